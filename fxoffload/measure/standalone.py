"""Ops run alone on made-up inputs of their traced shapes: their time (``calibrate``) and the scratch
memory they allocate inside and free before they return (``op_temporaries``); and the calls of the
code Inductor generated, on the layouts that code gives them, for the replay of that code
(``call_temporaries``: Inductor runs convolutions channels-last, where oneDNN's scratch is not what
the FX graph's contiguous layouts measure).

Both run each distinct (op, argument signature, device) once per process, with inputs that pass
the ops' device-side checks (``_real``) and only for ops that are safe to run that way
(``_calibratable``).

Temporaries: the memory model (``analysis.memory.simulate``) counts a node's inputs and output while it runs. Some kernels
also allocate scratch memory of their own for the duration of the call, and no formula predicts it:
on a CPU ``native_dropout_backward`` casts its mask to the gradient's dtype (one more gradient-sized
buffer), ``native_dropout`` draws its mask in floating point, a convolution's backward reorders its
weights. Measured on a 2-layer GPT, the dropout backward's scratch alone was 0.5 MiB above a 2.3 MiB
prediction. So each distinct (op, argument signature, device; on a CPU also the thread count, which
changes oneDNN's algorithms) is run once on made-up inputs, and the bytes it allocated above what it
returned are its temporary; graphs of the process share the figures. Each runs once before it is
measured: a first call may build what later calls reuse (a library's workspace).

CPU: one ``torch.profiler`` session for all the ops of a graph pair: each op runs inside a
``record_function`` range, and the CPU allocator's events inside the range give its peak and what
was still allocated when it returned (its outputs). CUDA: the caching allocator's statistics around
each op; this resets the device's peak statistics, so it runs only with ``calibrate=True`` (which
runs every op on the device anyway). The inputs, and which ops are run at all, follow the
calibration's safety rules (``_calibratable``, ``_real``): an op that cannot run alone
counts no temporary. A graph compiled while a profiler runs is not measured (a nested session
crashes the process at its export): its prediction then lacks the scratch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

from .._compat import profiler_active, real_tensors, size_hint
from ..analysis.code_memory import ExternCall
from ..analysis.graph import is_compute
from .link import cuda_device
from .profiler import cpu_memory_events, cpu_memory_profile, trace_events

log = logging.getLogger(__name__)

__all__ = ["calibrate", "call_temporaries", "op_temporaries"]

_RANGE = "fxoffload_temporary_"
_WORD = re.compile(r"\b[A-Za-z_]\w*\b")
# What runs one op alone: it builds the inputs (outside the measured range) and returns (op, args, kwargs).
_Prepare = Callable[[], tuple[Callable[..., Any], Any, Any]]


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
# A fused attention's dropout state (its backward's philox seed and offset, flash's ``rng_state``):
# outside a CUDA graph the op reads the value through the tensor's pointer on the host, so a made-up
# one on the device is a segfault, which nothing can catch (in torch's efficient and flash attention
# backwards alike). Matched by the schema's argument name, so every attention backend's op is.
_READ_ON_THE_HOST = frozenset({"philox_seed", "philox_offset", "rng_state"})


def _calibratable(node: fx.Node) -> bool:
    """Whether ``node`` may run on made-up inputs (see ``_UNSAFE_TO_CALIBRATE``)."""
    if not isinstance(node.target, torch._ops.OpOverload) or not _safe(node.target):
        return False
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if any(isinstance(v, torch.Tensor) and any(size_hint(s) == 0 for s in v.shape) for v in vals):
            return False
    return True


def _safe(op: torch._ops.OpOverload) -> bool:
    """Whether made-up inputs may run ``op`` (see ``_UNSAFE_TO_CALIBRATE``), tensors of zero elements aside."""
    if op.namespace not in ("aten", "prims"):
        return False
    name = op._schema.name.split("::")[-1]
    if name in _UNSAFE_TO_CALIBRATE or "assert" in name:
        return False
    return not any(a.name in _READ_ON_THE_HOST for a in op._schema.arguments)


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
        device = cuda_device(device)
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


# Bytes above its outputs that one (op, signature, device, CPU threads) allocated while it ran; 0 when
# it could not run alone. Shared by every graph of the process, like the calibration's timings.
_measured: dict[tuple[Any, ...], int] = {}

def _key(node: fx.Node, device: torch.device) -> tuple[Any, ...]:
    # On a CPU the thread count is part of the op: oneDNN picks its convolution algorithm, and so its
    # scratch, per thread count (the CNN's convolution backwards measured at 8 threads put 1.6% more
    # on a steady step's peak run at 1 thread), and a process changes its thread count between graphs.
    return (node.target, _signature(node.args), _signature(node.kwargs), str(device), _threads(device))


def _threads(device: torch.device) -> int | None:
    return torch.get_num_threads() if device.type == "cpu" else None


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
        _measure({k: functools.partial(_inputs, n, device) for k, n in pending.items()}, device)
    out = {n: _measured[_key(n, device)] for n in nodes}
    return {n: b for n, b in out.items() if b > 0}


def call_temporaries(calls: Iterable[ExternCall], device: torch.device) -> dict[int, int]:
    """Scratch bytes of the fallback and extern kernel calls of one wrapper (``code_memory.extern_calls``),
    by line, measured running each alone on ``device`` on the layouts the code gives its operands
    (each distinct call once per process). A call that cannot run alone (another namespace, an op
    unsafe on made-up inputs, ``_calibratable``'s rules) is left out, as are calls without scratch."""
    calls = list(calls)
    keys = {c.line: _call_key(c, device) for c in calls}
    pending = {}
    for c in calls:
        if keys[c.line] not in _measured and keys[c.line] not in pending and (op := _runnable(c)) is not None:
            pending[keys[c.line]] = functools.partial(_call_inputs, c, op, device)
    if pending and device.type == "cpu" and profiler_active():
        log.debug("fxoffload: a profiler is running; %d calls' temporaries are not measured", len(pending))
        pending = {}
    if pending:
        _measure(pending, device)
    return {line: _measured[k] for line, k in keys.items() if _measured.get(k, 0) > 0}


def _measure(pending: Mapping[tuple[Any, ...], _Prepare], device: torch.device) -> None:
    with real_tensors(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        _measured.update(_on_cpu(pending) if device.type == "cpu" else _on_cuda(pending, device))
    log.debug("fxoffload: measured the temporaries of %d ops on %s", len(pending), device)


def _inputs(node: fx.Node, device: torch.device) -> tuple[Callable[..., Any], Any, Any]:
    def arg(a: Any) -> Any:
        return _real(a.meta.get("val"), device) if isinstance(a, fx.Node) else a

    return node.target, fx.node.map_aggregate(node.args, arg), fx.node.map_aggregate(node.kwargs, arg)


def _call_key(call: ExternCall, device: torch.device) -> tuple[Any, ...]:
    """A call's text with its operands numbered, their layouts, and the device and thread count (``_key``)."""
    names = list(call.operands)
    text = _WORD.sub(lambda m: f"<{names.index(m.group())}>" if m.group() in call.operands else m.group(), call.args)
    return (call.op, text, tuple(call.operands.values()), str(device), _threads(device))


def _runnable(call: ExternCall) -> Callable[..., Any] | None:
    """The op a call names, where made-up inputs may run it (``_calibratable``'s rules): an aten
    overload (``torch.ops.aten.x.default``), or an extern kernel with an aten namesake
    (``extern_kernels.mm`` is ``aten.mm``, with its ``out=``)."""
    if call.op.startswith("extern_kernels."):
        packet = getattr(torch.ops.aten, call.op.removeprefix("extern_kernels."), None)
        overload, op = getattr(packet, "default", None), packet
    elif call.op.startswith("torch.ops.aten.") and call.op.count(".") == 4:
        overload = op = getattr(getattr(torch.ops.aten, call.op.split(".")[3], None), call.op.split(".")[4], None)
    else:
        return None
    if not isinstance(overload, torch._ops.OpOverload) or not _safe(overload):
        return None
    if any(0 in size for size, _, _ in call.operands.values()):
        return None
    return op


def _call_inputs(call: ExternCall, op: Callable[..., Any], device: torch.device) -> tuple[Callable[..., Any], Any, Any]:
    def meta(layout: tuple[Any, ...]) -> torch.Tensor:
        return torch.empty_strided(layout[0], layout[1], dtype=layout[2], device="meta")

    scope = {name: _real(meta(layout), device) for name, layout in call.operands.items()}
    scope.update(__builtins__={}, torch=torch, reinterpret_tensor=torch.as_strided, _args=lambda *a, **k: (a, k))
    args, kwargs = eval(f"_args({call.args})", scope)  # noqa: S307 - Inductor's own call text, names bound above
    return op, args, kwargs


def _on_cpu(pending: Mapping[tuple[Any, ...], _Prepare]) -> dict[tuple[Any, ...], int]:
    from torch.profiler import record_function

    keys = list(pending)
    ran: set[int] = set()
    with cpu_memory_profile() as prof:
        for i, key in enumerate(keys):
            try:
                op, args, kwargs = pending[key]()
                op(*args, **kwargs)  # warm: a first call may build and cache what a step's calls reuse
                with record_function(f"{_RANGE}{i}"):
                    out = op(*args, **kwargs)
                del out, args, kwargs
                ran.add(i)
            except Exception as e:  # runs alone or not at all: the model counts no temporary then
                log.debug("fxoffload: %s did not run alone (%s): no temporary counted", key[0], e)
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


def _on_cuda(pending: Mapping[tuple[Any, ...], _Prepare], device: torch.device) -> dict[tuple[Any, ...], int]:
    out: dict[tuple[Any, ...], int] = {}
    with torch.cuda.device(device):
        for key, prepare in pending.items():
            try:
                op, args, kwargs = prepare()
                op(*args, **kwargs)  # warm: cuBLAS's workspace, a first call's caches (as on a CPU)
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                result = op(*args, **kwargs)
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - base
                end = torch.cuda.memory_allocated(device) - base
                del result
                out[key] = max(0, peak - end)
            except Exception as e:
                log.debug("fxoffload: %s did not run alone on %s (%s): no temporary counted", key[0], device, e)
                out[key] = 0
    return out
