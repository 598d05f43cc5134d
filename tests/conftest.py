import contextlib
import copy
import dataclasses
import logging
import os
import re

import pytest
import torch
import torch._dynamo
import torch._inductor.config

import fxoffload
from fxoffload import _compat

# Inductor's C++ kernels are built scalar in the suite: most of its time is building them (711
# builds), and a scalar kernel builds about a fifth faster. The wrapper code, its buffers and the
# transfer ops (what the tests read and measure) are the same; the CUDA lowering is not affected.
# The demo, the benchmarks and users' runs keep Inductor's default (vectorised) kernels.
torch._inductor.config.cpp.vec_isa_ok = False

# pytest-xdist: the workers share the machine's cores, torch's intra-op threads too. Two workers of
# two threads each on two cores left each parallel region waiting for a thread the other worker had
# the core of: a 200-step MLP soak took 63 s at 2 threads and 13 s at 1 on a loaded 2-core machine.
# Each worker gets its share of torch's default thread count (at least one); tests that set their
# own count (one thread for measured peaks, eight for the scratch test) still do.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))
    # Each worker builds its C++ kernels itself: a pool of compile processes per worker (Inductor's
    # default on two cores) added 11% to the CPU time of `test_kernel_runs` and `test_fuzz` (394
    # against 351 CPU-seconds), on a machine the two workers already keep busy.
    torch._inductor.config.compile_threads = 1

# pytest 9 attaches its log capture to every logger that does not propagate, torch's structured-trace
# logger too: torch then builds every TORCH_TRACE payload (graphs printed, fxoffload's plan as JSON)
# for the capture, 2.4% of a budget test's time. Propagating, it gets no handler of pytest's and
# builds none; a TORCH_TRACE run (tests/test_explain.py, in its own process) is not affected.
logging.getLogger("torch.__trace").propagate = True

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The older of the two supported torch versions, where some measured figures differ by design of torch.
TORCH_2_11 = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)
# What code before a graph saved is read through ``SavedTensor.data`` (fxoffload/upstream.py).
requires_saved_tensor_reads = pytest.mark.skipif(
    not _compat.can_read_saved_tensors(),
    reason="this torch cannot read a SavedTensor without unpacking it: code before a graph is not counted",
)


def skip_unless_fake_devices_can_be_made(devices) -> None:
    """Skip where a fake tensor on one of ``devices`` cannot be made. Fake tensors need no GPU on a
    machine without CUDA, but where CUDA is present torch creates a real tensor on the fake one's
    device when it makes it (``FakeTensor``'s ``init_gpu_context``): a fake ``cuda:1`` then needs a
    second GPU, and fails on one GPU with "invalid device ordinal"."""
    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    for device in map(torch.device, devices):
        if device.type == "cuda" and (device.index or 0) >= count:
            pytest.skip(
                f"a fake tensor on {device} makes torch initialise {device} where CUDA is present, "
                f"and this machine has {count} CUDA device(s)"
            )


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def cpu_backend(**options):
    """An fxoffload backend that offloads CPU tensors, so the data flow runs on this machine.

    ``verify_peak`` off: these tests check the rewritten code itself, which the check could swap for
    the unchanged pair where its peak is higher (``tests/test_no_cost.py`` tests the check)."""
    options = {"offload_cpu": True, "min_bytes": 0, "policy": "all", "verify_peak": False, **options}
    return fxoffload.backend(**options)


def auto_on_gpt(steps, **options):
    """``auto`` on the built-in GPT (no dropout, batch 8) under aot_eager, tensors from 16 KiB, its op
    calls free, ``options`` on top, for ``steps`` training steps: the backend, each step's loss and
    the bytes its graph offloaded after that step."""
    from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    defaults = {"offload_cpu": True, "policy": "auto", "inner": "aot_eager", "min_bytes": "16KiB", "op_time": 0.0}
    backend = fxoffload.backend(**{**defaults, **options})
    compiled = torch.compile(model, backend=backend)
    losses, offloaded = [], []
    for _ in range(steps):
        loss = compiled(*batch)
        loss.backward()
        losses.append(loss.item())
        offloaded.append(backend.reports[0].offloaded_bytes)
    return backend, losses, offloaded


def train_step(model, args, backend=None, seed=0, steps=1):
    """Loss and gradients of ``steps`` forward+backward runs of a deep copy of ``model``.

    backend None runs eagerly. The seed is fixed before each step, so dropout draws the same masks in
    eager and compiled runs whose RNG handling agrees (see test_parity for where it does not).
    """
    return run_steps(*compiled_copy(model, backend), args, seed, steps)


def compiled_copy(model, backend=None):
    """A deep copy of ``model``, and that copy compiled with ``backend`` (None: the copy itself)."""
    model = copy.deepcopy(model)
    return model, (model if backend is None else torch.compile(model, backend=backend))


def run_steps(model, fn, args, seed=0, steps=1):
    """``train_step`` on a ``compiled_copy``: a test that measures the same compile afterwards
    (``measured_steady_step``) runs its steps on it instead of compiling the model again."""
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = fn(*args)
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses), grads


def assert_same(a, b, rtol=1e-5, atol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=atol, msg=name)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def returned_names(code: str) -> set[str]:
    """Names in the ``return`` of generated graph code: the forward's outputs, saved tensors included."""
    return set(re.findall(r"\w+", code.rsplit("return", 1)[-1]))


class ConvStack(torch.nn.Module):
    """Convolutions, GroupNorms and SiLUs, as in a diffusion UNet's blocks: Inductor lays the
    convolutions' operands out channels-last."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.c1, self.g1 = nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.c2, self.g2 = nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.c3, self.g3 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32)
        self.c4 = nn.Conv2d(32, 3, 1)

    def forward(self, x):
        silu = torch.nn.functional.silu
        x = silu(self.g1(self.c1(x)))
        x = silu(self.g2(self.c2(x))) + x
        return self.c4(silu(self.g3(self.c3(x)))).pow(2).mean()


def measured_example(name, backend):
    """``measured_steady_step`` of a training step of ``fxoffload.testing.models.example(name)`` compiled with
    ``backend`` (a non-scalar output is reduced to a loss): the peak bytes above the step's start."""
    from fxoffload.testing.models import example

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = example(name)
    compiled = torch.compile(model, backend=backend)

    def step():
        out = compiled(*batch)
        out = out[0] if isinstance(out, (tuple, list)) else out
        (out if out.dim() == 0 else out.float().pow(2).mean()).backward()

    return measured_steady_step(model, step)[0]


def measured_steady_step(model, step, warmup=2):
    """The CPU allocator's peak of one ``step()`` after ``warmup`` ones, above what was live when it
    started (``fxoffload.measure_memory``, one thread, frees of earlier blocks counted), and the
    warnings the warm-up steps gave (where the compiles happen)."""
    from fxoffload.measure.allocator import measure_steady_step, track_cpu_frees

    track_cpu_frees()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # allocation order does not depend on the thread count then
    try:
        measured, caught = measure_steady_step(step, warmup, lambda: model.zero_grad(set_to_none=True))
        return measured.cpu.peak_bytes, caught
    finally:
        torch.set_num_threads(threads)


def calls_cost_the_step(monkeypatch, seconds=5e-2):
    """Forced: the first steps measure both phases host-bound (the host's windows set to the
    device's), each offloaded tensor's calls at ``seconds`` of host time each way, and no copy
    stalled, so that only the calls' price can make a plan be made again."""
    from fxoffload.compiler import watch
    from fxoffload.runtime import timing

    real = timing.compute_windows
    monkeypatch.setattr(
        timing, "compute_windows",
        lambda resolved: [dataclasses.replace(t, host_window_s=t.stream_window_s) for t in real(resolved)],
    )  # fmt: skip
    monkeypatch.setattr(watch, "host_op_seconds", lambda device: (seconds, seconds))
    no_copy_stalls(monkeypatch)


def no_copy_stalls(monkeypatch):
    """Forced: no copy the first steps measure counts as stalled, whatever its stall."""
    from fxoffload.compiler import watch
    from fxoffload.planning import measured

    for module in (watch, measured):
        monkeypatch.setattr(module, "stalled", lambda t: False)


@contextlib.contextmanager
def through_inductors_cache(monkeypatch):
    """The compiles inside use Inductor's FX graph cache with every graph's id held at 0: the copies
    carry it in their names, which alone keeps a second compile of one model in a process from the
    cache. Yields a function: the cache hits since entering."""
    from torch._dynamo.utils import counters
    from torch._inductor import config

    from fxoffload.compiler import partitioner

    with monkeypatch.context() as m, config.patch(fx_graph_cache=True):
        m.setattr(partitioner, "new_graph_id", lambda: 0)
        counters.clear()
        yield lambda: counters["inductor"]["fxgraph_cache_hit"]


class RoutedTokens(torch.nn.Module):
    """A mixture-of-experts layer's dispatch: each expert runs on the tokens its router chose
    (``torch.where``: a count known only when the graph runs) and scales its output by the gate, a
    (tokens, 1) column that Inductor lays out with that count in a stride."""

    def __init__(self, dim=32, experts=2):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts)
        self.up = torch.nn.ModuleList(torch.nn.Linear(dim, 2 * dim) for _ in range(experts))
        self.down = torch.nn.ModuleList(torch.nn.Linear(2 * dim, dim) for _ in range(experts))

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        choice = gate.argmax(-1)
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            (tokens,) = torch.where(choice == e)
            h = down(torch.nn.functional.gelu(up(x[tokens])))
            out = out.index_add(0, tokens, h * gate[tokens, e, None])
        return out.square().mean()


def routed_tokens():
    """``RoutedTokens`` on 256 tokens (a gate column of 1 KiB at most: not too small to copy), and the
    Dynamo setting that traces its ``torch.where``."""
    torch.manual_seed(0)
    settings = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
    return RoutedTokens(), (torch.randn(256, 32),), settings
