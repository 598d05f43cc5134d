"""The memory model against timelines computed by hand."""

import warnings

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxoffload.analysis.graph import is_compute
from fxoffload.analysis.lifetimes import analyze_saved_tensors
from fxoffload.analysis.memory import CallOutside, kept_saved_bytes, simulate, with_plan
from fxoffload.options import OffloadOptions
from fxoffload.planning.budget import off_device
from fxoffload.planning.plan import plan_offloads
from fxoffload.rewrite.transfers import apply_plan
from fxoffload.analysis.outside import OutsideMemory as UpstreamMemory

from .conftest import requires_saved_tensor_reads

aten = torch.ops.aten


def _pair():
    """forward: a = mm(x, p) [1000 B]; b = relu(a) [1000 B, saved]; c = sum(b) [4 B, returned]
    backward: g = mul(t, b) [1000 B, gradient]. p: 400 B parameter, x: 200 B input, t: 4 B tangent."""
    mode = FakeTensorMode()
    with mode:
        vals = {
            "p": torch.empty(10, 10), "x": torch.empty(25, 2), "a": torch.empty(250),
            "b": torch.empty(250), "c": torch.empty(()), "t": torch.empty(()), "g": torch.empty(250),
        }  # fmt: skip

    def node(graph, name, target=None, args=()):
        n = graph.placeholder(name) if target is None else graph.call_function(target, args)
        n.name = name
        n.meta["val"] = vals[name]
        return n

    fg = fx.Graph()
    p, x = node(fg, "p"), node(fg, "x")
    a = node(fg, "a", aten.mm.default, (x, p))
    b = node(fg, "b", aten.relu.default, (a,))
    c = node(fg, "c", aten.sum.default, (b,))
    fg.output((c, b))
    bg = fx.Graph()
    b_in, t = node(bg, "b"), node(bg, "t")
    g = node(bg, "g", aten.mul.Tensor, (t, b_in))
    bg.output((g,))
    return fx.GraphModule({}, fg), fx.GraphModule({}, bg)


def test_hand_computed_timeline():
    """Each point is the moment its node runs: its inputs and its output are alive together, and
    what it was the last reader of dies only after it (the allocator's view, measured on a CPU)."""
    fw, bw = _pair()
    timeline = simulate(fw, bw, num_fwd_outputs=1, static_input_indices=[0])
    assert [(p.phase, p.node, p.total) for p in timeline.points] == [
        ("forward", "p", 400),
        ("forward", "x", 600),
        ("forward", "a", 1600),
        ("forward", "b", 2600),  # relu reads a while it writes b; a dies after it
        ("forward", "c", 1604),
        ("backward", "b", 1600),  # the returned loss is gone; b is still saved
        ("backward", "t", 1604),
        ("backward", "g", 2604),  # mul reads t and b while it writes the gradient; they die after it
    ]
    assert timeline.points[3].live == {
        "parameters": 400, "inputs": 200, "saved": 1000, "transient": 1000, "gradients": 0, "outside": 0,
    }  # fmt: skip
    assert (timeline.peak.phase, timeline.peak.node, timeline.peak_bytes) == ("backward", "g", 2604)
    # What code before the pair saved (an eager encoder's activations) is held at every point.
    held = simulate(fw, bw, num_fwd_outputs=1, static_input_indices=[0], outside=300)
    assert [p.total - 300 for p in held.points] == [p.total for p in timeline.points]
    assert {p.live["outside"] for p in held.points} == {300}


def test_scratch_and_every_output_of_a_multi_output_op_count_while_it_runs():
    """``var_mean`` returns two tensors (its getitem nodes come after it) and, measured, allocates
    scratch of its own: both count at the op's point, and the scratch is gone at the next one."""
    import operator

    mode = FakeTensorMode()
    with mode:
        x_val = torch.empty(100, 10)
        var_mean_val = torch.ops.aten.var_mean.correction(x_val, [1])
    fg = fx.Graph()
    x = fg.placeholder("x")
    x.meta["val"] = x_val
    vm = fg.call_function(aten.var_mean.correction, (x, [1]))
    vm.meta["val"] = var_mean_val
    var, mean = (fg.call_function(operator.getitem, (vm, i)) for i in range(2))
    var.meta["val"], mean.meta["val"] = var_mean_val
    fg.output((var, mean))
    bg = fx.Graph()
    bg.output(())
    fw, bw = fx.GraphModule({}, fg), fx.GraphModule({}, bg)
    timeline = simulate(fw, bw, num_fwd_outputs=2, temporaries={vm: 500})
    assert [(p.node, p.total) for p in timeline.points] == [
        ("x", 4000), ("var_mean_correction", 4000 + 400 + 400 + 500), ("getitem", 4800), ("getitem_1", 4800),
    ]  # fmt: skip


def test_offloaded_tensor_leaves_the_device_between_phases():
    fw, bw = _pair()
    options = OffloadOptions(policy="all", min_bytes=0, offload_cpu=True, prefetch=0)
    plan = plan_offloads(analyze_saved_tensors(fw, bw, 1, [0]), options)
    assert [d.saved.name for d in plan.offloaded] == ["b"]
    apply_plan(fw, bw, plan, prefetch=0)
    timeline = simulate(fw, bw, num_fwd_outputs=1, static_input_indices=[0])
    points = {(p.phase, p.node): p for p in timeline.points}
    forward = [p for p in timeline.points if p.phase == "forward"]
    # b is transient now, alive while its wait runs and released after it; the host copy costs no
    # device memory, so the backward starts with the parameter and the input alone.
    assert forward[-1].node.startswith("wait") and forward[-1].total == 1604 and forward[-1].live["saved"] == 0
    assert timeline.points[len(forward)].total == 600
    reload = next(p for p in timeline.points if p.node.startswith("reload"))
    assert reload.total == 1604  # reload allocates b again just before its use
    assert points[("backward", "g")].total == 2604


def test_inductor_code_replay_agrees_with_the_allocator_and_checks_the_budget():
    """With Inductor the report also replays the code that runs (``compiled_memory``): its peak is
    the measured one (the CPU allocator's events) to within 5%, and a budget that code misses is said
    at compile time, with the figures."""
    import fxoffload
    from fxoffload.planning.budget import budget_verdict
    from fxoffload.testing.models import example

    from .conftest import measured_steady_step

    torch._dynamo.reset()
    model, batch = example("gpt")
    backend = fxoffload.backend(offload_cpu=True, inner="inductor", policy="auto", min_bytes=0, memory_budget=0.7)
    compiled = torch.compile(model, backend=backend)
    measured, caught = measured_steady_step(model, lambda: compiled(*batch).backward())
    (report,) = backend.reports
    replay = report.compiled_memory()
    start = replay.peak.live["parameters"] + replay.peak.live["inputs"]
    assert abs((replay.peak_bytes - start) / measured - 1) < 0.05, (replay.peak_bytes - start, measured)
    assert "peak of Inductor's generated code" in report.summary()
    assert not [w for w in caught if "is not met by the code" in str(w.message)]
    predicted = report.predicted_peak_after
    with pytest.warns(RuntimeWarning, match=r"memory_budget .* is not met by the code Inductor generated: it peaks at"):
        budget_verdict(report.graph_id, replay.peak_bytes // 2, replay, predicted)
    # Missed where the plan itself was over the budget: said so, not laid at Inductor's door.
    with pytest.warns(RuntimeWarning, match=r"the lowest peak the budget's fit reached on the FX graph .*policy=\"all\", may still reach lower") as said:
        budget_verdict(report.graph_id, predicted // 2, replay, predicted)
    assert "Inductor fuses" not in str(said[0].message)
    with pytest.warns(RuntimeWarning, match=r"the plan's peak on the FX graph \(Inductor fuses, reuses"):
        budget_verdict(report.graph_id, replay.peak_bytes // 2, replay, replay.peak_bytes // 2)
    # The plan dropped by verify_peak (its code peaked higher): the code judged is the one without
    # offloading, and the FX model's peak beside it would be the unchanged graph's (a new user's UNet
    # read "against 518.0 KiB, the lowest peak the budget's fit reached", 518.0 KiB being without).
    dropped = "Inductor's code with the plan peaks at 512.4 KiB (...): compiled without offloading (verify_peak)"
    with pytest.warns(RuntimeWarning, match=r"it peaks at .*, without offloading: the budget's plan was dropped, "
                      r"Inductor's code with the plan peaks at 512.4 KiB .*; planned once more") as said:
        budget_verdict(report.graph_id, predicted // 2, replay, predicted, ["once"], dropped=dropped)
    assert "the lowest peak the budget's fit reached" not in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        budget_verdict(report.graph_id, replay.peak_bytes, replay, predicted)


# One memory model: the plan as data (``with_plan`` on the baseline, ``off_device(plan)``) against
# the same model run on the pair the rewrite produced. Rates fixed, so the plans are deterministic.
# The plan and the rewrite come before the inner compiler, so aot_eager's partitions stand for both
# (an Inductor GPT case agreed too, 2026-11-23, and cost 30 s of the suite's 15 min on a cold cache).
# The op calls priced as an accelerator's (none of the compute stream): "auto" offloads on a CPU too.
_RATES = {"compute_rates": {"flops": 1e13, "memory_bandwidth": 1e12}, "min_bytes": "16KiB", "op_time": 0.0}


def _planned_and_rewritten(name, inner, options, upstream=None):
    """The plan and the pair the rewrite made of it, compiled through the compiler itself, told what
    code before the graph holds (``upstream``) where given."""
    from fxoffload.compiler.compile import GraphCompiler
    from fxoffload.compiler.pair import PairRegister
    from fxoffload.options import OffloadOptions
    from fxoffload.testing.models import GPT, GPTConfig, example, gpt_batch

    register = PairRegister()
    compiler = GraphCompiler(register)
    opts = OffloadOptions.from_dict(
        {"offload_cpu": True, "min_bytes": 0, "policy": "all", "verify_peak": False, "inner": inner, **_RATES, **options}
    )

    def backend(gm, example_inputs):
        return compiler.compile(gm, example_inputs, opts, outside=upstream)[0]

    torch._dynamo.reset()
    torch.manual_seed(0)
    if name == "gpt3":
        cfg = GPTConfig(layers=3)
        model, batch = GPT(cfg), gpt_batch(cfg, 8)
    else:
        model, batch = example(name)
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an unreachable budget is not what this tests
        compiled(*batch)
    pair = register.pairs()[-1]
    fw, bw, plan, num_fwd_outputs, static = pair.fw, pair.bw, pair.plan, pair.num_fwd_outputs, pair.static
    planned = with_plan(plan.costs.baseline, off_device(plan), plan.costs.calls, plan.costs.kept)
    # What code around the pair holds with this plan: earlier calls of the same pair keep what its
    # rewritten forward saves on the device.
    outside, later = plan.costs.outside, 0
    if upstream is not None:
        kept = kept_saved_bytes(fw, num_fwd_outputs, static)
        outside, later = upstream.outside(kept), upstream.outside_backward(kept)
    rewritten = simulate(fw, bw, num_fwd_outputs, static, plan.costs.temporaries, outside, later)
    return plan, planned, rewritten, fw, bw


# Planned for two calls of a pair run four times in a row: the first, with 1 MiB of the later calls'
# gradients in its backward, and the last, after three calls that keep what the plan keeps; both
# with 256 KiB of other code.
_REPEATED = UpstreamMemory(0, 0, 0, calls=(CallOutside(2**18, 0, 2**20), CallOutside(2**18, 3)))


@pytest.mark.parametrize(
    "name, inner, options, upstream",
    [
        ("gpt3", "aot_eager", {"policy": "auto", "bandwidth": "1GB", "memory_budget": 0.6}, None),
        # recomputes:
        ("gpt3", "aot_eager", {"policy": "auto", "bandwidth": "1GB", "memory_budget": "4MiB"}, None),
        ("gpt3", "aot_eager", {"policy": "all"}, None),
        ("gpt3", "aot_eager", {"policy": "auto", "bandwidth": "1GB", "memory_budget": 0.6}, _REPEATED),
        ("gpt3", "aot_eager", {"policy": "auto", "bandwidth": "1GB", "memory_budget": "9MiB"}, _REPEATED),
        ("cnn", "aot_eager", {"policy": "auto", "memory_budget": 0.7, "min_bytes": 0}, None),
        ("seq2seq", "aot_eager", {"policy": "all", "min_bytes": 0}, None),
    ],
)
def test_the_plan_as_data_is_the_rewritten_pair(name, inner, options, upstream):
    plan, planned, rewritten, fw, bw = _planned_and_rewritten(name, inner, options, upstream)
    assert plan.offloaded
    if upstream is not None:  # each point holds what the call holding the most there holds
        kept = plan.costs.kept - plan.offloaded_bytes  # the earlier calls hold less with the plan
        for phase in ("forward", "backward"):
            expected = max(2**18 + 3 * kept, 2**18 + (2**20 if phase == "backward" else 0))
            assert {p.live["outside"] for p in planned.points if p.phase == phase} == {expected}
        assert planned.peak.live["outside"] < plan.costs.outside + 3 * plan.offloaded_bytes
    # Same peak, to the byte, and the budget fit's own figure is that peak.
    assert rewritten.peak_bytes == planned.peak_bytes
    if plan.fit_peak is not None:
        assert plan.fit_peak == planned.peak_bytes
    # The same figure at every node that computes (the rewrite's copies and waits come between them;
    # getitems, views and the backward's placeholders allocate nothing and may see a wait a node
    # later), so the model compares plans without rewriting graphs.
    computes = {
        (phase, n.name) for phase, gm in (("forward", fw), ("backward", bw)) for n in gm.graph.nodes if is_compute(n)
    }
    got = {(p.phase, p.node): p.total for p in rewritten.points}
    differ = [
        (p.phase, p.node, p.total, got[(p.phase, p.node)])
        for p in planned.points
        if (p.phase, p.node) in computes and got.get((p.phase, p.node), p.total) != p.total
    ]
    assert not differ, differ[:5]
    assert sum((p.phase, p.node) in got for p in planned.points if (p.phase, p.node) in computes) > 30


@pytest.mark.parametrize(
    "name, options",
    [
        ("mlp", {"policy": "none"}),
        ("gpt", {"policy": "all"}),
        ("cnn", {"policy": "auto"}),
        ("gpt", {"policy": "auto", "bandwidth": "0.01GB", "memory_budget": 0.45}),  # the budget decides
        # Its packed-GRU encoder runs eagerly, before the graph: what it saved is "outside" throughout.
        pytest.param("seq2seq", {"policy": "none"}, marks=requires_saved_tensor_reads),
        pytest.param("seq2seq", {"policy": "all"}, marks=requires_saved_tensor_reads),
        pytest.param(
            "seq2seq", {"policy": "auto", "bandwidth": "0.01GB", "memory_budget": 0.95},
            marks=requires_saved_tensor_reads,
        ),
    ],
)
def test_the_prediction_is_the_measured_peak_with_aot_eager(name, options):
    """aot_eager runs the FX graphs as they are: the memory model's peak is the CPU allocator's, and a
    budget the plan fits is met when measured (CPU, 1 thread). Within bytes when run alone; 1% because
    the convolutions' scratch (measured once per process, ``measure/standalone.py``) was 0.9% off on the CNN
    after other tests had run convolutions in the same process."""
    import fxoffload

    from .conftest import measured_example

    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, **options)
    measured = measured_example(name, backend)
    (report,) = backend.reports
    peak = (report.memory_after or report.memory_before).peak
    start = report.start_bytes  # parameters and inputs live before the step starts
    assert abs((peak.total - start) / measured - 1) < 0.01, (peak.total - start, measured, report.summary())
    if report.memory_budget is not None:
        assert report.offloaded or report.recomputed
        assert measured + start <= report.memory_budget * 1.03, (measured + start, report.summary())


def test_scratch_measured_at_another_thread_count_is_not_reused(monkeypatch):
    """A CPU op's scratch depends on the thread count (oneDNN picks its convolution algorithm per
    thread count), and the figures are shared by every graph of the process: measured at 8 threads
    (as tests that compile at the machine's default thread count leave them), they put the CNN's
    1-thread prediction 1.6% above the measured peak here (most likely why the test above failed for
    the CNN under ``pytest -n 12`` on a 16-core GPU machine). Keyed by thread count, the 1-thread
    step's ops are measured anew."""
    import fxoffload
    from fxoffload.measure import standalone
    from fxoffload.testing.models import example

    from .conftest import measured_example

    monkeypatch.setattr(standalone, "_measured", {})  # this process's earlier figures play no part
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        model, batch = example("cnn")
        backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, policy="auto")
        torch.compile(model, backend=backend)(*batch).backward()  # measures its ops' scratch at 8 threads
    finally:
        torch.set_num_threads(threads)
    torch._dynamo.reset()
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, policy="auto")
    measured = measured_example("cnn", backend)  # compiled and measured at 1 thread
    (report,) = backend.reports
    predicted = (report.memory_after or report.memory_before).peak.total - report.start_bytes
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)
