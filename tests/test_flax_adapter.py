"""The Flax NNX adapter: layers in execution order, policies as dtypes and Qwix rules, the user's
model untouched, bad input refused. Runs only where the `flax` extra is installed (its tier)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax", reason="the flax extra is not installed: pip install -e '.[flax]'")
qwix = pytest.importorskip("qwix", reason="the flax extra is not installed: pip install -e '.[flax]'")
from flax import nnx  # noqa: E402

import autopolicy as ap  # noqa: E402
from autopolicy import policies, search  # noqa: E402
from autopolicy.adapters import flax as af  # noqa: E402

pytestmark = pytest.mark.flax


@pytest.fixture(autouse=True)
def _standard_promotion():
    """Qwix 0.1.8's int8 path multiplies float32 scales by int32 accumulators without a cast,
    which the suite's strict promotion refuses: these tests run under JAX's default."""
    with jax.numpy_dtype_promotion("standard"):
        yield


class Net(nnx.Module):
    """Attributes named against their call order: `b_first` runs before `a_second`."""

    def __init__(self, rngs):
        self.a_second = nnx.Linear(32, 8, rngs=rngs)
        self.b_first = nnx.Linear(16, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs)])

    def __call__(self, x):
        x = self.norm(nnx.relu(self.b_first(x)))
        x = nnx.relu(self.blocks[0](x))
        return self.a_second(x)


class Tokens(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(50, 16, rngs=rngs)
        self.conv = nnx.Conv(16, 8, kernel_size=(3,), rngs=rngs)

    def __call__(self, ids):
        return self.conv(self.embed(ids))


@pytest.fixture(scope="module")
def net():
    return Net(nnx.Rngs(0))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (4, 16))


@pytest.fixture(scope="module")
def adapter(net, x):
    return af.FlaxAdapter(net, (x,), [])


def test_layers_in_execution_order_with_qwix_paths(adapter):
    assert [(l.path, l.kind) for l in adapter.layers()] == [
        ("b_first", "Linear"), ("norm", "LayerNorm"), ("blocks/0", "Linear"), ("a_second", "Linear")]
    assert adapter.layers()[0].modes == ("int8", "int4", "float8")
    assert adapter.layers()[1].modes == ()
    assert adapter.layers()[0].input_shape == (4, 16)
    assert adapter.layers()[1].producer == "b_first" or adapter.layers()[1].producer is None


@pytest.mark.parametrize("policy,dtype,nbytes", [
    ("float32", "float32", 32 * 32 * 4 + 32 * 4),
    ("mixed_bfloat16", "bfloat16", 32 * 32 * 4 + 32 * 4),  # parameters stay float32
    ("int8_from_float32", "float32", 32 * 32 + 32 * 4 + 32 * 4),
    ("int4/16_from_float32", "float32", 32 * 32 // 2 + 2 * 32 * 4 + 32 * 4),
])
def test_layer_program_runs_the_policy(adapter, policy, dtype, nbytes):
    program = adapter.layer_program("blocks/0", policies.get(policy))
    out = program.run()
    assert out.shape == (4, 32) and out.dtype == jnp.dtype(dtype)
    assert adapter.layer_bytes("blocks/0", policies.get(policy)) == nbytes
    reference = adapter.layer_program("blocks/0", policies.get("float32")).run()
    error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference)))
    assert 0 <= error < 0.15 * float(jnp.max(jnp.abs(reference)))
    if policy != "float32":
        assert error > 0


def test_with_policies_leaves_the_users_model_untouched(net, x, adapter):
    before = jax.tree_util.tree_map(np.asarray, nnx.state(net))
    tuned = adapter.with_policies(policies.DTypePolicyMap(
        "float32", {"b_first": "int8_from_float32", "blocks/0": "mixed_bfloat16"}))
    assert tuned(x).shape == (4, 8) and isinstance(tuned, Net) and type(net) is Net
    assert tuned.blocks[0].dtype == jnp.bfloat16 and net.blocks[0].dtype is None
    assert net.b_first.kernel[...].dtype == jnp.float32
    after = jax.tree_util.tree_map(np.asarray, nnx.state(net))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)


def test_rules_applied_with_qwix_reproduce_the_tuned_model(net, x):
    mapping = {"b_first": "int8_from_float32", "a_second": "int4/16_from_float32"}
    tuned = af.apply_policy_map(net, mapping, x)
    rules = af.qwix_rules(mapping, paths=af.tunable_modules(net))
    assert [r.module_path for r in rules] == ["b_first", "a_second"]
    assert rules[1].tile_size == 16 and rules[1].weight_qtype == jnp.int4 and rules[1].act_qtype == jnp.int8
    provider = qwix.PtqProvider(rules)
    by_hand = af._quantize(nnx.clone(net), provider, x)
    assert provider.get_unused_rules() == []
    np.testing.assert_array_equal(np.asarray(by_hand(x)), np.asarray(tuned(x)))
    assert not np.array_equal(np.asarray(tuned(x)), np.asarray(net(x)))


def test_rule_texts():
    mapping = {"blocks/0": "int8_from_float32", "b_first": "mixed_float16"}
    assert af.rules_to_python(mapping).splitlines()[-2] == (
        "    qwix.QuantizationRule(module_path=r'blocks/0', weight_qtype=jnp.int8, act_qtype=jnp.int8),")
    namespace: dict = {}
    exec(af.rules_to_python(mapping), namespace)  # the pasted config is valid Python
    assert namespace["RULES"][0].module_path == "blocks/0"
    assert '"weight_qtype": "int8"' in af.rules_to_json(mapping)


def test_jit_caches_do_not_leak_quantization(net, x):
    """A float and a quantized model of the same shapes through one jitted function."""
    quantized = af.apply_policy_map(net, {"blocks/0": "int8_from_float32"}, x)
    run = nnx.jit(lambda model, inputs: model(inputs))
    np.testing.assert_allclose(np.asarray(run(net, x)), np.asarray(net(x)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(run(quantized, x)), np.asarray(quantized(x)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(run(net, x)), np.asarray(run(quantized, x)), rtol=0, atol=1e-7)


def test_qwix_int8_bound_is_127_5_not_kerass_127(x):
    """Qwix scales by amax / 127.5, so -128 occurs; Keras (and autopolicy.nn) use amax / 127."""
    layer = nnx.Linear(16, 64, rngs=nnx.Rngs(3))
    layer.kernel[...] = -jnp.abs(layer.kernel[...])  # every column's amax is a negative value
    quantized = af.apply_policy_map(layer, {}, x)  # no rule: float32
    assert quantized.kernel[...].dtype == jnp.float32
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)
    q = af._quantize(nnx.clone(layer), qwix.PtqProvider([rule]), x)
    qvalue = np.asarray(nnx.state(q)["kernel"]["array"]["qvalue"][...])
    assert qvalue.min() == -128
    ours, _ = ap.numerics.int8.quantize_symmetric(layer.kernel[...], axes=(0,))
    assert int(np.asarray(ours).min()) == -127


def test_embed_and_conv(x):
    model, ids = Tokens(nnx.Rngs(0)), jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    adapter = af.FlaxAdapter(model, (ids,), [])
    assert [(l.path, l.modes) for l in adapter.layers()] == [("embed", ()), ("conv", ("int8", "float8"))]
    tuned = af.apply_policy_map(model, {"conv": "int8_from_float32", "embed": "mixed_bfloat16"}, ids)
    assert tuned(ids).shape == (2, 12, 8) and tuned.embed.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"'embed' \(Embed\) cannot run 'float8_from_float32'"):
        af.apply_policy_map(model, {"embed": "float8_from_float32"}, ids)


def test_bad_input_is_refused_by_name(net, x):
    with pytest.raises(ValueError, match=r"lacks: \['blocks/7'\]"):
        af.apply_policy_map(net, {"blocks/7": "int8_from_float32"}, x)
    with pytest.raises(ValueError, match=r"lacks: \['nope'\]"):
        af.qwix_rules({"nope": "int8_from_float32"}, paths=af.tunable_modules(net))
    with pytest.raises(TypeError, match="Expected a flax.nnx.Module. Received: dict"):
        af.FlaxAdapter({"w": x}, (x,), [])
    with pytest.raises(ValueError, match=r"sample_input of shape .* does not fit the model, whose layers take"):
        af.FlaxAdapter(net, (jnp.ones((4, 5)),), [])


def test_a_model_holding_linen_is_refused(x):
    from flax import linen

    class Mixed(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(16, 4, rngs=rngs)
            self.legacy = linen.Dense(4)

        def __call__(self, inputs):
            return self.dense(inputs)

    with pytest.raises(TypeError, match="Linen module at 'legacy' \\(Dense\\)"):
        af.FlaxAdapter(Mixed(nnx.Rngs(0)), (x,), [])


@pytest.mark.slow  # 10 s on a fresh run on 2 cores (compiling the tune's models)
def test_tune_an_nnx_model_end_to_end(net, x):
    reference = net(x)
    result = search.tune(net, eval_fn=lambda m: -float(jnp.mean((m(x).astype(jnp.float32) - reference) ** 2)),
                         sample_input=x, max_drop=0.01, repeats=3, progress=False)
    assert set(dict(result.policy_map.items())) <= {"b_first", "norm", "blocks/0", "a_second"}
    tuned = af.apply_policy_map(net, result.policy_map, x)
    assert tuned(x).shape == reference.shape


def test_autopolicy_flax_is_a_lazy_attribute():
    assert ap.flax.qwix_rules is af.qwix_rules


def test_save_and_restore_from_a_build_function(net, x, tmp_path):
    mapping = {"b_first": "int8_from_float32", "blocks/0": "int4/16_from_float32", "a_second": "mixed_bfloat16"}
    tuned = af.apply_policy_map(net, mapping, x)
    ap.flax.save(tuned, tmp_path / "tuned", mapping)
    assert sorted(p.name for p in (tmp_path / "tuned").iterdir()) == ["policy_map.json", "qwix_rules.json", "state"]
    restored = ap.flax.load(tmp_path / "tuned", lambda: Net(nnx.Rngs(7)), x)  # other weights until restored
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(tuned(x)))
    assert restored.a_second.dtype == jnp.bfloat16
    assert ap.load_policy_map(tmp_path / "tuned" / "policy_map.json") == policies.DTypePolicyMap("float32", mapping)
    with pytest.raises(FileNotFoundError, match="holds no saved NNX model: 'state' is missing"):
        ap.flax.load(tmp_path, lambda: Net(nnx.Rngs(7)), x)
