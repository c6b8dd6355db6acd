"""Small real datasets that ship with installed packages (no downloads)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Split", "digits", "python_source_bytes"]


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


def python_source_bytes(num_bytes: int = 2_000_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the Python standard library's own sources: ``(train, held_out)`` uint8 arrays.

    Files are split (not bytes): 90% of the standard library's top-level ``.py`` files, in a
    seeded order, feed the training stream; the rest are held out. Nothing is downloaded.

    Args:
      num_bytes: Total bytes to read (split 90/10 by files).
      seed: Seeds the order of the files.
    """
    import os  # pylint: disable=import-outside-toplevel

    root = os.path.dirname(os.__file__)
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"No Python sources found in {root!r}")
    np.random.default_rng(seed).shuffle(files)
    cut = max(1, int(0.9 * len(files)))
    streams = []
    for group, budget in ((files[:cut], int(0.9 * num_bytes)), (files[cut:], num_bytes - int(0.9 * num_bytes))):
        chunks, total = [], 0
        for name in group:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= budget:
                break
        streams.append(np.frombuffer(b"".join(chunks)[:budget], dtype=np.uint8).copy())
    return streams[0], streams[1]
