"""The serving ops on a cache in vLLM's hybrid layout (conformance.cases_serving.paged_cache: each slot's conv
window and ssm state side by side in one page of a raw buffer, the cache's ssm_state and conv_state views with the
page as their slot stride; each head's state stored [K, V] or, as newer vLLM's, [V, K]): every op of both
packages computes, bit for bit, what it computes on the allocated (contiguous) cache, and writes nothing outside
its views.

Bit for bit holds where the pages keep the slot strides divisible by 16 elements (64-byte pages here, as vLLM's
page sizes are), as a contiguous cache's are: Triton compiles the same kernel variants. Other strides compile the
other variants (another load layout, so another summation order: H200, float32 state, differences up to 3e-8 in
o); the conformance families paged-cache-align4 and prefill-paged-cache-bf16 check those against refgdn."""
import pytest
import torch

import fast.serving as fs
import refgdn.serving as rs
from conformance.cases_serving import drive, make_cache, make_layer, make_tokens, page_gaps, paged_cache

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"

# verify + accept rounds, decodes, prefills with and without an initial state (a padded row throughout)
STEPS = [("verify", [2, 1, 0], [3, 1, 1]), ("decode",), ("prefill", [5, 0, 37], [True, True, False]), ("decode",),
         ("verify", [3, 0, 2], [2, 1, 3]), ("prefill", [70, 0, 1], [True, False, True]), ("decode",)]
SLOTS = [3, -1, 0]


def _run_both(ops, state_dtype, dtype, device, layout="kv"):
    H, HV, K, V, W = 1, 2, 16, 16, 4
    base = make_cache(5, H, HV, K, V, W, max_draft=3, seed=1, state_dtype=state_dtype, act_dtype=dtype,
                      device=device)
    layer = make_layer(H, HV, K, V, W, seed=2, dtype=dtype, device=device)
    paged, raw = paged_cache(base, state_layout=layout)
    assert paged.ssm_state.stride(0) != HV * K * V and not paged.ssm_state.is_contiguous()
    assert paged.ssm_state.stride(3) == (1 if layout == "kv" else K)
    kw = dict(H=H, HV=HV, K=K, V=V, dtype=dtype, seed=3, device=device)
    flat = drive(ops, base.clone(), layer, STEPS, SLOTS, **kw)
    # (drive's records hold clones; the paged cache is the one the ops wrote)
    pag = drive(ops, paged, layer, STEPS, SLOTS, **kw)
    return flat, pag, paged, raw, base


def _assert_same(flat, pag, paged, raw, base, keys=("ssm", "conv", "conv_state", "pend_meta"), outputs=True):
    """The paged run's records equal the flat run's at ``keys`` (and the real requests' outputs); nothing was
    written outside the pages' views; the slots no request used kept theirs."""
    for r, (f, p) in enumerate(zip(flat, pag)):
        offs = torch.tensor([0] + f["lens"]).cumsum(0).tolist()
        for n, s in enumerate(SLOTS):                          # (padded rows' outputs: unspecified in a prefill)
            if outputs and s >= 0:
                assert torch.equal(p["o"][offs[n]:offs[n + 1]], f["o"][offs[n]:offs[n + 1]]), (r, f["kind"], n)
        for key in keys:
            assert torch.equal(p[key], f[key]), (r, f["kind"], key)
    assert not page_gaps(raw, paged).any(), "a kernel wrote outside the cache's views"
    untouched = [s for s in range(paged.num_slots) if s not in SLOTS]
    for name in ("ssm_state", "conv_state"):
        assert torch.equal(getattr(paged, name)[untouched], getattr(base, name)[untouched])


LAYOUTS = [pytest.param("kv", id="kv-blocks"), pytest.param("vk", id="vk-blocks")]   # see paged_cache


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_fast_ops_on_a_paged_cache_bit_for_bit(state_dtype, layout="kv"):
    """fast.serving's verify / accept / decode / prefill (materialize inside it) on the paged cache: outputs, the
    committed states, the conv windows and the metadata equal the contiguous cache's run bit for bit; the pages'
    unused bytes stay zero; untouched slots keep theirs."""
    _assert_same(*_run_both(fs, state_dtype, torch.float32, DEV, layout))


def test_refgdn_ops_on_a_paged_cache_bit_for_bit():
    """The oracle takes the same layout (float64)."""
    _assert_same(*_run_both(rs, torch.float64, torch.float64, "cpu"))


@pytest.mark.parametrize("ops", [pytest.param(fs, id="fast"), pytest.param(rs, id="refgdn")])
def test_vk_state_blocks_are_read_and_written_in_place(ops):
    """[V, K] state blocks (newer vLLM's (HV, V, K) temporal state, seen transposed as [K, V]): the same protocol
    on a page cache of that layout. The products now read the state with other strides, so their summation order
    may differ (refgdn's float64 matmuls too): the numbers are checked by the conformance families
    paged-cache-align64-vk-state and paged-vk-state-qwen-shape-bf16 (against the float64 truth); here, what must be
    exact: the conv windows, the metadata, the untouched slots and the pages' unused bytes."""
    dt, dev = (torch.float32, DEV) if ops is fs else (torch.float64, "cpu")
    flat, pag, paged, raw, base = _run_both(ops, dt, dt, dev, "vk")
    _assert_same(flat, pag, paged, raw, base, keys=("conv", "conv_state", "pend_meta"), outputs=False)
    assert paged.ssm_state.stride(2) == 1                        # (still the [V, K] layout: written in place)


@pytest.mark.skipif(not GPU, reason="bf16 and the pipelined forward (one long sequence) run on a CUDA device only")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T", [4099, 16384 + 7], ids=["one-pass", "pipelined"])
def test_fast_long_prefill_on_a_paged_cache_gpu(T, layout):
    """One long bf16 request (pipelined over segments from 16384 tokens: the first segment reads the slot's page,
    the last writes it) on the paged cache, either state layout, equals the contiguous cache's, bit for bit (the
    state pass only loads and stores the state with the cache's strides: its products are the same)."""
    H, HV, K, V, W = 2, 4, 128, 128, 4
    D = 2 * H * K + HV * V
    base = make_cache(3, H, HV, K, V, W, seed=4, state_dtype=torch.float32, act_dtype=torch.bfloat16,
                      device="cuda")
    layer = make_layer(H, HV, K, V, W, seed=5, dtype=torch.bfloat16, device="cuda")
    x, a, b = make_tokens(T, HV, D, seed=6, dtype=torch.bfloat16, device="cuda")
    args = (layer["conv_weight"], layer["conv_bias"], layer["A_log"], layer["dt_bias"])
    idx, cu = torch.tensor([1], device="cuda"), torch.tensor([0, T], dtype=torch.int32, device="cuda")
    flat = base.clone()
    paged, raw = paged_cache(base, state_layout=layout)
    o_flat = fs.gdn_prefill(x, a, b, *args, flat, idx, cu)
    o_pag = fs.gdn_prefill(x, a, b, *args, paged, idx, cu)
    assert torch.equal(o_pag, o_flat)
    assert torch.equal(paged.ssm_state, flat.ssm_state) and torch.equal(paged.conv_state, flat.conv_state)
    assert not page_gaps(raw, paged).any()


def test_wrap_an_engines_state_tensors():
    """GDNStateCache.wrap over an engine's state views (vLLM's newer layout: conv (S, W-1+spec, D) and temporal
    (S, HV, V, K) in pages, passed transposed): the ops use them in place (fast's run on the wrapped views equals
    its run on the same layout built by paged_cache, bit for bit, and the engine's pages hold the result); H is
    inferred from D; the pend_* buffers are allocate's shapes and dtypes; a D that no H explains is refused."""
    H, HV, K, V, W, md = 1, 2, 16, 16, 4, 3
    base = make_cache(5, H, HV, K, V, W, max_draft=md, seed=7, state_dtype=torch.float32, act_dtype=torch.float32,
                      device=DEV)
    for t in (base.pend_k, base.pend_v, base.pend_g, base.pend_beta, base.pend_meta):
        t.zero_()                                             # (wrap's: nothing pending, bank 0)
    want, _ = paged_cache(base, state_layout="vk")
    engine, raw = paged_cache(base, state_layout="vk")
    conv, temporal = engine.conv_state.transpose(-1, -2), engine.ssm_state.transpose(-1, -2)   # as vLLM holds them
    assert temporal.shape == (5, HV, V, K) and temporal.stride(3) == 1 and conv.stride(2) == 1
    got = rs.GDNStateCache.wrap(temporal.transpose(-1, -2), conv.transpose(-1, -2), max_draft=md)
    assert got.ssm_state.data_ptr() == temporal.data_ptr() and got.H == H and got.max_draft == md
    ref = rs.GDNStateCache.allocate(5, H, HV, K, V, W, md, torch.float32, torch.float32, DEV)
    for name in ("pend_k", "pend_v", "pend_g", "pend_beta", "pend_meta"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), name
    layer = make_layer(H, HV, K, V, W, seed=8, dtype=torch.float32, device=DEV)
    kw = dict(H=H, HV=HV, K=K, V=V, dtype=torch.float32, seed=9, device=DEV)
    for f, p in zip(drive(fs, want, layer, STEPS, SLOTS, **kw), drive(fs, got, layer, STEPS, SLOTS, **kw)):
        for key in ("o", "ssm", "conv", "conv_state", "pend_meta"):
            assert torch.equal(p[key], f[key]), (f["kind"], key)
    assert torch.equal(temporal.transpose(-1, -2), want.ssm_state)        # the engine's own tensors were written
    assert not page_gaps(raw, got).any()
    with pytest.raises(ValueError, match="not 2 H K \\+ HV V"):
        rs.GDNStateCache.wrap(temporal.transpose(-1, -2), conv.transpose(-1, -2)[:, 1:])
