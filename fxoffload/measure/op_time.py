"""The compute stream's time an offloaded tensor's op calls take, measured on the device itself.

Every offloaded tensor adds four op calls to a step: its offload, that copy's wait, its reload and
that copy's wait. On a CPU (``offload_cpu=True``) the compute stream is the host thread that makes
those calls, so their host time is step time whether or not the copies hide: the dispatcher's way into
a Python kernel, the host pool, the copy engine's hand-off, the publishing copy at the wait (about
0.15-0.2 ms for a small tensor, 0.34 ms for 512 KiB, on a 2-core development machine, ``python -m
bench.op_overhead``). On an accelerator
the host issues the calls ahead of the device while it has kernels queued, and they cost the compute
stream nothing; that is the model's first figure there (``DeviceRates.op_time`` = 0). Not always: on
an H100, gpt2-medium's forward (batch 8, bf16) kept the device waiting on the host, each kernel
starting about 10 us after its launch (Inductor's wrapper issued one every 31 us), and there each
offload added about 120 us of host time to the step (``tests/test_h100_runs.py``). Where the first
steps measure a phase so bound (``planning.measured``), ``host_op_seconds`` is what its calls cost.

``op_call_seconds`` times each call on a small tensor (its own cost, not the copy's), a wait after
its copy has finished (``transfers.copy_finished``: a wait that neither stalls nor copies the bytes
itself); ``measure_op_time`` is the four calls' sum, once per device type and process. On a CPU the
calls' time also grows with the tensor's bytes: the copy engine poisons each destination at the issue
and publishes the copy into it at the wait, on the compute thread (a 512 KiB tensor's calls took 0.34
ms where a 64 B one's took 0.18 ms, on 2 cores, 2026-12-01). ``measure_op_rates`` gives both figures,
the calls on a small tensor and the seconds a byte adds (a second probe on 1 MiB), what the planner
charges each offload on a CPU.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from .. import ir
from .._compat import real_tensors
from ..runtime.transfers import copy_finished, switch_copies_off, switch_copies_on, track_releases

log = logging.getLogger(__name__)

__all__ = ["OP_CALLS", "forget_op_times", "host_op_seconds", "measure_op_rates", "measure_op_time", "op_call_seconds"]

_NAME = ir.transfer_name(-1, "op_time")  # a graph id no compile uses: no recording takes its copies
OP_CALLS = ("offload", "wait (d2h)", "reload", "wait (h2d)")  # one offloaded tensor's calls a step
_PROBE_CYCLES = 30
_PROBE_BYTES = 64  # the calls' own time
_LARGE_PROBE_BYTES = 1 << 20  # and what the bytes add (``measure_op_rates``)

# Each call's times by device and bytes (``_probed``).
_measured: dict[tuple[str, int], dict[str, list[float]]] = {}


def forget_op_times() -> None:
    """Forget every measured figure: the next plan for a device measures it again."""
    _measured.clear()


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _cycle_times(x: torch.Tensor, calls: int, settle_s: float) -> dict[str, list[float]]:
    """Host seconds of each transfer op call on ``x`` in each of ``calls`` cycles (after 10% warm-up):
    the four of ``OP_CALLS`` and an ``order``."""
    device = x.device
    times: dict[str, list[float]] = {k: [] for k in (*OP_CALLS, "order")}

    def timed(key: str, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(*args)
        times[key].append(time.perf_counter() - start)
        return out

    def settle(dest: torch.Tensor) -> None:
        # As long for every size (a longer sleep alone slows the next calls: a 64 B tensor's took
        # 0.06-0.1 ms longer after 2 ms than after 0.5 ms, 2026-12-02), then the copy done: the
        # wait timed next neither stalls nor copies the bytes itself.
        _sync(device)
        time.sleep(settle_s)
        copy_finished(dest)

    def cycle() -> None:
        host = timed("offload", ir.OFFLOAD, x, [], 0.0, _NAME)
        settle(host)
        host = timed("wait (d2h)", ir.WAIT, host, x, [])
        back = timed("reload", ir.RELOAD, host, x.device, [], 0.0, _NAME)
        settle(back)
        timed("wait (h2d)", ir.WAIT, back, host, [])
        timed("order", ir.ORDER, x, [])

    for _ in range(max(1, calls // 10)):
        cycle()
    for v in times.values():
        v.clear()
    for _ in range(calls):
        cycle()
    return times


def _probe_tensor(device: torch.device, nbytes: int) -> torch.Tensor:
    return torch.ones(max(1, nbytes // 4), device=device)  # no draw: the user's generator is left alone


def op_call_seconds(
    device: torch.device, nbytes: int = 64, calls: int = 1000, settle_s: float = 0.0005, switched_off: bool = True
) -> dict[str, float]:
    """Median host seconds of each transfer op call on ``device`` over ``calls`` cycles (after 10%
    warm-up): the four of ``OP_CALLS``, an ``order``, and (``switched_off``) an offload switched off
    at run time. Its sources are left out of a ``track_releases`` the caller has open."""
    with real_tensors(), track_releases():
        x = _probe_tensor(device, nbytes)
        out = {k: statistics.median(v) for k, v in _cycle_times(x, calls, settle_s).items()}
        if not switched_off:
            return out
        switch_copies_off([_NAME])
        try:
            off: list[float] = []
            for _ in range(calls):
                start = time.perf_counter()
                host = ir.OFFLOAD(x, [], 0.0, _NAME)
                off.append(time.perf_counter() - start)
                ir.WAIT(host, x, [])
            out["offload, switched off"] = statistics.median(off)
        finally:
            switch_copies_on(_NAME)
    return out


def _probed(device: torch.device, nbytes: int = _PROBE_BYTES) -> dict[str, list[float]]:
    """Each op call's host seconds in each cycle of a few on a tensor of ``nbytes`` on ``device``,
    once per device, size and process; zeros where the calls cannot be timed (a measurement never fails
    a compile or a step: they are charged nothing)."""
    key = (str(device), nbytes)
    if key not in _measured:
        try:
            with real_tensors(), track_releases():
                _measured[key] = _cycle_times(_probe_tensor(device, nbytes), _PROBE_CYCLES, settle_s=0.0005)
        except RuntimeError as e:
            log.warning("fxoffload: could not time the transfer ops on %s (%s); charging them nothing", device, e)
            _measured[key] = {k: [0.0] for k in OP_CALLS}
        else:
            log.info("fxoffload: one offloaded tensor's op calls take %.0f us of host time on %s (%d bytes)",
                     _calls(device, nbytes) * 1e6, device, nbytes)  # fmt: skip
    return _measured[key]


def _calls(
    device: torch.device, nbytes: int, statistic: Callable[[list[float]], float] = statistics.median
) -> float:
    """The four calls' host seconds on a tensor of ``nbytes`` (``_probed``), each call's ``statistic``."""
    return sum(statistic(_probed(device, nbytes)[k]) for k in OP_CALLS)


def host_op_seconds(device: torch.device) -> tuple[float, float]:
    """Host seconds of one offloaded tensor's forward calls (its offload and that copy's wait) and
    backward calls (its reload and that wait) on ``device``, medians measured once per device and
    process: what they cost a phase the host bounds (``planning.measured``). Zeros where they cannot be
    measured."""
    seconds = {k: statistics.median(v) for k, v in _probed(device).items()}
    return seconds["offload"] + seconds["wait (d2h)"], seconds["reload"] + seconds["wait (h2d)"]


def measure_op_time(device: torch.device) -> float:
    """Seconds of ``device``'s compute stream one offloaded tensor's calls take: on a CPU their host
    time (each call's median), measured once per process (a few cycles); 0 on an accelerator."""
    if device.type != "cpu":
        return 0.0
    return _calls(device, _PROBE_BYTES)


def measure_op_rates(device: torch.device) -> tuple[float, float]:
    """``DeviceRates.op_time`` and ``op_byte_time`` of ``device``: on a CPU one offloaded tensor's
    calls on a small tensor (``measure_op_time``) and the seconds each byte adds to them, measured once
    per process; zeros on an accelerator, whose host issues the calls ahead of the device.

    The bytes' seconds are the difference between a 1 MiB tensor's calls and a small one's, each
    call's fastest cycle (at least 0): a first guess that the first steps correct
    (``planning.measured``), which only happens where something was offloaded, so one low rather than
    high. On a 2-core machine with two pytest workers beside, the medians moved 0.5-17 ms a MiB from
    one run to the next, the fastest cycles 0.17-0.33 ms (2026-12-02)."""
    small = measure_op_time(device)
    if device.type != "cpu":
        return small, 0.0
    added = _calls(device, _LARGE_PROBE_BYTES, min) - _calls(device, _PROBE_BYTES, min)
    return small, max(0.0, added / (_LARGE_PROBE_BYTES - _PROBE_BYTES))
