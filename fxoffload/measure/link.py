"""The host link's bandwidth, measured: a few pinned copies each way on the device itself."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .._compat import real_tensors

log = logging.getLogger(__name__)

__all__ = ["cuda_device", "forget_links", "measure_link"]

# Measured (d2h, h2d) bytes/s per device; None where the probe failed. Once per device and process.
_measured_links: dict[str, tuple[float, float] | None] = {}

# The link probe copies this many bytes each way. Small on purpose: its device buffer is counted in
# the caller's allocated-memory statistics while it lives (``max_memory_allocated`` is the user's and
# is never reset here), and once freed the caching allocator keeps the block reserved for later
# allocations (``empty_cache`` would release the user's cached blocks too, so it is not called;
# ``caching_allocator_alloc`` goes through the same allocator and statistics). 32 MiB copies already
# run at the link's full rate; the best of a few repeats filters out noise.
LINK_PROBE_BYTES = 32 << 20
LINK_PROBE_REPEATS = 5


def forget_links() -> None:
    """Forget every measured link: the next plan for a device measures it again."""
    _measured_links.clear()


def cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` means the current device (the only reading there is)."""
    if device.index is not None:
        return device
    return torch.device(device.type, torch.cuda.current_device())


def measure_link(
    device: torch.device,
    nbytes: int = LINK_PROBE_BYTES,
    timer: Callable[[torch.device, int], tuple[float, float]] | None = None,
) -> tuple[float, float] | None:
    """Host link bytes/s (d2h, h2d) of the CUDA ``device``, timed with pinned memory, cached per
    device; None where it cannot be measured (not a CUDA device, out of device or pinned memory):
    the cost model's default figure is used then.

    Runs on ``device`` itself (its index, not the current device), with ``nbytes`` of device and of
    pinned host memory that are freed before it returns. ``timer(device, nbytes)``: what times the
    copies (default: pinned copies each way, best of ``LINK_PROBE_REPEATS``).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    device = cuda_device(device)
    key = str(device)
    if key not in _measured_links:
        try:
            with real_tensors(), torch.cuda.device(device):
                _measured_links[key] = (timer or _time_link)(device, nbytes)
        except RuntimeError as e:  # out of device or pinned memory
            log.warning("fxoffload: could not measure the host link of %s (%s); using the default figure", key, e)
            _measured_links[key] = None
        else:
            d2h, h2d = _measured_links[key]  # type: ignore[misc]
            log.info("fxoffload: measured host link of %s: d2h %.1f GB/s, h2d %.1f GB/s", key, d2h / 1e9, h2d / 1e9)
    return _measured_links[key]


def _time_link(device: torch.device, nbytes: int, repeats: int = LINK_PROBE_REPEATS) -> tuple[float, float]:
    """Best of ``repeats`` single copies each way. The copies run on a stream of our own on
    ``device``, so no work queued on the user's streams is timed; the caller selected ``device``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # ``dev`` was allocated on the current stream
        rates = []
        with torch.cuda.stream(stream):
            for dst, src in ((host, dev), (dev, host)):
                dst.copy_(src, non_blocking=True)  # warm-up
                best = float("inf")
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    end.record(stream)
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) / 1e3)
                rates.append(nbytes / max(best, 1e-9))
        stream.synchronize()  # nothing reads or writes the buffers any more when they are freed
    finally:
        del host, dev  # back to the caching allocators (the device block stays reserved, see above)
    return rates[0], rates[1]
