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
  device destination; ``wait`` and ``order`` return their first argument, and so does
  ``copy_if_misaligned`` (torch 2.13, on inputs: it copies only data that is not 16-byte aligned).

A point is recorded after every statement of ``call``, so a kernel's inputs and outputs are counted
together (the frees come on later lines). A fallback op's result is allocated while its arguments
are alive, plus its scratch (``scratch``, by line, also at an extern kernel writing into an ``out=``
buffer: what the call holds inside and frees before it returns, measured running it alone on the
code's layouts, ``extern_calls``). Sizes are storage spans (``empty_strided`` size,
stride, dtype). A fallback's dtype is not in the text, so it is taken, in this order, from the
backward's ``get_args`` when the result is a saved tensor (``rand_strided(..., dtype=...)``), from
``_OUTPUT_DTYPES`` for the few ops whose outputs differ in dtype from their inputs (the bool mask of
``native_dropout``, the float32 logsumexp and int64 seeds of the attention kernels), else from its
first tensor argument. What the text cannot show: outputs of a multi-output fallback that no line
reads (allocated and dropped by the op, never counted) and memory of generated kernels (none on CPU).

CUDA code (``empty_strided_cuda``, ``device='cuda...'``) is counted as the caching allocator counts it
(``torch.cuda.memory_allocated``): every storage is a block rounded up to a multiple of 512 bytes
(``sizes.cuda_block_bytes``), and the philox seed and offset of efficient and flash attention are
host scalars at run time although the code's asserts say cuda (measured on an H100,
``../shared/gpu/sdpa_seed_devices.txt``): no device bytes (``_HOST_OUTPUTS``). Left out, because they
are not the step's own bytes or cannot be read from the code: the cuBLAS workspace
(``CUBLAS_WORKSPACE_BYTES`` per handle and stream, allocated at the first matmul of a thread and kept:
live before a steady step starts, one for the forward's thread and one for autograd's), cuDNN and
cuBLASLt scratch inside a kernel, and a cached block handed out whole (a large block is split only
when more than 1 MiB would be left; it depends on the allocator's history, not on this step's code).
On an H100 this replay matched the GPT of ``tests/test_cuda.py`` to 512 bytes, and the 12-layer
stack's absolute peaks within 0.5% with the 65 MiB of workspaces added (docs/results.md).

Pure text in, a ``memory.MemoryTimeline`` out (``MemoryPoint.node`` names the line); nothing here
imports Inductor.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ..sizes import cuda_block_bytes, span_bytes
from .memory import CATEGORIES, MemoryPoint, MemoryTimeline
from .output_code import (
    ASSIGN, NAME, Statement, arg_names, asserted_layouts, base_name, call_body, eval_ints, module_args,
    parse_dtype, returned_names, returned_values, split_args, statements,
)

log = logging.getLogger(__name__)

__all__ = [
    "CUBLAS_WORKSPACE_BYTES", "ExternCall", "extern_calls", "returned_strides", "simulate_forward_code",
    "simulate_output_code",
]

# cuBLAS's workspace on sm90 and later (CublasHandlePool.cpp: 4096 * 8 * 1024 when major >= 9), one
# per (handle, stream): the calling thread and autograd's each have a handle. Live before a steady step
# starts, so not in a replay; a peak compared with a device's capacity adds it.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20

# Outputs (index -> dtype) of multi-output ops whose dtype is not their first tensor argument's.
_OUTPUT_DTYPES: dict[str, dict[int, torch.dtype]] = {
    "aten.native_dropout.default": {1: torch.bool},
    "aten._scaled_dot_product_efficient_attention.default": {1: torch.float32, 2: torch.int64, 3: torch.int64},
    "aten._scaled_dot_product_flash_attention.default": {1: torch.float32, 6: torch.int64, 7: torch.int64},
    "aten._scaled_dot_product_cudnn_attention.default": {1: torch.float32, 6: torch.int64, 7: torch.int64},
}
# Outputs that live on the host at run time while the code's fake tensors say cuda (pytorch#121528):
# the philox seed and offset, CPU scalars outside CUDA-graph capture. cuDNN's are on the device.
_HOST_OUTPUTS: dict[str, frozenset[int]] = {
    "aten._scaled_dot_product_efficient_attention.default": frozenset({2, 3}),
    "aten._scaled_dot_product_flash_attention.default": frozenset({6, 7}),
}

_EMPTY = re.compile(r"^empty_strided(?:_\w+)?\((.*)\)$")
_REINTERPRET = re.compile(r"^reinterpret_tensor\((\w+)\s*,")
_GETITEM = re.compile(r"^(\w+)\[(\d+)\]$")
_CALL = re.compile(r"^([\w.]+)\((.*)\)$")
_DEL = re.compile(r"^del ([\w\s,]+)$")
_FXOFFLOAD = re.compile(r"^torch\.ops\.fxoffload\.(offload|reload|wait|order)\.default$")
_WORD = re.compile(r"\b[A-Za-z_]\w*\b")

Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # size, stride, dtype


class ExternCall(NamedTuple):
    """A fallback or extern kernel call of a wrapper, with what running it alone takes: its line in
    ``call`` (``Statement.line``), the op as the code names it (``extern_kernels.mm``,
    ``torch.ops.aten.convolution_backward.default``), its argument text, and the layout of every
    buffer that text names (``reinterpret_tensor`` views in the text are laid over them)."""

    line: int
    op: str
    args: str
    operands: Mapping[str, Layout]


@dataclasses.dataclass
class _Storage:
    nbytes: int
    phase: str  # where it was allocated: "forward", "backward", "caller"
    refs: int = 0
    category: str = "transient"


@dataclasses.dataclass
class _State:
    """The replay's bookkeeping: names of the running function and the storages they hold."""

    cuda: bool = False  # CUDA code: storages counted as the caching allocator's blocks
    # Dtypes of fallback results read elsewhere in the code (the backward's get_args for saved tensors).
    known_dtypes: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    storages: list[_Storage] = dataclasses.field(default_factory=list)
    # name -> the storages it holds (several for the tuple a multi-output op returns)
    names: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    # name -> size and stride, where the code gives them: the operands of ``calls``
    layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    calls: list[ExternCall] = dataclasses.field(default_factory=list)
    live: set[int] = dataclasses.field(default_factory=set)
    events: list[tuple[str, str, frozenset[int], int]] = dataclasses.field(default_factory=list)

    def new(self, nbytes: int, phase: str) -> int:
        self.storages.append(_Storage(cuda_block_bytes(nbytes) if self.cuda else nbytes, phase))
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
    scratch: Mapping[tuple[str, int], int],
) -> list[list[int]]:
    """Replay one ``call``; its argument names must be bound already. Returns the storages it returns,
    each held once more for the caller. ``scratch``: bytes by ``(phase, line)`` of a call, added there."""
    asserts = asserted_layouts(stmts, symbols)
    getitems: dict[str, list[tuple[int, str]]] = {}  # tuple name -> (index, element name)
    for _, stmt, _ in stmts:
        if (m := ASSIGN.match(stmt)) and (g := _GETITEM.match(m.group(2))):
            getitems.setdefault(g.group(1), []).append((int(g.group(2)), m.group(1)))
    result: list[list[int]] = []
    for line, stmt, source in stmts:
        label = f"{phase} line {line}: {stmt[:100]}"
        if stmt.startswith("return"):
            result = [list(state.names.get(n, [])) if n else [] for n in returned_names([Statement(line, stmt, source)])]
            for ids in result:
                state.hold(ids)  # the caller's, once the frame's names are gone
        elif m := _DEL.match(stmt):
            for name in (n.strip() for n in m.group(1).split(",")):
                state.unbind(name)
        elif (m := ASSIGN.match(stmt)) and not stmt.endswith("= args"):
            target, value = m.groups()
            if e := _EMPTY.match(value):
                args = split_args(e.group(1))
                size, stride = eval_ints(args[0], symbols, stmt), eval_ints(args[1], symbols, stmt)
                dtype = parse_dtype(args[2] if len(args) > 2 else "float32", stmt)
                state.dtypes[target] = dtype
                state.layouts[target] = (size, stride)
                state.bind(target, [state.new(span_bytes(size, stride, dtype), phase)])
            elif NAME.match(value) or _REINTERPRET.match(value):
                base = base_name(value)
                state.dtypes.setdefault(target, state.dtypes.get(base, torch.float32))
                if not NAME.match(value):  # reinterpret_tensor(base, size, stride, offset)
                    args = split_args(value[len("reinterpret_tensor(") : -1])
                    state.layouts[target] = (eval_ints(args[1], symbols, stmt), eval_ints(args[2], symbols, stmt))
                elif base in state.layouts:
                    state.layouts[target] = state.layouts[base]
                state.bind(target, state.names.get(base, []))
            elif g := _GETITEM.match(value):
                ids = state.names.get(g.group(1), [])
                index = int(g.group(2))
                state.dtypes.setdefault(target, state.dtypes.get(g.group(1), torch.float32))
                state.bind(target, ids[index : index + 1] if len(ids) > 1 else ids[:1])
            elif c := _CALL.match(value):
                _call(phase, line, target, stmt, c.group(1), c.group(2), state, asserts, getitems)
            if target in asserts:
                state.layouts[target] = asserts[target]
        elif (c := _CALL.match(stmt)) and c.group(1).startswith("extern_kernels."):  # into an ``out=`` buffer
            _record_call(state, line, c.group(1), c.group(2))
        state.point(phase, label, scratch.get((phase, line), 0))
    for name in list(state.names):  # the frame ends: every local name goes
        state.unbind(name)
    return result


def _call(
    phase: str, line: int, target: str, stmt: str, op: str, arg_text: str, state: _State,
    asserts: Mapping[str, tuple], getitems: Mapping[str, list[tuple[int, str]]],
) -> None:
    """``target = op(...)``: a transfer op of fxoffload, or a fallback or extern kernel that allocates
    its results (recorded in ``state.calls``)."""
    args = split_args(arg_text)
    positional = [a for a in args if a and "=" not in a.split("(")[0]]  # not out=, stride=
    tensors = [base_name(a) for a in positional if base_name(a) in state.names]
    dtype = next((state.dtypes[t] for t in tensors if t in state.dtypes), torch.float32)
    kind = _FXOFFLOAD.match(op)
    # copy_if_misaligned (torch 2.13, on an input): a copy only of data that is not 16-byte
    # aligned, never the case for an allocator block; the input itself otherwise.
    if op == "copy_if_misaligned" or (kind and kind.group(1) in ("wait", "order")):
        state.dtypes[target] = dtype
        state.bind(target, state.names.get(tensors[0], []) if tensors else [])
    elif kind and kind.group(1) == "offload":
        state.dtypes[target] = dtype
        state.bind(target, [])  # a host buffer: no device bytes
    else:
        _record_call(state, line, op, arg_text)
        ids = _allocate(target, stmt, phase, dtype, asserts, getitems, state, op.removeprefix("torch.ops."))
        state.dtypes[target] = dtype
        state.bind(target, ids)


def _record_call(state: _State, line: int, op: str, arg_text: str) -> None:
    operands = {
        n: (*state.layouts[n], state.dtypes.get(n, torch.float32))
        for n in dict.fromkeys(_WORD.findall(arg_text)) if n in state.layouts and n in state.names
    }  # fmt: skip
    state.calls.append(ExternCall(line, op, arg_text, operands))


def _allocate(
    target: str,
    stmt: str,
    phase: str,
    dtype: torch.dtype,
    asserts: Mapping[str, tuple],
    getitems: Mapping[str, list[tuple[int, str]]],
    state: _State,
    op: str = "",
) -> list[int]:
    """Storages a fallback or extern kernel ``op`` returns, sized by the ``assert_size_stride`` of its
    result or of the elements read from it, each in its dtype: ``state.known_dtypes`` (read elsewhere
    in the code), else ``_OUTPUT_DTYPES[op]``, else ``dtype`` (its first tensor argument's). In CUDA
    code, an output of ``_HOST_OUTPUTS[op]`` is on the host: 0 device bytes."""
    known = state.known_dtypes
    if target in asserts:
        return [state.new(span_bytes(*asserts[target], known.get(target, dtype)), phase)]
    by_index = _OUTPUT_DTYPES.get(op, {})
    on_host = _HOST_OUTPUTS.get(op, frozenset()) if state.cuda else frozenset()
    elements = sorted(getitems.get(target, ()))
    if not elements:
        log.debug("fxoffload: no size for the result of %r: counted as 0 bytes", stmt)
        return []
    ids = []
    for index, name in elements:
        while len(ids) < index:  # outputs no line reads: unknown size (often None)
            ids.append(state.new(0, phase))
        element_dtype = known.get(name, by_index.get(index, dtype))
        state.dtypes[name] = element_dtype  # what ``name = target[index]`` binds next
        sized = name in asserts and index not in on_host
        nbytes = span_bytes(*asserts[name], element_dtype) if sized else 0
        if name not in asserts:
            log.debug("fxoffload: no size for %s (element %d of %r): counted as 0 bytes", name, index, stmt)
        ids.append(state.new(nbytes, phase))
    return ids


def _is_cuda_code(code: str) -> bool:
    return "empty_strided_cuda(" in code or "device='cuda" in code


def _saved_dtypes(fw: Sequence[Statement], dtypes: Sequence[torch.dtype | None]) -> dict[str, torch.dtype]:
    """The dtype of each saved tensor the forward returns, by the forward's name for it, from
    ``dtypes``: the saved tensors' dtypes in the order it returns them (the backward receives them
    first, in that order, and its ``get_args`` says them: the one place the text gives a fallback
    result's dtype)."""
    returned = returned_names(fw)
    out: dict[str, torch.dtype] = {}
    for name, dtype in zip(returned[len(returned) - len(dtypes) :], dtypes):
        if name and dtype is not None:
            out.setdefault(name, dtype)
    return out


def simulate_output_code(
    fw_code: str,
    bw_code: str,
    num_fwd_outputs: int | None = None,
    static_input_indices: Sequence[int] = (),
    scratch: Mapping[tuple[str, int], int] | None = None,
    symbols: Mapping[str, int] | None = None,
    outside: int = 0,
    outside_backward: int = 0,
) -> MemoryTimeline:
    """The device-memory timeline of one training step through Inductor's forward then backward wrapper.

    ``fw_code``, ``bw_code``: the modules Inductor generated (``report.output_code["forward"]`` and
    ``["backward"]``). ``num_fwd_outputs``: the forward's user outputs before its saved tensors; by
    default, what the backward does not receive (its arguments other than ``tangents_*``).
    ``scratch``: bytes a fallback or extern kernel allocates inside its call and frees before it
    returns, by ``(phase, line)`` of the call (``"forward"`` or ``"backward"``, ``Statement.line``),
    counted at that line: a pair's replay passes what ``measure.standalone.call_temporaries`` measured
    running its ``extern_calls`` alone on the code's layouts (a channels-last ``convolution_backward``
    holds oneDNN's weight-gradient buffer and a dense copy: 55 KB on a small UNet, 11% of its step's
    peak). ``symbols``: values of symbolic sizes (``{"s0": 8}``).
    ``outside``: bytes code before the pair holds through it, "outside" at every point
    (``memory.simulate``), and ``outside_backward`` more at the backward's points.

    Points are ``MemoryPoint(phase, "<phase> line <n>: <statement>", live)`` with ``live`` in the
    categories of ``memory.CATEGORIES``; the peak less "parameters" and "inputs" is what the step
    allocates above its start.
    """
    symbols, scratch = dict(symbols or {}), dict(scratch or {})
    fw, bw = (statements(code) if call_body(code) else [] for code in (fw_code, bw_code))
    if not fw or not bw:
        which = " and ".join(n for n, s in (("fw_code", fw), ("bw_code", bw)) if not s)
        raise ValueError(
            f"{which}: no 'def call(...)' with statements found; pass Inductor's Python wrapper code"
        )
    bw_args, bw_sizes = arg_names(bw), module_args(bw_code, symbols)
    dtypes = [bw_sizes[a][2] if a in bw_sizes else None for a in bw_args if not a.startswith("tangents_")]
    state = _State(cuda=_is_cuda_code(fw_code) or _is_cuda_code(bw_code), known_dtypes=_saved_dtypes(fw, dtypes))
    _bind_forward_args(state, arg_names(fw), module_args(fw_code, symbols), set(static_input_indices))
    returned = _run("forward", fw, state, symbols, scratch)
    state.known_dtypes = {}  # the backward's results are gradients: their first argument's dtype
    saved = _saved_between(state, returned, bw_args, num_fwd_outputs)
    state.dtypes = {}  # the wrapper's locals: the backward's ``buf0`` is not the forward's
    _bind_backward_args(state, bw_args, bw_sizes, saved)
    grads = _run("backward", bw, state, symbols, scratch)
    for ids in grads:  # held by AccumulateGrad
        for i in ids:
            if state.storages[i].phase == "backward":
                state.storages[i].category = "gradients"
    return _timeline(state, outside, outside_backward)


def simulate_forward_code(
    fw_code: str, saved_dtypes: Sequence[torch.dtype | None] = (), scratch: Mapping[tuple[str, int], int] | None = None,
    outside: int = 0,
) -> MemoryTimeline:
    """The forward alone of ``simulate_output_code``, from its code alone: its peak is a lower bound
    of the step's, before a backward is lowered (``verify_peak`` lowers one only where this does not
    settle it). ``saved_dtypes``: the saved tensors' dtypes in the order the forward returns them
    (what the backward's ``get_args`` gives a pair's replay); the categories are the forward's own
    (its saved tensors count as "transient": only the backward's arguments say which they are)."""
    fw = statements(fw_code) if call_body(fw_code) else []
    if not fw:
        raise ValueError("fw_code: no 'def call(...)' with statements found; pass Inductor's Python wrapper code")
    state = _State(cuda=_is_cuda_code(fw_code), known_dtypes=_saved_dtypes(fw, saved_dtypes))
    _bind_forward_args(state, arg_names(fw), module_args(fw_code, {}), set())
    _run("forward", fw, state, {}, dict(scratch or {}))
    return _timeline(state, outside, 0)


def returned_strides(code: str) -> list[tuple[int, ...] | None]:
    """The strides of what a wrapper returns, in order, as its code lays them out: what Inductor tells
    AOTAutograd of a forward it compiled, for the backward's saved inputs. None for a value the code
    gives no layout; empty for code this reader does not know (symbolic sizes)."""
    try:
        stmts, state = _walked(code, {})
    except ValueError:
        return []
    out: list[tuple[int, ...] | None] = []
    for value in returned_values(stmts):
        if value.startswith("reinterpret_tensor("):
            out.append(eval_ints(split_args(value[len("reinterpret_tensor(") : -1])[2], {}, value))
        else:
            out.append(state.layouts[value][1] if value in state.layouts else None)
    return out


def _walked(code: str, symbols: Mapping[str, int]) -> tuple[list[Statement], _State]:
    """One wrapper's statements, replayed from its ``get_args`` alone (``extern_calls``)."""
    stmts = statements(code) if call_body(code) else []
    if not stmts:
        raise ValueError("code: no 'def call(...)' with statements found; pass Inductor's Python wrapper code")
    state = _State(cuda=_is_cuda_code(code))
    _bind_forward_args(state, arg_names(stmts), module_args(code, symbols), set())
    _run("forward", stmts, state, symbols, {})
    return stmts, state


def extern_calls(code: str, symbols: Mapping[str, int] | None = None) -> list[ExternCall]:
    """The fallback and extern kernel calls of one wrapper (a forward or a backward), each with the
    layouts of the buffers it names as the replay finds them: what ``measure.standalone`` runs alone
    to measure the scratch a replay counts at their lines (``scratch``). Raises ``ValueError`` for
    code this reader does not know, and for symbolic sizes not in ``symbols``."""
    return _walked(code, dict(symbols or {}))[1].calls


def _timeline(state: _State, outside: int, outside_backward: int) -> MemoryTimeline:
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


def _bind_forward_args(state: _State, names: Sequence[str], layouts: Mapping[str, Layout], static: set[int]) -> None:
    """The forward's arguments: the caller's for the whole step (parameters, or inputs)."""
    for i, name in enumerate(names):
        nbytes, dtype = _arg_bytes(state, name, layouts)
        sid = state.new(nbytes, "caller")
        state.storages[sid].category = "parameters" if i in static else "inputs"
        state.storages[sid].refs += 1  # the caller's reference, never dropped
        state.dtypes[name] = dtype
        state.bind(name, [sid])


def _arg_bytes(state: _State, name: str, layouts: Mapping[str, Layout]) -> tuple[int, torch.dtype]:
    """Bytes and dtype of argument ``name`` from ``get_args`` (its layout kept for the calls it reads)."""
    if name not in layouts:
        return 0, torch.float32
    size, stride, dtype = layouts[name]
    state.layouts[name] = (size, stride)
    return span_bytes(size, stride, dtype), dtype


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
    state: _State, names: Sequence[str], layouts: Mapping[str, Layout], saved: list[list[int]]
) -> None:
    """The backward's arguments: the saved tensors first, then the tangents (allocated before the
    call); the saved ones are freed where the backward drops its last name for them."""
    for j, name in enumerate(names):
        nbytes, state.dtypes[name] = _arg_bytes(state, name, layouts)
        ids = saved[j] if j < len(saved) else [state.new(nbytes, "backward")]
        state.bind(name, ids)
    for ids in saved:
        state.drop(ids)  # the backward frees them at its ``del``
