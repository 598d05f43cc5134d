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

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch


def measure(layers: int, bandwidth: str = "2GB") -> dict:
    torch.compiler.reset()
    gc.collect()  # the previous size's garbage, so that its collection does not land in this run
    cfg = GPTConfig(layers=layers, dim=64, seq=64, heads=4, dropout=0.0)
    reports = fxoffload.explain(GPT(cfg), *gpt_batch(cfg, 2), offload_cpu=True, min_bytes=0, inner="aot_eager",
                                memory_budget=0.5, bandwidth=bandwidth)  # fmt: skip
    timings = [r.timings for r in reports]  # one graph pair unless the model has a graph break
    pass_s, simulate_s = sum(t.pass_s for t in timings), sum(t.simulate_s for t in timings)
    return {
        "layers": layers,
        "nodes (fw+bw)": sum(t.fw_nodes + t.bw_nodes for t in timings),
        "pass ms": pass_s * 1e3,
        "recomputed": sum(len(r.recomputed) for r in reports),
        "torch's 2nd partition ms": sum(t.repartition_s for t in timings) * 1e3,
        "memory after ms": simulate_s * 1e3,
        "total ms": (pass_s + simulate_s) * 1e3,
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
