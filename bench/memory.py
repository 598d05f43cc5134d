"""Predicted against measured peak memory of a steady training step, on a CPU.

For each model, inner compiler and plan: the model is compiled, two warm-up steps run, then one step
is measured with ``fxoffload.measure_memory`` (the CPU allocator's own allocation and free events,
fxoffload's host buffers left out: what a device would hold). The prediction is the report's memory
timeline (``memory_before`` without fxoffload's changes, ``memory_after`` with them), less the
parameters and inputs that were live when the step started, so that both count the bytes above the
start; with Inductor, the replay of the code it generated (``report.compiled_memory()``), with the FX
model's figure beside it.
``baseline`` is the same compiler without fxoffload. Budgets are shown above the start too.

    python -m bench.memory                               # every model, both inner compilers
    python -m bench.memory --models gpt,mlp --inner inductor --plans all,budget=0.7
    python -m bench.memory --scales 1,4                  # and each batch 4 times as large
    python -m bench.memory --models gpt --inner inductor --amp bf16   # the forward under bf16 autocast

CPU figures: every tensor, "device" and host alike, is a CPU tensor (``offload_cpu=True``).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from tabulate import tabulate

import fxoffload
from fxoffload.measure.allocator import measure_steady_step, track_cpu_frees
from fxoffload.planning.budget import BUDGET_TOLERANCE
from fxoffload.testing.models import example

_MODELS = ("mlp", "gpt", "cnn", "seq2seq", "hf-llama", "hf-gpt2")
_MORE = ("seq2seq-decoder",)  # seq2seq's compiled part alone, the encoder's output an input
_PLANS = ("none", "all", "auto", "budget=0.7", "budget=0.5", "budget=0.45@0.01GB")


def _model(name: str, scale: int = 1):
    """The model and its batch, every batch tensor repeated ``scale`` times along its first dimension."""
    if name.startswith("hf-"):
        from bench.workloads import build

        w = build(name, "tiny", "cpu")
        model, batch = w.model, w.batch
    else:
        model, batch = example(name)
    return model, tuple(_repeated(t, scale) for t in batch)


def _repeated(t, scale: int):
    if scale == 1 or not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    out = t.detach().repeat(scale, *([1] * (t.dim() - 1)))
    return out.requires_grad_() if t.requires_grad else out


def _loss(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out if out.dim() == 0 else out.float().pow(2).mean()


def _plan_options(plan: str) -> dict:
    """``all``, ``auto``, ``none``; ``budget=F`` (policy auto, memory_budget F); ``budget=F@BW`` the same
    over a host link of BW (``0.01GB``: nothing hidden, the budget alone decides what is offloaded)."""
    if plan.startswith("budget="):
        fraction, _, bandwidth = plan.split("=", 1)[1].partition("@")
        return {"policy": "auto", "memory_budget": float(fraction), **({"bandwidth": bandwidth} if bandwidth else {})}
    return {"policy": plan}


def measure(
    name: str, inner: str, plan: str | None, warmup: int = 2, min_bytes: int = 0, scale: int = 1, amp: bool = False
) -> dict:
    """One row: measured and predicted peak bytes of a steady step; ``plan`` None: no fxoffload;
    ``scale``: the batch that many times as large; ``amp``: the forward under bf16 autocast."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = _model(name, scale)
    model = copy.deepcopy(model)
    if plan is None:
        backend = inner
    else:
        backend = fxoffload.backend(offload_cpu=True, inner=inner, min_bytes=min_bytes, **_plan_options(plan))
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = _loss(compiled(*batch))
        loss.backward()

    measured_memory, caught = measure_steady_step(step, warmup, lambda: model.zero_grad(set_to_none=True))
    cpu = measured_memory.cpu
    measured = cpu.peak_bytes
    row = {"model": name + (" (bf16 autocast)" if amp else ""), "batch": batch[0].shape[0], "inner": inner,
           "plan": plan or "baseline",
           "measured_peak": measured, "measured_at": cpu.peak_op}
    if plan is not None:
        reports = backend.reports
        row["graphs"] = len(reports)
        row["offloaded"] = sum(len(r.offloaded) for r in reports)
        row["recomputed"] = sum(len(r.recomputed) for r in reports)
        row["replans"] = sum(len(r.replans) for r in reports)
        # verify_peak: graphs compiled unchanged, their plan's code peaking higher (auto: or as high)
        row["unchanged"] = sum("(verify_peak)" in r.note for r in reports)
        # fxoffload said at compile time that the budget is out of reach (its model, or Inductor's code)
        row["warned"] = any(
            "memory_budget" in str(w.message) and ("not met" in str(w.message) or "cannot be reached" in str(w.message))
            for w in caught
        )
        if len(reports) == 1:
            (report,) = reports
            timeline = report.memory_after or report.memory_before
            if timeline is not None and timeline.points:
                peak = timeline.peak
                row["start_bytes"] = report.start_bytes  # live before the step
                row["predicted_peak"] = peak.total - row["start_bytes"]
                row["predicted_at"] = f"{peak.phase} {peak.node}"
            compiled = report.compiled_memory()  # Inductor: replayed from the code it generated
            if compiled is not None and compiled.points:
                peak = compiled.peak
                row["code_peak"] = peak.total - report.start_bytes
            if report.memory_budget is not None and "start_bytes" in row:
                # The budget counts everything on the device, parameters and inputs included.
                row["budget"] = report.memory_budget - row["start_bytes"]
                row["predicted_over_budget"] = report.predicted_peak_after > report.memory_budget
    return row


def _budget_verdict(r: dict) -> str:
    """"yes": the measured peak is within BUDGET_TOLERANCE of the budget (both counting everything on
    the device, as ``memory_budget`` does: the parameters and inputs live at the start too); "warned":
    it is not, and fxoffload said at compile time, in a warning, that it cannot get there; "NO": over
    the budget and nothing said."""
    start = r.get("start_bytes", 0)
    if r["measured_peak"] + start <= (1 + BUDGET_TOLERANCE) * (r["budget"] + start):
        return "yes"
    return "warned" if r.get("warned") else "NO"


def table(rows: list[dict], tablefmt: str = "simple") -> str:
    """The rows as a table (``tablefmt``: tabulate's, e.g. "github" for docs/results.md)."""
    baseline = {
        (r["model"], r.get("batch"), r["inner"]): r["measured_peak"] for r in rows if r["plan"] == "baseline"
    }
    out = []
    for r in rows:
        base = baseline.get((r["model"], r.get("batch"), r["inner"]))
        # fxoffload's prediction for this compiler: the replay of Inductor's code where there is one
        # (what ``memory_budget`` is held to under Inductor), else the FX graphs' memory model.
        predicted = r.get("code_peak", r.get("predicted_peak"))
        fx_model = r.get("predicted_peak") if "code_peak" in r else None
        measured = r["measured_peak"]
        out.append({
            "model": r["model"], "batch": r.get("batch", ""), "inner": r["inner"], "plan": r["plan"],
            "offloaded": r.get("offloaded", ""), "recomputed": r.get("recomputed", ""),
            "planned again": r.get("replans", "") or "",
            "compiled unchanged": r.get("unchanged", "") or "",
            "measured MiB": f"{measured / 2**20:.2f}",
            "predicted MiB": "" if predicted is None else f"{predicted / 2**20:.2f}",
            "predicted/measured": "" if not predicted or not measured else f"{predicted / measured - 1:+.1%}",
            "predicted from": "" if predicted is None else ("Inductor code" if "code_peak" in r else "FX graphs"),
            "FX model/measured": "" if not fx_model or not measured else f"{fx_model / measured - 1:+.1%}",
            "vs baseline": "" if base is None or r["plan"] == "baseline" else f"{r['measured_peak'] / base - 1:+.1%}",
            "budget MiB": f"{r['budget'] / 2**20:.2f}" if "budget" in r else "",  # above the start, too
            "budget met": "" if "budget" not in r else _budget_verdict(r),
        })  # fmt: skip
    return tabulate(out, headers="keys", tablefmt=tablefmt)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", default=",".join(_MODELS), help=f"comma-separated, of: {', '.join(_MODELS + _MORE)}"
    )
    parser.add_argument("--inner", default="aot_eager,inductor", help="comma-separated: aot_eager, inductor")
    parser.add_argument("--plans", default=",".join(_PLANS), help=f"comma-separated, of: {', '.join(_PLANS)}")
    parser.add_argument("--scales", default="1", help="comma-separated batch multipliers (each batch tensor "
                        "repeated along its first dimension), e.g. 1,4")
    parser.add_argument("--amp", default="none", choices=("none", "bf16"), help="the forward under CPU autocast")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    amp = args.amp == "bf16"
    track_cpu_frees()  # frees of blocks from before the step count too
    torch.set_num_threads(1)  # allocation order does not depend on the thread count then
    rows = []
    for name in args.models.split(","):
        for scale in (int(s) for s in args.scales.split(",")):
            for inner in args.inner.split(","):
                these = [measure(name, inner, None, scale=scale, amp=amp)]
                these += [measure(name, inner, plan, scale=scale, amp=amp) for plan in args.plans.split(",")]
                rows += these
                print(table(these), flush=True)
    print(f"\ntorch {torch.__version__}, CPU, offload_cpu=True, min_bytes=0, 1 thread; bytes above the step's start")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
