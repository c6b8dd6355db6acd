"""Loss scales as pytrees, all_finite/select_tree, and the loss-scaling optax wrapper."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopolicy as ap
from autopolicy.numerics import find_loss_scale_state
from helpers import assert_bit_identical

INF, NAN = float("inf"), float("nan")


def standard_promotion(opt):
    """optax's Adam mixes Python floats with int32 counts, which strict promotion refuses."""

    def update(updates, state, params=None, **extra):
        with jax.numpy_dtype_promotion("standard"):
            return opt.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(opt.init, update)


# --- construction and validation ----------------------------------------------------------------


def test_dynamic_defaults():
    s = ap.DynamicLossScale()
    assert (s.growth_interval, s.factor, s.min_scale) == (2000, 2.0, 1.0)
    assert s.loss_scale.dtype == jnp.float32 and s.loss_scale.shape == () and float(s.loss_scale) == 2.0**15
    assert s.counter.dtype == jnp.int32 and int(s.counter) == 0
    assert repr(s) == "DynamicLossScale(loss_scale=32768.0, counter=0, growth_interval=2000, factor=2.0, min_scale=1.0)"


def test_static_and_noop_values():
    static = ap.StaticLossScale(128)
    assert static.loss_scale.dtype == jnp.float32 and float(static.loss_scale) == 128.0
    assert repr(static) == "StaticLossScale(128.0)"
    noop = ap.NoOpLossScale()
    assert noop.loss_scale.dtype == jnp.float32 and float(noop.loss_scale) == 1.0
    assert jax.tree_util.tree_leaves(noop) == []


@pytest.mark.parametrize(
    "kwargs,error,text",
    [
        ({"initial_scale": 0}, ValueError, "initial_scale=0"),
        ({"initial_scale": -1.0}, ValueError, "initial_scale=-1.0"),
        ({"initial_scale": NAN}, ValueError, "initial_scale=nan"),
        ({"initial_scale": INF}, ValueError, "initial_scale=inf"),
        ({"initial_scale": "8"}, TypeError, "initial_scale='8'"),
        ({"initial_scale": True}, TypeError, "initial_scale=True"),
        ({"growth_interval": 0}, ValueError, "growth_interval=0"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval=2.5"),
        ({"growth_interval": True}, TypeError, "growth_interval=True"),
        ({"factor": 1.0}, ValueError, "factor=1.0"),
        ({"factor": 0.5}, ValueError, "factor=0.5"),
        ({"min_scale": 0}, ValueError, "min_scale=0"),
        ({"initial_scale": 1.0, "min_scale": 2.0}, ValueError, "initial_scale=1.0, min_scale=2.0"),
    ],
)
def test_dynamic_rejects_bad_arguments(kwargs, error, text):
    with pytest.raises(error) as info:
        ap.DynamicLossScale(**kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-2.0, ValueError), (INF, ValueError), (NAN, ValueError),
                                       ("2", TypeError), (None, TypeError)])
def test_static_rejects_bad_scales(bad, error):
    with pytest.raises(error, match=f"scale={bad!r}"):
        ap.StaticLossScale(bad)


@pytest.mark.parametrize("make", [lambda: ap.DynamicLossScale(4.0), lambda: ap.StaticLossScale(4.0)])
def test_loss_scales_are_immutable(make):
    s = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.loss_scale = jnp.float32(1.0)
    assert float(s.loss_scale) == 4.0


# --- pytree: every field survives flatten/unflatten and jit -----------------------------------


def _custom_dynamic():
    s = ap.DynamicLossScale(initial_scale=64.0, growth_interval=7, factor=4.0, min_scale=0.5)
    return s.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))  # counter 2


def _check_custom_dynamic(s):
    assert isinstance(s, ap.DynamicLossScale)
    assert float(s.loss_scale) == 64.0 and s.loss_scale.dtype == jnp.float32
    assert int(s.counter) == 2 and s.counter.dtype == jnp.int32
    assert (s.growth_interval, s.factor, s.min_scale) == (7, 4.0, 0.5)


def test_dynamic_flatten_unflatten_keeps_every_field():
    s = _custom_dynamic()
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(s)
    assert [jax.tree_util.keystr(p) for p, _ in leaves_with_paths] == [".loss_scale", ".counter"]
    restored = jax.tree_util.tree_unflatten(treedef, [x for _, x in leaves_with_paths])
    _check_custom_dynamic(restored)
    # Every dataclass field is either a leaf or part of the treedef: none can be dropped.
    fields = {f.name for f in dataclasses.fields(s)}
    assert fields == {"loss_scale", "counter", "growth_interval", "factor", "min_scale"}
    _check_custom_dynamic(jax.tree_util.tree_map(lambda x: x, s))


def test_static_fields_are_in_the_treedef():
    base = jax.tree_util.tree_structure(ap.DynamicLossScale(8.0, growth_interval=3, min_scale=0.5))
    same = jax.tree_util.tree_structure(ap.DynamicLossScale(16.0, growth_interval=3, min_scale=0.5))
    assert base == same and hash(base) == hash(same)
    for other in (ap.DynamicLossScale(8.0, growth_interval=4, min_scale=0.5),
                  ap.DynamicLossScale(8.0, growth_interval=3, factor=4.0, min_scale=0.5),
                  ap.DynamicLossScale(8.0, growth_interval=3, min_scale=1.0)):
        assert jax.tree_util.tree_structure(other) != base


def test_dynamic_survives_jit_with_every_field():
    _check_custom_dynamic(jax.jit(lambda s: s)(_custom_dynamic()))


def test_jit_retraces_only_when_static_fields_change_and_honours_min_scale():
    traces = []

    @jax.jit
    def shrink(s):
        traces.append(s.min_scale)
        return s.adjust(jnp.bool_(False))

    # jmp's hand-written flatten dropped min_loss_scale, so a jitted shrink fell to the default.
    assert float(shrink(ap.DynamicLossScale(4.0, min_scale=4.0)).loss_scale) == 4.0
    assert float(shrink(ap.DynamicLossScale(8.0, min_scale=4.0)).loss_scale) == 4.0
    assert traces == [4.0]
    out = shrink(ap.DynamicLossScale(4.0, min_scale=0.5))
    assert float(out.loss_scale) == 2.0 and out.min_scale == 0.5
    assert traces == [4.0, 0.5]


@pytest.mark.parametrize("make", [lambda: ap.StaticLossScale(32.0), ap.NoOpLossScale])
def test_static_and_noop_survive_flatten_and_jit(make):
    s = make()
    leaves, treedef = jax.tree_util.tree_flatten(s)
    for restored in (jax.tree_util.tree_unflatten(treedef, leaves), jax.jit(lambda s: s)(s)):
        assert type(restored) is type(s)
        assert float(restored.loss_scale) == float(s.loss_scale)
        assert restored.loss_scale.dtype == jnp.float32


# --- the dynamic rule ------------------------------------------------------------------------------


def test_default_dynamic_grows_after_exactly_2000_finite_steps():
    step = jax.jit(lambda i, s: s.adjust(jnp.bool_(True)))
    s = jax.lax.fori_loop(0, 1999, step, ap.DynamicLossScale())
    assert (float(s.loss_scale), int(s.counter)) == (2.0**15, 1999)
    s = s.adjust(jnp.bool_(True))
    assert (float(s.loss_scale), int(s.counter)) == (2.0**16, 0)


def test_dynamic_with_another_factor_and_the_float32_ceiling():
    s = ap.DynamicLossScale(2.0, growth_interval=1, factor=4.0, min_scale=0.25)
    trajectory = []
    for finite in (True, True, False, False, False, False):
        s = s.adjust(jnp.bool_(finite))
        trajectory.append(float(s.loss_scale))
    assert trajectory == [8.0, 32.0, 8.0, 2.0, 0.5, 0.25]
    top = ap.DynamicLossScale(2.0**127, growth_interval=1)
    assert float(top.adjust(jnp.bool_(True)).loss_scale) == 2.0**127  # 2**128 is inf in float32


def test_adjust_returns_a_new_object():
    s = ap.DynamicLossScale(8.0, growth_interval=1)
    grown = s.adjust(jnp.bool_(True))
    assert grown is not s and float(grown.loss_scale) == 16.0 and float(s.loss_scale) == 8.0
    static = ap.StaticLossScale(8.0)
    assert float(static.adjust(jnp.bool_(False)).loss_scale) == 8.0
    noop = ap.NoOpLossScale()
    assert noop.adjust(jnp.bool_(False)) is noop


# --- scale / unscale --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_and_unscale_keep_dtypes_and_skip_integers(dtype):
    s = ap.StaticLossScale(1024.0)
    tree = {"x": jnp.array([0.75, -3.0], dtype), "step": jnp.array(3, jnp.int32)}
    scaled = s.scale(tree)
    assert scaled["x"].dtype == dtype and scaled["step"] is tree["step"]
    np.testing.assert_array_equal(np.asarray(scaled["x"], np.float32), [768.0, -3072.0])
    back = s.unscale(scaled)
    assert back["x"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(back["x"], np.float32), [0.75, -3.0])


def test_unscale_divides_in_float32():
    # 1 / 2**25 underflows to 0 in float16; dividing in float32 keeps the exact 2**-15.
    out = ap.StaticLossScale(2.0**25).unscale(jnp.array([1024.0], jnp.float16))
    assert out.dtype == jnp.float16 and float(out[0]) == 2.0**-15


def test_scale_of_a_python_float_and_noop_identity():
    out = ap.StaticLossScale(128.0).scale(2.0)
    assert out.dtype == jnp.float32 and float(out) == 256.0
    tree = {"g": jnp.ones(2, jnp.float16)}
    noop = ap.NoOpLossScale()
    assert noop.scale(tree) is tree and noop.unscale(tree) is tree


# --- all_finite and select_tree ------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree,expected",
    [
        ({}, True),
        ({"a": jnp.ones(3)}, True),
        ({"a": jnp.array([1.0, INF])}, False),
        ({"a": jnp.array(-INF)}, False),
        ({"a": [jnp.ones(2, jnp.float16), jnp.array([NAN], jnp.bfloat16)]}, False),
        ({"a": jnp.array([65504.0], jnp.float16)}, True),
        ({"ids": jnp.array([1, 2], jnp.int32), "w": jnp.zeros((2, 2), jnp.bfloat16)}, True),
        ((2.0, np.array([NAN], np.float32)), False),
    ],
)
def test_all_finite(tree, expected):
    for fn in (ap.all_finite, jax.jit(ap.all_finite)):
        out = fn(tree)
        assert out.dtype == jnp.bool_ and out.shape == () and bool(out) is expected


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pred", [True, False])
def test_select_tree(pred, jit):
    on_true = {"w": jnp.array([1.0, 2.0], jnp.float16), "n": jnp.array(1, jnp.int32)}
    on_false = {"w": jnp.array([-0.0, NAN], jnp.float16), "n": jnp.array(2, jnp.int32)}
    fn = jax.jit(ap.select_tree) if jit else ap.select_tree
    out = fn(jnp.bool_(pred), on_true, on_false)
    assert_bit_identical(out, on_true if pred else on_false)


def test_select_tree_rejects_different_structures():
    with pytest.raises(ValueError):
        ap.select_tree(jnp.bool_(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)})


# --- loss_scale_optimizer -----------------------------------------------------------------------

G = {"w": np.array([1.0, -2.0], np.float32), "b": np.float32(0.5)}
# (what this step's gradient is, loss scale after it, counter after it, finite steps applied so far)
SCRIPT = [
    ("finite", 8.0, 1, 1),
    ("finite", 16.0, 0, 2),  # 2 finite steps: grow
    ("inf", 8.0, 0, 2),  # shrink, reset
    ("finite", 8.0, 1, 3),
    ("nan", 4.0, 0, 3),
    ("finite", 4.0, 1, 4),
    ("-inf", 2.0, 0, 4),
    ("nan", 2.0, 0, 4),  # clamped at min_scale
    ("finite", 2.0, 1, 5),
    ("finite", 4.0, 0, 6),
    ("finite", 4.0, 1, 7),
]


def _scaled_grads(kind, scale):
    grads = {"w": G["w"] * scale, "b": G["b"] * np.float32(scale)}
    if kind == "inf":
        grads["w"] = np.array([INF, grads["w"][1]], np.float32)
    elif kind == "-inf":
        grads["w"] = np.array([grads["w"][0], -INF], np.float32)
    elif kind == "nan":
        grads["b"] = np.float32(NAN)  # one non-finite leaf skips the whole step
    return jax.tree_util.tree_map(jnp.asarray, grads)


@pytest.mark.parametrize("jit", [False, True])
def test_scripted_trajectory_with_sgd(jit):
    opt = ap.loss_scale_optimizer(optax.sgd(0.5), ap.DynamicLossScale(8.0, growth_interval=2, min_scale=2.0))
    update = jax.jit(opt.update) if jit else opt.update
    params = {"w": jnp.array([1.0, -2.0], jnp.float32), "b": jnp.float32(0.5)}
    state = opt.init(params)
    assert isinstance(state, ap.LossScaleState) and state._fields == ("loss_scale", "inner_state")
    scale = 8.0
    for kind, expected_scale, expected_counter, applied in SCRIPT:
        updates, state = update(_scaled_grads(kind, scale), state, params)
        params = optax.apply_updates(params, updates)
        if kind == "finite":  # -0.5 * G, exactly
            np.testing.assert_array_equal(updates["w"], [-0.5, 1.0])
            assert float(updates["b"]) == -0.25
        else:
            assert_bit_identical(updates, {"w": jnp.zeros(2, jnp.float32), "b": jnp.zeros((), jnp.float32)})
        assert (float(state.loss_scale.loss_scale), int(state.loss_scale.counter)) == (expected_scale, expected_counter)
        # By hand: each applied SGD step moves w by -0.5 * [1, -2] and b by -0.5 * 0.5.
        np.testing.assert_array_equal(params["w"], [1.0 - 0.5 * applied, -2.0 + 1.0 * applied])
        assert float(params["b"]) == 0.5 - 0.25 * applied
        scale = expected_scale
    assert np.array_equal(params["w"], [-2.5, 5.0]) and float(params["b"]) == -1.25


INNER_OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(0.1, 0.0, 10)
    ),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


@pytest.mark.parametrize("name,jit", [("sgd_momentum", False), ("adam", True), ("inject_hyperparams", True),
                                      ("multi_steps", True)])
def test_skipped_steps_are_as_if_they_never_happened(name, jit):
    inner = INNER_OPTIMIZERS[name]()
    wrapped = standard_promotion(ap.loss_scale_optimizer(inner, ap.DynamicLossScale(1024.0, growth_interval=100)))
    bare = standard_promotion(inner)
    wrapped_update = jax.jit(wrapped.update) if jit else wrapped.update
    bare_update = jax.jit(bare.update) if jit else bare.update
    params = {"w": jnp.array([1.0, -2.0, 3.0], jnp.float32), "b": jnp.float32(0.5)}
    w_params, w_state = params, wrapped.init(params)
    b_params, b_state = params, bare.init(params)
    script = [[0.5, -0.25, 1.0], [0.5, NAN, 1.0], [0.25, 0.5, -1.0], [INF, 0.0, 0.0], [-0.5, 0.125, 0.75]]
    for g in script:
        grads = {"w": jnp.array(g, jnp.float32), "b": jnp.float32(g[0])}
        scale = w_state.loss_scale.loss_scale
        updates, new_state = wrapped_update(jax.tree_util.tree_map(lambda x: x * scale, grads), w_state, w_params)
        if np.all(np.isfinite(g)):
            assert float(new_state.loss_scale.loss_scale) == float(scale)
            b_updates, b_state = bare_update(grads, b_state, b_params)
            b_params = optax.apply_updates(b_params, b_updates)
        else:
            assert_bit_identical(new_state.inner_state, w_state.inner_state)
            assert_bit_identical(updates, jax.tree_util.tree_map(jnp.zeros_like, params))
            assert float(new_state.loss_scale.loss_scale) == float(scale) / 2
        w_params, w_state = optax.apply_updates(w_params, updates), new_state
    # The wrapped run equals a bare run that never saw the two bad steps (the power-of-two scale
    # is exact; the tolerance only allows for differently fused arithmetic).
    for a, b in zip(jax.tree_util.tree_leaves((w_params, w_state.inner_state)),
                    jax.tree_util.tree_leaves((b_params, b_state))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    assert not np.allclose(w_params["w"], params["w"])


def test_gradients_are_unscaled_before_the_inner_transformation():
    # Unscaled, |g| < 1 and clipping is a no-op; had the scaled gradients reached the clip, it
    # would have cut them to norm 1.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    opt = ap.loss_scale_optimizer(inner, ap.StaticLossScale(1024.0))
    params = {"w": jnp.zeros(2, jnp.float32)}
    updates, state = opt.update({"w": jnp.array([512.0, 256.0])}, opt.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-0.5, -0.25])
    assert float(state.loss_scale.loss_scale) == 1024.0


def test_float16_gradients_stay_float16():
    opt = ap.loss_scale_optimizer(optax.sgd(1.0), ap.StaticLossScale(2.0**10))
    params = {"w": jnp.zeros(2, jnp.float16)}
    updates, _ = opt.update({"w": jnp.array([1.0, 2.0], jnp.float16)}, opt.init(params), params)
    assert updates["w"].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-(2.0**-10), -(2.0**-9)])


def test_extra_args_reach_the_inner_transformation():
    def times_factor():
        def update(updates, state, params=None, *, factor):
            return jax.tree_util.tree_map(lambda u: u * factor, updates), state

        return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)

    opt = ap.loss_scale_optimizer(times_factor(), ap.StaticLossScale(4.0))
    params = {"w": jnp.zeros(2, jnp.float32)}
    updates, _ = opt.update({"w": jnp.array([4.0, 8.0])}, opt.init(params), params, factor=jnp.float32(3.0))
    np.testing.assert_array_equal(updates["w"], [3.0, 6.0])


def test_loss_scale_optimizer_rejects_a_plain_number():
    with pytest.raises(TypeError, match="loss_scale=2.0"):
        ap.loss_scale_optimizer(optax.sgd(0.1), 2.0)


def test_loss_scale_state_is_found_inside_a_chain():
    opt = optax.chain(optax.clip(1.0), ap.loss_scale_optimizer(optax.sgd(0.1), ap.StaticLossScale(16.0)))
    found = find_loss_scale_state(opt.init({"w": jnp.zeros(2)}))
    assert isinstance(found, ap.LossScaleState) and float(found.loss_scale.loss_scale) == 16.0
    assert find_loss_scale_state(optax.sgd(0.1).init({"w": jnp.zeros(2)})) is None


# --- LossScaleOptimizer (Keras's spelling) --------------------------------------------------------


def test_keras_loss_scale_optimizer_defaults_and_names():
    opt = ap.LossScaleOptimizer(optax.sgd(0.5))
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    s = opt.init({"w": jnp.zeros(2)}).loss_scale
    assert isinstance(s, ap.DynamicLossScale)
    assert (float(s.loss_scale), s.growth_interval, s.factor, s.min_scale) == (2.0**15, 2000, 2.0, 1.0)
    custom = ap.LossScaleOptimizer(inner_optimizer=optax.sgd(0.5), initial_scale=256.0, dynamic_growth_steps=1)
    params = {"w": jnp.zeros(2, jnp.float32)}
    updates, state = custom.update({"w": jnp.array([256.0, -512.0])}, custom.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-0.5, 1.0])
    assert (float(state.loss_scale.loss_scale), state.loss_scale.growth_interval) == (512.0, 1)


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps=0"),
        ({"dynamic_growth_steps": 1.5}, "dynamic_growth_steps=1.5"),
        ({"initial_scale": -1.0}, "initial_scale=-1.0"),
    ],
)
def test_keras_loss_scale_optimizer_errors_use_keras_names(kwargs, text):
    with pytest.raises(ValueError) as info:
        ap.LossScaleOptimizer(optax.sgd(0.1), **kwargs)
    assert text in str(info.value)



# --- one parser for every loss_scale argument -------------------------------------------------


@pytest.mark.parametrize(
    "spec,kind,value",
    [("auto", "StaticLossScale", 3.0), ("dynamic", "DynamicLossScale", 2.0**15), (None, "NoOpLossScale", 1.0),
     (8, "StaticLossScale", 8.0), (0.5, "StaticLossScale", 0.5)],
)
def test_parse_loss_scale(spec, kind, value):
    scale = ap.numerics.parse_loss_scale(spec, auto=lambda: ap.StaticLossScale(3.0))
    assert type(scale).__name__ == kind and float(scale.loss_scale) == value


@pytest.mark.parametrize("bad", ["Dynamic", -2, 0, float("inf"), True, [1.0]])
def test_parse_loss_scale_refuses_by_name(bad):
    with pytest.raises(ValueError) as info:
        ap.numerics.parse_loss_scale(bad, auto=ap.NoOpLossScale)
    assert f"loss_scale={bad!r}" in str(info.value)
    assert str(ap.numerics.LOSS_SCALE_CHOICES) in str(info.value)


def test_the_training_loop_and_the_legacy_policy_share_the_parser():
    from autopolicy import mixed_precision  # pylint: disable=import-outside-toplevel
    from autopolicy.train import loop  # pylint: disable=import-outside-toplevel

    assert mixed_precision.LOSS_SCALE_CHOICES is loop.LOSS_SCALE_CHOICES is ap.numerics.LOSS_SCALE_CHOICES
    with pytest.raises(ValueError, match=r"Expected one of .*loss_scale='sometimes'"):
        mixed_precision.Policy("mixed_float16", "sometimes")
    scale = ap.StaticLossScale(4.0)
    assert mixed_precision.Policy("float32", scale).loss_scale_config == ("static", 4.0)
    assert mixed_precision.Policy("mixed_float16").loss_scale_config == ("dynamic", 2.0**15, 2000, 2.0, 1.0)
