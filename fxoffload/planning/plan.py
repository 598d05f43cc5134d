"""Policies: decide, for every saved tensor, "offload", "keep" or "recompute", and say why. Pure data.

Every decision is an ``Action`` with a ``Reason`` (a stable code and a sentence). The order of the
rules: a user's own choice (``policy`` function, ``offload_modules``) comes first and is final for the
planner's own judgement, but the rules that make it impossible (parameters, returned tensors, shared
storage, host_budget, ...) still hold; then "auto" or "all"; then ``memory_budget``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..analysis.lifetimes import GraphLifetimes, SavedTensor
from ..analysis.recompute import RecomputeOption
from ..options import OffloadOptions
from ..reasons import Action, Reason, ReasonCode
from ..sizes import CUDA_BLOCK_BYTES, fmt_bytes
from .budget import budget_bytes, fit_budget, fit_target, min_bytes_hint, unreachable_budget
from .decisions import Decision, OffloadPlan, PlanCosts, planned_host_bytes
from .policy import user_choice
from .schedule import HiddenSetChecker, OpAllowance, TransferTiming, fmt_ms, not_hidden, schedule_transfers
from .worth import without_useless_offloads

__all__ = ["MIN_COPY_BYTES", "auto_offload_bytes", "ineligible_reason", "plan_offloads", "replan_after_recompute"]

# Below this many bytes a tensor is never copied, whatever ``min_bytes`` says: the CUDA caching
# allocator hands out no block smaller than 512 bytes, so a copy of a smaller tensor frees at most
# one such block, for two copies, an event and a host buffer. (The few-byte tensors it keeps on the
# device include the philox seed and offset of efficient attention, which live on the host at run
# time although traced on the device: ``runtime.transfers`` keeps them where they are regardless.)
MIN_COPY_BYTES = CUDA_BLOCK_BYTES


def ineligible_reason(t: SavedTensor, options: OffloadOptions, *, asked: bool = False) -> Reason | None:
    """Why ``t`` cannot be offloaded, or None when it can. ``asked``: the user asked for it, which
    overrides ``min_bytes`` (a judgement), not the rules that make an offload impossible or useless."""
    if t.device.type == "cpu" and not options.offload_cpu:
        return Reason(ReasonCode.CPU_TENSOR, "CPU tensor (set offload_cpu=True to offload CPU tensors)")
    if t.device.type == "meta":
        return Reason(ReasonCode.META_TENSOR, "meta tensor")
    if t.is_static_input:
        return Reason(ReasonCode.STATIC_INPUT, "parameter or buffer (static input): it outlives the step anyway")
    if t.is_graph_input:
        return Reason(
            ReasonCode.GRAPH_INPUT, "graph input: its storage belongs to the caller, offloading it frees nothing"
        )
    if t.is_user_output:
        return Reason(ReasonCode.USER_OUTPUT, "returned to the caller: its storage stays alive")
    if t.shares_storage_with:
        return Reason(
            ReasonCode.SHARED_STORAGE,
            f"its storage ({t.storage}) is also saved as {', '.join(t.shares_storage_with)}: "
            "the other saved alias keeps it alive, offloading this one frees nothing",
        )
    if not t.is_dense:
        return Reason(ReasonCode.NON_DENSE, f"non-dense layout (stride {t.stride}): copying it would need a gather")
    if t.resolved_per_op:
        return Reason(
            ReasonCode.LAZY_VIEW,
            f"a lazy {t.resolved_per_op} view: torch resolves it into a temporary copy for each op it is passed "
            "to, so the offload would copy, and its wait keep alive, a tensor freed as each op returns",
        )
    if t.bw_first_use < 0:
        return Reason(ReasonCode.UNUSED_IN_BACKWARD, "not used by the backward graph")
    if t.nbytes == 0:
        return Reason(ReasonCode.EMPTY, "empty tensor (0 bytes)")
    if t.nbytes < MIN_COPY_BYTES:
        return Reason(
            ReasonCode.TOO_SMALL,
            f"{fmt_bytes(t.nbytes)}: below {MIN_COPY_BYTES} B a copy costs more than it frees (the device "
            "allocator's smallest block), whatever min_bytes says",
        )
    if not asked and t.nbytes < options.min_bytes:
        return Reason(ReasonCode.MIN_BYTES, f"{fmt_bytes(t.nbytes)} < min_bytes ({fmt_bytes(options.min_bytes)})")
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
    budget_target: int | None = None,
    fit: bool = True,
) -> OffloadPlan:
    """Decide every saved tensor of one graph pair.

    ``host_bytes_available`` is what is left of ``host_budget`` after the graphs planned before this
    one (None: unbounded). ``disabled_reason`` turns offloading off for the whole graph. ``costs``
    switches on the cost model: without it, "auto" judges by node counts alone. ``recompute`` lists
    the tensors that could be recomputed instead (``recompute_options``); a ``memory_budget`` may
    then choose recomputation where it is predicted cheaper than an un-hidden offload, and a policy
    function may ask for it. ``recompute_refused`` says why the others cannot be (kept on the
    decisions). ``keep`` names tensors that must stay on the device, with the reason.
    ``budget_target``: the fit's peak in bytes, below ``memory_budget`` after a miss (``compiler.refine``).
    ``fit=False``: no budget fit, only what the policy chooses (the budget is still recorded).
    """
    unchanged = _unchanged_reason(lifetimes, options, disabled_reason)
    if unchanged is not None:
        policy = "none" if options.policy == "none" else options.policy_name
        note = "" if options.policy == "none" else unchanged.text
        decisions = tuple(Decision(t, Action.KEEP, unchanged) for t in lifetimes.saved)
        return OffloadPlan(decisions, policy, note, costs=costs)
    reasons: dict[str, Reason] = {}
    asked = _user_choices(lifetimes.saved, options, recompute or {}, recompute_refused or {}, keep or {}, reasons)
    eligible = _eligible(lifetimes.saved, options, costs, keep or {}, asked, reasons)
    picks = _pick(asked, eligible, costs, options, host_bytes_available, reasons)
    recomputed: dict[str, RecomputeOption] = dict(asked.recomputes)
    extra: list[SavedTensor] = []
    budget = aim = fit_peak = None
    if options.memory_budget is not None and costs is not None and costs.baseline is not None:
        budget = budget_bytes(options.memory_budget, costs)
        aim = fit_target(options.memory_budget, costs, budget_target)  # on the FX model
    if budget is not None and aim is not None and fit:
        # The budget never overrides a user's choice: what the user decided is no candidate.
        sizes = {t.name: t.nbytes for t in lifetimes.saved}
        candidates = {
            n: o for n, o in (recompute or {}).items() if n not in asked.decided and sizes.get(n, 0) >= options.min_bytes
        }
        host_left = None if host_bytes_available is None else host_bytes_available - picks.host_used
        fitted = fit_budget(
            aim, lifetimes.saved, picks.chosen, picks.left, candidates, costs, options,
            host_left, asked.recomputes, picks.later,
        )  # fmt: skip
        extra, fit_peak = fitted.offloads, fitted.peak
        if fitted.peak > aim:
            _say_budget_missed(fitted, budget, aim, lifetimes.saved, options, reasons)
        _say_budget_choices(fitted, budget, asked, recompute or {}, recomputed, reasons)
        picks.chosen.extend([*fitted.hidden, *extra])
    _say_recompute_sources(recomputed, reasons)
    made = _Made(lifetimes.saved, reasons, recomputed, recompute_refused or {}, costs, options,
                 frozenset(t.name for t in extra), budget, aim if aim != budget else budget_target, fit_peak)  # fmt: skip
    plan = made.plan(picks.chosen)
    mine = [t for t in picks.chosen if t not in asked.offloads]
    if options.base_policy == "auto" and budget is None and mine and lifetimes.returns_only_scalars:
        without = made.plan([t for t in picks.chosen if t not in mine])
        plan = without_useless_offloads(plan, without, {t.name for t in mine})
    return plan


def _unchanged_reason(lifetimes: GraphLifetimes, options: OffloadOptions, disabled: Reason | str) -> Reason | None:
    """Why the whole graph stays as it is, or None."""
    if options.policy == "none":
        return Reason(ReasonCode.POLICY_NONE, "policy='none'")
    if disabled:
        return disabled if isinstance(disabled, Reason) else Reason(ReasonCode.DISABLED, disabled)
    if not options.offload_cpu and all(d in ("cpu", "meta") for d in lifetimes.devices):
        return Reason(ReasonCode.NO_ACCELERATOR, "no accelerator tensors in this graph (offload_cpu=False)")
    return None


def _eligible(
    saved: Sequence[SavedTensor],
    options: OffloadOptions,
    costs: PlanCosts | None,
    keep: Mapping[str, Reason],
    asked: _Asked,
    reasons: dict[str, Reason],
) -> list[SavedTensor]:
    """The tensors the planner may offload by its own judgement; fills ``reasons`` for the others."""
    window = max(1, options.prefetch or 0) if costs is None else 0
    auto = options.base_policy == "auto"
    pinned = {s for option in asked.recomputes.values() for s in option.sources}
    eligible = []
    for t in saved:
        # The user's choice (or why it cannot be carried out), or a source of the user's recomputation
        # (its reason comes with the recomputed tensors').
        if t.name in reasons or t.name in pinned:
            continue
        reason = keep.get(t.name) or ineligible_reason(t, options)
        if reason is None and costs is None and auto and (
            t.fw_compute_after < window or t.bw_compute_before < window
        ):
            reason = Reason(
                ReasonCode.TOO_SOON,
                f"needed again too soon to hide the copies: {t.fw_compute_after} compute nodes "
                f"after its last forward use, {t.bw_compute_before} before its first backward use "
                f"(policy='auto' wants >= {window} on each side)",
            )
        if reason is None:
            eligible.append(t)
        else:
            reasons[t.name] = reason
    return eligible


@dataclasses.dataclass
class _Picks:
    chosen: list[SavedTensor]  # offloaded, the user's first
    left: list[SavedTensor]  # eligible, not chosen because its copies would not hide (host budget permitting)
    host_used: int  # host bytes the chosen ones take
    later: list[SavedTensor] = dataclasses.field(default_factory=list)  # not chosen for auto's allowance


def _pick(
    asked: _Asked,
    eligible: Sequence[SavedTensor],
    costs: PlanCosts | None,
    options: OffloadOptions,
    host_available: int | None,
    reasons: dict[str, Reason],
) -> _Picks:
    """The user's offloads first (host_budget permitting), then the planner's. Largest first: the same
    device memory per host byte for every tensor, but fewer, larger copies use the link better, and
    the hidden set saves the most. "auto" keeps what would not hide (``HiddenSetChecker``)."""
    auto = options.base_policy == "auto"
    picks = _Picks([], [], 0)
    checker = allowance = None
    if costs is not None and auto:
        checker = HiddenSetChecker([*asked.offloads, *eligible], costs.fw_starts, costs.bw_starts, costs.rates)
        allowance = OpAllowance(costs)  # the user's offloads cost their calls too, but were asked for

    def fits(t: SavedTensor) -> bool:
        return host_available is None or picks.host_used + planned_host_bytes(t) <= host_available

    for t in sorted(asked.offloads, key=lambda t: (-t.nbytes, t.output_index)):
        if not fits(t):
            reasons[t.name] = Reason(
                ReasonCode.HOST_BUDGET,
                f"{reasons[t.name].text}, but it stays on the device: "
                + _host_budget_text(picks.host_used, host_available),
            )
            continue
        if checker is not None:
            checker.try_add(t)  # the planner's own choices share the link with it, hidden or not
        picks.host_used += planned_host_bytes(t)
        picks.chosen.append(t)
    for t in sorted(eligible, key=lambda t: (-t.nbytes, t.output_index)):
        if not fits(t):
            reasons[t.name] = Reason(ReasonCode.HOST_BUDGET, _host_budget_text(picks.host_used, host_available))
        elif allowance is not None and not allowance.room(t):
            reasons[t.name] = allowance.reason(t)
            picks.later.append(t)  # a memory_budget may take it, placed as a copy that hides
        elif checker is not None and not checker.try_add(t):
            reasons[t.name] = not_hidden(t, costs)
            picks.left.append(t)
        else:
            picks.host_used += planned_host_bytes(t)
            picks.chosen.append(t)
            if allowance is not None:
                allowance.take(t)
            idle = f"idle for {t.idle_compute_nodes} compute nodes ({t.fw_compute_after} forward + "
            idle += f"{t.bw_compute_before} backward)"
            if checker is not None:
                reasons[t.name] = Reason(ReasonCode.HIDDEN, f"copies predicted hidden; {idle}")
            else:
                reasons[t.name] = Reason(ReasonCode.IDLE_WINDOW if auto else ReasonCode.POLICY_ALL, idle)
    return picks


def auto_offload_bytes(plan: OffloadPlan, costs: PlanCosts, options: OffloadOptions, host: int | None) -> int:
    """The bytes "auto"'s pick offloads of ``plan``'s tensors under ``costs`` and ``host`` bytes of host_budget
    (what a plan made again offloads): those it judged (``_pick``), judged again; the user's offloads as before."""
    judged = {ReasonCode.HIDDEN, ReasonCode.NOT_HIDDEN, ReasonCode.OP_TIME, ReasonCode.HOST_BUDGET}
    asked = [d.saved for d in plan.offloaded if d.reason.code not in judged]
    picks = _pick(_Asked(asked, {}, set()), [d.saved for d in plan.decisions if d.reason.code in judged], costs,
                  options, host, {d.saved.name: d.reason for d in plan.decisions})  # fmt: skip
    return sum(t.nbytes for t in picks.chosen)


def _say_budget_missed(
    fitted, budget: int, aim: int, saved: Sequence[SavedTensor], options: OffloadOptions, reasons: dict[str, Reason]
) -> None:
    """The fit missed ``aim`` (its target for ``budget``): what it left untaken says why (auto's reason
    stays, its code with it), and the budget is said unreachable, naming what ``min_bytes`` kept from it
    (``min_bytes_hint``)."""
    at = fitted.lowest
    for name in fitted.untaken & reasons.keys():
        reasons[name] = Reason(
            reasons[name].code,
            f"{reasons[name].text}; not taken by memory_budget either: it is not idle at the peak the budget "
            f"misses ({at.phase} node {at.node})",
        )
    hint = min_bytes_hint((t.nbytes, reasons[t.name]) for t in saved if t.name in reasons)
    unreachable_budget(budget, fitted.peak, at, options.strict, hint, aim)


def _say_budget_choices(
    fit,
    budget: int,
    asked: _Asked,
    recompute: Mapping[str, RecomputeOption],
    recomputed: dict[str, RecomputeOption],
    reasons: dict[str, Reason],
) -> None:
    """The reasons of what the budget fit added; its recomputations join ``recomputed``."""
    for t in fit.hidden:
        cost = fmt_ms(fit.stall_estimate[t.name])
        text = f"memory_budget {fmt_bytes(budget)}: offloaded, its copies placed to hide (~{cost} with its op calls)"
        reasons[t.name] = Reason(ReasonCode.BUDGET_OFFLOAD, text)
    for t in fit.offloads:
        text = f"memory_budget {fmt_bytes(budget)}: offloaded although its copies stall"
        if t.name in recompute:
            text += f" (~{fmt_ms(fit.stall_estimate[t.name])} with its op calls, cheaper than recomputing it)"
        reasons[t.name] = Reason(ReasonCode.BUDGET_OFFLOAD, text)
    for name, option in fit.recomputes.items():
        if name in asked.recomputes:
            continue
        recomputed[name] = option
        cost = fit.stall_estimate.get(name)
        alternative = f", cheaper than an offload costing ~{fmt_ms(cost)} (stall and op calls)" if cost is not None else ""
        reasons[name] = Reason(
            ReasonCode.BUDGET_RECOMPUTE,
            f"memory_budget {fmt_bytes(budget)}: recomputed in the backward by {option.op} from "
            f"{', '.join(option.sources) or 'parameters'} (~{fmt_ms(option.seconds)}{alternative})",
        )


def _say_recompute_sources(recomputed: Mapping[str, RecomputeOption], reasons: dict[str, Reason]) -> None:
    """The tensors something is recomputed from stay on the device, and their reasons say so."""
    for name, users in _readers({n: o.sources for n, o in recomputed.items()}).items():
        if name in recomputed:  # a chain: rebuilt first, then what is recomputed from it
            then = f"; then {', '.join(users)} recomputed from it"
            reasons[name] = Reason(reasons[name].code, reasons[name].text + then)
        else:
            kept = f"kept on the device: {', '.join(users)} recomputed from it"
            before = reasons.get(name)
            reasons[name] = Reason(ReasonCode.RECOMPUTE_SOURCE, f"{kept}; {before.text}" if before else kept)


@dataclasses.dataclass(frozen=True)
class _Made:
    """What a plan of one pair is made of, but for the offloaded set (``plan(chosen)``)."""

    saved: Sequence[SavedTensor]
    reasons: Mapping[str, Reason]
    recomputed: Mapping[str, RecomputeOption]
    refused: Mapping[str, Reason]
    costs: PlanCosts | None
    options: OffloadOptions
    wait_at_once: frozenset[str]
    budget: int | None
    budget_target: int | None
    fit_peak: int | None

    def plan(self, chosen: Sequence[SavedTensor]) -> OffloadPlan:
        timings, stall = _schedule(chosen, self.costs, self.options, self.wait_at_once)
        names = {t.name for t in chosen}
        decisions = tuple(
            Decision(t, Action.RECOMPUTE, self.reasons[t.name], recompute=self.recomputed[t.name])
            if t.name in self.recomputed
            else Decision(
                t, Action.OFFLOAD if t.name in names else Action.KEEP, self.reasons[t.name], timings.get(t.name),
                recompute_refused=self.refused.get(t.name),
            )
            for t in self.saved
        )  # fmt: skip
        return OffloadPlan(
            decisions, self.options.policy_name, stall=stall, memory_budget=self.budget,
            budget_target=self.budget_target if self.budget is not None else None, costs=self.costs,
            wait_at_once=self.wait_at_once, fit_peak=self.fit_peak,
        )  # fmt: skip


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
        if blocked is None and action is Action.OFFLOAD:
            blocked = ineligible_reason(t, options, asked=True)
        if blocked is None and action is Action.RECOMPUTE and t.name not in recompute:
            blocked = refused.get(t.name) or Reason(
                ReasonCode.USER_RECOMPUTE_UNAVAILABLE,
                "no recomputation was planned for this graph (it needs partitioner='min_cut' and is "
                "planned once, on the first partition)",
            )
        if blocked is not None:
            reasons[t.name] = blocked.prefixed(f"{why.text}, but it stays on the device: ")
        elif action is Action.OFFLOAD:
            offloads.append((t, why))
            reasons[t.name] = why
        elif action is Action.RECOMPUTE:
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
                ReasonCode.RECOMPUTE_SOURCE,
                f"{why.text}, but it stays on the device: {', '.join(users)} recomputed from it",
            )
        else:
            out.offloads.append(t)
    return out


def _host_budget_text(used: int, available: int | None) -> str:
    return (
        f"host_budget reached: {fmt_bytes(used)} of the {fmt_bytes(available or 0)} left are taken by larger "
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
        source: Reason(ReasonCode.RECOMPUTE_SOURCE, f"kept on the device: {', '.join(names)} recomputed from it")
        for source, names in _readers(dict(sorted(sources.items()))).items()
    }
    for d in first.recomputed:
        if d.saved.name in now:
            keep[d.saved.name] = Reason(
                ReasonCode.STILL_SAVED, "tagged for recomputation, but torch's partitioner still saves it"
            )
    if first.memory_budget is not None:  # the same bytes, whatever fraction of the new baseline they are
        options = options.replace(memory_budget=first.memory_budget)
    refused = {d.saved.name: d.recompute_refused for d in first.decisions if d.recompute_refused is not None}
    second = plan_offloads(
        lifetimes, options, host_bytes_available=host_bytes_available, costs=costs, keep=keep,
        recompute_refused=refused, budget_target=first.budget_target,
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
        budget_target=first.budget_target,
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
