"""Conformance cases for the speculative generation loop (refgdn.speculative over refgdn.model).

One op, ``speculative_generate``: prefill + rounds of MTP drafts, verify, acceptance and rollback, run with
fast ops in precision p against refgdn (float64 truth, and refgdn in p for the rule), the same weights,
prompts and seeds, draft_steps 1..7 (and mixed k per request). Checked:

    generated tokens, num_accepted per round                 exact (torch.equal against the truth)
    per round: verify logits (rows the request verified),     tolerance (the conformance rule)
      draft logits (rows it drafted)
    per round: committed GDN ssm state and conv window of     tolerance
      every layer (refgdn.serving.committed_state)
    per round: target / MTP KV lengths                        exact

The model is "draft-friendly" (:func:`draft_friendly_state`): its layers add a scaled-down residual to the
embedding and its MTP head is an identity on the embedding, so the MTP draft agrees with the target part of
the time and the rounds mix full, partial and no acceptance (random MTP weights would reject almost every
draft, and a test of rollback after full rejection only proves little).
"""
from __future__ import annotations

from typing import Optional

import torch

from refgdn.model import FULL, LINEAR, Qwen3NextConfig, Qwen3NextModel
from refgdn.serving import committed_state

from .core import Case, Check

# a 2-layer tiny config (one GDN layer, one MoE attention layer): the interpreter runs it in seconds
SPEC_TINY = dict(vocab_size=16, num_hidden_layers=2, layer_types=[LINEAR, FULL])


def draft_friendly_state(config: Qwen3NextConfig, seed: int = 0, mix: float = 0.35) -> dict:
    """float64 weights (a state dict) of a random model whose MTP head tends to agree with the target.

    Target: every layer's output projection (GDN out_proj, attention o_proj, MLP / expert / shared-expert
    down_proj) scaled by ``mix`` -> the final hidden is norm(embed(token) + O(mix)), logits close to a
    bigram table lm_head(norm(embed(token))). MTP head: pre-fc norms and mtp.norm at scale 1, fc = [I | 0]
    (it passes the next token's embedding through), its layer's projections scaled by ``mix`` too -> its
    logits are the same bigram table plus a different O(mix) perturbation. Smaller mix: more agreement.
    """
    m = Qwen3NextModel(config, ops="refgdn", dtype=torch.float64, seed=seed)
    H = config.hidden_size
    with torch.no_grad():
        for name, p in m.hf_parameters().items():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(mix)
        m.model.norm.weight.zero_()
        head = m.mtp_head
        if head is not None:
            head.pre_fc_norm_embedding.weight.zero_()
            head.pre_fc_norm_hidden.weight.zero_()
            head.norm.weight.zero_()
            head.fc.weight.zero_()
            head.fc.weight[:, :H].copy_(torch.eye(H, dtype=torch.float64))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def model_from_state(config: Qwen3NextConfig, state: dict, ops="refgdn", dtype=torch.float64,
                     device="cpu") -> Qwen3NextModel:
    """The same weights in another dtype / ops namespace / device (cast from the float64 state)."""
    m = Qwen3NextModel(config, ops=ops, dtype=dtype, device=device, seed=None)
    m.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return m


def draft_friendly_model(ops="refgdn", dtype=torch.float64, device="cpu", seed: int = 0, mix: float = 0.35,
                         **overrides) -> Qwen3NextModel:
    cfg = Qwen3NextConfig.preset("tiny", **overrides)
    return model_from_state(cfg, draft_friendly_state(cfg, seed, mix), ops, dtype, device)


def random_prompts(lens, vocab: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


# ----------------------------------------------------------------------------------------------
# the case
# ----------------------------------------------------------------------------------------------

def _run(model, prompts, max_new, k, seed, slots):
    """generate_speculative with a recorder: per round the verify / draft logits of real rows, committed
    GDN states, and the lengths."""
    from refgdn.speculative import generate_speculative

    rounds = []

    def on_round(info):
        c = info.cache
        vl = torch.cat([info.verify_logits[i, :1 + kn] for i, kn in enumerate(info.num_drafts)])
        dl = torch.cat([info.draft_logits[i, :kn] for i, kn in enumerate(info.num_drafts)])
        states = [committed_state(g, info.slots) for g in c.gdn]
        idx = torch.tensor(info.slots, device=c.device)
        rounds.append(dict(verify=vl.detach().cpu(), draft=dl.detach().cpu(),
                           ssm=[s.detach().cpu() for s, _ in states], conv=[w.detach().cpu() for _, w in states],
                           lens=torch.stack([c.kv_lens[idx], c.mtp_kv_lens[idx]]).cpu(),
                           accepted=torch.tensor(info.num_accepted)))

    out = generate_speculative(model, prompts, max_new, k, seed=seed, slots=slots, on_round=on_round)
    return out, rounds


def _spec_case(name: str, k, *, lens=(5, 2, 7), max_new=8, slots=(2, 0, 3), dtype=torch.float32, seed=0,
               mix=0.35, quick=True, overrides: Optional[dict] = None) -> Case:
    over = dict(SPEC_TINY if overrides is None else overrides)

    def run(device: str) -> list:
        cfg = Qwen3NextConfig.preset("tiny", **over)
        state = draft_friendly_state(cfg, seed, mix)
        prompts = random_prompts(lens, cfg.vocab_size, seed)
        truth_o, truth = _run(model_from_state(cfg, state, "refgdn", torch.float64), prompts, max_new, k, seed, slots)
        ref_o, ref = _run(model_from_state(cfg, state, "refgdn", dtype), prompts, max_new, k, seed, slots)
        fast_o, fst = _run(model_from_state(cfg, state, "fast", dtype, device), prompts, max_new, k, seed, slots)
        tok = lambda o: torch.tensor([t for ts in o.tokens for t in ts] + [len(ts) for ts in o.tokens])  # noqa: E731
        checks = [Check("tokens", tok(fast_o), tok(truth_o), exact=True),
                  Check("tokens_refgdn_p", tok(ref_o), tok(truth_o), exact=True)]
        if len(fst) != len(truth):
            checks.append(Check("rounds", torch.tensor(len(fst)), torch.tensor(len(truth)), exact=True))
            return checks
        for r, (t, p, f) in enumerate(zip(truth, ref, fst)):
            checks.append(Check(f"r{r}.num_accepted", f["accepted"], t["accepted"], exact=True))
            checks.append(Check(f"r{r}.lens", f["lens"], t["lens"], exact=True))
            checks.append(Check(f"r{r}.verify_logits", f["verify"], t["verify"], p["verify"]))
            if t["draft"].numel():
                checks.append(Check(f"r{r}.draft_logits", f["draft"], t["draft"], p["draft"]))
            for i, (fs, ts, ps) in enumerate(zip(f["ssm"], t["ssm"], p["ssm"])):
                checks.append(Check(f"r{r}.gdn{i}.committed_ssm", fs, ts, ps, dtype=torch.float32))
            # conv windows hold raw in-projection outputs: layer 0's are bit-equal, deeper layers' inputs carry
            # the layers below them, so all are compared by the rule
            for i, (fw, tw, pw) in enumerate(zip(f["conv"], t["conv"], p["conv"])):
                checks.append(Check(f"r{r}.gdn{i}.committed_conv", fw, tw, pw))
        hist = torch.bincount(torch.cat([t["accepted"] for t in truth]))
        checks.append(Check("acceptance_histogram", torch.bincount(torch.cat([f["accepted"] for f in fst]),
                                                                   minlength=hist.numel()), hist, exact=True))
        return checks

    # cost: a whole model's rounds, ~14 float32 chunk cases of time in the CPU quick matrix (runner.shard)
    return Case(op="speculative_generate", case=name, dtype=dtype, run=run,
                draft_steps=max(k) if isinstance(k, (list, tuple)) else k, quick=quick, cost=14.0)


def cases(quick: bool, device: str) -> list:
    """quick (CPU interpreter, CI): one 2-layer case with k = 3 and one with mixed k per request.
    Full: draft_steps 1..7 on the 4-layer tiny preset (3 GDN layers, dense + MoE), and k = 3 on it as a Qwen3.5 and
    a Qwen3.5-MoE model. float32 only: greedy tokens
    of a bf16 model need not equal the float64 truth's (rounding flips close argmaxes), so no exact check applies."""
    out = [_spec_case("tiny2-k3", 3, quick=True),
           _spec_case("tiny2-mixed-k", [1, 4, 2], seed=1, quick=True)]
    for k in range(1, 8):
        out.append(_spec_case(f"tiny4-k{k}", k, seed=10 + k, max_new=12, overrides=dict(vocab_size=16), mix=0.2,
                              quick=False))
    # the Qwen3.5 families: their GDN projections (in_proj_qkv / z / b / a), dense or every MLP routed
    for name, family in (("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")):
        out.append(_spec_case(f"tiny4-{name}-k3", 3, seed=20, max_new=12,
                              overrides=dict(vocab_size=16, model_type=family), mix=0.2, quick=False))
    return [c for c in out if c.quick or not quick]
