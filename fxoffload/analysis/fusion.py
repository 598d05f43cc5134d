"""Which nodes of a graph Inductor computes inside another node's kernel, with no buffer. Pure.

``memory.simulate`` gives every node's output a buffer. Inductor does not: its lowering keeps a
pointwise op unrealized (an expression, no storage) and inlines it into every op that reads it,
so a chain like GELU's ``mul, erf, add, mul`` between two matmuls writes one buffer, not four. The
FX model without this was 3-64% above the replay of Inductor's code on the bench's tiny GPT, GPT-2,
Llama, DiT and the small GPT (fp32 and bf16 autocast, where the casts are such chains); with it,
within 3.6% of it (``tests/test_fusion.py``, docs/results.md). Not within 5%: the tiny CNN under bf16
autocast (23% under: Inductor runs the residual branches' gradient kernels together, and keeps the
weight gradients' small kernels to the end) and the GRU decoder (8-15% over).

The rules, after ``GraphLowering.run_node`` and ``StorageBox.mark_reuse`` in torch 2.11 and 2.13:

- Only pointwise ops are inlined (``torch.Tag.pointwise``, casts, constants, indexing loads such as
  ``embedding``); reductions, matmuls, attention, every fallback and every extern kernel write a
  buffer.
- Never a graph output (a saved tensor, a user output, a gradient), through any view.
- Every op that reads it (through views) must take an expression: a pointwise op or a reduction.
  An extern kernel (``mm``), a fallback or anything else realizes its inputs.
- Read by more than one op, it is realized where its expression reads more than
  ``realize_reads_threshold`` buffers, is long (``realize_opcount_threshold``), or, on a CPU, runs
  an op the installed Inductor calls heavy there (``_compat.inductor_heavy_ops_on_cpu``: ``exp`` and
  ``sigmoid`` on torch 2.11; ``log``, ``tanh`` and others as well on 2.13).
  Any read count past ``realize_acc_reads_threshold`` realizes it as well.

An inlined node's reads happen where the kernels that compute it run (``Fusion.runs_at``): a buffer
it reads lives until then. After lowering, what Inductor's scheduler does that moves memory:

- a generated kernel writes its output in place of an input of the same size and dtype that it
  reads last (``Fusion.kernels``, ``Fusion.allocated``; applied in ``memory``);
- ``add(mm(a, b), c)`` is one extern ``addmm`` (a post-grad pattern), the mm's product no buffer;
- two kernels reading a buffer in common are fused side by side and run together
  (``Fusion.order``, ``_schedule``).

Not modelled: the fusions the scheduler declines, buffers it makes local to one kernel, and its
``reorder_for_peak_memory``. The realize thresholds come from Inductor's config
(``_compat.inductor_realize_limits``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx as fx

from .._compat import inductor_heavy_ops_on_cpu, inductor_realize_limits
from .graph import is_view, last_reads, storage_owners, storage_root, storage_users

__all__ = ["Fusion", "addmm_products", "extern_scratch", "inductor_fusion"]

aten, prims = torch.ops.aten, torch.ops.prims

# Lowered as pointwise expressions though not tagged pointwise: casts, copies, constants, loads
# through an index (Inductor's ``embedding`` and ``gather`` lowerings are indirect loads), and writes
# of a slice or a select into a tensor (``slice_scatter``, ``select_scatter``: a masked ``where``; the
# zeros the backward of a fused QKV's unpacking, or of a rotary embedding's halves, writes into are no
# buffer).
_POINTWISE = frozenset({
    "convert_element_type", "_to_copy", "clone", "full", "full_like", "scalar_tensor", "iota", "zeros",
    "zeros_like", "ones", "ones_like", "embedding", "gather", "index", "where", "fill", "slice_scatter",
    "select_scatter",
})  # fmt: skip
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "var_mean", "var", "max", "min", "argmax", "argmin", "prod", "any", "all",
})  # fmt: skip
# Extern kernels whose scratch Inductor's code cannot show, taken from torch's allocator while they
# run (see ``extern_scratch``).
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


@dataclasses.dataclass(frozen=True)
class Fusion:
    """``inlined``: nodes with no buffer of their own. ``runs_at``: for each of them (and each view
    of one), the last node with a buffer that computes it, where its own reads happen.
    ``order``: the nodes in the order Inductor runs them, once it fused kernels side by side
    (``_schedule``). ``kernels``: the nodes with a buffer that a kernel Inductor generates writes (pointwise ops):
    such a kernel writes its output in place of an input of the same size and dtype that it reads
    last (``memory``'s in-place rule), as Inductor's scheduler does (``buf1 = mm; del mm  # reuse``:
    the logits' gradient in the saved logits), if that input's buffer is one Inductor allocated
    (``allocated``: its kernels' and the extern matmuls' ``out=``; not what a fallback op returned,
    such as a reload) or one the backward was given (a saved tensor: AOTAutograd donates them)."""

    inlined: frozenset[fx.Node]
    runs_at: Mapping[fx.Node, fx.Node]
    kernels: frozenset[fx.Node] = frozenset()
    allocated: frozenset[fx.Node] = frozenset()
    order: tuple[fx.Node, ...] = ()  # the graph's nodes as Inductor runs them; () where as in the graph
    # For each pointwise node, the buffers its expression reads (through the inlined nodes it reads):
    # what the kernel computing it loads (``cost.node_time``).
    reads: Mapping[fx.Node, frozenset[fx.Node]] = dataclasses.field(default_factory=dict)


def _name(node: fx.Node) -> str:
    """``mm`` for ``aten.mm.default``, ``convert_element_type`` for the prim."""
    return getattr(node.target, "__name__", "").split(".")[0] if node.op == "call_function" else ""


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor) or target._schema.is_mutable:
        return False
    return torch.Tag.pointwise in target.tags or _name(node) in _POINTWISE


def _takes_expression(node: fx.Node, addmms: Mapping[fx.Node, fx.Node]) -> bool:
    """An op whose kernel can compute an unrealized input inside it: pointwise ops and reductions
    (not an ``add`` Inductor turns into an ``addmm``)."""
    if node in addmms:
        return False
    return _pointwise(node) or (node.op == "call_function" and _name(node) in _REDUCTIONS)


def _addmms(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """The ``add(mm(a, b), c)`` that Inductor's post-grad ``addmm`` pattern makes one extern
    ``addmm(c, a, b)`` (by add, its mm): the mm read by that add alone, ``c`` a tensor of the mm's
    inputs' dtype that expands to its shape; on a GPU not where every reader of the add is
    pointwise (``should_prefer_unfused_addmm``): the bias add then fuses into them. The weight
    gradients that a recurrent model's backward sums over its steps are such chains."""
    out: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op != "call_function" or n.target is not aten.add.Tensor or n.kwargs or len(n.args) != 2:
            continue
        for mm, inp in (n.args, n.args[::-1]):
            if not (isinstance(mm, fx.Node) and mm.target is aten.mm.default and len(mm.users) == 1):
                continue
            val, mine = inp.meta.get("val") if isinstance(inp, fx.Node) else None, mm.meta.get("val")
            if not isinstance(val, torch.Tensor) or not isinstance(mine, torch.Tensor) or val.dtype != mine.dtype:
                continue
            if len(val.shape) > 2 or any(s not in (1, t) for s, t in zip(val.shape[::-1], mine.shape[::-1])):
                continue
            if mine.device.type != "cpu" and all(_pointwise(u) for u in n.users):
                continue
            out[n] = mm
            break
    return out


def addmm_products(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """The ``mm`` nodes of ``gm`` that Inductor folds into an ``addmm`` with the ``add`` reading them
    (``_addmms``), each to that ``add``: the mm has no buffer of its own (the add's is the addmm's),
    and one more reader (a copy's data edge) undoes the fold."""
    return {mm: add for add, mm in _addmms(list(gm.graph.nodes)).items()}


def inductor_fusion(gm: fx.GraphModule) -> Fusion:
    """The nodes of ``gm`` Inductor inlines into the kernels that read them (see the module's rules)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    addmms = _addmms(nodes)
    inlined: set[fx.Node] = set()
    reads: dict[fx.Node, frozenset[fx.Node]] = {}  # the buffers a pointwise node's expression reads
    ops: dict[fx.Node, frozenset[str]] = {}
    size: dict[fx.Node, int] = {}
    for n in nodes:
        if not _pointwise(n) or n in addmms:
            continue
        read, used, count = set(), {_name(n)}, 1
        for arg in n.all_input_nodes:
            root = storage_root(arg)
            if root in inlined:
                read |= reads[root]
                used |= ops[root]
                count += size[root]
            else:
                read.add(root)
        reads[n] = frozenset(read)
        readers = [u for u in storage_users(n) if not is_view(u)]  # through views
        if not readers or any(r.op == "output" or not _takes_expression(r, addmms) for r in readers):
            continue
        val = n.meta["val"]
        limits = inductor_realize_limits(cpu=val.device.type == "cpu")
        heavy = val.device.type == "cpu" and bool(used & inductor_heavy_ops_on_cpu())
        if len(n.users) > 1 and (heavy or len(read) > limits.reads or count > limits.opcount):
            continue
        if len(read) > limits.acc_reads:
            continue
        inlined.add(n)
        ops[n], size[n] = frozenset(used), count
    inlined.update(addmms.values())  # the mm's product is written by the addmm
    runs_at: dict[fx.Node, fx.Node] = {}
    for n in reversed(nodes):
        if n in inlined or (is_view(n) and storage_root(n) in inlined):
            at = [runs_at.get(u, u) for u in n.users]
            runs_at[n] = max(at, key=index.__getitem__) if at else n
    kernels = frozenset(n for n in nodes if _pointwise(n) and n not in inlined and n not in addmms)
    allocated = kernels | {n for n in nodes if n in addmms or _name(n) in _MATMULS}
    order = _schedule(nodes, index, {k: reads[k] for k in kernels}, runs_at)
    return Fusion(frozenset(inlined), runs_at, kernels, frozenset(allocated), order, reads)


def _reaches(a: fx.Node, b: fx.Node, index: Mapping[fx.Node, int]) -> bool:
    """Whether ``b`` is computed from ``a`` (``a`` before ``b`` in the graph)."""
    stack, seen = [a], {a}
    while stack:
        for u in stack.pop().users:
            if u is b:
                return True
            if u not in seen and index[u] < index[b]:
                seen.add(u)
                stack.append(u)
    return False


def _schedule(
    nodes: list[fx.Node],
    index: Mapping[fx.Node, int],
    reads: Mapping[fx.Node, frozenset[fx.Node]],
    runs_at: Mapping[fx.Node, fx.Node],
) -> tuple[fx.Node, ...]:
    """The order Inductor runs ``nodes`` in once its scheduler has fused, side by side, two
    pointwise kernels (``reads``: each one's, with the buffers its expression reads) over as many
    elements that read a buffer the later one reads last, neither computed from the other (a
    horizontal fusion: an activation recomputed in the backward, ``sin(x)``, and its derivative,
    ``g * cos(x)``, both read ``x``). The fused kernel takes the place of its first member and
    what its later members need is run before it (``Scheduler.topological_sort_schedule``), so
    buffers the graph makes apart are alive together: recomputing blocks of ``sin``, the FX order
    was 21-24% under Inductor's code, 1.5% with it. Not modelled: the pairs Inductor declines (its
    ``can_fuse`` rules), its ``reorder_for_peak_memory``. Empty where nothing is fused so."""
    last = last_reads(nodes, storage_owners(nodes), runs_at)
    by_read: dict[fx.Node, list[fx.Node]] = {}
    for k in sorted(reads, key=index.__getitem__):
        for r in sorted(reads[k], key=index.__getitem__):  # in the graph's order: the same plan each time
            by_read.setdefault(r, []).append(k)
    group: dict[fx.Node, list[fx.Node]] = {}
    for read, kernels in by_read.items():
        for a, b in zip(kernels, kernels[1:]):
            if (a in group and group.get(a) is group.get(b)) or last.get(read) != index[b]:
                continue
            if _numel(a) is None or _numel(a) != _numel(b):
                continue
            members = sorted(set(group.get(a, [a]) + group.get(b, [b])), key=index.__getitem__)
            if any(_reaches(x, y, index) for i, x in enumerate(members) for y in members[i + 1 :]):
                continue
            for m in members:
                group[m] = members
    return _topological(nodes, index, group) if group else ()


def _numel(node: fx.Node) -> int | None:
    """Elements of the node's output; None for a symbolic count (``int()`` of it would add a guard
    that specializes the compiled graph to this size)."""
    numel = node.meta["val"].numel()
    return numel if isinstance(numel, int) else None


def _topological(
    nodes: list[fx.Node], index: Mapping[fx.Node, int], group: Mapping[fx.Node, list[fx.Node]]
) -> tuple[fx.Node, ...]:
    """``nodes`` with each group of ``group`` run together: groups and single nodes taken in the
    order of their first node, each after what it reads (depth first, the earliest first); empty
    where two groups need each other."""
    unit = {n: tuple(group.get(n, (n,))) for n in nodes}
    out: list[fx.Node] = []
    done: set[tuple[fx.Node, ...]] = set()
    entered: set[tuple[fx.Node, ...]] = set()
    for start in nodes:
        stack = [(unit[start], False)]
        while stack:
            u, expanded = stack.pop()
            if u in done:
                continue
            if expanded:
                done.add(u)
                out.extend(u)
                continue
            if u in entered:  # two groups each needing the other: Inductor fuses neither so
                return ()
            entered.add(u)
            stack.append((u, True))
            needs = {unit[i] for m in u for i in m.all_input_nodes} - done - {u}
            stack.extend((d, False) for d in sorted(needs, key=lambda d: index[d[0]], reverse=True))
    return tuple(out)


def extern_scratch(temporaries: Mapping[fx.Node, int]) -> dict[fx.Node, int]:
    """Of the ops' measured scratch (``measure.standalone.op_temporaries``), what the FX model of
    the code Inductor generates counts (``memory.simulate`` with ``fuses``): the matmuls', which
    Inductor calls as extern kernels on the FX graph's layouts. On a CPU with bf16 matmul units oneDNN
    takes it from torch's allocator (up to about twice the output of a small bf16 ``mm`` on a 2-core
    EPYC; none in fp32). Other ops are left out: measured on the FX graph's layouts, their scratch
    may not be what Inductor's layouts need (a channels-last ``convolution_backward`` measured 1 MiB
    alone, while the step stayed within 19 KB without it). The replay of the code itself measures
    every call on the code's own layouts (``measure.standalone.call_temporaries``), and the model
    takes those figures where that code was lowered (``memory.CodeFacts``)."""
    return {n: b for n, b in temporaries.items() if _name(n) in _MATMULS}
