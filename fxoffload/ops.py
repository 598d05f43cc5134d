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

import copy
import dataclasses
import logging
import queue
import threading
import time
import warnings
from collections.abc import Sequence

import torch

from .host_memory import size_class
from ._compat import free_storage_weak_ref, storage_expired, storage_use_count, storage_weak_ref

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
        size = size_class(nbytes, pin)  # pinned: a power of two, what the host allocator really takes
        dev = str(device) if device is not None else ""
        with self._lock:
            self._tick += 1
            for cls in sorted(c for c, p, d in self._buckets if p == pin and d == dev and size <= c <= 2 * size):
                for buffer in self._buckets[(cls, pin, dev)]:
                    if _use_count(buffer.storage) == 1:
                        buffer.last_used = self._tick
                        return _claim(buffer.storage, nbytes)
            self._make_room(size)
            storage, pinned = self._allocate(nbytes, pin)
            key = (storage.nbytes(), pinned, dev)
            self._buckets.setdefault(key, []).append(_PooledBuffer(storage, self._tick))
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
        """A buffer of ``size_class(nbytes, pinned)`` bytes: its storage's size is what it really takes.

        Whether a buffer is pinned is known here and kept in its bucket's key: asking the storage
        (UntypedStorage.is_pinned) goes through a deprecated path on torch 2.11."""
        if pin:
            try:
                pinned = torch.empty(size_class(nbytes, pinned=True), dtype=torch.uint8, pin_memory=True)
                return pinned.untyped_storage(), True
            except RuntimeError as e:  # out of pinned (page-locked) memory
                self._pin_failed = True
                warnings.warn(
                    f"fxoffload: pinned host allocation of {nbytes} bytes failed ({e}); "
                    "falling back to pageable host memory, transfers will be synchronous and slower",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return torch.empty(size_class(nbytes), dtype=torch.uint8).untyped_storage(), False

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


def host_buffer_ranges() -> list[tuple[int, int]]:
    """``(address, nbytes)`` of every host buffer fxoffload holds now: the pool of offloaded tensors
    and the CPU copy engine's staging buffers. ``fxoffload.measure_memory`` leaves their allocations
    out of a CPU's figures: on a GPU machine they are host memory, not the device's."""
    ranges = []
    for pool in (HOST_POOL, STAGING_POOL):
        with pool._lock:
            buffers = [b.storage for bucket in pool._buckets.values() for b in bucket]
        ranges += [(storage.data_ptr(), storage.nbytes()) for storage in buffers]
    return ranges


# --------------------------------------------------------------------------------------------------
# Layouts: a transfer copies the whole strided span of its tensor
# --------------------------------------------------------------------------------------------------


def span_elements(t: torch.Tensor) -> int:
    """Elements from the first to the last one ``t`` addresses in its storage, gaps included.

    Equal to ``numel`` for dense tensors. Inductor may hand the ops a padded buffer (on CUDA,
    ``comprehensive_padding`` turns a 4096x1050 fp32 stride (1050, 1) into (1056, 1)); copying the
    span keeps the very buffer the graph computed, with its layout, instead of a dense copy of it.
    """
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _span(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage bytes ``t`` addresses (one contiguous run: a plain memcpy)."""
    return t.as_strided((span_elements(t),), (1,), t.storage_offset())


def _layout_like(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(0, dtype=like.dtype, device=storage.device)
    return out.set_(storage, 0, like.size(), like.stride())


def _span_nbytes(t: torch.Tensor) -> int:
    return span_elements(t) * t.element_size()


# --------------------------------------------------------------------------------------------------
# Transfers in flight
# --------------------------------------------------------------------------------------------------

_transfer_streams: dict[torch.device, torch.Stream] = {}


def _transfer_stream(device: torch.device) -> torch.Stream:
    stream = _transfer_streams.get(device)
    if stream is None:
        stream = _transfer_streams[device] = torch.Stream(device=device)
    return stream


@dataclasses.dataclass
class _Pending:
    event: torch.Event | None  # a GPU copy: the event recorded after it on the transfer stream
    device: torch.device  # the device whose compute stream must wait
    job: _CopyJob | None = None  # a CPU copy: the copy engine's job


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


def _register(dest: torch.Tensor, pending: _Pending) -> None:
    key = dest.data_ptr()
    if key in _pending:
        log.debug("fxoffload: dropping a stale pending transfer at %#x", key)
    _pending[key] = pending


def _pop(dest: torch.Tensor) -> _Pending:
    try:
        return _pending.pop(dest.data_ptr())
    except KeyError:
        raise RuntimeError(
            "fxoffload.wait: no transfer is pending for this tensor; every wait must follow the "
            "offload or reload that produced its first argument"
        ) from None


# --------------------------------------------------------------------------------------------------
# The CPU copy engine: what a GPU's copy engines do, on threads, with races made visible
# --------------------------------------------------------------------------------------------------

D2H, H2D = "d2h", "h2d"


@dataclasses.dataclass
class CopyEngineStats:
    """What the CPU copy engine did since the last ``reset_copy_stats()`` (per direction)."""

    copies: dict[str, int]
    bytes: dict[str, int]
    wait_seconds: dict[str, float]  # time the compute thread spent blocked in ``wait`` on a copy
    copy_seconds: dict[str, float]  # link time of the copies waited on: from their start on the link to done


class _CopyJob:
    """One copy on a copy thread: ``src`` into a private staging buffer, published into ``dest`` at
    the wait.

    ``dest`` holds a poison value (NaN, or the type's smallest value for integers) from issue until
    the wait, on purpose: a read that is not ordered after the wait sees poison every time, not only
    when a thread happens to be slow. The job holds the source only while it copies; the wait checks
    that the graph kept it alive until then (a GPU would otherwise reuse its memory mid-copy).
    """

    __slots__ = ("direction", "src", "src_ptr", "src_ref", "staging", "nbytes", "bandwidth", "done", "error",
                 "seconds", "claim", "start", "ready_at", "copied_at")  # fmt: skip

    def __init__(self, direction: str, src: torch.Tensor, staging: torch.Tensor, bandwidth: float) -> None:
        self.direction = direction
        self.src: torch.Tensor | None = src
        self.src_ptr = src.untyped_storage().data_ptr()
        self.src_ref = storage_weak_ref(src.untyped_storage())
        self.staging = staging
        self.nbytes = _span_nbytes(src)
        self.bandwidth = bandwidth
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.claim = threading.Lock()  # taken by whichever thread copies the bytes: the copy thread or the wait
        # The link's clock (perf_counter seconds), set at submit: when the copy starts on the link and
        # when the link is done with it; ``copied_at`` is when its bytes were really copied.
        self.start = self.ready_at = self.copied_at = 0.0


class CopyEngine:
    """Two copy threads (device-to-host and host-to-device), each a FIFO link like a copy engine.

    With ``bandwidth`` > 0 (bytes/s) a copy takes at least ``nbytes / bandwidth`` seconds from when
    the link is free: the link's speed is chosen, so overlap is measured with a known link.

    The link keeps its own clock, as a DMA engine would: a copy starts when it is issued or when the
    copy before it ends, and is done ``nbytes / bandwidth`` later (or once its bytes are copied, if
    that is later). The thread only copies the bytes, and a wait that finds them not yet taken copies
    them itself; the wait then holds the compute thread until the link is done. Copy threads that
    slept through the link time, and a wait that waited for a copy thread to be scheduled, put the
    operating system's scheduling on the critical path: on two busy cores that was milliseconds a
    copy, time the link model (and a GPU's copy engine) does not have (docs/results.md, "Overlap").
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[_CopyJob]] = {}
        self._link_free = {D2H: 0.0, H2D: 0.0}  # when each direction's link finishes its queued copies
        self._stats = self._zero()

    @staticmethod
    def _zero() -> CopyEngineStats:
        return CopyEngineStats({D2H: 0, H2D: 0}, {D2H: 0, H2D: 0}, {D2H: 0.0, H2D: 0.0}, {D2H: 0.0, H2D: 0.0})

    def submit(self, job: _CopyJob) -> None:
        with self._lock:
            q = self._queues.get(job.direction)
            if q is None:
                q = self._queues[job.direction] = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(q,), name=f"fxoffload-{job.direction}", daemon=True).start()
            self._stats.copies[job.direction] += 1
            self._stats.bytes[job.direction] += job.nbytes
            job.start = max(time.perf_counter(), self._link_free[job.direction])
            job.ready_at = job.start + (job.nbytes / job.bandwidth if job.bandwidth > 0 else 0.0)
            self._link_free[job.direction] = job.ready_at
        q.put(job)

    def _run(self, q: queue.SimpleQueue[_CopyJob]) -> None:
        while True:
            job = q.get()
            if job.claim.acquire(blocking=False):  # else its wait copied it already
                self._copy(job)
            del job  # the wait holds the job from here on; a finished one must not outlive it

    @staticmethod
    def _copy(job: _CopyJob) -> None:
        try:
            with torch.no_grad():
                _span(job.staging).copy_(_span(job.src))  # type: ignore[arg-type]
        except BaseException as e:  # reported at the wait, on the compute thread
            job.error = e
        job.src = None  # from here on only the graph keeps the source alive
        job.copied_at = time.perf_counter()
        job.done.set()

    def wait(self, job: _CopyJob) -> None:
        t0 = time.perf_counter()
        if job.claim.acquire(blocking=False):  # its copy thread has not got to it yet
            self._copy(job)
        job.done.wait()
        ready = max(job.ready_at, job.copied_at)
        delay = ready - time.perf_counter()
        if delay > 0:  # the link is still busy with it
            time.sleep(delay)
        # The link's time: a throttled copy whose bytes were copied late (no one waited) took no longer.
        job.seconds = (job.ready_at if job.bandwidth > 0 else job.copied_at) - job.start
        waited = time.perf_counter() - t0
        with self._lock:
            self._stats.wait_seconds[job.direction] += waited
            self._stats.copy_seconds[job.direction] += job.seconds

    def stats(self) -> CopyEngineStats:
        with self._lock:
            return copy.deepcopy(self._stats)

    def reset(self) -> None:
        with self._lock:
            self._stats = self._zero()


COPY_ENGINE = CopyEngine()


def copy_stats() -> CopyEngineStats:
    """Copies, bytes and blocked time of the CPU copy engine (``offload_cpu=True``) since the last reset."""
    return COPY_ENGINE.stats()


def reset_copy_stats() -> None:
    COPY_ENGINE.reset()


def _poison(t: torch.Tensor) -> None:
    """Fill every byte ``t`` addresses with a value no correct computation would read back."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        value: float | int | bool = float("nan")
    elif t.dtype is torch.bool:
        value = True
    else:
        value = torch.iinfo(t.dtype).min
    with torch.no_grad():
        _span(t).fill_(value)


# Where copy threads write before a wait publishes the bytes: host memory of the engine's own, apart
# from the pool of offloaded tensors so that pool's figures stay what a GPU run would show.
STAGING_POOL = HostBufferPool()


def _cpu_copy(direction: str, src: torch.Tensor, dest: torch.Tensor, device: torch.device, bandwidth: float) -> None:
    staging = _layout_like(STAGING_POOL.acquire(_span_nbytes(src), pin=False).untyped_storage(), src)
    _poison(dest)
    job = _CopyJob(direction, src, staging, bandwidth)
    COPY_ENGINE.submit(job)
    _register(dest, _Pending(None, device, job))


def _finish_cpu_copy(job: _CopyJob, dest: torch.Tensor, keepalive: torch.Tensor) -> None:
    COPY_ENGINE.wait(job)
    if job.error is not None:
        raise RuntimeError(f"fxoffload: a {job.direction} copy failed: {job.error}") from job.error
    if storage_expired(job.src_ref):
        free_storage_weak_ref(job.src_ref)
        raise RuntimeError(
            f"fxoffload.wait: the source of a {job.direction} copy was released before the copy was waited on; "
            "on a GPU its memory could be reused while the transfer still reads it (the wait must keep the "
            "source alive)"
        )
    if keepalive.untyped_storage().data_ptr() != job.src_ptr:
        raise RuntimeError(
            f"fxoffload.wait: the buffer this wait keeps alive is not the one its {job.direction} copy reads "
            "(a copy of it was passed to one of the two ops); the source can be freed mid-copy"
        )
    with torch.no_grad():
        _span(dest).copy_(_span(job.staging))  # the real bytes appear when the copy is waited on
    job.staging = None  # back to the staging pool
    free_storage_weak_ref(job.src_ref)


# --------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------

_lib = torch.library.Library(_LIB_NAME, "DEF")
# flexible_layout: Inductor passes the buffers as they are. The default for custom ops
# (needs_exact_strides) made it copy a padded CUDA buffer into a fresh one for each op, so the copy
# and its wait saw different buffers and the one being copied was freed before the wait.
_TAGS = (torch.Tag.flexible_layout,)
_lib.define("offload(Tensor src, Tensor[] after, float bandwidth=0.) -> Tensor", tags=_TAGS)
_lib.define("reload(Tensor host, Device device, Tensor[] after, float bandwidth=0.) -> Tensor", tags=_TAGS)
_lib.define("wait(Tensor(a) dest, Tensor keepalive, Tensor[] after) -> Tensor(a)", tags=_TAGS)
_lib.define("order(Tensor(a) x, Tensor[] after) -> Tensor(a)", tags=_TAGS)


def _offload_impl(src: torch.Tensor, after: Sequence[torch.Tensor], bandwidth: float = 0.0) -> torch.Tensor:
    # The host buffer gets the source's size and stride; the span between its first and last element
    # is copied as one run of bytes, so reload restores the very layout, padding included.
    claim = HOST_POOL.acquire(_span_nbytes(src), pin=src.device.type != "cpu", device=src.device)
    host = _layout_like(claim.untyped_storage(), src)  # the first bytes of a buffer maybe larger
    _track(src)
    if src.device.type == "cpu":
        _cpu_copy(D2H, src, host, src.device, bandwidth)
        return host
    compute = torch.accelerator.current_stream(src.device)
    transfer = _transfer_stream(src.device)
    transfer.wait_stream(compute)  # the producer has been issued
    event = torch.Event(device=src.device)
    with transfer:  # restores the previous stream and current device on exit
        _span(host).copy_(_span(src), non_blocking=True)  # pinned pool buffer, or pageable: then the copy syncs
        transfer.record_event(event)
    _register(host, _Pending(event, src.device))
    return host


def _reload_impl(
    host: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor], bandwidth: float = 0.0
) -> torch.Tensor:
    if host.data_ptr() in _pending:
        raise RuntimeError(
            "fxoffload.reload: the host buffer it reads is still being written by its offload (the offload "
            "was not waited on); the reload would copy unwritten bytes"
        )
    # Allocated on the compute stream (the current one), so the caching allocator ties the block to
    # the stream that uses it; the copy itself runs on the transfer stream.
    dest = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)
    if device.type == "cpu":
        _cpu_copy(H2D, host, dest, device, bandwidth)
        return dest
    compute = torch.accelerator.current_stream(device)
    transfer = _transfer_stream(device)
    transfer.wait_stream(compute)  # the allocation of dest is ordered before the copy into it
    event = torch.Event(device=device)
    with transfer:
        _span(dest).copy_(_span(host), non_blocking=True)
        transfer.record_event(event)
    _register(dest, _Pending(event, device))
    return dest


def _wait_impl(
    dest: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    pending = _pop(dest)
    if pending.job is not None:
        _finish_cpu_copy(pending.job, dest, keepalive)
    elif pending.event is not None:
        torch.accelerator.current_stream(pending.device).wait_event(pending.event)
    # ``keepalive`` ends here: its storage may be freed and reused from now on, which is safe
    # because every later kernel on the compute stream is ordered after the copy.
    return dest


def _order_impl(x: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return x  # its users now come after ``after``: the data edge is the whole point


def _offload_fake(src: torch.Tensor, after: Sequence[torch.Tensor], bandwidth: float = 0.0) -> torch.Tensor:
    return torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device="cpu")


def _reload_fake(
    host: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor], bandwidth: float = 0.0
) -> torch.Tensor:
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


def _wait_fake(
    dest: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    return dest


def _order_fake(x: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return x


for _name, _impl, _fake in (
    ("offload", _offload_impl, _offload_fake),
    ("reload", _reload_impl, _reload_fake),
    ("wait", _wait_impl, _wait_fake),
    ("order", _order_impl, _order_fake),
):
    # One implementation for every device: the arguments mix host and device tensors.
    torch.library.impl(f"{_LIB_NAME}::{_name}", "CompositeExplicitAutograd", lib=_lib)(_impl)
    torch.library.register_fake(f"{_LIB_NAME}::{_name}", lib=_lib)(_fake)

_FAKES = {"offload": _offload_fake, "reload": _reload_fake, "wait": _wait_fake, "order": _order_fake}


def fake_impl(op: torch._ops.OpOverload):
    """The fake (meta) function of one of our ops, to build ``meta["val"]`` without dispatching."""
    return _FAKES[op._opname]


offload = torch.ops.fxoffload.offload.default
reload = torch.ops.fxoffload.reload.default
wait = torch.ops.fxoffload.wait.default
order = torch.ops.fxoffload.order.default

# The copies have effects the graph does not see (a registered event); never dead-code eliminate them.
for _op in (offload, reload, wait, order):
    torch.fx.node.has_side_effect(_op)

TRANSFER_OPS = frozenset({offload, reload, wait, order})
