"""The data edges a copy's op takes (``rewrite.transfers``): to nodes that come before it in any
schedule the compiler picks, and that hold no memory the plan does not count. An edge keeps its
tensor alive until the op that reads it, and a node that would otherwise be fused away becomes a
buffer: only tensors alive there anyway, and only nodes the compiler writes out."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from ..analysis.graph import storage_root
from .kernel_runs import materialised

__all__ = ["Liveness", "addmm_by", "after_edges", "alive_edge", "descends_from", "edge_to"]


class Liveness:
    """Whether a storage of the graph, as it was before the rewrite, is still alive at a position:
    read by a node at or after it, or returned (``kept``: alive to the end). Taken before the
    rewrite adds its own readers. ``folded``: the mms the compiler folds into the add reading them
    (``fusion.addmm_products``, mm -> add): no buffer of their own, so no edge may read one; the add
    is the addmm's buffer."""

    def __init__(
        self, index: dict[fx.Node, int], kept: set[fx.Node], folded: Mapping[fx.Node, fx.Node] | None = None
    ) -> None:
        self.folded, self.folds = dict(folded or {}), frozenset((folded or {}).values())
        self._last: dict[fx.Node, float] = {root: float("inf") for root in kept}
        for n, i in index.items():
            root = storage_root(n)
            if root not in self._last or self._last[root] < i:
                self._last[root] = float(i)
            for inp in n.all_input_nodes:
                root = storage_root(inp)
                if self._last.get(root, -1.0) < i:
                    self._last[root] = float(i)

    def alive_at(self, n: fx.Node, position: float) -> bool:
        return self._last.get(storage_root(n), -1.0) >= position


def after_edges(
    c: fx.Node | None,
    anchor: fx.Node | None,
    position: float,
    order: list[fx.Node],
    index: dict[fx.Node, int],
    alive: Liveness | None,
    move: bool = False,
) -> list[fx.Node]:
    """The data edges of a wait at ``position`` that must come after ``c`` (the kernel the copy
    overlaps) and ``anchor`` (the node the plan put the wait behind).

    An edge keeps its tensor alive until the wait, so only tensors alive there anyway are used: the
    anchor (just computed) when ``c`` is among its ancestors; ``c`` itself when it lives that long;
    else a materialised descendant of ``c`` that does. If there is none, the wait gets no edge to
    ``c`` and may be scheduled before it (less overlap, never a wrong result): holding memory that
    the plan does not count would make its predicted peak wrong, and could raise the peak itself.
    Where ``c`` is an mm the compiler folds into an addmm, the kernel is the add's: where that comes
    before the wait, or (``move``: a backward wait, placed before its first use) can be moved there.
    """
    edges = [anchor] if anchor is not None and edge_to(anchor, alive) else []
    if c is not None and alive is not None and c in alive.folded:  # its kernel is the add's addmm
        add = alive.folded[c]
        c = add if index[add] < position else addmm_by(c, add, index, alive) if move else None
    if c is None or not edge_to(c, alive) or c in edges:
        return edges
    if edges and descends_from(anchor, c, index) and not (alive is None or alive.alive_at(c, position)):
        return edges
    edge = alive_edge(c, position, order, index, alive)
    return [edge, *edges] if edge is not None else edges


def addmm_by(mm: fx.Node, add: fx.Node, index: dict[fx.Node, int], alive: Liveness) -> fx.Node | None:
    """``add``, the add Inductor folds ``mm`` into, moved up to right after ``mm``, where that holds no
    more memory: every input it reads is computed by then (no placeholder: a saved tensor may be
    reloaded later), and its other addend, the size of its result, dies at it (a residual's two
    gradients: the addmm's result takes the addend's place, and the mm's inputs are freed as early).
    None where it cannot move. Its ``index`` becomes its mm's (no copy takes an edge to the mm), so a
    later copy places itself by where it runs now."""
    out = add.meta.get("val")
    for a in add.all_input_nodes:
        if a.op == "placeholder" or a not in index or index[a] > index[mm]:
            return None
        val = a.meta.get("val")
        if a is not mm and (
            not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or val.numel() != out.numel()
            or alive.alive_at(a, index[add] + 0.5)
        ):  # fmt: skip
            return None
    mm.append(add)
    index[add] = index[mm]
    return add


def edge_to(n: fx.Node, alive: Liveness | None) -> bool:
    """Whether a copy may take a data edge to ``n``: a buffer in every compiler (``materialised``)
    but an mm the compiler folds into the add reading it (an edge makes it a buffer: a residual MLP's
    backward then held three gradient mms where Inductor holds two addmms, and ``auto`` raised its
    peak by one), or that add, the addmm's buffer."""
    if alive is not None and (n in alive.folds or n in alive.folded):
        return n in alive.folds
    return materialised(n)


def alive_edge(
    n: fx.Node, position: float, order: list[fx.Node], index: dict[fx.Node, int], alive: Liveness | None
) -> fx.Node | None:
    """A data edge at ``position`` that orders after ``n`` and holds no memory: ``n`` when it is
    alive there anyway, else the latest materialised descendant of ``n`` that is; None if none is."""
    if alive is None or alive.alive_at(n, position):
        return n
    for i in range(min(int(position), len(order) - 1), index[n], -1):
        m = order[i]
        if m in index and edge_to(m, alive) and m.op != "placeholder" and isinstance(m.meta.get("val"), torch.Tensor):
            if alive.alive_at(m, position) and descends_from(m, n, index):
                return m
    return None


def descends_from(n: fx.Node, ancestor: fx.Node, index: dict[fx.Node, int]) -> bool:
    """True when ``ancestor`` is ``n`` or one of its inputs, transitively (searched back to its position)."""
    floor = index.get(ancestor, -1)
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m is ancestor:
            return True
        if m in seen or index.get(m, -1) < floor:
            continue
        seen.add(m)
        stack.extend(m.all_input_nodes)
    return False
