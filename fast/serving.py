"""Triton decode and speculative-verify steps against a slot cache, with lazy-commit rollback.

Same API, cache layout and contract as :mod:`refgdn.serving` (read its docstring for the protocol):

    gdn_decode(mixed_qkv [N, D], a, b [N, HV], conv_weight, conv_bias, A_log, dt_bias, cache, state_indices [N])
    gdn_verify(mixed_qkv [T, D], a, b [T, HV], ..., cache, state_indices [N], cu_seqlens [N+1])
    gdn_accept(cache, state_indices [N], num_accepted [N])
    gdn_materialize(cache, state_indices [N])

Per token:  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = scale S^T q   (q, k l2-normalised).

A step is two launches:

1. ``conv_step_kernel``, grid (D-blocks, N): reads the committed conv window (it starts at column
   ``max(count-1, 0)`` of ``conv_state[slot]``), convolves the request's new raw inputs, writes the
   conv outputs and the new window (oldest dropped), checks the request's values, and snapshots its
   verdict with the slot's ``(count, bank)`` into a per-request buffer for launch 2. Conv width
   W <= 4: a sliding window of [BD] registers; ``conv_step_any_w_kernel`` for wider convs.
2. ``gdn_step_kernel``, grid (V-blocks, HV / HPP, N): one program owns a ``[K, BV]`` block of one
   slot's state (for HPP value heads in turn), in registers for the whole step: one read, the
   pending tokens re-applied, one write, the new tokens' gating (from raw a, b), l2norm and delta
   rule, outputs. Verify stores the new tokens' inputs into the other pending bank and the new
   ``(count, bank)``; decode commits everything. The decay is folded into a scalar (see the kernel).

Performance (H200, Qwen3-Next shape, N = 256, float32 state; benchmarks/profile_decode.py): decode
~286 us = ~90 % of copy bandwidth: the step kernel ~270 us (the state at ~94 % of copy; memory-bound:
big blocks, many bytes in flight), the conv kernel ~12 us. The conv kernel's cost is its strided
per-channel accesses, so the cache keeps the conv state channels-contiguous (GDNStateCache.allocate;
a row-major [S, D, W'] conv state works too, at ~17 us). Verify is bound by the per-token arithmetic
and latency (small one-warp blocks, reductions by shuffles). Tried on an H200 and dropped: the conv
folded into the step kernel (one launch, q/k windows rewritten by their last reader through atomic
counters: 377 us), evict-first state traffic, a speculative window load, a flat coalesced window store
for row-major conv states (all within noise or slower); programmatic dependent launches (PDL) at N = 256
(no gain for float32 states, slower for bfloat16 ones). Tried on an H100 at small N and dropped (2026-11-24,
benchmarks/RESULTS.md): decode as one launch, every step program convolving the channels it reads and the
shared q/k windows and pend_meta rewritten by their last reader through per-slot ticket atomics -- per layer
of a 32-layer graph N = 1 6.59 us vs 5.19 for these two launches, N = 8 17.8 vs 16.1: each scalar atomic's
result is broadcast to the warp at once, so its round trip (two per program) sits on the critical path, and
the conv's window and weight loads, 8-16x redundant per q/k head, come on top of the state read. Tried at small
N and dropped (2026-11-24, H200 and H100): the conv programs asking L2 for the step's state before their
``gdc_wait`` (``prefetch.global.L2`` per line, its ``evict_last`` form, or one ``cp.async.bulk.prefetch.L2`` per
program), so the state's traffic would fill the conv's time: slower at every N, per layer of a 32-layer graph
N = 8 12.4 -> 14.1 us (H200), 14.8 -> 16.6-17.7 (H100); N = 4 +0.4-1.1 us; N = 1 within noise.

Small batches (decode N <= DECODE_PDL_MAX_N: 64 requests with float32 states, 32 with 16-bit ones; verify N <=
PDL_MAX_N = 32; sm_90+) both launches are programmatic dependents (PDL; at the smallest N the step is latency-bound:
one request's state is 2 MB at Qwen3-Next's shape): the conv kernel loads what its
predecessor cannot be writing (without drafts: the slot, its window and taps), waits for it, and then lets
the step kernel start, whose programs read their state blocks
(and, for decode, a and b) while the conv runs and wait (``gdc_wait``) only before the conv's outputs.
Per layer of a 32-layer CUDA graph (H100, 2026-11-23): N = 1 5.1-5.4 us against 6.8 without PDL (fla's fused
recurrent alone, without conv and gating: 5.2). With the conv's window and taps loaded before its wait (H200,
2026-11-25): N = 1 3.99 us, N = 8 11.6-11.7 (fla's fused recurrent alone 4.91 / 14.0; a bare read + write of
the N = 8 state 9.88). Eager, a cached call signature launches through
:class:`fast.launch.Relaunch` (the compiled kernels' launcher, without JITFunction.run's per-call work).

Why the snapshot: every program of a slot must see the same verdict and ``(count, bank)``, and programs of one
launch do not run at once; launch 2 writes the slot's metadata, so it reads the copy launch 1 made
(launch 1 only reads the slot's metadata). Why two banks: launch 2 reads the pending k of a q/k
head in several programs (all value heads of the group, all V-blocks) while others write the new
tokens' k; the new ones go to the other bank.

Validation that survives CUDA graphs (issue 8; the rules and their wording: refgdn.serving)
-------------------------------------------------------------------------------------------
Shapes, dtypes and devices are checked on the host before any launch, with refgdn's functions --
once per call signature (every tensor's type, shape, stride, dtype and device, the cache's fields'
too; refgdn.serving.step_signature): a call whose signature passed before reuses that verdict and
its launch plan (_checked_plan says why that is safe and what invalidates it). Values live on the
device, and reading them on the host is a sync (forbidden inside capture), so the kernels check them
where they already load them, at no extra launch:

* ``conv_step_kernel`` (and ``conv_step_any_w_kernel``; materialize runs them too): every program
  of request n computes the same verdict for its row (``_step_row_check``): slot < num_slots (negative: padded),
  no other row with the same slot (a pairwise compare of the row's slot against state_indices in
  blocks of DUP_BLOCK: deterministic, no atomics, no scratch to clear), offsets sane (cu[0] = 0,
  cu[N] = T, cu[n] <= cu[n+1], at most 1 + max_draft tokens), and the slot not awaiting an accept.
  It publishes the verdict in the per-request snapshot gdn_step_kernel already reads (slot -1 =
  write nothing), so the step kernel needs no check of its own. A failed request writes nothing:
  no conv window, no state, no pending tokens, no metadata; its outputs are zeros, or undefined when
  the offsets themselves are bad (its rows cannot be trusted).
* ``accept_kernel``: slot range and duplicates (a [64, 32] pairwise compare per column block),
  a verify awaiting the accept, num_accepted in [1, count] (exactly 0 for a zero-token row).

No address is ever formed from an unchecked value: slot, bos and L are clamped to safe values
first, and every access is masked, so no argument value makes a kernel touch memory outside the
tensors it was given. The fault is recorded in ``cache.err`` ([4] int64: code, request, value,
extra) exactly as refgdn chooses it: the call's lowest faulty request, with its highest-priority
rule (refgdn.serving, "Which fault is reported"). Deterministically, without atomics: a program
whose request has a fault (the error path; a fault-free call never takes it) re-checks the requests
before its own (``_step_fault_before``; accept: the blocks before its own) and records only if none
has a fault, and only if err is still empty (launches run in stream order, so an earlier call's or
another layer's fault stays). :meth:`GDNStateCache.check` (refgdn) reads it at the caller's next
host sync, clears it and raises refgdn's ValueError. The
eager ops do not call check() themselves: it costs a device->host copy and a sync (> 5 us), and
the same code runs inside capture -- except on a CPU device (the Triton interpreter), where the
cache is host memory and reading err is free: there every op ends with check(), so a fault raises
at once (after the call's good requests ran). ``check_values=True`` runs refgdn's host checks first
(a sync per call, not inside capture) and raises before any launch. Cost: the checks add loads of
state_indices (L2-resident) to the conv kernel; benchmarks/bench_decode.py measures decode with
and without them (the second table; target < 2 % at N = 256).

CUDA graphs: no host reads (no ``.item()``), no data-dependent shapes, no autotune (the kernels
mutate state in place: DESIGN.md invariant 2) -- configs are pinned by :func:`step_config` and
:func:`conv_config`; N, T and the slot count are not specialised (``do_not_specialize``). Compile
variants (warm them all up before capture, invariant 1): per dtype set, per (decode | verify |
materialize) mode and per cache geometry (fast/keys.py lists them).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

import refgdn.serving as rs
from refgdn.checks import host_offsets, one_host_read, provide_host_offsets
from refgdn.serving import (GDNStateCache, accept_value_faults, check_accept_inputs, check_cache,
                            check_state_indices, check_step_inputs, raise_first, step_value_faults)

from .chunk import chunk_gated_delta_rule_fwd
from .chunk.common import _capability, _is_fp64
from .conv import _forward as conv_forward
from .launch import ABSENT, Carved, MetaGuard, PlanCache, Relaunch, SignaturePlans, launch, shape_key
from .utils import cdiv, is_interpreting, next_pow2

__all__ = ["GDNStateCache", "gdn_prefill", "gdn_decode", "gdn_verify", "gdn_accept", "gdn_materialize",
           "step_config", "conv_config"]


class _Const(tl.constexpr):
    """A kernel-visible module constant: a tl.constexpr whose ``!=`` returns a plain bool.

    Why: on every launch Triton's JITFunction.run re-checks that each global a kernel reads is unchanged
    since compilation (``globals_dict.get(name) != val``, val a deep copy); tl.constexpr's ``!=`` builds a
    new constexpr and then takes its bool (~1 us each on a slow host), and conv_step_kernel reads ten of
    these constants, accept_kernel five. Same value, same repr (so the same compile hash and kernels);
    inside kernels the constants are only passed, or-ed and and-ed with tensors, never compared.
    """

    def __ne__(self, other):
        return self.value != (other.value if isinstance(other, tl.constexpr) else other)


# fault codes and the awaiting-accept bit, shared with refgdn.serving (kernel-visible constants)
_E_SLOT_RANGE, _E_SLOT_DUP = _Const(rs.E_SLOT_RANGE), _Const(rs.E_SLOT_DUP)
_E_CU_START, _E_CU_ORDER = _Const(rs.E_CU_START), _Const(rs.E_CU_ORDER)
_E_CU_END = _Const(rs.E_CU_END)
_E_TOO_LONG, _E_AWAITING = _Const(rs.E_TOO_LONG), _Const(rs.E_AWAITING)
_E_NO_VERIFY, _E_ACCEPT_RANGE = _Const(rs.E_NO_VERIFY), _Const(rs.E_ACCEPT_RANGE)
_AWAIT = _Const(rs.AWAIT_ACCEPT)

MIN_PROGRAMS = {4: 1024, 2: 2048}   # decode: BV shrinks until N * HV * cdiv(V, BV) reaches this, by the state's
                                    # element size (step_config)
FEW_PROGRAMS = 256   # decode, 16-bit states: [K, 16] blocks only where [K, 32] ones give fewer programs (step_config)
PDL_MAX_N = 32       # verify: both kernels programmatic dependents up to this many requests (step_config)
DECODE_PDL_MAX_N = {4: 64, 2: 32}   # decode: the same, by the SSM state's element size (step_config)
CONV_SMALL_N = 8     # conv_config: up to this many requests, short-lived two-warp programs
DUP_BLOCK = 128      # state_indices rows per step of the conv kernels' duplicate scan (fixed: one variant)
_SCAN_ROWS, _SCAN_COLS = _Const(16), _Const(32)   # tiles of the error path's earlier-fault scan
ACCEPT_BLOCK = 64    # requests per accept_kernel program (fixed: one variant for every N)


def step_config(K: int, V: int, state_dtype: torch.dtype, HV: int = 1, mode: str = "decode",
                N: Optional[int] = None, override: Optional[dict] = None, pdl_ok: bool = False) -> dict:
    """Pinned launch config of gdn_step_kernel: BV (V-block), num_warps, HPP (value heads per program),
    fold (decay folded into a scalar), pdl (launched as the conv kernel's programmatic dependent: only
    where ``pdl_ok``, the device has it (pdl_supported), and for N <= DECODE_PDL_MAX_N[state element size]
    requests in decode, N <= PDL_MAX_N in verify). N: the number of requests (None: large). override: keys
    put over the heuristic's (benchmark sweeps and tests: benchmarks/bench_decode.launch_overrides; the ops
    never pass it; each distinct config is its own compiled variant; an override cannot turn pdl on where
    pdl_ok is False).

    K is kept whole (K <= 256) so each program reads its [K, BV] block once and keeps it in registers.
    Decode is memory-bound: [K, 64] blocks at 8 KB per warp (float32 four warps, 16-bit states two) keep
    the most bytes in flight; small batches halve BV (down to 16) until there are MIN_PROGRAMS programs
    (1024 for float32 states, 2048 for 16-bit ones, which stop at [K, 32] while that gives FEW_PROGRAMS),
    one warp per block of at most 16 KB. Verify does 2-3 flops per state element per token
    (compute-bound): [K, 32] blocks in one warp, where the reductions over K are shuffles (no shared
    memory, no barrier). HPP heads per program (a divisor of HV): the next head's block loads while one
    is worked on.

    Measured per layer of a 32-layer CUDA graph (8 layers at N >= 128), HV = 32, K = V = 128, no conv
    bias, H200, Triton 3.6, 2026-11-28 (benchmarks/RESULTS.md, "Decode configs by N and state dtype"),
    us, two rounds within 0.3:
    - float32 state, PDL on / off at the pinned blocks: N = 8 11.6 / 13.9, 12 17.3 / 19.4, 16 22.6 / 23.5,
      24 31.3 / 32.3, 32 40.1 / 40.9, 48 57.5 / 58.8, 64 75.6 / 76.0, 128 147.0 / 145.9, 256 289.8 / 286.5:
      PDL up to 64 requests (an H100 run of the 2026-11-23 kernels had put the cut at 8).
    - bfloat16 state (vLLM's default SSM cache dtype): [K, 128] blocks in four warps (the rule before)
      at N = 32 / 64 29.4 / 50.8 without PDL against [K, 64] in two warps 26.4 / 47.3; at N = 16 / 24
      the halving loop had left [K, 64] in one warp, 25.6 / 34.5 us, now [K, 64] in two, with PDL 14.9 /
      20.6 ([K, 32] in one warp: 14.2 / 20.1); N = 128 / 256 (no PDL) 93.7 / 180.0 against 89.4 / 175.2.
      PDL on / off with [K, 64] in two warps: N = 32 26.1 / 26.4, N = 64 48.7 / 47.3, N = 128 95.6 /
      89.4: PDL up to 32 requests.
    - bfloat16 state at small N, with PDL (2026-11-28 16:41, two rounds each), [K, 16] one warp / [K, 32] one warp
      / [K, 64] two warps: N = 1 4.14 / 4.23 / 4.83; N = 2 4.95 / 4.66 / 5.31; N = 4 6.29 / 5.66-6.01 / 6.68;
      N = 8 10.5 / 8.28 / 9.49; N = 12 13.4 / 11.7 / 12.8; N = 16 17.4 / 14.2 / 14.9; N = 24 25.4 / 20.2 / 20.6
      ([K, 32] in two warps, [K, 64] in one or four: slower at every N): 16-bit states take [K, 32] in one warp
      from 2 to 31 requests at 32 value heads (256 to 2047 programs), [K, 16] at one.
    - bfloat16 state at 32 / 48 / 64 value heads (2026-11-28 20:03, two rounds each), [K, 32] one warp / [K, 64] two
      warps: HV = 32 N = 32 25.98 / 26.3-26.6 (PDL), N = 48 44.0 / 37.3, N = 64 57.7 / 47.6 (no PDL); HV = 48 N = 24
      28.45-28.57 / 28.73-28.84, N = 32 36.61 / 37.36; HV = 64 N = 16 24.82 / 26.03, N = 24 35.72 / 36.96, N = 32
      46.4-46.7 / 47.5: 16-bit states take [K, 32] in one warp wherever the step runs under PDL (2 to 32 requests),
      whatever the head count; without PDL the halving rule above ([K, 64] in two warps). The small-N rule holds at
      48 / 64 heads too (HV = 48 N = 2 / 4 / 8 / 16 and HV = 64 N = 1 / 2 / 4 / 8: its pick the fastest or within 0.05).
    - verify, 1 + 3 tokens, PDL on / off: float32 N = 8 / 16 / 32 20.3 / 22.0, 34.3 / 35.1, 59.9 / 60.2;
      bfloat16 16.8 / 18.8, 28.1 / 29.4, 48.9 / 49.8: PDL up to 32 requests.
    - H100, float32 (2026-11-23, the kernels of then): N = 1 BV 16 5.8 us (BV 64 6.7); N = 2 BV 16 7.2
      (BV 32 7.9); N = 4 BV 16 10.1 (BV 64 11.3); N = 8 BV 32 one warp 17.1 (two warps 18.8, BV 64 18.4).
    """
    BK = next_pow2(K)
    elem = state_dtype.itemsize
    if is_interpreting():
        cfg = dict(BV=min(next_pow2(V), 32), num_warps=1, HPP=1, fold=True)
    elif mode == "verify":
        BV = min(next_pow2(V), 32)
        cfg = dict(BV=BV, num_warps=max(1, min(8, BK * BV // 4096)), HPP=1, fold=True)
    else:
        BV = min(next_pow2(V), 64)                      # [128, 64] blocks, 8 KB per warp: fp32 4 warps, bf16 2
        warps = max(1, min(8, BK * BV * elem // 8192))
        # small batches: halve BV (down to 16) until there are MIN_PROGRAMS programs, one warp per block of
        # at most 16 KB; 16-bit states stop at [K, 32] unless that leaves fewer than FEW_PROGRAMS programs
        # (figures in the docstring)
        while N is not None and BV > 16 and N * HV * cdiv(V, BV) < MIN_PROGRAMS.get(elem, MIN_PROGRAMS[4]):
            if elem == 2 and BV == 32 and N * HV * cdiv(V, BV) >= FEW_PROGRAMS:
                break
            BV //= 2
            warps = max(1, min(8, BK * BV * elem // 16384))
        if elem == 2 and pdl_ok and N is not None and 2 <= N <= DECODE_PDL_MAX_N[2] and BV > 32:
            BV, warps = 32, 1    # 16-bit states under PDL: [K, 32] in one warp at 48 / 64 value heads too (docstring)
        cfg = dict(BV=BV, num_warps=warps, HPP=1, fold=True)
    pdl_max = PDL_MAX_N if mode == "verify" else DECODE_PDL_MAX_N.get(elem, PDL_MAX_N)
    cfg["pdl"] = N is not None and N <= pdl_max
    if override:
        cfg.update(override)
    cfg["pdl"] = bool(cfg["pdl"]) and pdl_ok and not is_interpreting()
    hpp = max(1, int(cfg["HPP"]))
    while HV % hpp:
        hpp //= 2
    cfg["HPP"] = hpp
    return cfg


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability 9.0+ (Hopper, Blackwell),
    not the interpreter (the capability as fast.chunk's config rules read it). Cached per device."""
    return device.type == "cuda" and not is_interpreting() and _capability(device.type, device.index)[0] >= 9


def conv_config(D: int, W: int = 4, N: Optional[int] = None, override: Optional[dict] = None) -> dict:
    """Pinned launch config of the conv step kernels: BD channels per program, num_warps. N: the number of
    requests (None: large). override: as step_config's.

    Up to CONV_SMALL_N requests: 256 channels in two warps (fewer, shorter-lived programs: the conv is the step
    kernel's wait). Per layer of a 32-layer graph (Triton 3.6, 2026-11-25, after the conv's window and taps moved
    before its wait; two runs each, us): H200 N = 8 BD 256 two warps 11.67-11.73, BD 128 two warps 11.56-11.65,
    BD 128 one warp 11.81, BD 64 one warp (the rule for 5..8 before) 12.07-12.19, BD 256 / 512 in one / two warps
    14.1-14.6; N = 6 BD 256 two warps 10.20-10.30, BD 128 two warps 10.23, BD 256 four warps 10.05-10.17, BD 64
    one warp 10.73-10.81; N <= 4 BD 256 two warps within 0.1 us of the best. H100 N = 8 BD 256 two warps
    14.23-14.25, BD 128 two warps 14.21-14.22, BD 64 one warp 14.83-14.84; N = 6 12.65-12.67 vs 13.08-13.13 /
    13.32-13.33; N = 5 11.03-11.05 vs 11.39-11.40 / 11.44-11.46. Before that change BD 64 in one warp was best
    at N = 5..8 (its many small programs left the SMs to the step kernel's early state reads): per layer of a
    32-layer graph
    (H100, float32 state, step config pinned; benchmarks/bench_graphs.py --only sweep, 2026-11-23): N = 8 BD 64
    one warp 17.0 us, BD 256 two warps 17.7, BD 256 four warps 18.0-18.2; N = 1 5.0 vs 4.9-5.2 (within the
    run-to-run spread). Per layer of a 32-layer graph (H200, Triton 3.6, first session of 2026-11-24, each figure
    from two runs: N = 1 4.54-4.85 us vs BD 64 one warp 5.04-5.08, BD 128 two warps 4.83-4.90, BD 256 / 512 four
    warps 4.91-4.97; N = 2 5.66-5.67 vs 6.10; N = 4 8.07 vs 8.28; at N = 8 BD 64 one warp stays best,
    13.50-13.54 vs 14.12-14.54). Larger N: 256 channels in four warps (N = 256, H200, bench_decode --sweep).
    """
    if is_interpreting():
        cfg = dict(BD=min(next_pow2(D), 256), num_warps=1)
    elif N is not None and N <= CONV_SMALL_N:
        cfg = dict(BD=min(next_pow2(D), 256), num_warps=2)
    else:
        cfg = dict(BD=min(next_pow2(D), 256), num_warps=4)
    if override:
        cfg.update(override)
    return cfg


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _as_block(cond, ref):
    """A scalar condition broadcast to ref's block shape, as a block mask.

    (``block & scalar_bool`` is promoted to int32 by the Triton interpreter, which then rejects it
    as a mask; integer arithmetic broadcasts the same way on GPU and in the interpreter.)
    """
    return (ref * 0 + cond.to(tl.int32)) != 0


@triton.jit
def _record_fault(err, do, code, n, value, extra):
    """err <- (code, n, value, extra) if ``do`` and no fault is recorded yet (code 0 = empty).

    Plain loads and stores, no atomics: within a launch only the program that owns the call's lowest
    faulty request calls it with ``do`` set (see _step_fault_before / accept_kernel), and launches run
    in stream order, so an earlier launch's fault (another layer's, sharing err) is never replaced.
    """
    old = tl.load(err, mask=do, other=1)
    w = do & (old == 0)
    tl.store(err, code.to(tl.int64), mask=w)
    tl.store(err + 1, n.to(tl.int64), mask=w)
    tl.store(err + 2, value.to(tl.int64), mask=w)
    tl.store(err + 3, extra.to(tl.int64), mask=w)


@triton.jit
def _step_code(raw, in_range, real, n, N, T, bos, eos, other, word, S, TCAP: tl.constexpr, VARLEN: tl.constexpr):
    """A step request's fault (code, value, extra), elementwise: scalars for one row, [BN] blocks for many.

    The rules of refgdn.serving.step_faults in its priority order (a request reports its highest-priority
    violated rule; the codes are numbered in that order): applied here from the lowest priority to the
    highest, each overriding. other: _earliest_other's key (< N: an earlier row has the same slot).
    TCAP < 0: no token cap (prefill).
    """
    zero = raw * 0
    awaiting = real & ((word & _AWAIT) != 0)
    code = tl.where(awaiting, _E_AWAITING, zero)
    value = tl.where(awaiting, raw, zero)
    extra = zero
    if VARLEN:
        L = eos - bos
        if TCAP >= 0:                                 # (prefill: no cap)
            f = L > TCAP
            code, value, extra = tl.where(f, _E_TOO_LONG, code), tl.where(f, L, value), tl.where(f, TCAP, extra)
        f = (n == N - 1) & (eos != T)
        code, value, extra = tl.where(f, _E_CU_END, code), tl.where(f, eos, value), tl.where(f, T, extra)
        f = eos < bos
        code, value, extra = tl.where(f, _E_CU_ORDER, code), tl.where(f, eos, value), tl.where(f, bos, extra)
        f = (n == 0) & (bos != 0)
        code, value, extra = tl.where(f, _E_CU_START, code), tl.where(f, bos, value), tl.where(f, 0, extra)
    f = real & (other < N)
    code, value, extra = tl.where(f, _E_SLOT_DUP, code), tl.where(f, raw, value), tl.where(f, other, extra)
    f = in_range == 0
    code, value, extra = tl.where(f, _E_SLOT_RANGE, code), tl.where(f, raw, value), tl.where(f, S, extra)
    return code, value, extra


@triton.jit
def _earliest_others(state_indices, raw, o_n, N, BC: tl.constexpr):
    """_earliest_other for a block of rows o_n [BN] holding raw [BN]: a [BN, BC] pairwise compare per
    column block. Rows outside [0, N) get garbage keys (callers mask them)."""
    other = o_n * 0 + 2 * N                          # int32 keys (row indices)
    for start in range(0, N, BC):
        o_c = start + tl.arange(0, BC)
        s_c = tl.load(state_indices + o_c, mask=o_c < N, other=-1).to(tl.int64)
        hit = (s_c[None, :] == raw[:, None]) & (o_c[None, :] != o_n[:, None]) & (o_c < N)[None, :]
        key = tl.where(o_c[None, :] < o_n[:, None], o_c[None, :], N + o_c[None, :])
        other = tl.minimum(other, tl.min(tl.where(hit, key, 2 * N), axis=1))
    return other


@triton.jit
def _step_fault_before(meta, state_indices, cu_seqlens, n_end, N, T, S, TCAP: tl.constexpr, VARLEN: tl.constexpr):
    """1 if a request m < n_end has a fault of its own (_step_code != 0), else 0.

    The error path only: the program of a faulty request calls it to learn whether it holds the call's
    lowest faulty request (the one refgdn reports, and the one recorded). Rows in blocks of _SCAN_ROWS,
    the duplicate compare in [_SCAN_ROWS, _SCAN_COLS] tiles: O(n_end * N) work, never on the hot path.
    """
    found = n_end * 0
    for start in range(0, n_end, _SCAN_ROWS):
        o = start + tl.arange(0, _SCAN_ROWS)
        m = o < n_end
        raw = tl.load(state_indices + o, mask=m, other=-1).to(tl.int64)   # masked rows: padded
        in_range = raw < S
        real = in_range & (raw >= 0)
        word = tl.load(meta + tl.where(real, raw, 0) * 2 + 1, mask=real, other=0)
        if VARLEN:
            bos = tl.load(cu_seqlens + o, mask=m, other=0).to(tl.int64)
            eos = tl.load(cu_seqlens + o + 1, mask=m, other=0).to(tl.int64)
        else:
            bos = o.to(tl.int64)
            eos = bos + 1
        other = _earliest_others(state_indices, raw, o, N, _SCAN_COLS)
        code, value, extra = _step_code(raw, in_range, real, o, N, T, bos, eos, other, word, S, TCAP, VARLEN)
        found = tl.maximum(found, tl.max(tl.where(m & (code != 0), 1, 0), axis=0))
    return found


@triton.jit
def _earliest_other(state_indices, slot, i_n, N, BN: tl.constexpr):
    """Among the rows m != i_n of state_indices [N] holding the value ``slot``: min of (m if m < i_n
    else N + m), 2N if there is none. So < N: an earlier row has it; in [N, 2N): only later rows.
    A deterministic pairwise compare (blocks of BN rows; no atomics, no scratch buffer)."""
    best = slot * 0 + 2 * N
    for start in range(0, N, BN):
        o = start + tl.arange(0, BN)
        s = tl.load(state_indices + o, mask=o < N, other=-1).to(tl.int64)
        hit = (s == slot) & (o != i_n) & (o < N)
        best = tl.minimum(best, tl.min(tl.where(hit, tl.where(o < i_n, o, N + o), 2 * N), axis=0))
    return best


@triton.jit
def _row_slot(state_indices, i_n, N, checks, BN: tl.constexpr):
    """Request i_n's raw slot (state_indices[i_n]) and its duplicate key (_earliest_other; 2N when ``checks``
    is 0): the part of a row's verdict that reads state_indices only, which no launch of a step writes (so a
    conv kernel may load it before its ``gdc_wait``)."""
    raw = tl.load(state_indices + i_n).to(tl.int64)
    other = raw * 0 + 2 * N
    if checks != 0:
        other = _earliest_other(state_indices, raw, i_n, N, BN)
    return raw, other


@triton.jit
def _safe_slot(raw, S):
    """A raw slot index -> (in_range, real, slot): slot is raw where it is a real slot of [0, S), else 0."""
    in_range = raw < S                                # any negative index: a padded row
    real = in_range & (raw >= 0)
    return in_range, real, tl.where(real, raw, 0)


@triton.jit
def _step_row_check(meta, cu_seqlens, i_n, N, T, S, checks, raw, other,
                    TCAP: tl.constexpr, TMAX: tl.constexpr, VARLEN: tl.constexpr):
    """The value rules of one request of a step (refgdn.serving.step_faults, on the device). raw, other:
    from _row_slot (the request's state_indices entry and its duplicate scan).

    Returns (slot, ok, live, bos, L, count, word, code, value, extra):
      slot   a safe slot address (the request's slot when it is a real one, else 0)
      ok     the request runs and writes: a real slot, no fault of its own, no other row with its
             slot, every offset of the call sane (else it writes nothing)
      live   its token rows [bos, bos + L) are inside the call's tensors (reads and zero outputs)
      count, word  the slot's pend_meta (0 unless a real slot); code, value, extra: its fault (0: none)
    Nothing here forms an address from an unchecked value: slot and bos are clamped first.
    ``checks`` == 0 skips the duplicate scan and the global offset loads: for benchmarks/bench_decode's
    cost measurement only (a runtime int, so both run the one compiled variant; never 0 in serving).
    """
    in_range, real, slot = _safe_slot(raw, S)
    count = tl.load(meta + slot * 2, mask=real, other=0)
    word = tl.load(meta + slot * 2 + 1, mask=real, other=0)
    c0 = raw * 0
    cN = c0 + T
    if VARLEN:
        if checks != 0:
            c0 = tl.load(cu_seqlens).to(tl.int64)
            cN = tl.load(cu_seqlens + N).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = c0 + i_n
        eos = bos + 1
    L = eos - bos
    dup = real & (other < 2 * N)
    code, value, extra = _step_code(raw, in_range, real, i_n, N, T, bos, eos, other, word, S, TCAP, VARLEN)
    # token rows: every offset of the call sane (else no row is trusted), this one's span in [0, T]
    live = (c0 == 0) & (cN == T) & (bos >= 0) & (bos <= eos) & (eos <= T) & (L <= TCAP)
    ok = live & real & (code == 0) & (dup == 0)
    bos = tl.where(live, bos, 0)
    L = tl.where(live, tl.minimum(L, TMAX), 0)
    return slot, ok, live, bos, L, count, word, code, value, extra


@triton.jit
def _publish_row(snap, err, meta, state_indices, cu_seqlens, i_n, N, T, S, first, slot, ok, count, word, bos, L,
                 code, value, extra, TCAP: tl.constexpr, VARLEN: tl.constexpr):
    """From the program ``first`` of request i_n: snap[i_n] <- (slot or -1 if it must not write, count,
    bank, bos, L) for gdn_step_kernel; and, if the request has a fault and no request before it has
    one (_step_fault_before: the error path only), its fault into err. So the recorded fault is the
    call's lowest faulty request's, as refgdn reports it, whatever order the programs run in."""
    if first:
        p = snap + i_n * 5
        tl.store(p, tl.where(ok, slot, -1).to(tl.int32))
        tl.store(p + 1, tl.minimum(tl.maximum(count, 0), TCAP).to(tl.int32))   # corrupt metadata: clamped
        tl.store(p + 2, (word & 1).to(tl.int32))
        tl.store(p + 3, bos.to(tl.int32))
        tl.store(p + 4, L.to(tl.int32))
        if code != 0:
            before = _step_fault_before(meta, state_indices, cu_seqlens, i_n, N, T, S, TCAP, VARLEN)
            _record_fault(err, before == 0, code, i_n, value, extra)


@triton.jit
def _conv_pdl_enter():
    """The conv kernels' start as the previous kernel's programmatic dependent: wait for it (and, by its own
    wait, everything before it) before reading anything it may write; then let the step kernel start: before
    its gdc_wait it reads only state_indices and the ssm state, which the conv kernels do not write.

    What may still run when a conv program starts: only a step kernel. Only the conv and step kernels let a
    dependent start early, a conv kernel's dependent is always its own call's step kernel, and a step kernel lets
    the next launch start only after its own wait, so everything launched before that step kernel is complete. A
    step kernel writes the ssm state, the pending inputs, pend_meta and o; conv_step_kernel without drafts reads
    state_indices, its window and its taps before calling this (see there)."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _own_slot(state_indices, i_n, S):
    """Request i_n's slot read before its verdict is known (PDL's early state read): state_indices[i_n]
    where it is a real slot, else 0 -- a safe address whatever the value."""
    in_range, real, slot = _safe_slot(tl.load(state_indices + i_n).to(tl.int64), S)
    return slot


@triton.jit
def _window_taps(p_c, p_w, bias, o_d, off, m_win, m_d, stride_c_w, stride_w_w, W: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """The committed window (columns off .. off+W-2 of the slot's channels at p_c) and the taps (weight
    columns at p_w, bias) as float32 [BD] registers: (r0, r1, r2, w0, w1, w2, w3, bias). Register m holds window
    column W-4+m; columns < 0 do not exist (zeros, as their taps)."""
    zero = tl.zeros(o_d.shape, dtype=tl.float32)
    r0 = zero
    r1 = zero
    r2 = zero
    w0 = zero
    w1 = zero
    w2 = zero
    b_bias = zero
    if W >= 4:
        r0 = tl.load(p_c + (off + (W - 4)) * stride_c_w, mask=m_win, other=0).to(tl.float32)
        w0 = tl.load(p_w + (W - 4) * stride_w_w, mask=m_d, other=0).to(tl.float32)
    if W >= 3:
        r1 = tl.load(p_c + (off + (W - 3)) * stride_c_w, mask=m_win, other=0).to(tl.float32)
        w1 = tl.load(p_w + (W - 3) * stride_w_w, mask=m_d, other=0).to(tl.float32)
    if W >= 2:
        r2 = tl.load(p_c + (off + (W - 2)) * stride_c_w, mask=m_win, other=0).to(tl.float32)
        w2 = tl.load(p_w + (W - 2) * stride_w_w, mask=m_d, other=0).to(tl.float32)
    w3 = tl.load(p_w + (W - 1) * stride_w_w, mask=m_d, other=0).to(tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_d, mask=m_d, other=0).to(tl.float32)
    return r0, r1, r2, w0, w1, w2, w3, b_bias


@triton.jit(do_not_specialize=["N", "T", "S", "checks"])   # one variant for every batch size, token count, ...
def conv_step_kernel(
    x, weight, bias, y, conv_state, meta, snap, err, state_indices, cu_seqlens,
    D, N, T, S, checks,
    stride_x_t, stride_x_d, stride_w_d, stride_w_w,
    stride_c_n, stride_c_d, stride_c_w,
    W: tl.constexpr, TCAP: tl.constexpr, TMAX: tl.constexpr, CWP: tl.constexpr,
    BD: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: channels [i_d*BD, +BD) of request i_n; conv width W <= 4 (a sliding window in registers).

    window = the committed W-1 raw inputs (conv_state[slot] at column max(count-1, 0)), held in three
    [BD] registers r0 (oldest) .. r2 (newest), zero-padded on the left when W < 4; per new token t < L:
        y_t = act(bias + w[W-4] r0 + w[W-3] r1 + w[W-2] r2 + w[W-1] x_t);  (r0, r1, r2) <- (r1, r2, x_t)
    conv_state[slot, :, 0 : W-1+L-drop] <- [window, x_0 .. x_{L-1}][drop:]   drop = min(L, 1)
    snap[i_n] <- (slot, or -1 if it must not write; count, bank before the step; bos, L), and the
    request's fault into err (the i_d == 0 program; the rules: _step_row_check). A failed request
    writes nothing; its tokens' rows of y are scratch.
    Every column is a [BD] vector (channels across threads), so the taps are per-thread FMAs.

    Latency: the first min(TMAX, 4) tokens' inputs are loaded before any is used, each later one 4
    tokens ahead. PDL without drafts (TCAP = 1: the window starts at column 0): the slot's state_indices entry,
    its duplicate scan, the window and the taps load before ``gdc_wait`` (nothing a step kernel writes:
    _conv_pdl_enter), so after it one round trip is left (pend_meta and the new inputs) instead of two, before
    the step kernel's state reads fill the memory system. Per layer of a 32-layer graph (2026-11-25, float32
    state; benchmarks/bench_graphs.per_layer_us, two processes each): H200 N = 1 4.37 -> 3.99 us, N = 2 5.58 ->
    5.39, N = 4 8.18 -> 7.76, N = 8 12.40 -> 12.28; H100 N = 1 4.55 -> 4.24, N = 4 9.50 -> 9.15, N = 8 14.74 ->
    14.80 (within noise). An in-kernel %globaltimer trace at N = 8 (H100): the conv's last program ends 1.5 us
    after its wait instead of 8.8, but the step kernel's wait still returns ~8.8 us in (likely: the conv's stores
    queue behind the step's 16.8 MB of early state reads); a release / acquire flag per request in place of the
    wait passed just as late, the step's state reads moved after its wait were slower (15.5 us), and so were its
    early reads as L2 prefetches or as a TMA load (H200 N = 8 12.1 vs 11.6-11.8; RESULTS.md, 2026-11-25).
    (Loading all of a slot's columns as a [BD, CW] block with the metadata, so the window's reads need not
    wait for the count, measured slower on an H200: the column extraction and layout changes cost more than
    the dependent load.)
    """
    i_d = tl.program_id(0)
    i_n = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_w = weight + o_d * stride_w_d
    if PDL and TCAP == 1:
        # no drafts: the window starts at column 0 whatever the count, so the window, the taps and the
        # slot's checks that read state_indices only load before the wait: the launch this one may overlap
        # is a step kernel (the only kernels that let a dependent start early), which writes none of them
        # (and everything before it is complete: it lets dependents start only after its own wait). After
        # the wait one round trip is left (the slot's pend_meta and the new inputs, side by side) instead
        # of two, while the step kernel's state reads fill the memory system.
        raw, other = _row_slot(state_indices, i_n, N, checks, BN)
        in_range, real, slot = _safe_slot(raw, S)
        r0, r1, r2, w0, w1, w2, w3, b_bias = _window_taps(
            conv_state + slot * stride_c_n + o_d.to(tl.int64) * stride_c_d, p_w, bias, o_d, 0, m_d, m_d,
            stride_c_w, stride_w_w, W, HAS_BIAS)
        _conv_pdl_enter()
    else:
        if PDL:
            _conv_pdl_enter()
        raw, other = _row_slot(state_indices, i_n, N, checks, BN)
    slot, valid, live, bos, L, count, bank, code, value, extra = _step_row_check(
        meta, cu_seqlens, i_n, N, T, S, checks, raw, other, TCAP, TMAX, VARLEN)
    _publish_row(snap, err, meta, state_indices, cu_seqlens, i_n, N, T, S, i_d == 0, slot, valid, count, bank,
                 bos, L, code, value, extra, TCAP, VARLEN)
    m_dv = m_d & _as_block(valid, o_d)              # channels of a request that writes (real, no fault)
    p_c = conv_state + slot * stride_c_n + o_d.to(tl.int64) * stride_c_d
    # the new tokens' raw inputs: up to 4 in flight (p0 is token t, p1 token t+1, ...)
    p_x = x + bos * stride_x_t + o_d * stride_x_d
    p0 = tl.load(p_x, mask=m_d & _as_block(L > 0, o_d), other=0)
    p1 = p0
    p2 = p0
    p3 = p0
    if TMAX > 1:
        p1 = tl.load(p_x + stride_x_t, mask=m_d & _as_block(L > 1, o_d), other=0)
    if TMAX > 2:
        p2 = tl.load(p_x + 2 * stride_x_t, mask=m_d & _as_block(L > 2, o_d), other=0)
    if TMAX > 3:
        p3 = tl.load(p_x + 3 * stride_x_t, mask=m_d & _as_block(L > 3, o_d), other=0)
    count = tl.minimum(tl.maximum(count, 0), TCAP)   # memory safety for corrupt metadata
    if TCAP == 1:
        # no drafts (count <= 1): the window starts at column 0 whatever the count, and is read whatever the
        # verdict (slot is a safe address; a failed request's y rows are scratch and the stores below keep
        # m_dv), so its reads wait for state_indices only, not for the slot's metadata and the duplicate scan
        off = 0
        m_win = m_d
    else:
        off = tl.maximum(count - 1, 0).to(tl.int64)
        m_win = m_dv
    drop = tl.minimum(L, 1)

    if not (PDL and TCAP == 1):                       # (else loaded before the wait, above)
        r0, r1, r2, w0, w1, w2, w3, b_bias = _window_taps(p_c, p_w, bias, o_d, off, m_win, m_d, stride_c_w,
                                                          stride_w_w, W, HAS_BIAS)
    # the new window: columns c < keep hold the kept window (old columns off + drop + c), columns
    # keep <= c < keep + L the raw inputs of the new tokens (in the cache's dtype: lossless)
    keep = W - 1 - drop
    if TMAX > 1:
        # verify: one [BD, CWP] tile, stored coalesced at the end (a strided 2-byte store per column
        # made the kernel L2-bound); the kept columns are read again, from L1
        cols = tl.arange(0, CWP)
        tt = cols - keep                              # token of column c
        w2d = tl.load(p_c[:, None] + (off + drop + cols)[None, :] * stride_c_w,
                      mask=m_dv[:, None] & (cols < keep)[None, :], other=0)
        x2d = tl.load(x + (bos + tt)[None, :] * stride_x_t + o_d[:, None] * stride_x_d,
                      mask=m_dv[:, None] & ((tt >= 0) & (tt < L))[None, :], other=0)
        new2d = tl.where((cols < keep)[None, :], w2d, x2d.to(conv_state.dtype.element_ty))
    else:
        # decode (and materialize): a few columns, stored from the registers by the thread that
        # loaded them (one [BD] layout, program order: the in-place rewrite needs no barrier)
        if W >= 4:
            tl.store(p_c + (W - 4 - drop) * stride_c_w, r0.to(conv_state.dtype.element_ty),
                     mask=m_dv & _as_block(W - 4 - drop >= 0, o_d))
        if W >= 3:
            tl.store(p_c + (W - 3 - drop) * stride_c_w, r1.to(conv_state.dtype.element_ty),
                     mask=m_dv & _as_block(W - 3 - drop >= 0, o_d))
        if W >= 2:
            tl.store(p_c + (W - 2 - drop) * stride_c_w, r2.to(conv_state.dtype.element_ty),
                     mask=m_dv & _as_block(W - 2 - drop >= 0, o_d))
        if TMAX == 1:
            if W >= 2:                                # (W = 1: x_0 is dropped)
                tl.store(p_c + keep * stride_c_w, p0.to(conv_state.dtype.element_ty), mask=m_dv & _as_block(L > 0, o_d))
    for t in tl.static_range(TMAX):
        live = L > t
        x_raw = p0
        p0 = p1
        p1 = p2
        p2 = p3
        if t + 4 < TMAX:
            p3 = tl.load(p_x + (t + 4) * stride_x_t, mask=m_d & _as_block(L > t + 4, o_d), other=0)
        x_t = x_raw.to(tl.float32)
        acc = w3 * x_t + w2 * r2 + w1 * r1 + w0 * r0
        if HAS_BIAS:
            acc += b_bias
        if SILU:
            # silu = y * sigmoid(y); exp(-y) overflows to inf for y << 0 and y / inf = -0: no NaN.
            acc = acc / (1 + tl.exp(-acc))
        tl.store(y + (bos + t) * D + o_d, acc.to(y.dtype.element_ty), mask=m_d & _as_block(live, o_d))
        r0 = r1
        r1 = r2
        r2 = x_t
    if TMAX > 1:
        # in place: the tile's elements were read by other threads than the ones that store them; the
        # barrier orders all of the program's loads before its stores (bar.sync orders the memory
        # accesses of the threads that meet there). keep + L <= W - 2 + TMAX <= CW: inside the cache.
        tl.debug_barrier()
        tl.store(p_c[:, None] + cols[None, :] * stride_c_w, new2d, mask=m_dv[:, None] & (cols < keep + L)[None, :])


@triton.jit(do_not_specialize=["N", "T", "S", "checks"])
def conv_step_any_w_kernel(
    x, weight, bias, y, conv_state, meta, snap, err, state_indices, cu_seqlens,
    D, N, T, S, checks,
    stride_x_t, stride_x_d, stride_w_d, stride_w_w,
    stride_c_n, stride_c_d, stride_c_w,
    W: tl.constexpr, CW: tl.constexpr, TCAP: tl.constexpr, TMAX: tl.constexpr, SP: tl.constexpr,
    BD: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """conv_step_kernel for any conv width W (W > 4): the window and tokens as one [BD, SP] block.

    seq = [committed window (W-1 columns from conv_state at max(count-1, 0)), x_0 .. x_{L-1}]
    y_t = act(bias + sum_j weight[:, j] seq[t + j])          for t < L   (y: [T, D] contiguous)
    conv_state[slot, :, 0 : W-1+L-drop] <- seq[drop:]        drop = min(L, 1) (oldest input out)
    snap[i_n] <- (slot, or -1 if it must not write; count, bank before the step; bos, L), and the
    request's fault into err (the i_d == 0 program; the rules: _step_row_check). A failed request
    writes nothing; its tokens' rows of y are scratch.
    """
    if PDL:
        _conv_pdl_enter()
    i_d = tl.program_id(0)
    i_n = tl.program_id(1)
    raw, other = _row_slot(state_indices, i_n, N, checks, BN)
    slot, valid, live, bos, L, count, bank, code, value, extra = _step_row_check(
        meta, cu_seqlens, i_n, N, T, S, checks, raw, other, TCAP, TMAX, VARLEN)
    _publish_row(snap, err, meta, state_indices, cu_seqlens, i_n, N, T, S, i_d == 0, slot, valid, count, bank,
                 bos, L, code, value, extra, TCAP, VARLEN)
    count = tl.minimum(tl.maximum(count, 0), TCAP)   # memory safety for corrupt metadata
    off = tl.maximum(count - 1, 0)

    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    m_dv = m_d & _as_block(valid, o_d)              # channels of a real (not padded) request
    c = tl.arange(0, SP)                              # seq columns: [0, W-1) window, [W-1, W-1+L) tokens
    in_win = c < W - 1
    in_x = (c >= W - 1) & (c < W - 1 + L)
    p_c = conv_state + slot * stride_c_n + o_d[:, None] * stride_c_d
    b_win = tl.load(p_c + (off + c)[None, :] * stride_c_w, mask=m_dv[:, None] & in_win[None, :], other=0)
    b_x = tl.load(x + (bos + c - (W - 1))[None, :] * stride_x_t + o_d[:, None] * stride_x_d,
                  mask=m_d[:, None] & in_x[None, :], other=0)
    seq = b_win.to(tl.float32) + b_x.to(tl.float32)   # exactly one term is non-zero per column

    if HAS_BIAS:
        b_bias = tl.load(bias + o_d, mask=m_d, other=0).to(tl.float32)
    for t in tl.static_range(TMAX):
        # the taps of token t sit at seq columns t .. t+W-1: weight column c - t
        j = c - t
        b_w = tl.load(weight + o_d[:, None] * stride_w_d + j[None, :] * stride_w_w,
                      mask=m_d[:, None] & ((j >= 0) & (j < W))[None, :], other=0).to(tl.float32)
        acc = tl.sum(seq * b_w, axis=1)
        if HAS_BIAS:
            acc += b_bias
        if SILU:
            # silu = y * sigmoid(y); exp(-y) overflows to inf for y << 0 and y / inf = -0: no NaN.
            acc = acc / (1 + tl.exp(-acc))
        tl.store(y + (bos + t) * D + o_d, acc.to(y.dtype.element_ty), mask=m_d & _as_block(L > t, o_d))

    # new window, in place: every address written here was read above by this program only, maybe by
    # another thread (the [BD, SP] layouts of the loads and of seq may differ): order loads before stores
    tl.debug_barrier()
    drop = tl.minimum(L, 1)
    dst = c - drop
    m_w = (c >= drop) & (c < W - 1 + L) & (dst < CW)
    tl.store(p_c + dst[None, :] * stride_c_w, seq.to(conv_state.dtype.element_ty),
             mask=m_dv[:, None] & m_w[None, :])


@triton.jit
def _token_inputs(y, a, b, t, live, i_h, i_hv, o_k, o_v, m_k, m_v,
                  stride_y_t, stride_a_t, stride_a_h, stride_b_t, stride_b_h,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Raw inputs of new token t (row t of y, a, b) for q/k head i_h, value head i_hv: (q, k, v, a, b).
    Nothing is loaded when ``live`` is false (zeros)."""
    p_y = y + t * stride_y_t
    m_kl = m_k & _as_block(live, o_k)
    b_q = tl.load(p_y + i_h * K + o_k, mask=m_kl, other=0)
    b_k = tl.load(p_y + H * K + i_h * K + o_k, mask=m_kl, other=0)
    b_v = tl.load(p_y + 2 * H * K + i_hv * V + o_v, mask=m_v & _as_block(live, o_v), other=0)
    b_a = tl.load(a + t * stride_a_t + i_hv * stride_a_h, mask=live, other=0)
    b_b = tl.load(b + t * stride_b_t + i_hv * stride_b_h, mask=live, other=0)
    return b_q, b_k, b_v, b_a, b_b


@triton.jit
def _pending_inputs(pk, pv, pg, pbeta, row, live, i_h, i_hv, o_k, o_v, m_k, m_v,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Kept inputs of pending token row ``row`` (of the [S*2*TCAP] token rows): (k, v, g, beta)."""
    b_k = tl.load(pk + (row * H + i_h) * K + o_k, mask=m_k & _as_block(live, o_k), other=0)
    b_v = tl.load(pv + (row * HV + i_hv) * V + o_v, mask=m_v & _as_block(live, o_v), other=0)
    b_g = tl.load(pg + row * HV + i_hv, mask=live, other=0)
    b_beta = tl.load(pbeta + row * HV + i_hv, mask=live, other=0)
    return b_k, b_v, b_g, b_beta


@triton.jit
def _gating(b_a, b_b, b_A, b_dt):
    """Raw a, b of one token and value head -> (g, beta):  g = A softplus(a + dt_bias),  beta = sigmoid(b);
    b_A = -exp(A_log). softplus with threshold 20: the discarded branch's argument is clamped so exp
    cannot overflow; sigmoid: exp(-b) -> inf for b << 0 gives 1 / inf = 0, the right limit (no NaN)."""
    b_x = b_a.to(tl.float32) + b_dt
    b_g = b_A * tl.where(b_x > 20.0, b_x, tl.log(1 + tl.exp(tl.minimum(b_x, 20.0))))
    b_beta = 1 / (1 + tl.exp(-b_b.to(tl.float32)))
    return b_g, b_beta


@triton.jit
def _qk_norm(c_q, c_k, scale):
    """One token's q, k rows -> float32 l2-normalised (q also scaled)."""
    b_q = c_q.to(tl.float32)
    b_k = c_k.to(tl.float32)
    return b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale, b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)


@triton.jit
def _store_block(p_s, b_s, c, m_k, m_cols):
    """The state block S = c S' into the cache (its dtype) at p_s, the columns m_cols [BV] (rows m_k [BK])."""
    tl.store(p_s, (b_s * c).to(p_s.dtype.element_ty), mask=m_k[:, None] & m_cols[None, :])


@triton.jit
def _delta_rule(b_s, b_k, b_v, b_g, b_beta):
    """One token on a [BK, BV] float32 state block:  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T."""
    b_s = b_s * tl.exp(b_g)                              # g <= 0: exp never overflows
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    return b_s + b_k[:, None] * b_u[None, :]


@triton.jit
def _fold_decay(b_s, c, b_g):
    """Decay folded into a scalar: the true state is c * S'. Returns (S', c * exp(g)); S' itself is
    scaled (and c reset to 1) only when the product would fall under 2^-64, so u / c stays finite."""
    ca = c * tl.exp(b_g)                                 # g <= 0: exp never overflows
    if ca < 5.421010862427522e-20:                       # 2^-64
        b_s = b_s * ca
        ca = ca * 0 + 1.0
    return b_s, ca


@triton.jit(do_not_specialize=["S"])     # one variant for every slot count
def gdn_step_kernel(
    y, a, b, A_log, dt_bias, o,
    ssm, pk, pv, pg, pbeta, meta, snap, state_indices,
    scale, S,
    stride_y_t, stride_a_t, stride_a_h, stride_b_t, stride_b_h,
    stride_s_n, stride_s_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, TCAP: tl.constexpr, TMAX: tl.constexpr, HPP: tl.constexpr,
    KEEP_PENDING: tl.constexpr, FOLD: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program: value columns [i_v*BV, +BV) of HPP consecutive value heads of request i_n.

    y: [T, D] conv outputs (q | k | v channels); a, b: [T, HV]; o: [T, HV, V] contiguous.
    ssm: [S, HV, K, V] (SK between K rows and SV between V columns: compile-time strides, so the block's row
    addresses are one base plus immediate offsets; with it a runtime stride cost ~60 registers of row addresses
    kept from the load to the store, and the one-warp BV-32 decode variant spilled: ptxas, sm_90, Qwen3-Next
    shape, 254 registers with spills -> 218 without. SV = 1 is the allocated cache's [K, V] blocks; SK = 1, SV = K
    newer vLLM's [V, K] blocks (its temporal state (HV, V, K), seen transposed)); pk [S, 2, TCAP, H, K],
    pv [S, 2, TCAP, HV, V], pg / pbeta [S, 2, TCAP, HV], meta [S, 2]: contiguous. snap[i_n] = (slot or -1, count,
    bank, bos, L)
    from the conv kernel, which checked the request: slot -1 (padded or failed) writes nothing but
    zero outputs for its L tokens; L = 0 when its token rows are not trustworthy.

    Per value head:
        S <- ssm[slot]; for the count pending tokens: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T
        verify (KEEP_PENDING): ssm[slot] <- S if count; new tokens -> o, their inputs -> bank 1-bank
        decode: new tokens -> o; ssm[slot] <- S
    Latency: the state block of the next head is loaded while this one is worked on (HPP > 1), and
    each token's inputs are loaded one token ahead, so no load waits behind a reduction.

    FOLD (arithmetic per token and state element: 2 for a pending token, 3 for a new one, 2 for the
    last draft, whose state verify never keeps): the block holds S' with S = c S' (c a scalar), so
    the decay costs one scalar multiply:  c <- c exp(g);  u = beta (v - c S'^T k);  S' += k (u / c)^T;
    verify: o = c S'_prev^T q + (k . q) u  (both reductions read the block once, before its update).
    Decode (TMAX = 1, one token, no loop): o = c S'^T q of the updated block, after the block's store, so
    the 2 MB-per-request state write leaves before o's reduction; with PDL the token's gating (a, b,
    A_log, dt_bias: inputs of earlier launches) is computed before ``gdc_wait``, so only the l2norm, the
    delta rule and the two stores follow the conv. Per layer of a 32-layer graph (H200, float32 state,
    2026-11-24): N = 1 4.87 -> 4.27 us, N = 8 13.6 -> 12.6-12.7 (benchmarks/decode_floor.py, which also
    measures the floor: a bare read + write of the same state bytes in the same graph is 9.8-10.0 us at N = 8).
    (Loading all tokens' inputs as tiles up front and picking rows measured faster only for float32
    states at k = 3 on an H200, and much slower elsewhere: the tiles spill registers at one warp.)

    PDL (small batches on sm_90+, step_config): launched as the conv kernel's programmatic dependent,
    so its programs start while the conv runs; each reads its state block at the request's own slot
    (state_indices, clamped to [0, S): a safe address whatever the value) before ``gdc_wait``, the
    conv's verdict after it. A request the conv let through has exactly that slot; any other writes
    nothing, so what the early read got never leaves the program. Before the wait nothing is read
    that the conv writes (y, snap, meta) and nothing is written.
    """
    i_v = tl.program_id(0)
    i_n = tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    i_hv = tl.program_id(1) * HPP
    if PDL:
        p_s = (ssm + _own_slot(state_indices, i_n, S) * stride_s_n + i_hv * stride_s_h + o_k[:, None] * SK
               + o_v[None, :] * SV)
        if TMAX == 1 and not KEEP_PENDING:
            # decode: each line of the state is read once, here, and written once after the wait: ask L2 to evict
            # these first (H200, per layer of a 32-layer graph, three alternating rounds: N = 8 11.776 -> 11.670 us,
            # N = 1 3.994 -> 3.999; the same hint on the stores, or .cs stores: slower; RESULTS.md 2026-11-27)
            b_next = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0, eviction_policy="evict_first")
        elif TMAX != 0:                             # (materialize reads its block after the verdict: below)
            b_next = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0)
        if TMAX == 1 and not KEEP_PENDING:
            # decode: request i_n's one token is row i_n (the conv kernel's bos; L = 1: no cu_seqlens,
            # T = N), so the first head's a, b (inputs of earlier launches) load before the wait and
            # its q, k, v right after it, beside the verdict rather than behind it
            # and its gating (A_log, dt_bias are weights): none of it waits behind the conv
            e_a = tl.load(a + i_n * stride_a_t + i_hv * stride_a_h)
            e_b = tl.load(b + i_n * stride_b_t + i_hv * stride_b_h)
            e_g, e_beta = _gating(e_a, e_b, -tl.exp(tl.load(A_log + i_hv).to(tl.float32)),
                                  tl.load(dt_bias + i_hv).to(tl.float32))
        tl.extra.cuda.gdc_wait()                    # the conv kernel's writes (y, snap) are visible now
        # the next kernel may launch (a PDL-launched one waits for this one's end before reading anything)
        tl.extra.cuda.gdc_launch_dependents()
        if TMAX == 1 and not KEEP_PENDING:
            p_y = y + i_n * stride_y_t
            e_h = i_hv // (HV // H)
            e_q = tl.load(p_y + e_h * K + o_k, mask=m_k, other=0)
            e_k = tl.load(p_y + H * K + e_h * K + o_k, mask=m_k, other=0)
            e_v = tl.load(p_y + 2 * H * K + i_hv * V + o_v, mask=m_v, other=0)
    slot = tl.load(snap + i_n * 5).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    m_vv = m_v & _as_block(valid, o_v)
    m_s = m_k[:, None] & m_vv[None, :]
    if not PDL:
        p_s = ssm + slot * stride_s_n + i_hv * stride_s_h + o_k[:, None] * SK + o_v[None, :] * SV
    if TMAX == 0:
        # materialize: a slot with no pending token keeps its state as it is, so its blocks are not even read (a
        # prefill's materialize of requests without drafts reads nothing: 2 MB per request at Qwen3-Next's shape)
        count = tl.load(snap + i_n * 5 + 1)
        m_s = m_s & _as_block(count > 0, o_v)[None, :]
        b_next = tl.load(p_s, mask=m_s, other=0)
    elif not PDL:
        # the state block of the first head: the one read of it, issued right after the verdict
        b_next = tl.load(p_s, mask=m_s, other=0)

    count = tl.load(snap + i_n * 5 + 1)              # clamped to [0, TCAP] by conv_step_kernel
    bank = tl.load(snap + i_n * 5 + 2).to(tl.int64)
    bos = tl.load(snap + i_n * 5 + 3).to(tl.int64)   # checked: [bos, bos + L) inside [0, T)
    L = tl.load(snap + i_n * 5 + 4)                  # in [0, TMAX]
    pb = (slot * 2 + bank) * TCAP                     # token row 0 of the pending bank
    nb = (slot * 2 + (1 - bank)) * TCAP               # token row 0 of the other bank
    zero = i_n * 0                                    # (a tensor 0: comparisons with loop ints stay tensors)

    for j in tl.static_range(HPP):
        i_hv = tl.program_id(1) * HPP + j
        i_h = i_hv // (HV // H)
        # prologue loads, all independent of the state: first pending token, first new token
        n_pk, n_pv, n_pg, n_pbeta = _pending_inputs(pk, pv, pg, pbeta, pb, count > 0, i_h, i_hv, o_k, o_v,
                                                    m_k, m_v, H, HV, K, V)
        if PDL and TMAX == 1 and not KEEP_PENDING and j == 0:
            n_q, n_k, n_v, n_a, n_b = e_q, e_k, e_v, e_a, e_b      # the same rows, loaded early (above)
        else:
            n_q, n_k, n_v, n_a, n_b = _token_inputs(y, a, b, bos, L > 0, i_h, i_hv, o_k, o_v, m_k, m_v, stride_y_t,
                                                    stride_a_t, stride_a_h, stride_b_t, stride_b_h, H, K, V)
        b_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
        b_cur = b_next
        if j + 1 < HPP:
            # the next head's block: in flight while this head is worked on
            b_next = tl.load(p_s + stride_s_h, mask=m_s, other=0)
        b_s = b_cur.to(tl.float32)                   # bf16 states: rounded once, at the store
        if FOLD:
            c = (i_n * 0).to(tl.float32) + 1.0       # the state is c * b_s
        else:
            c = 1.0                                  # (b_s * 1.0 folds away)

        # 1. fold the pending tokens (accepted inputs kept by the previous verify) into the state
        for i in range(0, count):
            c_k, c_v, c_g, c_beta = n_pk, n_pv, n_pg, n_pbeta
            n_pk, n_pv, n_pg, n_pbeta = _pending_inputs(pk, pv, pg, pbeta, pb + i + 1, zero + i + 1 < count,
                                                        i_h, i_hv, o_k, o_v, m_k, m_v, H, HV, K, V)
            if FOLD:
                b_kf = c_k.to(tl.float32)
                b_s, c = _fold_decay(b_s, c, c_g.to(tl.float32))
                b_u = c_beta.to(tl.float32) * (c_v.to(tl.float32) - c * tl.sum(b_s * b_kf[:, None], axis=0))
                b_s = b_s + b_kf[:, None] * (b_u / c)[None, :]
            else:
                b_s = _delta_rule(b_s, c_k.to(tl.float32), c_v.to(tl.float32), c_g.to(tl.float32),
                                  c_beta.to(tl.float32))
        if KEEP_PENDING:
            # verify: the committed state (accepted prefix included) is written once, before the drafts
            _store_block(p_s, b_s, c, m_k, m_vv & _as_block(count > 0, o_v))

        # 2. the new tokens: gating, l2norm, delta rule, output
        if TMAX == 1 and not KEEP_PENDING:
            # decode: one token (L = 1; L = 0 only where the row's offsets failed, and then valid is false too),
            # straight-line: the state block is stored before o's reduction, so the store leaves first
            live = L > 0
            if PDL and j == 0:
                b_g, b_beta = e_g, e_beta
            else:
                b_g, b_beta = _gating(n_a, n_b, b_A, b_dt)
            b_g = tl.where(live, b_g, 0.0)             # a row without a token leaves the block as it is
            b_beta = tl.where(live, b_beta, 0.0)
            b_q, b_k = _qk_norm(n_q, n_k, scale)
            if FOLD:
                b_s, c = _fold_decay(b_s, c, b_g)
                b_u = b_beta * (n_v.to(tl.float32) - c * tl.sum(b_s * b_k[:, None], axis=0))
                b_s = b_s + b_k[:, None] * (b_u / c)[None, :]
            else:
                b_s = _delta_rule(b_s, b_k, n_v.to(tl.float32), b_g, b_beta)
            _store_block(p_s, b_s, c, m_k, m_vv & _as_block(count + L > 0, o_v))
            b_o = c * tl.sum(b_s * b_q[:, None], axis=0)     # o = S^T q of the updated state S = c S'
            b_o = tl.where(valid, b_o, 0.0)                  # padded rows: zeros
            tl.store(o + (bos * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v & _as_block(live, o_v))
        else:                                          # verify (and materialize: L = 0)
            own_k = valid & (i_v == 0) & (i_hv % (HV // H) == 0)   # one program per q/k head stores k
            own_gb = valid & (i_v == 0)                             # one program per value head stores g, beta
            for i in range(0, L):
                t = bos + i
                c_q, c_k, c_v, c_a, c_b = n_q, n_k, n_v, n_a, n_b
                n_q, n_k, n_v, n_a, n_b = _token_inputs(y, a, b, t + 1, zero + i + 1 < L, i_h, i_hv, o_k, o_v,
                                                        m_k, m_v, stride_y_t, stride_a_t, stride_a_h, stride_b_t,
                                                        stride_b_h, H, K, V)
                b_q, b_k = _qk_norm(c_q, c_k, scale)
                b_kq = tl.sum(b_k * b_q)
                b_g, b_beta = _gating(c_a, c_b, b_A, b_dt)
                if FOLD:
                    b_s, c = _fold_decay(b_s, c, b_g)
                    b_u = b_beta * (c_v.to(tl.float32) - c * tl.sum(b_s * b_k[:, None], axis=0))
                    b_o = c * tl.sum(b_s * b_q[:, None], axis=0) + b_kq * b_u
                    if KEEP_PENDING:
                        if zero + i + 1 < L:                     # the last draft's state is never used
                            b_s = b_s + b_k[:, None] * (b_u / c)[None, :]
                    else:
                        b_s = b_s + b_k[:, None] * (b_u / c)[None, :]
                else:
                    b_s = _delta_rule(b_s, b_k, c_v.to(tl.float32), b_g, b_beta)
                    b_o = tl.sum(b_s * b_q[:, None], axis=0)
                b_o = tl.where(valid, b_o, 0.0)                  # padded rows: zeros
                tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
                if KEEP_PENDING:
                    tl.store(pk + ((nb + i) * H + i_h) * K + o_k, b_k.to(pk.dtype.element_ty),
                             mask=m_k & _as_block(own_k, o_k))
                    tl.store(pv + ((nb + i) * HV + i_hv) * V + o_v, c_v.to(pv.dtype.element_ty), mask=m_vv)
                    tl.store(pg + (nb + i) * HV + i_hv, b_g.to(pg.dtype.element_ty), mask=own_gb)
                    tl.store(pbeta + (nb + i) * HV + i_hv, b_beta.to(pbeta.dtype.element_ty), mask=own_gb)
        if TMAX == 0:
            # materialize: the one write of the state block (skipped when nothing changed)
            _store_block(p_s, b_s, c, m_k, m_vv & _as_block(count + L > 0, o_v))
        p_s += stride_s_h

    own_meta = valid & (i_v == 0) & (tl.program_id(1) == 0)
    if KEEP_PENDING:   # the new tokens pending in the other bank; the slot awaits its accept
        tl.store(meta + slot * 2, L.to(tl.int32), mask=own_meta)
        tl.store(meta + slot * 2 + 1, ((1 - bank) | _AWAIT).to(tl.int32), mask=own_meta)
    else:
        tl.store(meta + slot * 2, (count * 0).to(tl.int32), mask=own_meta)


@triton.jit(do_not_specialize=["N", "T", "S"])   # one variant for every batch size, token count and cache size
def prefill_rows_kernel(meta, err, state_indices, has_initial_state, cu_seqlens, rows, N, T, S,
                        BN: tl.constexpr, HAS_FLAGS: tl.constexpr):
    """gdn_prefill's verdicts, one program for the call's N requests (blocks of BN; the duplicate scan
    pairwise, as the steps'): the value rules of refgdn.serving.step_faults without a token cap.

    rows: int32 [3N] written: rows[:2N] as [N, 2] = (slot written, slot read) per request, -1 for none (a
    padded or failed request writes nothing and reads nothing; without an initial state it reads nothing),
    the form the conv and state kernels take (their SLOTS); rows[2N:] = the slots written again, a contiguous
    [N] for gdn_materialize. The lowest faulty request's fault goes into err (if it is empty).
    """
    c0 = tl.load(cu_seqlens).to(tl.int64)
    cN = tl.load(cu_seqlens + N).to(tl.int64)
    first = N * 0 + N                                 # the lowest faulty request so far (N: none)
    f_code = (N * 0).to(tl.int64)
    f_value = f_code
    f_extra = f_code
    for start in range(0, N, BN):
        o = start + tl.arange(0, BN)
        m = o < N
        raw = tl.load(state_indices + o, mask=m, other=-1).to(tl.int64)   # rows past N: padded
        in_range, real, slot = _safe_slot(raw, S)
        word = tl.load(meta + slot * 2 + 1, mask=real, other=0)
        bos = tl.load(cu_seqlens + o, mask=m, other=0).to(tl.int64)
        eos = tl.load(cu_seqlens + o + 1, mask=m, other=0).to(tl.int64)
        other = _earliest_others(state_indices, raw, o, N, BN)
        code, value, extra = _step_code(raw, in_range, real, o, N, T, bos, eos, other, word, S, -1, True)
        live = (c0 == 0) & (cN == T) & (bos >= 0) & (bos <= eos) & (eos <= T)
        ok = m & live & real & (code == 0) & (other >= 2 * N)   # (another row with the slot: both fail)
        reads = ok
        if HAS_FLAGS:
            reads = ok & (tl.load(has_initial_state + o, mask=m, other=0) != 0)
        w = tl.where(ok, slot, -1).to(tl.int32)
        tl.store(rows + o * 2, w, mask=m)
        tl.store(rows + o * 2 + 1, tl.where(reads, slot, -1).to(tl.int32), mask=m)
        tl.store(rows + 2 * N + o, w, mask=m)
        bad = m & (code != 0)
        n_bad = tl.min(tl.where(bad, o, N), axis=0)
        take = (first == N) & (n_bad < N)
        at = o == n_bad
        f_code = tl.where(take, tl.sum(tl.where(at, code, 0), axis=0), f_code)
        f_value = tl.where(take, tl.sum(tl.where(at, value, 0), axis=0), f_value)
        f_extra = tl.where(take, tl.sum(tl.where(at, extra, 0), axis=0), f_extra)
        first = tl.where(take, n_bad, first)
    _record_fault(err, first < N, f_code, first, f_value, f_extra)


@triton.jit
def _accept_rows(meta, state_indices, num_accepted, o_n, N, S, BC: tl.constexpr):
    """The value rules of gdn_accept (refgdn.serving.accept_faults) for a block of requests o_n [BN].

    Returns (slot, ok, count, word, acc, code, value, extra): slot a safe address, ok the row writes;
    code its fault (0: none), the rules applied from the lowest priority to the highest, each overriding.
    """
    m_n = o_n < N
    raw = tl.load(state_indices + o_n, mask=m_n, other=-1).to(tl.int64)   # rows past N: padded
    in_range = raw < S                                # any negative index: a padded row
    real = in_range & (raw >= 0)
    slot = tl.where(real, raw, 0)
    count = tl.load(meta + slot * 2, mask=real, other=0)
    word = tl.load(meta + slot * 2 + 1, mask=real, other=0)
    acc = tl.load(num_accepted + o_n, mask=m_n, other=0).to(tl.int64)
    other = _earliest_others(state_indices, raw, o_n, N, BC)
    dup = real & (other < 2 * N)
    zero = raw * 0
    f = real & ((acc < tl.minimum(count, 1)) | (acc > count))
    code, value, extra = tl.where(f, _E_ACCEPT_RANGE, zero), tl.where(f, acc, zero), tl.where(f, count, zero)
    f = real & ((word & _AWAIT) == 0)
    code, value, extra = tl.where(f, _E_NO_VERIFY, code), tl.where(f, raw, value), tl.where(f, 0, extra)
    f = real & (other < N)
    code, value, extra = tl.where(f, _E_SLOT_DUP, code), tl.where(f, raw, value), tl.where(f, other, extra)
    f = in_range == 0
    code, value, extra = tl.where(f, _E_SLOT_RANGE, code), tl.where(f, raw, value), tl.where(f, S, extra)
    ok = real & (code == 0) & (dup == 0)
    return slot, ok, count, word, acc, code, value, extra


@triton.jit(do_not_specialize=["N", "S"])  # one compiled variant for every batch size (N == 1 included)
def accept_kernel(meta, err, state_indices, num_accepted, N, S, BN: tl.constexpr, BC: tl.constexpr):
    """count[slot] <- num_accepted, AWAIT_ACCEPT cleared, for the rows of a block of BN requests that pass
    the value rules (_accept_rows: slot in [0, S) or negative (padded), no other row with the same slot
    (a [BN, BC] pairwise compare per column block: deterministic, no atomics), a verify awaiting the
    accept, num_accepted in [min(1, count), count]). The block holding the call's lowest faulty row
    records that row's fault (a block with a fault first re-checks the blocks before it: error path only).
    """
    pid = tl.program_id(0)
    o_n = pid * BN + tl.arange(0, BN)
    slot, ok, count, word, acc, code, value, extra = _accept_rows(meta, state_indices, num_accepted, o_n, N, S, BC)
    tl.store(meta + slot * 2, acc.to(tl.int32), mask=ok)
    tl.store(meta + slot * 2 + 1, (word & 1).to(tl.int32), mask=ok)
    bad = tl.min(tl.where(code != 0, o_n, N), axis=0)
    if bad < N:
        before = pid * 0
        for start in range(0, pid * BN, BN):
            _s, _ok, _c, _w, _a, code_b, _v, _e = _accept_rows(meta, state_indices, num_accepted,
                                                               start + tl.arange(0, BN), N, S, BC)
            before = tl.maximum(before, tl.max(tl.where(code_b != 0, 1, 0), axis=0))
        pick = o_n == bad
        _record_fault(err, before == 0, tl.sum(tl.where(pick, code, 0), axis=0), bad,
                      tl.sum(tl.where(pick, value, 0), axis=0), tl.sum(tl.where(pick, extra, 0), axis=0))


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def _on_refgdn(cache: GDNStateCache, op, *args):
    """A float64 call (the kernels compute in float32): refgdn's twin ``op(*args)`` (values unchecked on the host:
    its faults are recorded in cache.err as the kernels' are), then :func:`_check_if_free`. Returns op's result."""
    out = op(*args)
    _check_if_free(cache)
    return out


def _check_if_free(cache: GDNStateCache) -> None:
    """cache.check() when it costs nothing: the cache lives in host memory (CPU, the Triton interpreter).
    On a GPU reading err is a device->host copy and a sync (far over 5 us, and it would stall the
    launch queue), so there the caller checks at its next sync. Never while a graph captures (a host read
    is forbidden there: refgdn.capture's simulated graphs say so too)."""
    if cache.err.device.type == "cpu" and not _capturing():
        cache.check()


def _capturing() -> bool:
    """torch.cuda.is_current_stream_capturing(), False on a CPU-only build of torch (where it raises)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


class _StepPlan:
    """Everything a step's two launches derive from the call's metadata alone, computed once per signature.

    Built by :func:`_build_plan` from shapes, strides, dtypes, devices, None-ness, mode and activation
    (never from values): grid sizes, the kernels' scalar and constexpr arguments (configs from
    :func:`step_config` / :func:`conv_config`), output shapes, whether any unit-stride input needs a
    ``.contiguous()`` copy, whether the cache's fault word lives in host memory, and the two launches
    (fast.launch.Relaunch of the kernels as the plan was built: benchmarks that stub the kernels clear the
    plans). :func:`_run` adds the per-call parts: the tensors, fresh outputs, the scale's value. No tensor
    is kept: one plan serves every cache of the same geometry.
    """
    __slots__ = ("N", "T", "y_shape", "o_shape", "snap_offset", "scratch_bytes", "act_dtype", "device",
                 "unit_stride", "host_err", "scale", "conv_grid", "conv_args", "conv_kw", "step_grid", "step_args",
                 "step_kw", "conv_launch", "step_launch", "fp64")


def _build_plan(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                activation, mode: str, checks: bool = True, reuse: bool = False) -> _StepPlan:
    """The _StepPlan of a call (reads metadata only; the arguments are assumed to have passed the checks).
    reuse: the plan will serve later calls (its launches keep their compiled kernels: fast.launch.Relaunch)."""
    H, HV, K, V, D, W, TC = cache.H, cache.HV, cache.K, cache.V, cache.D, cache.W, cache.tokens_cap
    p = _StepPlan()
    N = p.N = state_indices.shape[0]
    T = p.T = mixed_qkv.shape[0]
    p.y_shape, p.o_shape = (T, D), (T, HV, V)          # conv outputs y [T, D]; outputs o [T, HV, V]
    p.snap_offset = Carved.nbytes(mixed_qkv.dtype, p.y_shape)   # scratch: y, then snap [N, 5] int32
    p.scratch_bytes = p.snap_offset + Carved.nbytes(torch.int32, (N, 5))
    p.act_dtype, p.device = mixed_qkv.dtype, cache.ssm_state.device
    # the kernels compute in float32: a float64 call runs refgdn (gdn_decode / gdn_verify / gdn_materialize), as
    # gdn_prefill's does
    p.fp64 = _is_fp64(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache.ssm_state, cache.conv_state)
    # the kernels index these with unit stride: copy the (rare) strided ones, per call
    p.unit_stride = all(t is None or t.is_contiguous() for t in (state_indices, A_log, dt_bias, cu_seqlens,
                                                                 conv_bias))
    p.host_err = cache.err.device.type == "cpu"
    p.scale = float(K ** -0.5)
    varlen = cu_seqlens is not None
    TMAX = {"decode": 1, "verify": TC, "materialize": 0}[mode]
    cc = conv_config(D, W, N)
    cs = cache.conv_state
    p.conv_kw = dict(W=W, TCAP=TC, TMAX=TMAX, BD=cc["BD"], VARLEN=varlen, BN=DUP_BLOCK,
                     SILU=activation in ("silu", "swish"), HAS_BIAS=conv_bias is not None,
                     num_warps=cc["num_warps"])
    window_conv = W <= 4                                # conv_step_kernel, else conv_step_any_w_kernel
    if window_conv:
        p.conv_kw.update(CWP=next_pow2(max(W - 1, W - 2 + TMAX)))  # the columns a step writes
    else:
        p.conv_kw.update(CW=cs.shape[2], SP=next_pow2(W - 1 + TMAX))
    p.conv_grid = (cdiv(D, cc["BD"]), N)
    p.conv_args = (D, N, T, cache.num_slots, int(checks),
                   mixed_qkv.stride(0), mixed_qkv.stride(1), conv_weight.stride(0), conv_weight.stride(1),
                   cs.stride(0), cs.stride(1), cs.stride(2))
    sc = step_config(K, V, cache.ssm_state.dtype, HV, mode, N, pdl_ok=pdl_supported(p.device))
    BV, HPP = sc["BV"], sc["HPP"]
    s = cache.ssm_state
    p.step_grid = (cdiv(V, BV), HV // HPP, N)
    p.step_args = (cache.num_slots,
                   D,                                   # y.stride(0): y is a fresh contiguous [T, D]
                   a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                   s.stride(0), s.stride(1))
    p.step_kw = dict(H=H, HV=HV, K=K, V=V, SK=s.stride(2), SV=s.stride(3), BK=next_pow2(K), BV=BV, TCAP=TC,
                     TMAX=TMAX, HPP=HPP, KEEP_PENDING=mode == "verify", FOLD=bool(sc["fold"]),
                     num_warps=sc["num_warps"])
    if sc["pdl"]:                                       # both kernels programmatic dependents (see the kernels)
        p.conv_kw.update(PDL=True, launch_pdl=True)
        p.step_kw.update(PDL=True, launch_pdl=True)
    p.conv_launch = Relaunch(conv_step_kernel if window_conv else conv_step_any_w_kernel, p.conv_grid, p.conv_kw,
                             reuse)
    p.step_launch = Relaunch(gdn_step_kernel, p.step_grid, p.step_kw, reuse)
    return p


def _run(p: _StepPlan, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
         scale):
    """The step's two launches with plan ``p`` (built for these arguments' metadata). Returns o."""
    if not p.unit_stride:
        state_indices, A_log, dt_bias = state_indices.contiguous(), A_log.contiguous(), dt_bias.contiguous()
        cu_seqlens = cu_seqlens.contiguous() if cu_seqlens is not None else None
        conv_bias = conv_bias.contiguous() if conv_bias is not None else None
    dev = p.device
    o = torch.empty(p.o_shape, dtype=p.act_dtype, device=dev)
    if p.N == 0:
        return o
    # the conv -> step scratch, one allocation: y [T, D] (conv outputs), snap [N, 5] int32 (slot | -1, count,
    # bank, bos, L); the launches take their addresses (fast.launch.Carved)
    scratch = torch.empty(p.scratch_bytes, dtype=torch.uint8, device=dev)
    y = Carved(scratch, 0, p.act_dtype, p.y_shape)
    snap = Carved(scratch, p.snap_offset, torch.int32, (p.N, 5))
    p.conv_launch(mixed_qkv, conv_weight, conv_bias if conv_bias is not None else conv_weight, y,
                  cache.conv_state, cache.pend_meta, snap, cache.err, state_indices,
                  cu_seqlens if cu_seqlens is not None else state_indices, *p.conv_args)
    p.step_launch(y, a, b, A_log, dt_bias, o,
                  cache.ssm_state, cache.pend_k, cache.pend_v, cache.pend_g, cache.pend_beta, cache.pend_meta, snap,
                  state_indices, p.scale if scale is None else float(scale), *p.step_args)
    return o


def _launch(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
            scale, activation, mode: str, checks: bool = True):
    """mode: "decode" (one token per request), "verify" (cu_seqlens) or "materialize" (no tokens).
    checks=False (benchmarks/bench_decode.py's cost measurement only, valid inputs only): the conv
    kernel skips the duplicate scan and the global offset checks; the ops never pass it.
    Uncached: the plan is built for this call (gdn_decode / gdn_verify reuse theirs: _checked_plan)."""
    plan = _build_plan(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                       activation, mode, checks)
    return _run(plan, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                scale)


# ----------------------------------------------------------------------------------------------
# host checks and plans, cached by signature
# ----------------------------------------------------------------------------------------------

PLAN_CACHE_SIZE = 64     # signatures kept (the oldest dropped): batch sizes x modes x cache geometries
# key -> entry (extras, guard, value); value: _StepPlan (steps), (N, launch) (accept), (N, inputs, plan) (materialize)
_PLANS = PlanCache(PLAN_CACHE_SIZE)
# (mode, batch dims) -> the entry of the last call of that mode and batch size that passed the checks (compared first:
# _checked_entry); a serving stream's sizes change from call to call, and each keeps its own last entry
_LAST: dict = {}
LAST_SLOTS = 64          # (mode, batch dims) slots kept in _LAST (all forgotten when a new one would exceed it)


def _dim0(t):
    """A tensor's first dim (None for anything else): the cheap batch-size hint of _checked_entry's last entries."""
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None


def _checked_plan(mode: str, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                  cu_seqlens, scale, activation, check_values: bool) -> _StepPlan:
    """refgdn's check_step_inputs for the call, then its _StepPlan; both skipped for a known signature.

    What is cached: for each signature (refgdn.serving.step_signature: every tensor's type, shape, stride,
    dtype and device, the cache's type and its fields' metadata, type(scale), activation) whose call
    passed the shape/dtype/device checks, the plan built for it, keyed together with the mode and the
    config functions in use (step_config / conv_config are looked up per call: benchmark sweeps and tests
    wrap them). Why it is safe: those checks read nothing but what the signature holds, so a call with an
    equal signature passes them too; the signature is recomputed from the tensors on every call, so a
    tensor changed in place or a cache field replaced gives another signature. What invalidates it: any
    difference misses and runs the full checks again; a call that fails them is never stored; an argument
    the signature cannot describe (None returned) is always checked in full. The value rules are not
    cached: check_values=True reads the values on the host on every call, as before, and the kernels'
    device-side checks are unchanged. Bounded: at most PLAN_CACHE_SIZE signatures (fast.launch.PlanCache).
    The mode's last entry is compared first, without building the signature: its non-tensor part (the
    extras: mode, configs, type(cache), type(scale), activation) by one tuple compare, its tensors'
    metadata by a :class:`fast.launch.MetaGuard` (one C++ call over refgdn.serving.step_tensors; equal
    guards imply equal signatures). The configs' other input, is_interpreting(), is fixed once fast is
    imported (fast/__init__ sets TRITON_INTERPRET before any kernel is defined), so it is not part of the key.
    """
    args = (mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens)

    def checked(reuse: bool) -> _StepPlan:
        check_step_inputs(*args, scale, activation, False)
        return _build_plan(*args, activation, mode, reuse=reuse)
    extras = (mode, step_config, conv_config, type(cache), type(scale), type(activation), activation)
    plan = _checked_entry(mode, extras, rs.step_tensors, args,
                          lambda: rs.step_signature(*args, scale, activation), checked,
                          (_dim0(state_indices), _dim0(mixed_qkv)))
    if check_values:                      # check_step_inputs' value rules: host reads, every call
        raise_first(step_value_faults(cache, state_indices, cu_seqlens, plan.T)[1])
    return plan


def _checked_entry(mode: str, extras: tuple, tensors_of, args: tuple, signature, checked, hint=None):
    """What a call needs beyond its arguments (a plan, its launches, constants): the value remembered when a
    call with the same signature passed the checks before, else ``checked(reuse)``, which runs the full
    checks (raising on bad input: nothing is remembered) and builds the value (reuse: whether it will be
    remembered, i.e. the signature is not None).

    extras: the call's non-tensor inputs to the checks and the config functions in use (a tuple of types,
    functions, str / None; the mode first); tensors_of(*args, absent=ABSENT): the tensors its signature covers
    (ABSENT for a None optional one); signature(): its signature; hint: the call's batch dims (hashable, cheap;
    e.g. _dim0 of state_indices). The last entry of the mode at that hint is compared first: extras, then the
    tensors' metadata through the entry's MetaGuard (one C++ call: no signature is built); the hint only picks
    which entry's guard is tried, the guard decides. On a miss the signature is looked up (_PLANS), and on a
    miss there the call is checked in full. Per batch size, so a serving stream whose batch sizes change from
    call to call still finds its entries without a signature (gdn_prefill's materialize: ~40 us of host work
    per call on an H200 host before)."""
    slot = (mode, hint)
    last = _LAST.get(slot)
    if last is not None and last[0] == extras:
        try:
            if last[1].check(*tensors_of(*args, absent=ABSENT)):
                return last[2]
        except AttributeError:            # a cache without its fields: the full path raises the error
            pass
    sig = signature()
    if sig is None:                       # not describable: checked in full on every call, never remembered
        return checked(False)
    key = (extras, sig)
    entry = _PLANS.get(key)
    tensors = tensors_of(*args, absent=ABSENT)
    if entry is None:
        value = checked(True)
    elif entry[1].check(*tensors):
        _remember_last(slot, entry)
        return entry[2]
    else:   # same signature, guard missed: e.g. made outside torch.inference_mode (dispatch keys): a new guard
        value = entry[2]
    entry = (extras, MetaGuard(tensors), value)
    _PLANS.put(key, entry)
    _remember_last(slot, entry)
    return value


def _remember_last(slot: tuple, entry: tuple) -> None:
    if slot not in _LAST and len(_LAST) >= LAST_SLOTS:
        _LAST.clear()
    _LAST[slot] = entry


def clear_plan_cache() -> None:
    """Forget every cached signature (the next call of each kind checks in full). Tests and benchmarks."""
    _PLANS.clear()
    _LAST.clear()
    _PREFILL_PLANS.clear()


def gdn_decode(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache: GDNStateCache, state_indices,
               scale: Optional[float] = None, activation: Optional[str] = "silu", check_values: bool = False):
    """One decode token per request, in place in the slot cache: conv update + gating + l2norm + delta rule.

    mixed_qkv: [N, D]   a, b: [N, HV]   conv_weight: [D, W]   conv_bias: [D] or None   A_log, dt_bias: [HV]
    state_indices: [N] int (negative = padded row: reads nothing, writes nothing, output zeros)
    Returns o: [N, HV, V] in mixed_qkv's dtype.

        S <- fold(pending);  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = scale S^T q

    Values are checked on the device (module docstring): a bad request writes nothing and its fault
    is raised by ``cache.check()`` (on a CPU device by the op itself); check_values=True checks on the
    host first (a sync). Two launches (conv, then gating + l2norm + delta rule in one kernel); one read
    and one write of each state block. Pending tokens of a previous verify are folded in first; the slot
    ends committed. The kernels compute in float32: float64 (an input or the cache) runs refgdn.
    """
    p = _checked_plan("decode", mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                      None, scale, activation, check_values)
    if p.fp64:
        return _on_refgdn(cache, rs.gdn_decode, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache,
                          state_indices, scale, activation, False)
    o = _run(p, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, None, scale)
    if p.host_err and not _capturing():           # _check_if_free, with the device looked up once per plan
        cache.check()
    return o


def gdn_verify(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache: GDNStateCache, state_indices,
               cu_seqlens, scale: Optional[float] = None, activation: Optional[str] = "silu",
               check_values: bool = False):
    """Speculative verify: 1 + k_n tokens for request n (k_n may differ), an output for every token.

    mixed_qkv: [T, D]   a, b: [T, HV]   cu_seqlens (query_start_loc): [N+1], request n owns tokens
    [cu[n], cu[n+1]), at most 1 + cache.max_draft of them   state_indices: [N]   (rest as gdn_decode)
    Returns o: [T, HV, V] in mixed_qkv's dtype.

        S <- fold(pending) (written back once);  for each new token: the delta rule on from S, o_t

    State traffic is a decode's (one read, one write per block) plus the few pending inputs. The new
    tokens become pending, all accepted until :func:`gdn_accept`, which must come next for these slots
    (refgdn.serving's sequence rules). Values: checked on the device, as gdn_decode; float64 runs refgdn, as
    gdn_decode.
    """
    if cu_seqlens is None:
        raise ValueError("cu_seqlens must be given for a verify step ([N+1] int, vLLM's query_start_loc)")
    p = _checked_plan("verify", mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                      cu_seqlens, scale, activation, check_values)
    if p.fp64:
        return _on_refgdn(cache, rs.gdn_verify, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache,
                          state_indices, cu_seqlens, scale, activation, False)
    o = _run(p, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens, scale)
    if p.host_err and not _capturing():           # _check_if_free
        cache.check()
    return o


PREFILL_BLOCK = 64       # requests per step of prefill_rows_kernel's loop (fixed: one variant for every N)
PREFILL_CHUNK = 64       # gdn_prefill's chunk size, and its conv's rows per tile: both tile by the same table


def prefill_update_x2(dtype: torch.dtype) -> bool:
    """Whether gdn_prefill's state update takes two bf16 terms (fast.chunk.state's UPDATE_X2): for bf16 inputs,
    since its final state lives on in the cache; half the state's error for a few per cent of device time, where
    the call is host-bound anyway (benchmarks/RESULTS.md, 2026-11-27). fast.keys asks the same."""
    return dtype == torch.bfloat16
# gdn_prefill's signatures (_prefill_signature) that passed the shape checks -> the LaunchPlan of their launches, from
# a signature's second call on (as fast.chunk's and fast.conv's)
_PREFILL_PLANS = SignaturePlans(PLAN_CACHE_SIZE, seen_size=256)


def _prefill_signature(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                       has_initial_state, scale, activation, cu_seqlens_cpu) -> Optional[tuple]:
    """What refgdn.serving.check_prefill_inputs reads, less the token count T and the request count N (so one entry
    serves a serving stream's changing shapes; fast.chunk's call signatures do the same): each tensor's
    fast.launch.shape_key less its T or N dim, the cache's fields' tensor_signature (contiguity included), the
    equalities the checks test (a's and b's T equal mixed_qkv's, state_indices' and has_initial_state's N equal
    cu_seqlens' length - 1, cu_seqlens_cpu's shape cu_seqlens', N == 0, T == 0), type(cache), type(scale) and
    activation. None when an argument cannot be described (then checked in full)."""
    if activation is not None and type(activation) is not str:
        return None
    try:
        T, N = mixed_qkv.shape[0], cu_seqlens.shape[0] - 1
        return (type(cache), type(scale), activation, shape_key(mixed_qkv, 0), shape_key(a, 0), shape_key(b, 0),
                shape_key(conv_weight), shape_key(conv_bias), shape_key(A_log), shape_key(dt_bias),
                shape_key(state_indices, 0), shape_key(cu_seqlens, 0), shape_key(has_initial_state, 0),
                shape_key(cu_seqlens_cpu, 0), a.shape[0] == T, b.shape[0] == T, state_indices.shape[0] == N,
                has_initial_state is None or has_initial_state.shape[0] == N,
                cu_seqlens_cpu is None or cu_seqlens_cpu.shape == cu_seqlens.shape, N == 0, T == 0,
                *map(rs.tensor_signature, rs.cache_fields(cache)))
    except Exception:  # noqa: BLE001 - not a tensor / a cache, too few dims: the full checks name the problem
        return None


@one_host_read   # cu_seqlens' values read to the host once per call (none with cu_seqlens_cpu)
def gdn_prefill(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache: GDNStateCache, state_indices,
                cu_seqlens, has_initial_state=None, scale: Optional[float] = None,
                activation: Optional[str] = "silu", check_values: bool = False, cu_seqlens_cpu=None):
    """Prefill in the chunked form, in place in the slot cache (refgdn.serving.gdn_prefill's twin: same arguments,
    semantics and faults).

    mixed_qkv: [T, D]   a, b: [T, HV]   cu_seqlens (query_start_loc): [N+1]   state_indices: [N] (negative =
    padded row)   has_initial_state: [N] bool or None (every request continues from its slot)   cu_seqlens_cpu:
    cu_seqlens' values as a CPU tensor (vLLM's query_start_loc_cpu) or None   (rest as gdn_decode)
    Returns o: [T, HV, V] in mixed_qkv's dtype (a padded or failed request's rows: finite, unspecified).

        S, window <- the slot's committed state if has_initial_state[n] else 0;  conv, l2norm, gating, the
        chunked delta rule from S;  ssm_state[slot], conv_state[slot, :, :W-1] <- the final ones;  count <- 0

    No gather and no scatter: the conv and state kernels read and write the slots themselves (their SLOTS), so
    each request's state is read once and written once, in place. Launches: prefill_rows_kernel (the requests'
    verdicts: slot range, duplicates, a verify awaiting its accept; the first fault into cache.err, raised by
    ``cache.check()``, on a CPU device by the op itself; a failed or padded request reads and writes nothing),
    gdn_materialize of the verified slots (their pending tokens folded in), fast.causal_conv1d's two kernels and
    the chunked forward's (fast.chunk; g and beta = sigmoid(b) formed in its kernels from raw a and b). cu_seqlens'
    values are read on the host (a sync, none with cu_seqlens_cpu: eager prefill, not for CUDA-graph capture) and
    checked there: bad offsets raise refgdn's first fault before anything runs. check_values=True checks every
    value rule on the host first (more reads).
    The cache's tensors may have any layout the decode accepts (e.g. ssm_state and conv_state as page-strided views
    of one buffer per slot, as vLLM's hybrid cache allocates them). float64 runs refgdn. Inside CUDA-graph
    capture it raises refgdn.capture.HostSyncInCapture before anything runs (its per-call host work could not be
    replayed: the offsets' read, the chunk tables' upload).
    """
    if _capturing():
        from refgdn.capture import HostSyncInCapture
        raise HostSyncInCapture("fast.gdn_prefill inside CUDA-graph capture: a prefill reads cu_seqlens' values on "
                                "the host and uploads per-call chunk tables, which a graph cannot replay; run "
                                "prefill eagerly (graphs are for decode, verify and draft steps)")
    sig = _prefill_signature(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                             cu_seqlens, has_initial_state, scale, activation, cu_seqlens_cpu)
    plan = _PREFILL_PLANS.get(sig)
    if plan is None:
        rs.check_prefill_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                                cu_seqlens, has_initial_state, scale, activation, cu_seqlens_cpu, False)
        plan = _PREFILL_PLANS.after_checks(sig)                  # (None on a signature's first call)
    elif cu_seqlens_cpu is not None:
        provide_host_offsets(cu_seqlens, cu_seqlens_cpu)      # (checked with this signature: it stands for cu_seqlens)
    T, N = mixed_qkv.shape[0], state_indices.shape[0]
    offsets = host_offsets(cu_seqlens)                          # cu_seqlens_cpu's values when given
    if check_values or not rs.offsets_sane(offsets, T):          # bad offsets: refgdn's first fault, before any launch
        raise_first(rs.prefill_value_faults(cache, state_indices, offsets, T)[1])
    if _is_fp64(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache.ssm_state, cache.conv_state):
        return _on_refgdn(cache, rs.gdn_prefill, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache,
                          state_indices, cu_seqlens, has_initial_state, scale, activation, False, cu_seqlens_cpu)
    H, HV, K, V = cache.H, cache.HV, cache.K, cache.V
    dev = cache.ssm_state.device
    if N == 0:
        return torch.empty(T, HV, V, dtype=mixed_qkv.dtype, device=dev)
    state_indices, cu_seqlens = state_indices.contiguous(), cu_seqlens.contiguous()
    flags = has_initial_state.contiguous().view(torch.uint8) if has_initial_state is not None else None
    with plan if plan is not None else contextlib.nullcontext():
        # 1. verdicts: rows[0:2N] as [N, 2] (slot written, slot read; -1: none), rows[2N:] the written slots
        rows = torch.empty(3 * N, dtype=torch.int32, device=dev)
        launch(prefill_rows_kernel, (1,), dict(BN=PREFILL_BLOCK, HAS_FLAGS=flags is not None, num_warps=4),
               cache.pend_meta, cache.err, state_indices, state_indices if flags is None else flags, cu_seqlens,
               rows, N, T, cache.num_slots)
        slot_rows = rows[:2 * N].view(N, 2)
        # 2. the written slots' pending tokens folded in (their committed state is what the request continues from)
        _materialize(cache, rows[2 * N:])
        # 3. conv, reading and writing the slots' windows in place
        # (its tiles PREFILL_CHUNK rows, as the chunked forward's chunks: one varlen table, built and uploaded once)
        y, _ = conv_forward(mixed_qkv[None], conv_weight, conv_bias, activation, cache.conv_state, True, cu_seqlens,
                            config=dict(BT=PREFILL_CHUNK), slot_rows=slot_rows)
        y = y[0]
        q, k, v = rs.split_qkv(y, H, K, HV)
        # 4. l2norm, gating (g from raw a; beta = sigmoid(b) in float32, as refgdn's, formed by each kernel reading
        # it: no torch launch on this host-bound path) and the chunked delta rule, the slots' states in place
        o, _ = chunk_gated_delta_rule_fwd(q[None], k[None], v[None], a[None], b[None], scale, cache.ssm_state,
                                          True, cu_seqlens, True, A_log, dt_bias, PREFILL_CHUNK, slot_rows=slot_rows,
                                          update_x2=prefill_update_x2(q.dtype), beta_logits=1)
    _check_if_free(cache)
    return o[0]


def gdn_accept(cache: GDNStateCache, state_indices, num_accepted, check_values: bool = False) -> None:
    """After a verify: keep the first ``num_accepted[n]`` tokens of request n (one tiny launch).

    state_indices: [N] int (negative = ignored)   num_accepted: [N] int in [1, L_n] (L_n: the tokens of
    request n's verify; 0 when L_n = 0)

        count[slot] <- num_accepted;  the slot no longer awaits an accept

    Checked on the device (slot range, duplicates, a verify awaiting this accept, the count's range):
    a bad row writes nothing and its fault is raised by ``cache.check()`` (on a CPU device by the op itself).
    """
    def checked(reuse: bool) -> tuple:   # (N, its launch); as _checked_plan: same safety argument, same bound
        N = check_accept_inputs(cache, state_indices, num_accepted, False)
        return N, Relaunch(accept_kernel, (cdiv(N, ACCEPT_BLOCK),), dict(BN=ACCEPT_BLOCK, BC=32, num_warps=4), reuse)
    args = (cache, state_indices, num_accepted)
    N, launch = _checked_entry("accept", ("accept", type(cache)), rs.accept_tensors, args,
                               lambda: rs.accept_signature(*args), checked, _dim0(state_indices))
    if check_values:                      # check_accept_inputs' value rules: host reads, every call
        raise_first(accept_value_faults(cache, state_indices, num_accepted)[1])
    if N == 0:
        return
    launch(cache.pend_meta, cache.err, state_indices.contiguous(), num_accepted.contiguous(), N, cache.num_slots)
    _check_if_free(cache)


def gdn_materialize(cache: GDNStateCache, state_indices, check_values: bool = False) -> None:
    """Commit the slots' pending tokens: afterwards ``ssm_state[slot]`` and ``conv_state[slot, :, :W-1]``
    are the slot's state and its count is 0 (what prefill and plain readers expect).

    state_indices: [N] int (negative = ignored). The decode kernels with zero new tokens per request; a slot
    whose verify awaits its accept is a fault (E_AWAITING), recorded like every device-side check.
    Host work as gdn_decode's: checks and launch plan once per call signature. A float64 cache runs refgdn.
    """
    _materialize(cache, state_indices, check_values)
    _check_if_free(cache)


def _materialize(cache: GDNStateCache, state_indices, check_values: bool = False) -> None:
    """gdn_materialize without its ``cache.check()`` on a CPU device (gdn_prefill's: its own comes after its other
    launches, as every op's)."""
    def checked(reuse: bool) -> tuple:   # as _checked_plan: same safety argument, same bound
        check_cache(cache)
        N = check_state_indices(state_indices, cache, None, False)
        # the step's inputs for zero new tokens per request: constant and read-only (no kernel writes them),
        # so a remembered signature keeps them with its plan
        dev = cache.ssm_state.device
        HV, D, W = cache.HV, cache.D, cache.W
        zeros_cu = torch.zeros(N + 1, dtype=torch.int32, device=dev)     # every request brings 0 tokens
        ab = torch.zeros(0, HV, dtype=torch.float32, device=dev)
        hv = torch.zeros(HV, dtype=torch.float32, device=dev)
        inputs = (cache.conv_state.new_zeros(0, D), ab, ab, torch.zeros(D, W, dtype=torch.float32, device=dev),
                  None, hv, hv, cache, state_indices, zeros_cu)
        return N, inputs[:7], zeros_cu, _build_plan(*inputs, None, "materialize", reuse=reuse)
    args = (cache, state_indices)
    N, inputs, zeros_cu, plan = _checked_entry("materialize", ("materialize", step_config, conv_config, type(cache)),
                                               rs.materialize_tensors, args, lambda: rs.materialize_signature(*args),
                                               checked, _dim0(state_indices))
    if check_values:
        raise_first(step_value_faults(cache, state_indices, None, N)[1])
    if plan.fp64:                                 # a float64 cache: refgdn folds (its faults recorded likewise)
        rs.gdn_materialize(cache, state_indices, False)
        return
    _run(plan, *inputs, cache, state_indices, zeros_cu, None)
