"""Triton backward of the chunked gated delta rule (fast.chunk's four forward kernels, run in reverse).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   do: [B, T, HV, V]   dht: [N, HV, K, V]
    S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

What is saved and why: the forward (fast.library's autograd registration) saves its inputs (q, k, v,
g, beta, initial_state and the gating parameters) and, where this backward would rerun kernel 1 exactly as
the forward ran it (reuses_forward_kkt: bf16 by default), that kernel's outputs G, l2norm(k) and A (as fla
keeps A and G): [B, T, HV] fp32 + [B, T, H, K] + [B, T, HV, BT] 16-bit, about 0.2 ms of kernel 1 saved at
bench_train's shape. Everything else chunk-sized is cheap to
recompute with the forward's own chunk-parallel kernels 1-2 (G, l2norm(k), A, w, u) and the chunk states
h with the sequential kernel 3; storing h and v_new from the forward instead would hold
NC * HV * K * V + T * HV * V per layer (h alone is K / BT = 2x the size of v at BT = 64, K = 128) across
the whole model's forward, and the recompute costs about one forward without its output kernel.

Backward stages (BT = chunk size; M_ij = exp(G_i - G_j) [i >= j]; G_L: G at the chunk's last token).
Each has a refgdn twin in refgdn.delta_rule_bwd (same math in readable PyTorch), checked on its own:

  0. recompute  G, kn (= l2norm(k)), A (unless kept), w, u, h, v_new   fast.chunk kernels 1-3 (bf16
         inputs: kernel 2 forms w only and the state pass v_new from A, as the forward's; FROM_A below)
  1. ``bwd_dv_local_kernel``  grid (chunks * HV)      dv_local = scale ((Q K^T) M)^T dO      (chunk_dv_local)
  2. ``bwd_dh_kernel``        grid (V-blocks, N * HV)  reverse over chunks, dS from dht:    (state_passing_bwd)
         dh[c] = dS ;  dv_new = dv_local + exp(G_L - G) (K dS) ;
         dS <- exp(G_L) dS + scale (Q exp(G))^T dO - w^T dv_new ;   dh0 = dS at the start
  3. ``bwd_dqkwg_kernel``     grid (chunks * HV * K-blocks)  dq, dk, dG through the        (chunk_bwd_dqkwg)
         output and the state update; dG = rowsum(Q dq) - rowsum(K dk) (+ the G_L terms at the last row)
         as one partial sum per K-block, its intra-chunk part as rowsum(P) - colsum(P) with
         P = ((dO v_new^T) M) * (Q K^T) off the diagonal
  3b. ``bwd_dw_kernel``       grid (chunks * HV)  dw = -dv_new h^T (through v_new = u - w h)  (chunk_dw)
  4. ``bwd_wy_kernel``        grid (chunks * HV)  through w = A Kb, u = A Vb, A = (I + L)^-1  (wy_bwd +
         in two passes over K-blocks (before and after dL):
         dk, dv, dbeta, dG; then dg = reverse chunk cumsum of dG and the fused-gating  chunk_cumsum_bwd +
         backward (da, and per-token terms of dA_log, ddt_bias)                              gating_bwd)
  5. ``bwd_qk_finish_kernel``: q/k gradients summed over each GVA group, through the l2norm, cast; host
     (torch): per-head sums of the gating parameters' gradients, casts of the others.

Precision (GRAD_DOT_PRECISION / RECOMPUTE_PRECISION / RECOMPUTE_STORAGE / RECOMPUTE_KKT / STAGE_GRAD_DOT
below): for bf16 inputs every fp32 operand of a product in the recompute and in stage 3 is split into bf16 hi +
lo ("bf16x2": ~16 mantissa bits from 16-bit tensor-core dots), the other stages' products with a gradient
operand are 16-bit (STAGE_GRAD_DOT), and kernel 1 is recomputed exactly as the forward ran it; for fp16 inputs the
recompute runs in fp32 (tf32x3 products) on the exact fp32 values of 16-bit tiles:
the intermediates (normalised q / k, A, w, u, h, dh) are stored in the inputs' 16-bit dtype and every
kernel converts them after the load (kernels 1-2 convert the raw k / v tiles: UPCAST). v_new is fp32 (for bf16:
stored as the two bf16 terms stage 3's split products take, VN_SPLIT), and products with a gradient operand take
fp32 operands; gradients that are summed further (dq, dk, dw,
dv_new, dG) are fp32, except dw and dv_new where every product that reads them is 16-bit (the bf16
default: stored rounded, exactly what those products would round them to), dv_local with them, and dq / dk
per value head for bf16 (QK_GRAD_STORAGE). The 16-bit variant (both precisions None) is faster and fails the
conformance rule in bf16 (numbers below; benchmarks/grad_precision.py measures each pair). fp32 inputs: IEEE
products. The products A^T dA A^T of the inverse's backward run in fp32 (INV_PRECISION). Configs are
pinned (``*_bwd_config``: shared memory and spills from sm_90 compiles, benchmarks/compile_check.py;
times from bench_train --sweep on an H100), never autotuned: these are training kernels but they share
the forward's no-autotune rule.

Where the time goes (H200, Triton 3.6, B=4 T=4096 H=16 HV=32 K=V=128 bf16, l2norm, BT 64; bench_train
--only profile / profile_fla; benchmarks/RESULTS.md, sixth session of 2026-11-23): forward + backward 5.23 ms
(fla 0.6.0 3.87 ms, guard bypassed, in the same run); per kernel (two profiling runs, same machine type),
fast against fla's kernel for the same step (us): stage 3 1411 / 959, the WY backward 996 / 504, the
reverse state pass 774 / 448, the state pass (forward and recompute) 611 / 411, kernel 1 (forward and
recompute) 396 / 188, kernel 2 386 / 305, the output 257 / 256, stage 1 159 / 121, the GVA sums and l2norm
backward 191 / 517 (fla: a torch reduction and its l2norm kernel). fla's backward runs 16-bit products
throughout; ours the precision above.
Stage 3b (2026-11-25, H100, Triton 3.6, same shape; benchmarks/RESULTS.md, 00:23): dw = -dv_new h^T moved out
of stage 3 into its own kernel. Stage 3 1552 -> 1110 us (its spills 776 -> 96 B per thread, one fp32 tile fewer
to load per V-block), stage 3b 267 us (805 MB at 3.0 TB/s: the copy ceiling), the WY backward 981 -> 973 us
((R + R^T) K as one product); forward + backward 5.30 -> 5.07 ms (fla 4.43 in the same call). Tried and slower
(A/B in one call): dw formed inside the WY kernel, K whole (8 warps: 736 B of spills, the WY kernel 1.8 ms) or
per K-block in both passes (dw's small products recomputed: 1.7 ms).
Bytes (2026-11-25, H100, Triton 3.6, same shape; benchmarks/RESULTS.md, 01:45 to 02:34): the gradient buffers that
every reader rounds anyway (dv_new, dw) and those whose extra rounding the conformance rule allows (dv_local; dq
and dk per value head: QK_GRAD_STORAGE) are stored 16-bit for bf16; stage 3's products of ds are 16-bit
(STAGE_GRAD_DOT dqkwg_post); the WY backward runs BV 64; the custom op no longer zero-fills its kept outputs'
gradients. Per kernel at 53767e8: stage 3 1032 us, the state pass (forward and recompute) 951, the WY backward
674, the reverse pass 477, kernel 2 (recompute) 264, stage 3b 178, stage 5 176, stage 1 170, kernel 1 167;
forward + backward (custom op) 4.79 -> 4.13 ms, fla 4.44 in the same process as the latter. Tried and slower:
stage 3 with one program per key head walking its value heads (dq summed over the group in the kernel): half the
programs, 552 B of spills per thread, stage 3 1036 -> 1890 us.
Now (2026-11-27 18:25, H200, Triton 3.6, same shape; benchmarks/RESULTS.md "The backward's loads, pipelined", "v_new
as two bf16 terms"): forward + backward 3.335 ms (fla 3.886 in the same process), forward 0.543; per kernel (us):
the state pass (forward and recompute) 853, stage 3 731, the WY backward 601, the reverse pass 425, stage 1 149,
kernel 2 (w only) 141, stage 5 124, stage 3b 123, kernel 1 (forward only) 120. Under ncu every large backward
kernel holds two 4-warp programs per SM (255 registers: 12.5 % occupancy) and waits mostly on loads (long
scoreboard); register caps (maxnreg 168 / 208) were slower for each of stages 2, 3 and 4 (spills). What bounds the
ratio to the forward: counting multiply-adds per chunk and value head (BT 64, K = V = 128; a split bf16x2 operand
counts twice), the forward's fused pass and kernel 1 do ~5.6 M and this backward ~22.5 M (recompute 6.3, stage 1
1.0, stage 2 3.2, stage 3 6.8, stage 3b 1.0, stage 4 4.2), so forward + backward is ~5x the forward's work: ~5x its
time at the forward's own rate (measured 6.1x: the backward's kernels run at ~0.8x the forward's rate). Without
the splits (the 16-bit backward) it would be ~4.1x.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl

from refgdn.checks import one_host_read

from .chunk import (INV_PRECISION, L2NORM_EPS, SOFTPLUS_THRESHOLD, _blocks, _check_fast_limits, _chunk_rows,
                    _Chunks, _contig, _dot, _dot_split, _exp, _fp32_prec, _gate, _gdiff, _launch_kkt,
                    _launch_state, _launch_w_u, _num_sms, _precise, _seq_coords, _seq_first_chunk, _seq_head,
                    _trunc_tf32)
from .chunk.common import _warp_mma
from .gating import l2norm_into
from .launch import launch
from .utils import cdiv, is_interpreting

# Per-stage config overrides (chunk_gated_delta_rule_bwd's ``configs`` argument, for benchmark sweeps:
# benchmarks/bench_train.py --sweep) are merged over the pinned heuristics below: {"dv_local": {...},
# "dh": {...}, "dqkwg": {...}, "dw": {...}, "wy": {...}} with keys BV, num_warps, num_stages, and for the
# recompute {"kkt": {...}, "w_u": {...}, "state": {...}} as in fast.chunk. Each distinct config is its own
# compiled variant.
# Precision of the backward, per input dtype (read-only defaults; chunk_gated_delta_rule_bwd's
# ``precision`` argument replaces a row for benchmarks; each value its own compiled variant):
#   GRAD_DOT_PRECISION: input_precision of the products that take a gradient operand (dS, dv_new, dw, ds,
#     dL, ...). A string keeps them fp32 ("tf32": 10 mantissa bits; the 16-bit operand converts exactly)
#     and stores dh, h and v_new in fp32; None rounds them to the input dtype for 16-bit dots.
#   RECOMPUTE_PRECISION: the recompute (fast.chunk kernels 1-3) and the products of inputs run on fp32
#     copies of q, k, v, beta at this input_precision; None: in the input dtype, like the forward.
# Why: the backward rounds at a dozen places where refgdn (the oracle in the same precision) rounds once,
# and dg (a reverse cumsum over up to BT tokens of differences of larger terms) and dA_log / ddt_bias (sums
# over all tokens) amplify it. Worst conformance ratio over the quick gradient families, interpreter with
# bf16 operands and tf32 modelled as truncation (fast.chunk._trunc_tf32; python -m
# benchmarks.grad_precision --quick):
#   bf16: None/None 2.24 (fails: ddt_bias with fused gating; dk 1.1-1.6 elsewhere), tf32/None 1.44
#     (fails), None/tf32 1.12 (fails: a 2-ulp dk at the largest entry of a length-1 sequence), tf32/tf32 0.54
#   fp16: None/None 0.68, tf32/None 1.16 (truncated tf32 is coarser than fp16), tf32x3/tf32x3 0.22
# On an H100 at bench_train's error shape (B=1 T=1024 H=4 HV=8) the 16-bit variant passes (worst 0.57, dg;
# fla 0.56, the default 0.32): the quick families' length-1 sequences, fused gating and strong decay are
# what it fails.
# fp32 inputs: IEEE products throughout.
# bf16 default since the sixth session of 2026-11-23: ("bf16x2", "bf16x2", "16-bit", "forward"), the comments on
# bf16x2 and KKT below (H200, Triton 3.6: full bf16 gradient families worst 0.759; fwd+bwd 5.34 ms at
# bench_train's shape against 5.70 for the previous default's kernel 1 run the forward's way).
GRAD_DOT_PRECISION = MappingProxyType({torch.bfloat16: "bf16x2", torch.float16: "tf32x3", torch.float32: "ieee"})
RECOMPUTE_PRECISION = MappingProxyType({torch.bfloat16: "bf16x2", torch.float16: "tf32x3", torch.float32: None})
# STORAGE of the recompute's chunk-local intermediates (normalised q / k, A, w, u, h, dh), per input dtype:
# None keeps the recompute's dtype (fp32 with RECOMPUTE_PRECISION set); "16-bit" stores them in the
# inputs' dtype while every kernel still computes on their (exactly converted) fp32 values: half the
# bytes of the fp32 recompute. v_new stays fp32 (rounding it too failed: quick bf16 families, worst ratio
# 1.24 on da with fused gating; bf16 stores its hi + lo terms, which keep what stage 3 uses of it: VN_SPLIT).
# Simulated in the interpreter by rounding each fp32 buffer in place after the kernel that writes it: kn + qu
# + A + w + u + h + dh together 0.84 (pass; the fp32 default 0.54), each alone <= 0.69; the implementation,
# with the interpreter's bf16 casts rounding to nearest as a GPU's do (benchmarks.grad_precision
# --interpreter-rne): 0.84 (fp16 inputs: 0.52). Compiles for sm_90 (Triton
# 3.9) at BT 16 / 32 / 64. The default for 16-bit inputs since the GPU gradient conformance matrix passed with
# it (H100, Triton 3.6: 495 / 495 checks, bf16 and fp16): fwd+bwd 9.2 -> 7.2 ms at bench_train's shape.
# Interpreter caveat for every bf16 figure above: Triton's interpreter casts fp32 -> bf16 by truncation
# (a GPU rounds to nearest even), so in-kernel bf16 roundings err up to twice as much there, all toward
# zero. With round-to-nearest the quick bf16 worst ratios read None/None 1.02, tf32/None 1.09, None/tf32
# 0.85, tf32/tf32 0.32 (truncation: 2.24, 1.44, 1.12, 0.54). CI's quick matrix tests fp16 and fp32 only.
# Experimental value "bf16x2" for the grad_dot and / or the recompute precision (bf16 inputs only; meant
# for 16-bit storage, e.g. precision=("bf16x2", "bf16x2", "16-bit"), where the stored operands are exact):
# every fp32 operand of a product split into bf16 hi + lo and multiplied by 16-bit dots (fast.chunk's
# _dot_split: about 16 mantissa bits instead of tf32's 10; 16-bit tiles in shared memory; two or three
# bf16 MMAs where tf32 takes one at half the bf16 rate). As the recompute precision, kernels 1-3 keep
# their 16-bit tiles (no UPCAST; kernel 1 then runs the forward's way) and their fp32 operands (the state
# S, the decayed v_new, beta exp(G) k, beta v) unrounded. Quick bf16 families with round-to-nearest, worst
# ratio: bf16x2/tf32 0.841 (da; as tf32/tf32, the storage dominates), tf32/bf16x2 0.942, bf16x2/bf16x2
# 0.906 (ddt_bias with fused gating; with fp32 storage instead of 16-bit: 0.437). Compiles for sm_90
# (Triton 3.9, bench shape, bf16x2/bf16x2: the reverse state pass without spills at 148 KB of shared
# memory, kernel 1 20 B of spills instead of 716, stage 3 776 B at the tf32 pins). On a GPU (H200, Triton
# 3.6, benchmarks.grad_precision, the full bf16 gradient families): bf16x2/bf16x2/16-bit/forward worst
# 0.759 (dg, no-init-K64-V96), fwd+bwd 5.342 ms at bench_train's shape; tf32/tf32/16-bit/forward worst
# 0.764, 5.698 ms. Per kernel (bench_train --only profile --beside, same device): bf16x2/bf16x2/16-bit
# against tf32/tf32/16-bit: kernel 1 682 -> 530 us, kernel 2 559 -> 388, the state pass 674 -> 619, stage
# 1 282 -> 160, the reverse pass 816 -> 775, stage 3 1458 -> 1422, the WY backward 1005 -> 1089; all
# kernels 5967 -> 5468 us. The bf16 default.
RECOMPUTE_STORAGE = MappingProxyType({torch.bfloat16: "16-bit", torch.float16: "16-bit", torch.float32: None})
# KKT: how the recompute's kernel 1 (G, l2norm(k), A) runs with 16-bit storage: "recompute" (fp32 products
# of the fp32 normalised k at the recompute precision) or "forward" (experimental: exactly the forward's
# kernel 1, 16-bit products of the rounded normalised k that the later kernels read anyway; the forward's
# A, at the forward's cost: ~0.15 instead of ~0.55 ms at bench_train's shape, estimated from the profile).
# Quick families, interpreter with round-to-nearest: bf16 worst 0.841 (the same da case as "recompute"),
# fp16 0.476 (0.52 with "recompute"). Not run on a GPU. Kernel 2 (w, u) run the forward's way as well
# fails: bf16 1.144 (dg, strided-slices family; its 16-bit products round beta exp(G) k before A's product).
# On a GPU (H200, Triton 3.6): kernel 1 684 -> 398 us with "forward" (tf32/tf32/16-bit; all kernels 5983 ->
# 5684 us); the full bf16 gradient families pass with it (worst 0.759 / 0.764 above). The bf16 default.
RECOMPUTE_KKT = MappingProxyType({torch.bfloat16: "forward", torch.float16: "recompute", torch.float32: "recompute"})
# FROM_A (chunk_gated_delta_rule_bwd's from_a; bf16 inputs since 2026-11-27): the recompute's state pass forms
# v_new = A (beta (V - exp(G) K S)) as the forward's does (fast.chunk.state's FROM_A, S and r split like the rest of
# the recompute), so kernel 2 forms only w, which the reverse pass reads, and u is neither stored nor read back. H200,
# Triton 3.6, bench_train's shape, same process: kernel 2 248 -> 142 us, the state kernel (forward + recompute) 773
# -> 858, fwd+bwd 3.621 -> 3.594 ms. More accurate for 16-bit inputs (the subtraction before A's product, in fp32,
# instead of u and w rounded to 16 bits first): quick families in the interpreter with round-to-nearest casts, worst
# ratio bf16 0.876 -> 0.497 (ddt_bias, fused gating), fp16 0.523 -> 0.469; on an H200 kernel 2's path fails the quick
# fused-gating family in bf16 (dA_log / ddt_bias over 1). float32 keeps kernel 2's path: its worst went 0.335 ->
# 0.671 (dg, strided-slices at BT 16: 2.6e-7 -> 1.7e-6). fp16 keeps it too until timed: its tf32x3 recompute pass
# spills more from A (sm_90a, Triton 3.6, bench shape: 1840 B against 1556) and no GPU run has measured it.
# QK_GRAD_STORAGE: how the per-value-head dq and dk (stage 3's dq, stage 4's total dk; stage 5 sums them over the
# GVA group, through the l2norm, and casts) are stored, per input dtype: None fp32; "16-bit" the inputs' dtype, a
# rounding before the group sum and the l2norm backward as well as the one after (precision hazard: that backward
# is a projection, d - y (y . d), which cancels where d is near y; the rounding is relative to d, not to the
# result). Half the bytes: bench_train's shape, 0.27 GB less written and 0.27 GB less read. Quick bf16 families
# in the interpreter with round-to-nearest casts (the bf16 default beside it): worst ratio 0.876 either way (ddt_bias,
# fused gating); dk's worst 0.635 (varlen-empty-len1), where every family's worst was <= 0.331 before.
QK_GRAD_STORAGE = MappingProxyType({torch.bfloat16: "16-bit", torch.float16: None, torch.float32: None})
# STAGE_GRAD_DOT: per input dtype, a stage's own GRAD_DOT precision where it differs from the dtype's ({stage
# name as in ``configs``: precision}; "wy" replaces the WY backward's own rule; benchmarks.grad_precision's
# variant field 5). bf16 since 2026-11-25: 16-bit products with a gradient operand everywhere but stage 3's loop
# over V (the recompute keeps bf16x2). Which stage needs the precision, quick bf16 families in the interpreter with
# round-to-nearest casts (worst ratio; the default before 0.902): stage 3 (dqkwg) alone at 16-bit 1.314 (fails),
# dh 0.870, dw 0.893, dv_local 0.847, wy 0.971, these four together 0.762. On a GPU (H100, Triton 3.6, the full
# bf16 gradient families, benchmarks.grad_precision; fwd+bwd at bench_train's shape in the same process, kernel 1
# rerun): the previous default worst 0.764 (dg, no-init-K64-V96), 5.171 ms; dh, dw, dv_local 16-bit 0.764,
# 5.008 ms; and the WY backward too 0.761, 4.898 ms (this default). Stage 3's own products, quick families with
# round-to-nearest on top of the four: "dqkwg_post" (ds K and ds^T Q, after the loop over V) at 16-bit 0.762
# (passes); the loop's products with v_new (do v_new^T, v_new dh^T) at 16-bit 1.174 (fails: ddt_bias with fused
# gating). dqkwg_post on a GPU (H100, Triton 3.6, 2026-11-25, full bf16 gradient families): worst 0.761 (the
# same dg case as without it), stage 3 1122 -> 1032 us, fwd+bwd 4.904 -> 4.838 ms in one process. The default since
# then.
STAGE_GRAD_DOTS = ("dv_local", "dh", "dqkwg", "dqkwg_post", "dw", "wy")   # the stages STAGE_GRAD_DOT may name
STAGE_GRAD_DOT = MappingProxyType({
    torch.bfloat16: MappingProxyType({"dv_local": None, "dh": None, "dw": None, "wy": None, "dqkwg_post": None}),
    torch.float16: MappingProxyType({}), torch.float32: MappingProxyType({})})


def reuses_forward_kkt(dtype: torch.dtype) -> bool:
    """Whether the default backward for inputs of ``dtype`` runs kernel 1 exactly as the forward did (16-bit
    storage, RECOMPUTE_KKT "forward"), so the forward's A, G and normalised k can be kept instead (fla keeps A
    and G too): the custom op's forward returns them and its backward skips kernel 1 (~0.2 ms at bench_train's
    shape; memory: A is [B, T, HV, BT] in the input dtype, G [B, T, HV] fp32, kn [B, T, H, K])."""
    return RECOMPUTE_STORAGE.get(dtype) == "16-bit" and RECOMPUTE_KKT.get(dtype) == "forward"


def _cfg(name: str, base: dict, configs: Optional[dict] = None) -> dict:
    """The pinned config `base` with the overrides configs[name] (benchmark sweeps) merged over it."""
    return dict(base, **(configs or {}).get(name, {}))


@triton.jit
def _gdot(a, b, DT: tl.constexpr, GPREC: tl.constexpr, EMU_TF32: tl.constexpr, PREC: tl.constexpr,
          DOT_F32: tl.constexpr):
    """A product with a gradient operand (fp32 in registers). GPREC None: both operands rounded to the
    inputs' dtype DT (16-bit tensor-core dot); "bf16x2": each fp32 operand split into hi + lo in DT (bf16
    only), 16-bit dots of the parts (two when one operand is already 16-bit and exact, three when both are
    fp32: hi hi + hi lo + lo hi), about 16 mantissa bits per fp32 operand with 16-bit tiles in shared memory;
    else fp32 operands at input_precision GPREC ("tf32": the gradient operand keeps 10 mantissa bits
    instead of bf16's 7; "ieee" for fp32 inputs). EMU_TF32 (interpreter): truncate operands to tf32 first,
    so CPU runs see the GPU's rounding."""
    if GPREC is None:
        return _dot(a.to(DT), b.to(DT), PREC, DOT_F32)
    elif GPREC == "bf16x2":
        return _dot_split(a, b, DT, DOT_F32)
    else:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if EMU_TF32:
            a = _trunc_tf32(a)
            b = _trunc_tf32(b)
        return tl.dot(a, b, input_precision=GPREC)


@triton.jit
def _row_decay(b_G, b_Gl, G_last, Gl_last, m_r, PRECISE: tl.constexpr):
    """exp(G_L - G_i) per row [BT], 0 on rows past the sequence end (masked before exp: a padded row's
    G is loaded as 0 and G_L - 0 may be > 0). On valid rows G_L - G_i <= 0 (G non-increasing)."""
    d = G_last - b_G
    if PRECISE:
        d = d + (Gl_last - b_Gl)
    return tl.where(m_r, _exp(tl.where(m_r, d, 0.0), PRECISE), 0.0)


@triton.jit
def _causal(b_G, b_Gl, keep, PRECISE: tl.constexpr):
    """[BT, BT] exp(G_i - G_j) where keep, 0 elsewhere (mask before exp: discarded entries may be > 0)."""
    return tl.where(keep, _exp(tl.where(keep, _gdiff(b_G, b_Gl, b_G, b_Gl, PRECISE), 0.0), PRECISE), 0.0)


# ============================================================================================
# stage 1: dv_local = scale ((Q K^T) M)^T dO                         (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def bwd_dv_local_kernel(
    q, k, G, Gl, do, dv,
    cu_seqlens, chunk_indices, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr,
    GPREC: tl.constexpr, EMU_TF32: tl.constexpr,
):
    """Per (chunk, value head): dv[j] = scale sum_{i >= j} (k_j . q_i) exp(G_i - G_j) dO[i].

    q, k: [B, T, H, K] contiguous (normalised when asked); G, Gl: [B, T, HV] fp32; do: [B, T, HV, V];
    dv: [B, T, HV, V] fp32, or 16-bit as stage 2 stores dv_new (host: dvn_dt). grid = (chunks * HV,), head
    fastest; V in blocks of BV inside.
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos, rows, m_r, tok = _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV, BT,
                                                     IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    qk_off = ((i_b * T + rows).to(tl.int64) * H + i_h // GROUP) * K
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
    b_k = tl.load(k + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_Gl = b_G
    if PRECISE:
        b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
    # entry (j, i) = scale (k_j . q_i) exp(G_i - G_j) for i >= j: the transpose of the output's (i, j)
    keep = (o_t[:, None] <= o_t[None, :]) & m_r[:, None] & m_r[None, :]
    d_ji = -_gdiff(b_G, b_Gl, b_G, b_Gl, PRECISE)                          # [j, i] = G_i - G_j
    decay = tl.where(keep, _exp(tl.where(keep, d_ji, 0.0), PRECISE), 0.0)   # mask before exp
    b_A = _dot(b_k, tl.trans(b_q), PREC, DOT_F32) * decay * scale
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_rv = m_r[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        b_dv = _gdot(b_A, b_do, b_q.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        tl.store(dv + tok[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_rv)


# ============================================================================================
# stage 2: the reverse state pass (sequential over chunks, dS in registers)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def bwd_dh_kernel(
    q, k, w, G, Gl, do, dv_local, dht, dh, dv_new, dh0,
    cu_seqlens, chunk_offsets, seq_order, T, NT, scale,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr,
    GPREC: tl.constexpr, EMU_TF32: tl.constexpr,
):
    """Per (V-block, sequence, value head), for each chunk c from the last to the first:

        dh[c] = dS ;  dv_new = dv_local + exp(G_L - G) (K dS) ;
        dS <- exp(G_L) dS + scale (Q exp(G))^T dO - w^T dv_new

    q, k: [B, T, H, K] contiguous; w: [B, T, HV, K]; do: [B, T, HV, V]; dv_local, dv_new: [B, T, HV, V] fp32,
    or the inputs' dtype where dv_new's readers round it to that anyway (host: dvn_dt);
    dht, dh0: [N, HV, K, V] fp32; dh: [chunks, HV, K, V] (k's dtype: a dot operand of stage 3, like the
    forward's h). dh[c] is the gradient of the state at the END of chunk c. dS: fp32 [BK, BV] in registers.
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
    kv_off = o_k[:, None] * V + o_v[None, :]

    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)
    for i_r in range(0, n_chunks):
        i_t = n_chunks - 1 - i_r
        rows = bos + i_t * BT + o_t
        m_r = rows < eos
        m_rk = m_r[:, None] & m_k[None, :]
        m_rv = m_r[:, None] & m_v[None, :]
        tok = (i_b * T + rows).to(tl.int64) * HV + i_h
        qk_off = ((i_b * T + rows).to(tl.int64) * H + i_h // GROUP) * K
        b_k = tl.load(k + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
        tl.store(dh + ((boc + i_t) * HV + i_h) * K * V + kv_off, b_dS.to(dh.dtype.element_ty), mask=m_kv)

        last = tl.minimum(eos - bos - i_t * BT, BT) - 1
        i_last = (i_b * T + bos + i_t * BT + last).to(tl.int64) * HV + i_h
        b_G = tl.load(G + tok, mask=m_r, other=0.0)
        G_last = tl.load(G + i_last)
        if PRECISE:
            b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
            Gl_last = tl.load(Gl + i_last)
        else:
            b_Gl = b_G
            Gl_last = G_last
        b_dv = tl.load(dv_local + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0).to(tl.float32)
        b_dv += (_gdot(b_k, b_dS, b_k.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
                 * _row_decay(b_G, b_Gl, G_last, Gl_last, m_r, PRECISE)[:, None])
        tl.store(dv_new + tok[:, None] * V + o_v[None, :], b_dv.to(dv_new.dtype.element_ty), mask=m_rv)

        b_q = tl.load(q + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
        b_w = tl.load(w + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
        b_do = tl.load(do + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        # exp(G) <= 1 on valid rows; padded rows have q = 0
        b_qg = b_q.to(tl.float32) * (_exp(b_G, PRECISE) * scale)[:, None]
        b_dS = b_dS * _exp(G_last, PRECISE)
        b_dS += _gdot(tl.trans(b_qg), b_do, b_q.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        b_dS -= _gdot(tl.trans(b_w), b_dv, b_w.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
    if STORE_DH0:
        tl.store(dh0 + (i_n.to(tl.int64) * HV + i_h) * K * V + kv_off, b_dS, mask=m_kv)


# ============================================================================================
# stage 3: dq, dk, dG through the output and the state update         (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def bwd_dqkwg_kernel(
    q, k, v_new, v_lo, h, dh, G, Gl, do, dq, dk, dG,
    cu_seqlens, chunk_indices, T, NT, scale, s_dG,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, PRECISE: tl.constexpr,
    GPREC: tl.constexpr, EMU_TF32: tl.constexpr, GPREC_POST: tl.constexpr, EMU_POST: tl.constexpr,
    VN_SPLIT: tl.constexpr = False,
):
    """Per (chunk, value head, K-block of BKC), with h = h[c] (chunk start) and dh = dh[c] (chunk end):

        dq = scale [exp(G) dO h^T + ((dO v_new^T) M) K]
        dk = scale ((dO v_new^T) M)^T Q + exp(G_L - G) v_new dh^T
        dG = rowsum(Q dq) - rowsum(K dk) ;  dG_L += sum(K dk_state) + exp(G_L) <h, dh>
           (intra-chunk part computed as rowsum(P) - colsum(P), P = scale ((dO v_new^T) M) (Q K^T), i > j)
    (dw = -dv_new h^T, the gradient through v_new = u - w h, is bwd_dw_kernel's.)

    q, k: [B, T, H, K] contiguous; v_new, do: [B, T, HV, V]; h, dh: [chunks, HV, K, V];
    dq: [B, T, HV, K] fp32 or 16-bit (host: QK_GRAD_STORAGE), dk: [B, T, HV, K] fp32 (per value head);
    dG: [NK, B, T, HV] fp32, one partial sum per K-block
    (every term of dG is a sum over K; stage 4 adds the NK = BK / BKC partials; s_dG = B T HV).
    grid = (chunks * HV * NK,), K-block fastest: each program owns the K columns of its block, V in blocks of BV
    inside; (dO v_new^T) M, over all of V, is computed by each of the NK programs of a chunk (cheap: [BT, BT]).
    VN_SPLIT (bf16 inputs, GPREC "bf16x2", 16-bit dh): v_new arrives as its bf16 hi (v_new) and lo (v_lo) terms,
    stored so by the recompute's state pass: the same operands and products as splitting an fp32 v_new here
    (bit for bit), without the split or an fp32 tile in shared memory; else v_lo is not read.
    """
    # K-block fastest: the NK programs of one (chunk, head) run together, so all but the first read v_new and dO
    # (all of V, in every K-block's program) from L2 (H200, bench_train's shape: 984 -> 957 us against the
    # K-blocks a grid dimension apart, 2026-11-27)
    pid = tl.program_id(0) // (BK // BKC)
    i_kb = tl.program_id(0) % (BK // BKC)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos, rows, m_r, tok = _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV, BT,
                                                     IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_kb * BKC + tl.arange(0, BKC)
    m_k = o_k < K
    m_rk = m_r[:, None] & m_k[None, :]
    qk_off = ((i_b * T + rows).to(tl.int64) * H + i_h // GROUP) * K
    h_base = (i_c.to(tl.int64) * HV + i_h) * K * V

    b_dq = tl.zeros([BT, BKC], dtype=tl.float32)
    b_dk = tl.zeros([BT, BKC], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BKC], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_rv = m_r[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + h_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dh = tl.load(dh + h_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_vn = tl.load(v_new + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        if VN_SPLIT:
            b_vl = tl.load(v_lo + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        b_do = tl.load(do + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        # v_new is fp32 when GPREC is set (the backward's recompute stores it so; its bf16 terms with VN_SPLIT),
        # else 16-bit
        b_dq += _gdot(b_do, tl.trans(b_h), b_do.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        if VN_SPLIT:                    # _dot_split's products of the two terms, in its order
            b_ds += (_dot(b_do, tl.trans(b_vn), None, DOT_F32) + _dot(b_do, tl.trans(b_vl), None, DOT_F32))
            b_dk += (_dot(b_vn, tl.trans(b_dh), None, DOT_F32) + _dot(b_vl, tl.trans(b_dh), None, DOT_F32))
        else:
            b_ds += _gdot(b_do, tl.trans(b_vn), b_do.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
            b_dk += _gdot(b_vn, tl.trans(b_dh), b_do.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)

    b_q = tl.load(q + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
    b_k = tl.load(k + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
    last = tl.minimum(eos - bos - i_t * BT, BT) - 1
    i_last = (i_b * T + bos + i_t * BT + last).to(tl.int64) * HV + i_h
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    G_last = tl.load(G + i_last)
    if PRECISE:
        b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
        Gl_last = tl.load(Gl + i_last)
    else:
        b_Gl = b_G
        Gl_last = G_last
    keep = (o_t[:, None] >= o_t[None, :]) & m_r[:, None] & m_r[None, :]
    b_ds = b_ds * _causal(b_G, b_Gl, keep, PRECISE) * scale                # (dO v_new^T) M scale
    b_eG = tl.where(m_r, _exp(b_G, PRECISE), 0.0)
    b_dqi = b_dq * (b_eG * scale)[:, None]                                  # through the chunk-start state
    # GPREC_POST: the precision of ds's products with K and Q (STAGE_GRAD_DOT's "dqkwg_post"; GPREC by default)
    b_dq = b_dqi + _gdot(b_ds, b_k, b_k.dtype, GPREC_POST, EMU_POST, PREC, DOT_F32)
    b_dks = b_dk * _row_decay(b_G, b_Gl, G_last, Gl_last, m_r, PRECISE)[:, None]   # through the state update
    b_dk = _gdot(tl.trans(b_ds), b_q, b_q.dtype, GPREC_POST, EMU_POST, PREC, DOT_F32) + b_dks
    # dG = rowsum(Q dq) - rowsum(K dk), with the intra-chunk part taken from P = ds * (Q K^T) directly:
    # rowsum(P) - colsum(P). precision hazard: via Q dq - K dk the diagonal terms P_ii (large when the
    # decay is strong) would cancel only up to rounding; here they are left out (they cancel exactly).
    # Q K^T is this K-block's part of the product; P is linear in it, so the partials sum to the whole.
    strict = (o_t[:, None] > o_t[None, :]) & m_r[:, None] & m_r[None, :]
    b_P = tl.where(strict, b_ds * _dot(b_q, tl.trans(b_k), PREC, DOT_F32), 0.0)
    b_dG = (tl.sum(b_q.to(tl.float32) * b_dqi, 1) - tl.sum(b_k.to(tl.float32) * b_dks, 1)
            + tl.sum(b_P, 1) - tl.sum(b_P, 0))
    g_last = tl.sum(tl.sum(b_k.to(tl.float32) * b_dks, 1), 0) + _exp(G_last, PRECISE) * tl.sum(b_hdh, 0)
    b_dG = tl.where(o_t == last, b_dG + g_last, b_dG)

    out = tok[:, None] * K + o_k[None, :]
    tl.store(dq + out, b_dq.to(dq.dtype.element_ty), mask=m_rk)
    tl.store(dk + out, b_dk, mask=m_rk)
    tl.store(dG + i_kb.to(tl.int64) * s_dG + tok, b_dG, mask=m_r)


# ============================================================================================
# stage 3b: dw = -dv_new h^T                                          (fully chunk-parallel)
# ============================================================================================

@triton.jit(do_not_specialize=["T", "NT"])
def bwd_dw_kernel(
    h, dv_new, dw, ref,
    cu_seqlens, chunk_indices, T, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, GPREC: tl.constexpr,
    EMU_TF32: tl.constexpr,
):
    """Per (chunk, value head), the gradient through v_new = u - w h (h = h[c], the chunk-start state):

        dw = -dv_new h^T

    h: [chunks, HV, K, V]; dv_new: [B, T, HV, V]; dw: [B, T, HV, K] (each fp32 or 16-bit, host: dvn_dt,
    dw_dt); ref: any tensor in the inputs' dtype (its dtype only: the 16-bit dtype of the products, as stage
    3's). grid = (chunks * HV,); K whole, V in blocks of BV. Its own kernel rather than a fourth accumulator
    of stage 3: there it cost registers (stage 3 spilled 776 B per thread with it, 96 without; sm_90,
    bench_train's shape) and a second read of dv_new per K-block program.
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    _, _, _, _, _, m_r, tok = _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV, BT, IS_VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    h_base = (i_c.to(tl.int64) * HV + i_h) * K * V
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_dv = tl.load(dv_new + tok[:, None] * V + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)
        b_h = tl.load(h + h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dw += _gdot(b_dv, tl.trans(b_h), ref.dtype.element_ty, GPREC, EMU_TF32, PREC, DOT_F32)
    tl.store(dw + tok[:, None] * K + o_k[None, :], (-b_dw).to(dw.dtype.element_ty),
             mask=m_r[:, None] & m_k[None, :])


# ============================================================================================
# stage 4: the WY backward, then dg = reverse chunk cumsum of dG (+ fused gating)   (chunk-parallel)
# ============================================================================================

@triton.jit
def _mm(a, b, P: tl.constexpr):
    """fp32 product of the inverse's backward (input_precision P)."""
    return tl.dot(a, b, input_precision=P)


@triton.jit(do_not_specialize=["T", "NT"])
def bwd_wy_kernel(
    k, v, beta, g, A_log, dt_bias, G, Gl, A, dw, du, dk, dk_out, dG,
    dv, dbeta, dg, dA_log_t,
    cu_seqlens, chunk_indices, T, NT, s_dG,
    s_vb, s_vt, s_vh, s_bb, s_bt, s_bh, s_gb, s_gt, s_gh,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, NKG: tl.constexpr,
    IS_VARLEN: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISE: tl.constexpr, THRESHOLD: tl.constexpr,
    GPREC: tl.constexpr, EMU_TF32: tl.constexpr,
    K1_STAGES: tl.constexpr = 1, V_STAGES: tl.constexpr = 1, K2_STAGES: tl.constexpr = 1,
):
    """Per (chunk, value head), through w = A Kb, u = A Vb (Kb = beta exp(G) K, Vb = beta V), A = (I + L)^-1:

        dA = dw Kb^T + du Vb^T ;  dKb = A^T dw ;  dVb = A^T du ;  dL = -A^T dA A^T (strictly lower)
        dk += beta exp(G) dKb + (R + R^T) K   (R = dL beta_i exp(G_i - G_j)) ;  dv = beta dVb
        dbeta = rowsum(dKb exp(G) K + dVb V + dL (K K^T) exp(G_i - G_j))
        dG += rowsum(dKb Kb) + rowsum(P) - colsum(P)   (P = R (K K^T) = dL L)
        dg_s = sum_{c >= s in the chunk} dG_c ;  GATE: da = dg dg/da, dA_log per token = dg g

    k: [B, T, H, K] contiguous (normalised when asked); v, beta, g: strided; A: [B, T, HV, BT];
    dk: [B, T, HV, K] fp32, stage 3's; dk_out: the total per value head, [B, T, HV, K] fp32 (may be dk itself)
    or 16-bit (host: QK_GRAD_STORAGE); dw: [B, T, HV, K], du = dv_new:
    [B, T, HV, V], fp32 or 16-bit when this kernel's products round them anyway (host: dw_dt, dvn_dt);
    dG: [NKG, B, T, HV] fp32 (stage 3's partial sums, s_dG apart); dv: [B, T, HV, V] v's dtype;
    dbeta, dg, dA_log_t: [B, T, HV] fp32.
    Registers: K in blocks of BKC, V in blocks of BV, so only [BT, BT] blocks (dA, A^T, K K^T) and one
    [BT, BKC] / [BT, BV] tile of each operand are live: two passes over K (before dL: dA, dKb's terms,
    K K^T; after: dKb again, (R + R^T) K), dk read and written once, in the second.
    """
    pid = tl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    i_b, i_t, bos, eos, rows, m_r, tok = _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV, BT,
                                                     IS_VARLEN)
    o_t = tl.arange(0, BT)
    qk_off = ((i_b * T + rows).to(tl.int64) * H + i_h // GROUP) * K
    r64 = rows.to(tl.int64)

    b_beta = tl.load(beta + i_b * s_bb + i_h * s_bh + r64 * s_bt, mask=m_r, other=0.0).to(tl.float32)
    b_G = tl.load(G + tok, mask=m_r, other=0.0)
    b_Gl = b_G
    if PRECISE:
        b_Gl = tl.load(Gl + tok, mask=m_r, other=0.0)
    b_eG = tl.where(m_r, _exp(b_G, PRECISE), 0.0)
    b_bG = b_beta * b_eG
    b_At = tl.trans(tl.load(A + tok[:, None] * BT + o_t[None, :], mask=m_r[:, None], other=0.0)
                    .to(k.dtype.element_ty))
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dG = tl.zeros([BT], dtype=tl.float32)
    for i_p in tl.static_range(NKG):
        b_dG += tl.load(dG + i_p * s_dG + tok, mask=m_r, other=0.0)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_KK = tl.zeros([BT, BT], dtype=tl.float32)
    # pass 1 over K: dA += dw Kb^T, dKb = A^T dw and its row-sum terms, K K^T (dk is not touched: pass 2
    # recomputes dKb, one more read of dw instead of a second fp32 read + write of dk)
    for i_k in tl.range(0, BK // BKC, num_stages=K1_STAGES):
        o_k = i_k * BKC + tl.arange(0, BKC)
        m_rk = m_r[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
        b_dw = tl.load(dw + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
        b_kf = b_k.to(tl.float32)
        b_Kb = b_kf * b_bG[:, None]
        b_dA += _gdot(b_dw, tl.trans(b_Kb), b_k.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        b_dKb = _gdot(b_At, b_dw, b_k.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        b_dbeta += tl.sum(b_dKb * b_kf * b_eG[:, None], 1)
        b_dG += tl.sum(b_dKb * b_Kb, 1)
        b_KK += _dot(b_k, tl.trans(b_k), PREC, DOT_F32)
    for i_v in tl.range(0, (V + BV - 1) // BV, num_stages=V_STAGES):
        o_v = i_v * BV + tl.arange(0, BV)
        m_rv = m_r[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + i_b * s_vb + i_h * s_vh + r64[:, None] * s_vt + o_v[None, :], mask=m_rv, other=0.0)
        b_du = tl.load(du + tok[:, None] * V + o_v[None, :], mask=m_rv, other=0.0)
        b_vf = b_v.to(tl.float32)
        b_dA += _gdot(b_du, tl.trans(b_vf * b_beta[:, None]), b_At.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        b_dVb = _gdot(b_At, b_du, b_At.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        tl.store(dv + tok[:, None] * V + o_v[None, :], (b_dVb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_rv)
        b_dbeta += tl.sum(b_dVb * b_vf, 1)

    # dL = -A^T dA A^T on the strictly lower triangle of valid rows and columns (fp32 products)
    strict = (o_t[:, None] > o_t[None, :]) & m_r[:, None] & m_r[None, :]
    b_Atf = b_At.to(tl.float32)
    b_dL = -_mm(_mm(b_Atf, b_dA, INV_PREC), b_Atf, INV_PREC)
    b_dL = tl.where(strict, b_dL, 0.0)
    b_R = b_dL * _causal(b_G, b_Gl, strict, PRECISE)                         # dL exp(G_i - G_j)
    b_dbeta += tl.sum(b_R * b_KK, 1)
    b_R = b_R * b_beta[:, None]
    b_P = b_R * b_KK                                                         # dL * L
    b_dG += tl.sum(b_P, 1) - tl.sum(b_P, 0)
    # R strictly lower, R^T strictly upper: each entry of R + R^T is exactly one of them (no rounding), so
    # R K + R^T K is one product
    b_Rs = b_R + tl.trans(b_R)
    # pass 2 over K: dk += beta exp(G) dKb + (R + R^T) K  (dKb = A^T dw again: the same dot as pass 1's)
    for i_k in tl.range(0, BK // BKC, num_stages=K2_STAGES):
        o_k = i_k * BKC + tl.arange(0, BKC)
        m_rk = m_r[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + qk_off[:, None] + o_k[None, :], mask=m_rk, other=0.0)
        b_dw = tl.load(dw + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
        b_dKb = _gdot(b_At, b_dw, b_k.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        b_dk = tl.load(dk + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0) + b_dKb * b_bG[:, None]
        b_dk += _gdot(b_Rs, b_k, b_k.dtype, GPREC, EMU_TF32, PREC, DOT_F32)
        tl.store(dk_out + tok[:, None] * K + o_k[None, :], b_dk.to(dk_out.dtype.element_ty), mask=m_rk)

    # dg: reverse cumsum inside the chunk (padded rows carry dG = 0)
    b_dG = tl.where(m_r, b_dG, 0.0)
    b_dg = tl.sum(b_dG, 0) - tl.cumsum(b_dG, 0) + b_dG
    if GATE:
        A_log_h = tl.load(A_log + i_h).to(tl.float32)
        dt_bias_h = tl.load(dt_bias + i_h).to(tl.float32)
        b_a = tl.load(g + i_b * s_gb + i_h * s_gh + r64 * s_gt, mask=m_r, other=0.0).to(tl.float32)
        b_x = b_a + dt_bias_h
        # softplus'(x) = sigmoid(x) below the threshold, 1 above it; sigmoid = 1 / (1 + exp(-x)) with
        # exp only of -|x| (no overflow)
        e = _exp(-tl.abs(b_x), PRECISE)
        sig = tl.where(b_x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        dsp = tl.where(b_x > THRESHOLD, 1.0, sig)
        b_gate = _gate(b_a, A_log_h, dt_bias_h, THRESHOLD, PRECISE)
        tl.store(dA_log_t + tok, b_dg * b_gate, mask=m_r)
        b_dg = b_dg * (-_exp(A_log_h, PRECISE)) * dsp
    tl.store(dg + tok, b_dg, mask=m_r)
    tl.store(dbeta + tok, b_dbeta, mask=m_r)


# ============================================================================================
# stage 5: q / k gradients per key head (GVA group sum, l2norm backward, cast)
# ============================================================================================

@triton.jit
def bwd_qk_finish_kernel(
    d_hv, x, out, n_rows,
    H: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    L2NORM: tl.constexpr, EPS: tl.constexpr,
):
    """Per block of BR rows (token, key head h): d = sum_j d_hv[token, h * GROUP + j] (the GVA group's value
    heads); with L2NORM, through y = x / sqrt(sum(x^2) + eps):  dx = (d - y (y . d)) / sqrt(sum(x^2) + eps).

    d_hv: [B, T, HV, K] fp32 or 16-bit; x: [B, T, H, K] contiguous (the raw q or k); out: [B, T, H, K] (its
    dtype).
    grid = (cdiv(B T H, BR),). All in fp32.
    """
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = r < n_rows
    o_k = tl.arange(0, BK)
    m = m_r[:, None] & (o_k < K)[None, :]
    r64 = r.to(tl.int64)
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.static_range(GROUP):                 # row (token, h) -> value head rows (token, h G + j)
        acc += tl.load(d_hv + (r64 * GROUP + j)[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if L2NORM:
        xr = tl.load(x + r64[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        rs = tl.rsqrt(tl.sum(xr * xr, 1) + EPS)
        y = xr * rs[:, None]
        acc = (acc - y * tl.sum(y * acc, 1)[:, None]) * rs[:, None]
    tl.store(out + r64[:, None] * K + o_k[None, :], acc.to(out.dtype.element_ty), mask=m)


# ============================================================================================
# host side
# ============================================================================================

def dv_local_bwd_config(K: int, V: int, tiles: torch.dtype) -> dict:
    """Stage 1: one [BT, BT] product then BV-wide [BT, BT] x [BT, BV] dots over V (tiles: q's and k's dtype as the
    stage loads them). bf16 tiles (the bf16 default): BV 64 with the V loop pipelined at three stages, so the next
    dO block loads behind this one's dot: Triton 3.6, bench_train's shape, fwd+bwd against BV 128 in one stage, the
    same bits: H200 3.464-3.486 -> 3.447-3.452 ms, H100 3.606-3.637 -> 3.585-3.589 (RESULTS.md, 2026-11-27). Others
    (fp16 untimed; fp32 tiles double the shared memory) keep BV 128 in one stage."""
    BVmax = _blocks(K, V)[1]
    if is_interpreting():
        return dict(BV=min(64, BVmax), num_warps=4, num_stages=1)
    if tiles == torch.bfloat16:
        return dict(BV=min(64, BVmax), num_warps=4, num_stages=3)
    return dict(BV=min(128, BVmax), num_warps=4, num_stages=1)


def dh_bwd_config(N: int, HV: int, K: int, V: int, device: torch.device, fp32: bool = False,
                  tf32_operands: bool = False, store16: bool = False, sixteen_bit: bool = False) -> dict:
    """Stage 2: the sequential pass, like the forward's kernel 3 (fast.chunk.state_config): BV trades
    programs (parallelism) against redundant q/k/w reads. num_stages 2 prefetches the next chunk's
    q, k, w; with fp32 operands (fp32 recompute) 1: at BT = 64, K = 128, BV = 32 two stages took 226 KB
    of shared memory (Triton 3.9, sm_90), at the 227 KB limit of an H100/H200 block. On warp-MMA GPUs
    (fast.chunk.common._warp_mma) BV <= 32, as the forward's pass (fast.chunk.state_config): at bench_train's
    shape (bf16 default) BV 64 spills 48 B per thread on sm_80, BV 32 none (ptxas 12.9; untimed)."""
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
    warp = _warp_mma(device)
    BV = min(BV, BVmax, 32 if warp else BVmax)
    if fp32:                          # fp32 q, k, w tiles: 4 warps spilled (255 registers), 8 do not
        # BV >= 32: BV = 16 at 8 warps with tf32x3 products (fp16 inputs) faults with an illegal memory
        # access on an H100 (Triton 3.6, BT = 64, K = V = 128; BV 32 or 4 warps run and agree).
        # tf32 operands (fp32 copies of 16-bit inputs): BV 64 once there is a program per SM: every
        # V-block program reloads the chunk's fp32 q, k, w (H100, Triton 3.6, bench_train's shape
        # B=4 T=4096 HV=32, 256 programs at BV 64: fwd+bwd 11.3 ms at BV 64 vs 11.9 at BV 32; two
        # stages at BV 64 need 254 KB of shared memory, over the limit)
        BV = 64 if tf32_operands and N * HV * cdiv(V, 64) >= sms and not warp else max(BV, 32)
        if store16 and sixteen_bit and BV == 64 and BK <= 128:
            # 16-bit storage and 16-bit products (sixteen_bit: the bf16 default, STAGE_GRAD_DOT's dh None) at BV 64
            # (a program per SM and more): 4 warps, one stage. 48 KB of shared memory and
            # 255 registers (4 B of spills; sm_90a, Triton 3.6) hold two programs per SM, where 8 warps and two
            # stages (137 KB) hold one: bench_train's 256 programs run in one wave instead of two. H200, Triton
            # 3.6, bench_train's shape, this kernel 458 -> 424 us (4 warps at BV 32 two stages 479, 8 warps at
            # BV 128 543; benchmarks/RESULTS.md, 2026-11-27)
            return dict(BV=64, num_warps=4, num_stages=1)
        # 16-bit storage (q, k, w read as 16-bit tiles): two stages fit and prefetch the next chunk (H100,
        # Triton 3.6, bench_train's shape: fwd+bwd 7.03 ms vs 7.17 with one stage)
        return dict(BV=min(BV, BVmax), num_warps=8, num_stages=2 if store16 else 1)
    return dict(BV=BV, num_warps=4 if BK * BV <= 128 * 64 else 8, num_stages=2)


def dqkwg_bwd_config(K: int, V: int, rprec: Optional[str] = None) -> dict:
    """Stage 3: per program a BKC-wide K-block (grid (chunks * HV * BK / BKC,)): three [BT, BKC] and one
    [BT, BT] fp32 accumulators, V in blocks of BV. Before the K split (one program per chunk, [BT, BK]
    accumulators, 8 warps, BV 32) the kernel spilled 312 B per thread with serialised wgmma (sm_90,
    Triton 3.9, bf16 with the fp32 recompute, K = V = 128, BT = 64); split at BKC 64, 8 warps: no spill
    at BV 64 or 32 (4 warps: 408 / 520 B). Without dw (stage 3b's since 2026-11-25; bf16x2 default, bench
    shape): 4 warps spill 96 B; K whole (BKC 128) at 8 warps 72 B. fwd+bwd at bench_train's shape (H100,
    Triton 3.6, one process): pinned 5.13-5.19 ms; BKC 128 / 8 warps 5.47, with BV 64 5.32, with one stage
    5.69; BV 64 5.27; 8 warps 6.08.
    rprec: the recompute's precision (RECOMPUTE_PRECISION): None, 16-bit operands, one stage; "tf32x3" (fp16's),
    fp32 operands, two; "bf16x2" (the bf16 default: v_new's bf16 hi + lo terms), three. Under ncu (H200, Triton
    3.6, bench_train's shape, 2026-11-27) the two-stage loop spent 9 % of all its stall samples at the h tile's
    load, the first of the iteration's prefetched tiles (waiting for them). Three stages (53 KB of shared
    memory; still two programs per SM, by registers): fwd+bwd 3.617-3.622 -> 3.556-3.569 ms; four stages
    3.561-3.576; BV 16 at three / four 3.593-3.624 (same process; gradients bit for bit the pinned ones at
    BV 32). fp16's tf32x3 operands keep two stages (not timed with more). On sm_80 (ptxas 12.9, bench_train's
    shape, bf16 default) this config spills 396 B per thread, BKC 32 none; but an H200 running BKC 32 here together
    with wy_bwd_config's 8-warp tile (benchmarks/as_capability, 2026-11-30) returned dk = inf in one conformance case
    and faulted in the tests; each alone agreed with the pinned tiles at B=2 T=256 there (and both in the
    interpreter): not isolated, so neither is taken anywhere."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():             # two K-blocks where K allows: CI runs the split
        return dict(BKC=max(16, min(64, BK // 2)), BV=min(64, BVmax), num_warps=4, num_stages=1)
    stages = 1 if rprec is None else 3 if rprec == "bf16x2" else 2
    return dict(BKC=min(64, BK), BV=min(32, BVmax), num_warps=4, num_stages=stages)


def dw_bwd_config(K: int, V: int) -> dict:
    """Stage 3b: one [BT, BK] fp32 accumulator, V in blocks of BV. fwd+bwd at bench_train's shape (H100, Triton
    3.6, one process): BV 64 5.18 ms, BV 32 5.22, BV 16 5.26, one stage 5.29, 8 warps 5.36-5.46."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():
        return dict(BV=min(64, BVmax), num_warps=4, num_stages=1)
    return dict(BV=min(64, BVmax), num_warps=4 if BK <= 128 else 8, num_stages=2)


def wy_bwd_config(K: int, V: int, sixteen_bit: bool = False) -> dict:
    """Stage 4: K in blocks of BKC, V in blocks of BV; live: three [BT, BT] fp32 blocks (dA, A^T, K K^T)
    and one operand tile of each kind. sm_90, Triton 3.9, bench_train's shape (bf16, fp32 recompute):
    8 warps BV 32 spill 4 B, BV 64 8 B, 4 warps BV 32 144 B (before the K blocks: 288 B at 8 warps).
    sixteen_bit (its products with a gradient operand are 16-bit: dw and dv_new arrive 16-bit; the bf16
    default): BV 64, no spills at the bench shape, and fwd+bwd 5.33 ms against 5.38-5.39 at BV 32 (H100,
    Triton 3.6, bench_train --sweep wy, 2026-11-25 01:55, on a tree with a slower stage-3 variant that was not
    kept, this WY kernel; 8 warps 5.89-6.04, two stages no better, BKC 64 faulted: bench_train's sweep comment;
    the WY kernel then took 714 us against 781 in the next profiles). With fp32 or tf32 products BV 64 spills
    more (sm_90, Triton 3.9, small shape: fp16 inputs 536 -> 1176 B, fp32 7.4 -> 42.9 KB), so BV stays 32.
    Per-loop pipelining (K1_STAGES, V_STAGES, K2_STAGES: the kernel's three loops; the kernel's num_stages 1
    leaves the others alone). Under ncu (H200, Triton 3.6, bench_train's shape, 2026-11-27) the kernel waited
    on its loads (long scoreboard the largest stall; pass 2's dk load alone 10 % of the stall samples).
    Same process, fwd+bwd ms, pinned 3.52-3.55: K2 two stages 3.520-3.525, **three 3.472-3.483** (bit for bit,
    sixteen_bit's pin), V two 3.570-3.579; K1 two stages faults (illegal memory access), and every variant
    with K1 pipelined returned other gradients (max difference 0.06: the same miscompile, not a rounding), so
    pass 1 is never pipelined. fp16 / fp32 products keep one stage (not timed). On sm_80 (ptxas 12.9, bench_train's
    shape, bf16 default) the sixteen_bit pin spills 468 B per thread (BKC 16, BV 32, 8 warps: 104 B; not kept: see
    dqkwg_bwd_config)."""
    BK, BVmax = _blocks(K, V)
    if is_interpreting():             # two K-blocks where K allows: CI runs the split
        return dict(BKC=max(16, min(64, BK // 2)), BV=min(64, BVmax), num_warps=4, num_stages=1)
    if sixteen_bit:
        return dict(BKC=min(32, BK), BV=min(64, BVmax), num_warps=4, num_stages=1, K2_STAGES=3)
    return dict(BKC=min(32, BK), BV=min(32, BVmax), num_warps=4, num_stages=1)


def _l2norm_fwd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [B, T, H, K] -> l2norm over the last dim in dtype (fast.gating.l2norm's kernel: fp32 arithmetic,
    refgdn.l2norm's; one pass where torch took six elementwise kernels, ~0.35 ms at bench_train's shape)."""
    return l2norm_into(x, torch.empty(x.shape, dtype=dtype, device=x.device), L2NORM_EPS)


def _qk_finish(d_hv: torch.Tensor, x: torch.Tensor, H: int, l2: bool, dtype: torch.dtype) -> torch.Tensor:
    """d_hv: [B, T, HV, K] fp32 per value head, x: [B, T, H, K] (the raw q or k) -> [B, T, H, K] in dtype:
    summed over each GVA group, through the l2norm when l2 (stage 5, one kernel pass)."""
    B, T, HV, K = d_hv.shape
    out = torch.empty(B, T, H, K, dtype=dtype, device=d_hv.device)
    n_rows = B * T * H
    if n_rows == 0:
        return out
    BR = 16 if is_interpreting() else 32
    launch(bwd_qk_finish_kernel, (cdiv(n_rows, BR),),
           dict(H=H, GROUP=HV // H, K=K, BK=_blocks(K, 16)[0], BR=BR, L2NORM=l2, EPS=L2NORM_EPS, num_warps=4),
           d_hv, x.contiguous() if l2 else d_hv, out, n_rows)
    return out


@one_host_read   # cu_seqlens read to the host once per call (value check + varlen tables)
def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64,
                               stages: Optional[dict] = None, *, configs: Optional[dict] = None,
                               precision: Optional[tuple] = None, kkt: Optional[tuple] = None,
                               from_a: Optional[bool] = None, vn_split: Optional[bool] = None):
    """Gradients of fast.chunk_gated_delta_rule (refgdn.delta_rule_bwd.chunk_gated_delta_rule_bwd's twin).

    q, k: [B, T, H, K]  v: [B, T, HV, V]  g, beta: [B, T, HV]  do: [B, T, HV, V]  dht: [N, HV, K, V] or None
    -> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias): each in its input's dtype (dh0 [N, HV, K, V],
    None without initial_state; dA_log, ddt_bias [HV], None without fused gating; with fused gating dg is
    the gradient of the raw gate input a). Inputs are assumed validated (the forward did) and not float64.
    stages: a dict to receive each stage's outputs (tests compare them with refgdn.delta_rule_bwd's
    stages): h, v_new, dv_local, dh, dv_new, dh0, stage 3's dq, dk, dG (per value head) and 3b's dw, then dk
    (total per value head), dv, dbeta, dg. Costs copies; None in normal use.
    Benchmark knobs (None in normal use): configs, per-stage config overrides (module comment);
    precision, a (grad_dot, recompute) pair replacing (GRAD_DOT_PRECISION[dt], RECOMPUTE_PRECISION[dt]),
    or a triple whose third item "16-bit" stores the recompute's chunk-local intermediates (normalised
    q / k, A, w, u, h, dh) in the inputs' 16-bit dtype (v_new stays fp32) while every kernel still computes
    on their fp32 values at the recompute / grad_dot precision (module comment STORAGE; the 16-bit default);
    an optional fourth item, kernel 1's recompute: "recompute" (the default: fp32 products at the recompute
    precision) or "forward" (experimental, 16-bit storage only: exactly the forward's kernel 1, 16-bit
    products of the 16-bit normalised k, the same A the forward used, at the forward's cost); an optional
    fifth, {stage: grad_dot precision} for stages whose products with a gradient operand differ (dv_local, dh,
    dqkwg, dqkwg_post: stage 3's products of ds with K and Q, dw, wy; module comment STAGE_GRAD_DOT).
    kkt: (A, G, kn or None), kernel 1's outputs kept by the forward (chunk_gated_delta_rule_fwd's keep_kkt; the
    custom op passes them where reuses_forward_kkt(dtype)): used, and kernel 1 not run, when kernel 1 would
    run the forward's way (those exact values); ignored otherwise.
    from_a (benchmark knob): True, the recompute's state pass forms v_new from A as the forward's does, and kernel 2
    forms w only; False, kernel 2 forms w and u and the pass reads them; None (the default): True for bf16 inputs,
    False for the others (module comment FROM_A).
    vn_split (test knob): False stores v_new in fp32 and stage 3 splits it where the default would store its bf16
    hi + lo terms (bf16 inputs, stage 3's bf16x2 products, 16-bit dh: the state kernel's VN_SPLIT); the
    gradients are the same bits either way. None: the default rule.
    """
    _check_fast_limits(q.shape[3], v.shape[3], chunk_size)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    scale = K ** -0.5 if scale is None else float(scale)
    dev, dt = q.device, q.dtype
    l2 = bool(use_qk_l2norm_in_kernel)
    A_log, dt_bias, cu_seqlens = _contig(A_log), _contig(dt_bias), _contig(cu_seqlens)
    ch = _Chunks(B, T, BT, cu_seqlens)
    precise = _precise(v.dtype)
    dot_f32 = is_interpreting()
    BK, _ = _blocks(K, V)
    if precision is None:
        precision = (GRAD_DOT_PRECISION[dt], RECOMPUTE_PRECISION[dt], RECOMPUTE_STORAGE[dt], RECOMPUTE_KKT[dt],
                     STAGE_GRAD_DOT[dt])
    gprec, rprec = precision[:2]
    stage_gprec = dict(precision[4]) if len(precision) > 4 and precision[4] else {}
    if set(stage_gprec) - set(STAGE_GRAD_DOTS) or ("bf16x2" in stage_gprec.values() and dt != torch.bfloat16):
        raise ValueError(f"precision: per-stage grad_dot precisions are for {', '.join(STAGE_GRAD_DOTS)} "
                         f"(bf16x2 for bf16 inputs only), got {stage_gprec} for {dt}")
    storage = precision[2] if len(precision) > 2 else None
    if storage not in (None, "16-bit"):
        raise ValueError(f"precision: storage must be None or '16-bit', got {storage!r}")
    store16 = storage == "16-bit"
    if store16 and (gprec is None or rprec is None or dt == torch.float32):
        raise ValueError(f"precision: 16-bit storage needs a grad_dot and a recompute precision and 16-bit "
                         f"inputs, got {precision} for {dt}")
    kkt_mode = precision[3] if len(precision) > 3 else "recompute"
    if kkt_mode not in ("recompute", "forward") or (kkt_mode == "forward" and not store16):
        raise ValueError(f"precision: kernel 1's mode must be 'recompute', or 'forward' with 16-bit storage, "
                         f"got {precision}")
    if "bf16x2" in (gprec, rprec) and dt != torch.bfloat16:
        raise ValueError(f"precision: 'bf16x2' needs bf16 inputs (its split operands are bf16), got {precision} "
                         f"for {dt}")
    beta_dtype = beta.dtype
    if rprec is not None:
        # recompute in fp32 (the 16-bit values convert exactly); every dot of the backward then takes
        # fp32 operands at input_precision rprec. fp32 copies only where a kernel reads the raw 16-bit
        # tensor as a dot operand: q and k without l2norm and without 16-bit storage. With l2norm, kernel 1
        # converts its k tiles and writes the normalised k, and q is normalised below; with 16-bit storage
        # the raw inputs are the stored values. v is read by kernel 2 (converts its tiles) and the WY
        # backward (converts), beta by kernels that convert on load.
        if not l2 and not store16:
            q, k = q.float(), k.float()
        cdt, prec, prec_of = torch.float32, rprec, (rprec, dt)
    else:
        cdt, prec, prec_of = dt, _fp32_prec(dt), None
    k_in = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()

    # ---- 0. recompute the forward's intermediates (kernels 1-3 of fast.chunk) --------------------
    # precision hazard: the forward's 16-bit intermediates (A, w, u, h, v_new, l2norm(k)) each round at
    # 2^-9 (bf16): with them dg failed the conformance rule (module constants above); RECOMPUTE_PRECISION
    # recomputes them in fp32.
    sdt = dt if store16 else cdt                                         # storage of A, kn, qu, w, u, h, dh
    Gl = None
    # fp32 k blocks in one warp spill (1.2 KB per thread at K = 128, sm_90, Triton 3.9; 2 warps: 0.5 KB)
    fp32_gpu = cdt == torch.float32 and not is_interpreting()
    # kkt_mode "forward": kernel 1 exactly as the forward ran it (16-bit k tiles normalised and rounded,
    # 16-bit products, its pinned config), so A is the forward's and consistent with the stored kn
    as_fwd = kkt_mode == "forward"
    if as_fwd and kkt is not None and not precise and kkt[0].dtype == sdt and (kkt[2] is not None) == l2:
        A, G, kn = kkt                       # the forward's kernel 1 outputs: what it would recompute, exactly
    else:
        G = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
        Gl = torch.empty_like(G) if precise else None
        A = torch.empty(B, T, HV, BT, dtype=sdt, device=dev)
        kn = torch.empty(B, T, H, K, dtype=sdt, device=dev) if l2 else None
        _launch_kkt(k_in, g, beta, A_log, dt_bias, G, Gl, A, kn, ch, T, HV, BT, l2norm=l2, load_g=False,
                    store_g=True, do_a=True, precise=precise, prec_of=None if as_fwd else prec_of,
                    cfg_over=dict(num_warps=2) if fp32_gpu and K <= 128 and not as_fwd else None, configs=configs)
    ku = kn if l2 else k_in.contiguous()                                 # the k the recurrence used
    qu = _l2norm_fwd(q, sdt) if l2 else q.contiguous()                   # likewise q ([B, T, H, K])
    # w for the reverse pass (stage 2). from_a: the recompute's state pass forms v_new = A (beta (V - exp(G) K S))
    # itself, as the forward does, so kernel 2 forms w only (u is never stored or read back)
    if from_a is None:
        from_a = dt == torch.bfloat16
    w = torch.empty(B, T, HV, K, dtype=sdt, device=dev)
    u = None if from_a else torch.empty(B, T, HV, V, dtype=sdt, device=dev)
    _launch_w_u(ku, v, beta, G, A, w, u, ch, T, BT, precise=precise, prec_of=prec_of, configs=configs)
    # precision hazard: dG's last-row term exp(G_L) <h, dh> + sum_j k_j . dk_state_j cancels O(sqrt(K V))
    # parts down to O(1): with GPREC set, h and v_new are stored in fp32 (the state kernel stores its
    # fp32 registers) even when the rest is 16-bit (for bf16, h 16-bit and v_new as two bf16 terms: below).
    hv_dt = cdt if gprec is None else torch.float32
    state_dt = sdt if store16 else hv_dt                                 # h here, dh in stage 2
    h = torch.empty(ch.total, HV, K, V, dtype=state_dt, device=dev)
    # bf16x2 products in stage 3 on a 16-bit dh: v_new stored as its bf16 hi + lo terms (the state kernel's
    # VN_SPLIT), the operands stage 3 would split an fp32 v_new into (ncu, H200: the split and the fp32 tile's
    # shared-memory traffic were ~10 % of stage 3's stall samples)
    vn_split = (vn_split is not False and dt == torch.bfloat16 and hv_dt == torch.float32
                and state_dt == torch.bfloat16 and stage_gprec.get("dqkwg", gprec) == "bf16x2")
    if vn_split:
        vn2 = torch.empty(2, B, T, HV, V, dtype=torch.bfloat16, device=dev)
        v_new, vn_lo = vn2[0], vn2[1]
    else:
        v_new = torch.empty(B, T, HV, V, dtype=hv_dt, device=dev)
        vn_lo = None
    h0 = initial_state.contiguous() if initial_state is not None else None
    # shared memory: the state kernel pipelines its k, w, u loads over num_stages = 3; with fp32 tiles at
    # BT = 64, K = 128, BV = 32 that is 246 KB (Triton 3.9, sm_90), over the 227 KB an H100/H200 block
    # may use: 2 stages for fp32 operands, and BV 64 once there is a program per SM (fewer reloads of the
    # fp32 k and w tiles; H100, Triton 3.6, bench_train's shape: fwd+bwd 11.5 ms vs 11.9 at BV 32)
    st_over = None
    if fp32_gpu:
        st_over = dict(num_stages=2)
        if rprec is not None and N * HV * cdiv(V, 64) >= _num_sms(dev) and V >= 64 and not _warp_mma(dev):
            st_over.update(BV=64, num_warps=4)      # (warp-MMA GPUs: BV 64 spills 708 B on sm_80; state_config)
    # fp32 tiles: BV 64 from two programs per SM (the rule measured for this recompute; the forward takes
    # BV 64 from half a program per SM)
    _launch_state(ku, None if from_a else w, u, G, Gl, h0, h, v_new, None, ch, N, T, BT, precise=precise,
                  prec_of=prec_of, cfg_over=st_over, configs=configs,
                  bv64_programs=2 * _num_sms(dev) if fp32_gpu else None, wy=(A, v, beta) if from_a else None,
                  vn_lo=vn_lo)
    del u

    Glx = G if Gl is None else Gl
    do = do.contiguous()
    f32 = dict(dtype=torch.float32, device=dev)
    # dv_new and dw are read only as operands of stage 3b's / stage 4's products (and stage 2's own, on its
    # registers). Where those products are 16-bit (bf16 default: STAGE_GRAD_DOT dw, wy None) they round the
    # operand to the inputs' dtype on load, so storing the rounded value instead is exact, bit for bit, and
    # halves the bytes (the same round-to-nearest cast, in the writer instead of the reader; bench_train's shape,
    # bf16: 0.27 GB less written, 0.54 GB less read).
    # dv_local (stage 1's, read once by stage 2 and added to in fp32 there) is stored like dv_new, whose readers
    # round the sum anyway: dv_new = rnd(rnd(dv_local) + exp(G_L - G) K dS), a second rounding (up to 1.5 ulp
    # of the dtype instead of 0.5) for 0.13 GB less written and 0.13 GB less read (bench_train's shape). Quick
    # bf16 families in the interpreter with round-to-nearest casts (benchmarks.grad_precision --quick
    # --interpreter-rne), the default's worst ratio: 0.762 with dv_local fp32, 0.876 stored bf16 (ddt_bias,
    # fused gating).
    wy_gprec = stage_gprec.get("wy", "tf32" if gprec == "bf16x2" else gprec)
    dw_gprec = stage_gprec.get("dw", gprec)
    rounds = sdt == dt != torch.float32                  # the products' 16-bit dtype is the inputs' (k, A in dt)
    dw_dt = dt if rounds and wy_gprec is None else torch.float32
    dvn_dt = dt if rounds and wy_gprec is None and dw_gprec is None else torch.float32
    dv_new = torch.empty(B, T, HV, V, dtype=dvn_dt, device=dev)
    dh = torch.empty(ch.total, HV, K, V, dtype=state_dt, device=dev)
    dh0 = torch.empty(N, HV, K, V, **f32) if initial_state is not None else None
    qk_dt = dt if QK_GRAD_STORAGE.get(dt) == "16-bit" else torch.float32
    dq = torch.empty(B, T, HV, K, dtype=qk_dt, device=dev)
    dk = torch.empty(B, T, HV, K, **f32)                                 # stage 3's; stage 4 adds to it
    dk_tot = dk if qk_dt == torch.float32 else torch.empty(B, T, HV, K, dtype=qk_dt, device=dev)
    dw = torch.empty(B, T, HV, K, dtype=dw_dt, device=dev)
    dq_cfg = _cfg("dqkwg", dqkwg_bwd_config(K, V, rprec), configs)
    NKG = BK // dq_cfg["BKC"]                                            # stage 3's K-blocks
    dG = torch.empty(NKG, B, T, HV, **f32)                               # their partial sums of dG
    dv = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    dbeta = torch.empty(B, T, HV, **f32)
    dg = torch.empty(B, T, HV, **f32)
    dA_log_t = torch.empty(B, T, HV, **f32) if A_log is not None else None
    # 16-bit storage: the stages' own products of stored values (Q K^T, K K^T) take 16-bit operands, exact
    # products of the stored values (PREC None); products with a gradient operand convert both to fp32
    def grad_prec(gp):                   # _gdot's precision constexprs (tf32 truncation emulated when interpreting)
        return dict(GPREC=gp, EMU_TF32=dot_f32 and gp == "tf32")
    common = dict(H=H, HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, IS_VARLEN=ch.varlen,
                  PREC=None if store16 else prec, DOT_F32=dot_f32, PRECISE=precise, **grad_prec(gprec))

    def stage(name, default=gprec):      # common, with the stage's own grad_dot precision where one is given
        return dict(common, **grad_prec(stage_gprec.get(name, default)))

    if ch.total > 0 and HV > 0:
        # ---- 1. dv_local --------------------------------------------------------------------------
        dv_local = dv_new if stages is None else torch.empty_like(dv_new)  # stage 2 reads it, then overwrites
        launch(bwd_dv_local_kernel, (ch.total * HV,),
               dict(**stage("dv_local"), **_cfg("dv_local", dv_local_bwd_config(K, V, qu.dtype), configs)),
               qu, ku, G, Glx, do, dv_local, ch.cu_seqlens, ch.indices, T, ch.NT, scale)
        # ---- 2. reverse state pass ----------------------------------------------------------------
        cfg = _cfg("dh", dh_bwd_config(N, HV, K, V, dev, fp32=cdt == torch.float32, tf32_operands=rprec is not None,
                                        store16=store16, sixteen_bit=stage_gprec.get("dh", gprec) is None),
                   configs)
        BV = cfg.pop("BV")
        dht_c = dht.float().contiguous() if dht is not None else None
        launch(bwd_dh_kernel, (cdiv(V, BV), N * HV),
               dict(**stage("dh"), BV=BV, USE_DHT=dht is not None, STORE_DH0=dh0 is not None, **cfg),
               qu, ku, w, G, Glx, do, dv_local, dht_c, dh, dv_new, dh0, ch.cu_seqlens, ch.offsets, ch.order, T, ch.NT,
               scale)
        # ---- 3. dq, dk, dG -------------------------------------------------------------------------
        post = stage_gprec.get("dqkwg_post", stage_gprec.get("dqkwg", gprec))      # ds K, ds^T Q
        launch(bwd_dqkwg_kernel, (ch.total * HV * NKG,),
               dict(**stage("dqkwg"), **dq_cfg, GPREC_POST=post, EMU_POST=dot_f32 and post == "tf32",
                    VN_SPLIT=vn_split),
               qu, ku, v_new, v_new if vn_lo is None else vn_lo, h, dh, G, Glx, do, dq, dk, dG, ch.cu_seqlens,
               ch.indices, T, ch.NT, scale, B * T * HV)
        if stages is not None:
            vn_full = v_new.clone() if vn_lo is None else v_new.float() + vn_lo.float()   # (the terms' sum)
            stages.update(h=h.clone(), v_new=vn_full, dv_local=dv_local.clone(), dh=dh.clone(),
                          dv_new=dv_new.clone(), dh0=None if dh0 is None else dh0.clone(), dq3=dq.clone(),
                          dk3=dk.clone(), dG3=dG.sum(0))
        # ---- 3b. dw = -dv_new h^T ------------------------------------------------------------------
        launch(bwd_dw_kernel, (ch.total * HV,),
               dict(HV=HV, K=K, V=V, BT=BT, BK=BK, IS_VARLEN=ch.varlen, PREC=common["PREC"], DOT_F32=dot_f32,
                    **grad_prec(dw_gprec), **_cfg("dw", dw_bwd_config(K, V), configs)),
               h, dv_new, dw, do, ch.cu_seqlens, ch.indices, T, ch.NT)
        if stages is not None:
            stages.update(dw=dw.clone())
        # ---- 4. WY backward, dg ---------------------------------------------------------------------
        # bf16x2 gradient products everywhere else; tf32 here, the one kernel the split made slower (H200,
        # Triton 3.6, bench_train's shape: 1005 us at tf32, 1089 at bf16x2); both precisions passed the
        # full bf16 gradient families throughout (module comment), this mix lies between them
        wy = dict(common, **grad_prec(wy_gprec))
        launch(bwd_wy_kernel, (ch.total * HV,),
               dict(**wy, NKG=NKG, GATE=A_log is not None, INV_PREC=INV_PRECISION[dt], THRESHOLD=SOFTPLUS_THRESHOLD,
                    **_cfg("wy", wy_bwd_config(K, V, sixteen_bit=wy_gprec is None), configs)),
               ku, v, beta, g, A_log, dt_bias, G, Glx, A, dw, dv_new, dk, dk_tot, dG, dv, dbeta, dg,
               dA_log_t if dA_log_t is not None else dg,
               ch.cu_seqlens, ch.indices, T, ch.NT, B * T * HV, *v.stride()[:3], *beta.stride(), *g.stride())
    elif dh0 is not None:                                                # no tokens: dh0 = dht
        dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
    if ch.total == 0:
        for t in (dq, dk_tot, dG, dbeta, dg, dv):
            t.zero_()
    if stages is not None:
        stages.update(dk=dk_tot.clone(), dv=dv.clone(), dbeta=dbeta.clone(), dg=dg.clone())

    # ---- 5. per key head: sum over the GVA group, l2norm backward, cast (one pass each) -----------
    dq = _qk_finish(dq, q, H, l2, dt)                                    # [B, T, (h j), K] -> [B, T, h, K]
    dk = _qk_finish(dk_tot, k, H, l2, dt)
    dA_log = ddt_bias = None
    if A_log is not None:
        dA_log = dA_log_t.sum((0, 1)).to(A_log.dtype) if T > 0 else torch.zeros_like(A_log)
        ddt_bias = dg.sum((0, 1)).to(dt_bias.dtype) if T > 0 else torch.zeros_like(dt_bias)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return (dq, dk, dv, dg.to(g.dtype), dbeta.to(beta_dtype), dh0, dA_log, ddt_bias)
