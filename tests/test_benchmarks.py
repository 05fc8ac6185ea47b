"""The benchmarks' own arithmetic that a figure in RESULTS.md rests on, and their tools end to end at tiny shapes
(on the test device: CPU, through the interpreter, or a GPU)."""
import random

import pytest
import torch

from benchmarks.bench_prefill import busy_ms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # where fast's kernels run (no interpreter on a GPU)


def _busy_by_unit_steps(spans) -> float:
    """The union's length by counting the integer microseconds covered (spans on integer endpoints), in ms."""
    covered = set()
    for a, b in spans:
        covered.update(range(a, b))
    return len(covered) / 1e3


@pytest.mark.parametrize("spans", [
    pytest.param([], id="none"),
    pytest.param([(0, 10)], id="one"),
    pytest.param([(0, 10), (20, 25)], id="gap"),
    pytest.param([(0, 10), (10, 12)], id="touching"),
    pytest.param([(0, 10), (2, 5)], id="nested"),
    pytest.param([(5, 15), (0, 10), (12, 30)], id="unsorted-overlapping"),
])
def test_busy_ms_counts_overlaps_once(spans):
    assert busy_ms(spans) == pytest.approx(_busy_by_unit_steps(spans))


def test_busy_ms_random_two_streams():
    rng = random.Random(0)
    for _ in range(50):
        spans = []
        for _stream in range(2):
            t = rng.randrange(0, 20)
            for _ in range(rng.randrange(1, 8)):
                d = rng.randrange(1, 30)
                spans.append((t, t + d))
                t += d + rng.randrange(0, 10)
        assert busy_ms(spans) == pytest.approx(_busy_by_unit_steps(spans))
        assert busy_ms(spans) <= sum(b - a for a, b in spans) / 1e3


def test_ab_tree_puts_a_revision_beside_this_tree(tmp_path):
    """benchmarks.ab_tree: a committed revision's fast/ extracted beside this tree's imports as its own package
    (its kernels separate objects), and at HEAD both give the same bits on the same inputs (tiny shape, on the test
    device: the interpreter on CPU).
    A revision that is not a commit fails at extraction. In a subprocess: the second copy of fast registers its
    torch.library ops again under the same names, which must not reach this test process."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    dest = str(tmp_path / "ab")
    code = f"""
import subprocess, torch
import fast
from benchmarks import ab_tree
from tests.helpers import gdn_inputs
ab_tree.prepare("HEAD", repo={repo!r}, dest={dest!r})
base, rev = ab_tree.load_base({dest!r})
assert rev.startswith("HEAD ") and base.__name__ == "fast_base", rev
assert base.chunk.chunk_state_kernel is not fast.chunk.chunk_state_kernel
q, k, v, g, beta = gdn_inputs(1, 40, 2, 4, 16, 16, seed=3, dtype=torch.float32, device={DEVICE!r})
kw = dict(chunk_size=16, output_final_state=True, use_qk_l2norm_in_kernel=True)
a = base.chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
b = fast.chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, **kw)
assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
try:
    ab_tree.prepare("no-such-revision-xyz", repo={repo!r}, dest={dest!r} + "-bad")
except subprocess.CalledProcessError:
    print("AB-OK")
"""
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "AB-OK" in r.stdout, (r.stdout + r.stderr)[-2000:]


def test_bench_chunk_runs_every_case_at_a_tiny_shape(monkeypatch, l2norm=True):
    """bench_chunk end to end on the test device (CPU: fast through the interpreter) at a tiny shape: every case gets
    a row with fast's time and no error note. A name error in the table's own code (a case after the first) fails
    here. (The l2norm form: the other differs by the flag the kernels take, which their own tests sweep.)"""
    import benchmarks.bench_prefill as bp
    for name, value in dict(H=1, HV=2, K=16, V=16, CHUNK=16, CHUNK_TS=(32,), BATCHED=(2, 32),
                            VARLEN_LENS=(5, 16, 1, None), VARLEN_TOTAL=40).items():
        monkeypatch.setattr(bp, name, value)
    monkeypatch.setattr(bp.common, "try_import_fla", lambda: None)
    monkeypatch.setattr(bp, "bench_refgdn", lambda *a: bp._row("refgdn", 1, 1.0))     # the oracle's row: not timed here
    monkeypatch.setattr(bp, "varlen_lengths", lambda: [5, 16, 1, 18])
    rows = bp.bench_chunk(DEVICE, 1.0, l2norm=l2norm)
    fast_rows = [r for r in rows if r["case"] != "refgdn"]
    assert len(fast_rows) == 4                                   # T=32, B=2, varlen, varlen with cu_seqlens_cpu
    assert all(("l2norm" in r["case"]) == l2norm for r in fast_rows)
    for r in fast_rows:
        assert r["ms"] is not None and r["ms"] > 0 and "fast:" not in r["note"], r


def test_prefetch_sweep_at_a_tiny_shape(monkeypatch):
    """prefetch_sweep end to end on the test device at a tiny shape: a row per case, beta form and l2norm, the
    forward's output bit for bit the same with beta loaded ahead or not, times on a GPU only, and the rule's pick
    as fast.chunk.state.state_prefetch_beta gives it (every pass prefetches in the interpreter)."""
    import benchmarks.bench_prefill as bp
    for name, value in dict(H=1, HV=2, K=16, V=16, CHUNK=16, VARLEN_TOTAL=40).items():
        monkeypatch.setattr(bp, name, value)
    monkeypatch.setattr(bp, "varlen_lengths", lambda: [5, 16, 1, 18])
    rows = bp.prefetch_sweep(DEVICE, cases=((2, 32), (1, None)), rounds=1, iters=1)
    assert [(r["case"], r["beta"], r["l2norm"]) for r in rows] == [
        (c, b, l2) for c in ("B=2 T=32", "varlen 4 seqs") for l2 in (True, False) for b in ("bf16", "fp32", "logits")]
    for r in rows:
        assert r["equal"], r
        assert (r["off us"] is not None and r["on us"] is not None) == (DEVICE != "cpu"), r
        assert DEVICE != "cpu" or r["rule"] == "on", r


def test_serving_prefill_rows_at_a_tiny_shape(monkeypatch):
    """serving_prefill_rows end to end on the test device at a tiny shape: a stream of varlen prefills whose shapes
    change every call (several token and sequence counts), fast's chunk and conv1d rows with their timings."""
    import benchmarks.bench_prefill as bp
    for name, value in dict(H=1, HV=2, K=16, V=16).items():
        monkeypatch.setattr(bp, name, value)
    monkeypatch.setattr(bp.common, "try_import_fla", lambda: None)
    stream = bp.serving_stream(3, seed=3, max_seqs=3, max_len=40)     # (interpreted: ~1 s per call and pass)
    assert len({(sum(x), len(x)) for x in stream}) == 3 and len({len(x) for x in stream}) > 1
    monkeypatch.setattr(bp, "serving_stream", lambda calls, seed: stream)
    rows = bp.serving_prefill_rows(DEVICE, calls=3, seed=3)
    assert [r["impl"] for r in rows] == ["fast chunk", "fast conv1d"]
    for row in rows:
        assert row["wall us"] > 0 and row["host us"] > 0 and (row["device us"] > 0) == (DEVICE != "cpu")


def test_layer_prefill_rows_at_a_tiny_shape(monkeypatch):
    """layer_prefill_rows end to end on the test device at a tiny shape: gdn_prefill and the gather / scatter
    composition over a stream of changing shapes, with timings (their equality: tests/test_serving_prefill.py)."""
    import benchmarks.bench_prefill as bp
    monkeypatch.setattr(bp.common, "try_import_fla", lambda: None)
    stream = bp.serving_stream(3, seed=5, max_seqs=3, max_len=40)
    assert len({(sum(x), len(x)) for x in stream}) == 3 and len({len(x) for x in stream}) > 1
    rows = bp.layer_prefill_rows(DEVICE, calls=3, seed=5, shape=(1, 2, 16, 16), max_len=40, max_seqs=3)
    assert [r["impl"] for r in rows] == ["fast.gdn_prefill", "fast ops + gather / scatter"]
    for row in rows:
        assert row["wall us"] > 0 and row["host us"] > 0 and (row["device us"] > 0) == (DEVICE != "cpu")


def test_host_rows_at_a_tiny_shape(monkeypatch):
    """host_rows end to end on the test device at a tiny shape: a row per case with its eager and host times (the
    device time where a CUDA graph can be captured). Its clean-up at the end of a case named a variable the function
    no longer defines, and the prefill table stopped there on the GPU for three days (UnboundLocalError)."""
    import benchmarks.bench_prefill as bp
    for name, value in dict(H=1, HV=2, K=16, V=16, CHUNK=16).items():
        monkeypatch.setattr(bp, name, value)
    monkeypatch.setattr(bp.common, "try_import_fla", lambda: None)
    rows = bp.host_rows(DEVICE, cases=((1, 32), (2, 16)), iters=1, repeats=1, warmup=1)
    assert [(r["case"], r["impl"]) for r in rows] == [("B=1 T=32", "fast"), ("B=2 T=16", "fast")]
    for r in rows:
        assert r["eager us"] > 0 and r["host us"] > 0, r
        assert (r["device us"] > 0) == (DEVICE != "cpu"), r


def test_best_of_autotune_draws_keeps_the_best_draws_picks(monkeypatch):
    """common.best_of_autotune_draws finds Autotuners under a module prefix (also behind a heuristics wrapper),
    clears their picks before each draw with the on-disk cache off, and leaves the best draw's picks in place."""
    import sys
    import types

    import triton
    import triton.language as tl

    from benchmarks import common

    @triton.jit
    def _k(x, N: tl.constexpr):
        pass

    configs = [triton.Config({"N": n}) for n in (1, 2, 4)]
    tuned = triton.autotune(configs=configs, key=[])(_k)
    tuned.cache_results = True            # (the interpreter forces it off at construction)
    wrapped = triton.heuristics({"M": lambda args: 1})(triton.autotune(configs=configs, key=[])(_k))
    mod = types.ModuleType("fake_tuned.kernels")
    mod.tuned, mod.wrapped, mod.other = tuned, wrapped, 3
    monkeypatch.setitem(sys.modules, "fake_tuned.kernels", mod)
    tuners = common.autotuners("fake_tuned.")
    assert {id(t) for t in tuners} == {id(tuned), id(wrapped.fn)}

    draw_picks = iter([2, 0, 1])          # the config each draw "tunes" to; time = 1 / N: config 2 (N=4) is best
    seen_flags = []

    def call():                           # stands in for fla's op: a draw's first call fills each cache
        seen_flags.append([t.cache_results for t in tuners])
        if all(not t.cache for t in tuners):
            i = next(draw_picks)
            for t in tuners:
                t.cache[()] = configs[i]

    best, times = common.best_of_autotune_draws(call, 3, lambda fn: 1.0 / tuners[0].cache[()].kwargs["N"],
                                                prefix="fake_tuned.")
    assert times == [0.25, 1.0, 0.5] and best == 0.25
    assert all(t.cache[()] is configs[2] for t in tuners)              # the best draw's picks, restored
    assert all(flags == [False, False] for flags in seen_flags)        # no disk cache during the draws
    assert tuned.cache_results is True and wrapped.fn.cache_results is False   # restored afterwards


def test_one_core_pins_and_restores(monkeypatch):
    """benchmarks.common.one_core: one core inside the block (the idlest allowed, the highest among equals, or the
    one asked for -- by argument or REFGDN_BENCH_CORE -- if allowed), the former affinity after it, also when the
    block raises."""
    import os

    from benchmarks import common
    if not hasattr(os, "sched_setaffinity"):
        with common.one_core() as pin:
            assert pin.core is None
        return
    before = os.sched_getaffinity(0)
    busy = common.core_busy(before, window=0.02)
    assert set(busy) <= before and all(0.0 <= b <= 1.0 for b in busy.values())
    monkeypatch.setattr(common, "core_busy", lambda cores: {c: 0.5 for c in cores})     # all equal: the highest
    with common.one_core() as pin:
        assert os.sched_getaffinity(0) == {max(before)} == {pin.core}
    monkeypatch.setattr(common, "core_busy", lambda cores: {c: 0.0 if c == min(cores) else 0.9 for c in cores})
    with common.one_core() as pin:                                                     # the idlest
        assert os.sched_getaffinity(0) == {min(before)} == {pin.core}
    assert os.sched_getaffinity(0) == before
    os.environ["REFGDN_BENCH_CORE"] = str(min(before))
    try:
        with common.one_core() as pin:
            assert os.sched_getaffinity(0) == {min(before)} == {pin.core}
    finally:
        del os.environ["REFGDN_BENCH_CORE"]
    with pytest.raises(RuntimeError):
        with common.one_core(min(before)) as pin:
            assert os.sched_getaffinity(0) == {min(before)}
            raise RuntimeError
    assert os.sched_getaffinity(0) == before


def test_blocks_per_sm_at_the_sm90_limits():
    """benchmarks.sm90.blocks_per_sm (compile_check's per-SM column) at the limits it encodes: shared memory (228 KB
    per SM, 1 KB reserved per block: the fused state pass's 115712 B fit twice, 115716 once), registers allocated
    per warp in units of 256 (255 per thread in 4 warps: two blocks; 232 in 8 warps: one), warps (64 per SM) and
    blocks (32 per SM)."""
    from benchmarks.sm90 import blocks_per_sm
    from fast.chunk.state import SMEM_TWO_PER_SM
    assert blocks_per_sm(4, SMEM_TWO_PER_SM, 200)["smem"] == 2
    assert blocks_per_sm(4, SMEM_TWO_PER_SM + 4, 200) == dict(smem=1, regs=2, warps=16, blocks=1)
    assert blocks_per_sm(4, 1000, 255)["blocks"] == 2 and blocks_per_sm(4, 1000, 248)["blocks"] == 2
    assert blocks_per_sm(4, 1000, 240)["regs"] == 2 and blocks_per_sm(4, 1000, 168)["regs"] == 3
    assert blocks_per_sm(8, 0, 230)["blocks"] == 1
    assert blocks_per_sm(1, 0, 32)["blocks"] == 32 and blocks_per_sm(32, 0, 32)["blocks"] == 2


def test_bench_norm_torch_row_is_transformers_module():
    """bench_norm's "transformers torch" row times transformers' own Qwen3NextRMSNormGated arithmetic: bit for bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

    from benchmarks.bench_norm import hf_torch
    del transformers
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(2, 5, 16, generator=gen).bfloat16() for _ in range(2))
    mod = hf_mod.Qwen3NextRMSNormGated(16, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.1 * torch.randn(16, generator=gen))
        assert torch.equal(hf_torch(x, z, mod.weight, 1e-6), mod(x, z))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_verify_call_at_a_tiny_shape(monkeypatch, engine):
    """bench_vllm's verify table call end to end on the test device at a tiny shape: SGLang's target verify and
    vLLM's verify on an [S, HV, V, K] pool give finite outputs for every token, and SGLang's leaves the pool as it was
    (disable_state_update: replays of the benchmark's graph all time the same work)."""
    import benchmarks.bench_decode as bd
    import benchmarks.bench_vllm as bv
    for name, value in dict(H=1, HV=2, K=16, V=16).items():
        monkeypatch.setattr(bd, name, value)
        monkeypatch.setattr(bv, name, value)
    call = bv.verify_call(2, 2, seed=1, engine=engine, device=DEVICE)
    pools = [c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, torch.Tensor)
             and c.cell_contents.dim() == 4 and c.cell_contents.shape[1:] == (2, 16, 16)]
    before = [p.clone() for p in pools]
    o = call()
    o = o[0] if isinstance(o, tuple) else o
    assert o.shape == (1, 2 * 3, 2, 16) and torch.isfinite(o.float()).all()
    if engine == "sglang":
        assert pools and all(torch.equal(p, b) for p, b in zip(pools, before))


def test_prep_call_chain_does_the_same_work(monkeypatch):
    """bench_vllm's prep table compares like with like: the fused op's outputs and the separate launches' agree (to
    the gates' float32 rounding), at a tiny shape on the test device."""
    import benchmarks.bench_decode as bd
    import benchmarks.bench_vllm as bv
    for name, value in dict(H=1, HV=2, K=16, V=16).items():
        monkeypatch.setattr(bd, name, value)
        monkeypatch.setattr(bv, name, value)
    fused, chain = bv.prep_call(5, device=DEVICE)(), bv.prep_call(5, chain=True, device=DEVICE)()
    for f, c in zip(fused, chain):
        assert f.shape == c.shape and f.dtype == c.dtype
        torch.testing.assert_close(f, c, rtol=1e-6, atol=1e-6)


def test_conv_fn_rows_calls_at_a_tiny_shape():
    """bench_vllm's prefill-conv table calls run on the test device at a tiny shape, and its padded variant is the op
    with the second request's outputs zero (the kernel's PAD_ZERO) and the others' unchanged."""
    import benchmarks.bench_vllm as bv
    outs = {what: bv.conv_fn_call(8, what, device=DEVICE, D=32)() for what in ("op", "op-padded", "plain", "zeroing")}
    op, padded = outs["op"].T, outs["op-padded"].T                         # [T, D]
    assert torch.equal(padded[2:4], torch.zeros_like(padded[2:4])) and op[2:4].abs().sum() > 0
    assert torch.equal(padded[:2], op[:2]) and torch.equal(padded[4:], op[4:])
    assert outs["plain"][0].shape == (1, 8, 32) and outs["zeroing"].shape == (8, 32)


def test_flashinfer_bench_calls_at_a_tiny_shape(monkeypatch):
    """bench_flashinfer's calls end to end on the test device at a tiny shape: the prefill with and without
    checkpoints gives the same outputs and final states (the checkpoints are extra stores), and the MTP verify row
    leaves its pool as it was (disable_state_update: replays of the benchmark's graph time the same work)."""
    import benchmarks.bench_decode as bd
    import benchmarks.bench_flashinfer as bf
    import benchmarks.bench_prefill as bp
    for mod in (bd, bf, bp):
        for name, value in dict(H=1, HV=2, K=16, V=16).items():
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, value)
    o1, s1 = bf.prefill_call([140, 70], "fast", device=DEVICE)()
    o2, s2 = bf.prefill_call([140, 70], "ckpt", device=DEVICE, every=64)()
    assert torch.equal(o1, o2) and torch.equal(s1, s2) and torch.isfinite(o1.float()).all()
    o3 = bf.prefill_call([140, 70], "paged", device=DEVICE, every=64)()            # (the same tokens, after prefixes)
    assert o3.shape == o1.shape and torch.isfinite(o3.float()).all()
    call = bf.decode_call(2, seed=1, verify_k=2, device=DEVICE)
    pool = [c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, dict)][0]["initial_state"]
    before = pool.clone()
    o, _ = call()
    assert o.shape == (2, 3, 2, 16) and torch.isfinite(o.float()).all() and torch.equal(pool, before)


def test_as_capability_reports_the_asked_generation_to_fast():
    """benchmarks/as_capability (gpu_pass.sh sm8x): a process started with it on its path and REFGDN_AS_CAPABILITY set
    sees that compute capability for CUDA devices in fast's config rules (so the chunk op's state pass does not fuse
    o there); without the variable it changes nothing."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = ("import torch, fast.chunk as fc; d = torch.device('cuda', 0);"
             "print(fc.common._warp_mma(d), fc.common._warp_mma(torch.device('cpu')))")
    path = os.pathsep.join([os.path.join(root, "benchmarks", "as_capability"), root])
    seen = []
    for cap in ("8.6", None):
        env = dict(os.environ, PYTHONPATH=path)
        env.pop("REFGDN_AS_CAPABILITY", None)
        if cap:
            env["REFGDN_AS_CAPABILITY"] = cap
        elif not torch.cuda.is_available():     # no variable, no GPU: the CPU answer for a CUDA device too
            probe = probe.replace("torch.device('cuda', 0)", "torch.device('cpu')")
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        seen.append(r.stdout.split())
    assert seen[0] == ["True", "False"]
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
    assert seen[1] == [str(major < 9 or major == 12), "False"]
