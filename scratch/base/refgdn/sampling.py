"""Token sampling and speculative acceptance: pure tensor functions, device ops only.

Shapes (N requests, K = the padded draft count, k_n <= K request n's own draft count, vocabulary V):

    draft_tokens  [N, K]       int   d_1..d_K (columns >= k_n are ignored)
    draft_probs   [N, K, V]    float q_j: the distribution d_{j+1} was drawn from (one-hot for greedy drafts)
    target_logits [N, K+1, V]  float the target's logits at the verified tokens [x, d_1..d_K]; row j
                                     predicts the token after verify token j
    num_drafts    [N]          int   k_n
    -> num_accepted [N] int32 in [1, 1 + k_n]: verify tokens kept (x and the accepted drafts), as
       ``gdn_accept`` / ``Qwen3NextModel.accept`` want;
       tokens [N, K+1] int64: tokens[n, :num_accepted[n]] are the emitted tokens (the accepted drafts,
       then the target's correction or bonus token); -1 after them.

Greedy (temperature 0):   accept d_{j+1} while d_{j+1} == argmax p_j; the first mismatch emits argmax p_j;
                          all k_n accepted: the bonus argmax p_{k_n}.  Emitted = argmax p_0..p_{a-1}.
Rejection sampling:       accept d_{j+1} with probability min(1, p_j(d_{j+1}) / q_j(d_{j+1}));
                          at the first rejection j emit a sample of norm(max(0, p_j - q_j));
                          all k_n accepted: the bonus, a sample of p_{k_n}.
                          (Leviathan et al. 2023 / Chen et al. 2023: the emitted tokens are distributed as
                          the target's, whatever q is.)

No host reads and no data-dependent shapes (a later issue captures these in CUDA graphs). Randomness
comes only from the given ``torch.Generator`` (on the tensors' device), so a seed reproduces a run.
Probabilities are computed in float32 (float64 for float64 logits): softmax of bf16 logits in bf16
would lose the small probabilities the ratio test divides by.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple, Union

import torch

Temperature = Union[float, torch.Tensor]


def _prob_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_temperature(temperature: Temperature, N: int, device) -> None:
    if isinstance(temperature, torch.Tensor):
        if temperature.shape not in ((), (N,)) or not temperature.is_floating_point():
            raise ValueError(f"temperature must be a float or a float tensor [] or [N] = [{N}], "
                             f"got {temperature.dtype}{list(temperature.shape)}")
        if temperature.device != torch.device(device):
            raise ValueError(f"temperature must be on {device}, got {temperature.device}")
    elif not isinstance(temperature, numbers.Real) or temperature < 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")


def is_greedy(temperature: Temperature) -> bool:
    """True when every request decodes greedily (a host check of a host value; a tensor is never assumed greedy)."""
    return not isinstance(temperature, torch.Tensor) and float(temperature) == 0.0


def _temp_column(temperature: Temperature, N: int, device, dtype) -> torch.Tensor:
    """temperature as [N, 1] (0 for greedy rows), on the device."""
    t = torch.as_tensor(temperature, dtype=dtype, device=device)
    return t.expand(N).reshape(N, 1)


def probs_from_logits(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] = softmax(logits / T) in float32 (float64 for float64);
    one-hot of the argmax where T == 0 (the T -> 0 limit), per row when T is a tensor [N] (N = logits.shape[0])."""
    dt = _prob_dtype(logits.dtype)
    x = logits.to(dt)
    onehot = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    if is_greedy(temperature):
        return onehot
    N = x.shape[0]
    t = _temp_column(temperature, N, x.device, dt).view(N, *([1] * (x.dim() - 1)))   # [N, 1, ..., 1]
    soft = torch.softmax(x / torch.where(t > 0, t, 1.0), dim=-1)
    return torch.where(t > 0, soft, onehot)


def sample_from_probs(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """probs: [..., V] (unnormalised is fine) -> tokens [...] int64, one draw per row.

    The exponential race: argmax_v p_v / E_v with E_v ~ Exp(1) iid picks v with probability p_v / sum(p)
    (no cumulative sums, no host sync; a zero-probability token is never picked)."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e).argmax(-1)


def sample_tokens(logits: torch.Tensor, temperature: Temperature,
                  generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] -> (tokens [N] int64, probs [N, V]): argmax where T == 0, else a draw of softmax(logits / T).

    probs is the distribution the token was drawn from (kept as the draft distribution q of speculative
    decoding; one-hot for greedy rows)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {list(logits.shape)}")
    _check_temperature(temperature, logits.shape[0], logits.device)
    probs = probs_from_logits(logits, temperature)
    if is_greedy(temperature):
        return logits.argmax(-1), probs
    drawn = sample_from_probs(probs, generator)
    t = _temp_column(temperature, logits.shape[0], logits.device, probs.dtype)[:, 0]
    return torch.where(t > 0, drawn, logits.argmax(-1)), probs


# ----------------------------------------------------------------------------------------------
# acceptance
# ----------------------------------------------------------------------------------------------

def _check_accept_args(draft_tokens, target_logits, num_drafts, draft_probs=None) -> Tuple[int, int, int]:
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [N, K+1, V], got "
                         f"{list(target_logits.shape) if isinstance(target_logits, torch.Tensor) else target_logits}")
    N, K1, V = target_logits.shape
    K = K1 - 1
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.shape != (N, K) or \
            draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"draft_tokens must be an int tensor [N, K] = [{N}, {K}], got "
                         f"{getattr(draft_tokens, 'dtype', None)}{list(getattr(draft_tokens, 'shape', []))}")
    if not isinstance(num_drafts, torch.Tensor) or num_drafts.shape != (N,) or \
            num_drafts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_drafts must be an int tensor [N] = [{N}], got "
                         f"{getattr(num_drafts, 'dtype', None)}{list(getattr(num_drafts, 'shape', []))}")
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or draft_probs.shape != (N, K, V)
                                    or not draft_probs.is_floating_point()):
        raise ValueError(f"draft_probs must be a float tensor [N, K, V] = [{N}, {K}, {V}], got "
                         f"{getattr(draft_probs, 'dtype', None)}{list(getattr(draft_probs, 'shape', []))}")
    for name, t in (("draft_tokens", draft_tokens), ("num_drafts", num_drafts), ("draft_probs", draft_probs)):
        if t is not None and t.device != target_logits.device:
            raise ValueError(f"{name} must be on {target_logits.device} (target_logits' device), got {t.device}")
    return N, K, V


def _emit(draft_tokens: torch.Tensor, m: torch.Tensor, last: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """m [N] accepted drafts, last [N] the correction/bonus -> (num_accepted = m + 1, tokens [N, K+1])."""
    N, K = draft_tokens.shape
    j = torch.arange(K + 1, device=draft_tokens.device)                          # [K+1]
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_zeros(N, 1).long()], 1)   # [N, K+1]
    tokens = torch.where(j < m[:, None], padded, torch.where(j == m[:, None], last[:, None], -1))
    return (m + 1).to(torch.int32), tokens


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_drafts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.  draft_tokens [N, K], target_logits [N, K+1, V], num_drafts [N]
    -> (num_accepted [N] int32, tokens [N, K+1] int64; module docstring).

        m = #leading j < k_n with d_{j+1} == argmax p_j;  emitted = argmax p_0 .. argmax p_m
    """
    N, K, V = _check_accept_args(draft_tokens, target_logits, num_drafts)
    best = target_logits.argmax(-1)                                               # [N, K+1]
    j = torch.arange(K, device=best.device)
    match = (draft_tokens.long() == best[:, :K]) & (j < num_drafts[:, None])      # [N, K]
    m = match.long().cumprod(1).sum(1)                                            # [N] leading matches
    return _emit(draft_tokens, m, best.gather(1, m[:, None])[:, 0])


def rejection_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                     num_drafts: torch.Tensor, temperature: Temperature,
                     generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling.  draft_tokens [N, K], draft_probs [N, K, V], target_logits [N, K+1, V],
    num_drafts [N], temperature > 0 (float or [N]) -> (num_accepted [N] int32, tokens [N, K+1] int64).

        p_j = softmax(target_logits_j / T);  accept d_{j+1} iff u_j * q_j(d_{j+1}) < p_j(d_{j+1}),  u_j ~ U[0, 1)
        m = #leading accepts (<= k_n);  emitted: d_1..d_m, then a draw of
            norm(max(0, p_m - q_m)) if m < k_n (a rejection), else p_m (the bonus)

    Rows with temperature 0 (a tensor temperature) fall back to :func:`greedy_accept`'s rule.
    """
    N, K, V = _check_accept_args(draft_tokens, target_logits, num_drafts, draft_probs)
    _check_temperature(temperature, N, target_logits.device)
    dt = _prob_dtype(target_logits.dtype)
    p = probs_from_logits(target_logits, temperature)                             # [N, K+1, V]
    q = draft_probs.to(dt)                                                        # [N, K, V]
    d = draft_tokens.long()
    p_d = p[:, :K].gather(-1, d[..., None])[..., 0]                               # [N, K] p_j(d_{j+1})
    q_d = q.gather(-1, d[..., None])[..., 0]                                      # [N, K] q_j(d_{j+1})
    u = torch.rand(N, K, generator=generator, device=p.device, dtype=dt)
    j = torch.arange(K, device=p.device)
    ok = (u * q_d < p_d) & (j < num_drafts[:, None])                              # [N, K]
    m = ok.long().cumprod(1).sum(1)                                               # [N]
    # the distribution of the token emitted at position m: the residual after a rejection, else p_m
    p_m = p.gather(1, m.view(N, 1, 1).expand(N, 1, V))[:, 0]                      # [N, V]
    q_m = q.gather(1, m.clamp(max=max(K - 1, 0)).view(N, 1, 1).expand(N, 1, V))[:, 0] if K else torch.zeros_like(p_m)
    residual = (p_m - q_m).clamp(min=0)
    # a rejection needs p_m(d) < q_m(d), so the residual has mass; the fallback guards rounding only
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_m)
    rejected = (m < num_drafts)[:, None]
    last = sample_from_probs(torch.where(rejected, residual, p_m), generator)     # [N]
    if not is_greedy(temperature) and not isinstance(temperature, torch.Tensor):
        return _emit(d, m, last)
    # per-row temperatures: greedy rows take greedy_accept's answer
    g_acc, g_tok = greedy_accept(draft_tokens, target_logits, num_drafts)
    s_acc, s_tok = _emit(d, m, last)
    greedy_row = _temp_column(temperature, N, p.device, dt)[:, 0] == 0
    return torch.where(greedy_row, g_acc, s_acc), torch.where(greedy_row[:, None], g_tok, s_tok)


def accept_drafts(draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor], target_logits: torch.Tensor,
                  num_drafts: torch.Tensor, temperature: Temperature = 0.0,
                  generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance when temperature is the number 0, else rejection sampling (see both)."""
    if is_greedy(temperature):
        return greedy_accept(draft_tokens, target_logits, num_drafts)
    if draft_probs is None:
        raise ValueError("draft_probs [N, K, V] is required for rejection sampling (temperature > 0)")
    return rejection_accept(draft_tokens, draft_probs, target_logits, num_drafts, temperature, generator)


def chi_square_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof) = Q(dof / 2, stat / 2), the regularised upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))
