"""Host buffers that hold offloaded tensors, reused across steps. Imports nothing of the pass."""

from __future__ import annotations

import dataclasses
import mmap
import threading
import weakref

import torch

from .._compat import storage_use_count
from ..sizes import host_bytes
from ..warn import warn

__all__ = [
    "HOST_POOL", "STAGING_POOL", "HostBufferPool", "HostPoolStats", "host_buffer_ranges", "host_pool_stats",
    "kept_on_device", "keep_on_device", "release_host_memory",
]  # fmt: skip


@dataclasses.dataclass
class HostPoolStats:
    """What the host buffer pool holds now."""

    buffers: int  # buffers allocated by the pool, free or in use
    # Bytes of those buffers (sizes rounded up to their class). The pool allocates only when nothing
    # free fits and then keeps at most twice the most bytes it ever had in use at once.
    bytes_allocated: int
    bytes_in_use: int  # bytes of buffers that some tensor still references now
    pinned_bytes: int  # bytes of those buffers that are page-locked (only with an accelerator)
    pin_failed: bool  # a pinned allocation failed and the pool fell back to pageable memory


class HostBufferPool:
    """Host buffers reused across steps, bucketed by size class.

    A buffer is free when nothing but the pool references its storage (use count 1),
    so a buffer still held by autograd (``retain_graph=True``, a second backward) is never handed out
    twice. Pinned allocations cost milliseconds and can synchronise; steps repeat the same sizes, so
    after the first step no allocation happens at all.

    Sizes are rounded up to quarter-octave classes (at most 25% more than asked), and a request may
    take a free buffer up to twice its size, so tensors whose sizes vary (dynamic shapes: another
    sequence length every step) reuse the buffers of earlier steps. A new allocation happens only
    when nothing free fits; then free buffers are dropped, least recently used first, until the pool
    holds at most twice the largest number of bytes it ever had in use at once: the pool is bounded
    by what the steps need, not by how many sizes they had.
    """

    # A pool may hold this many times the most bytes it ever had in use at once.
    MAX_POOL_OVER_PEAK = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (size class, pinned, device the buffer serves) -> buffers
        self._buckets: dict[tuple[int, bool, str], list[_PooledBuffer]] = {}
        self._sorted: dict[tuple[bool, str], list[int]] = {}  # ``_classes``
        self._pin_failed = False
        self._tick = 0  # acquisitions so far: the clock of least-recently-used eviction
        self._peak_in_use = 0

    def acquire(
        self, nbytes: int, pin: bool, device: torch.device | str | None = None, like: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``nbytes`` uint8 bytes at the start of a buffer (pinned if asked and possible) that no
        tensor used, or ``like``'s dtype, size and stride there (``nbytes`` its span); the buffer may
        be larger. The buffer stays taken while the returned tensor, or
        any tensor made on its storage, is alive.

        The claim is made under the lock: handing out the pool's own storage handle would leave the
        buffer looking free (use count 1) until the caller wrapped it, and another thread could take
        it in between.

        Buffers serve one ``device`` each: a buffer becomes free on the host as soon as its last
        tensor goes, while a reload's copy out of it may still run on that device's transfer stream.
        Reused for the same device, the next copy into it queues behind on the same stream; another
        device's stream would not wait for it.
        """
        pin = pin and not self._pin_failed
        size = host_bytes(nbytes, pin)  # pinned: a power of two, what the host allocator really takes
        dev = str(device) if device is not None else ""
        with self._lock:
            self._tick += 1
            for cls in self._classes(pin, dev):
                if not size <= cls <= 2 * size:
                    continue
                bucket = self._buckets[(cls, pin, dev)]
                for i, buffer in enumerate(bucket):  # least recently handed out first: the likely free ones
                    if _use_count(buffer.storage) == 1:
                        buffer.last_used = self._tick
                        bucket.append(bucket.pop(i))
                        return _claim(buffer.storage, nbytes, like)
            self._make_room(size)
            storage, pinned = self._allocate(nbytes, pin)
            key = (storage.nbytes(), pinned, dev)
            if key not in self._buckets:
                self._buckets[key] = []
                self._sorted.clear()
            self._buckets[key].append(_PooledBuffer(storage, self._tick))
            return _claim(storage, nbytes, like)

    def _classes(self, pin: bool, dev: str) -> list[int]:
        """The size classes of ``pin``, ``dev``'s buckets, smallest first (kept until buckets change)."""
        key = (pin, dev)
        classes = self._sorted.get(key)
        if classes is None:
            classes = self._sorted[key] = sorted(c for c, p, d in self._buckets if p == pin and d == dev)
        return classes

    def _make_room(self, size: int) -> None:
        """Before allocating ``size`` bytes: drop free buffers beyond the pool's bound."""
        in_use = self._bytes_in_use() + size
        self._peak_in_use = max(self._peak_in_use, in_use)
        limit = self.MAX_POOL_OVER_PEAK * self._peak_in_use
        total = size + sum(b.storage.nbytes() for bucket in self._buckets.values() for b in bucket)
        if total <= limit:
            return
        free = sorted(
            ((b.last_used, key, b) for key, bucket in self._buckets.items() for b in bucket
             if _use_count(b.storage) == 1),
            key=lambda f: f[0],
        )  # fmt: skip
        for _, key, buffer in free:
            if total <= limit:
                break
            total -= buffer.storage.nbytes()
            self._buckets[key].remove(buffer)
            if not self._buckets[key]:
                del self._buckets[key]
                self._sorted.clear()

    def _allocate(self, nbytes: int, pin: bool) -> tuple[torch.UntypedStorage, bool]:
        """A buffer of ``host_bytes(nbytes, pinned)`` bytes: its storage's size is what it really takes.

        Whether a buffer is pinned is known here and kept in its bucket's key: asking the storage
        (UntypedStorage.is_pinned) goes through a deprecated path on torch 2.11."""
        if pin:
            try:
                pinned = torch.empty(host_bytes(nbytes, pinned=True), dtype=torch.uint8, pin_memory=True)
                return pinned.untyped_storage(), True
            except RuntimeError as e:  # out of pinned (page-locked) memory
                self._pin_failed = True
                warn(
                    f"fxoffload: pinned host allocation of {nbytes} bytes failed ({e}); "
                    "falling back to pageable host memory, transfers will be synchronous and slower"
                )
        return torch.empty(host_bytes(nbytes), dtype=torch.uint8).untyped_storage(), False

    def _bytes_in_use(self) -> int:
        return sum(
            b.storage.nbytes() for bucket in self._buckets.values() for b in bucket
            if _use_count(b.storage) > 1
        )  # fmt: skip

    def stats(self) -> HostPoolStats:
        with self._lock:
            buffers = [b for bucket in self._buckets.values() for b in bucket]
            pinned = [b for (_, is_pinned, _), bucket in self._buckets.items() if is_pinned for b in bucket]
            return HostPoolStats(
                buffers=len(buffers),
                bytes_allocated=sum(b.storage.nbytes() for b in buffers),
                bytes_in_use=self._bytes_in_use(),
                pinned_bytes=sum(b.storage.nbytes() for b in pinned),
                pin_failed=self._pin_failed,
            )

    def buffer_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every buffer the pool holds, free or in use."""
        with self._lock:
            buffers = [b.storage for bucket in self._buckets.values() for b in bucket]
        return [(storage.data_ptr(), storage.nbytes()) for storage in buffers]

    def clear(self) -> None:
        """Forget every buffer: free ones are freed now, buffers in use stay alive through their
        tensors only (``stats`` no longer counts them) and are freed, not reused, when those go."""
        with self._lock:
            self._buckets.clear()
            self._sorted.clear()
            self._peak_in_use = 0


@dataclasses.dataclass
class _PooledBuffer:
    storage: torch.UntypedStorage
    last_used: int  # the pool's acquisition count when it was last handed out


def _claim(storage: torch.UntypedStorage, nbytes: int, like: torch.Tensor | None) -> torch.Tensor:
    if like is None:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))
    return torch.empty(0, dtype=like.dtype, device=storage.device).set_(storage, 0, like.size(), like.stride())


def _use_count(storage: torch.UntypedStorage) -> int:
    # The pool's own reference is the only one when this is 1. The temporary Python handle made by
    # ``storage._cdata`` access does not add a strong reference.
    return storage_use_count(storage)


HOST_POOL = HostBufferPool()
# Where the CPU copy engine's threads write before a wait publishes the bytes: host memory of its
# own, apart from the pool of offloaded tensors so that pool's figures stay what a GPU run would show.
STAGING_POOL = HostBufferPool()


def host_pool_stats() -> HostPoolStats:
    """Size of the host buffer pool that holds offloaded activations."""
    return HOST_POOL.stats()


def release_host_memory() -> None:
    """Free the pooled host buffers that no tensor references any more; the pool forgets the others,
    which are freed when their last tensor goes."""
    HOST_POOL.clear()


def host_buffer_ranges() -> list[tuple[int, int]]:
    """``(address, nbytes)`` of every host buffer fxoffload holds now: the pool of offloaded tensors
    and the CPU copy engine's staging buffers. ``fxoffload.measure_memory`` and the reading of what
    code before a graph holds leave them out of a CPU's figures: on a GPU machine they are host
    memory, not the device's."""
    kept = [(address, len(handle)) for address, handle in list(_KEPT.items())]
    return HOST_POOL.buffer_ranges() + STAGING_POOL.buffer_ranges() + kept


class _KeptOnDevice(mmap.mmap):
    """The host handle of a copy switched off at run time (``keep_on_device``): an anonymous mapping
    that is never written, so it takes no host memory, holding the device copy of its tensor."""

    kept: torch.Tensor


# By the handle's address: unique while the handle is alive, and an entry goes when it does.
_KEPT: weakref.WeakValueDictionary[int, _KeptOnDevice] = weakref.WeakValueDictionary()


def keep_on_device(kept: torch.Tensor) -> torch.Tensor:
    """A host tensor of ``kept``'s size, stride and dtype whose storage holds ``kept`` (a device
    tensor): the host handle an offload switched off at run time returns, so that its device copy
    lives exactly as long as the host tensor autograd saves, and no longer. ``kept_on_device`` of
    the handle gives ``kept`` back."""
    nbytes = max(1, kept.untyped_storage().nbytes())
    handle = _KeptOnDevice(-1, nbytes)
    handle.kept = kept
    storage = torch.frombuffer(handle, dtype=torch.uint8).untyped_storage()  # holds a reference to ``handle``
    host = torch.empty(0, dtype=kept.dtype).set_(storage, kept.storage_offset(), kept.size(), kept.stride())
    _KEPT[storage.data_ptr()] = handle
    return host


def kept_on_device(host: torch.Tensor) -> torch.Tensor | None:
    """The device tensor ``host`` holds, if ``host`` is a handle made by ``keep_on_device``; else None."""
    handle = _KEPT.get(host.untyped_storage().data_ptr())
    return handle.kept if handle is not None else None
