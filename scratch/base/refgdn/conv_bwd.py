"""The backward of the causal depthwise conv1d: the readable twin of fast.conv_bwd's kernel.

    x: [B, T, D]   weight: [D, W]   bias: [D]   initial_state: [N, D, W-1]   dy: [B, T, D]
    y_t = act(bias + sum_j weight[:, j] x_{t-W+1+j})     final_state = the last W-1 inputs

Per sequence, with xp = [initial_state ; x] (the W-1 inputs before the sequence first) and
dz = dy * act'(z) the gradient of the pre-activation z:

    dxp_p = sum_j weight[:, j] dz_{p-j}            (p indexes xp; x_t is xp_{t+W-1})
    dweight[:, j] = sum_t dz_t xp_{t+j} ;  dbias = sum_t dz_t
    dinitial_state = dxp_{0..W-2} ;  dx_t = dxp_{t+W-1} ;  plus dfinal on the last W-1 entries of xp
"""
from __future__ import annotations

import torch
from einops import rearrange

from .delta_rule import sequences
from .gating import compute_dtype


def silu_bwd(z: torch.Tensor) -> torch.Tensor:
    """d silu(z) / dz = s (1 + z (1 - s)), s = sigmoid(z)."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def causal_conv1d_bwd(x, weight, dy, bias=None, activation=None, initial_state=None, cu_seqlens=None, dfinal=None):
    """Gradients of refgdn.causal_conv1d by hand.

    x: [B, T, D]  weight: [D, W]  dy: [B, T, D]  bias: [D]  initial_state: [N, D, W-1]  dfinal: [N, D, W-1]
    -> (dx [B, T, D], dweight [D, W], dbias [D] or None, dinitial_state [N, D, W-1] or None), in the
    compute dtype (float32, float64 for float64 inputs).
    """
    B, T, D = x.shape
    W = weight.shape[1]
    dt = compute_dtype(x, weight, initial_state)
    wf = weight.to(dt)
    dx = torch.zeros(B, T, D, dtype=dt, device=x.device)
    dw = torch.zeros(D, W, dtype=dt, device=x.device)
    db = torch.zeros(D, dtype=dt, device=x.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dinit = torch.zeros(N, D, W - 1, dtype=dt, device=x.device)
    for n, b, bos, eos in sequences(B, T, cu_seqlens):
        L = eos - bos
        hist = (rearrange(initial_state[n], "d w -> w d").to(dt) if initial_state is not None
                else x.new_zeros(W - 1, D, dtype=dt))
        xp = torch.cat([hist, x[b, bos:eos].to(dt)])                       # [W-1+L, D]
        z = sum(wf[:, j] * xp[j:j + L] for j in range(W))
        if bias is not None:
            z = z + bias.to(dt)
        dz = dy[b, bos:eos].to(dt)
        if activation in ("silu", "swish"):
            dz = dz * silu_bwd(z)
        dxp = torch.zeros_like(xp)
        for j in range(W):                                                 # z_t reads xp_{t+j} with weight j
            dxp[j:j + L] += wf[:, j] * dz
            dw[:, j] += (dz * xp[j:j + L]).sum(0)
        db += dz.sum(0)
        if dfinal is not None and W > 1:                                   # final_state = xp's last W-1 rows
            dxp[xp.shape[0] - (W - 1):] += rearrange(dfinal[n].to(dt), "d w -> w d")
        dinit[n] = rearrange(dxp[:W - 1], "w d -> d w")
        dx[b, bos:eos] = dxp[W - 1:]
    return dx, dw, (db if bias is not None else None), (dinit if initial_state is not None else None)
