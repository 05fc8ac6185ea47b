"""fast.gdn_gating / fast.l2norm against refgdn (float64 truth, the conformance rule)."""
import pytest
import torch

import fast
import refgdn
from conformance.core import Check, evaluate

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]   # (bf16 on CPU: conftest rounds its casts as a GPU)


def _assert_conforms(name, fast_out, truth, ref):
    res = evaluate(Check(name, fast_out, truth, ref))
    assert res["passed"], f"{name}: error {res['error']:.3e} > bound (ref error {res['ref_error']:.3e})"


def _gating_inputs(shape, dtype, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    HV = shape[-1]
    if strided:  # a and b as halves of one [..., 2*HV] projection
        ab = (12 * torch.randn(*shape[:-1], 2 * HV, generator=gen)).to(DEV, dtype)
        a, b = ab[..., :HV], ab[..., HV:]
    else:
        a = (12 * torch.randn(*shape, generator=gen)).to(DEV, dtype)
        b = (12 * torch.randn(*shape, generator=gen)).to(DEV, dtype)
    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen)).to(DEV)
    dt_bias = (4 * torch.randn(HV, generator=gen)).to(DEV)
    return A_log, a, dt_bias, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided", [
    pytest.param((1, 1), False, id="one"),
    pytest.param((37, 6), False, id="T-HV6"),
    pytest.param((2, 9, 32), True, id="B-T-HV32-strided"),
    pytest.param((3, 5, 2, 65), False, id="4d-HV65"),
])
def test_gating_matches_refgdn(dtype, shape, strided):
    A_log, a, dt_bias, b = _gating_inputs(shape, dtype, seed=len(shape), strided=strided)
    g_f, b_f = fast.gdn_gating(A_log, a, dt_bias, b)
    g_r, b_r = refgdn.gdn_gating(A_log, a, dt_bias, b)
    g_t, b_t = refgdn.gdn_gating(A_log.double(), a.double(), dt_bias.double(), b.double())
    assert g_f.dtype == torch.float32 and g_f.shape == a.shape
    assert b_f.dtype == b.dtype and b_f.shape == b.shape
    _assert_conforms("g", g_f, g_t, g_r)
    _assert_conforms("beta", b_f, b_t, b_r)
    assert (g_f <= 0).all() and torch.isfinite(g_f).all()


def test_gating_softplus_branches_and_extremes():
    """a + dt_bias far above the threshold (returns x), at it, and far below (exp underflow)."""
    A_log = torch.zeros(5, device=DEV)
    dt_bias = torch.zeros(5, device=DEV)
    a = torch.tensor([[50.0, 20.0, 19.9, -30.0, -200.0]], device=DEV)
    b = torch.tensor([[100.0, -100.0, 0.0, 1e4, -1e4]], device=DEV)
    g_f, b_f = fast.gdn_gating(A_log, a, dt_bias, b)
    g_r, b_r = refgdn.gdn_gating(A_log, a, dt_bias, b)
    torch.testing.assert_close(g_f, g_r, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(b_f, b_r, rtol=1e-6, atol=1e-30)
    assert torch.isfinite(g_f).all() and torch.isfinite(b_f).all()


def test_gating_float64():
    A_log, a, dt_bias, b = (t.double() for t in _gating_inputs((7, 4), torch.float32))
    g_f, b_f = fast.gdn_gating(A_log, a, dt_bias, b)
    g_r, b_r = refgdn.gdn_gating(A_log, a, dt_bias, b)
    assert g_f.dtype == torch.float64 and b_f.dtype == torch.float64
    torch.testing.assert_close(g_f, g_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b_f, b_r, rtol=1e-12, atol=1e-12)


def test_l2norm_float64_keeps_eps_in_float64():
    """float64 l2norm with an eps that float32 cannot hold (Triton passes Python floats to kernels as float32: the
    kernel sums eps from two float32 parts) on rows whose sum of squares is near eps: refgdn's to float64 rounding."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=gen, dtype=torch.float64)
    x[:3] *= 1e-3                                     # sum of squares ~4e-5: eps 1e-4 is most of it
    x = x.to(DEV)
    for eps in (1e-4, 1e-3, 1.1e-6):
        torch.testing.assert_close(fast.l2norm(x, eps), refgdn.l2norm(x, eps), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided", [
    pytest.param((2, 5, 3, 128), False, id="K128"),
    pytest.param((3, 7, 100), True, id="K100-strided"),
    pytest.param((50, 32), False, id="K32"),
    pytest.param((4, 1), False, id="K1"),
    pytest.param((3,), False, id="1d"),
])
def test_l2norm_matches_refgdn(dtype, shape, strided):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape[:-1], 2 * shape[-1] + 3, generator=gen).to(DEV, dtype)
    x = x[..., 3:3 + shape[-1]] if strided else x[..., :shape[-1]].contiguous()
    y = fast.l2norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    _assert_conforms("y", y, refgdn.l2norm(x.double()), refgdn.l2norm(x))


def test_l2norm_zero_rows_and_eps():
    x = torch.zeros(3, 16, device=DEV)
    x[1] = 1.0
    for eps in (1e-6, 0.5):
        torch.testing.assert_close(fast.l2norm(x, eps), refgdn.l2norm(x, eps), rtol=1e-6, atol=1e-7)
    assert torch.equal(fast.l2norm(x)[0], torch.zeros(16, device=DEV))


def test_empty_inputs():
    """No rows, or no heads / columns: empty outputs, on every call of a layout (the planned calls included)."""
    for shape in ((0, 4), (3, 0), (2, 0, 4)):
        A_log, a, dt_bias, b = _gating_inputs(shape, torch.float32)
        for _ in range(3):
            g, beta = fast.gdn_gating(A_log, a, dt_bias, b)
            assert g.shape == shape and beta.shape == shape
    for shape in ((0, 8), (3, 0), (2, 0, 8)):
        for _ in range(3):
            assert fast.l2norm(torch.zeros(shape, device=DEV)).shape == shape


@pytest.mark.parametrize("args", [
    pytest.param(lambda: (torch.zeros(4), torch.zeros(3, 5), torch.zeros(4), torch.zeros(3, 5)), id="HV-mismatch"),
    pytest.param(lambda: (torch.zeros(4), torch.zeros(3, 4), torch.zeros(4), torch.zeros(2, 4)), id="b-shape"),
    pytest.param(lambda: (torch.zeros(4), torch.zeros(3, 4, dtype=torch.long), torch.zeros(4), torch.zeros(3, 4)),
                 id="int-a"),
])
def test_gating_bad_input_same_error_as_refgdn(args):
    with pytest.raises(ValueError) as e_fast:
        fast.gdn_gating(*args())
    with pytest.raises(ValueError) as e_ref:
        refgdn.gdn_gating(*args())
    assert str(e_fast.value) == str(e_ref.value)


def test_l2norm_bad_input_same_error_as_refgdn():
    for bad in (torch.zeros(3, 4, dtype=torch.int32), [1.0, 2.0]):
        with pytest.raises(ValueError) as e_fast:
            fast.l2norm(bad)
        with pytest.raises(ValueError) as e_ref:
            refgdn.l2norm(bad)
        assert str(e_fast.value) == str(e_ref.value)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "a-b-halves-of-one-projection"])
def test_gating_repeated_layout_is_planned_and_the_same_bits(monkeypatch, strided):
    """From a layout's third call the checks do not run (fast.launch.LayoutPlans); every call gives the full path's
    bits, also after the inputs change in place; another layout, and bad inputs after a planned one, are checked."""
    import fast.gating as fg
    calls = []
    monkeypatch.setattr(fg, "check_gating_inputs", lambda *a: calls.append(1) or refgdn.checks.check_gating_inputs(*a))
    monkeypatch.setattr(fg, "_GATING", type(fg._GATING)())
    A_log, a, dt_bias, b = _gating_inputs((2, 5, 8), torch.float32, seed=3, strided=strided)
    outs = [fast.gdn_gating(A_log, a, dt_bias, b) for _ in range(4)]
    assert len(calls) == 2
    for g, beta in outs[1:]:
        assert torch.equal(g, outs[0][0]) and torch.equal(beta, outs[0][1]) and g.data_ptr() != outs[0][0].data_ptr()
    a.mul_(0.5)
    g, beta = fast.gdn_gating(A_log, a, dt_bias, b)
    assert len(calls) == 2 and not torch.equal(g, outs[0][0])
    monkeypatch.setattr(fg, "_GATING", type(fg._GATING)())                    # the full path on the new values
    g2, beta2 = fast.gdn_gating(A_log, a, dt_bias, b)
    assert torch.equal(g, g2) and torch.equal(beta, beta2)
    for _ in range(3):
        fast.gdn_gating(A_log, a, dt_bias, b)
    with pytest.raises(ValueError, match="b must"):
        fast.gdn_gating(A_log, a, dt_bias, b[..., :4])
    with pytest.raises(ValueError, match="A_log"):
        fast.gdn_gating(A_log[:4], a, dt_bias, b)
    n = len(calls)
    fast.gdn_gating(A_log, a[:, ::2], dt_bias, b[:, ::2])                    # strided rows: another layout
    assert len(calls) == n + 1


def test_l2norm_repeated_layout_is_planned_and_the_same_bits(monkeypatch):
    """l2norm's layouts as gdn_gating's: planned from the third call (no checks), the full path's bits every call,
    a strided layout checked, bad input after a planned layout still refused."""
    import fast.gating as fg
    calls = []
    monkeypatch.setattr(fg, "_need_float", lambda *a: calls.append(1) or refgdn.checks._need_float(*a))
    monkeypatch.setattr(fg, "_L2", type(fg._L2)())
    x = torch.randn(3, 4, 24, device=DEV)
    outs = [fast.l2norm(x) for _ in range(4)]
    assert len(calls) == 2 and all(torch.equal(y, outs[0]) for y in outs)
    x.add_(1.0)
    y = fast.l2norm(x)
    assert len(calls) == 2 and not torch.equal(y, outs[0])
    monkeypatch.setattr(fg, "_L2", type(fg._L2)())
    assert torch.equal(fast.l2norm(x), y)
    fast.l2norm(x[..., ::2])                                                  # strided: another layout
    assert len(calls) == 4
    for _ in range(3):
        fast.l2norm(x)
    with pytest.raises(ValueError, match="x must"):
        fast.l2norm(x.long())
