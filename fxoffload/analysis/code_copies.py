"""A pair's replay of Inductor's code (``code_memory``), once per distinct code and never failing
(``replay_pair``, ``replay_forward``), and the host copies over it: where each is taken, reloaded
and released, read from the statements the replay's points are labelled with."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Collection, Mapping, Sequence

import torch

from .code_memory import simulate_forward_code, simulate_output_code
from .memory import MemoryTimeline, bytes_over_points, with_held

log = logging.getLogger(__name__)

__all__ = ["host_in_flight", "kept_in_replay", "replay_forward", "replay_pair"]

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


@functools.lru_cache(maxsize=32)
def _replay_cached(
    forward: str, backward: str, num_fwd_outputs: int | None, outside: int, outside_backward: int,
    scratch: tuple[tuple[str, int, int], ...] = (),
) -> MemoryTimeline:
    kw = {"scratch": {(p, line): b for p, line, b in scratch}, "outside": outside, "outside_backward": outside_backward}
    return simulate_output_code(forward, backward, num_fwd_outputs, **kw)


@functools.lru_cache(maxsize=32)
def _replay_kept_cached(*args: object, copies: tuple[tuple[str, int, int], ...], kept: frozenset[str]) -> MemoryTimeline:
    replay = _replay_cached(*args)
    held = kept_in_replay(replay, copies, kept)
    return with_held(replay, held) if held is not None else replay


def replay_pair(
    output_code: Mapping[str, str],
    num_fwd_outputs: int | None,
    outside: int = 0,
    outside_backward: int = 0,
    copies: Sequence[tuple[str, int, int]] = (),
    kept: Collection[str] = (),
    scratch: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> MemoryTimeline | None:
    """``simulate_output_code`` of a pair's wrapper codes (``{"forward": ..., "backward": ...}``), once
    per distinct codes and arguments. None until both graphs are compiled, and for code this reader
    does not know (a new Inductor): no figure then, never a failure. ``kept``: host placeholders of
    copies switched off at run time, counted on the device (``kept_in_replay``; ``copies`` as there).
    ``scratch``: ``(line, bytes)`` of the calls' measured scratch by graph ("forward", "backward";
    ``simulate_output_code``)."""
    forward, backward = output_code.get("forward"), output_code.get("backward")
    if not forward or not backward:
        return None
    try:
        flat = tuple((phase, line, b) for phase, lines in sorted((scratch or {}).items()) for line, b in lines)
        args = (forward, backward, num_fwd_outputs, outside, outside_backward, flat)
        if kept:
            return _replay_kept_cached(*args, copies=tuple(copies), kept=frozenset(kept))
        return _replay_cached(*args)
    except ValueError as e:
        log.debug("fxoffload: cannot replay the generated code: %s", e)
        return None


def replay_forward(
    forward: str, saved_dtypes: Sequence[torch.dtype | None], outside: int = 0,
    scratch: Sequence[tuple[int, int]] = (),
) -> MemoryTimeline | None:
    """``simulate_forward_code`` of a pair's forward code, ``scratch`` by line as in ``replay_pair``;
    None for code this reader does not know."""
    try:
        return simulate_forward_code(forward, saved_dtypes, {("forward", line): b for line, b in scratch}, outside)
    except ValueError as e:
        log.debug("fxoffload: cannot replay the generated forward: %s", e)
        return None
