"""The recurrent kernel: the time loop with the state in registers, handy for short T.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   h0, ht: [N, HV, K, V] fp32
    S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

``recurrent_kernel`` (grid (cdiv(V, BV), N * HV)), the twin of refgdn.recurrent_gated_delta_rule, and its
pinned config; the public function that launches it, ``recurrent_gated_delta_rule``, is in the package
``fast.chunk``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import Relaunch, launch
from ..utils import is_interpreting, next_pow2
from .common import L2NORM_EPS, _beta_of, _exp, _gate, _precise, _seq_coords


# ============================================================================================
# recurrent kernel: the time loop, state in registers
# ============================================================================================

@triton.jit
def _load_token(q_base, k_base, v_base, g_base, b_base, t64, s_qt, s_kt, s_vt, s_gt, s_bt, o_k, o_v, m_k, m_v):
    """Token t64's q, k [BK], v [BV], g in fp32 and its beta as stored (the caller maps it: common._beta_of)."""
    b_q = tl.load(q_base + t64 * s_qt + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k_base + t64 * s_kt + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v_base + t64 * s_vt + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g_base + t64 * s_gt).to(tl.float32)
    return b_q, b_k, b_v, b_g, tl.load(b_base + t64 * s_bt)


@triton.jit
def _delta_step(b_h, b_q, b_k, b_v, b_g, b_beta, scale, L2NORM: tl.constexpr, EPS: tl.constexpr,
                PRECISE: tl.constexpr):
    """One token of the delta rule on the [BK, BV] state block b_h (fp32) -> (b_h, o [BV]):

        S <- exp(g) S ;  S <- S + k (beta (v - S^T k))^T ;  o = scale S^T q     (q, k l2-normalised first if L2NORM)
    """
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + EPS)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + EPS)
    b_h *= _exp(b_g, PRECISE)
    b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))           # beta (v - S^T k)
    b_h += b_k[:, None] * b_v[None, :]
    return b_h, tl.sum(b_h * b_q[:, None], 0) * scale


@triton.jit(do_not_specialize=["T"])
def recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, o, ht,
    cu_seqlens, T, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, GATE: tl.constexpr, L2NORM: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, THRESHOLD: tl.constexpr, EPS: tl.constexpr, PRECISE: tl.constexpr,
    BETA_LOGITS: tl.constexpr = 0,
):
    """Per (V-block, sequence, value head), for each token t in order (all in fp32):

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    q, k: [B, T, H, K], v: [B, T, HV, V], g, beta: [B, T, HV] (strided, unit last-dim stride for q, k, v);
    h0, ht: [N, HV, K, V] fp32; o: [B, T, HV, V] contiguous. grid = (cdiv(V, BV), N * HV).
    PRECISE (fp32 inputs): range-reduced exp (``_exp``). BETA_LOGITS 1 / 2: beta holds logits, beta = sigmoid
    (x 2) formed per token (common._beta_of).
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_b, bos, eos = _seq_coords(i_n, cu_seqlens, T, IS_VARLEN)
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
        b_q, b_k, b_v, b_g, b_beta = _load_token(q_base, k_base, v_base, g_base, b_base, t64, s_qt, s_kt, s_vt,
                                                 s_gt, s_bt, o_k, o_v, m_k, m_v)
        b_beta = _beta_of(b_beta, True, BETA_LOGITS, PRECISE)
        if GATE:
            b_g = _gate(b_g, A_log_h, dt_bias_h, THRESHOLD, PRECISE)
        b_h, b_o = _delta_step(b_h, b_q, b_k, b_v, b_g, b_beta, scale, L2NORM, EPS, PRECISE)
        tl.store(o + ((i_b * T + t64) * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_HT:
        tl.store(ht + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, b_h, mask=m_kv)


# ============================================================================================
# host side: pinned config
# ============================================================================================

def recurrent_config(K: int, V: int) -> dict:
    """Recurrent kernel: state [BK, BV] fp32 in one warp's registers (<= 64 per thread), reductions over
    K stay inside the warp. Interpreter: one V-block."""
    BK = next_pow2(K)
    if is_interpreting():
        return dict(BV=min(next_pow2(V), 64), num_warps=4, num_stages=1)
    BV = min(next_pow2(V), max(8, 2048 // BK))
    return dict(BV=BV, num_warps=1, num_stages=1)


# ============================================================================================
# the serving form (vLLM's fused_recurrent_gated_delta_rule): states read from and written to a slot pool
# ============================================================================================

WRITE_NONE, WRITE_FINAL, WRITE_EACH_SLOT, WRITE_EACH_ROW = 0, 1, 2, 3   # where recurrent_slots_kernel stores states
WRITE_EACH_SLOT_AND_FINAL = 4    # WRITE_EACH_SLOT's cache rows, and the final state to the pool (FlashInfer's MTP)


@triton.jit
def _masked_by(m, cond):
    """Block mask m and a scalar condition (integer arithmetic: the interpreter rejects ``block & scalar_bool``
    as a mask, fast.serving._as_block)."""
    return m & ((m.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


@triton.jit(do_not_specialize=["T", "S", "L", "SW"])
def recurrent_slots_kernel(
    q, k, v, g, beta, pool, o, hs, cu_seqlens, idx, num_acc, A_log, dt_bias, widx, T, S, L, SW, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    s_pn, s_ph, s_pk, s_pv, s_hn, s_hh, s_hk, s_hv, s_in, s_it, s_wn, s_wt,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, USE_POOL: tl.constexpr, INDEXED: tl.constexpr,
    SPEC: tl.constexpr, WRITE: tl.constexpr, EPS: tl.constexpr, PRECISE: tl.constexpr,
    GATE: tl.constexpr = False, SLOT_LO: tl.constexpr = 0, THRESHOLD: tl.constexpr = 20.0,
    PAD_ZERO: tl.constexpr = True, WIDX: tl.constexpr = 0, FINAL_IDX: tl.constexpr = False,
):
    """Per (V-block, sequence, value head): the recurrent_kernel's time loop, its state read from a slot of
    ``pool`` [S, HV, K, V] (strided) and stored per WRITE (fast.vllm_ops.fused_recurrent_gated_delta_rule):

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    GATE (fast.vllm_ops.fused_recurrent_gated_delta_rule_packed_decode): g and beta hold the raw gate projections a
    and b, and each token's gates are formed here: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
    Absent pointers (pool, cu_seqlens, idx, num_acc, A_log, dt_bias) are None: only their constexpr branches read them.
    Read slot: INDEXED, idx[n, col] with col = num_acc[n] - 1 (SPEC) or 0 (idx [N] is [N, 1] with s_it unused);
    else pool[n] (USE_POOL) or zeros. A slot outside [SLOT_LO, S) marks a padded sequence: o zeros, no pool store
    (SLOT_LO 1: slot 0 is vLLM's null block; memory safety: the host checks name such values only when asked), and
    a per-token write entry outside it is skipped;
    PAD_ZERO False (SGLang's padding): a padded sequence's outputs are computed from a zero state instead (and its
    WIDX cache rows written; with PAD_ZERO they are not).
    WIDX (SGLang's target verify, a cache of L steps per row): WRITE_EACH_SLOT's destinations are rows of hs
    [SW, HV, K, V] instead, row * L + j for the state after token j, whatever the read slot; row = widx[n] (WIDX 1,
    widx [N] int; negative: none) or n (WIDX 2, widx None); a destination outside [0, SW) is skipped. WIDX 3
    (FlashInfer's per-token pool scatter): the state after token j to pool row widx[n, j] (widx [N, L] int; hs is the
    pool; outside [SLOT_LO, S): skipped), whatever the read slot.
    WRITE_FINAL: the final state to the read
    row (if any token); WRITE_EACH_SLOT: the state after token j to idx[n, j] (j < L, slots in [SLOT_LO, S)) -- hs is
    pool then; WRITE_EACH_ROW: the state after token t to row t of hs [B * T, HV, K, V] (zeros when padded);
    WRITE_EACH_SLOT_AND_FINAL (FlashInfer's MTP with its state update on): WRITE_EACH_SLOT's cache rows (WIDX), and the
    final state to the pool (its strides) as WRITE_FINAL. FINAL_IDX (FlashInfer's output_state_indices; WIDX 0 or 2):
    the final state goes to pool row widx[n] instead of the read slot (outside [SLOT_LO, S): not stored), for a
    sequence that was read (a padded one writes nothing).
    Stores round to the destination's dtype; the running state stays fp32 in registers.
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_b, bos, eos = _seq_coords(i_n, cu_seqlens, T, IS_VARLEN)
    if IS_VARLEN:               # offsets unchecked on the host (graph capture): clamped to [0, T], bos <= eos
        bos = tl.minimum(tl.maximum(bos, 0), T)
        eos = tl.minimum(tl.maximum(eos, bos), T)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    i_hk = i_h // GROUP
    if INDEXED:
        p_idx = idx + i_n.to(tl.int64) * s_in
        col = 0
        if SPEC:
            col = tl.load(num_acc + i_n).to(tl.int64) - 1
            col = tl.minimum(tl.maximum(col, 0), L - 1)       # memory safety for out-of-range counts
        slot = tl.load(p_idx + col * s_it).to(tl.int64)
        valid = (slot >= SLOT_LO) & (slot < S)
    else:
        slot = i_n.to(tl.int64)
        valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_POOL:
        p_read = pool + slot * s_pn + i_h * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
        b_h += tl.load(p_read, mask=_masked_by(m_kv, valid), other=0.0).to(tl.float32)

    q_base = q + i_b * s_qb + i_hk * s_qh
    k_base = k + i_b * s_kb + i_hk * s_kh
    v_base = v + i_b * s_vb + i_h * s_vh
    g_base = g + i_b * s_gb + i_h * s_gh
    b_base = beta + i_b * s_bb + i_h * s_bh
    if GATE:
        A_log_h = tl.load(A_log + i_h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias + i_h).to(tl.float32)
    for t in range(bos, eos):
        t64 = (i_b * 0 + t).to(tl.int64)
        b_q, b_k, b_v, b_g, b_beta = _load_token(q_base, k_base, v_base, g_base, b_base, t64, s_qt, s_kt, s_vt,
                                                 s_gt, s_bt, o_k, o_v, m_k, m_v)
        if GATE:                                     # b_g, b_beta hold a, b: the gates in fp32, beta never rounded
            b_g = _gate(b_g, A_log_h, dt_bias_h, THRESHOLD, PRECISE)
            b_beta = _beta_of(b_beta, True, 1, PRECISE)
        b_h, b_o = _delta_step(b_h, b_q, b_k, b_v, b_g, b_beta.to(tl.float32), scale, L2NORM, EPS, PRECISE)
        if PAD_ZERO:
            b_o = tl.where(valid, b_o, 0.0)
        tl.store(o + ((i_b * T + t64) * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if WRITE == 2 or WRITE == 4:                                     # WRITE_EACH_SLOT (and final)
            j = t64 - bos
            if WIDX == 3:                            # FlashInfer's per-token scatter: widx [N, L], read slot apart
                dest = tl.load(widx + i_n.to(tl.int64) * s_wn + tl.minimum(j, L - 1) * s_wt).to(tl.int64)
                ok = valid & (j < L) & (dest >= SLOT_LO) & (dest < S)
            elif WIDX != 0:
                if WIDX == 1:
                    row = tl.load(widx + i_n.to(tl.int64) * s_wn).to(tl.int64)
                else:
                    row = i_n.to(tl.int64)
                dest = row * L + j                           # (row < SW first: no overflow for any row)
                ok = (j < L) & (row >= 0) & (row < SW) & (dest < SW)
                if PAD_ZERO:                                 # FlashInfer's padding: a padded row caches nothing
                    ok = ok & valid
            else:
                dest = tl.load(p_idx + tl.minimum(j, L - 1) * s_it).to(tl.int64)
                ok = valid & (j < L) & (dest >= SLOT_LO) & (dest < S)
            dest = tl.where(ok, dest, 0)
            tl.store(hs + dest * s_hn + i_h * s_hh + o_k[:, None] * s_hk + o_v[None, :] * s_hv,
                     b_h.to(hs.dtype.element_ty), mask=_masked_by(m_kv, ok))
        elif WRITE == 3:                                                 # WRITE_EACH_ROW
            row = i_b * T + t64
            tl.store(hs + row * s_hn + i_h * s_hh + o_k[:, None] * s_hk + o_v[None, :] * s_hv,
                     tl.where(valid, b_h, 0.0).to(hs.dtype.element_ty), mask=m_kv)
    if WRITE == 1 or WRITE == 4:                                         # WRITE_FINAL: where it was read from
        dest = slot
        ok = valid & (eos > bos)
        if FINAL_IDX:                                                    # ... or to widx[n]
            dest = tl.load(widx + i_n.to(tl.int64) * s_wn).to(tl.int64)
            ok = ok & (dest >= SLOT_LO) & (dest < S)
            dest = tl.where(ok, dest, 0)
        if WRITE == 4:                  # hs holds the per-token cache: the final state goes to the pool
            tl.store(pool + dest * s_pn + i_h * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv,
                     b_h.to(pool.dtype.element_ty), mask=_masked_by(m_kv, ok))
        else:
            tl.store(hs + dest * s_hn + i_h * s_hh + o_k[:, None] * s_hk + o_v[None, :] * s_hv,
                     b_h.to(hs.dtype.element_ty), mask=_masked_by(m_kv, ok))


def is_v_major(states: torch.Tensor) -> bool:
    """Whether a [..., K, V] view of states has its K rows contiguous (stride 1 along K, not along V): newer vLLM's
    [S, HV, V, K] pools seen transposed. slots_config's v_major (a meta tensor does: only strides are read)."""
    return states.stride(-2) == 1 and states.stride(-1) != 1


def slots_config(K: int, V: int, N: int, per_token: bool, state_dtype: torch.dtype = torch.float32,
                 v_major: bool = False) -> dict:
    """recurrent_slots_kernel's pinned config: recurrent_config's (a [BK, BV] state block in one warp), by the
    stored states' dtype (state_dtype: the pool's, or of the per-row states written). Per layer of a 32-layer
    graph, H200, HV = 32, K = V = 128, 1 + 3 tokens when per-token (benchmarks.bench_vllm; RESULTS.md 2026-11-28):
    - float32, with a store of every token's state (per_token) a wider block for N > 2 requests and a narrower one
      for fewer: N = 1 BV 8 10.9 us vs 13.5 at BV 16; N = 8 BV 32 29.6 vs 36.9; N = 32 BV 32 110 vs 117. Decode
      (one store at the end) is fastest at recurrent_config's BV 16 for N = 1, 8, 32.
    - 16-bit states (vLLM's default SSM cache dtype): decode BV 16 / 32, us, N = 1 4.64 / 4.96, N = 8 9.25 / 8.49,
      N = 32 30.7 / 30.0, N = 128 113.7 / 108.0: BV 32 above two requests; per token BV 8 / 16 / 32: N = 1 12.1 /
      10.5 / 12.1, N = 8 45.1 / 20.1 / 19.8, N = 32 182 / 72.8 / 74.2: BV 16.
    - v_major (the pool's K stride is 1: newer vLLM's [S, HV, V, K] pools, the packed decode's; each V-row of a block
      is K contiguous elements), decode (2026-11-28 20:03, the packed decode, one round): float32 BV 8 / 16 / 32, us,
      N = 1 4.94 / 5.09 / 7.96, N = 8 12.69 / 12.75 / 15.18, N = 32 38.0 / 39.2 / 44.8, N = 128 136.7 / 140.3 / 143.0;
      bfloat16 N = 1 4.13 / 4.19 / 5.05, N = 8 9.82 / 8.50 / 8.93, N = 32 26.4 / 25.4 / 28.7, N = 128 90.3 / 87.3 /
      98.0 (two warps or BV 64: slower): BV 8 for float32, BV 16 for 16-bit states.
    Pinned (no autotune: the kernel writes the pool in place and runs inside CUDA graphs)."""
    cfg = recurrent_config(K, V)
    if is_interpreting():
        return cfg
    if v_major and not per_token:
        cfg["BV"] = min(next_pow2(V), 16 if state_dtype.itemsize == 2 else 8)
    elif state_dtype.itemsize == 2:
        cfg["BV"] = min(next_pow2(V), 16 if per_token or N <= 2 else 32)
    elif per_token:
        cfg["BV"] = min(next_pow2(V), 8 if N <= 2 else 32)
    return cfg


SLOTS_TENSORS = ("q", "k", "v", "g", "beta", "pool", "o", "hs", "cu_seqlens", "idx", "num_acc", "A_log", "dt_bias",
                 "widx")                                 # recurrent_slots_kernel's tensor arguments, in order


def slots_launch(q, k, v, g, beta, pool, o, hs, *, H: int, L: int, scale: float, write: int, l2norm: bool,
                 cu_seqlens=None, idx=None, num_acc=None, A_log=None, dt_bias=None, widx=None, cache: bool = False,
                 gate: bool = False, slot_lo: int = 0, pad_zero: bool = True, final_idx=None, token_slots=None):
    """Everything recurrent_slots_kernel is launched with, from shapes, strides and dtypes only (meta tensors do):
    -> (grid, args, constexprs, options), or None when there is nothing to launch (no sequence, head or token).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   pool: [S, HV, K, V] or None   o: [B, T, HV, V]
    hs: the states written (the pool, rows [R, HV, K, V] or a cache)   idx: [N] or [N, L]
    cache (with WRITE_EACH_SLOT: SGLang's target verify): hs is a cache of L steps per row, sequence n's at row
    widx[n] ([N] int; negative: none) or, widx None, row n (the kernel's WIDX)
    final_idx ([N] int, WRITE_FINAL / WRITE_EACH_SLOT_AND_FINAL; FlashInfer's output_state_indices): the final state
    goes to pool row final_idx[n] instead of the read slot (passed as the kernel's widx: not with widx)
    token_slots ([N, L] int, WRITE_EACH_SLOT; FlashInfer's ssm_state_indices): the state after token j goes to pool
    row token_slots[n, j] whatever the read slot (the kernel's WIDX 3, widx; hs is the pool)
    The serving ops (fast.vllm_ops, fast.sglang_ops) launch through launch_slots and fast.keys predicts their
    variants from the same plan, so the ~50 arguments are spelled once. Absent tensors pass strides 0.
    """
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    if N * HV == 0 or B * T == 0:
        return None
    cfg = slots_config(K, V, N, write != WRITE_FINAL, hs.dtype, is_v_major(hs))
    BV = cfg.pop("BV")
    strides = lambda t, n: tuple(t.stride()) if t is not None else (0,) * n         # noqa: E731
    s_idx = (0, 0) if idx is None else (idx.stride(0), idx.stride(1) if idx.dim() == 2 else 0)
    # the kernel reads A_log[h], dt_bias[h] at unit stride: any caller's strided [HV] view made contiguous here
    A_log, dt_bias = (None if t is None else t.contiguous() for t in (A_log, dt_bias))
    wdim = None if widx is None else 1 if cache else 0
    if final_idx is not None:
        assert widx is None and write in (WRITE_FINAL, WRITE_EACH_SLOT_AND_FINAL), "final_idx: the kernel's widx"
        widx, wdim = final_idx, 0
    if token_slots is not None:
        assert widx is None and write == WRITE_EACH_SLOT and not cache, "token_slots: the kernel's widx"
        widx, wdim = token_slots, 2
    args = (q, k, v, g, beta, pool, o, hs, cu_seqlens, idx, num_acc, A_log, dt_bias, widx,
            T, pool.shape[0] if pool is not None else 0, L, hs.shape[0] if cache else 0, scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3], *beta.stride()[:3],
            *strides(pool, 4), *hs.stride(), *s_idx, widx.stride(0) if widx is not None else 0,
            widx.stride(1) if wdim == 2 else 0)
    constexprs = dict(HV=HV, GROUP=HV // H, K=K, V=V, BK=next_pow2(K), BV=BV, IS_VARLEN=cu_seqlens is not None,
                      L2NORM=bool(l2norm), USE_POOL=pool is not None, INDEXED=idx is not None,
                      SPEC=num_acc is not None, WRITE=write, EPS=L2NORM_EPS, PRECISE=_precise(v.dtype), GATE=gate,
                      SLOT_LO=slot_lo, THRESHOLD=20.0, PAD_ZERO=pad_zero,
                      WIDX=(1 if wdim == 1 else 2) if cache else 3 if wdim == 2 else 0,
                      FINAL_IDX=final_idx is not None)
    return (triton.cdiv(V, BV), N * HV), args, constexprs, cfg


def launch_slots(*args, **kwargs) -> None:
    """Launch recurrent_slots_kernel as slots_launch (same arguments) plans it; nothing when there is no work."""
    plan = slots_launch(*args, **kwargs)
    if plan is not None:
        grid, kernel_args, constexprs, options = plan
        launch(recurrent_slots_kernel, grid, dict(constexprs, **options), *kernel_args)


class SlotsPlan:
    """recurrent_slots_kernel's launch for one call layout of a serving op, kept by the op's fast.launch.LayoutPlans
    so a layout seen before skips the op's host checks, slots_launch and Triton's launch path (the eager packed
    decode: ~140-190 us of host time per call -> ~30 on the CPU stand-in of benchmarks.host_overhead).

    launch: a Relaunch; head / tail: the scalar arguments before and after scale (fixed by the layout's metadata);
    M: 1 when there is something to launch; direct: nothing the launch reads is a per-call copy (A_log, dt_bias
    contiguous; the op checks its own views)."""
    __slots__ = ("launch", "head", "tail", "M", "direct")

    def run(self, tensors: tuple, scale: float) -> None:
        """tensors: the 14 of SLOTS_TENSORS, in order (tensors, fast.launch.Offset addresses, None for absent)."""
        self.launch(*tensors, *self.head, scale, *self.tail)


def slots_plan(*args, **kwargs) -> SlotsPlan:
    """The SlotsPlan of slots_launch(*args, **kwargs) (same arguments: the call the plan's later calls repeat)."""
    p = SlotsPlan()
    plan = slots_launch(*args, **kwargs)
    p.M, p.direct = 0, False
    if plan is None:
        return p
    grid, kernel_args, constexprs, options = plan
    n = len(SLOTS_TENSORS)
    p.head, p.tail = kernel_args[n:n + 4], kernel_args[n + 5:]      # (T, S, L, R), then the strides; scale between
    p.M = 1
    p.direct = all(t is None or t.is_contiguous() for t in (kwargs.get("A_log"), kwargs.get("dt_bias")))
    p.launch = Relaunch(recurrent_slots_kernel, grid, {**constexprs, **options})
    return p
