"""Rotary position embedding (RoPE), interleaved layout (as YOCO's): dimensions (2i, 2i+1) form
a pair rotated by ``position * theta^(-2i/d)``, computed as one complex multiplication."""

from __future__ import annotations

import torch
from torch import nn

from archlab.ops.common import float32_or_wider


class Rotary(nn.Module):
    """The frequencies are worked out on each call, in float64, then used in float32 (or the
    model's dtype if wider), as training uses them. A buffer would be cast with the model: in a
    bfloat16 model its rounding moved the angle at position 4,096 by up to 5 radians."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, N, H, D]; positions: [B or 1, N]."""
        wide = float32_or_wider(x.dtype)
        exponents = torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float64) / self.head_dim
        angles = positions.to(wide)[..., None] * (self.theta**-exponents).to(wide)  # [B or 1, N, D/2]
        turn = torch.polar(torch.ones_like(angles), angles)[:, :, None]  # e^(i angle), broadcast over heads
        pairs = torch.view_as_complex(x.to(wide).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)
