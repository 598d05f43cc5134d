"""``fxoffload.explain``: compile once, return the reports, leave the model as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .backend import OffloadBackend
from .measure import MeasuredMemory, measure_memory
from .options import OffloadOptions
from .report import OffloadReport


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
        out = _unwrapped(compiled, example_args)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        loss = sum(t.sum() for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
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
