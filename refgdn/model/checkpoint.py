"""Checkpoint IO: a directory of config.json + *.safetensors with Hugging Face parameter names.

Read: ``model.safetensors``, or the shards listed by ``model.safetensors.index.json``
(``weight_map``), or failing both every ``*.safetensors`` file of the directory. Experts may be stored
per expert (``mlp.experts.E.{gate,up,down}_proj.weight``: what transformers' save_pretrained and the
public checkpoints write) or fused as transformers 5 keeps them in memory
(``mlp.experts.gate_up_proj [E, 2I, hidden]``, ``mlp.experts.down_proj [E, hidden, I]``): fused
tensors are split on load. A multimodal Qwen3.5 checkpoint (``model.language_model.*``, ``model.visual.*``,
``mtp.*``, ``lm_head.weight``) loads as its text model: the language model's keys under ``model.*``, the
vision tower's left out. Strict: a missing key, an unexpected key or a shape mismatch raises
ValueError naming the key, before any weight is copied. save_pretrained writes the text model's layout
(``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM``, by config.model_type).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Optional

import torch

from .config import Qwen3NextConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LANGUAGE, _VISUAL = "model.language_model.", "model.visual."
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_tensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    if os.path.exists(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, SINGLE)):
        files = [SINGLE]
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path!r}")
    out: Dict[str, torch.Tensor] = {}
    for name in files:
        for k, v in load_file(os.path.join(path, name)).items():
            if k in out:
                raise ValueError(f"checkpoint key {k!r} appears in more than one file")
            out[k] = v
    return out


def _unfuse_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Split transformers 5's fused expert tensors into per-expert HF names."""
    out = {}
    for k, v in tensors.items():
        m = _FUSED.match(k)
        if m is None:
            out[k] = v
            continue
        prefix, kind = m.groups()
        if v.dim() != 3:
            raise ValueError(f"checkpoint key {k!r}: a fused expert tensor must be 3-D [E, ., .], got {list(v.shape)}")
        for e in range(v.shape[0]):
            if kind == "gate_up_proj":                                  # [E, 2I, hidden]: gate rows, then up rows
                gate, up = v[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:                                                       # [E, hidden, I]
                out[f"{prefix}.{e}.down_proj.weight"] = v[e]
    return out


def _text_model_keys(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A multimodal checkpoint's language model under the text model's names; its vision tower left out."""
    if not any(k.startswith(_LANGUAGE) for k in tensors):
        return tensors
    return {("model." + k[len(_LANGUAGE):] if k.startswith(_LANGUAGE) else k): v for k, v in tensors.items()
            if not k.startswith(_VISUAL)}


def load_pretrained(cls, path: str, ops=None, dtype: Optional[torch.dtype] = None, device="cpu",
                    check_values: Optional[bool] = None):
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path!r} has no config.json")
    config = Qwen3NextConfig.from_json_file(cfg_path)
    if dtype is None:
        name = config.extra.get("dtype") or config.extra.get("torch_dtype") or "float32"
        dtype = _DTYPES.get(name, torch.float32)
    tensors = _unfuse_experts(_text_model_keys(_read_tensors(path)))
    has_mtp = any(k.startswith("mtp.") for k in tensors)
    if "mtp.embed_tokens.weight" in tensors:    # the MTP head's own embedding: used where a checkpoint has it
        config.mtp_use_dedicated_embeddings = True
    # the MTP head iff the checkpoint has mtp.* weights (with num_nextn_predict_layers == 0 they are unexpected)
    model = cls(config, ops=ops, dtype=dtype, device=device, seed=None,
                mtp=bool(has_mtp and config.num_nextn_predict_layers > 0), check_values=check_values)
    params = model.hf_parameters()
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing key {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise ValueError(f"checkpoint {path!r} has unexpected key {unexpected[0]!r}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                         + ("; mtp.* weights need config.num_nextn_predict_layers = 1"
                            if unexpected[0].startswith("mtp.") else ""))
    for k, p in params.items():
        if tuple(tensors[k].shape) != tuple(p.shape):
            raise ValueError(f"checkpoint key {k!r} has shape {list(tensors[k].shape)}, the model expects "
                             f"{list(p.shape)}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[k].to(device=p.device, dtype=p.dtype))
    return model


def save_pretrained(model, path: str, max_shard_bytes: Optional[int] = None) -> None:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["dtype"] = {v: k for k, v in _DTYPES.items()}[model.dtype]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {k: p.detach().to("cpu").contiguous().clone() for k, p in model.hf_parameters().items()}
    if max_shard_bytes is None or sum(t.numel() * t.element_size() for t in tensors.values()) <= max_shard_bytes:
        save_file(tensors, os.path.join(path, SINGLE), metadata={"format": "pt"})
        return
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")
