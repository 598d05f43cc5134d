"""Readers of a torch profiler session: its Chrome-trace events and the CPU allocator's events in them."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["CPU_DEVICE_TYPE", "cpu_memory_events", "trace_events"]

CPU_DEVICE_TYPE = 0  # c10::DeviceType::CPU, the "Device Type" of a profiler memory event


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
