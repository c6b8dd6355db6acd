"""The distributed tier: Ray actors and a Dask cluster score one-layer candidates for ``tune``,
with results identical to the single-process run; a Ray actor killed mid-task loses nothing.

Needs the distributed extra (``pip install -e ".[distributed]"``); skipped without it. No
cluster: a local Ray (``num_cpus=2``) and a Dask ``LocalCluster``."""

import concurrent.futures
import os

import pytest

import helpers

ray = pytest.importorskip("ray", reason="the distributed extra is not installed: pip install -e '.[distributed]'")
dask_distributed = pytest.importorskip("dask.distributed",
                                       reason="the distributed extra is not installed: pip install -e '.[distributed]'")

from autopolicy import distributed, search  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning:ray"),
              # Ray starts its local cluster's processes with fork+exec: JAX warns of os.fork.
              pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

CANDIDATES = ("float32", "mixed_bfloat16", "int8_from_float32")


@pytest.fixture(scope="module")
def tiny():
    return helpers.tiny_two_layer()


def _tune(tiny, eval_fn=None, **kwargs):
    model, fidelity, x = tiny
    return search.tune(model, eval_fn or fidelity, x, candidates=CANDIDATES, max_drop=0.05,
                       profile_accuracy="always", repeats=3, progress=False, **kwargs)


@pytest.fixture(scope="module")
def local_result(tiny):
    return _tune(tiny)


@pytest.fixture(scope="module")
def ray_executor():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    executor = distributed.RayExecutor(num_workers=2)
    yield executor
    executor.shutdown()
    ray.shutdown()


def test_ray_actors_score_as_the_target_does(tiny, local_result, ray_executor):
    assert ray_executor.num_workers == 2 and len(set(ray_executor.worker_pids())) == 2
    result = _tune(tiny, executor=ray_executor)
    assert result.accuracy.entries == local_result.accuracy.entries
    assert result.accuracy.remote == 4
    assert all(not e.proxy for table in result.accuracy.entries.values() for e in table.values())


def test_a_ray_actor_killed_mid_task_loses_nothing(tiny, local_result, ray_executor, tmp_path):
    marker, target = str(tmp_path / "died"), os.getpid()
    _, fidelity, _ = tiny

    def dies_once(m):
        if os.getpid() != target:
            try:  # O_EXCL: of two actors scoring at once, exactly one creates the marker and dies
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(1)  # the actor's process dies in the middle of scoring
        return fidelity(m)

    before = ray_executor.worker_pids()
    result = _tune(tiny, eval_fn=dies_once, executor=ray_executor)
    assert os.path.exists(marker)
    assert result.accuracy.entries == local_result.accuracy.entries
    assert result.accuracy.remote == 4  # the dead actor's task was retried on an actor
    after = ray_executor.worker_pids()
    assert len(after) == 2 and len(set(after) - set(before)) == 1  # the dead actor was replaced


def test_a_ray_executor_refuses_a_bad_worker_count():
    with pytest.raises(ValueError, match=r"num_workers must be a positive integer or None. Received: num_workers=0"):
        distributed.RayExecutor(num_workers=0)


def test_dask_client_executor_works_as_it_is(tiny, local_result):
    with dask_distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None) as cluster, \
            dask_distributed.Client(cluster) as client:
        executor = client.get_executor()
        assert isinstance(executor, concurrent.futures.Executor)
        result = _tune(tiny, executor=executor)
    assert result.accuracy.entries == local_result.accuracy.entries
    assert result.accuracy.remote == 4
