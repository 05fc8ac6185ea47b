"""Qwen3NextModel: one hybrid decoder over an ops namespace (``refgdn`` or ``fast``).

Parameter names are Hugging Face's (``model.*``, ``lm_head.weight``, ``mtp.*``), so a Qwen3-Next
checkpoint directory loads as it is (:mod:`refgdn.model.checkpoint`).

Serving steps (tokens packed token-major; metadata from :func:`build_step_metadata`):

    prefill(cache, ids [T], meta)   chunked GDN form (varlen), KV written; commits: kv_lens <- seq_lens
    decode(cache, ids [N], meta)    one token per request (ops.gdn_decode); commits: kv_lens <- seq_lens
    verify(cache, ids [T], meta)    1 + k_n tokens per request (ops.gdn_verify); commits nothing
    accept(cache, state_indices, num_accepted)   keeps the first num_accepted verified tokens
    mtp(cache, ids [T], hidden [T, hidden], meta)   the MTP head; mtp_kv_lens <- seq_lens

All return the hidden state after the final norm (what the MTP head takes, as in vLLM), and
``logits(hidden)`` applies the lm_head. Length bookkeeping (padded rows never touch real slots):

    prefill / decode / accept:  mtp_kv_lens[slot] <- kv_lens[slot] (old);  kv_lens[slot] <- new length
        accept's new length is kv_lens + num_accepted (verify left kv_lens unchanged)

The MTP head (vLLM's qwen3_next_mtp): MTP position p takes (token p+1, the target's hidden at p after
its final norm). Lag rule: after any step that commits target tokens, the MTP head's KV length equals
the target's length before those tokens, so the next ``mtp`` call covers exactly them. A round:

    after prefill of x_0..x_{T-1} and sampling x_T:  mtp(ids = x_1..x_T, hidden = h_0..h_{T-1}) -> d_1
    draft steps j = 2..k (one token per request):    mtp(ids = d_{j-1}, hidden = the previous MTP output)
    verify [x_T, d_1..d_k] (positions T..T+k), sample, accept(a)
    next round's first MTP step (varlen, a tokens per request): ids = d_1..d_{a-1} and the bonus/correction
        token, hidden = the verify's hiddens of the request's first a tokens; positions resume at the first
        verified position (the draft steps' KV rows are overwritten or masked)

Every step needs fresh metadata (``metadata(...)``): the lengths move after each step.

No host reads in the steps after the argument checks (shape/dtype/device). The refgdn ops themselves
validate values on the host (they are the oracle); with ``check_values=True`` (the default for refgdn)
the model also checks metadata values on the host (slots in range and distinct, positions < max_len).
"""
from __future__ import annotations

import importlib
import math
from typing import Optional, Union

import torch
from torch import nn

from ..checks import check_cu_seqlens_cpu, host_offsets, host_offsets_known, one_host_read_scope
from .cache import KVCache, ModelCache, StepMetadata, build_step_metadata
from .config import FULL, LINEAR, Qwen3NextConfig
from .layers import DecoderLayer, MTPHead, RMSNorm, Rotary, attn_step, compute_dtype


def _resolve_ops(ops):
    if ops is None or ops == "refgdn":
        return importlib.import_module("refgdn")
    if ops == "fast":
        return importlib.import_module("fast")
    if isinstance(ops, str):
        raise ValueError(f"ops must be 'refgdn', 'fast' or an ops module, got {ops!r}")
    return ops


class _Backbone(nn.Module):
    """``model.*``: embed_tokens, layers, norm."""

    def __init__(self, cfg: Qwen3NextConfig, dtype=None, device=None):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **f)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, i, **f) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)


class Qwen3NextModel(nn.Module):
    """The Qwen3-Next hybrid decoder with an optional MTP head, written once over ``ops``.

    config: Qwen3NextConfig   ops: "refgdn" | "fast" | a module with the refgdn op names
    dtype: parameter / activation dtype (float64 for truth runs)   seed: random init (None: zeros
    and ones only, e.g. before loading weights)   mtp: build the MTP head (default: when
    config.num_nextn_predict_layers > 0)   check_values: host-check metadata values (default: ops is refgdn)
    """

    def __init__(self, config: Qwen3NextConfig, ops=None, dtype: torch.dtype = torch.float32, device="cpu",
                 seed: Optional[int] = 0, mtp: Optional[bool] = None, check_values: Optional[bool] = None):
        super().__init__()
        if not isinstance(config, Qwen3NextConfig):
            raise ValueError(f"config must be a Qwen3NextConfig, got {type(config).__name__}")
        if dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.config = config
        self.ops = _resolve_ops(ops)
        self.check_values = (self.ops.__name__ == "refgdn") if check_values is None else bool(check_values)
        f = dict(dtype=dtype, device=device)
        self.model = _Backbone(config, **f)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **f)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        want_mtp = config.num_nextn_predict_layers > 0 if mtp is None else bool(mtp)
        if want_mtp and config.num_nextn_predict_layers == 0:
            raise ValueError("mtp=True needs config.num_nextn_predict_layers = 1")
        if want_mtp:
            self._modules["mtp"] = MTPHead(config, **f)
        self.rotary = Rotary(config, device=device)
        for mod in self.modules():                   # the plain norms run through the ops namespace too
            if isinstance(mod, RMSNorm):
                mod.ops = self.ops
        self.gdn_layers = [i for i, t in enumerate(config.layer_types) if t == LINEAR]
        self.attn_layers = [i for i, t in enumerate(config.layer_types) if t == FULL]
        if seed is not None:
            self.init_random(seed)

    # The MTP head is registered as the submodule "mtp" (HF's prefix: state_dict keys mtp.*) by a
    # direct _modules entry, because ``mtp`` the method (below) runs it; ``mtp_head`` returns it.
    @property
    def mtp_head(self) -> Optional[MTPHead]:
        return self._modules.get("mtp")

    @property
    def has_mtp(self) -> bool:
        return self.mtp_head is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def hf_parameters(self) -> dict:
        """{HF name: Parameter}: the checkpoint's keys (a tied lm_head left out)."""
        return {k: p for k, p in self.named_parameters(remove_duplicate=False)
                if not (k == "lm_head.weight" and self.config.tie_word_embeddings)}

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Seeded random weights, drawn in float64 on the CPU and cast, so every dtype / device gets the
        same model up to rounding.

        Linear weights N(0, 1/fan_in); embeddings N(0, 1); zero-centred norm weights N(0, 0.1^2);
        gated-norm weights 1 + N(0, 0.1^2); A_log = log U(0.05, 1), dt_bias N(0, 0.5^2) (moderate
        decay, so a GDN state carries information across many tokens: tests see it).
        """
        gen = torch.Generator().manual_seed(int(seed))
        for name, p in self.hf_parameters().items():
            shape = p.shape
            if name.endswith("A_log"):
                val = torch.empty(shape, dtype=torch.float64).uniform_(0.05, 1.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                val = torch.randn(shape, dtype=torch.float64, generator=gen) * 0.5
            elif name.endswith("linear_attn.norm.weight"):
                val = 1.0 + 0.1 * torch.randn(shape, dtype=torch.float64, generator=gen)
            elif "norm" in name.rsplit(".", 2)[-2]:            # input_layernorm, q_norm, model.norm, ...
                val = 0.1 * torch.randn(shape, dtype=torch.float64, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                val = torch.randn(shape, dtype=torch.float64, generator=gen)
            else:                                              # linears [out, in], conv1d [D, 1, W]
                val = torch.randn(shape, dtype=torch.float64, generator=gen) * shape[-1] ** -0.5
            p.copy_(val.to(p.dtype))

    # ------------------------------------------------------------------------------------------
    # caches and metadata
    # ------------------------------------------------------------------------------------------
    @property
    def default_state_dtype(self) -> torch.dtype:
        """The GDN ssm state's dtype when none is asked for: float32 (float64 for a float64 model)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def allocate_cache(self, num_slots: int, max_len: int, max_draft: int = 0,
                       state_dtype: Optional[torch.dtype] = None) -> ModelCache:
        """Zeroed caches for ``num_slots`` requests of up to ``max_len`` positions (prompt, generated
        tokens and the drafts of a verify), with up to ``max_draft`` drafts per verify.

        GDN ssm state in ``state_dtype`` (float32; float64 for a float64 model), conv state and KV in
        the model dtype.
        """
        for name, val in (("num_slots", num_slots), ("max_len", max_len)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if not isinstance(max_draft, int) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0, got {max_draft!r}")
        c, dt, dev = self.config, self.dtype, self.device
        sdt = state_dtype or self.default_state_dtype
        err = torch.zeros(4, dtype=torch.int64, device=dev)     # one fault buffer for every GDN layer
        gdn = [self.ops.GDNStateCache.allocate(num_slots + 1, c.linear_num_key_heads, c.linear_num_value_heads,
                                               c.linear_key_head_dim, c.linear_value_head_dim,
                                               c.linear_conv_kernel_dim, max_draft, state_dtype=sdt, act_dtype=dt,
                                               device=dev, err=err)
               for _ in self.gdn_layers]
        kv = [KVCache.allocate(num_slots, max_len, c.num_key_value_heads, c.head_dim, dt, dev)
              for _ in self.attn_layers]
        mtp_kv = ([KVCache.allocate(num_slots, max_len, c.num_key_value_heads, c.head_dim, dt, dev)
                   for _ in self.mtp_head.layers] if self.has_mtp else [])
        z = dict(dtype=torch.int32, device=dev)
        return ModelCache(gdn, kv, mtp_kv, torch.zeros(num_slots + 1, **z), torch.zeros(num_slots + 1, **z),
                          num_slots, max_len, max_draft)

    def metadata(self, cache: ModelCache, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                 num_tokens: int, mtp: bool = False, position_offset: Union[int, torch.Tensor] = 0,
                 attn_window: Optional[int] = None) -> StepMetadata:
        """:func:`build_step_metadata` from the cache's target lengths (``mtp=False``) or MTP lengths."""
        lens = cache.mtp_kv_lens if mtp else cache.kv_lens
        return build_step_metadata(lens, state_indices, query_start_loc, num_tokens, cache.max_len, position_offset,
                                   attn_window)

    # ------------------------------------------------------------------------------------------
    # checks (host: shapes, dtypes, devices; values only with check_values)
    # ------------------------------------------------------------------------------------------
    def _check_step(self, cache: ModelCache, input_ids, meta: StepMetadata, mode: str) -> None:
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache must be a ModelCache (model.allocate_cache), got {type(cache).__name__}")
        if len(cache.gdn) != len(self.gdn_layers) or len(cache.kv) != len(self.attn_layers):
            raise ValueError(f"cache has {len(cache.gdn)} GDN / {len(cache.kv)} attention layers; this model has "
                             f"{len(self.gdn_layers)} / {len(self.attn_layers)}")
        if not isinstance(meta, StepMetadata):
            raise ValueError(f"meta must be a StepMetadata, got {type(meta).__name__}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype not in (
                torch.int32, torch.int64):
            raise ValueError(f"input_ids must be a 1-D int tensor [T], got "
                             f"{input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
                             f"{list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}")
        T, N = input_ids.shape[0], meta.num_reqs
        if meta.positions.shape[0] != T:
            raise ValueError(f"input_ids must have shape [T] = [{meta.positions.shape[0]}] (meta's token count), "
                             f"got [{T}]")
        if mode == "decode" and T != N:
            raise ValueError(f"decode takes one token per request: input_ids must have shape [N] = [{N}], got [{T}]")
        for name, t in zip(("input_ids",) + tuple(f"meta.{n}" for n in ("state_indices", "query_start_loc",
                           "positions", "seq_lens", "slot_mapping", "token_slots")), [input_ids] + meta.tensors()):
            if t.device != cache.device:
                raise ValueError(f"{name} must be on {cache.device} (the cache's device), got {t.device}")
        if mode == "mtp" and len(cache.mtp_kv) != len(self.mtp_head.layers):
            raise ValueError(f"cache has {len(cache.mtp_kv)} MTP KV caches, the MTP head has {len(self.mtp_head.layers)} "
                             f"layer(s): allocate the cache with this model")
        if self.check_values:
            self._check_values(cache, meta, mode, T)
            if T and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.config.vocab_size:
                raise ValueError(f"input_ids must be in [0, vocab_size={self.config.vocab_size}), got "
                                 f"[{int(input_ids.min())}, {int(input_ids.max())}]")

    def _check_values(self, cache: ModelCache, meta: StepMetadata, mode: str, T: int) -> None:
        si = meta.state_indices.tolist()                                 # host reads: validation only
        qsl = meta.query_start_loc.tolist()
        real = [s for s in si if s >= 0]
        if any(s >= cache.num_slots for s in real) or len(set(real)) != len(real):
            raise ValueError(f"meta.state_indices must be distinct slots < num_slots={cache.num_slots} "
                             f"(-1 = padded), got {si}")
        if qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])) or qsl[-1] > T:
            raise ValueError(f"meta.query_start_loc must start at 0, be non-decreasing and end <= T={T}, got {qsl}")
        for n, s in enumerate(si):
            L = qsl[n + 1] - qsl[n]
            if s >= 0 and mode == "verify" and L > 1 + cache.max_draft:
                raise ValueError(f"verify: request {n} has {L} tokens; at most 1 + max_draft = {1 + cache.max_draft}")
        limit = meta.attn_window or cache.max_len
        if bool(((meta.token_slots >= 0) & (meta.positions >= limit)).any()):
            what = f"meta.attn_window={limit}" if meta.attn_window else f"max_len={cache.max_len}: allocate a longer cache"
            raise ValueError(f"a position reaches {what} (positions up to {int(meta.positions.max())})")

    # ------------------------------------------------------------------------------------------
    # the target
    # ------------------------------------------------------------------------------------------
    def _run_target(self, cache: ModelCache, input_ids, meta: StepMetadata, mode: str) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        gi = ai = 0
        has_initial_state = None
        if mode == "prefill":           # which requests continue: once for every GDN layer
            has_initial_state = cache.kv_lens_buf[cache.safe_slots(meta.state_indices)] > 0
        step = None                     # the attention layers' shared tables: once per step, at the first one
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if layer.layer_type == FULL:
                if step is None:
                    # a prefill's request offsets, where the host has them (query_start_loc_cpu, or the GDN layers'
                    # read): a request's tokens then share its KV rows. The glue itself reads nothing.
                    known = mode == "prefill" and host_offsets_known(meta.query_start_loc)
                    step = attn_step(meta, cache.kv[ai], self.rotary, compute_dtype(x),
                                     host_offsets(meta.query_start_loc) if known else None)
                h = layer.self_attn(h, cache.kv[ai], meta, self.rotary, step)
                ai += 1
            else:
                h = layer.linear_attn(h, self.ops, cache.gdn[gi], meta, mode, has_initial_state)
                gi += 1
            x = layer.mlp_block(x + h)
        return self.model.norm(x)

    def _commit(self, cache: ModelCache, state_indices: torch.Tensor, new_lens: torch.Tensor) -> None:
        """mtp_kv_lens[slot] <- kv_lens[slot]; kv_lens[slot] <- new_lens (padded rows: scratch entry)."""
        safe = cache.safe_slots(state_indices)
        old = cache.kv_lens_buf[safe]
        cache.mtp_kv_lens_buf.index_copy_(0, safe, old)
        cache.kv_lens_buf.index_copy_(0, safe, new_lens.to(torch.int32))

    @torch.no_grad()
    def prefill(self, cache: ModelCache, input_ids: torch.Tensor, meta: StepMetadata,
                query_start_loc_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Varlen prefill.  input_ids: [T] -> hidden [T, hidden] (after the final norm).

        meta from the target lengths (``model.metadata(cache, ...)``); a request whose slot has
        kv_lens > 0 continues from its state (its pending verify tokens are committed first).
        Afterwards kv_lens[slot] = meta.seq_lens and mtp_kv_lens[slot] = the old kv_lens.
        The GDN layers' varlen ops need meta.query_start_loc's values on the host: read once for all
        layers, or taken from query_start_loc_cpu [N+1] (the same offsets on the CPU, as vLLM keeps them),
        which spares the read and its sync.
        """
        self._check_step(cache, input_ids, meta, "prefill")
        with one_host_read_scope():       # every layer's ops read query_start_loc's values once, together
            check_cu_seqlens_cpu(query_start_loc_cpu, meta.query_start_loc, "query_start_loc_cpu",
                                 "meta.query_start_loc")
            hidden = self._run_target(cache, input_ids, meta, "prefill")
        self._commit(cache, meta.state_indices, meta.seq_lens)
        return hidden

    @torch.no_grad()
    def decode(self, cache: ModelCache, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """One token per request.  input_ids: [N] -> hidden [N, hidden]; kv_lens[slot] += 1."""
        self._check_step(cache, input_ids, meta, "decode")
        hidden = self._run_target(cache, input_ids, meta, "decode")
        self._commit(cache, meta.state_indices, meta.seq_lens)
        return hidden

    @torch.no_grad()
    def verify(self, cache: ModelCache, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """1 + k_n tokens per request (the last sampled token and the drafts).  input_ids: [T] -> hidden [T, hidden].

        KV rows and GDN pending tokens are written for all of them; nothing is committed (kv_lens
        unchanged) until :meth:`accept`, which must follow before the slots' next step (the GDN layers
        count every verified token as accepted until told otherwise, the KV lengths count none).
        """
        self._check_step(cache, input_ids, meta, "verify")
        return self._run_target(cache, input_ids, meta, "verify")

    @torch.no_grad()
    def accept(self, cache: ModelCache, state_indices: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep the first ``num_accepted[n]`` tokens of request n's last verify (1 <= num_accepted <= 1 + k_n).

        state_indices, num_accepted: [N] int (device; -1 = padded row, ignored)

            every GDN layer: ops.gdn_accept;  mtp_kv_lens[slot] <- kv_lens[slot];
            kv_lens[slot] <- kv_lens[slot] + num_accepted[n]
        """
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache must be a ModelCache, got {type(cache).__name__}")
        for name, t in (("state_indices", state_indices), ("num_accepted", num_accepted)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be a 1-D int32/int64 tensor [N]")
            if t.device != cache.device:
                raise ValueError(f"{name} must be on {cache.device}, got {t.device}")
        if num_accepted.shape != state_indices.shape:
            raise ValueError(f"num_accepted must have shape [N] = [{state_indices.shape[0]}], "
                             f"got [{num_accepted.shape[0]}]")
        for gc in cache.gdn:
            self.ops.gdn_accept(gc, state_indices, num_accepted)
        real = state_indices >= 0
        safe = torch.where(real, state_indices, cache.num_slots).long()
        self._commit(cache, state_indices, torch.where(real, cache.kv_lens_buf[safe] + num_accepted.to(torch.int32), 0))

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] (after the final norm) -> logits [T, vocab] in the model dtype."""
        return self.lm_head(hidden)

    # ------------------------------------------------------------------------------------------
    # the MTP head
    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def mtp(self, cache: ModelCache, input_ids: torch.Tensor, hidden: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """One MTP step.  input_ids: [T] (token p+1 for position p), hidden: [T, hidden] (the target's
        hidden at p, after its final norm, or the MTP's own output for later draft steps)
        -> MTP hidden [T, hidden] (after mtp.norm; ``logits()`` gives the draft logits).

        meta from the MTP lengths (``model.metadata(cache, ..., mtp=True)``); afterwards
        mtp_kv_lens[slot] = meta.seq_lens.

            x = fc([pre_fc_norm_embedding(embed(ids)); pre_fc_norm_hidden(hidden)]);  x = layer(x);  norm(x)
        """
        if not self.has_mtp:
            raise ValueError("this model has no MTP head (the checkpoint has no mtp.* weights or "
                             "config.num_nextn_predict_layers == 0): it cannot draft")
        self._check_step(cache, input_ids, meta, "mtp")
        if not isinstance(hidden, torch.Tensor) or hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"hidden must have shape [T, hidden] = [{input_ids.shape[0]}, {self.config.hidden_size}], "
                             f"got {list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
        head = self.mtp_head
        embed = head.embed_tokens if self.config.mtp_use_dedicated_embeddings else self.model.embed_tokens
        e = head.pre_fc_norm_embedding(embed(input_ids))
        h = head.pre_fc_norm_hidden(hidden.to(self.dtype))
        x = head.fc(torch.cat([e, h], dim=-1))
        step = attn_step(meta, cache.mtp_kv[0], self.rotary, compute_dtype(x)) if cache.mtp_kv else None
        for layer, kv in zip(head.layers, cache.mtp_kv):
            x = layer.mlp_block(x + layer.self_attn(layer.input_layernorm(x), kv, meta, self.rotary, step))
        cache.mtp_kv_lens_buf.index_copy_(0, cache.safe_slots(meta.state_indices), meta.seq_lens)
        return head.norm(x)

    # ------------------------------------------------------------------------------------------
    # convenience: whole prompts, no serving state kept
    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, seq_lens=None) -> torch.Tensor:
        """Logits of whole prompts, through a throw-away cache and one varlen prefill.

        input_ids: [B, T] (every row full) or [T_total] packed with ``seq_lens`` (host ints)
        -> logits [B, T, vocab] or [T_total, vocab].
        """
        if seq_lens is None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
                raise ValueError("input_ids must be [B, T] (or packed [T_total] with seq_lens)")
            B, T = input_ids.shape
            lens, ids = [T] * B, input_ids.reshape(-1)
        else:
            lens, ids = [int(n) for n in seq_lens], input_ids
            if ids.dim() != 1 or sum(lens) != ids.shape[0]:
                raise ValueError(f"packed input_ids must be [sum(seq_lens)] = [{sum(lens)}], got {list(ids.shape)}")
        cache = self.allocate_cache(len(lens), max(max(lens), 1))
        dev = self.device
        qsl_cpu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        qsl = qsl_cpu.to(dev)
        si = torch.arange(len(lens), dtype=torch.int32, device=dev)
        meta = self.metadata(cache, si, qsl, ids.shape[0])
        logits = self.logits(self.prefill(cache, ids.to(dev), meta, qsl_cpu))
        return logits.view(len(lens), lens[0], -1) if seq_lens is None else logits

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, ops=None, dtype: Optional[torch.dtype] = None, device="cpu",
                        check_values: Optional[bool] = None) -> "Qwen3NextModel":
        """Load a directory of config.json + *.safetensors (HF names; sharded with an index or not).

        The MTP head is built iff the checkpoint has ``mtp.*`` weights. Missing or unexpected keys and
        shape mismatches raise ValueError naming the key. dtype: default the config's ``dtype`` /
        ``torch_dtype`` if any, else float32.
        """
        from .checkpoint import load_pretrained
        return load_pretrained(cls, path, ops=ops, dtype=dtype, device=device, check_values=check_values)

    def save_pretrained(self, path: str, max_shard_bytes: Optional[int] = None) -> None:
        """Write config.json and model.safetensors (or shards + model.safetensors.index.json)."""
        from .checkpoint import save_pretrained
        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)

    def extra_repr(self) -> str:
        return f"ops={self.ops.__name__}, mtp={self.has_mtp}"


def num_params(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())
