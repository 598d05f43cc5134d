"""The cost model as the first steps corrected it, against the step it models (issue 23 part 1).

``auto`` on a small GPT on the CPU (``offload_cpu``, the emulated link), its model mispriced on
purpose (``compute_rates`` about 1000x slow, as a FLOP table priced an H100's fused code 3x slow) and
each wait placed at once after its copy (``prefetch=0``), so that its first plan's copies stall and
the first steps correct the model (``planning.measured``). Once ``backend.settled``, each row gives
the compute the corrected model predicts for the step (``report.predicted_compute_ms``) against the
measured step of the same model compiled without fxoffload's changes (policy "none"): a corrected
model is within noise of 1.0x; a plan made again from a model still 3x slow offloads what cannot
hide. On a GPU the bench's own rows carry the same figure (``model_x``)::

    python -m bench.corrected_model                       # links 50MB, 500MB, 5GB; fp32 and bf16
    python -m bench.corrected_model --links 50MB --dtypes fp32 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.options import parse_bytes
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

from .runner import settle

MISPRICED = {"flops": 1e9, "memory_bandwidth": 1e8}
SETTLING_STEPS = 16


def gpt_stepper(backend, bf16: bool, cfg: GPTConfig | None = None):
    """A timed training step of a GPT on the CPU (``cfg``: 2 blocks by default, dropout 0; batch 8)
    compiled with ``backend``, under bf16 autocast where asked: a function returning its seconds."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = cfg or GPTConfig(layers=2, dropout=0.0)
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    compiled = torch.compile(model, backend=backend)

    def step() -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = compiled(*batch)
        loss.backward()
        return time.perf_counter() - start

    return step


def measure(link: float, bf16: bool, steps: int = 7) -> dict[str, float]:
    """One row: the baseline's median step, ``auto``'s steps to settle, plans made again, tensors
    offloaded, the corrected model's compute and its ratio to the baseline's step, and ``auto``'s step."""
    plain = gpt_stepper(fxoffload.backend(policy="none", inner="aot_eager"), bf16)
    base = statistics.median([plain() for _ in range(steps + 1)][1:])
    backend = fxoffload.backend(
        offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=link, inner="aot_eager",
        compute_rates=MISPRICED, prefetch=0,
    )  # fmt: skip
    step = gpt_stepper(backend, bf16)
    step()
    settling = 1 + settle(backend, step, SETTLING_STEPS - 1)
    auto = statistics.median(step() for _ in range(steps))
    compute = sum(r.predicted_compute_ms for r in backend.reports)
    return {
        "base_ms": base * 1e3, "settling": settling, "replans": sum(len(r.replans) for r in backend.reports),
        "offloaded": sum(len(r.offloaded) for r in backend.reports), "model_ms": compute,
        "model_x": compute / (base * 1e3), "auto_ms": auto * 1e3,
    }  # fmt: skip


def link_dtype_parser(description: str) -> argparse.ArgumentParser:
    """A command line with ``--links`` and ``--dtypes`` (``links_and_dtypes`` reads them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--links", default="50MB,500MB,5GB", help="emulated link speeds (default: %(default)s)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32 and/or bf16 (autocast)")
    return parser


def links_and_dtypes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[tuple[str, float, str]]:
    """Each (link as given, its bytes/s, dtype) of ``--links`` x ``--dtypes``; a dtype other than fp32
    or bf16 is refused by name."""
    for link in args.links.split(","):
        for dtype in args.dtypes.split(","):
            if dtype not in ("fp32", "bf16"):
                parser.error(f"--dtypes: {dtype!r} is not one of fp32, bf16")
            yield link, parse_bytes(link, "--links"), dtype


def main(argv: list[str] | None = None) -> int:
    parser = link_dtype_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps of each (median)")
    args = parser.parse_args(argv)
    rows = []
    for link, rate, dtype in links_and_dtypes(parser, args):
        m = measure(rate, dtype == "bf16", args.steps)
        rows.append([link, dtype, f"{m['base_ms']:.2f}", m["settling"], m["replans"], m["offloaded"],
                     f"{m['model_ms']:.1f}", f"{m['model_x']:.2f}", f"{m['auto_ms']:.2f}"])  # fmt: skip
    headers = ["link /s", "dtype", "plain step ms", "steps to settle", "replans", "offloaded",
               "corrected model's compute ms", "x plain step", "auto step ms"]  # fmt: skip
    print(tabulate(rows, headers=headers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
