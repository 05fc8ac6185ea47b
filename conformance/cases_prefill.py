"""The prefill conformance matrix: chunk/recurrent gated delta rule, causal conv1d (+ update),
gating, l2norm and the gated output norm, each fast op against its refgdn twin.

Every case builds fresh random inputs from its own seed (a hash of its name), rounds them to the
precision under test, and compares three runs on the *same rounded* inputs:

    truth = refgdn in float64      ref = refgdn in the precision under test      fast = fast op

with ``conformance.core.evaluate`` (fast's error <= 2 x ref's error + floor). Tensors that are
pure copies of inputs (conv states) are compared bit for bit against ref.

The matrix is op x chunk size {16, 32, 64} x dtype x shape family (dense, varlen with empty and
length-1 sequences, GVA 1/2/4, with and without initial state, awkward T 1/63/129/200, strided
inputs made by slicing, strong and weak decay, qk-l2norm, fused gating). ``quick`` keeps CPU
(Triton interpreter) sizes; the full matrix uses Qwen3-Next head dims (K = V = 128) and T up to 4096.
"""
from __future__ import annotations

import importlib
import zlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .core import Case, Check, DTYPE_NAMES

CHUNK_SIZES = (16, 32, 64)


def seed_of(name: str) -> int:
    """A stable per-case seed (crc32 of the case's full name)."""
    return zlib.crc32(name.encode())


def dtypes_for(device: str) -> list:
    """float32, float16 and bfloat16. On CPU (the Triton interpreter) bfloat16 needs the interpreter's fp32 -> bf16
    casts to round to nearest as a GPU's do: the runner runs those cases inside
    fast.utils.interpreter_bf16_round_to_nearest (the kernels' dots already take fp32 operands there, since the
    interpreter's bf16 dots are wrong); where that cannot act on the installed Triton, no bfloat16 on CPU."""
    out = [torch.float32, torch.float16]
    if device.startswith("cuda") or _interpreter_bf16_ok():
        out.append(torch.bfloat16)
    return out


def family_cases(quick: bool, device: str, ops, needs: Optional[str] = None) -> list:
    """The Cases of ops whose families are dicts of parameters: ops = ((op name, families(quick, device) -> {family:
    p}, checks(p, dtype, device, seed) -> [Check]), ...); one case per family and dtype of dtypes_for (float32 only for
    a family with p["fp32_x"]), seeded by its full name. needs: the fast module the ops come from; none when it does
    not import (no Triton)."""
    if needs is not None:
        try:
            importlib.import_module(needs)
        except ImportError:
            return []
    out = []
    for op, fams, check in ops:
        for family, p in fams(quick, device).items():
            for dt in dtypes_for(device):
                if p.get("fp32_x") and dt != torch.float32:        # (the family's x is float32 by construction)
                    continue
                name = f"{op}/{family}/{DTYPE_NAMES[dt]}"
                out.append(Case(op=op, case=family, dtype=dt, quick=quick,
                                run=lambda device, p=p, dt=dt, name=name, check=check: check(p, dt, device,
                                                                                            seed_of(name))))
    return out


def _interpreter_bf16_ok() -> bool:
    try:
        from fast.utils import interpreter_bf16_rne_supported
    except ImportError:
        return False
    return interpreter_bf16_rne_supported()


def _fast(name: str) -> Optional[Callable]:
    """fast.<name> if that op exists yet (fast.chunk may land after this file), else None."""
    try:
        import fast
    except ImportError:
        return None
    return getattr(fast, name, None)


def _refgdn(name: str) -> Callable:
    import refgdn
    return getattr(refgdn, name)


# ----------------------------------------------------------------------------------------------
# gated delta rule (chunk and recurrent)
# ----------------------------------------------------------------------------------------------

GATES = {  # log-decay per token: weak (g near 0) to strong (g near -10)
    "weak": lambda shape, gen: -torch.rand(shape, generator=gen, dtype=torch.float64) * 1e-3,
    "mid": lambda shape, gen: -torch.rand(shape, generator=gen, dtype=torch.float64) * 2.0,
    "strong": lambda shape, gen: -10.0 + torch.rand(shape, generator=gen, dtype=torch.float64) * 0.5,
}


def gdn_case_inputs(p: dict, dtype: torch.dtype, device: str, seed: int) -> tuple[dict, dict]:
    """Inputs for one gated-delta-rule case: (low-precision kwargs, float64 kwargs of the same values).

    p: B, T, H, HV, K, V, gate, init, cu (list or None), l2 (qk-l2norm), fused (gating),
    strided; fla 0.6.0's keywords: logits (beta as logits, use_beta_sigmoid_in_kernel), neg (allow_neg_eigval:
    beta in [0, 2)), vk (state_v_first: the initial state drawn [N, HV, V, K]). Low precision:
    q, k, v, beta (and the raw gate a when fused) in ``dtype``; g, A_log,
    dt_bias, initial_state in float32 (their serving dtypes). float64 = the rounded values, upcast.
    """
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K, V = p["B"], p["T"], p["H"], p["HV"], p["K"], p["V"]
    cu = p.get("cu")
    N = len(cu) - 1 if cu is not None else B
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731

    if p.get("strided"):
        # q, k, v as views of one fused projection [B, T, H*K + H*K + HV*V + pad] (row stride > width),
        # g and beta as views of wider gate projections: what a model hands the kernel.
        width = 2 * H * K + HV * V + 8
        qkv = r(B, T, width)
        if not p.get("l2"):  # keys unit-norm per head, as after the model's own l2norm
            kk = qkv[..., H * K:2 * H * K].reshape(B, T, H, K)
            qkv[..., H * K:2 * H * K] = F.normalize(kk, dim=-1).reshape(B, T, H * K)
        gproj = r(B, T, HV + 5)
        gproj[..., 2:2 + HV] = GATES[p["gate"]]((B, T, HV), gen)
        bproj = torch.rand(B, T, 2 * HV, generator=gen, dtype=torch.float64)

        def views(qkv_, gproj_, bproj_):
            q = qkv_[..., :H * K].view(B, T, H, K)                         # [B, T, (H K)] -> [B, T, H, K]
            k = qkv_[..., H * K:2 * H * K].view(B, T, H, K)
            v = qkv_[..., 2 * H * K:2 * H * K + HV * V].view(B, T, HV, V)
            return dict(q=q, k=k, v=v, g=gproj_[..., 2:2 + HV], beta=bproj_[..., HV:])

        lo_qkv, lo_g, lo_b = qkv.to(dtype).to(device), gproj.float().to(device), bproj.to(dtype).to(device)
        lo = views(lo_qkv, lo_g, lo_b)
        hi = views(lo_qkv.double(), lo_g.double(), lo_b.double())
    else:
        q = r(B, T, H, K)
        k = r(B, T, H, K)
        if not p.get("l2"):
            k = F.normalize(k, dim=-1)
        v = r(B, T, HV, V)
        g = GATES[p["gate"]]((B, T, HV), gen)
        beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
        lo = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta.to(dtype))
        lo = {n: t.to(device) for n, t in lo.items()}
        hi = {n: t.double() for n, t in lo.items()}

    if p.get("fused"):
        # g is the raw gate input a (dtype of the projection); the kernel applies
        # g = -exp(A_log) * softplus(a + dt_bias). A_log ~ log U(1, 16) as in Qwen3-Next init.
        a = r(B, T, HV)
        A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=torch.float64))
        dt_bias = r(HV) - 4.0
        lo.update(g=a.to(dtype).to(device), A_log=A_log.float().to(device), dt_bias=dt_bias.float().to(device))
        hi.update(g=lo["g"].double(), A_log=lo["A_log"].double(), dt_bias=lo["dt_bias"].double())
    if p.get("logits"):   # beta as logits of either sign (the keyword applies the sigmoid in both packages)
        logits = 2 * r(*lo["beta"].shape)
        lo["beta"] = logits.to(lo["beta"].dtype).to(device)
        hi["beta"] = lo["beta"].double()
        flags = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=bool(p.get("neg")))
        lo.update(flags)
        hi.update(flags)
    if p.get("init"):
        S0 = (0.5 * (r(N, HV, V, K) if p.get("vk") else r(N, HV, K, V))).float().to(device)
        lo["initial_state"], hi["initial_state"] = S0, S0.double()
    if p.get("vk"):
        lo["state_v_first"] = hi["state_v_first"] = True
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        lo["cu_seqlens"] = hi["cu_seqlens"] = cu_t
    if p.get("l2"):
        lo["use_qk_l2norm_in_kernel"] = hi["use_qk_l2norm_in_kernel"] = True
    return lo, hi


def gdn_case(op: str, family: str, p: dict, dtype: torch.dtype, chunk_size: Optional[int], quick: bool) -> Case:
    name = f"{op}/{family}/{DTYPE_NAMES[dtype]}/BT{chunk_size}"
    extra = {} if chunk_size is None else dict(chunk_size=chunk_size)

    def run(device: str) -> list:
        fast_op = _fast(op)
        ref_op = _refgdn(op)
        lo, hi = gdn_case_inputs(p, dtype, device, seed_of(name))
        o_f, s_f = fast_op(**lo, output_final_state=True, **extra)
        o_r, s_r = ref_op(**lo, output_final_state=True, **extra)
        o_t, s_t = ref_op(**hi, output_final_state=True, **extra)
        # the state is float32 but carries the inputs' rounding: take the floor from the input dtype
        return [Check("o", o_f, o_t, o_r), Check("final_state", s_f, s_t, s_r, dtype=dtype)]

    # float32 (IEEE products) compiles slowly at large chunks on a GPU: the full matrix's float32 chunk cases at
    # BT = 64 took ~30-60 s each on an H100 (2026-11-24), and with cost 1 all seven landed in one worker, which hit
    # a 400 s limit while the others were done; the worker planner spreads them by cost (as cases_grad's)
    cost = {16: 2.0, 32: 4.0, 64: 8.0}.get(chunk_size, 1.0) if (dtype == torch.float32 and not quick) else 1.0
    return Case(op=op, case=family, dtype=dtype, run=run, chunk_size=chunk_size, quick=quick, cost=cost)


def _gdn_families(quick: bool) -> dict:
    """family name -> params. Quick: B*HV <= 4, K, V <= 64, T <= 200 (interpreter-sized)."""
    if quick:
        base = dict(B=1, T=63, H=1, HV=2, K=32, V=32, gate="mid", init=False)
        return {
            "dense-T63-gva2": dict(base, B=2),
            "T1-init": dict(base, B=2, T=1, HV=1, init=True),
            "T129-init-gva1": dict(base, T=129, HV=1, init=True),
            "T200-weak-decay": dict(base, T=200, HV=1, gate="weak", init=True),
            "T129-strong-decay": dict(base, T=129, gate="strong", init=True),
            "varlen-empty-len1": dict(base, T=130, cu=[0, 0, 1, 1, 64, 129, 130], init=True),
            "gva4": dict(base, HV=4, K=16, V=32, init=True),
            "gva3-l2norm": dict(base, T=90, HV=3, K=16, V=16, l2=True, init=True),   # a group of 3 (Qwen3.5-27B)
            "strided-slices": dict(base, B=2, init=True, strided=True),
            "qk-l2norm": dict(base, T=100, l2=True, init=True),
            "fused-gating": dict(base, T=100, fused=True, init=True),
            "K64-V48": dict(base, T=70, HV=1, K=64, V=48),
            # fla 0.6.0's keywords: beta as logits, beta in [0, 2), [V, K] states (K != V), varlen
            "fla-logits-neg-eigval-vk": dict(base, T=90, K=32, V=16, cu=[0, 37, 90], init=True, logits=True,
                                             neg=True, vk=True),
        }
    base = dict(B=2, T=1024, H=2, HV=4, K=128, V=128, gate="mid", init=True)
    return {
        "dense-T1024-gva2": base,
        "T1-init": dict(base, T=1),
        "T63": dict(base, T=63),
        "T129": dict(base, T=129),
        "T4096-gva1": dict(base, B=1, T=4096, H=2, HV=2),
        "T2048-weak-decay": dict(base, B=1, T=2048, gate="weak"),
        "T2048-strong-decay": dict(base, B=1, T=2048, gate="strong"),
        "varlen-empty-len1": dict(base, B=1, T=3000, cu=[0, 0, 1, 1, 64, 1000, 1001, 2999, 3000]),
        "gva4": dict(base, H=1, HV=4, T=777),
        "strided-slices": dict(base, T=500, strided=True),
        "qk-l2norm": dict(base, T=500, l2=True),
        "fused-gating": dict(base, T=500, fused=True),
        "no-init": dict(base, T=500, init=False),
        "K64-V96": dict(base, T=300, K=64, V=96),
        # Qwen3-Next's head counts (16 key / 32 value heads), so the chunk forward takes the paths its benchmark
        # rows take on a 132-SM GPU (H100 SXM, H200; fast.chunk.state.state_config / state_fuses_output /
        # fast.chunk.pipeline.pipeline_segments): o formed in the state pass at BV 64 (B = 4: 256 programs) and at
        # BV 32 (B = 2: 128), the varlen mix likewise (16 sequences), and one sequence long enough to be pipelined
        # over two segments on two streams (T = 16384: 256 chunks at BT 64)
        "qwen3next-B4-bv64": dict(base, B=4, T=300, H=16, HV=32, l2=True),
        "qwen3next-B2-bv32-gating": dict(base, B=2, T=200, H=16, HV=32, fused=True),
        "qwen3next-varlen16": dict(base, B=1, T=1200, H=16, HV=32, l2=True,
                                   cu=[0, 1, 65, 128, 200, 263, 264, 400, 527, 600, 700, 777, 900, 960, 1023, 1100,
                                       1200]),
        "T16384-pipelined": dict(base, B=1, T=16384, H=1, HV=2),
        # fla 0.6.0's keywords: beta as logits in [0, 2) (allow_neg_eigval: transitions with negative eigenvalues)
        # and [V, K] states, at K != V; and at Qwen3-Next's heads on the fused path (l2norm) with beta up to 2
        "fla-logits-neg-eigval-vk-K64-V96": dict(base, T=500, K=64, V=96, logits=True, neg=True, vk=True),
        "qwen3next-B4-neg-eigval": dict(base, B=4, T=300, H=16, HV=32, l2=True, logits=True, neg=True),
        # Qwen3.5's larger models: 16 key / 64 value heads (four value heads per key head; conv width 12288)
        "qwen3_5-B2-hv64": dict(base, B=2, T=300, H=16, HV=64, l2=True),
        "qwen3_5-varlen-hv64": dict(base, B=1, T=700, H=16, HV=64, l2=True, cu=[0, 1, 130, 300, 301, 700]),
        # Qwen3.5-27B: 16 key / 48 value heads, three value heads per key head (a group that is no power of two)
        "qwen3_5-B2-hv48": dict(base, B=2, T=300, H=16, HV=48, l2=True),
        "qwen3_5-varlen-hv48": dict(base, B=1, T=700, H=16, HV=48, l2=True, fused=True,
                                    cu=[0, 1, 130, 300, 301, 700]),
    }


def _recurrent_families(quick: bool) -> dict:
    fams = _gdn_families(quick)
    keep = (["dense-T63-gva2", "T1-init", "varlen-empty-len1", "gva4", "gva3-l2norm", "strided-slices", "qk-l2norm",
             "fused-gating", "T129-strong-decay", "fla-logits-neg-eigval-vk"] if quick else list(fams))
    out = {k: fams[k] for k in keep}
    if not quick:  # the time loop is sequential: keep the full-matrix lengths moderate
        out = {k: dict(v, T=min(v["T"], 1024)) if "cu" not in v else v for k, v in out.items()}
    return out


# ----------------------------------------------------------------------------------------------
# causal conv1d and its update
# ----------------------------------------------------------------------------------------------

def conv_case_inputs(name: str, p: dict, dtype: torch.dtype, device: str) -> tuple:
    """p: B, T, D, W, act, bias, init, cu (list or None), strided -> (lo, hi, r, N): causal_conv1d's
    keyword arguments in `dtype` (x: [B, T, D], weight: [D, W], bias: [D], initial_state: [N, D, W - 1]),
    the same values in float64, the case's float64 normal sampler (further draws continue its seeded
    stream, also used by conformance.cases_grad) and the number of sequences N."""
    gen = torch.Generator().manual_seed(seed_of(name))
    B, T, D, W = p["B"], p["T"], p["D"], p["W"]
    cu = p.get("cu")
    N = len(cu) - 1 if cu is not None else B
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if p.get("strided"):  # x as a slice of a wider projection and every other time step
        x = r(B, 2 * T, D + 24).to(dtype).to(device)[:, ::2, 8:8 + D]
    else:
        x = r(B, T, D).to(dtype).to(device)
    lo = dict(x=x, weight=(r(D, W) / W ** 0.5).to(dtype).to(device), activation=p.get("act"))
    if p.get("bias"):
        lo["bias"] = r(D).to(dtype).to(device)
    if p.get("init"):
        lo["initial_state"] = r(N, D, W - 1).to(dtype).to(device)
    if cu is not None:
        lo["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    hi = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in lo.items()}
    return lo, hi, r, N


def conv_case(family: str, p: dict, dtype: torch.dtype, quick: bool) -> Case:
    """p: B, T, D, W, act, bias, init, cu (list or None), strided."""
    name = f"causal_conv1d/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        lo, hi, _, _ = conv_case_inputs(name, p, dtype, device)
        y_f, s_f = _fast("causal_conv1d")(**lo, output_final_state=True)
        y_r, s_r = _refgdn("causal_conv1d")(**lo, output_final_state=True)
        y_t, _ = _refgdn("causal_conv1d")(**hi, output_final_state=True)
        # the final state is a copy of (rounded) inputs: bit-exact against refgdn in the same dtype
        return [Check("y", y_f, y_t, y_r), Check("final_state", s_f, s_r, exact=True)]

    return Case(op="causal_conv1d", case=family, dtype=dtype, run=run, quick=quick)


def conv_update_case(family: str, p: dict, dtype: torch.dtype, quick: bool) -> Case:
    """p: N, D, W, act, bias, steps, strided: ``steps`` update calls in a row on one state (in place);
    y compared per step by the rule, the final state bit for bit against refgdn's."""
    name = f"causal_conv1d_update/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        gen = torch.Generator().manual_seed(seed_of(name))
        N, D, W, steps = p["N"], p["D"], p["W"], p["steps"]
        r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
        weight = (r(D, W) / W ** 0.5).to(dtype).to(device)
        bias = r(D).to(dtype).to(device) if p.get("bias") else None
        act = p.get("act")
        xs = r(steps, N, D).to(dtype).to(device)
        if p.get("strided"):
            # the state lives in a slot cache [slots, D, W-1 + spare]: a strided view of 3 of its slots
            cache = r(N + 3, D, W - 1 + 2).to(dtype).to(device)
            state_f = cache[1:N + 1, :, :W - 1]
            xs = r(steps, N, 2 * D).to(dtype).to(device)[..., ::2]
        else:
            state_f = r(N, D, W - 1).to(dtype).to(device)
        state_r = state_f.clone()
        state_t = state_f.double()
        checks = []
        for s in range(steps):
            y_f = _fast("causal_conv1d_update")(xs[s], state_f, weight, bias, act)
            y_r = _refgdn("causal_conv1d_update")(xs[s], state_r, weight, bias, act)
            y_t = _refgdn("causal_conv1d_update")(xs[s].double(), state_t, weight.double(),
                                                  None if bias is None else bias.double(), act)
            checks.append(Check(f"y[{s}]", y_f, y_t, y_r))
        checks.append(Check("conv_state", state_f, state_r, exact=True))
        return checks

    return Case(op="causal_conv1d_update", case=family, dtype=dtype, run=run, quick=quick)


def _conv_families(quick: bool) -> dict:
    if quick:
        base = dict(B=2, T=63, D=40, W=4, act="silu", bias=True, init=False)
        return {
            "dense-T63-silu-bias": base,
            "T1-init": dict(base, T=1, init=True),
            "T129-init-noact": dict(base, B=1, T=129, act=None, bias=False, init=True),
            "T200-W3": dict(base, B=1, T=200, W=3, init=True),
            "W2-D100": dict(base, B=1, W=2, D=100),
            "varlen-empty-len1": dict(base, B=1, T=130, cu=[0, 0, 1, 1, 2, 64, 129, 130], init=True),
            "varlen-no-init": dict(base, B=1, T=130, cu=[0, 3, 3, 130]),
            "strided-slices": dict(base, init=True, strided=True),
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


def _conv_update_families(quick: bool) -> dict:
    D = 40 if quick else 2048
    base = dict(N=3, D=D, W=4, act="silu", bias=True, steps=3)
    return {
        "3-steps-silu": base,
        "noact-W2": dict(base, W=2, act=None, bias=False),
        "W1": dict(base, W=1, steps=2),
        "strided-slot-cache": dict(base, strided=True),
    }


# ----------------------------------------------------------------------------------------------
# gating and l2norm
# ----------------------------------------------------------------------------------------------

def gating_case(family: str, shape: tuple, dtype: torch.dtype, quick: bool, strided: bool = False) -> Case:
    name = f"gdn_gating/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        gen = torch.Generator().manual_seed(seed_of(name))
        HV = shape[-1]
        r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
        # a + dt_bias spans both softplus branches (> 20 and very negative); b saturates sigmoid
        if strided:  # a and b as halves of one [..., 2*HV] projection
            ab = (12 * r(*shape[:-1], 2 * HV)).to(dtype).to(device)
            a, b = ab[..., :HV], ab[..., HV:]
        else:
            a, b = (12 * r(*shape)).to(dtype).to(device), (12 * r(*shape)).to(dtype).to(device)
        A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=torch.float64)).float().to(device)
        dt_bias = (4 * r(HV)).float().to(device)
        g_f, b_f = _fast("gdn_gating")(A_log, a, dt_bias, b)
        g_r, b_r = _refgdn("gdn_gating")(A_log, a, dt_bias, b)
        g_t, b_t = _refgdn("gdn_gating")(A_log.double(), a.double(), dt_bias.double(), b.double())
        return [Check("g", g_f, g_t, g_r), Check("beta", b_f, b_t, b_r)]

    return Case(op="gdn_gating", case=family, dtype=dtype, run=run, quick=quick)


def l2norm_case(family: str, shape: tuple, dtype: torch.dtype, quick: bool, strided: bool = False) -> Case:
    name = f"l2norm/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        gen = torch.Generator().manual_seed(seed_of(name))
        x = torch.randn(*shape[:-1], 2 * shape[-1] + 3, generator=gen, dtype=torch.float64)
        x = x.to(dtype).to(device)
        x = x[..., 3:3 + shape[-1]] if strided else x[..., :shape[-1]].contiguous()
        return [Check("y", _fast("l2norm")(x), _refgdn("l2norm")(x.double()), _refgdn("l2norm")(x))]

    return Case(op="l2norm", case=family, dtype=dtype, run=run, quick=quick)


# ----------------------------------------------------------------------------------------------
# the norms: the gated output norm (rms_norm_gated) and the model's plain one (rms_norm)
# ----------------------------------------------------------------------------------------------

def norm_case_inputs(p: dict, dtype: torch.dtype, device: str, seed: int, op: str = "rms_norm_gated"
                     ) -> tuple[dict, dict]:
    """The norm's inputs (low-precision kwargs, float64 kwargs of the same values). p: shape (leading dims and D),
    weight / bias (bool), act, strided (x and g as slices of one [..., 2D + 3] projection, the model's layout),
    unit (rms_norm's unit_offset: a zero-centred weight), residual (rms_norm: True or the residual's dtype; prenorm).
    Rows' scales span 1e-3 .. 1e2 (tiny rows meet eps), g saturates the sigmoid. op "rms_norm": no g, no activation."""
    gen = torch.Generator().manual_seed(seed)
    *lead, D = p["shape"]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    scale = 10.0 ** (5 * torch.rand(*lead, 1, generator=gen, dtype=torch.float64) - 3)
    if p.get("strided"):
        proj = r(*lead, 2 * D + 3)
        proj[..., :D] *= scale[..., 0:1]
        proj[..., D + 3:] *= 4
        proj = proj.to(dtype).to(device)
        x, g = proj[..., :D], proj[..., D + 3:]
    else:
        x = (r(*lead, D) * scale).to(dtype).to(device)
        g = (4 * r(*lead, D)).to(dtype).to(device)
    w = ((0 if p.get("unit") else 1) + 0.5 * r(D)).to(dtype).to(device) if p.get("weight", True) else None
    b = (0.5 * r(D)).to(dtype).to(device) if p.get("bias") else None
    if op == "rms_norm":
        lo = dict(x=x, weight=w, bias=b, eps=1e-6, unit_offset=bool(p.get("unit")))
        if p.get("residual"):                   # fla's pre-norm residual stream: the sum returned too (prenorm)
            rdt = p["residual"] if isinstance(p["residual"], torch.dtype) else dtype
            lo.update(residual=(r(*lead, D) * scale).to(rdt).to(device), prenorm=True)
    else:
        lo = dict(x=x, g=g, weight=w, bias=b, activation=p.get("act", "swish"), eps=1e-6)
    hi = {k: (v.double() if torch.is_tensor(v) else v) for k, v in lo.items()}
    return lo, hi


def norm_case(family: str, p: dict, dtype: torch.dtype, quick: bool, op: str = "rms_norm_gated") -> Case:
    name = f"{op}/{family}/{DTYPE_NAMES[dtype]}"

    def run(device: str) -> list:
        lo, hi = norm_case_inputs(p, dtype, device, seed_of(name), op)
        f, t, r = _fast(op)(**lo), _refgdn(op)(**hi), _refgdn(op)(**lo)
        if not isinstance(f, tuple):                  # (prenorm: y and the residual stream's sum)
            return [Check("y", f, t, r)]
        return [Check(n, a, b, c) for n, a, b, c in zip(("y", "residual_out"), f, t, r)]

    return Case(op=op, case=family, dtype=dtype, run=run, quick=quick)


def _norm_families(quick: bool) -> dict:
    """Qwen3-Next's output norm (per value head, D = V = 128, z a slice of the projection), an odd D with bias
    and the sigmoid gate, no weight, D = 1, and a wide row (one row per block)."""
    big = 1 if quick else 64
    return {
        "qwen3next-T-HV-V128-strided": dict(shape=(5 * big, 32 if not quick else 4, 128), strided=True),
        "D100-bias-sigmoid": dict(shape=(3, 7 * big, 100), bias=True, act="sigmoid"),
        "D48-no-weight": dict(shape=(11 * big, 48), weight=False),
        "D1": dict(shape=(2, 9 * big, 1), bias=True),
        "D2304-bias": dict(shape=(3 * big, 2304), bias=True),
    }


def _plain_norm_families(quick: bool) -> dict:
    """refgdn.model's norms (zero-centred weight): hidden rows (2048), attention's q norm on a slice of the
    projection (head_dim 256); then a plain weight with bias at an odd D, no weight, D = 1; fla's pre-norm residual
    stream (residual added, the sum returned), the residual in x's dtype or in float32."""
    big = 1 if quick else 64
    return {
        "hidden2048-unit": dict(shape=(3 * big, 2048), unit=True),
        "T-heads-hd256-strided-unit": dict(shape=(5 * big, 16 if not quick else 2, 256), strided=True, unit=True),
        "D100-bias": dict(shape=(3, 7 * big, 100), bias=True),
        "D48-no-weight": dict(shape=(11 * big, 48), weight=False),
        "D1-unit": dict(shape=(2, 9 * big, 1), unit=True),
        "hidden2048-unit-residual-prenorm": dict(shape=(3 * big, 2048), unit=True, residual=True),
        "D100-bias-float32-residual-prenorm": dict(shape=(3, 7 * big, 100), bias=True, residual=torch.float32),
    }


# ----------------------------------------------------------------------------------------------
# the matrix
# ----------------------------------------------------------------------------------------------

def cases(quick: bool, device: str) -> list:
    """All prefill-side cases for ``device``; ops whose fast twin is missing are left out."""
    out = []
    dts = dtypes_for(device)
    if _fast("chunk_gated_delta_rule") is not None:
        for family, p in _gdn_families(quick).items():
            for BT in CHUNK_SIZES:
                for dt in dts:
                    # quick (CPU CI): float32 at every BT, the 16-bit dtypes at the served BT (64) only. Their
                    # casts are the same code at every BT; the full matrix runs every BT x dtype on a GPU. This
                    # saves ~26 of the CPU matrix's ~330 CPU-seconds (2026-11-29: CI near its 15-minute line)
                    if quick and dt != torch.float32 and BT != max(CHUNK_SIZES):
                        continue
                    out.append(gdn_case("chunk_gated_delta_rule", family, p, dt, BT, quick))
    if _fast("recurrent_gated_delta_rule") is not None:
        for family, p in _recurrent_families(quick).items():
            for dt in dts:
                out.append(gdn_case("recurrent_gated_delta_rule", family, p, dt, None, quick))
    if _fast("causal_conv1d") is not None:
        for family, p in _conv_families(quick).items():
            for dt in dts:
                out.append(conv_case(family, p, dt, quick))
    if _fast("causal_conv1d_update") is not None:
        for family, p in _conv_update_families(quick).items():
            for dt in dts:
                out.append(conv_update_case(family, p, dt, quick))
    big = 1 if quick else 16
    if _fast("gdn_gating") is not None:
        for dt in dts:
            out.append(gating_case("T-HV", (37 * big, 6), dt, quick))
            out.append(gating_case("B-T-HV32-strided", (2, 9 * big, 32), dt, quick, strided=True))
    if _fast("l2norm") is not None:
        for dt in dts:
            out.append(l2norm_case("K128", (2, 5 * big, 3, 128), dt, quick))
            out.append(l2norm_case("K100-strided", (3, 7 * big, 100), dt, quick, strided=True))
            out.append(l2norm_case("K32", (50 * big, 32), dt, quick))
    if _fast("rms_norm_gated") is not None:
        for family, p in _norm_families(quick).items():
            for dt in dts:
                out.append(norm_case(family, p, dt, quick))
    if _fast("rms_norm") is not None:
        for family, p in _plain_norm_families(quick).items():
            for dt in dts:
                out.append(norm_case(family, p, dt, quick, "rms_norm"))
    return out


def missing_ops() -> list:
    """Prefill ops with no fast twin yet (reported by the runner as skipped)."""
    ops = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_update",
           "gdn_gating", "l2norm", "rms_norm_gated", "rms_norm"]
    return [op for op in ops if _fast(op) is None]
