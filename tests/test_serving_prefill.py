"""gdn_prefill (refgdn.serving and fast.serving): the oracle against a per-token time loop in float64; the
slot semantics (pending tokens folded, has_initial_state, padded rows, zero-length requests, untouched slots);
the value rules and faults; fast against refgdn and, bit for bit, against the gather / scatter composition of
its own ops it replaces."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fast
import fast.serving as fs
import refgdn
import refgdn.serving as rs
from conformance.cases_serving import make_cache, make_layer, make_tokens
from refgdn.serving import committed_state

D64 = torch.float64
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _args(layer):
    return layer["conv_weight"], layer["conv_bias"], layer["A_log"], layer["dt_bias"]


def _cu(lens, device="cpu"):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _time_loop(x, a, b, layer, S, window, H, HV, K, V):
    """The simplest form, float64, one token at a time: conv over [window | x], silu, split, l2norm (eps 1e-6 under
    the root, as fla's and refgdn's), gating,
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q / sqrt(K). Returns (o [L, HV, V], S, window)."""
    w, bias, A_log, dt_bias = _args(layer)
    W = w.shape[1]
    hist = torch.cat([window.T, x])                            # [W-1+L, D], oldest first
    S = S.clone()
    out = []
    for t in range(x.shape[0]):
        y = F.silu((hist[t:t + W] * w.T).sum(0) + (bias if bias is not None else 0))
        q = y[:H * K].view(H, K)
        k = y[H * K:2 * H * K].view(H, K)
        v = y[2 * H * K:].view(HV, V)
        q, k = (u / torch.sqrt((u * u).sum(-1, keepdim=True) + 1e-6) for u in (q, k))    # l2norm, eps 1e-6
        g = -torch.exp(A_log) * F.softplus(a[t] + dt_bias)
        beta = torch.sigmoid(b[t])
        o_t = []
        for h in range(HV):
            kh, qh = k[h // (HV // H)], q[h // (HV // H)]
            S[h] = torch.exp(g[h]) * S[h]
            S[h] = S[h] + torch.outer(kh, beta[h] * (v[h] - S[h].T @ kh))
            o_t.append(S[h].T @ qh / math.sqrt(K))
        out.append(torch.stack(o_t))
    o = torch.stack(out) if out else x.new_zeros(0, HV, V)
    return o, S, hist[hist.shape[0] - (W - 1):].T


def test_refgdn_prefill_equals_time_loop_float64():
    """After a verify + accept (pending tokens), a prefill of requests with and without an initial state, a
    zero-length request and a padded row: outputs and the slots' final states are the time loop's."""
    H, HV, K, V, W = 1, 2, 8, 6, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=1)
    cache = make_cache(6, H, HV, K, V, W, max_draft=3, seed=2)
    slots = [4, -1, 0, 2, 5]
    idx = torch.tensor(slots)
    # a verify + accept leaves pending tokens on slots 4, 0, 2, 5 (folded in by the prefill where it reads)
    xv, av, bv = make_tokens(4 * len(slots), HV, D, seed=3)
    rs.gdn_verify(xv, av, bv, *_args(layer), cache, idx, _cu([4] * len(slots)))
    rs.gdn_accept(cache, idx, torch.tensor([2, 1, 4, 3, 1]))
    start_ssm, start_conv = committed_state(cache, [4, 0, 2, 5])
    before = cache.clone()
    lens, has = [7, 3, 5, 0, 11], [True, True, False, True, False]
    x, a, b = make_tokens(sum(lens), HV, D, seed=4)
    o = rs.gdn_prefill(x, a, b, *_args(layer), cache, idx, _cu(lens), torch.tensor(has))
    offs = _cu(lens).tolist()
    j = 0
    for n, slot in enumerate(slots):
        rows = slice(offs[n], offs[n + 1])
        if slot < 0:
            assert torch.equal(o[rows], torch.zeros(lens[n], HV, V, dtype=D64))
            continue
        S0 = start_ssm[j] if has[n] else torch.zeros(HV, K, V, dtype=D64)
        w0 = start_conv[j] if has[n] else torch.zeros(D, W - 1, dtype=D64)
        j += 1
        o_t, S_t, w_t = _time_loop(x[rows], a[rows], b[rows], layer, S0, w0, H, HV, K, V)
        torch.testing.assert_close(o[rows], o_t, rtol=0, atol=1e-12)
        torch.testing.assert_close(cache.ssm_state[slot], S_t, rtol=0, atol=1e-12)
        assert torch.equal(cache.conv_state[slot, :, :W - 1], w_t)
        assert int(cache.pend_meta[slot, 0]) == 0 and not int(cache.pend_meta[slot, 1]) & rs.AWAIT_ACCEPT
    for f, g in zip(cache.slot_tensors(), before.slot_tensors()):      # slots 1 and 3: untouched
        assert torch.equal(f[[1, 3]], g[[1, 3]])
    assert cache.err.tolist() == [0, 0, 0, 0]


def test_prefill_then_decode_equals_one_longer_prefill():
    """Chunked prefill: prefill(x[:m]) then prefill(x[m:]) with an initial state, then a decode, equals one
    prefill of x then the decode (float64, refgdn; fast, float32 in the interpreter or on the GPU)."""
    H, HV, K, V, W = 1, 2, 8, 8, 4
    D = 2 * H * K + HV * V
    for ops, dt, dev, tol in ((rs, D64, "cpu", 1e-12), (fs, torch.float32, DEV, 2e-5)):
        layer = make_layer(H, HV, K, V, W, seed=5, dtype=dt, device=dev)
        x, a, b = make_tokens(40, HV, D, seed=6, dtype=dt, device=dev)
        xd, ad, bd = make_tokens(1, HV, D, seed=7, dtype=dt, device=dev)
        one = make_cache(2, H, HV, K, V, W, seed=8, state_dtype=dt, act_dtype=dt, device=dev)
        two = one.clone()
        idx = torch.tensor([1], device=dev)
        no, yes = torch.tensor([False], device=dev), torch.tensor([True], device=dev)
        o1 = ops.gdn_prefill(x, a, b, *_args(layer), one, idx, _cu([40], dev), no)
        d1 = ops.gdn_decode(xd, ad, bd, *_args(layer), one, idx)
        o2a = ops.gdn_prefill(x[:13], a[:13], b[:13], *_args(layer), two, idx, _cu([13], dev), no)
        o2b = ops.gdn_prefill(x[13:], a[13:], b[13:], *_args(layer), two, idx, _cu([27], dev), yes)
        d2 = ops.gdn_decode(xd, ad, bd, *_args(layer), two, idx)
        torch.testing.assert_close(torch.cat([o2a, o2b]), o1, rtol=0, atol=tol)
        torch.testing.assert_close(d2, d1, rtol=0, atol=tol)
        torch.testing.assert_close(two.ssm_state, one.ssm_state, rtol=0, atol=tol)
        assert torch.equal(two.conv_state, one.conv_state)


def _compose(ops, x, a, b, layer, cache, slots, lens, has, chunk=None, beta_kw=None):
    """What gdn_prefill replaces (the model's prefill before it): materialize, gather the states (zeros without
    one), the varlen conv and chunked forward (``chunk``, default fast's forward given b as beta's logits, as
    gdn_prefill runs it; beta_kw: how ``chunk`` takes them), scatter the final states."""
    W, H, K, HV = cache.W, cache.H, cache.K, cache.HV
    dev = x.device
    idx = torch.tensor(slots, device=dev)
    ops.gdn_materialize(cache, idx)
    real = [n for n, s in enumerate(slots) if s >= 0]
    safe = torch.tensor([max(s, 0) for s in slots], device=dev)
    keep = torch.tensor(has, device=dev) & (idx >= 0)
    h0 = torch.where(keep[:, None, None, None], cache.ssm_state[safe], 0)
    c0 = torch.where(keep[:, None, None], cache.conv_state[safe, :, :W - 1], 0).contiguous()
    cu = _cu(lens, dev)
    y, cf = ops.causal_conv1d(x[None], layer["conv_weight"], layer["conv_bias"], "silu", initial_state=c0,
                              output_final_state=True, cu_seqlens=cu)
    y = y[0]
    q = y[:, :H * K].unflatten(1, (H, K))
    k = y[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = y[:, 2 * H * K:].unflatten(1, (HV, -1))
    if chunk is None:
        chunk, beta_kw = fast.chunk.chunk_gated_delta_rule_fwd, dict(beta_logits=1)
    o, final = chunk(q[None], k[None], v[None], a[None], b.float()[None], initial_state=h0,
                     output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, A_log=layer["A_log"],
                     dt_bias=layer["dt_bias"], **beta_kw)
    sl = torch.tensor([slots[n] for n in real], device=dev, dtype=torch.long)
    rows = torch.tensor(real, device=dev, dtype=torch.long)
    cache.ssm_state[sl] = final[rows].to(cache.ssm_state.dtype)
    cache.conv_state[sl, :, :W - 1] = cf[rows].to(cache.conv_state.dtype)
    return o[0]


SHAPES = [
    pytest.param(dict(H=1, HV=2, K=16, V=16, lens=[5, 0, 70, 1], slots=[3, 1, -1, 0],
                      has=[True, False, True, True]), id="mixed"),
    pytest.param(dict(H=2, HV=4, K=12, V=20, lens=[33], slots=[2], has=[True]), id="one-request-odd-dims"),
    pytest.param(dict(H=1, HV=2, K=16, V=16, lens=[0, 0], slots=[0, 3], has=[True, False]), id="zero-tokens"),
]


@pytest.mark.parametrize("p", SHAPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_fast_prefill_equals_the_composition_bit_for_bit(p, state_dtype):
    """fast.gdn_prefill reads and writes the slots in its kernels; the gather / op / scatter composition of fast's
    own ops computes the same numbers: outputs, every cache tensor and the untouched slots, bit for bit."""
    H, HV, K, V, W = p["H"], p["HV"], p["K"], p["V"], 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=9, dtype=torch.float32, device=DEV)
    base = make_cache(5, H, HV, K, V, W, max_draft=2, seed=10, state_dtype=state_dtype, act_dtype=torch.float32,
                      device=DEV)
    slots, lens, has = p["slots"], p["lens"], p["has"]
    real = [s for s in slots if s >= 0]
    # pending tokens on the requests' slots first (a verify + accept)
    xv, av, bv = make_tokens(2 * len(real), HV, D, seed=11, dtype=torch.float32, device=DEV)
    ridx = torch.tensor(real, device=DEV)
    fs.gdn_verify(xv, av, bv, *_args(layer), base, ridx, _cu([2] * len(real), DEV))
    fs.gdn_accept(base, ridx, torch.ones(len(real), dtype=torch.int32, device=DEV))
    x, a, b = make_tokens(sum(lens), HV, D, seed=12, dtype=torch.float32, device=DEV)
    got, want = base.clone(), base.clone()
    o = fs.gdn_prefill(x, a, b, *_args(layer), got, torch.tensor(slots, device=DEV), _cu(lens, DEV),
                       torch.tensor(has, device=DEV))
    o_ref = _compose(fast, x, a, b, layer, want, slots, lens, has)
    offs = _cu(lens).tolist()
    for n, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(o[offs[n]:offs[n + 1]], o_ref[offs[n]:offs[n + 1]])
    for f, g in zip(got.tensors(), want.tensors()):
        if f is got.ssm_state and state_dtype == torch.bfloat16 and not GPU:
            # the interpreter rounds a kernel's float32 -> bfloat16 store toward zero (torch and the GPU: to
            # nearest even), so the kernel's store and the composition's .to() may differ by one bf16 ulp
            torch.testing.assert_close(f.float(), g.float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(f, g)


@pytest.mark.skipif(not GPU, reason="the pipelined forward (one long sequence) runs on a CUDA device only")
@pytest.mark.parametrize("T", [4099, 16384 + 7], ids=["one-pass", "pipelined"])
def test_fast_prefill_long_sequence_bit_for_bit_gpu(T):
    """One request of T tokens, bf16: the dense forward, pipelined over segments from 16384 tokens (the first
    segment reads the slot, the last writes it), equals the composition bit for bit (its forward with the state
    update in two bf16 terms, as gdn_prefill runs bf16: update_x2)."""
    H, HV, K, V, W = 1, 2, 128, 128, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=13, dtype=torch.bfloat16, device="cuda")
    base = make_cache(3, H, HV, K, V, W, seed=14, state_dtype=torch.float32, act_dtype=torch.bfloat16,
                      device="cuda")
    x, a, b = make_tokens(T, HV, D, seed=15, dtype=torch.bfloat16, device="cuda")
    got, want = base.clone(), base.clone()
    o = fs.gdn_prefill(x, a, b, *_args(layer), got, torch.tensor([2], device="cuda"), _cu([T], "cuda"))
    o_ref = _compose(fast, x, a, b, layer, want, [2], [T], [True],
                     chunk=functools.partial(fast.chunk.chunk_gated_delta_rule_fwd, update_x2=True),
                     beta_kw=dict(beta_logits=1))
    assert torch.equal(o, o_ref)
    for f, g in zip(got.tensors(), want.tensors()):
        assert torch.equal(f, g)


def _fault_setup(device=DEV, dtype=torch.float32):
    H, HV, K, V, W = 1, 2, 8, 8, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=16, dtype=dtype, device=device)
    cache = make_cache(4, H, HV, K, V, W, max_draft=2, seed=17, state_dtype=dtype, act_dtype=dtype, device=device)
    x, a, b = make_tokens(9, HV, D, seed=18, dtype=dtype, device=device)
    return layer, cache, x, a, b


FAULTS = [   # (state_indices, cu_seqlens offsets, the first fault's text, the requests that still run)
    pytest.param([0, 7, 2], [0, 3, 5, 9], r"state_indices\[1\] = 7 is out of range", [0, 2], id="range"),
    pytest.param([1, 2, 1], [0, 3, 5, 9], r"state_indices must be distinct.*\[2\] = 1 is also the slot of request 0",
                 [1], id="duplicate"),
    pytest.param([0, 1, 2], [0, 6, 5, 9], r"non-decreasing: request 1 spans", [], id="offsets-order"),
    pytest.param([0, 9, 2], [1, 3, 5, 9], r"must start at 0", [], id="offsets-start-before-slot"),
    pytest.param([0, 1, 2], [0, 3, 5, 8], r"must end at T=9", [], id="offsets-end"),
]


@pytest.mark.parametrize("slots,offs,msg,runs", FAULTS)
def test_faults_refgdn_raises_first_fast_records_and_skips(slots, offs, msg, runs):
    """check_values=True (refgdn's default): the first fault raises before anything is written. check_values=False:
    the failed requests write nothing, the good ones run, and the fault is recorded (refgdn) / raised by the op on
    a CPU device after its launches (fast). Bad offsets raise the call's first fault before anything runs in
    both packages (a prefill reads its offsets on the host)."""
    layer, cache, x, a, b = _fault_setup()
    idx, cu = torch.tensor(slots, device=DEV), torch.tensor(offs, dtype=torch.int32, device=DEV)
    before = cache.clone()
    with pytest.raises(ValueError, match=msg):
        rs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu)
    for f, g in zip(cache.tensors(), before.tensors()):
        assert torch.equal(f, g)
    outs = {}
    for ops in (rs, fs):
        c = before.clone()
        with pytest.raises(ValueError, match=msg):
            ops.gdn_prefill(x, a, b, *_args(layer), c, idx, cu, check_values=False)
            c.check()                                  # (refgdn recorded it)
        written = {slots[n] for n in runs}
        for s in range(c.num_slots):
            if s not in written:
                for f, g in zip(c.slot_tensors(), before.slot_tensors()):
                    assert torch.equal(f[s], g[s]), (ops.__name__, s)
        outs[ops, "cache"] = c
    for s in {slots[n] for n in runs}:                 # the good requests ran alike in both
        torch.testing.assert_close(outs[fs, "cache"].ssm_state[s], outs[rs, "cache"].ssm_state[s],
                                   rtol=1e-5, atol=1e-5)


def test_awaiting_accept_is_a_fault():
    layer, cache, x, a, b = _fault_setup()
    idx = torch.tensor([2, 0], device=DEV)
    for ops in (rs, fs):
        c = cache.clone()
        ops.gdn_verify(x[:2], a[:2], b[:2], *_args(layer), c, torch.tensor([0], device=DEV), _cu([2], DEV))
        c.check()                                      # (slot 0 awaits its accept now)
        before = c.clone()
        for check_values in (True, False):
            with pytest.raises(ValueError, match=r"state_indices\[1\] = 0: the slot's last verify awaits gdn_accept"):
                ops.gdn_prefill(x, a, b, *_args(layer), c, idx, _cu([4, 5], DEV), check_values=check_values)
                c.check()
        for f, g in zip(c.slot_tensors(), before.slot_tensors()):    # slot 0 untouched (slot 2 ran)
            assert torch.equal(f[0], g[0])


BAD = [
    pytest.param(lambda ops, L, c, x, a, b: ops.gdn_prefill(x, a, b, *_args(L), c, torch.tensor([0], device=DEV), None),
                 r"cu_seqlens must be given for a prefill", id="no-offsets"),
    pytest.param(lambda ops, L, c, x, a, b: ops.gdn_prefill(x, a, b, *_args(L), c, torch.tensor([0, 1], device=DEV),
                                                            _cu([4, 5], DEV), torch.tensor([1, 0], device=DEV)),
                 r"has_initial_state must be a bool tensor of shape \[N\] = \[2\], got torch.int64", id="flags-dtype"),
    pytest.param(lambda ops, L, c, x, a, b: ops.gdn_prefill(x, a, b, *_args(L), c, torch.tensor([0, 1], device=DEV),
                                                            _cu([4, 5], DEV), torch.tensor([True], device=DEV)),
                 r"has_initial_state must be a bool tensor of shape \[N\] = \[2\]", id="flags-shape"),
    pytest.param(lambda ops, L, c, x, a, b: ops.gdn_prefill(x, a[:-1], b, *_args(L), c,
                                                            torch.tensor([0, 1], device=DEV), _cu([4, 5], DEV)),
                 r"a must have shape", id="a-shape"),
    pytest.param(lambda ops, L, c, x, a, b: ops.gdn_prefill(x, a, b, *_args(L), c, torch.tensor([0, 1], device=DEV),
                                                            _cu([4, 5], DEV), cu_seqlens_cpu=torch.tensor([0, 9])),
                 r"cu_seqlens_cpu must have the shape of cu_seqlens", id="host-offsets-shape"),
]


@pytest.mark.parametrize("call,msg", BAD)
def test_bad_input_same_error_nothing_touched(call, msg):
    layer, cache, x, a, b = _fault_setup()
    before = cache.clone()
    texts = []
    for ops in (rs, fs):
        with pytest.raises(ValueError, match=msg) as e:
            call(ops, layer, cache, x, a, b)
        texts.append(str(e.value))
    assert texts[0] == texts[1]
    for f, g in zip(cache.tensors(), before.tensors()):
        assert torch.equal(f, g)


def test_a_remembered_signature_still_rejects_bad_shapes():
    """fast.gdn_prefill remembers a call layout that passed the checks whatever its T and N; calls whose T or N
    disagree between arguments, or other shapes, still raise refgdn's error, and write nothing."""
    layer, cache, x, a, b = _fault_setup()
    idx, cu, has = torch.tensor([0, 1], device=DEV), _cu([4, 5], DEV), torch.tensor([True, False], device=DEV)
    for T, lens in ((9, [4, 5]), (5, [2, 3]), (9, [4, 5])):          # remembered from the second call
        fs.gdn_prefill(x[:T], a[:T], b[:T], *_args(layer), cache, idx, _cu(lens, DEV), has)
    before = cache.clone()
    bad = [(lambda: fs.gdn_prefill(x, a[:-1], b, *_args(layer), cache, idx, cu, has), r"a must have shape"),
           (lambda: fs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu, has[:1]), r"has_initial_state must be"),
           (lambda: fs.gdn_prefill(x, a, b, *_args(layer), cache, idx[:1], cu, has), r"state_indices must have"),
           (lambda: fs.gdn_prefill(x[:, :-1], a, b, *_args(layer), cache, idx, cu, has), r"mixed_qkv must have")]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
    for f, g in zip(cache.tensors(), before.tensors()):
        assert torch.equal(f, g)


def test_host_offsets_copy_spares_the_read(monkeypatch):
    """With cu_seqlens_cpu, fast.gdn_prefill reads no offsets from the device (vLLM's query_start_loc_cpu)."""
    import refgdn.checks as rc
    layer, cache, x, a, b = _fault_setup()
    cu = _cu([4, 5])
    idx = torch.tensor([0, 1], device=DEV)
    reads = []
    real = rc._read
    monkeypatch.setattr(rc, "_read", lambda t: reads.append(t) or real(t))
    fs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu.to(DEV), cu_seqlens_cpu=cu)
    fs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu.to(DEV), cu_seqlens_cpu=cu)
    assert reads == []
    fs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu.to(DEV))
    assert len(reads) == 1                             # without it: one read per call, shared by every kernel


def test_conv_and_chunk_share_one_varlen_table(monkeypatch):
    """gdn_prefill's conv tiles by the chunked forward's 64 rows, so one varlen table is built and uploaded per call
    (fast.utils.varlen_chunk_tables, kept in the call's one_host_read scope); a later call builds its own."""
    import fast.utils as fu
    layer, cache, x, a, b = _fault_setup()
    cu = _cu([4, 5])
    idx = torch.tensor([0, 1], device=DEV)
    built = []
    for name in ("_table_words", "_table_words_small"):
        real = getattr(fu, name)
        monkeypatch.setattr(fu, name, lambda offs, BT, wide, real=real: built.append(BT) or real(offs, BT, wide))
    fs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu.to(DEV), cu_seqlens_cpu=cu)
    assert built == [fs.PREFILL_CHUNK]
    fs.gdn_prefill(x, a, b, *_args(layer), cache, idx, cu.to(DEV), cu_seqlens_cpu=cu)
    assert built == [fs.PREFILL_CHUNK] * 2


@settings(max_examples=5, deadline=None, derandomize=True)
@given(data=st.data())
def test_fuzz_fast_prefill_against_refgdn(data):
    """Random request counts and lengths (empty ones included), slots (padded rows included), initial-state flags,
    conv widths, bias or none, GVA factors, fast's cache layout (allocated, or vLLM's pages with [K, V] or [V, K]
    state blocks, 64- or 4-byte aligned): fast's outputs (real requests) and every cache tensor against refgdn's
    in the same precision (float32), by the conformance rule against the float64 truth."""
    from conformance.cases_serving import paged_cache
    from conformance.core import Check, evaluate
    H_ = data.draw(st.integers(1, 2), "H")
    HV_ = H_ * data.draw(st.sampled_from([1, 2]), "gva")
    K_, V_ = data.draw(st.sampled_from([8, 16]), "K"), data.draw(st.sampled_from([8, 12]), "V")
    W_ = data.draw(st.integers(2, 4), "W")
    S_ = 5
    N = data.draw(st.integers(1, 4), "N")
    lens = [data.draw(st.integers(0, 40), f"len{n}") for n in range(N)]
    slots = data.draw(st.permutations(list(range(S_)) + [-1, -1]), "slots")[:N]
    has = [data.draw(st.booleans(), f"has{n}") for n in range(N)]
    seed = data.draw(st.integers(0, 2 ** 16), "seed")
    layout = data.draw(st.sampled_from([None, ("kv", 64), ("kv", 4), ("vk", 64), ("vk", 4)]), "layout")
    D = 2 * H_ * K_ + HV_ * V_
    lay64 = make_layer(H_, HV_, K_, V_, W_, bias=data.draw(st.booleans(), "bias"), seed=seed)
    base = make_cache(S_, H_, HV_, K_, V_, W_, seed=seed + 1)
    x, a, b = make_tokens(sum(lens), HV_, D, seed=seed + 2)
    idx, cu, flags = torch.tensor(slots), _cu(lens), torch.tensor(has)
    truth = base.clone()
    o64 = rs.gdn_prefill(x, a, b, *_args(lay64), truth, idx, cu, flags)
    f32 = {k_: (v_.float() if v_ is not None else None) for k_, v_ in lay64.items()}
    ref, got = (from_cache(base) for _ in range(2))
    o_ref = rs.gdn_prefill(x.float(), a.float(), b.float(), *_args(f32), ref, idx, cu, flags)
    dev = {k_: (v_.to(DEV) if v_ is not None else None) for k_, v_ in f32.items()}
    got = got.to(device=DEV)
    if layout is not None:
        got = paged_cache(got, align=layout[1], state_layout=layout[0])[0]
    o = fs.gdn_prefill(x.float().to(DEV), a.float().to(DEV), b.float().to(DEV), *_args(dev), got, idx.to(DEV),
                       cu.to(DEV), flags.to(DEV))
    offs = cu.tolist()
    rows = [t for n, s in enumerate(slots) if s >= 0 for t in range(offs[n], offs[n + 1])]
    if rows:
        assert evaluate(Check("o", o[rows], o64[rows], ref=o_ref[rows]))["passed"]
    assert evaluate(Check("ssm", got.ssm_state, truth.ssm_state, ref=ref.ssm_state))["passed"]
    for name in ("conv_state", "pend_meta", "pend_k", "pend_v", "pend_g", "pend_beta"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    assert got.err.tolist() == [0, 0, 0, 0]


def from_cache(c):
    """The float32 copy of a float64 cache (conformance.cases_serving.cast_cache)."""
    from conformance.cases_serving import cast_cache
    return cast_cache(c, torch.float32, torch.float32)


def test_prefill_refuses_cuda_graph_capture(monkeypatch):
    """Inside capture (the stream reports capturing) gdn_prefill raises the lifecycle's HostSyncInCapture, naming
    the op, before it launches or writes anything."""
    from refgdn.capture import HostSyncInCapture
    layer, cache, x, a, b = _fault_setup()
    before = cache.clone()
    monkeypatch.setattr(fs, "_capturing", lambda: True)
    with pytest.raises(HostSyncInCapture, match="fast.gdn_prefill inside CUDA-graph capture"):
        fs.gdn_prefill(x, a, b, *_args(layer), cache, torch.tensor([0, 1], device=DEV), _cu([4, 5], DEV),
                       cu_seqlens_cpu=_cu([4, 5]))
    for f, g in zip(cache.tensors(), before.tensors()):
        assert torch.equal(f, g)

