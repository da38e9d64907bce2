"""Temporal U-Net denoiser and return model of Diffuser (Janner et al. 2022, arXiv:2205.09991).

Trajectories ``[B, H, C]`` are treated as ``C``-channel 1-D signals over the horizon
``H``: residual blocks of 1-D convolutions (kernel 5, GroupNorm, Mish) conditioned
on the diffusion step, downsampled ``len(dim_mults) - 1`` times and upsampled back
with skip connections, as in the reference. ``H`` must be divisible by
``2 ** (len(dim_mults) - 1)``.

>>> import torch
>>> unet = TemporalUnet(4, dim=8, dim_mults=(1, 2))
>>> x, t = torch.randn(3, 8, 4), torch.tensor([0, 3, 7])
>>> unet(x, t).shape
torch.Size([3, 8, 4])
>>> ValueUnet(4, dim=8, dim_mults=(1, 2))(x, t).shape
torch.Size([3, 1])
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

__all__ = ["SinusoidalEmbedding", "ResidualTemporalBlock", "TemporalUnet", "ValueUnet"]


class SinusoidalEmbedding(nn.Module):
    """Transformer-style sinusoidal embedding of the diffusion step."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        half = dim // 2
        self.register_buffer("freqs", torch.exp(torch.arange(half) * -(math.log(10000) / max(half - 1, 1))))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = t.float().unsqueeze(-1) * self.freqs
        return torch.cat([x.sin(), x.cos()], -1)


def _conv_block(c_in: int, c_out: int, kernel: int = 5) -> nn.Sequential:
    groups = 8 if c_out % 8 == 0 else 1
    return nn.Sequential(nn.Conv1d(c_in, c_out, kernel, padding=kernel // 2), nn.GroupNorm(groups, c_out), nn.Mish())


class ResidualTemporalBlock(nn.Module):
    """Two conv blocks with the step embedding added in between, plus a residual path."""

    def __init__(self, c_in: int, c_out: int, embed_dim: int) -> None:
        super().__init__()
        self.block1, self.block2 = _conv_block(c_in, c_out), _conv_block(c_out, c_out)
        self.time = nn.Sequential(nn.Mish(), nn.Linear(embed_dim, c_out))
        self.residual = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x) + self.time(emb).unsqueeze(-1)
        return self.block2(h) + self.residual(x)


def _step_embedding(dim: int) -> nn.Sequential:
    return nn.Sequential(SinusoidalEmbedding(dim), nn.Linear(dim, 4 * dim), nn.Mish(), nn.Linear(4 * dim, dim))


class TemporalUnet(nn.Module):
    """``(x_t [B, H, C], t [B]) -> [B, H, C]``: the noise (or ``x_0``) prediction.

    Args:
        transition_dim: channels ``C`` (action + observation widths).

    Keyword Args:
        dim: channels of the first level (reference: 32).
        dim_mults: channel multiplier per level (reference: ``(1, 2, 4, 8)``).
    """

    def __init__(self, transition_dim: int, *, dim: int = 32, dim_mults: Sequence[int] = (1, 2, 4, 8)) -> None:
        super().__init__()
        dims = [transition_dim, *[dim * m for m in dim_mults]]
        pairs = list(zip(dims[:-1], dims[1:]))
        self.levels = len(pairs)
        self.step_embed = _step_embedding(dim)
        self.downs = nn.ModuleList()
        for i, (c_in, c_out) in enumerate(pairs):
            last = i == len(pairs) - 1
            self.downs.append(
                nn.ModuleList(
                    [
                        ResidualTemporalBlock(c_in, c_out, dim),
                        ResidualTemporalBlock(c_out, c_out, dim),
                        nn.Conv1d(c_out, c_out, 3, stride=2, padding=1) if not last else nn.Identity(),
                    ]
                )
            )
        mid = dims[-1]
        self.mid1, self.mid2 = ResidualTemporalBlock(mid, mid, dim), ResidualTemporalBlock(mid, mid, dim)
        self.ups = nn.ModuleList()
        for i, (c_in, c_out) in enumerate(reversed(pairs[1:])):
            last = i == len(pairs) - 2
            self.ups.append(
                nn.ModuleList(
                    [
                        ResidualTemporalBlock(2 * c_out, c_in, dim),
                        ResidualTemporalBlock(c_in, c_in, dim),
                        nn.ConvTranspose1d(c_in, c_in, 4, stride=2, padding=1),
                    ]
                )
            )
        self.final = nn.Sequential(_conv_block(dim, dim), nn.Conv1d(dim, transition_dim, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        emb = self.step_embed(t)
        skips = []
        for block1, block2, down in self.downs:
            h = block2(block1(h, emb), emb)
            skips.append(h)
            h = down(h)
        h = self.mid2(self.mid1(h, emb), emb)
        for block1, block2, up in self.ups:
            h = torch.cat([h, skips.pop()], 1)
            h = up(block2(block1(h, emb), emb))
        return self.final(h).transpose(1, 2)


class ValueUnet(nn.Module):
    """``(x_t [B, H, C], t [B]) -> [B, 1]``: the return of a noised trajectory (Diffuser's guide).

    The reference's value function is the U-Net's downsampling half followed by an
    MLP; ours pools the last level over time before the MLP, so it does not depend on
    the horizon.
    """

    def __init__(self, transition_dim: int, *, dim: int = 32, dim_mults: Sequence[int] = (1, 2, 4, 8)) -> None:
        super().__init__()
        dims = [transition_dim, *[dim * m for m in dim_mults]]
        self.step_embed = _step_embedding(dim)
        self.downs = nn.ModuleList(
            nn.ModuleList(
                [ResidualTemporalBlock(c_in, c_out, dim), ResidualTemporalBlock(c_out, c_out, dim), nn.Conv1d(c_out, c_out, 3, stride=2, padding=1)]
            )
            for c_in, c_out in zip(dims[:-1], dims[1:])
        )
        self.head = nn.Sequential(nn.Linear(dims[-1] + dim, dims[-1] // 2), nn.Mish(), nn.Linear(dims[-1] // 2, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        emb = self.step_embed(t)
        for block1, block2, down in self.downs:
            h = down(block2(block1(h, emb), emb))
        return self.head(torch.cat([h.mean(-1), emb], -1))
