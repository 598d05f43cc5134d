"""The first steps' wall time, compile included, against Inductor's: each method in a process of its
own with an empty Inductor cache (a warm cache hides the compiles, so times only compare cold).

Steps 1-3 are timed apart: the first compiles (the plan, and whatever ``verify_peak`` compiles to
judge it), the second times the copies on the device, and a plan made again from those times
compiles at the third; an fxoffload method then steps on until ``backend.settled`` ("settled s":
every step's time until then, a second re-plan's compile included). fxoffload's own figures are from ``report.timings``: how many times the inner
compiler ran per graph and the seconds they took, and each compile by what it was for (``spent``).

    python -m bench.compile_time                       # the 12-block GPT, returning its loss
    python -m bench.compile_time --layers 4 --methods inductor,fxoffload-all,fxoffload-all-noverify
    python -m bench.compile_time --methods inductor,fxoffload-all --repeat 3   # rounds, interleaved: medians

CPU figures on a CPU (``offload_cpu=True``, the copy engine's link emulated at ``--cpu-link``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from tabulate import tabulate

_METHODS = {
    "inductor": None,
    # torch's own recomputation at the activation budget fxoffload-recompute's chooser picks here
    "inductor-amb": None,
    "fxoffload-none": {"policy": "none"},
    "fxoffload-all": {"policy": "all"},
    "fxoffload-all-noverify": {"policy": "all", "verify_peak": False},
    "fxoffload-auto": {"policy": "auto"},
    # auto where nothing is worth offloading: the plan's compile stops after the pass, then Inductor's own
    "fxoffload-auto-nothing": {"policy": "auto", "min_bytes": "1GiB"},
    "fxoffload-budget": {"memory_budget": 0.7},
    "fxoffload-recompute": {"memory_budget": 0.7, "recompute": "inductor"},
}


AMB = 0.6  # the activation budget recompute="inductor" chose for memory_budget=0.7 on the 12 blocks


def _one(method: str, layers: int, steps: int, link: str) -> dict:
    """One method's step times (in this process: called in a fresh one by ``main``, which imports
    no torch itself)."""
    import torch

    import fxoffload
    from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

    from .runner import settle

    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers, dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    options = _METHODS[method]
    if options is None:
        compiled = torch.compile(model, backend="inductor")
        if method == "inductor-amb":  # for every compile of the run (the backward's, at its first call)
            from torch._functorch import config as functorch_config

            functorch_config.activation_memory_budget = AMB
    else:
        backend = fxoffload.backend(**{"min_bytes": 0, **options}, offload_cpu=True, cpu_link_bandwidth=link)
        compiled = torch.compile(model, backend=backend)
    times = []

    def step() -> None:
        start = time.perf_counter()
        compiled(*batch).backward()
        times.append(time.perf_counter() - start)

    before = resource.getrusage(resource.RUSAGE_SELF)
    step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps - 1):
        step()
    # The first step's page faults and kernel time: on CPython 3.11+ a hot call whose frame starts a
    # new 16 KiB chunk of the interpreter's frame stack maps and unmaps that chunk on every call, so
    # the same compile costs more or less kernel time with the depth it is called at (see docs/results.md).
    row = {"method": method, "steps_s": times, "minflt": after.ru_minflt - before.ru_minflt,
           "sys_s": after.ru_stime - before.ru_stime}  # fmt: skip
    if options is not None:
        # On until the backend has timed and acted on its copies: a second re-plan compiles later.
        settle(backend, step, limit=20)
        row.update(settled_s=sum(times), settled_steps=len(times) if backend.settled else None)
        t = [r.timings for r in backend.reports if r.timings is not None]
        row.update(compiles=sum(sum(not c.inside for c in x.spent) or x.compiles for x in t), compile_s=sum(x.spent_s for x in t),
                   pass_s=sum(x.pass_s + x.repartition_s + x.simulate_s for x in t),
                   offloaded=sum(len(r.offloaded) for r in backend.reports), replans=sum(len(r.replans) for r in backend.reports),
                   spent=[f"graph {r.graph_id}: {r.timings.spent_text()}" for r in backend.reports if r.timings is not None],
                   why=[f"graph {r.graph_id}: planned again: {w}" for r in backend.reports for w in r.replans])  # fmt: skip
    return row


def _run(method: str, args: argparse.Namespace) -> dict:
    """One method's row, from a process of its own with an empty Inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        cmd = [sys.executable, "-m", "bench.compile_time", "--one", method, "--layers", str(args.layers),
               "--steps", str(args.steps), "--cpu-link", args.cpu_link]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _first3(row: dict) -> float:
    """The seconds of a run's first three steps, what the table compares."""
    return sum(row["steps_s"][:3])


def summarise(rounds: list[dict[str, dict]]) -> tuple[list[dict], dict[str, float]]:
    """Each method's median run (by the sum of its first three steps; the lower middle of an even
    count), in the first round's order, and each method's ratio to Inductor: the median of the
    rounds' ratios, each against the Inductor run of its own round (none without an Inductor row)."""
    rows, ratios = [], {}
    for method in rounds[0]:
        runs = sorted((one[method] for one in rounds), key=_first3)
        rows.append(runs[(len(runs) - 1) // 2])
        if all("inductor" in one for one in rounds):
            paired = sorted(_first3(one[method]) / _first3(one["inductor"]) for one in rounds)
            ratios[method] = statistics.median(paired)
    return rows, ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(_METHODS), help=f"comma-separated, of {', '.join(_METHODS)}")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu-link", default="2GB", help="the emulated link's bytes/s (default 2GB)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every method, interleaved (default 1)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this method's row as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args.layers, args.steps, args.cpu_link)))
        return
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in _METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; allowed: {', '.join(_METHODS)}")
    rounds: list[dict[str, dict]] = []
    for i in range(args.repeat):
        # Round by round, each round's order the last one's reversed: a machine that drifts (it
        # does, by 10% in an hour) weighs on every method alike, and each round pairs them.
        order = methods if i % 2 == 0 else methods[::-1]
        rounds.append({m: _run(m, args) for m in order})
    rows, ratios = summarise(rounds)
    table = []
    for r in rows:
        first3 = _first3(r)
        ratio = f"{ratios[r['method']]:.2f}" if r["method"] in ratios else "-"
        steps = " / ".join(f"{s:.2f}" for s in r["steps_s"][:3])
        spread = [_first3(one[r["method"]]) for one in rounds]
        settled = f"{r['settled_s']:.2f} ({r['settled_steps']})" if r.get("settled_steps") else "-"
        table.append([r["method"], steps, f"{first3:.2f}" + (f" ({min(spread):.1f}-{max(spread):.1f})" if len(rounds) > 1 else ""),
                      ratio, settled, r.get("compiles", "-"),
                      f"{r['compile_s']:.2f}" if "compile_s" in r else "-", f"{r['pass_s']:.2f}" if "pass_s" in r else "-",
                      r.get("offloaded", "-"), r.get("replans", "-"), f"{r['minflt']:,}", f"{r['sys_s']:.2f}"])  # fmt: skip
    headers = ["method", "steps 1/2/3 s", "sum s", "x inductor", "settled s (steps)", "compile runs", "compile s",
               "pass s", "offloaded", "replans", "step 1 page faults", "step 1 kernel s"]  # fmt: skip
    print(f"GPT, {args.layers} blocks (dim 64, seq 64, batch 8), returning its loss; cold Inductor cache per method"
          + (f"; {len(rounds)} rounds: each method's median run, its sums' range, x inductor the median of the"
             " rounds' ratios" if len(rounds) > 1 else ""))
    print(tabulate(table, headers=headers))
    print("\nWhere each method's compiles went (report.timings.spent; after the table's steps):")
    for r in rows:
        for line in (*r.get("spent", ()), *r.get("why", ())):
            print(f"  {r['method']}, {line}")


if __name__ == "__main__":
    main()
