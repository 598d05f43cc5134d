"""What runs: checks on the code Inductor generates for the rewritten graphs, not on the FX graph.

Each check reads ``report.output_code`` (Inductor's wrapper code, kept by the backend) with
``fxoffload.codecheck`` and compares it with the plan, read from the FX code handed to Inductor
(``report.fw_code``/``bw_code``): transfers are matched by the forward output they produce and the
backward placeholder they read.
"""

import dataclasses

import pytest
import torch

from fxoffload.analysis import output_code as codecheck
from fxoffload.testing.models import CNN, GPT, MLP, GPTConfig, gpt_batch

from .conftest import cpu_backend


def _mlp():
    return MLP(layers=4), (torch.randn(256, 64),)


def _gpt():
    cfg = GPTConfig(layers=2)
    return GPT(cfg), gpt_batch(cfg, 2)


def _cnn():
    return CNN(), (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))


MODELS = {"mlp": _mlp, "gpt": _gpt, "cnn": _cnn}


def _loss(out):
    return out if out.dim() == 0 else out.float().pow(2).mean()


def compiled_report(model, args, **options):
    """One training step through Inductor; the backend's report, output code included."""
    backend = cpu_backend(inner="inductor", **options)
    compiled = torch.compile(model, backend=backend)
    _loss(compiled(*args)).backward()
    (report,) = backend.reports
    return report


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, args = MODELS[request.param]()
    return request.param, compiled_report(model, args)


def _pairs(report, kind):
    code = codecheck.transfers(report.output_code[kind])
    fx_code = report.fw_code if kind == "forward" else report.bw_code
    plan = codecheck.transfers(fx_code, kernel=codecheck.is_materialised_call)
    got, want = {t.key: t for t in code}, {t.key: t for t in plan}
    # A host copy Inductor lays out again before returning it (a channels-last convolution output,
    # see docs/how-it-works.md, "Layouts") is not returned as it is, so it has no key to match on.
    relaid = [t for t in code if t.kind == "offload" and t.returned_at < 0]
    assert len(got) + len(relaid) - bool(relaid) == len(want)
    assert set(got) - {"output -1"} <= set(want), "every transfer in the generated code was planned"
    return [(got[k], want[k]) for k in want if k in got and k != "output -1"]


def test_every_offloaded_tensor_has_one_copy_and_one_wait_each_way(case):
    _, report = case
    n = len(report.offloaded)
    assert n > 0
    for kind, op in (("forward", "offload"), ("backward", "reload")):
        transfers = codecheck.transfers(report.output_code[kind])
        assert len(transfers) == n and {t.kind for t in transfers} == {op}
        assert all(t.wait_line > t.copy_line for t in transfers)


def test_the_copy_reads_the_buffer_its_wait_keeps_alive(case):
    name, report = case
    for kind in ("forward", "backward"):
        for t in codecheck.transfers(report.output_code[kind]):
            assert t.same_buffer, f"{name} {kind}: copy reads {t.source}, its wait keeps {t.keepalive} alive"
            assert not t.source_released_early, f"{name} {kind}: {t.source} deleted or reused before its wait"


def test_kernels_between_each_copy_and_its_wait_are_those_the_plan_scheduled(case):
    name, report = case
    scheduled = 0
    for kind in ("forward", "backward"):
        for code, plan in _pairs(report, kind):
            # The plan's count is of kernels no compiler can fuse away (matmuls, convolutions,
            # attention); Inductor adds fused pointwise kernels around them, never fewer.
            assert code.kernels_between >= plan.kernels_between, (name, kind, code.key, code, plan)
            if plan.kernels_between:
                scheduled += 1
                assert code.issued_before_kernel, (name, kind, code.key)
    # The CNN's copies are of its 256 KiB activations (its statistics are too small to copy, ``too_small``):
    # at the CPU link's 10 GB/s each is done by the next node, so its plan has no kernel to schedule.
    assert scheduled > 0 or name == "cnn", "the plan put compute between some copies and their waits"


def test_reloads_are_issued_their_planned_distance_ahead_of_the_first_use(case):
    name, report = case
    checked = 0
    for code, plan in _pairs(report, "backward"):
        if plan.kernels_before_use < 0 or code.kernels_before_use < 0:
            continue  # the first use is not a kernel call of its own (e.g. a view then a fallback)
        checked += 1
        assert code.kernels_before_use >= plan.kernels_before_use, (name, code.key, code, plan)
    assert checked > 0


class _Attention(torch.nn.Module):
    """torch's own multi-head attention with dropout: its V, offloaded, is a permute of a select of
    a reshape of a clone that Inductor fuses into the kernel after it, a view it cannot express as
    a view of a buffer, so each op reading it got a copy of its own."""

    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0].square().mean()


def _attention_step(backend):
    """One step of ``_Attention`` compiled with ``backend``: its loss and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Attention(), torch.randn(4, 64, 64)
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    loss = compiled(x)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def _trains_as_inductor(loss, grads):
    expected_loss, expected = _attention_step("inductor")
    torch.testing.assert_close(loss, expected_loss)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_a_view_inductor_copies_for_each_reader_is_copied_once_for_the_copy_and_its_wait(caplog):
    """A user's ``nn.MultiheadAttention`` under ``all`` raised at its first step (the CPU's check of
    a source freed before its wait; on a GPU, memory reused mid-copy): the offload read one copy of
    V, its wait kept another alive. The offload's lowering realizes its source once, in the value
    every later reader gets (``_compat.lowering``); the step trains as Inductor alone does."""
    backend = cpu_backend(inner="inductor")
    with caplog.at_level("WARNING", logger="fxoffload"):
        loss, grads = _attention_step(backend)
    assert "read a buffer their waits do not keep alive" not in caplog.text
    (report,) = backend.reports
    transfers = codecheck.transfers(report.output_code["forward"])
    assert transfers and len(transfers) == len(report.offloaded)
    for t in transfers:
        assert t.same_buffer and not t.source_released_early, t
    _trains_as_inductor(loss, grads)


def test_without_the_one_source_lowering_the_copies_reading_unkept_buffers_are_switched_off(monkeypatch, caplog):
    """The rule broken on purpose: the offload's plain fallback lowering (no cached code: the FX
    graph cache keys on the lowering's source, not on a patch of it). The code then copies V for
    the offload and for its wait apart; the register reads that from the code and switches that
    copy off (the tensor stays on the device), so nothing races and the step trains as Inductor's.
    Without that too, the CPU's check of a source freed before its wait stops the step."""
    from torch._inductor.lowering import lowerings

    from fxoffload import ir
    from fxoffload._compat import lowering
    from fxoffload.compiler import compile, pair
    from fxoffload.runtime import transfers

    lowering.register_fallbacks(compile._TRANSFERS)
    monkeypatch.setattr(transfers, "_off", set())  # what this test switches off, dropped after it
    monkeypatch.setitem(lowerings, ir.OFFLOAD, lowerings[ir.OFFLOAD].__wrapped__)
    monkeypatch.setattr(lowering, "_one_source", lambda lower: lower)
    with torch._inductor.config.patch(fx_graph_cache=False):
        backend = cpu_backend(inner="inductor")
        with caplog.at_level("WARNING", logger="fxoffload"):
            loss, grads = _attention_step(backend)
        (report,) = backend.reports
        unkept = [t for t in codecheck.transfers(report.output_code["forward"]) if not t.same_buffer]
        assert unkept and all(f"copies of {t.name} read a buffer" in caplog.text for t in unkept), caplog.text
        assert set(transfers.copies_switched_off()) >= {t.name for t in unkept}
        _trains_as_inductor(loss, grads)
        # The report says what runs: those tensors kept, counted on the device in every peak.
        rows = {ir.transfer_name(report.graph_id, r.name): r for r in report.saved}
        off = [rows[t.name] for t in unkept]
        assert all(r.decision == "keep" and r.reason_code == "unkept_source" for r in off), off
        assert set(report.switched_off) == {r.name for r in off} and not set(report.switched_off) & {
            r.name for r in report.offloaded
        }
        assert f"copies of {len(off)} tensors" in report.summary() and "does not keep alive" in report.summary()
        (planned,) = backend._register.pairs()
        assert planned.report is report and planned.kept_bytes >= sum(r.nbytes for r in off)
        replayed = [sum(p.total for p in r.compiled_memory().points) for r in (report, dataclasses.replace(report, switched_off=()))]
        assert replayed[0] > replayed[1], replayed
        monkeypatch.setattr(pair, "_unkept_sources", lambda pair, code: ())
        with pytest.raises(RuntimeError, match="released before the copy was waited on"):
            _attention_step(cpu_backend(inner="inductor"))


def test_without_the_order_edges_the_kernel_check_fails():
    """The rule the ``order`` edges keep, broken on purpose: without them Inductor's peak-memory
    reordering slides reloads down to their waits, and the check above fails on the same model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    report = compiled_report(*_mlp(), broken_rule="no_order_edges")
    assert "fxoffload.order" not in report.fw_code + report.bw_code
    short = [code.key for code, plan in _pairs(report, "backward") if code.kernels_between < plan.kernels_between]
    assert short, "with no order edges some reload ends up next to its wait"


def test_codecheck_reads_a_copy_freed_before_its_wait():
    code = (
        "def call(self, args):\n"
        "    buf3 = torch.ops.fxoffload.offload.default(buf2, [buf1], 0.0)\n"
        "    buf4 = buf3\n"
        "    del buf2\n"
        "    extern_kernels.mm(buf5, buf6, out=buf7)\n"
        "    buf8 = torch.ops.fxoffload.wait.default(buf4, buf6, [buf7])\n"
        "    return (buf8, )\n"
    )
    (t,) = codecheck.transfers(code)
    assert t.source_released_early and not t.same_buffer and t.kernels_between == 1 and t.returned_at == 0


def test_a_reload_whose_memory_the_code_reuses_is_found():
    """``reused_reloads``: the reloads whose result (through its wait, ``buf9 = buf8[0]`` or a view)
    Inductor hands on to another buffer, as a buffer reuse or an in-place update: a copy switched off
    at run time could not give its tensor back intact to a second backward there (``watch``)."""
    code = (
        "def call(self, args):\n"
        "    buf1 = torch.ops.fxoffload.reload.default(x_host, device(type='cpu'), [], 0.0, '3:x')\n"
        "    buf2 = buf1\n"
        "    buf3 = torch.ops.fxoffload.reload.default(y_host, device(type='cpu'), [], 0.0, '3:y')\n"
        "    buf4 = torch.ops.fxoffload.wait.default(buf2, x_host, [])\n"
        "    buf5 = torch.ops.fxoffload.wait.default(buf3, y_host, [])\n"
        "    buf6 = reinterpret_tensor(buf4, (16, 16), (16, 1), 0)\n"
        "    cpp_fused_0(buf6, buf5)\n"
        "    buf7 = reinterpret_tensor(buf6, (256, ), (1, ), 0); del buf6  # reuse\n"
        "    buf8 = torch.ops.fxoffload.reload.default(z_host, device(type='cpu'), [], 0.0, '3:z')\n"
        "    del buf5\n"
        "    return (buf7, )\n"
    )
    assert codecheck.reused_reloads(code) == {"3:x"}
    assert codecheck.reused_reloads(code.replace("; del buf6  # reuse", "")) == set()


def test_an_offload_whose_host_copy_the_forward_reads_is_found():
    """``read_offloads``: the offloads whose host copy (through its wait or an alias) a call of the code
    reads. Inductor's forward of a convolution laid out channels-last copies the host copy into the
    contiguous layout the saved tensor was traced with (the code below is cut from one, fuzz seed 2
    case 11): a copy switched off at run time would hand that kernel a handle with no bytes (``watch``)."""
    code = (
        "def call(self, args):\n"
        "    buf7 = torch.ops.fxoffload.offload.default(buf2, [], 50000000.0, '5:convolution')\n"
        "    buf8 = buf7\n"
        "    assert_size_stride(buf8, (s40, 4, 6, 6), (144, 1, 24, 4), 'torch.ops.fxoffload.offload.default')\n"
        "    del buf7\n"
        "    buf9 = torch.ops.fxoffload.wait.default(buf8, buf2, [])\n"
        "    buf10 = buf9\n"
        "    buf11 = empty_strided_cpu((s40, 4, 6, 6), (144, 36, 6, 1), torch.float32)\n"
        "    buf12 = buf2; del buf2  # reuse\n"
        "    cpp_fused_relu_2(buf12, buf10, buf11, s40)\n"
        "    buf14 = torch.ops.fxoffload.offload.default(buf13, [], 50000000.0, '5:getitem_3')\n"
        "    buf18 = torch.ops.fxoffload.wait.default(buf14, buf13, [])\n"
        "    del buf13\n"
        "    return (buf11, buf18, s40, )\n"
    )
    assert codecheck.read_offloads(code) == {"5:convolution"}  # returned as it is: no read
    assert codecheck.read_offloads(code.replace("cpp_fused_relu_2(buf12, buf10, buf11, s40)", "")) == set()
    assert codecheck.reused_reloads(code) == set()  # offloads are not reloads


def test_lines_are_read_for_the_op_they_run_and_the_buffers_they_pass():
    """What ``measure.kernel_times`` lines a trace up with: the op a line names, whether it may launch
    anything, and which lines pass a buffer (or an alias of it) to an op."""
    code = (
        "def call(self, args):\n"
        "    buf0 = empty_strided_cuda((1024, ), (1, ), torch.float32)\n"
        "    stream0 = get_raw_stream(0)\n"
        "    triton_per_fused_sum_0.run(primals_1, buf0, workspace_0, 8192, 1024, stream=stream0)\n"
        "    buf1 = workspace_0[0 * 512 * 1024 : (0 + 1) * 512 * 1024].view(512, 1024).sum(dim=0)\n"
        "    buf2 = reinterpret_tensor(buf0, (32, 32), (32, 1), 0)\n"
        "    extern_kernels.mm(buf2, primals_2, out=buf3)\n"
        "    buf4 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(buf3, buf3, buf3)\n"
        "    buf5 = buf4[0]\n"
        "    buf6 = torch.ops.fxoffload.offload.default(buf5, [], 0.0)\n"
        "    buf7 = buf3; del buf3  # reuse\n"
        "    buf7.copy_(buf5)\n"
        "    assert_size_stride(buf5, (8, ), (1, ))\n"
        "    del buf0\n"
        "    return (buf6, )\n"
    )
    body = codecheck.call_body(code)
    assert [codecheck.op_name(line) for line in body] == [
        None, None, "triton_per_fused_sum_0", None, None, "aten::mm",
        "aten::_scaled_dot_product_cudnn_attention", None, "fxoffload::offload", None, None, None, None, None,
    ]  # fmt: skip
    assert [codecheck.triton_kernel(line) for line in body][2:4] == ["triton_per_fused_sum_0", None]
    assert [i for i, line in enumerate(body) if codecheck.is_kernel(line)] == [2, 3, 5, 6]
    assert [i for i, line in enumerate(body) if codecheck.may_launch(line)] == [2, 3, 5, 6, 8, 10]
    # buf2 and buf5 are aliases of buf0 and buf4 (not buf7: it reuses buf3's memory); our ops are not readers
    assert codecheck.readers(code, "buf0") == [2, 5]
    assert codecheck.readers(code, "buf4") == [10]
    assert codecheck.readers(code, "buf3") == [5, 6]  # an out= too
    assert codecheck.readers(code, "workspace_0") == [2, 3] and codecheck.readers(code, "buf7") == [10]


def test_the_second_pass_of_a_mix_order_reduction_launches_a_kernel():
    """Inductor's mix-order reduction writes partial results into a workspace and reduces them with an
    eager op on the next line (an ``aten::sum`` kernel on the device, 48 lines in the backward of the
    H100 trace of ``tests/test_kernel_times.py``): kernels between a copy and its wait count it."""
    second_pass = "    buf19 = workspace_0[0 * 512 * 1024 : (0 + 1) * 512 * 1024].view(512, 1024).sum(dim=0)"
    assert codecheck.is_kernel(second_pass)
    amax = "    buf2 = workspace_1[0 * 64 * 8 : (0 + 1) * 64 * 8].view(64, 8).amax(dim=0).to(torch.bfloat16)"
    assert codecheck.is_kernel(amax)
    assert not codecheck.is_kernel("    buf5 = buf4[0]") and not codecheck.is_kernel("    buf7 = workspace_0")
    code = (
        "def call(self, args):\n"
        "    buf3 = torch.ops.fxoffload.offload.default(buf2, [buf1], 0.0)\n"
        "    triton_per_fused_0.run(buf2, workspace_0, 8192, 1024, stream=stream0)\n"
        f"{second_pass}\n"
        "    buf8 = torch.ops.fxoffload.wait.default(buf3, buf2, [buf19])\n"
        "    return (buf8, )\n"
    )
    (t,) = codecheck.transfers(code)
    assert t.kernels_between == 2
