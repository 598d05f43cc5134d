"""TORCH_BUG (a torch limitation): backward(retain_graph=True) through a graph with donated buffers.

Fuzz cases with ``schedule=retain`` (``loss.backward(retain_graph=True); loss.backward()``), e.g.
``--seed 0 --case 418``: eager works; ``backend="aot_eager"`` raises "This backward function was
compiled with non-empty donated buffers which requires create_graph=False and retain_graph=False"
(torch._functorch.config.donated_buffer) in the step after a recompile for a dynamic batch size; the
first, static compile runs. fxoffload raises the same (it changes nothing there); the fuzz
classifies both raising as TORCH_BUG.

    PYTHONPATH=. python bench/fuzz_repros/torch_retain_graph_donated.py
"""

import torch
import torch._dynamo

import fxoffload


def grads(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    fn = model if backend is None else torch.compile(model, backend=backend)
    for rows in (4, 5):  # the second size recompiles with a dynamic batch dimension
        loss = fn(torch.randn(rows, 6)).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    return model[0].weight.grad


eager = grads(None)
for name, backend in [("aot_eager", "aot_eager"),
                      ("fxoffload", fxoffload.backend(offload_cpu=True, min_bytes=0, policy="all", inner="aot_eager"))]:
    try:
        print(f"{name:10s} max |grad - eager| = {(grads(backend) - eager).abs().max().item():.3g}")
    except RuntimeError as e:
        print(f"{name:10s} raised: {str(e).splitlines()[0][:160]}")
