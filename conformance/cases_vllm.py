"""Conformance cases for the ops vLLM calls (fast.vllm_ops against refgdn.vllm_ops).

The serving recurrent op (fused_recurrent_gated_delta_rule): a slot pool read and written in place, per-token slots
with num_accepted_tokens, padded sequences, per-token states returned. Checked per case:

    o (every token)                                   tolerance (computed)
    written slots / per-token states                  tolerance (computed), in the pool's dtype
    untouched slots, padded sequences' outputs        exact

The truth is refgdn's op in float64 on the same rounded inputs and a float64 copy of the pool; refgdn_p runs in
the precision under test on the same pool dtype as fast (the rule in conformance.core).

The packed decode (fused_recurrent_gated_delta_rule_packed_decode: gates, l2norm and delta rule on the conv's packed
rows, the pool in vLLM's [S, HV, V, K] layout, slot 0 its null block): out and the written slots by the rule, null
requests' outputs (zeros) and the other slots exact.

The prefill preparation (fused_post_conv_prep: the conv's packed rows split into q, k, v, the l2norm and the gates):
q, k, g and beta by the rule, v exactly (a copy).

The conv (causal_conv1d_update in vLLM's form: rows picked by conv_state_indices, drafts kept for the next call's
window at num_accepted_tokens - 1): y by the rule; the new conv_state rows exactly refgdn's in the same precision
(they are copies of inputs); untouched rows and padded requests' outputs exact. The problem builders are shared
with tests/test_vllm_ops.py.

The chunk op (chunk_gated_delta_rule in vLLM's order, its default call: fast builds every chunk table on the device):
o (written into core_attn_out) and the final states by the rule, "vk" states included.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .cases_prefill import family_cases
from .core import Check, row_checks

OP = "vllm_fused_recurrent_gated_delta_rule"
PACKED_OP = "vllm_packed_decode"
CONV_OP = "vllm_causal_conv1d_update"
CONV_FN_OP = "vllm_causal_conv1d_fn"
POST_CONV_OP = "vllm_fused_post_conv_prep"
CHUNK_OP = "vllm_chunk_gated_delta_rule"


def problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(xs, pool, kwargs) of one call: xs = [q, k, v, g, beta] with q, k, v in dtype (k unit-norm unless l2) and g,
    beta float32; pool: the slot pool [slots, HV, K, V] in p["pool_dtype"] (float32), the per-sequence states
    [N, HV, K, V] (p["pool"] == "per-seq") or None (p["pool"] False); kwargs: the op's keywords.

    p: B, T; H, HV, K, V (1, 2, 16, 16); cu (offsets) or None; idx ([N] or [N, L] slots) or None; acc
    (num_accepted_tokens) or None; inplace (True); l2; strided (q, k, v slices of one wider buffer); scale; slots (9);
    layout ("vk": states [.., HV, V, K], newer vLLM's); null (null_block_id: entries <= it pad; -1).
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
    vk = p.get("layout") == "vk"
    if vk and pool is not None:
        pool = pool.transpose(-1, -2).contiguous()            # [.., HV, V, K]: newer vLLM's layout
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    kw = dict(inplace_final_state=p.get("inplace", True), use_qk_l2norm_in_kernel=p.get("l2", False),
              scale=p.get("scale"))
    if vk:
        kw["state_layout"] = "vk"
    if p.get("null") is not None:
        kw["null_block_id"] = p["null"]
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
    """Token indices (of the flattened [B * T] axis) of padded sequences (their read slot <= p's null, -1)."""
    if p.get("idx") is None:
        return []
    cu = p.get("cu") or [n * p["T"] for n in range(p["B"] + 1)]
    out = []
    for n, row in enumerate(p["idx"]):
        row = row if isinstance(row, list) else [row]
        if row[p["acc"][n] - 1 if p.get("acc") else 0] <= p.get("null", -1):
            out += list(range(cu[n], cu[n + 1]))
    return out


def checks(p: dict, dtype: torch.dtype, device: str, seed: int, sigmoid: bool = False) -> List[Check]:
    """fast vs refgdn in dtype vs refgdn in float64 (module docstring). sigmoid: newer vLLM's
    fused_sigmoid_gating_delta_rule_update on the same problem, raw gates a, b (sigmoid_inputs) in place of g, beta."""
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    xs, pool, kw = problem(p, dtype, device, seed)
    name = "fused_recurrent_gated_delta_rule"
    if sigmoid:
        xs, kw, name = sigmoid_inputs(xs, kw, dtype, seed), dict(kw), "fused_sigmoid_gating_delta_rule_update"
        kw.pop("state_layout"), kw.pop("null_block_id")            # (the op's own: "vk" and 0)
    o_f, fs_f, pool_f = run(getattr(FV, name), xs, pool, kw)
    o_r, fs_r, pool_r = run(getattr(RV, name), xs, pool, kw)
    o_t, fs_t, pool_t = run(getattr(RV, name), [x.double() for x in xs], None if pool is None else pool.double(), kw)
    pad = padded_tokens(p)
    flat = o_f.reshape(-1, *o_f.shape[2:])
    out = [Check("o", o_f, o_t, o_r), Check("padded outputs", flat[pad], torch.zeros_like(flat[pad]), exact=True)]
    if kw["inplace_final_state"]:
        out += row_checks("slots", pool, pool_f, pool_t, pool_r)
    else:
        out.append(Check("per-token states", fs_f, fs_t, fs_r, dtype=fs_f.dtype))
        if pool is not None:
            out.append(Check("pool (read only)", pool_f, pool, exact=True))
    return out


SIGMOID_OP = "vllm_fused_sigmoid_gating_delta_rule_update"


def sigmoid_inputs(xs: list, kw: dict, dtype: torch.dtype, seed: int) -> list:
    """problem()'s [q, k, v, g, beta] -> newer vLLM's fused_sigmoid_gating_delta_rule_update's leading arguments
    [A_log, a, b, dt_bias, q, k, v]: raw gates a, b [B * T, HV] in dtype (a + dt_bias across softplus' threshold, b
    saturating the sigmoid in places), A_log, dt_bias [HV] float32."""
    gen = torch.Generator().manual_seed(seed + 7)
    q, k, v = xs[:3]
    B, T, HV = v.shape[:3]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    a, b = (12.0 * r(B * T, HV)).to(dtype).to(v.device), (8.0 * r(B * T, HV)).to(dtype).to(v.device)
    A_log = (torch.rand(HV, generator=gen, dtype=torch.float64) * 2 - 1).float().to(v.device)
    return [A_log, a, b, (0.5 * r(HV)).float().to(v.device), q, k, v]


def sigmoid_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    return checks(p, dtype, device, seed, sigmoid=True)


def sigmoid_families(quick: bool, device: str) -> dict:
    """Newer vLLM's fused op: the recurrent op's newer-generation families (states [.., HV, V, K], the null block 0),
    a bfloat16 pool (o in q's dtype; float32 with a float32 pool), three value heads per key head with the l2norm."""
    out = {name: p for name, p in families(quick, device).items() if p.get("layout") == "vk"}
    for name, p in list(out.items()):
        out[name] = dict(p, null=0)
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128, l2=True)
    out["vk-decode-bf16-pool"] = dict(B=3, T=1, idx=[4, 1, 0], layout="vk", null=0, pool_dtype=torch.bfloat16, **qwen)
    out["vk-gva3-spec-l2norm"] = dict(B=1, T=6, cu=[0, 2, 4, 6], idx=[[8, 3], [1, 0], [2, 5]], acc=[2, 1, 1],
                                      l2=True, layout="vk", null=0,
                                      **(dict(H=2, HV=6) if quick else dict(H=16, HV=48, K=128, V=128)))
    return out


def families(quick: bool, device: str) -> dict:
    """Decode with [N] slots and a padded row; speculative verification with [N, L] slots and accepted counts (a
    padded row, a negative write entry), in place and returning every token's state; varlen without a state (an
    empty sequence); per-sequence states written back; a bfloat16 pool; newer vLLM's [.., HV, V, K] states with its
    null block 0 (several requests on it). Quick: 1 / 2 heads of 16; full: Qwen3-Next's
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
        # newer vLLM's generation (third_party fla): states [.., HV, V, K], entries <= 0 (NULL_BLOCK_ID) padding
        "vk-decode-null-block": dict(B=5, T=1, idx=[3, 0, 6, 0, 1], layout="vk", null=0),
        "vk-spec-null-block": dict(B=1, T=9, cu=[0, 3, 6, 9], idx=[[1, 2, 3], [4, 0, 5], [0, 7, 8]], acc=[2, 1, 1],
                                   layout="vk", null=0),
        "vk-per-token-states": dict(B=1, T=6, cu=[0, 2, 4, 6], idx=[[1, 2], [3, 4], [5, 6]], acc=[1, 2, 1],
                                    inplace=False, layout="vk", null=0),
        "vk-per-sequence-state": dict(B=2, T=3, pool="per-seq", layout="vk"),
    }
    out = {name: dict(p, **qwen) for name, p in out.items()}
    out["gva-l2norm-strided-odd-V"] = dict(B=1, T=6, cu=[0, 2, 4, 6], idx=[[8, 3], [1, 0], [2, 5]], H=2, HV=4, K=32,
                                           V=24, l2=True, strided=True, scale=0.3)
    # three value heads per key head (Qwen3.5-27B: 16 / 48)
    out["gva3-spec-l2norm"] = dict(B=1, T=6, cu=[0, 2, 4, 6], idx=[[8, 3], [1, 0], [2, 5]], acc=[2, 1, 1], l2=True,
                                   **(dict(H=2, HV=6) if quick else dict(H=16, HV=48, K=128, V=128)))
    return out


def packed_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(args, out) of one packed-decode call: args = [mixed_qkv, a, b, A_log, dt_bias, scale, pool, ssm_state_indices,
    l2] in the op's order with out (filled with a sentinel: every entry must be written) between pool and the indices
    added by the caller; mixed_qkv and a, b in dtype (k unit-norm unless l2), A_log / dt_bias float32, the pool [S, HV,
    V, K] in p["pool_dtype"] (float32).

    p: idx (one slot per request; <= 0 the null block); H, HV, K, V (1, 2, 16, 16); l2; scale; slots (9); strided
    (mixed_qkv rows of a wider buffer, the pool a page-strided view: vLLM's hybrid-cache pages)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(p["idx"])
    H, HV, K, V = p.get("H", 1), p.get("HV", 2), p.get("K", 16), p.get("V", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, H, K), r(B, H, K), r(B, HV * V)
    if not p.get("l2"):
        k = torch.nn.functional.normalize(k, dim=-1)
    x = torch.cat([q.flatten(1), k.flatten(1), v], 1).to(dtype).to(device)          # [B, 2 H K + HV V]
    if p.get("strided"):
        x = torch.cat([x, torch.zeros_like(x[:, :5])], 1)[:, :x.shape[1]]
    a, b = (r(B, HV).to(dtype).to(device) for _ in range(2))
    A_log = (torch.rand(HV, generator=gen, dtype=torch.float64) * 2 - 1).float().to(device)
    dt_bias = (0.5 * r(HV)).float().to(device)
    S = p.get("slots", 9)
    pool = (0.5 * r(S, HV, V, K)).to(p.get("pool_dtype", torch.float32)).to(device)
    if p.get("strided"):        # each slot a page: [V, K] blocks with a gap after every head
        page = torch.zeros(S, HV, V + 1, K, dtype=pool.dtype, device=device)
        page[:, :, :V] = pool
        pool = page[:, :, :V]
    idx = torch.tensor(p["idx"], dtype=torch.int32, device=device)
    return [x, a, b, A_log, dt_bias, p.get("scale"), pool, idx, bool(p.get("l2"))]


def packed_run(op, args: list) -> tuple:
    """op on args with a fresh copy of the pool (its strides kept) and an out full of NaN -> (out, pool copy)."""
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = args
    pool_c = torch.empty_strided(pool.shape, pool.stride(), dtype=pool.dtype, device=pool.device)
    pool_c.copy_(pool)
    out = torch.full((x.shape[0], 1, pool.shape[1], pool.shape[2]), float("nan"), dtype=x.dtype, device=x.device)
    got, state = op(x, a, b, A_log, dt_bias, scale, pool_c, out, idx, l2)
    assert got is out and state is pool_c
    return out, pool_c


def packed_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    """fast vs refgdn in dtype vs refgdn in float64 (the module's rule): out, the written slots (in the pool's
    dtype); the null requests' outputs (zeros) and every other slot exactly."""
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    args = packed_problem(p, dtype, device, seed)
    wide = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    o_f, pool_f = packed_run(FV.fused_recurrent_gated_delta_rule_packed_decode, args)
    o_r, pool_r = packed_run(RV.fused_recurrent_gated_delta_rule_packed_decode, args)
    o_t, pool_t = packed_run(RV.fused_recurrent_gated_delta_rule_packed_decode, wide)
    pool = args[6]
    null = [n for n, s in enumerate(p["idx"]) if s <= 0]
    moved = sorted(s for s in p["idx"] if s > 0)
    still = [s for s in range(pool.shape[0]) if s not in moved]
    return [Check("out", o_f, o_t, o_r), Check("null requests' outputs", o_f[null], torch.zeros_like(o_f[null]),
                                               exact=True),
            Check("written slots", pool_f[moved], pool_t[moved], pool_r[moved], dtype=pool.dtype),
            Check("untouched slots", pool_f[still], pool[still], exact=True)]


def packed_families(quick: bool, device: str) -> dict:
    """One token per request from its slot; null requests (slot 0, vLLM's null block, and a negative entry); the
    l2norm in the kernel; a bfloat16 pool (vLLM's default); Qwen3.5-27B's three value heads per key head; K, V not
    powers of two with a scale; page-strided pool and strided rows. Quick: 1 / 2 heads of 16; full: Qwen3-Next's
    16 / 32 heads of 128."""
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128)
    out = {
        "decode-null-slots": dict(idx=[5, 0, 2, -1, 7, 3]),
        "decode-l2norm": dict(idx=[4, 1, 8], l2=True),
        "decode-bf16-pool-l2norm": dict(idx=[6, 2, 0], l2=True, pool_dtype=torch.bfloat16),
        "decode-strided-pages": dict(idx=[1, 8, 0, 4], l2=True, strided=True),
    }
    out = {name: dict(p, **qwen) for name, p in out.items()}
    out["gva3-l2norm"] = dict(idx=[3, 7, 0], l2=True, **(dict(H=2, HV=6) if quick else dict(H=16, HV=48, K=128,
                                                                                              V=128)))
    out["odd-KV-scale"] = dict(idx=[2, 0, 5], H=2, HV=4, K=24, V=40, l2=True, scale=0.3)
    return out


def conv_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(x, conv_state, weight, bias, kwargs) of one conv call: x in dtype, conv_state [S, D, C] in p["state_dtype"]
    (dtype), weight [D, W] and bias [D] in dtype (bias None with p["bias"] False).

    p: D, W (4), S (slots, 6), C (columns, W - 1); B with L (x [B, D] when L is None, else [B, D, L]) or qsl
    (offsets: x [T, D]); idx, acc (lists) or None; act ("silu"; None, or True / False as vLLM's bool)."""
    gen = torch.Generator().manual_seed(seed)
    D, W = p["D"], p.get("W", 4)
    C = p.get("C", W - 1)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if p.get("qsl") is not None:
        x = r(p["qsl"][-1], D)
    elif p.get("L") is None:
        x = r(p["B"], D)
    else:
        x = r(p["B"], D, p["L"])
    x = x.to(dtype).to(device)
    state = r(p.get("S", 6), D, C).to(p.get("state_dtype", dtype)).to(device)
    weight = (r(D, W) / W ** 0.5).to(dtype).to(device)
    bias = (0.1 * r(D)).to(dtype).to(device) if p.get("bias", True) else None
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    kw = dict(activation=p.get("act", "silu"))
    for key, name in (("idx", "conv_state_indices"), ("acc", "num_accepted_tokens"), ("qsl", "query_start_loc")):
        if p.get(key) is not None:
            kw[name] = i32(p[key])
    if p.get("qsl") is not None:
        kw["max_query_len"] = max(b - a for a, b in zip(p["qsl"], p["qsl"][1:]))
    return x, state, weight, bias, kw


def conv_padded(p: dict) -> torch.Tensor:
    """A bool mask over x's request axis (dim 0, or the packed tokens with qsl) of padded requests' entries."""
    idx = p.get("idx")
    if idx is None:
        return torch.zeros(p["B"] if p.get("qsl") is None else p["qsl"][-1], dtype=torch.bool)
    if p.get("qsl") is None:
        return torch.tensor([s < 0 for s in idx])
    out = torch.zeros(p["qsl"][-1], dtype=torch.bool)
    for b, s in enumerate(idx):
        if s < 0:
            out[p["qsl"][b]:p["qsl"][b + 1]] = True
    return out


def conv_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    from fast.utils import interpreter_bf16_round_to_nearest
    x, state, w, b, kw = conv_problem(p, dtype, device, seed)
    s_f, s_r, s_t = state.clone(), state.clone(), state.double()
    # a bf16 state under wider x: x's rounding to it happens in the kernel, which the interpreter truncates unless
    # told to round as a GPU does (conformance.core.Case.checks does that for bf16 cases only)
    with interpreter_bf16_round_to_nearest():
        y_f = FV.causal_conv1d_update(x, s_f, w, b, **kw)
    y_r = RV.causal_conv1d_update(x, s_r, w, b, **kw)
    y_t = RV.causal_conv1d_update(x.double(), s_t, w.double(), None if b is None else b.double(), **kw)
    pad = conv_padded(p).to(device)
    moved = [i for i in range(state.shape[0]) if not torch.equal(s_r[i], state[i])]
    still = [i for i in range(state.shape[0]) if i not in moved]
    return [Check("y", y_f, y_t, y_r), Check("padded outputs", y_f[pad], torch.zeros_like(y_f[pad]), exact=True),
            Check("new conv_state rows", s_f[moved], s_r[moved], exact=True),
            Check("untouched rows", s_f[still], state[still], exact=True)]


def conv_families(quick: bool, device: str) -> dict:
    """Decode (x [B, D], rows by index, a padded request), x [B, D, 1] without indices, speculative verification
    (varlen and [B, D, L], drafts kept, windows from num_accepted_tokens - 1), a non-speculative varlen call with a
    zero-length request, a bf16 state under float32 x (x rounded first), width 2 without bias or activation.
    Quick: D = 40; full: Qwen3-Next's D = 8192."""
    D = 40 if quick else 8192
    k = 3
    return {
        "decode-idx-padded": dict(D=D, B=4, idx=[3, -1, 0, 5]),
        "decode-3d-rows-by-position": dict(D=D, B=3, L=1),
        "spec-k3-varlen-accepted": dict(D=D, qsl=[0, 4, 8, 12], idx=[0, 5, 2], acc=[1, 3, 4], C=2 + 1 + k),
        "spec-k2-3d-accepted-padded": dict(D=D, B=3, L=3, idx=[4, -1, 1], acc=[2, 1, 3], C=2 + 3),
        "varlen-mixed-lengths": dict(D=D, qsl=[0, 1, 4, 4, 6], idx=[1, 2, 3, 0], act=True),
        "bf16-state-fp32-x": dict(D=D, B=2, idx=[1, 4], state_dtype=torch.bfloat16, fp32_x=True),
        "W2-no-bias-no-act": dict(D=D, B=2, L=2, idx=[0, 1], W=2, bias=False, act=None),
    }


def conv_fn_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(x [D, T] channel-last, weight, bias, conv_states, kwargs) of one prefill conv call. p: D, W (4), S (6), C
    (W - 1 + 2), qsl (offsets), idx / init (lists) or None, state_dtype (dtype), bias (True), act ("silu")."""
    gen = torch.Generator().manual_seed(seed)
    D, W = p["D"], p.get("W", 4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = r(p["qsl"][-1], D).to(dtype).to(device).T                       # [D, T], x.stride(0) == 1 as vLLM's
    weight = (r(D, W) / W ** 0.5).to(dtype).to(device)
    bias = (0.1 * r(D)).to(dtype).to(device) if p.get("bias", True) else None
    states = r(p.get("S", 6), D, p.get("C", W + 1)).to(p.get("state_dtype", dtype)).to(device)
    kw = dict(query_start_loc=torch.tensor(p["qsl"], dtype=torch.int32, device=device), activation=p.get("act", "silu"))
    if p.get("idx") is not None:
        kw["cache_indices"] = torch.tensor(p["idx"], dtype=torch.int32, device=device)
    if p.get("init") is not None:
        kw["has_initial_state"] = torch.tensor(p["init"], dtype=torch.bool, device=device)
    return x, weight, bias, states, kw


def conv_fn_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    from fast.utils import interpreter_bf16_round_to_nearest
    x, w, b, states, kw = conv_fn_problem(p, dtype, device, seed)
    s_f, s_r, s_t = states.clone(), states.clone(), states.double()
    with interpreter_bf16_round_to_nearest():       # (a bf16 state under wider x: see conv_checks)
        y_f = FV.causal_conv1d_fn(x, w, b, s_f, **kw)
    y_r = RV.causal_conv1d_fn(x, w, b, s_r, **kw)
    y_t = RV.causal_conv1d_fn(x.double(), w.double(), None if b is None else b.double(), s_t, **kw)
    pad = torch.zeros(x.shape[1], dtype=torch.bool)
    for n, s in enumerate(p.get("idx") or []):
        if s < 0:
            pad[p["qsl"][n]:p["qsl"][n + 1]] = True
    pad = pad.to(device)
    moved = [i for i in range(states.shape[0]) if not torch.equal(s_r[i], states[i])]
    still = [i for i in range(states.shape[0]) if i not in moved]
    return [Check("y", y_f, y_t, y_r), Check("padded outputs", y_f[:, pad], torch.zeros_like(y_f[:, pad]), exact=True),
            Check("new conv_states rows", s_f[moved], s_r[moved], exact=True),          # copies of inputs
            Check("untouched rows", s_f[still], states[still], exact=True)]


def conv_fn_families(quick: bool, device: str) -> dict:
    """Packed prefills continuing from their rows or not, a zero-length request and a padded one; rows by position
    without indices or flags; a bf16 state under float32 x; width 2 without bias. Quick: D = 40; full: D = 8192 and
    longer requests."""
    D, m = (40, 1) if quick else (8192, 37)
    qsl = [0, 5 * m, 5 * m, 12 * m, 14 * m]
    return {
        "prefill-mixed-padded-empty": dict(D=D, qsl=qsl, idx=[3, 1, -1, 0], init=[True, False, True, False]),
        "rows-by-position": dict(D=D, qsl=[0, 3 * m, 7 * m]),
        "bf16-state-fp32-x": dict(D=D, qsl=[0, 4 * m, 9 * m], idx=[5, 2], init=[True, True],
                                  state_dtype=torch.bfloat16, fp32_x=True),
        "W2-no-bias-no-act": dict(D=D, qsl=[0, 6 * m, 7 * m], idx=[0, 4], init=[True, False], W=2, bias=False,
                                  act=None),
    }


def post_conv_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> list:
    """The op's arguments in its order: conv_output [L, 2 H K + HV V] and a, b [L, HV] in dtype (a + dt_bias across
    softplus' threshold, b saturating the sigmoid in places), A_log, dt_bias [HV] float32, H, K, V, the two flags.

    p: L; H, HV, K, V (2, 4, 16, 16); l2 (True); g_exp (False); strided (rows of a wider buffer, as vLLM's conv
    output slices)."""
    gen = torch.Generator().manual_seed(seed)
    L, H, HV, K, V = p["L"], p.get("H", 2), p.get("HV", 4), p.get("K", 16), p.get("V", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    width = 2 * H * K + HV * V
    x = r(L, width + (5 if p.get("strided") else 0))[:, :width]
    a, b = 12.0 * r(L, HV), 8.0 * r(L, HV)
    A_log = torch.rand(HV, generator=gen, dtype=torch.float64) * 2 - 1
    return [x.to(dtype).to(device), a.to(dtype).to(device), b.to(dtype).to(device), A_log.float().to(device),
            (0.5 * r(HV)).float().to(device), H, K, V, p.get("l2", True), p.get("g_exp", False)]


def post_conv_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    """fast vs refgdn in dtype vs refgdn in float64: q, k, g, beta by the rule; v exactly refgdn's (a copy)."""
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    args = post_conv_problem(p, dtype, device, seed)
    wide = [t.double() if isinstance(t, torch.Tensor) else t for t in args]
    f, r, t = (op(*xs) for op, xs in ((FV.fused_post_conv_prep, args), (RV.fused_post_conv_prep, args),
                                      (RV.fused_post_conv_prep, wide)))
    return [Check(name, f[i], t[i], r[i]) for i, name in ((0, "q"), (1, "k"), (3, "g"), (4, "beta"))] + [
        Check("v (a copy)", f[2], r[2], exact=True)]


def post_conv_families(quick: bool, device: str) -> dict:
    """A prefill's tokens with the l2norm; without it and with exp(g) (FlashInfer's form); strided rows with three
    value heads per key head and K, V not powers of two; one token. Quick: 2 / 4 heads of 16; full: Qwen3-Next's
    16 / 32 heads of 128 (and Qwen3.5-27B's 16 / 48)."""
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128)
    out = {
        "prefill-l2norm": dict(L=37, **qwen),
        "no-l2norm-g-exp": dict(L=20, l2=False, g_exp=True, **qwen),
        "one-token": dict(L=1, **qwen),
        "strided-gva3-odd-KV": dict(L=19, H=2, HV=6, K=24, V=20, strided=True),
    }
    if not quick:
        out["gva3-qwen3.5"] = dict(L=300, H=16, HV=48, K=128, V=128, strided=True)
    return out


def chunk_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    """vLLM's chunk op by its default call (fast: every chunk table built on the device, nothing read back):
    o, written into core_attn_out, and the final states by the rule; "vk": states [N, HV, V, K] both ways."""
    import fast.vllm_ops as FV
    import refgdn.vllm_ops as RV
    from .cases_prefill import gdn_case_inputs
    lo, hi = gdn_case_inputs(p, dtype, device, seed)
    vk = bool(lo.pop("state_v_first", False))
    hi.pop("state_v_first", None)
    kw = dict(state_layout="vk" if vk else "kv", output_final_state=True)
    out = torch.full_like(lo["v"], float("nan"))
    o_f, s_f = FV.chunk_gated_delta_rule(**lo, **kw, core_attn_out=out)
    o_r, s_r = RV.chunk_gated_delta_rule(**lo, **kw)
    o_t, s_t = RV.chunk_gated_delta_rule(**hi, **kw)
    return [Check("o (core_attn_out)", out, o_t, o_r), Check("returned o is core_attn_out", o_f, out, exact=True),
            Check("final_state", s_f, s_t, s_r, dtype=dtype)]


def chunk_families(quick: bool, device: str) -> dict:
    """Prefill batches as vLLM packs them (B = 1, cu_seqlens): with empty and one-token requests, "vk" states and
    the l2norm (newer vLLM); [N, HV, K, V] states with three value heads per key head; one request (the dense
    path). Quick: interpreter-sized heads; full: Qwen3-Next's 16 / 32 heads of 128."""
    if quick:
        base = dict(B=1, H=1, HV=2, K=32, V=32, gate="mid", init=True)
        return {
            "mixed-empty-len1-vk-l2norm": dict(base, T=100, cu=[0, 0, 1, 40, 40, 100], vk=True, l2=True),
            "gva3-kv": dict(base, T=70, HV=3, K=16, V=16, cu=[0, 33, 70]),
            "one-request-vk": dict(base, T=50, cu=[0, 50], vk=True, l2=True),
        }
    base = dict(B=1, H=16, HV=32, K=128, V=128, gate="mid", init=True)
    return {
        "mixed-empty-len1-vk-l2norm": dict(base, T=1200, cu=[0, 0, 1, 300, 300, 1200], vk=True, l2=True),
        "gva3-kv": dict(base, T=700, HV=48, cu=[0, 333, 700], l2=True),
        "one-request-vk": dict(base, T=640, cu=[0, 640], vk=True, l2=True),
    }


def cases(quick: bool, device: str) -> list:
    return family_cases(quick, device, ((OP, families, checks), (PACKED_OP, packed_families, packed_checks),
                                        (SIGMOID_OP, sigmoid_families, sigmoid_checks),
                                        (POST_CONV_OP, post_conv_families, post_conv_checks),
                                        (CONV_OP, conv_families, conv_checks),
                                        (CONV_FN_OP, conv_fn_families, conv_fn_checks),
                                        (CHUNK_OP, chunk_families, chunk_checks)), needs="fast.vllm_ops")
