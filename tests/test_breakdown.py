"""What is live at the peak, by kind: the report's breakdown, the picture, and the seq2seq question
("why does memory grow in the backward, what holds it after the optimizer step") answered in figures."""

import pytest
import torch

import fxoffload
from fxoffload.tools.explain import explain_step, where_memory_goes
from fxoffload.testing.models import example
from fxoffload.sizes import fmt_bytes
from fxoffload.reporting.report import OffloadReport

from .conftest import cpu_backend, requires_saved_tensor_reads

BATCH, IN, HIDDEN, OUT = 32, 16, 64, 8


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    return model, torch.randn(BATCH, IN)


def _report(inner):
    torch._dynamo.reset()
    model, x = _mlp()
    backend = cpu_backend(inner=inner)  # offload_cpu, min_bytes=0, policy="all"
    step = torch.compile(model, backend=backend)
    step(x).sum().backward()
    (report,) = backend.reports
    return report, step, x


@pytest.fixture(scope="module")
def mlp_report():
    report, step, x = _report("aot_eager")
    yield report, step, x
    torch._dynamo.reset()


def test_breakdown_at_the_peak_sums_to_the_peak(mlp_report):
    report, _, _ = mlp_report
    for which, timeline in (("before", report.memory_before), ("after", report.memory_after)):
        peak = report.peak_breakdown(which)
        assert peak.total == sum(peak.device.values()) == timeline.peak_bytes, (which, peak)
        assert (peak.phase, peak.node) == (timeline.peak.phase, timeline.peak.node)
        # Every point: moving reloads to the saved kind keeps the total of the memory model.
        assert [sum(k.values()) for k in report.device_kinds(which)] == [p.total for p in timeline.points]


def test_kinds_of_a_two_layer_mlp_by_hand(mlp_report):
    report, _, _ = mlp_report
    params = (HIDDEN * IN + HIDDEN + OUT * HIDDEN + OUT) * 4
    peak = report.peak_breakdown("before")
    assert peak.device["parameters"] == params and peak.device["inputs"] == BATCH * IN * 4
    # policy="all" offloads the one activation the backward needs: relu's output, 32x64 float32.
    assert [r.name for r in report.offloaded] == ["relu"]
    host = report.host_in_flight("after")
    phases = [p.phase for p in report.memory_after.points]
    end_of_forward = phases.index("backward") - 1
    assert host[end_of_forward] == report.offloaded_bytes == BATCH * HIDDEN * 4
    assert host[0] == 0 and host[-1] == 0  # taken by the offload, released after its reload's wait
    assert report.host_in_flight("before") == [0] * len(report.memory_before.points)
    # While its reload's destination is live, the reloaded tensor is a saved activation on the device.
    (copy,) = report.host_copies
    kinds = report.device_kinds("after")
    assert kinds[copy.reload_first]["saved"] == BATCH * HIDDEN * 4
    assert report.memory_after.points[copy.reload_first].live["saved"] == 0  # the model says "transient"


def test_summary_says_where_the_peak_is_and_the_kinds(mlp_report):
    report, _, _ = mlp_report
    peak = report.peak_breakdown("after")
    line = next(x for x in report.summary().splitlines() if "predicted peak with fxoffload" in x)
    assert f"{fmt_bytes(peak.total)} at {peak.phase} node {peak.node}" in line
    assert f"parameters {fmt_bytes(peak.device['parameters'])}" in line
    assert f"transients {fmt_bytes(peak.device['transient'])}" in line


def test_breakdown_survives_json_and_bad_timeline_names(mlp_report):
    report, _, _ = mlp_report
    again = OffloadReport.from_json(report.to_json())
    assert again.host_copies == report.host_copies and again.peak_breakdown() == report.peak_breakdown()
    assert report.peak_breakdown("compiled") is None  # aot_eager: no generated code to replay
    with pytest.raises(ValueError, match="timeline 'peak': choose 'before'.*'after'.*'compiled'"):
        report.peak_breakdown("peak")


def test_compiled_replay_has_a_breakdown_and_host_copies():
    report, _, _ = _report("inductor")
    compiled = report.compiled_memory()
    peak = report.peak_breakdown("compiled")
    assert peak.total == compiled.peak_bytes and peak.node == compiled.peak.node
    host = report.host_in_flight("compiled")
    assert max(host) == report.offloaded_bytes == BATCH * HIDDEN * 4 and host[0] == host[-1] == 0
    assert f"peak of Inductor's generated code: {fmt_bytes(peak.total)}" in report.summary()
    torch._dynamo.reset()


def test_host_copies_with_dynamic_shapes():
    """With a dynamic batch the forward also returns symbolic sizes and the backward takes them as
    placeholders, so saved values and backward placeholders no longer pair by position: each host
    copy is found by its placeholder's name, with its reload."""
    torch._dynamo.reset()
    model, x = _mlp()
    backend = cpu_backend(inner="aot_eager")
    step = torch.compile(model, backend=backend, dynamic=True)
    step(x).sum().backward()
    (report,) = backend.reports
    assert report.offloaded
    assert sorted(c.name for c in report.host_copies) == sorted(r.name for r in report.offloaded)
    for c in report.host_copies:
        assert c.host_name == f"{c.name}_host"
        assert 0 <= c.first < c.reload_first <= c.last and c.reload_first <= c.reload_last
    assert max(report.host_in_flight("after")) == report.offloaded_bytes
    torch._dynamo.reset()


def test_plot_marks_the_peak_kinds_and_a_measured_peak(mlp_report, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    report, step, x = mlp_report
    measured = fxoffload.measure_memory(lambda: step(x).sum().backward())
    path = tmp_path / "memory.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text in the SVG
        report.plot(str(path), measured=measured)
    svg = path.read_text()
    start = report.peak_breakdown().device["parameters"] + report.peak_breakdown().device["inputs"]
    assert f"measured peak (CPU) {fmt_bytes(measured.cpu.peak_bytes)} above the start" in svg
    assert f"drawn on this graph's {fmt_bytes(start)} of parameters and inputs" in svg
    assert f"predicted peak {fmt_bytes(report.predicted_peak_after)}" in svg
    for kind in ("parameters", "saved activations", "transients", "gradients", "host copies in flight"):
        assert kind in svg, kind
    report.plot(str(tmp_path / "bytes.png"), measured=12345)
    with pytest.raises(ValueError, match="pass bytes \\(an int\\), a DeviceMemory or a MeasuredMemory"):
        report.plot(str(tmp_path / "never.png"), measured="12 MiB")


@requires_saved_tensor_reads
def test_seq2seq_answer_is_figures_from_the_timeline_and_the_optimizer():
    model, args = example("seq2seq")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reports, step = explain_step(model, *args, optimizer="adamw", offload_cpu=True, min_bytes="8KiB",
                                 inner="aot_eager")  # fmt: skip
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert step.optimizer == "AdamW" and step.parameter_bytes == param_bytes
    # AdamW keeps exp_avg and exp_avg_sq per parameter (2x their bytes) and a float32 step counter each.
    assert step.optimizer_state_like_params_bytes == 2 * param_bytes
    assert step.optimizer_state_other_bytes == 4 * len(params)
    assert step.optimizer_state_bytes == 2 * param_bytes + 4 * len(params)
    # Measured: the backward leaves exactly the gradients live; the optimizer step leaves nothing more.
    assert step.gradient_bytes == param_bytes and step.backward.end_bytes == step.gradient_bytes
    assert step.optimizer_step.end_bytes == 0 and step.optimizer_step.peak_bytes > 0
    # The model was left as it was.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in params)

    text = where_memory_goes(reports, step)
    (report,) = reports
    kinds = report.device_kinds("after")
    points = report.memory_after.points
    bw = [i for i, p in enumerate(points) if p.phase == "backward"]
    fw = [i for i, p in enumerate(points) if p.phase == "forward"]
    fw_peak = max(sum(kinds[i].values()) for i in fw)
    bw_peak = max(sum(kinds[i].values()) for i in bw)
    assert bw_peak > fw_peak  # the seq2seq user's observation, predicted
    assert f"forward peak {fmt_bytes(fw_peak)}" in text and f"backward peak {fmt_bytes(bw_peak)}" in text
    assert f"{fmt_bytes(bw_peak - fw_peak)} above the forward's" in text
    assert f"start of the backward: saved activations {fmt_bytes(kinds[bw[0]]['saved'])}" in text
    # The eager packed-GRU encoder runs before the graph: what it saved, and its weights, are held
    # through it, and with them the prediction is the measured step (CPU allocator, within 1%; 372 B
    # apart on torch 2.13: its weights are in the start as well).
    up = report.outside
    assert up.saved_bytes > 100_000 and up.params_bytes > 100_000
    assert {k["outside"] for k in kinds} == {up.held_bytes}
    assert f"held from before its forward to after its backward: {report.outside.summary()}" in text
    above = max(sum(k.values()) for k in kinds) - report.start_bytes
    assert abs(above / step.backward.peak_bytes - 1) < 0.01, (above, step.backward.peak_bytes)
    assert f"the compiled graphs predict at most {fmt_bytes(above)} above the step's start" in text
    assert f"end of the backward: gradients {fmt_bytes(kinds[bw[-1]]['gradients'])}" in text
    # The decoder's weights are used at every step: their gradients are summed in the backward.
    assert "are gradients being summed over a weight's several uses" in text
    assert f"gradients {fmt_bytes(step.gradient_bytes)} (kept until zero_grad(set_to_none=True))" in text
    assert f"AdamW state {fmt_bytes(step.optimizer_state_bytes)} ({3 * len(params)} tensors" in text
    assert f"live at the end of the backward: {fmt_bytes(step.backward.end_bytes)} more" in text


def test_explain_step_bad_input():
    model, args = example("mlp")
    with pytest.raises(ValueError, match="optimizer='lion': use one of sgd, adam, adamw or a callable"):
        explain_step(model, *args, optimizer="lion")
    with pytest.raises(ValueError, match="must be a torch.nn.Module"):
        explain_step(lambda x: x.sin().sum(), torch.randn(3, requires_grad=True))


def test_cli_optimizer_says_what_is_live_after_the_step(capsys):
    from fxoffload.tools.cli import main

    argv = ["explain", "--model", "mlp", "--device", "cpu", "--offload-cpu", "--inner", "aot_eager",
            "--optimizer", "sgd"]  # fmt: skip
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines wrap to the terminal
    assert "where the memory goes (predicted by the memory model, with fxoffload):" in out
    assert "measured, one steady step with SGD (CPU, relative to what was live at its start):" in out
    model, _ = example("mlp")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # SGD with momentum keeps one buffer per parameter and no step counter.
    assert f"SGD state {fmt_bytes(param_bytes)}" in out and f"parameters {fmt_bytes(param_bytes)}" in out
    torch._dynamo.reset()
