"""ERROR (fxoffload): backward(retain_graph=True) raises under fxoffload where backend="inductor" runs.

Found by the fuzz: ``python -m bench.fuzz --seed 1 --case 20 --inner inductor --options budget,all,auto``
(schedule=retain): "budget" and "auto" raise, "all" and Inductor alone run.

    RuntimeError: This backward function was compiled with non-empty donated buffers which requires
    create_graph=False and retain_graph=False. ...

Cause: for a graph whose outputs are all 0-dim (a loss), ``verify_peak`` (on by default, so policy
"auto" with no options) and every ``memory_budget`` compile under
``_compat.backward_lowered_at_compile()`` (``functorch.config.force_non_lazy_backward_lowering``),
backend.py ``OffloadBackend._compile``. The backward is then compiled at forward-compile time with
``saved_tensors_use_once=True``, so AOTAutograd keeps its donated buffers (saved tensors that alias
nothing) and its runtime wrapper refuses any backward with retain_graph=True. Plain Inductor lowers
the backward lazily, at the first backward call: called with retain_graph=True it is compiled with
``saved_tensors_use_once=False`` and no donated buffers, and runs. Policy "all" without a budget
(verify_peak=False, or a graph that returns activations) takes the lazy path and runs too.

    PYTHONPATH=. python bench/fuzz_repros/fxoffload_retain_graph_eager_backward.py
"""

import torch
import torch._dynamo

import fxoffload


class WithLoss(torch.nn.Module):  # the compiled graph returns the loss: verify_peak judges it
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x).pow(2).mean()


def grads(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WithLoss()
    fn = model if backend is None else torch.compile(model, backend=backend)
    loss = fn(torch.randn(32, 16))
    loss.backward(retain_graph=True)  # e.g. two losses' backwards on one graph, or a GAN's shared step
    loss.backward()
    return model.net[0].weight.grad


eager = grads(None)
cpu = {"offload_cpu": True, "min_bytes": 0}
for name, backend in [
    ("inductor", "inductor"),
    ("fxoffload all, verify_peak=False", fxoffload.backend(**cpu, policy="all", verify_peak=False)),
    ("fxoffload auto (defaults)", fxoffload.backend(**cpu)),
    ("fxoffload all, verify_peak=True", fxoffload.backend(**cpu, policy="all")),
    ("fxoffload memory_budget=0.5", fxoffload.backend(**cpu, memory_budget=0.5, verify_peak=False)),
]:
    try:
        print(f"{name:34s} max |grad - eager| = {(grads(backend) - eager).abs().max().item():.3g}")
    except RuntimeError as e:
        print(f"{name:34s} raised: {str(e).splitlines()[0][:110]}")
