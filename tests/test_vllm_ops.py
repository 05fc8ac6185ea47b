"""The ops vLLM calls (refgdn.vllm_ops, fast.vllm_ops): the serving form of the recurrent op, whose states live in
a slot pool read and written in place (ssm_state_indices [N] or [N, L], num_accepted_tokens), and the chunk op in
vLLM's argument order.

refgdn's op against the simplest form (refgdn.recurrent_gated_delta_rule over each sequence from its gathered state,
float64); fast's against refgdn by the conformance rule (fast's error against refgdn's float64 truth at most twice
refgdn's own in the same precision, on the same rounded inputs; untouched slots and padded outputs exact): those
checks are conformance.cases_vllm's, run on every family below by the quick matrix (`python -m conformance --quick`,
the first half of the README's test command) and here only where a test needs more than the rule. The bad inputs of
both packages raise before any slot is written.
"""
import functools
import re

import pytest
import torch

import fast
import fast.vllm_ops as FV
import refgdn
import refgdn.vllm_ops as RV
from conformance.cases_vllm import (conv_families, conv_fn_families, conv_fn_problem, conv_problem, families,
                                   packed_families, packed_problem, packed_run, post_conv_families, post_conv_problem,
                                   problem, run as _run, sigmoid_families, sigmoid_inputs)
from conformance.core import Check, evaluate
from tests.helpers import gdn_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32
D64 = torch.float64
S = 9                    # slots in the pool


def _pool(HV, K, V, dtype, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(S, HV, K, V, generator=gen)).to(device=DEV, dtype=dtype)


def _t(x, dtype=I32):
    return torch.tensor(x, dtype=dtype, device=DEV)


LAYOUTS = [pytest.param(p, id=name) for name, p in families(quick=True, device=DEV).items()]


def _problem(p, dtype):
    return problem(p, dtype, DEV)


@pytest.mark.parametrize("p", LAYOUTS)
def test_refgdn_equals_the_time_loop_over_gathered_states(p):
    """float64: each sequence's outputs are refgdn.recurrent_gated_delta_rule's from its read state, every written slot
    holds the state after its token (a recurrent call over the prefix), every other slot is untouched."""
    xs, pool, kw = _problem(p, torch.float64)
    pool = None if pool is None else pool.double()
    o, fs, after = _run(RV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    null = p.get("null", -1)                          # entries <= null: padding
    if p.get("layout") == "vk":                       # every state [.., HV, V, K]: compared as [.., HV, K, V] views
        pool, after, fs = (None if x is None else x.transpose(-1, -2) for x in (pool, after, fs))
    B, T = p["B"], p["T"]
    cu = p.get("cu") or [n * T for n in range(B + 1)]
    flat = [x.reshape(B * T, *x.shape[2:])[None] for x in xs]
    o = o.reshape(1, B * T, *o.shape[2:])
    written = set()
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        row = None if p.get("idx") is None else (p["idx"][n] if isinstance(p["idx"][n], list) else [p["idx"][n]])
        col = p["acc"][n] - 1 if p.get("acc") else 0
        read = n if row is None else row[col]
        if read <= null:
            assert torch.equal(o[0, bos:eos], torch.zeros_like(o[0, bos:eos]))
            continue
        h0 = None if pool is None else pool[read][None]
        for t in range(bos, eos):           # the prefix ending at token t
            o_t, s_t = refgdn.recurrent_gated_delta_rule(*(x[:, bos:t + 1] for x in flat), scale=kw["scale"],
                                                         initial_state=h0, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"])
            torch.testing.assert_close(o[0, t], o_t[0, -1], rtol=1e-12, atol=1e-12)
            if not kw["inplace_final_state"]:
                torch.testing.assert_close(fs[t], s_t[0], rtol=1e-12, atol=1e-12)
                continue
            if row is not None and isinstance(p["idx"][n], list):
                dest = row[t - bos]                                   # one slot per token
            else:
                dest = read if t == eos - 1 else -1                   # the final state, where it was read
            if dest > null:
                torch.testing.assert_close(after[dest], s_t[0], rtol=1e-12, atol=1e-12)
                written.add(dest)
    if pool is not None:
        for s in range(pool.shape[0]):
            if s not in written:
                assert torch.equal(after[s], pool[s]), f"slot {s} written"
    if kw["inplace_final_state"]:
        assert fs.data_ptr() == after.data_ptr() and fs.shape == after.shape


@pytest.mark.parametrize("p", LAYOUTS)
def test_fast_returns_vllms_outputs_and_state(p):
    """The returned output is shaped and typed as v, and the returned state is the pool itself when written in place
    (else one state per token). Their values: conformance.cases_vllm's checks, which the quick matrix runs on every
    family of LAYOUTS in fp32, fp16 and bf16 (`python -m conformance --quick --ops
    vllm_fused_recurrent_gated_delta_rule`, part of the README's test command)."""
    xs, pool, kw = _problem(p, torch.float32)
    o, fs, after = _run(FV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    assert o.dtype == xs[2].dtype and o.shape == xs[2].shape
    HV, K, V = xs[2].shape[2], xs[0].shape[3], xs[2].shape[3]
    dims = (V, K) if p.get("layout") == "vk" else (K, V)
    assert fs is after if kw["inplace_final_state"] else fs.shape == (p["B"] * p["T"], HV, *dims)


@pytest.mark.parametrize("p", [lay for lay in LAYOUTS if lay.values[0].get("idx") is not None])
def test_refgdn_computes_in_float64_when_the_pool_is(p):
    """One compute-dtype rule for the serving ops: float32 inputs on a float64 pool compute in float64 (the packed
    decode's and SGLang's rule), so they give the float64 inputs' outputs rounded once and the same slots exactly."""
    xs, pool, kw = _problem(p, torch.float32)
    o32, _, after32 = _run(RV.fused_recurrent_gated_delta_rule, xs, pool.double(), kw)
    o64, _, after64 = _run(RV.fused_recurrent_gated_delta_rule, [x.double() for x in xs], pool.double(), kw)
    assert o32.dtype == torch.float32 and torch.equal(o32, o64.float())
    assert torch.equal(after32, after64)


def test_beta_none_is_ones_and_the_chunk_op_in_vllms_order():
    """beta None means ones (one per value head, GVA included); vLLM's chunk order (head_first 10th) is fast's op."""
    q, k, v, g, beta, h0 = gdn_inputs(1, 12, 1, 2, 16, 16, seed=3, dtype=torch.float32, device=DEV, init=True, N=2)
    cu = _t([0, 5, 12])
    idx = _t([1, 4])
    a = FV.fused_recurrent_gated_delta_rule(q, k, v, g, None, None, _pool(2, 16, 16, torch.float32), True, cu, idx)
    b = FV.fused_recurrent_gated_delta_rule(q, k, v, g, torch.ones_like(beta), None, _pool(2, 16, 16, torch.float32),
                                            True, cu, idx)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    want = fast.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, cu, True)
    got = FV.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, cu, False, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = RV.chunk_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)), None, h0.double(), True, cu, False, True)
    assert ref[0].dtype == torch.float64 and ref[1].shape == want[1].shape


def test_keys_equal_the_launches():
    """fast.keys.vllm_ops predicts the kernels each call launches (traced_ops raises on a mismatch)."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, recording, traced_ops
    F = traced_ops(FV, keys=fk.vllm_ops)
    log = KeyLog()
    with recording(log):
        for p in (LAYOUTS[0].values[0], LAYOUTS[1].values[0], LAYOUTS[3].values[0], LAYOUTS[4].values[0]):
            xs, pool, kw = _problem(p, torch.float32)
            F.fused_recurrent_gated_delta_rule(*xs, initial_state=pool, **kw)
        for p in (LAYOUTS[0].values[0], LAYOUTS[1].values[0]):    # a bf16 pool (vLLM's default): its own config
            xs, pool, kw = _problem(p, torch.float32)
            F.fused_recurrent_gated_delta_rule(*xs, initial_state=pool.to(torch.bfloat16), **kw)
        vk = [lay.values[0] for lay in LAYOUTS if lay.values[0].get("layout") == "vk"]
        for p in vk:                # newer vLLM's [.., HV, V, K] states and null block: SLOT_LO 1, transposed strides
            xs, pool, kw = _problem(p, torch.float32)
            F.fused_recurrent_gated_delta_rule(*xs, initial_state=pool, **kw)
        a = torch.randn(3, 2, device=DEV)
        F.fused_gdn_gating(torch.rand(2, device=DEV), a, a, torch.randn(2, device=DEV))
        for p in conv_families(quick=True, device=DEV).values():
            x, state, w, b, kw = conv_problem(p, torch.float32, DEV)
            F.causal_conv1d_update(x, state, w, b, **kw)
        x, w, b, states, kw = conv_fn_problem(conv_fn_families(True, DEV)["prefill-mixed-padded-empty"],
                                              torch.float32, DEV)
        F.causal_conv1d_fn(x, w, b, states, **kw)
    writes = [dict(key.constexprs)["WRITE"] for key in log.launched[:6]]
    assert len(vk) == 4 and [dict(key.constexprs)["SLOT_LO"] for key in log.launched[6:10]] == [1, 1, 1, 0]
    assert [key.kernel for key in log.launched] == (["recurrent_slots_kernel"] * 10 + ["gdn_gating_kernel"]
                                                    + ["conv_update_slots_kernel"] * len(conv_families(True, DEV))
                                                    + ["vllm_conv_rows_kernel", "chunk_table_kernel",
                                                       "causal_conv1d_fwd_window_kernel",
                                                       "causal_conv1d_final_state_kernel"])
    assert writes == [1, 2, 3, 3, 1, 2]


def _decode_call(T=6):
    q, k, v, g, beta = gdn_inputs(1, T, 1, 2, 16, 16, seed=2, dtype=torch.float32, device=DEV)
    return [q, k, v, g, beta], dict(cu_seqlens=_t([0, 3, T]), ssm_state_indices=_t([[0, 1, 2], [3, 4, 5]]),
                                    num_accepted_tokens=_t([1, 2]))


BAD = [
    pytest.param(lambda xs, kw: kw.update(retrieve_parent_token=_t([[0, 0, 1]] * 2)), "retrieve_parent_token",
                 id="tree-drafts"),
    pytest.param(lambda xs, kw: xs.__setitem__(4, xs[4][..., None].expand(*xs[4].shape, 16)), "head-wise beta",
                 id="headwise-beta"),
    pytest.param(lambda xs, kw: kw.update(ssm_state_indices=_t([0, 1, 2])), "ssm_state_indices must be [N]",
                 id="indices-wrong-N"),
    pytest.param(lambda xs, kw: kw.update(ssm_state_indices=kw["ssm_state_indices"].float()), "int32 or int64",
                 id="indices-float"),
    pytest.param(lambda xs, kw: kw.update(num_accepted_tokens=_t([1, 2, 3])), "num_accepted_tokens must have shape",
                 id="accepted-wrong-N"),
    pytest.param(lambda xs, kw: kw.update(ssm_state_indices=_t([0, 3])), "needs ssm_state_indices [N, L]",
                 id="accepted-with-1d-indices"),
    pytest.param(lambda xs, kw: kw.update(initial_state="pool"), "initial_state must be a torch.Tensor",
                 id="pool-not-a-tensor"),
    pytest.param(lambda xs, kw: kw.update(initial_state=torch.zeros(S, 2, 16, 8, device=DEV)),
                 "slot pool [S, HV, K, V]", id="pool-wrong-V"),
    pytest.param(lambda xs, kw: kw.update(inplace_final_state=1), "inplace_final_state must be a bool",
                 id="inplace-not-bool"),
    pytest.param(lambda xs, kw: xs.__setitem__(3, xs[3][:, :, :1]), "g must have shape", id="g-wrong-HV"),
    pytest.param(lambda xs, kw: kw.update(state_layout="kv-major"), "state_layout must be 'kv'", id="layout-unknown"),
    pytest.param(lambda xs, kw: kw.update(state_layout="vk", initial_state=torch.zeros(S, 2, 16, 8, device=DEV)),
                 "slot pool [S, HV, V, K] = [S >= 1, 2, 16, 16]", id="vk-pool-wrong-V"),
    pytest.param(lambda xs, kw: kw.update(null_block_id=-2), "null_block_id must be an int >= -1", id="null-below"),
    pytest.param(lambda xs, kw: kw.update(null_block_id=True), "null_block_id must be an int", id="null-bool"),
]


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", BAD)
def test_bad_inputs_raise_before_any_write(pkg, bad, words):
    xs, kw = _decode_call()
    pool = _pool(2, 16, 16, torch.float32)
    kw["initial_state"] = pool
    bad(xs, kw)
    before = pool.clone()
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        pkg.fused_recurrent_gated_delta_rule(*xs, **kw)
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="pass initial_state"):       # inplace needs somewhere to write
        pkg.fused_recurrent_gated_delta_rule(*_decode_call()[0], cu_seqlens=_t([0, 3, 6]))


BAD_VALUES = [
    pytest.param(dict(ssm_state_indices=[[0, 1, 2], [3, 4, S]]), r"ssm_state_indices\[1, 2\] = 9 is out of range",
                 id="slot-past-the-pool"),
    pytest.param(dict(num_accepted_tokens=[0, 1]), r"num_accepted_tokens\[0\] = 0 must be in \[1, L = 3\]",
                 id="accepted-zero"),
    pytest.param(dict(num_accepted_tokens=[1, 4]), r"num_accepted_tokens\[1\] = 4", id="accepted-past-L"),
    pytest.param(dict(ssm_state_indices=[[0, 1, 2], [3, 1, 5]]), "slot 1 is written by sequences 0 and 1",
                 id="two-sequences-write-one-slot"),
    pytest.param(dict(ssm_state_indices=[[0, 1, 2], [3, 4, 5]], num_accepted_tokens=[1, 1],
                      cu_seqlens=[0, 2, 6]), "has 4 tokens but", id="more-tokens-than-slots"),
    pytest.param(dict(T=4, cu_seqlens=[0, 2, 4], ssm_state_indices=[[0, 1, 7], [3, 7, 5]], num_accepted_tokens=[3, 1]),
                 "slot 7 is read by sequence 0 and written by sequence 1", id="read-while-another-writes"),
    pytest.param(dict(ssm_state_indices=[[0, 2, 0], [3, 2, 0]], num_accepted_tokens=[2, 1], null_block_id=0),
                 "slot 2 is written by sequences 0 and 1", id="null-block-repeats-a-real-slot-does-not"),
]


@pytest.mark.parametrize("bad,words", BAD_VALUES)
def test_bad_slot_values(bad, words):
    """refgdn always checks the slot values; fast with check_values=True (the same words); both before any write."""
    bad = dict(bad)
    xs, kw = _decode_call(bad.pop("T", 6))
    for name, val in bad.items():
        kw[name] = val if isinstance(val, int) else _t(val)
    for pkg, extra in ((RV, {}), (FV, dict(check_values=True))):
        pool = _pool(2, 16, 16, torch.float32)
        before = pool.clone()
        with pytest.raises(ValueError, match=words):
            pkg.fused_recurrent_gated_delta_rule(*xs, initial_state=pool, **kw, **extra)
        assert torch.equal(pool, before)


def test_fast_is_memory_safe_on_unchecked_values():
    """Without check_values the kernel never reads or writes outside the pool: a read slot past it pads its
    sequence (zeros, nothing written), a write slot past it is skipped, an accepted count past L is clamped."""
    xs, kw = _decode_call()
    pool = _pool(2, 16, 16, torch.float32)
    kw.update(ssm_state_indices=_t([[S + 3, 1, 2], [3, S, 5]]), num_accepted_tokens=_t([1, 7]))
    o, fs, after = _run(FV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    assert torch.equal(o[0, :3], torch.zeros_like(o[0, :3]))               # sequence 0 padded: read slot past S
    assert o[0, 3:].abs().max() > 0                                        # sequence 1 starts from slot 5 (L = 3)
    ref_kw = dict(kw, ssm_state_indices=_t([[-1, 1, 2], [3, -1, 5]]), num_accepted_tokens=_t([1, 3]))
    o_r, _, after_r = _run(RV.fused_recurrent_gated_delta_rule, xs, pool, ref_kw)
    torch.testing.assert_close(o, o_r)
    assert torch.equal(after[[0, 1, 2, 4, 6, 7, 8]], pool[[0, 1, 2, 4, 6, 7, 8]])


def test_twins_have_one_signature():
    import inspect
    for name in RV.__all__:
        assert inspect.signature(getattr(FV, name)) == inspect.signature(getattr(RV, name)), name


@pytest.mark.parametrize("p", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[3]])
def test_fast_reads_nothing_back_unless_asked(p):
    """Without check_values the op reads no value to the host (vLLM calls it inside CUDA graphs: a read there is a
    sync that capture forbids): refgdn.capture's host guards raise on any; with check_values they see the reads."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    xs, pool, kw = _problem(p, torch.float32)
    with capture_guards("vllm_ops", DEV):
        _run(FV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("vllm_ops", DEV):
            _run(FV.fused_recurrent_gated_delta_rule, xs, pool, dict(kw, check_values=True))


def test_fast_clamps_unchecked_offsets():
    """Offsets past T or decreasing (unchecked: no host read) never take the kernel outside q / o: each sequence's
    range is clamped to [0, T] with bos <= eos; the same call with check_values=True raises."""
    xs, kw = _decode_call()
    pool = _pool(2, 16, 16, torch.float32)
    kw.update(cu_seqlens=_t([0, 5, 40]), ssm_state_indices=_t([1, 4]))
    kw.pop("num_accepted_tokens")
    o, fs, after = _run(FV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    o_r, fs_r, after_r = _run(RV.fused_recurrent_gated_delta_rule, xs, pool, dict(kw, cu_seqlens=_t([0, 5, 6])))
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(after, after_r)
    with pytest.raises(ValueError, match="cu_seqlens must end at T=6"):
        _run(FV.fused_recurrent_gated_delta_rule, xs, pool, dict(kw, check_values=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
@pytest.mark.parametrize("p", [LAYOUTS[0], LAYOUTS[1]])
def test_cuda_graph_replay_equals_eager(p):
    """Captured once, replayed on new inputs copied into the static buffers: bit for bit the eager call's outputs and
    pool, round after round (the pool carries over)."""
    xs, pool, kw = _problem(p, torch.bfloat16)
    static = [x.clone() for x in xs]
    g_pool, e_pool = pool.clone(), pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        FV.fused_recurrent_gated_delta_rule(*static, initial_state=g_pool.clone(), **kw)      # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, _ = FV.fused_recurrent_gated_delta_rule(*static, initial_state=g_pool, **kw)
    for rnd in range(3):
        new, _, _ = problem(p, torch.bfloat16, DEV, seed=10 + rnd)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        o_e, _ = FV.fused_recurrent_gated_delta_rule(*new, initial_state=e_pool, **kw)
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_e) and torch.equal(g_pool, e_pool), rnd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [pytest.param((5, 6), id="N-HV"), pytest.param((2, 3, 4), id="B-T-HV")])
def test_fused_gdn_gating_in_vllms_order(shape, dtype):
    """vLLM's fused_gdn_gating(A_log, a, b, dt_bias): gdn_gating's values, [1, N, HV] for 2-D inputs; fast by the rule
    against refgdn in float64 (a + dt_bias across softplus' threshold, b saturating sigmoid)."""
    gen = torch.Generator().manual_seed(8)
    HV = shape[-1]
    a, b = (12 * torch.randn(2, *shape, generator=gen)).to(dtype).to(DEV)
    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen)).to(DEV)
    dt_bias = (4 * torch.randn(HV, generator=gen)).to(DEV)
    want = (1, *shape) if len(shape) == 2 else shape
    g_f, b_f = FV.fused_gdn_gating(A_log, a, b, dt_bias)
    g_r, b_r = RV.fused_gdn_gating(A_log, a, b, dt_bias)
    g_t, b_t = RV.fused_gdn_gating(A_log.double(), a.double(), b.double(), dt_bias.double())
    assert g_f.shape == b_f.shape == want and g_f.dtype == torch.float32 and b_f.dtype == dtype
    g0, b0 = fast.gdn_gating(A_log, a, dt_bias, b)
    assert torch.equal(g_f.reshape(g0.shape), g0) and torch.equal(b_f.reshape(b0.shape), b0)
    for name, f, t, r in (("g", g_f, g_t, g_r), ("beta", b_f, b_t, b_r)):
        res = evaluate(Check(name, f, t, r))
        assert res["passed"], (name, res)
    for pkg in (RV, FV):
        with pytest.raises(ValueError, match="beta .softplus' sharpness. must be 1.0"):
            pkg.fused_gdn_gating(A_log, a, b, dt_bias, beta=2.0)
        with pytest.raises(ValueError, match="threshold .softplus' linear cut-off. must be 20.0"):
            pkg.fused_gdn_gating(A_log, a, b, dt_bias, threshold=30.0)
        with pytest.raises(ValueError, match=r"a must be \[N, HV\] or \[B, T, HV\]"):
            pkg.fused_gdn_gating(A_log, a.reshape(-1), b.reshape(-1), dt_bias)



# ------------------------------------------------------------------------------ the packed decode (newer vLLM)

PACKED = [pytest.param(p, id=name) for name, p in packed_families(quick=True, device=DEV).items()]
PACKED_OP = "fused_recurrent_gated_delta_rule_packed_decode"


def _packed(p, dtype=torch.float32, seed=0):
    return packed_problem(p, dtype, DEV, seed)


@pytest.mark.parametrize("p", PACKED)
def test_packed_refgdn_equals_the_step_written_out(p):
    """float64: each live request's output and new slot are one step of the rule written out here (the gates, the
    l2norm, the state transposed as vLLM stores it); null requests' outputs are zeros; every other slot is untouched."""
    args = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in _packed(p)]
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = args
    out, after = packed_run(RV.fused_recurrent_gated_delta_rule_packed_decode, args)
    HV, V, K = pool.shape[1:]
    H = (x.shape[1] - HV * V) // (2 * K)
    scale = K ** -0.5 if scale is None else scale
    for n, s in enumerate(p["idx"]):
        if s <= 0:
            assert torch.equal(out[n], torch.zeros_like(out[n]))
            continue
        for h in range(HV):
            hk = h // (HV // H)
            q, k = x[n, hk * K:(hk + 1) * K], x[n, (H + hk) * K:(H + hk + 1) * K]
            v = x[n, 2 * H * K + h * V:2 * H * K + (h + 1) * V]
            if l2:
                q, k = q / torch.sqrt(q @ q + 1e-6), k / torch.sqrt(k @ k + 1e-6)
            g = -torch.exp(A_log[h]) * torch.nn.functional.softplus(a[n, h] + dt_bias[h])
            beta = torch.sigmoid(b[n, h])
            state = torch.exp(g) * pool[s, h].T                       # [K, V]
            state = state + torch.outer(k, beta * (v - state.T @ k))
            torch.testing.assert_close(out[n, 0, h], scale * state.T @ q, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(after[s, h], state.T, rtol=1e-12, atol=1e-12)
    for s in range(pool.shape[0]):
        if s not in p["idx"]:
            assert torch.equal(after[s], pool[s]), f"slot {s} written"


def test_packed_equals_vllms_two_op_decode():
    """The packed op is vLLM's older decode in one launch: fused_gdn_gating, then fused_recurrent_gated_delta_rule on
    the same pool seen as [S, HV, K, V] with the null requests' slots as -1 (fp32: equal to rounding)."""
    p = dict(idx=[5, 0, 2, 7, 3], H=2, HV=4, K=16, V=24, l2=True)
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = _packed(p)
    out, after = packed_run(FV.fused_recurrent_gated_delta_rule_packed_decode, [x, a, b, A_log, dt_bias, scale, pool,
                                                                                idx, l2])
    H, HV, K, V = 2, 4, 16, 24
    g, beta = FV.fused_gdn_gating(A_log, a, b, dt_bias)
    q, k, v = (t.reshape(1, -1, *shape) for t, shape in ((x[:, :H * K], (H, K)), (x[:, H * K:2 * H * K], (H, K)),
                                                          (x[:, 2 * H * K:], (HV, V))))
    pool2 = pool.clone()
    o2, _ = FV.fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, pool2.transpose(-1, -2), True,
                                                torch.arange(6, dtype=I32, device=DEV), torch.where(idx > 0, idx, -1),
                                                use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, o2.reshape(out.shape))
    torch.testing.assert_close(after, pool2)


PACKED_BAD = [
    pytest.param(lambda c: c.update(x=c["x"][:, 1:]), r"mixed_qkv must be \[B, 2 H K \+ HV V\]", id="qkv-width"),
    pytest.param(lambda c: c.update(x=torch.zeros(3, 3 * 2 * 16 + 2 * 16, device=DEV)), "must divide HV",
                 id="H-not-dividing-HV"),
    pytest.param(lambda c: c.update(a=c["a"][:, :1]), r"a must have shape \[B, HV\]", id="a-wrong-HV"),
    pytest.param(lambda c: c.update(A_log=c["A_log"][None]), r"A_log must have shape \[HV\]", id="A_log-2d"),
    pytest.param(lambda c: c.update(out=c["out"][:, 0]), r"out must have shape \[B, 1, HV, V\]", id="out-3d"),
    pytest.param(lambda c: c.update(out=torch.zeros(3, 1, 16, 2, device=DEV).transpose(2, 3)),
                 "out must be contiguous", id="out-strided"),
    pytest.param(lambda c: c.update(idx=c["idx"].float()), "int32 or int64", id="indices-float"),
    pytest.param(lambda c: c.update(idx=c["idx"][:2]), r"ssm_state_indices must have shape \[B\]",
                 id="indices-wrong-B"),
    pytest.param(lambda c: c.update(pool=c["pool"][0]), "initial_state must be 4-D", id="pool-3d"),
    pytest.param(lambda c: c.update(l2=1), "use_qk_l2norm_in_kernel must be a bool", id="l2-not-bool"),
]


def _packed_case(idx=(4, 0, 1)):
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = _packed(dict(idx=list(idx)))
    return dict(x=x, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool, idx=idx, l2=l2,
                out=torch.zeros(len(idx), 1, 2, 16, device=DEV))


def _packed_call(pkg, c, **kw):
    return getattr(pkg, PACKED_OP)(c["x"], c["a"], c["b"], c["A_log"], c["dt_bias"], None, c["pool"], c["out"],
                                   c["idx"], c["l2"], **kw)


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", PACKED_BAD)
def test_packed_bad_inputs_raise_before_any_write(pkg, bad, words):
    c = _packed_case()
    bad(c)
    before, out_before = c["pool"].clone(), c["out"].clone()
    with pytest.raises(ValueError, match=words):
        _packed_call(pkg, c)
    assert torch.equal(c["pool"], before) and torch.equal(c["out"], out_before)


@pytest.mark.parametrize("idx,words", [
    pytest.param((4, 0, S), r"ssm_state_indices\[2\] = 9 is outside the pool's 9 slots", id="slot-past-the-pool"),
    pytest.param((4, 0, 4), "slot 4 is given to requests 0 and 2", id="two-requests-one-slot"),
])
def test_packed_bad_slot_values(idx, words):
    """refgdn always checks the slots; fast with check_values=True (the same words); both before any write. Several
    null entries (0, negative) are fine: they touch nothing."""
    for pkg, extra in ((RV, {}), (FV, dict(check_values=True))):
        c = _packed_case(idx)
        before = c["pool"].clone()
        with pytest.raises(ValueError, match=words):
            _packed_call(pkg, c, **extra)
        assert torch.equal(c["pool"], before)
        c = _packed_case((0, -1, 0))
        _packed_call(pkg, c, **extra)
        assert torch.equal(c["pool"], before) and torch.equal(c["out"], torch.zeros_like(c["out"]))


def test_packed_fast_is_memory_safe_on_unchecked_slots():
    """Without check_values a slot past the pool pads its request (zeros out, nothing read or written): refgdn's
    result with that entry null."""
    c = _packed_case((4, S + 5, 1))
    o, after = packed_run(getattr(FV, PACKED_OP), [c["x"], c["a"], c["b"], c["A_log"], c["dt_bias"], None, c["pool"],
                                                   c["idx"], c["l2"]])
    o_r, after_r = packed_run(getattr(RV, PACKED_OP), [c["x"], c["a"], c["b"], c["A_log"], c["dt_bias"], None,
                                                       c["pool"], _t([4, 0, 1]), c["l2"]])
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(after, after_r)
    assert torch.equal(after[[0, 2, 3, 5, 6, 7, 8]], c["pool"][[0, 2, 3, 5, 6, 7, 8]])


def test_packed_fast_reads_nothing_back_unless_asked():
    """vLLM calls it inside CUDA graphs: no host read without check_values (refgdn.capture's guards), one with it."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    c = _packed_case()
    for _ in range(3):                    # the first call checks in full, later ones are served from its plan
        with capture_guards("vllm_ops", DEV):
            _packed_call(FV, c)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("vllm_ops", DEV):
            _packed_call(FV, c, check_values=True)


@pytest.mark.parametrize("name", ["decode-strided-pages", "decode-bf16-pool-l2norm"])
def test_packed_layout_plan_equals_the_checked_call(name, monkeypatch):
    """From a layout's second call fast serves the packed decode from a plan (fast.launch.LayoutPlans: no checks, q, k
    and v passed as addresses in mixed_qkv, the compiled launcher reused on a GPU): bit for bit the checked call's
    out and pool (check_values=True is never served), round after round, with the call's own scale."""
    fams = packed_families(quick=True, device=DEV)
    p = fams[name]
    FV._PACKED.clear()
    checked = []
    real = FV.check_vllm_packed_decode_inputs
    monkeypatch.setattr(FV, "check_vllm_packed_decode_inputs", lambda *a: checked.append(1) or real(*a))
    op = getattr(FV, PACKED_OP)
    scales = (None, None, 0.37, None)
    for rnd, scale in enumerate(scales):
        args = _packed(p, seed=rnd)
        args[5] = scale
        got = packed_run(op, args)
        want = packed_run(lambda *a: op(*a, check_values=True), args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"round {rnd}"
    # checked: the first two plain calls (the plan is kept from a layout's second call), the one with a float scale
    # (another key), every check_values call; the other plain calls were served
    assert len(checked) == 2 + 1 + len(scales), len(checked)


def test_packed_layout_plan_misses_on_bad_input():
    """A served layout's plan never serves a call whose metadata differs: the full checks run and raise (the same
    words as a first call), before any write."""
    FV._PACKED.clear()
    for _ in range(3):
        _packed_call(FV, _packed_case())                                    # the layout is served from here on
    for bad, words in [(lambda c: c.update(idx=c["idx"].float()), "int32 or int64"),
                       (lambda c: c.update(out=c["out"][:, 0]), r"out must have shape \[B, 1, HV, V\]"),
                       (lambda c: c.update(x=c["x"][:, 1:]), r"mixed_qkv must be \[B, 2 H K \+ HV V\]"),
                       (lambda c: c.update(l2=1), "use_qk_l2norm_in_kernel must be a bool")]:
        c = _packed_case()
        bad(c)
        before = c["pool"].clone()
        with pytest.raises(ValueError, match=words):
            _packed_call(FV, c)
        assert torch.equal(c["pool"], before)


def _served_rounds(op, calls, check_name: str, monkeypatch) -> int:
    """Each call of ``calls`` (a list of (args, pool, kw)) through op, and again with check_values=True (never served
    from a plan), on fresh copies of the pool: bit for bit the same output, returned state and pool. Returns how many
    times the op's host checks (fast.vllm_ops.<check_name>) ran."""
    FV._SLOTS.clear()
    checked = []
    real = getattr(FV, check_name)
    monkeypatch.setattr(FV, check_name, lambda *a, **k: checked.append(1) or real(*a, **k))
    for rnd, (xs, pool, kw) in enumerate(calls):
        got = _run(op, xs, pool, kw)
        want = _run(lambda *a, **k: op(*a, **k, check_values=True), xs, pool, kw)
        for name, x, y in zip(("o", "final state", "pool"), got, want):
            assert (x is None and y is None) or torch.equal(x, y), f"round {rnd}: {name}"
        if kw.get("inplace_final_state", True):
            assert got[1] is got[2] or got[2] is None
    return len(checked)


PLAN_LAYOUTS = [lay for lay in LAYOUTS if lay.id in ("decode-idx1d-padded", "spec-k2-idx2d-accepted",
                                                    "varlen-empty-no-state", "vk-per-token-states")]


@pytest.mark.parametrize("p", PLAN_LAYOUTS)
def test_recurrent_layout_plan_equals_the_checked_call(p, monkeypatch):
    """From a layout's second call fast serves vLLM's recurrent op from a plan (fast.launch.LayoutPlans: no checks,
    the compiled launcher reused on a GPU): bit for bit the checked call, round after round (new values, the call's
    own scale), beta None included (the plan's ones)."""
    calls = []
    for seed, scale in enumerate((None, None, 0.3, None)):      # (0.3: not the family's own scale, if it has one)
        xs, pool, kw = problem(p, torch.float32, DEV, seed)
        calls.append((xs, pool, dict(kw, scale=scale if kw.get("scale") is None else kw["scale"])))
    xs, pool, kw = calls[-1]
    calls += [(xs[:4] + [None], pool, kw)] * 2
    n = _served_rounds(FV.fused_recurrent_gated_delta_rule, calls, "check_vllm_recurrent_inputs", monkeypatch)
    # checked in full: every check_values call; the layout's first two calls (its plan is kept from the second), the
    # float scale's call where the family's scale is None (another key), the first call with beta None (the key's
    # guard misses: its plan is replaced); every other call was served
    assert n == len(calls) + 2 + (p.get("scale") is None) + 1, n


def test_layout_plans_miss_on_bad_input():
    """A served layout never serves a call whose metadata differs: the full checks raise (the first call's words)."""
    p = dict(families(quick=True, device=DEV).items())
    xs, pool, kw = problem(next(iter(p.values())), torch.float32, DEV)
    FV._SLOTS.clear()
    for _ in range(3):
        _run(FV.fused_recurrent_gated_delta_rule, xs, pool, kw)
    with pytest.raises(ValueError, match="g must"):
        _run(FV.fused_recurrent_gated_delta_rule, xs[:3] + [xs[3][..., :1]] + xs[4:], pool, kw)
    with pytest.raises(ValueError, match="initial_state"):
        _run(FV.fused_recurrent_gated_delta_rule, xs, None if pool is None else pool[..., :1], kw)


def test_packed_keys_equal_the_launches():
    """fast.keys.vllm_ops predicts the packed op's launch (traced_ops raises on a mismatch): float32 and bf16 pools,
    with and without the l2norm, a float64 call (refgdn: nothing launched)."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, recording, traced_ops
    F = traced_ops(FV, keys=fk.vllm_ops)
    log = KeyLog()
    with recording(log):
        for name in ("decode-null-slots", "decode-bf16-pool-l2norm", "gva3-l2norm"):
            packed_run(getattr(F, PACKED_OP), _packed(packed_families(True, DEV)[name]))
        args = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in _packed(packed_families(True, DEV)["decode-l2norm"])]
        packed_run(getattr(F, PACKED_OP), args)
    launched = [key for key in log.launched if key is not None]          # (None: a call that launches nothing)
    assert len(log.launched) == 4 and [key.kernel for key in launched] == ["recurrent_slots_kernel"] * 3
    assert {dict(key.constexprs)["GATE"] for key in launched} == {True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_packed_cuda_graph_replay_equals_eager():
    """Captured once, replayed on new rows copied into the static buffers: bit for bit the eager call's out and pool,
    round after round (a bf16 pool, vLLM's default)."""
    p = dict(packed_families(True, DEV)["decode-bf16-pool-l2norm"])
    static = _packed(p, torch.bfloat16)
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = static
    g_pool, e_pool = pool.clone(), pool.clone()
    out = torch.empty(x.shape[0], 1, pool.shape[1], pool.shape[2], dtype=x.dtype, device=DEV)
    op = getattr(FV, PACKED_OP)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(x, a, b, A_log, dt_bias, scale, g_pool.clone(), out, idx, l2)             # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(x, a, b, A_log, dt_bias, scale, g_pool, out, idx, l2)
    for rnd in range(3):
        new = _packed(p, torch.bfloat16, seed=10 + rnd)
        for dst, src in zip((x, a, b), new[:3]):
            dst.copy_(src)
        graph.replay()
        out_e = torch.empty_like(out)
        op(new[0], new[1], new[2], A_log, dt_bias, scale, e_pool, out_e, idx, l2)     # (the layer's own weights)
        torch.cuda.synchronize()
        assert torch.equal(out, out_e) and torch.equal(g_pool, e_pool), rnd

# ---------------------------------------------------------------------------------------------- the conv

def test_conv_refgdn_rounds_equal_the_conv_over_the_accepted_history():
    """float64, speculative rounds: each round's outputs are refgdn.causal_conv1d's over the request's history of
    accepted inputs (the simplest form: the conv of the whole sequence), whatever was rejected before. Rounds 0 and 3
    have no drafts (vLLM's non-speculative call on the speculative cache, one token each, as after a prefill or a
    round that accepted one token): the next verify still sees their token."""
    gen = torch.Generator().manual_seed(3)
    D, W, k, S = 12, 4, 3, 5
    C = W - 2 + 1 + k
    w, b = torch.randn(D, W, generator=gen, dtype=D64), torch.randn(D, generator=gen, dtype=D64)
    state = torch.randn(S, D, C, generator=gen, dtype=D64)
    slots = [3, 0]
    hist = [state[s, :, :W - 1].clone() for s in slots]            # [D, W - 1]: each request's past inputs
    acc = [1, 1]                                                    # the first call's windows start at column 0
    plain = (0, 3)                                                  # rounds without drafts
    for rnd in range(5):
        drafts = rnd not in plain
        x = torch.randn(2, D, 1 + k if drafts else 1, generator=gen, dtype=D64)
        y = RV.causal_conv1d_update(x if drafts else x[:, :, 0], state, w, b, "silu", torch.tensor(slots, dtype=I32),
                                    torch.tensor(acc, dtype=I32) if drafts else None)  # refgdn on the CPU
        y = y if drafts else y[:, :, None]
        for n in range(2):
            want, _ = refgdn.causal_conv1d(x[n].T[None], w, b, "silu", initial_state=hist[n][None, :, -(W - 1):])
            torch.testing.assert_close(y[n], want[0].T, rtol=1e-12, atol=1e-12)
        acc = [int(a) for a in torch.randint(1, 2 + k, (2,), generator=gen)] if drafts else [1, 1]
        acc = [1, 1] if rnd + 1 in plain else acc       # a plain call reads the row's start: one accepted before it
        hist = [torch.cat([hist[n], x[n][:, :acc[n]]], 1) for n in range(2)]


def _conv_call():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 16, generator=gen).to(DEV)
    state = torch.randn(5, 16, 6, generator=gen).to(DEV)
    w, b = torch.randn(16, 4, generator=gen).to(DEV), torch.randn(16, generator=gen).to(DEV)
    kw = dict(activation="silu", conv_state_indices=_t([1, 4]), num_accepted_tokens=_t([1, 2]),
              query_start_loc=_t([0, 3, 7]), max_query_len=4)
    return x, state, w, b, kw


CONV_BAD = [
    pytest.param(dict(x="x"), "x must be a torch.Tensor", id="x-not-a-tensor"),
    pytest.param(dict(x=torch.zeros(7, 16, 2)), r"x must be \[B, D\], \[B, D, L\] or", id="x-3d-with-varlen"),
    pytest.param(dict(conv_state=torch.zeros(5, 16, 2)), r"conv_state must be \[S, D, C\]", id="state-too-narrow"),
    pytest.param(dict(weight=torch.zeros(16, 1)), "W >= 2", id="width-1"),
    pytest.param(dict(conv_state_indices=None), "needs conv_state_indices", id="varlen-without-indices"),
    pytest.param(dict(num_accepted_tokens=_t([1, 2, 3])), r"num_accepted_tokens must have shape \[B\]",
                 id="accepted-wrong-B"),
    pytest.param(dict(conv_state_indices=_t([1.0, 4.0], torch.float32)), "int32 or int64", id="indices-float"),
    pytest.param(dict(activation="gelu"), "activation", id="activation"),
    pytest.param(dict(pad_slot_id=None), "pad_slot_id must be an int", id="pad-not-int"),
]


def _refused_before_any_write(fn, args: dict, kw: dict, state: str, bad: dict, words: str) -> None:
    """fn(*args.values(), **kw) with bad's entries put over the leading arguments (args) or the keywords (kw), tensors
    moved to DEV, raises a ValueError matching words, and the call's state tensor args[state] is left as it was."""
    watched = args[state]
    before = watched.clone()
    for name, val in bad.items():
        (args if name in args else kw)[name] = val.to(DEV) if isinstance(val, torch.Tensor) else val
    with pytest.raises(ValueError, match=words):
        fn(*args.values(), **kw)
    assert torch.equal(watched, before)


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", CONV_BAD)
def test_conv_bad_inputs_raise_before_any_write(pkg, bad, words):
    x, state, w, b, kw = _conv_call()
    _refused_before_any_write(pkg.causal_conv1d_update, dict(x=x, conv_state=state, weight=w, bias=b), kw,
                              "conv_state", bad, words)


CONV_BAD_VALUES = [
    pytest.param(dict(conv_state_indices=[1, 5]), r"conv_state_indices\[1\] = 5 is out of range", id="row-past-S"),
    pytest.param(dict(conv_state_indices=[4, 4]), "conv_state row 4 is used by requests 0 and 1", id="row-twice"),
    pytest.param(dict(num_accepted_tokens=[0, 1]), r"num_accepted_tokens\[0\] = 0 must be in \[1, C - W \+ 2 = 4\]",
                 id="accepted-zero"),
    pytest.param(dict(num_accepted_tokens=[1, 5]), r"num_accepted_tokens\[1\] = 5", id="window-past-C"),
    pytest.param(dict(query_start_loc=[0, 2, 7], num_accepted_tokens=[1, 1]), "request 1 has 5 tokens",
                 id="drafts-past-C"),
    pytest.param(dict(query_start_loc=[0, 3, 9]), "query_start_loc must end at T=7", id="offsets-past-T"),
]


@pytest.mark.parametrize("bad,words", CONV_BAD_VALUES)
def test_conv_bad_values(bad, words):
    """refgdn always checks the values, fast with check_values=True (the same words); both before any write."""
    for pkg, extra in ((RV, {}), (FV, dict(check_values=True))):
        x, state, w, b, kw = _conv_call()
        kw.update({k: _t(v) for k, v in bad.items()})
        before = state.clone()
        with pytest.raises(ValueError, match=words):
            pkg.causal_conv1d_update(x, state, w, b, **kw, **extra)
        assert torch.equal(state, before)


def test_conv_fast_reads_nothing_back_and_is_memory_safe_unchecked():
    """No host read without check_values (refgdn.capture's guards); unchecked values stay in bounds: a row past S pads
    its request (zeros, nothing written), an accepted count past the row is clamped into it (the window's last start,
    column C - W + 1: num_accepted_tokens 4 here), offsets past T are clamped to T."""
    from refgdn.capture import capture_guards
    x, state, w, b, kw = _conv_call()
    kw.update(conv_state_indices=_t([9, 4]), num_accepted_tokens=_t([1, 50]), query_start_loc=_t([0, 3, 40]))
    s_f = state.clone()
    with capture_guards("vllm_ops conv", DEV):
        y = FV.causal_conv1d_update(x, s_f, w, b, **kw)
    assert torch.equal(y[:3], torch.zeros_like(y[:3])) and torch.equal(s_f[:4], state[:4])
    ref_kw = dict(kw, conv_state_indices=_t([-1, 4]), num_accepted_tokens=_t([1, 4]), query_start_loc=_t([0, 3, 7]))
    s_r = state.clone()
    y_r = RV.causal_conv1d_update(x, s_r, w, b, **ref_kw)
    torch.testing.assert_close(y, y_r)
    torch.testing.assert_close(s_f, s_r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_conv_cuda_graph_replay_equals_eager():
    """Captured once, replayed on new inputs copied into the static x: bit for bit the eager call, round after round."""
    p = conv_families(quick=True, device=DEV)["spec-k3-varlen-accepted"]
    x, state, w, b, kw = conv_problem(p, torch.bfloat16, DEV)
    static, g_state, e_state = x.clone(), state.clone(), state.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        FV.causal_conv1d_update(static, state.clone(), w, b, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = FV.causal_conv1d_update(static, g_state, w, b, **kw)
    for rnd in range(3):
        new = conv_problem(p, torch.bfloat16, DEV, seed=20 + rnd)[0]
        static.copy_(new)
        graph.replay()
        y_e = FV.causal_conv1d_update(new, e_state, w, b, **kw)
        torch.cuda.synchronize()
        assert torch.equal(y_static, y_e) and torch.equal(g_state, e_state), rnd


@pytest.mark.parametrize("name", ["decode-idx-padded", "spec-k3-varlen-accepted", "W2-no-bias-no-act"])
def test_conv_layout_plan_equals_the_checked_call(name, monkeypatch):
    """From a layout's second call fast serves vLLM's conv update from a plan (fast.launch.LayoutPlans: no checks,
    the compiled launcher reused on a GPU): bit for bit the checked call (check_values=True: never served), output
    and rows, round after round on new values; another activation or pad_slot_id is another key (checked)."""
    FV._CONV_UPDATE.clear()
    checked = []
    real = FV.check_vllm_conv_update_inputs
    monkeypatch.setattr(FV, "check_vllm_conv_update_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    p = conv_families(quick=True, device=DEV)[name]
    for seed in range(4):
        x, state, w, b, kw = conv_problem(p, torch.float32, DEV, seed=seed)
        s_f, s_c = state.clone(), state.clone()
        y = FV.causal_conv1d_update(x, s_f, w, b, **kw)
        y_c = FV.causal_conv1d_update(x, s_c, w, b, **kw, check_values=True)
        assert torch.equal(y, y_c) and torch.equal(s_f, s_c), seed
    assert len(checked) == 4 + 2, len(checked)          # every check_values call and the layout's first two
    FV.causal_conv1d_update(x, state.clone(), w, b, **dict(kw, pad_slot_id=-7))
    assert len(checked) == 7
    with pytest.raises(ValueError, match="weight"):     # a served layout never serves other metadata
        FV.causal_conv1d_update(x, state.clone(), w[:, :1], b, **kw)


def test_layout_plans_keep_each_batch_size(monkeypatch):
    """A serving stream's eager steps alternate batch sizes: each size keeps its own plan (the first tensor's sizes
    are part of the plan's key), so after two calls of each every call is served, bit for bit the checked call."""
    FV._CONV_UPDATE.clear()
    checked = []
    real = FV.check_vllm_conv_update_inputs
    monkeypatch.setattr(FV, "check_vllm_conv_update_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    base = conv_families(quick=True, device=DEV)["decode-idx-padded"]
    for rnd, B in enumerate((2, 3, 2, 3, 2, 3, 3, 2)):
        p = dict(base, B=B, idx=list(range(B)))
        x, state, w, b, kw = conv_problem(p, torch.float32, DEV, seed=rnd)
        s_f, s_c = state.clone(), state.clone()
        y = FV.causal_conv1d_update(x, s_f, w, b, **kw)
        n = len(checked)
        y_c = FV.causal_conv1d_update(x, s_c, w, b, **kw, check_values=True)
        assert torch.equal(y, y_c) and torch.equal(s_f, s_c), rnd
        assert len(checked) == n + 1
    assert len(checked) == 8 + 4, len(checked)          # the checked calls and the first two of each size


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
def test_conv_takes_vllms_keywords(pkg):
    """vLLM's GDN layer passes validate_data=True (accepted: shapes are always checked); prefix caching's and tree
    drafts' arguments are refused by name."""
    x, state, w, b, kw = _conv_call()
    y = pkg.causal_conv1d_update(x, state.clone(), w, b, **kw, validate_data=True)
    assert y.shape == x.shape
    for name in ("block_idx_last_scheduled_token", "initial_state_idx", "retrieve_parent_token"):
        with pytest.raises(ValueError, match=name):
            pkg.causal_conv1d_update(x, state, w, b, **kw, **{name: _t([0, 0])})



# ---------------------------------------------------------------------------------------------- the prefill conv

def test_conv_fn_refgdn_equals_the_conv_of_each_request():
    """float64: each request's outputs and new window are refgdn.causal_conv1d's over its tokens from its row (or
    zeros); then a decode step (vLLM's causal_conv1d_update) continues exactly where the prefill left the row."""
    p = conv_fn_families(True, DEV)["prefill-mixed-padded-empty"]
    x, w, b, states, kw = conv_fn_problem(p, D64, DEV, seed=5)
    after = states.clone()
    y = RV.causal_conv1d_fn(x, w, b, after, **kw)
    qsl, W = p["qsl"], w.shape[1]
    for n, (s, init) in enumerate(zip(p["idx"], p["init"])):
        if s < 0:
            continue
        h0 = states[s, :, :W - 1][None] if init else None
        want, final = refgdn.causal_conv1d(x[:, qsl[n]:qsl[n + 1]].T[None], w, b, "silu", h0, True)
        torch.testing.assert_close(y[:, qsl[n]:qsl[n + 1]], want[0].T, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(after[s, :, :W - 1], final[0], rtol=0, atol=0)
    live = [n for n, s in enumerate(p["idx"]) if s >= 0 and qsl[n + 1] > qsl[n]]
    tok = torch.randn(len(live), x.shape[0], dtype=D64, device=DEV)
    rows = _t([p["idx"][n] for n in live])
    y1 = RV.causal_conv1d_update(tok, after, w, b, "silu", rows)
    for i, n in enumerate(live):
        seq = torch.cat([x[:, qsl[n]:qsl[n + 1]], tok[i][:, None]], 1)
        h0 = states[p["idx"][n], :, :W - 1][None] if p["init"][n] else None
        want, _ = refgdn.causal_conv1d(seq.T[None], w, b, "silu", h0)
        torch.testing.assert_close(y1[i], want[0, -1], rtol=1e-12, atol=1e-12)


def _conv_fn_call():
    x, w, b, states, kw = conv_fn_problem(conv_fn_families(True, DEV)["prefill-mixed-padded-empty"], torch.float32,
                                          DEV, seed=6)
    return x, w, b, states, kw


CONV_FN_BAD = [
    pytest.param(dict(x=torch.zeros(1, 40, 14)), "x must be 2-D", id="x-3d"),
    pytest.param(dict(conv_states=torch.zeros(6, 40, 2)), r"conv_states must be \[S, D, C\]", id="states-narrow"),
    pytest.param(dict(query_start_loc=_t([0, 5, 14])), r"cache_indices must have shape \[B\] = \[2\]",
                 id="indices-wrong-B"),
    pytest.param(dict(has_initial_state=_t([1, 0, 1, 0])), "has_initial_state must be a bool tensor", id="flags-int"),
    pytest.param(dict(query_start_loc=_t([0, 5, 5, 12, 13])), "query_start_loc must end at T=14", id="offsets-short"),
    pytest.param(dict(num_computed_tokens=_t([0, 0, 0, 0])), "num_computed_tokens", id="prefix-caching"),
    pytest.param(dict(block_size_to_align=16), "block_size_to_align", id="prefix-caching-align"),
]


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", CONV_FN_BAD)
def test_conv_fn_bad_inputs_raise_before_any_write(pkg, bad, words):
    """(fast checks query_start_loc's values with check_values=True: the offsets-short case asks for it.)"""
    x, w, b, states, kw = _conv_fn_call()
    fn = pkg.causal_conv1d_fn
    if pkg is FV and "must end at T" in words:
        fn = functools.partial(fn, check_values=True)
    _refused_before_any_write(fn, dict(x=x, weight=w, bias=b, conv_states=states), kw, "conv_states", bad, words)


def test_conv_fn_fast_reads_nothing_back_unless_asked():
    """fast's prefill conv builds its tile table on the device: no host read (capturable) unless check_values."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    x, w, b, states, kw = _conv_fn_call()
    with capture_guards("vllm_ops", DEV):
        FV.causal_conv1d_fn(x, w, b, states, **kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("vllm_ops", DEV):
            FV.causal_conv1d_fn(x, w, b, states, **kw, check_values=True)


def test_conv_fn_plan_serves_any_length_bit_for_bit(monkeypatch):
    """From a signature's second call fast serves the prefill conv from a plan that leaves the token and request counts
    out (checks skipped, the compiled launchers reused on a GPU): prefills of other lengths and request counts equal
    the checked call (check_values=True: never served) bit for bit, outputs and rows."""
    FV._CONV_FN.clear()
    checked = []
    real = FV.check_vllm_conv_fn_inputs
    monkeypatch.setattr(FV, "check_vllm_conv_fn_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    base = conv_fn_families(True, DEV)["prefill-mixed-padded-empty"]
    shapes = [([0, 5, 5, 12, 14], [3, 1, -1, 0]), ([0, 2, 9, 9, 20], [0, 4, 3, -1]), ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4])]
    for rnd, (qsl, idx) in enumerate(shapes):
        p = dict(base, qsl=qsl, idx=idx, init=[bool((n + rnd) % 2) for n in range(len(idx))])
        x, w, b, states, kw = conv_fn_problem(p, torch.float32, DEV, seed=rnd)
        s_f, s_c = states.clone(), states.clone()
        y = FV.causal_conv1d_fn(x, w, b, s_f, **kw)
        y_c = FV.causal_conv1d_fn(x, w, b, s_c, **kw, check_values=True)
        assert torch.equal(y, y_c) and torch.equal(s_f, s_c), rnd
    # checked: every check_values call and the first two plain ones (the plan is kept from the second)
    assert len(checked) == len(shapes) + 2, len(checked)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_conv_fn_cuda_graph_replay_equals_eager():
    """The prefill conv captured once (its tile table built on the device), replayed on new inputs and new offsets
    copied into the static buffers: bit for bit the eager call (outputs and rows), round after round."""
    x, w, b, states, kw = conv_fn_problem(conv_fn_families(True, DEV)["prefill-mixed-padded-empty"], torch.bfloat16,
                                          DEV, seed=3)
    static_x, static_q = x.T.contiguous().T, kw["query_start_loc"].clone()            # [D, T], x.stride(0) == 1
    g_states, e_states = states.clone(), states.clone()
    run = dict(kw, query_start_loc=static_q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        FV.causal_conv1d_fn(static_x, w, b, states.clone(), **run)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = FV.causal_conv1d_fn(static_x, w, b, g_states, **run)
    T = x.shape[1]
    for rnd, cut in enumerate((T // 3, 1, T - 2)):
        new = conv_fn_problem(conv_fn_families(True, DEV)["prefill-mixed-padded-empty"], torch.bfloat16, DEV,
                              seed=30 + rnd)[0]
        q = _t([0, cut, cut, T, T])
        static_x.copy_(new)
        static_q.copy_(q)
        graph.replay()
        y_e = FV.causal_conv1d_fn(new, w, b, e_states, **dict(kw, query_start_loc=q))
        torch.cuda.synchronize()
        assert torch.equal(y_static, y_e) and torch.equal(g_states, e_states), rnd


@pytest.mark.parametrize("qsl,clamped", [
    pytest.param([0, 5, 9, 14, 12], [0, 5, 9, 14, 14], id="decreasing"),
    pytest.param([-3, 5, 9, 9, 99], [0, 5, 9, 9, 14], id="out-of-range"),
])
def test_conv_fn_fast_is_memory_safe_on_unchecked_offsets(qsl, clamped):
    """Unchecked offsets are clamped into [0, T], and a reversed span is an empty request (its window row takes its
    initial row or zeros): outputs and rows are refgdn's on the clamped, monotone offsets; the other rows untouched.
    (Spans that overlap after clamping would race on their shared outputs, as two requests on one row do.)"""
    x, w, b, states, kw = _conv_fn_call()
    kw = dict(kw, cache_indices=_t([3, 1, 5, 0]))
    s_f, s_r = states.clone(), states.clone()
    y = FV.causal_conv1d_fn(x, w, b, s_f, **dict(kw, query_start_loc=_t(qsl)))
    y_r = RV.causal_conv1d_fn(x, w, b, s_r, **dict(kw, query_start_loc=_t(clamped)))
    torch.testing.assert_close(y, y_r)
    torch.testing.assert_close(s_f, s_r)
    assert torch.equal(s_f[[2, 4]], states[[2, 4]])


@pytest.mark.parametrize("bad,words", [
    pytest.param([3, 1, 6, 0], r"cache_indices\[2\] = 6 is out of range", id="row-past-S"),
    pytest.param([3, 1, 0, 0], "conv_states row 0 is used by requests 2 and 3", id="row-twice")])
def test_conv_fn_bad_rows(bad, words):
    """refgdn always checks the rows, fast with check_values=True; without, fast's out-of-range row pads its request."""
    for pkg, extra in ((RV, {}), (FV, dict(check_values=True))):
        x, w, b, states, kw = _conv_fn_call()
        kw["cache_indices"] = _t(bad)
        before = states.clone()
        with pytest.raises(ValueError, match=words):
            pkg.causal_conv1d_fn(x, w, b, states, **kw, **extra)
        assert torch.equal(states, before)
    x, w, b, states, kw = _conv_fn_call()
    s_f, s_r = states.clone(), states.clone()
    y = FV.causal_conv1d_fn(x, w, b, s_f, **dict(kw, cache_indices=_t([3, 1, 60, 0])))
    y_r = RV.causal_conv1d_fn(x, w, b, s_r, **dict(kw, cache_indices=_t([3, 1, -1, 0])))
    torch.testing.assert_close(y, y_r)
    assert torch.equal(s_f, s_r)


# ----------------------------------------------------------------------------------------------
# fused_post_conv_prep (newer vLLM's prefill preparation)
# ----------------------------------------------------------------------------------------------

POST_CONV = [pytest.param(p, id=name) for name, p in post_conv_families(quick=True, device=DEV).items()]


@pytest.mark.parametrize("p", POST_CONV)
def test_post_conv_prep_oracle_is_the_formulas(p):
    """float64: every token's and head's outputs are the formulas written out per element (the split by offsets into
    the row, the l2norm, softplus with its threshold of 20, the sigmoid, exp(g) when asked)."""
    import math
    x, a, b, A_log, dt_bias, H, K, V, l2, g_exp = [t.double() if isinstance(t, torch.Tensor) else t
                                                   for t in post_conv_problem(p, torch.float64, DEV)]
    q, k, v, g, beta = RV.fused_post_conv_prep(x, a, b, A_log, dt_bias, H, K, V, l2, g_exp)
    L, HV = a.shape
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.dtype == beta.dtype == torch.float64
    for t in range(L):
        for h in range(H):
            for out, off in ((q, h * K), (k, H * K + h * K)):
                row = x[t, off:off + K]
                want = row / math.sqrt(float((row * row).sum()) + 1e-6) if l2 else row
                torch.testing.assert_close(out[t, h], want, rtol=1e-13, atol=1e-15)
        for h in range(HV):
            assert torch.equal(v[t, h], x[t, 2 * H * K + h * V:2 * H * K + (h + 1) * V])
            z = float(a[t, h] + dt_bias[h])
            gate = -math.exp(float(A_log[h])) * (z if z > 20 else math.log1p(math.exp(z)))
            want_g = math.exp(gate) if g_exp else gate
            assert math.isclose(float(g[t, h]), want_g, rel_tol=1e-13, abs_tol=1e-300)
            assert math.isclose(float(beta[t, h]), 1 / (1 + math.exp(-float(b[t, h]))), rel_tol=1e-13)


POST_CONV_BAD = [
    pytest.param(lambda c: c.__setitem__(0, c[0][:, 1:]), "conv_output must be [L, 2 H K + HV V]", id="width"),
    pytest.param(lambda c: c.__setitem__(1, c[1][:-1]), "a must have shape", id="a-rows"),
    pytest.param(lambda c: c.__setitem__(4, c[4][:2]), "dt_bias must have shape", id="dt-bias-HV"),
    pytest.param(lambda c: c.__setitem__(5, True), "num_k_heads must be an int >= 1", id="H-bool"),
    pytest.param(lambda c: c.__setitem__(7, 0), "head_v_dim must be an int >= 1", id="V-zero"),
    pytest.param(lambda c: c.__setitem__(8, 1), "apply_l2norm must be a bool", id="l2norm-int"),
    pytest.param(lambda c: c.__setitem__(0, c[0].to(torch.int32)), "conv_output must be float16, bfloat16, float32",
                 id="x-int"),
]


def test_post_conv_prep_plan_serves_any_length_bit_for_bit(monkeypatch):
    """From a signature's second call the prefill preparation skips its checks and launches through a plan that
    leaves the token count out: other lengths equal a call whose plans were forgotten (checked in full), bit for
    bit; a bad shape under a served signature still raises."""
    FV._POST_CONV.clear()
    checked = []
    real = FV.check_vllm_post_conv_inputs
    monkeypatch.setattr(FV, "check_vllm_post_conv_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    base = post_conv_families(True, DEV)["prefill-l2norm"]
    for rnd, L in enumerate((37, 5, 64, 1)):
        args = post_conv_problem(dict(base, L=L), torch.float32, DEV, seed=rnd)
        got = FV.fused_post_conv_prep(*args)
        saved = dict(FV._POST_CONV.entries), dict(FV._POST_CONV.seen.entries)
        FV._POST_CONV.clear()
        want = FV.fused_post_conv_prep(*args)
        FV._POST_CONV.entries.update(saved[0])
        FV._POST_CONV.seen.entries.update(saved[1])
        assert all(torch.equal(x, y) for x, y in zip(got, want)), rnd
    assert len(checked) == 4 + 2, len(checked)           # the forgotten-plan calls and the first two served ones
    args = post_conv_problem(dict(base, L=9), torch.float32, DEV)
    with pytest.raises(ValueError, match="a must have shape"):
        FV.fused_post_conv_prep(args[0], args[1][:, :1], *args[2:])


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", POST_CONV_BAD)
def test_post_conv_prep_bad_inputs(pkg, bad, words):
    c = post_conv_problem(post_conv_families(True, DEV)["prefill-l2norm"], torch.float32, DEV)
    bad(c)
    with pytest.raises(ValueError, match=re.escape(words)):
        pkg.fused_post_conv_prep(*c)


def test_post_conv_prep_empty_keys_and_no_host_read():
    """No token: empty outputs of the right shapes, nothing launched; fast.keys predicts the launches (traced_ops raises
    on a mismatch; float64 runs refgdn); no host read (refgdn.capture's guards): vLLM captures its prefill pieces."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, capture_guards, recording, traced_ops
    F = traced_ops(FV, keys=fk.vllm_ops)
    log = KeyLog()
    fams = post_conv_families(True, DEV)
    with recording(log):
        for p in fams.values():
            F.fused_post_conv_prep(*post_conv_problem(p, torch.float32, DEV))
        out = F.fused_post_conv_prep(*post_conv_problem(dict(fams["prefill-l2norm"], L=0), torch.float32, DEV))
        F.fused_post_conv_prep(*[t.double() if isinstance(t, torch.Tensor) else t
                                 for t in post_conv_problem(fams["one-token"], torch.float32, DEV)])
    assert [key.kernel for key in log.launched if key is not None] == ["post_conv_prep_kernel"] * len(fams)
    assert [tuple(t.shape) for t in out] == [(0, 2, 16), (0, 2, 16), (0, 4, 16), (0, 4), (0, 4)]
    with capture_guards("vllm_ops", DEV):
        FV.fused_post_conv_prep(*post_conv_problem(fams["prefill-l2norm"], torch.float32, DEV))


# ----------------------------------------------------------------------------------------------
# fused_sigmoid_gating_delta_rule_update (newer vLLM's recurrent op with the gates in it)
# ----------------------------------------------------------------------------------------------

SIGMOID = [pytest.param(p, id=name) for name, p in sigmoid_families(quick=True, device=DEV).items()]


def _sigmoid(p, dtype, seed=0):
    xs, pool, kw = _problem(p, dtype)
    kw = {key: val for key, val in kw.items() if key not in ("state_layout", "null_block_id")}
    return sigmoid_inputs(xs, kw, dtype, seed), pool, kw


@pytest.mark.parametrize("p", SIGMOID)
def test_sigmoid_gating_oracle_is_the_recurrent_op_on_the_gates(p):
    """float64: the op is the newer-generation recurrent op (state_layout "vk", null_block_id 0) on the gates written
    out (softplus with its threshold of 20, the sigmoid), bit for bit: outputs, written states, untouched slots."""
    args, pool, kw = _sigmoid(p, torch.float64)
    args, pool = [x.double() for x in args], None if pool is None else pool.double()
    A_log, a, b, dt_bias, q, k, v = args
    z = a.double() + dt_bias.double()
    g = -torch.exp(A_log.double()) * torch.where(z > 20, z, torch.log1p(torch.exp(torch.clamp(z, max=20))))
    beta = 1 / (1 + torch.exp(-b.double()))
    B, T, HV = v.shape[:3]
    got = _run(lambda *xs, **kws: RV.fused_sigmoid_gating_delta_rule_update(*xs, **kws), args, pool, kw)
    want = _run(RV.fused_recurrent_gated_delta_rule, [q, k, v, g.reshape(B, T, HV), beta.reshape(B, T, HV)], pool,
                dict(kw, state_layout="vk", null_block_id=0))
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("pool_dtype,o_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16)],
                         ids=["fp32-state-fp32-out", "bf16-state-q-dtype-out"])
@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
def test_sigmoid_gating_output_dtype_follows_vllm(pkg, pool_dtype, o_dtype):
    """o is float32 with a float32 state (an fp16 readout of an unnormalised state can overflow), else q's dtype."""
    args, pool, kw = _sigmoid(sigmoid_families(True, DEV)["vk-decode-null-block"], torch.float16)
    o, final = pkg.fused_sigmoid_gating_delta_rule_update(*args, initial_state=pool.to(pool_dtype), **kw)
    assert o.dtype == o_dtype and final.dtype == pool_dtype


SIGMOID_BAD = [
    pytest.param(dict(is_kda=True), "is_kda must be False", id="kda"),
    pytest.param(dict(beta=2.0), "beta (softplus' sharpness) must be 1.0", id="softplus-beta"),
    pytest.param(dict(threshold=10.0), "threshold (softplus' linear cut-off) must be 20.0", id="threshold"),
    pytest.param(dict(a="drop-a-row"), "a must have shape [B, T, HV]", id="a-rows"),
    pytest.param(dict(dt_bias="short"), "dt_bias must have shape", id="dt-bias-HV"),
    pytest.param(dict(initial_state="kv"), "slot pool [S, HV, V, K]", id="kv-pool"),
]


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", SIGMOID_BAD)
def test_sigmoid_gating_bad_inputs_raise_before_any_write(pkg, bad, words):
    args, pool, kw = _sigmoid(sigmoid_families(True, DEV)["vk-spec-null-block"], torch.float32)
    pool = pool.clone()
    bad = dict(bad)
    if bad.pop("a", None):
        args[1] = args[1][:-1]
    if bad.pop("dt_bias", None):
        args[3] = args[3][:1]
    if bad.pop("initial_state", None):
        pool = torch.zeros(pool.shape[0], pool.shape[1], 16, 8, device=DEV)     # [S, HV, K, V] with K != V
    before = pool.clone()
    with pytest.raises(ValueError, match=re.escape(words)):
        pkg.fused_sigmoid_gating_delta_rule_update(*args, initial_state=pool, **kw, **bad)
    assert torch.equal(pool, before)


def test_sigmoid_gating_keys_and_no_host_read():
    """fast.keys.vllm_ops predicts every family's launch (traced_ops raises on a mismatch; GATE and SLOT_LO 1); no host
    read without check_values (capturable), one with it."""
    from fast import keys as fk
    from refgdn.capture import HostSyncInCapture, KeyLog, capture_guards, recording, traced_ops
    F = traced_ops(FV, keys=fk.vllm_ops)
    log = KeyLog()
    with recording(log):
        for p in sigmoid_families(True, DEV).values():
            args, pool, kw = _sigmoid(p, torch.float32)
            F.fused_sigmoid_gating_delta_rule_update(*args, initial_state=pool, **kw)
    keys = [key for key in log.launched if key is not None]
    assert len(keys) == len(SIGMOID) and all(dict(key.constexprs)["GATE"] and dict(key.constexprs)["SLOT_LO"] == 1
                                              for key in keys)
    args, pool, kw = _sigmoid(sigmoid_families(True, DEV)["vk-decode-null-block"], torch.float32)
    with capture_guards("vllm_ops", DEV):
        FV.fused_sigmoid_gating_delta_rule_update(*args, initial_state=pool, **kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("vllm_ops", DEV):
            FV.fused_sigmoid_gating_delta_rule_update(*args, initial_state=pool, **kw, check_values=True)


# ----------------------------------------------------------------------------------------------
# chunk_gated_delta_rule: newer vLLM's generation (states [N, HV, V, K], core_attn_out)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
def test_chunk_newer_generation_is_the_older_on_transposed_states(pkg):
    """state_layout "vk": initial_state [N, HV, V, K] in and final_state [N, HV, V, K] out are the older call's states
    transposed, bit for bit, and o equal; core_attn_out receives o and is what is returned; chunk_indices /
    chunk_offsets are accepted (not needed)."""
    q, k, v, g, beta, h0 = gdn_inputs(1, 40, 1, 2, 16, 16, seed=5, dtype=torch.float32, device=DEV, init=True, N=2)
    cu = _t([0, 15, 40])
    o, ht = pkg.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, cu)
    out = torch.full_like(v, float("nan"))
    o2, ht2 = pkg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(),
                                         output_final_state=True, cu_seqlens=cu, core_attn_out=out,
                                         chunk_indices=_t([[0, 0], [1, 0]]), chunk_offsets=_t([0, 1, 2]),
                                         state_layout="vk")
    assert o2 is out and torch.equal(o2, o)
    assert ht2.shape == (2, 2, 16, 16) and ht2.is_contiguous() and torch.equal(ht2, ht.transpose(-1, -2))


CHUNK_BAD = [
    pytest.param(dict(state_layout="v-major"), "state_layout must be 'kv'", id="layout-unknown"),
    pytest.param(dict(state_layout="vk", initial_state=torch.zeros(2, 2, 16, 8)),
                 "initial_state must be [N, HV, V, K] = [N, 2, 16, 16]", id="vk-state-shape"),
    pytest.param(dict(core_attn_out=torch.zeros(1, 40, 2, 16, dtype=torch.float16)), "core_attn_out must be",
                 id="out-dtype"),
    pytest.param(dict(core_attn_out=torch.zeros(1, 39, 2, 16)), "core_attn_out must be", id="out-shape"),
    pytest.param(dict(chunk_indices=[0, 1]), "chunk_indices must be a tensor or None", id="indices-list"),
]


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", CHUNK_BAD)
def test_chunk_newer_generation_bad_arguments(pkg, bad, words):
    q, k, v, g, beta, h0 = gdn_inputs(1, 40, 1, 2, 16, 16, seed=5, dtype=torch.float32, device=DEV, init=True, N=2)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=_t([0, 15, 40]))
    kw.update({key: val.to(DEV) if isinstance(val, torch.Tensor) else val for key, val in bad.items()})
    with pytest.raises(ValueError, match=re.escape(words)):
        pkg.chunk_gated_delta_rule(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("pkg", [RV, FV], ids=["refgdn", "fast"])
def test_chunk_core_attn_out_must_not_overlap_the_inputs(pkg):
    """core_attn_out sharing bytes with an input (fast's kernels would write o while reading it) is refused on every
    call, served ones included (addresses are no part of the plan's signature); disjoint carvings of one buffer
    are fine, and nothing is written before the refusal."""
    q, k, v, g, beta, h0 = gdn_inputs(1, 40, 1, 2, 16, 16, seed=5, dtype=torch.float32, device=DEV, init=True, N=2)
    kw = dict(initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True, cu_seqlens=_t([0, 15, 40]),
              state_layout="vk")
    block = torch.randn(2, 1, 40, 2, 16, device=DEV)            # v and o carved from one buffer, apart
    v2, out = block[0], block[1]
    v2.copy_(v)
    for _ in range(3):                                           # the first, the remembered and the served call
        o, _ = pkg.chunk_gated_delta_rule(q, k, v2, g, beta, **kw, core_attn_out=out)
        assert o is out
    for name, arg in (("v", 2), ("q", 0), ("g", 3)):
        xs = [q, k, v2, g, beta]
        shared = xs[arg].clone() if name != "v" else None
        if name == "v":
            bad_out = v2                                          # o written over v itself
        else:                                                     # a [1, 40, 2, 16] view starting inside xs[arg]
            store = torch.zeros(shared.numel() + 40 * 2 * 16, device=DEV)
            store[:shared.numel()] = shared.reshape(-1)
            xs[arg] = store[:shared.numel()].view(shared.shape)
            bad_out = store[4:4 + 40 * 2 * 16].view(1, 40, 2, 16)
        before = [x.clone() for x in xs]
        with pytest.raises(ValueError, match=f"core_attn_out must not overlap {name}"):
            pkg.chunk_gated_delta_rule(*xs, **kw, core_attn_out=bad_out)
        assert all(torch.equal(a, b) for a, b in zip(xs, before)), name


def test_chunk_newer_generation_keys_equal_the_launches():
    """fast.keys.vllm_ops predicts the newer-generation call's launches (traced_ops raises on a mismatch)."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, recording, traced_ops
    F = traced_ops(FV, keys=fk.vllm_ops)
    q, k, v, g, beta, h0 = gdn_inputs(1, 40, 1, 2, 16, 16, seed=5, dtype=torch.float32, device=DEV, init=True, N=2)
    log = KeyLog()
    with recording(log):
        F.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(),
                                 output_final_state=True, cu_seqlens=_t([0, 15, 40]), state_layout="vk",
                                 core_attn_out=torch.empty_like(v))
    assert len(log.launched) >= 2


CHUNK_OFFSETS = [
    pytest.param([0, 15, 40], "kv", False, id="two"),
    pytest.param([0, 0, 1, 17, 17, 40], "vk", True, id="empty-len1-vk-l2norm"),
    pytest.param([0, 33, 34, 40], "kv", True, id="l2norm-odd"),
]


def _chunk_call(cu, vk, l2, seed=5, dtype=torch.float32, T=40):
    N = len(cu) - 1
    q, k, v, g, beta, h0 = gdn_inputs(1, T, 1, 2, 16, 16, seed=seed, dtype=dtype, device=DEV, init=True, N=N)
    h0 = h0.float()
    kw = dict(initial_state=h0.transpose(-1, -2).contiguous() if vk else h0, output_final_state=True,
              cu_seqlens=_t(cu), use_qk_l2norm_in_kernel=l2, state_layout="vk" if vk else "kv")
    return (q, k, v, g, beta), kw


@pytest.mark.parametrize("cu,vk,l2", CHUNK_OFFSETS)
def test_chunk_device_tables_equal_the_host_tables(cu, vk, l2):
    """By default fast's vLLM chunk op builds every kernel's chunk table on the device (no host read): o and the
    final states equal the call that reads the offsets (check_values=True: host tables) bit for bit, with the
    output in the state pass (the interpreter's default) and in kernel 4 (chunk_gated_delta_rule_fwd,
    fuse_output=False: the rows of the table past its last chunk skipped there too); core_attn_out takes o in place."""
    xs, kw = _chunk_call(cu, vk, l2)
    o_h, ht_h = FV.chunk_gated_delta_rule(*xs, **kw, check_values=True)
    out = torch.full_like(xs[2], float("nan"))
    o_d, ht_d = FV.chunk_gated_delta_rule(*xs, **kw, core_attn_out=out)
    assert o_d is out and torch.equal(o_d, o_h) and torch.equal(ht_d, ht_h)
    assert ht_d.is_contiguous() and ht_d.shape == ht_h.shape
    from fast.chunk import chunk_gated_delta_rule_fwd
    h0 = kw["initial_state"].transpose(-1, -2) if vk else kw["initial_state"]
    for fuse in (True, False):
        got = chunk_gated_delta_rule_fwd(*xs, None, h0, True, kw["cu_seqlens"], l2, fuse_output=fuse,
                                         offsets_on_device=True)
        want = chunk_gated_delta_rule_fwd(*xs, None, h0, True, kw["cu_seqlens"], l2, fuse_output=fuse)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fuse


def test_chunk_reads_nothing_back_unless_asked():
    """The device-table path reads no value to the host (capturable; one sync per GDN layer per prefill step less);
    check_values=True reads the offsets."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    xs, kw = _chunk_call([0, 15, 40], True, True)
    with capture_guards("vllm_ops", DEV):
        FV.chunk_gated_delta_rule(*xs, **kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("vllm_ops", DEV):
            FV.chunk_gated_delta_rule(*xs, **kw, check_values=True)


@pytest.mark.parametrize("cu,clamped", [
    pytest.param([-4, 15, 99], [0, 15, 40], id="out-of-range"),
    pytest.param([0, 30, 12, 40], None, id="decreasing"),
])
def test_chunk_fast_is_memory_safe_on_unchecked_offsets(cu, clamped):
    """Unchecked offsets are clamped into [0, T] by the device table: out-of-range ones give the call on the
    clamped offsets bit for bit; a reversed span is a sequence without chunks (its final state is its initial
    state) and the spans that then overlap race on their shared tokens' outputs (values unspecified, nothing read
    or written outside the tensors); check_values=True raises on both."""
    xs, kw = _chunk_call(cu, False, True)
    o, ht = FV.chunk_gated_delta_rule(*xs, **kw)
    if clamped is not None:
        o_c, ht_c = FV.chunk_gated_delta_rule(*xs, **dict(kw, cu_seqlens=_t(clamped)), check_values=True)
        assert torch.equal(o, o_c) and torch.equal(ht, ht_c)
    else:
        assert torch.equal(ht[1], kw["initial_state"][1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        FV.chunk_gated_delta_rule(*xs, **kw, check_values=True)


def test_chunk_plan_serves_any_length_bit_for_bit(monkeypatch):
    """From a signature's second call the vLLM chunk op skips its checks and launches through a plan that leaves the
    token and sequence counts out (the compiled launchers reused on a GPU): prefills of other lengths and request
    counts equal the checked call (check_values=True: never served) bit for bit; a bad shape still raises."""
    FV._CHUNK.clear()
    checked = []
    real = FV.check_gdn_inputs
    monkeypatch.setattr(FV, "check_gdn_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    mixes = ([0, 15, 40], [0, 3, 3, 30, 52], [0, 1, 2, 3, 4, 5, 6, 70])
    for rnd, cu in enumerate(mixes):
        xs, kw = _chunk_call(cu, True, True, seed=rnd, T=cu[-1])
        out = torch.empty_like(xs[2])
        o, ht = FV.chunk_gated_delta_rule(*xs, **kw, core_attn_out=out)
        o_c, ht_c = FV.chunk_gated_delta_rule(*xs, **kw, core_attn_out=torch.empty_like(out), check_values=True)
        assert o is out and torch.equal(o, o_c) and torch.equal(ht, ht_c), rnd
    assert len(checked) == 2, len(checked)            # the first two default calls: the plan is kept from the second
    xs, kw = _chunk_call([0, 15, 40], True, True)
    with pytest.raises(ValueError, match="core_attn_out must be"):
        FV.chunk_gated_delta_rule(*xs, **kw, core_attn_out=torch.empty(1, 39, 2, 16, device=DEV))
    with pytest.raises(ValueError, match="initial_state"):
        FV.chunk_gated_delta_rule(*xs, **dict(kw, initial_state=kw["initial_state"][:1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pipelined forward (one long request) needs a GPU")
def test_chunk_one_long_request_takes_the_pipelined_forward_into_core_attn_out():
    """One request of 16384 tokens (vLLM's single-prompt prefill): the dense call, pipelined over segments on a
    GPU, writes o into core_attn_out and the "vk" final state in its layout, bit for bit the checked call's."""
    xs, kw = _chunk_call([0, 16384], True, True, dtype=torch.bfloat16, T=16384)
    out = torch.empty_like(xs[2])
    o, ht = FV.chunk_gated_delta_rule(*xs, **kw, core_attn_out=out)
    o_c, ht_c = FV.chunk_gated_delta_rule(*xs, **kw, check_values=True)
    assert o is out and torch.equal(o, o_c) and torch.equal(ht, ht_c) and ht.is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_chunk_cuda_graph_replay_equals_eager():
    """vLLM's chunk op captured once (chunk tables built on the device), replayed on new inputs and new offsets
    copied into the static buffers: bit for bit the eager call, round after round (bf16, "vk" states, l2norm)."""
    T = 300
    xs, kw = _chunk_call([0, 100, 101, 300], True, True, dtype=torch.bfloat16, T=T)
    static = [x.clone() for x in xs]
    static_cu, static_h0 = kw["cu_seqlens"].clone(), kw["initial_state"].clone()
    run = dict(kw, cu_seqlens=static_cu, initial_state=static_h0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        FV.chunk_gated_delta_rule(*static, **run)                          # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, ht_static = FV.chunk_gated_delta_rule(*static, **run)
    for rnd, cu in enumerate(([0, 7, 7, 300], [0, 1, 299, 300], [0, 150, 250, 300])):
        new, new_kw = _chunk_call(cu, True, True, seed=20 + rnd, dtype=torch.bfloat16, T=T)
        for dst, src in zip(static, new):
            dst.copy_(src)
        static_cu.copy_(new_kw["cu_seqlens"])
        static_h0.copy_(new_kw["initial_state"])
        graph.replay()
        o_e, ht_e = FV.chunk_gated_delta_rule(*new, **new_kw)
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_e) and torch.equal(ht_static, ht_e), rnd


@pytest.mark.parametrize("name", ["decode-null-slots", "decode-l2norm", "gva3-l2norm", "odd-KV-scale"])
def test_sigmoid_gating_one_token_is_the_packed_decode(name):
    """float64: for one token per request the two newer vLLM decode ops agree (written independently in refgdn: the
    packed decode's own step, the gated recurrent op over refgdn's recurrent op): outputs and pools, null block and
    negative entries padded alike."""
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = packed_problem(packed_families(True, DEV)[name], torch.float64, DEV)
    x, a, b, A_log, dt_bias, pool = (t.double() for t in (x, a, b, A_log, dt_bias, pool))
    N, HV, V, K = x.shape[0], pool.shape[1], pool.shape[2], pool.shape[3]
    H = (x.shape[1] - HV * V) // (2 * K)
    out = torch.zeros(N, 1, HV, V, dtype=torch.float64, device=DEV)
    pool_p, pool_s = pool.clone(), pool.clone()
    RV.fused_recurrent_gated_delta_rule_packed_decode(x, a, b, A_log, dt_bias, scale, pool_p, out, idx, l2)
    q = x[:, :H * K].unflatten(1, (H, K))[:, None]
    k = x[:, H * K:2 * H * K].unflatten(1, (H, K))[:, None]
    v = x[:, 2 * H * K:].unflatten(1, (HV, V))[:, None]
    o, _ = RV.fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, scale=scale, initial_state=pool_s,
                                                     ssm_state_indices=idx, use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(o, out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(pool_s, pool_p, rtol=1e-12, atol=1e-13)


def test_packed_decode_takes_strided_gate_parameters():
    """A_log / dt_bias as strided [HV] views (slices of wider tensors) read as their values, not as memory at unit
    stride: the same outputs and pool as contiguous copies (fast's kernel takes them through slots_launch)."""
    x, a, b, A_log, dt_bias, scale, pool, idx, l2 = packed_problem(packed_families(True, DEV)["decode-l2norm"],
                                                                   torch.float32, DEV)
    outs = []
    for wide in (False, True):
        A, d = A_log, dt_bias
        if wide:                                     # every other entry of a twice-as-long tensor
            A = torch.stack([A_log, torch.full_like(A_log, 9.0)], -1).flatten()[::2]
            d = torch.stack([dt_bias, torch.full_like(dt_bias, 9.0)], -1).flatten()[::2]
            assert A.stride(0) == 2 and torch.equal(A, A_log)
        out, p = torch.empty(x.shape[0], 1, pool.shape[1], pool.shape[2], device=DEV), pool.clone()
        FV.fused_recurrent_gated_delta_rule_packed_decode(x, a, b, A, d, scale, p, out, idx, l2)
        outs.append((out, p))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("p", [lay for lay in SIGMOID if lay.id in ("vk-decode-null-block", "vk-spec-null-block")])
def test_sigmoid_gating_layout_plan_equals_the_checked_call(p, monkeypatch):
    """As test_recurrent_layout_plan_equals_the_checked_call for newer vLLM's fused_sigmoid_gating_delta_rule_update
    (the raw gates a, b [B * T, HV] read through their [B, T, HV] views' strides)."""
    calls = [_sigmoid(p, torch.float32, seed) for seed in range(3)]
    n = _served_rounds(lambda *a, **k: FV.fused_sigmoid_gating_delta_rule_update(*a, **k), calls,
                       "check_vllm_sigmoid_gating_inputs", monkeypatch)
    assert n == len(calls) + 2, n
