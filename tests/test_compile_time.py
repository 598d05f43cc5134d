"""What compiling costs (issue 23, part 5): Inductor lowers and builds each graph no more often than
the plan needs. A graph lowered to judge it alone is stopped once its code exists (no kernels
built); a plan that changes nothing is lowered once, as ``backend="inductor"`` lowers it.

Counted, not timed: ``GraphLowering.codegen`` runs once per graph Inductor lowers, and
``PyCodeCache.load_by_key_path`` once per module it loads (on a CPU, where its C++ kernels are
compiled). Inductor's FX graph cache is off here, so a warm cache changes no count.
"""

import collections
import copy

import pytest
import torch
from torch._inductor import codecache
from torch._inductor.graph import GraphLowering

import fxoffload
from fxoffload import _compat
from fxoffload.analysis.memory import MemoryPoint, MemoryTimeline
from fxoffload.compiler import compile as compile_module
from fxoffload.compiler import verify as verify_module
from fxoffload.compiler.compile import GraphCompiler
from fxoffload.compiler.dynamo_graph import copy_graph_module
from fxoffload.compiler.pair import PairRegister
from fxoffload.compiler.partitioner import OffloadPartitioner
from fxoffload.compiler.verify import MODEL_AGREEMENT, MODEL_MARGIN, checked_model_floor, unchanged_floor
from fxoffload.options import OffloadOptions
from fxoffload.testing.models import example

pytestmark = pytest.mark.skipif(
    not _compat.can_lower_backward_at_compile(), reason="needs functorch's force_non_lazy_backward_lowering"
)


STOPPED = "the plan, stopped before lowering: it changes nothing"
AS_INDUCTOR = "without offloading, as Inductor compiles it"
VERIFY = "verify_peak: the code without offloading, not built"
VERIFY_INSIDE = "verify_peak: the forward without offloading, in the plan's compile, not built"


@pytest.fixture
def counted(monkeypatch):
    """Counts of Inductor's lowerings ("codegen") and module loads ("load"), its FX graph cache off."""
    counts = collections.Counter()
    for owner, name, key in ((GraphLowering, "codegen", "codegen"), (codecache.PyCodeCache, "load_by_key_path", "load")):
        original = getattr(owner, name)

        def counting(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield counts


@pytest.fixture
def judged_on_code(monkeypatch):
    """The FX model never stands in for the unchanged code (``checked_model_floor``): on ``_Probe``
    it agrees with the plan's code and puts the unchanged code 1.4% above it, enough to settle
    ``verify_peak`` alone; these tests are about the code lowered when it does not."""
    monkeypatch.setattr(verify_module, "checked_model_floor", lambda *args: None)


def _one_step(backend, name="mlp"):
    torch.manual_seed(0)
    model, batch = example(name)
    torch.compile(model, backend=backend)(*batch).backward()
    return model


def test_a_graph_compiled_for_its_code_builds_no_kernels(counted):
    """``code_only``: both graphs' wrapper code arrives, no module is loaded, and what is returned
    refuses to run rather than run nothing."""
    torch.manual_seed(0)
    model, (x,) = example("mlp")
    gm = torch.fx.symbolic_trace(model)  # not Dynamo's graph: its inputs are not static, no matter here
    partitioner = OffloadPartitioner(PairRegister(), OffloadOptions(policy="none"))
    code = {}
    with _compat.backward_lowered_at_compile():
        compiled = _compat.compile_with_inductor(gm, [x], partitioner, {}, code.__setitem__, code_only=True)
    assert set(code) == {"forward", "backward"} and all("def call(" in c for c in code.values())
    assert counted == {"codegen": 2}, counted
    with pytest.raises(RuntimeError, match="compiled for its code only"):
        compiled(x)
    with pytest.raises(ValueError, match="code_only=True.*needs on_output_code"):  # the code would go nowhere
        _compat.compile_with_inductor(gm, [x], partitioner, {}, code_only=True)


def test_a_plan_that_changes_nothing_is_lowered_once(counted):
    """Nothing worth offloading (``min_bytes`` above every tensor): the compile that would lower both
    graphs to judge the plan stops before Inductor lowers anything, and the graph is compiled as
    Inductor compiles it: forward now, backward at its first call, each lowered and built once.
    (Judged first, it was lowered twice: four lowerings, four loads.)"""
    backend = fxoffload.backend(offload_cpu=True, policy="auto", min_bytes="1GiB")
    _one_step(backend)
    (report,) = backend.reports
    assert not report.offloaded
    assert counted == {"codegen": 2, "load": 2}, counted
    assert report.timings.compiles == 1
    assert set(report.output_code) == {"forward", "backward"}  # Inductor's code is on the report all the same
    # Where the time went: the plan's trace and partition, stopped, then Inductor's own compile.
    spent = report.timings.spent
    assert [s.what for s in spent] == [STOPPED, AS_INDUCTOR], spent
    assert all(s.seconds > 0 and s.round == 0 for s in spent)
    assert report.timings.spent_s == pytest.approx(report.timings.compile_s)


def test_verify_peak_builds_the_unchanged_pairs_kernels_once(counted):
    """The MLP with policy "all", whose plan's code peaks higher than the unchanged code
    (``test_no_cost``): the plan is lowered and built (two graphs), the unchanged pair lowered for
    its code alone to judge it, then compiled as Inductor does. Six lowerings, four loads (built
    twice, the judged unchanged pair loaded six)."""
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0)
    _one_step(backend)
    (report,) = backend.reports
    assert not report.offloaded and "verify_peak" in report.note, report.note
    assert counted == {"codegen": 6, "load": 4}, counted
    assert [s.what for s in report.timings.spent] == ["the plan", VERIFY, AS_INDUCTOR], report.timings.spent
    assert report.timings.compiles == 3
    assert f"compiled: {report.timings.spent_text()}" in report.summary()
    assert "verify_peak: the code without offloading, not built" in report.timings.spent_text()


class _Probe(torch.nn.Module):
    """Saved activations, then a wide probe of their output the backward never needs: the step peaks
    in its forward, at the probe, above the floor (what the forward leaves for its backward)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
        self.register_buffer("probe", torch.randn(64, 4096))

    def forward(self, x):
        h = self.body(x)
        return (h * (h.detach() @ self.probe).amax(-1, keepdim=True)).mean()


def _probe_step(backend, probe=_Probe):
    """One step of ``probe`` compiled with ``backend``: its report, its gradients equal to eager's."""
    torch.manual_seed(0)
    model, x = probe(), torch.randn(1024, 64)
    eager = copy.deepcopy(model)
    torch.compile(model, backend=backend)(x).backward()
    eager(x).backward()
    for got, want in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad)
    (report,) = backend.reports
    return report


def test_verify_peak_lowers_the_unchanged_forward_inside_the_plans_compile(judged_on_code, counted, monkeypatch):
    """Policy "all" on ``_Probe``: the plan's code peaks above the floor, and under the unchanged
    forward's code, lowered inside the plan's compile (the same trace and partition, no kernel
    built), whose replay is the unchanged pair's up to its forward's end: a lower bound of that pair's
    peak. So the pair without offloading is not lowered: three lowerings (the plan's two, the
    unchanged forward), two loads, one compile. Without that forward (taken away), the pair is
    lowered whole in a compile of its own: its forward peaks where the one lowered inside did, its
    whole peak no lower, and the verdict is the same."""
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0)
    report = _probe_step(backend)
    assert report.offloaded and not report.note, report.note
    assert [s.what for s in report.timings.spent] == ["the plan", VERIFY_INSIDE], report.timings.spent
    assert counted == {"codegen": 3, "load": 2}, counted
    assert report.timings.compiles == 1 and [s.inside for s in report.timings.spent] == [False, True]
    ((_, forward_peak),) = backend._compiler._unchanged_forward_peak.values()
    plan_peak = report.compiled_memory().peak_bytes
    assert plan_peak < forward_peak

    monkeypatch.setattr(GraphCompiler, "_lower_unchanged_forward", lambda *args: None)
    counted.clear()
    torch._dynamo.reset()
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0)
    whole = _probe_step(backend)
    assert [s.what for s in whole.timings.spent] == ["the plan", VERIFY], whole.timings.spent
    assert counted == {"codegen": 4, "load": 2}, counted
    assert {r.name for r in whole.offloaded} == {r.name for r in report.offloaded}
    ((_, unchanged),) = backend._compiler._unchanged_code.values()
    replay = unchanged.code_memory()
    assert max(p.total for p in replay.points if p.phase == "forward") == forward_peak
    assert replay.peak_bytes >= forward_peak > plan_peak


def test_an_unchanged_forward_that_gives_no_figure_leaves_the_check_to_the_whole_pair(judged_on_code, counted, monkeypatch):
    """Where the forward lowered in the plan's compile gives no figure (code this reader does not
    know, here forced), nothing is kept from it and the pair is lowered whole, as before: the same
    plan kept, one lowering more."""
    monkeypatch.setattr(compile_module, "replay_forward", lambda *args: None)
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0)
    report = _probe_step(backend)
    assert report.offloaded and not report.note, report.note
    assert [s.what for s in report.timings.spent] == ["the plan", VERIFY_INSIDE, VERIFY], report.timings.spent
    assert counted == {"codegen": 5, "load": 2}, counted
    assert not backend._compiler._unchanged_forward_peak


class _DeepProbe(_Probe):
    """``_Probe`` with six saved layers: offloading them lowers the forward's peak, at the probe, by
    about a tenth, and that peak stays above the floor."""

    def __init__(self):
        super().__init__()
        layers = [m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]
        self.body = torch.nn.Sequential(*layers)


def test_verify_peak_takes_the_model_at_its_word_where_it_agrees_with_the_plans_code(counted, monkeypatch):
    """Policy "all" on ``_DeepProbe``: the FX model gives the plan's code its peak and its forward's
    within ``MODEL_AGREEMENT``, and puts the code without offloading well above it: nothing more is
    lowered (two lowerings, the plan's; one compile). The model was right: Inductor's own code for
    the graph peaks higher. Without the checked model (taken away), the unchanged forward is lowered
    inside the plan's compile to judge it, and the verdict is the same."""
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0)
    report = _probe_step(backend, _DeepProbe)
    assert report.offloaded and not report.note, report.note
    assert [s.what for s in report.timings.spent] == ["the plan"], report.timings.spent
    assert counted == {"codegen": 2, "load": 2}, counted
    plan_peak = report.compiled_memory().peak_bytes
    saved = [(r.producer, r.nbytes) for r in report.saved]
    assert unchanged_floor(report.memory_before, saved, report.compiled_memory()) < plan_peak  # not the floor's doing
    assert plan_peak < checked_model_floor(report.memory_before, report.memory_after, report.compiled_memory())

    torch._dynamo.reset()
    inductor = _probe_step(fxoffload.backend(offload_cpu=True, policy="none"), _DeepProbe)
    assert inductor.compiled_memory().peak_bytes > plan_peak

    monkeypatch.setattr(verify_module, "checked_model_floor", lambda *args: None)
    counted.clear()
    torch._dynamo.reset()
    judged = _probe_step(fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0), _DeepProbe)
    assert [s.what for s in judged.timings.spent] == ["the plan", VERIFY_INSIDE], judged.timings.spent
    assert counted == {"codegen": 3, "load": 2}, counted
    assert {r.name for r in judged.offloaded} == {r.name for r in report.offloaded}


def _timeline(forward: int, backward: int) -> MemoryTimeline:
    return MemoryTimeline((MemoryPoint("forward", "a", {"saved": forward}), MemoryPoint("backward", "b", {"saved": backward})))


def test_the_model_stands_for_the_unchanged_code_only_where_it_agrees_with_the_plans():
    """``checked_model_floor``: the unchanged pair's modelled peak, less the model's disagreement with
    the plan's code and ``MODEL_MARGIN``; no figure where the model is further than
    ``MODEL_AGREEMENT`` from that code, at its peak or at its forward's, or has no points."""
    before, code = _timeline(1000, 1100), _timeline(900, 950)
    assert checked_model_floor(before, code, code) == int(1100 * (1 - MODEL_MARGIN))
    off = _timeline(900, 950 + 10)  # 1% high at the peak
    assert checked_model_floor(before, off, code) == int(1100 * (1 - 10 / 950 - MODEL_MARGIN))
    too_far = 1 + MODEL_AGREEMENT + 0.01
    assert checked_model_floor(before, _timeline(900, int(950 * too_far)), code) is None
    assert checked_model_floor(before, _timeline(int(900 * too_far), 950), code) is None  # its forward
    assert checked_model_floor(before, _timeline(int(900 / too_far), 950), code) is None  # low as well as high
    assert checked_model_floor(None, code, code) is None
    assert checked_model_floor(before, MemoryTimeline(()), code) is None


def test_a_plan_made_again_reuses_the_unchanged_forwards_peak(judged_on_code, counted):
    """The unchanged forward's peak is kept per graph and what code before it holds: a plan made again
    for the same graph (``auto`` from measured copy times) is judged against it without lowering it
    again (two more lowerings: the new plan's)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((copy_graph_module(gm), list(example_inputs)))
        return gm.forward

    torch.manual_seed(0)
    torch.compile(_Probe(), backend=capture)(torch.randn(1024, 64))
    (gm, inputs), = graphs
    compiler = GraphCompiler(PairRegister())
    opts = OffloadOptions(policy="all", min_bytes=0, offload_cpu=True)
    _, first = compiler.compile(copy_graph_module(gm), inputs, opts)
    assert first.plan.offloaded and counted["codegen"] == 3, counted
    _, again = compiler.compile(copy_graph_module(gm), inputs, opts, graph_id=first.graph_id)
    assert again.plan.offloaded and not again.plan.note, again.plan.note
    assert counted["codegen"] == 3 + 2, counted
    assert [s.what for s in again.report.timings.spent] == ["the plan"], again.report.timings.spent


def test_a_graph_planned_again_is_judged_against_the_same_unchanged_code(counted):
    """verify_peak lowers the graph without offloading once: a plan made again for the same graph
    and the same outside memory (``auto`` from measured copy times) is judged against that code."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((copy_graph_module(gm), list(example_inputs)))
        return gm.forward

    torch.manual_seed(0)
    model, batch = example("mlp")
    torch.compile(model, backend=capture)(*batch)
    (gm, inputs), = graphs
    compiler = GraphCompiler(PairRegister())
    opts = OffloadOptions(policy="all", min_bytes=0, offload_cpu=True)
    _, first = compiler.compile(copy_graph_module(gm), inputs, opts)
    assert "verify_peak" in first.plan.note  # judged against the unchanged code, and swapped for it
    # The plan (2 graphs), the unchanged pair for its code (2), Inductor's own forward (the backward
    # waits for its first call).
    assert counted["codegen"] == 5, counted
    _, again = compiler.compile(copy_graph_module(gm), inputs, opts, graph_id=first.graph_id)
    assert "verify_peak" in again.plan.note
    assert counted["codegen"] == 5 + 3, counted  # the unchanged pair's code was not made again


def _stalling_gpt(**options):
    """``auto`` on the built-in GPT priced 1000x slow, its copies waited on at once on a 50 MB/s link:
    its copies stall. The backend, and one training step."""
    backend = fxoffload.backend(
        offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=50e6, prefetch=0,
        compute_rates={"flops": 1e9, "memory_bandwidth": 1e8}, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    model, batch = example("gpt")
    compiled = torch.compile(model, backend=backend)
    return backend, lambda: compiled(*batch).backward()


def test_auto_compiles_again_at_most_max_replans_times(counted):
    """``auto`` on a model priced 1000x slow, its copies waited on at once on a 50 MB/s link: the copies
    stall, are measured at the second step, and the graph is planned again and compiled, at most
    ``max_replans`` (2) times; each of those compiles lowers no more graphs than the first step did
    (its forward and backward, and the unchanged pair's code for ``verify_peak``)."""
    backend, step = _stalling_gpt()
    step()
    first = dict(counted)
    for _ in range(8):
        step()
    (report,) = backend.reports
    rounds = [r for r in report.replans if "planned again with the measured times" in r]
    assert 1 <= len(rounds) <= 2, report.replans
    assert 0 < counted["codegen"] - first["codegen"] <= len(rounds) * first["codegen"], (counted, first)
    # Every compile of the graph stays on its report, each plan made again under its round.
    spent = report.timings.spent
    assert [s.what for s in spent if s.round == 0][0] == "the plan", spent
    assert sorted({s.round for s in spent}) == list(range(len(report.replans) + 1)), (spent, report.replans)
    assert report.timings.spent_s > report.timings.compile_s  # this plan's compile, and the earlier ones
    assert "planned again at run time (1): the plan" in report.timings.spent_text()


def test_a_replan_that_fails_in_the_compiler_stays_on_the_report(counted, monkeypatch):
    """The model of ``test_auto_compiles_again_at_most_max_replans_times``, Inductor failing from the
    second step on: the plan runs on, and the failed round's compile is on its report, under round 1."""
    backend, step = _stalling_gpt(max_replans=1)
    step()

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(_compat, "compile_with_inductor", fail)
    for _ in range(4):
        step()
    (report,) = backend.reports
    assert not report.replans  # the plan made again never ran
    failed = [s for s in report.timings.spent if s.round == 1]
    assert [s.what for s in failed] == ["the plan (failed)"], report.timings.spent
    assert [s.what for s in report.timings.spent if s.round == 0][0] == "the plan"


def test_the_code_lowered_for_its_code_alone_is_read_back_by_the_next_compile(tmp_path, monkeypatch, caplog):
    """A fraction's base, the pair without offloading lowered for its code alone, is kept under
    Inductor's FX graph cache key (``_compat.code_cache``): the same model compiled again (a new
    process's first step; here after a reset) reads both graphs' code back instead of lowering them,
    for the same budget in bytes. With Inductor's cache off, whose key it is, they are lowered again."""
    from fxoffload._compat import code_cache

    monkeypatch.setattr(code_cache, "_path", lambda key: str(tmp_path / f"{key}.py"))
    # Inductor's own cache in a folder of this test's: one an earlier run or test had filled (CI's)
    # served the first compile's graphs, none lowered, and nothing was left to read back in place of that.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    lowerings = collections.Counter()
    original = GraphLowering.codegen

    def counting(self, *args, **kwargs):
        lowerings["now"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GraphLowering, "codegen", counting)

    def compiled(**patches):
        lowerings.clear()
        caplog.clear()
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, batch = example("mlp")
        backend = fxoffload.backend(memory_budget=0.5, offload_cpu=True, min_bytes=0)
        with caplog.at_level("DEBUG", logger=code_cache.__name__), torch._inductor.config.patch(patches):
            torch.compile(model, backend=backend)(*batch).backward()
        (report,) = backend.reports
        assert "for memory_budget's fraction" in report.timings.spent_text(), report.timings.spent_text()
        read = sum("read back" in r.getMessage() for r in caplog.records)
        return report.memory_budget, lowerings["now"], read

    budget, first, read = compiled()
    assert read == 0 and len(list(tmp_path.glob("*.py"))) == 2  # the forward's code and the backward's
    again, second, read = compiled()
    assert (again, read) == (budget, 2) and second <= first - 2, (first, second)
    _, _, read = compiled(fx_graph_cache=False)
    assert read == 0
