"""Offloaded storages are really released, host buffers are pooled, and lifetimes stay right."""

import warnings

import pytest
import torch
import torch.fx as fx

import fxoffload
from fxoffload import ir
from fxoffload import sizes
from fxoffload.runtime import host_pool
from fxoffload.runtime import transfers
from fxoffload.testing.models import MLP

from .conftest import cpu_backend, skip_unless_fake_devices_can_be_made, train_step

INNERS = ["aot_eager", "inductor"]


@pytest.mark.parametrize("inner", INNERS)
def test_source_storage_is_freed_after_forward(inner):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(16, 64)
    backend = cpu_backend(inner=inner)
    compiled = torch.compile(model, backend=backend)
    compiled(x).backward()  # compile outside the tracked region
    with transfers.track_releases() as tracked:
        loss = compiled(x)
        # Between forward and backward: every offloaded source storage is gone, while autograd
        # holds only the host copies.
        assert tracked.count() == len(backend.reports[0].offloaded) > 0
        assert tracked.alive() == 0, f"{tracked.alive()} offloaded storages are still alive"
        loss.backward()


def test_release_tracking_can_fail():
    """The tracker itself sees a storage that is kept alive."""
    keep = torch.randn(1000)
    with transfers.track_releases() as tracked:
        host = ir.OFFLOAD(keep, [])
        ir.WAIT(host, keep, [])
    assert tracked.count() == 1 and tracked.alive() == 1
    del keep
    assert tracked.alive() == 0


def test_wait_without_copy_is_an_error():
    t = torch.randn(4)
    with pytest.raises(RuntimeError, match="no transfer is pending"):
        ir.WAIT(t, t, [])


def test_reload_restores_size_and_stride_of_non_contiguous_tensors():
    src = torch.randn(8, 6, 4).permute(2, 0, 1)  # dense, not contiguous
    host = ir.WAIT(ir.OFFLOAD(src, []), src, [])
    assert host.stride() == src.stride()
    back = ir.WAIT(ir.RELOAD(host, src.device, []), host, [])
    assert back.stride() == src.stride() and torch.equal(back, src)


@pytest.mark.parametrize("inner", INNERS)
def test_host_pool_is_reused_across_steps(inner):
    torch.manual_seed(0)
    fxoffload.release_host_memory()
    model, x = MLP(), torch.randn(16, 64)
    compiled = torch.compile(model, backend=cpu_backend(inner=inner))
    sizes = []
    for _ in range(5):
        compiled(x).backward()
        stats = fxoffload.host_pool_stats()
        sizes.append((stats.buffers, stats.bytes_allocated))
        assert stats.bytes_in_use == 0, "host copies must be dropped after the backward"
    assert sizes[0][0] > 0
    assert len(set(sizes)) == 1, f"the pool grew after the first step: {sizes}"


def test_retain_graph_backward_twice_keeps_host_copies():
    """A pooled buffer still referenced by autograd is never handed out again."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(16, 64)
    compiled = torch.compile(model, backend=cpu_backend(inner="aot_eager"))
    loss = compiled(x)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    compiled(x + 1).backward()  # a second step takes pool buffers while the first graph is retained
    model.zero_grad()
    loss.backward()
    for a, p in zip(first, model.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_host_budget_bounds_offloaded_bytes():
    torch.manual_seed(0)
    model, x = MLP(layers=4), (torch.randn(16, 64),)
    full = cpu_backend(inner="aot_eager")
    train_step(model, x, full)
    everything = full.reports[0].offloaded_bytes
    budget = everything // 2
    torch._dynamo.reset()
    bounded = cpu_backend(inner="aot_eager", host_budget=budget)
    got = train_step(model, x, bounded)
    report = bounded.reports[0]
    assert 0 < report.offloaded_bytes <= budget
    assert any("host_budget reached" in r.reason for r in report.saved)
    # CPU tensors go to pageable buffers of the pool's size class: that is what the budget counts.
    assert report.host_budget == budget
    assert report.host_bytes_total == sum(sizes.host_bytes(r.nbytes) for r in report.offloaded) <= budget
    assert "host_budget:" in report.table() and "host_budget: unbounded" in full.reports[0].table()
    expected = train_step(model, x)
    torch.testing.assert_close(got[0], expected[0])


def test_min_bytes_filters_small_tensors():
    torch.manual_seed(0)
    model, x = MLP(), (torch.randn(16, 64),)
    backend = cpu_backend(inner="aot_eager", min_bytes="8KiB")
    train_step(model, x, backend)
    report = backend.reports[0]
    assert report.offloaded and all(r.nbytes >= 8192 for r in report.offloaded)
    assert any("min_bytes" in r.reason for r in report.saved)


def test_pinned_allocation_failure_falls_back_to_pageable(monkeypatch):
    pool = host_pool.HostBufferPool()
    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("cudaHostAlloc: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.warns(RuntimeWarning, match="falling back to pageable"):
        pool.acquire(1024, pin=True)
    stats = pool.stats()
    assert stats.pin_failed and stats.pinned_bytes == 0 and stats.bytes_allocated == 1024


def test_pinned_failure_warns_once_and_keeps_working(monkeypatch):
    pool = host_pool.HostBufferPool()
    real_empty = torch.empty
    calls = {"pinned": 0}

    def failing_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            calls["pinned"] += 1
            raise RuntimeError("cudaHostAlloc: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = [_take(pool, n, pin=True) for n in (1024, 4096, 4096, 1 << 20)]
    assert [str(w.message) for w in caught if "pageable" in str(w.message)] == [
        str(caught[0].message)
    ], "exactly one warning"
    assert calls["pinned"] == 1, "after the first failure the pool stops trying to pin"
    stats = pool.stats()
    assert stats.pin_failed and stats.pinned_bytes == 0 and stats.buffers == 4
    assert sum(t.untyped_storage().nbytes() for t in held) == stats.bytes_allocated


def _take(pool, nbytes, pin=False):
    """A pool buffer held by a tensor, as the offload op holds it (the pool's own handle does not count)."""
    return pool.acquire(nbytes, pin=pin)


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_acquire_claims_the_buffer_before_returning():
    """Two acquisitions with nothing wrapped in between get two buffers: the claim is made under the
    pool's lock, so another thread cannot take a buffer between acquire and its first tensor."""
    pool = host_pool.HostBufferPool()
    a, b = pool.acquire(1000, pin=False), pool.acquire(1000, pin=False)
    assert _ptr(a) != _ptr(b)
    assert a.shape == (1000,) and a.dtype == torch.uint8
    assert a.untyped_storage().nbytes() == sizes.host_bytes(1000)
    assert pool.stats().bytes_in_use == 2 * sizes.host_bytes(1000)
    del a
    assert pool.stats().bytes_in_use == sizes.host_bytes(1000)


def test_a_free_buffer_serves_only_the_device_it_served():
    """A reload's copy out of a buffer may still run on its device's transfer stream when the buffer
    turns free on the host; another device's stream would not wait for it, so no sharing."""
    pool = host_pool.HostBufferPool()
    first = pool.acquire(4096, pin=False, device="cuda:0")
    ptr = _ptr(first)
    del first  # free on the host
    other = pool.acquire(4096, pin=False, device="cuda:1")
    assert _ptr(other) != ptr
    same = pool.acquire(4096, pin=False, device="cuda:0")
    assert _ptr(same) == ptr
    assert pool.stats().buffers == 2


def test_acquire_from_many_threads_never_shares_a_buffer():
    import threading

    pool, threads, barrier, errors = host_pool.HostBufferPool(), 8, threading.Barrier(8), []

    def work(k):
        for _ in range(50):
            mine = pool.acquire(4096, pin=False)
            mine.fill_(k)
            barrier.wait()  # every thread holds one buffer now
            if not bool((mine == k).all()):
                errors.append(k)
            barrier.wait()
            del mine
            barrier.wait()  # every buffer is free again before the next round

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert pool.stats().buffers == threads and pool.stats().bytes_in_use == 0


def test_release_host_memory_frees_free_buffers_and_never_hands_out_held_ones():
    pool = host_pool.HostBufferPool()
    held = _take(pool, 4096)
    held.fill_(7)
    free = _take(pool, 8192)
    del free
    assert pool.stats().buffers == 2
    pool.clear()
    stats = pool.stats()
    assert (stats.buffers, stats.bytes_allocated, stats.bytes_in_use) == (0, 0, 0)
    again = _take(pool, 4096)
    assert _ptr(again) != _ptr(held)  # the held buffer is not the pool's to give any more
    again.fill_(1)
    assert bool((held == 7).all())
    # The module-level function clears the pool the ops use.
    host_pool.HOST_POOL.acquire(1 << 16, pin=False)  # taken and dropped at once: a free buffer
    assert fxoffload.host_pool_stats().bytes_allocated >= 1 << 16
    fxoffload.release_host_memory()
    assert fxoffload.host_pool_stats().buffers == 0


def test_eviction_never_drops_a_buffer_in_use():
    pool = host_pool.HostBufferPool()
    held = _take(pool, 40000)  # the least recently used buffer, but in use
    for n in (50000, 60000, 70000, 81000, 100000):  # each allocation goes past twice the peak
        del_me = _take(pool, n)
        assert pool.stats().bytes_in_use == sizes.host_bytes(40000) + sizes.host_bytes(n)
        del del_me
    ptr, buffers = _ptr(held), pool.stats().buffers
    assert buffers < 6, "free buffers were dropped"
    del held
    assert _ptr(_take(pool, 40000)) == ptr, "the buffer in use stayed in the pool and is reused"
    assert pool.stats().buffers == buffers


def test_pinned_and_pageable_buffers_are_never_mixed(monkeypatch):
    pool = host_pool.HostBufferPool()
    # No accelerator here: pinned buffers are plain ones that the pool records as pinned.
    plain = lambda n, pin: (torch.empty(n, dtype=torch.uint8).untyped_storage(), pin)  # noqa: E731
    monkeypatch.setattr(pool, "_allocate", plain)
    pinned = _take(pool, 4096, pin=True)
    pinned_ptr = _ptr(pinned)
    del pinned
    pageable = _take(pool, 4096, pin=False)
    assert _ptr(pageable) != pinned_ptr, "a pageable request took the free pinned buffer"
    pageable_ptr = _ptr(pageable)
    del pageable
    assert _ptr(_take(pool, 4096, pin=True)) == pinned_ptr
    assert _ptr(_take(pool, 4096, pin=False)) == pageable_ptr
    stats = pool.stats()
    assert (stats.buffers, stats.pinned_bytes, stats.bytes_allocated) == (2, 4096, 8192)


def test_offload_into_a_larger_pooled_buffer_views_only_its_bytes():
    fxoffload.release_host_memory()
    big = host_pool.HOST_POOL.acquire(1 << 16, pin=False, device="cpu")  # the device the offload below serves
    big.fill_(255)
    big_ptr = _ptr(big)
    del big
    src = torch.randn(40, 16, 20).permute(2, 0, 1)  # 51200 bytes, dense, not contiguous
    assert sizes.host_bytes(src.nbytes) <= 1 << 16 <= 2 * sizes.host_bytes(src.nbytes)
    host = ir.WAIT(ir.OFFLOAD(src, []), src, [])
    assert _ptr(host) == big_ptr and host.untyped_storage().nbytes() == 1 << 16
    assert host.storage_offset() == 0 and host.shape == src.shape and host.stride() == src.stride()
    assert torch.equal(host, src)
    raw = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage())
    assert bool((raw[src.nbytes :] == 255).all()), "bytes past the tensor were written"
    back = ir.WAIT(ir.RELOAD(host, src.device, []), host, [])
    assert back.stride() == src.stride() and torch.equal(back, src)
    assert back.untyped_storage().nbytes() == src.nbytes


def test_reload_copies_into_a_tensor_of_its_own():
    """The backward must not read the pooled host buffer, which is reused once the host copy goes."""
    src = torch.randn(64, 32)
    host = ir.WAIT(ir.OFFLOAD(src, []), src, [])
    back = ir.WAIT(ir.RELOAD(host, src.device, []), host, [])
    assert _ptr(back) != _ptr(host) and _ptr(back) != _ptr(src)
    host.zero_()
    assert torch.equal(back, src)


def test_pool_size_classes_and_reuse():
    assert [sizes.host_bytes(n) for n in (1, 8, 1024, 1025, 1280, 1281, 3000, 4096, 5000)] == [
        1, 8, 1024, 1280, 1280, 1536, 3072, 4096, 5120,
    ]
    for n in range(9, 5000, 7):
        assert n <= sizes.host_bytes(n) <= 1.25 * n
    pool = host_pool.HostBufferPool()
    big = _take(pool, 1 << 20)
    second = _take(pool, 1 << 20)  # the first is in use: a second buffer
    assert big.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    del big, second
    # A free buffer up to twice the request serves it; a larger one does not.
    assert _take(pool, 600_000).untyped_storage().nbytes() == 1 << 20
    assert _take(pool, 400_000).untyped_storage().nbytes() == sizes.host_bytes(400_000)
    assert pool.stats().buffers == 3


def test_pool_drops_least_recently_used_free_buffers_past_twice_the_peak():
    pool = host_pool.HostBufferPool()
    for n in (40000, 50000, 60000, 70000, 81000):  # ascending: nothing earlier fits the next one
        held = _take(pool, n)
        assert pool.stats().bytes_in_use == sizes.host_bytes(n)
        del held
    stats = pool.stats()
    assert stats.bytes_in_use == 0
    assert stats.bytes_allocated <= 2 * sizes.host_bytes(81000), stats
    assert stats.buffers < 5, "the oldest free buffers were dropped"
    held = _take(pool, 81000)  # the newest buffer survived and is reused
    assert pool.stats().buffers == stats.buffers
    assert held.untyped_storage().nbytes() == sizes.host_bytes(81000)


def test_host_budget_is_shared_by_the_graphs_of_one_backend():
    """A graph break makes two graphs; the second gets what the first left of host_budget."""
    from .test_parity import GraphBreak

    torch.manual_seed(0)
    model, x = GraphBreak(), (torch.randn(16, 64),)
    full = cpu_backend(inner="aot_eager")
    train_step(model, x, full)
    first, second = (r.offloaded_bytes for r in full.reports)
    torch._dynamo.reset()
    budget = first + second // 2
    bounded = cpu_backend(inner="aot_eager", host_budget=budget)
    got = train_step(model, x, bounded)
    a, b = bounded.reports
    assert a.offloaded_bytes == first and 0 < b.offloaded_bytes <= second // 2
    assert b.host_bytes_total == a.offloaded_bytes + b.offloaded_bytes <= budget
    kept = [r for r in b.saved if "host_budget reached" in r.reason]
    assert kept and all(r.decision == "keep" for r in kept)
    expected = train_step(model, x)
    torch.testing.assert_close(got[0], expected[0])
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name])


# --- saved tensors on two devices ----------------------------------------------------------------


def _two_device_graphs(devices, n=256):
    """A partitioned pair by hand: one chain per device, each saving a tanh for the backward. The
    values are fake tensors, so "cuda:0" and "cuda:1" need no GPU where CUDA is absent; where it is
    present they need those devices (``skip_unless_fake_devices_can_be_made``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    skip_unless_fake_devices_can_be_made(devices)

    aten = torch.ops.aten
    mode = FakeTensorMode()

    def call(graph, op, *args):
        node = graph.call_function(op, args)
        with mode:
            node.meta["val"] = op(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        return node

    def placeholder(graph, name, val):
        node = graph.placeholder(name)
        node.meta["val"] = val
        return node

    fw, bw = fx.Graph(), fx.Graph()
    saved, losses = [], []
    for i, device in enumerate(devices):
        with mode:
            x = placeholder(fw, f"x{i}", torch.empty(n, n, device=device))
        h = call(fw, aten.tanh.default, x)
        y = h
        for _ in range(3):  # forward compute after the last use: a window for the copy out
            y = call(fw, aten.mm.default, y, y)
        losses.append(call(fw, aten.sum.default, y))
        saved.append(h)
    fw.output(tuple(losses + saved))
    restored = [placeholder(bw, h.name, h.meta["val"]) for h in saved]
    with mode:
        tangents = [placeholder(bw, f"tangents_{i + 1}", torch.empty((), device=d)) for i, d in enumerate(devices)]
    grads = []
    for h, t in zip(restored, tangents):
        y = call(bw, aten.mul.Tensor, h, t)
        for _ in range(3):
            y = call(bw, aten.mm.default, y, y)
        grads.append(y)
    bw.output(tuple(grads))
    return fx.GraphModule(torch.nn.Module(), fw), fx.GraphModule(torch.nn.Module(), bw), len(devices)


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0"), ("cpu", "cuda:1")])
def test_each_reload_targets_the_device_of_its_saved_tensor(devices):
    from fxoffload.compiler.offload_pass import offload_pass
    from fxoffload.options import OffloadOptions

    fw, bw, num_outputs = _two_device_graphs(devices)
    original = {n.name: n.meta["val"].device for n in bw.graph.nodes if n.op == "placeholder"}
    options = OffloadOptions.from_dict({
        "policy": "all", "min_bytes": 0, "offload_cpu": True,
        "bandwidth": 25e9, "compute_rates": {"flops": 1e14, "memory_bandwidth": 2e12},
    })  # fmt: skip
    fw, bw, plan = offload_pass(fw, bw, num_outputs, (), options)
    assert len(plan.offloaded) == 2
    reloads = [n for n in bw.graph.nodes if n.target is ir.RELOAD]
    assert len(reloads) == 2
    for reload in reloads:
        host, device = reload.args[0], reload.args[1]
        assert host.op == "placeholder" and host.name.endswith("_host")
        assert host.meta["val"].device.type == "cpu"
        assert device == original[host.name.removesuffix("_host")]
        (wait,) = [u for u in reload.users if u.target is ir.WAIT]
        assert wait.meta["val"].device == device
        # Everything that used the saved tensor now reads the reloaded copy, on the same device.
        assert all(u.meta["val"].device == device for u in wait.users if u.op != "output")
    assert {r.args[1] for r in reloads} == {torch.device(d) for d in devices}


def test_pinned_buffers_are_sized_as_the_host_allocator_rounds_them(monkeypatch):
    """torch's caching host allocator rounds every pinned request up to a power of two and keeps the
    whole block: the pool asks for the power of two itself, so its size classes, its statistics and
    what it reuses are the real pinned bytes (a quarter-octave class of 1.1 MiB would take 2 MiB of
    page-locked memory while the pool counted 1.25)."""
    assert [sizes.host_bytes(n, pinned=True) for n in (1, 8, 9, 1024, 1025, 1_153_434, 33 << 20)] == [
        1, 8, 16, 1024, 2048, 2 << 20, 64 << 20,
    ]
    asked = []
    real_empty = torch.empty

    def pinned_empty(*args, pin_memory=False, **kwargs):  # no accelerator here: record, then plain memory
        if pin_memory:
            asked.append(args[0])
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned_empty)
    pool = host_pool.HostBufferPool()
    held = _take(pool, 1_153_434, pin=True)
    assert asked == [2 << 20] and held.numel() == 1_153_434
    stats = pool.stats()
    assert (stats.pinned_bytes, stats.bytes_allocated, stats.bytes_in_use) == (2 << 20, 2 << 20, 2 << 20)
    ptr = _ptr(held)
    del held
    assert _ptr(_take(pool, 2 << 20, pin=True)) == ptr, "the whole power of two is usable"
    assert asked == [2 << 20]


def test_host_budget_counts_real_host_bytes():
    """Three 3 MiB tensors and a 9 MiB host budget: CPU tensors (pageable, 3 MiB each) all fit; CUDA
    tensors take 4 MiB of pinned memory each, so only two do."""
    from fxoffload.analysis.lifetimes import GraphLifetimes
    from fxoffload.options import OffloadOptions
    from fxoffload.planning.plan import plan_offloads

    from .test_plan import saved

    def plan_on(device):
        records = [saved(f"t{i}", nbytes=3 << 20, device=device, output_index=i) for i in range(3)]
        lifetimes = GraphLifetimes(tuple(records), 100, 100, (device,))
        return plan_offloads(lifetimes, OffloadOptions(policy="all", offload_cpu=True), host_bytes_available=9 << 20)

    on_cpu, on_cuda = plan_on("cpu"), plan_on("cuda")
    assert len(on_cpu.offloaded) == 3 and on_cpu.host_bytes == 9 << 20
    assert len(on_cuda.offloaded) == 2 and on_cuda.host_bytes == 8 << 20
    assert on_cuda.decisions[2].reason.code == "host_budget"
