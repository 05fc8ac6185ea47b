"""Re-launching a Triton kernel with a fixed call layout, without JITFunction.run's per-call host work.

``kernel[grid](*args, **kw)`` costs 15-20 us of host time per launch on a server CPU (benchmarks/
host_overhead.py --sm90): JITFunction.run binds every argument, computes each one's specialisation
(dtype, 16-byte alignment of pointers, integers equal to 1 or divisible by 16), builds the cache key,
looks it up, re-checks every global the kernel reads, and only then calls the compiled kernel's C
launcher. A decode step's launch plan (fast.serving._StepPlan) already fixes everything in that key
except the pointers' alignment, so once a plan's first launch has gone through JITFunction.run,
:class:`Relaunch` calls the same compiled kernel's launcher directly, after checking per call only
what a plan does not fix:

* every tensor argument is 16-byte aligned or not as it was when its compiled kernel was picked (Triton
  specialises a pointer on that; the caching allocator gives 512-byte aligned blocks, so an unaligned one is a
  user view with an odd offset, e.g. a conv state's last W-1 of W columns); tensors reach the launcher as
  their addresses (ints), which spares its per-pointer data_ptr() call and driver query;
* each integer argument is in the class it had when its compiled kernel was picked (:func:`int_class`:
  Triton specialises an integer on its type, on being 1 and on 16 dividing it, not on its value; a
  constexpr parameter passed positionally must equal it). A Relaunch keeps one compiled kernel per
  integer classes and alignment pattern, so prefill calls whose lengths differ (T, N, the batch strides)
  reuse the launchers too;
* the current device is the first launch's (Triton's kernel cache is per device), and the stream is read
  from Triton's driver per call, exactly as JITFunction.run reads it;
* nothing is listening: no Triton launch hook (profilers), no wrapper installed over JITFunction.run
  (refgdn.capture's launch recorder, which CUDA-graph capture relies on to see every launch).

Any miss takes the ordinary ``kernel[grid](...)`` path (which also compiles a new variant if one is
needed), so the result is the same kernel on the same arguments either way. Not followed after the first
launch: Triton knobs that change compile options at run time (``knobs.runtime.debug``, instrumentation);
set them before the first call (clear fast.serving's plans to pick them up later). Never used when the
kernels run in the interpreter (``kernel[grid]`` returns no compiled kernel there). Floats are passed
through (Triton does not specialise on them). The launcher's calling convention (grid, stream, function,
packed metadata, launch metadata, enter / exit hooks, then every bound argument, constexprs included)
is Triton's since 3.3; tests/test_launch.py checks it on the installed Triton, and the GPU tests run the
ops both ways.
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
import threading
from typing import Any, Optional

import torch

from refgdn.capture import _Hooks        # refgdn's launch recorder: active while a graph captures

__all__ = ["ABSENT", "Carved", "LaunchPlan", "LayoutPlans", "MetaGuard", "Offset", "PlanCache", "Relaunch",
           "SignaturePlans", "launch", "scalar_key", "shape_key", "varlen_key"]

try:                                      # the launch path as it is when fast is imported (see _quiet)
    from triton import knobs as _knobs
    from triton.runtime import driver as _triton_driver
    from triton.runtime.jit import JITFunction as _JIT
    _JIT_RUN = _JIT.run
except Exception:  # noqa: BLE001 - no triton (or one without knobs: Triton < 3.4): Relaunch never reuses
    _JIT_RUN = None


def _driver():
    """Triton's active driver (current device and stream, as JITFunction.run reads them)."""
    return _triton_driver.active


def _silent(hook) -> bool:
    """A launch hook slot with nothing in it: None (Triton <= 3.8) or an empty HookChain (3.9)."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


def _quiet(fn) -> bool:
    """No launch hook and no wrapper over the launch path: a direct launch skips nothing anyone observes."""
    rt = _knobs.runtime
    if not (_silent(rt.launch_enter_hook) and _silent(rt.launch_exit_hook)):
        return False
    if type(fn).run is not _JIT_RUN:      # refgdn.capture's recorder (or another tool) wraps the launch path
        return False
    return not _Hooks.active


# Compile options every fast launch passes (every kernel launch in fast goes through :func:`launch` or
# :class:`Relaunch`, which add them): floating-point fusion (FMA contraction) on, Triton's default through
# 3.9, which the kernels' numerics and the conformance figures were measured with. Triton 3.9 warns on every process
# that compiles a kernel with the option unset ("TRITON_DEFAULT_FP_FUSION is unset ... will change to DISABLED in
# Triton 3.10"); set, nothing warns and a later default changes nothing here. The same compiled kernels as an unset
# option on Triton <= 3.9 (the option's value is what Triton keys its cache on); the interpreter ignores it.
# refgdn.capture's compile keys leave the pinned value out (_OPTION_DEFAULTS), so fast.keys need not list it.
PINNED_OPTIONS = {"enable_fp_fusion": True}


class Relaunch:
    """``fn[grid](*args, **kw)`` with fixed grid and keyword arguments, the compiled launcher reused.

    Call it with the kernel's positional arguments (``launch(*args)``; a :class:`Carved` region may stand
    where the kernel takes a tensor, the same one in every call of the layout, and an :class:`Offset` a tensor's
    address plus a fixed offset). The first call, and any call
    whose arguments the checks of the module docstring do not clear, goes through ``fn[grid]``; the
    others call the compiled kernel's launcher with the same arguments, each tensor replaced by its
    address (``data_ptr()``), the constexpr keyword values appended in parameter order. One Relaunch
    serves one call layout (the caller's plan): same kernel, grid, keyword arguments and tensor dtypes
    and devices; what may vary per call is checked.

    The caller guarantees that every tensor argument lives on the device of the first launch (fast.serving's
    plans: the call's signature holds every tensor's device, and a plan serves one signature). Triton's own
    launcher would catch a host tensor (its cuPointerGetAttribute query, a driver call per pointer);
    an address passed as an int is used as it is.
    """

    __slots__ = ("fn", "grid", "kw", "reuse", "compiled", "device", "tail", "tensors", "ints", "consts", "last",
                 "variants")

    def __init__(self, fn, grid, kw: dict, reuse: bool = True):
        """reuse=False: every call goes through ``fn[grid]`` (a launch layout used once: the ~10 us of
        bookkeeping for a reuse would be wasted)."""
        self.fn, self.kw, self.reuse = fn, {**PINNED_OPTIONS, **kw}, reuse
        self.grid = _grid3(grid)
        self.compiled = None      # truthy once a launch was remembered (the layout below is known)
        self.variants = {}        # (int_key, alignment) -> (launcher, head): one per compiled kernel
        self.last = None          # (integer values, launcher, head, alignment) of the last reuse: read at once

    def __call__(self, *args) -> None:
        self.run(self.grid, args)

    def run(self, grid: tuple, args: tuple) -> None:
        """One launch on ``grid`` (three ints; :meth:`__call__` passes the one given at construction). The grid
        is not part of what Triton compiles for, so one compiled kernel serves every grid: a LaunchPlan whose
        grids follow a call's values (varlen chunk counts) passes each call's own."""
        c = self.compiled
        if c is not None and _quiet(self.fn):
            drv = _driver()
            dev = drv.get_current_device()
            # every tensor as its address: the launcher takes an int as the pointer itself, where a tensor
            # costs a data_ptr() call and a cuPointerGetAttribute driver query each (the caller's signature
            # has already pinned every tensor to this device: see the class docstring)
            flat = list(args)
            ptr_bits = 0
            for i in self.tensors:
                ptr = flat[i].data_ptr()
                ptr_bits |= ptr
                flat[i] = ptr
            if dev == self.device:
                vals = self.ints(args)
                # Triton specialises a pointer on 16 | address: all aligned (the usual case) is True, else the
                # pattern per tensor argument
                align = True if not ptr_bits & 15 else tuple(not flat[i] & 15 for i in self.tensors)
                last = self.last
                if vals != last[0] or align != last[3]:   # another compiled kernel (int_key, alignment), if kept
                    v = self.variants.get((self.int_key(vals), align))
                    last = None if v is None else (vals, *v, align)
                if last is not None:
                    self.last = last
                    # head: the compiled kernel's function handle and packed metadata, then no launch metadata
                    # and no hooks (_quiet found the hook slots empty: an empty HookChain would only be called,
                    # from C, to do nothing)
                    last[1](*grid, drv.get_current_stream(dev), *last[2], *flat, *self.tail)
                    return
        args = tuple(a.tensor() if type(a) in _STAND_INS else a for a in args)
        out = self.fn[grid](*args, **self.kw)
        if self.reuse:
            self._remember(out, args)

    def _remember(self, compiled: Any, args: tuple) -> None:
        """After an ordinary launch (``args``: Carved ones made tensors): keep its compiled kernel, as the variant
        of its integer arguments' classes, if every later check can be made. Another call layout (which
        arguments are tensors or integers, the device) forgets the variants kept for the previous one."""
        if (compiled is None or _JIT_RUN is None
                or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))):
            self.compiled = None
            return                                     # the interpreter, or an unknown Triton
        try:
            tail = _constexpr_tail(self.fn, len(args), tuple(self.kw.items()))
        except TypeError:                              # an unhashable keyword value
            tail = None
        if tail is None:
            return
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        ints = tuple(i for i, a in enumerate(args) if type(a) is int or type(a) is bool)
        device = _driver().get_current_device()
        if not (self.compiled and (self.tensors, self.device, self.tail) == (tensors, device, tail)
                and self.consts[0] == ints):
            self.variants = {}
            self.tensors, self.device, self.tail = tensors, device, tail
            self.ints = _getter(list(ints))
            self.consts = (ints, _constexpr_positions(self.fn, ints))
        vals = self.ints(args)
        ptrs = [args[i].data_ptr() for i in tensors]
        align = True if all(not p & 15 for p in ptrs) else tuple(not p & 15 for p in ptrs)
        v = (compiled.run,                             # the C launcher (loaded by the launch just made)
             (compiled.function, compiled.packed_metadata, None, None, None))
        self.variants[(self.int_key(vals), align)] = v
        self.last = (vals, *v, align)
        self.compiled = compiled

    def int_key(self, vals: tuple) -> tuple:
        """The integer arguments' values as the compiled kernel depends on them: a positional constexpr's value,
        every other integer's :func:`int_class`."""
        const = self.consts[1]
        return tuple(x if c else int_class(x) for x, c in zip(vals, const))


def int_class(x: int) -> tuple:
    """What a compiled Triton kernel assumes of an integer argument that is not a constexpr: its type (bool is
    u1), whether it is 1 (made a constant), whether 16 divides it (the "D" hint), whether it fits int32 and
    int64 (else u64). Two integers of one class run on the same compiled kernel. As fine as Triton's own key
    or finer (tests/test_launch.py compares the two on the installed Triton): a finer class only costs a
    launch through JITFunction.run."""
    return (type(x), x == 1, x % 16 == 0, -0x80000000 <= x <= 0x7FFFFFFF,
            -0x8000000000000000 <= x <= 0x7FFFFFFFFFFFFFFF)


def _constexpr_positions(fn, ints: tuple) -> tuple:
    """For each positional integer argument (indices ``ints``), whether the kernel's parameter there is a constexpr
    (compared by value); all True when the parameters cannot be read (every integer then compared by value)."""
    jit = fn
    while jit is not None and not hasattr(jit, "params"):
        jit = getattr(jit, "fn", None)
    params = getattr(jit, "params", None)
    try:
        return tuple(bool(params[i].is_constexpr) for i in ints)
    except (TypeError, IndexError, AttributeError):
        return (True,) * len(ints)


def _grid3(grid) -> tuple:
    """A launch grid as three ints (missing dimensions 1)."""
    g = tuple(grid) + (1, 1)
    return int(g[0]), int(g[1]), int(g[2])


def _getter(idx: list):
    """args -> tuple of args[i] for i in idx (a tuple for any length)."""
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*idx)


@functools.lru_cache(maxsize=1024)
def _constexpr_tail(fn, npos: int, kw_items: tuple) -> Optional[tuple]:
    """The values of the parameters after the first npos, from the keyword arguments or their defaults,
    in order (what JITFunction.run's binder appends to the positional arguments); None if one has
    neither. Cached: gdn_materialize builds a plan per call."""
    kw = dict(kw_items)
    py = fn
    while not inspect.isfunction(py):
        py = getattr(py, "fn", None)
        if py is None:
            return None
    out = []
    for p in list(inspect.signature(py).parameters.values())[npos:]:
        if p.name in kw:
            out.append(kw[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            return None
    return tuple(out)


class Carved:
    """A typed, contiguous region of a scratch allocation, passed to :class:`Relaunch` where a kernel takes a
    tensor: several per-call scratch tensors from one ``torch.empty`` (each allocation costs ~3-7 us of host
    time on a GPU server), without building a view per call. The compiled launcher needs only the address;
    a tensor view is made only for a launch through JITFunction.run (it specialises on dtype and alignment).

    base: a 1-D torch.uint8 tensor; offset: bytes from its start (a multiple of 16); dtype, shape: the region's.
    """
    __slots__ = ("base", "offset", "dtype", "shape")

    def __init__(self, base: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple):
        self.base, self.offset, self.dtype, self.shape = base, offset, dtype, shape

    def data_ptr(self) -> int:
        return self.base.data_ptr() + self.offset

    def tensor(self) -> torch.Tensor:
        """The region as a tensor (a view of base)."""
        n = math.prod(self.shape) * self.dtype.itemsize
        return self.base[self.offset:self.offset + n].view(self.dtype).view(self.shape)

    @staticmethod
    def nbytes(dtype: torch.dtype, shape: tuple) -> int:
        """Bytes of a region, rounded up to 16 (so the next one starts aligned)."""
        return -(-math.prod(shape) * dtype.itemsize // 16) * 16


class Offset:
    """A tensor argument given as another tensor's address plus a fixed byte offset, for :class:`Relaunch`: where a
    kernel takes a view of an argument (q, k and v as column ranges of packed rows) and indexes it through strides
    passed separately, a plan passes ``Offset(base, nbytes)`` instead of building the view on every call (each torch
    view costs ~1-2 us of host time). Only the address is read on a reuse; a launch through JITFunction.run gets a
    one-element tensor of base's dtype at that address (what Triton specialises on: dtype and alignment).

    base: the tensor; offset: bytes from its data_ptr(), a multiple of its element size."""
    __slots__ = ("base", "offset")

    def __init__(self, base: torch.Tensor, offset: int):
        self.base, self.offset = base, offset

    def data_ptr(self) -> int:
        return self.base.data_ptr() + self.offset

    def tensor(self) -> torch.Tensor:
        """A one-element tensor of base's dtype at the address (a view of base's storage)."""
        b = self.base
        return b.as_strided((1,), (1,), b.storage_offset() + self.offset // b.element_size())


_STAND_INS = (Carved, Offset)     # what Relaunch turns into tensors before a launch through JITFunction.run


class LaunchPlan:
    """The launches of one call layout of an op, in launch order, each a :class:`Relaunch`: the eager prefill's
    three or four kernels (fast.chunk.chunk_gated_delta_rule keeps one per call signature).

    Used as a context manager around the op's launchers, which launch through :func:`launch`: the i-th launch
    of the block takes a Relaunch the plan made at position i for the same kernel and keyword arguments
    (compared per call, so a plan can never launch a kernel other than the one asked for), else a new one
    (at most PLAN_VARIANTS per position: calls of one signature may take other paths, e.g. a prefill's
    configs follow its sequence count). The grid is the launch's own (Relaunch.run): it is not part of what
    Triton compiles for, and a varlen call's grids follow its chunk counts. What the comparison does not
    cover -- the tensors' dtypes, which pick the compiled variant, and their devices -- the caller's
    signature pins: one plan serves calls whose inputs have the same dtypes and devices (the intermediates'
    follow from the inputs'). Integer arguments and pointer alignment are checked by Relaunch itself on
    every launch.

    The position in the plan lives in thread-local state, not in the plan: two threads may run one plan.
    Blocks nest (the inner block's launches use the inner plan).
    """
    __slots__ = ("slots",)

    def __init__(self):
        self.slots: list = []      # per launch position, [(fn, kw, Relaunch)], newest first (grids are per launch)

    def __enter__(self) -> "LaunchPlan":
        prev = getattr(_ACTIVE, "state", None)
        _ACTIVE.state = [self, 0, prev]
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.state = _ACTIVE.state[2]


_ACTIVE = threading.local()      # .state: [plan, position, enclosing state] inside a LaunchPlan block


def launch(fn, grid, kw: dict, *args) -> Any:
    """``fn[grid](*args, **kw)``; inside a :class:`LaunchPlan` block, through the plan's Relaunch for this
    launch's position (the compiled launcher reused: ~5-30 us less host time per launch than JITFunction.run,
    by the host). Returns what ``fn[grid]`` returns outside a plan, None inside one."""
    st = getattr(_ACTIVE, "state", None)
    if st is None:
        return fn[grid](*args, **{**PINNED_OPTIONS, **kw})
    plan, i = st[0], st[1]
    st[1] = i + 1
    slots = plan.slots
    while len(slots) <= i:
        slots.append([])
    here = slots[i]
    for f, k, r in here:
        if f is fn and k == kw:
            break
    else:
        r = Relaunch(fn, grid, kw)
        here.insert(0, (fn, dict(kw), r))
        del here[PLAN_VARIANTS:]
    r.run(_grid3(grid), args)
    return None


# Relaunches a LaunchPlan keeps per launch position (kernel + keyword arguments). The chunk op's serving stream (1-8
# sequences, Qwen3-Next shape) uses 4 at its third position: the state pass at BV 32 / 64, with and without beta
# one chunk ahead, and kernel 4 for the one-sequence calls; 8 leaves room for other shapes (a lookup compares the
# keyword dicts of the kept ones, ~0.2 us each).
PLAN_VARIANTS = 8


try:                                      # torch's C++ tensor-metadata check (what torch.compile's guards use)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # noqa: BLE001 - a torch without it: MetaGuard never matches (callers check in full)
    _TensorGuards = None


class _Absent(torch.Tensor):
    """The type of :data:`ABSENT` (private: no caller's tensor can have it)."""


ABSENT = torch.Tensor._make_subclass(_Absent, torch.empty(0))   # stands for None in a MetaGuard's tensors


class MetaGuard:
    """Whether tensors have, one for one, the metadata of those the guard was made from: one C++ call.

    ``MetaGuard(tensors).check(*others)`` is True only if every ``others[i]`` has ``tensors[i]``'s exact Python
    type, dtype, device, sizes, strides, requires_grad and dispatch keys (torch's ``TensorGuards``, read
    live on every call, so a tensor changed in place -- ``resize_``, ``as_strided_``, ``.data = ...`` -- is
    seen). That is everything :func:`refgdn.serving.tensor_signature` holds, and more (requires_grad,
    dispatch keys): equal checks imply equal signatures, so a call that passes may reuse what a call with
    the recorded metadata was checked for. Pass :data:`ABSENT` where an optional tensor is None (its type
    is private, so no argument matches it but ABSENT itself); any non-tensor fails the check.

    One object at several positions (ABSENT for two optional tensors, or a caller's x passed as both x and g):
    TensorGuards' check is False whenever its arguments repeat a tensor, so such a guard would never match and
    every call would take the caller's full path (fast.serving's decode without conv_bias and cu_seqlens did). The
    guard is then made over the distinct tensors, and a check also requires the same positions to hold one object.

    Cost: ~1.4 us for 17 tensors, against ~6-11 us for the same tensors' signature tuple built in Python
    (benchmarks/host_overhead.py); ~1 us more with repeated tensors. Without TensorGuards (or if it rejects the
    tensors) check is always False: the caller's full path runs.
    """
    __slots__ = ("check",)

    def __init__(self, tensors: tuple):
        self.check = _never
        if _TensorGuards is None:
            return
        first = {}                             # id -> first position
        keep, same = [], []                    # positions of distinct objects; (position, earlier position) pairs
        for i, t in enumerate(tensors):
            j = first.setdefault(id(t), i)
            (keep if j == i else same).append(i if j == i else (i, j))
        try:   # (both keywords are required: TensorGuards reads them unguarded)
            check = _TensorGuards(*(tensors[i] for i in keep), dynamic_dims_sizes=None,
                                  dynamic_dims_strides=None).check
        except Exception:  # noqa: BLE001 - not tensors, or another TensorGuards: never match
            return
        if not same:
            self.check = check
            return
        n, pick = len(tensors), _getter(keep)

        def check_repeated(*ts) -> bool:
            return len(ts) == n and all(ts[i] is ts[j] for i, j in same) and check(*pick(ts))
        self.check = check_repeated


def _never(*tensors) -> bool:
    return False


class PlanCache:
    """What an op keeps per call signature (a LaunchPlan, a checked verdict), at most ``size`` entries: first
    in, first out (a hit costs one hash and one compare of the key; an LRU's reordering would hash it again),
    so a working set larger than the bound only costs full work on the calls that miss. Hits read without
    the lock; inserts and evictions take it (two threads missing at once would evict the same key)."""
    __slots__ = ("size", "entries", "lock")

    def __init__(self, size: int = 64):
        self.size, self.entries, self.lock = size, {}, threading.Lock()

    def get(self, key):
        """The value stored under key, or None (also for None and for an unhashable key)."""
        if key is None:
            return None
        try:
            return self.entries.get(key)
        except TypeError:
            return None

    def put(self, key, value) -> None:
        """Store value under key (None or an unhashable key: nothing stored); the oldest entries go beyond size."""
        if key is None:
            return
        with self.lock:
            try:
                self.entries[key] = value
            except TypeError:
                return
            while len(self.entries) > self.size:
                del self.entries[next(iter(self.entries))]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key) -> bool:
        return self.get(key) is not None


class SignaturePlans(PlanCache):
    """The LaunchPlans of an eager op by call signature (fast.chunk, fast.conv): ``get(sig)``, the plan of a signature
    whose call passed the op's host checks before (the caller then skips them); ``after_checks(sig)``, the plan for
    a call that has just passed them: None on a signature's first call, which is only remembered (``seen``, at most
    ``seen_size``), and a new plan on its second. Keeping a plan costs ~15 us of Relaunch bookkeeping per launch on
    its first call, wasted on a signature that never comes back."""
    __slots__ = ("seen",)

    def __init__(self, size: int = 64, seen_size: int = 256):
        super().__init__(size)
        self.seen = PlanCache(seen_size)

    def after_checks(self, sig) -> Optional[LaunchPlan]:
        if sig is None or self.seen.get(sig) is None:
            self.seen.put(sig, True)
            return None
        plan = LaunchPlan()
        self.put(sig, plan)
        return plan

    def clear(self) -> None:
        super().clear()
        self.seen.clear()


class LayoutPlans:
    """An eager op's plans by call layout, for ops whose launch follows from their arguments' metadata alone (the
    norms, the gating): ``get(key, tensors)``, the plan kept for a layout whose call passed the op's host checks
    before, or None (the caller checks in full); ``remember(key, tensors, make)`` after such a call, which keeps
    ``make()`` from the layout's second call on (a plan's Relaunch bookkeeping is wasted on a layout seen once, as
    SignaturePlans says).

    key: hashable, the op's non-tensor arguments and whatever the caller wants to keep apart (None: never served);
    tensors: the tensors the checks and the plan read (None for an absent optional one), compared by one
    :class:`MetaGuard`. The plans are kept by key and the first tensor's sizes, so the batch sizes of a serving
    stream's eager steps (their token or request count is the first tensor's) each keep a plan instead of replacing
    one another; a layout's newest plan is kept (a guard that misses a known key and sizes is replaced). Never
    served while torch.compile traces (the op's own path runs and is traced)."""
    __slots__ = ("plans", "seen")

    def __init__(self, size: int = 64, seen_size: int = 256):
        self.plans, self.seen = PlanCache(size), PlanCache(seen_size)

    @staticmethod
    def _sized(key, tensors: tuple):
        t = tensors[0] if tensors else None
        return (key, tuple(t.shape) if isinstance(t, torch.Tensor) else None)

    def get(self, key, tensors: tuple):
        if key is None or torch.compiler.is_compiling():
            return None
        e = self.plans.get(self._sized(key, tensors))
        if e is None or not e[0].check(*(ABSENT if t is None else t for t in tensors)):
            return None
        return e[1]

    def remember(self, key, tensors: tuple, make) -> None:
        """make() -> the layout's plan, kept only where it launches something (``M``) on the tensors as they are
        (``direct``: no per-call copy); any other layout is checked in full on every call."""
        if key is None:
            return
        key = self._sized(key, tensors)
        ts = tuple(ABSENT if t is None else t for t in tensors)
        e = self.plans.get(key)
        if e is None and self.seen.get(key) is None:
            self.seen.put(key, True)
            return
        if e is not None and e[0].check(*ts):
            return
        plan = make()
        if plan.direct and plan.M:
            self.plans.put(key, (MetaGuard(ts), plan))

    def clear(self) -> None:
        self.plans.clear()
        self.seen.clear()


def shape_key(t, skip: Optional[int] = None) -> Optional[tuple]:
    """(type, shape, dtype, device) of a tensor, the shape less dim ``skip`` if given; None for None: what a call
    signature that leaves a length out (T, N) keeps of a tensor. Raises for a non-tensor or too few dims (a
    signature is then None: the op's full checks name the problem). (The shape as a list: slicing torch.Size costs
    twice as much host time.)"""
    if t is None:
        return None
    shape = list(t.shape)
    if skip is not None:
        del shape[skip]
    return type(t), tuple(shape), t.dtype, t.device


def scalar_key(*vals) -> Optional[tuple]:
    """A LayoutPlans key from an op's non-tensor arguments: each value with its exact type (the checks' rules are by
    type: a flag given as 1 is not the True a checked call passed); None when one is unhashable (never served)."""
    key = tuple((type(x), x) for x in vals)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def varlen_key(x, initial_state, cu_seqlens, cu_seqlens_cpu) -> tuple:
    """The part of a prefill's call signature (fast.chunk, fast.conv) that leaves out the token count T (x's dim 1)
    and the sequence count N (cu_seqlens' length - 1, else x's batch): initial_state's and the offsets' shape_key
    less their N dim, and what the checks test of them: T == 0, initial_state's dim 0 == N, at least two offsets,
    cu_seqlens_cpu's shape == cu_seqlens'. Raises where shape_key does."""
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return (shape_key(initial_state, 0), shape_key(cu_seqlens, 0), shape_key(cu_seqlens_cpu, 0), x.shape[1] == 0,
            initial_state is None or initial_state.shape[0] == N, cu_seqlens is None or N >= 1,
            cu_seqlens_cpu is None or cu_seqlens_cpu.shape == cu_seqlens.shape)
