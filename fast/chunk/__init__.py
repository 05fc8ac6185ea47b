"""Triton prefill for the gated delta rule: the chunked WY/UT form in four kernels, plus a recurrent kernel.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   state: [N, HV, K, V] float32
    S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

Value head h reads q/k head h // (HV // H) (GVA: q/k are never repeated). Varlen: B == 1 and
cu_seqlens [N+1]; chunks never straddle sequences. Semantics, validation and dtypes are refgdn's
(refgdn.delta_rule): o in v's dtype, final state float32.

The pipeline (BT = chunk size in {16, 32, 64}; "chunk" = BT tokens of one sequence):

  1. ``chunk_kkt_inv_kernel``  grid (chunks * HV)          fully chunk-parallel, 1 warp
       g (or fused gating of raw a) -> G = chunk-local cumsum            (fp32, stored; fp32 inputs:
           in fp64, with its rounding error Gl stored too, see below)
       k -> l2norm(k) when asked (stored once per key head: kn [B, T, H, K], read by kernels 2-4)
       L_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j                    (16x16 blocks, tl.dot)
       A = (I + L)^-1: the 16x16 diagonal blocks by forward substitution or doubling (inv_method), the
           off-diagonal blocks by block forward substitution (16^3 fp32 dots, INV_PRECISION);
           A stored in k's dtype (fp32 for fp32 inputs)
  2. ``chunk_w_u_kernel``      grid (chunks * HV)          fully chunk-parallel
       w = A (beta exp(G) K),  u = A (beta V)                             (two [BT, BT] x [BT, *] dots)
  3. ``chunk_state_kernel``    grid (cdiv(V, BV), N * HV)  sequential over the chunks of a sequence
       h[c] = S (stored in k's dtype);  v_new = u - w S (stored);
       S <- exp(G_last) S + K^T (exp(G_last - G) v_new)                   (S: fp32 [K, BV] in registers)
  4. ``chunk_output_kernel``   grid (chunks * HV * cdiv(V, BV)) fully chunk-parallel
       O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * causal) v_new ]

Kernels 1 and 2 are split (rather than one kernel holding k, L, A, w and u at once) so that each
stays small: kernel 1 works on 16x16 blocks in a single warp (its reductions and layout changes
never leave the warp); kernel 2 is two plain dots. The l2norm of k happens once, in kernel 1, so
the sequential kernel 3 only loads and multiplies.

fp32 inputs (PRECISE): exps are range-reduced (``_exp``), and every decay exp(G_i - G_j) is taken
of (G_i - G_j) + (Gl_i - Gl_j): under strong gating |G| reaches ~1e3, where one fp32 ulp of G (6e-5)
would dominate the decays' error (the refgdn oracle itself rounds G to fp32); with Gl the
difference is as accurate as a difference of small numbers.

HBM traffic per token and value head: read q, k (shared by the GVA group, mostly L2), v, g, beta;
write/read A, w, u, v_new and G once each; h once per chunk.

Tuning knobs are keyword arguments of the internal launchers and ``chunk_gated_delta_rule_fwd`` (never
module state; benchmarks pass them; each value is its own compiled variant): ``configs`` (per-kernel
BV / num_warps / num_stages over the pinned heuristics) and ``inv_method`` ("rows" / "doubling" for the
16x16 diagonal inverses). Read-only constants: ``INV_PRECISION``, ``INV_DIAG_PRECISION`` and
``FP32_PRECISION`` (tl.dot input precisions, see below).

``recurrent_kernel`` (grid (cdiv(V, BV), N * HV)) is the time loop with the state in registers:
the twin of refgdn.recurrent_gated_delta_rule, handy for short T.

Backward (training): fast.chunk_bwd's kernels, reached through autograd of the custom op
torch.ops.fast.chunk_gated_delta_rule (fast.library); it recomputes kernels 1-3's outputs with the
launchers below (``prec_of`` runs them on fp32 copies at a chosen dot precision).

Each refgdn stage (chunk_cumsum, wy_repr, w_u, state_passing, chunk_output) has a twin here of
the same name and signature built from the same kernels (kernel 1 runs with constexpr switches),
so each kernel is tested alone against refgdn.delta_rule's stage.

Configs are pinned by small heuristics (``*_config`` below), never autotuned at run time: the
prefill path must launch exactly the variants warmup compiled (DESIGN.md invariants 1 and 2) and
autotune would re-run kernels. Dots keep 16-bit operands on the GPU (fp32 accumulate); fp32 inputs
use IEEE fp32 dots (TF32 would exceed the conformance bound) and a range-reduced exp (``_exp``).
In the Triton interpreter dot operands are cast to fp32 (bf16 dots are wrong there) and every
kernel uses one config. float64 inputs run refgdn itself (the oracle is the float64 path; there
are no float64 kernels).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

import refgdn
from refgdn.checks import check_chunk_size, check_gdn_inputs

from ..utils import cdiv, is_interpreting, next_pow2, prepare_chunk_indices, prepare_chunk_offsets

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
MAX_HEAD_DIM = 256
CHUNK_SIZES = (16, 32, 64)
# tl.dot input precisions (constexprs, so each value is its own compiled variant):
#   FP32_PRECISION: dots on fp32 inputs. "ieee" is exact fp32 FMA (slow, spills on sm90: fp32 inputs are
#     not the fast path); "tf32x3" would use tensor cores at ~fp32 accuracy.
#   INV_PRECISION: the 16x16 fp32 products of the triangular inverse's off-diagonal blocks, per input
#     dtype. A is stored in the input dtype before w = A (beta exp(G) K), so TF32 products (relative
#     rounding 2^-11) are far below bf16's (2^-9); fp16 rounds like TF32, so it gets tf32x3 (~fp32);
#     fp32 gets exact IEEE.
FP32_PRECISION = "ieee"
INV_PRECISION = MappingProxyType({torch.bfloat16: "tf32", torch.float16: "tf32x3", torch.float32: "ieee"})
#   INV_DIAG_PRECISION: the products of the diagonal blocks' doubling (inv_method "doubling"): their
#     4 levels compound the products' rounding, so bf16 gets tf32x3 there too (with tf32 the worst bf16
#     final-state conformance ratio of the quick matrix rose from 0.69 with rows to 0.89; tf32x3 is the
#     fp16 setting, conformance-checked on H200; its bf16 timing is not measured yet).
INV_DIAG_PRECISION = MappingProxyType({torch.bfloat16: "tf32x3", torch.float16: "tf32x3", torch.float32: "ieee"})
# The 16x16 diagonal blocks of (I + L)^-1: "rows" (forward substitution, 15 dependent steps of masked
# reductions, exact fp32) or "doubling" (4 levels of two 16x16 dots at INV_DIAG_PRECISION), chosen by the launchers' inv_method argument. None: rows
# on a GPU, doubling in the interpreter (4x cheaper there). Rows is the GPU default because it is the
# variant whose bf16 conformance and tests passed on the H200; doubling measured faster (H200, K = 128,
# BT = 64, bf16, 1 warp, tf32 products: 0.58 ms against rows' 0.75) but its tf32x3 setting for bf16 has
# not run on a GPU yet. Both are direct (no series, no approximation); the tests run both.
# Per-kernel config overrides (the launchers' ``configs`` argument, for benchmark sweeps) are merged over
# the pinned heuristics: {"kkt": {...}, "w_u": {...}, "state": {...}, "output": {...}} with keys
# BV, num_warps, num_stages (BV for "state", "output"). Each distinct config is its own compiled variant.


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
def _exp(x, PRECISE: tl.constexpr):
    """exp(x) in fp32. PRECISE (fp32 inputs): range-reduced, a few ulp at any |x|; else tl.exp.

    precision hazard: tl.exp lowers to ex2.approx(x * log2 e) with the product rounded first, which
    costs a relative error ~|x| 2^-24 in the result (~1e-6 at |x| = 20): visible against an fp32
    oracle under strong gating. PRECISE splits x = n ln2 + r exactly (Cody-Waite: ln2 = C1 + C2 with
    C1 short enough that n C1 is exact; n = floor(x / ln2) keeps 2^n finite wherever exp(x) is),
    takes exp2 of the small r log2 e only and builds 2^n from its bits. x < -87 (near the smallest
    normal) returns 0; x > 88.72 overflows to inf as it should.
    """
    if PRECISE:
        xc = tl.where(x < -87.0, -87.0, tl.where(x > 89.0, 89.0, x))
        xc = tl.where(x == x, xc, 0.0)                                     # NaN: returned as is below
        n = tl.floor(xc * 1.4426950408889634)                              # -126 <= n <= 128
        r = (xc - n * 0.693359375) - n * -2.1219444005469057e-4          # x - n ln2, in ~[0, ln2)
        two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)   # 2^n exactly (n >= -126)
        y = tl.exp2(r * 1.4426950408889634) * two_n
        return tl.where(x < -87.0, 0.0, tl.where(x == x, y, x))
    else:
        return tl.exp(x)


@triton.jit
def _gate(a, A_log_h, dt_bias_h, THRESHOLD: tl.constexpr, PRECISE: tl.constexpr):
    """Fused gating in fp32: g = -exp(A_log) * softplus(a + dt_bias), softplus(x) = x for x > 20.

    Below the threshold softplus is evaluated as max(x, 0) + log(1 + exp(-|x|)) (the same function;
    exp never overflows and the log's argument stays in [1, 2])."""
    x = a + dt_bias_h
    sp = tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + tl.log(1.0 + _exp(-tl.abs(x), PRECISE)))
    return -_exp(A_log_h, PRECISE) * sp


@triton.jit
def _l2norm_rows(x, EPS: tl.constexpr):
    """x: [M, BK] -> x / sqrt(sum(x^2) + eps) per row, computed in fp32, returned in x's dtype.
    Masked-off columns were loaded as 0, so they do not count in the norm."""
    xf = x.to(tl.float32)
    return (xf * tl.rsqrt(tl.sum(xf * xf, 1) + EPS)[:, None]).to(x.dtype)


@triton.jit
def _trunc_tf32(x):
    """fp32 -> the tf32 value tensor cores read (the low 13 mantissa bits dropped: truncation, the
    conservative model). Interpreter only: it computes tl.dot in fp32 whatever input_precision says."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """tl.dot with fp32 accumulation. PREC: input_precision for fp32 operands ("ieee", "tf32x3"), or
    None for 16-bit operands (the default). DOT_F32 (interpreter only): cast operands to fp32 first, as
    bf16 dots are wrong there (the interpreter ignores input_precision)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if PREC == "tf32":          # the interpreter computes fp32: model the tensor cores' tf32 operands
            a = _trunc_tf32(a)
            b = _trunc_tf32(b)
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
    [BC, BC] dots each instead of BC - 1 dependent row steps.
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
def _row_step(L, X, sel):
    """One forward-substitution step on a 16x16 block: row i (sel = [row == i]) of X = (I + L)^-1 - I,
    x_i = -L_i - L_i X (rows < i of X only; X rows >= i are still 0 and L is strictly lower)."""
    a = -tl.sum(tl.where(sel, L, 0.0), 0)                          # -L[i, :], indexed by column m
    a = a + tl.sum(a[:, None] * X, 0)                              # -L_i - L_i X
    return tl.where(sel, a[None, :], X)


@triton.jit
def _inv_diag_rows(L0, L1, L2, L3, NB: tl.constexpr):
    """The NB (1, 2 or 4) diagonal 16x16 blocks of (I + L)^-1 by forward substitution, row by row.

    The blocks are independent: one loop of 15 dependent steps advances all of them (NB-fold
    instruction-level parallelism). No tl.dot: each step is two masked reductions over a 16x16
    block (inside the warp at 1 warp). Exact fp32 arithmetic.
    """
    o = tl.arange(0, 16)
    X0 = tl.zeros([16, 16], dtype=tl.float32)
    X1 = tl.zeros([16, 16], dtype=tl.float32)
    X2 = tl.zeros([16, 16], dtype=tl.float32)
    X3 = tl.zeros([16, 16], dtype=tl.float32)
    for i in range(1, 16):
        sel = o[:, None] == i
        X0 = _row_step(L0, X0, sel)
        if NB >= 2:
            X1 = _row_step(L1, X1, sel)
        if NB >= 4:
            X2 = _row_step(L2, X2, sel)
            X3 = _row_step(L3, X3, sel)
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    return X0 + eye, X1 + eye, X2 + eye, X3 + eye


# ============================================================================================
# kernel 1: cumsum (+ gating) -> l2norm(k) -> L -> A = (I + L)^-1     (fully chunk-parallel)
# ============================================================================================

@triton.jit
def _g_block(g_base, s_gt, rows, m_r, G, Gl, G_off, acc, A_log_h, dt_bias_h,
             GATE: tl.constexpr, LOAD_G: tl.constexpr, STORE_G: tl.constexpr, THRESHOLD: tl.constexpr,
             PRECISE: tl.constexpr):
    """One 16-token block of G (fp32 [16]): loaded (LOAD_G) or g (gated) cumsum'ed on top of acc.
    Returns (G, Gl, acc): Gl is G's rounding error (see chunk_kkt_inv_kernel), 0 unless PRECISE."""
    if LOAD_G:
        b_G = tl.load(G + G_off, mask=m_r, other=0.0).to(tl.float32)
        b_Gl = b_G * 0.0
    else:
        b_g = tl.load(g_base + rows.to(tl.int64) * s_gt, mask=m_r, other=0.0).to(tl.float32)
        if GATE:
            b_g = _gate(b_g, A_log_h, dt_bias_h, THRESHOLD, PRECISE)
        # padded tokens get g = 0 (decay 1): G stays flat past the sequence end
        b_g = tl.where(m_r, b_g, 0.0)
        if PRECISE:
            # precision hazard: G reaches |G| ~ 1e3 under strong gating, where an fp32 ulp (6e-5) is
            # far above the decays' own precision. The fp64 cumsum is exact for 64 fp32 terms; G and
            # its rounding error Gl are both kept, so G_i - G_j = (G_i - G_j) + (Gl_i - Gl_j) is
            # accurate to the difference's own precision (the refgdn oracle rounds G to fp32).
            c = tl.cumsum(b_g.to(tl.float64), 0) + acc
            acc = acc + tl.sum(b_g.to(tl.float64), 0)
            b_G = c.to(tl.float32)
            b_Gl = (c - b_G.to(tl.float64)).to(tl.float32)
            if STORE_G:
                tl.store(Gl + G_off, b_Gl, mask=m_r)
        else:
            b_G = tl.cumsum(b_g, 0) + acc
            acc = acc + tl.sum(b_g, 0)
            b_Gl = b_G * 0.0
        if STORE_G:
            tl.store(G + G_off, b_G, mask=m_r)
    return b_G, b_Gl, acc


@triton.jit
def _gdiff(Ga, Gla, Gb, Glb, PRECISE: tl.constexpr):
    """G_a - G_b from (G, Gl) pairs: [Ma] x [Mb] -> [Ma, Mb] (the Gl terms only when PRECISE)."""
    d = Ga[:, None] - Gb[None, :]
    if PRECISE:
        d = d + (Gla[:, None] - Glb[None, :])
    return d


@triton.jit
def _k_block(k_base, rows, m_r, s_kt, o_k, m_k, kn, kn_off, m_kn,
             L2NORM: tl.constexpr, EPS: tl.constexpr):
    """k rows [16, BK] of one 16-token block (padded rows and columns are 0). With L2NORM they are
    normalised and stored to kn where m_kn ([BK]: the columns, for the first value head of the GVA
    group only; all False for the others)."""
    b_k = tl.load(k_base + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                  other=0.0)
    if L2NORM:
        b_k = _l2norm_rows(b_k, EPS)
        tl.store(kn + kn_off[:, None] + o_k[None, :], b_k, mask=m_r[:, None] & m_kn[None, :])
    return b_k


@triton.jit
def _kk_block(ka, kb, beta_a, Ga, Gla, Gb, Glb, m_a, PREC: tl.constexpr, DOT_F32: tl.constexpr,
              DIAG: tl.constexpr, PRECISE: tl.constexpr):
    """One 16x16 block of L: L_ij = beta_i (k_i . k_j) exp(G_i - G_j) for rows i of block a, cols j of
    block b (b <= a), strictly below the diagonal when DIAG. Rows past the sequence end (m_a False) are 0."""
    o = tl.arange(0, 16)
    keep = m_a[:, None] & (o[None, :] >= 0)
    if DIAG:
        keep = keep & (o[:, None] > o[None, :])
    # precision hazard: mask before exp. Discarded entries (above the diagonal, or a padded row whose
    # G was loaded as 0) can have G_i - G_j > 0 and overflow; exponentiate 0 there instead.
    decay = _exp(tl.where(keep, _gdiff(Ga, Gla, Gb, Glb, PRECISE), 0.0), PRECISE)
    kk = _dot(ka, tl.trans(kb), PREC, DOT_F32)
    return tl.where(keep, kk * beta_a[:, None] * decay, 0.0)


@triton.jit
def _store_a(A, tok, m_r, X, j: tl.constexpr, BT: tl.constexpr):
    """Block column j (16 wide) of A [B, T, HV, BT] for the 16 tokens `tok` (rows past the end: not stored)."""
    tl.store(A + tok[:, None] * BT + j * 16 + tl.arange(0, 16)[None, :], X.to(A.dtype.element_ty),
             mask=m_r[:, None])


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_kkt_inv_kernel(
    k, g, beta, A_log, dt_bias,             # inputs
    G, Gl, A, kn,                           # outputs (G an input with LOAD_G)
    cu_seqlens, chunk_indices, T, NT,
    s_kb, s_kt, s_kh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr,
    LOAD_G: tl.constexpr, STORE_G: tl.constexpr, DO_A: tl.constexpr,
    PREC: tl.constexpr, INV_PREC: tl.constexpr, INV_DIAG_PREC: tl.constexpr, INV_ROWS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISE: tl.constexpr, THRESHOLD: tl.constexpr, EPS: tl.constexpr,
):
    """Per (chunk, value head): G = cumsum(g); kn = l2norm(k); A = (I + L)^-1.

    k: [B, T, H, K] (any strides, unit last-dim stride), g, beta: [B, T, HV] (any strides).
    G: [B, T, HV] fp32; Gl: [B, T, HV] fp32, G's rounding error (PRECISE only: the cumsum runs in fp64,
    G = fp32(cumsum), Gl = fp32(cumsum - G)); A: [B, T, HV, BT] (its dtype; every column written, zeros
    above the diagonal); kn: [B, T, H, K] (contiguous, k's dtype; written with L2NORM by the first value
    head of each group). grid = (chunks * HV,), head fastest (GVA heads sharing k run together: k hits L2).
    The chunk is NB = BT/16 blocks of 16 tokens; the k blocks [16, BK] are loaded (normalised), the
    lower blocks of L computed by 16x16 tl.dots, then
        A_ii = (I + L_ii)^-1                 (doubling; INV_ROWS: one row-substitution loop for all blocks)
        A_ij = -A_ii sum_{j <= m < i} L_im A_mj                  (block forward substitution)
    Switches: LOAD_G (G given, no cumsum, Gl = 0), STORE_G, DO_A (else only G).
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos = _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = bos + i_t * BT
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    i_hk = i_h // GROUP
    m_kn = m_k & ((o_k * 0 + i_h % GROUP) == 0)                  # kn columns this program stores

    k_base = k + i_b * s_kb + i_hk * s_kh
    g_base = g + i_b * s_gb + i_h * s_gh
    b_base = beta + i_b * s_bb + i_h * s_bh
    if GATE:
        A_log_h = tl.load(A_log + i_h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias + i_h).to(tl.float32)
    else:
        A_log_h = 0.0
        dt_bias_h = 0.0
    if PRECISE:
        acc = tl.sum(tl.zeros([16], dtype=tl.float64), 0)
    else:
        acc = tl.sum(tl.zeros([16], dtype=tl.float32), 0)

    # ---- per 16-token block: G, beta, k ------------------------------------------------------
    r0 = t0 + o_c
    m0 = r0 < eos
    tok0 = (i_b * T + r0).to(tl.int64) * HV + i_h                # [B, T, HV] flat index of (token, head)
    kn0 = ((i_b * T + r0).to(tl.int64) * H + i_hk) * K           # [B, T, H, K] row offsets of kn
    G0, Gl0, acc = _g_block(g_base, s_gt, r0, m0, G, Gl, tok0, acc, A_log_h, dt_bias_h, GATE, LOAD_G, STORE_G,
                            THRESHOLD, PRECISE)
    if DO_A:
        b0 = tl.load(b_base + r0.to(tl.int64) * s_bt, mask=m0, other=0.0).to(tl.float32)
        k0 = _k_block(k_base, r0, m0, s_kt, o_k, m_k, kn, kn0, m_kn, L2NORM, EPS)
    if BT >= 32:
        r1 = r0 + 16
        m1 = r1 < eos
        tok1 = tok0 + 16 * HV
        G1, Gl1, acc = _g_block(g_base, s_gt, r1, m1, G, Gl, tok1, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                STORE_G, THRESHOLD, PRECISE)
        if DO_A:
            b1 = tl.load(b_base + r1.to(tl.int64) * s_bt, mask=m1, other=0.0).to(tl.float32)
            k1 = _k_block(k_base, r1, m1, s_kt, o_k, m_k, kn, kn0 + 16 * H * K, m_kn, L2NORM, EPS)
    if BT >= 64:
        r2 = r0 + 32
        m2 = r2 < eos
        tok2 = tok0 + 32 * HV
        G2, Gl2, acc = _g_block(g_base, s_gt, r2, m2, G, Gl, tok2, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                STORE_G, THRESHOLD, PRECISE)
        r3 = r0 + 48
        m3 = r3 < eos
        tok3 = tok0 + 48 * HV
        G3, Gl3, acc = _g_block(g_base, s_gt, r3, m3, G, Gl, tok3, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                STORE_G, THRESHOLD, PRECISE)
        if DO_A:
            b2 = tl.load(b_base + r2.to(tl.int64) * s_bt, mask=m2, other=0.0).to(tl.float32)
            k2 = _k_block(k_base, r2, m2, s_kt, o_k, m_k, kn, kn0 + 32 * H * K, m_kn, L2NORM, EPS)
            b3 = tl.load(b_base + r3.to(tl.int64) * s_bt, mask=m3, other=0.0).to(tl.float32)
            k3 = _k_block(k_base, r3, m3, s_kt, o_k, m_k, kn, kn0 + 48 * H * K, m_kn, L2NORM, EPS)

    if DO_A:
        # ---- the lower blocks of L (k is dead after this) --------------------------------------
        L00 = _kk_block(k0, k0, b0, G0, Gl0, G0, Gl0, m0, PREC, DOT_F32, True, PRECISE)
        L11 = L00
        L22 = L00
        L33 = L00
        if BT >= 32:
            L11 = _kk_block(k1, k1, b1, G1, Gl1, G1, Gl1, m1, PREC, DOT_F32, True, PRECISE)
            L10 = _kk_block(k1, k0, b1, G1, Gl1, G0, Gl0, m1, PREC, DOT_F32, False, PRECISE)
        if BT >= 64:
            L22 = _kk_block(k2, k2, b2, G2, Gl2, G2, Gl2, m2, PREC, DOT_F32, True, PRECISE)
            L20 = _kk_block(k2, k0, b2, G2, Gl2, G0, Gl0, m2, PREC, DOT_F32, False, PRECISE)
            L21 = _kk_block(k2, k1, b2, G2, Gl2, G1, Gl1, m2, PREC, DOT_F32, False, PRECISE)
            L33 = _kk_block(k3, k3, b3, G3, Gl3, G3, Gl3, m3, PREC, DOT_F32, True, PRECISE)
            L30 = _kk_block(k3, k0, b3, G3, Gl3, G0, Gl0, m3, PREC, DOT_F32, False, PRECISE)
            L31 = _kk_block(k3, k1, b3, G3, Gl3, G1, Gl1, m3, PREC, DOT_F32, False, PRECISE)
            L32 = _kk_block(k3, k2, b3, G3, Gl3, G2, Gl2, m3, PREC, DOT_F32, False, PRECISE)

        # ---- diagonal blocks of the inverse ----------------------------------------------------
        if INV_ROWS:
            A00, A11, A22, A33 = _inv_diag_rows(L00, L11, L22, L33, BT // 16)
        else:
            A00 = _inv_unit_lower(L00, 16, 4, INV_DIAG_PREC)
            A11 = A00
            A22 = A00
            A33 = A00
            if BT >= 32:
                A11 = _inv_unit_lower(L11, 16, 4, INV_DIAG_PREC)
            if BT >= 64:
                A22 = _inv_unit_lower(L22, 16, 4, INV_DIAG_PREC)
                A33 = _inv_unit_lower(L33, 16, 4, INV_DIAG_PREC)
        zero = tl.zeros([16, 16], dtype=tl.float32)

        # ---- block forward substitution, block row by block row, and the stores -----------------
        _store_a(A, tok0, m0, A00, 0, BT)
        if BT >= 32:
            _store_a(A, tok0, m0, zero, 1, BT)
            A10 = -_mm32(A11, _mm32(L10, A00, INV_PREC), INV_PREC)
            _store_a(A, tok1, m1, A10, 0, BT)
            _store_a(A, tok1, m1, A11, 1, BT)
        if BT >= 64:
            _store_a(A, tok0, m0, zero, 2, BT)
            _store_a(A, tok0, m0, zero, 3, BT)
            _store_a(A, tok1, m1, zero, 2, BT)
            _store_a(A, tok1, m1, zero, 3, BT)
            A21 = -_mm32(A22, _mm32(L21, A11, INV_PREC), INV_PREC)
            A20 = -_mm32(A22, _mm32(L20, A00, INV_PREC) + _mm32(L21, A10, INV_PREC), INV_PREC)
            _store_a(A, tok2, m2, A20, 0, BT)
            _store_a(A, tok2, m2, A21, 1, BT)
            _store_a(A, tok2, m2, A22, 2, BT)
            _store_a(A, tok2, m2, zero, 3, BT)
            A32 = -_mm32(A33, _mm32(L32, A22, INV_PREC), INV_PREC)
            A31 = -_mm32(A33, _mm32(L31, A11, INV_PREC) + _mm32(L32, A21, INV_PREC), INV_PREC)
            A30 = -_mm32(A33, _mm32(L30, A00, INV_PREC) + _mm32(L31, A10, INV_PREC) + _mm32(L32, A20, INV_PREC),
                         INV_PREC)
            _store_a(A, tok3, m3, A30, 0, BT)
            _store_a(A, tok3, m3, A31, 1, BT)
            _store_a(A, tok3, m3, A32, 2, BT)
            _store_a(A, tok3, m3, A33, 3, BT)


# ============================================================================================
# kernel 2: w = A (beta exp(G) K), u = A (beta V)     (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def chunk_w_u_kernel(
    k, v, beta, G, A, w, u,
    cu_seqlens, chunk_indices, T, NT,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr,
):
    """Per (chunk, value head): w = A (beta exp(G) K) [BT, K], u = A (beta V) [BT, V].

    k: [B, T, H, K], v: [B, T, HV, V], beta: [B, T, HV] (strided, unit last-dim stride for k, v);
    G: [B, T, HV] fp32, A: [B, T, HV, BT] (zeros above the diagonal), w: [B, T, HV, K],
    u: [B, T, HV, V] (contiguous). A is rounded to k's dtype for the dots (it is stored so on the
    main path). exp(G) <= 1 (G: cumsum of g <= 0). grid = (chunks * HV,), head fastest.
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos = _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_r = rows < eos
    tok = (i_b * T + rows).to(tl.int64) * HV + i_h
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    m_rv = m_r[:, None] & (o_v < V)[None, :]

    b_beta = tl.load(beta + i_b * s_bb + i_h * s_bh + rows.to(tl.int64) * s_bt, mask=m_r, other=0.0).to(tl.float32)
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_A = tl.load(A + tok[:, None] * BT + tl.arange(0, BT)[None, :], mask=m_r[:, None], other=0.0)
    b_k = tl.load(k + i_b * s_kb + (i_h // GROUP) * s_kh + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :],
                  mask=m_rk, other=0.0)
    b_v = tl.load(v + i_b * s_vb + i_h * s_vh + rows.to(tl.int64)[:, None] * s_vt + o_v[None, :],
                  mask=m_rv, other=0.0)
    b_A = b_A.to(b_k.dtype)
    b_kb = (b_k.to(tl.float32) * (b_beta * _exp(b_G, PRECISE))[:, None]).to(b_k.dtype)
    b_w = _dot(b_A, b_kb, PREC, DOT_F32)
    tl.store(w + tok[:, None] * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_rk)
    b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(b_v.dtype)
    b_u = _dot(b_A.to(b_v.dtype), b_vb, PREC, DOT_F32)
    tl.store(u + tok[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_rv)


# ============================================================================================
# kernel 3: state passing (sequential over chunks, state in registers)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def chunk_state_kernel(
    k, w, u, G, Gl, h0, h, v_new, ht,
    cu_seqlens, chunk_offsets, T, NT,
    s_kb, s_kt, s_kh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr,
):
    """Per (V-block, sequence, value head), for each chunk c of the sequence in order:

        h[c] = S ;   v_new = u - w S ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)

    k: [B, T, H, K] (strided, already l2-normalised when asked: kernel 1's kn); w: [B, T, HV, K],
    u, v_new: [B, T, HV, V], G: [B, T, HV] (contiguous); h0, ht: [N, HV, K, V] fp32 (contiguous);
    h: [chunks, HV, K, V] (global chunk order). grid = (cdiv(V, BV), N * HV), V-block fastest (the
    V-blocks of one head share w and k via L2). S: fp32 [BK, BV] kept in registers across all chunks;
    K is one block (<= 256). Both dots take 16-bit operands (S rounded to w's dtype, the decayed v_new
    to k's) with fp32 accumulation. Only loads that do not depend on S are issued per chunk, so the
    compiler's software pipeline (num_stages) prefetches the next chunk's w, u, k, G while this one
    computes. PRECISE: decays from the compensated (G, Gl) pairs (kernel 1).
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

    k_base = k + i_b * s_kb + (i_h // GROUP) * s_kh
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(0, n_chunks):
        rows = bos + i_t * BT + o_t
        m_r = rows < eos
        m_rv = m_r[:, None] & m_v[None, :]
        tok = (i_b * T + rows).to(tl.int64) * HV + i_h             # [BT] flat (token, head) index
        b_w = tl.load(w + tok[:, None] * K + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_hc = b_h.to(b_w.dtype)                                    # chunk-start state as a dot operand
        # h in its own dtype: w's dtype on the forward path (= b_hc), fp32 for the backward's recompute
        tl.store(h + ((boc + i_t) * HV + i_h) * K * V + kv_off, b_h.to(h.dtype.element_ty), mask=m_kv)

        b_v = tl.load(u + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        b_v = b_v.to(tl.float32) - _dot(b_w, b_hc, PREC, DOT_F32)                    # v_new = u - w S
        tl.store(v_new + tok[:, None] * V + o_v[None, :], b_v.to(v_new.dtype.element_ty), mask=m_rv)

        last = tl.minimum(eos - bos - i_t * BT, BT) - 1             # last valid row of the chunk
        i_last = (i_b * T + bos + i_t * BT + last).to(tl.int64) * HV + i_h
        b_G = tl.load(G + tok, mask=m_r, other=0.0)
        G_last = tl.load(G + i_last)
        d_G = G_last - b_G                                          # [BT] G_last - G
        if PRECISE:
            d_G = d_G + (tl.load(Gl + i_last) - tl.load(Gl + tok, mask=m_r, other=0.0))
        b_k = tl.load(k_base + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :],
                      mask=m_r[:, None] & m_k[None, :], other=0.0)

        # precision hazard: mask before exp (padded rows' G is 0 and G_last - 0 may be > 0);
        # on valid rows G_last - G <= 0 since G is non-increasing within a chunk.
        b_v = b_v * tl.where(m_r, _exp(tl.where(m_r, d_G, 0.0), PRECISE), 0.0)[:, None]
        b_h = b_h * _exp(G_last, PRECISE)
        b_h += _dot(tl.trans(b_k), b_v.to(b_k.dtype), PREC, DOT_F32)                 # + K^T (decayed v_new)

    if STORE_HT:
        tl.store(ht + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, b_h, mask=m_kv)


# ============================================================================================
# kernel 4: output (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def chunk_output_kernel(
    q, k, v_new, h, G, Gl, o,
    cu_seqlens, chunk_indices, T, NT, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISE: tl.constexpr, EPS: tl.constexpr,
):
    """Per (chunk, value head, V-block):

        O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * [i >= j]) v_new ]

    q, k: [B, T, H, K] (strided; k already normalised when asked); v_new, o: [B, T, HV, V],
    G: [B, T, HV], h: [chunks, HV, K, V] (contiguous). grid = (chunks * HV * cdiv(V, BV),), V-block
    fastest, then head (q, k shared by GVA heads and V-blocks hit L2). L2NORM normalises q: both
    products are linear in q's rows, so the dots take q as loaded and the rows are scaled by
    1 / |q_i| in fp32 afterwards (no 16-bit rounding of the normalised q). exp(G) likewise scales the
    rows of Q h after the dot. PRECISE: decays from the compensated (G, Gl) pairs (kernel 1).
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
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vn = tl.load(v_new + tok[:, None] * V + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)

    if L2NORM:
        qf = b_q.to(tl.float32)
        b_s = tl.rsqrt(tl.sum(qf * qf, 1) + EPS) * scale            # [BT] row scale: scale / |q_i|
    else:
        b_s = tl.zeros([BT], dtype=tl.float32) + scale
    b_o = _dot(b_q, b_h, PREC, DOT_F32) * (_exp(b_G, PRECISE) * b_s)[:, None]    # inter-chunk: exp(G) <= 1
    keep = (o_t[:, None] >= o_t[None, :]) & m_r[:, None]
    # precision hazard: mask before exp (above the diagonal G_i - G_j >= 0 may overflow)
    if PRECISE:
        b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
    else:
        b_Gl = b_G
    b_A = _dot(b_q, tl.trans(b_k), PREC, DOT_F32) * _exp(tl.where(keep, _gdiff(b_G, b_Gl, b_G, b_Gl, PRECISE), 0.0),
                                                         PRECISE)
    b_A = tl.where(keep, b_A * b_s[:, None], 0.0)
    b_o += _dot(b_A.to(b_vn.dtype), b_vn, PREC, DOT_F32)                 # intra-chunk
    tl.store(o + tok[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])
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
    STORE_HT: tl.constexpr, THRESHOLD: tl.constexpr, EPS: tl.constexpr, PRECISE: tl.constexpr,
):
    """Per (V-block, sequence, value head), for each token t in order (all in fp32):

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    q, k: [B, T, H, K], v: [B, T, HV, V], g, beta: [B, T, HV] (strided, unit last-dim stride for q, k, v);
    h0, ht: [N, HV, K, V] fp32; o: [B, T, HV, V] contiguous. grid = (cdiv(V, BV), N * HV).
    PRECISE (fp32 inputs): range-reduced exp (``_exp``).
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
            b_g = _gate(b_g, A_log_h, dt_bias_h, THRESHOLD, PRECISE)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + EPS)
        b_h *= _exp(b_g, PRECISE)
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


def kkt_config(K: int) -> dict:
    """Kernel 1 (chunk_kkt_inv_kernel): one program per (chunk, value head), no loop to pipeline.
    One warp at K <= 128: the 16x16 blocks of L and A are small, and in one warp the layout changes
    between the 16x16 dots (and the row substitution's reductions) never leave the warp (H200,
    K = 128, BT = 64, bf16, rows inverse: 1 warp 0.76 ms, 2 warps 1.24, 4 warps 2.1; doubling with tf32
    products: 1 warp 0.58, 2 warps 0.98); 2 warps for the [16, 256] k blocks at K = 256 (register
    pressure)."""
    BK, _ = _blocks(K, 16)
    if is_interpreting():
        return dict(num_warps=4, num_stages=1)
    return dict(num_warps=1 if BK <= 128 else 2, num_stages=1)


def w_u_config(K: int, V: int) -> dict:
    """Kernel 2 (chunk_w_u_kernel): two [BT, BT] x [BT, K or V] dots per program; 8 warps share the
    fp32 [BT, K] and [BT, V] results (measured on H200 at K = V = 128: 8 warps 0.55 ms, 80 registers;
    4 warps 0.62 ms, 152 registers)."""
    if is_interpreting():
        return dict(num_warps=4, num_stages=1)
    return dict(num_warps=8, num_stages=1)


def state_config(N: int, HV: int, K: int, V: int, device: torch.device) -> dict:
    """Kernel 3 (chunk_state_kernel): the sequential pass. Only N * HV * cdiv(V, BV) programs exist,
    each walking all chunks of its sequence, so BV trades parallelism (small BV: more programs fill the
    SMs) against redundant w/k reads (every V-block program reloads the chunk's w and k; they mostly hit
    L2). Qwen3-Next at B=1 (HV=32, V=128): BV=32 -> 128 programs for 132 SMs. num_stages=3 prefetches
    the next chunks' w, u, k, G behind the current chunk's dots. Pinned, never autotuned
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
    return dict(BV=BV, num_warps=4 if BK * BV <= 128 * 64 else 8, num_stages=3)


def output_config(K: int, V: int) -> dict:
    """Kernel 4 (chunk_output_kernel): chunk-parallel, (chunks x HV x V-blocks) programs, plenty at any
    T >= a few chunks. BV = V (up to 128) so Q K^T is computed once per (chunk, head); 4 warps (one
    warpgroup) for the [BT, 128] fp32 accumulator next to the [BT, BT] attention block (measured on
    H200 at K = V = 128: 4 warps beat 8)."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():
        return dict(BV=min(BVmax, 64), num_warps=4, num_stages=1)
    BV = min(BVmax, 128 if BK <= 128 else 64)
    return dict(BV=BV, num_warps=4 if BK * BV <= 128 * 128 else 8, num_stages=1)


def recurrent_config(K: int, V: int) -> dict:
    """Recurrent kernel: state [BK, BV] fp32 in one warp's registers (<= 64 per thread), reductions over
    K stay inside the warp. Interpreter: one V-block."""
    BK = next_pow2(K)
    if is_interpreting():
        return dict(BV=min(next_pow2(V), 64), num_warps=4, num_stages=1)
    BV = min(next_pow2(V), max(8, 2048 // BK))
    return dict(BV=BV, num_warps=1, num_stages=1)


def _cfg(name: str, base: dict, configs: Optional[dict] = None) -> dict:
    """The pinned config `base` with the overrides configs[name] (benchmark sweeps) merged over it."""
    return dict(base, **(configs or {}).get(name, {}))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """Kernels address the last dim with unit stride; other dims may have any stride (slices are views)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _fp32_prec(dtype: torch.dtype):
    """input_precision of the dots whose operands are in `dtype`: None (default) for 16-bit operands,
    FP32_PRECISION for fp32 inputs (plain TF32 would fail fp32 conformance)."""
    return FP32_PRECISION if dtype == torch.float32 else None


def _precise(dtype: torch.dtype) -> bool:
    """Range-reduced exp (``_exp``) for fp32 inputs; 16-bit inputs round far above tl.exp's error."""
    return dtype == torch.float32


def _inv_rows(inv_method: Optional[str] = None) -> bool:
    """Diagonal-block inverse method: inv_method, by default rows on a GPU, doubling when interpreting
    (module comment)."""
    if inv_method not in (None, "rows", "doubling"):
        raise ValueError(f"inv_method must be None, 'rows' or 'doubling', got {inv_method!r}")
    return (inv_method or ("doubling" if is_interpreting() else "rows")) == "rows"


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


def _launch_kkt(k, g, beta, A_log, dt_bias, G, Gl, A, kn, ch: _Chunks, T: int, HV: int, BT: int, *,
                l2norm: bool, load_g: bool, store_g: bool, do_a: bool, precise: bool, prec_of=None,
                cfg_over: Optional[dict] = None, configs: Optional[dict] = None, inv_method: Optional[str] = None):
    """Kernel 1. k: [B, T, H, K] (a dummy when not do_a); kn: [B, T, H, K] or None (without l2norm);
    Gl: G's rounding error [B, T, HV] fp32, written when precise and store_g (else may be None).
    prec_of: None, or (dot input_precision, dtype whose INV_PRECISION / INV_DIAG_PRECISION apply) for
    the backward's fp32 recompute of 16-bit inputs (also taken by _launch_w_u / _launch_state);
    cfg_over: keys merged over the pinned config (the fp32 recompute takes 2 warps); configs, inv_method:
    benchmark knobs (module comment)."""
    H, K = k.shape[2], k.shape[3]
    BK, _ = _blocks(K, 16)
    if ch.total == 0 or HV == 0:
        return
    return chunk_kkt_inv_kernel[(ch.total * HV,)](
        k, g, beta, A_log, dt_bias, G, G if Gl is None else Gl, A, kn,
        ch.cu_seqlens, ch.indices, T, ch.NT,
        *k.stride()[:3], *g.stride(), *beta.stride(),
        H=H, HV=HV, GROUP=HV // H, K=K, BT=BT, BK=BK,
        IS_VARLEN=ch.varlen, GATE=A_log is not None, L2NORM=l2norm,
        LOAD_G=load_g, STORE_G=store_g, DO_A=do_a,
        PREC=_fp32_prec(k.dtype) if prec_of is None else prec_of[0],
        INV_PREC=INV_PRECISION[k.dtype if prec_of is None else prec_of[1]],
        INV_DIAG_PREC=INV_DIAG_PRECISION[k.dtype if prec_of is None else prec_of[1]],
        INV_ROWS=_inv_rows(inv_method), DOT_F32=is_interpreting(),
        PRECISE=precise, THRESHOLD=SOFTPLUS_THRESHOLD, EPS=L2NORM_EPS,
        **dict(_cfg("kkt", kkt_config(K), configs), **(cfg_over or {})))


def _launch_w_u(k, v, beta, G, A, w, u, ch: _Chunks, T: int, BT: int, *, precise: bool, prec_of=None,
                configs: Optional[dict] = None):
    """Kernel 2. k: [B, T, H, K] (normalised already when asked), A: [B, T, HV, BT]."""
    H, K = k.shape[2], k.shape[3]
    HV, V = v.shape[2], v.shape[3]
    BK, BV = _blocks(K, V)
    if ch.total == 0 or HV == 0:
        return
    return chunk_w_u_kernel[(ch.total * HV,)](
        k, v, beta, G, A, w, u,
        ch.cu_seqlens, ch.indices, T, ch.NT,
        *k.stride()[:3], *v.stride()[:3], *beta.stride(),
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, PREC=_fp32_prec(k.dtype) if prec_of is None else prec_of[0], DOT_F32=is_interpreting(),
        PRECISE=precise,
        **_cfg("w_u", w_u_config(K, V), configs))


def _launch_state(k, w, u, G, Gl, h0, h, v_new, ht, ch: _Chunks, N: int, T: int, BT: int, *, precise: bool,
                  prec_of=None, cfg_over: Optional[dict] = None, configs: Optional[dict] = None):
    """Kernel 3. k: [B, T, H, K] (normalised already when asked); Gl: G's rounding error or None (0).
    cfg_over: keys merged over the pinned config (the backward's fp32 recompute lowers num_stages)."""
    H, K = k.shape[2], k.shape[3]
    HV, V = u.shape[2], u.shape[3]
    if N * HV == 0:
        return
    BK, _ = _blocks(K, V)
    cfg = dict(_cfg("state", state_config(N, HV, K, V, k.device), configs), **(cfg_over or {}))
    BV = cfg.pop("BV")
    if precise and Gl is None:
        Gl = torch.zeros_like(G)
    return chunk_state_kernel[(cdiv(V, BV), N * HV)](
        k, w, u, G, G if Gl is None else Gl, h0, h, v_new, ht,
        ch.cu_seqlens, ch.offsets, T, ch.NT, *k.stride()[:3],
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, USE_H0=h0 is not None, STORE_HT=ht is not None,
        PREC=_fp32_prec(w.dtype) if prec_of is None else prec_of[0], DOT_F32=is_interpreting(), PRECISE=precise,
        **cfg)


def _launch_output(q, k, v_new, h, G, Gl, o, ch: _Chunks, T: int, BT: int, scale: float, *, l2norm_q: bool,
                   precise: bool, configs: Optional[dict] = None):
    """Kernel 4. k: [B, T, H, K] (normalised already when asked); l2norm_q normalises q in the kernel;
    Gl: G's rounding error or None (0)."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v_new.shape[2], v_new.shape[3]
    if ch.total == 0 or HV == 0:
        return
    BK, _ = _blocks(K, V)
    cfg = _cfg("output", output_config(K, V), configs)
    BV = cfg.pop("BV")
    if precise and Gl is None:
        Gl = torch.zeros_like(G)
    return chunk_output_kernel[(ch.total * HV * cdiv(V, BV),)](
        q, k, v_new, h, G, G if Gl is None else Gl, o,
        ch.cu_seqlens, ch.indices, T, ch.NT, float(scale),
        *q.stride()[:3], *k.stride()[:3],
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, L2NORM=l2norm_q, PREC=_fp32_prec(q.dtype), DOT_F32=is_interpreting(),
        PRECISE=precise, EPS=L2NORM_EPS, **cfg)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                           chunk_size=64):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or None).

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    refgdn.chunk_gated_delta_rule's twin (and fla's chunk_gated_delta_rule's signature), in four
    Triton kernels (module docstring). HV % H == 0 (value head h reads q/k head h // (HV // H)).
    Varlen: B == 1 and cu_seqlens [N+1] (int; empty and length-1 sequences are fine). With A_log and
    dt_bias [HV] given, `g` is the raw gate input a and g = -exp(A_log) softplus(a + dt_bias) is
    computed in fp32 inside the cumsum. use_qk_l2norm_in_kernel normalises q, k rows in the kernels
    (k once, in kernel 1). chunk_size: 16, 32 or 64. Inputs may be strided views (unit stride along
    the head dim is preferred; other layouts are copied). q, k, v in fp16/bf16/fp32; float64 inputs
    run refgdn. Reads cu_seqlens on the host (eager prefill, not for CUDA-graph capture).

    Differentiable: when an input requires grad (or torch.compile traces the call) it runs as the
    custom op torch.ops.fast.chunk_gated_delta_rule (fast.library), whose backward is fast.chunk_bwd's
    kernels: gradients of q, k, v, g (or of a, A_log, dt_bias with fused gating), beta, initial_state.
    """
    N = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, chunk_size)
    if _is_fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return refgdn.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size)
    _check_fast_limits(q.shape[3], v.shape[3], chunk_size)
    from .. import library                                               # registers the ops (no cycle at import)
    if library.wants_graph(q, k, v, g, beta, initial_state, A_log, dt_bias):
        o, final = library.chunk_gated_delta_rule_op(
            q, k, v, g, beta, q.shape[3] ** -0.5 if scale is None else float(scale), initial_state, cu_seqlens,
            bool(use_qk_l2norm_in_kernel), A_log, dt_bias, int(chunk_size))
        return o, (final if output_final_state else None)
    return chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                      use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size)


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                               chunk_size=64, *, configs: Optional[dict] = None, inv_method: Optional[str] = None):
    """The forward kernels of chunk_gated_delta_rule (same arguments and results), without validation or
    autograd: for callers that validated already (the public function, the custom op). Not float64.
    configs, inv_method: benchmark knobs passed to the launchers (module docstring)."""
    _check_fast_limits(q.shape[3], v.shape[3], chunk_size)
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    A_log, dt_bias, cu_seqlens = _contig(A_log), _contig(dt_bias), _contig(cu_seqlens)
    dev = q.device
    ch = _Chunks(B, T, BT, cu_seqlens)
    precise = _precise(v.dtype)
    l2 = bool(use_qk_l2norm_in_kernel)

    G = torch.empty(B, T, HV, dtype=torch.float32, device=dev)           # chunk-local cumsum of g
    Gl = torch.empty_like(G) if precise else None                        # its rounding error (fp32 inputs)
    A = torch.empty(B, T, HV, BT, dtype=k.dtype, device=dev)             # (I + L)^-1 per chunk
    kn = torch.empty(B, T, H, K, dtype=k.dtype, device=dev) if l2 else None
    _launch_kkt(k, g, beta, A_log, dt_bias, G, Gl, A, kn, ch, T, HV, BT, l2norm=l2, load_g=False, store_g=True,
                do_a=True, precise=precise, configs=configs, inv_method=inv_method)
    if l2:
        k = kn                                                           # kernels 2-4 read the normalised k

    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=dev)
    u = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
    _launch_w_u(k, v, beta, G, A, w, u, ch, T, BT, precise=precise, configs=configs)

    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    h = torch.empty(ch.total, HV, K, V, dtype=k.dtype, device=dev)       # chunk-start states
    v_new = torch.empty_like(u)
    _launch_state(k, w, u, G, Gl, h0, h, v_new, final, ch, N, T, BT, precise=precise, configs=configs)

    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
    _launch_output(q, k, v_new, h, G, Gl, o, ch, T, BT, scale, l2norm_q=l2, precise=precise,
                   configs=configs)
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
    cfg = recurrent_config(K, V)
    BV = cfg.pop("BV")
    recurrent_kernel[(cdiv(V, BV), N * HV)](
        q, k, v, g, beta, A_log, dt_bias, h0, o, final,
        cu_seqlens, T, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        HV=HV, GROUP=HV // H, K=K, V=V, BK=next_pow2(K), BV=BV,
        IS_VARLEN=cu_seqlens is not None, GATE=A_log is not None, L2NORM=use_qk_l2norm_in_kernel,
        USE_H0=h0 is not None, STORE_HT=final is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD, EPS=L2NORM_EPS, PRECISE=_precise(v.dtype), **cfg)
    return o, final
# stage twins of refgdn.delta_rule (same names and leading arguments; each runs one kernel).
# Dense inputs [B, T, ...] with any T (refgdn's need T % chunk_size == 0); cu_seqlens optional.
# --------------------------------------------------------------------------------------------

def _dummy(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(1, 1, 1, 1)


def chunk_cumsum(g: torch.Tensor, chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None,
                 A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 1. g: [B, T, HV] -> G: [B, T, HV] float32, the cumulative decay restarting at every chunk.

        G_c = sum_{s <= c, s in the chunk of c} g_s        (g = -exp(A_log) softplus(a + dt_bias) if given)

    Kernel 1 with only its cumsum switched on (fused gating with the range-reduced exp).
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
    _launch_kkt(d, g, g, A_log, dt_bias, G, torch.empty_like(G), None, None, _Chunks(B, T, chunk_size, cu_seqlens),
                T, HV, chunk_size, l2norm=False, load_g=False, store_g=True, do_a=False, precise=True)
    return G


def wy_repr(k: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, chunk_size: int,
            cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 2. k: [B, T, H, K], beta, G: [B, T, HV] -> A: [B, T, HV, BT] float32, A = (I + L)^-1 per chunk
    with L_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j. Kernel 1 with G given."""
    return _wy_repr(k, beta, G, chunk_size, cu_seqlens)


def _wy_repr(k: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, chunk_size: int,
             cu_seqlens: Optional[torch.Tensor] = None, *, inv_method: Optional[str] = None) -> torch.Tensor:
    """wy_repr with the diagonal-block inverse method chosen (inv_method: None, "rows", "doubling")."""
    check_chunk_size(chunk_size)
    if _is_fp64(k, beta, G):
        return refgdn.delta_rule.wy_repr(k, beta, G, chunk_size)
    _check_fast_limits(k.shape[3], 16, chunk_size)
    B, T, H, K = k.shape
    HV = G.shape[2]
    k = _unit_last(k)
    A = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=k.device)   # every entry written
    Gc = G.float().contiguous()
    _launch_kkt(k, Gc, beta, None, None, Gc, None, A, None, _Chunks(B, T, chunk_size, cu_seqlens), T, HV,
                chunk_size, l2norm=False, load_g=True, store_g=False, do_a=True, precise=_precise(k.dtype),
                inv_method=inv_method)
    return A


def w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, G: torch.Tensor,
        chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 3. k: [B, T, H, K], v: [B, T, HV, V], beta, G: [B, T, HV], A: [B, T, HV, BT]
    -> w: [B, T, HV, K] (k.dtype), u: [B, T, HV, V] (v.dtype);  w = A (beta exp(G) K), u = A (beta V).
    Kernel 2 (A is rounded to k's dtype for the dots)."""
    check_chunk_size(chunk_size)
    if _is_fp64(k, v, beta, A, G):
        return refgdn.delta_rule.w_u(k, v, beta, A, G, chunk_size)
    _check_fast_limits(k.shape[3], v.shape[3], chunk_size)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    k, v = _unit_last(k), _unit_last(v)
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    u = torch.empty(B, T, HV, V, dtype=v.dtype, device=k.device)
    _launch_w_u(k, v, beta, G.float().contiguous(), A.float().contiguous(), w, u,
                _Chunks(B, T, chunk_size, cu_seqlens), T, chunk_size, precise=_precise(k.dtype))
    return w, u


def state_passing(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, G: torch.Tensor, chunk_size: int,
                  initial_state: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """Step 4. k: [B, T, H, K], w: [B, T, HV, K], u: [B, T, HV, V], G: [B, T, HV], initial_state: [N, HV, K, V]
    -> h: [B, NC, HV, K, V] (w.dtype; varlen: [1, total chunks, ...]), v_new: [B, T, HV, V] (u.dtype),
    final_state: [N, HV, K, V] float32.

        v_new = u - w S ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)      (kernel 3)
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
    _launch_state(_unit_last(k), w.contiguous(), u.contiguous(), G.float().contiguous(), None, h0, h, v_new, final,
                  ch, N, T, chunk_size, precise=_precise(w.dtype))
    NC = ch.NT if cu_seqlens is None else ch.total
    return h.view(B if cu_seqlens is None else 1, NC, HV, K, V), v_new, final


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
