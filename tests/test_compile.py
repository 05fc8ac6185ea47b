"""torch.library registration: the custom ops pass torch.library.opcheck (schema, autograd registration,
fake tensors, AOT dispatch with dynamic shapes), and a small GDN block (projections + conv1d + gating +
delta rule + gated RMSNorm) compiles with torch.compile(fullgraph=True), forward and backward, with no
graph break, and gives refgdn's output and gradients by the conformance rule.

On CPU the kernels run in the Triton interpreter; torch.compile (inductor, CPU codegen) still works
there because the fast ops are opaque custom ops whose eager implementations launch the kernels.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fast
import refgdn
from conformance.core import Check, evaluate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gdn_args(device, dtype=torch.float32, varlen=False, grad=True):
    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 1, 20, 1, 2, 16, 16
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    beta = torch.rand(B, T, HV, generator=gen).to(device=device, dtype=dtype)
    if varlen:
        cu = torch.tensor([0, 5, 20], dtype=torch.int32, device=device)
        g = -torch.rand(B, T, HV, generator=gen).to(device)
        args = [q, k, v, g, beta, 0.25, r(2, HV, K, V).float(), cu, False, None, None, 32]
    else:
        a = r(B, T, HV)
        args = [q, k, v, a, beta, 0.25, r(B, HV, K, V).float(), None, True,
                torch.rand(HV, generator=gen).to(device), r(HV).float(), 16]
    return [x.requires_grad_(grad) if torch.is_tensor(x) and x.is_floating_point() else x for x in args]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense-l2norm-fused-gating", "varlen"])
def test_opcheck_chunk_gated_delta_rule(varlen):
    args = _gdn_args(DEVICE, varlen=varlen)
    res = torch.library.opcheck(torch.ops.fast.chunk_gated_delta_rule.default, tuple(args))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_opcheck_chunk_gated_delta_rule_bwd():
    args = _gdn_args(DEVICE, grad=False)
    q, v, S0 = args[0], args[2], args[6]
    do = torch.randn_like(v)
    dht = torch.randn_like(S0)
    res = torch.library.opcheck(torch.ops.fast.chunk_gated_delta_rule_bwd.default, (do, dht, *args))
    assert all(r == "SUCCESS" for r in res.values()), res


def _conv_args(device, grad=True):
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    x = r(2, 40, 30)[:, ::2, 3:27]                                     # strided [2, 20, 24]
    return [x.requires_grad_(grad), r(24, 4).requires_grad_(grad),
            r(24).requires_grad_(grad), "silu", r(2, 24, 3).requires_grad_(grad), None]


def test_opcheck_causal_conv1d():
    res = torch.library.opcheck(torch.ops.fast.causal_conv1d.default, tuple(_conv_args(DEVICE)))
    assert all(v == "SUCCESS" for v in res.values()), res
    x, w, b, act, s0, cu = _conv_args(DEVICE, grad=False)
    res = torch.library.opcheck(torch.ops.fast.causal_conv1d_bwd.default,
                                (torch.randn_like(x), torch.randn_like(s0), x, w, b, act, s0, cu))
    assert all(v == "SUCCESS" for v in res.values()), res


class GDNBlock(nn.Module):
    """Qwen3-Next's GDN layer in miniature: in_proj_qkvz, in_proj_ba, causal conv1d (silu) on q|k|v,
    fused gating (A_log, dt_bias) and qk-l2norm inside the delta rule, gated RMSNorm, out_proj.
    ``ops`` is the namespace (fast or refgdn): the same block runs both."""

    def __init__(self, D=32, H=1, HV=2, K=16, V=16, W=4):
        super().__init__()
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.Dc = 2 * H * K + HV * V
        self.in_proj_qkvz = nn.Linear(D, self.Dc + HV * V, bias=False)
        self.in_proj_ba = nn.Linear(D, 2 * HV, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(self.Dc, W) / 2)
        self.A_log = nn.Parameter(torch.log(1 + 15 * torch.rand(HV)))
        self.dt_bias = nn.Parameter(torch.randn(HV) - 2)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(V))
        self.out_proj = nn.Linear(HV * V, D, bias=False)

    def forward(self, x, ops):
        B, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        qkvz = self.in_proj_qkvz(x)
        z = qkvz[..., self.Dc:].reshape(B, T, HV, V)                   # [B, T, (HV V)] -> [B, T, HV, V]
        qkv, _ = ops.causal_conv1d(qkvz[..., :self.Dc], self.conv_weight, None, "silu")
        q = qkv[..., :H * K].reshape(B, T, H, K)
        k = qkv[..., H * K:2 * H * K].reshape(B, T, H, K)
        v = qkv[..., 2 * H * K:].reshape(B, T, HV, V)
        ba = self.in_proj_ba(x)
        beta, a = torch.sigmoid(ba[..., :HV]), ba[..., HV:]
        o, _ = ops.chunk_gated_delta_rule(q, k, v, a, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                                          use_qk_l2norm_in_kernel=True, chunk_size=16)
        # gated RMSNorm (upcast, normalise, cast back)
        of = o.float() if o.dtype != torch.float64 else o
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight * F.silu(z)
        return self.out_proj(of.to(o.dtype).reshape(B, T, HV * V))


def _block_and_input(device):
    torch.manual_seed(0)
    block = GDNBlock().to(device)
    x = torch.randn(2, 20, 32, device=device)
    return block, x


def test_gdn_block_explain_has_no_graph_break():
    block, x = _block_and_input(DEVICE)
    ex = torch._dynamo.explain(lambda t: block(t, fast).sum())(x)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1


def test_gdn_block_compiles_fullgraph_forward_and_backward():
    """torch.compile(fullgraph=True) (inductor) of the block's loss, backward included; output and every
    parameter gradient checked against refgdn (float64 truth, float32 oracle) by the conformance rule."""
    block, x = _block_and_input(DEVICE)
    torch._dynamo.reset()
    step = torch.compile(lambda t: block(t, fast), fullgraph=True)
    y = step(x)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, list(block.parameters()), dy)

    def ref_run(dtype):
        b = copy.deepcopy(block).to(dtype)
        yr = b(x.to(dtype), refgdn)
        return yr, torch.autograd.grad(yr, list(b.parameters()), dy.to(dtype))

    y_t, g_t = ref_run(torch.float64)
    y_r, g_r = ref_run(torch.float32)
    checks = [Check("y", y, y_t, y_r)]
    checks += [Check(f"d{n}", g, gt, gr) for (n, _), g, gt, gr in zip(block.named_parameters(), grads, g_t, g_r)]
    for c in checks:
        res = evaluate(c)
        assert res["passed"], (c.name, res)


def test_compiled_graph_keeps_the_ops():
    """The compiled forward and backward graphs call the custom ops (the block is one graph; the ops are
    not decomposed away or run outside it)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = {"fw": [], "bw": []}

    def record(kind):
        def compiler(gm, example_inputs):
            seen[kind] += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    block, x = _block_and_input(DEVICE)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"))
    step = torch.compile(lambda t: block(t, fast).sum(), backend=backend, fullgraph=True)
    step(x).backward()
    assert any("fast.chunk_gated_delta_rule.default" in t for t in seen["fw"]), seen["fw"]
    assert any("fast.causal_conv1d.default" in t for t in seen["fw"]), seen["fw"]
    assert any("fast.chunk_gated_delta_rule_bwd.default" in t for t in seen["bw"]), seen["bw"]
    assert any("fast.causal_conv1d_bwd.default" in t for t in seen["bw"]), seen["bw"]


def _varlen_fns():
    def gdn(q, k, v, g, beta, cu):
        return fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, chunk_size=16)

    def conv(x, w, cu):
        return fast.causal_conv1d(x, w, None, "silu", cu_seqlens=cu, output_final_state=True)
    return gdn, conv


def _varlen_inputs(device):
    gen = torch.Generator().manual_seed(3)
    T, H, HV, K, V, D, W = 40, 1, 2, 16, 16, 24, 4
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    gdn = (r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, HV, V),
           -torch.rand(1, T, HV, generator=gen).to(device) * 0.2, torch.rand(1, T, HV, generator=gen).to(device))
    conv = (r(1, T, D), r(D, W) / W ** 0.5)
    return gdn, conv


@pytest.mark.parametrize("bad", [None, [0, 7, 5, 30, 40], [0, 7, 7, 30, 39], [1, 7, 7, 30, 40]],
                         ids=["valid", "decreasing", "end-not-T", "start-not-0"])
def test_varlen_compiles_fullgraph_and_checks_values_at_run_time(bad):
    """Varlen (cu_seqlens, with an empty sequence) under torch.compile(fullgraph=True): the host validation
    cannot read the offsets of a traced tensor, so the values are checked when the graph runs (inside the
    custom ops): a valid call gives the eager outputs bit for bit, a bad one refgdn's ValueError, word for word."""
    gdn, conv = _varlen_fns()
    (q, k, v, g, beta), (x, w) = _varlen_inputs(DEVICE)
    cu = torch.tensor([0, 7, 7, 30, 40] if bad is None else bad, dtype=torch.int32, device=DEVICE)
    torch._dynamo.reset()
    cgdn, cconv = (torch.compile(f, fullgraph=True, backend="aot_eager") for f in (gdn, conv))
    if bad is None:
        for eager, compiled in ((gdn(q, k, v, g, beta, cu), cgdn(q, k, v, g, beta, cu)),
                                (conv(x, w, cu), cconv(x, w, cu))):
            assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
        return
    with pytest.raises(ValueError) as ref_err:
        refgdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16)
    with pytest.raises(ValueError) as err:
        cgdn(q, k, v, g, beta, cu)
    assert str(err.value) == str(ref_err.value)
    with pytest.raises(ValueError) as err:
        cconv(x, w, cu)
    assert str(err.value) == str(ref_err.value)


def test_varlen_with_host_offsets_compiles_fullgraph():
    """cu_seqlens_cpu beside cu_seqlens under torch.compile(fullgraph=True): its checks trace without a graph
    break (the values are checked when the graph runs, as without it), and the outputs are the eager ones."""
    (q, k, v, g, beta), (x, w) = _varlen_inputs(DEVICE)
    cu_cpu = torch.tensor([0, 7, 7, 30, 40], dtype=torch.int32)
    cu = cu_cpu.to(DEVICE)

    def gdn(q, k, v, g, beta, cu, cu_cpu):
        return fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                           output_final_state=True, chunk_size=16)

    def conv(x, w, cu, cu_cpu):
        return fast.causal_conv1d(x, w, None, "silu", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, output_final_state=True)
    torch._dynamo.reset()
    cgdn, cconv = (torch.compile(f, fullgraph=True, backend="aot_eager") for f in (gdn, conv))
    for eager, compiled in ((gdn(q, k, v, g, beta, cu, cu_cpu), cgdn(q, k, v, g, beta, cu, cu_cpu)),
                            (conv(x, w, cu, cu_cpu), cconv(x, w, cu, cu_cpu))):
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_fla_keywords_compile_fullgraph():
    """fla 0.6.0's keywords (beta as logits with allow_neg_eigval, [N, HV, V, K] states) under
    torch.compile(fullgraph=True): the mapping (refgdn.checks.fla_keywords) traces without a graph break, and the
    outputs are the eager ones."""
    (q, k, v, g, beta), _ = _varlen_inputs(DEVICE)
    N, HV, K, V = 4, v.shape[2], q.shape[3], v.shape[3]
    h0 = torch.randn(N, HV, V, K, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cu = torch.tensor([0, 7, 7, 30, 40], dtype=torch.int32, device=DEVICE)

    def gdn(q, k, v, g, logits, h0, cu):
        return fast.chunk_gated_delta_rule(q, k, v, g, logits, initial_state=h0, cu_seqlens=cu,
                                           output_final_state=True, chunk_size=16, use_beta_sigmoid_in_kernel=True,
                                           allow_neg_eigval=True, state_v_first=True)
    torch._dynamo.reset()
    cgdn = torch.compile(gdn, fullgraph=True, backend="aot_eager")
    logits = 3 * beta - 1.5
    eager, compiled = gdn(q, k, v, g, logits, h0, cu), cgdn(q, k, v, g, logits, h0, cu)
    assert compiled[1].shape == (N, HV, V, K)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
