"""explain(), the report file formats, the picture and the command line."""

import contextlib
import importlib.util
import io
import os
import subprocess
import sys

import pytest
import torch

import fxoffload
from fxoffload.testing.models import example
from fxoffload.reporting.report import load_reports, save_reports

OPTIONS = dict(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager")


@pytest.mark.parametrize("name", ["gpt", "cnn", "seq2seq"])
def test_explain_reports_and_leaves_the_model_alone(name):
    model, args = example(name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    reports = fxoffload.explain(model, *args, **OPTIONS)
    assert reports and all(r.saved for r in reports)
    assert any(r.offloaded for r in reports)
    assert all(p.grad is None for p in model.parameters()), "explain must not leave gradients"
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), f"{key} changed"  # BatchNorm running stats included
    assert torch.equal(torch.get_rng_state(), rng)
    # One table row per saved tensor.
    for report in reports:
        body = report.table().splitlines()[4:]  # header, host line, column names, rule
        assert len([line for line in body if line and not line.startswith(" ")]) == len(report.saved)


def test_explain_without_anything_requiring_grad_is_empty():
    model, args = example("mlp")
    model.requires_grad_(False)
    assert fxoffload.explain(model, *args, **OPTIONS) == []


def test_reports_file_round_trip(tmp_path):
    model, args = example("cnn")
    reports = fxoffload.explain(model, *args, **OPTIONS)
    path = tmp_path / "reports.json"
    save_reports(reports, str(path))
    assert load_reports(str(path)) == reports


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_plot_writes_a_picture(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    model, args = example("mlp")
    (report,) = fxoffload.explain(model, *args, **OPTIONS)
    path = tmp_path / f"memory.{suffix}"
    report.plot(str(path))
    head = path.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in path.read_bytes()[:2000]


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch):
    model, args = example("mlp")
    (report,) = fxoffload.explain(model, *args, **OPTIONS)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'fxoffload\[plot\]'"):
        report.plot("never.png")


def _cli(*argv, env=None):
    """``python -m fxoffload *argv``, run in this process (a new interpreter costs 4-5 s of imports a
    call on two cores): its exit code, stdout and stderr, as ``subprocess.run`` gives them. ``env``:
    variables set for the call (``COLUMNS``)."""
    from fxoffload.tools.cli import main

    if "--offload-cpu" in argv and "--device" not in argv:  # a CPU test: the CLI picks cuda where there is one
        argv = (*argv, "--device", "cpu")
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv)) or 0
            except SystemExit as e:  # argparse's errors, and the CLI's own messages
                if isinstance(e.code, str):
                    err.write(e.code + "\n")
                code = e.code if isinstance(e.code, int) else 1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["fxoffload", *argv], code, out.getvalue(), err.getvalue())


def test_cli_explain(tmp_path):
    out = tmp_path / "r.json"
    picture = tmp_path / "r.png"
    plot = ["--plot", str(picture)] if importlib.util.find_spec("matplotlib") else []
    result = _cli("explain", "--model", "mlp", "--offload-cpu", "--inner", "aot_eager", "--policy", "all",
                  "--min-bytes", "0", "--all-rows", "--json", str(out), *plot)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "predicted peak without fxoffload" in result.stdout and "decision" in result.stdout
    (report,) = load_reports(str(out))
    assert report.offloaded
    # --all-rows: a line for every saved tensor, parameters and graph inputs included.
    lines = result.stdout.splitlines()
    for row in report.saved:
        assert any(line.startswith(f"{row.name} ") for line in lines), row.name
    if plot:
        assert picture.read_bytes().startswith(b"\x89PNG")


def test_cli_offload_module_patterns(tmp_path):
    out = tmp_path / "r.json"
    result = _cli("explain", "--model", "gpt", "--offload-cpu", "--inner", "aot_eager", "--min-bytes", "1GiB",
                  "--offload-module", "blocks.0.*", "--offload-module", "*.fc", "--json", str(out),
                  env={"COLUMNS": "160"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    # The short table: the offloaded group is titled with the code its rows share, each row says why.
    assert "[user_module]" in result.stdout
    assert "produced by blocks.0.qkv, which matches" in result.stdout
    (report,) = load_reports(str(out))
    paths = {r.name: r.module_path for r in report.saved}
    matching = {n for n, p in paths.items() if p.startswith("blocks.0.") or p.endswith(".fc")}
    asked = {r.name for r in report.saved if r.reason_code == "user_module"}
    assert asked and {r.name for r in report.offloaded} == asked <= matching, report.table()


def test_cli_user_factory(tmp_path):
    factory = tmp_path / "mine.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))\n"
        "    return m, (torch.randn(4, 8),)\n"
    )
    result = _cli("explain", "--model", f"{factory}:make", "--offload-cpu", "--inner", "aot_eager", "--min-bytes", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "saved tensor" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "--policy", "most"], "invalid choice: 'most'"),
        (["explain", "--min-bytes", "12parsecs"], "cannot parse"),
        (["explain", "--model", "nope"], "expected one of gpt, cnn, seq2seq, mlp or FILE.py:FUNCTION"),
        (["explain", "--model", "missing.py:make"], "no such file 'missing.py'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["explain", "--budget", "1.5"], "a float is a fraction of the peak without offloading"),
        (["explain", "--budget", "lots"], "cannot parse memory_budget='lots'"),
        (["explain", "--bandwidth", "fast"], "cannot parse rate='fast'; a rate is bytes per second"),
        (["explain", "--cpu-link", "2GB/s"], "--cpu-link sets the CPU copy threads' speed; it needs --offload-cpu"),
        (["explain", "--model", "mlp", "--offload-cpu", "--inner", "aot_eager", "--min-bytes", "0",
          "--budget", "1KiB", "--strict"], "cannot be reached"),
    ],
)
def test_cli_bad_arguments(argv, message):
    result = _cli(*argv)
    assert result.returncode != 0
    assert message in result.stderr


def test_cli_help():
    result = _cli("--help")
    assert result.returncode == 0 and "explain" in result.stdout


def test_cli_explain_help_shows_defaults_and_examples():
    result = _cli("explain", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())  # argparse wraps the help to the terminal
    assert "(default: gpt)" in text and "(default: auto)" in text and "(default: inductor)" in text
    assert "gpt: 16KiB" in text and "(default: unbounded)" in text
    assert "examples: # the plan for the built-in GPT" in text
    assert "python -m fxoffload explain --model cnn --offload-cpu --policy all --measure" in text
    # Every flag has a help text (--inner had none).
    from fxoffload.tools.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    flags = {a.option_strings[0]: a.help for a in sub.choices["explain"]._actions}
    assert {"--inner", "--all-rows", "--min-bytes"} <= flags.keys()
    assert all(flags.values()), [f for f, h in flags.items() if not h]


def test_cli_example_min_bytes_offloads_and_the_short_table_fits(tmp_path):
    """The built-in examples carry a min_bytes that makes them offload (policy "all": on a CPU "auto" keeps
    what its op calls would slow, tests/test_op_time.py) (the CNN's 64 KiB; the 1 MiB
    default would leave most of what they save); the default table is the short one and fits a
    110-column terminal."""
    out = tmp_path / "r.json"
    result = _cli("explain", "--model", "cnn", "--offload-cpu", "--inner", "aot_eager", "--policy", "all", "--json", str(out),
                  env={"COLUMNS": "110"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    (report,) = load_reports(str(out))
    assert len(report.offloaded) > 0 and {r.reason_code for r in report.saved} >= {"min_bytes"}
    assert all(len(line) <= 110 for line in result.stdout.splitlines()), result.stdout
    assert f"offloaded: {len(report.offloaded)} tensors" in result.stdout
    assert "parameters, buffers and graph inputs: 9 kept" in result.stdout
    assert "decision" not in result.stdout  # the all-rows column names
    # An explicit --min-bytes wins over the example's.
    again = _cli("explain", "--model", "cnn", "--offload-cpu", "--inner", "aot_eager", "--min-bytes", "4MiB",
                 "--json", str(out))  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    (report,) = load_reports(str(out))
    assert not report.offloaded and {r.reason_code for r in report.saved} >= {"min_bytes"}
    assert "predicted stall" not in again.stdout  # nothing planned: no stall to predict


def test_logs_and_trace_artifacts(tmp_path):
    """TORCH_LOGS="+fxoffload" shows decisions; TORCH_TRACE gets the plan and graphs as artifacts."""
    code = (
        "import torch, fxoffload\n"
        "b = fxoffload.backend(inner='aot_eager', offload_cpu=True, min_bytes=0, policy='all', partitioner='default')\n"
        "f = torch.compile(lambda x: (x.sin() * x.cos()).sum(), backend=b)\n"
        "f(torch.randn(256, requires_grad=True)).backward()\n"
    )
    env = {**__import__("os").environ, "TORCH_LOGS": "+fxoffload", "TORCH_TRACE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fxoffload: offload sin" in result.stderr and "offloading 2 of" in result.stderr
    trace = "".join(p.read_text() for p in tmp_path.iterdir())
    assert '"name": "fxoffload_plan"' in trace and '"name": "fxoffload_graphs"' in trace


def test_cli_budget():
    # The copies priced at the CPU copy threads' speed, a rate as people write one.
    result = _cli("explain", "--model", "gpt", "--offload-cpu", "--inner", "aot_eager", "--min-bytes", "16KiB",
                  "--cpu-link", "1GB/s", "--budget", "0.8")  # fmt: skip
    # (0.6 to 0.75 are missed by 1-2%: the budget fit's intervals and the simulated rewritten graphs
    # still disagree, see test_planner.test_memory_budget_in_bytes; the summary says "NOT met" then.)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "memory_budget:" in result.stdout and "(met" in result.stdout and "NOT met" not in result.stdout
    assert "predicted stall" in result.stdout and "link 1.0 GB/s out, 1.0 GB/s in" in result.stdout


def test_user_guide_options_table_gives_every_option_a_unit_and_default():
    import dataclasses
    from pathlib import Path

    from fxoffload.options import OffloadOptions

    guide = (Path(__file__).parent.parent / "docs" / "user-guide.md").read_text()
    section = guide.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].strip("`")] = cells
    fields = {f.name for f in dataclasses.fields(OffloadOptions)}
    assert fields <= rows.keys(), f"add to the options table of docs/user-guide.md: {fields - rows.keys()}"
    assert all(unit and default and meaning for _, unit, default, meaning in rows.values()), rows
    assert rows["min_bytes"][2].startswith("`1 MiB`") and OffloadOptions().min_bytes == 2**20
