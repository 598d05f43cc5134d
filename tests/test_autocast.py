"""Memory from the code that runs, under bf16 autocast as in fp32.

Under autocast the FX memory model counts every cast and every intermediate of the backward's
pointwise chains that Inductor fuses: on the GPT below it is 56% above the allocator without
offloading (CPU, torch 2.13; +34-38% on an H100, ``../shared/gpu/README.md``, section 2). The replay
of Inductor's generated code is the prediction the step is held to, and budgets are judged on it.
"""

import functools
import re

import pytest
import torch

import fxoffload
from fxoffload.compiler import compile as compile_module
from fxoffload.testing.models import GPT, GPTConfig, example, gpt_batch

from .conftest import measured_steady_step


def _run(bf16, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    options = {"offload_cpu": True, "min_bytes": 0, "inner": "inductor", "verify_peak": False, **options}
    backend = fxoffload.backend(**options)
    compiled = torch.compile(model, backend=backend)

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = compiled(*batch)
        loss.backward()

    measured, caught = measured_steady_step(model, step)
    (report,) = backend.reports
    return measured, report, [str(w.message) for w in caught if "fxoffload" in str(w.message)]


@functools.cache
def _unchanged_bf16():
    """The GPT under bf16 autocast without offloading: three tests read it (one compile a worker)."""
    return _run(True, policy="none")


@pytest.mark.parametrize("policy", ["none", "all"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_prediction_is_the_measured_peak_under_autocast(policy, bf16):
    measured, report, _ = _unchanged_bf16() if (bf16, policy) == (True, "none") else _run(bf16, policy=policy)
    code = report.compiled_memory()
    assert report.expected_memory() is code or report.expected_memory() == code
    predicted = code.peak_bytes - report.start_bytes
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)


def test_a_budget_under_autocast_is_met_on_the_measured_bytes():
    """60% of the step's own peak without offloading, under bf16 autocast: the FX fit overshoots (it
    counts what Inductor fuses), the code's peak is the verdict, and the measured step meets it."""
    base, unchanged, _ = _unchanged_bf16()
    budget = unchanged.start_bytes + int(0.6 * base)
    measured, report, said = _run(True, policy="auto", memory_budget=budget, bandwidth="0.01GB")
    assert measured + report.start_bytes <= budget * 1.03, (measured, budget)
    assert report.compiled_memory().peak_bytes <= budget * 1.03
    assert re.search(r"memory_budget: [\d.]+ MiB(, \d+% of that)? \(met\)", report.summary()), report.summary()
    assert not [s for s in said if "is not met by the code" in s], said


def test_a_plan_that_changes_nothing_runs_inductors_own_code():
    """A plan that offloads nothing, stopped before anything is lowered, is compiled as Inductor
    compiles it: the step holds what Inductor's holds, under bf16 autocast too."""
    inductor, _, _ = _unchanged_bf16()
    measured, report, _ = _run(True, policy="auto", min_bytes="1GiB", verify_peak=True)
    assert not report.offloaded, report.table()
    assert measured == inductor, (measured, inductor)


def _gpt_budget(op_time):
    """The built-in GPT under bf16 autocast at ``memory_budget=0.5``, op calls and compute priced
    fixed (no timing on this machine decides the plan): measured peak, the budget, the report."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = example("gpt")
    backend = fxoffload.backend(
        offload_cpu=True, inner="inductor", min_bytes=0, memory_budget=0.5, op_time=op_time,
        compute_rates={"flops": 1e11, "memory_bandwidth": 1e10},
    )  # fmt: skip
    compiled = torch.compile(model, backend=backend)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            loss = compiled(*batch)
        loss.backward()

    measured, _ = measured_steady_step(model, step)
    (report,) = backend.reports
    return measured + report.start_bytes, report.memory_budget, report


def test_a_budget_missed_where_the_code_holds_saved_activations_is_planned_again(monkeypatch):
    """The fit predicts a little over the budget, its peak at a dropout the model cannot lower; the
    code peaks at the next attention, in the forward, with saved activations on the device. Planned
    again for a lower target, the code meets the budget; the rule broken on purpose (the fit taken
    for the lowest reachable because the model is over its target), it is missed."""
    measured, budget, report = _gpt_budget(op_time=1e-4)
    assert report.replans and measured <= budget * 1.03, (measured, budget, report.replans)
    monkeypatch.setattr(compile_module, "fit_is_lowest", lambda pair, code, target: pair.memory_after.peak_bytes > target)
    measured, budget, report = _gpt_budget(op_time=1e-4)
    assert not report.replans and measured > budget * 1.03, (measured, budget)
