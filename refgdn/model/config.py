"""The model configuration: Hugging Face ``Qwen3NextConfig`` field names, read from / written to config.json.

Three families (``model_type``), one decoder:

* ``qwen3_next`` (Qwen3-Next): GDN in-projections ``in_proj_qkvz`` / ``in_proj_ba``, head-interleaved;
* ``qwen3_5_text`` (Qwen3.5 dense, ``Qwen3_5ForCausalLM``): ``in_proj_qkv`` (q | k | v, the conv's own channel
  order), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; dense MLPs; the MTP layer count is ``mtp_num_hidden_layers``
  (``mtp_use_dedicated_embeddings``: the MTP head's own ``mtp.embed_tokens``; a checkpoint with that key sets it);
* ``qwen3_5_moe_text`` (Qwen3.5-MoE): the same GDN projections, every MLP a routed MoE with normalised top-k weights.

A multimodal Qwen3.5 config.json (``qwen3_5`` / ``qwen3_5_moe``, the language model under ``text_config``) is read
as its text model; ``tie_word_embeddings`` is taken from the outer config. Qwen3.5's multi-axis rotary
(``mrope_section``, ``mrope_interleaved``) is read and kept: for text, whose three position axes are equal, it is
the one-axis rotary computed here.

Only the fields this model uses are typed; any other key of a config.json (architectures,
bos_token_id, transformers_version, ...) is kept in ``extra`` and written back unchanged.
Rotary settings: transformers 5 writes ``rope_parameters = {rope_type, rope_theta,
partial_rotary_factor}``; older files (and the public Qwen3-Next checkpoints) have top-level
``rope_theta`` and ``partial_rotary_factor``. Both are read; ``rope_parameters`` is written.
Only the default (unscaled) rope is implemented: a scaled rope type raises.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

LINEAR, FULL = "linear_attention", "full_attention"
QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE = "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"
ARCHITECTURES = {QWEN3_NEXT: "Qwen3NextForCausalLM", QWEN3_5: "Qwen3_5ForCausalLM",
                 QWEN3_5_MOE: "Qwen3_5MoeForCausalLM"}
_OUTER = {"qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE}        # multimodal configs: text_config is the model
# transformers' own defaults where a family's differ from Qwen3-Next's (a config.json may leave them out)
_FAMILY_DEFAULTS: Dict[str, Dict[str, Any]] = {
    QWEN3_5: dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_key_value_heads=4, num_experts=0),
    QWEN3_5_MOE: dict(vocab_size=248320, num_hidden_layers=40, num_experts=256, num_experts_per_tok=8,
                      norm_topk_prob=True),
}   # (an absent mtp_num_hidden_layers means 1, as vLLM's Qwen3.5 MTP reads it; the head is built iff mtp.* exists)
# a preset taken as another family (preset(name, model_type=...)): what the family fixes (Qwen3.5 is dense;
# Qwen3.5-MoE routes every MLP), before the caller's other overrides
_PRESET_FAMILY: Dict[str, Dict[str, Any]] = {QWEN3_5: dict(num_experts=0),
                                             QWEN3_5_MOE: dict(decoder_sparse_step=1, mlp_only_layers=[])}


@dataclasses.dataclass
class Qwen3NextConfig:
    """Qwen3-Next hybrid decoder: GDN ("linear_attention") and gated softmax ("full_attention") layers."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: List[int] = dataclasses.field(default_factory=list)
    layer_types: Optional[List[str]] = None
    full_attention_interval: int = 4
    num_nextn_predict_layers: int = 1
    mtp_use_dedicated_embeddings: bool = False     # the MTP head's own token embedding (mtp.embed_tokens)
    model_type: str = QWEN3_NEXT
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:    # HF's rule: every full_attention_interval-th layer is full attention
            self.layer_types = [FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        self.validate()

    # --------------------------------------------------------------------------------------
    def validate(self) -> None:
        """ValueError naming the field on an inconsistent config."""
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"config.model_type must be one of {sorted(ARCHITECTURES)} (or a multimodal "
                             f"{sorted(_OUTER)} config.json), got {self.model_type!r}")
        if self.model_type == QWEN3_5 and self.num_experts:
            raise ValueError(f"config.num_experts={self.num_experts}: a {QWEN3_5} model is dense (num_experts = 0; "
                             f"{QWEN3_5_MOE} has experts)")
        if self.model_type == QWEN3_5_MOE and (not self.num_experts or self.mlp_only_layers
                                               or self.decoder_sparse_step != 1 or not self.norm_topk_prob):
            raise ValueError(f"config: every {QWEN3_5_MOE} MLP is a MoE with normalised top-k weights "
                             f"(num_experts > 0, mlp_only_layers = [], decoder_sparse_step = 1, norm_topk_prob = "
                             f"True), got num_experts={self.num_experts}, mlp_only_layers={self.mlp_only_layers}, "
                             f"decoder_sparse_step={self.decoder_sparse_step}, norm_topk_prob={self.norm_topk_prob}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "decoder_sparse_step"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"config.{name} must be a positive int, got {val!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config.layer_types must have num_hidden_layers={self.num_hidden_layers} entries, "
                             f"got {len(self.layer_types)}")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            raise ValueError(f"config.layer_types entries must be {LINEAR!r} or {FULL!r}, got {bad[0]!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads} (GQA)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config.linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads} (GVA)")
        rot = self.rotary_dim
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise ValueError(f"config.partial_rotary_factor={self.partial_rotary_factor} gives rotary dim {rot}; "
                             f"it must be even and in (0, head_dim={self.head_dim}]")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"config.num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if not isinstance(self.mtp_use_dedicated_embeddings, bool):
            raise ValueError(f"config.mtp_use_dedicated_embeddings must be a bool, "
                             f"got {self.mtp_use_dedicated_embeddings!r}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ValueError(f"config.num_nextn_predict_layers must be 0 or 1 (one MTP layer, as Qwen3-Next), "
                             f"got {self.num_nextn_predict_layers!r}")

    # derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def split_gdn_projections(self) -> bool:
        """Qwen3.5's GDN in-projections (in_proj_qkv / z / b / a) rather than Qwen3-Next's in_proj_qkvz / ba."""
        return self.model_type != QWEN3_NEXT

    @property
    def conv_dim(self) -> int:
        """D = 2 * H * K + HV * V: the GDN conv channels (q | k | v)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def is_moe_layer(self, idx: int) -> bool:
        """HF's rule (the MTP layer uses it with its own index 0, as vLLM does)."""
        return (idx not in self.mlp_only_layers and self.num_experts > 0
                and (idx + 1) % self.decoder_sparse_step == 0)

    # config.json ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Qwen3NextConfig":
        d = dict(d)
        if d.get("model_type") in _OUTER:                       # multimodal Qwen3.5: its language model
            outer, d = d, dict(d.get("text_config") or {})
            d["model_type"] = _OUTER[outer["model_type"]]
            for k in ("tie_word_embeddings", "dtype", "torch_dtype"):        # the outer config's say
                if k in outer:
                    d[k] = outer[k]
        family = d.get("model_type", QWEN3_NEXT)
        if family in (QWEN3_5, QWEN3_5_MOE):
            if "mtp_num_hidden_layers" in d:                     # Qwen3.5's name for the MTP layer count
                d["num_nextn_predict_layers"] = d.pop("mtp_num_hidden_layers")
            for k, v in _FAMILY_DEFAULTS[family].items():
                d.setdefault(k, v)
        d.pop("architectures", None)                             # to_dict writes the family's
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None)
        if rope:
            rtype = rope.get("rope_type", rope.get("type", "default"))
            if rtype != "default":
                raise ValueError(f"config rope_parameters.rope_type={rtype!r}: only the default rope is implemented")
            if "rope_theta" in rope:
                d["rope_theta"] = rope["rope_theta"]
            if "partial_rotary_factor" in rope:
                d["partial_rotary_factor"] = rope["partial_rotary_factor"]
            mrope = {k: rope[k] for k in ("mrope_section", "mrope_interleaved") if k in rope}
            if mrope:                                            # text positions: the one-axis rotary (module doc)
                d["extra"] = dict(d.get("extra", {}), rope_mrope=mrope)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = dict(d.get("extra", {}))
        extra.update({k: v for k, v in d.items() if k not in names and k != "extra"})
        if known.get("layer_types") is not None:
            known["num_hidden_layers"] = known.get("num_hidden_layers", len(known["layer_types"]))
        return cls(**known, extra=extra)

    def to_dict(self) -> Dict[str, Any]:
        """config.json of the family's text model (a multimodal Qwen3.5 config is written as its language model)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("extra", "rope_theta", "partial_rotary_factor", "full_attention_interval")}
        extra = dict(self.extra)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor, **extra.pop("rope_mrope", {})}
        if self.model_type == QWEN3_NEXT and not self.mtp_use_dedicated_embeddings:
            d.pop("mtp_use_dedicated_embeddings")                  # a Qwen3.5 field; Qwen3-Next's files lack it
        if self.model_type != QWEN3_NEXT:                          # Qwen3.5's own names; no unused MoE fields
            d["mtp_num_hidden_layers"] = d.pop("num_nextn_predict_layers")
            drop = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
            if self.model_type == QWEN3_5:
                drop += ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size")
            for k in drop:
                d.pop(k)
        out = {"architectures": [ARCHITECTURES[self.model_type]]}
        out.update(extra)
        out.update(d)
        return out

    @classmethod
    def from_json_file(cls, path: str) -> "Qwen3NextConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_json_file(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    # presets -------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "Qwen3NextConfig":
        """``"tiny"``: CPU tests (vocab 128, hidden 32, 4 layers: 3 GDN + 1 attention, dense and MoE MLPs, MTP).
        ``"bench"``: issue 9's GPU shape (hidden 2048; GDN 16 q/k heads, 32 value heads, head dim 128;
        4 layers with one full-attention layer; vocab 32K). Its MLP is dense SwiGLU with intermediate
        5632 = Qwen3-Next's active MoE width (10 experts x 512 + shared 512): the same FLOPs per token
        without a plain-torch expert loop in the timings.
        ``model_type`` among the overrides takes the preset as that family: a Qwen3.5 preset has no experts, a
        Qwen3.5-MoE one routes every MLP (then the other overrides).
        """
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        d = dict(PRESETS[name])
        d.update(_PRESET_FAMILY.get(overrides.get("model_type"), {}))
        d.update(overrides)
        return cls(**d)


PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        layer_types=[LINEAR, LINEAR, LINEAR, FULL],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=4096, num_nextn_predict_layers=1,
    ),
    "bench": dict(
        vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
        layer_types=[LINEAR, LINEAR, LINEAR, FULL],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10000000.0,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
        max_position_embeddings=262144, num_nextn_predict_layers=1,
    ),
}
