"""The one options dataclass of fxoffload, validated once when it is built."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

POLICIES = ("auto", "all", "none")
INNER_COMPILERS = ("inductor", "aot_eager")
PARTITIONERS = ("min_cut", "default")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, name: str) -> int:
    """An int number of bytes, or a string like "800MB", "1.5GiB", "4096"."""
    if isinstance(value, bool):
        raise ValueError(f"fxoffload: {name} must be a number of bytes or a size string, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"fxoffload: {name} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        raise ValueError(
            f"fxoffload: cannot parse {name}={value!r}; use an int or a size such as "
            f"'512KiB', '800MB', '12GiB' (units: {', '.join(u for u in _UNITS if u)})"
        )
    raise ValueError(
        f"fxoffload: {name} must be an int number of bytes or a size string, got {type(value).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """Every knob of the fxoffload backend. Build with ``OffloadOptions.from_dict`` to validate keys."""

    # Which saved tensors to offload: "auto" (the ones whose idle window is long enough to hide the
    # copies), "all" (every eligible one), "none" (compile unchanged, for comparison).
    policy: str = "auto"
    # Saved tensors smaller than this many bytes stay on the device: tiny copies cost more in launch
    # overhead than they save. Int or size string.
    min_bytes: int = 1 << 20
    # How many compute nodes a copy gets to overlap with: reloads are issued this many nodes before
    # their first backward use, and an offload's wait sits this many nodes after its copy started.
    prefetch: int = 4
    # Upper bound on host bytes holding offloaded tensors, summed over the graphs this backend
    # compiles; None is unbounded. Tensors past the bound stay on the device, with that reason.
    host_budget: int | None = None
    # Treat CPU tensors as offloadable (copied to a separate host buffer, original released). For
    # testing the data flow on machines without an accelerator.
    offload_cpu: bool = False
    # The compiler that runs the rewritten graphs: "inductor", or "aot_eager" to run them eagerly.
    inner: str = "inductor"
    # torch's partitioner that splits the joint graph before the offload pass.
    partitioner: str = "min_cut"
    # torch.compile mode, passed on to Inductor.
    mode: str = "default"

    def __post_init__(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("inner", self.inner, INNER_COMPILERS)
        _choice("partitioner", self.partitioner, PARTITIONERS)
        _choice("mode", self.mode, MODES)
        object.__setattr__(self, "min_bytes", parse_bytes(self.min_bytes, "min_bytes"))
        if self.host_budget is not None:
            object.__setattr__(self, "host_budget", parse_bytes(self.host_budget, "host_budget"))
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"fxoffload: prefetch must be an int >= 0 (graph nodes), got {self.prefetch!r}")
        if not isinstance(self.offload_cpu, bool):
            raise ValueError(f"fxoffload: offload_cpu must be True or False, got {self.offload_cpu!r}")
        if self.inner == "aot_eager" and self.mode != "default":
            raise ValueError(f"fxoffload: mode={self.mode!r} applies to inner='inductor' only")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, **overrides: Any) -> OffloadOptions:
        merged = {**(values or {}), **overrides}
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(merged) - set(valid))
        if unknown:
            raise ValueError(
                f"fxoffload: unknown option(s) {', '.join(map(repr, unknown))}; valid options are: "
                f"{', '.join(valid)}"
            )
        if merged.get("mode") is None:
            merged.pop("mode", None)
        return cls(**merged)

    def replace(self, **changes: Any) -> OffloadOptions:
        return OffloadOptions.from_dict(dataclasses.asdict(self), **changes)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"fxoffload: {name}={value!r} is not valid; choose one of: {', '.join(map(repr, allowed))}"
        )
