"""What the backward's precision buys and costs: for each (grad_dot, recompute) precision pair of
fast.chunk_bwd (module comment there), the worst gradient-conformance ratio per family (the conformance
matrix's own gdn gradient cases and rule) and, on a GPU, the forward + backward time at bench_train's
shape. Used to choose GRAD_DOT_PRECISION / RECOMPUTE_PRECISION; the library's defaults are not changed
by this script except inside its own process (each variant is applied with unittest.mock.patch.object
around the cases, then restored).

    python -m benchmarks.grad_precision [--quick] [--dtype bfloat16] [--variants None/None,tf32/tf32]

A variant is ``grad_dot/recompute`` with ``None`` for 16-bit (e.g. ``None/tf32``: 16-bit products with
a gradient operand, fp32 recompute at tf32). Output: one table, rows per family and variant, the worst
ratio over that family's checks and chunk sizes (pass <= 1), which gradient it was, and the ms column.
"""
from __future__ import annotations

import argparse
import sys
import time
from types import MappingProxyType
from unittest import mock

import torch

from . import common

DEFAULT_VARIANTS = {"bfloat16": "None/None,tf32/None,None/tf32,tf32/tf32",
                    "float16": "None/None,None/tf32x3,tf32x3/tf32x3"}


def _parse(v: str):
    a, b = v.split("/")
    return (None if a == "None" else a, None if b == "None" else b)


def _patched(dt: torch.dtype, pair):
    from fast import chunk_bwd as cb
    g = MappingProxyType({**cb.GRAD_DOT_PRECISION, dt: pair[0]})
    r = MappingProxyType({**cb.RECOMPUTE_PRECISION, dt: pair[1]})
    return mock.patch.multiple(cb, GRAD_DOT_PRECISION=g, RECOMPUTE_PRECISION=r)


def conformance_rows(dt: torch.dtype, pair, quick: bool, device: str) -> list:
    from conformance import cases_grad
    from conformance.core import evaluate
    worst = {}
    cases = [cases_grad.gdn_grad_case(f, p, dt, BT, quick)
             for f, (p, sizes) in cases_grad._gdn_grad_families(quick).items() for BT in sizes]
    with _patched(dt, pair):
        for case in cases:
            try:
                checks = case.run(device)
            except Exception as e:  # noqa: BLE001
                worst[case.case] = (float("inf"), f"{type(e).__name__}: {e}"[:80])
                continue
            for c in checks:
                r = evaluate(c)["ratio"]
                if case.case not in worst or r > worst[case.case][0]:
                    worst[case.case] = (r, f"{c.name} BT{case.chunk_size}")
    return [dict(family=f, ratio=r, where=w, passed="yes" if r <= 1 else "NO") for f, (r, w) in worst.items()]


def time_ms(dt: torch.dtype, pair) -> float:
    from . import bench_train as bt
    if dt != bt.DTYPE:
        return None
    leaves, do = bt.inputs(bt.B, bt.T, bt.H, bt.HV, "cuda")
    ms, _ = bt._bench(bt._fwd_bwd(bt._fast_knob_call(precision=pair), leaves, do), leaves)
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.grad_precision", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CI-size gradient families (the interpreter's)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DEFAULT_VARIANTS))
    ap.add_argument("--variants", default=None, help="comma-separated grad_dot/recompute pairs")
    args = ap.parse_args(argv)
    dt = getattr(torch, args.dtype)
    device = "cuda" if common.gpu_available() else "cpu"
    rows = []
    for v in (args.variants or DEFAULT_VARIANTS[args.dtype]).split(","):
        pair = _parse(v)
        t0 = time.perf_counter()
        fam = conformance_rows(dt, pair, args.quick, device)
        ms = time_ms(dt, pair) if device == "cuda" else None
        worst = max((r["ratio"] for r in fam), default=float("nan"))
        for r in fam:
            rows.append(dict(variant=v, **r))
        rows.append(dict(variant=v, family="(worst)", ratio=worst, where=f"{time.perf_counter() - t0:.0f} s",
                         passed="yes" if worst <= 1 else "NO", **{"fwd+bwd ms": ms}))
        print(common.format_table(rows[-len(fam) - 1:]), flush=True)
    print(f"\ndevice: {common.device_name() if device == 'cuda' else 'cpu (interpreter)'} | {args.dtype} | "
          f"{'quick' if args.quick else 'full'} families")
    print(common.format_table([r for r in rows if r["family"] == "(worst)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
