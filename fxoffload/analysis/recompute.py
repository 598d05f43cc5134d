"""Which saved tensors could be recomputed in the backward instead of kept: pure, reads the forward.

A saved tensor ``t = op(a, b, ...)`` can be recomputed for the price of one ``op`` when every input
is already available to the backward without extra memory: a parameter or buffer (static input), or
another saved tensor that stays on the device. The planner weighs that price against an un-hidden
offload for the same bytes; the decision itself is carried out by torch's partitioner (the forward
node is tagged ``MUST_RECOMPUTE`` in the joint graph, as selective activation checkpointing does),
not by a second partitioner of ours.

Before (forward / backward)::

    t = op(a, w)         |  t = placeholder
    return (y, a, t)     |  g = use(t, ...)

After, with ``t`` recomputed::

    return (y, a)        |  t = op(a, w)
                         |  g = use(t, ...)

Rules: random ops are never recomputed (they would draw new numbers), nor nodes tagged ``MUST_SAVE``
(by a selective activation checkpointing policy, or by torch's partitioner), nor ops with side effects or
mutations, nor collectives, views, and getitems of multi-output ops (the whole op would rerun), nor
ops reading a graph input that the forward mutates in place (a buffer update: the backward would
read the new value). The sources (``a``) stay on the device or are recomputed in turn (a chain,
which torch's partitioner reruns in order): the planner never offloads a tensor something is
recomputed from, since the recompute would need its reload early and the offload would save nothing.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from .._compat import must_save
from ..reasons import Reason, ReasonCode
from .cost import DeviceRates, node_time
from .graph import is_compute, mutated_inputs, static_inputs, storage_root
from .lifetimes import GraphLifetimes, SavedTensor


@dataclasses.dataclass(frozen=True)
class RecomputeOption:
    """How to rebuild one saved tensor in the backward, and what it costs."""

    name: str  # the saved tensor (a forward node)
    op: str  # the op that reruns
    seconds: float  # predicted compute time of that op
    sources: tuple[str, ...]  # saved tensors it reads, which must then stay on the device


def recompute_options(
    fw: fx.GraphModule,
    lifetimes: GraphLifetimes,
    static_input_indices: Sequence[int],
    rates: DeviceRates,
    min_bytes: int = 0,
    scale: float = 1.0,
) -> tuple[dict[str, RecomputeOption], dict[str, Reason]]:
    """The saved tensors that one op could rebuild from what the backward already has, each op's
    time at ``rates`` times ``scale``: the backward's measured speed over the model's, where the
    device measured it (``PlanCosts.scale``), as the stalls it is weighed against are.

    Returns the options by name, and for every other saved tensor the reason it cannot be.
    """
    nodes = {n.name: n for n in fw.graph.nodes}
    static = static_inputs(fw, static_input_indices)
    mutated = set(mutated_inputs(fw.graph))
    by_storage: dict[str, list[str]] = {}
    for t in lifetimes.saved:
        by_storage.setdefault(t.storage, []).append(t.name)
    options: dict[str, RecomputeOption] = {}
    reasons: dict[str, Reason] = {}
    for t in lifetimes.saved:
        node = nodes.get(t.name)
        reason = _why_not(t, node, min_bytes)
        sources: list[str] = []
        if reason is None:
            assert node is not None
            for inp in node.all_input_nodes:
                root = storage_root(inp)  # a view of a kept tensor is rebuilt for free
                if root in mutated:
                    reason = Reason(
                        ReasonCode.MUTATED_INPUT,
                        f"its input {inp.name} is a graph input the forward mutates in place "
                        "(recomputing in the backward would read the new value)",
                    )
                    break
                if root in static:
                    continue
                if root.name in by_storage:
                    sources.extend(n for n in by_storage[root.name] if n not in sources)
                    continue
                reason = Reason(
                    ReasonCode.INPUT_NOT_KEPT,
                    f"its input {inp.name} is not kept for the backward (recomputing would save it instead)",
                )
                break
        if reason is None and not isinstance(node.meta.get("val"), torch.Tensor):
            reason = Reason(ReasonCode.NOT_A_TENSOR, "not a single tensor")
        if reason is not None:
            reasons[t.name] = reason
            continue
        options[t.name] = RecomputeOption(t.name, t.producer, scale * node_time(node, rates), tuple(sources))
    return options, reasons


def _why_not(t: SavedTensor, node: fx.Node | None, min_bytes: int) -> Reason | None:
    if node is None or node.op != "call_function":
        return Reason(ReasonCode.NOT_COMPUTED, "not computed by the forward graph")
    if t.is_static_input or t.is_graph_input:
        return Reason(ReasonCode.GRAPH_INPUT, "a graph input")
    if t.is_user_output:
        return Reason(ReasonCode.USER_OUTPUT, "returned to the caller: recomputing frees nothing")
    if t.is_view or t.shares_storage_with:
        return Reason(ReasonCode.SHARED_STORAGE, "shares its storage with another tensor: recomputing frees nothing")
    if t.bw_first_use < 0:
        return Reason(ReasonCode.UNUSED_IN_BACKWARD, "not used by the backward graph")
    if t.nbytes == 0 or t.nbytes < min_bytes:
        return Reason(ReasonCode.MIN_BYTES, "below min_bytes")
    if must_save(node):
        return Reason(
            ReasonCode.MUST_SAVE, "tagged MUST_SAVE (a selective activation checkpointing policy or torch's partitioner)"
        )
    if node.target is operator.getitem:
        return Reason(ReasonCode.MULTI_OUTPUT, "one output of a multi-output op (recomputing reruns the whole op)")
    if not is_compute(node):
        return Reason(ReasonCode.NOT_COMPUTE, "not a compute op")
    return op_cannot_rerun(node.target)


def op_cannot_rerun(target: object, views_rerun: bool = False) -> Reason | None:
    """Why an op cannot run again in the backward, or None: not an ATen operator, random (it would
    draw new numbers), writing its inputs or (unless ``views_rerun``: a view reruns where its base
    does) aliasing them, or of another namespace than aten and prims."""
    if not isinstance(target, torch._ops.OpOverload):
        return Reason(ReasonCode.NOT_ATEN, f"{target} is not an ATen operator")
    if torch.Tag.nondeterministic_seeded in target.tags:
        return Reason(ReasonCode.RANDOM_OP, "random op: recomputing would draw different numbers")
    schema = target._schema
    if schema.is_mutable or any(a.alias_info is not None and (a.alias_info.is_write or not views_rerun)
                                for a in schema.arguments):  # fmt: skip
        return Reason(ReasonCode.MUTATES_INPUTS, "mutates or aliases its inputs")
    if target.namespace not in ("aten", "prims"):
        return Reason(ReasonCode.OTHER_NAMESPACE, f"{target.namespace}:: op (only aten and prims ops are recomputed)")
    return None


def recompute_sources(bw: fx.GraphModule, names: frozenset[str], saved: frozenset[str]) -> dict[str, tuple[str, ...]]:
    """For each recomputed forward node in ``bw`` (by name), the saved tensors its recomputation
    reads: the backward's placeholders among its ancestors (through views and other recomputed ops).
    """
    out: dict[str, tuple[str, ...]] = {}
    for node in bw.graph.nodes:
        if node.name not in names:
            continue
        found: list[str] = []
        seen: set[fx.Node] = set()
        stack = list(node.all_input_nodes)
        while stack:
            inp = stack.pop()
            if inp in seen:
                continue
            seen.add(inp)
            if inp.op == "placeholder":
                if inp.name in saved and inp.name not in found:
                    found.append(inp.name)
            else:
                stack.extend(inp.all_input_nodes)
        out[node.name] = tuple(sorted(found))
    return out
