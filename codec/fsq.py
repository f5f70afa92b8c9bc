"""Finite scalar quantisation (Mentzer et al., 2023): no codebook, each latent dimension is bounded
and rounded to one of L_i levels with a straight-through gradient. Imports only torch."""

from __future__ import annotations

import math

import torch
from torch import nn


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round in the forward pass, identity gradient in the backward pass."""
    return x + (torch.round(x) - x).detach()


class FSQ(nn.Module):
    """Quantise [..., G * len(levels)] latents: G groups of len(levels) dimensions, one code per group.

    `quantize` returns values on the grid scaled to [-1, 1] (the continuous latent a flow model predicts);
    `codes` / `from_codes` convert to / from integer indices in [0, prod(levels))."""

    def __init__(self, levels: tuple[int, ...] = (8, 5, 5, 5), groups: int = 1, eps: float = 1e-3) -> None:
        super().__init__()
        self.levels = tuple(int(v) for v in levels)
        self.groups = int(groups)
        self.eps = eps
        lv = torch.tensor(self.levels, dtype=torch.float32)
        basis = torch.cumprod(torch.tensor((1, *self.levels[:-1]), dtype=torch.int64), 0)
        self.register_buffer("_levels", lv, persistent=False)
        self.register_buffer("_basis", basis, persistent=False)

    @property
    def dim(self) -> int:
        return len(self.levels) * self.groups

    @property
    def codebook_size(self) -> int:
        return math.prod(self.levels)

    @property
    def bits_per_frame(self) -> float:
        return self.groups * math.log2(self.codebook_size)

    def _lv(self) -> torch.Tensor:
        return self._levels.repeat(self.groups)

    def bound(self, z: torch.Tensor) -> torch.Tensor:
        """tanh-bound so that rounding gives exactly L levels (the half-step offset handles even L)."""
        lv = self._lv()
        half_l = (lv - 1) * (1 + self.eps) / 2
        offset = torch.where(lv % 2 == 0, 0.5, 0.0)
        shift = torch.atanh(offset / half_l)
        return torch.tanh(z + shift) * half_l - offset

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Straight-through quantised latent, scaled to [-1, 1]."""
        half_width = torch.div(self._lv(), 2, rounding_mode="floor")
        return round_ste(self.bound(z)) / half_width

    def snap(self, y: torch.Tensor) -> torch.Tensor:
        """A predicted latent scaled like `quantize`'s output [..., G*D] -> the nearest grid point."""
        lv = self._lv()
        half_width = torch.div(lv, 2, rounding_mode="floor")
        y = torch.minimum(torch.maximum(y, -torch.ones_like(lv)), (lv - 1 - half_width) / half_width)
        return torch.round(y * half_width) / half_width

    def codes(self, zq: torch.Tensor) -> torch.Tensor:
        """Quantised latent [..., G*D] -> integer codes [..., G]."""
        lv = self._lv()
        half_width = torch.div(lv, 2, rounding_mode="floor")
        digits = torch.round(zq * half_width + half_width).long()
        digits = digits.reshape(*zq.shape[:-1], self.groups, len(self.levels))
        return (digits * self._basis).sum(-1)

    def digits(self, codes: torch.Tensor) -> torch.Tensor:
        """Integer codes [..., G] -> per-dimension level indices [..., G, D]."""
        lv = self._levels.long()
        return torch.div(codes.unsqueeze(-1), self._basis, rounding_mode="floor") % lv

    def from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Integer codes [..., G] -> quantised latent [..., G*D] in [-1, 1]."""
        d = self.digits(codes).to(torch.float32)
        half_width = torch.div(self._levels, 2, rounding_mode="floor")
        return ((d - half_width) / half_width).reshape(*codes.shape[:-1], self.dim)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        zq = self.quantize(z)
        return zq, self.codes(zq)
