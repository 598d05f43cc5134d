"""The compile called on a roomy stretch of the interpreter's frame stack (``compiler.lowering``):
a hot call on a chunk boundary maps and unmaps 16 KiB at every call; under ``on_roomy_stack`` no
depth does. Page faults counted with ``resource`` (Linux, CPython 3.11+), not timed."""

import sys

import pytest
import torch

import fxoffload
from fxoffload.compiler import lowering
from fxoffload.compiler.lowering import has_chunked_frames, on_roomy_stack
from fxoffload.testing.models import example

resource = pytest.importorskip("resource")


def _leaf():
    return 1


def _faults_at_depth(depth: int, calls: int) -> int:
    """Minor page faults of ``calls`` calls of a leaf made ``depth`` frames down."""
    if depth:
        return _faults_at_depth(depth - 1, calls)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        _leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start


def _thrashing_depths(call, depths=range(0, 300), calls=2000):
    return [d for d in depths if call(_faults_at_depth, d, calls) >= calls]


@pytest.mark.skipif(not has_chunked_frames() or not sys.platform.startswith("linux"), reason="CPython 3.11+ on Linux")
def test_no_depth_thrashes_on_the_roomy_stack():
    """Plainly called, some depth puts the leaf's frame at the start of a chunk: one page fault or
    more per call (the chunk mapped and unmapped each time). Called on the roomy stack, none does."""
    plain = _thrashing_depths(lambda fn, *args: fn(*args))
    assert plain, "no depth thrashed: this interpreter frees no frame chunk per call"
    assert _thrashing_depths(on_roomy_stack) == []


def test_on_roomy_stack_is_a_call():
    """Arguments in, the result out, an exception through, the frame's slots untouched."""
    assert on_roomy_stack(divmod, 7, 2) == (3, 1)
    assert on_roomy_stack(dict, a=1) == {"a": 1}
    with pytest.raises(ZeroDivisionError):
        on_roomy_stack(divmod, 1, 0)
    if has_chunked_frames():
        assert lowering._roomy_caller().__code__.co_nlocals >= lowering.ROOMY_SLOTS


def test_inductor_compiles_on_the_roomy_stack(monkeypatch):
    """Every Inductor compile of the backend runs below the roomy frame (taken away, this fails)."""
    from fxoffload import _compat

    seen = []
    original = _compat.compile_with_inductor

    def spying(*args, **kwargs):
        frame, names = sys._getframe(), []
        while frame is not None:
            names.append(frame.f_code.co_filename)
            frame = frame.f_back
        seen.append("<fxoffload roomy frame>" in names)
        return original(*args, **kwargs)

    monkeypatch.setattr(_compat, "compile_with_inductor", spying)
    torch._dynamo.reset()
    model, batch = example("mlp")
    torch.compile(model, backend=fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0))(*batch).backward()
    assert seen and all(seen) == has_chunked_frames(), seen


def test_only_a_graph_that_copies_is_lowered_without_pool_reuse():
    """The config each graph is lowered with: no pool reuse where a transfer op is in it, Inductor's
    own config everywhere else (a scatter too: its readers keep their dependency on it instead,
    ``_compat.scheduler_runs.keeping_mutation_renames``)."""
    from fxoffload import ir
    from fxoffload.compiler.lowering import lowering_config

    plain = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    assert lowering_config(plain) == {}
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    host = graph.call_function(ir.OFFLOAD, (x, [], 0.0, ir.transfer_name(0, "x")))
    idx = graph.placeholder("idx")
    graph.call_function(torch.ops.aten.index_put.default, (x, [idx], x, True))
    graph.output(graph.call_function(ir.WAIT, (host, x, [])))
    assert lowering_config(torch.fx.GraphModule({}, graph)) == {"allow_buffer_reuse": False}


def _budget_plan_peaks():
    """The tiny GPT under ``memory_budget=0.5``: its plan's code peak and the FX model's."""
    from bench.workloads import build

    torch._dynamo.reset()
    w = build("gpt", "tiny", "cpu")
    # At 0.01 GB/s nothing hides: the budget alone decides what is offloaded, whatever the machine.
    backend = fxoffload.backend(memory_budget=0.5, offload_cpu=True, min_bytes=0, bandwidth="0.01GB")
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(w.model, backend=backend)(*w.batch).backward()
    (report,) = backend.reports
    assert report.offloaded
    return report.compiled_memory().peak_bytes, report.memory_after.peak_bytes


def test_an_offloaded_buffer_is_not_kept_for_a_later_allocation(monkeypatch):
    """Inductor keeps a freed buffer for a later allocation of its size where its own peak estimate
    allows, and that estimate counts the host copies as device bytes: an offloaded MLP output was
    held from its wait to the next block's. Lowered without pool reuse, the plan's code peaks where
    the FX model says; with Inductor's reuse (the rule taken away) 8% higher."""
    from fxoffload.compiler import compile as compile_module

    code, model = _budget_plan_peaks()
    assert code == pytest.approx(model, rel=0.01)
    monkeypatch.setattr(compile_module, "lowering_config", lambda graph: {})
    reused, _ = _budget_plan_peaks()
    assert reused > 1.05 * code, (reused, code)
