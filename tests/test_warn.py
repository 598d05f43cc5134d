"""fxoffload's warnings are said at the user's line (``fxoffload.warn``), not inside the compiler."""

import inspect
import runpy
import warnings

import pytest
import torch

import fxoffload
from fxoffload.warn import warn


def test_a_budget_not_met_is_said_at_the_line_that_ran_the_compiled_model():
    """Said at compile time, deep in torch.compile's frames: it pointed at fxoffload/compiler/ before."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    backend = fxoffload.backend(offload_cpu=True, min_bytes=0, memory_budget="1KiB", inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    with pytest.warns(RuntimeWarning, match="memory_budget 1.0 KiB cannot be reached") as said:
        line = inspect.currentframe().f_lineno + 1
        compiled(torch.randn(32, 64)).sum().backward()
    (w,) = [w for w in said if "memory_budget" in str(w.message)]
    assert (w.filename, w.lineno) == (__file__, line)


def _hook(module, args, output):
    warn("fxoffload: from a hook torch called")


def test_code_torch_calls_is_not_the_users_line():
    """A hook (as the code Inductor generates, which calls fxoffload's ops) is called by torch: the
    line said is the one that called torch."""
    module = torch.nn.Linear(2, 2)
    module.register_forward_hook(_hook)
    with pytest.warns(RuntimeWarning, match="from a hook") as said:
        line = inspect.currentframe().f_lineno + 1
        module(torch.randn(1, 2))
    assert (said[0].filename, said[0].lineno) == (__file__, line)


@pytest.mark.parametrize("how", ["path", "module"])
def test_a_script_run_by_python_is_the_users_line(tmp_path, monkeypatch, how):
    """A script's frame is called by Python's own library (``python script.py``, ``python -m pkg.mod``:
    runpy): it is still the user's. Run as a module it is __main__ with its package's loader, which
    cannot read __main__'s source (the fuzz, ``python -m bench.fuzz``, got an ImportError at compile)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    script = tmp_path / "pkg" / "train.py"
    script.write_text("from fxoffload.warn import warn\n\nwarn('fxoffload: from a script')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="from a script") as said:
        if how == "path":
            runpy.run_path(str(script))
        else:
            runpy.run_module("pkg.train", run_name="__main__", alter_sys=True)
    assert (said[0].filename, said[0].lineno) == (str(script), 3)


def test_said_once_per_line_and_filtered_as_any_warning():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        for _ in range(3):
            warn("fxoffload: the same words")
    assert len(said) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxoffload: an error now")
        with pytest.raises(RuntimeWarning):
            warn("fxoffload: an error now")
