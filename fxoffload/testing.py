"""Helpers for testing fxoffload itself: break an ordering rule on purpose.

Each rule the rewrite keeps exists because breaking it corrupts gradients somewhere (TRL #7195,
Megatron-LM #7398, torchtune #1867). The suite proves it would notice: with ``broken_rule(name)``
the rewrite breaks ``name``, and the tests assert that training then fails loudly or gives wrong
numbers (the CPU copy engine fills unwritten destinations with NaN).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import rewrite


@contextlib.contextmanager
def broken_rule(name: str) -> Iterator[None]:
    """Compile graphs with one ordering rule broken: ``no_wait_before_use`` (a reload's result is used
    before its wait), ``source_released_at_issue`` (the offloaded tensor is not kept alive until its
    wait), ``reload_before_written`` (the host copy is saved without waiting for the offload), and
    ``no_order_edges`` (no ``fxoffload.order`` edge bounds a copy from below: results stay right, but
    Inductor's reordering may put each copy right next to its wait, so nothing overlaps)."""
    if name not in rewrite.BROKEN_RULES:
        raise ValueError(f"fxoffload: unknown rule {name!r}; choose one of: {', '.join(rewrite.BROKEN_RULES)}")
    previous, rewrite._broken = rewrite._broken, name
    try:
        yield
    finally:
        rewrite._broken = previous
