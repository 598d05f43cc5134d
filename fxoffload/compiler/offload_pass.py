"""The fxoffload pass on a partitioned pair: lifetimes, costs, plan, rewrite; torch's partitioner
again where the plan recomputes something."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from ..analysis.lifetimes import GraphLifetimes, analyze_saved_tensors
from ..analysis.memory import CodeFacts
from ..analysis.outside import OutsideMemory
from ..analysis.recompute import RecomputeOption, recompute_options, recompute_sources
from ..options import OffloadOptions
from ..planning.budget import decisions_hint, planned_memory, unreachable_budget
from ..planning.decisions import OffloadPlan, PlanCosts
from ..planning.measured import Measured
from ..planning.plan import ineligible_reason, plan_offloads, replan_after_recompute
from ..reasons import Reason, ReasonCode
from ..rewrite.transfers import apply_plan, hoist_saved_views
from ..sizes import fmt_bytes
from .costs import plan_costs
from .inductor_recompute import Partitions, TorchsPlan, with_inductor_recompute
from .refine import Trial, attempt_quietly, refine, say

log = logging.getLogger(__name__)

__all__ = ["offload_pass"]

Pair = tuple[fx.GraphModule, fx.GraphModule]


def offload_pass(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    static_input_indices: Any,
    options: OffloadOptions,
    *,
    host_bytes_available: int | None = None,
    disabled_reason: Reason | str = "",
    repartition: Callable[[frozenset[str]], Pair] | None = None,
    outside: OutsideMemory | None = None,
    budget_target: int | None = None,
    graph_id: int = -1,
    measured: Measured | None = None,
    code_peak: int | None = None,
    code: CodeFacts | None = None,
    partitions: Partitions | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, OffloadPlan]:
    """The fxoffload pass on a partitioned pair: analyse, plan, rewrite; returns the rewritten pair, plan.

    ``repartition(names)`` runs torch's partitioner again with the forward nodes ``names`` tagged
    for recomputation; without it (a pair with no joint graph behind it) nothing is recomputed.
    ``outside``: what code before the pair holds through it, "outside" in every timeline and so in
    the budget. ``budget_target``: the peak the budget fit aims at, below ``memory_budget`` when the
    compiler plans again after a miss. ``graph_id`` names the copies; ``measured``: what the device
    measured of this graph's copies under an earlier plan, which corrects the cost model (the tensors
    whose copies stalled are judged again on it; the last plan made from measurements keeps them, and
    the last re-plan of ``auto`` offloads only what hid). ``code_peak``, ``code``: the peak of Inductor's
    code for the pair without offloading, replayed, and what it showed (``PlanCosts``), where it was lowered;
    ``partitions``: torch's, priced by earlier plans of the graph (``inductor_recompute.Partition``). The pair
    is rewritten in place unless the plan recomputes something: then the returned pair is the new
    partition. The memory predicted before any change is ``(plan.partition_costs or plan.costs).baseline``;
    ``plan.costs.baseline`` is that of the pair the plan was made for."""
    # 1. Lifetimes of the saved tensors (saved views moved next to their bases first: the baseline is after it).
    static = tuple(static_input_indices)
    lifetimes = _lifetimes(fw, bw, num_fwd_outputs, static)
    # 2. Costs: compute time of every node and the host link, on the graph's device; what could be
    #    recomputed instead, and for how much (for a memory_budget, or when a policy function may
    #    ask for it: then at any size, the planner applies min_bytes to its own choices only).
    context = _Context(options, num_fwd_outputs, static, outside, host_bytes_available, code_peak, code, partitions)
    costs = context.costs(fw, bw, lifetimes)
    keep: dict[str, Reason] = {}
    if measured is not None:
        costs = measured.corrected(costs, options.op_time)  # the tensors that stalled judged again on it,
        keep = measured.keep() if measured.final else {}  # but by the last plan made from measurements
        if measured.only is not None:
            keep.update(_not_measured(lifetimes, options, measured.only, keep))
    torchs = None
    if options.memory_budget is not None and options.recompute == "inductor" and repartition and not disabled_reason:
        torchs = _torchs_recompute((fw, bw), lifetimes, costs, keep, measured, repartition, budget_target, context)
        if torchs is not None and torchs.meets:  # torch's partitioner recomputes, the plan offloads what hides on top
            return _rewritten(torchs, options, graph_id)
    recompute: dict[str, RecomputeOption] = {}
    refused: dict[str, Reason] = {}
    wanted = options.memory_budget is not None or callable(options.policy)
    if repartition is not None and wanted and options.partitioner == "min_cut":
        min_bytes = 0 if callable(options.policy) else options.min_bytes
        recompute, refused = recompute_options(fw, lifetimes, static, costs.rates, min_bytes, costs.scale[1])
        for name, reason in refused.items():
            log.debug("fxoffload: cannot recompute %s: %s", name, reason)
    # 3. The plan: one decision and reason per saved tensor.
    def plan_for(target: int | None, with_recompute: bool = True) -> OffloadPlan:
        return plan_offloads(
            lifetimes, options, host_bytes_available=host_bytes_available, disabled_reason=disabled_reason,
            costs=costs, recompute=recompute if with_recompute else None,
            recompute_refused=refused if with_recompute else None, budget_target=target, keep=keep,
        )  # fmt: skip

    first, said = attempt_quietly(lambda: plan_for(budget_target))
    if torchs is not None and _lower_than_own_fit(torchs, first):  # the budget missed, said so
        return _rewritten(torchs, options, graph_id)
    if not first.recomputed:
        say(Trial(first, None, said=said))
        _rewrite(fw, bw, first, options, graph_id)  # 5. the rewrite
        return fw, bw, first
    # 4. Recomputation is torch's partitioner's job: tag, partition again, plan the new pair.
    assert repartition is not None
    best = _recompute_or_offload(first, said, plan_for, repartition, (fw, bw), context)
    _rewrite(*best.value, options, graph_id)
    return best.value


def _rewritten(
    torchs: TorchsPlan, options: OffloadOptions, graph_id: int
) -> tuple[fx.GraphModule, fx.GraphModule, OffloadPlan]:
    """Torch's partition ``torchs`` rewritten as its plan says (``_rewrite``); the budget said to be
    missed where it is the lowest of torch's partitions, none meeting it."""
    if not torchs.meets:
        _missed(torchs.plan, torchs.peak, options)
    _rewrite(torchs.fw, torchs.bw, torchs.plan, options, graph_id)
    return torchs.fw, torchs.bw, torchs.plan


def _lower_than_own_fit(torchs: TorchsPlan, own: OffloadPlan) -> bool:
    """Whether torch's partition of the lowest peak, which misses the budget, peaks lower on the memory
    model than fxoffload's own fit predicts it can (its estimate ``fit_peak``, its recomputation
    included): where the fit can take nothing more, a budget below what recomputing block by block
    reached was left with no plan at all (ALBERT at 0.2 of its peak: the fit offloaded and recomputed
    nothing, 11.8 MiB predicted, where block by block reached 5.8; the code, 4.3 MiB at 0.4, was
    Inductor's own, 11.8 MiB, at 0.2)."""
    reach = own.fit_peak if own.fit_peak is not None else planned_memory(own).peak_bytes
    if torchs.peak < reach:
        log.info(
            "fxoffload: fxoffload's own budget fit predicts %s at best, torch's partition %s: that partition is kept",
            fmt_bytes(reach), fmt_bytes(torchs.peak),
        )  # fmt: skip
        return True
    log.info("fxoffload: fxoffload's own budget fit decides (it predicts %s, torch's partitions %s at best)",
             fmt_bytes(reach), fmt_bytes(torchs.peak))  # fmt: skip
    return False


def _missed(plan: OffloadPlan, peak: int, options: OffloadOptions) -> None:
    """Say that ``plan``, the lowest reachable, misses its budget (``unreachable_budget``)."""
    budget = plan.memory_budget if plan.memory_budget is not None else peak
    target = plan.budget_target if plan.budget_target is not None else budget
    unreachable_budget(budget, peak, planned_memory(plan).peak, options.strict, decisions_hint(plan), target)


@dataclasses.dataclass(frozen=True)
class _Context:
    """What every plan of one pair is made with."""

    options: OffloadOptions
    num_fwd_outputs: int
    static: tuple[int, ...]
    outside: OutsideMemory | None
    host_bytes_available: int | None
    code_peak: int | None = None  # of the joint graph, whatever the partition: ``PlanCosts.code_peak``
    code: CodeFacts | None = None  # ``PlanCosts.code``
    # torch's partitions priced by earlier plans of the graph (``inductor_recompute.Partition``)
    partitions: Partitions | None = dataclasses.field(default=None, hash=False)

    def costs(self, fw: fx.GraphModule, bw: fx.GraphModule, lifetimes: GraphLifetimes) -> PlanCosts:
        """The cost model of one partition of the pair (``compiler.costs.plan_costs``)."""
        found = plan_costs(
            fw, bw, lifetimes, self.options, self.num_fwd_outputs, self.static, self.outside, code=self.code
        )
        return dataclasses.replace(found, code_peak=self.code_peak)


def _torchs_recompute(
    pair: Pair,
    lifetimes: GraphLifetimes,
    costs: PlanCosts,
    keep: dict[str, Reason],
    measured: Measured | None,
    repartition: Callable[..., Pair],
    budget_target: int | None,
    context: _Context,
) -> TorchsPlan | None:
    """``recompute="inductor"`` (``compiler.inductor_recompute``): the partition torch's min-cut
    makes under an activation memory budget and its plan (``meets=False``: the lowest, where none
    meets the budget), or None where it made none."""

    def analyse(f: fx.GraphModule, b: fx.GraphModule) -> tuple[GraphLifetimes, PlanCosts]:
        found = _lifetimes(f, b, context.num_fwd_outputs, context.static)
        return found, context.costs(f, b, found)

    correct = (lambda new: measured.corrected(new, context.options.op_time)) if measured is not None else None
    plan_args = {"host_bytes_available": context.host_bytes_available, "keep": keep}
    return with_inductor_recompute(
        pair, lifetimes, costs, context.options, repartition, analyse, plan_args, budget_target, context.partitions,
        correct,
    )  # fmt: skip


def _recompute_or_offload(
    first: OffloadPlan,
    said: tuple,
    plan_for: Callable[..., OffloadPlan],
    repartition: Callable[[frozenset[str]], Pair],
    pair: Pair,
    context: _Context,
) -> Trial[tuple[fx.GraphModule, fx.GraphModule, OffloadPlan]]:
    """The plan with recomputation, judged on the memory model of the partition torch makes of it
    (the fit estimated it from the first pair): where it misses the budget, planned again for a
    target lowered by the miss (``refine``). An offload-only plan of the first pair may still do
    better: the lowest peak wins."""
    # Judged against the target the plan was made for: below the budget when the compiler plans
    # again after a miss in the generated code.
    budget = first.budget_target if first.budget_target is not None else first.memory_budget
    options = context.options
    tried = [0]

    def attempt(target: int | None) -> Trial | None:
        try:
            plan, held = (first, said) if not tried[0] else attempt_quietly(lambda: plan_for(target))
        except ValueError:  # strict=True and the lower target unreachable: judged on the budget below
            return None
        tried[0] += 1
        if not plan.recomputed:
            return None
        names = frozenset(d.saved.name for d in plan.recomputed)
        try:
            new_fw, new_bw = repartition(names)
        except Exception as e:  # never fail a compile over an optimisation: plan without it
            log.warning("fxoffload: partitioning again to recompute %s failed (%s); offloading only", sorted(names), e)
            return None
        second, more = attempt_quietly(lambda: _second_plan(plan, new_fw, new_bw, names, context))
        return Trial((new_fw, new_bw, second), planned_memory(second).peak_bytes, target, said=held + more)

    def on_replan(trial: Trial, target: int) -> None:
        log.info(
            "fxoffload: recomputing %d tensors, the new partition peaks at %s, over the budget %s; planning "
            "again for %s", len(trial.value[2].recomputed), fmt_bytes(trial.peak), fmt_bytes(budget), fmt_bytes(target),
        )  # fmt: skip

    best, trials = refine(budget, attempt, options.max_replans, on_replan)
    if best is None or (budget is not None and best.peak is not None and best.peak > budget):
        try:
            alone, held = attempt_quietly(lambda: plan_for(first.budget_target, with_recompute=False))
            candidate = Trial((*pair, alone), planned_memory(alone).peak_bytes, said=held)
            trials.append(candidate)
            best = candidate if best is None or candidate.peak < best.peak else best
        except ValueError:  # strict=True and unreachable without recomputation
            if best is None:
                raise
    if budget is not None and best.peak > budget:
        hint = decisions_hint(best.value[2])
        at = planned_memory(best.value[2]).peak
        unreachable_budget(first.memory_budget or budget, best.peak, at, options.strict, hint, budget)
    elif len(trials) > 1:
        log.info("fxoffload: of %d plans tried for memory_budget %s, the chosen one peaks at %s",
                 len(trials), fmt_bytes(budget or 0), fmt_bytes(best.peak or 0))  # fmt: skip
    # The fit's own warnings are about the attempts' targets; the verdict above replaces them.
    say(best, drop=lambda w: "cannot be reached" in str(w.message))
    return best


def _second_plan(
    plan: OffloadPlan, fw: fx.GraphModule, bw: fx.GraphModule, names: frozenset[str], context: _Context
) -> OffloadPlan:
    """The plan of the pair torch made with ``names`` tagged for recomputation."""
    lifetimes = _lifetimes(fw, bw, context.num_fwd_outputs, context.static)
    costs = context.costs(fw, bw, lifetimes)
    sources = recompute_sources(bw, names, frozenset(t.name for t in lifetimes.saved))
    return replan_after_recompute(
        plan, lifetimes, costs, context.options, sources, host_bytes_available=context.host_bytes_available
    )


def _rewrite(fw: fx.GraphModule, bw: fx.GraphModule, plan: OffloadPlan, options: OffloadOptions, graph_id: int) -> None:
    for d in plan.decisions:
        log.debug("fxoffload: %s %s (%s): %s", d.decision, d.saved.name, fmt_bytes(d.saved.nbytes), d.reason)
    if plan.note:
        log.info("fxoffload: %s", plan.note)
    # Inductor's C++ backend writes a run of generated-code nodes into one kernel (not its GPU ones).
    cpu = any(d.saved.device.type == "cpu" for d in plan.offloaded)
    runs = options.inner == "inductor" and cpu
    apply_plan(fw, bw, plan, options.prefetch, options.cpu_link(), options.broken_rule, graph_id, runs, options.fuses)
    log.info(
        "fxoffload: offloading %d of %d saved tensors (%s), recomputing %d",
        len(plan.offloaded), len(plan.decisions), fmt_bytes(plan.offloaded_bytes), len(plan.recomputed),
    )  # fmt: skip


def _lifetimes(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int]) -> GraphLifetimes:
    hoist_saved_views(fw, num_fwd_outputs)
    return analyze_saved_tensors(fw, bw, num_fwd_outputs, static)


def _not_measured(
    lifetimes: GraphLifetimes, options: OffloadOptions, only: frozenset[str], keep: dict[str, Reason]
) -> dict[str, Reason]:
    """The tensors ``auto``'s last re-plan keeps because their copies were not measured to hide
    (``Measured.only``): every one it could offload otherwise, but those."""
    why = Reason(
        ReasonCode.NOT_MEASURED,
        "the last re-plan from measurements offloads only copies measured to hide under the plan before",
    )
    return {
        t.name: why for t in lifetimes.saved
        if t.name not in only and t.name not in keep and ineligible_reason(t, options) is None
    }  # fmt: skip
