"""Triton kernels for the element-wise pieces around the delta rule: gating and l2norm.

    gdn_gating:  g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)
    l2norm:      x / sqrt(sum(x^2) + eps)  over the last dim

Both are memory-bound one-pass kernels with pinned configs (no autotune: they run inside decode
graphs, DESIGN.md invariant 2). Semantics, dtypes and validation are refgdn's (refgdn.gating).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from refgdn.checks import _need_float, _need_tensor, check_gating_inputs

from .utils import cdiv, eps_split, fp64_eps, next_pow2

SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def gdn_gating_kernel(A_log, a, dt_bias, b, g, beta, M, HV,
                      stride_a_m, stride_b_m,
                      BM: tl.constexpr, BH: tl.constexpr, THRESHOLD: tl.constexpr,
                      G_FP64: tl.constexpr, BETA_FP64: tl.constexpr):
    """a, b: [M, HV] (row strides given, unit column stride); A_log, dt_bias: [HV]; g, beta: [M, HV] contiguous.

    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
    """
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_h = i_h * BH + tl.arange(0, BH)
    m_m = o_m < M
    m_h = o_h < HV
    mask = m_m[:, None] & m_h[None, :]
    rows = o_m.to(tl.int64)
    if G_FP64:
        cdt = tl.float64
    else:
        cdt = tl.float32
    b_A = tl.load(A_log + o_h, mask=m_h, other=0).to(cdt)
    b_dt = tl.load(dt_bias + o_h, mask=m_h, other=0).to(cdt)
    b_a = tl.load(a + rows[:, None] * stride_a_m + o_h[None, :], mask=mask, other=0).to(cdt)
    x = b_a + b_dt[None, :]
    # precision hazard: exp(x) overflows for large x; clamp the argument of the branch we discard.
    sp = tl.where(x > THRESHOLD, x, tl.log(1 + tl.exp(tl.minimum(x, THRESHOLD))))
    b_g = -tl.exp(b_A)[None, :] * sp
    tl.store(g + rows[:, None] * HV + o_h[None, :], b_g.to(g.dtype.element_ty), mask=mask)

    if BETA_FP64:
        bdt = tl.float64
    else:
        bdt = tl.float32
    b_b = tl.load(b + rows[:, None] * stride_b_m + o_h[None, :], mask=mask, other=0).to(bdt)
    # sigmoid without overflow: exp only of -|b| <= 0 (exp(-b) would overflow for b << 0)
    e = tl.exp(-tl.abs(b_b))
    b_beta = tl.where(b_b >= 0, 1 / (1 + e), e / (1 + e))
    tl.store(beta + rows[:, None] * HV + o_h[None, :], b_beta.to(beta.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, HV: int) -> torch.Tensor:
    """[..., HV] -> [M, HV] with unit column stride (a view when the layout allows, else a copy)."""
    t2 = t.reshape(-1, HV)  # [..., HV] -> [(...), HV]
    if HV > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor):
    """A_log: [HV], a: [..., HV], dt_bias: [HV], b: [..., HV] -> g: [..., HV] float32, beta: [..., HV] b.dtype

        g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)

    g is computed and returned in float32 (float64 if any of A_log, a, dt_bias is float64); beta
    is computed in float32 (float64 for float64 b) and returned in b's dtype. refgdn.gdn_gating's twin.
    """
    check_gating_inputs(A_log, a, dt_bias, b)
    HV = a.shape[-1]
    g_fp64 = any(t.dtype == torch.float64 for t in (A_log, a, dt_bias))
    g = torch.empty(a.shape, dtype=torch.float64 if g_fp64 else torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if a.numel() == 0:
        return g, beta
    a2, b2 = _rows(a, HV), _rows(b, HV)
    M = a2.shape[0]
    BH = min(next_pow2(HV), 64)
    BM = max(1, min(next_pow2(M), 4096 // BH))  # ~4K elements per program
    grid = (cdiv(M, BM), cdiv(HV, BH))
    gdn_gating_kernel[grid](A_log.contiguous(), a2, dt_bias.contiguous(), b2, g, beta, M, HV,
                            a2.stride(0), b2.stride(0),
                            BM=BM, BH=BH, THRESHOLD=SOFTPLUS_THRESHOLD,
                            G_FP64=g_fp64, BETA_FP64=b.dtype == torch.float64, num_warps=4)
    return g, beta


@triton.jit
def l2norm_kernel(x, y, M, K, stride_x_m, eps, eps_lo,
                  BM: tl.constexpr, BK: tl.constexpr, FP64: tl.constexpr):
    """x: [M, K] (row stride given, unit column stride) -> y: [M, K] contiguous;  y = x / sqrt(sum(x^2) + eps).
    eps + eps_lo: utils.eps_split's two float32 parts (summed in float64 by the float64 variant)."""
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    mask = (o_m < M)[:, None] & (o_k < K)[None, :]
    rows = o_m.to(tl.int64)
    if FP64:
        b_x = tl.load(x + rows[:, None] * stride_x_m + o_k[None, :], mask=mask, other=0).to(tl.float64)
    else:
        b_x = tl.load(x + rows[:, None] * stride_x_m + o_k[None, :], mask=mask, other=0).to(tl.float32)
    # masked columns load 0 and add nothing to the sum of squares.
    b_r = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + fp64_eps(eps, eps_lo, FP64))
    tl.store(y + rows[:, None] * K + o_k[None, :], (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=mask)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., K] -> x / sqrt(sum(x^2) + eps) over the last dim, computed in float32 (float64 for
    float64 x), returned in x.dtype. refgdn.l2norm's twin."""
    _need_tensor("x", x)
    _need_float("x", x)
    if x.dim() == 0:  # a scalar is its own last dim: [] -> [1]
        return l2norm(x.reshape(1), eps).reshape(())
    return l2norm_into(x, torch.empty(x.shape, dtype=x.dtype, device=x.device), eps)


def l2norm_into(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """l2norm's launch: x: [..., K] -> y (given: x's shape, contiguous, any float dtype; the backward's
    recompute asks for fp32 or 16-bit). Inputs assumed checked; returns y."""
    if x.numel() == 0:
        return y
    K = x.shape[-1]
    x2 = _rows(x, K)  # [..., K] -> [M, K]
    M = x2.shape[0]
    BK = next_pow2(K)
    BM = max(1, min(next_pow2(M), max(1, 4096 // BK)))  # ~4K elements per program
    l2norm_kernel[(cdiv(M, BM),)](x2, y, M, K, x2.stride(0), *eps_split(float(eps)),
                                  BM=BM, BK=BK, FP64=x.dtype == torch.float64,
                                  num_warps=4 if BK * BM <= 4096 else 8)
    return y
