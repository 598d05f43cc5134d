"""The cost-model planner on real graphs, with fixed rates so that plans are deterministic."""

import pytest
import torch

from fxoffload.models import GPT, GPTConfig, gpt_batch

from .conftest import assert_same, cpu_backend, train_step

RATES = {"compute_rates": {"flops": 1e13, "memory_bandwidth": 1e12}}  # short windows: links matter


def _plan(policy="auto", **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(layers=3)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    backend = cpu_backend(inner="aot_eager", policy=policy, min_bytes="16KiB", **RATES, **options)
    result = train_step(model, batch, backend)
    (report,) = backend.reports
    return report, result, (model, batch)


def test_auto_offloads_only_what_it_can_hide():
    report, _, _ = _plan(bandwidth="4GB")
    offloaded, kept = report.offloaded, [r for r in report.saved if r.decision == "keep"]
    assert offloaded, report.table()
    assert report.predicted_stall_ms < 1e-6, "auto is near-zero overhead by construction"
    hidden_reasons = [r for r in kept if "cannot be hidden" in r.reason]
    assert hidden_reasons, "at 4 GB/s some copies do not fit"
    # Everything offloaded fits its windows on its own.
    for r in offloaded:
        assert r.d2h_ms <= r.fw_window_ms + 1e-9 and r.h2d_ms <= r.bw_window_ms + 1e-9


def test_a_faster_link_hides_more():
    slow, _, _ = _plan(bandwidth="1GB")
    fast, _, _ = _plan(bandwidth="100GB")
    assert fast.offloaded_bytes > slow.offloaded_bytes


def test_policy_all_reports_the_stall_it_costs():
    report, _, _ = _plan(policy="all", bandwidth="0.5GB")
    assert report.predicted_stall_ms > 0
    assert "predicted stall" in report.summary()


def test_plans_are_deterministic():
    a, _, _ = _plan(bandwidth="4GB")
    b, _, _ = _plan(bandwidth="4GB")
    assert [(r.name, r.decision, r.reason) for r in a.saved] == [(r.name, r.decision, r.reason) for r in b.saved]


def test_memory_budget_fraction_is_met_and_results_unchanged():
    report, got, (model, batch) = _plan(bandwidth="1GB", memory_budget=0.5)
    assert report.memory_budget == int(0.5 * report.predicted_peak_before)
    assert report.predicted_peak_after <= report.memory_budget * 1.03, report.summary()
    assert any("memory_budget" in r.reason for r in report.offloaded), "un-hidden offloads were needed"
    assert_same(got, train_step(model, batch), rtol=1e-4, atol=1e-5)


def test_memory_budget_in_bytes():
    report, _, _ = _plan(bandwidth="1GB", memory_budget="4MiB")
    assert report.memory_budget == 4 * 2**20
    assert report.predicted_peak_after <= 4 * 2**20 * 1.03


def test_unreachable_budget_warns_with_the_smallest_peak():
    with pytest.warns(RuntimeWarning, match=r"memory_budget 1.0 KiB cannot be reached: the smallest predicted peak is"):
        report, _, _ = _plan(memory_budget="1KiB")
    assert "NOT met" in report.summary()


def test_unreachable_budget_with_strict_raises():
    with pytest.raises(Exception, match=r"cannot be reached.*strict=True"):
        _plan(memory_budget="1KiB", strict=True)
