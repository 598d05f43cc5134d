"""Runtime ops of fxoffload: the only place that touches streams, events and host buffers.

Every transfer is two nodes in the graph, found by ``node.target``::

    forward, one offloaded tensor ``x`` whose last forward users are ``u1 .. uk``:
        x_host = fxoffload.offload(x, [u1, .., uk])   # D2H copy on the transfer stream into a pooled host buffer
        x_host = fxoffload.wait(x_host, x, [b])      # compute stream waits on the copy's event; x dies after this
        return (..., x_host)                         # the host copy is saved for backward, x is not

    (``b`` is the node ``prefetch`` compute nodes after the copy started: the copy overlaps with them.)

    backward, ``a`` being the node ``prefetch`` compute nodes before the first use:
        x_dev = fxoffload.reload(x_host, device, [a]) # H2D copy into a buffer allocated on the compute stream
        x_dev = fxoffload.wait(x_dev, x_host, [])    # compute stream waits on the copy's event
        first_use(x_dev)

The one hard rule: a storage that a transfer reads or writes stays alive through a graph edge to the
transfer's ``wait`` (its ``keepalive`` argument), and ``wait`` makes the compute stream wait on the
transfer's event before that edge ends. ``record_stream`` is never used. Ordering never relies on the
position of a node in the graph: the ``after`` lists are data edges that pin a copy behind the nodes it
must follow, so schedulers that reorder (Inductor's ``reorder_for_peak_memory``) cannot break it.

On a machine without an accelerator (``offload_cpu=True``) the same ops run synchronously with CPU
tensors: the "host" copy is a separate buffer and the source storage is released exactly as on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from collections.abc import Sequence

import torch

from ._compat import storage_expired, storage_use_count, storage_weak_ref

log = logging.getLogger(__name__)

_LIB_NAME = "fxoffload"

# --------------------------------------------------------------------------------------------------
# Host buffer pool
# --------------------------------------------------------------------------------------------------


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
        self._pin_failed = False
        self._tick = 0  # acquisitions so far: the clock of least-recently-used eviction
        self._peak_in_use = 0

    def acquire(self, nbytes: int, pin: bool, device: torch.device | str | None = None) -> torch.Tensor:
        """``nbytes`` uint8 bytes at the start of a buffer (pinned if asked and possible) that no
        tensor used; the buffer may be larger. The buffer stays taken while the returned tensor, or
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
        size = size_class(nbytes)
        dev = str(device) if device is not None else ""
        with self._lock:
            self._tick += 1
            for cls in sorted(c for c, p, d in self._buckets if p == pin and d == dev and size <= c <= 2 * size):
                for buffer in self._buckets[(cls, pin, dev)]:
                    if _use_count(buffer.storage) == 1:
                        buffer.last_used = self._tick
                        return _claim(buffer.storage, nbytes)
            self._make_room(size)
            storage, pinned = self._allocate(size, pin)
            self._buckets.setdefault((size, pinned, dev), []).append(_PooledBuffer(storage, self._tick))
            return _claim(storage, nbytes)

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

    def _allocate(self, nbytes: int, pin: bool) -> tuple[torch.UntypedStorage, bool]:
        # Whether a buffer is pinned is known here and kept in its bucket's key: asking the storage
        # (UntypedStorage.is_pinned) goes through a deprecated path on torch 2.11.
        if pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage(), True
            except RuntimeError as e:  # out of pinned (page-locked) memory
                self._pin_failed = True
                warnings.warn(
                    f"fxoffload: pinned host allocation of {nbytes} bytes failed ({e}); "
                    "falling back to pageable host memory, transfers will be synchronous and slower",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage(), False

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

    def clear(self) -> None:
        """Forget every buffer: free ones are freed now, buffers in use stay alive through their
        tensors only (``stats`` no longer counts them) and are freed, not reused, when those go."""
        with self._lock:
            self._buckets.clear()
            self._peak_in_use = 0


@dataclasses.dataclass
class _PooledBuffer:
    storage: torch.UntypedStorage
    last_used: int  # the pool's acquisition count when it was last handed out


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a quarter-octave size class (at most 25% more, powers of two exact)."""
    if nbytes <= 8:
        return nbytes
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


def _claim(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))


def _use_count(storage: torch.UntypedStorage) -> int:
    # The pool's own reference is the only one when this is 1. The temporary Python handle made by
    # ``storage._cdata`` access does not add a strong reference.
    return storage_use_count(storage)


HOST_POOL = HostBufferPool()


def host_pool_stats() -> HostPoolStats:
    """Size of the host buffer pool that holds offloaded activations."""
    return HOST_POOL.stats()


def release_host_memory() -> None:
    """Free the pooled host buffers that no tensor references any more; the pool forgets the others,
    which are freed when their last tensor goes."""
    HOST_POOL.clear()


# --------------------------------------------------------------------------------------------------
# Streams and pending transfers
# --------------------------------------------------------------------------------------------------

_transfer_streams: dict[torch.device, torch.Stream] = {}


def _transfer_stream(device: torch.device) -> torch.Stream:
    stream = _transfer_streams.get(device)
    if stream is None:
        stream = _transfer_streams[device] = torch.Stream(device=device)
    return stream


@dataclasses.dataclass
class _Pending:
    event: torch.Event | None  # None: the copy ran synchronously (CPU tensors)
    device: torch.device  # the accelerator whose compute stream must wait


# Keyed by the data pointer of a transfer's destination: unique while that destination is alive,
# and the destination is alive until its ``wait`` because ``wait`` takes it as an argument.
_pending: dict[int, _Pending] = {}

# Opt-in record of released source storages, read by tests to prove the release really happened.
_release_log: list[tuple[int, object]] | None = None


def _track(src: torch.Tensor) -> None:
    if _release_log is not None:
        _release_log.append((id(src), storage_weak_ref(src.untyped_storage())))


class track_releases:
    """Context manager recording a weak reference to every offloaded source storage.

    ``.released()`` / ``.alive()`` tell how many of those storages were freed. Used by the tests to
    prove that offloading really gives the memory back; weak references never keep a storage alive.
    """

    def __enter__(self) -> track_releases:
        global _release_log
        self._previous = _release_log
        _release_log = []
        self.log = _release_log
        return self

    def __exit__(self, *exc: object) -> None:
        global _release_log
        _release_log = self._previous

    def count(self) -> int:
        return len(self.log)

    def alive(self) -> int:
        return sum(not storage_expired(ref) for _, ref in self.log)

    def released(self) -> int:
        return self.count() - self.alive()


def _register(dest: torch.Tensor, event: torch.Event | None, device: torch.device) -> None:
    key = dest.data_ptr()
    if key in _pending:
        log.debug("fxoffload: dropping a stale pending transfer at %#x", key)
    _pending[key] = _Pending(event, device)


def _pop(dest: torch.Tensor) -> _Pending:
    try:
        return _pending.pop(dest.data_ptr())
    except KeyError:
        raise RuntimeError(
            "fxoffload.wait: no transfer is pending for this tensor; every wait must follow the "
            "offload or reload that produced its first argument"
        ) from None


def _layout_like(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(0, dtype=like.dtype, device=storage.device)
    return out.set_(storage, 0, like.size(), like.stride())


def _dense_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------

_lib = torch.library.Library(_LIB_NAME, "DEF")
_lib.define("offload(Tensor src, Tensor[] after) -> Tensor")
_lib.define("reload(Tensor host, Device device, Tensor[] after) -> Tensor")
_lib.define("wait(Tensor(a) dest, Tensor keepalive, Tensor[] after) -> Tensor(a)")


def _offload_impl(src: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    # src is dense and non-overlapping (the planner refuses anything else), so its storage bytes are
    # copied as they are and the host tensor keeps its size and stride: reload restores the layout.
    claim = HOST_POOL.acquire(_dense_nbytes(src), pin=src.device.type != "cpu", device=src.device)
    host = _layout_like(claim.untyped_storage(), src)  # the first bytes of a buffer maybe larger
    _track(src)
    if src.device.type == "cpu":
        host.copy_(src)
        _register(host, None, src.device)
        return host
    compute = torch.accelerator.current_stream(src.device)
    transfer = _transfer_stream(src.device)
    transfer.wait_stream(compute)  # the producer and the last forward users have been issued
    event = torch.Event(device=src.device)
    with transfer:  # restores the previous stream and current device on exit
        host.copy_(src, non_blocking=True)  # pinned pool buffer, or pageable: then the copy syncs
        transfer.record_event(event)
    _register(host, event, src.device)
    return host


def _reload_impl(
    host: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    # Allocated on the compute stream (the current one), so the caching allocator ties the block to
    # the stream that uses it; the copy itself runs on the transfer stream.
    dest = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)
    if device.type == "cpu":
        dest.copy_(host)
        _register(dest, None, device)
        return dest
    compute = torch.accelerator.current_stream(device)
    transfer = _transfer_stream(device)
    transfer.wait_stream(compute)  # the allocation of dest is ordered before the copy into it
    event = torch.Event(device=device)
    with transfer:
        dest.copy_(host, non_blocking=True)
        transfer.record_event(event)
    _register(dest, event, device)
    return dest


def _wait_impl(
    dest: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    pending = _pop(dest)
    if pending.event is not None:
        torch.accelerator.current_stream(pending.device).wait_event(pending.event)
    # ``keepalive`` ends here: its storage may be freed and reused from now on, which is safe
    # because every later kernel on the compute stream is ordered after the copy.
    return dest


def _offload_fake(src: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device="cpu")


def _reload_fake(
    host: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


def _wait_fake(
    dest: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    return dest


for _name, _impl, _fake in (
    ("offload", _offload_impl, _offload_fake),
    ("reload", _reload_impl, _reload_fake),
    ("wait", _wait_impl, _wait_fake),
):
    # One implementation for every device: the arguments mix host and device tensors.
    torch.library.impl(f"{_LIB_NAME}::{_name}", "CompositeExplicitAutograd", lib=_lib)(_impl)
    torch.library.register_fake(f"{_LIB_NAME}::{_name}", lib=_lib)(_fake)

_FAKES = {"offload": _offload_fake, "reload": _reload_fake, "wait": _wait_fake}


def fake_impl(op: torch._ops.OpOverload):
    """The fake (meta) function of one of our ops, to build ``meta["val"]`` without dispatching."""
    return _FAKES[op._opname]


offload = torch.ops.fxoffload.offload.default
reload = torch.ops.fxoffload.reload.default
wait = torch.ops.fxoffload.wait.default

# The copies have effects the graph does not see (a registered event); never dead-code eliminate them.
for _op in (offload, reload, wait):
    torch.fx.node.has_side_effect(_op)

TRANSFER_OPS = frozenset({offload, reload, wait})
