"""The norms, the gated output norm (rms_norm_gated) and the model's plain one (rms_norm): refgdn against the
row-by-row formula and finite differences, fast against refgdn (float64 truth, the conformance rule) forward and
backward, and the fla-compatible surface."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import fast
import refgdn
from conformance.core import Check, evaluate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rowwise(x, g, w, b, act, eps, unit=False):
    """The simplest form: one row at a time, float64, plain arithmetic. g None: no gate (rms_norm); unit: the
    weight is 1 + w."""
    x = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        r = 1.0 / math.sqrt(sum(float(v) ** 2 for v in x[i]) / x.shape[1] + eps)
        for j in range(x.shape[1]):
            wj = (float(w[j]) + (1.0 if unit else 0.0)) if w is not None else 1.0
            y = float(x[i, j]) * r * wj + (float(b[j]) if b is not None else 0.0)
            if g is not None:
                gij = float(g.reshape(-1, x.shape[1])[i, j])
                s = 1.0 / (1.0 + math.exp(-gij))
                y = y * (gij * s if act in ("swish", "silu") else s)
            out[i, j] = y
    return out


@pytest.mark.parametrize("act", ["swish", "silu", "sigmoid"])
@pytest.mark.parametrize("affine", ["weight-bias", "weight", "none"])
def test_refgdn_matches_rowwise_formula(act, affine):
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(3, 2, 7, generator=gen, dtype=torch.float64), 4 * torch.randn(3, 2, 7, generator=gen,
                                                                                       dtype=torch.float64)
    x[0, 0] *= 1e-4                                   # a tiny row: eps matters
    w = torch.randn(7, generator=gen, dtype=torch.float64) if affine != "none" else None
    b = torch.randn(7, generator=gen, dtype=torch.float64) if affine == "weight-bias" else None
    y = refgdn.rms_norm_gated(x, g, w, b, act, eps=1e-5)
    torch.testing.assert_close(y.reshape(-1, 7), _rowwise(x, g, w, b, act, 1e-5), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_refgdn_gradients_match_finite_differences(act):
    gen = torch.Generator().manual_seed(1)
    args = [torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)
            for s in ((4, 6), (4, 6), (6,), (6,))]
    assert torch.autograd.gradcheck(lambda x, g, w, b: refgdn.rms_norm_gated(x, g, w, b, act, eps=1e-6), args)


def _inputs(shape, dtype, layout, gen, weight=True, bias=True):
    """x and g [..., D] on DEVICE: "contiguous"; "slices" (x and g halves of one [..., 2D + 3] projection, the model's
    z); "heads" ([T, HV, D] taken from a [HV, T, D] buffer: leading dims that do not merge into one stride)."""
    *lead, D = shape
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if layout == "slices":
        p = r(*lead, 2 * D + 3).to(dtype).to(DEVICE)
        x, g = p[..., :D], p[..., D + 3:]
    elif layout == "heads":
        x = r(lead[1], lead[0], D).to(dtype).to(DEVICE).transpose(0, 1)
        g = r(lead[1], lead[0], D).to(dtype).to(DEVICE).transpose(0, 1)
    else:
        x, g = r(*shape).to(dtype).to(DEVICE), r(*shape).to(dtype).to(DEVICE)
    x = x * 3.0
    w = (1 + 0.3 * r(D)).to(dtype).to(DEVICE) if weight else None
    b = (0.3 * r(D)).to(dtype).to(DEVICE) if bias else None
    return x, g, w, b


def _seed(*params) -> int:
    """A case's input seed, the same in every process (hash() of a str is salted per process: PYTHONHASHSEED)."""
    return zlib.crc32(repr(params).encode())


def _conforms(name, fast_t, truth, ref, dtype):
    res = evaluate(Check(name, fast_t, truth, ref, dtype=dtype))
    assert res["passed"], f"{name}: {res}"


SHAPES = [pytest.param((37, 4, 128), "slices", id="T37-HV4-V128-slices"),
          pytest.param((5, 3, 100), "heads", id="D100-heads-strided"),
          pytest.param((1, 32, 128), "contiguous", id="decode-N1-HV32"),
          pytest.param((9, 1), "contiguous", id="D1"),
          pytest.param((3, 3000), "contiguous", id="D3000-one-row-a-block"),
          pytest.param((0, 4, 16), "contiguous", id="empty")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,layout", SHAPES)
@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_fast_forward_and_backward_conform(dtype, shape, layout, act):
    """fast's forward and its gradients (dx, dg, dweight, dbias) by the conformance rule: fast's error against the
    float64 truth at most twice refgdn's own in the same precision (+ the floor)."""
    gen = torch.Generator().manual_seed(_seed(shape, layout, act))
    x, g, w, b = _inputs(shape, dtype, layout, gen, bias=act == "sigmoid")
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    outs = {}
    for name, mod, cast in (("fast", fast, None), ("ref", refgdn, None), ("truth", refgdn, torch.float64)):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_(True) if t is not None else None for t in (x, g, w, b)]
        y = mod.rms_norm_gated(*leaves, act, eps=1e-6)
        need = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(y, need, dy.to(y.dtype)) if y.numel() else [torch.zeros_like(t) for t in need]
        outs[name] = [y.detach()] + list(grads)
    assert outs["fast"][0].dtype == dtype and outs["fast"][0].shape == x.shape
    for i, n in enumerate(["y", "dx", "dg", "dweight", "dbias"][:len(outs["fast"])]):
        _conforms(n, outs["fast"][i], outs["truth"][i], outs["ref"][i], dtype)


def test_fast_equals_refgdn_in_float64():
    """float64 inputs run float64 kernels: fast and refgdn agree to float64 rounding."""
    gen = torch.Generator().manual_seed(3)
    x, g, w, b = _inputs((6, 2, 24), torch.float64, "slices", gen)
    torch.testing.assert_close(fast.rms_norm_gated(x, g, w, b, "silu"), refgdn.rms_norm_gated(x, g, w, b, "silu"),
                               rtol=1e-12, atol=1e-12)


def test_fast_inputs_are_not_written_and_the_output_is_fresh():
    gen = torch.Generator().manual_seed(4)
    x, g, w, b = _inputs((4, 3, 32), torch.float32, "slices", gen)
    before = [t.clone() for t in (x, g, w, b)]
    y = fast.rms_norm_gated(x, g, w, b)
    assert y.is_contiguous() and y.data_ptr() not in {t.data_ptr() for t in (x, g, w, b)}
    assert all(torch.equal(t, u) for t, u in zip((x, g, w, b), before))


def test_fla_positional_order_and_limits():
    """fla 0.6.0's order: (x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps); fast's D limit
    is its own (refgdn has none), raised before any launch."""
    gen = torch.Generator().manual_seed(5)
    x, g, w, _ = _inputs((3, 16), torch.float32, "contiguous", gen, bias=False)
    a = fast.rms_norm_gated(x, g, w, None, "sigmoid", None, False, False, 1e-3)
    torch.testing.assert_close(a, refgdn.rms_norm_gated(x, g, w, eps=1e-3, activation="sigmoid"))
    big = torch.zeros(1, fast.norm.MAX_D + 1, device=DEVICE)
    with pytest.raises(ValueError, match="D must be <= 16384"):
        fast.rms_norm_gated(big, big, None)
    assert refgdn.rms_norm_gated(big, big, None).shape == big.shape


def test_custom_op_registration():
    """torch.library's checks of the autograd / fake registrations of torch.ops.fast.rms_norm_gated."""
    gen = torch.Generator().manual_seed(6)
    x, g, w, b = _inputs((3, 2, 16), torch.float32, "slices", gen)
    args = (x.detach().requires_grad_(), g.detach().requires_grad_(), w.detach().requires_grad_(), b, "swish", 1e-6)
    torch.library.opcheck(torch.ops.fast.rms_norm_gated.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ----------------------------------------------------------------------------------------------
# rms_norm: the model's plain norm (unit_offset: the zero-centred weight)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("affine", ["weight-bias", "weight", "unit", "none"])
def test_refgdn_rms_norm_matches_rowwise_formula(affine):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, 2, 7, generator=gen, dtype=torch.float64)
    x[0, 0] *= 1e-4                                   # a tiny row: eps matters
    w = torch.randn(7, generator=gen, dtype=torch.float64) if affine != "none" else None
    b = torch.randn(7, generator=gen, dtype=torch.float64) if affine == "weight-bias" else None
    y = refgdn.rms_norm(x, w, b, eps=1e-5, unit_offset=affine == "unit")
    torch.testing.assert_close(y.reshape(-1, 7), _rowwise(x, None, w, b, None, 1e-5, affine == "unit"), rtol=1e-13,
                               atol=1e-13)


@pytest.mark.parametrize("unit", [False, True])
def test_refgdn_rms_norm_gradients_match_finite_differences(unit):
    gen = torch.Generator().manual_seed(11)
    args = [torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in ((4, 6), (6,), (6,))]
    assert torch.autograd.gradcheck(lambda x, w, b: refgdn.rms_norm(x, w, b, eps=1e-6, unit_offset=unit), args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,layout", [p for p in SHAPES if p.id != "D3000-one-row-a-block"] +
                         [pytest.param((2, 2048), "contiguous", id="hidden2048")])
@pytest.mark.parametrize("unit", [False, True], ids=["weight-bias", "unit"])
def test_fast_rms_norm_forward_and_backward_conform(dtype, shape, layout, unit):
    """fast.rms_norm and its gradients (dx, dweight, dbias) by the conformance rule, on the layouts of the gated
    norm's tests (x a slice of a projection, leading dims that do not merge) and the model's hidden width."""
    gen = torch.Generator().manual_seed(_seed(shape, layout, unit, "plain"))
    x, _, w, b = _inputs(shape, dtype, layout, gen, bias=not unit)
    if unit:
        w = w - 1                                     # a zero-centred weight
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    outs = {}
    for name, mod, cast in (("fast", fast, None), ("ref", refgdn, None), ("truth", refgdn, torch.float64)):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_(True) if t is not None else None for t in (x, w, b)]
        y = mod.rms_norm(*leaves, eps=1e-6, unit_offset=unit)
        need = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(y, need, dy.to(y.dtype)) if y.numel() else [torch.zeros_like(t) for t in need]
        outs[name] = [y.detach()] + list(grads)
    assert outs["fast"][0].dtype == dtype and outs["fast"][0].shape == x.shape
    for i, n in enumerate(["y", "dx", "dweight", "dbias"][:len(outs["fast"])]):
        _conforms(n, outs["fast"][i], outs["truth"][i], outs["ref"][i], dtype)


def test_fast_rms_norm_equals_refgdn_in_float64_and_fla_order():
    """float64 inputs run float64 kernels; fla 0.6.0's positional order (x, weight, bias, residual, eps, prenorm,
    residual_in_fp32) with unit_offset keyword-only; bad arguments raise before any launch."""
    gen = torch.Generator().manual_seed(12)
    x, _, w, b = _inputs((6, 2, 24), torch.float64, "slices", gen)
    a = fast.rms_norm(x, w, b, None, 1e-3, False, False)
    torch.testing.assert_close(a, refgdn.rms_norm(x, w, b, eps=1e-3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast.rms_norm(x, w, None, unit_offset=True),
                               refgdn.rms_norm(x, w, None, unit_offset=True), rtol=1e-12, atol=1e-12)
    for pkg in (fast, refgdn):
        with pytest.raises(ValueError, match="residual must have shape"):
            pkg.rms_norm(x, w, b, x[..., :3])
        with pytest.raises(ValueError, match="unit_offset=True .* needs a weight"):
            pkg.rms_norm(x, None, unit_offset=True)
    with pytest.raises(TypeError):
        fast.rms_norm(x, w, b, None, 1e-5, False, False, True)      # unit_offset is keyword-only


def test_rms_norm_custom_op_registration():
    gen = torch.Generator().manual_seed(13)
    x, _, w, b = _inputs((3, 2, 16), torch.float32, "slices", gen)
    r = torch.randn(x.shape, generator=gen).to(DEVICE)
    for args in ((x.detach().requires_grad_(), w.detach().requires_grad_(), b, None, 1e-6, True, None),
                 (x.detach().requires_grad_(), w.detach().requires_grad_(), b, r.requires_grad_(), 1e-6, True,
                  torch.float32)):
        torch.library.opcheck(torch.ops.fast.rms_norm.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_model_norm_is_the_previous_torch_formula_bit_for_bit():
    """refgdn.model's RMSNorm now runs through its ops namespace (refgdn.rms_norm with unit_offset): bit for bit the
    torch formula it had, so the refgdn model's numbers did not move; in a model on fast ops its norms run fast's."""
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    from refgdn.model.layers import RMSNorm
    gen = torch.Generator().manual_seed(14)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        norm = RMSNorm(40, 1e-6, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(0.2 * torch.randn(40, generator=gen))
        x = (3 * torch.randn(5, 40, generator=gen)).to(dtype)
        dt = torch.float64 if dtype == torch.float64 else torch.float32
        xf = x.to(dt)
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight.to(dt))).to(dtype)
        assert torch.equal(norm(x), want)
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="fast", seed=0)
    norms = [mod for mod in m.modules() if isinstance(mod, RMSNorm)]
    assert norms and all(mod.ops is fast for mod in norms)


def _residual_rule(x, r, fp32):
    """fla 0.6.0's residual stream, written out: the sum in float32, normalised as computed; returned (prenorm) in the
    residual's dtype, else float32 with residual_in_fp32 (x itself when x is float32 or nothing asks for a copy)."""
    s = x.float() + (r.float() if r is not None else 0)
    want = r.dtype if r is not None else (torch.float32 if fp32 and x.dtype != torch.float32 else None)
    return s, want


@pytest.mark.parametrize("res_dtype", [None, torch.bfloat16, torch.float32], ids=["no-residual", "bf16", "fp32"])
@pytest.mark.parametrize("residual_in_fp32", [False, True], ids=["", "residual_in_fp32"])
def test_rms_norm_residual_stream_follows_fla(res_dtype, residual_in_fp32):
    """rms_norm(x, w, b, residual, eps, prenorm=True, residual_in_fp32) -> (y, residual_out), fla's pre-norm block:
    y normalises x + residual as computed in float32; residual_out is that sum in the residual's dtype (float32 with
    residual_in_fp32 and no residual; x itself otherwise). Both packages, and fast by the conformance rule, gradients
    of x, the residual and the weight included (the sum's gradient flows back through residual_out too)."""
    gen = torch.Generator().manual_seed(15)
    x = (3 * torch.randn(4, 5, 64, generator=gen, dtype=torch.float64)).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(4, 5, 64, generator=gen, dtype=torch.float64).to(res_dtype).to(DEVICE) if res_dtype else None
    w = (0.2 * torch.randn(64, generator=gen, dtype=torch.float64)).to(torch.bfloat16).to(DEVICE)
    s, want = _residual_rule(x, r, residual_in_fp32)
    for pkg in (refgdn, fast):
        y, out = pkg.rms_norm(x, w, None, r, 1e-6, True, residual_in_fp32, unit_offset=True)
        if want is None:
            assert out is x
        else:
            assert out.dtype == want and torch.equal(out, s.to(want))
        # without prenorm: y alone, the same y
        assert torch.equal(pkg.rms_norm(x, w, None, r, 1e-6, False, residual_in_fp32, unit_offset=True), y)
    # fast by the rule, forward and backward
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(torch.bfloat16).to(DEVICE)
    ds = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(want or x.dtype).to(DEVICE)
    outs = {}
    for name, mod, cast in (("fast", fast, None), ("ref", refgdn, None), ("truth", refgdn, torch.float64)):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_(True) if t is not None else None for t in (x, r, w)]
        y, out = mod.rms_norm(leaves[0], leaves[2], None, leaves[1], 1e-6, True, residual_in_fp32, unit_offset=True)
        need = [t for t in leaves if t is not None]
        grads = torch.autograd.grad((y, out), need, (dy.to(y.dtype), ds.to(out.dtype)))
        outs[name] = [y.detach(), out.detach()] + list(grads)
    names = ["y", "residual_out", "dx"] + (["dresidual"] if r is not None else []) + ["dweight"]
    for i, n in enumerate(names):
        _conforms(n, outs["fast"][i], outs["truth"][i], outs["ref"][i], outs["fast"][i].dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="fla's kernels need a GPU")
def test_rms_norm_residual_stream_against_fla_itself():
    """The same positional call in fla 0.6.0 and in fast (x, weight, bias, residual, eps, prenorm, residual_in_fp32):
    residual_out bit for bit (both round the float32 sum once), y by the conformance rule (each against refgdn's
    float64 truth)."""
    fla_ln = pytest.importorskip("fla.modules.layernorm")
    gen = torch.Generator().manual_seed(16)
    x = (3 * torch.randn(6, 7, 256, generator=gen, dtype=torch.float64)).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(6, 7, 256, generator=gen, dtype=torch.float64).to(torch.float32).to(DEVICE)
    w = (1 + 0.2 * torch.randn(256, generator=gen, dtype=torch.float64)).to(torch.bfloat16).to(DEVICE)
    y_fla, s_fla = fla_ln.rms_norm(x, w, None, r, 1e-5, True, False)
    y_f, s_f = fast.rms_norm(x, w, None, r, 1e-5, True, False)
    assert s_f.dtype == s_fla.dtype == torch.float32 and torch.equal(s_f, s_fla)
    truth = refgdn.rms_norm(x.double(), w.double(), None, r.double(), 1e-5)
    _conforms("y (fast)", y_f, truth, refgdn.rms_norm(x, w, None, r, 1e-5), torch.bfloat16)
    _conforms("y (fla)", y_fla, truth, refgdn.rms_norm(x, w, None, r, 1e-5), torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# the eager forward's plans by call layout (fast.norm._cached_fwd)
# ----------------------------------------------------------------------------------------------

def _count_checks(monkeypatch):
    """Counts of the full host checks fast's two norms run (fast.norm's names are patched)."""
    import fast.norm as fn
    calls = {"plain": 0, "gated": 0}

    def counted(kind, check):
        def wrapped(*a, **k):
            calls[kind] += 1
            return check(*a, **k)
        return wrapped
    monkeypatch.setattr(fn, "check_rms_norm_inputs", counted("plain", fn.check_rms_norm_inputs))
    monkeypatch.setattr(fn, "check_rms_norm_gated_inputs", counted("gated", fn.check_rms_norm_gated_inputs))
    monkeypatch.setattr(fn, "_FWD", type(fn._FWD)())
    return calls


def test_a_repeated_layout_skips_the_checks_and_gives_the_same_bits(monkeypatch):
    """From a layout's third call (the second keeps its plan) the checks do not run, and the planned calls equal the
    full call bit for bit, also after the inputs change in place (a plan holds no values)."""
    calls = _count_checks(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 2, 48, generator=gen).to(DEVICE)
    g = torch.randn(3, 2, 48, generator=gen).to(DEVICE)
    w = torch.randn(48, generator=gen).to(DEVICE)
    res = torch.randn(3, 2, 48, generator=gen).to(DEVICE)
    plain = [fast.rms_norm(x, w, None, res, 1e-6, True, unit_offset=True) for _ in range(4)]
    gated = [fast.rms_norm_gated(x, g, w, None, "sigmoid", eps=1e-6) for _ in range(4)]
    assert calls == {"plain": 2, "gated": 2}
    for outs in (gated, [y for y, _ in plain], [r for _, r in plain]):
        for o in outs[1:]:
            assert torch.equal(o, outs[0]) and o.data_ptr() != outs[0].data_ptr()    # fresh outputs each call
    torch.testing.assert_close(plain[0][1], x + res, rtol=0, atol=0)
    x.mul_(-2.0)                                      # new values, same layout: planned, and they count
    y = fast.rms_norm_gated(x, g, w, None, "sigmoid", eps=1e-6)
    assert calls["gated"] == 2 and not torch.equal(y, gated[0])
    import fast.norm as fn
    monkeypatch.setattr(fn, "_FWD", type(fn._FWD)())                            # the full path on the new values
    assert torch.equal(fast.rms_norm_gated(x, g, w, None, "sigmoid", eps=1e-6), y)


def test_a_known_layout_still_rejects_what_differs(monkeypatch):
    """A planned layout serves only calls with its metadata and arguments: another eps, flag, weight shape, dtype or
    stride, or a wrong-shaped g, goes through the full checks (bad ones raise their ValueError)."""
    calls = _count_checks(monkeypatch)
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.randn(32, device=DEVICE)
    for _ in range(3):
        fast.rms_norm(x, w, eps=1e-6)
        fast.rms_norm_gated(x, x, w, eps=1e-6)
    assert calls == {"plain": 2, "gated": 2}
    with pytest.raises(ValueError, match="eps"):
        fast.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        fast.rms_norm_gated(x, x, w, eps=float("nan"))
    with pytest.raises(ValueError, match="weight"):
        fast.rms_norm(x, torch.randn(31, device=DEVICE), eps=1e-6)
    with pytest.raises(ValueError, match="g must"):
        fast.rms_norm_gated(x, x[:, :16], w, eps=1e-6)
    with pytest.raises(ValueError, match="unit_offset"):
        fast.rms_norm(x, w, eps=1e-6, unit_offset=1)
    with pytest.raises(ValueError, match="activation"):
        fast.rms_norm_gated(x, x, w, activation="relu", eps=1e-6)
    before = dict(calls)
    y = fast.rms_norm(x[:, ::2], w[:16], eps=1e-6)                 # strided rows: another layout, checked
    assert calls["plain"] == before["plain"] + 1
    torch.testing.assert_close(y, fast.rms_norm(x[:, ::2].contiguous(), w[:16], eps=1e-6), rtol=0, atol=0)


def test_a_planned_layout_still_takes_autograd_when_a_gradient_is_wanted(monkeypatch):
    """Planned under no_grad, the same tensors with requires_grad under grad mode take the custom op (a grad_fn, and
    gradients that match refgdn's by the rule's float64 form)."""
    _count_checks(monkeypatch)
    x = torch.randn(2, 24, device=DEVICE, dtype=torch.float64)
    w = torch.randn(24, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        for _ in range(3):
            assert fast.rms_norm(x, w, eps=1e-6).grad_fn is None
    y = fast.rms_norm(x, w, eps=1e-6)
    assert y.grad_fn is not None
    (gw,) = torch.autograd.grad(y.sum(), w)
    (rw,) = torch.autograd.grad(refgdn.rms_norm(x, w, eps=1e-6).sum(), w)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32), (0, 3, 32)], ids=["no-rows", "no-rows-3d", "no-rows-lead"])
def test_empty_rows_on_every_call(shape):
    """No rows: empty outputs (and an empty pre-norm sum) on every call of the layout, the planned ones included."""
    x = torch.zeros(shape, device=DEVICE)
    w = torch.ones(shape[-1], device=DEVICE)
    for _ in range(3):
        y, res = fast.rms_norm(x, w, residual=x.clone(), prenorm=True)
        assert y.shape == shape and res.shape == shape
        assert fast.rms_norm_gated(x, x, w).shape == shape
