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

The same wrapper times the plan's copies on the device (``copy_timer.CopyTimer``, ``runtime.timing``): at the
second call after each compile, one call's offloads and a reload of each (an ``auto`` plan that offloads
nothing as no copy would hide: its forward, ``learns_without_copies``). The measured windows, copy
times and stalls go on the report's rows. Where a copy of ``auto``'s stalled the compute stream, the
graph is planned again with the model corrected by what was measured (``planning.measured``: compute
scaled to the device, the link at its measured speed, the stalled tensors kept) and compiled again,
through the same path, and the next calls are measured again, within the same ``max_replans`` (not
where the stalls are under ``WORTH_A_COMPILE`` of the step: ``report.left_as_planned``). Where
it cannot be compiled again (dynamic shapes, a failed compile), the copies that stalled are switched
off in the compiled code (``switch_off``: no compile; the tensor stays on the device, as a copy).
With a memory_budget (``recompute="inductor"``), whose peak is the code's to judge, the graph is
planned again from measurements once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from .. import _compat
from ..analysis.memory import CallOutside
from ..analysis.output_code import read_offloads, reused_reloads
from ..analysis.outside import OutsideMemory, graph_device, mark_call, read_outside_memory
from ..ir import TransferTime, transfer_name
from ..measure.op_time import host_op_seconds
from ..options import OffloadOptions
from ..planning.budget import BUDGET_TOLERANCE, times_said
from ..planning.decisions import OffloadPlan
from ..planning.measured import (
    Measured, calls_over_allowance, calls_over_price, measured_plan, measured_step, room, stalled,
)
from ..planning.worth import stall_not_worth_a_compile
from ..reporting.report import carry_measured, with_measured
from ..runtime.host_pool import host_buffer_ranges
from ..runtime.transfers import switch_copies_off, switch_copies_on
from ..sizes import fmt_bytes
from ..warn import warn
from .compile import GraphCompiler
from .dynamo_graph import copy_graph_module
from .copy_timer import CopyTimer
from .pair import PlannedPair
from .refine import Trial, attempt_quietly, say

log = logging.getLogger(__name__)

__all__ = ["CallWatch"]

Compiled = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class _RunPeak:
    """The worst call of a run of ``calls``, and what it reaches."""

    worst: int  # its place in the run
    calls: int
    peak: int  # its predicted peak
    beyond: int  # how much more than the plan's own peak
    held: tuple[int, ...]  # bytes each call holds at every point (what it read, later calls' parameters)


class CallWatch:
    """Wraps a compiled graph: reads what code before it holds at its first calls, and times its
    copies (see the module)."""

    CALLS = 256
    SECONDS = 1.0  # and no more reading time than this per graph (a long eager history)

    def __init__(
        self,
        compiler: GraphCompiler,
        pair: PlannedPair,
        options: OffloadOptions,
        pristine: fx.GraphModule | None,
        seen: dict[int, int],
        ticks: Iterator[int],
    ) -> None:
        self.compiler = compiler
        # When it was made and last called, and its calls, on its backend's ``ticks`` (``settled``).
        self.ticks = ticks
        self.created = self.last_call = next(ticks)
        self.calls = 0
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
        self.judged = False  # a run of this plan's calls judged (``settled``)
        self.mark = object()  # on the backward node of each call read (``mark_call``)
        if pair.outside is None:
            self.left = 0  # nothing was read at the compile: nothing to compare with
        self.timer = CopyTimer(self)
        self.measured: Measured | None = None  # what the device measured, once a plan was made from it
        # The plan of the most bytes measured with no copy stalling, and what it was made from (None: the model).
        self.hid: tuple[OffloadPlan, Measured | None] | None = None

    @property
    def settled(self) -> bool:
        """Nothing more to measure or plan again: its copies timed and acted on, and, where a
        memory_budget may be planned again from what code before it holds, a run of its calls judged
        since its last compile (later runs are read on, for what they hold, but rarely planned for)."""
        judged = self.judged or not self.left or self.pristine is None
        return self.timer.done and (self.pair.memory_budget is None or judged)

    def wrap(self, compiled: Compiled) -> Compiled:
        self.compiled = compiled

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            self.last_call, self.calls = next(self.ticks), self.calls + 1
            if not self.left and self.timer.done:
                return self.compiled(*args)
            # A boxed call passes its arguments in one list (which the callee may empty): read first.
            inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            reading = self.left > 0
            if reading:
                self.left -= 1
                # The first call is the one Dynamo compiled for, with the arguments the compile read.
                if self.left < self.CALLS - 1:
                    self.see(inputs)
            started = self.timer.before_call(inputs)
            outputs = self.compiled(*args)
            self.timer.after_call(started)
            if reading:
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
        self.judged = True
        measured = self.measure()
        more = measured.beyond > BUDGET_TOLERANCE * pair.planned_peak_bytes()
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
            warn(text)
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
                text += f"; planned again {times_said(self.replans)} at run time, this is the last plan's"
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
        if self.compile_again(args, why, outside=model, measured=self.measured):
            self.said, self.verdict_due = False, True

    def compile_again(self, args: Any, why: str, outside: OutsideMemory | None, measured: Measured | None = None) -> bool:
        """Plan and compile the graph again (the arguments of the current call as its example
        inputs); its pair replaces the old one and runs from this call on. False where it failed:
        the old plan runs on."""
        old = self.pair
        self.replans += 1
        # strict is a compile's verdict: the run judges this plan, and a step is not failed over it.
        opts = self.options.replace(strict=False)
        self.compiler.forget_spent()
        try:
            graph = copy_graph_module(self.pristine)
            (compiled, new), said = attempt_quietly(
                lambda: _compile_outside_dynamo(self.compiler, graph, list(args), opts, outside, old.graph_id, measured)
            )
            boxed = getattr(compiled, "_boxed_call", False), getattr(self.compiled, "_boxed_call", False)
            if new is None or boxed[0] != boxed[1]:
                raise RuntimeError("the new compile has no plan or another calling convention")
        except Exception as e:  # never fail a step over a re-plan: the old plan runs on
            log.warning("fxoffload: graph %d: planning it again failed (%s); its plan is kept", old.graph_id, e)
            if old.report.timings is not None:  # what the failed round's compiles took stays said
                timings = old.report.timings
                old = self.pair = old.with_report(
                    timings=dataclasses.replace(timings, spent=(*timings.spent, *self.compiler.spent(self.replans)))
                )  # fmt: skip
            self.pair = old = self.compiler.register.record(old)
            self.pristine, self.why_not = None, f"planning it again failed ({e})"
            return False
        switch_copies_on(transfer_name(old.graph_id, ""))  # the new code's copies run, every one
        new = dataclasses.replace(new, report=carry_measured(new.report, old.report))
        new = new.with_report(replans=(*old.report.replans, why, *new.report.replans))
        if new.report.timings is not None and old.report.timings is not None:  # the earlier compiles stay said
            earlier = old.report.timings.spent
            spent = (*earlier, *(dataclasses.replace(s, round=self.replans) for s in new.report.timings.spent))
            new = new.with_report(timings=dataclasses.replace(new.report.timings, spent=spent))
        new = self.compiler.register.record(new)
        self.pair, self.compiled, self.held, self.judged = new, compiled, said, False
        self.timer.restart()
        return True

    def on_copy_times(self, times: list[TransferTime], forward: tuple[float, float] | None, args: Any) -> bool:
        """What the device measured of one call's copies: on the report; and, for "auto" (also on top
        of ``recompute="inductor"``), a plan made again where they stalled. True where the graph was planned again."""
        old = self.pair
        report = with_measured(old.report, times, *(forward or (None, None)))
        self.pair = dataclasses.replace(old, report=report)
        self.pair = self.compiler.register.record(self.pair)
        measured = measured_plan(old.plan, times, forward[0] if forward else None).merged(self.measured)
        if measured.host_bound("d2h") or measured.host_bound("h2d"):  # the device waited on the host
            measured = dataclasses.replace(measured, host_calls=host_op_seconds(self.timer.device))
        elif self.timer.device.type == "cpu":  # the host's thread is the compute stream
            measured = dataclasses.replace(measured, on_cpu=True)
        predicted = old.plan.stall * 1e3
        log.info(
            "fxoffload: graph %d: measured %d copies: %.3f ms of stall a step (%.3f ms predicted), compute %.2fx "
            "the model's in the forward, %.2fx in the backward", old.graph_id, len(times), measured.stall_s * 1e3,
            predicted, measured.fw_scale, measured.bw_scale,
        )  # fmt: skip
        options = self.options
        if not options.plans_from_measurements:  # "auto"'s own choices: alone, or on top of torch's recompute
            return False
        # Planned again where a copy stalled, or where, in a phase the host bound or on a CPU, the calls
        # cost more of the step than auto allows, or than a budget's plan priced them (not where the user
        # set ``op_time``).
        dearer = calls_over_allowance if options.memory_budget is None else calls_over_price
        costly = options.op_time is None and dearer(old.plan, measured)
        copies_stalled = any(stalled(t) for t in times)
        if copies_stalled and not costly and old.plan.costs is not None:  # too little to compile for: said
            now = {n: s for n, s in measured.stalls.items() if n in {t.tensor for t in times}}
            left = stall_not_worth_a_compile(now, sum(now.values()), sum(measured_step(old.plan.costs, measured)))
            if left:
                log.info("fxoffload: graph %d: %s; left as planned", old.graph_id, left)
                self.pair = self.pair.with_report(left_as_planned=left)
                self.pair = self.compiler.register.record(self.pair)
                return False
        stalled_now = copies_stalled or costly
        can_compile = self.pristine is not None and self.replans < options.max_replans
        if not stalled_now:
            # Every copy hid: kept in mind (``back_to_hidden``), and planned again where more would hide
            # (``room``); not for a budget, nor by the last re-plan, which is left to take back what stalls.
            if self.hid is None or old.plan.offloaded_bytes > self.hid[0].offloaded_bytes:
                self.hid = (old.plan, self.measured)
            if not can_compile or self.replans >= options.max_replans - 1 or options.memory_budget is not None:
                return False
            host = self.compiler.register.host_left(options.host_budget, old.graph_id)
            grows = room(old.plan, measured, options, host)
            return bool(grows) and self._compile_measured(dataclasses.replace(measured, grows=grows), predicted, args)
        if options.memory_budget is None:
            # Planned again and compiled (the stalled tensors kept, stalls summed over the rounds), the
            # last time offloading only what was measured to hide; switched off only where it cannot
            # be compiled: code with its copies switched off keeps a copy of each tensor and calls the
            # transfer ops (gpt2-medium on an H100: 1.15x Inductor's step, 8% more memory).
            if can_compile and self.replans == options.max_replans - 1:
                measured = measured.hidden_only(old.plan)
                hid = sum(d.saved.nbytes for d in old.plan.offloaded if d.saved.name in (measured.only or ()))
                if self.hid is not None and self.hid[0].offloaded_bytes > hid:
                    said = "copies stalled" if copies_stalled else "its op calls cost more of the step than auto allows"
                    return self.back_to_hidden(args, said)
            return (can_compile and self._compile_measured(measured, predicted, args)) or self.switch_off(
                measured, predicted
            )
        # With a budget, one plan made again from measurements (a second measurement is reported, not
        # acted on: the plans would take turns), compiled: the peak it reaches is the code's; and
        # within ``max_replans``, with the re-plans for outside memory.
        final = dataclasses.replace(measured, final=True)  # the only one: the tensors that stalled kept
        return can_compile and self.measured is None and self._compile_measured(final, predicted, args)

    def back_to_hidden(self, args: Any, what: str) -> bool:
        """The last re-plan where the copies of a plan made for more (``planning.measured.room``), or of
        one made after it, stalled (``what`` the last plan did: its copies stalled, or its calls cost
        more than auto allows), and those that hid are fewer bytes than the plan of ``hid``, all of
        whose copies hid: that plan, made again from what it was made from, not planned anew. The same
        model gives the same plan, but where the other graphs' offloads now take more of a host_budget,
        or ``calibrate`` times the ops again."""
        plan, measured = self.hid
        why = (
            f"measured in the first steps: {what}, and the copies that hid are fewer bytes than the "
            f"{fmt_bytes(plan.offloaded_bytes)} an earlier plan offloaded, all of whose copies hid; that plan made "
            "again as it was"
        )  # fmt: skip
        log.info("fxoffload: graph %d: %s", self.pair.graph_id, why)
        self.measured = measured
        return self.compile_again(args, why, outside=self.pair.outside, measured=measured)

    def _compile_measured(self, measured: Measured, predicted: float, args: Any) -> bool:
        """The graph planned again with the model corrected by ``measured`` and compiled; False where
        that failed (the old plan runs on)."""
        old = self.pair
        why = measured.why(predicted)
        log.info("fxoffload: graph %d: %s", old.graph_id, why)
        self.measured = measured
        return self.compile_again(args, why, outside=old.outside, measured=measured)

    def switch_off(self, measured: Measured, predicted_ms: float) -> bool:
        """``auto``'s plan made again from what was measured, without compiling again: the copies that
        stalled are switched off in the compiled code (``runtime.transfers.switch_copies_off``), their
        tensors kept on the device, and the next calls measured again; at most ``max_replans`` times
        (taking copies away frees the link for the others: it converges). A copy stays on where
        Inductor's backward hands its reload result on to another buffer (the copy a switched-off
        reload gives back must be intact for a second backward, ``retain_graph``), or where its forward
        reads the host copy (a switched-off offload's handle holds no bytes: ``read_offloads``)."""
        old = self.pair
        if self.replans >= self.options.max_replans:
            return False
        code = old.output_code
        reused = reused_reloads(code.get("backward", "")) | read_offloads(code.get("forward", ""))
        offloaded = {d.saved.name for d in old.plan.offloaded}
        stalls = {t: s for t, s in measured.stalls.items() if t in offloaded}
        stuck = sorted(t for t in stalls if transfer_name(old.graph_id, t) in reused)
        if stuck:
            log.info(
                "fxoffload: graph %d: the copies of %s stalled but stay on: Inductor's code reuses the memory of "
                "their reloads or reads their host copies", old.graph_id, ", ".join(stuck),
            )  # fmt: skip
        off = {t: s for t, s in stalls.items() if t not in stuck}
        if not off:
            return False
        self.replans += 1
        self.measured = measured
        why = (
            f"measured in the first steps: the copies of {', '.join(sorted(off))} stalled the compute stream "
            f"{sum(off.values()) * 1e3:.3g} ms a step (the plan predicted {predicted_ms:.3g} ms); switched off at "
            "run time, those tensors kept on the device, without compiling again"
        )
        log.info("fxoffload: graph %d: %s", old.graph_id, why)
        switch_copies_off([transfer_name(old.graph_id, t) for t in off])
        new = old.with_switched_off(dataclasses.replace(measured, stalls=off).keep())
        self.pair = self.compiler.register.record(new.with_report(replans=(*old.report.replans, why)))
        self.timer.restart()
        return True


@torch.compiler.disable
def _compile_outside_dynamo(
    compiler: GraphCompiler,
    gm: fx.GraphModule,
    example_inputs: list[Any],
    opts: OffloadOptions,
    outside: OutsideMemory | None,
    graph_id: int,
    measured: Measured | None = None,
) -> tuple[Compiled, PlannedPair | None]:
    """``compiler.compile`` from a running step (``CallWatch.compile_again``): Dynamo is not to trace it.
    The call's arguments go in as fakes of Dynamo's mode, as at the first compile (``_compat.static_fakes``):
    from real ones AOTAutograd could not trace a ``nonzero`` (a mixture of experts' dispatch)."""
    fakes = _compat.static_fakes(example_inputs, like=gm)
    return compiler.compile(gm, fakes, opts, outside=outside, graph_id=graph_id, measured=measured)
