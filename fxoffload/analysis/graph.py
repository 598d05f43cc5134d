"""Facts about FX nodes that every analysis reads: aliasing, storages, compute, mutation. Pure.

One home for "which storage does this node live in" (``storage_root``), "who reads it"
(``storage_users``), "does it launch work" (``is_compute``) and "which graph inputs does the graph
write in place" (``mutated_inputs``), so that lifetimes, the memory model, recomputation and the
rewrite agree.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from .._compat import size_hint
from ..ir import RELOAD, is_transfer

__all__ = [
    "closure", "is_compute", "is_dense", "is_view", "last_reads", "module_path", "mutated_inputs", "op_name",
    "static_inputs", "storage_owners", "storage_root", "storage_users", "written_args",
]  # fmt: skip


def closure(starts: Iterable[fx.Node], step: str) -> set[fx.Node]:
    """``starts`` and every node reached from them through their users (``step="users"``: what is
    computed from them) or their inputs (``step="inputs"``: what they are computed from)."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.users if step == "users" else node.all_input_nodes)
    return seen


def is_view(node: fx.Node) -> bool:
    """True for nodes whose output aliases an input's storage (views, getitems of aliasing ops)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and _returns_alias(src)
    return _returns_alias(node)


def _returns_alias(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def holds_host_copy(node: fx.Node) -> bool:
    """A backward placeholder that holds a host copy: the tensor a reload copies back."""
    return node.op == "placeholder" and any(is_transfer(u, RELOAD) and u.args[0] is node for u in node.users)


def is_compute(node: fx.Node) -> bool:
    """Nodes that launch work: calls that are neither views nor getitems nor our own transfers."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return False
    return not is_transfer(node)


def static_inputs(gm: fx.GraphModule, static_input_indices: Sequence[int]) -> set[fx.Node]:
    """The placeholders of ``gm`` at ``static_input_indices``: parameters, buffers, other inputs
    whose storage outlives the step."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {placeholders[i] for i in static_input_indices if i < len(placeholders)}


def storage_root(node: fx.Node) -> fx.Node:
    """The node that owns the storage ``node`` lives in (itself unless it is a view)."""
    while is_view(node):
        node = node.args[0]  # type: ignore[assignment]
    return node


def storage_owners(nodes: Iterable[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Storage owner of every tensor node (itself unless it is a view)."""
    return {n: storage_root(n) for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)}


def last_reads(
    nodes: Sequence[fx.Node], owners: Mapping[fx.Node, fx.Node], runs_at: Mapping[fx.Node, fx.Node] | None = None
) -> dict[fx.Node, int]:
    """Index in ``nodes`` of the last node reading each storage owner (the output node counts); a
    node in ``runs_at`` reads where the node it maps to runs (Inductor's inlined nodes,
    ``fusion.Fusion.runs_at``)."""
    index = {n: i for i, n in enumerate(nodes)}
    runs_at = runs_at or {}
    last: dict[fx.Node, int] = {}
    for n in nodes:
        at = index[runs_at.get(n, n)]
        for inp in n.all_input_nodes:
            owner = owners.get(inp)
            if owner is not None:
                last[owner] = max(last.get(owner, -1), at)
    return last


def storage_users(node: fx.Node) -> list[fx.Node]:
    """Every node reading the storage of ``node`` through any chain of views."""
    out: list[fx.Node] = []
    stack = [node]
    while stack:
        for user in stack.pop().users:
            out.append(user)
            if is_view(user):
                stack.append(user)
    return out


def is_dense(val: torch.Tensor) -> bool:
    """Non-overlapping and dense, judged on size hints: a permutation of a contiguous layout."""
    dims = sorted(
        ((size_hint(s), size_hint(st)) for s, st in zip(val.shape, val.stride()) if size_hint(s) != 1),
        key=lambda d: d[1],
    )
    expected = 1
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def written_args(node: fx.Node) -> list[fx.Node]:
    """The nodes a mutable ATen op writes in place (its ``Tensor(a!)`` arguments)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out: list[fx.Node] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
        values = value if isinstance(value, (list, tuple)) else (value,)
        out.extend(v for v in values if isinstance(v, fx.Node))
    return out


def _written_root(node: fx.Node) -> fx.Node:
    while is_view(node) and isinstance(node.args[0], fx.Node) and not written_args(node):
        node = node.args[0]
    return node


def mutated_inputs(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Placeholders that the graph writes in place, each with the nodes writing it (usually one
    ``aten.copy_(placeholder, new_value)`` at the end: AOTAutograd's functionalized input mutation).
    By the time a backward runs they hold the new value."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        for written in written_args(node):
            root = _written_root(written)
            if root.op == "placeholder":
                out.setdefault(root, []).append(node)
    return out


# Dynamo writes a module's path from the compiled frame's locals: "L['self'].layers[0].mlp" or, in newer
# versions, "L['self'].layers.0.mlp"; a module passed as an argument is "L['model']...".
_ROOT = re.compile(r"^L\[['\"][^'\"]*['\"]\]\.?")
_ITEM = re.compile(r"\[['\"]?([^'\"\]]*)['\"]?\]")


def module_path(node: fx.Node) -> str:
    """The innermost module whose forward produced ``node``, as a dotted path ("layers.0.mlp.fc1").

    Forward nodes carry ``meta["nn_module_stack"]`` (outermost first); nodes that the partitioner
    moved into the forward from the backward carry ``meta["fwd_nn_module_stack"]``, the module of the
    forward node they belong to. "" when neither is there (graph inputs, top-level code).
    """
    stack = _module_stack(node)
    return _dotted(list(stack.values())[-1]) if stack else ""


def module_call(node: fx.Node, path: str) -> str:
    """``path``, a module on ``node``'s stack as ``module_path`` writes it, with "@k" where ``node``
    came from that module's call k + 1 in the graph ("blocks.1@1"): a module called twice in one
    forward, its weights shared, is two calls (Dynamo keys the stack's entries so: "<id>@1")."""
    for key, entry in _module_stack(node).items():
        if _dotted(entry) == path:
            call = str(key).rpartition("@")[2] if "@" in str(key) else ""
            return f"{path}@{call}" if call else path
    return path


def _module_stack(node: fx.Node) -> dict:
    return node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}


def _dotted(entry: object) -> str:
    path = entry[0] if isinstance(entry, tuple) else entry
    if not isinstance(path, str):
        return ""
    parts = _ITEM.sub(r".\1", _ROOT.sub("", path)).split(".")
    return ".".join(p for p in parts if p and p != "_modules")


def op_name(node: fx.Node) -> str:
    """``mm``, ``addmm``, ``placeholder``: the op a node runs, as reports name it."""
    if node.op != "call_function":
        return node.op
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    overload = getattr(target, "_overloadpacket", None)
    if overload is not None:
        name = str(overload).replace("aten.", "")
    return name
