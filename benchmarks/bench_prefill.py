"""Prefill benchmarks at Qwen3-Next's shape: fast vs fla (same process, same inputs) vs the ceilings.

Shape: H = 16 query/key heads, HV = 32 value heads, K = V = 128, bfloat16 q/k/v/beta, float32 g and
state; chunk size 64 (fast's default). Cases:

  - chunk forward, B = 1, T = 4096 / 16384 / 65536, and B = 4, T = 4096 (no initial state, final state
    written);
  - varlen: 16 sequences totalling 32760 tokens, with initial states, final states written;
  - causal conv1d forward: T = 16384, D = 8192, W = 4, silu, bf16;
  - refgdn (the oracle, float32 compute on the GPU) at T = 4096 only, timed twice;
  - per-kernel breakdown of fast's (and fla's) chunk forward at T = 65536 (torch.profiler);
  - a conv1d config sweep (BT x BD x warps) to choose the pinned config;
  - the error of o and the final state against the float64 truth (fast's two output paths, fla);
  - host and device time per call of the chunk forward at short lengths (which of the two bounds a call);
  - a serving stream: varlen prefills whose token and sequence counts change on every call;
  - one GDN layer's prefill against a slot cache (fast.gdn_prefill vs the gather / scatter composition).

FLOPs of the chunked forward (matmul FLOPs of the algorithm, 2 per multiply-add, per value head,
chunk size C, head dims K and V, per chunk of C tokens; counted per value head as computed, even
where a kernel could share K K^T across the G = HV/H value heads of one key head):

    K K^T (C x C x K)             2 C^2 K       wy_repr: L = beta (K K^T) * decay
    (I + L)^-1                    2 C^3 / 3     triangular inverse (forward substitution)
    w = A (beta e^G K)            2 C^2 K
    u = A (beta V)                2 C^2 V
    v_new = u - w S               2 C K V       state passing
    S += K^T (decay * v_new)      2 C K V
    Q S                           2 C K V       output
    Q K^T                         2 C^2 K
    (Q K^T * M) v_new             2 C^2 V

    flops / token / value head = 6 C K + 4 C V + 6 K V + 2 C^2 / 3     (C = 64, K = V = 128: 182,955)

Bytes of conv1d (the floor of its HBM traffic): read x (T D) + write y (T D) + weights (D W), in
the element size of bf16; its ceiling is the measured device copy bandwidth (read + write).
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import common

H, HV, K, V = 16, 32, 128, 128
CHUNK = 64
DTYPE = torch.bfloat16
CHUNK_TS = (4096, 16384, 65536)
BATCHED = (4, 4096)                      # (B, T): the batched row
VARLEN_LENS = (4096, 512, 3000, 1, 2047, 2049, 6000, 64, 1500, 2500, 1800, 2200, 1900, 1100, 3000, None)
VARLEN_TOTAL = 32760
CONV_T, CONV_D, CONV_W = 16384, 8192, 4
BREAKDOWN_T = 65536
FLA_DRAWS = 3                            # fla's autotune draws per chunk row (bench_chunk)


def chunk_flops(tokens: int, heads: int = HV, C: int = CHUNK, Kd: int = K, Vd: int = V) -> float:
    """Matmul FLOPs of the chunked forward (formula in the module docstring)."""
    return tokens * heads * (6 * C * Kd + 4 * C * Vd + 6 * Kd * Vd + 2 * C * C / 3)


def conv_bytes(T: int, D: int, W: int, elem: int = 2) -> int:
    """read x + write y + weights."""
    return elem * (2 * T * D + D * W)


def varlen_lengths() -> list:
    lens = [x for x in VARLEN_LENS if x is not None]
    lens.append(VARLEN_TOTAL - sum(lens))
    assert len(lens) == 16 and min(lens) >= 1 and sum(lens) == VARLEN_TOTAL
    return lens


def cu_seqlens_of(lens: list, device: str) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as an int64 tensor on device: the offsets of sequences of these lengths."""
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=device)


def rel_errors(x: torch.Tensor, truth: torch.Tensor) -> tuple:
    """(max |x - truth| / max |truth|, ||x - truth|| / ||truth||): x against its float64 truth."""
    d = x.double() - truth
    return (d.abs().max() / truth.abs().max()).item(), (d.norm() / truth.norm()).item()


def chunk_case_inputs(T: int, seq_lens: Optional[list], B: int, device: str, host_copy: bool = False,
                      l2norm: bool = False, heads: Optional[tuple] = None) -> tuple:
    """(q, k, v, g, beta, keyword arguments) of one chunk-table case: B sequences of T tokens (dense, no initial
    state) or the sequences seq_lens (varlen, an initial state each; host_copy: cu_seqlens_cpu too); the final state
    written; l2norm: use_qk_l2norm_in_kernel=True; heads: (H, HV), default Qwen3-Next's (H, HV)."""
    N = len(seq_lens) if seq_lens else None
    q, k, v, g, beta, S0 = gdn_inputs(T, device, N, B=B, heads=heads)
    kw = dict(initial_state=S0, output_final_state=True)
    if l2norm:
        kw["use_qk_l2norm_in_kernel"] = True
    if seq_lens:
        cu = cu_seqlens_of(seq_lens, device)
        kw["cu_seqlens"] = cu
        if host_copy:
            kw["cu_seqlens_cpu"] = cu.cpu()
    return q, k, v, g, beta, kw


def gdn_inputs(T: int, device: str, N: Optional[int] = None, seed: int = 0, B: int = 1,
               heads: Optional[tuple] = None):
    """q, k (unit-norm), v, g (log-decay, float32), beta (bf16), [B, T, ...]; S0 [N, HV, K, V] if N.
    heads: (H, HV) (default: the module's, Qwen3-Next's 16 / 32)."""
    h, hv = heads or (H, HV)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, h, K, device=device, generator=gen).to(DTYPE)
    k = F.normalize(torch.randn(B, T, h, K, device=device, generator=gen), dim=-1).to(DTYPE)
    v = torch.randn(B, T, hv, V, device=device, generator=gen).to(DTYPE)
    g = F.logsigmoid(torch.randn(B, T, hv, device=device, generator=gen) + 3.0)  # mostly weak decay
    beta = torch.sigmoid(torch.randn(B, T, hv, device=device, generator=gen)).to(DTYPE)
    S0 = (0.1 * torch.randn(N, hv, K, V, device=device, generator=gen)) if N else None
    return q, k, v, g, beta, S0


def _fast(name: str):
    try:
        import fast
    except Exception as e:  # noqa: BLE001
        print(f"fast: import failed: {e}", file=sys.stderr)
        return None
    return getattr(fast, name, None)


def _row(case: str, tokens: int, ms: float, *, flops: float = None, nbytes: float = None,
         ceiling: float = None, fla_ms: float = None, note: str = "", device=None) -> dict:
    # fixed column order: case, ms, Mtok/s, TFLOP/s, GB/s, of ceiling, fla ms, fla/fast, [device columns,] note
    # device: (fast's, fla's) device ms per call, the union of their kernels' intervals (a call whose host work
    # outlasts its kernels is timed by its host in "ms"; by its kernels here), or None: no device columns
    row = {"case": case, "ms": ms, "Mtok/s": tokens / ms / 1e3 if ms else None, "TFLOP/s": None, "GB/s": None,
           "of ceiling": None}
    if flops is not None and ms:
        row["TFLOP/s"] = flops / ms / 1e9
        row["of ceiling"] = row["TFLOP/s"] / ceiling if ceiling else None
    if nbytes is not None and ms:
        row["GB/s"] = nbytes / ms / 1e6
        row["of ceiling"] = row["GB/s"] / ceiling if ceiling else None
    row["fla ms"] = fla_ms
    row["fla/fast"] = fla_ms / ms if (fla_ms and ms) else None
    if device is not None:
        dev, fla_dev = device
        row["device ms"], row["fla device ms"] = dev, fla_dev
        row["fla/fast device"] = fla_dev / dev if (dev and fla_dev) else None
    row["note"] = note
    return row


def _bench_or_error(fn: Callable, warm: bool = False, time_fn: Optional[Callable] = None) -> tuple:
    """(ms, "") or (None, error text): one failing implementation must not sink the whole run. warm: one
    untimed do_bench first (the first row of a process: fla's first timed row read 2x slow there, 1.052 vs
    0.499 ms on an H200, sixth session of 2026-11-23; given to both implementations alike). time_fn(fn) -> ms:
    how fn is timed (default common.bench)."""
    try:
        fn()
        common.synchronize()
        if warm:
            common.bench(fn)
        return (time_fn or common.bench)(fn), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


# ----------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------

def bench_chunk(device: str, tflops_ceiling: float, only: Optional[str] = None, l2norm: bool = False,
                fla_draws: int = FLA_DRAWS, heads: Optional[tuple] = None) -> list:
    """The chunk rows (fast, fla, the refgdn oracle at the first T); only: the cases whose name contains it.
    l2norm: both called with use_qk_l2norm_in_kernel=True (how vLLM runs Qwen3-Next; the issue's baseline table
    names it), the case names marked "l2norm"; by default q and k come normalised and neither normalises.
    fla_draws: fla's time is its best over this many autotune draws (common.best_of_autotune_draws; the draws'
    times in the note), its device time that of the best draw's picks. heads: (H, HV) other than Qwen3-Next's
    16 / 32 (e.g. Qwen3.5's larger models' 16 / 64), named in each row."""
    rows = []
    fast_chunk = _fast("chunk_gated_delta_rule")
    fla = common.try_import_fla()
    fla_chunk = fla.chunk_gated_delta_rule if fla is not None else None

    cases = [(f"chunk fwd T={T}", T, None, 1, False) for T in CHUNK_TS]
    cases.append((f"chunk fwd B={BATCHED[0]} T={BATCHED[1]}", BATCHED[1], None, BATCHED[0], False))
    lens = varlen_lengths()
    cases.append((f"varlen 16 seqs, {VARLEN_TOTAL} tok, init", VARLEN_TOTAL, lens, 1, False))
    # the same with cu_seqlens' host copy passed to both (fla's cu_seqlens_cpu; vLLM has query_start_loc_cpu):
    # no device->host read per call, so the host work overlaps the GPU
    cases.append((f"varlen 16 seqs, {VARLEN_TOTAL} tok, init, cu_seqlens_cpu", VARLEN_TOTAL, lens, 1, True))
    if l2norm:
        cases = [(name + ", l2norm", *rest) for name, *rest in cases]
    if heads is not None:
        cases = [(name + f", H={heads[0]} HV={heads[1]}", *rest) for name, *rest in cases]
    for i, (name, T, seq_lens, B, host_copy) in enumerate([c for c in cases if only is None or only in c[0]]):
        q, k, v, g, beta, kw = chunk_case_inputs(T, seq_lens, B, device, host_copy, l2norm, heads)
        notes = []
        ms = dev_ms = None
        if fast_chunk is not None:
            fn = lambda: fast_chunk(q, k, v, g, beta, chunk_size=CHUNK, **kw)    # noqa: E731
            ms, err = _bench_or_error(fn, warm=i == 0)
            if err:
                notes.append("fast: " + err)
            else:
                dev_ms = device_ms(fn)
        else:
            notes.append("fast.chunk_gated_delta_rule missing")
        fla_ms = fla_dev = None
        if fla_chunk is not None:
            try:
                call, note = common.call_fla_gdn(fla_chunk, q, k, v, g, beta, **kw)
                draws = []

                def best_draw(f):              # fla's best of fla_draws autotune draws (a slow first row too)
                    ms, draws[:] = common.best_of_autotune_draws(f, fla_draws, common.bench)
                    return ms
                fla_ms, err = _bench_or_error(call, warm=i == 0 and fla_draws <= 1,
                                              time_fn=best_draw if fla_draws > 1 else None)
                if draws:
                    note = "; ".join(x for x in (note, "fla best of draws " + "/".join(f"{t:.3f}" for t in draws))
                                     if x)
                notes += [n for n in (note, "fla: " + err if err else "") if n]
                fla_dev = device_ms(call) if not err else None
            except Exception as e:  # noqa: BLE001
                notes.append(f"fla: {type(e).__name__}: {e}"[:120])
        rows.append(_row(name, B * T, ms, flops=chunk_flops(B * T, heads=(heads or (H, HV))[1]),
                         ceiling=tflops_ceiling, fla_ms=fla_ms,
                         note="; ".join(notes), device=(dev_ms, fla_dev)))
        print(_progress(rows[-1]), file=sys.stderr)
        if T == CHUNK_TS[0] and B == 1 and not seq_lens and heads is None:
            rows.append(bench_refgdn(q, k, v, g, beta, kw, T, tflops_ceiling))
            print(_progress(rows[-1]), file=sys.stderr)
        # the case's tensors freed by a rebind (a `del` here read to pyflakes as undefining the names that the
        # loop's lambdas use: 45 false reports, which hid a real undefined name)
        q = k = v = g = beta = kw = None
        torch.cuda.empty_cache()
    return rows


def bench_refgdn(q, k, v, g, beta, kw, T, ceiling) -> dict:
    import refgdn

    try:
        ms = common.bench_once(lambda: refgdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, **kw),
                               repeats=2)
        note = "refgdn (oracle, fp32 compute), wall-clock median of 2"
    except Exception as e:  # noqa: BLE001
        ms, note = None, f"refgdn: {type(e).__name__}: {e}"[:120]
    return _row(f"refgdn chunk T={T}", T, ms, flops=chunk_flops(T), ceiling=ceiling, note=note)


def bench_conv(device: str, gbs_ceiling: float) -> list:
    fast_conv = _fast("causal_conv1d")
    fla = common.try_import_fla()
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, CONV_T, CONV_D, device=device, generator=gen).to(DTYPE)
    w = (torch.randn(CONV_D, CONV_W, device=device, generator=gen) / 2).to(DTYPE)
    notes, ms, fla_ms = [], None, None
    if fast_conv is not None:
        ms, err = _bench_or_error(lambda: fast_conv(x, w, None, "silu"))
        if err:
            notes.append("fast: " + err)
    if fla is not None and fla.causal_conv1d is not None:
        fla_ms, err = _bench_or_error(lambda: fla.causal_conv1d(x=x, weight=w, activation="silu"))
        if err:
            notes.append("fla: " + err)
    row = _row(f"conv1d fwd T={CONV_T} D={CONV_D} W={CONV_W} silu", CONV_T, ms,
               nbytes=conv_bytes(CONV_T, CONV_D, CONV_W), ceiling=gbs_ceiling, fla_ms=fla_ms, note="; ".join(notes))
    print(_progress(row), file=sys.stderr)
    return [row]


def conv_sweep(device: str, gbs_ceiling: float) -> list:
    """Time fast's conv1d prefill kernel over a small config grid (to choose the pinned config)."""
    try:
        from fast.conv import causal_conv1d_with_config, conv_fwd_config
    except Exception as e:  # noqa: BLE001
        return [dict(config=f"unavailable: {e}")]
    x = torch.randn(1, CONV_T, CONV_D, device=device).to(DTYPE)
    w = torch.randn(CONV_D, CONV_W, device=device).to(DTYPE)
    nbytes = conv_bytes(CONV_T, CONV_D, CONV_W)
    pinned = conv_fwd_config(CONV_T, CONV_D, CONV_W)
    rows = []
    for BT in (8, 16, 32, 64):
        for BD in (128, 256, 512):
            for nw in (4, 8):
                if BT * BD > 32768:
                    continue
                cfg = dict(BT=BT, BD=BD, num_warps=nw)
                ms, err = _bench_or_error(lambda: causal_conv1d_with_config(x, w, None, "silu", config=cfg))
                rows.append(dict(config=f"BT={BT} BD={BD} warps={nw}" + (" (pinned)" if cfg == pinned else ""),
                                 ms=ms, **{"GB/s": nbytes / ms / 1e6 if ms else None,
                                           "of copy bw": nbytes / ms / 1e6 / gbs_ceiling if ms else None},
                                 note=err))
    rows.sort(key=lambda r: r["ms"] if r["ms"] else float("inf"))
    return rows[:12]


def device_ms(fn, iters: int = 5) -> float:
    """Device time of one call of fn, in ms: how long the device had a kernel (or copy) of it running, torch.profiler,
    mean over ``iters`` calls: the union of the kernels' [start, end) intervals (busy_ms), so kernels that run at
    once (the B=1 pipeline's two streams) count once. Idle gaps between kernels (the host's share of a host-bound
    call) do not count. None without CUDA (nothing to profile)."""
    if not torch.cuda.is_available():
        return None
    return busy_ms(_kernel_spans(_profile(fn, iters))) / iters


def busy_ms(spans) -> float:
    """The length, in ms, of the union of [start, end) intervals given in us (overlaps counted once)."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def _profile(fn, iters: int):
    """torch.profiler's record of ``iters`` calls of fn (CUDA activity), after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    common.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        common.synchronize()
    return prof


def _kernel_spans(prof) -> list:
    """[(start us, end us)] of every device activity (kernels, copies) in a profiler record."""
    from torch.autograd import DeviceType
    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]


def _kernel_times(fn, iters: int) -> list:
    """[(kernel name, mean device ms per call, calls per call)] of fn over ``iters`` profiled calls (after one
    unprofiled call): torch.profiler's CUDA activity."""
    return _events(_profile(fn, iters), iters)


def _events(prof, iters: int) -> list:
    """_kernel_times' rows from a profiler record of ``iters`` calls."""
    events = []
    for e in prof.key_averages():
        t_us = getattr(e, "device_time_total", None)
        if t_us is None:
            t_us = getattr(e, "cuda_time_total", 0)
        if t_us and t_us > 0:
            events.append((e.key, t_us / iters / 1e3, e.count / iters))
    return events


# (B, T): Qwen3-Next's longest row, then the same 16384 tokens in 1, 2, 4, 8 sequences
STATE_SWEEP_CASES = ((1, 65536), (1, 16384), (2, 8192), (4, 4096), (8, 2048))
STATE_SWEEP_CONFIGS = (dict(BV=16, num_warps=4), dict(BV=32, num_warps=4), dict(BV=64, num_warps=4),
                       dict(BV=64, num_warps=8), dict(BV=32, num_warps=4, num_stages=2))


def state_sweep(device: str, cases=STATE_SWEEP_CASES, configs=STATE_SWEEP_CONFIGS, iters: int = 5,
                paths=((False, False), (True, False), (True, True), (False, True)),
                heads: Optional[tuple] = None) -> list:
    """Kernel 3 (chunk_state_kernel, the sequential state pass) over a config grid, at the same token count split
    into 1..8 sequences, along each path (from_a, fuse_output): v_new formed from w, u (kernel 2 runs) or from A in
    the pass (FROM_A; kernel 2 skipped), and o by kernel 4 or in the pass (OUTPUT; kernel 4 skipped, h and v_new
    never stored). Per row the state kernel's device time (torch.profiler) and the whole forward's (do_bench),
    under each config beside the pinned one (fast.chunk.state.state_config), passed as the forward's ``configs``,
    ``from_a`` and ``fuse_output`` arguments; "rule" marks the path the forward takes (FROM_A always; OUTPUT by
    fast.chunk.state.state_fuses_output). How the pinned BV rule (sixth session of 2026-11-23), FROM_A and the
    OUTPUT rule (2026-11-24) were chosen; heads: (H, HV) other than Qwen3-Next's; run:
    python -c "import benchmarks.bench_prefill as b; [print(r) for r in b.state_sweep('cuda')]"."""
    from fast.chunk import chunk_gated_delta_rule_fwd
    from fast.chunk.pipeline import forward_fuses_output
    from fast.chunk.state import state_config

    def state_ms(fn) -> float:
        return next((ms for name, ms, _ in _kernel_times(fn, iters) if name == "chunk_state_kernel"), float("nan"))

    rows = []
    for B, T in cases:
        q, k, v, g, beta, _ = gdn_inputs(T, device, B=B, heads=heads)
        hv = v.shape[2]
        rule = (True, forward_fuses_output(B, T, CHUNK, hv, K, V, q.device))
        for fa, fu in paths:
            pinned = state_config(B, hv, K, V, q.device, fused=fu)
            for cfg in (None,) + tuple(configs):
                over = {"state": cfg} if cfg else None

                def fwd():
                    return chunk_gated_delta_rule_fwd(q, k, v, g, beta, chunk_size=CHUNK, output_final_state=True,
                                                      configs=over, from_a=fa, fuse_output=fu)
                try:
                    ms, total, note = state_ms(fwd), common.bench(fwd), ""
                except Exception as e:  # noqa: BLE001 - a config that does not run is reported
                    ms, total, note = None, None, f"{type(e).__name__}: {e}"[:100]
                rows.append(dict(case=f"B={B} T={T} HV={hv}", from_a=fa, fuse_output=fu,
                                 config=f"pinned {pinned}" if cfg is None else str(cfg),
                                 **{"state ms": ms, "forward ms": total},
                                 note=("rule; " if (fa, fu) == rule and cfg is None else "") + note))
        q = k = v = g = beta = None
        torch.cuda.empty_cache()
    return rows


# (B, T or None for the varlen mix): the fused pass's programs 128 / 256 / 512 / 1024 dense, and 1024 varlen; then
# B=1, the unfused pass (pipelined over two segments at T=16384; not in the 2026-11-27 run)
PREFETCH_SWEEP_CASES = ((2, 8192), (4, 4096), (8, 2048), (16, 1024), (1, None), (1, 16384))


def prefetch_sweep(device: str, cases=PREFETCH_SWEEP_CASES, betas=("bf16", "fp32", "logits"), l2norms=(True, False),
                   rounds: int = 2, iters: int = 10) -> list:
    """The state pass's beta prefetch (the kernel's PREFETCH_BETA) off and on, alternating ``rounds`` times in one
    process, beside fast.chunk.state.state_prefetch_beta's pick: per case, beta form ("bf16" / "fp32" values, or
    bf16 "logits" with beta_logits=1, gdn_prefill's form) and l2norm in the kernel, the state kernel's mean device
    us over ``iters`` calls (torch.profiler; None without CUDA) for each, and whether o is bit for bit the same
    both ways (it must be: the load moves, the arithmetic does not). Passed as the forward's
    ``configs={"state": {"PREFETCH_BETA": ...}}``. How the rule of 2026-11-27 was chosen; rerun it on a new Triton:
    python -c "import benchmarks.bench_prefill as b; [print(r) for r in b.prefetch_sweep('cuda')]"."""
    from fast.chunk import chunk_gated_delta_rule_fwd
    from fast.chunk.pipeline import forward_fuses_output
    from fast.chunk.state import state_prefetch_beta

    rows = []
    for B, T in cases:
        lens = varlen_lengths() if T is None else None
        N = len(lens) if lens else B
        fused = forward_fuses_output(N, T or VARLEN_TOTAL, CHUNK, HV, K, V, torch.device(device))
        for l2 in l2norms:
            q, k, v, g, beta0, kw = chunk_case_inputs(T or VARLEN_TOTAL, lens, B, device, l2norm=l2)
            forms = dict(bf16=(beta0.to(torch.bfloat16), {}), fp32=(beta0.float(), {}),
                         logits=(torch.logit(beta0.float().clamp(1e-3, 1 - 1e-3)).to(torch.bfloat16),
                                 dict(beta_logits=1)))
            for name in betas:
                beta, extra = forms[name]
                times, outs = {False: [], True: []}, {}
                for _ in range(rounds):
                    for ahead in (False, True):
                        def fwd():
                            return chunk_gated_delta_rule_fwd(q, k, v, g, beta, chunk_size=CHUNK, **kw, **extra,
                                                              configs={"state": {"PREFETCH_BETA": ahead}})
                        outs.setdefault(ahead, fwd()[0])
                        if torch.cuda.is_available():
                            times[ahead] += [t * 1e3 for n, t, _ in _kernel_times(fwd, iters)
                                             if n == "chunk_state_kernel"]
                pick = state_prefetch_beta(fused, lens is not None and N > 1, beta.dtype, l2 and fused)
                rows.append(dict(case=f"B={B} T={T}" if lens is None else f"varlen {N} seqs", beta=name, l2norm=l2,
                                 fused=fused, rule="on" if pick else "off",
                                 **{"off us": [round(t, 1) for t in times[False]] or None,
                                    "on us": [round(t, 1) for t in times[True]] or None},
                                 equal=torch.equal(outs[False], outs[True])))
                print(rows[-1], file=sys.stderr)
            q = k = v = g = beta0 = kw = forms = None
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# the state pass's chunk size: (B, T, fused), chunk sizes, and per chunk size the configs beside the pinned one
CHUNK_PROBE_CASES = ((1, 16384, False), (4, 4096, True))
CHUNK_PROBE_BTS = (32, 64, 128)
CHUNK_PROBE_CONFIGS = {128: (dict(BV=32, num_warps=4, num_stages=2), dict(BV=32, num_warps=8, num_stages=2),
                             dict(BV=16, num_warps=4, num_stages=2), dict(BV=64, num_warps=8, num_stages=1),
                             dict(BV=64, num_warps=8, num_stages=2))}


def chunk_size_probe(device: str, cases=CHUNK_PROBE_CASES, bts=CHUNK_PROBE_BTS, configs=CHUNK_PROBE_CONFIGS,
                     iters: int = 5) -> list:
    """A timing probe, not a forward: kernel 3 (the FROM_A state pass, fused with the output or not) alone at chunk
    sizes the library does not offer (128), to learn how its time scales with the chunk. At B = 1 the pass walks
    T / BT chunks one after another, latency-bound: if a chunk's latency grows less than its size, larger chunks
    shorten the chain. The inputs are shaped as the forward's (A: a random unit lower-triangular [BT, BT] block per
    chunk, not the inverse of anything; G: a chunk-local cumsum of g), so the outputs mean nothing; only the time is
    read. Per row: the state kernel's device ms (torch.profiler) and per chunk (us), or the error a config raised
    (e.g. shared memory). Run: python -c "import benchmarks.bench_prefill as b; [print(r) for r in
    b.chunk_size_probe('cuda')]"."""
    from fast.chunk.common import _Chunks
    from fast.chunk.output import row_scales
    from fast.chunk.state import _launch_state, state_config

    rows = []
    for B, T, fused in cases:
        q, k, v, g, beta, _ = gdn_inputs(T, device, B=B)
        for BT in bts:
            NT = T // BT
            G = g.view(B, NT, BT, HV).cumsum(2).view(B, T, HV).contiguous()           # chunk-local cumsum
            gen = torch.Generator(device=device).manual_seed(1)
            A = (0.05 * torch.randn(B, T, HV, BT, device=device, generator=gen)).view(B, NT, BT, HV, BT)
            A = (torch.tril(A.transpose(2, 3), -1) + torch.eye(BT, device=device)).transpose(2, 3)
            A = A.reshape(B, T, HV, BT).to(DTYPE).contiguous()
            ch = _Chunks(B, T, BT, None)
            ht = torch.empty(B, HV, K, V, device=device)
            if fused:
                o = torch.empty(B, T, HV, V, dtype=DTYPE, device=device)
                h = v_new = None
                out = (q, o, K ** -0.5, row_scales(q))            # l2norm in the kernel: q's row scales
            else:
                h = torch.empty(ch.total, HV, K, V, dtype=DTYPE, device=device)
                v_new = torch.empty(B, T, HV, V, dtype=DTYPE, device=device)
                out = None
            pinned = state_config(B, HV, K, V, q.device, fused=fused)
            for cfg in configs.get(BT, (None,)):
                def call():
                    _launch_state(k, None, None, G, None, None, h, v_new, ht, ch, B, T, BT, precise=False,
                                  wy=(A, v, beta), out=out, configs={"state": cfg} if cfg else None)
                try:
                    ms = next(t for name, t, _ in _kernel_times(call, iters) if name == "chunk_state_kernel")
                    note = ""
                except Exception as e:  # noqa: BLE001 - a config that does not run is reported
                    ms, note = None, f"{type(e).__name__}: {e}"[:120]
                rows.append(dict(case=f"B={B} T={T}", fused=fused, BT=BT,
                                 config=f"pinned {pinned}" if cfg is None else str(cfg), **{
                                     "state ms": ms, "us per chunk": ms * 1e3 / NT if ms else None}, note=note))
                print(rows[-1], flush=True)
            G = A = h = v_new = None
        q = k = v = g = beta = None
        torch.cuda.empty_cache()
    return rows


# (segments, configs) beside the rule's choice: kernel 1 queued 1 or all segments ahead, equal or tapered cuts
PIPELINE_VARIANTS = ((1, None), (2, None), (2, {"pipeline": dict(ahead=2)}), (4, None), (4, {"pipeline": dict(ahead=4)}),
                     (4, {"pipeline": dict(ahead=4, weights=(1, 2, 2, 1))}), (8, {"pipeline": dict(ahead=8)}),
                     (8, {"pipeline": dict(ahead=8, weights=(1, 2, 2, 2, 2, 2, 2, 1))}))
# the kernels' configs inside the rule's pipeline: the state pass's shared memory (stages) against kernel 4's
PIPELINE_CONFIG_VARIANTS = ((None, None), (None, {"state": dict(num_stages=2)}), (None, {"output": dict(num_warps=8)}),
                            (None, {"output": dict(BV=64)}), (None, {"state": dict(num_stages=2), "output": dict(BV=64)}))


def pipeline_sweep(device: str, Ts=(16384, 65536), variants=PIPELINE_VARIANTS, heads: Optional[tuple] = None,
                   fuse_output: Optional[bool] = None) -> list:
    """The B = 1 forward pipelined over segments (fast.chunk.pipeline) by segment count (None: the rule's) and configs:
    the pipeline's benchmark knobs (configs={"pipeline": {"ahead": segments whose kernel 1 the caller's stream queues
    before a kernel 4, "weights": relative segment lengths}}) or the kernels' (PIPELINE_CONFIG_VARIANTS). Per row:
    the device time (the call replayed from a CUDA graph, do_bench) and the eager time (do_bench, host included), ms;
    "rule" marks pipeline_segments' choice. heads: (H, HV) other than Qwen3-Next's; fuse_output: the forward's
    (None: its rule; the pipeline runs only without the fused pass). Run:
    python -c "import benchmarks.bench_prefill as b; [print(r) for r in b.pipeline_sweep('cuda')]"."""
    from fast.chunk import chunk_gated_delta_rule_fwd, pipeline_segments

    from .bench_decode import graphed
    rows = []
    for T in Ts:
        q, k, v, g, beta, _ = gdn_inputs(T, device, heads=heads)
        rule = pipeline_segments(1, T, CHUNK, q.device, False)
        for S, cfgs in variants:
            def fwd():
                return chunk_gated_delta_rule_fwd(q, k, v, g, beta, chunk_size=CHUNK, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, segments=S, configs=cfgs,
                                                  fuse_output=fuse_output)
            replay = graphed(fwd)
            dev = common.bench(replay) if replay is not None else float("nan")
            rows.append(dict(case=f"B=1 T={T} HV={v.shape[2]}", segments=S or rule, configs=str(cfgs or {}), **{
                "device ms": dev, "eager ms": common.bench(fwd)},
                note="rule" if S in (None, rule) and not cfgs else ""))
            print(rows[-1], flush=True)
            replay = None
        q = k = v = g = beta = None
        torch.cuda.empty_cache()
    return rows


INVERSE_VARIANTS = (("rows", None), ("doubling", dict(INV_DIAG_PREC="tf32x3")), ("doubling", dict(INV_DIAG_PREC="tf32")))
# kernel 1's launch configs beside the pinned one (1 warp, HPP 2 at Qwen3-Next's GVA), for the bf16 default (doubling)
KKT_CONFIG_VARIANTS = (("doubling", None), ("doubling", dict(num_warps=2)), ("doubling", dict(num_warps=4)),
                       ("doubling", dict(HPP=1)), ("doubling", dict(HPP=1, num_warps=2)))


def inverse_sweep(device: str, cases=((4, 4096), (1, 65536), (16, None)), variants=INVERSE_VARIANTS, iters: int = 5,
                  seeds=(1, 2, 3)) -> list:
    """Kernel 1's triangular inverse, its diagonal 16x16 blocks by forward substitution ("rows") or by doubling (its
    products at the precision given, through the launchers' configs {"kkt": {"INV_DIAG_PREC": ...}}; by default the
    dtype's fast.chunk.common.INV_DIAG_PRECISION). variants: (inv_method, kernel 1 config keys over the pinned ones or
    None); KKT_CONFIG_VARIANTS sweeps kernel 1's warps and heads per program instead. Per case and variant: kernel 1's device time
    (torch.profiler), the whole forward's time (do_bench), and the forward's error against the float64 truth (refgdn
    in float64 on the same rounded inputs, an initial state per sequence), mean over ``seeds`` of max |x - t| / max |t|
    for o and the final state (error_rows' measure). (16, None): the varlen mix (varlen_lengths). Run:
    python -c "import benchmarks.bench_prefill as b; [print(r) for r in b.inverse_sweep('cuda')]"."""
    import refgdn
    from fast.chunk import chunk_gated_delta_rule_fwd

    rows = []
    for B, T in cases:
        kw = dict(chunk_size=CHUNK, output_final_state=True, use_qk_l2norm_in_kernel=True)
        name, N = f"B={B} T={T}", B
        if T is None:
            lens = varlen_lengths()
            B, N, T, name = 1, len(lens), sum(lens), f"varlen {len(lens)} seqs {sum(lens)} tok"
            kw["cu_seqlens"] = cu_seqlens_of(lens, device)
        errs: dict = {}
        for seed in seeds:
            q, k, v, g, beta, S0 = gdn_inputs(T, device, N=N, B=B, seed=seed)
            truth = None
            if B * T <= 32768:                          # the float64 truth of the long row costs too much memory
                truth = refgdn.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                      initial_state=S0.double(), **kw)
            for method, kcfg in variants:
                over = {"kkt": dict(kcfg)} if kcfg else None

                def fwd():
                    return chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=S0, configs=over,
                                                      inv_method=method, **kw)
                key = method + (", " + ", ".join(f"{a}={b}" for a, b in kcfg.items()) if kcfg else ", pinned")
                e = errs.setdefault(key, dict(kkt=[], fwd=[], o=[], st=[]))
                if truth is not None:
                    o, st = fwd()[:2]
                    e["o"].append(rel_errors(o, truth[0])[0])
                    e["st"].append(rel_errors(st, truth[1])[0])
                if seed == seeds[0]:
                    e["kkt"].append(next((ms for n, ms, _ in _kernel_times(fwd, iters) if n == "chunk_kkt_inv_kernel"),
                                         float("nan")))
                    e["fwd"].append(common.bench(fwd))
            q = k = v = g = beta = S0 = truth = None
            torch.cuda.empty_cache()
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        for key, e in errs.items():
            rows.append({"case": name, "inverse": key, "kernel 1 ms": mean(e["kkt"]), "forward ms": mean(e["fwd"]),
                         "o err (max rel)": mean(e["o"]), "state err (max rel)": mean(e["st"])})
    return rows


def kernel_breakdown(device: str, T: int = BREAKDOWN_T, iters: int = 5, seq_lens: Optional[list] = None) -> list:
    """Per-kernel device time of one chunk forward at T (fast, and fla when installed): torch.profiler.
    seq_lens: the varlen case instead (T = their sum, cu_seqlens, an initial state per sequence)."""
    kw = dict(output_final_state=True)
    if seq_lens:
        T = sum(seq_lens)
        kw["cu_seqlens"] = cu_seqlens_of(seq_lens, device)
    q, k, v, g, beta, S0 = gdn_inputs(T, device, len(seq_lens) if seq_lens else None)
    if S0 is not None:
        kw["initial_state"] = S0
    impls = []
    fast_chunk = _fast("chunk_gated_delta_rule")
    if fast_chunk is not None:
        impls.append(("fast", lambda q, k, v, g, beta: fast_chunk(q, k, v, g, beta, chunk_size=CHUNK, **kw)))
    fla = common.try_import_fla()
    if fla is not None and fla.chunk_gated_delta_rule is not None:
        try:
            call, note = common.call_fla_gdn(fla.chunk_gated_delta_rule, q, k, v, g, beta, **kw)
            impls.append(("fla" + (" (q/k repeated)" if note else ""), lambda *a: call()))
        except Exception as e:  # noqa: BLE001
            print(f"fla breakdown skipped: {e}", file=sys.stderr)
    rows = []
    for impl, fn in impls:
        try:
            prof = _profile(lambda: fn(q, k, v, g, beta), iters)
            events = _events(prof, iters)
            busy = busy_ms(_kernel_spans(prof)) / iters
        except Exception as e:  # noqa: BLE001
            rows.append(dict(impl=impl, kernel=f"failed: {type(e).__name__}: {e}"[:120]))
            continue
        total = sum(t for _, t, _ in events) or 1.0
        for name, ms, calls in sorted(events, key=lambda x: -x[1]):
            rows.append(dict(impl=impl, kernel=name[:80], ms=ms, share=ms / total, calls=calls))
        rows.append(dict(impl=impl, kernel="TOTAL (sum of kernel times)", ms=total, share=1.0, calls=None))
        # kernels on two streams (fast's B=1 pipeline) overlap: the device was busy for less than their sum
        rows.append(dict(impl=impl, kernel="BUSY (union of kernel intervals)", ms=busy, share=busy / total, calls=None))
    q = k = v = g = beta = S0 = None
    torch.cuda.empty_cache()
    return rows


def _progress(row: dict) -> str:
    parts = [f"{row['case']}:"]
    if row.get("ms"):
        parts.append(f"{row['ms']:.3f} ms")
    for key in ("TFLOP/s", "GB/s"):
        if row.get(key):
            parts.append(f"{row[key]:.1f} {key}")
    if row.get("of ceiling"):
        parts.append(f"{100 * row['of ceiling']:.0f}% of ceiling")
    if row.get("fla ms"):
        parts.append(f"fla {row['fla ms']:.3f} ms (fla/fast {row['fla/fast'] or 0:.2f})")
    if row.get("note"):
        parts.append(f"[{row['note']}]")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------

def error_rows(device: str, cases=((1, 4096), (4, 4096)), seeds=(1, 2, 3, 4, 5)) -> list:
    """Error of o and of the final state against the float64 truth (refgdn in float64 on the same rounded inputs),
    for fast on the path it takes, on the other output path (o through kernel 4 / in the state pass) and on kernel
    2's path (w and u stored, fla's algorithm), and fla 0.6.0 when installed; issue 11's accuracy bar is fast's
    error at or below fla's. Two measures per output, each the mean over ``seeds`` (inputs
    bench_prefill.gdn_inputs(seed) with an initial state): max |x - truth| / max |truth| (one element decides it:
    noisy between seeds) and ||x - truth|| / ||truth|| (Frobenius: every element); "worst max" is the largest
    max-norm error over the seeds."""
    import refgdn
    from fast.chunk import chunk_gated_delta_rule_fwd
    from fast.chunk.pipeline import forward_fuses_output

    fla = common.try_import_fla()
    rows = []
    for B, T in cases:
        acc: dict = {}                                   # (impl, path) -> per seed (o max, o fro, st max, st fro)
        for seed in seeds:
            q, k, v, g, beta, S0 = gdn_inputs(T, device, N=B, B=B, seed=seed)
            o_t, s_t = refgdn.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                     initial_state=S0.double(), output_final_state=True,
                                                     chunk_size=CHUNK)
            rule = forward_fuses_output(B, T, CHUNK, HV, K, V, q.device)
            for from_a, fused in ((True, rule), (True, not rule), (False, False)):
                o, st = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                                   chunk_size=CHUNK, fuse_output=fused, from_a=from_a)
                path = ("v_new from A, " if from_a else "kernel 2 (w, u), ") + (
                    "o in the state pass" if fused else "kernel 4")
                acc.setdefault(("fast" + (" (rule)" if from_a and fused == rule else ""), path), []).append(
                    rel_errors(o, o_t) + rel_errors(st, s_t))
            if fla is not None and fla.chunk_gated_delta_rule is not None:
                call, note = common.call_fla_gdn(fla.chunk_gated_delta_rule, q, k, v, g, beta, initial_state=S0,
                                                 output_final_state=True)
                o, st = call()
                acc.setdefault(("fla 0.6.0", note or "-"), []).append(rel_errors(o, o_t) + rel_errors(st, s_t))
            q = k = v = g = beta = S0 = o_t = s_t = None
            torch.cuda.empty_cache()
        for (impl, path), per_seed in acc.items():
            mean = [sum(x[i] for x in per_seed) / len(per_seed) for i in range(4)]
            rows.append({"case": f"B={B} T={T}", "impl": impl, "path": path, "o max": mean[0], "o fro": mean[1],
                         "o worst max": max(x[0] for x in per_seed), "state max": mean[2], "state fro": mean[3]})
    return rows


def host_rows(device: str, cases=((1, 1024), (1, 4096), (4, 4096)), iters: int = 50, repeats: int = 5,
              warmup: int = 10) -> list:
    """Per call of the chunk forward (an initial state, the final state written), fast and fla: the eager time
    (do_bench: what the main table reports), the host time (``iters`` back-to-back calls with no sync, per call:
    the Python, checks, allocations and launches; the GPU keeps up while it is shorter than the device time),
    and the device time (the call replayed from a CUDA graph). A call whose host time exceeds its device time is
    host-bound: its eager time is the host's."""
    import fast

    from .bench_decode import graphed
    fla = common.try_import_fla()
    rows = []
    for B, T in cases:
        q, k, v, g, beta, S0 = gdn_inputs(T, device, N=B, B=B)
        impls = [("fast", lambda: fast.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0,
                                                              output_final_state=True, chunk_size=CHUNK))]
        if fla is not None and fla.chunk_gated_delta_rule is not None:
            impls.append(("fla 0.6.0", common.call_fla_gdn(fla.chunk_gated_delta_rule, q, k, v, g, beta,
                                                           initial_state=S0, output_final_state=True)[0]))
        for name, fn in impls:
            eager = common.bench(fn)
            host = common.wall_us(fn, iters=iters, repeats=repeats, warmup=warmup, sync=lambda: None)
            common.synchronize(device)
            replay = graphed(fn)                      # None (reported) if fn cannot be captured
            dev = common.bench(replay) if replay is not None else float("nan")
            bound = "-" if dev != dev else "host" if host > dev * 1e3 else "device"
            rows.append({"case": f"B={B} T={T}", "impl": name, "eager us": eager * 1e3, "host us": host,
                         "device us": dev * 1e3, "bound by": bound})
        q = k = v = g = beta = S0 = impls = None
        torch.cuda.empty_cache()
    return rows


SERVING_CALLS = 300                      # serving_prefill_rows: calls per stream (more than any plan cache holds)


def serving_stream(calls: int = SERVING_CALLS, seed: int = 0, max_seqs: int = 8, max_len: int = 512) -> list:
    """A serving-like stream of varlen prefills whose shapes (nearly) never repeat: per call 1..max_seqs sequences
    of 1..max_len tokens each (a list of length lists)."""
    import random
    rng = random.Random(seed)
    return [[rng.randint(1, max_len) for _ in range(rng.randint(1, max_seqs))] for _ in range(calls)]


def serving_prefill_rows(device: str, calls: int = SERVING_CALLS, seed: int = 0) -> list:
    """Eager chunk forwards (and conv1d forwards: "conv1d" rows, D = 2 H K + HV V channels, W = 4, silu, the conv
    state in / out) as a server issues them: a stream of `calls` varlen prefills whose token and sequence
    counts change on every call (serving_stream), l2norm in the kernel, an initial state per sequence, the final
    states written, cu_seqlens with its host copy (vLLM's query_start_loc_cpu), inputs sliced from preallocated
    buffers. fast fuses the gating (A_log, dt_bias; beta given); fla takes g, so its call is fast.gdn_gating (g and
    beta in one launch, as vLLM's fused_gdn_gating) and then its op. Both run the stream once untimed (compiles,
    fla's autotuning), then again timed:
      wall us: per call, the stream back to back with one sync at its end (what the server waits);
      host us: per call, the same without the sync (the host's share: Python, checks, allocations, launches);
      device us: per call, the kernels' busy time (torch.profiler; the stream's first 40 calls).
    A stream whose host us exceeds its device us is host-bound: the server waits for the host. The timed passes
    run on one core (common.one_core)."""
    import fast
    fla = common.try_import_fla()
    stream = serving_stream(calls, seed)
    T_max = max(sum(x) for x in stream)
    N_max = max(len(x) for x in stream)
    q, k, v, g, beta, S0 = gdn_inputs(T_max, device, N_max, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    a, b = (torch.randn(1, T_max, HV, device=device, generator=gen).to(DTYPE) for _ in range(2))
    A_log = torch.rand(HV, device=device, generator=gen)
    dt_bias = torch.randn(HV, device=device, generator=gen)
    offs = [(cu_seqlens_of(lens, device), cu_seqlens_of(lens, "cpu"), sum(lens), len(lens)) for lens in stream]

    def fast_call(i):
        cu, cu_cpu, T, N = offs[i]
        return fast.chunk_gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], a[:, :T], beta[:, :T], initial_state=S0[:N],
                                           output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                           use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    D = 2 * H * K + HV * V                                      # the conv's channels: q | k | v
    x = torch.randn(1, T_max, D, device=device, generator=gen).to(DTYPE)
    cw = (torch.randn(D, CONV_W, device=device, generator=gen) / 2).to(DTYPE)
    c0 = torch.randn(N_max, D, CONV_W, device=device, generator=gen).to(DTYPE)    # (fla's conv state keeps W columns)

    def fast_conv(i):
        cu, cu_cpu, T, N = offs[i]
        return fast.causal_conv1d(x[:, :T], cw, None, "silu", initial_state=c0[:N, :, 1:], output_final_state=True,
                                  cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    impls = [("fast chunk", fast_call), ("fast conv1d", fast_conv)]
    if fla is not None and fla.causal_conv1d is not None:
        def fla_conv(i):
            cu, cu_cpu, T, N = offs[i]
            return fla.causal_conv1d(x[:, :T], cw, initial_state=c0[:N], output_final_state=True, activation="silu",
                                     cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        impls.append(("fla 0.6.0 conv1d", fla_conv))
    if fla is not None and fla.chunk_gated_delta_rule is not None:
        gate = fast.gdn_gating          # fla's op takes g: one gating launch first (vLLM's fused_gdn_gating)

        def fla_call(i):
            cu, cu_cpu, T, N = offs[i]
            gg, bb = gate(A_log, a[:, :T], dt_bias, b[:, :T])
            return fla.chunk_gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], gg, bb, initial_state=S0[:N],
                                              output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                              use_qk_l2norm_in_kernel=True)
        impls.append(("fla 0.6.0 chunk (+ fast.gdn_gating)", fla_call))
    mean_T = sum(o[2] for o in offs) / calls
    return [_stream_row(f"{calls} varlen prefills, 1-8 seqs of 1-512 tokens (mean {mean_T:.0f})", name, fn, calls,
                        device) for name, fn in impls]


def _stream_row(case: str, name: str, fn: Callable[[int], object], calls: int, device: str,
                reset: Optional[Callable[[], None]] = None) -> dict:
    """One row of a serving stream: fn(i) for i < calls run once untimed (compiles, autotuning), then timed on one
    core (common.one_core): host us (per call, back to back without a sync), wall us (per call, one sync at the
    end), device us (per call, the kernels' busy time over the first 40 calls, torch.profiler). reset(): run before
    each pass (e.g. a cache's contents restored), untimed."""
    def timed_pass(sync: bool) -> float:                       # us per call
        if reset is not None:
            reset()
        common.synchronize(device)
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        if sync:
            common.synchronize(device)
        return (time.perf_counter() - t0) / calls * 1e6

    for i in range(calls):
        fn(i)
    common.synchronize(device)
    with common.one_core():                                      # host-bound: one core
        host = timed_pass(False)
        # on the CPU nothing runs asynchronously: the synchronised pass would time the same work again
        wall = timed_pass(True) if device != "cpu" else host
    n_dev = min(40, calls)
    dev = (busy_ms(_kernel_spans(_profile(lambda: [fn(i) for i in range(n_dev)], 1))) * 1e3 / n_dev
           if device != "cpu" else float("nan"))                           # (no CUDA activity to profile)
    return {"case": case, "impl": name, "wall us": wall, "host us": host, "device us": dev,
            "bound by": "-" if dev != dev else "host" if host > dev else "device"}


def layer_prefill_rows(device: str, calls: int = SERVING_CALLS, seed: int = 0, shape: tuple = (H, HV, K, V),
                       max_len: int = 512, max_seqs: int = 8) -> list:
    """One GDN layer's prefill against a slot cache (conv + gating + l2norm + chunked delta rule, the slots' states
    read and written), over the serving stream (serving_stream: 1..max_seqs requests of 1..max_len tokens per call,
    random distinct slots of a 64-slot float32 cache, every other request continuing from its state), bf16:
      fast.gdn_prefill: one op; the conv and state kernels read and write the slots in place;
      fast ops + gather / scatter: the model's prefill before gdn_prefill (gdn_materialize, the states gathered with
        torch.where / indexing, fast.causal_conv1d and fast.chunk_gated_delta_rule, the finals scattered back);
      fla 0.6.0 chunk + gather / scatter: the same with fla's chunk op (g from fast.gdn_gating, as vLLM's
        fused_gdn_gating) in place of fast's (the conv stays fast's: fla's keeps W columns of state).
    Wall / host / device us per call as _stream_row's (cu_seqlens' host copy given to every op)."""
    import random

    import fast
    from conformance.cases_serving import make_cache
    Hh, HVv, Kk, Vv = shape
    fla = common.try_import_fla()
    stream = serving_stream(calls, seed, max_seqs=max_seqs, max_len=max_len)
    rng = random.Random(seed + 1)
    S_SLOTS = 64
    D = 2 * Hh * Kk + HVv * Vv
    T_max = max(sum(x) for x in stream)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T_max, D, device=device, generator=gen).to(DTYPE)
    a, b = (torch.randn(T_max, HVv, device=device, generator=gen).to(DTYPE) for _ in range(2))
    cw = (torch.randn(D, CONV_W, device=device, generator=gen) / 2).to(DTYPE)
    A_log = torch.rand(HVv, device=device, generator=gen)
    dt_bias = torch.randn(HVv, device=device, generator=gen)
    base = make_cache(S_SLOTS, Hh, HVv, Kk, Vv, CONV_W, seed=seed, state_dtype=torch.float32, act_dtype=DTYPE,
                      device=device)
    calls_in = []
    for lens in stream:
        slots = rng.sample(range(S_SLOTS), len(lens))
        calls_in.append((torch.tensor(slots, dtype=torch.int32, device=device), cu_seqlens_of(lens, device),
                         cu_seqlens_of(lens, "cpu"), sum(lens),
                         torch.tensor([n % 2 == 0 for n in range(len(lens))], device=device)))
    cache = base.clone()

    def reset():
        for f, g in zip(cache.tensors(), base.tensors()):
            f.copy_(g)

    def op(i):
        idx, cu, cu_cpu, T, has = calls_in[i]
        return fast.gdn_prefill(x[:T], a[:T], b[:T], cw, None, A_log, dt_bias, cache, idx, cu, has,
                                cu_seqlens_cpu=cu_cpu)

    def composed(chunk_op, gating: bool):
        def call(i):
            idx, cu, cu_cpu, T, has = calls_in[i]
            fast.gdn_materialize(cache, idx)
            sl = idx.long()
            h0 = torch.where(has[:, None, None, None], cache.ssm_state[sl], 0)
            c0 = torch.where(has[:, None, None], cache.conv_state[sl, :, :CONV_W - 1], 0).contiguous()
            y, cf = fast.causal_conv1d(x[None, :T], cw, None, "silu", initial_state=c0, output_final_state=True,
                                       cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
            y = y[0]
            q = y[:, :Hh * Kk].unflatten(1, (Hh, Kk))[None]
            k = y[:, Hh * Kk:2 * Hh * Kk].unflatten(1, (Hh, Kk))[None]
            v = y[:, 2 * Hh * Kk:].unflatten(1, (HVv, Vv))[None]
            if gating:
                g, beta = fast.gdn_gating(A_log, a[None, :T], dt_bias, b[None, :T])
                o, final = chunk_op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True)
            else:
                beta = torch.sigmoid(b[None, :T].float())
                o, final = chunk_op(q, k, v, a[None, :T], beta, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True, A_log=A_log,
                                    dt_bias=dt_bias)
            cache.ssm_state.index_copy_(0, sl, final.to(cache.ssm_state.dtype))
            cache.conv_state[sl, :, :CONV_W - 1] = cf
            return o
        return call

    impls = [("fast.gdn_prefill", op), ("fast ops + gather / scatter", composed(fast.chunk_gated_delta_rule, False))]
    if fla is not None and fla.chunk_gated_delta_rule is not None:
        impls.append(("fla 0.6.0 chunk + gather / scatter (+ fast conv, fast.gdn_gating)",
                      composed(fla.chunk_gated_delta_rule, True)))
    mean_T = sum(c[3] for c in calls_in) / calls
    case = (f"{calls} layer prefills, H={Hh} HV={HVv} K={Kk} V={Vv}, 1-{max_seqs} requests of 1-{max_len} tokens "
            f"(mean {mean_T:.0f})")
    return [_stream_row(case, name, fn, calls, device, reset) for name, fn in impls]


def run_sections(device: str = "cuda") -> list:
    """[(title, rows, meta)]: the main table, the T=65536 breakdown, the conv1d config sweep."""
    tflops = common.matmul_tflops(device)
    gbs = common.copy_bandwidth_gbs(device)
    print(f"ceilings: bf16 matmul {tflops:.0f} TFLOP/s, copy {gbs:.0f} GB/s (measured)", file=sys.stderr)
    meta = {"shape": f"H={H}, HV={HV}, K=V={K}, bf16 q/k/v/beta, fp32 g/state, chunk {CHUNK}",
            "ceiling (chunk rows)": f"bf16 8192^3 matmul, measured: {tflops:.0f} TFLOP/s",
            "ceiling (conv row)": f"device copy (read+write), measured: {gbs:.0f} GB/s",
            "FLOPs": "6CK + 4CV + 6KV + 2C^2/3 per token per value head (benchmarks/bench_prefill.py)",
            "conv bytes": "2 B x (read x + write y + weights)",
            "device ms": "how long the device ran the call's kernels (torch.profiler, mean of 5 calls): the union "
                         "of the kernels' intervals, whatever the host adds between them; kernels that run at once "
                         "(the B=1 pipeline's two streams, from T=16384) count once; fla/fast device is the ratio"}
    main = bench_chunk(device, tflops) + bench_conv(device, gbs)
    sections = [("Prefill: fast vs fla", main, meta)]
    sections.append((f"Prefill: per-kernel breakdown, chunk forward T={BREAKDOWN_T} (torch.profiler)",
                     kernel_breakdown(device), {"iterations averaged": 5}))
    sections.append((f"Prefill: per-kernel breakdown, varlen 16 seqs {VARLEN_TOTAL} tok with initial states "
                     "(torch.profiler)", kernel_breakdown(device, seq_lens=varlen_lengths()),
                     {"iterations averaged": 5, "lengths": str(varlen_lengths())}))
    sections.append((f"Prefill: conv1d config sweep T={CONV_T} D={CONV_D} (fastest 12)", conv_sweep(device, gbs),
                     {"ceiling": f"copy {gbs:.0f} GB/s"}))
    sections.append(("Prefill: error against the float64 truth (refgdn float64 on the same rounded inputs)",
                     error_rows(device), {"error": "relative to the truth, max-norm and Frobenius, mean over seeds 1-5 "
                                                   "(bf16 inputs, an initial state)"}))
    sections.append(("Prefill: host and device time per call (chunk forward)", host_rows(device),
                     {"host us": "back-to-back calls without a sync, per call", "device us": "CUDA graph replay"}))
    sections.append(("Prefill: a serving stream (token and sequence counts change every call)",
                     serving_prefill_rows(device), {"rows": "benchmarks.bench_prefill.serving_prefill_rows"}))
    sections.append(("Prefill: one GDN layer against a slot cache, a serving stream",
                     layer_prefill_rows(device), {"rows": "benchmarks.bench_prefill.layer_prefill_rows"}))
    return sections


def run() -> list:
    """The main prefill table's rows (the ``run() -> list[rows]`` interface shared with bench_decode)."""
    return run_sections()[0][1]


if __name__ == "__main__":
    from .__main__ import main
    sys.exit(main(["--only", "prefill"] + sys.argv[1:]))
