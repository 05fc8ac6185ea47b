"""fast.serving (Triton; the interpreter on CPU) against refgdn.serving beyond the conformance matrix (its serving
cases run in the quick matrix, the first half of the README's test command): strided conv states, bfloat16 state storage, padded rows, device-side faults (skip the request, record, raise at
check()) matching refgdn's skip-and-record mode, and identical input errors. The full list of bad-input
classes, run against both packages, is tests/test_bad_inputs.py."""
import functools

import pytest
import torch

import fast.serving as fs
import refgdn.serving as rs
from conformance.cases_serving import cast_cache, make_cache, make_layer, make_tokens
from refgdn.serving import committed_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _args(layer):
    return layer["conv_weight"], layer["conv_bias"], layer["A_log"], layer["dt_bias"]


def _to(layer, dtype=None, device=DEVICE):
    return {k: (v.to(device=device, dtype=dtype or v.dtype) if v is not None else None) for k, v in layer.items()}


def _run_both(cache_ref, cache_fast, layer_ref, layer_fast, slots, schedule, HV, D, dtype, scale=None):
    """Drive both implementations through (kind, lens, accepts) steps; return paired outputs."""
    idx = torch.tensor(slots, dtype=torch.int32)
    outs = []
    for i, (kind, lens, acc) in enumerate(schedule):
        x, a, b = make_tokens(sum(lens), HV, D, seed=100 + i, dtype=dtype)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        pair = []
        for ops, c, lay, dev in ((rs, cache_ref, layer_ref, "cpu"), (fs, cache_fast, layer_fast, DEVICE)):
            xd, ad, bd, idd, cud = (t.to(dev) for t in (x, a, b, idx, cu))
            if kind == "verify":
                o = ops.gdn_verify(xd, ad, bd, *_args(lay), c, idd, cud, scale=scale)
                ops.gdn_accept(c, idd, torch.tensor(acc, dtype=torch.int32, device=dev))
            elif kind == "decode":
                o = ops.gdn_decode(xd, ad, bd, *_args(lay), c, idd, scale=scale)
            else:
                ops.gdn_materialize(c, idd)
                o = None
            pair.append(o)
        outs.append(pair)
    return outs


def _assert_as_refgdn(outs, c_fast, c_ref):
    """Every step's outputs and the final ssm state close to refgdn's (float32); conv windows and
    metadata identical (copies)."""
    for o_r, o_f in outs:
        if o_r is not None:
            torch.testing.assert_close(o_f.cpu(), o_r, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_fast.conv_state.cpu(), c_ref.conv_state)
    torch.testing.assert_close(c_fast.ssm_state.cpu(), c_ref.ssm_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_fast.pend_meta.cpu(), c_ref.pend_meta)


@pytest.mark.parametrize("layout", ["channels-contiguous", "rows-contiguous", "sliced"])
def test_strided_conv_state_and_inputs(layout):
    """conv_state layouts: allocate's ([S, W', D] storage seen as [S, D, W']), row-major [S, D, W']
    (vLLM's older layout), a slice of a wider buffer; and strided a, b, x."""
    H, HV, K, V, W, S = 1, 2, 8, 8, 4, 3
    D = 2 * H * K + HV * V
    base = make_cache(S, H, HV, K, V, W, 3, seed=1, state_dtype=torch.float32, act_dtype=torch.float32)
    assert base.conv_state.stride(1) == 1                                     # allocate: channels contiguous
    c_ref = base.clone()
    c_fast = base.clone().to(device=DEVICE)
    if layout == "rows-contiguous":
        c_fast.conv_state = c_fast.conv_state.contiguous()                    # [S, D, W-1+3] row-major
        assert c_fast.conv_state.stride(2) == 1
    elif layout == "sliced":
        wide = torch.zeros(S, D, 2 * (W - 1 + 3), device=DEVICE)
        wide[:, :, 1::2] = c_fast.conv_state
        c_fast.conv_state = wide[:, :, 1::2]                                  # every other column
    assert c_fast.conv_state.stride(1) == 1 or layout != "channels-contiguous"
    layer = _to(make_layer(H, HV, K, V, W, seed=2), torch.float32, "cpu")
    sched = [("verify", [2, 4], [2, 1]), ("decode", [1, 1], None), ("verify", [3, 1], [3, 1]),
             ("materialize", [0, 0], None)]
    outs = _run_both(c_ref, c_fast, layer, _to(layer), [2, 0], sched, HV, D, torch.float32, scale=0.5)
    _assert_as_refgdn(outs, c_fast, c_ref)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5], ids=lambda w: f"W{w}")
def test_conv_widths(W):
    """Every conv width: W <= 4 runs the register sliding-window conv kernel, W > 4 the general one;
    outputs, conv window (exact) and states as refgdn through verify / accept / decode / materialize."""
    H, HV, K, V, S = 1, 2, 8, 8, 3
    D = 2 * H * K + HV * V
    base = make_cache(S, H, HV, K, V, W, 3, seed=50 + W, state_dtype=torch.float32, act_dtype=torch.float32)
    c_ref, c_fast = base.clone(), base.clone().to(device=DEVICE)
    layer = _to(make_layer(H, HV, K, V, W, seed=60 + W), torch.float32, "cpu")
    sched = [("verify", [3, 4], [2, 4]), ("decode", [1, 1], None), ("verify", [2, 0], [1, 0]),
             ("verify", [4, 1], [3, 1]), ("materialize", [0, 0], None)]
    outs = _run_both(c_ref, c_fast, layer, _to(layer), [2, 0], sched, HV, D, torch.float32)
    _assert_as_refgdn(outs, c_fast, c_ref)


@pytest.mark.parametrize("cfg", [dict(HPP=2), dict(HPP=4, BV=4), dict(HPP=3)], ids=["hpp2", "hpp4-bv4", "hpp3"])
def test_step_kernel_configs(cfg, monkeypatch):
    """Step-kernel variants: several value heads per program (next head's state prefetched; HPP=3
    falls back to a divisor of HV), in decode and verify alike. Same results as refgdn."""
    monkeypatch.setattr(fs, "step_config", functools.partial(fs.step_config, override=cfg))
    H, HV, K, V, W, S = 2, 4, 8, 8, 4, 4
    D = 2 * H * K + HV * V
    base = make_cache(S, H, HV, K, V, W, 2, seed=70, state_dtype=torch.float32, act_dtype=torch.float32)
    c_ref, c_fast = base.clone(), base.clone().to(device=DEVICE)
    layer = _to(make_layer(H, HV, K, V, W, seed=71), torch.float32, "cpu")
    sched = [("verify", [3, 2, 1], [2, 2, 1]), ("verify", [1, 3, 2], [1, 3, 1]), ("decode", [1, 1, 1], None)]
    outs = _run_both(c_ref, c_fast, layer, _to(layer), [3, -1, 1], sched, HV, D, torch.float32)
    for o_r, o_f in outs:
        torch.testing.assert_close(o_f.cpu(), o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_fast.ssm_state.cpu(), c_ref.ssm_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_fast.conv_state.cpu(), c_ref.conv_state)


@pytest.mark.parametrize("fold", [True, False], ids=["folded-decay", "explicit-decay"])
def test_extreme_decay(fold, monkeypatch):
    """Decays from none (g = 0) to total (exp(g) underflows to 0) over the value heads: the folded
    decay's rescaling (c < 2^-64) and the explicit form both match refgdn."""
    monkeypatch.setattr(fs, "step_config", functools.partial(fs.step_config, override=dict(fold=fold)))
    H, HV, K, V, W, S = 1, 4, 8, 8, 4, 3
    D = 2 * H * K + HV * V
    base = make_cache(S, H, HV, K, V, W, 3, seed=80, state_dtype=torch.float32, act_dtype=torch.float32)
    c_ref, c_fast = base.clone(), base.clone().to(device=DEVICE)
    layer = _to(make_layer(H, HV, K, V, W, seed=81), torch.float32, "cpu")
    # g = -exp(A_log) softplus(a + dt_bias): A_log = -30 -> g ~ 0; 1.5 -> g ~ -4.5 per token; 5 -> g < -100
    layer["A_log"] = torch.tensor([-30.0, 1.5, 3.0, 5.0])
    layer["dt_bias"] = torch.tensor([0.0, 0.0, 1.0, 3.0])
    sched = [("verify", [4, 3], [4, 2]), ("verify", [4, 4], [3, 4]), ("decode", [1, 1], None),
             ("verify", [2, 4], [1, 3]), ("materialize", [0, 0], None)]
    outs = _run_both(c_ref, c_fast, layer, _to(layer), [2, 0], sched, HV, D, torch.float32)
    for o_r, o_f in outs:
        if o_r is not None:
            torch.testing.assert_close(o_f.cpu(), o_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c_fast.ssm_state.cpu(), c_ref.ssm_state, rtol=1e-4, atol=1e-5)


def test_bf16_state_storage():
    """bfloat16 ssm state with float32 activations: fast rounds at the same points as refgdn."""
    H, HV, K, V, W = 2, 4, 16, 16, 4
    D = 2 * H * K + HV * V
    base = make_cache(4, H, HV, K, V, W, 3, seed=3)
    c_ref = cast_cache(base, torch.bfloat16, torch.float32)
    c_fast = cast_cache(base, torch.bfloat16, torch.float32).to(device=DEVICE)
    layer = _to(make_layer(H, HV, K, V, W, seed=4), torch.float32, "cpu")
    sched = [("verify", [4, 1, 2], [3, 1, 2]), ("verify", [2, 2, 4], [1, 2, 4]), ("decode", [1, 1, 1], None),
             ("verify", [1, 3, 2], [1, 2, 1])]
    outs = _run_both(c_ref, c_fast, layer, _to(layer), [1, 3, -1], sched, HV, D, torch.float32)
    for o_r, o_f in outs:
        torch.testing.assert_close(o_f.cpu(), o_r, rtol=2e-2, atol=2e-2)
    assert c_fast.ssm_state.dtype == torch.bfloat16
    s_r, _ = committed_state(c_ref, [1, 3])
    s_f, _ = committed_state(c_fast.to(device="cpu"), [1, 3])
    # both round (nearly) the same float32 values once per write: a bf16 ulp of disagreement at the
    # state's scale, carried on through later rounds
    torch.testing.assert_close(s_f.float(), s_r.float(), rtol=2 ** -7, atol=2 ** -7 * s_r.float().abs().max().item())
    assert torch.equal(c_fast.conv_state.cpu(), c_ref.conv_state)


def test_padded_rows_and_zero_length_rows():
    """Padded rows (slot -1) touch nothing and output zeros, whatever their token count."""
    H, HV, K, V, W = 1, 1, 8, 8, 4
    D = 2 * H * K + HV * V
    c = make_cache(2, H, HV, K, V, W, 2, seed=5, state_dtype=torch.float32, act_dtype=torch.float32).to(device=DEVICE)
    before = c.clone()
    layer = _to(make_layer(H, HV, K, V, W, seed=6), torch.float32)
    x, a, b = (t.to(DEVICE) for t in make_tokens(5, HV, D, seed=7, dtype=torch.float32))
    idx = torch.tensor([-1, -1, -1], dtype=torch.int32, device=DEVICE)
    o = fs.gdn_verify(x, a, b, *_args(layer), c, idx, torch.tensor([0, 3, 3, 5], dtype=torch.int32, device=DEVICE))
    fs.gdn_accept(c, idx, torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE))
    fs.gdn_materialize(c, idx)
    c.check()
    assert torch.equal(o, torch.zeros_like(o))
    for f, g in zip(c.tensors(), before.tensors()):
        assert torch.equal(f, g)


def _mixed_fault_schedule():
    """(kind, state_indices, cu_seqlens or None, num_accepted or None, the fault check() raises after it)."""
    return [
        ("verify", [0, 3, 1], [0, 2, 5, 6], [2, 1, 1], "state_indices[1] = 3 is out of range"),   # rows 0, 2 run
        ("verify", [2, 1, 1], [0, 1, 3, 4], [1, 1, 1], "state_indices[2] = 1 is also the slot of request 1"),
        ("verify_only", [0, -1, 2], [0, 3, 3, 4], None, None),               # slots 0 and 2 await their accept
        ("decode", [0, 1, -1], None, None, "state_indices[0] = 0: the slot's last verify awaits gdn_accept"),
        ("accept_only", [2, 0, 1], None, [1, 4, 1], "num_accepted[1] must be in [1, 3]"),  # slot 2 accepted
        ("accept_only", [0], None, [2], None),
        ("verify", [0, 2, -1], [0, 4, 5, 6], [1, 1, 1], "cu_seqlens: request 0 has 4 tokens"),  # row 1 runs
        ("verify", [2, 0, -1], [0, 1, 3, 2], [1, 1, 1],                     # a bad offset: rows 1, 2 fail
         "cu_seqlens must be non-decreasing: request 2 spans cu_seqlens[2] = 3 .. cu_seqlens[3] = 2"),
        ("verify_only", [1], [0, 1], None, None),
        ("materialize", [0, 1, 2], None, None, "state_indices[1] = 1: the slot's last verify awaits gdn_accept"),
        ("accept_only", [1, -1], None, [1, 7], None),
        ("materialize", [0, 1, 2], None, None, None),
    ]


def test_device_faults_match_refgdn_skip_and_record():
    """Calls mixing good and faulty requests: fast (device checks) and refgdn with check_values=False
    (skip the failed requests, record the first fault) leave the same cache and raise the same
    ValueError at check(); good requests' outputs agree."""
    H, HV, K, V, W, md = 1, 2, 8, 8, 4, 2
    D = 2 * H * K + HV * V
    base = make_cache(3, H, HV, K, V, W, md, seed=8, state_dtype=torch.float32, act_dtype=torch.float32)
    c_ref, c_fast = base.clone(), base.clone().to(device=DEVICE)
    layer = _to(make_layer(H, HV, K, V, W, seed=9), torch.float32, "cpu")
    lay_d = _to(layer)
    for i, (kind, slots, cu, acc, expect) in enumerate(_mixed_fault_schedule()):
        T = cu[-1] if cu is not None else len(slots)
        x, a, b = make_tokens(max(T, 0), HV, D, seed=20 + i, dtype=torch.float32)
        msgs, outs = [], []
        for ops, c, lay, dev in ((rs, c_ref, layer, "cpu"), (fs, c_fast, lay_d, DEVICE)):
            idx = torch.tensor(slots, dtype=torch.int32, device=dev)
            xd, ad, bd = x.to(dev), a.to(dev), b.to(dev)
            kw = dict(check_values=False) if ops is rs else {}
            raised = []

            def run(fn, *args):   # fast on a CPU device raises from the op itself, on a GPU at check()
                try:
                    return fn(*args, **kw)
                except ValueError as e:
                    raised.append(str(e))

            o = None
            if kind.startswith("verify"):
                o = run(ops.gdn_verify, xd, ad, bd, *_args(lay), c, idx, torch.tensor(cu, dtype=torch.int32, device=dev))
                if kind == "verify":
                    run(ops.gdn_accept, c, idx, torch.tensor(acc, dtype=torch.int32, device=dev))
            elif kind == "accept_only":
                run(ops.gdn_accept, c, idx, torch.tensor(acc, dtype=torch.int32, device=dev))
            elif kind == "decode":
                o = run(ops.gdn_decode, xd, ad, bd, *_args(lay), c, idx)
            else:
                run(ops.gdn_materialize, c, idx)
            run(lambda **_: c.check())
            outs.append(o)
            msgs.append(raised[0] if raised else None)   # the first fault (on a CPU device fast checks
                                                          # after every op, so a later op may raise its own)
        assert msgs[0] == msgs[1], (i, msgs)
        assert (msgs[0] is None) if expect is None else (expect in (msgs[0] or "")), (i, msgs[0])
        if outs[0] is not None and outs[1] is not None:   # (fast on a CPU device raised instead of returning)
            # rows of requests that ran (refgdn's non-zero rows); failed rows: unspecified
            ran = outs[0].flatten(1).abs().amax(1) > 0
            torch.testing.assert_close(outs[1].cpu()[ran], outs[0][ran], rtol=1e-5, atol=1e-5)
        for name, f, g in zip(c_ref.SLOT_FIELDS, c_fast.slot_tensors(), c_ref.slot_tensors()):
            if name in ("conv_state", "pend_meta"):       # raw inputs and counts: exact
                assert torch.equal(f.cpu(), g), (i, name)
            else:                                         # computed in float32 by both: close
                torch.testing.assert_close(f.cpu(), g, rtol=1e-5, atol=1e-5)
        assert c_fast.err.tolist() == c_ref.err.tolist() == [0, 0, 0, 0]


def test_corrupt_metadata_is_clamped_not_out_of_bounds():
    """A pend_meta count beyond capacity (device state, not an argument) is read as the capacity."""
    H, HV, K, V, W = 1, 1, 8, 8, 4
    D = 2 * H * K + HV * V
    c = make_cache(2, H, HV, K, V, W, 1, seed=8, state_dtype=torch.float32, act_dtype=torch.float32).to(device=DEVICE)
    layer = _to(make_layer(H, HV, K, V, W, seed=9), torch.float32)
    idx = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    x, a, b = (t.to(DEVICE) for t in make_tokens(2, HV, D, seed=10, dtype=torch.float32))
    fs.gdn_verify(x, a, b, *_args(layer), c, idx, torch.tensor([0, 2], dtype=torch.int32, device=DEVICE))
    fs.gdn_accept(c, idx, torch.tensor([2], dtype=torch.int32, device=DEVICE))
    c.pend_meta[1, 0] = 99                                  # corrupt: read as the capacity (2)
    ref = c.to(device="cpu")
    ref.pend_meta[1, 0] = 2
    fs.gdn_materialize(c, idx)
    rs.gdn_materialize(ref, idx.cpu())
    c.check()
    torch.testing.assert_close(c.ssm_state.cpu(), ref.ssm_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(c.conv_state.cpu()[:, :, :W - 1], ref.conv_state[:, :, :W - 1])


def test_same_errors_as_refgdn():
    """fast raises the same ValueError text as refgdn for the shape/dtype checks and, with
    check_values=True, for the value checks."""
    H, HV, K, V, W = 1, 2, 4, 4, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=11, dtype=torch.float32)
    cache = make_cache(3, H, HV, K, V, W, 2, seed=12, state_dtype=torch.float32, act_dtype=torch.float32)
    x, a, b = make_tokens(4, HV, D, seed=13, dtype=torch.float32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    calls = [
        lambda ops: ops.gdn_decode(x[:, :-1], a, b, *_args(layer), cache, torch.tensor([0, 1, 2, -1])),
        lambda ops: ops.gdn_verify(x, a, b, *_args(layer), cache, idx, torch.tensor([0, 4, 4]), check_values=True),
        lambda ops: ops.gdn_verify(x, a, b, *_args(layer), cache, idx, None),
        lambda ops: ops.gdn_decode(x, a, b.double(), *_args(layer), cache, torch.tensor([0, 1, 1, -1]),
                                   check_values=True),
        lambda ops: ops.gdn_accept(cache, idx, torch.tensor([1, 9]), check_values=True),
        lambda ops: ops.gdn_accept(cache, idx, torch.tensor([1.0, 2.0])),
        lambda ops: ops.gdn_materialize(cache, torch.tensor([[0]])),
    ]
    before = cache.clone()
    for call in calls:
        msgs = []
        for ops in (rs, fs):
            with pytest.raises(ValueError) as e:
                call(ops)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1], msgs
    for f, g in zip(cache.tensors(), before.tensors()):
        assert torch.equal(f, g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay_matches_eager():
    """Warm up on a scratch cache, capture verify+accept and decode, replay three rounds with fresh
    inputs copied into the static buffers: bit-identical to the same calls run eagerly. (A Triton
    compile inside capture would fail the capture: warmup must have launched every variant.)"""
    H, HV, K, V, W, md = 2, 4, 64, 64, 4, 3
    D = 2 * H * K + HV * V
    dev = "cuda"
    base = make_cache(6, H, HV, K, V, W, md, seed=30)
    c_graph = cast_cache(base, torch.float32, torch.bfloat16).to(device=dev)
    c_eager = c_graph.clone()
    scratch = c_graph.clone()
    layer = _to(make_layer(H, HV, K, V, W, seed=31), torch.bfloat16, dev)
    lay = _args(layer)
    lens = [4, 1, 3, 2]
    T, N = sum(lens), len(lens)
    x = torch.zeros(T, D, dtype=torch.bfloat16, device=dev)
    a = torch.zeros(T, HV, dtype=torch.bfloat16, device=dev)
    b = torch.zeros(T, HV, dtype=torch.bfloat16, device=dev)
    xd, ad, bd = x[:N].clone(), a[:N].clone(), b[:N].clone()
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 4, 5, 8, 10], dtype=torch.int32, device=dev)
    acc = torch.ones(N, dtype=torch.int32, device=dev)

    def verify_step(c):
        o = fs.gdn_verify(x, a, b, *lay, c, idx, cu)
        fs.gdn_accept(c, idx, acc)
        return o

    def decode_step(c):
        return fs.gdn_decode(xd, ad, bd, *lay, c, idx)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                  # warmup: every variant the graphs will launch
        for _ in range(2):
            verify_step(scratch)
            decode_step(scratch)
    torch.cuda.current_stream().wait_stream(s)
    g_verify, g_decode = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_verify):
        o_verify = verify_step(c_graph)
    with torch.cuda.graph(g_decode):
        o_decode = decode_step(c_graph)
    # capture recorded launches only: the graph cache is still the starting contents
    for f, g in zip(c_graph.tensors(), c_eager.tensors()):
        assert torch.equal(f, g)
    for r in range(3):
        xs, as_, bs = make_tokens(T, HV, D, seed=40 + r, dtype=torch.bfloat16, device=dev)
        x.copy_(xs), a.copy_(as_), b.copy_(bs)
        acc.copy_(torch.tensor([1 + (r + n) % L for n, L in enumerate(lens)], dtype=torch.int32))
        xd.copy_(xs[:N]), ad.copy_(as_[:N]), bd.copy_(bs[:N])
        g_verify.replay()
        o_e = verify_step(c_eager)
        assert torch.equal(o_verify, o_e)
        if r == 1:
            g_decode.replay()
            assert torch.equal(o_decode, decode_step(c_eager))
    torch.cuda.synchronize()
    c_graph.check(), c_eager.check()            # the device-side value checks found nothing
    for f, g in zip(c_graph.tensors(), c_eager.tensors()):
        assert torch.equal(f, g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_records_faults_and_writes_nothing():
    """Bad values copied into a captured graph's static buffers: the replay writes nothing for the bad
    requests (the 4-slot cache is a view of a 6-slot allocation: every byte of it is checked) and
    check() after the replay raises refgdn's ValueError; a good replay afterwards runs normally."""
    H, HV, K, V, W, md = 2, 4, 64, 64, 4, 2
    D = 2 * H * K + HV * V
    dev = "cuda"
    big = make_cache(6, H, HV, K, V, W, md, seed=32, state_dtype=torch.float32, act_dtype=torch.float32).to(device=dev)
    err_big = torch.zeros(8, dtype=torch.int64, device=dev)
    cache = rs.GDNStateCache(*(t[:4] for t in big.slot_tensors()), err=err_big[2:6])
    scratch = cache.clone()
    layer = _to(make_layer(H, HV, K, V, W, seed=33), torch.float32, dev)
    x, a, b = make_tokens(4, HV, D, seed=34, dtype=torch.float32, device=dev)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=dev)
    acc = torch.tensor([1, 2], dtype=torch.int32, device=dev)

    def decode(c):
        return fs.gdn_decode(x[:2], a[:2], b[:2], *_args(layer), c, idx)

    def verify(c):
        o = fs.gdn_verify(x, a, b, *_args(layer), c, idx, cu)
        fs.gdn_accept(c, idx, acc)
        return o

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            verify(scratch)
            decode(scratch)
    torch.cuda.current_stream().wait_stream(s)
    g_dec, g_ver = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dec):
        decode(cache)
    with torch.cuda.graph(g_ver):
        verify(cache)
    cache.check()

    def memory():
        return [t.clone() for t in big.slot_tensors()] + [err_big.clone()]

    def replay_fails(graph, message):
        before = memory()
        graph.replay()
        torch.cuda.synchronize()
        with pytest.raises(ValueError) as e:
            cache.check()
        assert message in str(e.value), str(e.value)
        assert all(torch.equal(p, q) for p, q in zip(before, memory()))

    idx.copy_(torch.tensor([-1, 4]))
    replay_fails(g_dec, "state_indices[1] = 4 is out of range: a slot index must be in [0, num_slots=4)")
    idx.copy_(torch.tensor([3, 3]))
    replay_fails(g_dec, "state_indices must be distinct (one request per slot): state_indices[1] = 3 is also")
    idx.copy_(torch.tensor([-1, 2]))
    cu.copy_(torch.tensor([0, 0, 4]))                  # request 1: 4 tokens > 1 + max_draft = 3
    replay_fails(g_ver, "cu_seqlens: request 1 has 4 tokens")
    cu.copy_(torch.tensor([0, 3, 2]))                  # decreasing, and not ending at T = 4
    replay_fails(g_ver, "cu_seqlens must be non-decreasing: request 1")
    # good values again: the graphs run as captured (a verify, then its accept, then a decode)
    idx.copy_(torch.tensor([0, 1]))
    cu.copy_(torch.tensor([0, 2, 4]))
    before = memory()
    g_ver.replay()
    g_dec.replay()
    cache.check()
    assert not all(torch.equal(p, q) for p, q in zip(before, memory()))
    for t, t0 in zip(big.slot_tensors(), before):
        assert torch.equal(t[4:], t0[4:])             # slots 4, 5: outside the cache


def test_layers_share_one_err_buffer():
    """Caches allocated with one err buffer (a model's layers): a fault in any of them is raised by the
    check() of any of them (on a CPU device by the op itself), once."""
    H, HV, K, V, W = 1, 1, 8, 8, 4
    D = 2 * H * K + HV * V
    err = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    c1, c2 = (rs.GDNStateCache.allocate(3, H, HV, K, V, W, 1, torch.float32, torch.float32, DEVICE, err=err)
              for _ in range(2))
    layer = _to(make_layer(H, HV, K, V, W, seed=35), torch.float32)
    x, a, b = (t.to(DEVICE) for t in make_tokens(1, HV, D, seed=36, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"state_indices\[0\] = 3 is out of range"):
        fs.gdn_decode(x, a, b, *_args(layer), c2, torch.tensor([3], dtype=torch.int32, device=DEVICE))
        c1.check()
    c1.check(), c2.check()
    assert err.tolist() == [0, 0, 0, 0]


def _several_faults_cases():
    """(name, kind, state_indices, cu_seqlens, num_accepted, the lowest faulty request's message).
    Rows beyond 16 / 64 put the faults in different blocks of the error path's scan and of accept_kernel."""
    pad = [-1] * 70
    return [
        ("decode-second-scan-block", "decode", pad[:33] + [2, 9, -6, 2, 8], None, None,
         "state_indices[34] = 9 is out of range"),
        ("decode-dup-before-range", "decode", pad[:3] + [2, 2] + pad[:30] + [9], None, None,
         "state_indices[4] = 2 is also the slot of request 3"),
        ("verify-range-over-too-long", "verify", [0, 9, 1, 1, -1], [0, 1, 5, 6, 7, 7], None,
         "state_indices[1] = 9 is out of range"),
        ("verify-offset-two-rows", "verify", [-1, 0, -3], [0, 1, 9, 4], None,
         "cu_seqlens: request 1 has 8 tokens"),
        ("accept-third-block", "accept", pad[:66] + [9] + pad[:61] + [3, 9], None, [1] * 130,
         "state_indices[66] = 9 is out of range"),
        ("accept-first-block", "accept", pad[:10] + [3] + pad[:60] + [9], None, [1] * 72,
         "state_indices[10] = 3: gdn_accept without a verify"),
    ]


@pytest.mark.parametrize("case", _several_faults_cases(), ids=lambda c: c[0])
def test_several_faulty_rows_report_the_lowest_like_refgdn(case):
    """Several faulty requests in one call (in different blocks of fast's programs): fast records the
    call's lowest faulty request with its highest-priority rule, the fault refgdn raises, whatever order
    the programs run in; nothing of the failed rows is written."""
    _, kind, slots, cu, acc, expect = case
    H, HV, K, V, W, md = 1, 1, 4, 4, 4, 2
    D = 2 * H * K + HV * V
    base = make_cache(4, H, HV, K, V, W, md, seed=30, state_dtype=torch.float32, act_dtype=torch.float32)
    layer = _to(make_layer(H, HV, K, V, W, seed=31), torch.float32, "cpu")
    T = cu[-1] if cu is not None else len(slots)
    x, a, b = make_tokens(T, HV, D, seed=32, dtype=torch.float32)
    msgs = []
    for ops, dev in ((rs, "cpu"), (fs, DEVICE)):
        c = base.clone().to(device=dev)
        idx = torch.tensor(slots, dtype=torch.int32, device=dev)
        before = c.clone()
        with pytest.raises(ValueError) as e:
            if kind == "decode":
                ops.gdn_decode(x.to(dev), a.to(dev), b.to(dev), *_args(_to(layer, device=dev)), c, idx)
            elif kind == "verify":
                ops.gdn_verify(x.to(dev), a.to(dev), b.to(dev), *_args(_to(layer, device=dev)), c, idx,
                               torch.tensor(cu, dtype=torch.int32, device=dev))
            else:
                ops.gdn_accept(c, idx, torch.tensor(acc, dtype=torch.int32, device=dev))
            c.check()
        msgs.append(str(e.value))
        if ops is rs or kind == "accept":   # (fast steps: the good rows ran; refgdn raised first)
            for f, g in zip(c.slot_tensors(), before.slot_tensors()):
                assert torch.equal(f, g)
        c.check()                            # raised once, cleared
    assert msgs[0] == msgs[1], msgs
    assert expect in msgs[0], msgs[0]


def test_fault_codes_are_numbered_in_priority_order():
    """Both packages use refgdn's codes; a request's fault is its lowest-numbered violated rule (the
    order of refgdn.serving's rule table), which fast's kernels apply as an override chain."""
    step = [rs.E_SLOT_RANGE, rs.E_SLOT_DUP, rs.E_CU_START, rs.E_CU_ORDER, rs.E_CU_END, rs.E_TOO_LONG, rs.E_AWAITING]
    accept = [rs.E_SLOT_RANGE, rs.E_SLOT_DUP, rs.E_NO_VERIFY, rs.E_ACCEPT_RANGE]
    assert step == sorted(step) and accept == sorted(accept) and rs.E_AWAITING < rs.E_NO_VERIFY
    assert [fs._E_SLOT_RANGE.value, fs._E_AWAITING.value, fs._E_ACCEPT_RANGE.value] == \
        [rs.E_SLOT_RANGE, rs.E_AWAITING, rs.E_ACCEPT_RANGE]
    # one row breaking several rules at once: the same (highest-priority) fault in both packages
    ok, faults = rs.step_faults([7, 0], 4, lambda s: True, [0, 9, 9], 9, 3)
    assert faults[0][0] == rs.E_SLOT_RANGE and faults[1][0] == rs.E_AWAITING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PDL and CUDA graphs exist on a GPU only")
def test_pdl_back_to_back_decodes_without_drafts_are_bit_identical():
    """Decode steps on one cache without drafts (TCAP = 1), launched back to back with nothing between them, as
    programmatic dependents (small N on sm_90+): each conv kernel reads its slot, window and taps before its
    gdc_wait while the previous step kernel may still run. Outputs, every cache tensor and the recorded fault
    are the bits of the same steps without PDL, eagerly and replayed from one CUDA graph of all the steps. The
    steps reuse slots from one step to the next (the window a conv reads early is the one the previous call's
    conv wrote), mix batch sizes 1..8, and hold a padded row and a duplicate slot (a fault: writes nothing).
    Qwen3-Next's head shape, so a step kernel runs long enough for the next launch to start beside it. (It did not
    catch a conv that lets its step start before its own wait, on an H200 in three runs: that race did not show.)"""
    H, HV, K, V, W = 16, 32, 128, 128, 4
    D = 2 * H * K + HV * V
    dev = "cuda"
    base = make_cache(10, H, HV, K, V, W, 0, seed=50)
    layer = _to(make_layer(H, HV, K, V, W, seed=51), torch.bfloat16, dev)
    lay = _args(layer)
    plan = [[3], [3, 1], [1, 3, 0, -1], [0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [2, 2, 5], [5], [5, 9]]
    idxs = [torch.tensor(sl, dtype=torch.int32, device=dev) for sl in plan]
    toks = [tuple(t.to(dev) for t in make_tokens(len(sl), HV, D, seed=300 + i, dtype=torch.bfloat16))
            for i, sl in enumerate(plan)]

    def steps(cache):
        return [fs.gdn_decode(*toks[i], *lay, cache, idxs[i]) for i in range(len(plan))]

    def fresh():
        return cast_cache(base, torch.float32, torch.bfloat16).to(device=dev)

    def snapshot(outs, cache):
        torch.cuda.synchronize()
        return [o.clone() for o in outs] + [t.clone() for t in cache.tensors()]

    orig = fs.step_config
    fs.step_config = functools.partial(orig, override=dict(pdl=False))
    try:
        fs.clear_plan_cache()
        cache = fresh()
        ref = snapshot(steps(cache), cache)
    finally:
        fs.step_config = orig
        fs.clear_plan_cache()
    assert int(ref[-1][0]) == rs.E_SLOT_DUP, "the duplicate slot must have recorded its fault"
    cache = fresh()
    got = snapshot(steps(cache), cache)                    # eager, PDL where pinned
    for u, v in zip(ref, got):
        assert torch.equal(u, v)
    cache = fresh()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = steps(cache)
    for t, t0 in zip(cache.tensors(), fresh().tensors()):   # capture ran nothing: start from the base contents
        t.copy_(t0)
    g.replay()
    got = snapshot(outs, cache)
    for u, v in zip(ref, got):
        assert torch.equal(u, v)
    assert fs.step_config(K, V, torch.float32, HV, "decode", 8, pdl_ok=fs.pdl_supported(torch.device(dev)))[
        "pdl"] == (torch.cuda.get_device_capability()[0] >= 9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PDL and reused launchers exist on a GPU only")
def test_pdl_and_relaunch_are_bit_identical():
    """The step kernel as the conv kernel's programmatic dependent (step_config's pdl, on for small N on
    sm_90+) and the launches reused through fast.launch.Relaunch give the bits of plain launches made
    through JITFunction.run on every call: outputs, every cache tensor and the recorded fault, over
    decode / verify / accept rounds with a padded row and a duplicate slot (a fault: writes nothing)."""
    H, HV, K, V, W, md = 2, 4, 64, 64, 4, 3
    D = 2 * H * K + HV * V
    dev = "cuda"
    base = make_cache(6, H, HV, K, V, W, md, seed=40)
    layer = _to(make_layer(H, HV, K, V, W, seed=41), torch.bfloat16, dev)
    lay = _args(layer)
    steps = [("decode", [0, 1, -1, 3], None), ("verify", [2, 0, 5], [3, 2, 1]), ("decode", [0, 2, 5], None),
             ("decode", [1, 1, 4], None), ("verify", [4, 3], [2, 1]), ("decode", [3, 4], None)]

    def run(mode):
        cache = cast_cache(base, torch.float32, torch.bfloat16).to(device=dev)
        outs, errs = [], []
        orig = fs.step_config
        if mode == "plain":
            fs.step_config = functools.partial(orig, override=dict(pdl=False))
        try:
            for i, (kind, slots, acc) in enumerate(steps):
                if mode == "uncached":
                    fs.clear_plan_cache()                 # every launch through JITFunction.run
                idx = torch.tensor(slots, dtype=torch.int32, device=dev)
                lens = [1 + (j % 3) for j in range(len(slots))] if kind == "verify" else [1] * len(slots)
                x, a, b = (t.to(dev) for t in make_tokens(sum(lens), HV, D, seed=200 + i, dtype=torch.bfloat16))
                if kind == "verify":
                    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
                    outs.append(fs.gdn_verify(x, a, b, *lay, cache, idx, cu))
                    fs.gdn_accept(cache, idx, torch.tensor([min(c, L) for c, L in zip(acc, lens)],
                                                           dtype=torch.int32, device=dev))
                else:
                    outs.append(fs.gdn_decode(x, a, b, *lay, cache, idx))
                errs.append(cache.err.clone())
                cache.err.zero_()
        finally:
            fs.step_config = orig
        torch.cuda.synchronize()
        return outs, errs, [t.clone() for t in cache.tensors()]

    fs.clear_plan_cache()
    ref = run("uncached")
    for mode in ("default", "plain"):
        fs.clear_plan_cache()
        got = run(mode)
        for u, v in zip(ref[0], got[0]):
            assert torch.equal(u, v), mode
        for u, v in zip(ref[1] + ref[2], got[1] + got[2]):
            assert torch.equal(u, v), mode
    assert any(int(e[0]) != 0 for e in ref[1]), "the duplicate slot must have recorded a fault"
    assert fs.step_config(K, V, torch.float32, HV, "decode", 3, pdl_ok=fs.pdl_supported(torch.device(dev)))[
        "pdl"] == (torch.cuda.get_device_capability()[0] >= 9)


def test_float64_steps_run_refgdn_bit_for_bit():
    """The step kernels compute in float32, so a float64 call (inputs or cache) runs refgdn, as gdn_prefill's does:
    decode, verify + accept and materialize on a float64 cache give refgdn's outputs and caches (bit for bit on the
    CPU; within 1e-12 relative of refgdn on the CPU when fast runs on a GPU, whose float64 math rounds its own way;
    the kernels' float32 arithmetic is ~1e-7 off), and fast.keys lists no kernel for them. A fault is still recorded
    and raised at check()."""
    import fast.keys as fk
    H, HV, K, V = 1, 2, 16, 16
    D = 2 * H * K + HV * V
    lay = make_layer(H, HV, K, V, dtype=torch.float64)
    c_ref = make_cache(4, H, HV, K, V, max_draft=2, state_dtype=torch.float64, act_dtype=torch.float64)
    c_fast = c_ref.clone().to(device=DEVICE)
    outs = _run_both(c_ref, c_fast, lay, _to(lay), [3, 0, 2],
                     [("decode", [1, 1, 1], None), ("verify", [3, 1, 2], [2, 1, 1]), ("materialize", [0, 0, 0], None),
                      ("verify", [2, 2, 1], [1, 2, 1]), ("decode", [1, 1, 1], None)], HV, D, torch.float64)
    def same(f, r):
        f = f.cpu()
        if DEVICE == "cpu" or not r.is_floating_point():
            return torch.equal(f, r)
        return f.dtype == r.dtype and bool((f - r).abs().max() <= 1e-12 * max(float(r.abs().max()), 1e-30))
    for o_r, o_f in outs:
        assert (o_r is None) == (o_f is None) and (o_r is None or same(o_f, o_r))
    for f, r in zip(c_fast.tensors(), c_ref.tensors()):
        assert same(f, r)
    idx = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    x, a, b = (t.to(DEVICE) for t in make_tokens(2, HV, D, dtype=torch.float64))
    assert fk.gdn_decode(x, a, b, *_args(_to(lay)), c_fast, idx) == []
    assert fk.gdn_materialize(c_fast, idx) == []
    bad = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)       # slot 9 >= num_slots: a recorded fault
    with pytest.raises(ValueError):
        fs.gdn_decode(x, a, b, *_args(_to(lay)), c_fast, bad)
        c_fast.check()
