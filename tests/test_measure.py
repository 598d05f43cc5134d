"""fxoffload.measure_memory: figures from the allocator itself, checked to the byte on hand-computed cases."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import fxoffload
from fxoffload.runtime import copy_engine, host_pool
from fxoffload.measure.allocator import DeviceMemory, _tracking_cpu_frees, cpu_memory_from_trace, measure_memory

MiB = 2**20


def test_temporaries_and_the_result_to_the_byte():
    def step():
        kept = torch.empty(MiB // 4)  # 1 MiB of fp32, returned: alive at the end
        temp = torch.empty(3 * MiB // 4)  # 3 MiB, freed before the next allocation
        del temp
        odd = torch.empty(1001, dtype=torch.uint8)  # requested bytes, not a rounded block
        del odd
        return kept

    m = measure_memory(step)
    assert m.cpu.device == "cpu"
    assert m.cpu.peak_bytes == 4 * MiB
    assert m.cpu.end_bytes == MiB
    assert m.cpu.allocations == 3
    assert m.cpu.peak_op == "aten::empty"
    # Frees of earlier blocks: unseen (None) until some code of this process called track_cpu_frees
    # (a one-way switch), then seen and none here (0).
    assert m.cpu.excluded_bytes == 0 and m.cpu.freed_earlier_bytes == (0 if _tracking_cpu_frees() else None)
    assert m.result.shape == (MiB // 4,)
    assert m["cpu"] is m.cpu


def test_the_profilers_start_and_stop_notices_stay_off_stderr(capfd):
    """torch 2.13's kineto writes ``USDT: ... profiler_start`` and ``profiler_stop`` to stderr for
    every session, and fxoffload starts sessions of its own (op scratch while planning on a CPU):
    those two lines are dropped, anything else written meanwhile reaches stderr."""
    import os

    from fxoffload.measure import profiler

    capfd.readouterr()
    measure_memory(lambda: torch.ones(1000) + 1)
    assert "profiler_st" not in capfd.readouterr().err
    with profiler._notices_dropped():
        os.write(2, b"USDT:2026-11-29 16:27:51 10731:10731 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real error\n")
        os.write(2, b"USDT:2026-11-29 16:27:52 10731:10731 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "a real error\n"


def test_a_steady_step_after_warm_up_calls():
    """``measure_steady_step``: the warm-up calls are not measured (the first one allocates 8 MiB more,
    as a compile would), their warnings come back, and ``before_each`` runs before every call."""
    import warnings

    calls = []

    def step():
        if not calls.count("step"):
            warnings.warn("compiling")
            torch.empty(2 * MiB)  # 8 MiB, the first call only
        calls.append("step")
        return torch.empty(MiB // 4)  # 1 MiB

    m, caught = fxoffload.measure_steady_step(step, warmup=2, before_each=lambda: calls.append("reset"))
    assert calls == ["reset", "step"] * 3
    assert m.cpu.peak_bytes == MiB and [str(w.message) for w in caught] == ["compiling"]


def test_unrounded_sizes_and_a_peak_inside_an_op():
    a = torch.ones(1001)  # 4004 bytes

    def step():
        b = a * 2  # 4004 bytes, freed at the end of the step
        return (b + 1).sum()  # b + 1: another 4004 bytes, then the sum's 4

    m = measure_memory(step)
    # Each Python scalar becomes a CPU tensor: 8 bytes (double), then 4 (converted to fp32), both
    # freed when the op returns. Peak inside the add: b, the 8 + 4 of the scalar 1, and b + 1.
    assert m.cpu.peak_bytes == 4004 + 8 + 4 + 4004
    assert m.cpu.peak_op == "aten::add"
    assert m.cpu.end_bytes == 4  # the returned sum
    assert m.cpu.allocations == 3 + 3 + 1  # mul: 8, 4, b; add: 8, 4, b + 1; sum


def test_a_free_of_a_block_from_before_the_start():
    # Without track_cpu_frees, in a process of its own (other tests may have switched it on here).
    code = textwrap.dedent("""
        import torch
        from fxoffload.measure.allocator import measure_memory
        held = [torch.empty(1000)]
        m = measure_memory(held.clear)
        print(m.cpu.peak_bytes, m.cpu.end_bytes, m.cpu.freed_earlier_bytes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The allocator did not know the block's size, so the profiler reported no free: unseen.
    assert out.stdout.split() == ["0", "0", "None"]


def test_track_cpu_frees_counts_earlier_blocks_below_the_start():
    # A one-way switch for the whole process: run it in its own.
    code = textwrap.dedent("""
        import torch
        from fxoffload.measure.allocator import measure_memory, track_cpu_frees
        assert track_cpu_frees()
        held = [torch.empty(1000)]
        def step():
            held.clear()  # 4000 bytes from before the start
            return torch.empty(500)  # 2000 bytes, alive at the end
        m = measure_memory(step)
        print(m.cpu.peak_bytes, m.cpu.end_bytes, m.cpu.freed_earlier_bytes, m.cpu.allocations)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "-2000", "4000", "1"]


def test_trace_rules_by_hand():
    """A host buffer that is live at the end is left out, by address, size and time; so is the free
    of one held at the start; the peak names the innermost op of its thread; a free of an unknown
    block counts only when earlier frees are seen."""

    def mem(ev, ts, addr, nbytes, tid=1):
        args = {"Addr": addr, "Bytes": nbytes, "Device Type": 0, "Ev Idx": ev}
        return {"name": "[memory]", "ph": "i", "ts": ts, "tid": tid, "args": args}

    def op(name, ts, dur, tid=1):
        return {"name": name, "ph": "X", "cat": "cpu_op", "ts": ts, "dur": dur, "tid": tid}

    events = [
        op("outer", 0, 100), op("aten::mm", 10, 20), op("other thread", 0, 100, tid=2),
        mem(1, 2, 0x9000, 4096),  # a temporary at the address a host buffer takes later: counted
        mem(2, 3, 0x9000, -4096),
        mem(3, 5, 0x1000, 300),  # counted
        mem(4, 12, 0x9000, 4096),  # the host buffer, live at the end: left out
        mem(5, 15, 0x2000, 200),  # counted: peak 500 (4096 before it), inside aten::mm
        mem(6, 40, 0x2000, -200),
        mem(7, 41, 0x7000, -1024),  # a host buffer held at the start, dropped by its pool
        mem(8, 42, 0x5000, -700),  # a block from before the start
        {"name": "[memory]", "ph": "i", "ts": 43, "args": {"Addr": 1, "Bytes": 64, "Device Type": 1}},  # CUDA
    ]  # fmt: skip
    before, after = [(0x7000, 1024)], [(0x9000, 4096)]
    unseen = cpu_memory_from_trace(events, before, after, freed_earlier_seen=False)
    assert unseen == DeviceMemory(
        device="cpu", peak_bytes=4096, end_bytes=300, allocations=3, peak_event=1, peak_op="outer",
        excluded_bytes=4096, freed_earlier_bytes=None,
    )  # fmt: skip
    seen = cpu_memory_from_trace(events, before, after, freed_earlier_seen=True)
    assert (seen.peak_bytes, seen.end_bytes, seen.freed_earlier_bytes) == (4096, -400, 700)
    # Without the first temporary the peak is the 300 + 200 inside aten::mm.
    rest = cpu_memory_from_trace(events[:3] + events[5:], before, after, freed_earlier_seen=False)
    assert (rest.peak_bytes, rest.peak_event, rest.peak_op, rest.allocations) == (500, 5, "aten::mm", 2)
    # Not a host buffer at the end: its 4096 bytes count.
    counted = cpu_memory_from_trace(events, before, [], freed_earlier_seen=False)
    assert (counted.peak_bytes, counted.end_bytes, counted.excluded_bytes) == (4096 + 300 + 200, 4396, 0)


def test_errors():
    with pytest.raises(ValueError, match="first argument must be callable .* got Tensor"):
        measure_memory(torch.ones(2))

    def boom():
        torch.empty(10)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        measure_memory(boom)
    # The profiler was stopped on the way out: the next measurement works.
    assert measure_memory(torch.empty, 256).cpu.end_bytes == 1024


def _mlp_step(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )  # fmt: skip
    x = torch.randn(128, 64)
    fn = torch.compile(model, backend=backend)

    def step():
        fn(x).sum().backward()
        model.zero_grad(set_to_none=True)

    return step


def test_host_pool_buffers_are_left_out():
    torch._dynamo.reset()
    fxoffload.release_host_memory()
    host_pool.STAGING_POOL.clear()
    # The CPU link's speed is measured at the process's first copy (two 48 MiB buffers): measured
    # here first, or the first step's peak has them when this test is the first to copy.
    copy_engine.memcpy_rate()
    backend = fxoffload.backend(offload_cpu=True, policy="all", min_bytes=0, inner="aot_eager")
    step = _mlp_step(backend)
    first = measure_memory(step)  # compiles, and the pools allocate their buffers, kept after the step
    assert sum(r.offloaded_bytes for r in backend.reports) > 0
    pools = host_pool.host_pool_stats().bytes_allocated + host_pool.STAGING_POOL.stats().bytes_allocated
    assert pools > 0 and first.cpu.excluded_bytes == pools
    assert first.cpu.end_bytes == 0  # the pools' bytes, still held, do not appear
    # Every figure repeats step to step; the profiler's event index of the peak need not (the
    # events of other threads, e.g. the copy engine's, are numbered in the same sequence).
    steady = [dataclasses.replace(measure_memory(step).cpu, peak_event=None) for _ in range(2)]
    assert steady[0] == steady[1]
    assert steady[0].excluded_bytes == 0  # buffers reused: no allocation in the pools
    assert steady[0].peak_bytes == first.cpu.peak_bytes
    torch._dynamo.reset()


def test_inductor_step_is_reproducible():
    torch._dynamo.reset()
    step = _mlp_step("inductor")
    step()  # compile
    runs = [measure_memory(step).cpu for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    # Not less than the largest tensor a step makes: the 128x256 fp32 hidden activations (128 KiB).
    assert runs[0].peak_bytes >= 128 * 256 * 4 and runs[0].end_bytes == 0
    torch._dynamo.reset()


def test_explain_and_measure_restores_the_model():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    x = torch.randn(128, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reports, measured = fxoffload.explain_and_measure(
        model, x, offload_cpu=True, policy="all", min_bytes=0, inner="aot_eager"
    )
    assert len(reports) == 1 and reports[0].offloaded_bytes > 0
    # Steady: nothing left behind by the step, and at least the 128x256 hidden activations were live.
    assert measured.cpu.end_bytes == 0 and measured.cpu.peak_bytes >= 128 * 256 * 4
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch._dynamo.reset()


def test_cli_explain_measure(capsys):
    from fxoffload.tools.cli import main

    torch._dynamo.reset()
    argv = ["explain", "--model", "gpt", "--device", "cpu", "--offload-cpu", "--policy", "all",
            "--min-bytes", "16KiB", "--inner", "aot_eager", "--measure"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "measured, one steady step (CPU, fxoffload's host buffers left out):\n  cpu: peak " in out
    assert "  predicted peak with fxoffload: " in out
    assert "of parameters, buffers and inputs live at the start" in " ".join(out.split())  # lines wrap
    torch._dynamo.reset()


def test_the_calls_of_generated_code_run_alone_on_its_layouts():
    """``call_temporaries``: each call of the code runs alone on made-up operands of the layouts the
    code gives them (``code_memory.extern_calls``); what it holds above its results while it runs is
    its scratch, by line. ``native_dropout_backward`` casts its bool mask to the gradient's dtype on a
    CPU: one 16 KiB buffer here. An fp32 ``mm`` into its ``out=`` buffer holds none (not listed);
    fxoffload's own ops, an extern kernel without an aten namesake and a call on an empty tensor do
    not run (the calibration's rules)."""
    from fxoffload.analysis.code_memory import ExternCall
    from fxoffload.measure.standalone import call_temporaries

    f32, empty = ((64, 64), (64, 1), torch.float32), ((0, 64), (64, 1), torch.float32)
    mask = ((64, 64), (64, 1), torch.bool)
    dropout = "torch.ops.aten.native_dropout_backward.default"
    calls = [
        ExternCall(3, dropout, "buf0, buf1, 2.0", {"buf0": f32, "buf1": mask}),
        ExternCall(4, "extern_kernels.mm", "buf0, reinterpret_tensor(buf2, (64, 64), (1, 64), 0), out=buf3",
                   {"buf0": f32, "buf2": f32, "buf3": f32}),
        ExternCall(5, "torch.ops.fxoffload.reload.default", "buf0, 0", {"buf0": f32}),
        ExternCall(6, "extern_kernels._mm_plus_mm", "buf0, buf0, buf0, buf0", {"buf0": f32}),
        ExternCall(7, dropout, "buf0, buf1, 2.0", {"buf0": empty, "buf1": empty[:2] + (torch.bool,)}),
    ]  # fmt: skip
    got = call_temporaries(calls, torch.device("cpu"))
    assert list(got) == [3]
    assert 64 * 64 * 4 <= got[3] <= 64 * 64 * 4 + 64, got  # and a few bytes of a scalar's
