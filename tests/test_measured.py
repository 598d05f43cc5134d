"""Time from the device the step runs on: each copy's window, duration and stall measured in the first
steps (``runtime.timing``), shown beside the plan's, and ``auto`` planned again from them.

On a CPU the same path runs with ``offload_cpu=True`` and the copy engine's emulated link: a copy
takes at least its bytes over the link's speed there, as on a device's copy engine. The model is
mispriced on purpose (``compute_rates`` about 1000x slow, as the FLOP table priced an H100's fused code 3x
slow, ``tests/test_kernel_times.py``): it sees windows the device does not have, and ``auto``
offloads what cannot hide until the measurement says so.
"""

import copy
import dataclasses
import functools
import time

import pytest
import torch

import fxoffload
from fxoffload import ir
from fxoffload.compiler import watch
from fxoffload.planning import measured
from fxoffload._compat import storage_expired, storage_weak_ref
from fxoffload.runtime import copy_stats, reset_copy_stats, transfers
from fxoffload.runtime.host_pool import host_buffer_ranges, keep_on_device
from fxoffload.runtime import timing
from fxoffload.runtime.timing import Recording
from fxoffload.runtime.transfers import copies_switched_off, switch_copies_off, switch_copies_on
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

from .conftest import assert_same, calls_cost_the_step, measured_steady_step, no_copy_stalls, routed_tokens, train_step

LINKS = {"50MB": 50e6, "500MB": 500e6, "5GB": 5e9}
MISPRICED = {"compute_rates": {"flops": 1e9, "memory_bandwidth": 1e8}}
# Each wait placed at once after its copy (no compute between): a copy of 64 KiB or more stalls by
# about its time on a 50 MB/s link, 1.3 ms or more, however fast or loaded the machine is.
STALLS = {"prefetch": 0}


def _backend(link, **options):
    options = {"inner": "aot_eager", **MISPRICED, **options}
    return fxoffload.backend(offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=link, **options)


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
    waited on: the window is the 2 ms, and the compute waits the rest of the copy, less what ran
    while the calls themselves did (on a loaded CI machine the offload's call took 9.4 ms, and the
    stall was 6.5 ms, not the 7.2 ms or more that copy less window less 1 ms asked)."""
    src = torch.randn(1 << 18)  # 1 MiB
    recording = Recording(ir.transfer_name(7, "")).start()
    host = ir.OFFLOAD(src, [], 100e6, ir.transfer_name(7, "x"))
    time.sleep(0.002)
    host = ir.WAIT(host, src, [])
    recording.close()
    called = time.perf_counter()
    back = ir.WAIT(ir.RELOAD(host, src.device, [], 100e6, ir.transfer_name(7, "x")), host, [])
    spent = time.perf_counter() - called  # the reload's call, the Python before its wait, the wait
    assert recording.complete
    d2h, h2d = recording.stop()
    torch.testing.assert_close(back, src)
    nbytes = src.numel() * 4
    for t in (d2h, h2d):
        assert (t.name, t.graph_id, t.tensor, t.nbytes) == ("7:x", 7, "x", nbytes)
        assert t.copy_s >= nbytes / 100e6 * 0.999, t
    # A copy cannot end before its issue plus its time on the link: what the compute thread spent
    # from the offload's call to the end of its wait (its calls, the window, the stall) covers it.
    assert d2h.direction == "d2h" and d2h.window_s >= 0.002, d2h
    assert d2h.op_s + d2h.window_s + d2h.stall_s >= d2h.copy_s - 1e-3, d2h
    # Waited on at once: the window ends where the wait starts, so it and the stall fit in the time
    # the calls took (not "window < 2 ms" nor "< half the copy": on a loaded machine the Python
    # between the reload and its wait took 2.4 ms in one CI run and 5.5 ms in another). A window
    # closed at the wait's end would hold the stall twice: about 2 x 10.5 ms against 10.5 spent.
    assert h2d.window_s + h2d.stall_s <= spent + 1e-4, (h2d, spent)
    assert h2d.op_s + h2d.window_s + h2d.stall_s >= h2d.copy_s - 1e-3, h2d


def test_a_window_holds_compute_only_not_another_copys_stall():
    """Copy a (1 MiB over 100 MB/s, 10.5 ms) issued, 2 ms of work, copy b issued behind it on the
    link and waited on at once (b's wait stalls for both copies, about 21 ms), then a waited on: a's
    window is the 2 ms of compute, not the 23 ms the compute thread spent between its issue and
    its wait. With b's stall left in, a plan that stalls teaches the model a slower compute (on an
    H100: a step predicted 1.4-1.9x the device's) and the plan made from it stalls again."""
    a, b = torch.randn(1 << 18), torch.randn(1 << 18)
    recording = Recording(ir.transfer_name(7, "")).start()
    host_a = ir.OFFLOAD(a, [], 100e6, ir.transfer_name(7, "a"))
    issued = time.perf_counter()
    time.sleep(0.002)
    host_b = ir.WAIT(ir.OFFLOAD(b, [], 100e6, ir.transfer_name(7, "b")), b, [])
    between = time.perf_counter() - issued  # a's issue to its wait, b's stall in it
    host_a = ir.WAIT(host_a, a, [])
    recording.close()
    for host, src, name in ((host_a, a, "a"), (host_b, b, "b")):
        ir.WAIT(ir.RELOAD(host, src.device, [], 0.0, ir.transfer_name(7, name)), host, [])
    times = {t.tensor: t for t in recording.stop() if t.direction == "d2h"}
    # On a loaded machine b's call may take milliseconds and its stall be shorter: still a stall.
    assert times["b"].stall_s > 0.005, times
    assert 0.002 <= times["a"].window_s <= between - times["b"].stall_s / 2, (between, times)


def test_a_window_loses_what_the_other_copies_took_inside_it_and_nothing_else():
    """Copy a's window, 10 ms from its issue (at 0) to its wait: b issued inside it (its call 0.3 ms)
    and waited on inside it (a 2 ms stall, 0.1 ms of the wait's own work); c issued before a's issue
    and waited on after a's wait. a keeps 10 - 0.3 - 2 - 0.1 = 7.6 ms; b's own window (1 ms) has
    nothing of the others in it; c's loses a's and b's calls and b's stall, 3.1 ms."""
    def copy(name, window, stall=0.0):
        return ir.TransferTime(name, "d2h", 1, window, 1e-3, stall)

    a = timing.Resolved(copy("a", 0.010), issued=0.0, waited=0.010, issue_op=0.5e-3, wait_op=0.2e-3)
    b = timing.Resolved(copy("b", 0.001, stall=0.002), issued=0.002, waited=0.003, issue_op=0.3e-3, wait_op=0.1e-3)
    c = timing.Resolved(copy("c", 0.020), issued=-0.001, waited=0.019)
    out = {t.name: t.window_s for t in timing.compute_windows([a, b, c])}
    assert out == pytest.approx({"a": 0.0076, "b": 0.001, "c": 0.020 - 0.0031}), out


def test_a_measurement_of_a_plan_made_from_measurements_is_of_the_model_as_it_came():
    """A plan whose model was scaled by an earlier measurement (0.5x) and whose copies' windows are
    measured just as that plan priced them: compute runs 0.5x the model as it came, as before, not
    1.0x. Merged with the earlier measurement, the two agree (the rounds of ``auto``'s re-plans)."""
    backend = _backend("5GB", max_replans=0)
    _train(backend, steps=1)
    (w,) = backend._watches
    plan = w.pair.plan
    assert plan.offloaded and plan.costs.scale == (1.0, 1.0)

    def as_priced(plan):
        times = []
        for d in plan.offloaded:
            fw, bw = measured._predicted_window(d, plan.costs, "d2h"), measured._predicted_window(d, plan.costs, "h2d")
            name = ir.transfer_name(w.pair.graph_id, d.saved.name)
            times += [ir.TransferTime(name, "d2h", 1, fw, 1e-6, 0.0), ir.TransferTime(name, "h2d", 1, bw, 1e-6, 0.0)]
        return times

    first = measured.measured_plan(plan, [dataclasses.replace(t, window_s=t.window_s / 2) for t in as_priced(plan)])
    assert (first.fw_scale, first.bw_scale) == pytest.approx((0.5, 0.5))
    again = dataclasses.replace(plan, costs=first.corrected(plan.costs))
    assert again.costs.scale == pytest.approx((0.5, 0.5))
    second = measured.measured_plan(again, as_priced(again)).merged(first)
    assert (second.fw_scale, second.bw_scale) == pytest.approx((0.5, 0.5))


def test_copies_of_other_graphs_and_calls_are_not_taken():
    recording = Recording(ir.transfer_name(1, "")).start()
    src = torch.randn(256)
    other = ir.WAIT(ir.OFFLOAD(src, [], 0.0, ir.transfer_name(2, "y")), src, [])  # another graph
    recording.close()
    late = ir.WAIT(ir.OFFLOAD(src, [], 0.0, ir.transfer_name(1, "y")), src, [])  # after the recorded call
    assert recording.stop() == [] and other.shape == late.shape


class _Event:
    """A device's timing event, at ``t`` seconds of that device's own clock: like torch's, it has
    no time against another device's event."""

    def __init__(self, device, t):
        self.device, self.t = torch.device(device), t

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        if end.device != self.device:
            raise RuntimeError(f"events of {self.device} and {end.device}")
        return (end.t - self.t) * 1e3


def _stamped(name, device, issue, wait, stall):
    """An offload on ``device`` issued at ``issue``, waited on at ``wait`` for ``stall`` seconds."""
    event = functools.partial(_Event, device)
    return timing.Stamps(
        ir.transfer_name(7, name), "d2h", 1 << 20, torch.device(device), issue=event(issue),
        copy_start=event(issue), copy_end=event(wait + stall), wait_start=event(wait),
        wait_end=event(wait + stall), waited=True,
    )  # fmt: skip


def test_a_recording_of_two_devices_times_each_on_its_own_clock():
    """A graph whose copies run on two GPUs: cuda:1's events have no time against cuda:0's (torch
    raises), and a stall on cuda:1 is no part of a window on cuda:0. Each copy is placed against a
    stamp of its own device; a's window keeps its 10 ms though b's stall falls inside it by the
    clocks' numbers."""
    recording = Recording(ir.transfer_name(7, "")).start()
    recording.take(_stamped("a", "cuda:0", 0.0, 0.010, 0.0))
    recording.take(_stamped("b", "cuda:1", 0.002, 0.004, 0.003))
    recording.close()
    a, b = recording.stop()
    assert (a.tensor, b.tensor) == ("a", "b")
    assert (a.window_s, b.window_s, b.stall_s) == pytest.approx((0.010, 0.002, 0.003))


def test_reading_the_copies_times_never_fails_a_step(monkeypatch, caplog):
    """An error where the copies' events are read (a device's, say) is logged, and training goes on."""
    def fails(self, origin):
        raise RuntimeError("an event of another device")

    monkeypatch.setattr(timing.Stamps, "resolve", fails)
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", policy="all", min_bytes="16KiB")
    step = _stepper(backend)
    with caplog.at_level("WARNING", logger="fxoffload"):
        for _ in range(4):
            step()
    assert "reading its copies' times failed (an event of another device)" in caplog.text


def test_a_recompile_drops_the_recording_of_the_old_codes_copies():
    """A plan compiled again while a recording is open (its forward ran, its reloads have not):
    the old code's copies are no longer stamped, and the new code's are timed from its second call."""
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", policy="all", min_bytes="16KiB")
    model, batch = _gpt()
    compiled = torch.compile(model, backend=backend)
    compiled(*batch).backward()
    loss = compiled(*batch)  # the second call: its copies are being recorded
    (w,) = backend._watches
    old = w.timer.recording
    reload = ir.transfer_name(w.pair.graph_id, w.pair.plan.offloaded[0].saved.name)
    assert old in timing._open and timing.wanted(reload, "h2d")  # (other tests' may be open too)
    w.timer.restart()
    assert old not in timing._open and not timing.wanted(reload, "h2d")
    loss.backward()
    for _ in range(3):  # as from a compile: its second call recorded, read at the third
        compiled(*batch).backward()
    assert w.timer.done and w.timer.recording is None


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
    # the link measured at its own speed (the engine's clock), to float rounding
    assert 0 < report.offload_bound_bytes <= LINKS[link] * report.measured_forward_ms / 1e3 * (1 + 1e-9)
    # On a CPU the host is the compute stream: its time in the forward call is the forward's.
    assert report.measured_forward_host_ms == pytest.approx(report.measured_forward_ms, rel=0.05)
    summary = report.summary()
    assert "measured in a step: forward" in summary and "that can leave without a stall" in summary
    assert "(the host's call" in summary
    assert "measured copy ms out/in, stall pred/meas" in report.table(width=250)


@pytest.fixture
def cannot_compile_again(monkeypatch):
    """Compiling a graph again at run time fails (as it cannot be with dynamic shapes): the watch
    falls back on switching copies off in the compiled code."""

    def fail(*args, **kwargs):
        raise RuntimeError("compiling again refused by the test")

    monkeypatch.setattr(watch, "_compile_outside_dynamo", fail)


def _stepper(backend, bf16=False):
    model, batch = _gpt()
    compiled = torch.compile(model, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = compiled(*batch)
        loss.backward()

    return step


def _stalled_rounds(bf16, steps):
    """``steps`` steps of ``auto`` on copies that stall: the stepper, the report and its rounds of
    plans made again from what was measured."""
    backend = _backend("50MB", **STALLS)
    step = _stepper(backend, bf16)
    for _ in range(steps):
        step()
    (report,) = backend.reports
    return step, report, [r for r in report.replans if r.startswith("measured in the first steps")]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_auto_plans_again_from_what_stalled_and_compiles_it(bf16):
    """The mispriced plan's copies stall the step (waited on at once, on a 50 MB/s link): once
    measured, the graph is planned again with the measured times, the stalled tensors judged again on
    them (the corrected model keeps them: they cannot hide, or their calls cost more of the step than
    ``auto`` allows; the last re-plan would keep them as ``measured_stall``), and compiled again (``max_replans`` (2) times at most); no copy is
    switched off (code with switched-off copies keeps a copy of each tensor: on an H100 it ran 1.15x
    Inductor's step for 8% more memory). The next step copies only what the last plan offloads."""
    step, report, rounds = _stalled_rounds(bf16, steps=8)
    assert 1 <= len(rounds) <= 2 and all("planned again with the measured times" in r for r in rounds), report.replans
    assert report.timings.compiles >= 1 and not report.switched_off
    kept = [r for r in report.saved if r.measured_stall_ms and r.measured_stall_ms > 0.05]  # its measured rows
    assert kept and all(r.decision == "keep" for r in kept), report.table()
    assert not copies_switched_off(ir.transfer_name(report.graph_id, ""))
    reset_copy_stats()
    step()
    stats = copy_stats()
    assert stats.copies == {"d2h": len(report.offloaded), "h2d": len(report.offloaded)}, (stats, report.table())


def test_a_graph_whose_sizes_depend_on_the_data_is_compiled_again():
    """A mixture of experts' dispatch (``torch.where``: sizes known only at run time) whose copies
    stall is planned again and compiled again like any graph. Compiled again from the call's real
    tensors, AOTAutograd's own fake mode refused the ``nonzero`` and the plan that stalled ran on;
    Dynamo's mode (``_compat.static_fakes``) traces it. The results stay eager's."""
    model, args, settings = routed_tokens()
    backend = _backend("50MB", **STALLS)
    with settings:
        got = train_step(model, args, backend, steps=6)
    (report,) = backend.reports
    rounds = [r for r in report.replans if r.startswith("measured in the first steps")]
    assert rounds and all("planned again with the measured times" in r for r in rounds), report.replans
    assert report.timings.compiles >= 1 and not report.switched_off
    assert any(r.data_dependent_dims for r in report.saved if r.measured_stall_ms), report.table()
    assert_same(got, train_step(model, args, steps=6), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_auto_switches_off_what_stalled_where_it_cannot_compile_again(bf16, cannot_compile_again):
    """Where compiling again fails, the copies that stalled are switched off in the compiled code,
    their tensors kept on the device (``measured_stall``, their measured figures on their rows), and
    measured again, ``max_replans`` (2) times at most. The next step copies only what is left."""
    step, report, rounds = _stalled_rounds(bf16, steps=6)
    assert 1 <= len(rounds) <= 2 and all("without compiling again" in r for r in rounds), report.replans
    assert report.timings.compiles == 1  # the first compile only
    kept = [r for r in report.saved if r.reason_code == "measured_stall"]
    assert kept and all(r.decision == "keep" and r.measured_stall_ms > 0 for r in kept), kept
    assert all("switched off at run time" in r.reason for r in kept)
    prefix = ir.transfer_name(report.graph_id, "")
    assert copies_switched_off(prefix) == {prefix + r.name for r in kept} == {prefix + n for n in report.switched_off}
    assert f"switched off at run time: the copies of {len(kept)} tensors" in report.summary(), report.summary()
    assert fxoffload.OffloadReport.from_json(report.to_json()).switched_off == report.switched_off
    reset_copy_stats()
    step()
    stats = copy_stats()
    assert stats.copies == {"d2h": len(report.offloaded), "h2d": len(report.offloaded)}, (stats, report.table())


def test_a_switched_off_copy_gives_its_tensor_back_after_the_code_reuses_its_memory():
    """A switched-off offload keeps a copy of its source on the device: the compiled code reuses the
    source's memory after the wait, and the reload (and a second one, ``retain_graph``) gives the
    values back all the same. No host bytes, no copy on the link. The copy lives as long as the host
    tensor autograd saves. The rule broken on purpose (the source itself kept, no copy of it): the
    reload gives what the code wrote there since."""
    name = ir.transfer_name(991, "x")

    def offload_reuse_reload():
        src = torch.randn(4096)
        want = src.clone()
        reset_copy_stats()
        host = ir.WAIT(ir.OFFLOAD(src, [], 50e6, name), src, [])
        src.fill_(float("nan"))  # what the compiled code does with a buffer whose last use has passed
        backs = [ir.WAIT(ir.RELOAD(host, src.device, [], 50e6, name), host, []) for _ in range(2)]
        return want, host, backs

    switch_copies_off([name])
    try:
        ranges = len(host_buffer_ranges())
        want, host, backs = offload_reuse_reload()
        for back in backs:
            torch.testing.assert_close(back, want)
        assert copy_stats().copies == {"d2h": 0, "h2d": 0}
        assert len(host_buffer_ranges()) == ranges + 1  # the handle, no host bytes touched
        kept = storage_weak_ref(backs[0].untyped_storage())
        del host, backs, back
        assert storage_expired(kept) and len(host_buffer_ranges()) == ranges
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(transfers, "_kept_copy", lambda src, stride: _kept_as_is(src))
            want, _, backs = offload_reuse_reload()
            assert backs[0].isnan().all()
    finally:
        switch_copies_on(ir.transfer_name(991, ""))
    assert name not in copies_switched_off()


def _kept_as_is(src):
    host = keep_on_device(src)
    transfers._register(host, transfers._Pending(None, src.device))
    return host


def test_a_graph_with_copies_switched_off_trains_like_eager_with_retain_graph(cannot_compile_again):
    """Every copy stalls (``STALLS``) and is switched off at the third step; each step runs two
    backwards through the same graph (``retain_graph``): the kept copies are read twice, and the
    gradients are eager's."""
    model, batch = _gpt()

    def twice(fn, m):
        m.zero_grad(set_to_none=True)
        loss = fn(*batch)
        loss.backward(retain_graph=True)  # two losses, a GAN step
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    want = twice(eager, eager)
    backend = _backend("50MB", **STALLS)
    fn = torch.compile(compiled, backend=backend)
    for _ in range(4):
        got = twice(fn, compiled)
    (report,) = backend.reports
    assert copies_switched_off(ir.transfer_name(report.graph_id, "")), report.replans
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)


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


def test_the_offloads_on_top_of_torchs_recompute_are_measured_too(monkeypatch):
    """``recompute="inductor"`` adds "auto"'s offloads on top of torch's partition: those that stalled
    are kept on the device once measured, and torch's partitioner recomputes more instead, where the
    budget then needs it. Budgets are of the memory model, the step trains like eager. The plan made
    again prices on the partitions torch made for the first (``inductor_recompute.Partition``): it
    asks torch's partitioner for the one it keeps only."""
    from fxoffload.compiler.compile import GraphCompiler

    calls = []  # each compile of the graph: torch's partitions it asked for
    partition, compile_graph = fxoffload._compat.call_partitioner, GraphCompiler.compile

    def counted(*args, **kwargs):
        calls[-1].append(kwargs.get("activation_memory_budget"))
        return partition(*args, **kwargs)

    def compiles(*args, **kwargs):
        calls.append([])
        return compile_graph(*args, **kwargs)

    monkeypatch.setattr(fxoffload._compat, "call_partitioner", counted)
    monkeypatch.setattr(GraphCompiler, "compile", compiles)
    model, batch = _gpt()
    backend = _backend("50MB", memory_budget=0.9, recompute="inductor", **STALLS)
    got = train_step(model, batch, backend, steps=5)
    assert_same(got, train_step(model, batch, steps=5), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    assert [r for r in report.replans if r.startswith("measured in the first steps")], report.replans
    kept = {r.name for r in report.saved if r.reason_code == "measured_stall"}
    assert kept and not kept & {r.name for r in report.offloaded}, report.table()
    # The first compile: torch's own partition, then at activation budget 0.8 and block by block; the
    # plan made again from what the first steps measured: torch's own and the kept one's again.
    assert len(calls) == 2 and len(calls[1]) < len(calls[0]) and calls[1][1:] == [0.8], calls


def test_a_copy_whose_reload_the_code_reuses_stays_on(monkeypatch, cannot_compile_again):
    """The copies that stalled are not switched off where the backward's code hands the memory of
    their reloads on to another buffer (``output_code.reused_reloads``): a second backward would get
    what was written there. The rule's input forced: every reload reused."""

    class Every:
        def __contains__(self, name):
            return True

    monkeypatch.setattr(watch, "reused_reloads", lambda code: Every())
    report = _train(_backend("50MB", **STALLS), steps=4)
    assert report.offloaded and not report.replans
    assert not copies_switched_off(ir.transfer_name(report.graph_id, ""))
    assert report.measured_stall_ms > 0


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_the_prediction_counts_the_copies_switched_off(inner, cannot_compile_again):
    """The copies stall and are switched off: those tensors stay on the device from their offload to
    their reload, and the prediction the step is held to (the FX model, or the replay of Inductor's
    code) counts them there: within 5% of the CPU allocator's peak of a steady step. Without them
    (the compiled plan's own timeline) it is far below."""
    model, batch = _gpt()
    backend = _backend("50MB", inner=inner, verify_peak=False, **STALLS)
    compiled = torch.compile(model, backend=backend)

    def step():
        compiled(*batch).backward()

    measured, _ = measured_steady_step(model, step, warmup=4)  # switched off at the third step
    (report,) = backend.reports
    assert report.switched_off, report.replans
    predicted = report.expected_memory().peak_bytes - report.start_bytes
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)
    held = max(report.switched_off_held())
    assert held > 0.1 * measured and "switched off at run time" in report.summary()
    # The compiler's pair knows what it switched off and counts it itself: its report is an output,
    # never read back (a report blanked of them changes nothing the watch judges on).
    (pair,) = backend._register.pairs()
    assert pair.switched_off == report.switched_off and pair.host_copies == report.host_copies
    blank = dataclasses.replace(report, switched_off=(), host_copies=(), memory_after=None, output_code={})
    pair = dataclasses.replace(pair, report=blank)
    assert pair.expected_memory().peak_bytes == report.expected_memory().peak_bytes


def test_the_watch_reads_a_pairs_peaks_again_when_its_timeline_changes():
    """The watch asks a pair for its phase peaks, parameters and planned peak at every call it reads;
    they are read once per timeline object, and again from a timeline that replaced it."""
    from fxoffload.analysis.memory import MemoryTimeline
    from fxoffload.testing.models import MLP

    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", policy="all", min_bytes=0)
    torch.manual_seed(0)
    model = MLP(layers=2)
    torch.compile(model, backend=backend)(torch.randn(64, 64)).sum().backward()
    (pair,) = backend._register.pairs()
    points = pair.memory_after.points
    fw = max(p.total for p in points if p.phase == "forward")
    bw = max(p.total for p in points if p.phase == "backward")
    assert pair.phase_peaks() == (fw, bw) and pair.planned_peak_bytes() == pair.memory_after.peak_bytes
    params = pair.parameter_bytes()
    assert params > 0
    pair.memory_after = MemoryTimeline(tuple(
        dataclasses.replace(p, live={**p.live, "transient": p.live.get("transient", 0) + 1}) for p in points
    ))  # fmt: skip
    assert pair.phase_peaks() == (fw + 1, bw + 1)
    assert pair.planned_peak_bytes() == pair.memory_after.peak_bytes == max(fw, bw) + 1
    assert pair.parameter_bytes() == params  # read from memory_before, which did not change


def test_the_backend_is_settled_once_its_copies_are_timed_and_acted_on():
    """``backend.settled``: False while a graph's copies wait to be timed or a plan made from them to
    be compiled; True once that is done, and from then on no step measures or compiles (the bench
    times steps from there)."""
    backend = _backend("50MB", **STALLS)
    step = _stepper(backend)
    step()
    assert not backend.settled  # its copies are timed at the second call
    for n in range(2, 16):
        step()
        if backend.settled:
            break
    assert backend.settled, backend.reports[0].replans
    (report,) = backend.reports
    assert [r for r in report.replans if r.startswith("measured in the first steps")], report.replans
    for _ in range(3):
        step()
    (after,) = backend.reports
    assert backend.settled and after.replans == report.replans and after.timings == report.timings


def _mlp_steps(backend, sizes, graph_break=False):
    """A step of a small MLP per batch size in ``sizes``, compiled with ``backend`` (a graph break
    before its last layer where asked); whether the backend was settled after each."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh())
    rest = torch.nn.Linear(256, 1)  # after the break: nothing of its own to offload, nothing to time

    def forward(x):
        h = first(x)
        if graph_break:
            torch._dynamo.graph_break()
        return rest(h)

    compiled = torch.compile(forward, backend=backend)
    settled = []
    for n in sizes:
        compiled(torch.randn(n, 64)).pow(2).mean().backward()
        settled.append(backend.settled)
    return settled


def test_a_graph_a_recompile_replaced_does_not_keep_the_backend_unsettled():
    """With Dynamo's default ``dynamic=None``, the first batch size gets a graph of its own, called
    once, and a later size a dynamic one that every step runs: the first graph's copies (timed at
    its second call) never are. ``settled`` leaves it out once the graph compiled after it has run
    twice; a graph the step still runs (the first half of a graph break, whose second half is settled
    at its first call) it does not leave out."""
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes="4KiB", inner="aot_eager")
    settled = _mlp_steps(backend, [32, 48, 16, 64, 40])
    first, dynamic = backend._watches
    assert first.calls == 1 and not first.settled and dynamic.settled
    assert not any(settled[:2]) and settled[-1], settled  # unsettled until the dynamic graph is timed
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes="4KiB", inner="aot_eager")
    settled = _mlp_steps(backend, [32, 32, 32], graph_break=True)
    assert len(backend._watches) == 2 and not settled[0] and settled[-1], settled


def test_a_backend_with_nothing_to_time_is_settled_after_its_first_step():
    backend = fxoffload.backend(offload_cpu=True, policy="none", inner="aot_eager")
    step = _stepper(backend)
    step()
    assert backend.settled


def test_a_tensor_that_stalled_is_judged_again_by_the_corrected_model(monkeypatch):
    """A stall measures the window the plan placed a copy in; a model that priced the device slow placed
    it short. So a plan made again from the measurement judges a tensor that stalled on the corrected
    model, as any other: on a 5 GB/s link every copy hides there, and the tensors reported stalled
    (forced: half of them, by name) are offloaded again; only the last plan made from measurements
    keeps them (``measured_stall``). Keeping them every time settled gpt2-medium's ``auto`` on an H100
    at 4% of what could leave its peak."""
    forced: set[str] = set()
    original = watch.measured_plan

    def half_stalled(plan, times, forward_s=None):
        if not forced:
            names = sorted(d.saved.name for d in plan.offloaded)
            forced.update(names[: len(names) // 2])
        return dataclasses.replace(original(plan, times), stalls={n: 0.1 for n in forced})

    monkeypatch.setattr(watch, "measured_plan", half_stalled)
    monkeypatch.setattr(watch, "stalled", lambda t: t.tensor in forced)
    backend = fxoffload.backend(
        offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=5e9, inner="aot_eager", op_time=0.0,
    )  # fmt: skip
    step = _stepper(backend)
    for _ in range(8):  # until the first plan made again from the measurement
        step()
        if backend.reports[0].replans:
            break
    (report,) = backend.reports
    assert forced and forced <= {r.name for r in report.offloaded}, (forced, report.table())
    assert "judged again" in report.replans[0], report.replans
    for _ in range(6):  # stalled again, and again: the last re-plan keeps them
        step()
    (report,) = backend.reports
    codes = {r.name: r.reason_code for r in report.saved}
    assert len(report.replans) == 2 and all(codes[n] == "measured_stall" for n in forced), (report.replans, codes)


def test_the_last_replan_offloads_only_what_was_measured_to_hide(monkeypatch):
    """``auto``'s last re-plan (``max_replans=1``: the first) offloads only tensors the plan before
    offloaded and measured hiding: no copy that was not measured comes in, so nothing new can stall.
    The measurement's input forced: half the offloaded tensors (by name) reported stalled; a
    ``host_budget`` the first plan fills (1 MiB: with less, what is left to offload lowers the peak
    too little to be worth it, ``planning.worth``), so that keeping the stalled ones leaves room a
    plan would fill with a copy never measured."""
    forced: set[str] = set()
    original = watch.measured_plan

    def half_stalled(plan, times, forward_s=None):
        if not forced:  # the first plan's measurement; the later ones stall the same tensors
            names = sorted(d.saved.name for d in plan.offloaded)
            forced.update(names[: len(names) // 2])
        m = original(plan, times)
        return dataclasses.replace(m, stalls={n: 0.1 for n in forced})

    monkeypatch.setattr(watch, "measured_plan", half_stalled)
    monkeypatch.setattr(watch, "stalled", lambda t: t.tensor in forced)
    backend = fxoffload.backend(
        offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=5e9, inner="aot_eager", op_time=0.0,
        max_replans=1, host_budget="1MiB",
    )  # fmt: skip
    step = _stepper(backend)
    step()
    first = {r.name for r in backend.reports[0].offloaded}
    assert len(first) >= 2, backend.reports[0].table()
    for _ in range(4):
        step()
    (report,) = backend.reports
    (why,) = report.replans
    hidden = first - forced
    assert f"only the {len(hidden)} measured to hide offloaded" in why, why
    now = {r.name for r in report.offloaded}
    assert now and now <= hidden, (now, hidden)
    codes = {r.name: r.reason_code for r in report.saved}
    assert all(codes[n] == "measured_stall" for n in forced), codes
    assert "not_measured" in codes.values(), report.table()  # room on the host, refused


def test_a_budgeted_backend_is_settled_once_a_step_of_its_calls_is_judged():
    """With a memory_budget the watch reads what code before the graph holds for up to ``CALLS``
    calls; ``settled`` waits for the first run of calls to be judged (where a re-plan for the
    budget would come), not for the reading to end."""
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", memory_budget=0.8, min_bytes=0)
    step = _stepper(backend)
    for n in range(1, 9):
        step()
        if backend.settled:
            break
    assert backend.settled and n <= 4, n
    (w,) = backend._watches
    assert w.left > 0  # still reading, and settled all the same


def _times(name, fw_host, bw_host, op=(20e-6, 5e-6)):
    """One tensor's copies, each window 10 ms on the device; ``fw_host``/``bw_host``: the host's."""
    return [
        ir.TransferTime(ir.transfer_name(0, name), "d2h", 1 << 20, 0.01, 1e-3, 0.0, op[0], fw_host),
        ir.TransferTime(ir.transfer_name(0, name), "h2d", 1 << 20, 0.01, 1e-3, 0.0, op[1], bw_host),
    ]


def test_a_phase_the_host_bound_charges_its_calls_their_host_time():
    """The forward's windows took the device as long as the host took to issue them (it waited on the
    host: gpt2-medium on an H100, ``tests/test_h100_runs.py``), the backward's 5x: the forward's calls
    cost their host time (the probe's 120 us), the backward's what the device measured (5 us). On a
    CPU (no host windows: the host is the compute stream) the calls cost what was measured."""
    times = _times("a", 0.0099, 0.002) + _times("b", 0.0101, 0.002)
    m = measured.Measured(tuple(times), (), (), {}, {}, host_calls=(120e-6, 100e-6))
    assert m.host_bound("d2h") and not m.host_bound("h2d")
    assert m.op_time == pytest.approx(125e-6)
    assert dataclasses.replace(m, host_calls=None).op_time == pytest.approx(25e-6)
    on_cpu = measured.Measured(tuple(_times("a", None, None)), (), (), {}, {}, host_calls=(120e-6, 100e-6))
    assert not on_cpu.host_bound("d2h") and on_cpu.op_time == pytest.approx(25e-6)
    assert "the host bound the forward (the device waited on it)" in m.why(0.0)
    # A window the stream spent mostly stalled is no sign of waiting on the host; nor is a device a
    # whole window behind the host at the wait (its host window unmeasured) at half the copies.
    stalled = [dataclasses.replace(t, stream_window_s=0.02) if t.direction == "d2h" else t for t in times]
    assert not measured.Measured(tuple(stalled), (), (), {}, {}).host_bound("d2h")
    behind = [dataclasses.replace(t, host_window_s=None) if t.tensor == "a" else t for t in times]
    assert not measured.Measured(tuple(behind), (), (), {}, {}).host_bound("d2h")
    assert measured.Measured(tuple(behind[1:] + times[2:]), (), (), {}, {}).host_bound("d2h")


def _auto_after_its_first_steps():
    """The report of ``auto``'s graph after five steps, its first plan having offloaded something."""
    backend = _backend("5GB")
    step = _stepper(backend)
    step()
    assert backend.reports[0].offloaded
    for _ in range(4):
        step()
    (report,) = backend.reports
    return report


def test_auto_plans_again_where_the_host_bound_phase_makes_its_calls_cost_the_step(monkeypatch):
    """No copy stalls (forced); the first steps measure both phases host-bound (the host's
    windows forced to the device's) and the calls' host time at 50 ms a tensor each way (forced): every
    offload's calls cost more than ``auto``'s allowance (1% of a step the mispriced model, as the
    first steps correct it, still puts near a second: 5 ms each way left one tensor in at times), so
    the graph is planned again, and its plan keeps every tensor for that reason. The report says the
    host bound both phases."""
    calls_cost_the_step(monkeypatch, 5e-2)
    report = _auto_after_its_first_steps()
    (why,) = [r for r in report.replans if r.startswith("measured in the first steps")]
    assert "the host bound the forward and backward" in why and "stalled" not in why, why
    assert not report.offloaded and "op_time" in {r.reason_code for r in report.saved}, report.table()
    assert "the host bound the forward and backward" in report.summary(), report.summary()


@pytest.mark.parametrize("op_s", [5e-2, 0.0])
def test_on_a_cpu_auto_plans_again_where_its_calls_measured_cost_the_step(monkeypatch, op_s):
    """On a CPU the compute stream is the host's own thread: the calls' measured time is step time in
    either phase, though no host window is measured there to call a phase host-bound. No copy stalls
    (forced); each offloaded tensor's calls measured at 50 ms each way (forced): past ``auto``'s
    allowance, the graph is planned again and keeps every tensor for that reason. Before this rule
    the plan stayed, as it does where the calls cost nothing measurable (0 s each way, forced): on the
    demo's GPT one 512 KiB offload's calls took 0.40 ms a step on the CPU, 4-10% of it."""
    from fxoffload.runtime import timing

    real = timing.compute_windows
    monkeypatch.setattr(
        timing, "compute_windows", lambda resolved: [dataclasses.replace(t, op_s=op_s) for t in real(resolved)]
    )
    no_copy_stalls(monkeypatch)
    report = _auto_after_its_first_steps()
    if not op_s:
        assert report.offloaded and not report.replans, report.table()
        return
    (why,) = [r for r in report.replans if r.startswith("measured in the first steps")]
    assert "op calls cost 100 ms of the step (on a CPU they run on the compute thread)" in why, why
    assert "stalled" not in why and "host bound" not in why, why
    assert not report.offloaded and "op_time" in {r.reason_code for r in report.saved}, report.table()
