"""The CUDA-graph lifecycle as an explicit state machine that raises the moment an invariant breaks.

DESIGN.md, "The CUDA-graph lifecycle": load -> profile -> reserve -> (per capture descriptor: warmup,
capture) -> serve. This module is that lifecycle, runnable on a CPU (so CI exercises it):

    lc = Lifecycle(device)                       # phase "load"
    lc.profile(run_every_variant)                # "profile": every kernel variant launched once,
                                                 #   autotune allowed, peak memory measured
    cache = lc.reserve(allocate_cache)           # "reserve": from here on nothing may compile or autotune
    lc.capture(desc, make_step)                  # per descriptor: make_step(desc, warmup=True) runs
                                                 #   eagerly, make_step(desc, warmup=False) is captured
    lc.replay(desc, inputs)                      # "serve": copy inputs into static buffers, replay
    lc.replay_draft(desc, step, metadata)        # one captured draft step, replayed per step index

A capture descriptor is (padded batch size, tokens per request, mode decode / verify / draft).
``make_step(desc, warmup)`` returns a :class:`StepSpec`: the step callable, the metadata object it
reads and its static input buffers (vLLM's ``create_forward_fn(desc, warmup)`` protocol, seed 004).

Every kernel launch is seen by a launch recorder (class-level hooks on Triton's ``JITFunction.run``,
the interpreter's ``InterpretedFunction.run`` and ``Autotuner.run``, plus :func:`traced_ops` for an ops
namespace such as ``refgdn`` whose calls are keyed by ``fast.keys``), which turns a launch into a
:class:`CompileKey` (kernel, constexprs, tensor dtypes, launch options). The errors, each named after
the invariant it guards (DESIGN.md, seeds/):

    CompileDuringCapture   a key first seen inside a capture, or one its descriptor's warmup did not
                           launch (invariant 1; seeds 000, 001)
    AutotuneAfterReserve   an autotuner asked to tune, or a key first compiled, after the cache was
                           reserved (invariant 2; seed 003); CompileAfterReserve is its subclass
    SharedWarmupMetadata   warmup and capture given the same mutable metadata object, or a capture
                           object whose lazy-init state warmup already flipped (invariant 3; seed 004)
    StaleDraftMetadata     a draft step replayed with metadata not rebuilt for its step (invariant 4;
                           seed 002)
    HostSyncInCapture      .item() / .cpu() / .tolist(), a data-dependent shape, an allocation outside
                           the graph pool, a static buffer whose address changed (invariant 5);
                           AllocationOutsidePool and StaticBufferMoved are its subclasses

On a CPU the graph is a :class:`SimulatedGraph`: capture records the step's launches (aten ops,
Triton launches, traced op calls) on the tensors they used; replay re-runs them on those same
tensors and copies fresh results into the recorded outputs, so the addresses are fixed exactly as a
CUDA graph's are. ``fast.graphs`` runs the same machine with ``torch.cuda.CUDAGraph``.

The warmup planner: ``plan(model, ServingConfig(...))`` lists every compile key that profiling,
warmup, capture and serving of a refgdn.model will launch (from fast.keys' pure functions: capture
batch sizes, max draft steps k, prefill length classes, dtypes, the model
config); tests/test_capture.py checks it against the keys an eager run of the model launches, and
tests/test_graphs_cuda.py against the keys Triton actually compiles on a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import threading
import types
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "LifecycleError", "CompileDuringCapture", "AutotuneAfterReserve", "CompileAfterReserve",
    "SharedWarmupMetadata", "StaleDraftMetadata", "HostSyncInCapture", "AllocationOutsidePool",
    "StaticBufferMoved", "PhaseError", "CompileKey", "CaptureDescriptor", "StepSpec", "Lifecycle",
    "SimulatedGraph", "LaunchRecorder", "KeyLog", "traced_ops", "key_of_launch", "recording", "ServingConfig",
    "Plan", "plan", "prefill_classes", "metadata_tensors",
]


# ==============================================================================================
# named errors
# ==============================================================================================

class LifecycleError(RuntimeError):
    """Base of every lifecycle error."""


class PhaseError(LifecycleError):
    """A lifecycle method called out of order (e.g. capture before reserve)."""


class CompileDuringCapture(LifecycleError):
    """Invariant 1: a kernel variant would be compiled (module loaded) inside a stream capture."""


class AutotuneAfterReserve(LifecycleError):
    """Invariant 2: autotuning (or a first compile) after the cache took the memory."""


class CompileAfterReserve(AutotuneAfterReserve):
    """Invariant 2: a kernel variant first compiled after the cache was reserved (its module takes memory)."""


class SharedWarmupMetadata(LifecycleError):
    """Invariant 3: warmup and capture share mutable metadata (a lazy-init flag flipped by warmup)."""


class StaleDraftMetadata(LifecycleError):
    """Invariant 4: a draft step replayed with metadata not rebuilt for its step index."""


class HostSyncInCapture(LifecycleError):
    """Invariant 5: the captured step talks to the host (or its buffers moved)."""


class AllocationOutsidePool(HostSyncInCapture):
    """Invariant 5: memory that is not the graph pool's (host data, another device, pinned memory)."""


class StaticBufferMoved(HostSyncInCapture):
    """Invariant 5: a static buffer's address changed between capture and replay."""


# ==============================================================================================
# compile keys
# ==============================================================================================

def _norm(v):
    """A constexpr / option value as a hashable, comparable plain value."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, (tuple, list)):
        return tuple(_norm(x) for x in v)
    inner = getattr(v, "value", None)          # tl.constexpr wrapper
    if inner is not None and type(v).__name__ == "constexpr":
        return _norm(inner)
    return repr(v)


@dataclasses.dataclass(frozen=True, order=True)
class CompileKey:
    """One compiled kernel variant: what Triton specialises a compile on, minus integer-value
    specialisation (see fast.keys): kernel name, constexpr values, the dtype of every tensor argument
    (``None`` for an argument passed as None), and launch options (num_warps, num_stages, ...).

    kernel: str; constexprs, dtypes, options: sorted tuples of (name, value).
    """

    kernel: str
    constexprs: Tuple[Tuple[str, Any], ...] = ()
    dtypes: Tuple[Tuple[str, Any], ...] = ()
    options: Tuple[Tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, kernel: str, constexprs: dict, dtypes: dict, options: dict) -> "CompileKey":
        return cls(kernel, tuple(sorted((k, _norm(v)) for k, v in constexprs.items())),
                   tuple(sorted((k, _norm(v)) for k, v in dtypes.items())),
                   tuple(sorted((k, _norm(v)) for k, v in options.items() if v is not None)))

    def __str__(self) -> str:
        c = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        o = ", ".join(f"{k}={v}" for k, v in self.options)
        d = ", ".join(f"{k}:{str(v).replace('torch.', '')}" for k, v in self.dtypes)
        return f"{self.kernel}[{c}; {o}]({d})"


# Launch options of a Triton call (everything in kwargs that is not a kernel parameter).
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
                   "launch_cooperative_grid")
# Options passed at Triton's own default (through 3.9) compile the same kernel as the option unset: a key leaves them
# out (fast passes enable_fp_fusion=True on every launch: fast.launch.PINNED_OPTIONS; fast.keys lists no such option)
_OPTION_DEFAULTS = {"enable_fp_fusion": True}
_NONE = object()


def _is_constexpr_annotation(ann) -> bool:
    if isinstance(ann, str):
        return "constexpr" in ann
    return getattr(ann, "__name__", "") == "constexpr" or ann is getattr(_tl(), "constexpr", object())


@functools.lru_cache(maxsize=1)
def _tl():
    import triton.language as tl
    return tl


@functools.lru_cache(maxsize=None)
def _kernel_params(pyfn) -> Tuple[Tuple[str, bool, Any], ...]:
    """(name, is_constexpr, default) per parameter of a @triton.jit function's Python body."""
    import inspect
    out = []
    for p in inspect.signature(pyfn).parameters.values():
        default = p.default if p.default is not inspect.Parameter.empty else inspect.Parameter.empty
        out.append((p.name, _is_constexpr_annotation(p.annotation), default))
    return tuple(out)


def _pyfn(kernel) -> Callable:
    fn = kernel
    while not isinstance(fn, types.FunctionType):     # JITFunction / InterpretedFunction / Autotuner
        fn = fn.fn
    return fn


def key_of_launch(kernel, args: Sequence, kwargs: dict) -> CompileKey:
    """The CompileKey of ``kernel[grid](*args, **kwargs)``: constexpr values, tensor dtypes, options."""
    import inspect
    pyfn = _pyfn(kernel)
    params = _kernel_params(pyfn)
    bound: Dict[str, Any] = {}
    for (name, _, _), a in zip(params, args):
        bound[name] = a
    for name, is_c, default in params:
        if name in kwargs:
            bound[name] = kwargs[name]
        elif name not in bound and default is not inspect.Parameter.empty:
            bound[name] = default
    constexprs, dtypes = {}, {}
    for name, is_c, _ in params:
        v = bound.get(name)
        if is_c:
            constexprs[name] = v
        elif isinstance(v, torch.Tensor):
            dtypes[name] = v.dtype
        elif v is None:
            dtypes[name] = None
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs and _OPTION_DEFAULTS.get(k, _NONE) != kwargs[k]}
    return CompileKey.make(pyfn.__name__, constexprs, dtypes, options)


# ==============================================================================================
# the launch recorder: class-level hooks on Triton's launch paths
# ==============================================================================================

class LaunchRecorder:
    """Listener protocol for kernel launches (subclass and override what you need).

    on_launch(key, event) runs *before* the launch (raise to prevent it); ``event`` is a callable that
    re-issues the launch (used by the simulated graph). on_compiled(key) runs after a launch that made
    Triton compile (GPU: Triton's jit_post_compile_hook). on_autotune(name, tune_key, cached) runs
    before an Autotuner with several configs picks one (cached: the key was tuned before).
    """

    def on_launch(self, key: CompileKey, event: Callable[[], Any]) -> None:
        pass

    def on_compiled(self, key: CompileKey) -> None:
        pass

    def on_autotune(self, name: str, tune_key: tuple, cached: bool) -> None:
        pass

    def note_output(self, out) -> None:
        """The result of the launch event last reported (a traced op's outputs)."""


class _Hooks:
    """Installs the class-level wrappers while at least one recorder is active (thread-local stack)."""

    lock = threading.RLock()
    active: List[LaunchRecorder] = []
    compiles = 0                       # bumped by Triton's jit_post_compile_hook
    prev_hook = None
    local = threading.local()

    @classmethod
    def opaque(cls) -> int:
        """> 0 inside a launch event: torch-level guards and the graph's aten recording stand aside."""
        return getattr(cls.local, "opaque", 0)

    @classmethod
    def mute(cls) -> int:
        """> 0 inside a launch event: nested Triton launches are not reported again."""
        return getattr(cls.local, "mute", 0)

    @classmethod
    @contextlib.contextmanager
    def inside(cls, opaque: int = 1, mute: int = 1):
        cls.local.opaque = cls.opaque() + opaque
        cls.local.mute = cls.mute() + mute
        try:
            yield
        finally:
            cls.local.opaque -= opaque
            cls.local.mute -= mute

    built: Optional[List[Tuple[Any, Callable, Callable]]] = None     # (class, original run, wrapper)
    knobs = None

    @classmethod
    def _build(cls):
        """The wrappers, made once: class-level replacements of JITFunction.run, InterpretedFunction.run
        and Autotuner.run (each falls through to the original when no recorder is active)."""
        cls.built = []
        klasses = []
        try:
            from triton.runtime.jit import JITFunction
            klasses.append(JITFunction)
        except Exception:  # noqa: BLE001 - no triton: only traced ops are recorded
            pass
        try:
            from triton.runtime.interpreter import InterpretedFunction
            klasses.append(InterpretedFunction)
        except Exception:  # noqa: BLE001
            pass
        for klass in klasses:
            orig = klass.run

            def run(self, *args, grid, warmup, _orig=orig, **kwargs):
                if warmup or cls.mute() > 0 or not cls.active:
                    return _orig(self, *args, grid=grid, warmup=warmup, **kwargs)
                key = key_of_launch(self, args, kwargs)

                def event(_self=self, _args=args, _kwargs=kwargs, _grid=grid):
                    with cls.inside():
                        return _orig(_self, *_args, grid=_grid, warmup=False, **_kwargs)

                recs = list(cls.active)
                for rec in recs:
                    rec.on_launch(key, event)
                before = cls.compiles
                size = _cache_len(self)       # either signal counts: the hook, or the JIT cache growing
                out = event()
                if cls.compiles != before or (size is not None and _cache_len(self) != size):
                    for rec in recs:
                        rec.on_compiled(key)
                for rec in recs:
                    rec.note_output(None)
                return out

            cls.built.append((klass, orig, run))
        try:
            from triton.runtime.autotuner import Autotuner
            orig_a = Autotuner.run

            def arun(self, *args, _orig=orig_a, **kwargs):
                if cls.active and cls.mute() == 0 and len(self.configs) > 1:
                    all_args = {**dict(zip(self.arg_names, args)), **kwargs}
                    named = {k: v for k, v in all_args.items() if k in self.arg_names}
                    tk = [named[k] for k in self.keys if k in named]
                    tk += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
                    tk = tuple(tk)
                    for rec in list(cls.active):
                        rec.on_autotune(_pyfn(self).__name__, tk, tk in self.cache)
                return _orig(self, *args, **kwargs)

            cls.built.append((Autotuner, orig_a, arun))
        except Exception:  # noqa: BLE001
            pass
        try:   # Triton's own compile hook (3.4+): counts real compilations on a GPU
            from triton import knobs
            knobs.runtime.jit_post_compile_hook  # noqa: B018 - present?
            cls.knobs = knobs
        except Exception:  # noqa: BLE001
            cls.knobs = None

    @classmethod
    def install(cls):
        if cls.built is None:
            cls._build()
        for klass, _, wrap in cls.built:
            klass.run = wrap
        if cls.knobs is not None and cls.knobs.runtime.jit_post_compile_hook is not cls._post_compile:
            cls.prev_hook = cls.knobs.runtime.jit_post_compile_hook or False
            cls.knobs.runtime.jit_post_compile_hook = cls._post_compile

    @staticmethod
    def _post_compile(*args, **kwargs):
        _Hooks.compiles += 1
        prev = _Hooks.prev_hook
        return prev(*args, **kwargs) if prev else None

    @classmethod
    def uninstall(cls):
        for klass, orig, _ in cls.built or ():
            klass.run = orig
        if cls.knobs is not None and cls.knobs.runtime.jit_post_compile_hook is cls._post_compile:
            cls.knobs.runtime.jit_post_compile_hook = cls.prev_hook or None
        cls.prev_hook = None


def _cache_len(kernel) -> Optional[int]:
    """Compiled variants in a JITFunction's in-memory cache (the compile counter when Triton has no
    jit_post_compile_hook); None for the interpreter."""
    try:
        return sum(len(v[0]) for v in kernel.device_caches.values())
    except Exception:  # noqa: BLE001
        return None


@contextlib.contextmanager
def recording(recorder: LaunchRecorder):
    """Route every Triton launch (and traced op call) to ``recorder`` while the block runs."""
    with _Hooks.lock:
        _Hooks.active.append(recorder)
        _Hooks.install()
    try:
        yield recorder
    finally:
        with _Hooks.lock:
            _Hooks.active.remove(recorder)
            if not _Hooks.active:
                _Hooks.uninstall()


class KeyLog(LaunchRecorder):
    """Collects the keys launched (in order, with repeats) and the keys Triton compiled."""

    def __init__(self):
        self.launched: List[CompileKey] = []
        self.compiled: List[CompileKey] = []
        self.autotuned: List[Tuple[str, tuple]] = []

    def on_launch(self, key, event):
        self.launched.append(key)

    def on_compiled(self, key):
        self.compiled.append(key)

    def on_autotune(self, name, tune_key, cached):
        if not cached:
            self.autotuned.append((name, tune_key))

    @property
    def keys(self) -> set:
        return set(self.launched)


# ----------------------------------------------------------------------------------------------
# traced ops: an ops namespace whose calls are launch events keyed by fast.keys
# ----------------------------------------------------------------------------------------------

def traced_ops(ops, keys=None, names: Optional[Iterable[str]] = None):
    """A namespace with ``ops``' functions wrapped so that each call is one launch event.

    ops: a module such as ``refgdn`` or ``fast``; keys: a namespace of key functions with the same
    names and signatures (default ``fast.keys``). Each call reports the keys ``keys.<name>(...)``
    predicts (the variants fast would compile for these arguments) to the active recorders, then runs
    the op with the recorders' per-kernel hooks suspended (the call is opaque, like a kernel: host
    reads inside a refgdn op are its own business). With ``ops = fast`` (or fast.vllm_ops) the Triton launches inside are
    still checked against the prediction (a mismatch raises AssertionError: fast.keys is stale).
    Non-callable attributes (GDNStateCache, ...) pass through unchanged.
    """
    if keys is None:
        import fast.keys as keys
    ns = types.SimpleNamespace()
    names = list(names) if names is not None else [n for n in dir(ops) if not n.startswith("_")]
    for name in names:
        fn = getattr(ops, name)
        kfn = getattr(keys, name, None)
        if callable(fn) and kfn is not None and not isinstance(fn, type):
            setattr(ns, name, _traced(fn, kfn, name, ops))
        else:
            setattr(ns, name, fn)
    ns.__wrapped_ops__ = ops
    ns.__name__ = getattr(ops, "__name__", "ops")
    return ns


def _traced(fn, kfn, name, ops):
    check_real = getattr(ops, "__name__", "").split(".")[0] == "fast"     # fast, fast.vllm_ops

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _Hooks.active or _Hooks.mute() > 0:
            return fn(*args, **kwargs)
        predicted = list(kfn(*args, **kwargs))

        def event():
            with _Hooks.inside():
                return fn(*args, **kwargs)

        recs = list(_Hooks.active)
        for rec in recs:
            for i, k in enumerate(predicted or [None]):
                rec.on_launch(k, event if i == 0 else None)
        if not check_real:
            out = event()
        else:
            # fast: its real Triton launches go to `log` only, and must be the predicted ones
            log = KeyLog()
            saved = list(_Hooks.active)
            _Hooks.active[:] = [log]
            try:
                with _Hooks.inside(opaque=1, mute=0):
                    out = fn(*args, **kwargs)
            finally:
                _Hooks.active[:] = saved
            if log.launched != predicted:
                raise AssertionError(f"fast.keys.{name} predicted {[str(k) for k in predicted]} but fast launched "
                                     f"{[str(k) for k in log.launched]}: fast.keys is out of date with the launcher")
        for rec in recs:
            rec.note_output(out)
        return out

    call.__traced__ = True
    return call


# ==============================================================================================
# guards active while a step is captured
# ==============================================================================================

_HOST_READ_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_HOST_DATA_FUNCS = {"tensor", "as_tensor", "asarray", "from_numpy", "new_tensor", "pin_memory"}
_FACTORIES = {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "empty_like",
              "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
              "empty_strided", "linspace"}


class _HostGuard(TorchFunctionMode):
    """Raises HostSyncInCapture / AllocationOutsidePool for host reads and host-data tensors."""

    def __init__(self, where: str, device: torch.device):
        super().__init__()
        self.where = where
        self.device = device

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _Hooks.opaque() == 0:
            name = getattr(func, "__name__", "")
            if name in _HOST_READ_METHODS:
                raise HostSyncInCapture(f"{self.where}: Tensor.{name}() inside capture reads device memory from "
                                        f"the host (a sync; forbidden in a CUDA graph, invariant 5)")
            if name in _HOST_DATA_FUNCS:
                raise AllocationOutsidePool(
                    f"{self.where}: torch.{name}(...) inside capture makes a tensor from host memory, outside "
                    f"the graph pool (replay would copy a host buffer that no longer exists; invariant 5)")
            if name == "to" and _to_other_device(args, kwargs, self.device):
                raise HostSyncInCapture(f"{self.where}: Tensor.to(another device) inside capture (invariant 5)")
            if kwargs.get("pin_memory"):
                raise AllocationOutsidePool(f"{self.where}: torch.{name}(pin_memory=True) inside capture "
                                            f"allocates pinned host memory outside the graph pool (invariant 5)")
            dev = kwargs.get("device")
            if name in _FACTORIES and dev is not None and torch.device(dev).type != self.device.type:
                raise AllocationOutsidePool(f"{self.where}: torch.{name}(device={dev!s}) inside capture allocates "
                                            f"outside the graph pool on {self.device} (invariant 5)")
        return func(*args, **kwargs)


def _to_other_device(args, kwargs, device: torch.device) -> bool:
    cand = [kwargs.get("device")] + [a for a in args[1:] if isinstance(a, (str, torch.device))]
    for c in cand:
        if c is None:
            continue
        try:
            if torch.device(c).type != device.type:
                return True
        except (RuntimeError, TypeError):
            pass
    return False


def _is_data_dependent(func, args) -> bool:
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape in tags:
        if func is torch.ops.aten.index.Tensor:          # only a boolean mask makes the shape data-dependent
            idx = args[1] if len(args) > 1 else ()
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        return True
    return False


class _DispatchGuard(TorchDispatchMode):
    """Aten-level guard (data-dependent shapes, .item() from C++) and, for a SimulatedGraph, the recorder."""

    def __init__(self, where: str, graph: Optional["SimulatedGraph"] = None):
        super().__init__()
        self.where = where
        self.graph = graph

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _Hooks.opaque() > 0:
            return func(*args, **kwargs)
        if _is_data_dependent(func, args):
            raise HostSyncInCapture(f"{self.where}: {func} inside capture has a data-dependent result or shape "
                                    f"(a host sync; invariant 5)")
        if func is torch.ops.aten.lift_fresh.default:
            raise AllocationOutsidePool(f"{self.where}: a tensor made from host data inside capture lies outside "
                                        f"the graph pool (invariant 5)")
        out = func(*args, **kwargs)
        if self.graph is not None:
            self.graph._record_aten(func, args, kwargs, out)
        return out


# ==============================================================================================
# the simulated graph (CPU) and the graph interface
# ==============================================================================================

def _flat_tensors(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _flat_tensors(e)]
    if isinstance(x, dict):
        return [t for e in x.values() for t in _flat_tensors(e)]
    return []


def _copy_into(recorded, fresh) -> None:
    """Copy a re-run's results into the tensors the capture recorded (same structure)."""
    for r, f in zip(_flat_tensors(recorded), _flat_tensors(fresh)):
        if r is f:
            continue
        if r.shape != f.shape:
            raise HostSyncInCapture(f"replay produced shape {tuple(f.shape)} where capture recorded {tuple(r.shape)} "
                                    f"(a data-dependent shape; invariant 5)")
        r.copy_(f)


class SimulatedGraph:
    """A CPU stand-in for torch.cuda.CUDAGraph: records a step's launches on the tensors they used,
    replays them on those same tensors. Events: aten ops (outputs that alias an input are left alone;
    fresh outputs receive the re-run's values), Triton launches and traced op calls (opaque: re-issued
    as they were). Tensors allocated during capture stay alive in ``pool`` (the graph's private pool).
    """

    def __init__(self, name: str):
        self.name = name
        self.events: List[Callable[[], None]] = []
        self.pool: List[torch.Tensor] = []
        self.replays = 0

    # recording hooks -----------------------------------------------------------------------
    def _record_aten(self, func, args, kwargs, out):
        rets = func._schema.returns
        aliased = [r.alias_info is not None for r in rets]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        fresh = [o for o, al in zip(outs, aliased) if isinstance(o, torch.Tensor) and not al]
        self.pool.extend(fresh)

        def ev(func=func, args=args, kwargs=kwargs, out=out, aliased=aliased):
            new = func(*args, **kwargs)
            news = new if isinstance(new, (tuple, list)) else (new,)
            olds = out if isinstance(out, (tuple, list)) else (out,)
            for o, n, al in zip(olds, news, aliased):
                if not al and isinstance(o, torch.Tensor):
                    _copy_into(o, n)

        self.events.append(ev)

    def _record_opaque(self, event: Callable[[], Any], out_holder: list):
        def ev(event=event):
            new = event()
            if out_holder:
                _copy_into(out_holder[0], new)
        self.events.append(ev)

    # replay ---------------------------------------------------------------------------------
    def replay(self) -> None:
        with torch.no_grad():                  # a graph records no autograd
            for ev in self.events:
                ev()
        self.replays += 1


class _OpaqueRecorder(LaunchRecorder):
    """Puts Triton launches and traced op calls into a SimulatedGraph as opaque events."""

    def __init__(self, graph: SimulatedGraph):
        self.graph = graph
        self.holder: Optional[list] = None

    def on_launch(self, key, event):
        if event is not None:
            self.holder: list = []
            self.graph._record_opaque(event, self.holder)

    def note_output(self, out):
        if out is not None and self.holder is not None:
            self.holder.append(out)
        self.holder = None


# ==============================================================================================
# descriptors, step specs, the lifecycle
# ==============================================================================================

class Phase(str, enum.Enum):
    LOAD = "load"
    PROFILE = "profile"
    RESERVE = "reserve"
    WARMUP = "warmup"
    CAPTURE = "capture"
    SERVE = "serve"


MODES = ("decode", "verify", "draft")


@dataclasses.dataclass(frozen=True, order=True)
class CaptureDescriptor:
    """batch: padded batch size; tokens: tokens per request (1 decode / draft, 1 + k verify); mode."""

    mode: str
    batch: int
    tokens: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.batch < 1 or self.tokens < 1:
            raise ValueError(f"batch and tokens must be >= 1, got batch={self.batch}, tokens={self.tokens}")

    def __str__(self) -> str:
        return f"{self.mode}[N={self.batch}, T={self.tokens}]"


@dataclasses.dataclass
class StepSpec:
    """What make_step(desc, warmup) returns.

    fn: the step, ``fn() -> outputs`` (tensors or a structure of them), reading only the tensors below
    and the caches; metadata: the step's metadata object (its tensor fields are static buffers; its
    other state must not be shared between warmup and capture); inputs: named static input buffers
    (copied into by replay); step_index: for a draft step, the device scalar holding the step number;
    position_fields: names of metadata tensor fields that must change from one draft step to the next
    (default: at least one tensor field must change).
    """

    fn: Callable[[], Any]
    metadata: Any = None
    inputs: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    step_index: Optional[torch.Tensor] = None
    position_fields: Optional[Sequence[str]] = None


_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, range)


def _fields(obj) -> Dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        out.update({k: v for k, v in getattr(obj, "__dict__", {}).items() if k not in out})
        return out
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    if hasattr(obj, "__slots__"):
        return {s: getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)}
    return {}


def metadata_tensors(obj, prefix: str = "", depth: int = 3) -> Dict[str, torch.Tensor]:
    """Tensor fields of a metadata object (dataclass / object / dict, nested up to ``depth``) by dotted name."""
    out: Dict[str, torch.Tensor] = {}
    if depth < 0:
        return out
    for k, v in _fields(obj).items():
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, (list, tuple)):
            for i, e in enumerate(v):
                if isinstance(e, torch.Tensor):
                    out[f"{name}.{i}"] = e
                elif not isinstance(e, _IMMUTABLE):
                    out.update(metadata_tensors(e, f"{name}.{i}.", depth - 1))
        elif not isinstance(v, _IMMUTABLE) and not callable(v):
            out.update(metadata_tensors(v, f"{name}.", depth - 1))
    return out


def _state_fingerprint(obj, depth: int = 3) -> Dict[str, Any]:
    """Non-tensor leaf state of a metadata object (flags, counters): what lazy initialisation flips."""
    out: Dict[str, Any] = {}
    if depth < 0 or obj is None:
        return out
    for k, v in _fields(obj).items():
        if isinstance(v, torch.Tensor) or callable(v) and not hasattr(v, "__dict__"):
            continue
        if isinstance(v, _IMMUTABLE):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(e, _IMMUTABLE) for e in v):
            out[k] = tuple(v)
        else:
            for kk, vv in _state_fingerprint(v, depth - 1).items():
                out[f"{k}.{kk}"] = vv
    return out


def _mutable_objects(obj, prefix: str = "", depth: int = 3) -> Dict[int, Tuple[str, Any]]:
    """id -> (dotted name, object) of every mutable non-tensor object reachable from obj (obj included)."""
    out: Dict[int, Tuple[str, Any]] = {}
    if obj is None or isinstance(obj, (_IMMUTABLE, torch.Tensor)) or depth < 0:
        return out
    out[id(obj)] = (prefix.rstrip(".") or "<metadata>", obj)
    for k, v in _fields(obj).items():
        if isinstance(v, (list, tuple)):
            for i, e in enumerate(v):
                out.update(_mutable_objects(e, f"{prefix}{k}.{i}.", depth - 1))
        elif not callable(v) or hasattr(v, "__dict__"):
            out.update(_mutable_objects(v, f"{prefix}{k}.", depth - 1))
    return out


@dataclasses.dataclass
class CapturedStep:
    desc: CaptureDescriptor
    spec: StepSpec
    graph: Any                                 # SimulatedGraph or a CUDA graph wrapper
    outputs: Any
    warm_keys: set
    capture_keys: set
    static: Dict[str, Tuple[torch.Tensor, int]]   # name -> (tensor, data_ptr at capture)
    owners: Dict[str, Tuple[Any, str]]            # name -> (owner object, attribute) for re-resolution
    last_fp: Dict[int, Dict[str, bytes]] = dataclasses.field(default_factory=dict)   # draft round: step -> content


class Lifecycle(LaunchRecorder):
    """The CUDA-graph lifecycle as a state machine (module docstring). One instance per served model.

    device: where the step runs ("cpu": SimulatedGraph; "cuda": a graph backend must be given);
    graph_backend: ``backend(desc) -> graph`` with ``capture(fn) -> outputs`` and ``replay()`` (fast.graphs
    passes a CUDA one); default: the simulated graph. check_drafts: compare draft metadata between
    steps (reads the buffers on the host between replays: a debug check, on by default on CPU).
    """

    def __init__(self, device="cpu", graph_backend=None, check_drafts: Optional[bool] = None):
        self.device = torch.device(device)
        self.phase = Phase.LOAD
        self.profiled_keys: set = set()
        self.seen_keys: set = set()            # every key launched so far (the process's "compiled" set)
        self.compiled_after_profile: List[CompileKey] = []
        self.autotuned: List[Tuple[str, tuple]] = []
        self.steps: Dict[CaptureDescriptor, CapturedStep] = {}
        self.peak_bytes = 0
        self.graph_backend = graph_backend
        self.check_drafts = (self.device.type == "cpu") if check_drafts is None else check_drafts
        self._where = "load"
        self._desc: Optional[CaptureDescriptor] = None
        self._warm: Optional[set] = None
        self._capture_keys: Optional[set] = None
        self.real_compiles: Dict[str, int] = {}       # phase -> Triton compilations seen (GPU)

    # ------------------------------------------------------------------ the recorder protocol
    def on_launch(self, key, event):
        if key is None:
            return
        where = self._where
        if self.phase == Phase.PROFILE:
            self.profiled_keys.add(key)
        elif self.phase == Phase.CAPTURE:
            if key not in self.seen_keys:
                raise CompileDuringCapture(
                    f"capture of {self._desc}: kernel variant {key} was never launched before (not in profile, "
                    f"not in this descriptor's warmup): Triton would compile and load its module inside the "
                    f"stream capture ('operation not permitted when stream is capturing'); warm up the exact "
                    f"path capture takes (seeds 000, 001)")
            if self._warm is not None and key not in self._warm:
                raise CompileDuringCapture(
                    f"capture of {self._desc}: kernel variant {key} was not launched by this descriptor's warmup: "
                    f"warmup must run the same path as capture (e.g. the speculative variants; seeds 000, 001)")
            self._capture_keys.add(key)
        elif self.phase in (Phase.RESERVE, Phase.WARMUP, Phase.SERVE) and key not in self.seen_keys:
            self.compiled_after_profile.append(key)
            raise CompileAfterReserve(
                f"{where}: kernel variant {key} first launched after the cache was reserved: its compile (and any "
                f"autotune benchmarking) needs memory the cache now holds; launch it in profile (seed 003: every BT "
                f"a prefill can select, T = 16, 32, 64 under BT = min(64, max(16, next_pow2(T))))")
        if self.phase == Phase.WARMUP and self._warm is not None:
            self._warm.add(key)
        self.seen_keys.add(key)

    def on_compiled(self, key):
        self.real_compiles[self.phase.value] = self.real_compiles.get(self.phase.value, 0) + 1

    def on_autotune(self, name, tune_key, cached):
        if cached:
            return
        if self.phase in (Phase.LOAD, Phase.PROFILE):
            self.autotuned.append((name, tune_key))
            return
        raise AutotuneAfterReserve(
            f"{self._where}: kernel {name} would autotune for key {tune_key} after the cache was reserved "
            f"(phase {self.phase.value}): benchmarking its configs loads every config's module into memory the "
            f"cache holds, and re-runs a kernel that may mutate state; tune or pin its config in profile (seed 003)")

    # ------------------------------------------------------------------ phases
    def _need(self, *phases: Phase, what: str):
        if self.phase not in phases:
            raise PhaseError(f"{what} needs phase {' or '.join(p.value for p in phases)}, but the lifecycle is in "
                             f"{self.phase.value}")

    def profile(self, fn: Callable[[], Any]):
        """Run ``fn`` (every kernel variant the server will launch, once) with autotuning allowed;
        records its keys and the peak memory it allocated. May be called several times."""
        self._need(Phase.LOAD, Phase.PROFILE, what="profile")
        self.phase = Phase.PROFILE
        self._where = "profile"
        with recording(self), _PeakMemory(self.device) as mem:
            out = fn()
        self.peak_bytes = max(self.peak_bytes, mem.peak)
        return out

    def check_profiled(self, keys: Iterable[CompileKey]) -> None:
        """Raise CompileAfterReserve now, before the cache is reserved, if profile missed any of ``keys``
        (e.g. ``plan(model, cfg).keys``): each would be compiled later, after the memory is gone."""
        missing = sorted(map(str, set(keys) - self.seen_keys))
        if missing:
            raise CompileAfterReserve(f"profile did not launch {len(missing)} planned kernel variant(s); each would "
                                      f"first compile after the cache is reserved: {missing}")

    def reserve(self, allocate: Callable[[], Any]):
        """Allocate the cache (``allocate()``) from what is left; from here on a new kernel variant or an
        autotune raises (CompileAfterReserve / AutotuneAfterReserve)."""
        self._need(Phase.PROFILE, what="reserve")
        self.phase = Phase.RESERVE
        self._where = "reserve"
        with recording(self):
            return allocate()

    def serve(self) -> None:
        """Start serving without (more) captures: reserve -> serve (an eager-only server, cuda_graphs=False)."""
        self._need(Phase.RESERVE, Phase.SERVE, what="serve")
        self.phase, self._where = Phase.SERVE, "serve"

    def capture(self, desc: CaptureDescriptor, make_step: Callable[[CaptureDescriptor, bool], StepSpec]):
        """Warm up ``make_step(desc, warmup=True)`` eagerly, then capture ``make_step(desc, warmup=False)``.

        The two calls must give separate metadata objects (SharedWarmupMetadata otherwise); capture may
        launch only kernel variants the warmup launched (CompileDuringCapture otherwise); the captured
        step may not talk to the host (HostSyncInCapture)."""
        self._need(Phase.RESERVE, Phase.SERVE, what=f"capture of {desc}")
        if desc in self.steps:
            raise PhaseError(f"{desc} is captured already")
        try:
            spec, graph, outputs, warm_keys, capture_keys = self._warmup_and_capture(desc, make_step)
        finally:
            self.phase, self._where, self._desc, self._warm, self._capture_keys = Phase.SERVE, "serve", None, None, None
        static, owners = self._static_of(spec)
        self.steps[desc] = CapturedStep(desc, spec, graph, outputs, warm_keys, capture_keys, static, owners)
        return outputs

    def _warmup_and_capture(self, desc, make_step):
        self._desc = desc
        # warmup ------------------------------------------------------------------------------
        self.phase, self._where = Phase.WARMUP, f"warmup of {desc}"
        warm = make_step(desc, True)
        fp_before = _state_fingerprint(warm.metadata)
        self._warm = set()
        graph = (self.graph_backend or _sim_backend)(desc)
        warm_ctx = getattr(graph, "warmup_context", contextlib.nullcontext)   # CUDA: the capture's side stream
        try:
            with torch.no_grad(), recording(self), warm_ctx():
                warm.fn()
        finally:
            warm_keys, self._warm = self._warm, None
        fp_after = _state_fingerprint(warm.metadata)
        flipped = sorted(k for k in fp_after if fp_before.get(k, _MISSING) != fp_after[k])
        # capture -----------------------------------------------------------------------------
        spec = make_step(desc, False)
        self._check_not_shared(desc, warm, spec, flipped, fp_before)
        if desc.mode == "draft" and not isinstance(spec.step_index, torch.Tensor):
            raise StaleDraftMetadata(
                f"{desc}: a draft step is captured once and replayed for every step index, so the index must live "
                f"in a device scalar (StepSpec.step_index) that replay_draft writes; a Python int would be baked "
                f"into the graph and every replay would act as that step (seed 002)")
        self.phase, self._where = Phase.CAPTURE, f"capture of {desc}"
        self._warm, self._capture_keys = warm_keys, set()
        outputs = graph.capture(spec.fn, self)
        return spec, graph, outputs, warm_keys, self._capture_keys

    def _check_not_shared(self, desc, warm: StepSpec, spec: StepSpec, flipped, fp_before):
        if warm.metadata is not None and spec.metadata is warm.metadata:
            extra = f" (warmup flipped {', '.join(flipped)})" if flipped else ""
            raise SharedWarmupMetadata(
                f"{desc}: warmup and capture were given the same metadata object {type(spec.metadata).__name__}"
                f"{extra}: state a backend initialises lazily on first use is then skipped by the capture, and the "
                f"graph records reads of uninitialised buffers; build fresh metadata for capture (seed 004)")
        shared = set(_mutable_objects(warm.metadata)) & set(_mutable_objects(spec.metadata))
        if shared:
            names = sorted(_mutable_objects(spec.metadata)[i][0] for i in shared)
            raise SharedWarmupMetadata(
                f"{desc}: warmup and capture metadata share the mutable object(s) {names}: a lazy-init flag warmup "
                f"flips there is seen as set by the capture (seed 004); give capture its own")
        fp_cap = _state_fingerprint(spec.metadata)
        stale = sorted(k for k in flipped if k in fp_cap and fp_cap[k] != fp_before.get(k, _MISSING))
        if stale:
            raise SharedWarmupMetadata(
                f"{desc}: the capture metadata arrives with {', '.join(stale)} already in the state warmup left it "
                f"({', '.join(f'{k}={fp_cap[k]!r}' for k in stale)}), not freshly built: a lazily initialised "
                f"object whose flag warmup flipped (seed 004)")

    def _static_of(self, spec: StepSpec):
        static, owners = {}, {}
        for name, t in spec.inputs.items():
            static[f"inputs.{name}"] = (t, t.data_ptr())
            owners[f"inputs.{name}"] = (spec.inputs, name)
        for name, t in metadata_tensors(spec.metadata).items():
            static[f"metadata.{name}"] = (t, t.data_ptr())
            path = name.split(".")
            owner = spec.metadata
            ok = True
            for p in path[:-1]:
                f = _fields(owner)
                if p not in f:
                    ok = False
                    break
                owner = f[p]
            if ok and not isinstance(owner, (list, tuple)):
                owners[f"metadata.{name}"] = (owner, path[-1])
        if spec.step_index is not None:
            static["step_index"] = (spec.step_index, spec.step_index.data_ptr())
            owners["step_index"] = (spec, "step_index")
        return static, owners

    # ------------------------------------------------------------------ serving
    def check_static(self, desc: CaptureDescriptor, extra: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Raise StaticBufferMoved if a static buffer of ``desc`` was replaced or re-allocated since capture.

        extra: more buffers to check by name (e.g. the caches' tensors, registered with :meth:`watch`)."""
        st = self.steps[desc]
        for name, (t, ptr) in st.static.items():
            cur = t
            if name in st.owners:
                owner, attr = st.owners[name]
                f = owner if isinstance(owner, dict) else _fields(owner)
                cur = f.get(attr, t) if isinstance(f, dict) else t
            if not isinstance(cur, torch.Tensor) or cur.data_ptr() != ptr:
                new = f"{cur.data_ptr():#x}" if isinstance(cur, torch.Tensor) else "no tensor"
                raise StaticBufferMoved(
                    f"{desc}: static buffer {name} moved since capture (address {ptr:#x} -> "
                    f"{new}): the graph reads and writes the old address, so the "
                    f"new tensor's values would be ignored (invariant 5); copy into the static buffer instead")
        for name, (get, ptr) in getattr(self, "_watched", {}).items():
            t = get()
            if t.data_ptr() != ptr:
                raise StaticBufferMoved(f"{desc}: buffer {name} moved since capture ({ptr:#x} -> {t.data_ptr():#x}): "
                                        f"the graphs still use the old one (invariant 5)")

    def watch(self, name: str, get: Callable[[], torch.Tensor]) -> None:
        """Check at every replay that ``get()`` (e.g. ``lambda: cache.ssm_state``) keeps its capture address."""
        if not hasattr(self, "_watched"):
            self._watched = {}
        self._watched[name] = (get, get().data_ptr())

    def replay(self, desc: CaptureDescriptor, inputs: Optional[Dict[str, torch.Tensor]] = None, metadata=None):
        """Serve one step of ``desc``: copy ``inputs`` (by name) and ``metadata``'s tensor fields into the
        static buffers, check the static addresses, replay; returns the static outputs."""
        self._need(Phase.SERVE, what=f"replay of {desc}")
        if desc not in self.steps:
            raise KeyError(f"{desc} was not captured (captured: {sorted(map(str, self.steps))})")
        st = self.steps[desc]
        self.check_static(desc)
        self._copy_in(st, inputs, metadata)
        st.graph.replay()
        return st.outputs

    def replay_draft(self, desc: CaptureDescriptor, step: int, metadata, inputs=None):
        """Replay the captured draft step for draft step ``step`` (0-based): writes ``step`` into the step's
        device scalar, copies ``metadata`` (rebuilt for this step) into the static buffers. Raises
        StaleDraftMetadata when ``metadata`` is the previous step's (its position-dependent fields did not
        change) or carries another step number."""
        if desc.mode != "draft":
            raise ValueError(f"replay_draft needs a draft descriptor, got {desc}")
        self._need(Phase.SERVE, what=f"replay of {desc}")
        st = self.steps[desc]
        tagged = getattr(metadata, "step", None)
        if isinstance(tagged, int) and tagged != step:
            raise StaleDraftMetadata(f"{desc}: draft step {step} replayed with metadata built for step {tagged} "
                                     f"(rebuild positions, sequence lengths and slot mapping per step; seed 002)")
        if self.check_drafts:
            self._check_draft_fresh(st, step, metadata)
        if st.spec.step_index is not None:
            st.spec.step_index.fill_(step)
        return self.replay(desc, inputs, metadata)

    def _check_draft_fresh(self, st: CapturedStep, step: int, metadata):
        cur = {n: t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
               for n, t in metadata_tensors(metadata).items()}
        if step == 0:
            st.last_fp = {0: cur}
            return
        prev = st.last_fp.get(step - 1)
        if prev is None:
            raise StaleDraftMetadata(f"{st.desc}: draft step {step} replayed without step {step - 1} before it in this "
                                     f"round (replay steps 0, 1, ..., k-1 in order)")
        fields = st.spec.position_fields
        if fields:
            same = [f for f in fields if f in cur and cur[f] == prev.get(f)]
            stale = bool(same)
        else:
            same = sorted(cur)
            stale = all(cur[n] == prev.get(n) for n in cur)
        if stale:
            raise StaleDraftMetadata(
                f"{st.desc}: draft step {step} replayed with metadata equal to step {step - 1}'s in {same}: "
                f"position-dependent metadata (positions, sequence lengths, slot mapping) must be rebuilt for every "
                f"draft step and copied into the static buffers before its replay (seed 002)")
        st.last_fp[step] = cur

    def _copy_in(self, st: CapturedStep, inputs, metadata):
        for name, src in (inputs or {}).items():
            if name not in st.spec.inputs:
                raise KeyError(f"{st.desc}: no static input {name!r} (has {sorted(st.spec.inputs)})")
            dst = st.spec.inputs[name]
            if src is dst:
                continue
            if src.shape != dst.shape:
                raise ValueError(f"{st.desc}: input {name} must have the static shape {tuple(dst.shape)} (pad the "
                                 f"batch), got {tuple(src.shape)}")
            dst.copy_(src)
        if metadata is not None and metadata is not st.spec.metadata:
            static = metadata_tensors(st.spec.metadata)
            for name, src in metadata_tensors(metadata).items():
                dst = static.get(name)
                if dst is None:
                    raise KeyError(f"{st.desc}: metadata field {name} has no static buffer")
                if src.shape != dst.shape:
                    raise ValueError(f"{st.desc}: metadata.{name} must have the static shape {tuple(dst.shape)}, "
                                     f"got {tuple(src.shape)}")
                dst.copy_(src)

    def descriptor_for(self, mode: str, batch: int, tokens: int = 1) -> Optional[CaptureDescriptor]:
        """The smallest captured descriptor of ``mode``/``tokens`` whose padded batch holds ``batch``
        requests, or None (run eagerly: larger than the largest graph)."""
        fits = [d for d in self.steps if d.mode == mode and d.tokens == tokens and d.batch >= batch]
        return min(fits, key=lambda d: d.batch) if fits else None

    def eager(self, fn: Callable[[], Any], what: str = "eager step"):
        """Run a step eagerly while serving (a batch above the largest graph): new variants still raise."""
        self._need(Phase.SERVE, Phase.RESERVE, what=what)
        self._where = what
        with recording(self):
            out = fn()
        self._where = "serve"
        return out


_MISSING = object()


class _SimBackend:
    """Graph backend of the CPU lifecycle: a SimulatedGraph captured under the host guards."""

    def __init__(self, desc: CaptureDescriptor):
        self.graph = SimulatedGraph(str(desc))
        self.desc = desc

    def capture(self, fn, lifecycle: "Lifecycle"):
        where = f"capture of {self.desc}"
        rec = _OpaqueRecorder(self.graph)
        # fast's launchers skip host-side cache checks while a stream is capturing: the simulation says so too
        with torch.no_grad(), _capturing_flag(), recording(lifecycle), recording(rec), \
                _HostGuard(where, lifecycle.device), _DispatchGuard(where, self.graph):
            outputs = fn()
        return outputs

    def replay(self):
        self.graph.replay()


def _sim_backend(desc):
    return _SimBackend(desc)


@contextlib.contextmanager
def _capturing_flag():
    """torch.cuda.is_current_stream_capturing() -> True while a simulated graph captures."""
    orig = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = orig


def capture_guards(where: str, device) -> contextlib.ExitStack:
    """The host guards alone (for a real CUDA graph capture): HostSyncInCapture / AllocationOutsidePool."""
    stack = contextlib.ExitStack()
    stack.enter_context(_HostGuard(where, torch.device(device)))
    stack.enter_context(_DispatchGuard(where, None))
    return stack


class _PeakMemory:
    """Peak bytes allocated while the block runs: torch.cuda's counters on a GPU, a live-bytes count of
    fresh tensors (weakref-finalised) on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        self._mode = _LiveBytes()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._mode.__exit__(*exc)
            self.peak = self._mode.peak
        return False


class _LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o, r in zip(outs, rets):
            if isinstance(o, torch.Tensor) and r.alias_info is None:
                try:
                    n = o.untyped_storage().nbytes()
                    weakref.finalize(o, self._free, n)
                except (RuntimeError, TypeError, NotImplementedError):   # storage-less tensors: not counted
                    continue
                self.live += n
                self.peak = max(self.peak, self.live)
        return out


# ==============================================================================================
# the warmup planner
# ==============================================================================================

@dataclasses.dataclass
class ServingConfig:
    """What a server will run, for :func:`plan`.

    capture_batch_sizes: padded batch sizes of the decode / verify / draft graphs; max_draft: k (verify
    graphs for 1 + k tokens, k = 1..max_draft); max_batch: largest batch served (eagerly above the largest
    graph); max_prefill_tokens / max_prefill_seqs: the largest packed prefill (tokens, sequences);
    state_dtype: GDN ssm state (None: the model's default_state_dtype, float32); index_dtype / accept_dtype:
    dtypes of state_indices / num_accepted the caller passes; device: where the model runs (its SM count and
    type pick configs).
    """

    capture_batch_sizes: Sequence[int] = (1, 2, 4, 8)
    max_draft: int = 0
    max_batch: int = 8
    max_prefill_tokens: int = 64
    max_prefill_seqs: int = 4
    state_dtype: Optional[torch.dtype] = None
    index_dtype: torch.dtype = torch.int32
    accept_dtype: torch.dtype = torch.int32
    device: Any = "cpu"

    def descriptors(self) -> List[CaptureDescriptor]:
        """decode[N], verify[N, 1+k] for k = 1..max_draft, and the MTP draft step draft[N, 1] (when k > 0)."""
        out = [CaptureDescriptor("decode", n) for n in self.capture_batch_sizes]
        for k in range(1, self.max_draft + 1):
            out += [CaptureDescriptor("verify", n, 1 + k) for n in self.capture_batch_sizes]
        if self.max_draft:
            out += [CaptureDescriptor("draft", n, 1) for n in self.capture_batch_sizes]
        return out


@dataclasses.dataclass
class Plan:
    """keys: every compile key profiling must launch; steps: name -> keys, e.g. "decode[N=4, T=1]",
    "prefill[T<=16, N=2]", "accept[N=4]" (prefill and eager entries by class)."""

    keys: set
    steps: Dict[str, set]

    def for_descriptor(self, desc: CaptureDescriptor) -> set:
        return self.steps[str(desc)]


def prefill_classes(max_tokens: int) -> List[int]:
    """Packed prefill lengths that reach every key class up to ``max_tokens``: each power of two (keys
    depend on T through next_pow2(T)), the maximum, and for T >= 16 also an
    odd length (p + 1): on a GPU Triton compiles integer arguments divisible by 16 (T, batch strides
    T * D) as their own variant, so profile must see both classes of every key."""
    out, p = set(), 1
    while p < max_tokens:
        out.add(p)
        if p >= 16 and p + 1 <= max_tokens:
            out.add(p + 1)
        p *= 2
    out.add(max_tokens)
    return sorted(out)


def plan(model, cfg: ServingConfig, keys=None) -> Plan:
    """Every compile key that profiling, warmup, capture and serving of ``model`` (a refgdn.model
    Qwen3NextModel, any ops) under ``cfg`` will launch, from fast.keys' pure functions on meta tensors.

    The model's GDN layers call (refgdn/model/layers.py): prefill -> gdn_prefill (the rows kernel,
    gdn_materialize, the conv and the chunked forward on the cache's slots); decode -> gdn_decode; verify ->
    gdn_verify; accept -> gdn_accept; then, in each step mode, rms_norm_gated (the output norm, on the step's
    tokens) and rms_norm (every RMSNorm of the model, the MTP head's included: one key per width). Attention,
    MLPs and the rest of the MTP head are plain torch (no compile keys).
    Keys depend on the prefill's packed length T only through next_pow2(T) classes (the conv's configs), on
    its sequence count N through the state pass's
    BV, so T runs over :func:`prefill_classes` and N over 1..max_prefill_seqs.
    """
    if keys is None:
        import fast.keys as keys

    import refgdn.serving as rs
    from refgdn.model.config import FULL
    c = model.config
    H, HV, K, V, W = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim, c.linear_conv_kernel_dim)
    D = 2 * H * K + HV * V
    dt = model.dtype
    dev = torch.device(cfg.device)
    meta = dict(device="meta")

    def e(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype, **meta)

    cache = rs.GDNStateCache.allocate(2, H, HV, K, V, conv_width=W, max_draft=cfg.max_draft,
                                      state_dtype=cfg.state_dtype or model.default_state_dtype, act_dtype=dt,
                                      device="meta")
    conv_w = e(D, W)
    A_log, dt_bias = e(HV), e(HV)
    idx = cfg.index_dtype
    steps: Dict[str, set] = {}

    norm_w = e(V)
    target_attn = FULL in c.layer_types

    def plain_norms(T, attn):
        # the model's RMSNorms (zero-centred) on a step of T tokens: hidden rows, and where attention runs its q / k
        # norms (q a [T, heads, head_dim] slice of the projection; layers.py). One key per D: T only shapes them.
        hd, w = c.head_dim, e(c.head_dim)
        out = keys.rms_norm(e(T, c.hidden_size), e(c.hidden_size), None, None, c.rms_norm_eps, unit_offset=True)
        if attn:
            out += keys.rms_norm(e(T, c.num_attention_heads, 2 * hd)[..., :hd], w, None, None, c.rms_norm_eps,
                                 unit_offset=True)
            out += keys.rms_norm(e(T, c.num_key_value_heads, hd), w, None, None, c.rms_norm_eps, unit_offset=True)
        return out

    def norm(T):
        # the output norm of a step of T tokens: o [T, HV, V], z a [T, HV, V] slice of the projection (layers.py),
        # and the target's plain norms
        z = e(T, HV, 2 * V)[..., V:]
        return (keys.rms_norm_gated(e(T, HV, V), z, norm_w, None, "silu", eps=c.rms_norm_eps)
                + plain_norms(T, target_attn))

    def decode(N):
        return keys.gdn_decode(e(N, D), e(N, HV), e(N, HV), conv_w, None, A_log, dt_bias, cache, e(N, dtype=idx),
                               device=dev) + norm(N)

    def verify(N, T):
        return keys.gdn_verify(e(N * T, D), e(N * T, HV), e(N * T, HV), conv_w, None, A_log, dt_bias, cache,
                               e(N, dtype=idx), e(N + 1, dtype=torch.int32), device=dev) + norm(N * T)

    def accept(N):
        return keys.gdn_accept(cache, e(N, dtype=idx), e(N, dtype=cfg.accept_dtype))

    def prefill(T, N):
        return keys.gdn_prefill(e(T, D), e(T, HV), e(T, HV), conv_w, None, A_log, dt_bias, cache, e(N, dtype=idx),
                                e(N + 1, dtype=torch.int32), e(N, dtype=torch.bool), device=dev) + norm(T)

    for desc in cfg.descriptors():
        if desc.mode == "decode":
            steps[str(desc)] = set(decode(desc.batch))
        elif desc.mode == "verify":
            steps[str(desc)] = set(verify(desc.batch, desc.tokens))
        else:
            # the MTP head: its norms (it holds a full-attention layer); no head, no draft graph (fast.graphs)
            steps[str(desc)] = set(plain_norms(desc.batch, True)) if getattr(model, "has_mtp", True) else set()
    for N in range(1, cfg.max_batch + 1):
        steps[f"decode-eager[N={N}]"] = set(decode(N))
        if cfg.max_draft:
            steps[f"verify-eager[N={N}]"] = set(verify(N, 1 + cfg.max_draft))
            steps[f"accept[N={N}]"] = set(accept(N))
    for T in prefill_classes(cfg.max_prefill_tokens):
        for N in range(1, min(T, cfg.max_prefill_seqs) + 1):
            steps[f"prefill[T={T}, N={N}]"] = set(prefill(T, N))
    allk = set().union(*steps.values()) if steps else set()
    return Plan(allk, steps)

