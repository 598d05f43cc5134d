"""Kernels between each copy and its wait, read from the code Inductor generates.

For each model, lowering and schedule rule, one training step is compiled with
``policy="all", min_bytes=0``; ``fxoffload.analysis.output_code`` reads Inductor's wrapper code
(``report.output_code``) and the FX code handed to it. Per direction it prints the kernels launched
between each copy and its wait, how many of the copies the plan put compute behind (at least one
matmul, convolution or attention kernel in the FX graph between copy and wait) end up with none in
the generated code, and, for reloads, the kernels between the copy and its first use.

    python -m bench.kernels                      # CPU Inductor and the CUDA lowering (fake tensors)
    python -m bench.kernels --lowering cpu --models mlp3

"order edges: off" compiles with ``broken_rule="no_order_edges"``: the rewrite
without the ``fxoffload.order`` edges that bound each copy from below, i.e. the schedule before
they existed. The CUDA lowering runs on this machine with fake tensors (``fxoffload.testing.cuda_codegen``):
it is the code Inductor would generate for an H100, not code that ran.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn
from tabulate import tabulate

import fxoffload
from fxoffload.analysis import output_code as codecheck
from fxoffload.testing.models import CNN, GPT, MLP, GPTConfig, gpt_batch

# Cost-model figures of an H100-class device, so that the CUDA lowering plans as it would there.
_OPTIONS = dict(policy="all", min_bytes=0, bandwidth=10e9, compute_rates={"flops": 1e14, "memory_bandwidth": 2e12})


def _mlp3(dim: int = 1024) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))


def _models(lowering: str) -> dict:
    """name -> (model, example inputs); the CUDA lowering takes one input tensor."""
    cfg = GPTConfig(layers=2)
    cpu = {
        "mlp3": lambda: (_mlp3(256), (torch.randn(512, 256),)),
        "mlp": lambda: (MLP(layers=4), (torch.randn(256, 64),)),
        "gpt": lambda: (GPT(cfg), gpt_batch(cfg, 2)),
        "cnn": lambda: (CNN(), (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))),
    }
    cuda = {
        "mlp3": lambda: (_mlp3(1024), (torch.randn(4096, 1024),)),
        "mlp3-padded": lambda: (_mlp3(1050), (torch.randn(4096, 1050),)),
    }
    return cpu if lowering == "cpu" else cuda


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out if out.dim() == 0 else out.float().pow(2).mean()


def _report(lowering: str, model: nn.Module, args: tuple, **options) -> fxoffload.OffloadReport:
    torch._dynamo.reset()
    options = {**_OPTIONS, **options}
    if lowering == "cpu":
        backend = fxoffload.backend(offload_cpu=True, inner="inductor", **options)
        _loss(torch.compile(model, backend=backend)(*args)).backward()
    else:
        from fxoffload.testing import cuda_codegen as _cuda_codegen

        backend = fxoffload.backend(**options)
        _cuda_codegen.cuda_wrapper_code(model, args, backend)
    (report,) = backend.reports
    return report


def _summary(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{min(values)} / {statistics.median(values):g} / {max(values)}"


def measure(lowering: str, name: str, order_edges: bool) -> list[dict]:
    torch.manual_seed(0)
    model, args = _models(lowering)[name]()
    report = _report(lowering, model, args, **({} if order_edges else {"broken_rule": "no_order_edges"}))
    rows = []
    for kind, fx_code in (("forward", report.fw_code), ("backward", report.bw_code)):
        code = {t.key: t for t in codecheck.transfers(report.output_code[kind])}
        plan = {t.key: t for t in codecheck.transfers(fx_code, kernel=codecheck.is_materialised_call)}
        pairs = [(code[k], plan[k]) for k in plan if k in code]
        between = [c.kernels_between for c, _ in pairs]
        rows.append({
            "lowering": lowering, "model": name, "order edges": "on" if order_edges else "off",
            "direction": "d2h" if kind == "forward" else "h2d", "copies": len(pairs),
            "kernels between (min / median / max)": _summary(between),
            "0 where the plan put compute": sum(1 for c, p in pairs if p.kernels_between and not c.kernels_between),
            "kernels before first use": _summary([c.kernels_before_use for c, _ in pairs if kind == "backward"]),
            "same buffer": all(c.same_buffer and not c.source_released_early for c, _ in pairs),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lowering", choices=["cpu", "cuda", "both"], default="both")
    parser.add_argument("--models", default="", help="comma-separated; default: every model of the lowering")
    args = parser.parse_args(argv)
    rows = []
    for lowering in ("cpu", "cuda") if args.lowering == "both" else (args.lowering,):
        names = [m for m in args.models.split(",") if m] or list(_models(lowering))
        for name in names:
            for edges in (False, True):
                try:
                    rows += measure(lowering, name, edges)
                except NotImplementedError as e:  # the CUDA lowering's private pieces on another torch
                    print(f"{lowering} {name}: skipped ({e})")
    print(f"torch {torch.__version__}; policy='all', min_bytes=0; kernels counted in Inductor's wrapper code")
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
