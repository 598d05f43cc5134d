"""How many host bytes a host buffer of a given size really takes: one rule for the pool and the planner.

Pageable buffers (``offload_cpu`` on a machine without an accelerator) are allocated at the pool's own
size class: ``nbytes`` rounded up to a quarter octave (at most 25% more, powers of two exact), so that
tensors whose sizes vary step to step reuse each other's buffers.

Pinned buffers come from torch's caching host allocator (``pin_memory=True``), which rounds every
request up to a power of two (``CachingHostAllocator``: ``PowerOf2Ceil(size)`` below
``pinned_max_round_threshold``, unbounded by default) and keeps the whole block. Asking it for the
quarter-octave class of a 33 MiB tensor (40 MiB) would take 64 MiB of page-locked memory while the
pool, its statistics and ``host_budget`` counted 40. So pinned buffers are sized at the power of two
themselves: the pool uses all of what it holds, and every count is of real pinned bytes. (A
``pinned_max_round_threshold`` set through the allocator's configuration is not read here: above it,
the counts are up to 2x high, never low.)
"""

from __future__ import annotations

__all__ = ["size_class"]


def size_class(nbytes: int, pinned: bool = False) -> int:
    """The bytes a host buffer able to hold ``nbytes`` really takes: the next power of two when
    ``pinned``, else ``nbytes`` rounded up to a quarter octave."""
    if nbytes <= 8:
        return max(nbytes, 1) if pinned else nbytes
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step
