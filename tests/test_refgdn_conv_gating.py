"""refgdn's conv1d, conv1d update, gating and l2norm against their direct formulas."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import refgdn

D64 = torch.float64


def _conv_direct(x, weight, bias, activation):
    """x: [T, D] -> F.conv1d with groups=D and left zero padding (an independent formulation)."""
    D, W = weight.shape
    y = F.conv1d(F.pad(x.T[None], (W - 1, 0)), weight[:, None, :], bias, groups=D)[0].T
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_matches_torch_conv1d(W, activation):
    x, w, b = torch.randn(2, 33, 7, dtype=D64), torch.randn(7, W, dtype=D64), torch.randn(7, dtype=D64)
    y, _ = refgdn.causal_conv1d(x, w, b, activation)
    for n in range(2):
        torch.testing.assert_close(y[n], _conv_direct(x[n], w, b, activation), rtol=0, atol=1e-12)


@pytest.mark.parametrize("T,split", [pytest.param(12, 5, id="T12-split5"), pytest.param(9, 0, id="T9-split0"),
                                     pytest.param(6, 2, id="T6-prefix-shorter-than-state")])
def test_conv_prefill_then_updates_equals_full_prefill(T, split):
    N, D, W = 3, 6, 4
    x, w, b = torch.randn(N, T, D, dtype=D64), torch.randn(D, W, dtype=D64), torch.randn(D, dtype=D64)
    s0 = torch.randn(N, D, W - 1, dtype=D64)
    y_full, s_full = refgdn.causal_conv1d(x, w, b, "silu", initial_state=s0, output_final_state=True)
    y_pre, state = refgdn.causal_conv1d(x[:, :split], w, b, "silu", initial_state=s0, output_final_state=True)
    ys = [y_pre]
    for t in range(split, T):
        ys.append(refgdn.causal_conv1d_update(x[:, t], state, w, b, "silu")[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=0, atol=1e-12)
    assert torch.equal(state, s_full)


def test_conv_varlen_equals_per_sequence_loop():
    lens = [0, 1, 5, 2, 0, 11]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)))
    T, N, D, W = int(cu[-1]), len(lens), 5, 4
    x, w = torch.randn(1, T, D, dtype=D64), torch.randn(D, W, dtype=D64)
    s0 = torch.randn(N, D, W - 1, dtype=D64)
    y, s = refgdn.causal_conv1d(x, w, None, None, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    for n in range(N):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        y_n, s_n = refgdn.causal_conv1d(x[:, sl], w, None, None, initial_state=s0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, sl], y_n, rtol=0, atol=1e-14)
        assert torch.equal(s[n:n + 1], s_n)
    assert torch.equal(s[0], s0[0])   # an empty sequence hands its state through
    assert torch.equal(s[1], torch.cat([s0[1, :, 1:], x[0, 0, :, None]], 1))  # a length-1 sequence shifts by one


def test_conv_update_keeps_dtype_and_rounds_like_a_store():
    x, w = torch.randn(2, 4), torch.randn(4, 3)
    state = torch.randn(2, 4, 2).bfloat16()
    old = state.clone()
    y = refgdn.causal_conv1d_update(x, state, w)
    assert y.dtype == torch.float32 and state.dtype == torch.bfloat16
    assert torch.equal(state[:, :, 0], old[:, :, 1]) and torch.equal(state[:, :, 1], x.bfloat16())


def test_conv_gradcheck():
    x, w, b = (torch.randn(*s, dtype=D64, requires_grad=True) for s in ((1, 7, 3), (3, 4), (3,)))
    s0 = torch.randn(1, 3, 3, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b, s0: refgdn.causal_conv1d(x, w, b, "silu", initial_state=s0, output_final_state=True),
        (x, w, b, s0))


def test_gating_matches_formula_both_sides_of_softplus_threshold():
    HV = 6
    A_log, dt_bias = torch.randn(HV, dtype=D64), torch.zeros(HV, dtype=D64)
    a = torch.tensor([[-30.0, -1.0, 0.0, 19.99, 20.01, 80.0]], dtype=D64)
    b = torch.randn(1, HV, dtype=D64)
    g, beta = refgdn.gdn_gating(A_log, a, dt_bias, b)
    sp = torch.tensor([torch.log1p(torch.exp(x)).item() if x <= 20 else x.item() for x in a[0]], dtype=D64)
    torch.testing.assert_close(g[0], -A_log.exp() * sp, rtol=1e-15, atol=0)
    torch.testing.assert_close(beta, 1 / (1 + torch.exp(-b)), rtol=1e-15, atol=0)
    assert g[0, 5] == -A_log[5].exp() * 80.0          # above the threshold softplus(x) == x exactly
    # float32 inputs: g comes back float32, beta in b's dtype
    g32, beta16 = refgdn.gdn_gating(A_log.float(), a.bfloat16(), dt_bias.float(), b.half())
    assert g32.dtype == torch.float32 and beta16.dtype == torch.float16
    assert torch.isfinite(g32).all()


def test_l2norm():
    x = torch.randn(3, 5, 7, dtype=D64)
    torch.testing.assert_close(refgdn.l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6),
                               rtol=1e-15, atol=0)
    assert refgdn.l2norm(x.half()).dtype == torch.float16


BAD_CONV = {
    "weight-D": (dict(weight=torch.randn(5, 4)), "weight"),
    "bias-shape": (dict(bias=torch.randn(3)), "bias"),
    "activation": (dict(activation="relu"), "activation"),
    "state-width": (dict(initial_state=torch.randn(1, 4, 2)), "initial_state"),
    "cu-end": (dict(cu_seqlens=torch.tensor([0, 3])), "end at T"),
    "x-2d": (dict(x=torch.randn(6, 4)), "x"),
}


@pytest.mark.parametrize("bad", list(BAD_CONV), ids=list(BAD_CONV))
def test_conv_bad_input(bad):
    args = dict(x=torch.randn(1, 6, 4), weight=torch.randn(4, 4), bias=None, activation=None,
                initial_state=torch.randn(1, 4, 3), cu_seqlens=None)
    override, words = BAD_CONV[bad]
    args.update(override)
    state = args["initial_state"].clone()
    with pytest.raises(ValueError, match=words):
        refgdn.causal_conv1d(**args)
    assert torch.equal(state, args["initial_state"])


@pytest.mark.parametrize("bad", ["width", "activation", "x-dim", "batch"])
def test_conv_update_bad_input_leaves_state_untouched(bad):
    x, w, state = torch.randn(2, 4), torch.randn(4, 4), torch.randn(2, 4, 3)
    kw = dict(activation=None)
    if bad == "width":
        state = torch.randn(2, 4, 4)          # W-1 + 1 columns: not this op's layout
    elif bad == "activation":
        kw["activation"] = "gelu"
    elif bad == "x-dim":
        x = x[None]
    else:
        x = torch.randn(3, 4)
    before = state.clone()
    with pytest.raises(ValueError, match={"width": "W-1", "activation": "activation", "x-dim": "x",
                                          "batch": "conv_state"}[bad]):
        refgdn.causal_conv1d_update(x, state, w, **kw)
    assert torch.equal(state, before)


def test_gating_bad_input():
    with pytest.raises(ValueError, match="A_log"):
        refgdn.gdn_gating(torch.zeros(3), torch.zeros(2, 4), torch.zeros(4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="b"):
        refgdn.gdn_gating(torch.zeros(4), torch.zeros(2, 4), torch.zeros(4), torch.zeros(2, 3))
