"""Newer vLLM's GDN layer core, composed of this package's ops the way vLLM composes its own, against one pass of the
layer's math over each request's whole history.

vLLM's layer (its Qwen3-Next model file, the third_party fla generation) runs a prefill as

    causal_conv1d_fn -> fused_post_conv_prep -> chunk_gated_delta_rule(state_layout "vk") -> final states into the pool

and each later token as

    causal_conv1d_update -> fused_recurrent_gated_delta_rule_packed_decode (pool [S, HV, V, K], slot 0 its null block)

(or, for the decode's delta rule, vLLM's newer fused_sigmoid_gating_delta_rule_update, or SGLang's op of that name on
the same pool layout)
with the conv windows and the states handed from op to op through two slot pools. The truth for a request whose
prompt is prefilled and then extended by decode steps is refgdn's conv, gates and delta rule over its whole token
sequence in float64 (one pass: refgdn.causal_conv1d, gdn_gating, recurrent_gated_delta_rule). refgdn's chain in float64
must give it to rounding; fast's chain in float32 by the conformance rule against refgdn's chain in float32.
"""
import pytest
import torch

import fast.sglang_ops as FS
import fast.vllm_ops as FV
import refgdn
import refgdn.sglang_ops as RS
import refgdn.vllm_ops as RV
from conformance.core import Check, evaluate

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K, V, W = 1, 2, 16, 16, 4
D = 2 * H * K + HV * V
PROMPTS = (5, 9, 1)              # tokens per request in the prefill
SLOTS = (3, 1, 4)                # each request's slot in both pools (slot 0: the null block, never a request's)
STEPS = 3                        # decode steps after the prefill


def _layer(seed: int, dtype: torch.dtype):
    """Weights and every token's projections: x [T_n + STEPS, D], a, b [T_n + STEPS, HV] per request."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    w = {"conv": r(D, W) / W ** 0.5, "A_log": torch.rand(HV, generator=gen, dtype=torch.float64) * 2 - 1,
         "dt_bias": 0.5 * r(HV)}
    toks = [dict(x=r(n + STEPS, D), a=3.0 * r(n + STEPS, HV), b=2.0 * r(n + STEPS, HV)) for n in PROMPTS]
    cast = lambda t: t.to(dtype).to(DEV)  # noqa: E731
    return {k_: cast(t) for k_, t in w.items()}, [{k_: cast(t) for k_, t in d.items()} for d in toks]


def _decode(ops, sg, engine, y1, a1, b1, w, ssm_pool, slots, dtype):
    """One decode step's delta rule on the conv's rows y1 [N, D] -> [N, HV, V]: vLLM's packed decode ("packed"), vLLM's
    newer gated recurrent op ("vllm-sigmoid"), or SGLang's op ("sglang", its own signature: the sg namespace)."""
    N = y1.shape[0]
    q = y1[:, :H * K].unflatten(1, (H, K))[:, None]                             # [N, 1, H, K]: views of the rows
    k = y1[:, H * K:2 * H * K].unflatten(1, (H, K))[:, None]
    v = y1[:, 2 * H * K:].unflatten(1, (HV, V))[:, None]
    if engine == "packed":
        out = torch.empty(N, 1, HV, V, dtype=dtype, device=DEV)
        ops.fused_recurrent_gated_delta_rule_packed_decode(y1, a1, b1, w["A_log"], w["dt_bias"], K ** -0.5, ssm_pool,
                                                           out, slots, True)
        return out[:, 0]
    if engine == "vllm-sigmoid":
        o, _ = ops.fused_sigmoid_gating_delta_rule_update(w["A_log"], a1, b1, w["dt_bias"], q, k, v,
                                                          initial_state=ssm_pool, ssm_state_indices=slots,
                                                          use_qk_l2norm_in_kernel=True)
        return o[:, 0].to(dtype)
    o = sg.fused_sigmoid_gating_delta_rule_update(w["A_log"], a1[:, None], w["dt_bias"], 1.0, 20.0, q, k, v,
                                                  b1[:, None], ssm_pool, slots, K ** -0.5, True)
    return o[:, 0]


def _vllm_chain(ops, w, toks, dtype, engine="packed"):
    """The prefill of every prompt in one call, then STEPS decode calls of one token per request (engine: which decode
    op, _decode): (outputs per request [T_n + STEPS, HV, V], the ssm pool)."""
    S = max(SLOTS) + 1
    conv_pool = torch.full((S, D, W - 1), 7.0, dtype=dtype, device=DEV)        # stale rows: must not be read
    ssm_pool = torch.full((S, HV, V, K), 7.0, dtype=dtype, device=DEV)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, *torch.tensor(PROMPTS).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    x = torch.cat([t["x"][:n] for t, n in zip(toks, PROMPTS)])                 # [T, D]: the packed prompts
    a = torch.cat([t["a"][:n] for t, n in zip(toks, PROMPTS)])
    b = torch.cat([t["b"][:n] for t, n in zip(toks, PROMPTS)])
    fresh = torch.zeros(len(PROMPTS), dtype=torch.bool, device=DEV)            # new requests: no initial state
    y = ops.causal_conv1d_fn(x.t(), w["conv"], None, conv_pool, qsl, cache_indices=slots, has_initial_state=fresh,
                             activation="silu").t()
    q, k, v, g, beta = ops.fused_post_conv_prep(y, a, b, w["A_log"], w["dt_bias"], H, K, V, True)
    h0 = torch.zeros(len(PROMPTS), HV, V, K, dtype=dtype, device=DEV)          # (vLLM zeroes the new requests' rows)
    o, ht = ops.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                                       output_final_state=True, cu_seqlens=qsl, state_layout="vk")
    ssm_pool[slots.long()] = ht.to(dtype)
    outs = list(o[0].split(list(PROMPTS)))
    for step in range(STEPS):
        xs = torch.stack([t["x"][n + step] for t, n in zip(toks, PROMPTS)])   # [N, D]: one token per request
        a1 = torch.stack([t["a"][n + step] for t, n in zip(toks, PROMPTS)])
        b1 = torch.stack([t["b"][n + step] for t, n in zip(toks, PROMPTS)])
        y1 = ops.causal_conv1d_update(xs, conv_pool, w["conv"], None, "silu", conv_state_indices=slots)
        out = _decode(ops, RS if ops is RV else FS, engine, y1, a1, b1, w, ssm_pool, slots, dtype)
        outs = [torch.cat([o_n, out[n][None]]) for n, o_n in enumerate(outs)]
    return outs, ssm_pool


def _truth(w, toks):
    """One float64 pass of conv, gates and delta rule over each request's whole history: (outputs, final states
    [HV, V, K] as the pool keeps them)."""
    outs, states = [], []
    for t in toks:
        x = t["x"].double()[None]                                               # [1, T, D]
        y = refgdn.causal_conv1d(x, w["conv"].double(), None, "silu")[0][0]     # [T, D]
        q = y[:, :H * K].unflatten(1, (H, K))[None]
        k = y[:, H * K:2 * H * K].unflatten(1, (H, K))[None]
        v = y[:, 2 * H * K:].unflatten(1, (HV, V))[None]
        g, beta = refgdn.gdn_gating(w["A_log"].double(), t["a"].double(), w["dt_bias"].double(), t["b"].double())
        o, ht = refgdn.recurrent_gated_delta_rule(q, k, v, g[None], beta[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        states.append(ht[0].transpose(-1, -2))
    return outs, states


ENGINES = [pytest.param("packed", id="vllm-packed-decode"), pytest.param("vllm-sigmoid", id="vllm-gated-recurrent"),
           pytest.param("sglang", id="sglang-op")]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", [1])
def test_refgdn_chain_is_one_pass_over_the_history(seed, engine):
    """float64: prefill + decode steps through vLLM's op chain (refgdn) equal one pass over each request's tokens;
    the pool's rows of the requests hold their final states, every other row (the null block 0 included) is
    untouched."""
    w, toks = _layer(seed, torch.float64)
    outs, pool = _vllm_chain(RV, w, toks, torch.float64, engine)
    want, states = _truth(w, toks)
    for n, slot in enumerate(SLOTS):
        torch.testing.assert_close(outs[n], want[n], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pool[slot], states[n], rtol=1e-10, atol=1e-12)
    others = [s for s in range(pool.shape[0]) if s not in SLOTS]
    assert torch.equal(pool[others], torch.full_like(pool[others], 7.0))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", [1])
def test_fast_chain_by_the_conformance_rule(seed, engine):
    """float32: fast's chain against the float64 truth within the conformance rule (refgdn's chain in float32 as the
    reference error), outputs and final states; the other rows untouched, bit for bit."""
    w, toks = _layer(seed, torch.float32)
    outs_f, pool_f = _vllm_chain(FV, w, toks, torch.float32, engine)
    outs_r, pool_r = _vllm_chain(RV, w, toks, torch.float32, engine)
    want, states = _truth(w, toks)
    checks = [Check("o", torch.cat(outs_f), torch.cat(want), torch.cat(outs_r)),
              Check("final states", pool_f[list(SLOTS)], torch.stack(states), pool_r[list(SLOTS)])]
    for check in checks:
        res = evaluate(check)
        assert res["passed"], (check.name, res)
    others = [s for s in range(pool_f.shape[0]) if s not in SLOTS]
    assert torch.equal(pool_f[others], torch.full_like(pool_f[others], 7.0))
