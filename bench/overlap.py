"""Overlap measured on a CPU: time the compute thread waits on copies, against the predicted stall.

With ``offload_cpu=True`` the copies run on fxoffload's CPU copy engine (one thread per direction),
throttled to ``cpu_link_bandwidth``; the cost model prices copies at the same link. For each link
speed and policy this trains a few steps through Inductor and reports, per step, the seconds the
compute thread spent blocked in ``fxoffload.wait`` (per direction) beside the plan's predicted stall.

    python -m bench.overlap                 # GPT tiny, links 20 MB/s .. 2 GB/s, policies auto and all

CPU figures: compute and copies share two cores here, so they say whether waiting happens where the
plan says it does, not what a GPU would see.
"""

from __future__ import annotations

import argparse
import time

import torch

import fxoffload
from fxoffload.runtime import copy_engine
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

from .runner import settle

SETTLING_STEPS = 16


def measure(model, args, steps: int = 3, **options) -> dict[str, float]:
    """Per-step wait and copy seconds (d2h, h2d), copies per step, step seconds, the predicted stall
    and the plans made again, after one warm-up step and those until ``backend.settled`` (``auto``
    plans again where its first steps measured a copy stalling)."""
    backend = fxoffload.backend(offload_cpu=True, inner="inductor", **options)
    compiled = torch.compile(model, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        compiled(*args).backward()

    step()  # compile and warm up, then on until the first steps' measurements are acted on
    settle(backend, step, SETTLING_STEPS)
    copy_engine.reset_copy_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - t0) / steps
    stats = copy_engine.copy_stats()
    return {
        "offloaded": sum(len(r.offloaded) for r in backend.reports),
        "predicted_stall_s": sum(r.predicted_stall_ms for r in backend.reports) / 1e3,
        "wait_d2h_s": stats.wait_seconds["d2h"] / steps,
        "wait_h2d_s": stats.wait_seconds["h2d"] / steps,
        "copy_d2h_s": stats.copy_seconds["d2h"] / steps,
        "copy_h2d_s": stats.copy_seconds["h2d"] / steps,
        "copies": (stats.copies["d2h"] + stats.copies["h2d"]) / steps,
        "step_s": seconds,
        "replans": sum(len(r.replans) for r in backend.reports),
        "kept_measured_stalling": sum(r.reason_code == "measured_stall" for rep in backend.reports for r in rep.saved),
        "kept_barely_lowering": sum(r.reason_code == "peak_barely_lowered" for rep in backend.reports for r in rep.saved),
    }


def wait_per_copy(m: dict[str, float]) -> float:
    """Mean seconds the compute thread waited per copy: ~0 for a hidden copy, most of its copy time
    for one that is not."""
    return (m["wait_d2h_s"] + m["wait_h2d_s"]) / max(m["copies"], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", default="20e6,200e6,2e9", help="link speeds in bytes/s (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    from tabulate import tabulate

    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    rows = []
    for link in (float(x) for x in opts.links.split(",")):
        for policy in ("auto", "all"):
            torch._dynamo.reset()
            m = measure(model, batch, opts.steps, policy=policy, min_bytes="16KiB", cpu_link_bandwidth=link)
            rows.append((f"{link / 1e6:g} MB/s", policy, m["offloaded"], f"{m['predicted_stall_s'] * 1e3:.1f}",
                         f"{(m['wait_d2h_s'] + m['wait_h2d_s']) * 1e3:.1f}", f"{m['wait_d2h_s'] * 1e3:.1f}",
                         f"{m['wait_h2d_s'] * 1e3:.1f}", f"{wait_per_copy(m) * 1e3:.2f}",
                         f"{m['step_s'] * 1e3:.1f}"))  # fmt: skip
            print(rows[-1], flush=True)
    print(f"GPT tiny ({cfg.layers} layers, batch 8, seq {cfg.seq}), torch {torch.__version__}, CPU copy engine")
    print(tabulate(rows, headers=("link", "policy", "offloaded", "predicted stall ms", "measured wait ms",
                                  "d2h wait ms", "h2d wait ms", "wait per copy ms", "step ms")))  # fmt: skip


if __name__ == "__main__":
    main()
