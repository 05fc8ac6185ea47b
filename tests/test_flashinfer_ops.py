"""FlashInfer's GDN API (refgdn.flashinfer_ops, fast.flashinfer_ops): chunk_gated_delta_rule (its prefill) and
gated_delta_rule_decode_pretranspose / gated_delta_rule_decode / gated_delta_rule_mtp (its decode and MTP verify).

refgdn's ops against the rule written out per token and head here (float64, FlashInfer's conventions: the decay as
alpha, states [.., V, K], GQA / GVA heads); fast's against refgdn by the conformance rule: the checks of
conformance.cases_flashinfer, run on every family below by the quick matrix (`python -m conformance --quick`, the first
half of the README's test command), and here only where a test needs more than the rule. Bad inputs raise before
anything is written.
"""
import inspect
import warnings

import pytest
import torch

import fast.flashinfer_ops as FF
import refgdn.flashinfer_ops as RF
from conformance.cases_flashinfer import (SENTINEL, decode_families, decode_problem, prefill_families,
                                          prefill_problem, run_decode, run_prefill)
from tests.helpers import captured

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PREFILL = [pytest.param(p, id=name) for name, p in prefill_families(quick=True, device=DEV).items()]
DECODE = [pytest.param(p, id=name) for name, p in decode_families(quick=True, device=DEV).items()]


def _t(x, dtype=torch.int32):
    return torch.tensor(x, dtype=dtype, device=DEV)


def _wide(args: list) -> list:
    return [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]


@pytest.mark.parametrize("p", PREFILL)
def test_refgdn_prefill_equals_the_steps_written_out(p):
    """float64: every output and final state is FlashInfer's recurrence written out here per sequence, head and token
    (the decay multiplied in as alpha, alpha = 0 included; GQA's k / v head h // (Hq / Hv), GVA's q / k head
    h // (Hv / Hq); states read and written [V, K]); an empty sequence's output_state row keeps its contents; the
    checkpoints are the states after every checkpoint_every_n_tokens tokens, in their rows, the spare row untouched."""
    args, kw = prefill_problem(p, torch.float64, DEV)
    args = _wide(args)
    o, final, ck = run_prefill(RF.chunk_gated_delta_rule, args, kw, wide=True)
    every = p.get("ckpt", 0)
    starts = kw["checkpoint_cu_starts"].tolist() if every else None
    stored = set()
    q, k, v, alpha, beta, scale, h0, _, cu, l2 = args
    T, Hq, K = q.shape
    Hk, Hv, V = k.shape[1], v.shape[1], v.shape[2]
    sab = max(Hq, Hv)
    scale = K ** -0.5 if not scale else scale
    offs = cu.tolist()
    for n in range(len(offs) - 1):
        for h in range(sab):
            hq = h if Hq == sab else h // (sab // Hq)
            hk, hv = (h // (sab // Hk), h // (sab // Hv)) if Hq == sab else (h // (sab // Hk), h)
            state = h0[n, h].T.clone() if h0 is not None else torch.zeros(K, V, dtype=torch.float64, device=DEV)
            for t in range(offs[n], offs[n + 1]):
                qt, kt = q[t, hq], k[t, hk]
                if l2:
                    qt, kt = qt / torch.sqrt(qt @ qt + 1e-6), kt / torch.sqrt(kt @ kt + 1e-6)
                a = 1.0 if alpha is None else alpha[t, h]
                b = 1.0 if beta is None else beta[t, h]
                state = a * state
                state = state + torch.outer(kt, b * (v[t, hv] - state.T @ kt))
                torch.testing.assert_close(o[t, h], scale * state.T @ qt, rtol=1e-12, atol=1e-12)
                done = t + 1 - offs[n]
                if every and done % every == 0:
                    row = starts[n] + done // every - 1
                    torch.testing.assert_close(ck[row, h], state.T, rtol=1e-12, atol=1e-12)
                    stored.add(row)
            if offs[n + 1] > offs[n]:
                torch.testing.assert_close(final[n, h], state.T, rtol=1e-12, atol=1e-12)
            elif "output_state" in kw:
                assert torch.equal(final[n, h], torch.full_like(final[n, h], SENTINEL))
            else:                                       # an allocated final state: the sequence's initial state
                assert torch.equal(final[n, h], state.T)
    if every:
        assert stored == set(range(starts[-1])) and torch.equal(ck[-1], torch.full_like(ck[-1], SENTINEL))


@pytest.mark.parametrize("p", DECODE)
def test_refgdn_decode_equals_the_steps_written_out(p):
    """float64: every output and written state is the decode rule written out here per batch row, head and token (the
    gates from the raw projections; states [V, K] but for the K-major decode); a padded row (negative read index)
    outputs zeros and writes nothing; output_state_indices moves the write (negative: none); the MTP buffer holds row
    n's state after each token; with disable_state_update no state is written; everything else is untouched."""
    fn, args, kw = decode_problem(p, torch.float64, DEV)
    o, after, buf_after = run_decode(getattr(RF, fn), fn, _wide(args), kw, wide=True)
    q, k, v = args[:3]
    if fn.endswith("mtp"):
        A_log, a, dt_bias, b = args[5:9]
        states = args[3]
    else:
        A_log, a, dt_bias, b = args[4:8]
        states = kw.get("initial_state", args[3])
    states, buf = states.double(), kw.get("intermediate_states_buffer")
    buf = None if buf is None else buf.double()
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if kw["scale"] is None else kw["scale"]
    kv = p["fn"] == "decode"
    read = p["idx"] if p.get("P") else list(range(B))
    write = p["out_idx"] if p.get("out_idx") is not None else read
    frozen = p.get("frozen", False)
    ssm = p.get("ssm")                                   # each token's state to its own pool row, no write back
    if ssm is not None:
        write = [-1] * B
    written, cached = set(), set()
    for n in range(B):
        if read[n] < 0:
            assert torch.equal(o[n], torch.zeros_like(o[n]))
            continue
        for h in range(HV):
            hk = h // (HV // H)
            s0 = states[read[n], h]
            state = (s0 if kv else s0.T).clone()                                         # [K, V]
            for t in range(T):
                qt, kt = q[n, t, hk].double(), k[n, t, hk].double()
                if kw["use_qk_l2norm"]:
                    qt, kt = qt / torch.sqrt(qt @ qt + 1e-6), kt / torch.sqrt(kt @ kt + 1e-6)
                g = -torch.exp(A_log[h].double()) * torch.nn.functional.softplus(a[n, t, h].double() + dt_bias[h])
                beta = torch.sigmoid(b[n, t, h].double())
                state = torch.exp(g) * state
                state = state + torch.outer(kt, beta * (v[n, t, h].double() - state.T @ kt))
                torch.testing.assert_close(o[n, t, h], scale * state.T @ qt, rtol=1e-12, atol=1e-12)
                if buf is not None:
                    torch.testing.assert_close(buf_after[n, t, h], state.T, rtol=1e-12, atol=1e-12)
                    cached.add((n, t))
                if ssm is not None and ssm[n][t] >= 0:
                    torch.testing.assert_close(after[ssm[n][t], h], state.T, rtol=1e-12, atol=1e-12)
                    written.add(ssm[n][t])
            if write[n] >= 0 and not frozen:
                torch.testing.assert_close(after[write[n], h], state if kv else state.T, rtol=1e-12, atol=1e-12)
                written.add(write[n])
    for s in range(states.shape[0]):
        if s not in written:
            assert torch.equal(after[s], states[s]), f"state {s} written"
    if buf is not None:
        for r in range(buf.shape[0]):
            for j in range(buf.shape[1]):
                if (r, j) not in cached:
                    assert torch.equal(buf_after[r, j], buf[r, j]), f"buffer entry {(r, j)} written"


def test_flashinfer_names_and_argument_orders():
    """Both packages' functions take FlashInfer's parameters by name and position (flashinfer.gdn_prefill /
    flashinfer.gdn_decode / flashinfer.gdn_paged, as FlashInfer documents them), plus the trailing check_values keyword of fast's."""
    want = {
        "chunk_gated_delta_rule": "q k v g beta scale initial_state output_final_state cu_seqlens "
                                  "use_qk_l2norm_in_kernel output output_state state_checkpoints checkpoint_cu_starts "
                                  "checkpoint_every_n_tokens use_cp",
        "gated_delta_rule_decode_pretranspose": "q k v state A_log a dt_bias b scale output use_qk_l2norm "
                                                "initial_state initial_state_indices output_state_indices "
                                                "intermediate_states_buffer disable_state_update",
        "gated_delta_rule_decode": "q k v state A_log a dt_bias b scale output use_qk_l2norm",
        "gated_delta_rule_mtp": "q k v initial_state initial_state_indices A_log a dt_bias b scale output "
                                "intermediate_states_buffer ssm_state_indices disable_state_update use_qk_l2norm "
                                "output_state_indices",
        # flashinfer.gdn_paged (the slots functions and their tuples: one object in both packages)
        "chunk_gated_delta_rule_paged": "q k v g beta scale cu_seqlens state_pool page_indices page_indptr "
                                        "page_size last_page_len use_qk_l2norm_in_kernel output gate_domain "
                                        "use_gate_in_kernel A_log dt_bias beta_is_logit slots",
        "gated_delta_rule_decode_paged": "q k v A_log a dt_bias b scale output use_qk_l2norm state_pool "
                                         "page_indices page_indptr last_page_len backend slots",
        "gdn_paged_prefill_slots": "cu_seqlens page_indices page_indptr page_size last_page_len",
        "gdn_paged_decode_slots": "page_indices page_indptr last_page_len",
        "GDNPagedPrefillSlots": "state_indices output_state_indices checkpoint_cu_starts prefix_lens",
        "GDNPagedDecodeSlots": "initial_state_indices output_state_indices",
    }
    assert sorted(RF.__all__) == sorted(want) == sorted(FF.__all__)
    for name, params in want.items():
        ref = list(inspect.signature(getattr(RF, name)).parameters)
        assert ref == params.split(), name
        extra = [] if getattr(FF, name) is getattr(RF, name) else ["check_values"]
        assert list(inspect.signature(getattr(FF, name)).parameters) == ref + extra, name


def test_fast_returns_flashinfers_outputs():
    """Return forms: the prefill's output [T, sab, V] alone, or (output, final state [N, sab, V, K] float32) with
    output_final_state; a given output / output_state is the tensor returned. The decode's (output [B, T, HV, V] in
    q's dtype, the states passed)."""
    p = prefill_families(True, DEV)["equal-heads-output-state"]
    args, kw = prefill_problem(p, torch.float32, DEV)
    o, s = FF.chunk_gated_delta_rule(*args, **kw)
    assert o is kw["output"] and s is kw["output_state"]
    args[7] = False
    o2 = FF.chunk_gated_delta_rule(*args)
    assert isinstance(o2, torch.Tensor) and o2.shape == o.shape and o2.dtype == args[0].dtype
    fn, args, kw = decode_problem(decode_families(True, DEV)["pretranspose-pool-padded"], torch.bfloat16, DEV)
    o, pool = getattr(FF, fn)(*args, **kw)
    assert pool is kw["initial_state"] and o.dtype == torch.bfloat16 and o.shape == args[2].shape
    out = torch.empty(o.shape, dtype=torch.float32, device=DEV)            # another dtype: cast into it
    o3, _ = getattr(FF, fn)(*args, **dict(kw, output=out))
    assert o3 is out


def test_mtp_default_is_frozen_with_flashinfers_warning():
    """disable_state_update None: True (FlashInfer's default, with a FutureWarning): the pool is left as it was."""
    fn, args, kw = decode_problem(decode_families(True, DEV)["mtp-commit"], torch.float32, DEV)
    del kw["disable_state_update"]
    for pkg in (RF, FF):
        pool = args[3].clone()
        with pytest.warns(FutureWarning, match="disable_state_update"):
            pkg.gated_delta_rule_mtp(*args[:3], pool, *args[4:], **kw)
        assert torch.equal(pool, args[3])


def _prefill_bad(bad: dict) -> tuple:
    p = prefill_families(True, DEV)["equal-heads-output-state"]
    args, kw = prefill_problem(p, torch.float32, DEV)
    names = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
             "use_qk_l2norm_in_kernel"]
    kw = dict(zip(names, args), **kw)
    for name, val in bad.items():
        kw[name] = val(kw) if callable(val) else val
    return kw


PREFILL_BAD = [
    pytest.param(dict(checkpoint_every_n_tokens=64), "must both be given", id="checkpoints-without-buffers"),
    pytest.param(dict(state_checkpoints=torch.zeros(1)), "must both be given", id="checkpoint-buffer-alone"),
    pytest.param(dict(checkpoint_every_n_tokens=-1), "a positive multiple of the chunk size 64", id="ckpt-neg"),
    pytest.param(dict(checkpoint_every_n_tokens=32, state_checkpoints=torch.zeros(1),
                      checkpoint_cu_starts=torch.zeros(1)), "a positive multiple of the chunk size 64", id="ckpt-32"),
    pytest.param(dict(checkpoint_every_n_tokens=64, state_checkpoints=torch.zeros(2, 2, 16, 8, device=DEV),
                      checkpoint_cu_starts=_t([0, 0, 0, 0], torch.int64)),
                 r"state_checkpoints must be \[R, num_sab_heads, V, K\]", id="ckpt-shape"),
    pytest.param(dict(checkpoint_every_n_tokens=64, state_checkpoints=torch.zeros(2, 2, 16, 16, device=DEV),
                      checkpoint_cu_starts=_t([0, 0, 0], torch.int64)),
                 r"checkpoint_cu_starts must have shape \[B\] = \[4\]", id="ckpt-starts-shape"),
    pytest.param(dict(cu_seqlens=None), "cu_seqlens must be given", id="no-cu_seqlens"),
    pytest.param(dict(q=lambda kw: kw["q"][None]), "q must be 3-D", id="q-4d"),
    pytest.param(dict(k=lambda kw: kw["k"][:, :1]), "must be GQA", id="heads"),
    pytest.param(dict(g=lambda kw: kw["g"][:, :1]), r"g must have shape \[T, num_sab_heads\]", id="g-shape"),
    pytest.param(dict(initial_state=lambda kw: kw["initial_state"].transpose(-1, -2)[..., :8]),
                 r"initial_state must have shape \[N, num_sab_heads, V, K\]", id="h0-shape"),
    pytest.param(dict(output=lambda kw: kw["output"].double()), "output must be", id="output-dtype"),
    pytest.param(dict(output=lambda kw: kw["v"]), "output must not overlap v", id="output-is-v"),
    pytest.param(dict(use_cp=1), "use_cp must be a bool", id="use_cp"),
    pytest.param(dict(output_final_state=None), "output_final_state must be a bool", id="final-flag"),
    pytest.param(dict(cu_seqlens=lambda kw: kw["cu_seqlens"].float()), "cu_seqlens must be int32 or int64",
                 id="cu-float"),
]


@pytest.mark.parametrize("pkg", [RF, FF], ids=["refgdn", "fast"])
@pytest.mark.parametrize("bad,words", PREFILL_BAD)
def test_prefill_bad_inputs_raise_before_any_write(pkg, bad, words):
    kw = _prefill_bad(bad)
    outs = {n: kw[n].clone() for n in ("output", "output_state") if isinstance(kw.get(n), torch.Tensor)}
    with pytest.raises(ValueError, match=words):
        pkg.chunk_gated_delta_rule(**kw)
    for n, before in outs.items():
        assert torch.equal(torch.nan_to_num(kw[n]), torch.nan_to_num(before)), n      # (output: torch.empty's)


def _decode_bad(name: str, bad: dict) -> tuple:
    fn, args, kw = decode_problem(decode_families(True, DEV)[name], torch.float32, DEV)
    kw = dict(kw)
    for key, val in bad.items():
        if isinstance(key, int):
            args[key] = val(args) if callable(val) else val
        else:
            kw[key] = val(kw) if callable(val) else val
    return fn, args, kw


DECODE_BAD = [
    pytest.param("mtp-commit", dict(ssm_state_indices=torch.zeros(1)), "ssm_state_indices must be 2-D",
                 id="token-slots-1d"),
    pytest.param("mtp-commit", dict(ssm_state_indices=_t([[0, 2, 3, 4]])), r"ssm_state_indices must be \[B, T\]",
                 id="token-slots-shape"),
    pytest.param("mtp-commit", dict(ssm_state_indices=_t([[0, 2, 3, 4], [5, 6, 7, 8]]), disable_state_update=True),
                 "needs T >= 2 tokens, disable_state_update=False", id="token-slots-frozen"),
    pytest.param("mtp-commit-buffer-out-idx", dict(ssm_state_indices=_t([[0, 1, 2], [3, 4, 5], [6, 7, 8]])),
                 "neither intermediate_states_buffer nor output_state_indices", id="token-slots-with-buffer"),
    pytest.param("pretranspose-pool-padded", {3: torch.zeros(4, 2, 16, 16)}, "not both", id="state-and-pool"),
    pytest.param("pretranspose-state", dict(initial_state_indices=_t([0, 1, 2])), "given together",
                 id="indices-without-pool"),
    pytest.param("pretranspose-state", dict(output_state_indices=_t([0, 1, 2])), "needs the pool",
                 id="out-indices-without-pool"),
    pytest.param("pretranspose-pool-padded", dict(disable_state_update=True), "for T > 1", id="frozen-T1"),
    pytest.param("pretranspose-mtp-frozen-buffer",
                 dict(intermediate_states_buffer=lambda kw: kw["intermediate_states_buffer"][:, :2]),
                 r"\[C >= B, T' >= T, HV, V, K\]", id="buffer-too-short"),
    pytest.param("pretranspose-mtp-frozen-buffer",
                 dict(intermediate_states_buffer=lambda kw: torch.zeros(4, 5, 2, 16, 16, device=DEV)[:, :4]),
                 "one after another", id="buffer-gapped"),
    pytest.param("pretranspose-pool-padded", dict(initial_state=lambda kw: kw["initial_state"][..., :8]),
                 r"initial_state must be the pool \[P >= 1, 2, 16, 16\]", id="pool-shape"),
    pytest.param("pretranspose-pool-padded", dict(initial_state_indices=_t([1, 2])),
                 r"initial_state_indices must have shape \[B\] = \[4\]", id="indices-wrong-B"),
    pytest.param("decode-kmajor", {5: lambda args: args[5][:, :, :1]}, r"a must have shape \[B, T, HV\]",
                 id="a-shape"),
    pytest.param("mtp-commit", dict(disable_state_update=1), "disable_state_update must be a bool", id="frozen-int"),
    pytest.param("pretranspose-pool-padded", dict(use_qk_l2norm=None), "use_qk_l2norm must be a bool", id="l2-flag"),
    pytest.param("mtp-commit", dict(output=lambda kw: torch.zeros(1, device=DEV)), "output must be 4-D",
                 id="output-shape"),
]


@pytest.mark.parametrize("pkg", [RF, FF], ids=["refgdn", "fast"])
@pytest.mark.parametrize("name,bad,words", DECODE_BAD)
def test_decode_bad_inputs_raise_before_any_write(pkg, name, bad, words):
    fn, args, kw = _decode_bad(name, bad)
    held = [t for t in list(args) + list(kw.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    before = [t.clone() for t in held]
    with pytest.raises(ValueError, match=words):
        getattr(pkg, fn)(*args, **kw)
    assert all(torch.equal(t, b) for t, b in zip(held, before))


def test_decode_k_major_takes_one_token():
    fn, args, kw = decode_problem(dict(decode_families(True, DEV)["decode-kmajor"], T=2), torch.float32, DEV)
    for pkg in (RF, FF):
        with pytest.raises(ValueError, match="one token per batch row"):
            getattr(pkg, fn)(*args, **kw)


@pytest.mark.parametrize("change,words", [
    pytest.param(dict(idx=[4, -1, 9, 7]), r"initial_state_indices\[2\] = 9 is outside the pool's 9 slots",
                 id="past-pool"),
    pytest.param(dict(idx=[4, -1, 7, 7], out_idx=None), "slot 7 is given to rows 2 and 3", id="one-slot-two-rows"),
    pytest.param(dict(out_idx=[2, 3, 2, 8]), "slot 2 is given to rows 0 and 2", id="one-write-two-rows"),
    pytest.param(dict(out_idx=[2, 3, -1, 9]), r"output_state_indices\[3\] = 9 is outside", id="write-past-pool"),
    pytest.param(dict(out_idx=[2, 3, 4, 8]), r"slot 4 is written by row 2 \(output_state_indices\) and read by row 0",
                 id="write-where-another-reads"),
    pytest.param(dict(idx=[4, -1, 4, 7], out_idx=[4, 3, 2, 8]),          # rows 0 and 2 read slot 4, row 0 writes it
                 r"slot 4 is written by row 0 \(output_state_indices\) and read by row 2", id="write-where-two-read"),
    pytest.param(dict(fn="mtp", T=2, out_idx=None, ssm=[[1, 2], [1, 2], [3, 9], [6, 8]]),
                 r"ssm_state_indices\[2, 1\] = 9 is outside", id="token-slot-past-pool"),
    pytest.param(dict(fn="mtp", T=2, out_idx=None, ssm=[[1, 2], [3, 5], [6, 2], [8, 3]]),
                 r"slot 2 is given to tokens \(0, 1\) and \(2, 1\)", id="token-slot-twice"),
    pytest.param(dict(fn="mtp", T=2, out_idx=None, ssm=[[1, 7], [3, 5], [6, 2], [8, 3]]),
                 "slot 7 is written by row 0's token 1 and read by row 3", id="token-slot-read-by-another"),
])
def test_bad_slot_values(change, words):
    """refgdn always checks the slots, fast with check_values=True (same words), both before any write."""
    p = dict(decode_families(True, DEV)["pretranspose-out-idx"], **change)
    for pkg, extra in ((RF, {}), (FF, dict(check_values=True))):
        fn, args, kw = decode_problem(p, torch.float32, DEV)
        pool = args[3] if fn.endswith("mtp") else kw["initial_state"]
        before = pool.clone()
        with pytest.raises(ValueError, match=words):
            getattr(pkg, fn)(*args, **kw, **extra)
        assert torch.equal(pool, before)


def test_prefill_offsets_checked_when_asked():
    p = prefill_families(True, DEV)["gva-varlen-h0"]
    args, kw = prefill_problem(p, torch.float32, DEV)
    args[8] = _t([0, 5, 3, 37, 70], torch.int64)
    for pkg, extra in ((RF, {}), (FF, dict(check_values=True))):
        with pytest.raises(ValueError, match="non-decreasing"):
            pkg.chunk_gated_delta_rule(*args, **kw, **extra)


def test_fast_is_memory_safe_on_unchecked_values():
    """Without check_values: a read slot past the pool is a padded row (refgdn's result with that entry negative), a
    write index past it writes nothing (refgdn's with it negative); offsets past T are clamped."""
    base = decode_families(True, DEV)["pretranspose-out-idx"]
    fn, args, kw = decode_problem(dict(base, idx=[4, -1, 30, 7], out_idx=[2, 3, 5, 40]), torch.float32, DEV)
    o, after, _ = run_decode(getattr(FF, fn), fn, args, kw)
    fn, args_r, kw_r = decode_problem(dict(base, idx=[4, -1, -1, 7], out_idx=[2, 3, 5, -1]), torch.float32, DEV)
    o_r, after_r, _ = run_decode(getattr(RF, fn), fn, args_r, kw_r)
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(after, after_r)
    base = decode_families(True, DEV)["mtp-token-slots"]                # a per-token row past the pool: not stored
    fn, args, kw = decode_problem(dict(base, ssm=[[0, 2, 30], [4, 5, 7], [8, -1, 1]]), torch.float32, DEV)
    o, after, _ = run_decode(getattr(FF, fn), fn, args, kw)
    fn, args_r, kw_r = decode_problem(dict(base, ssm=[[0, 2, -1], [4, 5, 7], [8, -1, 1]]), torch.float32, DEV)
    o_r, after_r, _ = run_decode(getattr(RF, fn), fn, args_r, kw_r)
    torch.testing.assert_close(o, o_r)
    torch.testing.assert_close(after, after_r)
    p = prefill_families(True, DEV)["gva-varlen-h0"]
    args, kw = prefill_problem(p, torch.float32, DEV)
    want = FF.chunk_gated_delta_rule(*args, **kw)
    args[8] = _t([0, 5, 5, 37, 700], torch.int64)                     # clamped to T = 70: the same call
    got = FF.chunk_gated_delta_rule(*args, **kw)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_alpha_zero_clears_the_state():
    """alpha = 0 at a token: nothing before it reaches the outputs after it (refgdn: exp(log 0) = 0; fast: the decay's
    log floored at LOG_DECAY_FLOOR, 0 in float32) -- the same outputs with the tokens before it changed."""
    p = dict(prefill_families(True, DEV)["one-seq-chunks"], cu=[0, 40])
    args, kw = prefill_problem(p, torch.float32, DEV)
    alpha = args[3]
    alpha[10] = 0.0                                                  # every head, token 10
    for pkg in (RF, FF):
        o1, _ = pkg.chunk_gated_delta_rule(*args, **kw)
        changed = list(args)
        changed[2] = args[2].clone()
        changed[2][:10] += 1.0                                       # v before token 10
        o2, _ = pkg.chunk_gated_delta_rule(*changed, **kw)
        torch.testing.assert_close(o2[10:], o1[10:], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(o2[:10], o1[:10])


def test_fast_reads_nothing_back_unless_asked():
    """Capturable by default: no host read (refgdn.capture's guards) without check_values, one with it."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    for p in decode_families(True, DEV).values():
        fn, args, kw = decode_problem(p, torch.float32, DEV)
        with capture_guards("flashinfer_ops", DEV):
            run_decode(getattr(FF, fn), fn, args, kw)
    fn, args, kw = decode_problem(decode_families(True, DEV)["pretranspose-pool-padded"], torch.float32, DEV)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("flashinfer_ops", DEV):
            run_decode(lambda *a, **k: getattr(FF, fn)(*a, **k, check_values=True), fn, args, kw)
    for name in ("gva-varlen-h0", "checkpoints"):                     # (varlen; the checkpoints' rows)
        args, kw = prefill_problem(prefill_families(True, DEV)[name], torch.float32, DEV)
        with capture_guards("flashinfer_ops", DEV):
            run_prefill(FF.chunk_gated_delta_rule, args, kw)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("flashinfer_ops", DEV):
            run_prefill(lambda *a, **k: FF.chunk_gated_delta_rule(*a, **k, check_values=True), args, kw)


def test_keys_equal_the_launches():
    """fast.keys.flashinfer_ops predicts each call's launches (traced_ops raises on a mismatch)."""
    from fast import keys as fk
    from refgdn.capture import KeyLog, recording, traced_ops
    F = traced_ops(FF, keys=fk.flashinfer_ops)
    log = KeyLog()
    with recording(log):
        for p in decode_families(True, DEV).values():
            fn, args, kw = decode_problem(p, torch.float32, DEV)
            run_decode(getattr(F, fn), fn, args, kw)
    assert [key.kernel for key in log.launched] == ["recurrent_slots_kernel"] * len(decode_families(True, DEV))
    log = KeyLog()
    with recording(log):           # varlen, one sequence (the dense call), GQA, checkpoints (the state pass's CKPT)
        for name in ("gva-varlen-h0", "one-seq-chunks", "gqa-no-alpha", "checkpoints"):
            run_prefill(F.chunk_gated_delta_rule, *prefill_problem(prefill_families(True, DEV)[name], torch.float32,
                                                                   DEV))
    assert "chunk_table_kernel" in [key.kernel for key in log.launched]     # the device tables of the varlen calls


def test_mtp_default_warning_is_flashinfers_only():
    """An explicit disable_state_update warns about nothing."""
    fn, args, kw = decode_problem(decode_families(True, DEV)["mtp-commit"], torch.float32, DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_decode(getattr(FF, fn), fn, args, kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
@pytest.mark.parametrize("name", ["pretranspose-pool-padded", "mtp-commit-buffer-out-idx"])
def test_cuda_graph_replay_equals_eager(name):
    """Captured once, replayed on new tokens copied into the static buffers: bit for bit the eager call's outputs,
    pool and buffer, round after round (bf16; the pool carries over)."""
    p = decode_families(True, DEV)[name]
    fn, static, kw = decode_problem(p, torch.bfloat16, DEV)
    op = getattr(FF, fn)
    at = 3 if fn.endswith("mtp") else None
    pool_of = (lambda a, k: a[3]) if at is not None else (lambda a, k: k["initial_state"])   # noqa: E731
    e_args, e_kw = list(static), {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    if at is not None:
        e_args[3] = static[3].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(*[t.clone() if isinstance(t, torch.Tensor) else t for t in static],
           **{n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})   # compile outside
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, _ = op(*static, **kw)
    gates = (6, 8) if fn.endswith("mtp") else (5, 7)
    for rnd in range(3):
        _, new, _ = decode_problem(p, torch.bfloat16, DEV, seed=10 + rnd)
        for i in (0, 1, 2) + gates:                              # q, k, v, a, b (the layer's weights stay)
            static[i].copy_(new[i])
            e_args[i].copy_(new[i])
        graph.replay()
        o_e, _ = op(*e_args, **e_kw)
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_e), rnd
        assert torch.equal(pool_of(static, kw), pool_of(e_args, e_kw)), rnd
        if "intermediate_states_buffer" in kw:
            assert torch.equal(kw["intermediate_states_buffer"], e_kw["intermediate_states_buffer"]), rnd


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU")
def test_prefill_cuda_graph_replay_equals_eager():
    """The prefill captured (no host read: its chunk tables are built on the device) and replayed on new offsets of
    the same total: bit for bit the eager call's output and final states."""
    p = prefill_families(True, DEV)["gva-varlen-h0"]
    static, kw = prefill_problem(p, torch.bfloat16, DEV)
    graph, (o_static, s_static) = captured(lambda: FF.chunk_gated_delta_rule(*static, **kw))
    for cu in ([0, 5, 5, 37, 70], [0, 1, 30, 30, 70], [0, 70, 70, 70, 70]):
        static[8].copy_(_t(cu, torch.int64))
        graph.replay()
        o_e, s_e = FF.chunk_gated_delta_rule(*static, **kw)
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_e) and torch.equal(s_static, s_e), cu


@pytest.mark.parametrize("starts,rows,words", [
    pytest.param([1, 2, 2, 4], 5, r"checkpoint_cu_starts\[0\] must be 0", id="not-from-0"),
    pytest.param([0, 2, 2, 4], 5, "gives sequence 0 2 checkpoints; its 70 tokens make 1", id="wrong-count"),
    pytest.param([0, 1, 1, 2], 1, "ends at 2, past state_checkpoints' 1 rows", id="past-the-rows"),
])
def test_bad_checkpoint_rows(starts, rows, words):
    """refgdn always checks checkpoint_cu_starts' values, fast with check_values=True (same words); nothing is
    written."""
    p = prefill_families(True, DEV)["checkpoints"]
    for pkg, extra in ((RF, {}), (FF, dict(check_values=True))):
        args, kw = prefill_problem(p, torch.float32, DEV)
        kw["checkpoint_cu_starts"] = _t(starts, torch.int64)
        kw["state_checkpoints"] = torch.full((rows,) + kw["state_checkpoints"].shape[1:], SENTINEL, device=DEV)
        before = kw["state_checkpoints"].clone()
        with pytest.raises(ValueError, match=words):
            pkg.chunk_gated_delta_rule(*args, **kw, **extra)
        assert torch.equal(kw["state_checkpoints"], before)


@pytest.mark.parametrize("name", list(decode_families(quick=True, device=DEV)))
def test_layout_plan_equals_the_checked_call(name, monkeypatch):
    """From a layout's second call fast serves the decode / MTP step from a plan (fast.launch.LayoutPlans: no checks,
    the compiled launcher reused on a GPU): bit for bit the checked call (check_values=True: never served), round
    after round; a bad argument afterwards still meets the checks."""
    p = decode_families(quick=True, device=DEV)[name]
    FF._DECODE.clear()
    checked = []
    real = FF.check_flashinfer_decode_inputs
    monkeypatch.setattr(FF, "check_flashinfer_decode_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    rounds = 2
    for seed in range(rounds):
        fn, args, kw = decode_problem(p, torch.float32, DEV, seed)
        op = getattr(FF, fn)
        got = run_decode(op, fn, args, kw)
        want = run_decode(lambda *a, **k: op(*a, **k, check_values=True), fn, args, kw)
        for what, x, y in zip(("o", "states", "buffer"), got, want):
            assert (x is None and y is None) or torch.equal(x, y), f"round {seed}: {what}"
    assert len(checked) == rounds + 2, len(checked)      # every check_values call, the layout's first two
    gates = 6 if fn.endswith("mtp") else 5
    args[gates] = args[gates][:, :, :1]
    with pytest.raises(ValueError, match=r"a must have shape \[B, T, HV\]"):
        op(*args, **kw)


def test_prefill_plan_equals_the_checked_call(monkeypatch):
    """From a signature's second call the prefill skips its checks and launches through its plan (fast.launch's
    SignaturePlans; T and N are no part of the signature): bit for bit a call whose plans were forgotten, over
    request mixes of other lengths; a bad argument afterwards still meets the checks."""
    base = prefill_families(True, DEV)["gva-varlen-h0"]
    checked = []
    real = FF.check_flashinfer_prefill_inputs
    monkeypatch.setattr(FF, "check_flashinfer_prefill_inputs", lambda *a, **k: checked.append(1) or real(*a, **k))
    FF._PREFILL.clear()
    mixes = ([0, 5, 5, 37, 70], [0, 9, 30, 31, 50])
    for seed, cu in enumerate(mixes):
        args, kw = prefill_problem(dict(base, cu=cu), torch.float32, DEV, seed)
        got = FF.chunk_gated_delta_rule(*args, **kw)       # (from the second mix on: served by the plan)
        FF._PREFILL.clear()
        want = FF.chunk_gated_delta_rule(*args, **kw)      # checked, launched as it is
        assert all(torch.equal(x, y) for x, y in zip(got, want)), cu
        FF.chunk_gated_delta_rule(*args, **kw)             # the signature's second call: its plan kept
    n = len(checked)
    args, kw = prefill_problem(dict(base, cu=[0, 3, 20, 20, 41]), torch.float32, DEV, 7)
    FF.chunk_gated_delta_rule(*args, **kw)
    assert len(checked) == n                     # served: no checks
    args[3] = args[3][:, :1]
    with pytest.raises(ValueError, match=r"g must have shape \[T, num_sab_heads\]"):
        FF.chunk_gated_delta_rule(*args, **kw)


def test_unchecked_checkpoint_rows_stay_in_the_buffer():
    """Unchecked, fast stores no checkpoint outside state_checkpoints (rows past its end are skipped) and writes each
    one where checkpoint_cu_starts puts it."""
    p = prefill_families(True, DEV)["checkpoints"]
    args, kw = prefill_problem(p, torch.float32, DEV)
    _, _, good = run_prefill(FF.chunk_gated_delta_rule, args, kw)          # rows 0, 1 (sequences 0, 2), 2 spare
    kw["checkpoint_cu_starts"] = _t([0, 1, 2, 3], torch.int64)            # sequence 2's row moved to the spare one
    _, _, moved = run_prefill(FF.chunk_gated_delta_rule, args, kw)
    assert torch.equal(moved[0], good[0]) and torch.equal(moved[2], good[1])
    assert torch.equal(moved[1], kw["state_checkpoints"][1])               # row 1: nobody's now
    kw["checkpoint_cu_starts"] = _t([0, 1, 3, 4], torch.int64)            # sequence 2's row 3: past R = 3
    _, _, past = run_prefill(FF.chunk_gated_delta_rule, args, kw)
    assert torch.equal(past[0], good[0]) and torch.equal(past[1:], kw["state_checkpoints"][1:])
