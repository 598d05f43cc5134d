"""One row per saved tensor of a report: what was decided and why, what the model predicted of its
copies, and what the device measured of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..ir import TransferTime
from ..planning.decisions import OffloadPlan, PlanCosts
from ..planning.measured import host_ratio
from ..planning.schedule import copy_seconds, copy_windows, windows
from ..reasons import Action

if TYPE_CHECKING:
    from .report import OffloadReport

__all__ = ["SavedRow", "carry_measured", "saved_rows", "with_measured"]


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
    # An offloaded tensor's copies as the plan placed them: the compute between each copy's issue and
    # its wait (forward, backward) and the stall predicted at the waits.
    fw_copy_window_ms: float = 0.0
    bw_copy_window_ms: float = 0.0
    stall_ms: float = 0.0
    # The same, measured on the device in the first steps (``runtime.timing``); None: not measured.
    measured_fw_copy_window_ms: float | None = None
    measured_bw_copy_window_ms: float | None = None
    measured_d2h_ms: float | None = None
    measured_h2d_ms: float | None = None
    measured_stall_ms: float | None = None
    # The compute stream's own time in its copies' calls (offload, reload and, on a CPU, their waits).
    measured_op_ms: float | None = None
    # Dimensions of ``shape`` that depend on the data (estimates; ``SavedTensor.data_dependent_dims``).
    data_dependent_dims: tuple[int, ...] = ()

    @property
    def shape_text(self) -> str:
        """``256?x64``: the shape, a ``?`` after each size that depends on the data; ``scalar`` for 0-dim."""
        dims = (f"{n}?" if i in self.data_dependent_dims else str(n) for i, n in enumerate(self.shape))
        return "x".join(dims) or "scalar"


def saved_rows(plan: OffloadPlan) -> tuple[SavedRow, ...]:
    """One row per decision of ``plan``, with the predicted copy times and compute windows."""
    return tuple(
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
            **_timing_fields(d, plan.partition_costs if d.decision == Action.RECOMPUTE else plan.costs),
            recomputed_from=", ".join(d.recompute.sources) if d.recompute is not None else "",
            reason_code=d.reason.code.value,
            module_path=d.saved.module_path,
            recompute_refused=d.recompute_refused.text if d.recompute_refused else "",
            recompute_refused_code=d.recompute_refused.code.value if d.recompute_refused else "",
            data_dependent_dims=d.saved.data_dependent_dims,
        )
        for d in plan.decisions
    )


def _timing_fields(d: Any, costs: PlanCosts | None) -> dict[str, float]:
    """Predicted copy times and compute windows of a saved tensor (every row, offloaded or not)."""
    if costs is None:
        return {}
    d2h, h2d = copy_seconds(d.saved, costs.rates)
    fw_window, bw_window = windows(d.saved, costs.fw_starts, costs.bw_starts)
    recompute = d.recompute.seconds if d.recompute is not None else 0.0
    out = {
        "d2h_ms": d2h * 1e3, "h2d_ms": h2d * 1e3, "fw_window_ms": fw_window * 1e3, "bw_window_ms": bw_window * 1e3,
        "recompute_ms": recompute * 1e3,
    }  # fmt: skip
    timing = d.timing
    if timing is not None:
        out["stall_ms"] = timing.stall * 1e3
        out["fw_copy_window_ms"] = copy_windows(d.saved, timing, costs)[0] * 1e3
        out["bw_copy_window_ms"] = copy_windows(d.saved, timing, costs)[1] * 1e3
    return out


_MEASURED = (
    "measured_fw_copy_window_ms", "measured_bw_copy_window_ms", "measured_d2h_ms", "measured_h2d_ms", "measured_stall_ms",
    "measured_op_ms",
)  # fmt: skip


def carry_measured(report: OffloadReport, earlier: OffloadReport) -> OffloadReport:
    """``report`` (a plan made again) with what was measured of the same tensors under ``earlier``'s
    plan, where it has not been measured itself: the figures its decisions were made from."""
    before = {r.name: r for r in earlier.saved}

    def row(r: SavedRow) -> SavedRow:
        old = before.get(r.name)
        if old is None or r.measured_stall_ms is not None or old.measured_stall_ms is None:
            return r
        return dataclasses.replace(r, **{k: getattr(old, k) for k in _MEASURED})

    return dataclasses.replace(report, saved=tuple(map(row, report.saved)))


def with_measured(
    report: OffloadReport, times: Sequence[TransferTime], forward_s: float | None, forward_host_s: float | None = None
) -> OffloadReport:
    """``report`` with what the device measured of its copies in a step (``times``) on its rows, the
    step's stall, and the physical bound: the measured device-to-host link times the forward's compute
    (``forward_s``, the forward's measured time, less its waits); ``forward_host_s``: the host's time
    in that forward call."""
    by = {}
    for t in times:
        by.setdefault(t.tensor, {})[t.direction] = t

    def row(r: SavedRow) -> SavedRow:
        got = by.get(r.name)
        if not got:
            return r
        d2h, h2d = got.get("d2h"), got.get("h2d")
        return dataclasses.replace(
            r,
            measured_fw_copy_window_ms=d2h.window_s * 1e3 if d2h else None,
            measured_d2h_ms=d2h.copy_s * 1e3 if d2h else None,
            measured_bw_copy_window_ms=h2d.window_s * 1e3 if h2d else None,
            measured_h2d_ms=h2d.copy_s * 1e3 if h2d else None,
            measured_stall_ms=sum(t.stall_s for t in got.values()) * 1e3,
            measured_op_ms=sum(t.op_s for t in got.values()) * 1e3,
        )

    d2h = [t for t in times if t.direction == "d2h"]
    stall_fw = sum(t.stall_s for t in d2h)
    link = sum(t.nbytes for t in d2h) / sum(t.copy_s for t in d2h) if d2h and sum(t.copy_s for t in d2h) else None
    bound = None
    if forward_s is not None and link is not None:
        bound = int(link * max(0.0, forward_s - stall_fw))
    return dataclasses.replace(
        report, saved=tuple(map(row, report.saved)), measured_stall_ms=sum(t.stall_s for t in times) * 1e3,
        measured_forward_ms=forward_s * 1e3 if forward_s is not None else None, offload_bound_bytes=bound,
        measured_forward_host_ms=forward_host_s * 1e3 if forward_host_s is not None else None,
        measured_host_ratio_fw=host_ratio(times, "d2h"), measured_host_ratio_bw=host_ratio(times, "h2d"),
    )  # fmt: skip
