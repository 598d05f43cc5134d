"""What code before a compiled graph holds while it runs (``fxoffload.analysis.outside``): read from the autograd
graph behind the graph's real inputs, counted to the byte, nothing unpacked, and measured on a step."""

import pytest
import torch
import torch.nn as nn

import fxoffload
from fxoffload.sizes import fmt_bytes
from fxoffload.reporting.report import OffloadReport
from fxoffload.analysis.outside import graph_device, read_outside_memory
from fxoffload.runtime import host_buffer_ranges

from .conftest import requires_saved_tensor_reads

pytestmark = requires_saved_tensor_reads

CPU = torch.device("cpu")


def upstream_memory(inputs, device, **kwargs):
    """What code before a graph holds, fxoffload's own host buffers left out (as the backend reads it)."""
    return read_outside_memory(inputs, device, host_buffer_ranges(), **kwargs)


def test_saved_activations_count_parameters_leaves_and_own_inputs_do_not():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)  # a leaf: gradients accumulate into it
    w = nn.Parameter(torch.randn(8, 16))
    frozen = nn.Linear(16, 16).requires_grad_(False)  # saved as weight.t(), a view of a parameter
    h = x @ w  # saves x (a leaf) and w (a parameter): neither counts
    s = h.sigmoid()  # saves its result: 4 x 16 float32 = 256 bytes
    u = s.tanh()  # the same: 256 bytes
    t = frozen(u)  # addmm saves weight.t() only (no gradient for the weight, so not its input)
    assert t.grad_fn._raw_saved_mat2.data._base is frozen.weight  # 1 KiB, a parameter's: not counted
    upstream = upstream_memory([t, w], CPU)
    assert upstream.saved_bytes == 256 + 256
    assert upstream.made_inputs_bytes == 256  # t: made by the code before, in this step
    assert upstream.nodes == 6  # Addmm, Tanh, Sigmoid, Mm, and the two AccumulateGrad
    assert dict(upstream.largest) == {"SigmoidBackward0": 256, "TanhBackward0": 256}
    # The graph's own input is its own: passing s too leaves it out of "outside".
    assert upstream_memory([t, s], CPU).saved_bytes == 256
    # Not on the graph's device: nothing.
    assert upstream_memory([t], torch.device("cuda", 0)).saved_bytes == 0
    assert graph_device([1, t]) == CPU


def test_saved_tensors_behind_hooks_are_read_without_unpacking():
    """A checkpoint's saved tensors are handles (unpacking one would recompute), ``save_on_cpu``'s are
    host copies (unpacking one copies it back): read, neither is unpacked, and a hook's tensor payload
    on the device counts."""
    unpacked = []

    def pack(t):
        return t

    def unpack(t):
        unpacked.append(t)
        return t

    x = torch.randn(4, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        kept = x.exp()  # exp saves its result through the hooks: 256 bytes on the device
    calls = []

    def block(v):
        calls.append(1)
        return v.sin()

    ckpt = torch.utils.checkpoint.checkpoint(block, kept, use_reentrant=False)
    with torch.autograd.graph.save_on_cpu():
        out = ckpt.cos()  # saved as ("cpu", copy): not a tensor, so not counted
    upstream = upstream_memory([out], CPU)
    assert upstream.saved_bytes == 256
    assert not unpacked and calls == [1]  # read only: no unpack hook, no recomputation
    out.sum().backward()  # the graph still works, and now the hooks run
    assert calls == [1, 1] and unpacked


def test_views_of_parameters_and_leaves_are_not_made_in_the_step():
    """An input that is a slice of a parameter (an eager ``table[:10]``) or of a leaf has a grad_fn, but
    its storage was there before the step: not "made"; an op's output is, at the bytes the timeline
    counts for it (the view's, not its storage's)."""
    table = nn.Parameter(torch.randn(1000))
    x = torch.randn(100, requires_grad=True)
    made = (x * 2)[:10]
    upstream = upstream_memory([table[:10], x[:10], made, table], CPU)
    assert upstream.made_inputs_bytes == 10 * 4


def test_fake_inputs_and_storageless_tensors_count_nothing_and_fail_nothing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(4, 4, requires_grad=True).sigmoid()
    assert upstream_memory([fake], CPU) == upstream_memory([], CPU)

    class Wrapper(torch.Tensor):  # a wrapper subclass: no storage of its own to read
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, requires_grad=False)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    x = torch.randn(4, 16, requires_grad=True)
    s = x.sigmoid()  # 256 bytes, still counted beside the unreadable input (tanh saves its own output)
    assert upstream_memory([s.tanh(), Wrapper(torch.randn(2))], CPU).saved_bytes == 256


def test_nothing_before_the_graph_counts_nothing():
    x = torch.randn(4, 8, requires_grad=True)
    upstream = upstream_memory([x, torch.arange(3)], CPU)
    assert (upstream.saved_bytes, upstream.made_inputs_bytes, upstream.largest) == (0, 0, ())


def test_inputs_no_op_made_are_said_to_hold_nothing_without_reading_a_storage(monkeypatch):
    """A model's first graph (parameters and data, no autograd history): its first calls read what
    code before it holds on the host in the step's time (``CallWatch``), so nothing is read where
    nothing can be held. One input an op made (here a view of one) and the storages are read again."""
    import fxoffload.analysis.outside as outside

    reads = []
    real = outside._storage_key
    monkeypatch.setattr(outside, "_storage_key", lambda t: reads.append(t) or real(t))
    params = [nn.Parameter(torch.randn(64, 64)) for _ in range(8)]
    assert upstream_memory([*params, torch.arange(3)], CPU) == outside.OutsideMemory(0, 0, 0)
    assert reads == []
    made = (params[0] * 2)[:4]
    assert upstream_memory([*params, made], CPU).made_inputs_bytes == 4 * 64 * 4
    assert len(reads) >= len(params) + 1


class _EagerFirst(nn.Module):
    """An eager block (``torch.compiler.disable``) before a compiled MLP: like seq2seq's encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(64))
        self.eager = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))

    @torch.compiler.disable
    def before(self, x: torch.Tensor) -> torch.Tensor:
        return self.eager(x + self.shift)  # the add saves nothing: the batch is saved by no one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.before(x)).pow(2).mean()


@pytest.mark.parametrize("options", [{"policy": "none"}, {"policy": "all"}, {"policy": "auto", "memory_budget": 0.95}])
def test_an_eager_block_before_the_graph_is_predicted_with_it(options):
    """The step's measured peak is the graph's predicted peak with what the eager block saved on top
    (CPU allocator events, one thread); a budget is met counting it."""
    from .conftest import measured_steady_step

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _EagerFirst(), torch.randn(64, 64)
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, bandwidth="0.01GB", **options)
    compiled = torch.compile(model, backend=backend)
    measured, caught = measured_steady_step(model, lambda: compiled(x).backward())
    (report,) = backend.reports
    # GELU saves its input (64 x 256 float32), the second Linear GELU's output (the same), the first
    # Linear x + shift (64 x 64). The graph's input is the eager block's output. (Had the block saved
    # the batch x itself, x would count too, though live before the step: a saved tensor does not say
    # whether the step made it.)
    assert report.outside.saved_bytes == 2 * 64 * 256 * 4 + 64 * 64 * 4
    assert report.outside.made_inputs_bytes == 64 * 64 * 4
    # Its parameters (shift, two weights, two biases: no gradients yet, the step zeroes them to None),
    # live before the step: in "outside" and in the start.
    eager_params = sum(p.nbytes for p in (model.shift, *model.eager.parameters()))
    assert report.outside.params_bytes == eager_params == (64 + 2 * 64 * 256 + 256 + 64) * 4
    timeline = report.memory_after or report.memory_before
    assert {p.live["outside"] for p in timeline.points} == {report.outside.held_bytes}
    predicted = timeline.peak_bytes - report.start_bytes
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured, report.summary())
    assert "saved by code before this graph" in report.summary()
    assert OffloadReport.from_json(report.to_json()).outside == report.outside
    assert not backend.outside_seen  # every call holds what the compile saw: nothing said
    if report.memory_budget is not None:
        assert report.offloaded or report.recomputed  # 0.95 of the peak, the eager block in it
        assert not [w for w in caught if "memory_budget" in str(w.message)]  # the plan says it fits
        assert measured + report.start_bytes <= report.memory_budget * 1.03, (measured, report.summary())


class _TwoGraphs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.b = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).pow(2).mean()


@pytest.mark.parametrize("policy", ["none", "all"])
def test_a_graph_after_a_graph_break_holds_what_the_first_kept_on_the_device(policy):
    """The second graph's upstream is what the first compiled graph saved (its ``CompiledFunctionBackward``
    node's tensors): all of it without offloading; with ``all``, only what stayed on the device, the
    host copies (fxoffload's host buffers) left out."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _TwoGraphs(), torch.randn(64, 64)
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, policy=policy)
    torch.compile(model, backend=backend)(x).backward()
    first, second = backend.reports
    assert first.outside.saved_bytes == 0
    # The first graph's saved activations still on the device, and its input x (the batch: it counts
    # though live before the step, a saved tensor does not say); its parameters do not.
    activations = sum(r.nbytes for r in first.saved if r.producer != "placeholder" and r.decision != "offload")
    assert activations == (2 * 64 * 256 * 4 if policy == "none" else 0)
    assert second.outside.saved_bytes == activations + 64 * 64 * 4
    assert second.outside.made_inputs_bytes == 64 * 64 * 4  # h


class _Block(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def test_a_block_compiled_once_and_run_per_layer_is_said_to_hold_more(caplog):
    """Each block compiled on its own: Dynamo compiles the first and runs that graph for the second
    too, whose call holds what the first block saved. The plan counted the first call's; the second
    is read when it runs and said once, with the figures (a log line: no budget to miss)."""
    import logging
    import warnings

    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = nn.Sequential(_Block(), _Block())
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, policy="none")
    for i in range(2):
        blocks[i] = torch.compile(blocks[i], backend=backend)
    x = torch.randn(64, 64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="fxoffload.compiler"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            blocks(x).sum().backward()
    (report,) = backend.reports  # one graph for both blocks
    assert report.outside.saved_bytes == 0  # x is a leaf: the first block's call holds nothing before it
    # The second call holds what the first block saved: GELU's input, the second Linear's input (GELU's
    # output), 64 x 256 float32 each.
    first_saved = sum(r.nbytes for r in report.saved if r.producer != "placeholder")
    assert first_saved == 2 * 64 * 256 * 4
    assert report.kept_bytes == first_saved + 64 * 64 * 4  # and its input: a leaf, read with the parameters
    # And the first block's parameters and x, the leaves its gradients go to, with those gradients
    # (accumulated from the first step on: nothing zeroes them here).
    leaves = sum(t.nbytes for t in (*blocks[0].parameters(), x))
    held = first_saved + 2 * leaves
    assert backend.outside_seen == {report.graph_id: held}
    said = [r.getMessage() for r in caplog.records if "held by code before it" in r.getMessage()]
    assert len(said) == 1, said  # once, though the second block ran three times
    assert f"ran with {fmt_bytes(first_saved + leaves)} held by code before it" in said[0]  # at step 1
    assert "over memory_budget" not in said[0]
    assert not [w for w in caught if "held by code" in str(w.message)]
    assert not report.replans  # nothing to plan again for


class _Blocks(nn.Module):
    """A stem, then four blocks each compiled on its own: one graph, run for all four."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(128, 128)
        self.blocks = nn.ModuleList(_Block(128, 512) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


def _per_block(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Blocks()
    if backend is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    return model


# Budgets the plans made at the blocks' first call miss, and the plans made for all four calls meet.
_BUDGETS = {"aot_eager": int(5.8 * 2**20), "inductor": int(5.4 * 2**20)}


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_block_run_per_layer_is_planned_for_all_its_calls_and_meets_the_budget(inner, caplog):
    """The budget is missed by the plan made at the block's first call. A whole step read, the graph
    is planned again for its first call, where the three later calls' parameters and gradients are
    live in its backward, and its last, where the three earlier calls keep what the plan keeps; from
    the next step on the measured step meets the budget, block 4's call holds what the model said,
    and the gradients match eager code."""
    import logging
    import warnings

    budget = _BUDGETS[inner]
    x = torch.randn(256, 128)
    backend = fxoffload.backend(
        offload_cpu=True, inner=inner, min_bytes=0, policy="auto", memory_budget=budget, verify_peak=False
    )
    model, eager = _per_block(backend), _per_block(None)
    logs = caplog.at_level(logging.INFO, logger="fxoffload.compiler")
    with logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).backward()
    (report,) = backend.reports  # the graph of the four blocks
    (why,) = [r for r in report.replans if r.startswith("at run time")]
    assert "planned for the first and the last call of 4 at once" in why, why
    first, last = report.outside.calls
    block = sum(p.nbytes for p in model.blocks[0].parameters())
    assert (first.repeats, last.repeats) == (0, 3)
    assert first.backward == 3 * block and last.backward == 0  # the later blocks' gradients
    assert report.param_grad_bytes == block
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]  # met: nothing said
    said = [r.getMessage() for r in caplog.records]
    assert any("planned again at run time" in m and "met" in m for m in said)

    # What block 4's call holds before it, read now, is what the model's last call holds.
    held = {}

    def read(_, args):
        held["bytes"] = upstream_memory(args, CPU).held_bytes

    hook = model.blocks[3].register_forward_pre_hook(read)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    hook.remove()
    assert held["bytes"] == last.at("forward", report.kept_bytes)

    model.zero_grad(set_to_none=True)
    measured = fxoffload.measure_memory(lambda: model(x).backward()).cpu.peak_bytes
    # Everything on the device: the start holds every parameter (the graph's own and, in
    # ``upstream``, the other blocks' and the stem's); the batch x was live before the step too, and
    # the model counts it, saved by the stem (a saved tensor does not say the step did not make it).
    step = measured + report.start_bytes + x.nbytes
    predicted = report.expected_memory().peak_bytes  # Inductor's code replayed, else the FX model
    assert step <= budget * 1.03, (fmt_bytes(step), fmt_bytes(budget))
    # To the byte but for the 4-byte loss and Inductor's replay holding the block's output to the end
    # of the step (``codememory``), where this step drops it after the loss's backward.
    output = 256 * 128 * 4 if inner == "inductor" else 0
    assert abs(predicted - step - output) <= 16, (step, predicted)

    torch.manual_seed(1)
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
        m(x).backward()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class _GrowingEager(nn.Module):
    """Eager code before one compiled graph that saves more at each step (one sigmoid more)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.graph = torch.compile(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1)))
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        self.steps += 1
        for _ in range(8 * self.steps):
            h = torch.sigmoid(h)  # saves its 16 KiB output
        return self.graph(h).pow(2).mean()


def test_a_graph_run_once_per_step_is_not_taken_for_calls_in_a_row(caplog):
    """Its calls of two steps are two runs of one call, though the second holds more before it: it
    does not reach the first call's backward node (run, then freed). So no later calls' parameters
    are counted: it is said holding more, as one call."""
    import logging

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _GrowingEager()
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, policy="none")
    model.graph = torch.compile(model.graph._orig_mod, backend=backend)
    x = torch.randn(64, 64)
    with caplog.at_level(logging.WARNING, logger="fxoffload.compiler"):
        for _ in range(4):
            model(x).backward()
    (report,) = backend.reports
    said = [r.getMessage() for r in caplog.records if "held by code before it" in r.getMessage()]
    assert len(said) == 1 and "call 1 of 1 in a row" in said[0], said
    assert "later calls' parameters" not in said[0]


def test_a_block_with_dynamic_shapes_is_not_planned_again_and_says_why():
    import warnings

    backend = fxoffload.backend(
        offload_cpu=True, inner="aot_eager", min_bytes=0, policy="auto", memory_budget="2MiB"
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Blocks()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend, dynamic=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(256, 128)).backward()
    said = [str(w.message) for w in caught if "held by code before it" in str(w.message)]
    assert len(said) == 1 and "not planned again: its shapes are dynamic" in said[0], said
    assert not any(r.replans for r in backend.reports)


def test_a_failed_plan_again_keeps_the_plan_and_the_step(monkeypatch, caplog):
    import logging
    import warnings

    from fxoffload.compiler import watch

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(watch, "_compile_outside_dynamo", fail)
    backend = fxoffload.backend(
        offload_cpu=True, inner="aot_eager", min_bytes=0, policy="auto", memory_budget="3MiB"
    )
    model, eager = _per_block(backend), _per_block(None)
    x = torch.randn(256, 128)
    with caplog.at_level(logging.WARNING, logger="fxoffload.compiler.watch"), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).backward()
    said = [r.getMessage() for r in caplog.records]
    assert any("planning it again failed (no compiler today); its plan is kept" in m for m in said)
    (report,) = backend.reports
    assert not report.replans
    # No compile ran in the failed round: the report's compiles are the first round's alone.
    assert report.timings.spent and {s.round for s in report.timings.spent} == {0}, report.timings.spent
    eager(x).backward()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_reading_stops_at_max_nodes_and_says_so():
    x = torch.randn(4, 16, requires_grad=True)
    h = x
    for _ in range(5):
        h = h.sigmoid()  # five nodes, each saving its 256-byte result
    assert upstream_memory([h], CPU).complete and upstream_memory([h], CPU).nodes == 6
    partial = upstream_memory([h], CPU, max_nodes=3)
    assert not partial.complete and partial.nodes == 3
    assert partial.saved_bytes == 256 * 2  # 3 nodes: the first saves h itself (the graph's), two others
    assert "reading stopped after 3 nodes, more may be held" in partial.summary()


def test_the_watch_stops_reading_after_its_time(monkeypatch):
    from fxoffload.compiler.watch import CallWatch as _UpstreamWatch

    monkeypatch.setattr(_UpstreamWatch, "SECONDS", 0.0)
    torch._dynamo.reset()
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", min_bytes=0, policy="none")
    reads = []
    see = _UpstreamWatch.see

    def counted(self, args):
        reads.append(1)
        return see(self, args)

    monkeypatch.setattr(_UpstreamWatch, "see", counted)
    fn = torch.compile(nn.Linear(8, 8), backend=backend)
    fn(torch.randn(2, 8)).sum().backward()
    assert reads == []  # the call Dynamo compiled for: the compile read its arguments already
    for _ in range(3):
        fn(torch.randn(2, 8)).sum().backward()
    assert reads == [1]  # the second call's read spent the (zero) time: none after it
