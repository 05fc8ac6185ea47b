"""fast.launch.Relaunch: the compiled launcher reused only when nothing it skips could differ.

(a) with a stand-in kernel (no Triton involved): the first call goes through ``fn[grid]``; later calls
    call the compiled launcher with Triton's calling convention (grid, stream, function, packed metadata,
    launch metadata, hooks, then the positional arguments and the constexprs in parameter order);
    each per-call check (an unaligned pointer, a changed integer, another device, a launch hook, a
    wrapper over the launch path such as refgdn.capture's recorder) sends the call back to ``fn[grid]``;
(b) with the installed Triton, in a fresh process on the stand-in sm_90 driver (benchmarks/sm90.py:
    real compiles, the C launch replaced by a recorder): a decode step's two Relaunch launches pass
    the compiled kernels exactly the arguments JITFunction.run passes them.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fast.launch as fl
from refgdn.capture import KeyLog, recording


def body(x, y, n, scale, A: "tl.constexpr", B: "tl.constexpr" = 7):  # noqa: F821 - stand-in kernel body
    pass


class FakeCompiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn-handle", ("meta",), log

    def run(self, *a):
        self.log.append(("fast", a))


class FakeKernel:
    """Stands in for a JITFunction: ``k[grid](*args, **kw)`` logs and returns a compiled kernel."""
    fn = staticmethod(body)

    def __init__(self):
        self.log = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("slow", grid, args, kw))
            return self.compiled
        return launch

    def run(self, *a, **k):    # the class-level launch path _quiet compares against
        raise AssertionError("not called")


@pytest.fixture
def fake(monkeypatch):
    k = FakeKernel()
    monkeypatch.setattr(fl, "_JIT_RUN", FakeKernel.run)

    class Drv:
        dev = 0

        def get_current_device(self):
            return self.dev

        def get_current_stream(self, device=None):
            return 1000 + device

    d = Drv()
    monkeypatch.setattr(fl, "_driver", lambda: d)
    return k, d


def _args(x, y, n=5, scale=0.5):
    return (x, y, n, scale)


def test_plain_launch_pins_fp_fusion_and_keys_leave_it_out(fake):
    """fast.launch.launch outside a plan passes fast's pinned compile options (floating-point fusion on: Triton's
    default through 3.9, which 3.9 warns will change), a caller's own value wins, and refgdn.capture's compile key
    is the same with the pinned value as without it (fast.keys lists no such option), not with fusion off."""
    from refgdn.capture import key_of_launch
    k, _ = fake
    x, y = torch.zeros(64), torch.zeros(64)
    fl.launch(k, (2,), dict(A=4), *_args(x, y))
    assert k.log[-1][3] == dict(A=4, enable_fp_fusion=True)
    fl.launch(k, (2,), dict(A=4, enable_fp_fusion=False), *_args(x, y))
    assert k.log[-1][3] == dict(A=4, enable_fp_fusion=False)
    plain = key_of_launch(k, _args(x, y), dict(A=4, num_warps=2))
    assert key_of_launch(k, _args(x, y), dict(A=4, num_warps=2, enable_fp_fusion=True)) == plain
    assert key_of_launch(k, _args(x, y), dict(A=4, num_warps=2, enable_fp_fusion=False)) != plain


def test_every_fast_kernel_launch_goes_through_launch_or_relaunch():
    """No ``some_kernel[grid](...)`` call in fast's sources: each launch goes through fast.launch.launch or Relaunch,
    the two places that add PINNED_OPTIONS (a direct launch would compile with Triton's default and, on 3.9, warn)."""
    import ast
    import pathlib
    root = pathlib.Path(fl.__file__).parent
    direct = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")):
                direct.append(f"{path.relative_to(root)}:{node.lineno} {node.func.value.id}")
    assert not direct, direct


def test_relaunch_paths(fake, monkeypatch):
    k, drv = fake
    x, y = torch.zeros(64), torch.zeros(64)
    r = fl.Relaunch(k, (3, 2), dict(A=4, num_warps=2))
    r(*_args(x, y))
    # the slow path is kernel[grid](*args, **kw) with fast's pinned compile options (floating-point fusion on)
    assert k.log[-1] == ("slow", (3, 2, 1, 1)[:3], _args(x, y), dict(A=4, num_warps=2, enable_fp_fusion=True))
    r(*_args(x, y, scale=0.25))                        # floats are not specialised: fast path
    from triton import knobs
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    # tensors reach the launcher as their addresses
    assert k.log[-1] == ("fast", (3, 2, 1, 1000, "fn-handle", ("meta",), None, None, None, x.data_ptr(), y.data_ptr(),
                                  5, 0.25, 4, 7))
    n_fast = sum(e[0] == "fast" for e in k.log)

    r(*_args(x[1:], y))                                # a pointer 4 bytes off: slow
    assert k.log[-1][0] == "slow"
    r(*_args(x, y, n=6))                               # another integer: slow
    assert k.log[-1][0] == "slow"
    r(*_args(x, y))                                    # n = 5's compiled kernel is still kept: fast
    assert k.log[-1][0] == "fast"
    drv.dev = 1                                        # another current device: slow
    r(*_args(x, y))
    assert k.log[-1][0] == "slow"
    r(*_args(x, y))                                    # recorded on device 1: fast, device 1's stream
    assert k.log[-1][0] == "fast" and k.log[-1][1][3] == 1001

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    r(*_args(x, y))                                    # a launch hook listens: slow
    assert k.log[-1][0] == "slow"
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hooks[0])
    monkeypatch.setattr(fl, "_JIT_RUN", object())      # a wrapper over the launch path: slow
    r(*_args(x, y))
    assert k.log[-1][0] == "slow"
    monkeypatch.setattr(fl, "_JIT_RUN", FakeKernel.run)
    with recording(KeyLog()):                          # refgdn.capture's recorder active: slow
        r(*_args(x, y))
    assert k.log[-1][0] == "slow"
    r(*_args(x, y))
    assert k.log[-1][0] == "fast" and sum(e[0] == "fast" for e in k.log) == n_fast + 3


def test_relaunch_keeps_a_kernel_per_alignment_and_never_records_unknown(fake):
    """Triton specialises a pointer on 16 | address: the kernel compiled for an unaligned view serves the next call
    with the same pattern (one per pattern, like the integer classes), never an aligned one or another pattern.
    A layout whose later checks cannot be made is never reused."""
    k, _ = fake
    x, y = torch.zeros(64), torch.zeros(64)
    r = fl.Relaunch(k, (1,), dict(A=1))
    kinds = []
    for xa, ya in ((x[1:], y), (x[1:], y), (x, y), (x[2:], y), (x, y[1:]), (x, y), (x[5:], y[3:]), (x[5:], y[3:])):
        r(*_args(xa, ya))                              # x[1:] / x[2:]: 4 / 8 bytes off, one pattern
        kinds.append(k.log[-1][0])
        assert kinds[-1] == "slow" or k.log[-1][1][9:11] == (xa.data_ptr(), ya.data_ptr())
    assert kinds == ["slow", "fast", "slow", "fast", "slow", "fast", "slow", "fast"]
    n = len(k.log)
    r2 = fl.Relaunch(k, (1,), dict())                  # A has no value: the tail cannot be built
    r2(*_args(x, y))
    r2(*_args(x, y))
    assert [e[0] for e in k.log[n:]] == ["slow", "slow"]
    k.compiled = None                                  # the interpreter returns no compiled kernel
    r3 = fl.Relaunch(k, (1,), dict(A=1))
    r3(*_args(x, y))
    r3(*_args(x, y))
    assert [e[0] for e in k.log[n + 2:]] == ["slow", "slow"]


# The stand-in sm_90 driver for a fresh process (benchmarks/sm90.py): real compiles, every C launch recorded into
# `calls` as (kernel name, arguments); `counting_run` is JITFunction.run that also counts its calls into `runs`;
# `same_launches(slow, fast_, static)` checks two recorded launch sequences argument by argument, where `static`
# holds the addresses of the caller's tensors (Relaunch passes those as they are; the fresh outputs of a call may
# sit at any other aligned address).
_STAND_IN = """
import sys
sys.path.insert(0, {root!r})
from triton.runtime.jit import JITFunction
real_run = JITFunction.run
from benchmarks.sm90 import install_compile_only
calls, runs = [], []

def on_compile(name, kernel):
    kernel._run = lambda *a, _n=name: calls.append((_n, a))   # the C launch, recorded
    kernel.module, kernel._module_pid = "stand-in", -1          # no module to load or unload

install_compile_only(on_compile)
compile_only = JITFunction.run
import fast.launch as fl

def counting_run(self, *a, **k):
    runs.append(self)
    return real_run(self, *a, **k)

def same_launches(slow, fast_, static):
    assert [n for n, _ in fast_] == [n for n, _ in slow], (slow, fast_)
    for (n, a), (_, b) in zip(slow, fast_):
        assert len(a) == len(b), (n, len(a), len(b))
        for i, (u, v) in enumerate(zip(a, b)):
            if i == 6:                 # launch metadata (read by hooks only): Relaunch passes None
                assert v is None, (n, i, v)
            elif i in (7, 8):          # the hook slots: None where Triton's are empty
                assert v is None and fl._silent(u), (n, i, u, v)
            elif hasattr(u, "data_ptr"):   # an address: the caller's tensor's own, or a fresh aligned one
                same = type(v) is int and (v == u.data_ptr() if u.data_ptr() in static
                                           else v % 16 == 0 and v not in static)
                assert same, (n, i, u, v)
            else:
                assert type(u) is type(v) and u == v, (n, i, u, v)
"""


def _run_stand_in(body: str) -> None:
    """Run _STAND_IN + body in a fresh process (TRITON_INTERPRET=0); it must print OK."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _STAND_IN.format(root=root) + textwrap.dedent(body)
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_relaunch_matches_jitfunction_run_on_installed_triton():
    """Fresh process, stand-in sm_90 driver: the launcher sees the same arguments both ways."""
    _run_stand_in("""
        import fast.serving as fs
        from benchmarks.host_overhead import make_step
        args = make_step("cpu")
        fs.gdn_decode(*args)              # compile-only: compiles both kernels (sm_90), builds the plan
        static = {t.data_ptr() for t in list(args[:7]) + args[7].tensors() + [args[8]]}
        JITFunction.run = counting_run    # from here on JITFunction.run launches (into the recorders)
        fl._JIT_RUN = counting_run
        fs.clear_plan_cache()
        fs.gdn_decode(*args)              # a new plan: its first launches go through JITFunction.run
        slow = list(calls); calls.clear()
        fs.gdn_decode(*args)              # the same plan: Relaunch
        assert len(runs) == 2, runs       # the third call did not go through JITFunction.run
        assert [n for n, _ in slow] == ["conv_step_kernel", "gdn_step_kernel"], slow
        same_launches(slow, list(calls), static)
        print("OK")
    """)


def test_carved_regions(fake):
    """A Carved region stands for a tensor: JITFunction.run gets a view of the scratch with its dtype, shape
    and address; the compiled launcher gets the address (base + offset)."""
    k, _ = fake
    base = torch.zeros(256, dtype=torch.uint8)
    n = fl.Carved.nbytes(torch.float32, (3, 5))
    assert n == 64                                     # 60 bytes rounded up to 16
    x, y = fl.Carved(base, 0, torch.float32, (3, 5)), fl.Carved(base, n, torch.int32, (2, 4))
    r = fl.Relaunch(k, (1,), dict(A=1))
    r(*_args(x, y))
    slow = k.log[-1][2]
    assert slow[0].dtype == torch.float32 and slow[0].shape == (3, 5) and slow[0].data_ptr() == base.data_ptr()
    assert slow[1].dtype == torch.int32 and slow[1].shape == (2, 4) and slow[1].data_ptr() == base.data_ptr() + 64
    slow[1].fill_(7)                                   # a view: writes land in the scratch
    assert base[64:96].view(torch.int32).tolist() == [7] * 8
    r(*_args(x, y))
    assert k.log[-1][0] == "fast" and k.log[-1][1][9:11] == (base.data_ptr(), base.data_ptr() + 64)


def test_launch_plan_positions(fake):
    """fast.launch.launch: outside a LaunchPlan block always ``fn[grid]``; inside, the i-th launch reuses the
    plan's i-th Relaunch only for the same kernel and keyword arguments (else it takes its place), on the
    launch's own grid (one compiled kernel serves every grid)."""
    k, _ = fake
    k2 = FakeKernel()
    k2.log = k.log
    k2.compiled = FakeCompiled(k.log)
    x, y = torch.zeros(64), torch.zeros(64)
    kinds = lambda n: [e[0] for e in k.log[-n:]]  # noqa: E731

    fl.launch(k, (1,), dict(A=1), *_args(x, y))
    fl.launch(k, (1,), dict(A=1), *_args(x, y))
    assert kinds(2) == ["slow", "slow"]                # no plan: JITFunction.run every time

    plan = fl.LaunchPlan()

    def step(a2=2, grid2=(2,), kern2=k2):
        with plan:
            fl.launch(k, (1,), dict(A=1), *_args(x, y))
            fl.launch(kern2, grid2, dict(A=a2), *_args(x, y))

    step()
    assert kinds(2) == ["slow", "slow"] and len(plan.slots) == 2
    step()
    assert kinds(2) == ["fast", "fast"]                # positions 0 and 1 reused
    assert k.log[-1][1][:3] == (2, 1, 1)               # the second launch's own grid
    step(a2=3)                                         # another constexpr at position 1: a new Relaunch there
    assert kinds(2) == ["fast", "slow"] and plan.slots[1][0][1] == dict(A=3) and len(plan.slots[1]) == 2
    step(a2=3, grid2=(4, 3))                           # another grid: the same Relaunch, launched on it
    assert kinds(2) == ["fast", "fast"] and k.log[-1][1][:3] == (4, 3, 1)
    step()                                             # the first one is still kept beside it
    assert kinds(2) == ["fast", "fast"]
    step(a2=3, grid2=(4,), kern2=k)                    # another kernel
    assert kinds(2) == ["fast", "slow"] and plan.slots[1][0][0] is k
    step(a2=3, grid2=(4,), kern2=k)
    assert kinds(2) == ["fast", "fast"] and len(plan.slots) == 2

    inner = fl.LaunchPlan()
    with plan:                                         # blocks nest; each keeps its own position
        fl.launch(k, (1,), dict(A=1), *_args(x, y))
        with inner:
            fl.launch(k, (9,), dict(A=1), *_args(x, y))
        fl.launch(k, (4,), dict(A=3), *_args(x, y))    # the outer plan's position 1, as step() left it
    assert kinds(3) == ["fast", "slow", "fast"] and len(inner.slots) == 1
    fl.launch(k, (1,), dict(A=1), *_args(x, y))        # after the blocks: no plan again
    assert kinds(1) == ["slow"]
    for a2 in range(10, 10 + fl.PLAN_VARIANTS):         # at most PLAN_VARIANTS per position, the newest kept
        step(a2=a2)
    assert len(plan.slots[1]) == fl.PLAN_VARIANTS and [e[1]["A"] for e in plan.slots[1]][0] == 9 + fl.PLAN_VARIANTS
    step(a2=2)                                         # pushed out: a new Relaunch again
    assert kinds(2) == ["fast", "slow"]


def test_prefill_plan_matches_jitfunction_run_on_installed_triton():
    """Fresh process, stand-in sm_90 driver: fast.chunk_gated_delta_rule's second call with a signature launches
    each kernel through its plan's Relaunch, which hands the compiled launcher the arguments JITFunction.run
    handed it on the first call (None arguments, the three-kernel path and the fused two-kernel one included)."""
    _run_stand_in("""
        import torch
        import fast
        from fast import chunk as fc

        def inputs(B, H, HV, init):
            g = torch.Generator().manual_seed(0)
            q, k = (torch.randn(B, 64, H, 64, generator=g).bfloat16() for _ in range(2))
            v = torch.randn(B, 64, HV, 64, generator=g).bfloat16()
            gg, beta = -torch.rand(B, 64, HV, generator=g), torch.rand(B, 64, HV, generator=g).bfloat16()
            return q, k, v, gg, beta, (torch.zeros(B, HV, 64, 64) if init else None)

        # (B, H, HV, initial state + final state + l2norm): three kernels with every optional tensor; three kernels
        # with none (None arguments); the fused two-kernel path (N * HV * cdiv(V, 64) >= 132 // 2)
        for B, H, HV, full in ((1, 2, 4, True), (1, 2, 4, False), (3, 2, 32, True)):
            q, k, v, gg, beta, h0 = inputs(B, H, HV, full)
            call = lambda: fast.chunk_gated_delta_rule(q, k, v, gg, beta, initial_state=h0, output_final_state=full,
                                                       use_qk_l2norm_in_kernel=full)
            JITFunction.run = compile_only
            fl._JIT_RUN = compile_only
            call()                            # compiles (sm_90)
            JITFunction.run = counting_run    # from here on JITFunction.run launches (into the recorders)
            fl._JIT_RUN = counting_run
            fc.clear_plan_cache()
            call()                            # a signature's first call: remembered, no plan
            runs.clear(); calls.clear()
            call()                            # a new plan: its launches go through JITFunction.run
            slow, n_slow = list(calls), len(runs); calls.clear()
            call()                            # the same plan: Relaunch
            want = (["chunk_kkt_inv_kernel", "row_scales_kernel", "chunk_state_kernel"] if HV == 32     # (l2norm)
                    else ["chunk_kkt_inv_kernel", "chunk_state_kernel", "chunk_output_kernel"])
            assert [n for n, _ in slow] == want, slow
            assert n_slow == len(want) and len(runs) == n_slow, (n_slow, len(runs))   # none through run the 2nd time
            same_launches(slow, list(calls), {t.data_ptr() for t in (q, k, v, gg, beta, h0) if t is not None})
        # varlen, the offsets checked after the launches: the device chunk tables' launch first, all through the plan
        q, k, v, gg, beta, _ = inputs(1, 2, 4, False)
        cu = torch.tensor([0, 20, 20, 64], dtype=torch.int32)
        call = lambda: fast.chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        JITFunction.run = compile_only
        fl._JIT_RUN = compile_only
        call()
        JITFunction.run = counting_run
        fl._JIT_RUN = counting_run
        fc.clear_plan_cache()
        call()
        runs.clear(); calls.clear()
        call()
        slow, n_slow = list(calls), len(runs); calls.clear()
        call()
        want = ["chunk_table_kernel", "chunk_kkt_inv_kernel", "chunk_state_kernel", "chunk_output_kernel"]
        assert [n for n, _ in slow] == want, slow
        assert n_slow == len(want) and len(runs) == n_slow, (n_slow, len(runs))
        same_launches(slow, list(calls), {t.data_ptr() for t in (q, k, v, gg, beta, cu)})
        # varlen with the offsets' host copy (cu_seqlens_cpu): through the plan too, each launch on its own grid
        # (the chunk count follows the offsets' values: [0, 20, 20, 64] has 2 chunks of 64, [0, 64, 64, 64] one)
        cpu = lambda c: fast.chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=c, cu_seqlens_cpu=c.clone(),
                                                    use_qk_l2norm_in_kernel=True)
        cu1 = torch.tensor([0, 64, 64, 64], dtype=torch.int32)
        JITFunction.run = compile_only
        fl._JIT_RUN = compile_only
        cpu(cu)
        JITFunction.run = counting_run
        fl._JIT_RUN = counting_run
        fc.clear_plan_cache()
        cpu(cu)
        runs.clear(); calls.clear()
        cpu(cu)
        slow, n_slow = list(calls), len(runs); calls.clear()
        cpu(cu)
        want = ["chunk_kkt_inv_kernel", "chunk_state_kernel", "chunk_output_kernel"]
        assert [n for n, _ in slow] == want, slow
        assert n_slow == len(want) and len(runs) == n_slow, (n_slow, len(runs))
        same_launches(slow, list(calls), {t.data_ptr() for t in (q, k, v, gg, beta, cu)})
        calls.clear()
        cpu(cu1)                              # other offsets, same signature: the plan, on the new grids
        assert len(runs) == n_slow, len(runs)
        fast_grids = {n: a[:3] for n, a in calls}
        fc.clear_plan_cache(); calls.clear()
        cpu(cu1)                              # (JITFunction.run's grids for these offsets)
        assert fast_grids == {n: a[:3] for n, a in calls}, (fast_grids, calls)
        assert fast_grids["chunk_kkt_inv_kernel"] != slow[0][1][:3]
        # other token counts, the same plan (the signature leaves T out): T = 48 has the integer classes of T = 64
        # (16 divides T and the strides), so every launch is relaunched; T = 50 is a new class for some, which
        # go through JITFunction.run once; then T = 50 and T = 34 (50's classes) are all relaunched, and the
        # launcher gets what JITFunction.run gives it on a fresh plan
        cpu(cu1)                              # (the signature's second call since the clear: its plan, T = 64)
        for T, through_run in ((48, False), (50, True), (50, False), (34, False)):
            c = torch.tensor([0, 20, 20, T], dtype=torch.int32)
            part = lambda: fast.chunk_gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], gg[:, :T], beta[:, :T],
                                                       cu_seqlens=c, cu_seqlens_cpu=c.clone(),
                                                       use_qk_l2norm_in_kernel=True)
            runs.clear(); calls.clear()
            part()
            assert (len(runs) > 0) == through_run, (T, len(runs))
        relaunched = list(calls)
        fc.clear_plan_cache(); calls.clear()
        part()                                # a first call: JITFunction.run for every launch
        same_launches(list(calls), relaunched, {t.data_ptr() for t in (q, k, v, gg, beta, c)})
        print("OK")
    """)


def test_conv_plan_matches_jitfunction_run_on_installed_triton():
    """Fresh process, stand-in sm_90 driver: fast.causal_conv1d's plan relaunches other token and sequence counts
    of known integer classes, with an unaligned initial state (the last W-1 of W columns, as a W-column conv cache
    gives it), handing the compiled launchers what JITFunction.run hands them on a fresh plan."""
    _run_stand_in("""
        import torch
        import fast
        from fast import conv as fcv
        D, W = 64, 4
        x, w, c0 = torch.randn(1, 80, D).bfloat16(), torch.randn(D, W).bfloat16(), torch.randn(3, D, W).bfloat16()

        def call(lens):
            cu = torch.tensor(lens, dtype=torch.int32)
            return fast.causal_conv1d(x[:, :lens[-1]], w, None, "silu", initial_state=c0[:len(lens) - 1, :, 1:],
                                      output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
        JITFunction.run = compile_only
        fl._JIT_RUN = compile_only
        call([0, 30, 30, 80]); call([0, 25, 50])        # compiles both integer classes of T (16 | 80, not 50)
        JITFunction.run = counting_run
        fl._JIT_RUN = counting_run
        fcv.clear_plan_cache()
        for lens in ([0, 30, 30, 80], [0, 30, 30, 80], [0, 25, 50]):   # remembered; a plan; T's other class
            call(lens)
        runs.clear(); calls.clear()
        call([0, 10, 34]); call([0, 1, 2, 64])          # classes seen: every launch relaunched
        # (per call: the tile table built on the device, the conv, its final states)
        assert len(runs) == 0 and len(calls) == 6, (runs, [n for n, _ in calls])
        relaunched = list(calls)
        fcv.clear_plan_cache(); calls.clear()
        call([0, 10, 34]); call([0, 1, 2, 64])          # no plan: JITFunction.run
        same_launches(list(calls), relaunched, {t.data_ptr() for t in (x, w, c0, c0[:, :, 1:])})
        print("OK")
    """)


def test_int_class_is_as_fine_as_tritons_specialisation():
    """Two integers of one fast.launch.int_class get the same specialisation from the installed Triton (the key
    JITFunction.run compiles for), so one compiled kernel is right for both."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    edges = [0, 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64]
    vals = sorted({e + d for e in edges for d in range(-40, 41)} | {-e + d for e in edges for d in range(-40, 41)})
    vals = [v for v in vals if -2 ** 63 <= v < 2 ** 64] + [True, False]
    spec = lambda x: native_specialize_impl(BaseBackend, x, False, True, True)  # noqa: E731 (not constexpr)
    by_class = {}
    for x in vals:
        by_class.setdefault(fl.int_class(x), set()).add(spec(x))
    assert all(len(s) == 1 for s in by_class.values()), {c: s for c, s in by_class.items() if len(s) > 1}
    assert len(by_class) >= 8                           # (1, 16 | x, i32 / i64 / u64 ranges, bool all seen)


class _Param:
    def __init__(self, is_constexpr: bool):
        self.is_constexpr = is_constexpr


def test_relaunch_keeps_a_compiled_kernel_per_integer_class(fake):
    """Integers that are not constexprs are compared by int_class: another value of a class already launched
    reuses that class's compiled kernel; a new class goes through fn[grid] once. A positional constexpr is
    compared by value."""
    k, _ = fake
    x, y = torch.zeros(64), torch.zeros(64)
    k.params = [_Param(c) for c in (False, False, False, False, True, True)]     # x, y, n, scale | A, B
    r = fl.Relaunch(k, (1,), dict(A=1))
    kinds = []
    for n in (5, 7, 32, 48, 7, 1, 1, 2 ** 40, 2 ** 40 + 3, 64):
        r(*_args(x, y, n=n))
        kinds.append(k.log[-1][0])
        assert k.log[-1][0] == "slow" or k.log[-1][1][11] == n      # the launcher gets the call's own value
    assert kinds == ["slow", "fast", "slow", "fast", "fast", "slow", "fast", "slow", "slow", "fast"]
    k.params[2] = _Param(True)                          # n a constexpr: every value is its own kernel
    r2 = fl.Relaunch(k, (1,), dict(A=1))
    kinds = []
    for n in (5, 7, 5):
        r2(*_args(x, y, n=n))
        kinds.append(k.log[-1][0])
    assert kinds == ["slow", "slow", "fast"]
