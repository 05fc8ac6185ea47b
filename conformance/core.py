"""The conformance rule and the case record shared by every op's cases.

DESIGN.md, "Conformance method": the float64 refgdn result is the truth. A fast result in
precision p passes when

    max|fast_p - truth| <= 2 * max|refgdn_p - truth| + floor(p) * max(1, max|truth|)

where ``refgdn_p`` is the oracle itself run with inputs in precision p (FlashAttention's rule,
with a float64 truth). Exact outputs (indices, untouched slots, copied states) use ``torch.equal``.

A case is a named callable ``run(device) -> list[Check]``; the runner in ``conformance.__main__``
turns every Check into one JSON record.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

# Rounding floor per precision: one unit in the last place of an O(1) value. It only matters when
# refgdn_p happens to be (near-)exact for a case, e.g. a single token with no accumulation.
FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 2.0 ** -20,
    torch.float16: 2.0 ** -10,
    torch.bfloat16: 2.0 ** -7,
}

DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


@dataclasses.dataclass
class Check:
    """One compared tensor of a case.

    name:  what is compared, e.g. ``"o"`` or ``"final_state"``.
    fast:  the fast result (any dtype; compared in float64).
    ref:   refgdn run in the same precision as fast (None when ``exact``).
    truth: refgdn run in float64 (for ``exact`` checks: the tensor fast must equal bit for bit).
    exact: compare with ``torch.equal`` instead of the tolerance rule.
    dtype: the precision the rule's floor is taken from (defaults to ``fast.dtype``).
    """

    name: str
    fast: torch.Tensor
    truth: torch.Tensor
    ref: Optional[torch.Tensor] = None
    exact: bool = False
    dtype: Optional[torch.dtype] = None


@dataclasses.dataclass
class Case:
    """One row-group of the matrix.

    op:          op name, e.g. ``"chunk_gated_delta_rule"``.
    case:        short human id of the shape family, e.g. ``"varlen-empty-len1"``.
    dtype:       input precision under test.
    chunk_size:  BT where applicable, else None.
    draft_steps: k (speculative drafts) where applicable, else None.
    run:         ``run(device: str) -> list[Check]``; builds fresh random inputs itself.
    quick:       whether the case belongs to the CI-size (``--quick``) matrix.
    cost:        relative cost for the worker planner (conformance.runner.shard); 1 for most cases.
    """

    op: str
    case: str
    dtype: torch.dtype
    run: Callable[[str], list]
    chunk_size: Optional[int] = None
    draft_steps: Optional[int] = None
    quick: bool = True
    cost: float = 1.0

    def checks(self, device: str) -> list:
        """``run(device)`` as the matrix runs it (conformance.runner, tests): a bfloat16 case, where kernels run in the
        Triton interpreter, with fp32 -> bf16 casts rounding to nearest even as a GPU's do
        (fast.utils.interpreter_bf16_round_to_nearest; the interpreter truncates them, which roughly doubles every
        in-kernel bf16 rounding error, all toward zero), restored after the run."""
        if self.dtype != torch.bfloat16:
            return self.run(device)
        from fast.utils import interpreter_bf16_round_to_nearest
        with interpreter_bf16_round_to_nearest():
            return self.run(device)


def evaluate(check: Check) -> dict:
    """Apply the conformance rule to one Check; return ``error``, ``ref_error``, ``ratio``, ``passed``."""
    fast = check.fast.detach().to("cpu")
    truth = check.truth.detach().to("cpu")
    if fast.shape != truth.shape:
        return dict(error=float("inf"), ref_error=0.0, ratio=float("inf"), passed=False,
                    detail=f"shape {tuple(fast.shape)} != {tuple(truth.shape)}")
    if check.exact:
        equal = torch.equal(fast, truth)
        err = 0.0 if equal else float((fast.double() - truth.double()).abs().nan_to_num(float("inf")).max())
        return dict(error=err, ref_error=0.0, ratio=0.0 if equal else float("inf"), passed=equal)
    if fast.numel() == 0:
        return dict(error=0.0, ref_error=0.0, ratio=0.0, passed=True)
    truth = truth.double()
    err = (fast.double() - truth).abs().nan_to_num(float("inf")).max().item()
    ref_err = (check.ref.detach().to("cpu").double() - truth).abs().max().item()
    dtype = check.dtype or check.fast.dtype
    floor = FLOOR[dtype] * max(1.0, truth.abs().max().item())
    bound = 2.0 * ref_err + floor
    return dict(error=err, ref_error=ref_err, ratio=err / bound, passed=bool(err <= bound))


def row_checks(what: str, before: torch.Tensor, fast: torch.Tensor, truth: torch.Tensor, ref: torch.Tensor,
               written: str = "written", untouched: str = "untouched", dtype: Optional[torch.dtype] = None) -> list:
    """The rows (dim 0) of a state pool or cache an op writes in place, by the rule (the floor of ``dtype``, default
    the rows' own: a chunked prefill's states carry its inputs' precision); every other row exact. Which rows are
    written: those where refgdn_p's result differs from ``before``."""
    moved = [i for i in range(before.shape[0]) if not torch.equal(ref[i], before[i])]
    still = [i for i in range(before.shape[0]) if i not in moved]
    return [Check(f"{written} {what}", fast[moved], truth[moved], ref[moved], dtype=dtype or before.dtype),
            Check(f"{untouched} {what}", fast[still], before[still], exact=True)]

