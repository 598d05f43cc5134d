"""memory_budget under Inductor: met when measured, or warned about at compile time with the figures.

The plan fits the budget on the FX memory model; Inductor's code then fuses, reuses and frees its own
way. The backend lowers both graphs at compile time, replays the code (``report.compiled_memory``)
and, where it misses the budget, plans again for a lower target (``report.replans``). CPU figures:
at 0.01 GB/s nothing is hidden, so the budget alone decides what is offloaded.
"""

import logging
import re
import warnings

import pytest
import torch

import fxoffload
from fxoffload.testing.models import example

from .conftest import measured_steady_step

OPTIONS = {"offload_cpu": True, "inner": "inductor", "policy": "auto", "min_bytes": 0, "bandwidth": "0.01GB"}


def _compile_and_measure(**options):
    """The report, the warnings of the compile and the measured peak of a steady step, above its start."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = example("gpt")
    backend = fxoffload.backend(**{**OPTIONS, **options})
    compiled = torch.compile(model, backend=backend)
    measured, caught = measured_steady_step(model, lambda: compiled(*batch).backward())
    (report,) = backend.reports
    said = [str(w.message) for w in caught if "fxoffload" in str(w.message)]
    return report, said, measured


@pytest.fixture
def inductor_reuse(monkeypatch):
    """The plan's graphs lowered with Inductor's own pool reuse (``compiler.lowering``'s rule taken
    away): it keeps an offloaded buffer for a later allocation, so the code peaks above the FX model,
    which now follows the code closely enough that its plans for the GPT meet their budgets."""
    from fxoffload.compiler import compile as compile_module

    monkeypatch.setattr(compile_module, "lowering_config", lambda graph: {})


def _above_start(report, nbytes):
    """``nbytes`` less the parameters and inputs live when the step starts (all placeholders in)."""
    start = report.memory_before.points[-1]
    return nbytes - start.live["parameters"] - start.live["inputs"]


# GPT tiny (with dropout) at 0.6 of its predicted peak, lowered with Inductor's own pool reuse
# (``inductor_reuse``): the first plan fits on the FX model but
# Inductor's code peaks at 5.1 MiB, over the budget (5.0 MiB) by more than the tolerance; planned again
# for 4.8 MiB, its code peaks at 4.6 MiB. (Before the model fused as Inductor does, 0.45 of a peak
# predicted 4% higher missed by more: its plans rarely miss now.)
def test_a_budget_the_code_misses_is_planned_again_and_met_when_measured(inductor_reuse):
    report, said, measured = _compile_and_measure(memory_budget=0.6)
    assert 1 <= len(report.replans) <= 2, report.summary()  # max_replans (2) at most
    targets = []
    for i, line in enumerate(report.replans, 1):
        plan = re.match(
            rf"Inductor's code of plan {i} peaked at ([\d.]+) MiB, over memory_budget ([\d.]+) MiB; "
            r"planned again for ([\d.]+) MiB on the FX model", line,
        )  # fmt: skip
        assert plan, report.replans
        missed, budget, target = (float(x) for x in plan.groups())
        assert missed > budget > target
        targets.append(target)
    assert targets == sorted(targets, reverse=True)  # each lower by the last miss
    assert "planned again: Inductor's code of plan 1" in report.summary()
    code = report.compiled_memory().peak_bytes
    assert code <= report.memory_budget * 1.03, report.summary()
    assert re.search(r"memory_budget: [\d.]+ MiB(, \d+% of that)? \(met\)", report.summary()), report.summary()
    assert not [s for s in said if "not met" in s or "cannot be reached" in s], said
    # Measured: the CPU allocator's events of a steady step, above what was live at its start.
    assert measured <= _above_start(report, report.memory_budget) * 1.03, (measured, report.summary())


def test_without_planning_again_the_same_budget_is_warned_about(inductor_reuse):
    """The rule broken on purpose (``max_replans=0``): the first plan's code is kept, and the warning
    says so (0.47: its code peaks 5% over the budget)."""
    report, said, measured = _compile_and_measure(memory_budget=0.47, max_replans=0)
    assert report.replans == ()
    (warning,) = [s for s in said if "is not met by the code Inductor generated" in s]
    assert re.search(r"memory_budget [\d.]+ MiB is not met by the code Inductor generated: it peaks at [\d.]+ MiB", warning)
    assert measured > _above_start(report, report.memory_budget), "the first plan really misses it"


def test_strict_refuses_a_budget_the_code_misses_and_planning_again_stops_at_the_fits_smallest_peak(caplog):
    """At 0.3 the FX fit cannot reach the budget even on its own model: a lower target would give the
    same plan, so nothing is compiled again; the code's miss is refused with the figures."""
    with caplog.at_level("INFO", logger="fxoffload"), pytest.raises(
        Exception, match=r"memory_budget [\d.]+ MiB is not met by the code Inductor generated: it peaks at [\d.]+ MiB "
        r".*\(strict=True\)"
    ):  # fmt: skip
        _compile_and_measure(memory_budget=0.3, strict=True)
    assert not [m for m in caplog.messages if "planned again" in m], caplog.messages


def test_an_unreachable_budget_on_a_dynamic_graph_is_warned_about_too():
    """Inductor's code with symbolic sizes has no replay to judge: the fit's word stands (a new
    user's dynamic=True graph got no warning where the same static one did)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))
    backend = fxoffload.backend(offload_cpu=True, min_bytes="4KiB", memory_budget="1MiB")
    with pytest.warns(RuntimeWarning, match=r"memory_budget 1.0 MiB cannot be reached: the smallest predicted peak"):
        torch.compile(model, backend=backend, dynamic=True)(torch.randn(1024, 64)).pow(2).mean().backward()
    (report,) = backend.reports
    assert report.compiled_memory() is None or not report.compiled_memory().points


@pytest.mark.parametrize("bad", [0.0, 1.5, "many"])
def test_a_bad_budget_names_what_is_allowed(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        fxoffload.backend(memory_budget=bad)


class _LoRALinear(torch.nn.Module):
    def __init__(self, din, dout, r=4):
        super().__init__()
        self.base = torch.nn.Linear(din, dout).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(r, din) * 0.02)
        self.b = torch.nn.Parameter(torch.randn(dout, r) * 0.02)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t() * 2.0


class _LoRABlock(torch.nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d).requires_grad_(False), torch.nn.LayerNorm(d).requires_grad_(False)
        self.qkv, self.proj = _LoRALinear(d, 3 * d), _LoRALinear(d, d)
        self.fc, self.out = _LoRALinear(d, 4 * d), _LoRALinear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class _LoRAGPT(torch.nn.Module):
    """A GPT fine-tuned with low-rank adapters: every base weight frozen (a new user's, helper-21's)."""

    def __init__(self, vocab=256, d=64, layers=3):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(64, d)
        self.blocks = torch.nn.ModuleList(_LoRABlock(d) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)
        for m in (self.tok, self.pos, self.ln, self.head):
            m.requires_grad_(False)

    def forward(self, idx, target):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(self.ln(x)).flatten(0, 1), target.flatten())


_LORA_BUDGET = 4_890_004  # 0.62 of the LoRA GPT's FX model's peak


def _lora_budget(budget):
    torch._dynamo.reset()
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (8, 64))
    backend = fxoffload.backend(memory_budget=budget, offload_cpu=True, min_bytes="4KiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(_LoRAGPT(), backend=backend)(idx, torch.roll(idx, -1, 1)).backward()
    (report,) = backend.reports
    return report, [str(w.message) for w in caught if "memory_budget" in str(w.message)]


def test_a_budget_its_fit_met_only_on_its_own_estimate_is_planned_again(monkeypatch):
    """The LoRA GPT at 0.62 of its FX model's peak (4,890,004 bytes; the fraction is now of the code's
    peak, 5.4 MiB, met at once): the fit met 4.66 MiB on its own intervals, while the model of
    the plan it made, and Inductor's code, peaked at 5.14 MiB. That was taken for the lowest peak a
    target could reach, so nothing was planned again, and the user was told the budget could not be
    reached (``policy="all"`` reaches 4.53 MiB). A lower target makes the fit take more: met."""
    report, said = _lora_budget(_LORA_BUDGET)
    assert report.replans, report.summary()
    assert report.compiled_memory().peak_bytes <= report.memory_budget * 1.03, report.summary()
    assert not [s for s in said if "not met" in s], said
    # The rule broken on purpose: the fit's own estimate not asked, the plan's model alone.
    from fxoffload.compiler import compile as compile_module

    def lowest_by_the_model(pair, code, target):
        return pair.memory_after.peak_bytes > target and not pair.plan.judged_on_code

    monkeypatch.setattr(compile_module, "fit_is_lowest", lowest_by_the_model)
    report, said = _lora_budget(_LORA_BUDGET)
    assert not report.replans and [s for s in said if "not met" in s], (report.summary(), said)


class _TinyViT(torch.nn.Module):
    """Two attention blocks over 4x4 patches: a frozen model for attribution (gradients of the input)."""

    def __init__(self, dim: int = 16, blocks: int = 2):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(dim), "attn": torch.nn.MultiheadAttention(dim, 4, batch_first=True),
                "ln2": torch.nn.LayerNorm(dim), "mlp": torch.nn.Sequential(
                    torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)),
            }) for _ in range(blocks)
        )  # fmt: skip
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        for b in self.blocks:
            h = b["ln1"](x)
            x = x + b["attn"](h, h, h, need_weights=False)[0]
            x = x + b["mlp"](b["ln2"](x))
        return self.head(x[:, 0])


def test_a_plan_again_that_takes_nothing_more_is_not_lowered_again(caplog):
    """A new user's attribution (a frozen ViT, gradients of the input) under memory_budget="60%": the
    code peaked over the budget in the forward, so it was planned again for a lower target, twice, and
    the fit took the same tensors each time: the same graphs, lowered three times (10.7 s against 6.2
    for policy "all"), and each re-plan numbered as a new graph. Now a plan that rewrites the graphs
    as one compiled before stops before Inductor lowers it (judged by that one's peak, the target
    lowered again), and the graph keeps its number.
    One CPU thread: at two, oneDNN's patch-embedding convolution backward holds 77,872 bytes inside
    its call (53,272 at one), the code peaks there, in the backward, and is not planned again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyViT().eval().requires_grad_(False)
    backend = fxoffload.backend(offload_cpu=True, min_bytes=0, memory_budget="60%")
    img = torch.randn(4, 3, 16, 16, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.INFO, logger="fxoffload"), pytest.warns(RuntimeWarning, match="is not met"):
            (grad,) = torch.autograd.grad(torch.compile(model, backend=backend)(img)[:, 0].sum(), img)
    finally:
        torch.set_num_threads(threads)
    (report,) = backend.reports
    assert report.replans, "not planned again: the test says nothing"
    spent = report.timings.spent
    assert spent[0].what == "the code without offloading, for memory_budget's fraction, not built", spent
    # Each plan again took the same tensors (the target lowered by the miss each time: max_replans 2).
    assert [c.lowered for c in spent[1:]] == [True, False, False], spent
    assert all(c.what.endswith("stopped before lowering: the same graphs as a plan compiled before") for c in spent[2:])
    assert "plan 2 made the graphs of a plan before it" in report.replans[1], report.replans
    said = {int(m) for m in re.findall(r"fxoffload: graph (\d+):", caplog.text)}
    assert said == {report.graph_id}, caplog.text
    torch._dynamo.reset()
    (expected,) = torch.autograd.grad(torch.compile(model, backend="inductor")(img)[:, 0].sum(), img)
    assert torch.equal(grad, expected)


def test_a_fraction_is_of_the_peak_of_inductors_code_without_offloading():
    """``memory_budget=0.9`` is 90% of what Inductor's code peaks at without offloading (that code
    lowered first, for its code alone, and replayed), not of the FX model's peak: on convolutions
    with GroupNorms the model alone counts neither the convolutions' scratch nor the channels-last
    copies of their weights the forward saves and is 18% under the code, so 90% of it asked for less
    than the user meant and was "NOT met" by a plan that is within 90% of Inductor's peak. What that
    code showed is in the model of the plan (``memory.CodeFacts``): then within 1% of it. Measured,
    the plan's step peaks where its code replays."""
    from .conftest import ConvStack

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = ConvStack(), torch.randn(2, 3, 16, 16)
    backend = fxoffload.backend(offload_cpu=True, min_bytes=0, cpu_link_bandwidth="2GB/s", memory_budget=0.9)
    compiled = torch.compile(model, backend=backend)
    measured, caught = measured_steady_step(model, lambda: compiled(x).backward())
    (report,) = backend.reports
    torch._dynamo.reset()
    inductors = fxoffload.backend(offload_cpu=True, policy="none")  # Inductor's code, replayed
    plain = torch.compile(model, backend=inductors)
    plain_measured, _ = measured_steady_step(model, lambda: plain(x).backward())  # one thread, as above
    unchanged = inductors.reports[0].compiled_memory().peak_bytes
    assert report.unchanged_code_peak == unchanged
    assert abs(plain_measured - (unchanged - report.start_bytes)) <= 0.01 * plain_measured
    assert report.memory_budget == int(0.9 * unchanged)
    assert abs(report.predicted_peak_before / unchanged - 1) < 0.01, (report.predicted_peak_before, unchanged)
    assert report.compiled_memory().peak_bytes <= report.memory_budget, report.summary()
    assert "90% of that (met)" in report.summary(), report.summary()
    assert not [w for w in caught if "not met" in str(w.message)]
    assert abs(measured - (report.compiled_memory().peak_bytes - report.start_bytes)) <= 0.01 * measured
    # Lowered once: the plan's verify_peak judges against the same code.
    spent = [c.what for c in report.timings.spent]
    assert spent.count("the code without offloading, for memory_budget's fraction, not built") == 1, spent
    assert not any(w.startswith("verify_peak") for w in spent), spent


def test_planned_again_the_target_moves_from_what_the_first_plan_aimed_at():
    """A fraction of the code's peak is judged in the code's bytes while the first plan aims at the
    same fraction of the FX model's peak (``planning.budget.fit_target``; the UNet at 80%: a budget
    of 590.1 KiB, a first aim of 495.0 KiB). Its code missed by 40.6 KiB: the next target is that aim
    lowered by the miss, 454.4 KiB, not the budget lowered by it (549.5 KiB, which the first plan
    had already gone below on the model)."""
    from fxoffload.compiler.refine import Trial, refine

    asked = []

    def attempt(target):
        asked.append(target)
        aimed = 495_000 if target is None else target  # what the plan says it aimed at
        return Trial(f"plan {len(asked)}", {None: 630_600, 454_400: 600_000}[target], aimed, budget=590_000)

    best, trials = refine(None, attempt, limit=1, tolerance=0.03)
    assert asked == [None, 495_000 - (630_600 - 590_000)]
    assert best.value == "plan 2" and len(trials) == 2


def test_a_plan_that_makes_the_graphs_of_one_before_lowers_the_target_again():
    """Planned again for a lower target, torch's partitioner made the same graphs (its lowest partition
    already): that code missed, so the target is lowered by the miss again, not the loop ended with
    the budget missed. On an Intel Xeon with AMX (2026-12-02) the tiny blocks' code at torch's
    activation_memory_budget=0.2 peaked at 2.0 MiB over a 1.8 MiB budget, the model's 1.5 MiB
    meeting the next target; lowered again, offloads on top met it at 1.4 MiB. The repeat is not
    kept: it compiled nothing."""
    from fxoffload.compiler.refine import Trial, refine

    asked = []

    def attempt(target):
        asked.append(target)
        if target == 1_600:  # the same graphs as the first plan: its peak, nothing compiled
            return Trial(None, 2_000, target, budget=1_800, repeats=True)
        return Trial(f"plan {len(asked)}", {None: 2_000, 1_400: 1_400}[target], target, budget=1_800)

    best, trials = refine(None, attempt, limit=2)
    assert asked == [None, 1_600, 1_400], "lowered by the miss, twice"
    assert best.value == "plan 3" and [t.value for t in trials] == ["plan 1", "plan 3"]


def _costs(model_peak, code_peak):
    from fxoffload.analysis.cost import DeviceRates
    from fxoffload.analysis.memory import MemoryPoint, MemoryTimeline
    from fxoffload.planning.decisions import PlanCosts

    rates = DeviceRates("test", flops=1e12, memory_bandwidth=1e11, d2h=1e9, h2d=1e9, launch=0.0)
    baseline = MemoryTimeline((MemoryPoint("forward", "x", {"saved": model_peak}),))
    return PlanCosts(rates, (0.0, 1.0), (0.0, 1.0), baseline, code_peak=code_peak)


def test_the_budget_in_bytes_and_what_the_fit_aims_at():
    """A fraction is of the code's peak where it was replayed, and the fit aims at the same fraction
    of the model's; bytes are bytes; without the code, both are of the model's peak. A plan made
    with recomputation (its first pair's costs in ``partition_costs``) aimed at what its first pair's
    fit aimed at, whatever target its own re-plans moved to (``first_aim``)."""
    import dataclasses

    from fxoffload.planning.budget import budget_bytes, first_aim, fit_target
    from fxoffload.planning.decisions import OffloadPlan

    code = _costs(800, 1000)  # the model 20% under the code (a UNet's convolutions' scratch)
    assert (budget_bytes(0.6, code), fit_target(0.6, code, None)) == (600, 480)
    assert fit_target(0.6, code, 400) == 400  # planned again for a lower target
    assert (budget_bytes(512, code), fit_target(512, code, None)) == (512, 512)
    model = _costs(800, None)
    assert (budget_bytes(0.6, model), fit_target(0.6, model, None)) == (480, 480)
    plan = OffloadPlan((), "auto", costs=_costs(900, 1000), partition_costs=code, budget_target=430)
    assert first_aim(0.6, plan) == 480 and first_aim(None, plan) is None
    assert first_aim(0.6, dataclasses.replace(plan, partition_costs=None)) == 540


def test_a_fraction_lowers_no_code_first_where_there_is_no_pair_to_judge(monkeypatch):
    """No backward (grad mode off), or sizes Dynamo keeps symbolic (its code cannot be replayed):
    nothing lowered before the plan, the fraction of the model's peak. With fixed sizes and a
    backward, the code is lowered once (the rule broken on purpose: always lowered)."""
    from fxoffload.compiler import compile as compile_module

    lowered = []
    original = compile_module.GraphCompiler._judged_unchanged

    def counted(self, *args):
        lowered.append(args[-1])
        return original(self, *args)

    monkeypatch.setattr(compile_module.GraphCompiler, "_judged_unchanged", counted)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))

    def run(grad=True, dynamic=False):
        torch._dynamo.reset()
        lowered.clear()
        backend = fxoffload.backend(offload_cpu=True, min_bytes=0, memory_budget=0.6)
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the budget's verdict: not what this test is about
            out = torch.compile(model, backend=backend, dynamic=dynamic)(torch.randn(4, 32))
            if grad:
                out.pow(2).mean().backward()
        return [w for w in lowered if "fraction" in w]

    assert run(grad=False) == [] and run(dynamic=True) == []
    assert len(run()) == 1
    monkeypatch.setattr(compile_module, "_fraction_of_code", lambda gm: True)
    assert len(run(grad=False)) == 1  # broken on purpose: an inference graph lowered for nothing
