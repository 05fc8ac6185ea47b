"""The ops vLLM's Qwen3-Next GDN layer calls, under vLLM's names and argument orders.

From its vendored fla (``vllm.model_executor.layers.fla.ops``): ``chunk_gated_delta_rule`` for prefills (fla's op,
its arguments in vLLM's order) and ``fused_recurrent_gated_delta_rule`` for decode and speculative verification, a
serving form of the recurrent op that fla 0.6.0 does not have: the state lives in a pool of slots read and written
in place,

    ssm_state_indices [N]     one slot per request: read at the start, the final state written back;
    ssm_state_indices [N, L]  one slot per token: the state after token t goes to slot [n, t], and the request
                              starts from slot [n, num_accepted_tokens[n] - 1] (the last accepted draft's state:
                              vLLM's rollback by checkpoints).

Newer vLLM decodes without drafts through ``fused_recurrent_gated_delta_rule_packed_decode``: the gates, the l2norm
and the delta rule in one op on the conv's packed q | k | v rows, the pool in its [S, HV, V, K] layout, slot 0 its
null block.

Newer vLLM's ``fused_sigmoid_gating_delta_rule_update`` (its third_party fla; not SGLang's op of that name, see
refgdn.sglang_ops) is the newer recurrent op with the gates formed from the raw projections a, b. Newer vLLM prepares
a prefill's inputs with ``fused_post_conv_prep``: the conv's packed rows split into contiguous
q, k, v, the l2norm and the gates in one op.

From its Qwen3-Next model file: ``fused_gdn_gating`` (the gates). From its mamba ops: ``causal_conv1d_update`` (decode
and verification, with the drafts' rollback) and ``causal_conv1d_fn`` (prefill). So vLLM's imports of these names become
``from refgdn.vllm_ops import ...`` (the oracle) or ``from fast.vllm_ops import ...`` (Triton). Both packages'
functions have the same signatures; fast's checks the slot values on the device only as far as memory safety needs
(``check_values=True`` checks them on the host, as this oracle always does).
"""
from __future__ import annotations

import torch

from .checks import (_need_tensor, _shape, check_vk_states, check_vllm_conv_fn_inputs, check_vllm_conv_fn_refusals,
                     check_vllm_conv_refusals, check_vllm_conv_update_inputs, check_vllm_gating_arguments,
                     check_vllm_packed_decode_inputs, check_vllm_post_conv_inputs, check_vllm_recurrent_inputs,
                     check_vllm_sigmoid_gating_inputs, final_state_v_first, host_offsets, need_disjoint, one_host_read,
                     vllm_conv_fn_rows, vllm_conv_update_rows, vllm_packed_decode_slots, vllm_recurrent_slots)
from .conv import causal_conv1d as _causal_conv1d
from .delta_rule import chunk_gated_delta_rule as _chunk
from .delta_rule import recurrent_gated_delta_rule as _recurrent
from .gating import gdn_gating as _gating
from .gating import l2norm as _l2norm
from .gating import softplus as _softplus

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gated_delta_rule_packed_decode", "fused_sigmoid_gating_delta_rule_update",
           "fused_gdn_gating", "fused_post_conv_prep",
           "causal_conv1d_update", "causal_conv1d_fn"]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, *, chunk_indices=None,
                           chunk_offsets=None, core_attn_out=None, state_layout: str = "kv",
                           check_values: bool = False):
    """refgdn.chunk_gated_delta_rule in vLLM's argument order (``head_first`` before the l2norm flag).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V], final_state [N, HV, K, V] float32 or None)

    Newer vLLM's generation (third_party fla: no head_first, keywords after cu_seqlens): state_layout="vk" takes
    initial_state [N, HV, V, K] and returns final_state [N, HV, V, K] (contiguous); core_attn_out [B, T, HV, V] in
    v's dtype receives o (returned); chunk_indices / chunk_offsets (vLLM's precomputed varlen tables) are accepted
    and not needed (tensors or None). Pass them by keyword. check_values: the oracle checks cu_seqlens' values
    whatever it says (a host read); fast's twin only when it is True (by default it reads nothing back).
    """
    return vllm_chunk(_chunk, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, head_first,
                      use_qk_l2norm_in_kernel, chunk_indices, chunk_offsets, core_attn_out, state_layout)


def vllm_chunk(chunk, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, head_first,
               use_qk_l2norm_in_kernel, chunk_indices, chunk_offsets, core_attn_out, state_layout):
    """vLLM's chunk op over a package's chunk_gated_delta_rule (refgdn's or fast's): both generations' arguments
    checked here (ValueError naming them), the "vk" states seen through their [.., K, V] views."""
    check_vllm_chunk_args(q, v, initial_state, chunk_indices, chunk_offsets, core_attn_out, state_layout)
    check_vllm_chunk_out(core_attn_out, q, k, v, g, beta, initial_state, cu_seqlens)
    vk = state_layout == "vk"
    h0 = initial_state.transpose(-1, -2) if vk and initial_state is not None else initial_state   # [N, HV, K, V]
    o, final = chunk(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                     head_first=head_first)
    if core_attn_out is not None:
        o = core_attn_out.copy_(o)
    return o, final_state_v_first(final, vk)                                         # "vk": [N, HV, V, K]


def check_vllm_chunk_args(q, v, initial_state, chunk_indices, chunk_offsets, core_attn_out, state_layout) -> None:
    """The vLLM chunk op's own arguments (the rest are chunk_gated_delta_rule's): state_layout, the varlen tables'
    types, "vk" initial states [N, HV, V, K], core_attn_out [B, T, HV, V] in v's dtype on its device."""
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout must be 'kv' (states [N, HV, K, V]) or 'vk' ([N, HV, V, K], newer vLLM's), "
                         f"got {state_layout!r}")
    for name, t in (("chunk_indices", chunk_indices), ("chunk_offsets", chunk_offsets)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None (vLLM's varlen table; not needed here), got "
                             f"{type(t).__name__}")
    vk = state_layout == "vk"
    if vk and initial_state is not None:
        check_vk_states("initial_state", initial_state, q, v)
    if core_attn_out is not None:
        _need_tensor("core_attn_out", core_attn_out, 4)
        if tuple(core_attn_out.shape) != tuple(v.shape) or core_attn_out.dtype != v.dtype or (
                core_attn_out.device != v.device):
            raise ValueError(f"core_attn_out must be [B, T, HV, V] = {list(v.shape)} in v's dtype {v.dtype} on "
                             f"{v.device} (o is written into it), got {_shape(core_attn_out)} {core_attn_out.dtype} "
                             f"on {core_attn_out.device}")


def check_vllm_chunk_out(core_attn_out, q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """core_attn_out (a tensor: check_vllm_chunk_args ran) shares no byte with the inputs: fast's kernels write o
    into it while other programs read them. A per-call check (addresses are no part of a call's signature)."""
    if core_attn_out is not None:
        need_disjoint("core_attn_out", core_attn_out, (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                                        ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)))


def default_beta(q: torch.Tensor, v: torch.Tensor, beta):
    """beta None -> ones [B, T, HV] in q's dtype (a broadcast view: no memory). vLLM forms them from q's shape,
    i.e. [B, T, H], which only fits without GVA; HV is what every token and value head needs."""
    if beta is not None or not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor) or v.dim() != 4:
        return beta
    return torch.ones(1, dtype=q.dtype, device=q.device).expand(*v.shape[:3])


@one_host_read
def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None,
                                     inplace_final_state: bool = True, cu_seqlens=None, ssm_state_indices=None,
                                     num_accepted_tokens=None, use_qk_l2norm_in_kernel: bool = False, *,
                                     retrieve_parent_token=None, check_values: bool = False, state_layout: str = "kv",
                                     null_block_id: int = -1):
    """vLLM's serving recurrent op: the gated delta rule per token, states read from and written to a slot pool.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV] (beta None: ones)   cu_seqlens: [N+1], B == 1
    ssm_state_indices: None, [N] or [N, L] int; initial_state: the pool [S, HV, K, V] with indices, else
    [N, HV, K, V] or None (state_layout "vk": [.., HV, V, K]); num_accepted_tokens: [N] int in [1, L], with [N, L]
    indices only.   -> (o [B, T, HV, V] in v.dtype, final_state)

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    Where sequence n starts: slot ssm_state_indices[n] ([N]), ssm_state_indices[n, num_accepted_tokens[n] - 1]
    ([N, L]; column 0 without num_accepted_tokens), initial_state[n] (no indices), zeros (no initial_state).
    A slot <= null_block_id there (-1: a negative one) marks a padded sequence: it reads and writes nothing and its
    outputs are zeros; a write entry <= null_block_id is skipped.
    inplace_final_state=True (vLLM's default): final_state is initial_state, written in place: with [N, L] indices
    the state after each token t of the sequence goes to slot [n, t] (negative entries: not written); with [N]
    indices or none, the sequence's final state goes where it was read from. False: initial_state is only read and
    final_state is a new [B * T, HV, K, V] tensor of the state after every token (padded sequences' rows zeros), in
    initial_state's dtype (without one: the compute dtype). Computed in float32 (float64 when any input or the pool
    is); states are kept in the compute dtype between tokens, each stored copy rounded to the pool's dtype.

    The two generations of vLLM's op (same signature): state_layout="kv", null_block_id=-1 (the defaults) is
    vllm/model_executor/layers/fla's (states [.., HV, K, V], negative entries padding); state_layout="vk",
    null_block_id=0 is vllm/third_party/flash_linear_attention's (every state, the pool and the returned per-token
    states alike, [.., HV, V, K] with K contiguous; entries <= 0, its NULL_BLOCK_ID, padding).

    Where this differs from vLLM's kernel: only in what vLLM leaves undefined (its kernel reads and writes through
    whatever index it is given): [N] indices with several tokens per sequence write the final state to the
    sequence's own slot; without indices initial_state holds one state per sequence; a padded sequence writes
    nothing. retrieve_parent_token (tree drafts) and a head-wise beta [B, T, HV, V] are refused by name.
    The slot values are checked here on every call, whatever check_values says (fast's twin reads them only with
    check_values=True): slots within the pool, num_accepted_tokens in [1, L], no slot written by two
    sequences or written by one and read by another, L >= every sequence's token count where states are written
    per token (refgdn.checks.vllm_recurrent_slots).
    """
    beta = default_beta(q, v, beta)
    check_vllm_recurrent_inputs(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
                                ssm_state_indices, num_accepted_tokens, retrieve_parent_token,
                                state_layout=state_layout, null_block_id=null_block_id)
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    vk = state_layout == "vk"
    pool = initial_state.transpose(-1, -2) if vk and initial_state is not None else initial_state  # [.., HV, K, V]
    plan = vllm_recurrent_slots(B, T, cu_seqlens, ssm_state_indices, num_accepted_tokens, inplace_final_state,
                                None if pool is None else pool.shape[0], null_block_id)
    # the compute dtype: float64 when any input or the pool is (the packed decode's and SGLang's rule)
    wide = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                                              None if pool is None else pool.dtype) else torch.float32
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]     # [B T, ...]: one token axis
    o = torch.zeros(B * T, HV, V, dtype=v.dtype, device=q.device)
    per_token = None
    if not inplace_final_state:         # (a view [B T, HV, K, V] of [B T, HV, V, K] memory for "vk")
        per_token = torch.zeros(B * T, HV, *((V, K) if vk else (K, V)), dtype=pool.dtype if pool is not None else wide,
                                device=q.device)
        per_token_kv = per_token.transpose(-1, -2) if vk else per_token
    updates = []                    # (slot, state) written after every sequence has read (the kernel's order)
    for bos, eos, read, writes in plan:
        if read == -1:                                         # padded: zeros out, nothing written
            continue
        # the state in the compute dtype, as the kernel keeps it in registers between tokens
        S = torch.zeros(1, HV, K, V, dtype=wide, device=q.device) if read is None else pool[read][None].to(wide)
        for t in range(bos, eos):
            tok = [x[t][None, None] for x in flat]              # [1, 1, ...]: one token
            o_t, S = _recurrent(*tok, scale=scale, initial_state=S, output_final_state=True,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            o[t] = o_t[0, 0]
            if per_token is not None:
                per_token_kv[t] = S[0].to(per_token.dtype)
            if writes[t - bos] is not None:
                updates.append((writes[t - bos], S[0].clone()))
    for slot, S in updates:
        pool[slot].copy_(S.to(pool.dtype))
    o = o.reshape(B, T, HV, V)
    return o, (initial_state if inplace_final_state else per_token)


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                   ssm_state_indices, use_qk_l2norm_in_kernel: bool = False, *,
                                                   check_values: bool = False):
    """vLLM's non-speculative GDN decode in one op: the gates, the l2norm and the delta rule for one token per
    request, straight from the conv's packed output, the state read from and written to its slot in place.

    mixed_qkv: [B, 2 H K + HV V] (row n: request n's q | k | v, the conv update's output)   a, b: [B, HV] (the raw
    gate projections)   A_log, dt_bias: [HV]   initial_state: the slot pool [S, HV, V, K] (vLLM's layout: each
    head's state stored transposed, K contiguous)   out: [B, 1, HV, V], written in place   ssm_state_indices: [B] int
    -> (out, initial_state)

        g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b)
        S <- exp(g) S ;  S <- S + k (beta (v - S^T k))^T ;  o = scale S^T q       (S = initial_state[slot]^T)

    H is read from mixed_qkv's width; scale None means K ** -0.5 (vLLM always passes it). An entry of
    ssm_state_indices <= 0 is vLLM's null block (NULL_BLOCK_ID = 0: slot 0 is never a request's): that request's
    output is zeros and no slot is read or written. Computed in float32 (float64 when any input or the pool is), the
    state rounded once to the pool's dtype. Where this differs from vLLM's kernel: beta = sigmoid(b) stays in the
    compute dtype (vLLM's kernel rounds it to b's dtype first: a rounding, not a semantic). The slot values are
    checked here on every call (check_values is accepted for the signature of fast's twin, which reads them only when
    asked): slots below S, no slot given to two requests (refgdn.checks.vllm_packed_decode_slots).
    """
    B, H, HV, K, V = check_vllm_packed_decode_inputs(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                     ssm_state_indices, use_qk_l2norm_in_kernel)
    pool = initial_state
    slots = vllm_packed_decode_slots(ssm_state_indices, pool.shape[0])
    wide = (torch.float64 if torch.float64 in (mixed_qkv.dtype, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype,
                                               pool.dtype) else torch.float32)
    live = [n for n, s in enumerate(slots) if s > 0]
    o = torch.zeros(B, 1, HV, V, dtype=wide, device=mixed_qkv.device)
    if live:
        rows = torch.tensor(live, device=mixed_qkv.device)
        read = torch.tensor([slots[n] for n in live], device=mixed_qkv.device)
        x = mixed_qkv.index_select(0, rows).to(wide)                               # [n, 2 H K + HV V]
        q = x[:, :H * K].reshape(len(live), 1, H, K)                               # [n, 1, H, K]
        k = x[:, H * K:2 * H * K].reshape(len(live), 1, H, K)
        v = x[:, 2 * H * K:].reshape(len(live), 1, HV, V)                          # [n, 1, HV, V]
        # the gates in the compute dtype (precision hazard: softplus' exp of a large argument: refgdn's softplus)
        g = -torch.exp(A_log.to(wide)) * _softplus(a.index_select(0, rows).to(wide) + dt_bias.to(wide))
        beta = torch.sigmoid(b.index_select(0, rows).to(wide))                     # [n, HV]
        s0 = pool.index_select(0, read).transpose(-1, -2).to(wide)                 # [n, HV, V, K] -> [n, HV, K, V]
        o_live, s1 = _recurrent(q, k, v, g[:, None], beta[:, None], scale=scale, initial_state=s0,
                                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        o[rows] = o_live
    out.copy_(o)                                                                   # (checks above: nothing written)
    if live:
        pool.index_copy_(0, read, s1.transpose(-1, -2).to(pool.dtype))            # back to [n, HV, V, K]
    return out, initial_state


def sigmoid_gating_out_dtype(q: torch.Tensor, initial_state) -> torch.dtype:
    """Newer vLLM's fused_sigmoid_gating_delta_rule_update output dtype: float32 with a float32 state (an fp16 output
    of an unnormalised fp32 state can overflow), else q's."""
    return torch.float32 if initial_state is not None and initial_state.dtype == torch.float32 else q.dtype


def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta: float = 1.0, threshold: float = 20.0,
                                           scale=None, initial_state=None, inplace_final_state: bool = True,
                                           cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                           use_qk_l2norm_in_kernel: bool = False, is_kda: bool = False, *,
                                           check_values: bool = False):
    """Newer vLLM's fused decode / verify op (its third_party fla ``fused_sigmoid_gating_delta_rule_update``): the gates
    from the raw projections and the delta rule per token, states in a slot pool [S, HV, V, K].

    A_log, dt_bias: [HV]   a, b: [B, T, HV] or [B * T, HV]   q, k: [B, T, H, K]   v: [B, T, HV, V]
    initial_state, ssm_state_indices, num_accepted_tokens, cu_seqlens, inplace_final_state: as
    fused_recurrent_gated_delta_rule with state_layout "vk" and null_block_id 0 (entries <= 0: vLLM's null block)
    -> (o [B, T, HV, V], final_state); o is float32 with a float32 state, else in q's dtype (vLLM's rule).

        g_t = -exp(A_log) softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)     (in the compute dtype, never rounded)
        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    fused_recurrent_gated_delta_rule on the gates refgdn.gdn_gating forms (float32, float64 when any input or the
    pool is); beta / threshold are softplus' (1.0 / 20.0 only), is_kda must be False. Where this differs from
    vLLM's kernel: a padded request's outputs are zeros (vLLM leaves them unwritten). Values are checked on every
    call (check_values is fast's switch).
    """
    N, a3, b3 = check_vllm_sigmoid_gating_inputs(A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state,
                                                 inplace_final_state, cu_seqlens, ssm_state_indices,
                                                 num_accepted_tokens, use_qk_l2norm_in_kernel, is_kda)
    wide = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype, a.dtype, b.dtype, A_log.dtype,
                                              dt_bias.dtype, None if initial_state is None
                                              else initial_state.dtype) else torch.float32
    g, bt = _gating(A_log.to(wide), a3.to(wide), dt_bias.to(wide), b3.to(wide))
    # q, k, v upcast (exactly: the op computes in the compute dtype anyway) so that o comes back in the compute
    # dtype, then rounded once to vLLM's output dtype
    o, final = fused_recurrent_gated_delta_rule(q.to(wide), k.to(wide), v.to(wide), g, bt, scale, initial_state,
                                                inplace_final_state, cu_seqlens, ssm_state_indices,
                                                num_accepted_tokens, use_qk_l2norm_in_kernel, state_layout="vk",
                                                null_block_id=0)
    return o.to(sigmoid_gating_out_dtype(q, initial_state)), final


def fused_gdn_gating(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """vLLM's fused_gdn_gating (its Qwen3-Next model file) in its argument order: refgdn.gdn_gating.

    A_log: [HV]   a, b: [N, HV] (or [B, T, HV])   dt_bias: [HV]
    -> (g [1, N, HV] float32, beta [1, N, HV] in b's dtype) ([B, T, HV] for 3-D inputs)

        g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)

    beta / threshold are softplus' parameters; only vLLM's defaults (1.0, 20.0) are supported.
    """
    return vllm_gating(_gating, A_log, a, b, dt_bias, beta, threshold)


def fused_post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                         apply_l2norm: bool = True, output_g_exp: bool = False):
    """Newer vLLM's prefill preparation (its third_party fla ``fused_post_conv_prep``): the conv's packed rows split
    into contiguous q, k, v, q and k l2-normalised, and the gates, in one op.

    conv_output: [L, 2 H K + HV V] (row t: token t's q | k | v)   a, b: [L, HV]   A_log, dt_bias: [HV]
    -> (q [L, H, K], k [L, H, K], v [L, HV, V] contiguous in conv_output's dtype, g [L, HV], beta [L, HV])

        q, k <- x / sqrt(sum(x^2) + 1e-6) (apply_l2norm)   g = -exp(A_log) softplus(a + dt_bias)   beta = sigmoid(b)
        g <- exp(g) (output_g_exp: the decay itself, as FlashInfer's prefill takes it)

    H = num_k_heads, K = head_k_dim, V = head_v_dim; HV from A_log. g and beta are float32 (float64 when any input
    is), beta included (not b's dtype, unlike fused_gdn_gating). refgdn.l2norm and refgdn.gdn_gating on the split.
    """
    L, H, HV, K, V = check_vllm_post_conv_inputs(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim,
                                                 head_v_dim, apply_l2norm, output_g_exp)
    wide = torch.float64 if torch.float64 in (conv_output.dtype, a.dtype, b.dtype, A_log.dtype,
                                              dt_bias.dtype) else torch.float32
    x = conv_output
    q = x[:, :H * K].unflatten(1, (H, K))                           # [L, H K] -> [L, H, K]
    k = x[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = x[:, 2 * H * K:].unflatten(1, (HV, V)).contiguous()         # [L, HV V] -> [L, HV, V]
    if apply_l2norm:
        q, k = _l2norm(q), _l2norm(k)                               # (computed in float32 / 64, rounded back)
    g, beta = _gating(A_log.to(wide), a.to(wide), dt_bias.to(wide), b.to(wide))
    if output_g_exp:
        g = torch.exp(g)
    return q.contiguous(), k.contiguous(), v, g, beta


def vllm_gating(gating, A_log, a, b, dt_bias, beta: float, threshold: float):
    """fused_gdn_gating over a package's gdn_gating (``gating``, this API's argument order)."""
    check_vllm_gating_arguments(a, beta, threshold)
    g, b_out = gating(A_log, a, dt_bias, b)
    if a.dim() == 2:
        g, b_out = g[None], b_out[None]                  # [N, HV] -> [1, N, HV]: vLLM's token-major batch of one
    return g, b_out


@one_host_read
def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, query_start_loc=None, max_query_len: int = -1,
                         pad_slot_id: int = -1, block_idx_last_scheduled_token=None, initial_state_idx=None,
                         retrieve_parent_token=None, validate_data: bool = False, *, check_values: bool = False):
    """vLLM's causal_conv1d_update (vllm.model_executor.layers.mamba.ops.causal_conv1d): the conv of decode and
    speculative verification, its windows in conv_state rows picked by conv_state_indices, updated in place.

    x: [B, D] (one token each), [B, D, L] (L each) or [T, D] with query_start_loc [B+1]; conv_state: [S, D, C],
    C >= W - 1 (with drafts: W - 2 + the longest request); weight: [D, W]; bias: [D]; conv_state_indices,
    num_accepted_tokens: [B] int -> y shaped as x, in x's dtype.

        u = [conv_state[s, :, o : o + W - 1], x_b]          s = conv_state_indices[b], o = num_accepted_tokens[b] - 1
        y_t = act(bias + sum_j weight[:, j] u[:, t + j])    t < L_b
        conv_state[s, :, :W - 2 + L_b] <- u[:, 1:]           (num_accepted_tokens given: keep every draft's input)
        conv_state[s, :, :W - 1] <- u[:, L_b:]               (otherwise: the last W - 1 inputs)

    With drafts the row keeps W - 2 past inputs and every new one, so the next call starts its window at the last
    accepted token (vLLM's rollback of the conv). Without drafts the window stays in the row's first W - 1 columns,
    where every later read looks (this call's at offset 0, a verify's at num_accepted_tokens - 1, causal_conv1d_fn's).
    vLLM's kernel instead shifts the whole row left by L_b and writes x at its end; for C = W - 1 (its non-speculative
    cache) and for requests of max_query_len tokens that is the same. It differs for C > W - 1 (a speculative cache
    in a step whose batch has no drafts at all: vLLM's next read at the row's start would then miss x) and for a
    request shorter than the others in a query_start_loc call; vLLM's GDN layer sends one token per request there.
    A call without num_accepted_tokens reads the row's start, so after a verify it is right only when one token was
    accepted (vLLM keeps a request with zero drafts on its speculative path while any request has drafts).
    x is rounded to conv_state's dtype first, as vLLM does; sums in
    float32 (float64 when any input is). A request whose slot is pad_slot_id (or negative) is padded: zeros out, nothing
    written (vLLM leaves its outputs unwritten); a request without tokens writes nothing. activation: None, "silu" /
    "swish", or vLLM's bool (True: silu). max_query_len and validate_data (vLLM's shape asserts: the shapes are always
    checked here) are accepted and not needed; prefix caching's block_idx_last_scheduled_token / initial_state_idx and
    tree drafts' retrieve_parent_token are refused by name. The values (slots, offsets, counts) are checked here on
    every call, whatever check_values says (refgdn.checks.vllm_conv_update_rows); fast's twin checks them only when
    asked.
    """
    check_vllm_conv_refusals(block_idx_last_scheduled_token, initial_state_idx, retrieve_parent_token)
    B, D, W, L = check_vllm_conv_update_inputs(x, conv_state, weight, bias, activation, conv_state_indices,
                                               num_accepted_tokens, query_start_loc, max_query_len, pad_slot_id)
    S, C = conv_state.shape[0], conv_state.shape[2]
    rows = vllm_conv_update_rows(B, L, query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id, S, C, W)
    act = "silu" if activation is True else (None if activation is False else activation)
    wide = torch.float64 if torch.float64 in (x.dtype, weight.dtype, conv_state.dtype) else torch.float32
    xt = x[:, :, None] if x.dim() == 2 and query_start_loc is None else x      # [B, D, L] or [T, D]
    y = torch.zeros(xt.shape, dtype=x.dtype, device=x.device)
    new_rows = []
    for b, (bos, eos, s, off) in enumerate(rows):
        if s < 0 or eos == bos:                    # padded, or no token: nothing read or written (as vLLM)
            continue
        new = (xt[b] if query_start_loc is None else xt[bos:eos].transpose(0, 1))        # [D, L_b]
        new = new.to(conv_state.dtype)                                                     # vLLM rounds x first
        u = torch.cat([conv_state[s, :, off:off + W - 1], new], dim=1).to(wide)          # [D, W - 1 + L_b]
        taps = u.unfold(1, W, 1)                                                           # [D, L_b, W]: windows
        out = (taps * weight.to(wide)[:, None, :]).sum(-1)                               # [D, L_b]
        if bias is not None:
            out = out + bias.to(wide)[:, None]
        out = torch.nn.functional.silu(out) if act in ("silu", "swish") else out
        if query_start_loc is None:
            y[b] = out.to(x.dtype)
        else:
            y[bos:eos] = out.transpose(0, 1).to(x.dtype)
        keep = u[:, 1:] if num_accepted_tokens is not None else u[:, eos - bos:]
        new_rows.append((s, keep.to(conv_state.dtype)))
    for s, keep in new_rows:                       # written after every request has read (a kernel's order)
        conv_state[s, :, :keep.shape[1]] = keep
    return y[:, :, 0] if x.dim() == 2 and query_start_loc is None else y


@one_host_read
def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                     activation="silu", pad_slot_id: int = -1, block_idx_first_scheduled_token=None,
                     block_idx_last_scheduled_token=None, initial_state_idx=None, num_computed_tokens=None,
                     block_size_to_align=0, metadata=None, validate_data: bool = False, *, check_values: bool = False):
    """vLLM's causal_conv1d_fn (vllm.model_executor.layers.mamba.ops.causal_conv1d): the prefill conv over packed
    requests, each continuing from (and leaving its window in) a row of conv_states.

    x: [D, T] (vLLM's mixed_qkv.transpose(0, 1)); weight: [D, W]; bias: [D] or None; conv_states: [S, D, C],
    C >= W - 1; query_start_loc: [B+1]; cache_indices: [B] int (row of request b; None: row b); has_initial_state:
    [B] bool (None: no request continues) -> y: [D, T] in x's dtype.

        y_t = act(bias + sum_j weight[:, j] x_{t-W+1+j})     inputs before a request's start: its row's first W - 1
                                                             columns if has_initial_state, else zeros
        conv_states[s, :, :W - 1] <- the request's last W - 1 inputs (its window, as refgdn.causal_conv1d's state)

    x is rounded to conv_states' dtype first, as vLLM does. A padded request (row pad_slot_id or negative) reads and
    writes no row and its outputs are zeros (vLLM leaves them unwritten). metadata (vLLM's precomputed launch
    tables) and validate_data are accepted and not needed; prefix caching's arguments are refused by name. The row
    values and query_start_loc's are checked here on every call, whatever check_values says (fast's twin: only when
    asked).
    """
    check_vllm_conv_fn_refusals(block_idx_first_scheduled_token, block_idx_last_scheduled_token, initial_state_idx,
                                num_computed_tokens, block_size_to_align)
    B, D, W = check_vllm_conv_fn_inputs(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                        has_initial_state, activation, pad_slot_id)
    rows = vllm_conv_fn_rows(B, cache_indices, pad_slot_id, conv_states.shape[0])
    act = "silu" if activation is True else (None if activation is False else activation)
    offs = host_offsets(query_start_loc)
    cont = [False] * B if has_initial_state is None else has_initial_state.tolist()
    y = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    xs = x.to(conv_states.dtype)                                         # vLLM rounds x to the state's dtype first
    finals = []
    for b, s in enumerate(rows):
        if s < 0:
            continue
        h0 = conv_states[s, :, :W - 1][None] if cont[b] else torch.zeros_like(conv_states[s, :, :W - 1])[None]
        seq = xs[:, offs[b]:offs[b + 1]].T[None]                         # [1, L_b, D]
        out, final = _causal_conv1d(seq, weight, bias, act, h0, True)
        y[:, offs[b]:offs[b + 1]] = out[0].T.to(x.dtype)
        finals.append((s, final[0]))
    for s, final in finals:                                   # written after every request has read (a kernel's order)
        conv_states[s, :, :W - 1] = final.to(conv_states.dtype)
    return y
