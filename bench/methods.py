"""The methods the harness compares, each as "how to build one training step" on a model copy.

A method that cannot run on this device or torch raises ``Skip`` with the reason, which the table
shows; nothing is dropped silently. Names on the command line:

    eager, inductor, fxoffload-auto, fxoffload-all,
    inductor-noreuse          Inductor lowering every graph without pool reuse (allow_buffer_reuse=False),
                              as fxoffload lowers a graph that copies: what its extra allocations cost
    fxoffload-budget[=F]      fxoffload with memory_budget=F (a fraction of its predicted peak without
                              offloading)
    fxoffload-recompute[=F]   the same with recompute="inductor": torch's partitioner recomputes under its
                              activation_memory_budget, fxoffload offloads what hides on top
    save_on_cpu               eager under torch.autograd.graph.save_on_cpu(pin_memory=True on a GPU)
    streamed                  eager, saved-tensor hooks + side stream (TRL's when importable, else
                              bench/streamed.py)
    checkpoint                eager, torch.utils.checkpoint around every block
    checkpoint-compiled       the same model compiled by Inductor (torch.compile traces the checkpoints:
                              what a user who checkpoints by hand and compiles gets); by --inner's
                              compiler where that is another (aot_eager: the CPU smoke run)
    inductor-amb[=F]          Inductor with torch._functorch.config.activation_memory_budget=F during compile
    intree                    Inductor with torch's in-tree activation offloading, on the tensors fxoffload
                              (policy="auto") chose

Without ``=F`` the sweeps take every value of ``--budgets``. The two budgets mean different
things: fxoffload's (both methods) is a fraction of its predicted peak device memory, Inductor's a fraction of the
activation memory its partitioner would save.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import fxoffload

from .streamed import StreamedOffload, trl_context

log = logging.getLogger(__name__)

KINDS = (
    "eager",
    "inductor",
    "inductor-noreuse",
    "fxoffload-auto",
    "fxoffload-all",
    "fxoffload-budget",
    "fxoffload-recompute",
    "save_on_cpu",
    "streamed",
    "checkpoint",
    "checkpoint-compiled",
    "inductor-amb",
    "intree",
)
SWEPT = ("fxoffload-budget", "fxoffload-recompute", "inductor-amb")
DEFAULT = ",".join(KINDS)


class Skip(Exception):
    """The method cannot run here; the message is the reason shown in the table."""


@dataclasses.dataclass(frozen=True)
class Method:
    kind: str
    budget: float | None = None

    @property
    def name(self) -> str:
        return self.kind if self.budget is None else f"{self.kind}={self.budget:g}"


def parse_budget(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number; use fractions in (0, 1], e.g. 0.5") from None
    if not 0 < value <= 1:
        raise ValueError(f"{what}: {value:g} is out of range; use fractions in (0, 1]")
    return value


def parse_methods(spec: str, budgets: str) -> list[Method]:
    """``"eager,fxoffload-budget=0.5,inductor-amb"`` -> methods; swept names without ``=F`` take
    every budget of ``budgets`` ("0.8,0.5"). Raises ``ValueError`` naming the bad item."""
    points = [parse_budget(b, "--budgets") for b in budgets.split(",") if b.strip()]
    methods: list[Method] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        kind, _, value = item.partition("=")
        if kind not in KINDS:
            raise ValueError(f"unknown method {kind!r}; choose from: {', '.join(KINDS)}")
        if value and kind not in SWEPT:
            raise ValueError(f"method {kind!r} takes no value (only {', '.join(SWEPT)} do), got {item!r}")
        if kind in SWEPT:
            if value:
                methods.append(Method(kind, parse_budget(value, kind)))
            elif not points:
                raise ValueError(f"{kind} needs budgets: give --budgets 0.8,0.5 or {kind}=0.5")
            else:
                methods.extend(Method(kind, b) for b in points)
        else:
            methods.append(Method(kind))
    if not methods:
        raise ValueError("no methods given; choose from: " + ", ".join(KINDS))
    return methods


@dataclasses.dataclass
class Context:
    """What every method of one run shares."""

    device: torch.device
    min_bytes: int  # fxoffload's min_bytes and the streamed offloader's threshold
    inner: str  # fxoffload's inner compiler
    amp: torch.dtype | None  # autocast dtype on the GPU, or None for fp32
    auto_reports: list | None = None  # fxoffload policy="auto"'s reports with inner="inductor" (for intree)
    cpu_link: int | None = None  # on a CPU: bytes/s of fxoffload's emulated host link (cpu_link_bandwidth)
    trace_dir: str | None = None  # on a GPU: where fxoffload methods' profiled steps are written (.json.gz)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def fxoffload_options(self, **options: Any) -> dict[str, Any]:
        extra = {} if self.cuda else {"offload_cpu": True}
        if not self.cuda and self.cpu_link is not None:
            extra["cpu_link_bandwidth"] = self.cpu_link
        return {"min_bytes": self.min_bytes, "inner": self.inner, **extra, **options}


@dataclasses.dataclass
class Prepared:
    """One method, ready to run: ``step()`` runs forward and backward and returns the loss."""

    step: Callable[[], torch.Tensor]
    note: str = ""
    backend: Any = None  # an fxoffload backend, for its reports
    offloaded_bytes: Callable[[], int | None] = lambda: None  # bytes offloaded by the last step, if known
    close: Callable[[], None] = lambda: None
    late_note: Callable[[], str] | None = None  # a note that can only be written after the compile


def prepare(
    method: Method, model: nn.Module, batch: tuple, blocks: list[nn.Module], ctx: Context
) -> Prepared:
    """Build ``method``'s step on ``model`` (the method's own copy, on the device)."""
    kind = method.kind
    if kind == "eager":
        return Prepared(_step(model, batch, ctx))
    if kind == "inductor":
        return Prepared(_step(torch.compile(model, backend="inductor"), batch, ctx))
    if kind == "inductor-noreuse":  # fxoffload's lowering of a graph with copies (``compiler.lowering``)
        compiled = torch.compile(model, backend="inductor", options={"allow_buffer_reuse": False})
        return Prepared(_step(compiled, batch, ctx), "Inductor without pool reuse (allow_buffer_reuse=False)")
    if kind.startswith("fxoffload"):
        options = {"policy": "all"} if kind == "fxoffload-all" else {"policy": "auto"}
        if kind in ("fxoffload-budget", "fxoffload-recompute"):
            options["memory_budget"] = method.budget
        if kind == "fxoffload-recompute":
            options["recompute"] = "inductor"
        backend = fxoffload.backend(**ctx.fxoffload_options(**options))
        note = "" if ctx.cuda else "offload_cpu=True: host copies are CPU tensors (left out of measured peak)"
        return Prepared(
            _step(torch.compile(model, backend=backend), batch, ctx),
            note,
            backend,
            lambda: sum(r.offloaded_bytes for r in backend.reports),
        )
    if kind == "save_on_cpu":
        pin = ctx.cuda
        hooks = lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)
        note = (
            "" if pin else "CPU: saved tensors copied to other CPU tensors, pin_memory off (no accelerator)"
        )
        return Prepared(_step(model, batch, ctx, around_forward=hooks), note)
    if kind == "streamed":
        return _streamed(model, batch, ctx)
    if kind in ("checkpoint", "checkpoint-compiled"):
        if not blocks:
            raise Skip("the workload lists no blocks to checkpoint")
        for block in blocks:
            _checkpoint_forward(block)
        compiled = kind == "checkpoint-compiled"
        step_model = torch.compile(model, backend=ctx.inner) if compiled else model
        by = "Inductor" if ctx.inner == "inductor" else ctx.inner
        return Prepared(
            _step(step_model, batch, ctx),
            f"torch.utils.checkpoint around each of {len(blocks)} blocks" + (f", compiled by {by}" if compiled else ""),
        )
    if kind == "inductor-amb":
        from torch._functorch import config as functorch_config

        patch = lambda: functorch_config.patch(activation_memory_budget=method.budget)
        return Prepared(_step(torch.compile(model, backend="inductor"), batch, ctx, around_call=patch))
    if kind == "intree":
        return _intree(model, batch, ctx)
    raise AssertionError(kind)


def _step(
    fn: Callable[..., torch.Tensor],
    batch: tuple,
    ctx: Context,
    around_forward: Callable[[], Any] | None = None,
    around_call: Callable[[], Any] | None = None,
) -> Callable[[], torch.Tensor]:
    """forward (under ``around_forward``), backward; ``around_call`` wraps both (config patches
    that must be in force whenever a compile can happen)."""
    model = getattr(fn, "_orig_mod", fn)

    def step() -> torch.Tensor:
        with around_call() if around_call else contextlib.nullcontext():
            with around_forward() if around_forward else contextlib.nullcontext(), _autocast(ctx):
                loss = fn(*batch)
            loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _autocast(ctx: Context):
    if ctx.amp is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=ctx.amp)


def _checkpoint_forward(block: nn.Module) -> None:
    """Make ``block`` recompute its forward in the backward (non-reentrant checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def _streamed(model: nn.Module, batch: tuple, ctx: Context) -> Prepared:
    trl = trl_context(model)
    if trl is not None:
        return Prepared(
            _step(model, batch, ctx, around_forward=lambda: trl), "TRL get_act_offloading_ctx_manager"
        )
    offloader = StreamedOffload(model, min_bytes=ctx.min_bytes)
    inner = _step(model, batch, ctx, around_forward=lambda: offloader)

    def step() -> torch.Tensor:
        loss = inner()
        offloader.after_backward()
        return loss

    note = f"bench/streamed.py (TRL not importable): {offloader.mode}"
    return Prepared(step, note, offloaded_bytes=lambda: offloader.offloaded_bytes)


# -- torch's in-tree activation offloading -----------------------------------------------------------
def intree_unavailable() -> str | None:
    """Why torch's in-tree activation offloading cannot be used here, or None."""
    try:
        from torch._functorch import config as functorch_config
        from torch._functorch._activation_offloading import activation_offloading  # noqa: F401
        from torch._inductor import config as inductor_config
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no in-tree activation offloading ({e}); it needs torch >= 2.10"
    if not hasattr(functorch_config, "enable_activation_offloading"):
        return f"torch {torch.__version__} has no torch._functorch.config.enable_activation_offloading"
    for name in ("joint_custom_post_pass", "post_grad_custom_pre_pass"):
        if not hasattr(inductor_config, name):
            return f"torch {torch.__version__} has no torch._inductor.config.{name}"
        if getattr(inductor_config, name) is not None:
            return f"torch._inductor.config.{name} is set by the caller; the tagging pass would replace it"
    return None


def _intree(model: nn.Module, batch: tuple, ctx: Context) -> Prepared:
    """Tag, in Inductor's joint graph, the saved tensors fxoffload (policy="auto") chose to offload,
    as ``node.meta["should_offload"]``, and let torch's own pass (inside the min-cut partitioner)
    insert its offload and reload ops. Names match because fxoffload plans on the forward graph that
    the same partitioner extracts from the same joint graph."""
    reason = intree_unavailable()
    if reason:
        raise Skip(reason)
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    reports = ctx.auto_reports  # set by an fxoffload-auto row with inner="inductor" that ran before
    if reports is None:  # the names must come from Inductor's joint graph, so plan with inner="inductor"
        options = ctx.fxoffload_options(policy="auto", inner="inductor")
        if not ctx.cuda:  # the tensors whose copies would hide: torch's pass has no calls of fxoffload's
            options["op_time"] = 0.0
        with _autocast(ctx):
            reports = fxoffload.explain(copy.deepcopy(model), *batch, **options)
        torch._dynamo.reset()
    chosen = [frozenset(r.name for r in report.offloaded) for report in reports]
    if not any(chosen):
        raise Skip("fxoffload (policy='auto') chose no tensor to offload, so there is nothing to tag")

    class TagChosen(CustomGraphPass):
        """joint_custom_post_pass: the n-th joint graph gets the n-th report's choice."""

        def __init__(self) -> None:
            self.calls, self.tagged = 0, []

        def __call__(self, graph: torch.fx.Graph) -> None:
            names = chosen[self.calls] if self.calls < len(chosen) else frozenset()
            self.calls += 1
            hits = [n for n in graph.nodes if n.name in names]
            for node in hits:
                node.meta["should_offload"] = True
            self.tagged.append(len(hits))

        def uuid(self) -> Any:
            return hashlib.sha256(repr([sorted(c) for c in chosen]).encode()).hexdigest()

    class CountOffloads(CustomGraphPass):
        """post_grad_custom_pre_pass: count the offload ops torch's pass put in the forward graphs."""

        def __init__(self) -> None:
            self.count, self.nbytes = 0, 0

        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in graph.nodes:
                if _is_intree_offload(node):
                    self.count += 1
                    val = node.args[0].meta.get("val")
                    self.nbytes += val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0

        def uuid(self) -> Any:
            return "fxoffload-bench-count-offloads"

    tag, counter = TagChosen(), CountOffloads()
    functorch_patch = {"enable_activation_offloading": True, "enable_autograd_cache": False}
    if ctx.cuda:  # the asynchronous variant (side stream, waits sunk, reloads prefetched) where it exists
        functorch_patch.update(activation_offload_separate_stream=True, activation_reload_prefetch=True)
    functorch_patch = {k: v for k, v in functorch_patch.items() if hasattr(functorch_config, k)}
    inductor_patch = {
        "joint_custom_post_pass": tag,
        "post_grad_custom_pre_pass": counter,
        "fx_graph_cache": False,
    }

    @contextlib.contextmanager
    def patched():
        with functorch_config.patch(**functorch_patch), inductor_config.patch(**inductor_patch):
            yield

    pool = _intree_pinned_pool() if ctx.cuda else contextlib.nullcontext()
    pool.__enter__()
    step = _step(torch.compile(model, backend="inductor"), batch, ctx, around_call=patched)
    planned = sum(len(c) for c in chosen)

    def note() -> str:
        where = "" if ctx.cuda else "; CPU: device_put to the CPU of a CPU tensor moves nothing"
        return (
            f"tagged {sum(tag.tagged)} of {planned} tensors fxoffload-auto chose; torch's pass offloaded "
            f"{counter.count} (it refuses views, getitems, non-contiguous){where}"
        )

    return Prepared(
        step,
        offloaded_bytes=lambda: counter.nbytes,
        close=lambda: pool.__exit__(None, None, None),
        late_note=note,
    )


def _is_intree_offload(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    ao = getattr(torch.ops, "ao", None)
    if ao is not None and hasattr(ao, "offload") and node.target is ao.offload.default:
        return True
    # The synchronous variant: prims.device_put named after the in-tree pass's offload prefix (its
    # reloads on a CPU-only graph are device_puts to the CPU too, named "gpu_reload_...").
    return node.target is torch.ops.prims.device_put.default and node.name.startswith("cpu_offload_")


def _intree_pinned_pool():
    """torch's pinned pool for its offload ops (torch >= 2.12), else nothing."""
    try:
        from torch._functorch._activation_offloading.offload_ops import pinned_memory_pool
    except ImportError:
        return contextlib.nullcontext()
    return pinned_memory_pool()
