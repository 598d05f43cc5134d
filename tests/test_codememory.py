"""codememory.simulate_output_code: Inductor's wrapper code replayed, to the byte on hand-written code and
against the CPU allocator on compiled models."""

import textwrap

import pytest
import torch

import fxoffload
from fxoffload.analysis.code_memory import extern_calls, returned_strides, simulate_forward_code, simulate_output_code
from fxoffload.analysis.output_code import statements
from fxoffload.sizes import span_bytes as storage_bytes
from fxoffload.measure.allocator import track_cpu_frees

from .conftest import measured_example


def wrapper(body: str, get_args: str = "") -> str:
    """A module shaped like Inductor's: ``call`` inside a Runner class, then ``get_args``."""
    body = textwrap.indent(textwrap.dedent(body).strip(), " " * 8)
    args = textwrap.indent(textwrap.dedent(get_args).strip(), " " * 4)
    return f"class Runner:\n    def call(self, args):\n{body}\n\n\ndef get_args():\n{args}\n    return []\n"


def above_start(point) -> int:
    return point.total - point.live["parameters"] - point.live["inputs"]


# A linear layer and a relu: the weight (a parameter) and the input are the caller's; the forward saves
# the weight, the matmul's output and a view of the relu's, and returns a scalar loss.
FW = wrapper(
    """
    primals_1, primals_2 = args
    args.clear()
    assert_size_stride(primals_1, (64, 64), (64, 1), 'input')
    buf0 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
    # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
    extern_kernels.mm(primals_2, primals_1, out=buf0)
    buf1 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
    cpp_fused_relu_0(buf0, buf1)
    buf3 = empty_strided_cpu((), (), torch.float32)
    buf2 = buf1; del buf1  # reuse
    cpp_fused_sum_1(buf2, buf3)
    del primals_2
    return (buf3, primals_1, buf0, reinterpret_tensor(buf2, (64, 8), (1, 64), 0), )
    """,
    """
    primals_1 = rand_strided((64, 64), (64, 1), device='cpu', dtype=torch.float32)
    primals_2 = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.float32)
    """,
)
BW = wrapper(
    """
    primals_1, mm, relu, tangents_1 = args
    args.clear()
    buf0 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
    cpp_fused_threshold_backward_0(relu, tangents_1, buf0)
    del relu
    del tangents_1
    buf1 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    extern_kernels.mm(reinterpret_tensor(buf0, (64, 8), (1, 64), 0), mm, out=buf1)
    del mm
    del buf0
    return (buf1, None, )
    """,
    """
    primals_1 = rand_strided((64, 64), (64, 1), device='cpu', dtype=torch.float32)
    mm = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.float32)
    relu = rand_strided((64, 8), (1, 64), device='cpu', dtype=torch.float32)
    tangents_1 = rand_strided((), (), device='cpu', dtype=torch.float32)
    """,
)


def test_a_step_to_the_byte():
    timeline = simulate_output_code(FW, BW, num_fwd_outputs=1, static_input_indices=(0,))
    fw = [above_start(p) for p in timeline.points if p.phase == "forward"]
    # args, clear, assert, buf0, mm, buf1, relu, buf3, reuse (2 statements), sum, del, return
    assert fw == [0, 0, 0, 2048, 2048, 4096, 4096, 4100, 4100, 4100, 4100, 4100, 4100]
    bw = [above_start(p) for p in timeline.points if p.phase == "backward"]
    # The tangent (4 bytes) is there when the backward starts, besides the loss (4) and the two saved
    # storages (2048 each); the saved weight is the caller's. ``del relu`` frees the relu's storage
    # (the forward's view of it was its last other name), the gradient lives on.
    assert bw == [4104, 4104, 6152, 6152, 4104, 4100, 20484, 20484, 18436, 16388, 16388]
    peak = timeline.peak
    assert peak.phase == "backward"
    assert peak.node.startswith("backward line 6: buf1 = empty_strided_cpu((64, 64)")
    assert peak.live == {
        "parameters": 16384, "inputs": 2048, "saved": 2048, "transient": 2052, "gradients": 16384, "outside": 0,
    }  # fmt: skip


def test_the_forward_alone_is_the_steps_forward():
    """``simulate_forward_code``: the forward's points of the step's replay, from its code alone (what
    ``verify_peak`` judges before lowering a backward), so its peak is a lower bound of the step's."""
    step = simulate_output_code(FW, BW, num_fwd_outputs=1, outside=100)
    forward = simulate_forward_code(FW, [torch.float32] * 3, outside=100)
    assert [p.total for p in forward.points] == [p.total for p in step.points if p.phase == "forward"]
    assert [p.node for p in forward.points] == [p.node for p in step.points if p.phase == "forward"]
    assert forward.peak_bytes < step.peak_bytes
    with pytest.raises(ValueError, match="fw_code: no 'def call"):
        simulate_forward_code("x = 1")


def test_num_fwd_outputs_defaults_to_what_the_backward_does_not_receive():
    assert simulate_output_code(FW, BW) == simulate_output_code(FW, BW, num_fwd_outputs=1)
    fits = r"num_fwd_outputs=3 does not fit: the forward returns 4 values and the backward takes 3 saved"
    with pytest.raises(ValueError, match=fits):
        simulate_output_code(FW, BW, num_fwd_outputs=3)


BW_NOTHING = wrapper(
    """
    tangents_1, = args
    args.clear()
    return (None, )
    """
)


def test_a_fallback_allocates_its_results_sized_by_the_asserts_in_its_first_arguments_dtype():
    fw = wrapper(
        """
        primals_1, primals_2 = args
        args.clear()
        # Topologically Sorted Source Nodes: [native_layer_norm], Original ATen: [aten.native_layer_norm]
        buf0 = torch.ops.aten.native_layer_norm.default(primals_1, [64], primals_2, None, 1e-05)
        buf1 = buf0[0]
        assert_size_stride(buf1, (8, 64), (64, 1), 'torch.ops.aten.native_layer_norm.default')
        buf2 = buf0[2]
        assert_size_stride(buf2, (8, 1), (1, 1), 'torch.ops.aten.native_layer_norm.default')
        del buf0
        del buf2
        buf3 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
        cpp_fused_relu_0(buf1, buf3)
        del buf1
        return (buf3, )
        """,
        """
        primals_1 = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.bfloat16)
        primals_2 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.bfloat16)
        """,
    )
    line = next(st.line for st in statements(fw) if "native_layer_norm.default(" in st.text)
    timeline = simulate_output_code(fw, BW_NOTHING, scratch={("forward", line): 100, ("backward", line): 10**6})
    totals = [above_start(p) for p in timeline.points if p.phase == "forward"]
    # bf16 results: 1024 + 16 bytes, and 100 bytes of scratch while the op runs; element 1 is read by
    # no line (no size known: none counted); ``del buf0`` drops the tuple, buf1 and buf2 stay.
    assert totals == [0, 0, 1140, 1040, 1040, 1040, 1040, 1040, 1024, 3072, 3072, 2048, 2048]
    assert timeline.points[0].live["inputs"] == 1024 + 128
    assert timeline.peak.node == "forward line 10: buf3 = empty_strided_cpu((8, 64), (64, 1), torch.float32)"


def test_the_backward_names_its_buffers_afresh():
    """Names are the wrapper's locals: the backward's ``buf0`` is not the forward's. A bf16 saved
    tensor the backward reuses as ``buf0`` was taken in the forward ``buf0``'s float32, and a fallback
    reading it was sized twice its bytes (a new user's bf16 UNet: +56.9 KB by one line)."""
    fw = wrapper(
        """
        primals_1, = args
        args.clear()
        buf0 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
        cpp_fused_0(primals_1, buf0)
        buf1 = empty_strided_cpu((8, 64), (64, 1), torch.bfloat16)
        cpp_fused_1(buf0, buf1)
        del buf0
        buf2 = empty_strided_cpu((), (), torch.float32)
        cpp_fused_sum_2(buf1, buf2)
        return (buf2, buf1, )
        """,
        "primals_1 = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.float32)",
    )
    bw = wrapper(
        """
        convert, tangents_1 = args
        args.clear()
        buf0 = convert; del convert  # reuse
        # Topologically Sorted Source Nodes: [native_layer_norm], Original ATen: [aten.native_layer_norm]
        buf1 = torch.ops.aten.native_layer_norm.default(buf0, [64], None, None, 1e-05)
        buf2 = buf1[0]
        assert_size_stride(buf2, (8, 64), (64, 1), 'torch.ops.aten.native_layer_norm.default')
        del buf1
        del buf0
        return (None, )
        """,
        """
        convert = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.bfloat16)
        tangents_1 = rand_strided((), (), device='cpu', dtype=torch.float32)
        """,
    )
    timeline = simulate_output_code(fw, bw)
    backward = [above_start(p) for p in timeline.points if p.phase == "backward"]
    assert max(backward) == backward[0] + 1024, backward  # its result in bf16 (2048 bytes in float32)


def test_an_extern_kernel_into_an_out_buffer_counts_its_scratch_at_its_line():
    """``extern_kernels.mm(..., out=buf0)`` allocates nothing the code shows; its scratch (a bf16
    matmul's oneDNN buffers on a CPU with bf16 units) counts at its line, in its graph, and nowhere
    else: the backward's line 5 is another statement."""
    plain = simulate_output_code(FW, BW)
    scratched = simulate_output_code(FW, BW, scratch={("forward", 5): 5000})
    diffs = [(b.node, above_start(b) - above_start(a)) for a, b in zip(plain.points, scratched.points)]
    assert [d for d in diffs if d[1]] == [("forward line 5: extern_kernels.mm(primals_2, primals_1, out=buf0)", 5000)]


def test_extern_calls_name_the_layouts_the_code_gives_their_operands():
    """What running a call alone takes: ``get_args`` gives the arguments' layouts, ``empty_strided``
    a buffer's, an alias its base's, ``assert_size_stride`` a fallback's result's (here in bf16, its
    first argument's dtype); a ``reinterpret_tensor`` in the call's text stays text, over its base.
    Only fallback and extern kernel calls are listed, with their line in ``call``."""
    code = wrapper(
        """
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((2, 8, 4, 4), (128, 1, 32, 8), torch.bfloat16)
        cpp_fused_0(primals_1, buf0)
        buf1 = buf0; del buf0  # reuse
        buf2 = torch.ops.aten.convolution_backward.default(buf1, primals_2, primals_2, [8], (1, 1), (0, 0), (1, 1), False, (0, 0), 1, [True, True, False])
        buf3 = buf2[0]
        assert_size_stride(buf3, (2, 8, 4, 4), (128, 1, 32, 8), 'torch.ops.aten.convolution_backward.default')
        buf4 = empty_strided_cpu((8, 8), (8, 1), torch.bfloat16)
        extern_kernels.mm(reinterpret_tensor(buf3, (8, 32), (1, 8), 0), reinterpret_tensor(buf1, (32, 8), (8, 1), 0), out=buf4)
        return (buf4, )
        """,
        """
        primals_1 = rand_strided((2, 8, 4, 4), (128, 16, 4, 1), device='cpu', dtype=torch.float32)
        primals_2 = rand_strided((8, 8, 1, 1), (8, 1, 8, 8), device='cpu', dtype=torch.bfloat16)
        """,
    )
    calls = extern_calls(code)
    assert [(c.line, c.op) for c in calls] == [
        (5, "torch.ops.aten.convolution_backward.default"), (9, "extern_kernels.mm")
    ]  # fmt: skip
    channels_last = ((2, 8, 4, 4), (128, 1, 32, 8), torch.bfloat16)
    assert calls[0].operands == {"buf1": channels_last, "primals_2": ((8, 8, 1, 1), (8, 1, 8, 8), torch.bfloat16)}
    assert calls[1].operands == {"buf3": channels_last, "buf1": channels_last, "buf4": ((8, 8), (8, 1), torch.bfloat16)}
    assert calls[1].args.startswith("reinterpret_tensor(buf3, (8, 32), (1, 8), 0), ")
    with pytest.raises(ValueError, match="the size 's0' is symbolic"):
        extern_calls(code.replace("(2, 8, 4, 4), (128, 1, 32, 8), torch.bfloat16", "(s0, 8, 4, 4), (128, 1, 32, 8), torch.bfloat16"))


def test_a_forwards_output_strides_as_its_code_lays_them_out():
    """``returned_strides``: what Inductor tells AOTAutograd of a forward it compiled, read from the code
    (a code-only lowering tells it from here): a buffer's ``empty_strided``, an argument's
    ``get_args``, a view's ``reinterpret_tensor``; nothing for code with symbolic sizes."""
    assert returned_strides(FW) == [(), (64, 1), (64, 1), (1, 64)]
    assert returned_strides(FW.replace("empty_strided_cpu((8, 64)", "empty_strided_cpu((s0, 64)")) == []


def test_offload_is_host_memory_reload_allocates_and_wait_aliases():
    fw = wrapper(
        """
        primals_1, = args
        args.clear()
        buf0 = empty_strided_cpu((8, 64), (64, 1), torch.float16)
        cpp_fused_relu_0(primals_1, buf0)
        buf1 = torch.ops.fxoffload.offload.default(buf0, [], 0.0)
        buf2 = buf1
        assert_size_stride(buf2, (8, 64), (64, 1), 'torch.ops.fxoffload.offload.default')
        buf3 = torch.ops.fxoffload.wait.default(buf2, buf0, [])
        buf4 = buf3
        del buf0
        return (buf4, )
        """,
        "primals_1 = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.float16)",
    )
    bw = wrapper(
        """
        relu_host, tangents_1 = args
        args.clear()
        buf0 = torch.ops.fxoffload.reload.default(relu_host, device(type='cpu'), [], 0.0)  # a comment
        buf1 = buf0
        assert_size_stride(buf1, (8, 64), (64, 1), 'torch.ops.fxoffload.reload.default')
        buf2 = torch.ops.fxoffload.wait.default(buf1, relu_host, [])
        buf3 = buf2
        del buf0
        del buf1
        cpp_fused_threshold_backward_0(buf3, tangents_1)
        del buf2
        del buf3
        return (None, )
        """,
        """
        relu_host = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.float16)
        tangents_1 = rand_strided((8, 64), (64, 1), device='cpu', dtype=torch.float16)
        """,
    )
    timeline = simulate_output_code(fw, bw, num_fwd_outputs=0)
    fw_totals = [above_start(p) for p in timeline.points if p.phase == "forward"]
    assert fw_totals == [0, 0, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 0, 0]
    bw_totals = [above_start(p) for p in timeline.points if p.phase == "backward"]
    # the tangent (1024) from the start; the reload's destination (1024, fp16 like its host source)
    # until the last of its four names goes
    assert bw_totals == [1024, 1024] + [2048] * 9 + [1024, 1024]


def test_storage_spans_and_symbolic_sizes():
    assert storage_bytes((8, 64), (1, 8), torch.float32) == 2048
    assert storage_bytes((8, 4, 64, 1), (256, 64, 1, 2048), torch.float32) == 8192
    assert storage_bytes((8, 64), (64 * 2, 1), torch.bfloat16) == (7 * 128 + 63 + 1) * 2  # a padded row
    assert storage_bytes((0, 64), (64, 1), torch.float32) == 0
    with pytest.raises(ValueError, match=r"size \(8,\) and stride \(64, 1\) must have the same length"):
        storage_bytes((8,), (64, 1), torch.float32)

    fw = wrapper(
        """
        primals_1, = args
        buf0 = empty_strided_cpu((s0, 64), (64, 1), torch.float32)
        buf1 = empty_strided_cpu((2*s0 + 1, ), (1, ), torch.int64)
        return (buf0, )
        """
    )
    timeline = simulate_output_code(fw, BW_NOTHING, symbols={"s0": 8})
    assert timeline.peak_bytes == 8 * 64 * 4 + 17 * 8
    symbolic = r"the size 's0' is symbolic; pass its value in symbols= \(known: none\)"
    with pytest.raises(ValueError, match=symbolic):
        simulate_output_code(fw, BW_NOTHING)


def test_code_without_a_call_function_is_refused():
    with pytest.raises(ValueError, match=r"bw_code: no 'def call\(...\)' with statements found"):
        simulate_output_code(FW, "def forward(self, x):\n    return (x,)\n")
    bad = FW.replace("torch.float32)\n        # Topo", "torch.floaty)\n        # Topo")
    with pytest.raises(ValueError, match=r"'torch.floaty' is not a torch dtype"):
        simulate_output_code(bad, BW)


def _measured_and_predicted(name: str, policy: str) -> tuple[int, int, int]:
    """CPU allocator's peak of a steady step above its start; the wrapper code's and the FX model's."""
    backend = fxoffload.backend(offload_cpu=True, inner="inductor", policy=policy, min_bytes=0)
    measured = measured_example(name, backend)
    (report,) = backend.reports
    timeline = report.compiled_memory()  # with its calls' scratch, measured on the code's layouts
    fx_timeline = report.memory_after or report.memory_before
    return measured, above_start(timeline.peak), above_start(fx_timeline.peak)


# With a plan (GPT, seq2seq's decoder): tests/test_no_cost.py, on the same steps it measures.
# torch 2.11's convolution_backward copies a 512 KiB operand to a contiguous one inside the kernel
# (aten::contiguous under aten::convolution_backward; torch 2.13 does not): the wrapper code cannot
# show it, its call measured alone on the code's layouts does (``costs.code_scratch``).
@pytest.mark.parametrize("name, policy", [("mlp", "none"), ("cnn", "none")])
def test_predicted_within_5_percent_of_the_cpu_allocator(name, policy):
    track_cpu_frees()  # frees of blocks from before the step count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # allocation order does not depend on the thread count then
    try:
        measured, predicted, fx_predicted = _measured_and_predicted(name, policy)
    finally:
        torch.set_num_threads(threads)
    # CPU, 1 thread, measured / replayed: mlp 562184 / 562180, cnn 3424688 / 3424684 on torch 2.13 and
    # 3948976 / 3948972 on 2.11 (3406188 on both, 0.5% and 14% low, before the calls' scratch counted),
    # gpt 7848968 / 7848964; the FX model said 569088, 3287656 and 8209408.
    assert abs(predicted / measured - 1) < 0.01, (name, policy, measured, predicted, fx_predicted)


def test_a_convolutions_scratch_is_measured_on_the_layouts_inductor_runs(monkeypatch):
    """oneDNN's convolution backward on channels-last operands holds its weight gradient's buffer and
    dense copies inside the call. The replay counts each call's scratch measured alone on the layouts
    the code gives it (``costs.code_scratch``): to 4 bytes of the CPU allocator here (272084 measured,
    272080 replayed, torch 2.13, 1 thread). Not measured (broken on purpose), the replay is 13.6%
    low (235088), as it was 11% low on a new user's UNet."""
    from fxoffload.compiler import pair

    from .conftest import ConvStack, measured_steady_step

    def replayed() -> tuple[int, int]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = ConvStack(), torch.randn(2, 3, 16, 16)
        backend = fxoffload.backend(offload_cpu=True, policy="none", min_bytes=0)
        compiled = torch.compile(model, backend=backend)
        measured, _ = measured_steady_step(model, lambda: compiled(x).backward())
        (report,) = backend.reports
        return measured, report.compiled_memory().peak_bytes - report.start_bytes

    measured, predicted = replayed()
    assert abs(predicted / measured - 1) < 0.005, (predicted, measured)
    monkeypatch.setattr(pair, "code_scratch", lambda code, costs: ())
    measured_unscratched, predicted = replayed()
    assert measured_unscratched == measured and predicted < 0.95 * measured, (predicted, measured)


def test_the_fx_model_counts_what_the_code_without_offloading_showed(monkeypatch):
    """Where a graph's code without offloading was lowered before its plan (a fractional budget), what
    it showed that the FX graphs do not is in the FX model of the plan (``memory.CodeFacts``): its
    calls' scratch on the code's layouts, at the nodes that run them (each call's node found from
    Inductor's "Source Nodes" comment; in the forward, the names the nodes came from), and the
    channels-last copies of the convolutions' weights its forward saves. The ConvStack's model is
    then within 1% of the code's replay (308760 against 308764 bytes, torch 2.13). Not carried
    (broken on purpose), it is 10% or more under it."""
    from fxoffload.analysis.graph import op_name
    from fxoffload.analysis.memory import CodeFacts, code_scratch_nodes
    from fxoffload.compiler.pair import PlannedPair

    from .conftest import ConvStack

    def planned():
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = fxoffload.backend(offload_cpu=True, memory_budget=0.9, min_bytes=0)
        torch.compile(ConvStack(), backend=backend)(torch.randn(2, 3, 16, 16)).backward()
        ((_, unchanged),) = backend._compiler._unchanged_code.values()
        (pair,) = backend._register.pairs()
        return unchanged, pair, (pair.plan.partition_costs or pair.plan.costs)

    unchanged, pair, costs = planned()
    facts = unchanged.code_facts()
    assert costs.code == facts
    assert {(phase, op) for phase, op, _, _ in facts.calls} == {("forward", "convolution"), ("backward", "convolution_backward")}
    on_nodes = code_scratch_nodes(facts.calls, pair.fw, pair.bw)
    assert len(on_nodes) == len(facts.calls), (facts.calls, on_nodes)  # every call placed
    assert {op_name(n) for n in on_nodes} == {"convolution", "convolution_backward"}
    transient = {(p.phase, p.node): p.live["transient"] for p in pair.memory_before.points}
    for node, nbytes in on_nodes.items():
        phase = "forward" if node.graph is pair.fw.graph else "backward"
        assert transient[phase, node.name] >= nbytes, (node, nbytes)
    # The 3x3 convolutions' weights and the image, copied channels-last and saved.
    shapes = {n.name: tuple(n.meta["val"].shape) for n in pair.fw.graph.find_nodes(op="placeholder")}
    copied = sorted(shapes[name] for name in facts.copied_inputs)
    assert copied == [(2, 3, 16, 16), (16, 3, 3, 3), (16, 16, 3, 3), (32, 16, 3, 3)], copied
    code_peak = unchanged.code_memory().peak_bytes
    assert abs(pair.memory_before.peak_bytes / code_peak - 1) < 0.01, (pair.memory_before.peak_bytes, code_peak)
    monkeypatch.setattr(PlannedPair, "code_facts", lambda self: CodeFacts())
    _, without, costs = planned()
    assert costs.code == CodeFacts()
    assert without.memory_before.peak_bytes < 0.9 * code_peak, (without.memory_before.peak_bytes, code_peak)


def test_a_calls_scratch_goes_to_the_one_source_node_that_runs_its_op():
    """``memory.code_scratch_nodes``: a call's node is the one of its source nodes (as Inductor names
    them: the node a forward node came from, else its own name) that runs the call's op; a call whose
    names find none, or two, is left out rather than put on a guess."""
    import types

    import torch.fx as fx

    from fxoffload.analysis.memory import code_scratch_nodes

    def graph(*nodes):
        g = fx.Graph()
        x = g.placeholder("x")
        made = {}
        for name, target, origin in nodes:
            n = made[name] = g.call_function(target, (x,))
            n.name = name
            if origin:
                n.meta["from_node"] = [types.SimpleNamespace(name=origin)]
        g.output(tuple(made.values()))
        return fx.GraphModule(torch.nn.Module(), g), made

    aten = torch.ops.aten
    fw, f = graph(("convolution", aten.convolution.default, "conv2d"), ("relu", aten.relu.default, "conv2d"),
                  ("mm", aten.mm.default, "linear"), ("mm_1", aten.mm.default, "linear"))  # fmt: skip
    bw, b = graph(("convolution_backward", aten.convolution_backward.default, None), ("mul", aten.mul.Tensor, None))
    calls = (
        ("forward", "convolution", ("conv2d",), 100),  # the node conv2d became, not its relu
        ("forward", "mm", ("linear",), 7),  # two mm nodes came from linear: no guess
        ("backward", "convolution_backward", ("mul", "convolution_backward"), 300),
        ("backward", "convolution_backward", ("convolution",), 5),  # a forward name, in the backward
        ("forward", "convolution", ("convolution",), 9),  # its own name is not what Inductor says
    )
    assert code_scratch_nodes(calls, fw, bw) == {f["convolution"]: 100, b["convolution_backward"]: 300}


def test_the_inputs_inductors_code_saves_as_channels_last_copies_are_predicted_for_a_partition_not_lowered():
    """``memory.layout_copies``: the forward's saved placeholders Inductor's layout optimization lays
    out channels-last are saved as copies of its own, and the model predicts which for a partition
    whose code it has not seen. Under bf16 autocast a partition that recomputes the convolutions'
    bf16 weight casts in the backward saves the fp32 weights instead, and Inductor's forward returns
    channels-last copies of them: the rule names the same placeholders the code returns copies of
    (``PlannedPair.code_facts``), in fp32 as without autocast. (Unseen, a budget's fit took that
    recomputation for a saving: on a small UNet at 80% it doubled the weights' saved bytes and the
    code missed the budget by 19%.)"""
    from fxoffload.analysis.memory import layout_copies

    from .conftest import ConvStack

    def pair_of(amp, policy):
        torch._dynamo.reset()
        torch.manual_seed(0)
        # The plan kept whatever its code's peak: on a CPU with AMX (an Intel Xeon, 2026-12-02) the
        # recomputing partition's code peaked 3.1 KiB above the code without it, and verify_peak undid it.
        backend = fxoffload.backend(offload_cpu=True, policy=policy, min_bytes=0, verify_peak=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = torch.compile(ConvStack(), backend=backend)(torch.randn(2, 3, 16, 16))
        loss.float().backward()
        (pair,) = backend._register.pairs()
        return pair

    def weight_casts(t):
        return "recompute" if t.producer == "prims.convert_element_type" and len(t.shape) == 4 and t.shape[-1] == 3 else None

    for amp, policy in ((True, weight_casts), (False, "none")):
        pair = pair_of(amp, policy)
        assert amp == bool(pair.plan.recomputed), pair.report.table()
        shapes = {n.name: tuple(n.meta["val"].shape) for n in pair.fw.graph.find_nodes(op="placeholder")}
        copied = pair.code_facts().copied_inputs
        assert sorted(shapes[n] for n in copied if shapes[n][-1] == 3) == [(16, 3, 3, 3), (16, 16, 3, 3), (32, 16, 3, 3)]
        assert sorted(layout_copies(pair.fw, pair.num_fwd_outputs)) == sorted(copied), amp
