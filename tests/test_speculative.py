"""refgdn.speculative on the CPU: greedy speculative decoding is lossless, rollback is exact, draft-step
metadata is rebuilt per step.

Models are "draft-friendly" (conformance.cases_model.draft_friendly_model: scaled-down layers and an
MTP head that passes the next token's embedding through), so the MTP draft agrees with the target part
of the time and rounds end in full, partial and no acceptance: every test checks that mix happened.

* Greedy is lossless: speculative == plain greedy token for token, k = 1..5 (and mixed k, budgets and eos
  per request in one batch), prompts of different lengths; refgdn float64 (4-layer tiny: 3 GDN layers,
  dense and MoE MLPs) and fast float32 (2-layer tiny, Triton interpreter; k = 2 and 5, the quick
  conformance matrix taking k = 3 and mixed k). For fast, a step whose top two
  target logits lie within float32 rounding (gap <= 1e-5 * max(1, max|logit|)) may differ: it is
  counted as a tie; ties must stay under 1% of the compared steps.
* Rollback is exact: after every round each GDN layer's committed state and conv window, the target and
  MTP KV lengths and KV rows below them equal a fresh prefill (+ MTP catch-up) over the accepted tokens.
* Rejection sampling through the whole loop (T = 1, k = 2, tiny vocabulary, a draft unlike the target):
  generated tokens 2 and 3 match the target's exact marginals (enumerated continuations) by a chi-square
  test; a loop that accepts every draft fails the same test.
* Draft-step metadata is rebuilt: with k >= 3 every draft step's positions / slot mapping advance by one
  per step, and every draft logit equals an independent one-request recomputation on a fresh cache; a
  stale builder (step 1's metadata replayed, vLLM PR 41162's bug) fails both checks.
"""
from __future__ import annotations

import pytest
import torch

from conformance.cases_model import SPEC_TINY, draft_friendly_model, random_prompts
from refgdn.model import ModelCache
from refgdn.serving import committed_state
from refgdn.speculative import fresh_draft_metadata, generate_plain, generate_speculative

I32 = torch.int32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = (5, 2, 9)
SLOTS = (2, 0, 3)


@pytest.fixture(scope="module")
def m64():
    return draft_friendly_model(vocab_size=16, mix=0.2)          # 4 layers: 3 GDN + 1 attention, float64


def _kinds(results):
    """Counts of request-rounds with no acceptance, partial, full (k >= 1 only)."""
    none = part = full = 0
    for res in results:
        for r in res.rounds:
            for k, a in zip(r.num_drafts, r.num_accepted):
                if k == 0:
                    continue
                none += a == 1
                full += a == 1 + k
                part += 1 < a < 1 + k
    return none, part, full


def test_greedy_speculative_equals_plain_refgdn64(m64):
    prompts = random_prompts(LENS, 16, seed=3)
    plain = generate_plain(m64, prompts, 10, slots=SLOTS)
    assert all(len(t) == 10 for t in plain.tokens)
    specs = []
    for k in range(1, 6):
        spec = generate_speculative(m64, prompts, 10, k, slots=SLOTS)
        assert spec.tokens == plain.tokens, (k, spec.tokens, plain.tokens)
        assert all(max(r.num_accepted) <= 1 + k for r in spec.rounds)
        specs.append(spec)
    none, part, full = _kinds(specs)
    assert none > 0 and part > 0 and full > 0, (none, part, full)


@pytest.mark.parametrize("family", [pytest.param("qwen3_5_text", id="qwen3_5"),
                                    pytest.param("qwen3_5_moe_text", id="qwen3_5_moe")])
def test_greedy_speculative_equals_plain_qwen3_5_refgdn64(family):
    """The same losslessness for the Qwen3.5 families (their GDN projections, dense or every MLP routed; the MTP
    layer's MLP follows the family), k = 1 and 3."""
    m = draft_friendly_model(vocab_size=16, mix=0.2, model_type=family)
    prompts = random_prompts(LENS, 16, seed=3)
    plain = generate_plain(m, prompts, 8, slots=SLOTS)
    specs = [generate_speculative(m, prompts, 8, k, slots=SLOTS) for k in (1, 3)]
    for spec in specs:
        assert spec.tokens == plain.tokens, (spec.tokens, plain.tokens)
    none, part, full = _kinds(specs)
    assert none > 0 and full > 0, (none, part, full)


def test_greedy_mixed_k_budgets_and_eos_refgdn64(m64):
    """Different k, max_new_tokens and an eos per request in one batch: requests finish at different times."""
    prompts = random_prompts((7, 3, 4), 16, seed=5)
    budgets = [9, 4, 12]
    plain = generate_plain(m64, prompts, budgets)
    eos = plain.tokens[2][6]                      # a token request 2 emits (others may emit it earlier)
    plain = generate_plain(m64, prompts, budgets, eos_token_id=eos)
    spec = generate_speculative(m64, prompts, budgets, [1, 3, 5], eos_token_id=eos)
    assert spec.tokens == plain.tokens
    assert any(len(t) < b for t, b in zip(plain.tokens, budgets))            # eos cut a request short
    assert len({len(r.requests) for r in spec.rounds}) > 1                   # the batch shrank
    assert any(len(set(r.num_drafts)) > 1 for r in spec.rounds)              # different k in one round


def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_greedy_speculative_equals_plain_fast32():
    m = draft_friendly_model(ops="fast", dtype=torch.float32, device=DEVICE, mix=0.2, **SPEC_TINY)
    prompts = random_prompts((5, 2), 16, seed=3)
    new = 7
    plain = generate_plain(m, prompts, new, record_logits=True)
    specs, steps, ties = [], 0, 0
    # k = 2 and 5 here: the quick conformance matrix runs the same fast model's speculative loop at k = 3 and at
    # mixed k = (1, 4, 2) against the float64 truth (conformance/cases_model.py), and refgdn64 above takes k = 1..5
    for k in (2, 5):
        spec = generate_speculative(m, prompts, new, k)
        specs.append(spec)
        for n in range(len(prompts)):
            i = _first_divergence(spec.tokens[n], plain.tokens[n])
            steps += new if i is None else i + 1
            if i is None:
                continue
            reqs, logits = plain.step_logits[i]
            row = logits[reqs.index(n)].double()
            top2 = row.topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap <= 1e-5 * max(1.0, float(row.abs().max())), (
                f"k={k} request {n} differs at token {i} with a top-2 gap of {gap:.3e}: not a float32 tie")
            ties += 1
    assert ties < 0.01 * steps, (ties, steps)
    none, part, full = _kinds(specs)
    assert none > 0 and part > 0 and full > 0, (none, part, full)


# ----------------------------------------------------------------------------------------------
# rollback
# ----------------------------------------------------------------------------------------------

def _assert_close(a, b, what, rel=1e-10):
    scale = max(float(b.abs().max()), 1e-30) if b.numel() else 1.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= rel * scale, f"{what}: error {err:.3e} (scale {scale:.3e})"


def _fresh(model, seqs, mtp_lens, slots, like: ModelCache):
    """A fresh cache holding only the given token sequences: prefill, then the MTP head over positions
    0..mtp_lens[n]-1 (ids = tokens 1.., hidden = the prefill's hiddens), in the same slots."""
    cache = model.allocate_cache(like.num_slots, like.max_len, max_draft=like.max_draft)
    dev = model.device
    si = torch.tensor(slots, dtype=I32, device=dev)
    lens = [len(s) for s in seqs]
    offs = torch.tensor([0] + lens).cumsum(0)
    hid = model.prefill(cache, torch.tensor([t for s in seqs for t in s], device=dev),
                        model.metadata(cache, si, offs.to(I32).to(dev), sum(lens)))
    ids = torch.tensor([t for s, L in zip(seqs, mtp_lens) for t in (s + [0])[1:L + 1]], device=dev)
    rows = torch.tensor([int(o) + j for o, L in zip(offs[:-1], mtp_lens) for j in range(L)], device=dev)
    mq = torch.tensor([0] + list(mtp_lens)).cumsum(0).to(I32).to(dev)
    model.mtp(cache, ids, hid.index_select(0, rows), model.metadata(cache, si, mq, len(rows), mtp=True))
    return cache


def _assert_same_cache(c, f, slots, rel=1e-10):
    idx = torch.tensor(slots, device=c.device)
    assert torch.equal(c.kv_lens[idx], f.kv_lens[idx]), (c.kv_lens, f.kv_lens)
    assert torch.equal(c.mtp_kv_lens[idx], f.mtp_kv_lens[idx]), (c.mtp_kv_lens, f.mtp_kv_lens)
    for i, (g1, g2) in enumerate(zip(c.gdn, f.gdn)):
        s1, w1 = committed_state(g1, list(slots))
        s2, w2 = committed_state(g2, list(slots))
        _assert_close(s1, s2, f"gdn {i} ssm", rel)
        _assert_close(w1, w2, f"gdn {i} conv window", rel)
    for kvs1, kvs2, lens, what in ((c.kv, f.kv, c.kv_lens, "target"), (c.mtp_kv, f.mtp_kv, c.mtp_kv_lens, "mtp")):
        for j, (k1, k2) in enumerate(zip(kvs1, kvs2)):
            for s in slots:
                L = int(lens[s])
                _assert_close(k1.k_cache[s, :L], k2.k_cache[s, :L], f"{what} kv {j} slot {s} k", rel)
                _assert_close(k1.v_cache[s, :L], k2.v_cache[s, :L], f"{what} kv {j} slot {s} v", rel)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollback_after_every_round_equals_a_fresh_run(m64, temperature):
    prompts = random_prompts(LENS, 16, seed=7)
    seen = []

    def on_round(info):
        # committed: everything but the last emitted token (the next verify's first token); the MTP head
        # lags the target by the round's accepted tokens (model.accept's lag rule)
        seqs = [s[:-1] for s in info.sequences]
        mtp_lens = [len(s) - a for s, a in zip(seqs, info.num_accepted)]
        fresh = _fresh(m64, seqs, mtp_lens, info.slots, info.cache)
        _assert_same_cache(info.cache, fresh, info.slots)
        seen.extend(zip(info.num_drafts, info.num_accepted))

    spec = generate_speculative(m64, prompts, [8, 11, 6], [3, 2, 4], temperature=temperature, slots=SLOTS,
                                seed=11, on_round=on_round)
    assert len(spec.rounds) >= 3
    assert any(a == 1 for k, a in seen) and any(a == 1 + k for k, a in seen), seen
    if temperature == 0.0:
        assert any(1 < a < 1 + k for k, a in seen), seen


# ----------------------------------------------------------------------------------------------
# draft-step metadata
# ----------------------------------------------------------------------------------------------

def stale_draft_metadata():
    """The bug: build draft step 1's metadata once per round and replay it for every later step."""
    memo = {}

    def build(model, cache, state_indices, step):
        if step == 1 or "meta" not in memo:
            memo["meta"] = fresh_draft_metadata(model, cache, state_indices, step)
        return memo["meta"]
    return build


def check_positions_advance(info, max_len):
    """Draft step j (1-based single-token steps) of each real row: position = step 1's + (j - 1),
    slot_mapping = slot * max_len + position, seq_len = position + 1."""
    metas = info.draft_metas[1:]
    if not metas:
        return
    base = metas[0].positions.clone()
    for j, meta in enumerate(metas):
        real = meta.state_indices >= 0
        si = meta.state_indices.long()
        want = base + j
        assert torch.equal(meta.positions[real], want[real]), f"draft step {j + 1}: positions not rebuilt"
        assert torch.equal(meta.slot_mapping[real].long(), (si * max_len + want)[real].long()), \
            f"draft step {j + 1}: slot mapping not rebuilt"
        assert torch.equal(meta.seq_lens[real], (want + 1)[real].to(I32))


def reference_draft_logits(model, context, x, drafts):
    """Draft logits of one request recomputed alone on a fresh cache: prefill the committed context, the MTP
    head over it (ids shifted by one, with x last), then one MTP step per draft with fresh metadata."""
    dev = model.device
    cache = model.allocate_cache(1, len(context) + len(drafts) + 2, max_draft=len(drafts))
    si = torch.zeros(1, dtype=I32, device=dev)
    L = len(context)
    q = torch.tensor([0, L], dtype=I32, device=dev)
    hid = model.prefill(cache, torch.tensor(context, device=dev), model.metadata(cache, si, q, L))
    h = model.mtp(cache, torch.tensor(context[1:] + [x], device=dev), hid, model.metadata(cache, si, q, L, mtp=True))
    h = h[-1:]
    out = [model.logits(h)[0]]
    one = torch.tensor([0, 1], dtype=I32, device=dev)
    for d in drafts[:-1]:
        h = model.mtp(cache, torch.tensor([d], device=dev), h, model.metadata(cache, si, one, 1, mtp=True))
        out.append(model.logits(h)[0])
    return torch.stack(out)


def _run_with_checks(model, draft_metadata, k=4):
    prompts = random_prompts((6, 3), 16, seed=2)
    problems = []

    def on_round(info):
        try:
            check_positions_advance(info, info.cache.max_len)
        except AssertionError as e:
            problems.append(f"round {info.index}: {e}")
        for i, n in enumerate(info.requests):
            kn = info.num_drafts[i]
            if kn == 0:
                continue
            before = info.sequences[i][:len(info.sequences[i]) - info.num_accepted[i]]
            drafts = info.draft_logits[i, :kn].argmax(-1).tolist()
            ref = reference_draft_logits(model, before[:-1], before[-1], drafts)
            got = info.draft_logits[i, :kn]
            err = float((got - ref).abs().max())
            if err > 1e-10 * float(ref.abs().max()):
                problems.append(f"round {info.index} request {n}: draft logits off by {err:.2e}")

    out = generate_speculative(model, prompts, 12, k, on_round=on_round, draft_metadata=draft_metadata)
    return out, problems


def test_draft_steps_rebuild_their_metadata(m64):
    assert m64.config.rotary_dim > 0                     # positions enter the MTP attention through rotary
    out, problems = _run_with_checks(m64, fresh_draft_metadata)
    assert not problems, problems
    assert any(k >= 3 for r in out.rounds for k in r.num_drafts)


def test_stale_draft_metadata_is_caught(m64):
    """The same checks fail when every draft step replays step 1's metadata (so the test above can fail)."""
    out, problems = _run_with_checks(m64, stale_draft_metadata())
    assert any("positions not rebuilt" in p for p in problems), problems
    assert any("draft logits off" in p for p in problems), problems


def test_generate_command(capsys, tmp_path):
    """python -m refgdn.generate: plain + speculative, statistics printed, greedy equality reported."""
    from refgdn.generate import main, parse_prompts
    assert parse_prompts("1,2,3;4 5\n6") == [[1, 2, 3], [4, 5], [6]]
    f = tmp_path / "prompts.txt"
    f.write_text("1,2,3\n4,5\n")
    rc = main(["--preset", "tiny", "--dtype", "float64", "--max-new-tokens", "5", "--draft-steps", "2",
               "--draft-friendly", "0.2", "--prompt-file", str(f), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "greedy speculative == plain: True" in out and "acceptance rate" in out and "tok/s" in out
    assert "mean accepted length per round" in out
    # a preset as a Qwen3.5 model (its GDN projections, dense MLPs); --model-type is for presets only
    rc = main(["--preset", "tiny", "--model-type", "qwen3_5_text", "--dtype", "float64", "--max-new-tokens", "4",
               "--draft-steps", "2", "--draft-friendly", "0.2", "--prompt-ids", "1,2,3", "--no-progress"])
    assert rc == 0 and "greedy speculative == plain: True" in capsys.readouterr().out
    assert main(["--checkpoint", str(tmp_path), "--model-type", "qwen3_5_text", "--no-progress"]) == 2
    assert "--model-type is for --preset" in capsys.readouterr().err
    # the GDN state in bfloat16 (vLLM's default; GraphedModel's state_dtype: tests/test_capture.py)
    rc = main(["--preset", "tiny", "--dtype", "float32", "--state-dtype", "bfloat16", "--max-new-tokens", "3",
               "--draft-steps", "2", "--draft-friendly", "0.2", "--prompt-ids", "1,2,3", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "GDN ssm state: torch.bfloat16" in out and "tok/s" in out, out
    # graphs are fast's: the oracle checks its inputs' values on the host, which no graph can hold
    assert main(["--preset", "tiny", "--ops", "refgdn", "--cuda-graphs", "--no-progress"]) == 2
    assert "--cuda-graphs is for --ops fast" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# rejection sampling through the whole loop
# ----------------------------------------------------------------------------------------------

def _target_marginals(model, prompt, V):
    """Exact distributions (float64, T = 1) of generated tokens 1, 2, 3 after the prompt, by enumerating
    every continuation: P(t2) = sum_t1 P(t1) P(t2 | t1), P(t3) = sum_{t1,t2} P(t1) P(t2 | t1) P(t3 | t1, t2)."""
    p1 = torch.softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)                        # [V]
    seq2 = torch.tensor([prompt + [a] for a in range(V)])
    p2 = torch.softmax(model(seq2)[:, -1].double(), -1)                                           # [V(t1), V]
    seq3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    p3 = torch.softmax(model(seq3)[:, -1].double(), -1).view(V, V, V)                             # [t1, t2, V]
    joint12 = p1[:, None] * p2                                                                    # [t1, t2]
    return joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))


def test_rejection_sampling_through_the_loop_keeps_the_target_distribution(monkeypatch):
    """Many copies of one prompt, k = 2, T = 1: generated tokens 2 and 3 (emitted by the first speculative
    round: the first position of the round, and the second when d_1 was accepted) follow the target's exact
    marginals (chi-square p > 0.001), with a draft that differs from the target (rejections happen). The same
    histograms from a loop that accepts every draft fail the test (the check has power)."""
    from refgdn import speculative
    from refgdn.sampling import chi_square_sf

    V = 8
    m = draft_friendly_model(mix=0.6, **dict(SPEC_TINY, vocab_size=V))
    prompt = [1, 5, 2, 7]
    want2, want3 = _target_marginals(m, prompt, V)

    def histograms(seeds, N=400):
        h2, h3, hist = torch.zeros(V), torch.zeros(V), {}
        for seed in seeds:
            # 4 new tokens: x_T from the prefill, then a first round with k = 2 (k_n <= tokens left - 1)
            out = generate_speculative(m, [prompt] * N, 4, 2, temperature=1.0, seed=seed)
            toks = torch.tensor(out.tokens)                                      # [N, 4]
            h2 += torch.bincount(toks[:, 1], minlength=V)
            h3 += torch.bincount(toks[:, 2], minlength=V)
            for a, c in out.accept_histogram().items():
                hist[a] = hist.get(a, 0) + c
        return h2.double(), h3.double(), hist

    def pval(h, p):
        e = p * h.sum()
        return chi_square_sf(float(((h - e) ** 2 / e).sum()), V - 1)

    h2, h3, hist = histograms((0, 1))
    assert hist.get(1, 0) > 60 and hist.get(3, 0) > 60, hist          # rejections and full acceptance
    assert pval(h2, want2) > 1e-3, (h2, want2)
    assert pval(h3, want3) > 1e-3, (h3, want3)

    def accept_everything(D, Q, TL, k, temperature, gen):
        n, K = D.shape
        bonus = torch.full((n, 1), 0, dtype=torch.long)
        return (k + 1).to(torch.int32), torch.cat([D, bonus], 1)
    monkeypatch.setattr(speculative, "accept_drafts", accept_everything)
    h2, h3, _ = histograms((0,))
    assert pval(h2, want2) < 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rounds_do_no_host_reads_before_acceptance(temperature):
    """Steps 1-5 of every round (MTP catch-up, draft steps, verify, acceptance, model.accept) run under a
    guard that fails on any host read of a tensor value (model glue with stub GDN ops, check_values off);
    the round's one read comes after."""
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    from tests.test_model import _StubOps, no_host_reads
    model = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops=_StubOps(), dtype=torch.float32, check_values=False)
    entered = []

    def guard():
        entered.append(1)
        return no_host_reads()
    out = generate_speculative(model, [[1, 2, 3], [4, 5]], [6, 4], [3, 2], temperature=temperature,
                               round_guard=guard)
    assert len(entered) == len(out.rounds) >= 2
    assert [len(t) for t in out.tokens] == [6, 4]
