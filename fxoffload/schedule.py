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

from .cost import DeviceRates
from .lifetimes import SavedTensor


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

    timings = []
    for t in chosen:
        d2h, h2d = copy_seconds(t, rates)
        fw_window, bw_window = windows(t, fw_starts, bw_starts)
        f, b = fw[t.name], bw[t.name]
        timings.append(TransferTiming(t.name, d2h, h2d, fw_window, bw_window, f[0], f[1], b[0], b[1],
                                      f[2] + b[2], f[3], b[3]))  # fmt: skip
    return TransferSchedule(tuple(timings))


class _MinTree:
    """Range add, range min over n slots; inactive slots hold +inf."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self.low = [math.inf] * (4 * self.n)
        self.lazy = [0.0] * (4 * self.n)

    def _push(self, k: int) -> None:
        if self.lazy[k]:
            for c in (2 * k, 2 * k + 1):
                self.low[c] += self.lazy[k]
                self.lazy[c] += self.lazy[k]
            self.lazy[k] = 0.0

    def add(self, lo: int, hi: int, value: float, k: int = 1, l: int = 0, r: int | None = None) -> None:
        r = self.n - 1 if r is None else r
        if hi < l or r < lo or lo > hi:
            return
        if lo <= l and r <= hi:
            self.low[k] += value
            self.lazy[k] += value
            return
        self._push(k)
        m = (l + r) // 2
        self.add(lo, hi, value, 2 * k, l, m)
        self.add(lo, hi, value, 2 * k + 1, m + 1, r)
        self.low[k] = min(self.low[2 * k], self.low[2 * k + 1])

    @classmethod
    def of(cls, values: Sequence[float]) -> _MinTree:
        """A tree holding ``values``, built bottom-up in O(n)."""
        tree = cls(len(values))
        if values:
            tree._build(values, 1, 0, tree.n - 1)
        return tree

    def _build(self, values: Sequence[float], k: int, l: int, r: int) -> None:
        if l == r:
            self.low[k] = values[l]
            return
        m = (l + r) // 2
        self._build(values, 2 * k, l, m)
        self._build(values, 2 * k + 1, m + 1, r)
        self.low[k] = min(self.low[2 * k], self.low[2 * k + 1])

    def set(self, i: int, value: float, k: int = 1, l: int = 0, r: int | None = None) -> None:
        r = self.n - 1 if r is None else r
        if l == r:
            self.low[k] = value
            return
        self._push(k)
        m = (l + r) // 2
        if i <= m:
            self.set(i, value, 2 * k, l, m)
        else:
            self.set(i, value, 2 * k + 1, m + 1, r)
        self.low[k] = min(self.low[2 * k], self.low[2 * k + 1])

    def min(self, lo: int, hi: int, k: int = 1, l: int = 0, r: int | None = None) -> float:
        r = self.n - 1 if r is None else r
        if hi < l or r < lo or lo > hi:
            return math.inf
        if lo <= l and r <= hi:
            return self.low[k]
        self._push(k)
        m = (l + r) // 2
        return min(self.min(lo, hi, 2 * k, l, m), self.min(lo, hi, 2 * k + 1, m + 1, r))


    def argmin(self) -> int:
        """Index of the smallest value (ties go to the lowest index)."""
        k, lo, hi = 1, 0, self.n - 1
        while lo != hi:
            self._push(k)
            mid = (lo + hi) // 2
            if self.low[2 * k] <= self.low[2 * k + 1]:
                k, hi = 2 * k, mid
            else:
                k, lo = 2 * k + 1, mid + 1
        return lo


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
        self.fw = _MinTree(len(fw_order))
        self.bw = _MinTree(len(bw_order))
        self.fw_suffix_base = _Fenwick(len(fw_order))
        self.bw_prefix_base = _Fenwick(len(bw_order))

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


class _Fenwick:
    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0.0] * (n + 1)
        self.total = 0.0

    def add(self, i: int, value: float) -> None:
        self.total += value
        i += 1
        while i <= self.n:
            self.tree[i] += value
            i += i & -i

    def sum_to(self, i: int) -> float:  # sum over [0, i]
        s, i = 0.0, i + 1
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s

    def sum_from(self, i: int) -> float:  # sum over [i, n)
        return self.total - (self.sum_to(i - 1) if i > 0 else 0.0)
