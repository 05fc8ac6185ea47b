"""Serving: prefill, decode and speculative verify against a slot cache, with rollback by lazy commit.

Shapes (one layer; H q/k heads, HV value heads, head dims K and V, conv width W, D = 2*H*K + HV*V):

    mixed_qkv [T, D]   the in-projection's q | k | v channels before the conv (T = N for decode)
    a, b      [T, HV]  raw gate inputs:  g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    o         [T, HV, V]
    state_indices [N] int32/int64: the slot of each request; a negative index marks a padded row
    cu_seqlens    [N+1] int (vLLM's query_start_loc): request n owns tokens [cu[n], cu[n+1])

Per token, after the conv:  q, k = l2norm(q), l2norm(k);  S <- exp(g) S;
S <- S + k (beta (v - S^T k))^T;  o = scale S^T q   (value head h reads q/k head h // (HV // H)).

The rollback contract (DESIGN.md, "Serving semantics")
--------------------------------------------------------
A verify step runs 1 + k tokens per request (the last sampled token and k drafts) and returns an
output for each. The caller then calls :func:`gdn_accept` with ``num_accepted[n]`` in ``[1, 1+k]``.
From then on the slot behaves exactly as if only the first ``num_accepted[n]`` tokens had ever been
seen: the next decode / verify continues from that state, and :func:`gdn_materialize` writes it
out (``ssm_state[slot]`` and ``conv_state[slot, :, :W-1]``).

Mechanism: lazy commit (not vLLM's per-token checkpoints)
---------------------------------------------------------
Writing a state checkpoint per token costs (1+k) state writes per verify. Instead a verify step
keeps the *inputs* of its tokens and commits nothing of them; the next step commits the accepted
ones first:

1. read the committed state ``S = ssm_state[slot]`` once (arithmetic in float32);
2. re-apply the slot's *pending* tokens: the first ``count`` tokens kept by the previous verify
   (l2-normalised k, v, g, beta: everything the delta rule needs, nothing it must recompute);
3. verify: write ``S`` back once (now it includes the accepted prefix), then run the 1 + k new
   tokens on from ``S`` for their outputs only, keep their inputs in the pending buffer, and set
   ``count = 1 + k`` (all accepted until :func:`gdn_accept` lowers it);
   decode: apply the new token too and write ``S`` back once: the slot is fully committed
   (``count = 0``).

So a verify moves one state read + one state write per request, like a plain decode, plus the
few pending inputs. The pending buffer is double-banked (``bank`` selects the half holding the
pending tokens; a verify reads one half and writes the other), so a kernel that reads old
pending tokens and writes new ones in the same launch never races with itself.

The conv state keeps ``W - 1 + max_draft`` columns of *raw* inputs: after a step with L >= 1 new
tokens it holds the last W-1 old inputs followed by the L new ones, minus the oldest
(``[w_1 .. w_{W-2}, x_0 .. x_{L-1}]``). With ``count`` pending tokens accepted, the committed
window is the W-1 columns starting at ``max(count - 1, 0)``; no copy is needed at accept time.

Per-slot metadata ``pend_meta[slot] = (count, bank | AWAIT_ACCEPT * awaiting)``, int32: bit 0 of
the second word is the bank, bit 1 (:data:`AWAIT_ACCEPT`) is set by a verify and cleared by its
accept. A slot is *committed* when count == 0: then ``ssm_state[slot]`` and
``conv_state[slot, :, :W-1]`` are its state (what prefill reads and writes; call
:func:`gdn_materialize` first, or :meth:`GDNStateCache.reset` for a new request).

Precision: the ssm state may be float32 or bfloat16 (float64 in truth runs); it is read once,
carried in float32 (float64) and rounded once when written. Outputs, conv outputs and pending v
are in mixed_qkv's dtype (pending v is a copy of a conv output, so lossless); pending k, g, beta
are kept in the compute dtype (float32, float64 for float64 inputs), also lossless.

Validation: shapes, then values, then faults recorded on the device
-------------------------------------------------------------------
Shapes, dtypes and devices are checked on the host before anything runs (ValueError naming the
argument), identically in refgdn and fast. *Values* (slot indices, token counts, accept counts)
are checked per request by the rules below. A request that breaks one is a **failed request**:
nothing of it is written (its slot, the cache's other slots, and memory outside the cache are
byte-identical afterwards). The fault codes and their wording (:func:`fault_message`) are shared
by both packages:

    state_indices[n]   < num_slots; negative: a padded row (no fault;    E_SLOT_RANGE
                       it reads and writes nothing)
                       no other request with the same slot (both fail;  E_SLOT_DUP, reported by the
                       the later one reports, naming the earlier one)    later of the two requests
    cu_seqlens         cu[0] == 0 (request 0 reports), non-decreasing   E_CU_START, E_CU_ORDER,
                       (the request whose end is below its start        E_CU_END
                       reports), cu[N] == T (request N-1 reports); if
                       cu[0] or cu[N] is bad every request fails (no row
                       is trustworthy), else a request fails when its
                       own span is not inside [0, T]; an offset beyond
                       [0, T] implies one of these faults (or, in a
                       verify, E_TOO_LONG of the request it belongs to)
                       cu[n+1] - cu[n] <= 1 + max_draft (verify only)   E_TOO_LONG
    sequence           prefill / decode / verify / materialize of a     E_AWAITING
                       slot whose verify still awaits its accept
                       accept of a slot with no verify awaiting it      E_NO_VERIFY
                       (after a decode, a materialize, a second accept)
    num_accepted[n]    in [1, L] for a request that brought L >= 1      E_ACCEPT_RANGE
                       tokens to the verify; exactly 0 when L == 0

So every verify is followed by exactly one accept (of the same slots) before the slot is stepped
again; the rule catches a forgotten accept, which would otherwise commit every draft silently.

Which fault is reported (the same in both packages, whatever order fast's programs run in): within a
request the rules are checked in the order above, and the codes are numbered in that order (E_SLOT_RANGE
= 1 ... E_ACCEPT_RANGE = 9), so a request's fault is its lowest-numbered violated rule; the call reports
the fault of its **lowest-numbered faulty request** (:func:`first_fault`). An earlier recorded fault
(an earlier call, or another layer sharing ``err``) is never replaced.

refgdn (``check_values=True``, the default) reads the values on the host and raises the first
fault in request order before touching anything. fast cannot read device values on the host (a
sync, forbidden inside CUDA-graph capture), so its kernels check them on the device, skip the
failed requests (other requests of the call proceed) and record the first fault in ``cache.err``;
:meth:`GDNStateCache.check` raises it as the same ValueError at the next host sync (see
fast.serving). ``check_values=False`` makes refgdn behave like fast (skip and record), and makes
fast check on the host like refgdn (a sync per call; not inside capture).
"""
from __future__ import annotations

import dataclasses
import numbers
from collections import Counter
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from einops import rearrange

from .checks import (_need_device, _need_float, _need_shape, _need_tensor, check_activation, check_cu_seqlens_cpu,
                     check_float_param, check_scale, host_offsets, one_host_read)
from .conv import causal_conv1d
from .delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from .gating import compute_dtype, gdn_gating, l2norm

INDEX_DTYPES = (torch.int32, torch.int64)

# ----------------------------------------------------------------------------------------------
# faults: value errors of the serving protocol, shared with fast (its kernels record the codes)
# ----------------------------------------------------------------------------------------------

AWAIT_ACCEPT = 2     # bit of pend_meta[:, 1] (bit 0 is the bank): a verify awaits its gdn_accept

E_SLOT_RANGE, E_SLOT_DUP, E_CU_START, E_CU_ORDER, E_CU_END, E_TOO_LONG, E_AWAITING, E_NO_VERIFY, E_ACCEPT_RANGE = \
    range(1, 10)

Fault = Tuple[int, int, int, int]    # (code, request n, bad value, extra: a bound or another index)


def fault_message(code: int, n: int, value: int, extra: int) -> str:
    """The ValueError text of a fault: names the argument, the request and the bad value."""
    if code == E_SLOT_RANGE:
        return (f"state_indices[{n}] = {value} is out of range: a slot index must be in [0, num_slots={extra}), "
                f"or negative for a padded row")
    if code == E_SLOT_DUP:
        return (f"state_indices must be distinct (one request per slot): state_indices[{n}] = {value} "
                f"is also the slot of request {extra}")
    if code == E_CU_START:
        return f"cu_seqlens must start at 0, got cu_seqlens[0] = {value}"
    if code == E_CU_ORDER:
        return (f"cu_seqlens must be non-decreasing: request {n} spans cu_seqlens[{n}] = {extra} .. "
                f"cu_seqlens[{n + 1}] = {value}")
    if code == E_CU_END:
        return f"cu_seqlens must end at T={extra} (the tokens in mixed_qkv), got cu_seqlens[{n + 1}] = {value}"
    if code == E_TOO_LONG:
        return (f"cu_seqlens: request {n} has {value} tokens; a verify step takes 0..1+max_draft={extra} "
                f"tokens per request")
    if code == E_AWAITING:
        return (f"state_indices[{n}] = {value}: the slot's last verify awaits gdn_accept (no decode, verify or "
                f"materialize may come between a verify and its accept)")
    if code == E_NO_VERIFY:
        return (f"state_indices[{n}] = {value}: gdn_accept without a verify awaiting acceptance on that slot "
                f"(each verify is followed by exactly one accept)")
    if code == E_ACCEPT_RANGE:
        if extra == 0:
            return f"num_accepted[{n}] must be 0 (request {n} brought no tokens to the slot's last verify), got {value}"
        return (f"num_accepted[{n}] must be in [1, {extra}] (the tokens request {n} brought to the slot's last "
                f"verify), got {value}")
    return f"unknown serving fault code {code} (request {n}, value {value}, extra {extra})"


def _slot_faults(slots: Sequence[int], num_slots: int):
    """Per request: (fault or None, failed). Range first; then duplicates: every request sharing a slot
    fails, each but the first reports E_SLOT_DUP naming the first."""
    seen = Counter(s for s in slots if 0 <= s < num_slots)
    first = {}
    out = []
    for n, s in enumerate(slots):
        if s >= num_slots:                      # any negative index: a padded row
            out.append(((E_SLOT_RANGE, n, s, num_slots), True))
        elif s >= 0 and seen[s] > 1:
            out.append(((E_SLOT_DUP, n, s, first[s]) if s in first else None, True))
            first.setdefault(s, n)
        else:
            out.append((None, False))
    return out


def step_faults(slots: Sequence[int], num_slots: int, awaiting: Callable[[int], bool],
                offsets: Optional[Sequence[int]] = None, T: int = 0,
                cap: Optional[int] = 1) -> Tuple[List[bool], List]:
    """The value rules of decode (offsets None), verify, prefill and materialize, on host lists.

    slots: state_indices; awaiting(slot): its AWAIT_ACCEPT bit; offsets: cu_seqlens; T: tokens;
    cap: 1 + max_draft (None: no cap, prefill). Returns (ok [N]: the request runs, faults [N]: its Fault or None).
    fast's ``_step_row_check`` (a kernel helper) computes the same per request on the device.
    """
    N = len(slots)
    ok, faults = [], []
    cu_bad = offsets is not None and N > 0 and (offsets[0] != 0 or offsets[-1] != T)
    for n, (fault, failed) in enumerate(_slot_faults(slots, num_slots)):
        s = slots[n]
        if offsets is not None:
            bos, eos = offsets[n], offsets[n + 1]
            failed = failed or cu_bad or not 0 <= bos <= eos <= T
            if fault is None:
                if n == 0 and bos != 0:
                    fault = (E_CU_START, 0, bos, 0)
                elif eos < bos:
                    fault = (E_CU_ORDER, n, eos, bos)
                elif n == N - 1 and eos != T:
                    fault = (E_CU_END, n, eos, T)
                elif cap is not None and eos - bos > cap:
                    fault = (E_TOO_LONG, n, eos - bos, cap)
        if fault is None and 0 <= s < num_slots and awaiting(s):
            fault = (E_AWAITING, n, s, 0)
        ok.append(fault is None and not failed)
        faults.append(fault)
    return ok, faults


def accept_faults(slots: Sequence[int], num_slots: int, awaiting: Callable[[int], bool],
                  count: Callable[[int], int], accepted: Sequence[int]) -> Tuple[List[bool], List]:
    """The value rules of gdn_accept, on host lists (as step_faults; padded rows: not ok, no fault)."""
    ok, faults = [], []
    for n, (fault, failed) in enumerate(_slot_faults(slots, num_slots)):
        s, acc = slots[n], accepted[n]
        if fault is None and s >= 0:
            c = count(s)
            if not awaiting(s):
                fault = (E_NO_VERIFY, n, s, 0)
            elif not min(c, 1) <= acc <= c:
                fault = (E_ACCEPT_RANGE, n, acc, c)
        ok.append(fault is None and not failed and s >= 0)
        faults.append(fault)
    return ok, faults


def first_fault(faults) -> Optional[Fault]:
    """The first recorded fault in request order (refgdn raises it; fast's kernels record one)."""
    return next((f for f in faults if f is not None), None)


# ----------------------------------------------------------------------------------------------
# the slot cache
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class GDNStateCache:
    """One layer's state cache: S slots, each owned by at most one request at a time.

    ssm_state:  [S, HV, K, V]            float32 or bfloat16 (float64 for truth runs); any strides (e.g.
                                         [V, K] blocks seen transposed: newer vLLM's (HV, V, K) state)
    conv_state: [S, D, W-1+max_draft]    raw conv inputs, oldest first (any strides; allocate makes
                                         the channels contiguous: a [S, W-1+max_draft, D] buffer)
    pend_k:     [S, 2, 1+max_draft, H, K]   l2-normalised k of pending tokens, compute dtype
    pend_v:     [S, 2, 1+max_draft, HV, V]  v of pending tokens (after the conv)
    pend_g:     [S, 2, 1+max_draft, HV]     g (log decay) of pending tokens, compute dtype
    pend_beta:  [S, 2, 1+max_draft, HV]     beta of pending tokens, compute dtype
    pend_meta:  [S, 2] int32                (count, bank | AWAIT_ACCEPT if a verify awaits its accept):
                                            the first `count` tokens of bank `bank` are accepted and
                                            not yet folded into ssm_state
    err:        [4] int64                   the first recorded fault (code, request, value, extra);
                                            code 0 = none. Not slot-indexed. Written by fast's kernels
                                            (and refgdn with check_values=False), raised by check().
    The pend_* tensors must be contiguous (kernels index them directly). ``err`` defaults to a
    fresh zero buffer, so a cache built from the seven slot tensors keeps working; several
    caches (a model's layers) may share one err buffer (``allocate(err=...)``): one check() then
    covers them all, and the first fault of any of them wins.
    """

    ssm_state: torch.Tensor
    conv_state: torch.Tensor
    pend_k: torch.Tensor
    pend_v: torch.Tensor
    pend_g: torch.Tensor
    pend_beta: torch.Tensor
    pend_meta: torch.Tensor
    err: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.err is None and isinstance(self.ssm_state, torch.Tensor):
            self.err = torch.zeros(4, dtype=torch.int64, device=self.ssm_state.device)

    @classmethod
    def allocate(cls, num_slots: int, H: int, HV: int, K: int, V: int, conv_width: int = 4,
                 max_draft: int = 0, state_dtype: torch.dtype = torch.float32,
                 act_dtype: torch.dtype = torch.bfloat16, device="cpu",
                 err: Optional[torch.Tensor] = None) -> "GDNStateCache":
        """A zeroed cache for ``num_slots`` requests with up to ``max_draft`` drafts per verify.

        The conv state holds ``act_dtype`` (raw inputs are stored losslessly); pending k, g, beta
        use float64 when ``act_dtype`` or ``state_dtype`` is float64, else float32.
        err: an int64 [4] fault buffer to share with other caches (default: a fresh one).
        """
        for name, val in (("num_slots", num_slots), ("H", H), ("HV", HV), ("K", K), ("V", V),
                          ("conv_width", conv_width)):
            if not isinstance(val, numbers.Integral) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if not isinstance(max_draft, numbers.Integral) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0, got {max_draft!r}")
        if HV % H:
            raise ValueError(f"HV={HV} must be a multiple of H={H} (GVA)")
        if err is not None:
            _need_tensor("err", err, 1)
            where = torch.empty(0, device=device).device        # "cuda" -> "cuda:0", as the tensors get
            if err.shape[0] != 4 or err.dtype != torch.int64 or err.device != where:
                raise ValueError(f"err must be an int64 [4] tensor on {device}, got {err.dtype} "
                                 f"[{', '.join(map(str, err.shape))}] on {err.device}")
        D = 2 * H * K + HV * V
        return cls(
            ssm_state=torch.zeros(num_slots, HV, K, V, dtype=state_dtype, device=device),
            # [S, D, W-1+max_draft] as a view of [S, W-1+max_draft, D] storage (channels contiguous):
            # a step reads and writes whole columns, which are then coalesced (newer vLLM's layout)
            conv_state=torch.zeros(num_slots, conv_width - 1 + max_draft, D, dtype=act_dtype,
                                   device=device).transpose(1, 2),
            **_pending_buffers(num_slots, H, HV, K, V, max_draft, state_dtype, act_dtype, device),
            err=err,
        )

    @classmethod
    def wrap(cls, ssm_state: torch.Tensor, conv_state: torch.Tensor, max_draft: int = 0, H: Optional[int] = None,
             err: Optional[torch.Tensor] = None) -> "GDNStateCache":
        """A cache over state tensors a serving engine allocated, used in place (no copy); the pend_* buffers and
        err are allocated here (zeroed: count 0, nothing pending).

        ssm_state: [S, HV, K, V] and conv_state: [S, D, W-1+max_draft], any strides that do not overlap (check_cache
        checks them). H: key heads (default: from D = 2 H K + HV V). vLLM's hybrid cache gives a GDN layer
        ``[conv (S, W-1+num_spec, D), temporal (S, HV, V, K)]`` (newer releases; older: conv (S, D, W-1+num_spec),
        temporal (S, HV, K, V)), both page-strided views of the layer's pages::

            cache = GDNStateCache.wrap(temporal.transpose(-1, -2), conv.transpose(-1, -2), max_draft=num_spec)
        """
        for name, t, nd in (("ssm_state", ssm_state, 4), ("conv_state", conv_state, 3)):
            _need_tensor(name, t, nd)
        S, HV, K, V = ssm_state.shape
        D = conv_state.shape[1]
        if H is None:
            if (D - HV * V) <= 0 or (D - HV * V) % (2 * K):
                raise ValueError(f"conv_state's D={D} is not 2 H K + HV V for any H (HV={HV}, K={K}, V={V}): "
                                 f"pass H")
            H = (D - HV * V) // (2 * K)
        if not isinstance(max_draft, numbers.Integral) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0, got {max_draft!r}")
        cache = cls(ssm_state=ssm_state, conv_state=conv_state, err=err,
                    **_pending_buffers(S, H, HV, K, V, max_draft, ssm_state.dtype, conv_state.dtype,
                                       ssm_state.device))
        check_cache(cache)
        return cache

    # sizes ------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.ssm_state.shape[0]

    @property
    def H(self) -> int:
        return self.pend_k.shape[3]

    @property
    def HV(self) -> int:
        return self.ssm_state.shape[1]

    @property
    def K(self) -> int:
        return self.ssm_state.shape[2]

    @property
    def V(self) -> int:
        return self.ssm_state.shape[3]

    @property
    def D(self) -> int:
        return self.conv_state.shape[1]

    @property
    def tokens_cap(self) -> int:
        """1 + max_draft: the most tokens one request may bring to a verify step."""
        return self.pend_k.shape[2]

    @property
    def max_draft(self) -> int:
        return self.tokens_cap - 1

    @property
    def W(self) -> int:
        """Conv width (conv_state keeps W - 1 + max_draft columns)."""
        return self.conv_state.shape[2] - self.max_draft + 1

    SLOT_FIELDS = ("ssm_state", "conv_state", "pend_k", "pend_v", "pend_g", "pend_beta", "pend_meta")

    def tensors(self) -> list:
        """Every tensor in field order, the seven slot tensors then err (no copies)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def slot_tensors(self) -> list:
        """The seven slot-indexed tensors (dim 0 = slot), without err."""
        return [getattr(self, name) for name in self.SLOT_FIELDS]

    def clone(self) -> "GDNStateCache":
        return GDNStateCache(*(t.clone() for t in self.tensors()))

    def to(self, **kw) -> "GDNStateCache":
        """Copy with every tensor moved/cast by ``Tensor.to(**kw)`` (pend_meta keeps int32, err int64)."""
        out = {}
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            out[f.name] = t.to(device=kw.get("device", t.device)) if f.name in ("pend_meta", "err") else t.to(**kw)
        return GDNStateCache(**out)

    def reset(self, slots) -> None:
        """Zero the given slots (state, conv window, pending) for new requests. Host-side helper."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.ssm_state.device).reshape(-1)
        for t in self.slot_tensors():
            t[idx] = 0

    def check(self) -> None:
        """Raise the fault recorded in ``err`` (ValueError, refgdn's words) and clear it; else nothing.

        One device->host read of 32 bytes (a sync): call it where the host syncs anyway (e.g.
        after reading the sampled tokens), never inside CUDA-graph capture.
        """
        code, n, value, extra = self.err.tolist()
        if code:
            self.err.zero_()
            raise ValueError(fault_message(code, n, value, extra))


def pending_dtype(state_dtype: torch.dtype, act_dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of the pending k, g, beta buffers: float64 if either dtype is float64, else float32."""
    return torch.float64 if torch.float64 in (state_dtype, act_dtype) else torch.float32


def _pending_buffers(S: int, H: int, HV: int, K: int, V: int, max_draft: int, state_dtype, act_dtype,
                     device) -> dict:
    """The zeroed pend_* fields of a cache (nothing pending, bank 0): GDNStateCache.allocate's and wrap's."""
    cdt, TC = pending_dtype(state_dtype, act_dtype), 1 + max_draft
    return dict(pend_k=torch.zeros(S, 2, TC, H, K, dtype=cdt, device=device),
                pend_v=torch.zeros(S, 2, TC, HV, V, dtype=act_dtype, device=device),
                pend_g=torch.zeros(S, 2, TC, HV, dtype=cdt, device=device),
                pend_beta=torch.zeros(S, 2, TC, HV, dtype=cdt, device=device),
                pend_meta=torch.zeros(S, 2, dtype=torch.int32, device=device))


def split_qkv(y: torch.Tensor, H: int, K: int, HV: int):
    """Conv outputs y: [T, D] (D = 2 H K + HV V, q | k | v channels) -> q, k [T, H, K], v [T, HV, V] (views)."""
    T, D = y.shape
    V = (D - 2 * H * K) // HV
    # [T, (H K)] -> [T, H, K]: views of y (reshape, not einops: ~15 us of host time each on a serving host, and
    # the serving prefill is host-bound)
    q = y[:, :H * K].reshape(T, H, K)
    k = y[:, H * K:2 * H * K].reshape(T, H, K)
    v = y[:, 2 * H * K:].reshape(T, HV, V)
    return q, k, v


def check_cache(cache) -> None:
    """Validate a GDNStateCache's field shapes, dtypes and layouts (ValueError naming the field).

    Reads only the cache's type and its fields' metadata: :func:`step_signature` summarises exactly that
    (fast skips this check when a call's signature has passed before); keep the two in step.
    """
    if not isinstance(cache, GDNStateCache):
        raise ValueError(f"cache must be a GDNStateCache, got {type(cache).__name__}")
    _need_tensor("cache.ssm_state", cache.ssm_state, 4)
    _need_float("cache.ssm_state", cache.ssm_state)
    S, HV, K, V = cache.ssm_state.shape
    dev = cache.ssm_state.device
    _need_no_overlap("cache.ssm_state", cache.ssm_state)
    _need_tensor("cache.pend_k", cache.pend_k, 5)
    TC, H = cache.pend_k.shape[2], cache.pend_k.shape[3]
    if H == 0 or HV % H:
        raise ValueError(f"cache.pend_k's head count H={H} must divide ssm_state's HV={HV}")
    D = 2 * H * K + HV * V
    cdt = pending_dtype(cache.ssm_state.dtype, cache.pend_v.dtype)
    specs = (("cache.pend_k", cache.pend_k, (S, 2, TC, H, K), "[S, 2, 1+max_draft, H, K]"),
             ("cache.pend_v", cache.pend_v, (S, 2, TC, HV, V), "[S, 2, 1+max_draft, HV, V]"),
             ("cache.pend_g", cache.pend_g, (S, 2, TC, HV), "[S, 2, 1+max_draft, HV]"),
             ("cache.pend_beta", cache.pend_beta, (S, 2, TC, HV), "[S, 2, 1+max_draft, HV]"),
             ("cache.pend_meta", cache.pend_meta, (S, 2), "[S, 2]"))
    for name, t, shape, contract in specs:
        _need_tensor(name, t)
        _need_shape(name, t, shape, contract)
        _need_device(name, t, dev)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    _need_float("cache.pend_v", cache.pend_v)
    for name, t in (("cache.pend_k", cache.pend_k), ("cache.pend_g", cache.pend_g),
                    ("cache.pend_beta", cache.pend_beta)):
        if t.dtype != cdt:
            raise ValueError(f"{name} must be {cdt} (the compute dtype), got {t.dtype}")
    if cache.pend_meta.dtype != torch.int32:
        raise ValueError(f"cache.pend_meta must be int32, got {cache.pend_meta.dtype}")
    _need_tensor("cache.err", cache.err, 1)
    _need_shape("cache.err", cache.err, (4,), "[4] (code, request, value, extra)")
    _need_device("cache.err", cache.err, dev)
    if cache.err.dtype != torch.int64 or not cache.err.is_contiguous():
        raise ValueError(f"cache.err must be a contiguous int64 tensor, got {cache.err.dtype}")
    _need_tensor("cache.conv_state", cache.conv_state, 3)
    _need_float("cache.conv_state", cache.conv_state)
    _need_device("cache.conv_state", cache.conv_state, dev)
    if cache.conv_state.shape[0] != S or cache.conv_state.shape[1] != D or cache.conv_state.shape[2] < TC - 1:
        raise ValueError(f"cache.conv_state must have shape [S, D, W-1+max_draft] = [{S}, {D}, W-1+{TC - 1}] "
                         f"(D = 2*H*K + HV*V), got [{', '.join(map(str, cache.conv_state.shape))}]")
    _need_no_overlap("cache.conv_state", cache.conv_state)


def _need_no_overlap(name: str, t: torch.Tensor) -> None:
    """Any strides (page-strided views, transposed blocks), but no two elements at one address: a slot's writes
    would land in another's (e.g. a stride 0 from expand). The dims by increasing stride must nest: each stride at
    least the span of the dims before it."""
    span = 1                                        # offsets 0 .. span-1 reached by the dims taken so far
    for st, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if st < span:
            raise ValueError(f"{name} must not overlap itself (a slot's writes would land in another's; its dims by "
                             f"increasing stride must nest): strides {tuple(t.stride())} for shape {list(t.shape)}")
        span += st * (n - 1)


# ----------------------------------------------------------------------------------------------
# validation shared with fast
# ----------------------------------------------------------------------------------------------

def _need_index(name: str, t, ndim: int, device) -> None:
    _need_tensor(name, t, ndim)
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    _need_device(name, t, device)


def check_state_indices(state_indices, cache: GDNStateCache, N: Optional[int], check_values: bool) -> int:
    """state_indices: [N] int. With check_values: the slot rules (range, distinct) on the host. Returns N."""
    _need_index("state_indices", state_indices, 1, cache.ssm_state.device)
    if N is not None and state_indices.shape[0] != N:
        raise ValueError(f"state_indices must have shape [N] = [{N}], got [{state_indices.shape[0]}]")
    if check_values:
        raise_first(f for f, _ in _slot_faults(state_indices.tolist(), cache.num_slots))  # host read
    return state_indices.shape[0]


def raise_first(faults) -> None:
    """Raise the first fault (ValueError with fault_message's text), if any."""
    f = first_fault(faults)
    if f is not None:
        raise ValueError(fault_message(*f))


def _awaiting(cache: GDNStateCache) -> Callable[[int], bool]:
    flags = cache.pend_meta[:, 1].tolist()      # host read
    return lambda slot: bool(flags[slot] & AWAIT_ACCEPT)


def step_value_faults(cache: GDNStateCache, state_indices, cu_seqlens, T: int):
    """step_faults on the call's tensors (host reads): (ok [N], faults [N])."""
    offsets = cu_seqlens.tolist() if cu_seqlens is not None else None
    return step_faults(state_indices.tolist(), cache.num_slots, _awaiting(cache), offsets, T, cache.tokens_cap)


def prefill_value_faults(cache: GDNStateCache, state_indices, offsets: Sequence[int], T: int):
    """step_faults for a prefill (no token cap), offsets: cu_seqlens' values as a host list: (ok [N], faults [N])."""
    return step_faults(state_indices.tolist(), cache.num_slots, _awaiting(cache), offsets, T, None)


def offsets_sane(offsets: Sequence[int], T: int) -> bool:
    """cu_seqlens' values (a host list) start at 0, never decrease and end at T."""
    return offsets[0] == 0 and offsets[-1] == T and all(x <= y for x, y in zip(offsets, offsets[1:]))


def accept_value_faults(cache: GDNStateCache, state_indices, num_accepted):
    """accept_faults on the call's tensors (host reads): (ok [N], faults [N])."""
    counts = cache.pend_meta[:, 0].tolist()
    return accept_faults(state_indices.tolist(), cache.num_slots, _awaiting(cache), lambda s: counts[s],
                         num_accepted.tolist())


def record_fault(cache: GDNStateCache, faults) -> None:
    """Record the first fault in cache.err unless one is there already (fast's kernels do the same)."""
    f = first_fault(faults)
    if f is not None and int(cache.err[0]) == 0:
        cache.err.copy_(torch.tensor(f, dtype=torch.int64))


def check_step_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                      cu_seqlens=None, scale=None, activation="silu", check_values=True) -> int:
    """Validate a decode (cu_seqlens None) or verify step's arguments; return N, the request count.

    mixed_qkv: [T, D]; a, b: [T, HV]; conv_weight: [D, W]; conv_bias: [D]; A_log, dt_bias: [HV];
    state_indices: [N]; cu_seqlens: [N+1] (verify) -- T == N for decode. Shapes, dtypes and
    devices always; with check_values the value rules too (step_faults; host reads). What the shape
    checks read is summarised by :func:`step_signature` (keep the two in step).
    """
    check_cache(cache)
    dev = cache.ssm_state.device
    _need_tensor("mixed_qkv", mixed_qkv, 2)
    _need_float("mixed_qkv", mixed_qkv)
    _need_device("mixed_qkv", mixed_qkv, dev)
    T = mixed_qkv.shape[0]
    H, HV, K, V, D, W = cache.H, cache.HV, cache.K, cache.V, cache.D, cache.W
    if mixed_qkv.shape[1] != D:
        raise ValueError(f"mixed_qkv must have shape [T, D] = [{T}, {D}] (D = 2*H*K + HV*V = "
                         f"2*{H}*{K} + {HV}*{V}), got [{', '.join(map(str, mixed_qkv.shape))}]")
    for name, t in (("a", a), ("b", b)):
        check_float_param(name, t, (T, HV), "[T, HV]", dev)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_float_param(name, t, (HV,), "[HV]", dev)
    check_float_param("conv_weight", conv_weight, (D, W), "[D, W] (W from cache.conv_state)", dev)
    if conv_bias is not None:
        check_float_param("conv_bias", conv_bias, (D,), "[D]", dev)
    check_activation(activation)
    check_scale(scale)
    if cu_seqlens is None:
        N = check_state_indices(state_indices, cache, T, False)
    else:
        _need_index("cu_seqlens", cu_seqlens, 1, dev)
        if cu_seqlens.numel() < 1:
            raise ValueError("cu_seqlens must hold N+1 >= 1 offsets [0, ..., T]")
        N = check_state_indices(state_indices, cache, cu_seqlens.numel() - 1, False)
        if N == 0 and T != 0:   # [cu[0]] must be both 0 and T: a shape fault, no value needed
            raise ValueError(f"cu_seqlens must end at T={T} (the tokens in mixed_qkv) and start at 0: with N = 0 "
                             f"requests (one offset) T must be 0")
    if check_values:
        raise_first(step_value_faults(cache, state_indices, cu_seqlens, T)[1])
    return N


def check_prefill_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                         cu_seqlens, has_initial_state=None, scale=None, activation="silu", cu_seqlens_cpu=None,
                         check_values=True) -> int:
    """Validate a prefill's arguments; return N, the request count.

    As check_step_inputs for a verify (mixed_qkv [T, D], a, b [T, HV], state_indices [N], cu_seqlens [N+1]),
    plus has_initial_state: [N] bool or None, and cu_seqlens_cpu: cu_seqlens' values as a CPU tensor or None
    (its values then stand for cu_seqlens'). With check_values the value rules too (step_faults without a token
    cap; host reads). What the shape checks read is summarised by fast.serving's _prefill_signature (keep them in
    step).
    """
    if cu_seqlens is None:
        raise ValueError("cu_seqlens must be given for a prefill ([N+1] int, vLLM's query_start_loc)")
    N = check_step_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                          scale, activation, False)
    if has_initial_state is not None:
        _need_tensor("has_initial_state", has_initial_state, 1)
        _need_device("has_initial_state", has_initial_state, cache.ssm_state.device)
        if has_initial_state.dtype != torch.bool or has_initial_state.shape[0] != N:
            raise ValueError(f"has_initial_state must be a bool tensor of shape [N] = [{N}], got "
                             f"{has_initial_state.dtype} [{', '.join(map(str, has_initial_state.shape))}]")
    check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens)
    if check_values:
        raise_first(prefill_value_faults(cache, state_indices, host_offsets(cu_seqlens), mixed_qkv.shape[0])[1])
    return N


def check_accept_inputs(cache, state_indices, num_accepted, check_values=True) -> int:
    """num_accepted: [N] int; with check_values the value rules too (accept_faults; host reads)."""
    check_cache(cache)
    N = check_state_indices(state_indices, cache, None, False)
    _need_index("num_accepted", num_accepted, 1, cache.ssm_state.device)
    if num_accepted.shape[0] != N:
        raise ValueError(f"num_accepted must have shape [N] = [{N}], got [{num_accepted.shape[0]}]")
    if check_values:
        raise_first(accept_value_faults(cache, state_indices, num_accepted)[1])
    return N


# ----------------------------------------------------------------------------------------------
# signatures: what the host checks above read, for callers that skip re-checking unchanged metadata
# ----------------------------------------------------------------------------------------------

def tensor_signature(t):
    """A tensor's metadata as the checks see it: (type, shape, stride, dtype, device); None for None.

    shape and stride decide rank, numel and every layout rule the checks test (is_contiguous() and the
    no-overlap rule are functions of them); type decides isinstance(t, torch.Tensor). Read on every call:
    a tensor changed in place (``resize_``, ``as_strided_``, ``t.data = ...``) gives another signature.
    """
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def cache_fields(cache) -> tuple:
    """The cache's eight tensors as check_cache reads them (fields may be reassigned): ssm_state, conv_state,
    pend_k, pend_v, pend_g, pend_beta, pend_meta, err."""
    c = cache
    return c.ssm_state, c.conv_state, c.pend_k, c.pend_v, c.pend_g, c.pend_beta, c.pend_meta, c.err


def step_tensors(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                 cu_seqlens=None, absent=None) -> tuple:
    """Every tensor whose metadata check_step_inputs reads, in a fixed order: the nine arguments, then the
    cache's fields; ``absent`` where an optional one (conv_bias, cu_seqlens) is None. :func:`step_signature`
    summarises exactly these (with type(cache), type(scale) and activation); fast.serving's guard checks
    exactly these (with a placeholder tensor for ``absent``)."""
    return (mixed_qkv, a, b, conv_weight, absent if conv_bias is None else conv_bias, A_log, dt_bias, state_indices,
            absent if cu_seqlens is None else cu_seqlens, *cache_fields(cache))


def accept_tensors(cache, state_indices, num_accepted, absent=None) -> tuple:
    """As step_tensors, for check_accept_inputs (no optional tensor: ``absent`` is unused)."""
    return (state_indices, num_accepted, *cache_fields(cache))


def materialize_tensors(cache, state_indices, absent=None) -> tuple:
    """As step_tensors, for check_cache and check_state_indices (gdn_materialize's checks; ``absent`` unused)."""
    return (state_indices, *cache_fields(cache))


def step_signature(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                   cu_seqlens=None, scale=None, activation="silu") -> Optional[tuple]:
    """A hashable summary of everything :func:`check_step_inputs` (with :func:`check_cache`) reads except
    values, or None when an argument cannot be summarised (the caller then checks in full).

    Two calls with equal signatures pass or fail those checks alike: the tensor_signature of each of
    :func:`step_tensors` (None-ness included), type(cache), type(scale) (check_scale reads only the type),
    and activation itself (a str or None; anything else: None). The value rules (check_values) are not
    covered: they read tensor values and must run on every call. Extending check_step_inputs or check_cache
    with a check on anything else means extending this (and step_tensors) too.
    Cost: a few attribute reads per tensor (17 tensors), no tensor is created or read.
    """
    if activation is not None and type(activation) is not str:
        return None
    try:
        return (type(cache), type(scale), activation, *map(tensor_signature, step_tensors(
            mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens)))
    except Exception:  # noqa: BLE001 - not a tensor / not a cache: the full checks raise their own error
        return None


def materialize_signature(cache, state_indices) -> Optional[tuple]:
    """As step_signature, for :func:`check_cache` and :func:`check_state_indices` (gdn_materialize's checks)."""
    try:
        return (type(cache), *map(tensor_signature, materialize_tensors(cache, state_indices)))
    except Exception:  # noqa: BLE001 - see step_signature
        return None


def accept_signature(cache, state_indices, num_accepted) -> Optional[tuple]:
    """As step_signature, for :func:`check_accept_inputs` (the cache, state_indices, num_accepted)."""
    try:
        return (type(cache), *map(tensor_signature, accept_tensors(cache, state_indices, num_accepted)))
    except Exception:  # noqa: BLE001 - see step_signature
        return None


# ----------------------------------------------------------------------------------------------
# the protocol, one request at a time
# ----------------------------------------------------------------------------------------------

def _pending(cache: GDNStateCache, slot: int, dt: torch.dtype):
    """(count, bank, k [1, c, H, K], v [1, c, HV, V], g, beta [1, c, HV]) of a slot's pending tokens."""
    count, word = (int(x) for x in cache.pend_meta[slot].tolist())
    count, bank = min(max(count, 0), cache.tokens_cap), word & 1
    sel = (slot, bank, slice(0, count))
    return count, bank, *(t[sel][None].to(dt) for t in (cache.pend_k, cache.pend_v, cache.pend_g, cache.pend_beta))


def _fold_pending(cache: GDNStateCache, slot: int, dt: torch.dtype):
    """The slot's committed state with its pending tokens re-applied: (S [1, HV, K, V] in dt, count, bank)."""
    count, bank, k, v, g, beta = _pending(cache, slot, dt)
    S = cache.ssm_state[slot][None].to(dt)
    if count:
        q = torch.zeros_like(k)  # outputs of re-applied tokens were already returned: not needed
        _, S = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S, output_final_state=True)
    return S, count, bank


def _step(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
          scale, activation, keep_pending: bool):
    """Shared body of decode (keep_pending False: commit everything) and verify (keep the new tokens).
    Requests that break a value rule are skipped; the first fault is recorded in cache.err (callers
    with check_values have raised it already)."""
    H, HV, K, V, W = cache.H, cache.HV, cache.K, cache.V, cache.W
    T = mixed_qkv.shape[0]
    dt = compute_dtype(mixed_qkv, cache.ssm_state, cache.pend_k)
    ok, faults = step_value_faults(cache, state_indices, cu_seqlens, T)
    record_fault(cache, faults)
    offsets = list(range(T + 1)) if cu_seqlens is None else cu_seqlens.tolist()
    o = mixed_qkv.new_zeros(T, HV, V)              # padded (and failed) rows: zeros
    writes = []                                    # (slot, ...) applied after every request is computed
    for n, slot in enumerate(state_indices.tolist()):
        if slot < 0 or not ok[n]:
            continue
        bos, eos = offsets[n], offsets[n + 1]
        L = eos - bos
        # --- the committed state: fold the pending (accepted) tokens of the last verify
        S, count, bank = _fold_pending(cache, slot, dt)
        # --- conv: the committed window (starts at column count-1), then the new raw inputs
        off = max(count - 1, 0)
        window = cache.conv_state[slot, :, off:off + W - 1]                     # [D, W-1], oldest first
        x = mixed_qkv[bos:eos]                                                  # [L, D]
        y, _ = causal_conv1d(x[None], conv_weight, conv_bias, activation, initial_state=window[None])
        seq = torch.cat([window, rearrange(x, "l d -> d l").to(cache.conv_state.dtype)], dim=1)  # [D, W-1+L]
        new_conv = seq[:, min(L, 1):]              # drop the oldest input iff a token came in
        # --- gating and l2norm (compute dtype), split y [L, D] -> q, k [L, H, K], v [L, HV, V]
        y = y[0]
        q, k, v = split_qkv(y, H, K, HV)
        qn, kn = l2norm(q.to(dt)), l2norm(k.to(dt))
        g, beta = gdn_gating(A_log, a[bos:eos].to(dt), dt_bias, b[bos:eos].to(dt))
        # --- delta rule on from the committed state
        o_n, S_end = recurrent_gated_delta_rule(qn[None], kn[None], v[None].to(dt), g[None].to(dt),
                                                beta[None].to(dt), scale=scale, initial_state=S,
                                                output_final_state=True)
        o[bos:eos] = o_n[0].to(o.dtype)
        if keep_pending:   # verify: commit the accepted prefix only; the new tokens become pending
            writes.append((slot, S if count else None, new_conv, (L, (1 - bank) | AWAIT_ACCEPT), (kn, v, g, beta)))
        else:              # decode: everything committed
            writes.append((slot, S_end if count + L else None, new_conv, (0, bank), None))
    for slot, S, new_conv, meta, pend in writes:
        if S is not None:
            cache.ssm_state[slot] = S[0].to(cache.ssm_state.dtype)   # the one rounding of the state
        cache.conv_state[slot, :, :new_conv.shape[1]] = new_conv
        if pend is not None:
            L, nb = meta[0], meta[1] & 1
            for buf, val in zip((cache.pend_k, cache.pend_v, cache.pend_g, cache.pend_beta), pend):
                buf[slot, nb, :L] = val.to(buf.dtype)
        cache.pend_meta[slot] = torch.tensor(meta, dtype=torch.int32)
    return o


def gdn_decode(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache: GDNStateCache, state_indices,
               scale: Optional[float] = None, activation: Optional[str] = "silu", check_values: bool = True):
    """One decode token per request, in place in the slot cache: conv update + gating + l2norm + delta rule.

    mixed_qkv: [N, D]   a, b: [N, HV]   conv_weight: [D, W]   conv_bias: [D] or None   A_log, dt_bias: [HV]
    state_indices: [N] int (negative = padded row: reads nothing, writes nothing, output zeros)
    Returns o: [N, HV, V] in mixed_qkv's dtype.

        S <- fold(pending);  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = scale S^T q

    Pending tokens (accepted by a previous verify) are re-applied first, so a decode may follow a
    verify + accept directly (not a verify alone: E_AWAITING); afterwards the slot is committed
    (count 0). Value rules and faults: the module docstring (check_values=False: skip and record).
    """
    check_step_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, None,
                      scale, activation, check_values)
    return _step(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, None,
                 scale, activation, keep_pending=False)


def gdn_verify(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache: GDNStateCache, state_indices,
               cu_seqlens, scale: Optional[float] = None, activation: Optional[str] = "silu",
               check_values: bool = True):
    """Speculative verify: 1 + k_n tokens for request n (k_n may differ), an output for every token.

    mixed_qkv: [T, D]   a, b: [T, HV]   cu_seqlens (query_start_loc): [N+1], request n owns tokens
    [cu[n], cu[n+1]), at most 1 + cache.max_draft of them   state_indices: [N]   (rest as gdn_decode)
    Returns o: [T, HV, V] in mixed_qkv's dtype.

        S <- fold(pending) (written back once);  for each new token: the delta rule on from S, o_t

    The new tokens are not committed: they become the slot's pending tokens, all accepted until
    :func:`gdn_accept` says how many to keep; the slot then awaits that accept (AWAIT_ACCEPT), and
    a decode / verify / materialize of it before the accept is a fault (E_AWAITING). The next step
    re-applies the accepted tokens. Value rules and faults: the module docstring.
    """
    if cu_seqlens is None:
        raise ValueError("cu_seqlens must be given for a verify step ([N+1] int, vLLM's query_start_loc)")
    check_step_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                      cu_seqlens, scale, activation, check_values)
    return _step(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                 scale, activation, keep_pending=True)


@one_host_read   # cu_seqlens' values read to the host once per call (or taken from cu_seqlens_cpu)
def gdn_prefill(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache: GDNStateCache, state_indices,
                cu_seqlens, has_initial_state=None, scale: Optional[float] = None, activation: Optional[str] = "silu",
                check_values: bool = True, cu_seqlens_cpu=None):
    """Prefill in the chunked form: N requests of any length, in place in the slot cache.

    mixed_qkv: [T, D]   a, b: [T, HV]   cu_seqlens (query_start_loc): [N+1], request n owns tokens
    [cu[n], cu[n+1])   state_indices: [N] (negative = padded row: reads nothing, writes nothing, output zeros)
    has_initial_state: [N] bool (vLLM's name: the request has context before these tokens) or None (every
    request continues from its slot)   cu_seqlens_cpu: cu_seqlens' values as a CPU tensor, or None
    (rest as gdn_decode). Returns o: [T, HV, V] in mixed_qkv's dtype.

        S, window <- the slot's committed state (pending tokens folded) if has_initial_state[n] else 0
        conv, l2norm, gating, the gated delta rule (chunked) over the request's tokens from S
        ssm_state[slot], conv_state[slot, :, :W-1] <- the final state and window;  count <- 0

    Afterwards the slot is committed (count 0), whatever was pending; a slot whose verify awaits its
    accept is a fault (E_AWAITING), as for decode. The value rules are decode's and verify's without a
    token cap (the module docstring; check_values=False: skip and record), except that bad offsets always
    raise the call's first fault before anything runs (a prefill reads its offsets on the host).
    Numerics: the conv in the compute dtype (refgdn.causal_conv1d), beta = sigmoid(b) and the gating
    (fused into the chunked form: g = -exp(A_log) softplus(a + dt_bias)) in float32 (float64), the
    state read once and written once, rounded to the cache's dtype. No autograd (a serving op).
    """
    N = check_prefill_inputs(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices,
                             cu_seqlens, has_initial_state, scale, activation, cu_seqlens_cpu, False)
    H, HV, K, V, W = cache.H, cache.HV, cache.K, cache.V, cache.W
    T = mixed_qkv.shape[0]
    offsets = host_offsets(cu_seqlens)                 # cu_seqlens_cpu's values when given
    ok, faults = prefill_value_faults(cache, state_indices, offsets, T)
    if check_values or not offsets_sane(offsets, T):   # (bad offsets: read on the host anyway, raised at once)
        raise_first(faults)
    record_fault(cache, faults)
    has = [True] * N if has_initial_state is None else has_initial_state.tolist()
    dt = compute_dtype(mixed_qkv, cache.ssm_state, cache.pend_k)
    o = mixed_qkv.new_zeros(T, HV, V)              # padded (and failed) rows: zeros
    writes = []                                    # (slot, S, window, bank) applied after every request ran
    for n, slot in enumerate(state_indices.tolist()):
        if slot < 0 or not ok[n]:
            continue
        bos, eos = offsets[n], offsets[n + 1]
        # --- where the request starts: its committed state (pending tokens folded in), or zeros
        bank = int(cache.pend_meta[slot, 1]) & 1
        if has[n]:
            S, count, bank = _fold_pending(cache, slot, dt)
            off = max(count - 1, 0)
            window = cache.conv_state[slot, :, off:off + W - 1]                 # [D, W-1], oldest first
        else:
            S = torch.zeros(1, HV, K, V, dtype=dt, device=o.device)
            window = torch.zeros_like(cache.conv_state[slot, :, :W - 1])
        # --- conv (the window carries over), split y [L, D] -> q, k [L, H, K], v [L, HV, V]
        y, window = causal_conv1d(mixed_qkv[None, bos:eos], conv_weight, conv_bias, activation,
                                  initial_state=window[None], output_final_state=True)
        y = y[0]
        q, k, v = split_qkv(y, H, K, HV)
        beta = torch.sigmoid(b[bos:eos].to(compute_dtype(b)))                # float32 (float64)
        # --- the chunked delta rule with l2norm and the gating inside (g = a here)
        o_n, S_end = chunk_gated_delta_rule(q[None], k[None], v[None], a[None, bos:eos], beta[None], scale,
                                            initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            A_log=A_log, dt_bias=dt_bias)
        o[bos:eos] = o_n[0].to(o.dtype)
        writes.append((slot, S_end[0], window[0], bank))
    for slot, S, window, bank in writes:
        cache.ssm_state[slot] = S.to(cache.ssm_state.dtype)       # the one rounding of the state
        cache.conv_state[slot, :, :W - 1] = window.to(cache.conv_state.dtype)
        cache.pend_meta[slot] = torch.tensor((0, bank), dtype=torch.int32)
    return o


def gdn_accept(cache: GDNStateCache, state_indices, num_accepted, check_values: bool = True) -> None:
    """After a verify: keep the first ``num_accepted[n]`` tokens of request n, drop the rest.

    state_indices: [N] int (negative = padded row, ignored)   num_accepted: [N] int in [1, L_n], L_n = the
    tokens request n brought to the verify (0 when L_n = 0)

        count[slot] <- num_accepted;  the slot no longer awaits an accept

    Only the per-slot pending count changes (one int per request); the state itself is committed
    lazily by the next step. Exactly one accept follows each verify, for the verify's slots: an
    accept of a slot with no verify awaiting it (after a decode, a materialize, or a second accept)
    is a fault (E_NO_VERIFY), as is a count out of range (E_ACCEPT_RANGE).
    """
    check_accept_inputs(cache, state_indices, num_accepted, check_values)
    ok, faults = accept_value_faults(cache, state_indices, num_accepted)
    record_fault(cache, faults)
    for n, (slot, acc) in enumerate(zip(state_indices.tolist(), num_accepted.tolist())):
        if ok[n]:
            bank = int(cache.pend_meta[slot, 1]) & 1
            cache.pend_meta[slot] = torch.tensor((acc, bank), dtype=torch.int32)


def gdn_materialize(cache: GDNStateCache, state_indices, check_values: bool = True) -> None:
    """Commit the slots' pending tokens: afterwards ``ssm_state[slot]`` and ``conv_state[slot, :, :W-1]``
    are the slot's state and its count is 0 (what prefill and plain readers expect).

    state_indices: [N] int (negative = ignored). A slot whose verify awaits its accept is a fault (E_AWAITING).

        S <- fold(pending);  window <- conv_state[slot, :, max(count-1, 0) : ... + W-1]
    """
    check_cache(cache)
    check_state_indices(state_indices, cache, None, False)
    ok, faults = step_value_faults(cache, state_indices, None, state_indices.shape[0])
    if check_values:
        raise_first(faults)
    record_fault(cache, faults)
    W = cache.W
    dt = compute_dtype(cache.ssm_state, cache.pend_k)
    for n, slot in enumerate(state_indices.tolist()):
        if slot < 0 or not ok[n]:
            continue
        S, count, bank = _fold_pending(cache, slot, dt)
        if count:
            cache.ssm_state[slot] = S[0].to(cache.ssm_state.dtype)
        off = max(count - 1, 0)
        cache.conv_state[slot, :, :W - 1] = cache.conv_state[slot, :, off:off + W - 1].clone()
        cache.pend_meta[slot] = torch.tensor((0, bank), dtype=torch.int32)


def committed_state(cache: GDNStateCache, slots: Sequence[int]):
    """(ssm [n, HV, K, V], conv [n, D, W-1]) of the given slots as if materialized, without writing.

    For tests and conformance: compares slots regardless of how much is still pending (a slot
    awaiting its accept is read as if all its verify's tokens were accepted).
    """
    c = cache.clone()
    idx = torch.as_tensor(list(slots), dtype=torch.int64, device=cache.ssm_state.device)
    c.pend_meta[:, 1] &= 1                       # a reader, not a protocol step: no AWAIT_ACCEPT fault
    gdn_materialize(c, idx)
    return c.ssm_state[idx], c.conv_state[idx, :, :cache.W - 1]
