"""Peak memory and step time of fxoffload next to eager and Inductor.

    python -m bench --preset tiny --steps 2           # CPU smoke run (offload_cpu=True, labelled CPU)
    python -m bench --preset gpt2-medium --batch 8    # on a GPU

GPU metrics: peak allocated and reserved (MiB), median step time over the timed steps (CUDA events,
compile and warm-up steps excluded), offloaded bytes. CPU metrics: median step time and compile time;
CPU numbers are labelled as such and say nothing about GPU memory.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.models import GPT, PRESETS, gpt_batch

METHODS = ("eager", "inductor", "fxoffload-auto", "fxoffload-all")


def make_backend(method: str, cpu: bool):
    if method == "eager":
        return None
    if method == "inductor":
        return "inductor"
    extra = {"offload_cpu": True, "min_bytes": "16KiB"} if cpu else {}
    return fxoffload.backend(policy=method.split("-")[1], **extra)


def run_method(method, model, batch, steps, warmup, device):
    model = copy.deepcopy(model)
    backend = make_backend(method, device == "cpu")
    fn = model if backend is None else torch.compile(model, backend=backend)

    def step():
        loss = fn(*batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step()  # compile (and first run)
    if device == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        step()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
    else:
        for _ in range(steps):
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    row = {
        "method": method,
        "step_ms": statistics.median(times),
        "compile_s": compile_s,
        "offloaded_MiB": sum(r.offloaded_bytes for r in getattr(backend, "reports", [])) / 2**20,
    }
    if device == "cuda":
        row["peak_alloc_MiB"] = torch.cuda.max_memory_allocated() / 2**20
        row["peak_reserved_MiB"] = torch.cuda.max_memory_reserved() / 2**20
    torch._dynamo.reset()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", default=None, help="write the rows and conditions to this file")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        parser.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    batch = gpt_batch(cfg, args.batch, device)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (figures are CPU-only)"
    conditions = {
        "date": datetime.date.today().isoformat(),
        "device": where,
        "torch": torch.__version__,
        "preset": args.preset,
        "batch": args.batch,
        "steps": args.steps,
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"# {conditions}", flush=True)
    rows = []
    for i, method in enumerate(methods, 1):
        print(f"[{i}/{len(methods)}] {method} ...", flush=True)
        rows.append(run_method(method, model, batch, args.steps, args.warmup, device))
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
