"""A stand-in Triton driver for GPU-less machines: an sm_90 target (device 0, stream 0, CPU tensors) and
compile-only launches, so Triton's real compile and launch-preparation paths run without a GPU
(benchmarks.compile_check's register / spill report, benchmarks.host_overhead --sm90's launch cost).

Relies on Triton internals (``triton.runtime.driver.set_active``, ``JITFunction.run``'s ``warmup``):
written against Triton 3.9. Call before ``triton`` or ``fast`` is imported anywhere in the process.
"""
from __future__ import annotations

import os
from typing import Callable, Optional


# An H100 SXM / H200 SM (sm_90): what bounds how many blocks (programs) of a kernel it holds at once
SMEM_PER_SM = 233472            # 228 KB of shared memory per SM
SMEM_RESERVED_PER_BLOCK = 1024  # the driver's reserve per resident block
REGS_PER_SM = 65536
MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 64, 32


def blocks_per_sm(num_warps: int, shared: int, registers: int) -> dict:
    """How many blocks of a compiled kernel one sm_90 SM holds, by each limit and overall: ``shared`` bytes of shared
    memory and ``registers`` per thread (ptxas' count; allocated per warp in units of 256) for ``num_warps`` warps."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    limits = dict(smem=SMEM_PER_SM // (shared + SMEM_RESERVED_PER_BLOCK),
                  regs=REGS_PER_SM // max(1, regs_per_warp * num_warps),
                  warps=MAX_WARPS_PER_SM // num_warps)
    limits["blocks"] = min(MAX_BLOCKS_PER_SM, *limits.values())
    return limits


def install_compile_only(on_compile: Optional[Callable] = None, arch: int = 90) -> None:
    """Make every Triton launch a compile-only warmup on a stand-in sm_90 driver (nothing runs: outputs
    stay garbage). on_compile(kernel_name, compiled_kernel) is called after each launch. arch: the compute
    capability the stand-in reports (90; 80, 86, 89, 100, 120 to compile for other GPUs: benchmarks.compile_check
    --arch)."""
    os.environ["TRITON_INTERPRET"] = "0"                  # before triton loads: real compiles
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90:
        """The stand-in driver: an sm_90 (or ``arch``) target, device 0, stream 0."""
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

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
