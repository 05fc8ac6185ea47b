"""refgdn.serving: verify + rollback == plain decode over the accepted tokens (float64), decode == the
core ops composed, materialize, accept, padded rows, bf16 state rounding, bad input."""
import pytest
import torch
from einops import rearrange

import refgdn
import refgdn.serving as rs
from conformance.cases_serving import make_cache, make_layer, make_tokens, plan_rounds
from refgdn.serving import GDNStateCache, committed_state

D64 = torch.float64


def _step_args(layer):
    return layer["conv_weight"], layer["conv_bias"], layer["A_log"], layer["dt_bias"]


def _plain_copy(cache: GDNStateCache) -> GDNStateCache:
    """A max_draft = 0 cache holding the same committed slots (the plain-decode reference)."""
    W = cache.W
    plain = GDNStateCache.allocate(cache.num_slots, cache.H, cache.HV, cache.K, cache.V, W, 0,
                                   cache.ssm_state.dtype, cache.conv_state.dtype)
    plain.ssm_state.copy_(cache.ssm_state)
    plain.conv_state.copy_(cache.conv_state[:, :, :W - 1])
    return plain


SCHEDULES = [
    pytest.param(dict(drafts=[k], rounds=3, decode_every=0, slots=[2, 0]), id=f"k{k}") for k in range(8)
] + [
    pytest.param(dict(drafts=[0, 1, 3, 7], rounds=5, decode_every=2, slots=[3, -1, 0, 1]), id="mixed-pad-decodes"),
    pytest.param(dict(drafts=[2, 7], rounds=4, decode_every=1, slots=[1]), id="every-round-decode"),
]


@pytest.mark.parametrize("sched", SCHEDULES)
@pytest.mark.parametrize("gva", [1, 2])
def test_verify_rollback_equals_plain_decode_float64(sched, gva):
    H, K, V, W = 2 // gva if gva == 1 else 1, 8, 6, 4
    HV = H * gva
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=gva)
    spec = make_cache(5, H, HV, K, V, W, max_draft=7, seed=3)
    plain = _plain_copy(spec)
    slots = sched["slots"]
    idx = torch.tensor(slots, dtype=torch.int32)
    steps = plan_rounds(len(slots), sched["rounds"], sched["drafts"], seed=11, decode_every=sched["decode_every"])
    for i, st in enumerate(steps):
        if st[0] == "verify":
            lens = [1 + k for k in st[1]]
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
            x, a, b = make_tokens(sum(lens), HV, D, seed=i)
            o = rs.gdn_verify(x, a, b, *_step_args(layer), spec, idx, cu)
            assert o.shape == (sum(lens), HV, V) and o.dtype == D64
            rs.gdn_accept(spec, idx, torch.tensor(st[2], dtype=torch.int32))
            for n, slot in enumerate(slots):
                rows = range(int(cu[n]), int(cu[n + 1]))
                if slot < 0:
                    assert torch.equal(o[int(cu[n]):int(cu[n + 1])], torch.zeros(lens[n], HV, V, dtype=D64))
                    continue
                for t in list(rows)[:st[2][n]]:   # plain decode over the accepted tokens only
                    op = rs.gdn_decode(x[t:t + 1], a[t:t + 1], b[t:t + 1], *_step_args(layer), plain,
                                       torch.tensor([slot], dtype=torch.int32))
                    torch.testing.assert_close(o[t], op[0], rtol=0, atol=1e-12)
        else:
            x, a, b = make_tokens(len(slots), HV, D, seed=i)
            o = rs.gdn_decode(x, a, b, *_step_args(layer), spec, idx)
            op = rs.gdn_decode(x, a, b, *_step_args(layer), plain, idx)
            torch.testing.assert_close(o, op, rtol=0, atol=1e-12)
        valid = [s for s in slots if s >= 0]
        ssm, conv = committed_state(spec, valid)
        torch.testing.assert_close(ssm, plain.ssm_state[valid], rtol=0, atol=1e-12)
        assert torch.equal(conv, plain.conv_state[valid])
    # slots no request owns are untouched
    other = [s for s in range(5) if s not in slots]
    fresh = make_cache(5, H, HV, K, V, W, max_draft=7, seed=3)
    for f, g in zip(spec.slot_tensors(), fresh.slot_tensors()):
        assert torch.equal(f[other], g[other])
    assert spec.err.tolist() == [0, 0, 0, 0]


def test_decode_equals_core_ops():
    """gdn_decode on committed slots == causal_conv1d_update, split, gdn_gating, l2norm, recurrent rule."""
    H, HV, K, V, W = 2, 4, 8, 5, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=5)
    cache = make_cache(4, H, HV, K, V, W, max_draft=2, seed=6)
    slots = [3, 1]
    idx = torch.tensor(slots, dtype=torch.int64)
    x, a, b = make_tokens(2, HV, D, seed=7)
    conv0 = cache.conv_state[slots, :, :W - 1].clone()
    S0 = cache.ssm_state[slots].clone()
    o = rs.gdn_decode(x, a, b, *_step_args(layer), cache, idx, scale=0.3)
    y = refgdn.causal_conv1d_update(x, conv0, layer["conv_weight"], layer["conv_bias"], "silu")
    q = rearrange(y[:, :H * K], "n (h k) -> 1 n h k", h=H)
    k = rearrange(y[:, H * K:2 * H * K], "n (h k) -> 1 n h k", h=H)
    v = rearrange(y[:, 2 * H * K:], "n (h v) -> 1 n h v", h=HV)
    g, beta = refgdn.gdn_gating(layer["A_log"], a, layer["dt_bias"], b)
    cu = torch.tensor([0, 1, 2])
    o_ref, S1 = refgdn.recurrent_gated_delta_rule(refgdn.l2norm(q), refgdn.l2norm(k), v, g[None], beta[None],
                                                   scale=0.3, initial_state=S0, output_final_state=True,
                                                   cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref[0], rtol=0, atol=1e-13)
    torch.testing.assert_close(cache.ssm_state[slots], S1, rtol=0, atol=1e-13)
    assert torch.equal(cache.conv_state[slots, :, :W - 1], conv0)
    assert cache.pend_meta[slots, 0].tolist() == [0, 0]


def test_verify_state_traffic_and_materialize():
    """A verify writes the committed prefix once and leaves the drafts pending; materialize commits them."""
    H, HV, K, V, W = 1, 2, 6, 4, 3
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=8, bias=False)
    cache = make_cache(2, H, HV, K, V, W, max_draft=3, seed=9)
    idx = torch.tensor([1], dtype=torch.int32)
    before = cache.clone()
    x, a, b = make_tokens(4, HV, D, seed=10)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    rs.gdn_verify(x, a, b, *_step_args(layer), cache, idx, cu, activation=None)
    # nothing was pending: the committed state is unchanged; the 4 tokens are pending (all accepted)
    assert torch.equal(cache.ssm_state, before.ssm_state)
    assert cache.pend_meta[1, 0].item() == 4
    assert cache.pend_meta[1, 1].item() == (1 - before.pend_meta[1, 1].item()) | rs.AWAIT_ACCEPT   # new bank, awaiting
    assert torch.equal(cache.conv_state[1, :, :W - 1 + 3], torch.cat([before.conv_state[1, :, 1:W - 1], x.T], 1))
    rs.gdn_accept(cache, idx, torch.tensor([2], dtype=torch.int32))
    assert cache.pend_meta[1].tolist() == [2, 1 - before.pend_meta[1, 1].item()]       # accepted: flag cleared
    ssm, conv = committed_state(cache, [1])
    rs.gdn_materialize(cache, idx)
    assert cache.pend_meta[1, 0].item() == 0
    assert torch.equal(cache.ssm_state[1:2], ssm) and torch.equal(cache.conv_state[1:2, :, :W - 1], conv)
    # window after accepting 2 of 4: the last W-1 inputs of [old window, x0, x1]
    assert torch.equal(conv[0], torch.cat([before.conv_state[1, :, :W - 1], x[:2].T], 1)[:, -(W - 1):])
    # materialize is idempotent; slot 0 never touched
    again = cache.clone()
    rs.gdn_materialize(again, idx)
    for f, g in zip(again.tensors(), cache.tensors()):
        assert torch.equal(f, g)
    for f, g in zip(cache.slot_tensors(), before.slot_tensors()):
        assert torch.equal(f[0], g[0])


def test_zero_token_verify_row_equals_materialize():
    H, HV, K, V, W = 1, 1, 4, 4, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=12)
    cache = make_cache(3, H, HV, K, V, W, max_draft=2, seed=13)
    idx = torch.tensor([0, 2], dtype=torch.int32)
    x, a, b = make_tokens(5, HV, D, seed=14)
    rs.gdn_verify(x[:3], a[:3], b[:3], *_step_args(layer), cache, idx, torch.tensor([0, 2, 3], dtype=torch.int32))
    rs.gdn_accept(cache, idx, torch.tensor([2, 1], dtype=torch.int32))
    m = cache.clone()
    rs.gdn_materialize(m, idx)
    rs.gdn_verify(x[:0], a[:0], b[:0], *_step_args(layer), cache, idx, torch.tensor([0, 0, 0], dtype=torch.int32))
    for f, g in zip(cache.tensors()[:2], m.tensors()[:2]):
        assert torch.equal(f[[0, 2]][..., :W - 1] if f.dim() == 3 else f[[0, 2]],
                           g[[0, 2]][..., :W - 1] if g.dim() == 3 else g[[0, 2]])
    assert cache.pend_meta[[0, 2], 0].tolist() == [0, 0]


def test_accept_sequence_rules():
    """An accept needs a verify awaiting it (not after a decode, not twice); a step between a verify and
    its accept is a fault; num_accepted in [1, L] (0 for a row that brought no tokens). check_values=False
    skips the failed rows and records the first fault in cache.err (fast's behaviour), check() raises it."""
    H, HV, K, V, W = 1, 1, 4, 4, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=15)
    cache = make_cache(3, H, HV, K, V, W, max_draft=3, seed=16)
    idx = torch.tensor([1, -1], dtype=torch.int32)
    x, a, b = make_tokens(4, HV, D, seed=17)
    rs.gdn_decode(x[:2], a[:2], b[:2], *_step_args(layer), cache, idx)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"state_indices\[0\] = 1: gdn_accept without a verify awaiting"):
        rs.gdn_accept(cache, idx, torch.tensor([1, 5], dtype=torch.int32))
    assert all(torch.equal(f, g) for f, g in zip(cache.tensors(), before.tensors()))
    cu = torch.tensor([0, 3, 3], dtype=torch.int32)
    rs.gdn_verify(x[:3], a[:3], b[:3], *_step_args(layer), cache, idx, cu)
    after_verify = cache.clone()
    for acc in (0, 4):
        with pytest.raises(ValueError, match=rf"num_accepted\[0\] must be in \[1, 3\] .* got {acc}"):
            rs.gdn_accept(cache, idx, torch.tensor([acc, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"state_indices\[0\] = 1: the slot's last verify awaits gdn_accept"):
        rs.gdn_decode(x[:2], a[:2], b[:2], *_step_args(layer), cache, idx)
    with pytest.raises(ValueError, match=r"awaits gdn_accept"):
        rs.gdn_materialize(cache, idx)
    for f, g in zip(cache.tensors(), after_verify.tensors()):
        assert torch.equal(f, g)
    # skip-and-record: the faulty accept leaves the slot awaiting; check() raises it once
    rs.gdn_accept(cache, idx, torch.tensor([9, 0], dtype=torch.int32), check_values=False)
    assert cache.pend_meta[1].tolist() == after_verify.pend_meta[1].tolist()
    with pytest.raises(ValueError, match=r"num_accepted\[0\] must be in \[1, 3\] .* got 9"):
        cache.check()
    cache.check()                                        # cleared
    rs.gdn_accept(cache, idx, torch.tensor([2, 0], dtype=torch.int32))
    assert cache.pend_meta[1, 0].item() == 2
    with pytest.raises(ValueError, match=r"gdn_accept without a verify"):  # a second accept
        rs.gdn_accept(cache, idx, torch.tensor([1, 0], dtype=torch.int32))
    # a row that brought no tokens accepts exactly 0
    rs.gdn_verify(x[:0], a[:0], b[:0], *_step_args(layer), cache, idx, torch.tensor([0, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"num_accepted\[0\] must be 0"):
        rs.gdn_accept(cache, idx, torch.tensor([1, 0], dtype=torch.int32))
    rs.gdn_accept(cache, idx, torch.tensor([0, 0], dtype=torch.int32))
    assert cache.pend_meta[1, 0].item() == 0


def test_bf16_state_is_rounded_once_per_write():
    """bf16 state: the stored state == (fold of the accepted tokens in float32) rounded once."""
    H, HV, K, V, W = 1, 2, 8, 8, 4
    D = 2 * H * K + HV * V
    layer = {k: (v.float() if v is not None else None) for k, v in make_layer(H, HV, K, V, W, seed=18).items()}
    c32 = make_cache(2, H, HV, K, V, W, 3, seed=19, state_dtype=torch.float32, act_dtype=torch.float32)
    c32.ssm_state.copy_(c32.ssm_state.to(torch.bfloat16))  # representable start
    cbf = GDNStateCache(c32.ssm_state.to(torch.bfloat16), *[t.clone() for t in c32.tensors()[1:]])
    idx = torch.tensor([0], dtype=torch.int32)
    x, a, b = make_tokens(4, HV, D, seed=20, dtype=torch.float32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for c in (c32, cbf):
        o = rs.gdn_verify(x, a, b, *_step_args(layer), c, idx, cu)
        rs.gdn_accept(c, idx, torch.tensor([3], dtype=torch.int32))
        rs.gdn_verify(x[:2], a[:2], b[:2], *_step_args(layer), c, idx, torch.tensor([0, 2], dtype=torch.int32))
    assert cbf.ssm_state.dtype == torch.bfloat16
    assert torch.equal(cbf.ssm_state[0], c32.ssm_state[0].to(torch.bfloat16))


# ------------------------------------------------------------------------------------------ bad input

def _bad_setup():
    H, HV, K, V, W = 1, 2, 4, 4, 4
    D = 2 * H * K + HV * V
    layer = make_layer(H, HV, K, V, W, seed=21)
    cache = make_cache(3, H, HV, K, V, W, max_draft=2, seed=22)
    x, a, b = make_tokens(4, HV, D, seed=23)
    return layer, cache, x, a, b


BAD = [
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x[:, :-1], a, b, *_step_args(L), c, torch.tensor([0, 1, 2, -1])),
                 r"mixed_qkv must have shape \[T, D\]", id="mixed_qkv-width"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a[:, :1], b, *_step_args(L), c, torch.tensor([0, 1, 2, -1])),
                 r"a must have shape \[T, HV\]", id="a-shape"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a, b, *_step_args(L), c, torch.tensor([0., 1, 2, -1])),
                 r"state_indices must be int32 or int64", id="indices-dtype"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a, b, *_step_args(L), c, torch.tensor([0, 1, 1, -1])),
                 r"state_indices must be distinct .* state_indices\[2\] = 1 is also the slot of request 1",
                 id="indices-duplicate"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a, b, *_step_args(L), c, torch.tensor([0, 1, 3, -1])),
                 r"state_indices\[2\] = 3 is out of range: a slot index must be in \[0, num_slots=3\)",
                 id="indices-range"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a, b, L["conv_weight"][:, :3], *list(_step_args(L))[1:], c,
                                                     torch.tensor([0, 1, 2, -1])),
                 r"conv_weight must have shape \[D, W\]", id="conv-width"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_verify(x, a, b, *_step_args(L), c, torch.tensor([0, 1]),
                                                     torch.tensor([0, 4, 4])),
                 r"request 0 has 4 tokens; a verify step takes 0..1\+max_draft=3", id="too-many-drafts"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_verify(x, a, b, *_step_args(L), c, torch.tensor([0, 1]),
                                                     torch.tensor([0, 2, 3])),
                 r"cu_seqlens must end at T=4 \(the tokens in mixed_qkv\), got cu_seqlens\[2\] = 3", id="cu-end"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_verify(x, a, b, *_step_args(L), c, torch.tensor([0, 1]), None),
                 r"cu_seqlens must be given", id="cu-missing"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_verify(x, a, b, *_step_args(L), c, torch.tensor([0, 1, 2]),
                                                     torch.tensor([0, 2, 4])),
                 r"state_indices must have shape \[N\] = \[2\]", id="indices-vs-cu"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_accept(c, torch.tensor([0]), torch.tensor([1, 1])),
                 r"num_accepted must have shape \[N\] = \[1\]", id="accept-shape"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a, b, *_step_args(L), GDNStateCache(
        c.ssm_state, c.conv_state, c.pend_k.float(), c.pend_v, c.pend_g, c.pend_beta, c.pend_meta),
        torch.tensor([0, 1, 2, -1])), r"cache.pend_k must be torch.float64", id="cache-dtype"),
    pytest.param(lambda L, c, x, a, b: rs.gdn_decode(x, a, b, *_step_args(L), GDNStateCache(
        c.ssm_state, c.conv_state, c.pend_k, c.pend_v, c.pend_g, c.pend_beta, c.pend_meta.long()),
        torch.tensor([0, 1, 2, -1])), r"cache.pend_meta must be int32", id="meta-dtype"),
]


@pytest.mark.parametrize("call,msg", BAD)
def test_bad_input_raises_before_touching_state(call, msg):
    layer, cache, x, a, b = _bad_setup()
    before = cache.clone()
    with pytest.raises(ValueError, match=msg):
        call(layer, cache, x, a, b)
    for f, g in zip(cache.tensors(), before.tensors()):
        assert torch.equal(f, g)
