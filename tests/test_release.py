"""Offloaded storages are really released, host buffers are pooled, and lifetimes stay right."""

import pytest
import torch

import fxoffload
from fxoffload import ops
from fxoffload.models import MLP

from .conftest import cpu_backend, train_step

INNERS = ["aot_eager", "inductor"]


@pytest.mark.parametrize("inner", INNERS)
def test_source_storage_is_freed_after_forward(inner):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(16, 64)
    backend = cpu_backend(inner=inner)
    compiled = torch.compile(model, backend=backend)
    compiled(x).backward()  # compile outside the tracked region
    with ops.track_releases() as tracked:
        loss = compiled(x)
        # Between forward and backward: every offloaded source storage is gone, while autograd
        # holds only the host copies.
        assert tracked.count() == len(backend.reports[0].offloaded) > 0
        assert tracked.alive() == 0, f"{tracked.alive()} offloaded storages are still alive"
        loss.backward()


def test_release_tracking_can_fail():
    """The tracker itself sees a storage that is kept alive."""
    keep = torch.randn(1000)
    with ops.track_releases() as tracked:
        host = ops.offload(keep, [])
        ops.wait(host, keep, [])
    assert tracked.count() == 1 and tracked.alive() == 1
    del keep
    assert tracked.alive() == 0


def test_wait_without_copy_is_an_error():
    t = torch.randn(4)
    with pytest.raises(RuntimeError, match="no transfer is pending"):
        ops.wait(t, t, [])


def test_reload_restores_size_and_stride_of_non_contiguous_tensors():
    src = torch.randn(8, 6, 4).permute(2, 0, 1)  # dense, not contiguous
    host = ops.wait(ops.offload(src, []), src, [])
    assert host.stride() == src.stride()
    back = ops.wait(ops.reload(host, src.device, []), host, [])
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
    assert report.host_budget == budget and report.host_bytes_total == report.offloaded_bytes
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
    pool = ops.HostBufferPool()
    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("cudaHostAlloc: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.warns(RuntimeWarning, match="falling back to pageable"):
        storage = pool.acquire(1024, pin=True)
    stats = pool.stats()
    assert stats.pin_failed and stats.pinned_bytes == 0 and stats.bytes_allocated == 1024
