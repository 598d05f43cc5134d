"""The accelerator path of the transfer ops, run on a CPU: its streams and events, checked for order.

On a CPU (``offload_cpu=True``) the ops take the copy engine's path; the accelerator's path
(``runtime.transfers._device_copy`` and the event branch of ``wait``) ran only on a GPU
(``tests/test_cuda.py``, under the CUDA sanitizer). Here that very code runs on ``meta`` tensors (a
device that is not the CPU) with torch's stream and event calls replaced by recording ones; the
recorded calls are read as a happens-before graph, as a GPU orders work: program order on each
stream, ``record_event``/``wait_event`` and ``wait_stream`` edges between them. Each ordering rule is
a reachability, and each has a test that breaks it on purpose and sees the check fail:

- a copy runs after the kernel that wrote its source (the transfer stream waits on the compute
  stream before copying);
- every kernel the compute stream runs after a ``wait`` runs after the copy (the event recorded after
  the copy, waited on by the compute stream), so the source's memory may be reused there and the
  reloaded tensor read there;
- code on the host that reads a host copy after its wait (Inductor's forward copying it into the
  layout the tensor was traced with) runs after the copy: the wait of such a transfer makes the host
  wait on the event too (``transfers.wait_on_host``). The host is a stream of its own here.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fxoffload.runtime import host_pool, timing, transfers

META = torch.device("meta")


@dataclasses.dataclass(eq=False)
class _Event:
    id: int
    at: int | None = None  # the position in the log of the record it holds
    log: list | None = None

    def synchronize(self) -> None:  # the host waits for what the event records
        self.log.append(("host", "wait_event", self))

    def query(self) -> bool:  # a recording asks at a wait whether the device is behind
        return True


class _Streams:
    """Recording stand-ins for torch's stream and event calls; ``log`` holds (stream, what) in the
    order the host issued them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, object]] = []  # (stream, kind, detail)
        self.compute = _Stream(self, "compute")
        self.transfer = _Stream(self, "transfer")
        self.current = [self.compute]
        self._ids = itertools.count()

    def kernel(self, label: str) -> int:
        """A kernel the compute stream runs (a producer, a reuse of memory, a read)."""
        self.log.append((self.current[-1].name, "kernel", label))
        return len(self.log) - 1

    def event(self, device: torch.device | None = None, **_: object) -> _Event:
        return _Event(next(self._ids), log=self.log)

    def happens_before(self, a: int, b: int) -> bool:
        """Whether log entry ``a`` is ordered before ``b`` on the device (not merely issued before)."""
        preds: dict[int, set[int]] = {i: set() for i in range(len(self.log))}
        last: dict[str, int] = {}
        for i, (stream, kind, detail) in enumerate(self.log):
            if stream in last:
                preds[i].add(last[stream])  # program order on a stream
            last[stream] = i
            if kind == "wait_event" and detail.at is not None:
                preds[i].add(detail.at)
            if kind == "wait_stream" and detail in last:
                preds[i].add(last[detail])
        seen, todo = set(), [b]
        while todo:
            for p in preds[todo.pop()]:
                if p == a:
                    return True
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return False

    def copies(self) -> list[int]:
        return [i for i, (_, kind, _) in enumerate(self.log) if kind == "copy"]


class _Stream:
    def __init__(self, streams: _Streams, name: str) -> None:
        self.streams, self.name, self.device = streams, name, META

    def wait_stream(self, other: _Stream) -> None:
        self.streams.log.append((self.name, "wait_stream", other.name))

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event if event is not None else self.streams.event()
        self.streams.log.append((self.name, "record", event))
        event.at = len(self.streams.log) - 1
        return event

    def wait_event(self, event: _Event) -> None:
        self.streams.log.append((self.name, "wait_event", event))

    def __enter__(self) -> _Stream:
        self.streams.current.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.streams.current.pop()


@pytest.fixture
def streams(monkeypatch):
    s = _Streams()
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: s.current[-1])
    monkeypatch.setattr(transfers, "_transfer_stream", lambda device: s.transfer)
    monkeypatch.setattr(torch, "Event", s.event)

    def copy_span(dest, src, non_blocking=False):
        s.log.append((s.current[-1].name, "copy", (dest.device.type, src.device.type, non_blocking)))

    monkeypatch.setattr(transfers, "copy_span", copy_span)
    pool = host_pool.HostBufferPool()
    pool._pin_failed = True  # no pinned memory without an accelerator: pageable buffers, no warning
    monkeypatch.setattr(transfers, "HOST_POOL", pool)
    monkeypatch.setattr(transfers, "_host_reads", set())
    origins = set(transfers._origin)
    yield s
    transfers._pending.clear()
    for key in set(transfers._origin) - origins:  # the meta device of this test's host buffers
        del transfers._origin[key]


def _offload(streams: _Streams, src: torch.Tensor) -> tuple[int, int, int]:
    """Produce ``src``, offload it, wait, reuse its memory: the log positions of the three."""
    produced = streams.kernel("produce src")
    host = transfers._offload_impl(src, [], 0.0, "test:src")
    transfers._wait_impl(host, src, [])
    reused = streams.kernel("reuse src's memory")
    (copy,) = streams.copies()
    return produced, copy, reused


def test_an_offload_copies_after_its_producer_and_before_the_memory_is_reused(streams):
    src = torch.empty(4, 8, device=META)
    produced, copy, reused = _offload(streams, src)
    assert streams.log[copy] == ("transfer", "copy", ("cpu", "meta", True)), streams.log
    assert streams.happens_before(produced, copy), streams.log
    assert streams.happens_before(copy, reused), streams.log
    assert not streams.happens_before(reused, copy)


def test_a_reload_is_read_only_after_its_copy(streams):
    src = torch.empty(4, 8, device=META)
    host = transfers._wait_impl(transfers._offload_impl(src, [], 0.0, "test:src"), src, [])
    streams.log.clear()
    last = streams.kernel("the backward's last kernel before the reload")
    dest = transfers._reload_impl(host, META, [], 0.0, "test:src")
    assert dest.device == META and dest.shape == src.shape and dest.stride() == src.stride()
    transfers._wait_impl(dest, host, [])
    read = streams.kernel("read the reloaded tensor")
    (copy,) = streams.copies()
    assert streams.log[copy] == ("transfer", "copy", ("meta", "cpu", True)), streams.log
    assert streams.happens_before(last, copy)  # dest's memory was allocated on the compute stream before
    assert streams.happens_before(copy, read), streams.log


def test_the_check_sees_a_copy_that_does_not_wait_for_its_producer(streams, monkeypatch):
    monkeypatch.setattr(_Stream, "wait_stream", lambda self, other: None)  # broken on purpose
    produced, copy, reused = _offload(streams, torch.empty(4, 8, device=META))
    assert not streams.happens_before(produced, copy), streams.log
    assert streams.happens_before(copy, reused)  # the other rule still holds


def test_the_check_sees_memory_reused_before_the_copy_is_done(streams, monkeypatch):
    monkeypatch.setattr(_Stream, "wait_event", lambda self, event: None)  # broken on purpose
    produced, copy, reused = _offload(streams, torch.empty(4, 8, device=META))
    assert streams.happens_before(produced, copy)
    assert not streams.happens_before(copy, reused), streams.log


def test_the_check_sees_an_event_recorded_before_the_copy(streams, monkeypatch):
    """The event a wait waits on must be recorded after the copy on the transfer stream: one
    recorded before it (here: on the compute stream) orders nothing after the copy."""
    real = _Stream.record_event
    monkeypatch.setattr(_Stream, "record_event", lambda self, event=None: real(streams.compute, event))
    produced, copy, reused = _offload(streams, torch.empty(4, 8, device=META))
    assert not streams.happens_before(copy, reused), streams.log


def _read_on_host(streams: _Streams, name: str) -> tuple[int, int]:
    """Offload, wait, then read the host copy on the host: the log positions of the copy and the read."""
    src = torch.empty(4, 8, device=META)
    streams.kernel("produce src")
    transfers._wait_impl(transfers._offload_impl(src, [], 0.0, name), src, [])
    streams.log.append(("host", "kernel", "read the host copy"))
    (copy,) = streams.copies()
    return copy, len(streams.log) - 1


def test_a_host_copy_the_code_reads_on_the_host_is_read_after_its_copy(streams):
    transfers.wait_on_host("test:", ["test:read"])
    copy, read = _read_on_host(streams, "test:read")
    assert streams.happens_before(copy, read), streams.log


def test_the_check_sees_a_host_read_racing_its_copy(streams):
    """Broken on purpose: a transfer not said to be read on the host. Its wait orders the compute stream
    alone, and the host's read races the copy (what ``wait_on_host`` is for)."""
    copy, read = _read_on_host(streams, "test:other")
    assert not streams.happens_before(copy, read), streams.log


def test_the_compiler_says_which_host_copies_the_forward_reads(streams, caplog):
    """``PairRegister.record``: the offloads of accelerator tensors whose host copy the forward's code
    of the pair that runs reads (``output_code.read_offloads``) wait on the host, and the log says so;
    a CPU tensor's wait blocks the host anyway (the copy engine's), and is left alone. Set for the
    pair recorded, not by every compile of the graph: a compile that is dropped (verify_peak's code
    without offloading) cleared the pair's host waits, and its forward's host read raced the copy."""
    import types

    from fxoffload.compiler.pair import PairRegister

    def decision(name, device):
        return types.SimpleNamespace(saved=types.SimpleNamespace(name=name, device=torch.device(device)))

    def pair(graph_id, code, *decisions):
        plan = types.SimpleNamespace(offloaded=decisions)
        return types.SimpleNamespace(graph_id=graph_id, plan=plan, output_code={"forward": code})

    code = (
        "def call(self, args):\n"
        "    buf7 = torch.ops.fxoffload.offload.default(buf2, [], 0.0, '5:conv')\n"
        "    buf9 = torch.ops.fxoffload.wait.default(buf7, buf2, [])\n"
        "    buf3 = torch.ops.fxoffload.offload.default(buf1, [], 0.0, '5:other')\n"
        "    buf4 = torch.ops.fxoffload.wait.default(buf3, buf1, [])\n"
        "    cpp_fused_0(buf9, buf4, buf11)\n"
        "    return (buf11, )\n"
    )
    for device, said in (("cuda", {"5:conv", "5:other"}), ("cpu", set())):
        transfers._host_reads.clear()
        caplog.clear()
        PairRegister().record(pair(5, code, decision("conv", device), decision("other", device)))
        assert transfers._host_reads == said
        assert ("reads the host copies of conv, other" in caplog.text) is bool(said), caplog.text
    # The pair that runs is recorded again (its measurement on the report): nothing changes, said once.
    register, running = PairRegister(), pair(5, code, decision("conv", "cuda"))
    register.record(running)
    caplog.clear()
    register.record(running)
    assert transfers._host_reads == {"5:conv"} and "reads the host copies" not in caplog.text
    # The graph compiled again, its new code reading none: its waits stop blocking the host; another
    # graph's stay.
    transfers._host_reads.add("6:conv")
    register.record(pair(5, code.replace("cpp_fused_0(buf9, buf4, buf11)", "cpp_fused_0(buf11)"), decision("conv", "cuda")))
    assert transfers._host_reads == {"6:conv"}


def test_an_offload_restrides_its_source_into_the_layout_it_is_given(streams, monkeypatch):
    """A convolution's output laid out channels-last, traced contiguous: the host copy and its reload
    take the layout asked for (``rewrite.host_layout``). The source is restrided on its device, on the
    transfer stream after the producer, then copied as one run of bytes, ordered as any copy. A
    recording times the copy alone: the restride is no time on the link (the D2H rate measured)."""
    restrided = transfers._restrided

    def logged(src, stride):
        streams.log.append((streams.current[-1].name, "kernel", "restride"))
        return restrided(src, stride)

    monkeypatch.setattr(transfers, "_restrided", logged)
    src = torch.empty(2, 3, 4, 5, device=META).to(memory_format=torch.channels_last)
    traced = [60, 20, 5, 1]
    produced = streams.kernel("produce src")
    recording = timing.Recording("test:").start()
    host = transfers._offload_impl(src, [], 0.0, "test:src", traced)
    recording.close()
    assert host.stride() == tuple(traced) and host.device.type == "cpu"
    transfers._wait_impl(host, src, [])
    (stamps,) = recording._offloads
    recording.discard()
    reused = streams.kernel("reuse src's memory")
    (copy,) = streams.copies()
    (restride,) = [i for i, entry in enumerate(streams.log) if entry == ("transfer", "kernel", "restride")]
    assert streams.log[copy] == ("transfer", "copy", ("cpu", "meta", True)), streams.log
    assert streams.happens_before(produced, restride) and streams.happens_before(restride, copy), streams.log
    assert streams.happens_before(copy, reused), streams.log
    assert restride < stamps.copy_start.at < copy < stamps.copy_end.at, streams.log
    assert transfers._reload_impl(host, META, [], 0.0, "test:src").stride() == tuple(traced)
