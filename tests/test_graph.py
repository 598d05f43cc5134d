"""Golden graph shape: transfer pairs found by target, and ordering carried by data edges."""

import pytest
import torch
import torch.fx as fx

from fxoffload import ir
from fxoffload.analysis import output_code as codecheck
from fxoffload.testing.models import GPT, MLP, GPTConfig, gpt_batch
from fxoffload.reporting.report import OffloadReport
from fxoffload.rewrite.kernel_runs import materialised

from .conftest import cpu_backend, train_step


def _capture_graphs(model, args, **options):
    """Run one step with inner='aot_eager' and return (report, forward gm, backward gm)."""
    backend = cpu_backend(inner="aot_eager", **options)
    train_step(model, args, backend)
    (report,) = backend.reports
    fw, bw = report.graphs
    return report, fw, bw


def _reach(node: fx.Node, step) -> set[fx.Node]:
    """Every node reached from ``node`` by ``step`` (a node's inputs, or its users), transitively."""
    seen, stack = set(), [node]
    while stack:
        for other in step(stack.pop()):
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


def _ancestors(node: fx.Node) -> set[fx.Node]:
    return _reach(node, lambda n: n.all_input_nodes)


def _descendants(node: fx.Node) -> set[fx.Node]:
    return _reach(node, lambda n: n.users) | {node}


def _by_target(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


@pytest.fixture(scope="module")
def gpt_graphs():
    torch.manual_seed(0)
    cfg = GPTConfig()
    return _capture_graphs(GPT(cfg), gpt_batch(cfg, 2))


def test_one_copy_and_one_wait_per_offloaded_tensor_each_way(gpt_graphs):
    report, fw, bw = gpt_graphs
    n = len(report.offloaded)
    assert n > 0
    assert len(_by_target(fw, ir.OFFLOAD)) == n
    assert len(_by_target(fw, ir.WAIT)) == n
    assert len(_by_target(bw, ir.RELOAD)) == n
    assert len(_by_target(bw, ir.WAIT)) == n
    # Each forward wait consumes exactly one offload, each backward wait exactly one reload.
    for gm, copy_op in ((fw, ir.OFFLOAD), (bw, ir.RELOAD)):
        for wait in _by_target(gm, ir.WAIT):
            assert wait.args[0].target == copy_op
            assert len([u for u in wait.args[0].users if u.target == ir.WAIT]) == 1


def test_forward_outputs_save_host_copies_not_originals(gpt_graphs):
    report, fw, bw = gpt_graphs
    outputs = fw.graph.output_node().args[0]
    names = {getattr(o, "name", None) for o in outputs}
    for row in report.offloaded:
        assert row.name not in names, f"{row.name} is still saved on the device"
    waits = [o for o in outputs if isinstance(o, fx.Node) and o.target == ir.WAIT]
    assert len(waits) == len(report.offloaded)
    assert all(w.meta["val"].device.type == "cpu" for w in waits)
    bw_inputs = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    for row in report.offloaded:
        assert row.name not in bw_inputs and f"{row.name}_host" in bw_inputs


def test_offload_follows_producer_and_its_wait_keeps_the_source(gpt_graphs):
    _, fw, _ = gpt_graphs
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    for copy in _by_target(fw, ir.OFFLOAD):
        src = copy.args[0]
        assert order[src] < order[copy]
        wait = next(u for u in copy.users if u.target == ir.WAIT)
        # The source lives until its wait through this argument (a reader scheduled after the wait
        # keeps it alive longer, which is safe: the copy is complete by then).
        assert wait.args[1] is src, "the wait keeps the source alive"
        # Copies issued before a later kernel reach it through an order node, and the wait follows it,
        # through a data edge to the kernel or to a materialised descendant alive at the wait; where
        # none is alive there, the wait has no edge to it (``rewrite.edges.after_edges``: an edge
        # would hold memory the plan does not count).
        for order_node in (u for u in copy.users if u.target == ir.ORDER):
            kernel = next(iter(order_node.users))
            if kernel in _ancestors(wait) or kernel in wait.args[2]:
                continue
            alive = [
                d for d in _descendants(kernel) if order[d] < order[wait] and materialised(d)
                and not ir.is_transfer(d) and isinstance(d.meta.get("val"), torch.Tensor) and any(order[u] > order[wait] for u in d.users)
            ]  # fmt: skip
            assert not alive, f"{wait.name} could follow {kernel.name} through {alive}"


def test_reload_wait_precedes_first_use_and_follows_its_anchor(gpt_graphs):
    _, _, bw = gpt_graphs
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    for wait in _by_target(bw, ir.WAIT):
        reload = wait.args[0]
        assert reload.target == ir.RELOAD
        first_use = min((u for u in wait.users), key=order.__getitem__)
        assert order[reload] < order[wait] < order[first_use]
        # The anchor is a data edge: the reload cannot be hoisted above it (that would raise the peak).
        (anchor_list,) = [reload.args[2]]
        for anchor in anchor_list:
            assert anchor in _ancestors(reload)


def test_prefetch_sets_the_lookahead():
    torch.manual_seed(0)
    model, x = MLP(layers=4), (torch.randn(8, 64),)
    distances = []
    for prefetch in (1, 4):
        torch._dynamo.reset()
        _, _, bw = _capture_graphs(model, x, prefetch=prefetch)
        nodes = list(bw.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        gaps = []
        for wait in _by_target(bw, ir.WAIT):
            between = nodes[order[wait.args[0]] + 1 : order[wait]]
            gaps.append(sum(n.op == "call_function" and n.target not in ir.TRANSFER_OPS for n in between))
        distances.append(max(gaps))
    assert distances[1] > distances[0]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_the_report_holds_the_graphs_the_inner_compiler_was_given(inner):
    torch.manual_seed(0)
    backend = cpu_backend(inner=inner)
    train_step(MLP(layers=2), (torch.randn(8, 64),), backend)
    (report,) = backend.reports
    fw, bw = report.graphs
    assert (len(fw.graph.nodes), len(bw.graph.nodes)) == (report.fw_nodes, report.bw_nodes)
    n = len(report.offloaded)
    assert n > 0 and len(_by_target(fw, ir.OFFLOAD)) == len(_by_target(bw, ir.RELOAD)) == n
    # AOTAutograd compiles the backward from a deep copy of the graph it was given; the original is kept.
    assert bw.code == report.bw_code
    if inner == "aot_eager":
        # aot_eager's compiler switched this very forward object to the boxed calling convention
        # (args_list) and runs it: the body is the reported code, the signature is not.
        assert fw.code != report.fw_code and "args_list.clear()" in fw.code
        assert fw.code.split("args_list.clear()\n", 1)[1].strip() == report.fw_code.split("):\n", 1)[1].strip()
    else:
        assert fw.code == report.fw_code
        # Inductor's wrapper code has one copy and one wait per transfer of the graph it was given.
        assert len(codecheck.transfers(report.output_code["forward"])) == len(_by_target(fw, ir.OFFLOAD))
        assert len(codecheck.transfers(report.output_code["backward"])) == len(_by_target(bw, ir.RELOAD))


def test_the_report_times_the_pass_and_keeps_graphs_out_of_json():
    torch.manual_seed(0)
    report, fw, bw = _capture_graphs(MLP(layers=4), (torch.randn(8, 64),))
    t = report.timings
    assert t.pass_s > 0 and t.simulate_s > 0 and t.repartition_s == 0  # no memory_budget: no recomputation
    # The node counts are those of the pair the pass was given: the rewrite adds the transfer nodes.
    inserted_fw = sum(n.target in ir.TRANSFER_OPS for n in fw.graph.nodes)
    inserted_bw = sum(n.target in ir.TRANSFER_OPS for n in bw.graph.nodes)
    assert inserted_fw > 0 and inserted_bw > 0
    assert (t.fw_nodes, t.bw_nodes) == (report.fw_nodes - inserted_fw, report.bw_nodes - inserted_bw)
    assert report.num_fwd_outputs == 1  # the loss
    text = report.to_json()
    assert '"timings"' in text and '"graphs"' not in text and "GraphModule" not in repr(report)
    back = OffloadReport.from_json(text)
    assert back == report and back.timings == t and back.graphs is None
