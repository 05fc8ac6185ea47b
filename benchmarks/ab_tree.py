"""Same-process A/B of the chunked forward between this tree's ``fast`` and another revision's.

A structural kernel change (new arguments, a new kernel) cannot be switched by a benchmark knob, and timings
from two device calls may come from two machines. This puts a committed revision's ``fast`` package beside
this tree's, importable as ``fast_base`` (``fast`` uses only relative imports, and refgdn comes from this tree),
and times both forwards alternately in one process on the same inputs: device time from a CUDA graph's
replay (do_bench), eager time (do_bench), and the largest difference between the two outputs.

Two steps, since the device machine gets the working tree but not necessarily the git history:

    python -m benchmarks.ab_tree prepare main          # here: writes ab_base/fast_base/ (untracked: it travels)
    python -m benchmarks.ab_tree run [--l2norm]        # on the GPU machine: the table

``ab_base/`` is what ``prepare`` writes; delete it when done (it is not ignored, so that a device run carries it).
Use a process of its own: importing the second copy registers fast's torch.library ops again under the same names.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import torch

BASE_DIR = "ab_base"          # relative to the repository root
BASE_NAME = "fast_base"
CASES = {"B=4 T=4096": (4, 4096), "varlen16": (1, None), "B=1 T=16384": (1, 16384),   # name: (B, T or varlen)
         "B=1 T=4096": (1, 4096), "B=1 T=65536": (1, 65536)}


def prepare(rev: str, repo: str = ".", dest: str = BASE_DIR) -> str:
    """Extract revision ``rev``'s ``fast/`` (of the git repository ``repo``) as ``<dest>/fast_base/``; returns that
    path. ``dest`` is emptied first."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    with tempfile.TemporaryDirectory() as tmp:
        tar = os.path.join(tmp, "fast.tar")
        subprocess.run(["git", "-C", repo, "archive", "-o", tar, rev, "fast"], check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp)
        shutil.move(os.path.join(tmp, "fast"), os.path.join(dest, BASE_NAME))
    with open(os.path.join(dest, "REVISION"), "w") as f:
        rev_id = subprocess.run(["git", "-C", repo, "rev-parse", "--short", rev], capture_output=True, text=True)
        f.write(f"{rev} {rev_id.stdout.strip()}\n")
    return os.path.join(dest, BASE_NAME)


def load_base(dest: str = BASE_DIR):
    """The prepared revision's package (``fast_base``, from ``dest``) and its revision line."""
    path = os.path.abspath(dest)
    if not os.path.isdir(os.path.join(path, BASE_NAME)):
        raise FileNotFoundError(f"{path}/{BASE_NAME} missing: run `python -m benchmarks.ab_tree prepare REV` first")
    if path not in sys.path:
        sys.path.insert(0, path)
    with open(os.path.join(path, "REVISION")) as f:
        return importlib.import_module(BASE_NAME), f.read().strip()


def case_inputs(name: str, device: str, l2norm: bool = False):
    """(q, k, v, g, beta, keyword arguments) of one of CASES, as the prefill table builds its case
    (bench_prefill.chunk_case_inputs; T None: its 16-sequence varlen mix)."""
    from .bench_prefill import VARLEN_TOTAL, chunk_case_inputs, varlen_lengths
    B, T = CASES[name]
    lens = None if T else varlen_lengths()
    return chunk_case_inputs(T or VARLEN_TOTAL, lens, B, device, l2norm=l2norm)


def run(cases=CASES, l2norm: bool = False, reps: int = 2, device: str = "cuda") -> list:
    """Rows per case and tree (base, this tree, alternating ``reps`` times): device ms (graph replay; nan for varlen,
    whose host work cannot be captured), eager ms, busy ms (torch.profiler: the union of the call's kernel
    intervals, varlen included), each kernel's mean device us per call, and the largest |o_base - o_this| of the
    case."""
    from . import common
    from .bench_decode import graphed
    from .bench_prefill import _kernel_times, device_ms
    import fast
    base, rev = load_base()
    trees = (("base " + rev, base.chunk.chunk_gated_delta_rule_fwd), ("this tree", fast.chunk.chunk_gated_delta_rule_fwd))
    rows = []
    for name in cases:
        q, k, v, g, beta, kw = case_inputs(name, device, l2norm)
        outs = {}
        for _ in range(reps):
            for tag, fwd in trees:
                def fn():
                    return fwd(q, k, v, g, beta, chunk_size=64, **kw)
                outs.setdefault(tag, fn()[0].float())
                replay = graphed(fn) if "cu_seqlens" not in kw else None
                kernels = _kernel_times(fn, 5)
                rows.append(dict(case=name + (", l2norm" if l2norm else ""), tree=tag,
                                 **{"device ms": common.bench(replay) if replay is not None else float("nan"),
                                    "eager ms": common.bench(fn), "busy ms": device_ms(fn),
                                    "kernels us": {n[:24]: round(t * 1e3, 1) for n, t, _ in kernels}}))
                print(rows[-1], flush=True)
        a, b = outs.values()
        rows.append(dict(case=name, tree="outputs", **{"max |o_base - o_this|": (a - b).abs().max().item(),
                                                       "max |o_base|": a.abs().max().item()}))
        print(rows[-1], flush=True)
        del q, k, v, g, beta, kw
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="extract a revision's fast/ as ab_base/fast_base")
    p.add_argument("rev")
    r = sub.add_parser("run", help="time both trees' forwards in this process (GPU)")
    r.add_argument("--l2norm", action="store_true", help="use_qk_l2norm_in_kernel=True in both")
    r.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.rev))
        return 0
    run(cases=tuple(c.strip() for c in args.cases.split(",")), l2norm=args.l2norm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
