"""What fxoffload did to one compiled forward/backward pair, as data for people and for tools.

``OffloadReport`` is an output: the compiler builds one per pair from the plan it applied and never
reads one back to decide. Its text (``table``, ``summary``) is written by ``render``, its picture
(``plot``) by ``plot``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection
from typing import Any

import torch.fx as fx

from ..analysis.code_copies import host_in_flight as code_host_in_flight
from ..analysis.memory import CATEGORIES, CallOutside, MemoryPoint, MemoryTimeline, bytes_over_points
from ..analysis.outside import OutsideMemory
from ..planning.decisions import OffloadPlan, PlanCosts
from ..reasons import Action
from ..rewrite.host_copies import HostCopy, replay_switched_off, switched_off_held, switched_off_hosts
from . import plot as plotting
from . import render
from .rows import SavedRow, carry_measured, saved_rows, with_measured

log = logging.getLogger(__name__)

__all__ = [
    "CompileSpent", "HostCopy", "OffloadReport", "PassTimings", "PeakBreakdown", "SavedRow", "load_reports", "save_reports", "saved_rows",
    "carry_measured", "with_measured",
]  # fmt: skip


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
        return render.kinds_text(self.device, self.host_bytes)


@dataclasses.dataclass(frozen=True)
class PassTimings:
    """Wall-clock seconds the backend spent on one graph pair (CPU work on every machine)."""

    pass_s: float  # the fxoffload pass (analyse, plan, rewrite), without torch's second partition
    repartition_s: float  # torch's partitioner run again for the recomputation the plan asked for
    simulate_s: float  # the memory model run on the rewritten pair (``memory_after``); 0 if unchanged
    fw_nodes: int  # nodes of the partitioned forward the pass was given (before the rewrite)
    bw_nodes: int  # the same for the backward
    # The whole compile of the graph: how many times the inner compiler ran for it (a plan made again
    # for a missed budget, verify_peak's unchanged pair), and the seconds they took, pass included.
    compiles: int = 0
    compile_s: float = 0.0
    # Where the compiles of the graph went, each run of Inductor (or a compile stopped before it
    # lowered anything) with what it was for: this pair's compile and those of the plans before it,
    # made again at run time (``CompileSpent.round``), so the first steps' compile time is all here.
    spent: tuple[CompileSpent, ...] = ()

    @property
    def spent_s(self) -> float:
        """Seconds of every compile of the graph, the plans made again at run time included."""
        return sum(s.seconds for s in self.spent) if self.spent else self.compile_s

    def spent_text(self) -> str:
        """``38.2 s: the plan 25.8 s, verify_peak's code without offloading 10.8 s; planned again at
        run time (1): ...``: every compile of the graph, by what it was for."""
        if not self.spent:
            return f"{self.compile_s:.1f} s in {self.compiles} compiles"
        rounds: dict[int, list[str]] = {}
        for s in self.spent:
            rounds.setdefault(s.round, []).append(f"{s.what} {s.seconds:.1f} s")
        parts = [
            ("" if r == 0 else f"planned again at run time ({r}): ") + ", ".join(what) for r, what in sorted(rounds.items())
        ]
        return f"{self.spent_s:.1f} s: " + "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class CompileSpent:
    """One compile of a graph (``PassTimings.spent``): what it was for, its wall-clock seconds (the
    partition and the pass in it included), and when: 0 when Dynamo compiled the graph, n for the
    n-th plan made again at run time; ``inside``: a lowering inside the compile listed before it
    (``verify_peak``'s unchanged forward), not a compile of its own; ``lowered``: whether Inductor
    lowered a graph in it (not where the partitioner stopped it, nor for a lowering inside another)."""

    what: str
    seconds: float
    round: int = 0
    inside: bool = False
    lowered: bool = True


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
    # The model's compute time of the step (forward and backward), and the compute stream's time the
    # offloads' op calls take in it (``DeviceRates.op_cost`` each: "auto" spends at most 1% on them).
    predicted_compute_ms: float = 0.0
    predicted_op_ms: float = 0.0
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
    # Why copies measured to stall in the first steps were not planned again (too little of the step
    # to be worth a compile, ``planning.worth.stall_not_worth_a_compile``); empty where none was left so.
    left_as_planned: str = ""
    # What code before this graph (eager code, other graphs) saved and holds on its device while it
    # runs, read from the autograd graph behind its inputs when it compiled: "outside" in every
    # timeline. None where it could not be read.
    outside: OutsideMemory | None = None
    # Device bytes one call keeps for its backward with this plan (``memory.kept_saved_bytes``).
    kept_bytes: int = 0
    # Device bytes of its parameters' gradients, held after its backward (``memory.param_grad_bytes``).
    param_grad_bytes: int = 0
    # Measured in the first steps of this plan (``runtime.timing``): the forward's time, the time the
    # compute stream waited for copies, and what can leave the peak without a stall: the host link's
    # measured device-to-host bytes/s times the forward's compute (its time less its waits).
    measured_forward_ms: float | None = None
    measured_forward_host_ms: float | None = None  # the host's time in that forward call
    measured_stall_ms: float | None = None
    offload_bound_bytes: int | None = None
    # On an accelerator, the device's time over the host's across the copies' windows, forward and
    # backward (``planning.measured.host_ratio``): at most ``HOST_BOUND``, the device waited on the host.
    measured_host_ratio_fw: float | None = None
    measured_host_ratio_bw: float | None = None
    # Saved tensors whose copies were switched off at run time after they stalled (``auto``): kept on
    # the device by the compiled code that still has their copies. ``memory_after`` and the replay
    # (``compiled_memory``) count them there, from their offload to their reload. Copied, with
    # ``host_copies``, from the compiler's ``PlannedPair``, which decides on its own.
    switched_off: tuple[str, ...] = ()
    # Scratch bytes the code's fallback and extern kernels allocate inside their calls, by graph and
    # line, measured on the code's layouts: the replay counts it (the ``PlannedPair``'s, shared).
    code_scratch: dict[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    # The replayed peak of Inductor's code for this graph without offloading, where it was lowered
    # (for a fractional memory_budget, or by ``verify_peak`` to judge a plan): what
    # ``backend="inductor"`` would peak at.
    unchanged_code_peak: int | None = None

    @property
    def outside_bytes(self) -> int:
        """"outside" in this pair's timelines with its plan: what code before it holds at the call
        planned for, earlier calls of the same graph keeping ``kept_bytes`` each (``outside``)."""
        return self.outside.outside(self.kept_bytes) if self.outside is not None else 0

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
        **fields: Any,
    ) -> OffloadReport:
        """The report of ``plan`` applied to the rewritten pair ``fw``, ``bw``; ``fields``: the
        report's other fields (``timings``, ``outside``, ``output_code``, ``host_copies``, ...)."""
        costs = plan.costs
        rows = saved_rows(plan)
        if costs is not None:
            fields.setdefault("predicted_compute_ms", (costs.fw_starts[-1] + costs.bw_starts[-1]) * 1e3)
            fields.setdefault("predicted_op_ms", plan.op_seconds * 1e3)
            fields.setdefault("unchanged_code_peak", costs.code_peak)
        return cls(
            graph_id, plan.policy, rows, plan.note, fw.code, bw.code,
            len(fw.graph.nodes), len(bw.graph.nodes),
            host_budget, host_bytes_before + plan.host_bytes, memory_before, memory_after,
            plan.stall * 1e3, plan.memory_budget, _device_line(costs, bool(plan.offloaded)), plan.recompute_seconds * 1e3,
            graphs=(fw, bw), **fields,
        )  # fmt: skip

    @property
    def offloaded(self) -> tuple[SavedRow, ...]:
        return tuple(r for r in self.saved if r.decision == Action.OFFLOAD)

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.nbytes for r in self.offloaded)

    @property
    def recomputed(self) -> tuple[SavedRow, ...]:
        return tuple(r for r in self.saved if r.decision == Action.RECOMPUTE)

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    def table(self, rows: str = "all", width: int | None = None, kept: int = 5) -> str:
        """The saved tensors, their decisions and the reasons, as a text table (``render.table``)."""
        return render.table(self, rows, width, kept)

    def summary(self) -> str:
        """Predicted peak before and after, where it is and what is live there by kind, the peak of
        Inductor's code when replayed, bytes offloaded and host memory (``render.summary``)."""
        return render.summary(self)

    def plot(self, path: str, measured: Any = None) -> str:
        """Draw device memory over the step to a PNG or SVG (``plot.plot``); returns ``path``."""
        return plotting.plot(self, path, measured)

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
        (``outside``). A measured peak above the step's start (``fxoffload.measure_memory``) plus
        these compares with a point's total."""
        timeline = self.memory_after or self.memory_before
        points = timeline.points if timeline is not None else ()
        held = max((p.live["parameters"] + p.live["inputs"] for p in points), default=0)
        up = self.outside
        return max(0, held - (up.made_inputs_bytes if up is not None else 0)) + (up.params_bytes if up else 0)

    def expected_memory(self) -> MemoryTimeline | None:
        """The prediction the code that runs is held to: the replay of Inductor's code where there is
        one (``compiled_memory``), else the FX model's ``memory_after``."""
        compiled = self.compiled_memory()
        return compiled if compiled is not None and compiled.points else self.memory_after

    def compiled_memory(self) -> MemoryTimeline | None:
        """Device memory of one step replayed from the code Inductor generated for this pair
        (``analysis.code_memory``): the buffers it really allocates after fusion and reuse, freed where it frees
        them. None until both graphs are compiled, and with ``inner="aot_eager"``, which runs the FX
        graphs themselves (``memory_after`` is the prediction then)."""
        later = self.outside.outside_backward(self.kept_bytes) if self.outside is not None else 0
        return replay_switched_off(
            self.output_code, self.num_fwd_outputs, self.outside_bytes, later, self.host_copies, self.switched_off,
            self.code_scratch,
        )

    def switched_off_held(self, names: Collection[str] | None = None) -> list[int]:
        """Device bytes the copies switched off at run time (``names``, default ``switched_off``) keep
        at every point of ``memory_after`` as it was compiled: each from its offload to its reload,
        which gives the copy kept on the device back (the model counts the reload's result from there)."""
        n = len(self.memory_after.points) if self.memory_after is not None else 0
        return switched_off_held(self.host_copies, self.switched_off if names is None else names, n)

    def _copies(self) -> list[tuple[str, int, int]]:
        return [(c.host_name, c.first, c.nbytes) for c in self.host_copies]

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
        missing, or when the replayed code's offloads do not match the plan's (see ``analysis.code_memory.host_in_flight``)."""
        timeline = self._timeline(which)
        if timeline is None:
            return None
        n = len(timeline.points)
        if which == "before" or not self.host_copies:
            return [0] * n
        if which == "compiled":
            return code_host_in_flight(
                timeline, self._copies(), skip=switched_off_hosts(self.host_copies, self.switched_off)
            )
        # A copy switched off at run time is kept on the device: no host bytes.
        return bytes_over_points(
            n, [(c.first, c.last + 1, c.nbytes) for c in self.host_copies if c.name not in self.switched_off]
        )  # fmt: skip

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

    def to_json(self) -> str:
        """The whole report as JSON; ``OffloadReport.from_json`` reads it back."""
        data = dataclasses.asdict(dataclasses.replace(self, graphs=None))  # asdict would deep-copy them
        del data["graphs"]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> OffloadReport:
        data = json.loads(text)
        data["saved"] = tuple(
            SavedRow(**{
                **r, "shape": tuple(r["shape"]), "decision": Action(r["decision"]),
                "data_dependent_dims": tuple(r.get("data_dependent_dims", ())),
            })  # fmt: skip
            for r in data["saved"]
        )
        for key in ("memory_before", "memory_after"):
            if data[key] is not None:
                data[key] = MemoryTimeline(tuple(MemoryPoint(**p) for p in data[key]["points"]))
        if data.get("timings") is not None:
            spent = tuple(CompileSpent(**c) for c in data["timings"].get("spent", ()))
            data["timings"] = PassTimings(**{**data["timings"], "spent": spent})
        data["host_copies"] = tuple(HostCopy(**c) for c in data.get("host_copies", ()))
        data["replans"] = tuple(data.get("replans", ()))
        data["switched_off"] = tuple(data.get("switched_off", ()))
        data.pop("matmul_scratch", None)  # written before the scratch was measured on the code's layouts
        data["code_scratch"] = {k: tuple((int(n), int(b)) for n, b in v) for k, v in data.get("code_scratch", {}).items()}
        if "upstream" in data:  # written before the field was renamed
            data["outside"] = data.pop("upstream")
        if data.get("outside") is not None:
            up = data["outside"]
            data["outside"] = OutsideMemory(**{
                **up, "largest": tuple(tuple(x) for x in up["largest"]),
                "calls": tuple(CallOutside(**c) for c in up.get("calls", ())),
            })  # fmt: skip
        return cls(**data)

    def graph_code(self) -> str:
        """The rewritten forward and backward graphs as Python code (before the inner compiler)."""
        return f"# forward, graph {self.graph_id}\n{self.fw_code}\n# backward, graph {self.graph_id}\n{self.bw_code}"

    def __str__(self) -> str:
        return render.table(self)


def _device_line(costs: PlanCosts | None, offloaded: bool = True) -> str:
    if costs is None:
        return ""
    r = costs.rates
    line = f"{r.name}: link {r.d2h / 1e9:.1f} GB/s out, {r.h2d / 1e9:.1f} GB/s in"
    if r.op_time or r.op_byte_time:
        line += f"; op calls {r.op_time * 1e3:.3g} ms a tensor"
        if r.op_byte_time:
            line += f" + {r.op_byte_time * (1 << 20) * 1e3:.3g} ms a MiB"
    if r.copy_margin and offloaded:
        line += f"; copies planned {r.copy_margin:.0%} longer than predicted"
    if costs.calibrated:
        line += f"; {costs.calibrated} compute nodes timed (calibrate=True)"
    return line


def save_reports(reports: list[OffloadReport], path: str) -> None:
    """Write several reports to one JSON file (a list); ``load_reports`` reads it back."""
    with open(path, "w") as f:
        f.write("[\n" + ",\n".join(r.to_json() for r in reports) + "\n]\n")


def load_reports(path: str) -> list[OffloadReport]:
    with open(path) as f:
        return [OffloadReport.from_json(json.dumps(item)) for item in json.load(f)]
