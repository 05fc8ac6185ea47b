"""Compile fast's backward kernels (and the forward kernels they recompute with) for sm_90 on a machine
WITHOUT a GPU, and report each variant's shared memory, registers and spills.

    python -m benchmarks.compile_check [bf16|fp16|fp32] [--shape small|bench|bench16] [--precision G/R[/16-bit]]
                                       [--arch 90|80|86|89|100|120]

A development aid, not a test: the Triton interpreter (the CPU path) neither compiles nor allocates, so
it cannot see a GPU compile error (e.g. a runtime branch that changes a variable's shape), a config whose
shared memory exceeds the 227 KB an H100/H200 block may use, or register spills. This script installs a
stand-in Triton driver that reports an sm_90 target, makes every launch a compile-only warmup (nothing
runs; outputs stay garbage), runs fast.chunk_bwd / fast.conv_bwd's host code on CPU tensors, and runs the
bundled ptxas on each compiled kernel's PTX for the register and spill counts. "per SM" is how many of the
kernel's blocks one H100 / H200 SM holds, and by which limit (benchmarks.sm90.blocks_per_sm): a config a few bytes
over a shared-memory step runs at half the occupancy it was tuned for (RESULTS.md, 2026-11-27, the fused state
pass). It relies on Triton internals (``triton.runtime.driver.set_active``, ``JITFunction.run``): written against
Triton 3.9; the GPU machine's Triton may allocate differently, so keep margins.

Shapes: small = B 1, T 128, H 2, HV 4, K = V = 128 at BT 16/32/64 (l2norm + fused gating at 64), plus the
16-bit backward variant and conv1d; bench = bench_train's B 4, H 16, HV 32 (the configs depend on N * HV);
bench16 = the same with the 16-bit backward; forward = the prefill forward at Qwen3-Next's shape, B 1, B 4 and 16
sequences (the state pass's paths); decode = fast.serving's step kernels at Qwen3-Next's shape (float32
state): decode at N = 1, 8, 16 and verify of 1 + 3 tokens at N = 8; norm = fast.norm's gated output norm at
V = 128 (decode rows and a T = 4096 prefill, forward and backward) and the model's plain norms (hidden 2048,
head_dim 256); vllm = the vLLM / SGLang ops' kernels at Qwen3-Next's shape (fast.vllm_ops' recurrent op in both
generations, its gated op, the packed decode, the prefill preparation; SGLang's decode and target verify);
flashinfer = FlashInfer's API (fast.flashinfer_ops): the prefill with and without state checkpoints, the decode with
output_state_indices, the MTP step into its buffer and into per-token pool rows.

--arch compiles for another GPU generation instead (the configs are the ones fast picks for it: the sm_90-tuned ones,
but the chunk op's state passes and kernel 4 on warp-MMA GPUs, sm_8x / sm_12x: fast.chunk.common._warp_mma):
every variant's shared memory is checked against that GPU's per-block limit (SMEM_PER_BLOCK; exit status 1 and
the variants named when one is over, which would fail to launch there), with its registers and spills.

COMPILE_CHECK_PTX=DIR keeps each variant's PTX in DIR (e.g. to see where the compiler put fences, barriers and the
broadcast of a scalar atomic's result).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


# the most shared memory one block may use (the opt-in limit, cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute
# capability: a launch over it fails (Triton's OutOfResources) on that GPU
SMEM_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compile_check", description=__doc__.splitlines()[0])
    ap.add_argument("dtype", nargs="?", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--shape", default="small",
                    choices=["small", "bench", "bench16", "decode", "forward", "norm", "vllm", "flashinfer"])
    ap.add_argument("--precision", default=None, metavar="G/R[/16-bit[/forward]]",
                    help="bench shape: the backward's precision tuple (as benchmarks.grad_precision's "
                         "--variants, e.g. bf16x2/tf32/16-bit) instead of the dtype's default")
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_PER_BLOCK),
                    help="the compute capability to compile for (90: H100 / H200; 80: A100; 86 / 89: RTX 30 / 40, "
                         "A10, L4, L40S; 100: B200; 120: RTX 50): each variant's shared memory is checked against "
                         "that GPU's per-block limit")
    ap.add_argument("--step", default="", metavar="KEY=INT,...",
                    help="decode shape: step_config keys put over the pinned ones (bench_decode.launch_overrides)")
    args = ap.parse_args(argv)
    if "triton" in sys.modules or "fast" in sys.modules:
        print("compile_check: run it in a fresh process (python -m benchmarks.compile_check)")
        return 2
    compiled = []
    from .sm90 import blocks_per_sm, install_compile_only   # before fast / triton load: real compiles
    install_compile_only(lambda name, kernel: compiled.append((name, kernel)), arch=args.arch)
    import torch
    import triton

    import fast.chunk as fc
    import fast.chunk_bwd as cb
    import fast.conv_bwd as cvb
    fc.state._num_sms = lambda device: 132                # H100 SXM / H200 (state_config's, in fast.chunk.state)
    fc.common._capability = lambda kind, index: divmod(args.arch, 10)   # the rules' _warp_mma: the target's
    dt = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[args.dtype]

    def gdn(B, T, H, HV, BT, l2=False, gate=False, precision=None):
        K = V = 128
        q, k = torch.randn(B, T, H, K).to(dt), torch.randn(B, T, H, K).to(dt)
        v, do = torch.randn(B, T, HV, V).to(dt), torch.randn(B, T, HV, V).to(dt)
        g, beta = -torch.rand(B, T, HV), torch.rand(B, T, HV).to(dt)
        A_log, dt_bias = (torch.rand(HV), torch.randn(HV)) if gate else (None, None)
        cb.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, torch.randn(B, HV, K, V), None,
                                      torch.randn(B, HV, K, V), None, l2, A_log, dt_bias, BT,
                                      precision=precision)

    if args.shape == "decode":
        import fast.serving as fs
        from benchmarks.bench_decode import launch_overrides, make_problem
        fs.pdl_supported = lambda device: args.arch >= 90     # the sm_90 variants (programmatic dependents)
        step = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.step.split(",") if kv}
        for N, k in ((1, 0), (8, 0), (16, 0), (8, 3)):
            p = make_problem(N, k, torch.float32, "cpu")
            args_ = (p["x"], p["a"], p["b"], p["conv_weight"], p["conv_bias"], p["A_log"], p["dt_bias"], p["cache"],
                     p["idx"])
            with launch_overrides(step=step or None):
                fs.gdn_decode(*args_) if k == 0 else fs.gdn_verify(*args_, p["cu"])
    elif args.shape == "forward":
        # the prefill forward's kernels at Qwen3-Next's shape (H 16, HV 32, K = V = 128, BT 64): B = 1 (the unfused
        # pass, kernel 4), B = 4 (the pass forms o) and 16 sequences (varlen, initial states); B = 1 and 4 with l2norm
        K = V = 128
        x = lambda *s: torch.randn(*s).to(dt)                   # noqa: E731
        for B, N, l2 in ((1, None, False), (4, None, False), (1, 16, False), (1, None, True), (4, None, True)):
            T = 128 if N is None else 16 * 64
            cu = torch.arange(0, T + 1, T // N) if N else None
            fc.chunk_gated_delta_rule_fwd(x(B, T, 16, K), x(B, T, 16, K), x(B, T, 32, V), -torch.rand(B, T, 32),
                                          torch.rand(B, T, 32).to(dt), initial_state=torch.randn(N or B, 32, K, V),
                                          output_final_state=True, cu_seqlens=cu, chunk_size=64,
                                          use_qk_l2norm_in_kernel=l2)
    elif args.shape == "norm":
        # the gated output norm (fast.norm) at Qwen3-Next's value heads: decode rows (N = 1, 32) and a prefill's
        import fast.norm as fnm
        fnm._num_sms = lambda device: 132
        for M in (32, 1024, 4096 * 32):
            x, z, w = torch.randn(M, 128).to(dt), torch.randn(M, 128).to(dt), torch.randn(128).to(dt)
            fnm.norm_fwd(x, z, w, None, "swish", 1e-6)
            if M > 1024:
                fnm.norm_bwd(torch.randn(M, 128).to(dt), x, z, w, None, "swish", 1e-6)
        # the model's plain norms (zero-centred weight): hidden 2048, attention head_dim 256
        for M, D in ((1, 2048), (4096, 2048), (16, 256)):
            x, w = torch.randn(M, D).to(dt), torch.randn(D).to(dt)
            fnm.norm_fwd(x, None, w, None, None, 1e-6, True)
            if M > 16:
                fnm.norm_bwd(torch.randn(M, D).to(dt), x, None, w, None, None, 1e-6, True)
    elif args.shape == "vllm":
        # the serving ops vLLM and SGLang call, through their own host code (fast.chunk.recurrent.slots_launch), at
        # Qwen3-Next's heads: decode N = 8 and verify of 1 + 3 tokens, float32 / bfloat16 pools
        import fast.sglang_ops as FS
        import fast.vllm_ops as FV
        H, HV, K, V, N, L = 16, 32, 128, 128, 8, 4
        x = lambda *s: torch.randn(*s).to(dt)                   # noqa: E731
        i32 = lambda t: torch.as_tensor(t, dtype=torch.int32)   # noqa: E731
        cu = i32(list(range(0, N * L + 1, L)))
        for pool_dt in (torch.float32, torch.bfloat16):
            kv, vk = torch.randn(4 * N, HV, K, V).to(pool_dt), torch.randn(4 * N, HV, V, K).to(pool_dt)
            spec = dict(cu_seqlens=cu, ssm_state_indices=i32(torch.arange(N * L).reshape(N, L) + 1),
                        num_accepted_tokens=i32([1] * N), use_qk_l2norm_in_kernel=True)
            g, beta = -torch.rand(1, N * L, HV), torch.rand(1, N * L, HV)
            q, k, v = x(1, N * L, H, K), x(1, N * L, H, K), x(1, N * L, HV, V)
            FV.fused_recurrent_gated_delta_rule(q[:, :N], k[:, :N], v[:, :N], g[:, :N], beta[:, :N], None, kv, True,
                                                i32(list(range(N + 1))), i32(list(range(1, N + 1))),
                                                use_qk_l2norm_in_kernel=True)
            FV.fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, kv, True, **spec)
            FV.fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, vk, True, **spec, state_layout="vk",
                                                null_block_id=0)
            a, b = x(N * L, HV), x(N * L, HV)
            FV.fused_sigmoid_gating_delta_rule_update(torch.rand(HV), a, b, torch.randn(HV), q, k, v,
                                                      initial_state=vk, **spec)
            rows = x(N, 2 * H * K + HV * V)
            FV.fused_recurrent_gated_delta_rule_packed_decode(rows, a[:N], b[:N], torch.rand(HV), torch.randn(HV),
                                                              K ** -0.5, vk, torch.empty(N, 1, HV, V).to(dt),
                                                              i32(list(range(1, N + 1))), True)
            FS.fused_sigmoid_gating_delta_rule_update(torch.rand(HV), a[:N], torch.randn(HV), 1.0, 20.0, q[:, :N],
                                                      k[:, :N], v[:, :N], b[:N], vk, i32(list(range(N))), None, True,
                                                      i32(list(range(N + 1))))
            FS.fused_sigmoid_gating_delta_rule_update(torch.rand(HV), a, torch.randn(HV), 1.0, 20.0, q, k, v, b, vk,
                                                      i32(list(range(N))), None, True, cu, disable_state_update=True,
                                                      intermediate_states_buffer=torch.empty(N, L, HV, V, K).to(pool_dt))
        FV.fused_post_conv_prep(x(4096, 2 * H * K + HV * V), x(4096, HV), x(4096, HV), torch.rand(HV),
                                torch.randn(HV), H, K, V, True)
    elif args.shape == "flashinfer":
        # FlashInfer's API (fast.flashinfer_ops) at Qwen3-Next's heads, through its own host code: the prefill over 4
        # sequences with and without state checkpoints (the state pass's CKPT), the decode on a pool with
        # output_state_indices (FINAL_IDX), the MTP step into its buffer with the state update on (WRITE 4) and with
        # each token's state in its own pool row (WIDX 3)
        import fast.flashinfer_ops as FF
        H, HV, K, V, N, L = 16, 32, 128, 128, 8, 4
        x = lambda *s: torch.randn(*s).to(dt)                   # noqa: E731
        i32 = lambda t: torch.as_tensor(t, dtype=torch.int32)   # noqa: E731
        T = 4 * 256
        cu = torch.tensor([0, 256, 512, 768, 1024])
        pre = (x(T, H, K), x(T, H, K), x(T, HV, V), torch.rand(T, HV), torch.rand(T, HV), None,
               torch.randn(4, HV, V, K), True, cu, True)
        FF.chunk_gated_delta_rule(*pre)
        FF.chunk_gated_delta_rule(*pre, state_checkpoints=torch.empty(8, HV, V, K), checkpoint_every_n_tokens=128,
                                  checkpoint_cu_starts=torch.tensor([0, 2, 4, 6, 8]))
        for pool_dt in (torch.float32, torch.bfloat16):       # the paged prefill (fast.paged's kernels, CK_PAGED)
            try:
                FF.chunk_gated_delta_rule_paged(*pre[:5], cu_seqlens=cu,
                                                state_pool=torch.randn(12, HV, V, K).to(pool_dt),
                                                page_indices=i32(range(12)), page_indptr=i32([0, 3, 6, 9, 12]),
                                                page_size=128, last_page_len=i32([37, 37, 37, 37]),
                                                use_qk_l2norm_in_kernel=True)
            except IndexError:      # (o's gather by the aligned rows, which nothing computed here: every kernel was)
                pass
        A_log, dt_bias = torch.rand(HV), torch.randn(HV)
        q, k, v, a, b = x(N, L, H, K), x(N, L, H, K), x(N, L, HV, V), x(N, L, HV), x(N, L, HV)
        for pool_dt in (torch.float32, torch.bfloat16):
            pool = torch.randn(N * (L + 2), HV, V, K).to(pool_dt)
            FF.gated_delta_rule_decode_pretranspose(q[:, :1], k[:, :1], v[:, :1], None, A_log, a[:, :1], dt_bias,
                                                    b[:, :1], initial_state=pool, initial_state_indices=i32(range(N)),
                                                    output_state_indices=i32(range(N, 2 * N)))
            FF.gated_delta_rule_mtp(q, k, v, pool, i32(range(N)), A_log, a, dt_bias, b, disable_state_update=False,
                                    intermediate_states_buffer=torch.empty(N, L, HV, V, K).to(pool_dt))
            FF.gated_delta_rule_mtp(q, k, v, pool, i32(range(N)), A_log, a, dt_bias, b, disable_state_update=False,
                                    ssm_state_indices=i32(torch.arange(N, N + N * L).reshape(N, L)))
    elif args.shape == "small":
        for BT in (16, 32, 64):
            gdn(1, 128, 2, 4, BT, l2=BT == 64, gate=BT == 64)
        if dt != torch.float32:
            gdn(1, 128, 2, 4, 64, precision=(None, None))         # the 16-bit backward
        x, w = torch.randn(1, 100, 256).to(dt), torch.randn(256, 4).to(dt)
        cvb.causal_conv1d_bwd(x, w, torch.randn_like(x), torch.randn(256).to(dt), "silu",
                              torch.randn(1, 256, 3).to(dt), None, torch.randn(1, 256, 3).to(dt))
    else:
        precision = (None, None) if args.shape == "bench16" else None
        if args.precision:
            from .grad_precision import _parse                 # after the stand-in driver is installed
            precision = _parse(args.precision)
        gdn(4, 128, 16, 32, 64, l2=True, precision=precision)

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next((os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas")
                  if os.path.exists(os.path.join(bindir, n))), "ptxas")
    seen, over = set(), []
    for name, kernel in compiled:
        if kernel is None or (name, kernel.hash) in seen:
            continue
        seen.add((name, kernel.hash))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        if os.environ.get("COMPILE_CHECK_PTX"):                 # keep the PTX for reading
            with open(os.path.join(os.environ["COMPILE_CHECK_PTX"], f"{name}-{kernel.hash[:8]}.ptx"), "w") as g:
                g.write(kernel.asm["ptx"])
            if "ttgir" in kernel.asm:
                with open(os.path.join(os.environ["COMPILE_CHECK_PTX"], f"{name}-{kernel.hash[:8]}.ttgir"), "w") as g:
                    g.write(kernel.asm["ttgir"])
        gpu = f"sm_{args.arch}" + ("a" if args.arch >= 90 else "")          # as Triton targets it
        r = subprocess.run([ptxas, f"-arch={gpu}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
        info = [ln.split("info    :")[-1].strip() for ln in (r.stderr + r.stdout).splitlines()
                if "registers" in ln or "spill" in ln] or [(r.stderr + r.stdout).strip()[-200:]]
        os.unlink(f.name)
        regs = next((int(w) for ln in info for w, nxt in zip(ln.split(), ln.split()[1:])
                     if nxt.rstrip(",") == "registers"), None)
        per_sm = ""
        if kernel.metadata.shared > SMEM_PER_BLOCK[args.arch]:
            over.append(name)
            per_sm = f" | OVER sm_{args.arch}'s {SMEM_PER_BLOCK[args.arch]} B of shared memory per block"
        elif regs is not None and args.arch == 90:   # blocks per SM, and the limit that sets it (the others' beside)
            lim = blocks_per_sm(kernel.metadata.num_warps, kernel.metadata.shared, regs)
            per_sm = f" | per SM {lim['blocks']} (smem {lim['smem']}, regs {lim['regs']}, warps {lim['warps']})"
        print(f"{name:28s} warps={kernel.metadata.num_warps:2d} smem={kernel.metadata.shared:7d} | "
              + " | ".join(info) + per_sm)
    if over:
        print(f"{len(over)} variant(s) need more shared memory than an sm_{args.arch} block may have: "
              f"{sorted(set(over))}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
