"""Policies: decide, for every saved tensor, "offload" or "keep", and say why. Pure data in and out."""

from __future__ import annotations

import dataclasses

from .lifetimes import GraphLifetimes, SavedTensor
from .options import OffloadOptions

OFFLOAD = "offload"
KEEP = "keep"


@dataclasses.dataclass(frozen=True)
class Decision:
    saved: SavedTensor
    decision: str  # OFFLOAD or KEEP
    reason: str


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    decisions: tuple[Decision, ...]
    policy: str
    note: str = ""  # why the whole graph was left unchanged, if it was

    @property
    def offloaded(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.decision == OFFLOAD)

    @property
    def offloaded_bytes(self) -> int:
        return sum(d.saved.nbytes for d in self.offloaded)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def ineligible_reason(t: SavedTensor, options: OffloadOptions) -> str | None:
    """Why ``t`` can never be offloaded, or None when it can."""
    if t.device.type == "cpu" and not options.offload_cpu:
        return "CPU tensor (set offload_cpu=True to offload CPU tensors)"
    if t.device.type == "meta":
        return "meta tensor"
    if t.is_static_input:
        return "parameter or buffer (static input): it outlives the step anyway"
    if t.is_graph_input:
        return "graph input: its storage belongs to the caller, offloading it frees nothing"
    if t.is_user_output:
        return "returned to the caller: its storage stays alive"
    if t.shares_storage_with:
        return (
            f"its storage ({t.storage}) is also saved as {', '.join(t.shares_storage_with)}: "
            "the other saved alias keeps it alive, offloading this one frees nothing"
        )
    if not t.is_dense:
        return f"non-dense layout (stride {t.stride}): copying it would need a gather"
    if t.bw_first_use < 0:
        return "not used by the backward graph"
    if t.nbytes == 0 or t.nbytes < options.min_bytes:
        return f"{fmt_bytes(t.nbytes)} < min_bytes ({fmt_bytes(options.min_bytes)})"
    return None


def plan_offloads(
    lifetimes: GraphLifetimes,
    options: OffloadOptions,
    *,
    host_bytes_available: int | None = None,
    disabled_reason: str = "",
) -> OffloadPlan:
    """Decide every saved tensor of one graph pair.

    ``host_bytes_available`` is what is left of ``host_budget`` after the graphs planned before this
    one (None: unbounded). ``disabled_reason`` turns offloading off for the whole graph.
    """
    saved = lifetimes.saved
    if options.policy == "none":
        return OffloadPlan(tuple(Decision(t, KEEP, "policy='none'") for t in saved), "none")
    if disabled_reason:
        decisions = tuple(Decision(t, KEEP, disabled_reason) for t in saved)
        return OffloadPlan(decisions, options.policy, disabled_reason)
    if not options.offload_cpu and all(d in ("cpu", "meta") for d in lifetimes.devices):
        note = "no accelerator tensors in this graph; compiled unchanged (offload_cpu=False)"
        return OffloadPlan(tuple(Decision(t, KEEP, note) for t in saved), options.policy, note)

    reasons: dict[str, str] = {}
    wanted: list[SavedTensor] = []
    window = max(1, options.prefetch)
    for t in saved:
        reason = ineligible_reason(t, options)
        if reason is None and options.policy == "auto" and (
            t.fw_compute_after < window or t.bw_compute_before < window
        ):
            reason = (
                f"needed again too soon to hide the copies: {t.fw_compute_after} compute nodes "
                f"after its last forward use, {t.bw_compute_before} before its first backward use "
                f"(policy='auto' wants >= {window} on each side)"
            )
        if reason is None:
            wanted.append(t)
        else:
            reasons[t.name] = reason

    # Largest first under the host budget: the most device memory per host byte is the same for
    # every tensor, but fewer, larger copies use the link better.
    used = 0
    chosen: set[str] = set()
    for t in sorted(wanted, key=lambda t: (-t.nbytes, t.output_index)):
        if host_bytes_available is not None and used + t.nbytes > host_bytes_available:
            reasons[t.name] = (
                f"host_budget reached: {fmt_bytes(used)} of the {fmt_bytes(host_bytes_available)} "
                "left are taken by larger tensors"
            )
            continue
        used += t.nbytes
        chosen.add(t.name)
        reasons[t.name] = (
            f"idle for {t.idle_compute_nodes} compute nodes "
            f"({t.fw_compute_after} forward + {t.bw_compute_before} backward)"
        )

    decisions = tuple(
        Decision(t, OFFLOAD if t.name in chosen else KEEP, reasons[t.name])
        for t in saved
    )
    return OffloadPlan(decisions, options.policy)
