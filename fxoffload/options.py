"""The one options dataclass of fxoffload, validated once when it is built."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

POLICIES = ("auto", "all", "none")
INNER_COMPILERS = ("inductor", "aot_eager")
PARTITIONERS = ("min_cut", "default")
RECOMPUTE = ("fxoffload", "inductor")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The rules of the rewrite that the ``broken_rule`` option breaks on purpose: its ordering rules
# (``rewrite.transfers``) and random ops and ops binding data-dependent sizes kept saved under torch's
# recomputation (``rewrite.random_ops``).
BROKEN_RULES = (
    "no_wait_before_use", "source_released_at_issue", "reload_before_written", "no_order_edges", "random_ops_saved",
    "order_edges_on_pointwise", "host_copy_in_compilers_layout", "fallback_results_held", "size_ops_saved",
)  # fmt: skip

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
            if _UNITS[m.group(2).lower()] == 1 and not float(m.group(1)).is_integer():
                raise ValueError(
                    f"fxoffload: {name}={value!r} is not a whole number of bytes; use an int, or a size with a "
                    "unit such as '512KiB' or '1.5GiB'"
                    + (" (a fraction of the peak without offloading is a float: 0.6, not '0.6')" if name == "memory_budget" else "")
                )
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
            raise ValueError(f"fxoffload: {name} must not be negative, got {value!r}")
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
    # copies; none of them if they would not lower the predicted peak of a graph returning a loss),
    # "all" (every eligible one), "none" (compile unchanged, for comparison); or a function of one
    # ``fxoffload.TensorInfo`` returning "offload", "keep", "recompute" (an ``Action``) or
    # None to leave that tensor to "auto". The function must be hashable (options are cache keys).
    policy: str | Callable[[Any], Any] = "auto"
    # Saved tensors smaller than this many bytes stay on the device: tiny copies cost more in launch
    # overhead than they save. Int or size string.
    min_bytes: int = 1 << 20
    # Where copies are placed. None: from the cost model (a reload is issued as late as it can be and
    # still be hidden; an offload's wait goes where its copy is predicted done). An int: fixed, that
    # many compute nodes (reloads before their first use, waits after the copy starts).
    prefetch: int | None = None
    # Target for the peak device memory: bytes (int or "12GiB"), or a float in (0, 1] as a fraction
    # of the peak without offloading (that of Inductor's code, lowered first for its code alone and
    # replayed, where it can be; else the FX model's). On top of policy="auto", tensors whose copies
    # cannot be hidden are offloaded too, cheapest predicted stall per byte first, until it fits.
    memory_budget: int | float | None = None
    # With memory_budget: raise instead of warning when the budget cannot be reached.
    strict: bool = False
    # Host link bandwidth, bytes/s: a number for both directions or {"d2h": ..., "h2d": ...}; None
    # measures it once per GPU (pinned memory) and uses fixed figures on CPU.
    bandwidth: Any = None
    # Device compute rates for the cost model: {"flops": FLOP/s, "memory_bandwidth": bytes/s};
    # None uses figures for the GPU model (fixed ones on CPU).
    compute_rates: Any = None
    # Seconds of the compute stream's time one offloaded tensor's four op calls take (offload, reload
    # and their waits), apart from any stall, the same for every tensor. None: measured once per
    # process on a CPU (where the calls run on the compute thread), with what each byte adds to them
    # there; 0 on an accelerator (the host issues them ahead of the device).
    # "auto" spends at most ``AUTO_TIME_SHARE`` of the predicted step on them.
    op_time: float | None = None
    # Time every distinct compute op of a graph once on its device (random inputs of the traced
    # shapes) and plan with the measured times instead of the FLOP/bandwidth model. Slower planning;
    # timings vary, so plans may differ between runs and ranks.
    calibrate: bool = False
    # At most this many reloads are issued ahead of their first use at any time.
    max_inflight_reloads: int = 8
    # Upper bound on host bytes holding offloaded tensors, summed over the graphs this backend
    # compiles; None is unbounded. Tensors past the bound stay on the device, with that reason.
    host_budget: int | None = None
    # Treat CPU tensors as offloadable (copied to a separate host buffer, original released). For
    # testing the data flow on machines without an accelerator: the copies run on two background
    # threads (one per direction, like a GPU's copy engines), concurrently with compute.
    offload_cpu: bool = False
    # With offload_cpu: the speed of those copy threads in bytes/s, a number for both directions or
    # {"d2h": ..., "h2d": ...}; None copies as fast as memory allows. The cost model prices copies
    # at this speed too, unless ``bandwidth`` is given.
    cpu_link_bandwidth: Any = None
    # The compiler that runs the rewritten graphs: "inductor", or "aot_eager" to run them eagerly.
    inner: str = "inductor"
    # torch's partitioner that splits the joint graph before the offload pass.
    partitioner: str = "min_cut"
    # torch.compile mode, passed on to Inductor.
    mode: str = "default"
    # With inner="inductor", for a graph that returns a loss and that the plan changes: compile it
    # without offloading too, replay both codes Inductor generated, and keep the unchanged one where
    # the plan's code peaks higher, or as high for policy "auto" alone (its copies would buy nothing).
    # Each decision then says so (reason ``peak_not_lowered``); offloading never raises the peak.
    # Such a graph is compiled twice (the second time from
    # Inductor's cache on later runs), unless the plan's code peaks no higher than what the unchanged
    # code holds at the end of its forward anyway. False keeps the plan unchecked.
    verify_peak: bool = True
    # Module paths (``fnmatch`` patterns, e.g. ("*.mlp.*",)) whose saved tensors are offloaded, as if a
    # policy function returned "offload" for them; the rest follows ``policy``. A path is dotted from
    # the compiled module ("layers.0.mlp.fc1"), the innermost module that produced the tensor.
    offload_modules: tuple[str, ...] = ()
    # With memory_budget, what recomputes activations: "fxoffload" (the budget fit weighs each tensor's
    # recomputation against an un-hidden offload, and torch's partitioner carries out its choices) or
    # "inductor" (torch's own min-cut partitioner under ``activation_memory_budget``, lowered step by
    # step until the offloads that hide on top meet the budget; the budget fit only where none does).
    recompute: str = "fxoffload"
    # How many times a plan is made again when the peak it reached (on the memory model of the new
    # partition, in the code Inductor generated, or at run time) misses ``memory_budget``: each time
    # for a target lowered by the miss; of the plans that meet it the cheapest is kept, else the
    # lowest peak (``compiler.refine``). 0 keeps the first plan.
    max_replans: int = 2
    # For fxoffload's own tests only: compile with one ordering rule of the rewrite broken on purpose
    # (one of ``BROKEN_RULES``), to prove that the suite notices (NaNs from the CPU copy engine's
    # poison, wrong gradients, or a failed check). Never set it to train.
    broken_rule: str | None = None

    def __post_init__(self) -> None:
        self._check_policy()
        _choice("inner", self.inner, INNER_COMPILERS)
        _choice("partitioner", self.partitioner, PARTITIONERS)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("mode", self.mode, MODES)
        object.__setattr__(self, "min_bytes", parse_bytes(self.min_bytes, "min_bytes"))
        if self.host_budget is not None:
            object.__setattr__(self, "host_budget", parse_bytes(self.host_budget, "host_budget"))
        if self.prefetch is not None and (
            isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0
        ):
            raise ValueError(
                f"fxoffload: prefetch must be None (cost model) or an int >= 0 (graph nodes), got {self.prefetch!r}"
            )
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_budget(self.memory_budget))
        if not isinstance(self.strict, bool):
            raise ValueError(f"fxoffload: strict must be True or False, got {self.strict!r}")
        object.__setattr__(self, "bandwidth", _rates("bandwidth", self.bandwidth, ("d2h", "h2d"), both=True))
        object.__setattr__(
            self, "cpu_link_bandwidth", _rates("cpu_link_bandwidth", self.cpu_link_bandwidth, ("d2h", "h2d"), both=True)
        )
        object.__setattr__(
            self, "compute_rates", _rates("compute_rates", self.compute_rates, ("flops", "memory_bandwidth"))
        )
        if self.op_time is not None and (
            isinstance(self.op_time, bool) or not isinstance(self.op_time, (int, float))
            or not 0 <= self.op_time < float("inf")
        ):  # fmt: skip
            raise ValueError(
                f"fxoffload: op_time must be None (measured) or a number of seconds >= 0, got {self.op_time!r}"
            )
        if isinstance(self.max_inflight_reloads, bool) or not isinstance(self.max_inflight_reloads, int) or (
            self.max_inflight_reloads < 1
        ):
            raise ValueError(f"fxoffload: max_inflight_reloads must be an int >= 1, got {self.max_inflight_reloads!r}")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"fxoffload: calibrate must be True or False, got {self.calibrate!r}")
        if not isinstance(self.verify_peak, bool):
            raise ValueError(f"fxoffload: verify_peak must be True or False, got {self.verify_peak!r}")
        if not isinstance(self.offload_cpu, bool):
            raise ValueError(f"fxoffload: offload_cpu must be True or False, got {self.offload_cpu!r}")
        if self.cpu_link_bandwidth is not None and not self.offload_cpu:
            raise ValueError("fxoffload: cpu_link_bandwidth sets the CPU copy engine's speed; it needs offload_cpu=True")
        if isinstance(self.max_replans, bool) or not isinstance(self.max_replans, int) or self.max_replans < 0:
            raise ValueError(f"fxoffload: max_replans must be an int >= 0, got {self.max_replans!r}")
        if self.broken_rule is not None and self.broken_rule not in BROKEN_RULES:
            raise ValueError(
                f"fxoffload: broken_rule={self.broken_rule!r} is not valid; choose one of: "
                f"{', '.join(map(repr, BROKEN_RULES))} (for fxoffload's own tests), or None"
            )
        if self.recompute == "inductor" and self.memory_budget is None:
            raise ValueError(
                "fxoffload: recompute='inductor' says what recomputes to meet a memory_budget, and none is set; "
                "give memory_budget too (a fraction of the peak without offloading such as 0.5, or bytes such as '12GiB')"
            )
        if self.recompute == "inductor" and self.partitioner != "min_cut":
            raise ValueError(
                "fxoffload: recompute='inductor' uses the min-cut partitioner's activation_memory_budget; "
                f"it needs partitioner='min_cut', got partitioner={self.partitioner!r}"
            )
        if self.inner == "aot_eager" and self.mode != "default":
            raise ValueError(f"fxoffload: mode={self.mode!r} applies to inner='inductor' only")

    def _check_policy(self) -> None:
        if callable(self.policy):
            try:
                hash(self.policy)
            except TypeError:
                raise ValueError(
                    f"fxoffload: policy={self.policy!r} is a callable that cannot be hashed; options are "
                    "cache keys: pass a function, or an object with __hash__"
                ) from None
        elif self.policy not in POLICIES:
            raise ValueError(
                f"fxoffload: policy={self.policy!r} is not valid; choose one of: "
                f"{', '.join(map(repr, POLICIES))}, or a function of a saved tensor's TensorInfo"
            )
        patterns = self.offload_modules
        if isinstance(patterns, list):
            patterns = tuple(patterns)
        if not isinstance(patterns, tuple) or not all(isinstance(p, str) and p.strip() for p in patterns):
            raise ValueError(
                f"fxoffload: offload_modules must be a tuple of non-empty module path patterns such as "
                f"('*.mlp.*',), got {self.offload_modules!r}"
            )
        object.__setattr__(self, "offload_modules", patterns)
        if patterns and self.policy == "none":
            raise ValueError(
                "fxoffload: offload_modules needs a policy that offloads; policy='none' compiles unchanged "
                "(to offload only those modules, pass policy=lambda t: 'keep' if ... else None)"
            )

    @property
    def base_policy(self) -> str:
        """The policy for what the user's own policy leaves open: "auto" behind a function."""
        return "auto" if callable(self.policy) else self.policy

    @property
    def plans_from_measurements(self) -> bool:
        """Whether the first steps' measurements of the copies plan the graph again: ``auto``'s own
        choices, alone or as the offloads on top of torch's recomputation for a budget."""
        return self.base_policy == "auto" and (self.memory_budget is None or self.recompute == "inductor")

    @property
    def fuses(self) -> bool:
        """Whether the memory model and recomputation's price follow how Inductor compiles the graphs
        (``analysis.fusion``): under ``inner="inductor"``."""
        return self.inner == "inductor"

    @property
    def policy_name(self) -> str:
        """The policy as reports print it: "auto", "all", "none", or the function's name."""
        if not callable(self.policy):
            return self.policy
        return getattr(self.policy, "__name__", None) or type(self.policy).__name__

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

    def cpu_link(self) -> tuple[float, float]:
        """(device-to-host, host-to-device) bytes/s of the CPU copy engine; 0: the machine's memcpy
        speed (``runtime.copy_engine.memcpy_rate``)."""
        rates = dict(self.cpu_link_bandwidth or ())
        return rates.get("d2h", 0.0), rates.get("h2d", 0.0)

    def replace(self, **changes: Any) -> OffloadOptions:
        # Not dataclasses.asdict: it deep-copies values, and a copied policy object is another key.
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return OffloadOptions.from_dict(values, **changes)


def parse_budget(value: Any) -> int | float:
    """memory_budget: bytes (int or size string), or a float in (0, 1] (fraction of the peak without
    offloading: ``planning.budget.budget_bytes``),
    or a percentage string ("60%": 0.6). Fewer than 512 bytes (the allocator's smallest block) is
    refused: ``1`` meant as all of the peak would be a budget of one byte."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            fraction = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"fxoffload: cannot parse memory_budget={value!r}; a percentage such as '60%'") from None
        if not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"fxoffload: memory_budget={value!r}: a percentage of the peak without offloading must be over 0% and at "
                "most 100%; use an int or a size string such as '12GiB' for bytes"
            )
        value = fraction
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"fxoffload: memory_budget={value!r}: a float is a fraction of the peak without offloading and must "
                "be in (0, 1]; use an int or a size string such as '12GiB' for bytes"
            )
        return value
    nbytes = parse_bytes(value, "memory_budget")
    if nbytes < 512:
        raise ValueError(
            f"fxoffload: memory_budget={value!r} means {nbytes} B, under the allocator's smallest block (512); "
            "a fraction of the peak without offloading is a float (1.0 for all of it, 0.6) or a percentage ('60%'), "
            "bytes an int or a size such as '12GiB'"
        )
    return nbytes


def _rates(name: str, value: Any, keys: tuple[str, ...], both: bool = False) -> tuple[tuple[str, float], ...] | None:
    """A hashable, validated mapping of positive rates (a bare number sets every key when ``both``)."""
    if value is None:
        return None
    if isinstance(value, tuple) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        value = dict(value)  # the frozen form this function returns
    bare = both and isinstance(value, (int, float, str)) and not isinstance(value, bool)
    if bare:
        value = dict.fromkeys(keys, value)
    if not isinstance(value, Mapping) or not value or set(value) - set(keys):
        number = "a positive number per second or " if both else ""
        raise ValueError(
            f"fxoffload: {name} must be {number}a mapping with keys among {', '.join(keys)}, got {value!r}"
        )
    out = []
    for key in keys:
        if key not in value:
            continue
        rate = value[key]
        out.append((key, parse_rate(rate, name if bare else f"{name}[{key!r}]", flops=key == "flops")))
    return tuple(out)


def parse_rate(rate: Any, label: str, flops: bool = False) -> float:
    """A positive, finite rate: a number, or a size a second ("800MB", or "800MB/s" as people write
    a rate); ``flops``: FLOP/s, a number only. ``label`` names it in errors."""
    if isinstance(rate, str):
        try:
            rate = parse_bytes(re.sub(r"\s*/\s*s$", "", rate.strip(), flags=re.IGNORECASE), label)
        except ValueError as e:
            if "cannot parse" not in str(e):
                raise
            unit = "FLOP/s: a number such as 1e14, not a string" if flops else (
                "bytes per second: a number (25e9) or a size a second such as '25GB/s' or '800MB/s'"
            )
            raise ValueError(f"fxoffload: cannot parse {label}={rate!r}; a rate is {unit}") from None
    # NaN fails every comparison, so it would pass a plain ``rate <= 0`` check.
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
        raise ValueError(f"fxoffload: {label} must be a positive, finite number per second, got {rate!r}")
    return float(rate)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"fxoffload: {name}={value!r} is not valid; choose one of: {', '.join(map(repr, allowed))}"
        )
