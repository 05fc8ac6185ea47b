"""Where decode / verify time goes: per-kernel device times (torch.profiler) and the CUDA-graph step
time for launch-config variants of fast.serving at Qwen3-Next's shape, N = 256.

    python -m benchmarks.profile_decode

Per variant: "graph us" = one step replayed from a CUDA graph (benchmarks.common.bench), "% copy"
= bench_decode.traffic_bytes / time / measured copy bandwidth, then each kernel's mean device time
over 20 eager steps. Variants are (step, conv) config-override pairs (bench_decode.launch_overrides), and
one decode row without the device-side value checks (benchmark-only ``fast.serving._launch(checks=False)``:
the conv kernel's share of the checks' cost; bench_decode's second table times the whole step).
"""
from __future__ import annotations

import sys
from collections import defaultdict

import torch

from . import bench_decode as bd
from . import common

TITLE = "Decode / verify: where the time goes (N=256)"

VARIANTS = {  # (k, state dtype): [(step override, conv override[, value checks]), ...]
    (0, torch.float32): [({}, {}), ({}, {}, False), ({}, {"BD": 512}), ({}, {"BD": 128})],
    (0, torch.bfloat16): [({}, {})],
    (3, torch.float32): [({}, {})],
    (3, torch.bfloat16): [({}, {})],
}


def kernel_times(fn, steps: int = 20) -> dict:
    """Mean device time per kernel name (us) over ``steps`` eager calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name] += ev.device_time / steps
    return dict(out)


def main() -> list:
    gbs = common.copy_bandwidth_gbs("cuda")
    rows = []
    for (k, sdt), variants in VARIANTS.items():
        p = bd.make_problem(bd.VERIFY_N, k, sdt, "cuda")
        nbytes = bd.traffic_bytes(bd.VERIFY_N, k, sdt)
        for variant in variants:
            ov, cov, checks = (tuple(variant) + (True,))[:3]
            with bd.launch_overrides(dict(ov), dict(cov)):
                fn = bd.fast_step_fn(p) if checks else bd.fast_decode_unchecked_fn(p)
                ms, _ = bd.graph_time(fn, "cuda")
                kt = kernel_times(fn)
            row = dict(op="decode" if k == 0 else f"verify+accept k={k}", state=bd._sname(sdt),
                       variant=",".join(f"{a}={b}" for a, b in {**ov, **{"conv." + c: d for c, d in cov.items()}}.items())
                       or "pinned",
                       checks="on" if checks else "off (benchmark-only)",
                       **{"graph us": ms * 1e3, "% copy": 100 * nbytes / (ms * 1e-3) / 1e9 / gbs})
            for name, us in sorted(kt.items(), key=lambda kv: -kv[1]):
                row[name.split("(")[0][:24]] = us
            rows.append(row)
            print(common.format_table([row]), file=sys.stderr, flush=True)
        del p
    return rows


if __name__ == "__main__":
    if not common.gpu_available():
        print("profile_decode: a CUDA GPU is needed; nothing to do.")
        sys.exit(0)
    v = common.versions()
    print(f"device: {common.device_name()} | torch {v['torch']} | triton {v['triton']}")
    rows = main()
    meta = {"what": "per-kernel mean device time (us) over 20 eager steps (torch.profiler); graph us = one "
                    "step replayed from a CUDA graph; % copy as in the decode table",
            "copy bandwidth": f"{common.copy_bandwidth_gbs('cuda'):.0f} GB/s"}
    print(common.format_table(rows))
    if "--no-results" not in sys.argv:
        common.append_results(TITLE, rows, meta)
