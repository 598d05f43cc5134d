"""Host copies over a replay of Inductor's code (``code_memory``): where each is taken, reloaded and
released, read from the statements the replay's points are labelled with."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from .memory import MemoryTimeline, bytes_over_points

__all__ = ["host_in_flight", "kept_in_replay"]

_OFFLOAD_CALL = "torch.ops.fxoffload.offload.default("
_RELOAD_CALL = "torch.ops.fxoffload.reload.default("
_WORD = re.compile(r"\b\w+\b")


def host_in_flight(
    timeline: MemoryTimeline, copies: Sequence[tuple[str, int, int]], skip: Collection[str] = ()
) -> list[int] | None:
    """Host copies in flight at every point of a replay (its points are labelled with their
    statements). ``copies``: ``(host placeholder name, forward position, bytes)`` of the plan's
    offloads. They are taken, in forward order, at the forward's ``fxoffload.offload`` statements, in
    their order (Inductor may reorder offloads of different sizes: then the forward figures between
    them are off, the backward's are not), and released after the last backward statement naming the
    placeholder that holds them (its ``del``). None when the code has another number of offloads than
    the plan, or never names a copy's placeholder. ``skip``: host placeholders of copies left out (switched
    off at run time: no host bytes)."""
    spans = _copy_spans(timeline, copies)
    if spans is None:
        return None
    return bytes_over_points(
        len(timeline.points), [(start, last + 1, nbytes) for host, nbytes, start, _, last in spans if host not in skip]
    )  # fmt: skip


def kept_in_replay(
    timeline: MemoryTimeline, copies: Sequence[tuple[str, int, int]], kept: Collection[str]
) -> list[int] | None:
    """Device bytes at every point of a replay that the copies switched off at run time keep (their
    host placeholders' names in ``kept``; ``copies`` as for ``host_in_flight``, all of the plan's): the
    offload keeps a copy on the device from its statement until the reload, which gives that copy
    back (the replay counts the reload's result from there)."""
    spans = _copy_spans(timeline, copies)
    if spans is None:
        return None
    return bytes_over_points(
        len(timeline.points), [(start, reload, nbytes) for host, nbytes, start, reload, _ in spans if host in kept]
    )  # fmt: skip


def _copy_spans(
    timeline: MemoryTimeline, copies: Sequence[tuple[str, int, int]]
) -> list[tuple[str, int, int, int, int]] | None:
    """Per copy: its host placeholder, bytes, the forward point of its offload, the backward point of
    its reload, and the last backward point naming the placeholder. None where the code does not match."""
    points = timeline.points
    starts = [i for i, p in enumerate(points) if p.phase == "forward" and _OFFLOAD_CALL in p.node]
    if len(starts) != len(copies):
        return None
    naming: dict[str, list[int]] = {}  # word -> backward points whose statement names it
    for i, p in enumerate(points):
        if p.phase == "backward":
            for word in set(_WORD.findall(p.node.split(": ", 1)[-1])):
                naming.setdefault(word, []).append(i)
    spans = []
    for start, (host_name, _, nbytes) in zip(starts, sorted(copies, key=lambda c: c[1])):
        named = naming.get(host_name)
        if not named:
            return None
        reload = next((i for i in named if _RELOAD_CALL in points[i].node), named[0])
        spans.append((host_name, nbytes, start, reload, named[-1]))
    return spans
