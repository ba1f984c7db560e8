"""Feed-forward sublayers, each spec beside the module it builds: dense SwiGLU and a top-k routed
mixture of SwiGLU experts."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from archlab.block import MAX_SIZE, Problems, Size, Strict, round_up
from archlab.ops.common import float32_or_wider


class SwiGLU(Strict):
    """Dense gated FFN; ``hidden`` defaults to 8/3 of the width rounded up to a multiple of 64."""

    type: Literal["swiglu"] = "swiglu"
    hidden: Size | None = None

    def hidden_for(self, d_model: int) -> int:
        return self.hidden or round_up(8 * d_model // 3, 64)

    def params(self, d_model: int) -> int:
        return 3 * d_model * self.hidden_for(d_model)

    def active_params(self, d_model: int) -> int:
        return self.params(d_model)

    def flops_per_token(self, d_model: int) -> int:
        return 2 * self.params(d_model)

    def check(self, problems: Problems) -> None:
        """What the fields' own limits cannot say, as a block's ``check``: a dense FFN has nothing more."""

    def build(self, d_model: int, init_std: float) -> nn.Module:
        return SwiGLUFFN(d_model, self.hidden_for(d_model))


class SwiGLUFFN(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor, aux_losses: list) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoE(Strict):
    """Top-k routed SwiGLU experts plus always-on shared experts, with a load-balancing loss."""

    type: Literal["moe"]
    n_experts: Size
    top_k: Size
    n_shared: int = Field(0, ge=0, le=MAX_SIZE)
    expert_hidden: Size
    aux_loss_weight: float = Field(0.01, ge=0)

    def params(self, d_model: int) -> int:
        """Router, every routed expert and the shared experts."""
        return d_model * self.n_experts + 3 * d_model * self.expert_hidden * (self.n_experts + self.n_shared)

    def active_params(self, d_model: int) -> int:
        """What one token uses: the router, its top-k experts and the shared ones."""
        return d_model * self.n_experts + 3 * d_model * self.expert_hidden * (self.top_k + self.n_shared)

    def flops_per_token(self, d_model: int) -> int:
        return 2 * self.active_params(d_model)

    def check(self, problems: Problems) -> None:
        if self.top_k > self.n_experts:
            problems.at("top_k").add(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")

    def build(self, d_model: int, init_std: float) -> nn.Module:
        return MoEFFN(d_model, self, init_std)


class MoEFFN(nn.Module):
    """Softmax router, top-k of ``n_experts`` SwiGLU experts, plus ``n_shared`` experts every
    token uses. Top-k weights are renormalised to sum to one when k > 1; a single expert is
    scaled by its router probability, as in Switch, since renormalised it would be 1 and the
    router would learn from the balance loss alone. Appends the Switch-style balance loss
    ``weight * E * sum_e(fraction routed to e * mean router probability of e)`` to ``aux_losses``."""

    not_capturable = "picks its experts on the host, each step"  # forward's chosen.unique().tolist(): Engine(cuda_graph=True) refuses

    def __init__(self, d_model: int, spec: MoE, init_std: float):
        super().__init__()
        self.top_k, self.aux_weight = spec.top_k, spec.aux_loss_weight
        self.router = nn.Linear(d_model, spec.n_experts, bias=False)
        hidden, experts = spec.expert_hidden, spec.n_experts
        self.gate_up = nn.Parameter(torch.empty(experts, d_model, 2 * hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.shared = SwiGLUFFN(d_model, hidden * spec.n_shared) if spec.n_shared else None
        nn.init.normal_(self.gate_up, std=init_std)  # the model's init reaches nn.Linear weights only
        nn.init.normal_(self.down, std=init_std)

    def route(self, tokens: torch.Tensor) -> torch.Tensor:
        """Router scores, multiplied out in float32 (or wider), autocast or not: in bfloat16 their
        rounding sent a few tokens in a thousand to another set of experts."""
        wide = float32_or_wider(tokens.dtype)
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(wide), self.router.weight.to(wide))

    def forward(self, x: torch.Tensor, aux_losses: list) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.route(tokens).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(tokens)
        for expert in chosen.unique().tolist():
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            gate, up = (tokens[rows] @ self.gate_up[expert]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down[expert]
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            out = out + self.shared(tokens, aux_losses)
        n_experts = probs.shape[-1]
        routed = F.one_hot(chosen, n_experts).sum(dim=1).to(probs.dtype).mean(dim=0) / self.top_k  # probs: float32 or wider
        self.last_load = routed.detach()  # fraction of routed slots per expert, for utilisation logs
        aux_losses.append(self.aux_weight * n_experts * (routed * probs.mean(dim=0)).sum())
        return out.view_as(x)
