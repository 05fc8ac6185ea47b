"""Decode and speculative-verify benchmarks at Qwen3-Next's shape: fast.serving vs fla, vs copy bandwidth.

Shape: H = 16 q/k heads, HV = 32 value heads, K = V = 128, conv width W = 4 over
D = 2*H*K + HV*V = 8192 channels, bfloat16 activations; ssm state float32 or bfloat16 in a slot
cache (slots picked by a random permutation, as a server's would be).

Rows:
  - decode, N = 1, 64, 256 requests, float32 and bfloat16 state: fast.gdn_decode (conv update +
    gating + l2norm + delta rule, in place in the slot cache), eager and replayed from a CUDA graph;
  - verify + accept, N = 256, k = 1, 3, 7 drafts: fast.gdn_verify then fast.gdn_accept with fixed
    random accept counts in [1, 1+k] (steady state: every verify first folds the previous round's
    accepted tokens, so the timed work includes the rollback); "vs decode" = time / decode time at
    N = 256 with the same state dtype (targets: <= 1.5, goal 1.15);
  - the peer, fla's fused_recurrent_gated_delta_rule (if installed) on the same sizes: q, k, v,
    g, beta precomputed (no conv, no gating), l2norm in kernel, initial state in, final state out
    (in place through ssm_state_indices when the installed version has vLLM-style arguments);
    for verify, fla runs the 1+k tokens per request with no rollback support at all.

State traffic (the floor of HBM bytes per step), per the issue:

    bytes = 2 * N*HV*K*V * elem(state)          read + write of every request's state
          + N*D*elem(act) * (2*(W-1) + k)       conv window read (W-1) + write (W-1+k columns)

fla's bytes: read initial state in its dtype + write the float32 final state (no conv). "% copy" =
(bytes / time) / measured device copy bandwidth (read + write, 1 GiB buffers). Target: decode
N = 256, float32 state >= 90 % (fla: 373 us, 69 % on an H200).

Device-side value checks (issue 8): every decode / verify checks its slot indices (range,
duplicates), offsets and the verify -> accept sequence on the device; there is no switch in the ops.
The second table measures what they cost: decode replayed from a CUDA graph with the checks (the op
as served) and with ``fast.serving._launch(..., checks=False)``, a benchmark-only argument that
skips the duplicate scan and the global offset loads in the same compiled kernel (valid inputs
only). Target: overhead < 2 % at N = 256 (the rows alternate on/off three times; medians).

``python -m benchmarks.bench_decode [--sweep] [--no-results]``: --sweep adds a table at N = 256 of launch
configs around the pinned ones (step kernel BV x num_warps, conv kernel BD; pinned marked *).
Per-kernel times: ``python -m benchmarks.profile_decode``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Callable, Optional

import torch

from . import common

H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V
ACT = torch.bfloat16
DECODE_NS = (1, 64, 256)
VERIFY_N, VERIFY_KS = 256, (1, 3, 7)
STATE_DTYPES = (torch.float32, torch.bfloat16)
TITLE = "Decode / speculative verify: fast vs fla"


def _elem(dtype) -> int:
    return dtype.itemsize


def _sname(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def traffic_bytes(N: int, k: int, state_dtype, act_dtype=ACT, shape=None) -> int:
    """State bytes of one step (formula in the module docstring)."""
    h, hv, kd, vd, w = shape or (H, HV, K, V, W)
    d = 2 * h * kd + hv * vd
    return 2 * N * hv * kd * vd * _elem(state_dtype) + N * d * _elem(act_dtype) * (2 * (w - 1) + k)


# ----------------------------------------------------------------------------------------------
# set-up
# ----------------------------------------------------------------------------------------------

def make_problem(N: int, k: int, state_dtype, device: str, shape=None, seed: int = 0):
    """A slot cache with 2N slots (random contents), a layer, and one step's inputs for N requests
    with 1 + k tokens each. Returns a dict of everything the callables below need."""
    from refgdn.serving import GDNStateCache

    h, hv, kd, vd, w = shape or (H, HV, K, V, W)
    d = 2 * h * kd + hv * vd
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    slots = 2 * N
    cache = GDNStateCache.allocate(slots, h, hv, kd, vd, w, max(k, 0), state_dtype, ACT, device)
    sgen = torch.Generator(device=device).manual_seed(seed)    # the states drawn where they live (a CPU draw of a
    cache.ssm_state.copy_((0.1 * torch.randn(cache.ssm_state.shape, generator=sgen, device=device)).to(state_dtype))
    # large pool took seconds per layer of a 32-layer benchmark)
    cache.conv_state.copy_(rnd(*cache.conv_state.shape).to(ACT))
    T = N * (1 + k)
    p = dict(
        cache=cache, N=N, k=k, T=T,
        idx=torch.randperm(slots, generator=gen)[:N].to(torch.int32).to(device),
        x=rnd(T, d).to(device=device, dtype=ACT),
        a=rnd(T, hv).to(device=device, dtype=ACT),
        b=rnd(T, hv).to(device=device, dtype=ACT),
        conv_weight=(rnd(d, w) / w ** 0.5).to(device=device, dtype=ACT),
        conv_bias=(0.1 * rnd(d)).to(device=device, dtype=ACT),
        A_log=(torch.rand(hv, generator=gen) * 2 - 1).to(device),
        dt_bias=(0.5 * rnd(hv)).to(device),
        cu=torch.arange(0, T + 1, 1 + k, dtype=torch.int32).to(device),
        acc=(1 + torch.randint(0, k + 1, (N,), generator=gen)).to(torch.int32).to(device),
        shape=(h, hv, kd, vd, w),
    )
    return p


def fast_decode_fn(p) -> Callable[[], object]:
    import fast.serving as fs

    args = (p["x"], p["a"], p["b"], p["conv_weight"], p["conv_bias"], p["A_log"], p["dt_bias"], p["cache"], p["idx"])
    return lambda: fs.gdn_decode(*args)


def fast_verify_fn(p) -> Callable[[], object]:
    import fast.serving as fs

    args = (p["x"], p["a"], p["b"], p["conv_weight"], p["conv_bias"], p["A_log"], p["dt_bias"], p["cache"], p["idx"],
            p["cu"])

    def step():
        o = fs.gdn_verify(*args)
        fs.gdn_accept(p["cache"], p["idx"], p["acc"])
        return o
    return step


def fast_decode_unchecked_fn(p) -> Callable[[], object]:
    """fast_decode_fn without the device-side value checks (benchmark-only: fast.serving._launch checks=False)."""
    import fast.serving as fs

    args = (p["x"], p["a"], p["b"], p["conv_weight"], p["conv_bias"], p["A_log"], p["dt_bias"], p["cache"], p["idx"])
    return lambda: fs._launch(*args, None, None, "silu", "decode", checks=False)


def fast_step_fn(p) -> Callable[[], object]:
    """fast_decode_fn for a problem with k = 0, else fast_verify_fn."""
    return fast_decode_fn(p) if p["k"] == 0 else fast_verify_fn(p)


@contextlib.contextmanager
def launch_overrides(step: Optional[dict] = None, conv: Optional[dict] = None):
    """For the block, fast.serving's pinned configs with the keys of `step` / `conv` put over them: the
    library's step_config / conv_config are wrapped (their ``override`` argument) and restored after,
    errors too. The launchers and fast.keys look the functions up at call time, so both see the sweep's
    config. Benchmark sweeps only; never while graphs are captured (a new config is a new variant)."""
    import fast.serving as fs

    orig_step, orig_conv = fs.step_config, fs.conv_config
    fs.step_config = functools.partial(orig_step, override=step)
    fs.conv_config = functools.partial(orig_conv, override=conv)
    try:
        yield
    finally:
        fs.step_config, fs.conv_config = orig_step, orig_conv


def graph_time(fn: Callable[[], object], device: str) -> tuple:
    """(ms, note): fn replayed from a CUDA graph on a GPU (eager if capture fails or on CPU)."""
    g = graphed(fn) if device.startswith("cuda") else None
    return common.bench(g or fn), "CUDA graph" if g is not None else "eager"


def graphed(fn: Callable[[], object]) -> Optional[Callable[[], object]]:
    """fn captured in a CUDA graph (after two eager warmup calls on a side stream), or None."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay
    except Exception as e:  # noqa: BLE001 - report, don't crash the table
        print(f"bench_decode: CUDA graph capture failed: {e!r}", file=sys.stderr)
        return None


def _by_keyword(fn: Callable) -> Callable:
    """fn with g and beta passed by keyword: newer fla signatures put gk, gv between g and beta."""
    def call(q, k, v, g, beta, **kw):
        return fn(q, k, v, g=g, beta=beta, **kw)
    call.__qualname__ = getattr(fn, "__qualname__", "fla_op") + "[by keyword]"  # the GVA probe's cache key
    return call


def step_inputs(p) -> tuple:
    """The step's q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV] (contiguous): the conv's inputs taken as its
    outputs (no conv), the gating applied (refgdn.gdn_gating), as a recurrent op without conv and gating takes them."""
    from einops import rearrange

    import refgdn

    h, hv, kd, vd, w = p["shape"]
    q = rearrange(p["x"][:, :h * kd], "t (h d) -> 1 t h d", h=h).contiguous()
    kk = rearrange(p["x"][:, h * kd:2 * h * kd], "t (h d) -> 1 t h d", h=h).contiguous()
    v = rearrange(p["x"][:, 2 * h * kd:], "t (h d) -> 1 t h d", h=hv).contiguous()
    g, beta = refgdn.gdn_gating(p["A_log"], p["a"], p["dt_bias"], p["b"])
    return q, kk, v, g[None].contiguous(), beta[None].contiguous()


def fla_fn(p, fla) -> tuple:
    """fla's fused recurrent op on the same step (q, k, v, g, beta precomputed). Returns (fn, bytes, note)."""
    from einops import rearrange

    h, hv, kd, vd, w = p["shape"]
    N, k = p["N"], p["k"]
    fn = fla.fused_recurrent_gated_delta_rule
    q, kk, v, g, beta = step_inputs(p)
    state = p["cache"].ssm_state
    params = inspect.signature(fn).parameters
    kw = dict(use_qk_l2norm_in_kernel=True)
    note = "fla: no conv/gating; "
    if "ssm_state_indices" in params:  # vLLM-style continuous batching: in place in the slot cache
        kw.update(initial_state=state, ssm_state_indices=p["idx"].long())
        if "inplace_final_state" in params:
            kw["inplace_final_state"] = True
        out_bytes = 2 * N * hv * kd * vd * state.element_size()
        note += "in place via ssm_state_indices"
    else:
        h0 = state[p["idx"].long()].contiguous()
        kw.update(initial_state=h0, output_final_state=True)
        out_bytes = N * hv * kd * vd * (state.element_size() + 4)
        note += "gathered initial state, fp32 final state out"
    if k > 0 or "ssm_state_indices" in params:
        kw["cu_seqlens"] = p["cu"].long()
    else:  # plain decode: N sequences of one token, dense layout
        q, kk, v = (rearrange(t, "1 (n t) h d -> n t h d", n=N) for t in (q, kk, v))
        g, beta = (rearrange(t, "1 (n t) h -> n t h", n=N) for t in (g, beta))
    call, extra = common.call_fla_gdn(_by_keyword(fn), q, kk, v, g, beta, **kw)
    return call, out_bytes, note + (f"; {extra}" if extra else "")


# ----------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------

def _row(op, impl, N, k, sdt, ms, nbytes, gbs, **extra):
    us = ms * 1e3
    rate = nbytes / (ms * 1e-3) / 1e9
    r = dict(op=op, impl=impl, N=N, k=k, state=_sname(sdt), us=us, **{"GB/s": rate, "% copy": 100 * rate / gbs})
    r.update(extra)
    return r


def bench_main(device: str = "cuda", shape=None) -> list:
    gbs = common.copy_bandwidth_gbs(device) if device.startswith("cuda") else float("nan")
    fla = common.try_import_fla()
    fla_ok = fla is not None and fla.fused_recurrent_gated_delta_rule is not None
    on_gpu = device.startswith("cuda")
    rows, decode_us = [], {}
    for sdt in STATE_DTYPES:
        for N in DECODE_NS:
            p = make_problem(N, 0, sdt, device, shape)
            nbytes = traffic_bytes(N, 0, sdt, shape=p["shape"])
            fn = fast_decode_fn(p)
            ms = common.bench(fn)
            decode_us[(N, sdt)] = ms * 1e3
            rows.append(_row("decode", "fast", N, 0, sdt, ms, nbytes, gbs, note="eager"))
            g = graphed(fn) if on_gpu else None
            if g is not None:
                rows.append(_row("decode", "fast", N, 0, sdt, common.bench(g), nbytes, gbs, note="CUDA graph"))
            if fla_ok:
                try:
                    call, fb, note = fla_fn(p, fla)
                    rows.append(_row("decode", f"fla {fla.version}", N, 0, sdt, common.bench(call), fb, gbs, note=note))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(op="decode", impl="fla", N=N, k=0, state=_sname(sdt), note=f"failed: {e!r}"[:120]))
            del p
    for sdt in STATE_DTYPES:
        for k in VERIFY_KS:
            N = VERIFY_N
            p = make_problem(N, k, sdt, device, shape)
            nbytes = traffic_bytes(N, k, sdt, shape=p["shape"])
            fn = fast_verify_fn(p)
            ms = common.bench(fn)
            base = decode_us.get((N, sdt))
            rows.append(_row("verify+accept", "fast", N, k, sdt, ms, nbytes, gbs, note="eager",
                             **{"vs decode": ms * 1e3 / base if base else None}))
            g = graphed(fn) if on_gpu else None
            if g is not None:
                gms = common.bench(g)
                rows.append(_row("verify+accept", "fast", N, k, sdt, gms, nbytes, gbs, note="CUDA graph",
                                 **{"vs decode": gms * 1e3 / base if base else None}))
            if fla_ok:
                try:
                    call, fb, note = fla_fn(p, fla)
                    rows.append(_row("verify (no rollback)", f"fla {fla.version}", N, k, sdt, common.bench(call), fb,
                                     gbs, note=note))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(op="verify", impl="fla", N=N, k=k, state=_sname(sdt), note=f"failed: {e!r}"[:120]))
            del p
    return rows


CHECK_TITLE = "Decode: cost of the device-side value checks"


def check_cost(device: str = "cuda", shape=None, Ns=(1, 256)) -> list:
    """Decode with the value checks (as served) vs without (benchmark-only), CUDA graphs, alternating
    on / off three times per row; medians. Overhead = on / off - 1 (target < 2 % at N = 256)."""
    import statistics

    gbs = common.copy_bandwidth_gbs(device) if device.startswith("cuda") else float("nan")
    rows = []
    for sdt in STATE_DTYPES:
        for N in Ns:
            p = make_problem(N, 0, sdt, device, shape)
            nbytes = traffic_bytes(N, 0, sdt, shape=p["shape"])
            fns = {"on": fast_decode_fn(p), "off": fast_decode_unchecked_fn(p)}
            reps = {name: (graphed(fn) if device.startswith("cuda") else None) or fn for name, fn in fns.items()}
            times = {"on": [], "off": []}
            for _ in range(3):
                for name in ("on", "off"):
                    times[name].append(common.bench(reps[name]))
            on, off = statistics.median(times["on"]), statistics.median(times["off"])
            p["cache"].check()                       # the benchmark's inputs are valid: nothing recorded
            rows.append(_row("decode", "fast", N, 0, sdt, on, nbytes, gbs, **{
                "us without checks": off * 1e3, "overhead %": 100 * (on / off - 1),
                "target": ("< 2 %: " + ("met" if on / off - 1 < 0.02 else "MISSED")) if N == 256 else ""}))
            del p
    return rows


def config_sweep(device: str = "cuda", shape=None) -> list:
    """Launch configs at N = 256, timed from CUDA graphs: the step kernel's (BV, num_warps) and the
    conv kernel's channels per program (BD), for decode (float32 state) and verify + accept (k = 3).
    The pinned config (fast.serving.step_config / conv_config) is marked *."""
    import fast.serving as fs

    gbs = common.copy_bandwidth_gbs(device) if device.startswith("cuda") else float("nan")
    N = VERIFY_N
    h, hv, kd, vd, w = shape or (H, HV, K, V, W)
    pinned_bd = fs.conv_config(2 * h * kd + hv * vd, w)["BD"]
    plan = [(0, [(64, 4, 256), (32, 2, 256), (64, 8, 256), (128, 8, 256), (64, 4, 512)]),
            (3, [(32, 1, 256), (16, 1, 256), (32, 2, 256), (64, 2, 256), (32, 1, 512)])]
    rows = []
    for k, cfgs in plan:
        mode = "decode" if k == 0 else "verify"
        pinned = fs.step_config(kd, vd, torch.float32, mode=mode)
        p = make_problem(N, k, torch.float32, device, shape)
        nbytes = traffic_bytes(N, k, torch.float32, shape=p["shape"])
        for BV, nw, BD in cfgs:
            with launch_overrides(dict(BV=BV, num_warps=nw), dict(BD=BD)):
                ms, note = graph_time(fast_step_fn(p), device)
            star = (BV, nw, BD) == (pinned["BV"], pinned["num_warps"], pinned_bd)
            rows.append(_row(mode if k == 0 else "verify+accept", "fast", N, k, torch.float32, ms, nbytes, gbs,
                             BV=BV, warps=nw, conv_BD=BD, default="*" if star else "", note=note))
        del p
    return rows


META = {"shape": f"H={H}, HV={HV}, K=V={K}, W={W}, D={D}, bf16 activations",
        "bytes": "2*N*HV*K*V*elem(state) + N*D*2B*(2*(W-1)+k) (fast); fla: state in + fp32 state out",
        "ceiling": "device copy bandwidth (read+write, 1 GiB), measured in the same process",
        "targets": "decode N=256 fp32 >= 90% copy; verify+accept N=256 k=3 <= 1.5x (goal 1.15x) decode"}


def run_sections(device: str = "cuda", sweep: bool = False) -> list:
    meta = dict(META)
    if device.startswith("cuda"):
        meta["copy bandwidth"] = f"{common.copy_bandwidth_gbs(device):.0f} GB/s"
    sections = [(TITLE, bench_main(device), meta),
                (CHECK_TITLE, check_cost(device), {"what": "decode with the device-side value checks (as served) "
                                                          "vs fast.serving._launch(checks=False) (benchmark-only), "
                                                          "CUDA-graph replay, medians of 3 alternating runs"})]
    if sweep:
        sections.append(("Decode / verify: launch config sweep, N=256, fp32 state", config_sweep(device), {}))
    return sections


def run() -> list:
    """The main decode/verify table's rows."""
    return bench_main("cuda")


if __name__ == "__main__":
    if not common.gpu_available():
        print("bench_decode: a CUDA GPU is needed (none found, or TRITON_INTERPRET=1); nothing to do.")
        sys.exit(0)
    sweep = "--sweep" in sys.argv
    v = common.versions()
    print(f"device: {common.device_name()} | torch {v['torch']} | triton {v['triton']} | fla {v['fla']}")
    for title, rows, meta in run_sections("cuda", sweep=sweep):
        print(f"\n## {title}\n")
        for k_, v_ in meta.items():
            print(f"- {k_}: {v_}")
        print(common.format_table(rows))
        if "--no-results" not in sys.argv:
            common.append_results(title, rows, meta)
