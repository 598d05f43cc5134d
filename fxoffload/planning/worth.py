"""Whether "auto"'s own offloads are worth carrying out: they must lower the predicted peak, and by
enough to pay for what they cost beside their copies' time.

A plan that changes the graph costs its copies' op calls every step, risks a stall wherever a copy
fills its window on a device faster than priced, and costs compiles in the first steps: the one that
judges its code (``verify_peak``'s code without offloading) and, should a copy stall, the one that
plans it again. On a CPU "auto"'s first plan of the 12-block GPT offloaded one 0.25 MiB tensor, whose
copy then stalled 0.2 ms: the first step took 2.27x Inductor's (issue 23 part 5), for a peak lowered
by under 1%.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from ..reasons import Reason, ReasonCode
from ..sizes import fmt_bytes
from .budget import planned_memory
from .decisions import OffloadPlan

__all__ = ["WORTH_A_COMPILE", "stall_not_worth_a_compile", "without_useless_offloads"]

# The least share of the predicted peak "auto"'s own offloads must take off it (and, for a plan made
# again for more, of the pair's saved bytes it must add, ``measured.room``): less is not worth a compile.
WORTH_A_COMPILE = 0.02


def without_useless_offloads(plan: OffloadPlan, without: OffloadPlan, mine: Collection[str]) -> OffloadPlan:
    """``plan``, or ``without`` (the same plan without "auto"'s own offloads, ``mine``) where those do not
    lower the predicted peak by ``WORTH_A_COMPILE`` of it. Where they cannot lower it at all (the peak is
    where none of them is off the device: the MLP's, at the end of the backward, every gradient live),
    the order they impose on the compiler can even cost memory. Judged only for a pair that returns a
    loss alone: one that returns activations may be one block of a longer step, whose peak is where
    this pair's saved tensors wait for their backward."""
    with_them, before = planned_memory(plan), planned_memory(without)
    if with_them is None or before is None or with_them.peak.total < before.peak_bytes * (1 - WORTH_A_COMPILE):
        return plan
    peak = with_them.peak
    if peak.total >= before.peak_bytes:
        code = ReasonCode.PEAK_NOT_LOWERED
        why = (
            f"offloading would not lower the predicted peak ({fmt_bytes(peak.total)} at "
            f"{peak.phase} node {peak.node}, with or without it)"
        )
    else:
        code = ReasonCode.PEAK_BARELY_LOWERED
        why = (
            f"offloading would lower the predicted peak by {fmt_bytes(before.peak_bytes - peak.total)} only, under "
            f"{WORTH_A_COMPILE:.0%} of its {fmt_bytes(before.peak_bytes)}: not worth the copies' calls, their risk of "
            "a stall and the compiles that judge the plan"
        )
    decisions = tuple(
        dataclasses.replace(d, reason=Reason(code, f"{why}; {d.reason.text}")) if d.saved.name in mine else d
        for d in without.decisions
    )
    return dataclasses.replace(without, decisions=decisions)


def stall_not_worth_a_compile(stalls: Collection[str], stall_s: float, step_s: float) -> str:
    """Why copies (of ``stalls``) that stalled the compute stream ``stall_s`` a step, of ``step_s``
    measured compute, are not planned again and compiled for: under ``WORTH_A_COMPILE`` of the step,
    within its noise (the 12-block GPT on a loaded 2-core CPU: one copy waited 0.2 ms of a 30 ms
    step), where the compile that takes it away costs the first steps 0.3-0.5x Inductor's compile.
    Empty where they are worth it."""
    if step_s <= 0 or stall_s >= WORTH_A_COMPILE * step_s:
        return ""
    return (
        f"measured in the first steps: the copies of {', '.join(sorted(stalls))} stalled the compute stream "
        f"{stall_s * 1e3:.3g} ms a step, under {WORTH_A_COMPILE:.0%} of the step's {step_s * 1e3:.3g} ms of "
        "compute: within its noise, and not worth a compile"
    )
