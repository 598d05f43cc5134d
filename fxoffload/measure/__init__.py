"""Measurements on the device the step runs on: allocator statistics, profiler events, the host
link, and ops timed alone. What the models are checked against and corrected by."""

from .allocator import DeviceMemory, MeasuredMemory, measure_memory, measure_steady_step, track_cpu_frees

__all__ = ["DeviceMemory", "MeasuredMemory", "measure_memory", "measure_steady_step", "track_cpu_frees"]
