"""Measured memory: the peak live bytes of one call, per device, from the allocators themselves.

    m = fxoffload.measure_memory(step)       # forward + backward, or any callable
    m.cpu.peak_bytes                          # most bytes live above what was live at the start
    m["cuda:0"].peak_reserved_bytes

CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's CPU
allocator with its address and the requested size (``torch.empty(1001, dtype=torch.uint8)`` is 1001
bytes, not a rounded block). Frees are matched to allocations by address; the running sum's maximum
is the peak. Allocations of fxoffload's host buffers (``runtime.host_buffer_ranges``: the pool of
offloaded tensors and the CPU copy engine's staging buffers) are left out: on a GPU machine they are
host memory, so a CPU run with ``offload_cpu=True`` shows what the device would hold. What it does not
see, by the profiler's design:

- allocations and frees on other threads (its memory events are per thread; torch 2.13's
  ``profile_all_threads`` reports none at all). CPU autograd runs on the calling thread, and
  fxoffload's copy threads allocate and free nothing;
- frees of blocks allocated before the start, unless ``track_cpu_frees()`` was called before those
  blocks were allocated: otherwise the allocator does not know their size and reports nothing;
- a host buffer allocated and dropped again within the call (the pools bound their size) counts.

CUDA (not run on this project's CPU machines): the caching allocator's statistics, peak reset at the
start, ``memory_allocated`` before and ``max_memory_allocated`` after, the same for reserved bytes.
Pinned host buffers are not device memory, so nothing is left out there.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import cpu_block_sizes_flag
from ..runtime.host_pool import host_buffer_ranges
from ..sizes import fmt_bytes
from .profiler import cpu_memory_events, cpu_memory_profile, trace_events

log = logging.getLogger(__name__)

__all__ = ["DeviceMemory", "MeasuredMemory", "measure_memory", "track_cpu_frees"]

@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device's allocator did during the call, relative to what was live at its start."""

    device: str  # "cpu", "cuda:0"
    peak_bytes: int  # most bytes live above the start at any moment (0: never above it)
    end_bytes: int  # bytes live at the end minus at the start (negative: more freed than allocated)
    allocations: int  # allocations made during the call (those left out not counted)
    peak_reserved_bytes: int | None = None  # CUDA: the caching allocator's reserved bytes, peak above start
    peak_event: int | None = None  # CPU: the profiler's event index of the allocation that reached the peak
    peak_op: str | None = None  # CPU: the innermost profiled op running then ("aten::mm")
    excluded_bytes: int = 0  # CPU: bytes allocated inside fxoffload's host buffers, left out
    # CPU: bytes of blocks allocated before the start and freed during the call (counted in end_bytes
    # and in the running sum); None when such frees cannot be seen (no track_cpu_frees(), or CUDA).
    freed_earlier_bytes: int | None = None

    def summary(self) -> str:
        text = f"{self.device}: peak {fmt_bytes(self.peak_bytes)} above the start"
        if self.peak_reserved_bytes is not None:
            text += f" ({fmt_bytes(self.peak_reserved_bytes)} reserved)"
        text += f", {fmt_bytes(self.end_bytes)} more at the end, {self.allocations} allocations"
        if self.peak_op:
            text += f"; peak in {self.peak_op}"
        if self.excluded_bytes:
            text += f"; {fmt_bytes(self.excluded_bytes)} in fxoffload's host buffers left out"
        return text


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    """Per device figures of one call; ``result`` is what the call returned (alive at the end, so its
    bytes are in ``end_bytes``)."""

    devices: tuple[DeviceMemory, ...]
    result: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __getitem__(self, device: str | torch.device) -> DeviceMemory:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        for d in self.devices:
            if d.device == str(dev):
                return d
        measured = ", ".join(d.device for d in self.devices)
        raise KeyError(f"no figures for device {str(dev)!r}; measured: {measured}")

    @property
    def cpu(self) -> DeviceMemory:
        return self["cpu"]

    def summary(self) -> str:
        return "\n".join(d.summary() for d in self.devices)


def track_cpu_frees() -> bool:
    """From now on, for the rest of the process, torch's CPU allocator keeps the size of every block
    it hands out, so ``measure_memory`` sees the free of a block allocated before its start (after
    this call) and counts it below the start. Costs a lock and a hash-map update per CPU allocation.

    A one-way switch on purpose: switched off again, the allocator would keep stale sizes of blocks
    freed meanwhile and could report a later free with another block's size. Returns False (and
    changes nothing) where torch's allocator flag cannot be reached."""
    flag = cpu_block_sizes_flag()
    if flag is None:
        log.warning("fxoffload: cannot reach torch's CPU allocator flag; frees of earlier blocks stay unseen")
        return False
    flag.value = True
    return True


def _tracking_cpu_frees() -> bool:
    flag = cpu_block_sizes_flag()
    return bool(flag is not None and flag.value)


def measure_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MeasuredMemory:
    """Run ``fn(*args, **kwargs)`` once and measure, per device, the peak live bytes above what was
    live when it started, the bytes live at its end relative to the start, and the allocations made.

    Always the CPU (see the module's docstring for what its allocator events show and leave out),
    and every CUDA device when CUDA is available. Garbage is collected before the start so that a
    collection during the call does not free earlier blocks. Exceptions from ``fn`` propagate.
    Run warm-up steps before measuring a steady step: the first call of a compiled function compiles.
    """
    if not callable(fn):
        raise ValueError(
            f"fxoffload.measure_memory: the first argument must be callable (a function, a module, a "
            f"compiled step), got {type(fn).__name__}; pass its arguments after it"
        )
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    gc.collect()
    start = {i: _cuda_start(i) for i in cuda}
    host_before = host_buffer_ranges()
    tracked = _tracking_cpu_frees()
    with cpu_memory_profile() as prof:
        result = fn(*args, **kwargs)
        for i in cuda:
            torch.cuda.synchronize(i)
    host_after = host_buffer_ranges()
    events = trace_events(prof)
    devices = [cpu_memory_from_trace(events, host_before, host_after, tracked)]
    devices += [_cuda_end(i, start[i]) for i in cuda]
    return MeasuredMemory(tuple(devices), result)


def measure_steady_step(
    step: Callable[[], Any], warmup: int = 2, before_each: Callable[[], Any] | None = None
) -> tuple[MeasuredMemory, list[warnings.WarningMessage]]:
    """``measure_memory`` of one ``step()`` after ``warmup`` unmeasured ones (the first call of a
    compiled step compiles), with the warnings those warm-up calls gave (where torch.compile, and so
    fxoffload's planning, runs). ``before_each`` runs before every call, outside the measurement:
    ``model.zero_grad(set_to_none=True)``, so that each step starts with no gradients."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warmup):
            if before_each is not None:
                before_each()
            step()
    if before_each is not None:
        before_each()
    return measure_memory(step), caught


def cpu_memory_from_trace(
    events: Sequence[dict[str, Any]],
    host_before: Sequence[tuple[int, int]],
    host_after: Sequence[tuple[int, int]],
    freed_earlier_seen: bool,
) -> DeviceMemory:
    """The CPU figures from a Chrome trace's events (``[memory]`` instants with ``Addr`` and ``Bytes``,
    ``cpu_op`` spans).

    Left out: the allocation of each block still live at the end that is one of fxoffload's host
    buffers then (``host_after``, ``(address, nbytes)``), and the free of a host buffer held at the
    start (``host_before``). Matched by exact address and size, and in time: a temporary freed before
    a host buffer took its address still counts. Frees of blocks not allocated in the trace count
    only when ``freed_earlier_seen`` (the allocator knew every block's size, see ``track_cpu_frees``).
    """
    memory = cpu_memory_events(events)
    blocks = [(int(e["args"]["Addr"]), int(e["args"]["Bytes"])) for e in memory]
    # The allocation (position in ``memory``) of every block live at the end, by address.
    live_at_end: dict[int, int] = {}
    for i, (addr, nbytes) in enumerate(blocks):
        if nbytes > 0:
            live_at_end[addr] = i
        elif nbytes < 0:
            live_at_end.pop(addr, None)
    after = set(host_after)
    left_out = {i for addr, i in live_at_end.items() if (addr, blocks[i][1]) in after}
    before = {addr for addr, _ in host_before}

    live: dict[int, int] = {}  # address -> bytes counted, of blocks allocated in the call
    level = peak = allocations = excluded = freed_earlier = 0
    at_peak: dict[str, Any] | None = None
    for i, (addr, nbytes) in enumerate(blocks):
        if nbytes > 0:
            if i in left_out:
                excluded += nbytes
                live[addr] = 0
                continue
            live[addr] = nbytes
            allocations += 1
            level += nbytes
            if level > peak:
                peak, at_peak = level, memory[i]
        elif nbytes < 0:
            counted = live.pop(addr, None)
            if counted is not None:
                level -= counted
            elif freed_earlier_seen and addr not in before:
                freed_earlier -= nbytes
                level += nbytes
    return DeviceMemory(
        device="cpu",
        peak_bytes=peak,
        end_bytes=level,
        allocations=allocations,
        peak_event=None if at_peak is None else at_peak["args"].get("Ev Idx"),
        peak_op=None if at_peak is None else _op_at(events, at_peak),
        excluded_bytes=excluded,
        freed_earlier_bytes=freed_earlier if freed_earlier_seen else None,
    )


def _op_at(events: Sequence[dict[str, Any]], instant: dict[str, Any]) -> str | None:
    """The innermost ``cpu_op`` span of the instant's thread that contains it."""
    ts, tid = instant["ts"], instant.get("tid")
    best = None
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("tid") == tid:
            if e["ts"] <= ts <= e["ts"] + e.get("dur", 0) and (best is None or e["ts"] >= best["ts"]):
                best = e
    return None if best is None else best["name"]


def _cuda_start(index: int) -> tuple[int, int, int]:
    torch.cuda.synchronize(index)
    torch.cuda.reset_peak_memory_stats(index)
    stats = torch.cuda.memory_stats(index)
    return (
        torch.cuda.memory_allocated(index),
        torch.cuda.memory_reserved(index),
        stats.get("allocation.all.allocated", 0),
    )


def _cuda_end(index: int, start: tuple[int, int, int]) -> DeviceMemory:
    allocated, reserved, count = start
    torch.cuda.synchronize(index)
    return DeviceMemory(
        device=f"cuda:{index}",
        peak_bytes=torch.cuda.max_memory_allocated(index) - allocated,
        end_bytes=torch.cuda.memory_allocated(index) - allocated,
        allocations=torch.cuda.memory_stats(index).get("allocation.all.allocated", 0) - count,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(index) - reserved,
    )
