"""Triton prefill for the gated delta rule: the chunked WY/UT form in three kernels, plus a recurrent kernel.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   state: [N, HV, K, V] float32
    S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

Value head h reads q/k head h // (HV // H) (GVA: q/k are never repeated). Varlen: B == 1 and
cu_seqlens [N+1]; chunks never straddle sequences. Semantics, validation and dtypes are refgdn's
(refgdn.delta_rule): o in v's dtype, final state float32.

The pipeline (BT = chunk size in {16, 32, 64}; "chunk" = BT tokens of one sequence):

  1. ``chunk_wy_kernel``      grid (chunks * HV)           fully chunk-parallel
       g (or fused gating of raw a) -> G = chunk-local cumsum            (fp32, stored)
       L_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j                    (16x16 blocks, tl.dot)
       A = (I + L)^-1: each 16x16 diagonal block by forward substitution in registers, the
           off-diagonal blocks by block forward substitution (16^3 fp32 dots, INV_PRECISION)
       w = A (beta exp(G) K),  u = A (beta V)                             (stored in k's / v's dtype)
  2. ``chunk_state_kernel``   grid (cdiv(V, BV), N * HV)   sequential over the chunks of a sequence
       h[c] = S (stored in k's dtype);  v_new = u - w S (stored);
       S <- exp(G_last) S + K^T (exp(G_last - G) v_new)                   (S: fp32 [K, BV] in registers)
  3. ``chunk_output_kernel``  grid (chunks * HV * cdiv(V, BV)) fully chunk-parallel
       O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * causal) v_new ]

HBM traffic per token and value head: read q, k (shared by the GVA group, mostly L2), v, g, beta;
write/read w, u, v_new and G once each; h once per chunk. The fp32 inverse A never leaves registers.
With ``FUSE_OUTPUT = True`` kernel 2 also computes kernel 3's output from S in registers, so h and
v_new never touch HBM (more work on the sequential path; benchmark both).

Tuning knobs (module globals, read at call time; each value is its own compiled variant):
``CONFIG_OVERRIDES`` (per-kernel BV / num_warps / num_stages over the pinned heuristics),
``FUSE_OUTPUT``, ``INV_METHOD`` ("rows" / "doubling" for the 16x16 diagonal inverses),
``INV_PRECISION`` and ``FP32_PRECISION`` (tl.dot input precisions, see below).

``recurrent_kernel`` (grid (cdiv(V, BV), N * HV)) is the time loop with the state in registers:
the twin of refgdn.recurrent_gated_delta_rule, handy for short T.

Each refgdn stage (chunk_cumsum, wy_repr, w_u, state_passing, chunk_output) has a twin here of
the same name and signature built from the same kernels (kernel 1 runs with constexpr switches),
so each kernel is tested alone against refgdn.delta_rule's stage.

Configs are pinned by small heuristics (``*_config`` below), never autotuned at run time: the
prefill path must launch exactly the variants warmup compiled (DESIGN.md invariants 1 and 2) and
autotune would re-run kernels. Dots keep 16-bit operands on the GPU (fp32 accumulate); fp32 inputs
use IEEE fp32 dots (TF32 would exceed the conformance bound). In the Triton interpreter dot operands
are cast to fp32 (bf16 dots are wrong there) and every kernel uses one config.
float64 inputs run refgdn itself (the oracle is the float64 path; there are no float64 kernels).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

import refgdn
from refgdn.checks import check_chunk_size, check_gdn_inputs

from .utils import cdiv, is_interpreting, next_pow2, prepare_chunk_indices, prepare_chunk_offsets

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
MAX_HEAD_DIM = 256
CHUNK_SIZES = (16, 32, 64)
# tl.dot input precisions (constexprs, so each value is its own compiled variant):
#   FP32_PRECISION: dots on fp32 inputs. "ieee" is exact fp32 FMA (slow, spills on sm90: fp32 inputs are
#     not the fast path); "tf32x3" would use tensor cores at ~fp32 accuracy.
#   INV_PRECISION: the 16x16 fp32 products of the triangular inverse's off-diagonal blocks, per input
#     dtype. A is rounded to the input dtype before w = A (beta exp(G) K), so TF32 products (relative
#     rounding 2^-11) are far below bf16's (2^-9); fp16 rounds like TF32, so it gets tf32x3 (~fp32);
#     fp32 gets exact IEEE. On sm90 "ieee" products lower to FMA loops that cost ~80 registers more
#     (the bf16 kernel then spills).
FP32_PRECISION = "ieee"
INV_PRECISION = {torch.bfloat16: "tf32", torch.float16: "tf32x3", torch.float32: "ieee"}
# The 16x16 diagonal blocks of (I + L)^-1: "rows" (forward substitution, 15 dependent steps, no dots)
# or "doubling" (4 levels of two 16x16 dots at INV_PRECISION). None: rows on GPU, doubling in the
# interpreter. Both are direct (no series, no approximation); the tests run both.
INV_METHOD: Optional[str] = None
# Fuse kernel 3 into kernel 2 (the output computed in the sequential pass from S in registers): saves
# the h and v_new round trips through HBM (~3 x T x HV x V x 2 bytes + h) at the price of more work on
# the sequential path. Off until measured on the GPU (benchmark both).
FUSE_OUTPUT = False
# Per-kernel config overrides merged over the pinned heuristics, for benchmark sweeps:
# {"wy": {...}, "state": {...}, "state_fused": {...}, "output": {...}, "recurrent": {...}} with keys
# BV, num_warps, num_stages (BV not for "wy"). Each distinct config is its own compiled variant.
CONFIG_OVERRIDES: dict = {}


# ============================================================================================
# shared jit helpers
# ============================================================================================

@triton.jit
def _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN: tl.constexpr):
    """Global chunk index -> (batch row i_b [int64], chunk index within its sequence, bos, eos).

    Tokens of the chunk are rows bos + i_t * BT + r (r < BT) of batch row i_b, valid while < eos.
    Dense: chunk i_c = i_b * NT + i_t, bos = 0, eos = T. Varlen (B == 1): chunk_indices [NT_total, 2].
    """
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        i_b = i_n * 0
    else:
        i_b = (i_c // NT).to(tl.int64)
        i_t = i_c % NT
        bos = 0
        eos = T
    return i_b, i_t, bos, eos


@triton.jit
def _gate(a, A_log_h, dt_bias_h, THRESHOLD: tl.constexpr):
    """Fused gating in fp32: g = -exp(A_log) * softplus(a + dt_bias), softplus(x) = x for x > 20."""
    x = a + dt_bias_h
    # precision hazard: exp overflows for large x; clamp the argument of the branch we discard.
    sp = tl.where(x > THRESHOLD, x, tl.log(1 + tl.exp(tl.minimum(x, THRESHOLD))))
    return -tl.exp(A_log_h) * sp


@triton.jit
def _l2norm_rows(x, EPS: tl.constexpr):
    """x: [M, BK] -> x / sqrt(sum(x^2) + eps) per row, computed in fp32, returned in x's dtype.
    Masked-off columns were loaded as 0, so they do not count in the norm."""
    xf = x.to(tl.float32)
    return (xf * tl.rsqrt(tl.sum(xf * xf, 1) + EPS)[:, None]).to(x.dtype)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """tl.dot with fp32 accumulation. PREC: input_precision for fp32 operands ("ieee", "tf32x3"), or
    None for 16-bit operands (the default). DOT_F32 (interpreter only): cast operands to fp32 first, as
    bf16 dots are wrong there (the interpreter ignores input_precision)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if PREC is None:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _mm32(a, b, INV_PREC: tl.constexpr):
    """[16, 16] x [16, 16] fp32 product for the triangular inverse; INV_PREC is its input_precision."""
    return tl.dot(a, b, input_precision=INV_PREC)


@triton.jit
def _inv_unit_lower(L, BC: tl.constexpr, LOG2_BC: tl.constexpr, INV_PREC: tl.constexpr):
    """L: [BC, BC] strictly lower triangular (fp32) -> (I + L)^-1, by recursive doubling in registers.

    X starts as I, the inverse of the 1x1 diagonal blocks. Level s (1, 2, ..., BC/2) merges each pair
    of s x s diagonal blocks [[X1, 0], [L21, X2]] into their 2s x 2s inverse [[X1, 0], [-X2 L21 X1, X2]],
    for every pair at once:  X <- X - X M X  with M = L restricted to the L21 quadrants of level s.
    This is block forward substitution (the same products, no series), log2(BC) steps of two
    [BC, BC] dots each instead of BC - 1 dependent row steps; IEEE fp32 dots.
    """
    o = tl.arange(0, BC)
    X = (o[:, None] == o[None, :]).to(tl.float32)
    for lvl in tl.static_range(LOG2_BC):
        s = 1 << lvl
        quad = ((o[:, None] // (2 * s)) == (o[None, :] // (2 * s))) \
            & ((o[:, None] // s) % 2 == 1) & ((o[None, :] // s) % 2 == 0)
        M = tl.where(quad, L, 0.0)
        X = X - _mm32(_mm32(X, M, INV_PREC), X, INV_PREC)
    return X


@triton.jit
def _inv_unit_lower_rows(L, BC: tl.constexpr):
    """L: [BC, BC] strictly lower triangular (fp32) -> (I + L)^-1, by forward substitution row by row.

    With X = (I + L)^-1 - I (strictly lower), row i is x_i = -L_i - L_i X (rows < i of X only):
    BC - 1 dependent steps of masked row extraction and a [BC] x [BC, BC] product, no tl.dot (few
    registers on the GPU; each step is a pair of cross-thread reductions).
    """
    o = tl.arange(0, BC)
    X = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(1, BC):
        a = -tl.sum(tl.where(o[:, None] == i, L, 0.0), 0)          # -L[i, :], indexed by column m
        a = a + tl.sum(a[:, None] * X, 0)                           # -L_i - L_i X  (X rows >= i are 0)
        X = tl.where(o[:, None] == i, a[None, :], X)
    return X + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def _kk_block(ka, kb, beta_a, Ga, Gb, m_a, PREC: tl.constexpr, DOT_F32: tl.constexpr, DIAG: tl.constexpr):
    """One 16x16 block of L: L_ij = beta_i (k_i . k_j) exp(G_i - G_j) for rows i of block a, cols j of
    block b (b <= a), strictly below the diagonal when DIAG. Rows past the sequence end (m_a False) are 0."""
    o = tl.arange(0, 16)
    keep = m_a[:, None] & (o[None, :] >= 0)
    if DIAG:
        keep = keep & (o[:, None] > o[None, :])
    # precision hazard: mask before exp. Discarded entries (above the diagonal, or a padded row whose
    # G was loaded as 0) can have G_i - G_j > 0 and overflow; exponentiate 0 there instead.
    decay = tl.exp(tl.where(keep, Ga[:, None] - Gb[None, :], 0.0))
    kk = _dot(ka, tl.trans(kb), PREC, DOT_F32)
    return tl.where(keep, kk * beta_a[:, None] * decay, 0.0)


# ============================================================================================
# kernel 1: cumsum (+ gating) -> L -> A = (I + L)^-1 -> w, u     (fully chunk-parallel)
# ============================================================================================

@triton.jit
def _g_block(g_base, s_gt, rows, m_r, G, G_off, acc, A_log_h, dt_bias_h,
             GATE: tl.constexpr, LOAD_G: tl.constexpr, STORE_G: tl.constexpr, THRESHOLD: tl.constexpr):
    """One 16-token block of G (fp32 [16]): loaded (LOAD_G) or g (gated) cumsum'ed on top of acc."""
    if LOAD_G:
        b_G = tl.load(G + G_off, mask=m_r, other=0.0).to(tl.float32)
    else:
        b_g = tl.load(g_base + rows.to(tl.int64) * s_gt, mask=m_r, other=0.0).to(tl.float32)
        if GATE:
            b_g = _gate(b_g, A_log_h, dt_bias_h, THRESHOLD)
        # padded tokens get g = 0 (decay 1): G stays flat past the sequence end
        b_g = tl.where(m_r, b_g, 0.0)
        b_G = tl.cumsum(b_g, 0) + acc
        acc = acc + tl.sum(b_g, 0)
        if STORE_G:
            tl.store(G + G_off, b_G, mask=m_r)
    return b_G, acc


@triton.jit
def _load_k_block(k_base, rows, m_r, s_kt, o_k, m_k, L2NORM: tl.constexpr, EPS: tl.constexpr):
    """k rows [16, BK] of one 16-token block (padded rows and columns are 0), l2-normalised if asked."""
    b_k = tl.load(k_base + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                  other=0.0)
    if L2NORM:
        b_k = _l2norm_rows(b_k, EPS)
    return b_k


@triton.jit
def _beta_v_block(v_base, rows, m_r, s_vt, o_v, m_v, b_beta):
    """beta * V for one 16-token block, [16, BV] in v's dtype."""
    b_v = tl.load(v_base + rows.to(tl.int64)[:, None] * s_vt + o_v[None, :], mask=m_r[:, None] & m_v[None, :],
                  other=0.0)
    return (b_v.to(tl.float32) * b_beta[:, None]).to(b_v.dtype)


@triton.jit
def _beta_k_block(b_k, b_beta, b_G):
    """beta * exp(G) * K for one 16-token block in k's dtype. exp(G) <= 1 (G: cumsum of g <= 0)."""
    return (b_k.to(tl.float32) * (b_beta * tl.exp(b_G))[:, None]).to(b_k.dtype)


@triton.jit
def _store_w_u(w, u, tok, m_r, b_w, b_u, o_k, m_k, o_v, m_v, K: tl.constexpr, V: tl.constexpr):
    tl.store(w + tok[:, None] * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_r[:, None] & m_k[None, :])
    tl.store(u + tok[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])


@triton.jit
def _a_off(tok, j: tl.constexpr, BT: tl.constexpr):
    """Offsets of block column j (16 wide) of A: [B, T, HV, BT] for the block's 16 tokens."""
    return tok[:, None] * BT + j * 16 + tl.arange(0, 16)[None, :]


@triton.jit
def _inv_diag(L, INV_ROWS: tl.constexpr, INV_PREC: tl.constexpr):
    if INV_ROWS:
        return _inv_unit_lower_rows(L, 16)
    else:
        return _inv_unit_lower(L, 16, 4, INV_PREC)


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_wy_kernel(
    k, v, g, beta, A_log, dt_bias,          # inputs
    G, A, w, u,                             # outputs (or inputs, see LOAD_G / DO_A)
    cu_seqlens, chunk_indices, T, NT,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr,
    LOAD_G: tl.constexpr, STORE_G: tl.constexpr, DO_A: tl.constexpr, STORE_A: tl.constexpr,
    DO_WU: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr, INV_ROWS: tl.constexpr,
    DOT_F32: tl.constexpr, THRESHOLD: tl.constexpr, EPS: tl.constexpr,
):
    """Per (chunk, value head): G = cumsum(g); A = (I + L)^-1; w = A (beta exp(G) K), u = A (beta V).

    k: [B, T, H, K], v: [B, T, HV, V], g, beta: [B, T, HV] (any strides, unit last-dim stride for k, v).
    G: [B, T, HV] fp32; A: [B, T, HV, BT] fp32; w: [B, T, HV, K]; u: [B, T, HV, V] (contiguous).
    grid = (chunks * HV,), head fastest (GVA heads sharing k run together: k hits L2). The chunk is walked as BT/16 row blocks of 16 tokens (0..3), each finished
    (G, its row of A's 16x16 blocks, its w and u rows) before the next starts, which keeps the
    register footprint to one block row: block row i needs only A's earlier block rows and k_j,
    beta exp(G) K_j, beta V_j of the earlier blocks j < i.
        A_ii = (I + L_ii)^-1                 (in registers: INV_ROWS row substitution, else doubling)
        A_ij = -A_ii sum_{j <= m < i} L_im A_mj                  (block forward substitution)
        w_i = sum_{j <= i} A_ij (beta exp(G) K)_j,   u_i = sum_{j <= i} A_ij (beta V)_j
    Switches: LOAD_G (G given, no cumsum), STORE_G, DO_A (else A is loaded), STORE_A, DO_WU.
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos = _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = bos + i_t * BT
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V

    k_base = k + i_b * s_kb + (i_h // GROUP) * s_kh
    v_base = v + i_b * s_vb + i_h * s_vh
    g_base = g + i_b * s_gb + i_h * s_gh
    b_base = beta + i_b * s_bb + i_h * s_bh
    if GATE:
        A_log_h = tl.load(A_log + i_h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias + i_h).to(tl.float32)
    else:
        A_log_h = 0.0
        dt_bias_h = 0.0
    acc = tl.sum(tl.zeros([16], dtype=tl.float32), 0)

    # ---- row block 0 ------------------------------------------------------------------------
    r0 = t0 + o_c
    m0 = r0 < eos
    tok0 = (i_b * T + r0).to(tl.int64) * HV + i_h               # [B, T, HV] flat index of (token, head)
    G0, acc = _g_block(g_base, s_gt, r0, m0, G, tok0, acc, A_log_h, dt_bias_h, GATE, LOAD_G, STORE_G, THRESHOLD)
    if DO_A or DO_WU:
        b0 = tl.load(b_base + r0.to(tl.int64) * s_bt, mask=m0, other=0.0).to(tl.float32)
        k0 = _load_k_block(k_base, r0, m0, s_kt, o_k, m_k, L2NORM, EPS)
    if DO_A:
        A00 = _inv_diag(_kk_block(k0, k0, b0, G0, G0, m0, PREC, DOT_F32, True), INV_ROWS, INV_PREC)
        if STORE_A:
            tl.store(A + _a_off(tok0, 0, BT), A00, mask=m0[:, None])
    elif DO_WU:
        A00 = tl.load(A + _a_off(tok0, 0, BT), mask=m0[:, None], other=0.0).to(tl.float32)
    if DO_WU:
        kb0 = _beta_k_block(k0, b0, G0)
        vb0 = _beta_v_block(v_base, r0, m0, s_vt, o_v, m_v, b0)
        kdt = kb0.dtype
        vdt = vb0.dtype
        _store_w_u(w, u, tok0, m0, _dot(A00.to(kdt), kb0, PREC, DOT_F32), _dot(A00.to(vdt), vb0, PREC, DOT_F32),
                   o_k, m_k, o_v, m_v, K, V)

    # ---- row block 1 ------------------------------------------------------------------------
    if BT >= 32:
        r1 = r0 + 16
        m1 = r1 < eos
        tok1 = tok0 + 16 * HV
        G1, acc = _g_block(g_base, s_gt, r1, m1, G, tok1, acc, A_log_h, dt_bias_h, GATE, LOAD_G, STORE_G,
                           THRESHOLD)
        if DO_A or DO_WU:
            b1 = tl.load(b_base + r1.to(tl.int64) * s_bt, mask=m1, other=0.0).to(tl.float32)
            k1 = _load_k_block(k_base, r1, m1, s_kt, o_k, m_k, L2NORM, EPS)
        if DO_A:
            A11 = _inv_diag(_kk_block(k1, k1, b1, G1, G1, m1, PREC, DOT_F32, True), INV_ROWS, INV_PREC)
            L10 = _kk_block(k1, k0, b1, G1, G0, m1, PREC, DOT_F32, False)
            A10 = -_mm32(A11, _mm32(L10, A00, INV_PREC), INV_PREC)
            if STORE_A:
                tl.store(A + _a_off(tok1, 0, BT), A10, mask=m1[:, None])
                tl.store(A + _a_off(tok1, 1, BT), A11, mask=m1[:, None])
        elif DO_WU:
            A10 = tl.load(A + _a_off(tok1, 0, BT), mask=m1[:, None], other=0.0).to(tl.float32)
            A11 = tl.load(A + _a_off(tok1, 1, BT), mask=m1[:, None], other=0.0).to(tl.float32)
        if DO_WU:
            kb1 = _beta_k_block(k1, b1, G1)
            vb1 = _beta_v_block(v_base, r1, m1, s_vt, o_v, m_v, b1)
            b_w = _dot(A10.to(kdt), kb0, PREC, DOT_F32) + _dot(A11.to(kdt), kb1, PREC, DOT_F32)
            b_u = _dot(A10.to(vdt), vb0, PREC, DOT_F32) + _dot(A11.to(vdt), vb1, PREC, DOT_F32)
            _store_w_u(w, u, tok1, m1, b_w, b_u, o_k, m_k, o_v, m_v, K, V)

    # ---- row block 2 ------------------------------------------------------------------------
    if BT >= 64:
        r2 = r0 + 32
        m2 = r2 < eos
        tok2 = tok0 + 32 * HV
        G2, acc = _g_block(g_base, s_gt, r2, m2, G, tok2, acc, A_log_h, dt_bias_h, GATE, LOAD_G, STORE_G,
                           THRESHOLD)
        if DO_A or DO_WU:
            b2 = tl.load(b_base + r2.to(tl.int64) * s_bt, mask=m2, other=0.0).to(tl.float32)
            k2 = _load_k_block(k_base, r2, m2, s_kt, o_k, m_k, L2NORM, EPS)
        if DO_A:
            A22 = _inv_diag(_kk_block(k2, k2, b2, G2, G2, m2, PREC, DOT_F32, True), INV_ROWS, INV_PREC)
            L20 = _kk_block(k2, k0, b2, G2, G0, m2, PREC, DOT_F32, False)
            L21 = _kk_block(k2, k1, b2, G2, G1, m2, PREC, DOT_F32, False)
            A21 = -_mm32(A22, _mm32(L21, A11, INV_PREC), INV_PREC)
            A20 = -_mm32(A22, _mm32(L20, A00, INV_PREC) + _mm32(L21, A10, INV_PREC), INV_PREC)
            if STORE_A:
                tl.store(A + _a_off(tok2, 0, BT), A20, mask=m2[:, None])
                tl.store(A + _a_off(tok2, 1, BT), A21, mask=m2[:, None])
                tl.store(A + _a_off(tok2, 2, BT), A22, mask=m2[:, None])
        elif DO_WU:
            A20 = tl.load(A + _a_off(tok2, 0, BT), mask=m2[:, None], other=0.0).to(tl.float32)
            A21 = tl.load(A + _a_off(tok2, 1, BT), mask=m2[:, None], other=0.0).to(tl.float32)
            A22 = tl.load(A + _a_off(tok2, 2, BT), mask=m2[:, None], other=0.0).to(tl.float32)
        if DO_WU:
            kb2 = _beta_k_block(k2, b2, G2)
            vb2 = _beta_v_block(v_base, r2, m2, s_vt, o_v, m_v, b2)
            b_w = (_dot(A20.to(kdt), kb0, PREC, DOT_F32) + _dot(A21.to(kdt), kb1, PREC, DOT_F32)
                   + _dot(A22.to(kdt), kb2, PREC, DOT_F32))
            b_u = (_dot(A20.to(vdt), vb0, PREC, DOT_F32) + _dot(A21.to(vdt), vb1, PREC, DOT_F32)
                   + _dot(A22.to(vdt), vb2, PREC, DOT_F32))
            _store_w_u(w, u, tok2, m2, b_w, b_u, o_k, m_k, o_v, m_v, K, V)

    # ---- row block 3 ------------------------------------------------------------------------
    if BT >= 64:
        r3 = r0 + 48
        m3 = r3 < eos
        tok3 = tok0 + 48 * HV
        G3, acc = _g_block(g_base, s_gt, r3, m3, G, tok3, acc, A_log_h, dt_bias_h, GATE, LOAD_G, STORE_G,
                           THRESHOLD)
        if DO_A or DO_WU:
            b3 = tl.load(b_base + r3.to(tl.int64) * s_bt, mask=m3, other=0.0).to(tl.float32)
            k3 = _load_k_block(k_base, r3, m3, s_kt, o_k, m_k, L2NORM, EPS)
        if DO_A:
            A33 = _inv_diag(_kk_block(k3, k3, b3, G3, G3, m3, PREC, DOT_F32, True), INV_ROWS, INV_PREC)
            L30 = _kk_block(k3, k0, b3, G3, G0, m3, PREC, DOT_F32, False)
            L31 = _kk_block(k3, k1, b3, G3, G1, m3, PREC, DOT_F32, False)
            L32 = _kk_block(k3, k2, b3, G3, G2, m3, PREC, DOT_F32, False)
            A32 = -_mm32(A33, _mm32(L32, A22, INV_PREC), INV_PREC)
            A31 = -_mm32(A33, _mm32(L31, A11, INV_PREC) + _mm32(L32, A21, INV_PREC), INV_PREC)
            A30 = -_mm32(A33, _mm32(L30, A00, INV_PREC) + _mm32(L31, A10, INV_PREC) + _mm32(L32, A20, INV_PREC),
                         INV_PREC)
            if STORE_A:
                tl.store(A + _a_off(tok3, 0, BT), A30, mask=m3[:, None])
                tl.store(A + _a_off(tok3, 1, BT), A31, mask=m3[:, None])
                tl.store(A + _a_off(tok3, 2, BT), A32, mask=m3[:, None])
                tl.store(A + _a_off(tok3, 3, BT), A33, mask=m3[:, None])
        elif DO_WU:
            A30 = tl.load(A + _a_off(tok3, 0, BT), mask=m3[:, None], other=0.0).to(tl.float32)
            A31 = tl.load(A + _a_off(tok3, 1, BT), mask=m3[:, None], other=0.0).to(tl.float32)
            A32 = tl.load(A + _a_off(tok3, 2, BT), mask=m3[:, None], other=0.0).to(tl.float32)
            A33 = tl.load(A + _a_off(tok3, 3, BT), mask=m3[:, None], other=0.0).to(tl.float32)
        if DO_WU:
            kb3 = _beta_k_block(k3, b3, G3)
            vb3 = _beta_v_block(v_base, r3, m3, s_vt, o_v, m_v, b3)
            b_w = (_dot(A30.to(kdt), kb0, PREC, DOT_F32) + _dot(A31.to(kdt), kb1, PREC, DOT_F32)
                   + _dot(A32.to(kdt), kb2, PREC, DOT_F32) + _dot(A33.to(kdt), kb3, PREC, DOT_F32))
            b_u = (_dot(A30.to(vdt), vb0, PREC, DOT_F32) + _dot(A31.to(vdt), vb1, PREC, DOT_F32)
                   + _dot(A32.to(vdt), vb2, PREC, DOT_F32) + _dot(A33.to(vdt), vb3, PREC, DOT_F32))
            _store_w_u(w, u, tok3, m3, b_w, b_u, o_k, m_k, o_v, m_v, K, V)


# ============================================================================================
# kernel 2: state passing (sequential over chunks, state in registers)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def chunk_state_kernel(
    k, w, u, G, h0, h, v_new, ht, q, o,
    cu_seqlens, chunk_offsets, T, NT, scale,
    s_kb, s_kt, s_kh, s_qb, s_qt, s_qh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    FUSE_O: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, EPS: tl.constexpr,
):
    """Per (V-block, sequence, value head), for each chunk c of the sequence in order:

        h[c] = S ;   v_new = u - w S ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)

    k, q: [B, T, H, K] (strided); w: [B, T, HV, K], u, v_new, o: [B, T, HV, V], G: [B, T, HV] (contiguous);
    h0, ht: [N, HV, K, V] fp32 (contiguous); h: [chunks, HV, K, V] (global chunk order).
    grid = (cdiv(V, BV), N * HV), V-block fastest (the V-blocks of one head share w and k via L2).
    S: fp32 [BK, BV] kept in registers across all chunks; K is one block (<= 256). Only loads that do
    not depend on S are issued per chunk, so the compiler's software pipeline (num_stages) prefetches
    the next chunk's w, u, k, G while this one computes.
    FUSE_O: also compute the chunk's output here (kernel 3's formula with S in registers) instead of
    storing h and v_new: no h / v_new round trip through HBM, more work on the sequential path.
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        boc = tl.load(chunk_offsets + i_n).to(tl.int64)
        i_b = (i_n * 0).to(tl.int64)
    else:
        bos = 0
        eos = T
        boc = i_n.to(tl.int64) * NT
        i_b = i_n.to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_off = o_k[:, None] * V + o_v[None, :]                       # [BK, BV] offsets in a [K, V] state

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)

    k_base = k + i_b * s_kb + (i_h // GROUP) * s_kh
    q_base = q + i_b * s_qb + (i_h // GROUP) * s_qh
    for i_t in range(0, n_chunks):
        rows = bos + i_t * BT + o_t
        m_r = rows < eos
        m_rv = m_r[:, None] & m_v[None, :]
        tok = (i_b * T + rows).to(tl.int64) * HV + i_h             # [BT] flat (token, head) index
        b_w = tl.load(w + tok[:, None] * K + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_hc = b_h.to(b_w.dtype)                                    # chunk-start state as a dot operand
        if not FUSE_O:
            tl.store(h + ((boc + i_t) * HV + i_h) * K * V + kv_off, b_hc.to(h.dtype.element_ty), mask=m_kv)

        b_v = tl.load(u + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        b_v = b_v.to(tl.float32) - _dot(b_w, b_hc, PREC, DOT_F32)                    # v_new = u - w S
        if not FUSE_O:
            tl.store(v_new + tok[:, None] * V + o_v[None, :], b_v.to(v_new.dtype.element_ty), mask=m_rv)

        last = tl.minimum(eos - bos - i_t * BT, BT) - 1             # last valid row of the chunk
        b_G = tl.load(G + tok, mask=m_r, other=0.0)
        G_last = tl.load(G + (i_b * T + bos + i_t * BT + last).to(tl.int64) * HV + i_h)
        b_k = tl.load(k_base + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                      other=0.0)
        if L2NORM:
            b_k = _l2norm_rows(b_k, EPS)

        if FUSE_O:
            # O = scale [exp(G) * (Q S) + ((Q K^T) * exp(G_i - G_j) * [i >= j]) v_new]   (kernel 3's formula)
            b_q = tl.load(q_base + rows.to(tl.int64)[:, None] * s_qt + o_k[None, :],
                          mask=m_r[:, None] & m_k[None, :], other=0.0)
            if L2NORM:
                b_q = _l2norm_rows(b_q, EPS)
            b_o = _dot(b_q, b_hc, PREC, DOT_F32) * tl.exp(b_G)[:, None]
            keep = (o_t[:, None] >= o_t[None, :]) & m_r[:, None]
            # precision hazard: mask before exp (above the diagonal G_i - G_j >= 0 may overflow)
            b_A = _dot(b_q, tl.trans(b_k), PREC, DOT_F32) * tl.exp(tl.where(keep, b_G[:, None] - b_G[None, :], 0.0))
            b_A = tl.where(keep, b_A, 0.0)
            b_o += _dot(b_A.to(b_w.dtype), b_v.to(b_w.dtype), PREC, DOT_F32)
            tl.store(o + tok[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty), mask=m_rv)

        # precision hazard: mask before exp (padded rows' G is 0 and G_last - 0 may be > 0);
        # on valid rows G_last - G <= 0 since G is non-increasing within a chunk.
        b_v = b_v * tl.where(m_r, tl.exp(tl.where(m_r, G_last - b_G, 0.0)), 0.0)[:, None]
        b_h = b_h * tl.exp(G_last)
        b_h += _dot(tl.trans(b_k), b_v.to(b_k.dtype), PREC, DOT_F32)                 # + K^T (decayed v_new)

    if STORE_HT:
        tl.store(ht + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, b_h, mask=m_kv)


# ============================================================================================
# kernel 3: output (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def chunk_output_kernel(
    q, k, v_new, h, G, o,
    cu_seqlens, chunk_indices, T, NT, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
    EPS: tl.constexpr,
):
    """Per (chunk, value head, V-block):

        O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * [i >= j]) v_new ]

    q, k: [B, T, H, K] (strided); v_new, o: [B, T, HV, V], G: [B, T, HV], h: [chunks, HV, K, V]
    (contiguous). grid = (chunks * HV * cdiv(V, BV),), V-block fastest, then head (q, k shared by
    GVA heads and V-blocks hit L2). exp(G) is applied to Q h's rows after the dot
    (same product, no extra rounding of Q * exp(G) to 16 bits).
    """
    pid = tl.program_id(0)
    i_v = pid % ((V + BV - 1) // BV)                                # V-blocks per head (constexpr)
    i_h = (pid // ((V + BV - 1) // BV)) % HV
    i_c = pid // (((V + BV - 1) // BV) * HV)
    i_b, i_t, bos, eos = _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    rows = bos + i_t * BT + o_t
    m_r = rows < eos
    tok = (i_b * T + rows).to(tl.int64) * HV + i_h
    i_hk = i_h // GROUP

    b_q = tl.load(q + i_b * s_qb + i_hk * s_qh + rows.to(tl.int64)[:, None] * s_qt + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)
    b_k = tl.load(k + i_b * s_kb + i_hk * s_kh + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)
    if L2NORM:
        b_q = _l2norm_rows(b_q, EPS)
        b_k = _l2norm_rows(b_k, EPS)
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vn = tl.load(v_new + tok[:, None] * V + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)

    b_o = _dot(b_q, b_h, PREC, DOT_F32) * tl.exp(b_G)[:, None]         # inter-chunk: exp(G) <= 1
    keep = (o_t[:, None] >= o_t[None, :]) & m_r[:, None]
    # precision hazard: mask before exp (above the diagonal G_i - G_j >= 0 may overflow)
    b_A = _dot(b_q, tl.trans(b_k), PREC, DOT_F32) * tl.exp(tl.where(keep, b_G[:, None] - b_G[None, :], 0.0))
    b_A = tl.where(keep, b_A, 0.0)
    b_o += _dot(b_A.to(b_vn.dtype), b_vn, PREC, DOT_F32)                 # intra-chunk
    tl.store(o + tok[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=m_r[:, None] & m_v[None, :])


# ============================================================================================
# recurrent kernel: the time loop, state in registers
# ============================================================================================

@triton.jit(do_not_specialize=["T"])
def recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, o, ht,
    cu_seqlens, T, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, THRESHOLD: tl.constexpr, EPS: tl.constexpr,
):
    """Per (V-block, sequence, value head), for each token t in order (all in fp32):

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    q, k: [B, T, H, K], v: [B, T, HV, V], g, beta: [B, T, HV] (strided, unit last-dim stride for q, k, v);
    h0, ht: [N, HV, K, V] fp32; o: [B, T, HV, V] contiguous. grid = (cdiv(V, BV), N * HV).
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        i_b = (i_n * 0).to(tl.int64)
    else:
        bos = 0
        eos = T
        i_b = i_n.to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_off = o_k[:, None] * V + o_v[None, :]
    i_hk = i_h // GROUP

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)
    if GATE:
        A_log_h = tl.load(A_log + i_h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias + i_h).to(tl.float32)

    q_base = q + i_b * s_qb + i_hk * s_qh
    k_base = k + i_b * s_kb + i_hk * s_kh
    v_base = v + i_b * s_vb + i_h * s_vh
    g_base = g + i_b * s_gb + i_h * s_gh
    b_base = beta + i_b * s_bb + i_h * s_bh
    for t in range(bos, eos):
        t64 = (i_b * 0 + t).to(tl.int64)
        b_q = tl.load(q_base + t64 * s_qt + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_base + t64 * s_kt + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_base + t64 * s_vt + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g_base + t64 * s_gt).to(tl.float32)
        b_beta = tl.load(b_base + t64 * s_bt).to(tl.float32)
        if GATE:
            b_g = _gate(b_g, A_log_h, dt_bias_h, THRESHOLD)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + EPS)
        b_h *= tl.exp(b_g)
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))           # beta (v - S^T k)
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + ((i_b * T + t64) * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_HT:
        tl.store(ht + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, b_h, mask=m_kv)


# ============================================================================================
# host side: pinned configs, launchers, the public ops and the stage twins
# ============================================================================================

def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM / H200


def _blocks(K: int, V: int) -> Tuple[int, int]:
    """Padded head dims: one power-of-two block each (>= 16, the smallest tl.dot size)."""
    return max(16, next_pow2(K)), max(16, next_pow2(V))


def wy_config(K: int, V: int) -> dict:
    """Kernel 1 (chunk_wy_kernel): one program per (chunk, value head), no loop to pipeline.
    4 warps hold the 16-row blocks of k, v and the 16x16 blocks of L and A; 8 when a head dim is
    256 (register pressure)."""
    BK, BV = _blocks(K, V)
    if is_interpreting():
        return dict(num_warps=4, num_stages=1)
    return dict(num_warps=4 if max(BK, BV) <= 128 else 8, num_stages=1)


def state_config(N: int, HV: int, K: int, V: int, device: torch.device, fused: bool = False) -> dict:
    """Kernel 2 (chunk_state_kernel): the sequential pass. Only N * HV * cdiv(V, BV) programs exist,
    each walking all chunks of its sequence, so BV trades parallelism (small BV: more programs fill the
    SMs) against redundant w/k reads (every V-block program reloads the chunk's w and k; they mostly hit
    L2). Qwen3-Next at B=1 (HV=32, V=128): BV=32 -> 128 programs for 132 SMs. num_stages=2 prefetches
    the next chunk's w, u, k, G behind the current chunk's dots. Pinned, never autotuned
    (DESIGN.md invariant 2). Interpreter: one V-block (fewest programs)."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():
        return dict(BV=min(BVmax, 64), num_warps=4, num_stages=1)
    sms = _num_sms(device)
    if N * HV * cdiv(V, 64) >= 2 * sms:
        BV = 64
    elif N * HV * cdiv(V, 32) >= (sms * 3) // 4:
        BV = 32
    else:
        BV = 16
    BV = min(BV, BVmax)
    if fused:   # + Q [BT, K], Q K^T [BT, BT] and the output tile: 8 warps keep it (nearly) spill-free at K=128
        return dict(BV=BV, num_warps=8 if BK >= 128 else 4, num_stages=2)
    return dict(BV=BV, num_warps=4 if BK * BV <= 128 * 64 else 8, num_stages=2)


def output_config(K: int, V: int) -> dict:
    """Kernel 3 (chunk_output_kernel): chunk-parallel, (chunks x HV x V-blocks) programs, plenty at any
    T >= a few chunks. BV = V (up to 128) so Q K^T is computed once per (chunk, head); 8 warps for the
    [BT, 128] fp32 accumulator next to the [BT, BT] attention block."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():
        return dict(BV=min(BVmax, 64), num_warps=4, num_stages=1)
    BV = min(BVmax, 128 if BK <= 128 else 64)
    return dict(BV=BV, num_warps=8 if BK * BV >= 128 * 128 else 4, num_stages=1)


def recurrent_config(K: int, V: int) -> dict:
    """Recurrent kernel: state [BK, BV] fp32 in one warp's registers (<= 64 per thread), reductions over
    K stay inside the warp. Interpreter: one V-block."""
    BK = next_pow2(K)
    if is_interpreting():
        return dict(BV=min(next_pow2(V), 64), num_warps=4, num_stages=1)
    BV = min(next_pow2(V), max(8, 2048 // BK))
    return dict(BV=BV, num_warps=1, num_stages=1)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """Kernels address the last dim with unit stride; other dims may have any stride (slices are views)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _fp32_prec(dtype: torch.dtype):
    """input_precision of the dots whose operands are in `dtype`: None (default) for 16-bit operands,
    FP32_PRECISION for fp32 inputs (plain TF32 would fail fp32 conformance)."""
    return FP32_PRECISION if dtype == torch.float32 else None


def _inv_rows() -> bool:
    """Diagonal-block inverse method: INV_METHOD, or by default row substitution on the GPU (few
    registers, fla's choice) and doubling in the interpreter (4x fewer interpreted ops)."""
    method = INV_METHOD or ("doubling" if is_interpreting() else "rows")
    return method == "rows"


def _contig(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x.contiguous() if x is not None else None


def _is_fp64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def _check_fast_limits(K: int, V: int, chunk_size: Optional[int] = None) -> None:
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 16, 32 or 64 for fast's kernels, got {chunk_size!r}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM} for fast's kernels, got K={K}, V={V}")


class _Chunks:
    """Chunk bookkeeping: dense (NT per batch row) or varlen (host-built tables; eager prefill only)."""

    def __init__(self, B: int, T: int, BT: int, cu_seqlens: Optional[torch.Tensor]):
        self.varlen = cu_seqlens is not None
        self.cu_seqlens = cu_seqlens
        if self.varlen:
            self.indices = prepare_chunk_indices(cu_seqlens, BT)     # [NT_total, 2] (sequence, chunk)
            self.offsets = prepare_chunk_offsets(cu_seqlens, BT)     # [N+1] first global chunk of each
            self.NT = 1                                               # unused
            self.total = self.indices.shape[0]
        else:
            self.indices = self.offsets = None
            self.NT = cdiv(T, BT)
            self.total = B * self.NT


def _launch_wy(k, v, g, beta, A_log, dt_bias, G, A, w, u, ch: _Chunks, T: int, HV: int, BT: int,
               *, l2norm: bool, load_g: bool, store_g: bool, do_a: bool, store_a: bool, do_wu: bool):
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    BK, BV = _blocks(K, V)
    if ch.total == 0 or HV == 0:
        return
    chunk_wy_kernel[(ch.total * HV,)](
        k, v, g, beta, A_log, dt_bias, G, A, w, u,
        ch.cu_seqlens, ch.indices, T, ch.NT,
        *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, GATE=A_log is not None, L2NORM=l2norm,
        LOAD_G=load_g, STORE_G=store_g, DO_A=do_a, STORE_A=store_a, DO_WU=do_wu,
        PREC=_fp32_prec(k.dtype), INV_PREC=INV_PRECISION[k.dtype], INV_ROWS=_inv_rows(), DOT_F32=is_interpreting(),
        THRESHOLD=SOFTPLUS_THRESHOLD, EPS=L2NORM_EPS, **dict(wy_config(K, V), **CONFIG_OVERRIDES.get("wy", {})))


def _launch_state(k, w, u, G, h0, h, v_new, ht, ch: _Chunks, N: int, T: int, BT: int, *, l2norm: bool,
                  q=None, o=None, scale: float = 1.0):
    """Kernel 2; with q and o given it also writes the output (FUSE_O) and h / v_new may be None."""
    H, K = k.shape[2], k.shape[3]
    HV, V = u.shape[2], u.shape[3]
    if N * HV == 0:
        return
    BK, _ = _blocks(K, V)
    fuse = o is not None
    cfg = dict(state_config(N, HV, K, V, k.device, fuse),
               **CONFIG_OVERRIDES.get("state_fused" if fuse else "state", {}))
    BV = cfg.pop("BV")
    qq = q if fuse else k
    chunk_state_kernel[(cdiv(V, BV), N * HV)](
        k, w, u, G, h0, h, v_new, ht, qq, o,
        ch.cu_seqlens, ch.offsets, T, ch.NT, float(scale), *k.stride()[:3], *qq.stride()[:3],
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, L2NORM=l2norm, USE_H0=h0 is not None, STORE_HT=ht is not None, FUSE_O=fuse,
        PREC=_fp32_prec(w.dtype), DOT_F32=is_interpreting(), EPS=L2NORM_EPS, **cfg)


def _launch_output(q, k, v_new, h, G, o, ch: _Chunks, T: int, BT: int, scale: float, *, l2norm: bool):
    H, K = q.shape[2], q.shape[3]
    HV, V = v_new.shape[2], v_new.shape[3]
    if ch.total == 0 or HV == 0:
        return
    BK, _ = _blocks(K, V)
    cfg = dict(output_config(K, V), **CONFIG_OVERRIDES.get("output", {}))
    BV = cfg.pop("BV")
    chunk_output_kernel[(ch.total * HV * cdiv(V, BV),)](
        q, k, v_new, h, G, o,
        ch.cu_seqlens, ch.indices, T, ch.NT, float(scale),
        *q.stride()[:3], *k.stride()[:3],
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, L2NORM=l2norm, PREC=_fp32_prec(q.dtype), DOT_F32=is_interpreting(),
        EPS=L2NORM_EPS, **cfg)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                           chunk_size=64):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or None).

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    refgdn.chunk_gated_delta_rule's twin (and fla's chunk_gated_delta_rule's signature), in three
    Triton kernels (module docstring). HV % H == 0 (value head h reads q/k head h // (HV // H)).
    Varlen: B == 1 and cu_seqlens [N+1] (int; empty and length-1 sequences are fine). With A_log and
    dt_bias [HV] given, `g` is the raw gate input a and g = -exp(A_log) softplus(a + dt_bias) is
    computed in fp32 inside the cumsum. use_qk_l2norm_in_kernel normalises q, k rows in the kernels.
    chunk_size: 16, 32 or 64. Inputs may be strided views (unit stride along the head dim is
    preferred; other layouts are copied). q, k, v in fp16/bf16/fp32; float64 inputs run refgdn.
    Reads cu_seqlens on the host (eager prefill, not for CUDA-graph capture).
    """
    N = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, chunk_size)
    if _is_fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return refgdn.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size)
    _check_fast_limits(q.shape[3], v.shape[3], chunk_size)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    A_log, dt_bias, cu_seqlens = _contig(A_log), _contig(dt_bias), _contig(cu_seqlens)
    dev = q.device
    ch = _Chunks(B, T, BT, cu_seqlens)

    G = torch.empty(B, T, HV, dtype=torch.float32, device=dev)           # chunk-local cumsum of g
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=dev)
    u = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
    _launch_wy(k, v, g, beta, A_log, dt_bias, G, None, w, u, ch, T, HV, BT, l2norm=use_qk_l2norm_in_kernel,
               load_g=False, store_g=True, do_a=True, store_a=False, do_wu=True)

    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
    if FUSE_OUTPUT:   # kernels 2+3 in one sequential pass
        _launch_state(k, w, u, G, h0, None, None, final, ch, N, T, BT, l2norm=use_qk_l2norm_in_kernel,
                      q=q, o=o, scale=scale)
        return o, final
    h = torch.empty(ch.total, HV, K, V, dtype=k.dtype, device=dev)       # chunk-start states
    v_new = torch.empty_like(u)
    _launch_state(k, w, u, G, h0, h, v_new, final, ch, N, T, BT, l2norm=use_qk_l2norm_in_kernel)
    _launch_output(q, k, v_new, h, G, o, ch, T, BT, scale, l2norm=use_qk_l2norm_in_kernel)
    return o, final


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or None).

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    refgdn.recurrent_gated_delta_rule's twin: one Triton program per (V-block, sequence, value head)
    walks the tokens with the state in registers, all math in fp32. Same arguments as
    chunk_gated_delta_rule (no chunk_size). float64 inputs run refgdn.
    """
    N = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias)
    if _is_fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return refgdn.recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias)
    _check_fast_limits(q.shape[3], v.shape[3])
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    A_log, dt_bias, cu_seqlens = _contig(A_log), _contig(dt_bias), _contig(cu_seqlens)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    if N * HV == 0:
        return o, final
    cfg = dict(recurrent_config(K, V), **CONFIG_OVERRIDES.get("recurrent", {}))
    BV = cfg.pop("BV")
    recurrent_kernel[(cdiv(V, BV), N * HV)](
        q, k, v, g, beta, A_log, dt_bias, h0, o, final,
        cu_seqlens, T, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        HV=HV, GROUP=HV // H, K=K, V=V, BK=next_pow2(K), BV=BV,
        IS_VARLEN=cu_seqlens is not None, GATE=A_log is not None, L2NORM=use_qk_l2norm_in_kernel,
        USE_H0=h0 is not None, STORE_HT=final is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD, EPS=L2NORM_EPS, **cfg)
    return o, final


# --------------------------------------------------------------------------------------------
# stage twins of refgdn.delta_rule (same names and leading arguments; each runs one kernel).
# Dense inputs [B, T, ...] with any T (refgdn's need T % chunk_size == 0); cu_seqlens optional.
# --------------------------------------------------------------------------------------------

def _dummy(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(1, 1, 1, 1)


def chunk_cumsum(g: torch.Tensor, chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None,
                 A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 1. g: [B, T, HV] -> G: [B, T, HV] float32, the cumulative decay restarting at every chunk.

        G_c = sum_{s <= c, s in the chunk of c} g_s        (g = -exp(A_log) softplus(a + dt_bias) if given)

    Kernel 1 with only its cumsum switched on.
    """
    check_chunk_size(chunk_size)
    if _is_fp64(g, A_log, dt_bias):
        if A_log is not None:
            g = refgdn.gdn_gating(A_log, g, dt_bias, g)[0]
        return refgdn.delta_rule.chunk_cumsum(g, chunk_size)
    _check_fast_limits(16, 16, chunk_size)
    B, T, HV = g.shape
    A_log, dt_bias = _contig(A_log), _contig(dt_bias)
    G = torch.empty(B, T, HV, dtype=torch.float32, device=g.device)
    d = _dummy(g)
    _launch_wy(d, d, g, g, A_log, dt_bias, G, None, None, None, _Chunks(B, T, chunk_size, cu_seqlens), T, HV,
               chunk_size, l2norm=False, load_g=False, store_g=True, do_a=False, store_a=False, do_wu=False)
    return G


def wy_repr(k: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, chunk_size: int,
            cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 2. k: [B, T, H, K], beta, G: [B, T, HV] -> A: [B, T, HV, BT] float32, A = (I + L)^-1 per chunk
    with L_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j. Kernel 1 with G given, A stored, no w/u."""
    check_chunk_size(chunk_size)
    if _is_fp64(k, beta, G):
        return refgdn.delta_rule.wy_repr(k, beta, G, chunk_size)
    _check_fast_limits(k.shape[3], 16, chunk_size)
    B, T, H, K = k.shape
    HV = G.shape[2]
    k = _unit_last(k)
    A = torch.zeros(B, T, HV, chunk_size, dtype=torch.float32, device=k.device)
    d = _dummy(k)
    _launch_wy(k, d, G, beta, None, None, G.float().contiguous(), A, None, None,
               _Chunks(B, T, chunk_size, cu_seqlens), T, HV, chunk_size, l2norm=False,
               load_g=True, store_g=False, do_a=True, store_a=True, do_wu=False)
    return A


def w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, G: torch.Tensor,
        chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 3. k: [B, T, H, K], v: [B, T, HV, V], beta, G: [B, T, HV], A: [B, T, HV, BT]
    -> w: [B, T, HV, K] (k.dtype), u: [B, T, HV, V] (v.dtype);  w = A (beta exp(G) K), u = A (beta V).
    Kernel 1 with G and A loaded."""
    check_chunk_size(chunk_size)
    if _is_fp64(k, v, beta, A, G):
        return refgdn.delta_rule.w_u(k, v, beta, A, G, chunk_size)
    _check_fast_limits(k.shape[3], v.shape[3], chunk_size)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    k, v = _unit_last(k), _unit_last(v)
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    u = torch.empty(B, T, HV, V, dtype=v.dtype, device=k.device)
    _launch_wy(k, v, G, beta, None, None, G.float().contiguous(), A.float().contiguous(), w, u,
               _Chunks(B, T, chunk_size, cu_seqlens), T, HV, chunk_size, l2norm=False,
               load_g=True, store_g=False, do_a=False, store_a=False, do_wu=True)
    return w, u


def state_passing(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, G: torch.Tensor, chunk_size: int,
                  initial_state: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """Step 4. k: [B, T, H, K], w: [B, T, HV, K], u: [B, T, HV, V], G: [B, T, HV], initial_state: [N, HV, K, V]
    -> h: [B, NC, HV, K, V] (w.dtype; varlen: [1, total chunks, ...]), v_new: [B, T, HV, V] (u.dtype),
    final_state: [N, HV, K, V] float32.

        v_new = u - w S ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)      (kernel 2)
    """
    check_chunk_size(chunk_size)
    if _is_fp64(k, w, u, G, initial_state):
        return refgdn.delta_rule.state_passing(k, w, u, G, chunk_size, initial_state)
    _check_fast_limits(k.shape[3], u.shape[3], chunk_size)
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    ch = _Chunks(B, T, chunk_size, cu_seqlens)
    h = torch.empty(ch.total, HV, K, V, dtype=w.dtype, device=k.device)
    v_new = torch.empty(B, T, HV, V, dtype=u.dtype, device=k.device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    _launch_state(_unit_last(k), w.contiguous(), u.contiguous(), G.float().contiguous(), h0, h, v_new, final,
                  ch, N, T, chunk_size, l2norm=False)
    NC = ch.NT if cu_seqlens is None else ch.total
    return h.view(B if cu_seqlens is None else 1, NC, HV, K, V), v_new, final


def chunk_output(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, G: torch.Tensor,
                 scale: float, chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 5. q, k: [B, T, H, K], v_new: [B, T, HV, V], h: [B, NC, HV, K, V], G: [B, T, HV] -> o: [B, T, HV, V]
    (v_new.dtype).

        O = scale * [ (Q * exp(G)) S_chunk_start + ((Q K^T) * exp(G_i - G_j) * tril) v_new ]   (kernel 3)
    """
    check_chunk_size(chunk_size)
    if _is_fp64(q, k, v_new, h, G):
        return refgdn.delta_rule.chunk_output(q, k, v_new, h, G, scale, chunk_size)
    _check_fast_limits(q.shape[3], v_new.shape[3], chunk_size)
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.empty(B, T, HV, V, dtype=v_new.dtype, device=q.device)
    hh = h.reshape(-1, HV, K, V).contiguous()                       # [B, NC, HV, K, V] -> [(B NC), HV, K, V]
    _launch_output(_unit_last(q), _unit_last(k), v_new.contiguous(), hh, G.float().contiguous(), o,
                   _Chunks(B, T, chunk_size, cu_seqlens), T, chunk_size, float(scale), l2norm=False)
    return o
