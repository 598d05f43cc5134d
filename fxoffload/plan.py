"""Policies: decide, for every saved tensor, "offload", "keep" or "recompute", and say why. Pure data.

Every decision is an ``Action`` with a ``Reason`` (a stable code and a sentence). The order of the
rules: a user's own choice (``policy`` function, ``offload_modules``) comes first and is final for the
planner's own judgement, but the rules that make it impossible (parameters, returned tensors, shared
storage, host_budget, ...) still hold; then "auto" or "all"; then ``memory_budget``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import torch.fx as fx

from .cost import DeviceRates
from .host_memory import size_class
from .lifetimes import GraphLifetimes, SavedTensor
from .memory import CallOutside, MemoryPoint, MemoryTimeline, OffDevice, outside_at, with_plan
from .options import OffloadOptions
from .policy import user_choice
from .reasons import Action, Reason, ReasonCode
from .recompute import RecomputeOption
from .schedule import (
    HiddenSetChecker, TransferTiming, _MinTree, copy_seconds, padded_copy_seconds, schedule_transfers, windows,
)

# The old string constants, kept as names: each equals its string ("offload", ...).
OFFLOAD = Action.OFFLOAD
KEEP = Action.KEEP
RECOMPUTE = Action.RECOMPUTE
C = ReasonCode


@dataclasses.dataclass(frozen=True)
class Decision:
    saved: SavedTensor
    decision: Action
    reason: Reason
    timing: TransferTiming | None = None  # predicted copies, for offloaded tensors under the cost model
    recompute: RecomputeOption | None = None  # how it is rebuilt in the backward, when recomputed
    # Why it cannot be recomputed, when recomputation was considered (memory_budget or a policy
    # function) and refused; None otherwise.
    recompute_refused: Reason | None = None


@dataclasses.dataclass(frozen=True)
class PlanCosts:
    """What the cost model knows about one graph pair."""

    rates: DeviceRates
    fw_starts: tuple[float, ...]  # predicted start time of every forward node, then its end
    bw_starts: tuple[float, ...]
    baseline: MemoryTimeline | None = None  # predicted memory without offloading, for memory_budget
    calibrated: int = 0  # nodes whose time was measured (option calibrate) rather than modelled
    # Scratch bytes ops allocate while they run (temporaries.py), by node of this pair; the memory
    # model adds them at the node's point. Empty where they were not measured.
    temporaries: Mapping[fx.Node, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    outside: int = 0  # device bytes code before the pair holds through it (``upstream.py``), in ``baseline``
    # The calls of this pair it is planned for (``UpstreamMemory.calls``), where earlier calls of
    # the same pair keep what it keeps (``kept``, before any change): ``memory.with_plan``.
    calls: tuple[CallOutside, ...] = ()
    kept: int = 0


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    decisions: tuple[Decision, ...]
    policy: str
    note: str = ""  # why the whole graph was left unchanged, if it was
    stall: float = 0.0  # predicted seconds the compute stream waits for copies
    memory_budget: int | None = None  # the budget in bytes, when one was asked for
    costs: PlanCosts | None = None  # what the cost model predicted, when it was used
    wait_at_once: frozenset[str] = frozenset()  # offloads whose copies are not hidden (budget)
    # The cost model's view of the partition before recomputation (the recomputed tensors' rows
    # refer to it); None when nothing is recomputed.
    partition_costs: PlanCosts | None = None
    # The budget fit's own estimate of the peak with this plan (None without memory_budget).
    fit_peak: int | None = None

    @property
    def offloaded(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.decision == OFFLOAD)

    @property
    def recomputed(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.decision == RECOMPUTE)

    @property
    def recompute_seconds(self) -> float:
        """Predicted compute added to the backward by recomputation."""
        return sum(d.recompute.seconds for d in self.recomputed if d.recompute is not None)

    @property
    def offloaded_bytes(self) -> int:
        return sum(d.saved.nbytes for d in self.offloaded)

    @property
    def host_bytes(self) -> int:
        """Host memory the offloaded tensors' buffers really take (``host_bytes``)."""
        return sum(host_bytes(d.saved) for d in self.offloaded)


def host_bytes(t: SavedTensor) -> int:
    """Host bytes the buffer of an offloaded ``t`` takes: pinned (a power of two) for accelerator
    tensors, the pool's size class for CPU ones. ``host_budget`` counts these."""
    return size_class(t.nbytes, pinned=t.device.type != "cpu")


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def ineligible_reason(t: SavedTensor, options: OffloadOptions, *, asked: bool = False) -> Reason | None:
    """Why ``t`` cannot be offloaded, or None when it can. ``asked``: the user asked for it, which
    overrides ``min_bytes`` (a judgement), not the rules that make an offload impossible or useless."""
    if t.device.type == "cpu" and not options.offload_cpu:
        return Reason(C.CPU_TENSOR, "CPU tensor (set offload_cpu=True to offload CPU tensors)")
    if t.device.type == "meta":
        return Reason(C.META_TENSOR, "meta tensor")
    if t.is_static_input:
        return Reason(C.STATIC_INPUT, "parameter or buffer (static input): it outlives the step anyway")
    if t.is_graph_input:
        return Reason(
            C.GRAPH_INPUT, "graph input: its storage belongs to the caller, offloading it frees nothing"
        )
    if t.is_user_output:
        return Reason(C.USER_OUTPUT, "returned to the caller: its storage stays alive")
    if t.shares_storage_with:
        return Reason(
            C.SHARED_STORAGE,
            f"its storage ({t.storage}) is also saved as {', '.join(t.shares_storage_with)}: "
            "the other saved alias keeps it alive, offloading this one frees nothing",
        )
    if not t.is_dense:
        return Reason(C.NON_DENSE, f"non-dense layout (stride {t.stride}): copying it would need a gather")
    if t.bw_first_use < 0:
        return Reason(C.UNUSED_IN_BACKWARD, "not used by the backward graph")
    if t.nbytes == 0:
        return Reason(C.EMPTY, "empty tensor (0 bytes)")
    if not asked and t.nbytes < options.min_bytes:
        return Reason(C.MIN_BYTES, f"{fmt_bytes(t.nbytes)} < min_bytes ({fmt_bytes(options.min_bytes)})")
    return None


def plan_offloads(
    lifetimes: GraphLifetimes,
    options: OffloadOptions,
    *,
    host_bytes_available: int | None = None,
    disabled_reason: Reason | str = "",
    costs: PlanCosts | None = None,
    recompute: Mapping[str, RecomputeOption] | None = None,
    keep: Mapping[str, Reason] | None = None,
    recompute_refused: Mapping[str, Reason] | None = None,
) -> OffloadPlan:
    """Decide every saved tensor of one graph pair.

    ``host_bytes_available`` is what is left of ``host_budget`` after the graphs planned before this
    one (None: unbounded). ``disabled_reason`` turns offloading off for the whole graph. ``costs``
    switches on the cost model: without it, "auto" judges by node counts alone. ``recompute`` lists
    the tensors that could be recomputed instead (``recompute_options``); a ``memory_budget`` may
    then choose recomputation where it is predicted cheaper than an un-hidden offload, and a policy
    function may ask for it. ``recompute_refused`` says why the others cannot be (kept on the
    decisions). ``keep`` names tensors that must stay on the device, with the reason.
    """
    saved = lifetimes.saved
    refused = recompute_refused or {}
    label = options.policy_name
    if options.policy == "none":
        reason = Reason(C.POLICY_NONE, "policy='none'")
        return OffloadPlan(tuple(Decision(t, KEEP, reason) for t in saved), "none", costs=costs)
    if disabled_reason:
        if isinstance(disabled_reason, str):
            disabled_reason = Reason(C.DISABLED, disabled_reason)
        decisions = tuple(Decision(t, KEEP, disabled_reason) for t in saved)
        return OffloadPlan(decisions, label, disabled_reason.text, costs=costs)
    if not options.offload_cpu and all(d in ("cpu", "meta") for d in lifetimes.devices):
        note = Reason(
            C.NO_ACCELERATOR, "no accelerator tensors in this graph; compiled unchanged (offload_cpu=False)"
        )
        return OffloadPlan(tuple(Decision(t, KEEP, note) for t in saved), label, note.text, costs=costs)

    reasons: dict[str, Reason] = {}
    eligible: list[SavedTensor] = []
    asked = _user_choices(saved, options, recompute or {}, refused, keep or {}, reasons)
    window = max(1, options.prefetch or 0) if costs is None else 0
    auto = options.base_policy == "auto"
    pinned = {s for option in asked.recomputes.values() for s in option.sources}
    for t in saved:
        # The user's choice (or why it cannot be carried out), or a source of the user's recomputation
        # (its reason comes with the recomputed tensors').
        if t.name in reasons or t.name in pinned:
            continue
        reason = (keep or {}).get(t.name) or ineligible_reason(t, options)
        if reason is None and costs is None and auto and (
            t.fw_compute_after < window or t.bw_compute_before < window
        ):
            reason = Reason(
                C.TOO_SOON,
                f"needed again too soon to hide the copies: {t.fw_compute_after} compute nodes "
                f"after its last forward use, {t.bw_compute_before} before its first backward use "
                f"(policy='auto' wants >= {window} on each side)",
            )
        if reason is None:
            eligible.append(t)
        else:
            reasons[t.name] = reason

    # The user's offloads first (host_budget permitting), then the planner's. Largest first: the same
    # device memory per host byte for every tensor, but fewer, larger copies use the link better, and
    # the hidden set saves the most.
    used = 0
    chosen: list[SavedTensor] = []
    left: list[SavedTensor] = []  # eligible, not chosen, host budget permitting
    checker = (
        HiddenSetChecker([*asked.offloads, *eligible], costs.fw_starts, costs.bw_starts, costs.rates)
        if costs is not None and auto
        else None
    )
    for t in sorted(asked.offloads, key=lambda t: (-t.nbytes, t.output_index)):
        if host_bytes_available is not None and used + host_bytes(t) > host_bytes_available:
            reasons[t.name] = Reason(
                C.HOST_BUDGET,
                f"{reasons[t.name].text}, but it stays on the device: "
                + _host_budget_text(used, host_bytes_available),
            )
            continue
        if checker is not None:
            checker.try_add(t)  # the planner's own choices share the link with it, hidden or not
        used += host_bytes(t)
        chosen.append(t)
    for t in sorted(eligible, key=lambda t: (-t.nbytes, t.output_index)):
        if host_bytes_available is not None and used + host_bytes(t) > host_bytes_available:
            reasons[t.name] = Reason(C.HOST_BUDGET, _host_budget_text(used, host_bytes_available))
            continue
        if checker is not None and not checker.try_add(t):
            d2h, h2d = padded_copy_seconds(t, costs.rates)
            fw_window, bw_window = windows(t, costs.fw_starts, costs.bw_starts)
            margin = costs.rates.copy_margin
            reasons[t.name] = Reason(
                C.NOT_HIDDEN,
                f"its copies cannot be hidden: {_ms(d2h)} out in {_ms(fw_window)} of forward compute after "
                f"its last use, {_ms(h2d)} back in {_ms(bw_window)} of backward compute before its first "
                "use, sharing the link with the tensors already chosen"
                + (f" (copy times with the device's {margin:.0%} margin)" if margin else ""),
            )
            left.append(t)
            continue
        used += host_bytes(t)
        chosen.append(t)
        idle = f"idle for {t.idle_compute_nodes} compute nodes ({t.fw_compute_after} forward + {t.bw_compute_before} backward)"
        if checker is not None:
            reasons[t.name] = Reason(C.HIDDEN, f"copies predicted hidden; {idle}")
        else:
            reasons[t.name] = Reason(C.IDLE_WINDOW if auto else C.POLICY_ALL, idle)

    budget = None
    extra: list[SavedTensor] = []
    recomputed: dict[str, RecomputeOption] = dict(asked.recomputes)
    fit_peak = None
    if options.memory_budget is not None and costs is not None and costs.baseline is not None:
        budget = _budget_bytes(options.memory_budget, costs.baseline)
        # The budget never overrides a user's choice: what the user decided is no candidate.
        sizes = {t.name: t.nbytes for t in saved}
        candidates = {
            n: o
            for n, o in (recompute or {}).items()
            if n not in asked.decided and sizes.get(n, 0) >= options.min_bytes
        }
        fit = _fit_budget(
            budget, saved, chosen, left, candidates, costs, options, host_bytes_available, used,
            asked.recomputes,
        )  # fmt: skip
        extra, fit_peak = fit.offloads, fit.peak
        for t in extra:
            chosen.append(t)
            reasons[t.name] = Reason(
                C.BUDGET_OFFLOAD,
                f"memory_budget {fmt_bytes(budget)}: offloaded although its copies stall "
                f"(~{_ms(fit.stall_estimate[t.name])}, cheaper than recomputing it)"
                if t.name in (recompute or {})
                else f"memory_budget {fmt_bytes(budget)}: offloaded although its copies stall",
            )
        for name, option in fit.recomputes.items():
            if name in asked.recomputes:
                continue
            recomputed[name] = option
            alternative = (
                f", cheaper than an offload stalling ~{_ms(fit.stall_estimate[name])}"
                if name in fit.stall_estimate
                else ""
            )
            reasons[name] = Reason(
                C.BUDGET_RECOMPUTE,
                f"memory_budget {fmt_bytes(budget)}: recomputed in the backward by {option.op} from "
                f"{', '.join(option.sources) or 'parameters'} (~{_ms(option.seconds)}{alternative})",
            )
    for name, users in _readers({n: o.sources for n, o in recomputed.items()}).items():
        if name in recomputed:  # a chain: rebuilt first, then what is recomputed from it
            then = f"; then {', '.join(users)} recomputed from it"
            reasons[name] = Reason(reasons[name].code, reasons[name].text + then)
        else:
            kept = f"kept on the device: {', '.join(users)} recomputed from it"
            before = reasons.get(name)
            reasons[name] = Reason(C.RECOMPUTE_SOURCE, f"{kept}; {before.text}" if before else kept)

    wait_at_once = frozenset(t.name for t in extra)

    def planned(chosen: list[SavedTensor]) -> OffloadPlan:
        timings, stall = _schedule(chosen, costs, options, wait_at_once)
        names = {t.name for t in chosen}
        decisions = tuple(
            Decision(t, RECOMPUTE, reasons[t.name], recompute=recomputed[t.name])
            if t.name in recomputed
            else Decision(
                t, OFFLOAD if t.name in names else KEEP, reasons[t.name], timings.get(t.name),
                recompute_refused=refused.get(t.name),
            )
            for t in saved
        )  # fmt: skip
        return OffloadPlan(
            decisions, label, stall=stall, memory_budget=budget, costs=costs, wait_at_once=wait_at_once,
            fit_peak=fit_peak,
        )  # fmt: skip

    plan = planned(chosen)
    mine = [t for t in chosen if t not in asked.offloads]
    judged = costs is not None and costs.baseline is not None and lifetimes.returns_only_scalars
    if auto and budget is None and mine and judged:
        # "auto" offloads to lower the peak. Where its choices cannot (the peak is where none of its
        # tensors is off the device: the MLP's, at the end of the backward, every gradient live),
        # the copies buy nothing, and the order they impose on the compiler can cost memory. Judged
        # only for a pair that returns a loss alone: one that returns activations may be one block of
        # a longer step, whose peak is where this pair's saved tensors wait for their backward.
        without = planned([t for t in chosen if t not in mine])
        peak = with_plan(costs.baseline, off_device(plan), costs.calls, costs.kept).peak
        if peak.total >= with_plan(costs.baseline, off_device(without), costs.calls, costs.kept).peak_bytes:
            dropped = {t.name for t in mine}
            why = (
                f"offloading would not lower the predicted peak ({fmt_bytes(peak.total)} at "
                f"{peak.phase} node {peak.node}, with or without it)"
            )
            decisions = tuple(
                dataclasses.replace(d, reason=Reason(C.PEAK_NOT_LOWERED, f"{why}; {d.reason.text}"))
                if d.saved.name in dropped
                else d
                for d in without.decisions
            )
            plan = dataclasses.replace(without, decisions=decisions)
    return plan


@dataclasses.dataclass
class _Asked:
    offloads: list[SavedTensor]  # the user's offloads that can be carried out, host_budget aside
    recomputes: dict[str, RecomputeOption]  # the user's recomputations that can be carried out
    decided: set[str]  # every tensor the user decided, carried out or not


def _user_choices(
    saved: Sequence[SavedTensor],
    options: OffloadOptions,
    recompute: Mapping[str, RecomputeOption],
    refused: Mapping[str, Reason],
    keep: Mapping[str, Reason],
    reasons: dict[str, Reason],
) -> _Asked:
    """The user's choices (``policy`` function, ``offload_modules``), checked against the rules that
    make them impossible; fills ``reasons`` for every tensor the user decided."""
    out = _Asked([], {}, set())
    if not callable(options.policy) and not options.offload_modules:
        return out
    offloads: list[tuple[SavedTensor, Reason]] = []
    for t in saved:
        choice = user_choice(t, options)
        if choice is None:
            continue
        action, why = choice
        out.decided.add(t.name)
        blocked = keep.get(t.name)
        if blocked is None and action is OFFLOAD:
            blocked = ineligible_reason(t, options, asked=True)
        if blocked is None and action is RECOMPUTE and t.name not in recompute:
            blocked = refused.get(t.name) or Reason(
                C.USER_RECOMPUTE_UNAVAILABLE,
                "no recomputation was planned for this graph (it needs partitioner='min_cut' and is "
                "planned once, on the first partition)",
            )
        if blocked is not None:
            reasons[t.name] = blocked.prefixed(f"{why.text}, but it stays on the device: ")
        elif action is OFFLOAD:
            offloads.append((t, why))
            reasons[t.name] = why
        elif action is RECOMPUTE:
            out.recomputes[t.name] = recompute[t.name]
            reasons[t.name] = why
        else:
            reasons[t.name] = why
    # Nothing is offloaded that a recomputed tensor is rebuilt from (its reload would come at once).
    sources = {s for option in out.recomputes.values() for s in option.sources}
    for t, why in offloads:
        if t.name in sources:
            users = [n for n, o in out.recomputes.items() if t.name in o.sources]
            reasons[t.name] = Reason(
                C.RECOMPUTE_SOURCE,
                f"{why.text}, but it stays on the device: {', '.join(users)} recomputed from it",
            )
        else:
            out.offloads.append(t)
    return out


def _host_budget_text(used: int, available: int) -> str:
    return (
        f"host_budget reached: {fmt_bytes(used)} of the {fmt_bytes(available)} left are taken by larger "
        "tensors"
    )


def replan_after_recompute(
    first: OffloadPlan,
    lifetimes: GraphLifetimes,
    costs: PlanCosts,
    options: OffloadOptions,
    sources: Mapping[str, tuple[str, ...]],
    *,
    host_bytes_available: int | None = None,
) -> OffloadPlan:
    """The plan for the pair torch's partitioner made once ``first.recomputed`` were tagged.

    A whole plan of the new pair (``costs.baseline`` is its memory), under the same budget in bytes:
    the recomputation changed which tensors are saved and when, so the offloads are chosen again,
    except for the tensors a recomputed one is rebuilt from (``sources``: recomputed name -> saved
    tensors of the new pair it reads), which stay on the device. A tensor the partitioner still saves
    although it was tagged is kept with that reason. The returned plan's ``costs.baseline`` is the
    new pair's memory before any offload; ``partition_costs.baseline`` the memory before any change
    (``first``'s).
    """
    assert first.costs is not None
    now = {t.name for t in lifetimes.saved}
    keep = {
        source: Reason(C.RECOMPUTE_SOURCE, f"kept on the device: {', '.join(names)} recomputed from it")
        for source, names in _readers(dict(sorted(sources.items()))).items()
    }
    for d in first.recomputed:
        if d.saved.name in now:
            keep[d.saved.name] = Reason(
                C.STILL_SAVED, "tagged for recomputation, but torch's partitioner still saves it"
            )
    if first.memory_budget is not None:
        options = options.replace(memory_budget=first.memory_budget)
    refused = {d.saved.name: d.recompute_refused for d in first.decisions if d.recompute_refused is not None}
    second = plan_offloads(
        lifetimes, options, host_bytes_available=host_bytes_available, costs=costs, keep=keep,
        recompute_refused=refused,
    )  # fmt: skip
    recomputed = []
    for d in first.recomputed:
        if d.saved.name not in now:
            option = d.recompute
            if option is not None:  # name the sources the new pair really reads
                option = dataclasses.replace(option, sources=tuple(sources.get(d.saved.name, ())))
            recomputed.append(dataclasses.replace(d, recompute=option))
    return dataclasses.replace(
        second,
        decisions=second.decisions + tuple(recomputed),
        costs=costs,
        memory_budget=first.memory_budget,
        partition_costs=first.costs,
    )


def _schedule(
    chosen: Sequence[SavedTensor], costs: PlanCosts | None, options: OffloadOptions, wait_at_once: frozenset[str]
) -> tuple[dict[str, TransferTiming], float]:
    if costs is None or not chosen:
        return {}, 0.0
    schedule = schedule_transfers(
        chosen, costs.fw_starts, costs.bw_starts, costs.rates, options.max_inflight_reloads,
        wait_at_once=wait_at_once,
    )  # fmt: skip
    return schedule.by_name(), schedule.stall


def _readers(sources: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """recomputed tensor -> what it is rebuilt from, turned around: source -> recomputed tensors."""
    out: dict[str, list[str]] = {}
    for name, reads in sources.items():
        for source in reads:
            out.setdefault(source, []).append(name)
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _budget_bytes(budget: int | float, baseline: MemoryTimeline) -> int:
    return int(budget * baseline.peak_bytes) if isinstance(budget, float) else int(budget)


def _estimated_interval(t: SavedTensor, fw_points: int) -> tuple[int, int]:
    """Baseline points freed by offloading ``t`` for the budget: after its last use, until the
    reload issued just before its first use."""
    return t.fw_last_use + 1, fw_points + max(t.bw_first_use, 0) - 1


def _recompute_ends(
    recomputes: Mapping[str, RecomputeOption], saved: Mapping[str, SavedTensor], fw_points: int
) -> dict[str, int]:
    """The last point each recomputed tensor is off the device: just before its first backward
    use, or before a tensor recomputed from it is rebuilt, whichever comes first."""
    ends = {name: _estimated_interval(saved[name], fw_points)[1] for name in recomputes}
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


def _offload_interval(t: SavedTensor, timing: TransferTiming | None, fw_points: int) -> OffDevice:
    """Where offloading ``t`` takes it off the device: from the point after its forward wait (the
    source is released there) to the node its reload is issued after; without a schedule, the
    estimate of ``_estimated_interval``."""
    if timing is None:
        lo, hi = _estimated_interval(t, fw_points)
    else:
        # The wait comes after the node the copy is issued after at the earliest (the rewrite).
        lo, hi = max(timing.fw_wait_after, t.fw_last_use + 1) + 1, fw_points + timing.bw_issue_after
    return OffDevice(t.name, t.nbytes, lo, hi)


def _recompute_interval(t: SavedTensor, end: int, fw_points: int) -> OffDevice:
    return OffDevice(t.name, t.nbytes, _estimated_interval(t, fw_points)[0], end)


def off_device(plan: OffloadPlan) -> tuple[OffDevice, ...]:
    """The plan as data for the memory model (``memory.with_plan(plan.costs.baseline, ...)``): where
    each offloaded or recomputed tensor is off the device. A plan made for a second partition
    (``partition_costs`` set) has its recomputations in its baseline already."""
    if plan.costs is None or plan.costs.baseline is None:
        return ()
    fw_points = sum(p.phase == "forward" for p in plan.costs.baseline.points)
    off = [_offload_interval(d.saved, d.timing, fw_points) for d in plan.offloaded]
    recomputes = {d.saved.name: d.recompute for d in plan.recomputed if d.recompute is not None}
    if recomputes and plan.partition_costs is None:
        saved = {d.saved.name: d.saved for d in plan.decisions}
        ends = _recompute_ends(recomputes, saved, fw_points)
        off += [_recompute_interval(saved[name], end, fw_points) for name, end in ends.items()]
    return tuple(off)


def _covers(interval: tuple[int, int], point: int) -> bool:
    return interval[0] <= point <= interval[1]


@dataclasses.dataclass
class _BudgetFit:
    offloads: list[SavedTensor]
    recomputes: dict[str, RecomputeOption]
    stall_estimate: dict[str, float]  # predicted stall of an un-hidden offload, per candidate
    peak: int  # the fit's estimate of the peak with its choices


def _fit_budget(
    budget: int,
    saved: Sequence[SavedTensor],
    chosen: Sequence[SavedTensor],
    left: Sequence[SavedTensor],
    recompute: Mapping[str, RecomputeOption],
    costs: PlanCosts,
    options: OffloadOptions,
    host_bytes_available: int | None,
    host_used: int,
    recomputed: Mapping[str, RecomputeOption] | None = None,
) -> _BudgetFit:
    """Un-hidden offloads and recomputations, least predicted time per byte first, until the
    predicted peak fits.

    Each candidate tensor may be offloaded (cost: its predicted stall, on its own) or recomputed
    (cost: the op's compute time); both free the same interval, from its last forward use to just
    before its first backward use. Nothing is recomputed from an offloaded tensor, and nothing
    recomputed from is offloaded afterwards; a source may be recomputed too (a chain). Rounds: a
    greedy pass on estimated intervals, then a check with the intervals the transfer schedule really
    gives (copies queue on the link, waits and reloads move); repeat until the check passes or no
    candidate is left. ``recomputed``: recomputations decided already (by the user), fixed.
    """
    points = costs.baseline.points
    fw_points = sum(p.phase == "forward" for p in points)

    def standalone_stall(t: SavedTensor) -> float:
        d2h, h2d = copy_seconds(t, costs.rates)
        fw_window, bw_window = windows(t, costs.fw_starts, costs.bw_starts)
        return max(0.0, d2h - fw_window) + max(0.0, h2d - bw_window)

    stall_estimate = {t.name: standalone_stall(t) for t in left}
    recomputes: dict[str, RecomputeOption] = dict(recomputed or {})
    taken = {t.name for t in chosen} | set(recomputes)  # offloaded or recomputed
    all_saved = {t.name: t for t in saved}
    pool: list[tuple[float, int, int, SavedTensor, RecomputeOption | None]] = [
        (stall_estimate[t.name] / max(t.nbytes, 1), t.output_index, 0, t, None) for t in left
    ]
    for name, option in recompute.items():
        t = all_saved.get(name)
        if t is None or name in taken:
            continue
        pool.append((option.seconds / max(t.nbytes, 1), t.output_index, 1, t, option))
    pool.sort(key=lambda e: e[:3])
    pinned = {s for option in recomputes.values() for s in option.sources}  # recomputed from: stays
    extra: list[SavedTensor] = []
    # A pair planned for several of its calls (``costs.calls``): a tensor off the device is off in the
    # earlier calls too, which lowers "outside" in a phase where the call holding the most there
    # has earlier calls. Tracked per phase by the bytes off the device per call.
    repeated = any(c.repeats for c in costs.calls)

    def outside(phase: str, off_bytes: int) -> int:
        return outside_at(costs.calls, phase, costs.kept - off_bytes) if repeated else 0

    def usable(entry) -> bool:
        _, _, _, t, option = entry
        if t.name in taken:
            return False
        if option is None:
            return t.name not in pinned and (
                host_bytes_available is None or host_used + host_bytes(t) <= host_bytes_available
            )
        # A source may be recomputed too (a chain, in either order of picking), never offloaded.
        return not any(s in taken and s not in recomputes for s in option.sources)

    while True:
        # The check: the memory model with everything chosen so far off the device where the real
        # schedule puts it (``with_plan``, the model the rewritten graph is held to).
        schedule = schedule_transfers(
            [*chosen, *extra], costs.fw_starts, costs.bw_starts, costs.rates, options.max_inflight_reloads,
            wait_at_once=frozenset(t.name for t in extra),
        )  # fmt: skip
        applied = _recompute_ends(recomputes, all_saved, fw_points)
        off = [_offload_interval(t, timing, fw_points) for timing, t in zip(schedule.timings, [*chosen, *extra])]
        off += [_recompute_interval(all_saved[name], hi, fw_points) for name, hi in applied.items()]
        checked = with_plan(costs.baseline, off, costs.calls, costs.kept)
        tree = _MinTree.of([-float(p.total) for p in checked.points])  # -live bytes: its min is minus the peak
        if -tree.min(0, len(points) - 1) <= budget:
            break
        off_bytes = sum(o.nbytes for o in off)
        # A greedy round on estimated intervals.
        added = False
        while -tree.min(0, len(points) - 1) > budget:
            peak_at = tree.argmin()
            pick = next(
                (e for e in pool if _covers(_estimated_interval(e[3], fw_points), peak_at) and usable(e)), None
            )
            phase = points[peak_at].phase
            if pick is None and repeated:  # one that lowers "outside" there, by the earlier calls
                now = outside(phase, off_bytes)
                lowers = (e for e in pool if usable(e) and outside(phase, off_bytes + e[3].nbytes) < now)
                pick = next(lowers, None)
            if pick is None:
                break
            pool.remove(pick)
            _, _, _, t, option = pick
            taken.add(t.name)
            if repeated:
                phases = ((0, fw_points - 1, "forward"), (fw_points, len(points) - 1, "backward"))
                for lo, hi, phase in phases:
                    lower = outside(phase, off_bytes) - outside(phase, off_bytes + t.nbytes)
                    if lo <= hi and lower:
                        tree.add(lo, hi, float(lower))
                off_bytes += t.nbytes
            if option is None:
                extra.append(t)
                host_used += host_bytes(t)
                lo, hi = _estimated_interval(t, fw_points)
                tree.add(lo, hi, float(t.nbytes))
            else:
                recomputes[t.name] = option
                pinned.update(option.sources)
                # A chain holds its links at once: a recomputed source is live again from the
                # moment a tensor recomputed from it is rebuilt.
                ends = _recompute_ends(recomputes, all_saved, fw_points)
                lo = _estimated_interval(t, fw_points)[0]
                tree.add(lo, ends[t.name], float(t.nbytes))
                for name, end in ends.items():
                    if name != t.name and end < applied[name]:
                        tree.add(end + 1, applied[name], -float(all_saved[name].nbytes))
                applied = ends
            added = True
        if not added:
            break
    reachable = int(-tree.min(0, len(points) - 1))
    if reachable > budget:
        unreachable_budget(budget, reachable, points[tree.argmin()], options.strict)
    return _BudgetFit(extra, recomputes, stall_estimate, reachable)


def unreachable_budget(budget: int, peak: int, at: MemoryPoint, strict: bool) -> None:
    """Say that ``budget`` cannot be reached, with the smallest predicted ``peak`` (at point ``at``):
    a RuntimeWarning, or a ValueError with ``strict=True``."""
    message = (
        f"fxoffload: memory_budget {fmt_bytes(budget)} cannot be reached: the smallest predicted peak "
        f"is {fmt_bytes(peak)} (at {at.phase} node {at.node}); applying that plan"
    )
    if strict:
        raise ValueError(message.replace("; applying that plan", " (strict=True)"))
    warnings.warn(message, RuntimeWarning, stacklevel=3)
