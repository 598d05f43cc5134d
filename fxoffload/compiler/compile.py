"""Compiling one Dynamo graph with the pass: the inner compiler, the budget held by the code that
runs, and ``verify_peak``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx as fx

from .. import _compat
from ..analysis.code_copies import replay_forward
from ..analysis.code_memory import returned_strides
from ..analysis.outside import OutsideMemory
from ..ir import OFFLOAD, RELOAD, TRANSFER_OPS, WAIT
from ..options import OffloadOptions
from ..planning.budget import BUDGET_TOLERANCE, budget_verdict, decisions_hint, first_aim
from ..planning.measured import Measured
from ..reasons import Reason, ReasonCode
from ..reporting.report import CompileSpent
from ..sizes import fmt_bytes
from .costs import code_scratch, read_outside
from .dynamo_graph import copy_graph_module, may_have_a_backward, may_return_only_scalars, static_shapes
from .inductor_recompute import Partitions
from .lowering import fusion_groups, host_placeholders, lowering_config, on_roomy_stack
from .pair import PairRegister, PlannedPair, new_graph_id
from .partitioner import OffloadPartitioner, PlanChangesNothing, PlanCompiledBefore
from .refine import Trial, attempt_quietly, lowest, refine, say
from .verify import autos_own_picks, fit_is_lowest, needs_unchanged_code, plan_kept, with_peak_not_lowered

log = logging.getLogger(__name__)

__all__ = ["GraphCompiler", "check_budget", "copy_graph_module"]

# The transfer ops as Inductor's scheduler sees them, for ``_compat.compile_with_inductor(join_runs=...)``.
_TRANSFERS = _compat.TransferOps(TRANSFER_OPS, OFFLOAD, RELOAD, WAIT)

Compiled = Callable[..., Any]
T = TypeVar("T")


class GraphCompiler:
    """Compiles Dynamo graphs with the fxoffload pass and keeps the pair that runs for each in
    ``register``."""

    def __init__(self, register: PairRegister) -> None:
        self.register = register
        # Each inner compile of the graph being compiled (``round`` set when the report takes them).
        self._compiles: list[CompileSpent] = []
        # By graph id: the pair compiled without offloading for verify_peak, and the outside it had;
        # the peak of its forward's code alone, lowered inside a plan's compile, and the outside then.
        self._unchanged_code: dict[int, tuple[OutsideMemory | None, PlannedPair]] = {}
        self._unchanged_forward_peak: dict[int, tuple[OutsideMemory | None, int]] = {}
        # By graph id: torch's partitions its plans priced (``inductor_recompute.Partition``), and the
        # options and outside they were made with; every later plan of the graph made with the same
        # prices on them (for another target, or from what the first steps measured).
        self._partitions: dict[int, tuple[tuple[OffloadOptions, OutsideMemory | None], Partitions]] = {}
        self._inside: list[tuple[str, float]] = []  # lowerings inside the compile running: what, seconds
        self._measured: Measured | None = None  # what the device measured of the graph's earlier plan

    def _inductor(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        partitioner: OffloadPartitioner,
        patches: dict[str, Any],
        on_output_code: Callable[[str, str], None] | None = None,
        code_only: bool = False,
        what: str = "the plan",
        judge: OffloadOptions | None = None,
    ) -> Compiled | None:
        """``graph`` compiled by Inductor; None where ``partitioner`` stopped it (``PlanChangesNothing``,
        ``PlanCompiledBefore``) before anything was lowered (its seconds count in ``compile_s``, not as
        a compile).
        ``code_only``: stopped once the code is generated (``_compat.compile_with_inductor``).
        ``what``: what the compile is for, as ``report.timings.spent`` says it. ``judge``: the options
        of a plan ``verify_peak`` judges (``_lower_unchanged_forward``, in this compile)."""
        start = time.perf_counter()
        sink = on_output_code or partitioner.record_output_code
        partitioner.keep_unchanged_forward = judge is not None
        after = (lambda lower: self._lower_unchanged_forward(partitioner, judge, lower)) if judge is not None else None
        self._inside = []
        _compat.register_fallbacks(_TRANSFERS)  # the first compile of a process lowers as the later ones
        try:
            compiled = on_roomy_stack(
                _compat.compile_with_inductor, graph, example_inputs, partitioner, patches, sink, code_only, after,
                graph_patches=lowering_config, not_donated=host_placeholders, join_runs=_TRANSFERS,
                output_strides=returned_strides,
                backward_groups=lambda: fusion_groups(partitioner.pair.plan if partitioner.pair is not None else None),
            )
        except Exception as e:
            same = _compat.raised_from(e, PlanCompiledBefore)
            stopped = same or _compat.raised_from(e, PlanChangesNothing)
            said = (
                f"{what}, stopped before lowering: " + ("the same graphs as a plan compiled before" if same else "it changes nothing")
                if stopped else f"{what} (failed)"
            )  # fmt: skip
            self._compiles.append(CompileSpent(said, time.perf_counter() - start, lowered=not stopped))
            if not stopped:
                raise
            return None
        inside = sum(s for _, s in self._inside)
        self._compiles.append(CompileSpent(what, time.perf_counter() - start - inside))
        self._compiles.extend(CompileSpent(said, s, inside=True, lowered=False) for said, s in self._inside)
        return compiled

    def compile(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        opts: OffloadOptions,
        outside: OutsideMemory | None = None,
        graph_id: int | None = None,
        pristine: fx.GraphModule | None = None,
        measured: Measured | None = None,
    ) -> tuple[Compiled, PlannedPair | None]:
        """``gm`` compiled, and its pair (None: no backward, or not lowered yet). ``outside``: what
        code before it holds, where not read from ``example_inputs``; ``graph_id``: the id of a
        graph compiled again; ``pristine``: an unchanged copy of ``gm`` made already; ``measured``:
        what the device measured of its copies under its earlier plan."""
        self.forget_spent()
        self._measured = measured
        outside = outside if outside is not None else read_outside(example_inputs)
        partitioner = self._partitioner(opts, outside, graph_id)
        if opts.inner == "aot_eager":
            start = time.perf_counter()
            compiled = _compat.compile_with_aot_eager(gm, example_inputs, partitioner)
            self._compiles.append(CompileSpent("the plan (aot_eager)", time.perf_counter() - start))
            return compiled, self._keep(partitioner.pair)
        patches = _compat.inductor_mode_options(opts.mode)
        if _compat.cudagraphs_enabled(patches):
            partitioner.disabled_reason = Reason(
                ReasonCode.CUDA_GRAPHS,
                f"CUDA graphs are on (mode={opts.mode!r}): a capture cannot hold the transfer "
                "events and host buffers, so offloading is off for this graph",
            )
        plain = partitioner.disabled_reason or opts.policy == "none"
        checked = opts.verify_peak and may_return_only_scalars(gm)  # what verify_peak judges
        if plain or (opts.memory_budget is None and not checked):
            compiled = self._inductor(gm, example_inputs, partitioner, patches)
            return compiled, self._keep(partitioner.pair)
        pristine = pristine if pristine is not None else copy_graph_module(gm)  # compile_fx may change gm
        if isinstance(opts.memory_budget, float) and _fraction_of_code(gm):
            # A fraction of the peak of the code that would run without offloading: lowered first.
            graph_id = partitioner.graph_id = graph_id if graph_id is not None else new_graph_id()
            what = "the code without offloading, for memory_budget's fraction, not built"
            self._judged_unchanged(pristine, example_inputs, opts, patches, outside, graph_id, what)
            self._from_unchanged(partitioner)
        best = self._to_budget(gm, pristine, example_inputs, opts, patches, partitioner, checked)
        compiled, pair = best.value
        if pair is not None and checked and compiled is not None:
            compiled, pair = self._no_higher_than_unchanged(pristine, example_inputs, opts, patches, compiled, pair)
        # The fit's word on the budget gives way to the code's (``check_budget``), where there is code to replay
        # (not for symbolic sizes).
        code = pair.code_memory() if pair is not None and opts.memory_budget is not None else None
        judged = code is not None and bool(code.points)
        say(best, drop=lambda w: judged and "cannot be reached" in str(w.message))
        # A plan that changes nothing, stopped before lowering or swapped by verify_peak; one judged
        # on its code was lowered as Inductor lowers it (donated buffers: ``_compat.donated``).
        if pair is not None and compiled is None:
            compiled = self._as_inductor_does(pristine, example_inputs, opts, patches, pair)
        assert compiled is not None
        pair = self._keep(pair)
        if pair is not None:
            check_budget(pair, strict=opts.strict)
        return compiled, pair

    def _as_inductor_does(
        self,
        pristine: fx.GraphModule,
        example_inputs: list[Any],
        opts: OffloadOptions,
        patches: dict[str, Any],
        pair: PlannedPair,
    ) -> Compiled:
        """A plan that changes nothing, compiled as ``backend="inductor"`` compiles it: its backward
        lowered at its first call. The report keeps the early code where it was judged on it; where
        the early compile was stopped before lowering (no budget: nothing to judge), this code goes
        on it."""
        unchanged = self._unchanged_partitioner(opts, pair.outside, pair.graph_id)
        log.debug("fxoffload: graph %d: the plan changes nothing; compiled as Inductor does", pair.graph_id)
        sink = pair.record_code if not pair.output_code else None
        what = "without offloading, as Inductor compiles it"
        compiled = self._inductor(copy_graph_module(pristine), example_inputs, unchanged, patches, sink, what=what)
        assert compiled is not None  # an unchanged partitioner is never told to stop
        return compiled

    def _partitioner(
        self, opts: OffloadOptions, outside: OutsideMemory | None, graph_id: int | None, target: int | None = None,
        judged_here: bool = False,
    ) -> OffloadPartitioner:
        # A backward lowered lazily (at its first call) is judged against the budget when its code comes.
        late = None if judged_here or opts.memory_budget is None else (lambda pair: check_budget(pair, opts.strict))
        measured = self._measured if opts.policy != "none" else None
        made = OffloadPartitioner(self.register, opts, outside, graph_id, target, late, measured)
        made.partitions_of = self._partitions_of
        self._from_unchanged(made)
        return made

    def _partitions_of(self, graph_id: int, options: OffloadOptions, outside: OutsideMemory | None) -> Partitions:
        """torch's partitions of graph ``graph_id`` priced by its plans made with ``options`` and
        ``outside`` held, to be added to (none yet: a new table, for these)."""
        entry = self._partitions.get(graph_id)
        if entry is None or entry[0] != (options, outside):
            entry = self._partitions[graph_id] = ((options, outside), {})
        return entry[1]

    def _from_unchanged(self, made: OffloadPartitioner) -> None:
        """What the code of ``made``'s graph without offloading, where it was lowered with ``made.outside``
        held (``compile``, ``verify_peak``), tells its plans: what it showed that the FX graphs do not,
        which the memory model counts (``PlanCosts.code``), and, for a fractional memory_budget, its
        replayed peak, what the budget is a fraction of (``PlanCosts.code_peak``)."""
        unchanged = _known(self._unchanged_code, made.graph_id, made.outside)
        if unchanged is None or made.options.policy == "none":
            return
        made.code = unchanged.code_facts()
        code = unchanged.code_memory() if isinstance(made.options.memory_budget, float) else None
        made.code_peak = code.peak_bytes if code is not None and code.points else None

    def _unchanged_partitioner(
        self, opts: OffloadOptions, outside: OutsideMemory | None, graph_id: int | None
    ) -> OffloadPartitioner:
        """A partitioner for the graph without offloading (what ``backend="inductor"`` compiles): no
        budget, and so no ``recompute="inductor"`` either (which needs one)."""
        plain = opts.replace(policy="none", memory_budget=None, recompute="fxoffload", offload_modules=())
        return self._partitioner(plain, outside, graph_id, judged_here=True)

    def spent(self, round: int = 0) -> tuple[CompileSpent, ...]:
        """The compiles of the graph being compiled, so far (one that failed included)."""
        return tuple(dataclasses.replace(c, round=round) for c in self._compiles)

    def forget_spent(self) -> None:
        """A new attempt at a graph begins: ``spent`` says its compiles only (``compile`` does this too)."""
        self._compiles = []

    def _keep(self, pair: PlannedPair | None) -> PlannedPair | None:
        """Record ``pair`` as the one that runs, its report saying what compiling it took."""
        if pair is not None:
            timings = pair.report.timings
            if timings is not None:
                spent = dataclasses.replace(
                    timings, compiles=sum(c.lowered for c in self._compiles),
                    compile_s=sum(c.seconds for c in self._compiles), spent=self.spent(),
                )  # fmt: skip
                pair = pair.with_report(timings=spent)
            pair = self.register.record(pair)
        return pair

    def _to_budget(
        self,
        gm: fx.GraphModule,
        pristine: fx.GraphModule,
        example_inputs: list[Any],
        opts: OffloadOptions,
        patches: dict[str, Any],
        first: OffloadPartitioner,
        checked: bool = False,
    ) -> Trial[tuple[Compiled, PlannedPair | None]]:
        """The pair compiled with both graphs lowered now, its code replayed and, with a
        ``memory_budget``, planned and compiled again for a target lowered by the miss where that
        code peaks over it (``refine``), the lowest peak kept. The FX fit is no verdict under
        Inductor (it is 9-38% high where Inductor fuses): with ``strict``, the code is judged, by
        the caller (``check_budget``), not the fit."""
        early = _compat.can_lower_backward_at_compile()
        plan_opts = opts.replace(strict=False) if opts.strict and early else opts
        first.options = plan_opts
        if early:  # judged by ``compile`` once both graphs are lowered, not when the backward's code comes
            first.on_backward_code = None
            # Without a budget only a plan that changes something is judged: stop before lowering.
            first.stop_if_unchanged = opts.memory_budget is None
        replans: list[str] = []

        tried: list[int | None] = []
        judge = opts if checked and early else None  # verify_peak's unchanged forward, lowered in the plan's compile
        # The graphs of each plan compiled, and its code's peak once judged: a plan again that takes nothing
        # more is not lowered again, and judged by that peak (``refine`` lowers its target once more).
        compiled_plans: dict[tuple[str, str], int | None] = {}

        def attempt(target: int | None) -> Trial | None:
            partitioner = first if not tried else self._partitioner(
                plan_opts, first.outside, first.graph_id, target, judged_here=True
            )
            tried.append(target)
            partitioner.compiled_plans = compiled_plans
            graph = gm if partitioner is first else copy_graph_module(pristine)
            what = "the plan" if target is None else f"the plan for a lower target, {fmt_bytes(target)} (budget)"
            try:
                (compiled, lowered), said = attempt_quietly(
                    lambda: self._lowered(graph, example_inputs, partitioner, patches, what=what, judge=judge)
                )
            except Exception as e:
                if partitioner is first or "strict=True" not in str(e):
                    raise
                return None  # strict=True and a lower target out of the FX model's reach: keep what was tried
            pair = partitioner.pair
            # Stopped: the plan changes nothing (``compile`` compiles it as Inductor does), or it is one
            # compiled before (``refine`` keeps the trials it judged), judged by that one's peak.
            if compiled is None:
                peak = compiled_plans.get(partitioner.rewritten) if partitioner is not first and pair else None
                budget = pair.memory_budget if peak is not None and pair is not None else None
                return Trial((None, pair), peak, target, said=said, budget=budget, repeats=peak is not None)
            timeline = pair.code_memory() if pair is not None and lowered else None
            if pair is None or timeline is None or not timeline.points or pair.memory_budget is None:
                return Trial((compiled, pair if lowered else None), None, target, said=said)
            if partitioner.rewritten is not None:
                compiled_plans[partitioner.rewritten] = timeline.peak_bytes
            plan = pair.plan
            aimed = target if target is not None else first_aim(opts.memory_budget, plan)
            lowest_reachable = fit_is_lowest(pair, timeline, aimed if aimed is not None else pair.memory_budget)
            return Trial(
                (compiled, pair), timeline.peak_bytes, aimed, lowest_reachable, said, pair.memory_budget,
                cost=plan.time_cost, raisable=plan.budget_chose,
            )  # fmt: skip

        def on_replan(trial: Trial, target: int) -> None:
            _, pair = trial.value
            replans.append(_replanned(len(replans) + 1, trial, pair.memory_budget, target))
            log.info("fxoffload: graph %d: %s", pair.graph_id, replans[-1])

        # The budget in bytes is the first plan's (a fraction needs its baseline): read from its trial.
        best, _ = refine(None, attempt, opts.max_replans, on_replan, tolerance=BUDGET_TOLERANCE)
        assert best is not None
        compiled, pair = best.value
        if pair is not None and replans:
            pair = pair.with_report(replans=tuple(replans))
            best = Trial((compiled, pair), best.peak, best.target, said=best.said)
        return best

    def _lowered(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        partitioner: OffloadPartitioner,
        patches: dict[str, Any],
        code_only: bool = False,
        what: str = "the plan",
        judge: OffloadOptions | None = None,
    ) -> tuple[Compiled | None, bool]:
        """``graph`` compiled by Inductor with both graphs lowered now where this torch can (None:
        stopped, ``_inductor``; ``code_only``: for the code alone, which cannot run; ``judge``: as there)."""
        with _compat.backward_lowered_at_compile() as lowered:
            compiled = self._inductor(
                graph, example_inputs, partitioner, patches, code_only=code_only, what=what, judge=judge
            )
        return compiled, lowered

    def _no_higher_than_unchanged(
        self,
        pristine: fx.GraphModule,
        example_inputs: list[Any],
        opts: OffloadOptions,
        patches: dict[str, Any],
        compiled: Compiled,
        pair: PlannedPair,
    ) -> tuple[Compiled | None, PlannedPair]:
        """``verify_peak`` (see ``verify``): the compiled pair, or the unchanged pair (not compiled to
        run: None) where the code Inductor generated for the plan peaks higher."""
        timeline = pair.code_memory()
        if timeline is None or not needs_unchanged_code(pair, timeline, opts):
            return compiled, pair
        mine = autos_own_picks(pair.plan, opts.offload_modules)
        forward = _known(self._unchanged_forward_peak, pair.graph_id, pair.outside)
        if forward is not None and plan_kept(timeline.peak_bytes, forward, mine):
            log.debug(
                "fxoffload: graph %d: Inductor's code peaks at %s, below its forward without offloading (%s)",
                pair.graph_id, fmt_bytes(timeline.peak_bytes), fmt_bytes(forward),
            )  # fmt: skip
            return compiled, pair
        what = "verify_peak: the code without offloading, not built"
        unchanged = self._judged_unchanged(pristine, example_inputs, opts, patches, pair.outside, pair.graph_id, what)
        base = unchanged.code_memory() if unchanged is not None else None
        if base is None or not base.points:
            return compiled, pair
        kept = lowest(
            [Trial((compiled, pair), timeline.peak_bytes), Trial((None, unchanged), base.peak_bytes)],
            keep_first_on_tie=not mine,
        )
        if kept.value[1] is pair:
            log.info(
                "fxoffload: graph %d: Inductor's code peaks at %s with the plan, %s without it",
                pair.graph_id, fmt_bytes(timeline.peak_bytes), fmt_bytes(base.peak_bytes),
            )  # fmt: skip
            return compiled, pair.with_report(unchanged_code_peak=base.peak_bytes)
        swapped = with_peak_not_lowered(unchanged, pair, timeline, base.peak_bytes)
        log.info("fxoffload: graph %d: %s", pair.graph_id, swapped.plan.note)
        return None, swapped  # it changes nothing: ``compile`` compiles it as Inductor does

    def _lower_unchanged_forward(
        self, partitioner: OffloadPartitioner, opts: OffloadOptions, lower_like_forward: Callable[[fx.GraphModule], str]
    ) -> None:
        """Inside a plan's compile, once both its graphs are lowered: where ``verify_peak`` cannot
        judge the plan's code without the code of the pair without offloading, the forward torch's
        partitioner made for it (``UnchangedForward``) lowered like the plan's forward, for its code
        alone (no trace, no partition, no kernel), once per graph and what code before it holds. Its
        replay's peak, the pair's without offloading up to its forward's end, is a lower bound of that
        pair's: where the plan's code peaks under it, the pair need not be lowered whole."""
        pair, unchanged = partitioner.pair, partitioner.unchanged_forward
        timeline = pair.code_memory() if pair is not None else None
        if unchanged is None or timeline is None or not needs_unchanged_code(pair, timeline, opts):
            return
        lowered = (self._unchanged_forward_peak, self._unchanged_code)  # that forward, or the whole pair
        if any(_known(table, pair.graph_id, pair.outside) is not None for table in lowered):
            return
        # Not where the FX model's forward, which Inductor's fusion mostly lowers, peaks no higher than
        # the plan's code (the MLP's, at the backward's end): that code would not settle it.
        before = pair.memory_before
        modelled = before.phase_peak("forward") if before else 0
        if modelled and not plan_kept(timeline.peak_bytes, modelled, autos_own_picks(pair.plan, opts.offload_modules)):
            return
        start = time.perf_counter()
        try:
            code = lower_like_forward(unchanged.graph)
        except Exception as e:  # never fail a compile over a check: the pair is lowered whole instead
            log.debug("fxoffload: graph %d: lowering its unchanged forward failed (%s)", pair.graph_id, e)
            return
        finally:
            self._inside.append(("verify_peak: the forward without offloading, in the plan's compile, not built",
                                 time.perf_counter() - start))  # fmt: skip
        outside = pair.outside.outside(unchanged.kept_bytes) if pair.outside is not None else 0
        forward = replay_forward(code, unchanged.saved_dtypes, outside, code_scratch(code, pair.plan.costs))
        if forward is not None and forward.points:
            self._unchanged_forward_peak[pair.graph_id] = (pair.outside, forward.peak_bytes)

    def _judged_unchanged(
        self,
        pristine: fx.GraphModule,
        example_inputs: list[Any],
        opts: OffloadOptions,
        patches: dict[str, Any],
        outside: OutsideMemory | None,
        graph_id: int,
        what: str,
    ) -> PlannedPair | None:
        """The pair of graph ``graph_id`` without offloading, lowered for its code alone (no kernels
        built: a plan swapped for it is compiled again as Inductor does), once per graph and what code
        before it holds (``outside``): a plan made again from measured times is judged against the same
        one. None where it cannot be had."""
        cached = _known(self._unchanged_code, graph_id, outside)
        if cached is not None:
            return cached
        unchanged = self._unchanged_partitioner(opts, outside, graph_id)
        try:
            attempt_quietly(
                lambda: self._lowered(
                    copy_graph_module(pristine), example_inputs, unchanged, patches, code_only=True, what=what
                )
            )
        except Exception as e:  # never fail a compile over a check: keep the plan, unchecked
            log.warning(
                "fxoffload: graph %d: compiling it unchanged (%s) failed (%s); going on without it", graph_id, what, e
            )  # fmt: skip
            return None
        if unchanged.pair is not None:
            self._unchanged_code[graph_id] = (outside, unchanged.pair)
        return unchanged.pair


def check_budget(pair: PlannedPair, strict: bool = False) -> None:
    """The verdict on ``memory_budget`` by the code that will run (``budget_verdict``)."""
    predicted = pair.memory_after.peak_bytes if pair.memory_after is not None else 0
    hint = decisions_hint(pair.plan)
    swapped = any(d.reason.code == ReasonCode.PEAK_NOT_LOWERED for d in pair.plan.decisions)  # verify_peak's
    budget_verdict(
        pair.graph_id, pair.memory_budget, pair.code_memory(), predicted, pair.report.replans, strict, hint,
        dropped=pair.plan.note if swapped else "",
    )  # fmt: skip


def _replanned(n: int, trial: Trial, budget: int, target: int) -> str:
    """``report.replans``' line for plan ``n``, planned again for ``target``."""
    side = "over" if trial.peak is not None and trial.peak > budget else "well under"
    what = f"plan {n} made the graphs of a plan before it, whose code" if trial.repeats else f"Inductor's code of plan {n}"
    return (
        f"{what} peaked at {fmt_bytes(trial.peak or 0)}, {side} memory_budget {fmt_bytes(budget)}; planned again for "
        f"{fmt_bytes(target)} on the FX model"
    )


def _known(
    table: dict[int, tuple[OutsideMemory | None, T]], graph_id: int | None, outside: OutsideMemory | None
) -> T | None:
    """What ``table`` keeps of graph ``graph_id`` lowered with ``outside`` held (None: nothing, or
    kept for another outside)."""
    entry = table.get(graph_id) if graph_id is not None else None
    return entry[1] if entry is not None and entry[0] == outside else None


def _fraction_of_code(gm: fx.GraphModule) -> bool:
    """Whether a fractional memory_budget is taken of the peak of ``gm``'s code without offloading:
    where both graphs can be lowered at compile time, and their code replayed (fixed sizes), and
    there may be a backward (else there is no pair, nor budget to judge)."""
    return _compat.can_lower_backward_at_compile() and static_shapes(gm) and may_have_a_backward(gm)
