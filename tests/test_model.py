"""refgdn.model on the CPU: serving steps agree with each other, checkpoints, metadata.

* Consistency (refgdn ops, float64): prefill of whole prompts == prefill of a prefix + decode token by
  token == prefix + one verify of the rest + accept == prefix + a continuing prefill; logits and every
  cache (GDN ssm / conv states, KV rows, lengths). Partial acceptance rolls back to a fresh prefill of
  the accepted tokens. The MTP head over many tokens at once == one token at a time.
* fast ops (float32, Triton interpreter): the same decode / verify / accept steps by the conformance rule
  against the float64 truth, refgdn float32 as the reference precision.
* Checkpoints: save / load round trip (single file and shards), fused expert tensors, errors naming
  the key; config.json round trip.
* Metadata: values against a host loop; built and used without host reads (meta-device tensors,
  and the model's glue code under a guard that fails on any host read).
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conformance.core import Check, evaluate
from refgdn.model import ModelCache, Qwen3NextConfig, Qwen3NextModel, build_step_metadata
from refgdn.serving import committed_state

I32 = torch.int32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # fast ops: native on a GPU, else the interpreter


def tiny(dtype=torch.float64, ops="refgdn", seed=0, **kw):
    return Qwen3NextModel(Qwen3NextConfig.preset("tiny", **kw), ops=ops, dtype=dtype, seed=seed)


def ids_of(lens, vocab=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lens]


def qsl_of(counts):
    return torch.tensor([0] + list(counts)).cumsum(0).to(I32)


def step(model, cache, slots, chunks, mode):
    """One step over requests (slot s_n gets tokens chunks[n]; an empty chunk -> padded row in decode)."""
    if mode == "decode":
        si = torch.tensor([s if len(c) else -1 for s, c in zip(slots, chunks)], dtype=I32)
        ids = torch.cat([c if len(c) else torch.zeros(1, dtype=torch.long) for c in chunks])
        qsl = torch.arange(len(slots) + 1, dtype=I32)
    else:
        si = torch.tensor(slots, dtype=I32)
        ids = torch.cat(chunks)
        qsl = qsl_of([len(c) for c in chunks])
    dev = model.device
    meta = model.metadata(cache, si.to(dev), qsl.to(dev), ids.shape[0])
    hidden = getattr(model, mode)(cache, ids.to(dev), meta)
    return model.logits(hidden), qsl


def assert_close(a, b, what, rel=1e-10):
    scale = max(b.abs().max().item(), 1e-30) if b.numel() else 1.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert err <= rel * scale, f"{what}: error {err:.3e} (scale {scale:.3e})"


def assert_caches_equal(model, c1: ModelCache, c2: ModelCache, slots, rel=1e-10, mtp=False):
    """Committed GDN states, conv windows, KV rows below the lengths, and lengths."""
    idx = torch.tensor(slots)
    assert torch.equal(c1.kv_lens[idx], c2.kv_lens[idx]), (c1.kv_lens, c2.kv_lens)
    for i, (g1, g2) in enumerate(zip(c1.gdn, c2.gdn)):
        s1, w1 = committed_state(g1, slots)
        s2, w2 = committed_state(g2, slots)
        assert_close(s1, s2, f"gdn layer {i} ssm state", rel)
        assert_close(w1, w2, f"gdn layer {i} conv window", rel)
    pairs = [(c1.kv, c2.kv, c1.kv_lens)] + ([(c1.mtp_kv, c2.mtp_kv, c1.mtp_kv_lens)] if mtp else [])
    if mtp:
        assert torch.equal(c1.mtp_kv_lens[idx], c2.mtp_kv_lens[idx])
    for kvs1, kvs2, lens in pairs:
        for j, (k1, k2) in enumerate(zip(kvs1, kvs2)):
            for s in slots:
                L = int(lens[s])
                assert_close(k1.k_cache[s, :L], k2.k_cache[s, :L], f"kv layer {j} slot {s} k", rel)
                assert_close(k1.v_cache[s, :L], k2.v_cache[s, :L], f"kv layer {j} slot {s} v", rel)


# ----------------------------------------------------------------------------------------------
# consistency of the serving steps (float64 oracle)
# ----------------------------------------------------------------------------------------------

LENS = (9, 14, 5)
PREFIX = (4, 6, 1)
SLOTS = (2, 0, 3)           # not 0..N-1: slot mapping matters; slot 1 stays unused
MAXLEN = 24


@pytest.fixture(scope="module")
def model64():
    return tiny()


@pytest.fixture(scope="module")
def full_run(model64):
    prompts = ids_of(LENS)
    cache = model64.allocate_cache(4, MAXLEN, max_draft=max(LENS))
    logits, qsl = step(model64, cache, SLOTS, prompts, "prefill")
    per_req = list(logits.split(list(LENS)))
    return prompts, cache, per_req


def prefix_cache(model, prompts, max_draft):
    cache = model.allocate_cache(4, MAXLEN, max_draft=max_draft)
    logits, _ = step(model, cache, SLOTS, [p[:n] for p, n in zip(prompts, PREFIX)], "prefill")
    return cache, list(logits.split(list(PREFIX)))


def test_whole_prompt_logits_do_not_depend_on_batching(model64, full_run):
    prompts, _, per_req = full_run
    for p, ref in zip(prompts, per_req):
        alone = model64(p[None])[0]
        assert_close(alone, ref, "prompt alone vs in a varlen batch", 1e-12)


def test_prefix_then_decode_token_by_token(model64, full_run):
    prompts, full_cache, full_logits = full_run
    cache, pre_logits = prefix_cache(model64, prompts, 0)
    for n in range(len(LENS)):
        assert_close(pre_logits[n], full_logits[n][:PREFIX[n]], f"prefix logits {n}")
    for t in range(max(L - P for L, P in zip(LENS, PREFIX))):
        pos = [P + t for P in PREFIX]
        chunks = [p[q:q + 1] if q < len(p) else p[:0] for p, q in zip(prompts, pos)]
        logits, _ = step(model64, cache, SLOTS, chunks, "decode")
        for n, q in enumerate(pos):
            if q < LENS[n]:        # padded rows (finished requests) are ignored
                assert_close(logits[n], full_logits[n][q], f"decode request {n} position {q}")
    assert_caches_equal(model64, cache, full_cache, list(SLOTS))


def test_prefix_then_verify_rest_then_accept_all(model64, full_run):
    prompts, full_cache, full_logits = full_run
    cache, _ = prefix_cache(model64, prompts, max(L - P for L, P in zip(LENS, PREFIX)) - 1)
    rest = [p[P:] for p, P in zip(prompts, PREFIX)]
    logits, qsl = step(model64, cache, SLOTS, rest, "verify")
    for n, lg in enumerate(logits.split([len(r) for r in rest])):
        assert_close(lg, full_logits[n][PREFIX[n]:], f"verify logits {n}")
    assert torch.equal(cache.kv_lens[list(SLOTS)], torch.tensor(PREFIX, dtype=I32))   # nothing committed yet
    model64.accept(cache, torch.tensor(SLOTS, dtype=I32), torch.tensor([len(r) for r in rest], dtype=I32))
    assert_caches_equal(model64, cache, full_cache, list(SLOTS))


def test_prefix_then_continuing_prefill(model64, full_run):
    prompts, full_cache, full_logits = full_run
    cache, _ = prefix_cache(model64, prompts, 0)
    rest = [p[P:] for p, P in zip(prompts, PREFIX)]
    logits, _ = step(model64, cache, SLOTS, rest, "prefill")
    for n, lg in enumerate(logits.split([len(r) for r in rest])):
        assert_close(lg, full_logits[n][PREFIX[n]:], f"continued prefill logits {n}")
    assert_caches_equal(model64, cache, full_cache, list(SLOTS))


def test_partial_accept_rolls_back_to_the_accepted_prefix(model64):
    """verify 1+k tokens, keep a few: caches equal a fresh prefill of the kept tokens, and the next
    decode gives the same logits (stale KV rows and pending GDN tokens are invisible)."""
    prompts = ids_of((11, 12, 10), seed=3)
    pre = [p[:5] for p in prompts]
    drafts = [p[5:] for p in prompts]                     # 6, 7, 5 tokens: 1 + k with k = 5, 6, 4
    accepted = [1, 4, 5]
    cache = model64.allocate_cache(4, MAXLEN, max_draft=6)
    step(model64, cache, SLOTS, pre, "prefill")
    step(model64, cache, SLOTS, drafts, "verify")
    model64.accept(cache, torch.tensor(SLOTS, dtype=I32), torch.tensor(accepted, dtype=I32))
    fresh = model64.allocate_cache(4, MAXLEN, max_draft=6)
    step(model64, fresh, SLOTS, [p[:5 + a] for p, a in zip(prompts, accepted)], "prefill")
    assert_caches_equal(model64, cache, fresh, list(SLOTS))
    nxt = [torch.tensor([7]), torch.tensor([8]), torch.tensor([9])]
    l1, _ = step(model64, cache, SLOTS, nxt, "decode")
    l2, _ = step(model64, fresh, SLOTS, nxt, "decode")
    assert_close(l1, l2, "decode after partial accept vs after a fresh prefill")
    # a second round: verify on top of the rolled-back slot, then accept everything
    more = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    l1, _ = step(model64, cache, SLOTS, more, "verify")
    l2, _ = step(model64, fresh, SLOTS, more, "prefill")
    assert_close(l1, l2, "second verify vs prefill")
    model64.accept(cache, torch.tensor(SLOTS, dtype=I32), torch.tensor([3, 1, 2], dtype=I32))
    assert_caches_equal(model64, cache, fresh, list(SLOTS))


def test_mtp_many_tokens_at_once_equals_one_at_a_time(model64):
    """The MTP head's catch-up step (varlen) == the same tokens one per step; lag rule of mtp_kv_lens."""
    prompts = ids_of((7, 3), seed=5)
    slots = [1, 3]
    cache = model64.allocate_cache(4, MAXLEN, max_draft=2)
    si = torch.tensor(slots, dtype=I32)
    qsl = qsl_of([7, 3])
    ids = torch.cat(prompts)
    hidden = model64.prefill(cache, ids, model64.metadata(cache, si, qsl, 10))
    assert torch.equal(cache.kv_lens[slots], torch.tensor([7, 3], dtype=I32))
    assert torch.equal(cache.mtp_kv_lens[slots], torch.tensor([0, 0], dtype=I32))   # lags the prefill
    nxt = torch.tensor([11, 12])                               # "sampled" tokens after each prompt
    shifted = torch.cat([prompts[0][1:], nxt[:1], prompts[1][1:], nxt[1:]])
    c1 = cache.clone()
    out_all = model64.mtp(c1, shifted, hidden, model64.metadata(c1, si, qsl, 10, mtp=True))
    assert torch.equal(c1.mtp_kv_lens[slots], torch.tensor([7, 3], dtype=I32))
    c2 = cache.clone()
    outs = {0: [], 1: []}
    for t in range(7):
        live = [t < 7, t < 3]
        si_t = torch.tensor([s if ok else -1 for s, ok in zip(slots, live)], dtype=I32)
        tok = torch.stack([shifted[min(t, 6)], shifted[7 + min(t, 2)]])
        hid = torch.stack([hidden[min(t, 6)], hidden[7 + min(t, 2)]])
        o = model64.mtp(c2, tok, hid, model64.metadata(c2, si_t, torch.arange(3, dtype=I32), 2, mtp=True))
        for n in range(2):
            if live[n]:
                outs[n].append(o[n])
    assert_close(torch.stack(outs[0] + outs[1]), out_all, "mtp one-at-a-time vs varlen")
    assert_caches_equal(model64, c1, c2, slots, mtp=True)
    assert model64.logits(out_all).shape == (10, 128)
    # accept after a verify: mtp_kv_lens <- the target length before the accepted tokens
    c3 = cache.clone()
    step(model64, c3, slots, [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], "verify")
    model64.accept(c3, si, torch.tensor([2, 1], dtype=I32))
    assert torch.equal(c3.kv_lens[slots], torch.tensor([9, 4], dtype=I32))
    assert torch.equal(c3.mtp_kv_lens[slots], torch.tensor([7, 3], dtype=I32))


# ----------------------------------------------------------------------------------------------
# fast ops through the same model (float32, interpreter) by the conformance rule
# ----------------------------------------------------------------------------------------------

def _serving_run(model, lens=(6, 3)):
    """prefill, decode, verify + partial accept, decode, verify + accept, a continuing prefill (commits the
    pending tokens first): logits of every step and the final states."""
    prompts = ids_of(lens, seed=11, vocab=model.config.vocab_size)
    slots = [1, 0]
    dev = model.device
    si = torch.tensor(slots, dtype=I32, device=dev)
    cache = model.allocate_cache(3, max(lens) + 12, max_draft=3)
    outs = [step(model, cache, slots, prompts, "prefill")[0]]
    outs.append(step(model, cache, slots, [torch.tensor([5]), torch.tensor([6])], "decode")[0])
    outs.append(step(model, cache, slots, [torch.tensor([7, 8, 9, 10]), torch.tensor([11, 12])], "verify")[0])
    model.accept(cache, si, torch.tensor([2, 2], dtype=I32, device=dev))
    outs.append(step(model, cache, slots, [torch.tensor([13]), torch.tensor([14])], "decode")[0])
    outs.append(step(model, cache, slots, [torch.tensor([15, 16]), torch.tensor([17, 18])], "verify")[0])
    model.accept(cache, si, torch.tensor([1, 2], dtype=I32, device=dev))
    outs.append(step(model, cache, slots, [torch.tensor([19, 20, 21]), torch.tensor([22])], "prefill")[0])
    states = [torch.cat([x.reshape(-1) for x in committed_state(g, slots)]) for g in cache.gdn]
    return [o.cpu() for o in outs], [x.cpu() for x in states], cache.kv_lens.cpu()


def _fast_serving_by_rule(preset, dtype, device, lens=(6, 3)):
    # bfloat16: dense MLPs only (rounding flips near-tied top-k expert choices: a jump no error-proportional
    # rule covers); the bench preset is dense anyway
    cfg = Qwen3NextConfig.preset(preset, **({"num_experts": 0} if dtype == torch.bfloat16 else {}))
    models = {}
    for name, ops, dt in (("truth", "refgdn", torch.float64), ("ref", "refgdn", dtype), ("fast", "fast", dtype)):
        models[name] = Qwen3NextModel(cfg, ops, dt, device, seed=0 if name == "truth" else None)
        if name != "truth":            # the same weights, rounded (one random init: the bench shape is large)
            models[name].load_state_dict(models["truth"].state_dict())
    truth, t_states, t_lens = _serving_run(models["truth"], lens)
    ref, r_states, _ = _serving_run(models["ref"], lens)
    fast, f_states, f_lens = _serving_run(models["fast"], lens)
    assert torch.equal(f_lens, t_lens)
    names = ["prefill", "decode", "verify", "decode after accept", "verify 2", "prefill after accept"]
    for name, f, r, t in zip(names, fast, ref, truth):
        res = evaluate(Check(name, f, t, ref=r, dtype=dtype))
        assert res["passed"], f"{name} logits ({preset}, {dtype}, {device}): {res}"
    for i, (f, r, t) in enumerate(zip(f_states, r_states, t_states)):
        res = evaluate(Check(f"gdn layer {i} state", f, t, ref=r, dtype=dtype))
        assert res["passed"], f"gdn layer {i} committed state ({preset}, {dtype}, {device}): {res}"


def test_fast_serving_steps_by_conformance_rule():
    _fast_serving_by_rule("tiny", torch.float32, DEVICE)


_GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="the bench shape needs a GPU")


@pytest.mark.parametrize("preset,lens,dtype", [
    pytest.param("tiny", (6, 3), torch.bfloat16, id="tiny-bf16"),
    pytest.param("bench", (70, 33), torch.float32, marks=_GPU_ONLY, id="bench-fp32"),
    pytest.param("bench", (70, 33), torch.bfloat16, marks=_GPU_ONLY, id="bench-bf16")])
def test_fast_serving_steps_wider(preset, lens, dtype):
    """bfloat16 (on CPU in the interpreter, its fp32 -> bf16 casts rounding to nearest even as a GPU's do:
    conftest), and on a GPU the bench shape (hidden 2048, GDN 16/32 heads of 128, vocab 32K)."""
    _fast_serving_by_rule(preset, dtype, DEVICE, lens)


# ----------------------------------------------------------------------------------------------
# checkpoints and config
# ----------------------------------------------------------------------------------------------

def test_save_load_roundtrip(tmp_path, model64):
    model64.save_pretrained(tmp_path / "one")
    assert sorted(os.listdir(tmp_path / "one")) == ["config.json", "model.safetensors"]
    model64.save_pretrained(tmp_path / "sharded", max_shard_bytes=20_000)
    shards = [n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    ids = ids_of((8,), seed=2)[0][None]
    want = model64(ids)
    for sub in ("one", "sharded"):
        m = Qwen3NextModel.from_pretrained(tmp_path / sub)
        assert m.dtype == torch.float64 and m.has_mtp
        for (k1, v1), (k2, v2) in zip(model64.state_dict().items(), m.state_dict().items()):
            assert k1 == k2 and torch.equal(v1, v2), k1
        assert torch.equal(m(ids), want)


def test_checkpoint_errors_name_the_key(tmp_path, model64):
    model64.save_pretrained(tmp_path / "good")
    good = load_file(tmp_path / "good" / "model.safetensors")
    cfg = (tmp_path / "good" / "config.json").read_text()

    def write(name, tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(cfg)
        save_file(tensors, d / "model.safetensors")
        return d

    key = "model.layers.1.linear_attn.in_proj_ba.weight"
    missing = {k: v for k, v in good.items() if k != key}
    with pytest.raises(ValueError, match="missing key 'model.layers.1.linear_attn.in_proj_ba.weight'"):
        Qwen3NextModel.from_pretrained(write("missing", missing))
    extra = dict(good, **{"model.layers.0.linear_attn.bogus": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected key 'model.layers.0.linear_attn.bogus'"):
        Qwen3NextModel.from_pretrained(write("extra", extra))
    bad = dict(good, **{"model.layers.3.self_attn.k_norm.weight": torch.zeros(15, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"'model.layers.3.self_attn.k_norm.weight' has shape \[15\]"):
        Qwen3NextModel.from_pretrained(write("shape", bad))
    no_mtp = Qwen3NextModel.from_pretrained(write("nomtp", {k: v for k, v in good.items() if not k.startswith("mtp.")}))
    assert not no_mtp.has_mtp and no_mtp.mtp_head is None
    c = no_mtp.allocate_cache(1, 4)
    assert c.mtp_kv == []
    meta = no_mtp.metadata(c, torch.zeros(1, dtype=I32), torch.tensor([0, 1], dtype=I32), 1, mtp=True)
    with pytest.raises(ValueError, match="no MTP head"):
        no_mtp.mtp(c, torch.zeros(1, dtype=torch.long), torch.zeros(1, 32, dtype=torch.float64), meta)


def test_fused_expert_tensors_load(tmp_path, model64):
    """transformers 5 keeps experts fused (gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I])."""
    model64.save_pretrained(tmp_path / "a")
    t = load_file(tmp_path / "a" / "model.safetensors")
    fused = {}
    for k, v in t.items():
        if ".mlp.experts." not in k:
            fused[k] = v
    for layer in (1, 3):
        p = f"model.layers.{layer}.mlp.experts"
        E = model64.config.num_experts
        fused[f"{p}.gate_up_proj"] = torch.stack(                       # [E, 2I, hidden]: gate rows, up rows
            [torch.cat([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])
        fused[f"{p}.down_proj"] = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file(fused, d / "model.safetensors")
    m = Qwen3NextModel.from_pretrained(d)
    for (k1, v1), (k2, v2) in zip(model64.state_dict().items(), m.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1


def test_config_roundtrip_and_legacy_rope_fields():
    cfg = Qwen3NextConfig.preset("tiny")
    assert Qwen3NextConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == Qwen3NextConfig.from_dict(cfg.to_dict())
    back = Qwen3NextConfig.from_dict(cfg.to_dict())
    for f in ("layer_types", "rope_theta", "partial_rotary_factor", "num_experts", "mlp_only_layers", "head_dim"):
        assert getattr(back, f) == getattr(cfg, f), f
    legacy = {k: v for k, v in cfg.to_dict().items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=5e6, partial_rotary_factor=0.25, full_attention_interval=2)
    old = Qwen3NextConfig.from_dict(legacy)
    assert (old.rope_theta, old.partial_rotary_factor) == (5e6, 0.25)
    assert old.layer_types == ["linear_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3NextConfig.preset("tiny", layer_types=["linear_attention"] * 3)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        Qwen3NextConfig.preset("tiny", linear_num_value_heads=3)
    with pytest.raises(ValueError, match="rope_type"):
        Qwen3NextConfig.from_dict(dict(cfg.to_dict(), rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    bench = Qwen3NextConfig.preset("bench")
    assert (bench.hidden_size, bench.linear_num_key_heads, bench.linear_num_value_heads, bench.linear_key_head_dim,
            bench.vocab_size, bench.layer_types.count("full_attention"), bench.num_hidden_layers) == (
        2048, 16, 32, 128, 32768, 1, 4)


# ----------------------------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------------------------

def test_metadata_values_against_a_host_loop():
    kv_lens = torch.tensor([5, 0, 9, 2, 7], dtype=I32)
    si = torch.tensor([2, -1, 0, 4], dtype=I32)
    counts = [3, 2, 1, 4]
    qsl = qsl_of(counts)
    T, max_len = 12, 12                           # 2 trailing padding tokens; slot 4 runs past max_len
    offset = torch.tensor([1, 0, 2, 0], dtype=I32)
    meta = build_step_metadata(kv_lens, si, qsl, T, max_len, position_offset=offset)
    pos, sm, ts, sl = [0] * T, [-1] * T, [-1] * T, []
    for n, s in enumerate(si.tolist()):
        start = int(kv_lens[s]) + int(offset[n]) if s >= 0 else 0
        sl.append(start + counts[n] if s >= 0 else 0)
        for j in range(counts[n]):
            t = int(qsl[n]) + j
            if s >= 0:
                pos[t], ts[t] = start + j, s
                sm[t] = s * max_len + start + j if start + j < max_len else -1
    assert meta.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == sm
    assert meta.token_slots.tolist() == ts
    assert meta.seq_lens.tolist() == sl
    assert all(t.dtype == I32 for t in meta.tensors())
    scalar = build_step_metadata(kv_lens, si, qsl, T, max_len, position_offset=torch.tensor(3, dtype=I32))
    assert scalar.positions.tolist()[0] == int(kv_lens[2]) + 3
    with pytest.raises(ValueError, match="query_start_loc"):
        build_step_metadata(kv_lens, si, qsl[:-1], T, max_len)


def test_metadata_on_meta_device_reads_no_values():
    """meta tensors have no values: any host read (.item, .tolist, bool) would raise."""
    d = "meta"
    meta = build_step_metadata(torch.empty(8, dtype=I32, device=d), torch.empty(3, dtype=I32, device=d),
                               torch.empty(4, dtype=I32, device=d), 7, 32,
                               position_offset=torch.empty((), dtype=I32, device=d))
    assert all(t.device.type == "meta" for t in meta.tensors())
    assert meta.positions.shape == (7,) and meta.seq_lens.shape == (3,)


class _StubOps:
    """Shape-correct stand-ins for the GDN ops (they are tested elsewhere): isolates the model's own code."""
    __name__ = "stub"
    from refgdn import GDNStateCache

    @staticmethod
    def gdn_decode(mixed_qkv, a, *args, **kw):
        cache = args[5]
        return mixed_qkv.new_zeros(mixed_qkv.shape[0], cache.HV, cache.V)

    gdn_verify = gdn_prefill = gdn_decode

    @staticmethod
    def gdn_accept(*a, **k):
        pass

    @staticmethod
    def rms_norm_gated(x, *a, **k):
        return x.clone()

    rms_norm = rms_norm_gated


@contextlib.contextmanager
def no_host_reads():
    """Fail on any Python-level host read of a tensor value."""
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"host read: Tensor.{name}")
        return f
    saved = {}
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, boom(name))
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


def test_model_steps_do_no_host_reads():
    """Metadata, prefill, decode, verify, accept and the MTP step with the model's glue code only (stub GDN
    ops, check_values off): no .item / .tolist / bool / .cpu anywhere."""
    model = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops=_StubOps(), dtype=torch.float32, check_values=False)
    cache = model.allocate_cache(4, 16, max_draft=3)
    si = torch.tensor([3, -1, 1], dtype=I32)
    with no_host_reads():
        with pytest.raises(AssertionError, match="host read"):
            torch.zeros(1).item()                   # the guard works
        for mode, counts in (("prefill", [5, 2, 3]), ("decode", [1, 1, 1]), ("verify", [4, 1, 2])):
            qsl = qsl_of(counts)
            T = sum(counts)
            meta = model.metadata(cache, si, qsl, T)
            h = getattr(model, mode)(cache, torch.zeros(T, dtype=torch.long), meta)
        model.accept(cache, si, torch.tensor([2, 1, 1], dtype=I32))
        meta = model.metadata(cache, si, qsl_of([2, 1, 1]), 4, mtp=True, position_offset=torch.tensor(1, dtype=I32))
        out = model.mtp(cache, torch.zeros(4, dtype=torch.long), torch.zeros(4, 32), meta)
        logits = model.logits(out)
    assert logits.shape == (4, 128) and h.shape == (7, 32)
    assert cache.kv_lens.tolist() == [0, 3 + 1 + 1, 0, 5 + 1 + 2]       # slot 1: prefill 3, decode, accept 1
    assert cache.mtp_kv_lens.tolist() == [0, 4 + 1 + 1, 0, 6 + 1 + 2]   # lens before accept + offset 1 + tokens


def test_step_argument_errors(model64):
    cache = model64.allocate_cache(2, 8, max_draft=1)
    si, qsl = torch.tensor([0, 1], dtype=I32), qsl_of([1, 1])
    meta = model64.metadata(cache, si, qsl, 2)
    with pytest.raises(ValueError, match="input_ids"):
        model64.decode(cache, torch.zeros(3, dtype=torch.long), meta)
    with pytest.raises(ValueError, match="input_ids"):
        model64.decode(cache, torch.zeros(2, dtype=torch.float32), meta)
    with pytest.raises(ValueError, match="cache"):
        model64.decode(object(), torch.zeros(2, dtype=torch.long), meta)
    vmeta = model64.metadata(cache, si, qsl_of([3, 1]), 4)
    with pytest.raises(ValueError, match="at most 1 \\+ max_draft"):
        model64.verify(cache, torch.zeros(4, dtype=torch.long), vmeta)
    dup = model64.metadata(cache, torch.tensor([1, 1], dtype=I32), qsl, 2)
    with pytest.raises(ValueError, match="state_indices"):
        model64.decode(cache, torch.zeros(2, dtype=torch.long), dup)
    far = model64.metadata(cache, si, qsl, 2, position_offset=8)
    with pytest.raises(ValueError, match="max_len"):
        model64.decode(cache, torch.zeros(2, dtype=torch.long), far)
    assert int(cache.kv_lens.sum()) == 0          # nothing was touched
    with pytest.raises(ValueError, match="num_accepted"):
        model64.accept(cache, si, torch.tensor([1], dtype=I32))


def test_attn_window_bounds_the_attended_rows(model64):
    prompts = ids_of((9, 4), seed=7)
    cache = model64.allocate_cache(2, 32)
    step(model64, cache, [0, 1], prompts, "prefill")
    si, qsl, ids = torch.tensor([0, 1], dtype=I32), torch.arange(3, dtype=I32), torch.tensor([3, 4])
    c1, c2 = cache.clone(), cache.clone()
    whole = model64.decode(c1, ids, model64.metadata(c1, si, qsl, 2))
    windowed = model64.decode(c2, ids, model64.metadata(c2, si, qsl, 2, attn_window=10))   # positions 9, 4
    assert_close(windowed, whole, "decode with attn_window", 1e-13)
    with pytest.raises(ValueError, match="attn_window"):
        model64.decode(cache, ids, model64.metadata(cache, si, qsl, 2, attn_window=9))
    with pytest.raises(ValueError, match="attn_window"):
        model64.metadata(cache, si, qsl, 2, attn_window=33)


def test_mtp_round_then_rollback_equals_a_fresh_run(model64):
    """A whole round at the model level (catch-up MTP step, k-1 single draft steps, verify, partial accept,
    the next catch-up) leaves target and MTP caches and outputs equal to a fresh prefill + catch-up over
    the accepted tokens (the lag rule undoes the draft steps' MTP KV rows)."""
    m, k = model64, 3
    prompts, slots = ids_of((6, 4), seed=9), [0, 2]
    si = torch.tensor(slots, dtype=I32)
    cache = m.allocate_cache(3, 32, max_draft=k)
    hid = m.prefill(cache, torch.cat(prompts), m.metadata(cache, si, qsl_of([6, 4]), 10))
    x_T = torch.tensor([17, 23])                                   # the "sampled" next tokens
    ids = torch.cat([prompts[0][1:], x_T[:1], prompts[1][1:], x_T[1:]])
    mh = m.mtp(cache, ids, hid, m.metadata(cache, si, qsl_of([6, 4]), 10, mtp=True))
    last, drafts = mh[[5, 9]], []
    for j in range(k):
        d = m.logits(last).argmax(-1)
        drafts.append(d)
        if j < k - 1:
            last = m.mtp(cache, d, last, m.metadata(cache, si, torch.arange(3, dtype=I32), 2, mtp=True))
    assert torch.equal(cache.mtp_kv_lens[slots], torch.tensor([6 + k - 1, 4 + k - 1], dtype=I32))
    drafts = torch.stack(drafts, 1)                                # [2, k]
    verified = [torch.cat([x_T[n:n + 1], drafts[n]]) for n in range(2)]   # 1 + k tokens each
    vh = m.verify(cache, torch.cat(verified), m.metadata(cache, si, qsl_of([1 + k] * 2), 2 * (1 + k)))
    acc = [2, 4]
    m.accept(cache, si, torch.tensor(acc, dtype=I32))
    bonus = torch.tensor([5, 6])
    nxt = [torch.cat([verified[n][1:acc[n]], bonus[n:n + 1]]) for n in range(2)]
    vh_kept = torch.cat([vh[n * (1 + k):n * (1 + k) + acc[n]] for n in range(2)])
    mh2 = m.mtp(cache, torch.cat(nxt), vh_kept, m.metadata(cache, si, qsl_of(acc), sum(acc), mtp=True))

    fresh = m.allocate_cache(3, 32, max_draft=k)
    seqs = [torch.cat([prompts[n], verified[n][:acc[n]]]) for n in range(2)]
    lens = [len(s) for s in seqs]
    hid_f = m.prefill(fresh, torch.cat(seqs), m.metadata(fresh, si, qsl_of(lens), sum(lens)))
    ids_f = torch.cat([torch.cat([seqs[n][1:], bonus[n:n + 1]]) for n in range(2)])
    mh_f = m.mtp(fresh, ids_f, hid_f, m.metadata(fresh, si, qsl_of(lens), sum(lens), mtp=True))
    tail = torch.cat([mh_f[sum(lens[:n]) + lens[n] - acc[n]:sum(lens[:n]) + lens[n]] for n in range(2)])
    assert_close(mh2, tail, "MTP outputs after rollback vs fresh")
    assert torch.equal(cache.mtp_kv_lens[slots], torch.tensor(lens, dtype=I32))
    assert_caches_equal(m, cache, fresh, slots, mtp=True)


def test_padded_rows_touch_no_real_slot(model64):
    """A padded row (-1) with tokens in prefill / verify / accept changes no real slot's outputs or caches."""
    prompts = ids_of((5, 7), seed=13)
    drafts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    junk = torch.tensor([9, 9, 9, 9])
    runs = []
    for padded in (False, True):
        cache = model64.allocate_cache(3, 16, max_draft=3)
        si = torch.tensor([0, -1, 2] if padded else [0, 2], dtype=I32)

        def run(mode, chunks):
            parts = [chunks[0], junk, chunks[1]] if padded else chunks
            ids = torch.cat(parts)
            meta = model64.metadata(cache, si, qsl_of([len(c) for c in parts]), ids.shape[0])
            out = model64.logits(getattr(model64, mode)(cache, ids, meta))
            if padded:                                            # drop the padded row's tokens
                a, b = len(chunks[0]), len(junk)
                out = torch.cat([out[:a], out[a + b:]])
            return out
        outs = [run("prefill", prompts), run("verify", drafts)]
        model64.accept(cache, si, torch.tensor([2, 1, 1] if padded else [2, 1], dtype=I32))
        runs.append((outs, cache))
    (o1, c1), (o2, c2) = runs
    for a, b in zip(o1, o2):
        assert_close(b, a, "logits with a padded row", 1e-13)
    assert_caches_equal(model64, c2, c1, [0, 2], rel=1e-13)
    assert int(c2.kv_lens_buf[-1]) == 0 and int(c2.kv_lens[1]) == 0       # scratch and unused slot untouched


def test_tied_embeddings_roundtrip(tmp_path):
    m = tiny(tie_word_embeddings=True, seed=4)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    m.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    back = Qwen3NextModel.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = ids_of((5,), seed=1)[0][None]
    assert torch.equal(back(ids), m(ids))


def test_mtp_argument_errors(model64):
    no_mtp = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), dtype=torch.float64, mtp=False)
    foreign = no_mtp.allocate_cache(2, 8)                        # allocated without MTP KV caches
    si, qsl = torch.tensor([0], dtype=I32), qsl_of([1])
    meta = model64.metadata(foreign, si, qsl, 1, mtp=True)
    ids, hid = torch.tensor([3]), torch.zeros(1, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="MTP KV"):
        model64.mtp(foreign, ids, hid, meta)
    cache = model64.allocate_cache(2, 8)
    with pytest.raises(ValueError, match="hidden"):
        model64.mtp(cache, ids, torch.zeros(1, 31, dtype=torch.float64), model64.metadata(cache, si, qsl, 1, mtp=True))
    with pytest.raises(ValueError, match="input_ids must be in"):
        model64.mtp(cache, torch.tensor([128]), hid, model64.metadata(cache, si, qsl, 1, mtp=True))
    assert int(cache.mtp_kv_lens.sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_rotary_tables_equal_rotate_half(dtype):
    """Rotary.apply over its per-step tables (rotate_half's sign folded into sin) equals the textbook NeoX form
    x * cos + rotate_half(x) * sin on the first rotary_dim channels (computed in float32 / float64, rounded once),
    bit for bit; the pass-through channels are untouched."""
    from refgdn.model.layers import Rotary, compute_dtype
    cfg = Qwen3NextConfig.preset("tiny")
    rot = Rotary(cfg)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 3, cfg.head_dim, generator=gen, dtype=torch.float64) * 4).to(dtype)
    pos = torch.tensor([0, 1, 5, 17, 4095, 123456], dtype=I32)
    dt = compute_dtype(x)
    freqs = pos.to(dt)[:, None] * rot.inv_freq(dt, "cpu")
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    xr, xp = x.to(dt)[..., :rot.rotary_dim], x[..., rot.rotary_dim:]
    half = rot.rotary_dim // 2
    rotate_half = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    want = torch.cat([(xr * emb.cos() + rotate_half * emb.sin()).to(dtype), xp], dim=-1)
    got = rot.apply(x, rot.tables(pos, dt))
    assert got.dtype == dtype and torch.equal(got, want)


def test_prefill_attention_shares_a_requests_kv_rows(model64, monkeypatch):
    """A prefill whose request offsets the host holds (query_start_loc_cpu) attends each request's KV rows gathered
    once for all of its tokens (AttnStep.spans); the same prefill with the per-token gather of decode / verify
    gives the same hidden states (float64, to rounding). Prompts longer than one attention block, and a continuing
    prefill whose tokens also read rows of the earlier one."""
    import refgdn.model.core as core
    spans_seen = []
    real = core.attn_step

    def spy(meta, kv, rotary, dt, offsets=None):
        spans_seen.append(offsets is not None)
        return real(meta, kv, rotary, dt, offsets)
    monkeypatch.setattr(core, "attn_step", spy)
    monkeypatch.setattr("refgdn.model.layers.ATTN_BLOCK", 4)          # several blocks per request
    runs = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(core, "host_offsets_known", lambda t: False)
        cache = model64.allocate_cache(4, 40)
        outs = []
        for lens, slots in (([9, 3, 6], [2, 0, 3]), ([5, 7], [0, 2])):       # second: continues slots 0 and 2
            ids = torch.cat(ids_of(lens, seed=len(outs)))
            qsl = qsl_of(lens)
            meta = model64.metadata(cache, torch.tensor(slots, dtype=I32), qsl, ids.shape[0])
            outs.append(model64.prefill(cache, ids, meta, qsl))
        runs[shared] = outs
    assert spans_seen == [True, True, False, False]
    for a, b in zip(runs[True], runs[False]):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()


@pytest.mark.parametrize("family", [pytest.param("qwen3_next", id="qwen3_next"),
                                    pytest.param("qwen3_5_text", id="qwen3_5")])
def test_mtp_dedicated_embeddings(tmp_path, family):
    """config.mtp_use_dedicated_embeddings: the MTP head embeds its tokens with its own mtp.embed_tokens. With that
    table set to the target's, the head's outputs are the shared-table model's bit for bit (the flag changes only
    which table is read); with its own random table they differ. The key round-trips through save / load; a
    checkpoint that has the key loads with the flag on (as vLLM loads an MTP checkpoint's own embedding); a flag
    without the key is a missing key; a Qwen3-Next config.json gets the field only when it is on."""
    shared = tiny(model_type=family)
    own = tiny(model_type=family, mtp_use_dedicated_embeddings=True)
    assert "mtp.embed_tokens.weight" in own.hf_parameters() and "mtp.embed_tokens.weight" not in shared.hf_parameters()
    prompts = ids_of((5, 3), seed=9)
    si, qsl = torch.tensor([0, 2], dtype=I32), qsl_of([5, 3])
    ids = torch.cat(prompts)
    shifted = torch.cat([prompts[0][1:], torch.tensor([7]), prompts[1][1:], torch.tensor([8])])

    def mtp_out(m):
        cache = m.allocate_cache(3, MAXLEN, max_draft=2)
        hidden = m.prefill(cache, ids, m.metadata(cache, si, qsl, 8))
        return m.mtp(cache, shifted, hidden, m.metadata(cache, si, qsl, 8, mtp=True))

    want = mtp_out(shared)
    assert not torch.equal(mtp_out(own), want)          # its own random table is read
    with torch.no_grad():
        own.mtp_head.embed_tokens.weight.copy_(shared.model.embed_tokens.weight)
    assert torch.equal(mtp_out(own), want)

    own.save_pretrained(tmp_path / "own")
    cfg = json.loads((tmp_path / "own" / "config.json").read_text())
    assert cfg["mtp_use_dedicated_embeddings"] is True
    back = Qwen3NextModel.from_pretrained(tmp_path / "own")
    assert back.config.mtp_use_dedicated_embeddings
    assert torch.equal(back.mtp_head.embed_tokens.weight, own.mtp_head.embed_tokens.weight)
    assert torch.equal(mtp_out(back), want)
    # the key without the flag: the checkpoint says the head has its own table
    del cfg["mtp_use_dedicated_embeddings"]
    (tmp_path / "own" / "config.json").write_text(json.dumps(cfg))
    assert Qwen3NextModel.from_pretrained(tmp_path / "own").config.mtp_use_dedicated_embeddings
    # the flag without the key
    shared.save_pretrained(tmp_path / "shared")
    cfg = json.loads((tmp_path / "shared" / "config.json").read_text())
    assert cfg.get("mtp_use_dedicated_embeddings", False) is False
    assert ("mtp_use_dedicated_embeddings" in cfg) == (family != "qwen3_next")
    cfg["mtp_use_dedicated_embeddings"] = True
    (tmp_path / "shared" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing key 'mtp.embed_tokens.weight'"):
        Qwen3NextModel.from_pretrained(tmp_path / "shared")
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings must be a bool"):
        Qwen3NextConfig.preset("tiny", mtp_use_dedicated_embeddings=1)
