"""The gated delta rule: the recurrent time loop (the truth) and the chunked WY/UT form.

Notation (DESIGN.md): q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; state S: [K, V] per
(sequence, value head); value head h reads q/k head h // G with G = HV // H (grouped value heads).
Per token t:

    S <- exp(g_t) * S ;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T ;   o_t = scale * S^T q_t

Inside this module heads are kept as [H, G] pairs so q/k are broadcast, never repeated:
value head index hv = h * G + j  <->  (h, j).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange

from .checks import (check_chunk_size, check_gdn_inputs, final_state_v_first, fla_keywords, fla_recurrent_arguments,
                     host_offsets, one_host_read)
from .gating import compute_dtype, l2norm, softplus


# --------------------------------------------------------------------------------------------
# shared preparation
# --------------------------------------------------------------------------------------------

def sequences(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> Iterator[Tuple[int, int, int, int]]:
    """Yield (n, b, bos, eos): sequence n lives in batch row b, tokens [bos, eos)."""
    if cu_seqlens is None:
        for b in range(B):
            yield b, b, 0, T
    else:
        offsets = host_offsets(cu_seqlens)       # a host read, shared inside the op's one_host_read scope
        for n in range(len(offsets) - 1):
            yield n, 0, offsets[n], offsets[n + 1]


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
             chunk_size=None, cu_seqlens_cpu=None):
    """Validate, apply fused gating / l2norm, upcast to the compute dtype. Returns a dict of tensors."""
    N = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, chunk_size,
                         cu_seqlens_cpu)
    dt = compute_dtype(q, v, g, beta, initial_state)
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    if A_log is not None:  # fused gating: `g` is the raw gate input a
        g = -torch.exp(A_log.to(dt)) * softplus(g.to(dt) + dt_bias.to(dt))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.to(dt)), l2norm(k.to(dt))
    # contiguous: the oracle's result must not depend on the state's layout (a [V, K] view's matmuls would sum in
    # another order)
    S0 = initial_state.to(dt).contiguous() if initial_state is not None else q.new_zeros(N, HV, K, V, dtype=dt)
    return dict(q=q.to(dt), k=k.to(dt), v=v.to(dt), g=g.to(dt), beta=beta.to(dt), S0=S0, N=N, G=HV // H,
                scale=K ** -0.5 if scale is None else float(scale), dtype=dt)


# --------------------------------------------------------------------------------------------
# 1. the recurrent form: the base truth
# --------------------------------------------------------------------------------------------

def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, *,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                               use_gate_in_kernel=None, chunk_indices=None, cp_context=None, head_first=False):
    """Gated delta rule as a plain time loop: the base truth every other form is checked against.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   (HV % H == 0)
    initial_state: [N, HV, K, V] (N = B, or len(cu_seqlens) - 1 for varlen with B == 1)
    cu_seqlens: [N+1] int, FlashAttention convention; zero-length sequences are allowed.
    Returns o: [B, T, HV, V] in v.dtype and final_state: [N, HV, K, V] (float32; float64 for
    float64 inputs) or None unless output_final_state.

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    scale defaults to K ** -0.5. use_qk_l2norm_in_kernel normalises q and k first
    (x / sqrt(sum x^2 + 1e-6)). With A_log and dt_bias ([HV]) given, `g` is the raw gate input a and
    g = -exp(A_log) * softplus(a + dt_bias) is applied first. Plain torch: autograd gives gradients.
    The keyword-only arguments are fla 0.6.0's (beta as logits, [V, K] states, ...): refgdn.checks.fla_keywords.
    """
    beta, initial_state, A_log, dt_bias, vk = fla_keywords(
        q, v, beta, initial_state, A_log, dt_bias, cu_seqlens, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first, use_gate_in_kernel, chunk_indices, cp_context, head_first)
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias)
    B, T, H, K = q.shape
    G = p["G"]
    o_parts, finals = [], []
    for n, b, bos, eos in sequences(B, T, cu_seqlens):
        S = rearrange(p["S0"][n], "(h j) k v -> h j k v", j=G)
        outs = [S.new_zeros(0, H, G, v.shape[3])]                          # keeps empty sequences valid
        for t in range(bos, eos):
            q_t, k_t = p["q"][b, t], p["k"][b, t]                        # [H, K]
            v_t = rearrange(p["v"][b, t], "(h j) v -> h j v", j=G)        # [H, G, V]
            g_t = rearrange(p["g"][b, t], "(h j) -> h j", j=G)            # [H, G]
            beta_t = rearrange(p["beta"][b, t], "(h j) -> h j", j=G)
            S = S * torch.exp(g_t)[..., None, None]                        # decay
            pred = torch.einsum("hjkv,hk->hjv", S, k_t)                    # S^T k_t
            delta = beta_t[..., None] * (v_t - pred)                       # corrected value
            S = S + torch.einsum("hk,hjv->hjkv", k_t, delta)               # rank-1 write
            outs.append(p["scale"] * torch.einsum("hjkv,hk->hjv", S, q_t)[None])
        o_parts.append(rearrange(torch.cat(outs), "t h j v -> t (h j) v"))
        finals.append(rearrange(S, "h j k v -> (h j) k v"))
    o = torch.stack(o_parts) if cu_seqlens is None else torch.cat(o_parts)[None]
    o = o.to(v.dtype)
    return o, final_state_v_first(torch.stack(finals) if output_final_state else None, vk)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None):
    """recurrent_gated_delta_rule under fla 0.6.0's name and argument order (fla.ops.gated_delta_rule's
    fused_recurrent_gated_delta_rule: gk and gv between g and beta, cu_seqlens last), so calls written for fla run
    unchanged, positional ones included (Hugging Face's Qwen3-Next imports this name).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV] or None   initial_state: [N, HV, K, V]
    -> (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] or None)

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    g None: no decay; beta None: ones; gk / gv are refused (refgdn.checks.fla_recurrent_arguments).
    use_gate_in_kernel (fla's bool): False (default) reads g as the log-decay and ignores A_log / dt_bias; True reads
    it as the raw gate input. The other keywords as recurrent_gated_delta_rule's (refgdn.checks.fla_keywords).
    """
    args, kwargs = fla_recurrent_arguments(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                           use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens)
    return recurrent_gated_delta_rule(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# 2. the chunked (WY / UT) form, one function per math step.
#    Stage functions take dense [B, T, ...] tensors with T a multiple of chunk_size, already in the
#    compute dtype; chunk_gated_delta_rule pads each sequence to whole chunks (padding tokens have
#    g = 0, beta = 0, k = 0, which leaves the state unchanged) and calls them in order.
# --------------------------------------------------------------------------------------------

def _causal_decay(G: torch.Tensor, strict: bool) -> torch.Tensor:
    """G: [..., BT] chunk-local cumulative decay -> D: [..., BT, BT], D_ij = exp(G_i - G_j) for j < i
    (j <= i unless strict), 0 elsewhere."""
    BT = G.shape[-1]
    keep = torch.ones(BT, BT, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    diff = G[..., :, None] - G[..., None, :]
    # precision hazard: mask before exp. Above the diagonal G_i - G_j >= 0 can be large, and
    # exp would overflow to inf; inf * 0 is nan. Exponentiate -inf there instead.
    return torch.exp(diff.masked_fill(~keep, float("-inf")))


def chunk_cumsum(g: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Step 1. g: [B, T, HV] -> G: [B, T, HV], the cumulative decay restarting at every chunk.

        G_c = sum_{s <= c, s in the chunk of c} g_s
    """
    check_chunk_size(chunk_size)
    gc = rearrange(g, "b (n c) h -> b n c h", c=chunk_size)
    return rearrange(gc.cumsum(2), "b n c h -> b (n c) h")


def wy_repr(k: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Step 2. k: [B, T, H, K], beta, G: [B, T, HV] -> A: [B, T, HV, BT], the UT/WY transform.

    Per chunk and value head, with L_ij = beta_i (k_i . k_j) exp(G_i - G_j) for i > j (0 elsewhere):

        A = (I + L)^-1                      (unit lower triangular; row i of A stored at token i)

    solved by forward substitution, the same recurrence a kernel runs:
        A_i = e_i - sum_{j < i} L_ij A_j
    """
    BT, HV, H = chunk_size, G.shape[-1], k.shape[2]
    kc = rearrange(k, "b (n c) h d -> b n h c d", c=BT)                     # [B, NC, H, BT, K]
    Gc = rearrange(G, "b (n c) (h j) -> b n h j c", c=BT, j=HV // H)        # [B, NC, H, G, BT]
    bc = rearrange(beta, "b (n c) (h j) -> b n h j c", c=BT, j=HV // H)
    kk = (kc @ kc.transpose(-1, -2))[:, :, :, None]                        # [B, NC, H, 1, BT, BT]
    L = bc[..., :, None] * kk * _causal_decay(Gc, strict=True)             # [B, NC, H, G, BT, BT]
    rows = []                                                              # A_0, A_1, ... (rows of A)
    for i in range(BT):                                                    # forward substitution
        e_i = F.one_hot(torch.tensor(i), BT).to(L).expand(L.shape[:-1])    # [..., BT]
        if i == 0:
            rows.append(e_i)
        else:                                                              # A_i = e_i - sum_j<i L_ij A_j
            rows.append(e_i - torch.einsum("...j,...jd->...d", L[..., i, :i], torch.stack(rows, -2)))
    A = torch.stack(rows, -2)                                              # [B, NC, H, G, BT, BT]
    return rearrange(A, "b n h j c d -> b (n c) (h j) d")


def w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, G: torch.Tensor,
        chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 3. k: [B, T, H, K], v: [B, T, HV, V], beta, G: [B, T, HV], A: [B, T, HV, BT]
    -> w: [B, T, HV, K], u: [B, T, HV, V].

        w = A (beta * exp(G) * K)        u = A (beta * V)        (per chunk, per value head)
    """
    BT, HV, H = chunk_size, v.shape[2], k.shape[2]
    Ac = rearrange(A, "b (n c) h d -> b n h c d", c=BT)                     # [B, NC, HV, BT, BT]
    kb = rearrange(k, "b t h d -> b t h 1 d") * rearrange(beta * torch.exp(G), "b t (h j) -> b t h j 1", j=HV // H)
    kb = rearrange(kb, "b (n c) h j d -> b n (h j) c d", c=BT)              # [B, NC, HV, BT, K]
    vb = rearrange(v * beta[..., None], "b (n c) h d -> b n h c d", c=BT)   # [B, NC, HV, BT, V]
    w, u = Ac @ kb, Ac @ vb
    return (rearrange(w, "b n h c d -> b (n c) h d"), rearrange(u, "b n h c d -> b (n c) h d"))


def state_passing(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, G: torch.Tensor, chunk_size: int,
                  initial_state: Optional[torch.Tensor] = None):
    """Step 4. k: [B, T, H, K], w: [B, T, HV, K], u: [B, T, HV, V], G: [B, T, HV], initial_state: [B, HV, K, V]
    -> h: [B, NC, HV, K, V] (the state at each chunk's start), v_new: [B, T, HV, V], final_state: [B, HV, K, V].

    Sequential over chunks:
        v_new = u - w S ;   S <- exp(G_last) S + K^T (exp(G_last - G) * v_new)
    """
    BT, HV, H = chunk_size, w.shape[2], k.shape[2]
    B, T, _, K = w.shape
    V = u.shape[-1]
    kc = rearrange(k, "b (n c) h d -> b n h 1 c d", c=BT)                   # [B, NC, H, 1, BT, K]
    wc = rearrange(w, "b (n c) (h j) d -> b n h j c d", c=BT, j=HV // H)    # [B, NC, H, G, BT, K]
    uc = rearrange(u, "b (n c) (h j) d -> b n h j c d", c=BT, j=HV // H)    # [B, NC, H, G, BT, V]
    Gc = rearrange(G, "b (n c) (h j) -> b n h j c", c=BT, j=HV // H)        # [B, NC, H, G, BT]
    S = (initial_state if initial_state is not None else w.new_zeros(B, HV, K, V))
    S = rearrange(S, "b (h j) k v -> b h j k v", j=HV // H)
    hs, vs = [], []
    for n in range(T // BT):
        hs.append(S)
        v_new = uc[:, n] - wc[:, n] @ S                                    # [B, H, G, BT, V]
        G_last = Gc[:, n, ..., -1:]                                        # [B, H, G, 1]
        # exp(G_last - G) <= 1: G is non-increasing inside a chunk, so this never overflows
        decayed = v_new * torch.exp(G_last - Gc[:, n])[..., None]
        S = torch.exp(G_last)[..., None] * S + kc[:, n].transpose(-1, -2) @ decayed
        vs.append(v_new)
    if not hs:                                                             # a zero-length sequence
        return w.new_zeros(B, 0, HV, K, V), u.new_zeros(B, 0, HV, V), rearrange(S, "b h j k v -> b (h j) k v")
    h = rearrange(torch.stack(hs, 1), "b n h j k v -> b n (h j) k v")
    v_new = rearrange(torch.stack(vs, 1), "b n h j c v -> b (n c) (h j) v")
    return h, v_new, rearrange(S, "b h j k v -> b (h j) k v")


def chunk_output(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, G: torch.Tensor,
                 scale: float, chunk_size: int) -> torch.Tensor:
    """Step 5. q, k: [B, T, H, K], v_new: [B, T, HV, V], h: [B, NC, HV, K, V], G: [B, T, HV] -> o: [B, T, HV, V].

        O = scale * [ (Q * exp(G)) S_chunk_start + ((Q K^T) * exp(G_i - G_j) * tril) v_new ]
    """
    BT, HV, H = chunk_size, v_new.shape[2], q.shape[2]
    qc = rearrange(q, "b (n c) h d -> b n h 1 c d", c=BT)                   # [B, NC, H, 1, BT, K]
    kc = rearrange(k, "b (n c) h d -> b n h 1 c d", c=BT)
    Gc = rearrange(G, "b (n c) (h j) -> b n h j c", c=BT, j=HV // H)        # [B, NC, H, G, BT]
    vc = rearrange(v_new, "b (n c) (h j) d -> b n h j c d", c=BT, j=HV // H)
    hc = rearrange(h, "b n (h j) k v -> b n h j k v", j=HV // H)
    inter = (qc * torch.exp(Gc)[..., None]) @ hc                           # from the chunk-start state
    attn = (qc @ kc.transpose(-1, -2)) * _causal_decay(Gc, strict=False)   # [B, NC, H, G, BT, BT]
    o = scale * (inter + attn @ vc)
    return rearrange(o, "b n h j c d -> b (n c) (h j) d")


@one_host_read   # cu_seqlens' values read to the host once per call (or taken from cu_seqlens_cpu)
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                           chunk_size=64, cu_seqlens_cpu=None, *, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, state_v_first=False, use_gate_in_kernel=None, chunk_indices=None,
                           cp_context=None, head_first=False):
    """Gated delta rule in the chunked WY/UT form (same function as the recurrent form).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   (HV % H == 0)
    initial_state: [N, HV, K, V] (N = B, or len(cu_seqlens) - 1 for varlen with B == 1)
    cu_seqlens: [N+1] int; chunks never straddle sequences. chunk_size: a power of two >= 16.
    cu_seqlens_cpu: optional, cu_seqlens' values as a CPU tensor (fla's argument; vLLM's
    query_start_loc_cpu): checked and used in place of a device->host read of cu_seqlens, which must
    hold the same values (the segmentation follows cu_seqlens_cpu).
    Returns o: [B, T, HV, V] in v.dtype and final_state: [N, HV, K, V] (float32; float64 for
    float64 inputs) or None unless output_final_state.

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    computed per chunk of BT tokens in five steps: 1 chunk_cumsum, 2 wy_repr, 3 w_u, 4 state_passing,
    5 chunk_output (each importable from refgdn.delta_rule). Other arguments as in
    recurrent_gated_delta_rule (fla 0.6.0's keywords included).
    """
    beta, initial_state, A_log, dt_bias, vk = fla_keywords(
        q, v, beta, initial_state, A_log, dt_bias, cu_seqlens, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        state_v_first, use_gate_in_kernel, chunk_indices, cp_context, head_first)
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
                 chunk_size, cu_seqlens_cpu)
    B, T = q.shape[:2]
    BT = chunk_size
    o_parts, finals = [], []
    for n, b, bos, eos in sequences(B, T, cu_seqlens):
        pad = (-(eos - bos)) % BT
        # one sequence as a batch of one, padded to whole chunks with inert tokens (g = beta = k = 0)
        qs, ks, vs = (F.pad(p[x][b:b + 1, bos:eos], (0, 0, 0, 0, 0, pad)) for x in ("q", "k", "v"))
        gs, bs = (F.pad(p[x][b:b + 1, bos:eos], (0, 0, 0, pad)) for x in ("g", "beta"))
        G = chunk_cumsum(gs, BT)                                           # 1
        A = wy_repr(ks, bs, G, BT)                                         # 2
        w, u = w_u(ks, vs, bs, A, G, BT)                                   # 3
        h, v_new, S = state_passing(ks, w, u, G, BT, p["S0"][n:n + 1])     # 4
        o_parts.append(chunk_output(qs, ks, v_new, h, G, p["scale"], BT)[0, :eos - bos])  # 5
        finals.append(S[0])
    if cu_seqlens is None:
        o = torch.stack(o_parts)
    else:
        o = torch.cat(o_parts)[None]
    return o.to(v.dtype), final_state_v_first(torch.stack(finals) if output_final_state else None, vk)
