"""Rotary position embedding (RoPE), interleaved layout (as YOCO's): dimensions (2i, 2i+1) form
a pair rotated by ``position * theta^(-2i/d)``, computed as one complex multiplication."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, N, H, D]; positions: [B or 1, N]."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [B or 1, N, D/2]
        turn = torch.polar(torch.ones_like(angles), angles)[:, :, None]  # e^(i angle), broadcast over heads
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)
