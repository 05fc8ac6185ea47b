"""CUDA graphs for the model on a GPU (fast.graphs): capture compiles nothing, Triton's compiled keys equal the
planner's, graph replay equals eager bit for bit, and the real failure of an un-warmed capture.

Each lifecycle runs in a fresh subprocess so Triton's in-process caches start empty (the compile counts
then mean what they say). Skipped without a GPU.
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

I32 = torch.int32


def _run(code: str, timeout=900) -> str:
    # A file, not `python -c`: @triton.jit reads its function's source with inspect, which needs a file.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(code))
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the repo, as `-c` had it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, f.name], capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        os.unlink(f.name)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_capture_compiles_nothing_and_compiled_keys_equal_plan(state_dtype):
    """(bfloat16: the plan and the profile on a bfloat16 GDN state, vLLM's default; the profile allocated float32
    states whatever the plan said until 2026-11-28, so such a plan could never have been covered.)"""
    out = _run(f"""
        import json, torch
        from fast.graphs import lifecycle_report
        print("REPORT", json.dumps(lifecycle_report("tiny", torch.bfloat16, batch_sizes=(1, 2, 4, 8), max_draft=5,
                                                    state_dtype=torch.{state_dtype})))
    """)
    rep = json.loads(out.split("REPORT", 1)[1])
    print(json.dumps({k: v for k, v in rep.items() if k not in ("planned", "compiled")}, indent=1))
    assert rep["compiles_per_phase"].get("capture", 0) == 0
    assert rep["compiles_per_phase"].get("serve", 0) == 0 and rep["compiles_per_phase"].get("warmup", 0) == 0
    assert rep["compiles_per_phase"].get("profile", 0) > 0, "the counter saw no compilation at all"
    assert not rep["planned_not_compiled"] and not rep["compiled_not_planned"], rep
    assert not rep["first_seen_after_profile"]
    assert len(rep["captured"]) == 4 * (1 + 5 + 1)


def _twin(m, cache):
    return cache.clone()


def _same(a, b):
    for x, y in zip(a.gdn, b.gdn):
        for s, t in zip(x.tensors(), y.tensors()):
            assert torch.equal(s, t)
    for x, y in zip(a.kv + a.mtp_kv, b.kv + b.mtp_kv):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)
    assert torch.equal(a.kv_lens_buf, b.kv_lens_buf) and torch.equal(a.mtp_kv_lens_buf, b.mtp_kv_lens_buf)


@pytest.mark.parametrize("dtype,family,state_dtype", [
    pytest.param(torch.bfloat16, {}, torch.float32, id="bf16"),
    pytest.param(torch.float32, {}, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, dict(model_type="qwen3_5_moe_text"), torch.float32, id="bf16-qwen3_5_moe"),
    pytest.param(torch.bfloat16, {}, torch.bfloat16, id="bf16-bf16-state"),
])
def test_graph_replay_equals_eager_bit_for_bit(dtype, family, state_dtype):
    """Greedy speculative rounds with k = 1..5 on padded batches: graph and eager (same padded shapes)
    give equal logits, accepted tokens, GDN states, conv windows, KV caches and lengths, every round
    (Qwen3-Next's tiny preset, and the same as a Qwen3.5-MoE: its split GDN projections, every MLP routed;
    and with a bfloat16 GDN state, vLLM's default)."""
    from fast.graphs import GraphedModel, profile_traffic
    from refgdn.capture import ServingConfig
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny", **family), ops="fast", dtype=dtype, device="cuda", seed=1)
    K = 5
    cfg = ServingConfig(capture_batch_sizes=(2, 4), max_draft=K, max_batch=4, max_prefill_tokens=64,
                        max_prefill_seqs=4, state_dtype=state_dtype, device="cuda")
    gm = GraphedModel(m, batch_sizes=(2, 4), max_draft=K, num_slots=4, max_len=256, state_dtype=state_dtype).setup(
        profile=lambda: profile_traffic(m, cfg))
    assert all(c.ssm_state.dtype == state_dtype for c in gm.cache.gdn)
    twin = gm.cache.clone()
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    n = 3                                                     # 3 real requests in the N = 4 graphs
    lens = [5, 17, 9]
    ids = torch.randint(0, m.config.vocab_size, (sum(lens),), generator=gen).to(dev)
    si = torch.arange(n, dtype=I32, device=dev)
    qsl = torch.tensor([0] + lens, device=dev).cumsum(0).to(I32)
    for c in (gm.cache, twin):
        m.prefill(c, ids, m.metadata(c, si, qsl, sum(lens)))
    _same(gm.cache, twin)
    pad_si = torch.tensor([0, 1, 2, -1], dtype=I32, device=dev)
    tok = torch.tensor([3, 4, 5], device=dev)
    for rnd in range(2):
        for k in range(1, K + 1):
            # decode through the graph vs eager at the padded shape
            logits = gm.decode(tok, si).clone()
            pid = torch.zeros(4, dtype=torch.int64, device=dev)
            pid[:n] = tok
            ref = m.logits(m.decode(twin, pid, m.metadata(twin, pad_si, torch.arange(5, dtype=I32, device=dev), 4)))[:n]
            assert torch.equal(logits, ref)
            tok = logits.argmax(-1)
            # verify [tok, drafts]: drafts = a shifted copy so acceptance is partial
            drafts = (tok[:, None] + torch.arange(1, k + 1, device=dev)[None]) % m.config.vocab_size
            drafts[0] = logits.argmax(-1)[0]                  # request 0's drafts agree more often
            vids = torch.cat([tok[:, None], drafts], 1).reshape(-1)
            vl = gm.verify(vids, si, k).clone()
            pv = torch.zeros(4 * (1 + k), dtype=torch.int64, device=dev)
            pv[:n * (1 + k)] = vids
            rl = m.logits(m.verify(twin, pv, m.metadata(twin, pad_si, torch.arange(5, dtype=I32, device=dev) * (1 + k),
                                                       4 * (1 + k))))[:n * (1 + k)]
            assert torch.equal(vl, rl)
            target = vl.argmax(-1).view(n, 1 + k)
            match = (target[:, :k] == drafts).int().cumprod(1).sum(1)
            acc = (match + 1).to(I32)                          # accepted tokens incl. the correction / bonus
            gm.accept(si, acc)
            m.accept(twin, si, acc)
            _same(gm.cache, twin)
            tok = target.gather(1, (acc - 1).long()[:, None])[:, 0]
    torch.cuda.synchronize()
    gm.check()                                   # no device-side fault in any replay
    for gc in twin.gdn:
        gc.check()


def test_draft_graph_replayed_per_step_equals_eager():
    from fast.graphs import GraphedModel, profile_traffic
    from refgdn.capture import ServingConfig
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="fast", dtype=torch.float32, device="cuda", seed=2)
    K = 4
    cfg = ServingConfig(capture_batch_sizes=(2,), max_draft=K, max_batch=2, max_prefill_tokens=16,
                        max_prefill_seqs=2, device="cuda")
    gm = GraphedModel(m, batch_sizes=(2,), max_draft=K, num_slots=2, max_len=128).setup(
        profile=lambda: profile_traffic(m, cfg))
    twin = gm.cache.clone()
    si = torch.arange(2, dtype=I32, device="cuda")
    hid = torch.randn(2, m.config.hidden_size, device="cuda")
    toks = [gm.draft(0, si, torch.tensor([4, 6], device="cuda"), hid)] + [gm.draft(s, si) for s in range(1, K)]
    tid, h = torch.tensor([4, 6], device="cuda"), hid
    for s in range(K):
        h = m.mtp(twin, tid, h, m.metadata(twin, si, torch.arange(3, dtype=I32, device="cuda"), 2, mtp=True))
        tid = m.logits(h).argmax(-1)
        assert torch.equal(toks[s], tid), s
    _same(gm.cache, twin)


def test_unwarmed_capture_real_failure_and_guard():
    """Seeds 000/001 on the real thing: the model warmed up through decode (non-speculative) and then its
    verify step (speculative) captured in a CUDA graph. The hazard is that the verify kernels are first
    compiled *inside* the capture: Triton's compile hook must see compilations while the stream captures.
    Whether CUDA then refuses (the seeds: "operation not permitted when stream is capturing", A100) depends
    on the GPU, driver and Triton (seed 001's reviewer could not reproduce it on an RTX 3090), so the outcome
    is reported, and only checked to be the seeds' error when there is one. With the lifecycle the guard
    fires first, naming the key, on every stack."""
    out = _run("""
        import torch
        from triton import knobs
        from refgdn.model import Qwen3NextConfig, Qwen3NextModel
        inside = []                                       # kernels Triton compiled while the stream captured
        def hook(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                fn = kwargs.get("fn")
                inside.append(getattr(fn, "name", str(fn)))
        knobs.runtime.jit_post_compile_hook = hook
        m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="fast", dtype=torch.bfloat16, device="cuda", seed=0)
        cache = m.allocate_cache(2, 32, max_draft=2)
        I32 = torch.int32
        si = torch.full((2,), -1, dtype=I32, device="cuda")
        ids1, ids3 = torch.zeros(2, dtype=torch.long, device="cuda"), torch.zeros(6, dtype=torch.long, device="cuda")
        dmeta = m.metadata(cache, si, torch.arange(3, dtype=I32, device="cuda"), 2)
        m.decode(cache, ids1, dmeta)                                  # warmup: the non-speculative path only
        torch.cuda.synchronize()
        vmeta = m.metadata(cache, si, torch.arange(3, dtype=I32, device="cuda") * 3, 6)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                m.verify(cache, ids3, vmeta)                          # capture: the speculative path
            print("NO-ERROR")
        except Exception as e:                     # the error and what it was raised during (capture_end may mask it)
            chain = [e] + ([e.__context__] if e.__context__ is not None else [])
            print("ERROR", " | ".join(f"{type(x).__name__}: {str(x)[:300]}" for x in chain).replace("\\n", " "))
        print("INSIDE", sorted(set(inside)))
    """)
    print(out)
    inside = out.split("INSIDE", 1)[1]
    assert "conv_step" in inside and "gdn_step_kernel" in inside, out       # the hazard: compiled in capture
    if "NO-ERROR" not in out:                                             # this stack refuses, as the seeds
        assert "capturing" in out or "not permitted" in out, out
    out = _run("""
        import torch, triton, triton.language as tl
        from refgdn.capture import Lifecycle, CaptureDescriptor, StepSpec, CompileDuringCapture, CompileAfterReserve
        from fast.graphs import CudaGraphBackend
        @triton.jit
        def k_never_warmed(x, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(x + o, tl.load(x + o) + 1)
        x = torch.zeros(64, device="cuda")
        lc = Lifecycle("cuda", graph_backend=CudaGraphBackend())
        lc.profile(lambda: k_never_warmed[(1,)](x, BLOCK=32))
        lc.reserve(lambda: None)
        def make(desc, warmup):
            return StepSpec(lambda: None if warmup else k_never_warmed[(1,)](x, BLOCK=64))
        try:
            lc.capture(CaptureDescriptor("decode", 1), make)
        except CompileDuringCapture as e:
            print("GUARD", e)
        y = torch.ones(4, device="cuda") * 2                        # the device is still usable
        print("AFTER", float(y.sum()))
    """)
    print(out)
    assert "GUARD" in out and "k_never_warmed" in out and "BLOCK=64" in out and "AFTER 8.0" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_loop_over_cuda_graphs(dtype):
    """refgdn.speculative's loop on GraphedSteps (real CUDA graphs) gives the tokens of the same loop run
    eagerly (batch = the graph's batch, so the kernels see the same shapes), k = 1..5 and plain decoding."""
    from fast.graphs import GraphedModel, GraphedSteps, profile_traffic
    from refgdn.capture import ServingConfig, recording
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    from refgdn.speculative import generate_plain, generate_speculative
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="fast", dtype=dtype, device="cuda", seed=4)
    K = 5
    prompts = [[1, 5, 9, 2, 7, 7], [7, 3, 11]]
    cfg = ServingConfig(capture_batch_sizes=(2,), max_draft=K, max_batch=2, max_prefill_tokens=16,
                        max_prefill_seqs=2, device="cuda")
    gm = GraphedModel(m, batch_sizes=(2,), max_draft=K, num_slots=2, max_len=64).setup(
        profile=lambda: profile_traffic(m, cfg))
    gs = GraphedSteps(gm)
    with recording(gm.lc):                                  # nothing new compiles while serving
        for k in range(1, K + 1):
            got = generate_speculative(gs, prompts, 12, k, cache=gs.cache)
            ref = generate_speculative(m, prompts, 12, k, cache=gm.cache.clone())
            assert got.tokens == ref.tokens, k
        got = generate_plain(gs, prompts, 12, cache=gs.cache)
        assert got.tokens == generate_plain(m, prompts, 12, cache=gm.cache.clone()).tokens
    assert gs.replays > 0
    assert gm.lc.real_compiles.get("serve", 0) == 0 and gm.lc.real_compiles.get("capture", 0) == 0
