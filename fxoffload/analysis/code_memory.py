"""Device memory of one training step, replayed from the wrapper code Inductor generated.

``memory.simulate`` walks the FX graphs handed to the inner compiler. Inductor runs something else:
it fuses pointwise chains (their intermediates get no buffer), hands a dead buffer to a later one,
frees at ``del`` and allocates every output of a fused kernel before it runs. This module replays the
Python wrapper (``OffloadReport.output_code``), forward then backward, with Python's own rule: a
storage is freed when the last name holding it goes::

    buf3 = empty_strided_cpu((8, 64), (64, 1), torch.float32)    # allocates 2048 bytes
    cpp_fused_gelu_0(buf1, buf3)                                  # a point: buf1 and buf3 live
    buf4 = buf3; del buf3  # reuse                                # same storage, another name
    buf7 = reinterpret_tensor(buf4, (64, 8), (1, 64), 0)          # a view: nothing allocated
    buf5 = torch.ops.aten.convolution_backward.default(...)      # a fallback allocates its result;
    buf6 = buf5[0]                                                # its size comes from the
    assert_size_stride(buf6, (8, 16, 32, 32), ...)                # assert_size_stride that follows
    del buf4                                                      # frees unless buf7 still holds it
    return (buf6, buf7, )

Who holds what between and around the two functions:

- forward arguments (parameters, the user's inputs) are held by the caller the whole step; their
  bytes come from the module's ``get_args`` and count as "parameters" (``static_input_indices``) or
  "inputs". A ``del primals_3`` frees nothing.
- the forward returns its user outputs (live to the end of the step) and then the saved tensors;
  the backward receives those as its first arguments, in the same order, then the tangents. A saved
  storage is freed where the backward drops its last name for it ("saved"); a saved forward
  argument is still the caller's.
- tangents are allocated before the backward runs; what the backward returns is the gradients (live
  to the end of the step, ``AccumulateGrad`` keeps them).
- ``torch.ops.fxoffload.offload`` returns a host buffer (no device bytes); ``reload`` allocates its
  device destination; ``wait`` and ``order`` return their first argument.

A point is recorded after every statement of ``call``, so a kernel's inputs and outputs are counted
together (the frees come on later lines). A fallback op's result is allocated while its arguments
are alive, plus its scratch (``temporaries``). Sizes are storage spans (``empty_strided`` size,
stride, dtype). A fallback's dtype is not in the text: the dtype of its first tensor argument is
taken. What the text cannot show: outputs of a multi-output fallback that no line reads (allocated
and dropped by the op, never counted) and memory of generated kernels (none on CPU).

Pure text in, a ``memory.MemoryTimeline`` out (``MemoryPoint.node`` names the line); nothing here
imports Inductor.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Mapping, Sequence

import torch

from ..sizes import span_bytes
from .memory import CATEGORIES, MemoryPoint, MemoryTimeline
from .output_code import (
    Statement, arg_names, asserted_layouts, base_name, call_body, eval_ints, module_args, parse_dtype,
    returned_names, split_args, statements,
)

log = logging.getLogger(__name__)

__all__ = ["host_in_flight", "replay_pair", "simulate_output_code"]

_ASSIGN = re.compile(r"^(\w+) = (.+)$")
_EMPTY = re.compile(r"^empty_strided(?:_\w+)?\((.*)\)$")
_REINTERPRET = re.compile(r"^reinterpret_tensor\((\w+)\s*,")
_GETITEM = re.compile(r"^(\w+)\[(\d+)\]$")
_NAME = re.compile(r"^\w+$")
_CALL = re.compile(r"^([\w.]+)\((.*)\)$")
_DEL = re.compile(r"^del ([\w\s,]+)$")
_FXOFFLOAD = re.compile(r"^torch\.ops\.fxoffload\.(offload|reload|wait|order)\.default$")


@dataclasses.dataclass
class _Storage:
    nbytes: int
    phase: str  # where it was allocated: "forward", "backward", "caller"
    refs: int = 0
    category: str = "transient"


@dataclasses.dataclass
class _State:
    """The replay's bookkeeping: names of the running function and the storages they hold."""

    storages: list[_Storage] = dataclasses.field(default_factory=list)
    # name -> the storages it holds (several for the tuple a multi-output op returns)
    names: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    live: set[int] = dataclasses.field(default_factory=set)
    events: list[tuple[str, str, frozenset[int], int]] = dataclasses.field(default_factory=list)

    def new(self, nbytes: int, phase: str) -> int:
        self.storages.append(_Storage(nbytes, phase))
        self.live.add(len(self.storages) - 1)
        return len(self.storages) - 1

    def hold(self, ids: Sequence[int]) -> None:
        for i in ids:
            self.storages[i].refs += 1

    def drop(self, ids: Sequence[int]) -> None:
        for i in ids:
            self.storages[i].refs -= 1
            if self.storages[i].refs <= 0:
                self.live.discard(i)

    def bind(self, name: str, ids: Sequence[int]) -> None:
        """``name = ...``: the new value is held before the old one is dropped (both live in the call)."""
        self.hold(ids)
        old = self.names.pop(name, [])
        self.names[name] = list(ids)
        self.drop(old)

    def unbind(self, name: str) -> None:
        self.drop(self.names.pop(name, []))

    def point(self, phase: str, label: str, scratch: int = 0) -> None:
        self.events.append((phase, label, frozenset(self.live), scratch))


def _run(
    phase: str,
    stmts: Sequence[Statement],
    state: _State,
    symbols: Mapping[str, int],
    temporaries: Mapping[str, int],
) -> list[list[int]]:
    """Replay one ``call``; its argument names must be bound already. Returns the storages it returns,
    each held once more for the caller."""
    asserts = asserted_layouts(stmts, symbols)
    getitems: dict[str, list[tuple[int, str]]] = {}  # tuple name -> (index, element name)
    for _, stmt, _ in stmts:
        if (m := _ASSIGN.match(stmt)) and (g := _GETITEM.match(m.group(2))):
            getitems.setdefault(g.group(1), []).append((int(g.group(2)), m.group(1)))
    result: list[list[int]] = []
    for line, stmt, source in stmts:
        label = f"{phase} line {line}: {stmt[:100]}"
        scratch = 0
        if stmt.startswith("return"):
            result = [list(state.names.get(n, [])) if n else [] for n in returned_names([Statement(line, stmt, source)])]
            for ids in result:
                state.hold(ids)  # the caller's, once the frame's names are gone
        elif m := _DEL.match(stmt):
            for name in (n.strip() for n in m.group(1).split(",")):
                state.unbind(name)
        elif (m := _ASSIGN.match(stmt)) and not stmt.endswith("= args"):
            target, value = m.groups()
            if e := _EMPTY.match(value):
                args = split_args(e.group(1))
                size, stride = eval_ints(args[0], symbols, stmt), eval_ints(args[1], symbols, stmt)
                dtype = parse_dtype(args[2] if len(args) > 2 else "float32", stmt)
                state.dtypes[target] = dtype
                state.bind(target, [state.new(span_bytes(size, stride, dtype), phase)])
            elif _NAME.match(value) or _REINTERPRET.match(value):
                base = base_name(value)
                state.dtypes.setdefault(target, state.dtypes.get(base, torch.float32))
                state.bind(target, state.names.get(base, []))
            elif g := _GETITEM.match(value):
                ids = state.names.get(g.group(1), [])
                index = int(g.group(2))
                state.dtypes.setdefault(target, state.dtypes.get(g.group(1), torch.float32))
                state.bind(target, ids[index : index + 1] if len(ids) > 1 else ids[:1])
            elif c := _CALL.match(value):
                op, args = c.group(1), split_args(c.group(2))
                positional = [a for a in args if a and "=" not in a.split("(")[0]]  # not out=, stride=
                tensors = [base_name(a) for a in positional if base_name(a) in state.names]
                dtype = next((state.dtypes[t] for t in tensors if t in state.dtypes), torch.float32)
                kind = _FXOFFLOAD.match(op)
                if kind and kind.group(1) in ("wait", "order"):
                    state.dtypes[target] = dtype
                    state.bind(target, state.names.get(tensors[0], []) if tensors else [])
                elif kind and kind.group(1) == "offload":
                    state.dtypes[target] = dtype
                    state.bind(target, [])  # a host buffer: no device bytes
                else:
                    ids = _allocate(target, stmt, phase, dtype, asserts, getitems, state)
                    state.dtypes[target] = dtype
                    state.bind(target, ids)
                    names = [n.strip() for n in source.split(",") if n.strip()]
                    scratch = max((temporaries.get(n, 0) for n in names), default=0)
        state.point(phase, label, scratch)
    for name in list(state.names):  # the frame ends: every local name goes
        state.unbind(name)
    return result


def _allocate(
    target: str,
    stmt: str,
    phase: str,
    dtype: torch.dtype,
    asserts: Mapping[str, tuple],
    getitems: Mapping[str, list[tuple[int, str]]],
    state: _State,
) -> list[int]:
    """Storages a fallback or extern kernel returns, sized by the ``assert_size_stride`` of its result or
    of the elements read from it."""
    if target in asserts:
        return [state.new(span_bytes(*asserts[target], dtype), phase)]
    elements = sorted(getitems.get(target, ()))
    if not elements:
        log.debug("fxoffload: no size for the result of %r: counted as 0 bytes", stmt)
        return []
    ids = []
    for index, name in elements:
        while len(ids) < index:  # outputs no line reads: unknown size (often None)
            ids.append(state.new(0, phase))
        nbytes = span_bytes(*asserts[name], dtype) if name in asserts else 0
        if name not in asserts:
            log.debug("fxoffload: no size for %s (element %d of %r): counted as 0 bytes", name, index, stmt)
        ids.append(state.new(nbytes, phase))
    return ids


def simulate_output_code(
    fw_code: str,
    bw_code: str,
    num_fwd_outputs: int | None = None,
    static_input_indices: Sequence[int] = (),
    temporaries: Mapping[str, int] | None = None,
    symbols: Mapping[str, int] | None = None,
    outside: int = 0,
    outside_backward: int = 0,
) -> MemoryTimeline:
    """The device-memory timeline of one training step through Inductor's forward then backward wrapper.

    ``fw_code``, ``bw_code``: the modules Inductor generated (``report.output_code["forward"]`` and
    ``["backward"]``). ``num_fwd_outputs``: the forward's user outputs before its saved tensors; by
    default, what the backward does not receive (its arguments other than ``tangents_*``).
    ``temporaries``: scratch bytes by FX node name, counted at the fallback or extern kernel whose
    "Topologically Sorted Source Nodes" comment names the node (the largest of them). In the backward
    the comment names the nodes of the graph Inductor compiled; in the forward it may name the user's
    source instead (``[input_1]`` for the node ``convolution``), so nothing matches there. Figures from
    ``op_temporaries`` (``{n.name: b for n, b in ...items()}``) are measured on the FX graph's layouts and
    may not be what Inductor's layouts need: on a CPU, a CNN's ``convolution_backward`` measured 1 MiB
    alone, while in the channels-last wrapper the whole step stayed within 19 KB of this model without
    them. ``symbols``: values of symbolic sizes (``{"s0": 8}``). ``outside``: bytes code before the
    pair holds through it, "outside" at every point (``memory.simulate``), and ``outside_backward``
    more at the backward's points.

    Points are ``MemoryPoint(phase, "<phase> line <n>: <statement>", live)`` with ``live`` in the
    categories of ``memory.CATEGORIES``; the peak less "parameters" and "inputs" is what the step
    allocates above its start.
    """
    symbols = dict(symbols or {})
    temporaries = dict(temporaries or {})
    fw, bw = (statements(code) if call_body(code) else [] for code in (fw_code, bw_code))
    if not fw or not bw:
        which = " and ".join(n for n, s in (("fw_code", fw), ("bw_code", bw)) if not s)
        raise ValueError(
            f"{which}: no 'def call(...)' with statements found; pass Inductor's Python wrapper code"
        )
    state = _State()
    _bind_forward_args(state, arg_names(fw), module_args(fw_code, symbols), set(static_input_indices))
    returned = _run("forward", fw, state, symbols, temporaries)
    bw_args, bw_sizes = arg_names(bw), module_args(bw_code, symbols)
    saved = _saved_between(state, returned, bw_args, num_fwd_outputs)
    _bind_backward_args(state, bw_args, bw_sizes, saved)
    grads = _run("backward", bw, state, symbols, temporaries)
    for ids in grads:  # held by AccumulateGrad
        for i in ids:
            if state.storages[i].phase == "backward":
                state.storages[i].category = "gradients"
    points = []
    for phase, label, live, scratch in state.events:
        by = dict.fromkeys(CATEGORIES, 0)
        # What code before the pair holds through it, and later code in its backward (``memory.simulate``).
        by["outside"] = outside + (outside_backward if phase == "backward" else 0)
        for i in live:
            by[state.storages[i].category] += state.storages[i].nbytes
        by["transient"] += scratch
        points.append(MemoryPoint(phase, label, by))
    return MemoryTimeline(tuple(points))


def _bind_forward_args(
    state: _State, names: Sequence[str], sizes: Mapping[str, tuple[int, torch.dtype]], static: set[int]
) -> None:
    """The forward's arguments: the caller's for the whole step (parameters, or inputs)."""
    for i, name in enumerate(names):
        nbytes, dtype = sizes.get(name, (0, torch.float32))
        sid = state.new(nbytes, "caller")
        state.storages[sid].category = "parameters" if i in static else "inputs"
        state.storages[sid].refs += 1  # the caller's reference, never dropped
        state.dtypes[name] = dtype
        state.bind(name, [sid])


def _saved_between(
    state: _State, returned: list[list[int]], bw_args: Sequence[str], num_fwd_outputs: int | None
) -> list[list[int]]:
    """Between the two: user outputs are held to the end of the step, saved tensors until the
    backward drops them. Returns the saved tensors' storages, in the backward's argument order."""
    n_saved = sum(1 for a in bw_args if not a.startswith("tangents_"))
    if num_fwd_outputs is None:
        num_fwd_outputs = len(returned) - n_saved
    if len(returned) - num_fwd_outputs != n_saved:
        raise ValueError(
            f"num_fwd_outputs={num_fwd_outputs} does not fit: the forward returns {len(returned)} values "
            f"and the backward takes {n_saved} saved ones (arguments other than tangents_*); "
            f"pass the forward's user outputs, {len(returned) - n_saved} here"
        )
    saved = returned[num_fwd_outputs:]  # held by autograd; the user's outputs by the user to the end
    for i in {i for ids in saved for i in ids}:
        if state.storages[i].phase == "forward":
            state.storages[i].category = "saved"
    return saved


def _bind_backward_args(
    state: _State, names: Sequence[str], sizes: Mapping[str, tuple[int, torch.dtype]], saved: list[list[int]]
) -> None:
    """The backward's arguments: the saved tensors first, then the tangents (allocated before the
    call); the saved ones are freed where the backward drops its last name for them."""
    for j, name in enumerate(names):
        if j < len(saved):
            ids = saved[j]
        else:
            nbytes, _ = sizes.get(name, (0, torch.float32))
            ids = [state.new(nbytes, "backward")]
        state.dtypes[name] = sizes.get(name, (0, torch.float32))[1]
        state.bind(name, ids)
    for ids in saved:
        state.drop(ids)  # the backward frees them at its ``del``


@functools.lru_cache(maxsize=32)
def _replay_cached(
    forward: str, backward: str, num_fwd_outputs: int | None, outside: int, outside_backward: int
) -> MemoryTimeline:
    return simulate_output_code(
        forward, backward, num_fwd_outputs, outside=outside, outside_backward=outside_backward
    )


def replay_pair(
    output_code: Mapping[str, str], num_fwd_outputs: int | None, outside: int = 0, outside_backward: int = 0
) -> MemoryTimeline | None:
    """``simulate_output_code`` of a pair's wrapper codes (``{"forward": ..., "backward": ...}``), once
    per distinct codes and arguments. None until both graphs are compiled, and for code this reader
    does not know (a new Inductor): no figure then, never a failure."""
    forward, backward = output_code.get("forward"), output_code.get("backward")
    if not forward or not backward:
        return None
    try:
        return _replay_cached(forward, backward, num_fwd_outputs, outside, outside_backward)
    except ValueError as e:
        log.debug("fxoffload: cannot replay the generated code: %s", e)
        return None


_OFFLOAD_CALL = "torch.ops.fxoffload.offload.default("


def host_in_flight(timeline: MemoryTimeline, copies: Sequence[tuple[str, int, int]]) -> list[int] | None:
    """Host copies in flight at every point of a replay (its points are labelled with their
    statements). ``copies``: ``(host placeholder name, forward position, bytes)`` of the plan's
    offloads. They are taken, in forward order, at the forward's ``fxoffload.offload`` statements, in
    their order (Inductor may reorder offloads of different sizes: then the forward figures between
    them are off, the backward's are not), and released after the last backward statement naming the
    placeholder that holds them (its ``del``). None when the code has another number of offloads than
    the plan, or never names a copy's placeholder."""
    points = timeline.points
    starts = [i for i, p in enumerate(points) if p.phase == "forward" and _OFFLOAD_CALL in p.node]
    if len(starts) != len(copies):
        return None
    delta = [0] * (len(points) + 1)
    for start, (host_name, _, nbytes) in zip(starts, sorted(copies, key=lambda c: c[1])):
        word = re.compile(rf"\b{re.escape(host_name)}\b")
        named = [
            i for i, p in enumerate(points) if p.phase == "backward" and word.search(p.node.split(": ", 1)[-1])
        ]
        if not named:
            return None
        delta[start] += nbytes
        delta[named[-1] + 1] -= nbytes
    out, running = [], 0
    for d in delta[:-1]:
        running += d
        out.append(running)
    return out
