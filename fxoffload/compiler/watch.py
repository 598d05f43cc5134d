"""What code before a graph holds, read again at its first calls: a graph compiled once and run again
later in the step (a block compiled once and called for every layer) holds more there than its
plan counted at the compile.

The calls are judged in runs, the calls of one step: a call continues the run where what it reads
reaches an earlier call of the graph whose backward is pending (``analysis.outside.mark_call`` marks
each call's backward node), else it starts the next (the next step's first block, a graph run once
per step, a micro-batch after its backward). A run that reading ends in (after ``CALLS`` calls or
``SECONDS``) is not judged. Call ``k`` of a run of ``n`` holds what it was read holding, and the
parameters of the ``n - 1 - k`` calls after it (the same graph, so as many bytes as its own; unseen
from its inputs), at every point; during its backward, those calls' parameter gradients too (their
backward ran first). Its peak is the plan's (Inductor's code where there is one, forward and
backward apart) plus what it held beyond the plan's count.

- **Planned again.** With a memory_budget that the worst call's peak is over (and more than the plan
  counted), the graph is planned for the run's first and last calls (and the worst) at once
  (``OutsideMemory.calls``) and compiled again through the compiler's own refine loop, outside
  Dynamo, from a copy of its graph with the current call's arguments; this call and the later ones
  run the new code, whose pair replaces the old one under the same id. Its compile's own verdict on
  the budget is held back: the next run is the verdict. At most ``max_replans`` times per graph.
- **Said,** once per graph with the figures (a RuntimeWarning where over the budget, else a log
  line): a call holding more than the plan counted that is not planned again (no budget, dynamic
  shapes: compiling again would fix the sizes, re-plans spent), or a re-planned graph whose run
  still misses the budget. ``seen`` keeps the most held beyond a plan, by graph id.

Reading costs about 20 us per autograd node, at most ``SECONDS`` per graph, and nothing after.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..analysis.memory import CallOutside
from ..analysis.outside import OutsideMemory, graph_device, mark_call, read_outside_memory
from ..options import OffloadOptions
from ..planning.budget import BUDGET_TOLERANCE
from ..runtime.host_pool import host_buffer_ranges
from ..sizes import fmt_bytes
from .compile import GraphCompiler, copy_graph_module
from .pair import PlannedPair
from .refine import Trial, attempt_quietly, say

log = logging.getLogger(__name__)

__all__ = ["OutsideWatch"]

Compiled = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class _RunPeak:
    """The worst call of a run of ``calls``, and what it reaches."""

    worst: int  # its place in the run
    calls: int
    peak: int  # its predicted peak
    beyond: int  # how much more than the plan's own peak
    held: tuple[int, ...]  # bytes each call holds at every point (what it read, later calls' parameters)


class OutsideWatch:
    """Wraps a compiled graph: reads what code before it holds at its first calls (see the module)."""

    CALLS = 256
    SECONDS = 1.0  # and no more reading time than this per graph (a long eager history)

    def __init__(
        self,
        compiler: GraphCompiler,
        pair: PlannedPair,
        options: OffloadOptions,
        pristine: fx.GraphModule | None,
        seen: dict[int, int],
    ) -> None:
        self.compiler = compiler
        self.pair = pair
        self.options = options
        self.pristine = pristine  # Dynamo's graph as it came, to compile again; None: never planned again
        self.why_not = "" if pristine is not None else "its shapes are dynamic, and compiling again would fix them"
        self.seen = seen  # by graph id: the most code before it held beyond its plan
        self.compiled: Compiled | None = None
        self.left = self.CALLS
        self.spent = 0.0
        self.said = False
        # What each call of the current run held, in order (the compile read the first run's first).
        self.run: list[OutsideMemory] = [pair.outside] if pair.outside is not None else []
        self.replans = 0
        self.held: tuple[warnings.WarningMessage, ...] = ()  # the last re-plan's compile-time verdict
        self.verdict_due = False  # planned again, and no run of the new plan judged yet
        self.mark = object()  # on the backward node of each call read (``mark_call``)

    def wrap(self, compiled: Compiled) -> Compiled:
        self.compiled = compiled

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            if not self.left:
                return self.compiled(*args)
            self.left -= 1
            # The first call is the one Dynamo compiled for, with the arguments the compile read.
            if self.left < self.CALLS - 1:
                # A boxed call passes its arguments in one list (which the callee may empty): read first.
                self.see(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
            outputs = self.compiled(*args)
            try:
                mark_call(outputs, self.mark)  # a later call in this step reaches it
            except Exception as e:  # an estimate never fails a step
                log.debug("fxoffload: graph %d: cannot mark its call (%s)", self.pair.graph_id, e)
            return outputs

        return run

    def see(self, args: Any) -> None:
        start = time.perf_counter()
        try:
            seen = read_outside_memory(args, graph_device(args), host_buffer_ranges(), mark=self.mark)
        except Exception as e:  # an estimate never fails a step
            log.debug("fxoffload: graph %d: cannot read what code before it holds (%s)", self.pair.graph_id, e)
            seen = None
        finally:
            self.spent += time.perf_counter() - start
            if self.spent > self.SECONDS:
                self.left = 0
        try:
            if seen is not None and self.run and not seen.reaches_mark:
                self.judge(args)  # the run before this call: this one is not run after it in a step
                self.run = []
            if seen is not None:
                self.run.append(seen)
            if not self.left:
                self.stop()
        except Exception as e:  # a verdict never fails a step either
            log.warning("fxoffload: graph %d: judging its calls failed (%s)", self.pair.graph_id, e)
            self.left, self.run = 0, []

    def stop(self) -> None:
        """Reading ends, within a run that may go on: it is not judged (its later calls are not
        known). The last re-plan's compile-time verdict on the budget, held back for a run that will
        not be judged now, is said as it was."""
        if self.verdict_due:
            say(Trial(None, None, said=self.held))
        self.run, self.held, self.verdict_due, self.pristine = [], (), False, None

    def measure(self) -> _RunPeak:
        """The worst call of the run that just ended (``self.run``), by the plan's phase peaks."""
        pair, run = self.pair, self.run
        up = pair.outside
        planned_fw = pair.outside_bytes
        planned_bw = up.outside(pair.kept_bytes, "backward") if up is not None else 0
        fw_peak, bw_peak = pair.phase_peaks()
        n, grads, params = len(run), pair.param_grad_bytes, pair.parameter_bytes()
        held = tuple(u.held_bytes + (n - 1 - k) * params for k, u in enumerate(run))  # at every point

        def reached(k: int) -> int:
            return max(fw_peak + held[k] - planned_fw, bw_peak + held[k] + (n - 1 - k) * grads - planned_bw)

        worst = max(range(n), key=reached)
        peak = reached(worst)
        return _RunPeak(worst, n, peak, peak - max(fw_peak, bw_peak), held)

    def judge(self, args: Any) -> None:
        """The run that just ended (``self.run``); ``args``: the current call's."""
        if not self.run:
            return
        pair, run = self.pair, self.run
        measured = self.measure()
        more = measured.beyond > BUDGET_TOLERANCE * (pair.memory_after.peak_bytes if pair.memory_after else 0)
        if more:
            most = max(u.held_bytes for u in run)
            self.seen[pair.graph_id] = max(most, self.seen.get(pair.graph_id, 0))
        budget = pair.memory_budget
        over = budget is not None and measured.peak > budget * (1 + BUDGET_TOLERANCE)
        if over and more and self.pristine is not None and self.replans < self.options.max_replans:
            self.replan(args, self._model_of(measured), measured)
            return
        said, due, self.held, self.verdict_due = self.held, self.verdict_due, (), False
        if not over and due:
            log.info(
                "fxoffload: graph %d: planned again at run time, its calls peak at %s at most, memory_budget %s met",
                pair.graph_id, fmt_bytes(measured.peak), fmt_bytes(budget or 0),
            )  # fmt: skip
        # Said: more held than planned, or a plan made again at run time still over. A plan over the
        # budget by itself was said at its compile.
        if self.said or not (more or (over and due)):
            return
        self.said = True
        text = self._said(run[measured.worst], measured, more, over)
        if over:
            for w in said:  # what the last plan's compile said about the budget
                log.info("fxoffload: graph %d: at its last compile: %s", pair.graph_id, w.message)
            warnings.warn(text, RuntimeWarning, stacklevel=3)
        else:
            log.warning(text)

    def _model_of(self, measured: _RunPeak) -> OutsideMemory:
        """What the run's calls hold, for a plan made for its first call, its worst and its last at
        once (each point's bytes are linear in the call's place in the run, so one of the ends is the
        worst of any plan). The k calls before call k hold what this plan keeps, each (their backward
        is pending: call k reached them)."""
        pair, n, worst = self.pair, measured.calls, measured.worst
        kept, grads, params = pair.kept_bytes, pair.param_grad_bytes, pair.parameter_bytes()
        calls = [CallOutside(measured.held[k] - k * kept, k, (n - 1 - k) * grads) for k in sorted({0, worst, n - 1})]
        most = self.run[worst]
        return dataclasses.replace(most, params_bytes=most.params_bytes + (n - 1 - worst) * params, calls=tuple(calls))

    def _said(self, most: OutsideMemory, measured: _RunPeak, more: bool, over: bool) -> str:
        pair, n, worst = self.pair, measured.calls, measured.worst
        params, grads = pair.parameter_bytes(), pair.param_grad_bytes
        text = (
            f"fxoffload: graph {pair.graph_id}, call {worst + 1} of {n} in a row: ran with "
            f"{fmt_bytes(most.held_bytes)} held by code before it"
        )
        if worst < n - 1:
            text += (
                f", {fmt_bytes((n - 1 - worst) * params)} of the later calls' parameters and "
                f"{fmt_bytes((n - 1 - worst) * grads)} of their gradients in its backward"
            )
        if more:
            text += (
                f", {fmt_bytes(measured.beyond)} more than its plan and report count: a graph compiled once and run "
                "again later in the step (a block compiled once and called for every layer) holds more there"
            )
        text += f". Its predicted peak at that call: {fmt_bytes(measured.peak)}"
        if over:
            text += f", over memory_budget {fmt_bytes(pair.memory_budget or 0)}"
            if self.replans:
                text += f"; planned again {self.replans} times at run time, this is the last plan's"
            elif self.why_not:
                text += f"; not planned again: {self.why_not}"
        return text + ". Compiling the whole model as one graph lets the plan see all of it."

    def replan(self, args: Any, model: OutsideMemory, measured: _RunPeak) -> None:
        """Plan and compile the graph again for ``model``; its pair replaces the old one."""
        old, n, call = self.pair, measured.calls, measured.worst
        why = (
            f"at run time, call {call + 1} of {n} in a row had {fmt_bytes(self.run[call].held_bytes)} held by code "
            f"before it: its predicted peak, {fmt_bytes(measured.peak)}, was over memory_budget "
            f"{fmt_bytes(old.memory_budget or 0)}; planned for the first and the last call of {n} at once"
            + (f", and call {call + 1}" if 0 < call < n - 1 else "")
            + f", where the last runs after {max(c.repeats for c in model.calls)} calls of this graph that "
            "keep what its plan keeps"
        )  # fmt: skip
        log.info("fxoffload: graph %d: %s", old.graph_id, why)
        self.replans += 1
        # strict is a compile's verdict: the run judges this plan, and a step is not failed over it.
        opts = self.options.replace(strict=False)
        try:
            graph = copy_graph_module(self.pristine)
            (compiled, new), said = attempt_quietly(
                lambda: _compile_outside_dynamo(self.compiler, graph, list(args), opts, model, old.graph_id)
            )
            boxed = getattr(compiled, "_boxed_call", False), getattr(self.compiled, "_boxed_call", False)
            if new is None or boxed[0] != boxed[1]:
                raise RuntimeError("the new compile has no plan or another calling convention")
        except Exception as e:  # never fail a step over a re-plan: the old plan runs on
            log.warning("fxoffload: graph %d: planning it again failed (%s); its plan is kept", old.graph_id, e)
            self.compiler.register.record(old)
            self.pristine, self.why_not = None, f"planning it again failed ({e})"
            return
        new = new.with_report(replans=(*old.report.replans, why, *new.report.replans))
        self.compiler.register.record(new)
        self.pair, self.compiled, self.held = new, compiled, said
        self.said, self.verdict_due = False, True


@torch.compiler.disable
def _compile_outside_dynamo(
    compiler: GraphCompiler,
    gm: fx.GraphModule,
    example_inputs: list[Any],
    opts: OffloadOptions,
    outside: OutsideMemory,
    graph_id: int,
) -> tuple[Compiled, PlannedPair | None]:
    """``compiler.compile`` from a running step (``OutsideWatch.replan``): Dynamo is not to trace it."""
    return compiler.compile(gm, example_inputs, opts, outside=outside, graph_id=graph_id)
