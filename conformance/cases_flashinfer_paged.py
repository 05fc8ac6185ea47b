"""Conformance cases for FlashInfer's paged state cache (flashinfer.gdn_paged): fast.flashinfer_ops against
refgdn.flashinfer_ops.

chunk_gated_delta_rule_paged (a prefill whose sequences start from the page of their last prefix token and store
the state at every page boundary they cross and at their end), checked per case:

    o (every token)                                                  tolerance (computed)
    the pages written (crossed boundaries, last pages)               tolerance (computed)
    every other page (shared prefix pages, other sequences')         exact (untouched)

gated_delta_rule_decode_paged (one token per sequence: read the last page, or the previous one when the token opens a
new page; write the last page), checked per case:

    o (padded rows' included: zeros)                                 tolerance (computed)
    the pages written / every other page                             tolerance / exact

The truth is refgdn's op in float64 on the same rounded inputs and a float64 copy of the pool; refgdn_p runs in the
precision under test on the pool's dtype (the rule in conformance.core).
"""
from __future__ import annotations

import math
from typing import List

import torch

from .cases_flashinfer import token_inputs
from .cases_prefill import family_cases
from .cases_sglang import raw_gate_inputs
from .core import FLOOR, Check, row_checks

PAGED_PREFILL_OP = "flashinfer_chunk_gated_delta_rule_paged"
PAGED_DECODE_OP = "flashinfer_gated_delta_rule_decode_paged"


def _wide(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def page_table(lens: list, ps: int, gen: torch.Generator, shared: bool = False, spare: int = 3) -> tuple:
    """(page_indices, page_indptr, last_page_len as lists, pool pages P) for sequences of lens[b] tokens after the
    call (0: a padded sequence, no pages), page ids drawn at random from [0, P) with ``spare`` pages nobody owns;
    shared: sequence 1's first page is sequence 0's (a shared full-page prefix)."""
    counts = [math.ceil(n / ps) for n in lens]
    P = sum(counts) + spare
    perm = torch.randperm(P, generator=gen).tolist()
    ids, ptr, last = [], [0], []
    for b, (n, c) in enumerate(zip(lens, counts)):
        pages = [perm.pop() for _ in range(c)]
        if shared and b == 1:
            pages[0] = ids[0]
        ids += pages
        ptr.append(len(ids))
        last.append(n - (c - 1) * ps if c else 0)
    return ids, ptr, last, P


def prefill_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(args, kwargs) of one chunk_gated_delta_rule_paged call: args = [q, k, v, g, beta, scale]. p: seqs [(prefix,
    new)], ps (page size), heads (Hq, Hk, Hv) (1, 1, 2), K, V (16); gate "alpha" (the decay in (0.5, 1) with an exact
    0), "log", "raw" (use_gate_in_kernel with A_log, dt_bias) or None; beta "prob", "logit" or None; l2 (else k
    unit-norm); shared; output; pool_dtype (float32); scale. q, k, v in dtype; gates and the pool float32 (the pool
    random: a prefix's pages hold states from earlier calls)."""
    seqs, ps = p["seqs"], p["ps"]
    T = sum(n for _, n in seqs)
    (q, k, v), sab, r, u, gen = token_inputs(p, T, dtype, device, seed)
    K, V = q.shape[-1], v.shape[-1]
    gate, kw = p.get("gate", "log"), {}
    g = None
    if gate == "alpha":
        g = 0.5 + 0.5 * u(T, sab)
        g[min(3, T - 1), 0] = 0.0                        # alpha = 0: the state cleared
    elif gate == "log":
        g = -0.4 * u(T, sab)
    elif gate == "raw":
        g = r(T, sab)
        kw.update(use_gate_in_kernel=True, A_log=(u(sab) * 2 - 1).float().to(device),
                  dt_bias=(0.5 * r(sab)).float().to(device))
    if gate is not None:
        g = g.float().to(device)
        kw["gate_domain"] = "linear" if gate == "alpha" else "log"
    beta = None
    if p.get("beta", "prob") == "prob":
        beta = u(T, sab).float().to(device)
    elif p.get("beta") == "logit":
        beta = (2 * r(T, sab)).float().to(device)
        kw["beta_is_logit"] = True
    ids, ptr, last, P = page_table([a + b for a, b in seqs], ps, gen, bool(p.get("shared")))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    kw.update(cu_seqlens=i32(cu), state_pool=(0.5 * r(P, sab, V, K)).to(p.get("pool_dtype", torch.float32)).to(device),
              page_indices=i32(ids), page_indptr=i32(ptr), page_size=ps, last_page_len=i32(last),
              use_qk_l2norm_in_kernel=bool(p.get("l2")))
    if p.get("output"):
        kw["output"] = torch.empty(T, sab, V, dtype=dtype, device=device)
    return [q, k, v, g, beta, p.get("scale")], kw


def run(op, args: list, kw: dict, wide: bool = False) -> tuple:
    """op (either paged op) on a fresh copy of the pool and of an output buffer (float64 copies of every floating
    input when ``wide``, no output buffer: it is q's dtype) -> (o, pool after)."""
    if wide:
        args = [_wide(t) for t in args]
        kw = {n: _wide(t) for n, t in kw.items() if n != "output"}
    kw = dict(kw, state_pool=kw["state_pool"].clone())
    if "output" in kw:
        kw["output"] = kw["output"].clone()
    return op(*args, **kw), kw["state_pool"]



def prefill_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.flashinfer_ops as FF
    import refgdn.flashinfer_ops as RF
    args, kw = prefill_problem(p, dtype, device, seed)
    o_f, s_f = run(FF.chunk_gated_delta_rule_paged, args, kw)
    o_r, s_r = run(RF.chunk_gated_delta_rule_paged, args, kw)
    o_t, s_t = run(RF.chunk_gated_delta_rule_paged, args, kw, wide=True)
    # the written pages at the coarser of the inputs' precision (as chunk_gated_delta_rule's final state: the chunked
    # form's dots take 16-bit operands where the time loop does not) and the pool's (its rounding)
    pool = kw["state_pool"]
    return [Check("o", o_f, o_t, o_r)] + row_checks("pages", pool, s_f, s_t, s_r,
                                                    dtype=max(dtype, pool.dtype, key=FLOOR.get))


def prefill_families(quick: bool, device: str) -> dict:
    """Prefixes ending mid-chunk, at a chunk, at a page end and mid-page, empty; a sequence crossing several pages and
    one ending on a boundary; a shared full-page prefix; one sequence (the dense path); GQA and GVA; the decay as
    alpha (with a 0), as its log, from the raw projection; beta as logits; an output buffer; a bfloat16 pool; a
    padded sequence (no pages, no tokens). Quick: heads of 16, page size 64; full: Qwen3-Next's 16 / 32 heads of 128
    and pages of 256 tokens where the family allows."""
    big = {} if quick else dict(K=128, V=128)
    ps = 64 if quick else 256
    s = 1 if quick else 4                                     # token counts scale with the page size
    return {
        "prefixes-gva": dict(seqs=[(0, 70 * s), (100 * s, 90 * s), (64 * s, 5), (130 * s + 3, 130 * s),
                                   (128 * s, 0)], ps=ps, heads=(1, 1, 2) if quick else (16, 16, 32), l2=True, **big),
        "shared-prefix-alpha-logits": dict(seqs=[(ps + 10, 60 * s), (ps + 50, 78 * s)], ps=ps, shared=True,
                                           gate="alpha", beta="logit", heads=(4, 2, 2) if quick else (32, 16, 16),
                                           l2=True, **big),
        "raw-gates-output-padded": dict(seqs=[(37, 100), (0, 0), (ps, ps)], ps=ps, gate="raw", output=True,
                                        heads=(2, 2, 2), scale=0.3, **big),
        "one-seq-page128": dict(seqs=[(37, 250 if quick else 1000)], ps=128 if quick else 512,
                                heads=(1, 1, 2) if quick else (16, 16, 32), l2=True, **big),
        "bf16-pool": dict(seqs=[(10, 80), (70, 70)], ps=ps, heads=(2, 2, 4), l2=True, pool_dtype=torch.bfloat16,
                          **big),
        "odd-KV-no-gates": dict(seqs=[(5, 40), (64, 64)], ps=64, heads=(2, 2, 4), K=24, V=40, gate=None, beta=None),
    }


def decode_problem(p: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """(args, kwargs) of one gated_delta_rule_decode_paged call: args = [q, k, v, A_log, a, dt_bias, b, scale]. p:
    lens (each sequence's tokens after the call: 0 a padded row; a multiple of ps plus 1 opens a new page), ps,
    shared, H, HV, K, V, l2, pool_dtype."""
    gen = torch.Generator().manual_seed(seed)
    lens, B = p["lens"], len(p["lens"])
    q, k, v, a, b, A_log, dt_bias = raw_gate_inputs(p, B, 1, dtype, device, gen, True)
    HV, K, V = p.get("HV", 2), p.get("K", 16), p.get("V", 16)
    ids, ptr, last, P = page_table(lens, p["ps"], gen, bool(p.get("shared")))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    pool = (0.5 * torch.randn(P, HV, V, K, generator=gen, dtype=torch.float64)).to(
        p.get("pool_dtype", torch.float32)).to(device)
    kw = dict(use_qk_l2norm=bool(p.get("l2")), state_pool=pool, page_indices=i32(ids), page_indptr=i32(ptr),
              last_page_len=i32(last))
    return [q, k, v, A_log, a, dt_bias, b, p.get("scale")], kw


def decode_checks(p: dict, dtype: torch.dtype, device: str, seed: int) -> List[Check]:
    import fast.flashinfer_ops as FF
    import refgdn.flashinfer_ops as RF
    args, kw = decode_problem(p, dtype, device, seed)
    o_f, s_f = run(FF.gated_delta_rule_decode_paged, args, kw)
    o_r, s_r = run(RF.gated_delta_rule_decode_paged, args, kw)
    o_t, s_t = run(RF.gated_delta_rule_decode_paged, args, kw, wide=True)
    return [Check("o", o_f, o_t, o_r)] + row_checks("pages", kw["state_pool"], s_f, s_t, s_r)


def decode_families(quick: bool, device: str) -> dict:
    """Tokens opening a new page (the previous page read, left as it was) and mid-page, a padded row, two sequences
    opening pages after one shared full page; a bfloat16 pool; three value heads per key head. Quick: 1 / 2 heads
    of 16; full: Qwen3-Next's 16 / 32 heads of 128."""
    qwen = {} if quick else dict(H=16, HV=32, K=128, V=128)
    return {
        "open-mid-padded": dict(lens=[65, 30, 0, 129, 200], ps=64, l2=True, **qwen),
        "shared-page-opened": dict(lens=[65, 65, 10], ps=64, shared=True, l2=True, **qwen),
        "bf16-pool": dict(lens=[257, 3, 100], ps=128, l2=True, pool_dtype=torch.bfloat16, **qwen),
        "gva3-scale": dict(lens=[64 + 1, 7], ps=64, scale=0.3, **(dict(H=2, HV=6) if quick
                                                                   else dict(H=16, HV=48, K=128, V=128))),
    }


def cases(quick: bool, device: str) -> list:
    return family_cases(quick, device, ((PAGED_PREFILL_OP, prefill_families, prefill_checks),
                                        (PAGED_DECODE_OP, decode_families, decode_checks)), needs="fast.flashinfer_ops")
