"""Eager streamed activation offloading with saved-tensor hooks and one side stream.

THIS IS NOT FXOFFLOAD. It is a small implementation, written for this harness, of the technique
behind torchtune's ``OffloadActivations`` and TRL's ``get_act_offloading_ctx_manager`` (what a user
of eager PyTorch would pick). The harness uses TRL's when ``trl`` is importable and this one
otherwise, and labels the row with which one ran.

    offloader = StreamedOffload(model, min_bytes=1 << 20)
    with offloader:                 # forward: pack hook copies each large saved tensor to the host
        loss = model(*batch)
    loss.backward()                 # backward: unpack hook brings it back, prefetching the next one
    offloader.after_backward()      # the compute stream waits on the copies still in flight

On CUDA, pack issues the device-to-host copy into a pinned buffer on the side stream, after the
side stream waits on the compute stream; the device tensor stays referenced until its copy's event
has completed (checked at every pack, and at the end of the forward, where the compute stream waits
on the rest). Unpack allocates the destination on the compute stream, copies on the side stream,
and makes the compute stream wait on the copy's event before the tensor is used; it then prefetches
the tensor packed just before (the backward runs roughly in reverse). Pinned buffers are pooled by
(shape, stride, dtype) and reused once the copy out of them has completed.

On a CPU there is no stream: the copies are synchronous ``copy_`` calls on the compute thread (the
harness says so in the row), which gives the data flow's cost, not a memory saving.

Kept on the device: parameters and buffers (and views of them), tensors under ``min_bytes``, tensors
of another device, and tensors whose strides ``empty_like`` cannot reproduce (overlapping ones, e.g.
expanded views). A tensor saved twice in one forward is offloaded once.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn


class _Offloaded:
    """One offloaded tensor: its host copy and, between a reload and its last unpack, the device copy."""

    __slots__ = ("index", "host", "device", "uses", "reloaded", "event", "__weakref__")

    def __init__(self, index: int, host: torch.Tensor, device: torch.device) -> None:
        self.index = index
        self.host = host
        self.device = device
        self.uses = 1  # pack calls not yet matched by an unpack
        self.reloaded: torch.Tensor | None = None
        self.event = None  # the reload's completion event (CUDA)


class StreamedOffload:
    """Context manager around the forward; see the module docstring. Not thread-safe."""

    def __init__(self, model: nn.Module, min_bytes: int = 1 << 20, prefetch: bool = True) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self._weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        devices = {t.device for t in (*model.parameters(), *model.buffers())}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self.synchronous = self.device.type != "cuda"
        self.mode = (
            "synchronous copies on the CPU (no stream)" if self.synchronous else "side stream, pinned pool"
        )
        self._stream = None if self.synchronous else torch.cuda.Stream(self.device)
        self._pool: dict[tuple, list[tuple[torch.Tensor, object]]] = {}
        self._packed: list[_Offloaded] = []  # this step's offloaded tensors, in pack order
        self._by_tensor: dict[tuple, tuple[weakref.ref, _Offloaded]] = {}
        self._d2h_pending: list[tuple[object, torch.Tensor]] = []  # (event, device tensor) copies in flight
        self._hooks = None
        self.offloaded_bytes = 0  # bytes copied to the host in the last forward

    # -- the hooks -------------------------------------------------------------------------------
    def __enter__(self) -> StreamedOffload:
        self.after_backward()
        self._packed, self._by_tensor, self.offloaded_bytes = [], {}, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._by_tensor = {}
        if not self.synchronous:  # forward done: the compute stream waits on the copies still in flight
            current = torch.cuda.current_stream(self.device)
            for event, _ in self._d2h_pending:
                current.wait_event(event)
        self._d2h_pending = []

    def after_backward(self) -> None:
        """Make the compute stream wait on reloads still in flight (prefetched but never unpacked)
        and drop them: after this their memory can be reused safely."""
        if not self.synchronous:
            current = torch.cuda.current_stream(self.device)
            for obj in self._packed:
                if obj.event is not None:
                    current.wait_event(obj.event)
        for obj in self._packed:
            obj.reloaded = obj.event = None
        self._packed = []

    def _eligible(self, t: torch.Tensor) -> bool:
        return (
            t.device == self.device
            and t.untyped_storage().nbytes() > 0
            and t.numel() * t.element_size() >= self.min_bytes
            and t.untyped_storage().data_ptr() not in self._weights
        )

    def _pack(self, t: torch.Tensor):
        if not self._eligible(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        hit = self._by_tensor.get(key)
        if hit is not None and hit[0]() is t:
            hit[1].uses += 1
            return hit[1]
        host = self._host_buffer(t)
        if host is None:
            return t
        if self.synchronous:
            host.copy_(t)
        else:
            self._retire_finished_copies()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._d2h_pending.append((event, t))
        obj = _Offloaded(len(self._packed), host, t.device)
        self._packed.append(obj)
        self._by_tensor[key] = (weakref.ref(t), obj)
        self.offloaded_bytes += host.numel() * host.element_size()
        return obj

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        obj = packed
        if obj.reloaded is None:
            self._reload(obj)
        if obj.event is not None:
            torch.cuda.current_stream(self.device).wait_event(obj.event)
        out = obj.reloaded
        obj.uses -= 1
        if obj.uses == 0:  # no further unpack: give the host buffer back, keep nothing
            self._release_host(obj)
            obj.reloaded = None
        if self.prefetch and obj.index > 0:
            previous = self._packed[obj.index - 1]
            if previous.reloaded is None and previous.uses > 0:
                self._reload(previous)
        return out

    # -- copies and the pinned pool -------------------------------------------------------------
    def _reload(self, obj: _Offloaded) -> None:
        dest = torch.empty_like(obj.host, device=obj.device)  # allocated on the compute stream
        if self.synchronous:
            dest.copy_(obj.host)
            obj.reloaded = dest
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # dest's memory is free by now
        with torch.cuda.stream(self._stream):
            dest.copy_(obj.host, non_blocking=True)
            obj.event = torch.cuda.Event()
            obj.event.record(self._stream)
        obj.reloaded = dest

    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor | None:
        key = (tuple(t.shape), t.stride(), t.dtype)
        bucket = self._pool.get(key, [])
        for i, (buf, event) in enumerate(bucket):
            if event is None or event.query():
                del bucket[i]
                return buf
        buf = torch.empty_like(t, device="cpu", pin_memory=not self.synchronous)
        return buf if buf.stride() == t.stride() else None

    def _release_host(self, obj: _Offloaded) -> None:
        key = (tuple(obj.host.shape), obj.host.stride(), obj.host.dtype)
        self._pool.setdefault(key, []).append((obj.host, obj.event))

    def _retire_finished_copies(self) -> None:
        self._d2h_pending = [(e, t) for e, t in self._d2h_pending if not e.query()]

    def host_pool_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bucket in self._pool.values() for b, _ in bucket)


def trl_context(model: nn.Module):
    """TRL's ``get_act_offloading_ctx_manager(model)`` when ``trl`` is importable, else ``None``."""
    try:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except ImportError:
        return None
    return get_act_offloading_ctx_manager(model)
