"""Small numerics helpers shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np


def relative_error(y, reference):
    """Norm of the difference over the norm of the reference, in float32."""
    y = jnp.asarray(y, jnp.float32)
    return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))


def gaussian(shape, seed=1):
    # NumPy, not jax.random: no compilation per shape, which keeps the suite fast.
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@jax.jit
def forward(model, x):
    return model(x)


def assert_bit_identical(a, b):
    """Same structure and, leaf by leaf, the same dtype, shape and bytes (-0.0 != 0.0, NaN == NaN)."""
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y, equal_nan=True) and x.tobytes() == y.tobytes()
