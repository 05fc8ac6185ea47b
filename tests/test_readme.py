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
