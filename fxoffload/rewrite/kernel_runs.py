"""Where the transfer ops stand in a rewritten graph, so that Inductor generates the code it would
without them. Part of the rewrite (it moves nodes); pure of any plan.

Inductor's C++ backend writes the nodes it generates code for into one kernel function until an
extern call comes (``Scheduler.codegen`` flushes the kernel group at every extern node): a transfer
op standing between two pointwise nodes splits their kernel in two. With policy ``"all"`` on the
2-block GPT of ``tests/test_kernel_runs.py`` the backward ran 23 kernel calls where Inductor's own
runs 12, and the 12-block GPT of ``bench.compile_time`` had 30 distinct kernels to compile where
Inductor's own has 19. So each transfer op is moved, within the run of generated-code nodes it
stands in, to the run's edge: an offload later (issued a few pointwise nodes later, never past its
wait), a reload and a backward wait earlier (a few pointwise nodes before its first reader, which it
must precede). Never past a node it depends on or that depends on it. Then: 14 calls, 25 kernels.

A forward wait stays where the plan put it: it frees its source there, and Inductor's code
allocates the outputs of a whole kernel before calling it, so a wait moved to the end of its run
held the source over every allocation of the run. Moved, the built-in GPT's forward (fp32, dropout)
peaked at 3.27 MB in Inductor's code against 2.33 MB with the waits where the plan put them, and a
CNN's at 2.47 against 1.81 MB, for two or three kernel calls fewer (docs/results.md, eleventh session).
Inductor's GPU backends launch each fused node apart: none of this is done there.

Inductor's memory reordering moves the transfer ops again (a wait up to its copy, a copy up to its
source) and splits runs anew: what the code's kernels are is decided in Inductor's schedule, where
``_compat.scheduler_runs`` puts each offload's wait back after the kernels the plan put behind its
copy and joins the runs again where the device peak does not rise. This order is
the FX graph's, which the memory model reads (``analysis.memory``) and Inductor starts from.

Each ``fxoffload.order`` node already stands right before the extern node it routes an input of.
Which input it routes matters too (``routing_cost``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.graph import is_view, storage_root, storage_users
from ..ir import OFFLOAD, RELOAD, TRANSFER_OPS, WAIT, is_transfer

__all__ = ["between_kernel_runs", "materialised", "routing_cost"]

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


def between_kernel_runs(graph: fx.Graph) -> int:
    """Move every offload, reload and backward wait of ``graph`` to the edge of the run of
    generated-code nodes it stands in (a run ends at a ``materialised`` node: an extern kernel or a
    transfer op); a forward wait stays (``_frees_its_source_here``). Inductor schedules by the
    graph's order where its memory reordering leaves it. Returns how many were moved."""
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target in (OFFLOAD, RELOAD, WAIT)]
    up = [n for n in ops if n.target is RELOAD or n.target is WAIT and is_transfer(n.args[0], RELOAD)]
    going_up = set(up)
    down = [n for n in ops if n not in going_up and not _frees_its_source_here(n)]
    # The last first down, the first first up: each moves past the ones moved before it.
    return sum(_later(n) for n in reversed(down)) + sum(_earlier(n) for n in up)


def _frees_its_source_here(n: fx.Node) -> bool:
    """A forward wait: where the plan put it, its source is freed (see the module's docstring)."""
    return n.target is WAIT and is_transfer(n.args[0], OFFLOAD)


def _later(n: fx.Node) -> bool:
    """Move ``n`` down past the generated-code nodes after it (none of which reads it)."""
    at = n
    while True:
        nxt = at.next
        if nxt.op != "call_function" or materialised(nxt) or n in nxt.all_input_nodes:
            break
        at = nxt
    if at is n:
        return False
    at.append(n)
    return True


def _earlier(n: fx.Node) -> bool:
    """Move ``n`` up past the generated-code nodes before it (none of which it reads)."""
    at = n
    inputs = set(n.all_input_nodes)
    while True:
        prev = at.prev
        if prev.op != "call_function" or materialised(prev) or prev in inputs:
            break
        at = prev
    if at is n:
        return False
    at.prepend(n)
    return True


def routing_cost(inp: fx.Node, c: fx.Node) -> int:
    """How much routing ``inp`` through an ``order`` node into ``c`` may cost (lowest first).
    Inductor treats the order's result as an alias of ``inp``'s storage: every reader of that
    storage before it must run first, every reader after it reads through it and so waits for the
    copy too (a kernel that would have been fused with the one computing ``inp``, the GELU
    backward with its bias gradient's sum, then runs apart). An input ``c`` alone reads costs
    neither; a graph input (a parameter, through its transpose) has no kernel computing it, but its
    other readers are ordered around the copy (a gradient's matmul moved before a reload held its
    output over the reload: 0.4 MiB more at the peak of ``tests/test_upstream.py``'s blocks)."""
    root = storage_root(inp)
    if all(u is c or is_view(u) for u in storage_users(root)):
        return 0
    return 1 if root.op == "placeholder" else 2
