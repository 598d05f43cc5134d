"""Host time of each transfer op call: what the compute thread spends in fxoffload's ops per tensor.

A GPU step is on time only while the host issues its kernels ahead of the device; every offloaded
tensor adds four op calls (offload, its wait, reload, its wait) and a copy switched off at run time
adds the same four. This times each call on a small tensor (64 B by default, so that the figure is
the op's own cost, not the copy's), median of many calls:

    python -m bench.op_overhead                  # the accelerator if there is one, else the CPU engine
    python -m bench.op_overhead --device cpu --calls 2000
    python -m bench.op_overhead --device cpu --bytes 524288   # on a CPU the calls grow with the bytes

On a CPU it also prints the price the planner charges (``measure_op_rates``: a tensor, plus a MiB).

On a CPU the copies run on the copy engine's threads (``offload_cpu=True``); a wait is timed after
its copy has finished (a sleep between issue and wait), so it is the cost of a wait that does not
stall. "switched off" is an offload whose copy was switched off at run time
(``runtime.transfers.switch_copies_off``): it keeps a copy on the device instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

import fxoffload  # noqa: F401  (registers the ops' implementations)
from fxoffload.measure.op_time import OP_CALLS, measure_op_rates, op_call_seconds


def measure(
    device: torch.device, nbytes: int = 64, calls: int = 1000, settle_s: float = 0.0005
) -> dict[str, float]:
    """Median host microseconds of each op call on ``device`` (``calls`` cycles after 10% warm-up)."""
    return {k: v * 1e6 for k, v in op_call_seconds(device, nbytes, calls, settle_s).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    parser.add_argument(
        "--device", default=str(accelerator or "cpu"), help="cpu, cuda, ... (default: %(default)s)"
    )
    parser.add_argument("--bytes", type=int, default=64, help="tensor size (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=1000, help="timed cycles (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.bytes < 4:
        parser.error("--calls must be >= 1 and --bytes >= 4")
    device = torch.device(args.device)
    if device.type != "cpu" and (accelerator is None or accelerator.type != device.type):
        print(f"no {device.type} device here", file=sys.stderr)
        return 2
    us = measure(device, args.bytes, args.calls)
    print(
        f"device: {device} (torch {torch.__version__}), {args.bytes} B tensor, median of {args.calls} calls"
    )
    print(
        tabulate(
            [(k, f"{v:.1f}") for k, v in us.items()], headers=("op call", "host us"), tablefmt="github",
            disable_numparse=True, colalign=("left", "right"),
        )  # fmt: skip
    )
    per_tensor = sum(us[k] for k in OP_CALLS)
    print(f"one offloaded tensor, its four calls: {per_tensor:.1f} us of host time a step")
    if device.type == "cpu":
        op_time, op_byte_time = measure_op_rates(device)
        print(
            f"the planner's price on this CPU: {op_time * 1e6:.1f} us a tensor + {op_byte_time * (1 << 20) * 1e6:.1f} us a "
            f"MiB (for {args.bytes} B: {(op_time + op_byte_time * args.bytes) * 1e6:.1f} us)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
