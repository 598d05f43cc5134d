"""Cost model: how long each node computes and how long each copy takes. Pure, reads graphs.

Compute time of a node is the larger of its FLOPs at the device's rate (torch's own FLOP formulas,
``torch.utils.flop_counter``, called on the fake values' shapes, so nothing runs) and the bytes it
reads and writes at the device's memory bandwidth, plus a launch overhead. Views, getitems and the
transfer ops themselves cost nothing. Fusion is not modelled: a chain of pointwise ops that Inductor
fuses into one kernel is charged for every intermediate, so a window of memory-bound code is
over-estimated, which is the unsafe direction (a copy predicted hidden behind it may not be).

On a CPU (``offload_cpu=True``) the figures are fixed and at the fast end on purpose (``CPU_RATES``):
predicted windows come out short rather than long, so what policy="auto" calls hidden is. A
measured probe was tried and dropped: with two OpenMP threads on two shared cores, an add that takes
0.06 ms alone took 16 ms whenever another process held a core (docs/results.md, "Overlap"), and a
plan priced from that hides nothing.

Host link bandwidth is per direction: the ``bandwidth`` option, else a measurement (a small pinned
copy each way on the graph's own device, once per device and process, only when a plan needs it), else
a conservative default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from ._compat import real_tensors, size_hint
from .lifetimes import _tensor_bytes, is_compute

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """Throughputs of one device, in units per second."""

    name: str
    flops: float  # achieved dense half-precision FLOP/s (fp32 matmuls run at a fraction of it)
    memory_bandwidth: float  # device memory bytes/s
    d2h: float  # host link, device to host, bytes/s
    h2d: float  # host link, host to device, bytes/s
    launch: float = 5e-6  # seconds per kernel launch
    # Slack a copy must leave to be called hidden: it must fit its window at (1 + copy_margin) times
    # its predicted time, and its wait goes where that longer copy would be done. For the noise the
    # model does not see: on a CPU, other processes, OpenMP threads and the copy threads share cores.
    copy_margin: float = 0.0

    def __post_init__(self) -> None:
        for field in ("flops", "memory_bandwidth", "d2h", "h2d"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"fxoffload: device rate {field} must be a positive number, got {value!r}")
        margin = self.copy_margin
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin < float("inf"):
            raise ValueError(f"fxoffload: device rate copy_margin must be a number >= 0, got {margin!r}")


# Achieved (not datasheet) rates; the host link figures are placeholders replaced by a measurement.
_KNOWN_GPUS = {
    "H200": (650e12, 4.0e12),
    "H100": (600e12, 2.8e12),
    "A100": (250e12, 1.6e12),
    "L40S": (250e12, 0.7e12),
    "A10": (100e12, 0.5e12),
}
_DEFAULT_GPU = (100e12, 0.8e12)
_DEFAULT_LINK = 20e9  # PCIe Gen4-class, per direction, when nothing was measured
# A CPU. ``flops`` is the half-precision figure like a GPU's, so float32 runs at 1e11 FLOP/s (what
# two x86 cores reach; with flops=1e11 float32 matmuls were priced at 1e10, 4-5x slower than measured).
# Kernel overheads (Inductor's wrapper, OpenMP fork and join) are left out: compute is under-estimated.
CPU_RATES = DeviceRates("cpu", flops=1e12, memory_bandwidth=2e10, d2h=1e10, h2d=1e10, launch=2e-6)

# float32 matmuls without TF32 run on the CUDA cores: a fraction of the half-precision rate.
_DTYPE_FACTOR = {torch.float32: 0.1, torch.float64: 0.02}

_measured_links: dict[str, tuple[float, float]] = {}

# The link probe copies this many bytes each way. Small on purpose: its device buffer is counted in
# the caller's allocated-memory statistics while it lives (``max_memory_allocated`` is the user's and
# is never reset here), and once freed the caching allocator keeps the block reserved for later
# allocations (``empty_cache`` would release the user's cached blocks too, so it is not called;
# ``caching_allocator_alloc`` goes through the same allocator and statistics). 32 MiB copies already
# run at the link's full rate; the best of a few repeats filters out noise.
LINK_PROBE_BYTES = 32 << 20
LINK_PROBE_REPEATS = 5


def _cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` means the current device (the only reading there is)."""
    if device.index is not None:
        return device
    return torch.device(device.type, torch.cuda.current_device())


def measure_link(device: torch.device, nbytes: int = LINK_PROBE_BYTES) -> tuple[float, float]:
    """Host link bytes/s (d2h, h2d) of ``device``, timed with pinned memory, cached per device.

    Runs on ``device`` itself (its index, not the current device), with ``nbytes`` of device and of
    pinned host memory that are freed before it returns.
    """
    device = _cuda_device(device)
    key = str(device)
    if key not in _measured_links:
        try:
            with real_tensors(), torch.cuda.device(device):
                _measured_links[key] = _time_link(device, nbytes)
        except RuntimeError as e:  # out of device or pinned memory: plan with the default figure
            log.warning("fxoffload: could not measure the host link of %s (%s); assuming %.0f GB/s", key, e,
                        _DEFAULT_LINK / 1e9)  # fmt: skip
            _measured_links[key] = (_DEFAULT_LINK, _DEFAULT_LINK)
        else:
            log.info(
                "fxoffload: measured host link of %s: d2h %.1f GB/s, h2d %.1f GB/s",
                key, _measured_links[key][0] / 1e9, _measured_links[key][1] / 1e9,
            )  # fmt: skip
    return _measured_links[key]


def _time_link(device: torch.device, nbytes: int, repeats: int = LINK_PROBE_REPEATS) -> tuple[float, float]:
    """Best of ``repeats`` single copies each way. The copies run on a stream of our own on
    ``device``, so no work queued on the user's streams is timed; the caller selected ``device``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # ``dev`` was allocated on the current stream
        rates = []
        with torch.cuda.stream(stream):
            for dst, src in ((host, dev), (dev, host)):
                dst.copy_(src, non_blocking=True)  # warm-up
                best = float("inf")
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    end.record(stream)
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) / 1e3)
                rates.append(nbytes / max(best, 1e-9))
        stream.synchronize()  # nothing reads or writes the buffers any more when they are freed
    finally:
        del host, dev  # back to the caching allocators (the device block stays reserved, see above)
    return rates[0], rates[1]


def device_rates(device: torch.device, overrides: Mapping[str, Any] | None = None, measure: bool = True) -> DeviceRates:
    """The rates for ``device``: known figures for the GPU model, a measured link, then ``overrides``.

    The link is measured only with ``measure`` (the caller passes False when nothing will be
    offloaded), on a CUDA ``device``, and only for the directions ``overrides`` does not set.
    """
    overrides = dict(overrides or {})
    if device.type == "cpu":
        base = CPU_RATES
    else:
        cuda = device.type == "cuda" and torch.cuda.is_available()
        if cuda:
            device = _cuda_device(device)
        name = torch.cuda.get_device_name(device) if cuda else device.type
        flops, membw = next((v for k, v in _KNOWN_GPUS.items() if k in name), _DEFAULT_GPU)
        d2h = h2d = _DEFAULT_LINK
        if measure and cuda and not {"d2h", "h2d"} <= overrides.keys():
            d2h, h2d = measure_link(device)
        base = DeviceRates(name, flops, membw, d2h, h2d)
    return dataclasses.replace(base, **overrides)


def _flops(node: fx.Node) -> int | None:
    from torch.utils.flop_counter import flop_registry

    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
    kwargs = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
    try:
        return size_hint(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # a formula that does not accept these arguments: fall back to bytes
        log.debug("fxoffload: no FLOP count for %s", node.format_node())
        return None


def _io_bytes(node: fx.Node) -> int:
    total = 0
    for n in (*node.all_input_nodes, node):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            total += _tensor_bytes(val)
        elif isinstance(val, (tuple, list)):
            total += sum(_tensor_bytes(v) for v in val if isinstance(v, torch.Tensor))
    return total


def node_time(node: fx.Node, rates: DeviceRates) -> float:
    """Predicted seconds of compute for one node (0 for placeholders, views and our transfers)."""
    if not is_compute(node):
        return 0.0
    memory = _io_bytes(node) / rates.memory_bandwidth
    flops = _flops(node)
    if flops:
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.bfloat16
        memory = max(memory, flops / (rates.flops * _DTYPE_FACTOR.get(dtype, 1.0)))
    return memory + rates.launch


def node_start_times(
    gm: fx.GraphModule, rates: DeviceRates, measured: Mapping[fx.Node, float] | None = None
) -> list[float]:
    """starts[i] = predicted time at which node i starts; starts[-1] = the end of the graph.

    ``measured`` (from ``calibrate``) replaces the model's time of the nodes it has.
    """
    measured = measured or {}
    starts = [0.0]
    for node in gm.graph.nodes:
        t = measured.get(node)
        starts.append(starts[-1] + (node_time(node, rates) if t is None else t))
    return starts


# Measured seconds per (op, argument signature, device), shared by every graph of the process.
_timed_ops: dict[tuple[Any, ...], float | None] = {}

# Calibration runs each op once on made-up inputs, on the user's device, inside the user's process.
# A CUDA device-side assert (an index out of range, a probability outside [0, 1]) is not an exception
# we could catch: it poisons the CUDA context, and every later CUDA call of the process fails. So the
# inputs are made valid for the value checks ops do on the device: floating tensors are uniform in
# [0, 1) (binary_cross_entropy's input and target, bernoulli's and binomial's probabilities, the
# random samples of fractional_max_pool), integer and bool tensors are zeros (an index valid in
# every non-empty dimension: embedding, gather, scatter, index_select, index_put, nll_loss's class
# targets, the indices of max_unpool and of the pooling backwards). What inputs like these cannot make
# valid is not run at all, and the model prices it:
#   - ops outside aten and prims: custom ops, user Triton kernels and higher-order ops run arbitrary
#     code on the values, and collectives issued by one rank alone would block or desynchronise the
#     process group;
#   - ops whose device code checks values that neither uniform inputs nor zeros satisfy (below);
#   - ops with an empty tensor argument: any index into an empty dimension is out of range (and an
#     empty op costs a launch, which the model charges).
# Random ops otherwise run: the inputs above are valid parameters, and the generator is forked.
_UNSAFE_TO_CALIBRATE = frozenset({
    "_assert_async",  # asserts its (made-up) input on the device
    "_functional_assert_async",
    "multinomial",  # each row of probabilities must have a positive sum
    "_ctc_loss",  # lengths and targets index each other
    "_ctc_loss_backward",
    "segment_reduce",  # lengths or offsets are checked against the data's size
    "_segment_reduce_backward",
})


def _calibratable(node: fx.Node) -> bool:
    """Whether ``node`` may run on made-up inputs (see ``_UNSAFE_TO_CALIBRATE``)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    name = target._schema.name.split("::")[-1]
    if name in _UNSAFE_TO_CALIBRATE or "assert" in name:
        return False
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if any(isinstance(v, torch.Tensor) and any(size_hint(s) == 0 for s in v.shape) for v in vals):
            return False
    return True


def calibrate(gm: fx.GraphModule, device: torch.device, repeats: int = 3) -> dict[fx.Node, float]:
    """Measured seconds of every compute node of ``gm`` that can be run on its own on ``device``.

    Each distinct op and argument signature runs once to warm up, then ``repeats`` times; the median
    counts (CUDA events on a GPU, the wall clock on a CPU). Inputs are made-up values of the traced
    shapes, strides and dtypes that pass the ops' device-side checks: uniform in [0, 1) for floating
    tensors, zeros for integer and bool tensors (see ``_UNSAFE_TO_CALIBRATE``). Ops those inputs
    cannot make safe, and nodes that fail to run alone, are left out, and the model prices them.
    """
    out: dict[fx.Node, float] = {}
    cuda = device.type == "cuda"
    if cuda:
        device = _cuda_device(device)
    # Random inputs from a forked generator: calibrating leaves the caller's random state alone.
    with (
        real_tensors(),
        torch.random.fork_rng(devices=[device] if cuda else []),
        torch.cuda.device(device) if cuda else contextlib.nullcontext(),
    ):
        for node in gm.graph.nodes:
            if not is_compute(node) or not _calibratable(node):
                continue  # free (placeholders, views, getitems, our transfers), or unsafe to run
            key = (node.target, _signature(node.args), _signature(node.kwargs), str(device))
            if key not in _timed_ops:
                _timed_ops[key] = _time_node(node, device, repeats)
            if _timed_ops[key] is not None:
                out[node] = _timed_ops[key]
    log.info("fxoffload: calibrated %d of the compute nodes of a %d-node graph on %s", len(out), len(gm.graph.nodes), device)
    return out


def _signature(args: Any) -> Any:
    def one(a: Any) -> Any:
        val = a.meta.get("val") if isinstance(a, fx.Node) else a
        if isinstance(val, torch.Tensor):
            return (tuple(size_hint(s) for s in val.shape), tuple(size_hint(s) for s in val.stride()), val.dtype)
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return repr(val.node.hint) if val.node.has_hint() else "?"
        return repr(val)

    return repr(fx.node.map_aggregate(args, one))


# uniform_ is implemented for these; other floating types (float8) are drawn in float32 and cast.
_UNIFORM_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _real(val: Any, device: torch.device) -> Any:
    if isinstance(val, torch.Tensor):
        shape = [size_hint(s) for s in val.shape]
        stride = [size_hint(s) for s in val.stride()]
        # The values fill the whole strided span, then the traced layout is laid over it: a layout
        # whose elements overlap (an expanded stride 0) cannot be written through, but can be read.
        span = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        if val.dtype.is_complex:
            base = torch.view_as_real(torch.empty(span, dtype=val.dtype, device=device)).uniform_()
            base = torch.view_as_complex(base)
        elif val.dtype.is_floating_point:
            draw = val.dtype if val.dtype in _UNIFORM_DTYPES else torch.float32
            base = torch.empty(span, dtype=draw, device=device).uniform_().to(val.dtype)
        else:  # integers index element 0 of any non-empty dimension; bools are all False
            base = torch.zeros(span, dtype=val.dtype, device=device)
        return base.as_strided(shape, stride)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size_hint(val) if isinstance(val, torch.SymInt) else type(val.node.hint)(val.node.hint)
    return val


def _time_node(node: fx.Node, device: torch.device, repeats: int) -> float | None:
    def arg(a: Any) -> Any:
        return _real(a.meta.get("val"), device) if isinstance(a, fx.Node) else a

    try:
        args = fx.node.map_aggregate(node.args, arg)
        kwargs = fx.node.map_aggregate(node.kwargs, arg)
        node.target(*args, **kwargs)  # warm-up (and the check that it runs alone)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                node.target(*args, **kwargs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                node.target(*args, **kwargs)
                times.append(time.perf_counter() - begin)
    except Exception as e:  # not runnable alone (data-dependent inputs, a custom op, ...)
        log.debug("fxoffload: cannot time %s alone (%s); using the model", node.format_node(), e)
        return None
    return sorted(times)[len(times) // 2]
