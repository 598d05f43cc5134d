"""fxoffload composed with what training code uses: activation checkpointing, autocast, dynamic
shapes, graph breaks, ``torch.autograd.grad``, compile modes, and models that mutate tensors in place.

Every parity test offloads for real (``offload_cpu=True, policy="all", min_bytes=0``) and checks that
it did; the references are eager and the same compile without fxoffload.
"""

import copy
import re

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import fxoffload
from fxoffload import _compat
from fxoffload.testing.models import GPT, MLP, GPTConfig, gpt_batch

from .conftest import assert_same, cpu_backend, train_step

INNERS = ["aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _eager_random():
    with inductor_config.patch(fallback_random=True):
        yield


def _offloaded(backend) -> int:
    return sum(len(r.offloaded) for r in backend.reports)


def _parity(model, args, inner, steps=2, rtol=1e-5, atol=1e-5):
    """fxoffload against eager and against the same inner compiler without fxoffload."""
    backend = cpu_backend(inner=inner)
    got = train_step(model, args, backend, steps=steps)
    assert_same(got, train_step(model, args, steps=steps), rtol=rtol, atol=atol)
    torch._dynamo.reset()
    assert_same(got, train_step(model, args, inner, steps=steps), rtol=rtol, atol=atol)
    assert _offloaded(backend) > 0, backend.reports[0].table()
    return backend


# --- activation checkpointing ----------------------------------------------------------------------


class Checkpointed(nn.Module):
    """Every other residual block runs under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, use_checkpoint: bool = True) -> None:
        super().__init__()
        self.mlp = MLP(layers=2)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for i, layer in enumerate(self.mlp.layers):
            if self.use_checkpoint and i % 2 == 0:
                x = x + checkpoint(layer, x, use_reentrant=False)
            else:
                x = x + layer(x)
        return x.square().mean()


@pytest.mark.parametrize("inner", INNERS)
def test_checkpoint_regions(inner):
    torch.manual_seed(0)
    x = (torch.randn(16, 64),)
    model = Checkpointed()
    backend = _parity(model, x, inner)
    # The checkpointed blocks' activations are recomputed, not saved: fewer saved tensors than the
    # same model without checkpointing, and fxoffload offloads among what is left.
    torch._dynamo.reset()
    plain = cpu_backend(inner=inner)
    train_step(Checkpointed(use_checkpoint=False), x, plain)
    (with_ckpt,), (without,) = backend.reports, plain.reports
    activations = [sum(r.nbytes for r in rep.saved if r.producer != "placeholder") for rep in (with_ckpt, without)]
    assert activations[0] < activations[1], activations
    assert 0 < with_ckpt.offloaded_bytes < without.offloaded_bytes


# --- autocast --------------------------------------------------------------------------------------


def _autocast_step(model, batch, backend):
    model = copy.deepcopy(model)
    fn = model if backend is None else torch.compile(model, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(*batch)
    loss.backward()
    return loss.detach().float()[None], {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("inner", INNERS)
def test_autocast_bf16_cpu(inner):
    torch.manual_seed(0)
    model, x = MLP(layers=1), (torch.randn(32, 64),)
    backend = cpu_backend(inner=inner)
    got = _autocast_step(model, x, backend)
    rows = backend.reports[0].offloaded
    assert any(r.dtype == "bfloat16" for r in rows), backend.reports[0].table()
    torch._dynamo.reset()
    # bf16 rounding depends on fusion: the same compiler is the tight reference, eager a loose one.
    assert_same(got, _autocast_step(model, x, inner), rtol=1e-5, atol=1e-6)
    assert_same(got, _autocast_step(model, x, None), rtol=2e-2, atol=2e-3)


def test_autocast_bf16_cpu_gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 2)
    backend = cpu_backend(inner="aot_eager")
    got = _autocast_step(model, batch, backend)
    assert any(r.dtype == "bfloat16" for r in backend.reports[0].offloaded)
    torch._dynamo.reset()
    assert_same(got, _autocast_step(model, batch, "aot_eager"), rtol=0, atol=0)
    assert_same(got, _autocast_step(model, batch, None), rtol=2e-2, atol=2e-3)


# --- dynamic shapes --------------------------------------------------------------------------------

SEQ_LENGTHS = (16, 24, 40, 33)


@pytest.mark.parametrize("dynamic", [True, None])
def test_dynamic_sequence_lengths_compile_once(dynamic):
    """dynamic=True: one graph for every length; dynamic=None (the default): a static graph for the
    first length, then one dynamic graph for all the others. Never one per length."""
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0)
    model = GPT(cfg)
    compiled_model = copy.deepcopy(model)
    backend = cpu_backend(inner="aot_eager")
    compiled = torch.compile(compiled_model, backend=backend, dynamic=dynamic)
    counters.clear()
    for seq in SEQ_LENGTHS:
        batch = gpt_batch(cfg, 2, seq=seq)
        compiled_model.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(compiled(*batch), model(*batch))
        compiled(*batch).backward()
        model(*batch).backward()
        for (name, a), b in zip(compiled_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=f"seq={seq} {name}")
    expected = 1 if dynamic else 2
    assert len(backend.reports) == expected
    assert counters["stats"]["unique_graphs"] == expected
    assert all(r.offloaded for r in backend.reports)
    # Sizes are symbolic: the plan used the size hints of the length that compiled it.
    last = backend.reports[-1]
    assert any(SEQ_LENGTHS[expected - 1] in r.shape for r in last.offloaded), last.table()


def test_dynamic_lengths_mark_dynamic_host_pool_bounded():
    """mark_dynamic on the batch dimension, a new length nearly every step (ascending: the worst
    case for reuse). The host pool stays within twice the most bytes one step had in use, instead
    of keeping buffers for every length it has seen."""
    torch.manual_seed(0)
    fxoffload.release_host_memory()
    model = MLP()
    backend = cpu_backend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    in_use, pooled = [], []
    for rows in (9, 12, 17, 24, 31, 33, 40, 48, 50, 63, 64, 20, 64, 64):
        x = torch.randn(rows, 64)
        torch._dynamo.mark_dynamic(x, 0)
        loss = compiled(x)
        in_use.append(fxoffload.host_pool_stats().bytes_in_use)  # the step's host copies
        loss.backward()
        pooled.append(fxoffload.host_pool_stats().bytes_allocated)
    assert len(backend.reports) == 1 and backend.reports[0].offloaded
    assert min(in_use) > 0
    assert max(pooled) <= 2 * max(in_use), (pooled, in_use)
    assert pooled[-1] == pooled[-2], "a repeated length allocates nothing"


# --- graph breaks ----------------------------------------------------------------------------------


class DataDependentBreak(nn.Module):
    """A data-dependent branch (``.item()``) splits the graph; saved tensors on both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.a = MLP(layers=2)
        self.b = MLP(layers=2)

    def forward(self, x):
        h = x
        for layer in self.a.layers:
            h = h + layer(h)
        if h.mean().item() > 0:  # graph break
            h = h * 2
        for layer in self.b.layers:
            h = h + layer(h)
        return h.square().mean()


def test_data_dependent_graph_break():
    torch.manual_seed(0)
    model, x = DataDependentBreak(), (torch.randn(16, 64),)
    backend = _parity(model, x, "aot_eager")
    assert len(backend.reports) >= 2 and all(r.offloaded for r in backend.reports)


# --- torch.autograd.grad ---------------------------------------------------------------------------


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = MLP(layers=2)
        self.head = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))

    def features(self, x):
        for layer in self.body.layers:
            x = x + layer(x)
        return x


def _attribution(model, x, body, head):
    """Saliency and feature attribution: d(top class score)/d(input) and /d(features)."""
    x = x.clone().requires_grad_()
    feats = body(x)
    logits = head(torch.tanh(feats))
    score = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    return torch.autograd.grad(score, [x, feats])


@pytest.mark.parametrize("inner", INNERS)
def test_autograd_grad_wrt_inputs_and_intermediates(inner):
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(8, 64)
    expected = _attribution(model, x, model.features, model.head)
    backend = cpu_backend(inner=inner)
    body = torch.compile(model.features, backend=backend)
    head = torch.compile(model.head, backend=backend)
    got = _attribution(model, x, body, head)
    torch._dynamo.reset()
    reference = _attribution(model, x, torch.compile(model.features, backend=inner),
                             torch.compile(model.head, backend=inner))  # fmt: skip
    for g, e, r in zip(got, expected, reference):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters()), "autograd.grad must not touch .grad"
    assert _offloaded(backend) > 0


def test_double_backward_fails_as_without_fxoffload():
    """AOTAutograd has no double backward; fxoffload raises the same error as aot_eager."""
    torch.manual_seed(0)
    messages = []
    for backend in ("aot_eager", cpu_backend(inner="aot_eager")):
        torch._dynamo.reset()
        fn = torch.compile(MLP(), backend=backend)
        x = torch.randn(8, 64, requires_grad=True)
        with pytest.raises(RuntimeError) as info:
            (g,) = torch.autograd.grad(fn(x), x, create_graph=True)
            g.square().sum().backward()
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert "does not currently support double backward" in messages[0]


# --- compile modes ---------------------------------------------------------------------------------


@pytest.fixture
def inductor_patches(monkeypatch):
    """Records the Inductor config patches of every compile and runs the graphs eagerly instead."""
    seen = []

    def spy(gm, example_inputs, partitioner, config_patches, on_output_code=None, code_only=False, after_backward=None,
            graph_patches=None, not_donated=None, join_runs=None, output_strides=None, backward_groups=None):
        seen.append(dict(config_patches))
        return _compat.compile_with_aot_eager(gm, example_inputs, partitioner)

    monkeypatch.setattr(_compat, "compile_with_inductor", spy)
    return seen


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"])
def test_mode_is_passed_to_inductor(inductor_patches, mode):
    from torch._inductor import list_mode_options

    torch.manual_seed(0)
    x = torch.randn(8, 64)
    backend = cpu_backend()
    torch.compile(MLP(), backend=backend, mode=mode)(x).backward()
    torch._dynamo.reset()
    torch.compile(MLP(), backend="fxoffload", mode=mode, options=None)(x).backward()
    # Every Inductor compile of both backends (a plan that changes nothing compiles once more, as
    # Inductor does) gets the mode's options.
    assert len(inductor_patches) >= 2 and all(p == list_mode_options(mode) for p in inductor_patches), inductor_patches
    (report,) = backend.reports
    if list_mode_options(mode).get("triton.cudagraphs"):
        assert report.offloaded == () and "CUDA graphs are on" in report.note
    else:
        assert report.offloaded and report.note == ""


def test_reduce_overhead_turns_offloading_off_with_reason():
    """Real Inductor: the graph compiles and trains as without fxoffload, nothing is offloaded."""
    torch.manual_seed(0)
    model, x = MLP(dim=32, hidden=64, layers=1), (torch.randn(8, 32),)
    backend = cpu_backend()
    compiled_model = copy.deepcopy(model)
    fn = torch.compile(compiled_model, backend=backend, mode="reduce-overhead")
    for _ in range(2):
        compiled_model.zero_grad(set_to_none=True)
        loss = fn(*x)
        loss.backward()
    expected = train_step(model, x)
    torch.testing.assert_close(loss.detach()[None], expected[0])
    for name, p in compiled_model.named_parameters():
        torch.testing.assert_close(p.grad, expected[1][name], rtol=1e-5, atol=1e-6)
    (report,) = backend.reports
    assert report.offloaded == ()
    assert "CUDA graphs are on (mode='reduce-overhead')" in report.note
    assert all("CUDA graphs" in r.reason for r in report.saved)
    assert "fxoffload" not in report.fw_code + report.bw_code


# --- in-place mutation -----------------------------------------------------------------------------


class InPlace(nn.Module):
    """The valid ways a forward mutates tensors that are, or become, saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 256)
        self.l2 = nn.Linear(256, 256)
        self.l3 = nn.Linear(256, 64)
        self.register_buffer("running_mean", torch.zeros(256))  # updated like BatchNorm's
        self.register_buffer("hits", torch.zeros(256))

    def forward(self, x, idx):
        x.mul_(0.5)  # a graph input mutated before it is saved (l1's weight gradient needs it)
        h = self.l1(x)
        h[:, 0] = 1.0  # a slice written: l1's backward needs x, not h
        h = torch.relu_(h)  # relu_ saves its own (mutated) output, and so does l2
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * h.mean(0))
        g = self.l2(h)
        g.index_put_((idx,), torch.ones(idx.numel(), 256), accumulate=True)  # rows hit twice
        self.hits.index_put_((torch.arange(256),), torch.ones(256), accumulate=True)
        s = torch.sigmoid(g)  # saves its output s
        g.mul_(0)  # g is not saved by anyone: mutating it after sigmoid read it is valid
        return (self.l3(s) + g[:, :64]).square().mean()


def _mutation_step(model, x, idx, backend):
    model = copy.deepcopy(model)
    x = x.clone()
    fn = model if backend is None else torch.compile(model, backend=backend)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = fn(x, idx)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach()[None], {**grads, **dict(model.named_buffers()), "input": x}


@pytest.mark.parametrize("inner", INNERS)
def test_in_place_mutations_keep_semantics(inner):
    torch.manual_seed(0)
    model, x, idx = InPlace(), torch.randn(16, 64), torch.tensor([1, 3, 3, 7])
    backend = cpu_backend(inner=inner)
    got = _mutation_step(model, x, idx, backend)
    assert_same(got, _mutation_step(model, x, idx, None))
    torch._dynamo.reset()
    assert_same(got, _mutation_step(model, x, idx, inner))
    (report,) = backend.reports
    assert report.offloaded, report.table()
    # The graph saves the input's new value (x * 0.5), a tensor of its own that is copied into the
    # caller's x in the forward: it is offloaded like any activation, and x is still updated.
    new_x = re.search(r"aten\.copy_\.default\(primals_1, (\w+)\)", report.fw_code).group(1)
    (row,) = [r for r in report.saved if r.name == new_x]
    assert row.shape == (16, 64) and row.decision == "offload", report.table()
    assert torch.equal(got[1]["hits"], torch.full((256,), 2.0))


class MutatesSaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(32, 32)

    def forward(self, x):
        h = self.l(x)
        y = h.sin()  # saves h
        h.mul_(2)  # invalid: h is needed by sin's backward
        return (y * h).sum()


def test_mutating_a_saved_tensor_raises_like_eager():
    torch.manual_seed(0)
    model, x = MutatesSaved(), torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).backward()
    with pytest.raises(Exception, match="modified by an inplace operation"):
        torch.compile(model, backend=cpu_backend(inner="aot_eager"))(x).backward()
