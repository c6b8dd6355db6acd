"""One process of a two-process tuning run (``tests/test_multihost.py`` starts two of them).

Usage: ``python tests/multihost_worker.py PROCESS_ID COORDINATOR_PORT OUT_DIR``, with
``JAX_NUM_CPU_DEVICES=2``: the two processes' four CPU devices form one global mesh, the data
axis across the processes and the model axis within each. Every process tunes the same sharded
MLP, then saves the result to ``OUT_DIR/run`` (only process 0 writes it) with its cache in
``OUT_DIR/cache``, and writes what it saw to ``OUT_DIR/process_<id>.json``: the chosen map, its
profile's timings, and each timing gather's local and gathered values.

``AUTOPOLICY_TEST_SLOW_PROCESS=<id>`` and ``AUTOPOLICY_TEST_SLEEP_S=<seconds>`` make that
process's timer sleep inside every timed call, as a slower host would be.
"""

import json
import os
import sys
import time

import jax

PROCESS_ID, PORT, OUT_DIR = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=2, process_id=PROCESS_ID,
                           initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from autopolicy import _multihost, nn, policies, search  # noqa: E402
from autopolicy.search import timing  # noqa: E402

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


def main():
    _record_gathers()
    if os.environ.get("AUTOPOLICY_TEST_SLOW_PROCESS") == str(PROCESS_ID):
        _slow_down(float(os.environ.get("AUTOPOLICY_TEST_SLEEP_S", "0.01")))
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        model, x = _model(mesh)
        reference = model(x)

        def fidelity(m):
            return 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))

        result = search.tune(model, fidelity, x, candidates=("float32", "mixed_bfloat16", "int8_from_float32"),
                             max_drop=0.05, repeats=3, progress=False, profile_accuracy="always",
                             cache_dir=os.path.join(OUT_DIR, "cache"), confirm_seconds=1.0)
        result.save(os.path.join(OUT_DIR, "run"))
    frame = result.profile
    report = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "devices": jax.device_count(), "mesh_processes": [[d.process_index for d in row] for row in mesh.devices],
        "map": policies.serialize(result.policy_map),
        "profile": frame[["layer", "policy", "latency_s", "latency_p25_s", "latency_p75_s"]].to_dict("records"),
        "gathers": gathers,
    }
    with open(os.path.join(OUT_DIR, f"process_{PROCESS_ID}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
