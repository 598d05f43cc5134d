"""Donated buffers in a backward lowered with its forward (``fxoffload._compat.donated``).

A plan judged on its code (``verify_peak``, ``memory_budget``) has its backward lowered while the
forward compiles. It keeps the donated buffers Inductor's own backward has (the logits' gradient
written into the saved logits), never donates a host copy nor a saved tensor whose storage another
shares, and a backward that keeps the graph (``retain_graph=True``) runs its FX graph instead of
code that overwrites what the next one reads.
"""

import copy
import re

import pytest
import torch
from torch._functorch import config as functorch_config

import fxoffload
from fxoffload import _compat
from fxoffload._compat import donated
from fxoffload.compiler import compile as compile_module
from fxoffload.compiler.lowering import host_placeholders
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

from .conftest import measured_steady_step, through_inductors_cache

# The blocks' saved tensors offloaded; the logits (the LM head's ``mm``) kept for the backward.
OPTIONS = {"offload_cpu": True, "min_bytes": 0, "policy": "auto", "offload_modules": ("blocks.*",)}
CFG = GPTConfig(vocab=2048, layers=2, dropout=0.0)  # logits (2 MiB) the largest tensor
_REUSE = re.compile(r"^\s*buf\d+ = (\w+); del \1  # reuse$", re.M)


def _model_and_batch():
    torch.manual_seed(0)
    return GPT(CFG), gpt_batch(CFG, 4)


def _reused_saved(report) -> set[str]:
    """The backward's arguments (saved tensors) whose buffers its code writes a result into."""
    return {name for name in _REUSE.findall(report.output_code["backward"]) if not name.startswith("buf")}


def _step(model, batch, backend):
    compiled = torch.compile(model, backend=backend)

    def step():
        compiled(*batch).backward()

    return step


def _judged(donate: bool):
    """The step's measured peak and its report, with donated buffers on or off (torch's config)."""
    torch._dynamo.reset()
    model, batch = _model_and_batch()
    backend = fxoffload.backend(**OPTIONS)
    with functorch_config.patch(donated_buffer=donate):
        measured, _ = measured_steady_step(model, _step(model, batch, backend))
    (report,) = backend.reports
    assert report.offloaded and report.timings.compiles == 1, report.timings.spent  # judged, lowered early
    assert measured == pytest.approx(report.compiled_memory().peak_bytes - report.start_bytes, rel=0.01)
    return measured, report


def test_a_judged_backward_writes_the_logits_gradient_into_the_saved_logits():
    """As Inductor's own backward does: the code's backward peaks lower than the same plan's without
    donated buffers (the rule broken on purpose) by more than half the logits (the gradient's buffer;
    other buffers move too), and the step measures what the code replays."""
    logits = 4 * CFG.seq * CFG.vocab * 4  # fp32, batch 4
    _, report = _judged(True)
    assert "mm" in _reused_saved(report), _reused_saved(report)  # the saved logits
    _, broken = _judged(False)
    assert not _reused_saved(broken)
    with_donation, without = (r.compiled_memory().phase_peak("backward") for r in (report, broken))
    assert without > with_donation + logits // 2, (without, with_donation)


def _grads_twice(model, batch, backend, steps=1):
    """Gradients of ``steps`` steps, each two backwards through one graph (two losses, a GAN step)."""
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    fn = m if backend is None else torch.compile(m, backend=backend)
    for _ in range(steps):
        m.zero_grad(set_to_none=True)
        loss = fn(*batch)
        loss.backward(retain_graph=True)
        loss.backward()
    return {n: p.grad for n, p in m.named_parameters()}


def test_a_backward_keeping_the_graph_runs_its_fx_graph(monkeypatch):
    """Inductor's code writes into the saved logits; a second backward through the graph would read
    its own gradient there. Kept graphs run the FX graph (said once), on every step, also after a
    step that did not keep it (where Inductor's lazily lowered backward would refuse)."""
    model, batch = _model_and_batch()
    eager = _grads_twice(model, batch, None)
    backend = fxoffload.backend(**OPTIONS)
    with pytest.warns(UserWarning, match=r"retain_graph=True.*runs eagerly"):
        got = _grads_twice(model, batch, backend, steps=2)
    assert "mm" in _reused_saved(backend.reports[0])
    for name in eager:
        torch.testing.assert_close(got[name], eager[name], msg=name)
    # The rule broken on purpose: the donated code runs for both backwards.
    monkeypatch.setattr(donated, "_eager_when_graph_kept", lambda compiled, graph: compiled)
    broken = _grads_twice(model, batch, fxoffload.backend(**OPTIONS))
    assert not all(torch.allclose(broken[n], eager[n], rtol=1e-4, atol=1e-6) for n in eager)


def test_host_copies_are_never_donated(monkeypatch):
    """AOTAutograd offers the host copies a backward reads for Inductor's buffers (on a CPU they are
    CPU tensors like the rest); none is given, and, the rule broken on purpose, they would be."""
    seen = []
    original = _compat.lowering_backward

    def spy(graph, not_donated):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        names = [n.name for n in graph.graph.find_nodes(op="placeholder")]
        offered = {names[i] for i in meta.bw_donated_idxs or ()}
        finish = original(graph, not_donated)
        given = {names[i] for i in meta.bw_donated_idxs or ()}
        seen.append((offered, given, host_placeholders(graph)))
        return finish

    monkeypatch.setattr(_compat, "lowering_backward", spy)
    model, batch = _model_and_batch()
    _step(model, batch, fxoffload.backend(**OPTIONS))()
    ((offered, given, host),) = seen
    assert host and offered & host, (offered, host)
    assert "mm" in given and not given & host, (given, host)
    monkeypatch.setattr(compile_module, "host_placeholders", lambda graph: frozenset())
    seen.clear()
    _step(model, batch, fxoffload.backend(**OPTIONS))()
    ((_, given, host),) = seen
    assert given & host


def _cached_step(monkeypatch, donate: bool, fixed_key: str | None = None):
    """Reused saved tensors and Inductor's FX graph cache hits of one step, through the cache
    (``through_inductors_cache``). ``fixed_key``: the donated buffers' key replaced by one that
    ignores them (the rule broken on purpose)."""
    with through_inductors_cache(monkeypatch) as hits, monkeypatch.context() as m:
        if fixed_key is not None:
            m.setattr(donated, "_cache_key", lambda idxs: {"post_grad_custom_post_pass": donated._DonatedKey((fixed_key,))})
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = GPTConfig(vocab=2048, layers=1, dropout=0.0)
        backend = fxoffload.backend(**OPTIONS)
        with functorch_config.patch(donated_buffer=donate):
            torch.compile(GPT(cfg), backend=backend)(*gpt_batch(cfg, 4)).backward()
        found = _REUSE.findall(backend.reports[0].output_code["backward"])
        return sorted({n for n in found if not n.startswith("buf")}), hits()


def test_donated_buffers_are_in_inductors_cache_key(monkeypatch):
    """Inductor's FX graph cache keys a backward on its graph, not on its donated buffers: a process
    lowering the backward without them got, from the cache, code that writes into the saved logits.
    With the buffers in the key (``donated._cache_key``) it gets its own; the rule broken on purpose
    (a key that ignores them, fresh to this run), the cached code comes back."""
    import uuid

    assert _cached_step(monkeypatch, donate=True)[0] == ["mm"]
    assert _cached_step(monkeypatch, donate=False)[0] == []
    fixed = uuid.uuid4().hex
    reused, forward_hits = _cached_step(monkeypatch, donate=True, fixed_key=fixed)  # its forward may hit
    assert reused == ["mm"]
    reused, hits = _cached_step(monkeypatch, donate=False, fixed_key=fixed)
    assert hits == forward_hits + 1 and reused == ["mm"], (reused, hits, forward_hits)


def _aliasing_case(monkeypatch, broken: bool):
    """A fuzz model (seed 31, case 23, three of its blocks: a ReLU, a transposed mix, a bf16 matmul
    chain) under torch's default partitioner, which saves the ReLU's output and its transpose (one
    storage): its parameter gradients and input gradient with fxoffload (``policy="all"``) and in
    eager, and the backward's code. ``broken``: the rule that never donates a placeholder sharing
    its storage removed."""
    import dataclasses

    from bench import fuzz

    if broken:
        monkeypatch.setattr(donated, "_sharing_storage", lambda placeholders: frozenset())
    case = fuzz.make_case(31, 23)
    case = dataclasses.replace(case, blocks=tuple(case.blocks[i] for i in (2, 3, 5)))
    backend = fxoffload.backend(inner="inductor", **fuzz.OPTION_SETS["all-default-part"])
    offloaded = fuzz.train(case, backend, steps=1).tensors
    eager = fuzz.train(case, None, steps=1).tensors
    (pair,) = backend._register.pairs()
    grads = [k for k in eager if ".grad." in k or "input_grad" in k]
    return {k: (offloaded[k], eager[k]) for k in grads}, pair


def test_saved_tensors_sharing_a_storage_are_never_donated(monkeypatch):
    """Two saved tensors of one storage (an activation and its transpose) are both donated by
    AOTAutograd; Inductor wrote the input gradient in place of one while the same kernel read the
    other, and the transposed mix's weight ``s`` got a gradient near zero (``bench.fuzz --seed 31
    --case 23 --options all-default-part``). Neither is donated: the code writes into neither and
    every gradient is eager's; the rule broken on purpose, the code reuses one and ``s`` is wrong."""
    grads, pair = _aliasing_case(monkeypatch, broken=False)
    shared = donated._sharing_storage(list(pair.bw.graph.find_nodes(op="placeholder")))
    assert len(shared) >= 2, shared
    assert not (set(_REUSE.findall(pair.output_code["backward"])) & shared)
    for name, (got, want) in grads.items():
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4, msg=name)
    grads, pair = _aliasing_case(monkeypatch, broken=True)
    assert set(_REUSE.findall(pair.output_code["backward"])) & shared
    s = next(k for k in grads if k.endswith("blocks.1.s"))
    got, want = grads[s]
    assert not torch.allclose(got, want, rtol=2e-2, atol=1e-4)
