"""The ``fxoffload`` torch.compile backend: capture -> lifetimes -> plan -> rewrite -> inner compiler."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from ..options import OffloadOptions
from ..planning.measured import learns_without_copies
from ..reporting.report import OffloadReport
from .compile import GraphCompiler
from .dynamo_graph import copy_graph_module, static_shapes
from .pair import PairRegister
from .watch import CallWatch

log = logging.getLogger(__name__)

__all__ = ["OffloadBackend", "backend", "fxoffload_backend", "reports"]


class OffloadBackend:
    """A torch.compile backend object; ``.reports`` holds one ``OffloadReport`` per compiled graph pair.

    >>> backend = fxoffload.backend(policy="all")
    >>> compiled = torch.compile(model, backend=backend)
    """

    def __init__(self, options: OffloadOptions | None = None) -> None:
        self.options = options or OffloadOptions()
        # A rule broken on purpose (fxoffload's own tests) runs as broken, for the copy engine's checks to see.
        self._register = PairRegister(switch_off_unkept=self.options.broken_rule is None)
        self._compiler = GraphCompiler(self._register)
        # By graph id: the most bytes code before the graph was seen holding at one of its calls, where
        # that is more than it was planned with (``watch.CallWatch``).
        self.outside_seen: dict[int, int] = {}
        self._watches: list[CallWatch] = []
        self._ticks = itertools.count()  # orders the watches' compiles and calls (``settled``)
        self.__name__ = "fxoffload"  # torch.compile names a backend by it

    def __repr__(self) -> str:
        return f"fxoffload.backend({self.options})"

    @property
    def reports(self) -> list[OffloadReport]:
        """The report of the plan that runs for each graph this backend compiled, oldest first."""
        return self._register.reports()

    @property
    def settled(self) -> bool:
        """True once every graph it runs has done its first-step work: its copies timed on the
        device and, where they stalled, planned again and compiled (``max_replans`` at most). Time
        steps from here: before, a step may time copies or compile. A graph a recompile replaced
        (not called since a graph compiled after it ran twice: a batch size Dynamo then made
        dynamic) is left out: its copies, timed at its second call, may never be."""
        watches = self._watches
        return all(w.settled or any(v.created > w.last_call and v.calls >= 2 for v in watches) for w in watches)

    @property
    def host_bytes_planned(self) -> int:
        """Host bytes the offloads of every graph this backend runs take (``host_budget`` counts these)."""
        return self._register.host_bytes_planned()

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[..., Any]:
        opts = self.options
        if mode is not None or options:
            opts = opts.replace(**(options or {}), **({"mode": mode} if mode else {}))
        # Kept to plan again at run time (``CallWatch``): for what code before the graph holds there,
        # for the times its copies took.
        pristine = None
        if (opts.memory_budget is not None or opts.base_policy == "auto") and static_shapes(gm):
            try:
                pristine = copy_graph_module(gm)
            except Exception as e:  # then it is said, not planned again
                log.debug("fxoffload: cannot keep a copy of the graph to plan it again (%s)", e)
        compiled, pair = self._compiler.compile(gm, example_inputs, opts, pristine=pristine)
        if pair is None:
            return compiled
        learns = pristine is not None and learns_without_copies(pair.plan, opts)  # timed, then maybe planned again
        if pair.outside is None and not pair.plan.offloaded and not learns:
            return compiled
        watch = CallWatch(self._compiler, pair, opts, pristine, self.outside_seen, self._ticks)
        self._watches.append(watch)
        return watch.wrap(compiled)


def backend(**options: Any) -> OffloadBackend:
    """A backend object for ``torch.compile(model, backend=...)``; see ``OffloadOptions`` for the knobs."""
    return OffloadBackend(OffloadOptions.from_dict(options))


# The backend behind the name "fxoffload": one object per distinct options, so reports accumulate.
_named_backends: dict[OffloadOptions, OffloadBackend] = {}


def fxoffload_backend(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Entry point of ``torch.compile(model, backend="fxoffload", options={...})``."""
    opts = OffloadOptions.from_dict(options or {}, **({"mode": mode} if mode else {}))
    obj = _named_backends.get(opts)
    if obj is None:
        obj = _named_backends[opts] = OffloadBackend(opts)
    return obj(gm, example_inputs)


def reports() -> list[OffloadReport]:
    """Reports of every graph compiled through ``backend="fxoffload"`` (the string), oldest first."""
    return sorted((r for b in _named_backends.values() for r in b.reports), key=lambda r: r.graph_id)
