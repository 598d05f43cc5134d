"""Offloading never changes results: losses and gradients match eager and backend="inductor"."""

import copy

import pytest
import torch
import torch._inductor.config as inductor_config

import fxoffload
from fxoffload.testing.models import CNN, GPT, MLP, GPTConfig, gpt_batch

from .conftest import assert_same, cpu_backend, routed_tokens, train_step

INNERS = ["aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _eager_random():
    # Inductor draws random numbers with its own generator unless told to fall back to aten's;
    # with the fallback, dropout masks are identical in eager, inductor and fxoffload runs.
    with inductor_config.patch(fallback_random=True):
        yield


_references: dict = {}


def reference(name, model, args, backend=None):
    """Eager (``backend`` None) or ``"inductor"`` losses and gradients of two steps of the model
    ``name``, computed once per session: every test here builds its model and batch from seed 0,
    so the parametrized cases share one reference instead of compiling it again each."""
    key = (name, backend)
    if key not in _references:
        _references[key] = train_step(model, args, backend, steps=2)
    return _references[key]


@pytest.mark.parametrize("inner", INNERS)
def test_mlp(inner):
    torch.manual_seed(0)
    model, x = MLP(), (torch.randn(32, 64),)
    backend = cpu_backend(inner=inner)
    got = train_step(model, x, backend, steps=2)
    assert_same(got, reference("mlp", model, x))
    assert_same(got, reference("mlp", model, x, "inductor"))
    assert backend.reports and backend.reports[0].offloaded


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("policy", ["all", "auto"])
def test_gpt(inner, policy):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model, batch = GPT(cfg), gpt_batch(cfg, 4)
    backend = cpu_backend(inner=inner, policy=policy, op_time=0.0)  # auto's calls free: it offloads
    got = train_step(model, batch, backend, steps=2)
    assert_same(got, reference("gpt", model, batch, "inductor"), rtol=1e-4, atol=1e-5)
    assert_same(got, reference("gpt", model, batch), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    assert report.offloaded, report.table()
    if policy == "auto":
        # auto offloads only what the cost model predicts hidden (tests/test_planner.py varies the link).
        assert report.predicted_stall_ms < 1e-6


def test_gpt_dropout_is_active():
    """The parity above would be vacuous if dropout never fired: two seeds give two losses."""
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.5)
    model, batch = GPT(cfg), gpt_batch(cfg, 2)
    a, _ = train_step(model, batch, cpu_backend(inner="aot_eager"), seed=1)
    torch._dynamo.reset()
    b, _ = train_step(model, batch, cpu_backend(inner="aot_eager"), seed=2)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("inner", INNERS)
def test_cnn_batchnorm(inner):
    torch.manual_seed(0)
    model, batch = CNN(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    backend = cpu_backend(inner=inner)
    got = train_step(model, batch, backend, steps=2)
    assert_same(got, reference("cnn", model, batch), rtol=1e-4, atol=1e-5)
    assert_same(got, reference("cnn", model, batch, "inductor"), rtol=1e-4, atol=1e-5)
    # BatchNorm running stats are buffers mutated in place: they stay on the device and keep working.
    assert backend.reports[0].offloaded


@pytest.mark.parametrize("inner", INNERS)
def test_dynamic_shapes_two_batch_sizes(inner):
    torch.manual_seed(0)
    model = MLP()
    backend = cpu_backend(inner=inner)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for batch in (8, 24):
        x = torch.randn(batch, 64)
        model.zero_grad()
        compiled(x).backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        model(x).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)
    assert len(backend.reports) == 1, "one dynamic graph serves both batch sizes"
    assert backend.reports[0].offloaded


class GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = MLP(layers=2)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.b(x).relu() * x
        torch._dynamo.graph_break()
        return self.a(h)


@pytest.mark.parametrize("inner", INNERS)
def test_graph_break(inner):
    torch.manual_seed(0)
    model, x = GraphBreak(), (torch.randn(16, 64),)
    backend = cpu_backend(inner=inner)
    got = train_step(model, x, backend)
    assert_same(got, train_step(model, x))
    assert len(backend.reports) == 2
    assert all(r.offloaded for r in backend.reports)


@pytest.mark.parametrize("inner", INNERS)
def test_no_grad_inference_is_unchanged(inner):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 64)
    backend = cpu_backend(inner=inner)
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, model(x))
    assert backend.reports == [], "an inference graph saves nothing for backward: no plan, no rewrite"


def test_policy_none_is_pass_through():
    torch.manual_seed(0)
    model, x = MLP(), (torch.randn(8, 64),)
    backend = cpu_backend(policy="none", inner="aot_eager")
    assert_same(train_step(model, x, backend), train_step(model, x))
    (report,) = backend.reports
    assert report.offloaded == () and "fxoffload" not in report.graph_code()
    assert all(r.reason == "policy='none'" for r in report.saved)


def test_cpu_graph_unchanged_without_offload_cpu(caplog):
    torch.manual_seed(0)
    model, x = MLP(), (torch.randn(8, 64),)
    backend = fxoffload.backend(min_bytes=0, inner="aot_eager")
    with caplog.at_level("INFO", logger="fxoffload"):
        assert_same(train_step(model, x, backend), train_step(model, x))
    (report,) = backend.reports
    assert report.offloaded == ()
    assert "no accelerator tensors" in report.note
    assert any("no accelerator tensors" in r.getMessage() for r in caplog.records)


class ComplexProducts(torch.nn.Module):
    """Activations multiplied as complex numbers (RoPE written with ``view_as_complex``, spectral
    layers): the backward of a complex product saves the other factor as a lazy conjugate view."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 128)

    def forward(self, x, phase):
        h = self.fc(x)
        y = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2)) * phase
        return (torch.view_as_real(y * y).flatten(-2).sin() * h).sum()


@pytest.mark.parametrize("inner", INNERS)
def test_a_saved_lazy_conjugate_view_is_kept_and_the_rest_offloaded(inner):
    """Torch resolves a tensor's conjugate bit into a temporary for every op it is passed to,
    fxoffload's copy ops too: offloaded, the copy read a tensor freed as the offload returned (on a
    CPU the copy engine's check raised; on a GPU the allocator could reuse it mid-copy). Such a view
    is kept with its reason; the other saved tensors are offloaded and the results are Inductor's."""
    torch.manual_seed(0)
    model, args = ComplexProducts(), (torch.randn(64, 64), torch.polar(torch.ones(64, 64), torch.randn(64, 64)))
    backend = cpu_backend(inner=inner)
    got = train_step(model, args, backend, steps=2)
    assert_same(got, train_step(model, args, inner, steps=2), rtol=1e-5, atol=1e-6)
    assert_same(got, train_step(model, args, steps=2), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    # One conjugates an activation, the other an input (kept as a graph input, the rule before).
    conjugates = {r.reason_code for r in report.saved if r.producer == "_conj"}
    assert conjugates == {"lazy_view", "graph_input"}, report.table()
    assert report.offloaded, report.table()


@pytest.mark.parametrize("inner", INNERS)
def test_tensors_whose_sizes_depend_on_the_data_are_offloaded_with_inductors_results(inner):
    """Tensors sized by a ``torch.where`` (an unbacked size) are offloaded, the (tokens, 1) gate too:
    its host layout was chosen by comparing Inductor's layout, whose stride holds the count, with the
    traced one, and Inductor refused to compile the guard that asked whether the count was 1."""
    model, args, settings = routed_tokens()
    backend = cpu_backend(inner=inner)
    with settings:
        got = train_step(model, args, backend, steps=2)
        assert_same(got, train_step(model, args, "inductor", steps=2), rtol=1e-5, atol=1e-6)
        assert_same(got, train_step(model, args, steps=2), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    routed = [r for r in report.offloaded if r.data_dependent_dims == (0,)]
    assert any(r.shape[1:] == (1,) for r in routed) and any(r.shape[1:] == (64,) for r in routed), report.table()


@pytest.mark.parametrize("options", [{}, {"memory_budget": 0.5}], ids=["verify_peak", "memory_budget"])
def test_backward_retaining_the_graph_runs_where_inductor_does(options):
    """verify_peak and memory_budget lower the backward while the forward compiles; with donated
    buffers AOTAutograd would then refuse ``backward(retain_graph=True)``, which ``backend="inductor"``
    (lowering at the first backward) runs. Found by the fuzz (bench/fuzz_repros)."""
    torch.manual_seed(0)
    model, x = MLP(layers=2), torch.randn(64, 64)

    def grads(backend):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        fn = m if backend is None else torch.compile(m, backend=backend)
        loss = fn(x).square().mean()
        loss.backward(retain_graph=True)  # two backwards through one graph (two losses, a GAN step)
        loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    backend = fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", **options)
    got, eager = grads(backend), grads(None)
    assert backend.reports and backend.reports[0].offloaded, backend.reports[0].table()
    for name in eager:
        torch.testing.assert_close(got[name], eager[name], msg=name)
    assert_same((torch.zeros(1), got), (torch.zeros(1), grads("inductor")), rtol=1e-5, atol=1e-6)
