"""vLLM's serving recurrent op (fast.vllm_ops.fused_recurrent_gated_delta_rule) on a GPU, beside fla's recurrent op.

Shape: Qwen3-Next's (H = 16, HV = 32, K = V = 128), bf16 q / k / v, float32 g, beta and state, l2norm in the kernel,
the state in a slot pool [S, HV, K, V] float32, and again in bfloat16 (vLLM's default SSM cache dtype; no fla peer
there: fla's states are float32) (slots picked by a random permutation, as a server's would be).
Rows, per layer of one CUDA graph of 32 layers' calls (each layer its own pool: a layer's state has left L2 by its
next call, as in a model's decode graph; benchmarks.bench_graphs.per_layer_us):

  - decode (k = 0): N requests of one token, ssm_state_indices [N], read and written in place;
  - speculative verification (k drafts): N requests of 1 + k tokens (cu_seqlens), ssm_state_indices [N, 1 + k]
    (one slot per token's state, vLLM's checkpoints), num_accepted_tokens picking the slot each request starts from;
  - fla 0.6.0's fused_recurrent_gated_delta_rule on the same tokens (benchmarks.bench_decode.fla_fn: its initial
    states gathered from the pool beforehand, the final state written to a new float32 tensor: fla 0.6.0 has no slot
    indices, and per-token states only as a new tensor).

    bytes = e * HV * K * V * N * (1 + writes)     e = the pool's element size (4 or 2), writes = 1 (decode),
                                                  1 + k (one state per token)

GB/s = bytes / time; "of copy" = that over the measured device copy bandwidth (read + write of 1 GiB buffers).

vLLM's conv update (fast.vllm_ops.causal_conv1d_update), a second table: Qwen3-Next's conv channels
D = 2 H K + HV V = 8192, W = 4, bf16 x, weight and conv-state pool [S, D, C] (C = W - 1 + k), no bias, SiLU:

  - decode: x [N, D], conv_state_indices [N]; fla 0.6.0's causal_conv1d_update beside it (its cache [N, D, W] per
    request, no slot indices: the pool gathered beforehand is not timed);
  - speculative verification: x [N, D, 1 + k], num_accepted_tokens picking each request's window (no fla peer: fla
    takes one token per request).

    conv bytes = 2 N D ((W - 1) + (W - 1 + k) + 2 (1 + k))    window read, window written, x read, y written

Newer vLLM's decode without drafts (fast.vllm_ops.fused_recurrent_gated_delta_rule_packed_decode), a third table:
the conv's packed rows [N, 2 H K + HV V] bf16, the raw gates a, b [N, HV] bf16, the pool [S, HV, V, K] (vLLM's layout)
in float32 and bfloat16, l2norm in the kernel, slots by a random permutation (slot 0, the null block, never drawn):

  - fast's packed op (one launch: gates, l2norm, delta rule);
  - SGLang's fused_sigmoid_gating_delta_rule_update in fast (fast.sglang_ops: the same kernel, q, k, v as views of
    the rows, one token per sequence through cu_seqlens);
  - the same step as vLLM's older two ops in fast (fused_gdn_gating, then fused_recurrent_gated_delta_rule on views
    of the packed rows and the pool seen as [S, HV, K, V]);
  - fla 0.6.0's fused_recurrent_gated_delta_rule alone beside the float32 rows (its gates formed beforehand, not
    timed; gathered initial states; benchmarks.bench_decode.fla_fn).

    packed bytes = e * HV * K * V * N * 2        the state read and written once (inputs and outputs are < 1 %)

MTP target verification on [S, HV, V, K] pools (newer vLLM's and SGLang's layout), a fourth table: N requests of
1 + k tokens (cu_seqlens), bf16 q / k / v and raw gates, l2norm in the kernel, every step's state stored, pools in
float32 and bfloat16:

  - SGLang's target verify in fast (fast.sglang_ops.fused_sigmoid_gating_delta_rule_update with
    intermediate_states_buffer [N, 1 + k, HV, V, K] and disable_state_update: each step's state cached, nothing
    committed; the gates formed in the kernel);
  - vLLM's verify in fast on the same pool (fast.vllm_ops.fused_recurrent_gated_delta_rule with state_layout "vk",
    newer vLLM's; ssm_state_indices [N, 1 + k], num_accepted_tokens; the gates formed beforehand, not timed): the
    per-token stores into a K-contiguous layout (slots_config's per-token rule, measured on [S, HV, K, V] pools in
    the first table).

    verify bytes = e * HV * K * V * N * (2 + k)      one state read, 1 + k stored

Newer vLLM's prefill preparation (fast.vllm_ops.fused_post_conv_prep: the conv's packed rows [L, 2 H K + HV V]
bf16 split into contiguous q, k, v, q and k l2-normalised, the gates from a, b [L, HV] bf16), a fifth table, per
call of an 8-call CUDA graph (each call its own tensors), beside the same work as separate launches in fast (two
fast.l2norm on the q and k views, v made contiguous, fast.gdn_gating; no fla peer: fla has no such op):

    prep bytes = L ((2 H K + HV V) 2 e + HV (2 e + 2 * 4))    rows read, q | k | v written, a, b read, g, beta written

vLLM's prefill conv (fast.vllm_ops.causal_conv1d_fn: x [D, T] bf16, D = 8192, W = 4, SiLU, four requests of T / 4
tokens continuing from rows of a conv-state pool, written back in place), a sixth table, wall time of an eager call
(do_bench, host included: the op reads nothing back since 2026-11-29, its tile table built on the device; before, its
host read of query_start_loc synchronised every call), beside fast.causal_conv1d on the same tokens (varlen, no pool,
cu_seqlens_cpu given) and the cost of the [T, D] zeroing pass the op ran after the kernel before 2026-11-29 (padded
requests' outputs: now zeros stored by the kernel, PAD_ZERO), timed alone:

    conv_fn bytes = 2 T D * 2                       x read, y written (the pool's windows: < 0.1 %)

vLLM's chunk op (fast.vllm_ops.chunk_gated_delta_rule, Qwen3-Next heads H = 16, HV = 32, K = V = 128, bf16, l2norm in
the kernel, initial and final states [N, HV, V, K] as newer vLLM holds them, o into core_attn_out), a seventh table,
wall time of an eager call (do_bench, host included) over request mixes: by default it reads nothing back (every
kernel on chunk tables built on the device, since 2026-11-29), with check_values=True it reads the offsets (one sync
per call, behind kernel 1), beside fla's chunk_gated_delta_rule given cu_seqlens alone (its chunk table built from a
host read) and given vLLM's precomputed host offsets (cu_seqlens_cpu, as vLLM's metadata builder holds them):

    chunk FLOPs = benchmarks.bench_prefill.chunk_flops(tokens)

Run: python -m benchmarks.bench_vllm [--no-results] [--only recurrent|packed|verify|prep|conv|conv_fn|chunk]
"""
from __future__ import annotations

import torch

from benchmarks import common
from benchmarks.bench_decode import HV, H, K, V, fla_fn, make_problem, step_inputs
from benchmarks.bench_graphs import per_layer_us

TITLE = "vLLM's serving recurrent op: fast.vllm_ops vs fla (per layer of a 32-layer graph)"
META = {"op": "fast.vllm_ops.fused_recurrent_gated_delta_rule, H=16 HV=32 K=V=128, bf16 q/k/v, fp32 g/beta, "
              "fp32 state (and a bf16-pool set), l2norm in the kernel",
        "us": "do_bench median of a 32-layer graph's replay / 32",
        "bytes": "e HV K V N (1 + writes): e the pool's element size, writes 1 (decode) or 1 + k (a state per token)"}
CONV_TITLE = "vLLM's conv update: fast.vllm_ops.causal_conv1d_update vs fla (per layer of a 32-layer graph)"
CONV_META = {"op": "fast.vllm_ops.causal_conv1d_update, D=8192 W=4, bf16 x/weight/state pool, no bias, SiLU",
             "us": "do_bench median of a 32-layer graph's replay / 32",
             "bytes": "2 N D ((W-1) + (W-1+k) + 2 (1+k)): window read, window written, x read, y written"}
PACKED_TITLE = "vLLM's packed decode: fast.vllm_ops.fused_recurrent_gated_delta_rule_packed_decode (per layer of a 32-layer graph)"
PACKED_META = {"op": "fast.vllm_ops.fused_recurrent_gated_delta_rule_packed_decode, H=16 HV=32 K=V=128, bf16 packed "
                     "rows and gates, pool [S, HV, V, K] fp32 / bf16, l2norm in the kernel",
               "us": "do_bench median of a 32-layer graph's replay / 32",
               "bytes": "e HV K V N 2: e the pool's element size"}
VERIFY_TITLE = ("MTP target verify on [S, HV, V, K] pools: SGLang's and vLLM's ops in fast (per layer of a 32-layer "
                "graph)")
VERIFY_META = {"op": "fast.sglang_ops.fused_sigmoid_gating_delta_rule_update (intermediate_states_buffer, "
                     "disable_state_update) and fast.vllm_ops.fused_recurrent_gated_delta_rule, H=16 HV=32 K=V=128, "
                     "bf16 q/k/v/a/b, pool [S, HV, V, K] fp32 / bf16, l2norm in the kernel",
               "us": "do_bench median of a 32-layer graph's replay / 32",
               "bytes": "e HV K V N (2 + k): one state read, 1 + k stored"}
PREP_TITLE = "Newer vLLM's prefill preparation: fast.vllm_ops.fused_post_conv_prep (per call of an 8-call graph)"
PREP_META = {"op": "fast.vllm_ops.fused_post_conv_prep, H=16 HV=32 K=V=128, bf16 rows and gates, l2norm",
             "us": "do_bench median of an 8-call graph's replay / 8 (N: tokens L)",
             "bytes": "L ((2 H K + HV V) 2 e + HV (2 e + 8)): rows read, q | k | v written, a, b read, g, beta written"}
CONV_FN_TITLE = "vLLM's prefill conv: fast.vllm_ops.causal_conv1d_fn (eager call)"
CONV_FN_META = {"op": "fast.vllm_ops.causal_conv1d_fn, D=8192 W=4, bf16 x/weight/state pool, no bias, SiLU, four "
                      "requests of T/4 tokens (N: tokens T)",
                "us": "do_bench median of the eager call (host included)",
                "bytes": "2 T D * 2: x read, y written"}
CHUNK_TITLE = "vLLM's chunk op: fast.vllm_ops.chunk_gated_delta_rule vs fla (eager call)"
CHUNK_META = {"op": "fast.vllm_ops.chunk_gated_delta_rule, H=16 HV=32 K=V=128, bf16, l2norm, states [N, HV, V, K] "
                    "fp32, o into core_attn_out (N: tokens)",
              "us": "do_bench median of the eager call (host included)",
              "flops": "benchmarks.bench_prefill.chunk_flops(tokens)"}
CASES = ((1, 0), (8, 0), (32, 0), (128, 0), (1, 3), (8, 3), (32, 3))
BF16_CASES = ((1, 0), (8, 0), (32, 0), (128, 0), (1, 3), (8, 3))     # a bfloat16 pool (vLLM's default)


def fast_call(N: int, k: int, seed: int = 0, pool_dtype: torch.dtype = torch.float32):
    """One layer's call on its own pool (N * (2 + k) slots of pool_dtype, random contents): a callable."""
    import fast.vllm_ops as FV
    p = make_problem(N, k, torch.float32, "cuda", seed=seed)
    q, kk, v, g, beta = step_inputs(p)
    gen = torch.Generator().manual_seed(seed)
    slots = N * (2 + k)
    pool = (0.1 * torch.randn(slots, HV, K, V, generator=torch.Generator(device="cuda").manual_seed(seed),
                              device="cuda")).to(pool_dtype)       # (drawn on the GPU: see packed_call)
    perm = torch.randperm(slots, generator=gen).to(torch.int32).cuda()
    kw = dict(initial_state=pool, cu_seqlens=p["cu"], use_qk_l2norm_in_kernel=True)
    if k == 0:
        kw["ssm_state_indices"] = perm[:N]
    else:
        kw["ssm_state_indices"] = perm[:N * (1 + k)].reshape(N, 1 + k)
        kw["num_accepted_tokens"] = p["acc"]
    return lambda: FV.fused_recurrent_gated_delta_rule(q, kk, v, g, beta, **kw)  # noqa: E731


def state_bytes(N: int, k: int, elem: int = 4) -> int:
    writes = 1 if k == 0 else 1 + k
    return elem * HV * K * V * N * (1 + writes)


def rows(copy_gbps: float, cases=CASES, pool_dtype: torch.dtype = torch.float32) -> list:
    """The table's rows; copy_gbps: the device copy bandwidth measured by the caller (the "of copy" column).
    pool_dtype: the state pool's dtype (fla's peer rows only with float32: its states are float32)."""
    fla = common.try_import_fla() if pool_dtype == torch.float32 else None
    impl = "fast.vllm_ops" + ("" if pool_dtype == torch.float32 else f", {str(pool_dtype)[6:]} pool")
    out = []
    for N, k in cases:
        us = per_layer_us(lambda i: fast_call(N, k, i, pool_dtype))
        gbs = state_bytes(N, k, pool_dtype.itemsize) / us / 1e3
        out.append(dict(what="decode" if k == 0 else f"verify k={k}", N=N, impl=impl, us=us, GBps=gbs,
                        of_copy=gbs / copy_gbps))
        if fla is not None:
            fus = per_layer_us(lambda i: fla_fn(make_problem(N, k, torch.float32, "cuda", seed=i), fla)[0])
            out.append(dict(what="decode" if k == 0 else f"verify k={k}", N=N, impl="fla fused_recurrent (gathered "
                            "state in, fp32 final state out)", us=fus, vs_fast=fus / us))
    return out


CONV_D, CONV_W = 2 * 16 * K + HV * V, 4
CONV_CASES = ((1, 0), (8, 0), (32, 0), (128, 0), (8, 3), (32, 3))


def conv_call(N: int, k: int, seed: int = 0, peer: bool = False):
    """One layer's conv update on its own pool (random contents, slots by a random permutation): a callable; peer:
    fla 0.6.0's causal_conv1d_update on a per-request cache [N, D, W] instead (decode only)."""
    import fast.vllm_ops as FV
    gen = torch.Generator().manual_seed(seed)
    D, W = CONV_D, CONV_W
    bf = dict(dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(D, W, generator=gen) / W ** 0.5).to(**bf)
    if peer:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update as fla_update
        x, cache = torch.randn(N, D, generator=gen).to(**bf), torch.randn(N, D, W, generator=gen).to(**bf)
        return lambda: fla_update(x, cache, None, w, None, "silu")  # noqa: E731
    S, C = 2 * N, W - 1 + k
    pool = torch.randn(S, D, C, generator=gen).to(**bf)
    slots = torch.randperm(S, generator=gen)[:N].to(device="cuda", dtype=torch.int32)
    if k == 0:
        x, kw = torch.randn(N, D, generator=gen).to(**bf), {}
    else:
        x = torch.randn(N, D, 1 + k, generator=gen).to(**bf)
        kw = dict(num_accepted_tokens=torch.randint(1, 2 + k, (N,), generator=gen).to(device="cuda", dtype=torch.int32))
    return lambda: FV.causal_conv1d_update(x, pool, w, None, "silu", slots, **kw)  # noqa: E731


def conv_bytes(N: int, k: int) -> int:
    return 2 * N * CONV_D * ((CONV_W - 1) + (CONV_W - 1 + k) + 2 * (1 + k))


def conv_rows(copy_gbps: float, cases=CONV_CASES) -> list:
    """The conv table's rows (same columns as rows())."""
    fla = common.try_import_fla()
    out = []
    for N, k in cases:
        what = "decode" if k == 0 else f"verify k={k}"
        us = per_layer_us(lambda i: conv_call(N, k, i))
        gbs = conv_bytes(N, k) / us / 1e3
        out.append(dict(what=what, N=N, impl="fast.vllm_ops conv", us=us, GBps=gbs, of_copy=gbs / copy_gbps))
        if fla is not None and k == 0:
            fus = per_layer_us(lambda i: conv_call(N, k, i, peer=True))
            out.append(dict(what=what, N=N, impl="fla causal_conv1d_update (per-request cache)", us=fus,
                            vs_fast=fus / us))
    return out


PACKED_N = (1, 8, 32, 128)


def packed_call(N: int, seed: int = 0, pool_dtype: torch.dtype = torch.float32, two_ops: bool = False,
                sglang: bool = False):
    """One layer's packed decode on its own pool (2 N + 1 slots [S, HV, V, K] of pool_dtype, random contents): a
    callable; two_ops: fused_gdn_gating, then fused_recurrent_gated_delta_rule on the same memory instead; sglang:
    SGLang's fused_sigmoid_gating_delta_rule_update (fast.sglang_ops) on views of the same rows, one token per
    sequence through cu_seqlens, as SGLang's decode calls it."""
    import fast.sglang_ops as FS
    import fast.vllm_ops as FV
    gen = torch.Generator(device="cuda").manual_seed(seed)          # (drawn on the GPU: a CPU draw of 32 pools of
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731      # N = 128 takes minutes)
    slots = 2 * N + 1
    pool = (0.1 * rnd(slots, HV, V, K)).to(pool_dtype)
    perm = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(seed))
    idx = (1 + perm[:N]).to(device="cuda", dtype=torch.int32)     # slot 0: the null block
    x = rnd(N, 2 * H * K + HV * V).to(torch.bfloat16)
    a, b = rnd(N, HV).to(torch.bfloat16), rnd(N, HV).to(torch.bfloat16)
    A_log, dt_bias = torch.rand(HV, generator=gen, device="cuda") * 2 - 1, 0.5 * rnd(HV)
    out = torch.empty(N, 1, HV, V, dtype=x.dtype, device="cuda")
    if not (two_ops or sglang):
        return lambda: FV.fused_recurrent_gated_delta_rule_packed_decode(  # noqa: E731
            x, a, b, A_log, dt_bias, K ** -0.5, pool, out, idx, True)
    q = x[:, :H * K].unflatten(1, (H, K))[None]                    # [1, N, H, K]: views of the packed rows
    kk = x[:, H * K:2 * H * K].unflatten(1, (H, K))[None]
    v = x[:, 2 * H * K:].unflatten(1, (HV, V))[None]
    cu = torch.arange(N + 1, dtype=torch.int32, device="cuda")
    if sglang:
        return lambda: FS.fused_sigmoid_gating_delta_rule_update(  # noqa: E731
            A_log, a, dt_bias, 1.0, 20.0, q, kk, v, b, pool, idx, K ** -0.5, True, cu)

    def call():
        g, beta = FV.fused_gdn_gating(A_log, a, b, dt_bias)
        return FV.fused_recurrent_gated_delta_rule(q, kk, v, g, beta, K ** -0.5, pool.transpose(-1, -2), True, cu,
                                                   idx, use_qk_l2norm_in_kernel=True)
    return call


def packed_rows(copy_gbps: float, ns=PACKED_N) -> list:
    """The packed-decode table's rows (same columns as rows()), float32 then bfloat16 pools."""
    fla = common.try_import_fla()
    out = []
    for pool_dtype in (torch.float32, torch.bfloat16):
        tag = "" if pool_dtype == torch.float32 else ", bf16 pool"
        for N in ns:
            us = per_layer_us(lambda i: packed_call(N, i, pool_dtype))
            gbs = pool_dtype.itemsize * HV * K * V * N * 2 / us / 1e3
            out.append(dict(what="packed decode", N=N, impl="fast.vllm_ops packed" + tag, us=us, GBps=gbs,
                            of_copy=gbs / copy_gbps))
            two = per_layer_us(lambda i: packed_call(N, i, pool_dtype, two_ops=True))
            out.append(dict(what="packed decode", N=N, impl="fast: fused_gdn_gating + fused_recurrent" + tag, us=two,
                            vs_fast=two / us))
            sg = per_layer_us(lambda i: packed_call(N, i, pool_dtype, sglang=True))
            out.append(dict(what="packed decode", N=N, impl="fast.sglang_ops fused_sigmoid_gating_delta_rule_update"
                            + tag, us=sg, vs_fast=sg / us))
            if fla is not None and pool_dtype == torch.float32 and N <= 32:     # (N = 128: the recurrent table)
                fus = per_layer_us(lambda i: fla_fn(make_problem(N, 0, torch.float32, "cuda", seed=i), fla)[0])
                out.append(dict(what="packed decode", N=N, impl="fla fused_recurrent alone (gates formed beforehand, "
                                "gathered state in, fp32 final state out)", us=fus, vs_fast=fus / us))
    return out


VERIFY_CASES = ((1, 3), (8, 3), (32, 3))


def verify_call(N: int, k: int, seed: int = 0, pool_dtype: torch.dtype = torch.float32, engine: str = "sglang",
                device: str = "cuda"):
    """One layer's MTP target verify on its own [S, HV, V, K] pool (random contents): a callable. engine "sglang":
    SGLang's op with an intermediate_states_buffer [N, 1 + k, HV, V, K] (pool_dtype) and disable_state_update; "vllm":
    vLLM's recurrent op in its newer generation (state_layout "vk": the pool as it is), a slot per token ([N, 1 + k]
    by a random permutation of N (2 + k) slots) and num_accepted_tokens. device: "cuda" (the CPU: the tests, at a tiny shape)."""
    import fast.sglang_ops as FS
    import fast.vllm_ops as FV
    p = make_problem(N, k, torch.float32, device, seed=seed)
    q, kk, v, g, beta = step_inputs(p)
    slots = N * (2 + k)
    gen = torch.Generator(device=device).manual_seed(seed)      # (drawn on the GPU: see packed_call)
    pool = (0.1 * torch.randn(slots, HV, V, K, generator=gen, device=device)).to(pool_dtype)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=torch.int32)
    if engine == "sglang":
        buf = torch.empty(N, 1 + k, HV, V, K, dtype=pool_dtype, device=device)
        return lambda: FS.fused_sigmoid_gating_delta_rule_update(  # noqa: E731
            p["A_log"], p["a"], p["dt_bias"], 1.0, 20.0, q, kk, v, p["b"], pool, perm[:N], K ** -0.5, True, p["cu"],
            disable_state_update=True, intermediate_states_buffer=buf, cache_steps=1 + k)
    idx = perm[:N * (1 + k)].reshape(N, 1 + k)
    return lambda: FV.fused_recurrent_gated_delta_rule(  # noqa: E731
        q, kk, v, g, beta, K ** -0.5, pool, True, p["cu"], idx, p["acc"], use_qk_l2norm_in_kernel=True,
        state_layout="vk")


def verify_rows(copy_gbps: float, cases=VERIFY_CASES) -> list:
    """The verify table's rows (same columns as rows()): SGLang's verify, then vLLM's on the same layout."""
    out = []
    for pool_dtype in (torch.float32, torch.bfloat16):
        tag = "" if pool_dtype == torch.float32 else ", bf16 pool"
        for N, k in cases:
            us = per_layer_us(lambda i: verify_call(N, k, i, pool_dtype))
            gbs = state_bytes(N, k, pool_dtype.itemsize) / us / 1e3
            out.append(dict(what=f"verify k={k}", N=N, impl="fast.sglang_ops (cache every step)" + tag, us=us,
                            GBps=gbs, of_copy=gbs / copy_gbps))
            vus = per_layer_us(lambda i: verify_call(N, k, i, pool_dtype, engine="vllm"))
            vgbs = state_bytes(N, k, pool_dtype.itemsize) / vus / 1e3
            out.append(dict(what=f"verify k={k}", N=N, impl="fast.vllm_ops on [S, HV, V, K] (slot per token)" + tag,
                            us=vus, GBps=vgbs, of_copy=vgbs / copy_gbps, vs_fast=vus / us))
    return out


PREP_L = (512, 4096, 16384)


def prep_call(L: int, seed: int = 0, chain: bool = False, device: str = "cuda"):
    """One call of the prefill preparation on its own tensors (L tokens at Qwen3-Next's heads): a callable; chain:
    the same outputs through separate launches instead (fast.l2norm twice, a copy, fast.gdn_gating)."""
    import fast
    import fast.vllm_ops as FV
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = rnd(L, 2 * H * K + HV * V).to(torch.bfloat16)
    a, b = rnd(L, HV).to(torch.bfloat16), rnd(L, HV).to(torch.bfloat16)
    A_log, dt_bias = torch.rand(HV, generator=gen, device=device) * 2 - 1, 0.5 * rnd(HV)
    if not chain:
        return lambda: FV.fused_post_conv_prep(x, a, b, A_log, dt_bias, H, K, V, True, False)  # noqa: E731

    def call():
        q = fast.l2norm(x[:, :H * K].unflatten(1, (H, K)))
        kk = fast.l2norm(x[:, H * K:2 * H * K].unflatten(1, (H, K)))
        v = x[:, 2 * H * K:].unflatten(1, (HV, V)).contiguous()
        g, beta = fast.gdn_gating(A_log, a, dt_bias, b.float())
        return q, kk, v, g, beta
    return call


def prep_bytes(L: int, e: int = 2) -> int:
    return L * ((2 * H * K + HV * V) * 2 * e + HV * (2 * e + 2 * 4))


def prep_rows(copy_gbps: float, lengths=PREP_L) -> list:
    """The prep table's rows: the fused op, then the separate launches (vs_fast: their time over the op's)."""
    out = []
    for L in lengths:
        us = per_layer_us(lambda i: prep_call(L, i), layers=8)
        gbs = prep_bytes(L) / us / 1e3
        out.append(dict(what="post-conv prep", N=L, impl="fast.vllm_ops.fused_post_conv_prep", us=us, GBps=gbs,
                        of_copy=gbs / copy_gbps))
        cus = per_layer_us(lambda i: prep_call(L, i, chain=True), layers=8)
        out.append(dict(what="post-conv prep", N=L, impl="fast: l2norm x 2 + copy + gdn_gating", us=cus,
                        GBps=prep_bytes(L) / cus / 1e3, vs_fast=cus / us))
    return out


CONV_FN_T = (4096, 16384)


def conv_fn_call(T: int, what: str = "op", seed: int = 0, device: str = "cuda", D: int = CONV_D):
    """One prefill conv of T tokens (a multiple of 4) over D channels in four requests (the second padded when what
    == "op-padded"): a callable. what: "op" / "op-padded" (fast.vllm_ops.causal_conv1d_fn), "plain"
    (fast.causal_conv1d, varlen, no pool), "zeroing" (the removed epilogue alone: torch.where over the [T, D] output)."""
    import fast
    import fast.vllm_ops as FV
    gen = torch.Generator().manual_seed(seed)
    W = CONV_W
    bf = dict(dtype=torch.bfloat16, device=device)
    w = (torch.randn(D, W, generator=gen) / W ** 0.5).to(**bf)
    x = torch.randn(T, D, generator=gen).to(**bf).T                       # [D, T]: vLLM's mixed_qkv.transpose(0, 1)
    qsl = torch.arange(0, T + 1, T // 4, dtype=torch.int32, device=device)
    pool = torch.randn(8, D, W - 1, generator=gen).to(**bf)
    rows = torch.tensor([5, -1 if what == "op-padded" else 2, 7, 0], dtype=torch.int32, device=device)
    init = torch.tensor([True, False, True, True], device=device)
    if what in ("op", "op-padded"):
        return lambda: FV.causal_conv1d_fn(x, w, None, pool, qsl, rows, init, "silu")  # noqa: E731
    if what == "plain":
        qsl_cpu = qsl.cpu()                              # (once: a copy per call would synchronise each call)
        return lambda: fast.causal_conv1d(x.T[None], w, None, "silu", cu_seqlens=qsl,  # noqa: E731
                                          cu_seqlens_cpu=qsl_cpu)
    y, live = torch.empty(T, D, **bf), torch.rand(T, generator=gen).to(device) > 0.25
    return lambda: torch.where(live[:, None], y, 0.0)  # noqa: E731


def conv_fn_rows(copy_gbps: float, lengths=CONV_FN_T) -> list:
    import triton
    out = []
    for T in lengths:
        byt = 2 * T * CONV_D * 2
        base = None
        for what, impl in (("op", "fast.vllm_ops.causal_conv1d_fn"),
                           ("op-padded", "fast.vllm_ops.causal_conv1d_fn, one request padded"),
                           ("plain", "fast.causal_conv1d (varlen, no pool)"),
                           ("zeroing", "the zeroing pass removed (torch.where over [T, D])")):
            us = triton.testing.do_bench(conv_fn_call(T, what), warmup=25, rep=200) * 1e3
            base = us if base is None else base
            out.append(dict(what="prefill conv", N=T, impl=impl, us=us, GBps=byt / us / 1e3,
                            of_copy=byt / us / 1e3 / copy_gbps, vs_fast=None if what == "op" else us / base))
        # capturable since it reads nothing back: device time per call of an 8-call graph (each its own tensors)
        gus = per_layer_us(lambda i: conv_fn_call(T, "op", seed=i), layers=8)
        out.append(dict(what="prefill conv", N=T, impl="fast.vllm_ops.causal_conv1d_fn, per call of an 8-call graph",
                        us=gus, GBps=byt / gus / 1e3, of_copy=byt / gus / 1e3 / copy_gbps, vs_fast=gus / base))
    return out


def chunk_mixes() -> tuple:
    """(name, sequence lengths): vLLM prefill batches, small to bench_prefill's 16-sequence mix."""
    from benchmarks.bench_prefill import VARLEN_TOTAL, varlen_lengths
    return (("4 x 256", [256] * 4), ("8 x 1024", [1024] * 8), (f"16 seqs {VARLEN_TOTAL}", varlen_lengths()))


def chunk_call(lens: list, what: str = "op", seed: int = 0, device: str = "cuda"):
    """vLLM's chunk op over requests of these lengths: a callable. what: "op" (fast, nothing read back), "checked"
    (fast, check_values=True), "fla" (fla given cu_seqlens), "fla-cpu" (fla given cu_seqlens_cpu as well)."""
    import fast.vllm_ops as FV
    from benchmarks.bench_prefill import cu_seqlens_of, gdn_inputs
    T, N = sum(lens), len(lens)
    q, k, v, g, beta, S0 = gdn_inputs(T, device, N, seed=seed)
    cu = cu_seqlens_of(lens, device).to(torch.int32)
    if what in ("op", "checked"):
        h0 = S0.transpose(-1, -2).contiguous()                                   # [N, HV, V, K]
        out = torch.empty_like(v)
        kw = dict(check_values=True) if what == "checked" else {}
        return lambda: FV.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, cu, False, True,  # noqa: E731
                                                 state_layout="vk", core_attn_out=out, **kw)
    fla = common.try_import_fla()
    fla_chunk = getattr(fla, "chunk_gated_delta_rule", None)
    if fla_chunk is None:
        return None
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)
    if what == "fla-cpu":
        kw["cu_seqlens_cpu"] = cu.long().cpu()
    call, _ = common.call_fla_gdn(fla_chunk, q, k, v, g, beta, **kw)
    return call


def mix_rows(label: str, mixes, impls, call_of) -> list:
    """Eager prefill rows over request mixes (do_bench of the call, host included; TFLOP/s by
    benchmarks.bench_prefill.chunk_flops): for each (name, lengths) of mixes and each (what, impl) of impls, the call
    call_of(lengths, what) (None: skipped), vs_fast against the mix's first row."""
    import triton
    from benchmarks.bench_prefill import chunk_flops
    out = []
    for name, lens in mixes:
        T = sum(lens)
        base = None
        for what, impl in impls:
            call = call_of(lens, what)
            if call is None:
                continue
            us = triton.testing.do_bench(call, warmup=25, rep=200) * 1e3
            out.append(dict(what=f"{label} {name}", N=T, impl=impl, us=us, TFLOPs=chunk_flops(T) / us / 1e6,
                            vs_fast=None if base is None else us / base))
            base = us if base is None else base
            del call
        torch.cuda.empty_cache()
    return out


def chunk_rows(mixes=None) -> list:
    return mix_rows("chunk", mixes or chunk_mixes(),
                    (("op", "fast.vllm_ops (nothing read back)"),
                     ("checked", "fast.vllm_ops, check_values=True (reads the offsets)"),
                     ("fla", "fla 0.6.0, cu_seqlens"), ("fla-cpu", "fla 0.6.0, cu_seqlens + cu_seqlens_cpu")),
                    chunk_call)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--only", choices=("packed", "recurrent", "verify", "prep", "conv", "conv_fn", "chunk"),
                    help="only that table")
    ns = ap.parse_args(argv)
    if not common.gpu_available():
        print("bench_vllm: needs a GPU")
        return
    copy = common.copy_bandwidth_gbs()          # measured once: the rows' "of copy" and the section's meta
    tables = (("recurrent", TITLE, META, lambda: rows(copy) + rows(copy, BF16_CASES, torch.bfloat16)),
              ("packed", PACKED_TITLE, PACKED_META, lambda: packed_rows(copy)),
              ("verify", VERIFY_TITLE, VERIFY_META, lambda: verify_rows(copy)),
              ("prep", PREP_TITLE, PREP_META, lambda: prep_rows(copy)),
              ("conv", CONV_TITLE, CONV_META, lambda: conv_rows(copy)),
              ("conv_fn", CONV_FN_TITLE, CONV_FN_META, lambda: conv_fn_rows(copy)),
              ("chunk", CHUNK_TITLE, CHUNK_META, lambda: chunk_rows()))
    common.run_tables(tables, ns.only, ns.no_results, copy_GBps=copy)


if __name__ == "__main__":
    main()
