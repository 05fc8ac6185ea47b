"""The causal-conv1d package's API (refgdn.compat, fast.compat) against transformers' torch versions of the same two
functions (what its Qwen3-Next layer calls when causal-conv1d is not installed) and the conformance rule."""
from __future__ import annotations

import pytest
import torch

import fast.compat as fc
import refgdn
import refgdn.compat as rc
from conformance.core import Check, evaluate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
hf_mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
HF_UPDATE = getattr(hf_mod.causal_conv1d_update, "__wrapped__", hf_mod.causal_conv1d_update)
HF_FN = getattr(hf_mod.causal_conv1d_fn, "__wrapped__", hf_mod.causal_conv1d_fn)
B, D, W = 3, 40, 4


def _conforms(name, got, truth, ref, dtype):
    res = evaluate(Check(name, got.cpu(), truth, ref.cpu(), dtype=dtype))
    assert res["passed"], f"{name}: {res}"


@pytest.mark.parametrize("S", [W - 1, W, W + 2], ids=lambda s: f"state-width-{s}")
@pytest.mark.parametrize("mod", [rc, fc], ids=["refgdn", "fast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_update_matches_transformers(S, mod, dtype):
    """One decode token: the state buffer (any width >= W-1; transformers keeps W) shifts exactly as transformers'
    torch update shifts it (bit for bit); the output passes the rule against the float64 result, transformers' in
    `dtype` as the reference."""
    gen = torch.Generator().manual_seed(S)
    w, b = (torch.randn(D, W, generator=gen).to(dtype), torch.randn(D, generator=gen).to(dtype))
    st, x = torch.randn(B, D, S, generator=gen).to(dtype), torch.randn(B, D, 1, generator=gen).to(dtype)
    ref_state, got_state, truth_state = st.clone(), st.clone().to(DEVICE), st.double()
    ref = HF_UPDATE(x, ref_state, w, b, "silu")
    truth = HF_UPDATE(x.double(), truth_state, w.double(), b.double(), "silu")
    got = mod.causal_conv1d_update(x.to(DEVICE), got_state, w.to(DEVICE), b.to(DEVICE), "silu")
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got_state.cpu(), ref_state)
    _conforms("out", got, truth, ref, dtype)
    y2 = mod.causal_conv1d_update(x[:, :, 0].to(DEVICE), got_state, w.to(DEVICE), b.to(DEVICE), "silu")   # [B, D]
    assert y2.shape == (B, D)


@pytest.mark.parametrize("mod", [rc, fc], ids=["refgdn", "fast"])
def test_fn_matches_transformers_and_the_states(mod):
    """Prefill, channels first: out as transformers' torch causal_conv1d_fn (the rule, float32); with initial states
    and final states (written into final_states_out), as refgdn.causal_conv1d on the [B, T, D] layout."""
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    x = torch.randn(B, D, 37, generator=gen)
    got = mod.causal_conv1d_fn(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), activation="silu")
    assert got.shape == x.shape
    _conforms("out", got, HF_FN(x.double(), w.double(), b.double(), activation="silu"),
              HF_FN(x, w, b, activation="silu"), torch.float32)
    h0 = torch.randn(B, D, W - 1, generator=gen)
    into = torch.empty(B, D, W - 1, device=DEVICE)
    out, final = mod.causal_conv1d_fn(x.to(DEVICE), w.to(DEVICE), None, None, h0.to(DEVICE), True, into, None)
    y_t, f_t = refgdn.causal_conv1d(x.transpose(1, 2).double(), w.double(), None, None, h0.double(), True)
    y_r, f_r = refgdn.causal_conv1d(x.transpose(1, 2), w, None, None, h0, True)
    assert final is into
    _conforms("out", out.transpose(1, 2), y_t, y_r, torch.float32)
    assert torch.equal(final.cpu(), f_r)                # the last W-1 inputs: copies


def _i(v):
    return torch.tensor(v, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("mod", [rc, fc], ids=["refgdn", "fast"])
@pytest.mark.parametrize("S", [W - 1, W], ids=lambda s: f"state-width-{s}")
def test_update_with_conv_state_indices(mod, S):
    """A pool of 7 states, B = 3 rows picked by conv_state_indices (int32 and int64): each picked row shifted as
    transformers' update of those rows shifts them (bit for bit), the other rows untouched; the output by the
    conformance rule against the float64 update."""
    gen = torch.Generator().manual_seed(11 + S)
    w, b = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    pool, x = torch.randn(7, D, S, generator=gen), torch.randn(B, D, 1, generator=gen)
    for dt in (torch.int32, torch.int64):
        idx = torch.tensor([5, 0, 3], dtype=dt)
        rows = pool[idx.long()].clone()
        want = HF_UPDATE(x, rows, w, b, "silu")
        got_pool = pool.clone().to(DEVICE)
        got = mod.causal_conv1d_update(x.to(DEVICE), got_pool, w.to(DEVICE), b.to(DEVICE), "silu",
                                       conv_state_indices=idx.to(DEVICE))
        assert got.shape == x.shape
        want_pool = pool.clone()
        want_pool[idx.long()] = rows
        assert torch.equal(got_pool.cpu(), want_pool)            # picked rows shifted as transformers', others kept
        _conforms("out", got, HF_UPDATE(x.double(), pool[idx.long()].double(), w.double(), b.double(), "silu"),
                  want, torch.float32)


@pytest.mark.parametrize("mod", [rc, fc], ids=["refgdn", "fast"])
@pytest.mark.parametrize("S", [W - 1, W], ids=lambda s: f"state-width-{s}")
@pytest.mark.parametrize("pick", [[5, -1, 3], [-1, -1, -1], [-2, 6, -1]], ids=["one-padded", "all-padded", "two-padded"])
def test_update_with_padded_conv_state_indices(mod, pick, S):
    """Negative conv_state_indices are padded rows (causal-conv1d's padding): their outputs are zeros and no pool row
    is written for them; the live rows are updated bit for bit as transformers' update of those rows alone (S = W-1:
    through the ops' vLLM-form update on the device; S = W: gathered and written back)."""
    gen = torch.Generator().manual_seed(13)
    w, b = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    pool, x = torch.randn(7, D, S, generator=gen), torch.randn(B, D, 1, generator=gen)
    live = [i for i, v in enumerate(pick) if v >= 0]
    got_pool = pool.clone().to(DEVICE)
    got = mod.causal_conv1d_update(x.to(DEVICE), got_pool, w.to(DEVICE), b.to(DEVICE), "silu",
                                   conv_state_indices=_i(pick))
    want_pool, want = pool.clone(), torch.zeros_like(x)
    if live:
        rows = pool[[pick[i] for i in live]].clone()
        want[live] = HF_UPDATE(x[live], rows, w, b, "silu")
        want_pool[[pick[i] for i in live]] = rows
    assert torch.equal(got_pool.cpu(), want_pool)                # only the live rows' states moved
    padded = [i for i in range(B) if i not in live]
    assert torch.equal(got.cpu()[padded], torch.zeros_like(x[padded]))
    if live:
        _conforms("out", got[live], HF_UPDATE(x[live].double(), pool[[pick[i] for i in live]].double(), w.double(),
                                              b.double(), "silu"), want[live], torch.float32)


@pytest.mark.parametrize("mod", [rc, fc], ids=["refgdn", "fast"])
def test_refusals_name_the_argument_and_leave_the_state(mod):
    gen = torch.Generator().manual_seed(8)
    w, st = torch.randn(D, W, generator=gen).to(DEVICE), torch.randn(B, D, W, generator=gen).to(DEVICE)
    x = torch.randn(B, D, 1, generator=gen).to(DEVICE)
    before = st.clone()
    for call, arg in ((lambda: mod.causal_conv1d_update(x, st, w, cache_seqlens=torch.zeros(B)), "cache_seqlens"),
                      (lambda: mod.causal_conv1d_update(x, st, w, conv_state_indices=torch.zeros(B)),
                       "conv_state_indices"),                                            # float indices
                      (lambda: mod.causal_conv1d_update(x, st, w, conv_state_indices=_i([0, 1, 1])),
                       "conv_state_indices"),                                            # a duplicate
                      (lambda: mod.causal_conv1d_update(x, st, w, conv_state_indices=_i([0, 1, 3])),
                       "conv_state_indices"),                                            # out of the pool
                      (lambda: mod.causal_conv1d_update(x, st, w, conv_state_indices=_i([-1, 1, 1])),
                       "conv_state_indices"),                                            # a duplicate beside a pad
                      (lambda: mod.causal_conv1d_update(x, st, w, conv_state_indices=_i([0, 1])),
                       "conv_state_indices"),                                            # not [B]
                      (lambda: mod.causal_conv1d_update(x.repeat(1, 1, 2), st, w), "x"),
                      (lambda: mod.causal_conv1d_update(x, st, w[:5]), "weight"),          # the op's own check
                      (lambda: mod.causal_conv1d_fn(x, w, seq_idx=torch.zeros(B, 1)), "seq_idx")):
        with pytest.raises(ValueError, match=arg):
            call()
        assert torch.equal(st, before)


def test_fast_indexed_update_reads_nothing_back_unless_asked():
    """fast's indexed update of a [S_pool, D, W-1] pool runs on the device: no host read (refgdn.capture's guards: it
    can be captured in a CUDA graph); check_values=True reads and checks the values (a duplicate named) before any
    write; refgdn's checks them always."""
    from refgdn.capture import HostSyncInCapture, capture_guards
    gen = torch.Generator().manual_seed(21)
    w, pool = torch.randn(D, W, generator=gen).to(DEVICE), torch.randn(7, D, W - 1, generator=gen).to(DEVICE)
    x, idx = torch.randn(B, D, generator=gen).to(DEVICE), _i([5, -1, 3])
    with capture_guards("compat", DEVICE):
        fc.causal_conv1d_update(x, pool, w, None, "silu", conv_state_indices=idx)
    with pytest.raises(HostSyncInCapture):
        with capture_guards("compat", DEVICE):
            fc.causal_conv1d_update(x, pool, w, None, "silu", conv_state_indices=idx, check_values=True)
    before = pool.clone()
    for call in (lambda: fc.causal_conv1d_update(x, pool, w, conv_state_indices=_i([2, 4, 2]), check_values=True),
                 lambda: rc.causal_conv1d_update(x, pool, w, conv_state_indices=_i([2, 4, 2]))):
        with pytest.raises(ValueError, match="conv_state_indices must be distinct"):
            call()
    assert torch.equal(pool, before)
