"""Input validation shared by refgdn and fast.

Every check raises ``ValueError`` naming the argument and what was expected, and runs before
any tensor is read or written, so a rejected call leaves every state tensor byte-identical.
fast calls the same functions, so both packages reject the same inputs with the same words.
"""
from __future__ import annotations

import functools
import math
import numbers
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)
ACTIVATIONS = (None, "silu", "swish")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _need_tensor(name: str, t, ndim: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {_shape(t)}")


def _byte_span(t: torch.Tensor) -> tuple:
    """[first, last] byte addresses t's elements can reach (t not empty; torch strides are >= 0)."""
    base, size = t.data_ptr(), t.element_size()
    return base, base + sum(st * (n - 1) for st, n in zip(t.stride(), t.shape)) * size + size - 1


def need_disjoint(name: str, out: torch.Tensor, inputs: tuple) -> None:
    """out (an op's output argument, written by kernels while they read the inputs) must not share a byte with
    any input tensor of ``inputs`` ((name, tensor or None), ...): ValueError naming both. Spans by address (a view
    interleaved with an input, each element apart, is refused too: outputs are buffers of their own). Per call
    (addresses are no part of a served call's signature), so cheap first: tensors whose storages' byte ranges are
    disjoint cannot overlap (~0.5 us each); only inputs in out's allocation get their spans compared. Host and
    device tensors never overlap (the caller checked devices; CUDA devices share one virtual address space)."""
    if out.numel() == 0:
        return
    st = out.untyped_storage()
    s0 = st.data_ptr()
    s1 = s0 + st.nbytes()
    cuda = out.is_cuda
    o = None
    for what, t in inputs:
        if not isinstance(t, torch.Tensor) or t.is_cuda != cuda or t.numel() == 0:
            continue
        ts = t.untyped_storage()
        t0 = ts.data_ptr()
        if t0 >= s1 or t0 + ts.nbytes() <= s0:
            continue                                  # another allocation
        o = o or _byte_span(out)
        r = _byte_span(t)
        if o[0] <= r[1] and r[0] <= o[1]:
            raise ValueError(f"{name} must not overlap {what} (it is written while {what} is read): "
                             f"{name} {_shape(out)} at bytes [{o[0]:#x}, {o[1]:#x}], {what} {_shape(t)} at "
                             f"[{r[0]:#x}, {r[1]:#x}]")


def _need_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _need_shape(name: str, t: torch.Tensor, expected: Sequence[int], contract: str) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name} must have shape {contract} = {want}, got {_shape(t)}")


def _need_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")


def check_index_vector(name: str, t, B: int, device: torch.device) -> None:
    """t: an int32 / int64 tensor [B] on ``device`` (slot or row indices, counts), else ValueError naming it."""
    _need_tensor(name, t)
    if tuple(t.shape) != (B,):
        raise ValueError(f"{name} must have shape [B] = [{B}], got {_shape(t)}")
    if t.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    _need_device(name, t, device)


def check_float_param(name: str, t, shape: Sequence[int], contract: str, device: torch.device) -> None:
    """A floating tensor of exactly `shape` (described as `contract`, e.g. "[HV]") on `device`. A wrong rank gets the
    same message as a wrong size (the contract and the expected sizes)."""
    _need_tensor(name, t)
    _need_shape(name, t, shape, contract)
    _need_float(name, t)
    _need_device(name, t, device)


def check_scale(scale) -> None:
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise ValueError(f"scale must be a real number or None (default K ** -0.5), got {scale!r}")


def check_chunk_size(chunk_size) -> None:
    """chunk_size: a power of two >= 16."""
    if (not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool)
            or chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a power of two >= 16 (16, 32, 64, ...), got {chunk_size!r}")


def check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device, name: str = "cu_seqlens",
                     values: bool = True) -> int:
    """cu_seqlens: [N+1] int, starts at 0, non-decreasing, ends at T; only with B == 1. Returns N.
    values=False: the value rules are left to the caller (check_cu_seqlens_values, before any result is used)."""
    _need_tensor(name, cu_seqlens, 1)
    if cu_seqlens.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    _need_device(name, cu_seqlens, device)
    if B != 1:
        raise ValueError(f"{name} requires batch size B == 1 (varlen packs sequences along T), got B={B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must hold N+1 >= 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
    if values and not torch.compiler.is_compiling():   # traced by torch.compile: the values are checked at run
        check_cu_seqlens_values(cu_seqlens, T, name)     # time, inside fast's custom ops (fast/library.py)
    return cu_seqlens.numel() - 1


_HOST = threading.local()     # .memo: {id(tensor): (tensor, values)} while a one_host_read scope is open


class one_host_read_scope:
    """Inside the block, :func:`host_offsets` reads each cu_seqlens tensor's values to the host once:
    the value check and the varlen tables of an op (and of the ops it calls) share one device->host copy,
    one sync on a GPU, instead of one per reader. Nested blocks share the outer one; the values are
    forgotten when the outermost block ends (never reused by a later call, which may have changed them).
    A class rather than a generator context manager: every eager op call enters one (:func:`one_host_read`),
    and this is the cheaper of the two on the host."""
    __slots__ = ("outermost",)

    def __enter__(self) -> None:
        self.outermost = getattr(_HOST, "memo", None) is None
        if self.outermost:
            _HOST.memo = {}

    def __exit__(self, *exc) -> None:
        if self.outermost:
            _HOST.memo = None


def one_host_read(fn):
    """Decorator: ``fn`` runs inside :func:`one_host_read_scope`."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with one_host_read_scope():
            return fn(*args, **kwargs)
    return wrapped


def scope_memo() -> Optional[dict]:
    """The current :func:`one_host_read_scope`'s memo (None outside one): host work derived from a tensor's values
    (fast's varlen chunk tables) may be kept there under a key of its own, beside the offsets (keyed by id), and is
    forgotten with them when the outermost scope ends."""
    return getattr(_HOST, "memo", None)


def host_offsets(cu_seqlens: torch.Tensor) -> List[int]:
    """cu_seqlens' values as a list of ints: a host read (a sync on a GPU), once per tensor inside a
    :func:`one_host_read_scope` (the list is shared: callers must not modify it)."""
    memo = getattr(_HOST, "memo", None)
    if memo is None:
        return _read(cu_seqlens)
    hit = memo.get(id(cu_seqlens))
    if hit is None or hit[0] is not cu_seqlens:
        hit = memo[id(cu_seqlens)] = (cu_seqlens, _read(cu_seqlens))
    return hit[1]


def host_offsets_known(cu_seqlens: torch.Tensor) -> bool:
    """Whether :func:`host_offsets` (cu_seqlens) would answer without reading the device: its values were read
    or provided (cu_seqlens_cpu) earlier in the current :func:`one_host_read_scope`."""
    memo = getattr(_HOST, "memo", None)
    hit = None if memo is None else memo.get(id(cu_seqlens))
    return hit is not None and hit[0] is cu_seqlens


def host_offsets_later(cu_seqlens: torch.Tensor) -> Callable[[], List[int]]:
    """:func:`host_offsets` in two halves: the device->host copy is queued now, and the returned function waits
    for it and returns the values (remembered in the current scope as host_offsets' are). So kernels queued
    between the two halves run while the host waits, instead of after its read. On a CUDA device the copy goes
    to pinned memory without blocking and an event marks its end; elsewhere (or when the values are known
    already) the read happens at the wait. Still one read per tensor and scope (the same _read)."""
    if cu_seqlens.device.type != "cuda" or host_offsets_known(cu_seqlens):
        return lambda: host_offsets(cu_seqlens)
    pinned = torch.empty(cu_seqlens.shape, dtype=cu_seqlens.dtype, pin_memory=True)
    pinned.copy_(cu_seqlens, non_blocking=True)         # on the current stream of cu_seqlens' device
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(cu_seqlens.device))

    def wait() -> List[int]:
        done.synchronize()                  # the copy (and whatever ran before it on the stream) is complete
        values = _read(pinned)              # host memory: no device access
        memo = getattr(_HOST, "memo", None)
        if memo is not None:
            memo[id(cu_seqlens)] = (cu_seqlens, values)
        return values
    return wait


def provide_host_offsets(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> None:
    """Inside the current :func:`one_host_read_scope`, :func:`host_offsets` (cu_seqlens) answers with
    cu_seqlens_cpu's values (a host copy the caller holds, fla's and vLLM's ``cu_seqlens_cpu`` /
    ``query_start_loc_cpu``): no device->host read, no sync. Checked first (check_cu_seqlens_cpu); a no-op
    outside a scope (the op then reads cu_seqlens itself)."""
    memo = getattr(_HOST, "memo", None)
    if memo is not None:
        memo[id(cu_seqlens)] = (cu_seqlens, cu_seqlens_cpu.tolist())   # a CPU tensor: no sync


def check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens, name: str = "cu_seqlens_cpu", of: str = "cu_seqlens") -> None:
    """cu_seqlens_cpu: cu_seqlens' values on the host, [N+1] int32 or int64 on the CPU, with cu_seqlens.
    Once checked, its values stand for cu_seqlens' in the current one_host_read scope (provide_host_offsets):
    the value check and the chunk bookkeeping read them instead of the device tensor. name / of: the two
    arguments' names in messages (the model says query_start_loc_cpu / meta.query_start_loc)."""
    if cu_seqlens_cpu is None:
        return
    if cu_seqlens is None:
        raise ValueError(f"{name} is a host copy of {of}: give {of} too (or neither)")
    _need_tensor(name, cu_seqlens_cpu, 1)
    if cu_seqlens_cpu.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {cu_seqlens_cpu.dtype}")
    if cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (a host copy of {of}), got "
                         f"{cu_seqlens_cpu.device}")
    if (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
            and tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape)):
        raise ValueError(f"{name} must have the shape of {of}, {_shape(cu_seqlens)}, got "
                         f"{_shape(cu_seqlens_cpu)}")
    if isinstance(cu_seqlens, torch.Tensor) and not torch.compiler.is_compiling():   # (traced: values at run time)
        provide_host_offsets(cu_seqlens, cu_seqlens_cpu)


def _read(cu_seqlens: torch.Tensor) -> List[int]:
    """The device->host read itself (tests count the calls)."""
    return cu_seqlens.tolist()


def check_cu_seqlens_values(cu_seqlens, T: int, name: str = "cu_seqlens") -> None:
    """cu_seqlens' values: starts at 0, non-decreasing, ends at T. A host read (a sync on a GPU; shared
    with the op's other readers inside a one_host_read_scope)."""
    offsets = host_offsets(cu_seqlens)  # host read: validation only, before any work
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {offsets}")
    if offsets[-1] != T:
        raise ValueError(f"{name} must end at T={T} (the packed length), got {offsets[-1]}")


def check_offsets_again(cu_seqlens, cu_seqlens_cpu, T: int) -> None:
    """The per-call part of the checks of cu_seqlens, for a caller whose cached call signature stands for the
    rest (fast's eager plans): its host copy, when given, stands for its values in this one_host_read scope
    (as check_cu_seqlens_cpu makes it), and check_cu_seqlens_values runs on them. No-op without cu_seqlens."""
    if cu_seqlens is None:
        return
    if cu_seqlens_cpu is not None:
        provide_host_offsets(cu_seqlens, cu_seqlens_cpu)
    check_cu_seqlens_values(cu_seqlens, T)


def check_gdn_inputs(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                     A_log=None, dt_bias=None, chunk_size=None, cu_seqlens_cpu=None, offset_values: bool = True) -> int:
    """Validate the gated-delta-rule arguments; return N, the number of sequences.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; g, beta: [B, T, HV];
    initial_state: [N, HV, K, V]; cu_seqlens: [N+1] int with B == 1; A_log, dt_bias: [HV] (together);
    cu_seqlens_cpu: cu_seqlens' host copy (inside a one_host_read scope its values are the ones checked
    and read: check_cu_seqlens_cpu). offset_values=False: cu_seqlens' value rules are the caller's to run
    (check_cu_seqlens_values) before any result is used or any caller state is written.
    """
    _need_tensor("q", q, 4)
    _need_tensor("k", k, 4)
    _need_tensor("v", v, 4)
    B, T, H, K = q.shape
    _need_shape("k", k, q.shape, "[B, T, H, K] (same as q)")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must have shape [B, T, HV, V] = [{B}, {T}, HV, V], got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's head count H={H} (GVA)")
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K={K} (q) and V={V} (v)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _need_float(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    device = q.device
    _need_device("k", k, device)
    _need_device("v", v, device)
    for name, t in (("g", g), ("beta", beta)):
        check_float_param(name, t, (B, T, HV), "[B, T, HV]", device)
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias must be given together (fused gating) or both left None")
    if A_log is not None:
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            check_float_param(name, t, (HV,), "[HV]", device)
    check_scale(scale)
    if isinstance(cu_seqlens, bool):      # fla 0.6.0's positional order: its 9th argument is the l2norm flag
        raise ValueError(f"cu_seqlens must be a torch.Tensor or None, got {cu_seqlens}: fla 0.6.0's 9th positional "
                         "argument is use_qk_l2norm_in_kernel, this API's (and older fla's, vLLM's) is cu_seqlens; "
                         "pass the flags by keyword")
    check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens)
    if cu_seqlens is not None:
        N = check_cu_seqlens(cu_seqlens, B, T, device, values=offset_values)
    else:
        N = B
    if initial_state is not None:
        _need_tensor("initial_state", initial_state, 4)
        _need_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
        _need_float("initial_state", initial_state)
        _need_device("initial_state", initial_state, device)
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    return N


# fla 0.6.0's keywords beyond this API's (fla.ops.gated_delta_rule.chunk_gated_delta_rule's signature), so a call
# written for fla runs unchanged: keyword-only in both packages (fla's positional order differs after
# output_final_state: its 9th is use_qk_l2norm_in_kernel, this API's -- and vLLM's vendored fla's -- cu_seqlens)

def fla_keywords(q, v, beta, initial_state, A_log, dt_bias, cu_seqlens, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False, state_v_first=False, use_gate_in_kernel=None, chunk_indices=None,
                 cp_context=None, head_first=False) -> tuple:
    """fla 0.6.0's keyword arguments mapped onto this API's -> (beta, initial_state, A_log, dt_bias, state_v_first).
    Runs first in both packages' chunk_gated_delta_rule and recurrent_gated_delta_rule, so they mean the same.

    use_beta_sigmoid_in_kernel: beta holds logits [B, T, HV]; beta = sigmoid(beta) in float32 (float64 for float64
        logits), as fla's fused_beta_sigmoid, times 2 with allow_neg_eigval (beta in [0, 2): the transition
        I - beta k k^T may have eigenvalue -1 < 1 - beta < 0). allow_neg_eigval needs it, as in fla.
    state_v_first: initial_state is [N, HV, V, K] (S^T per head) and the final state comes back [N, HV, V, K],
        contiguous. initial_state is read in place through a transposed view; fast's kernels write the final state
        in that layout directly.
    use_gate_in_kernel: None (default): g is the raw gate input exactly when A_log is given (this API's rule);
        True: it is, A_log [HV] is required and dt_bias defaults to zeros; False: g is the log-decay and A_log /
        dt_bias are ignored (fla's meaning).
    chunk_indices: accepted (cu_seqlens required) and not read: the chunk tables come from cu_seqlens' checked
        values (fla takes it to skip building them).
    cp_context (context parallelism) is not supported; head_first must be False (vLLM's vendored fla passes it;
        [B, H, T, ...] inputs are refused, as fla refuses them).
    Raises ValueError naming the argument, before anything is computed. All at their defaults (every call not
    written for fla): the arguments come back as they are, at the cost of one comparison per keyword."""
    if (use_beta_sigmoid_in_kernel is False and allow_neg_eigval is False and state_v_first is False
            and use_gate_in_kernel is None and chunk_indices is None and cp_context is None and head_first is False):
        return beta, initial_state, A_log, dt_bias, False
    flags = dict(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 state_v_first=state_v_first, head_first=head_first)
    for name, f in flags.items():
        if type(f) is not bool:
            raise ValueError(f"{name} must be a bool, got {f!r}")
    if use_gate_in_kernel is not None and type(use_gate_in_kernel) is not bool:
        raise ValueError(f"use_gate_in_kernel must be None or a bool, got {use_gate_in_kernel!r}")
    if head_first:
        raise ValueError("head_first=True ([B, H, T, ...] inputs) is not supported (fla removed it too): pass q, k, "
                         "v as [B, T, H, K] / [B, T, HV, V] and g, beta as [B, T, HV]")
    if cp_context is not None:
        raise ValueError("cp_context (fla's context parallelism) is not supported: pass None")
    if chunk_indices is not None and cu_seqlens is None:
        raise ValueError("chunk_indices is for varlen calls: pass cu_seqlens with it (the chunk tables are built "
                         "from cu_seqlens' checked values; chunk_indices is not read)")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (beta = 2 sigmoid(beta))")
    if use_gate_in_kernel is False:
        A_log = dt_bias = None
    elif use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV] (g is then the raw gate input)")
        if dt_bias is None and isinstance(A_log, torch.Tensor):
            dt_bias = torch.zeros_like(A_log)
    if use_beta_sigmoid_in_kernel:
        _need_tensor("beta", beta)
        _need_float("beta", beta)
        logits = beta.to(torch.promote_types(beta.dtype, torch.float32))
        beta = torch.sigmoid(logits) * 2 if allow_neg_eigval else torch.sigmoid(logits)
    if state_v_first and initial_state is not None:
        _need_tensor("initial_state", initial_state, 4)
        if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4:
            want = (v.shape[2], v.shape[3], q.shape[3])
            if tuple(initial_state.shape[1:]) != want:
                raise ValueError(f"initial_state must have shape [N, HV, V, K] = [N, {want[0]}, {want[1]}, "
                                 f"{want[2]}] with state_v_first=True, got {_shape(initial_state)}")
        initial_state = initial_state.transpose(-1, -2)                 # [N, HV, V, K] -> [N, HV, K, V] (a view)
    return beta, initial_state, A_log, dt_bias, state_v_first


def fla_recurrent_arguments(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                            allow_neg_eigval, state_v_first, cu_seqlens) -> tuple:
    """fused_recurrent_gated_delta_rule's arguments (fla 0.6.0's order) -> (args, kwargs) of recurrent_gated_delta_rule,
    the one mapping both packages' fused_recurrent_gated_delta_rule (and fast.keys') use:

    g None: no decay (g = 0, [B, T, HV], float32 or float64 as v); beta None: ones [B, T, HV] in v's dtype (fla:
    ones_like(q[..., 0]), the same values where HV == H; logits too with use_beta_sigmoid_in_kernel, as in fla);
    gk / gv (fla's per-key / per-value decays) are refused: this gated delta rule decays per head. use_gate_in_kernel
    is fla's bool, and True needs g (the raw gate input). Shapes are left to the op's checks (no default is built
    from a v that is not a 4-D tensor). Raises ValueError naming the argument, before anything is computed."""
    for name, x in (("gk", gk), ("gv", gv)):
        if x is not None:
            raise ValueError(f"{name} (fla's per-{'key' if name == 'gk' else 'value'} decays) is not supported: the "
                             f"gated delta rule here decays per head; pass the log-decay g [B, T, HV] and {name}=None")
    if type(use_gate_in_kernel) is not bool:
        got = "a tensor" if isinstance(use_gate_in_kernel, torch.Tensor) else repr(use_gate_in_kernel)
        raise ValueError(f"use_gate_in_kernel must be a bool (fla's fused_recurrent_gated_delta_rule), got {got}")
    shaped = isinstance(v, torch.Tensor) and v.dim() == 4
    if g is None:
        if use_gate_in_kernel:
            raise ValueError("use_gate_in_kernel=True needs g, the raw gate input [B, T, HV]")
        if shaped:
            g = v.new_zeros(v.shape[:3], dtype=torch.promote_types(v.dtype, torch.float32))   # exp(0) = 1: no decay
    if beta is None and shaped:
        beta = v.new_ones(v.shape[:3])
    return ((q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log,
             dt_bias),
            dict(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 state_v_first=state_v_first, use_gate_in_kernel=use_gate_in_kernel))


def final_state_v_first(final: Optional[torch.Tensor], state_v_first: bool) -> Optional[torch.Tensor]:
    """The final state [N, HV, K, V] as state_v_first asks: [N, HV, V, K] contiguous (no copy when it already is,
    e.g. fast's final state written in that layout)."""
    if final is None or not state_v_first:
        return final
    return final.transpose(-1, -2).contiguous()


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or 'silu' (alias 'swish'), got {activation!r}")


def _check_weight_bias(weight, bias, D: int, device: torch.device) -> int:
    _need_tensor("weight", weight, 2)
    if weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [D, W] = [{D}, W] with W >= 1, got {_shape(weight)}")
    _need_float("weight", weight)
    _need_device("weight", weight, device)
    if bias is not None:
        check_float_param("bias", bias, (D,), "[D]", device)
    return weight.shape[1]


def check_conv_inputs(x, weight, bias=None, activation=None, initial_state=None, cu_seqlens=None,
                      cu_seqlens_cpu=None) -> int:
    """Validate causal_conv1d's arguments; return N, the number of sequences.

    x: [B, T, D]; weight: [D, W]; bias: [D]; initial_state: [N, D, W-1]; cu_seqlens: [N+1] with B == 1;
    cu_seqlens_cpu: its host copy (as check_gdn_inputs).
    """
    _need_tensor("x", x, 3)
    _need_float("x", x)
    B, T, D = x.shape
    W = _check_weight_bias(weight, bias, D, x.device)
    check_activation(activation)
    check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens)
    N = check_cu_seqlens(cu_seqlens, B, T, x.device) if cu_seqlens is not None else B
    if initial_state is not None:
        _need_tensor("initial_state", initial_state, 3)
        _need_shape("initial_state", initial_state, (N, D, W - 1), "[N, D, W-1]")
        _need_float("initial_state", initial_state)
        _need_device("initial_state", initial_state, x.device)
    return N


def check_conv_update_inputs(x, conv_state, weight, bias=None, activation=None) -> None:
    """Validate causal_conv1d_update: x: [N, D]; conv_state: [N, D, W-1]; weight: [D, W]; bias: [D]."""
    _need_tensor("x", x, 2)
    _need_float("x", x)
    N, D = x.shape
    W = _check_weight_bias(weight, bias, D, x.device)
    check_activation(activation)
    _need_tensor("conv_state", conv_state, 3)
    _need_float("conv_state", conv_state)
    _need_device("conv_state", conv_state, x.device)
    if conv_state.shape[0] != N or conv_state.shape[1] != D:
        raise ValueError(f"conv_state must have shape [N, D, W-1] = [{N}, {D}, {W - 1}], got {_shape(conv_state)}")
    if conv_state.shape[2] != W - 1:
        raise ValueError(f"conv_state's width must be W-1 = {W - 1} (weight is [D, W={W}]), "
                         f"got shape {_shape(conv_state)}")


NORM_GATES = ("swish", "silu", "sigmoid")


def _check_norm_common(x, weight, bias, eps) -> int:
    """The checks rms_norm and rms_norm_gated share: x [..., D] floating, D >= 1; weight, bias [D] or None; eps a
    finite real >= 0. Returns D."""
    _need_tensor("x", x)
    _need_float("x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape [..., D] with D >= 1, got {_shape(x)}")
    D = x.shape[-1]
    if weight is not None:
        check_float_param("weight", weight, (D,), "[D]", x.device)
    if bias is not None:
        check_float_param("bias", bias, (D,), "[D]", x.device)
    if (not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0):
        raise ValueError(f"eps must be a finite real number >= 0, got {eps!r}")
    return D


def check_rms_norm_gated_inputs(x, g, weight, bias=None, activation="swish", residual=None, prenorm=False,
                                residual_in_fp32=False, eps=1e-6) -> None:
    """Validate rms_norm_gated (fla's argument order): x, g: [..., D] of one shape, D >= 1; weight, bias: [D] or
    None; activation "swish" (alias "silu") or "sigmoid"; eps a finite real >= 0. fla's pre-norm residual add
    (residual, prenorm, residual_in_fp32) is refused unless left at None / False (rms_norm has it)."""
    _check_norm_common(x, weight, bias, eps)
    _need_tensor("g", g)
    _need_shape("g", g, x.shape, "[..., D] (same as x)")
    _need_float("g", g)
    _need_device("g", g, x.device)
    if activation not in NORM_GATES:
        raise ValueError(f"activation must be 'swish' (alias 'silu') or 'sigmoid', got {activation!r}")
    if residual is not None or prenorm or residual_in_fp32:
        raise ValueError("residual / prenorm / residual_in_fp32 (fla's pre-norm residual add) are not supported by "
                         "rms_norm_gated: leave them None / False and add the residual outside the norm")


def check_rms_norm_inputs(x, weight, bias=None, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False,
                          unit_offset=False) -> None:
    """Validate rms_norm (fla's argument order): x: [..., D], D >= 1; weight, bias: [D] or None; residual: x's shape
    (any floating dtype) or None; eps a finite real >= 0; prenorm, residual_in_fp32, unit_offset bools, unit_offset
    True only with a weight (the weight is then 1 + weight)."""
    _check_norm_common(x, weight, bias, eps)
    if residual is not None:
        _need_tensor("residual", residual)
        _need_shape("residual", residual, x.shape, "[..., D] (same as x)")
        _need_float("residual", residual)
        _need_device("residual", residual, x.device)
    for name, v in (("prenorm", prenorm), ("residual_in_fp32", residual_in_fp32), ("unit_offset", unit_offset)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    if unit_offset and weight is None:
        raise ValueError("unit_offset=True scales by 1 + weight: it needs a weight ([D]), got weight=None")


def check_gating_inputs(A_log, a, dt_bias, b) -> None:
    """Validate gdn_gating: A_log, dt_bias: [HV]; a, b: [..., HV] with the same shape."""
    for name, t in (("A_log", A_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        _need_tensor(name, t)
        _need_float(name, t)
        _need_device(name, t, a.device if isinstance(a, torch.Tensor) else t.device)
    if a.dim() < 1:
        raise ValueError(f"a must have shape [..., HV], got {_shape(a)}")
    HV = a.shape[-1]
    _need_shape("b", b, a.shape, "[..., HV] (same as a)")
    _need_shape("A_log", A_log, (HV,), "[HV]")
    _need_shape("dt_bias", dt_bias, (HV,), "[HV]")


# vLLM's serving form of the recurrent op (vllm.model_executor.layers.fla.ops.fused_recurrent_gated_delta_rule: a
# slot pool read and written in place, per-token slots for speculative decoding): refgdn.vllm_ops / fast.vllm_ops

def check_vk_states(name: str, states, q, v) -> None:
    """states [N, HV, V, K] (newer vLLM's layout: each head's state transposed), K from q [.., K], HV and V from
    v [.., HV, V]; the leading N and the rest are the op's own checks (on the [N, HV, K, V] view)."""
    _need_tensor(name, states, 4)
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4 and (
            tuple(states.shape[1:]) != (v.shape[2], v.shape[3], q.shape[3])):
        raise ValueError(f"{name} must be [N, HV, V, K] = [N, {v.shape[2]}, {v.shape[3]}, {q.shape[3]}] "
                         f"(state_layout 'vk'), got {_shape(states)}")


def check_vllm_recurrent_inputs(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
                                ssm_state_indices, num_accepted_tokens, retrieve_parent_token=None,
                                offset_values: bool = True, state_layout: str = "kv", null_block_id: int = -1) -> int:
    """Validate vLLM's fused_recurrent_gated_delta_rule arguments (shapes, dtypes, devices; beta already defaulted);
    return N, the number of sequences. The slot values are checked by :func:`vllm_recurrent_slots`, cu_seqlens'
    values here unless offset_values is False (a host read: fast's op skips it unless asked, so it can be captured
    in a CUDA graph, as vLLM's decode calls it).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; cu_seqlens: [N+1] with B == 1;
    ssm_state_indices None: initial_state [N, HV, K, V] or None; ssm_state_indices [N] or [N, L] int: initial_state
    is the slot pool [S, HV, K, V]; num_accepted_tokens [N] int, only with [N, L] indices. state_layout "vk": every
    state [.., HV, V, K] instead (newer vLLM's); null_block_id: an int >= -1 (entries <= it pad).
    """
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout must be 'kv' (states [.., HV, K, V]) or 'vk' ([.., HV, V, K], newer vLLM's), "
                         f"got {state_layout!r}")
    if isinstance(null_block_id, bool) or not isinstance(null_block_id, int) or null_block_id < -1:
        raise ValueError(f"null_block_id must be an int >= -1 (index entries <= it are padding: -1 negative ones, 0 "
                         f"newer vLLM's NULL_BLOCK_ID), got {null_block_id!r}")
    if retrieve_parent_token is not None:
        raise ValueError("retrieve_parent_token (vLLM's tree drafts) is not supported: pass None (drafts form one "
                         "chain per request; gdn_verify / gdn_accept are this package's speculative path)")
    if isinstance(beta, torch.Tensor) and isinstance(v, torch.Tensor) and beta.dim() == v.dim() == 4:
        raise ValueError(f"beta must be [B, T, HV] (one per token and value head), got {_shape(beta)}: vLLM's "
                         "head-wise beta [B, T, HV, V] is not supported")
    if not isinstance(inplace_final_state, bool):
        raise ValueError(f"inplace_final_state must be a bool, got {inplace_final_state!r}")
    N = check_gdn_inputs(q, k, v, g, beta, scale, None, cu_seqlens, offset_values=offset_values)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    dims, lay = ((HV, K, V), "[S, HV, K, V]") if state_layout == "kv" else ((HV, V, K), "[S, HV, V, K]")
    if ssm_state_indices is not None:
        _need_tensor("ssm_state_indices", ssm_state_indices)
        if ssm_state_indices.dim() not in (1, 2) or ssm_state_indices.shape[0] != N or (
                ssm_state_indices.dim() == 2 and ssm_state_indices.shape[1] < 1):
            raise ValueError(f"ssm_state_indices must be [N] or [N, L] with N = {N} sequences and L >= 1, got "
                             f"{_shape(ssm_state_indices)}")
        if ssm_state_indices.dtype not in INT_DTYPES:
            raise ValueError(f"ssm_state_indices must be int32 or int64, got {ssm_state_indices.dtype}")
        _need_device("ssm_state_indices", ssm_state_indices, device)
        if initial_state is None:
            raise ValueError(f"ssm_state_indices index the slot pool initial_state {lay}: pass initial_state")
        _need_tensor("initial_state", initial_state, 4)
        if tuple(initial_state.shape[1:]) != dims or initial_state.shape[0] < 1:
            raise ValueError(f"initial_state must be the slot pool {lay} = [S >= 1, {', '.join(map(str, dims))}], got "
                             f"{_shape(initial_state)}")
    elif initial_state is not None:
        _need_tensor("initial_state", initial_state, 4)
        _need_shape("initial_state", initial_state, (N, *dims), f"[N, {lay[4:]} (no ssm_state_indices)")
    if initial_state is not None:
        _need_float("initial_state", initial_state)
        _need_device("initial_state", initial_state, device)
    elif inplace_final_state:
        raise ValueError("inplace_final_state=True writes the states into initial_state: pass initial_state, or "
                         f"inplace_final_state=False for a new [B*T, {lay[4:]} tensor of every token's state")
    if num_accepted_tokens is not None:
        if ssm_state_indices is None or ssm_state_indices.dim() != 2:
            raise ValueError("num_accepted_tokens picks each request's slot column: it needs ssm_state_indices [N, L] "
                             "(one slot per token)")
        _need_tensor("num_accepted_tokens", num_accepted_tokens)
        if tuple(num_accepted_tokens.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must have shape [N] = [{N}], got {_shape(num_accepted_tokens)}")
        if num_accepted_tokens.dtype not in INT_DTYPES:
            raise ValueError(f"num_accepted_tokens must be int32 or int64, got {num_accepted_tokens.dtype}")
        _need_device("num_accepted_tokens", num_accepted_tokens, device)
    return N


def vllm_recurrent_slots(B: int, T: int, cu_seqlens, ssm_state_indices, num_accepted_tokens, inplace: bool,
                         num_slots: Optional[int], null_block_id: int = -1
                         ) -> List[Tuple[int, int, Optional[int], List[Optional[int]]]]:
    """Where each sequence of vLLM's recurrent op reads and writes its state, from the values (a host read):
    [(bos, eos, read, writes)] per sequence, tokens [bos, eos) of the flattened [B * T] token axis.

    read: the row of initial_state the state starts from (None: zeros, no initial_state), -1 for a padded sequence
    (a read entry <= null_block_id: it reads and writes nothing, its outputs are zeros). writes (inplace only): per
    token, the row of initial_state its state goes to, or None (an entry <= null_block_id); with [N] indices or none,
    only the last token's (the final state).
    Raises ValueError (naming the argument and the entry) for a slot >= num_slots, a num_accepted_tokens entry
    outside [1, L], [N, L] indices with fewer than T_n columns, or a slot written by two sequences, or written by
    one and read by another (the sequences run concurrently in a kernel)."""
    if cu_seqlens is None:
        spans = [(n * T, n * T + T) for n in range(B)]
    else:
        offs = host_offsets(cu_seqlens)
        spans = list(zip(offs, offs[1:]))
    idx = None if ssm_state_indices is None else ssm_state_indices.tolist()        # host read: value checks
    acc = None if num_accepted_tokens is None else num_accepted_tokens.tolist()
    out, written, read_by = [], {}, {}
    for n, (bos, eos) in enumerate(spans):
        if idx is None:
            read = n if num_slots is not None else None
            row = [n]
        else:
            row = idx[n] if isinstance(idx[n], list) else [idx[n]]
            col = 0
            if acc is not None:
                if not 1 <= acc[n] <= len(row):
                    raise ValueError(f"num_accepted_tokens[{n}] = {acc[n]} must be in [1, L = {len(row)}]")
                col = acc[n] - 1
            read = row[col]
            for j, s in enumerate(row):
                if s >= num_slots:
                    at = f"{n}, {j}" if isinstance(idx[n], list) else f"{n}"
                    raise ValueError(f"ssm_state_indices[{at}] = {s} is out of range for initial_state's {num_slots} "
                                     "slots")
            if read <= null_block_id:
                out.append((bos, eos, -1, [None] * (eos - bos)))
                continue
        writes: List[Optional[int]] = [None] * (eos - bos)
        if inplace and eos > bos:
            if idx is not None and isinstance(idx[n], list):
                if eos - bos > len(row):
                    raise ValueError(f"sequence {n} has {eos - bos} tokens but ssm_state_indices [N, L] gives it "
                                     f"L = {len(row)} slots: one per token's state")
                writes = [s if s > null_block_id else None for s in row[:eos - bos]]
            else:
                writes[-1] = read
        for s in set(w for w in writes if w is not None):
            if written.setdefault(s, n) != n:
                raise ValueError(f"slot {s} is written by sequences {written[s]} and {n}")
        if read is not None:
            read_by.setdefault(read, []).append(n)
        out.append((bos, eos, read, writes))
    for s, n in written.items():
        for m in read_by.get(s, ()):
            if m != n:
                raise ValueError(f"slot {s} is read by sequence {m} and written by sequence {n}")
    return out


def check_vllm_packed_decode_inputs(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                                    use_qk_l2norm_in_kernel) -> Tuple[int, int, int, int, int]:
    """Validate vLLM's fused_recurrent_gated_delta_rule_packed_decode arguments (shapes, dtypes, devices; the slot
    values are :func:`vllm_packed_decode_slots`'); return (B, H, HV, K, V).

    initial_state: the slot pool in vLLM's layout [S, HV, V, K] (each head's state transposed); mixed_qkv: [B, 2 H K
    + HV V], each row q | k | v of one request (H read from its width); a, b: [B, HV]; A_log, dt_bias: [HV]; out:
    [B, 1, HV, V] contiguous (written in place); ssm_state_indices: [B] int.
    """
    _need_tensor("initial_state", initial_state, 4)
    _need_float("initial_state", initial_state)
    if initial_state.shape[0] < 1 or min(initial_state.shape[1:]) < 1:
        raise ValueError(f"initial_state must be the slot pool [S, HV, V, K] with every size >= 1 (vLLM's layout), "
                         f"got {_shape(initial_state)}")
    HV, V, K = initial_state.shape[1:]
    device = initial_state.device
    _need_tensor("mixed_qkv", mixed_qkv, 2)
    _need_float("mixed_qkv", mixed_qkv)
    _need_device("mixed_qkv", mixed_qkv, device)
    B, width = mixed_qkv.shape
    qk = width - HV * V
    if qk <= 0 or qk % (2 * K):
        raise ValueError(f"mixed_qkv must be [B, 2 H K + HV V] (q | k | v per row; HV = {HV}, V = {V}, K = {K} from "
                         f"initial_state [S, HV, V, K]), got {_shape(mixed_qkv)}")
    H = qk // (2 * K)
    if HV % H:
        raise ValueError(f"mixed_qkv's width gives H = {H} query/key heads, which must divide HV = {HV} (value heads "
                         f"of initial_state [S, HV, V, K]), got {_shape(mixed_qkv)}")
    for name, t in (("a", a), ("b", b)):
        check_float_param(name, t, (B, HV), "[B, HV]", device)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_float_param(name, t, (HV,), "[HV]", device)
    check_float_param("out", out, (B, 1, HV, V), "[B, 1, HV, V]", device)
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (written in place as [B, 1, HV, V]), got strides {out.stride()}")
    check_index_vector("ssm_state_indices", ssm_state_indices, B, device)
    check_scale(scale)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise ValueError(f"use_qk_l2norm_in_kernel must be a bool, got {use_qk_l2norm_in_kernel!r}")
    return B, H, HV, K, V


def check_vllm_post_conv_inputs(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, apply_l2norm,
                                output_g_exp) -> Tuple[int, int, int, int, int]:
    """Validate vLLM's fused_post_conv_prep arguments (shapes, dtypes, devices); return (L, H, HV, K, V).

    conv_output: [L, 2 H K + HV V] (the conv's packed q | k | v rows); a, b: [L, HV]; A_log, dt_bias: [HV] (HV from
    A_log); num_k_heads H, head_k_dim K, head_v_dim V: ints >= 1; apply_l2norm, output_g_exp: bools.
    """
    for name, val in (("num_k_heads", num_k_heads), ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    for name, val in (("apply_l2norm", apply_l2norm), ("output_g_exp", output_g_exp)):
        if not isinstance(val, bool):
            raise ValueError(f"{name} must be a bool, got {val!r}")
    _need_tensor("conv_output", conv_output, 2)
    _need_float("conv_output", conv_output)
    device = conv_output.device
    _need_tensor("A_log", A_log, 1)
    H, HV, K, V = num_k_heads, A_log.shape[0], head_k_dim, head_v_dim
    if HV < 1:
        raise ValueError(f"A_log must be [HV] with HV >= 1 value heads, got {_shape(A_log)}")
    L, width = conv_output.shape
    if width != 2 * H * K + HV * V:
        raise ValueError(f"conv_output must be [L, 2 H K + HV V] = [L, {2 * H * K + HV * V}] (q | k | v per row; H = "
                         f"{H}, K = {K}, V = {V}, HV = {HV} from A_log), got {_shape(conv_output)}")
    for name, t in (("a", a), ("b", b)):
        check_float_param(name, t, (L, HV), "[L, HV]", device)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_float_param(name, t, (HV,), "[HV]", device)
    return L, H, HV, K, V


def _one_slot_each(name: str, indices: torch.Tensor, num_slots: int, lowest: int, padded: str, who: str,
                   writes: bool = True) -> List[int]:
    """indices' values (a host read): entries below ``lowest`` pad their row (``padded`` says how); raises ValueError
    naming the entry for a slot >= num_slots, or (writes) a slot given to two rows (``who``: "requests", ...)."""
    slots = indices.tolist()                                    # host read: value checks
    owner = {}
    for n, s in enumerate(slots):
        if s >= num_slots:
            raise ValueError(f"{name}[{n}] = {s} is outside the pool's {num_slots} slots ({padded})")
        if writes and s >= lowest and owner.setdefault(s, n) != n:
            raise ValueError(f"slot {s} is given to {who} {owner[s]} and {n} ({name})")
    return slots


def vllm_packed_decode_slots(ssm_state_indices: torch.Tensor, num_slots: int) -> List[int]:
    """The slot of each request of vLLM's packed decode, from the values (a host read): entries <= 0 are vLLM's null
    block (a padded request: output zeros, nothing read or written). Raises ValueError naming the entry for a slot >=
    num_slots or a slot given to two requests."""
    return _one_slot_each("ssm_state_indices", ssm_state_indices, num_slots, 1,
                          "entries <= 0: the null block, a padded request", "requests")


def check_vllm_gating_arguments(a, beta, threshold) -> None:
    """vLLM's fused_gdn_gating(A_log, a, b, dt_bias, beta=1.0, threshold=20.0): a is [N, HV] or [B, T, HV]; softplus'
    beta and threshold only at the values every Qwen3-Next caller passes (this package's softplus is log(1 + e^x),
    x itself above 20)."""
    if isinstance(a, torch.Tensor) and a.dim() not in (2, 3):
        raise ValueError(f"a must be [N, HV] or [B, T, HV] (vLLM's fused_gdn_gating), got {_shape(a)}")
    if beta != 1.0:
        raise ValueError(f"beta (softplus' sharpness) must be 1.0, got {beta!r}: other values are not supported")
    if threshold != 20.0:
        raise ValueError(f"threshold (softplus' linear cut-off) must be 20.0, got {threshold!r}: other values are not "
                         "supported")


def _check_vllm_conv_common(x, D: int, weight, bias, activation, state_name: str, states, pad_slot_id) -> int:
    """What vLLM's two conv ops check alike (x floating with D channels, weight [D, W >= 2], bias, activation, the state
    rows [S, D, C >= W - 1], pad_slot_id); returns W."""
    _need_float("x", x)
    W = _check_weight_bias(weight, bias, D, x.device)
    if W < 2:
        raise ValueError(f"weight must be [D, W] with W >= 2 (a window of W - 1 past inputs), got {_shape(weight)}")
    if not isinstance(activation, bool):
        check_activation(activation)
    _need_tensor(state_name, states, 3)
    _need_float(state_name, states)
    _need_device(state_name, states, x.device)
    if states.shape[1] != D or states.shape[2] < W - 1 or states.shape[0] < 1:
        raise ValueError(f"{state_name} must be [S, D, C] = [S >= 1, {D}, C >= W-1 = {W - 1}], got "
                         f"{_shape(states)}")
    if not isinstance(pad_slot_id, numbers.Integral) or isinstance(pad_slot_id, bool):
        raise ValueError(f"pad_slot_id must be an int, got {pad_slot_id!r}")
    return W


def check_vllm_conv_update_inputs(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                                  query_start_loc, max_query_len, pad_slot_id, offset_values: bool = True) -> tuple:
    """Validate vLLM's causal_conv1d_update arguments (shapes, dtypes, devices; query_start_loc's values unless
    offset_values is False). Returns (B, D, W, L): requests, channels, conv width, tokens per request (None: varlen).

    x: [B, D] (one token each), [B, D, L] or [T, D] with query_start_loc [B+1] (then conv_state_indices is required);
    conv_state: [S, D, C] with C >= W - 1; weight: [D, W] with W >= 2; conv_state_indices, num_accepted_tokens: [B]
    int; activation None / "silu" / "swish" / a bool (True: silu); pad_slot_id an int.
    """
    _need_tensor("x", x)
    if x.dim() not in (2, 3) or (query_start_loc is not None and x.dim() != 2):
        raise ValueError(f"x must be [B, D], [B, D, L] or (with query_start_loc) [T, D], got {_shape(x)}")
    D = x.shape[1]
    W = _check_vllm_conv_common(x, D, weight, bias, activation, "conv_state", conv_state, pad_slot_id)
    if not isinstance(max_query_len, numbers.Integral) or isinstance(max_query_len, bool):
        raise ValueError(f"max_query_len must be an int, got {max_query_len!r}")
    if query_start_loc is not None:
        if conv_state_indices is None:
            raise ValueError("query_start_loc (varlen x [T, D]) needs conv_state_indices [B]")
        B = check_cu_seqlens(query_start_loc, 1, x.shape[0], x.device, "query_start_loc", values=offset_values)
        L = None
    else:
        B = x.shape[0]
        L = 1 if x.dim() == 2 else x.shape[2]
        if conv_state_indices is None and conv_state.shape[0] < B:
            raise ValueError(f"conv_state has {conv_state.shape[0]} rows for B = {B} requests (no conv_state_indices: "
                             "request b uses row b)")
    for name, t in (("conv_state_indices", conv_state_indices), ("num_accepted_tokens", num_accepted_tokens)):
        if t is not None:
            check_index_vector(name, t, B, x.device)
    return B, D, W, L


def vllm_conv_update_rows(B: int, L: Optional[int], query_start_loc, conv_state_indices, num_accepted_tokens,
                          pad_slot_id: int, S: int, C: int, W: int) -> List[Tuple[int, int, int, int]]:
    """Each request of vLLM's causal_conv1d_update from the values (a host read): [(bos, eos, slot, offset)], tokens
    [bos, eos) (of x's token axis: its third dim, or the packed first one with query_start_loc), slot -1 for a padded
    request (pad_slot_id or negative: no output, nothing written), offset the state column its window starts at
    (num_accepted_tokens - 1, else 0). Raises ValueError for a slot >= S, an offset whose window or new state
    (W - 2 + L_n columns) passes C, or a slot used by two requests."""
    if query_start_loc is None:
        spans = [(0, L)] * B
    else:
        offs = host_offsets(query_start_loc)
        spans = list(zip(offs, offs[1:]))
    idx = list(range(B)) if conv_state_indices is None else conv_state_indices.tolist()
    acc = None if num_accepted_tokens is None else num_accepted_tokens.tolist()
    out, used = [], {}
    for b, (bos, eos) in enumerate(spans):
        s = idx[b]
        if s == pad_slot_id or s < 0:
            out.append((bos, eos, -1, 0))
            continue
        if s >= S:
            raise ValueError(f"conv_state_indices[{b}] = {s} is out of range for conv_state's {S} rows")
        if used.setdefault(s, b) != b:
            raise ValueError(f"conv_state row {s} is used by requests {used[s]} and {b}")
        off = 0
        if acc is not None:
            if not 1 <= acc[b] <= C - W + 2:
                raise ValueError(f"num_accepted_tokens[{b}] = {acc[b]} must be in [1, C - W + 2 = {C - W + 2}] (the "
                                 "window starts at column num_accepted_tokens - 1)")
            off = acc[b] - 1
            if W - 2 + (eos - bos) > C:
                raise ValueError(f"request {b} has {eos - bos} tokens: its new state (W - 2 + L = "
                                 f"{W - 2 + eos - bos} columns) does not fit conv_state's C = {C}")
        out.append((bos, eos, s, off))
    return out


def check_vllm_conv_refusals(block_idx_last_scheduled_token, initial_state_idx, retrieve_parent_token) -> None:
    """vLLM's causal_conv1d_update arguments this package does not support, refused by name when given."""
    for name, val, what in (("block_idx_last_scheduled_token", block_idx_last_scheduled_token, "prefix caching"),
                            ("initial_state_idx", initial_state_idx, "prefix caching"),
                            ("retrieve_parent_token", retrieve_parent_token, "tree drafts")):
        if val is not None:
            raise ValueError(f"{name} (vLLM's {what}) is not supported: pass None")


def check_vllm_conv_fn_inputs(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                              activation, pad_slot_id, offset_values: bool = True) -> tuple:
    """Validate vLLM's causal_conv1d_fn arguments (shapes, dtypes, devices and, with offset_values, query_start_loc's
    values: a host read). Returns (B, D, W): requests, channels, conv width.

    x: [D, T] (vLLM passes mixed_qkv.transpose(0, 1)); weight: [D, W], W >= 2; bias: [D]; conv_states: [S, D, C] with
    C >= W - 1; query_start_loc: [B+1]; cache_indices: [B] int or None (request b uses row b); has_initial_state: [B]
    bool or None (no request continues)."""
    _need_tensor("x", x, 2)
    D, T = x.shape
    W = _check_vllm_conv_common(x, D, weight, bias, activation, "conv_states", conv_states, pad_slot_id)
    B = check_cu_seqlens(query_start_loc, 1, T, x.device, "query_start_loc", values=offset_values)
    if cache_indices is None and conv_states.shape[0] < B:
        raise ValueError(f"conv_states has {conv_states.shape[0]} rows for B = {B} requests (no cache_indices: request "
                         "b uses row b)")
    if cache_indices is not None:
        check_index_vector("cache_indices", cache_indices, B, x.device)
    if has_initial_state is not None:
        _need_tensor("has_initial_state", has_initial_state)
        if tuple(has_initial_state.shape) != (B,) or has_initial_state.dtype != torch.bool:
            raise ValueError(f"has_initial_state must be a bool tensor [B] = [{B}], got {has_initial_state.dtype} "
                             f"{_shape(has_initial_state)}")
        _need_device("has_initial_state", has_initial_state, x.device)
    return B, D, W


def vllm_conv_fn_rows(B: int, cache_indices, pad_slot_id: int, S: int) -> List[int]:
    """Each request's conv_states row for vLLM's causal_conv1d_fn from the values (a host read): -1 for a padded request
    (pad_slot_id or negative). Raises ValueError for a row >= S or a row used by two requests."""
    idx = list(range(B)) if cache_indices is None else cache_indices.tolist()
    used = {}
    out = []
    for b, s in enumerate(idx):
        if s == pad_slot_id or s < 0:
            out.append(-1)
            continue
        if s >= S:
            raise ValueError(f"cache_indices[{b}] = {s} is out of range for conv_states' {S} rows")
        if used.setdefault(s, b) != b:
            raise ValueError(f"conv_states row {s} is used by requests {used[s]} and {b}")
        out.append(s)
    return out


def check_vllm_conv_fn_refusals(block_idx_first_scheduled_token, block_idx_last_scheduled_token, initial_state_idx,
                                num_computed_tokens, block_size_to_align) -> None:
    """vLLM's causal_conv1d_fn prefix-caching arguments, refused by name when given."""
    for name, val in (("block_idx_first_scheduled_token", block_idx_first_scheduled_token),
                      ("block_idx_last_scheduled_token", block_idx_last_scheduled_token),
                      ("initial_state_idx", initial_state_idx), ("num_computed_tokens", num_computed_tokens)):
        if val is not None:
            raise ValueError(f"{name} (vLLM's prefix caching) is not supported: pass None")
    if block_size_to_align not in (0, None):
        raise ValueError(f"block_size_to_align (vLLM's prefix caching) is not supported: pass 0, got "
                         f"{block_size_to_align!r}")


# SGLang's fused decode op (sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent, also in AMD's aiter and
# TensorRT-LLM): refgdn.sglang_ops / fast.sglang_ops

def _raw_gate_views(q, v, a, b) -> List[torch.Tensor]:
    """The raw gate projections a, b [B, T, HV] or [B * T, HV] (B, T from q [B, T, H, K], HV from v) as [B, T, HV]
    views; ValueError naming the argument otherwise."""
    _need_tensor("q", q, 4)
    _need_tensor("v", v, 4)
    B, T = q.shape[:2]
    HV = v.shape[2]
    views = []
    for name, t in (("a", a), ("b", b)):
        _need_tensor(name, t)
        if t.dim() == 2 and tuple(t.shape) == (B * T, HV):
            t = t.view(B, T, HV) if t.is_contiguous() else t.unflatten(0, (B, T))
        elif tuple(t.shape) != (B, T, HV):
            raise ValueError(f"{name} must have shape [B, T, HV] = [{B}, {T}, {HV}] or [B * T, HV] = [{B * T}, {HV}], "
                             f"got {_shape(t)}")
        _need_float(name, t)
        views.append(t)
    return views


def check_vllm_sigmoid_gating_inputs(A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state,
                                     inplace_final_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                                     use_qk_l2norm_in_kernel, is_kda, offset_values: bool = True):
    """Validate newer vLLM's fused_sigmoid_gating_delta_rule_update arguments (shapes, dtypes, devices; the slot values
    are :func:`vllm_recurrent_slots`' with null_block_id 0); return (N, a, b) with a, b as [B, T, HV] views.

    A_log, dt_bias: [HV]; a, b: [B, T, HV] or [B * T, HV]; q, k, v, initial_state and the rest as
    :func:`check_vllm_recurrent_inputs` with state_layout "vk" (states [.., HV, V, K]); beta, threshold: softplus'
    (1.0, 20.0 only); is_kda False (KDA's per-channel gates are refused by name).
    """
    if is_kda is not False:
        raise ValueError(f"is_kda must be False, got {is_kda!r}: KDA's per-channel gates are not supported")
    check_vllm_gating_arguments(None, beta, threshold)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise ValueError(f"use_qk_l2norm_in_kernel must be a bool, got {use_qk_l2norm_in_kernel!r}")
    a3, b3 = _raw_gate_views(q, v, a, b)
    N = check_vllm_recurrent_inputs(q, k, v, a3, b3, scale, initial_state, inplace_final_state, cu_seqlens,
                                    ssm_state_indices, num_accepted_tokens, None, offset_values, "vk", 0)
    HV = v.shape[2]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_float_param(name, t, (HV,), "[HV]", q.device)
    return N, a3, b3


def need_step_buffer(buf, rows: int, steps: int, state: tuple, device: torch.device, contract: str, steps_name: str,
                     note: str) -> None:
    """An MTP verify's intermediate_states_buffer (SGLang's, FlashInfer's): a floating [C >= rows, S >= steps, *state]
    tensor on ``device`` whose rows are [S, *state] blocks one after another (the kernels address row r's step j as
    row r * S + j of the buffer's first two dims merged), else ValueError naming it with ``contract``."""
    name = "intermediate_states_buffer"
    _need_tensor(name, buf, 2 + len(state))
    if buf.shape[0] < max(rows, 1) or buf.shape[1] < max(steps, 1) or tuple(buf.shape[2:]) != tuple(state):
        want = ", ".join([f"C >= {max(rows, 1)}", f"{steps_name} >= {max(steps, 1)}"] + [str(d) for d in state])
        raise ValueError(f"{name} must be {contract} = [{want}]{note}, got {_shape(buf)}")
    if buf.stride(0) != buf.shape[1] * buf.stride(1):
        raise ValueError(f"{name}'s rows must be [{steps_name}, HV, V, K] blocks one after another (stride(0) = "
                         f"{steps_name} * stride(1)), got strides {buf.stride()}")
    _need_float(name, buf)
    _need_device(name, buf, device)


def check_sglang_decode_inputs(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
                               initial_state_indices, scale, use_qk_l2norm_in_kernel, cu_seqlens, is_kda,
                               disable_state_update, intermediate_states_buffer, intermediate_state_indices,
                               cache_steps, retrieve_parent_token, offset_values: bool = True):
    """Validate SGLang's fused_sigmoid_gating_delta_rule_update arguments (shapes, dtypes, devices; the slots' values
    are :func:`sglang_decode_slots`'); return (N, a, b, steps) with a, b as [B, T, HV] views and steps the cache's
    steps per row (0 without intermediate_states_buffer).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; a, b: [B, T, HV] or [B * T, HV]; A_log, dt_bias: [HV]; cu_seqlens: [N+1]
    with B == 1; initial_state_source: the slot pool [S, HV, V, K] (each head's state transposed, as SGLang stores
    it); initial_state_indices: [N] int. Target verify: intermediate_states_buffer [C, steps, HV, V, K] (its first two
    dims mergeable into one), intermediate_state_indices [N] int or None (row n), cache_steps None or steps, with
    disable_state_update=True (SGLang's verify never commits). Refused by name: the KDA form, tree drafts
    (retrieve_parent_token), softplus parameters other than (1.0, 20.0)."""
    if is_kda:
        raise ValueError("is_kda=True (Kimi Delta Attention's per-channel gates) is not supported: pass False")
    if retrieve_parent_token is not None:
        raise ValueError("retrieve_parent_token (SGLang's tree drafts) is not supported: pass None (drafts form one "
                         "chain per request)")
    if intermediate_states_buffer is None and (intermediate_state_indices is not None or cache_steps is not None):
        raise ValueError("intermediate_state_indices / cache_steps describe intermediate_states_buffer: pass it too, "
                         "or neither")
    if softplus_beta != 1.0:
        raise ValueError(f"softplus_beta must be 1.0, got {softplus_beta!r}: other values are not supported")
    if softplus_threshold != 20.0:
        raise ValueError(f"softplus_threshold must be 20.0, got {softplus_threshold!r}: other values are not supported")
    for name, flag in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                       ("disable_state_update", disable_state_update)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    views = _raw_gate_views(q, v, a, b)
    HV = v.shape[2]
    N = check_gdn_inputs(q, k, v, views[0], views[1], scale, None, cu_seqlens, A_log, dt_bias,
                         offset_values=offset_values)
    K, V = q.shape[3], v.shape[3]
    _need_tensor("initial_state_source", initial_state_source, 4)
    if tuple(initial_state_source.shape[1:]) != (HV, V, K) or initial_state_source.shape[0] < 1:
        raise ValueError(f"initial_state_source must be the slot pool [S, HV, V, K] = [S >= 1, {HV}, {V}, {K}] "
                         f"(SGLang's layout: each head's state transposed), got {_shape(initial_state_source)}")
    _need_float("initial_state_source", initial_state_source)
    _need_device("initial_state_source", initial_state_source, q.device)
    check_index_vector("initial_state_indices", initial_state_indices, N, q.device)
    steps = 0
    buf = intermediate_states_buffer
    if buf is not None:
        need_step_buffer(buf, 1, 1, (HV, V, K), q.device, "[C, steps, HV, V, K]", "steps", "")
        steps = buf.shape[1]
        if cache_steps is not None and (isinstance(cache_steps, bool) or cache_steps != steps):
            raise ValueError(f"cache_steps must be intermediate_states_buffer's steps per row ({steps}) or None, got "
                             f"{cache_steps!r}")
        if intermediate_state_indices is not None:
            check_index_vector("intermediate_state_indices", intermediate_state_indices, N, q.device)
        if not disable_state_update:
            raise ValueError("intermediate_states_buffer (SGLang's target verify) needs disable_state_update=True: the "
                             "verify keeps every step's state there and commits nothing")
    return N, views[0], views[1], steps


def sglang_decode_slots(initial_state_indices: torch.Tensor, num_slots: int, writes: bool) -> List[int]:
    """Each sequence's slot, from the values (a host read): a negative entry starts its sequence from a zero state
    and writes nothing (SGLang's padding); raises ValueError naming the entry for a slot >= num_slots, or (writes) a
    slot given to two sequences."""
    return _one_slot_each("initial_state_indices", initial_state_indices, num_slots, 0, "negative: a padded sequence",
                          "sequences", writes)


def sglang_cache_rows(intermediate_state_indices, N: int, num_rows: int, steps: int, lengths: List[int]) -> List[int]:
    """Each sequence's row of SGLang's intermediate_states_buffer, from the values (a host read; None: row n):
    negative, none. Raises ValueError naming the entry for a row >= num_rows, a row given to two sequences, or a
    sequence with more tokens than the buffer's steps per row."""
    rows = list(range(N)) if intermediate_state_indices is None else _one_slot_each(
        "intermediate_state_indices", intermediate_state_indices, num_rows, 0, "negative: no cache row", "sequences")
    if intermediate_state_indices is None and N > num_rows:
        raise ValueError(f"intermediate_states_buffer has {num_rows} rows for {N} sequences (row n for sequence n)")
    for n, (r, length) in enumerate(zip(rows, lengths)):
        if r >= 0 and length > steps:
            raise ValueError(f"sequence {n} has {length} tokens but intermediate_states_buffer keeps {steps} steps")
    return rows


# ----------------------------------------------------------------------------------------------
# FlashInfer's GDN API (refgdn.flashinfer_ops, fast.flashinfer_ops)
# ----------------------------------------------------------------------------------------------

def _need_bool(name: str, flag) -> None:
    if not isinstance(flag, bool):
        raise ValueError(f"{name} must be a bool, got {flag!r}")


def flashinfer_heads(Hq: int, Hk: int, Hv: int) -> int:
    """FlashInfer's two head layouts: GQA (num_q_heads a multiple of num_k_heads = num_v_heads) or GVA (num_v_heads a
    multiple of num_q_heads = num_k_heads); returns num_sab_heads = max(Hq, Hv), the heads of g, beta, o and the
    states. ValueError otherwise."""
    gqa = Hk == Hv and Hv > 0 and Hq % Hv == 0
    gva = Hq == Hk and Hq > 0 and Hv % Hq == 0
    if not (gqa or gva):
        raise ValueError(f"q, k, v heads ({Hq}, {Hk}, {Hv}) must be GQA (num_q_heads a multiple of num_k_heads = "
                         f"num_v_heads) or GVA (num_v_heads a multiple of num_q_heads = num_k_heads)")
    return max(Hq, Hv)


def check_flashinfer_prefill_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                    use_qk_l2norm_in_kernel, output, output_state, state_checkpoints,
                                    checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp,
                                    offset_values: bool = True) -> Tuple[int, int]:
    """Validate FlashInfer's chunk_gated_delta_rule (flashinfer.gdn_prefill) arguments; return (N, num_sab_heads).

    q: [T, Hq, K]   k: [T, Hk, K]   v: [T, Hv, V] (packed tokens; GQA or GVA: flashinfer_heads)   g (alpha, the
    decay itself), beta: [T, sab] floating or None   cu_seqlens: [N+1] int (required)   initial_state, output_state:
    [N, sab, V, K] floating   output: [T, sab, V] in q's dtype, no byte shared with an input. State checkpoints
    (checkpoint_every_n_tokens: a multiple of 64): state_checkpoints [R, sab, V, K] floating, checkpoint_cu_starts
    [N+1] int (values: flashinfer_checkpoint_rows). offset_values=False: cu_seqlens' values are the caller's to check
    (fast reads them only when asked)."""
    every = checkpoint_every_n_tokens
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 0 or every % 64:
        raise ValueError(f"checkpoint_every_n_tokens must be 0 or a positive multiple of the chunk size 64, got "
                         f"{every!r}")
    if (every > 0) != (state_checkpoints is not None) or (every > 0) != (checkpoint_cu_starts is not None):
        raise ValueError("state_checkpoints and checkpoint_cu_starts must both be given with checkpoint_every_n_tokens"
                         " > 0, and both be None with 0")
    _need_bool("output_final_state", output_final_state)
    _need_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    _need_bool("use_cp", use_cp)
    if cu_seqlens is None:
        raise ValueError("cu_seqlens must be given ([N+1] int: FlashInfer's prefill takes packed tokens only)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _need_tensor(name, t, 3)
        _need_float(name, t)
    T, Hq, K = q.shape
    Hk, Hv, V = k.shape[1], v.shape[1], v.shape[2]
    if k.shape[0] != T or v.shape[0] != T or k.shape[2] != K:
        raise ValueError(f"q, k, v must be [T, Hq, K], [T, Hk, K], [T, Hv, V] with one T and K, got {_shape(q)}, "
                         f"{_shape(k)}, {_shape(v)}")
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K={K} (q) and V={V} (v)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    sab = flashinfer_heads(Hq, Hk, Hv)
    device = q.device
    _need_device("k", k, device)
    _need_device("v", v, device)
    for name, t in (("g", g), ("beta", beta)):
        if t is not None:
            check_float_param(name, t, (T, sab), "[T, num_sab_heads]", device)
    check_scale(scale)
    N = check_cu_seqlens(cu_seqlens, 1, T, device, values=offset_values)
    for name, t in (("initial_state", initial_state), ("output_state", output_state)):
        if t is not None:
            check_float_param(name, t, (N, sab, V, K), "[N, num_sab_heads, V, K]", device)
    if every:
        _need_tensor("state_checkpoints", state_checkpoints, 4)
        if tuple(state_checkpoints.shape[1:]) != (sab, V, K):
            raise ValueError(f"state_checkpoints must be [R, num_sab_heads, V, K] = [R, {sab}, {V}, {K}], got "
                             f"{_shape(state_checkpoints)}")
        _need_float("state_checkpoints", state_checkpoints)
        _need_device("state_checkpoints", state_checkpoints, device)
        check_index_vector("checkpoint_cu_starts", checkpoint_cu_starts, N + 1, device)
    if output is not None:
        _need_tensor("output", output, 3)
        if tuple(output.shape) != (T, sab, V) or output.dtype != q.dtype or output.device != device:
            raise ValueError(f"output must be [T, num_sab_heads, V] = [{T}, {sab}, {V}] in q's dtype {q.dtype} on "
                             f"{device}, got {_shape(output)} {output.dtype} on {output.device}")
    return N, sab


def check_flashinfer_outputs_disjoint(output, output_state, inputs: tuple, state_checkpoints=None) -> None:
    """output / output_state / state_checkpoints (written by kernels while others read the inputs) share no byte with
    the inputs ((name, tensor) pairs) nor with each other. Per call: addresses are no part of a call's signature."""
    if output is not None:
        need_disjoint("output", output, inputs + (("output_state", output_state),
                                                  ("state_checkpoints", state_checkpoints)))
    if output_state is not None:
        need_disjoint("output_state", output_state, inputs + (("state_checkpoints", state_checkpoints),))
    if state_checkpoints is not None:
        need_disjoint("state_checkpoints", state_checkpoints, inputs)


def check_flashinfer_decode_inputs(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm,
                                   initial_state, initial_state_indices, output_state_indices,
                                   intermediate_states_buffer, disable_state_update, ssm_state_indices=None,
                                   state_layout: str = "vk") -> Tuple[int, int, int]:
    """Validate FlashInfer's GDN decode arguments (gated_delta_rule_decode_pretranspose / _decode / _mtp); return
    (B, T, rows), rows the states the pool holds (B for a per-batch ``state``).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   a, b: [B, T, HV] (the raw gate projections)   A_log, dt_bias: [HV]
    state: [B, HV, V, K] ("vk", FlashInfer's pretranspose layout) or [B, HV, K, V] ("kv"), or the pool initial_state
    [P, HV, V, K] with initial_state_indices [B] int (negative: a padded row) and output_state_indices [B] int or None;
    intermediate_states_buffer: [C >= B, T', HV, V, K] with T' >= T (row n for batch row n), for T > 1 only, like
    disable_state_update=True; output: [B, T, HV, V] floating; ssm_state_indices: [B, T] int (FlashInfer's per-token
    pool scatter: T >= 2, the state updated, no buffer, no output_state_indices)."""
    _need_bool("use_qk_l2norm", use_qk_l2norm)
    _need_bool("disable_state_update", disable_state_update)
    _need_tensor("q", q, 4)
    _need_tensor("v", v, 4)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    for name, t in (("a", a), ("b", b)):           # (by their names first: the shared checks call them g, beta)
        check_float_param(name, t, (B, T, HV), "[B, T, HV]", device)
    check_gdn_inputs(q, k, v, a, b, scale, None, None, A_log, dt_bias)
    dims = (HV, V, K) if state_layout == "vk" else (HV, K, V)
    contract = "[HV, V, K]" if state_layout == "vk" else "[HV, K, V]"
    if initial_state is not None:
        if state is not None:
            raise ValueError("pass the per-batch state or the pool (initial_state with initial_state_indices), "
                             "not both")
        if initial_state_indices is None:
            raise ValueError("initial_state (the pool) and initial_state_indices must be given together")
        _need_tensor("initial_state", initial_state, 4)
        if tuple(initial_state.shape[1:]) != dims or initial_state.shape[0] < 1:
            raise ValueError(f"initial_state must be the pool [P >= 1, {', '.join(map(str, dims))}] ({contract} per "
                             f"slot), got {_shape(initial_state)}")
        _need_float("initial_state", initial_state)
        _need_device("initial_state", initial_state, device)
        check_index_vector("initial_state_indices", initial_state_indices, B, device)
        rows = initial_state.shape[0]
    else:
        if initial_state_indices is not None:
            raise ValueError("initial_state (the pool) and initial_state_indices must be given together")
        if output_state_indices is not None:
            raise ValueError("output_state_indices needs the pool (initial_state with initial_state_indices)")
        if state is None:
            raise ValueError("pass the per-batch state or the pool (initial_state with initial_state_indices)")
        check_float_param("state", state, (B,) + dims, "[B, " + contract[1:], device)
        rows = B
    if output_state_indices is not None:
        check_index_vector("output_state_indices", output_state_indices, B, device)
    buf = intermediate_states_buffer
    if (buf is not None or disable_state_update) and T == 1:
        raise ValueError("intermediate_states_buffer and disable_state_update are for T > 1 tokens per batch row "
                         "(FlashInfer's MTP verify)")
    if buf is not None:
        need_step_buffer(buf, B, T, (HV, V, K), device, "[C >= B, T' >= T, HV, V, K]", "T'",
                         " (row n for batch row n)")
    if ssm_state_indices is not None:               # FlashInfer's per-token pool scatter
        _need_tensor("ssm_state_indices", ssm_state_indices, 2)
        if tuple(ssm_state_indices.shape) != (B, T) or ssm_state_indices.dtype not in INT_DTYPES:
            raise ValueError(f"ssm_state_indices must be [B, T] = [{B}, {T}] int32 or int64 (the pool row of each "
                             f"token's state), got {_shape(ssm_state_indices)} {ssm_state_indices.dtype}")
        _need_device("ssm_state_indices", ssm_state_indices, device)
        if T < 2 or disable_state_update or buf is not None or output_state_indices is not None:
            raise ValueError("ssm_state_indices (each token's state to its own pool row) needs T >= 2 tokens, "
                             "disable_state_update=False, and neither intermediate_states_buffer nor "
                             "output_state_indices")
    if output is not None:
        _need_tensor("output", output, 4)
        if tuple(output.shape) != (B, T, HV, V) or output.device != device:
            raise ValueError(f"output must be [B, T, HV, V] = [{B}, {T}, {HV}, {V}] on {device}, got {_shape(output)} "
                             f"on {output.device}")
        _need_float("output", output)
    return B, T, rows


def flashinfer_decode_slots(initial_state_indices, output_state_indices, rows: int, writes: bool,
                            ssm_state_indices=None) -> tuple:
    """(read slots, write slots, per-token slots or None) of FlashInfer's pool decode, from the values (host reads): a
    negative read index pads its row (nothing read or written, output zeros); a negative write index skips that
    row's write back. With ssm_state_indices [B, T] the states go to those rows instead (a negative entry: not
    stored) and no row writes back. Raises ValueError naming the entry for an index >= the pool's rows, (writes) a
    slot written by two rows, or a slot written by one row (output_state_indices, ssm_state_indices) that another row
    reads (the kernels read and write the pool in place, in no order between rows)."""
    if ssm_state_indices is not None:
        read = _one_slot_each("initial_state_indices", initial_state_indices, rows, 0, "negative: a padded row",
                              "rows", False)
        tokens, owner = ssm_state_indices.tolist(), {}                       # host read: value checks
        reader = _other_reader(read)
        for n, row in enumerate(tokens):
            for t, s in enumerate(row):
                if s >= rows:
                    raise ValueError(f"ssm_state_indices[{n}, {t}] = {s} is outside the pool's {rows} slots "
                                     f"(negative: not stored)")
                if s < 0 or read[n] < 0:
                    continue
                if owner.setdefault(s, (n, t)) != (n, t):
                    raise ValueError(f"slot {s} is given to tokens {owner[s]} and {(n, t)} (ssm_state_indices)")
                if reader(s, n) is not None:
                    raise ValueError(f"slot {s} is written by row {n}'s token {t} and read by row {reader(s, n)} "
                                     f"(ssm_state_indices, initial_state_indices)")
        return read, [-1] * len(read), [r if read[n] >= 0 else [-1] * len(r) for n, r in enumerate(tokens)]
    read = _one_slot_each("initial_state_indices", initial_state_indices, rows, 0, "negative: a padded row", "rows",
                          writes and output_state_indices is None)
    if output_state_indices is None:
        return read, read, None
    dest = _one_slot_each("output_state_indices", output_state_indices, rows, 0, "negative: no write back", "rows",
                          writes)
    dest = [d if r >= 0 else -1 for r, d in zip(read, dest)]
    reader = _other_reader(read)
    for n, d in enumerate(dest if writes else ()):     # a write must not land where another row still reads
        if d >= 0 and reader(d, n) is not None:
            raise ValueError(f"slot {d} is written by row {n} (output_state_indices) and read by row {reader(d, n)} "
                             f"(initial_state_indices)")
    return read, dest, None


def _other_reader(read: List[int]) -> Callable[[int, int], Optional[int]]:
    """reader(slot, n): the first row other than n whose read slot is ``slot`` (None if none), from the rows' read
    slots (negative: a padded row, reads nothing). Several rows may read one slot when none of them writes it."""
    rows_of: dict = {}
    for m, r in enumerate(read):
        if r >= 0:
            rows_of.setdefault(r, []).append(m)
    return lambda slot, n: next((m for m in rows_of.get(slot, ()) if m != n), None)


def flashinfer_checkpoint_rows(cu_seqlens, checkpoint_cu_starts, every: int, rows: int) -> List[int]:
    """The first checkpoint row of each sequence, from the values (host reads): checkpoint_cu_starts must start at
    0, give sequence n (len_n // every) rows, and end within state_checkpoints' ``rows``; ValueError naming the entry
    otherwise."""
    offs, starts = host_offsets(cu_seqlens), checkpoint_cu_starts.tolist()         # host reads: value checks
    if starts[0] != 0:
        raise ValueError(f"checkpoint_cu_starts[0] must be 0, got {starts[0]}")
    for n in range(len(offs) - 1):
        want = (offs[n + 1] - offs[n]) // every
        if starts[n + 1] - starts[n] != want:
            raise ValueError(f"checkpoint_cu_starts gives sequence {n} {starts[n + 1] - starts[n]} checkpoints; its "
                             f"{offs[n + 1] - offs[n]} tokens make {want} (one every {every})")
    if starts[-1] > rows:
        raise ValueError(f"checkpoint_cu_starts ends at {starts[-1]}, past state_checkpoints' {rows} rows")
    return starts[:-1]


def check_flashinfer_page_table(page_indices, page_indptr, last_page_len, page_size, N: int, device) -> None:
    """FlashInfer's paged recurrent-state table (flashinfer.gdn_paged): page_indices [total_pages] int (page ids),
    page_indptr [N+1] int (sequence b owns page_indices[page_indptr[b]:page_indptr[b + 1]]), last_page_len [N] int,
    page_size a positive multiple of the chunk 64 (so a page boundary is a chunk boundary of an aligned grid; None:
    the decode, which takes no page size)."""
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral)
                                  or page_size < 64 or page_size % 64):
        raise ValueError(f"page_size must be a positive multiple of the chunk size 64, got {page_size!r}")
    _need_tensor("page_indices", page_indices, 1)
    if page_indices.dtype not in INT_DTYPES:
        raise ValueError(f"page_indices must be int32 or int64, got {page_indices.dtype}")
    _need_device("page_indices", page_indices, device)
    check_index_vector("page_indptr", page_indptr, N + 1, device)
    check_index_vector("last_page_len", last_page_len, N, device)


def check_flashinfer_paged_pool(state_pool, sab: int, V: int, K: int, device) -> int:
    """state_pool [num_pages >= 1, num_sab_heads, V, K] floating (FlashInfer's V-major state per page); returns
    num_pages."""
    _need_tensor("state_pool", state_pool, 4)
    if tuple(state_pool.shape[1:]) != (sab, V, K) or state_pool.shape[0] < 1:
        raise ValueError(f"state_pool must be [num_pages >= 1, num_sab_heads, V, K] = [P, {sab}, {V}, {K}], got "
                         f"{_shape(state_pool)}")
    _need_float("state_pool", state_pool)
    _need_device("state_pool", state_pool, device)
    return state_pool.shape[0]


def flashinfer_paged_rows(page_indices, page_indptr, last_page_len, page_size: Optional[int], num_pages: int,
                          new_lens: Optional[List[int]] = None) -> List[tuple]:
    """The pool rows of a paged prefill (new_lens: each sequence's new token count) or decode (None: one new token
    each; page_size None: the decode's last_page_len is only known to be >= 1), from the values (host reads). Per
    sequence: (read page or -1, [written pages, in token order: each page boundary the new tokens cross, then the last
    page], prefix length); a sequence without pages is a padded row ((-1, [], 0); in a prefill only with no new
    tokens; in a decode its output is zeros). ValueError naming the entry for: page_indptr not non-decreasing within
    page_indices, a last_page_len outside [1, page_size], fewer tokens than new ones, a page id
    outside [0, num_pages), a page written twice, or a page written by one sequence and read by another."""
    ptr, last, ids = page_indptr.tolist(), last_page_len.tolist(), page_indices.tolist()   # host reads: value checks
    N = len(last)
    if ptr[0] < 0 or any(ptr[b + 1] < ptr[b] for b in range(N)) or ptr[N] > len(ids):
        raise ValueError(f"page_indptr must be non-decreasing within page_indices' {len(ids)} entries, got {ptr}")
    out = []
    for b in range(N):
        pages, new = ids[ptr[b]:ptr[b + 1]], 1 if new_lens is None else new_lens[b]
        if not pages:
            if new and new_lens is not None:
                raise ValueError(f"sequence {b} has {new} new tokens but no pages (page_indptr[{b}] = "
                                 f"page_indptr[{b + 1}] = {ptr[b]})")
            out.append((-1, [], 0))
            continue
        if last[b] < 1 or (page_size is not None and last[b] > page_size):
            raise ValueError(f"last_page_len[{b}] = {last[b]} is outside [1, page_size = {page_size}]")
        for j, p in enumerate(pages):
            if not 0 <= p < num_pages:
                raise ValueError(f"page_indices[{ptr[b] + j}] = {p} (sequence {b}) is outside the pool's "
                                 f"{num_pages} pages")
        if page_size is None:                  # the decode: the last page, or the one before when the token opens it
            if len(pages) == 1 and last[b] == 1:
                raise ValueError(f"sequence {b}: a decoded token needs a prefix (its pages hold 1 token: the "
                                 f"sequence's first token goes through the prefill)")
            out.append((pages[-2] if last[b] == 1 else pages[-1], [pages[-1]], -1))
            continue
        total = (len(pages) - 1) * page_size + last[b]
        prefix = total - new
        if prefix < 0:
            raise ValueError(f"sequence {b} has {new} new tokens but its pages hold {total} tokens "
                             f"((num_pages - 1) * page_size + last_page_len)")
        read = pages[(prefix - 1) // page_size] if prefix else -1
        writes = [pages[m // page_size - 1] for m in range((prefix // page_size + 1) * page_size, total, page_size)]
        out.append((read, (writes + [pages[-1]]) if new else [], prefix))
    owner = {}
    for b, (_, writes, _) in enumerate(out):
        for p in writes:
            if owner.setdefault(p, b) != b or writes.count(p) > 1:
                raise ValueError(f"page {p} is written twice (sequences {owner[p]} and {b}): a written page must "
                                 f"belong to one sequence, once")
    for b, (read, _, _) in enumerate(out):
        if read >= 0 and owner.get(read, b) != b:
            raise ValueError(f"page {read} is read by sequence {b} and written by sequence {owner[read]}")
    return out


def check_flashinfer_paged_gates(g, gate_domain, use_gate_in_kernel, A_log, dt_bias, beta_is_logit, sab: int,
                                 device) -> None:
    """The gate arguments of FlashInfer's paged prefill: gate_domain "linear" (g is the decay alpha) or "log" (g is
    its log); use_gate_in_kernel=True: g holds the raw projection a, with A_log and dt_bias [num_sab_heads] floating
    (both None otherwise); beta_is_logit a bool."""
    if gate_domain not in ("linear", "log"):
        raise ValueError(f"gate_domain must be 'linear' (g is the decay) or 'log' (g is its log), got {gate_domain!r}")
    _need_bool("use_gate_in_kernel", use_gate_in_kernel)
    _need_bool("beta_is_logit", beta_is_logit)
    if use_gate_in_kernel:
        if g is None:
            raise ValueError("use_gate_in_kernel=True forms the decay from g (the raw projection a): g must be given")
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            check_float_param(name, t, (sab,), "[num_sab_heads]", device)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are read only with use_gate_in_kernel=True")


def check_flashinfer_paged_slots(slots, names: Tuple[str, ...], N: int, device) -> None:
    """slots (GDNPagedPrefillSlots / GDNPagedDecodeSlots, or None): its ``names`` fields, each an int tensor [N]."""
    if slots is None:
        return
    for name in names:
        check_index_vector(f"slots.{name}", getattr(slots, name, None), N, device)


def check_flashinfer_paged_decode_inputs(q, k, v, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, state_pool,
                                         page_indices, page_indptr, last_page_len, backend, slots) -> int:
    """Validate FlashInfer's gated_delta_rule_decode_paged arguments (flashinfer.gdn_paged); return B.
    q, k: [B, 1, H, K]   v: [B, 1, HV, V]   a, b: [B, 1, HV]   A_log, dt_bias: [HV]   state_pool: [P, HV, V, K]
    page table: check_flashinfer_page_table (no page size)   backend: one of FlashInfer's names (no effect here)."""
    if backend not in ("auto", "flashinfer", "cake_gdn", "rubin"):
        raise ValueError(f"backend must be 'auto', 'flashinfer', 'cake_gdn' or 'rubin' (FlashInfer's; none changes "
                         f"the result here), got {backend!r}")
    _need_tensor("q", q, 4)
    _need_tensor("v", v, 4)
    B, T, _, K = q.shape
    if T != 1:
        raise ValueError(f"gated_delta_rule_decode_paged takes one token per sequence (q [B, 1, H, K]), got T={T}")
    check_flashinfer_paged_pool(state_pool, v.shape[2], v.shape[3], K, q.device)
    check_flashinfer_page_table(page_indices, page_indptr, last_page_len, None, B, q.device)
    # the pool as the decode's initial_state (checked above under its own name), last_page_len standing for the
    # [B] indices it needs
    check_flashinfer_decode_inputs(q, k, v, None, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, state_pool,
                                   last_page_len, None, None, False)
    check_flashinfer_paged_slots(slots, ("initial_state_indices", "output_state_indices"), B, q.device)
    return B
