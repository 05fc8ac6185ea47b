"""Triton prefill for the gated delta rule: the chunked WY/UT form in four kernels, plus a recurrent kernel.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   state: [N, HV, K, V] float32
    S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

Value head h reads q/k head h // (HV // H) (GVA: q/k are never repeated). Varlen: B == 1 and
cu_seqlens [N+1]; chunks never straddle sequences. Semantics, validation and dtypes are refgdn's
(refgdn.delta_rule): o in v's dtype, final state float32.

Modules, one per math step (named after refgdn.delta_rule's stages; not after the stage twins
themselves, which keep their names as functions of this package):

  common.py     constants, dot-precision tables, jit helpers shared by the kernels (and fast.chunk_bwd),
                host helpers (``_blocks``, ``_cfg``, ``_Chunks``, ...)
  wy.py         kernels 1 and 2 (chunk_cumsum, wy_repr, w_u), their configs, launchers and stage twins
  state.py      kernel 3 (state_passing), its config, launcher and stage twin
  output.py     kernel 4 (chunk_output), its config, launcher and stage twin; q's l2norm row scales for the
                fused pass (row_scales_kernel, twin row_scales)
  recurrent.py  the recurrent kernel and its config
  pipeline.py   one long sequence's forward in segments: kernel 3 on a side stream beside kernels 1 and 4
                (pipeline_segments: B = 1, 2 segments from 256 chunks, 4 from 512, on a GPU; bit-identical
                to the one-pass forward)
  __init__.py   the public ops below; every name of the former single module is re-exported here;
                a call's checks and launches cached by its signature (fast.launch.SignaturePlans)

The pipeline (BT = chunk size in {16, 32, 64}; "chunk" = BT tokens of one sequence):

  1. ``chunk_kkt_inv_kernel``  grid (chunks * HV / HPP)    fully chunk-parallel, 1 warp, HPP value heads
                                                           per program (2 for Qwen3-Next's GVA pairs)
       g (or fused gating of raw a) -> G = chunk-local cumsum            (fp32, stored; fp32 inputs:
           in fp64, with its rounding error Gl stored too, see below)
       k -> l2norm(k) when asked (stored once per key head: kn [B, T, H, K], read by kernels 2-4)
       K K^T (16x16 blocks, tl.dot; once per program, shared by its value heads), then per value head
       L_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j
       A = (I + L)^-1: the 16x16 diagonal blocks by doubling (bf16; fp16 / fp32 on a GPU: forward
           substitution; inv_method chooses), the off-diagonal blocks by block forward substitution (16^3
           fp32 dots, INV_PRECISION);
           A stored in k's dtype (fp32 for fp32 inputs)
  2. ``chunk_w_u_kernel``      grid (chunks * HV)          fully chunk-parallel (the backward's recompute; the
                                                           forward with from_a=False)
       w = A (beta exp(G) K),  u = A (beta V)                             (two [BT, BT] x [BT, *] dots)
  3. ``chunk_state_kernel``    grid (cdiv(V, BV), N * HV)  sequential over the chunks of a sequence (varlen:
                                                           the longest sequences' programs first)
       h[c] = S (stored in k's dtype);  v_new = u - w S (stored);
       S <- exp(G_last) S + K^T (exp(G_last - G) v_new)                   (S: fp32 [K, BV] in registers)
       The forward skips kernel 2: the pass forms v_new = A (beta (V - exp(G) (K S))) itself from A, k, v, beta
       (FROM_A), so w and u never go through HBM and v_new is rounded once (kernel 2's path rounds w and u, then
       v_new). With many (sequence, head) pairs the pass also forms o (OUTPUT, pipeline.forward_fuses_output; stage
       twin state_output_wy): kernel 4's products on the chunk-start state and v_new it holds, so h and v_new
       are never stored. With l2norm in the kernel it scales o's rows by q's row scales 1 / |q_i|, formed once
       per row by ``row_scales_kernel`` (launched after kernel 1), not from q's tile in each of its programs.
  4. ``chunk_output_kernel``   grid (chunks * HV * cdiv(V, BV)) fully chunk-parallel (not run when fused into 3)
       O = scale [ exp(G) * (Q h[c]) + ((Q K^T) * exp(G_i - G_j) * causal) v_new ]

Varlen chunk tables: built on the host from cu_seqlens' checked values and uploaded with them. Without a host copy
(cu_seqlens_cpu) no kernel waits for the host's read: ``chunk_table_kernel`` builds every kernel's tables on the
device from the offsets clamped to [0, T] (rows past the last chunk: no chunk), and the host reads and checks the
values after the launches (chunk_gated_delta_rule_fwd's offsets_unchecked).

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
``FP32_PRECISION`` (tl.dot input precisions, see fast.chunk.common).

``recurrent_kernel`` (grid (cdiv(V, BV), N * HV)) is the time loop with the state in registers:
the twin of refgdn.recurrent_gated_delta_rule, handy for short T.

Backward (training): fast.chunk_bwd's kernels, reached through autograd of the custom op
torch.ops.fast.chunk_gated_delta_rule (fast.library); it recomputes kernels 1-3's outputs with the
launchers of the step modules (``prec_of`` runs them on fp32 copies at a chosen dot precision), or takes
kernel 1's from the forward where they are the same values (``keep_kkt``; fast.chunk_bwd.reuses_forward_kkt).

Each refgdn stage (chunk_cumsum, wy_repr, w_u, state_passing, chunk_output) has a twin here of
the same name and signature built from the same kernels (kernel 1 runs with constexpr switches),
so each kernel is tested alone against refgdn.delta_rule's stage.

Configs are pinned by small heuristics (``*_config`` in the step modules), never autotuned at run time: the
prefill path must launch exactly the variants warmup compiled (DESIGN.md invariants 1 and 2) and
autotune would re-run kernels. Dots keep 16-bit operands on the GPU (fp32 accumulate); fp32 inputs
use IEEE fp32 dots (TF32 would exceed the conformance bound) and a range-reduced exp (``_exp``).
In the Triton interpreter dot operands are cast to fp32 (bf16 dots are wrong there) and every
kernel uses one config. float64 inputs run refgdn itself (the oracle is the float64 path; there
are no float64 kernels).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

import refgdn
from refgdn.checks import (check_cu_seqlens_values, check_gdn_inputs, check_offsets_again, fla_recurrent_arguments,
                           final_state_v_first, fla_keywords, host_offsets_known, host_offsets_later, one_host_read)

from ..launch import SignaturePlans, launch, shape_key, varlen_key

from ..utils import cdiv, next_pow2
# every name of the former single module fast/chunk.py stays importable from fast.chunk
from .common import (CHUNK_ORDER_BLOCK, CHUNK_SIZES, CHUNK_TABLE_BLOCK, FP32_PRECISION,  # noqa: F401
                     INV_DIAG_PRECISION, INV_PRECISION, L2NORM_EPS, MAX_HEAD_DIM, SOFTPLUS_THRESHOLD, _blocks, _cfg,
                     _check_fast_limits,
                     _chunk_coords, _chunk_rows, _Chunks, _contig, _dot, _dot_split, _exp, _fp32_prec, _gate, _gdiff,
                     _is_fp64, _l2norm_rows, _num_sms, _precise, _seq_coords, _seq_first_chunk, _seq_head, _trunc_tf32,
                     _unit_last, chunk_table_kernel)
from .wy import (_dummy, _g_block, _inv_diag_rows, _inv_rows, _inv_unit_lower, _k_block,  # noqa: F401
                 _kk, _l_block, _launch_kkt, _launch_w_u, _mm32, _row_step, _store_a, _wy_repr, chunk_cumsum,
                 chunk_kkt_inv_kernel, chunk_w_u_kernel, kkt_config, kkt_heads_per_program, w_u, w_u_config,
                 wy_repr)
from .state import (_launch_state, chunk_state_kernel, state_config, state_fuses_output,  # noqa: F401
                    state_output_wy, state_passing, state_passing_wy, state_prefetch_beta)
from .output import (_launch_output, _launch_row_scales, chunk_output, chunk_output_kernel, output_config,  # noqa: F401
                     row_scales, row_scales_config, row_scales_kernel)
from .recurrent import recurrent_config, recurrent_kernel  # noqa: F401
from .pipeline import forward_fuses_output, pipeline_segments, pipelined_forward  # noqa: F401


# ============================================================================================
# the public ops
# ============================================================================================

@one_host_read   # cu_seqlens read to the host once per call (value check + varlen tables)
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                           chunk_size=64, cu_seqlens_cpu=None, *, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, state_v_first=False, use_gate_in_kernel=None, chunk_indices=None,
                           cp_context=None, head_first=False):
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
    run refgdn. Reads cu_seqlens on the host (eager prefill, not for CUDA-graph capture): one
    device->host copy, a sync, unless cu_seqlens_cpu (its values as a CPU tensor, fla's argument, vLLM's
    query_start_loc_cpu) is given: then nothing waits for the GPU and the call's host work overlaps the
    previous kernels. Without it (N >= 2) the copy is queued first and every kernel runs on chunk tables built
    on the device from the offsets (clamped to [0, T]: memory-safe for any values); the host waits for the copy
    after the launches and checks the values (the ValueError comes before anything is returned): the device does
    not idle through the host's read and work (chunk_gated_delta_rule_fwd's offsets_unchecked). For offsets that
    pass the check, the tables and so the outputs are the host tables' bit for bit.

    Differentiable: when an input requires grad (or torch.compile traces the call) it runs as the
    custom op torch.ops.fast.chunk_gated_delta_rule (fast.library), whose backward is fast.chunk_bwd's
    kernels: gradients of q, k, v, g (or of a, A_log, dt_bias with fused gating), beta, initial_state.

    fla 0.6.0's keywords (keyword-only; refgdn.checks.fla_keywords): use_beta_sigmoid_in_kernel, allow_neg_eigval,
    state_v_first (initial and final states [N, HV, V, K]: the state pass reads and writes that layout through its
    strides, no copy), use_gate_in_kernel, chunk_indices, cp_context, head_first.
    """
    # (beta's logits go through torch's sigmoid here, not the kernels' beta_logits: its two launches cost less than
    # the sigmoid in the fused state pass, 20-70 us at the prefill table's sizes: RESULTS.md, 2026-11-27)
    beta, initial_state, A_log, dt_bias, vk = fla_keywords(
        q, v, beta, initial_state, A_log, dt_bias, cu_seqlens, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first, use_gate_in_kernel, chunk_indices, cp_context, head_first)
    # a signature whose call passed the checks before skips them and launches through its plan (fast.launch:
    # the compiled launchers reused). The checks' value rules concern cu_seqlens only, and run on every call: after
    # the launches (chunk_gated_delta_rule_fwd's offsets_unchecked), or here on the host (cu_seqlens_cpu's values, or
    # the offsets read once per call). Integer arguments follow from the shapes; a varlen call's grids follow
    # from its chunk counts, and each launch takes its own grid.
    behind = _check_behind(cu_seqlens, cu_seqlens_cpu)
    sig = _call_signature(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, A_log,
                          dt_bias, chunk_size, cu_seqlens, cu_seqlens_cpu)
    plan = _PLANS.get(sig)
    if plan is not None and not behind and not torch.compiler.is_compiling():
        check_offsets_again(cu_seqlens, cu_seqlens_cpu, q.shape[1])     # (the values' rules, on every call)
    if plan is None:
        check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, chunk_size,
                         cu_seqlens_cpu,       # with cu_seqlens_cpu: its values stand for cu_seqlens' in this call
                         offset_values=not behind)
        if _is_fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):         # (refgdn checks the values itself)
            o, final = refgdn.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                     cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size,
                                                     cu_seqlens_cpu)
            return o, final_state_v_first(final, vk)
        _check_fast_limits(q.shape[3], v.shape[3], chunk_size)
    from .. import library                                               # registers the ops (no cycle at import)
    if library.wants_graph(q, k, v, g, beta, initial_state, A_log, dt_bias):     # (the op checks the values)
        o, final, *_ = library.chunk_gated_delta_rule_op(
            q, k, v, g, beta, q.shape[3] ** -0.5 if scale is None else float(scale), initial_state, cu_seqlens,
            bool(use_qk_l2norm_in_kernel), A_log, dt_bias, int(chunk_size))
        return o, final_state_v_first(final if output_final_state else None, vk)
    if plan is None:
        plan = _PLANS.after_checks(sig)                                  # (None on a signature's first call)
    with plan if plan is not None else contextlib.nullcontext():
        o, final = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                              use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size,
                                              offsets_unchecked=behind, final_v_first=vk)
    return o, final_state_v_first(final, vk)       # (written [N, HV, V, K] already: no copy)


def kernel_beta_logits(use_beta_sigmoid_in_kernel, allow_neg_eigval, q, k, v, g, beta, *rest) -> int:
    """How recurrent_gated_delta_rule takes beta given as logits (fla's use_beta_sigmoid_in_kernel): 1 (sigmoid) or
    2 (allow_neg_eigval: 2 sigmoid) when its kernel applies it per token (BETA_LOGITS), 0 when
    refgdn.checks.fla_keywords maps beta with torch instead: no logits, a gradient wanted or torch.compile tracing,
    float64 (refgdn runs), or arguments fla_keywords rejects with its own message. rest: initial_state, A_log,
    dt_bias as the caller passed them (fast.keys asks the same). (The chunk op maps with torch: a sigmoid in its
    fused state pass costs more than torch's launch.)"""
    if (use_beta_sigmoid_in_kernel is not True or type(allow_neg_eigval) is not bool
            or not isinstance(beta, torch.Tensor) or not beta.is_floating_point()):
        return 0
    from .. import library
    tensors = [t for t in (q, k, v, g, beta, *rest) if isinstance(t, torch.Tensor)]
    if _is_fp64(*tensors) or library.wants_graph(*tensors):
        return 0
    return 2 if allow_neg_eigval else 1


# ============================================================================================
# the eager forward's host path, cached by call signature
# ============================================================================================

# Signatures that passed check_gdn_inputs -> the LaunchPlan of their launches (fast.launch): a repeated call skips the
# checks and launches each kernel through Triton's compiled launcher instead of JITFunction.run. H100 host, B = 1,
# T = 4096, bf16 (2026-11-24): ~320 us of host time per call before, against ~257 us of device time (a CUDA graph's
# replay), so the call was host-bound; fla's is ~600 us. A plan is kept from a signature's second call on.
_PLANS = SignaturePlans(64, seen_size=256)


def _call_signature(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, A_log,
                    dt_bias, chunk_size, cu_seqlens=None, cu_seqlens_cpu=None) -> Optional[tuple]:
    """A hashable summary of what check_gdn_inputs reads, with the token count T and the sequence count N left
    out, or None (the caller then checks in full and keeps no plan). Serving's prefills differ in T and N on
    almost every call; the checks read them only through equalities, which the summary keeps:

    * each tensor's type, dtype, device and shape, less q, k, v, g and beta's dim 1 (T), initial_state's dim 0
      (N) and the lengths of cu_seqlens and cu_seqlens_cpu (N + 1); None-ness included;
    * whether k, v, g and beta's dim 1 equal q's, whether initial_state's dim 0 is N (cu_seqlens' length - 1,
      else the batch), whether cu_seqlens holds at least two offsets, whether cu_seqlens_cpu's shape is
      cu_seqlens', and T == 0;
    * type(scale) (check_scale reads only the type; the value is passed per call), the flags and chunk_size
      with their types (anything but a bool flag: None).

    Two calls with equal summaries pass or fail the checks alike, up to cu_seqlens' value rules (run on every
    call: the caller's). Strides are not read by the checks and are left out too. What the launches depend on
    besides the dtypes and devices held here -- configs that follow N, integer arguments that follow T and the
    strides, grids -- the plan checks per launch (fast.launch.launch and Relaunch). Recomputed on every call
    from the tensors, so a tensor changed in place gives its own summary."""
    if type(output_final_state) is not bool or type(use_qk_l2norm_in_kernel) is not bool:
        return None
    try:
        T = q.shape[1]
        return (shape_key(q, 1), shape_key(k, 1), shape_key(v, 1), shape_key(g, 1), shape_key(beta, 1),
                shape_key(A_log), shape_key(dt_bias), type(scale), output_final_state, use_qk_l2norm_in_kernel,
                type(chunk_size), chunk_size,
                k.shape[1] == T and v.shape[1] == T and g.shape[1] == T and beta.shape[1] == T,
                *varlen_key(q, initial_state, cu_seqlens, cu_seqlens_cpu))
    except Exception:  # noqa: BLE001 - not a tensor, or too few dims: the full checks raise their own error
        return None


def clear_plan_cache() -> None:
    """Forget every cached signature (the next call of each checks in full). Tests and benchmarks."""
    _PLANS.clear()


def _check_behind(cu_seqlens, cu_seqlens_cpu) -> bool:
    """Whether the call checks cu_seqlens' values behind its launches (chunk_gated_delta_rule_fwd's
    offsets_unchecked): varlen with at least two sequences whose values the host does not hold yet (no
    cu_seqlens_cpu, not read earlier in the scope, e.g. by the model's conv). Read inside the op's scope."""
    return (cu_seqlens_cpu is None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
            and cu_seqlens.numel() > 2 and not host_offsets_known(cu_seqlens))


@one_host_read   # cu_seqlens read to the host once per call (value check + varlen tables)
def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                               chunk_size=64, *, configs: Optional[dict] = None, inv_method: Optional[str] = None,
                               keep_kkt: bool = False, from_a: bool = True,
                               fuse_output: Optional[bool] = None, segments: Optional[int] = None,
                               offsets_unchecked: bool = False, slot_rows: Optional[torch.Tensor] = None,
                               update_x2: bool = False, final_v_first: bool = False, beta_logits: int = 0,
                               offsets_on_device: bool = False, out: Optional[torch.Tensor] = None,
                               checkpoints: Optional[tuple] = None, in_rows: Optional[tuple] = None):
    """The forward kernels of chunk_gated_delta_rule (same arguments and results), without validation or
    autograd: for callers that validated already (the public function, the custom op). Not float64.
    configs, inv_method: benchmark knobs passed to the launchers (module docstring).
    keep_kkt: also return kernel 1's outputs, (o, final, (A [B, T, HV, BT], G [B, T, HV] fp32, kn [B, T, H, K]
    or None)): the custom op keeps them for a backward that would recompute exactly these (fast.chunk_bwd).
    from_a: whether the state pass forms v_new from A (kernel 2 not run; the default): False runs kernel 2 first
    and the pass reads w and u, as fla does (tests and benchmarks run both). Whole forward, H100, Triton 3.6, bf16,
    Qwen3-Next shape (2026-11-24): as fast at B = 1 (T=16384 0.931-0.946 ms vs 0.941-0.949, T=65536 3.658-3.672
    vs 3.659-3.665; an H200 run of 2026-11-24 had FROM_A 5 % slower there), 20 % faster in batches (B=4 T=4096
    0.632 vs 0.772, H200), and more accurate: o's error against the float64 truth, B=1 T=4096, mean of 5 seeds,
    max-norm / Frobenius, 6.40e-3 / 3.35e-3 against 6.89e-3 / 3.71e-3 for kernel 2's path (fla 0.6.0: 6.78e-3
    / 3.71e-3; benchmarks.bench_prefill.error_rows). fuse_output: whether the state pass also forms o (kernel 4 skipped,
    h and v_new never stored); None: fast.chunk.pipeline.forward_fuses_output's rule (tests run both). segments: how many
    segments a single dense sequence's forward is pipelined over (fast.chunk.pipeline; 1: not pipelined; taken only
    for B == 1 without cu_seqlens, on the unfused path, on a CUDA device); None: pipeline_segments' rule.
    offsets_unchecked (the public function: varlen, N >= 2, no host copy of cu_seqlens): its values are not
    checked yet. Their device->host copy is queued first, every kernel runs on chunk tables built on the device
    from them (clamped: common._Chunks.unchecked with every_kernel, as offsets_on_device), and only after the
    launches does the host wait for the copy and check the values (check_cu_seqlens_values: the same ValueError,
    raised before anything is returned; the kernels wrote only this call's own tensors). So the device never idles
    through the host's read: the copy waits for the previous call's kernels only, and this call's are queued
    behind it. With a slot cache, checkpoints, out or in_rows (tensors the caller holds, written in place) the check
    comes before the state pass instead: kernel 1 alone runs on the device-built table, the other kernels on the
    host tables built from the checked values. 16-sequence varlen mix (32760 tokens, initial states, H200, eager us,
    three rounds in one process): host tables behind the read 934-1052, device tables 889-890, with cu_seqlens_cpu
    886-887; the device busy 878-882 in all three (outputs bit for bit; RESULTS.md, 2026-11-30).
    slot_rows (the serving prefill, fast.serving.gdn_prefill; int32 [N, 2]): initial_state is a slot cache's
    ssm_state [S, HV, K, V] (any strides), read from slot slot_rows[n, 1] and, with output_final_state, written in
    place at slot slot_rows[n, 0] (-1: start from zeros / write nothing); the final state returned is that ssm_state.
    Its values were checked on the device (distinct slots in range): the state pass reads each slot's block before
    any program writes it. update_x2 (bf16 inputs; fast.serving.gdn_prefill's): the state update in two bf16 terms
    (fast.chunk.state's UPDATE_X2: half the final state's error, 3-9 % more device time). final_v_first: the final
    state is allocated [N, HV, V, K] and returned as its [N, HV, K, V] view (fla's state_v_first: the state pass
    writes through its strides). beta_logits 1 / 2 (fla's use_beta_sigmoid_in_kernel, with allow_neg_eigval for 2;
    fast.serving.gdn_prefill's raw b): beta holds logits [B, T, HV]; each kernel that reads beta forms sigmoid(beta)
    (x 2) in fp32 after its load, by one formula (fast.chunk.common._beta_of): no torch launch, nothing stored.
    offsets_on_device (varlen; vLLM's chunk op, fast.vllm_ops.chunk_gated_delta_rule): cu_seqlens' values are never
    read on the host: every kernel runs on chunk tables built on the device (common._Chunks.unchecked with
    every_kernel: offsets clamped into [0, T], cdiv(T, BT) + N table rows, sequences longest first as the host
    tables' for N <= CHUNK_TABLE_BLOCK, in index order above), so the call reads nothing back and can be captured.
    Valid offsets give the host tables' bits; any values stay memory-safe (the caller checks them, or leaves them
    unchecked as vLLM does). N == 1 runs as the dense call over all T tokens. out: o is written into this contiguous
    [B, T, HV, V] tensor in v's dtype (vLLM's core_attn_out). checkpoints (FlashInfer's state checkpoints,
    fast.flashinfer_ops): (ck [R, HV, K, V] float32, starts [N] int, every: chunks between checkpoints), the state
    pass's CKPT (the state after every ``every`` whole chunks of sequence n to rows starts[n], starts[n] + 1, ...); the
    forward is then not pipelined. in_rows (FlashInfer's paged prefill, fast.flashinfer_ops; B = 1, from_a): (table
    int32 [N, 3], Tp): the kernels run on a row space of Tp rows (cu_seqlens its offsets; g and beta given in it)
    whose sequence n holds the caller's tokens at rows [lo, hi), row p the caller's row p - d, (lo, hi, d) =
    table[n] (common._in_rows_of); q, k, v are read and o is written at the caller's rows (o [1, T, HV, V]), every
    intermediate lives in the Tp rows. Not pipelined."""
    _check_fast_limits(q.shape[3], v.shape[3], chunk_size)
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if N == 1 and cu_seqlens is not None:
        # one sequence: the checked cu_seqlens is [0, T], so this is the dense B = 1 call (no chunk tables to build,
        # and a long sequence takes the pipelined forward; fast.keys lists the same kernels)
        cu_seqlens = None
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    A_log, dt_bias, cu_seqlens = _contig(A_log), _contig(dt_bias), _contig(cu_seqlens)
    dev = q.device
    Tc, rows_in = T, None                                                # the caller's rows (q, k, v, o)
    if in_rows is not None:
        if B != 1 or not from_a:
            raise ValueError("in_rows: one row of sequences (B = 1) on the from_a path only")
        rows_in, T = in_rows                                             # the kernels' rows: T = Tp
    behind = offsets_unchecked and cu_seqlens is not None and not offsets_on_device
    # the values checked after the launches (nothing the caller holds is written: no slot cache, checkpoints, out),
    # else between kernel 1 and the state pass (mid)
    late = behind and slot_rows is None and checkpoints is None and out is None and in_rows is None
    mid = behind and not late
    if behind:
        offsets = host_offsets_later(cu_seqlens)                          # the copy queued before kernel 1
    if late or (offsets_on_device and cu_seqlens is not None):
        ch = _Chunks.unchecked(T, BT, cu_seqlens, every_kernel=True)     # every kernel's tables on the device
    elif not mid:
        ch = _Chunks(B, T, BT, cu_seqlens)
    precise = _precise(v.dtype)
    l2 = bool(use_qk_l2norm_in_kernel)

    G = torch.empty(B, T, HV, dtype=torch.float32, device=dev)           # chunk-local cumsum of g
    Gl = torch.empty_like(G) if precise else None                        # its rounding error (fp32 inputs)
    A = torch.empty(B, T, HV, BT, dtype=k.dtype, device=dev)             # (I + L)^-1 per chunk
    kn = torch.empty(B, T, H, K, dtype=k.dtype, device=dev) if l2 else None
    slots = None
    if slot_rows is not None:                                            # the cache's ssm_state, in place
        h0, final = initial_state, (initial_state if output_final_state else None)
        slots = (slot_rows, True, output_final_state)
    else:
        final = None
        if output_final_state:
            final = (torch.empty(N, HV, V, K, dtype=torch.float32, device=dev).transpose(-1, -2) if final_v_first
                     else torch.empty(N, HV, K, V, dtype=torch.float32, device=dev))
        h0 = initial_state                                                # (read in place: any strides)
    o = torch.empty(B, Tc, HV, V, dtype=v.dtype, device=dev) if out is None else out
    fused = forward_fuses_output(N, T, BT, HV, K, V, dev) if fuse_output is None else fuse_output
    S = pipeline_segments(N, T, BT, dev, fused) if segments is None else segments
    if checkpoints is not None or rows_in is not None:
        S = 1                                     # (the checkpoints are the state pass's: one pass, not segments)
    if S > 1 and B == 1 and cu_seqlens is None and not fused and dev.type == "cuda":
        pipelined_forward(q, k, v, g, beta, scale, h0, final, A_log, dt_bias, G, Gl, A, kn, o, BT, S, l2=l2,
                          precise=precise, from_a=from_a, configs=configs, inv_method=inv_method, slot_rows=slot_rows,
                          update_x2=update_x2, beta_logits=beta_logits)
        return (o, final, (A, G, kn)) if keep_kkt else (o, final)
    _launch_kkt(k, g, beta, A_log, dt_bias, G, Gl, A, kn, _Chunks.unchecked(T, BT, cu_seqlens) if mid else ch,
                T, HV, BT, l2norm=l2, load_g=False, store_g=True, do_a=True, precise=precise, configs=configs,
                inv_method=inv_method, beta_logits=beta_logits, in_rows=rows_in)
    qs = None
    if fused and l2:                                                     # q's row scales for the fused pass
        qs = torch.empty(B, Tc, H, dtype=torch.float32, device=dev)
        _launch_row_scales(q, qs, configs=configs)
    if mid:
        offsets()                                                        # host: wait for the copy (kernel 1 runs)
        check_cu_seqlens_values(cu_seqlens, T)                           # raises before the state pass
        ch = _Chunks(B, T, BT, cu_seqlens)                               # from the values just read
    if l2:
        k = kn                                                           # kernels 2-4 read the normalised k

    if fused:
        h = v_new = None                                                 # never leave the pass
        out = (q, o, scale, qs)
    else:
        h = torch.empty(ch.total, HV, K, V, dtype=k.dtype, device=dev)   # chunk-start states
        v_new = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
        out = None
    if from_a:
        # kernel 2 does not run: the state pass forms v_new = u - w S from A, k, v and beta itself
        _launch_state(k, None, None, G, Gl, h0, h, v_new, final, ch, N, T, BT, precise=precise, configs=configs,
                      wy=(A, v, beta), out=out, slots=slots, update_x2=update_x2, beta_logits=beta_logits,
                      ckpt=checkpoints, in_rows=rows_in, k_in_rows=not l2)
    else:
        w = torch.empty(B, T, HV, K, dtype=k.dtype, device=dev)
        u = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
        _launch_w_u(k, v, beta, G, A, w, u, ch, T, BT, precise=precise, configs=configs, beta_logits=beta_logits)
        _launch_state(k, w, u, G, Gl, h0, h, v_new, final, ch, N, T, BT, precise=precise, configs=configs, out=out,
                      slots=slots, update_x2=update_x2, ckpt=checkpoints)
    if not fused:
        _launch_output(q, k, v_new, h, G, Gl, o, ch, T, BT, scale, l2norm_q=l2, precise=precise,
                       configs=configs, in_rows=rows_in, k_in_rows=not l2)
    if late:
        offsets()                                                        # host: wait for the copy (the kernels run)
        check_cu_seqlens_values(cu_seqlens, T)                           # raises before anything is returned
    if keep_kkt:
        return o, final, (A, G, kn)
    return o, final


@one_host_read   # cu_seqlens read to the host once per call (value check + varlen tables)
def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, *,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                               use_gate_in_kernel=None, chunk_indices=None, cp_context=None, head_first=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or None).

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    refgdn.recurrent_gated_delta_rule's twin: one Triton program per (V-block, sequence, value head)
    walks the tokens with the state in registers, all math in fp32. Same arguments as
    chunk_gated_delta_rule (no chunk_size; fla 0.6.0's keywords included: beta's logits go to the kernel). float64
    inputs run refgdn.
    """
    logits = kernel_beta_logits(use_beta_sigmoid_in_kernel, allow_neg_eigval, q, k, v, g, beta, initial_state, A_log,
                                dt_bias)
    beta, initial_state, A_log, dt_bias, vk = fla_keywords(
        q, v, beta, initial_state, A_log, dt_bias, cu_seqlens, False if logits else use_beta_sigmoid_in_kernel,
        False if logits else allow_neg_eigval, state_v_first, use_gate_in_kernel, chunk_indices, cp_context,
        head_first)
    N = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias)
    if _is_fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):
        o, final = refgdn.recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                     cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias)
        return o, final_state_v_first(final, vk)
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
        return o, final_state_v_first(final, vk)
    cfg = recurrent_config(K, V)
    BV = cfg.pop("BV")
    launch(recurrent_kernel, (cdiv(V, BV), N * HV),
           dict(HV=HV, GROUP=HV // H, K=K, V=V, BK=next_pow2(K), BV=BV,
                IS_VARLEN=cu_seqlens is not None, GATE=A_log is not None, L2NORM=use_qk_l2norm_in_kernel,
                USE_H0=h0 is not None, STORE_HT=final is not None,
                THRESHOLD=SOFTPLUS_THRESHOLD, EPS=L2NORM_EPS, PRECISE=_precise(v.dtype), BETA_LOGITS=logits, **cfg),
           q, k, v, g, beta, A_log, dt_bias, h0, o, final,
           cu_seqlens, T, scale,
           *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride())
    return o, final_state_v_first(final, vk)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] or None; initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or None).

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    refgdn.fused_recurrent_gated_delta_rule's twin: recurrent_gated_delta_rule (the same kernel) under fla 0.6.0's
    name and argument order, so calls written for fla's fused_recurrent_gated_delta_rule run unchanged, positional
    ones included. g None: no decay; beta None: ones; gk / gv refused (refgdn.checks.fla_recurrent_arguments).
    """
    args, kwargs = fla_recurrent_arguments(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                           use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens)
    return recurrent_gated_delta_rule(*args, **kwargs)
