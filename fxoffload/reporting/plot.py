"""The picture of a report: device memory over the step, by kind, with the peak and the copies marked."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

from ..analysis.memory import CATEGORIES, MemoryTimeline
from ..measure.allocator import DeviceMemory, MeasuredMemory
from ..sizes import fmt_bytes
from .render import KIND_NAMES

if TYPE_CHECKING:
    from .report import OffloadReport

__all__ = ["plot"]


def plot(report: OffloadReport, path: str, measured: Any = None) -> str:
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
    level = _measured_level(report, measured)  # bad input fails before matplotlib is asked for
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(13, 5))
    mib = 2**20
    after = report.memory_after if report.memory_after and report.memory_after.points else None
    before = report.memory_before if report.memory_before and report.memory_before.points else None
    if before is not None:
        ax.step(_original_positions(before), [p.total / mib for p in before.points], where="post",
                color="tab:gray", lw=1.5,
                label=f"without fxoffload, total (peak {fmt_bytes(before.peak_bytes)})")  # fmt: skip
    if after is not None:
        xs = _original_positions(after)
        bottom = [0.0] * len(xs)
        colors = {"parameters": "#9ecae1", "inputs": "#c6dbef", "gradients": "#fdae6b", "saved": "#74c476",
                  "transient": "#bcbddc", "outside": "#d9d9d9"}  # fmt: skip
        kinds = report.device_kinds("after")
        for kind in CATEGORIES:
            values = [k[kind] / mib for k in kinds]
            if not any(values):
                continue
            top = [b + v for b, v in zip(bottom, values)]
            ax.fill_between(xs, bottom, top, step="post", color=colors.get(kind), lw=0,
                            label=f"with fxoffload: {KIND_NAMES.get(kind, kind)}")  # fmt: skip
            bottom = top
        totals = [p.total / mib for p in after.points]
        ax.step(xs, totals, where="post", color="tab:blue", lw=1,
                label=f"with fxoffload, total (peak {fmt_bytes(after.peak_bytes)})")  # fmt: skip
        host = report.host_in_flight("after") or []
        if any(host):
            ax.step(xs, [h / mib for h in host], where="post", color="tab:brown", ls="--", lw=1.2,
                    label="host copies in flight (host memory, not stacked)")  # fmt: skip
        for name, marker, color in (("offload", "v", "tab:orange"), ("reload", "^", "tab:green")):
            marks = [i for i, p in enumerate(after.points) if p.node.startswith(f"{name}_default")]
            if marks:
                ax.scatter([xs[i] for i in marks], [totals[i] for i in marks], marker=marker, color=color,
                           s=18, zorder=3, label=name)  # fmt: skip
        peak = report.peak_breakdown("after")
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
    compiled = report.compiled_memory()
    if compiled is not None and compiled.points:
        ax.axhline(compiled.peak_bytes / mib, color="tab:purple", ls=":", lw=1.2,
                   label=f"peak of Inductor's generated code {fmt_bytes(compiled.peak_bytes)}")  # fmt: skip
    if level is not None:
        value, label = level
        ax.axhline(value / mib, color="black", ls="-.", lw=1.2, label=label)
    ax.set_xlabel("graph node (forward, then backward)")
    ax.set_ylabel("live device memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"fxoffload graph {report.graph_id}: {len(report.offloaded)} of {len(report.saved)} saved tensors offloaded")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)  # beside the curves, not on them
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


_INSERTED = ("offload_default", "reload_default", "wait_default")


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


def _measured_level(report: OffloadReport, measured: Any) -> tuple[int, str] | None:
    """The level (bytes) and legend of a measured peak given to ``plot``."""
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
