"""The backward of the chunked gated delta rule, stage by stage: readable twins of fast's backward kernels.

Each stage is the hand-written gradient of a forward stage of refgdn.delta_rule, and is checked on
its own against torch.autograd of that stage in float64 (tests/test_fast_grad.py). The composition
``chunk_gated_delta_rule_bwd`` is what fast's backward computes; refgdn's own gradient (the truth of
the conformance rule) is plain autograd through refgdn.chunk_gated_delta_rule.

Notation as in refgdn.delta_rule (per chunk of BT tokens and value head; G is the chunk-local
cumulative decay, G_L its value at the chunk's last token, M_ij = exp(G_i - G_j) [i >= j]):

    forward                                          backward stage (this module)
    1 G = chunk cumsum of g                          5 chunk_cumsum_bwd: dg = reverse chunk cumsum of dG
    2 A = (I + L)^-1                    \\
    3 w = A (beta exp(G) K), u = A (beta V)  }        4 wy_bwd: dk, dv, dbeta, dG from dw, du
    4 v_new = u - w S ;                               2 state_passing_bwd: dS (reverse over chunks), dv_new
      S <- exp(G_L) S + K^T (exp(G_L - G) v_new)
    5 O = scale [(Q exp(G)) S + ((Q K^T) M) v_new]    1 chunk_dv_local: the intra-chunk part of dv_new
                                                      3 chunk_bwd_dqkwg: dq, dk, dw, dG (output + state update)

Stages take dense [B, T, ...] tensors with T a multiple of chunk_size, already in the compute dtype,
like the forward stages (padding tokens have g = beta = k = 0). Value heads are kept as (h, j) pairs;
per-value-head gradients of q and k come back as [B, T, HV, K] and are summed over the GVA group by
the caller.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from .delta_rule import (_causal_decay, _prepare, chunk_cumsum, sequences, state_passing, w_u, wy_repr)
from .gating import SOFTPLUS_THRESHOLD, softplus


def _heads(x: torch.Tensor, BT: int, G: int) -> torch.Tensor:
    """[B, T, HV, D] -> [B, NC, H, G, BT, D] (value head hv = h * G + j)."""
    return rearrange(x, "b (n c) (h j) d -> b n h j c d", c=BT, j=G)


def _qk(x: torch.Tensor, BT: int) -> torch.Tensor:
    """[B, T, H, K] -> [B, NC, H, 1, BT, K] (broadcast over the GVA group)."""
    return rearrange(x, "b (n c) h d -> b n h 1 c d", c=BT)


def _gates(G: torch.Tensor, BT: int, Gn: int) -> torch.Tensor:
    """[B, T, HV] -> [B, NC, H, G, BT]."""
    return rearrange(G, "b (n c) (h j) -> b n h j c", c=BT, j=Gn)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, NC, H, G, BT, D] -> [B, T, HV, D]."""
    return rearrange(x, "b n h j c d -> b (n c) (h j) d")


def chunk_dv_local(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, do: torch.Tensor, scale: float,
                   chunk_size: int) -> torch.Tensor:
    """Stage 1. q, k: [B, T, H, K], G: [B, T, HV], do: [B, T, HV, V] -> dv_local: [B, T, HV, V].

    The gradient of the output's intra-chunk term with respect to v_new:
        dv_local = scale ((Q K^T) * M)^T dO
    """
    BT, HV, H = chunk_size, do.shape[2], q.shape[2]
    Gc = _gates(G, BT, HV // H)
    attn = (_qk(q, BT) @ _qk(k, BT).transpose(-1, -2)) * _causal_decay(Gc, strict=False)   # [.., BT, BT]
    return _flat(scale * attn.transpose(-1, -2) @ _heads(do, BT, HV // H))


def state_passing_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, G: torch.Tensor, do: torch.Tensor,
                      dv_local: torch.Tensor, scale: float, chunk_size: int,
                      dht: Optional[torch.Tensor] = None):
    """Stage 2. q, k: [B, T, H, K], w: [B, T, HV, K], G: [B, T, HV], do, dv_local: [B, T, HV, V],
    dht: [B, HV, K, V] (gradient of the final state, or None)
    -> dh: [B, NC, HV, K, V] (gradient of the state at each chunk's END), dv_new: [B, T, HV, V]
    (the full gradient of v_new, = du), dh0: [B, HV, K, V].

    Reverse over chunks, dS starting at dht:
        dh[c] = dS ;  dv_new = dv_local + exp(G_L - G) * (K dS) ;
        dS <- exp(G_L) dS + scale (Q exp(G))^T dO - w^T dv_new
    """
    BT, HV, H = chunk_size, w.shape[2], k.shape[2]
    B, T, _, K = w.shape
    V = do.shape[-1]
    Gn = HV // H
    qc, kc = _qk(q, BT), _qk(k, BT)
    wc, doc, dvc = _heads(w, BT, Gn), _heads(do, BT, Gn), _heads(dv_local, BT, Gn)
    Gc = _gates(G, BT, Gn)
    dS = dht if dht is not None else w.new_zeros(B, HV, K, V)
    dS = rearrange(dS, "b (h j) k v -> b h j k v", j=Gn)
    dhs, dvs = [], []
    for n in reversed(range(T // BT)):
        dhs.append(dS)
        G_last = Gc[:, n, ..., -1:]                                        # [B, H, G, 1]
        dv = dvc[:, n] + torch.exp(G_last - Gc[:, n])[..., None] * (kc[:, n] @ dS)
        dS = (torch.exp(G_last)[..., None] * dS
              + scale * (qc[:, n] * torch.exp(Gc[:, n])[..., None]).transpose(-1, -2) @ doc[:, n]
              - wc[:, n].transpose(-1, -2) @ dv)
        dvs.append(dv)
    dh0 = rearrange(dS, "b h j k v -> b (h j) k v")
    if not dhs:                                                            # a zero-length sequence
        return w.new_zeros(B, 0, HV, K, V), do.new_zeros(B, 0, HV, V), dh0
    dh = rearrange(torch.stack(dhs[::-1], 1), "b n h j k v -> b n (h j) k v")
    dv_new = rearrange(torch.stack(dvs[::-1], 1), "b n h j c v -> b (n c) (h j) v")
    return dh, dv_new, dh0


def chunk_bwd_dqkwg(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
                    do: torch.Tensor, dv_new: torch.Tensor, G: torch.Tensor, scale: float, chunk_size: int):
    """Stage 3. q, k: [B, T, H, K], v_new, do, dv_new: [B, T, HV, V], h, dh: [B, NC, HV, K, V] (chunk-start
    states and end-of-chunk state gradients), G: [B, T, HV]
    -> dq, dk, dw: [B, T, HV, K] (per value head), dG: [B, T, HV].

    The gradients through the output (O = scale [(Q exp(G)) h + ((Q K^T) M) v_new]), the state update
    (S' = exp(G_L) h + K^T (exp(G_L - G) v_new)) and v_new = u - w h:
        dq = scale [exp(G) dO h^T + ((dO v_new^T) M) K]
        dk = scale ((dO v_new^T) M)^T Q + exp(G_L - G) v_new dh^T          dw = -dv_new h^T
        dG = rowsum(Q dq) - rowsum(K dk);  dG_L += rowsum(K dk_state) summed + exp(G_L) <h, dh>
    (the intra-chunk part of dG computed as rowsum(P) - colsum(P), P = scale ((dO v_new^T) M) (Q K^T), i > j)
    """
    BT, HV, H = chunk_size, v_new.shape[2], q.shape[2]
    Gn = HV // H
    qc, kc = _qk(q, BT), _qk(k, BT)
    vc, doc, dvc = _heads(v_new, BT, Gn), _heads(do, BT, Gn), _heads(dv_new, BT, Gn)
    hc = rearrange(h, "b n (h j) k v -> b n h j k v", j=Gn)
    dhc = rearrange(dh, "b n (h j) k v -> b n h j k v", j=Gn)
    Gc = _gates(G, BT, Gn)
    G_last = Gc[..., -1:]                                                  # [B, NC, H, G, 1]
    ds = (doc @ vc.transpose(-1, -2)) * _causal_decay(Gc, strict=False)   # (dO v_new^T) M
    dq = scale * (torch.exp(Gc)[..., None] * (doc @ hc.transpose(-1, -2)) + ds @ kc)
    dk_state = torch.exp(G_last - Gc)[..., None] * (vc @ dhc.transpose(-1, -2))
    dk = scale * ds.transpose(-1, -2) @ qc + dk_state
    dw = -dvc @ hc.transpose(-1, -2)
    # dG = rowsum(Q dq) - rowsum(K dk); the intra-chunk terms as rowsum(P) - colsum(P) with
    # P = ds * (Q K^T): the diagonal P_ii (in both sums) cancels exactly instead of up to rounding
    P = (ds * (qc @ kc.transpose(-1, -2))).tril(-1)
    dG = (qc * (dq - scale * ds @ kc)).sum(-1) - (kc * dk_state).sum(-1) + P.sum(-1) * scale - P.sum(-2) * scale
    last = (kc * dk_state).sum((-1, -2)) + torch.exp(G_last[..., 0]) * (hc * dhc).sum((-1, -2))
    dG = dG + F.one_hot(torch.tensor(BT - 1), BT).to(dG) * last[..., None]
    return _flat(dq), _flat(dk), _flat(dw), rearrange(dG, "b n h j c -> b (n c) (h j)")


def wy_bwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, A: torch.Tensor,
           dw: torch.Tensor, du: torch.Tensor, chunk_size: int):
    """Stage 4. k: [B, T, H, K], v: [B, T, HV, V], beta, G: [B, T, HV], A: [B, T, HV, BT], dw: [B, T, HV, K],
    du: [B, T, HV, V] -> dk: [B, T, HV, K] (per value head), dv: [B, T, HV, V], dbeta, dG: [B, T, HV].

    Through w = A Kb, u = A Vb (Kb = beta exp(G) K, Vb = beta V) and A = (I + L)^-1,
    L_ij = beta_i (k_i . k_j) exp(G_i - G_j) for i > j:
        dA = dw Kb^T + du Vb^T ;  dKb = A^T dw ;  dVb = A^T du ;  dL = -A^T dA A^T (strictly lower)
        dk = beta exp(G) dKb + R K + R^T K   with R = dL * beta_i exp(G_i - G_j)
        dv = beta dVb ;  dbeta = rowsum(dKb exp(G) K + dVb V) + rowsum(dL (K K^T) exp(G_i - G_j))
        dG = rowsum(dKb Kb) + rowsum(P) - colsum(P)   with P = dL * L
    """
    BT, HV, H = chunk_size, v.shape[2], k.shape[2]
    Gn = HV // H
    kc = _qk(k, BT)                                                        # [B, NC, H, 1, BT, K]
    vc, dwc, duc = _heads(v, BT, Gn), _heads(dw, BT, Gn), _heads(du, BT, Gn)
    Ac = rearrange(A, "b (n c) (h j) d -> b n h j c d", c=BT, j=Gn)
    Gc, bc = _gates(G, BT, Gn), _gates(beta, BT, Gn)
    eG = torch.exp(Gc)[..., None]
    Kb = bc[..., None] * eG * kc                                           # [B, NC, H, G, BT, K]
    Vb = bc[..., None] * vc
    dA = dwc @ Kb.transpose(-1, -2) + duc @ Vb.transpose(-1, -2)
    dKb = Ac.transpose(-1, -2) @ dwc
    dVb = Ac.transpose(-1, -2) @ duc
    strict = torch.ones(BT, BT, dtype=torch.bool, device=k.device).tril(-1)
    dL = -(Ac.transpose(-1, -2) @ dA @ Ac.transpose(-1, -2)) * strict
    KK = kc @ kc.transpose(-1, -2)                                         # [B, NC, H, 1, BT, BT]
    decay = _causal_decay(Gc, strict=True)
    R = dL * bc[..., None] * decay
    P = R * KK
    dk = bc[..., None] * eG * dKb + R @ kc + R.transpose(-1, -2) @ kc
    dv = bc[..., None] * dVb
    dbeta = (dKb * eG * kc).sum(-1) + (dVb * vc).sum(-1) + (dL * KK * decay).sum(-1)
    dG = (dKb * Kb).sum(-1) + P.sum(-1) - P.sum(-2)
    return (_flat(dk), _flat(dv), rearrange(dbeta, "b n h j c -> b (n c) (h j)"),
            rearrange(dG, "b n h j c -> b (n c) (h j)"))


def chunk_cumsum_bwd(dG: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Stage 5. dG: [B, T, HV] -> dg: [B, T, HV], the reverse cumulative sum inside each chunk:
        dg_s = sum_{c >= s, c in the chunk of s} dG_c
    """
    dGc = rearrange(dG, "b (n c) h -> b n c h", c=chunk_size)
    return rearrange(dGc.flip(2).cumsum(2).flip(2), "b n c h -> b (n c) h")


def gating_bwd(dg: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Through g = -exp(A_log) softplus(a + dt_bias): dg, a: [B, T, HV], A_log, dt_bias: [HV]
    -> da: [B, T, HV], dA_log, ddt_bias: [HV].  softplus'(x) = sigmoid(x) (1 above the threshold 20)."""
    x = a + dt_bias
    g = -torch.exp(A_log) * softplus(x)
    da = dg * -torch.exp(A_log) * torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
    return da, (dg * g).flatten(0, -2).sum(0), da.flatten(0, -2).sum(0)


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Through y = x / sqrt(sum(x^2) + eps) (last dim): dx = (dy - y (y . dy)) / sqrt(sum(x^2) + eps)."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return (dy - y * (y * dy).sum(-1, keepdim=True)) * r


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64):
    """The hand-written gradient of refgdn.chunk_gated_delta_rule, composed from the five stages.

    q, k: [B, T, H, K]  v: [B, T, HV, V]  g, beta: [B, T, HV]  do: [B, T, HV, V]  dht: [N, HV, K, V] or None
    -> dict with dq, dk ([B, T, H, K]), dv, dg, dbeta, dh0 ([N, HV, K, V], or None without initial_state),
    dA_log, ddt_bias ([HV], fused gating only). In the compute dtype (float64 for float64 inputs).

    Recompute, as fast does: G, A, w, u, h, v_new from the inputs; then stages 1-5; then the gating
    and l2norm backward and the sum of q/k gradients over each GVA group.
    """
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, False, None, None, chunk_size)
    dt = p["dtype"]
    gg = p["g"]
    if A_log is not None:
        gg = -torch.exp(A_log.to(dt)) * softplus(g.to(dt) + dt_bias.to(dt))
    qn, kn = p["q"], p["k"]
    if use_qk_l2norm_in_kernel:
        qn, kn = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (qn, kn))
    B, T, H, K = q.shape
    HV, Gn, BT = v.shape[2], p["G"], chunk_size
    do = do.to(dt)
    out = {n: torch.zeros_like(p[x]) for n, x in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"),
                                                  ("dbeta", "beta"))}
    dh0 = torch.zeros_like(p["S0"])
    for n, b, bos, eos in sequences(B, T, cu_seqlens):
        L = eos - bos
        pad = (-L) % BT
        qs, ks, vs, dos = (F.pad(x[b:b + 1, bos:eos], (0, 0, 0, 0, 0, pad)) for x in (qn, kn, p["v"], do))
        gs, bs = (F.pad(x[b:b + 1, bos:eos], (0, 0, 0, pad)) for x in (gg, p["beta"]))
        G = chunk_cumsum(gs, BT)
        A = wy_repr(ks, bs, G, BT)
        w, u = w_u(ks, vs, bs, A, G, BT)
        h, v_new, _ = state_passing(ks, w, u, G, BT, p["S0"][n:n + 1])
        dv_loc = chunk_dv_local(qs, ks, G, dos, p["scale"], BT)                                 # 1
        dS = None if dht is None else dht[n:n + 1].to(dt)
        dh, dv_new, dS0 = state_passing_bwd(qs, ks, w, G, dos, dv_loc, p["scale"], BT, dS)      # 2
        dq, dk, dw, dG = chunk_bwd_dqkwg(qs, ks, v_new, h, dh, dos, dv_new, G, p["scale"], BT)  # 3
        dk2, dv, dbeta, dG2 = wy_bwd(ks, vs, bs, G, A, dw, dv_new, BT)                         # 4
        dg = chunk_cumsum_bwd(dG + dG2, BT)                                                    # 5
        sl = (slice(b, b + 1), slice(bos, eos))
        # per value head -> per key head: sum over the GVA group ([B, T, (h j), K] -> [B, T, h, K])
        out["dq"][sl] = rearrange(dq[:, :L], "b t (h j) d -> b t h j d", j=Gn).sum(3)
        out["dk"][sl] = rearrange((dk + dk2)[:, :L], "b t (h j) d -> b t h j d", j=Gn).sum(3)
        out["dv"][sl] = dv[:, :L]
        out["dg"][sl] = dg[:, :L]
        out["dbeta"][sl] = dbeta[:, :L]
        dh0[n] = dS0[0]
    if use_qk_l2norm_in_kernel:
        out["dq"] = l2norm_bwd(p["q"], out["dq"])
        out["dk"] = l2norm_bwd(p["k"], out["dk"])
    out["dh0"] = dh0 if initial_state is not None else None
    out["dA_log"] = out["ddt_bias"] = None
    if A_log is not None:
        out["dg"], out["dA_log"], out["ddt_bias"] = gating_bwd(out["dg"], g.to(dt), A_log.to(dt), dt_bias.to(dt))
    return out
