"""Transfer ops that leave Inductor's C++ kernels whole (``rewrite.kernel_runs``), asserted on the
FX graph handed to Inductor and on the code it generates: its C++ backend writes a run of
generated-code nodes into one kernel until an extern call, so a copy standing inside a run splits
it (more kernels to compile, more calls per step)."""

import re

import pytest
import torch
import torch.fx as fx

import fxoffload
from fxoffload.ir import OFFLOAD, RELOAD, WAIT
from fxoffload.rewrite import transfers
from fxoffload.rewrite.kernel_runs import between_kernel_runs, materialised, routing_cost
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch


def _step(policy: str, layers: int = 1):
    """A GPT step compiled by Inductor with ``policy`` (offload_cpu): its pair (the rewritten graphs,
    Inductor's code), its loss and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers, dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    backend = fxoffload.backend(policy=policy, offload_cpu=True, min_bytes=0, verify_peak=False)
    loss = torch.compile(model, backend=backend)(*batch)
    loss.backward()
    (pair,) = backend._register.pairs()
    return pair, loss.detach(), [p.grad.clone() for p in model.parameters()]


def _inside_a_run(graph: fx.Graph) -> list[str]:
    """Offloads, reloads and waits standing between two generated-code nodes of ``graph`` (alone or
    among other transfer ops: a cluster of them splits the run as one does)."""
    def copy(n):
        return n.op == "call_function" and n.target in (OFFLOAD, RELOAD, WAIT)

    def generated(n, step):
        while copy(n):
            n = n.prev if step < 0 else n.next
        return n.op == "call_function" and not materialised(n)

    return [n.name for n in graph.nodes if copy(n) and generated(n.prev, -1) and generated(n.next, +1)]


def _kernel_calls(code: str) -> int:
    body = code[code.index("def call(self, args)") :]
    return len(re.findall(r"^\s+cpp_fused\w+\(", body, re.M))


@pytest.fixture(scope="module", autouse=True)
def lowered_here():
    """Every graph of this module lowered, not read from Inductor's FX graph cache: under torch 2.11,
    in this module with a warm cache, the forward with the copies left in place came with 12 kernel
    calls where its fresh lowering has 14 (as many as with them moved; not traced further)."""
    from torch._inductor import config

    with config.patch(fx_graph_cache=False):
        yield


@pytest.fixture(scope="module")
def plain_and_all():
    return _step("none", layers=2), _step("all", layers=2)


def test_no_copy_stands_inside_a_run_of_generated_code(plain_and_all):
    """With every saved tensor offloaded, no copy stands between two generated-code nodes of the
    graphs handed to Inductor, and the backward runs Inductor's own kernels but for one per block
    (2 blocks: 14 calls against 12; copies left where the plan put them, 23); the loss and the
    gradients are Inductor's."""
    (plain, plain_loss, plain_grads), (offloaded, loss, grads) = plain_and_all
    assert len(offloaded.plan.offloaded) >= 20
    assert _inside_a_run(offloaded.fw.graph) == [] and _inside_a_run(offloaded.bw.graph) == []
    calls = _kernel_calls(offloaded.output_code["backward"])
    assert calls <= _kernel_calls(plain.output_code["backward"]) + 2, calls
    torch.testing.assert_close(loss, plain_loss)
    for g, p in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, p)


def test_copies_left_where_the_plan_put_them_split_kernels(monkeypatch, plain_and_all):
    """The rule broken on purpose (the copies left inside the runs): copies inside runs, and more
    kernel calls in both graphs."""
    _, (offloaded, _, _) = plain_and_all
    monkeypatch.setattr(transfers, "between_kernel_runs", lambda graph: 0)
    broken, _, _ = _step("all", layers=2)
    assert _inside_a_run(broken.fw.graph) and _inside_a_run(broken.bw.graph)
    for kind in ("forward", "backward"):
        assert _kernel_calls(broken.output_code[kind]) > _kernel_calls(offloaded.output_code[kind]), kind


def test_each_op_moves_to_the_edge_of_its_run_never_past_what_it_reads():
    """An offload and a forward wait go down to the next extern node, a reload and a backward wait
    up to the previous one; none past a node it reads or that reads it."""
    g = fx.Graph()
    x, w, host = g.placeholder("x"), g.placeholder("w"), g.placeholder("host")
    a = g.call_function(torch.relu, (x,))
    off = g.call_function(OFFLOAD, (a, []))  # offload
    b = g.call_function(torch.neg, (a,))
    mm = g.call_function(torch.ops.aten.mm.default, (b, w))
    c = g.call_function(torch.sin, (mm,))
    rel = g.call_function(RELOAD, (host, x, []))  # reload
    wait = g.call_function(WAIT, (rel, host, []))  # its wait
    d = g.call_function(torch.add, (c, wait))
    g.output((d, off))
    assert between_kernel_runs(g) == 3
    label = {a: "relu", b: "neg", off: "offload", mm: "mm", c: "sin", rel: "reload", wait: "wait", d: "add"}
    names = [label[n] for n in g.nodes if n.op == "call_function"]
    # offload past neg (which does not read it) to the mm; reload and wait up past sin to the mm
    assert names == ["relu", "neg", "offload", "mm", "reload", "wait", "sin", "add"]


def test_an_order_edge_goes_through_an_input_nothing_else_reads():
    """``order`` is routed through an input ``c`` alone reads before a graph input, before one
    other nodes read (Inductor orders them all around the copy)."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    shared = g.call_function(torch.relu, (x,))
    other = g.call_function(torch.neg, (shared,))
    alone = g.call_function(torch.sin, (x,))
    c = g.call_function(torch.ops.aten.mm.default, (shared, alone))
    c2 = g.call_function(torch.ops.aten.mm.default, (shared, w))
    g.output((c, c2, other, g.call_function(torch.neg, (w,))))
    assert routing_cost(alone, c) < routing_cost(w, c2) < routing_cost(shared, c)
    assert materialised(c) and not materialised(alone)
