"""What fxoffload did to one compiled forward/backward pair, for people and for tools."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from tabulate import tabulate

from .plan import OFFLOAD, OffloadPlan, fmt_bytes


@dataclasses.dataclass(frozen=True)
class SavedRow:
    """One saved tensor and what was decided for it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    decision: str  # "offload" or "keep"
    reason: str
    producer: str
    device: str
    fw_last_use: str  # forward node after which it is not needed on the device
    bw_first_use: str  # backward node that needs it again
    idle_compute_nodes: int


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

    @classmethod
    def from_plan(
        cls,
        graph_id: int,
        plan: OffloadPlan,
        fw: fx.GraphModule,
        bw: fx.GraphModule,
        host_budget: int | None,
        host_bytes_before: int,
    ) -> OffloadReport:
        rows = tuple(
            SavedRow(
                name=d.saved.name,
                shape=d.saved.shape,
                dtype=str(d.saved.dtype).replace("torch.", ""),
                nbytes=d.saved.nbytes,
                decision=d.decision,
                reason=d.reason,
                producer=d.saved.producer,
                device=str(d.saved.device),
                fw_last_use=d.saved.fw_last_user,
                bw_first_use=d.saved.bw_first_user,
                idle_compute_nodes=d.saved.idle_compute_nodes,
            )
            for d in plan.decisions
        )
        return cls(
            graph_id, plan.policy, rows, plan.note, fw.code, bw.code,
            len(fw.graph.nodes), len(bw.graph.nodes),
            host_budget, host_bytes_before + plan.offloaded_bytes,
        )  # fmt: skip

    @property
    def offloaded(self) -> tuple[SavedRow, ...]:
        return tuple(r for r in self.saved if r.decision == OFFLOAD)

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.nbytes for r in self.offloaded)

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    def table(self) -> str:
        """One row per saved tensor, with its decision and the reason for it."""
        rows = [
            (r.name, "x".join(map(str, r.shape)) or "scalar", r.dtype, fmt_bytes(r.nbytes),
             r.producer, r.decision, r.reason)
            for r in self.saved
        ]  # fmt: skip
        header = (
            f"graph {self.graph_id}: policy={self.policy!r}, {len(self.offloaded)} of "
            f"{len(self.saved)} saved tensors offloaded, {fmt_bytes(self.offloaded_bytes)} of "
            f"{fmt_bytes(self.saved_bytes)}"
        )
        budget = "unbounded" if self.host_budget is None else fmt_bytes(self.host_budget)
        header += f"\nhost memory: {fmt_bytes(self.host_bytes_total)} planned by this backend (host_budget: {budget})"
        if self.note:
            header += f"\n{self.note}"
        body = tabulate(
            rows,
            headers=("saved tensor", "shape", "dtype", "size", "producer", "decision", "reason"),
            maxcolwidths=[None, None, None, None, None, None, 60],
        )
        return f"{header}\n{body}"

    def graph_code(self) -> str:
        """The rewritten forward and backward graphs as Python code (before the inner compiler)."""
        return f"# forward, graph {self.graph_id}\n{self.fw_code}\n# backward, graph {self.graph_id}\n{self.bw_code}"

    def __str__(self) -> str:
        return self.table()
