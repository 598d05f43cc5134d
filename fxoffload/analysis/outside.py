"""What code before a compiled graph holds on its device while the graph runs. Pure, reads tensors.

A compiled graph is rarely the whole step: an encoder that Dynamo cannot trace runs eagerly, a graph
break splits a model in two. What that earlier code saved for its backward is on the device from
before this graph's forward until after this graph's backward (autograd runs the backward of earlier
code later), so it belongs to every point of this graph's timeline, and it is none of the graph's
own tensors. A backend sees it through the real tensors Dynamo passes at compile time: the autograd
graph behind each input (its ``grad_fn`` and what that node reaches) holds the saved tensors.

    outside = read_outside_memory(example_inputs, torch.device("cuda", 0))
    outside.held_bytes         # "outside" at every point of the graph's timeline
    outside.saved_bytes        #   of it, what earlier code saved for its backward
    outside.params_bytes       #   and its parameters, with their gradients where they exist
    outside.made_inputs_bytes  # inputs that earlier code made in this step: not live at its start

Counted, on ``device``, each storage once and none of the graph's own inputs (its timeline has
them): the tensors saved by the nodes reached, less fxoffload's own host buffers; apart, the
parameters of that code (the leaves its gradients accumulate into, found at their
``AccumulateGrad`` nodes, and ``nn.Parameter``s it saved, a frozen weight) and the gradients those
leaves hold already. Those were live before the step, so ``report.start_bytes`` has them too.
Saved tensors behind a pack hook (``save_on_cpu``, checkpointing) are read without unpacking: what
the hook returned counts if it is a tensor on ``device``.

Not seen, so not counted: tensors earlier code holds outside autograd (a cache, a Python variable),
an optimizer's state, buffers saved by earlier code (counted as if made in the step: they cannot be
told from a mask made there), parameters of code after this graph, and what that code allocates
(an eager LM head after per-layer blocks; a later graph's gradients). Read when the graph
compiles, and again at its first calls (``compiler.watch.CallWatch``): a graph run again later in the
step (a block compiled once and run per layer) holds more there, partly what its own earlier calls
saved, which changes with its plan (``calls``).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._compat import is_fake, saved_tensor_payload
from ..sizes import fmt_bytes, tensor_bytes
from .memory import CallOutside, outside_at

log = logging.getLogger(__name__)

__all__ = ["OutsideMemory", "graph_device", "mark_call", "read_outside_memory"]

# Autograd nodes read at most (about 20 us each on a CPU): an eager prefix of a big model has
# thousands; this bounds a pathological one to about 2 s per compile.
MAX_NODES = 100_000


@dataclasses.dataclass(frozen=True)
class OutsideMemory:
    """Device bytes that code before a compiled graph holds while the graph runs (see the module)."""

    saved_bytes: int  # saved by earlier autograd nodes, on the graph's device: "outside" in its timeline
    # The graph's own inputs made by earlier code in this step (an op's output, not a view of a
    # parameter or a leaf), at the bytes the graph's timeline counts them with.
    made_inputs_bytes: int
    nodes: int  # autograd nodes read
    largest: tuple[tuple[str, int], ...] = ()  # the nodes saving the most bytes: (node name, bytes)
    complete: bool = True  # False: reading stopped at ``MAX_NODES``, more may be held
    # Parameters of that code (and other leaves its gradients go to, frozen weights it saved), with
    # their gradients where they exist, on the device: live before the step and through it, in no
    # graph's timeline but this one's "outside" (another block's weights, an eager encoder's).
    params_bytes: int = 0
    # A graph run several times in a step (a block compiled once and run per layer, read at its
    # calls: ``compiler.watch.CallWatch``) is planned for its calls at once: what each holds, less what
    # the earlier calls of the same graph keep (that changes with its plan), and the gradients of the
    # calls after it during its backward. Empty: one call, holding ``held_bytes``.
    calls: tuple[CallOutside, ...] = ()
    # Read with a ``mark``: an earlier call of the same graph is among that code (``mark_call``).
    reaches_mark: bool = dataclasses.field(default=False, compare=False)

    @property
    def held_bytes(self) -> int:
        """All that code before the graph holds on its device: what it saved, and its parameters."""
        return self.saved_bytes + self.params_bytes

    def outside(self, kept_per_call: int, phase: str = "forward") -> int:
        """"outside" at a point of ``phase`` for a plan whose call keeps ``kept_per_call`` saved bytes
        on the device (``memory.kept_saved_bytes``): the earlier calls of the same graph run that
        plan too."""
        return outside_at(self.calls, phase, kept_per_call) if self.calls else self.held_bytes

    def outside_backward(self, kept_per_call: int) -> int:
        """How much more "outside" is during the backward than during the forward."""
        return self.outside(kept_per_call, "backward") - self.outside(kept_per_call)

    def summary(self) -> str:
        text = f"{fmt_bytes(self.saved_bytes)} saved by code before this graph ({self.nodes} autograd nodes)"
        if self.largest:
            text += ", most by " + ", ".join(f"{name} {fmt_bytes(n)}" for name, n in self.largest)
        if self.params_bytes:
            text += f"; and {fmt_bytes(self.params_bytes)} of its parameters, with their gradients where they have any"
        if self.calls:
            text += (
                f"; planned for {len(self.calls)} of its calls in a row, the last after "
                f"{max(c.repeats for c in self.calls)} calls of this graph that run its plan too, the first "
                f"with {fmt_bytes(max(c.backward for c in self.calls))} of later calls' gradients in its "
                "backward"
            )
        if not self.complete:
            text += f"; reading stopped after {self.nodes} nodes, more may be held"
        return text


def graph_device(inputs: Iterable[Any]) -> torch.device:
    """The device a graph's memory is on: that of its first accelerator input, else the CPU."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


def read_outside_memory(
    inputs: Sequence[Any],
    device: torch.device,
    host_buffers: Sequence[tuple[int, int]] = (),
    largest: int = 3,
    mark: object | None = None,
    max_nodes: int = MAX_NODES,
) -> OutsideMemory:
    """The autograd graph behind ``inputs`` (a compiled graph's real example inputs), read on
    ``device``. Reads only: no saved tensor is unpacked, no hook called. ``host_buffers``:
    ``(address, nbytes)`` of fxoffload's own host buffers (``runtime.host_buffer_ranges``), left out
    on a CPU, where they are not told from the device's memory by their device. A tensor whose storage
    cannot be read (a wrapper subclass such as DTensor) is skipped; fake inputs give nothing.
    ``mark``: ``reaches_mark`` says whether a compiled function's backward node that ``mark_call``
    marked with it is among the nodes read (an earlier call of the same graph, backward pending)."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if not any(_has_history(t) for t in tensors) or any(is_fake(t) for t in tensors):
        # No input an op made (a model's first graph: parameters and data): no node to read, nothing
        # made; said at once, since the graph's first calls pay for this read on the host.
        return OutsideMemory(0, 0, 0)
    own = {k for k in map(_storage_key, tensors) if k is not None}
    nodes, complete = _reachable([t.grad_fn for t in tensors if t.grad_fn is not None], max_nodes)
    leaves = set()
    params: dict[tuple[int, int], int] = {}  # parameters, leaves and their gradients, on ``device``
    for node in nodes:
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf its gradient goes to
        if isinstance(variable, torch.Tensor):
            leaves.add(_storage_key(variable))
            for t in (variable, variable.grad):
                _count(params, t, device, own)
    made = {}
    for t in tensors:
        key, root = _storage_key(t), t._base if t._base is not None else t
        op_made = root.grad_fn is not None and not _is_parameter(t)  # not a parameter's view or a leaf's
        if key is not None and op_made and key not in leaves and _on(t, device):
            made[key] = made.get(key, 0) + tensor_bytes(t)  # as the graph's timeline counts it
    host = _HostRanges(host_buffers) if device.type == "cpu" else None  # elsewhere a host buffer is never on the device
    counted: dict[tuple[int, int], int] = {}
    by_node: dict[str, int] = {}
    reaches = mark is not None and any(
        node.name().startswith("CompiledFunction") and node.metadata.get(_MARK) is mark for node in nodes
    )
    for node in nodes:
        for t in _saved_tensors(node):
            key = _storage_key(t)
            if _is_parameter(t):  # a frozen weight saved (one with a gradient is a leaf, above)
                _count(params, t._base if t._base is not None else t, device, own)
                continue
            if (
                key is None or key in counted or key in own or key in leaves or not _on(t, device)
                or (host is not None and key[0] in host)
            ):  # fmt: skip
                continue
            counted[key] = key[1]
            name = node.name()
            by_node[name] = by_node.get(name, 0) + key[1]
    top = sorted(by_node.items(), key=lambda kv: -kv[1])[:largest]
    return OutsideMemory(
        sum(counted.values()), sum(made.values()), len(nodes), tuple(top), complete,
        params_bytes=sum(params.values()), reaches_mark=reaches,
    )  # fmt: skip


_MARK = "fxoffload_call"  # the key of ``mark_call``'s mark in an autograd node's ``metadata``


def mark_call(outputs: Any, mark: object) -> None:
    """Mark the backward node of a compiled call (the ``CompiledFunctionBackward`` behind its
    outputs) with ``mark``, for ``read_outside_memory(..., mark=mark)`` at a later call. The mark lives
    as long as the node: until that call's backward ran."""
    for t in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        for _ in range(3):  # an output that is a view: its view node, then the compiled function's
            if node is None or node.name().startswith("CompiledFunction"):
                break
            node = next((fn for fn, _ in node.next_functions if fn is not None), None)
        if node is not None and node.name().startswith("CompiledFunction"):  # only those are looked at
            node.metadata[_MARK] = mark
            return


def _count(into: dict[tuple[int, int], int], t: Any, device: torch.device, own: set) -> None:
    """Add the storage of ``t`` (a tensor on ``device``, none of the graph's own inputs) to ``into``."""
    if isinstance(t, torch.Tensor) and _on(t, device):
        key = _storage_key(t)
        if key is not None and key not in own:
            into[key] = key[1]


def _reachable(roots: list[Any], max_nodes: int) -> tuple[list[Any], bool]:
    """The autograd nodes reachable from ``roots``, and whether that is all of them (``max_nodes``)."""
    seen: dict[int, Any] = {}
    stack = list(roots)
    while stack and len(seen) < max_nodes:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(fn for fn, _ in getattr(node, "next_functions", ()) if fn is not None)
    return list(seen.values()), not any(n is not None and id(n) not in seen for n in stack)


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}  # per autograd node type: its ``_raw_saved_*`` names


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    """The tensors ``node`` saved (C++ nodes: ``_raw_saved_<name>``, a list for a tensor list;
    Python functions: ``_raw_saved_tensors``), read without unpacking."""
    attrs = _SAVED_ATTRS.get(type(node))
    if attrs is None:
        attrs = _SAVED_ATTRS[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    out = []
    for attr in attrs:
        try:
            raw = getattr(node, attr)
        except RuntimeError:  # freed by a backward that already ran
            continue
        for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
            payload = saved_tensor_payload(saved)
            if isinstance(payload, torch.Tensor):
                out.append(payload)
    return out


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of ``t``'s storage; None where it has none to read (a wrapper subclass)."""
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _has_history(t: torch.Tensor) -> bool:
    """Whether an autograd node made ``t`` or the tensor it views."""
    return t.grad_fn is not None or (t._base is not None and t._base.grad_fn is not None)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class _HostRanges:
    """fxoffload's host buffers, searched by address."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [start for start, _ in self.ranges]

    def __contains__(self, address: int) -> bool:
        i = bisect.bisect_right(self.starts, address) - 1
        return i >= 0 and address < self.ranges[i][0] + self.ranges[i][1]
