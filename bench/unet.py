"""A diffusion UNet trained on the noise-prediction loss: the convolution-heavy workload of people
training image and video diffusion models (GroupNorm, SiLU, strided convolutions, nearest
upsampling, ``cat`` skips, a timestep embedding added in every residual block). Inductor runs its
convolutions channels-last; oneDNN and cuDNN hold scratch inside their calls, and the forward saves
channels-last copies of the weights: the replay of Inductor's code measures both, the FX graph's
memory model counts them from that code (``analysis.memory.CodeFacts``; ``docs/results.md``, the
nineteenth to twenty-first sessions)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], 1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int, groups: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, te: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(te))[:, :, None, None]
        return self.c2(F.silu(self.n2(h))) + self.skip(x)


class DiffusionUNet(nn.Module):
    """Two levels down, a middle block, two levels up; ``forward(x0, t, noise)`` is the step's loss:
    the MSE of the predicted noise of ``x0`` noised at timesteps ``t``."""

    def __init__(self, channels: tuple[int, int, int] = (8, 16, 32), tdim: int = 32, groups: int = 4) -> None:
        super().__init__()
        c0, c1, c2 = channels
        self.tdim = tdim
        self.tmlp = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inc = nn.Conv2d(3, c0, 3, padding=1)
        self.d1, self.down1 = ResBlock(c0, c0, tdim, groups), nn.Conv2d(c0, c0, 3, stride=2, padding=1)
        self.d2, self.down2 = ResBlock(c0, c1, tdim, groups), nn.Conv2d(c1, c1, 3, stride=2, padding=1)
        self.mid = ResBlock(c1, c2, tdim, groups)
        self.u2, self.u1 = ResBlock(c2 + c1, c1, tdim, groups), ResBlock(c1 + c0, c0, tdim, groups)
        self.out = nn.Sequential(nn.GroupNorm(groups, c0), nn.SiLU(), nn.Conv2d(c0, 3, 3, padding=1))
        self.blocks = nn.ModuleList([self.d1, self.d2, self.mid, self.u2, self.u1])

    def predict(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        te = self.tmlp(timestep_embedding(t, self.tdim))
        h0 = self.d1(self.inc(x), te)
        h1 = self.d2(self.down1(h0), te)
        u = F.interpolate(self.mid(self.down2(h1), te), scale_factor=2, mode="nearest")
        u = F.interpolate(self.u2(torch.cat([u, h1], 1), te), scale_factor=2, mode="nearest")
        return self.out(self.u1(torch.cat([u, h0], 1), te))

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        keep = (1 - t.float() / 1000)[:, None, None, None]
        noised = keep.sqrt() * x0 + (1 - keep).sqrt() * noise
        return F.mse_loss(self.predict(noised, t), noise)
