"""`make demo`: train a small GPT-style model a few steps with backend="fxoffload".

It starts where a user should: ``policy="auto"``, which offloads only what hides behind compute and
costs no time (once the device has measured its copies, it switches off whatever stalled), and beside
it ``policy="all"``, what offloading every eligible tensor saves and costs. It compares the steady
step's peak memory and time with Inductor's, on a GPU where there is one; on a machine without one it
runs the same data flow on CPU tensors (offload_cpu=True) and says so: there the op calls run on the
compute thread, and ``auto`` keeps what they would slow down.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

import fxoffload
from fxoffload.sizes import fmt_bytes
from fxoffload.testing.models import EXAMPLE_MIN_BYTES, GPT, PRESETS, gpt_batch


class Run:
    """One compiler's training of its own copy of the model: its losses, timed steps and peaks."""

    def __init__(self, model, backend, batch, device):
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.fn = torch.compile(self.model, backend=backend)
        self.batch, self.device = batch, device
        self.losses: list[float] = []
        self.times: list[float] = []
        self.peak: int | None = None  # on a GPU: allocated over the first steps, above their start
        self.measured = 0

    def step(self):
        torch.manual_seed(0)
        loss = self.fn(*self.batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def timed_step(self) -> None:
        start = time.perf_counter()
        self.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)


def train(runs: list[Run], steps: int, timed: int = 20) -> None:
    """Each run's first ``steps`` steps (their losses: the compile, and ``auto`` measuring its copies
    and maybe compiling again), one run after the other; then ``timed`` rounds of one timed step of
    each run in turn, so that a machine whose load changes meanwhile slows every run alike; then a
    steady step of each, measured from the allocator (bytes above what was live at its start)."""
    for run in runs:
        if run.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        run.losses = [run.step().item() for _ in range(steps)]
        if run.device == "cuda":
            run.peak = torch.cuda.max_memory_allocated() - start
    for _ in range(timed):
        for run in runs:
            run.timed_step()
    for run in runs:
        run.measured = fxoffload.measure_memory(run.step)[run.device].peak_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=6, help="steps per compiler whose losses are compared")
    parser.add_argument("--timed", type=int, default=20, help="steady steps timed after them (the median is shown)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--policy", default="auto", choices=("auto", "all", "none"))
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                        help="the compiler both runs use (aot_eager: no Inductor, quicker to compile)")
    parser.add_argument("--all-rows", action="store_true", help="print every saved tensor with every column")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = args.preset or ("small" if device == "cuda" else "tiny")
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    batch = gpt_batch(cfg, args.batch, device)
    # "auto" first, as a user should start; beside it "all", what offloading every tensor costs and saves.
    policies = [args.policy, "all"] if args.policy == "auto" else [args.policy]
    if device == "cuda":
        options: dict[str, Any] = {}
        where = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    else:
        # The tiny preset is the "gpt" example; its tensors are far below the default min_bytes (1 MiB).
        options = {"offload_cpu": True, "min_bytes": EXAMPLE_MIN_BYTES["gpt"]}
        where = (f"CPU (torch {torch.__version__}); no GPU, so offload_cpu=True: activations are copied\n"
                 "        to separate host buffers and their storage released (the real data flow, CPU"
                 " figures)")  # fmt: skip
    names = " and ".join(f"fxoffload {p!r}" for p in policies)
    print(f"compiling and training {names} and {args.inner}, {args.steps} steps each...", flush=True)
    backends = [fxoffload.backend(policy=policy, inner=args.inner, **options) for policy in policies]
    runs = [Run(model, b, batch, device) for b in backends]
    ref = Run(model, args.inner, batch, device)
    train([*runs, ref], args.steps, args.timed)
    _figures(args, cfg, preset, where, device, policies, backends, runs, ref)
    _closing(args, backends, device)


def _figures(args, cfg, preset, where, device, policies, backends, runs, ref) -> None:
    """What a user came for first: memory, time, same losses, what was moved, for each policy."""
    size = ", ".join(f"{k} {getattr(cfg, k)}" for k in ("vocab", "seq", "dim", "heads", "layers"))
    print(f"\nmodel : GPT preset {preset!r} ({size}), batch {args.batch}, {args.steps} AdamW steps")
    print(f"device: {where}")

    def row(label: str, *cells: str) -> str:
        return f"{label:34}" + "".join(f"{c:>20}" for c in cells)

    print(row("", args.inner, *(f"fxoffload {p!r}" for p in policies)))

    def change(ours: float, theirs: float, less: str, more: str) -> str:
        cut = 1 - ours / theirs if theirs else 0.0
        return f"({cut:.0%} {less})" if cut >= 0 else f"({-cut:.0%} {more})"

    print(row("peak memory of a steady step", fmt_bytes(ref.measured),
              *(f"{fmt_bytes(r.measured)} {change(r.measured, ref.measured, 'less', 'more')}" for r in runs)))  # fmt: skip
    if device == "cuda":
        print(row("peak allocated, first steps", fmt_bytes(ref.peak), *(fmt_bytes(r.peak) for r in runs)))
    # Steps after the compared ones (the first compile; "auto" judged from its measured copies).
    steady = (lambda ts: sorted(ts)[len(ts) // 2] * 1e3)
    if ref.times:
        base = steady(ref.times)
        print(row(f"step time, median of {len(ref.times)} after", f"{base:.1f} ms",
                  *(f"{steady(r.times):.1f} ms ({steady(r.times) / base - 1:+.0%})" for r in runs)))  # fmt: skip
    diff = max(abs(a - b) for r in runs for a, b in zip(r.losses, ref.losses))
    same = "identical" if diff == 0 else f"same within {diff:.1e}"
    print(row("loss, last step", f"{ref.losses[-1]:.5f}", *(f"{r.losses[-1]:.5f}" for r in runs)))
    print(f"losses: {same} over {len(ref.losses)} steps")
    for policy, backend in zip(policies, backends):
        offloaded = [r for report in backend.reports for r in report.offloaded]
        recomputed = [r for report in backend.reports for r in report.recomputed]
        saved = sum(r.saved_bytes for r in backend.reports)
        count = sum(len(r.saved) for r in backend.reports)
        moved, rebuilt = fmt_bytes(sum(r.nbytes for r in offloaded)), fmt_bytes(sum(r.nbytes for r in recomputed))
        print(f"offloaded ({policy}): {len(offloaded)} of {count} saved tensors, {moved} of {fmt_bytes(saved)}"
              + (f"; recomputed: {len(recomputed)}, {rebuilt}" if recomputed else ""))  # fmt: skip
    stats = fxoffload.host_pool_stats()
    print(f"host pool: {stats.buffers} buffers, {fmt_bytes(stats.bytes_allocated)}, allocated in the first "
          "step and reused")  # fmt: skip


def _first_steps(backend: Any) -> str:
    """What ``auto`` did with what its first steps measured, as the closing line's end."""
    replanned = [why for report in backend.reports for why in report.replans if why.startswith("measured")]
    switched = sum(len(report.switched_off) for report in backend.reports)
    if switched:
        return (f"; the copies of {switched} tensors measured stalling in\n  the first steps were switched off "
                "(those tensors stay on the device)")  # fmt: skip
    if replanned:
        why = replanned[-1]
        found = ("its copies stalled" if "stalled" in why else "its copies hid, with room for more" if "room for" in why
                 else "its offloads' op calls cost the step")  # fmt: skip
        return f"; planned again\n  from what the first steps measured: {found}"
    return "; its copies measured hiding in the first steps" if any(r.offloaded for r in backend.reports) else ""


def _closing(args: argparse.Namespace, backends: list[Any], device: str) -> None:
    """What to try next, how the figures were taken, and each graph's table."""
    backend = backends[0]
    calls = [r for report in backend.reports for r in report.saved if r.reason_code == "op_time"]
    if args.policy == "auto":
        print("policy 'auto' offloads what hides behind compute and costs no time" + _first_steps(backend))
        if calls:
            print(f"  {len(calls)} tensors stayed for their op calls, which would cost more than 1% of the step\n"
                  "  (reason op_time; on a CPU the calls run on the compute thread)")  # fmt: skip
        print("more memory: policy='all' offloads every eligible tensor (slower where copies cannot hide);")
        print("  memory_budget='12GiB' (or 0.7) fits the peak you need, offloading or recomputing only that far")
        print("  (recompute='inductor': torch's partitioner recomputes, offloads only where they hide)")
    print("(peak memory: allocator bytes above what was live at the step's start"
          + (", fxoffload's host buffers left out)" if device == "cpu" else ")"))
    if device == "cpu":
        print("(step time: the runs' steps taken in turn; on a CPU the copies run on two threads that share\n"
              " the cores with compute, and on a shared or busy machine a few steps' times are noise)")
    for backend in backends:
        for report in backend.reports:
            print()
            print(report.table(rows="all" if args.all_rows else "short", kept=3))
    if not args.all_rows:
        print("\nevery saved tensor and column: python -m fxoffload.tools.demo --all-rows")


if __name__ == "__main__":
    main()
