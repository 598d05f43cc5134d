"""Peak memory against step time, one point per method and budget, as a PNG.

On a GPU the y axis is the measured peak allocated memory. On a CPU nothing measures device memory:
the points are fxoffload's rows at the peak its memory model predicts, and the dashed line is the
prediction without offloading; the title says so.
"""

from __future__ import annotations

from typing import Any


def plot(rows: list[dict[str, Any]], conditions: dict[str, Any], path: str) -> str | None:
    """Write the picture to ``path``; returns None, or the reason no picture was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no PNG written"
    gpu = conditions.get("gpu", False)
    key = "peak_alloc_MiB" if gpu else "predicted_after_MiB"
    points = [r for r in rows if r.get("status") == "ok" and r.get(key) is not None and r.get("step_ms")]
    if not points:
        return f"no measured row has both a step time and {key}; no PNG written"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(points):  # labels staggered in height: points often share a peak
        ax.scatter(
            r["step_ms"],
            r[key],
            s=30,
            color="tab:blue" if r["method"].startswith("fxoffload") else "tab:gray",
        )
        ax.annotate(
            r["method"],
            (r["step_ms"], r[key]),
            textcoords="offset points",
            xytext=(4, 4 + 10 * (i % 3)),
            fontsize=8,
        )
    if not gpu:
        before = max((r.get("predicted_before_MiB") or 0) for r in points)
        if before:
            ax.axhline(before, color="tab:gray", linestyle="--", linewidth=1)
            ax.annotate(
                "predicted peak without offloading",
                (ax.get_xlim()[0], before),
                fontsize=8,
                textcoords="offset points",
                xytext=(4, -10),
            )
    ax.set_xlabel("median step time (ms)" + ("" if gpu else ", CPU"))
    ax.set_ylabel("peak allocated (MiB)" if gpu else "predicted peak device memory (MiB)")
    what = (
        "measured on " + conditions.get("device", "?")
        if gpu
        else "CPU only: memory is fxoffload's prediction"
    )
    ax.set_title(f"{conditions.get('workload')} {conditions.get('preset')}: {what}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
