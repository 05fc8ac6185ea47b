"""refgdn's delta rule: chunked == recurrent in float64, varlen == per-sequence loop, each stage == its
direct formula, gradcheck, bad input."""
import itertools

import pytest
import torch

import refgdn
from refgdn import delta_rule as dr
from tests.helpers import gdn_inputs

D64 = torch.float64


# ------------------------------------------------------------------------------------- chunked == recurrent

def _chunk_vs_recurrent_params():
    for bt, T, ratio in itertools.product((16, 32, 64), (1, 63, 64, 65, 129, 200), (1, 2, 4)):
        for gate, init, l2 in (("weak", True, False), ("strong", False, True), ("mid", True, True)):
            yield pytest.param(bt, T, ratio, gate, init, l2, id=f"BT{bt}-T{T}-gva{ratio}-{gate}-init{int(init)}-l2{int(l2)}")


@pytest.mark.parametrize("bt,T,ratio,gate,init,l2", list(_chunk_vs_recurrent_params()))
def test_chunk_matches_recurrent_float64(bt, T, ratio, gate, init, l2):
    H = 4 // ratio if ratio < 4 else 1
    args = gdn_inputs(2, T, H, H * ratio, 12, 10, gate=gate, seed=T * 7 + bt + ratio, init=init)
    q, k, v, g, beta = args[:5]
    h0 = args[5] if init else None
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o_r, s_r = refgdn.recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_c, s_c = refgdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=bt, **kw)
    assert o_c.dtype == D64 and s_c.dtype == D64
    assert (o_c - o_r).abs().max() < 1e-10
    assert (s_c - s_r).abs().max() < 1e-10


def test_recurrent_matches_naive_per_head_loop():
    """The recurrent op against the equation written out per head with explicit repeats (no einsum)."""
    q, k, v, g, beta, h0 = gdn_inputs(1, 9, 2, 4, 5, 3, seed=3, init=True)
    o, s = refgdn.recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    for hv in range(4):
        S = h0[0, hv].clone()
        for t in range(9):
            kt, qt = k[0, t, hv // 2], q[0, t, hv // 2]
            S = S * g[0, t, hv].exp()
            S = S + torch.outer(kt, beta[0, t, hv] * (v[0, t, hv] - S.T @ kt))
            torch.testing.assert_close(o[0, t, hv], 0.7 * S.T @ qt, rtol=0, atol=1e-13)
        torch.testing.assert_close(s[0, hv], S, rtol=0, atol=1e-13)


def test_output_dtypes_follow_inputs():
    q, k, v, g, beta = (x.float() for x in gdn_inputs(1, 20, 1, 1, 8, 8))
    for op in (refgdn.recurrent_gated_delta_rule, refgdn.chunk_gated_delta_rule):
        o, s = op(q.half(), k.half(), v.half(), g, beta, output_final_state=True)
        assert o.dtype == torch.float16 and s.dtype == torch.float32
        o, s = op(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
        assert o.dtype == torch.bfloat16 and s is None


def test_fused_gating_equals_explicit_gating():
    q, k, v, a, beta = gdn_inputs(1, 40, 1, 2, 8, 8, seed=5)
    a = a * 50 + 10  # raw gate input, spans both sides of the softplus threshold
    A_log, dt_bias = torch.randn(2, dtype=D64), torch.randn(2, dtype=D64)
    g, _ = refgdn.gdn_gating(A_log, a, dt_bias, beta)
    for op in (refgdn.recurrent_gated_delta_rule, refgdn.chunk_gated_delta_rule):
        o1, s1 = op(q, k, v, g, beta, output_final_state=True)
        o2, s2 = op(q, k, v, a, beta, output_final_state=True, A_log=A_log, dt_bias=dt_bias)
        torch.testing.assert_close(o1, o2, rtol=0, atol=1e-14)
        torch.testing.assert_close(s1, s2, rtol=0, atol=1e-14)


# ------------------------------------------------------------------------------------- varlen

@pytest.mark.parametrize("op", [pytest.param(refgdn.recurrent_gated_delta_rule, id="recurrent"),
                                pytest.param(lambda *a, **kw: refgdn.chunk_gated_delta_rule(*a, chunk_size=16, **kw), id="chunk16"),
                                pytest.param(refgdn.chunk_gated_delta_rule, id="chunk64")])
def test_varlen_equals_per_sequence_loop(op):
    lens = [0, 1, 37, 0, 70, 16]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    T, N = int(cu[-1]), len(lens)
    q, k, v, g, beta, h0 = gdn_inputs(1, T, 2, 4, 8, 6, seed=11, init=True, N=N)
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, T, 4, 6) and s.shape == (N, 4, 8, 6)
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        sl = slice(a, b)
        o_n, s_n = refgdn.recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                     initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, sl], o_n, rtol=0, atol=1e-12)
        torch.testing.assert_close(s[n:n + 1], s_n, rtol=0, atol=1e-12)
    assert torch.equal(s[0], h0[0]) and torch.equal(s[3], h0[3])  # empty sequences keep their state


# ------------------------------------------------------------------------------------- stages

def _stage_inputs(BT=16, NC=3, H=2, G=2, K=6, V=5, seed=0, gate="mid"):
    q, k, v, g, beta, h0 = gdn_inputs(1, BT * NC, H, H * G, K, V, seed=seed, init=True, gate=gate)
    return q, k, v, g, beta, h0


def test_chunk_cumsum_direct():
    g = -torch.rand(2, 48, 3, dtype=D64)
    G = dr.chunk_cumsum(g, 16)
    for t in range(48):
        start = t - t % 16
        torch.testing.assert_close(G[:, t], g[:, start:t + 1].sum(1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("gate", ["weak", "strong"])
def test_wy_repr_is_inverse(gate):
    BT, H, G = 16, 2, 2
    q, k, v, g, beta, _ = _stage_inputs(BT=BT, gate=gate)
    Gc = dr.chunk_cumsum(g, BT)
    A = dr.wy_repr(k, beta, Gc, BT)                                   # [1, T, HV, BT]
    for c, hv in itertools.product(range(3), range(H * G)):
        rows = slice(c * BT, (c + 1) * BT)
        kc, bc, gc = k[0, rows, hv // G], beta[0, rows, hv], Gc[0, rows, hv]
        L = torch.zeros(BT, BT, dtype=D64)
        for i in range(BT):
            for j in range(i):
                L[i, j] = bc[i] * (kc[i] @ kc[j]) * torch.exp(gc[i] - gc[j])
        torch.testing.assert_close(A[0, rows, hv], torch.linalg.inv(torch.eye(BT, dtype=D64) + L), rtol=0, atol=1e-12)


def test_w_u_direct():
    BT, G = 16, 2
    q, k, v, g, beta, _ = _stage_inputs(BT=BT)
    Gc = dr.chunk_cumsum(g, BT)
    A = dr.wy_repr(k, beta, Gc, BT)
    w, u = dr.w_u(k, v, beta, A, Gc, BT)
    for c, hv in itertools.product(range(3), range(4)):
        rows = slice(c * BT, (c + 1) * BT)
        Ac = A[0, rows, hv]
        kb = beta[0, rows, hv, None] * torch.exp(Gc[0, rows, hv])[:, None] * k[0, rows, hv // G]
        torch.testing.assert_close(w[0, rows, hv], Ac @ kb, rtol=0, atol=1e-13)
        torch.testing.assert_close(u[0, rows, hv], Ac @ (beta[0, rows, hv, None] * v[0, rows, hv]), rtol=0, atol=1e-13)


def test_state_passing_gives_recurrent_states():
    """h[c] is the recurrent state after c*BT tokens; the final state is the recurrent final state."""
    BT = 16
    q, k, v, g, beta, h0 = _stage_inputs(BT=BT)
    Gc = dr.chunk_cumsum(g, BT)
    A = dr.wy_repr(k, beta, Gc, BT)
    w, u = dr.w_u(k, v, beta, A, Gc, BT)
    h, v_new, S = dr.state_passing(k, w, u, Gc, BT, h0)
    assert h.shape == (1, 3, 4, 6, 5) and v_new.shape == v.shape
    for c in range(3):
        sl = slice(0, c * BT)
        _, s_c = refgdn.recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                   initial_state=h0, output_final_state=True)
        torch.testing.assert_close(h[:, c], s_c, rtol=0, atol=1e-12)
    _, s_T = refgdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(S, s_T, rtol=0, atol=1e-12)


def test_chunk_output_direct():
    BT, G, scale = 16, 2, 0.3
    q, k, v, g, beta, h0 = _stage_inputs(BT=BT)
    Gc = dr.chunk_cumsum(g, BT)
    A = dr.wy_repr(k, beta, Gc, BT)
    w, u = dr.w_u(k, v, beta, A, Gc, BT)
    h, v_new, _ = dr.state_passing(k, w, u, Gc, BT, h0)
    o = dr.chunk_output(q, k, v_new, h, Gc, scale, BT)
    for t, hv in itertools.product(range(3 * BT), range(4)):
        c, i = divmod(t, BT)
        qt = q[0, t, hv // G]
        ref = torch.exp(Gc[0, t, hv]) * (qt @ h[0, c, hv])
        for j in range(c * BT, t + 1):
            ref = ref + (qt @ k[0, j, hv // G]) * torch.exp(Gc[0, t, hv] - Gc[0, j, hv]) * v_new[0, j, hv]
        torch.testing.assert_close(o[0, t, hv], scale * ref, rtol=0, atol=1e-12)
    o_r, _ = refgdn.recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0)
    torch.testing.assert_close(o, o_r, rtol=0, atol=1e-12)


def test_strong_decay_is_finite_in_float32():
    """Mask before exp: with g near -10 a 64-chunk spans exp(+600) above the diagonal; no inf/nan may leak."""
    q, k, v, g, beta = (x.float() for x in gdn_inputs(1, 128, 1, 1, 16, 16, gate="strong", seed=2))
    o, s = refgdn.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    o_r, s_r = refgdn.recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                 output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o.double(), o_r, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("op", [pytest.param(refgdn.recurrent_gated_delta_rule, id="recurrent"),
                                pytest.param(lambda *a, **kw: refgdn.chunk_gated_delta_rule(*a, chunk_size=16, **kw), id="chunk16")])
def test_gradcheck(op):
    q, k, v, g, beta, h0 = gdn_inputs(1, 19, 1, 2, 3, 2, seed=4, init=True)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def f(q, k, v, g, beta, h0):
        o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, s

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------- bad input

def _good():
    q, k, v, g, beta, h0 = gdn_inputs(1, 8, 2, 4, 4, 4, seed=0, init=True, dtype=torch.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


BAD = {
    "k-shape": (lambda a: a.update(k=a["k"][:, :, :1]), "k"),
    "v-batch": (lambda a: a.update(v=a["v"][:, :4]), "v"),
    "qkv-dtype": (lambda a: a.update(v=a["v"].double()), "dtype"),
    "q-int": (lambda a: a.update(q=a["q"].int(), k=a["k"].int(), v=a["v"].int()), "q"),
    "g-shape": (lambda a: a.update(g=a["g"][..., :3]), "g"),
    "beta-shape": (lambda a: a.update(beta=a["beta"][:, :5]), "beta"),
    # a wrong rank names the contract and the sizes expected, as a wrong size does (fla's older per-V beta)
    "beta-rank": (lambda a: a.update(beta=a["beta"][..., None].expand(*a["v"].shape)),
                  r"beta must have shape \[B, T, HV\] = \[1, 8, 4\], got \[1, 8, 4, 4\]"),
    "hv-not-multiple": (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][..., :3], beta=a["beta"][..., :3],
                                           initial_state=None), "multiple"),
    "state-shape": (lambda a: a.update(initial_state=a["initial_state"][:, :2]), "initial_state"),
    "state-batch": (lambda a: a.update(initial_state=torch.cat([a["initial_state"]] * 2)), "initial_state"),
    "cu-not-zero": (lambda a: a.update(cu_seqlens=torch.tensor([1, 8])), "start at 0"),
    "cu-decreasing": (lambda a: a.update(cu_seqlens=torch.tensor([0, 5, 3, 8]),
                                         initial_state=torch.zeros(3, 4, 4, 4)), "non-decreasing"),
    "cu-end": (lambda a: a.update(cu_seqlens=torch.tensor([0, 7])), "end at T"),
    "cu-float": (lambda a: a.update(cu_seqlens=torch.tensor([0.0, 8.0])), "int"),
    "cu-with-batch": (lambda a: a.update(**{x: torch.cat([a[x]] * 2) for x in ("q", "k", "v", "g", "beta")},
                                         cu_seqlens=torch.tensor([0, 8])), "B == 1"),
    "chunk-size-48": (lambda a: a.update(chunk_size=48), "chunk_size"),
    "chunk-size-8": (lambda a: a.update(chunk_size=8), "chunk_size"),
    "A_log-alone": (lambda a: a.update(A_log=torch.zeros(4)), "dt_bias"),
    "A_log-shape": (lambda a: a.update(A_log=torch.zeros(3), dt_bias=torch.zeros(3)), "A_log"),
}


BAD_CASES = [pytest.param(op, bad, id=f"{op.split('_')[0]}-{bad}")
             for op in ("recurrent_gated_delta_rule", "chunk_gated_delta_rule") for bad in BAD
             if op == "chunk_gated_delta_rule" or not bad.startswith("chunk-size")]  # recurrent: no chunk_size


@pytest.mark.parametrize("op_name,bad", BAD_CASES)
def test_bad_input_raises_value_error(op_name, bad):
    args = _good()
    mutate, words = BAD[bad]
    mutate(args)
    state = args.get("initial_state")
    before = state.clone() if state is not None else None
    with pytest.raises(ValueError, match=words):
        getattr(refgdn, op_name)(**args)
    if state is not None:
        assert torch.equal(state, before)


# ----------------------------------------------------------------------------------------------
# fla 0.6.0's keywords: the same function on transformed inputs (refgdn.checks.fla_keywords)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"])
@pytest.mark.parametrize("neg", [False, True], ids=["sigmoid", "2-sigmoid"])
def test_fla_keywords_are_the_transformed_call(op, neg):
    """use_beta_sigmoid_in_kernel (+ allow_neg_eigval), state_v_first, use_gate_in_kernel and chunk_indices mean
    what fla 0.6.0 says: bit for bit the plain call on inputs the test transforms itself (float64), K != V so a
    transposition mix-up cannot pass."""
    f = getattr(refgdn, op)
    q, k, v, g, _, S0 = gdn_inputs(1, 37, 1, 2, 8, 6, seed=21, init=True, N=2)
    logits = 3 * torch.randn(1, 37, 2, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    beta = (2 if neg else 1) * torch.sigmoid(logits)
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    A_log, dt_bias = torch.rand(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    want_o, want_s = f(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    got_o, got_s = f(q, k, v, g, logits, initial_state=S0.transpose(-1, -2).contiguous(), output_final_state=True,
                     cu_seqlens=cu, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, state_v_first=True,
                     use_gate_in_kernel=False, A_log=A_log, dt_bias=dt_bias,     # (ignored: g is the log-decay)
                     chunk_indices=torch.zeros(2, 2, dtype=torch.int32))        # (accepted, not read)
    assert torch.equal(got_o, want_o)
    assert got_s.shape == (2, 2, 6, 8) and got_s.is_contiguous() and torch.equal(got_s, want_s.transpose(-1, -2))
    # use_gate_in_kernel=True without dt_bias: softplus(a + 0)
    want_o, _ = f(q, k, v, g, beta, A_log=A_log, dt_bias=torch.zeros(2, dtype=torch.float64), cu_seqlens=cu)
    got_o, _ = f(q, k, v, g, beta, A_log=A_log, use_gate_in_kernel=True, cu_seqlens=cu)
    assert torch.equal(got_o, want_o)
