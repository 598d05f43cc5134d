"""Keep saved what reads a graph input before the forward mutates it (a torch partitioner bug).

A rewrite of the joint graph before torch partitions it: it tags nodes, and changes nothing else.

AOTAutograd functionalizes a buffer update: the joint graph reads the input's old value through its
placeholder and writes the new value back at the very end, ``copy_(primals_1, new)``::

    add = aten.add(primals_2, primals_1)     # reads the buffer's value *before* the update
    sin = aten.sin(add)
    add_1 = aten.add(primals_1, 1.0)         # the updated value
    cos = aten.cos(add)                      # backward
    mul = aten.mul(expand, cos)
    copy_ = aten.copy_(primals_1, add_1)     # buf.add_(1.0), applied at the end of the forward

torch's min-cut partitioner treats ``primals_1`` as free to keep (a static input) and may recompute
``add`` in the backward from it; by then the forward has run ``copy_`` and the backward reads the
*new* buffer: silently wrong gradients (``y = sin(x + buf); buf.add_(1)`` and a step counter
``count += 1`` used by the loss, with ``aot_eager`` and Inductor alike).

``protect_mutated_reads`` tags, before partitioning, the first non-view readers of each mutated
input whose value the backward needs with ``CheckpointPolicy.MUST_SAVE`` (the tag selective
activation checkpointing uses; torch's partitioners never recompute such a node). Nothing
downstream of them is tagged: recomputing ``cos`` from a saved ``add`` is correct, only reading the
placeholder in the backward is not. Graphs that mutate no input are left untouched.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..analysis.graph import closure, is_view, mutated_inputs, written_args

log = logging.getLogger(__name__)

__all__ = ["ReadsMutatedInput", "mutated_reads_added", "protect_mutated_reads"]

_VALUES = (torch.Tensor, tuple, list)  # a tensor, or a multi-output op's tuple (not a SymInt)


def _backward_outputs(joint: fx.GraphModule, num_fwd_outputs: int | None) -> list[fx.Node]:
    """The joint graph's gradient outputs: after the first ``num_fwd_outputs``, or where the output
    descriptors (torch >= 2.9 puts them on ``meta["desc"]``) say ``GradAOTOutput``."""
    output = joint.graph.output_node()
    values = output.args[0]
    if not isinstance(values, (list, tuple)):
        return []
    if num_fwd_outputs is not None:
        grads = values[num_fwd_outputs:]
    else:
        descs = output.meta.get("desc")
        if not isinstance(descs, (list, tuple)) or len(descs) != len(values):
            return []
        grads = [v for v, d in zip(values, descs) if type(d).__name__ == "GradAOTOutput"]
    return [v for v in grads if isinstance(v, fx.Node)]


def protect_mutated_reads(joint: fx.GraphModule, num_fwd_outputs: int | None = None) -> list[str]:
    """Tag ``MUST_SAVE`` the joint-graph nodes that read the pre-mutation value of an input the graph
    mutates in place and that the backward needs, so that a partitioner never recomputes them in
    the backward (where the input already holds its new value). Returns the names tagged, in graph
    order. Call it on the joint graph before torch's partitioner; ``num_fwd_outputs`` (the
    partitioner's keyword) makes the gradient outputs exact, otherwise the output descriptors are used.

    A node is tagged when: it is the first non-view node on a chain ``placeholder -> views -> node``
    of a mutated placeholder (not the mutation itself), it does not depend on the tangents, it
    produces a tensor, and the backward (the tangents' descendants and the gradient outputs) reads
    it directly or through other nodes. An existing ``MUST_SAVE`` tag is kept; ``PREFER_SAVE`` and a
    user's ``MUST_RECOMPUTE``/``PREFER_RECOMPUTE`` are replaced by ``MUST_SAVE`` (logged): recomputing
    would give wrong gradients, and torch's min-cut partitioner may recompute a ``PREFER_SAVE`` node.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    graph = joint.graph
    mutated = mutated_inputs(graph)
    if not mutated:
        return []
    writers = {w for ws in mutated.values() for w in ws}
    tangents = [n for n in graph.nodes if n.op == "placeholder" and "tangents" in str(n.target)]
    backward = closure(tangents, "users")
    backward.update(_backward_outputs(joint, num_fwd_outputs))
    backward.discard(graph.output_node())
    needed_by_backward = closure((i for n in backward for i in n.all_input_nodes), "inputs") - backward

    tagged: list[fx.Node] = []
    for placeholder, by in mutated.items():
        stack, seen = [placeholder], set()
        while stack:
            node = stack.pop()
            for user in node.users:
                if user in seen or user in writers or user.op == "output":
                    continue
                seen.add(user)
                if is_view(user) and not written_args(user):
                    stack.append(user)  # a view reads nothing yet; its readers do
                    continue
                if user in backward:
                    # Only a backward that reads the old value itself: eager autograd refuses it
                    # ("modified by an inplace operation"), and no tag can help.
                    log.debug(
                        "fxoffload: %s reads %s in the backward: no tag can help", user.name, placeholder.name
                    )
                    continue
                if user not in needed_by_backward or not isinstance(user.meta.get("val"), _VALUES):
                    continue
                old = user.meta.get("recompute")
                if old is CheckpointPolicy.MUST_SAVE:
                    log.debug(
                        "fxoffload: %s reads mutated input %s: already MUST_SAVE", user.name, placeholder.name
                    )
                    continue
                if old is not None:
                    log.info(
                        "fxoffload: %s was tagged %s, now MUST_SAVE: it reads %s before %s updates it "
                        "in place, and recomputing it in the backward would read the new value",
                        user.name, getattr(old, "name", old), placeholder.name, by[-1].name,
                    )  # fmt: skip
                else:
                    log.debug(
                        "fxoffload: keeping %s saved (MUST_SAVE): it reads %s before %s updates it in place, "
                        "and the backward needs it",
                        user.name, placeholder.name, by[-1].name,
                    )  # fmt: skip
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                tagged.append(user)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return [n.name for n in sorted(set(tagged), key=order.__getitem__)]


class ReadsMutatedInput(RuntimeError):
    """A partition whose backward reads an input the forward mutates in place, where the first
    partition's backward does not (``mutated_reads_added``)."""


def mutated_reads_added(joint: fx.GraphModule, bw: fx.GraphModule, first: frozenset[str]) -> list[str]:
    """The inputs ``joint`` mutates in place that partition ``bw``'s backward reads (its placeholders)
    and the first partition's backward (``first``: its placeholders' names) does not. Such a
    backward reads the new value where the joint graph read the old one: torch's min-cut partitioner
    at activation budget 0.0 recomputes from the graph's inputs whatever ``protect_mutated_reads``
    tagged ``MUST_SAVE`` (a fuzz model's EMA buffer, seed 11 case 7: autograd refused the backward,
    the buffer "modified by an inplace operation")."""
    mutated = {p.name for p in mutated_inputs(joint.graph)}
    return sorted(n.name for n in bw.graph.find_nodes(op="placeholder") if n.name in mutated and n.name not in first)
