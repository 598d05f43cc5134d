"""The models the harness measures, by name and preset: random weights, nothing downloaded.

Every workload is a model whose ``forward(*batch)`` returns a scalar training loss, one fixed batch,
the list of blocks that activation checkpointing wraps one by one, and the unit of its throughput.
Dropout is zero everywhere so that every method computes the same loss and the first-step losses
of the table can be compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxoffload.testing.models import GPT, PRESETS, Seq2Seq, gpt_batch, seq2seq_batch

from .unet import DiffusionUNet


class WorkloadUnavailable(RuntimeError):
    """The workload cannot be built here (a missing optional package); the message says why."""


@dataclasses.dataclass
class Workload:
    name: str
    preset: str
    model: nn.Module  # on the CPU; each method moves its own deep copy to the device
    batch: tuple  # already on the device
    blocks: Callable[[nn.Module], list[nn.Module]]  # the blocks of a copy, for per-block checkpointing
    items_per_step: int  # tokens or samples in one batch
    unit: str  # "tokens" or "samples"
    description: str


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, a projection shortcut when the
    shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet-style CNN: a 3x3 stem, stages of basic blocks (the first of each stage after the
    first halves the resolution), global average pooling, a linear classifier, cross-entropy."""

    def __init__(self, widths: tuple[int, ...], depths: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks, cin = [], widths[0]
        for stage, (width, depth) in enumerate(zip(widths, depths)):
            for i in range(depth):
                blocks.append(BasicBlock(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as ``forward(idx, targets) -> loss`` (labels are the inputs; the
    model shifts them itself; a masked LM's loss is on every token)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, labels=idx).loss


# name -> preset -> keyword arguments of the builder below. "tiny" presets are for CPU runs and
# tests; the others are shaped for a GPU.
GPT_BATCH = {"tiny": 8, "small": 8, "gpt2-medium": 8}
HF_PRESETS = {
    "hf-gpt2": {
        "tiny": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256, batch=8),
        "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=50257, batch=8),
    },
    "hf-llama": {
        "tiny": dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=64,
            batch=8,
        ),
        # Llama-shaped, ~0.4B parameters: GQA, SwiGLU, RoPE, RMSNorm; fits one H100 in fp32.
        "medium": dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=1024,
            batch=8,
        ),
    },
    # ALBERT: one layer's weights shared by every layer (one ModuleList item called num_hidden_layers
    # times in a row), a masked-LM loss on every token.
    "hf-albert": {
        "tiny": dict(
            embedding_size=32,
            hidden_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=176,
            vocab_size=256,
            max_position_embeddings=64,
            batch=8,
        ),
        "base": dict(
            embedding_size=128,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            vocab_size=30000,
            max_position_embeddings=512,
            batch=16,
        ),
    },
}
CNN_PRESETS = {
    "tiny": dict(widths=(16, 32), depths=(1, 1), classes=10, image=32, batch=8),
    "resnet18": dict(widths=(64, 128, 256, 512), depths=(2, 2, 2, 2), classes=1000, image=224, batch=64),
}
SEQ2SEQ_PRESETS = {
    "tiny": dict(vocab=128, emb=32, hidden=64, batch=4, src_len=12, tgt_len=6),
    # Sizes of the forum thread's model: 256-d embeddings, 512-d GRU, long padded batches.
    "thread": dict(vocab=8000, emb=256, hidden=512, batch=64, src_len=80, tgt_len=40),
}

# Where offloading should win (issue: "a workload where offloading wins"). Llama-7B-shaped blocks, few
# enough to fit one H100 (``../shared/gpu/bound.py``: at dim 4096 about 30% of the saved bytes can
# leave within the forward on PCIe with bf16 weights); "bf16" weights are bf16 (no saved weight casts),
# the others fp32 under --amp bf16. A video diffusion transformer at long sequence: non-causal
# attention grows with the square of the tokens while the saved bytes grow linearly.
LLAMA_PRESETS = {
    "tiny": dict(dim=64, heads=4, mlp=176, seq=64, batch=2, blocks=2, bf16=False),
    "7b-4l": dict(dim=4096, heads=32, mlp=11008, seq=2048, batch=1, blocks=4, bf16=False),
    # Batch 4: at batch 1 the step's peak is its weight gradients' (1.6 GB of bf16), not the 1 GB of
    # saved activations: Inductor, auto and amb=0.5 all peaked at the same 1620 MiB on an H100
    # (docs/results.md, 2026-11-26); four times the tokens save about 4 GB.
    "7b-4l-bf16": dict(dim=4096, heads=32, mlp=11008, seq=2048, batch=4, blocks=4, bf16=True),
}
DIT_PRESETS = {
    "tiny": dict(dim=64, heads=4, tokens=128, batch=2, blocks=2, bf16=False),
    "video-16k": dict(dim=1536, heads=24, tokens=16384, batch=1, blocks=4, bf16=True),
    "video-32k": dict(dim=3072, heads=24, tokens=32768, batch=1, blocks=2, bf16=True),
}
# A diffusion UNet (``bench.unet``): "tiny" is the small UNet of the CPU side by sides in
# docs/results.md; "sd-64" has Stable Diffusion's first widths on 64x64 images (not yet run on a GPU).
UNET_PRESETS = {
    "tiny": dict(channels=(8, 16, 32), tdim=32, groups=4, image=16, batch=2),
    "sd-64": dict(channels=(320, 640, 1280), tdim=320, groups=32, image=64, batch=8),
}

WORKLOADS: dict[str, tuple[str, ...]] = {
    "gpt": tuple(PRESETS),
    "hf-gpt2": tuple(HF_PRESETS["hf-gpt2"]),
    "hf-llama": tuple(HF_PRESETS["hf-llama"]),
    "hf-albert": tuple(HF_PRESETS["hf-albert"]),
    "cnn": tuple(CNN_PRESETS),
    "seq2seq": tuple(SEQ2SEQ_PRESETS),
    "llama": tuple(LLAMA_PRESETS),
    "dit": tuple(DIT_PRESETS),
    "unet": tuple(UNET_PRESETS),
}


def build(
    name: str, preset: str, device: str | torch.device, batch: int | None = None, seed: int = 0
) -> Workload:
    """The workload ``name`` at ``preset``; ``batch`` overrides the preset's batch size.

    Raises ``ValueError`` for an unknown name or preset and ``WorkloadUnavailable`` when an optional
    package it needs (``transformers``) is not installed.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    if preset not in WORKLOADS[name]:
        raise ValueError(
            f"workload {name!r} has no preset {preset!r}; choose one of: {', '.join(WORKLOADS[name])}"
        )
    if batch is not None and batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    torch.manual_seed(seed)
    if name == "gpt":
        return _gpt(preset, device, batch or GPT_BATCH[preset])
    if name in HF_PRESETS:
        return _hf(name, preset, device, batch)
    if name == "cnn":
        return _cnn(preset, device, batch)
    if name == "llama":
        return _llama(preset, device, batch)
    if name == "dit":
        return _dit(preset, device, batch)
    if name == "unet":
        return _unet(preset, device, batch)
    return _seq2seq(preset, device, batch)


def _gpt(preset: str, device, batch: int) -> Workload:
    cfg = dataclasses.replace(PRESETS[preset], dropout=0.0)
    model = GPT(cfg)
    return Workload(
        "gpt",
        preset,
        model,
        gpt_batch(cfg, batch, device),
        lambda m: list(m.blocks),
        batch * cfg.seq,
        "tokens",
        f"GPT-style decoder (fxoffload.testing.models.GPT): {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, "
        f"seq {cfg.seq}, vocab {cfg.vocab}, batch {batch}",
    )


def _hf(name: str, preset: str, device, batch: int | None) -> Workload:
    try:
        import transformers
    except ImportError as e:
        raise WorkloadUnavailable(
            f"{name} needs the transformers package ({e}); pip install transformers"
        ) from e
    kw = dict(HF_PRESETS[name][preset])
    preset_batch = kw.pop("batch")
    batch = batch or preset_batch
    common = dict(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "hf-gpt2":
        cfg = transformers.GPT2Config(**kw, **common, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        inner = transformers.GPT2LMHeadModel(cfg)
        # transformers finds no loss type in the name "GPT2LMHeadModel", logs a warning inside the
        # forward and falls back to "ForCausalLM"; the logging call is a graph break (two graph pairs
        # for one step). Naming the loss it falls back to anyway keeps the step one graph pair.
        inner.loss_type = "ForCausalLM"
        seq, blocks = kw["n_positions"], (lambda m: list(m.model.transformer.h))
        shape = f"{kw['n_layer']} layers, dim {kw['n_embd']}, {kw['n_head']} heads"
    elif name == "hf-albert":
        cfg = transformers.AlbertConfig(
            **kw, **common, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0
        )
        inner = transformers.AlbertForMaskedLM(cfg)
        # Checkpointing wraps the one shared layer group: each of its calls is a checkpointed region.
        seq, blocks = kw["max_position_embeddings"], (lambda m: [m.model.albert.encoder.albert_layer_groups[0]])
        shape = f"{kw['num_hidden_layers']} layers sharing one's weights, dim {kw['hidden_size']}"
    else:
        cfg = transformers.LlamaConfig(**kw, **common, attention_dropout=0.0)
        inner = transformers.LlamaForCausalLM(cfg)
        seq, blocks = kw["max_position_embeddings"], (lambda m: list(m.model.model.layers))
        shape = (
            f"{kw['num_hidden_layers']} layers, dim {kw['hidden_size']}, {kw['num_attention_heads']} heads "
            f"({kw['num_key_value_heads']} KV)"
        )
    idx = torch.randint(0, kw["vocab_size"], (batch, seq), device=device)
    return Workload(
        name,
        preset,
        HFCausalLM(inner),
        (idx, idx),
        blocks,
        batch * seq,
        "tokens",
        f"transformers {transformers.__version__} {type(inner).__name__} from a config (random weights): "
        f"{shape}, seq {seq}, vocab {kw['vocab_size']}, batch {batch}",
    )


def _cnn(preset: str, device, batch: int | None) -> Workload:
    kw = CNN_PRESETS[preset]
    batch = batch or kw["batch"]
    model = ResNet(kw["widths"], kw["depths"], kw["classes"])
    x = torch.randn(batch, 3, kw["image"], kw["image"], device=device)
    y = torch.randint(0, kw["classes"], (batch,), device=device)
    return Workload(
        "cnn",
        preset,
        model,
        (x, y),
        lambda m: list(m.blocks),
        batch,
        "samples",
        f"ResNet-style CNN: widths {kw['widths']}, blocks {kw['depths']}, "
        f"{kw['image']}x{kw['image']} images, "
        f"{kw['classes']} classes, batch {batch}",
    )


def _seq2seq(preset: str, device, batch: int | None) -> Workload:
    kw = SEQ2SEQ_PRESETS[preset]
    batch = batch or kw["batch"]
    model = Seq2Seq(kw["vocab"], kw["emb"], kw["hidden"])
    data = seq2seq_batch(batch, kw["src_len"], kw["tgt_len"], kw["vocab"], device)  # lengths stay on the CPU
    return Workload(
        "seq2seq",
        preset,
        model,
        data,
        lambda m: [m.encoder, m.cell],
        batch,
        "samples",
        f"attention seq2seq (fxoffload.testing.models.Seq2Seq): packed bidirectional GRU {kw['hidden']}, "
        f"GRUCell decoder with additive attention, vocab {kw['vocab']}, src {kw['src_len']}, "
        f"tgt {kw['tgt_len']}, batch {batch}",
    )


class LlamaBlock(nn.Module):
    """RMSNorm, fused QKV, causal SDPA, SwiGLU MLP: a Llama block's shape (``../shared/gpu/bound.py``)."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, mlp, bias=False), nn.Linear(dim, mlp, bias=False)
        self.down = nn.Linear(mlp, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DiTBlock(nn.Module):
    """A diffusion transformer block: adaptive LayerNorm (shift, scale, gate from the conditioning),
    non-causal attention over every token of a video clip, a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.n2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = nn.Linear(dim, 6 * dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c))[:, None].chunk(6, dim=-1)
        h = self.n1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + gate1 * self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        h = self.n2(x) * (1 + scale2) + shift2
        return x + gate2 * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class Stack(nn.Module):
    """Blocks in a row on a given input, the mean square of the output as the loss (``bound.py``'s)."""

    def __init__(self, blocks: list[nn.Module], conditioned: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.conditioned = conditioned

    def forward(self, x: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, c) if self.conditioned else block(x)
        return x.float().pow(2).mean()


def _llama(preset: str, device, batch: int | None) -> Workload:
    kw = LLAMA_PRESETS[preset]
    batch = batch or kw["batch"]
    model = Stack([LlamaBlock(kw["dim"], kw["heads"], kw["mlp"]) for _ in range(kw["blocks"])])
    dtype = torch.bfloat16 if kw["bf16"] else torch.float32
    model = model.to(dtype)
    x = torch.randn(batch, kw["seq"], kw["dim"], device=device, dtype=dtype, requires_grad=True)
    return Workload(
        "llama", preset, model, (x,), lambda m: list(m.blocks), batch * kw["seq"], "tokens",
        f"Llama-shaped blocks: {kw['blocks']} x (dim {kw['dim']}, {kw['heads']} heads, SwiGLU {kw['mlp']}), "
        f"seq {kw['seq']}, batch {batch}, {'bf16' if kw['bf16'] else 'fp32'} weights",
    )  # fmt: skip


def _dit(preset: str, device, batch: int | None) -> Workload:
    kw = DIT_PRESETS[preset]
    batch = batch or kw["batch"]
    model = Stack([DiTBlock(kw["dim"], kw["heads"]) for _ in range(kw["blocks"])], conditioned=True)
    dtype = torch.bfloat16 if kw["bf16"] else torch.float32
    model = model.to(dtype)
    x = torch.randn(batch, kw["tokens"], kw["dim"], device=device, dtype=dtype, requires_grad=True)
    c = torch.randn(batch, kw["dim"], device=device, dtype=dtype)
    return Workload(
        "dit", preset, model, (x, c), lambda m: list(m.blocks), batch * kw["tokens"], "tokens",
        f"video diffusion transformer blocks: {kw['blocks']} x (dim {kw['dim']}, {kw['heads']} heads, "
        f"non-causal attention, adaLN), {kw['tokens']} tokens, batch {batch}, "
        f"{'bf16' if kw['bf16'] else 'fp32'} weights",
    )  # fmt: skip


def _unet(preset: str, device, batch: int | None) -> Workload:
    kw = UNET_PRESETS[preset]
    batch = batch or kw["batch"]
    model = DiffusionUNet(kw["channels"], kw["tdim"], kw["groups"])
    shape = (batch, 3, kw["image"], kw["image"])
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    return Workload(
        "unet", preset, model, (x0.to(device), t.to(device), noise.to(device)), lambda m: list(m.blocks), batch,
        "samples", f"diffusion UNet: channels {kw['channels']}, {kw['image']}x{kw['image']} images, batch {batch}",
    )  # fmt: skip
