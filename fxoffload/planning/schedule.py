"""Transfer schedule: when each copy runs on the host link, where its wait goes, and what it stalls.

The link is one FIFO queue per direction (one transfer stream). Forward: a copy is released when
its tensor's last forward reader ends and must finish before the forward returns; its wait goes
after the first node that ends once the copy is predicted done. Backward: every reload is issued as
late as possible so that it is done when its first use starts (an early reload raises the peak),
with at most ``max_inflight`` reloads issued ahead of their use, and never before the backward
starts; a reload that cannot make it stalls the compute stream by the difference.

``HiddenSetChecker`` answers "is everything still hidden if this tensor is added?" in O(log n):
the forward queue is feasible iff ``release_i + (work queued at or after i) <= end of forward`` for
every copy i, and the backward one iff ``sum of reload times due by deadline_k <= deadline_k`` for
every k. Both are range-add / range-min updates of per-copy slacks.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..analysis.cost import DeviceRates
from ..analysis.lifetimes import SavedTensor
from ..reasons import Reason, ReasonCode
from .trees import Fenwick, MinTree

if TYPE_CHECKING:
    from .decisions import PlanCosts


@dataclasses.dataclass(frozen=True)
class TransferTiming:
    """Predicted timing of one offloaded tensor (seconds; forward and backward clocks start at 0)."""

    name: str
    d2h: float  # duration of the device-to-host copy
    h2d: float  # duration of the host-to-device copy
    fw_window: float  # forward compute after its last use, until the forward ends
    bw_window: float  # backward compute before its first use
    offload_start: float
    offload_end: float
    reload_start: float
    reload_end: float
    stall: float  # compute-stream time lost waiting for this tensor's copies
    fw_wait_after: int  # forward node index after which its wait goes
    bw_issue_after: int  # backward node index after which its reload is issued; -1: at the start


@dataclasses.dataclass(frozen=True)
class TransferSchedule:
    timings: tuple[TransferTiming, ...]

    @property
    def stall(self) -> float:
        return sum(t.stall for t in self.timings)

    def by_name(self) -> dict[str, TransferTiming]:
        return {t.name: t for t in self.timings}


def copy_seconds(t: SavedTensor, rates: DeviceRates) -> tuple[float, float]:
    return t.nbytes / rates.d2h, t.nbytes / rates.h2d


def padded_copy_seconds(t: SavedTensor, rates: DeviceRates) -> tuple[float, float]:
    """The copy times a plan keeps room for: ``copy_seconds`` times (1 + ``rates.copy_margin``)."""
    d2h, h2d = copy_seconds(t, rates)
    return d2h * (1 + rates.copy_margin), h2d * (1 + rates.copy_margin)


def windows(t: SavedTensor, fw_starts: Sequence[float], bw_starts: Sequence[float]) -> tuple[float, float]:
    release = fw_starts[t.fw_last_use + 1]
    return fw_starts[-1] - release, bw_starts[max(t.bw_first_use, 0)]


def copy_windows(t: SavedTensor, timing: TransferTiming, costs) -> tuple[float, float]:
    """The compute the model prices between each copy's issue and its wait, as the schedule placed
    them: the offload issued after its tensor's last forward use, waited on after ``fw_wait_after``;
    the reload issued after ``bw_issue_after``, waited on before the first backward use."""
    fw, bw = costs.fw_starts, costs.bw_starts
    fw_window = fw[min(timing.fw_wait_after + 1, len(fw) - 1)] - fw[t.fw_last_use + 1]
    issue = bw[timing.bw_issue_after + 1] if timing.bw_issue_after >= 0 else 0.0
    return max(0.0, fw_window), max(0.0, bw[max(t.bw_first_use, 0)] - issue)


def schedule_transfers(
    chosen: Sequence[SavedTensor],
    fw_starts: Sequence[float],
    bw_starts: Sequence[float],
    rates: DeviceRates,
    max_inflight: int = 8,
    wait_at_once: frozenset[str] = frozenset(),
) -> TransferSchedule:
    """Timings of the copies of ``chosen`` on a shared link, one FIFO queue per direction.

    Tensors named in ``wait_at_once`` (offloaded for a memory budget although their copies cannot
    be hidden) trade time for memory in both directions: their forward wait comes right after their
    last use, and their reload is issued just before their first use. The compute stream pauses
    for those copies, which is the price of holding their memory for the shortest time.

    Waits and reloads are placed for copies ``rates.copy_margin`` longer than predicted
    (``padded_copy_seconds``), the stall is predicted with the copies' own times.
    """
    fw = _forward_schedule(chosen, fw_starts, rates, wait_at_once)
    bw = _backward_schedule(chosen, bw_starts, rates, max_inflight, wait_at_once)
    timings = []
    for t in chosen:
        d2h, h2d = copy_seconds(t, rates)
        fw_window, bw_window = windows(t, fw_starts, bw_starts)
        f, b = fw[t.name], bw[t.name]
        timings.append(TransferTiming(t.name, d2h, h2d, fw_window, bw_window, f[0], f[1], b[0], b[1],
                                      f[2] + b[2], f[3], b[3]))  # fmt: skip
    return TransferSchedule(tuple(timings))


# Per tensor: (copy start, copy end, stall, node index its wait goes after / its reload is issued after).
_Placed = dict[str, tuple[float, float, float, int]]


def _forward_schedule(
    chosen: Sequence[SavedTensor], fw_starts: Sequence[float], rates: DeviceRates, wait_at_once: frozenset[str]
) -> _Placed:
    """Each offload released at its last use, queued on the link; its wait after the first node
    that ends once the (padded) copy is predicted done; the forward clock run node by node, a wait
    whose copy is not done stalling it."""
    n_fw = len(fw_starts) - 1
    # First pass, no stalls: when would each copy be done, and so where does its wait go?
    link = 0.0
    wait_node: dict[str, int] = {}
    by_release = sorted(chosen, key=lambda t: (t.fw_last_use, t.output_index))
    for t in by_release:
        d2h, _ = padded_copy_seconds(t, rates)
        link = end = max(fw_starts[t.fw_last_use + 1], link) + d2h
        j = t.fw_last_use + 1
        if t.name not in wait_at_once:
            # the first node j >= last use + 1 that ends (fw_starts[j + 1]) at or after the copy
            j = max(j, bisect.bisect_left(fw_starts, end, lo=j + 1) - 1)
        wait_node[t.name] = min(j, n_fw - 1)
    # Second pass: run the forward clock node by node; a wait whose copy is not done stalls it.
    released: dict[int, list[SavedTensor]] = {}
    waits: dict[int, list[SavedTensor]] = {}
    for t in by_release:
        released.setdefault(t.fw_last_use, []).append(t)
        waits.setdefault(wait_node[t.name], []).append(t)
    clock, link = 0.0, 0.0
    fw: dict[str, tuple[float, float, float, int]] = {}
    copy_end: dict[str, tuple[float, float]] = {}
    for i in range(n_fw):
        clock += fw_starts[i + 1] - fw_starts[i]
        for t in released.get(i, ()):
            start = max(clock, link)
            link = start + copy_seconds(t, rates)[0]
            copy_end[t.name] = (start, link)
        for t in waits.get(i, ()):
            start, end = copy_end[t.name]
            stall = max(0.0, end - clock)
            clock += stall
            fw[t.name] = (start, end, stall, wait_node[t.name])
    return fw


def _backward_schedule(
    chosen: Sequence[SavedTensor],
    bw_starts: Sequence[float],
    rates: DeviceRates,
    max_inflight: int,
    wait_at_once: frozenset[str],
) -> _Placed:
    """Each reload issued as late as it can be and still be done when its first use starts, at most
    ``max_inflight`` ahead of their use and never before the backward starts; a reload that cannot
    make it stalls the compute stream by the difference."""
    bw: dict[str, tuple[float, float, float, int]] = {}
    order = sorted(chosen, key=lambda t: (t.bw_first_use, t.output_index))
    need = [bw_starts[max(t.bw_first_use, 0)] for t in order]
    dur = [copy_seconds(t, rates)[1] for t in order]
    padded = [padded_copy_seconds(t, rates)[1] for t in order]
    # As late as possible, latest deadline first, each ending before the next one starts.
    issue = [0.0] * len(order)
    next_start = math.inf
    for i in reversed(range(len(order))):
        if order[i].name in wait_at_once:
            issue[i] = need[i]  # just in time for its use: it stalls by its copy time
            continue
        end = min(need[i], next_start)
        issue[i] = end - padded[i]
        next_start = issue[i]
    for i in range(len(order)):
        floor = need[i - max_inflight] if max_inflight and i >= max_inflight else 0.0
        issue[i] = max(issue[i], floor, 0.0)
    link, delay = 0.0, 0.0
    for i, t in enumerate(order):
        start = max(issue[i] + delay, link)
        link = end = start + dur[i]
        stall = max(0.0, end - (need[i] + delay))
        delay += stall
        # the last node a that has ended (bw_starts[a + 1]) by the issue time
        a = bisect.bisect_right(bw_starts, issue[i], lo=1) - 2
        if t.name in wait_at_once:
            a = max(t.bw_first_use - 1, -1)
        bw[t.name] = (start, end, stall, min(a, max(t.bw_first_use - 1, -1)))
    return bw


class HiddenSetChecker:
    """Grows a set of offloaded tensors whose copies all stay hidden (predicted stall 0) with room
    to spare: each copy counts at ``padded_copy_seconds``."""

    def __init__(self, candidates: Sequence[SavedTensor], fw_starts, bw_starts, rates: DeviceRates) -> None:
        self.rates = rates
        self.fw_end = fw_starts[-1]
        fw_order = sorted(candidates, key=lambda t: (t.fw_last_use, t.output_index))
        bw_order = sorted(candidates, key=lambda t: (t.bw_first_use, t.output_index))
        self.fw_pos = {t.name: i for i, t in enumerate(fw_order)}
        self.bw_pos = {t.name: i for i, t in enumerate(bw_order)}
        self.release = {t.name: fw_starts[t.fw_last_use + 1] for t in candidates}
        self.need = {t.name: bw_starts[max(t.bw_first_use, 0)] for t in candidates}
        # fw slack_i = end - release_i - (queued work at or after i); bw slack_k = need_k - (work due by k)
        self.fw = MinTree(len(fw_order))
        self.bw = MinTree(len(bw_order))
        self.fw_suffix_base = Fenwick(len(fw_order))
        self.bw_prefix_base = Fenwick(len(bw_order))

    def try_add(self, t: SavedTensor) -> bool:
        d2h, h2d = padded_copy_seconds(t, self.rates)
        i, k = self.fw_pos[t.name], self.bw_pos[t.name]
        eps = 1e-12
        # Forward: every active copy released at or before i loses d2h of slack; i itself gets its own.
        own_fw = self.fw_end - self.release[t.name] - self.fw_suffix_base.sum_from(i) - d2h
        if own_fw < -eps or self.fw.min(0, i) - d2h < -eps:
            return False
        own_bw = self.need[t.name] - self.bw_prefix_base.sum_to(k) - h2d
        if own_bw < -eps or self.bw.min(k, self.bw.n - 1) - h2d < -eps:
            return False
        self.fw.add(0, i, -d2h)
        self.fw.set(i, own_fw)
        self.fw_suffix_base.add(i, d2h)
        self.bw.add(k, self.bw.n - 1, -h2d)
        self.bw.set(k, own_bw)
        self.bw_prefix_base.add(k, h2d)
        return True


# "auto" spends at most this share of the predicted step on its offloads' op calls (``OpAllowance``):
# below the noise of a step's time, so that its copies cost no time that can be measured.
AUTO_TIME_SHARE = 0.01


class OpAllowance:
    """"auto"'s allowance for its offloads' op calls (``DeviceRates.op_cost`` each, the compute
    stream's own time on a CPU): ``AUTO_TIME_SHARE`` of the predicted step. A tensor whose copies
    would hide still costs its calls: past the allowance, it is time traded for memory that nobody
    asked to save."""

    def __init__(self, costs: PlanCosts) -> None:
        self.rates = costs.rates
        self.step = costs.fw_starts[-1] + costs.bw_starts[-1]
        self.left = AUTO_TIME_SHARE * self.step
        self.taken = 0

    def room(self, t: SavedTensor) -> bool:
        """Whether ``t``'s calls fit (``take`` them once it is chosen)."""
        return self.rates.op_cost(t.nbytes) <= self.left

    def take(self, t: SavedTensor) -> None:
        self.left -= self.rates.op_cost(t.nbytes)
        self.taken += 1

    def reason(self, t: SavedTensor) -> Reason:
        return Reason(
            ReasonCode.OP_TIME,
            f"its four op calls would take {self.rates.op_cost(t.nbytes) * 1e3:.3g} ms of the compute stream's "
            f"time a step (op_time), and policy='auto' spends at most {AUTO_TIME_SHARE:.0%} of the predicted "
            f"step ({self.step * 1e3:.3g} ms) on them: {self.taken} larger tensors took it",
        )


def not_hidden(t: SavedTensor, costs: PlanCosts) -> Reason:
    """Why ``t`` stays on the device: its copies do not fit their windows (``HiddenSetChecker``)."""
    d2h, h2d = padded_copy_seconds(t, costs.rates)
    fw_window, bw_window = windows(t, costs.fw_starts, costs.bw_starts)
    margin = costs.rates.copy_margin
    return Reason(
        ReasonCode.NOT_HIDDEN,
        f"its copies cannot be hidden: {fmt_ms(d2h)} out in {fmt_ms(fw_window)} of forward compute after "
        f"its last use, {fmt_ms(h2d)} back in {fmt_ms(bw_window)} of backward compute before its first "
        "use, sharing the link with the tensors already chosen"
        + (f" (copy times with the device's {margin:.0%} margin)" if margin else ""),
    )


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
