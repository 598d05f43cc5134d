"""Times a compiled graph's copies on the device for its ``CallWatch`` (``runtime.timing``): one call's
offloads and a reload of each, at the second call after each compile, and that forward's own time
(alone, for an ``auto`` plan that offloads nothing: ``planning.measured.learns_without_copies``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..analysis.outside import graph_device
from ..ir import transfer_name
from ..planning.measured import learns_without_copies
from ..runtime.timing import Recording, now

if TYPE_CHECKING:
    from .watch import CallWatch

log = logging.getLogger(__name__)

__all__ = ["CopyTimer"]


class CopyTimer:
    """Times one call's copies at the second call after each compile (``runtime.timing``): its
    forward's offloads and a reload of each, and the forward's own time; hands them to the watch."""

    MAX_OPEN_CALLS = 64  # a recording not complete after this many more calls is read as it is
    # Forwards timed for a plan with no copy (the quickest taken: one call on a loaded host is noise).
    FORWARDS_ALONE = 3

    def __init__(self, watch: CallWatch) -> None:
        self.watch = watch
        self.restart()

    def restart(self) -> None:
        """From the first call of a new compile: a recording still open (its copies not all waited
        on) is of the old code, and is dropped, so its ops stop stamping copies."""
        if getattr(self, "recording", None) is not None:
            self.recording.discard()
        self.calls = 0
        self.recording: Recording | None = None
        self.open_calls = 0
        self.forwards: list[tuple[Any, Any, float]] = []  # each timed call's start and end stamps, host seconds
        plan = self.watch.pair.plan
        self.done = not plan.offloaded and not learns_without_copies(plan, self.watch.options)

    def before_call(self, inputs: Any) -> Any:
        """Read a recording whose copies have all been waited on; start one at the second call."""
        if self.recording is not None:
            self.open_calls += 1
            # A plan that offloads nothing has only its forwards' times to take (``learns_without_copies``).
            alone = not self.watch.pair.plan.offloaded
            if alone and len(self.forwards) < self.FORWARDS_ALONE:
                return now(self.device), time.perf_counter()
            if self.recording.complete or self.open_calls > self.MAX_OPEN_CALLS or alone:
                self.finish(inputs)
        self.calls += 1
        if self.done or self.recording is not None or self.calls != 2:
            return None
        self.device = graph_device(inputs)
        self.recording = Recording(transfer_name(self.watch.pair.graph_id, "")).start()
        return now(self.device), time.perf_counter()

    def after_call(self, started: Any) -> None:
        if started is not None and self.recording is not None:
            (start, host), end = started, now(self.device)
            self.forwards.append((start, end, time.perf_counter() - host))
            self.recording.close()

    def finish(self, inputs: Any) -> None:
        recording, self.recording = self.recording, None
        self.done = True
        try:
            times = recording.stop()  # reads the events: a device's error surfaces here
            forward = min(((_elapsed(start, end), host) for start, end, host in self.forwards), default=None)
            self.watch.on_copy_times(times, forward, inputs)
        except Exception as e:  # a measurement never fails a step
            log.warning("fxoffload: graph %d: reading its copies' times failed (%s)", self.watch.pair.graph_id, e)


def _elapsed(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3
