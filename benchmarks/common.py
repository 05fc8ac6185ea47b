"""Shared benchmark helpers: timing, measured ceilings, the fla peer, and RESULTS.md.

Every figure is a median of ``triton.testing.do_bench`` taken in this process, on this device;
ceilings (copy bandwidth, bf16 matmul throughput) are measured here too, never quoted from a
datasheet, so "fraction of ceiling" compares like with like.

Used by ``benchmarks/bench_prefill.py`` and ``benchmarks/bench_decode.py``; each exposes
``run() -> list[dict]`` (table rows) and ``python -m benchmarks`` collects them.
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, Optional

import torch

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"


# ----------------------------------------------------------------------------------------------
# device
# ----------------------------------------------------------------------------------------------

def gpu_available() -> bool:
    """True when a CUDA device is usable and we are not in the Triton interpreter."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def device_name(device: str = "cuda") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def synchronize(device: str = "cuda") -> None:
    """Wait for the device's queued work; nothing to wait for without CUDA (the tables' CPU smoke tests)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def bench(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (``triton.testing.do_bench``, L2 flushed per call).

    ``warmup``/``rep`` are target durations in ms, as in do_bench. On CPU (no CUDA) falls back to
    a wall-clock median of a few calls so callers never crash; such numbers are not reported.
    """
    if not torch.cuda.is_available():
        return bench_once(fn, repeats=3)
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except TypeError:  # very old triton without return_mode
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5]))


def wall_us(fn: Callable[[], object], iters: int = 200, repeats: int = 5, warmup: int = 10,
            sync: Optional[Callable[[], None]] = None) -> float:
    """Host wall time per call in us: median over ``repeats`` of (``iters`` back-to-back calls + one
    ``sync``) / iters, after ``warmup`` calls. sync: by default a CUDA synchronize when CUDA is there
    (launch overhead and device time both count); pass ``lambda: None`` to time host work alone."""
    if sync is None:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(out)


def core_busy(cores, window: float = 0.1) -> dict:
    """core -> the fraction of ``window`` seconds it spent busy (Linux /proc/stat, two reads); {} where unreadable."""
    def read() -> dict:
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *vals = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                    ticks = [int(x) for x in vals]
                    out[int(name[3:])] = (sum(ticks), ticks[3] + (ticks[4] if len(ticks) > 4 else 0))  # total, idle
        return out
    try:
        a = read()
        time.sleep(window)
        b = read()
    except (OSError, ValueError, IndexError):
        return {}
    return {c: 1 - (b[c][1] - a[c][1]) / max(1, b[c][0] - a[c][0]) for c in a if c in b}


class one_core:
    """Context manager: the process runs on one CPU core inside the block (``core``, else the environment's
    REFGDN_BENCH_CORE, else the idlest core it may use over 0.1 s, the highest-numbered among equals), its former
    affinity restored after. For rows bound by host work (eager decode, short prefills): unpinned, one server host
    read the same code 1.5-2x apart in different processes (RESULTS.md, 2026-11-27); pinned with `taskset -c 3`,
    the same rows agreed within ~10 % but for rare outliers. The idlest core rather than a fixed one: after a
    conformance run a GPU host's load average was still 2-9 and the pinned rows read 1.5-2x high (RESULTS.md,
    2026-11-27 10:58). No-op where the OS has no affinity call. ``.core``: the core pinned to, or None."""

    def __init__(self, core: Optional[int] = None):
        self.core, self.saved = core, None

    def __enter__(self) -> "one_core":
        if hasattr(os, "sched_setaffinity"):
            self.saved = os.sched_getaffinity(0)
            if self.core is None and os.environ.get("REFGDN_BENCH_CORE", "").isdigit():
                self.core = int(os.environ["REFGDN_BENCH_CORE"])
            if self.core is None or self.core not in self.saved:
                busy = core_busy(self.saved)
                self.core = max(self.saved, key=lambda c: (-round(busy.get(c, 0.0), 2), c))
            os.sched_setaffinity(0, {self.core})
        else:
            self.core = None
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)


def bench_once(fn: Callable[[], object], repeats: int = 1, device: str = "cuda") -> float:
    """Wall-clock median in ms of ``repeats`` calls (after one untimed call). For slow references
    (refgdn at T=4096) where do_bench's hundred calls would take minutes."""
    fn()
    synchronize(device if torch.cuda.is_available() else "cpu")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device if torch.cuda.is_available() else "cpu")
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# measured ceilings
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbs(device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in GB/s (1e9 B/s), counting read + write bytes.

    bytes = 2 * nbytes (one read of the source, one write of the destination); 1 GiB buffers are
    far larger than L2 (50-60 MB on H100/H200), so this is HBM bandwidth.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


@functools.lru_cache(maxsize=None)
def matmul_tflops(device: str = "cuda", n: int = 8192) -> float:
    """Measured dense bf16 matmul throughput in TFLOP/s: ``2 * n**3`` FLOPs for an n x n x n GEMM."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    ms = bench(lambda: torch.matmul(a, b, out=out))
    del a, b, out
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------
# the peer: fla (flash-linear-attention, ``pip install fla-core``)
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def try_import_fla() -> Optional[SimpleNamespace]:
    """fla's ops if installed, else None.

    Returns a namespace with ``version`` and whichever of these imported:
      - ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
        output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False) -> (o, ht)``
        (``fla.ops.gated_delta_rule``; same [B, T, H, K] layout as refgdn; no float32 inputs)
      - ``fused_recurrent_gated_delta_rule(<same>) -> (o, ht)``
      - ``causal_conv1d(x [B, T, D], weight [D, W], bias=None, residual=None, initial_state=None,
        output_final_state=False, activation=None, ..., cu_seqlens=None) -> (y, final_state)``
        (``fla.modules.convolution``; note fla's conv state is [N, D, W], refgdn's [N, D, W-1])
    Missing pieces are None. Whether a given fla version supports HV > H (grouped value heads)
    is not assumed: benchmarks call through :func:`call_fla_gdn`, which falls back to repeating
    q/k heads (and says so) when fla rejects the grouped shapes.
    """
    try:
        import fla  # noqa: F401
    except Exception:
        return None
    ns = SimpleNamespace(version=getattr(fla, "__version__", "unknown"),
                         chunk_gated_delta_rule=None, fused_recurrent_gated_delta_rule=None,
                         causal_conv1d=None)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        ns.chunk_gated_delta_rule = chunk_gated_delta_rule
    except Exception:
        pass
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        ns.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    except Exception:
        pass
    try:
        from fla.modules.convolution import causal_conv1d
        ns.causal_conv1d = causal_conv1d
    except Exception:
        pass
    return ns


def autotuners(prefix: str = "fla.") -> list:
    """Every Triton Autotuner held as a module attribute by the loaded modules under ``prefix`` (also through
    wrappers that keep the wrapped kernel as ``.fn``, e.g. triton.heuristics): fla's kernels, for
    :func:`best_of_autotune_draws`."""
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(prefix):
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):                        # Heuristics(Autotuner(JITFunction)) and the like
                if isinstance(obj, Autotuner):
                    found[id(obj)] = obj
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return list(found.values())


def best_of_autotune_draws(fn: Callable[[], object], draws: int, time_fn: Callable, prefix: str = "fla.") -> tuple:
    """(best time, [time of each draw]) of ``fn`` over ``draws`` independent autotune draws of the kernels under
    ``prefix``, which are left with the best draw's picks. Before each draw every such Autotuner forgets its choice
    and does not consult its on-disk result (cache_results off for the draw), so the next call benchmarks its
    configs again. fla's autotuner picks its configs from one timing of each; timing noise makes the pick (and
    fla's figure) differ from process to process (its B=4 T=4096 forward read 0.846 to 1.097 ms on the same H200
    in separate runs, RESULTS.md 2026-11-26). A ratio against fla's best draw is the conservative one.
    time_fn(fn) -> time; fn is called once untimed per draw (the autotuning call)."""
    tuners = autotuners(prefix)
    saved = [(t, t.cache_results) for t in tuners]
    times, picks = [], []
    try:
        for _ in range(max(1, draws)):
            for t in tuners:
                t.cache.clear()
                t.cache_results = False
            fn()                                     # autotunes
            synchronize()
            times.append(time_fn(fn))
            picks.append([dict(t.cache) for t in tuners])
    finally:
        for t, c in saved:
            t.cache_results = c
    best = min(range(len(times)), key=times.__getitem__)
    for t, pick in zip(tuners, picks[best]):
        t.cache.clear()
        t.cache.update(pick)
    return times[best], times


def _expand_qk(q, k, HV):
    rep = HV // q.shape[2]
    # [B, T, H, K] -> [B, T, HV, K]: value head h reads q/k head h // rep
    return q.repeat_interleave(rep, dim=2).contiguous(), k.repeat_interleave(rep, dim=2).contiguous()


_GVA_PROBE: dict = {}


def fla_supports_gva(fn: Callable, device: str) -> bool:
    """Whether fla's op computes grouped value heads (HV > H) correctly: a small probe comparing its
    native GVA call with the same call on q/k repeated to HV heads. A version without GVA may raise,
    or silently read the wrong heads: both count as unsupported. Cached per (op, device)."""
    key = (getattr(fn, "__qualname__", repr(fn)), device)
    if key not in _GVA_PROBE:
        gen = torch.Generator(device=device).manual_seed(0)
        B, T, H, HV, K = 1, 128, 2, 4, 64
        q = torch.randn(B, T, H, K, device=device, generator=gen).to(torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
        k = k.to(torch.bfloat16)
        v = torch.randn(B, T, HV, K, device=device, generator=gen).to(torch.bfloat16)
        g = -torch.rand(B, T, HV, device=device, generator=gen)
        beta = torch.rand(B, T, HV, device=device, generator=gen).to(torch.bfloat16)
        try:
            o_native = fn(q, k, v, g, beta, output_final_state=True)[0]
            q2, k2 = _expand_qk(q, k, HV)
            o_rep = fn(q2, k2, v, g, beta, output_final_state=True)[0]
            synchronize(device)
            ok = o_native.shape == o_rep.shape and bool(
                torch.allclose(o_native.float(), o_rep.float(), atol=2e-2, rtol=2e-2))
        except Exception:
            ok = False
        _GVA_PROBE[key] = ok
    return _GVA_PROBE[key]


def call_fla_gdn(fn: Callable, q, k, v, g, beta, **kwargs):
    """Call an fla gated-delta-rule op with refgdn's layout; returns ``(callable, note)``.

    ``callable()`` runs the op. When HV > H and this fla version does not handle grouped value
    heads (:func:`fla_supports_gva`), q and k are repeated to HV heads once, up front (outside the
    timed region), and ``note`` says so: the timed work is then fla's work at H = HV, which is what
    a GVA-less kernel must do anyway.
    """
    H, HV = q.shape[2], v.shape[2]
    if H == HV or fla_supports_gva(fn, str(q.device)):
        return (lambda: fn(q, k, v, g, beta, **kwargs)), ""
    q2, k2 = _expand_qk(q, k, HV)
    return (lambda: fn(q2, k2, v, g, beta, **kwargs)), "fla: q/k repeated to HV heads"


# ----------------------------------------------------------------------------------------------
# versions, tables and RESULTS.md
# ----------------------------------------------------------------------------------------------

def versions() -> dict:
    import triton

    fla = try_import_fla()
    return dict(torch=torch.__version__, triton=triton.__version__,
                fla=fla.version if fla is not None else "not installed",
                cuda=torch.version.cuda or "none")


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:  # nan
            return "-"
        if x == 0:
            return "0"
        a = abs(x)
        if a >= 100:
            return f"{x:.0f}"
        if a >= 10:
            return f"{x:.1f}"
        if a >= 0.01:
            return f"{x:.3f}"
        return f"{x:.2e}"
    return str(x)


def format_table(rows: Iterable[dict], columns: Optional[list] = None) -> str:
    """Markdown table of ``rows`` (dicts); columns default to the union of keys in first-seen order."""
    rows = list(rows)
    if not rows:
        return "(no rows)\n"
    if columns is None:
        columns = []
        for r in rows:
            for key in r:
                if key not in columns:
                    columns.append(key)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out) + "\n"


def run_tables(tables, only=None, no_results: bool = False, **meta_extra) -> None:
    """Print each table (name, title, meta, make() -> rows) whose name is ``only`` (every one when None) and append it
    to RESULTS.md unless no_results, its meta with meta_extra added (e.g. the measured copy bandwidth)."""
    for name, title, meta, make in tables:
        if only not in (None, name):
            continue
        r = make()
        print(format_table(r), flush=True)
        if not no_results:
            append_results(title, r, meta=dict(meta, **meta_extra))


def append_results(section_title: str, table_rows: list, meta: Optional[dict] = None,
                   path: Optional[Path] = None) -> str:
    """Append one section (title, device/version line, meta, markdown table) to RESULTS.md.

    ``meta``: extra ``key: value`` pairs printed under the title (ceilings, shapes, notes).
    Returns the appended text.
    """
    path = Path(path) if path is not None else RESULTS_PATH
    v = versions()
    dev = device_name("cuda") if torch.cuda.is_available() else device_name("cpu")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [f"## {section_title}", "",
             f"{stamp} · {dev} · torch {v['torch']} · triton {v['triton']} · fla {v['fla']}"
             f" · CUDA {v['cuda']}", ""]
    for key, val in (meta or {}).items():
        lines.append(f"- {key}: {_fmt(val)}")
    if meta:
        lines.append("")
    text = "\n".join(lines) + "\n" + format_table(table_rows) + "\n"
    new = not path.exists()
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by `python -m benchmarks`; newest sections last. "
                    "Times are medians of `triton.testing.do_bench`; ceilings are measured in the "
                    "same process.\n\n")
        f.write(text)
    return text
