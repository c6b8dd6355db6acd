"""digits_cnn_nnx: the digits_cnn network written in Flax NNX, tuned with the Flax adapter.

The twin of ``digits_cnn`` (scikit-learn's bundled 8x8 digits, the same split, batch, metric and
budget): two 3x3 ``nnx.Conv`` (32, 64 channels, ReLU), 2x2 max pooling, ``nnx.Linear`` 256 and 10.
Trained with optax Adam in a few seconds, then cached (``cache_dir/digits_cnn_nnx-v1/weights.npz``,
the parameters in the model's flattened state order). It needs the flax extra::

    .venv/bin/pip install -e ".[flax]"
    autopolicy tune digits_cnn_nnx --out runs/digits_cnn_nnx

Its tunable layers, in the order they run and under Qwix's paths: ``conv1``, ``conv2``,
``hidden``, ``logits`` (the convolutions take int8, float8 and float policies; the linears
int4 too).
"""

from __future__ import annotations

import functools
import importlib.util
import io
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopolicy import datasets
from autopolicy.experiment import Experiment

try:  # the module imports without the flax extra (``autopolicy list``); build() says what to install
    from flax import nnx
except ImportError:  # pragma: no cover - exercised where flax is absent
    nnx = None

DESCRIPTION = ("CNN conv32-conv64-pool-dense256-dense10 as a Flax NNX model on digits images, batch 256, "
               "tuned through the Flax adapter and Qwix; metric: validation accuracy (needs the flax extra)")
FLAX_INSTALL = 'pip install -e ".[flax]"'
BATCH = 256
CACHE_NAME = "digits_cnn_nnx-v1"
EPOCHS, TRAIN_BATCH = 8, 32


def require_flax() -> None:
    """Raises ModuleNotFoundError naming the pip command when Flax or Qwix is missing."""
    missing = [name for name in ("flax", "qwix") if importlib.util.find_spec(name) is None]
    if missing or nnx is None:
        missing = missing or ["flax"]
        raise ModuleNotFoundError(
            f"The digits_cnn_nnx experiment needs the flax extra ({' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed). Install it with: {FLAX_INSTALL}"
        )


_Module = nnx.Module if nnx is not None else object


class DigitsCNN(_Module):
    """Call on ``(batch, 8, 8, 1)`` float32 images; returns ``(batch, 10)`` logits."""

    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), padding="SAME", rngs=rngs)
        self.hidden = nnx.Linear(4 * 4 * 64, 256, rngs=rngs)
        self.logits = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        return self.logits(nnx.relu(self.hidden(x)))


@functools.lru_cache(maxsize=None)
def _jitted():
    @functools.partial(jax.jit, static_argnums=0)
    def apply(graphdef, state, x):
        return nnx.merge(graphdef, state)(x)
    return apply


def accuracy(model, x: np.ndarray, y: np.ndarray) -> float:
    """The fraction of ``x`` that ``model`` (float or tuned: one compilation per structure) labels as ``y``."""
    graphdef, state = nnx.split(model)
    logits = _jitted()(graphdef, state, jnp.asarray(x))
    return float(np.mean(np.asarray(jnp.argmax(logits, axis=-1)) == y))


def train(data: datasets.Split, epochs: int = EPOCHS, seed: int = 0) -> "DigitsCNN":
    """A DigitsCNN trained with Adam (1e-3) on cross-entropy, ``epochs`` shuffled passes of batch 32."""
    model = DigitsCNN(rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p, rest)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rng = np.random.default_rng(seed)
    n = len(data.x_train) // TRAIN_BATCH * TRAIN_BATCH  # whole batches only: one compilation
    for _ in range(epochs):
        order = rng.permutation(len(data.x_train))[:n].reshape(-1, TRAIN_BATCH)
        for idx in order:
            params, opt_state = step(params, opt_state, data.x_train[idx], data.y_train[idx])
    return nnx.merge(graphdef, params, rest)


def _save(model, path: pathlib.Path) -> None:
    from autopolicy import _atomic  # pylint: disable=import-outside-toplevel

    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    buffer = io.BytesIO()
    np.savez(buffer, *[np.asarray(leaf) for leaf in leaves])
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic.write_bytes(path, buffer.getvalue())


def _load(path: pathlib.Path) -> "DigitsCNN":
    """The cached model; ValueError if the file does not fit the model (damaged or stale)."""
    model = DigitsCNN(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    with np.load(path) as saved:
        arrays = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    if len(arrays) != len(leaves) or any(a.shape != leaf.shape for a, leaf in zip(arrays, leaves)):
        raise ValueError("its arrays do not fit the model's parameters")
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in arrays]))


def cached_model(cache_dir, data: datasets.Split) -> "DigitsCNN":
    """The model cached under ``cache_dir``, or a newly trained one (then cached); a damaged
    cache is trained again, with a warning naming it."""
    path = pathlib.Path(cache_dir) / CACHE_NAME / "weights.npz"
    if path.is_file():
        try:
            return _load(path)
        except Exception as e:  # pylint: disable=broad-except  # a truncated npz raises any of several errors
            warnings.warn(f"The cached model {str(path)!r} is damaged ({type(e).__name__}: {e}); training it again.",
                          UserWarning, stacklevel=2)
    model = train(data)
    _save(model, path)
    return model


def build(cache_dir) -> Experiment:
    require_flax()
    data = datasets.digits(seed=0, image=True)
    model = cached_model(cache_dir, data)
    return Experiment(
        name="digits_cnn_nnx",
        model=model,
        eval_fn=lambda m: accuracy(m, data.x_val, data.y_val),
        test_fn=lambda m: accuracy(m, data.x_test, data.y_test),
        sample_input=jnp.asarray(np.resize(data.x_train, (BATCH, 8, 8, 1))),
        calibration_inputs=[jnp.asarray(data.x_train[:256])],
        max_drop=0.01,
        metric_name="validation accuracy",
        description=DESCRIPTION,
    )
