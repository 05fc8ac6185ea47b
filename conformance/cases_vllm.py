"""Conformance cases for vLLM's serving recurrent op (fast.vllm_ops.fused_recurrent_gated_delta_rule against
refgdn.vllm_ops's): a slot pool read and written in place, per-token slots with num_accepted_tokens, padded
sequences, per-token states returned. Checked per case:

    o (every token)                                   tolerance (computed)
    written slots / per-token states                  tolerance (computed), in the pool's dtype
    untouched slots, padded sequences' outputs        exact

The truth is refgdn's op in float64 on the same rounded inputs and a float64 copy of the pool; refgdn_p runs in
the precision under test on the same pool dtype as fast (the rule in conformance.core). The problem builder is
shared with tests/test_vllm_ops.py.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .cases_prefill import dtypes_for, seed_of
from .core import DTYPE_NAMES, Case, Check

OP = "vllm_fused_recurrent_gated_delta_rule"


def problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(xs, pool, kwargs) of one call: xs = [q, k, v, g, beta] with q, k, v in dtype (k unit-norm unless l2) and g,
    beta float32; pool: the slot pool [slots, HV, K, V] in p["pool_dtype"] (float32), the per-sequence states
    [N, HV, K, V] (p["pool"] == "per-seq") or None (p["pool"] False); kwargs: the op's keywords.

    p: B, T; H, HV, K, V (1, 2, 16, 16); cu (offsets) or None; idx ([N] or [N, L] slots) or None; acc
    (num_accepted_tokens) or None; inplace (True); l2; strided (q, k, v slices of one wider buffer); scale; slots (9).
    """
    gen = torch.Generator().manual_seed(seed)
    B, T = p["B"], p["T"]
    H, HV, K, V = p.get("H", 1), p.get("HV", 2), p.get("K", 16), p.get("V", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if not p.get("l2"):
        k = torch.nn.functional.normalize(k, dim=-1)
    g = -2.0 * torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    xs = [x.to(dtype).to(device) for x in (q, k, v)] + [x.float().to(device) for x in (g, beta)]
    if p.get("strided"):        # q, k, v as slices of wider buffers (vLLM splits one projection)
        xs[:3] = [torch.cat([x, torch.zeros_like(x[..., :3])], -1)[..., :x.shape[-1]] for x in xs[:3]]
    N = B if p.get("cu") is None else len(p["cu"]) - 1
    kind = p.get("pool", True)
    if kind == "per-seq":
        pool = (0.5 * r(N, HV, K, V)).float().to(device)
    elif kind:
        pool = (0.5 * r(p.get("slots", 9), HV, K, V)).to(p.get("pool_dtype", torch.float32)).to(device)
    else:
        pool = None
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    kw = dict(inplace_final_state=p.get("inplace", True), use_qk_l2norm_in_kernel=p.get("l2", False),
              scale=p.get("scale"))
    for key, name in (("cu", "cu_seqlens"), ("idx", "ssm_state_indices"), ("acc", "num_accepted_tokens")):
        if p.get(key) is not None:
            kw[name] = i32(p[key])
    return xs, pool, kw


def run(op, xs: list, pool: Optional[torch.Tensor], kw: dict) -> tuple:
    """op on xs with a fresh copy of the pool -> (o, final_state, the pool copy after the call)."""
    pool = None if pool is None else pool.clone()
    o, fs = op(*xs, initial_state=pool, **kw)
    return o, fs, pool


def padded_tokens(p: dict) -> List[int]:
    """Token indices (of the flattened [B * T] axis) of padded sequences (their read slot is negative)."""
    if p.get("idx") is None:
        return []
    cu = p.get("cu") or [n * p["T"] for n in range(p["B"] + 1)]
    out = []
    for n, row in enumerate(p["idx"]):
        row = row if isinstance(row, list) else [row]
        if row[p["acc"][n] - 1 if p.get("acc") else 0] < 0:
            out += list(range(cu[n], cu[n + 1]))
    return out


def checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    """fast vs refgdn in dtype vs refgdn in float64 (module docstring)."""
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    xs, pool, kw = problem(p, dtype, device, seed)
    o_f, fs_f, pool_f = run(FV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    o_r, fs_r, pool_r = run(RV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    o_t, fs_t, pool_t = run(RV.fused_recurrent_gated_delta_rule, [x.double() for x in xs],
                            None if pool is None else pool.double(), kw)
    pad = padded_tokens(p)
    flat = o_f.reshape(-1, *o_f.shape[2:])
    out = [Check("o", o_f, o_t, o_r), Check("padded outputs", flat[pad], torch.zeros_like(flat[pad]), exact=True)]
    if kw["inplace_final_state"]:
        moved = [s for s in range(pool.shape[0]) if not torch.equal(pool_r[s], pool[s])]
        still = [s for s in range(pool.shape[0]) if s not in moved]
        out += [Check("written slots", pool_f[moved], pool_t[moved], pool_r[moved], dtype=pool.dtype),
                Check("untouched slots", pool_f[still], pool[still], exact=True)]
    else:
        out.append(Check("per-token states", fs_f, fs_t, fs_r, dtype=fs_f.dtype))
        if pool is not None:
            out.append(Check("pool (read only)", pool_f, pool, exact=True))
    return out


def families(quick: bool, device: str) -> dict:
    """Decode with [N] slots and a padded row; speculative verification with [N, L] slots and accepted counts (a
    padded row, a negative write entry), in place and returning every token's state; varlen without a state (an
    empty sequence); per-sequence states written back; a bfloat16 pool. Quick: 1 / 2 heads of 16; full: Qwen3-Next's
    16 / 32 heads of 128 (GVA 2) and the l2norm in the kernel."""
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128, l2=True)
    out = {
        "decode-idx1d-padded": dict(B=6, T=1, idx=[5, -1, 2, 0, 7, 3]),
        "spec-k2-idx2d-accepted": dict(B=1, T=9, cu=[0, 3, 6, 9], idx=[[0, 1, 2], [3, 4, -1], [6, 7, 8]],
                                       acc=[2, 1, 3]),
        "spec-k2-idx2d-padded-row": dict(B=1, T=9, cu=[0, 3, 6, 9], idx=[[0, 1, 2], [-1, 4, 5], [6, 7, 8]],
                                         acc=[3, 1, 1]),
        "spec-k2-per-token-states": dict(B=1, T=9, cu=[0, 3, 6, 9], idx=[[0, 1, 2], [3, 4, 5], [6, 7, 8]],
                                         acc=[1, 2, 3], inplace=False),
        "varlen-empty-no-state": dict(B=1, T=8, cu=[0, 3, 3, 8], pool=False, inplace=False),
        "dense-per-sequence-state": dict(B=2, T=3, pool="per-seq"),
        "decode-bf16-pool": dict(B=3, T=1, idx=[4, 1, 7], pool_dtype=torch.bfloat16),
    }
    out = {name: dict(p, **qwen) for name, p in out.items()}
    out["gva-l2norm-strided-odd-V"] = dict(B=1, T=6, cu=[0, 2, 4, 6], idx=[[8, 3], [1, 0], [2, 5]], H=2, HV=4, K=32,
                                           V=24, l2=True, strided=True, scale=0.3)
    return out


def cases(quick: bool, device: str) -> list:
    try:
        import fast.vllm_ops  # noqa: F401
    except ImportError:
        return []
    out = []
    for family, p in families(quick, device).items():
        for dt in dtypes_for(device):
            name = f"{OP}/{family}/{DTYPE_NAMES[dt]}"
            out.append(Case(op=OP, case=family, dtype=dt, quick=quick,
                            run=lambda device, p=p, dt=dt, name=name: checks(p, dt, device, seed_of(name))))
    return out
