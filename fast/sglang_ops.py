"""SGLang's fused GDN decode op in Triton: refgdn.sglang_ops's twin (semantics and arguments there).

``fused_sigmoid_gating_delta_rule_update``: vLLM's serving recurrent kernel (fast.chunk.recurrent.recurrent_slots_kernel)
with the gates formed in it, the pool read in SGLang's [S, HV, V, K] layout through its strides.
"""
from __future__ import annotations

import torch

import refgdn.sglang_ops as _ref
from refgdn.checks import (check_sglang_decode_inputs, host_offsets, one_host_read, sglang_cache_rows,
                           sglang_decode_slots)

from .chunk.common import _check_fast_limits, _is_fp64, _unit_last
from .chunk.recurrent import WRITE_EACH_SLOT, WRITE_FINAL, WRITE_NONE, launch_slots
from .launch import LayoutPlans, scalar_key
from .vllm_ops import _SlotsOpPlan

__all__ = ["fused_sigmoid_gating_delta_rule_update"]


@one_host_read
def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                                           is_kda: bool = False, disable_state_update: bool = False,
                                           intermediate_states_buffer=None, intermediate_state_indices=None,
                                           cache_steps=None, retrieve_parent_token=None, *, check_values: bool = False):
    """SGLang's decode op (refgdn.sglang_ops.fused_sigmoid_gating_delta_rule_update's twin, same semantics): one launch.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV] or [B * T, HV]   A_log, dt_bias: [HV]   cu_seqlens: [N+1]
    initial_state_source: [S, HV, V, K] (any strides)   initial_state_indices: [N] int   ->   o: [B, T, HV, V]

        g_t = -exp(A_log) softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)
        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = pool[slot]^T)

    Shapes, dtypes and devices are checked on the host; the offsets and slots only with check_values=True (a host
    read), so by default the call can be captured in a CUDA graph. Unchecked values stay memory-safe: offsets clamped
    to [0, T], a slot at or past S treated as a negative one (zeros in, nothing written); two sequences on one slot
    race, as in SGLang. float64 runs refgdn (the kernel computes in float32).
    """
    # the key: the non-tensor arguments the checks read (a verify's cache_steps among them; tree drafts never served)
    verify = intermediate_states_buffer is not None
    key = None if check_values or retrieve_parent_token is not None else scalar_key(
        "sglang-verify" if verify else "sglang", softplus_beta, softplus_threshold, use_qk_l2norm_in_kernel, is_kda,
        disable_state_update, type(scale), cache_steps)
    if verify:
        tensors = (q, k, v, a, b, initial_state_source, cu_seqlens, initial_state_indices, intermediate_states_buffer,
                   intermediate_state_indices, A_log, dt_bias)
        p = _VERIFY.get(key, tensors)
        if p is not None:                 # a verify layout whose call passed the checks before: the launch alone
            return p.serve(q, k, v, a, b, initial_state_source, cu_seqlens, initial_state_indices, None, A_log,
                           dt_bias, scale, intermediate_states_buffer, intermediate_state_indices)[0]
    else:
        tensors = (q, k, v, a, b, initial_state_source, cu_seqlens, initial_state_indices, None, A_log, dt_bias)
        p = _DECODE.get(key, tensors)
        if p is not None:                 # a layout whose call passed the checks before: the launch alone
            return p.serve(q, k, v, a, b, initial_state_source, cu_seqlens, initial_state_indices, None, A_log,
                           dt_bias, scale)[0]
    N, a3, b3, steps = check_sglang_decode_inputs(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale, use_qk_l2norm_in_kernel,
                                           cu_seqlens, is_kda, disable_state_update, intermediate_states_buffer,
                                           intermediate_state_indices, cache_steps, retrieve_parent_token,
                                           offset_values=check_values)
    if _is_fp64(q, k, v, a, b, A_log, dt_bias, initial_state_source):
        return _ref.fused_sigmoid_gating_delta_rule_update(
            A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
            initial_state_indices, scale, use_qk_l2norm_in_kernel, cu_seqlens, is_kda, disable_state_update,
            intermediate_states_buffer, intermediate_state_indices, cache_steps)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_fast_limits(K, V)
    pool = initial_state_source.transpose(-1, -2)                 # [S, HV, K, V]: the same memory
    buf = intermediate_states_buffer
    if check_values:                                              # (the offsets' values: checked above)
        sglang_decode_slots(initial_state_indices, pool.shape[0], not disable_state_update)
        if buf is not None:
            offs = host_offsets(cu_seqlens) if cu_seqlens is not None else [n * T for n in range(B + 1)]
            sglang_cache_rows(intermediate_state_indices, N, buf.shape[0], steps,
                              [e - s for s, e in zip(offs, offs[1:])])
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    q2, k2, v2 = _unit_last(q), _unit_last(k), _unit_last(v)
    if buf is None:
        write, hs, table = (WRITE_NONE if disable_state_update else WRITE_FINAL), pool, None
    else:
        # verify: the state after token j of sequence n goes to row rows[n] * steps + j of the buffer seen as [C steps,
        # HV, K, V] (a view: its first two dims merge, checked; rows None: row n), formed by the kernel (WIDX)
        hs, table = buf.flatten(0, 1).transpose(-1, -2), intermediate_state_indices
        write = WRITE_EACH_SLOT
    pos = (q2, k2, v2, a3, b3, pool, o, hs)
    kw = dict(H=H, L=max(steps, 1), write=write, l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
              idx=initial_state_indices, A_log=A_log, dt_bias=dt_bias, widx=table, cache=buf is not None, gate=True,
              pad_zero=False)
    launch_slots(*pos, scale=K ** -0.5 if scale is None else float(scale), **kw)
    if key is not None and q2 is q and k2 is k and v2 is v:
        # by call layout: the decode's state is the pool, written in place (or not at all); the verify's the buffer's
        # steps, its cache rows formed by the kernel
        (_VERIFY if verify else _DECODE).remember(key, tensors, lambda: _SlotsOpPlan(pos, kw, o, hs, True, K, tensors))
    return o


# Eager decodes and target verifies by call layout (fast.launch.LayoutPlans, as fast.vllm_ops' _SLOTS): SGLang calls
# the op once per GDN layer and step outside its CUDA graphs.
_DECODE = LayoutPlans()
_VERIFY = LayoutPlans()
