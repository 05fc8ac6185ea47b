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
