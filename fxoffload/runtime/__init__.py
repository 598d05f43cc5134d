"""The runtime of the transfer ops: host buffer pool, CPU copy engine, streams and events.

Importing it registers the ops' implementations (``fxoffload.ir`` defines the ops). It imports
nothing from the analysis, the planner or the rewrite.
"""

from .copy_engine import COPY_ENGINE, CopyEngineStats, copy_stats, reset_copy_stats
from .host_pool import HOST_POOL, HostBufferPool, HostPoolStats, host_buffer_ranges, host_pool_stats, release_host_memory
from .transfers import track_releases

__all__ = [
    "COPY_ENGINE", "CopyEngineStats", "HOST_POOL", "HostBufferPool", "HostPoolStats", "copy_stats",
    "host_buffer_ranges", "host_pool_stats", "release_host_memory", "reset_copy_stats", "track_releases",
]  # fmt: skip
