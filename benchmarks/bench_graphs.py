"""CUDA-graph benchmarks (GPU): one GDN layer's decode step under a graph and eager, and the model with graphs.

1. One GDN layer's decode step (conv update + gating + l2norm + delta rule: fast.gdn_decode) at Qwen3-Next's
   shape (H = 16, HV = 32, K = V = 128, bf16 activations, float32 state) at N = 1 and N = 8: per layer of
   one CUDA graph of 32 layers' steps (distinct caches: what a layer costs in a model's decode graph, its
   state out of L2), and one graph per step (do_bench median of the replay: graph launch latency included,
   ~5 us at N = 1, which alone is the target), and per layer with a bfloat16 state (vLLM's default SSM cache dtype);
   eager at N = 1 as host wall time per call (launch overhead included:
   a loop of calls, one synchronize at the end); fla's fused_recurrent_gated_delta_rule beside it in the
   same run (no conv, no gating). Targets (issue 10): <= 5 us (graph, N = 1), <= 11 us (graph, N = 8),
   <= 40 us (eager wall, N = 1).
2. The model (refgdn.model "bench" preset, fast ops, bf16; fast.graphs.GraphedModel): decode latency per
   token, and one speculative round (k MTP draft steps + verify of 1 + k + accept) for k = 1..3, graphs vs
   eager, batch 1 and 32; tokens/s at the round's measured greedy acceptance and at full acceptance.

Run: python -m benchmarks.bench_graphs  (appends a section to benchmarks/RESULTS.md)
"""
from __future__ import annotations

import torch

from benchmarks import common
from benchmarks.bench_decode import fla_fn, graphed, make_problem

TITLE = "CUDA graphs: GDN decode step and the model (fast.graphs)"
META = {"layer step": "fast.gdn_decode, H=16 HV=32 K=V=128 W=4, bf16 activations, float32 state (a bfloat16 "
                      "state's row beside each N)",
        "model": "refgdn.model preset 'bench' (hidden 2048, 3 GDN + 1 attention layer, vocab 32K), fast ops, bf16",
        "targets (us)": "graph N=1 <= 5, graph N=8 <= 11, eager N=1 wall <= 40",
        "us": "per-layer rows: do_bench median of a 32-layer graph's replay / 32; one-graph rows: do_bench median "
              "of the replay; eager / model rows: host wall per call (sync at the end)"}


BF16 = torch.bfloat16
LAYERS = 32       # layers per graph in the "per layer" rows: 32 distinct caches, state > L2 (50 MB) at N = 1


def per_layer_us(make_call, layers: int = LAYERS) -> float:
    """GPU time per layer of one CUDA graph that runs `layers` steps, each on its own problem (own cache,
    own weights): how a layer's step costs inside a model's decode graph, where one graph launch covers
    all layers and a layer's state has left L2 by its next step. make_call(seed) -> a step callable."""
    calls = [make_call(i) for i in range(layers)]

    def all_layers():
        for c in calls:
            c()
    g = graphed(all_layers)
    return common.bench(g) * 1e3 / layers if g is not None else float("nan")


def fast_call(N: int, seed: int = 0, bias: bool = True, state_dtype: torch.dtype = torch.float32):
    """One GDN layer's decode step at Qwen3-Next's shape on its own problem: a callable. bias=False: no conv bias, as
    Qwen3-Next's conv (its decode guard then holds two absent tensors: fast.launch.MetaGuard). state_dtype: the SSM
    state's (float32; vLLM's default is the model's, bfloat16)."""
    import fast.serving as fs
    p = make_problem(N, 0, state_dtype, "cuda", seed=seed)
    args = (p["x"], p["a"], p["b"], p["conv_weight"], p["conv_bias"] if bias else None, p["A_log"], p["dt_bias"],
            p["cache"], p["idx"])
    return lambda: fs.gdn_decode(*args)  # noqa: E731


def _pinned_wall_us(fn) -> float:
    """common.wall_us of an eager (host-bound) call, on one core (common.one_core)."""
    with common.one_core():
        return common.wall_us(fn)


def layer_rows(batches=(1, 8), beside=()) -> list:
    """beside: step_config keys (e.g. "pdl") whose per-layer rows are also timed with the key off and on, to see
    what each buys at each N."""
    import fast.serving as fs
    from benchmarks.bench_decode import launch_overrides
    rows = []
    fla = common.try_import_fla()
    # the eager row first, in a process that has captured no graph yet: after this table's graphs (32 problems'
    # caches, the graphs' private pools) the caching allocator makes each eager call's two allocations and frees
    # slower (H200 host, 2026-11-24: 41.6 us before, 65.8 after, 40.8 again after torch.cuda.empty_cache()); the
    # row after the graphs is kept beside it
    fresh = _pinned_wall_us(fast_call(1)) if 1 in batches else None     # (eager rows: host-bound, one core)
    fresh_nb = _pinned_wall_us(fast_call(1, bias=False)) if 1 in batches else None

    for N in batches:
        if N == 1:
            rows.append(dict(what="GDN layer decode step", impl="fast eager (wall, host incl.), before any graph",
                             N=N, us=fresh, target=40))
            rows.append(dict(what="GDN layer decode step", impl="fast eager (wall, host incl.), before any graph, "
                             "no conv bias (Qwen3-Next)", N=N, us=fresh_nb, target=40))
        rows.append(dict(what="GDN layer decode step", impl=f"fast, per layer of a {LAYERS}-layer graph", N=N,
                         us=per_layer_us(lambda i: fast_call(N, i)), target={1: 5, 8: 11}.get(N),
                         note=f"pdl={fs.step_config(128, 128, torch.float32, 32, 'decode', N, pdl_ok=True)['pdl']}"))
        rows.append(dict(what="GDN layer decode step", impl=f"fast, per layer of a {LAYERS}-layer graph, bfloat16 "
                         "state (vLLM's default)", N=N, us=per_layer_us(lambda i: fast_call(N, i, bias=False,
                                                                                           state_dtype=BF16)),
                         note=f"no conv bias; pdl="
                              f"{fs.step_config(128, 128, BF16, 32, 'decode', N, pdl_ok=True)['pdl']}"))
        for key in beside:
            for on in (False, True):
                with launch_overrides(step={key: on}):
                    rows.append(dict(what="GDN layer decode step", impl=f"fast, per layer of a {LAYERS}-layer "
                                     f"graph, {key}={on}", N=N, us=per_layer_us(lambda i: fast_call(N, i))))
        step = fast_call(N)
        g = graphed(step)
        if g is not None:
            rows.append(dict(what="GDN layer decode step", impl="fast, one graph per step (launch incl.)", N=N,
                             us=common.bench(g) * 1e3))
        if N == 1:
            rows.append(dict(what="GDN layer decode step", impl="fast eager (wall, host incl.), after the graphs",
                             N=N, us=_pinned_wall_us(step), target=40))
        if fla is not None and getattr(fla, "fused_recurrent_gated_delta_rule", None) is not None:
            try:
                call, _, note = fla_fn(make_problem(N, 0, torch.float32, "cuda"), fla)
                rows.append(dict(what="fla fused_recurrent (no conv/gating)", impl=f"fla, per layer of a "
                                 f"{LAYERS}-layer graph", N=N, note=note,
                                 us=per_layer_us(lambda i: fla_fn(make_problem(N, 0, torch.float32, "cuda",
                                                                               seed=i), fla)[0])))
                gf = graphed(call)
                if gf is not None:
                    rows.append(dict(what="fla fused_recurrent (no conv/gating)", impl="fla, one graph per step",
                                     N=N, us=common.bench(gf) * 1e3, note=note))
                if N == 1:
                    rows.append(dict(what="fla fused_recurrent (no conv/gating)", impl="fla eager (wall)", N=N,
                                     us=_pinned_wall_us(call), note=note))
            except Exception as e:  # noqa: BLE001 - the peer's failure is reported, not fatal
                rows.append(dict(what="fla fused_recurrent", impl="fla", N=N, note=f"failed: {e!r}"[:120]))
    return rows


SWEEP_STEP = [dict(BV=8, num_warps=1), dict(BV=16, num_warps=1), dict(BV=32, num_warps=1), dict(BV=32, num_warps=2),
              dict(BV=64, num_warps=2), dict(BV=64, num_warps=4), dict(BV=128, num_warps=4),
              dict(BV=128, num_warps=8), dict(BV=64, num_warps=4, HPP=2)]   # (one-warp BV 32 at HPP 2 spills: 84-176 us)
SWEEP_CONV = [dict(BD=32, num_warps=1), dict(BD=64, num_warps=1), dict(BD=128, num_warps=1), dict(BD=128, num_warps=2),
              dict(BD=256, num_warps=2), dict(BD=256, num_warps=4), dict(BD=512, num_warps=4)]


def sweep_rows(batches=(1, 2, 4, 8, 16)) -> list:
    """Per layer of a 32-layer graph, the step kernel's configs (SWEEP_STEP) at each N, PDL off and on at
    N = 1 and 8 (the pinned rule elsewhere), then the conv kernel's configs (SWEEP_CONV) at N = 1 and 8
    with the pinned step config. Benchmark sweeps only (benchmarks.bench_decode.launch_overrides)."""
    import fast.serving as fs
    from benchmarks.bench_decode import launch_overrides
    rows = []

    for N in batches:
        pinned = fs.step_config(128, 128, torch.float32, 32, "decode", N, pdl_ok=True)
        for cfg in SWEEP_STEP:
            for pdl in ((False, True) if N in (1, 8) else (pinned["pdl"],)):
                c = dict(cfg, pdl=pdl)
                with launch_overrides(step=c):
                    try:
                        us = per_layer_us(lambda i: fast_call(N, i))
                    except Exception as e:  # noqa: BLE001 - a config that does not run is reported
                        us, c = float("nan"), dict(c, error=repr(e)[:60])
                rows.append(dict(what="sweep: step kernel", N=N, us=us, note=str(c)))
        for cfg in SWEEP_CONV if N in (1, 8) else ():
            with launch_overrides(conv=cfg):
                rows.append(dict(what="sweep: conv kernel", N=N, us=per_layer_us(lambda i: fast_call(N, i)),
                                 note=str(cfg)))
    return rows


def model_rows(batches=(1, 32), ks=(1, 2, 3), iters: int = 20, preset: str = "bench", ops="fast",
               dtype=torch.bfloat16, device: str = "cuda", warmup: int = 10) -> list:
    """(preset, ops, dtype, device: a CPU smoke run uses the tiny preset with simulated graphs.)"""
    from fast.graphs import GraphedModel, profile_traffic
    from refgdn.capture import ServingConfig
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    m = Qwen3NextModel(Qwen3NextConfig.preset(preset), ops=ops, dtype=dtype, device=device, seed=0,
                       check_values=False)
    K = max(ks)
    cfg = ServingConfig(capture_batch_sizes=batches, max_draft=K, max_batch=max(batches), max_prefill_tokens=64,
                        max_prefill_seqs=4, device=device)
    rows = []
    prof = lambda: profile_traffic(m, cfg)  # noqa: E731
    for graphs in (True, False):
        gm = GraphedModel(m, batch_sizes=batches, max_draft=K, cuda_graphs=graphs, num_slots=max(batches),
                          max_len=(iters * 3 + warmup) * (K + 2) + 64).setup(profile=prof)
        impl = "graphs" if graphs else "eager"
        for B in batches:
            si = torch.arange(B, dtype=torch.int32, device=device)
            tok = torch.zeros(B, dtype=torch.int64, device=device)
            gm.cache.reset(list(range(max(batches))))
            t = common.wall_us(lambda: gm.decode(tok, si), iters=iters, repeats=3, warmup=warmup)
            rows.append(dict(what="model decode step", impl=impl, N=B, us=t, tok_s=B / t * 1e6))
            for k in ks:
                hid = torch.zeros(B, m.config.hidden_size, dtype=m.dtype, device=device)
                accepted = []

                def round_():
                    gm.cache.reset(list(range(max(batches))))   # host zeroing, same cost both ways
                    if graphs:
                        d = [gm.draft(0, si, tok, hid)] + [gm.draft(j, si) for j in range(1, k)]
                    else:
                        d, h, x = [], hid, tok
                        for _ in range(k):
                            meta = m.metadata(gm.cache, si, torch.arange(B + 1, dtype=torch.int32, device=device),
                                              B, mtp=True)
                            h = m.mtp(gm.cache, x, h, meta)
                            x = m.logits(h).argmax(-1)
                            d.append(x)
                    vids = torch.cat([tok[:, None], torch.stack(d, 1)], 1).reshape(-1)
                    tgt = gm.verify(vids, si, k).argmax(-1).view(B, 1 + k)
                    acc = ((tgt[:, :k] == torch.stack(d, 1)).int().cumprod(1).sum(1) + 1).to(torch.int32)
                    gm.accept(si, acc)
                    accepted.append(acc)

                t = common.wall_us(round_, iters=iters, repeats=3, warmup=warmup)
                mean_acc = float(torch.cat(accepted).float().mean())
                rows.append(dict(what=f"speculative round k={k}", impl=impl, N=B, us=t,
                                 tok_s=B * mean_acc / t * 1e6, tok_s_full_accept=B * (1 + k) / t * 1e6,
                                 mean_accepted=mean_acc,
                                 note="random weights: acceptance is the model's, not a real checkpoint's"))
        compiles = dict(gm.lc.real_compiles)
        rows.append(dict(what="Triton compilations per phase", impl=impl, note=str(compiles)))
    return rows


def run(only: str = "all", batches=(1, 8), beside=()) -> list:
    rows = []
    if only == "sweep":
        return sweep_rows(batches)
    if only in ("all", "layer"):
        rows += layer_rows(batches, beside)
    if only in ("all", "model"):
        rows += model_rows()
    return rows


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("all", "layer", "model", "sweep"), default="all")
    ap.add_argument("--batches", default="1,8", help="N of the layer rows (comma-separated)")
    ap.add_argument("--beside", default="", help="comma-separated step_config keys (e.g. pdl): layer rows with "
                    "each off and on")
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    ns = ap.parse_args(argv)
    if not common.gpu_available():
        print("bench_graphs: needs a GPU")
        return
    rows = run(ns.only, tuple(int(b) for b in ns.batches.split(",")), tuple(k for k in ns.beside.split(",") if k))
    print(common.format_table(rows))
    if not ns.no_results:
        common.append_results(TITLE, rows, meta=META)


if __name__ == "__main__":
    main()
