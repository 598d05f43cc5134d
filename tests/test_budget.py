"""memory_budget under Inductor: met when measured, or warned about at compile time with the figures.

The plan fits the budget on the FX memory model; Inductor's code then fuses, reuses and frees its own
way. The backend lowers both graphs at compile time, replays the code (``report.compiled_memory``)
and, where it misses the budget, plans again for a lower target (``report.replans``). CPU figures:
at 0.01 GB/s nothing is hidden, so the budget alone decides what is offloaded.
"""

import re

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

    monkeypatch.setattr(compile_module, "no_pool_reuse_where_it_copies", lambda graph: {})


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
    assert re.search(r"memory_budget: [\d.]+ MiB \(met\)", report.summary()), report.summary()
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
