"""Depthwise causal conv1d in pure PyTorch, mirroring the `causal-conv1d` package.

Layout is channel-first like causal_conv1d: x [B, D, T], weight [D, W], conv states [B, D, W-1]
(the last W-1 inputs). Computed in fp32 (fp64 stays fp64), autocast or not; outputs keep x's dtype, states are fp32.
"""
import torch
import torch.nn.functional as F

from archlab.ops.common import float32_or_wider, without_autocast


def _activate(y, activation):
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


@without_autocast
def causal_conv1d_fn(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
    """out[t] = act(bias + sum_w weight[:, w] * x[t - W + 1 + w]), with x[<0] taken from initial_states (or 0).

    Returns out [B, D, T], or (out, final_states [B, D, W-1]) if return_final_states.
    Unlike the CUDA kernel there is no seq_idx / final_states_out (pass arguments by keyword).
    """
    B, D, T = x.shape
    W = weight.shape[1]
    dtype = float32_or_wider(x.dtype)
    past = x.new_zeros(B, D, W - 1, dtype=dtype) if initial_states is None else initial_states.to(dtype)
    xp = torch.cat([past, x.to(dtype)], dim=-1)  # [B, D, W-1+T]
    out = F.conv1d(xp, weight.to(dtype).unsqueeze(1), None if bias is None else bias.to(dtype), groups=D)
    out = _activate(out, activation).to(x.dtype)
    return (out, xp[..., T:]) if return_final_states else out


@without_autocast
def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """One decoding step: x [B, D], conv_state [B, D, W-1] -> (out [B, D], new_conv_state [B, D, W-1]).

    The CUDA kernel keeps a [B, D, W] state, shifts it in place and returns only out; ours is
    functional (returns the new state, no in-place write) so it stays autograd-friendly, and its
    state is exactly causal_conv1d_fn's final_states, so prefill -> decode hands over directly.
    """
    dtype = float32_or_wider(x.dtype)
    window = torch.cat([conv_state.to(dtype), x.to(dtype).unsqueeze(-1)], dim=-1)  # [B, D, W]
    out = (window * weight.to(dtype)).sum(-1)
    if bias is not None:
        out = out + bias.to(dtype)
    return _activate(out, activation).to(x.dtype), window[..., 1:]


def short_conv(x, weight, bias=None, state=None, activation="silu"):
    """Sequence-first causal conv for a block: x [B, T, D] -> [B, T, D].

    With ``state`` (a [B, D, W-1] tensor of the last inputs) it continues from and updates that
    state in place: one token takes the decoding op, several take the full op.
    """
    if state is None:
        return causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    if x.shape[1] == 1:
        out, new_state = causal_conv1d_update(x[:, 0], state, weight, bias, activation=activation)
        state.copy_(new_state)
        return out[:, None]
    out, new_state = causal_conv1d_fn(
        x.transpose(1, 2), weight, bias, initial_states=state, return_final_states=True, activation=activation
    )
    state.copy_(new_state)
    return out.transpose(1, 2)
