"""Memory model: live device bytes after every node of a forward/backward pair. Pure, reads graphs.

Rules (sizes from fake values, symbolic sizes at their hints):

- A node's output storage is allocated when the node runs and freed after the last node that reads
  it through any alias; views and getitems of aliasing ops allocate nothing.
- Forward placeholders are "parameters" when static (parameters, buffers) and "inputs" otherwise;
  both live through the whole step.
- Forward outputs saved for the backward are "saved" from their producer until their last backward
  use; user outputs live until the end of the forward; everything else is "transient".
- Backward outputs are "gradients" and live until the end of the backward; tangents are "transient".
- "outside": what code before the pair saved for its own backward and its parameters
  (``outside.py``), given as ``outside``; held at every point, since autograd runs that backward
  after this pair's; ``outside_backward`` more during the backward (later code's gradients). A pair
  run several times in a step (a block run per layer) is planned for its calls at once
  (``CallOutside``): each point holds the most any of them holds there, and the earlier calls hold
  what the plan keeps.
- Host tensors (the outputs of ``fxoffload.offload`` and the backward placeholders holding them) are
  not device memory. A ``fxoffload.reload`` allocates its device destination when it is issued.

- Under Inductor (``fuses``), the graphs as Inductor compiles them (``fusion``): pointwise ops it
  inlines into other kernels have no buffer and read where those kernels run, a kernel writes in
  place of a buffer it reads last, kernels fused side by side run together, and of the measured
  scratch only the extern matmuls' counts; with what that code showed (``CodeFacts``), its calls'
  scratch at the nodes that run them and its saved copies of placeholders, which its layout
  optimization predicts too (``layout_copies``).

A plan is data to this model: ``with_plan(baseline, off)`` is the timeline of the pair once the
plan's tensors are off the device over the points ``off`` gives (``planning.off_device``). The planner's
budget fit compares plans with it, without rewriting graphs; ``simulate`` on the rewritten pair gives
the same figure at every node the pair had (``tests/test_memory.py`` holds the two together).

The model predicts allocated bytes (what ``torch.cuda.max_memory_allocated`` measures), not reserved
bytes: the caching allocator's rounding and fragmentation come on top.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from .._compat import donates_saved_buffers, inductor_channels_last_nodes, kernel_source_name
from ..ir import OFFLOAD, WAIT, is_transfer
from ..sizes import tensor_bytes
from .fusion import Fusion, extern_scratch, inductor_fusion
from .graph import holds_host_copy, last_reads, op_name, static_inputs, storage_owners, storage_root

CATEGORIES = ("parameters", "inputs", "saved", "transient", "gradients", "outside")


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    phase: str  # "forward" or "backward"
    node: str
    live: dict[str, int]  # bytes per category after the node ran

    @property
    def total(self) -> int:
        return sum(self.live.values())


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    points: tuple[MemoryPoint, ...]

    @property
    def peak(self) -> MemoryPoint:
        return max(self.points, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total if self.points else 0

    def phase_peak(self, phase: str, default: int = 0) -> int:
        """The most bytes live at a point of ``phase`` ("forward" or "backward"); ``default`` if none."""
        return max((p.total for p in self.points if p.phase == phase), default=default)


def bytes_over_points(n: int, spans: Sequence[tuple[int, int, int]]) -> list[int]:
    """At each of ``n`` points, the sum of ``nbytes`` of the ``(start, stop, nbytes)`` spans that
    cover it (``start <= i < stop``)."""
    delta = [0] * (n + 1)
    for start, stop, nbytes in spans:
        start = min(n, max(0, start))
        delta[start] += nbytes
        delta[min(n, max(start, stop))] -= nbytes
    out, running = [], 0
    for d in delta[:n]:
        running += d
        out.append(running)
    return out


def with_held(timeline: MemoryTimeline, held: Sequence[int], kind: str = "saved") -> MemoryTimeline:
    """``timeline`` with ``held[i]`` more bytes of ``kind`` at its point ``i``: what a timeline of the
    compiled code leaves out (copies switched off at run time, kept on the device)."""
    return MemoryTimeline(tuple(
        dataclasses.replace(p, live={**p.live, kind: p.live.get(kind, 0) + h}) if h else p
        for p, h in zip(timeline.points, held)
    ))  # fmt: skip


def _is_host(node: fx.Node) -> bool:
    """A host tensor: an offload's result (through its wait), or a backward placeholder a reload reads."""
    if is_transfer(node, OFFLOAD):
        return True
    if is_transfer(node, WAIT):
        return _is_host(node.args[0])
    return holds_host_copy(node)


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or _is_host(node) or val.device.type == "meta":
        return 0
    return tensor_bytes(val)


def _born(nodes: Sequence[fx.Node]) -> dict[int, list[fx.Node]]:
    """The nodes whose storage is allocated at each position: a node's own, except the outputs of an
    op returning several tensors (its ``getitem`` nodes), which that op allocates while it runs."""
    index = {n: i for i, n in enumerate(nodes)}
    out: dict[int, list[fx.Node]] = {}
    for i, n in enumerate(nodes):
        parent = n.args[0] if n.op == "call_function" and n.target is operator.getitem else None
        at = index[parent] if isinstance(parent, fx.Node) and parent.op == "call_function" else i
        out.setdefault(at, []).append(n)
    return out


def _in_place(
    node: fx.Node, dying: Sequence[fx.Node], fusion: Fusion | None, donated: Sequence[fx.Node] = ()
) -> fx.Node | None:
    """The storage among ``dying`` (read for the last time by ``node``: Inductor's own buffers count,
    ``Fusion.allocated``) and ``donated`` (saved tensors read last there) that Inductor's kernel for
    ``node`` writes its output into: one of the same bytes and dtype (``Fusion.kernels``)."""
    if fusion is None or node not in fusion.kernels:
        return None
    dtype = node.meta["val"].dtype
    for x in [d for d in dying if d in fusion.allocated] + list(donated):
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == dtype and _bytes(x) == _bytes(node):
            return x
    return None


def _running(live: dict[str, int], node: fx.Node, scratch: Mapping[fx.Node, int], phase: str) -> MemoryPoint:
    point = dict(live)
    point["transient"] += scratch.get(node, 0)
    return MemoryPoint(phase, node.name, point)


def simulate(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    static_input_indices: Sequence[int] = (),
    temporaries: Mapping[fx.Node, int] | None = None,
    outside: int = 0,
    outside_backward: int = 0,
    fuses: bool = False,
    code: CodeFacts | None = None,
    fusions: tuple[Fusion, Fusion] | None = None,
) -> MemoryTimeline:
    """The device-memory timeline of one training step through ``fw`` then ``bw``.

    ``temporaries``: scratch bytes a node allocates and frees inside its own call (measured, see
    ``measure.standalone.op_temporaries``), counted at that node's point as "transient". ``outside``: bytes
    code before the pair holds through it (``outside.OutsideMemory.outside``); ``outside_backward``:
    bytes more there during the backward, which later code made after this pair's forward (the
    gradients of later calls of the same pair: ``OutsideMemory.outside_backward``). ``fuses``: the
    graphs run as Inductor compiles them: the nodes it inlines into other kernels without a buffer,
    what they read alive until those kernels run, outputs written in place of an input read last
    there, and of ``temporaries`` only the extern matmuls' (``fusion``). ``code``: what Inductor's code
    for the pair showed (``CodeFacts``), counted where the graphs run as it compiles them: its calls'
    scratch in place of ``temporaries`` at the nodes that run them, its copies of saved inputs.
    ``fusions``: ``inductor_fusion`` of ``fw`` and ``bw``, where the caller has them already."""
    scratch = temporaries or {}
    code = code if fuses and code is not None else CodeFacts()
    if fuses:  # Inductor's code allocates the extern kernels' scratch; its own kernels take none
        scratch = {**extern_scratch(scratch), **code_scratch_nodes(code.calls, fw, bw)}
    live = dict.fromkeys(CATEGORIES, 0)
    live["outside"] = outside
    points: list[MemoryPoint] = []
    if not fuses:
        fusions = (None, None)
    elif fusions is None:
        fusions = (inductor_fusion(fw), inductor_fusion(bw))
    copied = (*code.copied_inputs, *layout_copies(fw, num_fwd_outputs)) if fuses else ()
    saved = _forward(fw, num_fwd_outputs, static_input_indices, scratch, live, points, fusions[0], copied)
    live["outside"] += outside_backward
    _backward(bw, saved, scratch, live, points, fusions[1])
    return MemoryTimeline(tuple(points))


@dataclasses.dataclass(frozen=True)
class CodeFacts:
    """What Inductor's code for a graph pair showed that its FX graphs do not, for the FX model of
    any plan of the same graph (``compiler.pair.PlannedPair.code_facts``): the scratch of its calls,
    measured on the code's layouts, as (phase, op, source nodes, bytes) (``code_scratch_nodes``), and
    the forward's placeholders that it saves for the backward as copies of its own, by name (a
    convolution's weight or input laid out channels-last: saved bytes the FX graph counts as the
    placeholder's, there anyway)."""

    calls: tuple[tuple[str, str, tuple[str, ...], int], ...] = ()
    copied_inputs: tuple[str, ...] = ()


def layout_copies(fw: fx.GraphModule, num_fwd_outputs: int) -> tuple[str, ...]:
    """The forward's placeholders saved for the backward that Inductor's code saves as copies of its
    own: those its layout optimization lays out channels-last (``_compat.inductor_channels_last_nodes``)
    that are not channels-last already (a convolution's weight, the image it reads; a 1x1 kernel's
    weight is both). What ``CodeFacts.copied_inputs`` reads from the code, for a partition not yet
    lowered: one that recomputes a weight's bf16 cast in the backward saves the weight, copied."""
    outputs = fw.graph.output_node().args[0][num_fwd_outputs:]
    saved = [o for o in outputs if isinstance(o, fx.Node) and o.op == "placeholder"]
    preferred = (inductor_channels_last_nodes(fw) if saved else None) or set()
    copies = []
    for o in (o for o in saved if o in preferred):
        value = o.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() not in (4, 5):
            continue
        layout = torch.channels_last if value.dim() == 4 else torch.channels_last_3d
        try:
            if not value.is_contiguous(memory_format=layout):
                copies.append(o.name)
        except Exception:  # a symbolic layout it cannot decide: no copy counted
            continue
    return tuple(copies)


def code_scratch_nodes(
    calls: Sequence[tuple[str, str, tuple[str, ...], int]], fw: fx.GraphModule, bw: fx.GraphModule
) -> dict[fx.Node, int]:
    """The scratch of the calls of Inductor's code for this pair, on the FX nodes that run them:
    ``calls`` is (phase, op, source nodes, bytes) (``CodeFacts.calls``), and a
    call's node is the one node named by its source nodes (as Inductor names them:
    ``_compat.kernel_source_name``) that runs its op. A call without one such node here (a node
    Inductor's passes made, another partition) is left out."""
    nodes: dict[tuple[str, str], list[fx.Node]] = {}
    for phase, graph in (("forward", fw), ("backward", bw)):
        for n in graph.graph.nodes:
            nodes.setdefault((phase, kernel_source_name(n)), []).append(n)
    out: dict[fx.Node, int] = {}
    for phase, op, sources, nbytes in calls:
        found = [n for s in sources for n in nodes.get((phase, s), ()) if op_name(n) == op]
        if len(found) == 1:
            out[found[0]] = max(out.get(found[0], 0), nbytes)
    return out


def _forward(
    fw: fx.GraphModule,
    num_fwd_outputs: int,
    static_input_indices: Sequence[int],
    scratch: Mapping[fx.Node, int],
    live: dict[str, int],
    points: list[MemoryPoint],
    fusion: Fusion | None,
    copied_inputs: Sequence[str] = (),
) -> tuple[dict[str, fx.Node], set[str]]:
    """Walk the forward, appending its points; returns the storage owner of each saved output that
    the forward made (by name), and the names of the saved outputs that outlive the step anyway.
    ``copied_inputs``: placeholders saved as a copy the code makes (``CodeFacts``), saved bytes
    from the forward's start (Inductor lays them out in its first kernels) until their backward reads."""
    nodes = list(fusion.order if fusion is not None and fusion.order else fw.graph.nodes)
    owners = storage_owners(nodes)
    last = last_reads(nodes, owners, fusion.runs_at if fusion is not None else None)
    static = static_inputs(fw, static_input_indices)
    outputs = list(fw.graph.output_node().args[0])
    saved_owners = {owners[o] for o in outputs[num_fwd_outputs:] if o in owners}
    user_owners = {owners[o] for o in outputs[:num_fwd_outputs] if o in owners}
    category: dict[fx.Node, str] = {}
    frees: dict[int, list[fx.Node]] = {}
    copies: set[fx.Node] = set()
    born = _born(nodes)
    inlined = fusion.inlined if fusion is not None else frozenset()
    for i, n in enumerate(nodes):
        if n.op == "output":
            break
        for m in born.get(i, ()):
            if owners.get(m) is not m or not _bytes(m) or m in inlined:
                continue
            if m.op == "placeholder":
                category[m] = "parameters" if m in static else "inputs"
                if m.name in copied_inputs and m in saved_owners:
                    copies.add(m)
                    live["saved"] += _bytes(m)
            else:
                category[m] = "saved" if m in saved_owners else "transient"
                if m not in saved_owners and m not in user_owners:
                    frees.setdefault(last.get(m, i), []).append(m)
            live[category[m]] += _bytes(m)
        reused = _in_place(n, frees.get(i, ()), fusion)
        if reused is not None:  # written in place: that storage is n's now
            frees[i].remove(reused)
            live["transient"] -= _bytes(reused)
        points.append(_running(live, n, scratch, "forward"))  # while n runs: inputs, output, scratch
        for dead in frees.pop(i, ()):
            live[category[dead]] -= _bytes(dead)
    # User outputs (the loss, typically) are consumed by autograd at the end of the forward.
    for owner in user_owners - saved_owners:
        if owner in category and category[owner] == "transient":
            live["transient"] -= _bytes(owner)
    saved_owner_of = {
        o.name: owners[o] for o in outputs[num_fwd_outputs:]
        if o in owners and (category.get(owners[o]) == "saved" or owners[o] in copies)
    }  # fmt: skip
    persistent = {o.name for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node)} - set(saved_owner_of)
    return saved_owner_of, persistent


def _backward(
    bw: fx.GraphModule,
    saved: tuple[dict[str, fx.Node], set[str]],
    scratch: Mapping[fx.Node, int],
    live: dict[str, int],
    points: list[MemoryPoint],
    fusion: Fusion | None,
) -> None:
    """Walk the backward, appending its points: saved tensors enter as placeholders named like the
    forward outputs (``saved``, from ``_forward``) and are freed after their last reader."""
    saved_owner_of, persistent = saved
    nodes = list(fusion.order if fusion is not None and fusion.order else bw.graph.nodes)
    bw_owners = storage_owners(nodes)
    last = last_reads(nodes, bw_owners, fusion.runs_at if fusion is not None else None)
    grads = {bw_owners[o] for o in bw.graph.output_node().args[0] if isinstance(o, fx.Node) and o in bw_owners}
    # A forward storage saved through several placeholders is freed after the last of them.
    saved_last: dict[fx.Node, int] = {}
    through: Counter[fx.Node] = Counter()  # how many placeholders hold each
    for i, n in enumerate(nodes):
        if n.op == "placeholder" and n.name in saved_owner_of:
            owner = saved_owner_of[n.name]
            saved_last[owner] = max(saved_last.get(owner, i), last.get(n, i))
            through[owner] += 1
    frees_saved: dict[int, list[fx.Node]] = {}
    # Inductor may write into a saved tensor it reads last, but never into a storage saved through
    # two placeholders (``_compat.donated``)
    donates = donates_saved_buffers()
    for owner, i in saved_last.items():
        frees_saved.setdefault(i, []).append(owner)
    category: dict[fx.Node, str] = {}
    frees: dict[int, list[fx.Node]] = {}
    born = _born(nodes)
    inlined = fusion.inlined if fusion is not None else frozenset()
    for i, n in enumerate(nodes):
        if n.op == "output":
            break
        for m in born.get(i, ()):
            if bw_owners.get(m) is not m or m.name in saved_owner_of or m.name in persistent or not _bytes(m):
                continue
            if m in inlined:
                continue
            if m.op == "placeholder":
                category[m] = "transient"  # tangents
            else:
                category[m] = "gradients" if m in grads else "transient"
            live[category[m]] += _bytes(m)
            if category[m] == "transient":
                frees.setdefault(last.get(m, i), []).append(m)
        # Written in place of a storage it reads last: one Inductor allocated, or a saved tensor.
        donated = [o for o in frees_saved.get(i, ()) if through[o] == 1] if donates else ()
        reused = _in_place(n, frees.get(i, ()), fusion, donated)
        if reused is not None:
            kind = "saved" if reused in frees_saved.get(i, ()) else "transient"
            (frees_saved if kind == "saved" else frees)[i].remove(reused)
            live[kind] -= _bytes(reused)
        points.append(_running(live, n, scratch, "backward"))  # while n runs
        for dead in frees.pop(i, ()):
            live[category[dead]] -= _bytes(dead)
        for owner in frees_saved.pop(i, ()):
            live["saved"] -= _bytes(owner)


@dataclasses.dataclass(frozen=True)
class CallOutside:
    """What code around one call of a pair holds at the pair's points (``OutsideMemory.calls``):
    ``fixed`` bytes at every point, ``backward`` more at the backward's, and ``repeats`` earlier
    calls of the same pair, each keeping what the pair keeps for its backward
    (``kept_saved_bytes``), which changes with the plan."""

    fixed: int
    repeats: int = 0
    backward: int = 0

    def at(self, phase: str, kept: int) -> int:
        return max(0, self.fixed + self.repeats * kept) + (self.backward if phase == "backward" else 0)


def outside_at(calls: Sequence[CallOutside], phase: str, kept: int) -> int:
    """"outside" at a point of ``phase`` for a pair keeping ``kept`` bytes per call: the most any of
    its ``calls`` holds there."""
    return max(c.at(phase, kept) for c in calls)


@dataclasses.dataclass(frozen=True)
class OffDevice:
    """``nbytes`` of saved tensor ``name`` off the device from point ``first`` to point ``last`` of a
    timeline (inclusive; forward points, then backward points: one per node before the output)."""

    name: str
    nbytes: int
    first: int
    last: int


def with_plan(
    baseline: MemoryTimeline, off: Iterable[OffDevice], calls: Sequence[CallOutside] = (), kept: int = 0
) -> MemoryTimeline:
    """The timeline ``baseline`` (the pair before any change) with the tensors of ``off`` off the
    device over their points, taken from its "saved" bytes. ``calls``: the calls of the pair it is
    planned for, where earlier calls of the same pair hold what it keeps (``CallOutside``);
    ``kept``: what the baseline pair keeps per call. Each tensor of ``off`` is off the device in
    those earlier calls too (between their forward and their backward at every point): "outside"
    is then that of a pair keeping ``kept`` less all of ``off``. Pure; linear in points + intervals."""
    points = baseline.points
    delta = [0] * (len(points) + 1)
    off_bytes = 0
    for o in off:
        lo, hi = max(o.first, 0), min(o.last, len(points) - 1)
        if lo <= hi:
            delta[lo] -= o.nbytes
            delta[hi + 1] += o.nbytes
        off_bytes += o.nbytes
    repeated = any(c.repeats for c in calls) and off_bytes
    outside = {}
    if repeated:
        outside = {phase: outside_at(calls, phase, kept - off_bytes) for phase in ("forward", "backward")}
    out, running = [], 0
    for p, d in zip(points, delta):
        running += d
        if running or repeated:
            live = dict(p.live)
            live["saved"] += running
            if repeated:
                live["outside"] = outside[p.phase]
            p = MemoryPoint(p.phase, p.node, live)
        out.append(p)
    return MemoryTimeline(tuple(out))


def param_grad_bytes(fw: fx.GraphModule, bw: fx.GraphModule, static_input_indices: Sequence[int]) -> int:
    """Device bytes of the gradients the backward returns for the pair's parameters (its static
    inputs): what ``AccumulateGrad`` holds after one call's backward. The backward returns one
    gradient (or None) per forward input, in their order."""
    static = static_inputs(fw, static_input_indices)
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    grads = list(bw.graph.output_node().args[0])
    return sum(_bytes(g) for p, g in zip(placeholders, grads) if p in static and isinstance(g, fx.Node))


def kept_saved_bytes(
    fw: fx.GraphModule, num_fwd_outputs: int, static_input_indices: Sequence[int] = ()
) -> int:
    """Device bytes one call of the pair keeps for its backward: the distinct storages of what the
    forward saves, less parameters (static inputs) and host copies. What ``read_outside_memory`` reads of
    an earlier call of the same graph."""
    static = static_inputs(fw, static_input_indices)
    outputs = list(fw.graph.output_node().args[0])[num_fwd_outputs:]
    roots = {storage_root(o) for o in outputs if isinstance(o, fx.Node)}
    return sum(_bytes(r) for r in roots if r not in static)
