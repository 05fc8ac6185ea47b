"""Small helpers shared by the fast kernels: interpreter detection, sizes, varlen chunk tables.

Nothing here launches a kernel. The varlen table builders read ``cu_seqlens`` on the host
(one device->host copy), so they belong to eager prefill paths, never inside a CUDA-graph
capture (DESIGN.md invariant 5); graph-captured paths must precompute their tables outside.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def is_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Kernels use it to pick a single pinned config (the interpreter has no benchmarker) and to
    cast ``tl.dot`` operands to float32 (bf16 dots are wrong in the interpreter).
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens: [N+1] -> per-sequence lengths [N] (same dtype and device)."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """cu_seqlens: [N+1] -> chunk_offsets [N+1] int32: sequence n owns global chunks
    ``chunk_offsets[n] .. chunk_offsets[n+1]-1`` (a zero-length sequence owns none).

    Chunks never straddle sequences: sequence n has ceil(len_n / chunk_size) chunks.
    """
    lens = prepare_lens(cu_seqlens.to(torch.int64))
    nchunks = (lens + chunk_size - 1) // chunk_size
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=cu_seqlens.device)
    out[1:] = torch.cumsum(nchunks, 0)
    return out.to(torch.int32)


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """cu_seqlens: [N+1] -> chunk_indices [NT, 2] int32, one row per global chunk:
    ``(sequence n, chunk index within sequence n)``. NT = total chunks over all sequences.

    Host work: reads the lengths once (``.tolist()``); use outside CUDA-graph capture.
    """
    lens = prepare_lens(cu_seqlens.to(torch.int64))
    nchunks = ((lens + chunk_size - 1) // chunk_size).cpu()
    seq = torch.repeat_interleave(torch.arange(nchunks.numel()), nchunks)  # [NT]
    if seq.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int32, device=cu_seqlens.device)
    starts = torch.cumsum(nchunks, 0) - nchunks                              # [N]
    within = torch.arange(seq.numel()) - starts[seq]                         # [NT]
    return torch.stack([seq, within], 1).to(torch.int32).to(cu_seqlens.device)


def num_chunks(T: int, chunk_size: int, cu_seqlens: Optional[torch.Tensor]) -> int:
    """Total number of chunks: B*ceil(T/BT) style per batch row, or the varlen total."""
    if cu_seqlens is None:
        return cdiv(T, chunk_size)
    lens = prepare_lens(cu_seqlens.to(torch.int64))
    return int(((lens + chunk_size - 1) // chunk_size).sum().item())
