"""Real CUDA graphs for the model's decode, verify and MTP draft steps, driven by refgdn.capture's lifecycle.

    gm = GraphedModel(model, cache, batch_sizes=(1, 2, 4, 8), max_draft=3)   # model: refgdn.model, ops=fast
    gm.setup(profile=lambda: profile_traffic(model, cfg))   # profile -> (cache given) -> warmup + capture
    logits = gm.decode(ids [n], state_indices [n])           # graph of the smallest batch >= n, else eager
    logits = gm.verify(ids [n*(1+k)], state_indices [n], k)
    tok = gm.draft(step, state_indices [n])                  # the captured MTP step, once per draft step

The lifecycle is :class:`refgdn.capture.Lifecycle` with :class:`CudaGraphBackend`: the same state machine
and named errors as on the CPU, with ``torch.cuda.CUDAGraph`` underneath (one memory pool shared by
every graph, captured on a side stream). Per DESIGN.md's invariants:

1. warmup launches the path capture takes (``make_step(desc, warmup)``, same code, fresh metadata), and
   a recorder on Triton's launch path raises CompileDuringCapture before a first launch inside capture;
   Triton's ``jit_post_compile_hook`` counts real compilations per phase (``lifecycle.real_compiles``);
2. nothing compiles or autotunes after the cache is reserved (CompileAfterReserve / AutotuneAfterReserve);
3. warmup and capture get separate StepMetadata objects (decode / verify build theirs inside the graph
   from the static slot and token buffers: build_step_metadata is device ops only, so a replay copies
   the ids and slots and nothing else);
4. the MTP draft step is captured once per padded batch and replayed once per draft step; the step
   index is a device scalar (it picks the output column inside the graph) and the attention metadata
   (positions, sequence lengths, slot mapping) is rebuilt from the device lengths and copied into the
   static buffers before each replay;
5. no host syncs in capture (guards), static buffers keep their addresses (checked at replay).

On a CPU the same class runs with refgdn.capture's simulated graphs (tests/test_capture.py).
``cuda_graphs=False`` runs every step eagerly through the same padding and metadata code (the switch of
mamba's DecodingCGCache / gpt-fast). The first MTP step of a round (varlen: the accepted tokens) runs
eagerly; the later single-token draft steps use the graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Optional, Sequence

import torch

from refgdn.capture import (CaptureDescriptor, KeyLog, Lifecycle, ServingConfig, StepSpec, capture_guards, plan,
                            prefill_classes, recording)

__all__ = ["CudaGraphBackend", "GraphedModel", "profile_traffic", "lifecycle_report"]

I32 = torch.int32


class _CudaGraph:
    def __init__(self, desc, pool, stream):
        self.desc, self.pool, self.stream = desc, pool, stream
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    @contextlib.contextmanager
    def warmup_context(self):
        """Warmup runs on the capture's side stream (cuBLAS handles / workspaces of that stream are made
        here, not inside the capture), joined with the current stream on both sides."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()

    def capture(self, fn, lifecycle: Lifecycle):
        g = torch.cuda.CUDAGraph()
        where = f"capture of {self.desc}"
        torch.cuda.synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), recording(lifecycle), torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool)
            try:
                with capture_guards(where, lifecycle.device):
                    out = fn()
            except BaseException:
                try:                      # end the broken capture so the stream is usable again; keep our error
                    g.capture_end()
                except Exception:  # noqa: BLE001
                    pass
                raise
            g.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()
        self.graph = g
        return out

    def replay(self):
        self.graph.replay()


class CudaGraphBackend:
    """``backend(desc)`` -> a graph whose capture/replay is torch.cuda.CUDAGraph's; one pool for all graphs."""

    def __init__(self, device="cuda"):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, desc):
        return _CudaGraph(desc, self.pool, self.stream)


@dataclasses.dataclass
class _DraftBuffers:
    ids: torch.Tensor          # [N] int64: this step's input token per request
    hidden: torch.Tensor       # [N, hidden]: the MTP's previous output (or the target's hidden)
    step: torch.Tensor         # [] int64 device scalar: the draft step index
    drafts: torch.Tensor       # [N, max_draft] int64: draft token of step j in column j


class GraphedModel:
    """A refgdn.model Qwen3NextModel with CUDA graphs for decode / verify / MTP draft steps (module docstring).

    model, cache: the model and its ModelCache (allocated by ``setup``'s reserve when None);
    batch_sizes: padded batch sizes captured; max_draft: verify graphs for k = 1..max_draft and the draft
    graph; cuda_graphs: False = eager everywhere (same code path otherwise); state_dtype: the GDN ssm state of
    the cache ``setup`` allocates (None: the model's default, float32; a plan's ServingConfig.state_dtype
    must agree).
    """

    def __init__(self, model, cache=None, batch_sizes: Sequence[int] = (1, 2, 4, 8), max_draft: int = 0,
                 cuda_graphs: bool = True, num_slots: int = 8, max_len: int = 256,
                 state_dtype: Optional[torch.dtype] = None):
        self.m = model
        self.cache = cache
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_draft = max_draft
        self.cuda_graphs = bool(cuda_graphs)
        self.num_slots, self.max_len, self.state_dtype = num_slots, max_len, state_dtype
        # on a CPU the graphs are refgdn.capture's simulated ones (same lifecycle, same checks)
        backend = CudaGraphBackend(model.device) if self.cuda_graphs and model.device.type == "cuda" else None
        self.lc = Lifecycle(model.device, graph_backend=backend, check_drafts=model.device.type == "cpu")
        self.drafts: Dict[CaptureDescriptor, _DraftBuffers] = {}

    # ------------------------------------------------------------------ lifecycle
    def setup(self, profile=None, planned=None):
        """profile (``profile()`` launches every variant) -> reserve the cache -> warmup + capture every graph.
        planned: keys the profile must have launched (``plan(model, cfg).keys``), checked before reserve."""
        self.lc.profile(profile or (lambda: None))
        if planned is not None:
            self.lc.check_profiled(planned)
        if self.cache is None:
            self.cache = self.lc.reserve(lambda: self.m.allocate_cache(self.num_slots, self.max_len,
                                                                        max_draft=self.max_draft,
                                                                        state_dtype=self.state_dtype))
        else:
            self.lc.reserve(lambda: self.cache)
        if not self.cuda_graphs:
            self.lc.serve()
            return self
        for desc in self.descriptors():
            self.lc.capture(desc, self._make_step)
        for i, gc in enumerate(self.cache.gdn):
            self.lc.watch(f"gdn[{i}].ssm_state", lambda gc=gc: gc.ssm_state)
        return self

    def descriptors(self):
        cfg = ServingConfig(capture_batch_sizes=self.batch_sizes, max_draft=self.max_draft)
        return cfg.descriptors() if self.m.has_mtp else [d for d in cfg.descriptors() if d.mode != "draft"]

    def _pad_meta(self, mode, N, T, si=None, mtp=False):
        """Metadata of a padded step: real rows first (state_indices si), padded rows slot -1."""
        dev = self.m.device
        full = torch.full((N,), -1, dtype=I32, device=dev)
        if si is not None:
            full[:si.shape[0]] = si
        qsl = torch.arange(N + 1, dtype=I32, device=dev) * T
        return self.m.metadata(self.cache, full, qsl, N * T, mtp=mtp)

    def _fill_inputs(self, desc: CaptureDescriptor, ids, state_indices) -> None:
        """ids [n*T], state_indices [n] -> written straight into the graph's static inputs (padded rows:
        slot -1; their ids are left as they are: a padded row's tokens are never read into a real slot)."""
        n = state_indices.shape[0]
        inp = self.lc.steps[desc].spec.inputs
        inp["ids"][:n * desc.tokens].copy_(ids)
        inp["state_indices"][:n].copy_(state_indices)
        if n < desc.batch:
            inp["state_indices"][n:].fill_(-1)

    def _make_step(self, desc: CaptureDescriptor, warmup: bool) -> StepSpec:
        """vLLM's create_forward_fn(desc, warmup): the same step for warmup and capture, fresh metadata each."""
        m, cache, N, T, dev = self.m, self.cache, desc.batch, desc.tokens, self.m.device
        if desc.mode == "draft":
            meta = self._pad_meta(desc.mode, N, T, mtp=True)      # padded rows only: warmup / capture write scratch
            buf = _DraftBuffers(torch.zeros(N, dtype=torch.int64, device=dev),
                                torch.zeros(N, m.config.hidden_size, dtype=m.dtype, device=dev),
                                torch.zeros((), dtype=torch.int64, device=dev),
                                torch.zeros(N, max(self.max_draft, 1), dtype=torch.int64, device=dev))
            if not warmup:
                self.drafts[desc] = buf

            def draft():
                h = m.mtp(cache, buf.ids, buf.hidden, meta)
                logits = m.logits(h)
                tok = logits.argmax(-1)
                buf.drafts.index_copy_(1, buf.step.reshape(1), tok[:, None])   # column `step`, chosen on the device
                buf.ids.copy_(tok)                                             # fed back to the next step
                buf.hidden.copy_(h)
                return h, logits
            return StepSpec(draft, meta, {"ids": buf.ids, "hidden": buf.hidden}, step_index=buf.step,
                            position_fields=("positions", "seq_lens", "slot_mapping"))
        # decode / verify: the metadata is built inside the graph from two static inputs (build_step_metadata
        # is device ops only), so a replay copies ids and slots, nothing else; every run builds its own
        # StepMetadata (warmup and capture never share one)
        ids = torch.zeros(N * T, dtype=torch.int64, device=dev)
        si = torch.full((N,), -1, dtype=I32, device=dev)
        qsl = torch.arange(N + 1, dtype=I32, device=dev) * T
        step = m.decode if desc.mode == "decode" else m.verify

        def fn():
            h = step(cache, ids, m.metadata(cache, si, qsl, N * T))
            return h, m.logits(h)
        return StepSpec(fn, None, {"ids": ids, "state_indices": si})

    # ------------------------------------------------------------------ serving
    def _padded(self, mode, n, T):
        desc = self.lc.descriptor_for(mode, n, T) if self.cuda_graphs else None
        return desc

    def decode(self, ids: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
        """ids, state_indices: [n] -> logits [n, vocab]; kv_lens += 1. From a graph, the logits are a view
        of its static output: valid until the next replay of that graph (copy to keep)."""
        n = state_indices.shape[0]
        desc = self._padded("decode", n, 1)
        if desc is None:
            qsl = torch.arange(n + 1, dtype=I32, device=ids.device)
            meta = self.m.metadata(self.cache, state_indices.to(I32), qsl, n)
            return self.lc.eager(lambda: self.m.logits(self.m.decode(self.cache, ids, meta)), "eager decode")
        self._fill_inputs(desc, ids, state_indices)
        return self.lc.replay(desc)[1][:n]

    def verify(self, ids: torch.Tensor, state_indices: torch.Tensor, k: int) -> torch.Tensor:
        """ids: [n * (1+k)] (request-major), state_indices: [n] -> logits [n * (1+k), vocab]; commits nothing."""
        n, T = state_indices.shape[0], 1 + k
        desc = self._padded("verify", n, T)
        if desc is None:
            qsl = torch.arange(n + 1, dtype=I32, device=ids.device) * T
            meta = self.m.metadata(self.cache, state_indices.to(I32), qsl, n * T)
            return self.lc.eager(lambda: self.m.logits(self.m.verify(self.cache, ids, meta)), "eager verify")
        self._fill_inputs(desc, ids, state_indices)
        return self.lc.replay(desc)[1][:n * T]

    def check(self) -> None:
        """Raise a fault the kernels recorded on the device (GDNStateCache.check of every layer: a host
        sync; call it where the host reads tokens anyway, never inside capture)."""
        for gc in self.cache.gdn:
            if hasattr(gc, "check"):
                gc.check()

    def accept(self, state_indices, num_accepted):
        return self.lc.eager(lambda: self.m.accept(self.cache, state_indices, num_accepted), "accept")

    def draft(self, step: int, state_indices: torch.Tensor, ids: Optional[torch.Tensor] = None,
              hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Draft step ``step`` (0-based) of one token per request: ids [n], hidden [n, hidden] (given at
        step 0; later steps feed back the previous step's inside the static buffers) -> draft tokens [n]."""
        n = state_indices.shape[0]
        desc = self._padded("draft", n, 1)
        if desc is None:
            raise ValueError(f"draft steps need a captured draft graph of batch >= {n} (batch sizes "
                             f"{self.batch_sizes}, cuda_graphs={self.cuda_graphs}); run m.mtp eagerly")
        buf = self.drafts[desc]
        if ids is not None:
            buf.ids[:n] = ids
            buf.hidden[:n] = hidden.to(buf.hidden.dtype)
        meta = self._pad_meta("draft", desc.batch, 1, state_indices.to(I32), mtp=True)   # rebuilt per step
        self.lc.replay_draft(desc, step, meta)
        return buf.ids[:n].clone()


# ----------------------------------------------------------------------------------------------
# profile traffic and the GPU report
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def profile_traffic(model, cfg: ServingConfig):
    """Launch every variant ``plan(model, cfg)`` lists, eagerly, on a throw-away cache: prefills of each
    packed-length class (refgdn.capture.prefill_classes: powers of two, odd lengths past 16) with
    1..max_prefill_seqs sequences, decode / verify / accept at every batch size."""
    m, dev = model, model.device
    n = max(cfg.max_batch, cfg.max_prefill_seqs)
    cache = m.allocate_cache(n, max(cfg.max_prefill_tokens, 1) + 2 * (cfg.max_draft + 2) * 4 + 8,
                             max_draft=cfg.max_draft, state_dtype=cfg.state_dtype)     # the plan's state dtype
    for T in prefill_classes(cfg.max_prefill_tokens):
        for N in range(1, min(T, cfg.max_prefill_seqs) + 1):
            cache.reset(list(range(n)))
            lens = [T // N] * N
            lens[-1] += T - sum(lens)
            ids = torch.zeros(T, dtype=torch.int64, device=dev)
            qsl = torch.tensor([0] + lens, device=dev).cumsum(0).to(I32)
            m.prefill(cache, ids, m.metadata(cache, torch.arange(N, dtype=I32, device=dev), qsl, T))
    for N in range(1, cfg.max_batch + 1):
        cache.reset(list(range(n)))
        si = torch.arange(N, dtype=I32, device=dev)
        m.decode(cache, torch.zeros(N, dtype=torch.int64, device=dev),
                 m.metadata(cache, si, torch.arange(N + 1, dtype=I32, device=dev), N))
        if cfg.max_draft:
            T = 1 + cfg.max_draft
            m.verify(cache, torch.zeros(N * T, dtype=torch.int64, device=dev),
                     m.metadata(cache, si, torch.arange(N + 1, dtype=I32, device=dev) * T, N * T))
            m.accept(cache, si, torch.ones(N, dtype=cfg.accept_dtype, device=dev))
    torch.cuda.synchronize() if dev.type == "cuda" else None


def lifecycle_report(preset: str = "tiny", dtype=torch.bfloat16, batch_sizes=(1, 2, 4, 8), max_draft: int = 5,
                     rounds: int = 3, seed: int = 0, device: str = "cuda", ops="fast",
                     state_dtype: Optional[torch.dtype] = None) -> dict:
    """GPU: the whole lifecycle in this process (run it in a fresh one), with Triton's compilations counted.

    Returns planned keys, keys Triton compiled (by the launch recorder's attribution), compilations per
    phase, and the keys first seen after profile. Serving traffic afterwards: prefills of random lengths,
    decode and speculative rounds (k = 1..max_draft) at padded batch sizes below and above the graphs.
    state_dtype: the GDN ssm state's (the plan's and the cache's; None: the model's default)."""
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    m = Qwen3NextModel(Qwen3NextConfig.preset(preset), ops=ops, dtype=dtype, device=device, seed=seed,
                       check_values=False)
    cfg = ServingConfig(capture_batch_sizes=batch_sizes, max_draft=max_draft, max_batch=max(batch_sizes) + 2,
                        max_prefill_tokens=64, max_prefill_seqs=max(batch_sizes) + 2, state_dtype=state_dtype,
                        device=device)
    log = KeyLog()
    with recording(log):
        gm = GraphedModel(m, batch_sizes=batch_sizes, max_draft=max_draft, num_slots=cfg.max_batch, max_len=512,
                          state_dtype=state_dtype)
        gm.setup(profile=lambda: profile_traffic(m, cfg), planned=plan(m, cfg).keys)
        gen = torch.Generator().manual_seed(seed)
        for n in (1, 3, cfg.max_batch):
            gm.cache.reset(list(range(cfg.max_batch)))
            lens = torch.randint(1, 64 // n + 1, (n,), generator=gen).tolist()
            si = torch.arange(n, dtype=I32, device=device)
            qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(I32)
            ids = torch.randint(0, m.config.vocab_size, (sum(lens),), generator=gen).to(device)
            gm.lc.eager(lambda: m.prefill(gm.cache, ids, m.metadata(gm.cache, si, qsl, sum(lens))), "prefill")
            for r in range(rounds):
                tok = gm.decode(torch.zeros(n, dtype=torch.int64, device=device), si).argmax(-1)
                for k in range(1, max_draft + 1):
                    gm.verify(tok.repeat_interleave(1 + k), si, k)
                    gm.accept(si, torch.ones(n, dtype=I32, device=device))
                if m.has_mtp and gm.lc.descriptor_for("draft", n) is not None:
                    hid = torch.zeros(n, m.config.hidden_size, dtype=m.dtype, device=device)
                    for j in range(max_draft):
                        gm.draft(j, si, tok if j == 0 else None, hid if j == 0 else None)
        if device == "cuda":
            torch.cuda.synchronize()
        gm.check()                                 # no request faulted on the device (graphs and eager)
    planned = plan(m, cfg).keys
    compiled = set(log.compiled)
    return dict(planned=sorted(map(str, planned)), compiled=sorted(map(str, compiled)),
                planned_not_compiled=sorted(map(str, planned - compiled)),
                compiled_not_planned=sorted(map(str, compiled - planned)),
                compiles_per_phase=dict(gm.lc.real_compiles), compile_events=len(log.compiled),
                first_seen_after_profile=[str(k) for k in gm.lc.compiled_after_profile],
                captured=[str(d) for d in gm.lc.steps])


# ----------------------------------------------------------------------------------------------
# the model's step API over the graphs (a drop-in for refgdn.speculative / refgdn.generate)
# ----------------------------------------------------------------------------------------------

def pad_step_metadata(meta, N: int, T: int):
    """StepMetadata of n requests / t tokens -> N >= n requests / T >= t tokens: padded requests get slot -1
    and no tokens, padded tokens (past query_start_loc[N]) position 0, slot mapping -1, token slot -1."""
    n, t = meta.num_reqs, meta.num_tokens
    if (n, t) == (N, T):
        return meta

    def pad(x, L, val):
        out = torch.full((L,), val, dtype=x.dtype, device=x.device)
        out[:x.shape[0]] = x
        return out
    qsl = pad(meta.query_start_loc, N + 1, 0)
    qsl[n + 1:] = meta.query_start_loc[n]
    return type(meta)(state_indices=pad(meta.state_indices, N, -1), query_start_loc=qsl,
                      positions=pad(meta.positions, T, 0), seq_lens=pad(meta.seq_lens, N, 0),
                      slot_mapping=pad(meta.slot_mapping, T, -1), token_slots=pad(meta.token_slots, T, -1))


class GraphedSteps:
    """The model's step API (``prefill``, ``decode``, ``verify``, ``accept``, ``mtp``, ``logits``, ``metadata``,
    ... everything else forwarded to the model) with steps that fit a captured graph replayed from it:

    - decode: one token per request, ``cache`` the graphs' cache -> decode graph of the smallest batch >= N
      (the graph rebuilds the metadata from the slots, as ``model.metadata`` does);
    - verify: 1 + k_n tokens for request n (one small device->host read of query_start_loc) -> the verify
      graph of 1 + max k_n tokens per request, shorter requests padded (``verify``);
    - mtp: one token per request (the single-token draft steps) -> the draft graph, the caller's metadata
      (rebuilt by the caller for the step: refgdn.speculative.fresh_draft_metadata) padded and copied into
      the static buffers, the step index counted since the last target step;
    - logits(h) of an h just returned by a graph: the graph's own logits (no second lm_head).

    Outputs are copies (the loop may keep them across steps, as it does eager ones). Usage:
    ``gs = GraphedSteps(GraphedModel(model, ...).setup(...)); generate_speculative(gs, ..., cache=gs.cache)``.
    """

    def __init__(self, gm: GraphedModel):
        self._gm = gm
        self._last = None
        self._step = 0
        self.replays = 0                      # steps served from a graph (for tests and reports)
        self.padded_verifies = 0              # of them, verifies of mixed k laid out in a uniform graph
        self._real_lens = None                # the last padded verify's tokens per request (device), for accept

    def __getattr__(self, name):
        return getattr(self._gm.m, name)

    @property
    def cache(self):
        return self._gm.cache

    def _ok(self, cache) -> bool:
        return cache is self._gm.cache and self._gm.cuda_graphs

    def _ret(self, h, logits):
        h, logits = h.clone(), logits.clone()
        self._last = (h, logits)
        self.replays += 1
        return h

    def logits(self, hidden):
        if self._last is not None and hidden is self._last[0]:
            return self._last[1]
        return self._gm.m.logits(hidden)

    def _eager(self, what, fn):
        """A step no graph fits: eagerly, still under the lifecycle (a variant not profiled raises)."""
        return self._gm.lc.eager(fn, f"eager {what}")

    def prefill(self, cache, input_ids, meta, query_start_loc_cpu=None):
        self._step = 0
        return self._eager("prefill", lambda: self._gm.m.prefill(cache, input_ids, meta, query_start_loc_cpu))

    def accept(self, cache, state_indices, num_accepted):
        """model.accept. After a padded verify (``verify``) gdn_accept sees each request's padded length, so an
        accept beyond the request's own tokens is turned into 0 on the device: a count the rule faults
        (E_ACCEPT_RANGE, raised by ``cache.check()``; nothing of the request committed), as the eager verify's
        accept would have been; never a commit of padding. The fault names the request; the count it quotes is
        that 0 against the padded length."""
        self._step = 0
        lens, self._real_lens = self._real_lens, None
        if lens is not None and num_accepted.shape == lens.shape:
            num_accepted = torch.where(num_accepted <= lens.to(num_accepted.dtype), num_accepted, 0)
        return self._eager("accept", lambda: self._gm.m.accept(cache, state_indices, num_accepted))

    def decode(self, cache, input_ids, meta):
        self._step = 0
        n = meta.num_reqs
        desc = self._gm._padded("decode", n, 1) if self._ok(cache) and meta.num_tokens == n else None
        if desc is None:
            return self._eager("decode", lambda: self._gm.m.decode(cache, input_ids, meta))
        self._gm._fill_inputs(desc, input_ids, meta.state_indices)
        h, logits = self._gm.lc.replay(desc)
        return self._ret(h[:n], logits[:n])

    def verify(self, cache, input_ids, meta):
        """From the verify graph of 1 + k tokens per request, k the batch's largest: a request with fewer tokens
        is laid out at its row of that graph with padding tokens after its own (their outputs dropped, gathered
        back to the packed order). The padding joins the request's verify: gdn_verify keeps it pending and the
        accept that must follow never commits it (num_accepted <= the request's real tokens); attention writes
        its K/V at positions past the request's, which the next step rewrites before reading, and none at
        positions >= max_len (build_step_metadata). A causal step: no real token reads a later one, so the real
        tokens' outputs are the packed layout's."""
        self._step = 0
        self._real_lens = None
        n, t = meta.num_reqs, meta.num_tokens
        desc, pick = None, None
        if self._ok(cache) and n:
            offs = meta.query_start_loc.tolist()                # the one host read: the requests' lengths
            lens = [e - b for b, e in zip(offs, offs[1:])]
            T = max(lens)
            if min(lens) >= 1 and 2 <= T <= 1 + self._gm.max_draft:
                desc = self._gm._padded("verify", n, T)
                if desc is not None and min(lens) < T:          # mixed k: each request at row i of the graph
                    pick = torch.tensor([i * T + j for i, L in enumerate(lens) for j in range(L)],
                                        dtype=torch.long, device=input_ids.device)
        if desc is None:
            return self._eager("verify", lambda: self._gm.m.verify(cache, input_ids, meta))
        ids = input_ids
        if pick is not None:                                    # padding tokens: id 0 (any id would do)
            ids = torch.zeros(n * T, dtype=input_ids.dtype, device=input_ids.device).index_copy_(0, pick, input_ids)
            self.padded_verifies += 1
            self._real_lens = torch.tensor(lens, dtype=torch.int32, device=input_ids.device)
        self._gm._fill_inputs(desc, ids, meta.state_indices)
        h, logits = self._gm.lc.replay(desc)
        if pick is None:
            return self._ret(h[:t], logits[:t])
        return self._ret(h.index_select(0, pick), logits.index_select(0, pick))

    def mtp(self, cache, input_ids, hidden, meta):
        n = meta.num_reqs
        desc = self._gm._padded("draft", n, 1) if self._ok(cache) and meta.num_tokens == n else None
        if desc is None or desc not in self._gm.drafts:
            self._step = 0
            return self._eager("mtp", lambda: self._gm.m.mtp(cache, input_ids, hidden, meta))
        buf = self._gm.drafts[desc]
        buf.ids[:n].copy_(input_ids)
        buf.hidden[:n].copy_(hidden)
        step = self._step % buf.drafts.shape[1]
        self._gm.lc.replay_draft(desc, step, pad_step_metadata(meta, desc.batch, desc.batch))
        self._step += 1
        h, logits = self._gm.lc.steps[desc].outputs
        return self._ret(h[:n], logits[:n])
