"""Triton kernels for the causal depthwise conv1d in front of q, k, v, and its one-token update.

    y_t = act(bias + sum_{j=0}^{W-1} weight[:, j] * x_{t-W+1+j})        act: None or silu

Prefill (``causal_conv1d``) is a pure streaming op: every input row is read once from HBM and
every output row written once, so its speed limit is copy bandwidth. Two kernels:

- W <= 4 (every GDN model): ``causal_conv1d_fwd_window_kernel``, a sliding window. A program owns
  BD channels x BT rows of one sequence; it loads the W-1 halo rows before its block once (from x,
  initial_state or zero), then walks its rows keeping the last W-1 inputs in registers, so each
  x row is loaded exactly once (one coalesced [BD] vector load per row) and each y row stored
  once. The walk is unrolled by 4 rows (4 independent loads in flight, then 4 outputs), with the
  next 4 rows' loads issued before the current 4 outputs' math (register double buffering).
  The per-element math is ~17 instructions (4 taps, silu with approximate ex2/rcp on the GPU,
  bf16 unpack/pack): the kernel must stay under the issue budget of copy bandwidth.
- W > 4: ``causal_conv1d_fwd_kernel``, the general tile kernel: each program owns a [BT, BD] tile
  of y and reads its x tile W times, shifted by 0..W-1 rows (the shifted reads hit L1/L2).

Varlen batches use a (row block -> sequence, block-within-sequence) table, so no block straddles
two sequences.

Configs are pinned by a small heuristic (``conv_fwd_config``), never autotuned at run time: the
update kernel mutates state in place and runs inside CUDA graphs (DESIGN.md invariant 2), and the
prefill kernel is bandwidth-bound with a flat optimum.

Host path: a prefill whose call signature passed the checks before (token and sequence counts left out, as
fast.chunk's) skips them, less cu_seqlens' value rules, and launches through its plan (fast.launch).

Semantics, dtypes and validation are refgdn.conv's: compute in float32 (float64 when x, weight or
the state is float64), y in x's dtype, states in initial_state's / conv_state's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from refgdn.checks import check_conv_inputs, check_conv_update_inputs, check_offsets_again, one_host_read

from .chunk.common import _Chunks
from .launch import SignaturePlans, launch, shape_key, varlen_key
from .utils import cdiv, checked_offsets, is_interpreting, next_pow2, slot_row, varlen_chunk_tables


@triton.jit
def _silu(y):
    # silu(y) = y * sigmoid(y); sigmoid without overflow: exp only of -|y| <= 0, so e in (0, 1].
    # One division: sigmoid(|y|) = 1 / (1 + e), sigmoid(-|y|) = e * sigmoid(|y|).
    e = tl.exp(-tl.abs(y))
    r = 1 / (1 + e)
    return y * tl.where(y >= 0, r, e * r)


# Widest kernel taps the sliding-window kernel handles (its window is W-1 <= 3 named registers).
WINDOW_MAX_W = 4


@triton.jit
def _silu_fast_f32(y):
    """silu(y) = y / (1 + 2^(-y log2 e)) in float32 with the GPU's approximate ex2 / rcp (2 MUFU ops,
    ~2 ulp; the exact-division form costs ~3x the instructions and this kernel is issue-bound at
    bf16 bandwidth). Overflow is benign: y << 0 gives 2^(+big) = inf, rcp(inf) = 0, y * 0 = -0 (the
    limit); y >> 0 gives 2^(-big) = 0 (flushed), rcp(1) = 1, y. GPU only (inline PTX)."""
    e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [y * -1.4426950408889634],
                                  dtype=tl.float32, is_pure=True, pack=1)
    r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e],
                                  dtype=tl.float32, is_pure=True, pack=1)
    return y * r


@triton.jit
def _window_out(x0, p1, p2, p3, w0, w1, w2, w3, b,
                W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_SILU: tl.constexpr):
    """One output row from the newest input x0 = x_t and the window p_k = x_{t-k}:
    y_t = act(bias + w0 x_t + w1 x_{t-1} + w2 x_{t-2} + w3 x_{t-3}), w_k = weight[:, W-1-k]; taps k >= W
    are absent (constexpr), so their window registers are never read. FAST_SILU: float32 on a GPU."""
    acc = x0 * w0
    if W > 1:
        acc += p1 * w1
    if W > 2:
        acc += p2 * w2
    if W > 3:
        acc += p3 * w3
    if HAS_BIAS:
        acc += b
    if SILU:
        if FAST_SILU:
            acc = _silu_fast_f32(acc)
        else:
            acc = _silu(acc)
    return acc


@triton.jit
def _window_halo(x_base, p_x, initial_state, s_off, p_s, pos, L, m_d, m_init, zero_d, stride_x_t, stride_s_w,
                 W: tl.constexpr, HAS_INIT: tl.constexpr, DT: tl.constexpr):
    """Input row at position pos (int64 scalar, pos >= -(W-1)) as a [BD] vector in DT: x when
    0 <= pos < L, initial_state column W-1+pos when pos < 0 (zero without a state), zero past L.
    s_off: sequence n's offset in initial_state; p_x / p_s: per-channel offsets (o_d * stride_x_d,
    o_d * stride_s_d); m_init: m_d where the sequence has a state to read; zero_d: int64 zeros [BD]
    (row conditions are vectors, see the kernel)."""
    pos_d = pos + zero_d
    b = tl.load(x_base + pos * stride_x_t + p_x, mask=m_d & (pos_d >= 0) & (pos_d < L), other=0).to(DT)
    if HAS_INIT:
        # masked where pos >= 0 (the column index would be out of range there): b + 0 is exact
        b += tl.load(initial_state + s_off + (pos + (W - 1)) * stride_s_w + p_s,
                     mask=m_init & (pos_d < 0), other=0).to(DT)
    return b


@triton.jit
def _window_start(weight, o_d, m_d, stride_w_d, stride_w_w, x_base, p_x, initial_state, s_off, p_s, t0, L, m_init,
                  zero_d, stride_x_t, stride_s_w, W: tl.constexpr, HAS_INIT: tl.constexpr, DT: tl.constexpr):
    """A window kernel's start (the forward's and fast.conv_bwd's): the taps w_k = weight[:, W-1-k], which multiply
    x_{t-k}, and the halo p_k = x_{t0-k} before the block's first row t0 (_window_halo: x, initial_state or zero),
    as [BD] vectors in DT; taps and halo rows k >= W stay zero and unused."""
    w0 = tl.load(weight + o_d * stride_w_d + (W - 1) * stride_w_w, mask=m_d, other=0).to(DT)
    w1 = tl.zeros(o_d.shape, dtype=DT)
    w2 = tl.zeros(o_d.shape, dtype=DT)
    w3 = tl.zeros(o_d.shape, dtype=DT)
    p1 = tl.zeros(o_d.shape, dtype=DT)
    p2 = tl.zeros(o_d.shape, dtype=DT)
    p3 = tl.zeros(o_d.shape, dtype=DT)
    if W > 1:
        w1 = tl.load(weight + o_d * stride_w_d + (W - 2) * stride_w_w, mask=m_d, other=0).to(DT)
        p1 = _window_halo(x_base, p_x, initial_state, s_off, p_s, t0 - 1, L, m_d, m_init, zero_d,
                          stride_x_t, stride_s_w, W, HAS_INIT, DT)
    if W > 2:
        w2 = tl.load(weight + o_d * stride_w_d + (W - 3) * stride_w_w, mask=m_d, other=0).to(DT)
        p2 = _window_halo(x_base, p_x, initial_state, s_off, p_s, t0 - 2, L, m_d, m_init, zero_d,
                          stride_x_t, stride_s_w, W, HAS_INIT, DT)
    if W > 3:
        w3 = tl.load(weight + o_d * stride_w_d + (W - 4) * stride_w_w, mask=m_d, other=0).to(DT)
        p3 = _window_halo(x_base, p_x, initial_state, s_off, p_s, t0 - 3, L, m_d, m_init, zero_d,
                          stride_x_t, stride_s_w, W, HAS_INIT, DT)
    return w0, w1, w2, w3, p1, p2, p3


@triton.jit
def _window_load4(x_base, p_x, r, stride_x_t, j_d, n_d, m_d):
    """Input rows r .. r+3 (r: int64 scalar) as four [BD] vectors in x's dtype. j_d: the block-local
    index of row r and n_d: the block's row count, as int32 [BD] vectors; rows j >= n are masked
    to 0. Four independent loads: all in flight at once."""
    x0 = tl.load(x_base + r * stride_x_t + p_x, mask=m_d & (j_d < n_d), other=0)
    x1 = tl.load(x_base + (r + 1) * stride_x_t + p_x, mask=m_d & (j_d + 1 < n_d), other=0)
    x2 = tl.load(x_base + (r + 2) * stride_x_t + p_x, mask=m_d & (j_d + 2 < n_d), other=0)
    x3 = tl.load(x_base + (r + 3) * stride_x_t + p_x, mask=m_d & (j_d + 3 < n_d), other=0)
    return x0, x1, x2, x3


@triton.jit(do_not_specialize=["T"])  # T is arithmetic below: keep it a runtime int even when T == 1
def causal_conv1d_fwd_window_kernel(
    x, y, weight, bias, initial_state, cu_seqlens, tile_table, slot_rows,
    T, D,
    stride_x_b, stride_x_t, stride_x_d,
    stride_w_d, stride_w_w,
    stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    IS_VARLEN: tl.constexpr, FP64: tl.constexpr, FAST_SILU: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, SLOTS: tl.constexpr = False, PAD_ZERO: tl.constexpr = False,
):
    """x: [B, T, D] (any strides) -> y: [B, T, D] contiguous, for W <= 4; BT rows x BD channels per program.

    grid = (cdiv(D, BD), row blocks, B): dense row blocks = cdiv(T, BT); varlen (B == 1) row blocks
    = rows of tile_table [NT, 2] = (sequence n, block index within n). BT is a multiple of 4.

        y_t = act(bias + sum_k w_k x_{t-k}),  window (p1, p2, p3) = (x_{t-1}, x_{t-2}, x_{t-3})

    The window starts as the W-1 halo rows before the block (x, initial_state, or zero), then
    slides: every row of the block is loaded once and every output stored once. Values are kept
    in the compute dtype (float32, float64 with FP64): converting x to it is exact.
    PREFETCH: double-buffer the 4-row loads (more bytes in flight per thread, +4 rows of registers).
    FAST_SILU: approximate ex2/rcp silu (float32 on a GPU only: inline PTX). SLOTS: initial_state is a slot
    cache's conv_state (fast.utils.slot_row); with PAD_ZERO a sequence that writes no slot (slot_rows[n, 0] < 0:
    vLLM's padded request) outputs zeros.
    """
    if FP64:
        DT: tl.constexpr = tl.float64
    else:
        DT: tl.constexpr = tl.float32
    i_d = tl.program_id(0)
    i_t = tl.program_id(1)
    i_b = tl.program_id(2)
    if IS_VARLEN:
        # a row (-1, 0) holds no tile (a device-built table's rows past the tile count: fast.chunk.common's
        # chunk_table_kernel): sequence 0 with no rows, nothing stored
        i_n = tl.load(tile_table + i_t * 2).to(tl.int64)
        i_tt = tl.load(tile_table + i_t * 2 + 1).to(tl.int64)
        live = i_n >= 0
        i_n = tl.maximum(i_n, 0)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = tl.where(live, tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos, 0)
        x_base = x + bos * stride_x_t                    # batch row 0
        y_base = y + bos * D
    else:
        i_n = i_b.to(tl.int64)
        i_tt = i_t.to(tl.int64)
        L = T
        x_base = x + i_n * stride_x_b
        y_base = y + i_n * T * D
    t0 = i_tt * BT                                       # first row of the block (int64: T * D may pass 2^31)

    o_d = i_d * BD + tl.arange(0, BD)                    # channels, [BD]
    m_d = o_d < D
    p_x = o_d * stride_x_d
    p_s = o_d * stride_s_d
    # Row conditions are broadcast to [BD] vectors before they meet m_d: the compiler folds the
    # add of zeros (a splat), and the Triton interpreter mis-types `vector & scalar` masks.
    zero_d = tl.zeros([BD], dtype=tl.int64)
    r_init, m_init = slot_row(slot_rows, i_n, 1, zero_d, m_d, SLOTS)     # (read with HAS_INIT only)
    s_off = r_init * stride_s_n
    if PAD_ZERO:
        # a padded sequence's rows are stored as zeros (its taps are zeroed: bias and silu(0) are not)
        _, m_live = slot_row(slot_rows, i_n, 0, zero_d, m_d, SLOTS)

    w0, w1, w2, w3, p1, p2, p3 = _window_start(weight, o_d, m_d, stride_w_d, stride_w_w, x_base, p_x, initial_state,
                                               s_off, p_s, t0, L, m_init, zero_d, stride_x_t, stride_s_w,
                                               W, HAS_INIT, DT)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0).to(DT)
    else:
        b = w0  # unused

    # Walk the block 4 rows at a time: 4 independent loads in flight, then 4 outputs. Rows past the
    # block's end or the sequence's end are masked (loaded as 0, never stored). i only offsets
    # pointers and masks. PREFETCH: the loads of the next 4 rows are issued before the current 4
    # outputs are computed (register double buffering), so loads stay in flight during the math.
    # Row masks compare block-local int32 indices (pointers use int64 rows r).
    zero_i = tl.zeros([BD], dtype=tl.int32)
    n_d = tl.minimum((L - t0).to(tl.int32) + zero_i, BT)  # rows of this block inside the sequence
    if PREFETCH:
        n0, n1, n2, n3 = _window_load4(x_base, p_x, t0, stride_x_t, zero_i, n_d, m_d)
    for i in range(0, BT, 4):
        r = t0 + i                                       # int64 row of x0
        j_d = zero_i + i                                 # its block-local index, [BD]
        if PREFETCH:
            x0, x1, x2, x3 = n0, n1, n2, n3
            n0, n1, n2, n3 = _window_load4(x_base, p_x, r + 4, stride_x_t, j_d + 4, n_d, m_d)
        else:
            x0, x1, x2, x3 = _window_load4(x_base, p_x, r, stride_x_t, j_d, n_d, m_d)
        x0 = x0.to(DT)
        x1 = x1.to(DT)
        x2 = x2.to(DT)
        x3 = x3.to(DT)
        y0 = _window_out(x0, p1, p2, p3, w0, w1, w2, w3, b, W, SILU, HAS_BIAS, FAST_SILU)
        y1 = _window_out(x1, x0, p1, p2, w0, w1, w2, w3, b, W, SILU, HAS_BIAS, FAST_SILU)
        y2 = _window_out(x2, x1, x0, p1, w0, w1, w2, w3, b, W, SILU, HAS_BIAS, FAST_SILU)
        y3 = _window_out(x3, x2, x1, x0, w0, w1, w2, w3, b, W, SILU, HAS_BIAS, FAST_SILU)
        if PAD_ZERO:
            y0 = tl.where(m_live, y0, 0.0)
            y1 = tl.where(m_live, y1, 0.0)
            y2 = tl.where(m_live, y2, 0.0)
            y3 = tl.where(m_live, y3, 0.0)
        tl.store(y_base + r * D + o_d, y0.to(y.dtype.element_ty), mask=m_d & (j_d < n_d))
        tl.store(y_base + (r + 1) * D + o_d, y1.to(y.dtype.element_ty), mask=m_d & (j_d + 1 < n_d))
        tl.store(y_base + (r + 2) * D + o_d, y2.to(y.dtype.element_ty), mask=m_d & (j_d + 2 < n_d))
        tl.store(y_base + (r + 3) * D + o_d, y3.to(y.dtype.element_ty), mask=m_d & (j_d + 3 < n_d))
        p1, p2, p3 = x3, x2, x1


@triton.jit(do_not_specialize=["T"])  # T is arithmetic below: keep it a runtime int even when T == 1
def causal_conv1d_fwd_kernel(
    x, y, weight, bias, initial_state, cu_seqlens, tile_table, slot_rows,
    T, D,
    stride_x_b, stride_x_t, stride_x_d,
    stride_w_d, stride_w_w,
    stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    IS_VARLEN: tl.constexpr, FP64: tl.constexpr, SLOTS: tl.constexpr = False, PAD_ZERO: tl.constexpr = False,
):
    """x: [B, T, D] (any strides) -> y: [B, T, D] contiguous; one [BT, BD] tile of y per program.

    grid = (cdiv(D, BD), tiles, B): dense tiles = cdiv(T, BT); varlen (B == 1) tiles = rows of
    tile_table [NT, 2] = (sequence n, tile index within n).
    y_t = act(bias + sum_j w[:, j] * x_{t-W+1+j}), positions < 0 read initial_state[n, :, W-1+pos].
    SLOTS: initial_state is a slot cache's conv_state (fast.utils.slot_row); PAD_ZERO as the window kernel's.
    """
    i_d = tl.program_id(0)
    i_t = tl.program_id(1)
    i_b = tl.program_id(2)
    if IS_VARLEN:
        i_n = tl.load(tile_table + i_t * 2).to(tl.int64)
        i_tt = tl.load(tile_table + i_t * 2 + 1)
        live = i_n >= 0                                  # (-1, 0): no tile (the window kernel's comment)
        i_n = tl.maximum(i_n, 0)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = tl.where(live, (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32), 0)
        x_base = x + bos * stride_x_t                    # batch row 0
        y_base = y + bos * D
    else:
        i_n = i_b.to(tl.int64)
        i_tt = i_t
        L = T
        x_base = x + i_n * stride_x_b
        y_base = y + i_n * T * D

    o_t = i_tt * BT + tl.arange(0, BT)                   # positions within the sequence, [BT]
    o_d = i_d * BD + tl.arange(0, BD)                    # channels, [BD]
    m_d = o_d < D
    m_t = o_t < L
    r_init, m_init = slot_row(slot_rows, i_n, 1, o_d, m_d, SLOTS)
    s_off = r_init * stride_s_n
    if FP64:
        acc = tl.zeros([BT, BD], dtype=tl.float64)
    else:
        acc = tl.zeros([BT, BD], dtype=tl.float32)

    for j in tl.static_range(W):
        # source position of tap j; negative = before the sequence start (initial state or zero).
        # Pointers for masked-off rows may point outside x: they are never dereferenced.
        o_s = o_t + (j - (W - 1))
        m_x = (m_t & (o_s >= 0))[:, None] & m_d[None, :]
        b_x = tl.load(x_base + o_s.to(tl.int64)[:, None] * stride_x_t + o_d[None, :] * stride_x_d,
                      mask=m_x, other=0).to(acc.dtype)
        if HAS_INIT:
            # o_s >= -(W-1) always (o_t >= 0, j >= 0): the state column W-1+o_s is in range.
            m_s = (m_t & (o_s < 0))[:, None] & m_init[None, :]
            b_s = tl.load(initial_state + s_off + o_d[None, :] * stride_s_d
                          + (o_s + (W - 1))[:, None] * stride_s_w, mask=m_s, other=0).to(acc.dtype)
            b_x += b_s
        b_w = tl.load(weight + o_d * stride_w_d + j * stride_w_w, mask=m_d, other=0).to(acc.dtype)
        acc += b_x * b_w[None, :]

    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0).to(acc.dtype)[None, :]
    if SILU:
        acc = _silu(acc)
    if PAD_ZERO:
        _, m_live = slot_row(slot_rows, i_n, 0, o_d, m_d, SLOTS)   # a padded sequence: zeros
        acc = tl.where(m_live[None, :], acc, 0.0)
    tl.store(y_base + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["T"])
def causal_conv1d_final_state_kernel(
    x, final_state, initial_state, cu_seqlens, slot_rows,
    T, D,
    stride_x_b, stride_x_t, stride_x_d,
    stride_s_n, stride_s_d, stride_s_w,
    stride_f_n, stride_f_d, stride_f_w,
    W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
    SLOTS: tl.constexpr = False,
):
    """final_state[n, :, i] = x_{L-(W-1)+i} of sequence n (i < W-1, oldest first); positions < 0
    come from initial_state[n, :, W-1+pos] (zero without one). final_state: [N, D, W-1] (any strides).
    grid = (cdiv(D, BD), N). A pure copy: values are only rounded to final_state's dtype on store.
    SLOTS (the serving prefill): initial_state and final_state are a slot cache's conv_state, read at slot
    slot_rows[n, 1] and written at slot slot_rows[n, 0] (int32 [N, 2]; -1: zeros / nothing written): in place,
    which is safe because the [BD, W-1] block is loaded whole before it is stored.
    """
    i_d = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        # >= 0: offsets clamped into [0, T] but not checked (a device-built table's) may decrease
        L = tl.maximum(tl.load(cu_seqlens + i_n + 1) - bos, 0).to(tl.int32)
        x_base = x + bos * stride_x_t
    else:
        L = T
        x_base = x + i_n * stride_x_b
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_i = tl.arange(0, WP)                               # the state's columns
    pos = L - (W - 1) + o_i                              # their source positions; < 0: from initial_state
    m_i = o_i < W - 1
    b = tl.load(x_base + pos.to(tl.int64)[None, :] * stride_x_t + o_d[:, None] * stride_x_d,
                mask=m_d[:, None] & (m_i & (pos >= 0))[None, :], other=0).to(final_state.dtype.element_ty)
    if HAS_INIT:
        r_init, m_init = slot_row(slot_rows, i_n, 1, o_d, m_d, SLOTS)
        b_s = tl.load(initial_state + r_init * stride_s_n + o_d[:, None] * stride_s_d
                      + (pos + (W - 1))[None, :] * stride_s_w,
                      mask=m_init[:, None] & (m_i & (pos < 0))[None, :], other=0)
        b = tl.where((pos >= 0)[None, :], b, b_s.to(final_state.dtype.element_ty))
    f_row, m_f = slot_row(slot_rows, i_n, 0, o_d, m_d, SLOTS)
    tl.store(final_state + f_row * stride_f_n + o_d[:, None] * stride_f_d + o_i[None, :] * stride_f_w, b,
             mask=m_f[:, None] & m_i[None, :])


def conv_fwd_config(T: int, D: int, W: int, elem_size: int = 2) -> dict:
    """Pinned prefill config: a heuristic, never autotuned at run time. elem_size: bytes per
    element of x (2 for bf16/fp16, the benchmarked case). Keys: BT (rows per program), BD
    (channels per program), num_warps (the window kernel prefetches unless a config says not).

    W <= 4, sliding-window kernel (GPU): 4 warps, 4 channels per thread (BD = 512: 8 B vectors
    of bf16, 16 B of float32). Compiled for sm_90 that holds the kernel at 56 registers (9
    programs = 36 warps per SM, ~36 KB of loads in flight per SM); 8 channels per thread (BD =
    1024, 16 B vectors) needs ~128 registers (4 programs per SM) for the same bytes in flight.
    BT = 16 rows: the (W-1)/BT = 19% halo re-read hits L2, and the shorter walk wins. Measured on
    an H200 (Triton 3.6, T=16384, D=8192, bf16, silu; `fast.conv.sweep()`): BT=16 BD=512 4 warps
    93.7% of a same-size copy, BT=32 91.0%, BT=64 90.8%. prefetch: next 4 rows' loads issued
    before the current 4 rows' math.
    W > 4, tile kernel (GPU): BD = 256 channels, BT = 32 rows, 8 warps.
    Interpreter: small blocks, fewest programs.
    """
    if W <= WINDOW_MAX_W:
        if is_interpreting():
            return dict(BT=max(4, min(32, next_pow2(T))), BD=max(16, min(128, next_pow2(D))), num_warps=4)
        BD = max(16, min(512, next_pow2(D)))
        num_warps = max(1, min(4, BD // 128))
        BT = max(4, min(16, next_pow2(T)))
        return dict(BT=BT, BD=BD, num_warps=num_warps)
    if is_interpreting():
        return dict(BT=max(16, min(64, next_pow2(T))), BD=max(16, min(128, next_pow2(D))), num_warps=4)
    BD = max(16, min(256, next_pow2(D)))
    BT = max(16, min(32, next_pow2(T)))
    return dict(BT=BT, BD=BD, num_warps=8 if BT * BD >= 8192 else 4)


@one_host_read   # cu_seqlens read to the host once per call (its value check; none with cu_seqlens_cpu)
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                  cu_seqlens_cpu: Optional[torch.Tensor] = None):
    """x: [B, T, D], weight: [D, W], bias: [D], initial_state: [N, D, W-1] -> (y [B, T, D], final_state [N, D, W-1])

        y_t = act(bias + sum_{j=0}^{W-1} weight[:, j] * x_{t-W+1+j})      act: None or "silu"

    Varlen: B == 1 and cu_seqlens [N+1]. Inputs before a sequence's start come from initial_state
    (zeros when None). y in x.dtype; final_state (the last W-1 inputs of each sequence, oldest
    first; None unless output_final_state) in initial_state's dtype if given, else x's.
    refgdn.causal_conv1d's twin. cu_seqlens_cpu: as fast.chunk_gated_delta_rule's (its values, on the
    CPU: no device->host read). The host checks the offsets' values (ValueError before anything runs); the tile
    table is then built on the device from the checked values (one small launch, fast.chunk.common.
    chunk_table_kernel, on cu_seqlens, or on the N + 1 values of cu_seqlens_cpu uploaded) instead of on the host.

    Differentiable: when an input requires grad (or torch.compile traces the call) it runs as the
    custom op torch.ops.fast.causal_conv1d (fast.library), whose backward is fast.conv_bwd's kernel:
    gradients of x, weight, bias and initial_state (the final state's gradient included).
    """
    from . import library                                                # registers the ops (no cycle at import)
    if library.wants_graph(x, weight, bias, initial_state):
        check_conv_inputs(x, weight, bias, activation, initial_state, cu_seqlens, cu_seqlens_cpu)
        y, final = library.causal_conv1d_op(x, weight, bias, activation or "", initial_state, cu_seqlens)
        return y, (final if output_final_state else None)
    sig = _call_signature(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu)
    plan = _PLANS.get(sig)
    if plan is None:
        check_conv_inputs(x, weight, bias, activation, initial_state, cu_seqlens, cu_seqlens_cpu)
        plan = _PLANS.after_checks(sig)                                  # (None on a signature's first call)
    else:
        check_offsets_again(cu_seqlens, cu_seqlens_cpu, x.shape[1])     # (the values' rules, on every call)
    cu = checked_offsets(cu_seqlens, cu_seqlens_cpu)
    if plan is None:
        return _forward(x, weight, bias, activation, initial_state, output_final_state, cu, device_table=True)
    with plan:
        return _forward(x, weight, bias, activation, initial_state, output_final_state, cu, device_table=True)


# Signatures that passed check_conv_inputs -> the LaunchPlan of their launches (fast.launch), from a signature's
# second call on.
_PLANS = SignaturePlans(64, seen_size=256)


def _call_signature(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens,
                    cu_seqlens_cpu) -> Optional[tuple]:
    """What check_conv_inputs reads, with the token count T and the sequence count N left out (fast.chunk's
    _call_signature says why and how): the tensors' (type, shape, dtype, device) less x's dim 1, initial_state's
    dim 0 and the offsets' lengths; activation (by value: None or a str) and output_final_state (a bool); whether
    initial_state holds N rows, cu_seqlens at least two offsets, cu_seqlens_cpu cu_seqlens' shape, and T == 0.
    None (check in full, keep no plan) when an argument is of another kind."""
    if type(output_final_state) is not bool or not (activation is None or type(activation) is str):
        return None
    try:
        return (shape_key(x, 1), shape_key(weight), shape_key(bias), activation, output_final_state,
                *varlen_key(x, initial_state, cu_seqlens, cu_seqlens_cpu))
    except Exception:  # noqa: BLE001 - not a tensor, or too few dims: the full checks raise their own error
        return None


def clear_plan_cache() -> None:
    """Forget every cached signature (the next call of each checks in full). Tests and benchmarks."""
    _PLANS.clear()


@one_host_read   # cu_seqlens read to the host once per call (its value check; none with cu_seqlens_cpu)
def causal_conv1d_with_config(x, weight, bias=None, activation=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                              config: Optional[dict] = None):
    """causal_conv1d with ``config`` overriding keys of the pinned config (for benchmark sweeps that
    choose the pinned values; each config is a separate compilation):

        BT: rows per program (a multiple of 4 for the window kernel), BD: channels per program (a
        power of two), num_warps; optional: kernel = "window" (W <= 4 only, the default there) or
        "tile" (any W, the default for W > 4); for the window kernel prefetch (bool, default True)
        and fast_silu (bool: approximate ex2/rcp; default and only honoured for float32 compute on
        CUDA); Triton's num_stages and maxnreg.
    """
    check_conv_inputs(x, weight, bias, activation, initial_state, cu_seqlens, cu_seqlens_cpu)
    cu = checked_offsets(cu_seqlens, cu_seqlens_cpu)
    return _forward(x, weight, bias, activation, initial_state, output_final_state, cu, config, device_table=True)


def _forward(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens, config=None,
             slot_rows=None, pad_zero: bool = False, device_table: bool = False):
    """causal_conv1d_with_config after its checks (the caller's): allocations and the two launches (through
    fast.launch.launch: the caller's plan, if any). slot_rows (the serving prefill, fast.serving.gdn_prefill;
    int32 [N, 2], values checked on the device): initial_state is a slot cache's conv_state [S, D, W-1+...], read at
    slot slot_rows[n, 1] and, with output_final_state, written in place at slot slot_rows[n, 0] (its first W-1
    columns; -1: zeros / nothing written); the final state returned is that conv_state. pad_zero (with slot_rows:
    vLLM's causal_conv1d_fn): a sequence whose written slot is -1 outputs zeros (the kernels' PAD_ZERO). device_table
    (varlen): the tile table is built on the device from cu_seqlens (fast.chunk.common._Chunks.unchecked: cdiv(T,
    BT) + N rows, offsets clamped into [0, T]; rows past the tile count hold none), with no host read: for offsets
    the host checked already (the public op: no host table build, no upload) or never reads (vLLM's
    causal_conv1d_fn: any values stay memory-safe and the call is capturable). False (gdn_prefill): the host-built
    table, which its chunked forward shares (one build, one upload)."""
    B, T, D = x.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    W = weight.shape[1]
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (x, weight, initial_state))
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    state_dtype = initial_state.dtype if initial_state is not None else x.dtype
    if slot_rows is not None:
        final = initial_state if output_final_state else None
    else:
        final = torch.empty(N, D, W - 1, dtype=state_dtype, device=x.device) if output_final_state else None
    if D == 0:
        return y, final
    config = dict(config or {})
    cfg = dict(conv_fwd_config(T, D, W, x.element_size()), **config)
    kernel = cfg.get("kernel", "window" if W <= WINDOW_MAX_W else "tile")
    BT, BD = cfg["BT"], cfg["BD"]
    if kernel not in ("window", "tile") or (kernel == "window" and (W > WINDOW_MAX_W or BT % 4)):
        raise ValueError(f"config: kernel 'window' needs W <= {WINDOW_MAX_W} and BT % 4 == 0, 'tile' any W; "
                         f"got kernel={kernel!r}, W={W}, BT={BT}")
    s = initial_state.stride() if initial_state is not None else (0, 0, 0)
    cu_checked = None
    while True:
        if cu_seqlens is not None and device_table:
            tab = _Chunks.unchecked(T, BT, cu_seqlens)     # on the device: no host read
            tile_table, cu_checked = tab.indices, tab.cu_seqlens
            n_tiles = tab.total if T else 0                 # (no tokens: only the final states, from cu_checked)
        elif cu_seqlens is not None:
            # the lengths on the host (gdn_prefill: the table its chunked forward shares, within its one host
            # read); the kernels read the checked offsets uploaded with the table
            tab = varlen_chunk_tables(cu_seqlens, BT)
            tile_table, cu_checked = tab.indices, tab.checked
            n_tiles = tile_table.shape[0]
        else:
            tile_table = None
            n_tiles = cdiv(T, BT)
        if n_tiles <= 65535 or "BT" in config:      # grid axis 1 limit: grow a pinned BT to fit
            break
        BT *= 2
    if n_tiles > 0:
        grid = (cdiv(D, BD), n_tiles, B)
        kw = dict(num_warps=cfg["num_warps"])
        for key in ("num_stages", "maxnreg"):
            if cfg.get(key) is not None:
                kw[key] = cfg[key]
        if kernel == "window":
            fwd = causal_conv1d_fwd_window_kernel
            # approximate-ex2/rcp silu: float32 compute on a GPU only (inline PTX)
            gpu_f32 = x.is_cuda and not fp64 and not is_interpreting()
            kw["FAST_SILU"] = bool(cfg.get("fast_silu", gpu_f32)) and gpu_f32
            kw["PREFETCH"] = bool(cfg.get("prefetch", True))
        else:
            fwd = causal_conv1d_fwd_kernel
        kw.update(W=W, BT=BT, BD=BD, SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None,
                  HAS_INIT=initial_state is not None, IS_VARLEN=cu_seqlens is not None, FP64=fp64,
                  SLOTS=slot_rows is not None, PAD_ZERO=pad_zero and slot_rows is not None)
        launch(fwd, grid, kw, x, y, weight, bias, initial_state, cu_checked, tile_table, slot_rows, T, D,
               *x.stride(), *weight.stride(), *s)
    if output_final_state and W > 1 and N > 0:
        BDs = max(16, min(256, next_pow2(D)))
        kw = dict(W=W, WP=next_pow2(W - 1), BD=BDs, HAS_INIT=initial_state is not None,
                  IS_VARLEN=cu_seqlens is not None, SLOTS=slot_rows is not None, num_warps=4)
        launch(causal_conv1d_final_state_kernel, (cdiv(D, BDs), N), kw,
               x, final, initial_state, cu_checked, slot_rows, T, D, *x.stride(), *s, *final.stride())
    return y, final


@triton.jit
def causal_conv1d_update_kernel(
    x, conv_state, weight, bias, y, D,
    stride_x_n, stride_x_d,
    stride_s_n, stride_s_d, stride_s_w,
    stride_w_d, stride_w_w,
    W: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, FP64: tl.constexpr,
):
    """x: [N, D], conv_state: [N, D, W-1] (in place) -> y: [N, D] contiguous. grid = (cdiv(D, BD), N).

        window = [conv_state, x];  y = act(bias + sum_j w[:, j] window[:, j]);  conv_state <- window[:, 1:]

    In-place safety: every tensor here is a 1-D [BD] vector with one layout, so channel d's state
    row is read and rewritten by the same thread, in program order (reads of column j+1 precede
    the write of column j+1). No other program touches row (n, d).
    """
    i_d = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if FP64:
        acc = tl.zeros([BD], dtype=tl.float64)
    else:
        acc = tl.zeros([BD], dtype=tl.float32)
    p_s = conv_state + i_n * stride_s_n + o_d * stride_s_d
    b_x = tl.load(x + i_n * stride_x_n + o_d * stride_x_d, mask=m_d, other=0)
    for j in tl.static_range(W - 1):
        b_s = tl.load(p_s + j * stride_s_w, mask=m_d, other=0).to(acc.dtype)
        acc += b_s * tl.load(weight + o_d * stride_w_d + j * stride_w_w, mask=m_d, other=0).to(acc.dtype)
    acc += b_x.to(acc.dtype) * tl.load(weight + o_d * stride_w_d + (W - 1) * stride_w_w,
                                       mask=m_d, other=0).to(acc.dtype)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0).to(acc.dtype)
    if SILU:
        acc = _silu(acc)
    tl.store(y + i_n * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)
    # shift: drop the oldest column, append x (rounded to the state's dtype by the store)
    if W > 2:
        for j in tl.static_range(W - 2):
            tl.store(p_s + j * stride_s_w, tl.load(p_s + (j + 1) * stride_s_w, mask=m_d, other=0), mask=m_d)
    if W > 1:
        tl.store(p_s + (W - 2) * stride_s_w, b_x.to(conv_state.dtype.element_ty), mask=m_d)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """x: [N, D], conv_state: [N, D, W-1] (oldest first, updated in place), weight: [D, W], bias: [D] -> y: [N, D]

        window = [conv_state, x];  y = act(bias + sum_j weight[:, j] * window[:, j]);  conv_state <- window[:, 1:]

    y in x.dtype; the appended state column is x rounded to conv_state's dtype. conv_state may be
    any strided view (e.g. a slice of a slot cache). Pinned config: no autotune (in-place, graph-safe).
    refgdn.causal_conv1d_update's twin.
    """
    check_conv_update_inputs(x, conv_state, weight, bias, activation)
    N, D = x.shape
    W = weight.shape[1]
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    if N == 0 or D == 0:
        return y
    fp64 = any(t.dtype == torch.float64 for t in (x, weight, conv_state))
    BD = max(16, min(256 if not is_interpreting() else 128, next_pow2(D)))
    launch(causal_conv1d_update_kernel, (cdiv(D, BD), N),
           dict(W=W, BD=BD, SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None, FP64=fp64, num_warps=4),
           x, conv_state, weight, bias, y, D, *x.stride(), *conv_state.stride(), *weight.stride())
    return y


def sweep(T: int = 16384, D: int = 8192, W: int = 4, dtype=torch.bfloat16, configs=None) -> list:
    """GPU helper for choosing the pinned prefill config (not used by the ops): time
    causal_conv1d_with_config (silu, no bias/state) over ``configs`` (default: a window-kernel grid
    over BD, num_warps, BT, prefetch) with triton.testing.do_bench; print and return rows of
    (config, ms, GB/s, fraction of a same-size device copy). Run: python -c "import fast.conv as c; c.sweep()"
    """
    from triton.testing import do_bench

    x = torch.randn(1, T, D, device="cuda").to(dtype)
    w = (torch.randn(D, W, device="cuda") / 2).to(dtype)
    nbytes = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()   # read x + write y + weights
    out = torch.empty_like(x)
    copy_ms = do_bench(lambda: out.copy_(x))
    if configs is None:
        configs = [dict(BT=bt, BD=bd, num_warps=nw, prefetch=pf)
                   for bd, nw in ((512, 4), (1024, 4), (1024, 8), (256, 2)) for bt in (16, 32, 64, 128, 256)
                   for pf in (True, False)]
        configs.append(conv_fwd_config(T, D, W, x.element_size()))
    rows = []
    for cfg in configs:
        try:
            ms = do_bench(lambda: causal_conv1d_with_config(x, w, None, "silu", config=cfg))
            rows.append((cfg, ms, nbytes / ms / 1e6, copy_ms / ms))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
            rows.append((cfg, float("nan"), float("nan"), float("nan")))
            print(f"{cfg}: {type(e).__name__}: {e}"[:200])
    rows.sort(key=lambda r: (r[1] != r[1], r[1]))
    print(f"copy of {x.numel() * x.element_size() / 1e6:.0f} MB: {copy_ms:.3f} ms "
          f"({2 * x.numel() * x.element_size() / copy_ms / 1e6:.0f} GB/s); pinned {conv_fwd_config(T, D, W, 2)}")
    for cfg, ms, gbs, frac in rows:
        print(f"{ms:8.4f} ms {gbs:7.0f} GB/s {100 * frac:5.1f}% of copy  {cfg}")
    return rows


@triton.jit(do_not_specialize=["T", "S", "pad"])
def conv_update_slots_kernel(
    x, conv_state, weight, bias, y, idx, num_acc, qsl, T, S, pad,
    s_xb, s_xd, s_xt, s_cn, s_cd, s_cw, s_wd, s_ww, s_yb, s_yd, s_yt,
    D: tl.constexpr, C: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, CP: tl.constexpr, SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr, INDEXED: tl.constexpr, SPEC: tl.constexpr, VARLEN: tl.constexpr, FP64: tl.constexpr,
):
    """vLLM's causal_conv1d_update (fast.vllm_ops): request i_b's channels o_d, grid = (cdiv(D, BD), B).

        u = [conv_state[s, :, o : o + W - 1], x_b];  y_t = act(bias + sum_j w[:, j] u[:, t + j]);
        conv_state[s, :, :W - 2 + L] <- u[:, 1:] (SPEC)  or  conv_state[s, :, :W - 1] <- u[:, L:]

    s = idx[i_b] (INDEXED) else i_b; a padded request (s == pad, s < 0 or s >= S) writes zeros to y and nothing to
    conv_state, nor does a request without tokens. o = num_acc[i_b] - 1 (SPEC), clamped so the window stays in [0, C).
    Tokens: x[i_b, :, t] (t < T), or rows qsl[i_b] .. qsl[i_b + 1] of x [T, D] (VARLEN; offsets clamped to [0, T]). x is
    rounded to conv_state's dtype before use. In place: the outputs read the old row first; the new row is one [CP, BD]
    tile loaded whole before its store, so no column is overwritten before it is read.
    """
    i_d = tl.program_id(0)
    i_b = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if INDEXED:
        slot = tl.load(idx + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    valid = (slot != pad) & (slot >= 0) & (slot < S)
    slot = tl.where(valid, slot, 0)
    m_dv = m_d & ((o_d * 0 + valid.to(tl.int32)) != 0)
    if VARLEN:
        bos = tl.minimum(tl.maximum(tl.load(qsl + i_b).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(qsl + i_b + 1).to(tl.int64), bos), T)
        p_x = x + bos * s_xt + o_d * s_xd
        p_y = y + bos * s_yt + o_d * s_yd
        L = eos - bos
    else:
        p_x = x + i_b.to(tl.int64) * s_xb + o_d * s_xd
        p_y = y + i_b.to(tl.int64) * s_yb + o_d * s_yd
        L = T
    off = 0
    if SPEC:
        off = tl.load(num_acc + i_b).to(tl.int64) - 1
        off = tl.minimum(tl.maximum(off, 0), C - (W - 1))              # memory safety for unchecked counts
    p_c = conv_state + slot * s_cn + o_d * s_cd
    cdt = conv_state.dtype.element_ty
    for t in range(0, L):
        if FP64:
            acc = tl.zeros([BD], dtype=tl.float64)
        else:
            acc = tl.zeros([BD], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + o_d, mask=m_d, other=0).to(acc.dtype)
        for j in tl.static_range(W):
            m = o_d * 0 + t + j                                           # u's column, as a block
            old = tl.load(p_c + (off + m) * s_cw, mask=m_dv & (m < W - 1), other=0)
            new = tl.load(p_x + (m - (W - 1)) * s_xt, mask=m_d & (m >= W - 1), other=0).to(cdt)
            u = old.to(acc.dtype) + new.to(acc.dtype)                      # one of the two is 0
            acc += u * tl.load(weight + o_d * s_wd + j * s_ww, mask=m_d, other=0).to(acc.dtype)
        if SILU:
            acc = _silu(acc)
        acc = tl.where(m_dv, acc, 0.0)
        tl.store(p_y + t * s_yt, acc.to(y.dtype.element_ty), mask=m_d)
    # the new row: column c takes u[:, c + shift]
    c = tl.arange(0, CP)
    if SPEC:
        shift = 1
        count = W - 2 + L
    else:
        shift = L
        count = W - 1 + L * 0
    mc = c[:, None] + shift + o_d[None, :] * 0                             # u's column per tile element
    m2 = m_dv[None, :] & (c[:, None] < C) & (c[:, None] * 0 + L > 0)        # no token: the row is left as it is
    old = tl.load(p_c[None, :] + (off + mc) * s_cw, mask=m2 & (mc < W - 1), other=0)
    new = tl.load(p_x[None, :] + (mc - (W - 1)) * s_xt, mask=m2 & (mc >= W - 1) & (mc < W - 1 + L), other=0).to(cdt)
    tile = old + new
    tl.store(p_c[None, :] + c[:, None] * s_cw, tile, mask=m2 & (c[:, None] < count))


@triton.jit(do_not_specialize=["B", "S", "pad"])   # one variant for every request count, pool size and pad id
def vllm_conv_rows_kernel(idx, init, rows, B, S, pad, BN: tl.constexpr, INDEXED: tl.constexpr, HAS_FLAGS: tl.constexpr):
    """vLLM's causal_conv1d_fn (fast.vllm_ops): the prefill conv's slot rows from its values, on the device (one
    program, BN requests at a time): rows int32 [B, 2] = (row written, row read), -1 for none.

        s = idx[b] (INDEXED) else b;  written = s if s != pad and 0 <= s < S else -1;
        read = written if init[b] (HAS_FLAGS; none without) else -1
    """
    o = tl.arange(0, BN)
    for start in range(0, B, BN):
        b = start + o
        m = b < B
        if INDEXED:
            s = tl.load(idx + b, mask=m, other=-1).to(tl.int64)
        else:
            s = b.to(tl.int64)
        w = tl.where((s != pad) & (s >= 0) & (s < S), s, -1)
        if HAS_FLAGS:
            r = tl.where(tl.load(init + b, mask=m, other=0) != 0, w, -1)
        else:
            r = w * 0 - 1
        tl.store(rows + b * 2, w.to(tl.int32), mask=m)
        tl.store(rows + b * 2 + 1, r.to(tl.int32), mask=m)


VLLM_ROWS_BLOCK = 256    # vllm_conv_rows_kernel's BN (fixed: one variant)


def vllm_conv_update_config(D: int, B: int = 1, tokens: int = 1) -> dict:
    """conv_update_slots_kernel's pinned config for B requests of D channels bringing `tokens` tokens in all (more
    than B: several per request, as in speculative verification). No autotune: it writes conv_state in place and runs
    in CUDA graphs.

    Swept on an H200 (benchmarks/RESULTS.md, 2026-11-28; D = 8192, per layer of a 32-layer graph): narrow programs
    where few requests leave most SMs idle (one token, B = 1: 32 channels in one warp, 2.55 us against 2.71 for 256 in
    4; 1 + 3 tokens, B <= 8: 3.1 / 4.1 us against 4.3 / 5.0), 64 channels in one warp for 1 + k tokens up to B = 32,
    else 256 channels in 4 warps. The interpreter: at most 128."""
    multi_token = tokens > B
    if B <= 1 or (multi_token and B <= 8):
        bd, nw = 32, 1
    elif multi_token and B <= 32:
        bd, nw = 64, 1
    else:
        bd, nw = 256, 4
    if is_interpreting():
        bd = min(bd, 128)
    return dict(BD=max(16, min(bd, next_pow2(D))), num_warps=nw)
