"""Regenerates tests/data/gpt_cuda_{forward,backward}.py.gz: Inductor's CUDA wrapper code for the GPT of
tests/test_cuda.py::test_the_prediction_is_the_cuda_allocators_peak[none], generated on a CPU-only machine
with fxoffload.testing.cuda_codegen (fake H100), trimmed to what the replay reads (``call`` and ``get_args``).

    PYTHONPATH=. python tests/data/gen_gpt_cuda_code.py

Three script-only patches make the meta trace lower like the H100's cuda trace (see docs/cuda-replay.md),
the first two in fxoffload.testing._cuda_compat.language_model_traced_on_meta:
1. aten.nll_loss's Python-dispatcher Meta kernel is dropped: it bypasses the CompositeImplicitAutograd
   kernel, so AOTAutograd's joint trace got no gradient through cross_entropy (an empty backward);
2. the decomposition of _unsafe_masked_index_put_accumulate (embedding backward) is redone with aten ops:
   ``~mask`` (Tensor.__invert__) enters a cuda device guard a CPU-only build lacks;
3. F.scaled_dot_product_attention calls _scaled_dot_product_efficient_attention, the kernel SDPA picks on
   an H100 for fp32 inputs with dropout (on meta it picks the math kernel).
Check: the main-branch replay of this code gives 89264148 B above the start, the figure the H100 run's
own replay gave (suite_on_h100.txt).
"""

import gzip
import re
import sys

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

import fxoffload
from fxoffload.testing import cuda_codegen as _cuda_codegen
from fxoffload.analysis.output_code import call_body
from fxoffload.testing._cuda_compat import language_model_traced_on_meta
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch

aten = torch.ops.aten


def sdpa_efficient(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    need_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, need_lse, dropout_p, is_causal, scale=scale)[0]


F.scaled_dot_product_attention = sdpa_efficient


def trim(code: str) -> str:
    """``call`` (no kernel-launch bookkeeping, alignment asserts or comments) and ``get_args``."""
    keep = [line for line in call_body(code)
            if line.strip() and not re.match(r"\s*(#|assert_alignment\(|raw_stream\d* = get_raw_stream|stream\d* = get_raw_stream)", line)]
    args = [line for line in code.splitlines() if re.match(r"\s+\w+ = (rand_strided|torch\.as_strided)\(", line)]
    return "class Runner:\n    def call(self, args):\n" + "\n".join(keep) + "\n\n\ndef get_args():\n" + "\n".join(args) + "\n"


torch.manual_seed(0)
cfg = GPTConfig(vocab=512, seq=256, dim=256, heads=4, layers=2)  # tests/test_cuda.py, dropout 0.1
backend = fxoffload.backend(policy="none", min_bytes=0, verify_peak=False)
with inductor_config.patch(fallback_random=True), language_model_traced_on_meta():
    _cuda_codegen.cuda_wrapper_code(GPT(cfg), gpt_batch(cfg, 8, "cpu"), backend)
(report,) = backend.reports
out = sys.argv[1] if len(sys.argv) > 1 else "tests/data"
for kind, name in (("forward", "forward"), ("backward", "backward")):
    with gzip.open(f"{out}/gpt_cuda_{name}.py.gz", "wt", compresslevel=9) as f:
        f.write(trim(report.output_code[kind]))
print(report.summary())
