"""Not a parity failure: fxoffload's Inductor compiles never hit Inductor's FX graph cache.

docs/how-it-works.md says "Inductor's FX graph cache still serves the rewritten graphs", but the cache
key (torch 2.13) includes the whole Inductor config, and fxoffload patches a fresh
``_OffloadPartitioner`` object into ``config.custom_partitioner_fn`` for every compile. The key detail
``inductor_config[custom_partitioner_fn]`` is that object (its repr shows a new address each time), so
the key differs on every compile, even of the same graph with the same options in the same process.
torch hashes the partitioner's ``uuid()`` separately (``_custom_partitioner_fn``) but does not list
``custom_partitioner_fn`` in ``_cache_config_ignore_prefix``. Every compile re-lowers both graphs (the
C++ kernels are still cached by source), e.g. 12 s instead of ~3 s for a warm fuzz case.

    PYTHONPATH=. python bench/fuzz_repros/fxgraph_cache_miss.py
"""

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fxoffload


def compile_and_step(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    counters.clear()
    torch.compile(model, backend=backend)(torch.randn(8, 16)).sum().backward()
    return dict(counters["inductor"])


for name, make in [("inductor", lambda: "inductor"),
                   ("fxoffload", lambda: fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all"))]:
    for attempt in range(2):
        c = compile_and_step(make())
        print(f"{name} compile {attempt}: fxgraph_cache_hit={c.get('fxgraph_cache_hit', 0)} "
              f"miss={c.get('fxgraph_cache_miss', 0)}")
# Before the fix: 2 misses every time, in every process. Now: the first process misses, a second run
# of this script hits on both fxoffload compiles (graph ids 0 and 1 are in the copies' names, so
# compile 1 of a process is not compile 0's graph).
