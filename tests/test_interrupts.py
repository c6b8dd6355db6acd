"""Ctrl-C at any moment of a tune ends it with exit status 130 and the resume line, never a
crash at interpreter exit; the interrupted run then resumes to completion."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from autopolicy import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_interrupts  # noqa: E402  pylint: disable=wrong-import-position

#: Seconds after the first measurement flush (cache/measurements.json appears) at which SIGINT
#: is sent: during layer timing, casts, calibration, verification and end-to-end rounds.
DELAYS = (0.0, 0.1, 0.25, 0.5, 0.9, 1.5)


@pytest.mark.slow
def test_interrupts_at_many_moments_end_with_130_and_the_resume_line(tmp_path):
    outcomes = []
    for delay in DELAYS:
        outcome, status, tail = bench_interrupts.interrupt_once(tmp_path, delay)
        outcomes.append(outcome)
        # Never a crash: a clean interrupt (130, the resume line, no traceback), or a run that
        # finished before the signal reached it (0).
        assert outcome in ("clean", "finished"), (delay, status, tail)
        if outcome == "clean":
            assert status == cli.EXIT_INTERRUPTED and bench_interrupts.RESUME in tail
    assert outcomes[0] == "clean"  # at the first flush the run is far from done
    assert outcomes.count("clean") >= len(DELAYS) // 2


@pytest.mark.slow
def test_an_interrupted_tune_resumes_to_completion(tmp_path):
    outcome, status, _ = bench_interrupts.interrupt_once(tmp_path, 0.0)
    assert (outcome, status) == ("clean", 130)
    (out,) = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    proc = subprocess.run([sys.executable, "-m", "autopolicy", "tune", str(tmp_path / "tiny.py"), "--out", str(out),
                           "--repeats", "3", "--no-progress", "--no-report", "--no-shared-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "reused from the cache" in proc.stdout
    assert (out / "summary.json").exists() and (out / "policy_map.json").exists()


def test_a_second_interrupt_while_winding_down_is_ignored(monkeypatch, capsys):
    # The first Ctrl-C ends the command; a second one, while it waits for JAX work in flight
    # and prints the resume line, changes nothing (no traceback, same status).
    def interrupted(args):
        raise KeyboardInterrupt

    def settle_interrupted_again():
        os.kill(os.getpid(), signal.SIGINT)  # ignored while winding down
        time.sleep(0.05)
        settle_calls.append(True)

    settle_calls = []
    # Start from Python's own handler whatever an earlier test on this worker left installed:
    # the assertion below is about what cli.main restores.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setitem(cli._COMMANDS, "list", interrupted)
    monkeypatch.setattr(cli, "_settle", settle_interrupted_again)
    assert cli.main(["list"]) == cli.EXIT_INTERRUPTED
    assert settle_calls == [True]
    assert capsys.readouterr().err == "autopolicy list: interrupted; run the same command again to resume\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


class _RaisesInFinalizer:
    """An object whose finalizer is interrupted: where a Ctrl-C lands inside a ``__del__``,
    Python can only print it ("Exception ignored in ...") and carry on."""

    def __del__(self):
        raise KeyboardInterrupt


def test_an_interrupt_lost_in_a_finalizer_still_ends_the_command(monkeypatch, capsys):
    def command(args):
        _RaisesInFinalizer()  # dropped at once: the interrupt goes to the unraisable hook
        return cli.EXIT_OK

    monkeypatch.setitem(cli._COMMANDS, "list", command)
    hook = sys.unraisablehook
    assert cli.main(["list"]) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err == "autopolicy list: interrupted; run the same command again to resume\n"
    assert sys.unraisablehook is hook  # restored


def test_an_interrupt_lost_in_a_finalizer_stops_the_tuner_at_its_next_measurement(tmp_path):
    from autopolicy import _interrupts
    from autopolicy.search.cache import MeasurementCache

    with MeasurementCache(str(tmp_path)) as cache, _interrupts.catching():
        cache.put("before", 1.0)
        _RaisesInFinalizer()
        with pytest.raises(KeyboardInterrupt):
            cache.put("after", 2.0)
        assert "after" not in cache.entries and cache.entries["before"] == 1.0
        cache.put("resumed", 3.0)  # raised once, not again
    assert not _interrupts.pending()
