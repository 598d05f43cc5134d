"""Where the rewrite put each offloaded tensor's host copy, read back from the rewritten pair; and the
device memory of the compiled code with the copies that were switched off at run time.

The compiler's decisions read these through ``PlannedPair`` (the watch, after a switch); the report
copies them for people. One home for the rule "a copy switched off at run time is held on the
device from its offload to its reload".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import torch.fx as fx

from ..analysis.code_copies import replay_pair
from ..analysis.graph import storage_users
from ..analysis.memory import MemoryTimeline, bytes_over_points
from ..ir import OFFLOAD, RELOAD, WAIT, is_transfer
from ..sizes import tensor_bytes
from .transfers import host_placeholder_name

__all__ = ["HostCopy", "find_host_copies", "replay_switched_off", "switched_off_held", "switched_off_hosts"]


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """The host copy of one offloaded tensor, over the points of the FX memory model of the rewritten
    pair (``memory_after``).

    Host memory, not device memory: the memory model leaves it out of every device figure."""

    name: str  # the saved tensor it copies (forward node)
    host_name: str  # the backward placeholder that holds it
    nbytes: int  # bytes of the host copy (the tensor's bytes, as ``host_bytes_total`` counts them)
    first: int  # point of ``memory_after`` where ``fxoffload.offload`` takes it (forward)
    last: int  # point after which it is released: its placeholder's last backward reader
    # Points over which its reload's device destination is live (-1: no reload). The memory model counts
    # that destination as "transient"; breakdowns and the plot count it with the saved activations.
    reload_first: int = -1
    reload_last: int = -1


def find_host_copies(
    fw: fx.GraphModule, bw: fx.GraphModule, after: MemoryTimeline | None
) -> tuple[HostCopy, ...]:
    """Every offloaded tensor's host copy over the points of ``after`` (the memory model on the rewritten
    ``fw``, ``bw``: one point per node but the outputs). The forward returns the host copy (an
    ``offload``, through its ``wait``) among its saved values; the backward receives it in the
    placeholder the rewrite named after the saved tensor (``host_placeholder_name``, as ``apply_plan``
    finds the saved tensor's placeholder by its forward name)."""
    fw_nodes = [n for n in fw.graph.nodes if n.op != "output"]
    bw_nodes = [n for n in bw.graph.nodes if n.op != "output"]
    names = [(p.phase, p.node) for p in after.points] if after is not None else []
    if names != [("forward", n.name) for n in fw_nodes] + [("backward", n.name) for n in bw_nodes]:
        return ()  # not the timeline of these graphs (the graphs were left unchanged)
    placeholders = {n.name: n for n in bw_nodes if n.op == "placeholder"}
    fw_index = {n: i for i, n in enumerate(fw_nodes)}
    bw_index = {n: len(fw_nodes) + i for i, n in enumerate(bw_nodes)}
    copies = []
    for out in fw.graph.output_node().args[0]:
        copy = out
        while isinstance(copy, fx.Node) and is_transfer(copy, WAIT):
            copy = copy.args[0]
        if not (isinstance(copy, fx.Node) and is_transfer(copy, OFFLOAD)):
            continue
        source = copy.args[0]
        held = placeholders.get(host_placeholder_name(source.name)) if isinstance(source, fx.Node) else None
        if held is None:
            continue
        last = max((bw_index[u] for u in held.users if u in bw_index), default=len(fw_nodes))
        reloads = [u for u in held.users if is_transfer(u, RELOAD)]
        # The reload's destination lives from the reload to its last reader through any alias (its wait).
        reload_first = bw_index[reloads[0]] if reloads else -1
        reload_users = storage_users(reloads[0]) if reloads else []
        reload_last = max((bw_index[u] for u in reload_users if u in bw_index), default=reload_first)
        copies.append(HostCopy(source.name, held.name,
                               tensor_bytes(copy.meta["val"]), fw_index[copy], last,
                               reload_first, reload_last if reloads else -1))  # fmt: skip
    return tuple(copies)


def switched_off_held(copies: Sequence[HostCopy], names: Collection[str], points: int) -> list[int]:
    """Device bytes the copies of ``names`` switched off at run time keep at each of ``points`` points
    of the memory model they were found over: each from its offload to its reload, which gives the
    copy kept on the device back (the model counts the reload's result from there)."""
    return bytes_over_points(points, [
        (c.first, c.reload_first if c.reload_first >= 0 else c.last + 1, c.nbytes) for c in copies if c.name in names
    ])  # fmt: skip


def switched_off_hosts(copies: Sequence[HostCopy], switched_off: Collection[str]) -> set[str]:
    """The backward placeholders that hold the host copies of ``switched_off`` (each a handle of a
    copy kept on the device)."""
    return {c.host_name for c in copies if c.name in switched_off}


def replay_switched_off(
    output_code: Mapping[str, str],
    num_fwd_outputs: int | None,
    outside: int,
    outside_backward: int,
    copies: Sequence[HostCopy],
    switched_off: Collection[str],
    scratch: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> MemoryTimeline | None:
    """The replay of the code Inductor generated (``analysis.code_copies.replay_pair``), the host copies
    of ``switched_off`` counted on the device (their offloads keep a copy there), the calls' measured
    ``scratch`` (``(line, bytes)`` by graph) counted where they run. None until both graphs are
    compiled, and with ``inner="aot_eager"``."""
    kept = switched_off_hosts(copies, switched_off)
    listed = [(c.host_name, c.first, c.nbytes) for c in copies] if kept else ()
    return replay_pair(output_code, num_fwd_outputs, outside, outside_backward, listed, kept, scratch)
