"""Donated buffers in a backward lowered while its forward compiles (private torch pieces).

AOTAutograd lets Inductor write a backward's buffers into the saved tensors it reads for the last
time ("donated buffers", ``functorch.config.donated_buffer``): Inductor's own backward, lowered at
its first call, writes the logits' gradient into the saved logits. fxoffload lowers a backward with
its forward where it judges a plan by the code (``force_non_lazy_backward_lowering``); that backward
keeps its donated buffers too, so a plan's code holds what Inductor's holds. Three things differ from
Inductor's own, and are handled here:

- The host copies fxoffload's reloads read are never donated (on a CPU they are CPU tensors like the
  device's; a host buffer must never become a kernel's output): ``lowering_backward``'s
  ``not_donated``, in every backward, lowered early or lazily.
- Saved tensors that share a storage (an activation and a view of it) are never donated: AOTAutograd
  donates both, and Inductor, seeing two inputs, writes into one while it reads the other.
- ``backward(retain_graph=True)``: code that writes into saved tensors would corrupt what a second
  backward reads, so AOTAutograd refuses to run a backward with donated buffers then, and lowers a
  lazy one without them when its first call keeps the graph. Lowered early, the runtime check is told
  this backward has none, and a call that keeps the graph runs the backward's FX graph as it stands
  (eagerly, said once in a warning), never the code that overwrites.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..warn import warn

_early = [0]  # backward_lowered_at_compile contexts open (compiles run on one thread)


def can_lower_backward_at_compile() -> bool:
    """Whether this torch has ``functorch.config.force_non_lazy_backward_lowering``."""
    return hasattr(functorch_config, "force_non_lazy_backward_lowering")


def donates_saved_buffers() -> bool:
    """Whether Inductor may write a backward's buffers into the saved tensors it reads last."""
    return bool(getattr(functorch_config, "donated_buffer", False))


@contextlib.contextmanager
def backward_lowered_at_compile() -> Iterator[bool]:
    """AOTAutograd lowers the backward while the forward compiles, not at the first backward call
    (``functorch.config.force_non_lazy_backward_lowering``), with donated buffers where torch's
    config has them (see the module's docstring for ``retain_graph``). Yields False, changing
    nothing, where this torch has no such option: the backward is then lowered lazily."""
    if not can_lower_backward_at_compile():
        yield False
        return
    _early[0] += 1
    try:
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            yield True
    finally:
        _early[0] -= 1


def lowering_backward(
    graph: fx.GraphModule, not_donated: frozenset[str]
) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """Called as ``graph``, a backward, is about to be lowered: its placeholders named in
    ``not_donated`` are taken out of the buffers Inductor may reuse. Returns the Inductor config to
    lower it with (``_cache_key``), and ``finish(compiled)``, to call on what Inductor compiled,
    where this backward is lowered early with donated buffers (else None)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    donated = list(getattr(meta, "bw_donated_idxs", None) or ())
    if donated:
        placeholders = list(graph.graph.find_nodes(op="placeholder"))
        kept_out = not_donated | _sharing_storage(placeholders)
        donated = [i for i in donated if i < len(placeholders) and placeholders[i].name not in kept_out]
        meta.bw_donated_idxs = donated  # what Inductor reads (``get_donated_idxs``) as it lowers
    if not _early[0] or not donated:
        return _cache_key(donated), None
    eager = _graph_copy(graph)  # before Inductor's passes change it; made a module when first run

    def finish(compiled: Any) -> Any:
        meta.bw_donated_idxs = []  # AOTAutograd's runtime check: a graph kept is handled here
        return _eager_when_graph_kept(compiled, eager)

    return _cache_key(donated), finish


def _sharing_storage(placeholders: list[fx.Node]) -> frozenset[str]:
    """The placeholders whose storage another placeholder shares (a saved activation and a saved view
    of it: ``relu`` and its transpose under torch's default partitioner). AOTAutograd checks a saved
    tensor against the forward's inputs and outputs and the backward's outputs, not against the other
    saved tensors, and donates both; Inductor, which sees two inputs, then wrote a gradient in place
    of one while the same kernel read the other (measured: a parameter's gradient near zero,
    ``bench.fuzz --seed 31 --case 23``). Such a placeholder is never donated."""
    from torch.multiprocessing.reductions import StorageWeakRef

    owners: dict[Any, list[str]] = {}
    for n in placeholders:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_sparse:
            owners.setdefault(StorageWeakRef(val.untyped_storage()), []).append(n.name)
    return frozenset(name for names in owners.values() if len(names) > 1 for name in names)


class _DonatedKey(CustomGraphPass):
    """A post-grad pass that changes nothing, there for its ``uuid``: the buffers donated."""

    def __init__(self, donated: tuple[int, ...]) -> None:
        self.donated = donated

    def __call__(self, graph: fx.Graph) -> None:
        pass

    def uuid(self) -> Any:
        return ("fxoffload: donated buffers", self.donated)


def _cache_key(donated: list[int]) -> dict[str, Any]:
    """Inductor's FX graph cache keys a backward on its graph and config, not on the buffers donated
    to it: code that writes into saved tensors came back from the cache for the same graph lowered
    without donated buffers (measured: a plan's early backward, in a later process), which a second
    backward through a kept graph would read corrupted. The donated buffers go into the key as a
    post-grad pass that does nothing; where the user has a pass of their own there, no cache."""
    if inductor_config.post_grad_custom_post_pass is not None:
        return {"fx_graph_cache": False}
    return {"post_grad_custom_post_pass": _DonatedKey(tuple(donated))}


def _graph_copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.Graph]:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return gm, graph


def _eager_when_graph_kept(compiled: Any, eager: tuple[fx.GraphModule, fx.Graph]) -> Any:
    """``compiled`` (Inductor's ``CompiledFxGraph``, boxed: it takes the argument list and empties
    it) running the graph of ``eager`` (its root module, the graph) instead where the autograd call
    keeps the graph (``retain_graph``)."""
    run = getattr(compiled, "current_callable", None)
    if run is None:  # stopped for its code, or not Inductor's: nothing that runs to guard
        return compiled
    module: list[fx.GraphModule] = []

    def current_callable(args: list[Any]) -> Any:
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            return run(args)
        if not module:
            module.append(fx.GraphModule(*eager))
            warn(
                "fxoffload: backward(retain_graph=True) through a backward Inductor lowered with donated "
                "buffers (it writes into saved tensors a second backward reads): its FX graph runs "
                "eagerly instead, slower; torch._functorch.config.donated_buffer=False compiles it "
                "without them",
                UserWarning,
            )
        out = module[0](*args)
        args.clear()
        return out

    compiled.current_callable = current_callable
    return compiled
