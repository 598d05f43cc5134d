"""The IR of a transfer: four custom ops, their schemas and fake functions. The contract between the
pass (which inserts them) and the runtime (which implements them, ``fxoffload.runtime``).

Every transfer is two nodes in the graph, found by ``node.target``, never by name or position::

    forward, one offloaded tensor ``x`` whose last forward readers are ``u1 .. uk``:
        x_host = fxoffload.offload(x, [u1, .., uk])  # D2H copy on the transfer stream into a host buffer,
                                                     # in the layout the forward returns it in (``stride``)
        x_host = fxoffload.wait(x_host, x, [b])     # compute stream waits on the copy; x dies after this
        return (..., x_host)                        # the host copy is saved for backward, x is not

    backward, ``a`` being the node the plan issues the reload after:
        x_dev = fxoffload.reload(x_host, device, [a]) # H2D copy into a buffer allocated on the compute stream
        x_dev = fxoffload.wait(x_dev, x_host, [])   # compute stream waits on the copy
        first_use(x_dev)

    c = fxoffload.order(input_of_c, [copy])          # makes kernel ``c`` come after ``copy`` is issued

The one hard rule: a storage that a transfer reads or writes stays alive through a graph edge to the
transfer's ``wait`` (its ``keepalive`` argument), and ``wait`` makes the compute stream wait on the
transfer before that edge ends. The ``after`` lists are data edges that pin a copy behind the nodes
it must follow, so schedulers that reorder (Inductor's ``reorder_for_peak_memory``) cannot break it.

A copy can be switched off at run time (``runtime.transfers.switch_copies_off``, by its ``name``):
the same four ops run, the offload keeps a copy of ``x`` on the device, held by the host tensor it
returns, and the reload gives that copy back; the graph and its ordering are unchanged.

This module defines the ops and what they look like to a tracer (their fake functions); it runs
nothing. ``fxoffload.runtime.transfers`` registers what they do on real tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import dataclasses

import torch
import torch.fx as fx

__all__ = [
    "LIBRARY", "OFFLOAD", "ORDER", "RELOAD", "TRANSFER_OPS", "TransferTime", "WAIT", "fake_impl", "host_stride",
    "is_transfer", "transfer_name",
]  # fmt: skip

LIBRARY = "fxoffload"

_lib = torch.library.Library(LIBRARY, "DEF")
# flexible_layout: Inductor passes the buffers as they are. The default for custom ops
# (needs_exact_strides) made it copy a padded CUDA buffer into a fresh one for each op, so the copy
# and its wait saw different buffers and the one being copied was freed before the wait.
_TAGS = (torch.Tag.flexible_layout,)
# ``name``: which saved tensor the copy moves, as "<graph id>:<tensor>" (``TransferTime.name``).
# ``stride``: the layout the host copy takes, the one the forward returns the saved tensor in
# (``rewrite.host_layout``; None: the source's, ``host_stride``). A host copy in another layout (the one
# Inductor chose for the source: a convolution's output channels-last, returned as traced) made
# Inductor's forward restride it on the host after the wait, into a new buffer it saved instead (on a
# CPU a device buffer: nothing left the device; on a GPU a pageable one, written after a wait that
# must then block the host).
_lib.define(
    "offload(Tensor src, Tensor[] after, float bandwidth=0., str name='', int[]? stride=None) -> Tensor", tags=_TAGS
)
_lib.define(
    "reload(Tensor host, Device device, Tensor[] after, float bandwidth=0., str name='') -> Tensor", tags=_TAGS
)
_lib.define("wait(Tensor(a) dest, Tensor keepalive, Tensor[] after) -> Tensor(a)", tags=_TAGS)
_lib.define("order(Tensor(a) x, Tensor[] after) -> Tensor(a)", tags=_TAGS)


def host_stride(size: Sequence[int], src: Sequence[int], wanted: Sequence[int] | None) -> tuple[int, ...]:
    """The stride of an offload's host copy of a source laid out ``src``: ``wanted`` (its ``stride``
    argument), or ``src`` itself where it orders the dimensions as ``wanted`` does (the same layout,
    maybe padded: Inductor's CUDA buffers, which it accepts padded where it returns them, and which the
    copy then moves as one run of bytes, padding included). Both the fake function (at Inductor's
    lowering) and the run time decide by it, so the code's layout asserts hold."""
    if wanted is None or tuple(wanted) == tuple(src):
        return tuple(src)

    def order(stride: Sequence[int]) -> list[int]:
        return sorted((d for d in range(len(size)) if size[d] != 1), key=lambda d: (stride[d], -d))

    return tuple(src) if order(src) == order(wanted) else tuple(wanted)


def _offload_fake(
    src: torch.Tensor, after: Sequence[torch.Tensor], bandwidth: float = 0.0, name: str = "",
    stride: Sequence[int] | None = None,
) -> torch.Tensor:
    return torch.empty_strided(src.size(), host_stride(src.size(), src.stride(), stride), dtype=src.dtype, device="cpu")


def _reload_fake(
    host: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor], bandwidth: float = 0.0, name: str = ""
) -> torch.Tensor:
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


def _wait_fake(dest: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return dest


def _order_fake(x: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return x


_FAKES: dict[str, Callable[..., torch.Tensor]] = {
    "offload": _offload_fake, "reload": _reload_fake, "wait": _wait_fake, "order": _order_fake,
}  # fmt: skip
for _name, _fake in _FAKES.items():
    torch.library.register_fake(f"{LIBRARY}::{_name}", lib=_lib)(_fake)

OFFLOAD = torch.ops.fxoffload.offload.default
RELOAD = torch.ops.fxoffload.reload.default
WAIT = torch.ops.fxoffload.wait.default
ORDER = torch.ops.fxoffload.order.default
TRANSFER_OPS = frozenset({OFFLOAD, RELOAD, WAIT, ORDER})

# The copies have effects the graph does not see (a registered event); never dead-code eliminate them.
for _op in TRANSFER_OPS:
    torch.fx.node.has_side_effect(_op)


def fake_impl(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    """The fake function of one of the ops, to build ``meta["val"]`` without dispatching."""
    return _FAKES[op._opname]


def is_transfer(node: fx.Node, op: torch._ops.OpOverload | None = None) -> bool:
    """Whether ``node`` calls one of the transfer ops (``op``: that one)."""
    if node.op != "call_function":
        return False
    return node.target is op if op is not None else node.target in TRANSFER_OPS


def transfer_name(graph_id: int, saved: str) -> str:
    """The ``name`` argument of the copies of saved tensor ``saved`` of graph ``graph_id``."""
    return f"{graph_id}:{saved}"


@dataclasses.dataclass(frozen=True)
class TransferTime:
    """One copy as the device ran it (``runtime.timing``), in seconds. The window is the compute
    stream's time from the copy's issue to its wait: what the copy can hide behind."""

    name: str  # ``transfer_name(graph id, saved tensor)``
    direction: str  # "d2h" (an offload) or "h2d" (a reload)
    nbytes: int
    window_s: float  # compute between the copy's issue and its wait
    copy_s: float  # the copy itself, on its link
    stall_s: float  # how long the compute stream waited for it at the wait
    # The compute stream's own time in the copy's calls, stall apart: its offload or reload (on a CPU
    # the thread that makes the call; on an accelerator the gap between events recorded at the call's
    # start and end, zero while the host runs ahead of the device), and on a CPU its wait's work.
    op_s: float = 0.0
    # On an accelerator, the host's time from the issue to the wait: where the compute stream's own
    # time from issue to wait (``stream_window_s``) was about as long, the device waited on the host
    # to issue its kernels (a host-bound phase), and any host time of the op calls there is step time.
    # None on a CPU (the host is the stream), and where the device had not yet reached the issue
    # when the host reached the wait: it was a whole window behind, not waiting on the host.
    host_window_s: float | None = None
    # The compute stream's time from issue to wait as it ran, the other copies' stalls and calls in
    # it (``window_s`` is it less those); None: not measured apart.
    stream_window_s: float | None = None

    @property
    def graph_id(self) -> int:
        return int(self.name.split(":", 1)[0]) if ":" in self.name else -1

    @property
    def tensor(self) -> str:
        return self.name.split(":", 1)[-1]
