"""Triton backward of the causal depthwise conv1d (refgdn.conv_bwd.causal_conv1d_bwd's twin).

    x: [B, T, D]   weight: [D, W]   bias: [D]   initial_state: [N, D, W-1]   dy: [B, T, D]
    y_t = act(bias + sum_{j} weight[:, j] x_{t-W+1+j})       dz = dy * act'(z) (z: the pre-activation)

    dx_t = sum_{k=0}^{W-1} weight[:, W-1-k] dz_{t+k}   (+ dfinal where x_t is one of the last W-1 inputs)
    dweight[:, j] = sum_t dz_t x_{t-W+1+j} ;  dbias = sum_t dz_t ;  dinitial_state: dx of positions < 0

What is saved and why: the forward saves only its inputs (x, weight, bias, initial_state); z is
recomputed here (W multiply-adds per element, from rows the tile reads anyway) instead of storing a
[B, T, D] pre-activation.

One kernel, ``causal_conv1d_bwd_kernel``: a program owns BT rows x BD channels of one sequence; it
recomputes dz on its rows shifted by 0..W-1 (the shifted reads hit L1/L2), writes dx, and per-program
partial sums of dweight and dbias ([tiles, W, D] fp32, summed on the host: a deterministic reduction,
no atomics); the first tile of a sequence also writes dinitial_state. Pinned config, no autotune.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .utils import cdiv, is_interpreting, next_pow2, prepare_chunk_indices


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


@triton.jit(do_not_specialize=["T"])
def causal_conv1d_bwd_kernel(
    x, dy, weight, bias, initial_state, dfinal, cu_seqlens, tile_table,
    dx, dw_part, db_part, dinit,
    T, D,
    stride_x_b, stride_x_t, stride_x_d, stride_dy_b, stride_dy_t,
    stride_w_d, stride_w_w, stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
    IS_VARLEN: tl.constexpr, FP64: tl.constexpr,
):
    """grid = (cdiv(D, BD), tiles, B). x: [B, T, D] (any strides); dy: [B, T, D] (unit channel stride);
    dfinal, dinit: [N, D, W-1] contiguous; dx: [B, T, D] contiguous; dw_part: [B * tiles, W, D] and
    db_part: [B * tiles, D] (compute dtype). Tiles: dense cdiv(T, BT) per batch row, varlen the rows of
    tile_table [NT, 2] = (sequence, tile within the sequence). BW = next_pow2(W - 1) rows for dinit."""
    if FP64:
        DT: tl.constexpr = tl.float64
    else:
        DT: tl.constexpr = tl.float32
    i_d = tl.program_id(0)
    i_t = tl.program_id(1)
    i_b = tl.program_id(2)
    if IS_VARLEN:
        i_n = tl.load(tile_table + i_t * 2).to(tl.int64)
        i_tt = tl.load(tile_table + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        x_base = x + bos * stride_x_t
        dy_base = dy + bos * stride_dy_t
        dx_base = dx + bos * D
        i_part = i_t.to(tl.int64)
    else:
        i_n = i_b.to(tl.int64)
        i_tt = i_t.to(tl.int64)
        L = T
        x_base = x + i_n * stride_x_b
        dy_base = dy + i_n * stride_dy_b
        dx_base = dx + i_n * T * D
        i_part = i_n * tl.num_programs(1) + i_t
    s_off = i_n * stride_s_n
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = i_tt * BT + tl.arange(0, BT).to(tl.int64)
    m_r = rows < L

    # dx_t = sum_k weight[:, W-1-k] dz_{t+k}; dweight / dbias partials from dz on this tile's rows
    b_dx = tl.zeros([BT, BD], dtype=DT)
    b_db = tl.zeros([BD], dtype=DT)
    for kk in tl.static_range(W):
        b_dz = _dz(x_base, dy_base, weight, bias, initial_state, s_off, rows + kk, L, o_d, m_d,
                   stride_x_t, stride_x_d, stride_dy_t, stride_w_d, stride_w_w, stride_s_d, stride_s_w,
                   W, SILU, HAS_BIAS, HAS_INIT, DT)
        wk = tl.load(weight + o_d * stride_w_d + (W - 1 - kk) * stride_w_w, mask=m_d, other=0).to(DT)
        b_dx += wk[None, :] * b_dz
        if kk == 0:                                       # dz on the tile's own rows
            b_db = tl.sum(b_dz, 0)
            for j in tl.static_range(W):
                xin = _load_in(x_base, initial_state, s_off, rows - (W - 1) + j, L, o_d, m_d,
                               stride_x_t, stride_x_d, stride_s_d, stride_s_w, W, HAS_INIT, DT)
                tl.store(dw_part + (i_part * W + j) * D + o_d, tl.sum(b_dz * xin, 0), mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + i_part * D + o_d, b_db, mask=m_d)
    if HAS_DFINAL:
        # final_state[:, i] = x_{L-(W-1)+i}: rows t >= L-(W-1) get dfinal[:, t-L+W-1]
        col = rows - L + (W - 1)
        m_f = m_r & (col >= 0)
        b_dx += tl.load(dfinal + i_n * D * (W - 1) + o_d[None, :] * (W - 1) + col[:, None],
                        mask=m_f[:, None] & m_d[None, :], other=0).to(DT)
    tl.store(dx_base + rows[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])

    if HAS_INIT:
        if i_tt == 0:
            # positions p = -(W-1) .. -1 (initial_state column W-1+p), BW rows with the extra masked
            o_w = tl.arange(0, BW)
            pos = o_w.to(tl.int64) - (W - 1)
            m_p = o_w < W - 1
            b_di = tl.zeros([BW, BD], dtype=DT)
            # (names distinct from the block above: a runtime branch may not change a variable's shape)
            for kk in tl.static_range(W):
                b_dzi = _dz(x_base, dy_base, weight, bias, initial_state, s_off, pos + kk, L, o_d, m_d,
                            stride_x_t, stride_x_d, stride_dy_t, stride_w_d, stride_w_w, stride_s_d, stride_s_w,
                            W, SILU, HAS_BIAS, HAS_INIT, DT)
                wki = tl.load(weight + o_d * stride_w_d + (W - 1 - kk) * stride_w_w, mask=m_d, other=0).to(DT)
                b_di += wki[None, :] * b_dzi
            if HAS_DFINAL:                                # a sequence shorter than W-1 keeps initial inputs
                col_i = pos - L + (W - 1)
                m_fi = m_p & (col_i >= 0)
                b_di += tl.load(dfinal + i_n * D * (W - 1) + o_d[None, :] * (W - 1) + col_i[:, None],
                                mask=m_fi[:, None] & m_d[None, :], other=0).to(DT)
            tl.store(dinit + i_n * D * (W - 1) + o_d[None, :] * (W - 1) + (pos + (W - 1))[:, None],
                     b_di.to(dinit.dtype.element_ty), mask=m_p[:, None] & m_d[None, :])


def conv_bwd_config(T: int, D: int) -> dict:
    """Pinned: BT = 32 rows x BD = 128 channels, 8 warps (GPU); small tiles in the interpreter. Compiled for
    sm_90 (Triton 3.9, bf16, W = 4, silu; not timed): 4 warps spill 1.6 KB per thread (the W shifted dz
    recomputes keep many [BT, BD] tiles live), 8 warps 20 B."""
    if is_interpreting():
        return dict(BT=max(4, min(32, next_pow2(T))), BD=max(16, min(64, next_pow2(D))), num_warps=4)
    return dict(BT=32, BD=max(16, min(128, next_pow2(D))), num_warps=8)


def causal_conv1d_bwd(x, weight, dy, bias=None, activation=None, initial_state=None, cu_seqlens=None,
                      dfinal=None):
    """x: [B, T, D], weight: [D, W], dy: [B, T, D], bias: [D], initial_state, dfinal: [N, D, W-1]
    -> (dx [B, T, D] x.dtype, dweight [D, W] weight.dtype, dbias [D] or None, dinitial_state [N, D, W-1] or None).

        dx_t = sum_k weight[:, W-1-k] dz_{t+k} ;  dweight[:, j] = sum_t dz_t x_{t-W+1+j} ;  dbias = sum_t dz_t

    refgdn.conv_bwd.causal_conv1d_bwd's twin. Inputs are assumed validated (the forward did).
    """
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (x, weight, initial_state))
    cdt = torch.float64 if fp64 else torch.float32
    cfg = conv_bwd_config(T, D)
    BT, BD = cfg["BT"], cfg["BD"]
    if cu_seqlens is not None:
        tile_table = prepare_chunk_indices(cu_seqlens, BT)               # host read (eager only)
        n_tiles = tile_table.shape[0]
    else:
        tile_table, n_tiles = None, cdiv(T, BT)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    n_part = (B if cu_seqlens is None else 1) * n_tiles
    dw_part = torch.zeros(n_part, W, D, dtype=cdt, device=x.device)
    db_part = torch.zeros(n_part, D, dtype=cdt, device=x.device)
    dinit = torch.zeros(N, D, W - 1, dtype=initial_state.dtype, device=x.device) if initial_state is not None else None
    dfinal = dfinal.contiguous() if (dfinal is not None and W > 1) else None
    s = initial_state.stride() if initial_state is not None else (0, 0, 0)
    if n_tiles > 0 and D > 0:
        causal_conv1d_bwd_kernel[(cdiv(D, BD), n_tiles, B if cu_seqlens is None else 1)](
            x, dy, weight, bias, initial_state, dfinal, cu_seqlens, tile_table,
            dx, dw_part, db_part, dinit if dinit is not None else dx,
            T, D, *x.stride(), dy.stride(0), dy.stride(1), *weight.stride(), *s,
            W=W, BT=BT, BD=BD, BW=max(1, next_pow2(W - 1)),
            SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
            HAS_DFINAL=dfinal is not None, IS_VARLEN=cu_seqlens is not None, FP64=fp64,
            num_warps=cfg["num_warps"])
    if dinit is not None and n_tiles > 0 and cu_seqlens is not None:
        # zero-length sequences own no tile: their initial state only reaches the final state
        empty = (cu_seqlens[1:] == cu_seqlens[:-1])
        if dfinal is not None:
            dinit[empty] = dfinal[empty].to(dinit.dtype)
    elif dinit is not None and n_tiles == 0 and dfinal is not None:
        dinit.copy_(dfinal)
    dweight = dw_part.sum(0).t().contiguous().to(weight.dtype)           # [W, D] -> [D, W]
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinit
