"""`make demo`: train a small GPT-style model a few steps with backend="fxoffload".

On a GPU it offloads CUDA activations and compares peak memory with Inductor; on a machine without one
it runs the same data flow on CPU tensors (offload_cpu=True) and says so.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import fxoffload
from fxoffload.models import GPT, PRESETS, gpt_batch
from fxoffload.plan import fmt_bytes


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
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--policy", default="all", choices=("auto", "all", "none"))
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = args.preset or ("small" if device == "cuda" else "tiny")
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    batch = gpt_batch(cfg, args.batch, device)
    if device == "cuda":
        backend = fxoffload.backend(policy=args.policy)
        print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    else:
        backend = fxoffload.backend(policy=args.policy, offload_cpu=True, min_bytes="16KiB")
        print(
            f"device: CPU (torch {torch.__version__}). No GPU here: running with offload_cpu=True, so CPU\n"
            "activations are copied to separate host buffers and their storage released. The data flow\n"
            "is the real one; the memory figures are not GPU figures."
        )
    print(f"model: GPT preset {preset!r} {cfg}, batch {args.batch}, {args.steps} training steps (AdamW)\n")

    losses, times, peak, measured = train(model, backend, batch, args.steps, device)
    torch._dynamo.reset()
    ref_losses, ref_times, ref_peak, ref_measured = train(model, "inductor", batch, args.steps, device)

    where = "CPU, fxoffload's host buffers left out" if device == "cpu" else "CUDA allocator"
    print(f"measured peak of a steady step ({where}), above what was live at its start:\n"
          f"    fxoffload {fmt_bytes(measured)}, inductor {fmt_bytes(ref_measured)}\n")  # fmt: skip

    for report in backend.reports:
        print(report.table(), "\n")
    stats = fxoffload.host_pool_stats()
    print(f"losses, fxoffload : {[round(v, 5) for v in losses]}")
    print(f"losses, inductor  : {[round(v, 5) for v in ref_losses]}")
    offloaded = sum(r.offloaded_bytes for r in backend.reports)
    saved = sum(r.saved_bytes for r in backend.reports)
    print(f"saved for backward: {fmt_bytes(saved)}; offloaded per step: {fmt_bytes(offloaded)}")
    print(f"host pool: {stats.buffers} buffers, {fmt_bytes(stats.bytes_allocated)}, "
          "allocated in the first step and reused after it")  # fmt: skip
    if device == "cuda":
        print(f"peak allocated    : fxoffload {peak / 2**20:.1f} MiB vs inductor {ref_peak / 2**20:.1f} MiB")
    # Step 1 includes compilation; the rest are steady state.
    steady = (lambda ts: sorted(ts[1:])[len(ts[1:]) // 2] * 1e3 if len(ts) > 1 else float("nan"))
    print(f"step time (median after the first): fxoffload {steady(times):.1f} ms, "
          f"inductor {steady(ref_times):.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
