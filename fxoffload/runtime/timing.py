"""Measured transfers: when each copy was issued, how long it took, how long the compute waited for it.

Off unless a ``Recording`` is open (one check per op). On an accelerator every stamp is an event of
torch's device-generic API (``torch.Event(enable_timing=True)``), recorded on the stream where it
happens and read once the recording stops; on a CPU (``offload_cpu``) the compute thread's clock and
the copy engine's link clock give the same figures::

    issue = event on the compute stream when the copy is issued     (its window opens)
    copy  = events on the transfer stream around the copy           (its duration)
    wait  = events on the compute stream before and after the wait  (window closes; the gap is the stall)
    host  = the host's clock at the issue and at the wait               (how long the host took to issue
                                                                         the window: ``host_window_s``)

A window is the compute between a copy's issue and its wait: what the other copies took inside it
(the stalls at their waits, their calls' own time) is taken out (``compute_windows``). That is no
compute of the model's, and a plan that stalls would otherwise measure its compute that much
slower: on an H100 the windows of three presets taught the model a step 1.4-1.9x the device's
(``tests/data/h100-2026-11-26``), and the plan made again from them stalled again.

A recording collects the copies whose ``name`` (``ir.transfer_name``) starts with its prefix: the
transfers of one graph. What the plan predicted for the same copies is the planner's to compare.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ..ir import TransferTime

__all__ = ["Recording", "Resolved", "Stamps", "compute_windows", "now", "recording", "wanted"]

_open: list[Recording] = []


class Recording:
    """The copies of one graph (names starting with ``prefix``): the offloads issued while it is
    ``issuing`` (one call's forward), and one reload for each of them, whenever it comes (the
    backward runs later; a graph run several times in a step reloads its last call's tensors first,
    taken for the first call's: same graph, same copies)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.issuing = False
        self._offloads: list[Stamps] = []
        self._reloads: dict[str, Stamps] = {}

    def start(self) -> Recording:
        """Take the offloads issued from now on (until ``close``), and their reloads."""
        self.issuing = True
        if self not in _open:
            _open.append(self)
        return self

    def close(self) -> None:
        """The forward call returned: no more offloads; their reloads are still taken."""
        self.issuing = False

    def discard(self) -> None:
        """Stop, reading nothing: no copy is stamped for it from now on."""
        if self in _open:
            _open.remove(self)
        self.issuing = False
        self._offloads, self._reloads = [], {}

    def wants(self, name: str, direction: str) -> bool:
        if not name.startswith(self.prefix):
            return False
        if direction == "d2h":
            return self.issuing
        return name not in self._reloads and any(o.name == name for o in self._offloads)

    def take(self, stamps: Stamps) -> None:
        if stamps.direction == "d2h":
            self._offloads.append(stamps)
        else:
            self._reloads[stamps.name] = stamps

    @property
    def complete(self) -> bool:
        """Every offload taken was waited on, and so was a reload of each."""
        return (
            not self.issuing and bool(self._offloads) and all(o.waited for o in self._offloads)
            and all(o.name in self._reloads and self._reloads[o.name].waited for o in self._offloads)
        )  # fmt: skip

    def stop(self) -> list[TransferTime]:
        """Stop, and the copies that were issued and waited on (offloads, then reloads); an
        accelerator's events are read now, which waits for them."""
        done = [s for s in (*self._offloads, *self._reloads.values()) if s.waited]
        self.discard()
        # Placed against one stamp of their own device: two devices' events (or a CPU clock and an
        # event) have no common time, and what one device's compute stream did is no other's window.
        times: dict[int, TransferTime] = {}
        for device in dict.fromkeys(s.device for s in done):
            mine = [i for i, s in enumerate(done) if s.device == device]
            resolved = [done[i].resolve(origin=done[mine[0]].issue) for i in mine]
            times.update(zip(mine, compute_windows(resolved)))
        return [times[i] for i in range(len(done))]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One copy as measured (``Stamps.resolve``), and where its calls sat: its issue and its wait's
    start in seconds from one stamp of the recording (the first copy's issue), and the compute
    stream's time in its issuing call and in its wait's own work (stall apart)."""

    time: TransferTime
    issued: float
    waited: float
    issue_op: float = 0.0
    wait_op: float = 0.0


def compute_windows(resolved: list[Resolved]) -> list[TransferTime]:
    """Each copy's window less what the compute stream spent inside it on the other copies: the
    stalls at their waits and their calls' own time. What is left is compute, the model's figure."""
    out = []
    for r in resolved:
        other = sum(
            (u.issue_op if r.issued <= u.issued < r.waited else 0.0)
            + (u.time.stall_s + u.wait_op if r.issued <= u.waited < r.waited else 0.0)
            for u in resolved if u is not r
        )  # fmt: skip
        out.append(dataclasses.replace(r.time, window_s=max(0.0, r.time.window_s - other)))
    return out


def recording() -> bool:
    return bool(_open)


def wanted(name: str, direction: str) -> bool:
    """Whether an open recording takes the copy ``name`` in ``direction`` (then its call is stamped)."""
    return any(r.wants(name, direction) for r in _open)


@dataclasses.dataclass
class Stamps:
    """What one copy's ops stamp, device events or the CPU's clocks."""

    name: str
    direction: str
    nbytes: int
    device: torch.device
    issue: Any = None  # compute-stream event, or perf_counter seconds
    copy_start: Any = None
    copy_end: Any = None
    copy_s: float = 0.0  # on a CPU: the link's time for the copy (``link_times``)
    wait_start: Any = None
    wait_end: Any = None
    waited: bool = False
    entered: Any = None  # the issuing call's start and end on the compute stream (``op_s``)
    left: Any = None
    # On an accelerator, the host's clock at the issue and at the wait's start (``host_window_s``).
    host_issue: float = 0.0
    host_wait: float = 0.0
    behind: bool = False  # at the wait, the device had not reached the issue (``before_wait``)

    @classmethod
    def at_issue(
        cls, name: str, direction: str, nbytes: int, device: torch.device, entered: Any = None
    ) -> Stamps | None:
        """Stamps for a copy issued now, where a recording wants it (None otherwise); ``entered``:
        ``now(device)`` when the issuing call began."""
        wanted = [r for r in _open if r.wants(name, direction)]
        if not wanted:
            return None
        stamps = cls(name, direction, nbytes, device, entered=entered)
        for r in wanted:
            r.take(stamps)
        stamps.issue = now(device)
        stamps.host_issue = time.perf_counter()
        return stamps

    def issued_on_cpu(self) -> None:
        """On a CPU, the copy is issued once the copy engine has it: the work before (a staging buffer,
        poisoning the destination) is the emulation's, which a device's launch does not have."""
        self.issue = time.perf_counter()

    def issued(self) -> None:
        """The issuing call returns: its end on the compute stream."""
        self.left = now(self.device)

    def around_copy(self, stream: torch.Stream | None, start: bool) -> None:
        """On an accelerator: an event on the transfer stream before (``start``) or after the copy."""
        if stream is not None:
            setattr(self, "copy_start" if start else "copy_end", _event(stream))

    def link_times(self, start: float, seconds: float) -> None:
        """On a CPU: the copy engine's link clock for the copy: when it starts on the link, and how long
        it takes there (kept as it is: a difference of clocks near 1e5 s loses digits of a microsecond)."""
        self.copy_start, self.copy_end, self.copy_s = start, start + seconds, seconds

    def before_wait(self) -> None:
        self.wait_start = now(self.device)
        self.host_wait = time.perf_counter()
        if self.device.type != "cpu":  # still pending: the device is a whole window behind the host
            self.behind = not self.issue.query()

    def after_wait(self) -> None:
        self.wait_end = now(self.device)
        self.waited = True

    def resolve(self, origin: Any) -> Resolved:
        """The copy as measured, placed from ``origin`` (a stamp of the same recording); its window
        still holds whatever the other copies took inside it (``compute_windows``)."""
        if self.device.type == "cpu":
            window = self.wait_start - self.issue
            copy = self.copy_s
            # As a copy engine would stall a compute stream: until the copy is done on the link; the
            # wait's own work of publishing the bytes (an emulation's, see ``copy_engine``) is not it.
            stall = self.copy_end - self.wait_start
            wait_own = max(0.0, self.wait_end - self.wait_start - max(stall, 0.0))
            issue_op = self.left - self.entered if self.entered is not None and self.left is not None else 0.0
            op = issue_op + wait_own
            issued, waited = self.issue - origin, self.wait_start - origin
            host_window = None  # the compute stream is the host: ``window`` is its time
        else:
            self.wait_end.synchronize()
            self.copy_end.synchronize()
            window = self.issue.elapsed_time(self.wait_start) / 1e3
            copy = self.copy_start.elapsed_time(self.copy_end) / 1e3
            # The compute stream resumes at the later of the wait's start and the copy's end.
            stall = self.wait_start.elapsed_time(self.wait_end) / 1e3
            op = wait_own = 0.0
            if self.entered is not None and self.left is not None:
                self.left.synchronize()  # before ``wait_end`` on the compute stream: done already
                op = self.entered.elapsed_time(self.left) / 1e3
            issue_op = op
            issued, waited = origin.elapsed_time(self.issue) / 1e3, origin.elapsed_time(self.wait_start) / 1e3
            host_window = None if self.behind else max(0.0, self.host_wait - self.host_issue)
        measured = TransferTime(
            self.name, self.direction, self.nbytes, max(window, 0.0), max(copy, 0.0), max(stall, 0.0), max(op, 0.0),
            host_window, max(window, 0.0),
        )
        return Resolved(measured, issued, waited, max(issue_op, 0.0), wait_own)


def now(device: torch.device) -> Any:
    """A stamp of now on ``device``'s compute stream: the CPU's clock, or a timing event."""
    if device.type == "cpu":
        return time.perf_counter()
    return _event(torch.accelerator.current_stream(device))


def _event(stream: torch.Stream) -> torch.Event:
    event = torch.Event(device=stream.device, enable_timing=True)
    stream.record_event(event)
    return event
