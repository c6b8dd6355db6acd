"""The module system: pytrees, immutability, names and paths, policies and maps, errors."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
import autopolicy.nn as nn

X = jnp.asarray(np.random.default_rng(0).normal(size=(3, 6)), jnp.float32)


def mlp(**kwargs):
    return nn.Sequential(
        [nn.Dense(8, activation="relu"), nn.Dense(8, activation="relu"), nn.Dense(4)], name="mlp", **kwargs
    )


class Block(nn.Module):
    """A composite whose call order differs from its definition order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.out = nn.Dense(6)
        self.norm = nn.LayerNormalization()
        self.mlp = mlp()

    def call(self, x):
        return x + self.cast(self.out(self.mlp(self.norm(x))))


class Net(nn.Module):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block(), Block()]
        self.head = nn.Dense(2, name="logits")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_paths_are_unique_slash_joined_and_in_execution_order():
    net = Net(name="net").build(jax.random.key(0), X)
    paths = list(net.layers_by_path())
    assert paths == [
        "net/block/norm", "net/block/mlp/dense", "net/block/mlp/dense_1", "net/block/mlp/dense_2",
        "net/block/out",
        "net/block_1/norm", "net/block_1/mlp/dense", "net/block_1/mlp/dense_1", "net/block_1/mlp/dense_2",
        "net/block_1/out",
        "net/logits",
    ]
    assert len(set(net.modules())) == len(net.modules())
    for path, layer in net.layers_by_path().items():
        assert layer.path == path


def test_auto_names_and_duplicate_explicit_names():
    seq = nn.Sequential([nn.Dense(2), nn.Dense(2, name="dense_1"), nn.Dense(2), nn.Conv2D(1, 1)])
    assert [layer.name for layer in seq] == ["dense", "dense_1", "dense_2", "conv2d"]
    assert seq.path == "sequential"
    with pytest.raises(ValueError, match="dense_x"):
        nn.Sequential([nn.Dense(2, name="dense_x"), nn.Dense(2, name="dense_x")])
    with pytest.raises(ValueError, match="without '/'"):
        nn.Dense(2, name="a/b")


def test_nesting_repaths_without_mutating_the_child():
    inner = mlp()
    outer = nn.Sequential([inner], name="outer")
    assert inner.layers[0].path == "mlp/dense"
    assert outer.layers[0].layers[0].path == "outer/mlp/dense"


def test_modules_are_immutable():
    layer = nn.Dense(2).build(jax.random.key(0), X)
    with pytest.raises(AttributeError, match="immutable"):
        layer.units = 3
    with pytest.raises(AttributeError, match="immutable"):
        layer.kernel = jnp.zeros((6, 2))


def test_build_returns_a_copy_and_the_original_stays_unbuilt():
    model = mlp()
    built = model.build(jax.random.key(0), X)
    assert built.built and not model.built
    assert model.layers[0].kernel is None
    assert built.layers[0].kernel.shape == (6, 8)
    with pytest.raises(RuntimeError, match="not built"):
        model(X)


def test_build_is_deterministic_and_keyed_by_path():
    a = mlp().build(jax.random.key(0), X)
    b = mlp().build(jax.random.key(0), X[:1])
    c = mlp().build(jax.random.key(1), X)
    np.testing.assert_array_equal(a.layers[1].kernel, b.layers[1].kernel)
    assert not np.array_equal(a.layers[1].kernel, c.layers[1].kernel)
    assert not np.array_equal(a.layers[1].kernel[:8], a.layers[0].kernel[:6].T[:8, :6].T[:8])


def test_build_needs_a_key():
    with pytest.raises(TypeError, match="jax.random.key"):
        mlp().build(0, X)


def _compiled(caplog) -> list[str]:
    return [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("Compiling ")]


def test_building_traces_without_compiling_and_a_rebuild_keeps_the_weights(caplog):
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        built = Net(name="net").build(jax.random.key(0), X)
        again = built.build(jax.random.key(1), X)
    assert _compiled(caplog) == []
    assert again.blocks[1].out.kernel is built.blocks[1].out.kernel
    assert built.blocks[0].norm.gamma.dtype == jnp.float32 and built.head.kernel.shape == (6, 2)


class _Ramp(nn.Module):
    """Keeps an array computed while building that is neither a weight nor an input."""

    def build_variables(self, x):
        self.add_weight("bias", (x.shape[-1],), "ones")
        self.ramp = jnp.arange(x.shape[-1], dtype=jnp.float32) * 2.0

    def call(self, x):
        return x + self.bias + self.ramp


def test_an_array_computed_while_building_is_computed_for_real(caplog):
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        built = _Ramp().build(jax.random.key(0), X)
    assert _compiled(caplog) == ["jit(build_pass)"]
    np.testing.assert_array_equal(built.ramp, [0.0, 2.0, 4.0, 6.0, 8.0, 10.0])
    np.testing.assert_array_equal(built.bias, np.ones(6, np.float32))
    np.testing.assert_allclose(built(X), X + 1.0 + built.ramp, rtol=1e-6)


def test_pytree_round_trip_keeps_every_field():
    model = Net(name="net").build(jax.random.key(0), X).quantize("int8", filter=lambda p, l: p.endswith("out"))
    leaves, treedef = jax.tree_util.tree_flatten(model)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert jax.tree_util.tree_structure(again) == treedef
    assert again.__dict__.keys() == model.__dict__.keys()
    assert again.blocks[0].out.dtype_policy == model.blocks[0].out.dtype_policy
    np.testing.assert_array_equal(again(X), model(X))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    assert ".blocks[0].out.kernel_scale" in paths


def test_jit_equals_eager_and_retraces_only_on_policy_change():
    model = Net(name="net").build(jax.random.key(0), X)
    traces = []

    @jax.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    np.testing.assert_allclose(f(model, X), model(X), rtol=1e-5, atol=1e-6)
    f(model, X + 1)
    assert len(traces) == 1
    f(jax.tree_util.tree_map(lambda a: a * 2 if a.dtype == jnp.float32 else a, model), X)
    assert len(traces) == 1
    f(model.with_dtype_policy("mixed_bfloat16"), X)
    assert len(traces) == 2


def test_optax_trains_a_model_directly():
    import optax

    model = mlp().build(jax.random.key(0), X)
    opt = optax.sgd(0.1)
    state = opt.init(model)
    y = jnp.ones((3, 4))
    loss = lambda m: jnp.mean((m(X) - y) ** 2)  # noqa: E731
    before = loss(model)
    for _ in range(20):
        grads = jax.grad(loss)(model)
        updates, state = opt.update(grads, state)
        model = optax.apply_updates(model, updates)
    assert float(loss(model)) < 0.5 * float(before)


def test_map_applied_by_exact_and_regex_keys_without_mutating_the_original():
    model = Net(name="net").build(jax.random.key(0), X)
    policy_map = ap.DTypePolicyMap(
        "float32",
        {"net/logits": "mixed_float16", "net/block_1/mlp/dense_[0-9]": "mixed_bfloat16"},
    )
    mapped = model.with_dtype_policy(policy_map)
    by_path = {p: layer.dtype_policy.name for p, layer in mapped.layers_by_path().items()}
    assert by_path["net/logits"] == "mixed_float16"
    assert by_path["net/block_1/mlp/dense_1"] == "mixed_bfloat16"
    assert by_path["net/block_1/mlp/dense"] == "float32"  # full match, not prefix
    assert by_path["net/block/mlp/dense_1"] == "float32"
    assert all(layer.dtype_policy.name == "float32" for layer in model.layers_by_path().values())
    assert mapped(X).dtype == jnp.float16
    assert model(X).dtype == jnp.float32


def test_strict_map_raises_on_keys_matching_no_layer():
    model = mlp().build(jax.random.key(0), X)
    typo = ap.DTypePolicyMap("float32", {"mlp/dnese": "bfloat16", "mlp/dense": "bfloat16"})
    with pytest.raises(ValueError, match="mlp/dnese"):
        model.with_dtype_policy(typo, strict=True)
    with pytest.warns(UserWarning, match=r"'mlp/dnese': did you mean \['mlp/dense'"):
        assert model.with_dtype_policy(typo).layers[0].dtype_policy.name == "bfloat16"


def test_with_dtype_policy_casts_stored_variables():
    model = mlp().build(jax.random.key(0), X)
    half = model.with_dtype_policy("bfloat16")
    assert half.layers[0].kernel.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(half.layers[0].kernel, np.float32), np.asarray(model.layers[0].kernel), rtol=1e-2
    )
    mixed = model.with_dtype_policy("mixed_bfloat16")
    assert mixed.layers[0].kernel.dtype == jnp.float32


def test_dtype_map_at_construction_resolves_by_path():
    policy_map = ap.DTypePolicyMap("float32", {"mlp/dense_1": "mixed_bfloat16"})
    model = mlp(dtype=policy_map).build(jax.random.key(0), X)
    assert [layer.dtype_policy.name for layer in model] == ["float32", "mixed_bfloat16", "float32"]


def test_container_dtype_is_handed_to_children_without_one():
    model = nn.Sequential([nn.Dense(2), nn.Dense(2, dtype="float16")], dtype="mixed_bfloat16")
    assert [layer.dtype_policy.name for layer in model] == ["mixed_bfloat16", "float16"]


def test_none_dtype_means_the_global_policy_at_construction():
    with ap.policy_scope("mixed_bfloat16"):
        layer = nn.Dense(2)
    assert layer.dtype_policy.name == "mixed_bfloat16"
    assert nn.Dense(2).dtype_policy.name == "float32"


def test_quantized_policy_on_a_layer_without_a_kernel_reads_as_its_source(caplog):
    model = nn.Sequential([nn.Dense(4), nn.LayerNormalization()], name="m").build(jax.random.key(0), X)
    with caplog.at_level(logging.INFO, logger="autopolicy.nn"):
        q = model.with_dtype_policy("int8_from_float32")
    assert q.layers[0].dtype_policy.name == "int8_from_float32"
    assert q.layers[1].dtype_policy.name == "float32"
    assert "m/layer_normalization" in caplog.text


def test_infer_policy_is_deprecated_and_takes_the_first_input_dtype():
    with pytest.warns(DeprecationWarning, match="infer"):
        layer = nn.Dense(2, dtype="infer")
    with pytest.raises(RuntimeError, match="infer"):
        layer.dtype_policy
    built = layer.build(jax.random.key(0), jnp.ones((1, 3), jnp.bfloat16))
    assert built.dtype_policy.name == "bfloat16"
    assert built.kernel.dtype == jnp.bfloat16


def test_regularization_loss_uses_the_stored_weights():
    layer = nn.Dense(3, kernel_regularizer=nn.regularizers.L2(0.5), dtype="mixed_bfloat16")
    layer = layer.build(jax.random.key(0), X)
    expected = 0.5 * float(jnp.sum(layer.kernel.astype(jnp.float32) ** 2))
    assert layer.kernel.dtype == jnp.float32
    np.testing.assert_allclose(float(layer.regularization_loss()), expected, rtol=1e-6)
    model = nn.Sequential([layer, nn.Dense(2, kernel_regularizer=nn.regularizers.L1(1.0))])
    model = model.build(jax.random.key(0), X)
    assert float(model.regularization_loss()) > 0


def test_dropout_needs_randomness_only_while_training():
    model = nn.Sequential([nn.Dense(16), nn.Dropout(0.5)]).build(jax.random.key(0), X)
    np.testing.assert_array_equal(model(X), model(X, training=False))
    with pytest.raises(RuntimeError, match="rng_scope"):
        model(X, training=True)
    with nn.rng_scope(jax.random.key(0)):
        a = model(X, training=True)
    with nn.rng_scope(jax.random.key(0)):
        b = model(X, training=True)
    np.testing.assert_array_equal(a, b)
    assert 0.2 < float(jnp.mean(a == 0)) < 0.8


@pytest.mark.parametrize(
    "make,text",
    [
        (lambda: nn.Dense(0), "units=0"),
        (lambda: nn.Dense(2, activation="reluu"), "reluu"),
        (lambda: nn.Dense(2, kernel_initializer="glorot"), "glorot"),
        (lambda: nn.Dense(2, dtype="mixed_float15"), "mixed_float15"),
        (lambda: nn.Conv2D(2, 3, padding="full"), "full"),
        (lambda: nn.Conv2D(2, (3, 0)), "kernel_size"),
        (lambda: nn.Dropout(1.0), "rate=1.0"),
        (lambda: nn.EinsumDense("ab->b", 3), "ab->b"),
        (lambda: nn.EinsumDense("ab,bc->ac", 3, bias_axes="z"), "bias_axes='z'"),
        (lambda: nn.MultiHeadAttention(0, 4), "num_heads=0"),
        (lambda: nn.Embedding(10, 0), "output_dim=0"),
        (lambda: nn.LayerNormalization(epsilon=-1), "epsilon=-1"),
        (lambda: nn.Sequential([nn.Dense(2), "relu"]), "relu"),
    ],
)
def test_bad_constructor_arguments_raise_early(make, text):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert text in str(info.value)


def test_unhashable_static_attributes_are_refused():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"a": 1}

        def call(self, x):
            return x

    with pytest.raises(TypeError, match="hashable"):
        Bad()


def test_a_subclass_must_call_super_init():
    class Forgot(nn.Module):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match="super"):
        Forgot()


def test_summary_lists_every_leaf():
    text = mlp().build(jax.random.key(0), X).summary()
    assert "mlp/dense_2" in text and "float32" in text
    assert text.splitlines()[-1].split()[1] == str(6 * 8 + 8 + 8 * 8 + 8 + 8 * 4 + 4)


def test_max_pooling_values_and_gradient():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 4, 3)), jnp.float32)
    pool = nn.MaxPooling2D(2).build(jax.random.key(0), x)
    expected = np.asarray(x).reshape(2, 2, 2, 2, 2, 3).max(axis=(2, 4))
    np.testing.assert_array_equal(pool(x), expected)
    grad = jax.grad(lambda a: pool(a).sum())(x)
    assert float(grad.sum()) == 2 * 2 * 2 * 3  # one winner per window
    assert pool.with_dtype_policy("mixed_bfloat16")(x).dtype == jnp.bfloat16


def test_flattening_reuses_the_aux_data_and_a_changed_copy_gets_its_own():
    """jit hashes and compares every module's aux data at every call: a frozen module keeps its
    own (the same object at every flatten, and after unflattening), a changed copy gets new."""
    from autopolicy.nn import _base

    layer = nn.Dense(3).build(jax.random.key(0), jnp.ones((2, 4)))
    leaves, treedef = jax.tree_util.tree_flatten(layer)
    aux = _base.flatten(layer)[1]
    assert _base.flatten(layer)[1] is aux and hash(aux) == hash(tuple(aux))
    assert jax.tree_util.tree_structure(layer) == treedef
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert _base.flatten(rebuilt)[1] is aux
    changed = layer.with_dtype_policy("bfloat16")
    assert _base.flatten(changed)[1] != aux
    assert jax.tree_util.tree_structure(changed) != treedef
    assert changed.dtype_policy.name == "bfloat16" and layer.dtype_policy.name == "float32"


def test_compiled_by_parts_compiles_each_child_once_per_nameless_signature():
    """A model compiled by parts runs each child it calls as its own compiled part; parts that
    differ only in names and paths (the blocks) share one compilation, so a model that differs
    in one block compiles one part. The outputs are the whole call's up to rounding."""
    from autopolicy.nn import _parts
    from autopolicy.nn.calibration import calibrate

    x = jnp.asarray(np.random.default_rng(5).normal(size=(5, 6)), jnp.float32)  # 5 rows: this test's own shapes
    net = Net(name="net").build(jax.random.key(3), x)
    parts = net.compiled_by_parts()
    assert parts.compiles_by_parts and not net.compiles_by_parts
    assert not parts.compiled_by_parts(False).compiles_by_parts
    compiled = _parts._jit_part._cache_size  # pylint: disable=protected-access
    start = compiled()
    np.testing.assert_allclose(np.asarray(parts(x)), np.asarray(net(x)), rtol=1e-6, atol=1e-6)
    assert compiled() - start == 2  # block and block_1 share one part; the head is the other

    def with_int8(path):
        return net.with_dtype_policy(ap.DTypePolicyMap("float32", {path: "int8_from_float32"}))

    first, second = with_int8("net/block/mlp/dense_1"), with_int8("net/block_1/mlp/dense_1")
    np.testing.assert_allclose(np.asarray(first.compiled_by_parts()(x)), np.asarray(first(x)), rtol=1e-6, atol=1e-6)
    assert compiled() - start == 3  # the int8 block is new; the float32 block and the head are not
    np.testing.assert_allclose(np.asarray(second.compiled_by_parts()(x)), np.asarray(second(x)), rtol=1e-6,
                               atol=1e-6)
    assert compiled() - start == 3  # the same int8 block under another name: nothing new
    # float8 layers keep their scales in a dict of arrays (a tree node with its keys as data).
    fp8 = calibrate(net.with_dtype_policy(ap.DTypePolicyMap("float32", {"net/block/out": "float8_from_float32"})),
                    [x])
    np.testing.assert_allclose(np.asarray(fp8.compiled_by_parts()(x)), np.asarray(fp8(x)), rtol=1e-6, atol=1e-6)
    assert compiled() - start == 4
    # Inside a trace (the user's own jit) a model compiled by parts is traced whole.
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, v: m(v))(parts, x)), np.asarray(net(x)), rtol=1e-6,
                               atol=1e-6)
    assert compiled() - start == 4


def test_part_outputs_reuse_a_part_another_model_ran_on_the_same_weights_and_equal_inputs():
    x = jnp.asarray(np.random.default_rng(6).normal(size=(4, 6)), jnp.float32)  # not the 5 rows above: its compilations are counted
    net = Net(name="net").build(jax.random.key(3), x)

    def changed(path, reuse):  # float32 but for one layer; the float32 layers keep net's arrays
        return net.with_dtype_policy(ap.DTypePolicyMap("float32", {path: "int8_from_float32"})).compiled_by_parts(
            reuse=reuse)

    reuse = nn.PartOutputs()
    one, two = changed("net/block_1/out", reuse), changed("net/logits", reuse)
    first = np.asarray(one(x))  # block, block_1 (int8) and the head: seen
    np.testing.assert_array_equal(np.asarray(one(x)), first)  # one model's own calls are never kept
    assert (reuse.hits, reuse.misses, len(reuse)) == (0, 6, 0)
    # The float32 block on the same input in a second model: kept. Its block_1 (float32) and
    # head (int8) run for it alone.
    expected = np.asarray(two.compiled_by_parts(False)(x))
    np.testing.assert_allclose(np.asarray(two(x)), expected, rtol=1e-6, atol=1e-6)
    assert (reuse.hits, reuse.misses, len(reuse), reuse.nbytes) == (0, 9, 1, 4 * 6 * 4)
    np.testing.assert_array_equal(np.asarray(two(x)), np.asarray(two(x)))
    assert (reuse.hits, reuse.misses, len(reuse)) == (2, 13, 1)
    # Equal inputs in another array: the kept output, and the same outputs bit for bit.
    np.testing.assert_array_equal(np.asarray(one(jnp.asarray(np.asarray(x)))), first)
    assert (reuse.hits, reuse.misses) == (3, 15)
    one(x + 1.0)  # other inputs: nothing reused
    assert (reuse.hits, reuse.misses) == (3, 18)
    reuse.clear()
    assert (len(reuse), reuse.nbytes) == (0, 0)

    # At most max_bytes, least recently used out first; an output over a quarter of it never.
    small = nn.PartOutputs(max_bytes=360)  # a block's 96 bytes are over 90: never kept
    one, two = changed("net/block_1/out", small), changed("net/logits", small)
    one(x), two(x), two(x)
    assert (small.hits, len(small)) == (0, 0)
    small = nn.PartOutputs(max_bytes=384)  # four blocks' outputs
    one, two = changed("net/block_1/out", small), changed("net/logits", small)
    inputs = [x + i for i in range(5)]
    for v in inputs:
        one(v), two(v)
    assert (len(small), small.nbytes) == (4, 384)
    one(inputs[4])
    assert small.hits == 1
    one(inputs[0])  # the first one kept, dropped for the fifth
    assert small.hits == 1
    with pytest.raises(ValueError, match=r"max_bytes must be a positive int. Received: max_bytes=0"):
        nn.PartOutputs(max_bytes=0)
    with pytest.raises(TypeError, match=r"reuse must be an autopolicy.nn.PartOutputs or None. Received: 'yes'"):
        net.compiled_by_parts(reuse="yes")
