"""RMSNorms: the GDN layer's output norm (gated by the activation of z) and the model's plain one.

    x, g: [..., D]   weight, bias: [D] (or None)  ->  y: [..., D] in x.dtype
    rms_norm_gated:  y = (x / sqrt(mean(x^2) + eps) * weight + bias) * act(g)   act(g) = g sigmoid(g) or sigmoid(g)
    rms_norm:        y =  x / sqrt(mean(x^2) + eps) * weight + bias     (weight -> 1 + weight with unit_offset)

fla's ``rms_norm_gated`` / ``FusedRMSNormGated`` and vLLM's ``RMSNormGated`` compute this in float32 and round once
at the end, as here (refgdn.model's GDN layers call it through their ops namespace). transformers' torch
``Qwen3NextRMSNormGated`` also rounds the normalised x to x's dtype before the weight multiplies it: one rounding
more for 16-bit x, which the conformance rule's float64 truth sees as error, not as a different definition.
"""
from __future__ import annotations

import torch

from .checks import check_rms_norm_gated_inputs, check_rms_norm_inputs
from .gating import compute_dtype


def gate_activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g): g sigmoid(g) for "swish" / "silu", sigmoid(g) for "sigmoid" (in g's dtype: upcast first)."""
    s = torch.sigmoid(g)
    return g * s if activation in ("swish", "silu") else s


def _normalized(s: torch.Tensor, weight, bias, eps: float, dt: torch.dtype, unit_offset: bool = False):
    """s / sqrt(mean(s^2) + eps) * w + bias in dt (s already in dt): the core both norms share; w = weight, or
    1 + weight with unit_offset."""
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)             # mean over the true D
    if weight is not None:
        y = y * (1.0 + weight.to(dt) if unit_offset else weight.to(dt))
    if bias is not None:
        y = y + bias.to(dt)
    return y


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight, bias=None, activation: str = "swish",
                   residual=None, prenorm: bool = False, residual_in_fp32: bool = False, eps: float = 1e-6):
    """x, g: [..., D]; weight, bias: [D] or None -> y: [..., D] in x.dtype (fla 0.6.0's name and argument order).

        y = (x / sqrt(mean(x^2) + eps) * weight + bias) * act(g)

    Computed in float32 (float64 when any input is float64), cast back once. residual / prenorm /
    residual_in_fp32 (fla's pre-norm residual add) must stay None / False. Differentiable (autograd).
    """
    check_rms_norm_gated_inputs(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps)
    dt = compute_dtype(x, g, weight, bias)
    y = _normalized(x.to(dt), weight, bias, eps, dt)
    return (y * gate_activation(g.to(dt), activation)).to(x.dtype)


def residual_out_dtype(x: torch.Tensor, residual, residual_in_fp32: bool, prenorm: bool = True):
    """The dtype of rms_norm's pre-norm sum x + residual as returned with prenorm (fla's rule): the residual's, else
    float32 with residual_in_fp32, else None (x itself is returned: nothing was added). None without prenorm (the sum
    is not returned: fast does not store it)."""
    if not prenorm:
        return None
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 and x.dtype != torch.float32 else None


def rms_norm(x: torch.Tensor, weight, bias=None, residual=None, eps: float = 1e-5, prenorm: bool = False,
             residual_in_fp32: bool = False, *, unit_offset: bool = False):
    """x: [..., D]; weight, bias: [D] or None; residual: [..., D] or None -> y: [..., D] in x.dtype, or (y,
    residual_out) with prenorm (fla 0.6.0's ``fla.modules.layernorm.rms_norm`` name and argument order).

        s = x + residual;   y = s / sqrt(mean(s^2) + eps) * w + bias        w = weight, or 1 + weight with unit_offset

    residual_out = s in the residual's dtype (float32 with residual_in_fp32 and no residual; x itself when nothing was
    added): the next block's residual (fla's pre-norm residual stream). The sum is normalised as computed (float32),
    not as rounded to residual_out's dtype, as fla's kernels do. unit_offset: the zero-centred weight of Qwen3-Next's
    (and Gemma's) RMSNorm, stored as w - 1 (FlashInfer's gemma_rmsnorm); refgdn.model's norms take it. Computed in
    float32 (float64 when any input is float64), cast back once. Differentiable (autograd).
    """
    check_rms_norm_inputs(x, weight, bias, residual, eps, prenorm, residual_in_fp32, unit_offset)
    dt = compute_dtype(x, weight, bias, residual)
    s = x.to(dt) if residual is None else x.to(dt) + residual.to(dt)
    y = _normalized(s, weight, bias, eps, dt, unit_offset).to(x.dtype)
    if not prenorm:
        return y
    rdt = residual_out_dtype(x, residual, residual_in_fp32)
    return y, (s.to(rdt) if rdt is not None else x)
