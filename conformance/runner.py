"""The conformance runner behind ``python -m conformance``.

    python -m conformance [--quick | --full] [--device cpu|cuda] [--json PATH] [--ops a,b] [--cases SUBSTR] [--jobs N]

Collects Cases from ``conformance.cases_prefill`` and (when present) ``conformance.cases_serving``,
runs each on the device, applies ``conformance.core.evaluate`` to every Check, shows a progress
bar on stderr, prints a summary table, writes a JSON report (one record per Check) and returns a
non-zero exit status on any failure. A case that raises is recorded as a failed record carrying
the exception's message; the run goes on.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Iterable, Optional

CASE_MODULES = ("conformance.cases_prefill", "conformance.cases_serving", "conformance.cases_grad",
                "conformance.cases_model", "conformance.cases_vllm", "conformance.cases_sglang",
                "conformance.cases_flashinfer", "conformance.cases_flashinfer_paged")
OPTIONAL_MODULES = ("conformance.cases_serving",)


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_device(device: str) -> None:
    """On CPU the Triton kernels run in the interpreter; it must be chosen before triton loads kernels."""
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


# ----------------------------------------------------------------------------------------------
# collection
# ----------------------------------------------------------------------------------------------

def collect(quick: bool, device: str, ops: Optional[Iterable[str]] = None,
            match: Optional[str] = None, modules: Iterable[str] = CASE_MODULES):
    """Return (cases, problems, notes): the selected Cases, failure records for case modules that
    could not be loaded, and human notes (skipped modules / ops without a fast twin)."""
    cases, problems, notes = [], [], []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
            got = list(mod.cases(quick, device))
        except ModuleNotFoundError as e:
            if mod_name in OPTIONAL_MODULES and e.name == mod_name:
                notes.append(f"{mod_name}: not present, skipped")
                continue
            problems.append(_failure_record(mod_name, "<collect>", None, e))
            continue
        except Exception as e:  # a broken case module is a failure, not a crash
            problems.append(_failure_record(mod_name, "<collect>", None, e))
            continue
        missing = getattr(mod, "missing_ops", None)
        if missing is not None:
            for op in missing():
                notes.append(f"{op}: no fast twin yet, skipped")
        cases.extend(got)
    if quick:
        cases = [c for c in cases if c.quick]
    if ops:
        ops = set(ops)
        cases = [c for c in cases if c.op in ops]
    if match:                                   # comma-separated: any of the substrings
        subs = [m for m in match.split(",") if m]
        cases = [c for c in cases if any(m in f"{c.op}/{c.case}" for m in subs)]
    return cases, problems, notes


# ----------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------

def _dtype_name(dtype) -> Optional[str]:
    from .core import DTYPE_NAMES
    return DTYPE_NAMES.get(dtype, str(dtype)) if dtype is not None else None


def _failure_record(op: str, case: str, c, exc: BaseException) -> dict:
    msg = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return dict(op=op, case=case, dtype=_dtype_name(c.dtype) if c is not None else None,
                chunk_size=c.chunk_size if c is not None else None,
                draft_steps=c.draft_steps if c is not None else None,
                check="<exception>", error=None, ref_error=None, ratio=None, passed=False,
                detail=msg + where, seconds=None)


def run_case(c, device: str) -> list:
    """Run one Case; return its records (one per Check, or one failure record if it raised)."""
    from .core import evaluate

    t0 = time.perf_counter()
    try:
        checks = c.checks(device)
        if not checks:
            raise RuntimeError("case returned no checks")
        records = []
        for chk in checks:
            res = evaluate(chk)
            records.append(dict(op=c.op, case=c.case, dtype=_dtype_name(c.dtype), chunk_size=c.chunk_size,
                                draft_steps=c.draft_steps, check=chk.name, error=res["error"],
                                ref_error=res["ref_error"], ratio=res["ratio"], passed=bool(res["passed"]),
                                detail=res.get("detail"), exact=bool(chk.exact)))
    except Exception as e:
        return [_failure_record(c.op, c.case, c, e)]
    dt = time.perf_counter() - t0
    for r in records:
        r["seconds"] = dt
    return records


class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal, sparse lines otherwise)."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.width = max(total, 1), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.failed = 0
        self._last_line = -1

    def update(self, done: int, label: str = "", failed: int = 0) -> None:
        self.failed = failed
        frac = done / self.total
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        elapsed = time.perf_counter() - self.t0
        text = (f"[{bar}] {done}/{self.total} {elapsed:6.1f}s"
                f"{'  FAILED ' + str(failed) if failed else ''}  {label}")
        if self.tty:
            self.stream.write("\r" + text[:150].ljust(150))
        else:  # log every ~10% and the end: CI logs stay short
            step = int(frac * 10)
            if step != self._last_line or done == self.total:
                self._last_line = step
                self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def run_all(cases: list, device: str, progress: bool = True, stream=None, sink=None,
            deadline: Optional[float] = None) -> list:
    """Run the cases in order. sink(records) is called after each case (a worker streams its records
    with it); past `deadline` (time.monotonic()) the remaining cases become one failure record."""
    records = []
    bar = Progress(len(cases), stream) if progress else None
    failed = 0
    for i, c in enumerate(cases):
        if deadline is not None and time.monotonic() > deadline:
            records.append(_timeout_record(f"{len(cases) - i} of {len(cases)} cases not run"))
            break
        label = f"{c.op}/{c.case}/{_dtype_name(c.dtype)}" + (f"/BT{c.chunk_size}" if c.chunk_size else "")
        if bar:
            bar.update(i, label, failed)
        recs = run_case(c, device)
        _release_cached_memory(device)
        failed += sum(not r["passed"] for r in recs)
        records.extend(recs)
        if sink is not None:
            sink(recs)
    if bar:
        bar.update(len(cases), "done", failed)
        bar.close()
    return records


def _release_cached_memory(device: str) -> None:
    """Give the blocks torch's caching allocator keeps after a case back to the device. Workers share one GPU: a
    worker's cache from its largest case (the float64 truth's autograd) is memory another worker's Triton launch or
    cuBLAS handle cannot get, which torch's own retry-after-freeing never sees (H100, 12 workers, 2026-11-25: a
    float32 gradient case failed with Triton's "out of memory" and passed alone). Measured (H100, 12 workers,
    2026-11-25): that case still ran out of memory once beside the others (rerun_out_of_memory then passed it), and
    the full matrix took no longer (487 s against ~500 before), so it is kept as a cheap reduction of the odds."""
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


def _timeout_record(detail: str) -> dict:
    return dict(op="<timeout>", case="<timeout>", dtype=None, chunk_size=None, draft_steps=None,
                check="<timeout>", error=None, ref_error=None, ratio=None, passed=False,
                detail=f"--timeout reached: {detail}", seconds=None)


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------

def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def format_summary(records: list, only_failures: bool = False) -> str:
    cols = ["op", "case", "dtype", "BT", "draft_steps", "check", "error", "refgdn error", "ratio", "pass"]
    rows = []
    for r in records:
        if only_failures and r["passed"]:
            continue
        rows.append([r["op"], r["case"], r["dtype"] or "-", _num(r["chunk_size"]), _num(r["draft_steps"]),
                     r["check"], _num(r["error"]),
                     "exact" if r.get("exact") else _num(r["ref_error"]),
                     f"{r['ratio']:.2f}" if isinstance(r.get("ratio"), float) and math.isfinite(r["ratio"])
                     else _num(r.get("ratio")),
                     "ok" if r["passed"] else "FAIL"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    lines = [fmt(cols), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows]
    out = "\n".join(lines) + "\n"
    for r in records:
        if not r["passed"] and r.get("detail"):
            out += f"  {r['op']}/{r['case']}/{r['dtype']}: {r['detail']}\n"
    return out


def worst_per_case(records: list) -> list:
    """One row per (op, case, dtype, BT, draft_steps): a failing check if any, else the highest ratio."""
    def rank(r):
        ratio = r.get("ratio")
        return (not r["passed"], ratio if isinstance(ratio, float) and math.isfinite(ratio) else 0.0)

    worst: dict = {}
    for r in records:
        key = (r["op"], r["case"], r["dtype"], r["chunk_size"], r["draft_steps"])
        if key not in worst or rank(r) > rank(worst[key]):
            worst[key] = r
    return list(worst.values())


def totals(records: list) -> str:
    n_fail = sum(not r["passed"] for r in records)
    ops = sorted({r["op"] for r in records})
    return (f"{len(records)} checks over {len(ops)} ops ({', '.join(ops)}): "
            f"{len(records) - n_fail} passed, {n_fail} failed")


def _clean(record: dict) -> dict:
    """JSON has no inf/nan: write them as strings."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def write_json(records: list, path: str) -> None:
    """The report: a JSON list, one record per Check (op, case, dtype, chunk_size, draft_steps,
    check, error, ref_error, ratio, passed, detail, seconds); inf/nan written as strings."""
    with open(path, "w") as f:
        json.dump([_clean(r) for r in records], f, indent=1)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m conformance",
                                 description="Check every fast op against its refgdn twin.")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the CI-size matrix (CPU interpreter: minutes); "
                      "the default on cpu")
    size.add_argument("--full", action="store_true", help="the full matrix (Qwen3-Next head dims, T up to 4096); "
                      "the default on cuda")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda if available, else cpu (Triton interpreter)")
    ap.add_argument("--json", default="conformance-report.json", metavar="PATH",
                    help="JSON report path (default: conformance-report.json)")
    ap.add_argument("--ops", default=None, help="comma-separated op names to run (default: all)")
    ap.add_argument("--cases", default=None, metavar="SUBSTR[,SUBSTR...]",
                    help="only cases whose op/case contains SUBSTR (any of several, comma-separated)")
    ap.add_argument("--dtypes", default=None, help="comma-separated dtypes to keep, e.g. float32,bfloat16")
    ap.add_argument("--all-rows", action="store_true", help="summary shows every check (default when <= 200 "
                    "checks; otherwise one row per case: its failing or worst check)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--jobs", type=int, default=None, metavar="N",
                    help="run the matrix in N worker processes (compiling Triton variants is CPU-bound; "
                         "default: 8 on cuda, 2 on cpu, never more than the CPU count)")
    ap.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="stop after SECONDS, report what ran and record the rest as a failure")
    ap.add_argument("--shard", default=None, metavar="I/N", help=argparse.SUPPRESS)  # a worker's slice
    return ap.parse_args(argv)


def shard(cases: list, i: int, n: int, max_group: Optional[int] = None) -> list:
    """Worker i's share of the cases. Cases of one (op, dtype, chunk size) launch the same Triton
    variants, so they stay together: each variant is compiled once per piece, not once per case.
    Groups costing more than ``max_group`` (default: a quarter of a worker's fair share, at least 4; a
    case's ``cost`` is 1 unless it says otherwise) are cut into pieces of near-equal cost, so no single
    group sets the run's length (a 14-case float32 chunk group took ~450 s in one worker on an H200 while
    the others finished in ~110 s; a float32 gradient case at BT = 64 compiles for ~50 s on an H100).
    Pieces go, costliest first, to the worker with the least cost so far."""
    groups: dict = {}
    for c in cases:
        groups.setdefault((c.op, str(c.dtype), c.chunk_size), []).append(c)
    cap = max_group or max(4, -(-sum(c.cost for c in cases) // (4 * n)))
    pieces = []                                        # (cost, key, index, cases)
    for key in sorted(groups, key=str):
        g = groups[key]
        cost = sum(c.cost for c in g)
        k = min(len(g), int(-(-cost // cap)))          # pieces of near-equal cost: cut where the running
        cuts, run = [], 0.0                            # cost first reaches j/k of the group's
        for idx, c in enumerate(g[:-1]):
            run += c.cost
            if len(cuts) < k - 1 and run >= (len(cuts) + 1) * cost / k:
                cuts.append(idx + 1)
        for j, (a, b) in enumerate(zip([0] + cuts, cuts + [len(g)])):
            pieces.append((sum(c.cost for c in g[a:b]), key, j, g[a:b]))
    loads, mine = [0.0] * n, []
    for cost, key, j, piece in sorted(pieces, key=lambda p: (-p[0], str(p[1]), p[2])):
        w = min(range(n), key=lambda t: (loads[t], t))
        loads[w] += cost
        if w == i:
            mine.extend(piece)
    return mine


def run_sharded(argv: list, jobs: int, progress: bool, deadline: Optional[float] = None) -> list:
    """Run ``python -m conformance`` as `jobs` workers, each taking its :func:`shard` of the cases; merge
    their reports. Workers stream their records (JSON lines) as each case ends, so a worker that dies
    or is stopped at the deadline still contributes what it ran, plus a failure record: never a silent gap."""
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        workers = []
        for i in range(jobs):
            path = os.path.join(tmp, f"shard{i}.json")
            cmd = [sys.executable, "-m", "conformance", *argv, "--shard", f"{i}/{jobs}", "--json", path,
                   "--no-progress", "--jobs", "1"]
            log = open(os.path.join(tmp, f"shard{i}.log"), "w+")
            workers.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), path, log))
        bar = Progress(jobs) if progress else None
        try:
            while any(proc.poll() is None for proc, _, _ in workers):
                if deadline is not None and time.monotonic() > deadline:
                    break
                if bar:
                    done = sum(proc.poll() is not None for proc, _, _ in workers)
                    bar.update(done, f"{done}/{jobs} workers finished", 0)
                time.sleep(0.5)
        finally:
            for proc, _, _ in workers:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        records = []
        for proc, path, log in workers:
            try:
                with open(path) as f:
                    records.extend(json.load(f))
                continue
            except (OSError, ValueError):
                pass
            partial = []
            if os.path.exists(path + "l"):
                with open(path + "l") as f:
                    partial = [json.loads(line) for line in f if line.strip()]
            records.extend(partial)
            log.seek(0)
            tail = log.read()[-2000:]
            why = ("stopped at the --timeout" if proc.returncode == -9 and deadline is not None
                   else f"exited {proc.returncode} without a report")
            records.append(dict(op="<worker>", case=os.path.basename(path), dtype=None, chunk_size=None,
                                draft_steps=None, check="<exception>", error=None, ref_error=None, ratio=None,
                                passed=False, detail=f"worker {why} after {len(partial)} checks: {tail}",
                                seconds=None))
        for _, _, log in workers:
            log.close()
        if bar:
            bar.update(jobs, "done", sum(not r["passed"] for r in records))
            bar.close()
    return records


OUT_OF_MEMORY = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")   # CUDA / torch / Triton, and cuBLAS's handle


def _out_of_memory(r: dict) -> bool:
    """A case that raised an out-of-memory error (OUT_OF_MEMORY: CUDA's, torch's, Triton's or cuBLAS's)."""
    detail = r.get("detail") or ""
    return r["check"] == "<exception>" and r["op"] != "<worker>" and any(m in detail for m in OUT_OF_MEMORY)


def rerun_out_of_memory(records: list, argv: list, deadline: Optional[float] = None) -> list:
    """records with each case that ran out of GPU memory under several workers rerun alone, in one worker
    process of its own after the others ended: the workers share the device, and each process reserves its own
    local-memory stacks for the kernels that spill, so a case can fail for memory the other workers hold. The
    rerun's records replace the failure (each says so in its detail); a case that runs out of memory alone
    still fails. Cases are rerun only while the deadline allows."""
    key = lambda r: (r["op"], r["case"], r["dtype"], r["chunk_size"], r["draft_steps"])  # noqa: E731
    failed = {key(r): r for r in records if _out_of_memory(r)}
    if not failed:
        return records
    out = [r for r in records if key(r) not in failed]
    with tempfile.TemporaryDirectory(prefix="conformance-oom-") as tmp:
        for k, r in failed.items():
            left = None if deadline is None else deadline - time.monotonic()
            rerun = []
            if left is None or left > 0:
                path = os.path.join(tmp, "rerun.json")
                cmd = [sys.executable, "-m", "conformance", *argv, "--ops", k[0], "--cases", k[1], "--json", path,
                       "--no-progress", "--jobs", "1"] + (["--dtypes", k[2]] if k[2] else [])
                try:
                    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=left)
                    with open(path) as f:
                        rerun = [x for x in json.load(f) if key(x) == k]
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    rerun = []
            if rerun:
                for x in rerun:
                    x["detail"] = ((x.get("detail") or "") + " [rerun alone: out of memory beside the other "
                                   "workers]").strip()
                out.extend(rerun)
            else:
                out.append(r)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or default_device()
    prepare_device(device)
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available", file=sys.stderr)
        return 2
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    t0 = time.perf_counter()
    # the interpreter runs K = V = 128, T = 4096 for hours: on cpu the quick matrix unless --full
    args.quick = args.quick or (not args.full and not device.startswith("cuda"))
    cases, problems, notes = collect(args.quick, device, ops, args.cases)
    if args.dtypes:
        keep = {d.strip() for d in args.dtypes.split(",")}
        cases = [c for c in cases if _dtype_name(c.dtype) in keep]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        cases, problems = shard(cases, i, n), (problems if i == 0 else [])
    deadline = time.monotonic() + args.timeout if args.timeout else None
    jobs = args.jobs or (8 if device == "cuda" else 2)
    jobs = max(1, min(jobs, os.cpu_count() or 1, len(cases)))
    if not args.shard:
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        print(f"conformance: {len(cases)} cases on {device} ({'quick' if args.quick else 'full'} matrix)"
              + (f", {jobs} workers" if jobs > 1 else ""), file=sys.stderr)
    if jobs > 1 and not args.shard:
        argv = list(sys.argv[1:] if argv is None else argv)
        own = ("--json", "--jobs", "--timeout")   # the parent's options, not the workers'
        passthrough = [a for j, a in enumerate(argv) if a not in own and (j == 0 or argv[j - 1] not in own)]
        passthrough += ["--device", device]
        records = problems + run_sharded(passthrough, jobs, progress=not args.no_progress, deadline=deadline)
        records = rerun_out_of_memory(records, passthrough, deadline)
    else:
        lines = open(args.json + "l", "w") if args.shard and args.json else None

        def stream_lines(recs):  # a worker streams its records as JSON lines next to its report
            lines.write("".join(json.dumps(_clean(r)) + "\n" for r in recs))
            lines.flush()
        sink = stream_lines if lines is not None else None
        records = problems + run_all(cases, device, progress=not args.no_progress, sink=sink, deadline=deadline)
    show_all = args.all_rows or len(records) <= 200
    print(format_summary(records if show_all else worst_per_case(records)), end="")
    print(totals(records) + f" in {time.perf_counter() - t0:.1f}s")
    if args.json:
        write_json(records, args.json)
        print(f"report: {args.json}")
    if not records:
        print("no checks ran", file=sys.stderr)
        return 1
    return 0 if all(r["passed"] for r in records) else 1
