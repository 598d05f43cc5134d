"""Built-in example models for the demo, the tests and the benchmarks (random weights, no download)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1


PRESETS = {
    "tiny": GPTConfig(),  # CPU tests and demo
    "small": GPTConfig(vocab=4096, seq=256, dim=256, heads=4, layers=4),
    "gpt2-medium": GPTConfig(vocab=50304, seq=1024, dim=1024, heads=16, layers=24),  # GPU
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), drop, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), drop, self.training)


class GPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        for module in self.modules():  # GPT-2's initialisation: small weights, a sane first loss
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(cfg: GPTConfig, batch: int, device: str | torch.device = "cpu", seq: int | None = None):
    seq = seq or cfg.seq
    idx = torch.randint(0, cfg.vocab, (batch, seq), device=device)
    return idx, torch.roll(idx, -1, dims=1)


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


class CNN(nn.Module):
    """A small ResNet-style CNN with BatchNorm."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
        )  # fmt: skip
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = F.relu(h + self.body(h))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)
