"""Lifetime analysis of saved activations: pure, reads the partitioned graphs and returns data.

A saved tensor is a forward output after the user outputs that the backward graph takes as a
placeholder of the same name. For each one we record its size and layout, which node produced it,
the last forward node that uses its storage (following views and aliases), the first backward node
that uses it, and the storage it lives in: saved tensors sharing a storage form one candidate.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Sequence

import torch
import torch.fx as fx

from ._compat import size_hint


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor the forward graph saves for the backward graph."""

    name: str  # forward node name (also the backward placeholder's name)
    output_index: int  # position in the forward graph's outputs
    shape: tuple[int, ...]  # size hints for symbolic sizes
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int  # bytes of the dense tensor (numel * element size)
    producer: str  # op that produced it ("placeholder" for graph inputs)
    storage: str  # name of the node that owns the storage (itself unless it is a view)
    is_view: bool  # aliases the storage of another node
    is_graph_input: bool  # a forward placeholder: its storage belongs to the caller
    is_static_input: bool  # a parameter, buffer or other static-lifetime input
    is_user_output: bool  # its storage is also returned to the user
    is_dense: bool  # non-overlapping and dense: its storage bytes can be copied as they are
    shares_storage_with: tuple[str, ...]  # other saved tensors in the same storage
    fw_position: int  # index of the producer among the forward nodes
    # index of the last forward node using the storage, or of that node's last getitem when it
    # returns several tensors (>= fw_position)
    fw_last_use: int
    fw_last_user: str
    fw_compute_after: int  # compute nodes in the forward after the last use
    bw_first_use: int  # index of the first backward node using it; -1: unused in backward
    bw_first_user: str
    bw_compute_before: int  # compute nodes in the backward before the first use
    # The module whose forward produced it, as a dotted path from the compiled module ("layers.0.mlp.fc1"),
    # from the node's ``nn_module_stack``; "" for graph inputs and code outside any submodule.
    module_path: str = ""

    @property
    def idle_compute_nodes(self) -> int:
        """Compute nodes during which the tensor is not needed on the device."""
        return self.fw_compute_after + self.bw_compute_before


@dataclasses.dataclass(frozen=True)
class GraphLifetimes:
    saved: tuple[SavedTensor, ...]
    fw_nodes: int
    bw_nodes: int
    devices: tuple[str, ...]  # device types of every tensor in the forward graph
    # Every output the forward returns to the user is a 0-dim tensor (a loss): the backward follows
    # it with nothing of this pair's in between, so this pair's own timeline is the step's, give or
    # take what other code holds throughout. False when it returns anything else (logits, a block's
    # activations: other graphs or eager code may run between the two, holding these saved tensors).
    returns_only_scalars: bool = False


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


def is_compute(node: fx.Node) -> bool:
    """Nodes that launch work: calls that are neither views nor getitems nor our own transfers."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return False
    return not str(node.target).startswith("fxoffload.")


def static_inputs(gm: fx.GraphModule, static_input_indices: Sequence[int]) -> set[fx.Node]:
    """The placeholders of ``gm`` at ``static_input_indices``: parameters, buffers, other inputs
    whose storage outlives the step."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {placeholders[i] for i in static_input_indices if i < len(placeholders)}


def storage_root(node: fx.Node) -> fx.Node:
    while is_view(node):
        node = node.args[0]  # type: ignore[assignment]
    return node


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


def _val(node: fx.Node) -> object:
    return node.meta.get("val")


def _tensor_bytes(val: torch.Tensor) -> int:
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()


def analyze_saved_tensors(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    static_input_indices: Sequence[int] = (),
) -> GraphLifetimes:
    """One ``SavedTensor`` per saved tensor of a partitioned forward/backward pair."""
    fw_nodes = list(fw.graph.nodes)
    bw_nodes = list(bw.graph.nodes)
    fw_index = {n: i for i, n in enumerate(fw_nodes)}
    bw_index = {n: i for i, n in enumerate(bw_nodes)}
    fw_compute_prefix = _compute_prefix(fw_nodes)
    bw_compute_prefix = _compute_prefix(bw_nodes)

    static = static_inputs(fw, static_input_indices)
    output = fw.graph.output_node()
    outputs = list(output.args[0])
    user_output_storages = {
        storage_root(o) for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)
    }
    bw_placeholders = {n.name: n for n in bw_nodes if n.op == "placeholder"}

    saved_nodes: list[tuple[int, fx.Node]] = [
        (i, o)
        for i, o in enumerate(outputs)
        if i >= num_fwd_outputs
        and isinstance(o, fx.Node)
        and isinstance(_val(o), torch.Tensor)
        and o.name in bw_placeholders
    ]
    by_storage: dict[fx.Node, list[str]] = {}
    for _, node in saved_nodes:
        by_storage.setdefault(storage_root(node), []).append(node.name)

    records = []
    for out_index, node in saved_nodes:
        val = _val(node)
        assert isinstance(val, torch.Tensor)
        root = storage_root(node)
        fw_users = [u for u in storage_users(root) if u.op != "output"]
        last = max(fw_users, key=fw_index.__getitem__, default=node)
        # A reader returning several tensors stands for its getitems (next to it, see
        # hoist_saved_views): the copy is issued after them, where its results are named.
        results = [
            fw_index[g] for u in fw_users if not isinstance(_val(u), torch.Tensor) for g in u.users
            if g.target is operator.getitem and isinstance(_val(g), torch.Tensor) and g in fw_index
        ]  # fmt: skip
        last_i = max([fw_index[last], fw_index[node], *results])
        bw_node = bw_placeholders[node.name]
        bw_users = [u for u in storage_users(bw_node) if u.op != "output"]
        first = min(bw_users, key=bw_index.__getitem__, default=None)
        first_i = bw_index[first] if first is not None else -1
        records.append(
            SavedTensor(
                name=node.name,
                output_index=out_index,
                shape=tuple(size_hint(s) for s in val.shape),
                stride=tuple(size_hint(s) for s in val.stride()),
                dtype=val.dtype,
                device=val.device,
                nbytes=_tensor_bytes(val),
                producer=_op_name(node),
                storage=root.name,
                is_view=root is not node,
                is_graph_input=root.op == "placeholder",
                is_static_input=root in static,
                is_user_output=root in user_output_storages,
                is_dense=is_dense(val),
                shares_storage_with=tuple(n for n in by_storage[root] if n != node.name),
                fw_position=fw_index[node],
                fw_last_use=last_i,
                fw_last_user=(last if fw_index[last] >= fw_index[node] else node).name,
                fw_compute_after=fw_compute_prefix[-1] - fw_compute_prefix[last_i + 1],
                bw_first_use=first_i,
                bw_first_user=first.name if first is not None else "",
                bw_compute_before=bw_compute_prefix[first_i] if first is not None else bw_compute_prefix[-1],
                module_path=module_path(node) or module_path(root),
            )
        )
    devices = sorted(
        {v.device.type for n in fw_nodes if isinstance(v := _val(n), torch.Tensor)}
    )
    scalars = returns_only_scalars(fw, num_fwd_outputs)
    return GraphLifetimes(tuple(records), len(fw_nodes), len(bw_nodes), tuple(devices), scalars)


def returns_only_scalars(fw: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """True when the forward's user outputs are 0-dim tensors (a loss), and at least one
    (``GraphLifetimes.returns_only_scalars``)."""
    outputs = fw.graph.output_node().args[0]
    returned = [_val(o) if isinstance(o, fx.Node) else o for o in outputs[:num_fwd_outputs]]
    tensors = [v for v in returned if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(v.dim() == 0 for v in tensors)


def _compute_prefix(nodes: list[fx.Node]) -> list[int]:
    """prefix[i] = number of compute nodes among nodes[:i]."""
    prefix = [0]
    for n in nodes:
        prefix.append(prefix[-1] + is_compute(n))
    return prefix


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
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else path
    if not isinstance(path, str):
        return ""
    parts = _ITEM.sub(r".\1", _ROOT.sub("", path)).split(".")
    return ".".join(p for p in parts if p and p != "_modules")


def _op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    overload = getattr(target, "_overloadpacket", None)
    if overload is not None:
        name = str(overload).replace("aten.", "")
    return name
