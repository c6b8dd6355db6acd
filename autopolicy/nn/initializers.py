"""Weight initializers by Keras name, or any ``fn(key, shape, dtype)``."""

from __future__ import annotations

import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["get", "draw", "NAMES"]

Initializer = Callable[[jax.Array, tuple, Any], jax.Array]

# name -> (scale, fan mode, distribution) of Keras's VarianceScaling family.
_VARIANCE_SCALING = {
    "glorot_uniform": (1.0, "fan_avg", "uniform"),
    "glorot_normal": (1.0, "fan_avg", "truncated_normal"),
    "he_uniform": (2.0, "fan_in", "uniform"),
    "he_normal": (2.0, "fan_in", "truncated_normal"),
    "lecun_uniform": (1.0, "fan_in", "uniform"),
    "lecun_normal": (1.0, "fan_in", "truncated_normal"),
}


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def _ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def _random_normal(key, shape, dtype):
    return 0.05 * jax.random.normal(key, shape, dtype)


def _random_uniform(key, shape, dtype):
    return jax.random.uniform(key, shape, dtype, -0.05, 0.05)


_FIXED: dict[str, Initializer] = {
    "zeros": _zeros,
    "ones": _ones,
    "random_normal": _random_normal,
    "random_uniform": _random_uniform,
    "uniform": _random_uniform,
    "normal": _random_normal,
}
NAMES = tuple(_VARIANCE_SCALING) + tuple(_FIXED)


def get(
    identifier: Any, in_axis: int | Sequence[int] = -2, out_axis: int | Sequence[int] = -1
) -> Initializer:
    """Returns the initializer named ``identifier``, or ``identifier`` if it is callable.

    Args:
      identifier: A name from :data:`NAMES` or ``fn(key, shape, dtype)``.
      in_axis, out_axis: The kernel axes that count as fan-in and fan-out for the
        variance-scaling family (tuples for einsum kernels); other axes are the receptive field.

    >>> get("zeros")(None, (2,), jnp.float32)
    Array([0., 0.], dtype=float32)
    """
    if callable(identifier):
        return identifier
    if isinstance(identifier, str) and identifier in _VARIANCE_SCALING:
        scale, mode, distribution = _VARIANCE_SCALING[identifier]
        return jax.nn.initializers.variance_scaling(
            scale, mode, distribution, in_axis=in_axis, out_axis=out_axis
        )
    if isinstance(identifier, str) and identifier in _FIXED:
        return _FIXED[identifier]
    raise ValueError(
        f"Unknown initializer. Expected one of {NAMES} or a function fn(key, shape, dtype). "
        f"Received: {identifier!r}"
    )


def check(identifier: Any, argument: str) -> Any:
    """Validates an initializer argument at construction (returns it unchanged)."""
    try:
        get(identifier)
    except ValueError as e:
        raise ValueError(f"Invalid {argument}: {e}") from None
    return identifier


# --- drawing weights at build time, in NumPy -----------------------------------------------------
# Building draws every weight of a model outside of XLA: compiling a random-number generator per
# weight costs seconds on a CPU, drawing in NumPy costs microseconds. The stream of each weight is
# seeded by the build key and the weight's path, so it does not depend on the order of layers.


def _axes(axis: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axes)


def _fans(shape: tuple[int, ...], in_axis: Any, out_axis: Any) -> tuple[float, float]:
    if len(shape) < 2:
        size = float(np.prod(shape)) if shape else 1.0
        return size, size
    ins, outs = _axes(in_axis, len(shape)), _axes(out_axis, len(shape))
    receptive = float(np.prod([d for i, d in enumerate(shape) if i not in ins + outs]))
    return float(np.prod([shape[i] for i in ins])) * receptive, float(np.prod([shape[i] for i in outs])) * receptive


def _truncated_normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2.0
    return out


def _numpy_draw(name: str, rng: np.random.Generator, shape: tuple[int, ...], in_axis, out_axis) -> np.ndarray:
    if name in ("zeros", "ones"):
        return np.full(shape, 0.0 if name == "zeros" else 1.0)
    if name in ("random_normal", "normal"):
        return 0.05 * rng.standard_normal(shape)
    if name in ("random_uniform", "uniform"):
        return rng.uniform(-0.05, 0.05, shape)
    scale, mode, distribution = _VARIANCE_SCALING[name]
    fan_in, fan_out = _fans(shape, in_axis, out_axis)
    n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    variance = scale / max(n, 1.0)
    if distribution == "uniform":
        limit = np.sqrt(3.0 * variance)
        return rng.uniform(-limit, limit, shape)
    # A normal truncated at two standard deviations has a smaller spread; this constant (the
    # standard deviation of the standard normal truncated to [-2, 2]) corrects it.
    return np.sqrt(variance) / 0.87962566103423978 * _truncated_normal(rng, shape)


def draw(
    key: jax.Array,
    path: str,
    shape: tuple[int, ...],
    dtype: Any,
    initializer: Any,
    fan_axes: tuple[Any, Any] = (-2, -1),
) -> jax.Array:
    """The initial value of the weight at ``path`` for the build key ``key``."""
    if callable(initializer):
        from autopolicy.nn import _context  # pylint: disable=import-outside-toplevel

        return jnp.asarray(initializer(_context.path_key(key, path), shape, dtype), dtype)
    get(initializer)  # validates the name
    words = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel().tolist()
    rng = np.random.default_rng(words + [zlib.crc32(path.encode("utf-8"))])
    values = _numpy_draw(initializer, rng, tuple(shape), *fan_axes).astype(np.float32)
    # Cast on the host (ml_dtypes rounds as XLA's convert does, to nearest even) and copy over:
    # jnp.asarray(numpy).astype(...) compiles two programs per new weight shape.
    return jax.device_put(values.astype(jnp.dtype(dtype)))
