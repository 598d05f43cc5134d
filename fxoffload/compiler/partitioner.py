"""The partition function AOTAutograd calls: torch's own partitioner, then the fxoffload pass."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import _compat
from ..analysis.blocks import NoRepeatedBlocks, block_tags
from ..analysis.memory import CodeFacts, kept_saved_bytes, param_grad_bytes, simulate
from ..analysis.outside import OutsideMemory
from ..options import OffloadOptions
from ..planning.measured import Measured
from ..reasons import Reason
from ..reporting.report import OffloadReport, PassTimings
from ..rewrite.host_copies import find_host_copies
from ..rewrite.mutated_reads import ReadsMutatedInput, mutated_reads_added, protect_mutated_reads
from ..rewrite.random_ops import keep_random_ops_saved, keep_size_ops_saved
from .inductor_recompute import Partitions
from .offload_pass import offload_pass
from .pair import PairRegister, PlannedPair, new_graph_id

log = logging.getLogger(__name__)

__all__ = ["OffloadPartitioner", "PlanChangesNothing", "PlanCompiledBefore", "UnchangedForward"]


class PlanChangesNothing(Exception):
    """Raised by a partitioner told to ``stop_if_unchanged`` once its plan changes neither graph:
    the compile that would lower both graphs now (to judge the plan's code) is abandoned before
    Inductor lowers anything, and the caller compiles the graph as ``backend="inductor"`` does."""


class PlanCompiledBefore(Exception):
    """Raised by a partitioner given the graphs already compiled for a graph (``compiled_plans``) when
    its plan rewrites them as one of those: planned again for a lower target, the fit took nothing
    more, and lowering the same graphs again would give the same code. The compile is abandoned before
    Inductor lowers anything; the caller keeps what it compiled before."""


@dataclasses.dataclass(frozen=True)
class UnchangedForward:
    """The forward torch's partitioner made, before the pass changed it: what ``verify_peak`` lowers
    for its code inside the plan's compile (``GraphCompiler``), whose replay's peak is a lower bound of
    the pair's without offloading, with what that replay needs."""

    graph: fx.GraphModule
    saved_dtypes: tuple[torch.dtype | None, ...]  # the saved tensors' dtypes, in the order it returns them
    kept_bytes: int  # device bytes one call keeps for its backward (``memory.kept_saved_bytes``)


def _torchs(
    options: OffloadOptions, joint: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any],
    recompute: frozenset[str], memory_budget: float | None, per_block: bool,
) -> tuple[fx.GraphModule, fx.GraphModule]:  # fmt: skip
    """torch's partitioner on ``joint``; ``recompute``: nodes tagged for it; ``memory_budget``: its
    activation budget; ``per_block``: each repeated block recomputed in turn (``analysis.blocks``).
    Random ops are kept saved where it may recompute on its own (``rewrite.random_ops``)."""
    if recompute:
        _compat.tag_must_recompute(joint, recompute)
    if (memory_budget is not None or per_block) and options.broken_rule != "random_ops_saved":
        keep_random_ops_saved(joint)
    if (memory_budget is not None or per_block) and options.broken_rule != "size_ops_saved":
        keep_size_ops_saved(joint)
    blocks = block_tags(joint) if per_block else None
    if per_block and blocks is None:
        raise NoRepeatedBlocks("fxoffload: no repeated blocks (ModuleList items) in this graph's forward")
    tags = _compat.checkpoint_tags(joint, blocks.save, blocks.recompute) if blocks else contextlib.nullcontext()
    with tags:
        return _compat.call_partitioner(
            options.partitioner, joint, joint_inputs, activation_memory_budget=memory_budget, **kwargs
        )


class OffloadPartitioner(_compat.CustomPartitionerFn):
    """torch's own partitioner followed by the fxoffload pass; ``pair`` is what it made.

    ``register``: the backend's pairs (read for the host bytes planned by the other graphs);
    ``outside``: what code before this graph holds on its device, "outside" in every timeline and
    in the budget; ``graph_id``: the id of a graph planned again (None: a new one);
    ``budget_target``: a peak below ``memory_budget`` to fit (a plan made again after a miss).
    ``on_backward_code(pair)`` runs when Inductor's backward code arrives. ``measured``: what the
    device measured of the graph's copies under its earlier plan (``planning.measured``).
    """

    def __init__(
        self,
        register: PairRegister,
        options: OffloadOptions,
        outside: OutsideMemory | None = None,
        graph_id: int | None = None,
        budget_target: int | None = None,
        on_backward_code: Callable[[PlannedPair], None] | None = None,
        measured: Measured | None = None,
    ) -> None:
        self.register = register
        self.options = options
        self.outside = outside
        self.graph_id = graph_id
        self.budget_target = budget_target
        self.on_backward_code = on_backward_code
        self.measured = measured
        self.disabled_reason: Reason | str = ""
        self.pair: PlannedPair | None = None
        # Abandon the compile (``PlanChangesNothing``) where the plan changes nothing: nothing to judge.
        self.stop_if_unchanged = False
        # Keep the forward torch's partitioner made, before the pass changes it (``unchanged_forward``).
        self.keep_unchanged_forward = False
        # The rewritten graphs' code of the plans compiled for this graph (shared by the compiles of a
        # budget's re-plans): one seen before stops the compile (``PlanCompiledBefore``). None: never.
        self.compiled_plans: dict[tuple[str, str], int | None] | None = None  # with their code's peaks
        self.rewritten: tuple[str, str] | None = None  # the graphs its plan made, as ``compiled_plans`` keys them
        # torch's partitions of a graph priced by its plans made with these options and outside
        # (``GraphCompiler``): a plan made again prices on them (``inductor_recompute.Partition``).
        self.partitions_of: Callable[[int, OffloadOptions, OutsideMemory | None], Partitions] | None = None
        self.unchanged_forward: UnchangedForward | None = None
        # The peak of Inductor's code for this graph without offloading, replayed, where it was lowered
        # before the plan: a fractional memory_budget is a fraction of it (``PlanCosts.code_peak``).
        self.code_peak: int | None = None
        # What that code showed that the FX graphs do not (``PlannedPair.code_facts``): in the memory
        # model of every plan of this graph (``PlanCosts.code``).
        self.code: CodeFacts | None = None

    def record_output_code(self, kind: str, code: str) -> None:
        """Inductor's wrapper code for the graphs of this pair (``PlannedPair.output_code``)."""
        if self.pair is not None:
            self.pair.record_code(kind, code)
            if kind == "backward" and self.on_backward_code is not None:
                self.on_backward_code(self.pair)

    # Inductor copies and pickles its config, this object included, for its FX graph cache key:
    # ``uuid`` stands for it there (the pair it holds has fake tensors in node metadata, and a
    # callback; the rewritten graphs are in the key anyway).
    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadPartitioner:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (repr(self.uuid()),))

    def uuid(self) -> Any:
        # Cache key part for Inductor; AOTAutograd's cache is off while we compile (see _compat).
        return (
            "fxoffload", repr(self.options), self.budget_target, self.code_peak, self.code, self.disabled_reason,
            self.measured is not None,
        )  # fmt: skip

    def _partitions(self, graph_id: int) -> Partitions | None:
        return self.partitions_of(graph_id, self.options, self.outside) if self.partitions_of is not None else None

    def __call__(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        # 1. torch's min-cut partitioner may recompute, in the backward, a value that reads an input
        #    the forward mutates afterwards (wrong gradients): keep those values saved.
        protect_mutated_reads(joint, kwargs.get("num_fwd_outputs"))
        # 2. torch's partitioner, and again for what the plan recomputes (timed apart from the pass).
        repartition_s = [0.0]

        def partition(
            recompute: frozenset[str] = frozenset(), memory_budget: float | None = None, per_block: bool = False
        ) -> tuple[fx.GraphModule, fx.GraphModule]:
            """torch's partition (``_torchs``), refused where its backward reads an input the forward
            mutates in place that torch's own partition's backward does not (``mutated_reads_added``)."""
            again = bool(recompute) or memory_budget is not None or per_block
            start = time.perf_counter()
            try:
                made = _torchs(self.options, joint, joint_inputs, kwargs, recompute, memory_budget, per_block)
            finally:
                if again:
                    repartition_s[0] += time.perf_counter() - start
            added = mutated_reads_added(joint, made[1], first_reads[0]) if again and first_reads else []
            if added:
                raise ReadsMutatedInput(f"its backward reads {', '.join(added)} after the forward updates it in place")
            return made

        first_reads: list[frozenset[str]] = []  # the placeholders of torch's own partition's backward
        fw, bw = partition()
        first_reads.append(frozenset(n.name for n in bw.graph.find_nodes(op="placeholder")))
        nodes_in = len(fw.graph.nodes), len(bw.graph.nodes)
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static = tuple(kwargs.get("static_lifetime_input_indices") or ())
        if self.keep_unchanged_forward:
            self.unchanged_forward = unchanged_forward(fw, bw, num_fwd_outputs, static)
        # Kept: the partitioners of its re-plans take it (``GraphCompiler``).
        graph_id = self.graph_id = self.graph_id if self.graph_id is not None else new_graph_id()
        host_before = self.register.host_bytes_planned(except_graph=graph_id)  # the report says it
        host_left = self.register.host_left(self.options.host_budget, graph_id)
        # 3. The pass: lifetimes, costs, plan, rewrite.
        start = time.perf_counter()
        fw, bw, plan = offload_pass(
            fw, bw, num_fwd_outputs, static, self.options, host_bytes_available=host_left,
            disabled_reason=self.disabled_reason, repartition=partition, outside=self.outside,
            budget_target=self.budget_target, graph_id=graph_id, measured=self.measured, code_peak=self.code_peak,
            code=self.code, partitions=self._partitions(graph_id),
        )  # fmt: skip
        pass_s = time.perf_counter() - start - repartition_s[0]
        # 4. The memory model of the rewritten pair, and the pair with its report.
        start = time.perf_counter()
        kept = kept_saved_bytes(fw, num_fwd_outputs, static)
        memory_before = (plan.partition_costs or plan.costs).baseline  # before any change
        memory_after = memory_before
        if plan.changes_graphs:
            held, later = (self.outside.outside(kept), self.outside.outside_backward(kept)) if self.outside else (0, 0)
            temporaries, code = (plan.costs.temporaries, plan.costs.code) if plan.costs is not None else ({}, None)
            memory_after = simulate(fw, bw, num_fwd_outputs, static, temporaries, held, later, self.options.fuses, code)
        timings = PassTimings(pass_s, repartition_s[0], time.perf_counter() - start, *nodes_in)
        output_code: dict[str, str] = {}
        code_scratch: dict[str, tuple[tuple[int, int], ...]] = {}
        grads = param_grad_bytes(fw, bw, static)
        copies = find_host_copies(fw, bw, memory_after)
        report = OffloadReport.from_plan(
            graph_id, plan, fw, bw, self.options.host_budget, host_before, memory_before, memory_after,
            timings=timings, num_fwd_outputs=num_fwd_outputs, outside=self.outside, kept_bytes=kept,
            param_grad_bytes=grads, output_code=output_code, host_copies=copies, code_scratch=code_scratch,
        )  # fmt: skip
        self.pair = PlannedPair(
            graph_id, plan, fw, bw, num_fwd_outputs, static, memory_before, memory_after, self.outside, kept, grads,
            report, output_code, host_copies=copies, code_scratch=code_scratch,
        )  # fmt: skip
        if log.isEnabledFor(logging.DEBUG):  # the table takes 0.5 s on a 12-block GPT: not for nothing
            log.debug("fxoffload plan for graph %d:\n%s", graph_id, report.table())
        _compat.trace_artifact("fxoffload_plan", report.to_json, encoding="json")
        _compat.trace_artifact("fxoffload_graphs", report.graph_code)
        self._stop_if_asked(plan.changes_graphs, fw, bw)
        return fw, bw

    def _stop_if_asked(self, changes_graphs: bool, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
        """Abandon the compile, before Inductor lowers anything, where told to: a plan that changes
        nothing (``stop_if_unchanged``), or graphs rewritten as a plan compiled before (``compiled_plans``)."""
        if self.stop_if_unchanged and not changes_graphs:
            raise PlanChangesNothing(f"fxoffload: graph {self.graph_id}: the plan changes nothing")
        if self.compiled_plans is not None:
            rewritten = self.rewritten = (fw.code, bw.code)
            if rewritten in self.compiled_plans:
                raise PlanCompiledBefore(f"fxoffload: graph {self.graph_id}: the plan rewrites the graphs as one compiled before")
            self.compiled_plans[rewritten] = None


def unchanged_forward(
    fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, static: tuple[int, ...]
) -> UnchangedForward:
    """A copy of ``fw`` as torch's partitioner made it (its nodes' metadata shared, not copied: the
    same fake tensors), and what the replay of its code needs from the pair."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(fw.graph, {}))
    saved = [p.meta.get("val") for p in bw.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents_")]
    dtypes = tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in saved)
    return UnchangedForward(fx.GraphModule(fw, graph), dtypes, kept_saved_bytes(fw, num_fwd_outputs, static))
