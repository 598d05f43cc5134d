"""One forward/backward pair as the pass left it, and the backend's register of the pairs that run.

A ``PlannedPair`` is what the compiler's decisions read (the plan, the rewritten graphs, the memory
model's timelines, the code Inductor generated); its ``report`` is a snapshot written for people
when the pair is made, and never read back to decide.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from ..analysis.memory import CodeFacts, MemoryPoint, MemoryTimeline, with_held
from ..analysis.output_code import call_sources, read_offloads, returns_own_buffer, transfers
from ..analysis.outside import OutsideMemory
from ..ir import transfer_name
from ..planning.decisions import OffloadPlan
from ..planning.measured import switched_off
from ..reasons import Reason, ReasonCode
from ..reporting.report import OffloadReport
from ..reporting.rows import carry_measured, saved_rows
from ..rewrite.host_copies import HostCopy, replay_switched_off, switched_off_held
from ..runtime.transfers import switch_copies_off, wait_on_host
from .costs import code_scratch

log = logging.getLogger(__name__)

__all__ = ["PairRegister", "PlannedPair", "new_graph_id"]

_graph_ids = itertools.count()
_graph_ids_lock = threading.Lock()


def new_graph_id() -> int:
    """A graph id unique in the process (reports of every backend object share the sequence)."""
    with _graph_ids_lock:
        return next(_graph_ids)


@dataclasses.dataclass(eq=False)
class PlannedPair:
    """A partitioned pair after the pass: its plan, its rewritten graphs and what the models predict."""

    graph_id: int
    plan: OffloadPlan
    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int
    static: tuple[int, ...]  # the forward's static inputs (parameters, buffers), by position
    memory_before: MemoryTimeline | None  # the FX memory model before any change
    memory_after: MemoryTimeline | None  # the same on the rewritten pair
    outside: OutsideMemory | None  # what code before the pair holds through it
    kept_bytes: int  # device bytes one call keeps for its backward (``memory.kept_saved_bytes``)
    param_grad_bytes: int  # device bytes of its parameters' gradients (``memory.param_grad_bytes``)
    report: OffloadReport
    # Inductor's wrapper code by graph ("forward", "backward"), filled in as each graph is compiled
    # (the backward may come at the first backward call); the report shares this dict.
    output_code: dict[str, str] = dataclasses.field(default_factory=dict)
    # Where the rewrite put each offloaded tensor's host copy, over ``memory_after``'s points.
    host_copies: tuple[HostCopy, ...] = ()
    # Saved tensors whose copies were switched off at run time (``CallWatch.switch_off``): the compiled
    # code keeps them on the device, from their offload to their reload. The report copies these.
    switched_off: tuple[str, ...] = ()
    # Scratch bytes the fallback and extern kernels of ``output_code`` allocate inside their calls,
    # ``(line, bytes)`` by graph, measured on the code's layouts as each graph is compiled
    # (``record_code``), which the replay counts at their lines; the report shares this dict.
    code_scratch: dict[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    # What ``_read`` read, by the timeline it was read from: the watch asks at every call it reads,
    # and the timeline (a cached replay, or the FX model) rarely changes.
    _memo: dict[str, tuple[MemoryTimeline | None, Any]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def memory_budget(self) -> int | None:
        """The user's memory_budget in bytes, when one was asked for."""
        return self.plan.memory_budget

    @property
    def outside_bytes(self) -> int:
        """"outside" in the pair's timelines with its plan (``OutsideMemory.outside``)."""
        return self.outside.outside(self.kept_bytes) if self.outside is not None else 0

    @property
    def outside_backward(self) -> int:
        return self.outside.outside_backward(self.kept_bytes) if self.outside is not None else 0

    def record_code(self, kind: str, code: str) -> None:
        """Inductor's wrapper ``code`` for graph ``kind`` ("forward", "backward"), with the scratch its
        calls allocate measured on its layouts (``costs.code_scratch``)."""
        self.output_code[kind] = code
        self.code_scratch[kind] = code_scratch(code, self.plan.costs)

    def code_facts(self) -> CodeFacts:
        """What ``output_code`` showed that the FX graphs do not (``memory.CodeFacts``), for the memory
        model of any plan of the same graph: (phase, op, source nodes, bytes) of each call with
        measured scratch (``code_scratch``; ``output_code.call_sources``), and the forward's
        placeholders saved for the backward whose place among the forward's returns holds a buffer
        the code made (``output_code.returns_own_buffer``)."""
        calls = []
        for phase, lines in sorted(self.code_scratch.items()):
            sources = call_sources(self.output_code.get(phase, ""))
            calls.extend((phase, *sources[line], nbytes) for line, nbytes in lines if line in sources)
        outputs = list(self.fw.graph.output_node().args[0])
        own = returns_own_buffer(self.output_code.get("forward", ""))
        copied = sorted(
            o.name for o, made in zip(outputs[self.num_fwd_outputs :], own[self.num_fwd_outputs :])
            if made and isinstance(o, fx.Node) and o.op == "placeholder"
        ) if len(own) == len(outputs) else []  # fmt: skip
        return CodeFacts(tuple(calls), tuple(copied))

    def code_memory(self) -> MemoryTimeline | None:
        """The replay of the code Inductor generated for the pair, the copies switched off at run time
        counted on the device (None until both graphs are compiled, and with ``inner="aot_eager"``)."""
        return replay_switched_off(
            self.output_code, self.num_fwd_outputs, self.outside_bytes, self.outside_backward, self.host_copies,
            self.switched_off, self.code_scratch,
        )  # fmt: skip

    def expected_memory(self) -> MemoryTimeline | None:
        """The prediction the code that runs is held to: Inductor's code replayed where there is
        one, else the FX model of the rewritten pair."""
        code = self.code_memory()
        return code if code is not None and code.points else self.memory_after

    def phase_peaks(self) -> tuple[int, int]:
        """The expected peak in the forward and in the backward."""

        def peaks(points: tuple[MemoryPoint, ...]) -> tuple[int, int]:
            timeline = MemoryTimeline(points)
            fw = timeline.phase_peak("forward")
            return fw, timeline.phase_peak("backward", default=fw)

        return self._read("phase_peaks", self.expected_memory(), peaks)

    def parameter_bytes(self) -> int:
        """The pair's parameters (static inputs) on the device, as its timelines count them."""
        return self._read(
            "parameter_bytes", self.memory_before or self.memory_after,
            lambda points: max((p.live.get("parameters", 0) for p in points), default=0),
        )  # fmt: skip

    def planned_peak_bytes(self) -> int:
        """``memory_after``'s peak: the FX model's peak of the rewritten pair."""
        return self._read("peak", self.memory_after, lambda pts: max((p.total for p in pts), default=0))

    def _read(
        self, key: str, timeline: MemoryTimeline | None, read: Callable[[tuple[MemoryPoint, ...]], Any]
    ) -> Any:
        """``read(timeline.points)``, once per timeline object (the watch asks at every call it reads)."""
        memo = self._memo.get(key)
        if memo is None or memo[0] is not timeline:
            memo = self._memo[key] = (timeline, read(timeline.points if timeline is not None else ()))
        return memo[1]

    def with_switched_off(self, keep: Mapping[str, Reason]) -> PlannedPair:
        """The same pair once the copies of ``keep``'s tensors are switched off in its compiled code
        (``runtime.transfers.switch_copies_off``, the caller's): its plan keeps them on the device for
        ``keep``'s reasons, its FX timeline, kept bytes and report count them there, from their
        offload to their reload (the replay of Inductor's code does from ``switched_off``)."""
        plan = switched_off(self.plan, keep)
        after = self.memory_after
        if after is not None:
            after = with_held(after, switched_off_held(self.host_copies, keep, len(after.points)))
        kept = self.kept_bytes + sum(d.saved.nbytes for d in self.plan.offloaded if d.saved.name in keep)
        switched = (*self.switched_off, *sorted(keep))
        report = dataclasses.replace(
            self.report, saved=saved_rows(plan), predicted_stall_ms=plan.stall * 1e3, switched_off=switched,
            memory_after=after, kept_bytes=kept,
            host_bytes_total=self.report.host_bytes_total - self.plan.host_bytes + plan.host_bytes,
        )  # fmt: skip
        return dataclasses.replace(
            self, plan=plan, kept_bytes=kept, memory_after=after, switched_off=switched,
            report=carry_measured(report, self.report),
        )  # fmt: skip

    def with_report(self, **changes: object) -> PlannedPair:
        """The same pair, its report changed (``replans``, ``note``, ...)."""
        return dataclasses.replace(self, report=dataclasses.replace(self.report, **changes))


class PairRegister:
    """The pairs one backend object runs, by graph id, in the order they were compiled."""

    def __init__(self, switch_off_unkept: bool = True) -> None:
        self.switch_off_unkept = switch_off_unkept  # ``_unkept_sources``
        self._pairs: dict[int, PlannedPair] = {}
        self._forward_code: dict[int, str] = {}  # by graph id: the forward code its host reads came from

    def record(self, pair: PlannedPair) -> PlannedPair:
        """``pair`` runs for its graph id from now on (replacing a pair planned before for it); the
        pair that runs is returned, and the caller runs that one. Where its forward's code reads an
        accelerator tensor's host copy after its wait, that wait makes the host wait for the copy too
        (``runtime.transfers.wait_on_host``), and where a copy reads a buffer its wait does not keep
        alive, that copy is switched off and its tensor kept on the device (``_unkept_sources``): set
        here, for the pair that runs, never by a compile that is then dropped (verify_peak's code
        without offloading, a budget's other attempts, a re-plan that failed)."""
        code = pair.output_code.get("forward", "")
        if self._forward_code.get(pair.graph_id) is not code:
            self._forward_code[pair.graph_id] = code
            _host_reads(pair, code)
            unkept = _unkept_sources(pair, code) if self.switch_off_unkept else ()
            if unkept:
                why = Reason(
                    ReasonCode.UNKEPT_SOURCE,
                    "in Inductor's forward its copy reads a buffer its wait does not keep alive",
                )
                pair = pair.with_switched_off(dict.fromkeys(unkept, why))
        self._pairs[pair.graph_id] = pair
        return pair

    def get(self, graph_id: int) -> PlannedPair | None:
        return self._pairs.get(graph_id)

    def host_bytes_planned(self, except_graph: int | None = None) -> int:
        """Host bytes the offloads of the registered pairs take (``host_budget`` counts these), but
        those of ``except_graph`` (the graph being planned again)."""
        return sum(p.plan.host_bytes for gid, p in self._pairs.items() if gid != except_graph)

    def host_left(self, host_budget: int | None, graph_id: int) -> int | None:
        """What ``host_budget`` leaves graph ``graph_id``'s plan once the other pairs' offloads have
        theirs (None: no budget)."""
        return None if host_budget is None else max(0, host_budget - self.host_bytes_planned(except_graph=graph_id))

    def pairs(self) -> list[PlannedPair]:
        return list(self._pairs.values())

    def reports(self) -> list[OffloadReport]:
        return [p.report for p in self._pairs.values()]


def _unkept_sources(pair: PlannedPair, code: str) -> tuple[str, ...]:
    """The offloads whose copy, in the forward's ``code``, reads a buffer its wait does not keep
    alive (Inductor passed a copy of the source to one of the two ops, or freed the source before
    the wait: ``output_code.Transfer.same_buffer``): on a GPU the copy could read memory already
    reused. Switched off (``runtime.transfers.switch_copies_off``: the offload keeps a device copy
    of the tensor at once, no transfer) and said: that tensor is not offloaded, and nothing races.
    Returns the names of their saved tensors, which the caller keeps on the device in the pair's
    plan. ``_compat.lowering`` keeps Inductor from it in the cases known (a view it copies per reader)."""
    unkept = {
        t.name for t in transfers(code)
        if t.kind == "offload" and t.name and (not t.same_buffer or t.source_released_early)
    }  # fmt: skip
    names = tuple(
        sorted(d.saved.name for d in pair.plan.offloaded if transfer_name(pair.graph_id, d.saved.name) in unkept)
    )
    if unkept:
        switch_copies_off(sorted(unkept))
        log.warning(
            "fxoffload: graph %d: in Inductor's forward the copies of %s read a buffer their waits do not keep "
            "alive (a copy of the source made for one of the two ops, or the source freed before the wait): "
            "switched off, those tensors stay on the device", pair.graph_id, ", ".join(sorted(unkept)),
        )  # fmt: skip
    return names


def _host_reads(pair: PlannedPair, code: str) -> None:
    """The offloads of accelerator tensors whose host copy the forward's ``code`` reads after the wait
    (``output_code.read_offloads``: Inductor copying it into another layout): a wait orders the device
    alone, and the host would read a copy still in flight. Their waits wait on the host as well,
    replacing what the graph's earlier code said; said once per forward code, as it costs those copies
    their overlap."""
    read = read_offloads(code)
    names = sorted(
        d.saved.name for d in pair.plan.offloaded
        if d.saved.device.type != "cpu" and transfer_name(pair.graph_id, d.saved.name) in read
    )  # fmt: skip
    wait_on_host(transfer_name(pair.graph_id, ""), [transfer_name(pair.graph_id, n) for n in names])
    if names:
        log.warning(
            "fxoffload: graph %d: Inductor's forward reads the host copies of %s after their waits (it copies "
            "them into another layout than their offloads gave them, ``rewrite.host_layout``): those waits make "
            "the host wait for the copy, and the copies do not overlap the step", pair.graph_id, ", ".join(names),
        )  # fmt: skip
