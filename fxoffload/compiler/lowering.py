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
from the host keeps no freed buffer for a later allocation of its size (see there).
``fusion_groups(plan)``: what a backward's kernels are fused within, where a plan changes the graphs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx as fx

from ..analysis.blocks import block_of
from ..analysis.graph import holds_host_copy
from ..ir import is_transfer
from ..planning.decisions import OffloadPlan

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


def lowering_config(graph: fx.GraphModule) -> dict[str, Any]:
    """Inductor's config for lowering ``graph``; every graph without a copy is compiled as Inductor
    compiles it. Where it copies tensors to or from the host:

    - no buffer freed is kept for a later allocation of its size (``allow_buffer_reuse``). Inductor
      keeps one where its own estimate of the graph's peak allows, and that estimate counts the host
      copies as bytes of the device: the offloaded output of one block's MLP was held from its wait
      to the next block's, and the plans' code peaked 8-17% higher on the tiny transformers
      (docs/results.md, eighth session). Buffers written in place of a dying input
      (``inplace_buffers``) stay as they are.

    Such a graph is also lowered with the scheduler's dependencies on mutations kept where its C++
    backend recomputes a node's loops (``_compat.scheduler_runs.keeping_mutation_renames``: the
    reader of a scatter's result put before the scatter, fuzz seed 39 case 10)."""
    if not any(is_transfer(n) for n in graph.graph.nodes):
        return {}
    return {"allow_buffer_reuse": False}


def host_placeholders(graph: fx.GraphModule) -> frozenset[str]:
    """The placeholders of a backward that hold host copies (what its reloads read): never donated to
    Inductor for its own buffers (``_compat.donated``)."""
    return frozenset(n.name for n in graph.graph.find_nodes(op="placeholder") if holds_host_copy(n))


def fusion_groups(plan: OffloadPlan | None) -> Callable[[fx.Node], str | None] | None:
    """The groups Inductor fuses the kernels of ``plan``'s backward within (``_compat.scheduler_runs.
    fusing_within``): its blocks (``analysis.blocks.block_of``) where the plan changes the graphs
    (offloads or recomputes), so that each block's backward, its reloads and recomputation run in
    the order the plan was priced in; None (Inductor's fusion) for a plan that changes nothing.
    Inductor fused the kernels of ALBERT's six calls of one layer (their reads of the shared
    weights) across calls: block by block, the recomputed LayerNorms ran at the start of the
    backward, 13.4 MiB where the plan was priced at 5.8; an offloading plan priced at 3.7 MiB peaked
    at 12.1 (3.2 with the fusions refused; docs/results.md). Distinct weights give it no such
    fusions: the tiny GPT's code is the same either way."""
    return block_of if plan is not None and plan.changes_graphs else None
