"""TORCH_BUG: two micro-batches through a compiled graph that reads and updates a buffer, one backward.

Fuzz cases with ``schedule=accumulate`` and a ``counter`` block (e.g. ``--seed 0 --case 415``): eager
works, but ``backend="aot_eager"`` (and Inductor) raise "one of the variables needed for gradient
computation has been modified by an inplace operation: [torch.LongTensor []] is at version 4;
expected version 2": the min-cut partition saves the ``count`` buffer itself for the backward (to
recompute from it, the bug of torch_mincut_mutated_buffer.py), and the second call's ``count += 1``
bumps its version. fxoffload keeps the reader saved instead of the buffer, so it runs and matches eager.

    PYTHONPATH=. python bench/fuzz_repros/torch_accumulate_saved_buffer.py
"""

import torch
import torch._dynamo

import fxoffload


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.scale = torch.nn.Parameter(torch.ones(6))

    def forward(self, h):
        y = torch.sin(h * self.scale + self.count * 0.1)
        self.count += 1
        return (h + y).pow(2).sum()


def grad(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Counter(), torch.randn(3, 6)
    fn = model if backend is None else torch.compile(model, backend=backend)
    (fn(x) + fn(0.5 * x)).backward()
    return model.scale.grad


eager = grad(None)
for name, backend in [("aot_eager", "aot_eager"),
                      ("fxoffload", fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager"))]:
    try:
        print(f"{name:10s} max |grad - eager| = {(grad(backend) - eager).abs().max().item():.3g}")
    except RuntimeError as e:
        print(f"{name:10s} raised: {str(e).splitlines()[0][:160]}")
