"""The cost model's compute time of gpt2-medium's forward and backward, unfused node by node and as
Inductor compiles them (``analysis.fusion``), at the H200's rates: the graphs fxoffload plans on,
made with Inductor's CUDA lowering on a machine without a GPU (``fxoffload.testing.cuda_codegen``, a
fake H100), bf16 autocast's casts written by hand (autocast does nothing on the meta tensors of that
trace), attention as the flash kernel an H100 or H200 picks for bf16. Against the kernels the H200
ran in ``gpt2m_auto_trace.json.gz`` (13.4 ms forward, 27.3 ms backward on the compute stream,
``tests/test_h200_runs.py``). About 75 s on a 2-core CPU:

    PYTHONPATH=. python tests/data/h200-2026-11-30/model_times.py

Printed on 2026-11-30 (torch 2.13.0+cpu): forward 990 compute nodes, 555 not inlined, 34.70 ms node
by node, 17.90 ms fused; backward 1640 and 857, 75.71 and 32.85 ms.
"""

import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

import fxoffload
import fxoffload.compiler.offload_pass as offload_pass
from fxoffload.analysis import cost
from fxoffload.analysis.fusion import inductor_fusion
from fxoffload.analysis.graph import is_compute
from fxoffload.testing import cuda_codegen, models
from fxoffload.testing._cuda_compat import language_model_traced_on_meta
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

aten = torch.ops.aten
BF16 = torch.bfloat16

def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # what SDPA picks on an H100: flash for bf16, efficient attention for fp32 (on meta it picks math)
    if q.dtype == BF16:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    need_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, need_lse, dropout_p, is_causal, scale=scale)[0]


F.scaled_dot_product_attention = sdpa


# --- bf16 autocast, its casts by hand ----------------------------------------------------------------
def _lin(x, layer):  # autocast's linear: bf16 in, bf16 out
    return F.linear(x.to(BF16), layer.weight.to(BF16), layer.bias.to(BF16))


def _ln(x, layer):  # autocast's layer_norm: fp32
    return F.layer_norm(x.float(), layer.normalized_shape, layer.weight, layer.bias, layer.eps)


def block_cast(self, x):
    b, t, c = x.shape
    q, k, v = _lin(_ln(x, self.ln1), self.qkv).split(c, dim=-1)
    q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
    x = x + _lin(y.transpose(1, 2).reshape(b, t, c), self.proj)
    return x + _lin(F.gelu(_lin(_ln(x, self.ln2), self.fc)), self.out)


def gpt_cast(self, idx, targets):
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = self.tok(idx) + self.pos(pos)
    for block in self.blocks:
        x = block(x)
    logits = _ln(x, self.ln).to(BF16) @ self.tok.weight.t().to(BF16)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # cross_entropy: fp32 under autocast



models.Block.forward = block_cast
models.GPT.forward = gpt_cast
seen = []
_plan_costs = offload_pass.plan_costs


def _spy(fw, bw, *args, **kwargs):
    seen.append((fw, bw))
    return _plan_costs(fw, bw, *args, **kwargs)


offload_pass.plan_costs = _spy
H200 = cost.DeviceRates("H200", flops=650e12, memory_bandwidth=4.0e12, d2h=55e9, h2d=55e9)  # cost.device_rates's
cfg = GPTConfig(vocab=50304, seq=1024, dim=1024, heads=16, layers=24, dropout=0.0)  # gpt2-medium
backend = fxoffload.backend(policy="auto", bandwidth=55e9, verify_peak=False)
start = time.perf_counter()
with inductor_config.patch(fallback_random=True), language_model_traced_on_meta():
    cuda_codegen.cuda_wrapper_code(GPT(cfg), gpt_batch(cfg, 8, "cpu"), backend)
print(f"lowered in {time.perf_counter() - start:.0f} s")
for name, gm in zip(("forward", "backward"), seen[0]):
    fusion = inductor_fusion(gm)
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    one_by_one = sum(cost.node_time(n, H200) for n in compute) * 1e3
    fused = sum(cost.node_time(n, H200, fusion) for n in compute) * 1e3
    kernels = sum(n not in fusion.inlined for n in compute)
    print(f"{name}: {len(compute)} compute nodes, {kernels} not inlined; {one_by_one:.2f} ms node by node, {fused:.2f} ms fused")
