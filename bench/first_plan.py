"""auto's first plan, before anything is measured: does it stall, and what does the re-plan cost? (issue 23)

A plan priced from the built-in figures keeps a copy margin (``FIRST_GUESS_MARGIN``) until the first
steps have timed its copies. Each row trains a GPT on the CPU (``offload_cpu``, the emulated link,
the op calls priced 0 as on an accelerator whose host runs ahead) with ``auto`` twice: its first plan
alone (``max_replans=0``: the stall it measured), then as it ships (planned again where copies
stalled, or where all hid with room for more: the steps until ``backend.settled``, the plans made
again, the stall measured of the last plan, and the settled step against the plain one)::

    python -m bench.first_plan                          # links 50MB, 500MB, 5GB; fp32 and bf16; margins 0, 0.6
    python -m bench.first_plan --links 500MB --dtypes fp32 --margins 0.6
"""

from __future__ import annotations

import statistics
import sys

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.analysis import cost
from fxoffload.testing.models import GPTConfig

from .corrected_model import gpt_stepper, link_dtype_parser, links_and_dtypes
from .runner import settle

SETTLING_STEPS = 16


def measure(link: float, bf16: bool, margin: float, layers: int = 2, steps: int = 5) -> dict[str, float]:
    """One row: the plain step, the first plan's offloaded MiB and measured stall, then ``auto`` as it
    ships: steps to settle, plans made again, offloaded MiB and its settled step."""
    cfg = GPTConfig(layers=layers, dropout=0.0, dim=128, seq=128)
    plain = gpt_stepper(fxoffload.backend(policy="none", inner="aot_eager"), bf16, cfg)
    base = statistics.median([plain() for _ in range(steps + 1)][1:])
    saved, cost.FIRST_GUESS_MARGIN = cost.FIRST_GUESS_MARGIN, margin
    try:
        out = {"base_ms": base * 1e3}
        for replans in (0, None):
            options = {"max_replans": replans} if replans is not None else {}
            backend = fxoffload.backend(
                offload_cpu=True, policy="auto", min_bytes="16KiB", cpu_link_bandwidth=link, inner="aot_eager",
                op_time=0.0, **options,
            )  # fmt: skip
            step = gpt_stepper(backend, bf16, cfg)
            step()
            settling = 1 + settle(backend, step, SETTLING_STEPS - 1)
            (report,) = backend.reports
            mib = sum(r.nbytes for r in report.offloaded) / 2**20
            if replans == 0:
                out.update(first_mib=mib, first_stall_ms=report.measured_stall_ms or 0.0)
            else:
                auto = statistics.median(step() for _ in range(steps))
                out.update(settling=settling, replans=len(report.replans), mib=mib, auto_x=auto / base,
                           stall_ms=report.measured_stall_ms or 0.0)  # fmt: skip
    finally:
        cost.FIRST_GUESS_MARGIN = saved
    return out


def main(argv: list[str] | None = None) -> int:
    parser = link_dtype_parser(__doc__.splitlines()[0])
    parser.add_argument("--margins", default=f"0,{cost.FIRST_GUESS_MARGIN}",
                        help="first-guess copy margins to compare (default: %(default)s)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=2, help="GPT blocks (dim 128, seq 128, batch 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each (median)")
    args = parser.parse_args(argv)
    rows = []
    for link, rate, dtype in links_and_dtypes(parser, args):
        for margin in args.margins.split(","):
            m = measure(rate, dtype == "bf16", float(margin), args.layers, args.steps)
            rows.append([link, dtype, margin, f"{m['base_ms']:.1f}", f"{m['first_mib']:.2f}",
                         f"{m['first_stall_ms']:.2f}", m["settling"], m["replans"], f"{m['mib']:.2f}",
                         f"{m['stall_ms']:.2f}", f"{m['auto_x']:.2f}"])  # fmt: skip
    headers = ["link /s", "dtype", "margin", "plain step ms", "1st plan MiB", "1st plan stall ms",
               "steps to settle", "replans", "settled MiB", "last plan stall ms", "settled step x plain"]  # fmt: skip
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, GPT {args.layers} blocks, aot_eager")
    print(tabulate(rows, headers=headers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
