"""Command line: ``python -m fxoffload explain ...`` prints what fxoffload would do to a model."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
from pathlib import Path

import torch

from .explain import OPTIMIZERS, explain, explain_and_measure, explain_step, where_memory_goes
from ..options import POLICIES, parse_budget, parse_bytes, parse_rate
from ..reporting.render import text_width
from ..reporting.report import save_reports
from ..sizes import fmt_bytes
from ..testing.models import EXAMPLE_MIN_BYTES, EXAMPLES, example


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


def _rate(text: str) -> float:
    try:
        try:
            value: float | str = float(text)  # 25e9
        except ValueError:
            value = text  # 25GB/s
        return parse_rate(value, "rate")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("fxoffload: ", "")) from None


def _budget(text: str) -> int | float:
    try:
        value: int | float | str = float(text) if "." in text and text.replace(".", "", 1).isdigit() else text
        return parse_budget(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("fxoffload: ", "")) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help (except flags off by default and "unset"), the epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


EXPLAIN_EXAMPLES = """\
examples:
  # the plan for the built-in GPT on this machine (on a CPU, nothing is offloaded without --offload-cpu)
  python -m fxoffload explain --model gpt
  # offload CPU tensors too (policy all: on a CPU, auto keeps what its op calls would slow), and
  # measure one real training step beside the prediction
  python -m fxoffload explain --model cnn --offload-cpu --policy all --measure
  # why memory grows in the backward and what holds it after an AdamW step, with figures
  python -m fxoffload explain --model seq2seq --offload-cpu --inner aot_eager --optimizer adamw
  # your own model: make() in my_model.py returns (model, example_args); a budget of 60% of the peak
  python -m fxoffload explain --model my_model.py:make --budget 0.6 --json plan.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fxoffload", description="fxoffload: activation offloading for torch.compile",
        epilog=EXPLAIN_EXAMPLES, formatter_class=_HelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser(
        "explain", help="plan a model and print the summary and the table of saved tensors",
        description="Compile one forward of a model with fxoffload and print what it would offload,\n"
        "recompute or keep, and why. Runs no training step unless --measure is given.",
        epilog=EXPLAIN_EXAMPLES, formatter_class=_HelpFormatter,
    )  # fmt: skip
    examples = ", ".join(f"{k}: {v}" for k, v in EXAMPLE_MIN_BYTES.items())
    add = ex.add_argument
    add("--model", default="gpt",
        help=f"a built-in example ({', '.join(EXAMPLES)}) or FILE.py:FUNCTION returning (model, args)")
    add("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    add("--policy", default="auto", choices=POLICIES,
        help="auto: what the cost model predicts hidden; all: every eligible tensor; none: unchanged")
    add("--offload-module", action="append", default=[], metavar="PATTERN",
        help="offload what modules matching this fnmatch pattern produce, e.g. '*.mlp.*' (repeatable)")
    add("--min-bytes", type=_size, default=None, metavar="SIZE",
        help=f"smaller saved tensors stay on the device, e.g. 1MiB (default: per built-in example, "
        f"{examples}; 1 MiB, the backend's, for your own model)")
    add("--budget", type=_budget, default=None, metavar="SIZE|FRACTION",
        help="memory budget for the peak: a size (12GiB), or a fraction (0.6, 60%%) of the peak of "
        "Inductor's code without offloading (default: none)")
    add("--strict", action="store_true", help="fail when --budget cannot be reached (default: warn)")
    add("--bandwidth", type=_rate, default=None, metavar="BYTES_PER_S",
        help="host link bytes/s each way, e.g. 25GB/s (default: measured on a GPU, fixed on CPU)")
    add("--host-budget", type=_size, default=None, metavar="SIZE",
        help="bound on host bytes, e.g. 8GiB (default: unbounded)")
    add("--prefetch", type=int, default=None, metavar="NODES",
        help="compute nodes each copy overlaps with (default: placed by the cost model)")
    add("--offload-cpu", action="store_true",
        help="offload CPU tensors too, to see the data flow on a machine without a GPU")
    add("--cpu-link", type=_rate, default=None, metavar="BYTES_PER_S",
        help="with --offload-cpu: the CPU copy threads' speed each way, to mimic a host link, e.g. 2GB/s "
        "(default: as fast as memory copies)")
    add("--inner", default="inductor", choices=("inductor", "aot_eager"),
        help="compiler of the rewritten graphs; aot_eager runs them eagerly (for debugging)")
    add("--calibrate", action="store_true", help="time the ops on the device instead of modelling them")
    add("--measure", action="store_true",
        help="run steady training steps and show the measured peak beside the predicted one")
    add("--optimizer", choices=tuple(OPTIMIZERS), default=None,
        help="with --measure: measure a step that ends with this optimizer's step() and say what is live "
        "after it (parameters, gradients, optimizer state) and why the backward grows (implies --measure)")
    add("--all-rows", action="store_true",
        help="print every saved tensor with every column (default: offloaded, recomputed and the largest "
        "kept ones, fitted to the terminal)")
    add("--plot", metavar="FILE", help="write the memory picture (PNG or SVG; needs matplotlib)")
    add("--json", metavar="FILE", help="write the reports as JSON (every row and field)")
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
    if args.model in EXAMPLES:
        options["min_bytes"] = EXAMPLE_MIN_BYTES[args.model]  # an explicit --min-bytes wins, below
    for key in ("min_bytes", "host_budget", "prefetch", "bandwidth"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.cpu_link is not None:
        if not args.offload_cpu:
            raise SystemExit("fxoffload: --cpu-link sets the CPU copy threads' speed; it needs --offload-cpu")
        options["cpu_link_bandwidth"] = args.cpu_link
    if args.budget is not None:
        options.update(memory_budget=args.budget, strict=args.strict)
    if args.offload_module:
        options["offload_modules"] = tuple(args.offload_module)
    width = max(40, text_width())
    measured = step = None
    try:
        if args.optimizer:
            reports, step = explain_step(model, *inputs, optimizer=args.optimizer, **options)
        elif args.measure:
            reports, measured = explain_and_measure(model, *inputs, **options)
        else:
            reports = explain(model, *inputs, **options)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not reports:
        print("fxoffload: no graph was planned: nothing requires grad, so nothing is saved for backward")
    for report in reports:
        # The short table says a graph-wide note itself; the summary's copy of it would repeat it.
        summary = report.summary().splitlines()
        summary = [line for line in summary if args.all_rows or not line.startswith("  note: ")]
        print("\n".join(_fitted(summary, width)) + "\n")
        print(report.table(rows="all" if args.all_rows else "short", width=width) + "\n")
    if measured is not None:
        _print_measured(measured[device], reports, model, inputs, width)
    if args.measure or step is not None:
        print("\n".join(_fitted(where_memory_goes(reports, step).splitlines(), width)))
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


def _fitted(lines: list[str], width: int) -> list[str]:
    """Each line wrapped to ``width`` columns, its continuation indented under its text."""
    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out.extend(textwrap.wrap(line, width, subsequent_indent=indent) or [""])
    return out


def _print_measured(measured, reports, model, inputs, width: int) -> None:
    where = "CPU, fxoffload's host buffers left out" if measured.device == "cpu" else measured.device
    lines = [f"measured, one steady step ({where}):", f"  {measured.summary()}"]
    if reports:
        tensors = [*(model.parameters() if isinstance(model, torch.nn.Module) else ()),
                   *(model.buffers() if isinstance(model, torch.nn.Module) else ()),
                   *(a for a in inputs if isinstance(a, torch.Tensor))]  # fmt: skip
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        start, predicted = sum(storages.values()), max(r.predicted_peak_after for r in reports)
        lines.append(f"  predicted peak with fxoffload: {fmt_bytes(predicted)}, {fmt_bytes(predicted - start)} "
                     f"above the {fmt_bytes(start)} of parameters, buffers and inputs live at the start")  # fmt: skip
    print("\n".join(_fitted(lines, width)))


if __name__ == "__main__":
    sys.exit(main())
