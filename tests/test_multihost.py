"""The multi-host tier: two JAX processes (``jax.distributed`` on the loopback address, two CPU
devices each) tune one model sharded over a global 2x2 mesh (``tests/multihost_worker.py``).

Also, without a second process: the gathering helpers of :mod:`autopolicy._multihost`, with the
gather replaced by one that returns several processes' values.
"""

import csv
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from autopolicy import _multihost

#: The two-process runs belong to the multi-host tier (the README's tier command sets it): each
#: starts two JAX processes, over a minute on 2 cores, beside the default suite's own workers.
two_processes = pytest.mark.skipif(not os.environ.get("AUTOPOLICY_TEST_MULTI_HOST"),
                                   reason="two jax.distributed processes: the multi-host tier "
                                          "(AUTOPOLICY_TEST_MULTI_HOST=1 .venv/bin/python -m pytest tests/test_multihost.py)")
from autopolicy.search import result as result_mod
from autopolicy.search.cache import MeasurementCache

WORKER = pathlib.Path(__file__).resolve().parent / "multihost_worker.py"
SLEEP_S = 0.01
NOT_STARTED = 77  # multihost_worker.NOT_STARTED: jax.distributed could not start


def _free_port():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:
        pytest.skip(f"no free port on 127.0.0.1 for jax.distributed's coordinator: {e}")


def _run_two(out, **env):
    """Starts the two processes, waits for both; returns their reports (process 0 first)."""
    port = _free_port()
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", **env}
    environ.pop("XLA_FLAGS", None)  # no forced device count: two devices per process
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(out)], env=environ,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        logs = [p.communicate(timeout=270)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    if NOT_STARTED in codes:
        log = logs[codes.index(NOT_STARTED)]
        pytest.skip(f"jax.distributed could not start two processes on 127.0.0.1: {log[-500:]}")
    for i, (code, log) in enumerate(zip(codes, logs)):
        assert code == 0, f"process {i} exited with {code}:\n{log[-4000:]}"
    return [json.loads((out / f"process_{i}.json").read_text()) for i in (0, 1)]


@pytest.mark.slow
@two_processes
def test_two_processes_tune_one_sharded_model_alike(tmp_path):
    first, second = _run_two(tmp_path, AUTOPOLICY_TEST_SLOW_PROCESS="1", AUTOPOLICY_TEST_SLEEP_S=str(SLEEP_S))
    assert first["process_count"] == 2 and first["devices"] == 4
    assert first["mesh_processes"] == [[0, 0], [1, 1]]  # the data axis spans the processes
    # The same decisions, from the same (gathered) timings.
    assert first["map"] == second["map"] and first["map_again"] == second["map_again"]
    assert first["profile"] == second["profile"]
    # Each gathered timing is, element by element, the slower process's.
    assert len(first["gathers"]) == len(second["gathers"]) > 0
    for mine, theirs in zip(first["gathers"], second["gathers"]):
        assert mine["gathered"] == theirs["gathered"]
        np.testing.assert_allclose(mine["gathered"], np.maximum(mine["local"], theirs["local"]))
    # Process 1 slept SLEEP_S in every timed call (one call each: its estimate counts): every
    # recorded quartile is at least that, though process 0's own calls were faster.
    for row in first["profile"]:
        assert row["latency_p25_s"] >= SLEEP_S, row
    assert min(np.min(g["local"]) for g in first["gathers"]) < SLEEP_S  # process 0's own
    # And so are the files process 0 wrote: the run's profile and the cached layer timings.
    with open(tmp_path / "p0" / "run" / "profile.csv", encoding="utf-8") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(first["profile"]) and all(float(r["latency_p25_s"]) >= SLEEP_S for r in written)
    cached = json.loads((tmp_path / "p0" / "cache" / "measurements.json").read_text())
    layer_timings = [v for v in cached.values() if isinstance(v, dict) and "latency_p25_s" in v]
    assert layer_timings and all(v["latency_p25_s"] >= SLEEP_S for v in layer_timings)
    # Only process 0 wrote: its run directory and cache; process 1 created neither.
    assert sorted(os.listdir(tmp_path / "p0" / "run")) == ["frontier.csv", "policy_map.json",
                                                            "policy_map.kernels.json", "profile.csv", "summary.json",
                                                            "tuned"]
    assert json.loads((tmp_path / "p0" / "run" / "tuned" / "tuned.json").read_text())["framework"] == "autopolicy.nn"
    assert (tmp_path / "p0" / "cache" / "measurements.json").is_file()
    assert not (tmp_path / "p1").exists()
    # The second run found process 0's measurements on both processes alike.
    assert first["cache_again"] == second["cache_again"] and first["cache_again"]["hits"] > 0


@pytest.mark.slow
@two_processes
def test_an_eval_fn_that_differs_between_processes_stops_the_run(tmp_path):
    reports = _run_two(tmp_path, AUTOPOLICY_TEST_DISAGREE="1")
    for report in reports:
        assert "eval_fn's value for the float32 model differs between processes" in report["error"]
    assert not (tmp_path / "p0" / "run").exists()


def _as_processes(monkeypatch, *per_process):
    """Makes _multihost believe it runs in len(per_process) processes that hold these values."""
    monkeypatch.setattr(_multihost, "count", lambda: len(per_process))
    monkeypatch.setattr(_multihost, "_gather", lambda values: np.stack([np.asarray(p, values.dtype).reshape(
        values.shape) for p in per_process]))


def test_slowest_takes_each_elements_largest(monkeypatch):
    _as_processes(monkeypatch, [1.0, 5.0, 2.0], [3.0, 4.0, 2.0])
    np.testing.assert_array_equal(_multihost.slowest([1.0, 5.0, 2.0]), [3.0, 5.0, 2.0])


def test_agreed_accepts_equal_values_and_names_different_ones(monkeypatch):
    _as_processes(monkeypatch, [0.5], [0.5])
    assert _multihost.agreed(0.5, "eval_fn's value") == 0.5
    _as_processes(monkeypatch, [float("nan")], [float("nan")])
    assert np.isnan(_multihost.agreed(float("nan"), "eval_fn's value"))
    _as_processes(monkeypatch, [0.5], [0.75])
    with pytest.raises(ValueError, match=r"eval_fn's value differs between processes: \[0.5, 0.75\]"):
        _multihost.agreed(0.5, "eval_fn's value")


def test_check_same_names_the_processes_that_differ(monkeypatch):
    _multihost.check_same({"a": 1}, "the map")  # one process: nothing to compare
    monkeypatch.setattr(_multihost, "count", lambda: 3)
    monkeypatch.setattr(_multihost, "_gather", lambda mine: np.stack([mine, mine + 1, mine]))
    with pytest.raises(RuntimeError, match=r"disagree on the map: processes \[1\] differ from process 0"):
        _multihost.check_same({"a": 1}, "the map")
    monkeypatch.setattr(_multihost, "_gather", lambda mine: np.stack([mine, mine]))
    _multihost.check_same({"a": 1}, "the map")


def test_one_process_writes_and_reads_as_before(tmp_path):
    assert _multihost.is_writer() and _multihost.count() == 1
    assert _multihost.from_leader({"x": [1, 2]}) == {"x": [1, 2]}
    np.testing.assert_array_equal(_multihost.host_array(np.arange(3)), [0, 1, 2])
    assert _multihost.gather_bytes(b"ab") == [b"ab"]


def test_a_process_other_than_0_starts_from_process_0s_cache_and_writes_nothing(tmp_path, monkeypatch):
    leader = {"error": None, "entries": {"k": {"latency_s": 1.0}}, "shared": {"s": 2.0}}
    monkeypatch.setattr(_multihost, "count", lambda: 2)
    monkeypatch.setattr(_multihost, "is_writer", lambda: False)
    monkeypatch.setattr(_multihost, "from_leader", lambda mine: leader)
    with MeasurementCache(tmp_path / "cache", tmp_path / "shared" / "measurements.json") as cache:
        assert cache.lookup("k") == {"latency_s": 1.0} and cache.lookup("s") == 2.0
        cache.put("new", 3.0, share=True)
        cache.flush()
    result_mod.write_summary(tmp_path / "run", {"a": 1})
    assert not any(tmp_path.iterdir())  # no directory, lock, cache, shared file or summary
    leader["error"] = "RunDirectoryLocked: held by process 123"
    with pytest.raises(RuntimeError, match="Process 0 could not open the measurement cache: RunDirectoryLocked"):
        MeasurementCache(tmp_path / "cache")


def test_process_0_shares_its_cache_entries(tmp_path, monkeypatch):
    with MeasurementCache(tmp_path) as cache:
        cache.put("k", [1.0, float("nan")])
    sent = []
    monkeypatch.setattr(_multihost, "count", lambda: 2)
    monkeypatch.setattr(_multihost, "from_leader", lambda mine: sent.append(mine) or mine)
    with MeasurementCache(tmp_path) as cache:
        assert cache.lookup("k")[0] == 1.0
    assert sent[0]["error"] is None and "k" in sent[0]["entries"]
