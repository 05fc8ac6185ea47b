"""SGLang's fused GDN decode op, under its name and argument order.

``fused_sigmoid_gating_delta_rule_update`` (SGLang's ``sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent``;
AMD's aiter and TensorRT-LLM ship the same op): the gates, the l2norm and the delta rule over each sequence's tokens in
one op, the state read from a slot of a pool in SGLang's [S, HV, V, K] layout and written back in place. So SGLang's
import becomes ``from refgdn.sglang_ops import ...`` (the oracle) or ``from fast.sglang_ops import ...`` (Triton); both
functions have one signature.
"""
from __future__ import annotations

import torch

from .checks import check_sglang_decode_inputs, host_offsets, one_host_read, sglang_cache_rows, sglang_decode_slots
from .delta_rule import recurrent_gated_delta_rule as _recurrent
from .gating import softplus as _softplus

__all__ = ["fused_sigmoid_gating_delta_rule_update"]


@one_host_read
def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                                           is_kda: bool = False, disable_state_update: bool = False,
                                           intermediate_states_buffer=None, intermediate_state_indices=None,
                                           cache_steps=None, retrieve_parent_token=None, *, check_values: bool = False):
    """The gated delta rule from the raw gates, each sequence's state in a slot of the pool, updated in place.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV] or [B * T, HV] (the raw gate projections)
    A_log, dt_bias: [HV]   cu_seqlens: [N+1] with B == 1 (else N = B sequences of T tokens)
    initial_state_source: the pool [S, HV, V, K] (SGLang's layout: each head's state stored transposed)
    initial_state_indices: [N] int   ->   o: [B, T, HV, V] in v's dtype

        g_t = -exp(A_log) softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)
        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = pool[slot]^T)

    Sequence n starts from pool[initial_state_indices[n]] and its final state goes back there, unless
    disable_state_update; a negative index starts it from zeros and writes nothing (its outputs are still computed,
    as SGLang's kernel does). Target verify (SGLang's MTP): with intermediate_states_buffer [C, steps, HV, V, K] and
    disable_state_update=True, the state after the j-th token of sequence n goes to buffer[r, j] (transposed),
    r = intermediate_state_indices[n] (n when None; negative: none), and the pool is left as it is. Computed in
    float32 (float64 when any input or the pool is), each stored state rounded once to its destination's dtype. Only
    softplus_beta = 1.0 and softplus_threshold = 20.0 (what every Qwen3-Next caller passes); is_kda and tree drafts
    are refused by name. The values (offsets; slots and cache rows in range, none given to two sequences that write
    it; no sequence longer than the cache's steps) are checked here on every call (check_values is accepted for the
    signature of fast's twin, which reads them only when asked).
    """
    N, a, b, steps = check_sglang_decode_inputs(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                         initial_state_source, initial_state_indices, scale, use_qk_l2norm_in_kernel,
                                         cu_seqlens, is_kda, disable_state_update, intermediate_states_buffer,
                                         intermediate_state_indices, cache_steps, retrieve_parent_token)
    B, T = q.shape[:2]
    pool = initial_state_source
    if cu_seqlens is not None:
        offs = host_offsets(cu_seqlens)                 # (values checked above)
        spans = [(0, s, e) for s, e in zip(offs, offs[1:])]
    else:
        spans = [(n, 0, T) for n in range(B)]
    slots = sglang_decode_slots(initial_state_indices, pool.shape[0], not disable_state_update)
    buf = intermediate_states_buffer
    rows = ([-1] * N if buf is None else
            sglang_cache_rows(intermediate_state_indices, N, buf.shape[0], steps, [e - s for _, s, e in spans]))
    wide = torch.float64 if torch.float64 in (q.dtype, v.dtype, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype,
                                              pool.dtype) else torch.float32
    # the gates in the compute dtype (precision hazard: softplus' exp of a large argument: refgdn's softplus)
    g = -torch.exp(A_log.to(wide)) * _softplus(a.to(wide) + dt_bias.to(wide))     # [B, T, HV]
    beta = torch.sigmoid(b.to(wide))
    o = torch.zeros(v.shape, dtype=v.dtype, device=q.device)
    updates = []                    # (slot, state) written after every sequence has read (the kernel's order)
    for (row, bos, eos), slot, cache in zip(spans, slots, rows):
        HV, V, K = pool.shape[1:]
        s0 = (pool[slot].transpose(-1, -2)[None].to(wide) if slot >= 0                 # [1, HV, K, V]
              else torch.zeros(1, HV, K, V, dtype=wide, device=q.device))
        if eos == bos:                                  # an empty sequence: its slot keeps its state
            continue
        for t in range(bos, eos) if cache >= 0 else ():     # verify: the state after each token, to its cache row
            step = [x[row:row + 1, bos:t + 1].to(wide) for x in (q, k, v, g, beta)]
            _, s_t = _recurrent(*step, scale=scale, initial_state=s0, output_final_state=True,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            buf[cache, t - bos] = s_t[0].transpose(-1, -2).to(buf.dtype)               # [HV, V, K]
        seq = [x[row:row + 1, bos:eos].to(wide) for x in (q, k, v, g, beta)]
        o_n, s1 = _recurrent(*seq, scale=scale, initial_state=s0, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        o[row, bos:eos] = o_n[0].to(v.dtype)
        if slot >= 0 and not disable_state_update:
            updates.append((slot, s1[0].transpose(-1, -2)))                           # back to [HV, V, K]
    for slot, state in updates:
        pool[slot] = state.to(pool.dtype)
    return o
