"""Offloading never costs memory: the measured peak of a steady step with a plan is at most the measured
peak of the same compiler without fxoffload (issue 11, part 2).

Measured from the CPU allocator's own events (``fxoffload.measure_memory``, fxoffload's host buffers
left out, as a GPU run would show them), one thread, after two warm-up steps.
"""

import functools

import pytest
import torch

import fxoffload
from fxoffload.compiler.verify import plan_kept, unchanged_floor
from fxoffload.measure.allocator import track_cpu_frees
from fxoffload.testing.models import example

from .conftest import measured_example, measured_steady_step, requires_saved_tensor_reads


# The op calls priced as an accelerator's host issues them, costing the compute stream nothing: these
# tests are about memory, and on a CPU the calls' own time leaves "auto" nothing to offload
# (tests/test_op_time.py).
FREE_CALLS = {"op_time": 0.0}


def _steady_peak(name: str, backend) -> int:
    """Bytes above the start at the peak of the third training step of ``example(name)``."""
    return measured_example(name, backend)  # one thread, two warm-up steps


@functools.cache
def _baseline(name: str, inner: str) -> int:
    return _steady_peak(name, inner)  # backend="inductor" / "aot_eager": no fxoffload at all


# CPU, torch 2.13, 1 thread (bytes, baseline -> policy "all"): mlp aot_eager 569096 -> 569096, gpt
# inductor 7848968 -> 3137288, gpt aot_eager 8540680 -> 2905876, cnn aot_eager 4729200 -> 3165232,
# seq2seq inductor 670344 -> 670344. The MLP under Inductor: see the verify_peak tests below.
CASES = [
    ("mlp", "aot_eager", "all"),
    ("gpt", "inductor", "all"),
    ("gpt", "aot_eager", "all"),
    ("cnn", "aot_eager", "all"),
    # Its packed-GRU encoder runs eagerly before the graph and holds its activations through it (the
    # prediction counts them as "outside"); the step peaks in the graph's backward, where edges from
    # reloads to earlier gradients once raised the peak by 30 KiB of Inductor's code.
    pytest.param("seq2seq", "inductor", "all", marks=requires_saved_tensor_reads),
]


# Inductor compiles of the pair under verify_peak: GPT's plan peaks below what the unchanged code holds
# at the end of its forward (no second compile); seq2seq's ties with it (compiled again).
COMPILES = {"gpt": 1, "seq2seq": 2}


@pytest.mark.parametrize("name, inner, policy", CASES)
def test_offloading_never_raises_the_measured_peak(name, inner, policy):
    track_cpu_frees()  # frees of blocks from before the step count
    backend = fxoffload.backend(offload_cpu=True, inner=inner, policy=policy, min_bytes=0)
    with_plan = _steady_peak(name, backend)
    (report,) = backend.reports
    assert report.offloaded, "nothing was offloaded: the comparison would test nothing"
    if inner == "inductor":  # and the prediction under Inductor, its code replayed, is the measured step
        # verify_peak kept the plan: its code peaks no higher than the unchanged pair's.
        assert not report.note and "fxoffload.offload" in report.output_code["forward"], report.note
        assert report.timings.compiles == COMPILES[name]
        predicted = report.compiled_memory().peak_bytes - report.start_bytes
        # CPU, torch 2.13: gpt 3137284 predicted / 3137288 measured, seq2seq 662180 / 670344 (its step
        # peaks in the eager encoder's own backward, after the graph's).
        assert abs(predicted / with_plan - 1) < 0.05, (name, predicted, with_plan)
    baseline = _baseline(name, inner)
    assert with_plan <= baseline, (
        f"{name}, {inner}, policy={policy}: {with_plan} bytes measured with fxoffload, {baseline} without "
        f"({with_plan / baseline - 1:+.2%})"
    )


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_auto_leaves_a_graph_it_cannot_help_unchanged(inner):
    """The MLP's peak is at the end of its backward, where every gradient is live and none of its
    saved tensors is: offloading cannot lower it, so "auto" offloads nothing and says why (before this
    rule it offloaded 11 tensors and, under Inductor, measured +1.5%, as "all" still does)."""
    track_cpu_frees()
    backend = fxoffload.backend(offload_cpu=True, inner=inner, policy="auto", min_bytes=0, **FREE_CALLS)
    measured = _steady_peak("mlp", backend)
    (report,) = backend.reports
    assert not report.offloaded
    codes = {r.reason_code for r in report.saved}
    assert "peak_not_lowered" in codes and "hidden" not in codes, codes
    assert measured <= _baseline("mlp", inner)


def test_auto_does_not_judge_a_pair_that_returns_activations():
    """The same MLP without its loss (a block of a longer step, as after a graph break): its saved
    tensors wait for their backward while other code runs, where offloading them lowers the step's
    peak, so its own timeline does not decide and "auto" offloads as before."""
    torch._dynamo.reset()
    model, (x,) = example("mlp")
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", policy="auto", min_bytes=0, **FREE_CALLS)
    residual = lambda h, layer: h + layer(h)  # noqa: E731  the MLP's forward without the loss
    block = torch.compile(lambda x: functools.reduce(residual, model.layers, x), backend=backend)
    block(x).sum().backward()
    (report,) = backend.reports
    assert report.offloaded and "peak_not_lowered" not in {r.reason_code for r in report.saved}


def test_the_users_own_offloads_stay_when_autos_are_dropped():
    """A policy function's "offload" is the user's decision: the rule drops only the planner's picks."""
    torch._dynamo.reset()
    model, batch = example("mlp")

    def offload_first_matmul(t):
        return "offload" if t.name == "addmm" else None

    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", policy=offload_first_matmul, min_bytes=0, **FREE_CALLS)
    torch.compile(model, backend=backend)(*batch).backward()
    (report,) = backend.reports
    assert [r.name for r in report.offloaded] == ["addmm"]
    assert next(r for r in report.saved if r.name == "addmm").reason_code == "user_policy"
    assert "peak_not_lowered" in {r.reason_code for r in report.saved}


def test_inductor_code_that_peaks_higher_is_compiled_unchanged():
    """``verify_peak``: the MLP under Inductor with policy "all". Its peak is at the end of the
    backward (every gradient live, no saved tensor). With the reloads' order edges, Inductor fuses the
    bias-gradient sums into one kernel at the end and moves three weight-gradient matmuls after it,
    the last one still reading an 8 KiB reloaded input: +8 KiB measured. The backend compiles the pair
    unchanged too, replays both codes, and keeps the unchanged one, saying so."""
    track_cpu_frees()
    baseline = _baseline("mlp", "inductor")
    unchecked = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0, verify_peak=False)
    raised = _steady_peak("mlp", unchecked)
    assert unchecked.reports[0].offloaded
    # What the check is for (CPU, torch 2.13: 570376 against 562184 bytes). Should Inductor ever stop
    # doing this, the case below tests nothing and needs another model.
    assert raised > baseline, (raised, baseline)

    checked = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0)
    measured = _steady_peak("mlp", checked)
    (report,) = checked.reports
    assert measured == baseline
    assert not report.offloaded and report.policy == "all"
    assert "above its code without offloading" in report.note and "verify_peak" in report.note
    kept = [r for r in report.saved if r.reason_code == "peak_not_lowered"]
    assert {r.name for r in kept} == {r.name for r in unchecked.reports[0].offloaded}
    assert all(r.reason.startswith("Inductor's code with the plan peaks at") for r in kept)
    # The code that runs is the unchanged pair's: no transfer op in it.
    assert "fxoffload" not in report.output_code["forward"] + report.output_code["backward"]
    # A plan whose code peaks at most at this floor skips the second compile: the unchanged code holds
    # it at the end of its forward (parameters, inputs, every saved tensor), whatever Inductor fuses.
    floor = _floor(report, report.compiled_memory())
    assert 0 < floor <= report.compiled_memory().peak_bytes


def test_memory_budget_plan_whose_code_peaks_higher_is_compiled_unchanged():
    """The same MLP with a memory_budget it cannot reach: the budget plan's code peaks 8 KiB higher than
    the unchanged code, so the unchanged compile is kept, and the budget warning gives its figures."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = example("mlp")
    backend = fxoffload.backend(offload_cpu=True, memory_budget=0.8, min_bytes=0, **FREE_CALLS)
    compiled = torch.compile(model, backend=backend)
    measured, caught = measured_steady_step(model, lambda: compiled(*batch).backward())  # compiles in warm-up
    (report,) = backend.reports
    assert not report.offloaded and "(verify_peak)" in report.note and report.memory_budget is not None
    assert measured == _baseline("mlp", "inductor")
    # The code that runs is the code without offloading; the budget is 80% of its peak.
    assert report.unchanged_code_peak == report.compiled_memory().peak_bytes
    assert report.memory_budget == int(0.8 * report.unchanged_code_peak)
    assert "80% of that (NOT met)" in report.summary(), report.summary()
    (said,) = [str(w.message) for w in caught if "is not met by the code" in str(w.message)]
    assert "without offloading: the budget's plan was dropped, Inductor's code with the plan peaks at" in said


def test_the_floor_sizes_an_expanded_input_by_its_storage():
    """An input expanded from (512, 1) to (512, 1024) spans 2 KiB, not the 2 MiB its shape says: the
    floor under which verify_peak skips its second compile must not count the shape (it would then
    skip the check for plans peaking anywhere below 2 MiB)."""
    torch._dynamo.reset()
    weight = torch.nn.Parameter(torch.randn(1024, 64) * 0.01)
    backend = fxoffload.backend(offload_cpu=True, policy="none", min_bytes=0)
    x = torch.randn(512, 1).expand(512, 1024)
    torch.compile(lambda x: torch.tanh(x @ weight).square().sum(), backend=backend)(x).backward()
    (report,) = backend.reports
    code = report.compiled_memory()
    assert report.memory_before.points[-1].live["inputs"] >= 512 * 1024 * 4  # the FX model: the shape
    assert _floor(report, code) <= code.peak_bytes



def test_auto_offloads_nothing_where_inductors_code_would_tie():
    """seq2seq under Inductor: "auto"'s offloads cannot lower the decoder graph's peak, in its
    backward where they are all back. The FX model that did not fuse said 66 offloads lowered it,
    and the code of the plan (a second compile) tied with the unchanged code; the model that fuses as
    Inductor does (``analysis.fusion``) sees that they would barely lower it: nothing offloaded, each
    tensor saying why, no second lowering."""
    track_cpu_frees()
    backend = fxoffload.backend(offload_cpu=True, policy="auto", min_bytes=0, **FREE_CALLS)
    measured = _steady_peak("seq2seq", backend)
    (report,) = backend.reports
    assert not report.offloaded and "peak_barely_lowered" in {r.reason_code for r in report.saved}, report.table()
    assert not [s.what for s in report.timings.spent if "verify_peak" in s.what], report.timings.spent_text()
    assert measured == _baseline("seq2seq", "inductor")


@pytest.mark.parametrize("autos_own", [True, False])
def test_on_a_tie_autos_own_copies_give_way(autos_own):
    """verify_peak's rule when the plan's code peaks as high as the unchanged code: copies "auto"
    picked buy nothing and give way; copies a user asked for stay. Lower always stays, higher never."""
    assert plan_kept(100, 100, autos_own) is not autos_own
    assert plan_kept(99, 100, autos_own) and not plan_kept(101, 100, autos_own)


def _floor(report, code):
    return unchanged_floor(report.memory_before, [(r.producer, r.nbytes) for r in report.saved], code)
