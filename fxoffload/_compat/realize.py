"""When Inductor's lowering stores a pointwise expression in a buffer rather than inline it into its
readers (torch's private config and IR; read by ``analysis.fusion``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

from torch._inductor import config as inductor_config


@dataclasses.dataclass(frozen=True)
class RealizeLimits:
    """When Inductor's lowering stores a pointwise expression in a buffer rather than inline it into
    its readers (``analysis.fusion``): read by several ops, past ``reads`` buffers read or ``opcount``
    ops; read by any, past ``acc_reads``."""

    reads: int
    opcount: int
    acc_reads: int


def inductor_realize_limits(cpu: bool) -> RealizeLimits:
    """Inductor's realize thresholds from its config: a fixed value where one is set, else the
    device's default (torch 2.13 leaves ``realize_opcount_threshold`` and
    ``realize_acc_reads_threshold`` None and keeps a CPU value and a GPU value; torch 2.11 sets one
    for both)."""

    def pick(name: str, fallback: int) -> int:
        value = getattr(inductor_config, name, None)
        if value is None:
            stem = name.removeprefix("realize_")
            value = getattr(inductor_config, f"realize_cpu_{stem}" if cpu else f"_realize_{stem}_default", None)
        return int(value) if value is not None else fallback

    return RealizeLimits(pick("realize_reads_threshold", 4), pick("realize_opcount_threshold", 30),
                         pick("realize_acc_reads_threshold", 8))  # fmt: skip


# The ops torch 2.13's Inductor counts heavy (``StorageBox.should_realize_on_reuse``): where its source
# cannot be read (a frozen install), the list the model was measured against.
_HEAVY_ON_CPU_2_13 = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


@functools.cache
def inductor_heavy_ops_on_cpu() -> frozenset[str]:
    """The ops whose result Inductor's lowering stores on a CPU, rather than compute it again in each
    of several readers (``analysis.fusion``): the ``heavy_ops`` of the installed Inductor's
    ``StorageBox.should_realize_on_reuse``, read from its source. Torch 2.11 lists ``exp`` and
    ``sigmoid``; 2.13 adds ``log``, ``log10``, ``log1p``, ``log2`` and ``tanh``."""
    from torch._inductor import ir

    try:
        source = inspect.getsource(ir.StorageBox.should_realize_on_reuse)
    except (AttributeError, OSError, TypeError):
        return _HEAVY_ON_CPU_2_13
    listed = re.search(r"heavy_ops\s*=\s*\[([^\]]*)\]", source)
    ops = frozenset(re.findall(r"[\"'](\w+)[\"']", listed.group(1))) if listed else frozenset()
    return ops or _HEAVY_ON_CPU_2_13
