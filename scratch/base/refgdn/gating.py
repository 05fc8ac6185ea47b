"""Gating and normalisation: the small element-wise pieces around the delta rule."""
from __future__ import annotations

import torch

from .checks import _need_float, _need_tensor, check_gating_inputs

SOFTPLUS_THRESHOLD = 20.0


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (the oracle's truth runs), else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus(x) = log(1 + exp(x)), returning x itself when x > 20 (torch/fla/vLLM convention)."""
    # precision hazard: exp overflows for large x; clamp the argument of the branch we discard.
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x.clamp(max=SOFTPLUS_THRESHOLD))))


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor):
    """Gated DeltaNet gates from the raw projections.

    A_log: [HV], a: [..., HV], dt_bias: [HV], b: [..., HV]  ->  g: [..., HV] float32, beta: [..., HV] b.dtype

        g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)

    g is a log-space decay (g <= 0), computed and returned in float32 (float64 when any input is
    float64). beta is computed in float32 and returned in b's dtype.
    """
    check_gating_inputs(A_log, a, dt_bias, b)
    dt = compute_dtype(A_log, a, dt_bias)
    g = -torch.exp(A_log.to(dt)) * softplus(a.to(dt) + dt_bias.to(dt))
    beta = torch.sigmoid(b.to(compute_dtype(b))).to(b.dtype)
    return g, beta


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., K] -> x / sqrt(sum(x^2) + eps) over the last dim, computed in float32, returned in x.dtype."""
    _need_tensor("x", x)
    _need_float("x", x)
    xf = x.to(compute_dtype(x))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)
