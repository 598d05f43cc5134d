"""fxoffload's changes to how Inductor lowers its transfer ops (torch's private lowering API).

The code Inductor generates for a graph depends on these beyond the graph and Inductor's config, so
this file's source is part of the key Inductor's FX graph cache files that code under
(``scheduler_runs._JOIN_KEY``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .scheduler_runs import TransferOps

__all__ = ["inductor_runs_as_fallback", "register_fallbacks"]


def register_fallbacks(ops: TransferOps) -> None:
    """Inductor's fallback lowering of each transfer op, registered as Inductor registers it at the
    first graph that calls the op (``GraphLowering.call_function``'s implicit fallback), but before
    any graph is lowered; the offload's wrapped so that it reads the buffer its wait keeps alive
    (``_one_source``). That registration also puts the op among those whose inputs are realized,
    which changes how a later graph lowers a value such an op reads beside other users: on torch
    2.11 the first fxoffload compile of a process fused a one-block GPT's token embedding into its
    layer norm's kernel and every later compile of the same FX graph realized it (5 against 6
    forward kernel calls). Registered first, each compile lowers as the later ones did."""
    from torch._inductor.lowering import get_layout_constraint_tag, lowerings, make_fallback, tag_to_layout_constraint

    for op in ops.all:
        if op not in lowerings:
            make_fallback(op, layout_constraint=tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True)))
    if not getattr(lowerings[ops.offload], "one_source", False):
        lowerings[ops.offload] = _one_source(lowerings[ops.offload])


def inductor_runs_as_fallback(op: object) -> bool:
    """Whether Inductor runs ``op`` as a call of the op itself (a fallback: ``aten.convolution_backward``,
    the attention kernels, a custom op) rather than lowering or decomposing it into its own kernels."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import fallbacks, lowerings

    if not isinstance(op, torch._ops.OpOverload):
        return False
    return op in fallbacks or (op not in lowerings and op not in select_decomp_table())


def _one_source(lower: Callable[..., Any]) -> Callable[..., Any]:
    """The offload's lowering, with its source realized once, in the value its other readers get.

    A fallback's input that is a view Inductor cannot express as a view of a buffer (the value of
    ``nn.MultiheadAttention``'s V, a permute of a select of a reshape of a fused clone) is copied
    into a new buffer for that op alone (``ExternKernel.realize_input``, then ``copy_input``): the
    offload read one copy and its wait kept another alive, and the one being read was deleted right
    after the offload (on a GPU free to be reused mid-copy). Realized here and put in the value's
    box, the wait and every later reader get the buffer the offload reads."""
    from torch._inductor import ir as inductor_ir

    @functools.wraps(lower)
    def offload(src: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(src, inductor_ir.TensorBox):
            realized = inductor_ir.ExternKernel.realize_input(src)
            if isinstance(realized, inductor_ir.TensorBox):  # a copy made for this reader alone
                src.data = realized.data
        return lower(src, *args, **kwargs)

    offload.one_source = True  # type: ignore[attr-defined]
    return offload
