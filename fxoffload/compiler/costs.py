"""What the planner is told about a pair: device rates, compute times, scratch memory, what code
before it holds, and the memory model before any change. Measurements and models meet here."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .. import _compat
from ..analysis import cost
from ..analysis.code_memory import extern_calls
from ..analysis.fusion import inductor_fusion
from ..analysis.lifetimes import GraphLifetimes
from ..analysis.memory import CodeFacts, kept_saved_bytes, simulate
from ..analysis.outside import OutsideMemory, graph_device, read_outside_memory
from ..measure.link import measure_link
from ..measure.op_time import measure_op_rates
from ..measure.standalone import calibrate, call_temporaries, op_temporaries
from ..options import OffloadOptions
from ..planning.decisions import PlanCosts
from ..runtime.host_pool import host_buffer_ranges

log = logging.getLogger(__name__)

__all__ = ["cost_device", "plan_costs", "read_outside"]


def plan_costs(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    lifetimes: GraphLifetimes,
    options: OffloadOptions,
    num_fwd_outputs: int,
    static: Sequence[int] = (),
    outside: OutsideMemory | None = None,
    probe: Callable[[torch.device], tuple[float, float] | None] = measure_link,
    code: CodeFacts | None = None,
) -> PlanCosts:
    """The cost model's view of a graph pair: device rates (the host link measured once per device
    where a plan needs it, and on a CPU the transfer ops' own time, ``measure_op_rates``), predicted
    node start times (ops timed on the device with ``calibrate``),
    the ops' measured temporaries and the predicted memory before any change (``baseline``), with
    what code before the pair holds (``outside``, for what this pair keeps) included. ``probe``
    measures a device's host link (None where it cannot: the model's default figure then).
    ``code``: what Inductor's code for the pair without offloading showed, where it was lowered
    (``PlanCosts.code``)."""
    device = cost_device(lifetimes)
    link_option = options.bandwidth or (options.cpu_link_bandwidth if device.type == "cpu" else None)
    overrides = dict(link_option or ()) | dict(options.compute_rates or ())
    wants_measure = options.policy != "none" and bool(lifetimes.saved)
    link = None
    if wants_measure and device.type != "cpu" and not {"d2h", "h2d"} <= overrides.keys():
        link = probe(device)
    rates = cost.device_rates(device, overrides, link)
    if not options.compute_rates and not options.calibrate and options.plans_from_measurements:
        # Compute priced from the built-in figures, until the first steps measure it and plan again: a
        # plan never made again (policy "all", fxoffload's own budget fit) is placed on the figures.
        rates = dataclasses.replace(rates, copy_margin=cost.FIRST_GUESS_MARGIN)
    if options.op_time is not None:
        rates = dataclasses.replace(rates, op_time=options.op_time, op_byte_time=0.0)
    elif wants_measure and device.type == "cpu" and options.offload_cpu:
        op_time, op_byte_time = measure_op_rates(device)
        rates = dataclasses.replace(rates, op_time=op_time, op_byte_time=op_byte_time)
    fw_times = bw_times = None
    if options.calibrate and wants_measure and (device.type != "cpu" or options.offload_cpu):
        fw_times, bw_times = calibrate(fw, device), calibrate(bw, device)
    # Scratch memory of the ops: on a CPU, cheap and harmless to measure; on a device it resets the
    # allocator's peak statistics, so only where calibrate runs ops there anyway.
    temporaries, scratch_on = {}, None
    if lifetimes.saved and (options.offload_cpu if device.type == "cpu" else options.calibrate and wants_measure):
        temporaries, scratch_on = op_temporaries((fw, bw), device), str(device)
    kept = kept_saved_bytes(fw, num_fwd_outputs, static)
    held, later = (outside.outside(kept), outside.outside_backward(kept)) if outside is not None else (0, 0)
    # Under Inductor, the graphs as it compiles them: fused, written in place (``analysis.fusion``).
    fusions = (inductor_fusion(fw), inductor_fusion(bw)) if options.fuses else None
    baseline = simulate(fw, bw, num_fwd_outputs, static, temporaries, held, later, options.fuses, code, fusions)
    # On an accelerator, windows priced on the kernels Inductor writes, each charged once
    # (``cost.node_start_times``). A CPU's rates leave out its kernels' overheads (Inductor's wrapper,
    # OpenMP's fork and join: ``cost.CPU_RATES``), which charging every node stands in for: the bench's
    # tiny GPT priced that way at 1.31x its Inductor step, fused at 0.66x (docs/results.md, 2026-11-30).
    fw_fusion, bw_fusion = fusions if fusions is not None and device.type != "cpu" else (None, None)
    return PlanCosts(
        rates,
        tuple(cost.node_start_times(fw, rates, fw_times, fw_fusion)),
        tuple(cost.node_start_times(bw, rates, bw_times, bw_fusion)),
        baseline,
        calibrated=len(fw_times or ()) + len(bw_times or ()),
        temporaries=temporaries,
        code=code,
        outside=held,
        calls=outside.calls if outside is not None else (),
        kept=kept,
        scratch_on=scratch_on,
    )


def cost_device(lifetimes: GraphLifetimes) -> torch.device:
    """The device whose rates price this graph: that of its saved accelerator tensors, with its index
    (a bare ``cuda`` would be whatever device is current when the graph compiles), else the first
    accelerator type among its tensors, else the CPU."""
    for t in lifetimes.saved:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    accelerators = [d for d in lifetimes.devices if d not in ("cpu", "meta")]
    return torch.device(accelerators[0]) if accelerators else torch.device("cpu")


def read_outside(example_inputs: Sequence[Any], mark: object | None = None) -> OutsideMemory | None:
    """``read_outside_memory`` of a graph's real example inputs (fxoffload's own host buffers left
    out); None where it cannot be read (a tensor subclass without storage, fake inputs, a torch that
    cannot read saved tensors): then nothing outside the graph is counted."""
    if not _compat.can_read_saved_tensors():
        log.info("fxoffload: this torch cannot read saved tensors without unpacking them; what code before "
                 "a graph holds is not counted")  # fmt: skip
        return None
    try:
        outside = read_outside_memory(example_inputs, graph_device(example_inputs), host_buffer_ranges(), mark=mark)
    except Exception as e:  # an estimate never fails a compile
        log.info("fxoffload: cannot read what code before this graph holds (%s); counting none", e)
        return None
    if not outside.complete:
        log.warning("fxoffload: %s", outside.summary())
    elif outside.held_bytes:
        log.info("fxoffload: %s", outside.summary())
    return outside


def code_scratch(code: str, costs: PlanCosts | None) -> tuple[tuple[int, int], ...]:
    """``(line, bytes)`` of the scratch the fallback and extern kernels of Inductor's wrapper ``code``
    allocate inside their calls, measured running each alone on the layouts the code gives it
    (``measure.standalone.call_temporaries``), where the pair's ops' scratch was measured
    (``PlanCosts.scratch_on``): Inductor lays a convolution's operands out channels-last, and oneDNN's
    scratch then is not what the FX graph's layouts measure. Empty elsewhere, and for code the reader
    does not know (symbolic sizes)."""
    if costs is None or costs.scratch_on is None:
        return ()
    try:
        calls = extern_calls(code)
    except ValueError as e:
        log.debug("fxoffload: the calls of the generated code are not measured: %s", e)
        return ()
    try:
        return tuple(sorted(call_temporaries(calls, torch.device(costs.scratch_on)).items()))
    except Exception as e:  # never fail a compile over a measurement: the replay lacks the scratch then
        log.warning("fxoffload: measuring the scratch of the generated code's calls failed (%s)", e)
        return ()
