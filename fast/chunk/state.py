"""Step 4 of the chunked forward (refgdn.delta_rule.state_passing): kernel 3, its one sequential pass.

    k: [B, T, H, K]   w: [B, T, HV, K]   u: [B, T, HV, V]   G: [B, T, HV]   h0, ht: [N, HV, K, V] fp32
    -> h: [chunks, HV, K, V] (chunk-start states), v_new: [B, T, HV, V]
    h[c] = S ;  v_new = u - w S ;  S <- exp(G_last) S + K^T (exp(G_last - G) v_new)
    OUTPUT (step 5 fused in, q: [B, T, H, K] -> o: [B, T, HV, V]; h and v_new then never leave the pass):
    O = scale [ exp(G) * (Q S) + ((Q K^T) * exp(G_i - G_j) * causal) v_new ]

``chunk_state_kernel``: grid (cdiv(V, BV), N * HV), sequential over the chunks of a sequence with S fp32
[K, BV] in registers. Here too: its pinned config (``state_config``), launcher and the stage twin.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import refgdn
from refgdn.checks import check_chunk_size

from ..launch import launch
from ..utils import cdiv, is_interpreting, slot_row
from .common import (L2NORM_EPS, _beta_of, _blocks, _caller_rows, _cfg, _check_fast_limits, _Chunks,
                     _dot, _exp, _fp32_prec, _hi_lo, _in_rows_of, _is_fp64, _load_beta, _num_sms, _operand, _precise,
                     _rows16, _seq_coords, _seq_first_chunk, _seq_head, _small_smem, _unit_last, _upcast, _warp_mma)
from .output import _output_block
from .recurrent import _masked_by


# ============================================================================================
# kernel 3: state passing (sequential over chunks, state in registers)
# ============================================================================================

@triton.jit
def _dense_state(s_n, s_h, s_k, s_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Whether an initial / final state with these (row, head, K, V) strides is a contiguous [rows, HV, K, V] tensor
    (a runtime test, uniform over the program). The state pass then addresses it as before it took strides: from the
    constexpr K and V, through the [K, V] offsets its loop holds anyway. The strided form alone cost the forward
    ~8 us at B=4 T=4096 (the state kernel 390-392 us with this test, 397-399 without; H200, Triton 3.6, outputs bit
    for bit the same; benchmarks/RESULTS.md, 2026-11-29 21:15)."""
    return (s_n == HV * K * V) & (s_h == K * V) & (s_k == V) & (s_v == 1)


@triton.jit(do_not_specialize=["T", "NT", "ck_every", "ck_rows"])
def chunk_state_kernel(
    k, w, u, G, Gl, h0, h, v_new, ht, A, v, beta, q, o, qs,
    cu_seqlens, chunk_offsets, seq_order, slot_rows, ck, ck_starts, ck_idx, in_rows, T, NT, scale, ck_every, ck_rows,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh, s_qb, s_qt, s_qh,
    s_0n, s_0h, s_0k, s_0v, s_tn, s_th, s_tk, s_tv, s_cn, s_ch, s_ck, s_cv,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr, UPCAST: tl.constexpr,
    FROM_A: tl.constexpr = False, OUTPUT: tl.constexpr = False, L2NORM: tl.constexpr = False,
    EPS: tl.constexpr = 1e-6, PREFETCH_BETA: tl.constexpr = True, UPDATE_X2: tl.constexpr = False,
    H0_SLOTS: tl.constexpr = False, HT_SLOTS: tl.constexpr = False, BETA_LOGITS: tl.constexpr = 0,
    VN_SPLIT: tl.constexpr = False, CKPT: tl.constexpr = False, CK_PAGED: tl.constexpr = False,
    IN_ROWS: tl.constexpr = False, K_IN_ROWS: tl.constexpr = False,
):
    """Per (V-block, sequence, value head), for each chunk c of the sequence in order:

        h[c] = S ;   v_new = u - w S ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)

    k: [B, T, H, K] (strided, already l2-normalised when asked: kernel 1's kn); w: [B, T, HV, K],
    u, v_new: [B, T, HV, V], G: [B, T, HV] (contiguous); h0, ht: [N, HV, K, V] (any strides: s_0* / s_t*, Triton
    makes a unit one a constant; a contiguous one addressed through K and V: _dense_state; h0 any float dtype, ht
    fp32 but in a cache); h: [chunks, HV, K, V] (global chunk order).
    H0_SLOTS / HT_SLOTS (serving prefill, fast.serving.gdn_prefill): h0 / ht is a slot cache's ssm_state [S, HV,
    K, V] (float32 or bfloat16; any strides, e.g. vLLM's page-strided views, [V, K] blocks too), and sequence n reads
    slot slot_rows[n, 1] / writes slot slot_rows[n, 0] (int32 [N, 2]; -1: start from zeros / write nothing), in
    place: each program reads its block before any program of the call writes it (distinct slots, checked on the
    device before this launch). grid = (cdiv(V, BV), N * HV), V-block fastest (the
    V-blocks of one head share w and k via L2); varlen: sequences in seq_order (longest first, _seq_head).
    S: fp32 [BK, BV] kept in registers across all chunks; K is one block (<= 256). Both dots take 16-bit
    operands (S rounded to w's dtype, the decayed v_new to k's) with fp32 accumulation. Only loads that do
    not depend on S are issued per chunk, so the compiler's software pipeline (num_stages) prefetches the next
    chunk's w, u, k, G while this one computes. PRECISE: decays from the compensated (G, Gl) pairs (kernel 1).
    UPCAST (the backward's fp32 recompute): w and k tiles converted to fp32 after the load, so both dots keep
    S and v_new in fp32. VN_SPLIT (the backward's bf16x2 recompute; not with OUTPUT): v_new stored as its bf16
    hi + lo terms (common._hi_lo), hi in v_new and lo in o, the operands stage 3 of the backward would split it
    into (fast.chunk_bwd): the same bytes as fp32, no split and no fp32 tile there.

    FROM_A (the forward; the backward's recompute for bf16 inputs, fast.chunk_bwd): w and u are not read.
    With w = A diag(beta exp(G)) K and u = A diag(beta) V (kernel 2's definitions),
        v_new = u - w S = A (beta (V - exp(G) (K S))):
    one [BT, K] x [K, BV] dot with k's tile (the tile the update reads anyway), the difference in fp32, then a
    [BT, BT] x [BT, BV] dot with A (kernel 1's output, k's dtype), rounded to the dot dtype once, after the
    subtraction (u and w are rounded before it on the other path). A: [B, T, HV, BT], v: [B, T, HV, V] and beta:
    [B, T, HV] (strided; unit last-dim stride for v) stand for w and u (kernel 2 does not run in the forward; the
    backward runs it for w alone). PREC "bf16x2" (the backward's split recompute): S and r stay fp32, split into
    bf16 hi + lo in the dots (common._dot_split), as on the other path.

    PREFETCH_BETA (FROM_A): the next chunk's beta (rows HV elements apart) is loaded one chunk ahead instead of in
    its own chunk; which placement the compiler's pipeline serves better depends on the variant (state_prefetch_beta,
    measured). BETA_LOGITS (FROM_A): beta holds logits; beta = sigmoid (x 2 for 2) is formed after the
    load (common._beta_of, kernel 1's formula).

    UPDATE_X2 (bf16 inputs; the serving prefill, whose final state lives on in the cache): the update's decayed
    v_new stays fp32 and enters K^T v_new as two bf16 terms (hi + lo, _dot_split), one more dot per chunk. Of the
    pass's 16-bit roundings this one sets the final state's error: H200, Qwen3-Next shape, l2norm, initial states,
    final state max error against float64 at B=1 T=4096 3.86e-3 -> 1.86e-3, B=4 T=4096 4.22e-3 -> 2.51e-3; the
    chunk-start state split the same way for K S changed nothing. Device time +3 % (B=4 T=4096) to +9 % (B=1
    T=4096, T=65536): the public forward keeps one term, as fla does (benchmarks/RESULTS.md, 2026-11-27).

    CKPT (FlashInfer's state checkpoints, fast.flashinfer_ops): the state after every ck_every-th full chunk of a
    sequence, its j-th such state (j = 0, 1, ...) to row ck_starts[n] + j of ck [ck_rows, HV, K, V] (fp32, any
    strides: s_c*); a row outside [0, ck_rows) is not stored (memory safety for unchecked starts).
    CK_PAGED (with CKPT; FlashInfer's paged state cache, fast.flashinfer_ops.chunk_gated_delta_rule_paged): ck_starts
    is an int32 [N, 3] table (first, e0, e1) and ck_idx the page table's page ids: the state after chunk
    first + j ck_every (j = 0, 1, ...; a page boundary) goes to page ck_idx[e0 + j] while e0 + j < e1 (the pages
    before the last; the final state goes to the last one through HT_SLOTS).

    IN_ROWS (FlashInfer's paged prefill, with FROM_A; common._in_rows_of): v, and with OUTPUT q, qs and o, are the
    caller's tensors, at the caller's rows of in_rows [N, 3]; K_IN_ROWS: k too (the caller's k, not kernel 1's kn).

    OUTPUT (the forward, with FROM_A): kernel 4's work per chunk, here, on the operands the pass holds anyway:
    the chunk-start state as its dot operand (what h[c] would have stored) and v_new before its decay (rounded to
    o's dtype, as v_new would have been stored), so h and v_new are neither written nor read back (kernel 4 does
    not run):  O = scale [ exp(G) * (Q S) + ((Q K^T) * exp(G_i - G_j) * [i >= j]) v_new ]  (output._output_block,
    kernel 4's own code). q: [B, T, H, K] (strided, unit last-dim stride), o: [B, T, HV, V] contiguous; L2NORM
    normalises q's rows as kernel 4 does, by their scales qs: [B, T, H] fp32 (output.row_scales_kernel's, formed
    once per row: reducing q's tile here in every program cost the B=4 pass 13 % and the varlen mix's 19 %,
    RESULTS.md 2026-11-27). Q S and Q K^T hang off the pass's
    dependent chain (S -> v_new -> S), so they cost throughput, not latency: worth it where the pass is
    throughput-bound (many (sequence, head) pairs), not at B = 1. Q S alone at B = 1 (stored in place of h, kernel 4
    scaling it instead of forming Q h: half its products, no h in HBM) was tried too and lost, the same bits: the
    pass +15 %, kernel 4 -13 % (H100, T=16384, 364 -> 418 and 285 -> 249 us; RESULTS.md, 2026-11-27).
    """
    i_v = tl.program_id(0)
    i_n, i_h = _seq_head(tl.program_id(1), seq_order, HV, IS_VARLEN)    # varlen: longest sequences first
    i_b, bos, eos = _seq_coords(i_n, cu_seqlens, T, IS_VARLEN)
    boc = _seq_first_chunk(i_n, chunk_offsets, NT, IS_VARLEN)
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
        r0, m0 = slot_row(slot_rows, i_n, 1, kv_off, m_kv, H0_SLOTS)
        if _dense_state(s_0n, s_0h, s_0k, s_0v, HV, K, V):
            b_0 = tl.load(h0 + (r0 * HV + i_h) * K * V + kv_off, mask=m0, other=0.0)
        else:
            b_0 = tl.load(h0 + r0 * s_0n + i_h * s_0h + o_k[:, None] * s_0k + o_v[None, :] * s_0v, mask=m0, other=0.0)
        b_h += b_0.to(tl.float32)

    q_base = q + i_b * s_qb + (i_h // GROUP) * s_qh
    v_base = v + i_b * s_vb + i_h * s_vh
    b_base = beta + i_b * s_bb + i_h * s_bh
    if FROM_A and PREFETCH_BETA:
        # beta one chunk ahead (docstring): the first chunk's here, the next chunk's rows in each (masked at the end)
        b_beta_next = tl.load(b_base + (bos + o_t).to(tl.int64) * s_bt, mask=bos + o_t < eos, other=0.0)
    in_lo, in_hi, in_d = _in_rows_of(i_n, in_rows, IN_ROWS or K_IN_ROWS)       # (the caller's rows, once)
    if CK_PAGED:                        # this sequence's first boundary (in chunks) and its page-table entries
        ck_first = tl.load(ck_starts + i_n * 3)
        ck_e0 = tl.load(ck_starts + i_n * 3 + 1)
        ck_e1 = tl.load(ck_starts + i_n * 3 + 2)
    for i_t in range(0, n_chunks):
        rows = bos + i_t * BT + o_t
        m_r = rows < eos
        m_rv = m_r[:, None] & m_v[None, :]
        tok = (i_b * T + rows).to(tl.int64) * HV + i_h             # [BT] flat (token, head) index
        h_c = h + ((boc + i_t) * HV + i_h) * K * V + kv_off         # this chunk's h[c]
        r_c, m_c = _caller_rows(rows, m_r, in_lo, in_hi, in_d, IN_ROWS)          # q, v, o's rows (IN_ROWS)
        r_k, m_rk = _caller_rows(rows, m_r, in_lo, in_hi, in_d, K_IN_ROWS)       # k's
        b_G = tl.load(G + tok, mask=m_r, other=0.0)
        b_k = tl.load(k_base + r_k.to(tl.int64)[:, None] * s_kt + o_k[None, :],
                      mask=m_rk[:, None] & m_k[None, :], other=0.0)
        if UPCAST:
            b_k = b_k.to(tl.float32)
        if FROM_A:
            b_A = tl.load(A + tok[:, None] * BT + o_t[None, :], mask=m_r[:, None], other=0.0).to(b_k.dtype)
            if PREFETCH_BETA:
                b_beta = _beta_of(b_beta_next, m_r, BETA_LOGITS, PRECISE)
                b_beta_next = tl.load(b_base + (rows + BT).to(tl.int64) * s_bt, mask=rows + BT < eos, other=0.0)
            else:
                b_beta = _load_beta(b_base, rows, m_r, s_bt, BETA_LOGITS, PRECISE)
            b_vr = tl.load(v_base + r_c.to(tl.int64)[:, None] * s_vt + o_v[None, :],
                           mask=m_c[:, None] & m_v[None, :], other=0.0)
            b_hc = _operand(b_h, b_k.dtype, PREC)                   # chunk-start state as a dot operand
            if not OUTPUT:
                tl.store(h_c, b_h.to(h.dtype.element_ty), mask=m_kv)
            # r = beta (v - exp(G) K S) in fp32 (padded rows: beta = 0), rounded once for the dot with A (the split
            # recompute keeps it fp32)
            b_r = (b_vr.to(tl.float32) - _exp(b_G, PRECISE)[:, None] * _dot(b_k, b_hc, PREC, DOT_F32)) \
                * b_beta[:, None]
            b_v = _dot(b_A, _operand(b_r, b_k.dtype, PREC), PREC, DOT_F32)             # v_new = A r
        else:
            b_w = tl.load(w + tok[:, None] * K + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
            if UPCAST:
                b_w = b_w.to(tl.float32)
            b_hc = _operand(b_h, b_w.dtype, PREC)                   # chunk-start state as a dot operand
            # h in its own dtype: w's dtype on the forward path (= b_hc), fp32 for the backward's recompute
            if not OUTPUT:
                tl.store(h_c, b_h.to(h.dtype.element_ty), mask=m_kv)
            b_v = tl.load(u + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
            b_v = b_v.to(tl.float32) - _dot(b_w, b_hc, PREC, DOT_F32)                # v_new = u - w S
        if OUTPUT:
            # step 5 on the chunk-start state b_hc (h[c] as kernel 4 reads it) and this chunk's v_new, rounded to
            # o's dtype as kernel 4's path stores it
            b_q = tl.load(q_base + r_c.to(tl.int64)[:, None] * s_qt + o_k[None, :],
                          mask=m_c[:, None] & m_k[None, :], other=0.0)
            if PRECISE:
                b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
            else:
                b_Gl = b_G
            b_qs = b_G                                              # (not read without L2NORM)
            if L2NORM:
                b_qs = tl.load(qs + (i_b * T + r_c).to(tl.int64) * (HV // GROUP) + i_h // GROUP, mask=m_c, other=0.0)
            b_o = _output_block(b_q, b_k, b_hc, b_v.to(o.dtype.element_ty), b_G, b_Gl, b_qs, m_r, scale, BT, L2NORM,
                                True, PREC, DOT_F32, PRECISE, EPS)
            tok_c = (i_b * T + r_c).to(tl.int64) * HV + i_h                # o's (token, head) (IN_ROWS: B = 1)
            tl.store(o + tok_c[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=m_c[:, None] & m_v[None, :])
        elif VN_SPLIT:
            b_vh, b_vl = _hi_lo(b_v, v_new.dtype.element_ty)
            tl.store(v_new + tok[:, None] * V + o_v[None, :], b_vh, mask=m_rv)
            tl.store(o + tok[:, None] * V + o_v[None, :], b_vl, mask=m_rv)
        else:
            tl.store(v_new + tok[:, None] * V + o_v[None, :], b_v.to(v_new.dtype.element_ty), mask=m_rv)

        last = tl.minimum(eos - bos - i_t * BT, BT) - 1             # last valid row of the chunk
        i_last = (i_b * T + bos + i_t * BT + last).to(tl.int64) * HV + i_h
        G_last = tl.load(G + i_last)
        d_G = G_last - b_G                                          # [BT] G_last - G
        if PRECISE:
            d_G = d_G + (tl.load(Gl + i_last) - tl.load(Gl + tok, mask=m_r, other=0.0))

        # precision hazard: mask before exp (padded rows' G is 0 and G_last - 0 may be > 0);
        # on valid rows G_last - G <= 0 since G is non-increasing within a chunk.
        b_v = b_v * tl.where(m_r, _exp(tl.where(m_r, d_G, 0.0), PRECISE), 0.0)[:, None]
        b_h = b_h * _exp(G_last, PRECISE)
        if UPDATE_X2:                         # the decayed v_new in fp32, multiplied as hi + lo bf16 terms
            b_h += _dot(tl.trans(b_k), b_v, "bf16x2", DOT_F32)
        else:
            b_h += _dot(tl.trans(b_k), _operand(b_v, b_k.dtype, PREC), PREC, DOT_F32)  # + K^T (decayed v_new)
        if CKPT:                              # after ck_every whole chunks: a checkpoint of the state
            done = i_t + 1
            # a branch, not a masked store: the state's conversion to the store's layout (through shared memory) is
            # then paid at the checkpoints only, not in every chunk
            if CK_PAGED:
                d_ck = done - ck_first
                hit = (d_ck >= 0) & (d_ck % ck_every == 0) & (done * BT <= eos - bos)
            else:
                hit = (done % ck_every == 0) & (done * BT <= eos - bos)
            if hit:
                if CK_PAGED:                  # the page of this boundary, if it is not the last page (or past it)
                    e_ck = ck_e0 + d_ck // ck_every
                    in_table = (e_ck >= 0) & (e_ck < ck_e1)
                    r_ck = tl.load(ck_idx + tl.where(in_table, e_ck, 0), mask=in_table, other=-1).to(tl.int64)
                else:
                    r_ck = tl.load(ck_starts + i_n).to(tl.int64) + done // ck_every - 1
                ok = (r_ck >= 0) & (r_ck < ck_rows)                 # (-1: an entry past the table's)
                r_ck = tl.where(ok, r_ck, 0)
                tl.store(ck + r_ck * s_cn + i_h * s_ch + o_k[:, None] * s_ck + o_v[None, :] * s_cv,
                         b_h.to(ck.dtype.element_ty), mask=_masked_by(m_kv, ok))

    if STORE_HT:
        r1, m1 = slot_row(slot_rows, i_n, 0, kv_off, m_kv, HT_SLOTS)
        if _dense_state(s_tn, s_th, s_tk, s_tv, HV, K, V):
            tl.store(ht + (r1 * HV + i_h) * K * V + kv_off, b_h.to(ht.dtype.element_ty), mask=m1)
        else:
            tl.store(ht + r1 * s_tn + i_h * s_th + o_k[:, None] * s_tk + o_v[None, :] * s_tv,
                     b_h.to(ht.dtype.element_ty), mask=m1)


# ============================================================================================
# host side: pinned config, launcher, the stage twin state_passing
# ============================================================================================

def state_config(N: int, HV: int, K: int, V: int, device: torch.device, bv64_programs: Optional[int] = None,
                 fused: bool = False, itemsize: int = 2) -> dict:
    """Kernel 3 (chunk_state_kernel): the sequential pass. Only N * HV * cdiv(V, BV) programs exist, each walking all
    chunks of its sequence, so BV trades parallelism (small BV: more programs fill the SMs) against redundant w/k
    reads (every V-block program reloads the chunk's w and k; they mostly hit L2). num_stages=3 prefetches the
    next chunks' w, u, k, G behind the current chunk's dots: with it the block takes ~119 KB of shared memory at
    BT = 64, K = 128 (one block per SM; 2 stages ran 1.9x slower). BV 64 (four warps) from half a program per SM
    on: H200, Triton 3.6, bf16, Qwen3-Next shape, state kernel alone (torch.profiler;
    benchmarks.bench_prefill.state_sweep), B=2 T=8192 (128 programs at BV 64): 0.227 ms vs 0.335 at BV 32 (256
    programs), B=4 T=4096: 0.229 vs 0.335, B=8 T=2048: 0.235 (either rule), varlen mix 0.495 (BV 64 either rule);
    eight warps 0.27-0.28. Below that, B=1 (HV=32, V=128): BV=32 -> 128 programs for 132 SMs (T=16384: 0.331 ms;
    BV 16 0.415; BV 64 in 8 warps 0.548). ncu (H200, B=1 T=16384): 150 registers, one warp per scheduler issuing
    every ~4 cycles -- the pass is latency-bound per warp. Hand-prefetching u and G a chunk ahead (beside the
    compiler's pipeline) bought nothing at B=1 and lost on the varlen mix (0.547 ms): not kept. Pinned, never
    autotuned (DESIGN.md invariant 2). Interpreter: one V-block (fewest programs). bv64_programs: the program
    count at BV 64 from which BV 64 is taken (default half the SMs; the backward's fp32 recompute keeps its own,
    fast.chunk_bwd).

    fused (the pass forms o too, OUTPUT: state_fuses_output): BV 64 from one program per SM, else BV 32; four warps,
    two pipeline stages (the q tile joins the prefetched ones: three stages ran 1.6x slower). H100, Triton 3.6, bf16,
    Qwen3-Next shape, whole forward (ms; benchmarks.bench_prefill.state_sweep, 2026-11-24): B=4 T=4096: BV 64 / 4
    warps / 2 stages 0.584, 1 stage 0.577, 3 stages 0.843, 8 warps 0.914, BV 32 0.692, BV 128 / 8 warps 1.06-1.18;
    B=2 T=8192: BV 32 0.695, BV 64 0.817-0.857; B=8, B=16 as B=4 (0.590, 0.595); varlen mix 1.508 (BV 32 1.869).

    On warp-MMA GPUs (sm_8x, sm_12x: mma.sync accumulators in registers, _warp_mma) BV is at most 32, the widest
    block that compiles without spills there: ptxas (CUDA 12.8 and 12.9, -O3), bf16, Qwen3-Next shape, 4 warps, 3
    stages: the unfused pass at BV 64 spills 256-292 B per thread on sm_80, BV 32 none; the fused one (asked for by
    name; the rule never fuses there) 650-800 B at BV 32 and 1.3-11 KB at BV 64 (ptxas picks 168 or 32 registers
    for it). Untimed: no such GPU ran these (RESULTS.md, 2026-11-30, "Configs for warp-MMA GPUs").
    itemsize: the tiles' element size (k's). 4-byte tiles on a ~99 KB-shared-memory GPU (_small_smem) take one stage:
    at three the float32 pass needs 132 KB of shared memory and cannot launch there; at one 57-82 KB (sm_86, Qwen3-Next
    shape; compiled, not run)."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():
        return dict(BV=min(BVmax, 64), num_warps=4, num_stages=1)
    sms = _num_sms(device)
    cap = 32 if _warp_mma(device) else BVmax
    if fused:
        BV = min(64 if N * HV * cdiv(V, 64) >= sms else 32, BVmax, cap)
        return dict(BV=BV, num_warps=4 if BK * BV <= 128 * 64 else 8, num_stages=2)
    if N * HV * cdiv(V, 64) >= (sms // 2 if bv64_programs is None else bv64_programs):
        BV = 64
    elif N * HV * cdiv(V, 32) >= (sms * 3) // 4:
        BV = 32
    else:
        BV = 16
    BV = min(BV, BVmax, cap)
    stages = 1 if itemsize >= 4 and _small_smem(device) else 3
    return dict(BV=BV, num_warps=4 if BK * BV <= 128 * 64 else 8, num_stages=stages)


# Shared memory per program under which two fused-pass programs fit one SM of an H100 / H200 (228 KB per SM, 1 KB
# reserved per block: 2 * (115712 + 1024) = 233472). The fused pass's pipelined copies sit just under it: one more
# 4-byte copy per chunk crosses it and halves the pass's occupancy (state_prefetch_beta; tests/test_fast_chunk.py
# compiles every variant the rules pick for sm_90 and checks it).
SMEM_TWO_PER_SM = 115712


def state_prefetch_beta(fused: bool, varlen: bool, beta_dtype: Optional[torch.dtype] = None,
                        l2norm: bool = False) -> bool:
    """Whether the FROM_A pass loads beta one chunk ahead (the kernel's PREFETCH_BETA). Where the load sits changes
    what the compiler's software pipeline makes of it (an asynchronous copy of scattered rows, or a load in the
    chunk's own body) and how many registers stay live, and the winner follows the compiled variant (beta's width,
    L2NORM, IS_VARLEN), not the program count, so the rule is measured:
    - the interpreter (the CPU tests), the unfused pass (one program per SM or fewer, latency-bound), and the fused
      varlen pass: always. The 16-sequence varlen mix, state kernel, us, without / with: bf16 beta 686-692 / 665-667
      (no l2norm in the kernel 696-698 / 659-660), float32 1264 / 663-665 (758 / 672-676), logits 737-740 / 732-735
      (759-763 / 720-721);
    - the fused dense pass: for a 4-byte beta with l2norm in the kernel, for a 2-byte one (values or logits)
      without it. B=4 T=4096, us, without / with: bf16 beta 393-395 / 405 (no l2norm 403-404 / 402-403), float32
      636-638 / 418-422 (364-365 / 412), logits 402-404 / 426-427 (407-409 / 408-409); B=8 T=2048 and B=16 T=1024
      the same way (bf16 395-405 / 406-422, float32 without l2norm 365-372 / 418-432); B=2 T=8192 within 1-4 %.
    H200, Triton 3.6, bf16, Qwen3-Next shape, two alternating rounds in one process, outputs bit for bit equal
    (RESULTS.md, 2026-11-27 "The state pass's beta prefetch, re-measured"). The two ~2x cells (a float32 beta in
    its chunk beside L2NORM's row scales: 636 and 1264 us) are an occupancy cliff, not a schedule: that variant's
    pipelined copies take 115716 B of shared memory (Triton 3.6 and 3.9, sm_90a), 4 B over SMEM_TWO_PER_SM, so one
    program runs per SM instead of two; every variant these rules pick stays under it."""
    if is_interpreting() or not fused or varlen:
        return True
    return (beta_dtype is not None and beta_dtype.itemsize >= 4) == bool(l2norm)


def state_fuses_output(N: int, HV: int, K: int, V: int, device: torch.device) -> bool:
    """Whether the forward's state pass also forms o (the kernel's OUTPUT; kernel 4 does not run and h, v_new never
    go through HBM): when the pass has enough (sequence, head) pairs for state_config's widest blocks (BV 64 from
    half a program per SM). Q S and Q K^T double the pass's products, off its dependent chain: paid in throughput,
    so a win where the pass has programs to spare and a loss at B = 1, where one program per SM walks its chunks
    latency-bound. Whole forward, H100, Triton 3.6, bf16, Qwen3-Next shape, ms (kernel 4 / fused, each at its
    pinned config; benchmarks.bench_prefill.state_sweep, 2026-11-24): B=2 T=8192 0.780 / 0.695; B=4 T=4096
    0.708 / 0.584; B=8 T=2048 0.703 / 0.590; B=16 T=1024 0.714 / 0.595; varlen, 16 sequences / 32760 tokens
    2.05 / 1.51; but B=1 T=16384 0.949 / 1.037-1.108 and T=65536 3.66 / 4.04-4.26 (the pass alone 3.4 ms against
    1.3 + kernel 4's 1.07; every BV and stage count tried: RESULTS.md, 20:20). The interpreter always fuses (the
    CPU tests cover it). Never on warp-MMA GPUs (_warp_mma): there the fused pass spills in every config tried
    (state_config) while kernel 4 and the unfused pass at BV 32 compile without spills (untimed)."""
    if is_interpreting():
        return True
    return N * HV * cdiv(V, 64) >= _num_sms(device) // 2 and not _warp_mma(device)


def _launch_state(k, w, u, G, Gl, h0, h, v_new, ht, ch: _Chunks, N: int, T: int, BT: int, *, precise: bool,
                  prec_of=None, cfg_over: Optional[dict] = None, configs: Optional[dict] = None,
                  bv64_programs: Optional[int] = None, wy: Optional[tuple] = None, out: Optional[tuple] = None,
                  slots: Optional[tuple] = None, update_x2: bool = False, beta_logits: int = 0,
                  vn_lo: Optional[torch.Tensor] = None, ckpt: Optional[tuple] = None,
                  in_rows: Optional[torch.Tensor] = None, k_in_rows: bool = False):
    """Kernel 3. k: [B, T, H, K] (normalised already when asked); Gl: G's rounding error or None (0).
    slots: (slot_rows [N, 2] int32, h0 indexed, ht indexed) where h0 and / or ht is a slot cache's ssm_state (the
    kernel's H0_SLOTS / HT_SLOTS), else None. update_x2: the kernel's UPDATE_X2 (bf16 k only).
    wy: (A, v, beta) instead of w and u (then None): v_new from A in the pass (the kernel's FROM_A; the
    forward; beta_logits 1 / 2: beta holds logits, the kernel's BETA_LOGITS). out: (q, o, scale, qs): step 5
    fused in (the kernel's OUTPUT): o written, h and v_new (then None) not; qs: q's row scales [B, T, H] fp32
    (output.row_scales; use_qk_l2norm_in_kernel) or None. vn_lo: v_new's low bf16 term (the kernel's VN_SPLIT, the
    backward's bf16x2 recompute; v_new then bf16 and holding the high term), else None. ckpt: (ck [R, HV, K, V]
    float32 view, starts [N] int, every: chunks between checkpoints[, page ids: the kernel's CK_PAGED, starts then
    its [N, 3] table]) for the kernel's CKPT, else None. in_rows: int32 [N, 3] (with wy): v, q, qs and o in the
    caller's rows (the kernel's IN_ROWS; k too with k_in_rows: K_IN_ROWS), else None.
    bv64_programs: state_config's (the backward's fp32 recompute keeps its own threshold); cfg_over: keys merged
    over the pinned config (the backward's fp32 recompute lowers num_stages); configs: benchmark overrides,
    merged last."""
    H, K = k.shape[2], k.shape[3]
    k = _rows16(k)                                      # (a Triton 3.6 miscompile otherwise: common._rows16)
    if out is not None:
        if vn_lo is not None:
            raise ValueError("vn_lo: v_new's low term is stored only without the fused output (out)")
        q, o, scale, qs = out
        HV, V = o.shape[2], o.shape[3]
        h = v_new = o                                   # (not written)
    else:
        q, o, scale, qs = k, v_new, 1.0, None           # (not read)
        HV, V = v_new.shape[2], v_new.shape[3]
        if vn_lo is not None:
            if vn_lo.shape != v_new.shape or {v_new.dtype, vn_lo.dtype} != {torch.bfloat16}:
                raise ValueError(f"vn_lo: v_new's low term, bfloat16 and shaped as v_new {tuple(v_new.shape)}; got "
                                 f"{vn_lo.dtype} {tuple(vn_lo.shape)} beside v_new's {v_new.dtype}")
            o = vn_lo                                   # (VN_SPLIT: the low term's store)
    if N * HV == 0:
        return
    BK, _ = _blocks(K, V)
    # pinned config, then the caller's adjustments, then benchmark overrides (a sweep sees what it set)
    cfg = _cfg("state", dict(state_config(N, HV, K, V, k.device, bv64_programs, fused=out is not None,
                                          itemsize=k.element_size()), **(cfg_over or {})), configs)
    BV = cfg.pop("BV")
    prefetch = cfg.pop("PREFETCH_BETA", None)           # (a benchmark may set it)
    if precise and Gl is None:
        Gl = torch.zeros_like(G)
    if wy is not None:
        A, v, beta = wy
        w = u = v_new                                   # (not read)
    else:
        A, v, beta = v_new, v_new, G                    # (not read)
    kw = dict(
        HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=ch.varlen, USE_H0=h0 is not None, STORE_HT=ht is not None,
        PREC=_fp32_prec(k.dtype if wy is not None else w.dtype) if prec_of is None else prec_of[0],
        DOT_F32=is_interpreting(), PRECISE=precise, UPCAST=_upcast(prec_of), FROM_A=wy is not None,
        OUTPUT=out is not None, L2NORM=qs is not None, EPS=L2NORM_EPS, UPDATE_X2=update_x2, BETA_LOGITS=beta_logits,
        **cfg)
    if vn_lo is not None:
        kw["VN_SPLIT"] = True
    if in_rows is not None:
        if wy is None:
            raise ValueError("in_rows: the caller's rows are read on the FROM_A path only (wy given)")
        kw["IN_ROWS"], kw["K_IN_ROWS"] = True, k_in_rows
    ck, ck_starts, ck_every, ck_idx = (*ckpt, None)[:4] if ckpt is not None else (None, None, 1, None)
    if ckpt is not None:
        kw["CKPT"] = True
    if ck_idx is not None:
        kw["CK_PAGED"] = True
    if update_x2 and k.dtype != torch.bfloat16:
        raise ValueError(f"update_x2 splits into bfloat16 terms: k must be bfloat16, got {k.dtype}")
    slot_rows = None
    if slots is not None:
        slot_rows, kw["H0_SLOTS"], kw["HT_SLOTS"] = slots
    if wy is not None:                                  # (without FROM_A there is no beta to load: the default)
        kw["PREFETCH_BETA"] = (state_prefetch_beta(out is not None, ch.varlen, beta.dtype, qs is not None)
                               if prefetch is None
                               else bool(prefetch))
    return launch(chunk_state_kernel, (cdiv(V, BV), N * HV), kw,
        k, w, u, G, G if Gl is None else Gl, h0, h, v_new, ht, A, v, beta, q, o, G if qs is None else qs,
        ch.cu_seqlens, ch.offsets, ch.order, slot_rows, ck, ck_starts, ck_idx, in_rows, T, ch.NT, float(scale),
        int(ck_every),
        ck.shape[0] if ck is not None else 0,
        *k.stride()[:3], *v.stride()[:3], *beta.stride(), *q.stride()[:3], *_state_strides(h0), *_state_strides(ht),
        *_state_strides(ck))


def _state_strides(s: Optional[torch.Tensor]) -> tuple:
    """An initial / final state's strides [N, HV, K, V], in elements; zeros for None (not read)."""
    return (0, 0, 0, 0) if s is None else s.stride()


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
    return _state_twin(k, G, u.shape, w.dtype, u.dtype, chunk_size, initial_state, cu_seqlens,
                       w.contiguous(), u.contiguous(), None)


def state_output_wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor,
                    G: torch.Tensor, scale: float, chunk_size: int, initial_state: Optional[torch.Tensor] = None,
                    cu_seqlens: Optional[torch.Tensor] = None):
    """Steps 3, 4 and 5 in one pass (the forward's FROM_A + OUTPUT kernel). q, k: [B, T, H, K], v: [B, T, HV, V],
    beta, G: [B, T, HV], A: [B, T, HV, BT] (wy_repr's), initial_state: [N, HV, K, V] -> (o [B, T, HV, V] in v's
    dtype, final_state [N, HV, K, V] float32), as chunk_output(q, k, *state_passing_wy(...)[:2], G, scale) without
    storing h or v_new:

        v_new = A (beta (V - exp(G) (K S))) ;  O = scale [ exp(G) * (Q S) + ((Q K^T) * exp(G_i - G_j) * causal) v_new ]
        S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)                                               (kernel 3)
    """
    check_chunk_size(chunk_size)
    if _is_fp64(q, k, v, beta, A, G, initial_state):
        w, u = refgdn.delta_rule.w_u(k, v, beta, A, G, chunk_size)
        h, v_new, final = refgdn.delta_rule.state_passing(k, w, u, G, chunk_size, initial_state)
        return refgdn.delta_rule.chunk_output(q, k, v_new, h, G, scale, chunk_size), final
    _check_fast_limits(k.shape[3], v.shape[3], chunk_size)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=k.device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    _launch_state(_unit_last(k), None, None, G.float().contiguous(), None, h0, None, None, final,
                  _Chunks(B, T, chunk_size, cu_seqlens), N, T, chunk_size, precise=_precise(k.dtype),
                  wy=(A.contiguous(), _unit_last(v), beta), out=(_unit_last(q), o, float(scale), None))
    return o, final


def _state_twin(k, G, v_shape, h_dtype, v_dtype, chunk_size, initial_state, cu_seqlens, w, u, wy):
    """The stage twins' common part: outputs allocated, kernel 3 launched (from w, u or, with wy, from A)."""
    _check_fast_limits(k.shape[3], v_shape[3], chunk_size)
    B, T, H, K = k.shape
    HV, V = v_shape[2], v_shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    ch = _Chunks(B, T, chunk_size, cu_seqlens)
    h = torch.empty(ch.total, HV, K, V, dtype=h_dtype, device=k.device)
    v_new = torch.empty(B, T, HV, V, dtype=v_dtype, device=k.device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    _launch_state(_unit_last(k), w, u, G.float().contiguous(), None, h0, h, v_new, final, ch, N, T, chunk_size,
                  precise=_precise(h_dtype), wy=wy)
    NC = ch.NT if cu_seqlens is None else ch.total
    return h.view(B if cu_seqlens is None else 1, NC, HV, K, V), v_new, final


def state_passing_wy(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, G: torch.Tensor,
                     chunk_size: int, initial_state: Optional[torch.Tensor] = None,
                     cu_seqlens: Optional[torch.Tensor] = None):
    """Steps 3 and 4 in one pass (the forward's FROM_A kernel). k: [B, T, H, K], v: [B, T, HV, V], beta, G:
    [B, T, HV], A: [B, T, HV, BT] (wy_repr's), initial_state: [N, HV, K, V] -> (h [B, NC, HV, K, V] in k's dtype,
    v_new [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32), as state_passing(k, *w_u(k, v, beta, A,
    G), G) without forming w and u:

        v_new = A (beta (V - exp(G) (K S))) ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)   (kernel 3)
    """
    check_chunk_size(chunk_size)
    if _is_fp64(k, v, beta, A, G, initial_state):
        w, u = refgdn.delta_rule.w_u(k, v, beta, A, G, chunk_size)
        return refgdn.delta_rule.state_passing(k, w, u, G, chunk_size, initial_state)
    return _state_twin(k, G, v.shape, k.dtype, v.dtype, chunk_size, initial_state, cu_seqlens, None, None,
                       (A.contiguous(), _unit_last(v), beta))
