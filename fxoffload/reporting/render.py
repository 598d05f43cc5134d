"""The text of a report: the table of saved tensors and decisions, and the summary."""

from __future__ import annotations

import collections
import shutil
import textwrap
from typing import TYPE_CHECKING

from tabulate import tabulate

from .._compat import UNBACKED_FALLBACK
from ..planning.budget import BUDGET_TOLERANCE
from ..planning.measured import host_bound
from ..reasons import Action
from ..sizes import fmt_bytes

if TYPE_CHECKING:
    from .report import OffloadReport

__all__ = ["KIND_NAMES", "UNBOUND_WIDTH", "kinds_text", "summary", "table", "text_width"]

# How a breakdown names the kinds of memory; "host" is host memory and not part of the device total.
KIND_NAMES = {
    "saved": "saved activations", "transient": "transients", "host": "host copies in flight",
    "outside": "held by code before this graph",
}  # fmt: skip
# The device kinds a breakdown shows, in this order ("host", host memory, comes apart).
_DEVICE_KINDS = ("parameters", "inputs", "gradients", "saved", "transient", "outside")


def kinds_text(device: dict[str, int], host: int | None) -> str:
    """``parameters 6.3 KiB, ..., transients 16.0 KiB; host copies in flight 8.0 KiB (host memory)``."""
    text = ", ".join(f"{KIND_NAMES.get(k, k)} {fmt_bytes(device.get(k, 0))}" for k in _DEVICE_KINDS if device.get(k))
    if host:
        text += f"; {KIND_NAMES['host']} {fmt_bytes(host)} (host memory)"
    return text


# Columns for text that goes to no terminal (a pipe, a file, a CI log) and no COLUMNS: a terminal's
# default 80 cut every reason short to a few words, where a log is read wide.
UNBOUND_WIDTH = 160


def text_width() -> int:
    """Columns of text for stdout: ``COLUMNS``, else the terminal's, else ``UNBOUND_WIDTH``."""
    return shutil.get_terminal_size(fallback=(UNBOUND_WIDTH, 24)).columns


def table(report: OffloadReport, rows: str = "all", width: int | None = None, kept: int = 5) -> str:
    """The saved tensors, their decisions and the reasons, as a text table.

    ``rows="all"``: one row per saved tensor with every column (copy times, compute windows, first
    and last uses). ``rows="short"``: what a person reads first: the offloaded and recomputed
    tensors, the ``kept`` largest kept ones, a count of the rest by reason code, parameters and
    graph inputs in one line, and a reason shared by every row said once above the table.
    ``width``: columns to fit (None: ``text_width``); the reason column is wrapped ("all") or cut
    short ("short") to fit.
    """
    if rows not in ("all", "short"):
        raise ValueError(f"fxoffload: table(rows={rows!r}): rows must be 'all' or 'short'")
    if isinstance(kept, bool) or not isinstance(kept, int) or kept < 0:
        raise ValueError(f"fxoffload: table(kept={kept!r}): kept must be an int >= 0 (rows shown)")
    width = text_width() if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 40:
        raise ValueError(f"fxoffload: table(width={width!r}): width must be an int >= 40 (columns)")
    header = (
        f"graph {report.graph_id}: policy={report.policy!r}, {len(report.offloaded)} of "
        f"{len(report.saved)} saved tensors offloaded, {fmt_bytes(report.offloaded_bytes)} of "
        f"{fmt_bytes(report.saved_bytes)}"
    )
    if report.recomputed:
        header += f", {len(report.recomputed)} recomputed"
    budget = "unbounded" if report.host_budget is None else fmt_bytes(report.host_budget)
    host = f"host memory: {fmt_bytes(report.host_bytes_total)} planned by this backend "
    host += f"(host_budget: {budget})"
    if rows == "short":
        return _short_table(report, header, host, width, kept)
    header += f"\n{host}"
    if report.note:
        header += f"\n{report.note}"
    if any(r.data_dependent_dims for r in report.saved):
        header += "\n" + "\n".join(textwrap.wrap(DATA_DEPENDENT, width))
    body = [
        (r.name, r.shape_text, r.dtype, f"{r.nbytes / 2**20:.3f}",
         r.producer, r.fw_last_use, r.bw_first_use or "-", r.idle_compute_nodes,
         f"recompute {r.recompute_ms:.3f}" if r.decision == Action.RECOMPUTE
         else f"{r.d2h_ms:.3f}/{r.h2d_ms:.3f}", f"{r.fw_window_ms:.3f}/{r.bw_window_ms:.3f}", r.decision,
         f"[{r.reason_code}] {r.reason}" if r.reason_code else r.reason)
        for r in report.saved
    ]  # fmt: skip
    headers = ("saved tensor", "shape", "dtype", "MiB", "producer", "fw last use", "bw first use",
               "idle nodes", "copy ms out/in", "window ms fw/bw", "decision", "reason")  # fmt: skip
    if any(r.measured_stall_ms is not None for r in report.saved):  # the device's figures beside the model's
        body = [(*b[:10], _measured(r), *b[10:]) for b, r in zip(body, report.saved)]
        headers = (*headers[:10], "measured copy ms out/in, stall pred/meas", *headers[10:])
    # The reason column takes what the others leave of the width, never less than 40 columns.
    others = _table_width([r[:-1] for r in body], headers[:-1])
    reason_width = max(40, width - others - 2)
    widths = [None] * (len(headers) - 1) + [reason_width]
    return f"{header}\n{tabulate(body, headers=headers, maxcolwidths=widths)}"


# Said once above a table with a size that depends on the data (``SavedRow.shape_text``).
DATA_DEPENDENT = (
    "a size marked ? depends on the data: it, and the bytes and copy times of its tensor, are torch's "
    f"estimate ({UNBACKED_FALLBACK}, held within the range torch proved for it), not a measured size"
)


def _measured(r) -> str:
    """``0.512/0.498, 0.000/0.031``: what the device measured of a row's copies, beside the plan's stall."""
    if r.measured_stall_ms is None:
        return ""
    out = "/".join("-" if v is None else f"{v:.3f}" for v in (r.measured_d2h_ms, r.measured_h2d_ms))
    return f"{out}, {r.stall_ms:.3f}/{r.measured_stall_ms:.3f}"


def _short_table(report: OffloadReport, header: str, host: str, width: int, kept: int) -> str:
    lines = [header]
    if report.offloaded or report.host_budget is not None:
        lines.append(host)
    # A reason every row shares (a graph left unchanged, policy="none") is said once, not per row.
    reasons = {(r.reason_code, r.reason) for r in report.saved}
    shared = len(reasons) == 1 and len(report.saved) > 1
    if report.note or shared:
        code, text = next(iter(reasons)) if shared else ("", report.note)
        note = f"note: {text}" + (f" [{code}]" if shared and code else "")
        lines.extend(textwrap.wrap(note, width, subsequent_indent="  "))
    if any(r.data_dependent_dims for r in report.saved):
        lines.extend(textwrap.wrap(DATA_DEPENDENT, width))
    # Parameters, buffers and graph inputs (placeholders) stay whatever the policy: one line for all.
    inputs = [r for r in report.saved if r.producer == "placeholder" and r.decision == Action.KEEP]
    groups = [(f"offloaded: {_count(report.offloaded)}", report.offloaded)]
    if report.recomputed:
        groups.append((f"recomputed: {_count(report.recomputed)}", report.recomputed))
    rest = sorted(
        (r for r in report.saved if r.decision == Action.KEEP and r.producer != "placeholder"),
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
        (r.name, r.shape_text, r.dtype, fmt_bytes(r.nbytes),
         r.module_path or f"({r.producer})",  # no module: the op that made it, said apart
         f"{r.recompute_ms:.3f} compute" if r.decision == Action.RECOMPUTE
         else f"{r.d2h_ms:.3f}/{r.h2d_ms:.3f}" if r.decision == Action.OFFLOAD else "",
         "" if shared else r.reason if id(r) in titled or not r.reason_code
         else f"{r.reason_code}: {r.reason}")
        for _, group in groups for r in group
    ]  # fmt: skip
    headers = ("saved tensor", "shape", "dtype", "size", "module (op)", "copy ms", "reason")
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


def _predicted_peaks(report: OffloadReport) -> list[str]:
    """The FX model's peaks without and with fxoffload, and a word where the second is higher."""
    lines, peaks = [], {}
    for label, which in (("without fxoffload", "before"), ("with fxoffload", "after")):
        peak = peaks[which] = report.peak_breakdown(which)
        if peak is not None:
            lines.append(
                f"  predicted peak {label}: {fmt_bytes(peak.total)} at {peak.phase} node {peak.node} ({peak.kinds()})"
            )
    if peaks["before"] is not None and peaks["after"] is not None and peaks["after"].total > peaks["before"].total:
        lines.append(
            f"    above the peak without, by {fmt_bytes(peaks['after'].total - peaks['before'].total)}: there the "
            "reloads' buffers and what the copies hold outweigh what the offloads free (code run between this "
            "graph's forward and its backward, such as a loss computed outside it, holds less, which this graph "
            "does not see)"
        )
    return lines


def summary(report: OffloadReport) -> str:
    """Predicted peak before and after, where it is and what is live there by kind, the peak of
    Inductor's code when replayed, bytes offloaded and host memory."""
    lines = [f"graph {report.graph_id} (policy={report.policy!r})", *_predicted_peaks(report)]
    if report.switched_off:
        off = set(report.switched_off)
        rows = [r for r in report.saved if r.name in off]
        why = {"measured_stall": "stalled", "unkept_source": "read a buffer Inductor does not keep alive"}
        whys = collections.Counter(why.get(r.reason_code, r.reason_code) for r in rows)
        lines.append(
            f"  switched off at run time: the copies of {len(report.switched_off)} tensors "
            f"({fmt_bytes(sum(r.nbytes for r in rows))}; {', '.join(f'{n} {w}' for w, n in sorted(whys.items()))}); "
            "they stay on the device, from their offload to their reload, as the peak with fxoffload above counts them"
        )
    if report.outside is not None and report.outside.held_bytes:
        lines.append(f"  held through it: {report.outside.summary()}")
    compiled = report.compiled_memory()
    if compiled is not None and compiled.points:
        peak = report.peak_breakdown("compiled")
        node = _cut(peak.node, 72)
        lines.append(f"  peak of Inductor's generated code: {fmt_bytes(peak.total)} at {node} ({peak.kinds()})")
    if report.unchanged_code_peak is not None:
        lines.append(
            f"  peak of Inductor's code without offloading: {fmt_bytes(report.unchanged_code_peak)} (lowered for its "
            "code alone, replayed)"
        )
    if report.memory_budget is not None:
        expected = compiled if compiled is not None and compiled.points else report.memory_after
        reached = expected.peak_bytes if expected is not None else 0
        fits = "met" if reached <= report.memory_budget * (1 + BUDGET_TOLERANCE) else "NOT met"
        if fits == "met" and reached > report.memory_budget:
            fits = f"met: {fmt_bytes(reached - report.memory_budget)} above it, within its {BUDGET_TOLERANCE:.0%} tolerance"
        of = f", {report.memory_budget / report.unchanged_code_peak:.0%} of that" if report.unchanged_code_peak else ""
        lines.append(f"  memory_budget: {fmt_bytes(report.memory_budget)}{of} ({fits})")
    lines.extend(f"  planned again: {r}" for r in report.replans)
    if report.left_as_planned:
        lines.append(f"  not planned again: {report.left_as_planned}")
    if report.timings is not None and report.timings.spent:
        lines.append(f"  compiled: {report.timings.spent_text()}")
    if report.device and report.offloaded:  # no stall to predict where nothing is copied
        lines.append(f"  predicted stall: {report.predicted_stall_ms:.3f} ms per step ({report.device})")
        if report.predicted_op_ms:
            lines.append(
                f"  predicted op calls: {report.predicted_op_ms:.3f} ms of the compute stream per step, of "
                f"{report.predicted_compute_ms:.3f} ms predicted compute"
            )
    if report.measured_stall_ms is not None:
        lines.append(
            f"  measured in a step: forward {report.measured_forward_ms or 0:.3f} ms"
            + (f" (the host's call {host:.3f} ms)" if (host := report.measured_forward_host_ms) is not None else "")
            + f", the compute stream waited {report.measured_stall_ms:.3f} ms for copies"
        )
    ratios = (report.measured_host_ratio_fw, report.measured_host_ratio_bw)
    if any(r is not None for r in ratios):
        fw, bw = (f"{r:.2f}x" if r is not None else "-" for r in ratios)
        bound = " and ".join(p for p, r in zip(("forward", "backward"), ratios) if host_bound(r))
        lines.append(
            f"  the copies' windows took the device {fw} / {bw} the host's time to issue them (forward / backward)"
            + (f": the host bound the {bound}, where the op calls' host time is step time" if bound else "")
        )
    if report.offload_bound_bytes is not None:
        lines.append(
            f"  offloaded {fmt_bytes(report.offloaded_bytes)} of the at most {fmt_bytes(report.offload_bound_bytes)} "
            "that can leave without a stall (a bound: the measured link times one call's forward compute, "
            "whatever each tensor's window)"
        )
    lines.append(
        f"  offloaded: {len(report.offloaded)} of {len(report.saved)} saved tensors, "
        f"{fmt_bytes(report.offloaded_bytes)} of {fmt_bytes(report.saved_bytes)}"
    )
    if report.recomputed:
        lines.append(
            f"  recomputed: {len(report.recomputed)} tensors, {fmt_bytes(sum(r.nbytes for r in report.recomputed))}, "
            f"predicted {report.predicted_recompute_ms:.3f} ms of extra backward compute"
        )
    budget = "unbounded" if report.host_budget is None else fmt_bytes(report.host_budget)
    lines.append(f"  host memory planned by this backend: {fmt_bytes(report.host_bytes_total)} (host_budget: {budget})")
    if report.note:
        lines.append(f"  note: {report.note}")
    return "\n".join(lines)


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
