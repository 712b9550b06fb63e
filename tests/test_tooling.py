"""The repository's tooling: CI's script, the lint configuration, the command line from a checkout."""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _commands(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_builds_its_environment_in_a_temporary_folder_and_leaves_dot_venv_alone():
    commands = _commands(CI)
    assert any("mktemp -d" in c for c in commands)
    assert any(re.search(r"trap .*rm -rf", c) for c in commands), "the temporary environment is removed on exit"
    assert not any(".venv" in c for c in commands), "CI must not create, activate or delete the checkout's .venv"


def test_ci_lints_before_running_exactly_the_test_command():
    commands = _commands(CI)
    lint = next(i for i, c in enumerate(commands) if c == "ruff check .")
    test = next(i for i, c in enumerate(commands) if "python -m pytest -n 2 -q" in c)
    assert lint < test
    assert '-eq 5' in CI, "pytest's exit 5 (no tests collected) is reported"


def test_ruff_is_configured():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ruff = config["tool"]["ruff"]
    assert ruff["line-length"] == 120
    assert {"E", "F", "W", "I", "B", "UP"} <= set(ruff["lint"]["select"])
    assert any(dep.startswith("ruff") for dep in config["project"]["optional-dependencies"]["lint"])


def test_python_dash_m_mtjax_cli_runs_from_the_repository_root():
    """From the root, ``mtjax/`` is the source folder while kernels/, sharding/ and train/ live beside it;
    the editable install still resolves mtjax.kernels & co."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "mtjax.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    for command in ("info", "train", "generate", "bench"):
        assert command in result.stdout
