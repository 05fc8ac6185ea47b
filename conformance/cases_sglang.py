"""Conformance cases for SGLang's fused decode op (fast.sglang_ops against refgdn.sglang_ops).

fused_sigmoid_gating_delta_rule_update: the gates formed from raw projections, each sequence's state in a slot of a
pool in SGLang's [S, HV, V, K] layout, updated in place. Checked per case:

    o (every token, padded sequences' included: SGLang computes them from a zero state)   tolerance (computed)
    written slots; target verify's cached steps                                         tolerance (computed)
    every other slot and cache entry                                                    exact

The truth is refgdn's op in float64 on the same rounded inputs and a float64 copy of the pool; refgdn_p runs in the
precision under test on the same pool dtype as fast (the rule in conformance.core).
"""
from __future__ import annotations

from typing import List

import torch

from .cases_prefill import family_cases
from .core import Check, row_checks

OP = "sglang_fused_sigmoid_gating_delta_rule_update"


def problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(args, kwargs) of one call in the op's order: args = [A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, idx];
    q, k, v, a, b in dtype (k unit-norm unless l2; a, b [B * T, HV] unless p["gates3d"]); A_log, dt_bias float32;
    the pool [S, HV, V, K] in p["pool_dtype"] (float32). p: B, T, cu (offsets) or None, idx (one slot per sequence,
    negative: padded); H, HV, K, V (1, 2, 16, 16); l2; scale; slots (9); frozen (disable_state_update); cache (target
    verify: dict(C, steps, rows (None: row n), dtype): intermediate_states_buffer [C, steps, HV, V, K] of random
    contents, disable_state_update)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = p["B"], p["T"]
    HV, V, K = p.get("HV", 2), p.get("V", 16), p.get("K", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, a, b, A_log, dt_bias = raw_gate_inputs(p, B, T, dtype, device, gen, bool(p.get("gates3d")))
    pool = (0.5 * r(p.get("slots", 9), HV, V, K)).to(p.get("pool_dtype", torch.float32)).to(device)
    idx = torch.tensor(p["idx"], dtype=torch.int32, device=device)
    kw = dict(scale=p.get("scale"), use_qk_l2norm_in_kernel=bool(p.get("l2")),
              disable_state_update=bool(p.get("frozen")))
    if p.get("cu") is not None:
        kw["cu_seqlens"] = torch.tensor(p["cu"], dtype=torch.int32, device=device)
    c = p.get("cache")
    if c:
        buf = r(c["C"], c["steps"], HV, V, K).to(c.get("dtype", torch.float32)).to(device)
        kw.update(disable_state_update=True, cache_steps=c["steps"], intermediate_states_buffer=buf)
        if c.get("rows") is not None:
            kw["intermediate_state_indices"] = torch.tensor(c["rows"], dtype=torch.int32, device=device)
    return [A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, idx], kw


def raw_gate_inputs(p: dict, B: int, T: int, dtype: torch.dtype, device: str, gen: torch.Generator,
                    gates3d: bool) -> tuple:
    """(q, k [B, T, H, K], v [B, T, HV, V] in dtype (k unit-norm unless p["l2"]), the raw gates a, b in dtype ([B, T,
    HV] when gates3d, else [B * T, HV]), A_log, dt_bias [HV] float32), drawn from gen in this order; H, HV, K, V from
    p (1, 2, 16, 16). The problems of the decode ops that form their gates in the kernel (SGLang's, FlashInfer's)."""
    H, HV, K, V = p.get("H", 1), p.get("HV", 2), p.get("K", 16), p.get("V", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not p.get("l2"):
        k = torch.nn.functional.normalize(k, dim=-1)
    q, k, v = (x.to(dtype).to(device) for x in (q, k, v))
    a, b = (r(*((B, T, HV) if gates3d else (B * T, HV))).to(dtype).to(device) for _ in range(2))
    A_log = (torch.rand(HV, generator=gen, dtype=torch.float64) * 2 - 1).float().to(device)
    dt_bias = (0.5 * r(HV)).float().to(device)
    return q, k, v, a, b, A_log, dt_bias


def run(op, args: list, kw: dict, buffer=None) -> tuple:
    """op with fresh copies of the pool and of the verify cache (``buffer``, default kw's) -> (o, the pool copy
    after the call, the cache copy after it or None)."""
    args, kw = list(args), dict(kw)
    args[9] = args[9].clone()
    buf = kw.get("intermediate_states_buffer") if buffer is None else buffer
    if buf is not None:
        kw["intermediate_states_buffer"] = buf = buf.clone()
    return op(*args, **kw), args[9], buf


def checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.sglang_ops as FS
    import refgdn.sglang_ops as RS
    args, kw = problem(p, dtype, device, seed)
    wide = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    buf = kw.get("intermediate_states_buffer")
    o_f, pool_f, buf_f = run(FS.fused_sigmoid_gating_delta_rule_update, args, kw)
    o_r, pool_r, buf_r = run(RS.fused_sigmoid_gating_delta_rule_update, args, kw)
    o_t, pool_t, buf_t = run(RS.fused_sigmoid_gating_delta_rule_update, wide, kw,
                             None if buf is None else buf.double())
    pool = args[9]
    out = [Check("o", o_f, o_t, o_r)] + row_checks("slots", pool, pool_f, pool_t, pool_r)
    if buf is not None:             # verify: the cached steps by the rule, every other entry of the cache exact
        out += row_checks("steps", *(t.flatten(0, 1) for t in (buf, buf_f, buf_t, buf_r)), written="cached",
                          untouched="other")           # [C steps, HV, V, K]
    return out


def families(quick: bool, device: str) -> dict:
    """SGLang's decode (B = 1, one token per sequence through cu_seqlens, a padded sequence), several tokens per
    sequence with an empty one, dense [B, T] with [B, T, HV] gates, the state update disabled, a bfloat16 pool,
    target verify (every step's state to intermediate_states_buffer: rows by index with a sequence padded and one not
    cached, or row n, a bf16 cache), three value heads per key head, K / V not powers of two with a scale. Quick: 1 / 2
    heads of 16; full: Qwen3-Next's 16 / 32 heads of 128 where the family allows."""
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128)
    out = {
        "decode-varlen-padded": dict(B=1, T=5, cu=[0, 1, 2, 3, 4, 5], idx=[4, -1, 0, 7, 2], l2=True),
        "multi-token-empty-seq": dict(B=1, T=7, cu=[0, 3, 3, 7], idx=[1, 5, 8], l2=True),
        "dense-3d-gates": dict(B=2, T=3, idx=[6, 3], gates3d=True),
        "frozen-state": dict(B=1, T=4, cu=[0, 2, 4], idx=[2, 7], l2=True, frozen=True),
        "bf16-pool": dict(B=1, T=3, cu=[0, 1, 2, 3], idx=[8, 0, 3], l2=True, pool_dtype=torch.bfloat16),
    }
    out = {name: dict(p, **qwen) for name, p in out.items()}
    out["verify-cache-rows"] = dict(B=1, T=7, cu=[0, 3, 4, 7], idx=[2, -1, 5], l2=True,
                                    cache=dict(C=3, steps=3, rows=[1, 0, -1]), **qwen)
    out["verify-cache-row-n-bf16"] = dict(B=1, T=4, cu=[0, 2, 4], idx=[3, 6], l2=True,
                                          cache=dict(C=2, steps=4, dtype=torch.bfloat16), **qwen)
    out["gva3"] = dict(B=1, T=4, cu=[0, 1, 3, 4], idx=[5, 1, 6], l2=True,
                       **(dict(H=2, HV=6) if quick else dict(H=16, HV=48, K=128, V=128)))
    out["odd-KV-scale"] = dict(B=1, T=4, cu=[0, 2, 4], idx=[3, 0], H=2, HV=4, K=24, V=40, l2=True, scale=0.3)
    return out


def cases(quick: bool, device: str) -> list:
    return family_cases(quick, device, ((OP, families, checks),), needs="fast.sglang_ops")
