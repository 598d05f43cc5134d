"""Distributed training on 2 CPU processes with gloo: DDP around a compiled model, a compiled DDP
model, and FSDP2 with per-block compile. Same gradients as plain data parallelism, and the same
plan on every rank.

One spawn runs every scenario (starting processes and importing torch is the slow part); each test
checks one scenario's results.

The CPU is pinned, so that a GPU on the machine changes nothing: the workers start with no CUDA
device visible, and FSDP2 is given a CPU mesh (without one, ``fully_shard`` builds its mesh on the
accelerator torch finds, and on a one-GPU H100 machine the workers died: "CUDA error: invalid device
ordinal", rank 0 with SIGSEGV). DDP on a GPU: ``tests/test_cuda.py::test_ddp_on_one_gpu``.
"""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import fxoffload

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this build", allow_module_level=True)

WORLD = 2
BUCKET_MB = 1  # DDP's first bucket is 1 MiB (DDPOptimizer asserts first <= the others)


class Block(nn.Module):
    """Defined here, not in torch.nn: Dynamo compiles user code, while torch.nn containers called
    through FSDP's hooks are in its skip list."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 128, hidden: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _backend():
    return fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager")


def _plans(backend) -> list[tuple]:
    """What must agree across ranks: every decision with its reason, and the rewritten code."""
    return [
        (tuple((r.name, r.shape, r.decision, r.reason) for r in rep.saved), rep.fw_code, rep.bw_code)
        for rep in backend.reports
    ]


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", "").replace("module.", ""): p.grad.detach().clone()
            for n, p in module.named_parameters()}  # fmt: skip


def _steps(fn, params, x, steps=2):
    """``steps`` forward/backward passes with the same input; the gradients of the last one."""
    for _ in range(steps):
        for p in params:
            p.grad = None
        fn(x).backward()


def _ddp_scenarios(model, x):
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    ref = DDP(copy.deepcopy(model), gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_MB)
    _steps(ref, list(ref.parameters()), x)
    out["reference"] = _grads(ref)

    # DDP around the compiled model: Dynamo's DDPOptimizer splits the graph at bucket boundaries
    # and calls the backend once per piece.
    backend = _backend()
    inner = copy.deepcopy(model)
    ddp = DDP(torch.compile(inner, backend=backend), gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_MB)
    _steps(ddp, list(ddp.parameters()), x)
    out["ddp_of_compiled"] = (_grads(ddp), _plans(backend), [len(r.offloaded) for r in backend.reports])
    torch._dynamo.reset()

    # The compiled DDP model: the same DDPOptimizer split, Dynamo traces DDP's forward.
    backend = _backend()
    ddp = DDP(copy.deepcopy(model), gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_MB)
    compiled = torch.compile(ddp, backend=backend)
    _steps(compiled, list(ddp.parameters()), x)
    out["compiled_ddp"] = (_grads(ddp), _plans(backend), [len(r.offloaded) for r in backend.reports])
    torch._dynamo.reset()
    return out


def _fsdp2_scenario(model, x):
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # pragma: no cover - both supported torch versions have it
        return {"fsdp2_error": f"torch.distributed.fsdp.fully_shard is missing: {e}"}
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))  # fully_shard's default is the accelerator's mesh
    ref = copy.deepcopy(model)
    _steps(ref, list(ref.parameters()), x)
    for p in ref.parameters():  # plain data parallelism: the mean of the ranks' gradients
        dist.all_reduce(p.grad)
        p.grad /= world
    def sharded_steps(backend):
        sharded = copy.deepcopy(model)
        for block in sharded.blocks:
            block.compile(backend=backend)
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        _steps(sharded, list(sharded.parameters()), x)
        return {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}

    backend = _backend()
    try:
        grads = sharded_steps(backend)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        torch._dynamo.reset()
        try:  # the same without fxoffload: a failure of torch on this set-up is skipped, ours is not
            sharded_steps("aot_eager")
        except Exception:
            return {"fsdp2_error": error}
        return {"fsdp2_fxoffload_error": error}
    return {"fsdp2": (_grads(ref), grads, _plans(backend), [len(r.offloaded) for r in backend.reports])}


def _worker(rank: int, world: int, init_file: str, results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Net()
        x = torch.randn(16, 128) + rank  # each rank its own data
        out = _ddp_scenarios(model, x)
        fsdp_model = Net(dim=64, hidden=256, layers=3)
        out.update(_fsdp2_scenario(fsdp_model, torch.randn(16, 64) * (rank + 1)))
        torch.save(out, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    # Each run its own directory (the rendezvous file included): no port, nothing shared between
    # pytest-xdist workers that run this module at the same time.
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "")  # the spawned workers see no GPU: the CPU path
        mp.spawn(_worker, args=(WORLD, os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _assert_grads(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("scenario", ["ddp_of_compiled", "compiled_ddp"])
def test_ddp_same_gradients_and_plans_on_every_rank(ranks, scenario):
    for out in ranks:
        grads, plans, offloaded = out[scenario]
        _assert_grads(grads, out["reference"])
        # DDPOptimizer split the model at bucket boundaries: one plan per piece, each offloading.
        assert len(plans) > 1, f"expected several bucket graphs, got {len(plans)}"
        assert all(n > 0 for n in offloaded), offloaded
    # Ranks saw different data, the same shapes: the same plan everywhere.
    assert ranks[0][scenario][1] == ranks[1][scenario][1]
    # The ranks' gradients were averaged: they are identical.
    _assert_grads(ranks[0][scenario][0], ranks[1][scenario][0])


def test_fsdp2_per_block_compile(ranks):
    for out in ranks:
        error = out.get("fsdp2_fxoffload_error")
        assert error is None, f"FSDP2 works with aot_eager, not with fxoffload: {error}"
    if "fsdp2_error" in ranks[0]:
        pytest.skip(f"FSDP2 on CPU with gloo failed in this torch: {ranks[0]['fsdp2_error']}")
    for out in ranks:
        ref, grads, plans, offloaded = out["fsdp2"]
        _assert_grads(grads, ref)
        assert plans and all(n > 0 for n in offloaded), offloaded
    assert ranks[0]["fsdp2"][2] == ranks[1]["fsdp2"][2]
