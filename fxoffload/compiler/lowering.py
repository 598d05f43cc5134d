"""How fxoffload has Inductor lower its graphs: on a roomy stretch of the interpreter's frame
stack, and without a freed buffer kept for later where a graph copies to or from the host.

CPython (3.11 and later) keeps Python frames on a stack of chunks, 16 KiB each, and frees a chunk
as soon as the first frame in it returns. A hot call whose frame happens to start a new chunk
therefore maps and unmaps 16 KiB at every call: on the 12-block GPT of ``bench.compile_time`` the
pattern matcher's ``is_match`` (190,000 calls in the joint-graph passes) sat on such a boundary,
and the first step paid 1-2 s of kernel time in page faults that ``backend="inductor"``, calling
the same compile a few frames higher, did not (``docs/results.md``, "the interpreter's frame
stack"). Which call lands on a boundary depends only on how deep the compile is called.

``on_roomy_stack(fn, ...)`` calls ``fn`` from a frame with a large, unused locals array: the
interpreter puts that frame at the start of a chunk of its own (1 MiB), and every frame of the
compile below it fits in the rest of that chunk, so no chunk is mapped and unmapped under it.
Plain Python (a generated function with many local names): no allocator swapped, no interpreter
state touched; where frames are not kept in chunks (CPython before 3.11, other interpreters) it is
a plain call.

``lowering_config(graph)``: the Inductor config a graph is lowered with; a graph that copies to or
from the host keeps no freed buffer for a later allocation of its size, and one that also scatters
into a result is not reordered for peak memory (see there).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx as fx

from ..analysis.graph import holds_host_copy, op_name
from ..ir import is_transfer

T = TypeVar("T")

# Local slots of the roomy frame (8 bytes each): 512 KiB of slots make the interpreter allocate a
# 1 MiB chunk for it (chunk sizes double from 16 KiB until the frame fits), leaving about 512 KiB
# for the frames under it: thousands of frames, deeper than any compile.
ROOMY_SLOTS = 65_536


@functools.cache
def _roomy_caller() -> Callable[..., Any]:
    """A function whose frame has ``ROOMY_SLOTS`` local slots, never assigned (the assignment is
    unreachable; the names are locals all the same): it costs the interpreter one chunk allocation
    per call and nothing per slot but clearing it."""
    names = "=".join(f"_{i}" for i in range(ROOMY_SLOTS))
    source = f"def roomy(fn, args, kwargs):\n    if False:\n        {names} = None\n    return fn(*args, **kwargs)\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<fxoffload roomy frame>", "exec"), namespace)  # noqa: S102 (our own source)
    return namespace["roomy"]


def has_chunked_frames() -> bool:
    """Whether this interpreter keeps frames on a chunked stack that it frees chunk by chunk."""
    return sys.implementation.name == "cpython" and sys.version_info >= (3, 11)


def on_roomy_stack(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, called with room below it on the frame stack (see the module's text)."""
    if not has_chunked_frames():
        return fn(*args, **kwargs)
    return _roomy_caller()(fn, args, kwargs)


# The aten ops Inductor lowers to a buffer and a scatter into it, which mutates that buffer (a clone
# and ``mutate_to``, ``copy_`` or ``ir.Scatter``; some are pointwise on some devices): the readers of
# the result must follow the scatter. Not those of ``NOT_SCATTERS``.
SCATTERS = frozenset({
    "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put",
    "index_add", "index_add_", "index_copy", "index_copy_", "index_fill",
    "index_fill_", "index_reduce", "index_reduce_", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_", "masked_scatter", "masked_scatter_", "_generalized_scatter",
    "select_scatter", "slice_scatter", "diagonal_scatter", "as_strided_scatter",
})  # fmt: skip
# Left out on purpose: ``_unsafe_masked_index_put_accumulate``, an embedding's backward. Every language
# model's backward calls it, and without the reordering Inductor's code for the built-in GPT called 14
# kernels, not 12, and peaked otherwise (tests/test_kernel_runs.py); no fuzz case found a reader of it
# put before it (docs/results.md, eighteenth session).
NOT_SCATTERS = frozenset({"_unsafe_masked_index_put_accumulate"})


def lowering_config(graph: fx.GraphModule) -> dict[str, Any]:
    """Inductor's config for lowering ``graph``; every graph without a copy is compiled as Inductor
    compiles it. Where it copies tensors to or from the host:

    - no buffer freed is kept for a later allocation of its size (``allow_buffer_reuse``). Inductor
      keeps one where its own estimate of the graph's peak allows, and that estimate counts the host
      copies as bytes of the device: the offloaded output of one block's MLP was held from its wait
      to the next block's, and the plans' code peaked 8-17% higher on the tiny transformers
      (docs/results.md, eighth session). Buffers written in place of a dying input
      (``inplace_buffers``) stay as they are.
    - where it also scatters into a result (``SCATTERS``), no peak-memory reordering
      (``reorder_for_peak_memory``). In a forward with copies, the kernel reading an accumulating
      ``index_put``'s result depended on the buffer scattered into, not on the scatter, and the
      reordering put it first: a wrong loss (fuzz seed 39 case 10, docs/results.md, seventeenth
      session). The graph's own order is right. The lost dependency is Inductor's (torch 2.11 and
      2.13): where it recomputes a node's loops to fuse it with one of another shape
      (``SchedulerNode.recompute_size_and_body``, from its C++ backend) it drops the renames that
      point the node's reads at the latest scatter; copies only change the peaks the reordering
      weighs. Its GPU backends recompute a split reduction the same way, so the rule is not only
      the CPU's.
    """
    if not any(is_transfer(n) for n in graph.graph.nodes):
        return {}
    patches: dict[str, Any] = {"allow_buffer_reuse": False}
    if any(op_name(n) in SCATTERS for n in graph.graph.nodes):
        patches["reorder_for_peak_memory"] = False
    return patches


def host_placeholders(graph: fx.GraphModule) -> frozenset[str]:
    """The placeholders of a backward that hold host copies (what its reloads read): never donated to
    Inductor for its own buffers (``_compat.donated``)."""
    return frozenset(n.name for n in graph.graph.find_nodes(op="placeholder") if holds_host_copy(n))
