"""Steps 1-3 of the chunked forward (refgdn.delta_rule's chunk_cumsum, wy_repr, w_u): kernels 1 and 2.

    k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]
    -> G: [B, T, HV] fp32, A: [B, T, HV, BT], w: [B, T, HV, K], u: [B, T, HV, V]
    G = chunk-local cumsum(g) ;  A = (I + L)^-1, L_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j ;
    w = A (beta exp(G) K) ;  u = A (beta V)

``chunk_kkt_inv_kernel`` (kernel 1, grid (chunks * HV / HPP), 1 warp): the cumsum (or fused gating of raw a),
l2norm(k) once per key head, K K^T in 16x16 blocks once per program (HPP value heads of one key head), each
head's L and its inverse (diagonal blocks by forward substitution
or doubling, ``inv_method``; off-diagonal blocks by block forward substitution). ``chunk_w_u_kernel``
(kernel 2, grid (chunks * HV)): two plain [BT, BT] x [BT, *] dots. Split so that each stays small
(package docstring). Here too: their pinned configs, launchers and the stage twins.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

import refgdn
from refgdn.checks import check_chunk_size

from ..launch import launch
from ..utils import is_interpreting
from .common import (INV_DIAG_PRECISION, INV_PRECISION, L2NORM_EPS, SOFTPLUS_THRESHOLD, _blocks, _caller_rows, _cfg,
                     _check_fast_limits, _chunk_coords, _chunk_rows, _Chunks, _contig, _dot, _exp, _fp32_prec, _gate,
                     _gdiff, _in_rows_of_chunk, _is_fp64, _l2norm_rows, _load_beta, _operand, _precise, _unit_last,
                     _upcast)


# ============================================================================================
# triangular inverse helpers (kernel 1)
# ============================================================================================

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
def _k_block(k_base, rows, m_r, in_lo, in_hi, in_d, s_kt, o_k, m_k, kn, kn_off, m_kn,
             L2NORM: tl.constexpr, EPS: tl.constexpr, UPCAST: tl.constexpr, IN_ROWS: tl.constexpr):
    """k rows [16, BK] of one 16-token block (padded rows and columns are 0; IN_ROWS: read at the caller's rows,
    common._caller_rows). With L2NORM they are normalised and stored to kn (every row of the block, zeros
    included) where m_kn ([BK]: the columns, for the first value head of the GVA group only; all False for the
    others). UPCAST: converted to fp32 first (exact for 16-bit k)."""
    r_in, m_in = _caller_rows(rows, m_r, in_lo, in_hi, in_d, IN_ROWS)
    b_k = tl.load(k_base + r_in.to(tl.int64)[:, None] * s_kt + o_k[None, :], mask=m_in[:, None] & m_k[None, :],
                  other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
    if L2NORM:
        b_k = _l2norm_rows(b_k, EPS)
        tl.store(kn + kn_off[:, None] + o_k[None, :], b_k.to(kn.dtype.element_ty), mask=m_r[:, None] & m_kn[None, :])
    return b_k


@triton.jit
def _kk(ka, kb, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Raw 16x16 block of K K^T (rows of block a, columns of block b), fp32; shared by a program's value heads."""
    return _dot(ka, tl.trans(kb), PREC, DOT_F32)


@triton.jit
def _l_block(kk, beta_a, Ga, Gla, Gb, Glb, m_a, DIAG: tl.constexpr, PRECISE: tl.constexpr):
    """One 16x16 block of L from its K K^T block: L_ij = beta_i (k_i . k_j) exp(G_i - G_j) for rows i of block
    a, cols j of block b (b <= a), strictly below the diagonal when DIAG. Rows past the sequence end (m_a False)
    are 0."""
    o = tl.arange(0, 16)
    keep = m_a[:, None] & (o[None, :] >= 0)
    if DIAG:
        keep = keep & (o[:, None] > o[None, :])
    # precision hazard: mask before exp. Discarded entries (above the diagonal, or a padded row whose
    # G was loaded as 0) can have G_i - G_j > 0 and overflow; exponentiate 0 there instead.
    decay = _exp(tl.where(keep, _gdiff(Ga, Gla, Gb, Glb, PRECISE), 0.0), PRECISE)
    return tl.where(keep, kk * beta_a[:, None] * decay, 0.0)


@triton.jit
def _diag_inverse(kk, beta_a, Ga, Gla, m_a, PRECISE: tl.constexpr, INV_DIAG_PREC: tl.constexpr):
    """A diagonal 16x16 block of (I + L)^-1 from its K K^T block, by doubling (_inv_unit_lower)."""
    return _inv_unit_lower(_l_block(kk, beta_a, Ga, Gla, Ga, Gla, m_a, True, PRECISE), 16, 4, INV_DIAG_PREC)


@triton.jit
def _store_a(A, tok, m_r, X, j: tl.constexpr, BT: tl.constexpr):
    """Block column j (16 wide) of A [B, T, HV, BT] for the 16 tokens `tok` (rows past the end: not stored)."""
    tl.store(A + tok[:, None] * BT + j * 16 + tl.arange(0, 16)[None, :], X.to(A.dtype.element_ty),
             mask=m_r[:, None])


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_kkt_inv_kernel(
    k, g, beta, A_log, dt_bias,             # inputs
    G, Gl, A, kn,                           # outputs (G an input with LOAD_G)
    cu_seqlens, chunk_indices, in_rows, T, NT,
    s_kb, s_kt, s_kh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr,
    LOAD_G: tl.constexpr, STORE_G: tl.constexpr, DO_A: tl.constexpr, HPP: tl.constexpr,
    PREC: tl.constexpr, INV_PREC: tl.constexpr, INV_DIAG_PREC: tl.constexpr, INV_ROWS: tl.constexpr,
    DOT_F32: tl.constexpr, UPCAST: tl.constexpr,
    PRECISE: tl.constexpr, THRESHOLD: tl.constexpr, EPS: tl.constexpr, BETA_LOGITS: tl.constexpr = 0,
    IN_ROWS: tl.constexpr = False,
):
    """Per (chunk, HPP value heads of one key head): G = cumsum(g); kn = l2norm(k); A = (I + L)^-1.

    k: [B, T, H, K] (any strides, unit last-dim stride), g, beta: [B, T, HV] (any strides).
    G: [B, T, HV] fp32; Gl: [B, T, HV] fp32, G's rounding error (PRECISE only: the cumsum runs in fp64,
    G = fp32(cumsum), Gl = fp32(cumsum - G)); A: [B, T, HV, BT] (its dtype; every column written, zeros
    above the diagonal); kn: [B, T, H, K] (contiguous, k's dtype; written with L2NORM by the program holding
    the first value head of each group). grid = (chunks * HV / HPP,), heads fastest (programs of one key
    head run together: k hits L2). HPP (divides GROUP): value heads per program, sharing the chunk's k
    blocks and K K^T (kkt_heads_per_program).
    The chunk is NB = BT/16 blocks of 16 tokens; the k blocks [16, BK] are loaded (normalised) and the
    lower 16x16 blocks of K K^T formed by tl.dots, once; then per value head L = beta (K K^T) exp(G_i - G_j)
    (strictly lower) and
        A_ii = (I + L_ii)^-1                 (doubling; INV_ROWS: one row-substitution loop for all blocks)
        A_ij = -A_ii sum_{j <= m < i} L_im A_mj                  (block forward substitution)
    Switches: LOAD_G (G given, no cumsum, Gl = 0), STORE_G, DO_A (else only G); UPCAST: k tiles are
    converted to fp32 after the load (the backward's fp32 recompute of 16-bit k, without an fp32 copy).
    BETA_LOGITS (common._beta_of): beta holds logits; beta = sigmoid (x 2 for 2) is formed where it is loaded,
    here and in each later kernel that reads beta (nothing stored: the same fp32 formula in each).
    IN_ROWS (FlashInfer's paged prefill): k is read at the caller's rows (common._caller_rows, in_rows [N, 3]); g,
    beta and every output are in the kernel's rows.
    """
    pid = tl.program_id(0)
    i_c = pid // (HV // HPP)
    i_h0 = (pid % (HV // HPP)) * HPP                             # the program's first value head
    if IS_VARLEN:
        if tl.load(chunk_indices + i_c * 2) < 0:                 # a row of a device-built table past its last
            return                                               # chunk (common._Chunks.unchecked): no chunk
    i_b, i_t, bos, eos = _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    in_lo, in_hi, in_d = _in_rows_of_chunk(i_c, i_b, chunk_indices, in_rows, IN_ROWS, IS_VARLEN)   # (k's rows)
    t0 = bos + i_t * BT
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    i_hk = i_h0 // GROUP
    m_kn = m_k & ((o_k * 0 + i_h0 % GROUP) == 0)                 # kn columns this program stores

    # ---- the chunk's 16-token blocks: rows, k (normalised), and the lower blocks of K K^T --------
    r0 = t0 + o_c
    m0 = r0 < eos
    r1 = r0 + 16
    m1 = r1 < eos
    r2 = r0 + 32
    m2 = r2 < eos
    r3 = r0 + 48
    m3 = r3 < eos
    tok_r = (i_b * T + r0).to(tl.int64)                          # [16] flat token index of block 0's rows
    if DO_A:
        k_base = k + i_b * s_kb + i_hk * s_kh
        kn0 = (tok_r * H + i_hk) * K                             # [B, T, H, K] row offsets of kn
        k0 = _k_block(k_base, r0, m0, in_lo, in_hi, in_d, s_kt, o_k, m_k, kn, kn0, m_kn, L2NORM,
                      EPS, UPCAST, IN_ROWS)
        KK00 = _kk(k0, k0, PREC, DOT_F32)
        if BT >= 32:
            k1 = _k_block(k_base, r1, m1, in_lo, in_hi, in_d, s_kt, o_k, m_k, kn, kn0 + 16 * H * K, m_kn, L2NORM,
                          EPS, UPCAST, IN_ROWS)
            KK11 = _kk(k1, k1, PREC, DOT_F32)
            KK10 = _kk(k1, k0, PREC, DOT_F32)
        if BT >= 64:
            k2 = _k_block(k_base, r2, m2, in_lo, in_hi, in_d, s_kt, o_k, m_k, kn, kn0 + 32 * H * K, m_kn, L2NORM,
                          EPS, UPCAST, IN_ROWS)
            k3 = _k_block(k_base, r3, m3, in_lo, in_hi, in_d, s_kt, o_k, m_k, kn, kn0 + 48 * H * K, m_kn, L2NORM,
                          EPS, UPCAST, IN_ROWS)
            KK22 = _kk(k2, k2, PREC, DOT_F32)
            KK20 = _kk(k2, k0, PREC, DOT_F32)
            KK21 = _kk(k2, k1, PREC, DOT_F32)
            KK33 = _kk(k3, k3, PREC, DOT_F32)
            KK30 = _kk(k3, k0, PREC, DOT_F32)
            KK31 = _kk(k3, k1, PREC, DOT_F32)
            KK32 = _kk(k3, k2, PREC, DOT_F32)               # (k is dead from here)

    for j in range(HPP):
        i_h = i_h0 + j
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

        # ---- per 16-token block: G (cumsum, stored) and beta ------------------------------------
        tok0 = tok_r * HV + i_h                                  # [B, T, HV] flat index of (token, head)
        G0, Gl0, acc = _g_block(g_base, s_gt, r0, m0, G, Gl, tok0, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                STORE_G, THRESHOLD, PRECISE)
        if DO_A:
            b0 = _load_beta(b_base, r0, m0, s_bt, BETA_LOGITS, PRECISE)
        if BT >= 32:
            tok1 = tok0 + 16 * HV
            G1, Gl1, acc = _g_block(g_base, s_gt, r1, m1, G, Gl, tok1, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                    STORE_G, THRESHOLD, PRECISE)
            if DO_A:
                b1 = _load_beta(b_base, r1, m1, s_bt, BETA_LOGITS, PRECISE)
        if BT >= 64:
            tok2 = tok0 + 32 * HV
            G2, Gl2, acc = _g_block(g_base, s_gt, r2, m2, G, Gl, tok2, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                    STORE_G, THRESHOLD, PRECISE)
            tok3 = tok0 + 48 * HV
            G3, Gl3, acc = _g_block(g_base, s_gt, r3, m3, G, Gl, tok3, acc, A_log_h, dt_bias_h, GATE, LOAD_G,
                                    STORE_G, THRESHOLD, PRECISE)
            if DO_A:
                b2 = _load_beta(b_base, r2, m2, s_bt, BETA_LOGITS, PRECISE)
                b3 = _load_beta(b_base, r3, m3, s_bt, BETA_LOGITS, PRECISE)

        if DO_A:
            # ---- INV_ROWS: the diagonal blocks of L first, inverted together by one loop of row steps (their ILP)
            if INV_ROWS:
                L00 = _l_block(KK00, b0, G0, Gl0, G0, Gl0, m0, True, PRECISE)
                L11 = L00
                L22 = L00
                L33 = L00
                if BT >= 32:
                    L11 = _l_block(KK11, b1, G1, Gl1, G1, Gl1, m1, True, PRECISE)
                if BT >= 64:
                    L22 = _l_block(KK22, b2, G2, Gl2, G2, Gl2, m2, True, PRECISE)
                    L33 = _l_block(KK33, b3, G3, Gl3, G3, Gl3, m3, True, PRECISE)
                A00, A11, A22, A33 = _inv_diag_rows(L00, L11, L22, L33, BT // 16)
            zero = tl.zeros([16, 16], dtype=tl.float32)

            # ---- block row by block row: its diagonal block's inverse (doubling), its off-diagonal L blocks,
            # block forward substitution, its stores. Formed where used, each block row's L blocks die with it
            # (fewer live registers: no spills at 255 with l2norm; 4 % off the kernel, H200, B=4 T=4096, bf16,
            # RESULTS.md 2026-11-30)
            if not INV_ROWS:
                A00 = _diag_inverse(KK00, b0, G0, Gl0, m0, PRECISE, INV_DIAG_PREC)
            _store_a(A, tok0, m0, A00, 0, BT)
            if BT >= 32:
                _store_a(A, tok0, m0, zero, 1, BT)
                if not INV_ROWS:
                    A11 = _diag_inverse(KK11, b1, G1, Gl1, m1, PRECISE, INV_DIAG_PREC)
                L10 = _l_block(KK10, b1, G1, Gl1, G0, Gl0, m1, False, PRECISE)
                A10 = -_mm32(A11, _mm32(L10, A00, INV_PREC), INV_PREC)
                _store_a(A, tok1, m1, A10, 0, BT)
                _store_a(A, tok1, m1, A11, 1, BT)
            if BT >= 64:
                _store_a(A, tok0, m0, zero, 2, BT)
                _store_a(A, tok0, m0, zero, 3, BT)
                _store_a(A, tok1, m1, zero, 2, BT)
                _store_a(A, tok1, m1, zero, 3, BT)
                if not INV_ROWS:
                    A22 = _diag_inverse(KK22, b2, G2, Gl2, m2, PRECISE, INV_DIAG_PREC)
                L21 = _l_block(KK21, b2, G2, Gl2, G1, Gl1, m2, False, PRECISE)
                L20 = _l_block(KK20, b2, G2, Gl2, G0, Gl0, m2, False, PRECISE)
                A21 = -_mm32(A22, _mm32(L21, A11, INV_PREC), INV_PREC)
                A20 = -_mm32(A22, _mm32(L20, A00, INV_PREC) + _mm32(L21, A10, INV_PREC), INV_PREC)
                _store_a(A, tok2, m2, A20, 0, BT)
                _store_a(A, tok2, m2, A21, 1, BT)
                _store_a(A, tok2, m2, A22, 2, BT)
                _store_a(A, tok2, m2, zero, 3, BT)
                if not INV_ROWS:
                    A33 = _diag_inverse(KK33, b3, G3, Gl3, m3, PRECISE, INV_DIAG_PREC)
                L32 = _l_block(KK32, b3, G3, Gl3, G2, Gl2, m3, False, PRECISE)
                L31 = _l_block(KK31, b3, G3, Gl3, G1, Gl1, m3, False, PRECISE)
                L30 = _l_block(KK30, b3, G3, Gl3, G0, Gl0, m3, False, PRECISE)
                A32 = -_mm32(A33, _mm32(L32, A22, INV_PREC), INV_PREC)
                A31 = -_mm32(A33, _mm32(L31, A11, INV_PREC) + _mm32(L32, A21, INV_PREC), INV_PREC)
                A30 = -_mm32(A33, _mm32(L30, A00, INV_PREC) + _mm32(L31, A10, INV_PREC)
                             + _mm32(L32, A20, INV_PREC), INV_PREC)
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
    UPCAST: tl.constexpr, BETA_LOGITS: tl.constexpr = 0, DO_U: tl.constexpr = True,
):
    """Per (chunk, value head): w = A (beta exp(G) K) [BT, K], u = A (beta V) [BT, V] (DO_U; else w only).

    k: [B, T, H, K], v: [B, T, HV, V], beta: [B, T, HV] (strided, unit last-dim stride for k, v);
    G: [B, T, HV] fp32, A: [B, T, HV, BT] (zeros above the diagonal), w: [B, T, HV, K],
    u: [B, T, HV, V] (contiguous). A is rounded to k's dtype for the dots (it is stored so on the
    main path). exp(G) <= 1 (G: cumsum of g <= 0). grid = (chunks * HV,), head fastest. UPCAST: k and v
    tiles converted to fp32 after the load (the backward's fp32 recompute of 16-bit inputs). BETA_LOGITS: beta
    holds logits (common._beta_of).
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos, rows, m_r, tok = _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV, BT,
                                                     IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    m_rv = m_r[:, None] & (o_v < V)[None, :]

    b_beta = _load_beta(beta + i_b * s_bb + i_h * s_bh, rows, m_r, s_bt, BETA_LOGITS, PRECISE)
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_A = tl.load(A + tok[:, None] * BT + tl.arange(0, BT)[None, :], mask=m_r[:, None], other=0.0)
    b_k = tl.load(k + i_b * s_kb + (i_h // GROUP) * s_kh + rows.to(tl.int64)[:, None] * s_kt + o_k[None, :],
                  mask=m_rk, other=0.0)
    if DO_U:
        b_v = tl.load(v + i_b * s_vb + i_h * s_vh + rows.to(tl.int64)[:, None] * s_vt + o_v[None, :],
                      mask=m_rv, other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
        if DO_U:
            b_v = b_v.to(tl.float32)
    # dot operands in the tiles' dtype; the backward's split recompute ("bf16x2") keeps A as stored and the
    # scaled tiles in fp32 (_dot splits fp32 operands)
    b_kb = b_k.to(tl.float32) * (b_beta * _exp(b_G, PRECISE))[:, None]
    b_A = _operand(b_A, b_k.dtype, PREC)
    b_w = _dot(b_A, _operand(b_kb, b_k.dtype, PREC), PREC, DOT_F32)
    tl.store(w + tok[:, None] * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_rk)
    if DO_U:
        b_vb = b_v.to(tl.float32) * b_beta[:, None]
        b_u = _dot(_operand(b_A, b_v.dtype, PREC), _operand(b_vb, b_v.dtype, PREC), PREC, DOT_F32)
        tl.store(u + tok[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_rv)


# ============================================================================================
# host side: pinned configs, launchers, the stage twins chunk_cumsum, wy_repr, w_u
# ============================================================================================

def kkt_config(K: int) -> dict:
    """Kernel 1 (chunk_kkt_inv_kernel): one program per (chunk, value head), no loop to pipeline.
    One warp at K <= 128: the 16x16 blocks of L and A are small, and in one warp the layout changes
    between the 16x16 dots (and the row substitution's reductions) never leave the warp (H200,
    K = 128, BT = 64, bf16, rows inverse: 1 warp 0.76 ms, 2 warps 1.24, 4 warps 2.1; doubling with tf32
    products: 1 warp 0.58, 2 warps 0.98; with doubling, the bf16 default since 2026-11-26, at B=4 T=4096: 1 warp
    0.119, 2 warps 0.178, 4 warps 0.301; RESULTS.md, "Prefill and decode experiments of 2026-11-26"); 2 warps for
    the [16, 256] k blocks at K = 256 (register pressure)."""
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


def kkt_heads_per_program(GROUP: int, do_a: bool = True) -> int:
    """Kernel 1's value heads per program (HPP): 2 when a key head has an even number of value heads (GVA, as
    Qwen3-Next's 16 key / 32 value heads), so one program loads and normalises the chunk's k once and forms its
    K K^T blocks once for both heads, then builds and inverts each head's L; else 1. Without A (do_a False:
    the cumsum only) nothing is shared: 1. Kernel 1 alone, H200, Triton 3.6, bf16, Qwen3-Next shape (torch.profiler,
    2026-11-24), HPP 1 -> 2: B=4 T=4096 0.154 -> 0.134 ms, B=1 T=16384 0.152 -> 0.133, the 16-sequence varlen mix
    0.314 -> 0.269 (no spills either way at 255 registers; 2 warps 0.240 / 0.491 and a register cap of 128-200
    0.195-0.256 / 0.403-0.503 are slower: one warp's 16x16 blocks stay the pinned layout). The inverse and the
    stores, per head, are most of what is left (sharing halved the loads and dots: ~15 % of the kernel)."""
    return 2 if do_a and GROUP % 2 == 0 else 1


def _inv_rows(inv_method: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether kernel 1 inverts the diagonal blocks by rows (else by doubling): inv_method, by default doubling when
    interpreting and, on a GPU, for bf16 (dtype: the one whose INV_DIAG_PRECISION applies), rows for the others
    (fast.chunk.common's comment on the inverse: measured there)."""
    if inv_method not in (None, "rows", "doubling"):
        raise ValueError(f"inv_method must be None, 'rows' or 'doubling', got {inv_method!r}")
    if inv_method is None:
        inv_method = "doubling" if is_interpreting() or dtype == torch.bfloat16 else "rows"
    return inv_method == "rows"


def _launch_kkt(k, g, beta, A_log, dt_bias, G, Gl, A, kn, ch: _Chunks, T: int, HV: int, BT: int, *,
                l2norm: bool, load_g: bool, store_g: bool, do_a: bool, precise: bool, prec_of=None,
                cfg_over: Optional[dict] = None, configs: Optional[dict] = None, inv_method: Optional[str] = None,
                beta_logits: int = 0, in_rows: Optional[torch.Tensor] = None):
    """Kernel 1. k: [B, T, H, K] (a dummy when not do_a); kn: [B, T, H, K] or None (without l2norm);
    beta_logits 1 / 2: beta holds logits, beta = sigmoid (x 2) formed in the kernel (its BETA_LOGITS);
    Gl: G's rounding error [B, T, HV] fp32, written when precise and store_g (else may be None).
    prec_of: None, or (dot input_precision, dtype whose INV_PRECISION / INV_DIAG_PRECISION apply) for
    the backward's fp32 recompute of 16-bit inputs (also taken by _launch_w_u / _launch_state; kernels 1
    and 2 then convert their k / v tiles to fp32 themselves, so k and v may stay 16-bit);
    cfg_over: keys merged over the pinned config (the fp32 recompute takes 2 warps); configs, inv_method:
    benchmark knobs (module comment). in_rows: int32 [N, 3], k in the caller's rows (the kernel's IN_ROWS)."""
    H, K = k.shape[2], k.shape[3]
    BK, _ = _blocks(K, 16)
    if ch.total == 0 or HV == 0:
        return
    cfg = _cfg("kkt", dict(kkt_config(K), **(cfg_over or {})), configs)
    HPP = cfg.pop("HPP", kkt_heads_per_program(HV // H, do_a))          # a benchmark may set it (1: unshared)
    # the doubling's product precision (a benchmark may set it: benchmarks.bench_prefill.inverse_sweep)
    pdt = k.dtype if prec_of is None else prec_of[1]                    # the dtype whose inverse settings apply
    inv_diag_prec = cfg.pop("INV_DIAG_PREC", INV_DIAG_PRECISION[pdt])
    kw = dict(
        H=H, HV=HV, GROUP=HV // H, K=K, BT=BT, BK=BK,
        IS_VARLEN=ch.varlen, GATE=A_log is not None, L2NORM=l2norm,
        LOAD_G=load_g, STORE_G=store_g, DO_A=do_a, HPP=HPP,
        PREC=_fp32_prec(k.dtype) if prec_of is None else prec_of[0],
        INV_PREC=INV_PRECISION[pdt],
        INV_DIAG_PREC=inv_diag_prec,
        INV_ROWS=_inv_rows(inv_method, pdt), DOT_F32=is_interpreting(), UPCAST=_upcast(prec_of),
        PRECISE=precise, THRESHOLD=SOFTPLUS_THRESHOLD, EPS=L2NORM_EPS, BETA_LOGITS=beta_logits,
        IN_ROWS=in_rows is not None, **cfg)
    return launch(chunk_kkt_inv_kernel, (ch.total * HV // HPP,), kw,
        k, g, beta, A_log, dt_bias, G, G if Gl is None else Gl, A, kn,
        ch.cu_seqlens, ch.indices, in_rows, T, ch.NT,
        *k.stride()[:3], *g.stride(), *beta.stride())


def _launch_w_u(k, v, beta, G, A, w, u, ch: _Chunks, T: int, BT: int, *, precise: bool, prec_of=None,
                configs: Optional[dict] = None, beta_logits: int = 0):
    """Kernel 2. k: [B, T, H, K] (normalised already when asked), A: [B, T, HV, BT]; beta_logits as _launch_kkt's.
    u None: w only (the backward's recompute, whose state pass forms v_new from A)."""
    H, K = k.shape[2], k.shape[3]
    HV, V = v.shape[2], v.shape[3]
    BK, BV = _blocks(K, V)
    if ch.total == 0 or HV == 0:
        return
    kw = dict(
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, PREC=_fp32_prec(k.dtype) if prec_of is None else prec_of[0], DOT_F32=is_interpreting(),
        PRECISE=precise, UPCAST=_upcast(prec_of),
        BETA_LOGITS=beta_logits, DO_U=u is not None, **_cfg("w_u", w_u_config(K, V), configs))
    return launch(chunk_w_u_kernel, (ch.total * HV,), kw,
        k, v, beta, G, A, w, w if u is None else u,
        ch.cu_seqlens, ch.indices, T, ch.NT,
        *k.stride()[:3], *v.stride()[:3], *beta.stride())


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
