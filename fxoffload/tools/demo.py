"""`make demo`: train a small GPT-style model a few steps with backend="fxoffload".

It starts where a user should: ``policy="auto"``, which offloads only what hides behind compute and,
once the device has measured its copies, keeps whatever stalled (the graph is planned again at the
third step). It compares the steady step's peak memory and time with Inductor's, on a GPU where there
is one; on a machine without one it runs the same data flow on CPU tensors (offload_cpu=True) and
says so.
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


def train(model, backend, batch, steps, device):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn = torch.compile(model, backend=backend)
    losses, times = [], []

    def step():
        torch.manual_seed(0)
        loss = fn(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    # One more, steady, step measured from the allocator: bytes above what was live at its start.
    measured = fxoffload.measure_memory(step)[device].peak_bytes
    return losses, times, peak, measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=6, help="steps per compiler (the last half are timed)")
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
    if device == "cuda":
        backend = fxoffload.backend(policy=args.policy, inner=args.inner)
        where = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    else:
        # The tiny preset is the "gpt" example; its tensors are far below the default min_bytes (1 MiB).
        backend = fxoffload.backend(
            policy=args.policy, inner=args.inner, offload_cpu=True, min_bytes=EXAMPLE_MIN_BYTES["gpt"]
        )
        where = (f"CPU (torch {torch.__version__}); no GPU, so offload_cpu=True: activations are copied\n"
                 "        to separate host buffers and their storage released (the real data flow, CPU"
                 " figures)")  # fmt: skip
    print(f"compiling and training twice (fxoffload, {args.inner}), {args.steps} steps each...", flush=True)
    losses, times, peak, measured = train(model, backend, batch, args.steps, device)
    torch._dynamo.reset()
    ref_losses, ref_times, ref_peak, ref_measured = train(model, args.inner, batch, args.steps, device)

    # What a user came for first: memory, time, same losses, what was moved; then the short table.
    size = ", ".join(f"{k} {getattr(cfg, k)}" for k in ("vocab", "seq", "dim", "heads", "layers"))
    print(f"\nmodel : GPT preset {preset!r} ({size}), batch {args.batch}, {args.steps} AdamW steps")
    print(f"device: {where}")
    def row(label: str, ref: str, ours: str, note: str) -> str:
        return f"{label:34}{ref:>12}{ours:>12}   {note}".rstrip()

    print(row("", args.inner, "fxoffload", ""))
    cut = 1 - measured / ref_measured if ref_measured else 0.0
    change = f"{cut:.0%} less" if cut >= 0 else f"{-cut:.0%} more"
    print(row("peak memory of a steady step", fmt_bytes(ref_measured), fmt_bytes(measured), change))
    if device == "cuda":
        print(row("peak allocated, all steps", fmt_bytes(ref_peak), fmt_bytes(peak), ""))
    # The first steps compile (and "auto" is planned again at the third, from measured times): the
    # last half are the steady state.
    steady = (lambda ts: sorted(ts[len(ts) // 2:])[len(ts[len(ts) // 2:]) // 2] * 1e3)
    slower = steady(times) / steady(ref_times) - 1
    print(row("step time, median of the last half", f"{steady(ref_times):.1f} ms", f"{steady(times):.1f} ms",
              f"{slower:+.0%}"))  # fmt: skip
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    same = "identical" if diff == 0 else f"same within {diff:.1e}"
    same = f"{same} over {len(losses)} steps"
    print(row("loss, last step", f"{ref_losses[-1]:.5f}", f"{losses[-1]:.5f}", same))
    offloaded = [r for report in backend.reports for r in report.offloaded]
    recomputed = [r for report in backend.reports for r in report.recomputed]
    saved = sum(r.saved_bytes for r in backend.reports)
    count = sum(len(r.saved) for r in backend.reports)
    stats = fxoffload.host_pool_stats()
    moved, rebuilt = fmt_bytes(sum(r.nbytes for r in offloaded)), fmt_bytes(sum(r.nbytes for r in recomputed))
    print(f"offloaded: {len(offloaded)} of {count} saved tensors, {moved} of {fmt_bytes(saved)}"
          + (f"; recomputed: {len(recomputed)}, {rebuilt}" if recomputed else ""))  # fmt: skip
    pool = fmt_bytes(stats.bytes_allocated)
    print(f"host pool: {stats.buffers} buffers, {pool}, allocated in the first step and reused")
    _closing(args, backend, device)

def _closing(args: argparse.Namespace, backend: Any, device: str) -> None:
    """What to try next, how the figures were taken, and each graph's table."""
    replanned = [why for report in backend.reports for why in report.replans if why.startswith("measured")]
    switched = sum(len(report.switched_off) for report in backend.reports)
    if args.policy == "auto":
        print("policy 'auto' offloads what hides behind compute; "
              + (f"the copies of {switched} tensors measured stalling in\n  the first steps were switched off "
                 "(those tensors stay on the device)" if switched
                 else "its copies measured stalling in the first steps\n  were kept: planned again once"
                 if replanned else "its copies measured hiding in the first steps"))  # fmt: skip
        print("more memory: policy='all' offloads every eligible tensor (slower where copies cannot hide);")
        print("  memory_budget='12GiB' (or 0.7) fits the peak you need, offloading or recomputing only that far")
        print("  (recompute='inductor': torch's partitioner recomputes, offloads only where they hide)")
    print("(peak memory: allocator bytes above what was live at the step's start"
          + (", fxoffload's host buffers left out)" if device == "cpu" else ")"))
    if device == "cpu":
        print("(step time: on a CPU the copies run on two threads that share the cores with compute)")
    for report in backend.reports:
        print()
        print(report.table(rows="all" if args.all_rows else "short", kept=3))
    if not args.all_rows:
        print("\nevery saved tensor and column: python -m fxoffload.tools.demo --all-rows")



if __name__ == "__main__":
    main()
