"""fast.serving's host checks cached by signature (issue 10, eager speed): fail-closed stays fail-closed.

A decode / verify / accept whose signature (refgdn.serving.step_signature / accept_signature) passed the
shape, dtype and device checks before skips them. These tests show that

  (a) after a valid call has stored its signature, every kind of bad input -- a wrong dtype, shape or
      device, a non-contiguous cache field, a cache field replaced on the same cache object, a tensor
      resized or restrided in place -- still raises the ValueError an uncached call raises, word for
      word, and no cache tensor changes; value faults are still found (host with check_values=True,
      device otherwise);
  (b) the cached path gives the bits of the uncached one (outputs and every cache tensor), and it is
      really taken (the checks run once per signature);
  (c) the store is bounded, and a plan follows the config functions in use (tests wrap step_config).

Tiny shapes, float32 (the Triton interpreter on CPU): a few seconds.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import triton.language as tl

import fast
import fast.serving as fs
import refgdn
import refgdn.serving as rs
from conformance.cases_serving import make_cache, make_layer, make_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ELSEWHERE = "cpu" if DEVICE == "cuda" else "meta"      # a device the inputs are not on
H, HV, K, V, W, MD, S = 1, 2, 8, 8, 4, 2, 4
D = 2 * H * K + HV * V
F32, I32 = torch.float32, torch.int32


def _i(values, dtype=I32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


class World:
    """A 4-slot cache (max_draft 2), a layer and step tokens on DEVICE, float32."""

    def __init__(self, seed: int = 0):
        self.cache = make_cache(S, H, HV, K, V, W, MD, seed=seed, state_dtype=F32, act_dtype=F32).to(device=DEVICE)
        lay = make_layer(H, HV, K, V, W, seed=seed + 1, dtype=F32, device=DEVICE)
        self.layer = [lay["conv_weight"], lay["conv_bias"], lay["A_log"], lay["dt_bias"]]
        self.x, self.a, self.b = make_tokens(6, HV, D, seed=seed + 2, dtype=F32, device=DEVICE)

    def decode_args(self, n: int = 2):
        """gdn_decode's positional arguments for slots 0..n-1."""
        return [self.x[:n], self.a[:n], self.b[:n], *self.layer, self.cache, _i(list(range(n)))]

    def verify_args(self):
        """gdn_verify's: slots 0 and 2 with 3 and 2 tokens."""
        return [self.x[:5], self.a[:5], self.b[:5], *self.layer, self.cache, _i([0, 2]), _i([0, 3, 5])]

    def snapshot(self, also=()) -> list:
        """(tensor, copy) of every cache field and of `also` (fields a case replaced), meta tensors aside."""
        ts = [t for t in list(self.cache.tensors()) + list(also)
              if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        return [(t, t.clone()) for t in ts]

    @staticmethod
    def unchanged(snap) -> bool:
        return all(torch.equal(t, u) for t, u in snap)


def _message(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.fixture(autouse=True)
def _fresh_store():
    fs.clear_plan_cache()
    yield
    fs.clear_plan_cache()


# ------------------------------------------------------------------------------------------------
# (a) bad inputs after a cached valid call
# ------------------------------------------------------------------------------------------------
# each case: (name, op, mutate(world, args) -> the bad args). Mutations on the world's objects (a cache
# field reassigned, a tensor resized in place) happen inside mutate, after the valid call was cached.

def _set(i, value):
    def mutate(w, args):
        args[i] = value(w, args) if callable(value) else value
        return args
    return mutate


def _field(name, value):
    def mutate(w, args):
        setattr(w.cache, name, value(getattr(w.cache, name)))
        return args
    return mutate


def _resize_indices(w, args):
    args[8].resize_(3)                        # state_indices [2] -> [3] in place (same object)
    return args


def _resize_x(w, args):
    args[0] = args[0].clone()
    return args


def _restride_ssm(w, args):
    s = w.cache.ssm_state                     # same tensor object, every slot now at the same address
    s.as_strided_(s.shape, (0, s.stride(1), s.stride(2), 1))
    return args


def _resize_pend_meta(w, args):
    w.cache.pend_meta.resize_(S, 3)           # a cache field resized in place
    return args


def _data_dtype(w, args):
    w.layer[2].data = w.layer[2].data.double().to(torch.int64)     # A_log's dtype swapped through .data
    return args


BAD = [
    ("mixed_qkv-dtype", "decode", _set(0, lambda w, a: a[0].to(I32))),
    ("mixed_qkv-width", "decode", _set(0, lambda w, a: w.x[:2, :-1])),
    ("a-shape", "decode", _set(1, lambda w, a: w.a[:2, :1])),
    ("b-dtype", "decode", _set(2, lambda w, a: a[2].to(I32))),
    ("conv_weight-width", "decode", _set(3, lambda w, a: a[3][:, :3])),
    ("conv_bias-shape", "decode", _set(4, lambda w, a: a[4][:-1])),
    ("A_log-device", "decode", _set(5, lambda w, a: torch.zeros(HV, device=ELSEWHERE))),
    ("A_log-dtype-through-data", "decode", _data_dtype),
    ("indices-float", "decode", _set(8, lambda w, a: a[8].to(F32))),
    ("indices-resized-in-place", "decode", _resize_indices),
    ("scale-str", "decode_scale", None),
    ("activation", "decode_activation", None),
    ("cache-not-a-cache", "decode", _set(7, lambda w, a: w.cache.tensors())),
    ("cache-ssm-overlapping", "decode", _field("ssm_state", lambda t: t[:1].expand(t.shape))),
    ("cache-ssm-restrided-in-place", "decode", _restride_ssm),
    ("cache-pend_k-noncontiguous", "decode",
     _field("pend_k", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1))),
    ("cache-pend_g-shape", "decode", _field("pend_g", lambda t: t[:, :, :1])),
    ("cache-pend_meta-dtype", "decode", _field("pend_meta", lambda t: t.long())),
    ("cache-pend_meta-resized-in-place", "decode", _resize_pend_meta),
    ("cache-err-dtype", "decode", _field("err", lambda t: t.to(I32))),
    ("cache-conv-channels", "decode", _field("conv_state", lambda t: t[:, 1:])),
    ("cache-conv-device", "decode", _field("conv_state", lambda t: torch.zeros(t.shape, device=ELSEWHERE))),
    ("verify-cu-float", "verify", _set(9, lambda w, a: a[9].to(F32))),
    ("verify-cu-length", "verify", _set(9, lambda w, a: _i([0, 3, 4, 5]))),
    ("verify-cu-rank", "verify", _set(9, lambda w, a: a[9][None])),
    ("verify-cu-missing", "verify", _set(9, None)),
    ("accept-count-float", "accept", _set(2, lambda w, a: a[2].to(F32))),
    ("accept-count-length", "accept", _set(2, lambda w, a: a[2][:1])),
    ("accept-indices-resized-in-place", "accept", lambda w, a: (a[1].resize_(3), a)[1]),
    ("materialize-indices-float", "materialize", _set(1, lambda w, a: a[1].to(F32))),
    ("materialize-indices-rank", "materialize", _set(1, lambda w, a: a[1][None])),
    ("materialize-indices-resized-in-place", "materialize", lambda w, a: (a[1].resize_(1, 2), a)[1]),
    ("materialize-cache-ssm-overlapping", "materialize", _field("ssm_state", lambda t: t[:1].expand(t.shape))),
    ("materialize-cache-pend_meta-resized-in-place", "materialize", _resize_pend_meta),
]


def _call(ops, kind, args):
    if kind in ("decode", "decode_scale", "decode_activation"):
        kw = dict(scale="0.5") if kind == "decode_scale" else dict(activation="relu") if kind == "decode_activation" \
            else {}
        return ops.gdn_decode(*args, **kw)
    if kind == "verify":
        return ops.gdn_verify(*args)
    if kind == "materialize":
        return ops.gdn_materialize(*args)
    return ops.gdn_accept(*args)


def _valid_args(w, kind):
    """Run the valid calls that store the case's signature; return the args to mutate."""
    if kind == "accept":
        fast.gdn_verify(*w.verify_args())
        args = [w.cache, _i([0, 2]), _i([2, 1])]
        fast.gdn_accept(*args)            # stores accept's signature ...
        fast.gdn_verify(*w.verify_args())  # ... and a verify awaits the bad accept
        return args
    if kind == "materialize":
        args = [w.cache, _i([0, 2])]
        fast.gdn_materialize(*args)       # stores materialize's signature
        return args
    args = w.verify_args() if kind == "verify" else w.decode_args()
    _call(fast, "verify" if kind == "verify" else "decode", args)
    return args


def _bad_message(kind, mutate, cached: bool) -> tuple:
    """(message, nothing changed) of the bad call, after valid calls stored their signatures (cached) or
    with the store emptied just before the bad call (uncached)."""
    w = World()
    args = _valid_args(w, kind)
    if cached:
        assert len(fs._PLANS) > 0
    fields = list(w.cache.tensors())      # the original field tensors, in case mutate replaces some
    args = mutate(w, list(args)) if mutate is not None else list(args)
    if not cached:
        fs.clear_plan_cache()
    snap = w.snapshot(also=fields)
    msg = _message(lambda: _call(fast, kind, args))
    ok = w.unchanged(snap)
    w.cache = rs.GDNStateCache(*fields)
    w.cache.check()                       # nothing was recorded either
    return msg, ok


@pytest.mark.parametrize("name,kind,mutate", BAD, ids=[b[0] for b in BAD])
def test_bad_input_after_a_cached_call_raises_the_uncached_error(name, kind, mutate):
    cached, untouched = _bad_message(kind, mutate, cached=True)
    uncached, untouched_u = _bad_message(kind, mutate, cached=False)
    assert cached == uncached
    assert untouched and untouched_u, f"{name}: a cache tensor changed"
    if kind == "materialize":             # and refgdn, the oracle, says the same
        w = World()
        args = mutate(w, [w.cache, _i([0, 2])])
        assert _message(lambda: _call(refgdn, kind, args)) == cached
    elif kind != "accept":
        w = World()
        args = mutate(w, (w.verify_args() if kind == "verify" else w.decode_args())) if mutate else \
            w.decode_args()
        assert _message(lambda: _call(refgdn, kind, args)) == cached


def test_value_faults_are_still_found_on_the_cached_path():
    """check_values=True reads the values on every call (host), before any launch; without it the
    kernels' device checks record the fault (raised by cache.check(); on CPU by the op)."""
    w = World()
    fast.gdn_decode(*w.decode_args())
    args = w.decode_args()
    args[8] = _i([0, S])                  # slot S: out of range, same metadata as the cached call
    snap = w.snapshot()
    m = _message(lambda: fast.gdn_decode(*args, check_values=True))
    assert m == rs.fault_message(rs.E_SLOT_RANGE, 1, S, S) and World.unchanged(snap)

    def device_checked():
        fast.gdn_decode(*args)
        w.cache.check()
    assert _message(device_checked) == m
    # accept: a count beyond the verify's tokens, host-checked on a cached signature
    fast.gdn_verify(*w.verify_args())
    fast.gdn_accept(w.cache, _i([0, 2]), _i([1, 1]))
    fast.gdn_verify(*w.verify_args())
    snap = w.snapshot()
    m = _message(lambda: fast.gdn_accept(w.cache, _i([0, 2]), _i([4, 1]), check_values=True))
    assert "num_accepted[0]" in m and World.unchanged(snap)


# ------------------------------------------------------------------------------------------------
# (b) cached == uncached, bit for bit; the cached path is taken
# ------------------------------------------------------------------------------------------------

def _schedule(w, before_each):
    """verify -> accept -> decode -> verify -> accept -> decode -> verify (strided inputs) -> accept -> decode."""
    outs = []
    wide = torch.zeros(5, 2 * D, device=DEVICE)
    wide[:, ::2] = w.x[:5]
    for r in range(3):
        before_each()
        args = w.verify_args()
        if r == 2:
            args[0] = wide[:, ::2]                               # a strided view: its own signature
        outs.append(fast.gdn_verify(*args))
        before_each()
        fast.gdn_accept(w.cache, _i([0, 2]), _i([[2, 1], [3, 2], [1, 1]][r]))
        before_each()
        outs.append(fast.gdn_decode(*w.decode_args(3), scale=0.25 if r == 1 else None))
    return outs


def test_cached_and_uncached_paths_are_bit_identical(monkeypatch):
    counts = {"step": 0, "accept": 0, "materialize": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(fs, "check_step_inputs", counting("step", fs.check_step_inputs))
    monkeypatch.setattr(fs, "check_accept_inputs", counting("accept", fs.check_accept_inputs))
    monkeypatch.setattr(fs, "check_state_indices", counting("materialize", fs.check_state_indices))
    w_cached, w_plain = World(seed=5), World(seed=5)
    o_cached = _schedule(w_cached, lambda: None)
    for _ in range(2):                                         # verify-free slots: nothing pending
        fast.gdn_materialize(w_cached.cache, _i([0, 2]))
    # 3 step signatures (verify, strided verify, decode; scale's type is float or None: 2 decode signatures)
    assert counts == {"step": 4, "accept": 1, "materialize": 1}, counts
    counts.update(step=0, accept=0, materialize=0)
    o_plain = _schedule(w_plain, fs.clear_plan_cache)
    for _ in range(2):
        fs.clear_plan_cache()
        fast.gdn_materialize(w_plain.cache, _i([0, 2]))
    assert counts == {"step": 6, "accept": 3, "materialize": 2}, counts     # every call checked in full
    for a, b in zip(o_cached, o_plain):
        assert torch.equal(a, b)
    for a, b in zip(w_cached.cache.tensors(), w_plain.cache.tensors()):
        assert torch.equal(a, b)
    w_cached.cache.check()


def test_signature_sees_in_place_changes():
    """Identity is never enough: a tensor changed in place or a cache field replaced changes the signature;
    fresh tensors with the same metadata give the same one."""
    w = World()
    args = w.decode_args()
    sig = rs.step_signature(*args)
    assert sig is not None and sig == rs.step_signature(*World(seed=9).decode_args())
    assert rs.step_signature(*args, scale=0.5) != sig                  # type(scale): float vs None
    assert rs.step_signature(*args, activation=None) != sig
    assert rs.step_signature(*args, activation=["silu"]) is None       # not describable: full checks
    args[8].resize_(3)
    assert rs.step_signature(*args) != sig
    args[8].resize_(2)
    assert rs.step_signature(*args) == sig
    w.cache.pend_k = w.cache.pend_k.clone()                            # same metadata: same signature
    assert rs.step_signature(*args) == sig
    w.cache.pend_k = w.cache.pend_k.double()
    assert rs.step_signature(*args) != sig
    w = World()
    args = w.decode_args()
    args[0].t_()                                                       # in place: [2, D] -> [D, 2]
    assert rs.step_signature(*args) != sig
    args[0].t_()
    args[0].as_strided_(args[0].shape, (1, 2))
    assert rs.step_signature(*args) != sig
    assert rs.step_signature(*w.decode_args()[:7], object(), _i([0, 1])) is None


def _guard_cases():
    """(name, recorded tensors, other tensors) pairs for MetaGuard against tensor_signature: one change each."""
    def fresh():
        return [torch.zeros(2, 6), torch.zeros(6, dtype=torch.int32), torch.zeros(3, 4)[:, :2]]

    def with_(i, make):
        def case():
            ts = fresh()
            ts[i] = make(ts[i])
            return ts
        return case

    def in_place(fn):
        def case():
            ts = fresh()
            fn(ts)
            return ts
        return case

    def data_swap(ts):
        ts[0].data = ts[0].data.double()
    return [
        ("same-metadata", fresh),
        ("shape", with_(0, lambda t: torch.zeros(2, 5))),
        ("stride", with_(0, lambda t: torch.zeros(6, 2).t())),
        ("strided-view", with_(2, lambda t: torch.zeros(3, 2))),
        ("dtype", with_(1, lambda t: t.long())),
        ("device", with_(0, lambda t: t.to("meta"))),
        ("type", with_(0, lambda t: torch.nn.Parameter(t, requires_grad=False))),
        ("rank", with_(1, lambda t: t[None])),
        ("resized-in-place", in_place(lambda ts: ts[1].resize_(7))),
        ("restrided-in-place", in_place(lambda ts: ts[0].as_strided_((2, 6), (1, 2)))),
        ("transposed-in-place", in_place(lambda ts: ts[0].t_())),
        ("dtype-through-data", in_place(data_swap)),
        ("absent-for-a-tensor", with_(1, lambda t: fs.ABSENT)),
        ("empty-tensor-for-absent", with_(1, lambda t: torch.empty(0))),
        ("none", with_(1, lambda t: None)),
        ("not-a-tensor", with_(1, lambda t: [0] * 6)),
    ]


@pytest.mark.parametrize("name,case", _guard_cases(), ids=[c[0] for c in _guard_cases()])
def test_meta_guard_matches_exactly_when_signatures_match(name, case):
    """The guard a hit runs instead of building the signature (fast.launch.MetaGuard) never says "same" where
    the signatures differ, and says "same" for fresh tensors with the recorded metadata (so the hit is real).
    The 'absent' cases: ABSENT stands for None, and no other tensor (an empty one included) matches it."""
    recorded = [torch.zeros(2, 6), fs.ABSENT if name == "empty-tensor-for-absent" else
                torch.zeros(6, dtype=torch.int32), torch.zeros(3, 4)[:, :2]]
    guard = fs.MetaGuard(tuple(recorded))
    other = case()
    sig = [rs.tensor_signature(t) if isinstance(t, torch.Tensor) else t for t in other]
    same_sig = sig == [rs.tensor_signature(t) for t in recorded]
    assert guard.check(*other) == same_sig
    assert same_sig == (name == "same-metadata")


def test_meta_guard_with_repeated_tensors():
    """A guard whose tensors repeat an object (two optional tensors absent, or one tensor passed twice) matches fresh
    tensors of the same metadata repeated the same way (torch's TensorGuards alone says False to any repeated
    argument), and nothing else: distinct objects where the recorded call had one, or one where it had two."""
    def ts():
        return torch.zeros(2, 6), torch.zeros(6, dtype=torch.int32)
    x, i = ts()
    assert fs.MetaGuard((x, fs.ABSENT, i, fs.ABSENT)).check(*(lambda y, j: (y, fs.ABSENT, j, fs.ABSENT))(*ts()))
    assert not fs.MetaGuard((x, fs.ABSENT, i, fs.ABSENT)).check(ts()[0], fs.ABSENT, ts()[1], torch.empty(0))
    y, _ = ts()
    guard = fs.MetaGuard((x, x, i))
    assert guard.check(y, y, i) and not guard.check(y, ts()[0], i) and not guard.check(y, y)
    assert not fs.MetaGuard((x, y, i)).check(x, x, i)


@pytest.mark.parametrize("bias", [True, False], ids=["conv-bias", "no-conv-bias"])
def test_a_hit_builds_no_signature(monkeypatch, bias):
    """After a call has stored its entry, a call with fresh tensors of the same metadata reuses it through the
    guard alone (step_signature is not built); a changed tensor misses the guard and builds it. Without a conv
    bias a decode's guard holds two placeholders (conv_bias and cu_seqlens None): it matched no call before
    MetaGuard took repeated tensors (Qwen3-Next's conv has no bias: every model decode built the signature)."""
    def args_of(world):
        args = world.decode_args()
        if not bias:
            args[4] = None
        return args
    w = World()
    fast.gdn_decode(*args_of(w))
    built = []
    monkeypatch.setattr(rs, "step_signature", lambda *a, **k: built.append(1) or _SIGNATURE(*a, **k))
    fast.gdn_decode(*args_of(World(seed=4)))
    fast.gdn_decode(*args_of(World(seed=5)))
    assert built == []
    args = args_of(w)
    args[0] = args[0].clone().t().contiguous().t()      # same shape, other strides: a miss, then the full checks
    fast.gdn_decode(*args)
    assert built == [1]


def test_a_guard_made_in_another_grad_mode_is_replaced(monkeypatch):
    """A guard reads the dispatch keys under the current grad mode: one stored outside torch.inference_mode misses
    inside it. The first call inside rebuilds it (one signature, no full checks: the plan is the same), and the
    calls after it hit again."""
    w = World()
    fast.gdn_decode(*w.decode_args())
    built, checked = [], []
    monkeypatch.setattr(rs, "step_signature", lambda *a, **k: built.append(1) or _SIGNATURE(*a, **k))
    monkeypatch.setattr(fs, "check_step_inputs", lambda *a, **k: checked.append(1) or rs.check_step_inputs(*a, **k))
    with torch.inference_mode():
        for _ in range(3):
            fast.gdn_decode(*w.decode_args())
    assert built == [1] and checked == []


_SIGNATURE = rs.step_signature     # (the original, for the spy above)


# ------------------------------------------------------------------------------------------------
# (c) bounded; plans follow the config functions in use
# ------------------------------------------------------------------------------------------------

def test_store_is_bounded(monkeypatch):
    assert fs._PLANS.size == fs.PLAN_CACHE_SIZE
    for i in range(3 * fs.PLAN_CACHE_SIZE):
        fs._PLANS.put(("test", i), i)
    assert len(fs._PLANS) == fs.PLAN_CACHE_SIZE
    assert fs._PLANS.get(("test", 0)) is None and fs._PLANS.get(("test", 3 * fs.PLAN_CACHE_SIZE - 1)) is not None
    fs._PLANS.put(("test", [1]), 1)                                   # unhashable: not stored, no error
    assert fs._PLANS.get(("test", [1])) is None and fs._PLANS.get(None) is None
    fs.clear_plan_cache()
    # through the ops: 5 batch sizes, a bound of 3 -> the first ones are checked again (one last entry kept per
    # mode, so an evicted signature is not found there either)
    monkeypatch.setattr(fs._PLANS, "size", 3)
    monkeypatch.setattr(fs, "LAST_SLOTS", 1)
    calls = []
    monkeypatch.setattr(fs, "check_step_inputs", lambda *a, **k: calls.append(a[8].shape[0]) or
                        rs.check_step_inputs(*a, **k))
    w = World()
    for n in (1, 2, 3, 4, 1, 4):
        fast.gdn_decode(*w.decode_args(n))
    assert len(fs._PLANS) == 3
    assert calls == [1, 2, 3, 4, 1]                                     # 1 was dropped, 4 was kept
    assert len(fs._LAST) == 1


def test_last_entries_per_batch_size(monkeypatch):
    """A stream whose batch size changes from call to call finds each size's last entry by its guard alone: no
    signature is built (refgdn.serving.step_signature) after each size's first call; _LAST stays bounded."""
    fs.clear_plan_cache()
    built = []
    real = rs.step_signature
    monkeypatch.setattr(rs, "step_signature", lambda *a, **k: built.append(a[8].shape[0]) or real(*a, **k))
    w = World()
    for n in (1, 2, 3, 1, 2, 3, 1, 2, 3):
        fast.gdn_decode(*w.decode_args(n))
    assert built == [1, 2, 3]
    fs._LAST.clear()
    monkeypatch.setattr(fs, "LAST_SLOTS", 2)
    for n in (1, 2, 3, 4):                                             # each inserted again, past the bound
        fast.gdn_decode(*w.decode_args(n))
        assert len(fs._LAST) <= 2


def test_concurrent_misses_evict_safely(monkeypatch):
    """Two threads storing past the bound at once: each must evict one oldest entry, and neither may fail.
    Forced interleaving: the store's dict snapshots its keys when iterated, then waits until both threads
    have iterated (or 0.5 s). Without the store's lock (fast.launch.PlanCache) both pick the same oldest key and the
    second `del` raises KeyError; with it the second thread waits for the first and evicts the next oldest."""
    import threading
    barrier = threading.Barrier(2, timeout=0.5)

    class Interleaved(dict):
        def __iter__(self):
            keys = list(dict.keys(self))
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass
            return iter(keys)

    monkeypatch.setattr(fs._PLANS, "entries", Interleaved())
    monkeypatch.setattr(fs._PLANS, "size", 1)
    fs._PLANS.put(("old",), 0)
    errors = []

    def store(i):
        try:
            fs._PLANS.put(("new", i), i)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=store, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(fs._PLANS) == 1 and ("old",) not in fs._PLANS, (errors, dict(fs._PLANS.entries))


def test_plan_follows_the_config_functions_in_use(monkeypatch):
    """step_config / conv_config are looked up per call (benchmark sweeps and tests wrap them): a wrapped
    function after a cached call is used, not the stored plan of the original."""
    w = World()
    fast.gdn_decode(*w.decode_args())
    seen = []

    def spy(*a, **k):
        seen.append(a)
        return rs_step_config(*a, **k)
    rs_step_config = fs.step_config
    monkeypatch.setattr(fs, "step_config", functools.partial(spy))
    fast.gdn_decode(*w.decode_args())
    assert len(seen) == 1
    fast.gdn_decode(*w.decode_args())
    assert len(seen) == 1                 # cached again under the wrapper


def test_kernel_constants_compare_like_tl_constexpr():
    """fast.serving's kernel-visible constants (_Const) give Triton's per-launch used-globals check
    (``current != compiled_copy``) the answers tl.constexpr gives, as plain bools, with the same repr
    (the compile hash). A changed constant is still seen as changed."""
    names = [n for n, v in vars(fs).items() if isinstance(v, tl.constexpr)]
    assert len(names) >= 12 and all(type(getattr(fs, n)) is fs._Const for n in names)
    for n in names:
        c = getattr(fs, n)
        plain = tl.constexpr(c.value)
        assert repr(c) == repr(plain)
        assert (c != copy.deepcopy(c)) is False and (c != plain) is False and (plain != c) is False
        assert (c != tl.constexpr(c.value + 1)) is True and (c != fs._Const(c.value + 1)) is True
        assert bool(tl.constexpr(c.value + 1) != c) is True
