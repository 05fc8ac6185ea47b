"""Step 5 of the chunked forward (refgdn.delta_rule.chunk_output): kernel 4, fully chunk-parallel.

    q, k: [B, T, H, K]   v_new: [B, T, HV, V]   h: [chunks, HV, K, V]   G: [B, T, HV]  -> o: [B, T, HV, V]
    O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * causal) v_new ]

``chunk_output_kernel``: grid (chunks * HV * cdiv(V, BV)). Here too: its pinned config
(``output_config``), launcher and the stage twin; and ``row_scales_kernel`` (q's l2norm row scales
1 / |q_i|, [B, T, H] fp32, for the fused state pass that forms o with use_qk_l2norm_in_kernel) with its twin
``row_scales``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import refgdn
from refgdn.checks import check_chunk_size

from ..launch import launch
from ..utils import cdiv, is_interpreting, next_pow2
from .common import (L2NORM_EPS, _blocks, _caller_rows, _cfg, _check_fast_limits, _chunk_rows, _Chunks, _dot, _exp,
                     _fp32_prec, _gdiff, _in_rows_of_chunk, _is_fp64, _precise, _small_smem, _unit_last, _warp_mma)


# ============================================================================================
# kernel 4: output (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def chunk_output_kernel(
    q, k, v_new, h, G, Gl, o,
    cu_seqlens, chunk_indices, in_rows, T, NT, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISE: tl.constexpr, EPS: tl.constexpr, IN_ROWS: tl.constexpr = False, K_IN_ROWS: tl.constexpr = False,
):
    """Per (chunk, value head, V-block):

        O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * [i >= j]) v_new ]

    q, k: [B, T, H, K] (strided; k already normalised when asked); v_new, o: [B, T, HV, V],
    G: [B, T, HV], h: [chunks, HV, K, V] (contiguous). grid = (chunks * HV * cdiv(V, BV),), V-block
    fastest, then head (q, k shared by GVA heads and V-blocks hit L2). L2NORM normalises q (see
    _output_block). PRECISE: decays from the compensated (G, Gl) pairs (kernel 1). IN_ROWS (FlashInfer's paged
    prefill; common._in_rows_of): q and o are the caller's, at the caller's rows of in_rows [N, 3] (B = 1);
    K_IN_ROWS: k too.
    """
    pid = tl.program_id(0)
    i_v = pid % ((V + BV - 1) // BV)                                # V-blocks per head (constexpr)
    i_h = (pid // ((V + BV - 1) // BV)) % HV
    i_c = pid // (((V + BV - 1) // BV) * HV)
    if IS_VARLEN:
        if tl.load(chunk_indices + i_c * 2) < 0:                     # a row of a device-built table past its last
            return                                                   # chunk (common._Chunks.unchecked): no chunk
    i_b, i_t, bos, eos, rows, m_r, tok = _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV, BT,
                                                     IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    i_hk = i_h // GROUP
    in_lo, in_hi, in_d = _in_rows_of_chunk(i_c, i_b, chunk_indices, in_rows, IN_ROWS or K_IN_ROWS, IS_VARLEN)
    r_c, m_c = _caller_rows(rows, m_r, in_lo, in_hi, in_d, IN_ROWS)              # q and o's rows
    r_k, m_rk = _caller_rows(rows, m_r, in_lo, in_hi, in_d, K_IN_ROWS)           # k's

    b_q = tl.load(q + i_b * s_qb + i_hk * s_qh + r_c.to(tl.int64)[:, None] * s_qt + o_k[None, :],
                  mask=m_c[:, None] & m_k[None, :], other=0.0)
    b_k = tl.load(k + i_b * s_kb + i_hk * s_kh + r_k.to(tl.int64)[:, None] * s_kt + o_k[None, :],
                  mask=m_rk[:, None] & m_k[None, :], other=0.0)
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vn = tl.load(v_new + tok[:, None] * V + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)

    if PRECISE:
        b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
    else:
        b_Gl = b_G
    b_o = _output_block(b_q, b_k, b_h, b_vn, b_G, b_Gl, b_G, m_r, scale, BT, L2NORM, False, PREC, DOT_F32, PRECISE,
                        EPS)
    tok_c = (i_b * T + r_c).to(tl.int64) * HV + i_h                 # o's (token, head)
    tl.store(o + tok_c[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_c[:, None] & m_v[None, :])


@triton.jit
def _output_block(b_q, b_k, b_h, b_vn, b_G, b_Gl, b_qs, m_r, scale, BT: tl.constexpr, L2NORM: tl.constexpr,
                  QS: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr,
                  EPS: tl.constexpr):
    """One chunk's output block, fp32 [BT, BV] (kernel 4's math; also kernel 3's with OUTPUT):

        O = scale [ exp(G) * (Q h) + ((Q K^T) * exp(G_i - G_j) * [i >= j]) v_new ]

    b_q, b_k: [BT, BK] as loaded (16-bit on the GPU); b_h: [BK, BV] the chunk-start state as a dot operand;
    b_vn: [BT, BV] v_new in o's dtype; b_G, b_Gl: [BT] (Gl: G's rounding error, used when PRECISE); m_r: [BT]
    valid rows. L2NORM normalises q: both products are linear in q's rows, so the dots take q as loaded and the
    rows are scaled by 1 / |q_i| in fp32 afterwards (no 16-bit rounding of the normalised q); exp(G) likewise
    scales the rows of Q h after the dot. QS: the row scales come in b_qs ([BT] fp32, row_scales_kernel's, the
    same formula) instead of being reduced from b_q here (b_qs is not read otherwise)."""
    o_t = tl.arange(0, BT)
    if L2NORM and QS:
        b_s = b_qs * scale                                          # [BT] row scale: scale / |q_i|
    elif L2NORM:
        qf = b_q.to(tl.float32)
        b_s = tl.rsqrt(tl.sum(qf * qf, 1) + EPS) * scale            # [BT] row scale: scale / |q_i|
    else:
        b_s = tl.zeros([BT], dtype=tl.float32) + scale
    b_o = _dot(b_q, b_h, PREC, DOT_F32) * (_exp(b_G, PRECISE) * b_s)[:, None]    # inter-chunk: exp(G) <= 1
    keep = (o_t[:, None] >= o_t[None, :]) & m_r[:, None]
    # precision hazard: mask before exp (above the diagonal G_i - G_j >= 0 may overflow)
    b_A = _dot(b_q, tl.trans(b_k), PREC, DOT_F32) * _exp(tl.where(keep, _gdiff(b_G, b_Gl, b_G, b_Gl, PRECISE), 0.0),
                                                         PRECISE)
    b_A = tl.where(keep, b_A * b_s[:, None], 0.0)
    return b_o + _dot(b_A.to(b_vn.dtype), b_vn, PREC, DOT_F32)           # intra-chunk


@triton.jit(do_not_specialize=["M", "T"])
def row_scales_kernel(x, s, M, T, s_b, s_t, s_h,
                      H: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr):
    """x: [B, T, H, K] (strided, unit last-dim stride) -> s: [B, T, H] fp32 contiguous, M = B T H rows:

        s_i = 1 / sqrt(sum_k x_ik^2 + eps)        (l2norm's row scale: l2norm(x)_i = s_i x_i)

    The fused state pass (kernel 3 with OUTPUT and L2NORM) scales its output rows by q's s instead of reducing
    q's [BT, K] tile in every program (2 V-blocks x GROUP value heads per key head and chunk)."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)                 # flat (b, t, h) row index
    m_m = o_m < M
    o_k = tl.arange(0, BK)
    i_h = o_m % H
    i_t = (o_m // H) % T
    i_b = o_m // (H * T)
    off = i_b.to(tl.int64) * s_b + i_t.to(tl.int64) * s_t + i_h.to(tl.int64) * s_h
    b_x = tl.load(x + off[:, None] + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
    # masked columns load 0 and add nothing to the sum of squares
    tl.store(s + o_m, tl.rsqrt(tl.sum(b_x * b_x, 1) + EPS), mask=m_m)


# ============================================================================================
# host side: pinned config, launcher, the stage twin chunk_output
# ============================================================================================

def output_config(K: int, V: int, device: Optional[torch.device] = None, itemsize: int = 2) -> dict:
    """Kernel 4 (chunk_output_kernel): chunk-parallel, (chunks x HV x V-blocks) programs, plenty at any
    T >= a few chunks. BV = V (up to 128) so Q K^T is computed once per (chunk, head); 4 warps (one
    warpgroup) for the [BT, 128] fp32 accumulator next to the [BT, BT] attention block (measured on
    H200 at K = V = 128: 4 warps beat 8). On warp-MMA GPUs (_warp_mma; device None: not) 8 warps: at 4 the
    l2norm variant spills 152-188 B per thread on sm_80 / sm_86 / sm_120 (ptxas 12.9, bf16, K = V = 128), at 8
    none (untimed: state_config). 4-byte tiles (itemsize) on a ~99 KB-shared-memory GPU (_small_smem): BV 32, 90 KB
    of shared memory where BV 128 needs 160 KB and BV 64 114 KB (sm_86, float32, K = V = 128; compiled, not run)."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():
        return dict(BV=min(BVmax, 64), num_warps=4, num_stages=1)
    BV = min(BVmax, 128 if BK <= 128 else 64)
    if itemsize >= 4 and device is not None and _small_smem(device):
        BV = min(BV, 32)
    wide = BK * BV > 128 * 128 or (device is not None and _warp_mma(device))
    return dict(BV=BV, num_warps=8 if wide else 4, num_stages=1)


def row_scales_config(K: int) -> dict:
    """row_scales_kernel: a bandwidth-bound pass over x (one read, [BM, K] per program). BM = 4096 / K rows (32 at K =
    128): 4 warps, 32 fp32 values per thread. Interpreter: the same."""
    BK = next_pow2(K)
    return dict(BM=max(1, 4096 // BK), num_warps=4, num_stages=1)


def _launch_row_scales(x: torch.Tensor, s: torch.Tensor, *, configs: Optional[dict] = None):
    """row_scales_kernel: x [B, T, H, K] (unit last-dim stride) -> s [B, T, H] fp32 contiguous (written)."""
    B, T, H, K = x.shape
    M = B * T * H
    if M == 0:
        return
    cfg = _cfg("row_scales", row_scales_config(K), configs)
    BM = cfg.pop("BM")
    return launch(row_scales_kernel, (cdiv(M, BM),), dict(H=H, K=K, BM=BM, BK=next_pow2(K), EPS=L2NORM_EPS, **cfg),
                  x, s, M, T, *x.stride()[:3])


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """The stage twin of row_scales_kernel: x [B, T, H, K] -> [B, T, H] float32, 1 / sqrt(sum(x^2) + eps) per row
    (eps = L2NORM_EPS, as l2norm's). float64 x: refgdn's formula in float64."""
    if x.dtype == torch.float64:
        return torch.rsqrt((x * x).sum(-1) + L2NORM_EPS)
    B, T, H, K = x.shape
    s = torch.empty(B, T, H, dtype=torch.float32, device=x.device)
    _launch_row_scales(_unit_last(x), s)
    return s


def _launch_output(q, k, v_new, h, G, Gl, o, ch: _Chunks, T: int, BT: int, scale: float, *, l2norm_q: bool,
                   precise: bool, configs: Optional[dict] = None, in_rows: Optional[torch.Tensor] = None,
                   k_in_rows: bool = False):
    """Kernel 4. k: [B, T, H, K] (normalised already when asked); l2norm_q normalises q in the kernel;
    Gl: G's rounding error or None (0). in_rows: int32 [N, 3], q and o in the caller's rows (the kernel's IN_ROWS;
    k too with k_in_rows), else None."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v_new.shape[2], v_new.shape[3]
    if ch.total == 0 or HV == 0:
        return
    BK, _ = _blocks(K, V)
    cfg = _cfg("output", output_config(K, V, q.device, q.element_size()), configs)
    BV = cfg.pop("BV")
    if precise and Gl is None:
        Gl = torch.zeros_like(G)
    kw = dict(
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, L2NORM=l2norm_q, PREC=_fp32_prec(q.dtype), DOT_F32=is_interpreting(),
        PRECISE=precise, EPS=L2NORM_EPS, IN_ROWS=in_rows is not None, K_IN_ROWS=in_rows is not None and k_in_rows,
        **cfg)
    return launch(chunk_output_kernel, (ch.total * HV * cdiv(V, BV),), kw,
        q, k, v_new, h, G, G if Gl is None else Gl, o,
        ch.cu_seqlens, ch.indices, in_rows, T, ch.NT, float(scale),
        *q.stride()[:3], *k.stride()[:3])


def chunk_output(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, G: torch.Tensor,
                 scale: float, chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 5. q, k: [B, T, H, K], v_new: [B, T, HV, V], h: [B, NC, HV, K, V], G: [B, T, HV] -> o: [B, T, HV, V]
    (v_new.dtype).

        O = scale * [ (Q * exp(G)) S_chunk_start + ((Q K^T) * exp(G_i - G_j) * tril) v_new ]   (kernel 4)
    """
    check_chunk_size(chunk_size)
    if _is_fp64(q, k, v_new, h, G):
        return refgdn.delta_rule.chunk_output(q, k, v_new, h, G, scale, chunk_size)
    _check_fast_limits(q.shape[3], v_new.shape[3], chunk_size)
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.empty(B, T, HV, V, dtype=v_new.dtype, device=q.device)
    hh = h.reshape(-1, HV, K, V).contiguous()                       # [B, NC, HV, K, V] -> [(B NC), HV, K, V]
    _launch_output(_unit_last(q), _unit_last(k), v_new.contiguous(), hh, G.float().contiguous(), None, o,
                   _Chunks(B, T, chunk_size, cu_seqlens), T, chunk_size, float(scale), l2norm_q=False,
                   precise=_precise(q.dtype))
    return o
