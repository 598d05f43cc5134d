"""The layout of each host copy: the one Inductor's forward returns the saved tensor in.

Inductor returns each saved tensor in a layout of its choosing: as traced, or, where it optimizes
layouts around convolutions, channels-last for a 4-D tensor it prefers so (``GraphLowering.run_node``
on a graph output). An offload's host copy is what the forward returns (its wait's result); a copy
in any other layout has Inductor restride it after the wait, on the host, into a buffer of its own
that it returns instead. On a CPU that buffer is device memory: the tensor never left the peak. On a
GPU it is pageable host memory that host code writes after the wait (which then blocks the host:
``runtime.transfers.wait_on_host``), and its reload is synchronous. So each offload is told the layout
Inductor will want (its ``stride`` argument, ``ir``), and copies its source into it, whatever layout
Inductor chose for the source.

Where Inductor does not force a layout on the wait, that layout is the one Inductor would have
returned the source in without offloading: the backward then reads its reload in the layout it reads
the saved tensor in without fxoffload, and runs the same kernels (the same rounding). Inductor's
preference spreads from convolutions to their readers only up to the forward's last convolution, so
a wait after the last one is not preferred even where its source, that convolution, is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from .. import _compat
from ..analysis.graph import is_dense
from ..ir import OFFLOAD, RELOAD, WAIT, fake_impl, is_transfer

__all__ = ["host_layouts", "wanted_stride"]


def wanted_stride(
    x: torch.Tensor, wait: fx.Node, channels_last: set[fx.Node] | None, source: fx.Node | None = None
) -> list[int] | None:
    """The stride Inductor will return ``wait``'s result in, the host copy of ``x`` (the traced value
    of ``source``): channels-last where Inductor prefers that for ``wait`` (it forces it then) or for
    ``source`` (it would have returned the source so; ``channels_last``, None: not known), else ``x``'s
    traced stride. None, the source's layout at run time, where a stride is symbolic or a size depends
    on the data (Inductor may lay such a buffer out with the data-dependent size in a stride, (u0, 1)
    as (1, u0), and comparing layouts would ask whether u0 is 1: a guard on data the compile has not)."""
    if not all(isinstance(s, int) for s in x.stride()) or any(_compat.is_data_dependent(s) for s in x.shape):
        return None
    if channels_last and (wait in channels_last or source in channels_last) and x.dim() == 4 and is_dense(x):
        return list(torch.empty(x.shape, device="meta").to(memory_format=torch.channels_last).stride())
    return list(x.stride())


def host_layouts(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    host_name: Callable[[str], str],
    broken: str | None = None,
    inductor: bool = True,
) -> None:
    """Give each offload of the rewritten ``fw`` the layout its host copy is returned in, and the
    values of its wait, of the backward placeholder that receives it (named ``host_name(source)``,
    ``transfers.host_placeholder_name``) and of that placeholder's reloads that layout. Without
    Inductor (``inductor=False``: ``inner="aot_eager"``) nothing is laid out channels-last: each copy
    as traced."""
    offloads = [n for n in fw.graph.nodes if is_transfer(n, OFFLOAD)]
    if not offloads or broken == "host_copy_in_compilers_layout":
        return
    channels_last = _compat.inductor_channels_last_nodes(fw) if inductor else set()
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    for copy in offloads:
        waits = [u for u in copy.users if is_transfer(u, WAIT) and u.args[0] is copy]
        if len(waits) != 1:
            continue
        (wait,) = waits
        src = copy.args[0].meta["val"]
        stride = wanted_stride(src, wait, channels_last, copy.args[0])
        copy.args = (*copy.args[:4], stride)
        with src.fake_mode:
            val = fake_impl(OFFLOAD)(src, [], *copy.args[2:])
        copy.meta["val"] = wait.meta["val"] = val
        host = placeholders.get(host_name(copy.args[0].name))
        if host is not None:
            host.meta["val"] = val
            _reloads_follow(host)


def _reloads_follow(host: fx.Node) -> None:
    """The values of the reloads of the backward placeholder ``host`` (and of their waits) in its new
    layout: a reload returns its host copy's."""
    for reload in [u for u in host.users if is_transfer(u, RELOAD)]:
        val = host.meta["val"]
        with val.fake_mode:
            reload.meta["val"] = fake_impl(RELOAD)(val, *reload.args[1:2], [], *reload.args[3:])
        for wait in [u for u in reload.users if is_transfer(u, WAIT) and u.args[0] is reload]:
            wait.meta["val"] = reload.meta["val"]
