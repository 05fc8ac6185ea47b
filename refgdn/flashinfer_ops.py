"""FlashInfer's GDN ops, under their names and argument orders.

``chunk_gated_delta_rule`` (``flashinfer.gdn_prefill``): a prefill over packed tokens (``cu_seqlens`` required), the
forget gate given as the decay itself (alpha = exp(g)), states [N, H, V, K] float32, GQA or GVA heads.
``gated_delta_rule_decode_pretranspose``, ``gated_delta_rule_decode`` and ``gated_delta_rule_mtp``
(``flashinfer.gdn_decode``): decode and MTP verify with the gates formed from the raw projections, the states a
per-batch tensor or a pool of slots, written in place. ``chunk_gated_delta_rule_paged`` /
``gated_delta_rule_decode_paged`` with ``gdn_paged_prefill_slots`` / ``gdn_paged_decode_slots``
(``flashinfer.gdn_paged``): prefill and decode on a paged recurrent-state cache, page j of a sequence holding the state
after its last token, so a request sharing a full-page prefix with an earlier one starts from the last shared page
(prefix caching). So FlashInfer's imports of these names become ``from refgdn.flashinfer_ops import ...`` (the oracle,
any device) or ``from fast.flashinfer_ops import ...`` (Triton: any GPU Triton runs on, where FlashInfer's kernels need
sm_90 or newer). Both packages' functions have one signature.

Where FlashInfer's backends differ, one behaviour is chosen and documented per function.
"""
from __future__ import annotations

import warnings

import torch

from typing import NamedTuple, Optional

from .checks import (check_flashinfer_decode_inputs, check_flashinfer_outputs_disjoint, check_flashinfer_page_table,
                     check_flashinfer_paged_decode_inputs, check_flashinfer_paged_gates, check_flashinfer_paged_pool,
                     check_flashinfer_paged_slots, check_flashinfer_prefill_inputs, check_index_vector,
                     flashinfer_checkpoint_rows, flashinfer_decode_slots, flashinfer_paged_rows, host_offsets,
                     need_disjoint, one_host_read)
from .delta_rule import recurrent_gated_delta_rule as _recurrent
from .gating import softplus as _softplus

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode_pretranspose", "gated_delta_rule_decode",
           "gated_delta_rule_mtp", "chunk_gated_delta_rule_paged", "gated_delta_rule_decode_paged",
           "gdn_paged_prefill_slots", "gdn_paged_decode_slots", "GDNPagedPrefillSlots", "GDNPagedDecodeSlots"]


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


# ----------------------------------------------------------------------------------------------
# flashinfer.gdn_paged: the state cache in pages (prefix caching)
# ----------------------------------------------------------------------------------------------

class GDNPagedPrefillSlots(NamedTuple):
    """Per-sequence pool rows of a paged prefill, all [N] int32 (gdn_paged_prefill_slots; FlashInfer's fields)."""
    state_indices: torch.Tensor          # page holding the last prefix token, read as the initial state (-1: none)
    output_state_indices: torch.Tensor   # the last page, written with the final state (-1: a padded sequence)
    checkpoint_cu_starts: torch.Tensor   # page_indices entry of the first page boundary the new tokens cross
    prefix_lens: torch.Tensor            # tokens before the new ones


class GDNPagedDecodeSlots(NamedTuple):
    """Per-sequence pool rows of a paged decode, both [B] int32 (gdn_paged_decode_slots; FlashInfer's fields)."""
    initial_state_indices: torch.Tensor  # the page read: the previous one when the token opens a new page
    output_state_indices: torch.Tensor   # the last page, written with the state after the token


def _page_at(page_indices: torch.Tensor, entry: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """page_indices[entry] where ok and the entry is within the table, else -1 (int64; safe for any values)."""
    n = page_indices.numel()
    if n == 0:
        return torch.full_like(entry, -1)
    return torch.where(ok & (entry >= 0) & (entry < n), page_indices.long()[entry.clamp(0, n - 1)], -1)


def _need_offsets(name: str, t) -> None:
    """t: an int tensor [n+1], n >= 0 (the length the other arguments are checked against)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int tensor [N+1], got {getattr(t, 'shape', type(t).__name__)}")
    check_index_vector(name, t, t.numel(), t.device)


def _page_counts(page_indptr: torch.Tensor) -> tuple:
    ptr = page_indptr.long()
    return ptr, ptr[1:] - ptr[:-1]


def gdn_paged_prefill_slots(cu_seqlens, page_indices, page_indptr, page_size, last_page_len) -> GDNPagedPrefillSlots:
    """The pool rows chunk_gated_delta_rule_paged derives from a page table, on the device (no host read: a model may
    form them once per step and pass them to every layer's call).

    cu_seqlens: [N+1] int   page_indices: [total_pages] int   page_indptr: [N+1] int   last_page_len: [N] int
    -> GDNPagedPrefillSlots of [N] int32. Sequence b's tokens after the call: (num_pages_b - 1) * page_size +
    last_page_len[b]; its prefix: those less its new tokens. A sequence without pages is padding (rows -1).
    """
    _need_offsets("cu_seqlens", cu_seqlens)
    check_flashinfer_page_table(page_indices, page_indptr, last_page_len, page_size, cu_seqlens.numel() - 1,
                                cu_seqlens.device)
    ptr, pages = _page_counts(page_indptr)
    cu = cu_seqlens.long()
    prefix = (pages - 1) * page_size + last_page_len.long() - (cu[1:] - cu[:-1])
    some = pages > 0
    prefix = torch.where(some, prefix, 0)
    read = _page_at(page_indices, ptr[:-1] + torch.div(prefix - 1, page_size, rounding_mode="floor"),
                    some & (prefix > 0))
    final = _page_at(page_indices, ptr[1:] - 1, some)
    starts = ptr[:-1] + torch.div(prefix, page_size, rounding_mode="floor")
    return GDNPagedPrefillSlots(*(t.to(torch.int32) for t in (read, final, starts, prefix)))


def gdn_paged_decode_slots(page_indices, page_indptr, last_page_len) -> GDNPagedDecodeSlots:
    """The pool rows gated_delta_rule_decode_paged derives from a page table, on the device (no host read).

    page_indices: [total_pages] int   page_indptr: [B+1] int   last_page_len: [B] int   -> GDNPagedDecodeSlots [B]
    int32: read the last page, or the previous one when the token opens a new page (last_page_len 1); write the last
    page. A sequence without pages is padding (rows -1).
    """
    _need_offsets("page_indptr", page_indptr)
    check_flashinfer_page_table(page_indices, page_indptr, last_page_len, None, page_indptr.numel() - 1,
                                page_indptr.device)
    ptr, pages = _page_counts(page_indptr)
    write = _page_at(page_indices, ptr[1:] - 1, pages > 0)
    read = torch.where(last_page_len.long() == 1, _page_at(page_indices, ptr[1:] - 2, pages > 1), write)
    return GDNPagedDecodeSlots(read.to(torch.int32), write.to(torch.int32))


def paged_gates(g, beta, T: int, sab: int, gate_domain: str, use_gate_in_kernel: bool, A_log, dt_bias,
                beta_is_logit: bool, wide: torch.dtype, device, log_floor: Optional[float] = None) -> tuple:
    """The paged prefill's gates as the core takes them: (the decay's log, beta), [T, sab] in ``wide``.
    g None: no decay; use_gate_in_kernel: g is the raw a, log decay = -exp(A_log) softplus(a + dt_bias); gate_domain
    "log": g is the log; "linear": g is the decay (its log; alpha = 0 gives -inf, or log_floor when given). beta None:
    ones; beta_is_logit: sigmoid(beta)."""
    if g is None:
        log_g = torch.zeros(T, sab, dtype=wide, device=device)
    elif use_gate_in_kernel:
        # precision hazard: softplus' exp of a large argument (refgdn's softplus)
        log_g = -torch.exp(A_log.to(wide)) * _softplus(g.to(wide) + dt_bias.to(wide))
    elif gate_domain == "log":
        log_g = g.to(wide)
    else:
        log_g = torch.log(g.to(wide))
        if log_floor is not None:
            log_g = log_g.clamp_min(log_floor)
    if beta is None:
        beta = torch.ones(T, sab, dtype=wide, device=device)
    else:
        beta = torch.sigmoid(beta.to(wide)) if beta_is_logit else beta.to(wide)
    return log_g, beta


def check_paged_prefill(q, k, v, g, beta, scale, cu_seqlens, state_pool, page_indices, page_indptr, page_size,
                        last_page_len, use_qk_l2norm_in_kernel, output, gate_domain, use_gate_in_kernel, A_log,
                        dt_bias, beta_is_logit, slots, offset_values: bool = True) -> tuple:
    """chunk_gated_delta_rule_paged's shape, dtype and device checks (both packages); -> (N, num_sab_heads, P)."""
    N, sab = check_flashinfer_prefill_inputs(q, k, v, g, beta, scale, None, False, cu_seqlens,
                                             use_qk_l2norm_in_kernel, output, None, None, None, 0, False,
                                             offset_values=offset_values)
    P = check_flashinfer_paged_pool(state_pool, sab, v.shape[2], q.shape[2], q.device)
    check_flashinfer_page_table(page_indices, page_indptr, last_page_len, page_size, N, q.device)
    check_flashinfer_paged_gates(g, gate_domain, use_gate_in_kernel, A_log, dt_bias, beta_is_logit, sab, q.device)
    check_flashinfer_paged_slots(slots, GDNPagedPrefillSlots._fields, N, q.device)
    return N, sab, P


def paged_disjoint(output, state_pool, inputs: tuple) -> None:
    """The paged ops' written tensors (output, the pool) share no byte with the inputs nor with each other."""
    if output is not None:
        need_disjoint("output", output, inputs + (("state_pool", state_pool),))
    need_disjoint("state_pool", state_pool, inputs)


def _same_slots(slots, derived, who: str) -> None:
    """Slots a caller passed must be the ones its page table gives (a host read)."""
    for name, given, want in zip(type(derived)._fields, slots, derived):
        if not torch.equal(given.long().cpu(), want.long().cpu()):
            raise ValueError(f"slots.{name} = {given.tolist()} is not what the page table gives {who} "
                             f"({want.tolist()})")


@one_host_read
def chunk_gated_delta_rule_paged(q, k, v, g=None, beta=None, scale=None, *, cu_seqlens, state_pool, page_indices,
                                 page_indptr, page_size, last_page_len, use_qk_l2norm_in_kernel=False, output=None,
                                 gate_domain="linear", use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                 beta_is_logit=False, slots=None):
    """FlashInfer's chunked prefill on a paged state cache (flashinfer.gdn_paged), by the time loop.

    q: [T, Hq, K]   k: [T, Hk, K]   v: [T, Hv, V] (packed; GQA or GVA as chunk_gated_delta_rule)   g, beta: [T, sab]
    cu_seqlens: [N+1] int   state_pool: [P, sab, V, K]   page_indices: [total_pages] int   page_indptr: [N+1] int
    last_page_len: [N] int   A_log, dt_bias: [sab] (use_gate_in_kernel)   ->   output [T, sab, V] in q's dtype

        S <- exp(log g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t     (S = page^T)

    Sequence b's new tokens q[cu_seqlens[b]:cu_seqlens[b + 1]] are the last of its (num_pages_b - 1) * page_size +
    last_page_len[b] tokens (page_size: a multiple of the chunk 64); the tokens before them are its prefix. The
    state starts from the page holding the last prefix token (zeros for an empty prefix); the state at every page
    boundary the new tokens cross goes to the page that ends there, and the final state to the last page. Pages
    ending at or before the prefix are only read, so a full-page prefix shared with other sequences is never
    written; a prefix ending inside a page continues that page in place. A sequence without pages (and tokens) is
    padding. gate_domain "linear": g is the decay (alpha), "log": its log; use_gate_in_kernel: g is the raw a,
    log decay = -exp(A_log) softplus(a + dt_bias); beta_is_logit: beta = sigmoid(beta); g / beta None: 1. slots
    (gdn_paged_prefill_slots') must be the page table's. The page table's values are checked (pages in range, none
    written twice or written by one sequence and read by another). Computed in float32 (float64 when any input or
    the pool is), o rounded to q's dtype.
    """
    N, sab, P = check_paged_prefill(q, k, v, g, beta, scale, cu_seqlens, state_pool, page_indices, page_indptr,
                                    page_size, last_page_len, use_qk_l2norm_in_kernel, output, gate_domain,
                                    use_gate_in_kernel, A_log, dt_bias, beta_is_logit, slots)
    paged_disjoint(output, state_pool, (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                                        ("dt_bias", dt_bias)))
    offs = host_offsets(cu_seqlens)
    rows = flashinfer_paged_rows(page_indices, page_indptr, last_page_len, page_size, P,
                                 [offs[n + 1] - offs[n] for n in range(N)])
    if slots is not None:
        _same_slots(slots, gdn_paged_prefill_slots(cu_seqlens, page_indices, page_indptr, page_size, last_page_len),
                    "chunk_gated_delta_rule_paged")
    T, _, K = q.shape
    wide = torch.float64 if torch.float64 in [t.dtype for t in (q, g, beta, A_log, state_pool) if t is not None] \
        else torch.float32
    log_g, beta = paged_gates(g, beta, T, sab, gate_domain, use_gate_in_kernel, A_log, dt_bias, beta_is_logit, wide,
                              q.device)
    q, k, v = gqa_to_gva(q, k, v)
    o = torch.zeros(T, sab, v.shape[2], dtype=q.dtype, device=q.device)
    updates = []
    for n, (read, writes, prefix) in enumerate(rows):
        lo, L = offs[n], offs[n + 1] - offs[n]
        s = None if read < 0 else state_pool[read][None].to(wide)                     # [1, sab, V, K]
        # the new tokens in segments ending at the page boundaries they cross, then at their end
        ends = [m - prefix for m in range((prefix // page_size + 1) * page_size, prefix + L, page_size)] + [L]
        start = 0
        for page, end in zip(writes, ends):
            seg = slice(lo + start, lo + end)
            o_s, s = _recurrent(q[None, seg], k[None, seg], v[None, seg], log_g[None, seg], beta[None, seg],
                                prefill_scale(scale, K), s, True, None, use_qk_l2norm_in_kernel, state_v_first=True)
            o[seg] = o_s[0].to(q.dtype)
            updates.append((page, s[0]))
            start = end
    for page, s in updates:                                 # after every sequence read its page
        state_pool[page] = s.to(state_pool.dtype)
    return output.copy_(o) if output is not None else o


@one_host_read
def gated_delta_rule_decode_paged(q, k, v, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True, *,
                                  state_pool, page_indices, page_indptr, last_page_len, backend="auto", slots=None):
    """FlashInfer's single-token decode on a paged state cache (flashinfer.gdn_paged).

    q, k: [B, 1, H, K]   v: [B, 1, HV, V]   a, b: [B, 1, HV]   A_log, dt_bias: [HV]   state_pool: [P, HV, V, K]
    page_indices: [total_pages] int   page_indptr: [B+1] int   last_page_len: [B] int   -> output [B, 1, HV, V]

    gated_delta_rule_decode_pretranspose's update. The decoded token is its sequence's last: it sits at position
    last_page_len[b] of the last page. When it opens that page (last_page_len 1) the state is read from the previous
    page, which is left as it was (it may be a shared full page), else from the last page; the state after the token
    goes to the last page. A sequence without pages is padding (output zeros, nothing read or written); a sequence's
    first token goes through the prefill (a decode needs a prefix: checked). backend is accepted (FlashInfer's
    names) and changes nothing. slots (gdn_paged_decode_slots') must be the page table's.
    """
    check_flashinfer_paged_decode_inputs(q, k, v, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, state_pool,
                                             page_indices, page_indptr, last_page_len, backend, slots)
    paged_disjoint(output, state_pool, (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log),
                                        ("dt_bias", dt_bias)))
    rows = flashinfer_paged_rows(page_indices, page_indptr, last_page_len, None, state_pool.shape[0])
    if slots is not None:
        _same_slots(slots, gdn_paged_decode_slots(page_indices, page_indptr, last_page_len),
                    "gated_delta_rule_decode_paged")
    read = [r for r, _, _ in rows]
    write = [w[0] if w else -1 for _, w, _ in rows]
    return _decode(q, k, v, A_log, a, dt_bias, b, scale, use_qk_l2norm, state_pool, True, read, write, None, output)
