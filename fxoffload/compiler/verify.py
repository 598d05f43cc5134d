"""``verify_peak``: offloading never raises the peak of the code that runs.

The FX model is what the plan is made on, and Inductor then fuses, reorders and reuses buffers its
own way: the copies' order edges can keep a buffer alive that the unchanged code frees (the built-in
MLP's backward, +8 KiB). So the code Inductor generated for the plan is replayed against a lower
bound of the unchanged code's peak (``unchanged_floor``, no second compile), and where that does not
settle it, against the code of the pair lowered without offloading (``lowest`` of the two): lowered
for its code alone, its kernels not built, once per graph (a plan made again is judged against the
same code). Before that, inside the plan's own compile, its forward alone (``GraphCompiler.
_lower_unchanged_forward``): its replay's peak is a lower bound of the pair's, and the pair is
lowered whole only where the plan's code does not peak below it. Where the unchanged code wins, the
graph is compiled again as ``backend="inductor"`` compiles it.
Judged for a pair returning a loss only: one returning activations may be one block of a longer
step, whose peak its saved tensors make, and no pair's own peak says that.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from ..analysis.lifetimes import returns_only_scalars
from ..analysis.memory import MemoryTimeline
from ..options import OffloadOptions
from ..planning.decisions import OffloadPlan
from ..reasons import Action, Reason, ReasonCode
from ..reporting.report import saved_rows
from ..sizes import fmt_bytes
from .pair import PlannedPair

log = logging.getLogger(__name__)

__all__ = [
    "autos_own_picks", "checked_model_floor", "needs_unchanged_code", "unchanged_floor", "with_peak_not_lowered",
]

# The FX model (fusing as Inductor does) stands in for the code without offloading only where it
# agrees with the plan's own code this closely, at the peak and at the forward's; the figure it
# gives is then lowered by that disagreement and by ``MODEL_MARGIN`` more.
MODEL_AGREEMENT = 0.02
MODEL_MARGIN = 0.01

# Ops whose output Inductor's no-op removal may turn into an alias of their input (a saved tensor it
# then holds no buffer for): left out of ``unchanged_floor``.
_MAY_BECOME_ALIASES = frozenset({
    "lift_fresh_copy", "clone", "alias", "_to_copy", "convert_element_type", "expand", "view", "reshape",
    "slice", "slice_scatter", "repeat", "constant_pad_nd", "cat",
})  # fmt: skip


def autos_own_picks(plan: OffloadPlan, offload_modules: tuple[str, ...]) -> bool:
    """Whether the plan's offloads are "auto"'s own (not asked for by the user): on a tie with the
    unchanged code its copies buy nothing, and the unchanged code is kept."""
    return plan.policy == "auto" and not offload_modules


def unchanged_floor(
    memory_before: MemoryTimeline | None, saved: Iterable[tuple[str, int]], code: MemoryTimeline
) -> int | None:
    """A lower bound of the peak of the pair's code without offloading, whatever the compiler fuses:
    at the end of its forward it holds its arguments and every saved tensor, which that forward
    returns. The arguments as the plan's code (``code``) holds them (both take the same ones, sized
    by their storage, an expanded input by what it really spans); the saved tensors from the FX
    model (``memory_before``), less every one an op produced that Inductor may remove as a no-op (it
    then returns an alias, no buffer; ``saved``: each saved tensor's producing op and bytes); what
    code before the pair holds through it, too. None without a prediction."""
    before = memory_before
    ends = [p for p in before.points if p.phase == "forward"] if before is not None else []
    if not ends or not code.points:
        return None
    start = code.points[0].live
    maybe_alias = sum(nbytes for producer, nbytes in saved if producer in _MAY_BECOME_ALIASES)
    held = start["parameters"] + start["inputs"] + start.get("outside", 0)
    return held + max(0, ends[-1].live["saved"] - maybe_alias)


def checked_model_floor(
    memory_before: MemoryTimeline | None, memory_after: MemoryTimeline | None, code: MemoryTimeline
) -> int | None:
    """What the code without offloading peaks at, by the FX model checked against the plan's code:
    the plan's graphs and the unchanged ones are the same ops but for the copies, so Inductor fuses
    and frees them alike, and a model that gives the plan's code (``code``, replayed) its peak and
    its forward's peak within ``MODEL_AGREEMENT`` is taken at its word for the unchanged pair
    (``memory_before``), less that disagreement and ``MODEL_MARGIN``. None where it is further off
    (the tiny CNN under bf16 autocast, 23% under: Inductor's scheduler runs kernels in its own order)
    or has no figure: then the unchanged code is lowered to judge the plan."""
    timelines = (memory_before, memory_after, code)
    if any(t is None or not t.points for t in timelines):
        return None
    pairs = (
        (memory_after.peak_bytes, code.peak_bytes),
        (memory_after.phase_peak("forward"), code.phase_peak("forward")),
    )
    if any(real <= 0 for _, real in pairs):
        return None
    off = max(abs(modelled - real) / real for modelled, real in pairs)
    if off > MODEL_AGREEMENT:
        return None
    return int(memory_before.peak_bytes * (1 - off - MODEL_MARGIN))


def fit_is_lowest(pair: PlannedPair, code: MemoryTimeline, target: int) -> bool:
    """Whether a lower target cannot lower the peak of ``pair``'s code (``code``, its replay): the
    fit predicts more than ``target`` already, so it offloads and recomputes all it can by the
    model. Not where that code peaks in the forward with saved activations still on the device: the
    model peaked elsewhere, and a lower target may move them (the GPT under bf16 autocast: the model
    at a dropout, the code at the next attention, 2.34 MiB over a 2.15 MiB budget, met at 2.02 once
    planned again). In the backward those bytes may be reloads. Nor where the plan was kept for
    its code to judge: a lower target may find another. Nor where the fit's own estimate met the
    target and the model of the plan it made does not (a LoRA GPT's budget fit, on its intervals, met
    4.66 MiB, its plan's model peaked at 5.14 and its code at 5.14, where policy "all" reached 4.53):
    a lower target makes the fit take more."""
    after = pair.memory_after.peak_bytes if pair.memory_after is not None else 0
    held = code.peak.live.get("saved", 0) if code.peak.phase == "forward" else 0
    fit = pair.plan.fit_peak
    return after > target and (fit is None or fit > target) and not pair.plan.judged_on_code and not held


def plan_kept(plan_peak: int, unchanged_peak: int, autos_own: bool) -> bool:
    """The plan's code stays if it peaks lower than the unchanged code (or no higher, unless its
    picks are "auto"'s own: copies that buy nothing are not kept)."""
    return plan_peak < unchanged_peak or (plan_peak == unchanged_peak and not autos_own)


def with_peak_not_lowered(unchanged: PlannedPair, planned: PlannedPair, peak: MemoryTimeline, base_peak: int) -> PlannedPair:
    """The unchanged pair standing in for ``planned``: its graph id, policy and budget, each
    decision the plan changed saying why it was not carried out (``peak_not_lowered``)."""
    point = peak.peak
    above = point.total - base_peak
    why = (
        f"Inductor's code with the plan peaks at {fmt_bytes(point.total)} ({point.phase}, {point.node}), "
        + (f"{fmt_bytes(above)} above" if above else "as high as")
        + f" its code without offloading ({fmt_bytes(base_peak)}): compiled without offloading (verify_peak)"
    )
    by_name = {d.saved.name: d for d in planned.plan.decisions}

    def decided(d):
        p = by_name.get(d.saved.name)
        if p is None:
            return d
        if p.decision == Action.KEEP and p.reason.code != ReasonCode.RECOMPUTE_SOURCE:
            return dataclasses.replace(d, reason=p.reason)
        return dataclasses.replace(d, reason=Reason(ReasonCode.PEAK_NOT_LOWERED, f"{why}; {p.reason.text}"))

    plan = dataclasses.replace(
        unchanged.plan, decisions=tuple(map(decided, unchanged.plan.decisions)), policy=planned.plan.policy,
        note=why, memory_budget=planned.plan.memory_budget,
    )  # fmt: skip
    report = dataclasses.replace(
        unchanged.report, graph_id=planned.graph_id, policy=plan.policy, note=why, saved=saved_rows(plan),
        memory_budget=plan.memory_budget, replans=planned.report.replans, unchanged_code_peak=base_peak,
    )  # fmt: skip
    return dataclasses.replace(unchanged, graph_id=planned.graph_id, plan=plan, report=report)


def needs_unchanged_code(pair: PlannedPair, timeline: MemoryTimeline, opts: OffloadOptions) -> bool:
    """Whether ``verify_peak`` needs code without offloading to judge ``pair``'s plan, whose code
    ``timeline`` replays: it changes the graphs, returns a loss alone, and its code peaks above what
    the unchanged code holds at the end of its forward anyway (``unchanged_floor``) and above where
    the FX model, checked against the plan's code, puts the unchanged code (``checked_model_floor``)."""
    if not pair.plan.changes_graphs or not timeline.points or not returns_only_scalars(pair.fw, pair.num_fwd_outputs):
        return False
    mine = autos_own_picks(pair.plan, opts.offload_modules)
    saved = [(d.saved.producer, d.saved.nbytes) for d in pair.plan.decisions]
    checked = checked_model_floor(pair.memory_before, pair.memory_after, timeline)
    for floor, what in (
        (unchanged_floor(pair.memory_before, saved, timeline), "what the unchanged code holds"),
        (checked, "the FX model's unchanged peak, checked against the plan's code"),
    ):
        if floor is not None and plan_kept(timeline.peak_bytes, floor, mine):
            log.debug(
                "fxoffload: graph %d: Inductor's code peaks at %s, below %s (%s)",
                pair.graph_id, fmt_bytes(timeline.peak_bytes), fmt_bytes(floor), what,
            )  # fmt: skip
            return False
    return True
