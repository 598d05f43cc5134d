"""Recomputation under memory_budget, on adversarial models: results never change, and the plan
respects what must not be recomputed (mutated inputs, MUST_SAVE tags, random ops).

The options force recomputation: a 0.01 GB/s link makes every un-hidden offload stall for
milliseconds, while a recomputed op costs microseconds at the fixed compute rates.
"""

import copy
import functools
import re
import warnings

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxoffload import _compat
from fxoffload.analysis.memory import simulate
from fxoffload.reporting.report import OffloadReport

from .conftest import assert_same, cpu_backend, returned_names, train_step

INNERS = ["aot_eager", "inductor"]
FORCE = {
    "bandwidth": "0.01GB",
    "memory_budget": 0.5,
    "min_bytes": 0,
    "policy": "auto",
    "compute_rates": {"flops": 1e13, "memory_bandwidth": 1e12},
}
D, N = 32, 1024  # small weights, large batch: activations dominate the peak


@pytest.fixture(autouse=True)
def _eager_random():
    with inductor_config.patch(fallback_random=True):
        yield


def _backend(inner="aot_eager", **options):
    return cpu_backend(inner=inner, **{**FORCE, **options})


def _run(model, args, backend, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an unreachable budget is not what these test
        return train_step(model, args, backend, **kwargs)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 4 * D, bias=False)
        self.b = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        return x + self.b(torch.sin(self.a(x)))


class Stack(nn.Module):
    """Three blocks; ``mode`` wraps the middle one in checkpoint ("ckpt") or in selective
    checkpointing that must save matmuls ("sac")."""

    def __init__(self, mode="none"):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.mode = mode

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i == 1 and self.mode == "ckpt":
                x = checkpoint(block, x, use_reentrant=False)
            elif i == 1 and self.mode == "sac":
                context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                x = checkpoint(block, x, use_reentrant=False, context_fn=context)
            else:
                x = block(x)
        return (x.sin() * x).mean()


def _save_matmuls(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("mode", ["none", "ckpt"])
def test_recomputing_keeps_results_with_and_without_checkpoint(mode, inner):
    torch.manual_seed(0)
    model, x = Stack(mode), (torch.randn(N, D),)
    # 0.6: under Inductor the model of the recomputing plans peaks where their code does (2.0 MiB),
    # above half the step's peak (1.8 MiB), which only copies that stall reach.
    backend = _backend(inner, memory_budget=0.6)
    got = _run(model, x, backend)
    (report,) = backend.reports
    assert report.recomputed, report.table()
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)
    if inner == "inductor":
        assert_same(got, train_step(model, x, "inductor"), rtol=1e-5, atol=1e-7)
    for r in report.recomputed:
        assert r.name not in returned_names(report.fw_code), f"{r.name} is still saved"
        assert re.search(rf"\b{r.name} = ", report.bw_code), f"{r.name} is not rebuilt in the backward"


def test_a_must_save_tag_of_selective_checkpointing_is_respected():
    """The policy says matmuls MUST_SAVE; overriding its tag with MUST_RECOMPUTE recomputed one."""
    torch.manual_seed(0)
    model, x = Stack("sac"), (torch.randn(N, D),)
    backend = _backend()
    got = _run(model, x, backend)
    (report,) = backend.reports
    # The report says why each saved tensor could not be recomputed: the tagged ones by the tag.
    tagged = [r.name for r in report.saved if r.recompute_refused_code == "must_save"]
    assert tagged and all(r.producer in ("mm", "addmm") for r in report.saved if r.name in tagged), report.table()
    assert report.recomputed, report.table()
    assert not {r.name for r in report.recomputed} & set(tagged), report.table()
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)


class MutatedBias(nn.Module):
    """``addmm`` reads a buffer that the forward then updates in place. Its backward does not need
    the bias, so eager autograd is fine; recomputed in the backward, it would read the new bias."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, 4 * D) / 6)
        self.w2 = nn.Parameter(torch.randn(4 * D, 4 * D) / 12)
        self.w3 = nn.Parameter(torch.randn(4 * D, 4 * D) / 12)
        self.register_buffer("bias", torch.randn(4 * D))

    def forward(self, x):
        h = x @ self.w
        y = torch.addmm(self.bias, h, self.w2)
        self.bias.mul_(0.5)
        z = y.sin()
        for _ in range(3):
            z = torch.tanh(z @ self.w3)
        return z.mean() + h.mean()


@pytest.mark.parametrize("inner", INNERS)
def test_an_op_reading_a_buffer_the_forward_mutates_is_not_recomputed(inner, caplog):
    torch.manual_seed(0)
    model, x = MutatedBias(), (torch.randn(N, D),)
    backend = _backend(inner)
    with caplog.at_level("DEBUG", logger="fxoffload"):
        got = _run(model, x, backend)
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)
    (report,) = backend.reports
    assert "addmm" not in {r.name for r in report.recomputed}, report.table()
    # The refusal is kept on the decision, with its code. Since fxoffload.mutation tags such reads
    # MUST_SAVE before partitioning, that tag is what refuses it first; recompute.py's own check
    # (mutated_input) is the second line.
    (row,) = [r for r in report.saved if r.name == "addmm"]
    assert row.recompute_refused_code in ("must_save", "mutated_input"), row
    assert any(f"cannot recompute addmm: {row.recompute_refused}" in m for m in caplog.messages)


def test_recomputed_from_names_kept_tensors_of_the_final_graphs():
    """``recomputed_from`` lists the saved tensors the recomputation really reads in the final
    backward (through other recomputed ops): rows of the report, kept on the device, saying why."""
    torch.manual_seed(0)
    model, x = Stack(), (torch.randn(N, D),)
    backend = _backend()
    got = _run(model, x, backend)
    (report,) = backend.reports
    rows = {r.name: r for r in report.saved}
    saved_now = returned_names(report.fw_code)
    assert report.recomputed, report.table()
    for r in report.recomputed:
        sources = r.recomputed_from.split(", ")
        assert sources != [""], r
        for s in sources:
            assert s in rows and rows[s].decision == "keep", (r.name, s)
            assert s in saved_now or s.startswith("primals"), s
            assert r.name in rows[s].reason and "recomputed from it" in rows[s].reason, rows[s].reason
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)


def test_recomputation_that_misses_the_budget_gives_way_to_offloads(caplog):
    """At 0.47 the recomputed chain (mm then sin, both live in the backward, counted while each op
    runs) peaks above the budget on the new partition, also when planned again for a lower target,
    while offloads alone meet it: the pass compares the plans on the memory model and keeps the
    offloads."""
    torch.manual_seed(0)
    model, x = Stack(), (torch.randn(N, D),)
    backend = _backend(memory_budget=0.47)
    with caplog.at_level("INFO", logger="fxoffload"):
        got = _run(model, x, backend)
    (report,) = backend.reports
    again = [m for m in caplog.messages if "the new partition peaks at" in m]
    assert again and all("over the budget" in m and "planning again for" in m for m in again), caplog.messages
    (chosen,) = [m for m in caplog.messages if "plans tried for memory_budget" in m]
    assert f"of {len(again) + 2} plans tried" in chosen, chosen  # each partition, then offloads only
    assert not report.recomputed and report.offloaded
    assert report.predicted_peak_after <= report.memory_budget, report.summary()
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("inner", INNERS)
def test_a_failing_second_partition_falls_back_to_offloads(inner, caplog):
    torch.manual_seed(0)
    model, x = Stack(), (torch.randn(N, D),)
    calls = []
    original = _compat.call_partitioner

    def again_fails(name, joint, *args, **kwargs):  # the partition that carries out a recomputation
        again = any(n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE for n in joint.graph.nodes)
        calls.append(again)
        if again:
            raise RuntimeError("min-cut exploded")
        return original(name, joint, *args, **kwargs)

    backend = _backend(inner)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING", logger="fxoffload"):
        mp.setattr(_compat, "call_partitioner", again_fails)
        got = _run(model, x, backend)
    # Under Inductor the graph's code without offloading is lowered first (the budget's fraction).
    first = int(inner == "inductor" and _compat.can_lower_backward_at_compile())
    assert calls[first : first + 2] == [False, True], calls  # each plan (compile attempt): its partition, then again
    (report,) = backend.reports
    assert not report.recomputed and report.offloaded, report.table()
    assert report.predicted_recompute_ms == 0
    said = [m for m in caplog.messages if "partitioning again" in m]
    assert said and all("failed (min-cut exploded); offloading only" in m for m in said), said
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)


def test_the_report_describes_the_final_graphs_and_round_trips():
    torch.manual_seed(0)
    model, x = Stack(), (torch.randn(N, D),)
    backend = _backend()
    _run(model, x, backend)
    (report,) = backend.reports
    fw, bw = report.graphs
    assert report.recomputed, report.table()
    assert report.timings.repartition_s > 0  # the final graphs come from a second partition
    assert report.predicted_peak_after == simulate(fw, bw, report.num_fwd_outputs).peak_bytes
    assert report.predicted_peak_after < report.predicted_peak_before
    assert report.predicted_recompute_ms == pytest.approx(sum(r.recompute_ms for r in report.recomputed))
    back = OffloadReport.from_json(report.to_json())
    assert back == report and back.recomputed == report.recomputed
    assert all(r.recompute_ms > 0 and r.recomputed_from for r in back.recomputed)


@pytest.mark.parametrize("inner", INNERS)
def test_dynamic_shapes_with_a_budget(inner):
    torch.manual_seed(0)
    model = Stack()
    compiled_model = copy.deepcopy(model)
    backend = _backend(inner)
    fn = torch.compile(compiled_model, backend=backend, dynamic=True)
    for n in (N, N - 256):
        x = torch.randn(n, D)
        compiled_model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            fn(x).backward()
        eager = copy.deepcopy(model)
        eager(x).backward()
        for p, q in zip(compiled_model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    (report,) = backend.reports  # one graph for both sizes
    assert report.recomputed, report.table()


def test_autograd_grad_with_respect_to_the_input():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(N, D)
    backend = _backend()
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (got,) = torch.autograd.grad(torch.compile(model, backend=backend)(xc), xc)
    (expected,) = torch.autograd.grad(model(xe), xe)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-8)
    assert backend.reports[0].recomputed


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, 4 * D) / 6)
        self.w2 = nn.Parameter(torch.randn(4 * D, D) / 6)

    def forward(self, x):
        h = F.dropout(x @ self.w, 0.3, True)
        g = h.sin() @ self.w2
        return (g.sin() * F.dropout(g, 0.2, True)).mean()


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 4 * D, bias=False)
        self.bn = nn.BatchNorm1d(4 * D)
        self.b = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        return self.b(self.bn(self.a(x)).sin()).sin().mean()


@pytest.mark.parametrize("inner", INNERS)
def test_dropout_is_not_recomputed_and_masks_match(inner):
    torch.manual_seed(0)
    model, x = Dropped(), (torch.randn(N, D),)
    backend = _backend(inner)
    got = _run(model, x, backend)
    (report,) = backend.reports
    random = ("rand", "bernoulli", "native_dropout", "rand_like", "uniform")
    assert not [r for r in report.recomputed if r.producer in random]
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)
    if not report.recomputed:
        # Since copies and waits sit where Inductor keeps them (order edges, 2026-11), the simulated
        # peak of the recompute plan on this model no longer fits the budget and the pass keeps the
        # offload-only plan; the memory model's rework (issue 11) is where this is settled.
        pytest.xfail("the budget fit chose offloads only on this model: " + report.table())


def test_batchnorm_buffers_and_results_with_recomputation():
    torch.manual_seed(0)
    model, x = Normed(), torch.randn(N, D)
    compiled_model, eager = copy.deepcopy(model), copy.deepcopy(model)
    backend = _backend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.compile(compiled_model, backend=backend)(x).backward()
    eager(x).backward()
    assert backend.reports[0].recomputed, backend.reports[0].table()
    for (name, a), b in zip(compiled_model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("inner", INNERS)
def test_calibrate_with_dynamic_shapes_leaves_no_state_behind(inner):
    """Ops timed on made-up inputs while the graph compiles, with symbolic shapes: the caller's
    random state, grad mode and dispatch modes are as before, the step is eager's, and the plan is
    made from the timings. Which tensors the budget fit recomputes rather than offloads depends on
    those timings, which vary with the machine's load (a loaded machine offloaded 5 tensors and
    recomputed none); with no host memory to offload into, recomputing is the only way to the
    budget, so the recomputation runs under calibrate whatever the timings."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fxoffload.measure import standalone as cost

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(N, D)
    cost._timed_ops.clear()
    backend = _backend(inner, calibrate=True, host_budget=0)
    compiled_model = copy.deepcopy(model)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loss = torch.compile(compiled_model, backend=backend, dynamic=True)(x)
    after = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(4)), "compiling drew from the global generator"
    assert torch.is_grad_enabled() and loss.requires_grad
    assert not _get_current_dispatch_mode_stack()
    assert not isinstance(loss, torch._subclasses.FakeTensor)
    loss.backward()
    eager = copy.deepcopy(model)
    eager(x).backward()
    for p, q in zip(compiled_model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    (report,) = backend.reports
    assert "compute nodes timed (calibrate=True)" in report.device and cost._timed_ops
    assert report.recomputed and not report.offloaded, report.table()
