"""The one-sequence forward as a pipeline over segments of the sequence, on two streams.

    q, k: [1, T, H, K]   v: [1, T, HV, V]   g, beta: [1, T, HV]   -> o: [1, T, HV, V], final: [1, HV, K, V]

At B = 1 the sequential state pass (kernel 3) has one program per (value head, V-block), about one per SM, and walks
its chunks latency-bound, while kernels 1, 2 and 4 are chunk-parallel and throughput-bound: run one after the
other, most of the GPU idles during kernel 3 (RESULTS.md, "Prefill at B = 1"). Here the sequence is cut into S
segments of whole chunks. Kernel 3 walks them in order on a high-priority side stream, each segment starting from
the previous one's final state (fp32, the value the pass would have held in registers: the results are bit for
bit those of the one-pass forward), while the caller's stream runs the chunk-parallel kernels of the other
segments beside it:

    caller's stream:  K1 K2 (0) >r0   K1 K2 (1) >r1   <d0 K4 (0)   K1 K2 (2) >r2   <d1 K4 (1)   ...   <d[S-1] K4 (S-1)
    state stream:     <r0 K3 (0) >d0   <r1 K3 (1) >d1   <r2 K3 (2) >d2 ...

(>e: record event e; <e: wait for it.) Kernels 1-2 of segment s + 1 are queued before kernel 4 of segment s, so
the producer stays a segment ahead of the pass. The caller's stream waits for the last segment's pass (through
kernel 4's wait) before anything after the call runs, so the caching allocator's stream-ordered reuse stays safe
for every intermediate, and the pattern (fork by an event, join by an event) is also legal inside a CUDA-graph
capture. Every segment's tensors are views of the whole call's buffers: at B = 1 a slice along T of a contiguous
[1, T, ...] buffer is a contiguous buffer of the segment's length (kernels index it from its own start).
"""
from __future__ import annotations

import itertools
import threading
from typing import List, Optional

import torch

from ..utils import cdiv, is_interpreting
from .common import _Chunks
from .output import _launch_output
from .state import _launch_state, state_fuses_output
from .wy import _launch_kkt, _launch_w_u

_STREAMS: dict = {}                 # device index -> the state pass's high-priority stream
_STREAMS_LOCK = threading.Lock()


def pipeline_segments(N: int, T: int, BT: int, device: torch.device, fused: bool,
                      capturing: Optional[bool] = None) -> int:
    """How many segments the forward of one dense call pipelines (1: none), for a single sequence (N = 1, dense) on a
    CUDA device when the state pass is the unfused latency-bound one (not ``fused``): 4 from 512 chunks (T >= 32768
    at BT = 64); while a CUDA graph is captured (``capturing``, default: the current stream's state) also 2 from 256
    chunks (T >= 16384). An eager call below 512 chunks is not pipelined: each segment's ~170 us of host work then
    delays the device, and one pass is faster. H200 host, eager do_bench ms, three rounds alternating in one process
    (2026-11-29), 1 / 2 segments: T=16384 0.750-0.755 / 0.778-0.993 (fast.chunk_gated_delta_rule 0.750-0.754 /
    0.778-0.785; fast.flashinfer_ops' prefill, more host work ahead of it, 0.768-0.772 / 0.804-1.218), T=24576
    1.107-1.111 / 1.125-1.128, T=32704 1.460-1.464 / 1.472-1.473; T=65536 1 / 2 / 4: 2.893-2.897 / 2.867-2.876 /
    2.748-2.754 (the four segments kept). A graph's replay has no host work: there two segments stay ~10 % faster
    at T=16384 (0.673 vs 0.745-0.753 ms). Triton 3.6, bf16, Qwen3-Next shape, ms by segment count 1 / 2 / 4 / 8
    (2026-11-24; device time from a CUDA graph's replay; then the eager call through its launch plan, and its host
    time per call), H100: T=16384 0.942 / 0.842 / 0.822 / 0.891, eager 0.956 / 0.885 / 0.868 / 1.438; T=65536
    3.661 / 3.279 / 3.144 / 3.158, eager 3.649 / 3.386 / 3.231 / 3.241. H200: T=16384 0.893 / 0.790 / 0.770 /
    0.829, eager 0.897 / 0.840 / 0.817 / 1.438, host 118 / 454 / 790 / 1451 us; T=65536 3.468 / 3.061 / 2.943 /
    2.925, eager 3.472 / 3.176 / 3.031 / 3.019. The chunk-parallel kernels beside the pass slow it down, so the gain
    stays near 13 % of the device time, not the pass's whole idle share; and each segment adds ~170 us of host work
    (three launches, two events, a stream switch, the views), so at T=16384 the call is as long on the host as on
    the device: the H200's prefill table timed it at 1.037 ms (fla 0.968) where the one-pass forward takes 0.90.
    Hence four segments only from 512 chunks, where the device time (~1.7 ms and up) hides the host's; two segments
    from 256 chunks, whose ~450 us of host time stay under the ~0.8 ms of device time (H200, 2026-11-24 22:50, the
    forward without a launch plan, host work included: T=16384 S=1 / 2 / 4 / 8 device 0.869 / 0.780 / 0.766 / 0.790
    ms, eager 0.874 / 0.838 / 0.883 / 3.331; kernel 2's path, from_a=False, pipelines no better: 0.828 / 0.782 /
    0.798 / 0.893, and at T=65536 3.231 / 3.073 / 3.044 / 3.175 against FROM_A's 3.416 / 3.013 / 2.879 / 2.921).
    Inside the pipeline the pinned configs stay best (same H200, device ms: T=16384 in 2 segments 0.789, the pass
    at BV 16 0.834, BV 64 0.849, kernel 4 at BV 64 0.813, kernel 1 unshared (HPP 1) 0.799; T=65536 in 4 segments
    2.924, BV 16 3.321, BV 64 3.086, kernel 4 at BV 64 3.008, HPP 1 2.966)."""
    if N != 1 or fused or is_interpreting() or device.type != "cuda":
        return 1
    chunks = cdiv(T, BT)
    if capturing is None:
        capturing = torch.cuda.is_current_stream_capturing()
    return 4 if chunks >= 512 else 2 if chunks >= 256 and capturing else 1


def forward_fuses_output(N: int, T: int, BT: int, HV: int, K: int, V: int, device: torch.device,
                         capturing: Optional[bool] = None) -> bool:
    """Whether the forward forms o in the state pass: state_fuses_output's rule, except for a single sequence long
    enough to be pipelined unfused (pipeline_segments > 1, capturing as there), which keeps kernel 4 and the
    pipeline. At Qwen3-Next's
    32 value heads a single sequence is never fused anyway; at Qwen3.5's 64 (16 key heads) the pass has enough
    programs to fuse, but the pipeline is faster. H200, Triton 3.6, bf16, l2norm in the kernel, B = 1, H = 16,
    HV = 64 (benchmarks.bench_prefill.state_sweep / pipeline_sweep with heads=(16, 64), 2026-11-28), ms, eager
    (device time of a graph replay): T = 16384 fused 1.252-1.259 (1.26), unfused 2 segments 1.240 (1.126); T = 65536
    fused 4.940-4.947, unfused 4 segments 4.39-4.61 (4.399); and B = 2, T = 8192 (not pipelined) fused 0.953,
    unfused 1.040 (the rule's choice stands)."""
    fused = state_fuses_output(N, HV, K, V, device)
    return fused and not (N == 1 and pipeline_segments(1, T, BT, device, False, capturing) > 1)


def _state_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for the pipelined state pass: created once, at the highest priority, so the pass's few
    programs are scheduled ahead of the chunk-parallel kernels queued beside them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _STREAMS.get(index)
    if s is None:
        with _STREAMS_LOCK:
            s = _STREAMS.get(index)
            if s is None:
                # a priority below the device's range is mapped to its highest
                s = _STREAMS[index] = torch.cuda.Stream(device=torch.device("cuda", index), priority=-100)
    return s


def _bounds(NT: int, S: int, BT: int, T: int, weights: Optional[tuple] = None) -> List[tuple]:
    """[(first chunk, end chunk, first token, end token)] of S segments of whole chunks: nearly equal, or with lengths
    in the proportions ``weights`` (S of them; a benchmark knob)."""
    ends = list(itertools.accumulate(weights or (1.0,) * S, initial=0.0))
    cuts = [round(c * NT / ends[-1]) for c in ends]
    return [(c0, c1, c0 * BT, min(c1 * BT, T)) for c0, c1 in zip(cuts, cuts[1:]) if c1 > c0]


class _Segment:
    """One segment's views of the call's [1, T, ...] tensors and of h [NT, ...] (sliced once per call: every slice
    costs host time), its length T and its chunk bookkeeping."""
    __slots__ = ("T", "ch", "q", "k", "kk", "v", "g", "beta", "G", "Gl", "A", "kn", "w", "u", "v_new", "o", "h")

    def __init__(self, bounds: tuple, BT: int, q, k, kk, v, g, beta, G, Gl, A, kn, w, u, v_new, o, h):
        c0, c1, t0, t1 = bounds
        sl = slice(t0, t1)
        self.T, self.ch, self.h = t1 - t0, _Chunks(1, t1 - t0, BT, None), h[c0:c1]
        self.q, self.k, self.kk, self.v = q[:, sl], k[:, sl], kk[:, sl], v[:, sl]
        self.g, self.beta = g[:, sl], beta[:, sl]
        self.G, self.A, self.v_new, self.o = G[:, sl], A[:, sl], v_new[:, sl], o[:, sl]
        self.Gl, self.kn, self.w, self.u = (None if x is None else x[:, sl] for x in (Gl, kn, w, u))


def pipelined_forward(q, k, v, g, beta, scale: float, h0: Optional[torch.Tensor], final: Optional[torch.Tensor],
                      A_log, dt_bias, G, Gl, A, kn, o, BT: int, segments: int, *, l2: bool, precise: bool,
                      from_a: bool, configs: Optional[dict] = None, inv_method: Optional[str] = None,
                      slot_rows: Optional[torch.Tensor] = None, update_x2: bool = False,
                      beta_logits: int = 0) -> None:
    """Kernels 1-4 of chunk_gated_delta_rule_fwd for one dense sequence, pipelined over ``segments`` segments
    (module docstring). Inputs as the forward's, [1, T, ...]; G, Gl (or None), A, kn (or None), o: the forward's
    buffers, written here; h0: [1, HV, K, V] fp32 or None; final: [1, HV, K, V] fp32 or None (written).
    slot_rows ([1, 2] int32, the serving prefill's): h0 and final are a slot cache's ssm_state, read by the first
    segment's pass and written by the last's (the state kernel's H0_SLOTS / HT_SLOTS). update_x2: the state
    kernel's UPDATE_X2, in every segment's pass. beta_logits 1 / 2: beta holds logits (every kernel reading beta
    forms its sigmoid, as the forward's)."""
    T, HV, K, V = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    NT = cdiv(T, BT)
    dev = q.device
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=dev)            # chunk-start states (kernel 3 -> 4)
    v_new = torch.empty(1, T, HV, V, dtype=v.dtype, device=dev)
    w = u = None
    if not from_a:
        w = torch.empty(1, T, HV, K, dtype=k.dtype, device=dev)
        u = torch.empty(1, T, HV, V, dtype=v.dtype, device=dev)
    knobs = (configs or {}).get("pipeline", {})                         # benchmark knobs: ahead, weights
    parts = _bounds(NT, segments, BT, T, knobs.get("weights"))
    # the state handed from segment to segment (fp32, as the pass holds it); the last one is the call's final
    carry = [h0] + [torch.empty(1, HV, K, V, dtype=torch.float32, device=dev) for _ in parts[1:]] + [final]
    main = torch.cuda.current_stream(dev)
    side = _state_stream(dev)
    kk = kn if l2 else k                                                 # what kernels 2-4 read as k

    def produce(s: _Segment):                                            # kernels 1 (and 2) of a segment
        _launch_kkt(s.k, s.g, s.beta, A_log, dt_bias, s.G, s.Gl, s.A, s.kn, s.ch, s.T, HV, BT, l2norm=l2,
                    load_g=False, store_g=True, do_a=True, precise=precise, configs=configs, inv_method=inv_method,
                    beta_logits=beta_logits)
        if not from_a:
            _launch_w_u(s.kk, s.v, s.beta, s.G, s.A, s.w, s.u, s.ch, s.T, BT, precise=precise, configs=configs,
                        beta_logits=beta_logits)
        ready = torch.cuda.Event()
        ready.record(main)
        return ready

    def consume(i: int, s: _Segment, ready):                             # kernel 3 of a segment, on the side stream
        side.wait_event(ready)
        with torch.cuda.stream(side):
            ends = (i == 0, i == len(segs) - 1)                            # (the cache's state read, written)
            _launch_state(s.kk, s.w, s.u, s.G, s.Gl, carry[i], s.h, s.v_new, carry[i + 1], s.ch, 1, s.T, BT,
                          precise=precise, configs=configs, wy=(s.A, s.v, s.beta) if from_a else None,
                          slots=(slot_rows, *ends) if slot_rows is not None and any(ends) else None,
                          update_x2=update_x2, beta_logits=beta_logits)
            done = torch.cuda.Event()
            done.record(side)
        return done

    def output(s: _Segment, done):                                       # kernel 4 of a segment, caller's stream
        main.wait_event(done)
        _launch_output(s.q, s.kk, s.v_new, s.h, s.G, s.Gl, s.o, s.ch, s.T, BT, scale, l2norm_q=l2, precise=precise,
                       configs=configs)

    segs = [_Segment(b, BT, q, k, kk, v, g, beta, G, Gl, A, kn, w, u, v_new, o, h) for b in parts]
    # how many segments' kernel 1 the caller's stream queues ahead of a segment's kernel 4 (a benchmark may set it)
    ahead = knobs.get("ahead", 1)
    side.wait_stream(main)                                               # the inputs, produced before the call
    # the last kernel 4 waits for the last pass, which follows every earlier one on the side stream: from there the
    # caller's stream is behind all of the side stream's work, so the intermediates (allocated on the caller's
    # stream, freed when this returns) need no record_stream
    done = []
    for i in range(len(segs)):
        for j in range(len(done), min(len(segs), i + 1 + ahead)):       # kernels 1 (and 3) up to segment i + ahead
            done.append(consume(j, segs[j], produce(segs[j])))
        output(segs[i], done[i])
