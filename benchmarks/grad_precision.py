"""What the backward's precision buys and costs: for each (grad_dot, recompute) precision pair of
fast.chunk_bwd (module comment there), the worst gradient-conformance ratio per family (the conformance
matrix's own gdn gradient cases and rule) and, on a GPU, the forward + backward time at bench_train's
shape. Used to choose GRAD_DOT_PRECISION / RECOMPUTE_PRECISION; the library's defaults are not changed
by this script except inside its own process (each variant is applied with unittest.mock.patch.object
around the cases, then restored).

    python -m benchmarks.grad_precision [--quick] [--dtype bfloat16] [--variants None/None,tf32/tf32/16-bit/forward]
        [--jobs N]

A variant is ``grad_dot/recompute[/16-bit]`` with ``None`` for 16-bit (e.g. ``None/tf32``: 16-bit products
with a gradient operand, fp32 recompute at tf32; ``tf32/tf32/16-bit``: the fp32 recompute's intermediates
stored in 16 bits, fast.chunk_bwd's RECOMPUTE_STORAGE). Output: one table, rows per family and variant, the worst
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

DEFAULT_VARIANTS = {"bfloat16": "None/None,tf32/None,None/tf32,tf32/tf32,tf32/tf32/16-bit",
                    "float16": "None/None,None/tf32x3,tf32x3/tf32x3,tf32x3/tf32x3/16-bit"}


def _parse(v: str):
    """"grad_dot/recompute[/16-bit[/forward[/stage:prec+stage:prec]]]" -> the precision tuple of
    fast.chunk_bwd.chunk_gated_delta_rule_bwd (storage None when not given; the fifth field: per-stage grad_dot
    precisions, e.g. "dh:None+dw:None", fast.chunk_bwd.STAGE_GRAD_DOT)."""
    parts = v.split("/")
    stages = {}
    if len(parts) > 4:
        for item in parts[4].split("+"):
            name, prec = item.split(":")
            stages[name] = None if prec == "None" else prec
        parts = parts[:4]
    parts = [None if x == "None" else x for x in parts]
    head = tuple(parts) if len(parts) >= 3 else (parts[0], parts[1], None)
    return head + (stages,) if stages else head


def _patched(dt: torch.dtype, pair):
    from fast import chunk_bwd as cb
    g = MappingProxyType({**cb.GRAD_DOT_PRECISION, dt: pair[0]})
    r = MappingProxyType({**cb.RECOMPUTE_PRECISION, dt: pair[1]})
    st = MappingProxyType({**cb.RECOMPUTE_STORAGE, dt: pair[2]})
    kk = MappingProxyType({**cb.RECOMPUTE_KKT, dt: pair[3] if len(pair) > 3 else "recompute"})
    sg = MappingProxyType({**cb.STAGE_GRAD_DOT, dt: MappingProxyType(pair[4] if len(pair) > 4 else {})})
    return mock.patch.multiple(cb, GRAD_DOT_PRECISION=g, RECOMPUTE_PRECISION=r, RECOMPUTE_STORAGE=st,
                               RECOMPUTE_KKT=kk, STAGE_GRAD_DOT=sg)


def _case_worst(dt: torch.dtype, pair, quick: bool, device: str, family: str, BT: int, rne: bool = False):
    """(family, worst ratio, where) of one gradient case of the matrix, run under the variant `pair`."""
    from conformance import cases_grad
    from conformance.core import evaluate
    if rne:
        from fast.utils import install_interpreter_bf16_round_to_nearest   # (fast first sets TRITON_INTERPRET)
        install_interpreter_bf16_round_to_nearest()
    p, _ = cases_grad._gdn_grad_families(quick)[family]
    case = cases_grad.gdn_grad_case(family, p, dt, BT, quick)
    try:
        with _patched(dt, pair):
            checks = case.run(device)
    except Exception as e:  # noqa: BLE001
        return family, float("inf"), f"{type(e).__name__}: {e}"[:80]
    worst = (-1.0, "")
    for c in checks:
        r = evaluate(c)["ratio"]
        if r > worst[0]:
            worst = (r, f"{c.name} BT{BT}")
    return (family, *worst)


def conformance_rows(dt: torch.dtype, pair, quick: bool, device: str, jobs: int = 1, rne: bool = False) -> list:
    """Worst ratio per family over the matrix's gdn gradient cases under `pair`; jobs > 1 runs the cases in
    that many fresh processes (spawned; each applies the variant itself: cold compiles are CPU-bound)."""
    from conformance import cases_grad
    todo = [(f, BT) for f, (_, sizes) in cases_grad._gdn_grad_families(quick).items() for BT in sizes]
    if jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
            results = list(ex.map(_case_worst, *zip(*[(dt, pair, quick, device, f, BT, rne) for f, BT in todo])))
    else:
        results = [_case_worst(dt, pair, quick, device, f, BT, rne) for f, BT in todo]
    worst = {}
    for f, r, w in results:
        if f not in worst or r > worst[f][0]:
            worst[f] = (r, w)
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
    ap.add_argument("--jobs", type=int, default=1, help="worker processes for the cases (spawned; default 1)")
    ap.add_argument("--interpreter-rne", action="store_true",
                    help="interpreter only: fp32 -> bf16 casts round to nearest even as on a GPU (see "
                         "fast.utils.install_interpreter_bf16_round_to_nearest, as conformance's bf16 cases run in "
                         "CI); the default keeps the interpreter's truncation")
    args = ap.parse_args(argv)
    if args.interpreter_rne:
        from fast.utils import install_interpreter_bf16_round_to_nearest   # (fast first sets TRITON_INTERPRET)
        install_interpreter_bf16_round_to_nearest()
    dt = getattr(torch, args.dtype)
    device = "cuda" if common.gpu_available() else "cpu"
    rows = []
    for v in (args.variants or DEFAULT_VARIANTS[args.dtype]).split(","):
        pair = _parse(v)
        t0 = time.perf_counter()
        fam = conformance_rows(dt, pair, args.quick, device, args.jobs, args.interpreter_rne)
        ms = time_ms(dt, pair) if device == "cuda" else None
        worst = max((r["ratio"] for r in fam), default=float("nan"))
        for r in fam:
            rows.append(dict(variant=v, **r))
        rows.append(dict(variant=v, family="(worst)", ratio=worst, where=f"{time.perf_counter() - t0:.0f} s",
                         passed="yes" if worst <= 1 else "NO", **{"fwd+bwd ms": ms}))
        print(common.format_table(rows[-len(fam) - 1:]), flush=True)
    interp = "cpu (interpreter" + (", bf16 casts round to nearest)" if args.interpreter_rne else ", bf16 casts truncate)")
    print(f"\ndevice: {common.device_name() if device == 'cuda' else interp} | {args.dtype} | "
          f"{'quick' if args.quick else 'full'} families")
    print(common.format_table([r for r in rows if r["family"] == "(worst)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
