"""fxoffload: a torch.compile backend that offloads long-lived saved activations to host memory.

    torch.compile(model, backend="fxoffload")                      # after pip install
    torch.compile(model, backend=fxoffload.backend(policy="all"))  # an object with .reports

The package follows the data: ``analysis`` (reads graphs) -> ``planning`` (decides, pure) ->
``rewrite`` (the only graph mutation) -> ``runtime`` (the transfer ops) -> ``reporting``; the
``compiler`` wires them into a backend, ``measure`` reads the device, ``tools`` is what people run.
"""

from __future__ import annotations

import logging

from . import runtime  # registers the transfer ops' implementations
from .analysis.lifetimes import SavedTensor, analyze_saved_tensors
from .analysis.memory import MemoryTimeline, OffDevice, simulate, with_plan
from .compiler.backend import OffloadBackend, backend, fxoffload_backend, reports
from .measure.allocator import DeviceMemory, MeasuredMemory, measure_memory, measure_steady_step, track_cpu_frees
from .options import OffloadOptions
from .planning.budget import off_device
from .planning.decisions import Decision, OffloadPlan
from .planning.plan import plan_offloads
from .planning.policy import TensorInfo
from .reasons import Action
from .reporting.report import OffloadReport, SavedRow
from .runtime.host_pool import host_pool_stats, release_host_memory
from .tools.explain import explain, explain_and_measure, explain_step, where_memory_goes

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Decision",
    "DeviceMemory",
    "MeasuredMemory",
    "MemoryTimeline",
    "OffDevice",
    "OffloadBackend",
    "OffloadOptions",
    "OffloadPlan",
    "OffloadReport",
    "SavedRow",
    "SavedTensor",
    "TensorInfo",
    "analyze_saved_tensors",
    "backend",
    "explain",
    "explain_and_measure",
    "explain_step",
    "fxoffload_backend",
    "host_pool_stats",
    "measure_memory",
    "measure_steady_step",
    "off_device",
    "plan_offloads",
    "release_host_memory",
    "reports",
    "runtime",
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

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if any(ep.name == "fxoffload" for ep in entry_points(group="torch_dynamo_backends")):
        return
    if "fxoffload" not in _COMPILER_FNS:
        register_backend(fxoffload_backend, name="fxoffload")


_register_name()
