"""The CPU copy engine: what a GPU's copy engines do, on two threads, with races made visible.

On a machine without an accelerator (``offload_cpu=True``) the transfer ops copy CPU tensors into
separate host buffers on these threads, concurrently with compute, and release the source storage
exactly as on a GPU. A destination holds poison until its wait, so a read the graph did not order
after the wait sees NaN every time, not only when a thread happens to be slow.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import queue
import statistics
import threading
import time

import torch

from .._compat import free_storage_weak_ref, storage_expired, storage_weak_ref
from ..sizes import span_bytes, span_elements
from .host_pool import STAGING_POOL

__all__ = ["COPY_ENGINE", "CopyEngine", "CopyEngineStats", "copy_stats", "reset_copy_stats"]

D2H, H2D = "d2h", "h2d"


def span(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage bytes ``t`` addresses (one contiguous run: a plain memcpy). A
    transfer copies the whole strided span of its tensor: Inductor may hand the ops a padded buffer,
    and copying the span keeps the very buffer the graph computed, with its layout."""
    if t.is_contiguous():  # the common case, a quarter of the host time
        return t.view(-1)
    return t.as_strided((span_elements(t.shape, t.stride()),), (1,), t.storage_offset())


def copy_span(dest: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``span(dest) <- span(src)``: the bytes ``src`` addresses into ``dest`` of the same layout (two
    dense tensors copy as they are: no views made). Where the layouts differ, element by element: a
    switched-off offload's copy on the device, and the CPU engine's wait publishing a restrided host
    copy (an accelerator's transfer restrides on the device first, ``transfers._restrided``)."""
    if (dest.is_contiguous() and src.is_contiguous()) or dest.stride() != src.stride():
        dest.copy_(src, non_blocking=non_blocking)
    else:
        span(dest).copy_(span(src), non_blocking=non_blocking)


def memcpy_span(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``copy_span`` as one C ``memcpy`` (``ctypes.memmove``, which releases the GIL): for the copy
    threads. A torch copy there starts an OpenMP team of the thread's own; with the compute thread's
    team on the same cores libgomp counts more threads than cores and cuts its spin-waits short, and
    every parallel kernel after that wakes its workers the slow way: on 2 cores, Inductor's steps
    ran 1.5-1.7x slower for the rest of the process once a copy thread had copied (docs/results.md).
    ``dest`` has ``src``'s layout (a staging buffer, or the destination the job was made for)."""
    nbytes = span_nbytes(src)
    if nbytes:
        ctypes.memmove(span(dest).data_ptr(), span(src).data_ptr(), nbytes)


def span_nbytes(t: torch.Tensor) -> int:
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return span_bytes(t.shape, t.stride(), t.dtype)


@dataclasses.dataclass
class CopyEngineStats:
    """What the CPU copy engine did since the last ``reset_copy_stats()`` (per direction)."""

    copies: dict[str, int]
    bytes: dict[str, int]
    wait_seconds: dict[str, float]  # time the compute thread spent blocked in ``wait`` on a copy
    copy_seconds: dict[str, float]  # link time of the copies waited on: from their start on the link to done


class CopyJob:
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
        self.nbytes = span_nbytes(src)
        self.bandwidth = bandwidth
        self.done = _Done()
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.claim = threading.Lock()  # taken by whichever thread copies the bytes: the copy thread or the wait
        # The link's clock (perf_counter seconds), set at submit: when the copy starts on the link and
        # when the link is done with it; ``copied_at`` is when its bytes were really copied (by a copy
        # thread, or by the wait).
        self.start = self.ready_at = self.copied_at = 0.0


class _Done:
    """Set once, waited on by one thread: a ``threading.Event`` at an eighth of its host time (a lock
    held from the start, released when set)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set (at once if it was); False after ``timeout`` seconds without (None: no limit)."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._lock.release()
        return True


class CopyEngine:
    """Two copy threads (device-to-host and host-to-device), each a FIFO link like a copy engine.

    With ``bandwidth`` > 0 (bytes/s) a copy takes ``nbytes / bandwidth`` seconds from when the link
    is free: the link's speed is chosen, so overlap is measured with a known link. Without one, the
    link runs at this machine's memcpy speed (``memcpy_rate``, measured once).

    The link keeps its own clock, as a DMA engine would: a copy starts when it is issued or when the
    copy before it ends, and is done ``nbytes / bandwidth`` later. The thread only copies the bytes,
    and a wait that finds them not yet taken copies them itself; the wait then holds the compute
    thread until the link is done. That clock, not the threads, says when a copy is done and what
    its wait stalls: copy threads that slept through the link time, and a wait that waited for a copy
    thread to be scheduled, put the operating system's scheduling on the critical path (on two busy
    cores, milliseconds a copy: docs/results.md, "Overlap"), and the threads need the GIL to copy,
    which Inductor's C++ kernels on a CPU hold while they run. A device's copy engine has neither:
    the bytes a thread did not get to are copied in the wait, at the emulation's cost, not the link's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[CopyJob]] = {}
        self._link_free = {D2H: 0.0, H2D: 0.0}  # when each direction's link finishes its queued copies
        self._stats = self._zero()

    @staticmethod
    def _zero() -> CopyEngineStats:
        return CopyEngineStats({D2H: 0, H2D: 0}, {D2H: 0, H2D: 0}, {D2H: 0.0, H2D: 0.0}, {D2H: 0.0, H2D: 0.0})

    def submit(self, job: CopyJob) -> None:
        rate = job.bandwidth if job.bandwidth > 0 else memcpy_rate()  # measured once, outside the lock
        with self._lock:
            q = self._queues.get(job.direction)
            if q is None:
                q = self._queues[job.direction] = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(q,), name=f"fxoffload-{job.direction}", daemon=True).start()
            self._stats.copies[job.direction] += 1
            self._stats.bytes[job.direction] += job.nbytes
            job.start = max(time.perf_counter(), self._link_free[job.direction])
            job.seconds = job.nbytes / rate  # the link's time, kept as it is (not a difference of clocks)
            job.ready_at = job.start + job.seconds
            self._link_free[job.direction] = job.ready_at
        q.put(job)

    def _run(self, q: queue.SimpleQueue[CopyJob]) -> None:
        while True:
            job = q.get()
            if job.claim.acquire(blocking=False):  # else its wait copied it already
                self._copy(job)
            del job  # the wait holds the job from here on; a finished one must not outlive it

    @staticmethod
    def _copy(job: CopyJob) -> None:
        try:
            memcpy_span(job.staging, job.src)  # type: ignore[arg-type]
        except BaseException as e:  # reported at the wait, on the compute thread
            job.error = e
        job.src = None  # from here on only the graph keeps the source alive
        job.copied_at = time.perf_counter()
        job.done.set()

    def wait(self, job: CopyJob) -> None:
        t0 = time.perf_counter()
        if job.claim.acquire(blocking=False):  # its copy thread has not got to it yet
            self._copy(job)
        job.done.wait()
        delay = job.ready_at - time.perf_counter()
        if delay > _SPIN_S:  # the link is still busy with it
            time.sleep(delay)
        while time.perf_counter() < job.ready_at:  # a sleep this short would take ~0.1 ms: spin
            pass
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


# A link delay shorter than this is waited out on the clock: ``time.sleep`` of a few microseconds
# took 0.1-0.2 ms on the development machine.
_SPIN_S = 2e-4


@functools.cache
def memcpy_rate() -> float:
    """Bytes/s of a host-to-host copy larger than the caches (the median of five 48 MiB copies, on
    the CPU whatever the default device): the link's speed where none is set. Measured once per
    process, on the first copy of an unthrottled link."""
    src = torch.ones(12 << 20, device="cpu")
    dst = torch.empty(12 << 20, device="cpu")
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return src.nbytes / max(statistics.median(seconds), 1e-9)


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
        (t if t.is_contiguous() else span(t)).fill_(value)


def start_cpu_copy(direction: str, src: torch.Tensor, dest: torch.Tensor, bandwidth: float) -> CopyJob:
    """Poison ``dest`` and queue the copy of ``src``'s bytes on the ``direction`` thread; the
    caller's wait publishes them (``finish_cpu_copy``)."""
    staging = STAGING_POOL.acquire(span_nbytes(src), pin=False, like=src)
    _poison(dest)
    job = CopyJob(direction, src, staging, bandwidth)
    COPY_ENGINE.submit(job)
    return job


def finish_cpu_copy(job: CopyJob, dest: torch.Tensor, keepalive: torch.Tensor, name: str = "") -> None:
    """The copy ``job`` done, its bytes in ``dest``; raises where the graph broke an ordering rule
    (the copy of ``name``, ``ir.transfer_name``: "<graph id>:<saved tensor>")."""
    COPY_ENGINE.wait(job)
    which = f" ({name})" if name else ""
    if job.error is not None:
        raise RuntimeError(f"fxoffload: a {job.direction} copy failed: {job.error}") from job.error
    if storage_expired(job.src_ref):
        free_storage_weak_ref(job.src_ref)
        raise RuntimeError(
            f"fxoffload.wait: the source of a {job.direction} copy{which} was released before the copy was waited on; "
            "on a GPU its memory could be reused while the transfer still reads it (the wait must keep the "
            "source alive)"
        )
    if keepalive.untyped_storage().data_ptr() != job.src_ptr:
        raise RuntimeError(
            f"fxoffload.wait: the buffer this wait keeps alive is not the one its {job.direction} copy{which} reads "
            "(a copy of it was passed to one of the two ops); the source can be freed mid-copy"
        )
    with torch.no_grad():
        copy_span(dest, job.staging)  # the real bytes appear when the copy is waited on
    job.staging = None  # back to the staging pool
    free_storage_weak_ref(job.src_ref)


