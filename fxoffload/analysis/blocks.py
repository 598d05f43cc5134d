"""The repeated blocks of a joint graph, for recomputation block by block: pure, reads the graph.

Per-block activation checkpointing (``torch.utils.checkpoint`` around each transformer block) is what
users reach for when a budget is below what torch's min-cut partitioner can reach: under
``activation_memory_budget=0`` that partitioner saves little, and the backward then rebuilds the whole
forward at once (the bench's tiny GPT: 7.2 MiB on the memory model, 6.3 MiB with nothing recomputed).
Saving each block's outputs bounds what any backward step rebuilds to one block. So the blocks of
the joint graph are found from the modules its forward nodes came from (``nn_module_stack``: the
items of a ``ModuleList`` or ``Sequential`` such as ``blocks.0``, ``blocks.1``; an item called twice,
its weights shared, is a block per call, ``graph.module_call``): each block's outputs,
the values something outside the block reads in the forward, are tagged ``MUST_SAVE``, and every
other node of it that can rerun ``MUST_RECOMPUTE``, the tags of selective activation checkpointing.
torch's partitioner then makes the pair, and its reordering that mimics the autograd engine places
each block's recomputation just before that block's backward. No model change, no checkpoint wrapper.

A node reruns unless it is random (it would draw new numbers: ``rewrite.random_ops`` keeps it
saved), writes to its inputs, is no ATen or prims op, or already carries a tag (a selective
checkpointing policy of the user's, or ``rewrite.mutated_reads``, which keeps values saved that read an
input the forward mutates later).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re

import torch.fx as fx

from .._compat import is_backward_node
from .graph import closure, module_call, module_path
from .recompute import op_cannot_rerun

log = logging.getLogger(__name__)

__all__ = ["BlockTags", "NoRepeatedBlocks", "block_of", "block_tags"]

# A module path up to its first index: "blocks.3" of "blocks.3.attn.qkv".
_BLOCK = re.compile(r"^((.*?)\.(\d+))(?:\.|$)")


class NoRepeatedBlocks(ValueError):
    """A graph with no repeated blocks was asked to be recomputed block by block."""


@dataclasses.dataclass(frozen=True)
class BlockTags:
    """What recomputing block by block tags in a joint graph."""

    blocks: tuple[str, ...]  # the blocks found, in forward order ("blocks.0", "blocks.1", ...)
    save: frozenset[str]  # each block's outputs: nodes whose values something outside the block reads
    recompute: frozenset[str]  # every other node of a block that can rerun

    def describe(self) -> str:
        """``blocks.0`` to ``blocks.11`` (12 blocks)"""
        first, last = self.blocks[0], self.blocks[-1]
        return f"{first} to {last} ({len(self.blocks)} blocks)"


def block_tags(joint: fx.GraphModule) -> BlockTags | None:
    """The tags that make torch's partitioner recompute ``joint``'s repeated blocks one at a time, or
    None where its forward has fewer than two blocks of one container (nothing repeats) or nothing in
    them can rerun."""
    backward = _backward(joint)
    in_block: dict[fx.Node, str] = {}
    container_of: dict[fx.Node, str] = {}
    containers: dict[str, list[str]] = {}
    for node in joint.graph.nodes:
        if node.op != "call_function" or node in backward or not node.meta.get("nn_module_stack"):
            continue
        found = _block(node)
        if found is None:
            continue
        container_of[node], in_block[node] = container, block = found
        seen = containers.setdefault(container, [])
        if block not in seen:
            seen.append(block)
    repeated = {c for c, blocks in containers.items() if len(blocks) >= 2}
    in_block = {n: b for n, b in in_block.items() if container_of[n] in repeated}
    if not in_block:
        return None
    save, recompute = set(), set()
    for node, block in in_block.items():
        if "recompute" in node.meta:  # the user's policy, or a value kept saved on purpose
            continue
        read_outside = any(u not in backward and in_block.get(u) != block for u in node.users)
        if read_outside:
            save.add(node.name)
        elif node.target is operator.getitem:
            if node.args[0].name in recompute:  # an output of a multi-output op reruns with that op alone
                recompute.add(node.name)
        elif op_cannot_rerun(node.target, views_rerun=True) is None:
            recompute.add(node.name)
    if not recompute:  # blocks that are one op each: nothing reruns
        return None
    tags = BlockTags(tuple(dict.fromkeys(in_block.values())), frozenset(save), frozenset(recompute))
    log.debug(
        "fxoffload: blocks %s: %d outputs kept saved, %d nodes tagged to rerun in the backward",
        tags.describe(), len(save), len(recompute),
    )  # fmt: skip
    return tags


def block_of(node: fx.Node) -> str | None:
    """The block ``node`` came from, as ``block_tags`` names it ("blocks.3", "blocks.1@1" for a second
    call of ``blocks.1``), or None where it came from no item of a ``ModuleList`` or ``Sequential``.
    Read from its module stack: a node of the backward, or recomputed there, names its forward's."""
    found = _block(node)
    return found[1] if found is not None else None


def _block(node: fx.Node) -> tuple[str, str] | None:
    """``node``'s container ("blocks") and block, or None."""
    m = _BLOCK.match(module_path(node))
    return (m.group(2), module_call(node, m.group(1))) if m is not None else None  # a block called twice is two


def _backward(joint: fx.GraphModule) -> set[fx.Node]:
    """The backward's nodes: the tangents, those AOTAutograd traced for it, and any computed from them."""
    tangents = (n for n in joint.graph.nodes if n.op == "placeholder" and "tangents" in str(n.target))
    return closure([*tangents, *filter(is_backward_node, joint.graph.nodes)], "users")

