"""Memory an op allocates inside and frees before it returns: measured, once per op and signature.

The memory model (``memory.simulate``) counts a node's inputs and output while it runs. Some kernels
also allocate scratch memory of their own for the duration of the call, and no formula predicts it:
on a CPU ``native_dropout_backward`` casts its mask to the gradient's dtype (one more gradient-sized
buffer), ``native_dropout`` draws its mask in floating point, a convolution's backward reorders its
weights. Measured on a 2-layer GPT, the dropout backward's scratch alone was 0.5 MiB above a 2.3 MiB
prediction. So each distinct (op, argument signature, device) is run once on made-up inputs, and the
bytes it allocated above what it returned are its temporary; graphs of the process share the figures.

CPU: one ``torch.profiler`` session for all the ops of a graph pair: each op runs inside a
``record_function`` range, and the CPU allocator's events inside the range give its peak and what
was still allocated when it returned (its outputs). CUDA: the caching allocator's statistics around
each op; this resets the device's peak statistics, so it runs only with ``calibrate=True`` (which
runs every op on the device anyway). The inputs, and which ops are run at all, follow the
calibration's safety rules (``cost._calibratable``, ``cost._real``): an op that cannot run alone
counts no temporary. A graph compiled while a profiler runs is not measured (a nested session
crashes the process at its export): its prediction then lacks the scratch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from ._compat import profiler_active
from .cost import _calibratable, _real, _signature, real_tensors
from .lifetimes import is_compute
from .measure import cpu_memory_events, trace_events

log = logging.getLogger(__name__)

__all__ = ["op_temporaries"]

# Bytes above its outputs that one (op, signature, device) allocated while it ran; 0 when it could
# not run alone. Shared by every graph of the process, like the calibration's timings.
_measured: dict[tuple[Any, ...], int] = {}

_RANGE = "fxoffload_temporary_"


def _key(node: fx.Node, device: torch.device) -> tuple[Any, ...]:
    return (node.target, _signature(node.args), _signature(node.kwargs), str(device))


def op_temporaries(graphs: Iterable[fx.GraphModule], device: torch.device) -> dict[fx.Node, int]:
    """Scratch bytes of every compute node of ``graphs`` that has any, measured on ``device`` (each
    distinct op and signature once per process). Nodes without a temporary are left out."""
    nodes = [n for gm in graphs for n in gm.graph.nodes if is_compute(n) and _calibratable(n)]
    pending: dict[tuple[Any, ...], fx.Node] = {}
    for n in nodes:
        key = _key(n, device)
        if key not in _measured and key not in pending:
            pending[key] = n
    if pending and device.type == "cpu" and profiler_active():
        # Compiled while a profiler runs (the user's, or a measured first step): a session of our own
        # inside it would crash the process at its export. Not measured now; a later compile will.
        log.debug("fxoffload: a profiler is running; %d ops' temporaries are not measured", len(pending))
        return {n: _measured[k] for n in nodes if (k := _key(n, device)) in _measured and _measured[k] > 0}
    if pending:
        with real_tensors(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            measured = _on_cpu(pending) if device.type == "cpu" else _on_cuda(pending, device)
        _measured.update(measured)
        log.debug("fxoffload: measured the temporaries of %d ops on %s", len(pending), device)
    out = {n: _measured[_key(n, device)] for n in nodes}
    return {n: b for n, b in out.items() if b > 0}


def _inputs(node: fx.Node, device: torch.device) -> tuple[Any, Any]:
    def arg(a: Any) -> Any:
        return _real(a.meta.get("val"), device) if isinstance(a, fx.Node) else a

    return fx.node.map_aggregate(node.args, arg), fx.node.map_aggregate(node.kwargs, arg)


def _on_cpu(pending: dict[tuple[Any, ...], fx.Node]) -> dict[tuple[Any, ...], int]:
    from torch.profiler import ProfilerActivity, profile, record_function

    cpu = torch.device("cpu")
    keys = list(pending)
    ran: set[int] = set()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, key in enumerate(keys):
            node = pending[key]
            try:
                args, kwargs = _inputs(node, cpu)
                with record_function(f"{_RANGE}{i}"):
                    out = node.target(*args, **kwargs)
                del out, args, kwargs
                ran.add(i)
            except Exception as e:  # runs alone or not at all: the model counts no temporary then
                log.debug("fxoffload: %s did not run alone (%s): no temporary counted", node.name, e)
    events = trace_events(prof)
    ranges = {
        int(e["name"][len(_RANGE):]): (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(_RANGE)
    }  # fmt: skip
    memory = cpu_memory_events(events)
    out: dict[tuple[Any, ...], int] = {}
    for i, key in enumerate(keys):
        if i not in ran or i not in ranges:
            out[key] = 0
            continue
        lo, hi = ranges[i]
        level = peak = 0
        for e in memory:
            if lo <= e["ts"] <= hi:
                level += int(e["args"]["Bytes"])
                peak = max(peak, level)
        out[key] = max(0, peak - max(level, 0))  # what it held above what it returned
    return out


def _on_cuda(pending: dict[tuple[Any, ...], fx.Node], device: torch.device) -> dict[tuple[Any, ...], int]:
    out: dict[tuple[Any, ...], int] = {}
    with torch.cuda.device(device):
        for key, node in pending.items():
            try:
                args, kwargs = _inputs(node, device)
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                result = node.target(*args, **kwargs)
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - base
                end = torch.cuda.memory_allocated(device) - base
                del result
                out[key] = max(0, peak - end)
            except Exception as e:
                log.debug("fxoffload: %s did not run alone on %s (%s): no temporary counted", node.name, device, e)
                out[key] = 0
    return out
