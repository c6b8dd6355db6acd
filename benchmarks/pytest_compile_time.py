"""Where the test suite's time goes: a pytest plugin that sums JAX's compilation events per test.

JAX reports each tracing, lowering and XLA compilation through ``jax.monitoring``; this plugin
adds them up per test (setup, call and teardown) on every pytest-xdist worker, and the controller
prints the totals and the tests and files that compile most. A sampling profiler misses most of
this: XLA compiles with the GIL released, on its own threads.

Run (the README's test command with the plugin; a fresh cache shows a first run's cost)::

    PYTHONPATH=benchmarks AUTOPOLICY_TEST_JAX_CACHE=$(mktemp -d) \\
        .venv/bin/python -m pytest -p pytest_compile_time -n auto --dist loadscope -m "not slow" -q

``--compile-time-top N`` sets how many tests and files are listed (default 25).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import tempfile
import time

import jax.monitoring
import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_ENV = "AUTOPOLICY_COMPILE_TIME_DIR"

_current = ["(outside tests)"]
_seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_wall: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **_: object) -> None:
    kind = EVENTS.get(event)
    if kind is not None:
        _seconds[_current[0]][kind] += duration
        if kind == "compile":
            _seconds[_current[0]]["compilations"] += 1


def pytest_addoption(parser):
    parser.addoption("--compile-time-top", type=int, default=25, help="tests and files listed (default 25)")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) owns the folder
        os.environ.setdefault(_ENV, tempfile.mkdtemp(prefix="compile-time-"))
    jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0], start = item.nodeid, time.perf_counter()
    yield
    _wall[item.nodeid] += time.perf_counter() - start
    _current[0] = "(between tests)"


def pytest_sessionfinish(session):
    folder = pathlib.Path(os.environ[_ENV])
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    (folder / f"{worker}.json").write_text(json.dumps({"wall": _wall, "seconds": _seconds}))


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    wall, seconds = collections.Counter(), collections.defaultdict(collections.Counter)
    for path in pathlib.Path(os.environ[_ENV]).glob("*.json"):
        data = json.loads(path.read_text())
        wall.update(data["wall"])
        for test, counts in data["seconds"].items():
            seconds[test].update(counts)
    totals = collections.Counter()
    for counts in seconds.values():
        totals.update(counts)
    write = terminalreporter.write_line
    top = config.getoption("--compile-time-top")
    terminalreporter.section("JAX compilation time (summed over workers)")
    write(f"tests: {sum(wall.values()):.1f} s; tracing {totals['trace']:.1f} s, lowering {totals['lower']:.1f} s, "
          f"XLA compilation {totals['compile']:.1f} s in {int(totals['compilations'])} compilations")
    by_file, by_test = collections.Counter(), collections.Counter()
    compiled_file, compiled_test = collections.Counter(), collections.Counter()
    for test, seconds_ in wall.items():
        name = test.split("[")[0]  # a parametrized test's cases together
        by_test[name] += seconds_
        by_file[test.split("::")[0]] += seconds_
        spent = seconds[test]["trace"] + seconds[test]["lower"] + seconds[test]["compile"]
        compiled_test[name] += spent
        compiled_file[test.split("::")[0]] += spent
    for title, table, compiled in (("files", by_file, compiled_file), ("tests", by_test, compiled_test)):
        write(f"slowest {title} (wall s, of which tracing + lowering + compiling):")
        for name, seconds_ in table.most_common(top):
            write(f"  {seconds_:7.1f} {compiled[name]:7.1f}  {name}")
