"""fxoffload: a torch.compile backend that offloads long-lived saved activations to host memory.

    torch.compile(model, backend="fxoffload")                      # after pip install
    torch.compile(model, backend=fxoffload.backend(policy="all"))  # an object with .reports
"""

from __future__ import annotations

import logging

from . import ops
from .backend import OffloadBackend, backend, fxoffload_backend, offload_pass, reports
from .explain import explain, explain_and_measure, explain_step, where_memory_goes
from .lifetimes import SavedTensor, analyze_saved_tensors
from .memory import MemoryTimeline, OffDevice, simulate, with_plan
from .measure import DeviceMemory, MeasuredMemory, measure_memory, measure_steady_step, track_cpu_frees
from .ops import host_pool_stats, release_host_memory
from .options import OffloadOptions
from .plan import Decision, OffloadPlan, off_device, plan_offloads
from .report import OffloadReport, SavedRow

__version__ = "0.1.0"

__all__ = [
    "Decision",
    "DeviceMemory",
    "OffloadBackend",
    "OffloadOptions",
    "OffloadPlan",
    "OffloadReport",
    "SavedRow",
    "MeasuredMemory",
    "MemoryTimeline",
    "OffDevice",
    "SavedTensor",
    "analyze_saved_tensors",
    "backend",
    "explain",
    "explain_and_measure",
    "explain_step",
    "fxoffload_backend",
    "measure_memory",
    "measure_steady_step",
    "host_pool_stats",
    "off_device",
    "offload_pass",
    "ops",
    "plan_offloads",
    "release_host_memory",
    "reports",
    "simulate",
    "track_cpu_frees",
    "where_memory_goes",
    "with_plan",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def _register_name() -> None:
    """Make ``backend="fxoffload"`` work when the package is imported but not installed.

    When it is installed, torch finds it through the ``torch_dynamo_backends`` entry point and
    registers it on first lookup; registering here too would raise "duplicate name".
    """
    from importlib.metadata import entry_points

    if any(ep.name == "fxoffload" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "fxoffload" not in _COMPILER_FNS:
        register_backend(fxoffload_backend, name="fxoffload")


_register_name()
