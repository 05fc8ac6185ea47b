"""fused_recurrent_gated_delta_rule: fla 0.6.0's name and argument order for recurrent_gated_delta_rule, in both
packages (refgdn.checks.fla_recurrent_arguments maps the arguments recurrent_gated_delta_rule does not have).

Calls written for fla (Hugging Face's Qwen3-Next imports this name) run unchanged, positional ones included: gk and
gv sit between g and beta, cu_seqlens comes last. A shim that kept recurrent_gated_delta_rule's order would read a
positional beta as gk; these tests would catch it (the refusal of gk, or the bit-for-bit comparison).
"""
import pytest
import torch

import fast
import refgdn
from conformance.core import Check, evaluate
from tests.helpers import gdn_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (package, dtype): refgdn in float64 (the oracle), fast in float32 (the interpreter on a CPU)
PACKAGES = [pytest.param(refgdn, torch.float64, id="refgdn"), pytest.param(fast, torch.float32, id="fast")]


def _case(dtype, seed):
    """Varlen (3 sequences, one empty), GVA, K != V; q, k, v, g, beta, initial state, cu_seqlens, A_log, dt_bias."""
    q, k, v, g, beta, S0 = gdn_inputs(1, 29, 1, 2, 16, 8, seed=seed, init=True, N=3)
    gen = torch.Generator().manual_seed(seed + 1)
    A_log, dt_bias = torch.rand(2, generator=gen), torch.randn(2, generator=gen)
    xs = [x.to(dtype) for x in (q, k, v)] + [x.to(torch.promote_types(dtype, torch.float32))
                                             for x in (g, beta, S0, A_log, dt_bias)]
    q, k, v, g, beta, S0, A_log, dt_bias = (x.to(DEV) for x in xs)
    return q, k, v, g, beta, S0, torch.tensor([0, 11, 11, 29], device=DEV), A_log, dt_bias


@pytest.mark.parametrize("pkg, dtype", PACKAGES)
def test_fla_positional_order_is_the_recurrent_call(pkg, dtype):
    """Every positional slot of fla's order lands where it belongs: bit for bit recurrent_gated_delta_rule's keyword
    call, with q / k l2norm, a scale, an initial state, varlen offsets and the final state asked for."""
    q, k, v, g, beta, S0, cu, A_log, dt_bias = _case(dtype, 31)
    want_o, want_s = pkg.recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=S0,
                                                    output_final_state=True, cu_seqlens=cu,
                                                    use_qk_l2norm_in_kernel=True)
    #                                           g  gk    gv    beta  scale h0  out   l2    gate   A_log  dt_bias
    got_o, got_s = pkg.fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, 0.3, S0, True, True, False,
                                                        A_log, dt_bias, False, False, False, cu)
    #                                                      sigmoid neg  v_first cu_seqlens
    assert torch.equal(got_o, want_o) and torch.equal(got_s, want_s)
    # use_gate_in_kernel=False (fla's default): A_log / dt_bias are ignored and g is the log-decay (as above);
    # True: g is the raw gate input
    want_o, _ = pkg.recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias)
    got_o, _ = pkg.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, cu_seqlens=cu, use_gate_in_kernel=True,
                                                    A_log=A_log, dt_bias=dt_bias)
    assert torch.equal(got_o, want_o)


@pytest.mark.parametrize("pkg, dtype", PACKAGES)
def test_fla_defaults_no_decay_and_unit_beta(pkg, dtype):
    """g None is no decay (g = 0) and beta None is ones, as in fla; beta logits through fla's keywords."""
    q, k, v, g, beta, S0, cu, _, _ = _case(dtype, 32)
    zeros, ones = torch.zeros_like(g), torch.ones_like(v[..., 0])
    for kw, (g_, b_) in ((dict(beta=beta), (zeros, beta)), (dict(g=g), (g, ones)), ({}, (zeros, ones))):
        want_o, want_s = pkg.recurrent_gated_delta_rule(q, k, v, g_, b_, initial_state=S0, output_final_state=True,
                                                        cu_seqlens=cu)
        got_o, got_s = pkg.fused_recurrent_gated_delta_rule(q, k, v, initial_state=S0, output_final_state=True,
                                                            cu_seqlens=cu, **kw)
        assert torch.equal(got_o, want_o) and torch.equal(got_s, want_s), sorted(kw)
    logits = 2 * beta - 1
    want_o, _ = pkg.recurrent_gated_delta_rule(q, k, v, g, logits, use_beta_sigmoid_in_kernel=True,
                                               allow_neg_eigval=True)
    got_o, _ = pkg.fused_recurrent_gated_delta_rule(q, k, v, g, beta=logits, use_beta_sigmoid_in_kernel=True,
                                                    allow_neg_eigval=True)
    assert torch.equal(got_o, want_o)


@pytest.mark.parametrize("pkg, dtype", PACKAGES)
@pytest.mark.parametrize("bad, words", [
    pytest.param(dict(gk="a tensor"), "gk .*per-key decays", id="gk"),
    pytest.param(dict(gv="a tensor"), "gv .*per-value decays", id="gv"),
    pytest.param(dict(g=None, use_gate_in_kernel=True), "use_gate_in_kernel=True needs g", id="gate-without-g"),
    pytest.param(dict(use_gate_in_kernel="yes"), "use_gate_in_kernel must be a bool", id="gate-not-bool"),
    pytest.param(dict(cu_seqlens="cu", initial_state="S0"), None, id="beta-slot-check"),
])
def test_fla_refusals_name_the_argument(pkg, dtype, bad, words):
    """What the gated delta rule here does not have is refused by name, before anything runs; the last case checks
    the other direction: a call in recurrent_gated_delta_rule's own positional order (beta fifth) is refused
    (beta would be read as gk), not silently misread."""
    q, k, v, g, beta, S0, cu, _, _ = _case(dtype, 33)
    if words is None:
        with pytest.raises(ValueError, match="gk .*per-key decays"):
            pkg.fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, S0, True)
        return
    kw = dict(g=g, beta=beta)
    kw.update({n: (torch.rand_like(v) if x == "a tensor" else x) for n, x in bad.items()})
    with pytest.raises(ValueError, match=words):
        pkg.fused_recurrent_gated_delta_rule(q, k, v, **kw)


@pytest.mark.skipif(DEV != "cuda", reason="fla's kernels run on a GPU only")
def test_fla_fused_recurrent_positional_call_through_fla():
    """The same positional call through fla 0.6.0's own fused_recurrent_gated_delta_rule and through fast's: both
    pass the conformance rule against refgdn's float64 truth (bf16, varlen, GVA, K != V, l2norm in the kernel)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    q, k, v, g, beta, S0 = gdn_inputs(1, 200, 2, 4, 128, 64, seed=34, init=True, N=3)
    low = [x.to(torch.bfloat16).to(DEV) for x in (q, k, v)] + [x.float().to(DEV) for x in (g, beta, S0)]
    q, k, v, g, beta, S0 = low
    cu = torch.tensor([0, 50, 51, 200], dtype=torch.long, device=DEV)
    args = (q, k, v, g, None, None, beta, None, S0, True, True)       # ..., initial_state, output_final_state, l2norm
    o_t, s_t = refgdn.fused_recurrent_gated_delta_rule(*(x.double() if isinstance(x, torch.Tensor) else x
                                                          for x in args), cu_seqlens=cu)
    o_r, s_r = refgdn.fused_recurrent_gated_delta_rule(*args, cu_seqlens=cu)
    for name, impl in (("fast", fast.fused_recurrent_gated_delta_rule), ("fla", fla.fused_recurrent_gated_delta_rule)):
        o, s = impl(*args, cu_seqlens=cu)
        for what, x, r, t, dt in (("o", o, o_r, o_t, None), ("final_state", s, s_r, s_t, torch.bfloat16)):
            res = evaluate(Check(f"{name}/{what}", x, t, r, dtype=dt))
            assert res["passed"], res
