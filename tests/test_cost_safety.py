"""The cost model's runs on the user's device are safe: calibration inputs that pass the ops' device-side
checks, and a link probe that is small, runs on the graph's own device, and only when a plan needs it."""

import contextlib
import importlib
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fxoffload import cost
from fxoffload.lifetimes import is_compute

from .conftest import cpu_backend, requires_cuda

aten = torch.ops.aten


def _losses(x, logits, target, weight, ids, idx, probs, labels):
    """Forward and backward of ops whose device code checks index ranges or value ranges."""
    emb = F.embedding(ids, weight)  # ids index the rows of weight
    picked = torch.gather(x, 1, idx)  # idx indexes dim 1 of x
    rows = torch.index_select(x, 0, ids.flatten())
    loss = (
        F.cross_entropy(logits, target)  # class targets: nll_loss
        + F.binary_cross_entropy(probs, labels)  # input and target must lie in [0, 1]
        + emb.sum() + picked.sum() + rows.sum()
    )  # fmt: skip
    return (loss, *torch.autograd.grad(loss, (x, logits, weight, probs)))


def _graph():
    args = (
        torch.randn(8, 16, requires_grad=True),
        torch.randn(8, 10, requires_grad=True),
        torch.randint(0, 10, (8,)),
        torch.randn(20, 4, requires_grad=True),
        torch.randint(0, 20, (2, 3)),
        torch.randint(0, 16, (8, 2)),
        torch.rand(8, requires_grad=True),
        torch.rand(8),
    )
    return make_fx(_losses, tracing_mode="fake")(*args)


CHECKED_OPS = {
    aten.nll_loss_forward.default,
    aten.nll_loss_backward.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default,
    aten.embedding.default,
    aten.embedding_dense_backward.default,
    aten.gather.default,
    aten.index_select.default,
}


def test_calibrating_index_and_range_checked_ops_times_them():
    gm = _graph()
    present = {n.target for n in gm.graph.nodes}
    assert CHECKED_OPS <= present, CHECKED_OPS - present
    cost._timed_ops.clear()
    times = cost.calibrate(gm, torch.device("cpu"), repeats=1)
    timed = {n.target: t for n, t in times.items()}
    for op in CHECKED_OPS:
        assert timed.get(op, 0) > 0, f"{op} was not timed: {timed}"
    # Random inputs of the old kind (normal_) fail binary_cross_entropy's range check on a CPU; on a
    # GPU the same check is a device-side assert that poisons the CUDA context.


def test_calibration_inputs_pass_value_checks():
    fake = make_fx(lambda a, b, c, d: (a + 1, b + 1, c | c, d + 1), tracing_mode="fake")(
        torch.empty(64, 64), torch.empty(4, 4, dtype=torch.int64), torch.empty(8, dtype=torch.bool),
        torch.empty(3, 5).t(),
    )  # fmt: skip
    vals = [n.meta["val"] for n in fake.graph.nodes if n.op == "placeholder"]
    floats, ints, bools, transposed = (cost._real(v, torch.device("cpu")) for v in vals)
    assert floats.min() >= 0 and floats.max() < 1 and floats.std() > 0.1
    assert not ints.any() and not bools.any()
    assert transposed.stride() == (1, 5) and transposed.shape == (5, 3)
    # A broadcast (stride 0) layout: values are laid under it, never written through it.
    expanded = cost._real(torch.empty(4, 1).expand(4, 6), torch.device("cpu"))
    assert expanded.stride() == (1, 0) and ((expanded >= 0) & (expanded < 1)).all()
    half = cost._real(torch.empty(16, dtype=torch.float8_e4m3fn), torch.device("cpu"))
    assert half.dtype == torch.float8_e4m3fn and (half.float() >= 0).all()


@torch.library.custom_op("fxoffload_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_scaled.register_fake
def _(x):
    return torch.empty_like(x)


def test_ops_inputs_cannot_make_safe_keep_the_models_time():
    def f(x, p, mask, e):
        torch._assert_async(mask.any())  # asserts a made-up value on the device
        draws = torch.multinomial(p, 2)  # rows of probabilities must have positive sums
        return torch.ops.fxoffload_test.scaled(x), draws, x + 1, e * 2

    gm = make_fx(f, tracing_mode="fake")(
        torch.randn(8, 8), torch.rand(4, 5), torch.ones(3, dtype=torch.bool), torch.empty(0, 8)
    )
    cost._timed_ops.clear()
    times = cost.calibrate(gm, torch.device("cpu"), repeats=1)
    timed = {str(n.target) for n in times}
    assert "aten.add.Tensor" in timed, timed
    for skipped in ("aten._assert_async.default", "aten.multinomial.default", "fxoffload_test.scaled.default",
                    "aten.mul.Tensor"):  # fmt: skip
        assert skipped not in timed, (skipped, timed)  # mul reads an empty tensor
    skipped = [n for n in gm.graph.nodes if is_compute(n) and n not in times and "assert" not in str(n.target)]
    assert skipped and all(cost.node_time(n, cost.CPU_RATES) > 0 for n in skipped), "the model prices them"


@requires_cuda
@pytest.mark.cuda
def test_calibrating_checked_ops_on_cuda_leaves_the_context_usable():
    gm = _graph()
    cost._timed_ops.clear()
    times = cost.calibrate(gm, torch.device("cuda", torch.cuda.device_count() - 1), repeats=1)
    torch.cuda.synchronize()  # a device-side assert would surface here, and in every later call
    assert {n.target for n in times} >= CHECKED_OPS
    assert torch.ones(2, device="cuda").sum().item() == 2


# --------------------------------------------------------------------------------------------------
# The link probe
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CPU machine that claims CUDA devices: records where the probe would run, times nothing."""
    calls = []
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(torch.device(d))
        yield

    def time_link(device, nbytes):
        calls.append((device, nbytes, entered[-1] if entered else None))
        return 25e9, 26e9

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(cost, "_time_link", time_link)
    monkeypatch.setattr(cost, "_measured_links", {})
    return calls


def test_link_is_measured_on_the_graphs_device_with_little_memory(fake_cuda):
    rates = cost.device_rates(torch.device("cuda", 1), measure=True)
    assert (rates.d2h, rates.h2d) == (25e9, 26e9)
    ((device, nbytes, current),) = fake_cuda
    assert device == torch.device("cuda", 1) and current == torch.device("cuda", 1)
    assert nbytes <= 32 << 20
    cost.device_rates(torch.device("cuda", 1), measure=True)
    assert len(fake_cuda) == 1, "measured once per device and process"
    cost.device_rates(torch.device("cuda", 0), measure=True)
    assert [c[0] for c in fake_cuda] == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert set(cost._measured_links) == {"cuda:0", "cuda:1"}


def test_a_bare_cuda_device_is_the_current_one(fake_cuda):
    cost.device_rates(torch.device("cuda"), measure=True)
    assert [c[0] for c in fake_cuda] == [torch.device("cuda", 2)]
    assert set(cost._measured_links) == {"cuda:2"}


def test_link_is_not_measured_when_not_needed(fake_cuda):
    rates = cost.device_rates(torch.device("cuda", 0), measure=False)
    assert (rates.d2h, rates.h2d) == (cost._DEFAULT_LINK, cost._DEFAULT_LINK)
    rates = cost.device_rates(torch.device("cuda", 0), {"d2h": 1e9, "h2d": 2e9}, measure=True)
    assert (rates.d2h, rates.h2d) == (1e9, 2e9)
    assert not fake_cuda
    rates = cost.device_rates(torch.device("cuda", 0), {"d2h": 1e9}, measure=True)
    assert (rates.d2h, rates.h2d) == (1e9, 26e9), "the direction not given is measured"


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


@pytest.mark.parametrize("policy, wanted", [("none", False), ("all", True)])
def test_backend_asks_for_a_measurement_only_when_it_may_offload(policy, wanted):
    backend_module = importlib.import_module("fxoffload.backend")  # the package's `backend` is a function
    asked = []
    real = backend_module.device_rates

    def spy(device, overrides=None, measure=True):
        asked.append(measure)
        return real(device, overrides, measure=measure)

    with mock.patch.object(backend_module, "device_rates", spy), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.compile(Mlp(), backend=cpu_backend(policy=policy, inner="aot_eager"))(torch.randn(16, 32)).backward()
    assert asked and set(asked) == {wanted}, asked


@requires_cuda
@pytest.mark.cuda
def test_link_probe_runs_on_its_device_and_gives_its_memory_back():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    current = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    before, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    others = {i: torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()) if i != device.index}
    cost._measured_links.pop(str(device), None)
    d2h, h2d = cost.measure_link(device)
    assert d2h > 1e8 and h2d > 1e8
    assert torch.cuda.current_device() == current
    assert torch.cuda.memory_allocated(device) == before, "the probe's buffers are freed"
    assert torch.cuda.max_memory_allocated(device) <= max(peak, before + cost.LINK_PROBE_BYTES)
    assert {i: torch.cuda.memory_reserved(i) for i in others} == others, "no other device was touched"


def test_a_failing_probe_falls_back_to_the_default_link(fake_cuda, monkeypatch):
    def out_of_memory(device, nbytes):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cost, "_time_link", out_of_memory)
    rates = cost.device_rates(torch.device("cuda", 0), measure=True)
    assert (rates.d2h, rates.h2d) == (cost._DEFAULT_LINK, cost._DEFAULT_LINK)


@pytest.mark.parametrize("devices, priced", [
    (("cuda:1",), "cuda:1"), (("cpu", "cuda:1"), "cuda:1"), (("cuda:1", "cuda:0"), "cuda:1"), (("cpu",), "cpu"),
])  # fmt: skip
def test_the_graph_is_priced_on_the_device_of_its_saved_tensors(devices, priced):
    """A graph on cuda:1 measures cuda:1's link, whatever device is current while it compiles (fake
    tensors: no GPU needed)."""
    from fxoffload.backend import cost_device
    from fxoffload.lifetimes import analyze_saved_tensors

    from .test_release import _two_device_graphs

    fw, bw, num_outputs = _two_device_graphs(devices)
    assert cost_device(analyze_saved_tensors(fw, bw, num_outputs, ())) == torch.device(priced)
