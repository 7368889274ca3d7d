"""Tiny models for the engine tests: shapes chosen so rows do not divide by 2, 3 or 4 ranks."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, d: int = 6, h: int = 11, layers: int = 2, out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_net(seed: int = 0, **kw: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kw)


def batch(step: int, rank: int, world: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (same on every process) and this rank's contiguous slice of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 7, generator=g)
    y = torch.randn(n, 5, generator=g)
    k = n // world
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]
