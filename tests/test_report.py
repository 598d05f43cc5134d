"""Reports: predicted memory before/after, summary, timeline data and the JSON round trip."""

import dataclasses

import pytest
import torch

from fxoffload.testing.models import GPT, GPTConfig, gpt_batch
from fxoffload.reporting.report import OffloadReport

from .conftest import cpu_backend, routed_tokens, train_step


@pytest.fixture(scope="module")
def gpt_report():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig()
    backend = cpu_backend(inner="aot_eager", min_bytes="16KiB")
    train_step(GPT(cfg), gpt_batch(cfg, 8), backend)
    (report,) = backend.reports
    return report


def test_offloading_lowers_the_predicted_peak(gpt_report):
    before, after = gpt_report.predicted_peak_before, gpt_report.predicted_peak_after
    assert before > 0
    # Saved views are hoisted next to their base, so bases are released early: well under half.
    assert after < 0.5 * before, gpt_report.summary()


def test_between_phases_saved_bytes_drop_by_exactly_the_offloaded_bytes(gpt_report):
    def end_of_forward(timeline):
        return [p for p in timeline.points if p.phase == "forward"][-1]

    before = end_of_forward(gpt_report.memory_before).live["saved"]
    after = end_of_forward(gpt_report.memory_after).live["saved"]
    assert before - after == gpt_report.offloaded_bytes > 0


def test_summary_and_timeline(gpt_report):
    text = gpt_report.summary()
    assert "predicted peak without fxoffload" in text and "predicted peak with fxoffload" in text
    assert "saved" in text and "parameters" in text and "host_budget: unbounded" in text
    rows = gpt_report.timeline()
    assert {r["graph"] for r in rows} == {"before", "after"}
    assert {r["phase"] for r in rows} == {"forward", "backward"}
    before = [r for r in rows if r["graph"] == "before"]
    assert max(r["total"] for r in before) == gpt_report.predicted_peak_before
    assert all(r["total"] == r["parameters"] + r["inputs"] + r["saved"] + r["transient"] + r["gradients"] for r in rows)


def test_a_plan_that_raises_the_predicted_peak_is_said_to(gpt_report):
    """A new user's summary showed the peak with fxoffload above the one without, and said nothing."""
    assert "above the peak without" not in gpt_report.summary()
    points = gpt_report.memory_before.points
    top = max(range(len(points)), key=lambda i: points[i].total)
    raised = [
        dataclasses.replace(p, live={**p.live, "transient": p.live.get("transient", 0) + (2 << 20) * (i == top)})
        for i, p in enumerate(points)
    ]  # fmt: skip
    report = dataclasses.replace(gpt_report, memory_after=dataclasses.replace(gpt_report.memory_before, points=tuple(raised)))
    assert "above the peak without, by 2.0 MiB" in report.summary(), report.summary()


def test_a_row_without_a_module_names_its_op_apart(gpt_report):
    """A new user read ``mm`` in the module column of the LM head's matmul, as if a module were named so."""
    first = gpt_report.offloaded[0]
    rows = tuple(dataclasses.replace(r, module_path="") if r is first else r for r in gpt_report.saved)
    text = dataclasses.replace(gpt_report, saved=rows).table(rows="short", width=200)
    (line,) = [line for line in text.splitlines() if line.split() and line.split()[0] == first.name]
    assert f"({first.producer})" in line and "module (op)" in text, text


def test_a_budget_met_within_its_tolerance_says_by_how_much(gpt_report):
    """A new user read ``memory_budget: 502.8 KiB (met)`` under a code peak of 511.8 KiB."""
    peak = gpt_report.predicted_peak_after

    def said(budget):
        text = dataclasses.replace(gpt_report, memory_budget=budget).summary()
        return next(line for line in text.splitlines() if "memory_budget:" in line)

    assert said(peak).endswith("(met)")
    assert "(met: 10.0 KiB above it, within its 3% tolerance)" in said(peak - 10 * 1024)
    assert said(int(peak / 1.05)).endswith("(NOT met)")


def test_json_round_trip(gpt_report):
    again = OffloadReport.from_json(gpt_report.to_json())
    assert again == gpt_report
    assert [s.what for s in again.timings.spent] == ["the plan (aot_eager)"]  # where its compile went, typed
    assert again.table() == gpt_report.table() and again.summary() == gpt_report.summary()


def test_json_carries_reason_codes_and_typed_decisions(gpt_report):
    import json

    from fxoffload.reasons import Action, ReasonCode

    rows = json.loads(gpt_report.to_json())["saved"]
    assert {r["decision"] for r in rows} <= {"offload", "keep", "recompute"}  # the strings, as before
    codes = {r["reason_code"] for r in rows}
    assert codes <= {c.value for c in ReasonCode} and {"static_input", "graph_input"} <= codes, codes
    assert all(r["reason"] and r["reason_code"] for r in rows)
    assert {r["module_path"] for r in rows} >= {"blocks.0.fc", "blocks.1.qkv"}
    again = OffloadReport.from_json(gpt_report.to_json())
    assert all(isinstance(r.decision, Action) for r in again.saved)
    # JSON written before reason codes existed still loads, with empty codes.
    for r in rows:
        for key in ("reason_code", "module_path", "recompute_refused", "recompute_refused_code"):
            del r[key]
    old = json.loads(gpt_report.to_json())
    old["saved"] = rows
    assert [r.reason_code for r in OffloadReport.from_json(json.dumps(old)).saved] == [""] * len(rows)


def test_text_for_no_terminal_is_not_cut_to_80_columns(gpt_report, monkeypatch):
    """A table written to a pipe, a file or a CI log (no terminal, no ``COLUMNS``) is laid out for
    ``UNBOUND_WIDTH`` columns: the terminal's default 80 cut each reason to a few words."""
    import os

    from fxoffload.reporting import render

    def no_terminal(*args):
        raise OSError("not a terminal")

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    assert render.text_width() == render.UNBOUND_WIDTH == 160
    assert gpt_report.table(rows="short") == gpt_report.table(rows="short", width=160)
    monkeypatch.setenv("COLUMNS", "100")  # a width asked for wins
    assert render.text_width() == 100


def test_short_table_fits_the_width_and_lists_every_offloaded_tensor(gpt_report):
    text = gpt_report.table(rows="short", width=110, kept=3)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 110, text
    names = {line.split()[0] for line in lines if line.strip()}
    assert {r.name for r in gpt_report.offloaded} <= names
    assert f"offloaded: {len(gpt_report.offloaded)} tensors" in text
    # Kept activations: the 3 largest, then a count of the rest by reason code.
    kept = sorted((r for r in gpt_report.saved if r.decision == "keep" and r.producer != "placeholder"),
                  key=lambda r: -r.nbytes)  # fmt: skip
    assert {r.name for r in kept[:3]} <= names and not {r.name for r in kept[3:]} & names
    assert f"... and {len(kept) - 3} more kept" in text and "(codes: min_bytes" in text
    # Parameters and graph inputs: one line, no rows.
    placeholders = [r for r in gpt_report.saved if r.producer == "placeholder"]
    assert f"parameters, buffers and graph inputs: {len(placeholders)} kept" in text
    assert not {r.name for r in placeholders} & names
    # The full table keeps a row per saved tensor.
    full = gpt_report.table(rows="all", width=110).splitlines()
    assert {r.name for r in gpt_report.saved} <= {line.split()[0] for line in full if line.strip()}


def test_short_table_says_a_graph_wide_note_once_and_no_stall_when_nothing_is_planned():
    import fxoffload
    from fxoffload.testing.models import example

    model, args = example("mlp")
    (report,) = fxoffload.explain(model, *args, inner="aot_eager")  # CPU tensors, offload_cpu=False
    text = report.table(rows="short", width=110)
    assert text.count("no accelerator tensors") == 1 and "[no_accelerator]" in text, text
    assert "reason" not in text.splitlines()[2]  # the column names: no reason column repeating the note
    assert "predicted stall" not in report.summary()


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(rows="most"), "rows must be 'all' or 'short'"), (dict(width=10), "width must be an int >= 40"),
     (dict(rows="short", kept=-1), "kept must be an int >= 0")],
)  # fmt: skip
def test_table_bad_arguments(gpt_report, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpt_report.table(**kwargs)


def test_sizes_that_depend_on_the_data_are_estimated_within_their_bounds_and_marked():
    """A ``torch.where`` count is known only when the graph runs: torch proves it at most the mask's
    256 elements, so it is planned at 256, not at Inductor's blind 8192 (32x the bytes, the copy
    times and the windows), and the tables mark it as an estimate."""
    model, args, settings = routed_tokens()
    backend = cpu_backend(inner="aot_eager")
    with settings:
        train_step(model, args, backend)
    (report,) = backend.reports
    routed = [r for r in report.saved if r.data_dependent_dims]
    assert routed and all(r.data_dependent_dims == (0,) and r.shape[0] == 256 for r in routed), report.table()
    gelu = next(r for r in routed if r.producer == "gelu")
    assert gelu.nbytes == 256 * 64 * 4
    for table in (report.table(), report.table(rows="short")):
        assert "256?x64" in table and "a size marked ? depends on the data" in table
    assert OffloadReport.from_json(report.to_json()).saved == report.saved
