"""What Dynamo's graph says before it is compiled (from its placeholders' and outputs' example values),
and a copy of it to plan again from."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx

from .. import _compat

__all__ = ["copy_graph_module", "may_have_a_backward", "may_return_only_scalars", "static_shapes"]


def may_return_only_scalars(gm: fx.GraphModule) -> bool:
    """False when Dynamo's graph returns something other than 0-dim tensors (Dynamo's example values):
    then no pair of it returns a loss alone, and verify_peak need not lower its backward at compile
    time. True where it cannot tell."""
    outputs = gm.graph.output_node().args[0]
    for o in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
        val = o.meta.get("example_value", o.meta.get("val")) if isinstance(o, fx.Node) else o
        if isinstance(val, torch.Tensor) and val.dim() != 0:
            return False
    return True


def static_shapes(gm: fx.GraphModule) -> bool:
    """Every input of Dynamo's graph a tensor of fixed sizes: it can be compiled again from its
    arguments at any call without fixing a size Dynamo left dynamic."""
    try:
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("example_value", node.meta.get("val"))
            if not isinstance(val, torch.Tensor):
                return False
            if not all(isinstance(n, int) for n in (*val.shape, *val.stride(), val.storage_offset())):
                return False
    except Exception:  # a layout without strides (sparse, nested): not compiled again
        return False
    return True


def may_have_a_backward(gm: fx.GraphModule) -> bool:
    """Whether AOTAutograd may make a backward for Dynamo's graph: grad mode on and an input (a
    parameter, lifted) that requires grad. True where it cannot tell."""
    if not torch.is_grad_enabled():
        return False
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value", node.meta.get("val"))
        if not isinstance(val, torch.Tensor) or val.requires_grad:
            return True
    return False


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph can be changed without changing ``gm``'s; its tensors (parameters,
    buffers, constants: on a GPU, possibly gigabytes) are shared, not copied."""
    memo: dict[int, Any] = {}
    for module in gm.modules():
        for value in vars(module).values():
            for t in value.values() if isinstance(value, dict) else (value,):
                if isinstance(t, torch.Tensor):
                    memo[id(t)] = t
    out = copy.deepcopy(gm, memo)
    _compat.copy_dynamo_metadata(gm, out)  # its parameters stay static inputs
    return out
