"""Rotary position embedding (RoPE), half-split layout."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Rotates the last dimension of q or k by angles ``position * theta^(-2i/d)``."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, N, H, D]; positions: [N] or [B, N]."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., N, D/2]
        if angles.dim() == 2:
            angles = angles[None]
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)
