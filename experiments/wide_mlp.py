"""wide_mlp: a 64-1024-1024-1024-10 MLP on scikit-learn's bundled 8x8 digits, timed at batch
1024 (the "wider model" of the search's figures).

Scored by validation accuracy. Trained once, then cached.
"""

from _digits import mlp_experiment

DESCRIPTION = "wide MLP 64-1024x3-10 on scikit-learn digits, batch 1024; metric: validation accuracy"


def build(cache_dir):
    return mlp_experiment("wide_mlp", (1024, 1024, 1024), 1024, cache_dir, DESCRIPTION)
