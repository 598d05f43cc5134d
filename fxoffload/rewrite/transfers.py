"""The rewrite: the only code that mutates graphs. Inserts the transfer pairs an ``OffloadPlan`` chose.

Before (forward / backward)::

    x = producer(...)                       |  x = placeholder
    y = user(x)                             |  gx = first_use(x, ...)
    return (y, x)                           |

After::

    x = producer(...)                       |  x_host = placeholder
    y = user(x)                             |  ...                   (``prefetch`` compute nodes)
    h = fxoffload.offload(x, [y])           |  d = fxoffload.reload(x_host, device, [a])
    ... (``prefetch`` compute nodes, b) ... |  ...
    h = fxoffload.wait(h, x, [b])           |  d = fxoffload.wait(d, x_host, [])
    return (y, h)                           |  gx = first_use(d, ...)

``[y]``, ``[b]`` and ``[a]`` are data edges: they pin each copy behind the nodes it must follow, so a
scheduler that reorders nodes keeps the intended order. ``x`` is an argument of its wait, so it lives
until the compute stream has waited on the copy, and no longer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.fusion import addmm_products
from ..analysis.graph import is_compute, is_view, storage_root, storage_users
from ..ir import OFFLOAD, ORDER, RELOAD, TRANSFER_OPS, WAIT, fake_impl, transfer_name
from ..options import BROKEN_RULES
from ..planning.decisions import OffloadPlan
from .edges import Liveness, after_edges, alive_edge, edge_to
from .host_layout import host_layouts
from .kernel_runs import between_kernel_runs, materialised, routing_cost
from .tuples import getitems_after, release_tuples

__all__ = ["BROKEN_RULES", "apply_plan", "hoist_saved_views", "host_placeholder_name", "materialised"]


def apply_plan(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    plan: OffloadPlan,
    prefetch: int | None,
    cpu_link: tuple[float, float] = (0.0, 0.0),
    broken_rule: str | None = None,
    graph_id: int = -1,
    kernel_runs: bool = False,
    fuses: bool = False,
) -> None:
    """Insert one offload/wait pair in ``fw`` and one reload/wait pair in ``bw`` per offloaded tensor;
    in a pair that offloads or recomputes anything, compiled by Inductor, read each fallback's results
    in the backward out together (``tuples.release_tuples``).

    With ``prefetch=None`` the copies go where the plan's schedule put them (the forward wait after
    the node by which the copy is predicted done, the reload after the last node that ends before
    its predicted issue time); with an int, that many compute nodes away. ``cpu_link`` is the
    (device-to-host, host-to-device) speed in bytes/s of the CPU copy engine (0: unthrottled).
    ``broken_rule``: one of ``BROKEN_RULES``, broken on purpose (the option of that name, for the
    tests that prove the suite notices each breakage); None in every real use. ``graph_id`` names
    the copies (``ir.transfer_name``), so that their measured times find their tensors.
    ``kernel_runs``: for Inductor's C++ backend (``kernel_runs.between_kernel_runs``).
    ``fuses``: the graphs are compiled by Inductor, which folds ``add(mm(a, b), c)`` into one
    ``addmm`` where the mm has no other reader: no copy takes a data edge to such an mm; and whose
    wrapper holds a fallback's results until it reads the last one out (``tuples.release_tuples``).
    """
    if plan.offloaded:
        _insert_transfers(fw, bw, plan, prefetch, cpu_link, broken_rule, graph_id, fuses)
    elif not plan.recomputed:
        return  # nothing changes: the pair stays as it was given
    if fuses and broken_rule != "fallback_results_held":
        # The backward's only: a forward's results it only returns are saved tensors, which its
        # copies read. Routed there (a GPT's attention outputs, its logsumexp as the edge), the
        # replay of a plan whose copies were switched off at run time was 52% under the allocator.
        release_tuples(bw)
    for gm in (fw, bw):
        if kernel_runs:
            between_kernel_runs(gm.graph)
        gm.graph.lint()
        gm.recompile()


def _insert_transfers(
    fw: fx.GraphModule, bw: fx.GraphModule, plan: OffloadPlan, prefetch: int | None, cpu_link: tuple[float, float],
    broken_rule: str | None, graph_id: int, fuses: bool,
) -> None:
    """The copies of ``apply_plan``: one offload/wait pair in ``fw`` and one reload/wait pair in ``bw``
    per offloaded tensor, and the host copies' layouts."""
    chosen = plan.offloaded
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    bw_nodes = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    fw_order = list(fw.graph.nodes)
    bw_order = list(bw.graph.nodes)
    fw_index = {n: i for i, n in enumerate(fw_order) if n.op != "output"}
    bw_index = {n: i for i, n in enumerate(bw_order)}
    output = fw.graph.output_node()
    outputs = list(output.args[0])
    # Storages the forward returns and keeps (the outputs that are not offloaded): alive to its end.
    offloaded = {d.saved.name for d in chosen}
    fw_kept = {storage_root(o) for o in outputs if isinstance(o, fx.Node) and o.name not in offloaded}
    fw_alive = Liveness(fw_index, fw_kept, addmm_products(fw) if fuses else {})
    bw_outputs = {storage_root(o) for o in bw.graph.output_node().all_input_nodes}
    bw_alive = Liveness(bw_index, bw_outputs, addmm_products(bw) if fuses else {})
    for decision in chosen:
        t = decision.saved
        timing = decision.timing if prefetch is None else None
        fw_at = timing.fw_wait_after if timing else None
        bw_at = timing.bw_issue_after if timing else None
        name = transfer_name(graph_id, t.name)
        host = _rewrite_forward(
            fw.graph, fw_order, fw_index, fw_nodes[t.name], prefetch or 0, fw_at, (cpu_link[0], name), fw_alive,
            broken_rule,
        )  # fmt: skip
        outputs[t.output_index] = host
        _rewrite_backward(
            bw.graph, bw_order, bw_index, bw_nodes[t.name], host, prefetch or 0, bw_at, (cpu_link[1], name), bw_alive,
            broken_rule,
        )  # fmt: skip
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    host_layouts(fw, bw, host_placeholder_name, broken_rule, inductor=fuses)


def hoist_saved_views(fw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Move each saved view (and its chain of views) right after its inputs. Runs before analysis.

    Partitioners emit the views they save at the end of the forward, which makes the base's last
    use the end of the forward. A view computes nothing, so moving it up is free; it changes no
    memory without offloading (a saved view keeps its base alive until the backward anyway), and
    with offloading the base can be copied out and released as soon as its real readers are done.
    The getitems of multi-output ops are moved next to their op first, for the same reason.
    """
    graph = fw.graph
    moved = False
    outputs = graph.output_node().args[0]
    saved_views = [o for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node) and is_view(o)]
    # Positions, kept up to date without renumbering the graph after each move (that made this
    # quadratic): a moved view takes a position just after its latest input.
    index: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    for view_node in saved_views:
        chain = []
        node = view_node
        while is_view(node):
            chain.append(node)
            node = node.args[0]
        for view in reversed(chain):  # the one closest to the base first
            latest = max(view.all_input_nodes, key=index.__getitem__)
            if index[latest] + 1 < index[view]:
                latest.append(view)
                index[view] = index[latest] + 1e-3
                moved = True
    # Then the getitems of a multi-output op right after it (before the views just moved): the op
    # allocates all its results while it runs, so a getitem placed later only made the op's
    # readers look later than they are.
    for n in list(graph.nodes):
        moved = getitems_after(n)[1] or moved
    if moved:
        graph.lint()
        fw.recompile()


def _rewrite_forward(
    graph: fx.Graph,
    order: list[fx.Node],
    index: dict[fx.Node, int],
    x: fx.Node,
    prefetch: int,
    wait_after: int | None = None,
    copy_args: tuple[float, str] = (0.0, ""),
    alive: Liveness | None = None,
    broken: str | None = None,
) -> fx.Node:
    # Every reader of the storage, through any alias: a saved view of ``relu`` frees relu's storage.
    users = [u for u in storage_users(storage_root(x)) if u in index and u is not x]
    deps = _tensor_results(_maximal([u for u in users if is_compute(u)], index))
    # A multi-output user is represented by its getitems, which may come after it.
    last = max([x, *users, *deps], key=index.__getitem__)
    with graph.inserting_after(last):
        # Edges only to nodes every compiler materialises: an edge to a fusible node would make the
        # compiler write out a buffer it would otherwise fuse away.
        # (Each alive there anyway, or a descendant that is, so the edges hold no memory: a reader
        # after the copy is no race, the wait does not free the source, it ends the copy's claim.)
        after = [alive_edge(d, index[last] + 0.5, order, index, alive) for d in deps if edge_to(d, alive)]
        copy = _call(graph, OFFLOAD, (x, list(dict.fromkeys(a for a in after if a is not None)), *copy_args))
    if wait_after is None:
        anchor = _compute_anchor(order, index[last], prefetch, step=+1)
    else:  # right after the scheduled node, or the node after the copy if that comes later: where
        # the plan (``planning.budget.off_device``) releases the source
        at = max(wait_after, index[last] + 1)
        anchor = _tensor_result(order[at]) if at < len(order) and order[at].op != "output" else None
    # Between the copy and its wait the plan put compute; if some of it is materialised, the copy is
    # issued before ``c``, the first such node, and waited on after it: that kernel runs between the
    # two whatever order the compiler picks (without the edge to ``c``, Inductor's peak-memory
    # reordering moves the copy down to its wait).
    stop = index[anchor] + 1 if anchor is not None else len(order)
    c = _issue_before(graph, order, index, index[last] + 1, stop, copy, broken)
    at = index[anchor] + 0.5 if anchor is not None else len(order)  # where the wait goes
    edges = after_edges(c, anchor, at, order, index, alive)
    if broken == "reload_before_written":
        return copy  # no wait: the host copy is saved before it is written
    keepalive = copy if broken == "source_released_at_issue" else x
    if anchor is None:
        # Nothing left to overlap with: wait just before the outputs are returned.
        with graph.inserting_before(graph.output_node()):
            done = _call(graph, WAIT, (copy, keepalive, edges))
    else:
        with graph.inserting_after(anchor):
            done = _call(graph, WAIT, (copy, keepalive, edges))
    return done


def host_placeholder_name(saved: str) -> str:
    """The backward placeholder that receives the host copy of the saved tensor named ``saved``."""
    return f"{saved}_host"


def _rewrite_backward(
    graph: fx.Graph,
    order: list[fx.Node],
    index: dict[fx.Node, int],
    placeholder: fx.Node,
    host: fx.Node,
    prefetch: int,
    issue_after: int | None = None,
    copy_args: tuple[float, str] = (0.0, ""),
    alive: Liveness | None = None,
    broken: str | None = None,
) -> None:
    with graph.inserting_before(placeholder):
        host_in = graph.placeholder(host_placeholder_name(placeholder.name))
    host_in.meta["val"] = host.meta["val"]
    # An ``order`` node added for an earlier copy may read the placeholder: it is not in ``index`` and
    # stands just before the node it was added for.
    users = [u for u in storage_users(placeholder) if (u in index or u.target is ORDER) and u.op != "output"]
    first = min(users, key=lambda u: index[u] if u in index else min(index[v] for v in u.users) - 0.5)
    if first not in index:
        index[first] = min(index[v] for v in first.users)
    if issue_after is None:
        anchor = _compute_anchor(order, index[first], prefetch, step=-1)
    elif issue_after < 0:
        anchor = None  # issued at the start of the backward
    else:  # right after the scheduled node (before the first use at the latest): where the plan
        # (``planning.budget.off_device``) has the destination allocated
        anchor = _tensor_result(order[min(issue_after, index[first] - 1)])
    device = placeholder.meta["val"].device
    if anchor is not None:
        # Lower bounds: the anchor if it is materialised, and the inputs of the first use computed by
        # then when the first use is (they are buffers anyway): without them a scheduler that moves
        # the first use late (a weight gradient, to the end) would leave the reload far ahead of it.
        # (Only inputs computed before the node the reload is issued before, or it would be a cycle.)
        lower = [anchor] if edge_to(anchor, alive) else []
        if materialised(first):
            readers = set(users)
            stop = _first_materialised(order, index[anchor] + 1, index[first])
            lower += [
                a for a in first.all_input_nodes
                if a in index and a not in readers and a.op != "placeholder" and index[a] < stop
                and isinstance(a.meta.get("val"), torch.Tensor) and (alive is None or a not in alive.folded)
            ]  # fmt: skip
        # (An add moved up to its mm, ``edges.addmm_by``, has its mm's index and comes after it.)
        latest = max([anchor, *lower], key=lambda n: (index[n], alive is not None and n in alive.folds))
        with graph.inserting_after(latest):
            copy = _call(graph, RELOAD, (host_in, device, list(dict.fromkeys(lower)), *copy_args))
    else:
        first_compute = next(n for n in order if n.op != "placeholder")
        with graph.inserting_before(first_compute):
            copy = _call(graph, RELOAD, (host_in, device, [], *copy_args))
    # Issued before ``c``, the first materialised node after the anchor that comes before the first
    # use, and waited on after it: the compiler cannot slide the reload down to its use.
    start = index[anchor] + 1 if anchor is not None else 0
    # (``order_edges_on_pointwise`` is broken for the offloads only: a reload's position is its own.)
    reload_broken = None if broken == "order_edges_on_pointwise" else broken
    c = _issue_before(graph, order, index, start, index[first], copy, reload_broken)
    if broken == "no_wait_before_use":  # the first use reads the reload's result; its wait comes last
        placeholder.replace_all_uses_with(copy)
        results = [o for o in graph.output_node().all_input_nodes if isinstance(o.meta.get("val"), torch.Tensor)]
        with graph.inserting_before(graph.output_node()):
            _call(graph, WAIT, (copy, host_in, results))  # after every gradient, in any schedule
        graph.erase_node(placeholder)
        return
    with graph.inserting_before(first):
        edges = after_edges(c, None, index[first] - 0.5, order, index, alive, move=True)
        done = _call(graph, WAIT, (copy, host_in, edges))
    placeholder.replace_all_uses_with(done)
    graph.erase_node(placeholder)


def _first_materialised(order: list[fx.Node], start: int, stop: int, any_node: bool = False) -> int:
    """Index of the node ``_issue_before`` would pick in ``order[start:stop]``; ``stop`` if none.
    ``any_node``: any compute node, materialised or not (the rule broken on purpose)."""
    for i in range(start, min(stop, len(order))):
        c = order[i]
        if (any_node and c.op == "call_function" or materialised(c)) and c.target not in TRANSFER_OPS and any(
            isinstance(a.meta.get("val"), torch.Tensor) for a in c.all_input_nodes
        ):
            return i
    return stop


def _issue_before(
    graph: fx.Graph,
    order: list[fx.Node],
    index: dict[fx.Node, int],
    start: int,
    stop: int,
    copy: fx.Node,
    broken: str | None = None,
) -> fx.Node | None:
    """Make the first materialised node in ``order[start:stop]`` read one of its inputs through
    ``fxoffload.order(input, [copy])``, so that every schedule issues ``copy`` before it. Returns that
    node (whose output the wait may then depend on), or None if there is none.

    A materialised node's inputs are buffers already (an extern kernel reads realised inputs), so
    the edge costs no memory. Several copies due before the same node share one ``order`` node.
    """
    if broken == "no_order_edges":
        return None
    # Broken on purpose: an edge into a pointwise node makes the compiler realise its input, which
    # splits the fusion it was part of (tests/test_cuda_lowering.py counts Inductor's kernels).
    i = _first_materialised(order, start, stop, any_node=broken == "order_edges_on_pointwise")
    if i < min(stop, len(order)):
        c = order[i]
        inputs = [a for a in c.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for a in inputs:
            if a.target is ORDER:
                a.args = (a.args[0], [*a.args[1], copy])
                return _tensor_result(c)
        inp = min(inputs, key=lambda a: routing_cost(a, c))
        with graph.inserting_before(c):
            routed = graph.call_function(ORDER, (inp, [copy]))
        routed.meta["val"] = inp.meta["val"]
        c.replace_input_with(inp, routed)
        return _tensor_result(c)
    return None


def _tensor_result(n: fx.Node) -> fx.Node | None:
    results = _tensor_results([n])
    return min(results, key=lambda u: u.args[1] if u is not n else -1) if results else None


def _call(graph: fx.Graph, op: torch._ops.OpOverload, args: tuple) -> fx.Node:
    node = graph.call_function(op, args)
    val = args[0].meta["val"]
    if op is WAIT:
        node.meta["val"] = val  # the wait returns its first argument, aliased
    else:
        # The ops' own fake functions, without a trip through the dispatcher (this runs per tensor).
        fake_args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        fake_args[2 if op is RELOAD else 1] = []  # the ``after`` list
        with val.fake_mode:
            node.meta["val"] = fake_impl(op)(*fake_args)
    return node


def _maximal(nodes: list[fx.Node], index: dict[fx.Node, int]) -> list[fx.Node]:
    """The nodes that are not ancestors of another one in ``nodes``.

    An edge on a later reader already orders the copy after its ancestors, and every extra edge keeps
    one more output alive until the copy starts. The search walks backwards from each node and stops
    at the earliest candidate's position, so readers close together cost little.
    """
    if len(nodes) < 2:
        return nodes
    candidates = set(nodes)
    floor = min(index[n] for n in nodes)
    covered: set[fx.Node] = set()
    for n in sorted(nodes, key=index.__getitem__, reverse=True):
        if n in covered:
            continue
        stack, seen = list(n.all_input_nodes), set()
        while stack:
            m = stack.pop()
            if m in seen or index.get(m, -1) < floor:
                continue
            seen.add(m)
            if m in candidates:
                covered.add(m)
            stack.extend(m.all_input_nodes)
    return [n for n in nodes if n not in covered]


def _tensor_results(nodes) -> list[fx.Node]:
    """Tensor-valued nodes standing for ``nodes``: multi-output ops are represented by a getitem."""
    out = []
    for n in nodes:
        if isinstance(n.meta.get("val"), torch.Tensor):
            out.append(n)
        else:
            out.extend(
                u for u in n.users
                if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)
            )  # fmt: skip
    return out


def _compute_anchor(order: list[fx.Node], start: int, count: int, step: int) -> fx.Node | None:
    """The node a copy or wait is placed next to: ``count`` compute nodes away from ``order[start]``
    (for a multi-output op, its first tensor getitem). None past the start or end of the graph.

    The plan's position, exactly: looking further for a materialised node would hold memory
    longer than planned. Only materialised nodes get a data edge (``materialised``); any other
    anchor is a position in the graph only.
    """
    seen = 0
    i = start + step
    while 0 <= i < len(order):
        n = order[i]
        if n.op in ("placeholder", "output"):
            break
        if is_compute(n):
            seen += 1
            if seen >= count:
                result = _tensor_result(n)
                if result is not None:
                    return result
        i += step
    return None
