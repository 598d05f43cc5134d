"""How many bytes a tensor, a storage or a host buffer takes: the one byte rule of fxoffload.

Four quantities, each with one function, so that the planner, the memory models, the runtime, the
reports and the host budget all count the same way:

- ``tensor_bytes(val)``: the dense bytes of a (possibly fake, possibly symbolic) tensor, numel times
  the element size at size hints (a size that depends on the data at torch's estimate,
  ``_compat.size_hint``). What the FX memory model and the plan count per tensor.
- ``span_bytes(size, stride, dtype)``: the bytes of the storage a strided layout addresses, from its
  first element to its last, gaps included (``empty_strided`` allocates this much). What the replay
  of Inductor's code counts, and what a transfer copies (``span_elements``).
- ``host_bytes(nbytes, pinned)``: the bytes a host buffer able to hold ``nbytes`` really takes.
- ``distinct_storage_bytes(tensors)``: the bytes of the distinct storages of real tensors.
- ``cuda_block_bytes(nbytes)``: what the CUDA caching allocator counts for a storage (its block).

``fmt_bytes`` writes a count for people.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._compat import size_hint

__all__ = [
    "CUDA_BLOCK_BYTES", "cuda_block_bytes", "distinct_storage_bytes", "fmt_bytes", "host_bytes", "span_bytes",
    "span_elements", "tensor_bytes",
]  # fmt: skip

# The CUDA caching allocator hands out blocks whose size is a multiple of this (c10's kMinBlockSize).
CUDA_BLOCK_BYTES = 512


def tensor_bytes(val: torch.Tensor) -> int:
    """numel x element size of ``val``, symbolic sizes at their hints (no guard is added)."""
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()


def span_elements(size: Sequence[Any], stride: Sequence[Any]) -> int:
    """Elements from the first to the last one a layout addresses in its storage, gaps included:
    ``numel`` for a dense layout; 0 for an empty one. A padded buffer (on CUDA, Inductor's
    ``comprehensive_padding`` turns a 4096x1050 fp32 stride (1050, 1) into (1056, 1)) spans more."""
    if len(size) != len(stride):
        raise ValueError(f"size {tuple(size)} and stride {tuple(stride)} must have the same length")
    sizes = [size_hint(s) for s in size]
    if any(s == 0 for s in sizes):
        return 0
    return 1 + sum((s - 1) * size_hint(st) for s, st in zip(sizes, stride))


def span_bytes(size: Sequence[Any], stride: Sequence[Any], dtype: torch.dtype) -> int:
    """Bytes of the storage an ``empty_strided(size, stride, dtype)`` allocates: its span."""
    return span_elements(size, stride) * dtype.itemsize


def host_bytes(nbytes: int, pinned: bool = False) -> int:
    """The bytes a host buffer able to hold ``nbytes`` really takes: one rule for the host pool and
    the planner's ``host_budget``.

    Pinned buffers come from torch's caching host allocator, which rounds every request up to a
    power of two (``CachingHostAllocator``: ``PowerOf2Ceil(size)`` below
    ``pinned_max_round_threshold``, unbounded by default) and keeps the whole block; so pinned
    buffers are sized at that power of two and every count is of real pinned bytes. (A threshold
    set through the allocator's configuration is not read: above it, counts are up to 2x high,
    never low.) Pageable buffers (``offload_cpu``) are sized at a quarter-octave class (at most 25%
    more, powers of two exact), so that tensors whose sizes vary step to step reuse each other's."""
    if nbytes <= 8:
        return max(nbytes, 1) if pinned else nbytes
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes ``torch.cuda.memory_allocated`` counts for a storage of ``nbytes``: the block the caching
    allocator hands out, ``nbytes`` rounded up to a multiple of ``CUDA_BLOCK_BYTES`` (c10's
    ``round_size``); 0 stays 0 (no block). With ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions``
    large sizes round further; not modelled."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of real ``tensors`` (a view and its base counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def fmt_bytes(n: int) -> str:
    """``1.5 MiB``, ``512 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
