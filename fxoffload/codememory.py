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

import ast
import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence

import torch

from .codecheck import _base, _split_args, call_body, is_kernel
from .memory import CATEGORIES, MemoryPoint, MemoryTimeline

log = logging.getLogger(__name__)

__all__ = ["simulate_output_code", "storage_bytes"]

_ASSIGN = re.compile(r"^(\w+) = (.+)$")
_UNPACK_ARGS = re.compile(r"^([\w\s,]+?),? = args$")
_EMPTY = re.compile(r"^empty_strided(?:_\w+)?\((.*)\)$")
_REINTERPRET = re.compile(r"^reinterpret_tensor\((\w+)\s*,")
_GETITEM = re.compile(r"^(\w+)\[(\d+)\]$")
_NAME = re.compile(r"^\w+$")
_CALL = re.compile(r"^([\w.]+)\((.*)\)$")
_ASSERT = re.compile(r"^assert_size_stride\((\w+),\s*(.*)\)$")
_DEL = re.compile(r"^del ([\w\s,]+)$")
_RETURN = re.compile(r"^return\s*\(?(.*?)\)?\s*$")
_SOURCE = re.compile(r"#\s*Topologically Sorted Source Nodes: \[([^\]]*)\]")
_RAND = re.compile(r"^\s*(\w+) = rand_strided\((.*)\)\s*$")
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


def storage_bytes(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of the storage an ``empty_strided(size, stride, dtype)`` allocates: its span, 0 if empty."""
    if len(size) != len(stride):
        raise ValueError(f"size {tuple(size)} and stride {tuple(stride)} must have the same length")
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * dtype.itemsize


def _ints(expr: str, symbols: Mapping[str, int], where: str) -> tuple[int, ...]:
    """A tuple of integer expressions (``(s0, 64)``, ``(64*s0, 1)``) evaluated with ``symbols``."""
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"{where}: cannot read {expr!r} as a size or stride tuple ({e.msg})") from None
    elts = tree.elts if isinstance(tree, (ast.Tuple, ast.List)) else [tree]
    return tuple(_eval(e, symbols, where) for e in elts)


_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}


def _eval(node: ast.expr, symbols: Mapping[str, int], where: str) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in symbols:
            raise ValueError(
                f"{where}: the size {node.id!r} is symbolic; pass its value in symbols= "
                f"(known: {sorted(symbols) or 'none'})"
            )
        return int(symbols[node.id])
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left, symbols, where), _eval(node.right, symbols, where))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, symbols, where)
    raise ValueError(f"{where}: cannot evaluate {ast.unparse(node)!r} in a size or stride")


def _dtype(text: str, where: str) -> torch.dtype:
    name = text.strip().removeprefix("dtype=").strip().removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {text.strip()!r} is not a torch dtype")
    return dtype


def _statements(code: str) -> list[tuple[int, str, str]]:
    """``(line number in call, statement, source nodes of the kernel it launches)`` of ``call``."""
    out, source = [], ""
    for i, line in enumerate(call_body(code)):
        text = line.strip()
        if text.startswith("#"):
            if m := _SOURCE.match(text):
                source = m.group(1)
            continue
        code_part = re.sub(r"\s+#[^'\"]*$", "", text)  # a trailing comment (no quote: not inside a string)
        for stmt in (s.strip() for s in code_part.split(";")):
            if stmt:
                out.append((i, stmt, source))
                if is_kernel(stmt):
                    source = ""  # the comment names the nodes of this kernel only
    return out


def _module_args(code: str, symbols: Mapping[str, int]) -> dict[str, tuple[int, torch.dtype]]:
    """Bytes and dtype of every argument in the module's ``get_args`` (``rand_strided`` lines)."""
    out = {}
    for line in code.splitlines():
        if m := _RAND.match(line):
            args = _split_args(m.group(2))
            where = f"get_args: {m.group(1)}"
            dtype = next((_dtype(a, where) for a in args if a.startswith("dtype=")), torch.float32)
            size, stride = _ints(args[0], symbols, where), _ints(args[1], symbols, where)
            out[m.group(1)] = (storage_bytes(size, stride, dtype), dtype)
    return out


def _asserts(stmts: Sequence[tuple[int, str, str]], symbols: Mapping[str, int]) -> dict[str, tuple]:
    """Size and stride asserted for each name, and for a name whose only assert is on a plain alias of it
    (``buf1 = buf0`` then ``assert_size_stride(buf1, ...)``, how Inductor checks a custom op's result)."""
    out: dict[str, tuple] = {}
    alias_of: dict[str, str] = {}
    for _, stmt, _ in stmts:
        if (m := _ASSERT.match(stmt)) and m.group(1) not in out:
            args = _split_args(m.group(2))
            out[m.group(1)] = (_ints(args[0], symbols, stmt), _ints(args[1], symbols, stmt))
        elif (m := _ASSIGN.match(stmt)) and _NAME.match(m.group(2)):
            alias_of[m.group(1)] = m.group(2)
    for name, base in alias_of.items():
        if name in out:
            while base not in out and base in alias_of:
                out[base] = out[name]
                base = alias_of[base]
            out.setdefault(base, out[name])
    return out


def _returned(stmts: Sequence[tuple[int, str, str]]) -> list[str | None]:
    """Base names of the last ``return``, one per value (None for a constant or ``None``)."""
    for _, stmt, _ in reversed(stmts):
        if stmt.startswith("return"):
            m = _RETURN.match(stmt)
            values = [a for a in _split_args(m.group(1)) if a] if m else []
            return [None if a == "None" or not re.match(r"[A-Za-z_]", a) else _base(a) for a in values]
    return []


def _arg_names(stmts: Sequence[tuple[int, str, str]]) -> list[str]:
    for _, stmt, _ in stmts:
        if m := _UNPACK_ARGS.match(stmt):
            return [a.strip() for a in m.group(1).split(",") if a.strip()]
    return []


def _run(
    phase: str,
    stmts: Sequence[tuple[int, str, str]],
    state: _State,
    symbols: Mapping[str, int],
    temporaries: Mapping[str, int],
) -> list[list[int]]:
    """Replay one ``call``; its argument names must be bound already. Returns the storages it returns,
    each held once more for the caller."""
    asserts = _asserts(stmts, symbols)
    getitems: dict[str, list[tuple[int, str]]] = {}  # tuple name -> (index, element name)
    for _, stmt, _ in stmts:
        if (m := _ASSIGN.match(stmt)) and (g := _GETITEM.match(m.group(2))):
            getitems.setdefault(g.group(1), []).append((int(g.group(2)), m.group(1)))
    result: list[list[int]] = []
    for line, stmt, source in stmts:
        label = f"{phase} line {line}: {stmt[:100]}"
        scratch = 0
        if stmt.startswith("return"):
            result = [list(state.names.get(n, [])) if n else [] for n in _returned([(line, stmt, source)])]
            for ids in result:
                state.hold(ids)  # the caller's, once the frame's names are gone
        elif m := _DEL.match(stmt):
            for name in (n.strip() for n in m.group(1).split(",")):
                state.unbind(name)
        elif (m := _ASSIGN.match(stmt)) and not _UNPACK_ARGS.match(stmt):
            target, value = m.groups()
            if e := _EMPTY.match(value):
                args = _split_args(e.group(1))
                size, stride = _ints(args[0], symbols, stmt), _ints(args[1], symbols, stmt)
                dtype = _dtype(args[2] if len(args) > 2 else "float32", stmt)
                state.dtypes[target] = dtype
                state.bind(target, [state.new(storage_bytes(size, stride, dtype), phase)])
            elif _NAME.match(value) or _REINTERPRET.match(value):
                base = _base(value)
                state.dtypes.setdefault(target, state.dtypes.get(base, torch.float32))
                state.bind(target, state.names.get(base, []))
            elif g := _GETITEM.match(value):
                ids = state.names.get(g.group(1), [])
                index = int(g.group(2))
                state.dtypes.setdefault(target, state.dtypes.get(g.group(1), torch.float32))
                state.bind(target, ids[index : index + 1] if len(ids) > 1 else ids[:1])
            elif c := _CALL.match(value):
                op, args = c.group(1), _split_args(c.group(2))
                positional = [a for a in args if a and "=" not in a.split("(")[0]]  # not out=, stride=
                tensors = [_base(a) for a in positional if _base(a) in state.names]
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
        return [state.new(storage_bytes(*asserts[target], dtype), phase)]
    elements = sorted(getitems.get(target, ()))
    if not elements:
        log.debug("fxoffload: no size for the result of %r: counted as 0 bytes", stmt)
        return []
    ids = []
    for index, name in elements:
        while len(ids) < index:  # outputs no line reads: unknown size (often None)
            ids.append(state.new(0, phase))
        nbytes = storage_bytes(*asserts[name], dtype) if name in asserts else 0
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
    fw, bw = _statements(fw_code), _statements(bw_code)
    if not fw or not bw:
        which = " and ".join(n for n, s in (("fw_code", fw), ("bw_code", bw)) if not s)
        raise ValueError(
            f"{which}: no 'def call(...)' with statements found; pass Inductor's Python wrapper code"
        )
    state = _State()
    static = set(static_input_indices)

    # ---- forward: arguments are the caller's for the whole step
    fw_args, fw_sizes = _arg_names(fw), _module_args(fw_code, symbols)
    for i, name in enumerate(fw_args):
        nbytes, dtype = fw_sizes.get(name, (0, torch.float32))
        sid = state.new(nbytes, "caller")
        state.storages[sid].category = "parameters" if i in static else "inputs"
        state.storages[sid].refs += 1  # the caller's reference, never dropped
        state.dtypes[name] = dtype
        state.bind(name, [sid])
    returned = _run("forward", fw, state, symbols, temporaries)

    # ---- between: user outputs are held to the end of the step, saved tensors until the backward
    bw_args, bw_sizes = _arg_names(bw), _module_args(bw_code, symbols)
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

    # ---- backward: saved tensors first, then tangents (allocated before the call)
    for j, name in enumerate(bw_args):
        if j < len(saved):
            ids = saved[j]
        else:
            nbytes, _ = bw_sizes.get(name, (0, torch.float32))
            ids = [state.new(nbytes, "backward")]
        state.dtypes[name] = bw_sizes.get(name, (0, torch.float32))[1]
        state.bind(name, ids)
    for ids in saved:
        state.drop(ids)  # the backward frees them at its ``del``
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
