"""``memory_budget`` with ``recompute="inductor"``: torch's own partitioner recomputes, fxoffload offloads
what hides on top.

Inductor's ``activation_memory_budget`` frees saved bytes by recomputation at a fraction of the time
an un-hidden offload costs (1.19x step time for 0.69x memory on an H100 GPT, where fxoffload's own
budget took 7x: ``../shared/gpu/README.md``). So the partition is made by torch's min-cut partitioner
at activation budgets from 1 down, then with every repeated block recomputed in turn, its outputs saved
(``analysis.blocks``: per-block checkpointing without a wrapper, for budgets below the lowest peak
torch's own budget reaches), and on each three plans are priced: the partition alone (its
recomputation only), with the offloads that hide on top, and, where those miss the budget, with a
fit that offloads un-hidden on top (its stall priced against recomputing more). A plan's price is
what it adds to a step (``_Candidate.cost``): the recomputation, the stall and every offload's op
calls (hidden copies are not free: their calls run on the compute stream), all priced by the model
as the device's measurements corrected it. The cheapest plan that meets the budget on the memory
model is kept; lower activation budgets are tried until the recomputation alone costs as much as
that plan (they mostly recompute more, though not always as the model prices it: a cheaper plan
further down can be missed, and pricing all six costs a partition and its analysis each, made once
per graph: its later plans price on them, ``Partition``); block by
block is priced whenever anything must be recomputed (it recomputes less than torch's lowest
budgets, which recompute outside the blocks too). Where none meets it on the model but one comes
within ``NEAR_MISS`` of it under Inductor, that one is compiled and its code judges it (the model
follows Inductor's fusion and scheduling only in part, ``analysis.fusion``); where none does, or
that code misses too, fxoffload's own budget fit (its own recomputation too, on the first
partition) is asked, and the lower of its predicted peak and the partition of the lowest peak is
kept (``offload_pass``), the budget said to be missed: recomputing everything can peak higher than
saving (the backward rebuilds at once what the forward saved over time), and a fit that can take
nothing more left a budget below what block by block reached with no plan at all. Random ops are
kept saved (``rewrite.random_ops``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from ..analysis.blocks import NoRepeatedBlocks
from ..analysis.cost import node_time
from ..analysis.fusion import Fusion, inductor_fusion
from ..analysis.graph import is_compute
from ..analysis.lifetimes import GraphLifetimes
from ..analysis.recompute import RecomputeOption
from ..options import OffloadOptions
from ..planning.budget import budget_bytes, fit_target, planned_memory
from ..planning.decisions import Decision, OffloadPlan, PlanCosts
from ..planning.plan import ineligible_reason, plan_offloads
from ..planning.policy import user_choice
from ..reasons import Action, Reason, ReasonCode
from ..rewrite.mutated_reads import ReadsMutatedInput
from ..sizes import fmt_bytes
from .refine import attempt_quietly

log = logging.getLogger(__name__)

__all__ = ["ACTIVATION_BUDGETS", "PER_BLOCK", "Partition", "Partitions", "TorchsPlan", "with_inductor_recompute"]

# The activation memory budgets tried, least recomputation first.
ACTIVATION_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
# Priced apart from them: every repeated block recomputed in turn (``analysis.blocks``), the lowest
# peak where torch's lowest budgets rebuild the whole forward at once in the backward.
PER_BLOCK = "per block"
# How far over the budget a partition's plan may peak on the memory model and still be compiled, its
# code the judge, where none meets it there: the model follows Inductor's scheduler only in part
# (``analysis.fusion``: within 3.6% of its code on the bench's transformers, 8-15% over on a GRU;
# before it fused, the bench's tiny GPT recomputing block by block was 4.0 MiB on it, 3.63 MiB in
# its code).
NEAR_MISS = 0.1

Pair = tuple[fx.GraphModule, fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class TorchsPlan:
    """A partition of torch's and its plan (``with_inductor_recompute``)."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    plan: OffloadPlan
    peak: int  # on the memory model
    # False: no partition met the budget (nor came near it under Inductor); this one peaks lowest.
    meets: bool = True


@dataclasses.dataclass(frozen=True)
class Partition:
    """One of torch's partitions of a graph, analysed: what pricing plans on it takes. The plans of
    a graph made again (for another target, ``compiler.compile``, or from what the first steps
    measured) price on those its first plan had made (``seen`` of ``with_inductor_recompute``): the
    same joint graph, partitioned the same way, 2.4 s a partition for a 12-block GPT on this CPU and
    superlinear in the blocks. Kept as the model analysed it, before any measurement corrects it."""

    budget: float | str  # the activation memory budget torch's partitioner was given, or PER_BLOCK
    pair: Pair
    lifetimes: GraphLifetimes
    costs: PlanCosts
    recompute_s: float  # the model's time of what the backward recomputes (``PlanCosts.scale`` not applied)


# torch's partitions of one graph by the activation budget they were made at (None: it could not be).
Partitions = dict[float | str, Partition | None]


@dataclasses.dataclass
class _Candidate:
    budget: float | str  # the activation memory budget torch's partitioner was given, or PER_BLOCK
    pair: Pair
    lifetimes: GraphLifetimes
    plan: OffloadPlan
    peak: int  # the memory model's peak with the plan's offloads
    recompute_s: float  # the model's time of what the backward recomputes
    # Priced on a partition of an earlier trace of the joint graph (``Partition``): made again on
    # this one's before it is kept (its nodes are the ones compiled).
    stale: bool = False

    @property
    def cost(self) -> float:
        """Seconds the plan adds to a step: torch's recomputation, and the offloads' stall and op calls."""
        return self.recompute_s + self.plan.time_cost


def with_inductor_recompute(
    pair: Pair,
    lifetimes: GraphLifetimes,
    costs: PlanCosts,
    options: OffloadOptions,
    repartition: Callable[..., Pair],
    analyse: Callable[[fx.GraphModule, fx.GraphModule], tuple[GraphLifetimes, PlanCosts]],
    plan_args: Mapping[str, Any],
    budget_target: int | None = None,
    seen: Partitions | None = None,
    measured: Callable[[PlanCosts], PlanCosts] | None = None,
) -> TorchsPlan | None:
    """The partition and plan kept (see the module); where none meets the budget, the one of the
    lowest peak, ``meets=False``: fxoffload's own budget fit (un-hidden offloads and its
    recomputation) is the way unless it reaches no lower (``offload_pass``); None where torch's
    partitioner made none. ``analyse(fw, bw)``: the lifetimes and cost model of a new partition (saved
    views hoisted), as the model makes them; ``measured(costs)``: one corrected by what the device
    measured (``costs`` is); ``plan_args``: the rest of ``plan_offloads``'s arguments (host bytes, what to
    keep); ``seen``: the graph's partitions priced before (``Partition``), added to."""
    assert options.memory_budget is not None and costs.baseline is not None
    budget = fit_target(options.memory_budget, costs, budget_target)  # on the FX model
    # What the first backward computes: a tensor it read saved (a placeholder) is recomputed, and priced, where
    # a partition's backward computes it.
    first_bw = frozenset(n.name for n in pair[1].graph.nodes if is_compute(n))

    def priced(activations: float | str, fresh: bool = False) -> list[_Candidate] | None:
        """The plans priced on one of torch's partitions; None where it cannot be made. Not
        ``fresh``: on the one an earlier plan of the graph had made (``seen``), where there is one."""
        stale = not fresh and seen is not None and activations in seen
        if stale and seen is not None:  # (``seen is not None``: for the type checker)
            part = seen[activations]
        elif activations == 1.0:
            part = _analysed(activations, pair, lifetimes, costs, first_bw, options)
        else:
            part = _made(activations, pair, repartition, analyse, first_bw, options)
        if seen is not None and activations != 1.0:
            seen.setdefault(activations, part)
        if part is None:
            return None
        found = part.costs if activations == 1.0 or measured is None else measured(part.costs)
        here = _plans_on(part, found, options, budget, plan_args)
        return [dataclasses.replace(c, stale=True) for c in here] if stale else here

    candidates: list[_Candidate] = []
    meeting: list[_Candidate] = []
    for activations in ACTIVATION_BUDGETS:
        here = priced(activations)
        if here is None:
            break
        candidates += here
        meeting = [c for c in candidates if c.peak <= budget]
        if meeting and min(c.cost for c in meeting) <= here[0].recompute_s:
            break  # lower activation budgets recompute at least this much: none of theirs is cheaper
    # Recomputing block by block is no further step of that order (torch's budgets recompute outside
    # the blocks too): priced unless the partition as it is meets the budget for nothing.
    if not any(c.cost == 0 for c in meeting):
        candidates += priced(PER_BLOCK) or []
    inductor = options.inner == "inductor"
    chosen, near, meets = _choice(candidates, budget, inductor)
    while chosen is not None and chosen.stale:  # the one kept is partitioned again, on this trace
        candidates = [c for c in candidates if c.budget != chosen.budget] + (priced(chosen.budget, fresh=True) or [])
        chosen, near, meets = _choice(candidates, budget, inductor)
    if chosen is None:
        return None
    if not meets:
        return _lowest(chosen, lifetimes, costs, options, budget)
    plan = dataclasses.replace(chosen.plan, judged_on_code=near)
    if near:
        log.info(
            "fxoffload: memory_budget %s: no partition of torch's meets it on the memory model; %s with %d "
            "offloads predicts %s, within %.0f%%: Inductor's code judges it", fmt_bytes(budget), _named(chosen.budget),
            len(plan.offloaded), fmt_bytes(chosen.peak), NEAR_MISS * 100,
        )  # fmt: skip
    log.info(
        "fxoffload: memory_budget %s with %s, %s predicted, %.3f ms recomputed, %d offloaded (%.3f ms a step "
        "in all; %d plans priced, on %d of torch's partitions)",
        fmt_bytes(budget), _named(chosen.budget), fmt_bytes(chosen.peak), chosen.recompute_s * 1e3,
        len(plan.offloaded), chosen.cost * 1e3, len(candidates), len({c.budget for c in candidates}),
    )  # fmt: skip
    return _torchs_plan(chosen, plan, lifetimes, costs, options)


def _made(
    activations: float | str, pair: Pair, repartition: Callable[..., Pair],
    analyse: Callable[[fx.GraphModule, fx.GraphModule], tuple[GraphLifetimes, PlanCosts]],
    first_bw: frozenset[str], options: OffloadOptions,
) -> Partition | None:  # fmt: skip
    """torch's partition at activation budget ``activations`` (or block by block), analysed; None
    where it cannot be made."""
    try:
        fw, bw = _partitioned(pair, repartition, activations)
    except NoRepeatedBlocks:
        log.debug("fxoffload: no repeated blocks to recompute one at a time")
        return None
    except ReadsMutatedInput as e:
        log.info("fxoffload: %s not priced: %s (wrong gradients)", _named(activations), e)
        return None
    except Exception as e:  # never fail a compile over an optimisation
        log.warning("fxoffload: %s failed (%s)", _named(activations), e)
        return None
    return _analysed(activations, (fw, bw), *analyse(fw, bw), first_bw, options)


def _choice(candidates: list[_Candidate], budget: int, inductor: bool) -> tuple[_Candidate | None, bool, bool]:
    """(candidate, near, meets): the cheapest candidate that meets ``budget`` on the memory model;
    where none does, the cheapest within ``NEAR_MISS`` of it under Inductor (``near``: its code
    judges it); where none comes near, the one of the lowest peak (not ``meets``); None: no candidate."""
    meeting = [c for c in candidates if c.peak <= budget]
    near = not meeting and inductor
    if near:  # the model counts each buffer of a chain Inductor fuses: its code judges a near miss
        meeting = [c for c in candidates if c.peak <= budget * (1 + NEAR_MISS)]
    if meeting:
        return min(meeting, key=lambda c: (c.cost, c.peak)), near, True
    return (min(candidates, key=lambda c: (c.peak, c.cost)) if candidates else None), False, False


def _torchs_plan(
    c: _Candidate, plan: OffloadPlan, lifetimes: GraphLifetimes, costs: PlanCosts, options: OffloadOptions,
    meets: bool = True,
) -> TorchsPlan:  # fmt: skip
    """Candidate ``c`` with ``plan`` (``c.plan`` or a copy of it) and its ``recompute`` decisions."""
    fw, bw = c.pair
    budget = budget_bytes(options.memory_budget, costs)
    return TorchsPlan(fw, bw, _with_recomputed(plan, lifetimes, costs, c, budget, _fusion(bw, options)), c.peak, meets)


def _lowest(
    lowest: _Candidate, lifetimes: GraphLifetimes, costs: PlanCosts, options: OffloadOptions, budget: int
) -> TorchsPlan:
    """``lowest``, the candidate of the lowest peak, none meeting ``budget`` (``meets=False``)."""
    log.info(
        "fxoffload: memory_budget %s: torch's partitioner with the offloads that hide reaches %s at best "
        "(%s); fxoffload's own budget fit decides where it predicts lower", fmt_bytes(budget), fmt_bytes(lowest.peak),
        _named(lowest.budget),
    )  # fmt: skip
    return _torchs_plan(lowest, lowest.plan, lifetimes, costs, options, meets=False)


def _analysed(
    activations: float | str, pair: Pair, found: GraphLifetimes, costs: PlanCosts, first_bw: frozenset[str],
    options: OffloadOptions,
) -> Partition:  # fmt: skip
    """One of torch's partitions with its lifetimes and cost model, and the model's time of what its
    backward recomputes (the nodes the first partition's backward does not compute)."""
    recomputed = [n for n in pair[1].graph.nodes if is_compute(n) and n.name not in first_bw]
    fusion = _fusion(pair[1], options)
    return Partition(activations, pair, found, costs, sum(node_time(n, costs.rates, fusion) for n in recomputed))


def _plans_on(
    part: Partition, costs: PlanCosts, options: OffloadOptions, budget: int, plan_args: Mapping[str, Any]
) -> list[_Candidate]:
    """On one of torch's partitions, with ``costs`` its cost model as the device's measurements
    corrected it: the partition alone, with the offloads that hide on top and, where both miss
    ``budget``, with the fit's. Its recomputation is priced at the backward's measured speed
    (``PlanCosts.scale``), as the stall it is weighed against is."""
    activations, found, seconds = part.budget, part.lifetimes, costs.scale[1] * part.recompute_s

    def candidate(plan: OffloadPlan) -> _Candidate:
        return _Candidate(activations, part.pair, found, plan, planned_memory(plan).peak_bytes, seconds)

    here = [candidate(_alone(found, options, costs, budget, activations, seconds, plan_args))]
    hidden = plan_offloads(found, options, costs=costs, fit=False, budget_target=budget, **plan_args)
    if hidden.offloaded:
        here.append(candidate(hidden))
    if all(c.peak > budget for c in here):
        fitted = _fitted(found, options, costs, budget, plan_args)
        if fitted is not None and fitted.offloaded:  # un-hidden offloads on top, priced against more recompute
            here.append(candidate(fitted))
    for c in here:
        log.debug(
            "fxoffload: %s: %d offloaded, %s predicted (memory_budget %s), %.3f ms a step",
            _named(activations), len(c.plan.offloaded), fmt_bytes(c.peak), fmt_bytes(budget), c.cost * 1e3,
        )  # fmt: skip
    return here


def _partitioned(pair: Pair, repartition: Callable[..., Pair], activations: float | str) -> Pair:
    """torch's partition at activation budget ``activations``, or recomputing block by block."""
    if activations == PER_BLOCK:
        return repartition(frozenset(), None, per_block=True)
    return pair if activations == 1.0 else repartition(frozenset(), activations)


def _named(activations: float | str) -> str:
    """The partition as the report says it."""
    if activations == PER_BLOCK:
        return "torch's partitioner recomputing each repeated block in turn (its outputs saved)"
    return f"torch's partitioner at activation_memory_budget={activations}"


def _alone(
    lifetimes: GraphLifetimes,
    options: OffloadOptions,
    costs: PlanCosts,
    budget: int,
    activations: float | str,
    seconds: float,
    plan_args: Mapping[str, Any],
) -> OffloadPlan:
    """The partition torch's partitioner made at activation budget ``activations`` with no offload of
    fxoffload's own (the user's choices stand): its recomputation alone, ``seconds`` a step."""
    why = Reason(
        ReasonCode.RECOMPUTE_CHEAPER,
        f"{_named(activations)} recomputes {seconds * 1e3:.3g} ms a step, and the plan that meets "
        f"memory_budget's target {fmt_bytes(budget)} on the memory model for the least time (recomputation, stall and op calls) offloads "
        "nothing of fxoffload's choosing",
    )
    mine = [t for t in lifetimes.saved if user_choice(t, options) is None and not ineligible_reason(t, options)]
    keep = {**{t.name: why for t in mine}, **(plan_args.get("keep") or {})}
    args = {**plan_args, "keep": keep}
    return plan_offloads(lifetimes, options, costs=costs, fit=False, budget_target=budget, **args)


def _fitted(
    lifetimes: GraphLifetimes, options: OffloadOptions, costs: PlanCosts, budget: int, plan_args: Mapping[str, Any]
) -> OffloadPlan | None:
    """The budget fit by offloading (un-hidden copies included, no recomputation of fxoffload's own)
    on one partition, or None where it cannot be made (``strict=True`` and out of reach)."""
    try:
        plan, _ = attempt_quietly(
            lambda: plan_offloads(lifetimes, options, costs=costs, fit=True, budget_target=budget, **plan_args)
        )
    except ValueError:
        return None
    return plan


def _fusion(bw: fx.GraphModule, options: OffloadOptions) -> Fusion | None:
    """How Inductor compiles a partition's backward, where it does: its recomputed pointwise chains
    then cost only what their kernels load (``cost.node_time``), not a pass over memory each."""
    return inductor_fusion(bw) if options.fuses else None


def _with_recomputed(
    plan: OffloadPlan, first: GraphLifetimes, costs: PlanCosts, chosen: _Candidate, budget: int,
    fusion: Fusion | None = None,
) -> OffloadPlan:  # fmt: skip
    """``plan`` with a ``recompute`` decision for every tensor the first partition saved that torch's
    partitioner recomputes in the chosen one, the first partition's costs (its baseline is the
    memory before any change) and the user's ``budget`` (for the verdict on the generated code)."""
    if chosen.budget == 1.0:
        return dataclasses.replace(plan, memory_budget=budget)
    now = {d.saved.name for d in plan.decisions}
    bw_nodes = {n.name: n for n in chosen.pair[1].graph.nodes}
    reason = Reason(ReasonCode.INDUCTOR_RECOMPUTE, f"recomputed in the backward by {_named(chosen.budget)}")
    recomputed = tuple(
        Decision(t, Action.RECOMPUTE, reason, recompute=RecomputeOption(
            t.name, t.producer,
            costs.scale[1] * node_time(bw_nodes[t.name], costs.rates, fusion) if t.name in bw_nodes else 0.0, (),
        ))
        for t in first.saved if t.name not in now
    )  # fmt: skip
    note = f"{_named(chosen.budget)} recomputes {len(recomputed)} saved tensors"
    if chosen.budget == PER_BLOCK:  # ``compiler.lowering.fusion_groups``
        note += ", each block's just before its backward: Inductor fuses no kernel across blocks"
    note = f"{plan.note}; {note}" if plan.note else note
    return dataclasses.replace(
        plan, decisions=plan.decisions + recomputed, partition_costs=costs, note=note, memory_budget=budget
    )
