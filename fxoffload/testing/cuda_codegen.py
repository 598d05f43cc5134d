"""Inductor's CUDA wrapper code for a training step, generated on a machine without a GPU.

``cuda_wrapper_code(model, example_inputs, backend)`` returns the Python wrapper code Inductor
writes for the forward and the backward graph of ``model`` as if it ran on an H100: which buffers
are allocated (with their padded strides), copied, passed to extern kernels and custom ops, and
freed. Nothing is compiled or run; triton need not be installed.

How, and why each piece is needed:

* Trace on ``meta``, lower on ``cuda``. Autograd cannot run on a fake cuda tensor in a CPU-only
  build (the engine asks the CUDA device guard and the current accelerator stream, and aborts or
  raises), and both Dynamo and AOTAutograd's joint trace run autograd. So the model's parameters,
  buffers and the inputs are swapped for ``meta`` tensors (shape, stride, dtype, requires_grad
  kept; the model's own tensors are put back on exit), ``torch.compile`` traces that, and the
  joint graph is relabelled to ``cuda:0`` just before it is partitioned: every fake tensor in it
  (node values and the joint inputs, which are also the forward's example inputs) gets
  ``fake_device = cuda:0`` in place, and ``device=meta`` arguments become ``cuda:0``. From the
  partitioner on (Inductor's joint passes, the backend's custom partitioner, lowering of the
  forward and the backward) everything sees cuda tensors. The one difference from a real cuda
  trace: ops whose decomposition depends on the device (scaled dot product attention picks its
  kernel by device, for example) are traced as on meta.
* ``torch.compile`` traces a fresh function (a new code object per call, so Dynamo's cache
  neither fills up nor hands back an old entry) with ``backend`` wrapped: the wrapper lowers,
  then hands Dynamo the traced graph to run on the meta tensors, so later graphs are traced too.
* Every private piece of torch this needs is patched by a context manager of ``fxoffload.testing._cuda_compat``,
  all undone on exit:
  - ``fake_cuda_device(props)``: ``torch.cuda.{is_available, device_count, current_device,
    get_device_properties, get_device_capability, get_device_name, synchronize, get_rng_state,
    set_rng_state, _exchange_device, _maybe_exchange_device}`` and the same names on Dynamo's
    ``CudaInterface`` (it bound the real functions at import). Inductor reads the device's
    properties (padding, matmul choices, ``DeviceProperties``) and enters ``torch.cuda.device(0)``
    around the joint passes; Dynamo saves and restores the cuda RNG state once ``is_available()``.
    They describe one H100 (sm90, 132 SMs, 80 GB); ``DeviceProperties.create``'s cache is cleared
    before and after.
  - ``before_inductor_partition(hook)`` (``torch._inductor.compile_fx.partition_fn``, looked up
    when ``compile_fx`` runs): the relabelling above, done by ``fake_tensor_relabeller``, then the
    real partitioner.
  - ``joint_patterns_traced_on_cpu()``: the joint passes' patterns are traced, with autograd, on
    example tensors of the graph's device; they are traced on the CPU instead (a pattern matches
    whatever the device; this is the entry a CPU-only compile uses anyway).
  - ``constant_folding_on_cpu()``: constant folding computes small values for real; a dispatch
    mode runs ops asked for on cuda on the CPU (the folded node keeps its cuda device).
  - ``random_ops_without_device_guard()``: ``prims.inductor_lookup_seed``'s meta function (random
    ops such as dropout) uses ``Tensor.__getitem__``, whose binding enters a cuda device guard a
    CPU-only build lacks; the replacement calls the aten ops.
  - ``cuda_scheduling_without_triton()``: ``create_backend`` refuses a cuda device without
    triton. The real cuda scheduling (``CUDACombinedScheduling``, Triton) still runs and writes
    triton kernel source without importing triton, except for
    ``torch.utils._triton.triton_hash_with_backend`` (a cache key in the kernel's metadata),
    stubbed too. Inductor's ``pad_mm`` (padding matmul operands, decided by benchmarks) asks its
    own ``has_triton`` and stays off, as it must without a GPU to time on.
  - ``inductor_codegen_only(sink)``: ``GraphLowering.compile_to_module`` generates the code, hands
    the wrapper code to the ``save_output_code`` hook and returns a dummy module instead of loading
    it (the pattern of ``torch._inductor.utils.get_code``); ``save_output_code`` collects the
    wrapper code. Other hooks installed on ``save_output_code`` meanwhile (fxoffload's) still see
    every code.
  - ``lowering_without_caches()``: Inductor's and AOTAutograd's caches are off, so the code is
    really generated, and ``functorch.config.force_non_lazy_backward_lowering`` makes AOTAutograd
    lower the backward at compile time: we never run a backward.
* Comprehensive padding happens because Inductor now sees cuda example inputs
  (``maybe_disable_comprehensive_padding`` only turns it off for graphs without a GPU input); it
  pads the strides of intermediate buffers with a flexible layout (graph outputs keep eager
  strides, ``config.pad_outputs``).

This file uses public torch only; when a private piece is missing on a torch version, ``_compat``
raises ``NotImplementedError("cuda lowering unavailable on torch X: ...")`` saying which.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _cuda_compat as _compat

__all__ = ["H100", "cuda_wrapper_code", "fake_cuda"]

# What torch.cuda.get_device_properties says about an H100 SXM.
H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=80 * 2**30,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    warp_size=32,
    shared_memory_per_block=49152,
    shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472,
    L2_cache_size=50 * 2**20,
    is_integrated=False,
    is_multi_gpu_board=False,
    gcnArchName="NVIDIA H100 80GB HBM3",
    uuid="00000000-0000-0000-0000-000000000000",
    pci_bus_id=0,
    pci_device_id=0,
    pci_domain_id=0,
    clock_rate=1980000,
    memory_clock_rate=2619000,
    memory_bus_width=5120,
)

_CUDA0 = torch.device("cuda", 0)


def _relabel(value: Any, relabel_fake: Callable[[Any], bool]) -> Any:
    """Fake meta tensors in ``value`` (any nesting) say cuda:0 from now on; meta devices become cuda:0."""
    if relabel_fake(value):
        return value
    if isinstance(value, torch.device):
        return _CUDA0 if value.type == "meta" else value
    if isinstance(value, (list, tuple)):
        items = [_relabel(v, relabel_fake) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _relabel(v, relabel_fake) for k, v in value.items()}
    return value


def _relabel_joint(gm: torch.fx.GraphModule, joint_inputs: Any, relabel_fake: Callable[[Any], bool]) -> None:
    _relabel(joint_inputs, relabel_fake)
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            for key in ("val", "example_value"):
                if key in node.meta:
                    _relabel(node.meta[key], relabel_fake)
            node.args = _relabel(node.args, relabel_fake)
            node.kwargs = _relabel(node.kwargs, relabel_fake)
        module.recompile()


@contextlib.contextmanager
def fake_cuda(props: Any = H100, sink: Callable[[str], None] | None = None) -> Iterator[None]:
    """While open, torch and Inductor believe one cuda device ``props`` exists, joint graphs traced
    on ``meta`` are partitioned and lowered as ``cuda:0`` graphs, Inductor lowers them without
    triton and sends each wrapper code to ``sink`` instead of loading it."""
    relabel_fake = _compat.fake_tensor_relabeller("meta", _CUDA0)

    def relabel_joint(gm: torch.fx.GraphModule, joint_inputs: Any) -> None:
        _relabel_joint(gm, joint_inputs, relabel_fake)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_compat.fake_cuda_device(props))
        stack.enter_context(_compat.before_inductor_partition(relabel_joint))
        stack.enter_context(_compat.joint_patterns_traced_on_cpu())
        stack.enter_context(_compat.constant_folding_on_cpu())
        stack.enter_context(_compat.random_ops_without_device_guard())
        stack.enter_context(_compat.cuda_scheduling_without_triton())
        stack.enter_context(_compat.inductor_codegen_only(sink))
        stack.enter_context(_compat.lowering_without_caches())
        yield


def _fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object: Dynamo keys its cache on the code object."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _meta(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta.requires_grad_(t.requires_grad)


@contextlib.contextmanager
def _on_meta(model: torch.nn.Module) -> Iterator[None]:
    """Each parameter and buffer of ``model`` replaced by a meta tensor like it, until exit."""
    swaps = []
    try:
        for module in model.modules():
            own = [*module.named_parameters(recurse=False, remove_duplicate=False),
                   *module.named_buffers(recurse=False, remove_duplicate=False)]  # fmt: skip
            for name, value in own:
                swaps.append((module, name, value))
                setattr(module, name, _meta(value))
        yield
    finally:
        for module, name, value in reversed(swaps):
            setattr(module, name, value)


def cuda_wrapper_code(model: torch.nn.Module, example_inputs: tuple, backend: Any = None) -> list[str]:
    """Inductor's wrapper code for a training step of ``model(*example_inputs)`` on an H100, in the
    order Inductor lowered the graphs: per Dynamo graph, the forward, then the backward (only the
    forward where nothing needs a gradient).

    ``backend`` is a ``torch.compile`` backend callable ``(gm, example_inputs) -> callable`` that
    lowers with Inductor's ``compile_fx`` (``fxoffload.backend(...)``); None means plain Inductor.
    Tensors in ``example_inputs`` and the model's state lend only their shapes, strides, dtypes
    and ``requires_grad``; their data and device do not matter (``meta`` works).
    """
    if backend is None:
        backend = _compat.inductor_compile_fx()

    codes: list[str] = []

    def lower(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        backend(gm, inputs)
        return gm.forward  # Dynamo runs the traced graph on the meta tensors and goes on tracing

    def step(*args: Any) -> Any:
        return model(*args)

    args = tuple(_meta(a) if isinstance(a, torch.Tensor) else a for a in example_inputs)
    with fake_cuda(sink=codes.append), _on_meta(model):
        torch.compile(_fresh_function(step), backend=lower)(*args)
    return codes
