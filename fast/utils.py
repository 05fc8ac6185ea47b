"""Small helpers shared by the fast kernels: interpreter detection, sizes, varlen chunk tables, a slot-row lookup.

Nothing here launches a kernel. The varlen table builders read ``cu_seqlens`` on the host
(one device->host copy per op, shared with its value check: refgdn.checks.one_host_read_scope),
so they belong to eager prefill paths, never inside a CUDA-graph capture (DESIGN.md invariant 5);
graph-captured paths must precompute their tables outside.
"""
from __future__ import annotations

import contextlib
import os
import struct
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from refgdn.checks import host_offsets, scope_memo


_INTERPRETING = None     # TRITON_INTERPRET as read by the first is_interpreting() call


def is_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Kernels use it to pick a single pinned config (the interpreter has no benchmarker) and to
    cast ``tl.dot`` operands to float32 (bf16 dots are wrong in the interpreter). Read from the
    environment once: Triton fixes the choice when a kernel is defined (fast sets the variable before
    defining any), and the launchers ask several times per call.
    """
    global _INTERPRETING
    if _INTERPRETING is None:
        _INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return _INTERPRETING


def _rne_convert(real):
    """Triton's interpreter float conversion with fp32 -> bf16 rounding half to even (else ``real``)."""
    def convert(input, input_dtype, output_dtype, rounding_mode):
        if rounding_mode is None and input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            bits = np.frombuffer(np.ascontiguousarray(input).tobytes(), dtype=np.uint32).astype(np.uint64)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16               # round half to even
            return bits.astype(np.uint16).reshape(np.shape(input))
        return real(input, input_dtype, output_dtype, rounding_mode)
    convert._rne = True
    return convert


def _interpreter_module():
    """Triton's interpreter module when its float conversion is the one this file knows how to wrap, else None."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # noqa: BLE001 - no interpreter in this Triton
        return None
    return ti if callable(getattr(ti, "_convert_float", None)) else None


def interpreter_bf16_rne_supported() -> bool:
    """Whether :func:`interpreter_bf16_round_to_nearest` can act on the installed Triton (its interpreter's float
    conversion is ``triton.runtime.interpreter._convert_float``, as in Triton 3.9; looked up by name, so another
    layout leaves the interpreter as it is and this returns False)."""
    return _interpreter_module() is not None


def install_interpreter_bf16_round_to_nearest() -> bool:
    """For the rest of this process, the Triton interpreter's fp32 -> bf16 casts round to nearest even, as a GPU's
    cvt.rn does. Triton's interpreter truncates them (cast_impl calls _convert_float with no rounding mode: the low
    16 bits are dropped), so every bf16 value a kernel stores or rounds there carries up to twice a GPU's error,
    always toward zero, and bf16 runs read worse on a CPU than on a GPU. NaN payloads are not preserved (none
    arise). Returns whether it is in effect (False: an unknown interpreter, left as it is)."""
    ti = _interpreter_module()
    if ti is None:
        return False
    if not getattr(ti._convert_float, "_rne", False):
        ti._convert_float = _rne_convert(ti._convert_float)
    return True


@contextlib.contextmanager
def interpreter_bf16_round_to_nearest():
    """Within the block, the interpreter's fp32 -> bf16 casts round to nearest even (as
    install_interpreter_bf16_round_to_nearest); the previous conversion is restored after it. Nothing happens
    where kernels do not run in the interpreter, or where it is not the one this file knows."""
    ti = _interpreter_module() if is_interpreting() else None
    if ti is None or getattr(ti._convert_float, "_rne", False):
        yield
        return
    real = ti._convert_float
    ti._convert_float = _rne_convert(real)
    try:
        yield
    finally:
        ti._convert_float = real


class _SharedLangPatch:
    """Triton's interpreter re-patches triton.language at every call of a @triton.jit helper from a kernel (the
    device-function path calls _patch_lang, which walks tl, tl.core, tl.tensor and tl.math with
    inspect.getmembers: about 1 ms a call, a third of a CPU run of the chunked forward), although the launch has
    already patched those modules with the same closures. This wrapper keeps the launch's patch and skips a
    helper's when the helper sees no language module that the launch, or an earlier helper of the launch, did not
    patch (Triton never restores a helper's patch); any other call goes to Triton's own function. The helper's
    patch would re-set the same attributes to equivalent closures (none depends on the value it replaces), so the
    kernels compute the same bits either way (the quick matrix's reports are identical with and without it)."""

    def __init__(self, real, ti):
        self.real, self.ti, self.active = real, ti, None
        self._shared = True

    def _langs(self, fn) -> frozenset:
        tl_ = self.ti.tl
        return frozenset(id(v) for v in fn.__globals__.values() if isinstance(v, type(tl_)) and v in (tl_, tl_.core))

    def __call__(self, fn):
        langs = self._langs(fn)
        if self.active is not None and langs and langs <= self.active:
            return _NoScope()                                   # a helper inside a launch: already patched
        scope = self.real(fn)
        if self.active is not None:
            # a helper that sees another language module (Triton's own tl.sum, tl.zeros, ... see tl.core): Triton's
            # way; a helper's patch is never restored (Triton drops its scope), so it holds for the rest of the launch
            self.active = self.active | langs
            return scope
        self.active = langs                                     # a launch: its patch holds until it restores
        return _LaunchScope(self, scope)


class _LaunchScope:
    """A launch's patch scope (Triton's), restored when the launch ends; the wrapper's launch state with it."""
    __slots__ = ("owner", "scope")

    def __init__(self, owner: _SharedLangPatch, scope):
        self.owner, self.scope = owner, scope

    def restore(self) -> None:
        self.owner.active = None
        self.scope.restore()


class _NoScope:
    """A helper's skipped patch: nothing to restore (Triton drops a helper's scope anyway)."""

    def restore(self) -> None:
        pass


def install_interpreter_shared_lang_patch() -> bool:
    """For the rest of this process, a kernel's calls of @triton.jit helpers in the Triton interpreter reuse the
    launch's patch of triton.language instead of redoing it per call (_SharedLangPatch: same results, about a third
    less CPU time for kernels built from helpers). Returns whether it is in effect (False: an interpreter whose
    layout this file does not know, left as it is)."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # noqa: BLE001 - no interpreter in this Triton
        return False
    real = getattr(ti, "_patch_lang", None)
    if getattr(real, "_shared", False):
        return True
    if not callable(real) or not hasattr(ti, "GridExecutor") or not hasattr(ti, "tl"):
        return False
    ti._patch_lang = _SharedLangPatch(real, ti)
    return True


def eps_split(eps: float) -> tuple:
    """eps as (float32 value, float32 remainder): Triton passes a Python float to a kernel as a float32 scalar, so a
    float64 kernel that needs eps to float64 precision takes both and sums them (fp64_eps)."""
    hi = struct.unpack("f", struct.pack("f", eps))[0]
    return hi, eps - hi


@triton.jit
def fp64_eps(eps, eps_lo, FP64: tl.constexpr):
    """eps (eps_split's two parts) in the compute dtype: float64 variants sum both parts (a float32 eps alone is off by
    up to ~3e-8 relative: fast's float64 norms were 2e-9 off refgdn's at eps 1e-3, H100, 2026-11-28)."""
    if FP64:
        return tl.cast(eps, tl.float64) + tl.cast(eps_lo, tl.float64)
    else:
        return eps


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class VarlenTables(NamedTuple):
    """varlen_chunk_tables' result, on cu_seqlens' device. indices: [NT, 2] int32 (sequence n, chunk within n)
    per global chunk; offsets: [N+1] int32, sequence n's first global chunk; checked: [N+1] in cu_seqlens'
    dtype, the offsets the tables were built from (what kernels read in place of cu_seqlens); order: [N]
    int32, the sequences longest first (by chunk count, ties in index order)."""
    indices: torch.Tensor
    offsets: torch.Tensor
    checked: torch.Tensor
    order: torch.Tensor


@triton.jit
def slot_row(slot_rows, i_n, COL: tl.constexpr, ref, mask, SLOTS: tl.constexpr):
    """(row, mask): the row of an initial / final state that sequence i_n reads or writes, and ``mask`` (ref's
    shape) narrowed to it. Without SLOTS the row is i_n (an [N, ...] state). With SLOTS (the serving prefill,
    fast.serving.gdn_prefill: the state is a slot cache's) it is slot_rows[i_n, COL] (int32 [N, 2]: COL 0 the slot
    written, 1 the slot read; -1: none, the mask all false and the row 0, a safe address)."""
    if SLOTS:
        r = tl.load(slot_rows + i_n * 2 + COL).to(tl.int64)
        mask = mask & ((ref * 0 + (r >= 0).to(tl.int32)) != 0)   # a scalar as a block mask (the interpreter too)
        r = tl.maximum(r, 0)
    else:
        r = i_n.to(tl.int64)
    return r, mask


def checked_offsets(cu_seqlens, cu_seqlens_cpu):
    """The device tensor of offsets whose values the host checked, for kernels that read offsets after an op's
    host check (fast.causal_conv1d's tile table, built on the device from it). Without cu_seqlens_cpu the values
    were read from cu_seqlens itself: cu_seqlens (no copy). With it, the caller's host copy is what was checked
    (it may differ from cu_seqlens when stale): its values, uploaded in cu_seqlens' dtype from pinned memory
    without blocking, N + 1 integers (a pageable copy would wait for every kernel queued before it). None: None."""
    if cu_seqlens is None or cu_seqlens_cpu is None:
        return cu_seqlens
    host = cu_seqlens_cpu.to(cu_seqlens.dtype)
    if cu_seqlens.device.type == "cuda":
        return host.pin_memory().to(cu_seqlens.device, non_blocking=True)   # the pinned block outlives the copy
    return host.to(cu_seqlens.device, copy=True)


def varlen_chunk_tables(cu_seqlens: torch.Tensor, chunk_size: int) -> VarlenTables:
    """cu_seqlens: [N+1] -> VarlenTables (indices [NT, 2], offsets [N+1], checked [N+1], order [N]), all on
    cu_seqlens' device.

    indices has one row per global chunk, ``(sequence n, chunk index within sequence n)``;
    sequence n owns global chunks ``offsets[n] .. offsets[n+1]-1`` (none when empty): chunks
    never straddle sequences, sequence n has ceil(len_n / chunk_size) of them. ``checked`` is a device copy
    of the very values the tables were built from (and the op checked): kernels read it instead of
    cu_seqlens, so what they index always agrees with the tables and the checks. ``order`` lists the
    sequences by chunk count, longest first: the sequential passes (one program per sequence, head and V-block,
    each walking its sequence's chunks) map their programs through it, so the GPU starts the longest walks
    first and the short ones fill the tail (longest-processing-time-first scheduling) instead of a long
    sequence starting late and running alone at the end. H200, Triton 3.6, bf16, Qwen3-Next shape, the 16-sequence
    mix of benchmarks/bench_prefill.py (32760 tokens, 94 chunks in the longest): the forward's state pass 0.750 ->
    0.676 ms, the whole call 1.082 -> 1.005 ms (results bit for bit the same).

    Host work: cu_seqlens' values come from refgdn.checks.host_offsets (one read shared with the op's value
    check inside its one_host_read scope, or the caller's cu_seqlens_cpu: no read); the four tables are
    built with numpy into one buffer (each part 16-byte aligned) and copied to the device in one transfer,
    from pinned memory without blocking on a GPU (a pageable copy would wait for every kernel queued
    before it). No device kernel runs. Use outside CUDA-graph capture. Inside a one_host_read scope the tables are
    kept per (cu_seqlens, chunk_size) until it ends: fast.gdn_prefill's conv and chunked forward tile by the same
    64 rows and share one build and one upload.
    """
    memo = scope_memo()
    key = ("varlen_chunk_tables", id(cu_seqlens), chunk_size)
    hit = memo.get(key) if memo is not None else None
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1]
    offs = host_offsets(cu_seqlens)                                        # list of ints (validated by the op)
    wide = cu_seqlens.dtype == torch.int64
    build = _table_words_small if len(offs) <= SMALL_TABLES and offs[-1] <= SMALL_TABLES * chunk_size else \
        _table_words
    buf, n_off, o_ord, head, NT, tail = build(offs, chunk_size, wide)
    host = torch.from_numpy(buf)
    if cu_seqlens.device.type == "cuda":
        dev = host.pin_memory().to(cu_seqlens.device, non_blocking=True)   # the pinned block outlives the copy
    else:
        dev = host.to(cu_seqlens.device)
    checked = dev[tail:].view(torch.int64) if wide else dev[tail:]
    tables = VarlenTables(dev[head:head + 2 * NT].view(NT, 2), dev[:n_off], checked, dev[o_ord:o_ord + n_off - 1])
    if memo is not None:
        memo[key] = (cu_seqlens, tables)
    return tables


# Tables of at most this many sequences and chunks are built in Python lists (numpy's per-call overhead, ~1-2 us
# per operation on tiny arrays, is most of a short prefill's table work); larger ones with numpy. Same words.
SMALL_TABLES = 64


def _a16(n: int) -> int:
    """int32 words rounded up to 16 bytes."""
    return -(-n // 4) * 4


def _table_words(offs: list, BT: int, wide: bool) -> tuple:
    """varlen_chunk_tables' host buffer from the offsets, with numpy: (buf [int32 words], N+1, order start, indices
    start, NT, checked start). Layout: offsets [N+1] | order [N] | indices [NT, 2] | checked offsets [N+1] (int64
    when wide), each part 16-byte aligned."""
    offs = np.asarray(offs, dtype=np.int64)
    counts = (np.diff(offs) + BT - 1) // BT                                  # [N] chunks per sequence
    offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    NT = int(offsets[-1])
    seq = np.repeat(np.arange(counts.size, dtype=np.int64), counts)          # [NT]
    within = np.arange(NT, dtype=np.int64) - offsets[seq]                     # [NT]
    o_ord = _a16(offsets.size)                                                # order start
    head = _a16(o_ord + counts.size)                                          # chunk_indices start
    tail = _a16(head + 2 * NT)                                                # the checked offsets start
    buf = np.zeros(tail + offs.size * (2 if wide else 1), dtype=np.int32)
    buf[:offsets.size] = offsets
    buf[o_ord:o_ord + counts.size] = np.argsort(-counts, kind="stable")
    buf[head:head + 2 * NT:2] = seq
    buf[head + 1:head + 2 * NT:2] = within
    buf[tail:].view(np.int64 if wide else np.int32)[:] = offs
    return buf, offsets.size, o_ord, head, NT, tail


def _table_words_small(offs: list, BT: int, wide: bool) -> tuple:
    """_table_words in Python lists (small tables: SMALL_TABLES), the same words."""
    N = len(offs) - 1
    counts = [(offs[n + 1] - offs[n] + BT - 1) // BT for n in range(N)]
    offsets = [0] * (N + 1)
    for n in range(N):
        offsets[n + 1] = offsets[n] + counts[n]
    NT = offsets[-1]
    o_ord = _a16(N + 1)
    head = _a16(o_ord + N)
    tail = _a16(head + 2 * NT)
    words = offsets + [0] * (o_ord - N - 1)
    words += sorted(range(N), key=lambda n: -counts[n])                      # stable: ties in index order
    words += [0] * (head - o_ord - N)
    for n in range(N):
        for j in range(counts[n]):
            words += (n, j)
    words += [0] * (tail - head - 2 * NT)
    if wide:                                                                  # int64 offsets as int32 word pairs
        for x in offs:
            words += (x & 0xFFFFFFFF) - ((x & 0x80000000) << 1), x >> 32
    else:
        words += offs
    return np.array(words, dtype=np.int32), N + 1, o_ord, head, NT, tail
