"""A plan whose copies all hid is made again where the model their measurement corrects has room for
more (``planning.measured.room``), never by the last re-plan (a round is left to take back what
stalls).

``auto``'s first plan counts each copy ``FIRST_GUESS_MARGIN`` longer than the built-in figures say
(a device faster than its model stalls less); where the first steps then measured every copy hiding,
what the margin kept on the device may hide too.
"""

import dataclasses
import importlib

import pytest
import torch

import fxoffload
from fxoffload.analysis.cost import FIRST_GUESS_MARGIN, DeviceRates
from fxoffload.analysis.lifetimes import GraphLifetimes
from fxoffload.compiler import copy_timer, watch
from fxoffload.options import OffloadOptions
from fxoffload.planning.decisions import PlanCosts
from fxoffload.planning.measured import ROOM_SHARE, Measured, measured_plan, room
from fxoffload.planning.plan import auto_offload_bytes, plan_offloads
from fxoffload.sizes import fmt_bytes
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

from .conftest import assert_same, auto_on_gpt, train_step
from .test_plan import saved

MiB = 1 << 20
# 10 forward and 10 backward nodes of 1 ms; the link 1 GB/s each way (a MiB copy takes 1.05 ms).
RATES = DeviceRates("test", flops=1e12, memory_bandwidth=1e11, d2h=1e9, h2d=1e9, launch=0.0, copy_margin=0.6)
STARTS = tuple(i * 1e-3 for i in range(11))
AUTO = OffloadOptions(policy="auto", min_bytes=0)


def _plan(costs, *sizes):
    """``auto``'s plan of tensors of ``sizes`` MiB, each released after forward node 3 and needed by
    backward node 7 (7 ms of compute to hide each way), priced by ``costs``."""
    records = [
        saved(f"t{i}", nbytes=int(mib * MiB), output_index=i, fw_last_use=3, bw_first_use=7)
        for i, mib in enumerate(sizes)
    ]  # fmt: skip
    lifetimes = GraphLifetimes(tuple(records), 10, 10, ("cuda",))
    return lifetimes, plan_offloads(lifetimes, AUTO, costs=costs)


def _measured(ratio: float, spread: float = 1.0) -> Measured:
    """Every window ``ratio`` times the model's (``spread``: the lowest of three at ``ratio / spread``),
    the link as modelled, nothing stalled."""
    ratios = (ratio / spread, ratio, ratio)
    return Measured((), ratios, ratios, {"d2h": (MiB, MiB / 1e9), "h2d": (MiB, MiB / 1e9)}, {})


def test_the_margin_keeps_a_tensor_that_the_measured_model_has_room_for():
    """Three 1.5 MiB tensors, 6 ms of forward to hide behind: copies counted 1.6x (the first guess's
    margin) take 2.5 ms, two fit; measured as modelled (the measured margin, 10%: 1.7 ms), three fit."""
    costs = PlanCosts(RATES, STARTS, STARTS)
    _, first = _plan(costs, 1.5, 1.5, 1.5)
    assert first.offloaded_bytes == 3 * MiB
    assert room(first, _measured(1.0), AUTO) == 1.5 * MiB
    assert room(first, _measured(0.5), AUTO) == 0  # the device twice as fast as modelled: no room
    assert room(first, _measured(1.0, spread=2.0), AUTO) == 0  # windows spread: the measured margin 100%


def test_room_is_what_a_plan_made_again_with_the_corrected_model_offloads():
    costs = PlanCosts(RATES, STARTS, STARTS)
    lifetimes, first = _plan(costs, 3, 2, 2, 1, 0.5)
    corrected = _measured(1.5).corrected(costs)
    again = plan_offloads(lifetimes, AUTO, costs=corrected)
    assert auto_offload_bytes(first, corrected, AUTO, None) == again.offloaded_bytes > first.offloaded_bytes
    assert room(first, _measured(1.5), AUTO) == again.offloaded_bytes - first.offloaded_bytes


def test_a_measurement_of_a_scaled_plan_is_taken_back_to_the_model_as_it_came():
    """A plan made from a measurement has its node times scaled already (``PlanCosts.scale``): the next
    measurement's ratios are against the model as it came, and are applied to it, not to the scaled."""
    halved = dataclasses.replace(
        _measured(0.5).corrected(PlanCosts(RATES, STARTS, STARTS)), rates=dataclasses.replace(RATES, copy_margin=0.1)
    )  # fmt: skip
    assert halved.scale == (0.5, 0.5)
    _, first = _plan(halved, 1.5, 1.5, 1.5)
    assert first.offloaded_bytes == 1.5 * MiB  # 3 ms of forward: one copy of 1.7 ms
    assert room(first, _measured(1.0), AUTO) == 3 * MiB  # at 1x the model as it came (6 ms), three


def test_less_than_a_compile_is_worth_is_no_room():
    costs = PlanCosts(RATES, STARTS, STARTS)
    _, first = _plan(costs, 1.5, 1.5, 1.5, 100)  # 104.5 MiB saved: 1.5 MiB more is under ROOM_SHARE of it
    assert 1.5 * MiB < ROOM_SHARE * 104.5 * MiB
    assert room(first, _measured(1.0), AUTO) == 0


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, dropout=0.0, dim=128, seq=128)
    return GPT(cfg), gpt_batch(cfg, 8)


def _windows(m: Measured, factor: float) -> dict:
    """Every window measured ``factor`` times the model's, whatever this machine's load."""
    return {"fw_ratios": (factor,) * len(m.fw_ratios), "bw_ratios": (factor,) * len(m.bw_ratios)}


def _rounds(monkeypatch, plan_round):
    """Each plan's measurement forced: ``plan_round(k, offloaded, earlier)`` gives the k-th plan measured
    (its offloads, and the earlier plans') a factor on its windows and the tensors reported stalled.
    The offloads of each plan measured, and their bytes."""
    rounds: list[frozenset[str]] = []
    nbytes: list[int] = []
    stalling: set[str] = set()
    original = watch.measured_plan

    def forced(plan, times, forward_s=None):
        m = original(plan, times, forward_s)
        names = frozenset(d.saved.name for d in plan.offloaded)
        factor, stalls = plan_round(len(rounds), plan, rounds)
        stalling.clear()
        stalling.update(stalls)
        rounds.append(names)
        nbytes.append(plan.offloaded_bytes)
        return dataclasses.replace(m, stalls={n: 0.1 for n in stalls}, **_windows(m, factor))

    monkeypatch.setattr(watch, "measured_plan", forced)
    monkeypatch.setattr(watch, "stalled", lambda t: t.tensor in stalling)
    return rounds, nbytes


def _measured_slow(monkeypatch, factor: float):
    """Every window measured ``factor`` times the model's (a device that much slower than the model),
    nothing reported stalled."""
    _rounds(monkeypatch, lambda k, plan, earlier: (factor, set()))


def _train(max_replans: int, steps: int = 8):
    """``auto`` on a 500 MB/s link for ``steps`` steps: the backend, and the steps' loss and gradients."""
    model, batch = _gpt()
    backend = fxoffload.backend(
        offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=500e6, inner="aot_eager",
        op_time=0.0, max_replans=max_replans,
    )  # fmt: skip
    return backend, train_step(model, batch, backend, steps=steps)


def _offloaded(backend) -> int:
    (report,) = backend.reports
    return sum(r.nbytes for r in report.offloaded)


def test_auto_offloads_more_where_every_copy_hid_with_room(monkeypatch):
    """On a 500 MB/s link the first plan keeps tensors whose copies would not hide with the margin; the
    first steps measure the windows 4x the model's (forced) and no stall: planned again, it
    offloads the bytes the corrected model has room for, says so, and trains like eager."""
    _measured_slow(monkeypatch, 4.0)
    first, _ = _train(max_replans=0)  # the first plan, never made again
    backend, result = _train(max_replans=2)
    (report,) = backend.reports
    (why,) = report.replans
    more = _offloaded(backend) - _offloaded(first)
    assert more > 0 and "every copy hid" in why and f"room for {fmt_bytes(more)} more" in why, (why, more)
    assert backend.settled
    model, batch = _gpt()
    assert_same(result, train_step(model, batch, None, steps=8))


def test_the_last_replan_never_offloads_more(monkeypatch):
    """``max_replans=1``: the one re-plan is the last. Broken on purpose if the last round may grow: a
    plan whose copies were never measured would be the last, its stalls never taken back."""
    _measured_slow(monkeypatch, 4.0)
    backend, _ = _train(max_replans=1, steps=5)
    (report,) = backend.reports
    assert not report.replans and backend.settled, report.replans


def test_a_budget_never_plans_again_for_more(monkeypatch):
    """With a memory_budget (``recompute="inductor"``: "auto"'s offloads on top of torch's partition)
    the peak is the code's to judge: its copies hiding with room is no reason to compile again."""
    _measured_slow(monkeypatch, 4.0)
    model, batch = _gpt()
    backend = fxoffload.backend(
        offload_cpu=True, min_bytes="16KiB", cpu_link_bandwidth=500e6, inner="aot_eager", op_time=0.0,
        memory_budget=0.9, recompute="inductor",
    )  # fmt: skip
    train_step(model, batch, backend, steps=5)
    (report,) = backend.reports
    assert report.offloaded and not [r for r in report.replans if "every copy hid" in r], report.replans


def test_a_plan_made_for_more_that_then_stalls_gives_back_no_more_than_it_took(monkeypatch):
    """Round 1: every copy hid (windows forced 4x the model's), planned again for more. Round 2: every
    copy of that plan stalled (forced). The last re-plan is the first plan again, as it was: what hid
    together, where the tensors that hid under the plan made for more are none. Broken on purpose
    without ``CallWatch.back_to_hidden``: every tensor kept (on this CPU, without the forcing, 500
    MB/s in bf16 settled at 0.12-0.59 MiB where the first plan's 1.09 MiB had hid)."""
    rounds, nbytes = _rounds(monkeypatch, lambda k, plan, earlier: (
        4.0, {d.saved.name for d in plan.offloaded} if k == 1 else set()))  # fmt: skip
    backend, result = _train(max_replans=2, steps=10)
    (report,) = backend.reports
    # the third: the last plan's, timed. Made anew, the plan for more need not hold all the first's.
    assert len(rounds) == 3 and nbytes[0] < nbytes[1], (rounds, nbytes)
    assert len(report.replans) == 2 and "made again as it was" in report.replans[1], report.replans
    assert {r.name for r in report.offloaded} == rounds[0] == rounds[2]
    model, batch = _gpt()
    assert_same(result, train_step(model, batch, None, steps=10))


def test_the_plan_gone_back_to_may_be_one_made_from_a_measurement(monkeypatch):
    """``max_replans=3``: the first plan hid (windows as modelled), planned for more; that one hid (8x),
    planned for more; every copy of the third stalled: the last re-plan is the second plan again,
    made from the measurement it was made from."""
    factors = (1.0, 8.0, 8.0, 8.0)
    rounds, nbytes = _rounds(monkeypatch, lambda k, plan, earlier: (
        factors[k], {d.saved.name for d in plan.offloaded} if k == 2 else set()))  # fmt: skip
    backend, result = _train(max_replans=3, steps=12)
    (report,) = backend.reports
    assert len(rounds) == 4 and nbytes[0] < nbytes[1] < nbytes[2], (nbytes, report.replans)
    assert "made again as it was" in report.replans[2] and rounds[3] == rounds[1], (report.replans, rounds)
    model, batch = _gpt()
    assert_same(result, train_step(model, batch, None, steps=12))


def test_where_what_hid_under_the_plan_made_for_more_is_more_it_is_kept(monkeypatch):
    """The first plan hid, planned for more; one tensor of that plan stalled (its smallest new one): what
    hid under it is more bytes than the first plan, so the last re-plan offloads only that (``hidden_only``),
    not the first plan again."""

    def plan_round(k, plan, earlier):
        if k != 1:
            return 4.0, set()
        new = [d.saved for d in plan.offloaded if d.saved.name not in earlier[0]]
        return 4.0, {min(new, key=lambda t: t.nbytes).name}

    rounds, nbytes = _rounds(monkeypatch, plan_round)
    backend, _ = _train(max_replans=2, steps=10)
    (report,) = backend.reports
    assert len(report.replans) == 2 and "only the" in report.replans[1], (report.replans, nbytes)
    assert nbytes[2] > nbytes[0] and rounds[2] < rounds[1], (nbytes, rounds)


def _priced_fast():
    """``auto`` on the built-in GPT with compute priced far faster than this CPU runs it, the link at
    1 GB/s: no copy can hide on the model, so its first plan offloads nothing (``not_hidden``). Six
    steps: the backend, the bytes offloaded after each, and the losses."""
    backend, losses, offloaded = auto_on_gpt(
        6, cpu_link_bandwidth=1e9, compute_rates={"flops": 1e16, "memory_bandwidth": 1e15}
    )
    return backend, offloaded, losses


def test_a_first_plan_that_offloads_nothing_learns_from_the_forwards_time():
    """No copy to time: the forward is timed instead (``measured_plan``'s one ratio for both phases),
    and the model it corrects has room, so the graph is planned again and offloads (the report says
    why). The losses do not move."""
    backend, offloaded, losses = _priced_fast()
    assert offloaded[0] == 0, offloaded
    (report,) = backend.reports
    assert report.replans and "offloaded nothing, and the model corrected by the forward's measured time" in (
        report.replans[0]
    ), report.replans
    assert offloaded[-1] > 0, offloaded
    assert max(losses) - min(losses) < 1e-5, losses


def test_without_the_forwards_time_a_plan_that_offloads_nothing_stays_so(monkeypatch):
    """The rule taken away (no plan is judged to learn without copies): nothing is timed, nothing
    planned again, nothing offloaded, whatever the device."""
    backend_module = importlib.import_module("fxoffload.compiler.backend")  # ``backend`` is also a function
    monkeypatch.setattr(backend_module, "learns_without_copies", lambda plan, options: False)
    monkeypatch.setattr(copy_timer, "learns_without_copies", lambda plan, options: False)
    backend, offloaded, _ = _priced_fast()
    (report,) = backend.reports
    assert offloaded == [0] * 6 and not report.replans, (offloaded, report.replans)


def test_a_forward_timed_alone_gives_one_ratio_and_keeps_the_first_guess_margin():
    """``measured_plan`` with no copy and the forward's time: that time over the model's forward, for
    both phases; no spread of windows, so the margin stays the first guess's (``FIRST_GUESS_MARGIN``),
    not the measured one's 10%; and no forward time, no ratio."""
    costs = PlanCosts(RATES, STARTS, STARTS)  # a 10 ms forward on the model
    _, first = _plan(costs, 1.5)
    m = measured_plan(first, [], 0.02)
    assert m.forward_only and m.fw_ratios == m.bw_ratios == (pytest.approx(2.0),)
    assert m.margin == FIRST_GUESS_MARGIN and _measured(2.0).margin == 0.1
    assert measured_plan(first, []).fw_ratios == ()


def test_no_room_where_the_plan_made_again_could_not_lower_the_peak_by_two_percent():
    """The same room (1.5 MiB more, 4.5 MiB offloaded in all), judged against the predicted peak
    without offloading (``PlanCosts.baseline``): under 100 MiB it is worth a compile; at 300 MiB the
    4.5 MiB cannot lower it by 2% (``planning.worth``), the plan made again would offload nothing
    more, and no compile is asked for (a GPT at 200 MB/s compiled for nothing before)."""
    from fxoffload.analysis.memory import MemoryPoint, MemoryTimeline

    def baseline(mib):
        return MemoryTimeline((MemoryPoint("forward", "x", {"saved": int(mib * MiB)}),))

    for peak, more in ((100, 1.5 * MiB), (300, 0)):
        costs = PlanCosts(RATES, STARTS, STARTS, baseline=baseline(peak))
        _, first = _plan(costs, 1.5, 1.5, 1.5)
        assert room(first, _measured(1.0), AUTO) == more, peak
