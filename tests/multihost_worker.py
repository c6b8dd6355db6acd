"""One process of a two-process tuning run (``tests/test_multihost.py`` starts two of them).

Usage: ``python tests/multihost_worker.py PROCESS_ID COORDINATOR_PORT OUT_DIR``, with
``JAX_NUM_CPU_DEVICES=2``: the two processes' four CPU devices form one global mesh, the data
axis across the processes and the model axis within each. Every process tunes the same sharded
MLP twice (the second run, with ``profile_accuracy="auto"``, resumes from the first's cache),
saving the result to ``OUT_DIR/p<id>/run`` with the cache in ``OUT_DIR/p<id>/cache`` (only
process 0 may write them), and writes what it saw to ``OUT_DIR/process_<id>.json``: the chosen
map, the profile's timings, each timing gather's local and gathered values, and the cache's
statistics.

``AUTOPOLICY_TEST_SLOW_PROCESS=<id>`` and ``AUTOPOLICY_TEST_SLEEP_S=<seconds>`` make that
process's timer sleep inside every timed call, as a slower host would be.
``AUTOPOLICY_TEST_DISAGREE=1`` makes ``eval_fn`` return another value on each process: the run
must stop; the error goes to ``process_<id>.json``.
Exit status 77: ``jax.distributed`` could not start.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from autopolicy import _multihost, nn, policies, search
from autopolicy.search import timing

NOT_STARTED = 77
CANDIDATES = ("float32", "mixed_bfloat16", "int8_from_float32", "int4_from_float32", "float8_from_float32")

#: Column-parallel then row-parallel: the second layer sums across the model axis.
SPECS = {".layers[0].kernel": P(None, "model"), ".layers[0].bias": P("model"),
         ".layers[1].kernel": P("model", None), ".layers[1].bias": P()}

gathers = []


def _record_gathers():
    """Keeps each timing gather's local values and its result (the slowest process's)."""
    slowest = _multihost.slowest

    def recording(values):
        out = slowest(values)
        gathers.append({"local": np.asarray(values).tolist(), "gathered": np.asarray(out).tolist()})
        return out

    _multihost.slowest = recording


def _slow_down(seconds):
    """This process's timed calls each take ``seconds`` longer (inside the timed region)."""
    def slow(run):
        start = time.perf_counter()
        time.sleep(seconds)
        run()
        return time.perf_counter() - start

    timing._time_once = slow  # pylint: disable=protected-access


def _model(mesh):
    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    model = nn.Sequential([nn.Dense(128, activation="relu"), nn.Dense(32)], name="mlp")
    model = model.build(jax.random.key(0), jnp.asarray(x))
    # Every process holds the same values: each places them on its own devices of the mesh.
    placed = jax.tree_util.tree_map_with_path(
        lambda p, leaf: jax.device_put(np.asarray(leaf), NamedSharding(mesh, SPECS[jax.tree_util.keystr(p)])), model)
    return placed, jax.device_put(x, NamedSharding(mesh, P("data", None)))


def _start(process_id, port):
    """Joins the two-process run, or exits with NOT_STARTED."""
    try:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                                   initialization_timeout=60)
    except Exception as e:  # pylint: disable=broad-except
        print(f"jax.distributed could not start: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(NOT_STARTED)


def _tune(model, x, profile_accuracy, out_dir):
    reference = model(x)
    disagree = os.environ.get("AUTOPOLICY_TEST_DISAGREE") == "1"

    def fidelity(m):
        value = 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))
        return value + jax.process_index() if disagree else value

    mine = os.path.join(out_dir, f"p{jax.process_index()}")
    result = search.tune(model, fidelity, x, candidates=CANDIDATES,
                         max_drop=0.05, repeats=3, progress=False, profile_accuracy=profile_accuracy,
                         cache_dir=os.path.join(mine, "cache"), confirm_seconds=1.0)
    result.save(os.path.join(mine, "run"))
    return result


def main(process_id, port, out_dir):
    _start(process_id, port)
    _record_gathers()
    if os.environ.get("AUTOPOLICY_TEST_SLOW_PROCESS") == str(process_id):
        _slow_down(float(os.environ.get("AUTOPOLICY_TEST_SLEEP_S", "0.01")))
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    report = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "devices": jax.device_count(), "mesh_processes": [[d.process_index for d in row] for row in mesh.devices]}
    try:
        with jax.set_mesh(mesh):
            model, x = _model(mesh)
            first = _tune(model, x, "always", out_dir)
            timed = len(gathers)
            again = _tune(model, x, "auto", out_dir)  # other paths to the map, the same timings
    except ValueError as e:
        report["error"] = str(e)
    else:
        report.update({
            "map": policies.serialize(first.policy_map), "map_again": policies.serialize(again.policy_map),
            "profile": first.profile[["layer", "policy", "latency_s", "latency_p25_s", "latency_p75_s"]].to_dict(
                "records"),
            "gathers": gathers[:timed], "cache_again": again.cache_stats})
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
