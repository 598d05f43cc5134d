"""Inductor's CUDA lowering, on a machine without a GPU: the wrapper code fxoffload's graphs become
on CUDA (padding included), traced with fake tensors (see fxoffload/testing/cuda_codegen.py).

Where a real GPU is present the lowering tests skip: the fake lowering stubs ``torch.cuda`` and
triton for machines without them and has not been run with the real ones loaded (Inductor would
compile triton kernels and run ``pad_mm``'s benchmarks on the GPU under those stubs). There
``tests/test_cuda.py`` compiles and runs for the device itself. The tests that lower nothing run
everywhere; on torch 2.11's CUDA wheel without a GPU the lowering says it is unavailable (a skip).
"""

import ast
import collections
import functools
import inspect
import re

import pytest
import torch
import torch.nn as nn

import fxoffload
from fxoffload.analysis import output_code as codecheck

OPTIONS = dict(policy="all", min_bytes=0, bandwidth=10e9, compute_rates={"flops": 1e14, "memory_bandwidth": 2e12})


def _lower(model, x):
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device is loaded: the fake CUDA lowering is for machines without one")
    cuda_codegen = pytest.importorskip("fxoffload.testing.cuda_codegen")
    backend = fxoffload.backend(**OPTIONS)
    try:
        codes = cuda_codegen.cuda_wrapper_code(model, (x,), backend)
    except NotImplementedError as e:  # a torch version whose private pieces differ
        pytest.skip(str(e))
    (report,) = backend.reports
    return codes, report


def _mlp(dim):
    return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))


@pytest.mark.parametrize("dim", [1024, 1050], ids=["dense", "padded"])
def test_cuda_code_copies_the_buffer_its_wait_keeps_alive(dim):
    codes, report = _lower(_mlp(dim), torch.randn(4096, dim))
    assert report.offloaded and set(report.output_code) == {"forward", "backward"}
    forward, backward = report.output_code["forward"], report.output_code["backward"]
    assert "empty_strided_cuda" in forward
    if dim == 1050:  # comprehensive padding really happened; the checks below find no copy for our ops
        assert "empty_strided_cuda((4096, 1050), (1056, 1)" in forward
    for kind, code in (("forward", forward), ("backward", backward)):
        transfers = codecheck.transfers(code)
        assert len(transfers) == len(report.offloaded)
        for t in transfers:
            assert t.same_buffer and not t.source_released_early, (kind, t)


def test_cuda_code_keeps_kernels_between_copies_and_waits(monkeypatch):
    """Also: the join of C++ kernel runs (``_compat.scheduler_runs``) estimates no CUDA schedule's
    memory (it has no C++ run to join)."""
    from fxoffload._compat import scheduler_runs

    estimated = []
    real = scheduler_runs._run_peak
    monkeypatch.setattr(scheduler_runs, "_run_peak", lambda *a: estimated.append(1) or real(*a))
    codes, report = _lower(_mlp(1024), torch.randn(4096, 1024))
    assert not estimated
    scheduled = 0
    for kind, fx_code in (("forward", report.fw_code), ("backward", report.bw_code)):
        got = {t.key: t for t in codecheck.transfers(report.output_code[kind])}
        for p in codecheck.transfers(fx_code, kernel=codecheck.is_materialised_call):
            # Guaranteed by the order edge: the first materialised kernel the plan put between them.
            # (Inductor may schedule other independent matmuls, e.g. weight gradients, elsewhere.)
            if p.kernels_between:
                assert got[p.key].kernels_between >= 1 and got[p.key].issued_before_kernel, (kind, got[p.key], p)
                scheduled += 1
    assert scheduled > 0


def test_cuda_code_waits_for_an_offload_after_the_kernels_the_plan_put_behind_it():
    """Inductor's peak-memory reordering ran each offload's wait right after its copy in the CUDA
    code of two blocks (a copy the plan put 11 matmuls behind, over a link priced at 0.1 GB/s, had no
    kernel between it and its wait: the compute stream would wait for the whole copy). Put back
    (``_compat.scheduler_runs.waits_where_planned``), each has at least as many kernels as the plan
    put matmuls there."""
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device is loaded: the fake CUDA lowering is for machines without one")
    cuda_codegen = pytest.importorskip("fxoffload.testing.cuda_codegen")
    model, x = _blocks()
    backend = fxoffload.backend(**{**OPTIONS, "bandwidth": 1e8})
    try:
        cuda_codegen.cuda_wrapper_code(model, (x,), backend)
    except NotImplementedError as e:
        pytest.skip(str(e))
    (report,) = backend.reports
    got = {t.key: t.kernels_between for t in codecheck.transfers(report.output_code["forward"])}
    planned = codecheck.transfers(report.fw_code, kernel=codecheck.is_materialised_call)
    between = [(p.kernels_between, got[p.key]) for p in planned]
    assert max(plan for plan, _ in between) >= 8 and all(code >= plan for plan, code in between), between


def test_cuda_codegen_touches_no_private_torch_api():
    """Private torch pieces live in fxoffload/_compat/, so a torch upgrade is one package's work."""
    cuda_codegen = pytest.importorskip("fxoffload.testing.cuda_codegen")
    tree = ast.parse(inspect.getsource(cuda_codegen))
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            private += [node.module] if node.module.startswith("torch") and "._" in node.module else []
        elif isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.startswith("torch") and "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(ast.unparse(node))  # torch._inductor, module._parameters, ...
    assert private == [], private


def test_a_missing_torch_piece_says_which_and_undoes_the_others(monkeypatch):
    cuda_codegen = pytest.importorskip("fxoffload.testing.cuda_codegen")
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device is loaded: the lowering's pieces are not the stubs this test takes apart")
    real = torch.cuda.is_available, torch.cuda.get_device_properties
    try:  # every piece there before one is taken away (torch 2.11 without a GPU refuses earlier)
        with cuda_codegen.fake_cuda():
            pass
    except NotImplementedError as e:
        pytest.skip(f"a piece before the one this test removes is unavailable: {e}")
    monkeypatch.delattr("torch._inductor.scheduler.has_triton")  # as on a torch without it
    model = _mlp(64)
    with pytest.raises(NotImplementedError) as e:
        cuda_codegen.cuda_wrapper_code(model, (torch.randn(8, 64),), fxoffload.backend(**OPTIONS))
    assert str(e.value) == (
        f"cuda lowering unavailable on torch {torch.__version__}: torch._inductor.scheduler.has_triton is missing"
    )
    # The pieces patched before it (the fake device among them) were undone, the model is untouched.
    assert (torch.cuda.is_available, torch.cuda.get_device_properties) == real
    assert {p.device.type for p in model.parameters()} == {"cpu"}


class _Block(nn.Module):
    """A pre-norm transformer block: layer norms, attention, GELU and residual adds for Inductor to fuse."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def _triton_kernels(code: str) -> collections.Counter:
    """The Triton kernels a wrapper launches, by what they compute: Inductor's name less its index,
    and less "addmm" (Inductor moves a matmul's bias add into the pointwise kernel after it only when
    every reader of the matmul is pointwise; a copy reading it keeps the bias in the matmul)."""
    names = re.findall(r"(triton_\w+)\.run\(", code)
    return collections.Counter(re.sub(r"_\d+$", "", k).replace("_addmm", "") for k in names)


def _blocks():
    torch.manual_seed(0)
    return nn.Sequential(_Block(64), _Block(64)), torch.randn(4, 64, 64, requires_grad=True)


@functools.cache
def _plain_blocks_code() -> tuple[str, ...]:
    """Plain Inductor's CUDA code of ``_blocks()`` (lowered once a worker: both cases compare with it)."""
    from fxoffload.testing import cuda_codegen

    model, x = _blocks()
    return tuple(cuda_codegen.cuda_wrapper_code(model, (x,)))


@pytest.mark.parametrize("broken_rule", [None, "order_edges_on_pointwise"])
def test_transfer_ops_cost_no_triton_kernel(broken_rule):
    """The copies' ops and their ordering edges touch only buffers Inductor materialises anyway, so
    on CUDA the forward and the backward launch the same Triton kernels as without fxoffload: the
    offloads split no fusion and cost no compile. (Inductor's C++ backend does build more kernels:
    it packs consecutive nodes into one C++ function and starts a new one at every extern call.)"""
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device is loaded: the fake CUDA lowering is for machines without one")
    cuda_codegen = pytest.importorskip("fxoffload.testing.cuda_codegen")
    model, x = _blocks()
    try:
        plain = _plain_blocks_code()
        backend = fxoffload.backend(**OPTIONS, broken_rule=broken_rule)
        offloaded = cuda_codegen.cuda_wrapper_code(model, (x,), backend)
    except NotImplementedError as e:
        pytest.skip(str(e))
    (report,) = backend.reports
    assert len(report.offloaded) >= 10 and len(plain) == len(offloaded) == 2
    same = [_triton_kernels(a) == _triton_kernels(b) for a, b in zip(plain, offloaded)]
    assert same == ([True, True] if broken_rule is None else [False, True]), [
        (_triton_kernels(a), _triton_kernels(b)) for a, b in zip(plain, offloaded)
    ]


def test_the_language_model_patches_hold_while_open_and_are_undone_on_exit():
    """``_cuda_compat.language_model_traced_on_meta`` (the scripts that make a GPT's CUDA code on a
    CPU, ``tests/data``): nll_loss's Meta kernel is out and embedding's backward decomposes with
    aten ops while it is open; both as they were after, so no other trace in the process sees them."""
    from torch._decomp import decomposition_table

    from fxoffload.testing._cuda_compat import language_model_traced_on_meta

    nll = torch.ops.aten.nll_loss.default
    accumulate = torch.ops.aten._unsafe_masked_index_put_accumulate.default
    kernels, decomposition = dict(nll.py_kernels), decomposition_table.get(accumulate)
    with language_model_traced_on_meta():
        assert torch._C.DispatchKey.Meta not in nll.py_kernels
        assert decomposition_table[accumulate] is not decomposition
        x = torch.zeros(4, 2)
        out = decomposition_table[accumulate](x, [torch.tensor([1, 1, 9])], torch.tensor([[True], [True], [False]]),
                                              torch.ones(3, 2))  # fmt: skip
        assert out[1].tolist() == [2.0, 2.0] and out.sum() == 4  # masked-out index 9 clamped, adds nothing
    assert nll.py_kernels == kernels and decomposition_table.get(accumulate) is decomposition
