"""The model's plain decode step vs one speculative round, eager, and the acceptance at which speculation
breaks even (issue 9's GPU figure).

Model: refgdn.model's "bench" preset (hidden 2048; GDN 16 q/k heads, 32 value heads, head dim 128; 4 layers
with one full-attention layer; vocab 32K; dense SwiGLU MLP of Qwen3-Next's active width), fast ops, bf16
weights, float32 GDN state, eager (no CUDA graphs), batch 1 and 32, each request with a CONTEXT-token prompt
already prefilled. Timed as wall clock per call (a loop of calls, one synchronize at the end, median of
repeats): eager steps are bound by kernel launches, which do_bench's device timers would leave out.

    plain decode step:  decode(1 token/request) + lm_head + argmax + the host read of the tokens
    speculative round:  MTP catch-up (1 token/request) + (k - 1) MTP draft steps, each with lm_head + argmax
                        and fresh metadata + verify(1 + k tokens/request) + lm_head + greedy acceptance
                        + model.accept (rollback) + the round's host read; i.e. refgdn.speculative's round
                        at the smallest catch-up (the catch-up grows with the previous round's accepted tokens)

Break-even: a round emits E[a] tokens per request (a = num_accepted, bonus included) against 1 per plain
step, so speculation pays when E[a] > t_round / t_decode. Reported: that mean accepted length, the matching
acceptance rate (accepted / proposed drafts = (E[a] - 1) / k, as refgdn.generate reports it) and the
per-draft acceptance probability alpha of the i.i.d. model E[a] = (1 - alpha^(k+1)) / (1 - alpha).
Random weights: the round's own acceptance is meaningless and not reported.

Run: python -m benchmarks.bench_model   (appends a table to benchmarks/RESULTS.md)
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks import common

TITLE = "Model: plain decode step vs speculative round (eager, fast ops, bf16), break-even acceptance"
CONTEXT = 256
I32 = torch.int32


def wall_ms(fn, iters: int = 30, repeats: int = 5, device: str = "cuda") -> float:
    """Median over `repeats` of (wall time of `iters` calls + one synchronize) / iters, in ms."""
    for _ in range(min(iters, 5)):
        fn()
    common.synchronize(device)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        common.synchronize(device)
        out.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(out)


def break_even_alpha(mean_len: float, k: int) -> float:
    """alpha in [0, 1] with (1 - alpha^(k+1)) / (1 - alpha) = mean_len (bisection; nan if > 1 + k)."""
    if mean_len > 1 + k:
        return float("nan")
    if mean_len <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        val = sum(mid ** i for i in range(k + 1))
        lo, hi = (mid, hi) if val < mean_len else (lo, mid)
    return (lo + hi) / 2


def setup(model, B: int, max_draft: int):
    """A cache with B requests of CONTEXT prefilled tokens (slots 0..B-1)."""
    dev = model.device
    cache = model.allocate_cache(B, CONTEXT + 2 * max_draft + 8, max_draft=max_draft)
    si = torch.arange(B, dtype=I32, device=dev)
    qsl = torch.arange(B + 1, dtype=I32, device=dev) * CONTEXT
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (B * CONTEXT,), device=dev, generator=gen)
    hidden = model.prefill(cache, ids, model.metadata(cache, si, qsl, B * CONTEXT))
    return cache, si, hidden[qsl[1:].long() - 1]


def rows_for(model, B: int, ks=(1, 3), iters: int = 30, repeats: int = 5) -> list:
    from refgdn.sampling import greedy_accept
    from refgdn.speculative import fresh_draft_metadata

    dev = model.device
    K = max(ks)
    cache, si, h_last = setup(model, B, K)
    lens0, mlens0 = cache.kv_lens_buf.clone(), cache.mtp_kv_lens_buf.clone()
    one = torch.arange(B + 1, dtype=I32, device=dev)
    tok = torch.zeros(B, dtype=torch.int64, device=dev)

    def restore():          # keep positions fixed across timed calls (a device copy of a few bytes)
        cache.kv_lens_buf.copy_(lens0)
        cache.mtp_kv_lens_buf.copy_(mlens0)

    def decode_step():
        restore()
        h = model.decode(cache, tok, model.metadata(cache, si, one, B))
        return model.logits(h).argmax(-1).tolist()

    t_dec = wall_ms(decode_step, iters, repeats, dev.type)
    rows = [dict(what="plain decode step", B=B, k="-", ms=t_dec, tok_s_per_req=1e3 / t_dec, tok_s=B * 1e3 / t_dec)]
    for k in ks:
        kd = torch.full((B,), k, dtype=torch.int64, device=dev)
        qsl_v = torch.arange(B + 1, dtype=I32, device=dev) * (1 + k)

        def round_():
            restore()
            # catch-up (one token per request here) and k - 1 single-token draft steps, metadata per step
            h = model.mtp(cache, tok, h_last, model.metadata(cache, si, one, B, mtp=True))
            drafts = []
            for j in range(k):
                d = model.logits(h).argmax(-1)
                drafts.append(d)
                if j + 1 < k:
                    h = model.mtp(cache, d, h, fresh_draft_metadata(model, cache, si, j + 1))
            D = torch.stack(drafts, 1)
            ids = torch.cat([tok[:, None], D], 1).reshape(-1)
            vl = model.logits(model.verify(cache, ids, model.metadata(cache, si, qsl_v, B * (1 + k))))
            acc, emitted = greedy_accept(D, vl.view(B, 1 + k, -1), kd)
            model.accept(cache, si, acc)
            return torch.cat([acc[:, None].long(), emitted], 1).tolist()

        t_r = wall_ms(round_, iters, repeats, dev.type)
        ratio = t_r / t_dec
        alpha = break_even_alpha(ratio, k)
        rows.append(dict(what=f"speculative round k={k}", B=B, k=k, ms=t_r, round_over_decode=ratio,
                         break_even_mean_accepted=ratio if ratio <= 1 + k else f"> {1 + k}: never",
                         break_even_accept_rate=(ratio - 1) / k if ratio <= 1 + k else "never",
                         break_even_alpha_iid=alpha,
                         tok_s_at_full_accept=B * (1 + k) * 1e3 / t_r))
    return rows


def run(preset: str = "bench", ops: str = "fast", dtype=torch.bfloat16, device: str = "cuda", batches=(1, 32),
        **kw) -> list:
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    m = Qwen3NextModel(Qwen3NextConfig.preset(preset), ops=ops, dtype=dtype, device=device, seed=0)
    rows = []
    for B in batches:
        rows += rows_for(m, B, **kw)
    return rows


META = {"model": "bench preset (hidden 2048, GDN H=16 HV=32 K=V=128, 4 layers: 3 GDN + 1 attention, vocab 32768), "
                 f"fast ops, bf16 weights, fp32 GDN state, eager, context {CONTEXT} tokens per request",
        "timing": "wall clock per call (loop + one sync, median of 5), host read of the tokens included",
        "break-even": "speculation pays when mean accepted length per round > round ms / decode ms; "
                      "accept rate = (that - 1) / k; alpha = per-draft acceptance of the i.i.d. model"}


def main():
    if not common.gpu_available():
        print("bench_model: needs a GPU")
        return
    rows = run()
    print(common.format_table(rows))
    common.append_results(TITLE, rows, meta=META)


if __name__ == "__main__":
    main()
