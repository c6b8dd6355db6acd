"""Every layer under every float policy: output dtype, stored dtype, and accuracy against a
float64 NumPy reference computed from the same weights."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
import autopolicy.nn as nn

POLICIES = ["float32", "float16", "bfloat16", "float64", "mixed_float16", "mixed_bfloat16"]
# Relative error (norm of the difference over norm of the reference) allowed per compute dtype:
# the inputs and weights are rounded to it, and products accumulate in it.
TOLERANCE = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-3, "bfloat16": 2e-2}


def f64(x):
    return np.asarray(x).astype(np.float64)  # bfloat16 too (ml_dtypes), with no compilation


def ref_dense(layer, x):
    return x @ f64(layer.kernel) + f64(layer.bias)


def ref_einsum(layer, x):
    return np.einsum(layer.equation, x, f64(layer.kernel)) + f64(layer.bias)


def ref_conv(layer, x):
    k = f64(layer.kernel)
    kh, kw, _, cout = k.shape
    n, h, w, _ = x.shape
    out = np.zeros((n, h - kh + 1, w - kw + 1, cout))
    for i in range(h - kh + 1):
        for j in range(w - kw + 1):
            out[:, i, j, :] = np.einsum("nhwc,hwco->no", x[:, i : i + kh, j : j + kw, :], k)
    return out + f64(layer.bias)


def ref_layer_norm(layer, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + layer.epsilon) * f64(layer.gamma) + f64(layer.beta)


def ref_softmax(layer, x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ref_activation(layer, x):
    return np.tanh(x)


def ref_mha(layer, x):
    def proj(p, t):
        return np.einsum("abc,cde->abde", t, f64(p.kernel)) + f64(p.bias)

    q, k, v = proj(layer.query_dense, x), proj(layer.key_dense, x), proj(layer.value_dense, x)
    logits = np.einsum("bthd,bshd->bhts", q / np.sqrt(q.shape[-1]), k)
    probs = ref_softmax(None, logits)
    attended = np.einsum("bhts,bshd->bthd", probs, v)
    out = layer.output_dense
    return np.einsum("abcd,cde->abe", attended, f64(out.kernel)) + f64(out.bias)


RNG = np.random.default_rng(0)
CASES = {
    "Dense": (lambda p: nn.Dense(7, dtype=p), RNG.normal(size=(4, 5)), ref_dense),
    "EinsumDense": (
        lambda p: nn.EinsumDense("abc,cde->abde", (None, 3, 4), bias_axes="de", dtype=p),
        RNG.normal(size=(2, 3, 6)),
        ref_einsum,
    ),
    "Conv2D": (lambda p: nn.Conv2D(3, 2, dtype=p), RNG.normal(size=(2, 5, 5, 2)), ref_conv),
    "LayerNormalization": (
        lambda p: nn.LayerNormalization(dtype=p, gamma_initializer="random_normal",
                                        beta_initializer="random_normal"),
        RNG.normal(size=(3, 8)) * 4 + 1,
        ref_layer_norm,
    ),
    "Softmax": (lambda p: nn.Softmax(dtype=p), RNG.normal(size=(3, 6)) * 3, ref_softmax),
    "Activation": (lambda p: nn.Activation("tanh", dtype=p), RNG.normal(size=(3, 6)), ref_activation),
    "MultiHeadAttention": (
        lambda p: nn.MultiHeadAttention(2, 4, dtype=p, bias_initializer="random_normal"),
        RNG.normal(size=(2, 5, 8)),
        ref_mha,
    ),
}


def _x64(policy):
    return jax.enable_x64(True) if "64" in policy else contextlib.nullcontext()


def _rel_error(out, ref):
    return np.linalg.norm(f64(out) - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", list(CASES))
def test_layer_under_policy(case, policy):
    make, x, reference = CASES[case]
    p = ap.get(policy)
    with _x64(policy):
        layer = make(policy)
        call = (lambda m, a: m(a, a)) if case == "MultiHeadAttention" else (lambda m, a: m(a))
        layer = layer.build(jax.random.key(1), *([x] * (2 if case == "MultiHeadAttention" else 1)))
        x_in = jnp.asarray(x, jnp.float64 if policy == "float64" else jnp.float32)
        out = call(layer, x_in)  # a call from plain Python runs compiled as a whole (jitted)
        assert out.dtype == jnp.dtype(p.compute_dtype)
        for path, leaf in layer.layers_by_path().items():
            for value in jax.tree_util.tree_leaves(leaf):
                assert value.dtype == jnp.dtype(p.variable_dtype), (path, value.dtype)
        ref = reference(layer, np.asarray(x, np.float64))
        assert _rel_error(out, ref) < TOLERANCE[p.compute_dtype], case


@pytest.mark.parametrize("policy", POLICIES)
def test_embedding_under_policy(policy):
    p = ap.get(policy)
    with _x64(policy):
        ids = jnp.array([[0, 3, 9], [2, 2, 1]], jnp.int32)
        emb = nn.Embedding(10, 4, dtype=policy).build(jax.random.key(0), ids)
        out = emb(ids)
        assert out.dtype == jnp.dtype(p.compute_dtype)
        assert emb.embeddings.dtype == jnp.dtype(p.variable_dtype)
        ref = f64(emb.embeddings)[np.asarray(ids)]
        assert _rel_error(out, ref) < TOLERANCE[p.compute_dtype]


def test_layer_norm_and_softmax_in_mixed_float16_on_large_inputs():
    x = jnp.asarray(RNG.normal(size=(4, 64)) * 1e3 + 2e3, jnp.float32)
    ln = nn.LayerNormalization(dtype="mixed_float16").build(jax.random.key(0), x)
    y = ln(x)
    assert y.dtype == jnp.float16 and bool(jnp.isfinite(y).all())
    ref = ref_layer_norm(ln, np.asarray(x, np.float64))
    assert _rel_error(y, ref) < 2e-3
    # The naive float16 variance overflows here (squares of ~1e3 exceed 65504).
    naive = jnp.var(x.astype(jnp.float16), axis=-1)
    assert not bool(jnp.isfinite(naive).all())

    sm = nn.Softmax(dtype="mixed_float16").build(jax.random.key(0), x)
    s = sm(x)
    assert s.dtype == jnp.float16 and bool(jnp.isfinite(s).all())
    assert _rel_error(s, ref_softmax(None, np.asarray(x, np.float64))) < 2e-3


def test_integer_inputs_are_never_cast():
    ids = jnp.array([[1, 2]], jnp.int32)
    emb = nn.Embedding(5, 3, dtype="bfloat16").build(jax.random.key(0), ids)
    seen = []

    def hook(layer, args, kwargs):
        seen.append(args[0].dtype)

    from autopolicy.nn import _context

    with _context.call_hook(hook):
        emb(ids)
    assert seen == [jnp.int32]


def test_all_floating_arguments_are_cast_including_keywords():
    mha = nn.MultiHeadAttention(2, 4, dtype="bfloat16")
    x = jnp.ones((1, 3, 8), jnp.float32)
    mha = mha.build(jax.random.key(0), x, value=x)
    out = mha(x, value=jnp.ones((1, 3, 8), jnp.float16))
    assert out.dtype == jnp.bfloat16


def test_autocast_false_keeps_the_input_dtype():
    layer = nn.Dense(2, dtype="bfloat16", autocast=False)
    layer = layer.build(jax.random.key(0), jnp.ones((1, 3), jnp.bfloat16))
    with pytest.raises(jax.dtypes.TypePromotionError):  # strict: float32 input x bfloat16 kernel
        layer(jnp.ones((1, 3), jnp.float32))
    assert layer(jnp.ones((1, 3), jnp.bfloat16)).dtype == jnp.bfloat16


def test_gradients_come_back_in_the_variable_dtype():
    x = jnp.ones((2, 3))
    layer = nn.Dense(4, dtype="mixed_bfloat16").build(jax.random.key(0), x)
    grads = jax.grad(lambda m: m(x).astype(jnp.float32).sum())(layer)
    assert grads.kernel.dtype == jnp.float32 and grads.bias.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grads.kernel), np.full((3, 4), 2.0))


def test_float64_needs_x64_with_a_clear_error():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        nn.Dense(2, dtype="float64").build(jax.random.key(0), jnp.ones((1, 3)))


@pytest.mark.parametrize("policy", ["float32", "bfloat16", "mixed_bfloat16", "float16", "mixed_float16"])
def test_embedding_gathers_rows_before_casting_and_trains(policy):
    ids = jnp.array([[1, 2, 2, 7], [0, 9, 3, 3]])
    emb = nn.Embedding(10, 4, dtype=policy).build(jax.random.key(1), ids)
    reference = np.asarray(emb.kernel, np.float32)[np.asarray(ids)]
    out = emb(ids)
    assert out.dtype == jnp.dtype(emb.compute_dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(jnp.asarray(reference).astype(out.dtype), np.float32))
    # The table is never cast whole (a pass over every row to read a few): no convert of it.
    jaxpr = jax.make_jaxpr(lambda m: m(ids))(emb)
    converts = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert all(tuple(e.invars[0].aval.shape) != (10, 4) for e in converts)
    weights = jnp.arange(4.0)
    grad = jax.grad(lambda m: jnp.sum(m(ids).astype(jnp.float32) * weights))(emb).kernel
    expected = np.zeros((10, 4), np.float32)
    np.add.at(expected, np.asarray(ids), np.broadcast_to(np.arange(4.0), (2, 4, 4)))
    assert grad.dtype == jnp.dtype(emb.variable_dtype)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), expected)
