"""Triton backward of the causal depthwise conv1d (refgdn.conv_bwd.causal_conv1d_bwd's twin).

    x: [B, T, D]   weight: [D, W]   bias: [D]   initial_state: [N, D, W-1]   dy: [B, T, D]
    y_t = act(bias + sum_{j} weight[:, j] x_{t-W+1+j})       dz = dy * act'(z) (z: the pre-activation)

    dx_t = sum_{k=0}^{W-1} weight[:, W-1-k] dz_{t+k}   (+ dfinal where x_t is one of the last W-1 inputs)
    dweight[:, j] = sum_t dz_t x_{t-W+1+j} ;  dbias = sum_t dz_t ;  dinitial_state: dx of positions < 0

What is saved and why: the forward saves only its inputs (x, weight, bias, initial_state); z is
recomputed here (W multiply-adds per element, from rows the tile reads anyway) instead of storing a
[B, T, D] pre-activation.

Two forms, as the forward's (fast.conv):
- W <= 4 (every GDN model) on a GPU: ``conv_bwd_window_kernel``, one pass. A program owns BT rows x BD channels of one
  sequence and walks them row by row (4 per step), keeping the last W-1 inputs and the last W-1 dz values in
  registers: dz_t is formed once, used at once for the dx row it completes (t-(W-1)) and for the block's partial
  sums of dweight and dbias, and never stored. Each x and dy row is read once per block (plus the W-1 rows after
  the block, whose dz completes its last dx rows) and each dx row written once: 6 bytes per element at bf16, a
  streaming op. H200, T = 16384, D = 8192, bf16: 0.278 ms, 0.685 of copy bandwidth (the two passes 1.148, fla
  0.6.0's backward 1.002; conv_bwd_config).
- W > 4, the interpreter (conv_bwd_config says why) and on request, two passes over tiles of BT rows x BD channels of
  one sequence:
  1. ``conv_bwd_dz_kernel``: dz on the tile's rows (z recomputed once per element), stored to a
     [B, T, D] buffer in the compute dtype (fp32), and per-tile partial sums of dweight and dbias;
  2. ``conv_bwd_dx_kernel``: dx from W shifted reads of dz (they hit L1/L2); the first tile of a
     sequence also writes dinitial_state.
  Why two there: dx_t needs dz at t .. t+W-1, and a Triton tile cannot shift its rows in registers (the window
  kernel's named registers stop at W-1 = 3); the earlier one-pass tile form recomputed dz W times per element (W^2
  shifted x reads and W sigmoids per element: 3.2 ms against fla's ~1.0 ms at T = 16384, D = 8192 on an H100).
Both forms compute dz and dx by the same expressions in the same order, so dx and dinitial_state are the same bits
(tests/test_fast_grad.py holds them to it); the partial sums of dweight and dbias ([blocks, W, D] in the compute
dtype, summed on the host: a deterministic reduction, no atomics) add their rows in different orders.
Pinned configs, no autotune.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from refgdn.checks import one_host_read

from .launch import launch
from .conv import WINDOW_MAX_W, _window_load4, _window_start
from .utils import cdiv, is_interpreting, next_pow2, varlen_chunk_tables


@triton.jit
def _sigmoid(z):
    e = tl.exp(-tl.abs(z))                      # exp of -|z| <= 0 only: no overflow
    r = 1 / (1 + e)
    return tl.where(z >= 0, r, e * r)


@triton.jit
def _load_in(x_base, initial_state, s_off, pos, L, o_d, m_d, stride_x_t, stride_x_d, stride_s_d, stride_s_w,
             W: tl.constexpr, HAS_INIT: tl.constexpr, DT: tl.constexpr):
    """Inputs at positions pos ([R] int64, any value) -> [R, BD] in DT: x for 0 <= pos < L,
    initial_state column W-1+pos for -(W-1) <= pos < 0, zero elsewhere."""
    m_x = (pos >= 0) & (pos < L)
    b = tl.load(x_base + pos[:, None] * stride_x_t + o_d[None, :] * stride_x_d,
                mask=m_x[:, None] & m_d[None, :], other=0).to(DT)
    if HAS_INIT:
        m_s = (pos < 0) & (pos >= -(W - 1))
        b += tl.load(initial_state + s_off + (pos + (W - 1))[:, None] * stride_s_w + o_d[None, :] * stride_s_d,
                     mask=m_s[:, None] & m_d[None, :], other=0).to(DT)
    return b


@triton.jit
def _dz(x_base, dy_base, weight, bias, initial_state, s_off, rows, L, o_d, m_d,
        stride_x_t, stride_x_d, stride_dy_t, stride_w_d, stride_w_w, stride_s_d, stride_s_w,
        W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, DT: tl.constexpr):
    """dz at rows ([R] int64): dy * act'(z), zero outside [0, L)."""
    m_r = (rows >= 0) & (rows < L)
    b_dy = tl.load(dy_base + rows[:, None] * stride_dy_t + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                   other=0).to(DT)
    if SILU:
        z = tl.zeros(b_dy.shape, dtype=DT)
        for j in tl.static_range(W):
            wj = tl.load(weight + o_d * stride_w_d + j * stride_w_w, mask=m_d, other=0).to(DT)
            z += wj[None, :] * _load_in(x_base, initial_state, s_off, rows - (W - 1) + j, L, o_d, m_d,
                                        stride_x_t, stride_x_d, stride_s_d, stride_s_w, W, HAS_INIT, DT)
        if HAS_BIAS:
            z += tl.load(bias + o_d, mask=m_d, other=0).to(DT)[None, :]
        s = _sigmoid(z)
        b_dy = b_dy * (s * (1 + z * (1 - s)))                 # silu'(z)
    return b_dy


@triton.jit
def _tile_coords(cu_seqlens, tile_table, i_t, i_b, T, stride_x_b, stride_x_t, stride_dy_b, stride_dy_t, D,
                 IS_VARLEN: tl.constexpr):
    """Tile i_t of batch row i_b (dense) or row i_t of tile_table (varlen) -> (sequence n, tile within it,
    length L, x / dy offsets of its first token, offset of its first token in the contiguous [., T, D]
    buffers dz and dx, partial-sum row)."""
    if IS_VARLEN:
        i_n = tl.load(tile_table + i_t * 2).to(tl.int64)
        i_tt = tl.load(tile_table + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        return i_n, i_tt, L, bos * stride_x_t, bos * stride_dy_t, bos * D, i_t.to(tl.int64)
    else:
        i_n = i_b.to(tl.int64)
        return (i_n, i_t.to(tl.int64), (T + i_n * 0).to(tl.int64), i_n * stride_x_b, i_n * stride_dy_b,
                i_n * T * D, i_n * tl.num_programs(1) + i_t)


@triton.jit(do_not_specialize=["T"])
def conv_bwd_dz_kernel(
    x, dy, weight, bias, initial_state, cu_seqlens, tile_table,
    dz, dw_part, db_part,
    T, D,
    stride_x_b, stride_x_t, stride_x_d, stride_dy_b, stride_dy_t,
    stride_w_d, stride_w_w, stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
    FP64: tl.constexpr,
):
    """Pass 1: dz = dy * act'(z) on this tile's rows (z recomputed from W shifted x rows), stored to dz,
    and the tile's partial sums dweight[:, j] = sum_t dz_t x_{t-W+1+j}, dbias = sum_t dz_t.

    grid = (cdiv(D, BD), tiles, B). x: [B, T, D] (any strides); dy: [B, T, D] (unit channel stride);
    dz: [B, T, D] contiguous, compute dtype; dw_part: [B * tiles, W, D], db_part: [B * tiles, D]."""
    if FP64:
        DT: tl.constexpr = tl.float64
    else:
        DT: tl.constexpr = tl.float32
    i_d = tl.program_id(0)
    i_n, i_tt, L, x_off, dy_off, o_off, i_part = _tile_coords(
        cu_seqlens, tile_table, tl.program_id(1), tl.program_id(2), T, stride_x_b, stride_x_t,
        stride_dy_b, stride_dy_t, D, IS_VARLEN)
    x_base = x + x_off
    s_off = i_n * stride_s_n
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = i_tt * BT + tl.arange(0, BT).to(tl.int64)
    m_r = rows < L
    b_dz = _dz(x_base, dy + dy_off, weight, bias, initial_state, s_off, rows, L, o_d, m_d,
               stride_x_t, stride_x_d, stride_dy_t, stride_w_d, stride_w_w, stride_s_d, stride_s_w,
               W, SILU, HAS_BIAS, HAS_INIT, DT)                     # 0 on rows >= L
    tl.store(dz + o_off + rows[:, None] * D + o_d[None, :], b_dz, mask=m_r[:, None] & m_d[None, :])
    if HAS_BIAS:
        tl.store(db_part + i_part * D + o_d, tl.sum(b_dz, 0), mask=m_d)
    for j in tl.static_range(W):
        xin = _load_in(x_base, initial_state, s_off, rows - (W - 1) + j, L, o_d, m_d,
                       stride_x_t, stride_x_d, stride_s_d, stride_s_w, W, HAS_INIT, DT)
        tl.store(dw_part + (i_part * W + j) * D + o_d, tl.sum(b_dz * xin, 0), mask=m_d)


@triton.jit
def _dx_rows(dz_base, weight, pos, L, D, o_d, m_d, stride_w_d, stride_w_w, W: tl.constexpr, DT: tl.constexpr):
    """[R, BD]: sum_k weight[:, W-1-k] dz_{pos+k} at positions pos ([R] int64, any value; dz counts as 0
    outside [0, L)), accumulated over k = 0 .. W-1 in order."""
    acc = tl.zeros([pos.shape[0], o_d.shape[0]], dtype=DT)
    for kk in tl.static_range(W):
        r = pos + kk
        m = (r >= 0) & (r < L)
        b_dz = tl.load(dz_base + r[:, None] * D + o_d[None, :], mask=m[:, None] & m_d[None, :], other=0).to(DT)
        wk = tl.load(weight + o_d * stride_w_d + (W - 1 - kk) * stride_w_w, mask=m_d, other=0).to(DT)
        acc += wk[None, :] * b_dz
    return acc


@triton.jit
def _dfinal_rows(acc, dfinal, i_n, pos, L, D, o_d, m_d, m_p, W: tl.constexpr, DT: tl.constexpr):
    """acc + dfinal where x at pos is one of the last W-1 inputs: final_state[:, i] = x_{L-(W-1)+i}."""
    col = pos - L + (W - 1)
    m_f = m_p & (col >= 0)
    return acc + tl.load(dfinal + i_n * D * (W - 1) + o_d[None, :] * (W - 1) + col[:, None],
                         mask=m_f[:, None] & m_d[None, :], other=0).to(DT)


@triton.jit(do_not_specialize=["T"])
def conv_bwd_dx_kernel(
    dz, weight, dfinal, cu_seqlens, tile_table, dx, dinit,
    T, D, stride_w_d, stride_w_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, FP64: tl.constexpr,
):
    """Pass 2: dx_t = sum_k weight[:, W-1-k] dz_{t+k} (+ dfinal on the last W-1 inputs) on this tile's
    rows; the first tile of a sequence also writes dinitial_state (positions -(W-1) .. -1).

    grid = (cdiv(D, BD), tiles, B). dz: [B, T, D] contiguous (pass 1's); dx: [B, T, D] contiguous;
    dfinal, dinit: [N, D, W-1] contiguous. BW = next_pow2(W - 1) rows for dinit."""
    if FP64:
        DT: tl.constexpr = tl.float64
    else:
        DT: tl.constexpr = tl.float32
    i_d = tl.program_id(0)
    i_n, i_tt, L, x_off, dy_off, o_off, i_part = _tile_coords(
        cu_seqlens, tile_table, tl.program_id(1), tl.program_id(2), T, 0, 0, 0, 0, D, IS_VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = i_tt * BT + tl.arange(0, BT).to(tl.int64)
    m_r = rows < L
    b_dx = _dx_rows(dz + o_off, weight, rows, L, D, o_d, m_d, stride_w_d, stride_w_w, W, DT)
    if HAS_DFINAL:
        b_dx = _dfinal_rows(b_dx, dfinal, i_n, rows, L, D, o_d, m_d, m_r, W, DT)
    tl.store(dx + o_off + rows[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    if HAS_INIT:
        if i_tt == 0:
            o_w = tl.arange(0, BW)
            pos = o_w.to(tl.int64) - (W - 1)
            m_p = o_w < W - 1
            # (names distinct from the block above: a runtime branch may not change a variable's shape)
            b_di = _dx_rows(dz + o_off, weight, pos, L, D, o_d, m_d, stride_w_d, stride_w_w, W, DT)
            if HAS_DFINAL:                                # a sequence shorter than W-1 keeps initial inputs
                b_di = _dfinal_rows(b_di, dfinal, i_n, pos, L, D, o_d, m_d, m_p, W, DT)
            tl.store(dinit + i_n * D * (W - 1) + o_d[None, :] * (W - 1) + (pos + (W - 1))[:, None],
                     b_di.to(dinit.dtype.element_ty), mask=m_p[:, None] & m_d[None, :])


@triton.jit
def _dz_row(e, x0, p1, p2, p3, w0, w1, w2, w3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr):
    """dz at one row from its dy (e, in DT) and its inputs x0 = x_t, p_k = x_{t-k}: dy * act'(z), z recomputed
    in the two-pass form's order (_dz: weight column 0, the oldest input, first; then the bias), so dz is the same
    bits. w_k = weight[:, W-1-k]; taps k >= W are absent (constexpr)."""
    if SILU:
        z = tl.zeros(e.shape, dtype=e.dtype)
        if W > 3:
            z += w3 * p3
        if W > 2:
            z += w2 * p2
        if W > 1:
            z += w1 * p1
        z += w0 * x0
        if HAS_BIAS:
            z += b
        s = _sigmoid(z)
        e = e * (s * (1 + z * (1 - s)))                   # silu'(z)
    return e


@triton.jit
def _dx_row(d0, q1, q2, q3, w0, w1, w2, w3, W: tl.constexpr):
    """dx at position p = t-(W-1) from the newest dz_t = d0 and the window q_k = dz_{t-k}:
    sum_kk weight[:, W-1-kk] dz_{p+kk} = sum_kk w_kk dz_{p+kk}, kk = 0 .. W-1 in order (_dx_rows' order: the
    same bits)."""
    acc = tl.zeros(d0.shape, dtype=d0.dtype)
    if W == 4:
        acc += w0 * q3
        acc += w1 * q2
        acc += w2 * q1
        acc += w3 * d0
    elif W == 3:
        acc += w0 * q2
        acc += w1 * q1
        acc += w2 * d0
    elif W == 2:
        acc += w0 * q1
        acc += w1 * d0
    else:
        acc += w0 * d0
    return acc


@triton.jit
def _dx_row_store(acc, dx_row, dinit_row, dfinal_row, lj, n_d, o_d, m_d, first_d,
                  W: tl.constexpr, BT: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr):
    """Store dx at one position p: acc = its sum over dz, lj = p - t0 (the block-local index, int32 [BD]; may be
    negative), n_d = L - t0 (the sequence's rows from the block's first, int32 [BD]). Adds dfinal where x_p is one
    of the sequence's last W-1 inputs (column p - L + W-1 of dfinal_row, [D, W-1]); stores into dx_row (p's row of
    dx; its pointer is only dereferenced where stored) for 0 <= lj < BT and p < L, and into dinit_row ([D, W-1],
    column W-1+p) for p < 0 in the block that starts the sequence (first_d)."""
    if HAS_DFINAL:
        col = lj - n_d + (W - 1)                         # p - L + W-1
        acc += tl.load(dfinal_row + o_d * (W - 1) + col, mask=m_d & (col >= 0) & (lj < n_d), other=0).to(acc.dtype)
    tl.store(dx_row + o_d, acc.to(dx_row.dtype.element_ty), mask=m_d & (lj >= 0) & (lj < BT) & (lj < n_d))
    if HAS_INIT:
        tl.store(dinit_row + o_d * (W - 1) + (lj + (W - 1)), acc.to(dinit_row.dtype.element_ty),
                 mask=m_d & first_d & (lj < 0))


@triton.jit(do_not_specialize=["T"])
def conv_bwd_window_kernel(
    x, dy, weight, bias, initial_state, dfinal, cu_seqlens, tile_table,
    dx, dinit, dw_part, db_part,
    T, D,
    stride_x_b, stride_x_t, stride_x_d, stride_dy_b, stride_dy_t,
    stride_w_d, stride_w_w, stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
    IS_VARLEN: tl.constexpr, FP64: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """The whole backward in one pass, for W <= 4: dx, dinitial_state and the block's partial sums of dweight and
    dbias on BT rows x BD channels of one sequence, with no dz buffer.

    grid = (cdiv(D, BD), blocks, B) as the two-pass kernels' (_tile_coords). x: [B, T, D] (any strides); dy:
    [B, T, D] (unit channel stride); dx: [B, T, D] contiguous; dfinal, dinit: [N, D, W-1] contiguous; dw_part:
    [B * blocks, W, D], db_part: [B * blocks, D], every element written. BT: a multiple of 4.

        dz_t = dy_t act'(z_t) ;  dx_p = sum_kk w_kk dz_{p+kk} ;  dweight[:, W-1-k] += dz_t x_{t-k} ;  dbias += dz_t

    The block walks rows t0 .. t0+BT+W-2 (the W-1 rows after it are the next block's: their dz completes its last
    dx rows) as the forward's window kernel walks its rows: 4 rows per step, every x and dy row loaded once per block
    (PREFETCH: the next 4 rows' loads issued before this step's math), the last W-1 inputs (p1..p3) and dz values
    (q1..q3) kept in registers. So dz never goes through memory: the two-pass form wrote and re-read it in float32
    (8 of its 14 bytes per element at bf16). dz and dx are the two-pass form's bits (same expressions, same order);
    dweight and dbias sum their rows in another order (sequentially per block, not tl.sum over a tile)."""
    if FP64:
        DT: tl.constexpr = tl.float64
    else:
        DT: tl.constexpr = tl.float32
    i_d = tl.program_id(0)
    i_n, i_tt, L, x_off, dy_off, o_off, i_part = _tile_coords(
        cu_seqlens, tile_table, tl.program_id(1), tl.program_id(2), T, stride_x_b, stride_x_t,
        stride_dy_b, stride_dy_t, D, IS_VARLEN)
    x_base = x + x_off
    dy_base = dy + dy_off
    dx_base = dx + o_off
    t0 = i_tt * BT                                        # the block's first row (int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_x = o_d * stride_x_d
    p_s = o_d * stride_s_d
    s_off = i_n * stride_s_n
    # row conditions as [BD] vectors (the forward's window kernel says why)
    zero_d = tl.zeros([BD], dtype=tl.int64)
    zero_i = tl.zeros([BD], dtype=tl.int32)
    n_d = (L - t0).to(tl.int32) + zero_i                  # the sequence's rows from t0 (the halo rows included)
    first_d = (zero_d + t0) == 0
    dinit_row = dinit + i_n * D * (W - 1)
    dfinal_row = dfinal + i_n * D * (W - 1)

    # taps w_k (weight column W-1-k, multiplying x_{t-k}) and the halo p_k = x_{t0-k}, as the forward's
    w0, w1, w2, w3, p1, p2, p3 = _window_start(weight, o_d, m_d, stride_w_d, stride_w_w, x_base, p_x, initial_state,
                                               s_off, p_s, t0, L, m_d, zero_d, stride_x_t, stride_s_w,
                                               W, HAS_INIT, DT)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0).to(DT)
    else:
        b = w0  # unused
    # dz before the block: only its dx rows (the previous block's) or positions < 0 (where dz is 0) read it
    q1 = tl.zeros([BD], dtype=DT)
    q2 = tl.zeros([BD], dtype=DT)
    q3 = tl.zeros([BD], dtype=DT)
    # partial sums over the block's own rows: g_k = sum_t dz_t x_{t-k} (dweight column W-1-k), gb = sum_t dz_t
    g0 = tl.zeros([BD], dtype=DT)
    g1 = tl.zeros([BD], dtype=DT)
    g2 = tl.zeros([BD], dtype=DT)
    g3 = tl.zeros([BD], dtype=DT)
    gb = tl.zeros([BD], dtype=DT)

    if PREFETCH:
        n0, n1, n2, n3 = _window_load4(x_base, p_x, t0, stride_x_t, zero_i, n_d, m_d)
        f0, f1, f2, f3 = _window_load4(dy_base, o_d, t0, stride_dy_t, zero_i, n_d, m_d)
    for i in range(0, BT + W - 1, 4):
        r = t0 + i                                        # int64 row of x0 / e0
        j_d = zero_i + i                                  # its block-local index, [BD]
        if PREFETCH:
            x0, x1, x2, x3 = n0, n1, n2, n3
            e0, e1, e2, e3 = f0, f1, f2, f3
            n0, n1, n2, n3 = _window_load4(x_base, p_x, r + 4, stride_x_t, j_d + 4, n_d, m_d)
            f0, f1, f2, f3 = _window_load4(dy_base, o_d, r + 4, stride_dy_t, j_d + 4, n_d, m_d)
        else:
            x0, x1, x2, x3 = _window_load4(x_base, p_x, r, stride_x_t, j_d, n_d, m_d)
            e0, e1, e2, e3 = _window_load4(dy_base, o_d, r, stride_dy_t, j_d, n_d, m_d)
        x0 = x0.to(DT)
        x1 = x1.to(DT)
        x2 = x2.to(DT)
        x3 = x3.to(DT)
        # dz of the 4 rows (0 past the sequence: dy loads as 0 there)
        d0 = _dz_row(e0.to(DT), x0, p1, p2, p3, w0, w1, w2, w3, b, W, SILU, HAS_BIAS)
        d1 = _dz_row(e1.to(DT), x1, x0, p1, p2, w0, w1, w2, w3, b, W, SILU, HAS_BIAS)
        d2 = _dz_row(e2.to(DT), x2, x1, x0, p1, w0, w1, w2, w3, b, W, SILU, HAS_BIAS)
        d3 = _dz_row(e3.to(DT), x3, x2, x1, x0, w0, w1, w2, w3, b, W, SILU, HAS_BIAS)
        # the dx rows these complete: positions r+j-(W-1)
        a0 = _dx_row(d0, q1, q2, q3, w0, w1, w2, w3, W)
        a1 = _dx_row(d1, d0, q1, q2, w0, w1, w2, w3, W)
        a2 = _dx_row(d2, d1, d0, q1, w0, w1, w2, w3, W)
        a3 = _dx_row(d3, d2, d1, d0, w0, w1, w2, w3, W)
        row0 = dx_base + (r - (W - 1)) * D
        _dx_row_store(a0, row0, dinit_row, dfinal_row, j_d - (W - 1), n_d, o_d, m_d, first_d,
                      W, BT, HAS_INIT, HAS_DFINAL)
        _dx_row_store(a1, row0 + D, dinit_row, dfinal_row, j_d + 1 - (W - 1), n_d, o_d, m_d, first_d,
                      W, BT, HAS_INIT, HAS_DFINAL)
        _dx_row_store(a2, row0 + 2 * D, dinit_row, dfinal_row, j_d + 2 - (W - 1), n_d, o_d, m_d, first_d,
                      W, BT, HAS_INIT, HAS_DFINAL)
        _dx_row_store(a3, row0 + 3 * D, dinit_row, dfinal_row, j_d + 3 - (W - 1), n_d, o_d, m_d, first_d,
                      W, BT, HAS_INIT, HAS_DFINAL)
        # the partial sums take the block's own rows only (the halo rows after it are the next block's; dz is 0
        # past the sequence)
        m0 = tl.where(j_d < BT, d0, 0.0)
        m1 = tl.where(j_d + 1 < BT, d1, 0.0)
        m2 = tl.where(j_d + 2 < BT, d2, 0.0)
        m3 = tl.where(j_d + 3 < BT, d3, 0.0)
        gb += m0 + m1 + m2 + m3
        g0 += m0 * x0 + m1 * x1 + m2 * x2 + m3 * x3
        if W > 1:
            g1 += m0 * p1 + m1 * x0 + m2 * x1 + m3 * x2
        if W > 2:
            g2 += m0 * p2 + m1 * p1 + m2 * x0 + m3 * x1
        if W > 3:
            g3 += m0 * p3 + m1 * p2 + m2 * p1 + m3 * x0
        p1, p2, p3 = x3, x2, x1
        q1, q2, q3 = d3, d2, d1
    tl.store(dw_part + (i_part * W + (W - 1)) * D + o_d, g0, mask=m_d)
    if W > 1:
        tl.store(dw_part + (i_part * W + (W - 2)) * D + o_d, g1, mask=m_d)
    if W > 2:
        tl.store(dw_part + (i_part * W + (W - 3)) * D + o_d, g2, mask=m_d)
    if W > 3:
        tl.store(dw_part + (i_part * W + (W - 4)) * D + o_d, g3, mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + i_part * D + o_d, gb, mask=m_d)


def conv_bwd_config(T: int, D: int, W: int = 4) -> dict:
    """Pinned launch configs: {"kernel": "window" (W <= 4 on a GPU, the default there) or "two_pass", "window": {BT,
    BD, num_warps, PREFETCH}, "dz": {BT, BD, num_warps}, "dx": {...}}; small tiles and the two passes in the
    interpreter. Never autotuned.

    window (conv_bwd_window_kernel, one pass): 4 warps, BD 512 (4 channels per thread, 8 B vectors of bf16), BT 128
    rows per block (the W-1 halo rows re-read, 2 %, hit L2), PREFETCH. H200, Triton 3.6, T = 16384, D = 8192, W = 4,
    silu, bf16, the backward alone (bench_train --only conv_sweep, 2026-11-30), ms: BT 128 BD 512 0.278 (6 bytes
    per element: 0.685 of copy bandwidth; no PREFETCH 0.299), BT 64 0.293, BT 32 0.324; BD 256 0.297-0.346, BD 1024
    0.294-0.457 (8 warps there 0.308-0.453); the two passes 1.148, fla 0.6.0's backward 1.002.

    two_pass (W > 4): the passes exchange dz through memory, so their tilings are independent (pass 1's BT
    sets the number of dweight / dbias partial rows). Measured on an H100 (Triton 3.6, T = 16384, D = 8192,
    W = 4, silu, bf16; bench_train --only conv_sweep, both passes): pass 1 at BT 64 x BD 128, 4 warps 1.34 ms
    total (8 warps 2.08; BT 32 x BD 128 at 8 warps 2.29), pass 2 at BT 32 x BD 128, 4 warps (-0.15 ms
    against 8 warps). Triton 3.9 (compiled for sm_90, not timed) spills pass 1 at this tile (2.4 KB per
    thread: every element of a tile carries a 64-bit pointer); 8 warps do not spill there but ran slower
    on Triton 3.6."""
    # the interpreter takes the two passes: its cost is per operation, and the window kernel's row walk runs ~2x the
    # two passes' there (the CI matrix's conv gradients: 33.5 s against 15.1 s); on the CPU the window kernel is held
    # by its own tests to the two passes' bits (dx, dinitial_state) and to the conformance rule (dweight, dbias)
    kernel = "window" if W <= WINDOW_MAX_W and not is_interpreting() else "two_pass"
    if is_interpreting():
        t = dict(BT=max(4, min(32, next_pow2(T))), BD=max(16, min(64, next_pow2(D))), num_warps=4)
        return {"kernel": kernel, "window": dict(t, BT=max(4, min(16, next_pow2(T))), PREFETCH=True), "dz": t,
                "dx": dict(t)}
    BD = max(16, min(128, next_pow2(D)))
    return {"kernel": kernel, "window": dict(BT=128, BD=max(16, min(512, next_pow2(D))), num_warps=4, PREFETCH=True),
            "dz": dict(BT=64, BD=BD, num_warps=4), "dx": dict(BT=32, BD=BD, num_warps=4)}


@one_host_read   # cu_seqlens read to the host once per call (value check + varlen tables)
def causal_conv1d_bwd(x, weight, dy, bias=None, activation=None, initial_state=None, cu_seqlens=None,
                      dfinal=None, *, configs: Optional[dict] = None):
    """x: [B, T, D], weight: [D, W], dy: [B, T, D], bias: [D], initial_state, dfinal: [N, D, W-1]
    -> (dx [B, T, D] x.dtype, dweight [D, W] weight.dtype, dbias [D] or None, dinitial_state [N, D, W-1] or None).

        dz = dy * act'(z) ;  dx_t = sum_k weight[:, W-1-k] dz_{t+k} ;  dweight[:, j] = sum_t dz_t x_{t-W+1+j} ;
        dbias = sum_t dz_t

    refgdn.conv_bwd.causal_conv1d_bwd's twin. Inputs are assumed validated (the forward did).
    configs: benchmark overrides merged over conv_bwd_config's ({"kernel": "two_pass"} picks the two passes at
    W <= 4; {"window": {...}, "dz": {...}, "dx": {...}} the tiles; None in use).
    """
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (x, weight, initial_state))
    cdt = torch.float64 if fp64 else torch.float32
    base = conv_bwd_config(T, D, W)
    cfg = {p: dict(base[p], **(configs or {}).get(p, {})) for p in ("window", "dz", "dx")}
    window = (configs or {}).get("kernel", base["kernel"]) == "window"
    if window and W > WINDOW_MAX_W:
        raise ValueError(f"conv_bwd: the window kernel takes W <= {WINDOW_MAX_W}, got W = {W}")
    tables = {}

    def tiles(BT):
        """(tile_table or None, tile count, the offsets the kernels read) for tiles of BT rows (varlen: the
        host read of cu_seqlens, one per call, and the checked copy uploaded with the table)."""
        if BT not in tables:
            if cu_seqlens is not None:
                t = varlen_chunk_tables(cu_seqlens, BT)                  # host read (eager only)
                tables[BT] = (t.indices, t.indices.shape[0], t.checked)
            else:
                tables[BT] = (None, cdiv(T, BT), None)
        return tables[BT]

    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    table_z, n_z, cu_z = tiles(cfg["window" if window else "dz"]["BT"])
    n_part = (B if cu_seqlens is None else 1) * n_z
    # no fill: either form's kernel writes every partial row of its blocks (db_part's with a bias, when it is summed)
    dw_part = torch.empty(n_part, W, D, dtype=cdt, device=x.device)
    db_part = torch.empty(n_part, D, dtype=cdt, device=x.device)
    dinit = torch.zeros(N, D, W - 1, dtype=initial_state.dtype, device=x.device) if initial_state is not None else None
    dfinal = dfinal.contiguous() if (dfinal is not None and W > 1) else None
    s = initial_state.stride() if initial_state is not None else (0, 0, 0)
    flags = dict(W=W, IS_VARLEN=cu_seqlens is not None, FP64=fp64, HAS_INIT=initial_state is not None)
    Bg = B if cu_seqlens is None else 1
    if window and n_z > 0 and D > 0:
        c = cfg["window"]
        launch(conv_bwd_window_kernel, (cdiv(D, c["BD"]), n_z, Bg),
               dict(BT=c["BT"], BD=c["BD"], SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None,
                    HAS_DFINAL=dfinal is not None, PREFETCH=bool(c.get("PREFETCH", False)),
                    num_warps=c["num_warps"], **flags),
               x, dy, weight, bias, initial_state, dfinal if dfinal is not None else dx, cu_z, table_z,
               dx, dinit if dinit is not None else dx, dw_part, db_part,
               T, D, *x.stride(), dy.stride(0), dy.stride(1), *weight.stride(), *s)
    elif n_z > 0 and D > 0:
        # dz in the compute dtype: the same values the one-pass form recomputed per shift, so dx rounds once
        dz = torch.empty(B, T, D, dtype=cdt, device=x.device)
        c = cfg["dz"]
        launch(conv_bwd_dz_kernel, (cdiv(D, c["BD"]), n_z, Bg),
               dict(BT=c["BT"], BD=c["BD"], SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None,
                    num_warps=c["num_warps"], **flags),
               x, dy, weight, bias, initial_state, cu_z, table_z, dz, dw_part, db_part,
               T, D, *x.stride(), dy.stride(0), dy.stride(1), *weight.stride(), *s)
        c = cfg["dx"]
        table_x, n_x, cu_x = tiles(c["BT"])
        launch(conv_bwd_dx_kernel, (cdiv(D, c["BD"]), n_x, Bg),
               dict(BT=c["BT"], BD=c["BD"], BW=max(1, next_pow2(W - 1)), HAS_DFINAL=dfinal is not None,
                    num_warps=c["num_warps"], **flags),
               dz, weight, dfinal, cu_x, table_x, dx, dinit if dinit is not None else dx, T, D, *weight.stride())
    if dinit is not None and n_z > 0 and cu_seqlens is not None:
        # zero-length sequences own no tile: their initial state only reaches the final state (by the checked
        # offsets, as the kernels)
        empty = (cu_z[1:] == cu_z[:-1])
        if dfinal is not None:
            dinit[empty] = dfinal[empty].to(dinit.dtype)
    elif dinit is not None and n_z == 0 and dfinal is not None:
        dinit.copy_(dfinal)
    dweight = dw_part.sum(0).t().contiguous().to(weight.dtype)           # [W, D] -> [D, W]
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinit
