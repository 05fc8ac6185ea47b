"""FlashInfer's paged state cache (flashinfer.gdn_paged) in refgdn.flashinfer_ops and fast.flashinfer_ops:
chunk_gated_delta_rule_paged, gated_delta_rule_decode_paged and their slots functions.

refgdn's ops against the whole history written out here (float64, from the zero state over each sequence's prefix and
new tokens): the prefix's pages hold the history's states, the call must give the new tokens' outputs, store the
state at every page boundary they cross and at their end, and leave every other page as it was. fast's against
refgdn by the conformance rule: conformance.cases_flashinfer_paged, run by the quick matrix (the first half of the
README's test command), and here where a test needs more than the rule. Bad inputs raise before anything is written.
"""
import math

import pytest
import torch

import fast.flashinfer_ops as FF
import refgdn.flashinfer_ops as RF
from conformance.cases_flashinfer_paged import decode_families, decode_problem, prefill_families, prefill_problem, run
from refgdn.checks import flashinfer_paged_rows
from tests.helpers import captured

DEV = "cuda" if torch.cuda.is_available() else "cpu"
I32 = dict(dtype=torch.int32, device=DEV)


def _history(q, k, v, logg, beta, scale, l2):
    """The recurrence over one whole history, float64, from zeros: (o [L, h, V], the state after each token [L, h,
    V, K], FlashInfer's layout). q, k: [L, h, K] (already one per value head), v: [L, h, V], logg, beta: [L, h]."""
    S = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64, device=q.device)      # [h, K, V]
    outs, states = [], []
    for t in range(q.shape[0]):
        qt, kt = q[t], k[t]
        if l2:
            qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
            kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        S = S * torch.exp(logg[t])[:, None, None]
        S = S + kt[:, :, None] * (beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, kt)))[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", S, qt))
        states.append(S.transpose(-1, -2).clone())
    return torch.stack(outs), torch.stack(states)


def _paged_history(seqs, ps, heads, gate, seed, l2=True, shared=False):
    """A paged prefill whose truth is the history: (args, kw, o truth [T, sab, V], {page: its state after}).
    seqs: [(prefix, new)]; heads (Hq, Hk, Hv); gate "alpha", "log" or "raw"; shared: sequence 1's first page and
    first page of tokens are sequence 0's."""
    gen = torch.Generator().manual_seed(seed)
    Hq, Hk, Hv = heads
    sab, K, V = max(Hq, Hv), 16, 16
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    counts = [math.ceil((p + n) / ps) for p, n in seqs]
    P = sum(counts) + 2
    perm = torch.randperm(P, generator=gen).tolist()
    pool = torch.full((P, sab, V, K), 9.0, dtype=torch.float64)
    A_log, dt_bias = r(sab) * 0.5, r(sab) * 0.5
    parts, o_true, expect, ids, ptr, last, cu = [], [], {}, [], [0], [], [0]
    for b, ((pre, new), c) in enumerate(zip(seqs, counts)):
        L = pre + new
        x = dict(q=r(L, Hq, K), k=r(L, Hk, K), v=r(L, Hv, V), g=r(L, sab), beta=torch.rand(L, sab, generator=gen,
                                                                                          dtype=torch.float64))
        if gate == "alpha":
            x["g"] = 0.6 + 0.4 * torch.rand(L, sab, generator=gen, dtype=torch.float64)
        pages = [perm.pop() for _ in range(c)]
        if shared and b == 1:                            # the first page of history and its page: sequence 0's
            for name in x:
                x[name][:ps] = parts[0][name][:ps]
            pages[0] = ids[0]
        parts.append(x)
        logg = {"alpha": torch.log(x["g"]), "log": -0.3 * x["g"].abs(),
                "raw": -torch.exp(A_log) * torch.nn.functional.softplus(x["g"] + dt_bias)}[gate]
        if gate == "log":
            x["g"] = logg
        rep = lambda t, h: t.repeat_interleave(sab // h, dim=1)                    # noqa: E731 (GQA / GVA heads)
        o, st = _history(rep(x["q"], Hq), rep(x["k"], Hk), rep(x["v"], Hv), logg, x["beta"], K ** -0.5, l2)
        for j, p in enumerate(pages):
            end = min((j + 1) * ps, L)
            if end <= pre:
                pool[p] = st[end - 1]                    # a full page of the prefix
            elif j * ps < pre:
                pool[p] = st[pre - 1]                    # the page the prefix ends in
            if end > pre and new:
                expect[p] = st[end - 1]
        ids += pages
        ptr.append(len(ids))
        last.append(L - (c - 1) * ps)
        cu.append(cu[-1] + new)
        o_true.append(o[pre:])
    cat = {name: torch.cat([x[name][pre:] for x, (pre, _) in zip(parts, seqs)]) for name in parts[0]}
    kw = dict(cu_seqlens=torch.tensor(cu, **I32), state_pool=pool.to(DEV), page_indices=torch.tensor(ids, **I32),
              page_indptr=torch.tensor(ptr, **I32), page_size=ps, last_page_len=torch.tensor(last, **I32),
              use_qk_l2norm_in_kernel=l2, gate_domain="linear" if gate == "alpha" else "log")
    if gate == "raw":
        kw.update(use_gate_in_kernel=True, A_log=A_log.to(DEV), dt_bias=dt_bias.to(DEV))
    args = [cat[n].to(DEV) for n in ("q", "k", "v", "g", "beta")]
    return args, kw, torch.cat(o_true).to(DEV), {p: s.to(DEV) for p, s in expect.items()}


HISTORIES = [
    pytest.param([(0, 70), (100, 90), (64, 5), (130, 200), (128, 0)], 64, (1, 1, 2), "log", False,
                 id="prefixes-gva-page64"),
    pytest.param([(37, 300), (256, 1)], 128, (2, 2, 2), "alpha", False, id="page128-alpha"),
    pytest.param([(70, 60), (100, 100)], 64, (4, 2, 2), "raw", True, id="shared-prefix-gqa-raw-gates"),
]


@pytest.mark.parametrize("seqs,ps,heads,gate,shared", HISTORIES)
def test_refgdn_prefill_equals_the_history(seqs, ps, heads, gate, shared):
    """float64: the new tokens' outputs are the history's, every page the new tokens complete (and the last page)
    holds the history's state after its last token, and every other page (the prefix's, shared ones, spares) is
    untouched."""
    args, kw, o_true, expect = _paged_history(seqs, ps, heads, gate, seed=len(seqs), shared=shared)
    before = kw["state_pool"].clone()
    o = RF.chunk_gated_delta_rule_paged(*args, **kw)
    assert (o - o_true).abs().max() < 1e-10
    for p in range(before.shape[0]):
        if p in expect:
            assert (kw["state_pool"][p] - expect[p]).abs().max() < 1e-10, p
        else:
            assert torch.equal(kw["state_pool"][p], before[p]), p


@pytest.mark.parametrize("seqs,ps,heads,gate,shared", HISTORIES)
def test_fast_prefill_matches_the_history(seqs, ps, heads, gate, shared):
    """fast in float32 on the same problem: the history's outputs and pages to float32's accuracy, the other pages
    bit for bit."""
    args, kw, o_true, expect = _paged_history(seqs, ps, heads, gate, seed=len(seqs), shared=shared)
    args = [a.float() for a in args]
    kw = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    before = kw["state_pool"].clone()
    o = FF.chunk_gated_delta_rule_paged(*args, **kw)
    assert (o.double() - o_true).abs().max() < 1e-4
    for p in range(before.shape[0]):
        if p in expect:
            assert (kw["state_pool"][p].double() - expect[p]).abs().max() < 1e-4, p
        else:
            assert torch.equal(kw["state_pool"][p], before[p]), p


def test_decode_equals_the_history():
    """Both packages, one token per sequence: opening a new page reads the previous (full, shared) page and leaves it
    as it was; mid-page the last page is continued in place; a sequence without pages is padding (zeros)."""
    seqs, ps = [(64, 70), (64, 70), (30, 1)], 64       # histories of 134 and 31 tokens; the decode is one more
    args, kw, _, _ = _paged_history(seqs, ps, (1, 1, 2), "raw", seed=5, shared=True)
    gen = torch.Generator().manual_seed(1)
    B, HV = 4, 2
    q, k = (torch.randn(B, 1, 1, 16, generator=gen, dtype=torch.float64).to(DEV) for _ in range(2))
    v = torch.randn(B, 1, HV, 16, generator=gen, dtype=torch.float64).to(DEV)
    a, b = (torch.randn(B, 1, HV, generator=gen, dtype=torch.float64).to(DEV) for _ in range(2))
    A_log, dt_bias = kw["A_log"], kw["dt_bias"]
    RF.chunk_gated_delta_rule_paged(*args, **kw)                  # the pages of 134, 134 and 31 tokens
    pool = kw["state_pool"]
    ids, ptr = kw["page_indices"].tolist(), kw["page_indptr"].tolist()
    spare = sorted(set(range(pool.shape[0])) - set(ids))
    # sequence 0 opens a new page (a spare one) after its 134 tokens... as a decode of token 129 instead: a 2-page
    # table whose last page is new (last_page_len 1) reading page ids[0] (shared with sequence 1, full)
    table = [[ids[0], spare[0]], [ids[ptr[1]], ids[ptr[1] + 1], ids[ptr[1] + 2]], [ids[ptr[2]]], []]
    last = [1, 134 - 2 * ps + 1, 32, 0]
    page_indices = torch.tensor(sum(table, []), **I32)
    page_indptr = torch.tensor([0] + list(torch.tensor([len(t) for t in table]).cumsum(0).tolist()), **I32)
    reads = [pool[ids[0]], pool[ids[ptr[1] + 2]], pool[ids[ptr[2]]]]            # the states each row starts from
    for pkg in (RF, FF):
        st = pool.clone()
        o = pkg.gated_delta_rule_decode_paged(q, k, v, A_log, a, dt_bias, b, state_pool=st, page_indices=page_indices,
                                              page_indptr=page_indptr, last_page_len=torch.tensor(last, **I32))
        for n in range(3):
            g = -torch.exp(A_log) * torch.nn.functional.softplus(a[n, 0] + dt_bias)
            beta = torch.sigmoid(b[n, 0])
            qh, kh = q[n, 0].expand(HV, 16), k[n, 0].expand(HV, 16)
            qh, kh = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (qh, kh))
            S = reads[n].transpose(-1, -2) * torch.exp(g)[:, None, None]                # [HV, K, V]
            S = S + kh[:, :, None] * (beta[:, None] * (v[n, 0] - torch.einsum("hkv,hk->hv", S, kh)))[:, None, :]
            assert (o[n, 0].double() - 16 ** -0.5 * torch.einsum("hkv,hk->hv", S, qh)).abs().max() < 1e-6, (pkg, n)
            assert (st[table[n][-1]] - S.transpose(-1, -2)).abs().max() < 1e-6, (pkg, n)
        assert torch.equal(o[3], torch.zeros_like(o[3]))
        written = {t[-1] for t in table if t}
        for p in range(pool.shape[0]):
            if p not in written:
                assert torch.equal(st[p], pool[p]), (pkg, p)


def test_slots_are_the_page_tables_rows():
    """gdn_paged_prefill_slots / gdn_paged_decode_slots (device ops, no host read) give the rows the value checks
    derive on the host: the read page, the last page, the first boundary's page-table entry, the prefix."""
    ps = 64
    lens_new = [(0, 70), (100, 90), (64, 5), (130, 200), (0, 0), (128, 0)]
    gen = torch.Generator().manual_seed(0)
    ids, ptr, last = [], [0], []
    for pre, new in lens_new:
        c = math.ceil((pre + new) / ps)
        ids += (torch.randperm(100, generator=gen)[:c] + 100 * len(last)).tolist()
        ptr.append(len(ids))
        last.append(pre + new - (c - 1) * ps if c else 0)
    cu = [0]
    for _, n in lens_new:
        cu.append(cu[-1] + n)
    t = lambda x: torch.tensor(x, **I32)  # noqa: E731
    sl = FF.gdn_paged_prefill_slots(t(cu), t(ids), t(ptr), ps, t(last))
    rows = flashinfer_paged_rows(t(ids), t(ptr), t(last), ps, 10 ** 4, [n for _, n in lens_new])
    assert sl.state_indices.tolist() == [r for r, _, _ in rows]
    assert sl.prefix_lens.tolist() == [p for _, _, p in rows]
    for b, (read, writes, prefix) in enumerate(rows):
        if writes:
            assert sl.output_state_indices[b] == writes[-1]
        if len(writes) > 1:                              # a boundary crossed: its page is the entry's
            assert ids[sl.checkpoint_cu_starts[b]] == writes[0]
    assert sl.output_state_indices[4] == -1 and sl.state_indices[4] == -1      # no pages: padding
    dec = RF.gdn_paged_decode_slots(t(ids), t(ptr), t(last))
    assert dec.output_state_indices.tolist() == [ids[ptr[b + 1] - 1] if ptr[b + 1] > ptr[b] else -1
                                                 for b in range(len(last))]
    assert dec.initial_state_indices.tolist() == [
        -1 if ptr[b + 1] == ptr[b] else ids[ptr[b + 1] - 2] if last[b] == 1 and ptr[b + 1] - ptr[b] > 1
        else -1 if last[b] == 1 else ids[ptr[b + 1] - 1] for b in range(len(last))]


def test_names_and_argument_orders():
    """Both packages export FlashInfer's names with one signature (fast adds check_values)."""
    import inspect
    for name in ("chunk_gated_delta_rule_paged", "gated_delta_rule_decode_paged", "gdn_paged_prefill_slots",
                 "gdn_paged_decode_slots"):
        r, f = inspect.signature(getattr(RF, name)), inspect.signature(getattr(FF, name))
        assert [p for p in f.parameters if p != "check_values"] == list(r.parameters), name
    assert FF.GDNPagedPrefillSlots._fields == ("state_indices", "output_state_indices", "checkpoint_cu_starts",
                                               "prefix_lens")


def _prefill_bad(change: dict) -> tuple:
    args, kw = prefill_problem(prefill_families(True, DEV)["prefixes-gva"], torch.float32, DEV)
    kw = dict(kw, state_pool=kw["state_pool"].clone())
    for name, value in change.items():
        if name in ("g", "beta"):
            args[3 if name == "g" else 4] = value(args) if callable(value) else value
        else:
            kw[name] = value(kw) if callable(value) else value
    return args, kw


def _set(name, i, value):
    def f(kw):
        t = kw[name].clone()
        t[i] = value
        return t
    return f


PREFILL_BAD = [
    (dict(page_size=100), "page_size must be a positive multiple", False),
    (dict(page_indices=lambda kw: kw["page_indices"].float()), "page_indices must be int32 or int64", False),
    (dict(last_page_len=lambda kw: kw["last_page_len"][:-1]), "last_page_len must have shape", False),
    (dict(state_pool=lambda kw: kw["state_pool"][:, :1]), "state_pool must be \\[num_pages >= 1, num_sab_heads",
     False),
    (dict(gate_domain="exp"), "gate_domain must be", False),
    (dict(A_log=lambda kw: torch.zeros(2, device=DEV)), "A_log and dt_bias are read only with", False),
    (dict(use_gate_in_kernel=True), "A_log must", False),
    (dict(page_indices=_set("page_indices", 0, 10 ** 6)), "outside the pool", True),
    (dict(last_page_len=_set("last_page_len", 1, 0)), "last_page_len\\[1\\] = 0 is outside", True),
    (dict(last_page_len=_set("last_page_len", 0, 5)), "sequence 0 has 70 new tokens but its pages hold", True),
    # sequence 1's last page (entry 4) made sequence 0's (entry 1); sequence 0's last page made the one sequence 2
    # reads (its first: a prefix of 64 tokens)
    (dict(page_indices=lambda kw: _set("page_indices", 4, int(kw["page_indices"][1]))(kw)), "written twice", True),
    (dict(page_indices=lambda kw: _set("page_indices", 1, int(kw["page_indices"][int(kw["page_indptr"][2])]))(kw)),
     "read by sequence 2 and written by sequence 0", True),
]


@pytest.mark.parametrize("pkg", [RF, FF], ids=["refgdn", "fast"])
@pytest.mark.parametrize("change,words,value", PREFILL_BAD)
def test_prefill_bad_inputs_raise_before_any_write(pkg, change, words, value):
    args, kw = _prefill_bad(change)
    before = kw["state_pool"].clone()
    extra = dict(check_values=True) if pkg is FF and value else {}
    with pytest.raises(ValueError, match=words):
        pkg.chunk_gated_delta_rule_paged(*args, **kw, **extra)
    assert torch.equal(kw["state_pool"], before)


@pytest.mark.parametrize("pkg", [RF, FF], ids=["refgdn", "fast"])
@pytest.mark.parametrize("change,words,value", [
    (dict(backend="cuda"), "backend must be", False),
    (dict(q=lambda a: a.expand(-1, 2, -1, -1)), "one token per sequence", False),
    (dict(last_page_len=lambda kw: torch.ones_like(kw["last_page_len"]), page_indptr=lambda kw: torch.arange(
        kw["page_indptr"].numel(), dtype=torch.int32, device=DEV)), "a decoded token needs a prefix", True),
    (dict(page_indices=_set("page_indices", 0, -3)), "outside the pool", True),
])
def test_decode_bad_inputs_raise_before_any_write(pkg, change, words, value):
    args, kw = decode_problem(decode_families(True, DEV)["open-mid-padded"], torch.float32, DEV)
    kw = dict(kw, state_pool=kw["state_pool"].clone())
    for name, fn in change.items():
        if name == "q":
            args[0] = fn(args[0])
        else:
            kw[name] = fn(kw) if callable(fn) else fn
    before = kw["state_pool"].clone()
    extra = dict(check_values=True) if pkg is FF and value else {}
    with pytest.raises(ValueError, match=words):
        pkg.gated_delta_rule_decode_paged(*args, **kw, **extra)
    assert torch.equal(kw["state_pool"], before)


def test_slots_given_must_be_the_tables():
    """Slots passed by the caller are used as given by fast (checked against the table with check_values) and always
    checked by refgdn."""
    args, kw = prefill_problem(prefill_families(True, DEV)["odd-KV-no-gates"], torch.float32, DEV)
    sl = RF.gdn_paged_prefill_slots(kw["cu_seqlens"], kw["page_indices"], kw["page_indptr"], kw["page_size"],
                                    kw["last_page_len"])
    o_f, s_f = run(lambda *a, **k: FF.chunk_gated_delta_rule_paged(*a, **k, slots=sl), args, kw)
    o_g, s_g = run(FF.chunk_gated_delta_rule_paged, args, kw)
    assert torch.equal(o_f, o_g) and torch.equal(s_f, s_g)
    bad = sl._replace(prefix_lens=sl.prefix_lens + 1)
    for fn in (RF.chunk_gated_delta_rule_paged,
               lambda *a, **k: FF.chunk_gated_delta_rule_paged(*a, **k, check_values=True)):
        with pytest.raises(ValueError, match="slots.prefix_lens"):
            run(lambda *a, **k: fn(*a, **k, slots=bad), args, kw)


@pytest.mark.parametrize("offsets", ["past-T", "decreasing"])
def test_fast_unchecked_values_stay_in_the_pool(offsets):
    """Without check_values fast reads nothing back: page ids out of range, a garbage page table and offsets past T
    or decreasing write nothing outside the pool, nor outside the output (each sits inside a larger tensor here: the
    kernels write o at the caller's rows, in place)."""
    args, kw = prefill_problem(prefill_families(True, DEV)["prefixes-gva"], torch.float32, DEV)
    P, T = kw["state_pool"].shape[0], args[0].shape[0]
    big = torch.full((P + 4,) + tuple(kw["state_pool"].shape[1:]), 5.0, device=DEV)
    sab, V = max(args[0].shape[1], args[2].shape[1]), args[2].shape[2]
    big_o = torch.full((T + 4, sab, V), 5.0, device=DEV)
    cu = kw["cu_seqlens"]
    cu = cu * 2 if offsets == "past-T" else cu.flip(0)
    kw = dict(kw, state_pool=big[2:P + 2], page_indices=torch.randint(-50, 50, kw["page_indices"].shape, **I32),
              last_page_len=torch.randint(-5, 300, kw["last_page_len"].shape, **I32), cu_seqlens=cu,
              output=big_o[2:T + 2])
    FF.chunk_gated_delta_rule_paged(*args, **kw)
    for x in (big, big_o):
        assert torch.equal(x[:2], torch.full_like(x[:2], 5.0)) and torch.equal(x[-2:], torch.full_like(x[:2], 5.0))


def test_fast_reads_nothing_back_unless_asked():
    """Capturable by default (refgdn.capture's guards), one host read with check_values."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    args, kw = prefill_problem(prefill_families(True, DEV)["odd-KV-no-gates"], torch.float32, DEV)
    with capture_guards("flashinfer_ops", DEV):
        run(FF.chunk_gated_delta_rule_paged, args, kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("flashinfer_ops", DEV):
            run(lambda *a, **k: FF.chunk_gated_delta_rule_paged(*a, **k, check_values=True), args, kw)
    d_args, d_kw = decode_problem(decode_families(True, DEV)["open-mid-padded"], torch.float32, DEV)
    with capture_guards("flashinfer_ops", DEV):
        run(FF.gated_delta_rule_decode_paged, d_args, d_kw)


def test_keys_equal_the_launches():
    """fast.keys.flashinfer_ops predicts the paged ops' launches (traced_ops raises on a mismatch): varlen, one
    sequence (the dense call), bfloat16 inputs (the two-term update), the decode."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, recording, traced_ops
    F = traced_ops(FF, keys=fk.flashinfer_ops)
    log = KeyLog()
    with recording(log):
        for name, dt in (("prefixes-gva", torch.float32), ("one-seq-page128", torch.bfloat16)):
            run(F.chunk_gated_delta_rule_paged, *prefill_problem(prefill_families(True, DEV)[name], dt, DEV))
        run(F.gated_delta_rule_decode_paged, *decode_problem(decode_families(True, DEV)["open-mid-padded"],
                                                                    torch.float32, DEV))
    kernels = [key.kernel for key in log.launched]
    assert "chunk_state_kernel" in kernels and kernels[-1] == "recurrent_slots_kernel"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_cuda_graph_replay_equals_eager():
    """The paged prefill captured (nothing read back) and replayed on new page tables of the same sizes: bit for bit
    the eager call's output and pool."""
    p = prefill_families(True, DEV)["prefixes-gva"]
    args, kw = prefill_problem(p, torch.bfloat16, DEV)
    pool0 = kw["state_pool"].clone()
    graph, o_static = captured(lambda: FF.chunk_gated_delta_rule_paged(*args, **kw))
    for rnd in range(3):
        perm = torch.randperm(pool0.shape[0], device=DEV).to(torch.int32)
        kw["page_indices"].copy_(perm[:kw["page_indices"].numel()])
        kw["state_pool"].copy_(pool0)
        graph.replay()
        got = (o_static.clone(), kw["state_pool"].clone())
        kw["state_pool"].copy_(pool0)
        o_e = FF.chunk_gated_delta_rule_paged(*args, **kw)
        torch.cuda.synchronize()
        assert torch.equal(got[0], o_e) and torch.equal(got[1], kw["state_pool"]), rnd


@pytest.mark.parametrize("garbage", [False, True], ids=["table", "garbage"])
def test_bookkeeping_kernels_equal_their_twins(garbage):
    """fast.paged's two kernels against their torch twins: the rows bit for bit (also on garbage tables: the same
    clamps), the aligned gates to float32's rounding (the formulas' last bits differ), zeros on the pad rows."""
    from fast import paged
    args, kw = prefill_problem(prefill_families(True, DEV)["raw-gates-output-padded"], torch.float32, DEV)
    T, P = args[0].shape[0], kw["state_pool"].shape[0]
    sab = max(args[0].shape[1], args[2].shape[1])
    cu, ids, ptr, last = kw["cu_seqlens"], kw["page_indices"], kw["page_indptr"], kw["last_page_len"]
    if garbage:
        ids = torch.randint(-9, 2 * P, ids.shape, **I32)
        last = torch.randint(-70, 200, last.shape, **I32)
    got = paged.launch_paged_rows(cu, ids, ptr, last, 64, T, P)
    want = paged.paged_rows(cu, ids, ptr, last, 64, T, P)
    for a, b in zip(list(got[0]) + list(got[1:]), list(want[0]) + list(want[1:])):
        assert torch.equal(a.long(), b.long())
    # in_rows' ranges hold the caller's tokens: row p of sequence n is token p - d
    for n, (lo, hi, d) in enumerate(got[2].tolist()):
        assert (lo - d, hi - d) == (cu[n].item(), cu[n + 1].item()) and lo >= got[1][n].item()
    g = args[3]
    for gate, beta_mode, gg in (("raw", "logit", g), ("log", "prob", -g.abs()), ("linear", None, torch.rand_like(g)),
                                (None, "prob", None)):
        A_log, dt_bias = kw["A_log"], kw["dt_bias"]
        beta = None if beta_mode is None else args[4]
        k_out = paged.launch_paged_gates(gg, beta, A_log, dt_bias, got[1], got[2], T, sab, gate, beta_mode, -104.0)
        t_out = paged.paged_gates(gg, beta, A_log, dt_bias, got[1], got[2], T, sab, gate, beta_mode, -104.0)
        for a, b in zip(k_out, t_out):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
        pad = torch.ones(a.shape[0], dtype=torch.bool, device=DEV)
        pad[paged.aligned_rows(got[2], T)] = False
        assert pad.any() and not k_out[1][pad].any()                    # beta 0 on the rows that hold no token


@pytest.mark.parametrize("l2", [True, False], ids=["kn", "caller-k"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-output", "kernel4"])
def test_caller_rows_are_the_aligned_copy(l2, fused):
    """The kernels' IN_ROWS (q, k, v read and o written at the caller's rows of in_rows) against the chunked forward
    on the tokens copied into the aligned rows (zeros on the pad rows), bit for bit: o, every page. l2: k read by the
    later kernels as kernel 1's kn (aligned) or the caller's (K_IN_ROWS); fused: o formed by the state pass or by
    kernel 4."""
    from fast import paged
    from fast.chunk import chunk_gated_delta_rule_fwd
    fam = dict(prefill_families(True, DEV)["odd-KV-no-gates"], l2=l2, gate="log", beta="prob")
    args, kw = prefill_problem(fam, torch.float32, DEV)
    q, k, v, g, beta = args[:5]
    T, sab = q.shape[0], max(q.shape[1], v.shape[1])
    cu, ps = kw["cu_seqlens"], kw["page_size"]
    pool0 = kw["state_pool"]
    _, cu_p, in_rows, slot_rows, table = paged.launch_paged_rows(cu, kw["page_indices"], kw["page_indptr"],
                                                                 kw["last_page_len"], ps, T, pool0.shape[0])
    log_g, b = paged.launch_paged_gates(g, beta, None, None, cu_p, in_rows, T, sab, "log", "prob", -104.0)
    Tp = log_g.shape[0]
    dest = paged.aligned_rows(in_rows, T)
    q, k, v = FF.gqa_to_gva(q, k, v)
    outs = []
    for copy in (False, True):
        pool = pool0.clone()
        xs = [x.new_zeros((Tp,) + x.shape[1:]).index_copy_(0, dest, x) if copy else x for x in (q, k, v)]
        o, _ = chunk_gated_delta_rule_fwd(*(x[None] for x in (*xs, log_g, b)), None, pool.transpose(-1, -2), True,
                                          cu_p, l2, chunk_size=64, offsets_on_device=True, slot_rows=slot_rows,
                                          fuse_output=fused, checkpoints=(pool.transpose(-1, -2), table, ps // 64,
                                                                          kw["page_indices"]),
                                          in_rows=None if copy else (in_rows, Tp))
        outs.append((o[0] if not copy else o[0].index_select(0, dest), pool))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][1], pool0)                        # (the call wrote pages)


def test_planned_calls_equal_the_first():
    """From a signature's second call on, the checks are skipped and the launches replayed (fast.launch's plans):
    the same outputs and pages as the first, checked call, bit for bit."""
    args, kw = prefill_problem(prefill_families(True, DEV)["odd-KV-no-gates"], torch.float32, DEV)
    first = run(FF.chunk_gated_delta_rule_paged, args, kw)
    for _ in range(2):
        again = run(FF.chunk_gated_delta_rule_paged, args, kw)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
