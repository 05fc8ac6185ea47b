"""Triton kernels for the element-wise pieces around the delta rule: gating and l2norm.

    gdn_gating:  g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)
    l2norm:      x / sqrt(sum(x^2) + eps)  over the last dim
    post_conv_prep_kernel: both on the conv's packed q | k | v rows, split into contiguous q, k, v (newer vLLM's
                 prefill preparation, fast.vllm_ops.fused_post_conv_prep)

Both are memory-bound one-pass kernels with pinned configs (no autotune: they run inside decode
graphs, DESIGN.md invariant 2). Semantics, dtypes and validation are refgdn's (refgdn.gating).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from refgdn.checks import _need_float, _need_tensor, check_gating_inputs

from .chunk.common import _beta_of, _exp, _gate
from .launch import LayoutPlans, Relaunch
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


class _GatingPlan:
    """gdn_gating's launch for one call layout: output shapes / dtypes / device, grid, the kernel's integer arguments
    and its launcher (fast.launch.Relaunch). direct: a, b reach the kernel as [M, HV] views of themselves and A_log,
    dt_bias are contiguous (no per-call copy), so a later call of the layout needs only fresh outputs."""
    __slots__ = ("shape", "g_dtype", "beta_dtype", "device", "M", "ints", "launch", "direct")


def _gating_plan(A_log, a, dt_bias, b, reuse: bool):
    """-> (plan, A_log, a2, dt_bias, b2): the plan and the tensors its launch takes (rows views, or copies)."""
    HV = a.shape[-1]
    p = _GatingPlan()
    g_fp64 = any(t.dtype == torch.float64 for t in (A_log, a, dt_bias))
    p.shape, p.g_dtype, p.beta_dtype, p.device = a.shape, torch.float64 if g_fp64 else torch.float32, b.dtype, a.device
    A2, dt2 = A_log.contiguous(), dt_bias.contiguous()
    if a.numel() == 0:                                  # nothing to launch (HV = 0 has no [M, HV] view)
        p.M, p.direct, p.launch = 0, False, None
        return p, A2, a, dt2, b
    a2, b2 = _rows(a, HV), _rows(b, HV)
    M = p.M = a2.shape[0]
    p.direct = (a2.data_ptr() == a.data_ptr() and b2.data_ptr() == b.data_ptr() and A2 is A_log and dt2 is dt_bias)
    BH = min(next_pow2(HV), 64)
    BM = max(1, min(next_pow2(M), 4096 // BH))  # ~4K elements per program
    p.ints = (M, HV, a2.stride(0), b2.stride(0))
    p.launch = Relaunch(gdn_gating_kernel, (cdiv(M, BM), cdiv(HV, BH)),
                        dict(BM=BM, BH=BH, THRESHOLD=SOFTPLUS_THRESHOLD, G_FP64=g_fp64,
                             BETA_FP64=b.dtype == torch.float64, num_warps=4), reuse)
    return p, A2, a2, dt2, b2


def _gating_run(p: _GatingPlan, A_log, a2, dt_bias, b2):
    g = torch.empty(p.shape, dtype=p.g_dtype, device=p.device)
    beta = torch.empty(p.shape, dtype=p.beta_dtype, device=p.device)
    if p.M:
        p.launch(A_log, a2, dt_bias, b2, g, beta, *p.ints)
    return g, beta


# Eager calls by layout (fast.launch.LayoutPlans), as fast.norm's: vLLM's fused_gdn_gating runs once per GDN layer and
# step. The key: a's shape (b's is checked equal to it; the guard compares every tensor's metadata).
_GATING = LayoutPlans()


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor):
    """A_log: [HV], a: [..., HV], dt_bias: [HV], b: [..., HV] -> g: [..., HV] float32, beta: [..., HV] b.dtype

        g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)

    g is computed and returned in float32 (float64 if any of A_log, a, dt_bias is float64); beta
    is computed in float32 (float64 for float64 b) and returned in b's dtype. refgdn.gdn_gating's twin.
    A call layout seen twice is served from a plan (its host checks and Triton's launch path skipped).
    """
    key = ("gating", a.shape) if isinstance(a, torch.Tensor) else None
    tensors = (A_log, a, dt_bias, b)
    p = _GATING.get(key, tensors)
    if p is not None:                                       # a known layout: checked before
        return _gating_run(p, *tensors)
    check_gating_inputs(A_log, a, dt_bias, b)
    p, A2, a2, dt2, b2 = _gating_plan(A_log, a, dt_bias, b, False)
    out = _gating_run(p, A2, a2, dt2, b2)
    _GATING.remember(key, tensors, lambda: _gating_plan(A_log, a, dt_bias, b, True)[0])
    return out


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


class _L2Plan:
    """l2norm's launch for one call layout (as _GatingPlan): y's shape / dtype / device, the integer and float
    arguments, the launcher; direct: x reaches the kernel as an [M, K] view of itself."""
    __slots__ = ("shape", "dtype", "device", "M", "scalars", "launch", "direct")


def _l2_plan(x, eps, reuse: bool):
    """-> (plan, x2): the plan of l2norm_into's launch for x and the rows it reads (a view, or a copy)."""
    K = x.shape[-1]
    p = _L2Plan()
    p.shape, p.dtype, p.device = x.shape, x.dtype, x.device
    if x.numel() == 0:                                  # nothing to launch (K = 0 has no [M, K] view)
        p.M, p.direct, p.launch = 0, False, None
        return p, x
    x2 = _rows(x, K)  # [..., K] -> [M, K]
    M = p.M = x2.shape[0]
    p.direct = x2.data_ptr() == x.data_ptr()
    BK = next_pow2(K)
    BM = max(1, min(next_pow2(M), max(1, 4096 // BK)))  # ~4K elements per program
    p.scalars = (M, K, x2.stride(0), *eps_split(float(eps)))
    p.launch = Relaunch(l2norm_kernel, (cdiv(M, BM),), dict(BM=BM, BK=BK, FP64=x.dtype == torch.float64,
                                                           num_warps=4 if BK * BM <= 4096 else 8), reuse)
    return p, x2


_L2 = LayoutPlans()      # eager l2norm calls by layout (as _GATING)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., K] -> x / sqrt(sum(x^2) + eps) over the last dim, computed in float32 (float64 for
    float64 x), returned in x.dtype. refgdn.l2norm's twin. A call layout seen twice is served from a plan."""
    key = ("l2norm", type(eps), eps, x.shape) if isinstance(x, torch.Tensor) else None
    p = _L2.get(key, (x,))
    if p is not None:                                       # a known layout: checked before
        y = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        p.launch(x, y, *p.scalars)
        return y
    _need_tensor("x", x)
    _need_float("x", x)
    if x.dim() == 0:  # a scalar is its own last dim: [] -> [1]
        return l2norm(x.reshape(1), eps).reshape(())
    y = l2norm_into(x, torch.empty(x.shape, dtype=x.dtype, device=x.device), eps)
    _L2.remember(key, (x,), lambda: _l2_plan(x, eps, True)[0])
    return y


def l2norm_into(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """l2norm's launch: x: [..., K] -> y (given: x's shape, contiguous, any float dtype; the backward's
    recompute asks for fp32 or 16-bit). Inputs assumed checked; returns y."""
    p, x2 = _l2_plan(x, eps, False)
    if p.M:
        p.launch(x2, y, *p.scalars)
    return y


@triton.jit
def post_conv_prep_kernel(x, a, b, A_log, dt_bias, q, k, v, g, beta, L, s_xt, s_at, s_bt,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, G_EXP: tl.constexpr,
                          THRESHOLD: tl.constexpr, EPS: tl.constexpr, PRECISE: tl.constexpr):
    """Per (block of BT tokens, head): x [L, 2 H K + HV V] (row stride s_xt, unit column stride) split into
    q, k [L, H, K] and v [L, HV, V] (contiguous, x's dtype); a, b [L, HV] (row strides s_at, s_bt) -> g, beta [L, HV]
    float32. grid = (cdiv(L, BT), H + HV): programs h < H take query / key head h, the others value head h - H.

        q, k <- x / sqrt(sum(x^2) + EPS) (L2NORM)     g = -exp(A_log) softplus(a + dt_bias) (exp(g): G_EXP)
        beta = sigmoid(b)
    """
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = rows < L
    if i_h < H:                                              # query / key head i_h
        o_k = tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        p_q = x + rows[:, None] * s_xt + i_h * K + o_k[None, :]
        b_q = tl.load(p_q, mask=m, other=0.0).to(tl.float32)
        b_k = tl.load(p_q + H * K, mask=m, other=0.0).to(tl.float32)
        if L2NORM:                                           # masked columns load 0: nothing added to the sums
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + EPS)[:, None]
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + EPS)[:, None]
        out = (rows[:, None] * H + i_h) * K + o_k[None, :]
        tl.store(q + out, b_q.to(q.dtype.element_ty), mask=m)
        tl.store(k + out, b_k.to(k.dtype.element_ty), mask=m)
    else:                                                    # value head i_h - H and its gates
        i_hv = i_h - H
        o_v = tl.arange(0, BV)
        m = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(x + rows[:, None] * s_xt + 2 * H * K + i_hv * V + o_v[None, :], mask=m, other=0.0)
        tl.store(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_v, mask=m)
        b_a = tl.load(a + rows * s_at + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(b + rows * s_bt + i_hv, mask=m_t, other=0.0)
        b_g = _gate(b_a, tl.load(A_log + i_hv).to(tl.float32), tl.load(dt_bias + i_hv).to(tl.float32), THRESHOLD,
                    PRECISE)
        if G_EXP:
            b_g = _exp(b_g, PRECISE)
        tl.store(g + rows * HV + i_hv, b_g, mask=m_t)
        tl.store(beta + rows * HV + i_hv, _beta_of(b_b, m_t, 1, PRECISE), mask=m_t)


def post_conv_prep_config(H: int, HV: int, K: int, V: int) -> dict:
    """post_conv_prep_kernel's pinned config (no autotune: vLLM's prefill path runs it in piecewise CUDA graphs): 16
    tokens per program, four warps (unmeasured on a GPU: the first pick, vLLM's own tile)."""
    return dict(BT=16, BK=next_pow2(K), BV=next_pow2(V), num_warps=4)
