"""Triton kernels for the causal depthwise conv1d in front of q, k, v, and its one-token update.

    y_t = act(bias + sum_{j=0}^{W-1} weight[:, j] * x_{t-W+1+j})        act: None or silu

Prefill (``causal_conv1d``) is a pure streaming op: every input row is read once from HBM and
every output row written once, so its speed limit is copy bandwidth. The kernel tiles
(time x channel): each program owns a [BT, BD] tile of y, contiguous along D for coalesced
loads, and reads its x tile W times, shifted by 0..W-1 rows (the W-1 halo rows before the tile
come from the previous tile, from initial_state, or are zero at a sequence start). The W shifted
reads overlap almost entirely, so they hit L1/L2: HBM traffic stays ~ read x + write y.
Varlen batches use a (tile -> sequence, tile-within-sequence) table, so no tile straddles two
sequences.

Configs are pinned by a small heuristic (``conv_fwd_config``), never autotuned at run time: the
update kernel mutates state in place and runs inside CUDA graphs (DESIGN.md invariant 2), and the
prefill kernel is bandwidth-bound with a flat optimum.

Semantics, dtypes and validation are refgdn.conv's: compute in float32 (float64 when x, weight or
the state is float64), y in x's dtype, states in initial_state's / conv_state's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from refgdn.checks import check_conv_inputs, check_conv_update_inputs

from .utils import cdiv, is_interpreting, next_pow2, prepare_chunk_indices


@triton.jit
def _silu(y):
    # silu(y) = y * sigmoid(y); sigmoid without overflow: exp only of -|y| <= 0
    e = tl.exp(-tl.abs(y))
    return y * tl.where(y >= 0, 1 / (1 + e), e / (1 + e))


@triton.jit(do_not_specialize=["T"])  # T is arithmetic below: keep it a runtime int even when T == 1
def causal_conv1d_fwd_kernel(
    x, y, weight, bias, initial_state, cu_seqlens, tile_table,
    T, D,
    stride_x_b, stride_x_t, stride_x_d,
    stride_w_d, stride_w_w,
    stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    IS_VARLEN: tl.constexpr, FP64: tl.constexpr,
):
    """x: [B, T, D] (any strides) -> y: [B, T, D] contiguous; one [BT, BD] tile of y per program.

    grid = (cdiv(D, BD), tiles, B): dense tiles = cdiv(T, BT); varlen (B == 1) tiles = rows of
    tile_table [NT, 2] = (sequence n, tile index within n).
    y_t = act(bias + sum_j w[:, j] * x_{t-W+1+j}), positions < 0 read initial_state[n, :, W-1+pos].
    """
    i_d = tl.program_id(0)
    i_t = tl.program_id(1)
    i_b = tl.program_id(2)
    if IS_VARLEN:
        i_n = tl.load(tile_table + i_t * 2).to(tl.int64)
        i_tt = tl.load(tile_table + i_t * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
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
            m_s = (m_t & (o_s < 0))[:, None] & m_d[None, :]
            b_s = tl.load(initial_state + i_n * stride_s_n + o_d[None, :] * stride_s_d
                          + (o_s + (W - 1))[:, None] * stride_s_w, mask=m_s, other=0).to(acc.dtype)
            b_x += b_s
        b_w = tl.load(weight + o_d * stride_w_d + j * stride_w_w, mask=m_d, other=0).to(acc.dtype)
        acc += b_x * b_w[None, :]

    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0).to(acc.dtype)[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(y_base + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["T"])
def causal_conv1d_final_state_kernel(
    x, final_state, initial_state, cu_seqlens,
    T, D,
    stride_x_b, stride_x_t, stride_x_d,
    stride_s_n, stride_s_d, stride_s_w,
    W: tl.constexpr, BD: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """final_state[n, :, i] = x_{L-(W-1)+i} of sequence n (i < W-1, oldest first); positions < 0
    come from initial_state[n, :, W-1+pos] (zero without one). final_state: [N, D, W-1] contiguous.
    grid = (cdiv(D, BD), N). A pure copy: values are only rounded to final_state's dtype on store.
    """
    i_d = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
        x_base = x + bos * stride_x_t
    else:
        L = T
        x_base = x + i_n * stride_x_b
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    for i in tl.static_range(W - 1):
        # source position, broadcast to a [BD] vector so masks are plain vector masks
        pos = tl.zeros([BD], dtype=tl.int32) + (L - (W - 1) + i)
        b = tl.load(x_base + pos.to(tl.int64) * stride_x_t + o_d * stride_x_d, mask=m_d & (pos >= 0), other=0)
        if HAS_INIT:
            b_s = tl.load(initial_state + i_n * stride_s_n + o_d * stride_s_d + (pos + (W - 1)) * stride_s_w,
                          mask=m_d & (pos < 0), other=0)
            b = tl.where(pos >= 0, b.to(final_state.dtype.element_ty), b_s.to(final_state.dtype.element_ty))
        tl.store(final_state + i_n * D * (W - 1) + o_d * (W - 1) + i, b.to(final_state.dtype.element_ty),
                 mask=m_d)


def conv_fwd_config(T: int, D: int, W: int) -> dict:
    """Pinned (BT, BD, num_warps) for the prefill kernel: a heuristic, never autotuned at run time.

    GPU: BD = 256 channels (512 B of bf16 per row: full 128 B lines, 16 B vectors per thread),
    BT = 32 rows, 8 warps: 8K outputs per program and a (W-1)/BT = 9% halo re-read that hits L1.
    Interpreter: one program per (small) tile, fewest programs.
    """
    if is_interpreting():
        return dict(BT=max(16, min(64, next_pow2(T))), BD=max(16, min(128, next_pow2(D))), num_warps=4)
    BD = max(16, min(256, next_pow2(D)))
    BT = max(16, min(32, next_pow2(T)))
    return dict(BT=BT, BD=BD, num_warps=8 if BT * BD >= 8192 else 4)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None):
    """x: [B, T, D], weight: [D, W], bias: [D], initial_state: [N, D, W-1] -> (y [B, T, D], final_state [N, D, W-1])

        y_t = act(bias + sum_{j=0}^{W-1} weight[:, j] * x_{t-W+1+j})      act: None or "silu"

    Varlen: B == 1 and cu_seqlens [N+1]. Inputs before a sequence's start come from initial_state
    (zeros when None). y in x.dtype; final_state (the last W-1 inputs of each sequence, oldest
    first; None unless output_final_state) in initial_state's dtype if given, else x's.
    refgdn.causal_conv1d's twin.
    """
    return causal_conv1d_with_config(x, weight, bias, activation, initial_state, output_final_state,
                                     cu_seqlens)


def causal_conv1d_with_config(x, weight, bias=None, activation=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, config: Optional[dict] = None):
    """causal_conv1d with ``config`` = dict(BT=, BD=, num_warps=) overriding the pinned config
    (for benchmark sweeps that choose the pinned values; each config is a separate compilation)."""
    N = check_conv_inputs(x, weight, bias, activation, initial_state, cu_seqlens)
    B, T, D = x.shape
    W = weight.shape[1]
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (x, weight, initial_state))
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    state_dtype = initial_state.dtype if initial_state is not None else x.dtype
    final = torch.empty(N, D, W - 1, dtype=state_dtype, device=x.device) if output_final_state else None
    if D == 0:
        return y, final
    cfg = dict(conv_fwd_config(T, D, W), **(config or {}))
    BT, BD = cfg["BT"], cfg["BD"]
    s = initial_state.stride() if initial_state is not None else (0, 0, 0)
    if cu_seqlens is not None:
        # host read of the lengths (eager prefill only, not for graph capture)
        tile_table = prepare_chunk_indices(cu_seqlens, BT)
        n_tiles = tile_table.shape[0]
    else:
        tile_table = None
        n_tiles = cdiv(T, BT)
    if n_tiles > 0:
        grid = (cdiv(D, BD), n_tiles, B)
        causal_conv1d_fwd_kernel[grid](
            x, y, weight, bias, initial_state, cu_seqlens, tile_table,
            T, D, *x.stride(), *weight.stride(), *s,
            W=W, BT=BT, BD=BD, SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None,
            HAS_INIT=initial_state is not None, IS_VARLEN=cu_seqlens is not None, FP64=fp64,
            num_warps=cfg["num_warps"])
    if output_final_state and W > 1 and N > 0:
        BDs = max(16, min(256, next_pow2(D)))
        causal_conv1d_final_state_kernel[(cdiv(D, BDs), N)](
            x, final, initial_state, cu_seqlens, T, D, *x.stride(), *s,
            W=W, BD=BDs, HAS_INIT=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
            num_warps=4)
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
    causal_conv1d_update_kernel[(cdiv(D, BD), N)](
        x, conv_state, weight, bias, y, D, *x.stride(), *conv_state.stride(), *weight.stride(),
        W=W, BD=BD, SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None, FP64=fp64,
        num_warps=4)
    return y
