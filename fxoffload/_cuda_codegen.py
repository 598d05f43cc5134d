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
* ``functorch.config.force_non_lazy_backward_lowering`` makes AOTAutograd lower the backward at
  compile time: we never run a backward.
* Stubs, all undone on exit:
  - ``torch.cuda.{is_available, device_count, current_device, get_device_properties,
    get_device_capability, get_device_name, synchronize, get_rng_state, set_rng_state,
    _exchange_device, _maybe_exchange_device}`` and the same names on Dynamo's ``CudaInterface``
    (it bound the real functions at import). Inductor reads the device's properties (padding,
    matmul choices, ``DeviceProperties``) and enters ``torch.cuda.device(0)`` around the joint
    passes; Dynamo saves and restores the cuda RNG state once ``is_available()``. They describe
    one H100 (sm90, 132 SMs, 80 GB); ``DeviceProperties.create``'s cache is cleared before and
    after.
  - ``torch._inductor.compile_fx.partition_fn`` (looked up when ``compile_fx`` runs): the
    relabelling above, then the real one.
  - ``joint_graph.lazy_init``: the joint passes' patterns are traced, with autograd, on example
    tensors of the graph's device; they are traced on the CPU instead (a pattern matches
    whatever the device; this is the entry a CPU-only compile uses anyway).
  - ``ConstantFolder.run``: constant folding computes small values for real; a dispatch mode
    runs ops asked for on cuda on the CPU (the folded node keeps its cuda device).
  - ``prims.inductor_lookup_seed``'s meta function (random ops such as dropout): the original
    uses ``Tensor.__getitem__``, whose binding enters a cuda device guard a CPU-only build
    lacks; the replacement calls the aten ops.
  - ``has_triton`` in ``torch._inductor.scheduler``: ``create_backend`` refuses a cuda device
    without triton. The real cuda scheduling (``CUDACombinedScheduling``, Triton) still runs and
    writes triton kernel source without importing triton, except for
    ``torch.utils._triton.triton_hash_with_backend`` (a cache key in the kernel's metadata),
    stubbed too. Inductor's ``pad_mm`` (padding matmul operands, decided by benchmarks) asks
    its own ``has_triton`` and stays off, as it must without a GPU to time on.
  - ``GraphLowering.compile_to_module`` generates the code, hands the wrapper code to the
    ``save_output_code`` hook and returns a dummy module instead of loading it (the pattern of
    ``torch._inductor.utils.get_code``); ``save_output_code`` collects the wrapper code. Other
    hooks installed on ``save_output_code`` meanwhile (fxoffload's) still see every code.
  - Inductor's and AOTAutograd's caches are off, so the code is really generated.
* Comprehensive padding happens because Inductor now sees cuda example inputs
  (``maybe_disable_comprehensive_padding`` only turns it off for graphs without a GPU input); it
  pads the strides of intermediate buffers with a flexible layout (graph outputs keep eager
  strides, ``config.pad_outputs``).

Every private torch API used here is in this file; when a piece is missing on a torch version,
``NotImplementedError("cuda lowering unavailable on torch X: ...")`` says which.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

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
_CPU = torch.device("cpu")


def _unavailable(what: str, error: BaseException | None = None) -> NotImplementedError:
    detail = f"{what} ({type(error).__name__}: {error})" if error is not None else what
    return NotImplementedError(f"cuda lowering unavailable on torch {torch.__version__}: {detail}")


def _patch(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes; NotImplementedError when owner lacks ``name``."""
    if not hasattr(owner, name):
        raise _unavailable(f"{getattr(owner, '__name__', owner)}.{name} is missing")
    own = vars(owner)
    if name in own:
        stack.callback(setattr, owner, name, own[name])
    else:  # inherited: uncover it again
        stack.callback(delattr, owner, name)
    setattr(owner, name, value)


def _on_cpu(value: Any) -> Any:
    return _CPU if isinstance(value, torch.device) and value.type == "cuda" else value


def _relabel(value: Any, fake_tensor_type: type) -> Any:
    """Fake meta tensors in ``value`` (any nesting) say cuda:0 from now on; meta devices become cuda:0."""
    if isinstance(value, fake_tensor_type):
        if value.fake_device.type == "meta":
            value.fake_device = _CUDA0
        return value
    if isinstance(value, torch.device):
        return _CUDA0 if value.type == "meta" else value
    if isinstance(value, (list, tuple)):
        items = [_relabel(v, fake_tensor_type) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _relabel(v, fake_tensor_type) for k, v in value.items()}
    return value


def _relabel_joint(gm: torch.fx.GraphModule, joint_inputs: Any, fake_tensor_type: type) -> None:
    _relabel(joint_inputs, fake_tensor_type)
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            for key in ("val", "example_value"):
                if key in node.meta:
                    _relabel(node.meta[key], fake_tensor_type)
            node.args = _relabel(node.args, fake_tensor_type)
            node.kwargs = _relabel(node.kwargs, fake_tensor_type)
        module.recompile()


@contextlib.contextmanager
def fake_cuda(props: Any = H100, sink: Callable[[str], None] | None = None) -> Iterator[None]:
    """While open, torch and Inductor believe one cuda device ``props`` exists, joint graphs traced
    on ``meta`` are partitioned and lowered as ``cuda:0`` graphs, Inductor lowers them without
    triton and sends each wrapper code to ``sink`` instead of loading it."""
    try:
        from torch._dynamo.device_interface import CudaInterface
        from torch._functorch import config as functorch_config
        from torch._inductor import compile_fx as compile_fx_module
        from torch._inductor import config as inductor_config
        from torch._inductor import scheduler as inductor_scheduler
        from torch._inductor import inductor_prims  # noqa: F401  (registers prims.inductor_*)
        from torch._inductor.constant_folding import ConstantFolder
        from torch._inductor.fx_passes import joint_graph
        from torch._inductor.graph import GraphLowering
        from torch._inductor.runtime.hints import DeviceProperties
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils import _triton as torch_triton_utils
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as e:
        raise _unavailable("an Inductor module is missing", e) from e
    if getattr(getattr(FakeTensor, "fake_device", None), "fset", None) is None:
        raise _unavailable("FakeTensor.fake_device cannot be set")

    def capability(device: Any = None) -> tuple[int, int]:
        return props.major, props.minor

    cuda_stubs: dict[str, Callable[..., Any]] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": capability,
        "get_device_name": lambda device=None: props.name,
        "synchronize": lambda device=None: None,
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
        "_exchange_device": lambda device: 0,
        "_maybe_exchange_device": lambda device: 0,
    }

    real_partition_fn = compile_fx_module.partition_fn
    real_lazy_init = joint_graph.lazy_init

    def partition_fn(gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        _relabel_joint(gm, joint_inputs, FakeTensor)
        return real_partition_fn(gm, joint_inputs, **kwargs)

    def lazy_init(input_device: Any = None, *args: Any, **kwargs: Any) -> Any:
        # The joint passes' patterns are traced with autograd on example tensors of the graph's
        # device: trace them on the CPU (a pattern matches whatever the device).
        return real_lazy_init(_CPU, *args, **kwargs)

    class CudaOnCpu(TorchDispatchMode):
        """Real ops asked for cuda run on the CPU (constant folding computes small values)."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = {k: _on_cpu(v) for k, v in (kwargs or {}).items()}
            return func(*args, **kwargs)

    real_fold = ConstantFolder.run

    def fold(self: Any, *args: Any, **kwargs: Any) -> Any:
        with CudaOnCpu():
            return real_fold(self, *args, **kwargs)

    class _Generated:
        """Stands for the module Inductor would load from the generated code."""

        def call(self, *args: Any) -> None:
            raise RuntimeError("fxoffload._cuda_codegen: the generated cuda code is not runnable")

    def compile_to_module(self: Any) -> _Generated:
        wrapper_code, _kernel_code = self.codegen_with_cpp_wrapper() if self.cpp_wrapper else self.codegen()
        GraphLowering.save_output_code(wrapper_code.value)
        return _Generated()

    with contextlib.ExitStack() as stack:
        for name, stub in cuda_stubs.items():
            _patch(stack, torch.cuda, name, stub)
            if name in CudaInterface.__dict__:
                _patch(stack, CudaInterface, name, staticmethod(stub))
        _patch(stack, compile_fx_module, "partition_fn", partition_fn)
        _patch(stack, joint_graph, "lazy_init", lazy_init)
        _patch(stack, ConstantFolder, "run", fold)
        _patch(stack, torch_triton_utils, "triton_hash_with_backend", lambda: "no-triton")
        lookup_seed = getattr(getattr(torch.ops.prims, "inductor_lookup_seed", None), "default", None)
        if hasattr(lookup_seed, "prim_meta_impl"):  # dropout and other random ops
            _patch(stack, lookup_seed, "prim_meta_impl", _lookup_seed_meta)
        _patch(stack, inductor_scheduler, "has_triton", lambda: True)
        _patch(stack, GraphLowering, "compile_to_module", compile_to_module)
        _patch(stack, GraphLowering, "save_output_code", staticmethod(sink) if sink else None)
        try:
            stack.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
            stack.enter_context(
                functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True)
            )
        except (AttributeError, AssertionError) as e:
            raise _unavailable("a config option is missing", e) from e
        clear = getattr(DeviceProperties.create, "cache_clear", None)
        if clear is not None:
            stack.callback(clear)
            clear()
        yield


def _lookup_seed_meta(seeds: torch.Tensor, index: int) -> torch.Tensor:
    # Inductor's own is ``seeds[index].clone()``: Tensor.__getitem__ enters a device guard
    # for the (fake) cuda tensor, which a CPU-only build has not got; aten ops do not.
    return torch.ops.aten.clone.default(torch.ops.aten.select.int(seeds, 0, index))


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
            for table in (module._parameters, module._buffers):
                for name, value in list(table.items()):
                    if value is not None:
                        swaps.append((table, name, value))
                        table[name] = _meta(value)
        yield
    finally:
        for table, name, value in reversed(swaps):
            table[name] = value


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
        try:
            from torch._inductor.compile_fx import compile_fx as backend
        except ImportError as e:
            raise _unavailable("torch._inductor.compile_fx is missing", e) from e

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
