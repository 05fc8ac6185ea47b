"""fast.causal_conv1d / fast.causal_conv1d_update against refgdn (float64 truth, the conformance rule).

CPU runs the kernels in the Triton interpreter (tests/conftest.py): shapes stay small.
"""
import itertools

import pytest
import torch

import fast
import refgdn
from conformance.core import Check, evaluate
from fast.conv import WINDOW_MAX_W, causal_conv1d_with_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]   # (bf16 on CPU: conftest rounds its casts as a GPU)


def _assert_conforms(name, fast_out, truth, ref):
    res = evaluate(Check(name, fast_out, truth, ref))
    assert res["passed"], f"{name}: error {res['error']:.3e} > bound (ref error {res['ref_error']:.3e})"


def _inputs(B, T, D, W, dtype, N=None, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # a slice of a wider projection, every other time step: strides (2*T*(D+9), 2*(D+9), 1)
        x = torch.randn(B, 2 * T, D + 9, generator=gen).to(DEV, dtype)[:, ::2, 5:5 + D]
    else:
        x = torch.randn(B, T, D, generator=gen).to(DEV, dtype)
    w = torch.randn(D, W, generator=gen) / W ** 0.5
    b = torch.randn(D, generator=gen)
    s0 = torch.randn(N or B, D, W - 1, generator=gen)
    return [x] + [t.to(DEV, dtype) for t in (w, b, s0)]


def _check_prefill(x, w, b, s0, activation, cu=None, config=None):
    kw = dict(bias=b, activation=activation, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    if config is None:
        y_f, s_f = fast.causal_conv1d(x, w, **kw)
    else:
        y_f, s_f = causal_conv1d_with_config(x, w, **kw, config=config)
    y_r, s_r = refgdn.causal_conv1d(x, w, **kw)
    hi = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    y_t, _ = refgdn.causal_conv1d(x.double(), w.double(), **hi)
    assert y_f.dtype == x.dtype and y_f.shape == x.shape
    _assert_conforms("y", y_f, y_t, y_r)
    assert s_f.dtype == s_r.dtype and torch.equal(s_f, s_r)  # a copy of inputs: bit-exact


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,D,W", [
    pytest.param(2, 1, 16, 4, id="T1"),
    pytest.param(1, 63, 40, 4, id="T63-D40"),
    pytest.param(2, 129, 24, 3, id="T129-W3"),
    pytest.param(1, 200, 100, 2, id="T200-D100-W2"),
    pytest.param(1, 17, 8, 1, id="W1"),
    pytest.param(1, 2, 33, 4, id="T-shorter-than-state"),
])
@pytest.mark.parametrize("activation,use_bias,use_init", [
    pytest.param("silu", True, True, id="silu-bias-init"),
    pytest.param(None, False, False, id="plain"),
])
def test_prefill_dense(dtype, B, T, D, W, activation, use_bias, use_init):
    x, w, b, s0 = _inputs(B, T, D, W, dtype, seed=T * 31 + D)
    _check_prefill(x, w, b if use_bias else None, s0 if use_init else None, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_strided_x(dtype):
    x, w, b, s0 = _inputs(2, 70, 36, 4, dtype, strided=True)
    assert not x.is_contiguous()
    _check_prefill(x, w, b, s0, "silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lens", [
    pytest.param([0, 1, 5, 2, 0, 70], id="empty-len1-short"),
    pytest.param([1], id="single-len1"),
    pytest.param([40, 0], id="trailing-empty"),
])
@pytest.mark.parametrize("use_init", [True, False], ids=["init", "no-init"])
def test_prefill_varlen(dtype, lens, use_init):
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    T, N = int(cu[-1]), len(lens)
    x, w, b, s0 = _inputs(1, T, 24, 4, dtype, N=N, seed=len(lens))
    _check_prefill(x, w, b, s0 if use_init else None, "silu", cu)


# The sliding-window kernel (W <= 4) under explicit configs: rows per program BT (T not a multiple
# of it, blocks shorter than the halo), channel blocks BD (D not a multiple of it), both walk
# variants (prefetch or not), and the tile kernel (the W > 4 fallback) forced on W <= 4.
WINDOW_CONFIGS = {
    "BT4-BD16": dict(BT=4, BD=16, num_warps=1),
    "BT8-BD32-noprefetch": dict(BT=8, BD=32, num_warps=1, prefetch=False),
    "BT16-BD64-prefetch": dict(BT=16, BD=64, num_warps=2, prefetch=True),
    "tile-BT16-BD32": dict(BT=16, BD=32, num_warps=4, kernel="tile"),
}


@pytest.mark.parametrize("config", list(WINDOW_CONFIGS))
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_prefill_window_configs_dense(config, W):
    x, w, b, s0 = _inputs(2, 13, 40, W, torch.float32, seed=W)
    _check_prefill(x, w, b, s0, "silu", config=WINDOW_CONFIGS[config])


@pytest.mark.parametrize("config", list(WINDOW_CONFIGS))
@pytest.mark.parametrize("W", [2, 4])
def test_prefill_window_configs_varlen_strided(config, W):
    """Empty and length-1 sequences, sequences shorter than the halo and crossing blocks; x a
    strided slice (time and channel strides > 1); with and without an initial state."""
    lens = [0, 1, 5, 2, 0, 11]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    T, N, D = int(cu[-1]), len(lens), 24
    gen = torch.Generator().manual_seed(W)
    x = torch.randn(1, 2 * T, 2 * D + 3, generator=gen).to(DEV)[:, ::2, 3::2]   # strides (.., 2(2D+3), 2)
    assert x.stride(2) == 2
    _, w, b, s0 = _inputs(1, T, D, W, torch.float32, N=N, seed=W + 1)
    _check_prefill(x, w, b, s0, "silu", cu, config=WINDOW_CONFIGS[config])
    _check_prefill(x, w, None, None, None, cu, config=WINDOW_CONFIGS[config])


@pytest.mark.parametrize("W", [1, 3, 4])
def test_prefill_window_float64_and_mixed_state_dtype(W):
    """float64 inputs compute in float64; a float32 state with float16 x feeds the halo in float32."""
    x, w, b, s0 = _inputs(1, 10, 20, W, torch.float64, seed=W)
    _check_prefill(x, w, b, s0, "silu", config=dict(BT=4, BD=16, num_warps=1))
    x16, w16, b16, _ = _inputs(2, 6, 20, W, torch.float16, seed=W)
    s32 = torch.randn(2, 20, W - 1, device=DEV)
    kw = dict(bias=b16, activation="silu", initial_state=s32, output_final_state=True)
    y_f, s_f = causal_conv1d_with_config(x16, w16, **kw, config=dict(BT=4, BD=16, num_warps=1))
    y_r, s_r = refgdn.causal_conv1d(x16, w16, **kw)
    y_t, _ = refgdn.causal_conv1d(x16.double(), w16.double(), b16.double(), "silu", s32.double())
    _assert_conforms("y", y_f, y_t, y_r)
    assert s_f.dtype == torch.float32 and torch.equal(s_f, s_r)


@pytest.mark.parametrize("B,T,D,W,varlen", [
    pytest.param(2, 37, 24, 5, False, id="W5"),
    pytest.param(1, 20, 16, 7, False, id="W7-T-shorter-than-block"),
    pytest.param(1, 0, 16, 6, True, id="W6-varlen"),
])
def test_prefill_tile_fallback_wide_kernels(B, T, D, W, varlen):
    """W > WINDOW_MAX_W runs the tile kernel (pinned config), with states and varlen."""
    assert W > WINDOW_MAX_W
    cu = None
    if varlen:
        lens = [0, 1, 9, 3]
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
        T = int(cu[-1])
    x, w, b, s0 = _inputs(B, T, D, W, torch.float32, N=4 if varlen else None, seed=W)
    _check_prefill(x, w, b, s0, "silu", cu)


@pytest.mark.parametrize("config", [dict(kernel="window"), dict(kernel="window", BT=6), dict(kernel="fft")],
                         ids=["window-W5", "BT6", "unknown-kernel"])
def test_bad_config_raises(config):
    x, w, _, _ = _inputs(1, 8, 16, 5 if config.get("BT") is None else 4, torch.float32)
    with pytest.raises(ValueError, match="config"):
        causal_conv1d_with_config(x, w, config=config)


def test_varlen_equals_per_sequence_calls():
    lens = [3, 0, 1, 33]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), device=DEV)
    x, w, b, s0 = _inputs(1, int(cu[-1]), 20, 4, torch.float32, N=len(lens))
    y, s = fast.causal_conv1d(x, w, b, "silu", s0, True, cu)
    for n in range(len(lens)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        y_n, s_n = fast.causal_conv1d(x[:, sl], w, b, "silu", s0[n:n + 1], True)
        assert torch.equal(y[:, sl], y_n)
        assert torch.equal(s[n:n + 1], s_n)
    assert torch.equal(s[1], s0[1])  # the empty sequence hands its state through


def test_final_state_dtype_follows_initial_state():
    x, w, b, _ = _inputs(1, 9, 16, 4, torch.float16)
    s0 = torch.randn(1, 16, 3, device=DEV)  # float32 state, float16 inputs
    y, s = fast.causal_conv1d(x, w, b, None, s0, True)
    y_r, s_r = refgdn.causal_conv1d(x, w, b, None, s0, True)
    assert s.dtype == torch.float32 and torch.equal(s, s_r)
    _, s_none = fast.causal_conv1d(x, w, b, None, None, False)
    assert s_none is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("W", [4, 2, 1])
def test_update_matches_refgdn(dtype, W):
    N, D, steps = 3, 40, 3
    gen = torch.Generator().manual_seed(W)
    xs = torch.randn(steps, N, D, generator=gen).to(DEV, dtype)
    w = (torch.randn(D, W, generator=gen) / W ** 0.5).to(DEV, dtype)
    b = torch.randn(D, generator=gen).to(DEV, dtype)
    st_f = torch.randn(N, D, W - 1, generator=gen).to(DEV, dtype)
    st_r, st_t = st_f.clone(), st_f.double()
    for s in range(steps):
        y_f = fast.causal_conv1d_update(xs[s], st_f, w, b, "silu")
        y_r = refgdn.causal_conv1d_update(xs[s], st_r, w, b, "silu")
        y_t = refgdn.causal_conv1d_update(xs[s].double(), st_t, w.double(), b.double(), "silu")
        assert y_f.dtype == dtype
        _assert_conforms(f"y[{s}]", y_f, y_t, y_r)
        assert torch.equal(st_f, st_r)


def test_update_strided_slot_cache_touches_only_its_view():
    """conv_state as a strided view of a slot cache [slots, D, W-1+spare]: only the view changes."""
    N, D, W = 2, 24, 4
    cache = torch.randn(5, D, W - 1 + 2, device=DEV)
    before = cache.clone()
    view = cache[1:1 + N, :, :W - 1]
    x = torch.randn(N, 2 * D, device=DEV)[:, ::2]
    w = torch.randn(D, W, device=DEV)
    ref_state = view.clone()
    y = fast.causal_conv1d_update(x, view, w, None, None)
    y_r = refgdn.causal_conv1d_update(x, ref_state, w, None, None)
    torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)
    assert torch.equal(view, ref_state)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[1:1 + N, :, :W - 1] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_update_state_dtype_rounding():
    """float32 x into a float16 state: the appended column is x rounded like a store, as in refgdn."""
    N, D, W = 2, 16, 4
    x = torch.randn(N, D, device=DEV)
    w = torch.randn(D, W, device=DEV)
    st = torch.randn(N, D, W - 1, device=DEV).half()
    st_r = st.clone()
    fast.causal_conv1d_update(x, st, w)
    refgdn.causal_conv1d_update(x, st_r, w)
    assert st.dtype == torch.float16 and torch.equal(st, st_r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,split", [pytest.param(12, 5, id="T12-split5"), pytest.param(6, 0, id="from-init"),
                                     pytest.param(7, 2, id="prefix-shorter-than-state")])
def test_prefix_then_updates_equals_full_prefill(dtype, T, split):
    """fast prefill of a prefix + fast updates == fast/refgdn prefill of the whole sequence; the
    state after the last update is torch.equal to refgdn's final state."""
    N, D, W = 2, 20, 4
    x, w, b, s0 = _inputs(N, T, D, W, dtype, seed=T + split)
    y_full_r, s_full_r = refgdn.causal_conv1d(x, w, b, "silu", s0, True)
    y_full_t, _ = refgdn.causal_conv1d(x.double(), w.double(), b.double(), "silu", s0.double(), True)
    y_pre, state = fast.causal_conv1d(x[:, :split], w, b, "silu", s0, True)
    ys = [y_pre]
    for t in range(split, T):
        ys.append(fast.causal_conv1d_update(x[:, t], state, w, b, "silu")[:, None])
    y = torch.cat(ys, 1)
    _assert_conforms("y", y, y_full_t, y_full_r)
    assert torch.equal(state, s_full_r)


BAD = {  # id -> (op, (x, w, s) -> (args, kwargs))
    "x-2d": ("causal_conv1d", lambda x, w, s: ((x[0], w), {})),
    "weight-3d": ("causal_conv1d", lambda x, w, s: ((x, w[:, :, None]), {})),
    "activation": ("causal_conv1d", lambda x, w, s: ((x, w), dict(activation="relu"))),
    "state-width": ("causal_conv1d", lambda x, w, s: ((x, w), dict(initial_state=s[:, :, :2]))),
    "cu-end": ("causal_conv1d", lambda x, w, s: ((x, w), dict(cu_seqlens=torch.tensor([0, 3])))),
    "bias-shape": ("causal_conv1d", lambda x, w, s: ((x, w), dict(bias=torch.zeros(3)))),
    "update-state-width": ("causal_conv1d_update", lambda x, w, s: ((x[:, 0], s[:, :, :2], w), {})),
    "update-weight-D": ("causal_conv1d_update", lambda x, w, s: ((x[:, 0], s, w[:5]), {})),
    "update-int-x": ("causal_conv1d_update", lambda x, w, s: ((x[:, 0].long(), s, w), {})),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_same_error_as_refgdn_and_state_untouched(case):
    op, make = BAD[case]
    x, w, s = torch.randn(1, 9, 8), torch.randn(8, 4), torch.randn(1, 8, 3)
    s_before = s.clone()
    args, kwargs = make(x, w, s)
    with pytest.raises(ValueError) as e_fast:
        getattr(fast, op)(*args, **kwargs)
    with pytest.raises(ValueError) as e_ref:
        getattr(refgdn, op)(*args, **kwargs)
    assert str(e_fast.value) == str(e_ref.value)
    assert torch.equal(s, s_before)


def test_one_prefill_plan_serves_every_token_and_sequence_count():
    """As fast.chunk_gated_delta_rule's: the signature leaves the token and sequence counts out, so from the second
    call on one plan serves a stream of varlen prefills of changing shapes (launches checked per call by
    fast.launch), bit for bit the checked path without a plan; calls whose N disagrees between arguments, or
    whose offsets are bad, still raise."""
    import fast.conv as fcv
    fcv.clear_plan_cache()
    D, W = 24, 4
    lens_list = [[7, 0, 33], [40], [5, 16, 3, 9], [1, 1], [17, 30, 2], [64, 64]]
    for lens in lens_list + lens_list[:1]:          # (the first call builds the plan; its lengths come back last)
        T, N = sum(lens), len(lens)
        x, w, b, s0 = _inputs(1, T, D, W, torch.float32, N=N, seed=T)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
        kw = dict(bias=b, activation="silu", initial_state=s0, output_final_state=True, cu_seqlens=cu)
        want = causal_conv1d_with_config(x, w, **kw)
        kw["cu_seqlens_cpu"] = cu.cpu()
        got = fast.causal_conv1d(x, w, **kw)
        assert all(torch.equal(a, c) for a, c in zip(got, want)), lens
    assert len(fcv._PLANS) == 1
    with pytest.raises(ValueError, match="initial_state"):                   # N + 1 initial states for N sequences
        fast.causal_conv1d(x, w, **dict(kw, initial_state=torch.cat([s0, s0[:1]])))
    bad = torch.tensor([0, 70, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):                  # the same signature, bad values
        fast.causal_conv1d(x, w, **dict(kw, cu_seqlens=bad.to(DEV), cu_seqlens_cpu=bad))
    assert len(fcv._PLANS) == 1
    fcv.clear_plan_cache()
