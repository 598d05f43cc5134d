"""Planning time against graph size: GPT-style decoders of 4 to 48 layers.

    python -m bench.planner [--layers 4,8,16,32,48] [--bandwidth 2GB]

Times the whole fxoffload pass on the partitioned graphs (hoisting, lifetimes, baseline memory
model, cost model, plan, rewrite) and the report's memory-model run on the rewritten graphs, with
policy="auto" and a memory budget so that every part of the planner runs. Tracing and the first
partition are torch's and not counted; when the plan recomputes, the second partition it asks
torch for is reported in its own column and left out of "pass ms".
"""

from __future__ import annotations

import argparse
import gc
import importlib
import time

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.models import GPT, GPTConfig, gpt_batch


def measure(layers: int, bandwidth: str = "2GB") -> dict:
    backend_module = importlib.import_module("fxoffload.backend")
    timings: dict[str, float] = {}
    original_pass, original_simulate = backend_module.offload_pass, backend_module.simulate
    timings["repartition_s"] = 0.0

    def timed_pass(fw, bw, *args, **kwargs):
        timings["fw_nodes"], timings["bw_nodes"] = len(fw.graph.nodes), len(bw.graph.nodes)
        repartition = kwargs.get("repartition")
        if repartition is not None:

            def timed_repartition(names):
                begin = time.perf_counter()
                try:
                    return repartition(names)
                finally:
                    timings["repartition_s"] += time.perf_counter() - begin

            kwargs["repartition"] = timed_repartition
        start = time.perf_counter()
        result = original_pass(fw, bw, *args, **kwargs)  # includes the baseline memory model
        timings["pass_s"] = time.perf_counter() - start - timings["repartition_s"]
        return result

    def timed_simulate(*args, **kwargs):
        start = time.perf_counter()
        result = original_simulate(*args, **kwargs)
        if "pass_s" in timings:  # the report's run on the rewritten graphs, after the pass
            timings["simulate_s"] = time.perf_counter() - start
        return result

    backend_module.offload_pass, backend_module.simulate = timed_pass, timed_simulate
    try:
        torch._dynamo.reset()
        gc.collect()  # the previous size's garbage, so that its collection does not land in this run
        cfg = GPTConfig(layers=layers, dim=64, seq=64, heads=4, dropout=0.0)
        model = GPT(cfg)
        reports = fxoffload.explain(model, *gpt_batch(cfg, 2), offload_cpu=True, min_bytes=0, inner="aot_eager",
                          memory_budget=0.5, bandwidth=bandwidth)  # fmt: skip
    finally:
        backend_module.offload_pass, backend_module.simulate = original_pass, original_simulate
    recomputed = sum(len(r.recomputed) for r in reports)
    return {
        "layers": layers,
        "nodes (fw+bw)": int(timings["fw_nodes"] + timings["bw_nodes"]),
        "pass ms": timings["pass_s"] * 1e3,
        "recomputed": recomputed,
        "torch's 2nd partition ms": timings["repartition_s"] * 1e3,
        "memory after ms": timings["simulate_s"] * 1e3,
        "total ms": (timings["pass_s"] + timings["simulate_s"]) * 1e3,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,8,16,32,48")
    parser.add_argument(
        "--bandwidth", default="2GB",
        help="host link for the budget fit; a slow one (0.05GB) makes the plan recompute, which "
        "adds a second partition to the pass",
    )  # fmt: skip
    args = parser.parse_args(argv)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        print(f"planning a {layers}-layer decoder ...", flush=True)
        rows.append(measure(layers, args.bandwidth))
    print(f"# CPU ({torch.__version__}); planning is CPU work on every machine")
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    base = rows[0]
    for r in rows[1:]:
        grow = (r["total ms"] / base["total ms"]) / (r["nodes (fw+bw)"] / base["nodes (fw+bw)"])
        print(f"{r['layers']} layers: time grew {grow:.2f}x as fast as the node count")


if __name__ == "__main__":
    main()
