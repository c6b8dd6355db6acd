"""Small real datasets that ship with installed packages (no downloads)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Split", "digits"]


class Split(NamedTuple):
    """Train, validation and test arrays."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def digits(seed: int = 0, image: bool = False) -> Split:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), 60/20/20.

    Args:
      seed: Seeds the shuffle before splitting.
      image: Return ``(N, 8, 8, 1)`` images instead of ``(N, 64)`` vectors.

    Pixels are scaled to [0, 1] float32; labels are int32.
    """
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    if image:
        x = x.reshape((-1, 8, 8, 1))
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return Split(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:])
