"""What the device measured of a plan's copies, as the planner uses it: the model corrected. Pure.

The cost model's times are a first guess (on an H100 it priced compute 3.3x too slow, median over
every saved tensor of a 12-layer stack: ``tests/test_kernel_times.py``). The first steps measure each
copy's window (the compute between its issue and its wait), its duration and the stall at its wait
(``runtime.timing``). From those:

- the compute the model priced between each copy's issue and its wait, against the measured window
  (the compute there: other copies' stalls and calls taken out, ``runtime.timing``), gives one
  scale per phase (the median ratio), applied to every node's predicted time; a plan made from an earlier
  measurement has its model scaled already (``PlanCosts.scale``), and its ratios are taken back to
  the model as it came, so that the rounds' ratios are of one model and merge;
- the bytes the copies moved over the time they took give the link's speed per direction;
- the compute stream's own time in each tensor's calls gives the op calls' price (``op_time``); on
  an accelerator, in a phase whose windows took the compute stream about as long as the host took
  to issue them (``HOST_BOUND``: the device waited on the host; ``host_ratio``), the calls' host time
  (``host_calls``) where more: every host microsecond is step time there;
- every tensor whose copy stalled the compute stream is named (``stalls``) and, but in the last plan
  made from measurements (``final``: there it is kept on the device), judged again by the corrected
  model: a stall measures the window the plan placed the copy in, which a model that
  priced the device slow placed short (a reload issued too late, a wait too early); the corrected
  model places it again, and a copy that still cannot hide stays on the device (``not_hidden``).
  Keeping every tensor that stalled settled gpt2-medium's ``auto`` on the H100 at 4% of what could
  leave the peak, and a CPU run at 1.0 MiB where a plan that had not stalled kept 2.5
  (docs/results.md). Where copies are switched off instead (no plan made again), the ones that
  stalled are the ones switched off (``switched_off``);
- where every copy hid, the tensors the corrected model says would hide too are named (``room``): a
  plan priced before measurements keeps a margin for a device faster than its model, and kept them
  on the device for it (at 5 GB/s in bf16, 6.44 MiB offloaded where 8.59 hid without the margin:
  docs/results.md). Planned again for them, but never by the last re-plan: a round must be left
  to take back what stalls, and it gives back no more than was taken (where what hid under a plan
  made for more is fewer bytes than the plan before it, all of whose copies hid, the last re-plan
  is that plan, made again from the measurement it was made from: ``compiler.watch``).

A plan made again from these is what ``auto`` offloads knowing the device; its last re-plan offloads
only what was measured to hide (``hidden_only``): taking copies away only frees the link for the
others, so what hid still hides. Where a graph cannot be compiled again, ``switched_off`` is the
compiled plan less the copies that stalled, which the runtime switches off
(``runtime.transfers.switch_copies_off``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from ..analysis.cost import FIRST_GUESS_MARGIN, DeviceRates
from ..ir import TransferTime
from ..options import OffloadOptions
from ..reasons import Action, Reason, ReasonCode
from ..sizes import fmt_bytes
from .decisions import OffloadPlan, PlanCosts
from .plan import auto_offload_bytes
from .schedule import OpAllowance, copy_windows
from .worth import WORTH_A_COMPILE

__all__ = [
    "HOST_BOUND", "MEASURED_MARGIN", "Measured", "ROOM_SHARE", "STALL_FLOOR_S", "calls_over_allowance",
    "calls_over_price", "host_bound", "host_ratio", "learns_without_copies", "measured_plan", "measured_step", "room",
    "switched_off",
]

# A copy stalled when the compute stream waited for it longer than this and than a tenth of the
# copy: below, a wait's own cost (an event, a Python call) and the clocks' noise.
STALL_FLOOR_S = 50e-6
STALL_SHARE = 0.1
# The copy margin a measured model keeps (``Measured.margin``): at least the first (the clocks' and
# the link's noise between steps), at most the second.
MEASURED_MARGIN = (0.1, 1.0)
# A phase is host-bound where its copies' windows took the compute stream (stalls left in) at most
# this many times the host's time to issue them (summed): the device ran no faster than its host.
HOST_BOUND = 1.1
# A plan whose copies all hid is made again where the model corrected by their measurement offloads
# more, by at least this share of the pair's saved bytes (``room``): a compile for less is not worth it.
ROOM_SHARE = WORTH_A_COMPILE


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the first steps measured of a graph's copies, under one plan or several (``merged``),
    and the corrections it gives the model."""

    times: tuple[TransferTime, ...]
    # Measured window / the model's, per copy measured, forward (offloads) and backward (reloads).
    fw_ratios: tuple[float, ...]
    bw_ratios: tuple[float, ...]
    moved: Mapping[str, tuple[int, float]]  # per direction: bytes copied and the seconds they took
    stalls: Mapping[str, float]  # saved tensor -> seconds its copies stalled the compute stream
    # The last re-plan's: only these may be offloaded (those measured to hide); None: any.
    only: frozenset[str] | None = None
    # The last plan made from measurements (no round after it to judge a tensor judged again): the
    # tensors whose copies stalled are kept on the device (``keep``), not judged again.
    final: bool = False
    # Host seconds of one tensor's forward calls and backward calls (``measure.op_time.host_op_seconds``):
    # what they cost a host-bound phase. None: not measured (a CPU, where ``op_s`` is host time).
    host_calls: tuple[float, float] | None = None
    # Bytes a plan made from this measurement offloads beyond the measured plan's, its copies having
    # hidden with room to spare (``room``): the reason it is made. 0: made for stalls or calls.
    grows: int = 0
    # Only the forward's time, no copy (``learns_without_copies``): one ratio for both phases, and no
    # spread of windows to size a margin by (the first guess's is kept, ``margin``).
    forward_only: bool = False
    # Timed on a CPU (``offload_cpu``): the compute stream is the host's own thread, so each call's
    # measured time (``op_s``: the call, and its wait's work) is step time in either phase, as in a
    # phase the host bound on an accelerator.
    on_cpu: bool = False

    def host_bound(self, direction: str) -> bool:
        """Whether the phase of ``direction``'s copies was host-bound when measured (``host_ratio``)."""
        return host_bound(host_ratio(self.times, direction))

    @property
    def fw_scale(self) -> float:
        """Measured forward compute / the model's (the median over the copies measured)."""
        return statistics.median(self.fw_ratios) if self.fw_ratios else 1.0

    @property
    def bw_scale(self) -> float:
        return statistics.median(self.bw_ratios) if self.bw_ratios else 1.0

    @property
    def margin(self) -> float:
        """The copy margin the corrected model keeps: one scale per phase (the median) leaves the copies
        whose windows ran shorter than that scale says short by as much, so the margin is the spread
        below the median, the lowest ratio's or, from ten copies, the lowest tenth's, in the phase
        where it is widest (``MEASURED_MARGIN`` bounds it); the first guess's where only a forward was
        timed."""
        if self.forward_only:
            return FIRST_GUESS_MARGIN
        spread = 0.0
        for ratios in (self.fw_ratios, self.bw_ratios):
            if len(ratios) < 2:
                continue
            low = statistics.quantiles(ratios, n=10)[0] if len(ratios) >= 10 else min(ratios)
            if low > 0:
                spread = max(spread, statistics.median(ratios) / low - 1)
        least, most = MEASURED_MARGIN
        return min(max(spread, least), most)

    @property
    def d2h(self) -> float | None:
        """Bytes/s the offloads moved at; None: no offload measured."""
        nbytes, seconds = self.moved.get("d2h", (0, 0.0))
        return nbytes / seconds if seconds > 0 else None

    @property
    def h2d(self) -> float | None:
        nbytes, seconds = self.moved.get("h2d", (0, 0.0))
        return nbytes / seconds if seconds > 0 else None

    @property
    def stall_s(self) -> float:
        return sum(t.stall_s for t in self.times)

    @property
    def op_time(self) -> float | None:
        """The compute stream's time one offloaded tensor's calls took (the median over the tensors
        measured both ways: ``DeviceRates.op_time`` as the device ran it), each phase's calls at
        their host time at least where the host bound it; None: none measured."""
        host = {
            d: self.host_calls[d == "h2d"] if self.host_calls is not None and self.host_bound(d) else 0.0
            for d in ("d2h", "h2d")
        }  # fmt: skip
        by: dict[str, dict[str, float]] = {}
        for t in self.times:
            by.setdefault(t.tensor, {})[t.direction] = max(t.op_s, host[t.direction])
        both = [sum(d.values()) for d in by.values() if len(d) == 2]
        return statistics.median(both) if both else None

    def priced_op_time(self, rates: DeviceRates) -> float | None:
        """What ``rates`` price the calls of the tensors ``op_time`` is the median over (their
        median ``DeviceRates.op_cost``, by the bytes offloaded); None: none measured both ways."""
        by: dict[str, dict[str, int]] = {}
        for t in self.times:
            by.setdefault(t.tensor, {})[t.direction] = t.nbytes
        both = [rates.op_cost(d["d2h"]) for d in by.values() if len(d) == 2]
        return statistics.median(both) if both else None

    def merged(self, earlier: Measured | None) -> Measured:
        """This measurement and an earlier one of the same graph: every ratio, every byte moved and
        every tensor that stalled, but those this one timed again without a stall (judged again, a
        tensor that stalled is offloaded again where the corrected model says it hides: hiding now, it
        is no longer one that stalled)."""
        if earlier is None:
            return self
        moved = {
            k: (self.moved.get(k, (0, 0.0))[0] + earlier.moved.get(k, (0, 0.0))[0],
                self.moved.get(k, (0, 0.0))[1] + earlier.moved.get(k, (0, 0.0))[1])
            for k in {*self.moved, *earlier.moved}
        }  # fmt: skip
        timed_now = {t.tensor for t in self.times}
        stalls = {**{k: v for k, v in earlier.stalls.items() if k not in timed_now}, **self.stalls}
        return Measured(
            self.times, earlier.fw_ratios + self.fw_ratios, earlier.bw_ratios + self.bw_ratios, moved, stalls,
            host_calls=self.host_calls or earlier.host_calls,
        )  # fmt: skip

    def hidden_only(self, plan: OffloadPlan) -> Measured:
        """This measurement, the next plan to offload only what ``plan`` offloaded and was measured
        to hide: it brings no copy that was not measured, and taking copies away only frees the
        link for the others (the rounds converge)."""
        hidden = frozenset(d.saved.name for d in plan.offloaded if d.saved.name not in self.stalls)
        return dataclasses.replace(self, only=hidden, final=True)

    def why(self, predicted_ms: float) -> str:
        """What a plan made again from this measurement was made for (the report's ``replans``): copies
        that stalled, or calls over the allowance where they are step time (a phase the host bound,
        or a CPU: ``calls_over_allowance``), the only two reasons to make it; ``predicted_ms``: the
        stall the plan predicted."""
        said = []
        if self.stalls and not self.grows:
            said.append(
                f"the copies of {', '.join(sorted(self.stalls))} stalled the compute stream {self.stall_s * 1e3:.3g} ms "
                f"a step (the plan predicted {predicted_ms:.3g} ms)"
            )
        if self.grows and self.forward_only:
            said.append(
                f"the plan offloaded nothing, and the model corrected by the forward's measured time has room for "
                f"{fmt_bytes(self.grows)}"
            )
        elif self.grows:
            said.append(
                f"every copy hid, and the model corrected by their windows has room for {fmt_bytes(self.grows)} more"
            )
        bound = " and ".join(p for p, d in (("forward", "d2h"), ("backward", "h2d")) if self.host_bound(d))
        if bound and self.op_time is not None:
            said.append(
                f"the host bound the {bound} (the device waited on it), where each offloaded tensor's op calls "
                f"cost {self.op_time * 1e3:.3g} ms of the step"
            )
        elif self.on_cpu and self.op_time is not None:
            said.append(
                f"each offloaded tensor's op calls cost {self.op_time * 1e3:.3g} ms of the step (on a CPU they run "
                "on the compute thread)"
            )
        return (
            f"measured in the first steps: {', '.join(said)}, compute ran {self.fw_scale:.2f}x / {self.bw_scale:.2f}x "
            "the model's time (forward / backward); planned again with the measured times"
            + ((", those tensors kept on the device" if self.final else ", those tensors judged again on them")
               if self.stalls and not self.grows else "")
            + ("" if self.only is None else f", and only the {len(self.only)} measured to hide offloaded")
        )

    def keep(self) -> dict[str, Reason]:
        """The tensors whose copies stalled, kept on the device by the last plan made from measurements
        (``final``) and where their copies are switched off."""
        return {
            name: Reason(
                ReasonCode.MEASURED_STALL,
                f"measured: its copies stalled the compute stream {stall * 1e3:.3g} ms a step",
            )
            for name, stall in self.stalls.items()
        }

    def corrected(self, costs: PlanCosts, op_time: float | None = None) -> PlanCosts:
        """``costs`` with every node's time scaled to the measured compute, the link at its measured
        speed and the op calls at their measured price, or at ``op_time``, the user's, where set."""
        rates = costs.rates
        if self.d2h is not None:
            rates = dataclasses.replace(rates, d2h=self.d2h)
        if self.h2d is not None:
            rates = dataclasses.replace(rates, h2d=self.h2d)
        if op_time is not None:
            rates = dataclasses.replace(rates, op_time=op_time, op_byte_time=0.0)
        elif self.op_time is not None:
            rates = _op_rates_as_measured(rates, self.op_time, self.priced_op_time(rates))
        rates = dataclasses.replace(rates, copy_margin=self.margin)
        fw, bw = self.fw_scale, self.bw_scale
        return dataclasses.replace(
            costs, rates=rates, fw_starts=tuple(t * fw for t in costs.fw_starts),
            bw_starts=tuple(t * bw for t in costs.bw_starts), scale=(fw * costs.scale[0], bw * costs.scale[1]),
        )  # fmt: skip


def _op_rates_as_measured(rates: DeviceRates, measured: float, priced: float | None) -> DeviceRates:
    """``rates`` with the op calls at their measured price: where ``rates`` price them by the
    tensor's bytes too (a CPU), both figures scaled by measured over ``priced`` (what they priced the
    tensors measured), so that a larger tensor still costs more; otherwise ``measured`` a tensor."""
    if rates.op_byte_time and priced:
        scale = measured / priced
        return dataclasses.replace(rates, op_time=rates.op_time * scale, op_byte_time=rates.op_byte_time * scale)
    return dataclasses.replace(rates, op_time=measured, op_byte_time=0.0)


def host_ratio(times: Sequence[TransferTime], direction: str) -> float | None:
    """The compute stream's time over the host's across the windows of ``direction``'s copies (each
    as the stream ran it, stalls in it: a stall is no sign of waiting on the host); None where the
    host's was not measured (a CPU), or where the device was a whole window behind the host at half
    or more of those copies' waits (it was not waiting on the host)."""
    mine = [t for t in times if t.direction == direction]
    pairs = [(t.stream_window_s or t.window_s, t.host_window_s) for t in mine if t.host_window_s]
    host = sum(h for _, h in pairs)
    if host <= 0 or 2 * len(pairs) <= len(mine):
        return None
    return sum(w for w, _ in pairs) / host


def host_bound(ratio: float | None) -> bool:
    """Whether a phase whose ``host_ratio`` is ``ratio`` was host-bound (``HOST_BOUND``)."""
    return ratio is not None and ratio <= HOST_BOUND


def calls_over_allowance(plan: OffloadPlan, measured: Measured) -> bool:
    """Whether ``plan``'s offloads' op calls, at the price measured where it is step time (a phase
    the host bound, ``host_calls``, or a CPU; above the one planned with), take more of the step
    than ``auto`` allows (``OpAllowance``), the step as the measurement prices it: a plan to make
    again though no copy stalled (every host microsecond of the calls is step time there)."""
    op, costs = _dearer_calls(plan, measured), plan.costs
    if op is None or costs is None:
        return False
    fw, bw = measured_step(costs, measured)
    allowance = OpAllowance(dataclasses.replace(costs, fw_starts=(fw,), bw_starts=(bw,)))
    return _calls_as_measured(plan, costs, measured, op) > allowance.left


def calls_over_price(plan: OffloadPlan, measured: Measured) -> bool:
    """With a ``memory_budget`` met beside torch's recomputation (``compiler.inductor_recompute``):
    whether ``plan``'s offloads' op calls, at the price measured where it is step time, cost the
    step more than the plan priced them, by ``WORTH_A_COMPILE`` of the step as measured at least. The
    plans that meet the budget are then priced again, and recomputing may be the cheaper way."""
    op, costs = _dearer_calls(plan, measured), plan.costs
    if op is None or costs is None:
        return False
    extra = _calls_as_measured(plan, costs, measured, op) - plan.op_seconds
    return extra >= WORTH_A_COMPILE * sum(measured_step(costs, measured))


def _calls_as_measured(plan: OffloadPlan, costs: PlanCosts, measured: Measured, op: float) -> float:
    """The compute stream's time a step in ``plan``'s offloads' op calls at the price measured
    (``op``, the median tensor's), each tensor at its own size where ``costs`` (the plan's) priced
    the bytes too."""
    rates = _op_rates_as_measured(costs.rates, op, measured.priced_op_time(costs.rates))
    return sum(rates.op_cost(d.saved.nbytes) for d in plan.offloaded)


def _dearer_calls(plan: OffloadPlan, measured: Measured) -> float | None:
    """The op calls' measured price (``Measured.op_time``) where it is step time (a phase the host
    bound, or a CPU: ``on_cpu``) and above the price ``plan`` was made with for the same tensors (by
    more than a quarter); else None. On a CPU the price planned is the calls' probes on a small and a
    1 MiB tensor (``measure.op_time``); before the second probe, a 512 KiB tensor's calls measured
    0.40 ms a step where the first priced them 0.12 ms (the demo's GPT, 2026-12-01)."""
    op, costs = measured.op_time, plan.costs
    if not (measured.on_cpu or measured.host_calls is not None) or op is None or costs is None:
        return None
    return op if op > (measured.priced_op_time(costs.rates) or 0.0) * 1.25 else None


def measured_step(costs: PlanCosts, measured: Measured) -> tuple[float, float]:
    """The step's forward and backward compute as ``measured`` prices them: the model as it came
    (before any correction ``costs`` carries) times the measured ratios."""
    return (
        costs.fw_starts[-1] / costs.scale[0] * measured.fw_scale, costs.bw_starts[-1] / costs.scale[1] * measured.bw_scale
    )


def room(plan: OffloadPlan, measured: Measured, options: OffloadOptions, host: int | None = None) -> int:
    """Bytes more than ``plan``'s that ``auto`` offloads when planned again with the model ``measured``
    corrects and ``host`` bytes of host_budget left it (``auto_offload_bytes``), where that is worth a
    compile (at least ``ROOM_SHARE`` of the pair's saved bytes, and, with those, ``WORTH_A_COMPILE``
    of the predicted peak offloaded in all: fewer bytes cannot lower it that much, and the plan made
    again would offload nothing more, ``planning.worth``), else 0. A plan made from the model before
    measurements keeps a margin for a device faster than the model (``cost.FIRST_GUESS_MARGIN``);
    where its copies then hid, what the margin kept on the device may hide too, and the corrected
    model says so."""
    costs = plan.costs
    if costs is None:
        return 0
    fw, bw = costs.scale
    raw = dataclasses.replace(  # the model as it came (``measured`` holds ratios against that one)
        costs, fw_starts=tuple(t / fw for t in costs.fw_starts), bw_starts=tuple(t / bw for t in costs.bw_starts),
        scale=(1.0, 1.0),
    )  # fmt: skip
    more = auto_offload_bytes(plan, measured.corrected(raw, options.op_time), options, host) - plan.offloaded_bytes
    peak = costs.baseline.peak_bytes if costs.baseline is not None and costs.baseline.points else 0
    saved = sum(d.saved.nbytes for d in plan.decisions)
    if more < ROOM_SHARE * saved or plan.offloaded_bytes + more < WORTH_A_COMPILE * peak:
        return 0
    return more


def stalled(t: TransferTime) -> bool:
    return t.stall_s > max(STALL_FLOOR_S, STALL_SHARE * t.copy_s)


def learns_without_copies(plan: OffloadPlan, options: OffloadOptions) -> bool:
    """Whether the first steps time ``plan``'s forward though it offloads nothing: ``auto``'s own plan
    (``options.plans_from_measurements``) kept tensors because the model said their copies would not
    hide (``not_hidden``, ``too_soon``), and only a measurement can say the model priced the device
    too fast (on an H100, ``auto`` on the Llama blocks offloaded nothing and, no copy to time, never
    planned again)."""
    hides = {ReasonCode.NOT_HIDDEN, ReasonCode.TOO_SOON}
    return (
        options.plans_from_measurements and not plan.offloaded and plan.costs is not None
        and any(d.reason.code in hides for d in plan.decisions)
    )  # fmt: skip


def measured_plan(plan: OffloadPlan, times: Sequence[TransferTime], forward_s: float | None = None) -> Measured:
    """The corrections ``times`` (the copies of ``plan``, measured) give its cost model. Where no copy
    was timed, the forward's measured time (``forward_s``, a plan that offloads nothing) against the
    model's gives the one ratio, for both phases (the backward is not timed: taken as the forward)."""
    if not times and forward_s and plan.costs is not None and plan.costs.fw_starts[-1] > 0:
        ratio = forward_s / plan.costs.fw_starts[-1] * plan.costs.scale[0]
        return Measured((), (ratio,), (ratio,), {}, {}, forward_only=True)
    decisions = {d.saved.name: d for d in plan.offloaded if d.timing is not None}
    ratios: dict[str, list[float]] = {"d2h": [], "h2d": []}
    moved: dict[str, tuple[int, float]] = {}
    stalls: dict[str, float] = {}
    for t in times:
        if t.copy_s > 0:
            nbytes, seconds = moved.get(t.direction, (0, 0.0))
            moved[t.direction] = (nbytes + t.nbytes, seconds + t.copy_s)
        if stalled(t):
            stalls[t.tensor] = stalls.get(t.tensor, 0.0) + t.stall_s
        d = decisions.get(t.tensor)
        if d is None or plan.costs is None:
            continue
        predicted = _predicted_window(d, plan.costs, t.direction)
        if predicted > 0 and t.window_s > 0:  # against the model as it came, before any correction
            ratios[t.direction].append(t.window_s / predicted * plan.costs.scale[t.direction == "h2d"])
    return Measured(tuple(times), tuple(ratios["d2h"]), tuple(ratios["h2d"]), moved, stalls)


def _predicted_window(d, costs: PlanCosts, direction: str) -> float:
    """The compute the model priced between the copy's issue and its wait, as the rewrite placed them."""
    fw, bw = copy_windows(d.saved, d.timing, costs)
    return fw if direction == "d2h" else bw


def switched_off(plan: OffloadPlan, keep: Mapping[str, Reason]) -> OffloadPlan:
    """``plan`` with every offloaded tensor of ``keep`` kept on the device instead, for its reason
    there (``Measured.keep``: its copies stalled): what runs once the runtime switches their copies
    off in the compiled code."""
    decisions = tuple(
        dataclasses.replace(
            d, decision=Action.KEEP, timing=None,
            reason=Reason(keep[d.saved.name].code, f"{keep[d.saved.name].text}; switched off at run time, the "
                          "compiled code unchanged (the tensor stays on the device, in a copy of its own)"),
        ) if d.decision == Action.OFFLOAD and d.saved.name in keep else d
        for d in plan.decisions
    )  # fmt: skip
    stall = sum(d.timing.stall for d in decisions if d.decision == Action.OFFLOAD and d.timing is not None)
    return dataclasses.replace(plan, decisions=decisions, stall=stall)
