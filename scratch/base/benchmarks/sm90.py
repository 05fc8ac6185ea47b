"""A stand-in Triton driver for GPU-less machines: an sm_90 target (device 0, stream 0, CPU tensors) and
compile-only launches, so Triton's real compile and launch-preparation paths run without a GPU
(benchmarks.compile_check's register / spill report, benchmarks.host_overhead --sm90's launch cost).

Relies on Triton internals (``triton.runtime.driver.set_active``, ``JITFunction.run``'s ``warmup``):
written against Triton 3.9. Call before ``triton`` or ``fast`` is imported anywhere in the process.
"""
from __future__ import annotations

import os
from typing import Callable, Optional


def install_compile_only(on_compile: Optional[Callable] = None) -> None:
    """Make every Triton launch a compile-only warmup on a stand-in sm_90 driver (nothing runs: outputs
    stay garbage). on_compile(kernel_name, compiled_kernel) is called after each launch."""
    os.environ["TRITON_INTERPRET"] = "0"                  # before triton loads: real compiles
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90:
        """The stand-in driver: an sm_90 target, device 0, stream 0."""
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(Sm90())
    real_run = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        kernel = real_run(self, *a, grid=grid, warmup=True, **kw)
        if on_compile is not None:
            on_compile(self.__name__, kernel)
        return kernel

    JITFunction.run = compile_only
