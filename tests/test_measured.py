"""Time from the device the step runs on: each copy's window, duration and stall measured in the first
steps (``runtime.timing``), shown beside the plan's, and ``auto`` planned again from them.

On a CPU the same path runs with ``offload_cpu=True`` and the copy engine's emulated link: a copy
takes at least its bytes over the link's speed there, as on a device's copy engine. The model is
mispriced on purpose (``compute_rates`` about 1000x slow, as the FLOP table priced an H100's fused code 3x
slow, ``tests/test_kernel_times.py``): it sees windows the device does not have, and ``auto``
offloads what cannot hide until the measurement says so.
"""

import time

import pytest
import torch

import fxoffload
from fxoffload import ir
from fxoffload.runtime.timing import Recording
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

from .conftest import assert_same, train_step

LINKS = {"50MB": 50e6, "500MB": 500e6, "5GB": 5e9}
MISPRICED = {"compute_rates": {"flops": 1e9, "memory_bandwidth": 1e8}}
# Each wait placed at once after its copy (no compute between): a copy of 64 KiB or more stalls by
# about its time on a 50 MB/s link, 1.3 ms or more, however fast or loaded the machine is.
STALLS = {"prefetch": 0}


def _backend(link, **options):
    return fxoffload.backend(
        offload_cpu=True, inner="aot_eager", policy="auto", min_bytes="16KiB", cpu_link_bandwidth=link,
        **{**MISPRICED, **options},
    )  # fmt: skip


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, dropout=0.0)
    return GPT(cfg), gpt_batch(cfg, 8)


def _train(backend, steps, bf16=False):
    model, batch = _gpt()
    compiled = torch.compile(model, backend=backend)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = compiled(*batch)
        loss.backward()
    (report,) = backend.reports
    return report


def test_a_recording_times_one_copy_each_way_on_the_link():
    """1 MiB over a 100 MB/s link: the copy takes at least 10.5 ms; issued, then 2 ms of work, then
    waited on: the window is the 2 ms, and the compute waits the rest of the copy."""
    src = torch.randn(1 << 18)  # 1 MiB
    recording = Recording(ir.transfer_name(7, "")).start()
    host = ir.OFFLOAD(src, [], 100e6, ir.transfer_name(7, "x"))
    time.sleep(0.002)
    host = ir.WAIT(host, src, [])
    recording.close()
    back = ir.WAIT(ir.RELOAD(host, src.device, [], 100e6, ir.transfer_name(7, "x")), host, [])
    assert recording.complete
    d2h, h2d = recording.stop()
    torch.testing.assert_close(back, src)
    nbytes = src.numel() * 4
    for t in (d2h, h2d):
        assert (t.name, t.graph_id, t.tensor, t.nbytes) == ("7:x", 7, "x", nbytes)
        assert t.copy_s >= nbytes / 100e6 * 0.999, t
    assert d2h.direction == "d2h" and d2h.window_s >= 0.002 and d2h.stall_s >= d2h.copy_s - d2h.window_s - 1e-3
    assert h2d.window_s < 0.002 and h2d.stall_s > 0.005, h2d  # waited on at once: the whole copy stalls


def test_copies_of_other_graphs_and_calls_are_not_taken():
    recording = Recording(ir.transfer_name(1, "")).start()
    src = torch.randn(256)
    other = ir.WAIT(ir.OFFLOAD(src, [], 0.0, ir.transfer_name(2, "y")), src, [])  # another graph
    recording.close()
    late = ir.WAIT(ir.OFFLOAD(src, [], 0.0, ir.transfer_name(1, "y")), src, [])  # after the recorded call
    assert recording.stop() == [] and other.shape == late.shape


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("link", sorted(LINKS))
def test_each_copy_is_measured_and_shown_beside_the_plan(link, bf16):
    """``max_replans=0``: measured and reported, not acted on. Every offloaded tensor's row has its
    measured copy times, windows and stall; a copy takes at least its bytes over the link; the report
    gives the step's stall and the bound (the measured link times the forward's compute)."""
    report = _train(_backend(link, max_replans=0), steps=3, bf16=bf16)
    assert report.offloaded and not report.replans
    for r in report.offloaded:
        assert None not in (r.measured_d2h_ms, r.measured_h2d_ms, r.measured_fw_copy_window_ms, r.measured_stall_ms), r
        assert r.measured_d2h_ms >= r.nbytes / LINKS[link] * 1e3 * 0.999, r
        assert r.measured_h2d_ms >= r.nbytes / LINKS[link] * 1e3 * 0.999, r
        assert r.stall_ms == 0.0 and r.fw_copy_window_ms > 0  # the mispriced model: every copy hides
    assert report.measured_forward_ms > 0 and report.measured_stall_ms >= 0
    stall_fw = sum(r.measured_stall_ms for r in report.offloaded)
    assert report.measured_stall_ms == pytest.approx(stall_fw)
    assert 0 < report.offload_bound_bytes <= LINKS[link] * report.measured_forward_ms / 1e3
    summary = report.summary()
    assert "measured in a step: forward" in summary and "that can leave without a stall" in summary
    assert "measured copy ms out/in, stall pred/meas" in report.table(width=250)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_auto_keeps_what_stalled_and_plans_again_once(bf16):
    """The mispriced plan's copies stall the step (waited on at once, on a 50 MB/s link): once
    measured, the graph is planned again with the measured times, every tensor whose copy stalled
    kept on the device (``measured_stall``, its measured figures on its row), and it is not planned
    again after."""
    backend = _backend("50MB", **STALLS)
    report = _train(backend, steps=6, bf16=bf16)
    measured = [r for r in report.replans if r.startswith("measured in the first steps")]
    assert len(measured) == 1, report.replans
    kept = [r for r in report.saved if r.reason_code == "measured_stall"]
    assert kept and all(r.decision == "keep" and r.measured_stall_ms > 0 for r in kept), kept
    assert not [r for r in report.offloaded if r.name in {k.name for k in kept}]


def test_the_plan_made_again_trains_like_eager():
    model, batch = _gpt()
    got = train_step(model, batch, _backend("50MB", **STALLS), steps=5)  # planned again at the third step
    assert_same(got, train_step(model, batch, steps=5), rtol=1e-4, atol=1e-5)


def test_without_the_replan_the_stall_stays():
    """The rule broken on purpose (``max_replans=0``): the copies that stall are kept offloaded, and
    the measured stall says so."""
    report = _train(_backend("50MB", max_replans=0, **STALLS), steps=4)
    assert not report.replans and report.offloaded
    assert report.measured_stall_ms > len(report.offloaded), report.summary()  # over 1 ms a copy
    assert not [r for r in report.saved if r.reason_code == "measured_stall"]


def test_the_offloads_on_top_of_torchs_recompute_are_measured_too():
    """``recompute="inductor"`` adds "auto"'s offloads on top of torch's partition: those that stalled
    are kept on the device once measured, and torch's partitioner recomputes more instead, where the
    budget then needs it. Budgets are of the memory model, the step trains like eager."""
    model, batch = _gpt()
    backend = _backend("50MB", memory_budget=0.9, recompute="inductor", **STALLS)
    got = train_step(model, batch, backend, steps=5)
    assert_same(got, train_step(model, batch, steps=5), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    assert [r for r in report.replans if r.startswith("measured in the first steps")], report.replans
    kept = {r.name for r in report.saved if r.reason_code == "measured_stall"}
    assert kept and not kept & {r.name for r in report.offloaded}, report.table()
