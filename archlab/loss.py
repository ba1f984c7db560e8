"""Cross-entropy through the LM head without the whole logits tensor.

With a 100K-token vocabulary the logits of one training step of 16K tokens take 6.5 GB in
float32, and their gradient as much again. ``linear_cross_entropy`` runs the head, the loss and
both gradients a chunk of tokens at a time during the forward pass and keeps only the gradients
of the hidden states and of the head's weight: the idea of Liger-Kernel's fused linear
cross-entropy, in PyTorch ops. The head's three matrix products are the ones the plain path does,
so nothing is recomputed and the FLOPs counted for it stay true.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from archlab.ops.common import float32_or_wider

IGNORE = -100  # a target that is not counted, as in F.cross_entropy
CHUNK_ELEMENTS = 2**27  # float32 logits per chunk: 512 MiB


def _chunks(rows: int, vocab: int) -> list[slice]:
    """The rows of the logits, a chunk of at most CHUNK_ELEMENTS logits at a time."""
    size = max(1, CHUNK_ELEMENTS // vocab)
    return [slice(start, start + size) for start in range(0, rows, size)]


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        counted = (targets != IGNORE).sum().clamp(min=1)
        accumulate = float32_or_wider(dtype)
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        for rows in _chunks(len(hidden), weight.shape[0]):
            h, t = hidden[rows].to(dtype), targets[rows]
            counts = t != IGNORE
            picked = t.masked_fill(~counts, 0)[:, None]  # another negative id is out of range, as in F.cross_entropy
            logits = (h @ w.T).to(accumulate)
            norm = logits.logsumexp(-1, keepdim=True)
            total += ((norm - logits.gather(1, picked))[:, 0] * counts).sum()
            grad = logits.sub_(norm).exp_()  # softmax, in the logits' memory
            grad.scatter_add_(1, picked, grad.new_full(picked.shape, -1.0))
            grad = grad.mul_(counts[:, None].to(accumulate) / counted).to(dtype)
            grad_hidden[rows] = grad @ w
            grad_weight += grad.T @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / counted

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), (grad_weight * grad_loss).to(ctx.weight_dtype), None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (``IGNORE`` not counted):
    hidden [M, D], weight [V, D], targets [M]. Under autocast the products run in its dtype."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return LinearCrossEntropy.apply(hidden, weight, targets, dtype)


@torch.no_grad()
def scores(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, correct top-1 predictions, positions counted] of ``hidden @ weight.T``
    against ``targets`` (``IGNORE`` not counted), a chunk of rows at a time: evaluation's loss and
    accuracy without the whole logits. Under autocast the product runs in its dtype."""
    totals = torch.zeros(3, dtype=float32_or_wider(hidden.dtype), device=hidden.device)
    for rows in _chunks(len(hidden), weight.shape[0]):
        t, logits = targets[rows], hidden[rows] @ weight.T
        logits = logits.to(float32_or_wider(logits.dtype))
        counted = t != IGNORE
        lost = F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="sum")
        totals += torch.stack((lost, ((logits.argmax(-1) == t) & counted).sum(), counted.sum()))
    return totals
