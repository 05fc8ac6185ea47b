"""The README's test command is what CI runs, verbatim."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("Run the tests", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"{command!r} is not a line of .ci/run"


def test_help_shows_shape_contract():
    import refgdn
    for op in (refgdn.chunk_gated_delta_rule, refgdn.recurrent_gated_delta_rule, refgdn.causal_conv1d):
        assert "[B, T," in op.__doc__.split("\n\n")[1]


def test_every_fast_op_has_a_refgdn_twin_with_the_same_signature():
    import inspect

    import fast
    import refgdn
    assert set(fast.__all__) == set(refgdn.__all__)
    for name in fast.__all__:
        f, r = getattr(fast, name), getattr(refgdn, name)
        if inspect.isclass(f):
            continue
        fp, rp = inspect.signature(f).parameters, inspect.signature(r).parameters
        assert list(rp) == [p for p in fp if p in rp], name          # same order for the shared arguments
        assert set(rp) <= set(fp), f"{name}: fast lacks {set(rp) - set(fp)}"


def test_readme_usage_snippet_runs():
    """The README's usage snippet, run as written at a small shape on this machine's device (CPU: the interpreter):
    every name it uses is defined, the shapes and dtypes are the ones its comments state, and fast's o passes the
    conformance rule against the snippet's own float64 oracle result."""
    import torch

    import fast  # noqa: F401  (the snippet imports it)
    import refgdn
    from conformance.core import Check, evaluate
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Usage\n\n```python\n(.+?)\n```", readme, re.S).group(1)
    sizes = "B, T, H, HV, K, V = 1, 4096, 16, 32, 128, 128"
    assert sizes in code
    code = code.replace(sizes, "B, T, H, HV, K, V = 1, 40, 2, 4, 16, 16")
    if not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1":
        code = code.replace('device="cuda"', 'device="cpu"')
    env: dict = {}
    exec(compile(code, "README.md usage", "exec"), env)
    o, s, o_ref = env["o"], env["final_state"], env["o_ref"]
    assert o.shape == (1, 40, 4, 16) and o.dtype == torch.bfloat16
    assert s.shape == (1, 4, 16, 16) and s.dtype == torch.float32
    ins = [env[n] for n in ("q", "k", "v", "g", "beta")]
    o_bf16, _ = refgdn.chunk_gated_delta_rule(*ins, use_qk_l2norm_in_kernel=True)   # the oracle in the same precision
    assert evaluate(Check("o", o, o_ref, ref=o_bf16))["passed"]
