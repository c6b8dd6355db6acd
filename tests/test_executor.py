"""tune(..., executor=...): one-layer accuracy evaluations on a concurrent.futures.Executor,
identical to the single-process run, cached as they arrive, retried on a worker's failure."""

import concurrent.futures
from concurrent.futures.process import BrokenProcessPool
import multiprocessing
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import helpers

from autopolicy import cli, distributed, nn, search
from autopolicy.search import executor as executor_mod
from autopolicy.search.phases import Status

ROOT = pathlib.Path(__file__).resolve().parent.parent
CANDIDATES = ("float32", "mixed_bfloat16", "int8_from_float32")


@pytest.fixture(scope="module")
def tiny():
    return helpers.tiny_two_layer()


def _tune(tiny, **kwargs):
    model, fidelity, x = tiny
    return search.tune(model, fidelity, x, candidates=CANDIDATES, max_drop=0.05, profile_accuracy="always",
                       repeats=3, progress=False, **kwargs)


@pytest.fixture(scope="module")
def local_result(tiny):
    return _tune(tiny)


class _Counting(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that counts submissions; those numbered in ``fail`` (from 1) come back as
    a worker's failure (an exception from the future, as a dead process's would)."""

    def __init__(self, fail=()):
        super().__init__(2)
        self.submitted, self.fail = 0, set(fail)

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        if self.submitted in self.fail:
            future = concurrent.futures.Future()
            future.set_exception(BrokenProcessPool("a worker died"))
            return future
        return super().submit(fn, *args, **kwargs)


@pytest.mark.slow
def test_scores_from_an_executor_equal_the_single_process_run(tiny, local_result, tmp_path):
    with _Counting() as pool:
        result = _tune(tiny, executor=pool, cache_dir=str(tmp_path / "cache"))
    assert pool.submitted == 4  # 2 layers x 2 candidates besides float32, every one scored there
    assert result.accuracy.entries == local_result.accuracy.entries
    assert result.accuracy.remote == 4 and result.evaluations["on_workers"] == 4
    assert result.evaluations["profile"] == local_result.evaluations["profile"] == 4
    # (The maps themselves follow the timings, measured afresh by each run.)
    # The workload file shared with the workers is removed when the phase ends.
    assert not list((tmp_path / "cache").glob("workload-*.pkl"))
    # Cached as they arrived: a rerun submits nothing.
    with _Counting() as pool:
        again = _tune(tiny, executor=pool, cache_dir=str(tmp_path / "cache"))
    assert pool.submitted == 0 and again.accuracy.entries == local_result.accuracy.entries


@pytest.mark.slow
def test_a_failed_worker_task_is_retried_then_scored_on_the_target(tiny, local_result):
    # The first two tasks fail; both are submitted again, and the first retry (the fifth
    # submission) fails too: that task is scored on the target.
    with _Counting(fail={1, 2, 5}) as pool:
        result = _tune(tiny, executor=pool)
    assert pool.submitted == 4 + 2
    assert result.accuracy.entries == local_result.accuracy.entries
    assert result.accuracy.remote == 3  # the fourth evaluation ran on the target
    assert result.evaluations["profile"] == 4


@pytest.mark.slow
def test_an_executor_that_refuses_work_leaves_it_to_the_target(tiny, local_result):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.shutdown()  # submit raises RuntimeError from now on
    result = _tune(tiny, executor=pool)
    assert result.accuracy.entries == local_result.accuracy.entries and result.accuracy.remote == 0


@pytest.mark.slow
def test_scores_from_other_numerics_are_marked_proxy(tiny, local_result, monkeypatch):
    original = executor_mod.score_remote

    def on_an_older_jaxlib(ref, path, policy_name):
        figures = original(ref, path, policy_name)
        return {**figures, "numerics": {**figures["numerics"], "jaxlib": "0.0.1"}}

    monkeypatch.setattr(executor_mod, "score_remote", on_an_older_jaxlib)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        result = _tune(tiny, executor=pool)
    entry = result.accuracy.entries["tiny/dense"]["int8_from_float32"]
    expected = local_result.accuracy.entries["tiny/dense"]["int8_from_float32"]
    assert entry.status == Status.MEASURED and entry.metric == expected.metric
    assert entry.proxy.startswith("jaxlib 0.0.1 (target ") and entry.proxy.endswith(")")
    frame = result.profile
    rows = frame[(frame.layer == "tiny/dense") & (frame.policy == "int8_from_float32")]
    assert rows.status.tolist() == ["measured (proxy)"]
    assert frame[frame.policy == "float32"].proxy.tolist() == ["", ""]


def test_a_candidate_that_fails_on_a_worker_comes_back_as_its_error(tiny, tmp_path):
    model, fidelity, x = tiny
    workload = executor_mod.Workload(model, fidelity, (x,), [(x,)], None, None)
    ref, remove = executor_mod.share(workload, str(tmp_path))
    try:
        assert pathlib.Path(ref.path).parent == tmp_path and ref.path.endswith(f"workload-{ref.digest}.pkl")
        figures = executor_mod.score_remote(ref, "tiny/dense", "int3_from_float32")
        assert figures["error"].startswith("ValueError: Invalid quantization mode in policy name")
        assert figures["numerics"] == executor_mod.numerics_fingerprint() and figures["evaluations"] == 0
        scored = executor_mod.score_remote(ref, "tiny/dense", "mixed_bfloat16")
        assert scored["finite"] is True and 0.99 < scored["metric"] < 1.0 and scored["evaluations"] == 1
    finally:
        remove()
    assert not pathlib.Path(ref.path).exists()


def test_numerics_differences_are_named():
    target = executor_mod.numerics_fingerprint()
    assert set(target) == set(executor_mod.NUMERICS_KEYS) and target["platform"] == jax.default_backend()
    assert executor_mod.describe_numerics(dict(target), target) == ""
    assert executor_mod.describe_numerics({**target, "xla_flags": "--xla_cpu_use_onednn=true"}, target) == (
        "xla_flags --xla_cpu_use_onednn=true (target " + target["xla_flags"] + ")")


def test_tune_refuses_an_executor_without_submit(tiny):
    model, fidelity, x = tiny
    with pytest.raises(TypeError, match=r"executor must be a concurrent.futures.Executor .*Received: executor=4"):
        search.tune(model, fidelity, x, executor=4)


@pytest.mark.parametrize("spec", ["threads", "processes", "processes:0", "ray:x", "ray:0"])
def test_make_executor_names_the_choices(spec):
    with pytest.raises(ValueError, match=r"--executor must be one of 'processes:N' .*'ray' or 'ray:N'"):
        distributed.make_executor(spec)


def test_the_command_line_refuses_a_bad_executor(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", "digits_mlp", "--executor", "threads:2"])
    assert exit_info.value.code == cli.EXIT_USAGE
    assert "argument --executor: 'threads:2' is not one of 'processes:N'" in capsys.readouterr().err


def _dies_once(marker):
    """An eval_fn wrapper whose first call in a worker process kills that process mid-task."""

    def wrap(fidelity, target_pid):
        def eval_fn(m):
            if os.getpid() != target_pid and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # the worker dies in the middle of scoring
            return fidelity(m)

        return eval_fn

    return wrap


@pytest.mark.slow
def test_a_worker_process_killed_mid_task_loses_nothing(tiny, local_result, tmp_path):
    model, fidelity, x = tiny
    eval_fn = _dies_once(str(tmp_path / "died"))(fidelity, os.getpid())
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        result = search.tune(model, eval_fn, x, candidates=CANDIDATES, max_drop=0.05, profile_accuracy="always",
                             repeats=3, progress=False, executor=pool)
    assert (tmp_path / "died").exists()  # a worker did die
    assert result.accuracy.entries == local_result.accuracy.entries  # every score, none lost
    assert result.accuracy.remote < 4  # the broken pool's tasks were scored on the target


@pytest.mark.slow
def test_the_command_line_scores_on_worker_processes(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_interrupts  # pylint: disable=import-outside-toplevel

    (tmp_path / "tiny.py").write_text(bench_interrupts.EXPERIMENT)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "autopolicy", "tune", str(tmp_path / "tiny.py"), "--out", str(out),
                           "--repeats", "3", "--no-report", "--no-shared-cache", "--profile-accuracy", "always",
                           "--executor", "processes:2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "autopolicy: sensitivity (workers): 4/4 in " in proc.stderr
    import json  # pylint: disable=import-outside-toplevel

    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluations"]["on_workers"] == 4 and summary["evaluations"]["profile"] == 4


@pytest.mark.slow
def test_a_workload_from_an_experiment_file_pickles_its_functions_by_value(tmp_path):
    # The model's class and eval_fn both come from one experiment file loaded from a path: the
    # module travels by value (once), and the bytes load in a process that cannot import it.
    (tmp_path / "exp_by_path.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "from autopolicy import nn\n"
        "class Scaled(nn.Sequential):\n"
        "    pass\n"
        "def fidelity(m):\n"
        "    return 1.0\n")
    from autopolicy import experiment  # pylint: disable=import-outside-toplevel

    module = experiment._import(tmp_path / "exp_by_path.py")  # pylint: disable=protected-access
    x = jax.numpy.ones((2, 3))
    model = module.Scaled([nn.Dense(2)], name="s").build(jax.random.key(0), x)
    blob = executor_mod.Workload(model, module.fidelity, (x,), [(x,)], None, None).dumps()
    code = ("import sys, cloudpickle; w = cloudpickle.loads(sys.stdin.buffer.read()); "
            "print(type(w.model).__name__, w.eval_fn(w.model))")
    proc = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == ["Scaled", "1.0"]
