"""Kernel boundaries: which nodes every compiler materialises, and the fusible runs between them.

A run is a stretch of the graph between two materialised nodes (extern kernels: matmuls,
convolutions, attention; the transfer ops themselves): pointwise and reduction nodes that a compiler
may fuse. Inductor's C++ backend (the CPU) goes further: it packs every node scheduled between two
flushes into one ``cpp_fused_*`` function, and flushes before every extern node
(``Scheduler._codegen``), so a transfer op in the middle of a run splits that function in two: one
more C++ kernel to build (a second or more each on a small CPU) and to call every step.

So where the compiler packs runs (a graph on the CPU), the plan (``planning.schedule``) issues each
offload at the end of its last reader's run, just before the next materialised node, with data edges
to what the run hands that node (buffers alive there anyway; without them Inductor's peak-memory
reordering moves the offload back into the run: ``run_edges``, added by the rewrite). The issue
allocates host memory only, so the memory model is unchanged; its wait comes after it.

The other ops stay where the memory model puts them: the forward waits release the source, the
reloads allocate, and a reload's wait moved to the start of its run, which allocates nothing, still
raised the seq2seq model's code peak 0.5 MiB above its code without offloading (Inductor orders the
backward differently around it; ``tests/test_no_cost.py``). Counted on the 1-layer GPT of
``fxoffload.testing.models`` with every tensor offloaded (``tests/test_output_code.py``), C++
functions in the forward / backward: 5 / 7 unchanged, 11 / 14 with each offload right after its last
reader, 7-8 / 14 with the rule.

On a GPU each fused node is a Triton kernel of its own whatever stands between them
(``tests/test_cuda_lowering.py``): nothing to gain, and the ops stay where the plan put them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ir import ORDER, TRANSFER_OPS

__all__ = ["first_materialised", "materialised", "run_edges", "run_ends"]

# Ops whose outputs every compiler materialises and whose inputs are buffers: Inductor lowers them
# to extern kernels (matmuls, convolutions, attention), aot_eager runs them as they are. Data edges
# to and from them cost no buffer that the graph would not have anyway.
_MATERIALISED = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "convolution", "convolution_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_flash_attention_forward", "_flash_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward",
    )
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


def materialised(n: fx.Node) -> bool:
    """True when ``n``'s output (or, for a multi-output op, its getitems) is a buffer in every compiler."""
    if n.op == "placeholder":
        return True
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return isinstance(n.args[0], fx.Node) and materialised(n.args[0])
    return getattr(n.target, "overloadpacket", None) in _MATERIALISED or n.target in TRANSFER_OPS


def first_materialised(order: list[fx.Node], start: int, stop: int, any_node: bool = False) -> int:
    """Index of the first materialised compute node in ``order[start:stop]`` (one that reads a tensor);
    ``stop`` if none. ``any_node``: any compute node, materialised or not (a rule broken on purpose)."""
    for i in range(start, min(stop, len(order))):
        c = order[i]
        if (any_node and c.op == "call_function" or materialised(c)) and c.target not in TRANSFER_OPS and any(
            isinstance(a.meta.get("val"), torch.Tensor) for a in c.all_input_nodes
        ):
            return i
    return stop


def run_ends(gm: fx.GraphModule) -> tuple[int, ...]:
    """Per node index of ``gm`` (``graph.nodes`` order, up to the output): the last node of its run,
    where an op due right after it splits no run (the node itself where it is materialised or ends
    its run)."""
    order = [n for n in gm.graph.nodes if n.op != "output"]
    ends = list(range(len(order)))
    for i in reversed(range(len(order) - 1)):
        if not materialised(order[i]) and not materialised(order[i + 1]):
            ends[i] = ends[i + 1]
    return tuple(ends)


def run_edges(order: list[fx.Node], index: dict[fx.Node, int], last: int, issue_after: int) -> list[fx.Node]:
    """The data edges that keep an op issued after ``order[issue_after]`` (moved there from right
    after ``order[last]``, the end of a run) where it is: the tensors computed between the two that
    the next materialised node reads. They are buffers, alive until that node runs, which the op comes
    before: the edges hold no memory."""
    j = first_materialised(order, issue_after + 1, len(order))
    if issue_after <= last or j >= len(order) or order[j].op == "output":
        return []
    inputs = (a.args[0] if a.target is ORDER else a for a in order[j].all_input_nodes)
    return [
        a for a in dict.fromkeys(inputs)
        if a in index and last < index[a] <= issue_after and isinstance(a.meta.get("val"), torch.Tensor)
    ]  # fmt: skip
