"""Measured windows of fxoffload's copies and of every saved tensor, from one traced step.

The planner prices compute windows from a FLOP/bandwidth model; this module reads what the device
did instead. Inputs are a Chrome trace of a training step (``measure.trace``) and the wrapper code
Inductor generated for the forward and backward (``OffloadReport.output_code``, read through
``analysis.output_code``), whose lines ``measure.line_times`` gives the step's GPU work to. Pure:
text and dicts in, frozen dataclasses out; no GPU, no Inductor.

Each ``output_code.transfers()`` entry gets the memcpy its op launched (without CPU ops: the n-th
copy of its direction, the side stream being FIFO), the kernel time between it and its wait, its
window (an offload's forward kernel time after it, a reload's backward kernel time before the first
kernel line that reads it), how much of the copy a kernel overlapped and the compute stream's idle
time across its wait. ``saved_windows`` measures the windows of every saved tensor, offloaded or not.

Use::

    times = step_times("trace.json.gz", report["output_code"], step=0, report=report)
    times.forward.kernel_ms, times.backward.kernel_ms, times.step_kernel_ms
    times.forward.by_line()[i].kernel_ms          # line i of output_code.call_body(forward code)
    for c in times.copies:                        # one per output_code.transfers() entry
        c.name, c.copy_ms, c.compute_between_ms, c.window_ms, c.predicted_window_ms, c.hides
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..analysis.output_code import (
    Transfer,
    call_body,
    is_kernel,
    is_materialised_call,
    readers,
    returned_names,
    statements,
    transfers,
)
from ..ir import TransferTime, transfer_name
from .line_times import PhaseTimes, best_call, kernel_pattern, match_phase, split_phases
from .trace import GpuEvent, Step, Trace, find_steps, kernel_spans, load_trace, overlap_us

__all__ = ["CopyTime", "StepTimes", "saved_names", "saved_windows", "step_times"]


# ------------------------------------------------------------------------------------------ copies


@dataclasses.dataclass(frozen=True)
class CopyTime:
    """One fxoffload copy (``output_code.Transfer``) with what the device measured around it."""

    transfer: Transfer
    name: str  # the saved tensor it moves ("" if not known)
    memcpys: tuple[GpuEvent, ...]  # the device copies its op launched
    compute_between_ms: float  # kernel time of the lines between the copy and its wait
    window_ms: float  # offload: forward kernel time after the copy; reload: backward's before its first use
    overlap_ms: float  # part of the copy's own time during which a kernel ran
    gap_at_wait_us: tuple[float, float]  # compute stream idle across the wait line: (end of the last kernel
    # before it, start of the first after it); waits with no kernel between them share one gap
    predicted_copy_ms: float | None = None  # the report's d2h_ms / h2d_ms
    predicted_window_ms: float | None = None  # the report's fw_window_ms / bw_window_ms
    # How long the compute stream waited for this copy at its wait, as ``runtime.timing``'s events
    # measure it (``_with_stalls``).
    stall_ms: float = 0.0

    @property
    def kind(self) -> str:
        return self.transfer.kind

    @property
    def copy_ms(self) -> float:
        return sum(g.dur_us for g in self.memcpys) / 1e3

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.memcpys)

    @property
    def gap_at_wait_ms(self) -> float:
        a, b = self.gap_at_wait_us
        return max(0.0, b - a) / 1e3

    @property
    def hides(self) -> bool:
        """The simple rule: the copy takes no longer than the compute between its issue and its wait."""
        return bool(self.memcpys) and self.copy_ms <= self.compute_between_ms

    def transfer_time(self, graph_id: int) -> TransferTime:
        """This copy as the first steps measure it for the planner (``planning.measured``): the kernel
        time between its issue and its wait for a window, its memcpys' time, ``stall_ms``."""
        direction = "d2h" if self.kind == "offload" else "h2d"
        return TransferTime(
            transfer_name(graph_id, self.name), direction, self.nbytes, self.compute_between_ms / 1e3,
            self.copy_ms / 1e3, self.stall_ms / 1e3,
        )  # fmt: skip


def saved_names(fw_code: str, bw_code: str, host_copies: Iterable[Mapping[str, Any]] = ()) -> dict[str, str]:
    """``Transfer.key`` -> saved tensor name, from the rewritten FX graphs (``report.fw_code``/
    ``bw_code``): an offload's key is its output position, whose FX copy reads the saved tensor; a
    reload's is its host placeholder, named after the tensor in ``report.host_copies``."""
    names = {t.key: t.source for t in transfers(fw_code, kernel=is_materialised_call)}
    host = {c["host_name"]: c["name"] for c in host_copies}
    for t in transfers(bw_code, kernel=is_materialised_call):
        names[t.key] = host.get(t.source, t.source.removesuffix("_host"))
    return names


def _copy_times(
    code: str,
    phase: PhaseTimes,
    spans: Sequence[tuple[float, float]],
    names: Mapping[str, str],
    saved: Mapping[str, Mapping[str, Any]],
    memcpys_by_order: Sequence[GpuEvent] | None,
) -> list[CopyTime]:
    body = call_body(code)
    kernel_lines = [i for i, line in enumerate(body) if is_kernel(line)]
    by_line = phase.by_line()
    out = []
    for n, t in enumerate(transfers(code)):
        if memcpys_by_order is not None:  # no launches in the trace: the n-th copy of the direction
            mem = (memcpys_by_order[n],) if n < len(memcpys_by_order) else ()
        else:
            mem = by_line[t.copy_line].memcpys if t.copy_line in by_line else ()
        end = t.wait_line if t.wait_line >= 0 else len(body)
        if t.kind == "offload":
            window = phase.kernel_ms_after(t.copy_line)
        else:  # the kernels before the first one that reads the reloaded tensor
            before = sum(i < t.copy_line for i in kernel_lines) + max(t.kernels_before_use, 0)
            first_use = (
                kernel_lines[before] if t.kernels_before_use >= 0 and before < len(kernel_lines) else end
            )
            window = phase.kernel_ms_before(first_use)
        name = names.get(t.key, "")
        row = saved.get(name, {})
        over = sum(overlap_us(g.start_us, g.end_us, spans) for g in mem) / 1e3
        gap = _gap_at(phase, t.wait_line) if t.wait_line >= 0 else (0.0, 0.0)
        predicted = row.get("d2h_ms" if t.kind == "offload" else "h2d_ms")
        predicted_window = row.get("fw_window_ms" if t.kind == "offload" else "bw_window_ms")
        between = phase.kernel_ms_between(t.copy_line, end)
        out.append(CopyTime(t, name, tuple(mem), between, window, over, gap, predicted, predicted_window))
    return out


def _gap_at(phase: PhaseTimes, line: int) -> tuple[float, float]:
    """The compute stream's idle span across ``line``: from the end of the last kernel of the lines
    before it to the start of the first kernel of the lines after it (a stall there, plus launch gaps)."""
    before = [g.end_us for t in phase.lines if t.line < line for g in t.events if g.cat == "kernel"]
    after = [g.start_us for t in phase.lines if t.line > line for g in t.events if g.cat == "kernel"]
    if not before or not after:
        return (0.0, 0.0)
    return (max(before), max(max(before), min(after)))


def saved_windows(
    times: StepTimes, output_code: Mapping[str, str], fw_code: str, names: Mapping[str, str] | None = None
) -> dict[str, tuple[float, float]]:
    """Measured windows of every forward output the backward reads, offloaded or not:
    ``{saved name: (fw_ms, bw_ms)}``.

    ``fw_ms`` is the forward's kernel time after the last line of the forward ``call`` that gives
    the tensor's buffer (or an alias of it) to an op (``output_code.readers``), ``bw_ms`` the
    backward's kernel time before the first line that gives it to an op (the report's
    ``fw_window_ms``/``bw_window_ms``, measured). Positions in the FX return (``report.fw_code``)
    name the tensors; the wrapper's return at the same position names their buffers; the backward
    ``call`` takes them under their FX names. An offloaded tensor (``names``: ``saved_names``) is
    named for its row, and its windows are its copies' (``CopyTime.window_ms``: after the offload,
    before the first use of the reload).
    """
    fw, bw = output_code["forward"], output_code["backward"]
    fx, wrapper = returned_names(statements(fw_code)), returned_names(statements(fw))
    names = dict(names or {})
    offloads = {c.name: c.window_ms for c in times.copies if c.kind == "offload"}
    reloads = {c.name: c.window_ms for c in times.copies if c.kind == "reload"}
    out: dict[str, tuple[float, float]] = {}
    for pos, (fx_name, buf) in enumerate(zip(fx, wrapper)):
        if fx_name is None or buf is None:  # a constant: nothing saved
            continue
        name = names.get(f"output {pos}", fx_name)
        if name in offloads:  # the copy is issued after the last use; the wrapper returns the host copy
            fw_ms = offloads[name]
        else:
            touch = readers(fw, buf)
            fw_ms = times.forward.kernel_ms_after(touch[-1] if touch else -1)
        if name in reloads:
            bw_ms = reloads[name]
        else:
            first = readers(bw, fx_name)
            bw_ms = times.backward.kernel_ms_before(first[0] if first else times.backward.n_body_lines)
        out.setdefault(name, (fw_ms, bw_ms))
    return out


# ------------------------------------------------------------------------------------------ a step


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Measured times of one step: per line of both graphs, per copy, and the totals."""

    step: Step
    forward: PhaseTimes
    backward: PhaseTimes
    copies: tuple[CopyTime, ...]

    @property
    def step_kernel_ms(self) -> float:
        """All kernel time launched in the step (the graphs', the loss's, AccumulateGrad's ...)."""
        return self.step.kernel_ms

    @property
    def lines_kernel_ms(self) -> float:
        return self.forward.kernel_ms + self.backward.kernel_ms

    @property
    def outside_kernel_ms(self) -> float:
        """Kernel time of the step that no line of either graph accounts for."""
        return self.step_kernel_ms - self.lines_kernel_ms

    def overlap(self, direction: str) -> tuple[float, float, float]:
        """fxoffload's copies of one direction: (time ms, time a kernel overlapped ms, share)."""
        kind = {"DtoH": "offload", "HtoD": "reload"}[direction]
        mine = [c for c in self.copies if c.kind == kind]
        total = sum(c.copy_ms for c in mine)
        over = sum(c.overlap_ms for c in mine)
        return total, over, (over / total if total else 0.0)

    def wait_gaps_ms(self, kind: str) -> float:
        """Compute-stream idle time across the waits of ``kind``'s copies, each gap once."""
        spans = {c.gap_at_wait_us for c in self.copies if c.kind == kind}
        return sum(max(0.0, b - a) for a, b in spans) / 1e3

    def summary(self) -> dict[str, Any]:
        """The step's figures as plain data (ms)."""
        out: dict[str, Any] = {
            "step": self.step.index, "how": self.step.how, "method": self.forward.method,
            "step_kernel_ms": self.step_kernel_ms, "forward_kernel_ms": self.forward.kernel_ms,
            "backward_kernel_ms": self.backward.kernel_ms, "outside_kernel_ms": self.outside_kernel_ms,
            "forward_kernels": self.forward.n_kernels, "backward_kernels": self.backward.n_kernels,
            "unmatched_lines": len(self.forward.unmatched_lines) + len(self.backward.unmatched_lines),
            "unmatched_kernel_ms": self.forward.unmatched_kernel_ms + self.backward.unmatched_kernel_ms,
        }  # fmt: skip
        for d, kind in (("DtoH", "offload"), ("HtoD", "reload")):
            mine = [c for c in self.copies if c.kind == kind]
            total, over, share = self.overlap(d)
            out[d] = {
                "copies": len(mine), "bytes": sum(c.nbytes for c in mine), "ms": total, "overlapped_ms": over,
                "overlap_share": share, "hidden_by_rule": sum(c.hides for c in mine),
                "idle_at_waits_ms": self.wait_gaps_ms(kind),
            }  # fmt: skip
        return out


def step_times(
    trace: Trace | str | os.PathLike | Mapping[str, Any],
    output_code: Mapping[str, str],
    step: int = 0,
    report: Mapping[str, Any] | None = None,
) -> StepTimes:
    """Per-line kernel times and per-copy measured windows of step ``step`` of ``trace``.

    ``output_code`` is ``{"forward": ..., "backward": ...}`` (``OffloadReport.output_code``).
    ``report`` (optional, a report as ``save_reports`` writes it) names each copy's saved tensor
    and gives the old model's predictions next to the measurements.
    """
    trace = load_trace(trace)
    steps = find_steps(trace, kernel_pattern(output_code))
    if not steps:
        raise ValueError("no step found in the trace")
    s = steps[step]
    fw_code, bw_code = output_code["forward"], output_code["backward"]
    if s.forward and s.backward:
        fw = match_phase(fw_code, best_call(fw_code, s.forward))
        bw = match_phase(bw_code, best_call(bw_code, s.backward))
        fw_copies = bw_copies = None
    else:
        fw_events, bw_events = split_phases(s.events, output_code)
        fw = match_phase(fw_code, fw_events, "forward")
        bw = match_phase(bw_code, bw_events, "backward")
        fw_copies = [g for g in fw_events if g.direction == "DtoH"]
        bw_copies = [g for g in bw_events if g.direction == "HtoD"]
    names: dict[str, str] = {}
    saved: dict[str, Mapping[str, Any]] = {}
    if report is not None:
        names = saved_names(
            report.get("fw_code", ""), report.get("bw_code", ""), report.get("host_copies", ())
        )
        saved = {r["name"]: r for r in report.get("saved", ())}
    spans = kernel_spans(s.events)
    copies = _with_stalls(_copy_times(fw_code, fw, spans, names, saved, fw_copies))
    copies += _with_stalls(_copy_times(bw_code, bw, spans, names, saved, bw_copies))
    return StepTimes(s, fw, bw, tuple(copies))


def _with_stalls(copies: list[CopyTime]) -> list[CopyTime]:
    """Each copy's ``stall_ms``, as the events around its wait measure it: the wait starts when the
    compute stream gets there (the end of the last kernel before its line, or the end of the wait
    before it where no kernel ran between the two) and ends at the later of that and the copy's end,
    within the stream's idle span across the line. Waits sharing a span each count their own part."""
    resumed: dict[tuple[float, float], float] = {}  # by idle span: where the last wait in it ended
    stalls: dict[int, float] = {}
    for i in sorted(range(len(copies)), key=lambda i: copies[i].transfer.wait_line):
        c = copies[i]
        if not c.memcpys or c.transfer.wait_line < 0:
            continue
        span = c.gap_at_wait_us
        start = max(span[0], resumed.get(span, span[0]))
        end = max(start, min(max(g.end_us for g in c.memcpys), span[1]))
        resumed[span] = end
        stalls[i] = (end - start) / 1e3
    return [dataclasses.replace(c, stall_ms=stalls.get(i, 0.0)) for i, c in enumerate(copies)]
