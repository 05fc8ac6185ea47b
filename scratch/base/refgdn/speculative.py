"""Plain and speculative (MTP) generation over a :class:`refgdn.model.Qwen3NextModel`, either ops namespace.

    out = generate_plain(model, prompts, max_new_tokens, temperature=0.0, seed=0)
    out = generate_speculative(model, prompts, max_new_tokens, draft_steps=3, temperature=0.0, seed=0)
    out.tokens[n]        the generated tokens of request n (host ints)
    out.rounds           speculative: per round, the requests in it with their k_n and num_accepted

prompts: a list of 1-D int token sequences (any lengths >= 1, one varlen prefill); max_new_tokens,
draft_steps: an int, or one per request; eos_token_id: a request stops after emitting it.

A speculative round, for the requests still running (module :mod:`refgdn.model.core` states the MTP
lag rule it follows):

    1. MTP catch-up (draft step 0, varlen): the tokens committed last round (or the prompt's) with the
       target's hiddens  ->  d_1 ~ q_1   (greedy: argmax; else softmax(logits / T), q kept)
    2. draft steps j = 1 .. K-1 (one token per request, rows with k_n <= j padded with slot -1):
       metadata rebuilt for step j's positions  ->  d_{j+1} ~ q_{j+1}
    3. target verify of [x, d_1 .. d_{k_n}] (1 + k_n tokens per request, gdn_verify)
    4. acceptance (refgdn.sampling): num_accepted a_n in [1, 1 + k_n], emitted tokens
    5. model.accept(a): gdn_accept on every GDN layer, KV lengths of target and MTP head rolled back
    6. the round's one host read: a_n and the emitted tokens (d_1 .. d_{a-1}, then the correction / bonus)

Steps 1-5 run without host reads (shapes come from host values known at the start of the round), so
a later issue can capture them in CUDA graphs. Each request's k_n is min(its draft_steps, tokens left - 1),
so a request never overshoots max_new_tokens and the cache needs only prompt + max_new_tokens positions.

``draft_metadata(model, cache, state_indices, step)`` builds the metadata of draft step ``step`` >= 1
(default: fresh from the MTP lengths, :func:`fresh_draft_metadata`); it is a parameter so tests can show
that a stale builder (step 1's metadata replayed, the bug of vLLM PR 41162) is caught.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, ContextManager, List, Optional, Sequence, Union

import torch

from .model import ModelCache, StepMetadata
from .sampling import Temperature, accept_drafts, sample_tokens

I32 = torch.int32
IntOrList = Union[int, Sequence[int]]

__all__ = ["GenerationResult", "RoundRecord", "generate_plain", "generate_speculative", "fresh_draft_metadata"]


@dataclasses.dataclass
class RoundRecord:
    """One speculative round: the requests in it (indices into prompts), their k_n and num_accepted."""

    requests: List[int]
    num_drafts: List[int]
    num_accepted: List[int]


@dataclasses.dataclass
class GenerationResult:
    """tokens[n]: generated tokens of request n.  rounds: speculative rounds (empty for plain decoding).
    steps: target forward passes after the prefill (decode steps or verify rounds).  seconds: wall time
    (prefill included; the device is synchronised at the end).  step_logits (plain, record_logits=True):
    per decode step (requests, logits [n, V]) including the prefill's last-token logits as step 0."""

    tokens: List[List[int]]
    rounds: List[RoundRecord] = dataclasses.field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    step_logits: list = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts over all rounds (nan with no drafts)."""
        prop = sum(sum(r.num_drafts) for r in self.rounds)
        acc = sum(a - 1 for r in self.rounds for a in r.num_accepted)
        return acc / prop if prop else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per request per round (= mean num_accepted, the bonus counted)."""
        vals = [a for r in self.rounds for a in r.num_accepted]
        return sum(vals) / len(vals) if vals else float("nan")

    def accept_histogram(self) -> dict:
        """{num_accepted: how many request-rounds}."""
        out: dict = {}
        for r in self.rounds:
            for a in r.num_accepted:
                out[a] = out.get(a, 0) + 1
        return dict(sorted(out.items()))


@dataclasses.dataclass
class RoundInfo:
    """What ``on_round`` sees after each speculative round's acceptance (and the model's accept).

    requests, slots, num_drafts, num_accepted: host lists over the round's requests; emitted: host lists
    (the a_n tokens emitted, before eos / budget truncation); verify_logits [n, 1+K, V] and draft_logits
    [n, K, V] (device; row j of request n valid for j <= k_n / j < k_n); draft_metas: the metadata of
    draft steps 0..K-1; sequences[n]: request n's committed tokens (prompt + generated, host) after the round;
    cache: the live cache (read only!)."""

    index: int
    requests: List[int]
    slots: List[int]
    num_drafts: List[int]
    num_accepted: List[int]
    emitted: List[List[int]]
    verify_logits: torch.Tensor
    draft_logits: torch.Tensor
    draft_metas: List[StepMetadata]
    sequences: List[List[int]]
    cache: ModelCache


def fresh_draft_metadata(model, cache: ModelCache, state_indices: torch.Tensor, step: int) -> StepMetadata:
    """Metadata of single-token draft step ``step`` >= 1, rebuilt from the MTP head's current lengths
    (each step advanced them by one): positions = mtp_kv_lens[slot], slot mapping slot * max_len + position."""
    n = state_indices.shape[0]
    qsl = torch.arange(n + 1, dtype=I32, device=state_indices.device)
    return model.metadata(cache, state_indices, qsl, n, mtp=True)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _per_request(name: str, val: IntOrList, N: int, lo: int) -> List[int]:
    vals = [val] * N if isinstance(val, int) else list(val)
    if len(vals) != N or any(not isinstance(v, int) or v < lo for v in vals):
        raise ValueError(f"{name} must be an int >= {lo} or a list of {N} such ints, got {val!r}")
    return vals


def _prompts(prompts) -> List[List[int]]:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of 1-D int token sequences")
    out = []
    for n, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.is_floating_point():
                raise ValueError(f"prompts[{n}] must be a 1-D int tensor [T], got {p.dtype}{list(p.shape)}")
            p = p.tolist()
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompts[{n}] is empty: every prompt needs at least one token")
        out.append(p)
    return out


def _setup(model, prompts, max_new_tokens, k_max, slots, cache, seed, generator):
    ps = _prompts(prompts)
    N = len(ps)
    V = model.config.vocab_size
    for n, p in enumerate(ps):
        if min(p) < 0 or max(p) >= V:
            raise ValueError(f"prompts[{n}] has a token outside [0, vocab_size={V})")
    budget = _per_request("max_new_tokens", max_new_tokens, N, 1)
    slots = list(range(N)) if slots is None else [int(s) for s in slots]
    if len(slots) != N or len(set(slots)) != N or min(slots) < 0:
        raise ValueError(f"slots must be {N} distinct ints >= 0, got {slots}")
    need_len = max(len(p) + b for p, b in zip(ps, budget)) + 1
    if cache is None:
        cache = model.allocate_cache(max(slots) + 1, need_len, max_draft=k_max)
    else:
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache must be a ModelCache, got {type(cache).__name__}")
        if cache.num_slots <= max(slots) or cache.max_len < need_len or cache.max_draft < k_max:
            raise ValueError(f"cache must have num_slots > {max(slots)}, max_len >= {need_len} and max_draft >= "
                             f"{k_max}; got {cache.num_slots}, {cache.max_len}, {cache.max_draft}")
    cache.reset(slots)
    dev = model.device
    if generator is None:
        generator = torch.Generator(device=dev).manual_seed(int(seed))
    return ps, N, budget, slots, cache, generator, dev


def _prefill(model, cache, ps, slots, dev):
    """Varlen prefill of every prompt -> (hidden [T, hidden], last-token logits [N, V], token offsets)."""
    lens = [len(p) for p in ps]
    offs = [0]
    for L in lens:
        offs.append(offs[-1] + L)
    ids = torch.tensor([t for p in ps for t in p], dtype=torch.int64, device=dev)
    si = torch.tensor(slots, dtype=I32, device=dev)
    qsl_cpu = torch.tensor(offs, dtype=I32)
    hidden = model.prefill(cache, ids, model.metadata(cache, si, qsl_cpu.to(dev), offs[-1]), qsl_cpu)
    last = torch.tensor([o - 1 for o in offs[1:]], device=dev)
    return hidden, model.logits(hidden.index_select(0, last)), offs


def _finish(new: List[int], budget_left: int, eos: Optional[int]):
    """Truncate a request's newly emitted tokens at the budget and after eos -> (kept, finished)."""
    kept = new[:budget_left]
    if eos is not None and eos in kept:
        kept = kept[:kept.index(eos) + 1]
        return kept, True
    return kept, len(kept) >= budget_left


def _check_faults(cache: ModelCache) -> None:
    """Surface a fault a fast kernel recorded on the device (ModelCache.check: one small read, at the round's sync)."""
    cache.check()


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


# ----------------------------------------------------------------------------------------------
# plain generation
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def generate_plain(model, prompts, max_new_tokens: IntOrList, *, temperature: Temperature = 0.0,
                   eos_token_id: Optional[int] = None, seed: int = 0, generator: Optional[torch.Generator] = None,
                   slots: Optional[Sequence[int]] = None, cache: Optional[ModelCache] = None,
                   record_logits: bool = False, progress: Optional[Callable[[int], None]] = None) -> GenerationResult:
    """Prefill the prompts (varlen), then one decode step per token: x_{t+1} = argmax or a draw of
    softmax(logits_t / T).  Finished requests leave the batch; one host read per step (the sampled tokens)."""
    t0 = time.perf_counter()
    ps, N, budget, slots, cache, gen, dev = _setup(model, prompts, max_new_tokens, 0, slots, cache, seed, generator)
    _, logits, _ = _prefill(model, cache, ps, slots, dev)
    active = list(range(N))
    out = [[] for _ in range(N)]
    res = GenerationResult(out)
    while True:
        tok, _ = sample_tokens(logits, temperature, gen)                       # [n]
        if record_logits:
            res.step_logits.append((list(active), logits.clone()))
        tok_h = tok.tolist()                                                   # the step's one host read
        _check_faults(cache)
        still, keep = [], []
        for i, n in enumerate(active):
            kept, done = _finish([tok_h[i]], budget[n] - len(out[n]), eos_token_id)
            out[n] += kept
            if progress:
                progress(len(kept))
            if not done:
                still.append(n)
                keep.append(i)
        if not still:
            break
        active = still
        sel = torch.tensor(keep, device=dev)
        si = torch.tensor([slots[n] for n in active], dtype=I32, device=dev)
        meta = model.metadata(cache, si, torch.arange(len(active) + 1, dtype=I32, device=dev), len(active))
        logits = model.logits(model.decode(cache, tok.index_select(0, sel), meta))
        res.steps += 1
    _sync(dev)
    res.seconds = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------------------------
# speculative generation
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def generate_speculative(model, prompts, max_new_tokens: IntOrList, draft_steps: IntOrList, *,
                         temperature: Temperature = 0.0, eos_token_id: Optional[int] = None, seed: int = 0,
                         generator: Optional[torch.Generator] = None, slots: Optional[Sequence[int]] = None,
                         cache: Optional[ModelCache] = None,
                         draft_metadata: Callable = fresh_draft_metadata,
                         on_round: Optional[Callable[[RoundInfo], None]] = None,
                         progress: Optional[Callable[[int], None]] = None,
                         round_guard: Callable[[], ContextManager] = contextlib.nullcontext) -> GenerationResult:
    """Prefill, then rounds of k MTP draft steps + one verify of 1 + k tokens + acceptance + rollback
    (module docstring).  draft_steps: k per request (>= 0).  temperature 0: greedy acceptance (the tokens of
    :func:`generate_plain` exactly); > 0: rejection sampling (the target's distribution).

    round_guard(): a context manager entered around steps 1-5 of every round (the part a CUDA graph could
    capture); tests pass one that fails on any host read."""
    if not model.has_mtp:
        raise ValueError("speculative generation needs a model with an MTP head (model.has_mtp is False)")
    t0 = time.perf_counter()
    ks = _per_request("draft_steps", draft_steps, len(_prompts(prompts)), 0)
    ps, N, budget, slots, cache, gen, dev = _setup(model, prompts, max_new_tokens, max(ks), slots, cache, seed,
                                                   generator)
    hidden, logits, offs = _prefill(model, cache, ps, slots, dev)
    x, _ = sample_tokens(logits, temperature, gen)                             # x_T per request
    x_h = x.tolist()                                                           # the prefill's host read
    out = [[] for _ in range(N)]
    res = GenerationResult(out)
    active = []
    for n in range(N):
        kept, done = _finish([x_h[n]], budget[n], eos_token_id)
        out[n] += kept
        if progress:
            progress(len(kept))
        if not done:
            active.append(n)
    # the first catch-up: MTP position p takes (token p+1, target hidden h_p) for the whole prompt
    c_ids = torch.tensor([t for n in active for t in ps[n][1:] + [x_h[n]]], dtype=torch.int64, device=dev)
    c_hidden = hidden.index_select(0, torch.tensor([i for n in active for i in range(offs[n], offs[n + 1])],
                                                   dtype=torch.long, device=dev))
    c_counts = [len(ps[n]) for n in active]
    last = x.index_select(0, torch.tensor(active, dtype=torch.long, device=dev))   # [n] the last sampled token
    V = model.config.vocab_size
    r = 0
    while active:
        n_a = len(active)
        k_n = [min(ks[n], budget[n] - len(out[n]) - 1) for n in active]
        K = max(k_n)
        si_h = [slots[n] for n in active]
        si = torch.tensor(si_h, dtype=I32, device=dev)
        with round_guard():      # steps 1-5: no host reads (tests pass a guard that fails on any)
            # ---- 1. MTP catch-up (draft step 0), varlen --------------------------------------------------
            c_offs = [0]
            for c in c_counts:
                c_offs.append(c_offs[-1] + c)
            meta0 = model.metadata(cache, si, torch.tensor(c_offs, dtype=I32, device=dev), c_offs[-1], mtp=True)
            mh = model.mtp(cache, c_ids, c_hidden, meta0)
            h = mh.index_select(0, torch.tensor([o - 1 for o in c_offs[1:]], dtype=torch.long, device=dev))
            drafts, qs, dlogits, metas = [], [], [], [meta0]
            # ---- 2. single-token draft steps --------------------------------------------------------------
            for j in range(K):
                dl = model.logits(h)
                d, q = sample_tokens(dl, temperature, gen)
                drafts.append(d)
                qs.append(q)
                dlogits.append(dl)
                if j + 1 < K:
                    si_j = torch.tensor([s if kn > j + 1 else -1 for s, kn in zip(si_h, k_n)], dtype=I32, device=dev)
                    meta_j = draft_metadata(model, cache, si_j, j + 1)
                    metas.append(meta_j)
                    h = model.mtp(cache, d, h, meta_j)
            D = torch.stack(drafts, 1) if K else torch.zeros(n_a, 0, dtype=torch.int64, device=dev)        # [n, K]
            Q = torch.stack(qs, 1) if K else torch.zeros(n_a, 0, V, dtype=torch.float32, device=dev)       # [n, K, V]
            DL = torch.stack(dlogits, 1) if K else torch.zeros(n_a, 0, V, dtype=model.dtype, device=dev)
            # ---- 3. verify [x, d_1 .. d_{k_n}] ----------------------------------------------------------------
            full = torch.cat([last[:, None], D], 1).reshape(-1)                       # [n * (1+K)]
            v_offs = [0]
            for kn in k_n:
                v_offs.append(v_offs[-1] + 1 + kn)
            pick = torch.tensor([i * (1 + K) + j for i, kn in enumerate(k_n) for j in range(1 + kn)], device=dev)
            meta_v = model.metadata(cache, si, torch.tensor(v_offs, dtype=I32, device=dev), v_offs[-1])
            vh = model.verify(cache, full.index_select(0, pick), meta_v)              # [T_v, hidden]
            vl = model.logits(vh)                                                     # [T_v, V]
            # padded [n, 1+K, V]: row j of request i is its verify token min(j, k_i) (rows past k_i unused)
            gidx = torch.tensor([[v_offs[i] + min(j, kn) for j in range(1 + K)] for i, kn in enumerate(k_n)],
                                device=dev)
            TL = vl[gidx]
            # ---- 4. + 5. acceptance and rollback ------------------------------------------------------------
            k_dev = torch.tensor(k_n, dtype=torch.int64, device=dev)
            acc, emitted = accept_drafts(D, Q, TL, k_dev, temperature, gen)
            model.accept(cache, si, acc)
        # ---- 6. the round's host read ----------------------------------------------------------------------
        both = torch.cat([acc[:, None].long(), emitted], 1).tolist()
        _check_faults(cache)
        a_h = [row[0] for row in both]
        em_h = [row[1:1 + row[0]] for row in both]
        res.rounds.append(RoundRecord(list(active), list(k_n), list(a_h)))
        res.steps += 1
        still, keep = [], []
        for i, n in enumerate(active):
            kept, done = _finish(em_h[i], budget[n] - len(out[n]), eos_token_id)
            out[n] += kept
            if progress:
                progress(len(kept))
            if not done:
                still.append(n)
                keep.append(i)
        if on_round is not None:
            on_round(RoundInfo(r, list(active), si_h, list(k_n), a_h, em_h, TL, DL, metas,
                               [ps[n] + out[n] for n in active], cache))
        r += 1
        # next catch-up: the a_i emitted tokens with the verify hiddens of the a_i kept verify tokens
        c_counts = [a_h[i] for i in keep]
        rows = torch.tensor([v_offs[i] + j for i in keep for j in range(a_h[i])], dtype=torch.long, device=dev)
        c_hidden = vh.index_select(0, rows)
        c_ids = emitted.reshape(-1).index_select(
            0, torch.tensor([i * (1 + K) + j for i in keep for j in range(a_h[i])], dtype=torch.long, device=dev))
        last = emitted.reshape(-1).index_select(
            0, torch.tensor([i * (1 + K) + a_h[i] - 1 for i in keep], dtype=torch.long, device=dev))
        active = still
    _sync(dev)
    res.seconds = time.perf_counter() - t0
    return res
