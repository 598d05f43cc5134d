"""A torch profiler session of the CPU allocator, and readers of it: its Chrome-trace events and the
CPU allocator's events in them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["CPU_DEVICE_TYPE", "cpu_memory_events", "cpu_memory_profile", "trace_events"]

CPU_DEVICE_TYPE = 0  # c10::DeviceType::CPU, the "Device Type" of a profiler memory event
# What kineto (torch 2.13's) writes to stderr each time a session starts and stops, a line each: on
# a user's terminal they read like errors, and fxoffload starts sessions of its own while it plans.
KINETO_NOTICE = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\s*")


@contextlib.contextmanager
def cpu_memory_profile() -> Iterator[Any]:
    """A ``torch.profiler.profile`` session of the CPU with ``profile_memory=True`` around the body,
    without kineto's start and stop notices on stderr (``KINETO_NOTICE``): whatever else stderr got
    while the session started or stopped is written there afterwards."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _notices_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _notices_dropped():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def _notices_dropped() -> Iterator[None]:
    """File descriptor 2 into a temporary file for the body, then its lines back to it, less kineto's
    notices. Where descriptor 2 cannot be duplicated (closed), the body runs as it is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().splitlines(keepends=True)
            rest = b"".join(line for line in lines if not KINETO_NOTICE.fullmatch(line))
            if rest:
                os.write(2, rest)


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The Chrome-trace events of a finished ``torch.profiler.profile`` session (its public export)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="fxoffload-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)


def cpu_memory_events(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CPU allocator's ``[memory]`` instants (``Addr``, ``Bytes``: negative for a free), in order."""
    cpu = [
        e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == CPU_DEVICE_TYPE
    ]
    return sorted(cpu, key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
