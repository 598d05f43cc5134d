"""What a plan is: one decision and reason per saved tensor, with what the cost model predicted. Data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.fx as fx

from ..analysis.cost import DeviceRates
from ..analysis.lifetimes import SavedTensor
from ..analysis.memory import CallOutside, CodeFacts, MemoryTimeline
from ..analysis.recompute import RecomputeOption
from ..reasons import Action, Reason, ReasonCode
from ..sizes import host_bytes
from .schedule import TransferTiming

__all__ = ["Decision", "OffloadPlan", "PlanCosts", "planned_host_bytes"]


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
    # Scratch bytes ops allocate while they run (``measure.standalone.op_temporaries``), by node of
    # this pair; the memory model adds them at the node's point. Empty where they were not measured.
    temporaries: Mapping[fx.Node, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # What Inductor's code for this graph without offloading showed that the FX graphs do not (its
    # calls' scratch, its copies of saved inputs: ``memory.CodeFacts``), where it was lowered before
    # the plan; in ``baseline`` and in every memory model of the pair's plans. None: not lowered.
    code: CodeFacts | None = None
    outside: int = 0  # device bytes code before the pair holds through it (``analysis.outside``), in ``baseline``
    # The calls of this pair it is planned for (``OutsideMemory.calls``), where earlier calls of
    # the same pair keep what it keeps (``kept``, before any change): ``memory.with_plan``.
    calls: tuple[CallOutside, ...] = ()
    kept: int = 0
    # The measured corrections in ``fw_starts`` / ``bw_starts`` (``Measured.corrected``): the model's
    # node times were multiplied by these. A measurement of this plan's copies is divided by them.
    scale: tuple[float, float] = (1.0, 1.0)
    # The device ``temporaries`` were measured on (``str(torch.device)``), where the calls of the
    # pair's compiled code are measured too (``compiler.costs.code_scratch``); None: not measured.
    scratch_on: str | None = None
    # The peak of Inductor's code for this pair without offloading, lowered and replayed before the
    # plan (``compiler.compile``): what a fractional memory_budget is a fraction of. None: not lowered.
    code_peak: int | None = None


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    decisions: tuple[Decision, ...]
    policy: str
    note: str = ""  # why the whole graph was left unchanged, if it was
    stall: float = 0.0  # predicted seconds the compute stream waits for copies
    memory_budget: int | None = None  # the user's memory_budget in bytes, when one was asked for
    # The peak the budget fit aimed at on the FX model: ``memory_budget``, a lower target when a plan
    # is made again because the last one missed the budget (``compiler.refine``), or, for a fraction
    # of the code's peak, the same fraction of the model's (``budget.fit_target``; above the budget
    # where the model over-counts).
    budget_target: int | None = None
    costs: PlanCosts | None = None  # what the cost model predicted, when it was used
    wait_at_once: frozenset[str] = frozenset()  # offloads whose copies are not hidden (budget)
    # The cost model's view of the partition before recomputation (the recomputed tensors' rows
    # refer to it); None when nothing is recomputed.
    partition_costs: PlanCosts | None = None
    # The budget fit's own estimate of the peak with this plan (None without memory_budget).
    fit_peak: int | None = None
    # Kept although its memory model peaks over the target: within what that model may over-count
    # (``analysis.fusion`` follows Inductor's scheduler in part), the code Inductor generates judges
    # it (a lower target is planned on a miss).
    judged_on_code: bool = False

    @property
    def offloaded(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.decision == Action.OFFLOAD)

    @property
    def recomputed(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.decision == Action.RECOMPUTE)

    @property
    def recompute_seconds(self) -> float:
        """Predicted compute added to the backward by recomputation."""
        return sum(d.recompute.seconds for d in self.recomputed if d.recompute is not None)

    @property
    def op_seconds(self) -> float:
        """The compute stream's own time a step in the offloads' op calls (``DeviceRates.op_cost`` of
        each offloaded tensor: its copies hidden or not, the calls that issue and wait for them run)."""
        if self.costs is None:
            return 0.0
        return sum(self.costs.rates.op_cost(d.saved.nbytes) for d in self.offloaded)

    @property
    def time_cost(self) -> float:
        """What the plan adds to a step, as the cost model prices it: the stall, the recomputation and
        the offloads' op calls. The plans that meet a budget are chosen by it."""
        return self.stall + self.recompute_seconds + self.op_seconds

    @property
    def offloaded_bytes(self) -> int:
        return sum(d.saved.nbytes for d in self.offloaded)

    @property
    def host_bytes(self) -> int:
        """Host memory the offloaded tensors' buffers really take (``planned_host_bytes``)."""
        return sum(planned_host_bytes(d.saved) for d in self.offloaded)

    @property
    def changes_graphs(self) -> bool:
        return bool(self.offloaded or self.recomputed)

    @property
    def budget_chose(self) -> bool:
        """Whether ``memory_budget`` decided anything here (what a raised target could undo)."""
        return any(d.reason.code in _BUDGET_CODES for d in self.decisions)


_BUDGET_CODES = frozenset({ReasonCode.BUDGET_OFFLOAD, ReasonCode.BUDGET_RECOMPUTE, ReasonCode.INDUCTOR_RECOMPUTE})


def planned_host_bytes(t: SavedTensor) -> int:
    """Host bytes the buffer of an offloaded ``t`` takes (``sizes.host_bytes``): pinned for
    accelerator tensors, pageable for CPU ones. ``host_budget`` counts these."""
    return host_bytes(t.nbytes, pinned=t.device.type != "cpu")
