"""fast.chunk (Triton chunked gated delta rule, recurrent kernel, stage twins) against refgdn.

Every numeric check uses the conformance rule (conformance.core.evaluate): fast's error against
refgdn in float64 must be <= 2x refgdn's own error in the same precision + a rounding floor. All
three runs see the *same* rounded inputs. CPU runs in the Triton interpreter (float32, float16).
"""
import itertools

import pytest
import torch
import triton
import triton.language as tl

import fast
import refgdn
from conformance.core import Check, evaluate
from fast import chunk as fc
from fast.chunk.common import _beta_of
from refgdn import delta_rule as dr
from tests.helpers import captured, gdn_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
D64 = torch.float64


def _conform(name, fast_out, ref_out, truth, dtype=None):
    res = evaluate(Check(name, fast_out, truth, ref_out, dtype=dtype))
    assert res["passed"], f"{name}: {res}"
    return res


def _inputs(B, T, H, HV, K, V, dtype, *, gate="mid", seed=0, init=False, N=None):
    """Inputs rounded to `dtype` (g, beta, state stay float32), plus their float64 copies."""
    xs = gdn_inputs(B, T, H, HV, K, V, gate=gate, seed=seed, init=init, N=N)
    low = [x.to(dtype) for x in xs[:3]] + [x.float() for x in xs[3:]]
    low = [x.to(DEV) for x in low]
    return low, [x.double() for x in low]


def _compare_op(name, fast_op, ref_op, low, hi, dtype, **kw):
    """Run fast and refgdn on the same rounded inputs; check o and final_state by the rule."""
    q, k, v, g, beta = low[:5]
    h0 = low[5] if len(low) > 5 else None
    o_f, s_f = fast_op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    o_r, s_r = ref_op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    o_t, s_t = ref_op(*hi[:5], initial_state=hi[5] if len(hi) > 5 else None, output_final_state=True, **kw)
    assert o_f.dtype == v.dtype and o_f.shape == o_t.shape
    assert s_f.dtype == torch.float32 and s_f.shape == s_t.shape
    _conform(f"{name}/o", o_f, o_r, o_t)
    _conform(f"{name}/final_state", s_f, s_r, s_t, dtype=dtype)
    return o_f, s_f


def _chunk(bt):
    return lambda *a, **kw: fast.chunk_gated_delta_rule(*a, chunk_size=bt, **kw)


def _ref_chunk(bt):
    return lambda *a, **kw: refgdn.chunk_gated_delta_rule(*a, chunk_size=bt, **kw)


# ------------------------------------------------------------------------------------ full op, dense

def _dense_params():
    dts = (torch.float32, torch.float16)
    for i, (bt, T) in enumerate(itertools.product((16, 32, 64), (1, 63, 65, 129))):
        ratio = (1, 2, 4)[i % 3]
        init, l2, gate = (True, False, "mid"), (False, True, "strong"), (True, True, "weak")
        init, l2, gate = (init, l2, gate)[i % 3]
        dt = dts[i % 2]
        yield pytest.param(bt, T, ratio, init, l2, gate, dt,
                           id=f"BT{bt}-T{T}-gva{ratio}-init{int(init)}-l2{int(l2)}-{gate}-{str(dt)[6:]}")


@pytest.mark.parametrize("bt,T,ratio,init,l2,gate,dtype", list(_dense_params()))
def test_chunk_dense(bt, T, ratio, init, l2, gate, dtype):
    H = 2 if ratio < 4 else 1
    low, hi = _inputs(2 if T < 100 else 1, T, H, H * ratio, 32, 24, dtype, gate=gate, seed=T + bt + ratio,
                      init=init)
    _compare_op("chunk", _chunk(bt), _ref_chunk(bt), low, hi, dtype, use_qk_l2norm_in_kernel=l2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_chunk_other_dtype_pairs(dtype):
    """The other precision on a GVA-1 case with awkward head dims (K=20, V=40: padded blocks)."""
    low, hi = _inputs(1, 70, 1, 1, 20, 40, dtype, seed=11, init=True)
    _compare_op("chunk-K20-V40", _chunk(32), _ref_chunk(32), low, hi, dtype)


# ------------------------------------------------------------------------------------ varlen

@pytest.mark.parametrize("bt,dtype,init", [(16, torch.float32, True), (64, torch.float32, False),
                                           (32, torch.float16, True)],
                         ids=["BT16-fp32-init", "BT64-fp32-noinit", "BT32-fp16-init"])
def test_chunk_varlen(bt, dtype, init):
    lens = [0, 1, 37, 0, 70, 16, 1]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    low, hi = _inputs(1, sum(lens), 2, 4, 16, 16, dtype, seed=bt, init=init, N=len(lens))
    o, s = _compare_op("chunk-varlen", _chunk(bt), _ref_chunk(bt), low, hi, dtype, cu_seqlens=cu)
    if init:  # an empty sequence passes its initial state through unchanged
        assert torch.equal(s[0], low[5][0]) and torch.equal(s[3], low[5][3])


def test_chunk_varlen_matches_per_sequence_calls():
    """varlen == one dense call per sequence (chunks never straddle sequences)."""
    lens = [5, 0, 40, 17]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int64, device=DEV)
    (q, k, v, g, beta, h0), _ = _inputs(1, sum(lens), 1, 2, 16, 16, torch.float32, seed=3, init=True, N=4)
    o, s = fast.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, chunk_size=16)
    for n in range(len(lens)):
        a, b = cu[n].item(), cu[n + 1].item()
        o_n, s_n = fast.chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                               initial_state=h0[n:n + 1], output_final_state=True, chunk_size=16)
        torch.testing.assert_close(o[:, a:b], o_n, rtol=0, atol=1e-6)
        torch.testing.assert_close(s[n:n + 1], s_n, rtol=0, atol=1e-6)


def test_varlen_passes_walk_the_sequences_in_the_order_table(monkeypatch):
    """The sequential passes map their programs through the tables' sequence order (longest first, for the GPU's
    schedule): any permutation gives the same results bit for bit, and a table that is not one leaves sequences
    unvisited (so the kernels do read it: the order is not just computed)."""
    import fast.chunk.common as cm
    from fast.utils import VarlenTables
    lens = [5, 40, 17]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    (q, k, v, g, beta, h0), _ = _inputs(1, sum(lens), 1, 2, 16, 16, torch.float32, seed=7, init=True, N=3)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    want = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    tables = cm.varlen_chunk_tables
    assert tables(cu, 16).order.tolist() == [1, 2, 0]                        # by chunk count: 3, 2, 1

    def with_order(order):
        def build(cu_, bt):
            t = tables(cu_, bt)
            return VarlenTables(t.indices, t.offsets, t.checked, torch.tensor(order, dtype=torch.int32, device=DEV))
        monkeypatch.setattr(cm, "varlen_chunk_tables", build)
        return fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    kept = []                       # every result stays alive: no later output may reuse a block holding the answer
    for order in ([0, 1, 2], [2, 0, 1]):
        kept.append(with_order(order))
        assert torch.equal(kept[-1][0], want[0]) and torch.equal(kept[-1][1], want[1]), order
    partial = with_order([1, 1, 1])                                          # sequences 0 and 2 never walked
    assert torch.equal(partial[1][1], want[1][1]) and not torch.equal(partial[1][0], want[1][0])


@pytest.mark.parametrize("T", [pytest.param(40, id="T40"), pytest.param(0, id="T0")])
def test_one_sequence_varlen_is_the_dense_call(T):
    """cu_seqlens = [0, T] (one sequence) runs as the dense B = 1 call: the same results bit for bit, the same
    compile keys (fast.keys), no chunk tables (and, for a long sequence, the pipelined forward)."""
    from fast import keys
    (q, k, v, g, beta, h0), _ = _inputs(1, T, 1, 2, 16, 16, torch.float32, seed=4, init=True)
    cu = torch.tensor([0, T], dtype=torch.int64, device=DEV)
    kw = dict(initial_state=h0, output_final_state=True, chunk_size=16, use_qk_l2norm_in_kernel=True)
    from refgdn.capture import KeyLog, recording
    dense = fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    for extra in (dict(), dict(cu_seqlens_cpu=cu.cpu())):
        log = KeyLog()
        with recording(log):
            one = fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, **kw, **extra)
        assert torch.equal(one[0], dense[0]) and torch.equal(one[1], dense[1])
        # the launches themselves are the dense call's (IS_VARLEN off, no chunk tables), as fast.keys lists them
        assert log.launched == keys.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        assert all(not dict(key.constexprs).get("IS_VARLEN", False) for key in log.launched)
    assert keys.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, **kw) == keys.chunk_gated_delta_rule(
        q, k, v, g, beta, **kw)


def test_varlen_keys_equal_the_launches_with_and_without_host_offsets():
    """Varlen (N = 3) without cu_seqlens' host values: every kernel runs on the device-built tables (chunk_table_kernel's
    EVERY form first), with cu_seqlens_cpu on the host tables (no table kernel); fast.keys lists exactly those
    launches, and both calls give the same bits."""
    from fast import keys
    from refgdn.capture import KeyLog, recording
    (q, k, v, g, beta, h0), _ = _inputs(1, 40, 1, 2, 16, 16, torch.float32, seed=4, init=True, N=3)
    cu = torch.tensor([0, 7, 7, 40], dtype=torch.int64, device=DEV)
    kw = dict(initial_state=h0, output_final_state=True, chunk_size=16, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    outs = []
    for extra in (dict(), dict(cu_seqlens_cpu=cu.cpu())):
        log = KeyLog()
        with recording(log):
            outs.append(fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw, **extra))
        assert log.launched == keys.chunk_gated_delta_rule(q, k, v, g, beta, **kw, **extra,
                                                            offsets_known=bool(extra))
        tables = [key for key in log.launched if key.kernel == "chunk_table_kernel"]
        assert [dict(key.constexprs)["EVERY"] for key in tables] == ([] if extra else [True])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("bt,dtype", [(64, torch.float32), (32, torch.float16)], ids=["BT64-fp32", "BT32-fp16"])
def test_chunk_config_variants(bt, dtype):
    """Non-default configs: several V-blocks in the state and output kernels (BV < V, the last one
    partly masked), with l2norm and GVA."""
    configs = {"state": dict(BV=16), "output": dict(BV=16)}

    def fast_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        return fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             chunk_size=bt, configs=configs, **kw)
    low, hi = _inputs(1, 70, 1, 2, 40, 24, dtype, seed=21, init=True)
    _compare_op("chunk-variants", fast_fwd, _ref_chunk(bt), low, hi, dtype, use_qk_l2norm_in_kernel=True)


@triton.jit
def _exp_kernel(x, y, n, PRECISE: tl.constexpr):
    o = tl.program_id(0) * 256 + tl.arange(0, 256)
    tl.store(y + o, fc._exp(tl.load(x + o, mask=o < n, other=0.0), PRECISE), mask=o < n)


def test_precise_exp():
    """fast.chunk._exp(PRECISE), the range-reduced fp32 exp, against float64: a few ulp over the whole
    range, 0 below -87, inf past 88.73, nan kept."""
    x = torch.cat([torch.linspace(-100, 95, 3000), torch.linspace(-1, 1, 1000),
                   torch.tensor([0.0, -0.0, float("-inf"), float("inf"), float("nan"), -87.0, 88.7])]).to(DEV)
    y = torch.empty_like(x)
    _exp_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), True)
    t = x.double().exp()
    ok = (x >= -87) & (x < 88.72)
    rel = ((y.double() - t).abs() / t)[ok]
    assert rel.max().item() < 8 * 2.0 ** -24
    assert torch.all(y[(x < -87)] == 0) and torch.all(torch.isinf(y[x > 88.73]))
    assert torch.isnan(y[x.isnan()]).all()


def test_chunk_all_sequences_empty():
    cu = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEV)
    (q, k, v, g, beta, h0), _ = _inputs(1, 0, 1, 1, 16, 16, torch.float32, init=True, N=2)
    o, s = fast.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, 0, 1, 16) and torch.equal(s, h0)
    o, s = fast.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(s, torch.zeros_like(h0))


# ------------------------------------------------------------------------------------ strided, gating, scale

def _strided_inputs(B, T, H, HV, K, V, dtype, seed=0):
    """q, k, v as slices of one fused projection [B, T, 2HK + HV V]; g, beta as strided slices; a
    non-contiguous initial state."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, T, 2 * H * K + HV * V + 3, generator=gen).to(dtype).to(DEV)
    q = proj[..., :H * K].unflatten(-1, (H, K))
    k = proj[..., H * K:2 * H * K].unflatten(-1, (H, K))               # used with qk l2norm
    v = proj[..., 2 * H * K:2 * H * K + HV * V].unflatten(-1, (HV, V))
    gb = torch.rand(B, T, HV, 2, generator=gen) * torch.tensor([-2.0, 1.0])
    gb = gb.flatten(-2).to(DEV)                                      # [B, T, 2 HV]: (g, beta) interleaved
    g, beta = gb[..., 0::2], gb[..., 1::2]                           # head stride 2
    h0 = torch.randn(HV, B, V, K, generator=gen).to(DEV).permute(1, 0, 3, 2)   # [B, HV, K, V], transposed
    return [q, k, v, g, beta, h0]


@pytest.mark.parametrize("op,ref", [(_chunk(32), _ref_chunk(32)),
                                    (fast.recurrent_gated_delta_rule, refgdn.recurrent_gated_delta_rule)],
                         ids=["chunk32", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_strided_inputs(op, ref, dtype):
    low = _strided_inputs(2, 45, 2, 4, 16, 24, dtype, seed=5)
    assert not low[0].is_contiguous() and not low[3].is_contiguous() and not low[5].is_contiguous()
    hi = [x.double() for x in low]
    _compare_op("strided", op, ref, low, hi, dtype, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("op,ref", [(_chunk(64), _ref_chunk(64)), (_chunk(16), _ref_chunk(16)),
                                    (fast.recurrent_gated_delta_rule, refgdn.recurrent_gated_delta_rule)],
                         ids=["chunk64", "chunk16", "recurrent"])
def test_fused_gating_and_scale(op, ref):
    low, hi = _inputs(1, 90, 1, 2, 16, 16, torch.float32, seed=9, init=True)
    a = low[3] * 30 + 25                                           # raw gate input, both sides of softplus' 20
    low[3], hi[3] = a, a.double()
    gen = torch.Generator().manual_seed(19)                          # seeded: the same gates every run
    A_log = torch.randn(2, generator=gen).to(DEV)
    dt_bias = torch.randn(2, generator=gen).to(DEV)
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=0.37)
    q, k, v, g, beta, h0 = low
    o_f, s_f = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    o_r, s_r = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    o_t, s_t = ref(*hi[:5], initial_state=hi[5], output_final_state=True, A_log=A_log.double(),
                   dt_bias=dt_bias.double(), scale=0.37)
    _conform("gating/o", o_f, o_r, o_t)
    _conform("gating/final_state", s_f, s_r, s_t)


def test_no_final_state_and_default_scale():
    (q, k, v, g, beta), _ = _inputs(1, 20, 1, 1, 16, 16, torch.float32)
    o, s = fast.chunk_gated_delta_rule(q, k, v, g, beta)
    o2, _ = fast.chunk_gated_delta_rule(q, k, v, g, beta, scale=16 ** -0.5)
    assert s is None and torch.equal(o, o2)


def _repeats_through_one_plan(q, k, v, g, beta, kw) -> tuple:
    """Three calls of fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw) on an empty plan cache, each bit for bit
    the plain forward's results, leave one plan: (those results, the plan's kernels in launch order)."""
    want = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
    for _ in range(3):
        got = fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(fc._PLANS.entries) == 1
    plan = next(iter(fc._PLANS.entries.values()))
    return want, [s[0][0].__name__ for s in plan.slots]


def test_repeated_calls_launch_through_the_signature_plan():
    """A dense call whose signature passed the checks before skips them and launches through the signature's
    LaunchPlan (fast.launch; on a GPU each kernel's compiled launcher is reused), kept from the signature's second
    call: the same results as the plain forward, bit for bit; one plan per signature; an input that would fail the
    checks never reaches a plan."""
    fc.clear_plan_cache()
    (q, k, v, g, beta, h0), _ = _inputs(2, 40, 1, 2, 16, 16, torch.float32, init=True)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16)
    want, kernels = _repeats_through_one_plan(q, k, v, g, beta, kw)
    fused = fc.state_fuses_output(2, 2, 16, 16, q.device)                  # (always in the interpreter)
    assert kernels == (["chunk_kkt_inv_kernel", "row_scales_kernel", "chunk_state_kernel"] if fused    # (l2norm)
                       else ["chunk_kkt_inv_kernel", "chunk_state_kernel", "chunk_output_kernel"])
    o1, _ = fast.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, scale=0.25)   # the scale's value
    o2, _ = fast.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, scale=0.5)    # is passed per call
    assert len(fc._PLANS.entries) == 2 and not torch.equal(o1, o2)
    assert torch.equal(o2, fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, scale=0.5)[0])
    qs = torch.cat([q, q], dim=-1)[..., :16]                                  # same shape, other strides:
    assert torch.equal(fast.chunk_gated_delta_rule(qs, k, v, g, beta, **kw)[0], want[0])
    assert len(fc._PLANS.entries) == 2                                       # the same plan (strides are the
    qs = torch.stack([q, q], dim=-1)[..., 0]                                 # launches' integer arguments)
    assert torch.equal(fast.chunk_gated_delta_rule(qs, k, v, g, beta, **kw)[0], want[0])  # (last stride 2: copied)
    assert len(fc._PLANS.entries) == 2
    q3 = torch.randn(3, 40, 1, 16, device=DEV)                                # another batch: its own signature
    v3, g3, b3 = v[:1].expand(3, -1, -1, -1), g[:1].expand(3, -1, -1), beta[:1].expand(3, -1, -1)
    fast.chunk_gated_delta_rule(q3, q3, v3, g3, b3)
    assert len(fc._PLANS.entries) == 2                                       # a first call is only remembered
    fast.chunk_gated_delta_rule(q3, q3, v3, g3, b3)
    assert len(fc._PLANS.entries) == 3                                       # its second keeps a plan
    with pytest.raises(ValueError, match="initial_state"):                   # a known shape family, a bad state
        fast.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:1], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size"):
        fast.chunk_gated_delta_rule(q, k, v, g, beta, **dict(kw, chunk_size=24))
    assert len(fc._PLANS.entries) == 3
    fc.clear_plan_cache()


def test_varlen_calls_checked_behind_kernel_1_launch_through_the_signature_plan():
    """Varlen without cu_seqlens' host values (kernel 1 on the device-built table, the values checked behind it):
    a repeated signature skips the shape checks and launches through its LaunchPlan (the table kernel first), the
    same bits as the plain forward with the host copy; the values are still checked on every call."""
    fc.clear_plan_cache()
    (q, k, v, g, beta, h0), _ = _inputs(1, 40, 1, 2, 16, 16, torch.float32, init=True, N=3)
    cu = torch.tensor([0, 7, 7, 40], dtype=torch.int32, device=DEV)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16, cu_seqlens=cu)
    _, kernels = _repeats_through_one_plan(q, k, v, g, beta, kw)
    fused = fc.state_fuses_output(3, 2, 16, 16, q.device)
    assert kernels == ["chunk_table_kernel", "chunk_kkt_inv_kernel"] + (
        ["row_scales_kernel", "chunk_state_kernel"] if fused else ["chunk_state_kernel", "chunk_output_kernel"])
    with pytest.raises(ValueError, match="non-decreasing"):                  # the same signature, bad values
        bad = torch.tensor([0, 9, 7, 40], dtype=torch.int32, device=DEV)
        fast.chunk_gated_delta_rule(q, k, v, g, beta, **dict(kw, cu_seqlens=bad))
    assert len(fc._PLANS.entries) == 1
    fc.clear_plan_cache()


def test_varlen_calls_with_host_offsets_launch_through_the_signature_plan(monkeypatch):
    """Varlen with cu_seqlens' host copy (cu_seqlens_cpu, vLLM's query_start_loc_cpu): a repeated signature skips
    the shape checks and launches through its LaunchPlan, on each call's own grids (other offsets, other chunk
    counts), bit for bit the plain forward; the host copy's values are checked on every call, and cu_seqlens
    itself is never read."""
    import refgdn.checks as rc
    fc.clear_plan_cache()
    (q, k, v, g, beta, h0), _ = _inputs(1, 40, 1, 2, 16, 16, torch.float32, init=True, N=3)
    reads = []
    real_read = rc._read
    monkeypatch.setattr(rc, "_read", lambda t: reads.append(t) or real_read(t))

    def kw(offsets, host_copy=True):
        cu = torch.tensor(offsets, dtype=torch.int32, device=DEV)
        return dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16,
                    cu_seqlens=cu, **(dict(cu_seqlens_cpu=cu.cpu()) if host_copy else {}))
    wants = {}
    for offsets in ([0, 7, 7, 40], [0, 33, 33, 40], [0, 1, 2, 40], [0, 0, 0, 40]):   # other chunk counts
        wants[tuple(offsets)] = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw(offsets, host_copy=False))
    reads.clear()
    for offsets in [(0, 7, 7, 40)] * 3 + list(wants):                        # one plan from the second call on
        got = fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw(list(offsets)))
        assert all(torch.equal(a, b) for a, b in zip(got, wants[offsets])), offsets
    assert len(fc._PLANS.entries) == 1
    plan = next(iter(fc._PLANS.entries.values()))
    fused = fc.state_fuses_output(3, 2, 16, 16, q.device)
    assert [sl[0][0].__name__ for sl in plan.slots] == ["chunk_kkt_inv_kernel"] + (
        ["row_scales_kernel", "chunk_state_kernel"] if fused else ["chunk_state_kernel", "chunk_output_kernel"])
    for bad, match in (([0, 9, 7, 40], "non-decreasing"), ([0, 7, 7, 39], "end at T"), ([1, 7, 7, 40], "start at 0")):
        with pytest.raises(ValueError, match=match):                          # the same signature, bad values
            fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw(bad))
    assert reads == [] and len(fc._PLANS.entries) == 1
    fc.clear_plan_cache()


def test_one_prefill_plan_serves_every_token_and_sequence_count():
    """Serving's prefills differ in T and N on nearly every call. The signature leaves both out (it keeps the
    equalities the checks test), so from the second call on one plan serves them all, with per-launch checks of
    the kernels, keywords and integer classes (fast.launch), bit for bit the plain forward. Calls whose T or N
    disagree between arguments still fail the checks, and never reach the plan."""
    fc.clear_plan_cache()
    lens_list = [[7, 0, 33], [40], [5, 16, 3, 9], [1, 1], [17, 30, 2], [64, 64], [9, 23, 0, 0, 11]]
    for lens in lens_list + lens_list[:1]:          # (the first call builds the plan; its lengths come back last)
        T, N = sum(lens), len(lens)
        (q, k, v, g, beta, h0), _ = _inputs(1, T, 1, 2, 16, 16, torch.float32, init=True, N=N, seed=T)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16,
                  cu_seqlens=cu)
        want = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
        kw["cu_seqlens_cpu"] = cu.cpu()
        got = fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), lens
    assert len(fc._PLANS.entries) == 1
    with pytest.raises(ValueError, match="initial_state"):                  # N + 1 initial states for N sequences
        fast.chunk_gated_delta_rule(q, k, v, g, beta, **dict(kw, initial_state=torch.cat([h0, h0[:1]])))
    with pytest.raises(ValueError, match="v must have shape"):               # v one token short
        fast.chunk_gated_delta_rule(q, k, v[:, 1:], g, beta, **kw)
    with pytest.raises(ValueError, match="beta"):
        fast.chunk_gated_delta_rule(q, k, v, g, beta[:, 1:], **kw)
    with pytest.raises(ValueError, match="end at T"):                       # offsets of another T
        fast.chunk_gated_delta_rule(q[:, 1:], k[:, 1:], v[:, 1:], g[:, 1:], beta[:, 1:], **kw)
    assert len(fc._PLANS.entries) == 1
    fc.clear_plan_cache()


@pytest.mark.parametrize("NT,S,BT,T", [(1024, 4, 64, 65536), (600, 4, 64, 38390), (7, 3, 16, 100), (3, 8, 64, 130)],
                         ids=["even", "tail", "small", "more-segments-than-chunks"])
def test_pipeline_segment_bounds(NT, S, BT, T):
    """fast.chunk.pipeline's segments: whole chunks, in order, covering every chunk and token once, nearly equal;
    and the rule never pipelines in the interpreter, for several sequences, or on the fused path."""
    from fast.chunk import pipeline as pl
    parts = pl._bounds(NT, S, BT, T)
    assert parts[0][:3:2] == (0, 0) and parts[-1][1] == NT and parts[-1][3] == T
    assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(parts, parts[1:]))      # contiguous
    assert all(c1 > c0 and t0 == c0 * BT and t1 == min(c1 * BT, T) for c0, c1, t0, t1 in parts)
    sizes = [c1 - c0 for c0, c1, _, _ in parts]
    assert len(parts) == min(S, NT) and max(sizes) - min(sizes) <= 1
    dev = torch.device(DEV)
    assert pl.pipeline_segments(2, 65536, 64, dev, False) == 1
    assert pl.pipeline_segments(1, 65536, 64, dev, True) == 1
    assert pl.pipeline_segments(1, 16320, 64, dev, False) == 1                  # 255 chunks
    cuda = DEV == "cuda"
    for capturing in (True, False):      # two segments from 256 chunks only inside a graph's capture (no host work)
        assert pl.pipeline_segments(1, 16384, 64, dev, False, capturing) == (2 if cuda and capturing else 1)
        assert pl.pipeline_segments(1, 32704, 64, dev, False, capturing) == (2 if cuda and capturing else 1)  # 511
        assert pl.pipeline_segments(1, 32768, 64, dev, False, capturing) == (4 if cuda else 1)
    assert pl.pipeline_segments(1, 16384, 64, dev, False) == 1                 # (not capturing now)
    # the forward's fused-output rule: a single sequence long enough to pipeline keeps kernel 4 (Qwen3.5's 64 value
    # heads would fuse it by the program count alone); shorter, or two sequences, fuse (the interpreter always fuses)
    big = pl.state_fuses_output(1, 64, 128, 128, dev)
    assert pl.forward_fuses_output(1, 16384, 64, 64, 128, 128, dev, True) == (big and not cuda)
    assert pl.forward_fuses_output(1, 16384, 64, 64, 128, 128, dev, False) == big
    assert pl.forward_fuses_output(1, 16320, 64, 64, 128, 128, dev) == big
    assert pl.forward_fuses_output(2, 16384, 64, 64, 128, 128, dev) == pl.state_fuses_output(2, 64, 128, 128, dev)
    assert pl.forward_fuses_output(1, 65536, 64, 32, 128, 128, dev) == (not cuda)       # Qwen3-Next: never fused


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_configs_warp_mma(cap, monkeypatch):
    """The chunk op's GPU configs by compute capability (host rules only; nothing compiles): on warp-MMA GPUs (sm_8x,
    sm_12x) the state pass never fuses o, takes BV <= 32 and kernel 4 eight warps (the widest configs that compile
    without spills there: fast.chunk.state.state_config), and the backward's reverse pass too (fast.chunk_bwd);
    Hopper and sm_100 keep the sm_90-tuned ones; float32 tiles fit ~99 KB of shared memory where a block has no more.
    Qwen3-Next's heads, 132 SMs."""
    from fast.chunk import common, output, pipeline, state
    monkeypatch.setattr(common, "_capability", lambda kind, index: cap if kind == "cuda" else (9, 0))
    for mod in (state, output):
        monkeypatch.setattr(mod, "is_interpreting", lambda: False)
    monkeypatch.setattr(state, "_num_sms", lambda device: 132)
    dev, warp = torch.device("cuda", 0), cap[0] in (8, 12)
    assert common._warp_mma(dev) == warp and not common._warp_mma(torch.device("cpu"))
    for N in (1, 2, 4, 16):
        fused = state.state_fuses_output(N, 32, 128, 128, dev)
        assert fused == (N >= 2 and not warp)                       # 2 * 32 * 2 programs >= 132 // 2
        assert pipeline.forward_fuses_output(N, 4096, 64, 32, 128, 128, dev) == fused
        bv = state.state_config(N, 32, 128, 128, dev, fused=fused)["BV"]
        assert bv == (64 if N >= 4 and not warp else 32)          # fused: 64 from 4 * 32 * 2 >= 132 programs
    assert state.state_config(4, 32, 128, 128, dev, fused=True)["BV"] == (32 if warp else 64)  # fused asked for
    assert state.state_config(1, 8, 128, 128, dev)["BV"] == 16                                  # few programs: any GPU
    assert output.output_config(128, 128, dev) == dict(BV=128, num_warps=8 if warp else 4, num_stages=1)
    assert output.output_config(128, 128)["num_warps"] == 4                                    # no device: sm_90's
    # float32 tiles on ~99 KB-shared-memory GPUs (sm_86, sm_89, sm_12x): one stage, kernel 4 at BV 32 (they fit)
    small = cap in ((8, 6), (8, 9)) or cap[0] == 12
    assert common._small_smem(dev) == small and not common._small_smem(torch.device("cpu"))
    assert state.state_config(1, 32, 128, 128, dev, itemsize=4)["num_stages"] == (1 if small else 3)
    assert state.state_config(1, 32, 128, 128, dev)["num_stages"] == 3
    assert output.output_config(128, 128, dev, 4)["BV"] == (32 if small else 128)
    assert output.output_config(128, 128, dev)["BV"] == 128
    # the backward's (fast.chunk_bwd; bench_train's shape, the bf16 default's settings)
    import fast.chunk_bwd as cb
    monkeypatch.setattr(cb, "is_interpreting", lambda: False)
    monkeypatch.setattr(cb, "_num_sms", lambda device: 132)
    dh = cb.dh_bwd_config(4, 32, 128, 128, dev, fp32=True, tf32_operands=True, store16=True, sixteen_bit=True)
    assert (dh["BV"], dh["num_warps"]) == ((32, 8) if warp else (64, 4))


@pytest.mark.skipif(DEV != "cuda", reason="the pipelined forward runs on a CUDA device only (two streams)")
@pytest.mark.parametrize("T,segments,dtype,l2,init,from_a,knobs", [
    pytest.param(4096, 4, torch.bfloat16, False, True, True, None, id="T4096-s4-bf16"),
    pytest.param(4096, 4, torch.bfloat16, True, True, True, dict(ahead=4, weights=(1, 2, 2, 1)),
                 id="T4096-s4-bf16-l2-all-ahead-tapered"),
    pytest.param(1000, 3, torch.bfloat16, True, False, False, None, id="T1000-s3-bf16-l2-kernel2"),
    pytest.param(1000, 3, torch.bfloat16, False, False, True, dict(ahead=2, weights=(3, 1, 2)),
                 id="T1000-s3-bf16-ahead2-uneven"),
    pytest.param(777, 5, torch.float32, True, True, True, None, id="T777-s5-fp32-l2"),
    pytest.param(130, 8, torch.float16, False, True, False, None, id="T130-s8-fp16-kernel2")])
def test_pipelined_forward_is_bit_identical(T, segments, dtype, l2, init, from_a, knobs):
    """One sequence's forward pipelined over segments (fast.chunk.pipeline: the state pass on a side stream, segment
    by segment, beside the chunk-parallel kernels) gives the one-pass forward's results bit for bit: o, the final
    state and kernel 1's kept outputs, also with the pipeline's knobs (kernel 1 queued further ahead, uneven
    segments). Also inside a CUDA graph, replayed twice on new inputs."""
    (q, k, v, g, beta, h0), _ = _inputs(1, T, 2, 4, 64, 32, dtype, init=True)
    h0 = h0 if init else None
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, from_a=from_a, keep_kkt=True,
              fuse_output=False, configs={"pipeline": knobs} if knobs else None)
    want = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, segments=1, **kw)
    got = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, segments=segments, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[2], want[2]))
    # captured: the side stream forks from and joins the capturing stream
    ins = [x.clone() for x in (q, k, v, g, beta)]
    graph, out = captured(lambda: fc.chunk_gated_delta_rule_fwd(*ins, segments=segments, **kw))
    for seed in (5, 6):
        (q2, k2, v2, g2, beta2, _), _ = _inputs(1, T, 2, 4, 64, 32, dtype, init=True, seed=seed)
        for dst, src in zip(ins, (q2, k2, v2, g2, beta2)):
            dst.copy_(src)
        graph.replay()
        ref = fc.chunk_gated_delta_rule_fwd(q2, k2, v2, g2, beta2, segments=1, **kw)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_float64_runs_the_oracle():
    xs = gdn_inputs(1, 20, 1, 2, 8, 8, seed=1, init=True)
    for f_op, r_op in ((fast.chunk_gated_delta_rule, refgdn.chunk_gated_delta_rule),
                       (fast.recurrent_gated_delta_rule, refgdn.recurrent_gated_delta_rule)):
        o_f, s_f = f_op(*xs[:5], initial_state=xs[5], output_final_state=True)
        o_r, s_r = r_op(*xs[:5], initial_state=xs[5], output_final_state=True)
        assert torch.equal(o_f, o_r) and torch.equal(s_f, s_r)


# ------------------------------------------------------------------------------------ recurrent

@pytest.mark.parametrize("T,ratio,l2,dtype", [(1, 1, False, torch.float32), (33, 2, True, torch.float32),
                                              (65, 4, False, torch.float16), (20, 2, True, torch.float16)],
                         ids=["T1-fp32", "T33-gva2-l2-fp32", "T65-gva4-fp16", "T20-gva2-l2-fp16"])
def test_recurrent(T, ratio, l2, dtype):
    H = 2 if ratio < 4 else 1
    low, hi = _inputs(2, T, H, H * ratio, 24, 20, dtype, seed=T, init=True)
    _compare_op("recurrent", fast.recurrent_gated_delta_rule, refgdn.recurrent_gated_delta_rule, low, hi, dtype,
                use_qk_l2norm_in_kernel=l2)


def test_recurrent_varlen():
    lens = [3, 0, 1, 20]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    low, hi = _inputs(1, sum(lens), 1, 2, 16, 16, torch.float32, seed=2, init=True, N=4)
    _compare_op("recurrent-varlen", fast.recurrent_gated_delta_rule, refgdn.recurrent_gated_delta_rule,
                low, hi, torch.float32, cu_seqlens=cu)


def test_chunk_equals_recurrent_fp32():
    low, _ = _inputs(1, 100, 2, 4, 32, 32, torch.float32, seed=4, init=True)
    kw = dict(initial_state=low[5], output_final_state=True)
    o_c, s_c = fast.chunk_gated_delta_rule(*low[:5], **kw)
    o_r, s_r = fast.recurrent_gated_delta_rule(*low[:5], **kw)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=2e-5)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=2e-5)


# ------------------------------------------------------------------------------------ stages, one kernel each

def _stage_inputs(bt, T=None, seed=0, gate="mid", dtype=torch.float32):
    """Dense stage inputs (T a multiple of bt, as refgdn's stages need): rounded to dtype and float64 copies."""
    T = T or 2 * bt
    low, hi = _inputs(2, T, 1, 2, 24, 20, dtype, seed=seed, gate=gate, init=True)
    return low, hi


@pytest.mark.parametrize("bt", [16, 32, 64])
def test_stage_chunk_cumsum(bt):
    low, hi = _stage_inputs(bt, seed=bt)
    g, g64 = low[3], hi[3]
    _conform("G", fc.chunk_cumsum(g, bt), dr.chunk_cumsum(g, bt), dr.chunk_cumsum(g64, bt))
    # fused gating inside the cumsum
    gen = torch.Generator().manual_seed(23)
    A_log, dt_bias = torch.randn(2, generator=gen).to(DEV), torch.randn(2, generator=gen).to(DEV)
    a = g * 40 + 22                                                # both sides of softplus' 20
    g_ref = refgdn.gdn_gating(A_log, a, dt_bias, a)[0]
    g_64 = refgdn.gdn_gating(A_log.double(), a.double(), dt_bias.double(), a.double())[0]
    _conform("G-gated", fc.chunk_cumsum(a, bt, A_log=A_log, dt_bias=dt_bias), dr.chunk_cumsum(g_ref, bt),
             dr.chunk_cumsum(g_64, bt))


@pytest.mark.parametrize("method", ["rows", "doubling"])
@pytest.mark.parametrize("bt,gate", [(16, "mid"), (32, "weak"), (64, "mid"), (64, "strong")])
def test_stage_wy_repr(bt, gate, method):
    low, hi = _stage_inputs(bt, seed=bt, gate=gate)
    k, beta, G = low[1], low[4], dr.chunk_cumsum(low[3], bt)
    k64, beta64, G64 = hi[1], hi[4], dr.chunk_cumsum(hi[3], bt)
    _conform("A", fc._wy_repr(k, beta, G, bt, inv_method=method), dr.wy_repr(k, beta, G, bt),
             dr.wy_repr(k64, beta64, G64, bt))


def test_stage_wy_repr_repeated_keys():
    """Identical keys (repeated tokens) make L a full lower-triangular block of ~beta; the inverse's
    entries stay O(1) only if no series/cancellation is involved."""
    bt = 64
    low, hi = _stage_inputs(bt, seed=1, gate="weak")
    k = low[1][:, :1].expand_as(low[1]).contiguous()
    beta = torch.ones_like(low[4])
    G = dr.chunk_cumsum(low[3], bt)
    truth = dr.wy_repr(k.double(), beta.double(), G.double(), bt)
    _conform("A-repeated", fc.wy_repr(k, beta, G, bt), dr.wy_repr(k, beta, G, bt), truth)


@pytest.mark.parametrize("bt", [16, 64])
def test_stage_w_u(bt):
    low, hi = _stage_inputs(bt, seed=bt + 1)
    k, v, beta, G = low[1], low[2], low[4], dr.chunk_cumsum(low[3], bt)
    A = dr.wy_repr(k, beta, G, bt)
    k64, v64, beta64, G64 = hi[1], hi[2], hi[4], dr.chunk_cumsum(hi[3], bt)
    A64 = dr.wy_repr(k64, beta64, G64, bt)
    w, u = fc.w_u(k, v, beta, A, G, bt)
    w_r, u_r = dr.w_u(k, v, beta, A, G, bt)
    w_t, u_t = dr.w_u(k64, v64, beta64, A64, G64, bt)
    _conform("w", w, w_r, w_t)
    _conform("u", u, u_r, u_t)


@pytest.mark.parametrize("wy", [False, True], ids=["from-w-u", "from-A"])
@pytest.mark.parametrize("bt", [16, 32, 64])
def test_stage_state_passing(bt, wy):
    """Kernel 3 from w, u (state_passing) and from A, forming v_new in the pass (state_passing_wy, the forward's
    FROM_A), both against refgdn's w_u then state_passing."""
    low, hi = _stage_inputs(bt, T=3 * bt, seed=bt + 2)

    def pre(x):
        k, v, g, beta = x[1], x[2], x[3], x[4]
        G = dr.chunk_cumsum(g, bt)
        A = dr.wy_repr(k, beta, G, bt)
        return (k, v, beta, A, G), (k, *dr.w_u(k, v, beta, A, G, bt), G)

    wy_args, wu_args = pre(low)
    h, vn, s = fc.state_passing_wy(*wy_args, bt, low[5]) if wy else fc.state_passing(*wu_args, bt, low[5])
    h_r, vn_r, s_r = dr.state_passing(*wu_args, bt, low[5])
    h_t, vn_t, s_t = dr.state_passing(*pre(hi)[1], bt, hi[5])
    _conform("h", h, h_r, h_t)
    _conform("v_new", vn, vn_r, vn_t)
    _conform("final_state", s, s_r, s_t)


@pytest.mark.parametrize("fuse_output", [True, False], ids=["o-in-pass", "o-kernel"])
@pytest.mark.parametrize("from_a", [True, False], ids=["state-from-A", "w-u-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_chunk_forward_both_state_paths(from_a, fuse_output, dtype):
    """The forward with v_new formed in the state pass (kernel 2 skipped) or by kernel 2, and o formed in the pass
    (kernel 4 skipped) or by kernel 4: every path conforms, dense (GVA, l2norm, odd T) and varlen (an empty and a
    one-token sequence, initial states)."""
    def fwd(bt):
        def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
            return fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 chunk_size=bt, from_a=from_a, fuse_output=fuse_output, **kw)
        return run
    low, hi = _inputs(2, 77, 1, 2, 32, 24, dtype, seed=31, init=True)
    _compare_op("dense", fwd(32), _ref_chunk(32), low, hi, dtype, use_qk_l2norm_in_kernel=True)
    lens = [0, 1, 45, 70]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    low, hi = _inputs(1, sum(lens), 2, 4, 16, 16, dtype, seed=32, init=True, N=len(lens))
    _compare_op("varlen", fwd(16), _ref_chunk(16), low, hi, dtype, cu_seqlens=cu)


@pytest.mark.parametrize("fuse_output", [True, False], ids=["o-in-pass", "o-kernel"])
def test_state_pass_beta_ahead_is_bit_identical(fuse_output):
    """The state pass that forms v_new from A, with beta loaded one chunk ahead (PREFETCH_BETA: where the pass is
    latency-bound, fast.chunk.state.state_prefetch_beta) or in its own chunk (the GPU's fused pass beyond one wave):
    the same bits, dense (odd T: a partial last chunk) and varlen (empty, one-token and multi-chunk sequences)."""
    def both(q, k, v, g, beta, h0, **kw):
        return [fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              chunk_size=16, fuse_output=fuse_output,
                                              configs={"state": {"PREFETCH_BETA": ahead}}, **kw)[:2]
                for ahead in (False, True)]
    low, _ = _inputs(2, 77, 1, 2, 32, 24, torch.float16, seed=41, init=True)
    (o0, s0), (o1, s1) = both(*low)
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    lens = [0, 1, 45, 70]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    low, _ = _inputs(1, sum(lens), 2, 4, 16, 16, torch.float16, seed=42, init=True, N=len(lens))
    (o0, s0), (o1, s1) = both(*low, cu_seqlens=cu)
    assert torch.equal(o0, o1) and torch.equal(s0, s1)


_STAGE_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                 pytest.param(torch.bfloat16, id="bf16")]         # (bf16 on CPU: conftest rounds its casts as a GPU)


@pytest.mark.parametrize("dtype", _STAGE_DTYPES)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("bt", [16, 32, 64])
def test_stage_state_output(bt, varlen, dtype):
    """Kernel 3 with steps 3-5 in it (state_output_wy: v_new from A and o in the pass, the forward's FROM_A +
    OUTPUT) against refgdn's w_u, state_passing and chunk_output; varlen: against refgdn per sequence. In 16-bit
    precisions too (the forward's fused path, whose 16-bit products and roundings only run there): the refgdn side
    runs on the same rounded inputs in that precision as refgdn's ops do (fp32 compute, o rounded), and A is
    rounded to the inputs' dtype on fast's side, as the forward stores it."""
    low, hi = _stage_inputs(bt, T=3 * bt, seed=bt + 5, dtype=dtype)

    def run(x, op, cu=None):
        q, k, v, g, beta, h0 = x
        low_dt = q.dtype
        if op is None and low_dt in (torch.float16, torch.bfloat16):   # refgdn in that precision: fp32 compute
            q, k, v = q.float(), k.float(), v.float()
        G = dr.chunk_cumsum(g, bt)
        A = dr.wy_repr(k, beta, G, bt)
        if op is not None:
            A = A.to(k.dtype)                                  # (the forward stores A in k's dtype)
            return op(q, k, v, beta, A, G, 0.3, bt, h0 if cu is None else h0[:1].expand(2, -1, -1, -1), cu)
        w, u = dr.w_u(k, v, beta, A, G, bt)
        h, vn, s = dr.state_passing(k, w, u, G, bt, h0)
        return dr.chunk_output(q, k, vn, h, G, 0.3, bt).to(low_dt), s

    if not varlen:
        (o, s), (o_r, s_r), (o_t, s_t) = run(low, fc.state_output_wy), run(low, None), run(hi, None)
    else:
        # sequences of 2 and 1 chunks, one after the other: [1, 3 bt] with cu_seqlens [0, 2 bt, 3 bt], both from
        # initial state h0[0]; the truth per sequence is the dense stages on it alone (chunk-aligned, as refgdn's
        # stages need)
        cu = torch.tensor([0, 2 * bt, 3 * bt], dtype=torch.int32, device=DEV)
        lo = [t[:1] for t in low]
        o, s = run(lo, fc.state_output_wy, cu)
        o = o[0]

        def per_seq(x):
            outs, states = [], []
            for a, b in ((0, 2 * bt), (2 * bt, 3 * bt)):
                xs = [t[:1, a:b] if i < 5 else t[:1] for i, t in enumerate(x)]
                oo, ss = run(xs, None)
                outs.append(oo[0])
                states.append(ss)
            return torch.cat(outs, 0), torch.cat(states, 0)
        (o_r, s_r), (o_t, s_t) = per_seq(lo), per_seq([t.double() for t in lo])
    _conform("o", o, o_r, o_t)
    _conform("final_state", s, s_r, s_t, dtype=dtype)                # (the floor of the inputs' precision)


@pytest.mark.parametrize("bt", [16, 64])
def test_stage_chunk_output(bt):
    low, hi = _stage_inputs(bt, seed=bt + 3)

    def run(x, op):
        q, k, v, g, beta, h0 = x
        G = dr.chunk_cumsum(g, bt)
        w, u = dr.w_u(k, v, beta, dr.wy_repr(k, beta, G, bt), G, bt)
        h, vn, _ = dr.state_passing(k, w, u, G, bt, h0)
        return op(q, k, vn, h, G, 0.3, bt)

    _conform("o", run(low, fc.chunk_output), run(low, dr.chunk_output), run(hi, dr.chunk_output))


# ------------------------------------------------------------------------------------ bad input

def _bad_cases():
    (q, k, v, g, beta, h0), _ = _inputs(1, 8, 2, 4, 16, 16, torch.float32, init=True)
    yield "k-shape", (q, k[:, :, :1], v, g, beta), {}
    yield "gva", (q, k, v[:, :, :3], g[..., :3], beta[..., :3]), {}
    yield "g-shape", (q, k, v, g[..., :2], beta), {}
    yield "dtype-mix", (q, k.half(), v, g, beta), {}
    yield "state-shape", (q, k, v, g, beta), dict(initial_state=h0[:, :2])
    yield "cu-B", (q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                   g.expand(2, -1, -1), beta.expand(2, -1, -1)), dict(cu_seqlens=torch.tensor([0, 8], device=DEV))
    yield "cu-end", (q, k, v, g, beta), dict(cu_seqlens=torch.tensor([0, 5], device=DEV))
    yield "cu-dtype", (q, k, v, g, beta), dict(cu_seqlens=torch.tensor([0., 8.], device=DEV))
    yield "A_log-alone", (q, k, v, g, beta), dict(A_log=torch.zeros(4, device=DEV))
    yield "scale", (q, k, v, g, beta), dict(scale="x")


@pytest.mark.parametrize("name,args,kw", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_input_same_error_as_refgdn(name, args, kw):
    h0 = kw.get("initial_state")
    before = h0.clone() if h0 is not None else None
    for f_op, r_op in ((fast.chunk_gated_delta_rule, refgdn.chunk_gated_delta_rule),
                       (fast.recurrent_gated_delta_rule, refgdn.recurrent_gated_delta_rule)):
        with pytest.raises(ValueError) as ref_err:
            r_op(*args, **kw)
        with pytest.raises(ValueError) as fast_err:
            f_op(*args, **kw)
        assert str(fast_err.value) == str(ref_err.value)
    if before is not None:
        assert torch.equal(before, h0)


def test_bad_chunk_size_and_head_dim():
    (q, k, v, g, beta), _ = _inputs(1, 8, 1, 1, 16, 16, torch.float32)
    for bt in (8, 48, True):  # refgdn's own check: same message
        with pytest.raises(ValueError) as ref_err:
            refgdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=bt)
        with pytest.raises(ValueError) as fast_err:
            fast.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=bt)
        assert str(fast_err.value) == str(ref_err.value)
    with pytest.raises(ValueError, match="chunk_size must be 16, 32 or 64"):
        fast.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=128)
    big = torch.zeros(1, 2, 1, 300, device=DEV)
    with pytest.raises(ValueError, match="head dims must be <= 256"):
        fast.chunk_gated_delta_rule(big, big, v[:, :2], g[:, :2], beta[:, :2])


@pytest.mark.parametrize("B, T, H, K, dtype", [
    pytest.param(1, 1, 1, 16, torch.float32, id="one-row"),
    pytest.param(2, 37, 3, 48, torch.float32, id="odd-T-K48"),        # rows not a multiple of the block, K padded
    pytest.param(1, 70, 2, 128, torch.bfloat16, id="bf16-K128"),
    pytest.param(3, 5, 4, 16, torch.float16, id="fp16"),
])
def test_row_scales_against_float64(B, T, H, K, dtype):
    """row_scales_kernel (q's l2norm row scales for the fused state pass): 1 / sqrt(sum(x^2) + eps) for every (b, t,
    h) of a strided x (every other head of a wider tensor, a batch stride that is not T times the token stride),
    against float64 on the same 16-bit values, within a few fp32 roundings; every row written."""
    from fast.chunk import row_scales
    from fast.chunk.common import L2NORM_EPS
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, T + 1, 2 * H, K, generator=gen).to(dtype).to(DEV)[:, 1:, ::2]    # (sliced on the device)
    assert x.stride(2) == 2 * K and x.stride(0) != T * x.stride(1)
    s = row_scales(x)
    want = torch.rsqrt((x.double() ** 2).sum(-1) + L2NORM_EPS)
    assert s.shape == (B, T, H) and s.dtype == torch.float32
    # bound: the K squares of 16-bit values are exact in fp32 (fp32 inputs: half an eps each), their fp32 sum is
    # within (K - 1) eps relative in any order, which the rsqrt halves; the GPU's rsqrt.approx adds ~2 eps
    rel = ((s.double() - want).abs() / want).max().item() / torch.finfo(torch.float32).eps
    assert rel <= (K - 1) / 2 + 3, f"max relative error {rel:.1f} eps"
    xd = x.double()                                                    # float64: l2norm(x) = s x, as the oracle's
    assert torch.equal(xd * row_scales(xd)[..., None], refgdn.l2norm(xd, L2NORM_EPS))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_update_x2_lowers_the_final_state_error(seed):
    """update_x2 (gdn_prefill's bf16 forward: the state update's decayed v_new in two bf16 terms instead of one):
    the final state's error against the float64 truth drops (CPU: 0.0086 -> 0.0066 at seed 0), o is not worse, and
    the two-term forward passes the conformance rule against refgdn in bf16 (one term: ratio 1.11-1.24 here, in the
    interpreter). Equal errors would mean the flag did nothing."""
    gen = torch.Generator().manual_seed(seed)
    T, H, HV, K, V = 256, 1, 2, 32, 32
    q, k = (torch.randn(1, T, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen) + 3)
    beta = torch.rand(1, T, HV, generator=gen).bfloat16()
    S0 = 0.3 * torch.randn(1, HV, K, V, generator=gen)
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    truth = refgdn.chunk_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)),
                                          **dict(kw, initial_state=S0.double()))
    ref = refgdn.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    errs = {}
    for x2 in (False, True):
        o, final = fc.chunk_gated_delta_rule_fwd(*(x.to(DEV) for x in (q, k, v, g, beta)), None, S0.to(DEV), True,
                                                 None, True, update_x2=x2)
        if x2:      # (one term fails the rule here in the interpreter, whose bf16 stores round toward zero)
            _conform("o", o, ref[0], truth[0])
            _conform("final", final, ref[1], truth[1], dtype=torch.bfloat16)
        errs[x2] = [float((t.cpu().double() - u).abs().max()) for t, u in ((o, truth[0]), (final, truth[1]))]
    assert errs[True][1] < errs[False][1], errs
    assert errs[True][0] <= errs[False][0], errs


def test_update_x2_needs_bf16():
    """The split is into bfloat16 terms: a float16 k would lose bits in it, so the launcher refuses."""
    q, k, v, g, beta, S0 = gdn_inputs(1, 32, 1, 2, 16, 16, dtype=torch.float16, device=DEV, init=True)
    with pytest.raises(ValueError, match="update_x2.*bfloat16"):
        fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, S0, True, None, True, update_x2=True)


# ----------------------------------------------------------------------------------------------
# fla 0.6.0's keywords
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fla_keywords_fast_passes_the_rule(op, dtype):
    """Beta as logits with allow_neg_eigval (beta in [0, 2)) and [N, HV, V, K] states (K != V), varlen: fast against
    refgdn by the rule (refgdn's meaning of the keywords is checked exactly in test_refgdn_delta_rule); the final
    state comes back [N, HV, V, K], contiguous."""
    low, hi = _inputs(1, 50, 1, 2, 16, 8, dtype, seed=23, init=True, N=2)
    gen = torch.Generator().manual_seed(24)
    logits = (2 * torch.randn(1, 50, 2, generator=gen)).to(dtype).to(DEV)
    h0 = low[5].transpose(-1, -2).contiguous()                        # [N, HV, V, K]
    low = low[:4] + [logits, h0]
    hi = [t.double() for t in low]
    kw = dict(cu_seqlens=torch.tensor([0, 17, 50], dtype=torch.int32, device=DEV), use_beta_sigmoid_in_kernel=True,
              allow_neg_eigval=True, state_v_first=True)
    extra = dict(chunk_size=16) if op == "chunk_gated_delta_rule" else {}
    _, s_f = _compare_op(f"{op}/fla-keywords", getattr(fast, op), getattr(refgdn, op), low, hi, dtype, **kw, **extra)
    assert s_f.shape == (2, 2, 8, 16) and s_f.is_contiguous()


@triton.jit
def _beta_of_probe(b, out, n, LOGITS: tl.constexpr, PRECISE: tl.constexpr, BN: tl.constexpr):
    o = tl.arange(0, BN)
    m = o < n
    tl.store(out + o, _beta_of(tl.load(b + o, mask=m, other=0.0), m, LOGITS, PRECISE), mask=m)


@pytest.mark.parametrize("precise", [False, True], ids=["tl-exp", "precise-exp"])
@pytest.mark.parametrize("logits", [1, 2], ids=["sigmoid", "neg-eigval"])
def test_beta_of_against_the_float64_sigmoid(logits, precise):
    """fast.chunk.common._beta_of, the one formula every kernel that reads beta as logits applies: by the rule
    against the float64 sigmoid (x 2), torch's float32 sigmoid as the oracle, far tails included (no overflow, no
    NaN: exp only of -|b|)."""
    gen = torch.Generator().manual_seed(33)
    b = torch.cat([8 * torch.randn(200, generator=gen), torch.tensor([-104.0, -88.0, -30.0, 0.0, 30.0, 88.0, 104.0])])
    b = b.to(DEV)
    out = torch.full_like(b, float("nan"))
    _beta_of_probe[(1,)](b, out, b.numel(), LOGITS=logits, PRECISE=precise, BN=256)
    assert torch.isfinite(out).all()
    _conform("beta", out, torch.sigmoid(b) * logits, torch.sigmoid(b.double()) * logits)


@pytest.mark.parametrize("logits", [1, 2], ids=["sigmoid", "neg-eigval"])
@pytest.mark.parametrize("path", ["fused", "unfused", "w-u", "no-prefetch"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_beta_logits_in_the_kernels(logits, path, varlen):
    """beta given as logits (fla's use_beta_sigmoid_in_kernel; gdn_prefill's raw b): kernel 1, the state pass (beta
    loaded one chunk ahead or not), and kernel 2 on its path each form sigmoid (x 2) after the load. The forward
    passes the rule against refgdn's float64 truth of sigmoid(logits) on every path, fused pass and unfused."""
    low, _ = _inputs(2 if not varlen else 1, 45, 1, 2, 16, 8, torch.float16, seed=31, init=True,
                     N=3 if varlen else None)
    q, k, v, g, _, h0 = low
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    b = (4 * torch.randn(B, T, HV, generator=torch.Generator().manual_seed(32))).to(torch.float16).to(DEV)
    cu = torch.tensor([0, 9, 9, 45], dtype=torch.int32, device=DEV) if varlen else None
    kw = dict(cu_seqlens=cu, chunk_size=16, fuse_output=path == "fused", from_a=path != "w-u",
              configs={"state": {"PREFETCH_BETA": path != "no-prefetch"}} if path != "w-u" else None)
    o, s = fc.chunk_gated_delta_rule_fwd(q, k, v, g, b, None, h0, True, beta_logits=logits, **kw)
    beta_r, beta_t = torch.sigmoid(b.float()) * logits, torch.sigmoid(b.double()) * logits
    rkw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    o_r, s_r = refgdn.chunk_gated_delta_rule(q, k, v, g, beta_r, **rkw)
    o_t, s_t = refgdn.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta_t,
                                             **dict(rkw, initial_state=h0.double()))
    _conform("o", o, o_r, o_t)
    _conform("final_state", s, s_r, s_t, dtype=torch.float16)


def test_final_v_first_writes_the_transposed_layout():
    """chunk_gated_delta_rule_fwd(final_v_first=True): the state pass writes the final state into [N, HV, V, K]
    storage through its strides; the values are the [K, V] call's, bit for bit (the same registers stored)."""
    low, _ = _inputs(2, 40, 1, 2, 16, 8, torch.float32, seed=25, init=True)
    q, k, v, g, beta, h0 = low
    _, s_kv = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, h0, True, chunk_size=16)
    _, s_vk = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, h0, True, chunk_size=16, final_v_first=True)
    assert s_vk.shape == s_kv.shape and s_vk.transpose(-1, -2).is_contiguous()
    assert torch.equal(s_vk, s_kv)


def test_strided_initial_state_reads_the_same_bits():
    """The state pass reads a contiguous [N, HV, K, V] initial state through K and V (fast.chunk.state._dense_state)
    and any other through its strides: the same values in padded rows, in [V, K] storage, or one head apart give
    the contiguous call's o and final state bit for bit."""
    low, _ = _inputs(2, 40, 1, 2, 16, 8, torch.float32, seed=26, init=True)
    q, k, v, g, beta, h0 = low
    assert h0.is_contiguous()
    want = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, h0, True, chunk_size=16)
    N, HV, K, V = h0.shape
    padded = torch.zeros(N, HV, K, V + 3, device=h0.device)[..., :V]          # row stride V + 3
    heads = torch.zeros(N, 2 * HV, K, V, device=h0.device)[:, ::2]             # head stride 2 K V
    for view in (padded.copy_(h0), h0.transpose(-1, -2).contiguous().transpose(-1, -2), heads.copy_(h0)):
        assert not view.is_contiguous()
        got = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, view, True, chunk_size=16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(DEV != "cuda", reason="fla's kernels run on a GPU only")
def test_fla_keywords_mean_what_fla_0_6_means():
    """The same call with fla 0.6.0's keywords through fla itself: fla's results pass the conformance rule against
    refgdn's float64 truth of our reading of the keywords (a transposed state or an unscaled beta would not), as
    fast's do. bf16, varlen, K != V."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    low, hi = _inputs(1, 300, 2, 4, 128, 64, torch.bfloat16, seed=26, init=True, N=3)
    logits = (2 * torch.randn(1, 300, 4, generator=torch.Generator().manual_seed(27))).to(torch.bfloat16).to(DEV)
    h0 = low[5].transpose(-1, -2).contiguous()                        # [N, HV, V, K]
    low = low[:4] + [logits, h0]
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.tensor([0, 100, 101, 300], dtype=torch.long, device=DEV),
              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True)
    q, k, v, g, b = low[:5]
    o_t, s_t = refgdn.chunk_gated_delta_rule(*(t.double() for t in low[:5]), **dict(kw, initial_state=h0.double()))
    o_r, s_r = refgdn.chunk_gated_delta_rule(q, k, v, g, b, **kw)
    for name, impl in (("fast", fast.chunk_gated_delta_rule), ("fla", fla.chunk_gated_delta_rule)):
        o, s = impl(q, k, v, g, b, **kw)
        assert s.shape == (3, 4, 64, 128)
        _conform(f"{name}/o", o, o_r, o_t)
        _conform(f"{name}/final_state", s, s_r, s_t, dtype=torch.bfloat16)


def test_fused_state_pass_fits_two_programs_per_sm_on_sm90():
    """Fresh process, the stand-in sm_90 driver (benchmarks/sm90.py: Triton's real compile, nothing runs): every fused
    state-pass variant the rules pick (beta bf16, float32 or bf16 logits; l2norm in the kernel or not; dense B=4 and
    a 16-sequence varlen call at Qwen3-Next's heads) takes at most fast.chunk.state.SMEM_TWO_PER_SM bytes of shared
    memory, so two programs share an SM as the pinned config assumes. One pipelined 4-byte copy more per chunk
    crosses it and halves the pass's occupancy: a float32 beta loaded in its own chunk beside L2NORM's row scales
    took 115716 B and ran ~2x slower on an H200 (RESULTS.md, 2026-11-27); the script reports that variant too."""
    from tests.test_launch import _run_stand_in
    _run_stand_in("""
        import torch
        import fast.chunk as fc
        from fast.chunk.state import SMEM_TWO_PER_SM
        fc.state._num_sms = lambda device: 132                      # an H100 SXM / H200
        seen = []
        def on_compile(name, kernel):
            if name == "chunk_state_kernel":
                seen.append(kernel.metadata.shared)
        real = sys.modules["triton.runtime.jit"].JITFunction.run
        def recording(self, *a, **k):
            kernel = real(self, *a, **k)
            on_compile(self.__name__, kernel)
            return kernel
        sys.modules["triton.runtime.jit"].JITFunction.run = recording
        K = V = 128
        x = lambda *s: torch.randn(*s).to(torch.bfloat16)
        picked = []
        for N in (None, 16):                                        # dense B=4; varlen, 16 sequences
            B, T = (4, 128) if N is None else (1, 16 * 64)
            cu = torch.arange(0, T + 1, T // N) if N else None
            for l2 in (True, False):
                for beta, extra in ((torch.rand(B, T, 32).to(torch.bfloat16), {}), (torch.rand(B, T, 32), {}),
                                    (torch.randn(B, T, 32).to(torch.bfloat16), dict(beta_logits=1))):
                    n0 = len(seen)
                    fc.chunk_gated_delta_rule_fwd(x(B, T, 16, K), x(B, T, 16, K), x(B, T, 32, V),
                                                  -torch.rand(B, T, 32), beta,
                                                  initial_state=torch.randn(N or B, 32, K, V),
                                                  output_final_state=True, cu_seqlens=cu, chunk_size=64,
                                                  use_qk_l2norm_in_kernel=l2, **extra)
                    assert len(seen) == n0 + 1, (N, l2, beta.dtype, seen[n0:])
                    picked.append(((N, l2, str(beta.dtype), bool(extra)), seen[-1]))
        over = [p for p in picked if p[1] > SMEM_TWO_PER_SM]
        assert not over, (over, SMEM_TWO_PER_SM)
        n0 = len(seen)
        fc.chunk_gated_delta_rule_fwd(x(4, 128, 16, K), x(4, 128, 16, K), x(4, 128, 32, V), -torch.rand(4, 128, 32),
                                      torch.rand(4, 128, 32), output_final_state=True, chunk_size=64,
                                      use_qk_l2norm_in_kernel=True, configs={"state": {"PREFETCH_BETA": False}})
        print("picked", picked, "float32 beta in its chunk beside l2norm:", seen[n0:], "limit", SMEM_TWO_PER_SM)
        print("OK")
    """)


@pytest.mark.skipif(DEV != "cuda", reason="a GPU compiler fault: the interpreter has no such variant")
@pytest.mark.parametrize("row", [pytest.param(36, id="row36"), pytest.param(40, id="row40"),
                                 pytest.param(136, id="row136"), pytest.param(48, id="row48-aligned")])
def test_state_pass_k_rows_not_16_aligned_gpu(row):
    """k as a view whose row stride is not a multiple of 16 elements (a fused projection's slice): Triton 3.6
    compiled the unfused state pass with v_new from A (BV 16, 4 warps, K = 32, BT 64) into a kernel that faulted or
    returned a wrong o (fast.chunk.common._rows16). The state pass now reads an aligned copy of such a k: o and the
    final state bit for bit those of the call with k contiguous (the quick conformance family "strided-slices"'
    geometry, bf16)."""
    B, T, H, HV, K, V = 2, 63, 1, 2, 32, 32
    (q, k, v, g, beta, S0), _ = _inputs(B, T, H, HV, K, V, torch.bfloat16, init=True)
    buf = torch.zeros(B, T, H, row, dtype=k.dtype, device=DEV)
    k_view = buf[..., :K]
    k_view.copy_(k)
    assert k_view.stride(1) == H * row and not torch.equal(torch.tensor(k_view.stride()), torch.tensor(k.stride()))
    got = fast.chunk_gated_delta_rule(q, k_view, v, g, beta, initial_state=S0, output_final_state=True,
                                      chunk_size=64)
    want = fast.chunk_gated_delta_rule(q, k.contiguous(), v, g, beta, initial_state=S0, output_final_state=True,
                                       chunk_size=64)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("shape,row,offset,copied", [
    pytest.param((2, 63, 1, 32), 136, 64, True, id="fused-projection-slice"),
    pytest.param((1, 5, 3, 40), 40, 0, True, id="contiguous-K40"),
    pytest.param((2, 7, 2, 32), 32, 4, True, id="contiguous-base-8B-off"),
    pytest.param((2, 7, 2, 32), 48, 0, False, id="aligned-view"),
    pytest.param((2, 7, 2, 32), 32, 0, False, id="contiguous"),
])
def test_rows16_layout(shape, row, offset, copied):
    """fast.chunk.common._rows16 (the state pass's k on a GPU; its layout logic checked here on CPU tensors): a tensor
    whose strides but the last are multiples of 16 elements, on a 16-byte aligned base, comes back as itself; any
    other comes back as a copy with the same values and shape whose strides and base are."""
    from fast.chunk.common import _rows16
    B, T, H, K = shape
    buf = torch.randn(B * T * H * row + offset).to(torch.bfloat16)
    x = buf[offset:offset + B * T * H * row].view(B, T, H, row)[..., :K]
    y = _rows16(x, cuda_only=False)
    assert torch.equal(y, x) and y.shape == x.shape and y.stride(-1) == 1
    assert (y is not x) == copied
    assert y.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in y.stride()[:-1])
    assert _rows16(x) is x                                  # a CPU tensor: nothing to do (cuda_only)
