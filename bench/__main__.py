"""Peak memory and step time of fxoffload next to what users would pick instead.

    python -m bench --workload gpt --preset tiny --steps 2 --device cpu     # CPU smoke run
    python -m bench --workload gpt --preset gpt2-medium --png gpt2m.png     # on a GPU
    python -m bench --workload hf-llama --preset medium --methods eager,fxoffload-budget,checkpoint \
        --budgets 0.7,0.5
    python -m bench --workload llama --preset 7b-4l-bf16 --amp bf16 --budgets 0.8,0.6,0.4 \
        --methods inductor,fxoffload-auto,fxoffload-budget,fxoffload-recompute,inductor-amb,checkpoint

Workloads (presets): gpt (tiny, small, gpt2-medium), hf-gpt2 (tiny, gpt2-medium), hf-llama (tiny,
medium), hf-albert (tiny, base: one layer's weights shared by all), cnn (tiny, resnet18), seq2seq (tiny, thread), llama (tiny, 7b-4l, 7b-4l-bf16: four blocks of
Llama-2-7B at 2,048 tokens), dit (tiny, video-16k, video-32k: diffusion-transformer blocks over a long
video token sequence), unet (tiny, sd-64: a diffusion UNet on the noise-prediction loss). The hf-*
ones need `transformers`.

Methods: eager, inductor, inductor-noreuse, fxoffload-auto, fxoffload-all, fxoffload-budget[=F],
fxoffload-recompute[=F], save_on_cpu, streamed, checkpoint, inductor-amb[=F], intree (see
bench/methods.py). Each runs on a fresh deep copy of the same model with the same seed; the first
step's loss of every method is compared with eager's. Every row is set against the compiler alone
(inductor, else eager): step time as a multiple, the bytes that left the peak, and for fxoffload that
against the bound it measured (the link's bytes/s x the forward's time: what can leave the peak
without a stall).

A step is forward + backward (no optimizer). GPU: peak allocated/reserved over the timed steps,
median step time from CUDA events, throughput, bytes copied to/from the host and the achieved link
GB/s from one profiled extra step. CPU: median step time, the first step's time (with the compile)
and fxoffload's predicted peak; CPU figures are labelled CPU and say nothing about GPU memory. Both:
the measured peak of one extra step, bytes above what was live at its start (fxoffload.measure_memory;
on a CPU, fxoffload's host buffers are left out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from typing import Any

import torch
from tabulate import tabulate

from fxoffload.options import parse_bytes

from .methods import DEFAULT, Context, parse_methods
from .plot import plot
from .runner import check_losses, run_method
from .workloads import WORKLOADS, WorkloadUnavailable, build

COLUMNS = (  # (row key, header, format); columns with no value in any row are left out
    ("method", "method", "{}"),
    ("status", "status", "{}"),
    ("loss", "loss (1st step)", "{:.6f}"),
    ("loss_ok", "same loss", None),
    ("first_step_s", "1st step s (compile)", "{:.2f}"),
    ("first_steps_s", "steps to settled s", "{:.2f}"),
    ("settling_steps", "steps past warmup", "{}"),
    ("step_ms", "step ms (median)", "{:.2f}"),
    ("throughput", "throughput", "{:,.0f}"),
    ("peak_alloc_MiB", "peak alloc MiB", "{:,.1f}"),
    ("peak_reserved_MiB", "peak reserved MiB", "{:,.1f}"),
    ("measured_peak_MiB", "measured peak MiB (above start)", "{:,.2f}"),
    ("predicted_before_MiB", "predicted peak MiB (no offload)", "{:,.2f}"),
    ("predicted_after_MiB", "predicted peak MiB", "{:,.2f}"),
    ("offloaded_MiB", "offloaded MiB/step", "{:,.2f}"),
    ("time_x", "step time x baseline", "{:.2f}"),
    ("model_x", "model's compute x baseline step", "{:.2f}"),
    ("left_peak_MiB", "left the peak MiB", "{:,.1f}"),
    ("offload_bound_MiB", "bound MiB (link x fw)", "{:,.1f}"),
    ("bound_share", "of the bound", "{:.0%}"),
    ("measured_stall_ms", "stall ms (measured)", "{:.2f}"),
    ("dtoh_MiB", "D2H MiB (trace)", "{:,.1f}"),
    ("dtoh_GBps", "D2H GB/s", "{:.1f}"),
    ("htod_GBps", "H2D GB/s", "{:.1f}"),
    ("dtoh_overlap", "D2H overlapped", "{:.0%}"),
    ("htod_overlap", "H2D overlapped", "{:.0%}"),
    ("host_bound_share", "kernels waiting on the host", "{:.0%}"),
    ("note", "note", "{}"),
)


def table(rows: list[dict[str, Any]], unit: str) -> str:
    used = [c for c in COLUMNS if any(r.get(c[0]) not in (None, "") for r in rows)]
    body = []
    for r in rows:
        line = []
        for key, _, fmt in used:
            value = r.get(key)
            if key == "loss_ok":
                line.append("" if value is None else "yes" if value else "MISMATCH")
            else:
                line.append("" if value is None else fmt.format(value))
        body.append(line)
    headers = [f"{unit}/s" if key == "throughput" else header for key, header, _ in used]
    return tabulate(
        body, headers=headers, disable_numparse=True, maxcolwidths=[None] * (len(used) - 1) + [60]
    )


def against_baseline(rows: list[dict[str, Any]]) -> None:
    """Each row against the compiler alone ("inductor", else "eager"): its step time as a multiple (and
    the compute its plan's model predicts, as corrected by the first steps, against the same step), the
    bytes its method took off the peak, and, for an offloading method, that against the bound it
    measured (bytes that can leave the peak without a stall: the link's bytes/s x the forward's time)."""
    base = next((r for r in rows if r["method"] == "inductor" and r["status"] == "ok"), None)
    base = base or next((r for r in rows if r["method"] == "eager" and r["status"] == "ok"), None)
    if base is None:
        return
    key = "peak_alloc_MiB" if base.get("peak_alloc_MiB") is not None else "measured_peak_MiB"
    for r in rows:
        if r["status"] != "ok" or r is base:
            continue
        if r.get("step_ms") and base.get("step_ms"):
            r["time_x"] = r["step_ms"] / base["step_ms"]
            if r.get("predicted_compute_ms"):  # how far the plan's model is from the device
                r["model_x"] = r["predicted_compute_ms"] / base["step_ms"]
        if r.get(key) is not None and base.get(key) is not None:
            r["left_peak_MiB"] = base[key] - r[key]
            if r.get("offload_bound_MiB"):
                r["bound_share"] = max(0.0, r["left_peak_MiB"]) / r["offload_bound_MiB"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="gpt", choices=sorted(WORKLOADS))
    parser.add_argument("--preset", default="tiny", help="a preset of the workload (listed above)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the preset's)")
    parser.add_argument("--methods", default=DEFAULT, help="comma-separated (default: all)")
    parser.add_argument("--budgets", default="0.8,0.5", help="fractions in (0, 1] for the budget sweeps")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compile) step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default=None,
        choices=("cpu", "cuda"),
        help="where to run (default: cuda where CUDA is available, else cpu)",
    )
    parser.add_argument(
        "--min-bytes",
        default=None,
        help="fxoffload's and the streamed offloader's threshold (default: 1MiB on a GPU, 16KiB on a CPU)",
    )
    parser.add_argument(
        "--inner",
        default="inductor",
        choices=("inductor", "aot_eager"),
        help="fxoffload's inner compiler (aot_eager: faster compile, eager kernels)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for CPU ops (default: torch's own; 1 is steadier on a shared machine)",
    )
    parser.add_argument("--amp", default="none", choices=("none", "bf16"), help="autocast on the GPU")
    parser.add_argument("--json", default=None, help="write conditions and rows to this file")
    parser.add_argument("--cpu-link", default=None, help="on a CPU: the speed of fxoffload's emulated host "
                        "link (offload_cpu's copy threads), e.g. 2GB for 2 GB/s; default: as fast as memory allows")
    parser.add_argument("--png", default=None, help="draw peak memory against step time to this file")
    parser.add_argument("--trace", default=None, metavar="DIR", help="on a GPU: write the profiled step of "
                        "each method (the compiler alone's too) to DIR/<method>.json.gz (device activity; "
                        "measure.trace reads them)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    try:
        methods = parse_methods(args.methods, args.budgets)
        min_bytes = parse_bytes(args.min_bytes or ("1MiB" if cuda else "16KiB"), "--min-bytes")
        cpu_link = None if args.cpu_link is None else parse_bytes(args.cpu_link, "--cpu-link")
        if cpu_link is not None and cuda:
            raise ValueError("--cpu-link emulates a host link on a CPU; a GPU run uses its real link")
        device = torch.device("cuda" if cuda else "cpu")
        workload = build(args.workload, args.preset, device, args.batch, args.seed)
    except ValueError as e:
        parser.error(str(e))
    except WorkloadUnavailable as e:
        print(f"skipped: {e}", flush=True)
        if args.json:
            _write_json(args.json, {"skipped": str(e), "command": _command(argv)}, [])
        return 0
    if args.amp == "bf16" and not cuda:
        print("note: --amp bf16 is for GPU runs; this CPU run is fp32", flush=True)
    ctx = Context(device, min_bytes, args.inner, torch.bfloat16 if args.amp == "bf16" and cuda else None,
                  cpu_link=cpu_link, trace_dir=args.trace)  # fmt: skip

    conditions = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name()
        if cuda
        else f"CPU ({os.cpu_count()} cores; figures are CPU-only)",
        "gpu": cuda,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "workload": args.workload,
        "preset": args.preset,
        "model": workload.description,
        "throughput_unit": f"{workload.unit}/s",
        "dtype": "bf16 autocast" if ctx.amp else "fp32",
        "cpu_threads": torch.get_num_threads(),
        "steps": args.steps,
        "warmup": args.warmup,
        "min_bytes": min_bytes,
        "cpu_link_bytes_per_s": cpu_link,
        "fxoffload_inner": args.inner,
        "step": "forward + backward + zero_grad, no optimizer",
        "command": _command(argv),
    }
    print(
        f"# {conditions['date']}  {conditions['device']}  torch {conditions['torch']}  {conditions['dtype']}"
    )
    print(f"# {workload.description}", flush=True)
    rows = []
    for i, method in enumerate(methods, 1):
        print(f"[{i}/{len(methods)}] {method.name} ...", flush=True)
        row = run_method(method, workload, ctx, args.steps, args.warmup, args.seed, progress=_progress)
        if row["status"] != "ok":
            print(f"    {row['status']}: {row['note']}", flush=True)
        rows.append(row)
        if args.json:  # the rows so far: a run stopped by a time limit keeps the methods it finished
            _write_json(args.json, conditions, rows)
    check_losses(rows, rtol=2e-2 if ctx.amp else 1e-3)
    against_baseline(rows)
    print(table(rows, workload.unit))
    if args.json:
        _write_json(args.json, conditions, rows)
        print(f"wrote {args.json}")
    if args.png:
        why_not = plot(rows, conditions, args.png)
        print(why_not or f"wrote {args.png}")
    bad = [r["method"] for r in rows if r["status"] == "failed" or r.get("loss_ok") is False]
    if bad:
        print(f"failed or different loss: {', '.join(bad)}", flush=True)
    return 1 if bad else 0


def _progress(line: str) -> None:
    print(line, flush=True)


def _command(argv: list[str]) -> str:
    return "python -m bench " + " ".join(shlex.quote(a) for a in argv)


def _write_json(path: str, conditions: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"conditions": conditions, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
