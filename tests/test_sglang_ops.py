"""SGLang's fused decode op (refgdn.sglang_ops, fast.sglang_ops): fused_sigmoid_gating_delta_rule_update, the gates
formed from raw projections and each sequence's state in a slot of a pool in SGLang's [S, HV, V, K] layout.

refgdn's op against the step written out per token and head here (float64); fast's against refgdn by the conformance
rule: conformance.cases_sglang's checks, run on every family below by the quick matrix (`python -m conformance
--quick`, the first half of the README's test command), and here only where a test needs more than the rule. Bad
inputs raise before any slot is written.
"""
import pytest
import torch

import fast.sglang_ops as FS
import refgdn.sglang_ops as RS
from conformance.cases_sglang import families, problem, run

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = "fused_sigmoid_gating_delta_rule_update"
FAMILIES = [pytest.param(p, id=name) for name, p in families(quick=True, device=DEV).items()]


def _t(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("p", FAMILIES)
def test_refgdn_equals_the_steps_written_out(p):
    """float64: every token's output and every written slot are the rule written out per token and head here (the
    gates, the l2norm, the state transposed as SGLang stores it); a padded sequence runs from a zero state and writes
    nothing; with disable_state_update nothing is written; every other slot is untouched."""
    args, kw = problem(p, torch.float64, DEV)
    args = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    buf = kw.get("intermediate_states_buffer")
    buf = None if buf is None else buf.double()
    o, after, buf_after = run(RS.fused_sigmoid_gating_delta_rule_update, args, kw, buf)
    A_log, a, dt_bias, _, _, q, k, v, b, pool, idx = args
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    a, b = a.reshape(B, T, HV), b.reshape(B, T, HV)
    scale = K ** -0.5 if kw["scale"] is None else kw["scale"]
    cu = p.get("cu")
    spans = [(0, s, e) for s, e in zip(cu, cu[1:])] if cu else [(n, 0, T) for n in range(B)]
    written, cached = set(), set()
    c = p.get("cache")
    rows = ([-1] * len(spans) if not c else c["rows"] if c.get("rows") is not None else list(range(len(spans))))
    for (row, bos, eos), slot, r in zip(spans, p["idx"], rows):
        for h in range(HV):
            hk = h // (HV // H)
            state = pool[slot, h].T.clone() if slot >= 0 else torch.zeros(K, V, dtype=torch.float64, device=DEV)
            for t in range(bos, eos):
                qt, kt = q[row, t, hk], k[row, t, hk]
                if kw["use_qk_l2norm_in_kernel"]:
                    qt, kt = qt / torch.sqrt(qt @ qt + 1e-6), kt / torch.sqrt(kt @ kt + 1e-6)
                g = -torch.exp(A_log[h]) * torch.nn.functional.softplus(a[row, t, h] + dt_bias[h])
                beta = torch.sigmoid(b[row, t, h])
                state = torch.exp(g) * state
                state = state + torch.outer(kt, beta * (v[row, t, h] - state.T @ kt))
                torch.testing.assert_close(o[row, t, h], scale * state.T @ qt, rtol=1e-12, atol=1e-12)
                if r >= 0:                              # target verify: the state after this token, cached
                    torch.testing.assert_close(buf_after[r, t - bos, h], state.T, rtol=1e-12, atol=1e-12)
                    cached.add((r, t - bos))
            if slot >= 0 and eos > bos and not kw["disable_state_update"]:
                torch.testing.assert_close(after[slot, h], state.T, rtol=1e-12, atol=1e-12)
                written.add(slot)
    for s in range(pool.shape[0]):
        if s not in written:
            assert torch.equal(after[s], pool[s]), f"slot {s} written"
    if buf is not None:
        assert cached and not written
        for r in range(buf.shape[0]):
            for j in range(buf.shape[1]):
                if (r, j) not in cached:
                    assert torch.equal(buf_after[r, j], buf[r, j]), f"cache entry {(r, j)} written"


@pytest.mark.parametrize("p", FAMILIES[:3])
def test_fast_returns_sglangs_output(p):
    """The output is [B, T, HV, V] in v's dtype (values: the quick matrix's conformance checks)."""
    args, kw = problem(p, torch.float32, DEV)
    o, _, _ = run(FS.fused_sigmoid_gating_delta_rule_update, args, kw)
    assert o.shape == args[7].shape and o.dtype == args[7].dtype


BAD = [
    pytest.param(dict(is_kda=True), "is_kda=True", id="kda"),
    pytest.param(dict(intermediate_states_buffer=torch.zeros(1)), "intermediate_states_buffer must be 5-D",
                 id="cache-not-5d"),
    pytest.param(dict(cache_steps=4), "describe intermediate_states_buffer: pass it too", id="steps-without-cache"),
    pytest.param(dict(cache=(3, 2, 2, 16, 16)), "needs disable_state_update=True", id="cache-committing"),
    pytest.param(dict(cache=(3, 2, 2, 16, 8), disable_state_update=True), r"must be \[C, steps, HV, V, K\]",
                 id="cache-wrong-K"),
    pytest.param(dict(cache=(3, 2, 2, 16, 16), disable_state_update=True, cache_steps=3), "cache_steps must be",
                 id="cache-steps-mismatch"),
    pytest.param(dict(cache="gapped", disable_state_update=True), "one after another", id="cache-rows-gapped"),
    pytest.param(dict(cache=(3, 2, 2, 16, 16), disable_state_update=True, intermediate_state_indices=[0, 1]),
                 r"intermediate_state_indices must have shape \[B\] = \[5\]", id="cache-rows-wrong-N"),
    pytest.param(dict(retrieve_parent_token=torch.zeros(1)), "retrieve_parent_token", id="tree"),
    pytest.param(dict(softplus_beta=2.0), "softplus_beta must be 1.0", id="softplus-beta"),
    pytest.param(dict(softplus_threshold=10.0), "softplus_threshold must be 20.0", id="softplus-threshold"),
    pytest.param(dict(a="wrong"), r"a must have shape \[B, T, HV\]", id="a-wrong-shape"),
    pytest.param(dict(pool="KV"), r"initial_state_source must be the slot pool \[S, HV, V, K\]", id="pool-K-V"),
    pytest.param(dict(idx=[1, 2]), r"initial_state_indices must have shape \[B\] = \[5\]", id="indices-wrong-N"),
    pytest.param(dict(disable_state_update=1), "disable_state_update must be a bool", id="frozen-not-bool"),
]


def _bad_call(p, bad: dict) -> tuple:
    """(args, kwargs) of a call on family p with the change ``bad`` made (see BAD)."""
    args, kw = problem(p, torch.float32, DEV)
    bad = dict(bad)
    if bad.pop("a", None):
        args[1] = args[1][:, :1]
    if bad.pop("pool", None):
        args[9] = torch.zeros(9, 2, 16, 8, device=DEV)
    if "idx" in bad:
        args[10] = _t(bad.pop("idx"))
    for i, name in ((3, "softplus_beta"), (4, "softplus_threshold")):
        if name in bad:
            args[i] = bad.pop(name)
    cache = bad.pop("cache", None)
    if cache == "gapped":
        bad["intermediate_states_buffer"] = torch.zeros(3, 3, 2, 16, 16, device=DEV)[:, :2]
    elif cache is not None:
        bad["intermediate_states_buffer"] = torch.zeros(*cache, device=DEV)
    if "intermediate_state_indices" in bad:
        bad["intermediate_state_indices"] = _t(bad["intermediate_state_indices"])
    return args, dict(kw, **bad)


@pytest.mark.parametrize("pkg", [RS, FS], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", BAD)
def test_bad_inputs_raise_before_any_write(pkg, bad, words):
    args, kw = _bad_call(families(True, DEV)["decode-varlen-padded"], bad)
    before = args[9].clone()
    cache = kw.get("intermediate_states_buffer")
    cache_before = cache.clone() if isinstance(cache, torch.Tensor) else None
    with pytest.raises(ValueError, match=words):
        getattr(pkg, OP)(*args, **kw)
    assert torch.equal(args[9], before)
    assert cache_before is None or torch.equal(cache, cache_before)


@pytest.mark.parametrize("idx,words", [
    pytest.param([4, -1, 9, 7, 2], r"initial_state_indices\[2\] = 9 is outside the pool's 9 slots", id="past-pool"),
    pytest.param([4, -1, 7, 7, 2], "slot 7 is given to sequences 2 and 3", id="two-sequences-one-slot"),
])
def test_bad_slot_values(idx, words):
    """refgdn always checks the slots, fast with check_values=True (same words), both before any write; one slot for
    two sequences is fine when nothing is written (disable_state_update)."""
    p = dict(families(True, DEV)["decode-varlen-padded"], idx=idx)
    for pkg, extra in ((RS, {}), (FS, dict(check_values=True))):
        args, kw = problem(p, torch.float32, DEV)
        before = args[9].clone()
        with pytest.raises(ValueError, match=words):
            getattr(pkg, OP)(*args, **kw, **extra)
        assert torch.equal(args[9], before)
    if "given to" in words:
        for pkg, extra in ((RS, {}), (FS, dict(check_values=True))):
            args, kw = problem(dict(p, frozen=True), torch.float32, DEV)
            o, after, _ = run(getattr(pkg, OP), args, dict(kw, **extra))
            assert torch.equal(after, args[9])


@pytest.mark.parametrize("cache,words", [
    pytest.param(dict(C=3, steps=3, rows=[1, 0, 3]), r"intermediate_state_indices\[2\] = 3 is outside the pool's 3",
                 id="row-past-the-cache"),
    pytest.param(dict(C=3, steps=3, rows=[1, 0, 1]), "slot 1 is given to sequences 0 and 2", id="one-row-two-seqs"),
    pytest.param(dict(C=3, steps=2, rows=[1, 0, -1]), "sequence 0 has 3 tokens but intermediate_states_buffer keeps 2",
                 id="longer-than-steps"),
    pytest.param(dict(C=2, steps=3), "has 2 rows for 3 sequences", id="too-few-rows-for-row-n"),
])
def test_bad_cache_rows(cache, words):
    """Target verify's cache rows: refgdn always checks them, fast with check_values=True; nothing is written."""
    p = dict(families(True, DEV)["verify-cache-rows"], cache=cache)
    for pkg, extra in ((RS, {}), (FS, dict(check_values=True))):
        args, kw = problem(p, torch.float32, DEV)
        buf = kw["intermediate_states_buffer"]
        before, buf_before = args[9].clone(), buf.clone()
        with pytest.raises(ValueError, match=words):
            getattr(pkg, OP)(*args, **kw, **extra)
        assert torch.equal(args[9], before) and torch.equal(buf, buf_before)


def test_fast_is_memory_safe_on_unchecked_values():
    """Without check_values: a slot past the pool runs its sequence from zeros and writes nothing (refgdn's result
    with that entry negative); offsets past T are clamped (refgdn's result on the clamped offsets)."""
    p = families(True, DEV)["decode-varlen-padded"]
    args, kw = problem(dict(p, idx=[4, -1, 30, 7, 2]), torch.float32, DEV)
    o, after, _ = run(FS.fused_sigmoid_gating_delta_rule_update, args, kw)
    args_r, _ = problem(dict(p, idx=[4, -1, -1, 7, 2]), torch.float32, DEV)
    o_r, after_r, _ = run(RS.fused_sigmoid_gating_delta_rule_update, args_r, kw)
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(after, after_r)
    o2, after2, _ = run(FS.fused_sigmoid_gating_delta_rule_update, args_r,
                        dict(kw, cu_seqlens=_t([0, 1, 2, 3, 4, 40])))
    torch.testing.assert_close(o2, o_r)
    torch.testing.assert_close(after2, after_r)
    with pytest.raises(ValueError, match="cu_seqlens must end at T=5"):
        run(FS.fused_sigmoid_gating_delta_rule_update, args_r, dict(kw, cu_seqlens=_t([0, 1, 2, 3, 4, 40]),
                                                                     check_values=True))
    # target verify: a cache row past the buffer caches nothing (refgdn's result with that row negative), and a
    # sequence longer than the steps caches its first steps only
    p = families(True, DEV)["verify-cache-rows"]
    args, kw = problem(dict(p, cache=dict(C=3, steps=2, rows=[1, 9, 2])), torch.float32, DEV)
    o, _, buf = run(FS.fused_sigmoid_gating_delta_rule_update, args, kw)
    args_r, kw_r = problem(dict(p, cache=dict(C=3, steps=3, rows=[1, -1, 2])), torch.float32, DEV)
    wider = torch.cat([kw["intermediate_states_buffer"], kw["intermediate_states_buffer"][:, :1]], 1)   # 3 steps
    o_r, _, buf_r = run(RS.fused_sigmoid_gating_delta_rule_update, args_r, kw_r, wider)
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(buf, buf_r[:, :2])
    # an int64 row whose product with the steps would overflow (2^62 * 2) caches nothing either
    far = dict(kw, intermediate_state_indices=torch.tensor([1, 2 ** 62, 2], dtype=torch.int64, device=DEV))
    o_far, _, buf_far = run(FS.fused_sigmoid_gating_delta_rule_update, args, far)
    assert torch.equal(o_far, o) and torch.equal(buf_far, buf)


def test_fast_reads_nothing_back_unless_asked():
    """SGLang calls it inside CUDA graphs: no host read without check_values (refgdn.capture's guards), one with it."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    for name in ("verify-cache-rows", "verify-cache-row-n-bf16"):      # (the verify's cache rows formed by the kernel)
        args, kw = problem(families(True, DEV)[name], torch.float32, DEV)
        with capture_guards("sglang_ops", DEV):
            run(FS.fused_sigmoid_gating_delta_rule_update, args, kw)
    args, kw = problem(families(True, DEV)["decode-varlen-padded"], torch.float32, DEV)
    with capture_guards("sglang_ops", DEV):
        run(FS.fused_sigmoid_gating_delta_rule_update, args, kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("sglang_ops", DEV):
            run(FS.fused_sigmoid_gating_delta_rule_update, args, dict(kw, check_values=True))


def test_keys_equal_the_launches():
    """fast.keys.sglang_ops predicts each call's launch (traced_ops raises on a mismatch)."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, recording, traced_ops
    F = traced_ops(FS, keys=fk.sglang_ops)
    log = KeyLog()
    with recording(log):
        for p in families(True, DEV).values():
            run(F.fused_sigmoid_gating_delta_rule_update, *problem(p, torch.float32, DEV))
    assert [key.kernel for key in log.launched] == ["recurrent_slots_kernel"] * len(families(True, DEV))
    writes = [dict(key.constexprs)["WRITE"] for key in log.launched]
    assert writes.count(0) == 1 and writes.count(2) == 2          # the frozen family; the two verify families


def test_twins_have_one_signature():
    import inspect
    for name in RS.__all__:
        assert inspect.signature(getattr(FS, name)) == inspect.signature(getattr(RS, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_cuda_graph_replay_equals_eager():
    """Captured once, replayed on new tokens copied into the static buffers: bit for bit the eager call's outputs and
    pool, round after round (bf16, the pool carries over)."""
    p = families(True, DEV)["decode-varlen-padded"]
    static, kw = problem(p, torch.bfloat16, DEV)
    g_pool, e_pool = static[9].clone(), static[9].clone()
    op = getattr(FS, OP)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(*static[:9], g_pool.clone(), static[10], **kw)      # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = op(*static[:9], g_pool, static[10], **kw)
    for rnd in range(3):
        new, _ = problem(p, torch.bfloat16, DEV, seed=10 + rnd)
        for i in (1, 5, 6, 7, 8):                              # a, q, k, v, b (the layer's weights stay)
            static[i].copy_(new[i])
        graph.replay()
        o_e = op(*static[:9], e_pool, static[10], **kw)       # eager on the same (new) inputs
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_e) and torch.equal(g_pool, e_pool), rnd


@pytest.mark.parametrize("name", ["decode-varlen-padded", "dense-3d-gates", "frozen-state", "verify-cache-rows",
                                  "verify-cache-row-n-bf16"])
def test_layout_plan_equals_the_checked_call(name, monkeypatch):
    """From a layout's second call fast serves the decode or target verify from a plan (fast.launch.LayoutPlans: no
    checks, the compiled launcher reused on a GPU; a verify's row table built per call from its own rows): bit for
    bit the checked call (check_values=True: never served), round after round."""
    p = families(quick=True, device=DEV)[name]
    FS._DECODE.clear()
    FS._VERIFY.clear()
    checked = []
    real = FS.check_sglang_decode_inputs
    monkeypatch.setattr(FS, "check_sglang_decode_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    op = getattr(FS, OP)
    rounds = 3
    for seed in range(rounds):
        args, kw = problem(p, torch.float32, DEV, seed)
        got = run(op, args, kw)
        want = run(lambda *a, **k: op(*a, **k, check_values=True), args, kw)
        for what, x, y in zip(("o", "pool", "cache"), got, want):
            assert (x is None and y is None) or torch.equal(x, y), f"round {seed}: {what}"
    # checked: every check_values call and the layout's first two (its plan is kept from the second)
    assert len(checked) == rounds + 2, len(checked)


def test_served_verify_follows_each_calls_rows_and_misses_on_bad_shapes(monkeypatch):
    """A served target verify builds its row table from the call's own intermediate_state_indices (rows moved,
    negative, or left out: row n) and its own buffer: bit for bit the checked call; a buffer of other steps misses
    the plan and is refused by name."""
    p = families(quick=True, device=DEV)["verify-cache-rows"]
    FS._VERIFY.clear()
    checked = []
    real = FS.check_sglang_decode_inputs
    monkeypatch.setattr(FS, "check_sglang_decode_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    op = getattr(FS, OP)
    args, kw = problem(p, torch.float32, DEV, 0)
    for rnd, rows in enumerate(([1, 0, -1], [1, 0, -1], [2, -1, 0], [0, 1, 2], None)):
        kw2 = dict(kw, intermediate_state_indices=None if rows is None else torch.tensor(rows, dtype=torch.int32,
                                                                                           device=DEV))
        if rows is None:
            del kw2["intermediate_state_indices"]
        got = run(op, args, kw2)
        want = run(lambda *a, **k: op(*a, **k, check_values=True), args, kw2)
        for what, x, y in zip(("o", "pool", "cache"), got, want):
            assert torch.equal(x, y), f"rows {rows}: {what}"
    # checked: the five check_values calls, the rows layout's first two, the first (and only) call without rows
    assert len(checked) == 5 + 2 + 1, len(checked)
    bad = dict(kw, intermediate_states_buffer=kw["intermediate_states_buffer"][:, :2].contiguous())
    with pytest.raises(ValueError, match="cache_steps"):
        op(*args, **bad)
