"""A Chrome trace of training steps, read: what the device ran, who launched it, and when.

Input is what ``torch.profiler`` writes (``export_chrome_trace``, or ``profiler.trace_events``).
Pure: dicts in, frozen dataclasses out; no GPU, nothing of fxoffload's. ``measure.kernel_times``
gives this work to the lines of Inductor's code.

*GPU events* are the trace's ``ph == "X"`` events of category ``kernel``, ``gpu_memset`` and
``gpu_memcpy`` (``ts``/``dur`` in microseconds, ``args.stream``, ``args.correlation``).

*Launches*: each GPU event's ``args.correlation`` names the ``cuda_runtime``/``cuda_driver`` call
that launched it (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaMemcpyAsync``, ...). The CPU
ops (``cpu_op``/``user_annotation``/``python_function``) enclosing that call on its thread, found by
time containment, say which op launched it.

*Graph calls*: Inductor wraps every run of a compiled graph in a ``## Call CompiledFxGraph <key> ##``
range; it is a forward when an enclosing op is ``CompiledFunction`` and a backward under
``CompiledFunctionBackward``. The direct children of that range, in time order, are what the lines
of ``call`` ran: a ``triton_*`` range per Triton launch (named after the kernel), ``aten::mm`` for
``extern_kernels.mm``, ``fxoffload::offload`` for our copy, ``aten::slice``/``aten::view``/
``aten::sum`` for a ``workspace[...].view(...).sum(dim=0)`` line, ...

*Steps* (``find_steps``): ``ProfilerStep#N`` ranges where the trace has them; else each forward
graph call starts a step that runs to the next one (the loss, the backward call and
``AccumulateGrad`` after it are in it); a trace without CPU ops is cut where a given sequence of
kernel names recurs on the compute stream.

Times compare GPU events with GPU events only (overlap, idle gaps); launch times on the host clock
place events in steps, and say how far the host ran ahead of the device (``host_bound_share``: the
profiler puts both clocks on one time line).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gzip
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "GPU_CATEGORIES",
    "ChildOp",
    "CpuOp",
    "GpuEvent",
    "GraphCall",
    "Step",
    "Trace",
    "compute_stream",
    "copy_stalls",
    "find_steps",
    "host_bound_share",
    "kernel_spans",
    "load_trace",
    "overlap_share",
    "overlap_us",
]

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
_CPU_CATS = ("cpu_op", "user_annotation", "python_function")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_CALL = "## Call CompiledFxGraph"
_STEP = re.compile(r"ProfilerStep#(\d+)")


@dataclasses.dataclass(frozen=True)
class GpuEvent:
    """One kernel, memset or memcpy as the device ran it (times in microseconds, trace clock)."""

    name: str
    cat: str  # "kernel", "gpu_memset" or "gpu_memcpy"
    start_us: float
    dur_us: float
    stream: int
    correlation: int  # -1: none in the trace
    nbytes: int = 0  # memcpy/memset: bytes moved

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us

    @property
    def ms(self) -> float:
        return self.dur_us / 1e3

    @property
    def direction(self) -> str:
        """``"DtoH"``, ``"HtoD"``, ``"DtoD"`` ... for a memcpy (from its name), else ``""``."""
        m = re.search(r"Memcpy (\w+)", self.name) if self.cat == "gpu_memcpy" else None
        return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class CpuOp:
    """An op, annotation or runtime call on a host thread, placed in its thread's tree of ops."""

    name: str
    cat: str
    tid: Any  # (pid, tid)
    start_us: float
    end_us: float
    parent: int  # index into Trace.ops, -1 at the top


@dataclasses.dataclass(frozen=True)
class ChildOp:
    """An op the graph's ``call`` ran directly, with the GPU work launched inside it."""

    name: str
    start_us: float
    events: tuple[GpuEvent, ...]


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One run of a compiled graph: the ``## Call CompiledFxGraph`` range of the trace."""

    name: str
    phase: str  # "forward", "backward", "" (unknown)
    start_us: float
    end_us: float
    children: tuple[ChildOp, ...]

    @property
    def events(self) -> tuple[GpuEvent, ...]:
        return tuple(sorted((g for c in self.children for g in c.events), key=lambda g: g.start_us))


class Trace:
    """A parsed Chrome trace: GPU events, CPU ops (as a forest per thread) and launches."""

    def __init__(self, data: Mapping[str, Any] | Sequence[Mapping[str, Any]]):
        events = data.get("traceEvents", []) if isinstance(data, Mapping) else data
        gpu, cpu = [], []
        for e in events:
            if e.get("ph") != "X":
                continue
            cat = e.get("cat")
            if cat in GPU_CATEGORIES:
                args = e.get("args", {})
                gpu.append(GpuEvent(
                    e["name"], cat, float(e["ts"]), float(e.get("dur", 0.0)), int(args.get("stream", -1)),
                    int(args.get("correlation", -1)), int(args.get("bytes", 0) or 0),
                ))  # fmt: skip
            elif cat in _CPU_CATS or cat in _LAUNCH_CATS:
                cpu.append(e)
        self.gpu: tuple[GpuEvent, ...] = tuple(sorted(gpu, key=lambda g: (g.start_us, g.end_us)))
        self.ops, self._launch = _op_forest(cpu)
        self._children: dict[int, list[int]] = collections.defaultdict(list)
        for i, op in enumerate(self.ops):
            self._children[op.parent].append(i)

    @property
    def has_cpu_ops(self) -> bool:
        return bool(self._launch)

    def launch_of(self, event: GpuEvent) -> int:
        """Index in ``ops`` of the runtime/driver call that launched ``event``; -1: not in the trace."""
        return self._launch.get(event.correlation, -1)

    def launch_time(self, event: GpuEvent) -> float:
        """When the host launched ``event`` (the launch call's start), else when it ran."""
        i = self.launch_of(event)
        return self.ops[i].start_us if i >= 0 else event.start_us

    def ancestors(self, i: int) -> list[int]:
        """``i`` and the ops enclosing it, innermost first."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.ops[i].parent
        return out

    def graph_calls(self) -> list[GraphCall]:
        """Every run of a compiled graph in the trace, in time order, with the GPU work it launched."""
        calls = [i for i, op in enumerate(self.ops) if op.name.startswith(_CALL)]
        where = {c: k for k, c in enumerate(calls)}
        launched: list[dict[int, list[GpuEvent]]] = [collections.defaultdict(list) for _ in calls]
        for g in self.gpu:
            chain = self.ancestors(self.launch_of(g))
            for depth, i in enumerate(chain):
                if i in where:  # chain[depth - 1] is the child of the graph call that launched g
                    launched[where[i]][chain[depth - 1] if depth else i].append(g)
                    break
        out = [self._graph_call(c, launched[k]) for k, c in enumerate(calls)]
        return sorted(out, key=lambda c: c.start_us)

    def _graph_call(self, c: int, launched: Mapping[int, list[GpuEvent]]) -> GraphCall:
        names = {self.ops[i].name for i in self.ancestors(c)}
        phase = (
            "backward"
            if "CompiledFunctionBackward" in names
            else "forward"
            if "CompiledFunction" in names
            else ""
        )
        children = []
        for i in self._children[c]:
            child = self.ops[i]
            events = tuple(launched.get(i, ()))
            name = child.name
            if child.cat in _LAUNCH_CATS:  # launched with no op of its own: name it by its kernel
                if not events:
                    continue
                name = events[0].name
            children.append(ChildOp(name, child.start_us, events))
        op = self.ops[c]
        return GraphCall(op.name, phase, op.start_us, op.end_us, tuple(children))


def _op_forest(cpu: Iterable[Mapping[str, Any]]) -> tuple[tuple[CpuOp, ...], dict[int, int]]:
    """The CPU ops as one forest per thread (a stack pass over the ops sorted by start, longest
    first), and correlation -> index of the launch call that has it."""
    by_tid: dict[Any, list[Mapping[str, Any]]] = collections.defaultdict(list)
    for e in cpu:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    ops: list[CpuOp] = []
    launch: dict[int, int] = {}
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[int] = []
        for e in evs:
            start = float(e["ts"])
            end = start + float(e.get("dur", 0.0))
            while stack and ops[stack[-1]].end_us <= start:
                stack.pop()
            ops.append(CpuOp(e["name"], e["cat"], tid, start, end, stack[-1] if stack else -1))
            stack.append(len(ops) - 1)
            corr = e.get("args", {}).get("correlation")
            if e["cat"] in _LAUNCH_CATS and corr is not None:
                launch[int(corr)] = len(ops) - 1
    return tuple(ops), launch


def load_trace(source: str | os.PathLike | Mapping[str, Any] | Sequence[Mapping[str, Any]] | Trace) -> Trace:
    """A Chrome trace from a path (``.json`` or ``.json.gz``), its parsed JSON, its events, or a ``Trace``."""
    if isinstance(source, Trace):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            source = json.load(f)
    return Trace(source)


# ------------------------------------------------------------------------------------------ steps


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step of the trace and the GPU work launched in it."""

    index: int
    how: str  # "ProfilerStep#N", "graph calls" or "kernel pattern"
    start_us: float  # the step's range on the host clock (launch times)
    end_us: float
    forward: tuple[GraphCall, ...]  # graph calls in the step ("kernel pattern": none)
    backward: tuple[GraphCall, ...]
    events: tuple[GpuEvent, ...]  # every GPU event launched in the step, in device order

    @property
    def kernels(self) -> tuple[GpuEvent, ...]:
        return tuple(g for g in self.events if g.cat == "kernel")

    @property
    def kernel_ms(self) -> float:
        """Sum of the step's kernel durations (memsets and copies not included)."""
        return sum(g.dur_us for g in self.kernels) / 1e3


def find_steps(
    trace: Trace | str | os.PathLike | Mapping[str, Any], pattern: Sequence[str] = ()
) -> list[Step]:
    """The steps of ``trace``, in order.

    ``ProfilerStep#N`` ranges where there are any; else, one step from each forward graph call to
    the next (the last to the trace's end), so that the loss, the backward graph call and the
    autograd work after it (``AccumulateGrad``) are in it; else (a trace of GPU events only) one
    step from each place where the kernels named in ``pattern`` run in that order on the compute
    stream (other kernels may come between) to the next such place (``kernel_times.kernel_pattern``
    gives the Triton kernels of a step's code); no pattern, no steps.
    """
    trace = load_trace(trace)
    calls = trace.graph_calls()
    marks = sorted(
        (op.start_us, op.end_us, int(m.group(1))) for op in trace.ops if (m := _STEP.fullmatch(op.name))
    )
    ranges: list[tuple[float, float, str]] = []
    if marks:
        ranges = [(a, b, f"ProfilerStep#{n}") for a, b, n in marks]
    elif calls:
        fws = [c for c in calls if c.phase == "forward"]
        end = max([op.end_us for op in trace.ops] + [trace.launch_time(g) for g in trace.gpu])
        ranges = [(fw.start_us, fws[k + 1].start_us if k + 1 < len(fws) else end, "graph calls")
                  for k, fw in enumerate(fws)]  # fmt: skip
    if ranges:
        return [_step_in(trace, calls, n, r, last=n + 1 == len(ranges)) for n, r in enumerate(ranges)]
    return _steps_by_pattern(trace, pattern) if pattern else []


def _step_in(
    trace: Trace, calls: Sequence[GraphCall], n: int, span: tuple[float, float, str], last: bool
) -> Step:
    """Step ``n``: the graph calls and GPU work launched in ``span`` (the last step keeps what starts
    at its very end)."""
    a, b, how = span

    def within(t: float) -> bool:
        return a <= t < b or last and t == b

    inside = [c for c in calls if within(c.start_us)]
    events = tuple(g for g in trace.gpu if within(trace.launch_time(g)))
    forward = tuple(c for c in inside if c.phase == "forward")
    return Step(n, how, a, b, forward, tuple(c for c in inside if c.phase == "backward"), events)


def compute_stream(events: Iterable[GpuEvent]) -> int:
    """The stream that ran the most kernel time (-1: no kernels)."""
    busy: dict[int, float] = collections.Counter()
    for g in events:
        if g.cat == "kernel":
            busy[g.stream] += g.dur_us
    return max(busy, key=busy.get) if busy else -1


def _steps_by_pattern(trace: Trace, pattern: Sequence[str]) -> list[Step]:
    """Steps of a trace of GPU events only: ``pattern`` found in order on the compute stream; a step
    runs from the first kernel of a match to the start of the next match."""
    stream = compute_stream(trace.gpu)
    kernels = [g for g in trace.gpu if g.cat == "kernel" and g.stream == stream]
    names = [g.name for g in kernels]
    starts = []
    i = 0
    while True:
        start = i = next((j for j in range(i, len(names)) if names[j] == pattern[0]), len(names))
        for n in pattern:
            while i < len(names) and names[i] != n:
                i += 1
            i += 1
        if i > len(names):
            break
        starts.append(start)
    steps = []
    for n, s in enumerate(starts):
        a = kernels[s].start_us
        b = kernels[starts[n + 1]].start_us if n + 1 < len(starts) else float("inf")
        events = tuple(g for g in trace.gpu if a <= g.start_us < b)
        end = max((g.end_us for g in events), default=a)
        steps.append(Step(n, "kernel pattern", a, end, (), (), events))
    return steps


# ------------------------------------------------------------------------------------------ overlap


def kernel_spans(events: Iterable[GpuEvent]) -> list[tuple[float, float]]:
    """The union of the kernels' run times among ``events``: disjoint ``(start_us, end_us)``, sorted."""
    spans = sorted((g.start_us, g.end_us) for g in events if g.cat == "kernel")
    out: list[list[float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_us(start_us: float, end_us: float, spans: Sequence[tuple[float, float]]) -> float:
    """How much of ``[start_us, end_us)`` the ``kernel_spans`` cover."""
    i = max(bisect.bisect_right(spans, (start_us, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(spans) and spans[i][0] < end_us:
        total += max(0.0, min(end_us, spans[i][1]) - max(start_us, spans[i][0]))
        i += 1
    return total


def overlap_share(events: Iterable[GpuEvent], direction: str) -> tuple[float, float, float]:
    """Copies of ``direction`` ("DtoH"/"HtoD") among ``events``: (their time ms, the part of it a
    kernel ran during ms, that part's share)."""
    events = list(events)
    spans = kernel_spans(events)
    copies = [g for g in events if g.direction == direction]
    total = sum(g.dur_us for g in copies)
    over = sum(overlap_us(g.start_us, g.end_us, spans) for g in copies)
    return total / 1e3, over / 1e3, (over / total if total else 0.0)


def copy_stalls(events: Iterable[GpuEvent], within_us: float = 15.0, min_gap_us: float = 15.0) -> dict[str, float]:
    """Milliseconds the compute stream stood idle waiting for copies, by direction ("DtoH"/"HtoD"):
    each gap of ``min_gap_us`` or more between two of its kernels that ends within ``within_us`` of
    a copy's end (the wait's event fired, the next kernel ran) counts for that copy's direction.
    What the watch's events measure at each wait (``runtime.timing``), read from the device's trace."""
    events = list(events)
    stream = compute_stream(events)
    kernels = sorted((g for g in events if g.cat == "kernel" and g.stream == stream), key=lambda g: g.start_us)
    ends = sorted((g.end_us, g.direction) for g in events if g.direction in ("DtoH", "HtoD"))
    stalls = {"DtoH": 0.0, "HtoD": 0.0}
    for a, b in zip(kernels, kernels[1:]):
        gap = b.start_us - a.end_us
        if gap < min_gap_us:
            continue
        i = bisect.bisect_right(ends, (b.start_us, "~")) - 1  # the last copy to end before b starts
        if i >= 0 and b.start_us - ends[i][0] <= within_us and ends[i][0] > a.end_us:
            stalls[ends[i][1]] += gap / 1e3
    return stalls


def host_bound_share(trace: Trace, events: Iterable[GpuEvent] | None = None, within_us: float = 50.0) -> float:
    """The share of the compute stream's kernels among ``events`` (the trace's) that started within
    ``within_us`` of their launch: the device was waiting on its host to issue them. A host ahead of
    the device has milliseconds of kernels queued; a host-bound phase (gpt2-medium's forward on an
    H100: a kernel every 31 us from Inductor's wrapper, each starting about 10 us after its launch)
    has none, and every microsecond of host work in it, an op call's included, is step time."""
    events = list(trace.gpu if events is None else events)
    stream = compute_stream(events)
    kernels = [g for g in events if g.cat == "kernel" and g.stream == stream and trace.launch_of(g) >= 0]
    waiting = sum(g.start_us - trace.launch_time(g) <= within_us for g in kernels)
    return waiting / len(kernels) if kernels else 0.0
