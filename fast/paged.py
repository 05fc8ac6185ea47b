"""The paged prefill's bookkeeping (fast.flashinfer_ops.chunk_gated_delta_rule_paged): two small kernels where the
torch glue took ~60 launches, each with its stage twin in torch.

The chunked forward runs on a chunk-aligned row space: sequence n's tokens sit after pad_n zero rows, so its chunks
start at multiples of 64 of its whole history and every page boundary is a chunk boundary. The zero rows have beta 0
and decay 1 (the state passes through). Only the gates are written in that layout; q, k, v are read and o written at
the caller's rows (the kernels' IN_ROWS, fast.chunk.common._in_rows_of), so no token is copied.

``paged_rows_kernel`` (one program, the sequences in blocks): FlashInfer's slots from the page table (or the caller's),
and what the chunked forward takes from them:

    prefix = (num_pages - 1) page_size + last_page_len - len ;   pad = prefix mod 64 (0 for an empty sequence)
    cu_p[n + 1] = cu[n + 1] + sum_{m <= n} pad_m                  (the aligned layout's offsets)
    in_rows[n] = (cu_p[n] + pad_n, cu_p[n + 1], sum_{m <= n} pad_m)  (the rows holding the caller's tokens, the shift)
    slot_rows[n] = (last page or -1 when empty, the page of the last prefix token or -1)
    table[n] = (first crossed boundary in chunks of the aligned layout, its page-table entry, the last page's entry)

``paged_gates_kernel`` (rows of the aligned layout in blocks): the decay's log and beta, float32, at row p of
sequence n those of the caller's token p - d (in_rows[n] = (lo, hi, d), p in [lo, hi)), zeros on the pad_n rows in
front and past cu_p[N], formed on the way (alpha's log floored, or -exp(A_log) softplus(a + dt_bias); beta or
sigmoid(beta)). Values are never read on the host; any values stay memory-safe (offsets clamped into [0, T], rows
within T + 63 N, page-table entries within the table).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv, is_interpreting, next_pow2

GATES = {None: 0, "linear": 1, "log": 2, "raw": 3}       # paged_gates_kernel's GATE
BETAS = {None: 0, "prob": 1, "logit": 2}                 # ... and BETA
SOFTPLUS_THRESHOLD = 20.0


@triton.jit(do_not_specialize=["N", "T", "n_ids", "P"])
def paged_rows_kernel(cu, page_indices, page_indptr, last_page_len, s_read, s_final, s_ck, s_prefix,
                      cu_p, in_rows, slot_rows, table, N, T, n_ids, P, PS: tl.constexpr, GIVEN: tl.constexpr,
                      BN: tl.constexpr):
    """cu, page_indptr: [N+1]; last_page_len: [N]; s_*: the four slots [N] (written, or read when GIVEN);
    cu_p: [N+1] (cu's dtype); in_rows: [N, 3] int32; slot_rows: [N, 2] int32 (a page outside the pool's P: -1,
    nothing read or written there: memory safety for unchecked values); table: [N, 3] int32. One program."""
    carry = tl.zeros([1], dtype=tl.int64)
    tl.store(cu_p + tl.arange(0, 1), carry.to(cu_p.dtype.element_ty))
    for start in range(0, N, BN):
        n = start + tl.arange(0, BN)
        m = n < N
        lo = tl.minimum(tl.maximum(tl.load(cu + n, mask=m, other=0).to(tl.int64), 0), T)
        hi = tl.minimum(tl.maximum(tl.load(cu + n + 1, mask=m, other=0).to(tl.int64), 0), T)
        lens = tl.maximum(hi - lo, 0)
        p0 = tl.load(page_indptr + n, mask=m, other=0).to(tl.int64)
        p1 = tl.load(page_indptr + n + 1, mask=m, other=0).to(tl.int64)
        if GIVEN:
            read = tl.load(s_read + n, mask=m, other=-1).to(tl.int64)
            final = tl.load(s_final + n, mask=m, other=-1).to(tl.int64)
            ck = tl.load(s_ck + n, mask=m, other=0).to(tl.int64)
            prefix = tl.load(s_prefix + n, mask=m, other=0).to(tl.int64)
        else:
            some = p1 > p0
            last = tl.load(last_page_len + n, mask=m, other=0).to(tl.int64)
            prefix = tl.where(some, (p1 - p0 - 1) * PS + last - (hi - lo), 0)
            # floor division of a possibly negative prefix (unchecked values): Python's, as the twin's
            e_read = p0 + (prefix - 1 - ((prefix - 1) % PS + PS) % PS) // PS
            ok_r = m & some & (prefix > 0) & (e_read >= 0) & (e_read < n_ids)
            read = tl.where(ok_r, tl.load(page_indices + tl.where(ok_r, e_read, 0), mask=ok_r, other=-1), -1)
            ok_f = m & some & (p1 - 1 >= 0) & (p1 - 1 < n_ids)
            final = tl.where(ok_f, tl.load(page_indices + tl.where(ok_f, p1 - 1, 0), mask=ok_f, other=-1), -1)
            ck = p0 + (prefix - ((prefix % PS) + PS) % PS) // PS
            tl.store(s_read + n, read.to(tl.int32), mask=m)
            tl.store(s_final + n, final.to(tl.int32), mask=m)
            tl.store(s_ck + n, ck.to(tl.int32), mask=m)
            tl.store(s_prefix + n, prefix.to(tl.int32), mask=m)
        mod64 = ((prefix % 64) + 64) % 64
        pad = tl.where(m & (lens > 0), mod64, 0)
        cum = tl.cumsum(pad, 0) + carry
        tl.store(cu_p + n + 1, (hi + cum).to(cu_p.dtype.element_ty), mask=m)
        # the caller's tokens at aligned rows [lo + cum, hi + cum), row p holding row p - cum (an empty or inverted
        # range of unchecked offsets holds none)
        tl.store(in_rows + n * 3, (lo + cum).to(tl.int32), mask=m)
        tl.store(in_rows + n * 3 + 1, (hi + cum).to(tl.int32), mask=m)
        tl.store(in_rows + n * 3 + 2, cum.to(tl.int32), mask=m)
        carry += tl.sum(pad, 0)
        final = tl.where((final >= 0) & (final < P) & (lens > 0), final, -1)
        tl.store(slot_rows + n * 2, final.to(tl.int32), mask=m)
        tl.store(slot_rows + n * 2 + 1, tl.where((read >= 0) & (read < P), read, -1).to(tl.int32), mask=m)
        floor_ps = (prefix - ((prefix % PS) + PS) % PS) // PS
        first = ((floor_ps + 1) * PS - (prefix - mod64)) // 64
        tl.store(table + n * 3, first.to(tl.int32), mask=m)
        tl.store(table + n * 3 + 1, ck.to(tl.int32), mask=m)
        tl.store(table + n * 3 + 2, (p1 - 1).to(tl.int32), mask=m)


@triton.jit
def _rows_of(cu_p, p, N, STEPS: tl.constexpr):
    """The sequence of each aligned row p (largest n in [0, N) with cu_p[n] <= p), by binary search."""
    lo = tl.zeros(p.shape, dtype=tl.int64)
    hi = tl.zeros(p.shape, dtype=tl.int64) + N
    for _ in tl.static_range(STEPS):                    # lo < hi <= N throughout: mid in [0, N)
        mid = (lo + hi) // 2
        right = tl.load(cu_p + mid).to(tl.int64) <= p
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit(do_not_specialize=["N", "Tp"])
def paged_gates_kernel(g, beta, A_log, dt_bias, cu_p, in_rows, go, bo, N, Tp, s_gt, s_bt,
                       SAB: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr,
                       GATE: tl.constexpr, BETA: tl.constexpr, FLOOR: tl.constexpr, THRESHOLD: tl.constexpr):
    """g, beta: [T, SAB] (row strides) -> go (the decay's log), bo (beta): [Tp, SAB] float32 contiguous, every row
    written (the aligned layout's: module docstring). Row p of sequence n holds the caller's token p - d where
    in_rows[n] = (lo, hi, d) (paged_rows_kernel's; the kernels' rows, fast.chunk.common._in_rows_of) has p in
    [lo, hi); other rows hold zeros."""
    p = tl.program_id(0) * BR + tl.arange(0, BR)
    in_p = p < Tp
    rows = p.to(tl.int64)
    n = _rows_of(cu_p, rows, N, STEPS)
    lo = tl.load(in_rows + n * 3, mask=in_p, other=0).to(tl.int64)
    hi = tl.load(in_rows + n * 3 + 1, mask=in_p, other=0).to(tl.int64)
    d = tl.load(in_rows + n * 3 + 2, mask=in_p, other=0).to(tl.int64)
    real = in_p & (rows >= lo) & (rows < hi)
    src = tl.where(real, rows - d, 0)                                       # [BR] the token this row holds
    o_s = tl.arange(0, BS)
    m_s = o_s < SAB
    m = real[:, None] & m_s[None, :]
    out = in_p[:, None] & m_s[None, :]
    if GATE == 0:                                                            # no decay: log 0
        b_g = tl.zeros([BR, BS], dtype=tl.float32)
    else:
        x = tl.load(g + src[:, None] * s_gt + o_s[None, :], mask=m, other=1.0).to(tl.float32)
        if GATE == 1:                          # alpha: its log (precision hazard: log(0) = -inf, floored)
            b_g = tl.maximum(tl.log(x), FLOOR)
        elif GATE == 2:
            b_g = x
        else:                                  # -exp(A_log) softplus(a + dt_bias); the discarded branch's exp clamped
            xa = x + tl.load(dt_bias + o_s, mask=m_s, other=0.0).to(tl.float32)[None, :]
            sp = tl.where(xa > THRESHOLD, xa, tl.log(1 + tl.exp(tl.minimum(xa, THRESHOLD))))
            b_g = -tl.exp(tl.load(A_log + o_s, mask=m_s, other=0.0).to(tl.float32))[None, :] * sp
    tl.store(go + rows[:, None] * SAB + o_s[None, :], tl.where(m, b_g, 0.0), mask=out)
    if BETA == 0:
        b_b = tl.zeros([BR, BS], dtype=tl.float32) + 1.0
    else:
        x = tl.load(beta + src[:, None] * s_bt + o_s[None, :], mask=m, other=0.0).to(tl.float32)
        if BETA == 1:
            b_b = x
        else:                                  # sigmoid without overflow: exp of -|x| only
            e = tl.exp(-tl.abs(x))
            b_b = tl.where(x >= 0, 1 / (1 + e), e / (1 + e))
    tl.store(bo + rows[:, None] * SAB + o_s[None, :], tl.where(m, b_b, 0.0), mask=out)   # pad rows: beta 0


# ============================================================================================
# host side: launchers and the stage twins
# ============================================================================================

def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << max(n, 1).bit_length() - 1


def rows_config(N: int) -> dict:
    """paged_rows_kernel: one program over the sequences in blocks of BN (<= 1024), 4 warps."""
    return dict(BN=min(max(next_pow2(N), 16), 1024), num_warps=4, num_stages=1)


def gates_config(SAB: int) -> dict:
    """paged_gates_kernel: BR rows per program (~4K float32 elements of each gate, bandwidth-bound); the interpreter
    takes 64-row blocks (fewer programs to interpret)."""
    if is_interpreting():
        return dict(BR=64, num_warps=4, num_stages=1)
    # (BR >= 32: Triton 3.6 failed to compile the former copy's [16, .] tiles, TritonGPURemoveLayoutConversions)
    return dict(BR=max(32, min(256, prev_pow2(4096 // max(SAB, 1)))), num_warps=4, num_stages=1)


# the kernels' pointer arguments, in order (fast.keys names their dtypes from the plans below)
ROWS_TENSORS = ("cu", "page_indices", "page_indptr", "last_page_len", "s_read", "s_final", "s_ck", "s_prefix", "cu_p",
                "in_rows", "slot_rows", "table")
GATES_TENSORS = ("g", "beta", "A_log", "dt_bias", "cu_p", "in_rows", "go", "bo")


def modes(g, beta, gate_domain: str, use_gate_in_kernel: bool, beta_is_logit: bool) -> tuple:
    """paged_gates_kernel's (gate, beta) modes for chunk_gated_delta_rule_paged's arguments: keys of GATES, BETAS."""
    gate = None if g is None else "raw" if use_gate_in_kernel else gate_domain
    return gate, None if beta is None else "logit" if beta_is_logit else "prob"


def rows_launch(cu_seqlens, page_indices, page_indptr, last_page_len, slots: tuple, cu_p, in_rows, slot_rows, table,
                page_size: int, T: int, P: int, given: bool) -> tuple:
    """Everything paged_rows_kernel is launched with, from shapes and dtypes only (meta tensors do): (grid, args,
    constexprs, options). slots: the four [N] tensors (written, or read when ``given``)."""
    N = cu_seqlens.numel() - 1
    cfg = rows_config(N)
    ids = page_indices if page_indices.numel() else page_indptr          # (an empty table: never read)
    args = (cu_seqlens, ids, page_indptr, last_page_len, *slots, cu_p, in_rows, slot_rows, table, N, T,
            page_indices.numel(), P)
    return (1,), args, dict(PS=page_size, GIVEN=given, BN=cfg.pop("BN")), cfg


def launch_paged_rows(cu_seqlens, page_indices, page_indptr, last_page_len, page_size: int, T: int, P: int,
                      slots=None) -> tuple:
    """P: the pool's pages. -> (slots (4 x [N] int32; the given ones when slots), cu_p [N+1], in_rows [N, 3] int32,
    slot_rows [N, 2] int32, table [N, 3] int32)."""
    N = cu_seqlens.numel() - 1
    dev = cu_seqlens.device
    sl = slots if slots is not None else tuple(torch.empty(N, dtype=torch.int32, device=dev) for _ in range(4))
    cu_p = torch.empty(N + 1, dtype=cu_seqlens.dtype, device=dev)
    in_rows = torch.empty(N, 3, dtype=torch.int32, device=dev)
    slot_rows = torch.empty(N, 2, dtype=torch.int32, device=dev)
    table = torch.empty(N, 3, dtype=torch.int32, device=dev)
    grid, args, constexprs, options = rows_launch(cu_seqlens, page_indices, page_indptr, last_page_len, sl, cu_p,
                                                  in_rows, slot_rows, table, page_size, T, P, slots is not None)
    launch(paged_rows_kernel, grid, dict(constexprs, **options), *args)
    return sl, cu_p, in_rows, slot_rows, table


def paged_rows(cu_seqlens, page_indices, page_indptr, last_page_len, page_size: int, T: int, P: int,
               slots=None) -> tuple:
    """The stage twin of paged_rows_kernel in torch (refgdn.flashinfer_ops.gdn_paged_prefill_slots for the slots):
    the same five results from the same values (any values: the kernel's clamps)."""
    import refgdn.flashinfer_ops as RF
    if slots is None:
        slots = RF.gdn_paged_prefill_slots(cu_seqlens, page_indices, page_indptr, page_size, last_page_len)
    cu = cu_seqlens.long().clamp(0, T)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    prefix = slots.prefix_lens.long()
    pad = torch.where(lens > 0, prefix % 64, 0)
    cum = pad.cumsum(0)
    cu_p = torch.cat([cu[:1] * 0, cu[1:] + cum]).to(cu_seqlens.dtype)
    in_rows = torch.stack([cu[:-1] + cum, cu[1:] + cum, cum], 1).to(torch.int32)
    pool_row = lambda r: torch.where((r >= 0) & (r < P), r, -1)  # noqa: E731
    slot_rows = torch.stack([pool_row(torch.where(lens > 0, slots.output_state_indices.long(), -1)),
                             pool_row(slots.state_indices.long())], 1).to(torch.int32)
    first = (torch.div(prefix, page_size, rounding_mode="floor") + 1) * page_size - (prefix - prefix % 64)
    table = torch.stack([torch.div(first, 64, rounding_mode="floor"), slots.checkpoint_cu_starts.long(),
                         page_indptr.long()[1:] - 1], 1).to(torch.int32)
    return slots, cu_p, in_rows, slot_rows, table


def gates_launch(g, beta, A_log, dt_bias, cu_p, in_rows, outs: tuple, gate: Optional[str], beta_mode: Optional[str],
                 floor: float) -> tuple:
    """Everything paged_gates_kernel is launched with, from shapes, strides and dtypes only (meta tensors do): (grid,
    args, constexprs, options). outs: (go, bo), [Tp, sab] float32."""
    go, bo = outs
    Tp, SAB = go.shape
    N = in_rows.shape[0]
    gt = g if g is not None else go                                         # (not read without one)
    bt = beta if beta is not None else bo
    cfg = gates_config(SAB)
    BR = cfg.pop("BR")
    constexprs = dict(SAB=SAB, BS=next_pow2(SAB), BR=BR, STEPS=max(1, N.bit_length()), GATE=GATES[gate],
                      BETA=BETAS[beta_mode], FLOOR=floor, THRESHOLD=SOFTPLUS_THRESHOLD)
    args = (gt, bt, A_log if A_log is not None else go, dt_bias if dt_bias is not None else go, cu_p, in_rows, go,
            bo, N, Tp, gt.stride(0), bt.stride(0))
    return (cdiv(Tp, BR),), args, constexprs, cfg


def launch_paged_gates(g, beta, A_log, dt_bias, cu_p, in_rows, T: int, sab: int, gate: Optional[str],
                       beta_mode: Optional[str], floor: float) -> tuple:
    """g, beta: [T, sab] or None; cu_p, in_rows: launch_paged_rows' -> (the decay's log, beta), [Tp, sab] float32 in
    the aligned layout, Tp = T + 63 N."""
    Tp = T + 63 * in_rows.shape[0]
    outs = tuple(torch.empty(Tp, sab, dtype=torch.float32, device=cu_p.device) for _ in range(2))
    grid, args, constexprs, options = gates_launch(g, beta, A_log, dt_bias, cu_p, in_rows, outs, gate, beta_mode,
                                                   floor)
    launch(paged_gates_kernel, grid, dict(constexprs, **options), *args)
    return outs


def paged_gates(g, beta, A_log, dt_bias, cu_p, in_rows, T: int, sab: int, gate: Optional[str],
                beta_mode: Optional[str], floor: float) -> tuple:
    """The stage twin of paged_gates_kernel in torch: the same two tensors (by refgdn's formulas:
    refgdn.flashinfer_ops.paged_gates, float32), each token's gates at its aligned row (aligned_rows)."""
    import refgdn.flashinfer_ops as RF
    log_g, b = RF.paged_gates(g, beta, T, sab, "log" if gate == "raw" else gate or "log", gate == "raw", A_log,
                              dt_bias, beta_mode == "logit", torch.float32, cu_p.device,
                              log_floor=floor if gate == "linear" else None)
    dest = aligned_rows(in_rows, T)
    return tuple(x.new_zeros(T + 63 * in_rows.shape[0], sab).index_copy_(0, dest, x) for x in (log_g, b))


def aligned_rows(in_rows: torch.Tensor, T: int) -> torch.Tensor:
    """Each of the caller's T tokens' row in the chunk-aligned layout, [T] int64: t + d of its sequence (in_rows[n] =
    (lo, hi, d): the sequence's tokens are t in [lo - d, hi - d)), on the device."""
    lo, hi, d = in_rows.long().unbind(1)
    t = torch.arange(T, device=in_rows.device)
    seq = torch.searchsorted(hi - d, t, right=True).clamp_(max=max(in_rows.shape[0] - 1, 0))
    return t + d[seq]
