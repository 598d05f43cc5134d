"""The ``fxoffload`` torch.compile backend: capture -> lifetimes -> plan -> rewrite -> inner compiler."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from . import _compat
from .cost import device_rates, node_start_times
from .lifetimes import GraphLifetimes, analyze_saved_tensors
from .memory import MemoryTimeline, simulate
from .options import OffloadOptions
from .plan import OffloadPlan, PlanCosts, fmt_bytes, plan_offloads
from .report import OffloadReport
from .rewrite import apply_plan, hoist_saved_views

log = logging.getLogger(__name__)

_graph_ids = iter(range(1 << 62))
_graph_ids_lock = threading.Lock()


class OffloadBackend:
    """A torch.compile backend object; ``.reports`` holds one ``OffloadReport`` per compiled graph pair.

    >>> backend = fxoffload.backend(policy="all")
    >>> compiled = torch.compile(model, backend=backend)
    """

    def __init__(self, options: OffloadOptions | None = None) -> None:
        self.options = options or OffloadOptions()
        self.reports: list[OffloadReport] = []
        self.__name__ = "fxoffload"  # torch.compile names a backend by it

    def __repr__(self) -> str:
        return f"fxoffload.backend({self.options})"

    @property
    def host_bytes_planned(self) -> int:
        return sum(r.offloaded_bytes for r in self.reports)

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[..., Any]:
        opts = self.options
        if mode is not None or options:
            opts = opts.replace(**(options or {}), **({"mode": mode} if mode else {}))
        partitioner = _OffloadPartitioner(self, opts)
        if opts.inner == "aot_eager":
            return _compat.compile_with_aot_eager(gm, example_inputs, partitioner)
        patches = _compat.inductor_mode_options(opts.mode)
        if _compat.cudagraphs_enabled(patches):
            partitioner.disabled_reason = (
                f"CUDA graphs are on (mode={opts.mode!r}): a capture cannot hold the transfer "
                "events and host buffers, so offloading is off for this graph"
            )
        return _compat.compile_with_inductor(gm, example_inputs, partitioner, patches)

    def record(self, report: OffloadReport) -> None:
        self.reports.append(report)


class _OffloadPartitioner(_compat.CustomPartitionerFn):
    """torch's own partitioner followed by the fxoffload pass."""

    def __init__(self, backend: OffloadBackend, options: OffloadOptions) -> None:
        self.backend = backend
        self.options = options
        self.disabled_reason = ""

    def uuid(self) -> Any:
        # Cache key part for Inductor; AOTAutograd's cache is off while we compile (see _compat).
        return ("fxoffload", repr(self.options), self.disabled_reason)

    def __call__(
        self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw = _compat.call_partitioner(self.options.partitioner, joint, joint_inputs, **kwargs)
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static = kwargs.get("static_lifetime_input_indices") or ()
        host_before = self.backend.host_bytes_planned
        plan = offload_pass(
            fw, bw, num_fwd_outputs, static, self.options,
            host_bytes_available=self._host_left(),
            disabled_reason=self.disabled_reason,
        )  # fmt: skip
        with _graph_ids_lock:
            graph_id = next(_graph_ids)
        memory_before = plan.costs.baseline
        memory_after = simulate(fw, bw, num_fwd_outputs, tuple(static)) if plan.offloaded else memory_before
        report = OffloadReport.from_plan(
            graph_id, plan, fw, bw, self.options.host_budget, host_before, memory_before, memory_after
        )
        self.backend.record(report)
        log.debug("fxoffload plan for graph %d:\n%s", graph_id, report.table())
        _compat.trace_artifact("fxoffload_plan", report.to_json, encoding="json")
        _compat.trace_artifact("fxoffload_graphs", report.graph_code)
        return fw, bw

    def _host_left(self) -> int | None:
        if self.options.host_budget is None:
            return None
        return max(0, self.options.host_budget - self.backend.host_bytes_planned)


def offload_pass(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    static_input_indices: Any,
    options: OffloadOptions,
    *,
    host_bytes_available: int | None = None,
    disabled_reason: str = "",
) -> OffloadPlan:
    """The fxoffload pass on a partitioned pair: analyse, plan, rewrite in place. Returns the plan.

    The plan's ``costs.baseline`` is the predicted memory of the pair before the rewrite.
    """
    # 1. Lifetimes of the saved tensors (saved views first moved next to their bases, which changes
    #    no memory without offloading, so the baseline is taken after it).
    hoist_saved_views(fw, num_fwd_outputs)
    static = tuple(static_input_indices)
    lifetimes = analyze_saved_tensors(fw, bw, num_fwd_outputs, static)
    # 2. Costs: compute time of every node and the host link, on the graph's device.
    costs = plan_costs(fw, bw, lifetimes, options, simulate(fw, bw, num_fwd_outputs, static))
    # 3. The plan: one decision and reason per saved tensor.
    plan = plan_offloads(
        lifetimes, options, host_bytes_available=host_bytes_available, disabled_reason=disabled_reason,
        costs=costs,
    )  # fmt: skip
    for d in plan.decisions:
        log.debug("fxoffload: %s %s (%s): %s", d.decision, d.saved.name, fmt_bytes(d.saved.nbytes), d.reason)
    if plan.note:
        log.info("fxoffload: %s", plan.note)
    # 4. The rewrite.
    apply_plan(fw, bw, plan, options.prefetch)
    log.info(
        "fxoffload: offloading %d of %d saved tensors (%s)",
        len(plan.offloaded), len(plan.decisions), fmt_bytes(plan.offloaded_bytes),
    )  # fmt: skip
    return plan


def plan_costs(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    lifetimes: GraphLifetimes,
    options: OffloadOptions,
    baseline: MemoryTimeline | None = None,
) -> PlanCosts:
    """The cost model's view of a graph pair: device rates and predicted node start times."""
    accelerators = [d for d in lifetimes.devices if d not in ("cpu", "meta")]
    device = torch.device(accelerators[0]) if accelerators else torch.device("cpu")
    overrides = dict(options.bandwidth or ()) | dict(options.compute_rates or ())
    wants_measure = options.policy != "none" and bool(lifetimes.saved)
    rates = device_rates(device, overrides, measure=wants_measure)
    return PlanCosts(rates, tuple(node_start_times(fw, rates)), tuple(node_start_times(bw, rates)), baseline)


def backend(**options: Any) -> OffloadBackend:
    """A backend object for ``torch.compile(model, backend=...)``; see ``OffloadOptions`` for the knobs."""
    return OffloadBackend(OffloadOptions.from_dict(options))


# The backend behind the name "fxoffload": one object per distinct options, so reports accumulate.
_named_backends: dict[OffloadOptions, OffloadBackend] = {}


def fxoffload_backend(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Entry point of ``torch.compile(model, backend="fxoffload", options={...})``."""
    opts = OffloadOptions.from_dict(options or {}, **({"mode": mode} if mode else {}))
    obj = _named_backends.get(opts)
    if obj is None:
        obj = _named_backends[opts] = OffloadBackend(opts)
    return obj(gm, example_inputs)


def reports() -> list[OffloadReport]:
    """Reports of every graph compiled through ``backend="fxoffload"`` (the string), oldest first."""
    return sorted((r for b in _named_backends.values() for r in b.reports), key=lambda r: r.graph_id)
