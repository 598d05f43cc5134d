"""Lifetime analysis of saved activations: pure, reads the partitioned graphs and returns data.

A saved tensor is a forward output after the user outputs that the backward graph takes as a
placeholder of the same name. For each one we record its size and layout, which node produced it,
the last forward node that uses its storage (following views and aliases), the first backward node
that uses it, and the storage it lives in: saved tensors sharing a storage form one candidate.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from .._compat import is_data_dependent, resolved_per_op, size_hint
from ..sizes import tensor_bytes
from .graph import is_compute, is_dense, module_path, op_name, static_inputs, storage_root, storage_users


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
    # A lazy bit torch resolves into a temporary copy for every op it is passed to ("conjugate",
    # "negative", "zero"; ``_compat.resolved_per_op``), or "": a copy op would read, and its wait
    # keep alive, a tensor freed as each op returns.
    resolved_per_op: str = ""
    # Dimensions whose size is known only when the graph runs (the count of a ``nonzero``, a mask's
    # selection: ``_compat.is_data_dependent``). ``shape`` and ``nbytes`` hold torch's estimate for
    # them (``_compat.size_hint``: its fallback, within the range torch proved), not a measured size.
    data_dependent_dims: tuple[int, ...] = ()

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


def analyze_saved_tensors(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    static_input_indices: Sequence[int] = (),
) -> GraphLifetimes:
    """One ``SavedTensor`` per saved tensor of a partitioned forward/backward pair."""
    pair = _Pair(fw, bw, num_fwd_outputs, static_input_indices)
    outputs = list(fw.graph.output_node().args[0])
    saved_nodes: list[tuple[int, fx.Node]] = [
        (i, o)
        for i, o in enumerate(outputs)
        if i >= num_fwd_outputs
        and isinstance(o, fx.Node)
        and isinstance(o.meta.get("val"), torch.Tensor)
        and o.name in pair.bw_placeholders
    ]
    by_storage: dict[fx.Node, list[str]] = {}
    for _, node in saved_nodes:
        by_storage.setdefault(storage_root(node), []).append(node.name)
    records = tuple(pair.saved_tensor(i, node, by_storage) for i, node in saved_nodes)
    devices = sorted({v.device.type for n in pair.fw_nodes if isinstance(v := _val(n), torch.Tensor)})
    scalars = returns_only_scalars(fw, num_fwd_outputs)
    return GraphLifetimes(records, len(pair.fw_nodes), len(pair.bw_nodes), tuple(devices), scalars)


class _Pair:
    """The indexes of one forward/backward pair that every saved tensor's record reads."""

    def __init__(self, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int]) -> None:
        self.fw_nodes, self.bw_nodes = list(fw.graph.nodes), list(bw.graph.nodes)
        self.fw_index = {n: i for i, n in enumerate(self.fw_nodes)}
        self.bw_index = {n: i for i, n in enumerate(self.bw_nodes)}
        self.fw_compute = _compute_prefix(self.fw_nodes)
        self.bw_compute = _compute_prefix(self.bw_nodes)
        self.static = static_inputs(fw, static)
        outputs = list(fw.graph.output_node().args[0])
        self.user_storages = {storage_root(o) for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)}
        self.bw_placeholders = {n.name: n for n in self.bw_nodes if n.op == "placeholder"}

    def saved_tensor(self, out_index: int, node: fx.Node, by_storage: dict[fx.Node, list[str]]) -> SavedTensor:
        val = _val(node)
        assert isinstance(val, torch.Tensor)
        fw_index, root = self.fw_index, storage_root(node)
        fw_users = [u for u in storage_users(root) if u.op != "output"]
        last = max(fw_users, key=fw_index.__getitem__, default=node)
        # A reader returning several tensors stands for its getitems (next to it, see
        # hoist_saved_views): the copy is issued after them, where its results are named.
        results = [
            fw_index[g] for u in fw_users if not isinstance(_val(u), torch.Tensor) for g in u.users
            if g.target is operator.getitem and isinstance(_val(g), torch.Tensor) and g in fw_index
        ]  # fmt: skip
        last_i = max([fw_index[last], fw_index[node], *results])
        bw_users = [u for u in storage_users(self.bw_placeholders[node.name]) if u.op != "output"]
        first = min(bw_users, key=self.bw_index.__getitem__, default=None)
        first_i = self.bw_index[first] if first is not None else -1
        return SavedTensor(
            name=node.name,
            output_index=out_index,
            shape=tuple(size_hint(s) for s in val.shape),
            stride=tuple(size_hint(s) for s in val.stride()),
            dtype=val.dtype,
            device=val.device,
            nbytes=tensor_bytes(val),
            producer=op_name(node),
            storage=root.name,
            is_view=root is not node,
            is_graph_input=root.op == "placeholder",
            is_static_input=root in self.static,
            is_user_output=root in self.user_storages,
            is_dense=is_dense(val),
            shares_storage_with=tuple(n for n in by_storage[root] if n != node.name),
            fw_position=fw_index[node],
            fw_last_use=last_i,
            fw_last_user=(last if fw_index[last] >= fw_index[node] else node).name,
            fw_compute_after=self.fw_compute[-1] - self.fw_compute[last_i + 1],
            bw_first_use=first_i,
            bw_first_user=first.name if first is not None else "",
            bw_compute_before=self.bw_compute[first_i] if first is not None else self.bw_compute[-1],
            module_path=module_path(node) or module_path(root),
            resolved_per_op=resolved_per_op(val),
            data_dependent_dims=tuple(i for i, s in enumerate(val.shape) if is_data_dependent(s)),
        )


def returns_only_scalars(fw: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """True when the forward's user outputs are 0-dim tensors (a loss), and at least one
    (``GraphLifetimes.returns_only_scalars``)."""
    outputs = fw.graph.output_node().args[0]
    returned = [_val(o) if isinstance(o, fx.Node) else o for o in outputs[:num_fwd_outputs]]
    tensors = [v for v in returned if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(v.dim() == 0 for v in tensors)


def _val(node: fx.Node) -> object:
    return node.meta.get("val")


def _compute_prefix(nodes: list[fx.Node]) -> list[int]:
    """prefix[i] = number of compute nodes among nodes[:i]."""
    prefix = [0]
    for n in nodes:
        prefix.append(prefix[-1] + is_compute(n))
    return prefix
