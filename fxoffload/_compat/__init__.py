"""Every private torch API fxoffload uses, in one package, so a torch upgrade is one package's work
(donated buffers: ``_compat.donated``).

Supported: torch 2.11 and 2.13. Nothing here may depend on pieces that exist in only one of them
(the ``ao::`` offload ops of torch >= 2.12, for example, are never used).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._subclasses.fake_tensor import FakeTensorMode

from .code_cache import keeping_code
from .donated import backward_lowered_at_compile, can_lower_backward_at_compile, donates_saved_buffers, lowering_backward
from .lowering import inductor_runs_as_fallback, register_fallbacks
from .realize import RealizeLimits, inductor_heavy_ops_on_cpu, inductor_realize_limits
from .scheduler_runs import TransferOps, joining_runs
from .sizes import UNBACKED_FALLBACK, is_data_dependent, size_hint, static_fakes

__all__ = [
    "CustomPartitionerFn",
    "TransferOps",
    "aot_autograd",
    "backward_lowered_at_compile", "can_lower_backward_at_compile", "donates_saved_buffers", "lowering_backward",
    "boxed_nop",
    "call_partitioner",
    "checkpoint_tags",
    "compile_with_inductor",
    "detect_fake_mode",
    "UNBACKED_FALLBACK", "is_data_dependent",
    "raised_from",
    "resolved_per_op",
    "register_fallbacks",
    "real_tensors",
    "inductor_mode_options", "inductor_runs_as_fallback",
    "RealizeLimits", "inductor_heavy_ops_on_cpu", "inductor_realize_limits",
    "is_backward_node",
    "kernel_source_name",
    "must_save",
    "size_hint", "static_fakes",
    "storage_expired", "free_storage_weak_ref", "storage_use_count", "storage_weak_ref",
    "tag_must_recompute",
]

TORCH_PARTITIONERS: dict[str, Callable[..., tuple[fx.GraphModule, fx.GraphModule]]] = {
    "min_cut": min_cut_rematerialization_partition,
    "default": default_partition,
}


def call_partitioner(
    name: str,
    joint: fx.GraphModule,
    joint_inputs: Any,
    activation_memory_budget: float | None = None,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Run torch's own partitioner ``name``, passing only the keyword arguments it accepts;
    ``activation_memory_budget``: the min-cut partitioner's budget (``functorch.config``) for this
    call only, which makes it recompute until the saved activations fit that fraction."""
    fn = TORCH_PARTITIONERS[name]
    accepted = inspect.signature(fn).parameters
    args = {k: v for k, v in kwargs.items() if k in accepted}
    if activation_memory_budget is None:
        return fn(joint, joint_inputs, **args)
    with functorch_config.patch(activation_memory_budget=activation_memory_budget):
        return fn(joint, joint_inputs, **args)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Real tensors inside a compile (the partitioner may run under the fake mode), without grad."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        yield


def tag_must_recompute(joint: fx.GraphModule, names: frozenset[str]) -> None:
    """Ask torch's partitioners to recompute the joint graph's nodes ``names`` in the backward.

    The same node tag selective activation checkpointing sets (``meta["recompute"]``); both the
    min-cut and the default partitioner honour it.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    for node in joint.graph.nodes:
        if node.name in names:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def tag_must_save(joint: fx.GraphModule, names: frozenset[str]) -> None:
    """Forbid torch's partitioners to recompute the joint graph's nodes ``names``: the ``MUST_SAVE``
    tag of selective activation checkpointing, which the min-cut partitioner honours under any
    activation memory budget."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in joint.graph.nodes:
        if node.name in names:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


@contextlib.contextmanager
def checkpoint_tags(joint: fx.GraphModule, save: frozenset[str], recompute: frozenset[str]) -> Iterator[None]:
    """The joint graph's nodes ``save`` tagged ``MUST_SAVE`` and ``recompute`` ``MUST_RECOMPUTE`` while
    the block runs (a partition made with them); after it, every node's tag as it was before, or none
    (by name: torch's partitioner may copy the graph's nodes, their tags with them, and it tags more
    nodes where these make it)."""
    missing = object()
    before = {n.name: n.meta.get("recompute", missing) for n in joint.graph.nodes}
    tag_must_save(joint, save)
    tag_must_recompute(joint, recompute)
    try:
        yield
    finally:
        for node in joint.graph.nodes:
            tag = before.get(node.name, missing)
            if tag is missing:
                node.meta.pop("recompute", None)
            else:
                node.meta["recompute"] = tag


def is_backward_node(node: fx.Node) -> bool:
    """A node of a joint graph that AOTAutograd traced for the backward (its ``partitioner_tag``,
    torch 2.11 and 2.13), although it may read forward values only (a transpose of an activation)."""
    return node.meta.get("partitioner_tag") == "is_backward"


def kernel_source_name(node: fx.Node) -> str:
    """The name Inductor's "Source Nodes" comment gives ``node`` (``_inductor.utils.get_kernel_metadata``,
    torch 2.11 and 2.13): that of the first node it came from (``from_node``), else its own."""
    origin = node.meta.get("from_node")
    return getattr(origin[0], "name", node.name) if origin else node.name


def must_save(node: fx.Node) -> bool:
    """True when the node carries a ``MUST_SAVE`` tag: a selective activation checkpointing policy
    said so, or torch's partitioner forces it (collectives, effectful ops, backward mutations)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE


def inductor_mode_options(mode: str | None) -> dict[str, Any]:
    """Inductor config patches for a ``torch.compile`` mode ("default", "reduce-overhead", ...)."""
    from torch._inductor import list_mode_options

    if mode is None or mode == "default":
        return {}
    return dict(list_mode_options(mode))


def cudagraphs_enabled(config_patches: dict[str, Any]) -> bool:
    return bool(config_patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))


@contextlib.contextmanager
def _no_autograd_cache() -> Iterator[None]:
    # A hit in AOTAutograd's cache would skip the partitioner, and so the plan and its report.
    # Inductor's own FX graph cache still serves the (rewritten) forward and backward graphs: keyed
    # by their code, whose copies carry the graph's id (``rewrite.transfers``), so a later process
    # that compiles the same graphs in the same order hits it (bench/fuzz_repros/fxgraph_cache_miss.py).
    with functorch_config.patch(enable_autograd_cache=False):
        yield


class _CodeOnly(Exception):
    """Raised once Inductor's wrapper code of a graph compiled ``code_only`` has been captured."""


def _code_only_stub(*args: Any) -> Any:
    raise RuntimeError("fxoffload: this graph was compiled for its code only (code_only=True); it cannot run")


_code_only_stub._boxed_call = True  # type: ignore[attr-defined]


def compile_with_inductor(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    partitioner: CustomPartitionerFn,
    config_patches: dict[str, Any],
    on_output_code: Callable[[str, str], None] | None = None,
    code_only: bool = False,
    after_backward: Callable[[Callable[[fx.GraphModule], str]], None] | None = None,
    graph_patches: Callable[[fx.GraphModule], dict[str, Any]] | None = None,
    not_donated: Callable[[fx.GraphModule], frozenset[str]] | None = None,
    join_runs: TransferOps | None = None,
    output_strides: Callable[[str], list[tuple[int, ...] | None]] | None = None,
    backward_groups: Callable[[], Callable[[fx.Node], str | None] | None] | None = None,
) -> Callable[..., Any]:
    """Inductor's ``compile_fx`` with our partitioner plugged in for the duration of this compile.
    ``on_output_code(kind, code)`` receives the wrapper code Inductor generates for each graph it
    compiles here ("forward", "backward" or "inference"), also from its cache and for a backward
    compiled at its first call. ``code_only``: each graph stops once its wrapper code is generated,
    before the module is loaded (before C++ builds): what is returned cannot run, only the code is wanted.
    ``after_backward(lower_like_forward)`` runs once the backward is compiled, still inside this
    compile: ``lower_like_forward(graph)`` lowers another graph with the forward's inputs and
    arguments, for its wrapper code alone (no trace, no partition: the same fake tensors).
    ``graph_patches(graph)``: Inductor config patched while that graph (the partitioned forward or
    backward, also one lowered lazily at the first backward call) is lowered. ``not_donated(graph)``: a
    backward's placeholders whose buffers Inductor must not reuse (``donated.lowering_backward``).
    ``join_runs``: the transfer ops whose runs Inductor's schedule joins, and keeps dependencies in (``scheduler_runs``).
    ``output_strides(code)``: with ``code_only``, the strides of a forward's outputs read from its code,
    told to AOTAutograd as a finished compile tells them (``_report_output_strides``). ``backward_groups()``,
    as a backward is lowered: the groups no kernel is fused across (``scheduler_runs.fusing_within``) or None."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    if code_only and on_output_code is None:
        raise ValueError("fxoffload: compile_with_inductor(code_only=True) needs on_output_code, where the code goes")
    forward_call: list[tuple[Any, dict[str, Any]]] = []

    def lower_like_forward(graph: fx.GraphModule) -> str:
        inputs, kwargs = forward_call[-1]
        codes: list[str] = []
        _until_code(graph, inputs, kwargs, codes.append)
        if not codes:
            raise RuntimeError("fxoffload: Inductor generated no wrapper code for the graph lowered like the forward")
        return codes[0]

    def inner_compile(graph: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        keyed, finish = {}, None
        if kwargs.get("is_backward"):
            keyed, finish = lowering_backward(graph, not_donated(graph) if not_donated is not None else frozenset())
        elif after_backward is not None:
            forward_call.append((list(inputs), dict(kwargs)))
        with inductor_config.patch(keyed):
            compiled = _inner_compile(graph, inputs, **kwargs)
        compiled = finish(compiled) if finish is not None else compiled
        if kwargs.get("is_backward") and after_backward is not None and forward_call:
            after_backward(lower_like_forward)
        return compiled

    def _inner_compile(graph: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        groups = backward_groups() if backward_groups is not None and kwargs.get("is_backward") else None
        with inductor_config.patch(graph_patches(graph) if graph_patches else {}), joining_runs(join_runs, graph, groups):
            if on_output_code is None:
                return compile_fx_inner(graph, inputs, **kwargs)
            kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
            if code_only:
                strides = output_strides if kind == "forward" else None
                return _until_code(graph, inputs, kwargs, lambda code: on_output_code(kind, code), strides)
            with capture_output_code(lambda code: on_output_code(kind, code)):
                return compile_fx_inner(graph, inputs, **kwargs)

    patches = dict(config_patches)
    patches["custom_partitioner_fn"] = partitioner
    with _no_autograd_cache():
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def _until_code(
    graph: fx.GraphModule, inputs: Any, kwargs: dict[str, Any], on_code: Callable[[str], None],
    output_strides: Callable[[str], list[tuple[int, ...] | None]] | None = None,
) -> Any:
    """``compile_fx_inner`` stopped once ``on_code`` has the wrapper code (``_code_only_stub``); with
    ``output_strides``, a forward's outputs' strides reported first, as a whole compile does. The code
    is kept on disk under Inductor's cache key, and read back from there (``code_cache``)."""
    from torch._inductor.compile_fx import compile_fx_inner

    def sink(code: str) -> None:
        on_code(code)
        if output_strides is not None:
            _report_output_strides(output_strides(code))
        raise _CodeOnly()

    def lowered(code: str) -> None:
        keep(code)
        sink(code)

    with keeping_code(sink) as keep, capture_output_code(lowered):  # read back where kept (``code_cache``)
        try:
            return compile_fx_inner(graph, inputs, **kwargs)
        except Exception as e:
            if not raised_from(e, _CodeOnly):
                raise
            return _code_only_stub


def _report_output_strides(strides: list[tuple[int, ...] | None]) -> None:
    """A forward's output strides, told to AOTAutograd as a finished compile tells them
    (``set_tracing_context_output_strides``), which gives them to the backward's saved inputs. A compile
    stopped at its code tells nothing, and the backward was lowered for the traced strides: contiguous
    weights where the forward saves channels-last copies, another backward than the one that runs
    (a UNet's peaked 11% above Inductor's own)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is not None and context.output_strides is not None and not context.output_strides:
        context.output_strides.extend(strides)


def raised_from(e: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``e`` is a ``kind``, or was raised from one (torch wraps errors of its compile)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def capture_output_code(sink: Callable[[str], None]) -> Iterator[None]:
    """Send the wrapper code of every graph Inductor lowers (or loads from its cache) to ``sink``,
    besides any hook already installed (``torch._inductor.utils.run_and_get_code`` uses the same one)."""
    from torch._inductor.graph import GraphLowering

    previous = GraphLowering.save_output_code

    def save(code: str) -> None:
        sink(code)
        if previous is not None:
            previous(code)

    GraphLowering.save_output_code = save
    try:
        yield
    finally:
        GraphLowering.save_output_code = previous


def compile_with_aot_eager(
    gm: fx.GraphModule, example_inputs: list[Any], partition_fn: Callable[..., Any]
) -> Callable[..., Any]:
    """AOTAutograd with eager forward/backward (boxed), for debugging and inspection."""
    with _no_autograd_cache():
        return aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=partition_fn,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def copy_dynamo_metadata(source: fx.GraphModule, copy: fx.GraphModule) -> None:
    """What AOTAutograd reads of Dynamo on a graph it was handed (``_try_get_metadata_from_dynamo``),
    onto a copy that lost it: the graph's parameter sources and each placeholder's source. Without
    them a copy of Dynamo's graph is taken for an exported one, and its parameters, inputs like any
    other (not static inputs)."""
    if hasattr(source, "_param_name_to_source"):
        copy._param_name_to_source = source._param_name_to_source
    for a, b in zip(source.graph.find_nodes(op="placeholder"), copy.graph.find_nodes(op="placeholder")):
        if hasattr(a, "_dynamo_source"):
            b._dynamo_source = a._dynamo_source


def detect_fake_mode(values: list[Any]) -> FakeTensorMode | None:
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """Strong references to a storage (1: only the caller's handle)."""
    return torch._C._storage_Use_Count(storage._cdata)


def storage_weak_ref(storage: torch.UntypedStorage) -> int:
    return storage._weak_ref()


def storage_expired(ref: int) -> bool:
    return bool(torch.UntypedStorage._expired(ref))


def free_storage_weak_ref(ref: int) -> None:
    """Drop a weak reference made by ``storage_weak_ref`` (each one holds a small control block)."""
    torch.UntypedStorage._free_weak_ref(ref)


def trace_artifact(name: str, payload: Callable[[], str], encoding: str = "string") -> None:
    """A structured trace artifact (TORCH_TRACE / tlparse shows it beside the compile it belongs to)."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload,
    )


def cpu_block_sizes_flag() -> Any:
    """The c10 flag ``caffe2_report_cpu_memory_usage`` as a ``ctypes.c_bool`` (None where the library
    or the symbol cannot be found).

    While it is off, torch's CPU allocator records a block's size only while a memory profiler runs,
    so the profiler cannot report the free of a block allocated before it started ("Memory block of
    unknown size was allocated before the profiling started"); while it is on, every block's size is
    kept and such frees are reported.
    """
    import ctypes
    import os
    import sys

    name = {"darwin": "libc10.dylib", "win32": "c10.dll"}.get(sys.platform, "libc10.so")
    path = os.path.join(os.path.dirname(torch.__file__), "lib", name)
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return None


def inductor_channels_last_nodes(gm: fx.GraphModule) -> set[fx.Node] | None:
    """The nodes of a forward ``gm`` whose outputs Inductor lays out channels-last when it returns them
    (its layout optimization: ``GraphLowering.decide_layout_opt``, then
    ``find_nodes_prefer_channels_last``, asked as Inductor asks them); empty where Inductor does not
    optimize ``gm``'s layouts, None where this torch cannot say."""
    from torch._inductor.graph import GraphLowering

    decide = getattr(GraphLowering, "decide_layout_opt", None)
    find = getattr(GraphLowering, "find_nodes_prefer_channels_last", None)
    if decide is None or find is None:
        return None
    try:
        if not decide(gm, is_inference=False):
            return set()
        return set(find(types.SimpleNamespace(module=gm)))  # it reads only ``self.module``
    except Exception:  # a torch whose heuristics read more: unknown, never a failed compile
        return None


def profiler_active() -> bool:
    """Whether a torch profiler (the user's, or ``measure_memory``'s) is collecting in this process:
    a second session opened inside it corrupts the first (its trace export crashes the process)."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else True  # unknown: assume one is, and stay out


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a FakeTensor (no data: its storage address means nothing)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def resolved_per_op(t: torch.Tensor) -> str:
    """The lazy bit of ``t`` that torch resolves into a new tensor before any op without its own
    kernel for that bit runs (fxoffload's transfer ops among them: the conjugate, negative and
    zero-tensor fallbacks): "conjugate", "negative", "zero", or "" for none. Fake tensors carry them."""
    if t.is_conj():
        return "conjugate"
    if t.is_neg():
        return "negative"
    return "zero" if t._is_zerotensor() else ""


def can_read_saved_tensors() -> bool:
    """Whether this torch lets an autograd node's ``SavedTensor`` be read without unpacking it
    (``SavedTensor.data``; not in its type stubs)."""
    return hasattr(torch._C._autograd.SavedTensor, "data")


def saved_tensor_payload(saved: Any) -> Any:
    """What an autograd node's ``SavedTensor`` (its ``_raw_saved_*``) holds, without unpacking it:
    the tensor itself, or the object a saved-tensors pack hook returned (``save_on_cpu``'s host copy,
    a checkpoint's handle). Unpacking would call the unpack hook: a copy back to the device, or a
    recomputation. ``None`` where this torch has no such property."""
    try:
        return saved.data
    except (AttributeError, RuntimeError):
        return None
