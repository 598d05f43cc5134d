"""Each block compiled on its own, on a CPU: predicted against measured peak memory of a steady step.

torchtitan-style per-block compilation: ``torch.compile`` wraps each block of the built-in GPT, and
Dynamo compiles one graph that every block then runs. The graph's report counts what the code around
each call holds (``report.outside``: what earlier blocks saved, every other block's parameters, and
the later blocks' gradients during a call's backward), read at the calls of the first step; with a
``memory_budget`` that one of those calls misses, the graph is planned again for all of them at the
next step (``report.replans``).

Measured: ``fxoffload.measure_memory`` of one step after three (the plan made again at the second),
the CPU allocator's events, fxoffload's host buffers left out. "Everything" is the measured peak above
the step's start plus what was live at the start (every parameter and the batch): what the device
holds, which is what ``memory_budget`` counts. Predicted: the graph's peak at its worst call (the
replay of Inductor's code under Inductor, the FX memory model under aot_eager), which counts the
same things; given where the graph was planned for all its calls (a budget a call missed), since the
other plans count the call they were compiled for. Budgets are in bytes, a fraction of the step's
measured peak without fxoffload.

    python -m bench.blocks                               # GPT, 4 layers, both inner compilers
    python -m bench.blocks --layers 8 --batch 16 --budgets 0.5,0.4

CPU figures: every tensor, "device" and host alike, is a CPU tensor (``offload_cpu=True``).
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.measure.allocator import measure_steady_step
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch


def measure(
    inner: str, plan: str, layers: int = 4, batch: int = 8, budget: int | None = None, **options: object
) -> dict:
    """One row: ``plan`` "baseline" (each block compiled by ``inner`` alone), "none", "all", "auto", or
    "budget" (policy auto, ``memory_budget=budget`` bytes); ``options``: more of fxoffload's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers)
    model, (idx, targets) = GPT(cfg), gpt_batch(cfg, batch)
    backend: object = inner
    if plan != "baseline":
        plan_options = {"policy": "auto", "memory_budget": budget} if plan == "budget" else {"policy": plan}
        backend = fxoffload.backend(offload_cpu=True, inner=inner, min_bytes=0, **plan_options, **options)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend)

    def step() -> None:
        model(idx, targets).backward()

    memory, caught = measure_steady_step(step, 3, lambda: model.zero_grad(set_to_none=True))
    start = sum(p.nbytes for p in model.parameters()) + idx.nbytes + targets.nbytes
    row = {"inner": inner, "layers": layers, "batch": batch, "plan": plan}
    row["measured"] = memory.cpu.peak_bytes + start
    if plan == "baseline":
        return row
    report = backend.reports[-1]  # the blocks' graph (planned again: recorded again)
    if report.outside is not None and report.outside.calls:  # planned for all its calls: a prediction
        row["predicted"] = report.expected_memory().peak_bytes
    row["graphs"] = len(backend.reports)
    row["offloaded"] = f"{len(report.offloaded)} of {len(report.saved)}"
    row["replans"] = len(report.replans)
    row["budget"] = budget
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    row["warned"] = any("memory_budget" in s for s in said)
    return row


def table(rows: list[dict], tablefmt: str = "simple") -> str:
    base = {(r["inner"], r["layers"], r["batch"]): r["measured"] for r in rows if r["plan"] == "baseline"}
    out = []
    for r in rows:
        b = base.get((r["inner"], r["layers"], r["batch"]))
        budget = r.get("budget")
        met = ""
        if budget:
            met = "yes" if r["measured"] <= 1.03 * budget else "warned" if r.get("warned") else "NO"
        out.append({
            "inner": r["inner"], "layers": r["layers"], "batch": r["batch"], "plan": r["plan"],
            "offloaded": r.get("offloaded", ""), "planned again": r.get("replans", "") or "",
            "measured MiB": f"{r['measured'] / 2**20:.2f}",
            "predicted MiB": f"{r['predicted'] / 2**20:.2f}" if "predicted" in r else "",
            "predicted/measured": f"{r['predicted'] / r['measured'] - 1:+.1%}" if "predicted" in r else "",
            "vs baseline": "" if b is None or r["plan"] == "baseline" else f"{r['measured'] / b - 1:+.1%}",
            "budget MiB": f"{budget / 2**20:.2f}" if budget else "",
            "budget met": met,
        })  # fmt: skip
    return tabulate(out, headers="keys", tablefmt=tablefmt)


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--inner", default="aot_eager,inductor", help="comma-separated: aot_eager, inductor")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--plans", default="none,all,auto", help="comma-separated, of: none, all, auto")
    parser.add_argument("--budgets", default="0.35,0.3,0.25", help="fractions of the baseline's measured peak")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the profiler's memory events are per thread
    rows = []
    for inner in args.inner.split(","):
        base = measure(inner, "baseline", args.layers, args.batch)
        rows.append(base)
        for plan in filter(None, args.plans.split(",")):
            rows.append(measure(inner, plan, args.layers, args.batch))
        for fraction in filter(None, args.budgets.split(",")):
            budget = int(float(fraction) * base["measured"])
            rows.append(measure(inner, "budget", args.layers, args.batch, budget))
        print(table(rows[-1 - len(args.plans.split(",")) - len(args.budgets.split(",")):]), flush=True)
    print(table(rows, "github"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        main()
