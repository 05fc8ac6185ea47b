"""Gradient conformance: fast's backward (autograd through fast's custom ops) against refgdn autograd.

Per case, on the same rounded inputs and the same random cotangents (dO for the output, dS for the
final state, so the final state's gradient path is exercised too):

    truth = torch.autograd of refgdn in float64      ref = autograd of refgdn in the precision under test
    fast  = torch.autograd of fast (fast.chunk_bwd / fast.conv_bwd kernels)

and every input gradient is one Check under conformance.core's rule (fast's error <= 2 x ref's error
+ floor), with the floor taken from the input precision (gradients of float32 parameters such as g,
A_log or the initial state carry the inputs' rounding too).

Ops: ``chunk_gated_delta_rule_grad`` (dq, dk, dv, dg — or da with fused gating —, dbeta, dinitial_state,
dA_log, ddt_bias), ``causal_conv1d_grad`` (dx, dweight, dbias, dinitial_state), ``rms_norm_gated_grad`` (dx, dg,
dweight, dbias) and ``rms_norm_grad`` (dx, dweight, dbias, dresidual). Quick: a few
interpreter-sized families, chunk sizes 16/32/64 spread over them, float32 and float16. Full (GPU):
Qwen3-Next head dims, every chunk size, bfloat16 included.
"""
from __future__ import annotations

import torch

from .cases_prefill import (CHUNK_SIZES, _fast, _norm_families, _plain_norm_families, _refgdn, conv_case_inputs,
                            dtypes_for, gdn_case_inputs, norm_case_inputs, seed_of)
from .core import Case, Check, DTYPE_NAMES

GDN_GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _leaves(kw: dict, names) -> tuple[dict, list]:
    """Fresh leaf tensors (same strides: detach keeps the view's layout) for the differentiable inputs."""
    kw = dict(kw)
    leaves = []
    for n in names:
        if n in kw and torch.is_tensor(kw[n]):
            kw[n] = kw[n].detach().requires_grad_(True)
            leaves.append(n)
    return kw, leaves


def _grads(op, kw: dict, names, cotangents) -> dict:
    kw, leaves = _leaves(kw, names)
    outs = op(**kw)
    grads = torch.autograd.grad(outs, [kw[n] for n in leaves], grad_outputs=cotangents, allow_unused=True)
    return {n: g for n, g in zip(leaves, grads)}


def gdn_grad_case(family: str, p: dict, dtype: torch.dtype, chunk_size: int, quick: bool) -> Case:
    op = "chunk_gated_delta_rule_grad"
    name = f"{op}/{family}/{DTYPE_NAMES[dtype]}/BT{chunk_size}"

    def run(device: str) -> list:
        lo, hi = gdn_case_inputs(p, dtype, device, seed_of(name))
        gen = torch.Generator().manual_seed(seed_of(name) + 1)
        B, T, HV, V, K = p["B"], p["T"], p["HV"], p["V"], p["K"]
        N = len(p["cu"]) - 1 if p.get("cu") is not None else B
        do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64).to(dtype)
        dht = torch.randn(N, HV, *((V, K) if p.get("vk") else (K, V)), generator=gen, dtype=torch.float64).float()
        extra = dict(output_final_state=True, chunk_size=chunk_size)
        cot_lo = (do.to(device), dht.to(device))
        cot_hi = (do.double().to(device), dht.double().to(device))
        g_f = _grads(_fast("chunk_gated_delta_rule"), dict(lo, **extra), GDN_GRAD_INPUTS, cot_lo)
        g_r = _grads(_refgdn("chunk_gated_delta_rule"), dict(lo, **extra), GDN_GRAD_INPUTS, cot_lo)
        g_t = _grads(_refgdn("chunk_gated_delta_rule"), dict(hi, **extra), GDN_GRAD_INPUTS, cot_hi)
        checks = []
        for n in g_t:
            label = "da" if (n == "g" and p.get("fused")) else f"d{n}"
            if g_f[n] is None:
                raise RuntimeError(f"fast gave no gradient for {n}")
            checks.append(Check(label, g_f[n], g_t[n], g_r[n], dtype=dtype))
        return checks

    # float32 (IEEE products on FMA units) compiles slowly at large chunks on a GPU: ~50 s per variant at
    # BT = 64, K = V = 128 (H100, Triton 3.6), ~7 s at BT = 16; the worker planner spreads them out
    cost = {16: 2.0, 32: 4.0, 64: 12.0}.get(chunk_size, 4.0) if (dtype == torch.float32 and not quick) else 1.0
    return Case(op=op, case=family, dtype=dtype, run=run, chunk_size=chunk_size, quick=quick, cost=cost)


def _gdn_grad_families(quick: bool) -> dict:
    """family -> (params, chunk sizes). Quick: interpreter sizes, one chunk size per family (all three
    covered); full: every chunk size."""
    if quick:
        base = dict(B=1, T=63, H=1, HV=2, K=32, V=32, gate="mid", init=True)
        return {
            "dense-T63-gva2": (dict(base, B=2), (16,)),
            "varlen-empty-len1": (dict(base, T=100, cu=[0, 0, 1, 1, 40, 99, 100]), (32,)),
            "strided-slices": (dict(base, T=40, strided=True), (16,)),
            "qk-l2norm-fused-gating": (dict(base, T=70, l2=True, fused=True), (64,)),
            "strong-decay-gva4": (dict(base, T=50, HV=4, K=16, V=16, gate="strong"), (32,)),
            "gva3-l2norm": (dict(base, T=40, HV=3, K=16, V=16, l2=True), (16,)),    # a group of 3 (Qwen3.5-27B)
            "no-init-T1": (dict(base, T=1, init=False), (16,)),
            "fla-logits-neg-eigval-vk": (dict(base, T=50, K=32, V=16, logits=True, neg=True, vk=True), (16,)),
        }
    base = dict(B=2, T=512, H=2, HV=4, K=128, V=128, gate="mid", init=True)
    fams = {
        "dense-T512-gva2": base,
        "T1": dict(base, T=1),
        "T129-weak-decay": dict(base, T=129, gate="weak"),
        "T1024-strong-decay": dict(base, B=1, T=1024, gate="strong"),
        "varlen-empty-len1": dict(base, B=1, T=1500, cu=[0, 0, 1, 1, 64, 1000, 1001, 1499, 1500]),
        "gva4": dict(base, H=1, HV=4, T=300),
        "strided-slices": dict(base, T=300, strided=True),
        "qk-l2norm-fused-gating": dict(base, T=300, l2=True, fused=True),
        "no-init-K64-V96": dict(base, T=200, K=64, V=96, init=False),
        # Qwen3-Next's head counts (16 key / 32 value heads, qk-l2norm), so the backward's sequential passes take
        # the configs bench_train's rows take on a 132-SM GPU (fast.chunk_bwd.dh_bwd_config and the recompute's
        # state pass): BV 32 at B = 4 (256 (sequence, head, 64-column) programs), BV 64 at B = 8 (512)
        "qwen3next-B4-bv32": dict(base, B=4, T=192, H=16, HV=32, l2=True),
        "qwen3next-B8-bv64": dict(base, B=8, T=130, H=16, HV=32, l2=True),
        "qwen3_5-B2-hv64": dict(base, B=2, T=192, H=16, HV=64, l2=True),     # Qwen3.5's 16 key / 64 value heads
        "qwen3_5-B2-hv48": dict(base, B=2, T=192, H=16, HV=48, l2=True),     # Qwen3.5-27B's 16 / 48 (groups of 3)
        "fla-logits-neg-eigval-vk-K64-V96": dict(base, T=200, K=64, V=96, logits=True, neg=True, vk=True),
    }
    return {k: (v, CHUNK_SIZES) for k, v in fams.items()}


def conv_grad_case(family: str, p: dict, dtype: torch.dtype, quick: bool) -> Case:
    """p: B, T, D, W, act, bias, init, cu, strided (as conformance.cases_prefill.conv_case)."""
    op = "causal_conv1d_grad"
    name = f"{op}/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        B, T, D, W = p["B"], p["T"], p["D"], p["W"]
        lo, hi, r, N = conv_case_inputs(name, p, dtype, device)
        lo["output_final_state"] = hi["output_final_state"] = True
        dy = r(B, T, D).to(dtype).to(device)
        dfin = r(N, D, W - 1).to(dtype).to(device)
        names = ("x", "weight", "bias", "initial_state")
        g_f = _grads(_fast("causal_conv1d"), lo, names, (dy, dfin))
        g_r = _grads(_refgdn("causal_conv1d"), lo, names, (dy, dfin))
        g_t = _grads(_refgdn("causal_conv1d"), hi, names, (dy.double(), dfin.double()))
        return [Check(f"d{n}", g_f[n], g_t[n], g_r[n], dtype=dtype) for n in g_t]

    return Case(op=op, case=family, dtype=dtype, run=run, quick=quick)


def _conv_grad_families(quick: bool) -> dict:
    if quick:
        base = dict(B=2, T=63, D=40, W=4, act="silu", bias=True, init=True)
        return {
            "dense-T63-silu-bias-init": base,
            "T1-init": dict(base, T=1),
            "T129-noact-nobias": dict(base, B=1, T=129, act=None, bias=False),
            "W3-no-init": dict(base, B=1, T=50, W=3, init=False),
            "varlen-empty-len1": dict(base, B=1, T=130, cu=[0, 0, 1, 1, 2, 64, 129, 130]),
            "strided-slices": dict(base, strided=True),
        }
    base = dict(B=2, T=2048, D=1024, W=4, act="silu", bias=True, init=True)
    return {
        "dense-T2048-D1024": base,
        "T1": dict(base, T=1),
        "T63-noact": dict(base, T=63, act=None, bias=False),
        "T4096-D2304-no-init": dict(base, B=1, T=4096, D=2304, init=False),
        "varlen-empty-len1": dict(base, B=1, T=3000, cu=[0, 0, 1, 1, 2, 64, 1000, 2999, 3000]),
        "strided-slices": dict(base, T=1000, strided=True),
        "W3-D1000": dict(base, T=300, W=3, D=1000),
    }


def norm_grad_case(family: str, p: dict, dtype: torch.dtype, quick: bool, fwd: str = "rms_norm_gated") -> Case:
    op = f"{fwd}_grad"
    name = f"{op}/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        lo, hi = norm_case_inputs(p, dtype, device, seed_of(name), fwd)
        gen = torch.Generator().manual_seed(seed_of(name) + 1)
        dy = torch.randn(lo["x"].shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
        cot = (dy,)
        if lo.get("prenorm"):                         # the residual stream's sum has a gradient too
            res = lo["residual"]
            cot += (torch.randn(res.shape, generator=gen, dtype=torch.float64).to(res.dtype).to(device),)
        names = tuple(n for n in ("x", "g", "weight", "bias", "residual") if lo.get(n) is not None)
        g_f = _grads(_fast(fwd), lo, names, cot)
        g_r = _grads(_refgdn(fwd), lo, names, cot)
        g_t = _grads(_refgdn(fwd), hi, names, tuple(c.double() for c in cot))
        return [Check(f"d{n}", g_f[n], g_t[n], g_r[n], dtype=dtype) for n in g_t]

    return Case(op=op, case=family, dtype=dtype, run=run, quick=quick)


def _norm_grad_families(quick: bool) -> dict:
    """The forward's families but the widest (dweight / dbias sum over every row: T x HV rows in the first)."""
    out = _norm_families(quick)
    del out["D2304-bias"]
    return out


def cases(quick: bool, device: str) -> list:
    """The gradient cases for ``device`` (fast ops missing: none are made)."""
    out = []
    dts = dtypes_for(device)
    if _fast("chunk_gated_delta_rule") is not None:
        for family, (p, sizes) in _gdn_grad_families(quick).items():
            for BT in sizes:
                for dt in dts:
                    out.append(gdn_grad_case(family, p, dt, BT, quick))
    if _fast("causal_conv1d") is not None:
        for family, p in _conv_grad_families(quick).items():
            for dt in dts:
                out.append(conv_grad_case(family, p, dt, quick))
    if _fast("rms_norm_gated") is not None:
        for family, p in _norm_grad_families(quick).items():
            for dt in dts:
                out.append(norm_grad_case(family, p, dt, quick))
    if _fast("rms_norm") is not None:
        for family, p in _plain_norm_families(quick).items():
            for dt in dts:
                out.append(norm_grad_case(family, p, dt, quick, "rms_norm"))
    return out
