"""FlashInfer's GDN ops in Triton: refgdn.flashinfer_ops's twins (semantics and arguments there).

``chunk_gated_delta_rule``: fast's chunked forward (fast.chunk) on FlashInfer's packed tokens, the decay taken as its
log, the states [N, H, V, K] read and written through their [.., K, V] views, the chunk tables built on the device (no
host read: the call can be captured). ``gated_delta_rule_decode_pretranspose`` / ``gated_delta_rule_decode`` /
``gated_delta_rule_mtp``: vLLM's serving recurrent kernel (fast.chunk.recurrent.recurrent_slots_kernel) with the gates
formed in it, the states read and written through their strides, one launch. ``chunk_gated_delta_rule_paged`` /
``gated_delta_rule_decode_paged`` (FlashInfer's paged state cache): the chunked forward on chunk-aligned rows (the
caller's q, k, v and o addressed in place, fast.paged), every page boundary stored by the state pass, and the decode
kernel on the page table's rows. Where FlashInfer needs sm_90 or newer, these run on any GPU Triton supports.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

import refgdn.flashinfer_ops as _ref
from refgdn.checks import (check_cu_seqlens_values, check_flashinfer_decode_inputs, check_flashinfer_outputs_disjoint,
                           check_flashinfer_prefill_inputs, flashinfer_checkpoint_rows, flashinfer_decode_slots,
                           one_host_read_scope)
from refgdn.checks import check_flashinfer_paged_decode_inputs, flashinfer_paged_rows
from refgdn.flashinfer_ops import (GDNPagedDecodeSlots, GDNPagedPrefillSlots, _same_slots, _tokens,  # noqa: F401
                                   check_paged_prefill, gdn_paged_decode_slots, gdn_paged_prefill_slots, gqa_to_gva,
                                   mtp_update_flag, paged_disjoint, prefill_scale)

from .chunk import chunk_gated_delta_rule_fwd as _chunk_fwd
from .chunk.common import _check_fast_limits, _is_fp64, _unit_last
from .chunk.recurrent import (WRITE_EACH_SLOT, WRITE_EACH_SLOT_AND_FINAL, WRITE_FINAL, WRITE_NONE, launch_slots)
from .launch import LayoutPlans, SignaturePlans, scalar_key, shape_key
from .paged import launch_paged_gates, launch_paged_rows
from .paged import modes as paged_modes
from .serving import prefill_update_x2
from .vllm_ops import _SlotsOpPlan

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode_pretranspose", "gated_delta_rule_decode",
           "gated_delta_rule_mtp", "chunk_gated_delta_rule_paged", "gated_delta_rule_decode_paged",
           "gdn_paged_prefill_slots", "gdn_paged_decode_slots", "GDNPagedPrefillSlots", "GDNPagedDecodeSlots"]

# the decay's log for an alpha of 0 (or below float32's smallest positive value): exp(-104) is 0 in float32, and a
# finite floor keeps the chunk's cumulative sums finite (-inf - -inf would be NaN). Within a chunk the sums then reach
# at most 64 * 104 in magnitude, where float32 keeps the other tokens' decays to ~1e-6 relative.
LOG_DECAY_FLOOR = -104.0


def prefill_core_inputs(q, k, v, g, beta, initial_state) -> tuple:
    """The chunked forward's inputs for FlashInfer's prefill arguments: (q, k, v [1, T, ., .], the decay's log and
    beta [1, T, sab] float32, the initial state's [N, sab, K, V] view or None). GQA's k, v repeated per q head."""
    T, sab = q.shape[0], max(q.shape[1], v.shape[1])
    q, k, v = gqa_to_gva(q, k, v)
    dev = q.device
    # the decay's log (float32; precision hazard: log(0) = -inf, floored: LOG_DECAY_FLOOR)
    log_g = (torch.zeros(1, dtype=torch.float32, device=dev).expand(T, sab) if g is None
             else torch.log(g.float()).clamp_min_(LOG_DECAY_FLOOR))
    beta = torch.ones(1, dtype=torch.float32, device=dev).expand(T, sab) if beta is None else beta
    h0 = initial_state.transpose(-1, -2) if initial_state is not None else None
    return q[None], k[None], v[None], log_g[None], beta[None], h0


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
                           state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0,
                           use_cp=False, *, check_values: bool = False):
    """FlashInfer's GDN prefill (refgdn.flashinfer_ops.chunk_gated_delta_rule's twin, same semantics) on fast's chunked
    forward.

    q: [T, Hq, K]   k: [T, Hk, K]   v: [T, Hv, V]   g (alpha), beta: [T, sab] or None   cu_seqlens: [N+1] int
    initial_state, output_state: [N, sab, V, K]   ->   output [T, sab, V] (or (output, final state))

        S <- alpha_t S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = state[n]^T)

    Shapes and dtypes are checked on the host; cu_seqlens' values only with check_values=True (a host read). By
    default nothing is read back (the offsets clamped into [0, T] on the device: memory-safe whatever their values).
    GQA inputs run as GVA with k and v repeated per q head (copies). alpha = 0 is taken as exp(LOG_DECAY_FLOOR), 0 in
    float32. State checkpoints are stored by the state pass (its CKPT; the forward not pipelined); their rows'
    values too are checked only with check_values (unchecked: a row outside state_checkpoints is not stored). float64
    and gradients run refgdn.
    """
    # a signature whose call passed the checks before skips them and launches through its plan (fast.launch: the
    # compiled launchers reused); T and N left out, so a serving stream's prefills share one
    sig = _prefill_signature(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                             use_qk_l2norm_in_kernel, output, output_state, state_checkpoints, checkpoint_cu_starts,
                             checkpoint_every_n_tokens, use_cp)
    plan = _PREFILL.get(sig)
    if plan is None:
        check_flashinfer_prefill_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                        use_qk_l2norm_in_kernel, output, output_state, state_checkpoints,
                                        checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp, offset_values=False)
    from . import library
    if _is_fp64(q, g, beta, initial_state, output_state) or library.wants_graph(q, k, v, g, beta, initial_state):
        return _ref.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                           use_qk_l2norm_in_kernel, output, output_state, state_checkpoints,
                                           checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp)
    check_flashinfer_outputs_disjoint(output, output_state, (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                                             ("initial_state", initial_state),
                                                             ("cu_seqlens", cu_seqlens),
                                                             ("checkpoint_cu_starts", checkpoint_cu_starts)),
                                      state_checkpoints)
    T, _, K = q.shape
    if plan is None:
        _check_fast_limits(K, v.shape[2], 64)
        plan = _PREFILL.after_checks(sig)               # (None on a signature's first call: launched as it is)
    every = checkpoint_every_n_tokens
    if check_values:
        with one_host_read_scope():
            check_cu_seqlens_values(cu_seqlens, T)
            if every:
                flashinfer_checkpoint_rows(cu_seqlens, checkpoint_cu_starts, every, state_checkpoints.shape[0])
    out = output[None] if output is not None and output.is_contiguous() else None
    q4, k4, v4, g4, beta4, h0 = prefill_core_inputs(q, k, v, g, beta, initial_state)
    with plan if plan is not None else contextlib.nullcontext():
        o, final = _chunk_fwd(q4, k4, v4, g4, beta4, prefill_scale(scale, K), h0,
                              output_final_state or output_state is not None, cu_seqlens, use_qk_l2norm_in_kernel,
                              chunk_size=64, final_v_first=True, offsets_on_device=True, out=out,
                              checkpoints=(state_checkpoints.transpose(-1, -2), checkpoint_cu_starts, every // 64)
                              if every else None)
    o = output if out is not None else output.copy_(o[0]) if output is not None else o[0]
    if final is not None:
        final = final.transpose(-1, -2)                                  # the [N, sab, V, K] tensor written
    if output_state is not None:        # the rows of non-empty sequences, chosen on the device (no host read)
        cu = cu_seqlens.clamp(0, T)
        nonempty = (cu[1:] > cu[:-1])[:, None, None, None]
        final = output_state.copy_(torch.where(nonempty, final, output_state))
    return (o, final) if output_final_state else o


def _prefill_signature(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2, output,
                       output_state, state_checkpoints, checkpoint_cu_starts, every, use_cp):
    """What check_flashinfer_prefill_inputs reads, the token count T and the sequence count N left out (each tensor's
    type, shape less its T or N dim, dtype and device; whether that dim is T or N; the flags and checkpoint interval
    with their types; type(scale)), or None (checked in full, no plan kept). Two calls with equal signatures pass or
    fail the checks alike, up to cu_seqlens' and checkpoint_cu_starts' values (the caller's, as without a plan)."""
    if any(type(f) is not bool for f in (output_final_state, l2, use_cp)) or type(every) is not int:
        return None
    try:
        T, N = q.shape[0], cu_seqlens.shape[0] - 1
        rows = lambda t, n: None if t is None else (shape_key(t, 0), t.shape[0] == n)  # noqa: E731
        return (shape_key(q, 0), rows(k, T), rows(v, T), rows(g, T), rows(beta, T), rows(output, T), type(scale),
                output_final_state, l2, use_cp, every, shape_key(cu_seqlens, 0), N >= 1, rows(initial_state, N),
                rows(output_state, N), rows(state_checkpoints, -1), rows(checkpoint_cu_starts, N + 1))
    except Exception:  # noqa: BLE001 - not a tensor, or too few dims: the full checks name the problem
        return None


_PREFILL = SignaturePlans(64, seen_size=256)


def decode_launch_args(q, k, v, states, A_log, a, b, dt_bias, use_qk_l2norm, initial_state_indices,
                       output_state_indices, buf, disable_state_update, vk: bool, o, ssm_state_indices=None) -> tuple:
    """launch_slots' arguments (but scale) for a decode entry point's call, from shapes, strides and dtypes only
    (fast.keys passes meta tensors): (positional, keywords). states: the per-batch state or the pool, as given."""
    H, T = q.shape[2], q.shape[1]
    pool = states.transpose(-1, -2) if vk else states                                             # [P, HV, K, V]
    if ssm_state_indices is not None:    # each token's state to its own pool row (the kernel's WIDX 3), no final
        pos = (_unit_last(q), _unit_last(k), _unit_last(v), a, b, pool, o, pool)
        return pos, dict(H=H, L=T, write=WRITE_EACH_SLOT, l2norm=use_qk_l2norm, idx=initial_state_indices,
                         A_log=A_log, dt_bias=dt_bias, gate=True, pad_zero=True, token_slots=ssm_state_indices)
    if buf is None:
        write, hs = (WRITE_NONE if disable_state_update else WRITE_FINAL), pool
    else:
        # the state after token j of batch row n goes to row n * T' + j of the buffer seen as [C T', HV, K, V] (a
        # view: its first two dims merge, checked), formed by the kernel (WIDX 2); the final one to the pool as well
        # unless disable_state_update
        hs = buf.flatten(0, 1).transpose(-1, -2)
        write = WRITE_EACH_SLOT if disable_state_update else WRITE_EACH_SLOT_AND_FINAL
    final_idx = _widx(None, output_state_indices, disable_state_update)                            # None: read slot
    pos = (_unit_last(q), _unit_last(k), _unit_last(v), a, b, pool, o, hs)
    kw = dict(H=H, L=buf.shape[1] if buf is not None else 1, write=write, l2norm=use_qk_l2norm,
              idx=initial_state_indices, A_log=A_log, dt_bias=dt_bias, cache=buf is not None, gate=True,
              pad_zero=True, final_idx=final_idx)
    return pos, kw


# Eager decode / MTP calls by call layout (fast.launch.LayoutPlans, as fast.sglang_ops'): from a layout's second call
# on, the checks are skipped and the compiled launcher reused. The key: the entry point's non-tensor arguments; the
# guard compares every tensor's metadata. Calls with check_values or an output buffer are never served.
_DECODE = LayoutPlans()


def _decode_key(name: str, q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                initial_state_indices, output_state_indices, buf, disable_state_update, check_values,
                ssm_state_indices=None) -> tuple:
    """(key, tensors) of a decode entry point's call for _DECODE (key None: never served)."""
    tensors = (q, k, v, a, b, initial_state if initial_state is not None else state, initial_state_indices,
               output_state_indices, buf, A_log, dt_bias, ssm_state_indices)
    key = None if check_values is not False or output is not None else scalar_key(
        name, use_qk_l2norm, disable_state_update, type(scale), initial_state is None)
    return key, tensors


def _serve(p, tensors: tuple, scale, disable_state_update: bool, vk: bool) -> tuple:
    """A decode call of a known layout (p: its _SlotsOpPlan): the launch alone. -> (output, the states)."""
    q, k, v, a, b, states, idx, out_idx, buf, A_log, dt_bias, tokens = tensors
    pool = states.transpose(-1, -2) if vk else states
    cache = None if buf is None else buf.flatten(0, 1).transpose(-1, -2)
    o, _ = p.serve(q, k, v, a, b, pool, None, idx, None, A_log, dt_bias, scale, cache,
                   _widx(tokens, out_idx, disable_state_update))
    return o, states


def _widx(ssm_state_indices, output_state_indices, disable_state_update: bool):
    """The rows recurrent_slots_kernel's widx holds for a decode call: the per-token pool rows (WIDX 3), else the final
    state's rows (FINAL_IDX) unless nothing is written back; None: no widx (the final state to its read slot)."""
    if ssm_state_indices is not None:
        return ssm_state_indices
    return None if disable_state_update else output_state_indices


def _decode_launch(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                   initial_state_indices, output_state_indices, buf, disable_state_update, vk: bool,
                   check_values: bool, key=None, tensors=None, ssm_state_indices=None):
    """The decode entry points after their checks: one launch of recurrent_slots_kernel. -> (output, the states).
    key, tensors: the call's _DECODE entry (None: not kept), remembered when the launch reads the call's tensors as
    they are."""
    if _is_fp64(q, a, b, A_log, dt_bias, state, initial_state, buf):
        return _ref._decode_call(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                                 initial_state_indices, output_state_indices, buf, disable_state_update, vk,
                                 ssm_state_indices)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_fast_limits(K, V)
    states = initial_state if initial_state is not None else state
    if check_values and initial_state is not None:                  # the slots' value rules: a host read
        flashinfer_decode_slots(initial_state_indices, output_state_indices, states.shape[0], not disable_state_update,
                                ssm_state_indices)
    o = output if (output is not None and output.dtype == q.dtype and output.is_contiguous()) else \
        torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    pos, kw = decode_launch_args(q, k, v, states, A_log, a, b, dt_bias, use_qk_l2norm, initial_state_indices,
                                 output_state_indices, buf, disable_state_update, vk, o, ssm_state_indices)
    launch_slots(*pos, scale=K ** -0.5 if scale is None else float(scale), **kw)
    if key is not None and pos[0] is q and pos[1] is k and pos[2] is v:
        _DECODE.remember(key, tensors, lambda: _SlotsOpPlan(pos, kw, o, pos[7], True, K, tensors))
    if output is not None and o is not output:
        o = output.copy_(o)
    return o, states


def gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None,
                                         use_qk_l2norm=True, initial_state=None, initial_state_indices=None,
                                         output_state_indices=None, *, intermediate_states_buffer=None,
                                         disable_state_update=False, check_values: bool = False):
    """FlashInfer's V-major decode (refgdn.flashinfer_ops' twin, same semantics): one launch.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV]   A_log, dt_bias: [HV]
    state: [B, HV, V, K], or initial_state [P, HV, V, K] with initial_state_indices [B] (output_state_indices [B])
    -> (output [B, T, HV, V], the state or pool)

        g_t = -exp(A_log) softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)
        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = slot^T)

    Shapes, dtypes and devices are checked on the host; the slots' values only with check_values=True (a host read),
    so by default the call can be captured. Unchecked values stay memory-safe: a slot at or past P is a padded row (a
    write index there is skipped); a row written where another row reads (which the checks refuse) gives unspecified
    values. float64 runs refgdn (the kernel computes in float32).
    """
    key, tensors = _decode_key("pretranspose", q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm,
                               initial_state, initial_state_indices, output_state_indices, intermediate_states_buffer,
                               disable_state_update, check_values)
    p = _DECODE.get(key, tensors)
    if p is not None:                     # a layout whose call passed the checks before: the launch alone
        return _serve(p, tensors, scale, disable_state_update, True)
    check_flashinfer_decode_inputs(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                                   initial_state_indices, output_state_indices, intermediate_states_buffer,
                                   disable_state_update)
    return _decode_launch(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                          initial_state_indices, output_state_indices, intermediate_states_buffer,
                          disable_state_update, True, check_values, key, tensors)


def gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True, *,
                            check_values: bool = False):
    """FlashInfer's K-major decode (refgdn.flashinfer_ops' twin): one token per row, state [B, HV, K, V] in place.

    q, k: [B, 1, H, K]   v: [B, 1, HV, V]   a, b: [B, 1, HV]   A_log, dt_bias: [HV]   -> (output [B, 1, HV, V], state)
    """
    key, tensors = _decode_key("kmajor", q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, None,
                               None, None, None, False, check_values)
    p = _DECODE.get(key, tensors)
    if p is not None:
        return _serve(p, tensors, scale, False, False)
    check_flashinfer_decode_inputs(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, None, None,
                                   None, None, False, state_layout="kv")
    if q.shape[1] != 1:
        raise ValueError(f"gated_delta_rule_decode takes one token per batch row (q [B, 1, H, K]), got T={q.shape[1]}")
    return _decode_launch(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, None, None, None, None,
                          False, False, check_values, key, tensors)


def gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None,
                         output=None, intermediate_states_buffer=None, ssm_state_indices=None,
                         disable_state_update=None, use_qk_l2norm=True, output_state_indices=None, *,
                         check_values: bool = False):
    """FlashInfer's MTP verify step on a pool (refgdn.flashinfer_ops' twin): one launch.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV]   initial_state: [P, HV, V, K]
    initial_state_indices, output_state_indices: [B]   intermediate_states_buffer: [C >= B, T' >= T, HV, V, K]
    -> (output [B, T, HV, V], initial_state)
    """
    frozen = mtp_update_flag(disable_state_update)
    key, tensors = _decode_key("mtp", q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm,
                               initial_state, initial_state_indices, output_state_indices, intermediate_states_buffer,
                               frozen, check_values, ssm_state_indices)
    p = _DECODE.get(key, tensors)
    if p is not None:
        return _serve(p, tensors, scale, frozen, True)
    check_flashinfer_decode_inputs(q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                                   initial_state_indices, output_state_indices,
                                   intermediate_states_buffer, frozen and _tokens(q) > 1, ssm_state_indices)
    return _decode_launch(q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                          initial_state_indices, output_state_indices, intermediate_states_buffer, frozen, True,
                          check_values, key, tensors, ssm_state_indices)


# ----------------------------------------------------------------------------------------------
# flashinfer.gdn_paged (refgdn.flashinfer_ops for the semantics; the slots functions are refgdn's: device ops)
# ----------------------------------------------------------------------------------------------

def chunk_gated_delta_rule_paged(q, k, v, g=None, beta=None, scale=None, *, cu_seqlens, state_pool, page_indices,
                                 page_indptr, page_size, last_page_len, use_qk_l2norm_in_kernel=False, output=None,
                                 gate_domain="linear", use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                 beta_is_logit=False, slots=None, check_values: bool = False):
    """FlashInfer's prefill on a paged state cache (refgdn.flashinfer_ops.chunk_gated_delta_rule_paged's twin).

    q: [T, Hq, K]   k: [T, Hk, K]   v: [T, Hv, V]   g, beta: [T, sab]   cu_seqlens: [N+1] int
    state_pool: [P, sab, V, K]   page_indices: [total_pages] int   page_indptr: [N+1] int   last_page_len: [N] int
    -> output [T, sab, V]

        S <- exp(log g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = page^T)

    How (fast.paged): the pool rows from the page table on the device (paged_rows_kernel: gdn_paged_prefill_slots'
    rows, or the slots given); the chunked forward on a chunk-aligned row space (each sequence's prefix mod 64 zero
    rows in front, whose beta = 0 and decay 1 leave the state as it is, so chunks and page boundaries line up): the
    gates formed into it (paged_gates_kernel), q, k, v read and o written at the caller's rows (the kernels'
    IN_ROWS: no token copied); from the page holding the last prefix token (the state pass's H0_SLOTS), every
    crossed page boundary stored by the state pass (CKPT + CK_PAGED), the final state to the last page (HT_SLOTS).
    Nothing is read back unless check_values=True (cu_seqlens and the page table's values checked: refgdn's rules);
    unchecked values stay memory-safe (rows outside the pool are not written). The gates are formed in float32
    (alpha = 0: the decay's log floored at LOG_DECAY_FLOOR). float64 runs refgdn.
    """
    sig = _paged_signature(q, k, v, g, beta, scale, cu_seqlens, state_pool, page_indices, page_indptr, page_size,
                           last_page_len, use_qk_l2norm_in_kernel, output, gate_domain, use_gate_in_kernel, A_log,
                           dt_bias, beta_is_logit, slots)
    plan = _PAGED.get(sig)
    if plan is None:                      # (a signature that passed the checks before skips them: _PREFILL's way)
        check_paged_prefill(q, k, v, g, beta, scale, cu_seqlens, state_pool, page_indices, page_indptr, page_size,
                            last_page_len, use_qk_l2norm_in_kernel, output, gate_domain, use_gate_in_kernel, A_log,
                            dt_bias, beta_is_logit, slots, offset_values=False)
    N, P = cu_seqlens.shape[0] - 1, state_pool.shape[0]
    paged_disjoint(output, state_pool, (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                                        ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens),
                                        ("page_indices", page_indices), ("page_indptr", page_indptr),
                                        ("last_page_len", last_page_len)))
    from . import library
    if _is_fp64(q, g, beta, A_log, dt_bias, state_pool) or library.wants_graph(q, k, v, g, beta, A_log, dt_bias):
        return _ref.chunk_gated_delta_rule_paged(
            q, k, v, g, beta, scale, cu_seqlens=cu_seqlens, state_pool=state_pool, page_indices=page_indices,
            page_indptr=page_indptr, page_size=page_size, last_page_len=last_page_len,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output=output, gate_domain=gate_domain,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, beta_is_logit=beta_is_logit,
            slots=slots)
    T, _, K = q.shape
    if plan is None:
        _check_fast_limits(K, v.shape[2], 64)
        plan = _PAGED.after_checks(sig)                 # (None on a signature's first call: launched as it is)
    if check_values:
        with one_host_read_scope():
            check_cu_seqlens_values(cu_seqlens, T)
            cu = cu_seqlens.tolist()
            flashinfer_paged_rows(page_indices, page_indptr, last_page_len, page_size, P,
                                  [cu[n + 1] - cu[n] for n in range(N)])
            if slots is not None:
                _same_slots(slots, gdn_paged_prefill_slots(cu_seqlens, page_indices, page_indptr, page_size,
                                                           last_page_len), "chunk_gated_delta_rule_paged")
    q, k, v = gqa_to_gva(q, k, v)
    pool = state_pool.transpose(-1, -2)                                                # [P, sab, K, V] view
    with plan if plan is not None else contextlib.nullcontext():
        # the slots, the aligned layout's offsets and rows, the state pass's rows in one launch; the gates formed
        # into the aligned layout (the decay's log and beta, float32) in one more
        _, cu_p, in_rows, slot_rows, table = launch_paged_rows(cu_seqlens, page_indices, page_indptr, last_page_len,
                                                               page_size, T, P, slots)
        sab = max(q.shape[1], v.shape[1])
        log_g, beta = launch_paged_gates(g, beta, A_log, dt_bias, cu_p, in_rows, T, sab,
                                         *paged_modes(g, beta, gate_domain, use_gate_in_kernel, beta_is_logit),
                                         LOG_DECAY_FLOOR)
        out = output[None] if output is not None and output.is_contiguous() else None
        # the pages outlive the call, as gdn_prefill's cache: bf16's state update in two terms (fast.serving's rule)
        o, _ = _chunk_fwd(q[None], k[None], v[None], log_g[None], beta[None], prefill_scale(scale, K), pool, True,
                          cu_p, use_qk_l2norm_in_kernel, chunk_size=64, offsets_on_device=True, slot_rows=slot_rows,
                          update_x2=prefill_update_x2(k.dtype), out=out,
                          checkpoints=(pool, table, page_size // 64, page_indices), in_rows=(in_rows, log_g.shape[0]))
    return output if out is not None else output.copy_(o[0]) if output is not None else o[0]


def _paged_signature(q, k, v, g, beta, scale, cu_seqlens, state_pool, page_indices, page_indptr, page_size,
                     last_page_len, l2, output, gate_domain, use_gate_in_kernel, A_log, dt_bias, beta_is_logit,
                     slots) -> Optional[tuple]:
    """What check_paged_prefill reads, the token count T, the sequence count N and the page table's length left out
    (as _prefill_signature), or None (checked in full, no plan kept)."""
    if any(type(f) is not bool for f in (l2, use_gate_in_kernel, beta_is_logit)) or type(page_size) is not int \
            or gate_domain not in ("linear", "log"):
        return None
    try:
        T, N = q.shape[0], cu_seqlens.shape[0] - 1
        rows = lambda t, n: None if t is None else (shape_key(t, 0), t.shape[0] == n)  # noqa: E731
        return (shape_key(q, 0), rows(k, T), rows(v, T), rows(g, T), rows(beta, T), rows(output, T), type(scale),
                l2, gate_domain, use_gate_in_kernel, beta_is_logit, page_size, shape_key(cu_seqlens, 0), N >= 1,
                shape_key(state_pool), shape_key(page_indices, 0), rows(page_indptr, N + 1),
                rows(last_page_len, N), shape_key(A_log), shape_key(dt_bias),
                None if slots is None else (type(slots),) + tuple(rows(t, N) for t in slots))
    except Exception:  # noqa: BLE001 - not a tensor, or too few dims: the full checks name the problem
        return None


_PAGED = SignaturePlans(64, seen_size=256)


def gated_delta_rule_decode_paged(q, k, v, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True, *,
                                  state_pool, page_indices, page_indptr, last_page_len, backend="auto", slots=None,
                                  check_values: bool = False):
    """FlashInfer's decode on a paged state cache (refgdn.flashinfer_ops.gated_delta_rule_decode_paged's twin): the
    page table's rows formed on the device (gdn_paged_decode_slots, or the slots given), then
    gated_delta_rule_decode_pretranspose's kernel on the pool with them (read: the last page or the one before;
    write: the last page). -> output [B, 1, HV, V]. Values checked only with check_values=True (a host read)."""
    check_flashinfer_paged_decode_inputs(q, k, v, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, state_pool,
                                         page_indices, page_indptr, last_page_len, backend, slots)
    paged_disjoint(output, state_pool, (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log),
                                        ("dt_bias", dt_bias), ("page_indices", page_indices),
                                        ("page_indptr", page_indptr), ("last_page_len", last_page_len)))
    if check_values:
        with one_host_read_scope():
            flashinfer_paged_rows(page_indices, page_indptr, last_page_len, None, state_pool.shape[0])
            if slots is not None:
                _same_slots(slots, gdn_paged_decode_slots(page_indices, page_indptr, last_page_len),
                            "gated_delta_rule_decode_paged")
    if slots is None:
        slots = gdn_paged_decode_slots(page_indices, page_indptr, last_page_len)
    o, _ = _decode_launch(q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, state_pool,
                          slots.initial_state_indices, slots.output_state_indices, None, False, True, False)
    return o
