"""The private torch pieces that Inductor's CUDA lowering on a machine without a GPU needs
(``fxoffload.testing.cuda_codegen``), each patched by a context manager and undone on exit. Test code:
the backend never imports it. Where this torch lacks a piece, ``cuda_lowering_unavailable(...)`` (a
NotImplementedError the tests turn into a skip) is raised before anything is patched.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config


def cuda_lowering_unavailable(what: str, error: BaseException | None = None) -> NotImplementedError:
    detail = f"{what} ({type(error).__name__}: {error})" if error is not None else what
    return NotImplementedError(f"cuda lowering unavailable on torch {torch.__version__}: {detail}")


def _private_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise cuda_lowering_unavailable(f"{name} is missing", e) from e


def _patch(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes; NotImplementedError when owner lacks ``name``."""
    if not hasattr(owner, name):
        raise cuda_lowering_unavailable(f"{getattr(owner, '__name__', owner)}.{name} is missing")
    own = vars(owner)
    if name in own:
        stack.callback(setattr, owner, name, own[name])
    else:  # inherited: uncover it again
        stack.callback(delattr, owner, name)
    setattr(owner, name, value)


@contextlib.contextmanager
def fake_cuda_device(props: Any) -> Iterator[None]:
    """``torch.cuda`` (and Dynamo's ``CudaInterface``, which bound the real functions at import) says
    one device ``props`` exists: availability, count, current device, properties, capability, name,
    synchronize, RNG state and device exchange. ``DeviceProperties.create``'s cache is cleared on
    entry and exit, so Inductor reads ``props`` and nobody keeps them."""
    CudaInterface = _private_module("torch._dynamo.device_interface").CudaInterface
    DeviceProperties = _private_module("torch._inductor.runtime.hints").DeviceProperties
    stubs: dict[str, Callable[..., Any]] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (props.major, props.minor),
        "get_device_name": lambda device=None: props.name,
        "synchronize": lambda device=None: None,
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
        "_exchange_device": lambda device: 0,
        "_maybe_exchange_device": lambda device: 0,
    }
    really_available = torch.cuda.is_available()
    with contextlib.ExitStack() as stack:
        for name, stub in stubs.items():
            _patch(stack, torch.cuda, name, stub)
            if name in CudaInterface.__dict__:
                _patch(stack, CudaInterface, name, staticmethod(stub))
        if not really_available and torch.accelerator.is_available():
            # A CUDA build on a machine without a GPU (torch 2.11's wheel): torch.accelerator now
            # believes the stubs, and Dynamo asks it for the current stream, which initialises CUDA
            # for real ("Found no NVIDIA driver"). A CPU build has no accelerator to believe them.
            raise cuda_lowering_unavailable(
                "this CUDA build has no GPU to reach, and torch.accelerator (whose current stream Dynamo "
                "asks for) would initialise CUDA for the faked device"
            )
        clear = getattr(DeviceProperties.create, "cache_clear", None)
        if clear is not None:
            stack.callback(clear)
            clear()
        yield


def fake_tensor_relabeller(device_type: str, device: torch.device) -> Callable[[Any], bool]:
    """A function ``relabel(value)``: a fake tensor on ``device_type`` says it is on ``device`` from
    then on (in place); returns whether ``value`` was a fake tensor at all."""
    fake_tensor = _private_module("torch._subclasses.fake_tensor")
    FakeTensor = fake_tensor.FakeTensor
    # A property with a setter on torch 2.13, a plain attribute on torch 2.11: asked of a fake tensor,
    # not of the class (whose attribute only the property is).
    probe = fake_tensor.FakeTensorMode().from_tensor(torch.empty(0))
    try:
        probe.fake_device = probe.fake_device
    except (AttributeError, TypeError) as e:
        raise cuda_lowering_unavailable("FakeTensor.fake_device cannot be set", e) from e

    def relabel(value: Any) -> bool:
        if not isinstance(value, FakeTensor):
            return False
        if value.fake_device.type == device_type:
            value.fake_device = device
        return True

    return relabel


@contextlib.contextmanager
def before_inductor_partition(hook: Callable[[fx.GraphModule, Any], None]) -> Iterator[None]:
    """``hook(joint, joint_inputs)`` runs just before Inductor's ``compile_fx`` partitions a joint graph
    (``torch._inductor.compile_fx.partition_fn``, looked up when ``compile_fx`` runs)."""
    compile_fx_module = _private_module("torch._inductor.compile_fx")
    real = compile_fx_module.partition_fn

    def partition_fn(gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        hook(gm, joint_inputs)
        return real(gm, joint_inputs, **kwargs)

    with contextlib.ExitStack() as stack:
        _patch(stack, compile_fx_module, "partition_fn", partition_fn)
        yield


@contextlib.contextmanager
def joint_patterns_traced_on_cpu() -> Iterator[None]:
    """Inductor traces its joint-graph passes' patterns, with autograd, on example tensors of the
    graph's device (``joint_graph.lazy_init``): trace them on the CPU instead (a pattern matches
    whatever the device; this is the entry a CPU-only compile uses anyway)."""
    joint_graph = _private_module("torch._inductor.fx_passes.joint_graph")
    real = joint_graph.lazy_init

    def lazy_init(input_device: Any = None, *args: Any, **kwargs: Any) -> Any:
        return real(torch.device("cpu"), *args, **kwargs)

    with contextlib.ExitStack() as stack:
        _patch(stack, joint_graph, "lazy_init", lazy_init)
        yield


def _masked_index_put_accumulate(x: Any, indices: Any, mask: Any, values: Any) -> Any:
    aten = torch.ops.aten
    if x.numel() == 0:
        return aten.clone.default(x)
    indices = [None if i is None else aten.clamp.default(i, -x.size(d), x.size(d) - 1) for d, i in enumerate(indices)]
    masked = aten.masked_fill.Scalar(values, aten.bitwise_not.default(mask), 0)
    return aten._unsafe_index_put.default(x, indices, masked, True)


@contextlib.contextmanager
def language_model_traced_on_meta() -> Iterator[None]:
    """Two ops of a language model's training step that the meta trace gets wrong, set right while
    open (the scripts that make a GPT's code on a CPU, ``tests/data``; not ``fake_cuda``):

    - ``aten.nll_loss``'s Python-dispatcher Meta kernel bypasses its CompositeImplicitAutograd kernel,
      so AOTAutograd's joint trace got no gradient through ``cross_entropy`` (an empty backward): it
      is taken out;
    - the decomposition of ``_unsafe_masked_index_put_accumulate`` (embedding's backward) uses
      ``~mask``, whose binding enters a cuda device guard a CPU-only build lacks: redone with aten ops."""
    _private_module("torch._meta_registrations")  # registers the Meta py kernels first
    decomp = _private_module("torch._decomp")
    nll = torch.ops.aten.nll_loss.default
    accumulate = torch.ops.aten._unsafe_masked_index_put_accumulate.default
    meta_key = torch._C.DispatchKey.Meta
    kernel = nll.py_kernels.pop(meta_key, None)
    nll._dispatch_cache.clear()
    had, old = accumulate in decomp.decomposition_table, decomp.decomposition_table.get(accumulate)
    decomp.decomposition_table[accumulate] = _masked_index_put_accumulate
    try:
        yield
    finally:
        if kernel is not None:
            nll.py_kernels[meta_key] = kernel
            nll._dispatch_cache.clear()
        if had:
            decomp.decomposition_table[accumulate] = old
        else:
            del decomp.decomposition_table[accumulate]


def _cuda_on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) and value.type == "cuda" else value


@contextlib.contextmanager
def constant_folding_on_cpu() -> Iterator[None]:
    """Inductor's constant folding (``ConstantFolder.run``) computes small values for real: ops it
    asks for on cuda run on the CPU (the folded node keeps its cuda device)."""
    ConstantFolder = _private_module("torch._inductor.constant_folding").ConstantFolder
    TorchDispatchMode = _private_module("torch.utils._python_dispatch").TorchDispatchMode

    class CudaOnCpu(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = {k: _cuda_on_cpu(v) for k, v in (kwargs or {}).items()}
            return func(*args, **kwargs)

    real = ConstantFolder.run

    def fold(self: Any, *args: Any, **kwargs: Any) -> Any:
        with CudaOnCpu():
            return real(self, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        _patch(stack, ConstantFolder, "run", fold)
        yield


def _lookup_seed_meta(seeds: torch.Tensor, index: int) -> torch.Tensor:
    # Inductor's own is ``seeds[index].clone()``: Tensor.__getitem__ enters a device guard
    # for the (fake) cuda tensor, which a CPU-only build has not got; aten ops do not.
    return torch.ops.aten.clone.default(torch.ops.aten.select.int(seeds, 0, index))


@contextlib.contextmanager
def random_ops_without_device_guard() -> Iterator[None]:
    """``prims.inductor_lookup_seed``'s meta function (dropout and other random ops) calls aten ops
    instead of ``Tensor.__getitem__``, whose binding enters a cuda device guard a CPU-only build lacks."""
    _private_module("torch._inductor.inductor_prims")  # registers prims.inductor_*
    lookup_seed = getattr(getattr(torch.ops.prims, "inductor_lookup_seed", None), "default", None)
    with contextlib.ExitStack() as stack:
        if hasattr(lookup_seed, "prim_meta_impl"):
            _patch(stack, lookup_seed, "prim_meta_impl", _lookup_seed_meta)
        yield


@contextlib.contextmanager
def cuda_scheduling_without_triton() -> Iterator[None]:
    """Inductor's cuda scheduling (Triton kernels) runs without triton installed: ``create_backend``
    asks ``torch._inductor.scheduler.has_triton`` (stubbed True) and the kernels' metadata asks
    ``torch.utils._triton.triton_hash_with_backend`` for a cache key (stubbed). Kernel source is
    written, never compiled; ``pad_mm`` asks its own ``has_triton`` and stays off."""
    scheduler = _private_module("torch._inductor.scheduler")
    triton_utils = _private_module("torch.utils._triton")
    with contextlib.ExitStack() as stack:
        _patch(stack, triton_utils, "triton_hash_with_backend", lambda: "no-triton")
        _patch(stack, scheduler, "has_triton", lambda: True)
        yield


class _NotLoaded:
    """Stands for the module Inductor would load from the generated code."""

    def call(self, *args: Any) -> None:
        raise RuntimeError("fxoffload.testing.cuda_codegen: the generated cuda code is not runnable")


@contextlib.contextmanager
def inductor_codegen_only(sink: Callable[[str], None] | None) -> Iterator[None]:
    """``GraphLowering.compile_to_module`` generates the code, hands the wrapper code to the
    ``save_output_code`` hook and returns a module that cannot run instead of loading it (the pattern
    of ``torch._inductor.utils.get_code``); ``save_output_code`` is ``sink`` (hooks installed on it
    meanwhile, such as ``capture_output_code``'s, still see every code)."""
    GraphLowering = _private_module("torch._inductor.graph").GraphLowering

    def compile_to_module(self: Any) -> _NotLoaded:
        wrapper_code, _kernel_code = self.codegen_with_cpp_wrapper() if self.cpp_wrapper else self.codegen()
        GraphLowering.save_output_code(wrapper_code.value)
        return _NotLoaded()

    with contextlib.ExitStack() as stack:
        _patch(stack, GraphLowering, "compile_to_module", compile_to_module)
        _patch(stack, GraphLowering, "save_output_code", staticmethod(sink) if sink else None)
        yield



@contextlib.contextmanager
def lowering_without_caches() -> Iterator[None]:
    """Inductor's and AOTAutograd's caches off, so the code is really generated, and the backward
    lowered at compile time (``force_non_lazy_backward_lowering``): no backward is ever run."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
            stack.enter_context(
                functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True)
            )
        except (AttributeError, AssertionError) as e:
            raise cuda_lowering_unavailable("a config option is missing", e) from e
        yield


def inductor_compile_fx() -> Callable[..., Any]:
    """Inductor's own ``torch.compile`` backend, ``compile_fx``."""
    return _private_module("torch._inductor.compile_fx").compile_fx
