"""FlashInfer's GDN API in fast (fast.flashinfer_ops) on a GPU, beside fla 0.6.0 on the same work.

Shape: Qwen3-Next's (q / k heads 16, v heads 32, K = V = 128: FlashInfer's GVA), bf16 q / k / v, l2norm in the kernel.
FlashInfer itself is not run (its GDN kernels need its CUDA / CuTe-DSL build, which the benchmark machine lacks): the
peer is fla, whose ops vLLM and SGLang run where FlashInfer's are not used.

Prefill (fast.flashinfer_ops.chunk_gated_delta_rule: packed tokens, cu_seqlens, the decay as alpha float32, beta
float32, initial and final states [N, 32, V, K] float32), wall time of an eager call (do_bench, host included), over
request mixes:

  - fast (nothing read back: the chunk tables built on the device);
  - fast with state checkpoints every 1024 tokens (checkpoint_every_n_tokens: the state pass stores them; the
    forward is not pipelined then);
  - fast's chunk_gated_delta_rule_paged on the same tokens as continuations of prefixes (mostly not chunk-aligned)
    on a pool of pages of 1024 tokens (chunk-aligned rows, the page boundaries stored by the state pass);
  - fla 0.6.0's chunk_gated_delta_rule on the same tokens (g = log alpha formed beforehand, not timed; cu_seqlens and
    cu_seqlens_cpu given; states [N, 32, K, V]).

    FLOPs = benchmarks.bench_prefill.chunk_flops(tokens)

Decode (fast.flashinfer_ops.gated_delta_rule_decode_pretranspose on a pool [S, 32, V, K] with
initial_state_indices, the raw gates a, b bf16), per layer of a 32-layer CUDA graph (benchmarks.bench_graphs.
per_layer_us), float32 and bfloat16 pools; MTP verify (1 + 3 tokens, intermediate_states_buffer, the pool frozen)
beside it; fla 0.6.0's fused_recurrent_gated_delta_rule beside the float32 decode rows (its gates formed beforehand,
gathered initial states: benchmarks.bench_decode.fla_fn).

    bytes = e 32 K V N (1 + writes)      e the pool's element size; writes 1 (decode), 1 + k (verify: every step)

Run: python -m benchmarks.bench_flashinfer [--no-results] [--only prefill|decode]
"""
from __future__ import annotations

import torch

from benchmarks import common
from benchmarks.bench_decode import HV, H, K, V, fla_fn, make_problem

PREFILL_TITLE = "FlashInfer's prefill API: fast.flashinfer_ops.chunk_gated_delta_rule vs fla (eager call)"
PREFILL_META = {"op": "fast.flashinfer_ops.chunk_gated_delta_rule, q/k heads 16, v heads 32, K=V=128, bf16, alpha "
                      "and beta fp32, l2norm, states [N, HV, V, K] fp32 (N: tokens)",
                "us": "do_bench median of the eager call (host included)",
                "flops": "benchmarks.bench_prefill.chunk_flops(tokens)"}
DECODE_TITLE = ("FlashInfer's decode API: fast.flashinfer_ops.gated_delta_rule_decode_pretranspose (per layer of a "
                "32-layer graph)")
DECODE_META = {"op": "fast.flashinfer_ops.gated_delta_rule_decode_pretranspose, H=16 HV=32 K=V=128, bf16 q/k/v/a/b, "
                     "pool [S, HV, V, K] fp32 / bf16, l2norm in the kernel",
               "us": "do_bench median of a 32-layer graph's replay / 32",
               "bytes": "e HV K V N (1 + writes): writes 1 (decode) or 1 + k (verify: every step cached)"}
DECODE_N = (1, 8, 32, 128)


def prefill_call(lens: list, what: str = "fast", seed: int = 0, device: str = "cuda", every: int = 1024):
    """FlashInfer's prefill over requests of these lengths: a callable. what: "fast", "ckpt" (fast, checkpoints every
    ``every`` tokens), "paged" (fast's paged prefill, pages of ``every`` tokens), "fla" (fla 0.6.0 on the same tokens;
    None without fla)."""
    import fast.flashinfer_ops as FF
    from benchmarks.bench_prefill import cu_seqlens_of, gdn_inputs
    T, N = sum(lens), len(lens)
    q, k, v, g, beta, S0 = gdn_inputs(T, device, N, seed=seed)
    cu = cu_seqlens_of(lens, device)
    if what == "fla":
        fla_chunk = getattr(common.try_import_fla(), "chunk_gated_delta_rule", None)
        if fla_chunk is None:
            return None
        call, _ = common.call_fla_gdn(fla_chunk, q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                      cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), use_qk_l2norm_in_kernel=True)
        return call
    alpha, b32 = g[0].exp(), beta[0].float()                                # [T, HV] float32
    if what == "paged":
        return _paged_call(q[0], k[0], v[0], alpha, b32, lens, cu, every, seed)
    h0 = S0.transpose(-1, -2).contiguous()                                  # [N, HV, V, K]
    kw = {}
    if what == "ckpt":
        starts = torch.tensor([0] + [x // every for x in lens], device=device).cumsum(0)
        kw = dict(state_checkpoints=torch.empty(int(starts[-1]), HV, V, K, device=device),
                  checkpoint_cu_starts=starts, checkpoint_every_n_tokens=every)
    return lambda: FF.chunk_gated_delta_rule(q[0], k[0], v[0], alpha, b32, None, h0, True, cu, True,  # noqa: E731
                                             **kw)


def _paged_call(q, k, v, alpha, beta, lens: list, cu, page_size: int, seed: int):
    """chunk_gated_delta_rule_paged on the same tokens as continuations: request n has a prefix of (37 + 611 n) mod
    2 page_size tokens (mostly not chunk-aligned) in pages of page_size from a shuffled pool (random states)."""
    import math

    import fast.flashinfer_ops as FF
    dev = q.device
    ids, ptr, last = [], [0], []
    totals = [(37 + 611 * n) % (2 * page_size) + x for n, x in enumerate(lens)]
    counts = [math.ceil(t / page_size) for t in totals]
    perm = torch.randperm(sum(counts) + 1, generator=torch.Generator().manual_seed(seed)).tolist()
    for t, c in zip(totals, counts):
        ids += [perm.pop() for _ in range(c)]
        ptr.append(len(ids))
        last.append(t - (c - 1) * page_size)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    pool = 0.1 * torch.randn(len(perm) + len(ids), HV, V, K, device=dev)
    kw = dict(cu_seqlens=cu, state_pool=pool, page_indices=i32(ids), page_indptr=i32(ptr), page_size=page_size,
              last_page_len=i32(last), use_qk_l2norm_in_kernel=True)
    return lambda: FF.chunk_gated_delta_rule_paged(q, k, v, alpha, beta, **kw)  # noqa: E731


def prefill_rows() -> list:
    from benchmarks.bench_vllm import chunk_mixes, mix_rows
    return mix_rows("prefill", chunk_mixes() + (("1 x 16384", [16384]),),
                    (("fast", "fast.flashinfer_ops (nothing read back)"),
                     ("ckpt", "fast.flashinfer_ops, checkpoints every 1024 tokens"),
                     ("paged", "fast.flashinfer_ops paged: prefixes, pages of 1024"),
                     ("fla", "fla 0.6.0, cu_seqlens + cu_seqlens_cpu")),
                    prefill_call)


def decode_call(N: int, seed: int = 0, pool_dtype: torch.dtype = torch.float32, verify_k: int = 0,
                device: str = "cuda"):
    """One layer's FlashInfer decode (verify_k > 0: an MTP verify of 1 + verify_k tokens into a buffer, the pool
    frozen) on its own pool [2 N + 1, HV, V, K] (random contents, slots by a random permutation): a callable."""
    import fast.flashinfer_ops as FF
    T = 1 + verify_k
    gen = torch.Generator(device=device).manual_seed(seed)         # (drawn on the GPU: a CPU draw of 32 pools of
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731    # N = 128 takes minutes)
    slots = 2 * N + 1
    pool = (0.1 * rnd(slots, HV, V, K)).to(pool_dtype)
    idx = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:N].to(device=device,
                                                                                    dtype=torch.int32)
    q, k = rnd(N, T, H, K).to(torch.bfloat16), rnd(N, T, H, K).to(torch.bfloat16)
    v = rnd(N, T, HV, V).to(torch.bfloat16)
    a, b = rnd(N, T, HV).to(torch.bfloat16), rnd(N, T, HV).to(torch.bfloat16)
    A_log, dt_bias = torch.rand(HV, generator=gen, device=device) * 2 - 1, 0.5 * rnd(HV)
    kw = dict(initial_state=pool, initial_state_indices=idx)
    if verify_k:
        kw.update(intermediate_states_buffer=torch.empty(N, T, HV, V, K, dtype=pool_dtype, device=device),
                  disable_state_update=True)
    return lambda: FF.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, **kw)  # noqa: E731


def decode_rows(copy_gbps: float, ns=DECODE_N) -> list:
    from benchmarks.bench_graphs import per_layer_us
    fla = common.try_import_fla()
    out = []
    for pool_dtype in (torch.float32, torch.bfloat16):
        tag = "" if pool_dtype == torch.float32 else ", bf16 pool"
        e = pool_dtype.itemsize
        for N in ns:
            us = per_layer_us(lambda i: decode_call(N, i, pool_dtype))
            gbs = e * HV * K * V * N * 2 / us / 1e3
            out.append(dict(what="decode", N=N, impl="fast.flashinfer_ops pretranspose, pool" + tag, us=us, GBps=gbs,
                            of_copy=gbs / copy_gbps))
            if fla is not None and pool_dtype == torch.float32 and N <= 32:
                fus = per_layer_us(lambda i: fla_fn(make_problem(N, 0, torch.float32, "cuda", seed=i), fla)[0])
                out.append(dict(what="decode", N=N, impl="fla fused_recurrent alone (gates formed beforehand, "
                                "gathered state in, fp32 final state out)", us=fus, vs_fast=fus / us))
            if N <= 32:
                vus = per_layer_us(lambda i: decode_call(N, i, pool_dtype, verify_k=3))
                vgbs = e * HV * K * V * N * 5 / vus / 1e3
                out.append(dict(what="verify k=3", N=N, impl="fast.flashinfer_ops MTP (buffer, pool frozen)" + tag,
                                us=vus, GBps=vgbs, of_copy=vgbs / copy_gbps))
    return out


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--only", choices=("prefill", "decode"), help="only that table")
    ns = ap.parse_args(argv)
    if not common.gpu_available():
        print("bench_flashinfer: needs a GPU")
        return
    copy = common.copy_bandwidth_gbs()
    tables = (("prefill", PREFILL_TITLE, PREFILL_META, prefill_rows),
              ("decode", DECODE_TITLE, DECODE_META, lambda: decode_rows(copy)))
    common.run_tables(tables, ns.only, ns.no_results, copy_GBps=copy)


if __name__ == "__main__":
    main()
