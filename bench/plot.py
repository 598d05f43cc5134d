"""Step time against measured peak memory, as a PNG: the Pareto picture of the run.

One point per method; the swept methods (fxoffload's budgets, its recompute mode, Inductor's
activation memory budget) are one line each through their budgets, so each draws its own trade-off
curve, and the points no other point beats on both axes (the Pareto front) are circled. The y axis is
the measured peak: on a GPU the peak allocated memory over the timed steps, on a CPU the allocator's
peak of one extra step above what was live at its start (fxoffload's host buffers left out); the
title says which.
"""

from __future__ import annotations

from typing import Any

from .methods import SWEPT

COLORS = {
    "fxoffload": "tab:blue", "inductor-amb": "tab:orange", "checkpoint": "tab:green", "checkpoint-compiled": "tab:olive",
}


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points that no other point beats or ties on both coordinates with one better."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((a <= x and b <= y) and (a < x or b < y) for j, (a, b) in enumerate(points) if j != i):
            front.append(i)
    return front


def plot(rows: list[dict[str, Any]], conditions: dict[str, Any], path: str) -> str | None:
    """Write the picture to ``path``; returns None, or the reason no picture was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no PNG written"
    gpu = conditions.get("gpu", False)
    key = "peak_alloc_MiB" if gpu else "measured_peak_MiB"
    points = [r for r in rows if r.get("status") == "ok" and r.get(key) is not None and r.get("step_ms")]
    if not points:
        return f"no measured row has both a step time and {key}; no PNG written"
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for kind in SWEPT:  # one line per swept method, in budget order
        line = sorted((r for r in points if r["method"].split("=")[0] == kind), key=lambda r: r[key])
        if len(line) > 1:
            ax.plot([r["step_ms"] for r in line], [r[key] for r in line], color=_color(kind), linewidth=1,
                    label=kind)  # fmt: skip
    for i, r in enumerate(points):  # labels staggered in height: points often share a peak
        ax.scatter(r["step_ms"], r[key], s=30, color=_color(r["method"]))
        ax.annotate(r["method"], (r["step_ms"], r[key]), textcoords="offset points", xytext=(4, 4 + 10 * (i % 3)),
                    fontsize=8)  # fmt: skip
    front = pareto([(r["step_ms"], r[key]) for r in points])
    ax.scatter([points[i]["step_ms"] for i in front], [points[i][key] for i in front], s=120,
               facecolors="none", edgecolors="black", linewidths=1, label="Pareto front")  # fmt: skip
    ax.set_xlabel("median step time (ms)" + ("" if gpu else ", CPU"))
    ax.set_ylabel("peak allocated (MiB)" if gpu else "measured peak above the step's start (MiB), CPU")
    what = "measured on " + conditions.get("device", "?") if gpu else "CPU only, CPU allocator"
    ax.set_title(f"{conditions.get('workload')} {conditions.get('preset')}: {what}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _color(method: str) -> str:
    kind = method.split("=")[0]
    if kind.startswith("fxoffload"):
        return "tab:purple" if kind == "fxoffload-recompute" else COLORS["fxoffload"]
    return COLORS.get(kind, "tab:gray")
