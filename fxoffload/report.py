"""What fxoffload did to one compiled forward/backward pair, for people and for tools."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import textwrap

import torch.fx as fx

from tabulate import tabulate

from .codememory import simulate_output_code
from .memory import MemoryPoint, MemoryTimeline
from .plan import OFFLOAD, RECOMPUTE, OffloadPlan, PlanCosts, fmt_bytes
from .reasons import Action
from .schedule import copy_seconds, windows

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

    def compiled_memory(self) -> MemoryTimeline | None:
        """Device memory of one step replayed from the code Inductor generated for this pair
        (``codememory``): the buffers it really allocates after fusion and reuse, freed where it frees
        them. None until both graphs are compiled, and with ``inner="aot_eager"``, which runs the FX
        graphs themselves (``memory_after`` is the prediction then)."""
        forward, backward = self.output_code.get("forward"), self.output_code.get("backward")
        if not forward or not backward:
            return None
        try:
            return simulate_output_code(forward, backward, self.num_fwd_outputs)
        except ValueError as e:  # code this reader does not know (a new Inductor): no figure, no failure
            log.debug("fxoffload: cannot replay the generated code of graph %d: %s", self.graph_id, e)
            return None

    def timeline(self) -> list[dict[str, object]]:
        """Predicted live device bytes after every node, without and with fxoffload, as data."""
        out: list[dict[str, object]] = []
        for which, timeline in (("before", self.memory_before), ("after", self.memory_after)):
            for i, p in enumerate(timeline.points if timeline else ()):
                out.append({"graph": which, "step": i, "phase": p.phase, "node": p.node, "total": p.total, **p.live})
        return out

    def summary(self) -> str:
        """Predicted peak before and after, split by category, bytes offloaded and host memory."""
        lines = [f"graph {self.graph_id} (policy={self.policy!r})"]
        for label, timeline in (("without fxoffload", self.memory_before), ("with fxoffload", self.memory_after)):
            if not timeline or not timeline.points:
                continue
            peak = timeline.peak
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in peak.live.items() if v)
            lines.append(
                f"  predicted peak {label}: {fmt_bytes(peak.total)} at {peak.phase} node {peak.node} ({parts})"
            )
        compiled = self.compiled_memory()
        if compiled is not None and compiled.points:
            peak = compiled.peak
            lines.append(f"  peak of Inductor's generated code: {fmt_bytes(peak.total)} at {peak.phase} {peak.node}")
        if self.memory_budget is not None:
            reached = compiled.peak_bytes if compiled is not None else self.predicted_peak_after
            fits = "met" if reached <= self.memory_budget else "NOT met"
            lines.append(f"  memory_budget: {fmt_bytes(self.memory_budget)} ({fits})")
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

    def plot(self, path: str) -> str:
        """Draw predicted device memory over the step, without and with fxoffload, to a PNG or SVG.

        Offload and reload nodes are marked on the "with" curve. Needs matplotlib
        (``pip install 'fxoffload[plot]'``). Returns ``path``.
        """
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(10, 4.5))
        mib = 2**20
        for label, timeline, style in (
            ("without fxoffload", self.memory_before, dict(color="tab:gray", lw=1.5)),
            ("with fxoffload", self.memory_after, dict(color="tab:blue", lw=1.5)),
        ):
            if not timeline or not timeline.points:
                continue
            totals = [p.total / mib for p in timeline.points]
            xs = _original_positions(timeline)
            ax.step(xs, totals, where="post", label=f"{label} (peak {fmt_bytes(timeline.peak_bytes)})", **style)
            if timeline is self.memory_after:
                for name, marker, color in (("offload", "v", "tab:orange"), ("reload", "^", "tab:green")):
                    marks = [i for i, p in enumerate(timeline.points) if p.node.startswith(f"{name}_default")]
                    ax.scatter([xs[i] for i in marks], [totals[i] for i in marks], marker=marker, color=color,
                               s=18, zorder=3, label=name)  # fmt: skip
                split = xs[sum(p.phase == "forward" for p in timeline.points)]
                ax.axvline(split, color="black", ls=":", lw=1)
                ax.text(split, ax.get_ylim()[1] * 0.98, " backward", va="top", fontsize=8)
        ax.set_xlabel("graph node (forward, then backward)")
        ax.set_ylabel("predicted live device memory (MiB)")
        ax.set_title(f"fxoffload graph {self.graph_id}: {len(self.offloaded)} of {len(self.saved)} saved tensors offloaded")
        ax.legend(loc="upper left", fontsize=8)
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
