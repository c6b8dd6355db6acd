"""The README: its two set-up commands are the ones CI uses, it stays a page for users (short, no
run logs), and each audience's path in it runs as written (the Keras, Flax and language-model
paths in their tiers: tests/test_keras_tuned.py, tests/test_flax_tuned.py, tests/test_llm_tuned.py)."""

import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from autopolicy import cli
from helpers import readme_block, run_readme_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_has_exactly_the_two_setup_commands():
    for marker in ("main-command", "test-command"):
        assert README.count(f"<!-- {marker} -->") == 1
    main = README.split("<!-- main-command -->")[1].split("```bash\n")[1].split("\n")[0]
    assert "autopolicy tune digits_mlp" in main and "pip install -e ." in main
    ci = subprocess.run(
        ["awk", "/<!-- test-command -->/{getline; getline; print; exit}", str(ROOT / "README.md")],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert ci.endswith('python -m pytest -n auto --dist loadscope -m "not slow"') and "[dev]" in ci
    # Built without pip's isolated build environment, so what the build needs comes first.
    requirements, _, rest = ci.partition("--no-build-isolation")
    assert rest and all(r in requirements for r in ('"setuptools>=77"', "wheel", "jaxlib"))
    # The slow tests are not left out: CI runs them as the slow tier (the two make the whole suite).
    slow = README.split("<!-- tier-command: slow -->")[1].split("```bash\n")[1].split("\n")[0]
    assert slow == ".venv/bin/python -m pytest -n auto --dist loadscope -m slow"
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_page_for_users():
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    assert not re.search(r"\d\d:\d\d UTC|\bUTC\b", README)  # no dated run logs
    assert "/work/" not in README and "/tmp/" not in README  # no machine's paths
    for audience in ("nn", "keras", "flax", "llm", "cli"):
        readme_block(audience)  # each audience has its path, once


def _commands(audience):
    """The autopolicy commands of a bash block, as argument lists (comments dropped)."""
    _, code = readme_block(audience)
    out = []
    for line in code.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words and words[0].endswith("autopolicy"):
                out.append(words[1:])
    return out


@pytest.mark.parametrize("audience", ["llm", "cli"])
def test_every_command_line_in_the_readme_parses(audience):
    commands = _commands(audience)
    assert commands
    parser = cli.build_parser()
    for argv in commands:
        parser.parse_args(argv)  # exits 2 on an unknown command or flag


@pytest.mark.slow
def test_the_nn_path_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = run_readme_python("nn", {})
    assert (tmp_path / "runs" / "mlp" / "tuned" / "tuned.json").is_file()
    data = namespace["data"]
    np.testing.assert_array_equal(namespace["predictions"], np.asarray(namespace["result"].model(data.x_test)).argmax(-1))
    assert namespace["result"].summary["chosen"]["meets_budget"] is True


@pytest.mark.slow
def test_the_command_line_path_runs(tmp_path):
    for argv in _commands("cli"):
        out = subprocess.run([sys.executable, "-m", "autopolicy", *argv, *(["--no-progress"] if argv[0] == "tune" else [])],
                             cwd=tmp_path, capture_output=True, text=True, check=False)
        assert out.returncode == 0, (argv, out.stderr)
    assert (tmp_path / "runs" / "digits_mlp" / "report.html").is_file()
    assert (tmp_path / "shipped" / "digits_mlp" / "tuned" / "tuned.json").is_file()
    assert (tmp_path / "map.json").is_file() and (tmp_path / "map.kernels.json").is_file()
