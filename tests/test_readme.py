"""Every ```python block of README.md runs as written, and the quickstart's training loop learns.

Each block runs in a fresh namespace (a reader may copy any one of them), on the CPU with the
8 virtual devices of ``tests/conftest.py`` (the parallelism block needs them).
"""

import math
import pathlib
import re

import pytest

pytestmark = pytest.mark.usefixtures("fast_compiles")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[int, str]]:
    """``(line number, source)`` of every ```python block of README.md."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def run_block(line: int, source: str) -> dict:
    namespace = {"__name__": f"readme_line_{line}"}
    exec(compile(source, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - running the README is the test
    return namespace


def test_readme_has_a_quickstart_and_stays_short():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    assert "## Quickstart" in text
    assert python_blocks(), "no ```python blocks found"
    for doc in ("docs/performance.md", "docs/kernels.md", "docs/migrating-from-transformer-engine.md", "CHANGELOG.md"):
        assert f"]({doc})" in text, f"README does not link {doc}"
        assert (README.parent / doc).is_file(), f"{doc} is linked but missing"


def test_ci_runs_the_readme_commands():
    """The README opens with the set-up and test commands, and `.ci/run` runs that test command."""
    text = README.read_text(encoding="utf-8")
    first = re.search(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert first and text.index(first.group(0)) < text.index("\n## "), "the set-up commands must come first"
    commands = [line for line in first.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and "pip install" in commands[0] and "pytest" in commands[1]
    test_command = commands[1].split("&&")[-1].strip()
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci, f".ci/run does not run the README's test command {test_command!r}"


@pytest.mark.parametrize("line,source", [pytest.param(*block, id=f"README.md:{block[0]}") for block in python_blocks()])
def test_readme_python_block_runs(line, source):
    namespace = run_block(line, source)
    if "losses" in namespace:  # the quickstart's training loop
        losses = namespace["losses"]
        assert not any(math.isnan(loss) for loss in losses), f"NaN loss in the quickstart: {losses}"
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < first - 1.0, f"the quickstart's loss did not fall: {first:.3f} -> {last:.3f}"


def test_the_quickstart_trains():
    quickstart = [(line, src) for line, src in python_blocks() if "losses" in src]
    assert quickstart, "no README block records a training loss"
