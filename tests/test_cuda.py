"""On a CUDA device: parity under bf16 autocast, a real peak-memory drop, and a stable 50-step run."""

import contextlib
import copy

import pytest
import torch
import torch._inductor.config as inductor_config

import fxoffload
from fxoffload import ir
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _eager_random():
    with inductor_config.patch(fallback_random=True):
        yield


def _step(model, batch, backend, autocast=True):
    model = copy.deepcopy(model)
    fn = torch.compile(model, backend=backend)
    torch.manual_seed(0)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(*batch)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_bf16_autocast_parity_with_inductor():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=128, dim=128, heads=4, layers=4)
    model = GPT(cfg).cuda()
    batch = gpt_batch(cfg, 8, "cuda")
    backend = fxoffload.backend(policy="all", min_bytes=0)
    got = _step(model, batch, backend)
    torch._dynamo.reset()
    ref = _step(model, batch, "inductor")
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=5e-2, atol=5e-3, msg=name)
    assert backend.reports[0].offloaded


class Wide(torch.nn.Module):
    """Activations dominate: 8 layers of 4096-wide GELU MLP on a large batch."""

    def __init__(self, dim=1024, hidden=4096, layers=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
            for _ in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.float().square().mean()


def _peak(model, x, backend):
    fn = torch.compile(model, backend=backend)
    fn(x).backward()  # compile and warm up
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn(x).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_policy_all_lowers_peak_memory():
    torch.manual_seed(0)
    model = Wide().cuda()
    x = torch.randn(8192, 1024, device="cuda")
    base = _peak(model, x, "inductor")
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    backend = fxoffload.backend(policy="all")
    offloaded = _peak(model, x, backend)
    assert backend.reports[0].offloaded_bytes > 256 * 2**20
    assert offloaded < 0.8 * base, f"peak {offloaded / 2**20:.0f} MiB vs inductor {base / 2**20:.0f} MiB"


def test_fifty_steps_identical_and_no_memory_growth():
    torch.manual_seed(0)
    model = Wide(dim=512, hidden=2048, layers=4).cuda()
    x = torch.randn(2048, 512, device="cuda")
    fxoffload.release_host_memory()
    backend = fxoffload.backend(policy="all")
    fn = torch.compile(model, backend=backend)
    losses, allocated = [], []
    for _ in range(50):
        model.zero_grad(set_to_none=True)
        loss = fn(x)
        loss.backward()
        losses.append(loss.item())
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert len(set(losses)) == 1, "the same inputs and weights must give the same loss every step"
    assert max(allocated[2:]) == min(allocated[2:]), f"allocated memory moved: {allocated}"
    (report,) = backend.reports
    assert report.offloaded_bytes > 0, report.table()
    stats = fxoffload.host_pool_stats()
    assert stats.bytes_in_use == 0 and stats.pinned_bytes >= report.offloaded_bytes


def test_reload_goes_to_the_original_device():
    src = torch.randn(1024, 1024, device="cuda")
    host = ir.WAIT(ir.OFFLOAD(src, []), src, [])
    assert host.device.type == "cpu" and host.is_pinned()
    back = ir.WAIT(ir.RELOAD(host, src.device, []), host, [])
    torch.cuda.synchronize()
    assert back.device == src.device and torch.equal(back, src)


class TwoDevices(torch.nn.Module):
    """A pipeline split by hand: the first half on cuda:0, the second on cuda:1."""

    def __init__(self, dim=512, hidden=2048):
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
        self.second = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
        self.first.to("cuda:0")
        self.second.to("cuda:1")

    def forward(self, x):
        h = self.first(x.to("cuda:0"))
        return self.second(h.to("cuda:1")).square().mean()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_reload_to_their_own_devices():
    torch.manual_seed(0)
    model, x = TwoDevices(), torch.randn(1024, 512, device="cuda:0")
    backend = fxoffload.backend(policy="all", min_bytes=0, inner="aot_eager")
    compiled = copy.deepcopy(model)
    torch.compile(compiled, backend=backend)(x).backward()
    model(x).backward()
    for (name, a), b in zip(compiled.named_parameters(), model.parameters()):
        assert a.grad.device == b.device
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    devices = {r.device for rep in backend.reports for r in rep.offloaded}
    assert devices == {"cuda:0", "cuda:1"}, devices
    code = "".join(rep.bw_code for rep in backend.reports)
    assert "device(type='cuda', index=0)" in code and "device(type='cuda', index=1)" in code


# --------------------------------------------------------------------------------------------------
# The ops' stream use under the CUDA sanitizer (CSAN)
#
# CSAN is a dispatch mode: it sees each aten kernel, the stream it is issued on, and the events and
# stream waits of the process, and reports an access that no event orders after a conflicting one on
# another stream. Two things hide the ops from it, so these tests call them in a particular way:
#   - Dynamo does not run compiled frames while a dispatch mode is active, so a compiled model under
#     CSAN runs eagerly, without a single fxoffload op;
#   - called through the dispatcher, torch.ops.fxoffload.offload is one kernel to the mode (reading
#     its argument on the current stream), and the mode is switched off while that kernel runs, so the
#     copy it issues on the transfer stream is not seen.
# So each op's registered kernel is called directly (``_op_dk``), with the mode active: CSAN then sees
# the copy on the transfer stream, the events, and the compute stream's waits, exactly as the
# rewritten graph issues them. CSAN cannot see a free (it forgets a block when it is freed), so a
# source freed too early is shown as its next owner writing to it (what the caching allocator allows).
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sanitizer():
    """A fresh CSAN dispatch mode for the block; its trace callbacks are unregistered afterwards
    (torch never removes them, and each one runs on every CUDA allocation and event)."""
    from torch.cuda import _gpu_trace, _sanitizer

    torch.cuda.synchronize()
    mode = _sanitizer.CUDASanitizerDispatchMode()
    try:
        with mode:
            yield _sanitizer.CUDASanitizerErrors
    finally:
        torch.cuda.synchronize()
        for registry in vars(_gpu_trace).values():
            if isinstance(registry, torch._utils.CallbackRegistry):
                registry.callback_list[:] = [
                    cb for cb in registry.callback_list if getattr(cb, "__self__", None) is not mode.event_handler
                ]


def _kernel(name, *args):
    """Runs the registered kernel of ``fxoffload::name`` without the dispatcher's trip through the
    mode (see above): its aten calls, streams and events are what CSAN checks."""
    op = getattr(torch.ops.fxoffload, name).default
    key = torch._C.DispatchKey.CompositeExplicitAutograd
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), f"{op} has no {key} kernel"
    return op._op_dk(key, *args)


def offload_kernel(src, after):
    return _kernel("offload", src, after)


def reload_kernel(host, device, after):
    return _kernel("reload", host, device, after)


def wait_kernel(dest, keepalive, after):
    return _kernel("wait", dest, keepalive, after)


def _offloaded(x, others):
    """Forward: offload ``x``, compute with other tensors meanwhile, wait. Returns the host copy."""
    host = offload_kernel(x, [])
    assert host.is_pinned(), "a pageable copy would synchronise, and CSAN could not see a race"
    busy = others @ others  # compute on the compute stream while the copy runs
    return wait_kernel(host, x, [busy])


def test_offload_and_reload_are_ordered_under_the_cuda_sanitizer():
    device = torch.device("cuda", torch.cuda.current_device())
    with _sanitizer():
        x = torch.randn(1 << 20, device=device)
        expected = x.clone()
        others = torch.randn(256, 256, device=device)
        host = _offloaded(x, others)
        x.zero_()  # what the next owner of the freed block may do right after the wait
        del x
        back = reload_kernel(host, device, [others])
        back = wait_kernel(back, host, [])
        first_use = back * 2  # the first use, after the reload's wait
        assert torch.equal(first_use, expected * 2)


def test_the_cuda_sanitizer_sees_a_write_to_the_source_before_the_offloads_wait():
    device = torch.device("cuda", torch.cuda.current_device())
    with _sanitizer() as errors:
        x = torch.randn(1 << 20, device=device)
        host = offload_kernel(x, [])
        with pytest.raises(errors) as caught:
            x.add_(1)  # the compute stream writes the source while the transfer stream may read it
        wait_kernel(host, x, [])
    (error,) = caught.value.errors
    assert error.current_access.stream != error.previous_access.stream
    assert "copy_" in str(error.previous_access.operator), error


def test_the_cuda_sanitizer_sees_a_use_of_a_reload_before_its_wait():
    device = torch.device("cuda", torch.cuda.current_device())
    with _sanitizer() as errors:
        x = torch.randn(1 << 20, device=device)
        host = _offloaded(x, torch.randn(256, 256, device=device))
        back = reload_kernel(host, device, [])
        with pytest.raises(errors) as caught:
            back.sum()  # reads the reload's destination while the transfer stream may still write it
        wait_kernel(back, host, [])
    (error,) = caught.value.errors
    assert error.current_access.stream != error.previous_access.stream
    assert "copy_" in str(error.previous_access.operator), error


def test_compiled_step_offloads_and_matches_eager():
    """The compiled model these ops come from: something is offloaded, and the step is eager's."""
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0)
    model = GPT(cfg).cuda()
    batch = gpt_batch(cfg, 8, "cuda")
    backend = fxoffload.backend(policy="all", min_bytes=0, inner="aot_eager")
    got = _step(model, batch, backend, autocast=False)
    eager = copy.deepcopy(model)
    loss = eager(*batch)
    loss.backward()
    ref = loss.detach(), {n: p.grad for n, p in eager.named_parameters()}
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-4, atol=1e-5, msg=name)
    (report,) = backend.reports
    assert report.offloaded and report.offloaded_bytes > 0, report.table()
    assert "fxoffload.offload" in report.fw_code and "fxoffload.reload" in report.bw_code


def _ddp_one_gpu(rank, init_file, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, x = Wide(dim=256, hidden=1024, layers=4).cuda(), torch.randn(512, 256, device="cuda")
        ref = DDP(copy.deepcopy(model), bucket_cap_mb=1, gradient_as_bucket_view=True)
        ref(x).backward()
        backend = fxoffload.backend(policy="all", min_bytes=0)
        ddp = DDP(torch.compile(copy.deepcopy(model), backend=backend), bucket_cap_mb=1,
                  gradient_as_bucket_view=True)  # fmt: skip
        ddp(x).backward()
        diffs = [(a.grad - b.grad).abs().max().item() for a, b in zip(ddp.parameters(), ref.parameters())]
        torch.save({"diffs": diffs, "graphs": len(backend.reports),
                    "offloaded": [len(r.offloaded) for r in backend.reports],
                    "offloaded_bytes": [r.offloaded_bytes for r in backend.reports]}, out)  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_ddp_on_one_gpu(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    out = tmp_path / "ddp.pt"
    mp.spawn(_ddp_one_gpu, args=(str(tmp_path / "init"), str(out)), nprocs=1, join=True)
    result = torch.load(out)
    assert max(result["diffs"]) < 1e-4, result
    # DDP splits the model at its buckets; a piece may save nothing but its own input (never offloaded),
    # so what counts is the step as a whole.
    assert result["graphs"] > 1, result
    assert any(n > 0 for n in result["offloaded"]) and sum(result["offloaded_bytes"]) > 0, result


def test_measure_memory_reads_the_cuda_allocator_to_its_rounding():
    """``measure_memory`` on CUDA: peak and end above the start from the caching allocator's statistics,
    each block rounded up to 512 bytes as the allocator hands them out."""
    from fxoffload.measure.allocator import measure_memory

    def fn():
        kept = torch.empty(1000, dtype=torch.uint8, device="cuda")  # a 1024-byte block
        temporary = torch.empty(3000, dtype=torch.uint8, device="cuda")  # 3072, freed before the end
        del temporary
        return kept

    m = measure_memory(fn)
    cuda = m["cuda"]
    assert (cuda.peak_bytes, cuda.end_bytes, cuda.allocations) == (4096, 1024, 2)
    assert cuda.peak_reserved_bytes is not None and cuda.peak_reserved_bytes >= 0
    assert m.result.device.type == "cuda"


@pytest.mark.parametrize("policy", ["none", "all"])
def test_the_prediction_is_the_cuda_allocators_peak(policy):
    """The replay of Inductor's CUDA wrapper code (``report.compiled_memory()``) against the caching
    allocator's peak of a steady step, as ``bench.memory`` does on a CPU: within 5%."""
    from fxoffload.measure.allocator import measure_steady_step

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=256, dim=256, heads=4, layers=2)
    model = GPT(cfg).cuda()
    batch = gpt_batch(cfg, 8, "cuda")
    backend = fxoffload.backend(policy=policy, min_bytes=0, verify_peak=False)
    compiled = torch.compile(model, backend=backend)
    measured, _ = measure_steady_step(lambda: compiled(*batch).backward(), 2, lambda: model.zero_grad(set_to_none=True))
    (report,) = backend.reports
    replay = report.compiled_memory()
    assert replay is not None and replay.points, "no CUDA wrapper code to replay"
    predicted = replay.peak_bytes - report.start_bytes
    peak = measured["cuda"].peak_bytes
    assert abs(predicted / peak - 1) < 0.05, (predicted, peak, report.summary())
