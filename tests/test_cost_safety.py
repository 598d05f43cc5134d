"""The cost model's runs on the user's device are safe: calibration inputs that pass the ops' device-side
checks, and a link probe that is small, runs on the graph's own device, and only when a plan needs it."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fxoffload.analysis import cost
from fxoffload.measure import link, standalone
from fxoffload.analysis.graph import is_compute

from .conftest import requires_cuda

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
    standalone._timed_ops.clear()
    times = standalone.calibrate(gm, torch.device("cpu"), repeats=1)
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
    floats, ints, bools, transposed = (standalone._real(v, torch.device("cpu")) for v in vals)
    assert floats.min() >= 0 and floats.max() < 1 and floats.std() > 0.1
    assert not ints.any() and not bools.any()
    assert transposed.stride() == (1, 5) and transposed.shape == (5, 3)
    # A broadcast (stride 0) layout: values are laid under it, never written through it.
    expanded = standalone._real(torch.empty(4, 1).expand(4, 6), torch.device("cpu"))
    assert expanded.stride() == (1, 0) and ((expanded >= 0) & (expanded < 1)).all()
    half = standalone._real(torch.empty(16, dtype=torch.float8_e4m3fn), torch.device("cpu"))
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
    standalone._timed_ops.clear()
    times = standalone.calibrate(gm, torch.device("cpu"), repeats=1)
    timed = {str(n.target) for n in times}
    assert "aten.add.Tensor" in timed, timed
    for skipped in ("aten._assert_async.default", "aten.multinomial.default", "fxoffload_test.scaled.default",
                    "aten.mul.Tensor"):  # fmt: skip
        assert skipped not in timed, (skipped, timed)  # mul reads an empty tensor
    skipped = [n for n in gm.graph.nodes if is_compute(n) and n not in times and "assert" not in str(n.target)]
    assert skipped and all(cost.node_time(n, cost.CPU_RATES) > 0 for n in skipped), "the model prices them"


ATTENTION_BACKWARDS = (  # each reads its dropout's seed and offset on the host: made up, a segfault
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_efficient_attention_backward", "_flash_attention_backward",
    "_cudnn_attention_backward",
)  # fmt: skip


@pytest.mark.parametrize("op", ATTENTION_BACKWARDS)
def test_an_attention_backward_is_never_calibrated(op):
    """On an H100, calibrating a memory-efficient attention's backward would run it with a made-up
    seed on the device, which it reads on the host. Its forward (no such argument) is still timed."""
    graph = torch.fx.Graph()
    backward = graph.call_function(getattr(aten, op).default, ())
    forward = graph.call_function(aten._scaled_dot_product_efficient_attention.default, ())
    assert not standalone._calibratable(backward)
    assert standalone._calibratable(forward)


@requires_cuda
@pytest.mark.cuda
def test_calibrating_checked_ops_on_cuda_leaves_the_context_usable():
    gm = _graph()
    standalone._timed_ops.clear()
    times = standalone.calibrate(gm, torch.device("cuda", torch.cuda.device_count() - 1), repeats=1)
    torch.cuda.synchronize()  # a device-side assert would surface here, and in every later call
    assert {n.target for n in times} >= CHECKED_OPS
    assert torch.ones(2, device="cuda").sum().item() == 2


# --------------------------------------------------------------------------------------------------
# The link probe
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CPU machine that claims CUDA devices (torch's own switches): records where the probe would
    run, through the probe's ``timer``, and times nothing."""
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
    link.forget_links()
    yield calls, time_link
    link.forget_links()


def test_link_is_measured_on_the_graphs_device_with_little_memory(fake_cuda):
    calls, timer = fake_cuda
    rates = cost.device_rates(torch.device("cuda", 1), link=link.measure_link(torch.device("cuda", 1), timer=timer))
    assert (rates.d2h, rates.h2d) == (25e9, 26e9)
    ((device, nbytes, current),) = calls
    assert device == torch.device("cuda", 1) and current == torch.device("cuda", 1)
    assert nbytes <= 32 << 20
    link.measure_link(torch.device("cuda", 1), timer=timer)
    assert len(calls) == 1, "measured once per device and process"
    link.measure_link(torch.device("cuda", 0), timer=timer)
    assert [c[0] for c in calls] == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_a_bare_cuda_device_is_the_current_one(fake_cuda):
    calls, timer = fake_cuda
    link.measure_link(torch.device("cuda"), timer=timer)
    assert [c[0] for c in calls] == [torch.device("cuda", 2)]


def test_the_model_prices_a_given_link_over_a_measured_one():
    rates = cost.device_rates(torch.device("cuda", 0))
    assert (rates.d2h, rates.h2d) == (cost._DEFAULT_LINK, cost._DEFAULT_LINK)
    rates = cost.device_rates(torch.device("cuda", 0), {"d2h": 1e9, "h2d": 2e9}, link=(25e9, 26e9))
    assert (rates.d2h, rates.h2d) == (1e9, 2e9)
    rates = cost.device_rates(torch.device("cuda", 0), {"d2h": 1e9}, link=(25e9, 26e9))
    assert (rates.d2h, rates.h2d) == (1e9, 26e9), "the direction not given is measured"


@pytest.mark.parametrize(
    "policy, bandwidth, wanted", [("none", None, False), ("all", None, True), ("all", {"d2h": 1e9, "h2d": 1e9}, False)]
)
def test_a_plan_asks_for_a_measured_link_only_when_it_may_offload_and_the_link_is_not_given(policy, bandwidth, wanted):
    """The probe copies on the user's device: only where a plan may offload, on that device."""
    from fxoffload.analysis.lifetimes import analyze_saved_tensors
    from fxoffload.compiler.costs import plan_costs
    from fxoffload.options import OffloadOptions

    from .test_release import _two_device_graphs

    fw, bw, num_outputs = _two_device_graphs(("cuda:1",))
    asked = []
    options = OffloadOptions(policy=policy, bandwidth=bandwidth)
    plan_costs(fw, bw, analyze_saved_tensors(fw, bw, num_outputs, ()), options, num_outputs,
               probe=lambda device: asked.append(device))  # fmt: skip
    assert asked == ([torch.device("cuda", 1)] if wanted else [])


@requires_cuda
@pytest.mark.cuda
def test_link_probe_runs_on_its_device_and_gives_its_memory_back():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    current = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    before, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    others = {i: torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()) if i != device.index}
    link.forget_links()
    d2h, h2d = link.measure_link(device)
    assert d2h > 1e8 and h2d > 1e8
    assert torch.cuda.current_device() == current
    assert torch.cuda.memory_allocated(device) == before, "the probe's buffers are freed"
    assert torch.cuda.max_memory_allocated(device) <= max(peak, before + link.LINK_PROBE_BYTES)
    assert {i: torch.cuda.memory_reserved(i) for i in others} == others, "no other device was touched"


def test_a_failing_probe_says_so_and_the_default_link_is_used(fake_cuda):
    def out_of_memory(device, nbytes):
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert link.measure_link(torch.device("cuda", 0), timer=out_of_memory) is None
    rates = cost.device_rates(torch.device("cuda", 0), link=None)
    assert (rates.d2h, rates.h2d) == (cost._DEFAULT_LINK, cost._DEFAULT_LINK)


@pytest.mark.parametrize("devices, priced", [
    (("cuda:1",), "cuda:1"), (("cpu", "cuda:1"), "cuda:1"), (("cuda:1", "cuda:0"), "cuda:1"), (("cpu",), "cpu"),
])  # fmt: skip
def test_the_graph_is_priced_on_the_device_of_its_saved_tensors(devices, priced):
    """A graph on cuda:1 measures cuda:1's link, whatever device is current while it compiles (fake
    tensors: no GPU needed where CUDA is absent, and a second one where it is present)."""
    from fxoffload.compiler.costs import cost_device
    from fxoffload.analysis.lifetimes import analyze_saved_tensors

    from .test_release import _two_device_graphs

    fw, bw, num_outputs = _two_device_graphs(devices)
    assert cost_device(analyze_saved_tensors(fw, bw, num_outputs, ())) == torch.device(priced)
