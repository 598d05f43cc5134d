"""The results of a multi-output fallback, released together: a data edge that makes Inductor's
wrapper drop the tuple such an op returns as soon as its first reader runs.

Inductor runs an op it has no kernel for (``aten.convolution_backward``, the attention kernels) as a
fallback call that returns a tuple, and reads each result out of it in a line of its own::

    buf41 = torch.ops.aten.convolution_backward.default(buf33, div_15, primals_62, ...)
    buf42 = buf41[0]                    # the input's gradient: read by the next kernels
    ...  del buf42                      # its last reader ran: still held by buf41
    ...  (hundreds of lines)
    buf43 = buf41[1]                    # the weight's gradient, only returned
    buf44 = buf41[2]
    del buf41                           # only now is the input's gradient freed

Inductor's ``reorder_for_peak_memory`` counts each result as freed at its own last read and moves
the reads of results the graph only returns (the weights' gradients, as they are or cast under
autocast) late, so the tuple keeps every other result alive until then: on the small diffusion UNet
of ``bench.unet``, with its saved tensors offloaded, the input gradients held so set the step's peak
(438,036 bytes measured, 391,476 once released) and the FX memory model, which frees each result at
its own last read, was 10% under the code (``docs/results.md``). ``release_tuples`` routes the
first-read result of each such call through ``fxoffload.order`` with every other result as an edge:
the wrapper must read them all out before that result's first reader, and drops the tuple there.
Nothing is computed or copied; the order op returns its argument (about 2 us of host time a call).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._compat import inductor_runs_as_fallback
from ..ir import ORDER

__all__ = ["getitems_after", "release_tuples"]


def release_tuples(gm: fx.GraphModule) -> int:
    """For each call of ``gm`` that Inductor runs as a fallback returning several tensors, some of
    which the graph reads on and some it only returns, as they are or cast (a weight's gradient:
    what Inductor reads out late): the first result the graph reads on goes to its readers other
    than the output through ``fxoffload.order(result, [the other results])``. Returns the
    number of calls so routed; the graph is left to the caller to lint and recompile."""
    nodes = list(gm.graph.nodes)
    index = {m: i for i, m in enumerate(nodes)}  # the readers' places: moving getitems keeps them
    routed = 0
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.meta.get("val"), (tuple, list)):
            continue
        items = [u for u in n.users if u.target is operator.getitem]
        tensors = [g for g in items if isinstance(g.meta.get("val"), torch.Tensor)]
        if len(tensors) < 2 or len(items) != len(n.users) or not inductor_runs_as_fallback(n.target):
            continue
        read = [g for g in tensors if not _returned(g)]
        if not read or len(read) == len(tensors):  # none late, or all: nothing to release early
            continue
        readers = {g: [u for u in g.users if u.op != "output"] for g in read}
        first = min(read, key=lambda g: min(index[u] for u in readers[g]))
        at, _ = getitems_after(n)
        with gm.graph.inserting_after(at):
            edge = gm.graph.call_function(ORDER, (first, [g for g in tensors if g is not first]))
        edge.meta["val"] = first.meta.get("val")
        for u in readers[first]:
            u.replace_input_with(first, edge)
        routed += 1
    return routed


def getitems_after(n: fx.Node) -> tuple[fx.Node, bool]:
    """Move the getitems of ``n`` (a multi-output op's results) right after it, in the order of
    their indices (they read nothing else): the op allocates all its results while it runs. Returns
    the last of them (``n`` where it has none) and whether any moved."""
    getitems = [u for u in n.users if u.target is operator.getitem] if n.op == "call_function" else []
    at, moved = n, False
    for g in sorted(getitems, key=lambda g: g.args[1]):
        if at.next is not g:
            at.append(g)
            moved = True
        at = g
    return at, moved


_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _returned(node: fx.Node) -> bool:
    """The graph only returns ``node``'s value, as it is or cast (a weight's gradient under autocast)."""
    return all(
        u.op == "output" or (u.target in _CASTS and all(v.op == "output" for v in u.users)) for u in node.users
    )
