"""Fitting a plan to ``memory_budget``, and a plan as data for the memory model. Pure.

``off_device(plan)`` says where each offloaded or recomputed tensor is off the device, as the rewrite
will place its copies: ``analysis.memory.with_plan(baseline, off_device(plan))`` is then the pair's
predicted timeline without rewriting anything. ``fit_budget`` adds un-hidden offloads and
recomputations, least predicted time per byte first, until that timeline's peak fits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

from ..analysis.lifetimes import SavedTensor
from ..analysis.memory import MemoryPoint, MemoryTimeline, OffDevice, outside_at, with_plan
from ..analysis.recompute import RecomputeOption
from ..options import OffloadOptions
from ..reasons import Reason, ReasonCode
from ..sizes import fmt_bytes
from ..warn import warn
from .decisions import OffloadPlan, PlanCosts, planned_host_bytes
from .schedule import TransferTiming, copy_seconds, padded_copy_seconds, schedule_transfers, windows
from .trees import MinTree

log = logging.getLogger(__name__)

__all__ = [
    "BUDGET_TOLERANCE", "BudgetFit", "budget_bytes", "budget_verdict", "decisions_hint", "fit_budget", "fit_target",
    "first_aim", "min_bytes_hint", "off_device", "planned_memory", "times_said", "unreachable_budget",
]

# A memory_budget is met when the peak is at most this much above it: the tolerance of a
# measurement and of a replay that does not see an op's scratch.
BUDGET_TOLERANCE = 0.03


def budget_bytes(budget: int | float, costs: PlanCosts) -> int:
    """``memory_budget`` in bytes: an int as it is; a float a fraction of the peak of Inductor's code
    without offloading (``costs.code_peak``), the code that would run, where it was lowered and
    replayed, else of the FX model's (``costs.baseline``)."""
    if not isinstance(budget, float):
        return int(budget)
    assert costs.baseline is not None
    return int(budget * (costs.code_peak if costs.code_peak is not None else costs.baseline.peak_bytes))


def fit_target(budget: int | float, costs: PlanCosts, budget_target: int | None) -> int:
    """The peak the budget fit aims at on the FX model: ``budget_target`` (planned again after a
    miss), else, for a fraction of the code's peak, the same fraction of the model's (the model's
    bytes for the code's: where the code showed what the model alone misses, ``memory.CodeFacts``),
    else the budget. ``compiler.refine`` moves it by what the code then peaks at."""
    if budget_target is not None:
        return budget_target
    if isinstance(budget, float) and costs.code_peak is not None and costs.baseline is not None:
        return int(budget * costs.baseline.peak_bytes)
    return budget_bytes(budget, costs)


def first_aim(budget: int | float | None, plan: OffloadPlan) -> int | None:
    """What a plan made for no lower target aimed at (``fit_target`` on the first pair's costs),
    before any correction its recomputation's own re-plans made (``compiler.offload_pass``): the
    target ``compiler.refine`` moves by what the plan's code missed. None: no budget."""
    costs = plan.partition_costs or plan.costs
    if budget is None or costs is None or costs.baseline is None:
        return None
    return fit_target(budget, costs, None)


def estimated_interval(t: SavedTensor, fw_points: int) -> tuple[int, int]:
    """Baseline points freed by offloading ``t`` for the budget: after its last use, until the
    reload issued just before its first use."""
    return t.fw_last_use + 1, fw_points + max(t.bw_first_use, 0) - 1


def recompute_ends(
    recomputes: Mapping[str, RecomputeOption], saved: Mapping[str, SavedTensor], fw_points: int
) -> dict[str, int]:
    """The last point each recomputed tensor is off the device: just before its first backward
    use, or before a tensor recomputed from it is rebuilt, whichever comes first."""
    ends = {name: estimated_interval(saved[name], fw_points)[1] for name in recomputes}
    for _ in range(len(recomputes)):  # chains are short; stop as soon as nothing moves
        changed = False
        for name, option in recomputes.items():
            for source in option.sources:
                if source in ends and ends[name] - 1 < ends[source]:
                    ends[source] = ends[name] - 1
                    changed = True
        if not changed:
            break
    return ends


def offload_interval(t: SavedTensor, timing: TransferTiming | None, fw_points: int) -> OffDevice:
    """Where offloading ``t`` takes it off the device: from the point after its forward wait (the
    source is released there) to the node its reload is issued after; without a schedule, the
    estimate of ``estimated_interval``."""
    if timing is None:
        lo, hi = estimated_interval(t, fw_points)
    else:
        # The wait comes after the node the copy is issued after at the earliest (the rewrite).
        lo, hi = max(timing.fw_wait_after, t.fw_last_use + 1) + 1, fw_points + timing.bw_issue_after
    return OffDevice(t.name, t.nbytes, lo, hi)


def _recompute_interval(t: SavedTensor, end: int, fw_points: int) -> OffDevice:
    return OffDevice(t.name, t.nbytes, estimated_interval(t, fw_points)[0], end)


def off_device(plan: OffloadPlan) -> tuple[OffDevice, ...]:
    """The plan as data for the memory model (``with_plan(plan.costs.baseline, ...)``): where each
    offloaded or recomputed tensor is off the device. A plan made for a second partition
    (``partition_costs`` set) has its recomputations in its baseline already."""
    if plan.costs is None or plan.costs.baseline is None:
        return ()
    fw_points = sum(p.phase == "forward" for p in plan.costs.baseline.points)
    off = [offload_interval(d.saved, d.timing, fw_points) for d in plan.offloaded]
    recomputes = {d.saved.name: d.recompute for d in plan.recomputed if d.recompute is not None}
    if recomputes and plan.partition_costs is None:
        saved = {d.saved.name: d.saved for d in plan.decisions}
        ends = recompute_ends(recomputes, saved, fw_points)
        off += [_recompute_interval(saved[name], end, fw_points) for name, end in ends.items()]
    return tuple(off)


def planned_memory(plan: OffloadPlan) -> MemoryTimeline | None:
    """The predicted timeline of the pair with ``plan`` (``with_plan`` of its baseline)."""
    costs = plan.costs
    if costs is None or costs.baseline is None:
        return None
    return with_plan(costs.baseline, off_device(plan), costs.calls, costs.kept)


@dataclasses.dataclass
class BudgetFit:
    offloads: list[SavedTensor]
    recomputes: dict[str, RecomputeOption]
    stall_estimate: dict[str, float]  # predicted cost of an un-hidden offload (stall, op calls), per candidate
    peak: int  # the fit's estimate of the peak with its choices
    hidden: list[SavedTensor] = dataclasses.field(default_factory=list)  # of ``later``: placed to hide
    lowest: MemoryPoint | None = None  # where ``peak`` is
    # Over the budget: the candidates left untaken because freeing them would not lower ``peak``
    # (not idle at ``lowest``), by name.
    untaken: frozenset[str] = frozenset()


# A candidate of the fit: (cost per byte, output index, 0 offload / 1 recompute, tensor, option).
_Candidate = tuple[float, int, int, SavedTensor, "RecomputeOption | None"]


class _Fit:
    """The state of ``fit_budget``: what is chosen so far and the candidates left."""

    def __init__(
        self,
        saved: Sequence[SavedTensor],
        chosen: Sequence[SavedTensor],
        left: Sequence[SavedTensor],
        recompute: Mapping[str, RecomputeOption],
        costs: PlanCosts,
        host_left: int | None,
        recomputed: Mapping[str, RecomputeOption],
        later: Sequence[SavedTensor] = (),
    ) -> None:
        self.costs, self.host_left = costs, host_left
        self.points = costs.baseline.points
        self.fw_points = sum(p.phase == "forward" for p in self.points)
        self.stall_estimate = {t.name: self._standalone_cost(t) for t in (*left, *later)}
        # Of ``later``, those whose copies hide on their own are placed as hidden ones; the others
        # are candidates like ``left``'s.
        self.later = {t.name for t in later if self._standalone_cost(t, padded=True) <= costs.rates.op_cost(t.nbytes)}
        self.recomputes: dict[str, RecomputeOption] = dict(recomputed)
        self.chosen = list(chosen)
        self.taken = {t.name for t in chosen} | set(self.recomputes)  # offloaded or recomputed
        self.saved = {t.name: t for t in saved}
        pool: list[_Candidate] = [
            (self.stall_estimate[t.name] / max(t.nbytes, 1), t.output_index, 0, t, None) for t in (*left, *later)
        ]
        for name, option in recompute.items():
            t = self.saved.get(name)
            if t is not None and name not in self.taken:
                pool.append((option.seconds / max(t.nbytes, 1), t.output_index, 1, t, option))
        self.pool = sorted(pool, key=lambda e: e[:3])
        self.pinned = {s for option in self.recomputes.values() for s in option.sources}  # recomputed from
        self.extra: list[SavedTensor] = []  # its copies waited on at once (``wait_at_once``)
        self.hidden: list[SavedTensor] = []  # of ``later``: placed as copies that hide are
        # A pair planned for several of its calls (``costs.calls``): a tensor off the device is off in
        # the earlier calls too, which lowers "outside" in a phase where the call holding the most
        # there has earlier calls. Tracked per phase by the bytes off the device per call.
        self.repeated = any(c.repeats for c in costs.calls)

    def _standalone_cost(self, t: SavedTensor, padded: bool = False) -> float:
        """``t``'s predicted stall alone (its copies against its whole windows) and its calls; ``padded``:
        with the copies ``copy_margin`` longer, as the hidden-set check counts them."""
        d2h, h2d = (padded_copy_seconds if padded else copy_seconds)(t, self.costs.rates)
        fw_window, bw_window = windows(t, self.costs.fw_starts, self.costs.bw_starts)
        return max(0.0, d2h - fw_window) + max(0.0, h2d - bw_window) + self.costs.rates.op_cost(t.nbytes)

    def outside(self, phase: str, off_bytes: int) -> int:
        return outside_at(self.costs.calls, phase, self.costs.kept - off_bytes) if self.repeated else 0

    def usable(self, entry: _Candidate) -> bool:
        t, option = entry[3], entry[4]
        if t.name in self.taken:
            return False
        if option is None:
            return t.name not in self.pinned and (
                self.host_left is None or planned_host_bytes(t) <= self.host_left
            )
        # A source may be recomputed too (a chain, in either order of picking), never offloaded.
        return not any(s in self.taken and s not in self.recomputes for s in option.sources)

    def checked(self, max_inflight: int) -> tuple[MinTree, dict[str, int], int]:
        """The memory model with everything chosen so far off the device where the real schedule puts
        it (``with_plan``, the model the rewritten graph is held to), as a tree of -live bytes (its
        min is minus the peak); the recomputations' ends; the bytes off the device."""
        tensors = [*self.chosen, *self.hidden, *self.extra]
        schedule = schedule_transfers(
            tensors, self.costs.fw_starts, self.costs.bw_starts, self.costs.rates, max_inflight,
            wait_at_once=frozenset(t.name for t in self.extra),
        )  # fmt: skip
        applied = recompute_ends(self.recomputes, self.saved, self.fw_points)
        off = [offload_interval(t, timing, self.fw_points) for timing, t in zip(schedule.timings, tensors)]
        off += [_recompute_interval(self.saved[n], hi, self.fw_points) for n, hi in applied.items()]
        timeline = with_plan(self.costs.baseline, off, self.costs.calls, self.costs.kept)
        tree = MinTree.of([-float(p.total) for p in timeline.points])
        return tree, applied, sum(o.nbytes for o in off)

    def pick(self, tree: MinTree, off_bytes: int) -> _Candidate | None:
        """The cheapest usable candidate that frees the peak's point (or lowers "outside" there)."""
        at = tree.argmin()
        pick = next(
            (e for e in self.pool if _covers(estimated_interval(e[3], self.fw_points), at) and self.usable(e)), None
        )
        if pick is None and self.repeated:  # one that lowers "outside" there, by the earlier calls
            phase = self.points[at].phase
            now = self.outside(phase, off_bytes)
            pick = next(
                (e for e in self.pool if self.usable(e) and self.outside(phase, off_bytes + e[3].nbytes) < now),
                None,
            )
        return pick

    def take(self, entry: _Candidate, tree: MinTree, applied: dict[str, int], off_bytes: int) -> dict[str, int]:
        """Choose ``entry``, and update ``tree`` as the estimate of its effect; returns the
        recomputations' ends after it."""
        self.pool.remove(entry)
        t, option = entry[3], entry[4]
        self.taken.add(t.name)
        if self.repeated:
            n = len(self.points)
            for lo, hi, phase in ((0, self.fw_points - 1, "forward"), (self.fw_points, n - 1, "backward")):
                lower = self.outside(phase, off_bytes) - self.outside(phase, off_bytes + t.nbytes)
                if lo <= hi and lower:
                    tree.add(lo, hi, float(lower))
        if option is None:
            (self.hidden if t.name in self.later else self.extra).append(t)
            if self.host_left is not None:
                self.host_left -= planned_host_bytes(t)
            lo, hi = estimated_interval(t, self.fw_points)
            tree.add(lo, hi, float(t.nbytes))
            return applied
        self.recomputes[t.name] = option
        self.pinned.update(option.sources)
        # A chain holds its links at once: a recomputed source is live again from the moment a
        # tensor recomputed from it is rebuilt.
        ends = recompute_ends(self.recomputes, self.saved, self.fw_points)
        tree.add(estimated_interval(t, self.fw_points)[0], ends[t.name], float(t.nbytes))
        for name, end in ends.items():
            if name != t.name and end < applied[name]:
                tree.add(end + 1, applied[name], -float(self.saved[name].nbytes))
        return ends


def fit_budget(
    budget: int,
    saved: Sequence[SavedTensor],
    chosen: Sequence[SavedTensor],
    left: Sequence[SavedTensor],
    recompute: Mapping[str, RecomputeOption],
    costs: PlanCosts,
    options: OffloadOptions,
    host_left: int | None,
    recomputed: Mapping[str, RecomputeOption] | None = None,
    later: Sequence[SavedTensor] = (),
) -> BudgetFit:
    """Un-hidden offloads and recomputations, least predicted time per byte first, until the
    predicted peak fits ``budget``.

    Each candidate tensor may be offloaded (cost: its predicted stall, on its own, and its op calls)
    or recomputed (cost: the op's compute time); both free the same interval, from its last forward use to just
    before its first backward use. Nothing is recomputed from an offloaded tensor, and nothing
    recomputed from is offloaded afterwards; a source may be recomputed too (a chain). Rounds: a
    greedy pass on estimated intervals, then a check with the intervals the transfer schedule really
    gives (copies queue on the link, waits and reloads move); repeat until the check passes or no
    candidate is left. ``recomputed``: recomputations decided already (by the user), fixed.
    ``host_left``: host bytes ``host_budget`` leaves for these offloads (None: unbounded).
    ``later``: tensors whose copies would hide that ``auto``'s allowance for op calls left: offloads
    placed as hidden ones are (``BudgetFit.hidden``), at the cost of their calls.
    """
    fit = _Fit(saved, chosen, left, recompute, costs, host_left, recomputed or {}, later)
    last = len(fit.points) - 1
    while True:
        tree, applied, off_bytes = fit.checked(options.max_inflight_reloads)
        if -tree.min(0, last) <= budget:
            break
        added = False
        while -tree.min(0, last) > budget:  # a greedy round on estimated intervals
            entry = fit.pick(tree, off_bytes)
            if entry is None:
                break
            applied = fit.take(entry, tree, applied, off_bytes)
            off_bytes += entry[3].nbytes if fit.repeated else 0
            added = True
        if not added:
            break
    reachable, at = int(-tree.min(0, last)), tree.argmin()
    untaken = frozenset(
        e[3].name for e in fit.pool if reachable > budget and not _covers(estimated_interval(e[3], fit.fw_points), at)
    )
    return BudgetFit(fit.extra, fit.recomputes, fit.stall_estimate, reachable, fit.hidden, fit.points[at], untaken)


def _covers(interval: tuple[int, int], point: int) -> bool:
    return interval[0] <= point <= interval[1]


def unreachable_budget(
    budget: int, peak: int, at: MemoryPoint, strict: bool, hint: str = "", aim: int | None = None
) -> None:
    """Say that ``budget`` cannot be reached, with the smallest predicted ``peak`` (at point ``at``)
    and ``hint`` (``min_bytes_hint``): a RuntimeWarning, or a ValueError with ``strict=True``.
    ``aim``: the predicted peak the fit aimed at where it is not the budget (``fit_target``)."""
    aimed = f" (aiming the predicted peak at {fmt_bytes(aim)})" if aim is not None and aim != budget else ""
    message = (
        f"fxoffload: memory_budget {fmt_bytes(budget)}{aimed} cannot be reached: the smallest predicted peak "
        f"is {fmt_bytes(peak)} (at {at.phase} node {at.node}){hint}; applying that plan"
    )
    if strict:
        raise ValueError(message.replace("; applying that plan", " (strict=True)"))
    warn(message)


def times_said(n: int) -> str:
    """How many times, as the budget's messages say it: "once", "2 times"."""
    return "once" if n == 1 else f"{n} times"


def min_bytes_hint(kept: Iterable[tuple[int, Reason]]) -> str:
    """Where ``min_bytes`` kept saved tensors from a budget (a tiny model's, under its 1 MiB
    default): how many and their bytes, of ``kept`` (bytes, reason), for a budget said to be missed."""
    small = [nbytes for nbytes, reason in kept if reason.code == ReasonCode.MIN_BYTES]
    if not small:
        return ""
    return (
        f"; {len(small)} saved tensors ({fmt_bytes(sum(small))}) are under min_bytes, which keeps them from "
        "offloading and recomputation: a lower min_bytes lets the budget take them"
    )


def decisions_hint(plan: OffloadPlan) -> str:
    """``min_bytes_hint`` for the tensors ``plan``'s decisions kept (one home for both budget verdicts)."""
    return min_bytes_hint((d.saved.nbytes, d.reason) for d in plan.decisions)


def budget_verdict(
    graph_id: int,
    budget: int | None,
    compiled: MemoryTimeline | None,
    predicted: int,
    replans: Sequence[str] = (),
    strict: bool = False,
    hint: str = "",
    dropped: str = "",
) -> None:
    """Once both graphs are compiled, the peak of Inductor's code replayed (``compiled``) against
    ``budget``: past it (``BUDGET_TOLERANCE``), say so with the figures, beside the FX model's
    ``predicted`` peak (a RuntimeWarning, or a ValueError with ``strict=True``), and ``hint``
    (``min_bytes_hint``). ``dropped``: why the budget's plan does not run (verify_peak compiled the
    graphs without offloading, whose code peaks lower): then the code is that, not the plan's."""
    if budget is None or compiled is None or not compiled.points:
        return
    peak = compiled.peak
    if peak.total <= budget * (1 + BUDGET_TOLERANCE):
        log.info(
            "fxoffload: graph %d: Inductor's code peaks at %s, memory_budget %s met (%.0f%% tolerance)",
            graph_id, fmt_bytes(peak.total), fmt_bytes(budget), BUDGET_TOLERANCE * 100,
        )  # fmt: skip
        return
    why = (  # the plan itself over the budget (nothing this graph saves could bring it lower), or the code
        "the lowest peak the budget's fit reached on the FX graph (it takes only the tensors it predicts off the "
        "device at the peak it misses: a plan that offloads more, policy=\"all\", may still reach lower)"
        if predicted > budget * (1 + BUDGET_TOLERANCE)
        else "the plan's peak on the FX graph (Inductor fuses, reuses and frees buffers its own way)"
    )  # fmt: skip
    if dropped:
        why = f"without offloading: the budget's plan was dropped, {dropped}"
    else:
        why = f"against {fmt_bytes(predicted)}, {why}"
    message = (
        f"fxoffload: graph {graph_id}: memory_budget {fmt_bytes(budget)} is not met by the code Inductor generated: "
        f"it peaks at {fmt_bytes(peak.total)} ({peak.node}), {why}"
        + (f"; planned {times_said(len(replans))} more for lower targets, this is the lowest peak reached" if replans else "")
        + hint
        + ". Expect the step to peak about there."
    )
    if strict:
        raise ValueError(message.replace(". Expect the step to peak about there.", " (strict=True)."))
    warn(message)
