"""Loss scaling inside real training runs: skipped steps, float16 underflow, float8, auto-wrapping."""

import ast
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopolicy as ap
import autopolicy.nn as nn
from autopolicy import train
from autopolicy.mixed_precision import Policy
from autopolicy.nn._partition import combine, partition
from autopolicy.numerics import float8
from autopolicy.train.loop import LOSS_SCALE_CHOICES, _make_step
from helpers import assert_bit_identical, digits

# Each test trains or tunes (a module fixture alone takes ~20 s on two cores): run with the full
# suite, left out of the quick loop `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

XENT = train.losses.sparse_categorical_crossentropy


def _xy():
    # 1056 = 33 batches of 32: one batch shape, so each run compiles its step once.
    return digits().x_train[:1056], digits().y_train[:1056]


def digits_mlp(dtype=None):
    if isinstance(dtype, str):
        return _cached_digits_mlp(dtype)
    return nn.Sequential(
        [nn.Dense(64, activation="relu"), nn.Dense(64, activation="relu"), nn.Dense(10)],
        name="mlp",
        dtype=dtype,
    ).build(jax.random.key(0), _xy()[0][:1])


@functools.lru_cache(maxsize=None)
def _cached_digits_mlp(dtype):  # models are immutable: building each policy once is enough
    return digits_mlp(ap.get(dtype))


def tiny_model(dtype=None):
    return nn.Sequential([nn.Dense(8, activation="relu"), nn.Dense(3)], name="tiny", dtype=dtype).build(
        jax.random.key(1), np.ones((1, 4), np.float32)
    )


TINY_DATA = (
    np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32) / 4,
    np.random.default_rng(1).integers(0, 3, size=64).astype(np.int32),
)


def accuracy(model):
    return train.evaluate(model, (digits().x_test, digits().y_test), ["accuracy"])["accuracy"]


def batch(i):
    b = i % 33
    x, y = _xy()
    return x[b * 32 : (b + 1) * 32], y[b * 32 : (b + 1) * 32]


# --- NaN/Inf injected into a real run ------------------------------------------------------


def _with_negative_zero(model):
    """A -0.0 bias: a skipped step that added a zero update would turn it into +0.0."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    assert leaves[1].shape == (64,) and float(leaves[1][0]) == 0.0  # layer 0's bias
    leaves[1] = leaves[1].at[0].set(-0.0)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def test_injected_non_finite_steps_are_skipped_bit_exactly_and_training_converges():
    model = _with_negative_zero(digits_mlp("mixed_float16"))
    optimizer = ap.loss_scale_optimizer(optax.adam(3e-3), train.resolve_loss_scale(model))
    params, rest = partition(model, "param")
    fp8, rest = partition(rest, "fp8")
    state = optimizer.init(params)
    step = _make_step(XENT, optimizer, scaled=True)  # fit()'s own jitted step

    rng = np.random.default_rng(42)
    n_steps = 33 * 6
    injected = {0} | set(rng.choice(np.arange(1, n_steps), size=6, replace=False).tolist())
    skipped = []
    for i in range(n_steps):
        x, y = batch(i)
        if i in injected:
            x = x.copy()
            x[rng.integers(32), rng.integers(64)] = rng.choice([np.nan, np.inf, -np.inf])
        new_params, fp8, new_state, _, finite = step(params, fp8, rest, state, x, y, jax.random.key(i))
        if not bool(finite):
            skipped.append(i)
        if i in injected:
            assert_bit_identical(new_params, params)
            assert_bit_identical(new_state.inner_state, state.inner_state)
            assert float(new_state.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2
            assert int(new_state.loss_scale.counter) == 0
        else:
            assert int(new_state.inner_state[0].count) == int(state.inner_state[0].count) + 1
        params, state = new_params, new_state
    assert skipped == sorted(injected)
    assert float(state.loss_scale.loss_scale) == 2.0**15 / 2**7  # no overflow besides the injected
    assert accuracy(combine(params, fp8, rest)) >= 0.95


def test_fit_reports_skipped_steps_and_the_loss_scale_per_epoch():
    x, y = TINY_DATA
    batches = [(x[i : i + 16].copy(), y[i : i + 16]) for i in range(0, 64, 16)]
    batches[1][0][3, 2] = np.nan
    batches[3][0][0, 0] = np.inf
    _, history = train.fit(tiny_model("mixed_float16"), optax.sgd(0.1), XENT, batches, epochs=2, progress=False)
    assert history.steps == 8 and history.skipped_steps == 4
    assert history["skipped_steps"] == [2, 2]
    assert history["loss_scale"] == [2.0**13, 2.0**11] and history.loss_scale == 2.0**11
    assert all(np.isfinite(history["loss"]))  # skipped steps are left out of the mean


# --- float16 underflow ----------------------------------------------------------------------

TINY_WEIGHT = 2.0**-20  # e.g. an auxiliary loss's weight: |d loss / d logit| <= 2**-20 / 32 = 2**-25


def weighted_xent(labels, logits):
    return TINY_WEIGHT * XENT(labels, logits)


@jax.jit
def _param_grads(model, scale):
    params, rest = partition(model, "param")
    x, y = batch(0)
    return jax.grad(lambda p: scale * weighted_xent(y, combine(p, rest)(x)))(params)


def test_float16_gradients_that_underflow_train_with_loss_scaling():
    g32 = jax.tree_util.tree_leaves(_param_grads(digits_mlp("float32"), jnp.float32(1.0)))
    g16 = jax.tree_util.tree_leaves(_param_grads(digits_mlp("mixed_float16"), jnp.float32(1.0)))
    g16_scaled = jax.tree_util.tree_leaves(_param_grads(digits_mlp("mixed_float16"), jnp.float32(2.0**15)))
    assert len(g32) == len(g16) == 6
    for a, b, c in zip(g32, g16, g16_scaled):
        assert a.dtype == b.dtype == jnp.float32
        assert np.any(np.asarray(a) != 0)  # float32: small but there
        assert np.all(np.asarray(b) == 0)  # float16: every gradient underflowed to exactly 0
        np.testing.assert_allclose(c / 2.0**15, a, rtol=0, atol=1e-2 * float(jnp.max(jnp.abs(a))))

    # Adam's default eps (1e-8) would dwarf gradients of ~1e-8 in float32 too.
    model, history = train.fit(
        digits_mlp("mixed_float16"), optax.adam(3e-3, eps=1e-12), weighted_xent, _xy(), epochs=5, progress=False
    )
    assert history.loss_scale == 2.0**15 and history.skipped_steps == 0
    assert accuracy(model) >= 0.93


def test_mixed_float16_matches_float32_accuracy_on_digits():
    scores = {}
    for policy in ("float32", "mixed_float16"):
        model, history = train.fit(digits_mlp(policy), optax.adam(3e-3), XENT, _xy(), epochs=10, progress=False)
        scores[policy] = accuracy(model)
        assert model.layers[0].kernel.dtype == jnp.float32
    assert history.loss_scale == 2.0**15  # the mixed_float16 run was wrapped
    assert scores["float32"] >= 0.95
    assert scores["mixed_float16"] >= scores["float32"] - 0.01, scores


# --- float8 in the same loop ----------------------------------------------------------------


def test_float8_histories_update_every_step_and_record_scaled_gradients():
    fp8_policy = ap.QuantizedFloat8DTypePolicy("float8", "mixed_float16", amax_history_length=8)
    policy_map = ap.DTypePolicyMap("mixed_float16", {"mlp/dense": fp8_policy, "mlp/dense_2": fp8_policy})
    model = digits_mlp(policy_map)
    assert [layer.quantization_mode for layer in model.layers] == ["float8", None, "float8"]
    batches = [batch(i) for i in range(4)]
    trained, history = train.fit(model, optax.adam(3e-3), XENT, batches, progress=False)
    assert history.loss_scale == 2.0**15 and history.skipped_steps == 0
    assert trained.layers[1].fp8 is None

    for layer in (trained.layers[0], trained.layers[2]):
        for name, meta in layer.fp8.items():
            amax = np.asarray(meta.amax_history)
            assert np.all(amax[:4] > 0) and np.all(amax[4:] == 0), (layer.path, name, amax)  # 4 steps, 4 records
            fp8_max = float8.E5M2_MAX if name == "output_grad" else float8.E4M3_MAX
            assert float(meta.scale) == pytest.approx(amax.max() / fp8_max, rel=1e-6)

    # The oldest record is step 1, run with the initial weights: the forward amaxes are plain...
    x1, y1 = batches[0]
    first, last = trained.layers[0].fp8, trained.layers[2].fp8
    assert float(first["input"].amax_history[3]) == float(np.abs(x1).max())
    kernel16 = jnp.abs(model.layers[0].kernel.astype(jnp.float16))
    assert float(first["kernel"].amax_history[3]) == float(jnp.max(kernel16))
    # ...and the output gradient's is that of the *scaled* loss: the loss scale is not divided out.
    dlogits = jax.jit(lambda m, x, y: jax.grad(lambda logits: XENT(y, logits))(m(x)))(model, x1, y1)
    assert dlogits.dtype == jnp.float16
    unscaled_amax = float(jnp.max(jnp.abs(dlogits)))
    assert float(last["output_grad"].amax_history[3]) == 2.0**15 * unscaled_amax


# --- when the loop adds loss scaling --------------------------------------------------------


@pytest.mark.parametrize(
    "model_dtype,global_policy,loss_scale,expected",
    [
        ("mixed_float16", None, "auto", ("dynamic", 2.0**15)),
        ("float8_from_mixed_float16", None, "auto", ("dynamic", 2.0**15)),
        ("mixed_bfloat16", None, "auto", None),
        ("bfloat16", None, "auto", None),
        ("float32", None, "auto", None),
        (ap.DTypePolicyMap("float32", {"tiny/dense_1": "mixed_float16"}), None, "auto", ("dynamic", 2.0**15)),
        (None, "mixed_float16", "auto", ("dynamic", 2.0**15)),
        (None, "mixed_bfloat16", "auto", None),
        (None, Policy("mixed_float16", loss_scale=128), "auto", ("static", 128.0)),
        ("float32", Policy("mixed_float16", loss_scale=128), "auto", ("static", 128.0)),
        (None, Policy("mixed_float16", loss_scale=None), "auto", None),
        (None, Policy("mixed_bfloat16", loss_scale="dynamic"), "auto", ("dynamic", 2.0**15)),
        (Policy("mixed_float16", loss_scale=256), None, "auto", ("static", 256.0)),
        ("mixed_float16", None, None, None),
        ("mixed_float16", None, 512, ("static", 512.0)),
        ("float32", None, "dynamic", ("dynamic", 2.0**15)),
        ("mixed_bfloat16", None, ap.StaticLossScale(8.0), ("static", 8.0)),
    ],
)
def test_resolve_loss_scale(model_dtype, global_policy, loss_scale, expected):
    with ap.policy_scope(global_policy or "float32"):
        model = tiny_model(model_dtype)
        resolved = train.resolve_loss_scale(model, loss_scale)
    if expected is None:
        assert isinstance(resolved, ap.NoOpLossScale)
    else:
        kind, value = expected
        assert isinstance(resolved, ap.DynamicLossScale if kind == "dynamic" else ap.StaticLossScale)
        assert float(resolved.loss_scale) == value
    if isinstance(loss_scale, ap.StaticLossScale):
        assert resolved is loss_scale


@pytest.mark.parametrize("bad", ["sometimes", "Dynamic", -1, 0, float("nan"), float("inf"), True, [2.0]])
def test_bad_loss_scale_values_are_refused_by_name(bad):
    with pytest.raises(ValueError) as info:
        train.resolve_loss_scale(tiny_model("mixed_float16"), bad)
    assert f"loss_scale={bad!r}" in str(info.value)
    assert str(LOSS_SCALE_CHOICES) in str(info.value)


def test_every_literal_choice_the_error_suggests_is_accepted():
    literals = [ast.literal_eval(c) for c in LOSS_SCALE_CHOICES if c in ("'auto'", "'dynamic'", "None")]
    assert literals == ["auto", "dynamic", None]
    model = tiny_model("mixed_float16")
    resolved = [train.resolve_loss_scale(model, c) for c in literals + [4, 0.5, ap.NoOpLossScale()]]
    assert [type(r).__name__ for r in resolved] == [
        "DynamicLossScale", "DynamicLossScale", "NoOpLossScale", "StaticLossScale", "StaticLossScale", "NoOpLossScale"
    ]
    assert [float(r.loss_scale) for r in resolved] == [2.0**15, 2.0**15, 1.0, 4.0, 0.5, 1.0]


def test_fit_refuses_a_bad_loss_scale_before_training():
    with pytest.raises(ValueError, match=r"loss_scale=-1\b"):
        train.fit(tiny_model("mixed_float16"), optax.sgd(0.1), XENT, TINY_DATA, loss_scale=-1, progress=False)


@pytest.mark.parametrize(
    "model_dtype,global_policy,loss_scale,expected",
    [
        (None, Policy("mixed_float16", loss_scale=128), "auto", 128.0),
        ("mixed_float16", None, None, None),
    ],
)
def test_fit_wraps_the_optimizer_and_reports_the_scale(model_dtype, global_policy, loss_scale, expected):
    with ap.policy_scope(global_policy or "float32"):
        model = tiny_model(model_dtype)
        _, history = train.fit(model, optax.sgd(0.1), XENT, TINY_DATA, epochs=2, loss_scale=loss_scale, progress=False)
    assert history.loss_scale == expected and history.skipped_steps == 0
    assert history["loss_scale"] == ([] if expected is None else [expected, expected])
    assert history["skipped_steps"] == [0, 0]


def test_fit_keeps_a_users_loss_scale_optimizer():
    # Wrapping a LossScaleOptimizer again divided its gradients by the scale twice.
    model = tiny_model("mixed_float16")
    plain, plain_history = train.fit(model, optax.sgd(0.5), XENT, TINY_DATA, shuffle=False, progress=False)
    mine, history = train.fit(model, ap.LossScaleOptimizer(optax.sgd(0.5)), XENT, TINY_DATA, shuffle=False,
                              progress=False)
    # The plain optimizer was wrapped with the same default dynamic scale: the runs agree exactly.
    assert history.loss_scale == plain_history.loss_scale == 2.0**15 and history["loss_scale"] == [2.0**15]
    assert_bit_identical(mine, plain)
    assert not np.array_equal(mine.layers[0].kernel, model.layers[0].kernel)


def test_fit_refuses_a_second_loss_scale_for_a_scaling_optimizer():
    with pytest.raises(ValueError, match="loss_scale=64"):
        train.fit(tiny_model("mixed_float16"), ap.LossScaleOptimizer(optax.sgd(0.1)), XENT, TINY_DATA,
                  loss_scale=64, progress=False)
