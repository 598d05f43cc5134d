"""The one reader of the Python wrapper code Inductor generates: what runs, as text in and data out.

The FX graph fxoffload hands to Inductor is not what runs: Inductor fuses, reorders
(``reorder_for_peak_memory``), pads buffers on CUDA and may copy an argument to give an op the
strides it asks for. This module reads the wrapper (kept on ``OffloadReport.output_code``): its
``call`` body as statements, argument lists, the layouts of ``get_args`` and ``assert_size_stride``,
what it returns, which lines launch kernels, the op a line names (``op_name``) and the lines that
pass a buffer to an op (``readers``), which ``measure.line_times`` lines a profiler trace up with,
and, for every copy, what the checks of the schedule need (``transfers``)::

    buf3 = torch.ops.fxoffload.offload.default(buf1, [buf2], 0.0)    # copy: reads buf1
    buf4 = buf3; del buf3                                            # alias of the host copy
    extern_kernels.addmm(buf6, buf7, ..., out=buf8)                  # kernels between copy and wait
    buf11 = torch.ops.fxoffload.wait.default(buf4, buf1, [buf8])     # wait: keeps buf1 alive

``code_memory`` replays the statements for memory. Nothing here imports Inductor.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "Statement", "Transfer", "arg_names", "asserted_layouts", "base_name", "call_body", "eval_ints", "is_kernel",
    "is_materialised_call", "may_launch", "module_args", "op_name", "parse_dtype", "readers",
    "read_offloads", "returned_names", "returned_values", "reused_reloads", "split_args", "statements", "transfers",
    "triton_kernel",
]  # fmt: skip

_KERNEL = re.compile(
    r"^\s*(?:\w+ = )?(?:extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|\w+_kernel\w*\.run|torch\.ops\.aten\.\w+\.\w+"
    r"|aten\.\w+\.\w+)\("
)
# the second pass of Inductor's mix-order reduction: the kernel above wrote partial results into a
# workspace, this line reduces them with an eager op (``aten::sum``, ``aten::amax`` ...), one kernel
_WORKSPACE_REDUCTION = re.compile(
    r"^\s*\w+ = \w+\[[^\]]*\]\.view\([^)]*\)\.\w+\(dim=0\)(?:\.to\([\w.]+\))?\s*$"
)
_COPY = re.compile(r"^\s*(\w+) = torch\.ops\.fxoffload\.(offload|reload)\.default\((.*)\)\s*$")
_WAIT = re.compile(r"^\s*(\w+) = torch\.ops\.fxoffload\.wait\.default\((.*)\)\s*$")
_ORDER = re.compile(r"^\s*(\w+) = torch\.ops\.fxoffload\.order\.default\((.*)\)\s*$")
# FX code (``report.fw_code``): calls to ops every compiler keeps as one kernel each
_FX_MATERIALISED = re.compile(
    r"= torch\.ops\.aten\.(mm|addmm|bmm|baddbmm|_addmm_activation|convolution|convolution_backward"
    r"|_scaled_dot_product_\w+|_flash_attention_\w+|_efficient_attention_\w+)\.default\("
)
_ALIAS = re.compile(r"^\s*(\w+) = (\w+)(?:;\s*del \w+)?\s*(#.*)?$")
_DEL = re.compile(r"\bdel (\w+)")
_REUSE = re.compile(r"^\s*(\w+) = (\w+); del \2\s*# reuse")


# A statement ``name = value``, and a bare name (shared with ``analysis.code_memory``).
ASSIGN = re.compile(r"^(\w+) = (.+)$")
NAME = re.compile(r"^\w+$")
_UNPACK_ARGS = re.compile(r"^([\w\s,]+?),? = args$")
_ASSERT = re.compile(r"^assert_size_stride\((\w+),\s*(.*)\)$")
_RETURN = re.compile(r"^return\s*\(?(.*?)\)?\s*$")
_SOURCE = re.compile(r"#\s*Topologically Sorted Source Nodes: \[([^\]]*)\]")
_RAND = re.compile(r"^\s*(\w+) = rand_strided\((.*)\)\s*$")


class Statement(NamedTuple):
    """One statement of ``call``: its line in the body, its text, and the FX nodes of the kernel it
    launches (Inductor's "Topologically Sorted Source Nodes" comment above it), comma-separated."""

    line: int
    text: str
    source: str


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One copy and its wait, as the generated code runs them (line numbers in ``call``)."""

    kind: str  # "offload" or "reload"
    copy_line: int
    wait_line: int  # -1: no wait found for this copy
    source: str  # buffer the copy reads
    keepalive: str  # buffer its wait keeps alive
    kernels_between: int  # kernels launched between the copy and its wait
    kernels_before_use: int  # reload: kernels between the copy and the first kernel reading its result
    source_released_early: bool  # the source was deleted or handed to another buffer before the wait
    issued_before_kernel: bool  # an ``fxoffload.order`` edge makes a kernel wait for this copy to be issued
    returned_at: int  # forward: position of the waited host copy among the graph's outputs; -1: not returned
    name: str = ""  # the copy's transfer name (``ir.transfer_name``), where the code gives it

    @property
    def key(self) -> str:
        """What names this transfer in both the FX code and the generated code of the same graph:
        the output position of an offload, the host placeholder of a reload."""
        return f"output {self.returned_at}" if self.kind == "offload" else self.source

    @property
    def same_buffer(self) -> bool:
        """The wait keeps alive the very buffer the copy reads (no copy of it was made for either)."""
        return self.source == self.keepalive


def call_body(code: str) -> list[str]:
    """The lines of the wrapper's ``call`` function (the code that runs each step)."""
    lines = code.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if re.match(r"\s*def call\(", line))
    except StopIteration:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body


def is_kernel(line: str) -> bool:
    """A line of Inductor wrapper code that launches a kernel (extern, generated or fallback), the
    eager reduction after a mix-order reduction kernel
    (``buf19 = workspace_0[0 * 512 * 1024 : (0 + 1) * 512 * 1024].view(512, 1024).sum(dim=0)``) included."""
    return (bool(_KERNEL.match(line)) or bool(_WORKSPACE_REDUCTION.match(line))) and "fxoffload" not in line


_TRITON_RUN = re.compile(r"^\s*(?:[\w, ]+ = )?(triton_\w+|\w+_kernel\w*)\.run\(")
_EXTERN = re.compile(r"^\s*(?:[\w, ]+ = )?extern_kernels\.(\w+)\(")
_TORCH_OP = re.compile(r"^\s*(?:[\w, ]+ = )?(?:torch\.ops\.(\w+)|(aten))\.(\w+)\.\w+\(")
# lines of ``call`` that call something and launch nothing on the device: the wrapper's bookkeeping
_BOOKKEEPING = re.compile(
    r"^\s*(?:#|del |return\b|with |args\.clear\(|assert_\w+\(|torch\.cuda\.set_device\(|"
    r"(?:[\w, ]+ = )?(?:empty_strided\w*|get_raw_stream|reinterpret_tensor|torch\.empty\w*|empty\w*)\()"
)
_NAME_ALIAS = re.compile(r"^\s*\w+ = \w+(?:\[\d+\])?\s*(?:;.*)?(?:#.*)?$")


def triton_kernel(line: str) -> str | None:
    """The generated kernel a line launches (``triton_poi_fused_0.run(...)``: ``triton_poi_fused_0``),
    else None. The profiler records the launch under the same name."""
    m = _TRITON_RUN.match(line)
    return m.group(1) if m else None


def op_name(line: str) -> str | None:
    """The op a line of ``call`` runs, where its text names it, as the op's schema (and the profiler)
    names it: ``extern_kernels.mm(`` -> ``aten::mm``, ``torch.ops.ns.op.default(`` -> ``ns::op``,
    ``aten.op.default(`` -> ``aten::op``; a generated kernel's own name (``triton_kernel``). Else None."""
    if kernel := triton_kernel(line):
        return kernel
    if m := _EXTERN.match(line):
        return f"aten::{m.group(1)}"
    if m := _TORCH_OP.match(line):
        return f"{m.group(1) or m.group(2)}::{m.group(3)}"
    return None


def may_launch(line: str) -> bool:
    """A line of ``call`` that calls something other than the wrapper's bookkeeping (allocations,
    streams, asserts, aliases, ``del``): what may run on the device. Every ``is_kernel`` line, and the
    calls it does not know (``buf1.copy_(buf2)``, ...)."""
    s = line.split(";")[0]
    return "(" in s and not _BOOKKEEPING.match(s) and not _NAME_ALIAS.match(s)


def is_materialised_call(line: str) -> bool:
    """A line of FX code that calls an op every compiler runs as a kernel of its own (a matmul, ...)."""
    return bool(_FX_MATERIALISED.search(line))


def base_name(expr: str) -> str:
    """The buffer an argument expression reads: ``buf1``, ``reinterpret_tensor(buf1, ...)`` -> buf1."""
    expr = expr.strip()
    m = re.match(r"reinterpret_tensor\((\w+)", expr)
    return m.group(1) if m else re.match(r"\w+", expr).group(0) if re.match(r"\w+", expr) else expr


def split_args(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [a.strip() for a in out]


def statements(code: str) -> list[Statement]:
    """The statements of ``call`` (of ``forward`` for FX code), comments dropped, with their lines
    and the source nodes of the kernels they launch."""
    out, source = [], ""
    for i, line in enumerate(call_body(code) or _fx_body(code)):
        text = line.strip()
        if text.startswith("#"):
            if m := _SOURCE.match(text):
                source = m.group(1)
            continue
        code_part = re.sub(r"\s+#[^'\"]*$", "", text)  # a trailing comment (no quote: not inside a string)
        for stmt in (s.strip() for s in code_part.split(";")):
            if stmt:
                out.append(Statement(i, stmt, source))
                if is_kernel(stmt):
                    source = ""  # the comment names the nodes of this kernel only
    return out


def call_sources(code: str) -> dict[int, tuple[str, tuple[str, ...]]]:
    """By line of ``call``: the op a fallback or extern kernel call there runs (``op_name`` without its
    namespace: ``convolution_backward``) and the FX nodes Inductor's "Topologically Sorted Source Nodes"
    comment above it names (``[mul_47, convolution_backward]``): what ties a call's measured scratch
    to the FX node that runs it (``memory.code_scratch_nodes``)."""
    out = {}
    for line, text, source in statements(code):
        op = op_name(text)
        if op is not None and "::" in op and source:
            out[line] = (op.split("::", 1)[1], tuple(s.strip() for s in source.split(",")))
    return out


def returned_values(stmts: Sequence[Statement]) -> list[str]:
    """The values of the last ``return``, as text (``buf3``, ``reinterpret_tensor(buf2, ...)``, ``None``)."""
    for _, stmt, _ in reversed(stmts):
        if stmt.startswith("return"):
            m = _RETURN.match(stmt)
            return [a for a in split_args(m.group(1)) if a] if m else []
    return []


def returns_own_buffer(code: str) -> list[bool]:
    """For each value ``call`` returns: whether it is a buffer the code made (not one of its arguments
    or a view of one, nor a constant): where the graph returns an input, a copy Inductor laid out
    as it wanted (a convolution's weight, channels-last, saved for the backward)."""
    stmts = statements(code)
    args = set(arg_names(stmts))
    return [name is not None and name not in args for name in returned_names(stmts)]


def returned_names(stmts: Sequence[Statement]) -> list[str | None]:
    """Base names of the last ``return``, one per value (None for a constant or ``None``)."""
    values = returned_values(stmts)
    return [None if a == "None" or not re.match(r"[A-Za-z_]", a) else base_name(a) for a in values]


def readers(code: str, name: str) -> list[int]:
    """Lines of ``call`` (indices into ``call_body(code)``) that pass ``name``, or a name aliasing it,
    to an op that may run on the device (``may_launch``; fxoffload's own ops left out), in order: as an
    argument, an ``out=``, the tensor a method is called on (``name.copy_(x)``, ``name[...].sum()``).

    Aliases are the names made from it after it: ``x = name``, ``x = reinterpret_tensor(name, ...)``
    and ``x = name[0]`` (which takes an element of a tuple result as the whole: over-approximate), not
    a ``# reuse`` of its memory by another buffer."""
    aliases, uses = _reader_index(code)
    names, todo = {name}, [name]
    while todo:
        for alias in aliases.get(todo.pop(), ()):
            if alias not in names:
                names.add(alias)
                todo.append(alias)
    return sorted({i for n in names for i in uses.get(n, ())})


_VIEW_ALIAS = re.compile(
    r"^\s*(\w+) = (?:reinterpret_tensor\()?(\w+)(?:\[\d+\]|,[^;]*\))?\s*(?:;\s*del \w+)?\s*(#.*)?$"
)


@functools.lru_cache(maxsize=8)
def _reader_index(code: str) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    """Of ``call``: name -> the names made as aliases of it, and name -> the lines that pass it to an op."""
    aliases: dict[str, list[str]] = collections.defaultdict(list)
    uses: dict[str, list[int]] = collections.defaultdict(list)
    for i, line in enumerate(call_body(code)):
        if m := _VIEW_ALIAS.match(line):
            if "# reuse" not in line:
                aliases[m.group(2)].append(m.group(1))
            continue
        if "fxoffload" in line or not may_launch(line):
            continue
        passed = line.split(";")[0].split("#")[0].split(" = ", 1)[-1]  # not the names it assigns to
        for n in set(re.findall(r"\b[A-Za-z_]\w*\b", passed)):
            uses[n].append(i)
    return aliases, uses


def arg_names(stmts: Sequence[Statement]) -> list[str]:
    for _, stmt, _ in stmts:
        if m := _UNPACK_ARGS.match(stmt):
            return [a.strip() for a in m.group(1).split(",") if a.strip()]
    return []


def module_args(code: str, symbols: Mapping[str, int]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """Size, stride and dtype of every argument in the module's ``get_args`` (``rand_strided`` lines)."""
    out = {}
    for line in code.splitlines():
        if m := _RAND.match(line):
            args = split_args(m.group(2))
            where = f"get_args: {m.group(1)}"
            dtype = next((parse_dtype(a, where) for a in args if a.startswith("dtype=")), torch.float32)
            out[m.group(1)] = (eval_ints(args[0], symbols, where), eval_ints(args[1], symbols, where), dtype)
    return out


def asserted_layouts(stmts: Sequence[Statement], symbols: Mapping[str, int]) -> dict[str, tuple]:
    """Size and stride asserted for each name, and for a name whose only assert is on a plain alias of it
    (``buf1 = buf0`` then ``assert_size_stride(buf1, ...)``, how Inductor checks a custom op's result)."""
    out: dict[str, tuple] = {}
    alias_of: dict[str, str] = {}
    for _, stmt, _ in stmts:
        if (m := _ASSERT.match(stmt)) and m.group(1) not in out:
            args = split_args(m.group(2))
            out[m.group(1)] = (eval_ints(args[0], symbols, stmt), eval_ints(args[1], symbols, stmt))
        elif (m := ASSIGN.match(stmt)) and NAME.match(m.group(2)):
            alias_of[m.group(1)] = m.group(2)
    for name, base in alias_of.items():
        if name in out:
            while base not in out and base in alias_of:
                out[base] = out[name]
                base = alias_of[base]
            out.setdefault(base, out[name])
    return out


def eval_ints(expr: str, symbols: Mapping[str, int], where: str) -> tuple[int, ...]:
    """A tuple of integer expressions (``(s0, 64)``, ``(64*s0, 1)``) evaluated with ``symbols``."""
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"{where}: cannot read {expr!r} as a size or stride tuple ({e.msg})") from None
    elts = tree.elts if isinstance(tree, (ast.Tuple, ast.List)) else [tree]
    return tuple(_eval_int(e, symbols, where) for e in elts)


_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}


def _eval_int(node: ast.expr, symbols: Mapping[str, int], where: str) -> int:
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
        return _OPS[type(node.op)](_eval_int(node.left, symbols, where), _eval_int(node.right, symbols, where))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_int(node.operand, symbols, where)
    raise ValueError(f"{where}: cannot evaluate {ast.unparse(node)!r} in a size or stride")


def parse_dtype(text: str, where: str) -> torch.dtype:
    name = text.strip().removeprefix("dtype=").strip().removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {text.strip()!r} is not a torch dtype")
    return dtype


def transfers(code: str, kernel=is_kernel) -> list[Transfer]:
    """Every offload and reload in ``code`` with its wait, in the order they are issued.

    ``code`` is Inductor's wrapper code, or FX code with ``kernel=is_materialised_call`` (then the
    counts are the kernels the plan put there that no compiler can fuse away).
    """
    body = [line.split(";")[0] for line in (call_body(code) or _fx_body(code))]
    aliases: dict[str, str] = {}  # name -> the copy's result it aliases

    def root(name: str) -> str:
        while name in aliases:
            name = aliases[name]
        return name

    copies: dict[str, tuple[str, int, str, str]] = {}  # result -> (kind, line, source, transfer name)
    waits: dict[str, tuple[int, str, str]] = {}  # copy result -> (line, keepalive, wait result)
    ordered: set[str] = set()  # copy results some ``order`` edge waits for
    for i, line in enumerate(body):
        if m := _ORDER.match(line):
            after = split_args(m.group(2))[1].strip("[] ")
            ordered.update(root(base_name(a)) for a in split_args(after) if a)
            continue
        if m := _COPY.match(line):
            args = split_args(m.group(3))
            at = 3 if m.group(2) == "offload" else 4  # offload(src, after, bw, name, ...), reload(host, device, ...)
            transfer = args[at].strip().strip("'\"") if len(args) > at else ""
            copies[m.group(1)] = (m.group(2), i, base_name(args[0]), transfer)
        elif m := _WAIT.match(line):
            args = split_args(m.group(2))
            waits[root(base_name(args[0]))] = (i, base_name(args[1]), m.group(1))
        elif (m := _ALIAS.match(line)) and not _REUSE.match(line):
            aliases[m.group(1)] = m.group(2)
    result = []
    returned = [n or "" for n in returned_names(statements(code))]
    n_kernels = [0]
    for line in body:
        n_kernels.append(n_kernels[-1] + kernel(line))

    def kernels(lo: int, hi: int) -> int:  # kernels on lines lo .. hi - 1
        return n_kernels[max(hi, lo)] - n_kernels[lo]

    for name, (kind, line, source, transfer) in copies.items():
        wait_line, keepalive, done = waits.get(name, (-1, "", ""))
        end = wait_line if wait_line >= 0 else len(body)
        between = body[line + 1 : end]
        released = any(
            (m := _REUSE.match(b)) and m.group(2) == source or source in _DEL.findall(b) for b in between
        )  # fmt: skip
        before_use = -1
        if kind == "reload" and done:
            names = {done} | {a for a in aliases if root(a) == done}
            pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
            later = body[end + 1 :]
            use = next((j for j, b in enumerate(later) if _reads(b, pattern)), None)
            if use is not None:
                before_use = kernels(line + 1, end + 1 + use)
        result_name = done or name  # the waited result, or the copy's own when it has no wait
        names = {result_name} | {a for a in aliases if root(a) == result_name}
        at = next((i for i, r in enumerate(returned) if r in names), -1)
        result.append(
            Transfer(kind, line, wait_line, source, keepalive, kernels(line + 1, end), before_use, released,
                     name in ordered, at, transfer)
        )  # fmt: skip
    return sorted(result, key=lambda t: t.copy_line)


_NAME_ARG = re.compile(r"""['"](-?\d+:[^'"]*)['"]""")


def reused_reloads(code: str) -> frozenset[str]:
    """The transfer ``name`` of every reload in Inductor's wrapper ``code`` whose result's memory the
    code hands on to another buffer (a ``# reuse`` line: Inductor's buffer reuse and its in-place
    updates alike), through the result, its wait or an alias of either."""
    return _copies_where(code, "reload", lambda line: _DEL.findall(line) if "# reuse" in line else ())


def read_offloads(code: str) -> frozenset[str]:
    """The transfer ``name`` of every offload in Inductor's wrapper ``code`` whose host copy a call of
    the code reads, through the result, its wait or an alias of either: Inductor copying it into the
    layout the saved tensor was traced with, where it laid the source out otherwise (a convolution's
    output channels-last, the tensor saved contiguous). The host copy must hold the bytes there: a copy
    switched off at run time returns a handle that holds none (``runtime.host_pool.keep_on_device``)."""

    def args_read(line: str) -> list[str]:
        if "fxoffload" in line or not may_launch(line):
            return []
        return [base_name(a) for a in split_args(line[line.index("(") + 1 : line.rindex(")")])]

    return _copies_where(code, "offload", args_read)


def _copies_where(code: str, op: str, hit: Callable[[str], Iterable[str]]) -> frozenset[str]:
    """The transfer names of the ``op`` copies (offload or reload) of ``code`` whose result, its wait or
    an alias of either is among the names ``hit`` finds on a line of ``call``."""
    names: dict[str, str] = {}  # a copy's result, or a name aliasing it -> the copy's transfer name
    found: set[str] = set()
    for line in call_body(code):
        stmt = line.split(";")[0]
        if (m := _COPY.match(stmt)) and m.group(2) == op:
            if named := _NAME_ARG.search(m.group(3)):
                names[m.group(1)] = named.group(1)
        elif hits := [names[n] for n in hit(line) if n in names]:
            found.update(hits)
        elif m := _WAIT.match(stmt):
            first = base_name(split_args(m.group(2))[0])
            if first in names:
                names[m.group(1)] = names[first]
        elif (m := _VIEW_ALIAS.match(line)) and m.group(2) in names:
            names[m.group(1)] = names[m.group(2)]
    return frozenset(found)


def _reads(line: str, names: re.Pattern[str]) -> bool:
    """A compute line (not one of our ops) that names one of ``names`` among its arguments."""
    if "fxoffload" in line or "(" not in line:
        return False
    return bool(names.search(line[line.index("(") :]))


def _fx_body(code: str) -> list[str]:
    lines = code.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*def forward\(", line)), -1)
    return lines[start + 1 :]
