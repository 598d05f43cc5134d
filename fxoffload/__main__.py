"""Command line: ``python -m fxoffload explain ...`` prints what fxoffload would do to a model."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from .explain import explain, explain_and_measure
from .models import EXAMPLES, example
from .options import POLICIES, parse_budget, parse_bytes
from .report import save_reports


def _load_factory(spec: str):
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise SystemExit(f"fxoffload: --model {spec!r}: expected one of {', '.join(EXAMPLES)} or FILE.py:FUNCTION")
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"fxoffload: --model {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"fxoffload: --model {spec!r}: {path} has no function {name!r}")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SystemExit(f"fxoffload: {name}() must return (model, example_args_tuple), got {type(result).__name__}")
    return result


def _size(text: str) -> int:
    try:
        return parse_bytes(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("fxoffload: ", "")) from None


def _budget(text: str) -> int | float:
    try:
        value: int | float | str = float(text) if "." in text and text.replace(".", "", 1).isdigit() else text
        return parse_budget(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("fxoffload: ", "")) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fxoffload", description="fxoffload: activation offloading for torch.compile")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="plan a model and print the summary and the table of saved tensors")
    ex.add_argument("--model", default="gpt",
                    help=f"a built-in example ({', '.join(EXAMPLES)}) or FILE.py:FUNCTION returning (model, args)")  # fmt: skip
    ex.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ex.add_argument("--policy", default="auto", choices=POLICIES)
    ex.add_argument("--offload-module", action="append", default=[], metavar="PATTERN",
                    help="offload what modules matching this fnmatch pattern produce, e.g. '*.mlp.*' (repeatable)")  # fmt: skip
    ex.add_argument("--min-bytes", type=_size, default=None, help="e.g. 1MiB (default: the backend's, 1 MiB)")
    ex.add_argument("--budget", type=_budget, default=None,
                    help="memory budget for the predicted peak: a size (12GiB) or a fraction (0.6) of the peak")  # fmt: skip
    ex.add_argument("--strict", action="store_true", help="fail when --budget cannot be reached")
    ex.add_argument("--bandwidth", type=_size, default=None, help="host link bytes/s each way, e.g. 25GB")
    ex.add_argument("--host-budget", type=_size, default=None, help="bound on host bytes, e.g. 8GiB")
    ex.add_argument("--prefetch", type=int, default=None, help="compute nodes each copy overlaps with")
    ex.add_argument("--offload-cpu", action="store_true", help="offload CPU tensors (machines without a GPU)")
    ex.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    ex.add_argument("--calibrate", action="store_true", help="time the ops on the device instead of modelling them")
    ex.add_argument("--measure", action="store_true",
                    help="run steady training steps and show the measured peak beside the predicted one")  # fmt: skip
    ex.add_argument("--plot", metavar="FILE", help="write the memory picture (PNG or SVG; needs matplotlib)")
    ex.add_argument("--json", metavar="FILE", help="write the reports as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu") and not device.startswith("cuda:"):
        raise SystemExit(f"fxoffload: --device {device!r}: use cuda, cuda:N or cpu")
    if args.model in EXAMPLES:
        model, inputs = example(args.model, device)
    else:
        model, inputs = _load_factory(args.model)
    options = {"policy": args.policy, "offload_cpu": args.offload_cpu, "inner": args.inner, "calibrate": args.calibrate}
    for key in ("min_bytes", "host_budget", "prefetch", "bandwidth"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.budget is not None:
        options.update(memory_budget=args.budget, strict=args.strict)
    if args.offload_module:
        options["offload_modules"] = tuple(args.offload_module)
    measured = None
    try:
        if args.measure:
            reports, measured = explain_and_measure(model, *inputs, **options)
        else:
            reports = explain(model, *inputs, **options)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not reports:
        print("fxoffload: no graph was planned: nothing requires grad, so nothing is saved for backward")
    for report in reports:
        print(report.summary(), "\n")
        print(report.table(), "\n")
    if measured is not None:
        _print_measured(measured[device], reports, model, inputs)
    if device == "cpu" and not args.offload_cpu:
        print("note: on CPU nothing is offloaded unless --offload-cpu is given")
    if args.json:
        save_reports(reports, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if not reports:
            raise SystemExit("fxoffload: --plot: there is no report to draw")
        try:
            reports[0].plot(args.plot)
        except ImportError as e:
            raise SystemExit(f"fxoffload: --plot: {e}") from None
        print(f"wrote {args.plot}" + (" (graph 0 of several)" if len(reports) > 1 else ""))
    return 0


def _print_measured(measured, reports, model, inputs) -> None:
    from .plan import fmt_bytes

    where = "CPU, fxoffload's host buffers left out" if measured.device == "cpu" else measured.device
    print(f"measured, one steady step ({where}):\n  {measured.summary()}")
    if reports:
        tensors = [*(model.parameters() if isinstance(model, torch.nn.Module) else ()),
                   *(model.buffers() if isinstance(model, torch.nn.Module) else ()),
                   *(a for a in inputs if isinstance(a, torch.Tensor))]  # fmt: skip
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        start, predicted = sum(storages.values()), max(r.predicted_peak_after for r in reports)
        print(f"  predicted peak with fxoffload: {fmt_bytes(predicted)}, {fmt_bytes(predicted - start)} "
              f"above the {fmt_bytes(start)} of parameters, buffers and inputs live at the start")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
