"""Keep random ops, and ops that bind sizes known only at run time, saved when torch's partitioner
recomputes under an activation memory budget.

Under ``activation_memory_budget`` the min-cut partitioner may choose to recompute nodes it bans from
recomputation otherwise, random ops among them (pytorch#190758): the backward then draws new random
numbers, and its gradients are not those of the forward's loss (a dropout mask drawn twice). Tagging
them ``MUST_SAVE`` (the partitioner never recomputes such a node) keeps each draw to one. An op that
binds a data-dependent size (``nonzero``, ``.item()``) is kept saved the same way: recomputed, it
binds its sizes anew and Inductor cannot compile the forward (``keep_size_ops_saved``). A rewrite of
the joint graph's tags before torch partitions it; nothing else changes.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .. import _compat

log = logging.getLogger(__name__)

__all__ = ["keep_random_ops_saved", "keep_size_ops_saved"]


def keep_random_ops_saved(joint: fx.GraphModule) -> list[str]:
    """Tag every random op of ``joint`` ``MUST_SAVE``; returns their names in graph order."""
    tagged = [
        node.name for node in joint.graph.nodes
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
    ]  # fmt: skip
    _compat.tag_must_save(joint, frozenset(tagged))
    if tagged:
        log.debug("fxoffload: random ops kept saved under an activation memory budget: %s", ", ".join(tagged))
    return tagged


def keep_size_ops_saved(joint: fx.GraphModule) -> list[str]:
    """Tag ``MUST_SAVE`` every op of ``joint`` that binds a size known only at run time (``nonzero``,
    ``.item()``: ``unbacked_bindings``); returns their names in graph order. Recomputed in the
    backward under a budget, such an op binds its sizes anew, and the forward Inductor compiles then
    fails to return the symbols its own graph binds (``PendingUnbackedSymbolNotFound``; measured with
    ``backend="inductor"`` and ``activation_memory_budget=0.5`` alone, torch 2.13)."""
    tagged = [node.name for node in joint.graph.nodes if node.op == "call_function" and node.meta.get("unbacked_bindings")]
    _compat.tag_must_save(joint, frozenset(tagged))
    if tagged:
        log.debug("fxoffload: ops binding data-dependent sizes kept saved under an activation memory budget: %s",
                  ", ".join(tagged))  # fmt: skip
    return tagged
