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


class Seq2Seq(nn.Module):
    """The attention seq2seq model of the well-known "high GPU memory" forum thread: a packed
    bidirectional GRU encoder, a bridge to the decoder state, and a GRUCell decoder with additive
    (Bahdanau) attention, trained with teacher forcing."""

    def __init__(self, vocab: int = 128, emb: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.encoder = nn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.att_enc = nn.Linear(2 * hidden, hidden, bias=False)
        self.att_dec = nn.Linear(hidden, hidden)
        self.att_v = nn.Linear(hidden, 1, bias=False)
        self.cell = nn.GRUCell(emb + 2 * hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    @torch.compiler.disable  # Dynamo does not trace packed sequences; the decoder still compiles
    def encode(self, src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(src), lengths, batch_first=True, enforce_sorted=False)
        enc, _ = self.encoder(packed)
        enc, _ = nn.utils.rnn.pad_packed_sequence(enc, batch_first=True, total_length=src.shape[1])
        return enc

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(src, lengths), lengths, tgt)

    def decode(self, enc: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """The teacher-forced decoder loss, from the encoder's padded outputs (batch, src_len, 2*hidden)."""
        mask = torch.arange(enc.shape[1], device=enc.device)[None, :] < lengths.to(enc.device)[:, None]
        state = torch.tanh(self.bridge(enc.sum(1) / lengths.to(enc.device)[:, None]))
        keys = self.att_enc(enc)
        loss = enc.new_zeros(())
        for t in range(tgt.shape[1] - 1):
            scores = self.att_v(torch.tanh(keys + self.att_dec(state)[:, None])).squeeze(-1)
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            context = (weights[:, :, None] * enc).sum(1)
            state = self.cell(torch.cat([self.embed(tgt[:, t]), context], -1), state)
            loss = loss + F.cross_entropy(self.out(state), tgt[:, t + 1])
        return loss / (tgt.shape[1] - 1)


class Seq2SeqDecoder(nn.Module):
    """The part of ``Seq2Seq`` that compiles (all but the eager encoder), taking the encoder's output
    as an input: a step of it holds only what its graphs hold, so predictions can be checked alone."""

    def __init__(self, model: Seq2Seq) -> None:
        super().__init__()
        self.model = model

    def forward(self, enc: torch.Tensor, lengths: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.model.decode(enc, lengths, tgt)


def seq2seq_batch(batch: int = 4, src_len: int = 12, tgt_len: int = 6, vocab: int = 128, device="cpu"):
    src = torch.randint(1, vocab, (batch, src_len), device=device)
    lengths = torch.randint(src_len // 2, src_len + 1, (batch,))
    lengths[0] = src_len
    return src, lengths, torch.randint(1, vocab, (batch, tgt_len), device=device)


def example(name: str, device: str | torch.device = "cpu"):
    """A built-in (model, example args) pair: "gpt", "cnn", "seq2seq" or "mlp"."""
    torch.manual_seed(0)
    if name == "gpt":
        cfg = PRESETS["tiny"]
        return GPT(cfg).to(device), gpt_batch(cfg, 8, device)
    if name == "cnn":
        return CNN().to(device), (torch.randn(8, 3, 32, 32, device=device), torch.randint(0, 10, (8,), device=device))
    if name == "seq2seq":
        return Seq2Seq().to(device), seq2seq_batch(device=device)
    if name == "mlp":
        return MLP().to(device), (torch.randn(32, 64, device=device),)
    if name == "seq2seq-decoder":  # not in EXAMPLES: a check of the compiled part of "seq2seq"
        model, (src, lengths, tgt) = example("seq2seq", device)
        with torch.no_grad():
            enc = model.encode(src, lengths)
        return Seq2SeqDecoder(model), (enc.requires_grad_(), lengths, tgt)
    raise ValueError(f"unknown example {name!r}; choose one of: gpt, cnn, seq2seq, mlp")


EXAMPLES = ("gpt", "cnn", "seq2seq", "mlp")

# The min_bytes each built-in example is explained and demonstrated with (CLI and demo alike): their
# tensors are KiB-sized, far below the backend's default of 1 MiB, so the default would offload nothing.
EXAMPLE_MIN_BYTES = {"gpt": "16KiB", "cnn": "64KiB", "seq2seq": "8KiB", "mlp": "16KiB"}
