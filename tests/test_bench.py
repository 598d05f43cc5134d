"""The benchmark harness keeps working: a CPU smoke run, and the pieces that can go wrong."""

import copy
import json
import re
import sys
import types

import pytest
import torch

from bench.__main__ import main, table
from bench.methods import Context, Method, parse_methods
from bench.runner import check_losses, copies_from_trace, run_method
from bench.streamed import StreamedOffload
from bench.workloads import WORKLOADS, Workload, WorkloadUnavailable, build
from fxoffload.testing.models import GPT, MLP, PRESETS, gpt_batch

from .conftest import TORCH_2_11


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_smoke(tmp_path, capsys, restore_threads):
    """Tiny GPT, one timed step, fxoffload next to alternatives and torch's in-tree offloading, on
    the CPU whatever the machine (``--device cpu``): where there is a GPU the default is the GPU,
    with a 1 MiB ``min_bytes`` above every tensor of the tiny preset."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    methods = (
        "eager,fxoffload-all,fxoffload-budget=0.5,fxoffload-recompute=0.8,save_on_cpu,streamed,checkpoint,"
        "checkpoint-compiled,intree"
    )
    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--batch", "2",
            "--threads", "1", "--inner", "aot_eager", "--methods", methods, "--json", str(out),
            "--png", str(png)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == methods.split(",")
    assert all(r["status"] == "ok" for r in rows.values()), [(r["method"], r["note"]) for r in data["rows"]]
    # Every method computes the same first loss as eager.
    assert all(r["loss_ok"] for r in rows.values())
    assert all(abs(r["loss"] - rows["eager"]["loss"]) < 1e-4 for r in rows.values())
    assert all(r["step_ms"] > 0 and r["throughput"] > 0 for r in rows.values())
    # Every method's steady step is measured (on a CPU too).
    assert all(r["measured_peak_MiB"] > 0 for r in rows.values())
    # fxoffload rows carry its prediction; offloading lowers it; the budget row says whether it was met.
    for name in ("fxoffload-all", "fxoffload-budget=0.5"):
        assert rows[name]["offloaded_MiB"] > 0
        assert rows[name]["predicted_after_MiB"] < rows[name]["predicted_before_MiB"]
    for name in ("fxoffload-budget=0.5", "fxoffload-recompute=0.8"):  # judged on the measured step
        assert re.search(r"budget (met|NOT met) on measured bytes", rows[name]["note"]), rows[name]["note"]
    # Every other row against the compiler alone (eager here): its time as a multiple, what left the peak.
    assert "time_x" not in rows["eager"] and all(r["time_x"] > 0 for n, r in rows.items() if n != "eager")
    assert all(
        r["left_peak_MiB"] == pytest.approx(rows["eager"]["measured_peak_MiB"] - r["measured_peak_MiB"])
        for n, r in rows.items() if n != "eager"
    )  # fmt: skip
    # The plan's model against the device: the compute it predicts over the baseline's measured step.
    row = rows["fxoffload-all"]
    assert row["predicted_compute_ms"] > 0 and "model_x" not in rows["eager"]
    assert row["model_x"] == pytest.approx(row["predicted_compute_ms"] / rows["eager"]["step_ms"])
    assert rows["streamed"]["offloaded_MiB"] > 0 and "synchronous" in rows["streamed"]["note"]
    # Compiled by the run's inner compiler (Inductor's C++ build was 23 s of this test's 35)
    assert rows["checkpoint-compiled"]["note"].endswith("blocks, compiled by aot_eager")
    # torch's pass found the tensors by the names fxoffload gave them, and offloaded some of them.
    assert rows["intree"]["note"].startswith("tagged ")
    tagged, planned = rows["intree"]["note"].split(" tensors")[0].removeprefix("tagged ").split(" of ")
    assert int(tagged) == int(planned) > 0
    assert rows["intree"]["offloaded_MiB"] > 0
    assert "CPU" in data["conditions"]["device"] and data["conditions"]["gpu"] is False
    assert data["conditions"]["command"].startswith("python -m bench --preset tiny --device cpu")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "[9/9] intree ..." in printed and "fxoffload-budget=0.5" in printed
    assert "measured peak MiB (above start)" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: --device cuda would run")
def test_device_cuda_without_cuda_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_pareto_front():
    from bench.plot import pareto

    # (time, peak): the second is beaten by the first on both; the last ties the first on time only.
    points = [(1.0, 5.0), (2.0, 6.0), (3.0, 1.0), (1.0, 7.0), (2.0, 2.0)]
    assert pareto(points) == [0, 2, 4]


def test_parse_methods():
    names = [m.name for m in parse_methods("eager,fxoffload-budget,fxoffload-recompute,inductor-amb=0.3", "0.8,0.5")]
    assert names == ["eager", "fxoffload-budget=0.8", "fxoffload-budget=0.5", "fxoffload-recompute=0.8",
                     "fxoffload-recompute=0.5", "inductor-amb=0.3"]  # fmt: skip
    with pytest.raises(ValueError, match="unknown method 'fxoffload-some'; choose from: eager, inductor"):
        parse_methods("fxoffload-some", "0.5")
    with pytest.raises(ValueError, match=r"inductor-amb: 1.5 is out of range; use fractions in \(0, 1\]"):
        parse_methods("inductor-amb=1.5", "")
    with pytest.raises(ValueError, match="method 'eager' takes no value"):
        parse_methods("eager=0.5", "")
    with pytest.raises(ValueError, match="fxoffload-budget needs budgets"):
        parse_methods("fxoffload-budget", "")


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--workload", "cnn", "--preset", "gpt2-medium"])
    assert e.value.code == 2
    assert (
        "workload 'cnn' has no preset 'gpt2-medium'; choose one of: tiny, resnet18" in capsys.readouterr().err
    )


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_build_and_give_a_scalar_loss(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w = build(name, "tiny", "cpu", batch=2)
    loss = w.model(*w.batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    blocks = w.blocks(w.model)
    assert blocks and all(isinstance(b, torch.nn.Module) for b in blocks)
    assert all(p.grad is not None for b in blocks for p in b.parameters())
    assert w.items_per_step > 0 and w.unit in ("tokens", "samples")


def test_hf_workload_without_transformers(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(WorkloadUnavailable, match="hf-llama needs the transformers package"):
        build("hf-llama", "tiny", "cpu")
    out = tmp_path / "skip.json"
    assert main(["--workload", "hf-gpt2", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("skipped: hf-gpt2 needs the transformers package")
    assert "transformers" in json.loads(out.read_text())["conditions"]["skipped"]


def _grads(model, batch, offloader=None):
    model.zero_grad(set_to_none=True)
    if offloader is None:
        loss = model(*batch)
    else:
        with offloader:
            loss = model(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_streamed_offloader_matches_eager_on_cpu():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()  # no dropout: the two runs draw no random numbers
    batch = gpt_batch(PRESETS["tiny"], 2)
    ref_loss, ref = _grads(copy.deepcopy(model), batch)
    offloader = StreamedOffload(model, min_bytes=4096)
    for _ in range(2):  # the second step reuses the host buffers of the first
        loss, grads = _grads(model, batch, offloader)
        offloader.after_backward()
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref[n]) for n in ref)
    assert offloader.synchronous and "synchronous" in offloader.mode
    assert offloader.offloaded_bytes > 0
    assert offloader.host_pool_bytes() == offloader.offloaded_bytes  # every buffer came back to the pool


def test_streamed_offloader_skips_weights_and_small_tensors_and_dedupes():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(256, 256) * 0.05)
    model = torch.nn.Module()
    model.weight = weight
    x = torch.randn(64, 256, requires_grad=True)

    def f():
        h = x @ weight  # saves x (64 KiB) and the weight (never offloaded)
        return h, (h * h).sum() + (h.exp() * 2).sum()  # the mul saves h twice; exp saves its output

    expected = torch.autograd.grad(f()[1], [x, weight])
    offloader = StreamedOffload(model, min_bytes=1024)
    with offloader:
        h, y = f()
    assert offloader.offloaded_bytes == x.nbytes + h.nbytes + h.nbytes  # x, h once, exp(h)
    y.backward()
    offloader.after_backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])
    with offloader:
        small = (torch.randn(8, requires_grad=True) * 2).exp()
    assert offloader.offloaded_bytes == 0 and small.requires_grad


def test_method_without_blocks_is_skipped_with_a_reason():
    w = build("gpt", "tiny", "cpu", batch=2)
    no_blocks = Workload(**{**w.__dict__, "blocks": lambda m: []})
    ctx = Context(torch.device("cpu"), 16384, "aot_eager", None)
    row = run_method(Method("checkpoint"), no_blocks, ctx, steps=1, warmup=0, progress=lambda s: None)
    assert row == {
        "method": "checkpoint",
        "status": "skipped",
        "note": "the workload lists no blocks to checkpoint",
    }


def test_inductor_without_pool_reuse_allocates_more_for_the_same_loss():
    """``inductor-noreuse`` lowers as fxoffload lowers a graph that copies (``allow_buffer_reuse=False``):
    the same step, a buffer allocated where Inductor's own code hands on a freed one."""
    from torch._inductor.utils import run_and_get_code

    from bench.methods import prepare

    torch.manual_seed(0)
    model, batch = MLP(layers=2), (torch.randn(32, 64),)
    ctx = Context(torch.device("cpu"), 16384, "inductor", None)
    allocations, losses = {}, {}
    for kind in ("inductor", "inductor-noreuse"):
        torch._dynamo.reset()
        step = prepare(Method(kind), copy.deepcopy(model), batch, [], ctx).step
        with torch._inductor.config.patch(fx_graph_cache=False):
            losses[kind], codes = run_and_get_code(step)
        allocations[kind] = sum(code.count("empty_strided") for code in codes)
    assert losses["inductor"] == losses["inductor-noreuse"]
    assert allocations["inductor-noreuse"] > allocations["inductor"], allocations


def test_loss_check_and_table_flag_a_mismatch():
    rows = [{"method": "eager", "status": "ok", "loss": 2.0}, {"method": "x", "status": "ok", "loss": 2.01},
            {"method": "y", "status": "skipped", "note": "no GPU"}]  # fmt: skip
    check_losses(rows, rtol=1e-3)
    assert [r.get("loss_ok") for r in rows] == [True, False, None]
    text = table(rows, "tokens")
    assert "MISMATCH" in text and "no GPU" in text and "peak alloc" not in text


def test_copies_from_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 100.0,
         "args": {"bytes": 2_000_000}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 100, "dur": 100.0,
         "args": {"bytes": 2_000_000}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 200, "dur": 50.0,
         "args": {"bytes": 1_000_000}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 250, "dur": 10.0,
         "args": {"bytes": 9_000_000}},
        {"ph": "X", "cat": "kernel", "name": "gemm DtoH lookalike", "ts": 300, "dur": 999.0, "args": {"bytes": 1}},
    ]}  # fmt: skip
    out = copies_from_trace(trace)
    assert out["dtoh_GBps"] == pytest.approx(20.0) and out["dtoh_ms"] == pytest.approx(0.2)
    assert out["htod_GBps"] == pytest.approx(20.0) and out["htod_MiB"] == pytest.approx(1e6 / 2**20)
    assert copies_from_trace({"traceEvents": []})["dtoh_GBps"] == 0.0


def test_copies_from_trace_overlap():
    """The share of each direction's copy time a kernel ran beside: the figure issue 23 holds to 90%."""
    def ev(cat, name, ts, dur, stream, nbytes=0):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": nbytes}}

    trace = {"traceEvents": [
        ev("kernel", "gemm", 0.0, 100.0, 7),
        ev("kernel", "triton_poi", 150.0, 50.0, 7),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50.0, 100.0, 20, 1_000_000),  # 50 of 100 us beside a kernel
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 160.0, 20.0, 20, 1_000_000),  # all of it
    ]}  # fmt: skip
    out = copies_from_trace(trace)
    assert out["dtoh_overlap"] == pytest.approx(0.5) and out["htod_overlap"] == pytest.approx(1.0)
    assert "dtoh_overlap" not in copies_from_trace({"traceEvents": []})


def test_copies_from_trace_says_how_many_kernels_waited_on_the_host():
    """Three kernels on the compute stream, launched 10 us, 10 us and 2 ms before they started: two
    of three waited on the host. A trace without launches says nothing."""
    def kernel(ts, corr):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": 5.0, "args": {"stream": 7, "correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2.0, "tid": 1,
                "pid": 1, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        launch(0.0, 1), kernel(10.0, 1), launch(20.0, 2), kernel(30.0, 2), launch(40.0, 3), kernel(2040.0, 3),
    ]}  # fmt: skip
    assert copies_from_trace(trace)["host_bound_share"] == pytest.approx(2 / 3)
    assert "host_bound_share" not in copies_from_trace({"traceEvents": [kernel(0.0, 1)]})


def test_memory_bench_rows(restore_threads):
    """``python -m bench.memory``'s rows: measured and predicted peaks of the same step agree on the
    MLP under aot_eager (the FX model is its prediction there), and the table says which model."""
    from bench.memory import measure
    from bench.memory import table as memory_table
    from fxoffload.measure.allocator import track_cpu_frees

    track_cpu_frees()
    torch.set_num_threads(1)
    rows = [measure("mlp", "aot_eager", None), measure("mlp", "aot_eager", "all")]
    rows.append(measure("mlp", "aot_eager", "all", scale=4))  # the batch 4 times as large
    baseline, planned, larger = rows
    assert planned["offloaded"] > 0 and "predicted_peak" not in baseline
    for r in (planned, larger):
        assert abs(r["predicted_peak"] / r["measured_peak"] - 1) < 0.01, r
    assert (planned["batch"], larger["batch"]) == (32, 128) and larger["measured_peak"] > planned["measured_peak"]
    (_, _, row, other) = memory_table(rows).splitlines()[1:]
    assert row.split()[:4] == ["mlp", "32", "aot_eager", "all"] and "FX graphs" in row
    assert other.split()[:4] == ["mlp", "128", "aot_eager", "all"]


# torch 2.11 keeps the gradient a compiled block's backward is called with (the 128 KiB the eager
# LayerNorm backward after the blocks made) alive at the step's peak, inside that backward; torch
# 2.13 has freed it by then, and so has the FX memory model. Measured 3754004 bytes against a
# 3612470-byte budget (predicted 5.4% low), alike on a 2-core CPU machine and on the H100 machine.
@pytest.mark.xfail(
    TORCH_2_11, strict=True, reason="torch 2.11 holds a compiled backward's incoming gradient longer"
)
def test_blocks_bench_rows(restore_threads):
    """``python -m bench.blocks``'s rows: each GPT block compiled apart, a budget the blocks' first plan
    misses is planned again for all the calls, met when measured, and predicted within 2%."""
    from bench.blocks import measure
    from bench.blocks import table as blocks_table

    torch.set_num_threads(1)
    base = measure("aot_eager", "baseline", layers=2, batch=8)
    # The op calls priced as an accelerator's (none): a plan that does not depend on this machine's speed.
    row = measure("aot_eager", "budget", layers=2, batch=8, budget=int(0.4 * base["measured"]), op_time=0.0)
    assert row["replans"] == 1 and not row["warned"], row
    assert row["measured"] <= 1.03 * row["budget"] and abs(row["predicted"] / row["measured"] - 1) < 0.02, row
    (line,) = blocks_table([base, row]).splitlines()[3:]
    assert line.split()[:4] == ["aot_eager", "2", "8", "budget"] and line.split()[-1] == "yes"


def test_cli_cpu_link_is_parsed_and_passed_to_fxoffload(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--cpu-link", "fast"])
    assert e.value.code == 2 and "cannot parse --cpu-link='fast'" in capsys.readouterr().err
    ctx = Context(torch.device("cpu"), 0, "aot_eager", None, cpu_link=2_000_000_000)
    assert ctx.fxoffload_options()["cpu_link_bandwidth"] == 2_000_000_000
    assert "cpu_link_bandwidth" not in Context(torch.device("cpu"), 0, "aot_eager", None).fxoffload_options()


def test_compile_time_names_the_methods_it_knows(capsys):
    """``bench.compile_time``: an unknown method is refused with the allowed ones, before any compile."""
    from bench.compile_time import main as compile_time

    with pytest.raises(SystemExit):
        compile_time(["--methods", "inductor,fxoffload-sometimes"])
    err = capsys.readouterr().err
    assert "unknown methods ['fxoffload-sometimes']" in err and "fxoffload-auto" in err
    with pytest.raises(SystemExit):
        compile_time(["--methods", "inductor", "--repeat", "0"])
    assert "--repeat must be >= 1, got 0" in capsys.readouterr().err


def test_compile_time_rounds_pair_each_method_with_its_rounds_inductor():
    """``--repeat``: each method's median run, and its ratio the median of the rounds' own ratios (a
    round whose every run ran slow counts as one ratio, not as a slow fxoffload)."""
    from bench.compile_time import summarise

    def run(method, *steps):
        return {"method": method, "steps_s": list(steps)}

    rounds = [
        {"inductor": run("inductor", 10.0, 1, 1), "fxoffload-all": run("fxoffload-all", 11.0, 1, 1)},  # Inductor 12, fxoffload 13
        {"fxoffload-all": run("fxoffload-all", 17.0, 1, 1), "inductor": run("inductor", 15.0, 1, 1)},  # 17, 19
        {"inductor": run("inductor", 11.0, 1, 1), "fxoffload-all": run("fxoffload-all", 14.0, 1, 1)},  # 13, 16
    ]
    rows, ratios = summarise(rounds)
    assert [r["method"] for r in rows] == ["inductor", "fxoffload-all"]
    assert [r["steps_s"][0] for r in rows] == [11.0, 14.0]  # the median runs
    assert ratios["inductor"] == 1.0
    assert ratios["fxoffload-all"] == pytest.approx(19 / 17)  # 13/12, 19/17, 16/13: the middle one
    assert summarise([{"fxoffload-all": run("fxoffload-all", 1.0)}])[1] == {}


def test_op_overhead_times_each_transfer_op_call(capsys):
    """``bench.op_overhead`` on the CPU engine: a figure for each call, a switched-off copy timed and
    switched on again after, and bad arguments refused."""
    from bench.op_overhead import main
    from fxoffload.measure.op_time import _NAME
    from fxoffload.runtime.transfers import copies_switched_off

    assert main(["--device", "cpu", "--calls", "20"]) == 0
    out = capsys.readouterr().out
    for call in ("offload", "wait (d2h)", "reload", "wait (h2d)", "order", "offload, switched off"):
        assert re.search(rf"\| {re.escape(call)} +\| +\d+\.\d \|", out), (call, out)
    assert "one offloaded tensor, its four calls:" in out
    from fxoffload.measure.op_time import measure_op_rates

    op_time, op_byte_time = measure_op_rates(torch.device("cpu"))
    assert f"the planner's price on this CPU: {op_time * 1e6:.1f} us a tensor + " in out, out
    assert f"{op_byte_time * (1 << 20) * 1e6:.1f} us a MiB (for 64 B: " in out, out
    assert _NAME not in copies_switched_off()
    with pytest.raises(SystemExit):
        main(["--calls", "0"])
    assert "--calls must be >= 1" in capsys.readouterr().err


def test_device_check_runs_its_parts_and_writes_the_summary(tmp_path):
    """``python -m bench.device_check --smoke``: each part in a process of its own, its output in the
    log, the op table and each part's status in summary.md; an unknown part is refused by name."""
    from bench import device_check

    assert device_check.main(["--smoke", "--out", str(tmp_path), "--parts", "ops"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "## ops:" in summary and summary.count("ok, ") == 1, summary
    assert "| offload " in summary and "one offloaded tensor, its four calls" in summary
    assert "bench.op_overhead --device cpu" in (tmp_path / "device_check.log").read_text()
    with pytest.raises(SystemExit):
        device_check.main(["--smoke", "--out", str(tmp_path), "--parts", "ops,nope"])


def test_device_check_parts_run_under_the_time_left_where_it_gives_a_figure():
    """The default run on the H100's seconds (ops 12 s, gpt2m up to 256 s): gpt2m and llama run under
    their own limits, and what llama leaves is the GPU tests' limit where it is 120 s or more (with
    every part held to its full limit, as before, they never started: 930 s of limits in 570). A
    part with no least time is not started under its limit."""
    from bench import device_check

    gpt2m, llama, tests, ops = (device_check.PARTS[n] for n in ("gpt2m", "llama", "tests", "ops"))
    assert device_check.DEFAULT == ("ops", "gpt2m", "llama", "tests")
    assert gpt2m.limit(570 - 12) == 330 and llama.limit(570 - 12 - 256) == 300
    assert llama.limit(200) == 200 and tests.limit(200) == 200 and tests.limit(119) is None
    assert ops.limit(59) is None and ops.limit(60) == 60


def test_device_check_summary_rows(tmp_path):
    """The bench rows the issues judge, as summary.md tables them (overlap and bound shares in %)."""
    from bench import device_check

    path = tmp_path / "gpt2m.json"
    path.write_text(json.dumps({"conditions": {"command": "python -m bench x"}, "rows": [
        {"method": "inductor", "status": "ok", "step_ms": 47.4, "peak_alloc_MiB": 9955.0},
        {"method": "fxoffload-auto", "status": "ok", "step_ms": 49.0, "time_x": 1.034, "peak_alloc_MiB": 9000.0,
         "left_peak_MiB": 955.0, "bound_share": 0.61, "dtoh_overlap": 0.93, "htod_overlap": 0.972, "replans": 1},
    ]}))  # fmt: skip
    text = device_check.bench_rows(str(path))
    assert "| fxoffload-auto | 49.0 | 1.03 | 9,000 | 955.0 | 61% | 93% | 97% | 1 | ok |" in text, text
    assert "`python -m bench x`" in text and device_check.bench_rows(str(tmp_path / "none.json")) == ""


def test_device_check_reads_only_this_runs_op_table(tmp_path):
    """A log kept from an earlier run: the summary takes the op table printed after this part began."""
    from bench import device_check

    log = tmp_path / "device_check.log"
    log.write_text("device: an earlier run\n| offload | 1.0 |\n===== ops: ok\n")
    begin = log.stat().st_size
    with open(log, "a") as f:
        f.write("===== ops: failed (rc 1)\n")
    assert device_check._ops_lines(str(log), begin) == ""
    assert "an earlier run" in device_check._ops_lines(str(log), 0)


def test_bench_json_keeps_the_rows_of_methods_that_finished(tmp_path, monkeypatch):
    """``--json`` is written after every method: a run stopped by a time limit keeps what it measured."""
    import bench.__main__ as cli

    calls = []

    def run_method(method, *args, **kwargs):
        calls.append(method.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands for the time limit's kill
        return {"method": method.name, "status": "ok", "note": "", "step_ms": 1.0}

    monkeypatch.setattr(cli, "run_method", run_method)
    path = tmp_path / "rows.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--device", "cpu", "--methods", "eager,inductor", "--json", str(path)])
    assert [r["method"] for r in json.loads(path.read_text())["rows"]] == ["eager"]


def test_the_timed_steps_start_once_fxoffload_has_settled():
    """A backend that times its copies and compiles again in its first steps is stepped past
    ``--warmup`` until ``settled`` (at most ``MAX_SETTLING_STEPS``): no timed step is one of those;
    the row says how many more steps it took. On an H100 a re-plan fell in the timed steps."""
    from bench import runner

    class Backend:
        def __init__(self, after):
            self.after, self.steps = after, 0

        @property
        def settled(self):
            return self.steps >= self.after

    def prepared_for(backend):
        def step():
            backend.steps += 1
            return torch.ones(())

        return types.SimpleNamespace(step=step, backend=backend, offloaded_bytes=lambda: 0)

    ctx = Context(torch.device("cpu"), min_bytes=0, inner="aot_eager", amp=None)
    workload = types.SimpleNamespace(items_per_step=1)
    for after, want in ((9, 9 - 1 - 2), (2, 0), (10**6, runner.MAX_SETTLING_STEPS)):
        backend, row = Backend(after), {"note": ""}
        runner._measure(row, prepared_for(backend), workload, ctx, 3, 2, 0, lambda _: None)
        assert row["settling_steps"] == want, (after, row)
        assert ("still measuring" in row["note"]) == (after > 100), row
        assert row["first_steps_s"] >= row["first_step_s"]


def test_corrected_model_rows(capsys):
    """``bench.corrected_model`` on one link and dtype: a row with the corrected model's compute against
    the plain step; a bad dtype is refused by name."""
    from bench.corrected_model import main, measure

    m = measure(50e6, bf16=False, steps=2)
    assert m["replans"] >= 1 and m["base_ms"] > 0 and m["model_x"] == pytest.approx(m["model_ms"] / m["base_ms"])
    with pytest.raises(SystemExit):
        main(["--links", "50MB", "--dtypes", "fp16"])
    assert "'fp16' is not one of fp32, bf16" in capsys.readouterr().err


def test_first_plan_rows(capsys):
    """``bench.first_plan`` on one link and dtype: the first plan's stall and bytes, then auto as it
    ships; the margin it was given is put back; a bad dtype is refused by name."""
    from bench.first_plan import main, measure
    from fxoffload.analysis import cost

    before = cost.FIRST_GUESS_MARGIN
    m = measure(500e6, bf16=False, margin=0.6, steps=2)
    assert cost.FIRST_GUESS_MARGIN == before
    assert m["base_ms"] > 0 and m["first_mib"] > 0 and m["first_stall_ms"] >= 0 and m["settling"] >= 1
    assert m["replans"] > 0 or m["mib"] == m["first_mib"]  # not planned again: the first plan stays
    with pytest.raises(SystemExit):
        main(["--links", "50MB", "--dtypes", "fp16"])
    assert "'fp16' is not one of fp32, bf16" in capsys.readouterr().err
