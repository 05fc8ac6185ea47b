"""Causal depthwise conv1d (the short convolution in front of q, k, v) and its one-token update."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .checks import check_conv_inputs, check_conv_update_inputs, one_host_read
from .delta_rule import sequences
from .gating import compute_dtype


def _activate(y: torch.Tensor, activation) -> torch.Tensor:
    return F.silu(y) if activation in ("silu", "swish") else y


@one_host_read   # cu_seqlens' values read to the host once per call (or taken from cu_seqlens_cpu)
def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
    """Causal depthwise conv1d over time.

    x: [B, T, D]   weight: [D, W]   bias: [D]   initial_state: [N, D, W-1] (oldest input first)
    cu_seqlens: [N+1] int with B == 1 (varlen); cu_seqlens_cpu: optional, its values as a CPU tensor,
    used in place of reading cu_seqlens (which must hold the same values: the segmentation follows
    cu_seqlens_cpu). Returns y: [B, T, D] in x.dtype and final_state:
    [N, D, W-1] (the last W-1 inputs of each sequence, initial state included when the sequence is
    shorter; in initial_state's dtype if given, else x's) or None unless output_final_state.

        y_t = act(bias + sum_{j=0}^{W-1} weight[:, j] * x_{t-W+1+j})      act: None or "silu"

    Inputs before a sequence's start come from initial_state (zeros when None).
    """
    check_conv_inputs(x, weight, bias, activation, initial_state, cu_seqlens, cu_seqlens_cpu)
    B, T, D = x.shape
    W = weight.shape[1]
    dt = compute_dtype(x, weight, initial_state)
    state_dtype = initial_state.dtype if initial_state is not None else x.dtype
    wf = weight.to(dt)
    y_parts, finals = [], []
    for n, b, bos, eos in sequences(B, T, cu_seqlens):
        hist = (rearrange(initial_state[n], "d w -> w d").to(dt) if initial_state is not None
                else x.new_zeros(W - 1, D, dtype=dt))
        xp = torch.cat([hist, x[b, bos:eos].to(dt)])                       # [W-1+L, D], oldest first
        L = eos - bos
        y = sum(wf[:, j] * xp[j:j + L] for j in range(W))                  # [L, D]
        if bias is not None:
            y = y + bias.to(dt)
        y_parts.append(_activate(y, activation))
        finals.append(rearrange(xp[xp.shape[0] - (W - 1):], "w d -> d w"))
    y = torch.stack(y_parts) if cu_seqlens is None else torch.cat(y_parts)[None]
    final = torch.stack(finals).to(state_dtype) if output_final_state else None
    return y.to(x.dtype), final


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """One decode step of the causal conv1d, updating conv_state in place.

    x: [N, D]   conv_state: [N, D, W-1] (oldest first)   weight: [D, W]   bias: [D] -> y: [N, D] in x.dtype

        window = [conv_state, x] ;  y = act(bias + sum_j weight[:, j] * window[:, j]) ;
        conv_state <- window[:, 1:]                  (drop the oldest input, append x)

    The new state holds x cast to conv_state's dtype, exactly as a kernel would store it.
    """
    check_conv_update_inputs(x, conv_state, weight, bias, activation)
    dt = compute_dtype(x, weight, conv_state)
    window = torch.cat([conv_state.to(dt), x.to(dt)[:, :, None]], dim=2)  # [N, D, W]
    y = (window * weight.to(dt)).sum(-1)
    if bias is not None:
        y = y + bias.to(dt)
    y = _activate(y, activation)
    # state write last, after everything that could fail; x rounded to the state's dtype like a store
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x.to(conv_state.dtype)[:, :, None]], dim=2))
    return y.to(x.dtype)
