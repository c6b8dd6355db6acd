"""digits_mlp: a 64-512-512-10 MLP on scikit-learn's bundled 8x8 digits (the default experiment).

Scored by validation accuracy; timed at batch 512. Trained once (about 10 s), then cached.
"""

from _digits import mlp_experiment

DESCRIPTION = "MLP 64-512-512-10 on scikit-learn digits, batch 512; metric: validation accuracy"


def build(cache_dir):
    return mlp_experiment("digits_mlp", (512, 512), 512, cache_dir, DESCRIPTION)
