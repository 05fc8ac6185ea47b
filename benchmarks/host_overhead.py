"""Host overhead of one eager decode step (issue 10): the checks and launch preparation that
fast.serving caches by signature, old path against cached path, per call.

Shape: Qwen3-Next's decode step, N = 1, H = 16, HV = 32, K = V = 128 (D = 8192), W = 4, bf16
activations, float32 state. Each row is the median over `repeats` batches of `iters` back-to-back
calls of the per-call mean, in us (host wall time).

Rows (both paths do the same work on valid inputs; the old one is what gdn_decode ran before):
  checks         refgdn.serving.check_step_inputs (check_cache inside) + check_cache alone (old)
                 vs fast.serving._checked_plan's hit: the last entry's extras compare + MetaGuard check
  signature      refgdn.serving.step_signature alone (what a miss of the last entry builds), and the
                 MetaGuard check alone (one C++ call over the 17 tensors)
  accept checks  refgdn.serving.check_accept_inputs vs gdn_accept's hit (extras + MetaGuard)
  launch prep    fast.serving._build_plan (configs, grids, kernel arguments; recomputed per call
                 before) vs nothing (cached in the plan)
  decode host    gdn_decode's whole host side with the two Triton launches replaced by no-ops:
                 old = check_step_inputs + _launch (uncached) + _check_if_free, cached = gdn_decode
  decode wall    (--device cuda only) the same two with the real launches, one sync per batch: what
                 benchmarks.bench_graphs' "fast eager (wall, host incl.)" row measures
  launch, allocations  (--device cuda only) the cached decode's pieces alone: each kernel through its
                 Relaunch, Triton's compiled launcher alone, JITFunction.run, the allocations, and one
                 torch kernel launch for scale (launch_rows)
  serving        (--sm90, --device cuda) the serving ops' decode at N = 1 (vLLM's packed decode, its recurrent op,
                 its gated op, SGLang's op and its target verify of 1 + 3 tokens, vLLM's conv update) and vLLM's
                 prefill preparation over 64 tokens: the full path (checks, launch plan, JITFunction.run) vs
                 served from the call layout's or signature's plan (fast.launch.LayoutPlans, SignaturePlans), host
                 time only
  --sm90         (CPU, no GPU needed) Triton's real launch path instead of the stubs: a stand-in driver
                 reports an sm_90 target and every launch is a compile-only warmup (benchmarks.compile_check's
                 trick), so JITFunction.run does all its host work (argument binding and specialisation, the
                 cache-key lookup, the used-globals check) except the driver's launch call. Rows: one
                 launch of each kernel, and the decode host old (full checks, launch prep) vs cached.
                 --plain-constants: the kernel-visible constants as before (plain tl.constexpr; a separate
                 process). The "relaunch" row: the conv kernel through fast.launch.Relaunch (the compiled
                 kernel's launcher reused; the C launch is a no-op here), what gdn_decode's cached path
                 pays per launch. Relies on Triton internals (driver.set_active); run it in a fresh process.

Run: python -m benchmarks.host_overhead [--device cuda | --sm90 [--plain-constants]] [--iters 200] [--repeats 31]
(CPU by default: the real kernels would run in the Triton interpreter, so the decode rows stub them.)
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Callable

import torch

from . import common

H, HV, K, V, W, N, SLOTS = 16, 32, 128, 128, 4, 1, 4
D = 2 * H * K + HV * V


def per_call_us(fn: Callable[[], object], iters: int, repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Host wall time per call in us (common.wall_us), warmed up with max(10, iters / 10) calls; no
    device sync unless given."""
    return common.wall_us(fn, iters=iters, repeats=repeats, warmup=max(10, iters // 10), sync=sync)


def make_step(device: str) -> tuple:
    """(args of gdn_decode without scale/activation) for one request in slot 1 of a 4-slot cache."""
    from refgdn.serving import GDNStateCache
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    bf = dict(dtype=torch.bfloat16, device=device)
    cache = GDNStateCache.allocate(SLOTS, H, HV, K, V, conv_width=W, max_draft=0, state_dtype=torch.float32,
                                   act_dtype=torch.bfloat16, device=device)
    x = rnd(N, D).to(**bf)
    a, b = rnd(N, HV).to(**bf), rnd(N, HV).to(**bf)
    conv_weight, conv_bias = rnd(D, W).to(**bf), rnd(D).to(**bf)
    A_log, dt_bias = rnd(HV).to(device), rnd(HV).to(device)
    idx = torch.tensor([1], dtype=torch.int32, device=device)
    return x, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, idx


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_kernels():
    """fast.serving's two step kernels replaced by no-ops for the block (host cost only)."""
    import fast.serving as fs
    saved = fs.conv_step_kernel, fs.conv_step_any_w_kernel, fs.gdn_step_kernel
    fs.conv_step_kernel = fs.conv_step_any_w_kernel = fs.gdn_step_kernel = _NoLaunch()
    fs.clear_plan_cache()            # plans hold the kernel objects
    try:
        yield
    finally:
        fs.conv_step_kernel, fs.conv_step_any_w_kernel, fs.gdn_step_kernel = saved
        fs.clear_plan_cache()


def install_sm90_compile_only() -> None:
    """A stand-in Triton driver (sm_90, device 0, stream 0) and compile-only launches (see --sm90).
    Must run before triton or fast is imported."""
    from .sm90 import install_compile_only

    def no_launch(name, kernel):     # fast.launch.Relaunch calls the compiled launcher: make it a no-op
        kernel._run = lambda *a: None
        kernel.module, kernel._module_pid = "stand-in", -1      # nothing to load or unload
    install_compile_only(no_launch)


def use_plain_constants() -> None:
    """fast.serving's kernel-visible constants as plain tl.constexpr (as before issue 10), before the first
    launch: Triton's per-launch check of used globals then pays tl.constexpr's != (same values, same
    kernels). It must precede compilation: the check compares against a copy taken when compiling, and a
    _Const on either side of != takes the fast path."""
    import triton.language as tl

    import fast.serving as fs
    for n, v in list(vars(fs).items()):
        if isinstance(v, tl.constexpr):
            setattr(fs, n, tl.constexpr(v.value))


def sm90_rows(iters: int, repeats: int, plain: bool = False) -> list:
    """The --sm90 rows (install_sm90_compile_only() first): real JITFunction.run, no device."""
    import fast.serving as fs
    from fast.launch import launch
    import refgdn.serving as rs
    if plain:
        use_plain_constants()
    args = make_step("cpu")
    x, a, b, cw, cb, A_log, dt_bias, cache, idx = args
    step = args[:7] + (cache, idx, None)
    t = lambda fn: per_call_us(fn, iters, repeats)  # noqa: E731
    fs.gdn_decode(*args)                                     # compiles both kernels (sm_90), stores the plan
    p = fs._checked_plan("decode", *step, None, "silu", False)
    y, o = torch.empty(p.y_shape, dtype=p.act_dtype), torch.empty(p.o_shape, dtype=p.act_dtype)
    snap = torch.empty((p.N, 5), dtype=torch.int32)

    def conv():
        launch(fs.conv_step_kernel, p.conv_grid, p.conv_kw, x, cw, cb, y, cache.conv_state, cache.pend_meta, snap,
               cache.err, idx, idx, *p.conv_args)

    def gdn():
        launch(fs.gdn_step_kernel, p.step_grid, p.step_kw, y, a, b, A_log, dt_bias, o, cache.ssm_state, cache.pend_k,
               cache.pend_v, cache.pend_g, cache.pend_beta, cache.pend_meta, snap, idx, 0.1, *p.step_args)

    def old_decode_host():
        rs.check_step_inputs(*step, None, "silu", False)
        fs._launch(*step, None, "silu", "decode")
        fs._check_if_free(cache)

    from fast.launch import Relaunch
    import fast.launch as fl
    from triton.runtime.jit import JITFunction
    fl._JIT_RUN = JITFunction.run                  # the compile-only wrapper stands for the launch path
    rc = Relaunch(fs.conv_step_kernel, p.conv_grid, p.conv_kw)
    conv_args = (x, cw, cb, y, cache.conv_state, cache.pend_meta, snap, cache.err, idx, idx, *p.conv_args)
    rc(*conv_args)
    return [("sm90 launch: conv_step_kernel", t(conv)), ("sm90 launch: gdn_step_kernel", t(gdn)),
            ("sm90 relaunch: conv_step_kernel (fast.launch)", t(lambda: rc(*conv_args))),
            ("sm90 decode host: old (full checks, launch prep)", t(old_decode_host)),
            ("sm90 decode host: cached (gdn_decode)", t(lambda: fs.gdn_decode(*args)))] + [
        ("sm90 " + name, us) for name, us in serving_rows("cpu", iters, repeats)]


def serving_rows(device: str, iters: int, repeats: int) -> list:
    """The serving ops' decode at N = 1 (Qwen3-Next's heads, bf16 activations, a float32 pool of SLOTS slots): host
    time per call through the op's full path (its layout plans forgotten before every call: checks, launch plan,
    JITFunction.run) and served from the layout's plan (fast.launch.LayoutPlans, from a layout's second call). No
    sync: host work only (on a GPU the launches are queued)."""
    import fast.flashinfer_ops as ffi
    import fast.sglang_ops as fsg
    import fast.vllm_ops as fv
    g = torch.Generator().manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device=device)
    x = torch.randn(N, D, generator=g).to(**bf)
    a, b = torch.randn(N, HV, generator=g).to(**bf), torch.randn(N, HV, generator=g).to(**bf)
    A_log, dt_bias = torch.rand(HV, generator=g).to(device), torch.randn(HV, generator=g).to(device)
    pool = torch.zeros(SLOTS, HV, V, K, device=device)                       # [S, HV, V, K]: newer vLLM's, SGLang's
    idx = torch.tensor([1], dtype=torch.int32, device=device)
    cu = torch.tensor([0, N], dtype=torch.int32, device=device)
    out = torch.empty(N, 1, HV, V, **bf)
    q, k, v = (x[:, :H * K].view(1, N, H, K), x[:, H * K:2 * H * K].view(1, N, H, K),
               x[:, 2 * H * K:].view(1, N, HV, V))
    gg, beta = fv.fused_gdn_gating(A_log, a, b, dt_bias)
    conv_pool = torch.zeros(SLOTS, D, 3, **bf)                              # [S, D, W - 1]
    conv_w = torch.randn(D, 4, generator=g).to(**bf)
    rows64 = torch.randn(64, D, generator=g).to(**bf)                      # a short prefill's conv rows
    a64, b64 = torch.randn(64, HV, generator=g).to(**bf), torch.randn(64, HV, generator=g).to(**bf)
    x4 = torch.randn(4 * N, D, generator=g).to(**bf)                       # a verify of 1 + 3 tokens per request
    q4, k4, v4 = (x4[:, :H * K].view(1, 4 * N, H, K), x4[:, H * K:2 * H * K].view(1, 4 * N, H, K),
                  x4[:, 2 * H * K:].view(1, 4 * N, HV, V))
    a4, b4 = torch.randn(4 * N, HV, generator=g).to(**bf), torch.randn(4 * N, HV, generator=g).to(**bf)
    cu4 = torch.arange(0, 4 * N + 1, 4, dtype=torch.int32, device=device)
    cache = torch.zeros(SLOTS, 4, HV, V, K, device=device)                  # [C, steps, HV, V, K]
    calls = [
        ("vLLM packed decode", fv._PACKED, lambda: fv.fused_recurrent_gated_delta_rule_packed_decode(
            x, a, b, A_log, dt_bias, None, pool, out, idx, True)),
        ("vLLM fused_recurrent (older, [S, HV, K, V])", fv._SLOTS, lambda: fv.fused_recurrent_gated_delta_rule(
            q, k, v, gg.view(1, N, HV), beta.view(1, N, HV), None, pool.transpose(-1, -2), True, cu, idx,
            use_qk_l2norm_in_kernel=True)),
        ("vLLM fused_sigmoid_gating_delta_rule_update", fv._SLOTS, lambda: fv.fused_sigmoid_gating_delta_rule_update(
            A_log, a, b, dt_bias, q, k, v, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True)),
        ("SGLang fused_sigmoid_gating_delta_rule_update", fsg._DECODE,
         lambda: fsg.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, idx,
                                                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu)),
        ("SGLang target verify (1 + 3 tokens into its cache)", fsg._VERIFY,
         lambda: fsg.fused_sigmoid_gating_delta_rule_update(A_log, a4, dt_bias, 1.0, 20.0, q4, k4, v4, b4, pool, idx,
                                                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu4,
                                                            disable_state_update=True, intermediate_states_buffer=cache,
                                                            intermediate_state_indices=idx, cache_steps=4)),
        ("FlashInfer gated_delta_rule_decode_pretranspose (pool)", ffi._DECODE,
         lambda: ffi.gated_delta_rule_decode_pretranspose(q.view(N, 1, H, K), k.view(N, 1, H, K), v.view(N, 1, HV, V),
                                                          None, A_log, a.view(N, 1, HV), dt_bias, b.view(N, 1, HV),
                                                          initial_state=pool, initial_state_indices=idx)),
        ("FlashInfer gated_delta_rule_mtp (1 + 3 tokens into its buffer)", ffi._DECODE,
         lambda: ffi.gated_delta_rule_mtp(q4.view(N, 4, H, K), k4.view(N, 4, H, K), v4.view(N, 4, HV, V), pool, idx,
                                          A_log, a4.view(N, 4, HV), dt_bias, b4.view(N, 4, HV),
                                          intermediate_states_buffer=cache, disable_state_update=True)),
        ("vLLM causal_conv1d_update (decode)", fv._CONV_UPDATE, lambda: fv.causal_conv1d_update(
            x, conv_pool, conv_w, None, "silu", idx)),
        ("vLLM fused_post_conv_prep (64 tokens)", fv._POST_CONV, lambda: fv.fused_post_conv_prep(
            rows64, a64, b64, A_log, dt_bias, H, K, V)),
    ]
    out_rows = []
    for name, plans, fn in calls:
        def full(fn=fn, plans=plans):
            plans.clear()
            fn()
        out_rows.append((f"{name}: full path", per_call_us(full, iters, repeats)))
        out_rows.append((f"{name}: served from its plan", per_call_us(fn, iters, repeats)))
    return out_rows


def rows(device: str = "cpu", iters: int = 200, repeats: int = 31) -> list:
    import fast.serving as fs
    import refgdn.serving as rs
    args = make_step(device)
    cache = args[7]
    step = args[:7] + (cache, args[8], None)            # + cu_seqlens
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t = lambda fn: per_call_us(fn, iters, repeats)  # noqa: E731
    out = []

    def old_checks():
        rs.check_step_inputs(*step, None, "silu", False)   # check_cache runs inside

    fs.clear_plan_cache()
    fs._checked_plan("decode", *step, None, "silu", False)            # store the signature
    out.append(("checks: check_step_inputs (old)", t(old_checks)))
    out.append(("checks: check_cache alone (part of the above)", t(lambda: rs.check_cache(cache))))
    out.append(("checks: cached (_checked_plan hit)", t(lambda: fs._checked_plan("decode", *step, None, "silu",
                                                                                   False))))
    out.append(("signature: step_signature alone", t(lambda: rs.step_signature(*step, None, "silu"))))
    guard = _last_entry(fs, "decode")[1]
    tensors = rs.step_tensors(*step, absent=fs.ABSENT)
    out.append(("signature: the last entry's MetaGuard check alone (what a hit runs instead)",
                t(lambda: guard.check(*tensors))))
    acc = (cache, args[8], torch.ones_like(args[8]))

    def cached_accept_checks():       # what gdn_accept now does before its launch (valid call: a hit)
        return fs._checked_entry("accept", ("accept", type(cache)), rs.accept_tensors, acc,
                                 lambda: rs.accept_signature(*acc), None)

    fs._checked_entry("accept", ("accept", type(cache)), rs.accept_tensors, acc, lambda: rs.accept_signature(*acc),
                      lambda reuse: (N, None))                      # stores accept's entry (the checks' stand-in)
    out.append(("accept checks: check_accept_inputs (old)", t(lambda: rs.check_accept_inputs(*acc, False))))
    out.append(("accept checks: cached (signature + lookup)", t(cached_accept_checks)))
    out.append(("launch prep: _build_plan per call (old)", t(lambda: fs._build_plan(*step, "silu", "decode"))))

    def old_decode_host():            # gdn_decode as it was: full checks, launch prep every call
        rs.check_step_inputs(*step, None, "silu", False)
        o = fs._launch(*step, None, "silu", "decode")
        fs._check_if_free(cache)
        return o

    def new_decode():
        return fs.gdn_decode(*args)

    with stubbed_kernels():
        out.append(("decode host, launches stubbed: old", t(old_decode_host)))
        out.append(("decode host, launches stubbed: cached", t(new_decode)))
    if device.startswith("cuda"):
        fs.clear_plan_cache()
        out.append(("decode wall, real launches: old", per_call_us(old_decode_host, iters, repeats, sync)))
        out.append(("decode wall, real launches: cached", per_call_us(new_decode, iters, repeats, sync)))
        out += launch_rows(args, iters, repeats, sync)
        out += serving_rows(device, iters, repeats)
    return out


def _last_entry(fs, mode: str) -> tuple:
    """fast.serving's last remembered entry of ``mode`` (its _LAST is keyed by (mode, batch dims))."""
    return next(v for k, v in reversed(list(fs._LAST.items())) if k[0] == mode)


def launch_rows(args, iters: int, repeats: int, sync) -> list:
    """(GPU) The cached decode's pieces, each alone, with the real launches (one sync per batch of calls):
    each kernel through its plan's Relaunch, the compiled launcher alone (Triton's, no checks), the conv
    kernel through JITFunction.run, the output and scratch allocations (two now, three before; and one alone), and one torch
    kernel launch for scale. The compiled launcher is timed with the tensors and with their addresses
    (ints: what Relaunch passes; a tensor costs the launcher a data_ptr() call and a driver query)."""
    import fast.serving as fs
    from fast.launch import launch
    from triton.runtime import driver
    x, a, b, cw, cb, A_log, dt_bias, cache, idx = args
    fs.gdn_decode(*args)                                            # the plan and its Relaunch objects
    p = _last_entry(fs, "decode")[2]
    dev = cache.ssm_state.device
    y = torch.empty(p.y_shape, dtype=p.act_dtype, device=dev)
    o = torch.empty(p.o_shape, dtype=p.act_dtype, device=dev)
    snap = torch.empty((p.N, 5), dtype=torch.int32, device=dev)
    conv = (x, cw, cb, y, cache.conv_state, cache.pend_meta, snap, cache.err, idx, idx, *p.conv_args)
    step = (y, a, b, A_log, dt_bias, o, cache.ssm_state, cache.pend_k, cache.pend_v, cache.pend_g,
            cache.pend_beta, cache.pend_meta, snap, idx, p.scale, *p.step_args)
    t = lambda fn: per_call_us(fn, iters, repeats, sync)  # noqa: E731
    rows = [(f"launch: conv via Relaunch (pdl={p.conv_kw.get('PDL', False)})", t(lambda: p.conv_launch(*conv))),
            (f"launch: step via Relaunch (pdl={p.step_kw.get('PDL', False)})", t(lambda: p.step_launch(*step)))]
    r = p.conv_launch
    if r.compiled is not None:
        d = driver.active
        launcher, head = r.last[1:3]                                # the compiled kernel Relaunch last called
        rows.append(("launch: conv, Triton's compiled launcher alone",
                     t(lambda: launcher(*r.grid, d.get_current_stream(d.get_current_device()), *head, *conv,
                                        *r.tail))))
        ptrs = tuple(u.data_ptr() if isinstance(u, torch.Tensor) else u for u in conv)
        rows.append(("launch: conv, Triton's compiled launcher alone, tensors as addresses",
                     t(lambda: launcher(*r.grid, d.get_current_stream(d.get_current_device()), *head, *ptrs,
                                        *r.tail))))
    rows.append(("launch: conv via JITFunction.run", t(lambda: launch(fs.conv_step_kernel, p.conv_grid, p.conv_kw,
                                                                        *conv))))
    rows.append(("allocations: the step's two torch.empty (o, conv -> step scratch)",
                 t(lambda: (torch.empty(p.o_shape, dtype=p.act_dtype, device=dev),
                            torch.empty(p.scratch_bytes, dtype=torch.uint8, device=dev)))))
    rows.append(("allocations: three torch.empty (o, y, snap: before the scratch)",
                 t(lambda: (torch.empty(p.y_shape, dtype=p.act_dtype, device=dev),
                            torch.empty(p.o_shape, dtype=p.act_dtype, device=dev),
                            torch.empty((p.N, 5), dtype=torch.int32, device=dev)))))
    rows.append(("allocations: one torch.empty (o)", t(lambda: torch.empty(p.o_shape, dtype=p.act_dtype, device=dev))))
    rows.append(("for scale: one torch kernel launch (zero_)", t(lambda: snap.zero_())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--sm90", action="store_true", help="Triton's real launch path, compile-only (CPU)")
    ap.add_argument("--plain-constants", action="store_true",
                    help="--sm90 with the constants as before (old)")
    ns = ap.parse_args(argv)
    if ns.sm90:
        import sys
        if "fast" in sys.modules or "triton" in sys.modules:
            print("host_overhead --sm90: run it in a fresh process")
            return 2
        install_sm90_compile_only()
    elif ns.device == "cpu":
        import fast  # noqa: F401 - sets TRITON_INTERPRET before the kernels are defined
    where = "cpu, sm_90 compile-only launches" + (", plain tl.constexpr constants" if ns.plain_constants else "") \
        if ns.sm90 else ns.device
    print(f"host overhead per call, {where}, N={N} H={H} HV={HV} K=V={K} D={D} W={W}, torch {torch.__version__}")
    with common.one_core() as pin:           # every row is host work: one core (common.one_core)
        table = sm90_rows(ns.iters, ns.repeats, ns.plain_constants) if ns.sm90 else rows(ns.device, ns.iters,
                                                                                          ns.repeats)
    print(f"  (pinned to core {pin.core})")
    for name, us in table:
        print(f"  {name:<52s} {us:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
