"""What fxoffload did to one compiled forward/backward pair, for people and for tools."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import textwrap
from typing import Any

import torch.fx as fx

from tabulate import tabulate

from . import ops
from .codememory import simulate_output_code
from .lifetimes import _tensor_bytes, storage_users
from .memory import CATEGORIES, CallOutside, MemoryPoint, MemoryTimeline
from .plan import OFFLOAD, RECOMPUTE, OffloadPlan, PlanCosts, fmt_bytes
from .reasons import Action
from .rewrite import host_placeholder_name
from .schedule import copy_seconds, windows
from .upstream import UpstreamMemory

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SavedRow:
    """One saved tensor and what was decided for it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    decision: Action  # "offload", "keep" or "recompute" (an Action, equal to those strings)
    reason: str  # the sentence; reason_code is its stable code
    producer: str
    device: str
    fw_last_use: str  # forward node after which it is not needed on the device
    bw_first_use: str  # backward node that needs it again
    idle_compute_nodes: int
    d2h_ms: float = 0.0  # predicted device-to-host copy time (cost model)
    h2d_ms: float = 0.0  # predicted host-to-device copy time
    fw_window_ms: float = 0.0  # predicted forward compute after its last use
    bw_window_ms: float = 0.0  # predicted backward compute before its first use
    recompute_ms: float = 0.0  # predicted compute time of recomputing it in the backward
    recomputed_from: str = ""  # the saved tensors it is recomputed from, comma-separated
    reason_code: str = ""  # a ReasonCode value ("min_bytes", "hidden", ...; docs/user-guide.md)
    module_path: str = ""  # the module that produced it ("layers.0.mlp.fc1"), "" if none
    recompute_refused: str = ""  # why it cannot be recomputed, when that was considered
    recompute_refused_code: str = ""


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """The host copy of one offloaded tensor, over the points of ``OffloadReport.memory_after``.

    Host memory, not device memory: the memory model leaves it out of every device figure."""

    name: str  # the saved tensor it copies (forward node)
    host_name: str  # the backward placeholder that holds it
    nbytes: int  # bytes of the host copy (the tensor's bytes, as ``host_bytes_total`` counts them)
    first: int  # point of ``memory_after`` where ``fxoffload.offload`` takes it (forward)
    last: int  # point after which it is released: its placeholder's last backward reader
    # Points over which its reload's device destination is live (-1: no reload). The memory model counts
    # that destination as "transient"; breakdowns and the plot count it with the saved activations.
    reload_first: int = -1
    reload_last: int = -1


# A memory_budget is met when the peak is at most this much above it (the 3%).
BUDGET_TOLERANCE = 0.03


def _code_else_model(compiled: MemoryTimeline | None, after: MemoryTimeline | None) -> MemoryTimeline | None:
    """``compiled`` (Inductor's code replayed) where it has points, else ``after`` (the FX model)."""
    return compiled if compiled is not None and compiled.points else after


# The kinds a breakdown shows, in this order; "host" is host memory and not part of the device total.
KINDS = ("parameters", "inputs", "gradients", "saved", "transient", "outside", "host")
_KIND_NAMES = {
    "saved": "saved activations", "transient": "transients", "host": "host copies in flight",
    "outside": "held by code before this graph",
}  # fmt: skip
TIMELINES = ("before", "after", "compiled")


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """What is live at the peak of one timeline of a report, by kind (``OffloadReport.peak_breakdown``)."""

    timeline: str  # "before", "after" (the FX memory model) or "compiled" (replay of Inductor's code)
    phase: str  # "forward" or "backward"
    node: str  # the FX node running at the peak, or the line of Inductor's code
    index: int  # the peak's point in that timeline
    device: dict[str, int]  # device bytes per kind (``memory.CATEGORIES``); they sum to ``total``
    # Bytes of offloaded tensors held on the host at that point (host memory, not in ``total``);
    # None where it cannot be told (the compiled code's offloads do not match the plan's).
    host_bytes: int | None

    @property
    def total(self) -> int:
        return sum(self.device.values())

    def kinds(self) -> str:
        """``parameters 6.3 KiB, ..., transients 16.0 KiB; host copies in flight 8.0 KiB (host memory)``."""
        return _kinds_text(self.device, self.host_bytes)


def _kinds_text(device: dict[str, int], host: int | None) -> str:
    text = ", ".join(f"{_KIND_NAMES.get(k, k)} {fmt_bytes(device.get(k, 0))}" for k in KINDS[:-1] if device.get(k))
    if host:
        text += f"; {_KIND_NAMES['host']} {fmt_bytes(host)} (host memory)"
    return text


@dataclasses.dataclass(frozen=True)
class PassTimings:
    """Wall-clock seconds the backend spent on one graph pair (CPU work on every machine)."""

    pass_s: float  # the fxoffload pass (analyse, plan, rewrite), without torch's second partition
    repartition_s: float  # torch's partitioner run again for the recomputation the plan asked for
    simulate_s: float  # the memory model run on the rewritten pair (``memory_after``); 0 if unchanged
    fw_nodes: int  # nodes of the partitioned forward the pass was given (before the rewrite)
    bw_nodes: int  # the same for the backward


@dataclasses.dataclass(frozen=True)
class OffloadReport:
    """One per compiled forward/backward pair (``backend.reports``). Field names are stable."""

    graph_id: int
    policy: str
    saved: tuple[SavedRow, ...]
    note: str  # why the graph was left unchanged, when it was
    fw_code: str
    bw_code: str
    fw_nodes: int
    bw_nodes: int
    host_budget: int | None  # the backend's bound on host bytes; None: unbounded
    host_bytes_total: int  # host bytes planned by this and the earlier graphs of the same backend
    memory_before: MemoryTimeline | None = None  # predicted device memory per node, without fxoffload
    memory_after: MemoryTimeline | None = None  # the same for the rewritten graphs
    predicted_stall_ms: float = 0.0  # compute-stream time predicted lost to waiting for copies
    memory_budget: int | None = None  # the memory_budget in bytes, when one was asked for
    device: str = ""  # the device the cost model priced, with its host link
    predicted_recompute_ms: float = 0.0  # compute added to the backward by recomputation
    # The code the inner compiler really runs, by graph ("forward", "backward"): Inductor's wrapper
    # code, filled in as Inductor compiles each graph (the backward may come at the first backward
    # call). Empty with inner="aot_eager", which runs ``fw_code``/``bw_code`` as they are.
    output_code: dict[str, str] = dataclasses.field(default_factory=dict)
    timings: PassTimings | None = None  # where the backend's time on this pair went
    num_fwd_outputs: int | None = None  # the forward's user outputs, before its saved tensors
    # The rewritten forward and backward GraphModules the partitioner returned: the forward object is
    # what the inner compiler compiles, the backward is compiled from a deep copy AOTAutograd makes
    # of it. Not in JSON, ``==`` or repr.
    graphs: tuple[fx.GraphModule, fx.GraphModule] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    # The host copy of every offloaded tensor and when it is held, over ``memory_after``'s points.
    host_copies: tuple[HostCopy, ...] = ()
    # With memory_budget and Inductor: each earlier plan whose generated code missed the budget, and
    # the target it was planned again for (oldest first); empty when the first plan's code met it.
    replans: tuple[str, ...] = ()
    # What code before this graph (eager code, other graphs) saved and holds on its device while it
    # runs, read from the autograd graph behind its inputs when it compiled: "outside" in every
    # timeline. None where it could not be read.
    upstream: UpstreamMemory | None = None
    # Device bytes one call keeps for its backward with this plan (``memory.kept_saved_bytes``).
    kept_bytes: int = 0
    # Device bytes of its parameters' gradients, held after its backward (``memory.param_grad_bytes``).
    param_grad_bytes: int = 0

    @property
    def outside_bytes(self) -> int:
        """"outside" in this pair's timelines with its plan: what code before it holds at the call
        planned for, earlier calls of the same graph keeping ``kept_bytes`` each (``upstream``)."""
        return self.upstream.outside(self.kept_bytes) if self.upstream is not None else 0

    @classmethod
    def from_plan(
        cls,
        graph_id: int,
        plan: OffloadPlan,
        fw: fx.GraphModule,
        bw: fx.GraphModule,
        host_budget: int | None,
        host_bytes_before: int,
        memory_before: MemoryTimeline | None = None,
        memory_after: MemoryTimeline | None = None,
    ) -> OffloadReport:
        costs = plan.costs
        rows = tuple(
            SavedRow(
                name=d.saved.name,
                shape=d.saved.shape,
                dtype=str(d.saved.dtype).replace("torch.", ""),
                nbytes=d.saved.nbytes,
                decision=d.decision,
                reason=d.reason.text,
                producer=d.saved.producer,
                device=str(d.saved.device),
                fw_last_use=d.saved.fw_last_user,
                bw_first_use=d.saved.bw_first_user,
                idle_compute_nodes=d.saved.idle_compute_nodes,
                **_timing_fields(d, plan.partition_costs if d.decision == RECOMPUTE else costs),
                recomputed_from=", ".join(d.recompute.sources) if d.recompute is not None else "",
                reason_code=d.reason.code.value,
                module_path=d.saved.module_path,
                recompute_refused=d.recompute_refused.text if d.recompute_refused else "",
                recompute_refused_code=d.recompute_refused.code.value if d.recompute_refused else "",
            )
            for d in plan.decisions
        )
        return cls(
            graph_id, plan.policy, rows, plan.note, fw.code, bw.code,
            len(fw.graph.nodes), len(bw.graph.nodes),
            host_budget, host_bytes_before + plan.host_bytes, memory_before, memory_after,
            plan.stall * 1e3, plan.memory_budget, _device_line(costs), plan.recompute_seconds * 1e3,
            host_copies=_host_copies(fw, bw, memory_after),
        )  # fmt: skip

    @property
    def offloaded(self) -> tuple[SavedRow, ...]:
        return tuple(r for r in self.saved if r.decision == OFFLOAD)

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.nbytes for r in self.offloaded)

    @property
    def recomputed(self) -> tuple[SavedRow, ...]:
        return tuple(r for r in self.saved if r.decision == RECOMPUTE)

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    def table(self, rows: str = "all", width: int | None = None, kept: int = 5) -> str:
        """The saved tensors, their decisions and the reasons, as a text table.

        ``rows="all"``: one row per saved tensor with every column (copy times, compute windows, first
        and last uses). ``rows="short"``: what a person reads first: the offloaded and recomputed
        tensors, the ``kept`` largest kept ones, a count of the rest by reason code, parameters and
        graph inputs in one line, and a reason shared by every row said once above the table.
        ``width``: columns to fit (None: the terminal's, ``shutil.get_terminal_size``); the reason
        column is wrapped ("all") or cut short ("short") to fit.
        """
        if rows not in ("all", "short"):
            raise ValueError(f"fxoffload: table(rows={rows!r}): rows must be 'all' or 'short'")
        if isinstance(kept, bool) or not isinstance(kept, int) or kept < 0:
            raise ValueError(f"fxoffload: table(kept={kept!r}): kept must be an int >= 0 (rows shown)")
        width = shutil.get_terminal_size().columns if width is None else width
        if isinstance(width, bool) or not isinstance(width, int) or width < 40:
            raise ValueError(f"fxoffload: table(width={width!r}): width must be an int >= 40 (columns)")
        header = (
            f"graph {self.graph_id}: policy={self.policy!r}, {len(self.offloaded)} of "
            f"{len(self.saved)} saved tensors offloaded, {fmt_bytes(self.offloaded_bytes)} of "
            f"{fmt_bytes(self.saved_bytes)}"
        )
        if self.recomputed:
            header += f", {len(self.recomputed)} recomputed"
        budget = "unbounded" if self.host_budget is None else fmt_bytes(self.host_budget)
        host = f"host memory: {fmt_bytes(self.host_bytes_total)} planned by this backend "
        host += f"(host_budget: {budget})"
        if rows == "short":
            return self._short_table(header, host, width, kept)
        header += f"\n{host}"
        if self.note:
            header += f"\n{self.note}"
        body = [
            (r.name, "x".join(map(str, r.shape)) or "scalar", r.dtype, f"{r.nbytes / 2**20:.3f}",
             r.producer, r.fw_last_use, r.bw_first_use or "-", r.idle_compute_nodes,
             f"recompute {r.recompute_ms:.3f}" if r.decision == RECOMPUTE
             else f"{r.d2h_ms:.3f}/{r.h2d_ms:.3f}", f"{r.fw_window_ms:.3f}/{r.bw_window_ms:.3f}", r.decision,
             f"[{r.reason_code}] {r.reason}" if r.reason_code else r.reason)
            for r in self.saved
        ]  # fmt: skip
        headers = ("saved tensor", "shape", "dtype", "MiB", "producer", "fw last use", "bw first use",
                   "idle nodes", "copy ms out/in", "window ms fw/bw", "decision", "reason")  # fmt: skip
        # The reason column takes what the others leave of the width, never less than 40 columns.
        others = _table_width([r[:-1] for r in body], headers[:-1])
        reason_width = max(40, width - others - 2)
        return f"{header}\n{tabulate(body, headers=headers, maxcolwidths=[None] * 11 + [reason_width])}"

    def _short_table(self, header: str, host: str, width: int, kept: int) -> str:
        lines = [header]
        if self.offloaded or self.host_budget is not None:
            lines.append(host)
        # A reason every row shares (a graph left unchanged, policy="none") is said once, not per row.
        reasons = {(r.reason_code, r.reason) for r in self.saved}
        shared = len(reasons) == 1 and len(self.saved) > 1
        if self.note or shared:
            code, text = next(iter(reasons)) if shared else ("", self.note)
            note = f"note: {text}" + (f" [{code}]" if shared and code else "")
            lines.extend(textwrap.wrap(note, width, subsequent_indent="  "))
        # Parameters, buffers and graph inputs (placeholders) stay whatever the policy: one line for all.
        inputs = [r for r in self.saved if r.producer == "placeholder" and r.decision == Action.KEEP]
        groups = [(f"offloaded: {_count(self.offloaded)}", self.offloaded)]
        if self.recomputed:
            groups.append((f"recomputed: {_count(self.recomputed)}", self.recomputed))
        rest = sorted(
            (r for r in self.saved if r.decision == Action.KEEP and r.producer != "placeholder"),
            key=lambda r: -r.nbytes,
        )
        shown, hidden = rest[:kept], rest[kept:]
        if shown:
            title = f"kept, the {len(shown)} largest of {len(rest)}" if hidden else f"kept: {_count(shown)}"
            groups.append((title, shown))
        # A group whose rows share a reason code names it in its title; its rows give the sentence.
        titled = {id(r): r.reason_code for _, group in groups if len({r.reason_code for r in group}) == 1
                  for r in group if r.reason_code}  # fmt: skip
        body = [
            (r.name, "x".join(map(str, r.shape)) or "scalar", r.dtype, fmt_bytes(r.nbytes),
             r.module_path or r.producer,
             f"{r.recompute_ms:.3f} compute" if r.decision == RECOMPUTE
             else f"{r.d2h_ms:.3f}/{r.h2d_ms:.3f}" if r.decision == OFFLOAD else "",
             "" if shared else r.reason if id(r) in titled or not r.reason_code
             else f"{r.reason_code}: {r.reason}")
            for _, group in groups for r in group
        ]  # fmt: skip
        headers = ("saved tensor", "shape", "dtype", "size", "module", "copy ms", "reason")
        if body and not any(r[5] for r in body):  # nothing copied or recomputed: no copy-time column
            body, headers = [(*r[:5], r[6]) for r in body], (*headers[:5], headers[6])
        if body:
            room = max(20, width - _table_width([r[:-1] for r in body], headers[:-1]) - 2)
            body = [(*r[:-1], _cut(r[-1], room)) for r in body]
            if shared:
                body, headers = [r[:-1] for r in body], headers[:-1]
            table = tabulate(body, headers=headers, disable_numparse=True).splitlines()
            lines.extend(table[:2])  # column names and the rule; a title line above each group's rows
            at = 2
            for title, group in groups:
                code = titled.get(id(group[0])) if group and not shared else None
                if group:  # an empty group (nothing offloaded) is already said in the first line
                    lines.append(f"{title} [{code}]" if code else title)
                lines.extend(table[at : at + len(group)])
                at += len(group)
        if hidden:
            lines.append(
                f"... and {len(hidden)} more kept, {fmt_bytes(sum(r.nbytes for r in hidden))} "
                f"(codes: {_code_counts(hidden)})"
            )
        if inputs:
            lines.append(
                f"parameters, buffers and graph inputs: {len(inputs)} kept, "
                f"{fmt_bytes(sum(r.nbytes for r in inputs))} (codes: {_code_counts(inputs)})"
            )
        return "\n".join(lines)

    @property
    def predicted_peak_before(self) -> int:
        return self.memory_before.peak_bytes if self.memory_before else 0

    @property
    def predicted_peak_after(self) -> int:
        return self.memory_after.peak_bytes if self.memory_after else 0

    @property
    def start_bytes(self) -> int:
        """Bytes of every timeline live before the step starts: the parameters and the inputs, less the
        inputs that code before this graph made in the step, and that code's parameters
        (``upstream``). A measured peak above the step's start (``fxoffload.measure_memory``) plus
        these compares with a point's total."""
        timeline = self.memory_after or self.memory_before
        points = timeline.points if timeline is not None else ()
        held = max((p.live["parameters"] + p.live["inputs"] for p in points), default=0)
        up = self.upstream
        return max(0, held - (up.made_inputs_bytes if up is not None else 0)) + (up.params_bytes if up else 0)

    def expected_memory(self) -> MemoryTimeline | None:
        """The prediction the code that runs is held to: the replay of Inductor's code where there is
        one (``compiled_memory``), else the FX model's ``memory_after``."""
        return _code_else_model(self.compiled_memory(), self.memory_after)

    def compiled_memory(self) -> MemoryTimeline | None:
        """Device memory of one step replayed from the code Inductor generated for this pair
        (``codememory``): the buffers it really allocates after fusion and reuse, freed where it frees
        them. None until both graphs are compiled, and with ``inner="aot_eager"``, which runs the FX
        graphs themselves (``memory_after`` is the prediction then)."""
        forward, backward = self.output_code.get("forward"), self.output_code.get("backward")
        if not forward or not backward:
            return None
        try:
            later = self.upstream.outside_backward(self.kept_bytes) if self.upstream is not None else 0
            return simulate_output_code(
                forward, backward, self.num_fwd_outputs, outside=self.outside_bytes, outside_backward=later
            )
        except ValueError as e:  # code this reader does not know (a new Inductor): no figure, no failure
            log.debug("fxoffload: cannot replay the generated code of graph %d: %s", self.graph_id, e)
            return None

    def timeline(self) -> list[dict[str, object]]:
        """Predicted live device bytes after every node, without and with fxoffload, as data; "host" is
        the bytes of offloaded tensors held on the host at that node (not in "total")."""
        out: list[dict[str, object]] = []
        for which, timeline in (("before", self.memory_before), ("after", self.memory_after)):
            host = self.host_in_flight(which) or []
            for i, p in enumerate(timeline.points if timeline else ()):
                out.append({"graph": which, "step": i, "phase": p.phase, "node": p.node, "total": p.total, **p.live,
                            "host": host[i] if i < len(host) else 0})  # fmt: skip
        return out

    def _timeline(self, which: str) -> MemoryTimeline | None:
        if which not in TIMELINES:
            raise ValueError(
                f"fxoffload: timeline {which!r}: choose 'before' (predicted without fxoffload), 'after' "
                f"(predicted with it) or 'compiled' (replay of Inductor's generated code)"
            )
        if which == "compiled":
            return self.compiled_memory()
        return self.memory_before if which == "before" else self.memory_after

    def host_in_flight(self, which: str = "after") -> list[int] | None:
        """Bytes of offloaded tensors held on the host at every point of a timeline ("before", "after" or
        "compiled"): from where each ``fxoffload.offload`` runs in the forward to the last backward
        reader of its host copy. Host memory, never in the device figures. None when the timeline is
        missing, or when the replayed code's offloads do not match the plan's (see ``_compiled_host``)."""
        timeline = self._timeline(which)
        if timeline is None:
            return None
        n = len(timeline.points)
        if which == "before" or not self.host_copies:
            return [0] * n
        if which == "compiled":
            return _compiled_host(timeline, self.host_copies)
        delta = [0] * (n + 1)
        for c in self.host_copies:
            delta[max(0, c.first)] += c.nbytes
            delta[min(n, c.last + 1)] -= c.nbytes
        out, running = [], 0
        for d in delta[:n]:
            running += d
            out.append(running)
        return out

    def device_kinds(self, which: str = "after") -> list[dict[str, int]] | None:
        """Device bytes per kind at every point of a timeline: the memory model's categories, except
        that a reloaded tensor's device copy (which the model counts as "transient") is counted with the
        saved activations, from its reload to its last reader. The replay of Inductor's code
        ("compiled") keeps its own categories (reloads there are transients)."""
        timeline = self._timeline(which)
        if timeline is None:
            return None
        kinds = [{k: p.live.get(k, 0) for k in CATEGORIES} for p in timeline.points]
        if which == "after":
            for c in self.host_copies:
                points = range(c.reload_first, min(len(kinds), c.reload_last + 1)) if c.reload_first >= 0 else ()
                for i in points:
                    moved = min(c.nbytes, kinds[i]["transient"])
                    kinds[i]["transient"] -= moved
                    kinds[i]["saved"] += moved
        return kinds

    def peak_breakdown(self, which: str = "after") -> PeakBreakdown | None:
        """What is live at the peak of a timeline, by kind: parameters, inputs, gradients, saved
        activations and transients on the device (they sum to the peak), and the host copies in flight
        there (host memory, apart); reloaded tensors count as saved activations (``device_kinds``).
        ``which``: "after" (the memory model on the rewritten graphs, what runs), "before" (without
        fxoffload) or "compiled" (the replay of Inductor's generated code; None until both graphs are
        compiled, and with ``inner="aot_eager"``)."""
        timeline = self._timeline(which)
        if timeline is None or not timeline.points:
            return None
        index = max(range(len(timeline.points)), key=lambda i: timeline.points[i].total)
        peak = timeline.points[index]
        host = self.host_in_flight(which)
        return PeakBreakdown(
            which, peak.phase, peak.node, index, self.device_kinds(which)[index], None if host is None else host[index]
        )

    def summary(self) -> str:
        """Predicted peak before and after, where it is and what is live there by kind, the peak of
        Inductor's code when replayed, bytes offloaded and host memory."""
        lines = [f"graph {self.graph_id} (policy={self.policy!r})"]
        for label, which in (("without fxoffload", "before"), ("with fxoffload", "after")):
            peak = self.peak_breakdown(which)
            if peak is None:
                continue
            lines.append(
                f"  predicted peak {label}: {fmt_bytes(peak.total)} at {peak.phase} node {peak.node} ({peak.kinds()})"
            )
        if self.upstream is not None and self.upstream.held_bytes:
            lines.append(f"  held through it: {self.upstream.summary()}")
        compiled = self.compiled_memory()
        if compiled is not None and compiled.points:
            peak = self.peak_breakdown("compiled")
            node = _cut(peak.node, 72)
            lines.append(f"  peak of Inductor's generated code: {fmt_bytes(peak.total)} at {node} ({peak.kinds()})")
        if self.memory_budget is not None:
            expected = _code_else_model(compiled, self.memory_after)
            reached = expected.peak_bytes if expected is not None else 0
            fits = "met" if reached <= self.memory_budget * (1 + BUDGET_TOLERANCE) else "NOT met"
            lines.append(f"  memory_budget: {fmt_bytes(self.memory_budget)} ({fits})")
            lines.extend(f"  planned again: {r}" for r in self.replans)
        if self.device and self.offloaded:  # no stall to predict where nothing is copied
            lines.append(f"  predicted stall: {self.predicted_stall_ms:.3f} ms per step ({self.device})")
        lines.append(
            f"  offloaded: {len(self.offloaded)} of {len(self.saved)} saved tensors, "
            f"{fmt_bytes(self.offloaded_bytes)} of {fmt_bytes(self.saved_bytes)}"
        )
        if self.recomputed:
            lines.append(
                f"  recomputed: {len(self.recomputed)} tensors, {fmt_bytes(sum(r.nbytes for r in self.recomputed))}, "
                f"predicted {self.predicted_recompute_ms:.3f} ms of extra backward compute"
            )
        budget = "unbounded" if self.host_budget is None else fmt_bytes(self.host_budget)
        lines.append(f"  host memory planned by this backend: {fmt_bytes(self.host_bytes_total)} (host_budget: {budget})")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def plot(self, path: str, measured: Any = None) -> str:
        """Draw device memory over the step to a PNG or SVG: the prediction with fxoffload stacked by kind
        (parameters, inputs, gradients, saved activations, transients), the total without fxoffload as a
        line, the host copies in flight as a dashed line (host memory, not stacked), the peak marked with
        what is live there, offload and reload nodes marked, and the peak of Inductor's replayed code as a
        dotted level when there is one.

        ``measured``: a measured peak to mark as a level: bytes (an int, drawn as given), or a
        ``DeviceMemory`` / ``MeasuredMemory`` from ``fxoffload.measure_memory`` (its peak is above what
        was live at its start, so it is drawn on top of this graph's parameters and inputs). Needs
        matplotlib (``pip install 'fxoffload[plot]'``). Returns ``path``.
        """
        level = _measured_level(self, measured)  # bad input fails before matplotlib is asked for
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(13, 5))
        mib = 2**20
        after = self.memory_after if self.memory_after and self.memory_after.points else None
        before = self.memory_before if self.memory_before and self.memory_before.points else None
        if before is not None:
            ax.step(_original_positions(before), [p.total / mib for p in before.points], where="post",
                    color="tab:gray", lw=1.5,
                    label=f"without fxoffload, total (peak {fmt_bytes(before.peak_bytes)})")  # fmt: skip
        if after is not None:
            xs = _original_positions(after)
            bottom = [0.0] * len(xs)
            colors = {"parameters": "#9ecae1", "inputs": "#c6dbef", "gradients": "#fdae6b", "saved": "#74c476",
                      "transient": "#bcbddc", "outside": "#d9d9d9"}  # fmt: skip
            kinds = self.device_kinds("after")
            for kind in CATEGORIES:
                values = [k[kind] / mib for k in kinds]
                if not any(values):
                    continue
                top = [b + v for b, v in zip(bottom, values)]
                ax.fill_between(xs, bottom, top, step="post", color=colors.get(kind), lw=0,
                                label=f"with fxoffload: {_KIND_NAMES.get(kind, kind)}")  # fmt: skip
                bottom = top
            totals = [p.total / mib for p in after.points]
            ax.step(xs, totals, where="post", color="tab:blue", lw=1,
                    label=f"with fxoffload, total (peak {fmt_bytes(after.peak_bytes)})")  # fmt: skip
            host = self.host_in_flight("after") or []
            if any(host):
                ax.step(xs, [h / mib for h in host], where="post", color="tab:brown", ls="--", lw=1.2,
                        label="host copies in flight (host memory, not stacked)")  # fmt: skip
            for name, marker, color in (("offload", "v", "tab:orange"), ("reload", "^", "tab:green")):
                marks = [i for i, p in enumerate(after.points) if p.node.startswith(f"{name}_default")]
                if marks:
                    ax.scatter([xs[i] for i in marks], [totals[i] for i in marks], marker=marker, color=color,
                               s=18, zorder=3, label=name)  # fmt: skip
            peak = self.peak_breakdown("after")
            ax.axvline(xs[peak.index], color="tab:red", lw=0.8, alpha=0.6)
            ax.scatter([xs[peak.index]], [peak.total / mib], marker="o", color="tab:red", s=30, zorder=4,
                       label=f"predicted peak {fmt_bytes(peak.total)}, {peak.phase} {peak.node}")  # fmt: skip
            right = xs[peak.index] > (xs[0] + xs[-1]) / 2  # the text on the side with room
            ax.annotate("\n".join(textwrap.wrap(peak.kinds(), 48)), (xs[peak.index], peak.total / mib),
                        xytext=(-6 if right else 6, -6), textcoords="offset points", fontsize=7, va="top",
                        ha="right" if right else "left")  # fmt: skip
            split = xs[sum(p.phase == "forward" for p in after.points)] if any(
                p.phase == "backward" for p in after.points) else xs[-1]  # fmt: skip
            ax.axvline(split, color="black", ls=":", lw=1)
            ax.text(split, max(totals) * 1.02, " backward", va="bottom", fontsize=8)
        compiled = self.compiled_memory()
        if compiled is not None and compiled.points:
            ax.axhline(compiled.peak_bytes / mib, color="tab:purple", ls=":", lw=1.2,
                       label=f"peak of Inductor's generated code {fmt_bytes(compiled.peak_bytes)}")  # fmt: skip
        if level is not None:
            value, label = level
            ax.axhline(value / mib, color="black", ls="-.", lw=1.2, label=label)
        ax.set_xlabel("graph node (forward, then backward)")
        ax.set_ylabel("live device memory (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"fxoffload graph {self.graph_id}: {len(self.offloaded)} of {len(self.saved)} saved tensors offloaded")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)  # beside the curves, not on them
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def to_json(self) -> str:
        """The whole report as JSON; ``OffloadReport.from_json`` reads it back."""
        data = dataclasses.asdict(dataclasses.replace(self, graphs=None))  # asdict would deep-copy them
        del data["graphs"]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> OffloadReport:
        data = json.loads(text)
        data["saved"] = tuple(
            SavedRow(**{**r, "shape": tuple(r["shape"]), "decision": Action(r["decision"])})
            for r in data["saved"]
        )
        for key in ("memory_before", "memory_after"):
            if data[key] is not None:
                data[key] = MemoryTimeline(tuple(MemoryPoint(**p) for p in data[key]["points"]))
        if data.get("timings") is not None:
            data["timings"] = PassTimings(**data["timings"])
        data["host_copies"] = tuple(HostCopy(**c) for c in data.get("host_copies", ()))
        data["replans"] = tuple(data.get("replans", ()))
        if data.get("upstream") is not None:
            up = data["upstream"]
            data["upstream"] = UpstreamMemory(**{
                **up, "largest": tuple(tuple(x) for x in up["largest"]),
                "calls": tuple(CallOutside(**c) for c in up.get("calls", ())),
            })  # fmt: skip
        return cls(**data)

    def graph_code(self) -> str:
        """The rewritten forward and backward graphs as Python code (before the inner compiler)."""
        return f"# forward, graph {self.graph_id}\n{self.fw_code}\n# backward, graph {self.graph_id}\n{self.bw_code}"

    def __str__(self) -> str:
        return self.table()


def _table_width(rows, headers) -> int:
    """Columns a tabulate table of these rows takes."""
    return max(len(line) for line in tabulate(rows, headers=headers, disable_numparse=True).splitlines())


def _cut(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` columns, "..." where it was cut."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: max(0, width - 3)].rstrip() + "..."


def _count(rows) -> str:
    return f"{len(rows)} tensor{'s' if len(rows) != 1 else ''}, {fmt_bytes(sum(r.nbytes for r in rows))}"


def _code_counts(rows) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.reason_code or "-"] = counts.get(r.reason_code or "-", 0) + 1
    return ", ".join(f"{code} {n}" for code, n in sorted(counts.items(), key=lambda kv: -kv[1]))


_INSERTED = ("offload_default", "reload_default", "wait_default")


def _timing_fields(d, costs: PlanCosts | None) -> dict[str, float]:
    """Predicted copy times and compute windows of a saved tensor (every row, offloaded or not)."""
    if costs is None:
        return {}
    d2h, h2d = copy_seconds(d.saved, costs.rates)
    fw_window, bw_window = windows(d.saved, costs.fw_starts, costs.bw_starts)
    recompute = d.recompute.seconds if d.recompute is not None else 0.0
    return {
        "d2h_ms": d2h * 1e3, "h2d_ms": h2d * 1e3, "fw_window_ms": fw_window * 1e3, "bw_window_ms": bw_window * 1e3,
        "recompute_ms": recompute * 1e3,
    }  # fmt: skip


def _device_line(costs: PlanCosts | None) -> str:
    if costs is None:
        return ""
    r = costs.rates
    line = f"{r.name}: link {r.d2h / 1e9:.1f} GB/s out, {r.h2d / 1e9:.1f} GB/s in"
    if costs.calibrated:
        line += f"; {costs.calibrated} compute nodes timed (calibrate=True)"
    return line


def _original_positions(timeline: MemoryTimeline) -> list[float]:
    """x of every point, counting only the nodes of the original graphs, so that the curves with and
    without fxoffload line up; inserted transfer nodes sit just after the node before them."""
    xs, x, extra = [], -1, 0
    for p in timeline.points:
        if p.node.startswith(_INSERTED):
            extra += 1
            xs.append(x + min(0.9, 0.1 * extra))
        else:
            x, extra = x + 1, 0
            xs.append(float(x))
    return xs


def _host_copies(fw: fx.GraphModule, bw: fx.GraphModule, after: MemoryTimeline | None) -> tuple[HostCopy, ...]:
    """Every offloaded tensor's host copy over the points of ``after`` (the memory model on the rewritten
    ``fw``, ``bw``: one point per node but the outputs). The forward returns the host copy (an
    ``offload``, through its ``wait``) among its saved values; the backward receives it in the
    placeholder the rewrite named after the saved tensor (``rewrite.host_placeholder_name``, as
    ``apply_plan`` finds the saved tensor's placeholder by its forward name)."""
    fw_nodes = [n for n in fw.graph.nodes if n.op != "output"]
    bw_nodes = [n for n in bw.graph.nodes if n.op != "output"]
    names = [(p.phase, p.node) for p in after.points] if after is not None else []
    if names != [("forward", n.name) for n in fw_nodes] + [("backward", n.name) for n in bw_nodes]:
        return ()  # not the timeline of these graphs (the graphs were left unchanged)
    placeholders = {n.name: n for n in bw_nodes if n.op == "placeholder"}
    fw_index = {n: i for i, n in enumerate(fw_nodes)}
    bw_index = {n: len(fw_nodes) + i for i, n in enumerate(bw_nodes)}
    copies = []
    for out in fw.graph.output_node().args[0]:
        copy = out
        while isinstance(copy, fx.Node) and copy.op == "call_function" and copy.target is ops.wait:
            copy = copy.args[0]
        if not (isinstance(copy, fx.Node) and copy.op == "call_function" and copy.target is ops.offload):
            continue
        source = copy.args[0]
        held = placeholders.get(host_placeholder_name(source.name)) if isinstance(source, fx.Node) else None
        if held is None:
            continue
        last = max((bw_index[u] for u in held.users if u in bw_index), default=len(fw_nodes))
        reloads = [u for u in held.users if u.op == "call_function" and u.target is ops.reload]
        # The reload's destination lives from the reload to its last reader through any alias (its wait).
        reload_first = bw_index[reloads[0]] if reloads else -1
        reload_users = storage_users(reloads[0]) if reloads else []
        reload_last = max((bw_index[u] for u in reload_users if u in bw_index), default=reload_first)
        copies.append(HostCopy(source.name, held.name,
                               _tensor_bytes(copy.meta["val"]), fw_index[copy], last,
                               reload_first, reload_last if reloads else -1))  # fmt: skip
    return tuple(copies)


_OFFLOAD_CALL = "torch.ops.fxoffload.offload.default("


def _compiled_host(timeline: MemoryTimeline, copies: tuple[HostCopy, ...]) -> list[int] | None:
    """Host copies in flight at every line of Inductor's replayed code (``codememory`` points, labelled
    with their statement): the plan's copies are taken, in forward order, at the forward's
    ``fxoffload.offload`` lines, in their order (Inductor may reorder offloads of different sizes: then
    the forward figures between them are off, the backward's are not), and released after the last
    backward line naming the placeholder that holds them (its ``del``). None when the code has another
    number of offloads than the plan, or never names a copy's placeholder."""
    points = timeline.points
    starts = [i for i, p in enumerate(points) if p.phase == "forward" and _OFFLOAD_CALL in p.node]
    if len(starts) != len(copies):
        return None
    delta = [0] * (len(points) + 1)
    for start, c in zip(starts, sorted(copies, key=lambda c: c.first)):
        word = re.compile(rf"\b{re.escape(c.host_name)}\b")
        named = [
            i for i, p in enumerate(points) if p.phase == "backward" and word.search(p.node.split(": ", 1)[-1])
        ]
        if not named:
            return None
        delta[start] += c.nbytes
        delta[named[-1] + 1] -= c.nbytes
    out, running = [], 0
    for d in delta[:-1]:
        running += d
        out.append(running)
    return out


def _measured_level(report: OffloadReport, measured: Any) -> tuple[int, str] | None:
    """The level (bytes) and legend of a measured peak given to ``plot``."""
    from .measure import DeviceMemory, MeasuredMemory

    if measured is None:
        return None
    if isinstance(measured, int) and not isinstance(measured, bool):
        if measured < 0:
            raise ValueError(f"fxoffload: plot(measured={measured}): a measured peak in bytes must be >= 0")
        return measured, f"measured peak {fmt_bytes(measured)}"
    if isinstance(measured, MeasuredMemory):
        devices = {r.device for r in report.saved} or {"cpu"}
        found = [d for d in measured.devices if d.device in devices]
        if not found:
            raise ValueError(
                f"fxoffload: plot(measured=...): no figures for this graph's device ({', '.join(sorted(devices))}); "
                f"measured: {', '.join(d.device for d in measured.devices)}"
            )
        measured = found[0]
    if isinstance(measured, DeviceMemory):
        start = report.start_bytes  # parameters and inputs, live through the whole step
        where = "CPU" if measured.device == "cpu" else measured.device
        return start + measured.peak_bytes, (
            f"measured peak ({where}) {fmt_bytes(measured.peak_bytes)} above the start, "
            f"drawn on this graph's {fmt_bytes(start)} of parameters and inputs live before the step"
        )
    raise ValueError(
        f"fxoffload: plot(measured={type(measured).__name__}): pass bytes (an int), a DeviceMemory or a "
        f"MeasuredMemory (fxoffload.measure_memory), or None"
    )


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "OffloadReport.plot needs matplotlib, which is not installed: "
            "pip install 'fxoffload[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def save_reports(reports: list[OffloadReport], path: str) -> None:
    """Write several reports to one JSON file (a list); ``load_reports`` reads it back."""
    with open(path, "w") as f:
        f.write("[\n" + ",\n".join(r.to_json() for r in reports) + "\n]\n")


def load_reports(path: str) -> list[OffloadReport]:
    with open(path) as f:
        return [OffloadReport.from_json(json.dumps(item)) for item in json.load(f)]
