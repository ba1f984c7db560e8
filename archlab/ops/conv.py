"""The short depthwise causal conv (then silu) of the Mamba2 and Gated DeltaNet blocks, in pure PyTorch.

No kernel is dispatched for it (causal-conv1d's would only save a transpose and the small conv),
so it takes the blocks' sequence-first layout: x [B, T, D], weight [D, W], state [B, D, W-1].
"""
import torch
import torch.nn.functional as F

from archlab.ops.common import float32_or_wider, without_autocast


@without_autocast
def short_conv(x, weight, bias=None, state=None):
    """silu(bias + sum_w weight[:, w] * x[t - W + 1 + w]) for every t: x [B, T, D] -> [B, T, D].

    The inputs before x are ``state`` (the last W-1 of them, [B, D, W-1]), or zeros without one;
    a state is then overwritten in place with the last W-1 inputs, so that the next call, a
    decoding step or the next prefill chunk, continues from it. Computed in float32 or wider
    (autocast or not); the output keeps x's dtype.
    """
    batch, length, channels = x.shape
    dtype = float32_or_wider(x.dtype)
    weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    past = x.new_zeros(batch, channels, weight.shape[1] - 1, dtype=dtype) if state is None else state.to(dtype)
    inputs = torch.cat([past, x.transpose(1, 2).to(dtype)], dim=-1)  # [B, D, W-1+T]
    if state is not None and length == 1:  # a decoding step: one window, elementwise, as its cost counts it (state_update)
        out = (inputs * weight).sum(-1, keepdim=True)
        out = out if bias is None else out + bias[:, None]
    else:
        out = F.conv1d(inputs, weight[:, None], bias, groups=channels)
    if state is not None:
        state.copy_(inputs[..., length:])
    return F.silu(out).transpose(1, 2).to(x.dtype)
