"""The GPTQ/AWQ XLA path in the form XLA:GPU fuses: with the groups in natural order the scales
and zero points are repeated over each group by a broadcast, not gathered by ``g_idx``; the
weights and products equal the gather's bit for bit; act-order keeps the gather; calibration
and loading decide the order where ``g_idx`` is concrete."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
from autopolicy.numerics import gemm_forms, weight_only
from helpers import on_the_cpu  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("on_the_cpu")
N = 33  # odd: 4-bit storage packs a last byte row of one value
# (K, group size): per channel, groups that divide K, a last group cut short (200 = 3 * 64 + 8),
# and one group larger than K.
GROUPINGS = [(256, weight_only.PER_CHANNEL), (256, 32), (256, 128), (200, 64), (96, 128)]


def _weights(k, bits, group_size, seed, g_idx=None, awq=False):
    rng = np.random.default_rng(seed)
    maxq, groups = 2**bits - 1, weight_only.group_count(k, group_size)
    q, zero = rng.integers(0, maxq + 1, (N, k)), rng.integers(0, maxq + 1, (N, groups))
    scale = rng.uniform(0.01, 0.2, (N, groups)).astype(np.float32)
    g_idx = weight_only.group_index(k, group_size) if g_idx is None else g_idx
    stored = weight_only.store(q, scale, zero, g_idx, bits, jnp.float32)
    if awq:
        stored["awq_scales"] = jnp.asarray(rng.uniform(0.25, 4.0, (k,)).astype(np.float32))
    return stored


def _act_order(k, group_size, seed):
    return np.random.default_rng(seed).permutation(weight_only.group_index(k, group_size))


def _bits_of(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("k,group_size", GROUPINGS)
@pytest.mark.parametrize("bits", [8, 4])
def test_natural_order_weights_and_products_equal_the_gathers_bit_for_bit(bits, k, group_size, dtype):
    weights = _weights(k, bits, group_size, seed=bits + k + group_size, awq=group_size == 64)
    layout = weight_only.calibrated_layout((bits, group_size), weights["g_idx"])
    assert layout == (bits, group_size, True)
    gathered = weight_only.dequantize(weights, (bits, group_size), dtype)
    repeated = weight_only.dequantize(weights, layout, dtype)
    assert repeated.dtype == dtype and repeated.shape == (k, N)
    np.testing.assert_array_equal(_bits_of(repeated), _bits_of(gathered))
    x = jax.random.normal(jax.random.key(k), (5, k), dtype)

    def product(layout_):
        return jax.jit(lambda x_, w_: weight_only.einsum_kernel("mk,kn->mn", x_, w_, layout_, dtype))(x, weights)

    np.testing.assert_array_equal(_bits_of(product(layout)), _bits_of(product((bits, group_size))))


@pytest.mark.parametrize("bits,k,group_size", [(4, 256, 128), (8, 200, 64), (4, 256, weight_only.PER_CHANNEL)])
def test_the_natural_order_program_has_no_gather_and_act_order_keeps_it(bits, k, group_size):
    x = jnp.ones((4, k), jnp.bfloat16)

    def check(weights):
        layout = weight_only.calibrated_layout((bits, group_size), weights["g_idx"])
        fn = jax.jit(lambda x_, w_: weight_only.einsum_kernel("mk,kn->mn", x_, w_, layout, jnp.bfloat16))
        return gemm_forms.check_lowered(fn.lower(x, weights).as_text(), "weight_only")

    natural = check(_weights(k, bits, group_size, seed=1))
    assert natural.ok and natural.verdict == "weight_only: dots bf16 x bf16 -> bf16", natural.verdict
    if group_size != weight_only.PER_CHANNEL:  # one group has no order
        act_order = check(_weights(k, bits, group_size, seed=1, g_idx=_act_order(k, group_size, 2)))
        assert not act_order.ok and act_order.verdict.endswith("scales gathered by index (a gather)")


def test_the_order_is_known_only_from_concrete_indices():
    g_idx = weight_only.group_index(200, 64)
    assert weight_only.in_natural_order(g_idx, 64) and weight_only.in_natural_order(np.zeros(7), -1)
    assert not weight_only.in_natural_order(g_idx, 32)  # other groups
    assert not weight_only.in_natural_order(_act_order(200, 64, 0), 64)
    assert not weight_only.in_natural_order(None, 64)
    seen = []
    jax.jit(lambda g: seen.append(weight_only.in_natural_order(g, 64)))(jnp.asarray(g_idx))
    assert seen == [False]  # traced: not known, so the gather
    assert weight_only.calibrated_layout((4, 64), g_idx[::-1]) == (4, 64, False)


@pytest.mark.parametrize("act_order", [False, True])
def test_calibration_records_the_order_and_saved_models_keep_it(act_order, tmp_path):
    # One Dense of K=40 inputs in groups of 16 (a last one of 8).
    x = jax.random.normal(jax.random.key(0), (64, 40)) * jnp.linspace(0.1, 3.0, 40)
    model = nn.Sequential([nn.Dense(12)]).build(jax.random.key(1), x).quantize("gptq/4/16")
    model = nn.calibrate_weights(model, [x], act_order=act_order)
    layer = model.layers_by_path()["sequential/dense"]
    assert layer._calibrated_layout == (4, 16, not act_order)
    text = jax.jit(lambda m, x_: m(x_)).lower(model, x).as_text()
    assert ("stablehlo.gather" in text) == act_order
    y = jax.jit(lambda m, x_: m(x_))(model, x)
    nn.save(model, tmp_path)
    loaded = nn.load(tmp_path)
    assert loaded.layers_by_path()["sequential/dense"]._calibrated_layout == (4, 16, not act_order)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda m, x_: m(x_))(loaded, x)), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
