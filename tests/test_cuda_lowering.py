"""Inductor's CUDA lowering, on a machine without a GPU: the wrapper code fxoffload's graphs become
on CUDA (padding included), traced with fake tensors (see fxoffload/testing/cuda_codegen.py).

Where a real GPU is present the lowering tests skip: the fake lowering stubs ``torch.cuda`` and
triton for machines without them and has not been run with the real ones loaded (Inductor would
compile triton kernels and run ``pad_mm``'s benchmarks on the GPU under those stubs). There
``tests/test_cuda.py`` compiles and runs for the device itself. The tests that lower nothing run
everywhere; on torch 2.11's CUDA wheel without a GPU the lowering says it is unavailable (a skip).
"""

import ast
import inspect

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


def test_cuda_code_keeps_kernels_between_copies_and_waits():
    codes, report = _lower(_mlp(1024), torch.randn(4096, 1024))
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


def test_cuda_codegen_touches_no_private_torch_api():
    """Private torch pieces live in fxoffload/_compat.py, so a torch upgrade is one file's work."""
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
