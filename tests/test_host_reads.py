"""Varlen host reads: each op reads cu_seqlens' values to the host once per call (its value check and its
varlen tables share the read: refgdn.checks.one_host_read_scope), a model prefill once for all layers, and
the tables built from that read equal the definition (a loop over sequences and chunks)."""
from __future__ import annotations

import pytest
import torch

import fast
import refgdn
import refgdn.checks as checks
from fast.utils import varlen_chunk_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def reads(monkeypatch):
    log = []
    real = checks._read

    def counting(cu):
        log.append(cu)
        return real(cu)
    monkeypatch.setattr(checks, "_read", counting)
    return log


def _tables_by_definition(offs, BT):
    indices, offsets = [], [0]
    for n, (a, b) in enumerate(zip(offs, offs[1:])):
        nc = -(-(b - a) // BT)
        indices += [[n, c] for c in range(nc)]
        offsets.append(offsets[-1] + nc)
    return indices, offsets


@pytest.mark.parametrize("offs", [pytest.param([0, 5], id="one"), pytest.param([0, 0, 64, 65, 65, 200], id="empty-and-edges"),
                                  pytest.param([0, 1, 2, 3, 4, 5], id="ones"), pytest.param([0, 0], id="only-empty")])
@pytest.mark.parametrize("BT", [16, 64])
@pytest.mark.parametrize("dtype", [pytest.param(torch.int32, id="int32"), pytest.param(torch.int64, id="int64")])
@pytest.mark.parametrize("builder", ["lists", "numpy"])
def test_varlen_tables_match_definition(offs, BT, dtype, builder, monkeypatch):
    import fast.utils as fu
    if builder == "numpy":                                  # (small tables are built in Python lists otherwise)
        monkeypatch.setattr(fu, "SMALL_TABLES", 0)
    cu = torch.tensor(offs, dtype=dtype, device=DEVICE)
    idx, off, checked, order = varlen_chunk_tables(cu, BT)
    want_i, want_o = _tables_by_definition(offs, BT)
    counts = [b - a for a, b in zip(want_o, want_o[1:])]
    # longest first by chunk count, ties in index order (a stable sort of -count)
    assert order.dtype == torch.int32 and order.tolist() == sorted(range(len(counts)), key=lambda n: (-counts[n], n))
    assert idx.dtype == off.dtype == torch.int32 and idx.device == off.device == checked.device == cu.device
    assert idx.shape == (len(want_i), 2) and idx.tolist() == want_i and off.tolist() == want_o
    assert checked.dtype == dtype and checked.tolist() == offs and checked.data_ptr() != cu.data_ptr()
    assert idx.is_contiguous() and off.is_contiguous() and checked.is_contiguous()
    assert idx.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 0 and checked.data_ptr() % 16 == 0  # aligned
    assert order.data_ptr() % 16 == 0 and order.is_contiguous()


@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
def test_varlen_table_builders_write_the_same_words(wide):
    """fast.utils' two builders of the varlen tables' host buffer (Python lists for small tables, numpy for large
    ones) give the same int32 words and layout, over random offsets: empty sequences, ties in chunk count, lengths
    across chunk boundaries, int64 offsets written as two words each."""
    import numpy as np

    import fast.utils as fu
    gen = torch.Generator().manual_seed(0)
    for case in range(300):
        N = int(torch.randint(1, 80, (1,), generator=gen))
        lens = torch.randint(0, 200, (N,), generator=gen) * (torch.rand(N, generator=gen) > 0.2)
        offs = [0] + torch.cumsum(lens, 0).tolist()
        BT = (16, 32, 64)[case % 3]
        a, b = fu._table_words(offs, BT, wide), fu._table_words_small(offs, BT, wide)
        assert a[1:] == b[1:] and np.array_equal(a[0], b[0]) and a[0].dtype == b[0].dtype == np.int32, (offs, BT)


@pytest.mark.parametrize("offs, T", [
    pytest.param([0, 5, 5, 70, 71, 200], 200, id="valid"), pytest.param([0, 0, 0], 0, id="only-empty"),
    pytest.param([0, 64, 128], 128, id="whole-chunks"), pytest.param([0, 1, 2, 3, 4, 5], 5, id="ones"),
    pytest.param([5, -3, 1000, 2], 20, id="bad-out-of-range"), pytest.param([0, 10, 5, 20], 20, id="bad-decreasing"),
    pytest.param([0, 2 ** 30, 0, 20], 20, id="bad-far")])
@pytest.mark.parametrize("BT", [16, 64])
@pytest.mark.parametrize("dtype", [pytest.param(torch.int32, id="int32"), pytest.param(torch.int64, id="int64")])
def test_device_chunk_table_matches_definition(offs, T, BT, dtype):
    """Kernel 1's chunk table built on the device before the offsets are checked (fast.chunk.common._Chunks.unchecked):
    the definition applied to the offsets clamped to [0, T] (a negative length has no chunk), cut at the table's
    cdiv(T, BT) + N rows, then rows without a chunk (-1, 0). For valid offsets that is the host table and the offsets
    themselves; for any offsets every row's chunk lies inside its clamped sequence, so inside [0, T)."""
    from fast.chunk.common import _Chunks
    cu = torch.tensor(offs, dtype=dtype, device=DEVICE)
    ch = _Chunks.unchecked(T, BT, cu)
    clamped = [min(max(c, 0), T) for c in offs]
    want = []
    for n, (a, b) in enumerate(zip(clamped, clamped[1:])):
        want += [[n, c] for c in range(-(-max(b - a, 0) // BT))]
    rows = -(-T // BT) + len(offs) - 1
    want = (want + [[-1, 0]] * rows)[:rows]
    assert ch.total == rows and ch.indices.dtype == torch.int32 and ch.indices.tolist() == want
    assert ch.cu_seqlens.dtype == dtype and ch.cu_seqlens.tolist() == clamped
    for n, c in want:
        if n >= 0:
            assert 0 <= clamped[n] + c * BT < clamped[n + 1] <= T


@pytest.mark.parametrize("lens", [
    pytest.param([3, 0, 17, 9, 64, 65, 1, 17], id="ties-and-empty"), pytest.param([0, 0], id="only-empty"),
    pytest.param([200], id="one"), pytest.param([5, 130, 5, 130, 260, 0, 1], id="ties-longest-not-first"),
    pytest.param([2, 0, 1] * 22 + [70], id="over-one-tile"), pytest.param([1, 0] * 550, id="over-the-order-block")])
@pytest.mark.parametrize("BT, dtype", [pytest.param(16, torch.int32, id="16-int32"),
                                       pytest.param(64, torch.int64, id="64-int64")])
def test_device_tables_of_every_kernel_are_the_host_tables(lens, BT, dtype):
    """_Chunks.unchecked(every_kernel=True) (vLLM's chunk op: no host read): for valid offsets, its first rows, its
    int32 offsets and its program order are varlen_chunk_tables' (longest first by chunk count, ties in index order)
    for N <= CHUNK_TABLE_BLOCK sequences; above it the order is the index order."""
    from fast.chunk.common import CHUNK_TABLE_BLOCK, _Chunks
    offs = [0] + torch.tensor(lens).cumsum(0).tolist()
    cu = torch.tensor(offs, dtype=dtype, device=DEVICE)
    ch = _Chunks.unchecked(offs[-1], BT, cu, every_kernel=True)
    idx, off, _, order = varlen_chunk_tables(cu, BT)
    assert ch.offsets.dtype == ch.order.dtype == torch.int32
    assert ch.offsets.tolist() == off.tolist() and ch.indices[:idx.shape[0]].tolist() == idx.tolist()
    if len(lens) <= CHUNK_TABLE_BLOCK:
        assert ch.order.tolist() == order.tolist()
    else:
        assert ch.order.tolist() == list(range(len(lens)))


def _varlen_problem(lens, H=1, HV=2, K=16, V=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V)
    gg = -torch.rand(1, T, HV, generator=g).to(DEVICE)
    beta = torch.rand(1, T, HV, generator=g).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k, v, gg, beta, cu


def test_one_read_per_op_call(reads):
    q, k, v, g, beta, cu = _varlen_problem([3, 0, 17])
    fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=16)
    assert len(reads) == 1, "check + chunk tables: one host read"
    x = torch.randn(1, 20, 8, device=DEVICE)
    w = torch.randn(8, 4, device=DEVICE)
    fast.causal_conv1d(x, w, None, "silu", cu_seqlens=cu)
    assert len(reads) == 2, "conv: check + tile table, one host read"
    reads.clear()
    checks.host_offsets(cu)                                  # no scope open: every call reads
    checks.host_offsets(cu)
    assert len(reads) == 2


def test_backward_reads_once(reads):
    q, k, v, g, beta, cu = _varlen_problem([5, 11])
    for t in (q, k, v):
        t.requires_grad_(True)
    o, _ = fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16)
    n_fwd = len(reads)
    o.sum().backward()
    assert n_fwd == 1 and len(reads) == 2, (n_fwd, len(reads))


def test_model_prefill_reads_once_for_all_layers(reads):
    from refgdn.model import Qwen3NextConfig, Qwen3NextModel
    m = Qwen3NextModel(Qwen3NextConfig.preset("tiny"), ops="fast", dtype=torch.float32, seed=0, device=DEVICE)
    cache = m.allocate_cache(num_slots=2, max_len=64)
    ids = torch.randint(0, m.config.vocab_size, (9,), device=DEVICE)
    meta = m.metadata(cache, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                      torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE), 9)
    reads.clear()
    h = m.prefill(cache, ids, meta)
    assert len(reads) == 1, f"{len(reads)} host reads of cu_seqlens in one prefill (one expected)"
    # with the offsets' host copy (vLLM's query_start_loc_cpu): no read at all, the same result
    cache2 = m.allocate_cache(num_slots=2, max_len=64)
    meta2 = m.metadata(cache2, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                       torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE), 9)
    reads.clear()
    h2 = m.prefill(cache2, ids, meta2, torch.tensor([0, 4, 9], dtype=torch.int32))
    assert len(reads) == 0 and torch.equal(h, h2)
    with pytest.raises(ValueError, match="query_start_loc_cpu must have the shape of meta.query_start_loc"):
        m.prefill(m.allocate_cache(num_slots=2, max_len=64), ids, meta2, torch.tensor([0, 9], dtype=torch.int32))


def test_cu_seqlens_cpu_spares_the_read_and_is_what_the_kernels_see(reads):
    """cu_seqlens_cpu (fla's argument; vLLM's query_start_loc_cpu): no device->host read, the same bits as
    the read path, in fast and in refgdn; its values are checked in cu_seqlens' place, and the kernels
    index by them (the checked copy uploaded with the tables), not by cu_seqlens' device values."""
    q, k, v, g, beta, cu = _varlen_problem([3, 0, 17, 9])
    host = cu.cpu()
    reads.clear()
    for op in (fast.chunk_gated_delta_rule, refgdn.chunk_gated_delta_rule):
        kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=16, output_final_state=True)
        want = op(q, k, v, g, beta, **kw)
        n = len(reads)
        got = op(q, k, v, g, beta, cu_seqlens_cpu=host, **kw)
        assert len(reads) == n, f"{op.__module__}: cu_seqlens read although cu_seqlens_cpu was given"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), op.__module__
    # a host copy that disagrees with cu_seqlens: the segmentation follows the checked host copy
    other = [0, 10, 10, 20, 29]
    stale = torch.tensor(other, dtype=torch.int32, device=DEVICE)
    o_host, _ = fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=stale.cpu(), chunk_size=16)
    o_dev, _ = fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=stale, chunk_size=16)
    assert torch.equal(o_host, o_dev)


def test_values_checked_behind_kernel_1(reads, monkeypatch):
    """Varlen without cu_seqlens' values on the host (fast.chunk's offsets_unchecked): every kernel runs on the
    device-built tables while the host reads (once) and checks the values after the launches; the same bits as with
    the host copy (the host tables for every kernel). Bad values raise the check's error, and nothing is returned."""
    from fast.chunk.common import _Chunks
    built = []
    real = _Chunks.unchecked.__func__
    monkeypatch.setattr(_Chunks, "unchecked",
                        classmethod(lambda cls, *a, **kw: built.append(kw.get("every_kernel")) or real(cls, *a, **kw)))
    q, k, v, g, beta, cu = _varlen_problem([3, 0, 17, 9, 40])
    h0 = torch.randn(5, 2, 16, 16, device=DEVICE)
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=16, output_final_state=True, initial_state=h0)
    reads.clear()
    got = fast.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert len(built) == 1 and len(reads) == 1
    want = fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_cpu=cu.cpu(), **kw)
    assert len(built) == 1 and len(reads) == 1, "with the host copy: host tables only, no read"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    T = q.shape[1]
    for bad, match in (([0, 3, 3, 20, 29, T + 1], "must end at T="), ([0, 3, 2, 20, 29, T], "non-decreasing"),
                       ([1, 3, 3, 20, 29, T], "must start at 0")):
        with pytest.raises(ValueError, match=match):
            fast.chunk_gated_delta_rule(q, k, v, g, beta, **dict(kw, cu_seqlens=torch.tensor(bad, dtype=cu.dtype,
                                                                                                device=DEVICE)))
    assert built == [True] * 4, "one device-built table for every kernel per call"


@pytest.mark.parametrize("bad, match", [
    pytest.param(lambda cu: cu.cpu()[1:], "cu_seqlens_cpu must have the shape of cu_seqlens", id="shape"),
    pytest.param(lambda cu: cu.cpu().float(), "cu_seqlens_cpu must be int32 or int64", id="dtype"),
    pytest.param(lambda cu: torch.empty(cu.shape, dtype=torch.int32, device="meta"), "must be on the CPU", id="device"),
    pytest.param(lambda cu: torch.tensor([0, 3, 3, 20, 28]), "must end at T=29", id="values"),
    pytest.param(lambda cu: [0, 3, 3, 20, 29], "cu_seqlens_cpu must be a torch.Tensor", id="list"),
])
def test_cu_seqlens_cpu_checked(bad, match):
    q, k, v, g, beta, cu = _varlen_problem([3, 0, 17, 9])
    for op in (fast.chunk_gated_delta_rule, refgdn.chunk_gated_delta_rule):
        with pytest.raises(ValueError, match=match):
            op(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=bad(cu), chunk_size=16)
    with pytest.raises(ValueError, match="give cu_seqlens too"):
        fast.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_cpu=cu.cpu(), chunk_size=16)


def test_conv_cu_seqlens_cpu_spares_the_read_and_is_what_the_kernels_see(reads):
    """causal_conv1d's cu_seqlens_cpu, as the chunk op's: no read, the same bits, the host copy's segmentation."""
    lens = [3, 0, 17, 9]
    x = torch.randn(1, sum(lens), 8, device=DEVICE)
    w = torch.randn(8, 4, device=DEVICE)
    s0 = torch.randn(len(lens), 8, 3, device=DEVICE)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=DEVICE)
    for op in (fast.causal_conv1d, refgdn.causal_conv1d):
        kw = dict(initial_state=s0, output_final_state=True, cu_seqlens=cu)
        want = op(x, w, None, "silu", **kw)
        n = len(reads)
        got = op(x, w, None, "silu", cu_seqlens_cpu=cu.cpu(), **kw)
        assert len(reads) == n, f"{op.__module__}: cu_seqlens read although cu_seqlens_cpu was given"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), op.__module__
    stale = torch.tensor([0, 10, 10, 20, 29], dtype=torch.int64, device=DEVICE)
    y_host, f_host = fast.causal_conv1d(x, w, None, "silu", s0, True, cu_seqlens=cu, cu_seqlens_cpu=stale.cpu())
    y_dev, f_dev = fast.causal_conv1d(x, w, None, "silu", s0, True, cu_seqlens=stale)
    assert torch.equal(y_host, y_dev) and torch.equal(f_host, f_dev)
    with pytest.raises(ValueError, match="cu_seqlens_cpu must have the shape of cu_seqlens"):
        fast.causal_conv1d(x, w, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu()[1:])
    with pytest.raises(ValueError, match="must end at T=29"):
        refgdn.causal_conv1d(x, w, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 3, 3, 20, 28]))

