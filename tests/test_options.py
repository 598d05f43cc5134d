"""Options: validation with clear messages, and the two ways of passing them."""

import subprocess
import sys
import textwrap

import pytest
import torch

import fxoffload
from fxoffload.options import OffloadOptions


@pytest.mark.parametrize(
    "options, message",
    [
        ({"polcy": "all"}, r"unknown option\(s\) 'polcy'; valid options are: policy, min_bytes"),
        ({"policy": "some"}, r"policy='some' is not valid; choose one of: 'auto', 'all', 'none'"),
        ({"inner": "tvm"}, r"inner='tvm' is not valid; choose one of: 'inductor', 'aot_eager'"),
        ({"min_bytes": "12 parsecs"}, r"cannot parse min_bytes='12 parsecs'.*'800MB'"),
        ({"min_bytes": -1}, r"min_bytes must be >= 0 bytes"),
        ({"host_budget": 1.5}, r"host_budget must be an int number of bytes or a size string, got float"),
        ({"prefetch": -2}, r"prefetch must be None \(cost model\) or an int >= 0"),
        ({"prefetch": "4"}, r"prefetch must be None \(cost model\) or an int >= 0"),
        ({"memory_budget": 1.5}, r"memory_budget=1.5: a float is a fraction of the predicted peak"),
        ({"bandwidth": {"up": 1}}, r"bandwidth must be a mapping with keys among d2h, h2d"),
        ({"max_inflight_reloads": 0}, r"max_inflight_reloads must be an int >= 1"),
        ({"offload_cpu": "yes"}, r"offload_cpu must be True or False"),
        ({"mode": "fastest"}, r"mode='fastest' is not valid; choose one of: 'default', 'reduce-overhead'"),
        ({"partitioner": "mine"}, r"partitioner='mine' is not valid; choose one of: 'min_cut', 'default'"),
    ],
)
def test_bad_options_raise_value_error_naming_valid_choices(options, message):
    with pytest.raises(ValueError, match=message):
        fxoffload.backend(**options)


def test_sizes_parse():
    opts = OffloadOptions.from_dict({"min_bytes": "1.5KiB", "host_budget": "2GB"})
    assert opts.min_bytes == 1536 and opts.host_budget == 2 * 10**9
    assert OffloadOptions.from_dict({"host_budget": "12GiB"}).host_budget == 12 * 2**30


def test_options_dict_through_torch_compile_is_validated():
    f = torch.compile(lambda x: x.sin().sum(), backend="fxoffload", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown option"):
        f(torch.randn(3, requires_grad=True))


def test_string_backend_takes_options_and_reports():
    before = len(fxoffload.reports())
    f = torch.compile(
        lambda x: (x.sin() * x.cos()).sum(),
        backend="fxoffload",
        options={"offload_cpu": True, "min_bytes": 0, "policy": "all", "inner": "aot_eager",
                 "partitioner": "default"},  # saves sin and cos instead of recomputing them
    )
    x = torch.randn(64, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, (x.cos() ** 2 - x.sin() ** 2))
    reports = fxoffload.reports()
    assert len(reports) == before + 1
    assert reports[-1].offloaded


def test_report_api():
    backend = fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager")
    f = torch.compile(lambda x: (x.exp() * x.tanh()).sum(), backend=backend)
    f(torch.randn(32, requires_grad=True)).backward()
    (report,) = backend.reports
    table = report.table()
    for row in report.saved:
        assert row.name in table and row.decision in ("offload", "keep") and row.reason
    assert report.offloaded_bytes == sum(r.nbytes for r in report.offloaded) > 0
    code = report.graph_code()
    assert "fxoffload.offload.default" in code and "fxoffload.reload.default" in code


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


SNIPPET = """
    import torch
    f = torch.compile(lambda x: (x * x.sin()).sum(), backend="fxoffload",
                      options={"inner": "aot_eager"})
    x = torch.randn(8, requires_grad=True)
    f(x).backward()
    print("ok", x.grad.shape)
"""


def test_backend_name_works_without_importing_fxoffload():
    result = _run(SNIPPET)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok" in result.stdout


def test_backend_name_works_after_importing_fxoffload_first():
    result = _run("import fxoffload\n" + textwrap.dedent(SNIPPET))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "duplicate name" not in result.stderr
