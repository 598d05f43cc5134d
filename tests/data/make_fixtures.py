"""Cut the fixtures of tests/test_kernel_times.py from the H100 ground truth (/work/shared/gpu).

    python tests/data/make_fixtures.py /work/shared/gpu

For each run (inductor, auto, all): ``trace_<run>.json.gz`` keeps the GPU events (kernels, memsets,
memcpys: name, ts, dur, stream, correlation, bytes), the runtime/driver calls that launched them
(name, ts, dur, correlation), and of the CPU ops only the ones that enclose a launch, the graph-call
ranges with what encloses them, and the direct children of the graph calls (``fxoffload::wait`` ...
launch nothing but help the alignment); every other event (flows, metadata, ops launching nothing) is
dropped. The traces each hold one training step. For auto and all, ``report_<run>.json.gz`` keeps
from fxoffload's report: the wrapper code Inductor generated (``output_code``, only its ``call``
function and the line before it), the rewritten FX code's lines that name our ops and its return
(enough for ``output_code.transfers`` to key copies), ``host_copies`` and the saved rows' names,
decisions, sizes and predicted times.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
GPU = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH = ("cuda_runtime", "cuda_driver")
CPU = ("cpu_op", "user_annotation", "python_function")


def _write(path: Path, data) -> None:
    raw = json.dumps(data, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(raw, 9, mtime=0))
    print(f"{path.name}: {path.stat().st_size / 1024:.1f} KiB")


def cut_trace(src: Path, dst: Path) -> None:
    with gzip.open(src) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU]
    corr = {e["args"]["correlation"] for e in gpu if "correlation" in e.get("args", {})}
    launches = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH and e.get("args", {}).get("correlation") in corr
    ]
    cpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in CPU),
        key=lambda e: (e["ts"], -e.get("dur", 0)),
    )
    # forest per thread, as measure.trace builds it
    parent: dict[int, int] = {}
    by_tid: dict = {}
    for k, e in enumerate(cpu):
        by_tid.setdefault((e["pid"], e["tid"]), []).append(k)
    for ks in by_tid.values():
        stack: list[int] = []
        for k in ks:
            while stack and cpu[stack[-1]]["ts"] + cpu[stack[-1]]["dur"] <= cpu[k]["ts"]:
                stack.pop()
            parent[k] = stack[-1] if stack else -1
            stack.append(k)
    keep: set[int] = set()

    def up(k: int) -> None:
        while k >= 0 and k not in keep:
            keep.add(k)
            k = parent[k]

    calls = {k for k, e in enumerate(cpu) if e["name"].startswith("## Call CompiledFxGraph")}
    for k in calls:
        up(k)
    for k, p in parent.items():
        if p in calls:
            keep.add(k)
    for e in launches:  # the innermost op that encloses each launch, and its ancestors
        t0, t1 = e["ts"], e["ts"] + e.get("dur", 0)
        best = -1
        for k in by_tid.get((e["pid"], e["tid"]), []):
            c = cpu[k]
            if c["ts"] > t0:
                break
            if c["ts"] + c["dur"] >= t1:
                best = k
        up(best)
    out = []
    for e in gpu:
        a = e["args"]
        out.append(_complete(e, {k: a[k] for k in ("stream", "correlation", "bytes") if k in a}))
    for e in launches:
        out.append(_complete(e, {"correlation": e["args"]["correlation"]}))
    out.extend(_complete(cpu[k]) for k in sorted(keep))
    _write(dst, {"traceEvents": out, "source": f"{src.name}, cut by tests/data/make_fixtures.py"})


def _complete(e: dict, args: dict | None = None) -> dict:
    """A complete ("X") trace event with the fields the tests read, and ``args`` where given."""
    event = {"ph": "X", **{k: e[k] for k in ("cat", "name", "pid", "tid", "ts", "dur")}}
    return event if args is None else {**event, "args": args}


def _call_only(code: str) -> str:
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*def call\(", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and not (
        lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) <= indent
    ):
        end += 1
    return "\n".join(lines[start:end]) + "\n"


def _fx_ops_only(code: str) -> str:
    keep = [
        line
        for line in code.splitlines()
        if re.match(r"\s*def forward\(", line) or "fxoffload" in line or re.match(r"\s*return ", line)
    ]
    return "\n".join(keep) + "\n"


ROW_FIELDS = (
    "name",
    "decision",
    "nbytes",
    "d2h_ms",
    "h2d_ms",
    "fw_window_ms",
    "bw_window_ms",
    "fw_last_use",
    "bw_first_use",
    "reason_code",
)


def cut_report(src: Path, dst: Path) -> None:
    with gzip.open(src) as f:
        (r,) = json.load(f)
    _write(
        dst,
        {
            "source": f"{src.name}, cut by tests/data/make_fixtures.py",
            "policy": r["policy"],
            "device": r["device"],
            "predicted_stall_ms": r["predicted_stall_ms"],
            "output_code": {k: _call_only(v) for k, v in r["output_code"].items()},
            "fw_code": _fx_ops_only(r["fw_code"]),
            "bw_code": _fx_ops_only(r["bw_code"]),
            "host_copies": r["host_copies"],
            "saved": [{k: row[k] for k in ROW_FIELDS} for row in r["saved"]],
        },
    )


if __name__ == "__main__":
    gpu_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/gpu")
    for run in ("inductor", "auto", "all"):
        cut_trace(gpu_dir / f"trace_{run}.json.gz", HERE / f"trace_{run}.json.gz")
    for run in ("auto", "all"):
        cut_report(gpu_dir / f"reports_{run}.json.gz", HERE / f"report_{run}.json.gz")
