"""The model's layers, plain torch except the GDN core, which goes through the ops namespace.

Token-major layout throughout: a step's tokens are packed as ``x: [T, hidden]`` (all requests of
the step one after another, ``StepMetadata.query_start_loc`` says where each starts).

Precision: norms, softmax, router and rotary are computed in float32 (float64 for a float64
model: the truth runs) and cast back to the activation dtype, as Hugging Face's implementation does.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .. import norm as _norm
from .cache import KVCache, StepMetadata
from .config import FULL, Qwen3NextConfig

# query tokens per block in the torch attention: bounds its [block, heads, window] scores (and, where each token
# gathers its own KV rows, the [block, window, kv_heads, head_dim] gather)
ATTN_BLOCK = 256


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 tensors (truth runs), else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (Qwen3-Next / Gemma): y = x / sqrt(mean(x^2) + eps) * (1 + weight).

    x: [..., dim] -> [..., dim] in x.dtype; weight: [dim], initialised to 0 (identity scale). Runs through
    ``ops.rms_norm(..., unit_offset=True)`` (refgdn.norm: float32 inside, rounded once); ``ops`` is the model's ops
    namespace, set by Qwen3NextModel (refgdn's when None).
    """

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))
        self.ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.ops or _norm).rms_norm(x, self.weight, None, None, self.eps, unit_offset=True)


class GatedRMSNorm(nn.Module):
    """The GDN output norm, gated by z: y = weight * rmsnorm(x) * silu(z) (plain weight, initialised to 1).

    x, z: [..., dim] -> [..., dim] in x.dtype. Holds the weight (transformers' ``linear_attn.norm.weight``) and eps;
    the layer applies it through its ops namespace (``ops.rms_norm_gated``, refgdn.norm: float32 inside, rounded
    once, as fla's FusedRMSNormGated and vLLM's RMSNormGated, which transformers takes when fla is installed; its
    torch fallback also rounds the normalised x to x.dtype before the weight).
    """

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, z: torch.Tensor, ops=None) -> torch.Tensor:
        """ops: the namespace whose rms_norm_gated runs (refgdn's when None)."""
        return (ops or _norm).rms_norm_gated(x, z, self.weight, None, "silu", eps=self.eps)


class Conv1dWeight(nn.Module):
    """Holds the depthwise conv weight under HF's name and shape: ``conv1d.weight [D, 1, W]`` (no bias)."""

    def __init__(self, D: int, W: int, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(D, 1, W, dtype=dtype, device=device))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)).  x: [T, hidden] -> [T, hidden]."""

    def __init__(self, hidden: int, inter: int, dtype=None, device=None):
        super().__init__()
        f = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden, inter, **f)
        self.up_proj = nn.Linear(hidden, inter, **f)
        self.down_proj = nn.Linear(inter, hidden, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert.  x: [T, hidden] -> [T, hidden].

        p = softmax(gate(x));  (w, e) = topk(p, k);  w /= sum(w) if norm_topk_prob
        y = sum_j w_j expert_{e_j}(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

    Host-read free (capturable): every expert runs on every token, weighted by its routing weight
    (0 where not routed). That costs num_experts / top_k times the routed FLOPs: fine for the
    oracle and small expert counts, not a fast MoE.
    """

    def __init__(self, cfg: Qwen3NextConfig, dtype=None, device=None):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.top_k, self.norm_topk_prob, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, **f)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size, **f)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, **f)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, **f)

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> combine weights [T, num_experts] in x.dtype (0 for experts not routed)."""
        logits = self.gate(x)
        probs = torch.softmax(logits.to(compute_dtype(x)), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)              # [T, k]
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        return torch.zeros_like(logits).scatter(1, top_i, top_w.to(logits.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        combine = self.routing(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):                          # ascending, as HF accumulates
            out = out + expert(x) * combine[:, e:e + 1]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared


# ----------------------------------------------------------------------------------------------
# rotary
# ----------------------------------------------------------------------------------------------

class Rotary(nn.Module):
    """Partial rotary embedding (NeoX halves) on the first ``rotary_dim`` channels of each head.

    inv_freq[i] = theta ** (-2i / rotary_dim), computed in the compute dtype on the positions' device (a buffer
    would be rounded by ``model.to(bfloat16)``); cos/sin from the step's positions, once per step (:meth:`tables`),
    shared by q, k and every attention layer of the step.
    """

    def __init__(self, cfg: Qwen3NextConfig, device=None):
        super().__init__()
        self.rotary_dim, self.theta = cfg.rotary_dim, float(cfg.rope_theta)

    def inv_freq(self, dt: torch.dtype, device) -> torch.Tensor:
        rot = self.rotary_dim
        return 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=dt, device=device) / rot))

    def tables(self, positions: torch.Tensor, dt: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int -> (cos, sin): [T, 1, rotary_dim] in dt, sin's first half negated (rotate_half's
        sign, so that :meth:`apply` only swaps the halves: x * cos + swap(x) * sin, the same products)."""
        freqs = positions.to(dt)[:, None] * self.inv_freq(dt, positions.device)     # [T, rot/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]

    def apply(self, x: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, head_dim], tables: :meth:`tables` of the step's positions -> [T, heads, head_dim] in
        x.dtype (the rotated channels computed in the tables' dtype: x's values promote exactly)."""
        cos, sin = tables
        rot, half = self.rotary_dim, self.rotary_dim // 2
        xr, xp = x[..., :rot], x[..., rot:]
        swapped = torch.cat([xr[..., half:], xr[..., :half]], dim=-1)      # rotate_half, its sign in sin
        out = (xr * cos + swapped * sin).to(x.dtype)
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


# ----------------------------------------------------------------------------------------------
# token mixers
# ----------------------------------------------------------------------------------------------

class AttnStep(NamedTuple):
    """What every attention layer of a step shares, formed once per step (:func:`attn_step`)."""

    rope: Tuple[torch.Tensor, torch.Tensor]   # Rotary.tables of the step's positions
    dest: torch.Tensor                        # [T] int64: the KV row each token writes (padding: the scratch row)
    rows: torch.Tensor                        # [T] int64: the slot each token reads (padding: slot 0)
    masked: torch.Tensor                      # [T, window] bool: KV row l lies past the token's position
    scratch_row: int
    window: int
    spans: Optional[List[Tuple[int, int]]]    # prefill: each request's token range [b, e) (host ints), else None


def attn_step(meta: StepMetadata, kv: KVCache, rotary: Rotary, dt: torch.dtype,
              offsets: Optional[List[int]] = None) -> AttnStep:
    """The step's shared attention tables for KV caches laid out as ``kv`` (every attention layer of a model has the
    same num_slots / max_len), rotary tables in dt (the compute dtype). offsets: meta.query_start_loc's values on
    the host (a prefill has them): then each request's KV rows are gathered once for all of its tokens, else
    (decode, verify: a few tokens per request, no host values inside a graph) once per token."""
    window = meta.attn_window or kv.max_len
    dest = torch.where(meta.slot_mapping >= 0, meta.slot_mapping, kv.scratch_row).long()
    masked = torch.arange(window, device=meta.positions.device)[None, :] > meta.positions[:, None]   # [T, window]
    spans = None
    if offsets is not None:         # the requests' token ranges, then the padding tokens after them (if any)
        ends = list(offsets) + ([meta.num_tokens] if offsets[-1] < meta.num_tokens else [])
        spans = [(b, e) for b, e in zip(ends, ends[1:]) if e > b]
    return AttnStep(rotary.tables(meta.positions, dt), dest, meta.token_slots.clamp(min=0).long(), masked,
                    kv.scratch_row, window, spans)


class Attention(nn.Module):
    """Gated softmax attention with q/k norms, partial rotary, GQA and a KV cache in slots.

    x: [T, hidden] -> [T, hidden].  q_proj gives per head [q | gate] (head_dim each);
    o = o_proj(softmax(q k^T / sqrt(head_dim)) v * sigmoid(gate)). Causal within each request: token
    at position p sees the slot's KV rows 0..p (rows written earlier and by this step).
    """

    def __init__(self, cfg: Qwen3NextConfig, dtype=None, device=None):
        super().__init__()
        f = dict(bias=cfg.attention_bias, dtype=dtype, device=device)
        self.nh, self.kvh, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd * 2, **f)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, **f)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, **f)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, **f)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, kv: KVCache, meta: StepMetadata, rotary: Rotary,
                step: Optional[AttnStep] = None) -> torch.Tensor:
        """step: the step's :func:`attn_step` tables (formed here when None or made for another cache layout)."""
        T = x.shape[0]
        if step is None or step.scratch_row != kv.scratch_row or step.window != (meta.attn_window or kv.max_len):
            step = attn_step(meta, kv, rotary, compute_dtype(x))
        qg = rearrange(self.q_proj(x), "t (h c) -> t h c", h=self.nh)       # [T, nh, 2*hd]
        q, gate = qg[..., :self.hd], qg[..., self.hd:]
        q = rotary.apply(self.q_norm(q), step.rope)                          # [T, nh, hd]
        k = rotary.apply(self.k_norm(rearrange(self.k_proj(x), "t (h d) -> t h d", h=self.kvh)), step.rope)
        v = rearrange(self.v_proj(x), "t (h d) -> t h d", h=self.kvh)
        # write this step's K/V first (padded tokens go to the scratch row), then attend
        kv.k.index_copy_(0, step.dest, k.to(kv.k.dtype))
        kv.v.index_copy_(0, step.dest, v.to(kv.v.dtype))
        if step.spans is None:              # each token gathers its slot's rows
            parts = [(s, min(s + ATTN_BLOCK, T), s) for s in range(0, T, ATTN_BLOCK)]
        else:                               # a request's tokens share its rows (its first token's slot)
            parts = [(s, min(s + ATTN_BLOCK, e), b) for b, e in step.spans for s in range(b, e, ATTN_BLOCK)]
        blocks = [self._attend(q[s:e], step.rows[s:e] if step.spans is None else step.rows[r:r + 1],
                               step.masked[s:e], kv, step.window) for s, e, r in parts]
        o = blocks[0] if len(blocks) == 1 else torch.cat(blocks) if blocks else q.new_zeros(0, self.nh, self.hd)
        o = rearrange(o, "t h d -> t (h d)") * torch.sigmoid(rearrange(gate, "t h d -> t (h d)"))
        return self.o_proj(o)

    def _attend(self, q: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor, kv: KVCache,
                window: int) -> torch.Tensor:
        """q: [t, nh, hd], rows: [t] (each token's slot) or [1] (one slot for all t tokens), masked: [t, window]
        -> [t, nh, hd] in q.dtype (torch paged attention over the first ``window`` KV rows of the slot; masked
        rows are left out)."""
        dt = compute_dtype(q)
        G = self.nh // self.kvh
        keys = kv.k_cache[rows, :window].to(dt)                              # [r, L, kvh, hd], r = t or 1
        vals = kv.v_cache[rows, :window].to(dt)
        t = "t" if rows.shape[0] == q.shape[0] else ""                       # per-token rows, or one slot's
        if not t:
            keys, vals = keys[0], vals[0]                                    # [L, kvh, hd]
        qg = rearrange(q.to(dt), "t (h g) d -> t h g d", g=G)                # head h*G+j reads kv head h
        scores = torch.einsum(f"thgd,{t}lhd->thgl", qg, keys) * self.hd ** -0.5
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.einsum(f"thgl,{t}lhd->thgd", p, vals)
        return rearrange(o, "t h g d -> t (h g) d").to(q.dtype)


class GatedDeltaNet(nn.Module):
    """The GDN token mixer (Qwen3-Next ``linear_attn``), its core through the ops namespace.

    x: [T, hidden] -> [T, hidden].  H = linear_num_key_heads, HV = linear_num_value_heads, G = HV / H.
    Qwen3-Next: in_proj_qkvz gives, per q/k head h, [q_h (K) | k_h (K) | v (G*V) | z (G*V)]; in_proj_ba
    gives per h [b (G) | a (G)] (value head h*G + j). Qwen3.5 (config.split_gdn_projections): in_proj_qkv
    gives mixed_qkv as it is, in_proj_z, in_proj_b, in_proj_a the rest. mixed_qkv = [q | k | v]
    (D = 2HK + HV V) goes through the causal conv (silu), then q, k -> l2norm, g = -exp(A_log)
    softplus(a + dt_bias), beta = sigmoid(b), the gated delta rule, the gated RMSNorm with z, and out_proj.
    """

    def __init__(self, cfg: Qwen3NextConfig, dtype=None, device=None):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.H, self.HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.K, self.V, self.W = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.G = self.HV // self.H
        self.D = cfg.conv_dim
        self.split = cfg.split_gdn_projections
        if self.split:                                  # Qwen3.5
            self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.D, bias=False, **f)
            self.in_proj_z = nn.Linear(cfg.hidden_size, self.HV * self.V, bias=False, **f)
            self.in_proj_b = nn.Linear(cfg.hidden_size, self.HV, bias=False, **f)
            self.in_proj_a = nn.Linear(cfg.hidden_size, self.HV, bias=False, **f)
        else:                                           # Qwen3-Next
            self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.H * self.K + 2 * self.HV * self.V, bias=False,
                                          **f)
            self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.HV, bias=False, **f)
        self.conv1d = Conv1dWeight(self.D, self.W, **f)
        self.A_log = nn.Parameter(torch.zeros(self.HV, **f))
        self.dt_bias = nn.Parameter(torch.ones(self.HV, **f))
        self.norm = GatedRMSNorm(self.V, cfg.rms_norm_eps, **f)
        self.out_proj = nn.Linear(self.HV * self.V, cfg.hidden_size, bias=False, **f)

    @property
    def conv_weight(self) -> torch.Tensor:
        """[D, W] (the ops' layout) as a view of conv1d.weight [D, 1, W]."""
        return self.conv1d.weight[:, 0, :]

    def project(self, x: torch.Tensor):
        """x: [T, hidden] -> mixed_qkv [T, D], z [T, HV, V], b, a [T, HV] (Qwen3-Next: HF's head-interleaved split)."""
        H, K, V, G = self.H, self.K, self.V, self.G
        if self.split:
            z = rearrange(self.in_proj_z(x), "t (hv v) -> t hv v", v=V)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        qkvz = rearrange(self.in_proj_qkvz(x), "t (h c) -> t h c", h=H)      # c = 2K + 2GV
        q, k, v, z = torch.split(qkvz, [K, K, G * V, G * V], dim=-1)
        ba = rearrange(self.in_proj_ba(x), "t (h c) -> t h c", h=H)          # c = 2G
        b, a = torch.split(ba, [G, G], dim=-1)
        mixed = torch.cat([rearrange(q, "t h k -> t (h k)"), rearrange(k, "t h k -> t (h k)"),
                           rearrange(v, "t h (g v) -> t (h g v)", g=G)], dim=-1)   # [T, D]
        z = rearrange(z, "t h (g v) -> t (h g) v", g=G)
        b = rearrange(b, "t h g -> t (h g)")
        a = rearrange(a, "t h g -> t (h g)")
        return mixed, z, b.contiguous(), a.contiguous()

    def output(self, o: torch.Tensor, z: torch.Tensor, ops) -> torch.Tensor:
        """o, z: [T, HV, V] -> out_proj(gated_norm(o, z)) [T, hidden] (the norm through ``ops``)."""
        y = self.norm(o, z, ops)
        return self.out_proj(rearrange(y, "t h v -> t (h v)"))

    def forward(self, x: torch.Tensor, ops, gdn_cache, meta: StepMetadata, mode: str,
                has_initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
        """mode: "prefill" (ops.gdn_prefill: chunked form, varlen), "decode" (ops.gdn_decode) or "verify"
        (ops.gdn_verify). Prefill needs has_initial_state ([N] bool: the request continues from its slot's state;
        the same for every GDN layer of a step); it commits the slot's pending tokens first and writes the final
        ssm / conv state in place."""
        mixed, z, b, a = self.project(x)
        if mode == "prefill":
            if has_initial_state is None:
                raise ValueError("prefill needs has_initial_state ([N] bool) of the step")
            o = ops.gdn_prefill(mixed, a, b, self.conv_weight, None, self.A_log, self.dt_bias, gdn_cache,
                                meta.state_indices, meta.query_start_loc, has_initial_state)
        elif mode == "decode":
            o = ops.gdn_decode(mixed, a, b, self.conv_weight, None, self.A_log, self.dt_bias, gdn_cache,
                               meta.state_indices)
        elif mode == "verify":
            o = ops.gdn_verify(mixed, a, b, self.conv_weight, None, self.A_log, self.dt_bias, gdn_cache,
                               meta.state_indices, meta.query_start_loc)
        else:
            raise ValueError(f"mode must be 'prefill', 'decode' or 'verify', got {mode!r}")
        return self.output(o, z, ops)


# ----------------------------------------------------------------------------------------------
# decoder layer and MTP head
# ----------------------------------------------------------------------------------------------

class DecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + mixer(norm(x));  out = h + mlp(norm(h))."""

    def __init__(self, cfg: Qwen3NextConfig, layer_type: str, mlp_index: int, dtype=None, device=None):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.layer_type = layer_type
        if layer_type == FULL:
            self.self_attn = Attention(cfg, **f)
        else:
            self.linear_attn = GatedDeltaNet(cfg, **f)
        if cfg.is_moe_layer(mlp_index):
            self.mlp = SparseMoeBlock(cfg, **f)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, **f)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(nn.Module):
    """Qwen3-Next's multi-token-prediction head (``mtp.*``).

    x = fc([pre_fc_norm_embedding(embed(tok)); pre_fc_norm_hidden(h)]), one full-attention decoder
    layer with its own KV cache, then ``norm``; logits through the target's lm_head. embed is the target's
    ``model.embed_tokens``, or the head's own ``mtp.embed_tokens`` with ``config.mtp_use_dedicated_embeddings``.
    """

    def __init__(self, cfg: Qwen3NextConfig, dtype=None, device=None):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False, **f)
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.layers = nn.ModuleList(DecoderLayer(cfg, FULL, i, **f) for i in range(cfg.num_nextn_predict_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        if cfg.mtp_use_dedicated_embeddings:       # registered last: other heads' random init unchanged
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **f)
