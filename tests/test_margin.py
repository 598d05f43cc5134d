"""The copy margin: how much faster than its model the device may compute before a copy called hidden
stalls (``DeviceRates.copy_margin``).

A plan priced from the built-in figures keeps ``FIRST_GUESS_MARGIN`` (copies counted 1.6x longer);
one priced from rates the user gave keeps none; once the first steps have timed the copies, the
margin is the measured spread of their windows below the scale the model was corrected by
(``Measured.margin``). On a CPU the built-in figures are made slower than the machine (as an H100's
FLOP table priced its backward 1.6x slow), so the device computes faster than the model: without
the margin ``auto``'s first plan stalls, with it that plan's copies hide.
"""

import dataclasses

import pytest
import torch

import fxoffload
from fxoffload.analysis import cost
from fxoffload.ir import TransferTime
from fxoffload.planning.decisions import PlanCosts
from fxoffload.planning.measured import MEASURED_MARGIN, Measured
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch


def _measured(fw=(), bw=()):
    return Measured((), tuple(fw), tuple(bw), {}, {})


@pytest.mark.parametrize(
    ("fw", "bw", "margin"),
    [
        ((1.0, 1.0, 1.0), (), MEASURED_MARGIN[0]),  # no spread: the floor
        ((), (), MEASURED_MARGIN[0]),  # nothing measured
        ((0.8, 1.0, 1.2), (), 0.25),  # median 1.0 over the lowest 0.8
        ((0.8, 1.0, 1.2), (0.5, 1.0, 1.0), 1.0),  # the wider phase: 1.0 / 0.5
        ((0.1, 1.0, 1.0), (), MEASURED_MARGIN[1]),  # bounded
        ((0.5,) + (1.0,) * 19, (), MEASURED_MARGIN[0]),  # from ten copies, the lowest tenth: one outlier is noise
    ],
)
def test_the_measured_margin_is_the_spread_of_the_windows_below_the_median(fw, bw, margin):
    assert _measured(fw, bw).margin == pytest.approx(margin)


def test_a_corrected_model_keeps_the_measured_margin_in_place_of_the_first_guess():
    rates = dataclasses.replace(cost.CPU_RATES, copy_margin=cost.FIRST_GUESS_MARGIN)
    costs = PlanCosts(rates, (0.0, 1.0), (0.0, 2.0), None)
    corrected = _measured((0.8, 1.0, 1.2), (1.0, 1.0)).corrected(costs)
    assert corrected.rates.copy_margin == pytest.approx(0.25)
    assert corrected.fw_starts == (0.0, 1.0) and corrected.bw_starts == (0.0, 2.0)


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, dropout=0.0, dim=128, seq=128)
    return GPT(cfg), gpt_batch(cfg, 8)


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread: the windows measured here are compared across runs, and a second worker of the suite
    on the other core moves a two-thread step's time by half."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _first_plan(**options):
    """``auto``'s first plan (never made again; or ``options``'), trained until its copies were timed:
    its report."""
    model, batch = _gpt()
    options = {"policy": "auto", **options}
    backend = fxoffload.backend(
        offload_cpu=True, cpu_link_bandwidth=200e6, min_bytes="16KiB", op_time=0.0, max_replans=0,
        inner="aot_eager", **options,
    )  # fmt: skip
    compiled = torch.compile(model, backend=backend)
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        compiled(*batch).backward()
        if backend.settled:
            break
    (report,) = backend.reports
    assert backend.settled and report.offloaded, report.summary()
    return report


@pytest.mark.parametrize(
    ("options", "margin"),
    [
        ({}, True),
        ({"compute_rates": {"flops": 1e12, "memory_bandwidth": 2e10}}, False),  # the user's rates
        ({"policy": "all"}, False),  # never planned again from measurements: placed on the figures
        ({"memory_budget": 0.7, "recompute": "fxoffload"}, False),  # the same
    ],
    ids=["auto", "rates-given", "all", "budget"],
)
def test_only_a_plan_priced_from_the_built_in_figures_and_made_again_from_measurements_keeps_the_margin(
    options, margin
):
    report = _first_plan(**options)
    said = f"copies planned {cost.FIRST_GUESS_MARGIN:.0%} longer than predicted"
    assert (said in report.summary()) is margin, report.summary()


def test_a_tensor_measured_again_without_a_stall_is_no_longer_one_that_stalled():
    """Round 0: A and B stall; judged again, A is offloaded again and hides in round 1 while C stalls:
    the last re-plan may offload A (and whatever else hid), keeps B and C."""

    def time(tensor, stall):
        return TransferTime(f"0:{tensor}", "d2h", 1 << 20, 1e-3, 1e-4, stall)

    first = Measured((time("A", 1e-3), time("B", 1e-3)), (), (), {}, {"A": 1e-3, "B": 1e-3})
    second = Measured((time("A", 0.0), time("C", 1e-3)), (), (), {}, {"C": 1e-3}).merged(first)
    assert second.stalls.keys() == {"B", "C"}
    assert second.keep().keys() == {"B", "C"}


def _priced(monkeypatch, ratio: float, by=min, margin: float | None = None):
    """The built-in CPU figures scaled so that ``by`` of the offloaded copies' window ratios (measured
    window over priced) is ``ratio``, as measured on a first plan at the built-in figures: how far those
    are off varies with the machine and its load (on the 2-core development machine the windows ran
    0.6-0.9x the figures)."""
    slow = by(_window_ratios(_first_plan())) / ratio  # a window priced ``slow`` times longer
    rates = cost.CPU_RATES
    monkeypatch.setattr(cost, "CPU_RATES", dataclasses.replace(
        rates, flops=rates.flops / slow, memory_bandwidth=rates.memory_bandwidth / slow
    ))  # fmt: skip
    if margin is not None:
        monkeypatch.setattr(cost, "FIRST_GUESS_MARGIN", margin)
    torch._dynamo.reset()


def _window_ratios(report) -> list[float]:
    """Each offloaded copy's measured window over the one its plan priced, both ways."""
    return [
        measured / priced for r in report.offloaded
        for measured, priced in ((r.measured_fw_copy_window_ms, r.fw_copy_window_ms),
                                 (r.measured_bw_copy_window_ms, r.bw_copy_window_ms))
        if measured and priced
    ]  # fmt: skip


def _first_plan_priced(monkeypatch, holds, ratio: float, by=min, margin: float | None = None, tries: int = 3):
    """``_first_plan`` on figures ``_priced`` from a run just before it, priced and measured again (up
    to ``tries`` pairs) until its measured stall ``holds``: the load of the machine (a test worker
    beside it) may move between the two runs of a pair, either way. The report of the last pair."""
    for _ in range(tries):
        with monkeypatch.context() as patch:
            _priced(patch, ratio, by, margin)
            report = _first_plan()
        if holds(report.measured_stall_ms):
            break
    return report


def test_a_first_plan_priced_slower_than_the_device_hides_its_copies(monkeypatch):
    """The device up to 1.25x faster than the figures, within the margin's 1.6x (the rest of the margin
    for the machine's load moving between the run that priced the figures and this one; a CI run
    measured a 0.126 ms stall once, with one pair). Without the margin it stalls: 3 pairs of 3."""
    report = _first_plan_priced(monkeypatch, lambda stall: stall < 0.1, 0.8)
    assert report.measured_stall_ms < 0.1, (sorted(_window_ratios(report)), report.table())


def test_without_the_margin_that_plan_stalls(monkeypatch):
    """Broken on purpose: no margin, the device 3x faster than the figures for every copy (as the
    H100 first was than its FLOP table). Not 2x: a clean-clone CI run's second plan ran beside a
    busier worker than the run that priced the figures, its windows twice as long, and every copy hid."""
    report = _first_plan_priced(monkeypatch, lambda stall: stall > 0.5, 1 / 3, by=max, margin=0.0)
    assert report.measured_stall_ms > 0.5, report.table()
