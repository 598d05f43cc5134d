"""Each host copy in the layout Inductor's forward returns it in (``rewrite.host_layout``).

Inductor lays a convolution's output out channels-last and returns some saved tensors in that
layout, others as traced. A host copy in another layout than the one returned had the forward
restride it on the host after its wait, into a buffer of its own that it saved instead: on a CPU a
device buffer (the tensor never left the device), on a GPU a pageable one that the host writes after
the wait. The built-in CNN under Inductor showed it for its last convolution (``convolution_2``).
"""

import pytest
import torch

import fxoffload
from fxoffload.analysis.output_code import read_offloads
from fxoffload.ir import OFFLOAD, is_transfer
from fxoffload.rewrite.host_layout import wanted_stride
from fxoffload.testing.models import example

BROKEN = "host_copy_in_compilers_layout"


def _cnn_step(amp: bool, broken_rule=None):
    """One training step of the built-in CNN with policy "all" under Inductor: its report, loss, grads."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = example("cnn")
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0, verify_peak=False, broken_rule=broken_rule)
    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
        loss = torch.compile(model, backend=backend)(*batch)
    loss.backward()
    (report,) = backend.reports
    return report, loss.detach(), [p.grad.clone() for p in model.parameters()]


def _saved_at_forward_end(report) -> int:
    """Device bytes of saved tensors the forward's code holds when it returns (its code replayed)."""
    return [p for p in report.compiled_memory().points if p.phase == "forward"][-1].live["saved"]


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_forward_returns_each_host_copy_as_it_is(amp):
    report, loss, grads = _cnn_step(amp)
    assert len(report.offloaded) >= 7
    forward = report.output_code["forward"]
    assert not read_offloads(forward), read_offloads(forward)  # no host code reads a host copy
    # Broken on purpose (the copies in the layout Inductor chose for their sources): the forward
    # restrides the last convolution's host copy into a device buffer it saves instead.
    broken, broken_loss, broken_grads = _cnn_step(amp, BROKEN)
    reads = read_offloads(broken.output_code["forward"])
    assert {name.split(":", 1)[1] for name in reads} == {"convolution_2"}, reads
    conv = next(r for r in report.saved if r.name == "convolution_2")
    # That buffer is the difference in what the forward leaves on the device (fp32: 119,236 B against
    # 643,524 B on CPU, torch 2.13; the conv's output is 512 KiB).
    assert _saved_at_forward_end(broken) - _saved_at_forward_end(report) >= conv.nbytes
    # Both compute what Inductor computes without offloading; with each host copy in the layout
    # Inductor would have returned its source in, the backward runs Inductor's own kernels on the
    # same layouts, to the bit (the last convolution's copy laid out as traced, contiguous, gave
    # gradients 3.5e-6 apart in fp32 and 1.5e-5 under bf16 autocast).
    _, plain_loss, plain_grads = _plain_step(amp)
    for got, want in ((loss, plain_loss), (broken_loss, plain_loss)):
        torch.testing.assert_close(got, want)
    for g, b, want in zip(grads, broken_grads, plain_grads):
        tol = {"rtol": 2e-2, "atol": 2e-2} if amp else {}
        assert torch.equal(g, want), (g - want).abs().max()
        torch.testing.assert_close(b, want, **tol)
    fw = report.graphs[0]
    copies = {n.args[0].name: n.args[4] for n in fw.graph.nodes if is_transfer(n, OFFLOAD)}
    assert copies["convolution_2"] == [16384, 1, 512, 16]  # channels-last, as Inductor returns it


def test_without_inductor_each_host_copy_is_laid_out_as_traced():
    """With ``inner="aot_eager"`` no compiler lays anything out channels-last: each host copy has its
    source's traced layout, and the backward's eager kernels see what they see without offloading.
    (Laid out for Inductor, the convolutions' reloads came back channels-last and the gradients of a
    convolution and batch norm differed by 1e-8.)"""
    grads = {}
    for policy in ("none", "all"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, batch = example("cnn")
        backend = fxoffload.backend(offload_cpu=True, policy=policy, min_bytes=0, inner="aot_eager")
        torch.compile(model, backend=backend)(*batch).backward()
        grads[policy] = [p.grad.clone() for p in model.parameters()]
    fw = backend.reports[0].graphs[0]
    copies = [n for n in fw.graph.nodes if is_transfer(n, OFFLOAD)]
    assert len(copies) >= 7
    for n in copies:
        assert n.args[4] == list(n.args[0].meta["val"].stride()), n.args[0].name
    for got, want in zip(grads["all"], grads["none"]):
        assert torch.equal(got, want), (got - want).abs().max()


def _plain_step(amp: bool):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = example("cnn")
    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
        loss = torch.compile(model, backend="inductor")(*batch)
    loss.backward()
    return None, loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_the_wanted_layout_is_channels_last_only_where_inductor_prefers_it():
    graph = torch.fx.Graph()
    wait = graph.placeholder("wait")
    x = torch.empty(8, 16, 4, 4, device="meta")
    assert wanted_stride(x, wait, {wait}) == [256, 1, 64, 16]  # channels-last
    assert wanted_stride(x, wait, set()) == list(x.stride())  # as traced
    assert wanted_stride(x, wait, None) == list(x.stride())  # Inductor's choice unknown: as traced
    # Inductor would have returned the source channels-last (the last convolution, whose readers
    # Inductor's preference does not reach): so is its host copy.
    source = graph.placeholder("convolution")
    assert wanted_stride(x, wait, {source}, source) == [256, 1, 64, 16]
    assert wanted_stride(x, wait, {wait}, source) == [256, 1, 64, 16]
    assert wanted_stride(x, wait, set(), source) == list(x.stride())
    y = torch.empty(8, 16, device="meta")
    assert wanted_stride(y, wait, {wait}) == [16, 1]  # only 4-D tensors go channels-last
    permuted = torch.empty(8, 4, 4, 16, device="meta").permute(0, 3, 2, 1)  # dense, neither NCHW nor NHWC
    assert wanted_stride(permuted, wait, {wait}) == [256, 1, 64, 16]  # channels-last, as Inductor lays it out
    gappy = torch.empty(8, 16, 4, 8, device="meta")[..., :4]  # not dense: as traced
    assert wanted_stride(gappy, wait, {wait}) == list(gappy.stride())


def test_the_cpu_engine_restrides_a_source_into_the_layout_it_is_given():
    """On the CPU copy engine: the bytes are copied in the source's layout on the copy thread and
    restrided into the host copy's layout where the wait publishes them; the reload returns that
    layout, with the source's values."""
    from fxoffload.runtime import transfers

    src = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    expected = src.clone()
    host = transfers._offload_impl(src, [], 0.0, "test:restride", [60, 20, 5, 1])
    host = transfers._wait_impl(host, src, [])
    assert host.is_contiguous() and torch.equal(host, expected)
    back = transfers._wait_impl(transfers._reload_impl(host, torch.device("cpu"), [], 0.0, "test:restride"), host, [])
    assert back.is_contiguous() and torch.equal(back, expected)


def test_a_padded_source_keeps_its_layout_a_permuted_one_is_restrided():
    """``ir.host_stride``, which the fake function and the run time both follow: a source laid out as
    asked, but padded (Inductor's CUDA buffers), is copied as it is; one whose dimensions are ordered
    otherwise takes the layout asked for."""
    from fxoffload.ir import host_stride

    assert host_stride((4096, 1050), (1056, 1), [1050, 1]) == (1056, 1)  # padded: as it is
    assert host_stride((2, 3, 4, 5), (60, 1, 15, 3), [60, 20, 5, 1]) == (60, 20, 5, 1)  # channels-last: restrided
    assert host_stride((2, 3, 4, 5), (60, 20, 5, 1), [60, 1, 15, 3]) == (60, 1, 15, 3)
    assert host_stride((8, 1, 4), (4, 4, 1), [4, 1, 1]) == (4, 4, 1)  # a size-1 dimension's stride: no matter
    assert host_stride((2, 3), (3, 1), None) == (3, 1)


def test_the_backwards_reloads_take_the_host_copys_layout():
    """The backward's placeholder of each host copy, its reload and the reload's wait carry the layout
    the host copy has (FX values that Inductor's layout constraints read)."""
    from fxoffload.ir import RELOAD, WAIT

    report, _, _ = _cnn_step(False)
    fw, bw = report.graphs
    offloads = {n.args[0].name: n for n in fw.graph.nodes if is_transfer(n, OFFLOAD)}
    assert offloads
    for node in bw.graph.nodes:
        if not is_transfer(node, RELOAD):
            continue
        host = node.args[0]
        (wait,) = [u for u in node.users if is_transfer(u, WAIT)]
        stride = host.meta["val"].stride()
        assert node.meta["val"].stride() == wait.meta["val"].stride() == stride, (host.name, stride)
        assert stride == offloads[host.name.removesuffix("_host")].meta["val"].stride()
