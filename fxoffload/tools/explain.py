"""``fxoffload.explain``: compile once, return the reports, leave the model as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..analysis.graph import storage_root, storage_users
from ..compiler.backend import OffloadBackend
from ..measure.allocator import DeviceMemory, MeasuredMemory, measure_memory
from ..options import OffloadOptions
from ..reporting.report import OffloadReport
from ..sizes import distinct_storage_bytes, fmt_bytes, tensor_bytes

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def explain(model_or_fn: Callable[..., Any], *example_args: Any, **options: Any) -> list[OffloadReport]:
    """The ``OffloadReport`` of every graph fxoffload compiles for ``model_or_fn(*example_args)``.

    Runs one compiled forward (the plan is made when the forward is compiled) and no backward: no
    gradient is left behind, and parameters, buffers (BatchNorm statistics, for example) and the
    random number generators are restored afterwards. Inputs or parameters must require grad,
    otherwise there is no backward to plan for and the list is empty.
    """
    backend = OffloadBackend(OffloadOptions.from_dict(options))
    compiled = torch.compile(model_or_fn, backend=backend)
    with _restored(model_or_fn):
        _unwrapped(compiled, example_args)
    return list(backend.reports)


def explain_and_measure(
    model_or_fn: Callable[..., Any], *example_args: Any, **options: Any
) -> tuple[list[OffloadReport], MeasuredMemory]:
    """``explain``, and the memory of one steady training step measured from the allocators
    (``fxoffload.measure_memory``): two warm-up steps, then the measured one, each a compiled forward
    and a backward of the sum of its tensor outputs. Gradients, parameters, buffers and the random
    number generators are restored afterwards, as ``explain`` does.
    """
    backend = OffloadBackend(OffloadOptions.from_dict(options))
    compiled = torch.compile(model_or_fn, backend=backend)
    inputs = [a for a in example_args if isinstance(a, torch.Tensor) and a.requires_grad]
    input_grads = [a.grad for a in inputs]

    def step() -> None:
        _forward_backward(compiled, example_args)
        for a in inputs:
            a.grad = None
        if isinstance(model_or_fn, torch.nn.Module):
            model_or_fn.zero_grad(set_to_none=True)

    with _restored(model_or_fn):
        try:
            step()
            step()
            measured = measure_memory(step)
        finally:
            for a, grad in zip(inputs, input_grads):
                a.grad = grad
    return list(backend.reports), measured


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One steady training step with an optimizer, measured in two parts, and what it leaves live.

    ``backward``: the compiled forward and the backward, measured from a start with no gradients, so
    its ``end_bytes`` is what the backward left live (the gradients). ``optimizer_step``: the
    optimizer's ``step()`` right after, measured on its own (its peak is the update's temporaries).
    The byte counts after the step are read from the tensors themselves (storage bytes, each storage
    once)."""

    device: str  # the device measured, "cpu" or "cuda:0"
    optimizer: str  # the optimizer's class name
    backward: DeviceMemory
    optimizer_step: DeviceMemory
    parameter_bytes: int  # the model's parameters
    gradient_bytes: int  # their .grad after the step: kept until zero_grad(set_to_none=True)
    gradients: int  # parameters holding a .grad
    optimizer_state_bytes: int  # every tensor in optimizer.state (exp_avg, exp_avg_sq, step, ...)
    optimizer_state_tensors: int
    # Of optimizer_state_bytes: the state tensors shaped like their parameter (Adam's moments, SGD's
    # momentum) and the rest (the per-parameter ``step`` counters).
    optimizer_state_like_params_bytes: int
    optimizer_state_other_bytes: int

    @property
    def after_step_bytes(self) -> int:
        """Bytes live after the optimizer step that belong to training: parameters, their gradients
        and the optimizer's state."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes


def explain_step(
    model: torch.nn.Module, *example_args: Any, optimizer: str | Callable[..., Any] = "adamw", **options: Any
) -> tuple[list[OffloadReport], StepMemory]:
    """``explain``, and one steady training step with an optimizer measured from the allocators: a
    compiled forward, the backward of the sum of its tensor outputs, then ``optimizer.step()``.

    ``optimizer``: "sgd", "adam", "adamw" (torch's defaults; SGD with momentum 0.9 so it keeps
    state), or a callable taking the parameters and returning an optimizer. Two warm-up steps create
    the optimizer's state, then the gradients are set to None and the step is measured. Parameters,
    buffers, gradients and the random number generators are restored afterwards; the optimizer is
    dropped. Returns the reports and a ``StepMemory``; ``where_memory_goes`` reads both.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"fxoffload.explain_step: the model must be a torch.nn.Module (its parameters are what the "
            f"optimizer updates), got {type(model).__name__}"
        )
    make = _optimizer_factory(optimizer)
    backend = OffloadBackend(OffloadOptions.from_dict(options))
    compiled = torch.compile(model, backend=backend)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("fxoffload.explain_step: no parameter of the model requires grad; nothing to optimize")
    device = str(params[0].device) if params[0].device.type != "cuda" else f"cuda:{params[0].device.index or 0}"

    def forward_backward() -> None:
        _forward_backward(compiled, example_args)

    with _restored(model):
        opt = make(params)
        try:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                forward_backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            backward = measure_memory(forward_backward)[device]
            stepped = measure_memory(opt.step)[device]
            grads = [p.grad for p in params if p.grad is not None]
            state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            shapes = {(p.shape, p.dtype) for p in params}
            like = [t for t in state if (t.shape, t.dtype) in shapes and t.dim() > 0]
            result = StepMemory(
                device, type(opt).__name__, backward, stepped, distinct_storage_bytes(params), distinct_storage_bytes(grads),
                len(grads), distinct_storage_bytes(state), len(state), distinct_storage_bytes(like),
                distinct_storage_bytes([t for t in state if not any(t is u for u in like)]),
            )  # fmt: skip
        finally:
            del opt
    return list(backend.reports), result


def where_memory_goes(reports: Sequence[OffloadReport], step: StepMemory | None = None) -> str:
    """Why device memory grows during the backward and what holds it after the optimizer step, in
    figures: each graph's predicted timeline with fxoffload (saved activations at the start of its
    backward, what is live at its backward peak against its forward peak, the gradients at its end),
    and, with ``step`` (``explain_step``), the measured step and the bytes live after it. Every figure
    is computed from the timelines, the graphs or the measurement."""
    lines = ["where the memory goes (predicted by the memory model, with fxoffload):"]
    if not reports:
        lines.append("  no graph was planned: nothing requires grad")
    for r in reports:
        lines.extend(f"  {line}" for line in _backward_growth(r))
    if step is not None:
        lines.extend(_after_step(reports, step))
    return "\n".join(lines)


def _backward_growth(r: OffloadReport) -> list[str]:
    kinds, host = r.device_kinds("after"), r.host_in_flight("after")
    points = r.memory_after.points if r.memory_after else ()
    fw = [i for i, p in enumerate(points) if p.phase == "forward"]
    bw = [i for i, p in enumerate(points) if p.phase == "backward"]
    if not fw or not bw:
        return [f"graph {r.graph_id}: no timeline"]
    total = [sum(k.values()) for k in kinds]
    fpeak, bpeak = max(fw, key=total.__getitem__), max(bw, key=total.__getitem__)
    start, end, at = kinds[bw[0]], kinds[bw[-1]], kinds[bpeak]
    lines = [
        f"graph {r.graph_id}: forward peak {fmt_bytes(total[fpeak])} at {points[fpeak].node}; backward peak "
        f"{fmt_bytes(total[bpeak])} at {points[bpeak].node}, "
        + (f"{fmt_bytes(total[bpeak] - total[fpeak])} above the forward's" if total[bpeak] >= total[fpeak]
           else f"{fmt_bytes(total[fpeak] - total[bpeak])} below the forward's"),
        f"  start of the backward: saved activations {fmt_bytes(start['saved'])} on the device"
        + (f" (+ {fmt_bytes(host[bw[0]])} of host copies)" if host and host[bw[0]] else "")
        + f", gradients {fmt_bytes(start['gradients'])}",
    ]  # fmt: skip
    if r.outside is not None and r.outside.held_bytes:  # the "outside" of every point
        lines.append(
            f"  held from before its forward to after its backward: {r.outside.summary()} (what it saved is "
            "freed by autograd when it reaches that code, after this graph's backward)"
        )
    partial = _gradient_partials(r, bpeak - len(fw))
    lines.append(
        f"  at the backward peak: saved activations {fmt_bytes(at['saved'])} still live "
        f"({fmt_bytes(start['saved'] - at['saved'])} freed since the start), gradients {fmt_bytes(at['gradients'])}, "
        f"transients {fmt_bytes(at['transient'])}"
        + (f", of which {fmt_bytes(partial)} are gradients being summed over a weight's several uses "
           f"(the operands and partial sums of the adds that produce a gradient)" if partial else "")
    )  # fmt: skip
    lines.append(
        f"  end of the backward: gradients {fmt_bytes(end['gradients'])}, saved activations "
        f"{fmt_bytes(end['saved'])}, transients {fmt_bytes(end['transient'])}"
    )
    grown = (at["gradients"] - start["gradients"]) + (at["transient"] - start["transient"])
    lines.append(
        f"  so: by its peak the backward freed {fmt_bytes(start['saved'] - at['saved'])} of saved activations "
        f"and allocated {fmt_bytes(grown)} of its own (gradients {fmt_bytes(at['gradients'] - start['gradients'])}, "
        f"transients {fmt_bytes(at['transient'] - start['transient'])}): "
        + ("it grows because it allocates more than it frees" if grown > start["saved"] - at["saved"]
           else "it frees more than it allocates")
    )  # fmt: skip
    return lines


def _gradient_partials(r: OffloadReport, at: int) -> int:
    """Device bytes live at backward node ``at`` of report ``r`` that are contributions to a gradient
    still being summed: the operands and results of the ``aten.add`` trees whose root is a backward
    output (a weight used several times, like a recurrent cell's at every step, gets one contribution
    per use), live from their node to their last reader. 0 without the graphs (a report from JSON)."""
    if r.graphs is None:
        return 0
    bw = r.graphs[1]
    nodes = [n for n in bw.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    outputs = [o for o in bw.graph.output_node().args[0] if isinstance(o, fx.Node)]
    add = torch.ops.aten.add.Tensor
    parts: set[fx.Node] = set()
    stack = [storage_root(o) for o in outputs]
    grads = set(stack)
    while stack:
        n = stack.pop()
        if n.op == "call_function" and n.target is add:
            for a in n.args[:2]:
                root = storage_root(a) if isinstance(a, fx.Node) else None
                if root is not None and root not in parts and root.op == "call_function":
                    parts.add(root)
                    stack.append(root)
    live = 0
    for n in parts - grads:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or n not in index:
            continue
        last = max((index[u] for u in storage_users(n) if u in index), default=index[n])
        if index[n] <= at <= last:
            live += tensor_bytes(val)
    return live


def _after_step(reports: Sequence[OffloadReport], step: StepMemory) -> list[str]:
    where = "CPU" if step.device == "cpu" else step.device
    b, o = step.backward, step.optimizer_step
    lines = [
        f"measured, one steady step with {step.optimizer} ({where}, relative to what was live at its start):",
        f"  forward + backward: peak {fmt_bytes(b.peak_bytes)}"
        + (f" (in {b.peak_op})" if b.peak_op else "")
        + f"; live at the end of the backward: {fmt_bytes(b.end_bytes)} more than at the start, of which the "
        f"gradients are {fmt_bytes(step.gradient_bytes)} ({step.gradients} tensors)",
        f"  optimizer.step(): peak {fmt_bytes(o.peak_bytes)} above its start (the update's temporaries), "
        f"{fmt_bytes(o.end_bytes)} more at its end",
    ]  # fmt: skip
    predicted = [
        (r.peak_breakdown("after"), r) for r in reports if r.memory_after is not None and r.memory_after.points
    ]
    if predicted:
        above = max(p.total - r.start_bytes for p, r in predicted)
        gap = b.peak_bytes - above
        share = f" ({gap / b.peak_bytes:+.1%} of it)" if b.peak_bytes else ""
        unseen = (
            ": memory no compiled graph sees (code after a graph, tensors held outside autograd) "
            "or model error"
        )
        lines.append(
            f"  the compiled graphs predict at most {fmt_bytes(above)} above the step's start (what code "
            f"before them holds included); the measured peak is {fmt_bytes(abs(gap))} "
            f"{'more' if gap >= 0 else 'less'}" + share + (unseen if gap > 0.05 * b.peak_bytes else "")
        )
    state = (
        f"{step.optimizer} state {fmt_bytes(step.optimizer_state_bytes)} ({step.optimizer_state_tensors} tensors: "
        f"{fmt_bytes(step.optimizer_state_like_params_bytes)} shaped like the parameters, "
        f"{_ratio(step.optimizer_state_like_params_bytes, step.parameter_bytes)} of their bytes, and "
        f"{fmt_bytes(step.optimizer_state_other_bytes)} of other state such as step counters)"
    )
    lines.append(
        f"  live after the optimizer step: parameters {fmt_bytes(step.parameter_bytes)}, gradients "
        f"{fmt_bytes(step.gradient_bytes)} (kept until zero_grad(set_to_none=True)), {state}: "
        f"{fmt_bytes(step.after_step_bytes)} in all, {_ratio(step.after_step_bytes, step.parameter_bytes)} "
        f"the parameters"
    )
    return lines


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def _optimizer_factory(optimizer: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(optimizer):
        return optimizer
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZERS:
        cls = OPTIMIZERS[optimizer.lower()]
        return (lambda params: cls(params, lr=1e-3, momentum=0.9)) if cls is torch.optim.SGD else cls
    raise ValueError(
        f"fxoffload: optimizer={optimizer!r}: use one of {', '.join(OPTIMIZERS)} or a callable taking the "
        f"parameters and returning a torch.optim.Optimizer"
    )


def _forward_backward(compiled: Callable[..., Any], example_args: tuple) -> None:
    """One compiled forward and a backward of the sum of its tensor outputs that require grad."""
    out = _unwrapped(compiled, example_args)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    loss = sum(t.sum() for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()


def _unwrapped(compiled: Callable[..., Any], example_args: tuple[Any, ...]) -> Any:
    try:
        return compiled(*example_args)
    except Exception as e:
        # torch.compile wraps a backend's errors; a bad option or an unreachable strict budget
        # is a ValueError of ours and reads better unwrapped.
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, ValueError):
            raise inner from None
        raise


@contextlib.contextmanager
def _restored(model: Any) -> Iterator[None]:
    state = {}
    grads = {}
    if isinstance(model, torch.nn.Module):
        state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
        grads = {n: p.grad for n, p in model.named_parameters()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if isinstance(model, torch.nn.Module):
            with torch.no_grad():
                for name, value in model.state_dict(keep_vars=True).items():
                    value.copy_(state[name])
            for name, p in model.named_parameters():
                p.grad = grads[name]
