"""Measured GPU time per line of Inductor's wrapper code: a graph call's GPU work given to its lines.

The lines of ``call`` whose op can be named from the text (``output_code.op_name``: Triton launches,
``extern_kernels.*``, ``torch.ops.*``/``aten.*`` calls) are aligned with the graph call's child ops
(``trace.GraphCall``) by name (``difflib`` on the two sequences, which tolerates a missing or extra
op). GPU work of a child op that no named line claims (the ``aten::sum`` of a
``workspace[...].view(...).sum(dim=0)`` line) is given to the unnamed lines that may launch
something (``output_code.may_launch``) between the two aligned neighbours: one op to each in order
when the counts agree, all of it to the only such line, else left unmatched and reported
("correlation"). Without CPU ops the same is done on the compute stream's kernels alone: a Triton
line is the next kernel of its name, the other kernels between two Triton kernels go to the lines
between them by the same rule, or, where the counts differ, a matmul line taking one GEMM kernel
and another line the run of non-GEMM kernels up to the next GEMM ("order").
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence

from ..analysis.output_code import call_body, is_kernel, may_launch, op_name, triton_kernel
from .trace import GpuEvent, GraphCall, compute_stream

__all__ = ["LineTime", "PhaseTimes", "best_call", "kernel_pattern", "match_phase", "split_phases"]

_MATMULS = {f"aten::{op}" for op in ("mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm")}
# cuBLAS / CUTLASS kernel names, as the device reports them
_GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm\d+_.*_tn|ampere_|hopper_", re.IGNORECASE)


def kernel_pattern(output_code: Mapping[str, str]) -> list[str]:
    """The Triton kernels one step launches, in order: the forward code's, then the backward's (what
    ``trace.find_steps`` cuts a trace of GPU events only by)."""
    codes = (output_code["forward"], output_code.get("backward", ""))
    return [k for code in codes for line in call_body(code) if (k := triton_kernel(line))]


# ------------------------------------------------------------------------------------------ lines


@dataclasses.dataclass(frozen=True)
class LineTime:
    """The GPU work one line of ``call`` launched, as measured."""

    line: int  # index into ``output_code.call_body(code)``
    text: str
    op: str  # the op name it was matched by ("" for a line matched by position)
    events: tuple[GpuEvent, ...]

    @property
    def kernel_ms(self) -> float:
        return sum(g.dur_us for g in self.events if g.cat == "kernel") / 1e3

    @property
    def memset_ms(self) -> float:
        return sum(g.dur_us for g in self.events if g.cat == "gpu_memset") / 1e3

    @property
    def n_kernels(self) -> int:
        return sum(g.cat == "kernel" for g in self.events)

    @property
    def memcpys(self) -> tuple[GpuEvent, ...]:
        return tuple(g for g in self.events if g.cat == "gpu_memcpy")


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Measured GPU time of every line of one graph's ``call`` (forward or backward)."""

    phase: str
    method: str  # "correlation" (launches and CPU ops) or "order" (kernel names and order only)
    lines: tuple[LineTime, ...]  # lines that launched GPU work, in code order
    unmatched_lines: tuple[int, ...]  # kernel lines (``output_code.is_kernel``) no kernel was found for
    unmatched_events: tuple[GpuEvent, ...]  # GPU work of the call that no line could be given
    n_body_lines: int

    @property
    def kernel_ms(self) -> float:
        """Kernel time given to lines."""
        return sum(t.kernel_ms for t in self.lines)

    @property
    def unmatched_kernel_ms(self) -> float:
        return sum(g.dur_us for g in self.unmatched_events if g.cat == "kernel") / 1e3

    @property
    def n_kernels(self) -> int:
        return sum(t.n_kernels for t in self.lines)

    def by_line(self) -> dict[int, LineTime]:
        return {t.line: t for t in self.lines}

    def kernel_ms_between(self, lo: int, hi: int) -> float:
        """Kernel time of the lines strictly between ``lo`` and ``hi`` (indices into ``call``)."""
        return sum(t.kernel_ms for t in self.lines if lo < t.line < hi)

    def kernel_ms_after(self, line: int) -> float:
        return self.kernel_ms_between(line, self.n_body_lines)

    def kernel_ms_before(self, line: int) -> float:
        return self.kernel_ms_between(-1, line)


def match_phase(code: str, work: GraphCall | Sequence[GpuEvent], phase: str = "") -> PhaseTimes:
    """Give the GPU work of one run of ``code``'s ``call`` to its lines.

    ``work`` is the run's ``GraphCall`` (matched through launches: "correlation") or, for a trace
    without CPU ops, the phase's GPU events in device order (matched by kernel names: "order").
    """
    body = call_body(code)
    if isinstance(work, GraphCall):
        return _match_by_ops(body, work, phase or work.phase)
    return _match_by_order(body, list(work), phase)


def best_call(code: str, calls: Sequence[GraphCall]) -> GraphCall:
    """The one of a step's graph calls that ran ``code``: with graph breaks, the call whose child ops
    best match the code's named lines (``difflib`` ratio)."""
    if len(calls) == 1:
        return calls[0]
    want = [n for _, n in _named_lines(call_body(code))]
    return max(calls, key=lambda c: difflib.SequenceMatcher(None, want, [x.name for x in c.children]).ratio())


def _named_lines(body: Sequence[str]) -> list[tuple[int, str]]:
    return [(i, n) for i, line in enumerate(body) if (n := op_name(line)) is not None]


def _match_by_ops(body: Sequence[str], call: GraphCall, phase: str) -> PhaseTimes:
    named = _named_lines(body)
    wanted = {n for _, n in named}
    children = [c for c in call.children if c.name in wanted or c.events]
    sm = difflib.SequenceMatcher(None, [n for _, n in named], [c.name for c in children], autojunk=False)
    pairs: dict[int, int] = {}  # child index -> line
    for a, b, size in sm.get_matching_blocks():
        for k in range(size):
            pairs[b + k] = named[a + k][0]
    out: dict[int, list[GpuEvent]] = collections.defaultdict(list)
    ops: dict[int, str] = {}
    unmatched: list[GpuEvent] = []
    prev_line, pending = -1, []
    for j, child in enumerate(children):
        if j in pairs:
            _assign_gap(body, prev_line, pairs[j], pending, out, unmatched)
            prev_line, pending = pairs[j], []
            out[pairs[j]].extend(child.events)
            ops[pairs[j]] = child.name
        else:
            pending.append(child.events)
    _assign_gap(body, prev_line, len(body), pending, out, unmatched)
    return _phase(body, phase, "correlation", out, ops, unmatched)


def _assign_gap(
    body: Sequence[str],
    lo: int,
    hi: int,
    pending: list[tuple[GpuEvent, ...]],
    out: dict[int, list[GpuEvent]],
    unmatched: list[GpuEvent],
) -> None:
    """Give the GPU work of unclaimed ops (``pending``, in order) to the unnamed lines strictly between
    ``lo`` and ``hi`` that may launch something (one each when the counts agree, all to a single one)."""
    pending = [p for p in pending if p]
    if not pending:
        return
    candidates = [i for i in range(lo + 1, hi) if may_launch(body[i]) and op_name(body[i]) is None]
    if len(candidates) == len(pending):
        for i, evs in zip(candidates, pending):
            out[i].extend(evs)
    elif len(candidates) == 1:
        out[candidates[0]].extend(g for evs in pending for g in evs)
    else:
        unmatched.extend(g for evs in pending for g in evs)


def _match_by_order(body: Sequence[str], events: list[GpuEvent], phase: str) -> PhaseTimes:
    stream = compute_stream(events)
    kernels = [g for g in events if g.cat == "kernel" and g.stream == stream]
    named = [(i, k) for i, line in enumerate(body) if (k := triton_kernel(line))]
    out: dict[int, list[GpuEvent]] = collections.defaultdict(list)
    ops: dict[int, str] = {}
    unmatched: list[GpuEvent] = []
    k, prev_line = 0, -1
    for line, name in named:
        j = next((j for j in range(k, len(kernels)) if kernels[j].name == name), None)
        if j is None:
            continue
        _assign_gap_order(body, prev_line, line, kernels[k:j], out, unmatched)
        out[line].append(kernels[j])
        ops[line] = name
        prev_line, k = line, j + 1
    _assign_gap_order(body, prev_line, len(body), kernels[k:], out, unmatched)
    return _phase(body, phase, "order", out, ops, unmatched)


def _assign_gap_order(
    body: Sequence[str], lo: int, hi: int, kernels: Sequence[GpuEvent], out: dict[int, list[GpuEvent]],
    unmatched: list[GpuEvent],
) -> None:  # fmt: skip
    """Kernels between two Triton kernels, given to the lines between them that may launch something:
    one each when the counts agree; all to the only such line; else by name (``_cut_at_gemms``);
    failing that, unmatched."""
    if not kernels:
        return
    candidates = [i for i in range(lo + 1, hi) if may_launch(body[i]) and "fxoffload" not in body[i]]
    if len(candidates) == len(kernels):
        given = [[g] for g in kernels]
    elif len(candidates) == 1:
        given = [list(kernels)]
    else:
        given = _cut_at_gemms([op_name(body[i]) in _MATMULS for i in candidates], kernels)
    if given is None:
        unmatched.extend(kernels)
    else:
        for i, evs in zip(candidates, given):
            out[i].extend(evs)


def _cut_at_gemms(matmul: Sequence[bool], kernels: Sequence[GpuEvent]) -> list[list[GpuEvent]] | None:
    """Kernels for lines of which ``matmul`` says which run a matrix multiply: a matmul line takes one
    GEMM kernel (cuBLAS: ``nvjet``, ``gemm``, ``cutlass`` ...), any other line the run of non-GEMM
    kernels up to the next GEMM. None where that does not account for every line and kernel (two
    non-matmul lines in a row cannot be cut)."""
    given: list[list[GpuEvent]] = []
    k = 0
    for n, is_mm in enumerate(matmul):
        if is_mm:
            if k < len(kernels) and _GEMM_KERNEL.search(kernels[k].name):
                given.append([kernels[k]])
                k += 1
                continue
            return None
        if n + 1 < len(matmul) and not matmul[n + 1]:
            return None
        run = []
        while k < len(kernels) and not _GEMM_KERNEL.search(kernels[k].name):
            run.append(kernels[k])
            k += 1
        if not run:
            return None
        given.append(run)
    return given if len(given) == len(matmul) and k == len(kernels) else None


def _phase(
    body: Sequence[str], phase: str, method: str, out: Mapping[int, list[GpuEvent]], ops: Mapping[int, str],
    unmatched: Sequence[GpuEvent],
) -> PhaseTimes:  # fmt: skip
    lines = tuple(
        LineTime(i, body[i].strip(), ops.get(i, ""), tuple(sorted(out[i], key=lambda g: g.start_us)))
        for i in sorted(out)
        if out[i]
    )
    have = {t.line for t in lines if t.n_kernels}
    missing = tuple(i for i, line in enumerate(body) if is_kernel(line) and i not in have)
    return PhaseTimes(phase, method, lines, missing, tuple(unmatched), len(body))


# ------------------------------------------------------------------------------------------ no CPU ops


def split_phases(
    events: Sequence[GpuEvent], output_code: Mapping[str, str]
) -> tuple[list[GpuEvent], list[GpuEvent]]:
    """Without CPU ops: the forward is the compute stream's kernels up to the forward code's last
    Triton kernel (found in order from the step's start) and one kernel per named line after it;
    the backward, from the backward code's first Triton kernel after that, less one kernel per
    named line before it. Device-to-host copies go with the forward, host-to-device with the backward;
    memsets on the compute stream with the phase whose kernels they run among."""
    stream = compute_stream(events)
    kernels = [g for g in events if g.cat == "kernel" and g.stream == stream]
    fw_end, bw_start = _phase_bounds([g.name for g in kernels], output_code)
    fw_set, bw_set = set(kernels[:fw_end]), set(kernels[bw_start:])
    fw_until = kernels[fw_end - 1].end_us if fw_end else float("-inf")
    bw_from = kernels[bw_start].start_us if bw_start < len(kernels) else float("inf")

    def memset(g: GpuEvent) -> bool:
        return g.cat == "gpu_memset" and g.stream == stream

    fw = [g for g in events if g in fw_set or g.direction == "DtoH" or memset(g) and g.start_us < fw_until]
    bw = [g for g in events if g in bw_set or g.direction == "HtoD" or memset(g) and g.start_us >= bw_from]
    return fw, bw


def _phase_bounds(names: Sequence[str], output_code: Mapping[str, str]) -> tuple[int, int]:
    """Of the compute stream's kernel names: where the forward's kernels end and the backward's start."""
    fw_named, fw_triton = _kernel_ops(output_code["forward"])
    bw_named, bw_triton = _kernel_ops(output_code["backward"])
    if not fw_triton or not bw_triton:
        raise ValueError("without CPU ops in the trace, both graphs need a Triton kernel to be found by")
    k = 0
    for i in fw_triton:
        while k < len(names) and names[k] != fw_named[i]:
            k += 1
        k += 1
    fw_end = min(k + len(fw_named) - 1 - fw_triton[-1], len(names))
    first = next((i for i in range(fw_end, len(names)) if names[i] == bw_named[bw_triton[0]]), len(names))
    return fw_end, max(first - bw_triton[0], fw_end)


def _kernel_ops(code: str) -> tuple[list[str], list[int]]:
    """The op names of the kernel lines of ``code`` that name one, and which of them are Triton kernels."""
    body = call_body(code)
    named = [(n, triton_kernel(body[i]) is not None) for i, n in _named_lines(body) if is_kernel(body[i])]
    return [n for n, _ in named], [k for k, (_, triton) in enumerate(named) if triton]
