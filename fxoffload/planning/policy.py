"""A user's own policy: what ``policy=callable`` sees, and what ``offload_modules`` matches. Pure.

    def policy(t: fxoffload.TensorInfo):
        if t.module_path.endswith("mlp.fc1") and t.nbytes >= 8 << 20:
            return "offload"
        return None  # the planner decides ("auto", with memory_budget if one is set)

    torch.compile(model, backend=fxoffload.backend(policy=policy))
    torch.compile(model, backend=fxoffload.backend(offload_modules=("*.mlp.*",)))

A user's choice is final for the planner's own judgement (min_bytes, whether the copies can be
hidden, memory_budget), never for the rules that make a choice impossible (parameters, returned
tensors, shared storage, host_budget, ...): those keep the tensor, with a reason saying so.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch

from ..analysis.lifetimes import SavedTensor
from ..options import OffloadOptions
from ..reasons import Action, Reason, ReasonCode


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One saved tensor, as a user policy sees it."""

    name: str  # the forward graph's node name (also the name in reports)
    shape: tuple[int, ...]  # size hints for symbolic sizes
    dtype: torch.dtype
    nbytes: int
    device: torch.device
    producer: str  # the op that produced it ("mm", "addmm", "placeholder" for graph inputs, ...)
    # The module whose forward produced it, dotted from the compiled module ("layers.0.mlp.fc1"); ""
    # for graph inputs (parameters included) and code outside any submodule.
    module_path: str
    # Dimensions whose size depends on the data (a ``nonzero``'s count): ``shape`` and ``nbytes`` hold
    # torch's estimate for them (``SavedTensor.data_dependent_dims``).
    data_dependent_dims: tuple[int, ...] = ()

    @classmethod
    def of(cls, t: SavedTensor) -> TensorInfo:
        return cls(t.name, t.shape, t.dtype, t.nbytes, t.device, t.producer, t.module_path, t.data_dependent_dims)


def matches(patterns: tuple[str, ...], path: str) -> str | None:
    """The first ``fnmatch`` pattern matching the module path ``path``, or None ("" matches none)."""
    if not path:
        return None
    return next((p for p in patterns if fnmatch.fnmatchcase(path, p)), None)


def user_choice(t: SavedTensor, options: OffloadOptions) -> tuple[Action, Reason] | None:
    """What the user asked for ``t``: the policy function first, then ``offload_modules``; None
    leaves it to the planner. Raises ValueError when the function returns something else."""
    if callable(options.policy):
        asked = options.policy(TensorInfo.of(t))
        if asked is not None:
            try:
                action = Action(asked)
            except ValueError:
                raise ValueError(
                    f"fxoffload: the policy function {options.policy_name} returned {asked!r} for saved "
                    f"tensor {t.name} ({t.module_path or 'no module'}); return 'offload', 'keep', "
                    "'recompute', an fxoffload.reasons.Action, or None to let the planner decide"
                ) from None
            why = f"the policy function {options.policy_name} asked to {action}"
            return action, Reason(ReasonCode.USER_POLICY, why)
    pattern = matches(options.offload_modules, t.module_path)
    if pattern is not None:
        why = f"produced by {t.module_path}, which matches offload_modules pattern {pattern!r}"
        return Action.OFFLOAD, Reason(ReasonCode.USER_MODULE, why)
    return None
