"""refgdn.sampling: greedy acceptance against a host loop, rejection sampling preserves the target
distribution (chi-square over fixed seeds on a tiny vocabulary), the chi-square test has power (it
rejects the draft distribution), argument errors, no host reads."""
from __future__ import annotations

import math

import pytest
import torch

from refgdn.sampling import (accept_drafts, chi_square_sf, greedy_accept, probs_from_logits, rejection_accept,
                             sample_tokens)


def _greedy_host(draft, logits, k):
    """The rule written as a plain loop over Python lists."""
    best = logits.argmax(-1).tolist()
    out = []
    for n in range(len(k)):
        toks = []
        for j in range(k[n]):
            if draft[n][j] != best[n][j]:
                break
            toks.append(draft[n][j])
        toks.append(best[n][len(toks)])
        out.append(toks)
    return out


def test_greedy_accept_matches_a_host_loop():
    gen = torch.Generator().manual_seed(0)
    N, K, V = 64, 5, 4                                   # tiny vocabulary: drafts often match
    logits = torch.randn(N, K + 1, V, generator=gen, dtype=torch.float64)
    best = logits.argmax(-1)
    # drafts agree with the target's argmax at random, so every acceptance length occurs
    agree = torch.rand(N, K, generator=gen) < 0.7
    draft = torch.where(agree, best[:, :K], torch.randint(0, V, (N, K), generator=gen))
    k = torch.randint(0, K + 1, (N,), generator=gen)
    acc, toks = greedy_accept(draft, logits, k)
    want = _greedy_host(draft.tolist(), logits, k.tolist())
    assert acc.dtype == torch.int32
    for n in range(N):
        a = int(acc[n])
        assert 1 <= a <= 1 + int(k[n])
        assert toks[n, :a].tolist() == want[n], n
        assert (toks[n, a:] == -1).all()
    seen = set(acc.tolist())
    assert {1, 2, K + 1} <= seen, seen                   # rejections at once, partial, and full acceptance


def test_temperature_zero_rejection_equals_greedy():
    """Per-row temperatures: rows at T = 0 take the greedy answer exactly."""
    gen = torch.Generator().manual_seed(1)
    N, K, V = 16, 3, 6
    logits = torch.randn(N, K + 1, V, generator=gen, dtype=torch.float64)
    draft = torch.randint(0, V, (N, K), generator=gen)
    k = torch.full((N,), K)
    temp = torch.tensor([0.0, 1.0] * (N // 2), dtype=torch.float64)
    q = probs_from_logits(torch.randn(N, K, V, generator=gen, dtype=torch.float64), temp)
    acc, toks = rejection_accept(draft, q, logits, k, temp, torch.Generator().manual_seed(3))
    g_acc, g_tok = greedy_accept(draft, logits, k)
    assert torch.equal(acc[0::2], g_acc[0::2]) and torch.equal(toks[0::2], g_tok[0::2])


def _first_token_histogram(p_logits, q_logits, N, K, seed, temperature=1.0, k_of=None, mutant=None):
    """N independent rows with the same target (p) and draft (q) distributions at every position: drafts drawn
    from q, then rejection_accept; returns the histogram of the first emitted token."""
    V = p_logits.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    q = probs_from_logits(q_logits.expand(N, K, V).contiguous(), temperature)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(N, K)
    logits = p_logits.expand(N, K + 1, V).contiguous()
    k = torch.full((N,), K) if k_of is None else k_of(N)
    if mutant == "accept_all":          # no correction: the emitted token is the draft (must fail the test)
        first = draft[:, 0]
    else:
        acc, toks = rejection_accept(draft, q, logits, k, temperature, gen)
        assert bool((toks.gather(1, (acc - 1).long()[:, None]) >= 0).all())
        first = toks[:, 0]
    return torch.bincount(first, minlength=V).double()


def _chi2_p(hist, probs):
    expected = probs * hist.sum()
    stat = float(((hist - expected) ** 2 / expected).sum())
    return chi_square_sf(stat, hist.numel() - 1)


V_TINY = 6
P_LOGITS = torch.tensor([1.2, -0.3, 0.5, 0.0, -1.5, 0.9], dtype=torch.float64)
Q_LOGITS = torch.tensor([-0.4, 1.0, 0.8, -1.0, 0.3, -0.2], dtype=torch.float64)   # a different distribution


def test_chi_square_sf_against_known_values():
    # chi-square(1): P(X >= 3.841459) = 0.05; chi-square(5): P(X >= 11.0705) = 0.05; chi-square(2): exp(-x/2)
    assert abs(chi_square_sf(3.841459, 1) - 0.05) < 1e-6
    assert abs(chi_square_sf(11.070498, 5) - 0.05) < 1e-6
    assert abs(chi_square_sf(4.0, 2) - math.exp(-2.0)) < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_preserves_the_target_distribution(temperature):
    p = probs_from_logits(P_LOGITS[None], temperature)[0]
    q = probs_from_logits(Q_LOGITS[None], temperature)[0]
    assert float((p - q).abs().sum()) > 0.5                      # the draft really differs
    for seed in (0, 1, 2):
        hist = _first_token_histogram(P_LOGITS, Q_LOGITS, 20000, 3, seed, temperature)
        pval = _chi2_p(hist, p)
        assert pval > 1e-3, (seed, pval, hist, p)
    # mixed k per row (k = 0: the bonus token is the first one), the same target distribution
    hist = _first_token_histogram(P_LOGITS, Q_LOGITS, 20000, 3, 7, temperature,
                                  k_of=lambda N: torch.arange(N) % 4)
    assert _chi2_p(hist, p) > 1e-3


def test_second_token_follows_the_target_too():
    """Emitted token 2 (when emitted) of rows whose first draft was accepted: also ~ p (positions are iid here)."""
    N, K = 30000, 2
    gen = torch.Generator().manual_seed(5)
    q = probs_from_logits(Q_LOGITS.expand(N, K, V_TINY).contiguous(), 1.0)
    p = probs_from_logits(P_LOGITS[None], 1.0)[0]
    draft = torch.multinomial(q.reshape(-1, V_TINY), 1, generator=gen).view(N, K)
    acc, toks = rejection_accept(draft, q, P_LOGITS.expand(N, K + 1, V_TINY).contiguous(), torch.full((N,), K),
                                 1.0, gen)
    second = toks[acc >= 2, 1]
    assert second.numel() > 5000
    assert _chi2_p(torch.bincount(second, minlength=V_TINY).double(), p) > 1e-3


def test_the_chi_square_test_rejects_the_uncorrected_draft():
    """Power: emitting the draft without the acceptance test fails the same check (so the check can fail)."""
    p = probs_from_logits(P_LOGITS[None], 1.0)[0]
    hist = _first_token_histogram(P_LOGITS, Q_LOGITS, 20000, 3, 0, mutant="accept_all")
    assert _chi2_p(hist, p) < 1e-3


def test_sampling_is_reproducible_and_samples_the_softmax():
    logits = P_LOGITS.expand(20000, V_TINY).contiguous()
    t1, pr = sample_tokens(logits, 1.0, torch.Generator().manual_seed(4))
    t2, _ = sample_tokens(logits, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(t1, t2)
    assert _chi2_p(torch.bincount(t1, minlength=V_TINY).double(), pr[0]) > 1e-3
    g, pg = sample_tokens(logits[:3], 0.0)
    assert torch.equal(g, logits[:3].argmax(-1)) and torch.equal(pg.argmax(-1), g) and float(pg.sum()) == 3.0


def test_argument_errors():
    logits = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match="draft_tokens must be an int tensor \\[N, K\\] = \\[2, 3\\]"):
        greedy_accept(torch.zeros(2, 2, dtype=torch.long), logits, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_drafts must be an int tensor \\[N\\]"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), logits, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs must be a float tensor \\[N, K, V\\]"):
        rejection_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 4), logits,
                         torch.ones(2, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="temperature must be a float >= 0"):
        sample_tokens(logits[:, 0], -1.0)
    with pytest.raises(ValueError, match="draft_probs .* is required"):
        accept_drafts(torch.zeros(2, 3, dtype=torch.long), None, logits, torch.ones(2, dtype=torch.long), 0.5)


def test_acceptance_does_no_host_reads(monkeypatch):
    """The acceptance functions run with every host read of a tensor made to fail."""
    gen = torch.Generator().manual_seed(0)
    N, K, V = 4, 3, 5
    logits = torch.randn(N, K + 1, V, generator=gen)
    draft = torch.randint(0, V, (N, K), generator=gen)
    q = probs_from_logits(torch.randn(N, K, V, generator=gen), 1.0)
    k = torch.tensor([0, 1, 2, 3])

    def boom(*a, **kw):
        raise AssertionError("host read")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    greedy_accept(draft, logits, k)
    rejection_accept(draft, q, logits, k, 1.0, gen)
    rejection_accept(draft, q, logits, k, torch.full((N,), 0.5), gen)
    sample_tokens(logits[:, 0], 0.8, gen)
