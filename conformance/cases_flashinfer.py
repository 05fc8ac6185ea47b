"""Conformance cases for FlashInfer's GDN API (fast.flashinfer_ops against refgdn.flashinfer_ops).

chunk_gated_delta_rule (FlashInfer's prefill: packed tokens, the decay given as alpha, states [N, H, V, K], GQA or
GVA heads), checked per case:

    o (every token)                                                  tolerance (computed)
    the final state of every non-empty sequence                      tolerance (computed)
    output_state's rows of empty sequences                           exact (untouched)

gated_delta_rule_decode_pretranspose / gated_delta_rule_decode / gated_delta_rule_mtp (the gates from raw
projections; a per-batch state or a pool of slots, written in place; MTP's per-token cache), checked per case:

    o (padded rows' included: zeros)                                 tolerance (computed)
    written slots or state rows; the buffer's written steps          tolerance (computed)
    every other slot and buffer entry                                exact

The truth is refgdn's op in float64 on the same rounded inputs and float64 copies of the states; refgdn_p runs in the
precision under test on the same state dtype as fast (the rule in conformance.core).
"""
from __future__ import annotations

from typing import List

import torch

from .cases_prefill import family_cases
from .cases_sglang import raw_gate_inputs
from .core import Check, row_checks

PREFILL_OP = "flashinfer_chunk_gated_delta_rule"
DECODE_OP = "flashinfer_gated_delta_rule_decode"
SENTINEL = 7.0          # output_state's contents before the call: an empty sequence's row must keep it


def _wide(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def token_inputs(p: dict, T: int, dtype: torch.dtype, device: str, seed: int) -> tuple:
    """((q [T, Hq, K], k [T, Hk, K], v [T, Hv, V]) in dtype on device, sab = max(Hq, Hv), r, u, gen): a prefill
    problem's tokens, the float64 normal / uniform samplers that drew them and their generator, for the draws that
    follow. p: heads (Hq, Hk, Hv) (1, 1, 2), K, V (16), l2 (else k unit-norm: the op does not normalise)."""
    gen = torch.Generator().manual_seed(seed)
    Hq, Hk, Hv = p.get("heads", (1, 1, 2))
    K, V = p.get("K", 16), p.get("V", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)   # noqa: E731
    q, k, v = r(T, Hq, K), r(T, Hk, K), r(T, Hv, V)
    if not p.get("l2"):
        k = torch.nn.functional.normalize(k, dim=-1)
    return tuple(x.to(dtype).to(device) for x in (q, k, v)), max(Hq, Hv), r, u, gen


def prefill_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(args, kwargs) of one prefill call in FlashInfer's order: args = [q, k, v, g, beta, scale, initial_state,
    output_final_state=True, cu_seqlens, use_qk_l2norm_in_kernel]. p: cu (offsets), heads (Hq, Hk, Hv) (1, 1, 2),
    K, V (16); alpha (the decay in (0.5, 1), with an exact 0 at token 3 of head 0) / beta (in (0, 1)) given or None;
    h0 (an initial state); l2 (else k unit-norm); scale; out_state (output_state given, filled with SENTINEL);
    output (a preallocated output); ckpt: checkpoint_every_n_tokens (state_checkpoints filled with SENTINEL, one row
    more than the checkpoints). q, k, v in dtype; alpha, beta and the states float32."""
    cu = p["cu"]
    T, N = cu[-1], len(cu) - 1
    (q, k, v), sab, r, u, _ = token_inputs(p, T, dtype, device, seed)
    K, V = q.shape[-1], v.shape[-1]
    alpha = beta = h0 = None
    if p.get("alpha", True):
        alpha = 0.5 + 0.5 * u(T, sab)
        alpha[min(3, T - 1), 0] = 0.0                       # alpha = 0: the state cleared (log(0) = -inf)
        alpha = alpha.float().to(device)
    if p.get("beta", True):
        beta = u(T, sab).float().to(device)
    if p.get("h0"):
        h0 = (0.5 * r(N, sab, V, K)).float().to(device)
    cu_t = torch.tensor(cu, dtype=torch.int64, device=device)
    kw = {}
    if p.get("out_state"):
        kw["output_state"] = torch.full((N, sab, V, K), SENTINEL, dtype=torch.float32, device=device)
    if p.get("output"):
        kw["output"] = torch.empty(T, sab, V, dtype=dtype, device=device)
    every = p.get("ckpt", 0)
    if every:
        starts = [0]
        for n in range(N):
            starts.append(starts[-1] + (cu[n + 1] - cu[n]) // every)
        kw.update(checkpoint_every_n_tokens=every,
                  checkpoint_cu_starts=torch.tensor(starts, dtype=torch.int64, device=device),
                  state_checkpoints=torch.full((starts[-1] + 1, sab, V, K), SENTINEL, dtype=torch.float32,
                                               device=device))
    return [q, k, v, alpha, beta, p.get("scale"), h0, True, cu_t, bool(p.get("l2"))], kw


def run_prefill(op, args: list, kw: dict, wide: bool = False) -> tuple:
    """op on fresh copies of the output buffers (float64 ones when ``wide``) -> (o, final state, the checkpoints
    after the call or None)."""
    kw = {name: (t.double() if wide and t.is_floating_point() else t).clone() if isinstance(t, torch.Tensor) else t
          for name, t in kw.items()}
    if wide and "output" in kw:
        del kw["output"]                       # (output must be in q's dtype: the truth allocates its own)
    o, final = op(*args, **kw)
    return o, final, kw.get("state_checkpoints")


def prefill_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.flashinfer_ops as FF
    import refgdn.flashinfer_ops as RF
    args, kw = prefill_problem(p, dtype, device, seed)
    o_f, s_f, c_f = run_prefill(FF.chunk_gated_delta_rule, args, kw)
    o_r, s_r, c_r = run_prefill(RF.chunk_gated_delta_rule, args, kw)
    o_t, s_t, c_t = run_prefill(RF.chunk_gated_delta_rule, [_wide(t) for t in args], kw, wide=True)
    cu = p["cu"]
    full = [n for n in range(len(cu) - 1) if cu[n + 1] > cu[n]]
    empty = [n for n in range(len(cu) - 1) if n not in full]
    out = [Check("o", o_f, o_t, o_r), Check("final state", s_f[full], s_t[full], s_r[full], dtype=dtype)]
    if p.get("out_state") and empty:
        out.append(Check("output_state, empty sequences' rows", s_f[empty],
                         torch.full_like(s_f[empty], SENTINEL), exact=True))
    if c_f is not None:                         # every row but the spare last one is a checkpoint
        out += [Check("checkpoints", c_f[:-1], c_t[:-1], c_r[:-1], dtype=dtype),
                Check("state_checkpoints' spare row", c_f[-1:], torch.full_like(c_f[-1:], SENTINEL), exact=True)]
    return out


def prefill_families(quick: bool, device: str) -> dict:
    """GVA over several sequences with an empty one, an alpha of 0 and initial states; GQA with alpha None; equal heads
    with output and output_state given (an empty sequence's row untouched) and scale 0.0 (the default); one sequence
    over several chunks; K / V not powers of two; state checkpoints (a sequence shorter than the interval, ends
    between checkpoints). Quick: heads of 16 and T <= 140; full: Qwen3-Next's 16 / 32 heads of
    128 where the family allows."""
    q3 = {} if quick else dict(K=128, V=128)
    return {
        "gva-varlen-h0": dict(cu=[0, 5, 5, 37, 70], heads=(1, 1, 2) if quick else (16, 16, 32), h0=True, l2=True,
                              **q3),
        "gqa-no-alpha": dict(cu=[0, 20, 45], heads=(4, 2, 2) if quick else (32, 16, 16), alpha=False, l2=True, **q3),
        "equal-heads-output-state": dict(cu=[0, 9, 9, 30], heads=(2, 2, 2), h0=True, out_state=True, output=True,
                                         scale=0.0, **q3),
        "one-seq-chunks": dict(cu=[0, 80 if quick else 300], heads=(1, 1, 2) if quick else (16, 16, 32), l2=True,
                               **q3),
        "odd-KV-scale": dict(cu=[0, 13, 40], heads=(2, 2, 4), K=24, V=40, scale=0.3, beta=False, h0=True),
        "checkpoints": dict(cu=[0, 70, 70, 140] if quick else [0, 700, 700, 1000, 1100], ckpt=64 if quick else 128,
                            heads=(1, 1, 2) if quick else (16, 16, 32), h0=True, l2=True, out_state=True, **q3),
    }


def decode_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(fn name, args, kwargs) of one decode call. p: fn ("pretranspose", "decode" or "mtp"), B, T, H, HV, K, V
    (1, 2, 16, 16); P: pool rows (None: the per-batch state); idx / out_idx: initial_state_indices /
    output_state_indices; ssm: ssm_state_indices [B][T]; buf: (C, T') for intermediate_states_buffer (random
    contents); frozen (disable_state_update); state_dtype (float32); l2; scale. q, k, v, a, b in dtype; A_log, dt_bias
    float32 (cases_sglang.raw_gate_inputs)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = p["B"], p.get("T", 1)
    HV, K, V = p.get("HV", 2), p.get("K", 16), p.get("V", 16)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, a, b, A_log, dt_bias = raw_gate_inputs(p, B, T, dtype, device, gen, True)
    sd = p.get("state_dtype", torch.float32)
    t32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    fn = p["fn"]
    dims = (HV, K, V) if fn == "decode" else (HV, V, K)
    states = (0.5 * r(p["P"] if p.get("P") else B, *dims)).to(sd).to(device)
    kw = dict(scale=p.get("scale"), use_qk_l2norm=bool(p.get("l2")))
    if p.get("buf"):
        C, Tb = p["buf"]
        kw["intermediate_states_buffer"] = r(C, Tb, HV, V, K).to(sd).to(device)
    if p.get("out_idx") is not None:
        kw["output_state_indices"] = t32(p["out_idx"])
    if p.get("ssm") is not None:
        kw["ssm_state_indices"] = t32(p["ssm"])
    if fn == "mtp":
        kw["disable_state_update"] = bool(p.get("frozen"))
        args = [q, k, v, states, t32(p["idx"]), A_log, a, dt_bias, b]
    else:
        if fn == "pretranspose":
            kw["disable_state_update"] = bool(p.get("frozen"))
            if p.get("P"):
                kw.update(initial_state=states, initial_state_indices=t32(p["idx"]))
        args = [q, k, v, None if p.get("P") else states, A_log, a, dt_bias, b]
    return "gated_delta_rule_" + ("mtp" if fn == "mtp" else "decode" if fn == "decode" else "decode_pretranspose"), \
        args, kw


def _states_of(fn: str, args: list, kw: dict) -> tuple:
    """Where the call's states are: ("args", i) or ("kw", name)."""
    if fn.endswith("mtp"):
        return "args", 3
    return ("kw", "initial_state") if kw.get("initial_state") is not None else ("args", 3)


def run_decode(op, fn: str, args: list, kw: dict, wide: bool = False) -> tuple:
    """op on fresh copies of the states and buffer (float64 copies of every floating input when ``wide``) -> (o, the
    states after, the buffer after or None)."""
    args, kw = list(args), dict(kw)
    if wide:
        args = [_wide(t) for t in args]
        kw = {n: _wide(t) for n, t in kw.items()}
    where, at = _states_of(fn, args, kw)
    holder = args if where == "args" else kw
    holder[at] = holder[at].clone()
    buf = kw.get("intermediate_states_buffer")
    if buf is not None:
        kw["intermediate_states_buffer"] = buf = buf.clone()
    o, _ = op(*args, **kw)
    return o, holder[at], buf


def decode_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.flashinfer_ops as FF
    import refgdn.flashinfer_ops as RF
    fn, args, kw = decode_problem(p, dtype, device, seed)
    o_f, st_f, buf_f = run_decode(getattr(FF, fn), fn, args, kw)
    o_r, st_r, buf_r = run_decode(getattr(RF, fn), fn, args, kw)
    o_t, st_t, buf_t = run_decode(getattr(RF, fn), fn, args, kw, wide=True)
    where, at = _states_of(fn, args, kw)
    st0 = (args if where == "args" else kw)[at]
    out = [Check("o", o_f, o_t, o_r)] + row_checks("states", st0, st_f, st_t, st_r)
    buf = kw.get("intermediate_states_buffer")
    if buf is not None:                                  # the buffer's steps, [C T', HV, V, K]
        out += row_checks("steps", *(t.flatten(0, 1) for t in (buf, buf_f, buf_t, buf_r)), written="cached",
                          untouched="other")
    return out


def decode_families(quick: bool, device: str) -> dict:
    """V-major decode on a pool with a padded row, with output_state_indices (one negative), on per-batch states, a
    bfloat16 pool; K-major decode; MTP verify into the buffer with the pool frozen, MTP committing (buffer and
    output_state_indices, or neither), MTP with each token's state in its own pool row (ssm_state_indices: a padded
    row, a negative entry, a row's own read slot reused); three value heads per key head. Quick: 1 / 2 heads of 16;
    full: Qwen3-Next's 16 / 32 heads of 128 where the family allows."""
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128)
    out = {
        "pretranspose-pool-padded": dict(fn="pretranspose", B=4, P=9, idx=[4, -1, 0, 7], l2=True),
        "pretranspose-out-idx": dict(fn="pretranspose", B=4, P=9, idx=[4, -1, 0, 7], out_idx=[2, 3, -1, 8], l2=True),
        "pretranspose-state": dict(fn="pretranspose", B=3, l2=True),
        "pretranspose-bf16-pool": dict(fn="pretranspose", B=3, P=6, idx=[5, 0, 2], l2=True,
                                       state_dtype=torch.bfloat16),
        "decode-kmajor": dict(fn="decode", B=3, l2=True),
        "pretranspose-mtp-frozen-buffer": dict(fn="pretranspose", B=3, T=3, P=7, idx=[6, -1, 1], buf=(4, 4),
                                               frozen=True, l2=True),
        "mtp-commit-buffer-out-idx": dict(fn="mtp", B=3, T=3, P=7, idx=[6, 2, -1], out_idx=[0, -1, 4], buf=(3, 3),
                                          l2=True),
        "mtp-commit": dict(fn="mtp", B=2, T=4, P=5, idx=[3, 1], l2=True),
        "mtp-token-slots": dict(fn="mtp", B=3, T=3, P=12, idx=[6, -1, 1], ssm=[[0, 2, 3], [4, 5, 7], [8, -1, 1]],
                                l2=True),
    }
    out = {name: dict(p, **qwen) for name, p in out.items()}
    out["gva3"] = dict(fn="pretranspose", B=3, P=6, idx=[5, 1, 3], l2=True,
                       **(dict(H=2, HV=6) if quick else dict(H=16, HV=48, K=128, V=128)))
    out["odd-KV-scale"] = dict(fn="mtp", B=2, T=2, P=4, idx=[3, 0], H=2, HV=4, K=24, V=40, scale=0.3, frozen=True,
                               buf=(2, 2))
    return out


def cases(quick: bool, device: str) -> list:
    return family_cases(quick, device, ((PREFILL_OP, prefill_families, prefill_checks),
                                        (DECODE_OP, decode_families, decode_checks)), needs="fast.flashinfer_ops")
