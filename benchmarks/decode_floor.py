"""What bounds the small-batch decode step (issue 10, N = 8 under a graph): floors beside the step, per layer
of a 32-layer CUDA graph at Qwen3-Next's shape (HV = 32, K = V = 128, float32 state), GPU only.

Rows, each per layer of one graph of 32 layers on distinct buffers (state out of L2, as in bench_graphs):

1. ``torch mul_``: the N requests' state ``[N, HV, K, V]`` scaled in place by torch's elementwise kernel: the
   read + write of the same bytes with nothing else, torch's own launch geometry.
2. ``rmw BV/w``: a Triton kernel with the step's geometry (grid (V / BV, HV, N), a ``[K, BV]`` block per
   program in ``w`` warps) that loads the block and stores it scaled: the step's traffic in the step's
   programs, without its arithmetic, inputs or conv.
3. ``delta BV/w``: the same programs with one token's delta rule on the block (u = sum_k S k, S <- d S + k u^T,
   o = S^T q stored): the step's dependent reductions, without its gating, checks or conv; once more with each
   request's block found through a slot index loaded first (the step's state_indices).
4. ``step kernel alone``: fast's gdn_step_kernel relaunched on a fixed conv snapshot (no conv kernel).
5. ``step (pinned: conv + step)``: fast.gdn_decode as served; then with the device value checks off
   (benchmark-only ``fast.serving._launch(checks=False)``), and under each step_config override of ``extra``
   (conv + step, and the step kernel alone).

bytes = 2 * N * HV * K * V * 4 (state read + write); GB/s = bytes / time.

Run: python -m benchmarks.decode_floor [--batches 1,8] [--all-configs]   (prints; appends nothing to RESULTS.md)
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks import common
from fast.launch import launch
from benchmarks.bench_graphs import LAYERS, fast_call, per_layer_us

HV, K, V = 32, 128, 128
CONFIGS = [(16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4)]


@triton.jit
def _rmw_kernel(s, q, o, idx, d, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr,
                INDIRECT: tl.constexpr = False):
    """One [K, BV] block of s[n, hv] (contiguous [N, HV, K, V]): s <- d s (DELTA: one delta-rule token).
    INDIRECT: request n's block is at row idx[n] (a slot index loaded first, as the step's state_indices)."""
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if INDIRECT:
        i_n = tl.load(idx + i_n)
    nh = i_n * tl.num_programs(1) + i_hv
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p = s + nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p)
    if DELTA:
        b_q = tl.load(q + nh * K + o_k)
        b_k = b_q * 0.5
        b_u = tl.sum(b_s * b_k[:, None], axis=0)
        b_s = b_s * d + b_k[:, None] * b_u[None, :]
        tl.store(o + nh * V + o_v, tl.sum(b_s * b_q[:, None], axis=0))
    else:
        b_s = b_s * d
    tl.store(p, b_s)


def _rmw_call(N: int, BV: int, warps: int, delta: bool, indirect: bool = False):
    def make(seed):
        s = torch.randn(N, HV, K, V, device="cuda") * 0.01
        q = torch.randn(N, HV, K, device="cuda") * 0.01
        o = torch.empty(N, HV, V, device="cuda")
        idx = torch.randperm(N, device="cuda").to(torch.int32)
        grid = (V // BV, HV, N)
        kw = dict(K=K, V=V, BV=BV, DELTA=delta, INDIRECT=indirect, num_warps=warps)
        return lambda: launch(_rmw_kernel, grid, kw, s, q, o, idx, 0.999)
    return make


def _torch_call(N: int):
    def make(seed):
        s = torch.randn(N, HV, K, V, device="cuda")
        return lambda: s.mul_(0.999)
    return make


def _step_alone(N: int):
    """gdn_step_kernel relaunched on one conv snapshot (the conv kernel runs once, before capture)."""
    import fast.serving as fs
    from benchmarks.bench_decode import make_problem

    def make(seed):
        pr = make_problem(N, 0, torch.float32, "cuda", seed=seed)
        args = (pr["x"], pr["a"], pr["b"], pr["conv_weight"], pr["conv_bias"], pr["A_log"], pr["dt_bias"],
                pr["cache"], pr["idx"])
        plan = fs._build_plan(*args, None, "silu", "decode")
        cache = pr["cache"]
        scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device="cuda")
        y = fs.Carved(scratch, 0, plan.act_dtype, plan.y_shape)
        snap = fs.Carved(scratch, plan.snap_offset, torch.int32, (N, 5))
        plan.conv_launch(pr["x"], pr["conv_weight"], pr["conv_bias"], y, cache.conv_state, cache.pend_meta, snap,
                         cache.err, pr["idx"], pr["idx"], *plan.conv_args)
        o = torch.empty(plan.o_shape, dtype=plan.act_dtype, device="cuda")

        def step():
            plan.step_launch(y, pr["a"], pr["b"], pr["A_log"], pr["dt_bias"], o, cache.ssm_state, cache.pend_k,
                             cache.pend_v, cache.pend_g, cache.pend_beta, cache.pend_meta, snap, pr["idx"],
                             plan.scale, *plan.step_args)
        return step                          # (y and snap hold the scratch: Carved keeps its base tensor)
    return make


def _unchecked(N: int, seed: int):
    from benchmarks.bench_decode import fast_decode_unchecked_fn, make_problem
    return fast_decode_unchecked_fn(make_problem(N, 0, torch.float32, "cuda", seed=seed))


EXTRA = (dict(fold=False), dict(BV=16, HPP=2))    # step_config keys tried beside the pinned step


def rows(batches=(1, 8), all_configs: bool = False, extra=EXTRA) -> list:
    """The table; all_configs: the RMW and delta rows at every (BV, warps) of CONFIGS (else BV 32, one warp: the
    step's config at N = 8); extra: step_config overrides timed beside the pinned step (conv + step and alone)."""
    from benchmarks.bench_decode import launch_overrides
    out = []
    for N in batches:
        nbytes = 2 * N * HV * K * V * 4

        def add(what, make):
            try:
                us = per_layer_us(make)
            except Exception as e:  # noqa: BLE001 - a row that does not run is reported
                print(f"decode_floor: {what} N={N}: {e!r}")
                us = float("nan")
            out.append(dict(what=what, N=N, us=us, **{"GB/s": nbytes / (us * 1e-6) / 1e9}))
        add("torch mul_", _torch_call(N))
        configs = CONFIGS if all_configs else [(32, 1)]
        for BV, w in configs:
            add(f"rmw BV{BV}/w{w}", _rmw_call(N, BV, w, False))
        for BV, w in configs:
            add(f"delta BV{BV}/w{w}", _rmw_call(N, BV, w, True))
        add("delta BV32/w1, slot index loaded first", _rmw_call(N, 32, 1, True, True))
        add("step kernel alone (pinned config)", _step_alone(N))
        add("step (pinned: conv + step)", lambda i: fast_call(N, i))
        add("step, device value checks off", lambda i: _unchecked(N, i))
        for over in extra:
            with launch_overrides(step=over):
                add(f"step, {over}", lambda i: fast_call(N, i))
                add(f"step kernel alone, {over}", _step_alone(N))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--all-configs", action="store_true", help="RMW and delta rows at every (BV, warps) of CONFIGS")
    a = ap.parse_args(argv)
    if not common.gpu_available():
        print("decode_floor: needs a GPU")
        return
    r = rows(tuple(int(x) for x in a.batches.split(",")), a.all_configs)
    print(f"{common.device_name()} | torch {torch.__version__} | triton {triton.__version__} | {LAYERS} layers")
    print(common.format_table(r))


if __name__ == "__main__":
    main()
