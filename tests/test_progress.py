"""Progress: tqdm bars on a terminal, one line per phase when stderr is a file or a pipe."""

import io
import re
import sys

import pytest

from autopolicy import _progress
from autopolicy.search._progress import progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


class _Captured:
    """stderr as pytest captures it (not a terminal)."""

    def __init__(self, capsys):
        self.capsys = capsys

    def getvalue(self):
        return self.capsys.readouterr().err


@pytest.fixture
def stderr(capsys):
    assert not _progress._on_terminal()  # pytest's captured stderr is not a terminal
    return _Captured(capsys)


LINE = re.compile(r"autopolicy: (?P<desc>[a-z ]+): (?P<count>[0-9/]+) in (?P<s>[0-9]+\.[0-9]) s(?P<extra>.*)")


def test_without_a_terminal_each_phase_is_one_line_when_it_ends(stderr):
    assert list(progress(True, range(4), "layer latency")) == [0, 1, 2, 3]
    assert list(progress(True, iter("ab"), "casts")) == ["a", "b"]
    lines = stderr.getvalue().splitlines()
    assert [LINE.fullmatch(line)["desc"] for line in lines] == ["layer latency", "casts"]
    assert [LINE.fullmatch(line)["count"] for line in lines] == ["4/4", "2"]


def test_a_phase_that_stops_early_says_how_far_it_got(stderr):
    for i in progress(True, range(10), "solve and verify"):
        if i == 2:
            break
    assert LINE.fullmatch(stderr.getvalue().strip())["count"] == "3/10"  # 0, 1, 2 were handed out


def test_disabled_progress_writes_nothing_and_returns_the_iterable(stderr):
    items = [1, 2]
    assert progress(False, items, "casts") is items
    assert _progress.progress_bar(False, 5, "fit") is None
    assert stderr.getvalue() == ""


def test_the_fit_bar_without_a_terminal_is_one_line_with_its_postfix(stderr):
    bar = _progress.progress_bar(True, 6, "fit", unit="step")
    assert isinstance(bar, _progress.PhaseLine)
    for _ in range(6):
        bar.update(1)
    bar.set_postfix(epoch=2, loss="0.1250")
    bar.close()
    bar.close()  # closing twice writes once
    (line,) = stderr.getvalue().splitlines()
    match = LINE.fullmatch(line)
    assert (match["desc"], match["count"], match["extra"]) == ("fit", "6/6", " (epoch=2, loss=0.1250)")


def test_on_a_terminal_phases_are_tqdm_bars(monkeypatch):
    from tqdm.auto import tqdm

    stream = _Stream(tty=True)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", stream)
        assert _progress._on_terminal()
        bar = progress(True, range(3), "layer latency")
        assert isinstance(bar, tqdm) and list(bar) == [0, 1, 2]
        assert isinstance(_progress.progress_bar(True, 3, "fit"), tqdm)
    assert not LINE.search(stream.getvalue())
