"""Sizes that may be symbolic as ints, without a guard: torch's ``SymNode`` and ``ShapeEnv`` (private)."""

from __future__ import annotations

from typing import Any

import torch

# Inductor's ``unbacked_symint_fallback``: the estimate of a data-dependent size, before its bounds.
UNBACKED_FALLBACK = 8192


def size_hint(value: Any, fallback: int = UNBACKED_FALLBACK) -> int:
    """An int for a possibly symbolic size, without adding a guard (dynamic shapes stay dynamic)."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = value.node
        constant = node.maybe_as_int()
        if constant is not None:
            return int(constant)
        if node.has_hint():
            return int(node.hint)
        return _unbacked_hint(node, fallback)
    return int(value)


def is_data_dependent(value: Any) -> bool:
    """True for a size known only when the graph runs (an unbacked symbol: the count of a ``nonzero``,
    a boolean mask's selection); its ``size_hint`` is an estimate."""
    return isinstance(value, torch.SymInt) and value.node.maybe_as_int() is None and not value.node.has_hint()


def _unbacked_hint(node: Any, fallback: int) -> int:
    """Torch's estimate of a data-dependent size (``torch.fx.experimental._size_hinting`` in 2.13,
    written here for 2.11 too): every unbacked symbol at ``fallback`` (``UNBACKED_FALLBACK``), held
    within the range torch proved for it (a ``nonzero`` of 256 elements counts at most 256), backed
    symbols at their hints."""
    import sympy

    env = node.shape_env
    try:
        expr = node.expr.xreplace(env.backed_var_to_val)
        values = {}
        for symbol in expr.free_symbols:
            value, bounds = fallback, env.var_to_range.get(symbol)
            if bounds is not None and isinstance(bounds.lower, (int, sympy.Integer)):
                value = max(value, int(bounds.lower))
            if bounds is not None and isinstance(bounds.upper, (int, sympy.Integer)):
                value = min(value, int(bounds.upper))
            values[symbol] = value
        return int(expr.xreplace(values))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):  # an expression sympy cannot make an int
        return fallback


def static_fakes(values: list[Any], like: Any) -> list[Any]:
    """Real tensors as fakes of the mode Dynamo traced the graph module ``like`` in (its ShapeEnv,
    every size static), as Dynamo handed them to the backend; a new mode with a ShapeEnv where
    ``like`` has none. An op whose output size depends on the data (``nonzero``, a mask's selection)
    traces there into an unbacked size: from real tensors AOTAutograd makes a mode without a
    ShapeEnv, which refuses it (``DynamicOutputShapeException``), and a new ShapeEnv names its sizes
    u0, u1, ... again, which the graph's bindings from Dynamo's trace already use ("possible memo
    disaster")."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    traced = [n.meta.get("example_value", n.meta.get("val")) for n in like.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode([v for v in traced if isinstance(v, torch.Tensor)])
    if mode is None or mode.shape_env is None:
        mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    return [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v for v in values]
