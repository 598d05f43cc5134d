"""The one refine loop: plan, judge the peak the plan reached, plan again for a lower target.

    best, trials = refine(budget, attempt, limit)

``attempt(target)`` plans (and, where the peak is judged on generated code, compiles) for a target
peak and returns a ``Trial`` with the peak it reached. While that peak misses ``budget``, the next
target is lowered by the miss, at most ``limit`` more times (the ``max_replans`` option); the trial
with the lowest peak is kept. Every caller judges on its own evidence: the memory model of the
partition torch made for a recomputation (``offload_pass``), the replay of Inductor's code
(``compile``), the calls measured at run time (``watch``, which compiles through the same loop).
Warnings an attempt gives are held, and only the kept trial's are said (``say``).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ..sizes import fmt_bytes

log = logging.getLogger(__name__)

__all__ = ["Trial", "lowest", "refine", "say"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Trial(Generic[T]):
    """What one attempt made (``value``) and the peak it reached; None: no peak to judge it by."""

    value: T
    peak: int | None
    # The target it was planned for (None: the budget); a first attempt may say what it aimed at
    # instead (a fraction of the code's peak is aimed at as that fraction of the FX model's).
    target: int | None = None
    # A lower target cannot lower this peak (the plan is the fit's smallest already, or nothing more
    # can be recomputed): the loop stops after it.
    lowest_reachable: bool = False
    said: tuple[warnings.WarningMessage, ...] = dataclasses.field(default=(), compare=False, repr=False)
    # The budget in bytes it is judged against, where the caller of ``refine`` could not know it
    # before the first attempt (a fraction of a baseline the plan computes).
    budget: int | None = None
    # What the plan costs in time (``OffloadPlan.time_cost``: stall, recomputation, op calls): of
    # the trials that meet the budget, the cheapest is kept.
    cost: float = 0.0
    # Planned again for a higher target where it is well under the budget (its plan did something).
    raisable: bool = False
    # Its plan rewrote the graphs as an earlier trial's did (nothing compiled again): ``peak`` is that
    # trial's. Never kept, but judged: a target lowered again may still change the plan.
    repeats: bool = False


def attempt_quietly(fn: Callable[[], T]) -> tuple[T, tuple[warnings.WarningMessage, ...]]:
    """``fn()`` with the warnings it gives held back, to be said only if its result is kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, tuple(caught)


def refine(
    budget: int | None,
    attempt: Callable[[int | None], Trial[T] | None],
    limit: int,
    on_replan: Callable[[Trial[T], int], None] | None = None,
    start: int | None = None,
    tolerance: float = 0.0,
    raise_below: float = 0.9,
) -> tuple[Trial[T] | None, list[Trial[T]]]:
    """Try ``start`` (default: ``budget``), then a target moved by each miss, ``limit`` more times at
    most, and return the trial kept and every trial judged.

    A trial over the budget by more than ``tolerance`` is planned again for a target lowered by the
    miss. A trial that can be raised (``raisable``) and peaks below ``raise_below`` of the budget is
    planned again for a target raised by the slack: a plan made on a model that over-counts (where
    Inductor fuses or reuses buffers in ways the FX model does not follow) offloads more than the
    budget needs, and the code it compiles to is the judge. Kept: of the trials within
    ``tolerance`` of the budget, the cheapest (``cost``); else the lowest peak (the first trial when
    none could be judged). A trial that ``repeats`` an earlier one moves the target by that one's
    miss again and is not kept. ``budget`` None: the first trial's ``budget``. ``attempt`` returns None
    to stop; ``on_replan(trial, next_target)`` hears of each trial planned again."""
    trials: list[Trial[T]] = []
    target = start if start is not None else budget
    for i in range(limit + 1):
        trial = attempt(target)
        if trial is None:
            break
        if trial.peak is None:  # nothing to judge it by: kept only if it is all there is
            return (trial if not trials else min(trials, key=_peak)), trials
        if not trial.repeats:
            trials.append(trial)
        budget = budget if budget is not None else trial.budget
        if budget is None or i == limit:
            break
        over = trial.peak > budget * (1 + tolerance)  # met within it: another compile buys nothing
        slack = trial.raisable and trial.peak < budget * raise_below
        if (over and trial.lowest_reachable) or not (over or slack):
            break
        aimed = trial.target if trial.target is not None else target  # a first plan may say what it aimed at
        target = (aimed if aimed is not None else budget) - (trial.peak - budget)
        if target <= 0:
            break
        log.debug(
            "fxoffload: a plan peaked at %s, %s the budget %s; planning again for %s",
            fmt_bytes(trial.peak), "over" if over else "under", fmt_bytes(budget), fmt_bytes(target),
        )  # fmt: skip
        if on_replan is not None:
            on_replan(trial, target)
    return _kept(trials, budget, tolerance), trials


def _kept(trials: Sequence[Trial[T]], budget: int | None, tolerance: float) -> Trial[T] | None:
    if not trials:
        return None
    meeting = [t for t in trials if budget is not None and t.peak <= budget * (1 + tolerance)]
    if meeting:
        return min(meeting, key=lambda t: (t.cost, t.peak))
    return min(trials, key=_peak)


def lowest(candidates: Sequence[Trial[T]], keep_first_on_tie: bool = True) -> Trial[T]:
    """The candidate with the lowest peak; on a tie the first, or (``keep_first_on_tie=False``) the
    last: a plan whose copies buy nothing gives way to the unchanged code."""
    best = candidates[0]
    for c in candidates[1:]:
        if c.peak is not None and (best.peak is None or c.peak < best.peak or (c.peak == best.peak and not keep_first_on_tie)):
            best = c
    return best


def say(trial: Trial[T] | None, drop: Callable[[warnings.WarningMessage], bool] = lambda w: False) -> None:
    """Say the warnings the kept trial's attempt held back, less those ``drop`` selects."""
    for w in trial.said if trial is not None else ():
        if not drop(w):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _peak(trial: Trial[T]) -> int:
    return trial.peak if trial.peak is not None else 0
