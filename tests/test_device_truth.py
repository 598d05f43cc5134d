"""Where a tensor lives is read when the step runs, never from its traced (fake) value.

On a GPU, ``aten._scaled_dot_product_efficient_attention`` returns its philox seed and offset as int64
scalars on the host, while under fake tensors (what a traced graph's ``meta["val"]`` holds) they say
cuda:0 (pytorch#121528; ``../shared/gpu/sdpa_seed_devices.txt``). A plan that believed the fake
device offloaded them and reloaded them onto the GPU, and the backward kernel read the seed through a
host pointer that now pointed into device memory: a SIGSEGV on an H100. The class of that bug, on a
CPU: a custom op whose fake function says cuda while its real function returns a host tensor.
"""

import pytest
import torch
from torch import Tensor

import fxoffload
from fxoffload.planning.plan import MIN_COPY_BYTES

from .conftest import cpu_backend

AUX_ELEMENTS = 128  # 512 bytes: copied, where a smaller tensor is never worth a copy


@torch.library.custom_op("fxoffload_test::make_aux", mutates_args=())
def make_aux(x: Tensor, n: int) -> Tensor:
    """On the host whatever ``x``'s device, like efficient attention's seed and offset."""
    return torch.full((n,), 0.5) + x.sum().cpu() * 0


@make_aux.register_fake
def _(x, n):
    return torch.empty(n, device="cuda")  # the traced device: not where it lives


@torch.library.custom_op("fxoffload_test::scale_by", mutates_args=())
def scale_by(x: Tensor, aux: Tensor) -> Tensor:
    return x * aux.float().sum().to(x.device)


@scale_by.register_fake
def _(x, aux):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])  # the host tensor is saved for the backward


def _backward(ctx, grad):
    (aux,) = ctx.saved_tensors
    return scale_by(grad, aux), None


scale_by.register_autograd(_backward, setup_context=_setup)


def _step(n: int):
    def f(x):
        return scale_by(x.sin(), make_aux(x.detach(), n)).sum()

    return f


def _run(f, backend):
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    out = (torch.compile(f, backend=backend) if backend is not None else f)(x)
    out.backward()
    return out.detach(), x.grad


def test_a_tensor_traced_on_the_device_but_living_on_the_host_comes_back_to_the_host():
    """The plan offloads the 512-byte "cuda" tensor (it is saved, idle, big enough); at run time it
    is on the host, so its reload returns it there, and the backward reads what eager reads. Before
    the rule, the reload allocated on cuda:0 ("Torch not compiled with CUDA enabled" here; a native
    crash on a GPU)."""
    f = _step(AUX_ELEMENTS)
    backend = fxoffload.backend(policy="all", min_bytes=0, inner="aot_eager", verify_peak=False)
    got = _run(f, backend)
    (report,) = backend.reports
    (row,) = [r for r in report.saved if r.producer == "fxoffload_test.make_aux"]
    assert row.decision == "offload" and row.device.startswith("cuda"), report.table(width=200)
    want = _run(f, None)
    torch.testing.assert_close(got, want)


def test_a_copy_that_costs_more_than_it_frees_is_never_made_even_with_min_bytes_zero():
    """8 bytes, the size of the seed: below ``MIN_COPY_BYTES`` nothing is copied, whatever
    ``min_bytes`` or the policy say, and a user's policy function asking for it is refused too."""
    f = _step(1)
    asked = []

    def offload_everything(t):
        asked.append(t.name)
        return "offload"

    for options in ({"policy": "all"}, {"policy": offload_everything}):
        backend = fxoffload.backend(min_bytes=0, inner="aot_eager", verify_peak=False, **options)
        got = _run(f, backend)
        (report,) = backend.reports
        (row,) = [r for r in report.saved if r.producer == "fxoffload_test.make_aux"]
        assert row.decision == "keep" and row.reason_code == "too_small", row
        assert row.nbytes < MIN_COPY_BYTES
        torch.testing.assert_close(got, _run(f, None))
    assert asked, "the policy function was asked, and its offload refused with the reason"


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_offload_cpu_still_copies_host_tensors_and_brings_them_back(inner):
    """The rule keys on where a tensor lived when offloaded: CPU tensors offloaded on purpose
    (``offload_cpu``) still go through the copy engine and come back as copies."""
    from fxoffload.runtime import transfers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with transfers.track_releases() as tracked:
        loss = torch.compile(model, backend=cpu_backend(inner=inner))(x).square().mean()
        loss.backward()
    assert tracked.count() > 0 and tracked.released() == tracked.count()
