"""Cost model: how long each node computes and how long each copy takes. Pure, reads graphs.

Compute time of a node is the larger of its FLOPs at the device's rate (torch's own FLOP formulas,
``torch.utils.flop_counter``, called on the fake values' shapes, so nothing runs) and the bytes it
reads and writes at the device's memory bandwidth, plus a launch overhead. Views, getitems and the
transfer ops themselves cost nothing. On an accelerator under Inductor the copies' windows are
priced on the kernels Inductor writes, each charged once (``node_start_times(..., fusion)``). On a
CPU, and under ``aot_eager``, they are priced node by node: a chain of pointwise ops that Inductor
fuses into one kernel is charged for every intermediate, standing in for the kernel overheads a
CPU's rates leave out (``compiler.costs``), so a window of memory-bound code there may be
over-estimated, the unsafe direction (a copy predicted hidden behind it may not be); the first
steps' measurements correct it. What recomputation costs under Inductor is priced as Inductor
compiles it (``node_time(..., fusion)``): a recomputed pointwise chain runs inside the kernels that
read it.

On a CPU (``offload_cpu=True``) the figures are fixed and meant to be at the fast end (``CPU_RATES``):
predicted windows short rather than long, so that what policy="auto" calls hidden is. They are not
on every machine: on the 2-core development machine of 2026-11-28 (two threads) the copies' windows
ran 0.6-0.9x what the figures priced. A plan priced from built-in figures, here or on a GPU, keeps
``FIRST_GUESS_MARGIN`` for that until the first steps have measured the windows. A
measured probe was tried and dropped: with two OpenMP threads on two shared cores, an add that takes
0.06 ms alone took 16 ms whenever another process held a core (docs/results.md, "Overlap"), and a
plan priced from that hides nothing.

Host link bandwidth is per direction: the ``bandwidth`` option, else a measurement (a small pinned
copy each way on the graph's own device, once per device and process, only when a plan needs it), else
a conservative default.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from .._compat import size_hint
from ..sizes import tensor_bytes
from .fusion import Fusion
from .graph import is_compute

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
    # its predicted time, and its wait goes where that longer copy would be done. For the error the
    # model does not see: ``FIRST_GUESS_MARGIN`` where compute is priced from the built-in figures
    # and the first steps' measurements plan again (``auto``), the measured spread of the copies'
    # windows once they have (``planning.measured``); 0 where the user gave the rates, with
    # ``calibrate`` (compute timed on the device) and for plans never made again.
    copy_margin: float = 0.0
    # Seconds of the compute stream's time one offloaded tensor's op calls take (offload, reload and
    # their waits), stall apart: on a CPU the calls run on the compute thread; on an accelerator the
    # host issues them ahead of the device (0 until the first steps measure otherwise).
    op_time: float = 0.0
    # And per byte of the tensor, on top of ``op_time``: on a CPU the copy engine poisons each copy's
    # destination at its issue and publishes the copied bytes into it at its wait, on the compute
    # thread (``measure.op_time.measure_op_rates``); 0 on an accelerator, and where the user gives ``op_time``.
    op_byte_time: float = 0.0

    def __post_init__(self) -> None:
        for field in ("flops", "memory_bandwidth", "d2h", "h2d"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"fxoffload: device rate {field} must be a positive number, got {value!r}")
        for field in ("copy_margin", "op_time", "op_byte_time"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ValueError(f"fxoffload: device rate {field} must be a number >= 0, got {value!r}")

    def op_cost(self, nbytes: int) -> float:
        """Seconds of the compute stream's time the op calls of one offloaded tensor of ``nbytes`` take."""
        return self.op_time + self.op_byte_time * nbytes


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

# The copy margin of a plan priced from the figures above, before anything was measured. A copy that
# fills its predicted window stalls wherever the device computes faster than the model says, and on a
# link shared first in, first out the copies queued behind it stall too: auto's first plans on an H100
# stalled 64 ms (gpt2-medium) and 43 ms (Llama-7B blocks) a step where the device ran the forward at
# 0.91-0.92x and the backward at 0.61-0.78x the model's time (``tests/data/h100-2026-11-26``), and on
# the CPU a plan from a model 1.6x slow stalled 24 ms of a 71 ms step (docs/results.md). Copies counted
# 1.6x longer fit a device up to that much faster than its model.
FIRST_GUESS_MARGIN = 0.6

# float32 matmuls without TF32 run on the CUDA cores: a fraction of the half-precision rate.
_DTYPE_FACTOR = {torch.float32: 0.1, torch.float64: 0.02}


def device_rates(
    device: torch.device, overrides: Mapping[str, Any] | None = None, link: tuple[float, float] | None = None
) -> DeviceRates:
    """The rates for ``device``: known figures for the GPU model, the measured ``link`` (d2h, h2d
    bytes/s; None: the default figure), then ``overrides``."""
    overrides = dict(overrides or {})
    if device.type == "cpu":
        base = CPU_RATES
    else:
        cuda = device.type == "cuda" and torch.cuda.is_available()
        if cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device) if cuda else device.type
        flops, membw = next((v for k, v in _KNOWN_GPUS.items() if k in name), _DEFAULT_GPU)
        d2h, h2d = link or (_DEFAULT_LINK, _DEFAULT_LINK)
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


def _io_bytes(node: fx.Node, fusion: Fusion | None = None) -> int:
    """Bytes ``node`` reads and writes; under Inductor (``fusion``) what its kernel loads: for an
    input computed inside it, the buffers that input's expression reads."""
    ins: set[fx.Node] = set(node.all_input_nodes)
    if fusion is not None:
        ins = set(fusion.reads[node]) if node in fusion.reads else ins
        ins = {r for i in ins for r in (fusion.reads.get(i) or (i,) if i in fusion.inlined else (i,))}
    total = 0
    for n in (*ins, node):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            total += tensor_bytes(val)
        elif isinstance(val, (tuple, list)):
            total += sum(tensor_bytes(v) for v in val if isinstance(v, torch.Tensor))
    return total


def node_time(node: fx.Node, rates: DeviceRates, fusion: Fusion | None = None) -> float:
    """Predicted seconds of compute for one node (0 for placeholders, views and our transfers).
    ``fusion``: the graph as Inductor compiles it (``fusion.inductor_fusion``): a node it computes
    inside the kernels that read it costs nothing of its own (they load what it reads, it writes
    nothing), a kernel loads the buffers its expression reads and writes once."""
    if not is_compute(node) or (fusion is not None and node in fusion.inlined):
        return 0.0
    memory = _io_bytes(node, fusion) / rates.memory_bandwidth
    flops = _flops(node)
    if flops:
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.bfloat16
        memory = max(memory, flops / (rates.flops * _DTYPE_FACTOR.get(dtype, 1.0)))
    return memory + rates.launch


def node_start_times(
    gm: fx.GraphModule,
    rates: DeviceRates,
    measured: Mapping[fx.Node, float] | None = None,
    fusion: Fusion | None = None,
) -> list[float]:
    """starts[i] = predicted time at which node i starts; starts[-1] = the end of the graph.

    ``measured`` (from ``calibrate``) replaces the model's time of the nodes it has. ``fusion``: the
    graph as Inductor compiles it, each kernel charged once (``node_time``). Priced node by node
    instead, gpt2-medium's bf16 forward and backward came to 34.7 and 75.7 ms at an H200's rates
    against 13.4 and 27.3 ms of kernels its trace measured; with the fusion, 17.9 and 32.9 ms
    (docs/results.md, 2026-11-30): within the first guess's copy margin (``FIRST_GUESS_MARGIN``).
    """
    measured = measured or {}
    starts = [0.0]
    for node in gm.graph.nodes:
        t = measured.get(node)
        starts.append(starts[-1] + (node_time(node, rates, fusion) if t is None else t))
    return starts
