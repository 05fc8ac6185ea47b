"""FlashInfer's GDN ops, under their names and argument orders.

``chunk_gated_delta_rule`` (``flashinfer.gdn_prefill``): a prefill over packed tokens (``cu_seqlens`` required), the
forget gate given as the decay itself (alpha = exp(g)), states [N, H, V, K] float32, GQA or GVA heads.
``gated_delta_rule_decode_pretranspose``, ``gated_delta_rule_decode`` and ``gated_delta_rule_mtp``
(``flashinfer.gdn_decode``): decode and MTP verify with the gates formed from the raw projections, the states a
per-batch tensor or a pool of slots, written in place. So FlashInfer's imports of these names become
``from refgdn.flashinfer_ops import ...`` (the oracle, any device) or ``from fast.flashinfer_ops import ...`` (Triton:
any GPU Triton runs on, where FlashInfer's kernels need sm_90 or newer). Both packages' functions have one signature.

Where FlashInfer's backends differ, one behaviour is chosen and documented per function.
"""
from __future__ import annotations

import warnings

import torch

from .checks import (check_flashinfer_decode_inputs, check_flashinfer_outputs_disjoint,
                     check_flashinfer_prefill_inputs, flashinfer_checkpoint_rows, flashinfer_decode_slots,
                     host_offsets, one_host_read)
from .delta_rule import recurrent_gated_delta_rule as _recurrent
from .gating import softplus as _softplus

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode_pretranspose", "gated_delta_rule_decode",
           "gated_delta_rule_mtp"]


def gqa_to_gva(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """FlashInfer's GQA (more q heads than k = v heads; q head h reads k / v head h // (Hq // Hv)) as the core's
    layout: k and v repeated per q head (copies). GVA inputs (more v heads) are the core's own layout: unchanged."""
    Hq, Hv = q.shape[-2], v.shape[-2]
    if Hq <= Hv:
        return q, k, v
    r = Hq // Hv
    return q, k.repeat_interleave(r, dim=-2), v.repeat_interleave(r, dim=-2)


def prefill_scale(scale, K: int) -> float:
    """FlashInfer's prefill scale: None or 0.0 mean K ** -0.5."""
    return K ** -0.5 if scale is None or scale == 0.0 else float(scale)


@one_host_read
def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
                           state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0,
                           use_cp=False):
    """FlashInfer's GDN prefill over packed sequences, computed by the time loop (refgdn's base truth).

    q: [T, Hq, K]   k: [T, Hk, K]   v: [T, Hv, V]   (GQA: Hq a multiple of Hk = Hv; GVA: Hv a multiple of Hq = Hk)
    g (alpha), beta: [T, sab] (sab = max(Hq, Hv); None: ones)   cu_seqlens: [N+1] int
    initial_state, output_state: [N, sab, V, K]   ->   output [T, sab, V], or (output, final state) with
    output_final_state

        S <- alpha_t S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = state[n]^T)

    g is the decay itself (FlashInfer's alpha; alpha = 0 clears the state); scale None or 0.0 is K ** -0.5. output
    and output_state, when given, are written and returned (output_state also without output_final_state, as
    FlashInfer's Hopper path does); an empty sequence's row of output_state is left untouched, and of a final state
    allocated here it holds the sequence's initial state (zeros without one). State checkpoints
    (checkpoint_every_n_tokens, a multiple of 64): sequence n's state after every checkpoint_every_n_tokens of its
    tokens, in order, to rows checkpoint_cu_starts[n], ... of state_checkpoints [R, sab, V, K] (len_n // every rows;
    the values are checked). use_cp (FlashInfer's context-parallel schedule) changes nothing here. Computed in
    float32 (float64 when any input is), o rounded to q's dtype.
    """
    N, sab = check_flashinfer_prefill_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                             use_qk_l2norm_in_kernel, output, output_state, state_checkpoints,
                                             checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp)
    check_flashinfer_outputs_disjoint(output, output_state, (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                                             ("initial_state", initial_state)), state_checkpoints)
    every = checkpoint_every_n_tokens
    starts = flashinfer_checkpoint_rows(cu_seqlens, checkpoint_cu_starts, every,
                                        state_checkpoints.shape[0]) if every else []
    T, _, K = q.shape
    wide = torch.float64 if torch.float64 in [t.dtype for t in (q, g, beta, initial_state) if t is not None] \
        else torch.float32
    q, k, v = gqa_to_gva(q, k, v)
    # the decay in log space for the core: alpha = 0 gives -inf, and the time loop's exp(-inf) = 0 clears the state
    log_g = torch.zeros(T, sab, dtype=wide, device=q.device) if g is None else torch.log(g.to(wide))
    beta = torch.ones(T, sab, dtype=wide, device=q.device) if beta is None else beta
    o, final = _recurrent(q[None], k[None], v[None], log_g[None], beta[None], prefill_scale(scale, K),
                          initial_state, True, cu_seqlens, use_qk_l2norm_in_kernel, state_v_first=True)
    o = o[0]                                                                         # [T, sab, V]
    offs = host_offsets(cu_seqlens)
    for n, row in enumerate(starts):     # checkpoints: the sequence again, every tokens at a time from its state
        s = None if initial_state is None else initial_state[n:n + 1]
        for j in range((offs[n + 1] - offs[n]) // every):
            seg = slice(offs[n] + j * every, offs[n] + (j + 1) * every)
            _, s = _recurrent(q[None, seg], k[None, seg], v[None, seg], log_g[None, seg], beta[None, seg],
                              prefill_scale(scale, K), s, True, None, use_qk_l2norm_in_kernel, state_v_first=True)
            state_checkpoints[row + j] = s[0].to(state_checkpoints.dtype)
    if output is not None:
        o = output.copy_(o)
    if output_state is not None:                 # the rows of non-empty sequences (an empty one's row untouched)
        for n in range(N):
            if offs[n + 1] > offs[n]:
                output_state[n] = final[n].to(output_state.dtype)
        final = output_state
    return (o, final) if output_final_state else o


def _decode(q, k, v, A_log, a, dt_bias, b, scale, use_qk_l2norm, pool, vk: bool, read, write, buf, output,
            tokens=None):
    """The decode core: batch row n runs its T tokens from pool[read[n]] (zeros and nothing written when read[n] < 0),
    writes its final state to pool[write[n]] (write[n] < 0: nowhere) and, with a buffer, the state after token t to
    buf[n, t]; with tokens (per-token pool rows [B][T]), the state after token t to pool[tokens[n][t]] (< 0: not
    stored). Pool writes are applied after every row has read. pool is [P, HV, V, K] (vk) or [P, HV, K, V].
    -> o [B, T, HV, V]."""
    B, T = q.shape[:2]
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    wide = torch.float64 if torch.float64 in (q.dtype, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype, pool.dtype) \
        else torch.float32
    # the gates in the compute dtype (precision hazard: softplus' exp of a large argument: refgdn's softplus)
    g = -torch.exp(A_log.to(wide)) * _softplus(a.to(wide) + dt_bias.to(wide))              # [B, T, HV]
    beta = torch.sigmoid(b.to(wide))
    scale = K ** -0.5 if scale is None else float(scale)
    kv = (lambda s: s.transpose(-1, -2)) if vk else (lambda s: s)                          # a slot as [HV, K, V]
    o = torch.zeros(B, T, HV, V, dtype=q.dtype, device=q.device)
    updates = []
    for n in range(B):
        if read[n] < 0:                                   # a padded row: output zeros, nothing read or written
            continue
        s0 = kv(pool[read[n]])[None].to(wide)
        for t in range(T) if buf is not None or tokens is not None else ():   # MTP: the state after each token
            step = [x[n:n + 1, :t + 1].to(wide) for x in (q, k, v, g, beta)]
            _, s_t = _recurrent(*step, scale=scale, initial_state=s0, output_final_state=True,
                                use_qk_l2norm_in_kernel=use_qk_l2norm)
            if buf is not None:                                                          # to row n of the buffer
                buf[n, t] = s_t[0].transpose(-1, -2).to(buf.dtype)                      # [HV, V, K]
            elif tokens[n][t] >= 0:                                                      # to its own pool row
                updates.append((tokens[n][t], kv(s_t[0])))
        seq = [x[n:n + 1].to(wide) for x in (q, k, v, g, beta)]
        o_n, s1 = _recurrent(*seq, scale=scale, initial_state=s0, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm)
        o[n] = o_n[0].to(q.dtype)
        if write[n] >= 0:
            updates.append((write[n], kv(s1[0])))
    for slot, s in updates:
        pool[slot] = s.to(pool.dtype)
    if output is not None:
        return output.copy_(o)
    return o


@one_host_read
def gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None,
                                         use_qk_l2norm=True, initial_state=None, initial_state_indices=None,
                                         output_state_indices=None, *, intermediate_states_buffer=None,
                                         disable_state_update=False):
    """FlashInfer's decode with V-major states: the gates from the raw projections, the states updated in place.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV]   A_log, dt_bias: [HV]
    state: [B, HV, V, K] (row n for batch row n), or the pool initial_state [P, HV, V, K] with
    initial_state_indices [B] (and output_state_indices [B]: where row n's final state goes; default its read slot)
    -> (output [B, T, HV, V] in q's dtype, the state or pool)

        g_t = -exp(A_log) softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)
        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = slot^T)

    Padding: a negative initial_state_indices entry reads and writes nothing, its outputs zeros (FlashInfer's float32
    path; its bfloat16 path instead sends such rows to slot 0). A negative output_state_indices entry skips that row's
    write back. T > 1 (MTP verify): intermediate_states_buffer [C >= B, T' >= T, HV, V, K] gets row n's state after
    each token, and disable_state_update=True leaves the states as they were. Slot values are checked here (in range,
    no slot written by two rows). Computed in float32 (float64 when any input or the states are).
    """
    check_flashinfer_decode_inputs(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                                   initial_state_indices, output_state_indices, intermediate_states_buffer,
                                   disable_state_update)
    return _decode_call(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                        initial_state_indices, output_state_indices, intermediate_states_buffer, disable_state_update,
                        vk=True)


def _decode_call(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                 initial_state_indices, output_state_indices, buf, disable_state_update, vk: bool,
                 ssm_state_indices=None):
    """The three decode entry points after their checks: slots from the values, then the core."""
    B = q.shape[0]
    writes = not disable_state_update
    tokens = None
    if initial_state is None:
        pool, read, write = state, list(range(B)), list(range(B)) if writes else [-1] * B
    else:
        pool = initial_state
        read, write, tokens = flashinfer_decode_slots(initial_state_indices, output_state_indices, pool.shape[0],
                                                      writes, ssm_state_indices)
        write = write if writes else [-1] * B
    o = _decode(q, k, v, A_log, a, dt_bias, b, scale, use_qk_l2norm, pool, vk, read, write, buf, output, tokens)
    return o, pool


@one_host_read
def gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True):
    """FlashInfer's decode with K-major states: one token per batch row, state [B, HV, K, V] updated in place.

    q, k: [B, 1, H, K]   v: [B, 1, HV, V]   a, b: [B, 1, HV]   A_log, dt_bias: [HV]   -> (output [B, 1, HV, V], state)
    The update is gated_delta_rule_decode_pretranspose's, on S = state[n] as it is stored.
    """
    check_flashinfer_decode_inputs(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, None, None,
                                   None, None, False, state_layout="kv")
    if q.shape[1] != 1:
        raise ValueError(f"gated_delta_rule_decode takes one token per batch row (q [B, 1, H, K]), got T={q.shape[1]}")
    return _decode_call(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, None, None, None, None,
                        False, vk=False)


def _tokens(q) -> int:
    """q's T (tokens per batch row), 0 for anything the checks will refuse."""
    return q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0


def mtp_update_flag(disable_state_update) -> bool:
    """FlashInfer's MTP default: disable_state_update None means True (its deprecated default), with its warning."""
    if disable_state_update is None:
        warnings.warn("gated_delta_rule_mtp(): disable_state_update defaults to True (FlashInfer's default, which it "
                      "will change to False); pass it explicitly", FutureWarning, stacklevel=3)
        return True
    if not isinstance(disable_state_update, bool):
        raise ValueError(f"disable_state_update must be a bool or None, got {disable_state_update!r}")
    return disable_state_update


@one_host_read
def gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None,
                         output=None, intermediate_states_buffer=None, ssm_state_indices=None,
                         disable_state_update=None, use_qk_l2norm=True, output_state_indices=None):
    """FlashInfer's multi-token (MTP verify) step on a pool: gated_delta_rule_decode_pretranspose's pool form with T
    tokens per batch row (T = 1 too), disable_state_update None meaning True (FlashInfer's default, with its warning).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV]   initial_state: [P, HV, V, K]
    initial_state_indices, output_state_indices: [B]   intermediate_states_buffer: [C >= B, T' >= T, HV, V, K]
    ssm_state_indices: [B, T] int   -> (output [B, T, HV, V], initial_state)
    ssm_state_indices (FlashInfer's per-token pool scatter, T >= 2, disable_state_update=False): the state after token
    t of row n goes to pool row ssm_state_indices[n, t] (negative: not stored) and no row writes back its final state
    (the last token's row holds it); such a row must not be another row's read slot, nor given twice (checked).
    """
    frozen = mtp_update_flag(disable_state_update)
    check_flashinfer_decode_inputs(q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                                   initial_state_indices, output_state_indices,
                                   intermediate_states_buffer, frozen and _tokens(q) > 1, ssm_state_indices)
    return _decode_call(q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                        initial_state_indices, output_state_indices, intermediate_states_buffer, frozen, vk=True,
                        ssm_state_indices=ssm_state_indices)
