"""Third-party check of refgdn.model's Qwen3.5 families against Hugging Face transformers' Qwen3.5.

Qwen3.5 keeps Qwen3-Next's GDN core and changes its in-projections (``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a`` instead of the head-interleaved ``in_proj_qkvz`` / ``in_proj_ba``), its MLPs
(dense in ``qwen3_5_text``, every one routed in ``qwen3_5_moe_text``), its MTP count's name
(``mtp_num_hidden_layers``) and its rotary (multi-axis, equal to the one-axis form for text). Tiny random
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` / ``Qwen3_5ForConditionalGeneration`` models are saved with
``save_pretrained`` and loaded into ``Qwen3NextModel`` (test_model_hf.py's method: transformers in float64 on its
torch fallbacks, one prompt at a time; ours one varlen prefill):

* refgdn ops, float64: relative error < 1e-10 against transformers in float64, dense and MoE, and for the
  multimodal checkpoint layout (its language model; its vision tower left out);
* fast ops, float32 (the dense model): by the conformance rule against the float64 truth, refgdn in float32 as
  the reference precision;
* the other direction: our save_pretrained of a Qwen3.5 model (with MTP weights) loads into transformers;
* transformers' own Qwen3.5 runs on fast's chunk and recurrent ops in place of fla's.
"""
from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3.5", allow_module_level=True)
mod_dense = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
mod_moe = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

from conformance.core import Check, evaluate  # noqa: E402
from refgdn.model import Qwen3NextConfig, Qwen3NextModel  # noqa: E402
from refgdn.model.config import PRESETS  # noqa: E402
from tests.test_model_hf import (DEVICE, SEED, hf_float64, randomize, run_ours,  # noqa: E402
                                 transformers_runs_on_fast)

PROMPT_LENS = (1, 9, 70)                                      # 70 > 64: two chunks in both chunked forms
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4, layer_types=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
GVA3 = dict(linear_num_value_heads=6)         # three value heads per key head, as Qwen3.5-27B's 16 / 48


def _prompts(vocab: int) -> list:
    gen = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENS]


def _hf_logits(hf, prompts) -> list:
    with torch.no_grad():
        return [hf(input_ids=p[None], use_cache=False).logits[0] for p in prompts]


def _truth(path, family: str):
    """(checkpoint dir, prompts, transformers' float64 logits per prompt, fallback call counts) of a tiny random
    model of ``family`` ("dense", "moe", "multimodal": a dense text model under a vision tower, or "dense-gva3":
    three value heads per key head)."""
    mod = mod_moe if family == "moe" else mod_dense
    mp = pytest.MonkeyPatch()
    try:
        with hf_float64(mp, mod) as calls:
            torch.manual_seed(SEED)
            if family == "moe":
                cfg = transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE)
                cls = transformers.Qwen3_5MoeForCausalLM
            elif family in ("dense", "dense-gva3"):
                text = dict(TEXT, **(GVA3 if family == "dense-gva3" else {}))
                cfg, cls = transformers.Qwen3_5TextConfig(**text), transformers.Qwen3_5ForCausalLM
            else:
                cfg = transformers.Qwen3_5Config(
                    text_config=TEXT, vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24,
                                                         out_hidden_size=32, patch_size=4))
                cls = transformers.Qwen3_5ForConditionalGeneration
            cfg._attn_implementation = "eager"
            cfg._experts_implementation = "eager"      # the per-expert loop (grouped_mm has no float64)
            hf = cls(cfg).to(torch.float64).eval()
            randomize(hf, SEED)
            hf.save_pretrained(path)
            prompts = _prompts(TEXT["vocab_size"])
            truth = _hf_logits(hf, prompts)
            counts = dict(calls)
    finally:
        mp.undo()
    return path, prompts, truth, counts


_TRUTHS: dict = {}


def _family_truth(family: str, tmp_path_factory):
    if family not in _TRUTHS:                      # one build per family for the module's tests
        _TRUTHS[family] = (family,) + _truth(tmp_path_factory.mktemp(f"hf_qwen3_5_{family}"), family)
    return _TRUTHS[family]


@pytest.fixture(scope="module", params=["dense", "moe", "multimodal", "dense-gva3"])
def truth(request, tmp_path_factory):
    return _family_truth(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense_truth(tmp_path_factory):
    return _family_truth("dense", tmp_path_factory)


def test_the_checkpoints_are_qwen3_5s(truth):
    """What the comparison rests on: transformers ran its float64 torch fallbacks (3 GDN layers per prompt), and
    the directories hold Qwen3.5's GDN projections (and, multimodal, the language model under its own prefix)."""
    family, path, prompts, logits, counts = truth
    assert counts == {"chunk": 3 * len(prompts), "conv": 3 * len(prompts)}
    from safetensors.torch import load_file
    keys = set(load_file(os.path.join(path, "model.safetensors")))
    prefix = "model.language_model." if family == "multimodal" else "model."
    assert {f"{prefix}layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} <= keys
    assert not any("in_proj_qkvz" in k for k in keys)
    assert (family == "multimodal") == any(k.startswith("model.visual.") for k in keys)


def test_config_from_transformers(truth):
    family, path, *_ = truth
    model = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=torch.float64)
    c = model.config
    assert c.model_type == ("qwen3_5_moe_text" if family == "moe" else "qwen3_5_text")
    assert c.split_gdn_projections and c.layer_types == LAYERS
    assert (c.partial_rotary_factor, c.rope_theta, c.vocab_size, c.hidden_size) == (0.5, 10000.0, 96, 32)
    assert c.extra["rope_mrope"] == {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
    want = "SparseMoeBlock" if family == "moe" else "MLP"
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [want] * 4
    assert not model.has_mtp                    # no mtp.* weights (an absent MTP count reads as vLLM's default, 1)
    assert c.num_nextn_predict_layers == 1
    written = c.to_dict()                                           # back as the family's text model
    assert written["architectures"] == [{"qwen3_5_text": "Qwen3_5ForCausalLM",
                                         "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}[c.model_type]]
    assert written["rope_parameters"]["mrope_section"] == [2, 1, 1] and "num_nextn_predict_layers" not in written
    assert Qwen3NextConfig.from_dict(written) == c


def test_refgdn_float64_matches_transformers(truth):
    family, path, prompts, logits, _ = truth
    model = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=torch.float64)
    for n, (o, t) in enumerate(zip(run_ours(model, prompts), logits)):
        rel = ((o - t).abs().max() / t.abs().max()).item()
        assert rel < 1e-10, f"{family} prompt {n} (length {len(prompts[n])}): relative error {rel:.3e}"


def _fast_against_truth(dense_truth, dtype, device, n_prompts=None):
    family, path, prompts, logits, _ = dense_truth
    prompts = prompts[:n_prompts]
    ref = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=dtype, device=device)
    fast = Qwen3NextModel.from_pretrained(path, ops="fast", dtype=dtype, device=device)
    ref_out, fast_out = run_ours(ref, prompts), run_ours(fast, prompts)
    for n in range(len(prompts)):
        res = evaluate(Check(f"logits[{n}]", fast_out[n].cpu(), logits[n], ref=ref_out[n].cpu(), dtype=dtype))
        assert res["passed"], f"prompt {n} (length {len(prompts[n])}) {dtype}: {res}"


def test_fast_float32_by_conformance_rule(dense_truth):
    """The dense model: fast's GDN path behind Qwen3.5's projections (the MoE and the multimodal prefix are the
    loading's, which the refgdn comparison covers)."""
    _fast_against_truth(dense_truth, torch.float32, DEVICE)


def test_fast_float32_gva3_by_conformance_rule(tmp_path_factory):
    """Three value heads per key head (Qwen3.5-27B's grouping, no power of two) through fast's GDN path: the one-chunk
    prompts (the multi-chunk forward at that grouping is the conformance family gva3-l2norm's, at every BT)."""
    _fast_against_truth(_family_truth("dense-gva3", tmp_path_factory), torch.float32, DEVICE, n_prompts=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bfloat16)")
def test_fast_cuda_bfloat16_by_conformance_rule(dense_truth):
    _fast_against_truth(dense_truth, torch.bfloat16, "cuda")


def test_transformers_qwen3_5_runs_on_fast_ops(dense_truth):
    """transformers' own Qwen3.5 with fast.chunk_gated_delta_rule and fast.fused_recurrent_gated_delta_rule in place
    of fla's, float32: a prompt's logits and a cached decode step's pass the conformance rule against its float64
    run (test_model_hf.py's Qwen3-Next check, on Qwen3.5's modeling module)."""
    family, path, prompts, _, _ = dense_truth
    transformers_runs_on_fast(path, transformers.Qwen3_5ForCausalLM, mod_dense, prompts[1], torch.tensor(5))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_our_qwen3_5_checkpoint_loads_into_transformers(tmp_path, model_type):
    """save_pretrained of a random Qwen3.5 model with its MTP head: the config names Qwen3.5's class and its
    mtp_num_hidden_layers; transformers (which leaves mtp.* out) gives our logits in float64; and the directory
    loads back into ours with the MTP head."""
    moe = model_type == "qwen3_5_moe_text"
    model = Qwen3NextModel(Qwen3NextConfig.preset("tiny", model_type=model_type), ops="refgdn", dtype=torch.float64,
                           seed=7)
    model.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == model_type and cfg["mtp_num_hidden_layers"] == 1
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 20)]
    ours = run_ours(model, prompts)
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    mp = pytest.MonkeyPatch()
    try:
        with hf_float64(mp, mod_moe if moe else mod_dense):
            hf = cls.from_pretrained(tmp_path, dtype=torch.float64, attn_implementation="eager",
                                     experts_implementation="eager").eval()
            theirs = _hf_logits(hf, prompts)
    finally:
        mp.undo()
    for o, t in zip(ours, theirs):
        rel = ((o - t).abs().max() / t.abs().max()).item()
        assert rel < 1e-10, f"relative error {rel:.3e}"
    back = Qwen3NextModel.from_pretrained(tmp_path, ops="refgdn", dtype=torch.float64)
    assert back.has_mtp and back.config.extra.pop("dtype") == "float64"
    assert back.config.to_dict() == model.config.to_dict()
    for (k, p), q in zip(model.hf_parameters().items(), back.hf_parameters().values()):
        assert torch.equal(p, q), k


def test_qwen3_5_config_refusals():
    with pytest.raises(ValueError, match="model_type must be one of"):
        Qwen3NextConfig.preset("tiny", model_type="qwen3_vl")
    tiny = PRESETS["tiny"]                       # (preset(..., model_type=...) adapts it; the constructor does not)
    with pytest.raises(ValueError, match="qwen3_5_text model is dense"):
        Qwen3NextConfig(**dict(tiny, model_type="qwen3_5_text"))          # the tiny preset has experts
    with pytest.raises(ValueError, match="every qwen3_5_moe_text MLP is a MoE"):
        Qwen3NextConfig(**dict(tiny, model_type="qwen3_5_moe_text"))      # decoder_sparse_step = 2 there
    with pytest.raises(ValueError, match="every qwen3_5_moe_text MLP is a MoE"):
        Qwen3NextConfig.preset("bench", model_type="qwen3_5_moe_text")    # the bench preset has no experts
