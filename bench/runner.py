"""Run one method on a fresh copy of the workload's model and measure it.

GPU: peak allocated and reserved bytes over the timed steps (``reset_peak_memory_stats`` after the
warm-up), the median step time from CUDA events around each step, and, from one extra step under
``torch.profiler``, the bytes every host<->device copy moved and the time the copies took on the
device (achieved link GB/s = bytes / copy time, per direction). CPU: median wall-clock step time.
Both: the measured peak of one more step (``fxoffload.measure_memory``: bytes above what was live at
its start, from the allocator; on a CPU fxoffload's host buffers are left out, while the host copies
of save_on_cpu and streamed are ordinary CPU tensors there and count).
Both: the first step's loss and wall time (compile included; reported apart, never in the median).
"""

from __future__ import annotations

import copy
import gc
import gzip
import json
import os
import re
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import fxoffload
from fxoffload.measure.trace import Trace, host_bound_share, overlap_share
from fxoffload.planning.budget import BUDGET_TOLERANCE

from .methods import Context, Method, Skip, prepare
from .workloads import Workload

MiB = 2**20
# Steps past --warmup that an fxoffload method may take to finish its first-step work (``settled``).
MAX_SETTLING_STEPS = 64


def settle(backend: Any, step: Callable[[], Any], limit: int = MAX_SETTLING_STEPS) -> int:
    """Step until ``backend.settled`` (its copies timed and acted on, re-plans compiled), ``limit`` steps
    at most; the steps taken."""
    taken = 0
    while not backend.settled and taken < limit:
        step()
        taken += 1
    return taken


def run_method(
    method: Method,
    workload: Workload,
    ctx: Context,
    steps: int,
    warmup: int,
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One row of the table: measured figures, or ``status`` "skipped"/"failed" with the reason."""
    row: dict[str, Any] = {"method": method.name, "status": "ok", "note": ""}
    _fresh_state(ctx)
    torch.manual_seed(seed)
    model = copy.deepcopy(workload.model).to(ctx.device)
    try:
        prepared = prepare(method, model, workload.batch, workload.blocks(model), ctx)
    except Skip as e:
        row.update(status="skipped", note=str(e))
        return row
    except Exception as e:
        row.update(status="failed", note=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        progress(traceback.format_exc(limit=-3).rstrip())
        return row
    row["note"] = prepared.note
    try:
        _measure(row, prepared, workload, ctx, steps, warmup, seed, progress)
    except Exception as e:  # a method that breaks is a row that says how, not a lost run
        row.update(status="failed", note=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        progress(traceback.format_exc(limit=-3).rstrip())
    finally:
        prepared.close()
    if prepared.backend is not None and prepared.backend.reports:
        reports = prepared.backend.reports
        row["predicted_before_MiB"] = max(r.predicted_peak_before for r in reports) / MiB
        row["predicted_after_MiB"] = max(r.predicted_peak_after for r in reports) / MiB
        if method.kind == "fxoffload-auto" and ctx.inner == "inductor":
            ctx.auto_reports = list(reports)
        recomputed = sum(len(getattr(r, "recomputed", ())) for r in reports)
        if recomputed:
            row["note"] = _join(
                row["note"], f"recomputes {recomputed} saved tensors instead of offloading them"
            )
        budgets = [r for r in reports if r.memory_budget is not None]
        if budgets:
            row["note"] = _join(row["note"], _budget_verdict(row, budgets, ctx.cuda))
        bounds = [r.offload_bound_bytes for r in reports if r.offload_bound_bytes is not None]
        if bounds:  # measured in the first steps: link x the forward's compute
            row["offload_bound_MiB"] = sum(bounds) / MiB
        if any(r.predicted_compute_ms for r in reports):  # the model, as corrected by the first steps
            row["predicted_compute_ms"] = sum(r.predicted_compute_ms for r in reports)
        stalls = [r.measured_stall_ms for r in reports if r.measured_stall_ms is not None]
        if stalls:
            row["measured_stall_ms"] = sum(stalls)
        row["replans"] = sum(len(r.replans) for r in reports)  # the reasons: in "reports" below
        # What each plan did and why, for the JSON (a GPU run's only detail once the machine is gone).
        row["reports"] = [r.summary() + "\n" + r.table(width=250) for r in reports]
    if prepared.late_note is not None:
        row["note"] = _join(row["note"], prepared.late_note())
    del model, prepared
    _fresh_state(ctx)
    return row


def _budget_verdict(row: dict[str, Any], budgets: list, cuda: bool) -> str:
    """Whether the budget was met: on the measured bytes where one graph holds it (the budget counts
    everything on the device: on a GPU the peak allocated, on a CPU the measured step's peak above its
    start plus what was live at the start), else on the code that runs (Inductor's replayed)."""
    tolerance = 1 + BUDGET_TOLERANCE
    if len(budgets) == 1 and (row.get("peak_alloc_MiB") if cuda else row.get("measured_peak_MiB")) is not None:
        (r,) = budgets
        peak = row["peak_alloc_MiB"] * MiB if cuda else row["measured_peak_MiB"] * MiB + r.start_bytes
        return f"budget {'met' if peak <= r.memory_budget * tolerance else 'NOT met'} on measured bytes"
    met = all(
        (r.expected_memory().peak_bytes if r.expected_memory() else 0) <= r.memory_budget * tolerance
        for r in budgets
    )
    return f"budget {'met' if met else 'NOT met'} by the code"


def _measure(row, prepared, workload: Workload, ctx: Context, steps, warmup, seed, progress) -> None:
    torch.manual_seed(seed)
    start = time.perf_counter()
    loss = prepared.step()  # the compile, for the compiled methods
    row["loss"] = float(loss)
    _sync(ctx)
    row["first_step_s"] = time.perf_counter() - start
    for _ in range(warmup):
        prepared.step()
    # fxoffload times its copies in the first steps and may plan again and compile: those steps are
    # first steps, not the steady state (on an H100 a re-plan fell in the timed steps of gpt2-medium).
    backend = prepared.backend
    settling = settle(backend, prepared.step) if backend is not None else 0
    _sync(ctx)
    if backend is not None:
        row["first_steps_s"] = time.perf_counter() - start
        row["settling_steps"] = settling
        if not backend.settled:
            row["note"] = _join(row.get("note", ""), f"still measuring its copies after {settling} more steps")
    times = []
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            prepared.step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        row["peak_alloc_MiB"] = torch.cuda.max_memory_allocated() / MiB
        row["peak_reserved_MiB"] = torch.cuda.max_memory_reserved() / MiB
    else:
        for _ in range(steps):
            begin = time.perf_counter()
            prepared.step()
            times.append((time.perf_counter() - begin) * 1e3)
    row["step_ms"] = statistics.median(times)
    row["throughput"] = workload.items_per_step / (row["step_ms"] / 1e3)
    offloaded = prepared.offloaded_bytes()
    if offloaded is not None:
        row["offloaded_MiB"] = offloaded / MiB
    measured = fxoffload.measure_memory(prepared.step)[ctx.device]
    row["measured_peak_MiB"] = measured.peak_bytes / MiB
    if ctx.cuda:
        keep = None
        if ctx.trace_dir is not None:  # the compiler alone's too: what a plan adds is told against it
            keep = os.path.join(ctx.trace_dir, re.sub(r"[^\w.-]", "_", row["method"]) + ".json.gz")
        row.update(measure_copies(prepared.step, keep))
    progress(
        f"    first step {row['first_step_s']:.2f} s, median step {row['step_ms']:.2f} ms, "
        f"loss {row['loss']:.6f}, measured peak {row['measured_peak_MiB']:.2f} MiB above the start"
    )


def measure_copies(step: Callable[[], Any], keep: str | None = None) -> dict[str, float]:
    """Bytes, device time and overlap of every host<->device copy in one step, from a profiler
    trace of the device's activity only (profiling the host too would slow a host-bound step and
    lower the overlap it measures); ``keep``: write that trace there too (gzipped Chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            raw = f.read()
        if keep is not None:
            os.makedirs(os.path.dirname(keep) or ".", exist_ok=True)
            with gzip.open(keep, "wb") as out:
                out.write(raw)
        return copies_from_trace(json.loads(raw))
    finally:
        os.unlink(path)


def copies_from_trace(trace: dict[str, Any]) -> dict[str, float]:
    """Per direction: MiB moved, ms the copies took on the device, their ratio in GB/s (10^9
    bytes/s), and the share of that time a kernel ran beside them (``measure.trace.overlap_share``:
    issue 23 asks 90%), from the ``gpu_memcpy`` events of a Chrome trace (Kineto's "Memcpy DtoH
    (Device -> Pinned)" with ``args.bytes``, ``ts`` and ``dur`` in microseconds). Device-to-device
    copies are left out. And the share of the compute stream's kernels that started within 50 us of
    their launch (``measure.trace.host_bound_share``): a host-bound step pays for every op call."""
    parsed = Trace(trace)
    gpu = parsed.gpu
    out: dict[str, float] = {}
    if parsed.has_cpu_ops:  # the launches: how many kernels the device waited on the host for
        out["host_bound_share"] = host_bound_share(parsed)
    for direction in ("DtoH", "HtoD"):
        nbytes = sum(g.nbytes for g in gpu if g.direction == direction)
        ms, _, share = overlap_share(gpu, direction)
        key = direction.lower()
        out[f"{key}_MiB"] = nbytes / MiB
        out[f"{key}_ms"] = ms
        out[f"{key}_GBps"] = nbytes / ms / 1e6 if ms > 0 else 0.0
        if ms > 0:
            out[f"{key}_overlap"] = share
    return out


def _sync(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def _fresh_state(ctx: Context) -> None:
    torch._dynamo.reset()
    fxoffload.release_host_memory()
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a and b else a or b


def check_losses(rows: list[dict[str, Any]], rtol: float) -> None:
    """Compare every first-step loss with eager's (else the first measured one): ``loss_ok``."""
    measured = [r for r in rows if "loss" in r]
    if not measured:
        return
    ref = next((r for r in measured if r["method"] == "eager"), measured[0])
    for r in measured:
        r["loss_ok"] = abs(r["loss"] - ref["loss"]) <= rtol * max(abs(ref["loss"]), 1e-12)
