"""How long ``Module.build`` takes for a model it has not seen the input shape of.

Builds a 4-layer MLP (Dense 64 relu, LayerNormalization, Dense 64 relu, Dense 10) for twenty
input widths, each new (so nothing is reused from JAX's in-memory caches), and prints the
median and spread. Run it at two commits to compare: ``python benchmarks/bench_build.py``.
"""

from __future__ import annotations

import time

import jax
import numpy as np

import autopolicy.nn as nn
from autopolicy.search import hardware


def _mlp() -> nn.Sequential:
    return nn.Sequential([nn.Dense(64, activation="relu"), nn.LayerNormalization(),
                          nn.Dense(64, activation="relu"), nn.Dense(10)])


def main() -> None:
    _mlp().build(jax.random.key(0), np.ones((2, 5), np.float32))  # imports and first-use costs
    seconds = []
    for width in range(6, 26):
        x = np.ones((2, width), np.float32)
        start = time.perf_counter()
        built = _mlp().build(jax.random.key(0), x)
        jax.block_until_ready(jax.tree_util.tree_leaves(built))
        seconds.append(time.perf_counter() - start)
    low, mid, high = np.percentile(np.asarray(seconds) * 1e3, [10, 50, 90])
    print(f"{hardware.describe()}")
    print(f"build of a 4-layer MLP for a new input width: median {mid:.1f} ms (p10 {low:.1f}, p90 {high:.1f}; "
          f"{len(seconds)} builds)")


if __name__ == "__main__":
    main()
