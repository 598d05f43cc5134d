"""Cost model: how long each node computes and how long each copy takes. Pure, reads graphs.

Compute time of a node is the larger of its FLOPs at the device's rate (torch's own FLOP formulas,
``torch.utils.flop_counter``, called on the fake values' shapes, so nothing runs) and the bytes it
reads and writes at the device's memory bandwidth, plus a launch overhead. Views, getitems and the
transfer ops themselves cost nothing. Fusion is not modelled: a chain of pointwise ops that Inductor
fuses into one kernel is charged for every intermediate, so compute windows are over-, not under-
estimated for memory-bound code and the planner stays on the safe side for matmul-bound code.

Host link bandwidth is per direction: the ``bandwidth`` option, else a measurement (a 256 MiB
pinned copy each way, once per device and process), else a conservative default.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        for field in ("flops", "memory_bandwidth", "d2h", "h2d"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"fxoffload: device rate {field} must be a positive number, got {value!r}")


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
CPU_RATES = DeviceRates("cpu", flops=1e11, memory_bandwidth=2e10, d2h=1e10, h2d=1e10, launch=2e-6)

# float32 matmuls without TF32 run on the CUDA cores: a fraction of the half-precision rate.
_DTYPE_FACTOR = {torch.float32: 0.1, torch.float64: 0.02}

_measured_links: dict[str, tuple[float, float]] = {}


def measure_link(device: torch.device, nbytes: int = 256 << 20) -> tuple[float, float]:
    """Host link bytes/s (d2h, h2d) of ``device``, timed with pinned memory, cached per device."""
    key = str(device)
    if key not in _measured_links:
        with real_tensors():
            _measured_links[key] = _time_link(device, nbytes)
        log.info(
            "fxoffload: measured host link of %s: d2h %.1f GB/s, h2d %.1f GB/s",
            key, _measured_links[key][0] / 1e9, _measured_links[key][1] / 1e9,
        )  # fmt: skip
    return _measured_links[key]


def _time_link(device: torch.device, nbytes: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(3 * nbytes / (start.elapsed_time(end) / 1e3))
    return rates[0], rates[1]


def device_rates(device: torch.device, overrides: Mapping[str, Any] | None = None, measure: bool = True) -> DeviceRates:
    """The rates for ``device``: known figures for the GPU model, a measured link, then ``overrides``."""
    overrides = dict(overrides or {})
    if device.type == "cpu":
        base = CPU_RATES
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else device.type
        flops, membw = next((v for k, v in _KNOWN_GPUS.items() if k in name), _DEFAULT_GPU)
        d2h = h2d = _DEFAULT_LINK
        if measure and "d2h" not in overrides and device.type == "cuda" and torch.cuda.is_available():
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


def calibrate(gm: fx.GraphModule, device: torch.device, repeats: int = 3) -> dict[fx.Node, float]:
    """Measured seconds of every compute node of ``gm`` that can be run on its own on ``device``.

    Each distinct op and argument signature runs once to warm up, then ``repeats`` times; the median
    counts (CUDA events on a GPU, the wall clock on a CPU). Inputs are random values of the traced
    shapes, strides and dtypes (zeros for integer tensors, which index safely). A node that fails to
    run alone is left out, and the model prices it.
    """
    out: dict[fx.Node, float] = {}
    # Random inputs from a forked generator: calibrating leaves the caller's random state alone.
    with real_tensors(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for node in gm.graph.nodes:
            if not is_compute(node):
                continue  # placeholders, views, getitems, our transfers: free
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


def _real(val: Any, device: torch.device) -> Any:
    if isinstance(val, torch.Tensor):
        shape = [size_hint(s) for s in val.shape]
        stride = [size_hint(s) for s in val.stride()]
        t = torch.empty_strided(shape, stride, dtype=val.dtype, device=device)
        return t.normal_() if val.dtype.is_floating_point or val.dtype.is_complex else t.zero_()
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
