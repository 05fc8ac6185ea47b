"""Conformance cases for the serving path: prefill, decode and speculative verify + accept (rollback).

fast.serving vs refgdn.serving, driven through the same protocol with the same random inputs:
several consecutive verify / accept rounds (k = 0..7 drafts, batches mixing different k, padded
rows, random accept counts), decode steps in between, and a final materialize. Checked per round:

    o (every token)                          tolerance (computed)
    conv_state, pend_meta                    exact (raw inputs are copied; counts are ints)
    committed ssm state after each round     tolerance (computed), via refgdn.serving.committed_state
    untouched slots (whole cache rows)       exact
    padded rows' outputs                     exact zeros

The truth is refgdn.serving run in float64 on a float64 cache; refgdn_p runs in the precision
under test with the same cache dtypes as fast (the rule in conformance.core).
"""
from __future__ import annotations

import math

import torch

from refgdn.serving import GDNStateCache, committed_state, pending_dtype

from .core import Case, Check

# ----------------------------------------------------------------------------------------------
# random layers and steps (also used by tests/test_serving_*.py)
# ----------------------------------------------------------------------------------------------

DECAYS = {  # (A_log, dt_bias) ranges: weak decay (g near 0) .. strong decay (g near -10)
    "weak": (-6.0, -4.0),
    "mid": (-1.0, 0.5),
    "strong": (1.5, 2.3),
}


def make_layer(H, HV, K, V, W=4, *, decay="mid", bias=True, seed=0, dtype=torch.float64, device="cpu"):
    """Random layer parameters: conv_weight [D, W], conv_bias [D] or None, A_log [HV], dt_bias [HV]."""
    gen = torch.Generator().manual_seed(seed)
    D = 2 * H * K + HV * V
    lo, hi = DECAYS[decay]
    w = torch.randn(D, W, generator=gen) / math.sqrt(W)
    bvec = 0.1 * torch.randn(D, generator=gen) if bias else None
    A_log = lo + (hi - lo) * torch.rand(HV, generator=gen)
    dt_bias = 0.5 * torch.randn(HV, generator=gen)
    out = dict(conv_weight=w, conv_bias=bvec, A_log=A_log, dt_bias=dt_bias)
    return {k: (v.to(device=device, dtype=dtype) if v is not None else None) for k, v in out.items()}


def make_tokens(T, HV, D, *, seed=0, dtype=torch.float64, device="cpu", strided=False):
    """Random raw step inputs: mixed_qkv [T, D], a [T, HV], b [T, HV] (optionally strided views)."""
    gen = torch.Generator().manual_seed(seed)
    if strided:  # views into wider buffers: non-unit row strides, as a fused in-projection gives
        x = torch.randn(T, D + 5, generator=gen)[:, 3:3 + D]
        ab = torch.randn(T, 2 * HV + 1, generator=gen)
        a, b = ab[:, :HV], ab[:, HV + 1:]
    else:
        x = torch.randn(T, D, generator=gen)
        a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, a, b))


def make_cache(num_slots, H, HV, K, V, W=4, max_draft=0, *, seed=0, state_dtype=torch.float64,
               act_dtype=torch.float64, device="cpu") -> GDNStateCache:
    """A cache with random committed contents in every slot (count 0), so untouched slots are visible."""
    c = GDNStateCache.allocate(num_slots, H, HV, K, V, W, max_draft, state_dtype, act_dtype, device)
    gen = torch.Generator().manual_seed(seed)
    c.ssm_state.copy_(0.3 * torch.randn(c.ssm_state.shape, generator=gen))
    c.conv_state.copy_(torch.randn(c.conv_state.shape, generator=gen))
    for t in (c.pend_k, c.pend_v, c.pend_g, c.pend_beta):  # garbage pending data: count 0 must ignore it
        t.copy_(torch.randn(t.shape, generator=gen))
    c.pend_meta[:, 1] = torch.randint(0, 2, (num_slots,), generator=gen, dtype=torch.int32)
    return c


def paged_cache(c: GDNStateCache, gap: int = 48, align: int = 64, state_layout: str = "kv") -> tuple:
    """(cache, raw): c's contents in vLLM's hybrid-cache layout. Each slot owns one page of a raw byte buffer
    ``raw`` [S, page] holding its conv window (channels contiguous, as allocate's) and then its ssm state; the
    cache's ssm_state and conv_state are views whose slot stride is the page (vLLM's gpu_model_runner makes its
    mamba state tensors with ``as_strided``, stride[0] = page size, on one raw tensor per layer). ``gap`` unused
    bytes end each page (vLLM's pages are padded to a common size), zero: a kernel that writes outside its view
    shows there. ``align``: the page size and the ssm block's offset in it are multiples of this many bytes (64:
    slot strides divisible by 16 elements, as Triton specialises for, as a contiguous cache's are; 4: in general
    not, so the kernels compile their other variant). ``state_layout``: "kv" stores each head's state as [K, V] (the
    allocated cache's order), "vk" as [V, K] (newer vLLM's temporal state (HV, V, K)), the view then being its
    transpose. The pend_* tensors and err are copies of c's (contiguous, as the cache requires)."""
    S, D, Wc = c.conv_state.shape
    cs, ss = c.conv_state.element_size(), c.ssm_state.element_size()
    conv_bytes = Wc * D * cs
    ssm_at = -(-conv_bytes // align) * align                            # the ssm block's offset in the page
    page = -(-(ssm_at + c.ssm_state[0].numel() * ss + gap) // align) * align
    raw = torch.zeros(S, page, dtype=torch.uint8, device=c.ssm_state.device)
    flat = raw.view(-1)
    # [S, D, W'] seen through [S, W', D] storage per page (channels contiguous), slot stride = page
    conv = torch.as_strided(flat.view(c.conv_state.dtype), (S, D, Wc), (page // cs, 1, D))
    HV, K, V = c.ssm_state.shape[1:]
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout must be 'kv' or 'vk', got {state_layout!r}")
    inner = (K * V, V, 1) if state_layout == "kv" else (K * V, 1, K)   # [K, V] blocks, or [V, K] ones transposed
    ssm = torch.as_strided(flat.view(c.ssm_state.dtype), (S, HV, K, V), (page // ss, *inner), ssm_at // ss)
    conv.copy_(c.conv_state)
    ssm.copy_(c.ssm_state)
    out = c.clone()
    out.conv_state, out.ssm_state = conv, ssm
    return out, raw


def page_gaps(raw: torch.Tensor, c: GDNStateCache) -> torch.Tensor:
    """The bytes of paged_cache's pages that neither view covers, [S, n] (they must stay zero)."""
    conv_bytes = c.conv_state[0].numel() * c.conv_state.element_size()
    ssm_at = c.ssm_state.storage_offset() * c.ssm_state.element_size()
    ssm_end = ssm_at + c.ssm_state[0].numel() * c.ssm_state.element_size()
    return torch.cat([raw[:, conv_bytes:ssm_at], raw[:, ssm_end:]], dim=1)


def cast_cache(c: GDNStateCache, state_dtype, act_dtype) -> GDNStateCache:
    """The same contents in other dtypes (compute-dtype pending buffers follow the rule of allocate)."""
    cdt = pending_dtype(state_dtype, act_dtype)
    return GDNStateCache(c.ssm_state.to(state_dtype), c.conv_state.to(act_dtype), c.pend_k.to(cdt),
                         c.pend_v.to(act_dtype), c.pend_g.to(cdt), c.pend_beta.to(cdt), c.pend_meta.clone(),
                         err=c.err.clone())


# ----------------------------------------------------------------------------------------------
# the protocol driver
# ----------------------------------------------------------------------------------------------

def plan_rounds(N, rounds, drafts, *, seed=0, decode_every=0, decodes=3):
    """A schedule: list of steps, each ("verify", ks [N], accepts [N]) or ("decode",).

    drafts: the allowed k values; every request draws its own k per round, and an accept count
    uniform in [1, 1+k]. decode_every: a decode step after every `decode_every` verify rounds
    (0: never). rounds == 0: `decodes` plain decode steps.
    """
    gen = torch.Generator().manual_seed(seed)
    if rounds == 0:
        return [("decode",)] * decodes
    steps = []
    for r in range(rounds):
        ks = [drafts[int(torch.randint(len(drafts), (1,), generator=gen))] for _ in range(N)]
        acc = [1 + int(torch.randint(k + 1, (1,), generator=gen)) for k in ks]
        steps.append(("verify", ks, acc))
        if decode_every and (r + 1) % decode_every == 0:
            steps.append(("decode",))
    return steps


def drive(ops, cache, layer, steps, slots, *, H, HV, K, V, dtype, seed=0, device="cpu", strided=False):
    """Run `steps` through `ops` (refgdn.serving or fast.serving). Returns a list of per-step records:
    dict(kind, o, committed ssm [N', ...], committed conv, conv_state, pend_meta) (N' = valid rows).
    A step is ("verify", ks, accepts), ("decode",) or ("prefill", lens, has_initial_state)."""
    D = 2 * H * K + HV * V
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    valid = [s for s in slots if s >= 0]
    out = []
    for i, st in enumerate(steps):
        if st[0] == "verify":
            lens = [1 + k for k in st[1]]
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
            x, a, b = make_tokens(sum(lens), HV, D, seed=seed * 1000 + i, dtype=dtype, device=device,
                                  strided=strided)
            o = ops.gdn_verify(x, a, b, layer["conv_weight"], layer["conv_bias"], layer["A_log"],
                               layer["dt_bias"], cache, idx, cu)
            rec = dict(kind="verify", o=o, lens=lens)
            ops.gdn_accept(cache, idx, torch.tensor(st[2], dtype=torch.int32, device=device))
        elif st[0] == "prefill":
            lens = st[1]
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
            x, a, b = make_tokens(sum(lens), HV, D, seed=seed * 1000 + i, dtype=dtype, device=device,
                                  strided=strided)
            o = ops.gdn_prefill(x, a, b, layer["conv_weight"], layer["conv_bias"], layer["A_log"],
                                layer["dt_bias"], cache, idx, cu, torch.tensor(st[2], device=device))
            rec = dict(kind="prefill", o=o, lens=lens)
        else:
            x, a, b = make_tokens(len(slots), HV, D, seed=seed * 1000 + i, dtype=dtype, device=device,
                                  strided=strided)
            o = ops.gdn_decode(x, a, b, layer["conv_weight"], layer["conv_bias"], layer["A_log"],
                               layer["dt_bias"], cache, idx)
            rec = dict(kind="decode", o=o, lens=[1] * len(slots))
        cache.check()      # a valid schedule records no fault (fast's device-side value checks)
        ssm, conv = committed_state(cache, valid) if valid else (None, None)
        rec.update(ssm=ssm, conv=conv, conv_state=cache.conv_state.clone(), pend_meta=cache.pend_meta.clone())
        out.append(rec)
    return out


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

def _serving_case(name, *, N, slots, num_slots, H, HV, K, V, W=4, max_draft=7, drafts=(0, 1, 2, 3, 4, 5, 6, 7),
                  rounds=3, decode_every=0, dtype=torch.float32, state_dtype=torch.float32, decay="mid",
                  strided=False, seed=0, quick=True, draft_steps=None, prefills=(), paged=None) -> Case:
    """A protocol run: verify / accept rounds (and decodes) from plan_rounds, then each of ``prefills`` ((lens [N],
    has_initial_state [N]) per gdn_prefill step, a decode after each), fast against refgdn. paged: None, or
    (align, state_layout): fast's cache in vLLM's page layout (paged_cache; the pages' unused bytes are checked to
    stay zero)."""
    assert len(slots) == N

    def run(device: str) -> list:
        import fast.serving as fs
        import refgdn.serving as rs

        steps = plan_rounds(N, rounds, list(drafts), seed=seed, decode_every=decode_every) if rounds or not prefills \
            else []
        for lens, has in prefills:
            steps += [("prefill", list(lens), list(has)), ("decode",)]
        base = make_cache(num_slots, H, HV, K, V, W, max_draft, seed=seed)
        lay64 = make_layer(H, HV, K, V, W, decay=decay, seed=seed)
        layp = {k: (v.to(dtype) if v is not None else None) for k, v in lay64.items()}
        kw = dict(H=H, HV=HV, K=K, V=V, seed=seed, strided=strided)
        truth = drive(rs, base.clone(), lay64, steps, slots, dtype=torch.float64, **kw)
        c_ref = cast_cache(base, state_dtype, dtype)
        ref = drive(rs, c_ref, layp, steps, slots, dtype=dtype, **kw)
        c_fast = cast_cache(base, state_dtype, dtype).to(device=device)
        if paged:
            c_fast, raw = paged_cache(c_fast, align=paged[0], state_layout=paged[1])
        layd = {k: (v.to(device) if v is not None else None) for k, v in layp.items()}
        fst = drive(fs, c_fast, layd, steps, slots, dtype=dtype, device=device, **kw)
        checks = []
        valid_rows = [n for n, s in enumerate(slots) if s >= 0]
        pad_rows = [n for n, s in enumerate(slots) if s < 0]
        for r, (t, p, f) in enumerate(zip(truth, ref, fst)):
            tag = f"r{r}.{t['kind']}"
            offs = [0] + torch.tensor(t["lens"]).cumsum(0).tolist()
            rows = torch.cat([torch.arange(offs[n], offs[n + 1]) for n in valid_rows]) if valid_rows else None
            if rows is not None and rows.numel():
                checks.append(Check(f"{tag}.o", f["o"][rows.to(f["o"].device)], t["o"][rows], p["o"][rows]))
            prow = torch.cat([torch.arange(offs[n], offs[n + 1]) for n in pad_rows]) if pad_rows else None
            if prow is not None and prow.numel() and t["kind"] != "prefill":   # (a prefill's: unspecified in fast)
                checks.append(Check(f"{tag}.o_padded_zero", f["o"][prow.to(f["o"].device)],
                                    torch.zeros_like(p["o"][prow]), exact=True))
            if t["ssm"] is not None:
                checks.append(Check(f"{tag}.committed_ssm", f["ssm"], t["ssm"], p["ssm"],
                                    dtype=state_dtype))
                checks.append(Check(f"{tag}.committed_conv", f["conv"], p["conv"], exact=True))
            checks.append(Check(f"{tag}.conv_state", f["conv_state"], p["conv_state"], exact=True))
            checks.append(Check(f"{tag}.pend_meta", f["pend_meta"], p["pend_meta"], exact=True))
        if paged:
            gaps = page_gaps(raw, c_fast)
            checks.append(Check("pages.unused_bytes", gaps, torch.zeros_like(gaps), exact=True))
        # slots no request touched keep every byte
        untouched = [s for s in range(num_slots) if s not in slots]
        if untouched:
            u = torch.tensor(untouched)
            for fname in GDNStateCache.SLOT_FIELDS:
                checks.append(Check(f"untouched.{fname}", getattr(c_fast, fname)[u.to(device)],
                                    getattr(cast_cache(base, state_dtype, dtype), fname)[u], exact=True))
        return checks

    # cost (runner.shard): a prefill case runs refgdn's and fast's chunked prefills and decode rounds, ~7 chunk
    # cases of time in the CPU quick matrix
    return Case(op="gdn_prefill" if prefills else "gdn_verify" if rounds else "gdn_decode", case=name, dtype=dtype,
                run=run, draft_steps=max(drafts) if draft_steps is None else draft_steps, quick=quick,
                cost=7.0 if prefills else 1.0)


def cases(quick: bool, device: str) -> list:
    """The serving matrix. quick: CPU/interpreter sizes (K, V <= 32, H <= 2, N <= 4)."""
    out = []
    small = dict(H=1, HV=2, K=16, V=16)
    # one k for every request: k = 0..7, three verify rounds with random accepts
    for k in range(8):
        out.append(_serving_case(f"k{k}-uniform", N=2, slots=[3, 0], num_slots=5, drafts=(k,), max_draft=7,
                                 seed=100 + k, draft_steps=k, **small))
    # mixed k per request, padded rows, decode steps in between, strided inputs
    out.append(_serving_case("mixed-k-padded", N=4, slots=[2, -1, 0, 4], num_slots=6, H=2, HV=4, K=16, V=8,
                             drafts=(0, 1, 3, 7), rounds=4, decode_every=2, seed=7, strided=True))
    # three value heads per key head (Qwen3.5-27B's 16 / 48): verify, accept, decode and a prefill
    out.append(_serving_case("gva3-mixed-k-prefill", N=3, slots=[1, -1, 0], num_slots=4, H=1, HV=3, K=16, V=16,
                             drafts=(0, 1, 3), rounds=2, decode_every=1, max_draft=3, seed=71,
                             prefills=[((9, 1, 5), (True, False, True))]))
    # decode only (plain decode graph), bf16-class state precision is GPU-only in the quick set
    out.append(_serving_case("decode-only", N=3, slots=[1, -1, 0], num_slots=4, drafts=(0,), rounds=0,
                             decode_every=0, max_draft=0, seed=11, **small))
    # awkward head dims (not powers of two), strong decay, float16
    out.append(_serving_case("odd-dims-strong-fp16", N=2, slots=[0, 1], num_slots=2, H=1, HV=2, K=12, V=20,
                             drafts=(2, 5), max_draft=5, decay="strong", dtype=torch.float16, seed=13))
    out.append(_serving_case("weak-decay-gva2", N=3, slots=[2, 0, -1], num_slots=3, H=1, HV=2, K=32, V=32,
                             drafts=(1, 3), max_draft=3, decay="weak", rounds=3, decode_every=1, seed=17))
    # prefill (gdn_prefill): after verify rounds (pending tokens folded in), chunked (a second prefill continues
    # the first), zero-length and one-token requests, requests without an initial state, padded rows
    out.append(_serving_case("prefill-after-verify", N=3, slots=[2, -1, 0], num_slots=4, H=2, HV=4, K=16, V=8,
                             drafts=(0, 2, 5), rounds=2, max_draft=5, seed=31,
                             prefills=[((5, 3, 17), (True, True, False))]))
    out.append(_serving_case("prefill-chunked", N=3, slots=[1, 3, 0], num_slots=4, drafts=(0,), rounds=0,
                             max_draft=0, seed=37, strided=True,
                             prefills=[((40, 1, 0), (False, True, True)), ((23, 70, 2), (True, True, False))],
                             **small))
    out.append(_serving_case("prefill-odd-dims-fp16", N=2, slots=[1, 0], num_slots=2, H=1, HV=2, K=12, V=20,
                             drafts=(0,), rounds=0, max_draft=0, decay="strong", dtype=torch.float16, seed=41,
                             prefills=[((9, 33), (True, False))]))
    # the cache in vLLM's page layout (ssm_state and conv_state views with a page as their slot stride)
    # (64-byte pages: the slot strides divide by 16 as a contiguous cache's; 4-byte: Triton's other variants)
    # ([V, K] state blocks: newer vLLM's temporal state (HV, V, K), seen as [K, V] through a transposed view)
    for align, layout in ((64, "kv"), (4, "kv"), (64, "vk")):
        out.append(_serving_case(f"paged-cache-align{align}" + ("-vk-state" if layout == "vk" else ""), N=3,
                                 slots=[2, -1, 0], num_slots=4, H=2, HV=4, K=16, V=8, drafts=(0, 2, 3), rounds=2,
                                 decode_every=1, max_draft=3, seed=53, paged=(align, layout),
                                 prefills=[((21, 4, 0), (True, False, True))]))
    # bf16 activations at interpreter sizes, float32 and bfloat16 states: verify rounds, decodes, a prefill. CPU only
    # (the interpreter's fp32 -> bf16 casts round to nearest as a GPU's: conformance.runner's bf16 cases); a GPU runs
    # the bf16 families at Qwen3-Next's head size below
    for sdt, sname in (((torch.float32, "fp32"), (torch.bfloat16, "bf16")) if not device.startswith("cuda") else ()):
        out.append(_serving_case(f"small-bf16-state{sname}", N=3, slots=[2, -1, 0], num_slots=4, H=2, HV=4, K=16, V=8,
                                 drafts=(0, 2, 3), rounds=2, decode_every=1, max_draft=3, dtype=torch.bfloat16,
                                 state_dtype=sdt, seed=71, prefills=[((21, 4, 0), (True, False, True))]))
    # the full (non-quick) matrix: wider heads, more requests and rounds
    out.append(_serving_case("wide-mixed-k", N=6, slots=[7, 2, -1, 5, 0, 3], num_slots=8, H=2, HV=4, K=64, V=64,
                             drafts=tuple(range(8)), rounds=5, decode_every=2, seed=19, quick=False))
    if device.startswith("cuda"):  # bf16 (interpreter dots/dtypes are CPU-unsafe for bf16) and real sizes
        for sdt in (torch.float32, torch.bfloat16):
            sname = "fp32" if sdt == torch.float32 else "bf16"
            out.append(_serving_case(f"qwen-shape-bf16-state{sname}", N=4, slots=[5, -1, 1, 2], num_slots=8,
                                     H=2, HV=4, K=128, V=128, drafts=(0, 1, 3, 7), rounds=4, decode_every=2,
                                     dtype=torch.bfloat16, state_dtype=sdt, seed=23, quick=quick))
            out.append(_serving_case(f"prefill-qwen-shape-bf16-state{sname}", N=4, slots=[5, -1, 1, 2],
                                     num_slots=8, H=2, HV=4, K=128, V=128, drafts=(0, 3), rounds=2, max_draft=3,
                                     dtype=torch.bfloat16, state_dtype=sdt, seed=43, quick=quick,
                                     prefills=[((300, 7, 1, 129), (True, True, False, True)),
                                               ((2048, 0, 64, 5), (True, False, True, True))]))
            out.append(_serving_case(f"prefill-one-long-bf16-state{sname}", N=1, slots=[3], num_slots=4, H=2,
                                     HV=4, K=128, V=128, drafts=(0,), rounds=0, max_draft=0, dtype=torch.bfloat16,
                                     state_dtype=sdt, seed=47, quick=quick, prefills=[((4099,), (True,))]))
        # Qwen3.5's larger models group four value heads per key head (16 key / 64 value heads)
        out.append(_serving_case("qwen3_5-gva4-bf16", N=4, slots=[5, -1, 1, 2], num_slots=8, H=2, HV=8, K=128,
                                 V=128, drafts=(0, 1, 3), rounds=3, decode_every=1, max_draft=3,
                                 dtype=torch.bfloat16, seed=67, quick=quick,
                                 prefills=[((300, 7, 1, 129), (True, True, False, True))]))
        out.append(_serving_case("qwen3_5-gva3-bf16", N=4, slots=[5, -1, 1, 2], num_slots=8, H=2, HV=6, K=128,
                                 V=128, drafts=(0, 1, 3), rounds=3, decode_every=1, max_draft=3,
                                 dtype=torch.bfloat16, seed=73, quick=quick,
                                 prefills=[((300, 7, 1, 129), (True, True, False, True))]))
        # (seed 59 failed the rule on committed_ssm by 7 % before gdn_prefill's state update took two bf16 terms:
        # ratio 1.070 -> 0.901; benchmarks/RESULTS.md)
        out.append(_serving_case("prefill-paged-cache-bf16", N=3, slots=[1, 3, -1], num_slots=4, H=2, HV=4, K=128,
                                 V=128, drafts=(0, 2), rounds=2, max_draft=2, dtype=torch.bfloat16, seed=59,
                                 quick=quick, paged=(4, "kv"), prefills=[((600, 17, 3), (True, False, True))]))
        out.append(_serving_case("paged-vk-state-qwen-shape-bf16", N=4, slots=[5, -1, 1, 2], num_slots=8, H=2, HV=4,
                                 K=128, V=128, drafts=(0, 1, 3), rounds=3, decode_every=1, max_draft=3,
                                 dtype=torch.bfloat16, seed=61, quick=quick, paged=(64, "vk"),
                                 prefills=[((300, 7, 1, 129), (True, True, False, True))]))
        out.append(_serving_case("decode-bf16-state", N=4, slots=[0, 1, 2, 3], num_slots=4, H=2, HV=4, K=64,
                                 V=64, drafts=(0,), rounds=0, decode_every=0, max_draft=0, dtype=torch.bfloat16,
                                 state_dtype=torch.bfloat16, seed=29))
    return [c for c in out if c.quick or not quick]
