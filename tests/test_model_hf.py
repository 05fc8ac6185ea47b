"""Third-party check of refgdn.model against Hugging Face transformers' Qwen3-Next.

A tiny random ``transformers.Qwen3NextForCausalLM`` (GDN and full-attention layers, dense and MoE
MLPs) is saved with ``save_pretrained``; the directory loads into ``Qwen3NextModel`` and a varlen
batch of prompts of different lengths gives transformers' logits (transformers runs one prompt at a
time, so no padding is involved on its side):

* refgdn ops, float64: relative error < 1e-10 against transformers in float64;
* fast ops, float32 (Triton interpreter on CPU): by the conformance rule against the float64 truth,
  with refgdn in float32 as the reference precision; on a GPU also bfloat16 (dense-MLP checkpoint);
* the other direction: our save_pretrained loads into transformers with the same float64 logits.

transformers computes GDN, norms, rotary and the router in float32 internally (``.float()``,
``.to(torch.float32)``); for the float64 truth :func:`hf_float64` makes those casts keep float64
(a stand-in ``torch`` in its modeling module whose float32 is float64, and ``Tensor.float`` keeping
float64 tensors) and pins transformers' own torch fallbacks for the delta rule and the conv (never
fla), counting that they ran.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf_mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")

from conformance.core import Check, evaluate  # noqa: E402
from refgdn.model import Qwen3NextConfig, Qwen3NextModel  # noqa: E402

PROMPT_LENS = (1, 6, 23, 70)                                  # 70 > 64: two chunks in both chunked forms
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # fast ops: native on a GPU, else the interpreter
SEED = 1234


class _Float64Torch(types.ModuleType):
    """``torch`` with float32 meaning float64 (for transformers' hard-coded upcasts)."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        if name in ("float32", "float"):
            return torch.float64
        return getattr(torch, name)


@contextlib.contextmanager
def hf_float64(monkeypatch, mod=hf_mod):
    """transformers' Qwen3-Next (or the modeling module ``mod`` of another family: Qwen3.5's has the same
    functions) computing in float64 throughout, on its torch fallback paths."""
    calls = {"chunk": 0, "conv": 0}
    chunk = getattr(mod.torch_chunk_gated_delta_rule, "__wrapped__", mod.torch_chunk_gated_delta_rule)
    conv = getattr(mod.causal_conv1d_fn, "__wrapped__", mod.causal_conv1d_fn)

    def chunk_counted(*a, **k):
        calls["chunk"] += 1
        return chunk(*a, **k)

    def conv_counted(*a, **k):
        calls["conv"] += 1
        return conv(*a, **k)

    monkeypatch.setattr(mod, "torch", _Float64Torch())
    # every .float() means float64 here, integer tensors included (transformers 5.17's rotary multiplies
    # inv_freq.float() by position_ids.float(): both must land in the same dtype)
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: self.to(torch.float64))
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", chunk_counted)
    monkeypatch.setattr(mod, "causal_conv1d_fn", conv_counted)
    yield calls


def hf_config(**overrides):
    """A tiny HF config: layers [GDN, MoE] [GDN, dense] [attention, MoE] [GDN, dense (mlp_only_layers)]."""
    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, moe_intermediate_size=12, shared_expert_intermediate_size=20,
              num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1, 3],
              rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    kw.update(overrides)
    return transformers.Qwen3NextConfig(**kw)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (HF's init leaves norms at identity): norms matter in the comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                val = torch.empty(p.shape, dtype=torch.float64).uniform_(0.05, 1.0, generator=gen).log()
            elif "norm" in name:
                val = (1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.1 * torch.randn(
                    p.shape, dtype=torch.float64, generator=gen)
            else:
                val = torch.randn(p.shape, dtype=torch.float64, generator=gen) * p.shape[-1] ** -0.5
            p.copy_(val.to(p.dtype))


def make_truth(tmp_path_factory, **overrides):
    """(checkpoint dir, prompts, transformers' float64 logits per prompt, fallback call counts)."""
    mp = pytest.MonkeyPatch()
    try:
        with hf_float64(mp) as calls:
            torch.manual_seed(SEED)
            cfg = hf_config(**overrides)
            cfg._attn_implementation = "eager"
            cfg._experts_implementation = "eager"      # the per-expert loop (grouped_mm has no float64)
            hf = transformers.Qwen3NextForCausalLM(cfg).to(torch.float64).eval()
            randomize(hf, SEED)
            path = tmp_path_factory.mktemp("hf_qwen3_next")
            hf.save_pretrained(path)
            gen = torch.Generator().manual_seed(SEED + 1)
            prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
            with torch.no_grad():
                truth = [hf(input_ids=p[None], use_cache=False).logits[0] for p in prompts]
            counts = dict(calls)
    finally:
        mp.undo()
    return path, prompts, truth, counts


@pytest.fixture(scope="module")
def hf_truth(tmp_path_factory):
    return make_truth(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_truth_dense(tmp_path_factory):
    """All-dense MLPs, for bfloat16: top-k routing is discontinuous, and bfloat16 rounding flips near-tied
    expert choices, a jump that no error-proportional rule (the conformance rule) covers."""
    return make_truth(tmp_path_factory, num_experts=0)


def run_ours(model: Qwen3NextModel, prompts) -> list:
    """One varlen prefill over all prompts -> logits per prompt."""
    ids = torch.cat(prompts).to(model.device)
    logits = model(ids, seq_lens=[len(p) for p in prompts])
    return list(logits.split([len(p) for p in prompts]))


def test_transformers_ran_its_torch_fallbacks_in_float64(hf_truth):
    path, prompts, truth, counts = hf_truth
    n_gdn = 3
    assert counts["chunk"] == n_gdn * len(prompts) and counts["conv"] == n_gdn * len(prompts)
    assert all(t.dtype == torch.float64 for t in truth)


def test_config_roundtrip_from_transformers(hf_truth):
    path = hf_truth[0]
    model = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=torch.float64)
    c = model.config
    assert c.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert (c.partial_rotary_factor, c.rope_theta, c.mlp_only_layers) == (0.5, 10000.0, [1, 3])
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoeBlock", "MLP", "SparseMoeBlock",
                                                                         "MLP"]
    assert not model.has_mtp          # transformers saves no mtp.* weights
    with pytest.raises(ValueError, match="no MTP head"):
        cache = model.allocate_cache(1, 8)
        meta = model.metadata(cache, torch.zeros(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1,
                              mtp=True)
        model.mtp(cache, torch.zeros(1, dtype=torch.long), torch.zeros(1, c.hidden_size, dtype=torch.float64), meta)


def test_refgdn_float64_matches_transformers(hf_truth):
    path, prompts, truth, _ = hf_truth
    model = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=torch.float64)
    ours = run_ours(model, prompts)
    for n, (o, t) in enumerate(zip(ours, truth)):
        rel = ((o - t).abs().max() / t.abs().max()).item()
        assert rel < 1e-10, f"prompt {n} (length {len(prompts[n])}): relative error {rel:.3e}"


def test_refgdn_float64_matches_transformers_gva3(tmp_path_factory):
    """Three value heads per key head (no power of two): in_proj_qkvz / in_proj_ba interleave q, k, then the
    group's v and z per key head; refgdn's split of them against transformers' own."""
    path, prompts, truth, _ = make_truth(tmp_path_factory, linear_num_value_heads=6)
    model = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=torch.float64)
    assert model.config.linear_num_value_heads == 6
    for n, (o, t) in enumerate(zip(run_ours(model, prompts), truth)):
        rel = ((o - t).abs().max() / t.abs().max()).item()
        assert rel < 1e-10, f"prompt {n} (length {len(prompts[n])}): relative error {rel:.3e}"


def _fast_against_truth(hf_truth, dtype, device):
    path, prompts, truth, _ = hf_truth
    ref = Qwen3NextModel.from_pretrained(path, ops="refgdn", dtype=dtype, device=device)
    fast = Qwen3NextModel.from_pretrained(path, ops="fast", dtype=dtype, device=device)
    ref_out, fast_out = run_ours(ref, prompts), run_ours(fast, prompts)
    for n in range(len(prompts)):
        res = evaluate(Check(f"logits[{n}]", fast_out[n], truth[n], ref=ref_out[n], dtype=dtype))
        assert res["passed"], f"prompt {n} (length {len(prompts[n])}) {dtype}: {res}"


def test_fast_float32_by_conformance_rule(hf_truth):
    _fast_against_truth(hf_truth, torch.float32, DEVICE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bfloat16)")
def test_fast_cuda_bfloat16_dense_by_conformance_rule(hf_truth_dense):
    _fast_against_truth(hf_truth_dense, torch.bfloat16, "cuda")


def test_our_checkpoint_loads_into_transformers(tmp_path):
    """The other direction: save_pretrained of a random tiny model (with MTP weights, which transformers
    ignores) loads into transformers and gives our logits (float64)."""
    model = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="refgdn", dtype=torch.float64, seed=7)
    model.save_pretrained(tmp_path)
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 20)]
    ours = run_ours(model, prompts)
    mp = pytest.MonkeyPatch()
    try:
        with hf_float64(mp):
            hf = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,
                                                                   attn_implementation="eager",
                                                                   experts_implementation="eager").eval()
            with torch.no_grad():
                theirs = [hf(input_ids=p[None], use_cache=False).logits[0] for p in prompts]
    finally:
        mp.undo()
    for o, t in zip(ours, theirs):
        rel = ((o - t).abs().max() / t.abs().max()).item()
        assert rel < 1e-10, f"relative error {rel:.3e}"


def _hf_kwargs_filter(op):
    """How transformers hands fla's ops their arguments (its hub-kernel wrapper keeps the keywords the function
    declares: the layer passes its own kwargs, e.g. use_cache, through): the same filter around a fast op."""
    import inspect
    params = inspect.signature(op).parameters
    return lambda *a, **k: op(*a, **{n: x for n, x in k.items() if n in params})


def _hf_prefill_then_step(hf, prompt, token):
    """transformers' logits of a prompt (the chunked op) and of one cached decode step after it (the recurrent op),
    on the model's device, returned on the CPU."""
    dev = next(hf.parameters()).device
    with torch.no_grad():
        out = hf(input_ids=prompt[None].to(dev), use_cache=True)
        step = hf(input_ids=token[None, None].to(dev), past_key_values=out.past_key_values, use_cache=True)
    return out.logits[0].cpu(), step.logits[0, -1].cpu()


def test_transformers_qwen3_next_runs_on_fast_ops(hf_truth, monkeypatch):
    """The drop-in claim, from the other side: transformers' own Qwen3-Next with fast.chunk_gated_delta_rule and
    fast.fused_recurrent_gated_delta_rule in place of fla's (called with transformers' keywords, through the filter
    its hub-kernel wrapper applies to fla), float32: a prompt's logits and a cached decode step's pass the
    conformance rule against transformers' float64 run, with transformers' torch fallbacks in float32 as the
    reference precision."""
    path, prompts, _, _ = hf_truth
    transformers_runs_on_fast(path, transformers.Qwen3NextForCausalLM, hf_mod, prompts[2], torch.tensor(5))


def transformers_runs_on_fast(path, cls, mod, prompt, token) -> None:
    """test_transformers_qwen3_next_runs_on_fast_ops's check for the checkpoint ``path`` of transformers' class
    ``cls``, whose modeling module ``mod`` holds the delta-rule functions (Qwen3.5's has its own)."""
    import fast
    torch_chunk = getattr(mod.torch_chunk_gated_delta_rule, "__wrapped__", mod.torch_chunk_gated_delta_rule)
    torch_rec = getattr(mod.torch_recurrent_gated_delta_rule, "__wrapped__", mod.torch_recurrent_gated_delta_rule)
    load = dict(attn_implementation="eager", experts_implementation="eager")
    runs = {}
    for name, dtype, chunk, rec in (("truth", torch.float64, torch_chunk, torch_rec),
                                    ("ref", torch.float32, torch_chunk, torch_rec),
                                    ("fast", torch.float32, _hf_kwargs_filter(fast.chunk_gated_delta_rule),
                                     _hf_kwargs_filter(fast.fused_recurrent_gated_delta_rule))):
        mp = pytest.MonkeyPatch()
        try:
            with (hf_float64(mp, mod) if dtype == torch.float64 else contextlib.nullcontext()):
                calls = {"chunk": 0, "rec": 0}

                def counted(f, key):
                    def g(*a, **k):
                        calls[key] += 1
                        return f(*a, **k)
                    return g
                mp.setattr(mod, "torch_chunk_gated_delta_rule", counted(chunk, "chunk"))
                mp.setattr(mod, "torch_recurrent_gated_delta_rule", counted(rec, "rec"))
                hf = cls.from_pretrained(path, dtype=dtype, **load).eval()
                hf = hf.to("cpu" if dtype == torch.float64 else DEVICE)   # fast's kernels: native on a GPU
                runs[name] = _hf_prefill_then_step(hf, prompt, token)
                assert calls == {"chunk": 3, "rec": 3}, (name, calls)      # 3 GDN layers: one prefill, one step
        finally:
            mp.undo()
    for n, what in enumerate(("prompt logits", "decode-step logits")):
        res = evaluate(Check(what, runs["fast"][n], runs["truth"][n], ref=runs["ref"][n], dtype=torch.float32))
        assert res["passed"], f"{what}: {res}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transformers_gated_norm_runs_on_fast(dtype):
    """transformers' Qwen3NextRMSNormGated (the GDN layer's output norm, which a hub kernel may replace) with its
    forward patched to fast.rms_norm_gated(x, gate, self.weight, None, self.activation, eps=self.variance_epsilon):
    outputs pass the conformance rule against the module's own float64 result, with its own torch forward in
    `dtype` as the reference precision. (Not patched into the whole-model test above: there the decode step's
    largest logit error is a rounding-noise sample that swings ~2x between runs of equally accurate ops.)"""
    import fast
    gen = torch.Generator().manual_seed(SEED + 2)
    mod = hf_mod.Qwen3NextRMSNormGated(48, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.1 * torch.randn(48, generator=gen))
    x = torch.randn(3, 5, 48, generator=gen, dtype=torch.float64) * torch.logspace(-3, 2, 5, dtype=torch.float64)[
        None, :, None]
    z = 4 * torch.randn(3, 5, 48, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        mp = pytest.MonkeyPatch()
        try:
            with hf_float64(mp):
                truth = mod.double()(x, z)
        finally:
            mp.undo()
        mod = mod.to(dtype)
        ref = mod(x.to(dtype), z.to(dtype))
        mod = mod.to(DEVICE)
        y = fast.rms_norm_gated(x.to(dtype).to(DEVICE), z.to(dtype).to(DEVICE), mod.weight, None, mod.activation,
                                eps=mod.variance_epsilon)
    res = evaluate(Check("y", y.cpu(), truth, ref=ref, dtype=dtype))
    assert res["passed"], res
