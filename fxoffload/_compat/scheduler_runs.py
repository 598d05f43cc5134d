"""Kernel runs that a transfer op split, joined again in Inductor's schedule where no peak rises.

Inductor's C++ backend writes the nodes it generates code for into one kernel function until an
extern call comes (``Scheduler._codegen`` flushes at every extern node): a run of kernel nodes is
one C++ function to compile, and a transfer op standing between two runs splits it in two.
``rewrite.kernel_runs`` puts the transfer ops at the edges of the runs of the FX graph; Inductor's
memory reordering (``torch._inductor.memory.reorder_for_peak_memory``, the last reordering of its
schedule) then moves them again, a wait to just after its copy, a copy to just after its source: on
the 12-block GPT of ``bench.compile_time`` (policy "all") 26 distinct kernels to compile where
Inductor's own code has 19, about a second each on a CPU.

``joining_runs`` wraps that reordering, for the graphs lowered inside it: after Inductor's order, a
group of transfer ops standing between two runs is moved out of the way, the ops that the later run
reads before the earlier run, the ops that read the earlier run after the later one, when the
schedule's device peak (host copies left out: ``_host_buffers``), as Inductor's C++ code allocates
it, does not rise. That code allocates the buffers of a whole run before calling it (``_run_peak``),
so joining two runs holds the later one's buffers over the earlier one's call, and a wait moved
down holds its source: near the peak a join is refused (the forward waits of 86e73b4 stay where
they free memory that counts).

``waits_where_planned`` runs inside that wrapper first, on every device: Inductor's reordering runs
each offload's wait as early as it can (it frees the source there, to its estimate), the compute
stream then waiting for the whole copy; the wait is put back after the kernels the plan put behind
its copy.

``fusing_within`` keeps the scheduler from fusing two kernels of different groups (a graph's
blocks, where torch's partitioner recomputes them in turn: ``analysis.blocks``). Layers that share
weights (ALBERT's one layer applied six times, a ``ModuleList`` item called twice) recompute kernels
that read the same weights, and Inductor fuses such kernels across calls (``score_fusion_memory``
counts the shared reads): every call's recomputation then runs in one kernel at the start of the
backward, the peak that recomputing block by block was to avoid (ALBERT tiny: 13.4 MiB against 12.0
MiB with nothing recomputed; with the fusions refused 4.5 MiB, docs/results.md).

Private Inductor pieces (the scheduler's nodes, its memory estimates, ``Scheduler.can_fuse``): torch
2.11 and 2.13 alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch._inductor.memory as inductor_memory
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.dependencies import StarDep, WeakDep
from torch._inductor.scheduler import BaseSchedulerNode, NopKernelSchedulerNode, Scheduler, SchedulerNode
from torch.utils._ordered_set import OrderedSet

log = logging.getLogger(__name__)

__all__ = [
    "TransferOps", "fusing_within", "join_runs", "joining_runs", "keeping_mutation_renames",
    "waits_where_planned",
]  # fmt: skip

# The group of an FX node of the graph lowered, for ``fusing_within`` (None: in no group).
Groups = Callable[[Any], str | None]


@contextlib.contextmanager
def keeping_mutation_renames(ops: TransferOps | None, graph: Any) -> Iterator[None]:
    """Inductor's scheduler, lowering ``graph`` where it calls one of ``ops`` (a graph with copies;
    Inductor's own otherwise), keeping a node's dependencies on the mutations before it where it
    recomputes the node's loops.

    ``SchedulerNode.recompute_size_and_body`` (the C++ backend's fusion of loops of another shape,
    its loop split) reads a node's dependencies again from its loop body, and drops the renames that
    point its reads at the latest mutation of a buffer (torch 2.13 renames only where the node has
    fake dependencies; 2.11 keeps neither the renames nor those). A kernel reading an accumulating
    ``index_put``'s result then depends on the buffer scattered into, not on the scatter, and
    Inductor's peak-memory reordering is free to put it first; copies change the peaks it weighs: a
    wrong loss, or a buffer read after its reuse (fuzz seed 39 case 10, docs/results.md). Inside,
    both are kept, as 2.13 does where there are fake dependencies. (Its GPU backends recompute a split
    reduction by ``_compute_attrs`` alone: not this path, not covered.)"""
    if ops is None or not any(n.target in ops.all for n in graph.graph.nodes):
        yield
        return
    original = SchedulerNode.recompute_size_and_body

    def recompute(node: SchedulerNode, *args: Any, **kwargs: Any) -> None:
        fake = OrderedSet(dep for dep in node.read_writes.reads if isinstance(dep, (WeakDep, StarDep)))
        original(node, *args, **kwargs)
        node.set_read_writes(node.read_writes.with_read(fake).rename(node.mutation_renames))

    SchedulerNode.recompute_size_and_body = recompute  # type: ignore[method-assign]
    try:
        yield
    finally:
        SchedulerNode.recompute_size_and_body = original  # type: ignore[method-assign]


def _op(n: BaseSchedulerNode) -> Any:
    return getattr(getattr(n, "node", None), "op_overload", None)


def _runs_on_cpu(n: BaseSchedulerNode) -> bool:
    device = n.get_device()
    return device is not None and device.type == "cpu"


def _in_run(n: BaseSchedulerNode) -> bool:
    """A node that does not end a run of Inductor's C++ code (a kernel, or a view's no-op)."""
    return not n.is_extern() and not n.is_template() and (isinstance(n, NopKernelSchedulerNode) or _runs_on_cpu(n))


def _kernel(n: BaseSchedulerNode) -> bool:
    return _in_run(n) and not isinstance(n, NopKernelSchedulerNode)


def _movable(n: BaseSchedulerNode, transfer_ops: frozenset[Any]) -> bool:
    """A transfer op, or the output Inductor unpacks from one (``MultiOutput``)."""
    if _op(n) in transfer_ops:
        return True
    inner = getattr(n, "node", None)
    unpacks = isinstance(inner, ir.MultiOutput)
    return unpacks and any(getattr(i, "op_overload", None) in transfer_ops for i in inner.inputs)


def _depends(later: BaseSchedulerNode, earlier: BaseSchedulerNode) -> bool:
    """Whether ``later`` reads (through any chain) what ``earlier`` computes."""
    return any(name in later.ancestors for name in earlier.get_operation_names())


def _run_end(order: Sequence[BaseSchedulerNode], start: int) -> int:
    end = start
    while end < len(order) and _in_run(order[end]):
        end += 1
    return end


def _run_start(order: Sequence[BaseSchedulerNode], end: int) -> int:
    start = end
    while start > 0 and _in_run(order[start - 1]):
        start -= 1
    return start


def _join(order: list[BaseSchedulerNode], a: int, b: int) -> list[BaseSchedulerNode] | None:
    """``order`` with the gap ``order[a:b]`` (transfer ops between the run ending at ``a`` and the
    one starting at ``b``) moved out of the way, or None where its dependencies forbid it: what the
    later run reads goes before the earlier run, what reads the earlier run after the later one."""
    r1 = order[_run_start(order, a) : a]
    end = _run_end(order, b)
    r2 = order[b:end]
    gap = order[a:b]
    up: list[BaseSchedulerNode] = []
    for g in reversed(gap):  # what the later run (or an op that goes up) reads
        if any(_depends(k, g) for k in r2) or any(_depends(u, g) for u in up):
            up.append(g)
    up.reverse()
    down = [g for g in gap if g not in up]
    if any(_depends(g, k) for g in up for k in r1):
        return None
    start = a - len(r1)
    return order[:start] + up + r1 + r2 + down + order[end:]


@dataclasses.dataclass(frozen=True)
class TransferOps:
    """fxoffload's transfer ops as the scheduler sees them (``ir``, which this package cannot import)."""

    all: frozenset[Any]
    offload: Any  # its output, and a wait's of it, are host copies: not device memory
    reload: Any  # what it reads is a host copy (a backward's input)
    wait: Any


def _host_buffers(order: Sequence[BaseSchedulerNode], ops: TransferOps) -> set[str]:
    """The names of the buffers that hold host copies: an offload's output, its wait's, the outputs
    Inductor unpacks from either, and what a reload reads (in a backward, its inputs)."""
    host: set[str] = set()
    for n in order:
        inner = getattr(n, "node", None)
        op = _op(n)
        first = inner.inputs[0] if op is not None and getattr(inner, "inputs", None) else None
        if op is ops.reload and first is not None:
            host.add(first.get_name())
        unpacked = isinstance(inner, ir.MultiOutput) and any(i.get_name() in host for i in inner.inputs)
        if op is ops.offload or (op is ops.wait and first is not None and first.get_name() in host) or unpacked:
            host.add(inner.get_name())
            host.update(b.get_name() for b in n.get_outputs())
    return host


def _run_peak(order: Sequence[BaseSchedulerNode], freeable: dict[str, Any], outputs: Any, host: set[str]) -> int:
    """The schedule's device peak as Inductor's C++ code allocates it: a run's buffers all before
    its call, what it read last freed after it; an extern node's output at its call. Host copies
    (``host``) are not device memory; Inductor's own estimate counts them, and on a CPU (where they
    are plain CPU tensors) they, returned by the forward, made its end the peak of every schedule."""
    buffers, _, _ = inductor_memory.compute_memory_timeline(list(order), freeable, outputs)
    alloc, free = [0] * len(order), [0] * len(order)
    for info in buffers:
        if info.buffer.get_name() in host:
            continue
        alloc[info.start_step] += info.size_alloc
        if info.end_step != -1:
            free[info.end_step] += info.size_free
    current = peak = 0
    i = 0
    while i < len(order):
        end = _run_end(order, i) if _in_run(order[i]) else i + 1
        peak = max(peak, current + sum(alloc[i:end]))
        current += sum(alloc[i:end]) - sum(free[i:end])
        i = end
    return peak


def _forward_waits(order: Sequence[BaseSchedulerNode], ops: TransferOps) -> list[BaseSchedulerNode]:
    """The waits of ``order`` on offloads, in order: those ``_host_buffers`` counts (their output is
    the host copy they wait for)."""
    host = _host_buffers(order, ops)
    return [n for n in order if _op(n) is ops.wait and n.node.get_name() in host]


def waits_where_planned(
    given: Sequence[BaseSchedulerNode], order: Sequence[BaseSchedulerNode], ops: TransferOps
) -> list[BaseSchedulerNode]:
    """``order`` (Inductor's reordering of ``given``, the plan's order) with each offload's wait put
    back after every node the plan put between its copy and it (the copy's window), where Inductor
    moved it up; down only, never past a node that reads it, nor past the node the plan put right
    after it (the memory model frees the source there).

    Inductor's peak-memory reordering sees a wait as the last reader of the copy's source, and so
    runs it as early as it can: right after the first kernel after the copy, the compute stream
    waiting for the whole transfer where the plan had it hide behind its window. In Inductor's code
    for the fake H100 (``testing.cuda_codegen``, two blocks, a slow link) a copy the plan put 11
    matmuls behind had none; on this CPU, at a link too slow for any copy to hide, the tiny
    transformers' code peaked 17-34% under the memory model, every forward source freed that early,
    and on a device each such wait would have stalled (docs/results.md, twenty-eighth session)."""
    result = list(order)
    if len(result) != len(given) or set(result) != set(given):  # not a reordering: left as it is
        log.debug("fxoffload: Inductor's reordering changed the schedule's nodes; its waits left where they are")
        return result
    unpacked: dict[str, list[BaseSchedulerNode]] = {}  # by the buffer unpacked from
    for n in given:
        inner = getattr(n, "node", None)
        if isinstance(inner, ir.MultiOutput):
            for i in inner.inputs:
                unpacked.setdefault(i.get_name(), []).append(n)
    for wait in _forward_waits(given, ops):
        i = given.index(wait)
        copies = (k for k in range(i - 1, -1, -1) if _op(given[k]) is ops.offload)
        copy = next((k for k in copies if _depends(wait, given[k])), None)
        window = [n for n in given[copy + 1 : i] if not _movable(n, ops.all)] if copy is not None else []
        if not window:
            continue
        after = next((n for n in given[i + 1 :] if not _movable(n, ops.all)), None)
        group = [wait, *(u for name in wait.get_buffer_names() for u in unpacked.get(name, ()))]
        start = result.index(wait)  # in ``rest`` too: what it unpacks comes after it
        rest = [n for n in result if n not in group]
        inside = set(window)
        at = max(k for k, n in enumerate(rest) if n in inside) + 1
        limits = (k for k in range(start, at) if rest[k] is after or any(_depends(rest[k], g) for g in group))
        at = next(limits, at)
        if at > start:
            result = rest[:at] + group + rest[at:]
    return result


def join_runs(
    order: list[BaseSchedulerNode], transfer_ops: frozenset[Any], peak: Callable[[Sequence[BaseSchedulerNode]], int]
) -> tuple[list[BaseSchedulerNode], int]:
    """``order`` with each gap of transfer ops between two C++ kernel runs moved out of the way
    where ``peak`` (of a whole schedule) does not rise; and how many gaps were closed."""
    best = peak(order)
    closed = 0
    i = 1
    while i < len(order):
        if not (_movable(order[i], transfer_ops) and _kernel(order[i - 1])):
            i += 1
            continue
        b = i
        while b < len(order) and _movable(order[b], transfer_ops):
            b += 1
        if b == len(order) or not any(_kernel(n) for n in order[b : _run_end(order, b)]):
            i = b
            continue
        joined = _join(order, i, b)
        if joined is not None:
            value = peak(joined)
            if value <= best:
                order, best, closed = joined, value, closed + 1
                i = _run_start(order, i)  # the joined run may close the next gap too
                continue
        i = b
    return order, closed


@contextlib.contextmanager
def joining_runs(ops: TransferOps | None, graph: Any = None, groups: Groups | None = None) -> Iterator[None]:
    """Inductor's memory reordering followed by ``join_runs`` for the graphs lowered inside (None:
    Inductor's alone); ``graph``, lowered inside, ``keeping_mutation_renames`` where it calls an op of
    ``ops``; ``groups``: its kernels fused only within a group (``fusing_within``). Both changes to
    Inductor's schedule are in its cache key (``_cache_key``)."""
    if ops is None and groups is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        if ops is not None and graph is not None:
            stack.enter_context(keeping_mutation_renames(ops, graph))
        if ops is not None:
            stack.enter_context(_joining_runs(ops))
        stack.enter_context(fusing_within(groups))
        stack.enter_context(inductor_config.patch(_cache_key(ops is not None, groups is not None)))
        yield


@contextlib.contextmanager
def fusing_within(groups: Groups | None) -> Iterator[None]:
    """Inductor's scheduler, for the graphs lowered inside, fusing no two nodes whose FX origins lie in
    different groups (``groups(origin)``; a node with none of a group's origins fuses as Inductor
    decides): one group's kernels never run in another's. None: Inductor's fusion."""
    if groups is None:
        yield
        return
    original = Scheduler.can_fuse
    seen: dict[Any, str | None] = {}
    refused = [0]

    def groups_of(node: BaseSchedulerNode) -> frozenset[str]:
        found = set()
        for n in node.get_nodes():
            inner = getattr(n, "node", None)
            for origin in inner.get_origins() if inner is not None else ():
                if origin not in seen:
                    seen[origin] = groups(origin)
                if seen[origin] is not None:
                    found.add(seen[origin])
        return frozenset(found)

    def can_fuse(self: Scheduler, node1: BaseSchedulerNode, node2: BaseSchedulerNode, *args: Any, **kwargs: Any) -> bool:
        first, second = groups_of(node1), groups_of(node2)
        if first and second and first != second:
            refused[0] += 1
            return False
        return original(self, node1, node2, *args, **kwargs)

    Scheduler.can_fuse = can_fuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler.can_fuse = original  # type: ignore[method-assign]
        log.debug("fxoffload: %d fusions across groups refused in Inductor's schedule", refused[0])


@contextlib.contextmanager
def _joining_runs(ops: TransferOps) -> Iterator[None]:
    original = inductor_memory.reorder_for_peak_memory

    def reorder(nodes: list[BaseSchedulerNode], name_to_buf: Any, name_to_fused_node: Any,
                graph_inputs: Any, graph_outputs: Any, *args: Any, **kwargs: Any) -> list[BaseSchedulerNode]:  # fmt: skip
        given = list(nodes)
        order = original(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs)
        if not any(_op(n) in ops.all for n in order):
            return order
        order = waits_where_planned(given, order, ops)
        if not any(_kernel(n) for n in order):
            return order  # nothing to join: no C++ run (a CUDA graph's Triton kernels)
        _, freeable = inductor_memory.prepare_planning_info(
            order, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs
        )
        host = _host_buffers(order, ops)
        joined, closed = join_runs(order, ops.all, lambda o: _run_peak(o, freeable, graph_outputs, host))
        log.debug("fxoffload: %d gaps between C++ kernel runs closed in Inductor's schedule", closed)
        return joined

    inductor_memory.reorder_for_peak_memory = reorder
    try:
        yield
    finally:
        inductor_memory.reorder_for_peak_memory = original


# What the code of a graph lowered inside ``joining_runs`` depends on beyond its graph and config: this
# module's source, and the transfer ops' lowering (``lowering.py``).
_JOIN_KEY = hashlib.sha256(
    b"".join(p.read_bytes() for p in (Path(__file__), Path(__file__).with_name("lowering.py")))
).hexdigest()[:16]


class _JoinKey(CustomGraphPass):
    """The user's post-grad pre-passes (none, one, or a list on torch 2.13), run as they are, their
    ``uuid``s with ``_JOIN_KEY`` beside, and what of Inductor's schedule was changed."""

    def __init__(self, inner: Sequence[CustomGraphPass], changed: tuple[str, ...] = ("kernel runs joined",)) -> None:
        self.inner = tuple(inner)
        self.changed = changed

    def __call__(self, graph: Any) -> None:
        for p in self.inner:
            p(graph)

    def uuid(self) -> Any:
        inner = tuple(p.uuid() for p in self.inner)
        if not all(inner):
            return None  # a pass without a key: Inductor bypasses its cache, as it would without us
        return (f"fxoffload: {', '.join(self.changed)}", _JOIN_KEY, inner)


def _cache_key(joined: bool = True, within_groups: bool = False) -> dict[str, Any]:
    """Inductor's FX graph cache keys a graph on the graph and Inductor's config, not on a change to
    the schedule made here: code lowered without the join (an earlier fxoffload, or the join's rule
    changed) came back from it for the same graph. The join goes into the key as a post-grad pass
    that does nothing of its own (the user's, where they are keyed ``CustomGraphPass``es, run inside);
    a plain function there already keeps Inductor from caching, and is left alone."""
    user = inductor_config.post_grad_custom_pre_pass
    passes = [] if user is None else list(user) if isinstance(user, (list, tuple)) else [user]
    if not all(isinstance(p, CustomGraphPass) for p in passes):
        return {}
    changed = (("kernel runs joined", "waits where planned") if joined else ()) + (
        ("fused within groups",) if within_groups else ()
    )
    return {"post_grad_custom_pre_pass": _JoinKey(passes, changed)}
