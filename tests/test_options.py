"""Options: validation with clear messages, and the two ways of passing them."""

import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

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
        ({"memory_budget": 1.5}, r"memory_budget=1.5: a float is a fraction of the peak without offloading"),
        ({"bandwidth": {"up": 1}}, r"bandwidth must be a positive number per second or a mapping with keys among d2h, h2d"),
        ({"max_inflight_reloads": 0}, r"max_inflight_reloads must be an int >= 1"),
        ({"offload_cpu": "yes"}, r"offload_cpu must be True or False"),
        ({"mode": "fastest"}, r"mode='fastest' is not valid; choose one of: 'default', 'reduce-overhead'"),
        ({"partitioner": "mine"}, r"partitioner='mine' is not valid; choose one of: 'min_cut', 'default'"),
    ],
)
def test_bad_options_raise_value_error_naming_valid_choices(options, message):
    with pytest.raises(ValueError, match=message):
        fxoffload.backend(**options)


class _Unhashable:
    """A callable policy object that cannot be a dict key (eq without hash)."""

    def __eq__(self, other):
        return self is other

    __hash__ = None

    def __call__(self, t):
        return None

    def __repr__(self):
        return "<unhashable policy>"


# Every option: a wrong type and, where numbers are allowed, a negative or non-finite one. Each message
# names the option and what it accepts.
NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    ({"policy": 1}, r"policy=1 is not valid; choose one of: 'auto', 'all', 'none'"),
    ({"policy": None}, r"policy=None is not valid; choose one of"),
    ({"min_bytes": 1.5}, r"min_bytes must be an int number of bytes or a size string, got float"),
    ({"min_bytes": None}, r"min_bytes must be an int number of bytes or a size string, got NoneType"),
    ({"min_bytes": True}, r"min_bytes must be a number of bytes or a size string, got True"),
    ({"min_bytes": ""}, r"cannot parse min_bytes=''; use an int or a size such as"),
    ({"min_bytes": "-5MB"}, r"min_bytes must not be negative, got '-5MB'"),
    ({"min_bytes": "1.5"}, r"min_bytes='1.5' is not a whole number of bytes; use an int, or a size with a unit"),
    ({"min_bytes": "1.5.3GB"}, r"cannot parse min_bytes='1.5.3GB'"),
    ({"min_bytes": "3 furlongs"}, r"cannot parse min_bytes='3 furlongs'.*kib, mib, gib, tib"),
    ({"verify_peak": "yes"}, r"verify_peak must be True or False, got 'yes'"),
    ({"host_budget": -1}, r"host_budget must be >= 0 bytes, got -1"),
    ({"host_budget": "lots"}, r"cannot parse host_budget='lots'"),
    ({"host_budget": [1]}, r"host_budget must be an int number of bytes or a size string, got list"),
    ({"prefetch": True}, r"prefetch must be None \(cost model\) or an int >= 0 \(graph nodes\), got True"),
    ({"prefetch": 2.0}, r"prefetch must be None \(cost model\) or an int >= 0"),
    ({"memory_budget": 0.0}, r"memory_budget=0.0: a float is a fraction .* must be in \(0, 1\]"),
    ({"memory_budget": -0.5}, r"memory_budget=-0.5: a float is a fraction"),
    ({"memory_budget": NAN}, r"memory_budget=nan: a float is a fraction"),
    ({"memory_budget": -1}, r"memory_budget must be >= 0 bytes, got -1"),
    ({"memory_budget": "half"}, r"cannot parse memory_budget='half'"),
    ({"memory_budget": "0.6"}, r"memory_budget='0.6' is not a whole number of bytes.* a float: 0.6, not '0.6'"),
    ({"memory_budget": "-1GiB"}, r"memory_budget must not be negative, got '-1GiB'"),
    ({"memory_budget": 1}, r"memory_budget=1 means 1 B, under the allocator's smallest block .*1.0 for all of it"),
    ({"memory_budget": "150%"}, r"memory_budget='150%': a percentage of the peak without offloading must be over 0% and at most"),
    ({"memory_budget": "0%"}, r"memory_budget='0%': a percentage of the peak without offloading must be over 0%"),
    ({"memory_budget": "lots%"}, r"cannot parse memory_budget='lots%'; a percentage such as '60%'"),
    ({"recompute": "inductor"}, r"recompute='inductor' says what recomputes to meet a memory_budget, and none"),
    ({"memory_budget": [1]}, r"memory_budget must be an int number of bytes or a size string, got list"),
    ({"strict": "yes"}, r"strict must be True or False, got 'yes'"),
    ({"strict": 1}, r"strict must be True or False, got 1"),
    ({"bandwidth": -1}, r"bandwidth must be a positive, finite number per second, got -1"),
    ({"bandwidth": {"d2h": -1}}, r"bandwidth\['d2h'\] must be a positive, finite number per second, got -1"),
    ({"cpu_link_bandwidth": 0, "offload_cpu": True}, r"cpu_link_bandwidth must be a positive, finite"),
    ({"cpu_link_bandwidth": {"up": 1}, "offload_cpu": True}, r"cpu_link_bandwidth must be a positive number"),
    ({"cpu_link_bandwidth": "1GB"}, r"cpu_link_bandwidth sets the CPU copy engine's speed; it needs offload_cpu=True"),
    ({"bandwidth": 0}, r"bandwidth must be a positive, finite number per second, got 0"),
    ({"bandwidth": NAN}, r"bandwidth must be a positive, finite number per second, got nan"),
    ({"bandwidth": INF}, r"bandwidth must be a positive, finite number per second, got inf"),
    ({"bandwidth": "fast"}, r"cannot parse bandwidth='fast'; a rate is bytes per second: .* such as '25GB/s'"),
    ({"compute_rates": {"flops": "many"}}, r"cannot parse compute_rates\['flops'\]='many'; a rate is FLOP/s"),
    ({"bandwidth": {"h2d": "-1GB"}}, r"bandwidth\['h2d'\] must not be negative, got '-1GB'"),
    ({"bandwidth": {}}, r"bandwidth must be a positive number per second or a mapping with keys among d2h, h2d"),
    ({"bandwidth": [1, 2]}, r"bandwidth must be a positive number per second or a mapping .* got \[1, 2\]"),
    ({"bandwidth": (1, 2)}, r"bandwidth must be a positive number per second or a mapping .* got \(1, 2\)"),
    ({"bandwidth": True}, r"bandwidth must be a positive number per second or a mapping .* got True"),
    ({"compute_rates": 5}, r"compute_rates must be a mapping with keys among flops, memory_bandwidth, got 5"),
    ({"compute_rates": {"flop": 1}}, r"compute_rates must be a mapping with keys among flops, memory_bandwidth"),
    ({"compute_rates": {"flops": -1}}, r"compute_rates\['flops'\] must be a positive, finite number per second"),
    ({"compute_rates": {"flops": NAN}}, r"compute_rates\['flops'\] must be a positive, finite number .* got nan"),
    ({"compute_rates": {"memory_bandwidth": "x"}}, r"cannot parse compute_rates\['memory_bandwidth'\]='x'"),
    ({"max_inflight_reloads": -1}, r"max_inflight_reloads must be an int >= 1, got -1"),
    ({"max_inflight_reloads": "8"}, r"max_inflight_reloads must be an int >= 1, got '8'"),
    ({"max_inflight_reloads": True}, r"max_inflight_reloads must be an int >= 1, got True"),
    ({"max_inflight_reloads": 2.5}, r"max_inflight_reloads must be an int >= 1, got 2.5"),
    ({"calibrate": "yes"}, r"calibrate must be True or False, got 'yes'"),
    ({"op_time": -1e-6}, r"op_time must be None \(measured\) or a number of seconds >= 0, got -1e-06"),
    ({"op_time": True}, r"op_time must be None \(measured\) or a number of seconds >= 0, got True"),
    ({"op_time": NAN}, r"op_time must be None \(measured\) or a number of seconds >= 0, got nan"),
    ({"op_time": "1ms"}, r"op_time must be None \(measured\) or a number of seconds >= 0, got '1ms'"),
    ({"offload_cpu": 1}, r"offload_cpu must be True or False, got 1"),
    ({"offload_cpu": None}, r"offload_cpu must be True or False, got None"),
    ({"inner": None}, r"inner=None is not valid; choose one of: 'inductor', 'aot_eager'"),
    ({"partitioner": 3}, r"partitioner=3 is not valid; choose one of: 'min_cut', 'default'"),
    ({"mode": "reduce_overhead"}, r"mode='reduce_overhead' is not valid; choose one of: 'default', 'reduce-overhead', "
                                  r"'max-autotune', 'max-autotune-no-cudagraphs'"),
    ({"mode": 0}, r"mode=0 is not valid; choose one of"),
    ({"inner": "aot_eager", "mode": "max-autotune"}, r"mode='max-autotune' applies to inner='inductor' only"),
    ({"polcy": "all", "min_byte": 1}, r"unknown option\(s\) 'min_byte', 'polcy'; valid options are: policy, min_bytes"),
    ({"policy": "ALL"}, r"policy='ALL' is not valid; choose one of: 'auto', 'all', 'none', or a function of a saved"),
    ({"policy": _Unhashable()}, r"policy=<unhashable policy> is a callable that cannot be hashed; options are cache keys"),
    ({"offload_modules": "*.mlp.*"}, r"offload_modules must be a tuple of non-empty module path patterns such as "
                                     r"\('\*\.mlp\.\*',\), got '\*\.mlp\.\*'"),
    ({"offload_modules": ("*.mlp.*", "")}, r"offload_modules must be a tuple of non-empty .* got \('\*\.mlp\.\*', ''\)"),
    ({"offload_modules": (3,)}, r"offload_modules must be a tuple of non-empty module path patterns .* got \(3,\)"),
    ({"offload_modules": None}, r"offload_modules must be a tuple .* got None"),
    ({"offload_modules": ("*.mlp.*",), "policy": "none"}, r"offload_modules needs a policy that offloads; policy='none'"),
    ({"recompute": "checkpoint"}, r"recompute='checkpoint' is not valid; choose one of: 'fxoffload', 'inductor'"),
    ({"recompute": "inductor", "partitioner": "default", "memory_budget": 0.5},
     r"recompute='inductor' uses the min-cut .* it needs partitioner='min_cut', got partitioner='default'"),
    ({"max_replans": -1}, r"max_replans must be an int >= 0, got -1"),
    ({"max_replans": 1.5}, r"max_replans must be an int >= 0, got 1.5"),
    ({"broken_rule": "all_of_them"}, r"broken_rule='all_of_them' is not valid; choose one of: 'no_wait_before_use'"),
]


def test_every_option_is_checked():
    """BAD_VALUES covers every field of OffloadOptions (a new option needs its bad values here)."""
    import dataclasses

    covered = {key for options, _ in BAD_VALUES for key in options}
    assert {f.name for f in dataclasses.fields(OffloadOptions)} <= covered


@pytest.mark.parametrize("options, message", BAD_VALUES, ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "")
def test_bad_values_raise_value_error_naming_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        fxoffload.backend(**options)
    with pytest.raises(ValueError, match=message):  # the same check through the options dict
        OffloadOptions.from_dict(options)


def test_bad_mode_through_torch_compile_names_the_choices():
    f = torch.compile(lambda x: x.sin().sum(), backend="fxoffload", mode="fastest")
    with pytest.raises(Exception, match=r"mode='fastest' is not valid; choose one of: 'default'"):
        f(torch.randn(3, requires_grad=True))


def test_valid_rates_are_accepted_in_every_form():
    a = OffloadOptions.from_dict({"bandwidth": 25e9, "compute_rates": {"flops": 1e14, "memory_bandwidth": "2TB"}})
    assert a.bandwidth == (("d2h", 25e9), ("h2d", 25e9))
    assert a.compute_rates == (("flops", 1e14), ("memory_bandwidth", 2e12))
    assert OffloadOptions.from_dict({"bandwidth": {"h2d": "16GB"}}).bandwidth == (("h2d", 16e9),)
    assert a.replace(policy="all").bandwidth == a.bandwidth  # the frozen form validates again


def _my_policy(t):
    return "offload" if t.module_path.endswith("fc") else None


def test_a_policy_function_keeps_options_hashable_and_comparable():
    a = OffloadOptions(policy=_my_policy, offload_modules=["*.mlp.*"])
    assert a.offload_modules == ("*.mlp.*",)  # a list becomes a tuple: hashable
    b = a.replace(min_bytes=0)
    assert b.policy is _my_policy and b.replace(min_bytes=a.min_bytes) == a
    assert {a: 1}[OffloadOptions(policy=_my_policy, offload_modules=("*.mlp.*",))] == 1
    assert OffloadOptions(policy=lambda t: None) != OffloadOptions(policy=lambda t: None)  # two functions
    assert "policy=<function _my_policy at 0x" in repr(a)  # the cache key tells two functions apart
    assert a.policy_name == "_my_policy" and a.base_policy == "auto"
    assert OffloadOptions(policy="all").policy_name == "all"


def test_sizes_parse():
    opts = OffloadOptions.from_dict({"min_bytes": "1.5KiB", "host_budget": "2GB"})
    assert opts.min_bytes == 1536 and opts.host_budget == 2 * 10**9
    assert OffloadOptions.from_dict({"host_budget": "12GiB"}).host_budget == 12 * 2**30
    # A rate as people write one (a new user's "1GB/s" was refused); "/h" is no rate.
    link = {"offload_cpu": True, "cpu_link_bandwidth": "1GB/s"}
    assert OffloadOptions.from_dict(link).cpu_link_bandwidth == (("d2h", 1e9), ("h2d", 1e9))
    assert OffloadOptions.from_dict({"bandwidth": {"h2d": "25 GiB / S"}}).bandwidth == (("h2d", 25.0 * 2**30),)
    with pytest.raises(ValueError, match=r"cannot parse bandwidth='1GB/h'"):
        OffloadOptions.from_dict({"bandwidth": "1GB/h"})
    # A budget as a percentage (a new user's "60%" was refused), and bytes from 512 on.
    assert OffloadOptions.from_dict({"memory_budget": " 60% "}).memory_budget == 0.6
    assert OffloadOptions.from_dict({"memory_budget": 512}).memory_budget == 512


def test_options_dict_through_torch_compile_is_validated():
    """At the first call, as the README says: torch wraps the ValueError, its ``inner_exception``."""
    f = torch.compile(lambda x: x.sin().sum(), backend="fxoffload", options={"bogus": 1})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="unknown option") as raised:
        f(torch.randn(3, requires_grad=True))
    assert isinstance(raised.value.inner_exception, ValueError)


def test_string_backend_takes_options_and_reports():
    before = len(fxoffload.reports())
    f = torch.compile(
        lambda x: (x.sin() * x.cos()).sum(),
        backend="fxoffload",
        options={"offload_cpu": True, "min_bytes": 0, "policy": "all", "inner": "aot_eager",
                 "partitioner": "default"},  # saves sin and cos instead of recomputing them
    )
    x = torch.randn(256, requires_grad=True)  # 1 KiB saved tensors: a copy is worth it from 512 bytes
    f(x).backward()
    torch.testing.assert_close(x.grad, (x.cos() ** 2 - x.sin() ** 2))
    reports = fxoffload.reports()
    assert len(reports) == before + 1
    assert reports[-1].offloaded


def test_report_api():
    backend = fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager")
    f = torch.compile(lambda x: (x.exp() * x.tanh()).sum(), backend=backend)
    f(torch.randn(256, requires_grad=True)).backward()
    (report,) = backend.reports
    table = report.table()
    for row in report.saved:
        assert row.name in table and row.decision in ("offload", "keep") and row.reason
    assert report.offloaded_bytes == sum(r.nbytes for r in report.offloaded) > 0
    code = report.graph_code()
    assert "fxoffload.offload.default" in code and "fxoffload.reload.default" in code


ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


SNIPPET = """
    import torch
    f = torch.compile(lambda x: (x * x.sin()).sum(), backend="fxoffload",
                      options={"inner": "aot_eager"})
    x = torch.randn(8, requires_grad=True)
    f(x).backward()
    print("ok", x.grad.shape)
"""


def _declared_entry_point() -> str:
    """The target pyproject.toml declares for ``backend="fxoffload"`` (its ``torch_dynamo_backends``)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.entry-points.torch_dynamo_backends]", 1)[1].split("\n[", 1)[0]
    (target,) = re.findall(r'^fxoffload\s*=\s*"([^"]+)"', section, re.M)
    return target


def test_backend_name_works_without_importing_fxoffload(tmp_path):
    """torch finds the name through the package's entry point. Run from the tree (``PYTHONPATH=.``,
    as on the H100 machine) the package is not installed and there is none, so the child gets the
    one pyproject.toml declares, in a dist-info on its path as ``pip install`` would write it."""
    env = None
    if not any(ep.name == "fxoffload" for ep in entry_points(group="torch_dynamo_backends")):
        info = tmp_path / "fxoffload_tree-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fxoffload-tree\nVersion: 0\n")
        declared = f"[torch_dynamo_backends]\nfxoffload = {_declared_entry_point()}\n"
        (info / "entry_points.txt").write_text(declared)
        path = [str(tmp_path), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    result = _run(SNIPPET, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok" in result.stdout


def test_backend_name_works_after_importing_fxoffload_first():
    result = _run("import fxoffload\n" + textwrap.dedent(SNIPPET))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "duplicate name" not in result.stderr
