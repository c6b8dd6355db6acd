"""The README's tour runs as written, and its two set-up commands are the ones CI uses."""

import pathlib
import re
import subprocess

import pytest


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


@pytest.mark.slow
def test_the_tour_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert (tmp_path / "runs" / "tour" / "policy_map.json").is_file()
    assert namespace["result"].summary["chosen"]["meets_budget"] is True
