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
