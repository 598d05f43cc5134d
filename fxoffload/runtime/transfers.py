"""What the transfer ops do on real tensors: the only code that touches streams, events and host buffers.

The ops and the pattern they form in a graph are defined in ``fxoffload.ir``; this module registers
their implementations and imports nothing of the pass. ``record_stream`` is never used: a storage a
transfer reads or writes is kept alive by the graph (the wait's ``keepalive`` argument) until the
compute stream has waited on the transfer's event.

Where a tensor really lives is read here, when the copy runs, never from the traced (fake) value:
a few ops return tensors on another device than their fake function says (the philox seed and
offset of ``_scaled_dot_product_efficient_attention`` are CPU scalars at run time and cuda under
fake tensors, pytorch#121528). An offload remembers the device its source was on, and the reload
of that host copy returns it there, whatever device the graph was traced with: a tensor that lives
on the host at run time is never copied onto the accelerator for a kernel that reads it on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from .._compat import storage_expired, storage_weak_ref
from ..ir import LIBRARY, host_stride
from .copy_engine import D2H, H2D, CopyJob, copy_span, finish_cpu_copy, span_nbytes, start_cpu_copy
from .host_pool import HOST_POOL, keep_on_device, kept_on_device
from .timing import Stamps, now, recording, wanted

log = logging.getLogger(__name__)

__all__ = ["copies_switched_off", "switch_copies_off", "switch_copies_on", "track_releases", "wait_on_host"]

_transfer_streams: dict[torch.device, torch.Stream] = {}


def _transfer_stream(device: torch.device) -> torch.Stream:
    stream = _transfer_streams.get(device)
    if stream is None:
        stream = _transfer_streams[device] = torch.Stream(device=device)
    return stream


@dataclasses.dataclass
class _Pending:
    event: torch.Event | None  # a device copy: the event recorded after it on the transfer stream
    device: torch.device  # the device whose compute stream must wait
    job: CopyJob | None = None  # a CPU copy: the copy engine's job
    stamps: Stamps | None = None  # its times, while a recording wants them (``timing``)
    name: str = ""  # the transfer's name (``ir.transfer_name``)


# Keyed by the data pointer of a transfer's destination: unique while that destination is alive,
# and the destination is alive until its ``wait`` because ``wait`` takes it as an argument.
_pending: dict[int, _Pending] = {}

# The device each host copy's source lived on at run time, by the host buffer's data pointer (set
# by the offload, read by the reload). Bounded by the host pool: its buffers are reused every step.
_origin: dict[int, torch.device] = {}

# Copies switched off at run time (``switch_copies_off``), by transfer name: their offload keeps the source
# on its device, in a copy of its own held by the host handle it returns; their reload gives that
# copy back. No transfer, no stream, no copy engine: what the code does without offloading, plus one
# copy on the device, since the compiled code reuses the source's memory after the wait.
_off: set[str] = set()

# Offloads whose host copy code on the host reads after their wait, by transfer name (``wait_on_host``):
# their wait makes the host wait for the copy as well as the compute stream.
_host_reads: set[str] = set()

# Opt-in record of released source storages, read by tests to prove the release really happened.
_release_log: list[tuple[int, object]] | None = None


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


def switch_copies_off(names: Sequence[str]) -> None:
    """Switch the copies of these transfer names (``ir.transfer_name``) off from their next offload:
    the tensor stays on its device (a copy of it, held by the host tensor its offload returns), with
    no transfer. Their reloads of host copies made before still copy them back."""
    _off.update(names)


def switch_copies_on(prefix: str) -> None:
    """Switch every copy whose transfer name starts with ``prefix`` (one graph's) back on."""
    _off.difference_update([n for n in _off if n.startswith(prefix)])


def wait_on_host(prefix: str, names: Sequence[str]) -> None:
    """The waits of these transfers (``ir.transfer_name``), of the graph whose transfer names start
    with ``prefix``, make the host wait for the copy too, not only the compute stream: code on the
    host reads their host copies next (Inductor's forward copying one into another layout,
    ``output_code.read_offloads``), which a wait that orders the device alone leaves racing the copy.
    They replace what an earlier compile of that graph said: a copy its new code no longer reads
    overlaps again."""
    _host_reads.difference_update([n for n in _host_reads if n.startswith(prefix)])
    _host_reads.update(names)


def copy_finished(dest: torch.Tensor) -> None:
    """Block until the copy pending for ``dest`` is done (its link's time included), without its wait,
    which stays pending: what a probe of the calls' own time (``measure.op_time``) calls before it
    times a wait, so that the wait it times does not stall, nor copy the bytes itself."""
    pending = _pending.get(dest.data_ptr())
    if pending is None:
        return
    if pending.event is not None:
        pending.event.synchronize()
    elif pending.job is not None:
        pending.job.done.wait()
        delay = pending.job.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def copies_switched_off(prefix: str = "") -> frozenset[str]:
    return frozenset(n for n in _off if n.startswith(prefix))


def _kept_copy(src: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """A switched-off offload: the host handle of a copy of ``src`` on its own device, in the layout
    ``stride`` (the compute stream's order: after ``src`` is made, before its memory is reused)."""
    kept = torch.empty_strided(src.size(), stride, dtype=src.dtype, device=src.device)
    with torch.no_grad():
        copy_span(kept, src)
    host = keep_on_device(kept)
    _register(host, _Pending(None, src.device))
    return host


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


def _device_copy(
    src: torch.Tensor, dest: torch.Tensor, device: torch.device, stamps: Stamps | None, name: str
) -> None:
    """``dest <- src`` on ``device``'s transfer stream, after what the compute stream has issued."""
    compute = torch.accelerator.current_stream(device)
    transfer = _transfer_stream(device)
    transfer.wait_stream(compute)  # the producer of src (or the allocation of dest) has been issued
    event = torch.Event(device=device)
    with transfer:  # restores the previous stream and current device on exit
        if dest.stride() != src.stride():  # an offload restriding its source (``ir.host_stride``)
            src = _restrided(src, dest.stride())
        if stamps is not None:  # the copy alone: its bytes over this time are the link's rate
            stamps.around_copy(transfer, start=True)
        copy_span(dest, src, non_blocking=True)  # pinned pool buffer, or pageable: then it syncs
        transfer.record_event(event)
        if stamps is not None:
            stamps.around_copy(transfer, start=False)
    _register(dest, _Pending(event, device, stamps=stamps, name=name))


def _restrided(src: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """``src`` in the layout ``stride``, copied on its own device and the current (transfer) stream,
    so that the copy to the host is one run of bytes into pinned memory. (Torch's own copy to a host
    buffer of another layout stages through pageable memory where that layout is not contiguous,
    which blocks the host until the transfer stream gets there.) The block goes back to the caching
    allocator for the transfer stream, whose later work is ordered after this copy."""
    staged = torch.empty_strided(src.size(), stride, dtype=src.dtype, device=src.device)
    staged.copy_(src)
    return staged


def _offload_impl(
    src: torch.Tensor, after: Sequence[torch.Tensor], bandwidth: float = 0.0, name: str = "",
    stride: Sequence[int] | None = None,
) -> torch.Tensor:
    # The host copy's layout: the one the forward returns it in (``stride``, ``rewrite.host_layout``).
    # Where the source has it, maybe padded (the common case), the span between its first and last
    # element is copied as one run of bytes, padding included; where the compiler laid the source out
    # otherwise (channels-last), the copy restrides it (``copy_span``).
    layout = host_stride(src.size(), src.stride(), stride)
    if name in _off:
        return _kept_copy(src, layout)
    entered = now(src.device) if recording() and wanted(name, D2H) else None
    same = layout == src.stride()
    like = src if same else torch.empty_strided(src.size(), layout, dtype=src.dtype, device="meta")
    # The first bytes of a pool buffer, maybe a larger one, in that layout.
    host = HOST_POOL.acquire(span_nbytes(like), pin=src.device.type != "cpu", device=src.device, like=like)
    _origin[host.data_ptr()] = src.device
    if _release_log is not None:
        _release_log.append((id(src), storage_weak_ref(src.untyped_storage())))
    stamps = Stamps.at_issue(name, D2H, span_nbytes(src), src.device, entered) if entered is not None else None
    if src.device.type == "cpu":
        _register(host, _Pending(None, src.device, start_cpu_copy(D2H, src, host, bandwidth), stamps, name))
        if stamps is not None:
            stamps.issued_on_cpu()
    else:
        _device_copy(src, host, src.device, stamps, name)
    if stamps is not None:
        stamps.issued()
    return host


def _reload_impl(
    host: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor], bandwidth: float = 0.0, name: str = ""
) -> torch.Tensor:
    if host.data_ptr() in _pending:
        raise RuntimeError(
            "fxoffload.reload: the host buffer it reads is still being written by its offload (the offload "
            "was not waited on); the reload would copy unwritten bytes"
        )
    kept = kept_on_device(host)
    if kept is not None:  # its offload was switched off: the copy on the device, every time it is asked
        _register(kept, _Pending(None, kept.device))  # (a second backward: retain_graph)
        return kept
    # Back where the source lived when it was offloaded; ``device`` (the traced one) only for a host
    # tensor this process did not offload.
    origin = _origin.get(host.data_ptr(), device)
    entered = now(origin) if recording() and wanted(name, H2D) else None
    if origin != device:
        log.debug("fxoffload: a tensor traced on %s lived on %s: reloaded there", device, origin)
    # Allocated on the compute stream (the current one), so the caching allocator ties the block to
    # the stream that uses it; the copy itself runs on the transfer stream.
    dest = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=origin)
    stamps = Stamps.at_issue(name, H2D, span_nbytes(host), origin, entered) if entered is not None else None
    if origin.type == "cpu":
        _register(dest, _Pending(None, origin, start_cpu_copy(H2D, host, dest, bandwidth), stamps, name))
        if stamps is not None:
            stamps.issued_on_cpu()
    else:
        _device_copy(host, dest, origin, stamps, name)
    if stamps is not None:
        stamps.issued()
    return dest


def _wait_impl(dest: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    pending = _pop(dest)
    stamps = pending.stamps
    if stamps is not None:
        stamps.before_wait()
    if pending.job is not None:
        finish_cpu_copy(pending.job, dest, keepalive, pending.name)
        if stamps is not None:
            stamps.link_times(pending.job.start, pending.job.seconds)
    elif pending.event is not None:
        torch.accelerator.current_stream(pending.device).wait_event(pending.event)
        if pending.name in _host_reads:  # the host reads the copy next (``wait_on_host``)
            pending.event.synchronize()
    if stamps is not None:
        stamps.after_wait()
    # ``keepalive`` ends here: its storage may be freed and reused from now on, which is safe
    # because every later kernel on the compute stream is ordered after the copy.
    return dest


def _order_impl(x: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return x  # its users now come after ``after``: the data edge is the whole point


_lib = torch.library.Library(LIBRARY, "IMPL")
for _name, _impl in (
    ("offload", _offload_impl), ("reload", _reload_impl), ("wait", _wait_impl), ("order", _order_impl),
):  # fmt: skip
    # One implementation for every device: the arguments mix host and device tensors.
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
