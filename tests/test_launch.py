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


def test_relaunch_paths(fake, monkeypatch):
    k, drv = fake
    x, y = torch.zeros(64), torch.zeros(64)
    r = fl.Relaunch(k, (3, 2), dict(A=4, num_warps=2))
    r(*_args(x, y))
    assert k.log[-1] == ("slow", (3, 2, 1, 1)[:3], _args(x, y), dict(A=4, num_warps=2))
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
    r(*_args(x, y))                                    # (re-recorded with n = 5 again)
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
    assert k.log[-1][0] == "fast" and sum(e[0] == "fast" for e in k.log) == n_fast + 2


def test_relaunch_never_records_unaligned_or_unknown(fake):
    k, _ = fake
    x, y = torch.zeros(64), torch.zeros(64)
    r = fl.Relaunch(k, (1,), dict(A=1))
    r(*_args(x[1:], y))                                # picked while unaligned: never reused
    r(*_args(x[1:], y))
    assert [e[0] for e in k.log] == ["slow", "slow"]
    r2 = fl.Relaunch(k, (1,), dict())                  # A has no value: the tail cannot be built
    r2(*_args(x, y))
    r2(*_args(x, y))
    assert [e[0] for e in k.log[2:]] == ["slow", "slow"]
    k.compiled = None                                  # the interpreter returns no compiled kernel
    r3 = fl.Relaunch(k, (1,), dict(A=1))
    r3(*_args(x, y))
    r3(*_args(x, y))
    assert [e[0] for e in k.log[4:]] == ["slow", "slow"]


def test_relaunch_matches_jitfunction_run_on_installed_triton():
    """Fresh process, stand-in sm_90 driver: the launcher sees the same arguments both ways."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {root!r})
        from triton.runtime.jit import JITFunction
        real_run = JITFunction.run
        from benchmarks.sm90 import install_compile_only
        calls = []

        def on_compile(name, kernel):
            kernel._run = lambda *a, _n=name: calls.append((_n, a))   # the C launch, recorded
            kernel.module, kernel._module_pid = "stand-in", -1          # no module to load or unload

        install_compile_only(on_compile)
        import fast.serving as fs, fast.launch as fl
        from benchmarks.host_overhead import make_step
        args = make_step("cpu")
        fs.gdn_decode(*args)              # compile-only: compiles both kernels (sm_90), builds the plan
        static = {{t.data_ptr() for t in list(args[:7]) + args[7].tensors() + [args[8]]}}
        runs = []

        def counting_run(self, *a, **k):
            runs.append(self)
            return real_run(self, *a, **k)

        JITFunction.run = counting_run    # from here on JITFunction.run launches (into the recorders)
        fl._JIT_RUN = counting_run
        fs.clear_plan_cache()
        fs.gdn_decode(*args)              # a new plan: its first launches go through JITFunction.run
        slow = list(calls); calls.clear()
        fs.gdn_decode(*args)              # the same plan: Relaunch
        fast_ = list(calls)
        assert len(runs) == 2, runs       # the third call did not go through JITFunction.run
        assert [n for n, _ in slow] == ["conv_step_kernel", "gdn_step_kernel"], slow
        assert [n for n, _ in fast_] == [n for n, _ in slow]
        for (n, a), (_, b) in zip(slow, fast_):
            assert len(a) == len(b), (n, len(a), len(b))
            for i, (u, v) in enumerate(zip(a, b)):
                if i == 6:                 # launch metadata (read by hooks only): Relaunch passes None
                    assert v is None, (n, i, v)
                    continue
                if i in (7, 8):            # the hook slots: None where Triton's are empty
                    assert v is None and fl._silent(u), (n, i, u, v)
                    continue
                if hasattr(u, "data_ptr"):       # Relaunch passes each tensor's address: the caller's
                    # tensors' own; y, o, snap are fresh per call (any aligned address but a caller's tensor's)
                    same = type(v) is int and (v == u.data_ptr() if u.data_ptr() in static
                                               else v % 16 == 0 and v not in static)
                else:
                    same = type(u) is type(v) and u == v
                assert same, (n, i, u, v)
        print("OK", len(slow[0][1]), len(slow[1][1]))
    """)
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


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
