"""Ground truth from this project's own H100 runs (``tests/data/h100-2026-11-26``, README there):
what the watch measured with CUDA events at the copies' waits, checked against the device's own
trace of a later step of the same code, with no GPU here."""

import bisect
import gzip
import json
import statistics
from pathlib import Path

import pytest

from fxoffload.measure.trace import copy_stalls, host_bound_share, load_trace, overlap_share

DATA = Path(__file__).parent / "data" / "h100-2026-11-26"


def _auto(run: str) -> tuple[dict, object]:
    rows = json.loads(gzip.open(DATA / f"{run}_bench.json.gz").read())["rows"]
    (row,) = [r for r in rows if r["method"] == "fxoffload-auto"]
    trace = load_trace(json.loads(gzip.open(DATA / f"{run}_auto_trace.json.gz").read()))
    return row, trace


@pytest.mark.parametrize("run", ["gpt2m", "llama7b"])
def test_the_stall_the_watch_measured_is_the_one_the_device_trace_shows(run):
    """The compute stream's gaps that end as a copy ends (``trace.copy_stalls``), in the profiled
    step, against the stall the watch's events measured at the copies' waits in a step of the same
    plan (``measured_stall_ms``): within 15% (gpt2-medium 5.16 ms against 4.57, Llama-7B blocks 1.19
    against 1.21). The gaps ending within 5 us of a copy, a tolerance too tight for the wait's event
    and the next launch, miss most of them."""
    row, trace = _auto(run)
    stalls = copy_stalls(trace.gpu)
    assert sum(stalls.values()) == pytest.approx(row["measured_stall_ms"], rel=0.15), (stalls, row["measured_stall_ms"])
    tight = copy_stalls(trace.gpu, within_us=5.0)
    assert sum(tight.values()) < 0.5 * row["measured_stall_ms"], tight


def test_the_copies_are_the_plans_and_their_overlap_is_the_rows():
    """The trace holds each offloaded tensor's two copies and the bytes the row says; the share of
    the copies' time a kernel ran beside them is the row's (63% out, 66% in on gpt2-medium: short of
    the 90% issue 23 asks)."""
    row, trace = _auto("gpt2m")
    copies = [g for g in trace.gpu if g.direction in ("DtoH", "HtoD")]
    assert len(copies) == 2 * 37  # 37 saved tensors offloaded by the last plan
    for direction, key in (("DtoH", "dtoh_overlap"), ("HtoD", "htod_overlap")):
        total_ms, _, share = overlap_share(trace.gpu, direction)
        assert share == pytest.approx(row[key], abs=1e-9) and share < 0.9
        assert total_ms == pytest.approx(row[key.replace("overlap", "ms")], rel=1e-6)



def test_gpt2_mediums_forward_kept_the_h100_waiting_on_its_host_and_llamas_did_not():
    """Before its first reload (the forward), most of gpt2-medium's kernels started within 50 us of
    their launch: the device waited on the host (Inductor's wrapper issued a kernel every 31 us),
    so each offload's op calls were step time there; Llama-7B blocks'
    host ran milliseconds ahead. Each offload widened the launch interval its copy was issued in by
    a median 119 us. The runtime's own measure of it is each copy's host window
    against its device window (``planning.measured.HOST_BOUND``); this is the trace's."""
    shares = {}
    for run in ("gpt2m", "llama7b"):
        _, trace = _auto(run)
        first_reload = min(g.start_us for g in trace.gpu if g.direction == "HtoD")
        forward = [g for g in trace.gpu if g.start_us < first_reload]
        shares[run] = host_bound_share(trace, forward)
    assert shares["gpt2m"] > 0.5 and shares["llama7b"] < 0.05, shares
    _, trace = _auto("gpt2m")
    launches = sorted(trace.launch_time(g) for g in trace.gpu if g.cat == "kernel")
    forward = [b - a for a, b in zip(launches, launches[1:]) if b < launches[0] + 17_000]
    usual = statistics.median(forward)
    assert 20 < usual < 45, "Inductor's wrapper: a kernel every 31-34 us"
    # The launch interval each offload's copy was issued in, past the usual one: its host time.
    extra = []
    for copy in (trace.launch_time(g) for g in trace.gpu if g.direction == "DtoH"):
        i = bisect.bisect_left(launches, copy)
        extra.append(launches[i] - launches[i - 1] - usual)
    assert len(extra) == 37 and 60 < statistics.median(extra) < 200, extra  # 119 us
