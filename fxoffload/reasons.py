"""What the planner decides for a saved tensor, and why: typed values with stable codes.

``Action`` is the decision; its members are ``str``s equal to the old string values ("offload",
"keep", "recompute"), so ``d.decision == "offload"`` and JSON written before it keep working.
A ``Reason`` pairs a stable snake_case ``code`` (one of ``ReasonCode``, for tools and tests) with the
sentence people read (``text``, free to change between versions).
"""

from __future__ import annotations

import dataclasses
import enum


class _StrEnum(str, enum.Enum):
    """``str(member)`` and f-strings give the value, as ``enum.StrEnum`` (Python >= 3.11) does."""

    __str__ = str.__str__
    __format__ = str.__format__


class Action(_StrEnum):
    """The decision for one saved tensor."""

    OFFLOAD = "offload"  # copied to host memory after its last forward use, reloaded before the backward
    KEEP = "keep"  # stays on the device
    RECOMPUTE = "recompute"  # rebuilt in the backward by torch's partitioner


class ReasonCode(_StrEnum):
    """Every reason the planner gives, by a code that stays the same between versions.

    The table in docs/user-guide.md ("Reason codes") describes each one.
    """

    # The whole graph is left unchanged.
    POLICY_NONE = "policy_none"
    CUDA_GRAPHS = "cuda_graphs"
    DISABLED = "disabled"
    NO_ACCELERATOR = "no_accelerator"
    # Hard rules: the tensor can never be offloaded (some also refuse recomputation).
    CPU_TENSOR = "cpu_tensor"
    META_TENSOR = "meta_tensor"
    STATIC_INPUT = "static_input"
    GRAPH_INPUT = "graph_input"
    USER_OUTPUT = "user_output"
    SHARED_STORAGE = "shared_storage"
    NON_DENSE = "non_dense"
    LAZY_VIEW = "lazy_view"
    UNUSED_IN_BACKWARD = "unused_in_backward"
    EMPTY = "empty"
    TOO_SMALL = "too_small"
    # Thresholds and budgets.
    MIN_BYTES = "min_bytes"
    HOST_BUDGET = "host_budget"
    # policy="auto" and memory_budget.
    TOO_SOON = "too_soon"
    NOT_HIDDEN = "not_hidden"
    OP_TIME = "op_time"
    MEASURED_STALL = "measured_stall"
    UNKEPT_SOURCE = "unkept_source"
    NOT_MEASURED = "not_measured"
    HIDDEN = "hidden"
    IDLE_WINDOW = "idle_window"
    POLICY_ALL = "policy_all"
    PEAK_NOT_LOWERED = "peak_not_lowered"
    PEAK_BARELY_LOWERED = "peak_barely_lowered"
    BUDGET_OFFLOAD = "budget_offload"
    BUDGET_RECOMPUTE = "budget_recompute"
    INDUCTOR_RECOMPUTE = "inductor_recompute"
    RECOMPUTE_CHEAPER = "recompute_cheaper"
    RECOMPUTE_SOURCE = "recompute_source"
    STILL_SAVED = "still_saved"
    # The user's own policy.
    USER_POLICY = "user_policy"
    USER_MODULE = "user_module"
    USER_RECOMPUTE_UNAVAILABLE = "user_recompute_unavailable"
    # Why a tensor cannot be recomputed (``Decision.recompute_refused``).
    NOT_COMPUTED = "not_computed"
    MUST_SAVE = "must_save"
    MULTI_OUTPUT = "multi_output"
    NOT_COMPUTE = "not_compute"
    NOT_ATEN = "not_aten"
    RANDOM_OP = "random_op"
    MUTATES_INPUTS = "mutates_inputs"
    OTHER_NAMESPACE = "other_namespace"
    MUTATED_INPUT = "mutated_input"
    INPUT_NOT_KEPT = "input_not_kept"
    NOT_A_TENSOR = "not_a_tensor"


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a decision was made: a stable ``code`` and the human ``text``."""

    code: ReasonCode
    text: str

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "code", ReasonCode(self.code))
        except ValueError:
            codes = ", ".join(c.value for c in ReasonCode)
            raise ValueError(f"fxoffload: unknown reason code {self.code!r}; codes are: {codes}") from None

    def __str__(self) -> str:
        return self.text

    def prefixed(self, prefix: str) -> Reason:
        """The same code, the sentence after ``prefix``."""
        return Reason(self.code, f"{prefix}{self.text}")
