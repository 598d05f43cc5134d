"""TORCH_BUG (known, guarded by fxoffload/mutation.py): min-cut recomputes from a buffer mutated in place.

Fuzz cases with a ``counter`` (``self.count += 1`` read by the loss, before or after the update) or an
``ema`` block (``self.ema.mul_(0.9).add_(...)``) give wrong gradients under ``backend="aot_eager"`` and
``"inductor"``: torch's min-cut partitioner recomputes ``h * scale + count * 0.1`` in the backward from
the ``count`` placeholder, which the forward's trailing ``copy_`` has already updated, so the backward
sees the buffer one update ahead. ``aot_eager_default_partitioner`` (no recomputation) matches eager;
so does fxoffload, which tags those readers MUST_SAVE: the fuzz classifies these cases TORCH_BUG.

    PYTHONPATH=. python bench/fuzz_repros/torch_mincut_mutated_buffer.py
"""

import torch
import torch._dynamo

import fxoffload


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.scale = torch.nn.Parameter(torch.ones(6))

    def forward(self, h):
        self.count += 1
        return (h + torch.sin(h * self.scale + self.count * 0.1)).pow(2).sum()


def grad(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Counter(), torch.randn(3, 6)
    fn = model if backend is None else torch.compile(model, backend=backend)
    fn(x).backward()
    return model.scale.grad


eager = grad(None)
for name, backend in [("aot_eager", "aot_eager"), ("aot_eager_default_partitioner", "aot_eager_default_partitioner"),
                      ("fxoffload", fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager"))]:
    print(f"{name:30s} max |grad - eager| = {(grad(backend) - eager).abs().max().item():.3g}")
