"""Training benchmark: forward + backward of the chunked gated delta rule (and of conv1d) on a GPU, fast vs
fla 0.6.0 in the same process, with both implementations' gradient errors against the float64 truth.

Timing shape (issue 12): B = 4, T = 4096, Qwen3-Next heads (H = 16, HV = 32, K = V = 128), bf16 q/k/v/beta,
fp32 g (log-decay), qk-l2norm in the kernel, chunk 64, no initial state. Rows:

  - fast forward (inference path: no input requires grad), fast forward + backward (autograd through
    the custom op: the backward recomputes G, A, w, u, h, v_new), their ratio (target <= 3); and the
    same with the 16-bit backward variant (faster, less accurate: its gradient errors are in the table);
  - fla forward, fla forward + backward. fla 0.6.0 refuses its backward on Hopper with
    3.4.0 <= Triton < 3.7.1 (RuntimeError in fla.ops.common.chunk_o.chunk_bwd_dqkwg: "produces incorrect
    results for gated chunk_bwd_dqkwg (see #640)"). The guard is a module-level flag test
    (``IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1``); we first call it as
    shipped (to record whether it fires here), then bypass it by setting
    ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` for this process and time and check it anyway;
  - conv1d forward + backward (T = 16384, D = 8192, W = 4, silu, bf16) vs fla's causal_conv1d.

Gradient errors (smaller shape so the float64 oracle's autograd stays quick: B = 1, T = 1024, H = 4,
HV = 8, K = V = 128, same dtypes and flags): for each gradient, max |impl - truth| with truth = refgdn
autograd in float64 on the same bf16-rounded inputs and cotangent, and the conformance ratio
error / (2 x refgdn-bf16 error + floor) of conformance.core (pass: <= 1).

``python -m benchmarks.bench_train [--sweep] [--no-results] [--only timing,profile,errors]``; ``--sweep`` also times fast's backward over
a small grid of per-stage configs (fast.chunk_bwd.chunk_gated_delta_rule_bwd's ``configs`` argument) to
choose the pinned ones.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from . import common

B, T, H, HV, K, V = 4, 4096, 16, 32, 128, 128
CHUNK = 64
DTYPE = torch.bfloat16
ERR_SHAPE = dict(B=1, T=1024, H=4, HV=8)
CONV_T, CONV_D, CONV_W = 16384, 8192, 4
TITLE = "Training: forward + backward, fast vs fla"


def inputs(B_, T_, H_, HV_, device, seed=0, grad=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B_, T_, H_, K, device=device, generator=gen).to(DTYPE)
    k = torch.randn(B_, T_, H_, K, device=device, generator=gen).to(DTYPE)
    v = torch.randn(B_, T_, HV_, V, device=device, generator=gen).to(DTYPE)
    g = F.logsigmoid(torch.randn(B_, T_, HV_, device=device, generator=gen) + 3.0)      # fp32, mostly weak
    beta = torch.sigmoid(torch.randn(B_, T_, HV_, device=device, generator=gen)).to(DTYPE)
    do = torch.randn(B_, T_, HV_, V, device=device, generator=gen).to(DTYPE)
    leaves = [x.requires_grad_(grad) for x in (q, k, v, g, beta)]
    return leaves, do


def _fast_call(q, k, v, g, beta):
    import fast
    return fast.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=CHUNK)[0]


def _fast_knob_call(configs=None, precision=None):
    """fast's chunk forward + backward with benchmark knobs passed as arguments (no library globals):
    configs, per-stage backward config overrides; precision, a (grad_dot, recompute) pair replacing the
    dtype's defaults ((None, None): the 16-bit backward, faster and less accurate). A local autograd
    Function over fast.chunk's and fast.chunk_bwd's internal entry points (the custom op takes no knobs);
    inputs as in _fast_call (l2norm, chunk CHUNK, no initial state). Kernel 1's outputs are kept from the forward
    and passed to the backward, as the custom op does (the backward uses them where it would rerun kernel 1
    exactly as the forward did: fast.chunk_bwd.reuses_forward_kkt), so the default knobs time what the op runs."""
    from fast import chunk as fc, chunk_bwd as cb

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g, beta):
            ctx.save_for_backward(q, k, v, g, beta)
            o, _, ctx.kkt = fc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, None, False, None, True,
                                                          chunk_size=CHUNK, keep_kkt=True)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, g, beta = ctx.saved_tensors
            dq, dk, dv, dg, dbeta = cb.chunk_gated_delta_rule_bwd(
                q, k, v, g, beta, do, None, None, None, None, True, chunk_size=CHUNK,
                configs=configs, precision=precision, kkt=ctx.kkt)[:5]
            return dq, dk, dv, dg, dbeta

    return _Fn.apply


_sixteen_bit_call = _fast_knob_call(precision=(None, None))


def _fla_call(fla_fn):
    def call(q, k, v, g, beta):
        return fla_fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return call


def fla_guard_bypass() -> str:
    """Disable fla 0.6.0's Hopper/Triton guard on the gated chunk_bwd_dqkwg for this process; returns
    what the guard would have done here."""
    import fla.ops.common.chunk_o as fco
    active = bool(fco.IS_NVIDIA_HOPPER and fco.TRITON_ABOVE_3_4_0 and not fco.TRITON_ABOVE_3_7_1)
    fco.TRITON_ABOVE_3_7_1 = True
    return "guard active here (Hopper, Triton in [3.4.0, 3.7.1)): bypassed" if active else \
        "guard not active here (not Hopper or Triton >= 3.7.1)"


def _fwd_bwd(call, leaves, do):
    def run():
        o = call(*leaves)
        o.backward(do)
    return run


def _bench(fn, leaves=None):
    """(median ms, error note). Progress (first call: compiles and autotuning included) goes to stderr."""
    t0 = time.perf_counter()
    try:
        fn()
        common.synchronize()
        t1 = time.perf_counter()
        if leaves is not None and torch.cuda.is_available():
            import triton.testing
            ms = float(triton.testing.do_bench(fn, grad_to_none=leaves, return_mode="median"))
        else:
            ms = common.bench(fn)
        print(f"bench_train: first call {t1 - t0:.1f} s, median {ms:.3f} ms", file=sys.stderr, flush=True)
        return ms, ""
    except Exception as e:  # noqa: BLE001
        print(f"bench_train: failed after {time.perf_counter() - t0:.1f} s: {e!r}"[:300], file=sys.stderr, flush=True)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def timing_rows(device: str) -> tuple:
    rows, notes = [], {}
    fla = common.try_import_fla()
    leaves, do = inputs(B, T, H, HV, device)
    with torch.no_grad():
        plain = [x.detach() for x in leaves]
    fwd_ms, err = _bench(lambda: _fast_call(*plain))
    rows.append(dict(case=f"fast fwd B={B} T={T}", ms=fwd_ms, **{"x fwd": 1.0 if fwd_ms else None}, note=err))
    fb_ms, err = _bench(_fwd_bwd(_fast_call, leaves, do), leaves)
    rows.append(dict(case="fast fwd+bwd", ms=fb_ms, **{"x fwd": fb_ms / fwd_ms if fb_ms and fwd_ms else None},
                     note=err or "target <= 3x fwd"))
    if fb_ms and fwd_ms:
        rows.append(dict(case="fast bwd (difference)", ms=fb_ms - fwd_ms, **{"x fwd": (fb_ms - fwd_ms) / fwd_ms},
                         note="recompute + 5 backward kernels + GVA sums"))
    fb16, err = _bench(_fwd_bwd(_sixteen_bit_call, leaves, do), leaves)
    rows.append(dict(case="fast fwd+bwd, 16-bit backward", ms=fb16,
                     **{"x fwd": fb16 / fwd_ms if fb16 and fwd_ms else None},
                     note=err or "precision=(None, None), without the custom op: see the error table"))
    if fla is None or fla.chunk_gated_delta_rule is None:
        rows.append(dict(case="fla", note="fla not installed"))
        return rows, notes
    call = _fla_call(fla.chunk_gated_delta_rule)
    fla_fwd, err = _bench(lambda: call(*plain))
    rows.append(dict(case="fla fwd", ms=fla_fwd, **{"x fwd": fla_fwd / fwd_ms if fla_fwd and fwd_ms else None},
                     note=err))
    # as shipped first: does the guard fire here?
    try:
        _fwd_bwd(call, leaves, do)()
        common.synchronize()
        notes["fla guard as shipped"] = "backward ran"
    except RuntimeError as e:
        notes["fla guard as shipped"] = f"refused: {str(e).splitlines()[0][:110]}"
    for x in leaves:
        x.grad = None
    notes["fla guard"] = fla_guard_bypass()
    fla_fb, err = _bench(_fwd_bwd(call, leaves, do), leaves)
    rows.append(dict(case="fla fwd+bwd (guard bypassed)", ms=fla_fb,
                     **{"x fwd": fla_fb / fwd_ms if fla_fb and fwd_ms else None},
                     note=err or (f"fla/fast fwd+bwd {fla_fb / fb_ms:.2f}" if fb_ms else "")))
    del leaves, do, plain
    torch.cuda.empty_cache()
    return rows, notes


def conv_rows(device: str) -> list:
    import fast
    fla = common.try_import_fla()
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, CONV_T, CONV_D, device=device, generator=gen).to(DTYPE).requires_grad_()
    w = (torch.randn(CONV_D, CONV_W, device=device, generator=gen) / 2).to(DTYPE).requires_grad_()
    dy = torch.randn(1, CONV_T, CONV_D, device=device, generator=gen).to(DTYPE)
    fwd, _ = _bench(lambda: fast.causal_conv1d(x.detach(), w.detach(), None, "silu"))
    fast_step = lambda: fast.causal_conv1d(x, w, None, "silu")[0].backward(dy)  # noqa: E731
    fb, err = _bench(fast_step, [x, w])
    notes = [err] if err else []
    if fb:
        # the eager wall time above can be host-bound (autograd through torch.library); the device's own time
        notes.append(f"device {_device_ms(fast_step, [x, w]):.3f} ms")
    if fla is not None and fla.causal_conv1d is not None:
        fla_step = lambda: fla.causal_conv1d(x=x, weight=w, activation="silu")[0].backward(dy)  # noqa: E731
        ffb, ferr = _bench(fla_step, [x, w])
        notes.append(f"fla fwd+bwd {ffb:.3f} ms (device {_device_ms(fla_step, [x, w]):.3f})" if ffb else "fla: " + ferr)
    return [dict(case=f"conv1d fwd+bwd T={CONV_T} D={CONV_D} W={CONV_W} silu", ms=fb,
                 **{"x fwd": fb / fwd if fb and fwd else None}, note="; ".join(notes))]


def _device_ms(step, leaves) -> float:
    """Device time of one call of step (ms): the sum of its kernels' times (_kernel_times_of)."""
    return sum(_kernel_times_of(step, leaves).values()) / 1e3


def error_rows(device: str) -> list:
    """Gradient errors of fast and fla (guard bypassed) against refgdn float64 autograd (module docstring)."""
    import refgdn
    from conformance.core import Check, evaluate

    p = ERR_SHAPE
    leaves, do = inputs(p["B"], p["T"], p["H"], p["HV"], device, seed=3)
    names = ("q", "k", "v", "g", "beta")

    def grads(call, xs, cot):
        xs = [x.detach().requires_grad_() for x in xs]
        o = call(*xs)
        return torch.autograd.grad(o, xs, cot)

    def ref_call(q, k, v, g, beta):
        return refgdn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=CHUNK)[0]

    truth = grads(ref_call, [x.double() for x in leaves], do.double())
    ref = grads(ref_call, leaves, do)
    impls = [("fast", _fast_call), ("fast, 16-bit backward", _sixteen_bit_call)]
    fla = common.try_import_fla()
    if fla is not None and fla.chunk_gated_delta_rule is not None:
        fla_guard_bypass()
        impls.append(("fla (guard bypassed)", _fla_call(fla.chunk_gated_delta_rule)))
    rows = []
    for impl, call in impls:
        try:
            got = grads(call, leaves, do)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(impl=impl, grad="-", note=f"{type(e).__name__}: {e}"[:140]))
            continue
        for n, gf, gt, gr in zip(names, got, truth, ref):
            res = evaluate(Check(f"d{n}", gf, gt, gr, dtype=DTYPE))
            rows.append({"impl": impl, "grad": f"d{n}", "max |err|": res["error"],
                         "refgdn bf16 err": res["ref_error"], "ratio": res["ratio"],
                         "pass": "yes" if res["passed"] else "NO", "max |truth|": gt.abs().max().item()})
    return rows


def sweep_rows(device: str, stages=None) -> list:
    """fast fwd+bwd over per-stage backward configs (one stage varied at a time); ``stages``: only these
    (names as in fast.chunk_bwd's configs argument), None for all."""
    leaves, do = inputs(B, T, H, HV, device)
    # BV = 16 last: an fp32-operand config at BV 16 once faulted (illegal memory access, module comment in
    # fast.chunk_bwd), which would poison the context for every row after it. Under the bf16x2 default, dqkwg
    # at BV 64, 4 warps, BKC 32, one stage faulted likewise (H200, Triton 3.6, 2026-11-23; the interpreter
    # gives the pinned config's gradients for it): a fault ends the sweep, and the rows after it say not run
    grid = [("dh", dict(num_stages=s_, num_warps=w, BV=bv)) for s_ in (1, 2) for w in (4, 8) for bv in (32, 64)]
    grid += [(st, dict(num_warps=w, BV=bv, num_stages=s_, BKC=bkc)) for st in ("dqkwg", "wy") for w in (4, 8)
             for bv in (32, 64) for s_ in (1, 2) for bkc in (32, 64)]
    grid += [("dv_local", dict(num_warps=w, BV=bv)) for w in (4, 8) for bv in (64, 128)]
    grid += [("dw", dict(num_warps=w, BV=bv, num_stages=s_)) for w in (4, 8) for bv in (32, 64) for s_ in (1, 2)]
    grid += [("state", dict(num_stages=s_, num_warps=w, BV=bv)) for s_ in (1, 2, 3) for w in (4, 8) for bv in (32, 64)]
    grid += [("w_u", dict(num_warps=w)) for w in (4, 8)] + [("kkt", dict(num_warps=w)) for w in (1, 2, 4)]
    grid += [(st, dict(num_warps=w, BV=16, num_stages=1)) for st in ("dqkwg", "wy") for w in (4, 8)]
    # pipeline depth at the pinned tiles (2026-11-27, H200: stage 3 pinned at three stages, the WY backward's pass 2
    # over K at three; its pass 1 pipelined (K1_STAGES > 1) is a Triton 3.6 miscompile, a fault or wrong gradients,
    # so it is not swept: fast.chunk_bwd.wy_bwd_config)
    grid += [("dqkwg", dict(num_stages=s_)) for s_ in (2, 4)]
    grid += [("wy", dict(K2_STAGES=s_)) for s_ in (1, 2, 4)] + [("wy", dict(V_STAGES=s_)) for s_ in (2, 3)]
    grid += [("dv_local", dict(num_warps=4, BV=64, num_stages=s_)) for s_ in (1, 2)]
    grid += [("dv_local", dict(num_warps=4, BV=128, num_stages=1))]          # stage 1's pin before 2026-11-27
    # the WY backward at BKC 64 (16-bit products, since dw and dv_new are stored 16-bit) faulted likewise (H100,
    # Triton 3.6, 2026-11-25: 4 warps, BV 32, one stage): those rows last too. So did the recompute's state pass at
    # one stage and BV 32 or 16 (H200, Triton 3.6, 2026-11-27; compute-sanitizer: an out-of-range shared-memory
    # address at a tl.dot, so a compiler fault, not an index of ours; BV 64 at one stage and every two-stage row ran)
    grid.sort(key=lambda sc: sc[0] == "wy" and sc[1].get("BKC") == 64 or sc[1].get("BV") == 16
              or sc[0] == "state" and sc[1].get("num_stages") == 1 and sc[1].get("BV", 64) < 64)
    rows = []
    fault = None          # a device fault (illegal address) poisons the CUDA context: later rows cannot run
    for stage, cfg in [("pinned", {})] + grid:          # the pinned configs first: the sweep's own baseline
        if stages is not None and stage not in stages and stage != "pinned":
            continue
        if fault is not None:
            rows.append(dict(stage=stage, config=str(cfg), ms=None,
                             note=f"not run: the CUDA context faulted at {fault}"))
            continue
        ms, err = _bench(_fwd_bwd(_fast_knob_call(configs={stage: cfg} if cfg else None), leaves, do), leaves)
        if "illegal memory access" in err or "unspecified launch failure" in err:
            fault = f"{stage} {cfg}"
        rows.append(dict(stage=stage, config=str(cfg), ms=ms, note=err))
        print(f"sweep: {stage} {cfg}: {ms} {err}", file=sys.stderr, flush=True)
    return rows


def conv_sweep_rows(device: str) -> list:
    """fast's conv1d backward alone (fast.conv_bwd.causal_conv1d_bwd) at the conv row's shape: the pinned config of
    each form (the one-pass window kernel, W <= 4's default, and the two passes through a float32 dz), then the window
    kernel over BT x BD x PREFETCH (4 warps; 8 at BD 1024), beside fla's backward (its forward + backward less its
    forward). GB/s from the bytes each form must move per element at bf16: window 6 (read x, dy; write dx), two
    passes 14 (and dz's float32 write and read); of_copy: that against this process's copy bandwidth."""
    from fast import conv_bwd as cvb
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, CONV_T, CONV_D, device=device, generator=gen).to(DTYPE)
    w = (torch.randn(CONV_D, CONV_W, device=device, generator=gen) / 2).to(DTYPE)
    dy = torch.randn(1, CONV_T, CONV_D, device=device, generator=gen).to(DTYPE)
    elems = CONV_T * CONV_D
    copy = common.copy_bandwidth_gbs(device)
    grid = [("window", dict(BT=bt, BD=bd, num_warps=8 if bd == 1024 and nw8 else 4, PREFETCH=pf))
            for bt in (32, 64, 128) for bd in (256, 512, 1024) for pf in (True, False)
            for nw8 in ((False, True) if bd == 1024 else (False,))]
    rows = []
    for form, cfg in [("window", None), ("two_pass", None)] + grid:
        configs = {"kernel": form, **({form: cfg} if cfg else {})}
        ms, err = _bench(lambda: cvb.causal_conv1d_bwd(x, w, dy, None, "silu", configs=configs))
        gbs = (6 if form == "window" else 14) * elems / ms / 1e6 if ms else None
        rows.append({"form": form, "config": "pinned" if cfg is None else str(cfg), "ms": ms, "GB/s": gbs,
                     "of_copy": gbs / copy if gbs else None, "note": err})
    fla = common.try_import_fla()
    if fla is not None and fla.causal_conv1d is not None:
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        f, ferr = _bench(lambda: fla.causal_conv1d(x=xg.detach(), weight=wg.detach(), activation="silu")[0])
        fb, berr = _bench(lambda: fla.causal_conv1d(x=xg, weight=wg, activation="silu")[0].backward(dy), [xg, wg])
        rows.append({"form": "fla 0.6.0", "config": "fwd+bwd less fwd", "ms": fb - f if f and fb else None,
                     "note": "; ".join(e for e in (ferr, berr) if e) or f"fwd {f:.3f}, fwd+bwd {fb:.3f} ms"})
    return rows


def _step_kernel_times(call, leaves, do) -> dict:
    """Mean device time per kernel (us) of forward + backward through `call` (_kernel_times_of)."""
    return _kernel_times_of(_fwd_bwd(call, leaves, do), leaves)


def _kernel_times_of(step, leaves) -> dict:
    """Mean device time per kernel (us) of step() (5 profiled calls after a warm-up,
    benchmarks.profile_decode.kernel_times), the leaves' gradients cleared between calls."""
    from .profile_decode import kernel_times

    def clean():
        step()
        for x in leaves:
            x.grad = None
    return kernel_times(clean, steps=5)


def _kernel_rows(kt: dict, beside: dict = None, beside_name: str = "") -> list:
    """The 16 largest kernels of kt with their share, then the total; `beside`: the same kernels' times in
    another run, as a column."""
    total = sum(kt.values()) or 1.0
    top = sorted(kt.items(), key=lambda kv: -kv[1])[:16]
    rows = [dict(kernel=name[:60], us=us, share=f"{100 * us / total:.1f}%") for name, us in top]
    rows.append(dict(kernel="total (all kernels)", us=total, share="100%"))
    if beside is not None:
        for row, us in zip(rows, [beside.get(name) for name, _ in top] + [sum(beside.values())]):
            row[beside_name] = us
    return rows


def profile_fla_rows(device: str) -> list:
    """fla's forward + backward (guard bypassed) per kernel at the timing shape (torch.profiler), to set
    beside fast's profile; the first calls autotune (~2 min)."""
    fla = common.try_import_fla()
    if fla is None or fla.chunk_gated_delta_rule is None:
        return [dict(kernel="fla not installed")]
    fla_guard_bypass()
    leaves, do = inputs(B, T, H, HV, device)
    return _kernel_rows(_step_kernel_times(_fla_call(fla.chunk_gated_delta_rule), leaves, do))


def profile_rows(device: str, beside: str = "None/None") -> list:
    """Where fast's forward + backward time goes: mean device time per kernel (torch.profiler) over a few
    steps at the timing shape, largest first, with its share of the total; beside it the same kernel with
    the backward's precision tuple ``beside`` ("grad_dot/recompute[/16-bit]" as benchmarks.grad_precision's
    --variants; default None/None, the 16-bit backward), to show what a precision choice costs."""
    from .grad_precision import _parse
    leaves, do = inputs(B, T, H, HV, device)
    kt = _step_kernel_times(_fast_call, leaves, do)
    other = _step_kernel_times(_fast_knob_call(precision=_parse(beside)), leaves, do)
    return _kernel_rows(kt, other, "16-bit bwd us" if beside == "None/None" else f"{beside} us")


SECTIONS = ("timing", "profile", "errors")
EXTRA_SECTIONS = ("conv_sweep", "profile_fla")          # run only when named in --only


def run_sections(device: str = "cuda", sweep=None, only=SECTIONS, beside: str = "None/None"):
    """Yields (title, rows, meta) per section as each finishes (a time limit keeps what finished);
    ``only``: which of SECTIONS to run (the sweep runs when ``sweep`` is set: "all" or comma-separated
    stage names)."""
    shape = (f"B={B}, T={T}, H={H}, HV={HV}, K=V={K}, bf16 q/k/v/beta, fp32 g, qk-l2norm, chunk {CHUNK}, "
             "no initial state")
    if "timing" in only:
        rows, notes = timing_rows(device)
        rows += conv_rows(device)
        meta = {"shape": shape, "x fwd": "time / fast's forward time (inference path)", **notes}
        yield TITLE, rows, meta
    if "profile" in only:
        yield ("Training: where fast's forward + backward time goes (torch.profiler, per kernel)",
               profile_rows(device, beside), {"shape": shape, "us": "mean device time per step over 5 steps"})
    if "errors" in only:
        err_meta = {"shape": f"B={ERR_SHAPE['B']}, T={ERR_SHAPE['T']}, H={ERR_SHAPE['H']}, HV={ERR_SHAPE['HV']}, "
                             f"K=V={K}, bf16, qk-l2norm, chunk {CHUNK}",
                    "truth": "refgdn autograd in float64 on the same bf16 inputs and cotangent",
                    "ratio": "max|err| / (2 x refgdn-bf16 error + 2^-7 max(1, max|truth|)); pass <= 1"}
        yield "Training: gradient error vs float64 truth, fast and fla", error_rows(device), err_meta
    if sweep:
        yield ("Training: fast backward config sweep (fwd+bwd ms)",
               sweep_rows(device, None if sweep == "all" else sweep.split(",")), {})
    if "profile_fla" in only:
        yield ("Training: where fla's forward + backward time goes (guard bypassed, torch.profiler, per kernel)",
               profile_fla_rows(device), {"us": "mean device time per step over 5 steps"})
    if "conv_sweep" in only:
        yield (f"Training: conv1d backward config sweep T={CONV_T} D={CONV_D} W={CONV_W} silu bf16",
               conv_sweep_rows(device), {"GB/s": "bytes per element the form must move (window 6: x, dy, dx; "
                                                  "two passes 14: and dz in float32, written and read) / time",
                                         "of_copy": "GB/s / device copy bandwidth (read + write, 1 GiB), "
                                                    "this process"})


def run() -> list:
    return next(iter(run_sections()))[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_train", description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", nargs="?", const="all", default=None, metavar="STAGES",
                    help="also sweep fast's backward stage configs (optionally only these comma-separated "
                         "stages: dh, dqkwg, dw, wy, dv_local, state, w_u, kkt)")
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--beside", default="None/None", metavar="G/R[/16-bit[/forward]]",
                    help="profile: the backward precision tuple timed beside the default (default None/None, "
                         "the 16-bit backward; e.g. bf16x2/tf32/16-bit)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {','.join(SECTIONS + EXTRA_SECTIONS)} "
                         f"(default: {','.join(SECTIONS)})")
    args = ap.parse_args(argv)
    only = tuple(x for x in args.only.split(",") if x)
    bad = [x for x in only if x not in SECTIONS + EXTRA_SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; expected some of {list(SECTIONS + EXTRA_SECTIONS)}")
    if not common.gpu_available():
        print("bench_train: a CUDA GPU is needed (none found, or TRITON_INTERPRET=1); nothing to do.")
        return 0
    v = common.versions()
    print(f"device: {common.device_name()} | torch {v['torch']} | triton {v['triton']} | fla {v['fla']}")
    for title, rows, meta in run_sections(sweep=args.sweep, only=only, beside=args.beside):
        print(f"\n## {title}\n")
        for k_, v_ in meta.items():
            print(f"- {k_}: {v_}")
        print(common.format_table(rows))
        if not args.no_results:
            common.append_results(title, rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
