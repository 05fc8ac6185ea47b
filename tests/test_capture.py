"""The CUDA-graph lifecycle on CPU (refgdn.capture): the seed failures raise their named errors, the right
way passes, the planner's keys equal what the model launches, fast.keys equals fast's real launches.

The model is refgdn's Qwen3NextModel (tiny preset, float32) over ``traced_ops(refgdn)``: every GDN op
call reports the compile keys fast would launch for it (fast.keys), so the machine sees real keys while
the steps run at refgdn's speed. test_keys_match_fast_launches runs the fast ops themselves (Triton
interpreter) to tie fast.keys to the launchers.
"""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import fast
import fast.keys as fk
import refgdn
from refgdn import capture as cap
from refgdn.capture import (AllocationOutsidePool, AutotuneAfterReserve, CaptureDescriptor, CompileAfterReserve,
                            CompileDuringCapture, HostSyncInCapture, KeyLog, Lifecycle, ServingConfig,
                            SharedWarmupMetadata, StaleDraftMetadata, StaticBufferMoved, StepSpec, recording,
                            traced_ops)
from refgdn.model import Qwen3NextConfig, Qwen3NextModel

I32 = torch.int32
# Tests that launch fast's Triton kernels run them where they can: the interpreter on a CPU, the GPU when
# there is one (the refgdn-model tests stay on the CPU either way).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops: intra-op threads only contend (2 cores shared with xdist's other worker: 20x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    ops = traced_ops(refgdn)
    return Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops=ops, dtype=torch.float32, seed=3, check_values=False)


# ----------------------------------------------------------------------------------------------
# drivers: eager serving traffic (what a server does), and step factories for capture
# ----------------------------------------------------------------------------------------------

def _prefill(m, cache, lens, slots, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = m.device
    ids = torch.randint(0, m.config.vocab_size, (sum(lens),), generator=gen).to(dev)
    qsl = torch.tensor([0] + list(lens), device=dev).cumsum(0).to(I32)
    meta = m.metadata(cache, torch.tensor(slots, dtype=I32, device=dev), qsl, ids.shape[0])
    return m.prefill(cache, ids, meta)


def _decode(m, cache, slots, N=None):
    """One decode step of `slots`, padded to N rows (-1)."""
    N = N or len(slots)
    dev = m.device
    si = torch.full((N,), -1, dtype=I32, device=dev)
    si[:len(slots)] = torch.tensor(slots, dtype=I32, device=dev)
    ids = (torch.arange(N, device=dev) * 7 + 1) % m.config.vocab_size
    meta = m.metadata(cache, si, torch.arange(N + 1, dtype=I32, device=dev), N)
    return m.logits(m.decode(cache, ids, meta))


def _verify_accept(m, cache, slots, k, accepted):
    N = len(slots)
    dev = m.device
    si = torch.tensor(slots, dtype=I32, device=dev)
    ids = (torch.arange(N * (1 + k), device=dev) * 5 + 2) % m.config.vocab_size
    meta = m.metadata(cache, si, torch.arange(N + 1, dtype=I32, device=dev) * (1 + k), N * (1 + k))
    logits = m.logits(m.verify(cache, ids, meta))
    m.accept(cache, si, torch.tensor(accepted, dtype=I32, device=dev))
    return logits


def serving_traffic(m, k=2, prefill=True):
    """Eager traffic covering every class the planner lists for CFG (below): a prefill in each packed-length
    class of the interpreter's conv config (BT = 4, 8, 16, 32; one and two sequences), decodes and
    verify/accept rounds at N = 1..4."""
    cache = m.allocate_cache(4, 64, max_draft=k)
    for lens, slots in (([3], [0]), ([3, 4], [1, 2]), ([9], [3]), ([10, 10], [0, 1])) if prefill else ():
        _prefill(m, cache, lens, slots)
    for n in range(1, 5):
        slots = list(range(n))
        _decode(m, cache, slots)
        _verify_accept(m, cache, slots, k, [1 + (i % (k + 1)) for i in range(n)])
    return cache


CFG = ServingConfig(capture_batch_sizes=(1, 2, 4), max_draft=2, max_batch=4, max_prefill_tokens=24,
                    max_prefill_seqs=2)


def decode_step(m, cache, shared=None):
    """make_step for decode graphs: warmup and capture on padded rows only (slot -1: scratch), fresh metadata."""
    def make(desc, warmup):
        N = desc.batch
        ids = torch.zeros(N, dtype=torch.int64)
        meta = shared if shared is not None else m.metadata(cache, torch.full((N,), -1, dtype=I32),
                                                            torch.arange(N + 1, dtype=I32), N)
        return StepSpec(lambda: m.logits(m.decode(cache, ids, meta)), meta, {"ids": ids})
    return make


def verify_step(m, cache, warm_path="verify"):
    def make(desc, warmup):
        N, T = desc.batch, desc.tokens
        si = torch.full((N,), -1, dtype=I32)
        if warmup and warm_path == "decode":          # seeds 000/001: warmup through the non-speculative path
            ids = torch.zeros(N, dtype=torch.int64)
            meta = m.metadata(cache, si, torch.arange(N + 1, dtype=I32), N)
            return StepSpec(lambda: m.logits(m.decode(cache, ids, meta)), meta, {"ids": ids})
        ids = torch.zeros(N * T, dtype=torch.int64)
        meta = m.metadata(cache, si, torch.arange(N + 1, dtype=I32) * T, N * T)
        return StepSpec(lambda: m.logits(m.verify(cache, ids, meta)), meta, {"ids": ids})
    return make


class DraftState:
    """Static buffers of the captured MTP draft step: ids [N], hidden [N, hidden], the step index (a
    device scalar) and the draft tokens [N, k] (column `step` written inside the graph)."""

    def __init__(self, m, N, k):
        self.ids = torch.zeros(N, dtype=torch.int64)
        self.hidden = torch.zeros(N, m.config.hidden_size)
        self.step = torch.zeros((), dtype=torch.int64)
        self.drafts = torch.zeros(N, k, dtype=torch.int64)


def draft_fn(m, cache, st: DraftState, meta):
    def fn():
        h = m.mtp(cache, st.ids, st.hidden, meta)
        tok = m.logits(h).argmax(-1)
        st.drafts.index_copy_(1, st.step.reshape(1), tok[:, None])      # column `step`, chosen on the device
        st.ids.copy_(tok)                                                # fed back to the next draft step
        st.hidden.copy_(h)
        return tok
    return fn


def draft_step(m, cache, k, states):
    def make(desc, warmup):
        st = DraftState(m, desc.batch, k)
        if not warmup:
            states[desc] = st
        N = desc.batch
        meta = m.metadata(cache, torch.full((N,), -1, dtype=I32), torch.arange(N + 1, dtype=I32), N, mtp=True)
        return StepSpec(draft_fn(m, cache, st, meta), meta, {"ids": st.ids, "hidden": st.hidden},
                        step_index=st.step, position_fields=("positions", "seq_lens", "slot_mapping"))
    return make


def ready(m, k=2, profile=True):
    """A lifecycle past profile (CFG's decode / verify / accept variants launched: these tests prefill only
    outside the recorder, and refgdn's chunked prefill is the slow part on a CPU) and reserve; (lc, cache)."""
    lc = Lifecycle("cpu")
    if profile:
        lc.profile(lambda: serving_traffic(m, k, prefill=False))
    else:
        lc.profile(lambda: None)
    cache = lc.reserve(lambda: m.allocate_cache(4, 64, max_draft=k))
    return lc, cache


# ----------------------------------------------------------------------------------------------
# keys and planner
# ----------------------------------------------------------------------------------------------

def test_keys_match_fast_launches():
    """fast.keys predicts exactly the Triton launches of every fast op (traced_ops(fast) raises otherwise)."""
    H, HV, K, V, W = 1, 2, 16, 16, 4
    D = 2 * H * K + HV * V
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    t = lambda *a, **kw: torch.tensor(*a, **kw, device=DEV)  # noqa: E731
    cache = fast.GDNStateCache.allocate(4, H, HV, K, V, conv_width=W, max_draft=2, state_dtype=torch.float32,
                                        act_dtype=torch.float32, device=DEV)
    F = traced_ops(fast)
    si = t([0, 2], dtype=I32)
    w, bias, A, dt = r(D, W), r(D), r(HV), r(HV)
    log = KeyLog()
    with recording(log):
        F.gdn_decode(r(2, D), r(2, HV), r(2, HV), w, bias, A, dt, cache, si)
        F.gdn_verify(r(6, D), r(6, HV), r(6, HV), w, None, A, dt, cache, si, t([0, 3, 6], dtype=I32))
        F.gdn_accept(cache, si, t([1, 3], dtype=I32))
        F.gdn_materialize(cache, si)
        q, k, v = r(1, 20, H, K), r(1, 20, H, K), r(1, 20, HV, V)
        g, beta = -torch.rand(1, 20, HV, generator=gen).to(DEV), torch.rand(1, 20, HV, generator=gen).to(DEV)
        F.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 chunk_size=fk.bt_rule(20), cu_seqlens=t([0, 5, 20]))
        F.recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        F.fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, None, None, True)    # (fla's order)
        F.causal_conv1d(r(1, 20, D), w, bias, "silu", None, True, t([0, 5, 20]))
        F.causal_conv1d_update(r(2, D), r(2, D, W - 1), w, bias, "silu")
        F.gdn_gating(A, r(2, HV), dt, r(2, HV))
        F.l2norm(q)
        F.rms_norm_gated(v, r(1, 20, HV, 2 * V)[..., V:], r(V), None, "swish", eps=1e-6)   # z: a strided slice
    names = [key.kernel for key in log.launched]
    assert names.count("gdn_step_kernel") == 3 and "chunk_state_kernel" in names and "accept_kernel" in names
    # prefill: kernels 1 and 3 (the state pass forms v_new itself: kernel 2 never runs in the forward), kernel 4
    # unless the pass forms o too (fast.chunk.state_fuses_output), then q's row scales for it (l2norm in the
    # kernel), and, varlen without cu_seqlens' values on the host, every kernel's chunk tables built on the device
    fused = fast.chunk.state_fuses_output(2, HV, K, V, torch.device(DEV))
    prefill = 4
    assert "chunk_table_kernel" in names and ("row_scales_kernel" in names) == fused
    assert "chunk_w_u_kernel" not in names and ("chunk_output_kernel" in names) == (not fused)
    # 2 + 2 + 1 + 2 (serving) + prefill + 2 (recurrent, under both names) + 3 + 1 (conv: its tile table, built on
    # the device after the host's check, the conv, its final states; then the update) + 1 (gating) + 1 (l2norm)
    # + 1 (the gated norm)
    assert len(log.launched) == 16 + prefill and names.count("recurrent_kernel") == 2
    assert names.count("chunk_table_kernel") == 2
    assert names[-1] == "rms_norm_fwd_kernel"


def test_keys_match_beta_logits_launches():
    """Beta as logits (fla's use_beta_sigmoid_in_kernel, allow_neg_eigval): the chunk op maps it with torch (float32
    beta; this unfused pass loads it one chunk ahead, as state_prefetch_beta rules), the recurrent kernel takes the
    logits (BETA_LOGITS 2, beta in its own dtype); fast.keys predicts those launches exactly (traced_ops raises
    otherwise).
    With a gradient wanted the recurrent op maps with torch too."""
    H, HV, K, V = 1, 2, 16, 16
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    q, k, v = r(1, 20, H, K), r(1, 20, H, K), r(1, 20, HV, V)
    g, logits = -torch.rand(1, 20, HV, generator=gen).to(DEV), r(1, 20, HV).half()
    F = traced_ops(fast)
    kw = dict(output_final_state=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    log = KeyLog()
    with recording(log):
        F.chunk_gated_delta_rule(q, k, v, g, logits, chunk_size=16, **kw)
        F.recurrent_gated_delta_rule(q, k, v, g, logits, **kw)
    by = {key.kernel: key for key in log.launched}
    for name in ("chunk_kkt_inv_kernel", "chunk_state_kernel"):        # (keys hold dtype names)
        assert dict(by[name].constexprs)["BETA_LOGITS"] == 0 and dict(by[name].dtypes)["beta"] == str(torch.float32)
    assert dict(by["chunk_state_kernel"].constexprs)["PREFETCH_BETA"] is True
    assert dict(by["recurrent_kernel"].constexprs)["BETA_LOGITS"] == 2
    assert dict(by["recurrent_kernel"].dtypes)["beta"] == str(torch.float16)
    key = fk.recurrent_gated_delta_rule(q, k, v, g, logits.requires_grad_(), **kw)[0]
    assert dict(key.constexprs)["BETA_LOGITS"] == 0 and dict(key.dtypes)["beta"] == str(torch.float32)


def test_every_fast_op_declares_its_compile_key():
    """fast.keys has a key function for every public fast op, with the op's parameters (then keyword-only extras)."""
    import inspect
    for name in fast.__all__:
        op = getattr(fast, name)
        if inspect.isclass(op):
            continue
        params = list(inspect.signature(op).parameters)
        kparams = list(inspect.signature(getattr(fk, name)).parameters)
        assert kparams[:len(params)] == params, name
        assert all(inspect.signature(getattr(fk, name)).parameters[p].kind == inspect.Parameter.KEYWORD_ONLY
                   for p in kparams[len(params):]), name


def test_bt_rule_and_prefill_lengths():
    assert [fk.bt_rule(T) for T in (1, 15, 16, 17, 32, 33, 64, 65, 4096)] == [16, 16, 16, 32, 32, 64, 64, 64, 64]
    lens = fk.prefill_lengths(64)
    assert {fk.bt_rule(T) for T in lens} == {16, 32, 64} and 1 in lens and any(T % 16 for T in lens)


def test_planner_equals_keys_of_the_eager_run(model):
    """plan(model, CFG).keys == the keys the model's eager serving traffic launches (no more, no fewer)."""
    log = KeyLog()
    with recording(log):
        serving_traffic(model, CFG.max_draft)
    p = cap.plan(model, CFG)
    assert log.keys, "the traced model launched nothing"
    missing, extra = p.keys - log.keys, log.keys - p.keys
    assert not missing and not extra, f"planner-only: {sorted(map(str, missing))}; run-only: {sorted(map(str, extra))}"
    decode = p.for_descriptor(CaptureDescriptor("decode", 4))
    assert {key.kernel for key in decode} == {"conv_step_kernel", "gdn_step_kernel", "rms_norm_fwd_kernel"}
    assert p.for_descriptor(CaptureDescriptor("verify", 2, 3)) != decode


def test_planner_draft_keys_are_the_mtp_heads_norms(model):
    """A draft step launches the MTP head's norms (hidden rows and its attention's q / k norms), nothing of the GDN
    core; a model without an MTP head has no draft graph, and the planner lists nothing for one."""
    p = cap.plan(model, CFG)
    draft = p.for_descriptor(CaptureDescriptor("draft", 2))
    assert {key.kernel for key in draft} == {"rms_norm_fwd_kernel"}
    assert {dict(key.constexprs)["D"] for key in draft} == {model.config.hidden_size, model.config.head_dim}
    no_mtp = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops=traced_ops(refgdn), dtype=torch.float32, seed=3,
                            mtp=False, check_values=False)
    assert cap.plan(no_mtp, CFG).for_descriptor(CaptureDescriptor("draft", 2)) == set()


def test_planner_equals_real_triton_launches_of_the_fast_model():
    """The same with the model on fast ops: the recorder sees fast's real Triton launches (interpreter)."""
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="fast", dtype=torch.float32, seed=3, device=DEV)
    log = KeyLog()
    with recording(log):
        serving_traffic(m, CFG.max_draft)
    p = cap.plan(m, dataclasses.replace(CFG, device=DEV))
    missing, extra = p.keys - log.keys, log.keys - p.keys
    assert not missing and not extra, f"planner-only: {sorted(map(str, missing))}; run-only: {sorted(map(str, extra))}"


# ----------------------------------------------------------------------------------------------
# the right way: the whole lifecycle with the model, graph replay == eager bit for bit
# ----------------------------------------------------------------------------------------------

def _same_cache(a, b):
    for x, y in zip(a.gdn, b.gdn):
        for s, t in zip(x.tensors(), y.tensors()):
            assert torch.equal(s, t)
    for x, y in zip(a.kv + a.mtp_kv, b.kv + b.mtp_kv):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)
    assert torch.equal(a.kv_lens_buf, b.kv_lens_buf) and torch.equal(a.mtp_kv_lens_buf, b.mtp_kv_lens_buf)


def test_profile_must_cover_the_plan(model):
    lc = Lifecycle("cpu")
    lc.profile(lambda: serving_traffic(model, 2, prefill=False))       # no prefill in profile
    assert lc.peak_bytes > 0
    p = cap.plan(model, CFG)
    with pytest.raises(CompileAfterReserve, match=r"profile did not launch \d+ planned .*chunk_kkt_inv_kernel"):
        lc.check_profiled(p.keys)
    lc.check_profiled(set().union(*(p.steps[str(d)] for d in CFG.descriptors())))   # the graphs' keys: covered


def test_lifecycle_right_way_replay_equals_eager(model):
    m, k = model, 2
    lc, cache = ready(m, k)
    states = {}
    for desc in (CaptureDescriptor("decode", 2), CaptureDescriptor("decode", 4), CaptureDescriptor("verify", 2, 1 + k),
                 CaptureDescriptor("draft", 2)):
        make = {"decode": decode_step(m, cache), "verify": verify_step(m, cache),
                "draft": draft_step(m, cache, k, states)}[desc.mode]
        lc.capture(desc, make)
    assert lc.steps[CaptureDescriptor("verify", 2, 3)].capture_keys == \
        cap.plan(m, CFG).for_descriptor(CaptureDescriptor("verify", 2, 3))
    _prefill(m, cache, [5, 3], [0, 1])
    twin = cache.clone()
    for rnd in range(3):
        # decode, 2 real requests padded to the N = 4 graph; the twin runs the same padded step eagerly
        desc = lc.descriptor_for("decode", 2)
        assert desc == CaptureDescriptor("decode", 2) and lc.descriptor_for("decode", 5) is None
        si = torch.tensor([0, 1, -1, -1], dtype=I32)
        ids = torch.tensor([rnd + 3, 7, 0, 0])
        qsl = torch.arange(5, dtype=I32)
        out = lc.replay(CaptureDescriptor("decode", 4), {"ids": ids}, m.metadata(cache, si, qsl, 4))
        ref = m.logits(m.decode(twin, ids, m.metadata(twin, si, qsl, 4)))
        assert torch.equal(out, ref)
        _same_cache(cache, twin)
        # verify k = 2 and a partial accept
        si2, qv = torch.tensor([0, 1], dtype=I32), torch.tensor([0, 3, 6], dtype=I32)
        vids = torch.arange(6) + rnd
        out = lc.replay(CaptureDescriptor("verify", 2, 3), {"ids": vids}, m.metadata(cache, si2, qv, 6))
        ref = m.logits(m.verify(twin, vids, m.metadata(twin, si2, qv, 6)))
        assert torch.equal(out, ref)
        acc = torch.tensor([1 + rnd % 3, 2], dtype=I32)
        m.accept(cache, si2, acc)
        m.accept(twin, si2, acc)
        _same_cache(cache, twin)
        # k draft steps: one graph, replayed per step with metadata rebuilt for that step
        st = states[CaptureDescriptor("draft", 2)]
        hid = torch.randn(2, m.config.hidden_size, generator=torch.Generator().manual_seed(rnd))
        tid = torch.tensor([5, 9])
        st.ids.copy_(tid)
        st.hidden.copy_(hid)
        ref_tok = []
        for step in range(k):
            meta = m.metadata(cache, si2, torch.arange(3, dtype=I32), 2, mtp=True)
            lc.replay_draft(CaptureDescriptor("draft", 2), step, meta)
            h = m.mtp(twin, tid, hid, m.metadata(twin, si2, torch.arange(3, dtype=I32), 2, mtp=True))
            tid = m.logits(h).argmax(-1)
            hid = h
            ref_tok.append(tid)
        assert torch.equal(st.drafts, torch.stack(ref_tok, 1))
        _same_cache(cache, twin)
    # an eager batch above the largest graph still runs (its variants were profiled)
    lc.eager(lambda: _decode(m, cache, [0, 1, 2], N=3))


# ----------------------------------------------------------------------------------------------
# the seeds, the wrong way: each raises its named error
# ----------------------------------------------------------------------------------------------

def test_seed_000_001_warmup_non_speculative_then_capture_speculative(model):
    m = model
    # profile and warmup through the non-speculative path only: the verify variants are first seen in capture
    lc, cache = ready(m, profile=False)           # a profile that launched nothing: warmup is a first compile
    # (the step's first launch: the first layer's input norm)
    with pytest.raises(CompileAfterReserve, match=r"warmup of decode\[N=2, T=1\]: kernel variant rms_norm_fwd_kernel"
                                                  r"\[.*GATE=2"):
        lc.capture(CaptureDescriptor("decode", 2), decode_step(m, cache))
    lc = Lifecycle("cpu")
    lc.profile(lambda: _decode(m, m.allocate_cache(2, 16, max_draft=2), [0, 1]))
    cache = lc.reserve(lambda: m.allocate_cache(4, 64, max_draft=2))
    with pytest.raises(CompileDuringCapture, match=r"verify\[N=2, T=3\].*conv_step_kernel.*TMAX=3.*never launched"):
        lc.capture(CaptureDescriptor("verify", 2, 3), verify_step(m, cache, warm_path="decode"))
    # profile covered verify, but this descriptor's warmup took the decode path: still caught, naming the key
    lc, cache = ready(m)
    with pytest.raises(CompileDuringCapture, match=r"not launched by this descriptor's warmup"):
        lc.capture(CaptureDescriptor("verify", 2, 3), verify_step(m, cache, warm_path="decode"))
    # the fix (warmup = the capture's path) passes
    lc.capture(CaptureDescriptor("verify", 4, 3), verify_step(m, cache))


def _gdn_prefill(ops, T, chunk_size, seed=0):
    H, HV, K, V = 1, 2, 16, 16
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, h, d, generator=gen) for h, d in ((H, K), (H, K), (HV, V)))
    g, beta = -torch.rand(1, T, HV, generator=gen), torch.rand(1, T, HV, generator=gen)
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=chunk_size)


def test_seed_003_bt_variant_after_reserve():
    ops = traced_ops(refgdn)
    lc = Lifecycle("cpu")
    lc.profile(lambda: _gdn_prefill(ops, 64, fk.bt_rule(64)))              # only BT = 64 warmed
    lc.reserve(lambda: None)
    lc.serve()
    lc.eager(lambda: _gdn_prefill(ops, 50, fk.bt_rule(50)))                 # BT = 64 again: fine
    with pytest.raises(CompileAfterReserve, match=r"chunk_kkt_inv_kernel\[.*BT=32.*first launched after the cache"):
        lc.eager(lambda: _gdn_prefill(ops, 20, fk.bt_rule(20)))
    # the fix: profile every BT the rule can select (T = 16, 32, 64)
    lc = Lifecycle("cpu")
    lc.profile(lambda: [_gdn_prefill(ops, T, fk.bt_rule(T)) for T in fk.prefill_lengths(64)])
    lc.reserve(lambda: None)
    lc.serve()
    for T in (3, 20, 40, 64):
        lc.eager(lambda: _gdn_prefill(ops, T, fk.bt_rule(T)))


@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
@triton.jit
def _tuned_scale_kernel(x, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)


@triton.jit
def _pinned_scale_kernel(x, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)


def test_seed_003_kernel_that_would_autotune_at_run_time():
    x = torch.ones(40, device=DEV)
    lc = Lifecycle(DEV)
    lc.profile(lambda: _pinned_scale_kernel[(3,)](torch.ones(40, device=DEV), 40, BLOCK=16))
    lc.reserve(lambda: None)
    # an in-place kernel with several configs and an untuned key: raised before any benchmark re-runs it
    with pytest.raises(AutotuneAfterReserve,
                       match=r"_tuned_scale_kernel would autotune for key \(40, 'torch.float32'\)"):
        lc.eager(lambda: _tuned_scale_kernel[(3,)](x, 40))
    assert torch.equal(x.cpu(), torch.ones(40)), "the kernel ran although the guard fired"
    lc.eager(lambda: _pinned_scale_kernel[(3,)](x, 40, BLOCK=16))           # pinned and profiled: fine
    assert torch.equal(x.cpu(), torch.full((40,), 2.0))


class LazyBackendMeta:
    """A metadata object with a lazily initialised workspace (FlashMLA-style): the first step that uses it
    zeroes the workspace and flips `initialized`; later steps skip that."""

    def __init__(self, N):
        self.initialized = False
        self.workspace = torch.full((N,), float("nan"))
        self.scale = torch.ones(N)


def lazy_step(meta, x):
    if not meta.initialized:
        meta.workspace.zero_()
        meta.initialized = True
    return (x + meta.workspace) * meta.scale


def test_seed_004_warmup_and_capture_share_lazy_metadata():
    lc = Lifecycle("cpu")
    lc.profile(lambda: None)
    lc.reserve(lambda: None)
    x = torch.ones(4)
    shared = {}

    def make_shared(desc, warmup):               # the bug: one cached metadata object per descriptor
        meta = shared.setdefault(desc, LazyBackendMeta(desc.batch))
        return StepSpec(lambda: lazy_step(meta, x), meta, {"x": x})

    with pytest.raises(SharedWarmupMetadata, match=r"decode\[N=4, T=1\].*same metadata object.*initialized"):
        lc.capture(CaptureDescriptor("decode", 4), make_shared)

    backend = LazyBackendMeta(2)

    class Meta:
        def __init__(self):
            self.backend = backend               # distinct top-level objects sharing the lazy backend state
            self.positions = torch.zeros(2, dtype=I32)

    def make_nested(desc, warmup):
        meta = Meta()
        return StepSpec(lambda: lazy_step(meta.backend, x[:2]), meta)

    with pytest.raises(SharedWarmupMetadata, match=r"share the mutable object.*backend"):
        lc.capture(CaptureDescriptor("decode", 2), make_nested)

    def make_fresh(desc, warmup):                # the fix: separate objects for warmup and capture
        meta = LazyBackendMeta(desc.batch)
        return StepSpec(lambda: lazy_step(meta, x[:desc.batch]), meta)

    out = lc.capture(CaptureDescriptor("decode", 1), make_fresh)
    assert torch.equal(lc.replay(CaptureDescriptor("decode", 1)), torch.ones(1)) and torch.equal(out, torch.ones(1))


def test_seed_002_draft_step_replayed_with_step0_metadata(model):
    m, k = model, 3
    lc, cache = ready(m, k=2)
    states = {}
    desc = CaptureDescriptor("draft", 2)
    lc.capture(desc, draft_step(m, cache, k, states))
    _prefill(m, cache, [4, 6], [0, 1])
    si = torch.tensor([0, 1], dtype=I32)
    meta0 = m.metadata(cache, si, torch.arange(3, dtype=I32), 2, mtp=True)
    lc.replay_draft(desc, 0, meta0)
    with pytest.raises(StaleDraftMetadata, match=r"draft\[N=2, T=1\]: draft step 1 .*step 0's in \['positions'"):
        lc.replay_draft(desc, 1, meta0)                        # the bug: step 0's positions again
    # the fix: rebuild after every step (the MTP lengths advanced on the device), for k = 3 steps
    for step in range(k):
        lc.replay_draft(desc, step, m.metadata(cache, si, torch.arange(3, dtype=I32), 2, mtp=True))
    assert torch.equal(states[desc].step, torch.tensor(k - 1))


def test_draft_step_index_must_be_a_device_scalar():
    """A draft step with its index as a Python int: the simulated graph bakes it in exactly as a CUDA graph
    would (every replay writes column 0); the lifecycle refuses such a capture."""
    lc = Lifecycle("cpu")
    lc.profile(lambda: None)
    lc.reserve(lambda: None)
    out = torch.zeros(3)
    step = {"i": 0}

    def baked(desc, warmup):
        i = step["i"]                                   # read when the graph is made: baked in
        return StepSpec(lambda: out.index_fill_(0, torch.full((1,), i, dtype=torch.long), 1.0))

    with pytest.raises(StaleDraftMetadata, match=r"draft\[N=1, T=1\].*device scalar"):
        lc.capture(CaptureDescriptor("draft", 1), baked)
    g = cap.SimulatedGraph("baked")                     # what the capture would have produced
    with cap._DispatchGuard("baked", g):
        out.index_fill_(0, torch.zeros(1, dtype=torch.long), 1.0)
    out.zero_()
    for s_ in range(3):
        step["i"] = s_
        g.replay()
    assert out.tolist() == [1.0, 0.0, 0.0], "a replay saw a new step index: the simulation is not a graph"


def test_host_syncs_allocations_and_moved_buffers(model):
    m = model
    lc, cache = ready(m)
    x = torch.arange(4.0)
    cases = [
        (lambda: x * x.sum().item(), HostSyncInCapture, r"Tensor.item\(\)"),
        (lambda: x.cpu() + 1, HostSyncInCapture, r"Tensor.cpu\(\)"),
        (lambda: x[x > 1].sum(), HostSyncInCapture, r"data-dependent"),
        (lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), AllocationOutsidePool, r"host memory"),
        (lambda: (torch.zeros(4, device="meta"), x * 2)[1], AllocationOutsidePool,
         r"device=meta.*outside the graph pool"),
    ]
    for i, (fn, err, msg) in enumerate(cases):
        with pytest.raises(err, match=msg):
            lc.capture(CaptureDescriptor("decode", 10 + i), lambda d, w, fn=fn: StepSpec(fn))
    # the model with host value checks on (the refgdn default) is not capturable: .tolist() in _check_values
    m.check_values = True
    try:
        with pytest.raises(HostSyncInCapture, match=r"tolist"):
            lc.capture(CaptureDescriptor("decode", 2), decode_step(m, cache))
    finally:
        m.check_values = False
    # static buffers must keep their addresses: a replaced input, a replaced metadata field, a re-allocated cache
    desc = CaptureDescriptor("decode", 4)
    lc.capture(desc, decode_step(m, cache))
    lc.watch("gdn[0].ssm_state", lambda: cache.gdn[0].ssm_state)
    st = lc.steps[desc]
    lc.replay(desc)
    st.spec.inputs["ids"] = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(StaticBufferMoved, match=r"inputs.ids moved since capture"):
        lc.replay(desc)
    lc.steps.pop(desc)
    lc.capture(desc, decode_step(m, cache))
    lc.steps[desc].spec.metadata.positions = torch.zeros(4, dtype=I32)
    with pytest.raises(StaticBufferMoved, match=r"metadata.positions moved"):
        lc.replay(desc)
    lc.steps.pop(desc)
    lc.capture(desc, decode_step(m, cache))
    cache.gdn[0].ssm_state = cache.gdn[0].ssm_state.clone()
    with pytest.raises(StaticBufferMoved, match=r"gdn\[0\].ssm_state moved"):
        lc.replay(desc)


def test_phase_order_is_enforced(model):
    lc = Lifecycle("cpu")
    with pytest.raises(cap.PhaseError):
        lc.capture(CaptureDescriptor("decode", 1), lambda d, w: StepSpec(lambda: None))
    lc.profile(lambda: None)
    with pytest.raises(cap.PhaseError):
        lc.replay(CaptureDescriptor("decode", 1))
    with pytest.raises(ValueError, match="mode"):
        CaptureDescriptor("prefill", 1)


def test_graphed_model_on_cpu_equals_eager(model):
    """fast.graphs.GraphedModel with simulated graphs (CPU): decode / verify / draft through graphs, padded
    and above the largest graph, equal an eager twin bit for bit; cuda_graphs=False runs eagerly."""
    from fast.graphs import GraphedModel
    m, k = model, 2
    cfg = ServingConfig(capture_batch_sizes=(2, 4), max_draft=k, max_batch=5, max_prefill_tokens=1,
                        max_prefill_seqs=1)        # (the test's own prefills run outside the recorder)
    from fast.graphs import profile_traffic
    gm = GraphedModel(m, batch_sizes=(2, 4), max_draft=k, num_slots=5, max_len=64).setup(
        profile=lambda: profile_traffic(m, cfg))
    assert sorted(map(str, gm.lc.steps)) == sorted(map(str, cfg.descriptors()))
    eager = GraphedModel(m, cache=gm.cache.clone(), batch_sizes=(2, 4), max_draft=k, cuda_graphs=False).setup()
    eager.lc.seen_keys |= gm.lc.seen_keys            # the twin shares the process's profiled variants
    for g in (gm, eager):
        _prefill(m, g.cache, [3, 5, 2], [0, 1, 2])
    for n in (1, 3, 5):                                    # 1, 3: padded graphs; 5: above the largest -> eager
        si = torch.arange(n, dtype=I32)
        ids = torch.arange(n) + 11
        a, b = gm.decode(ids, si), eager.decode(ids, si)
        assert a.shape == (n, m.config.vocab_size) and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        vids = torch.arange(n * (1 + k)) % 50
        a, b = gm.verify(vids, si, k), eager.verify(vids, si, k)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        for g in (gm, eager):
            g.accept(si, torch.full((n,), 2, dtype=I32))
    si = torch.arange(2, dtype=I32)
    hid = torch.randn(2, m.config.hidden_size, generator=torch.Generator().manual_seed(1))
    toks = [gm.draft(0, si, torch.tensor([4, 6]), hid)] + [gm.draft(s, si) for s in range(1, k)]
    ref, tid, h = [], torch.tensor([4, 6]), hid
    for s in range(k):
        h = m.mtp(eager.cache, tid, h, m.metadata(eager.cache, si, torch.arange(3, dtype=I32), 2, mtp=True))
        tid = m.logits(h).argmax(-1)
        ref.append(tid)
    assert all(torch.equal(a, b) for a, b in zip(toks, ref))


def test_graphed_model_state_dtype(model):
    """GraphedModel(state_dtype=bfloat16) (vLLM's default SSM cache dtype) with a plan of that state dtype: the
    profile launches on such a cache, the reserved cache holds it, and graph replays equal the eager twin's steps
    bit for bit, states included."""
    from fast.graphs import GraphedModel, profile_traffic
    bf16 = torch.bfloat16
    cfg = ServingConfig(capture_batch_sizes=(2,), max_draft=1, max_batch=2, max_prefill_tokens=1, max_prefill_seqs=1,
                        state_dtype=bf16)
    gm = GraphedModel(model, batch_sizes=(2,), max_draft=1, num_slots=2, max_len=32, state_dtype=bf16).setup(
        profile=lambda: profile_traffic(model, cfg))
    assert [c.ssm_state.dtype for c in gm.cache.gdn] == [bf16] * len(gm.cache.gdn)
    eager = GraphedModel(model, cache=gm.cache.clone(), batch_sizes=(2,), max_draft=1, cuda_graphs=False).setup()
    eager.lc.seen_keys |= gm.lc.seen_keys
    for g in (gm, eager):
        _prefill(model, g.cache, [3, 2], [0, 1])
    si = torch.arange(2, dtype=I32)
    for step in range(3):
        ids = torch.tensor([7 + step, 20 + step])
        assert torch.equal(gm.decode(ids, si), eager.decode(ids, si))
    for a, b in zip(gm.cache.gdn, eager.cache.gdn):
        assert torch.equal(a.ssm_state, b.ssm_state) and torch.equal(a.conv_state, b.conv_state)


def test_speculative_loop_over_graphs_is_lossless():
    """refgdn.speculative's loop on fast.graphs.GraphedSteps (simulated graphs, float64 model): greedy
    speculative tokens == plain greedy tokens, with decode / verify / draft steps served from graphs, verifies
    of mixed k (requests near their budget draft fewer) included."""
    from fast.graphs import GraphedModel, GraphedSteps, profile_traffic
    from refgdn.speculative import generate_plain, generate_speculative
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops=traced_ops(refgdn), dtype=torch.float64, seed=5,
                       check_values=False)
    k = 3
    cfg = ServingConfig(capture_batch_sizes=(2, 4), max_draft=k, max_batch=3, max_prefill_tokens=12,
                        max_prefill_seqs=3)      # the prompts below: 12 tokens in 3 sequences
    gm = GraphedModel(m, batch_sizes=(2, 4), max_draft=k, num_slots=3, max_len=64).setup(
        profile=lambda: profile_traffic(m, cfg))
    gs = GraphedSteps(gm)
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 8, 1, 6]]
    plain = generate_plain(m, prompts, 8)   # the reference (its own cache: max_draft 0, other variants)
    # (GraphedSteps runs what no graph fits under the lifecycle: a variant not profiled would raise)
    spec = generate_speculative(gs, prompts, 8, k, cache=gs.cache)
    n_spec = gs.replays
    again = generate_plain(gs, prompts, 8, cache=gs.cache)
    assert spec.tokens == plain.tokens and again.tokens == plain.tokens
    assert n_spec > 0 and gs.replays > n_spec, "no step was served from a graph"
    assert gs.padded_verifies > 0, "no verify of mixed k was served from a graph"
    for mode in ("decode", "verify", "draft"):
        assert any(st.graph.graph.replays for st in gm.lc.steps.values() if st.desc.mode == mode), mode


def _graphed_pair():
    """A float64 tiny model (refgdn ops) with graphs for 2 requests and up to 3 drafts, two prompts prefilled in
    slots 1 and 0: (model, GraphedModel, GraphedSteps)."""
    from fast.graphs import GraphedModel, GraphedSteps, profile_traffic
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops=traced_ops(refgdn), dtype=torch.float64, seed=5,
                       check_values=False)
    cfg = ServingConfig(capture_batch_sizes=(2,), max_draft=3, max_batch=2, max_prefill_tokens=8, max_prefill_seqs=2)
    gm = GraphedModel(m, batch_sizes=(2,), max_draft=3, num_slots=2, max_len=16).setup(
        profile=lambda: profile_traffic(m, cfg))
    _prefill(m, gm.cache, [3, 5], [1, 0])
    return m, gm, GraphedSteps(gm)


@pytest.mark.parametrize("lens", [[2, 4], [3, 1], [1, 3]], ids=["short-first", "short-last", "k0-first"])
def test_mixed_k_verify_from_the_uniform_graph_equals_eager(lens):
    """GraphedSteps.verify of requests with different draft counts (each padded in its row of the graph of the
    longest): the outputs, in packed order, are the eager packed step's; after the same accept, a decode step of
    both caches gives the same logits (committed states and the KV rows the lengths cover agree; the padding's
    K/V rows past them are never read)."""
    m, gm, gs = _graphed_pair()
    twin = gm.cache.clone()
    slots = torch.tensor([1, 0], dtype=I32)
    ids = torch.randint(0, m.config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(2))
    qsl = torch.tensor([0, lens[0], sum(lens)], dtype=I32)
    n0 = gs.padded_verifies
    h = gs.verify(gs.cache, ids, m.metadata(gs.cache, slots, qsl, sum(lens)))
    assert gs.padded_verifies == n0 + 1
    want = m.verify(twin, ids, m.metadata(twin, slots, qsl, sum(lens)))
    torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gs.logits(h), m.logits(want), rtol=1e-12, atol=1e-12)
    acc = torch.tensor([max(1, L - 1) for L in lens], dtype=I32)
    gs.accept(gs.cache, slots, acc)
    m.accept(twin, slots, acc)
    nxt = torch.tensor([7, 9])
    one = torch.arange(3, dtype=I32)
    got = m.logits(m.decode(gs.cache, nxt, m.metadata(gs.cache, slots, one, 2)))
    torch.testing.assert_close(got, m.logits(m.decode(twin, nxt, m.metadata(twin, slots, one, 2))),
                               rtol=1e-12, atol=1e-12)


def test_mixed_k_verify_from_a_graph_refuses_to_accept_its_padding():
    """After a padded verify, accepting more tokens than a request brought faults (as after the eager verify) and
    commits nothing of that request: the padding is never accepted."""
    m, gm, gs = _graphed_pair()
    slots, qsl = torch.tensor([1, 0], dtype=I32), torch.tensor([0, 2, 6], dtype=I32)
    gs.verify(gs.cache, torch.arange(6), m.metadata(gs.cache, slots, qsl, 6))
    assert gs.padded_verifies == 1
    before = gs.cache.clone()
    with pytest.raises(ValueError, match=r"num_accepted\[0\]"):
        gs.accept(gs.cache, slots, torch.tensor([3, 2], dtype=I32))      # request 0 brought 2 tokens
        gs.cache.check()
    for s_, t_ in zip(gs.cache.gdn[0].tensors(), before.gdn[0].tensors()):
        assert torch.equal(s_[1], t_[1])                                  # slot 1 (request 0): nothing committed
