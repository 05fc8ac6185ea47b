"""The conformance runner in-process: a quick subset passes, the JSON report has its fields, and the
rule can fail (a perturbed fast result, a raising case, a one-ulp change in an exact check)."""
import json

import pytest
import torch

import fast
from conformance import cases_prefill, runner
from conformance.core import Case, Check

FIELDS = {"op", "case", "dtype", "chunk_size", "draft_steps", "check", "error", "ref_error", "passed"}
SUBSET = "causal_conv1d_update,gdn_gating,l2norm"    # the cheap ops: the whole quick matrix runs in CI anyway
# the device the fast kernels run on here: natively on a GPU, else in the Triton interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _json(path):
    with open(path) as f:
        return json.load(f)


def test_quick_subset_passes_and_writes_report(tmp_path, capsys):
    path = tmp_path / "report.json"
    rc = runner.main(["--quick", "--device", DEVICE, "--ops", SUBSET, "--json", str(path), "--no-progress", "--jobs", "1"])
    out = capsys.readouterr().out
    records = _json(path)
    assert rc == 0, out
    assert records and all(FIELDS <= set(r) for r in records)
    assert {r["op"] for r in records} == set(SUBSET.split(","))
    assert all(r["passed"] for r in records)
    # bf16 on CPU too, its cases run with the interpreter's casts rounding as a GPU's (cases_prefill.dtypes_for)
    assert {r["dtype"] for r in records} == {"float32", "float16", "bfloat16"}
    assert all(r["draft_steps"] is None for r in records)
    assert "refgdn error" in out and "passed, 0 failed" in out


def test_chunk_records_carry_chunk_size(tmp_path):
    path = tmp_path / "report.json"
    rc = runner.main(["--quick", "--device", DEVICE, "--cases", "chunk_gated_delta_rule/T1-init",
                      "--dtypes", "float32", "--json", str(path), "--no-progress", "--jobs", "1"])
    records = _json(path)
    assert {r["chunk_size"] for r in records} == set(cases_prefill.CHUNK_SIZES)
    assert {r["check"] for r in records} == {"o", "final_state"}
    assert rc == 0, [r for r in records if not r["passed"]]


def test_bf16_cases_round_casts_to_nearest_only_inside_the_case():
    """On CPU the matrix runs a bfloat16 Case (Case.checks) inside fast.utils.interpreter_bf16_round_to_nearest
    (the interpreter truncates fp32 -> bf16 casts; a GPU rounds to nearest even), and the interpreter's own
    conversion is back after it, so no other test sees the change. The wrapped conversion rounds half to even, as
    cvt.rn.bf16.f32 does."""
    import numpy as np
    import triton.language as tl

    from fast.utils import interpreter_bf16_rne_supported, interpreter_bf16_round_to_nearest
    if DEVICE == "cuda" or not interpreter_bf16_rne_supported():
        pytest.skip("the Triton interpreter's conversion is not in use / not the known one")
    from triton.runtime import interpreter as ti
    before = ti._convert_float
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 3 * 2 ** -9, 1 + 2 ** -9, -(1 + 3 * 2 ** -9)],
                 dtype=np.float32)                           # ties to even (down, up), above and below a half
    with interpreter_bf16_round_to_nearest():
        got = ti._convert_float(x, tl.float32, tl.bfloat16, None)
    assert ti._convert_float is before
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)   # torch: RNE
    assert np.array_equal(np.asarray(got, dtype=np.uint16), want)
    assert not np.array_equal(np.asarray(before(x, tl.float32, tl.bfloat16, None), dtype=np.uint16), want)
    seen = []
    case = Case("probe", "probe", torch.bfloat16,
                run=lambda device: seen.append(getattr(ti._convert_float, "_rne", False)) or [])
    runner.run_case(case, DEVICE)
    assert seen == [True] and ti._convert_float is before


def test_perturbed_fast_result_is_reported_failed(tmp_path, monkeypatch):
    """fast.l2norm made wrong by 0.05 on one element (values are <= 1): every l2norm check must fail."""
    real = fast.l2norm

    def wrong(x, eps=1e-6):
        y = real(x, eps).clone()
        y.view(-1)[0] += 0.05
        return y

    monkeypatch.setattr(fast, "l2norm", wrong)
    path = tmp_path / "report.json"
    rc = runner.main(["--quick", "--device", DEVICE, "--ops", "l2norm", "--json", str(path), "--no-progress", "--jobs", "1"])
    records = _json(path)
    assert rc != 0
    assert records and not any(r["passed"] for r in records)
    assert all(r["error"] > r["ref_error"] for r in records)


def test_conv_state_off_by_one_ulp_fails_exact_check(monkeypatch):
    real = fast.causal_conv1d

    def wrong(*args, **kwargs):
        y, s = real(*args, **kwargs)
        s = s.clone()
        s.view(-1)[-1] = torch.nextafter(s.view(-1)[-1], torch.tensor(float("inf"), dtype=s.dtype, device=s.device))
        return y, s

    monkeypatch.setattr(fast, "causal_conv1d", wrong)
    cases, _, _ = runner.collect(True, DEVICE, ["causal_conv1d"], "dense-T63")
    cases = [c for c in cases if c.dtype == torch.float32][:1]     # nextafter has no bf16 CUDA kernel
    records = runner.run_all(cases, DEVICE, progress=False)
    by_check = {r["check"]: r for r in records}
    assert "y" in by_check, records     # (an "<exception>" record instead means the case itself broke)
    assert by_check["y"]["passed"] and not by_check["final_state"]["passed"]


def test_cases_selects_any_of_comma_separated_substrings():
    """--cases a,b: the cases matching a plus those matching b, no others (an empty piece selects nothing more)."""
    mods = ("conformance.cases_prefill",)
    a = runner.collect(True, "cpu", match="gva3", modules=mods)[0]
    b = runner.collect(True, "cpu", match="dense-T63", modules=mods)[0]
    both = runner.collect(True, "cpu", match="gva3,dense-T63,", modules=mods)[0]
    assert a and b
    key = lambda c: (c.op, c.case, str(c.dtype), c.chunk_size)  # noqa: E731
    assert sorted(map(key, both)) == sorted(map(key, a + b)) and not set(map(key, a)) & set(map(key, b))


def test_exception_is_a_failure_record_not_a_crash(capsys):
    def boom(device):
        raise RuntimeError("kernel exploded")

    ok = Case(op="l2norm", case="fine", dtype=torch.float32,
              run=lambda device: [Check("y", torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(3))])
    bad = Case(op="l2norm", case="boom", dtype=torch.float16, run=boom, chunk_size=32)
    records = runner.run_all([bad, ok], "cpu", progress=True)
    err = capsys.readouterr().err
    assert "2/2" in err  # the progress bar reached the end
    assert [r["passed"] for r in records] == [False, True]
    assert records[0]["check"] == "<exception>" and "kernel exploded" in records[0]["detail"]
    assert records[0]["chunk_size"] == 32 and records[0]["dtype"] == "float16"
    assert "FAIL" in runner.format_summary(records)


def test_rule_bound_is_twice_ref_error_plus_floor():
    truth = torch.zeros(4, dtype=torch.float64)
    ref = torch.tensor([1e-3, 0, 0, 0])
    within = Case(op="x", case="c", dtype=torch.float32,
                  run=lambda d: [Check("o", torch.tensor([1.9e-3, 0, 0, 0]), truth, ref)])
    beyond = Case(op="x", case="c", dtype=torch.float32,
                  run=lambda d: [Check("o", torch.tensor([2.1e-3, 0, 0, 0]), truth, ref)])
    assert runner.run_case(within, "cpu")[0]["passed"]
    assert not runner.run_case(beyond, "cpu")[0]["passed"]


def test_quick_matrix_runs_every_family_the_tests_leave_to_it():
    """tests/test_vllm_ops.py, tests/test_sglang_ops.py, tests/test_flashinfer_ops.py and tests/test_serving_fast.py
    leave their fast-vs-refgdn rule checks to the quick matrix (the README's test command runs it first): it collects
    each of their families in fp32, fp16 and bf16."""
    from conformance import cases_flashinfer, cases_serving, cases_sglang, cases_vllm
    cases, problems, _ = runner.collect(True, DEVICE)
    assert not problems
    have = {(c.op, c.case, c.dtype) for c in cases}
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for op, fams in ((cases_vllm.OP, cases_vllm.families), (cases_vllm.CONV_OP, cases_vllm.conv_families),
                     (cases_vllm.CONV_FN_OP, cases_vllm.conv_fn_families),
                     (cases_vllm.PACKED_OP, cases_vllm.packed_families), (cases_sglang.OP, cases_sglang.families),
                     (cases_flashinfer.PREFILL_OP, cases_flashinfer.prefill_families),
                     (cases_flashinfer.DECODE_OP, cases_flashinfer.decode_families)):
        for family, p in fams(True, DEVICE).items():
            want = (torch.float32,) if p.get("fp32_x") else dtypes
            assert all((op, family, dt) in have for dt in want), (op, family)
    serving = cases_serving.cases(True, DEVICE)
    assert serving and all((c.op, c.case, c.dtype) in have for c in serving)


def test_ops_filter_and_missing_case_modules(monkeypatch):
    cases, problems, notes = runner.collect(True, DEVICE, ["gdn_gating"], modules=("conformance.cases_prefill",))
    assert cases and {c.op for c in cases} == {"gdn_gating"} and not problems
    # a missing optional case module is a note; a missing required one is a failure record
    monkeypatch.setattr(runner, "OPTIONAL_MODULES", ("conformance.cases_nonexistent",))
    cases, problems, notes = runner.collect(True, DEVICE, ["gdn_gating"], modules=(
        "conformance.cases_prefill", "conformance.cases_nonexistent", "conformance.cases_missing_required"))
    assert cases and any("cases_nonexistent" in n for n in notes)
    assert [p["op"] for p in problems] == ["conformance.cases_missing_required"]
    assert not problems[0]["passed"]


def test_workers_cover_the_same_checks_as_one_process(tmp_path):
    """--jobs 2 shards the cases over two worker processes and merges their reports: same checks, same verdicts."""
    args = ["--quick", "--device", DEVICE, "--ops", "gdn_gating,l2norm", "--no-progress"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert runner.main(args + ["--jobs", "1", "--json", str(one)]) == 0
    assert runner.main(args + ["--jobs", "2", "--json", str(two)]) == 0
    key = lambda r: (r["op"], r["case"], r["dtype"], r["check"], r["passed"])  # noqa: E731
    assert sorted(map(key, _json(one))) == sorted(map(key, _json(two)))
    assert len(_json(one)) > 4


@pytest.mark.parametrize("max_group", [None, 3], ids=["default", "cap3"])
def test_shards_partition_the_cases_and_keep_variant_groups_together(max_group):
    """Workers' shares partition the cases; a variant group stays in one worker unless it is larger
    than max_group, and then spans no more workers than the pieces it is cut into."""
    cases, _, _ = runner.collect(True, "cpu", modules=("conformance.cases_prefill",))
    parts = [runner.shard(cases, i, 3, max_group) for i in range(3)]
    assert sorted(map(id, sum(parts, []))) == sorted(map(id, cases))          # a partition
    cap = max_group or max(4, -(-len(cases) // 12))
    owners, size = {}, {}
    for i, part in enumerate(parts):
        for c in part:
            key = (c.op, c.dtype, c.chunk_size)
            owners.setdefault(key, set()).add(i)
            size[key] = size.get(key, 0) + 1
    assert all(len(owners[k]) <= -(-size[k] // cap) for k in owners)
    if max_group == 3:
        assert any(len(o) > 1 for o in owners.values())                       # big groups were cut
    loads = [len(p) for p in parts]
    assert max(loads) - min(loads) <= cap                                      # balanced


def test_full_matrix_spreads_slow_float32_chunk_cases():
    """The full matrix's float32 chunk-forward cases at BT = 64 (slow compiles on a GPU) cost more than one each, so
    12 workers (gpu_pass.sh's default) share them instead of one worker taking the whole group."""
    cases, _, _ = runner.collect(False, "cuda", ops=["chunk_gated_delta_rule"])
    slow = [c for c in cases if c.dtype == torch.float32 and c.chunk_size == 64]
    assert len(slow) >= 4 and all(c.cost > 1 for c in slow)
    owners = {i for i in range(12) for c in runner.shard(cases, i, 12) if c in slow}
    assert len(owners) >= 3


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_timeout_reports_what_ran_and_fails(tmp_path, jobs):
    """--timeout: the run stops, keeps the checks that ran, and the rest is a failure, never a silent pass."""
    path = tmp_path / "report.json"
    rc = runner.main(["--quick", "--device", DEVICE, "--ops", "gdn_gating,l2norm", "--json", str(path),
                      "--no-progress", "--jobs", jobs, "--timeout", "0.001"])
    records = _json(path)
    assert rc != 0
    assert any(not r["passed"] and "timeout" in (r["detail"] or "") for r in records)


def test_out_of_memory_case_is_rerun_alone(tmp_path):
    """A case that failed with CUDA's out-of-memory error under several workers is rerun in a process of its own
    and its records replace the failure; the other records stay as they were; a worker's record is never rerun."""
    oom = dict(op="causal_conv1d", case="T1-init", dtype="float32", chunk_size=None, draft_steps=None,
               check="<exception>", error=None, ref_error=None, ratio=None, passed=False,
               detail="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", seconds=None)
    other = dict(oom, case="dense-T63-silu-bias", check="y", passed=True, detail="")
    cublas = dict(oom, case="T129-init-noact", detail="RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when "
                                                        "calling `cublasCreate(handle)`")
    worker = dict(oom, op="<worker>", case="shard3.json", detail="worker exited 1: out of memory")
    wrong = dict(oom, case="dense-T63-silu-bias", dtype="float16", detail="ValueError: x must be [B, T, D]")
    out = runner.rerun_out_of_memory([oom, cublas, other, worker, wrong], ["--quick", "--device", DEVICE])
    for case in ("T1-init", "T129-init-noact"):
        rerun = [r for r in out if r["case"] == case]
        assert {r["check"] for r in rerun} == {"y", "final_state"}, case
        assert {r["dtype"] for r in rerun} == {"float32"}
        assert all(r["passed"] and "rerun alone" in r["detail"] for r in rerun)
    assert other in out and worker in out and wrong in out and oom not in out and cublas not in out
