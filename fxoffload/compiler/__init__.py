"""The compiler: the torch.compile backend, the partition function, the pass's steps, the refine loop
and the run-time watch. The only layer that wires analysis, measurement, planning, rewrite and
reporting together."""

from .backend import OffloadBackend, backend, fxoffload_backend, reports

__all__ = ["OffloadBackend", "backend", "fxoffload_backend", "reports"]
