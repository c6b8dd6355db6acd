"""Weight import (autopolicy.nn.load_weights): names by layer path, mappings for foreign names,
every missing, unexpected, mis-shaped and duplicated tensor named, and the Hugging Face BERT
mapping checked end to end against the float64 NumPy BERT."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
import bert_reference as ref
from helpers import gaussian


def mlp():
    model = nn.Sequential([nn.Dense(5, activation="relu"), nn.Dense(3)], name="mlp")
    return model.build(jax.random.key(0), jnp.ones((1, 4)))


def arrays_of(model, seed=1):
    """Random arrays (not the model's own) for every weight of ``model``."""
    return {name: gaussian(shape, seed=seed + i) for i, (name, shape) in enumerate(nn.weight_names(model).items())}


def test_weight_names_are_layer_paths():
    assert nn.weight_names(mlp()) == {
        "mlp/dense/kernel": (4, 5), "mlp/dense/bias": (5,), "mlp/dense_1/kernel": (5, 3), "mlp/dense_1/bias": (3,),
    }


def test_load_by_path_returns_a_new_model():
    model = mlp()
    source = arrays_of(model)
    loaded, report = nn.load_weights(model, source)
    assert report.ok and report.loaded == tuple(source) and report.skipped == ()
    np.testing.assert_array_equal(np.asarray(loaded.layers[1].kernel), source["mlp/dense_1/kernel"])
    assert not np.array_equal(np.asarray(model.layers[1].kernel), source["mlp/dense_1/kernel"])  # untouched
    x = gaussian((2, 4), seed=9)
    want = np.maximum(x @ source["mlp/dense/kernel"] + source["mlp/dense/bias"], 0)
    want = want @ source["mlp/dense_1/kernel"] + source["mlp/dense_1/bias"]
    np.testing.assert_allclose(np.asarray(loaded(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def test_every_problem_is_named_in_one_error():
    model = mlp()
    source = arrays_of(model)
    del source["mlp/dense/bias"]
    source["mlp/dense_1/kernel"] = gaussian((3, 5))
    source["mlp/dense_2/kernel"] = gaussian((2, 2))
    with pytest.raises(ValueError) as info:
        nn.load_weights(model, source)
    message = str(info.value)
    assert "missing (weights of the model that no tensor fills): ['mlp/dense/bias']" in message
    assert "unexpected: 'mlp/dense_2/kernel' -> 'mlp/dense_2/kernel' is not a weight of the model" in message
    assert ("mis-shaped: 'mlp/dense_1/kernel' -> 'mlp/dense_1/kernel': source shape (3, 5), "
            "model shape (5, 3)") in message
    assert "strict=False" in message


def test_not_strict_loads_what_fits_and_reports_the_rest():
    model = mlp()
    source = arrays_of(model)
    del source["mlp/dense/bias"]
    source["mlp/dense_1/kernel"] = gaussian((3, 5))
    loaded, report = nn.load_weights(model, source, strict=False)
    assert not report.ok
    assert report.loaded == ("mlp/dense/kernel", "mlp/dense_1/bias")
    assert report.missing == ("mlp/dense/bias",)
    assert report.mismatched == (("mlp/dense_1/kernel", "mlp/dense_1/kernel", (3, 5), (5, 3)),)
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].kernel), source["mlp/dense/kernel"])
    np.testing.assert_array_equal(np.asarray(loaded.layers[1].kernel), np.asarray(model.layers[1].kernel))


def test_two_tensors_for_one_weight_are_refused():
    model = mlp()
    source = arrays_of(model)
    source["copy"] = source["mlp/dense/bias"] + 1
    with pytest.raises(ValueError, match=re.escape("duplicated: 'mlp/dense/bias' is given by several tensors "
                                                   "['mlp/dense/bias', 'copy']")):
        nn.load_weights(model, source, {"copy": "mlp/dense/bias"})


def torch_names(model, source):
    """``source`` as a PyTorch-style state dict: ``0.weight`` ``[out, in]``, ``0.bias``."""
    out = {}
    for i, layer in enumerate(("dense", "dense_1")):
        out[f"{i}.weight"] = source[f"mlp/{layer}/kernel"].T.copy()
        out[f"{i}.bias"] = source[f"mlp/{layer}/bias"]
    return out


@pytest.mark.parametrize("form", ["rules", "dict", "callable"])
def test_mappings_translate_and_transpose(form):
    model = mlp()
    source = arrays_of(model)
    torch = torch_names(model, source)
    layer = lambda i: "dense" if i == "0" else "dense_1"  # noqa: E731
    if form == "rules":  # the first rule that matches wins; a Rule or a tuple
        mapping = [(r"0\.weight", "mlp/dense/kernel", "transpose"), nn.weights.Rule(r"0\.bias", "mlp/dense/bias"),
                   (r"(\d)\.weight", r"mlp/dense_\1/kernel", "transpose"), (r"(\d)\.bias", r"mlp/dense_\1/bias")]
    elif form == "dict":
        mapping = {f"{i}.{v}": (f"mlp/{layer(i)}/{'kernel' if v == 'weight' else 'bias'}",
                                "transpose" if v == "weight" else ())
                   for i in "01" for v in ("weight", "bias")}
    else:
        def mapping(name):
            i, v = name.split(".")
            return (f"mlp/{layer(i)}/kernel", ("transpose",)) if v == "weight" else f"mlp/{layer(i)}/bias"
    loaded, report = nn.load_weights(model, torch, mapping)
    assert report.ok and len(report.loaded) == 4
    for name, value in source.items():
        path, attr = name.rsplit("/", 1)
        np.testing.assert_array_equal(np.asarray(getattr(loaded.modules()[path], attr)), value)


def test_rules_are_hashable_static_configuration():
    rule = nn.weights.Rule(r"q\.weight", "query/kernel", ["transpose", "reshape"])
    assert rule.transform == ("transpose", "reshape")
    assert hash(rule) == hash(nn.weights.Rule(r"q\.weight", "query/kernel", ("transpose", "reshape")))
    rules = nn.bert_mapping("bert/embeddings", "bert/block_{}")
    assert jax.jit(lambda x, rules: x * len(rules), static_argnums=1)(jnp.float32(1), rules) == 20.0


def test_rules_skip_with_none_and_keep_unmatched_names():
    model = mlp()
    source = {**arrays_of(model), "buffers.position_ids": np.arange(4)}
    loaded, report = nn.load_weights(model, source, [(r"buffers\..*", None)])
    assert report.ok and report.skipped == ("buffers.position_ids",)


def test_reshape_splits_heads_and_refuses_another_size():
    layer = nn.EinsumDense("abc,cde->abde", (None, 2, 3), bias_axes="de", name="query")
    layer = layer.build(jax.random.key(0), jnp.ones((1, 2, 4)))
    weight = gaussian((6, 4))  # torch Linear [heads * head_dim, in]
    rules = [(r"q\.weight", "query/kernel", ("transpose", "reshape")), (r"q\.bias", "query/bias", "reshape")]
    loaded, _ = nn.load_weights(layer, {"q.weight": weight, "q.bias": gaussian((6,))}, rules)
    np.testing.assert_array_equal(np.asarray(loaded.kernel), weight.T.reshape(4, 2, 3))
    with pytest.raises(ValueError, match=re.escape("mis-shaped: 'q.weight' -> 'query/kernel': source shape "
                                                   "(8, 4), model shape (4, 2, 3)")):
        nn.load_weights(layer, {"q.weight": gaussian((8, 4)), "q.bias": gaussian((6,))}, rules)


def test_bad_mappings_and_sources_are_refused(tmp_path):
    model = mlp()
    with pytest.raises(ValueError, match=re.escape("Unknown transform. Expected one of ('transpose', 'reshape')")):
        nn.load_weights(model, arrays_of(model), [(r"x", "y", "flip")])
    with pytest.raises(ValueError, match="is not a regular expression"):
        nn.load_weights(model, arrays_of(model), [(r"(", "y")])
    with pytest.raises(TypeError, match="mapping must be None, a callable"):
        nn.load_weights(model, arrays_of(model), 42)
    with pytest.raises(TypeError, match=r"The mapping turned 'mlp/dense/kernel' into 7; expected None, a name"):
        nn.load_weights(model, arrays_of(model), lambda name: 7)
    with pytest.raises(TypeError, match="source must be a dict of arrays or a .safetensors file path. Received: list"):
        nn.load_weights(model, [1, 2])
    with pytest.raises(ValueError, match=r"must be a .safetensors file. Received: '.*weights.npz'"):
        nn.load_weights(model, str(tmp_path / "weights.npz"))
    with pytest.raises(FileNotFoundError, match="No weights file at"):
        nn.load_weights(model, tmp_path / "absent.safetensors")


def test_quantized_models_are_refused():
    model = mlp().with_dtype_policy("int8_from_float32")
    with pytest.raises(ValueError, match=r"\['mlp/dense', 'mlp/dense_1'\] hold quantized weights: load into the float model"):
        nn.load_weights(model, {})


def test_arrays_take_the_variable_dtype():
    model = nn.Dense(2, dtype="bfloat16", name="d").build(jax.random.key(0), jnp.ones((1, 3), jnp.bfloat16))
    loaded, _ = nn.load_weights(model, {"d/kernel": np.full((3, 2), 0.5), "d/bias": np.array([1.0, -2.0])})
    assert loaded.kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded.bias, np.float32), [1.0, -2.0])


def test_safetensors_file(tmp_path):
    from safetensors.numpy import save_file

    model = mlp()
    source = arrays_of(model)
    save_file(source, str(tmp_path / "model.safetensors"))
    loaded, report = nn.load_weights(model, tmp_path / "model.safetensors")
    assert report.ok
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].bias), source["mlp/dense/bias"])


# --- the Hugging Face BERT mapping on a tiny synthetic checkpoint -------------------------------

VOCAB, DIM, HEADS, FF, LAYERS, EPS = 40, 12, 3, 20, 2, 1e-12


class TinyBert(nn.Module):
    def __init__(self, layers=LAYERS, **kwargs):
        super().__init__(**kwargs)
        self.embeddings = nn.BertEmbeddings(VOCAB, DIM, max_length=16, epsilon=EPS)
        self.blocks = [nn.TransformerBlock(DIM, HEADS, FF, norm_first=False, norm_epsilon=EPS) for _ in range(layers)]
        self.pooler = nn.Dense(DIM, activation="tanh")

    def call(self, ids, mask):
        x = self.embeddings(ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return x, self.pooler(x[:, 0])


def hf_checkpoint(layers=LAYERS, prefix="bert.", old_norm_names=False, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    g, b = ("gamma", "beta") if old_norm_names else ("weight", "bias")
    w = {"embeddings.word_embeddings.weight": r(VOCAB, DIM), "embeddings.position_embeddings.weight": r(16, DIM),
         "embeddings.token_type_embeddings.weight": r(2, DIM), f"embeddings.LayerNorm.{g}": 1 + r(DIM),
         f"embeddings.LayerNorm.{b}": r(DIM), "embeddings.position_ids": np.arange(16)[None],
         "pooler.dense.weight": r(DIM, DIM), "pooler.dense.bias": r(DIM)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name, shape in (("attention.self.query", (DIM, DIM)), ("attention.self.key", (DIM, DIM)),
                            ("attention.self.value", (DIM, DIM)), ("attention.output.dense", (DIM, DIM)),
                            ("intermediate.dense", (FF, DIM)), ("output.dense", (DIM, FF))):
            w[p + name + ".weight"], w[p + name + ".bias"] = r(*shape), r(shape[0])
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[f"{p}{name}.{g}"], w[f"{p}{name}.{b}"] = 1 + r(DIM), r(DIM)
    checkpoint = {prefix + k: v for k, v in w.items()}
    checkpoint["cls.predictions.bias"] = r(VOCAB)
    return checkpoint, w


def tiny_bert():
    ids = jnp.zeros((1, 6), jnp.int32)
    return TinyBert(name="bert").build(jax.random.key(0), ids, jnp.ones((1, 6), jnp.int32))


IDS = np.array([[2, 17, 39, 5, 8, 0, 0], [3, 4, 5, 6, 7, 8, 9]], np.int32)
MASK = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("prefix,old_norm_names", [("bert.", False), ("", True)])
def test_bert_mapping_matches_the_float64_reference(prefix, old_norm_names):
    model = tiny_bert()
    blocks = [block.path for block in model.blocks]  # auto-named: transformer_block, transformer_block_1
    checkpoint, plain = hf_checkpoint(prefix=prefix, old_norm_names=old_norm_names)
    if old_norm_names:
        plain = {re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k)): v for k, v in plain.items()}
    rules = nn.bert_mapping("bert/embeddings", blocks, pooler="bert/pooler")
    loaded, report = nn.load_weights(model, checkpoint, rules)
    assert report.ok and len(report.loaded) == len(nn.weight_names(model))
    assert set(report.skipped) == {prefix + "embeddings.position_ids", "cls.predictions.bias"}
    hidden, pooled = loaded(jnp.asarray(IDS), jnp.asarray(MASK))
    want = ref.bert(plain, IDS, MASK, HEADS, EPS, LAYERS)
    np.testing.assert_allclose(np.asarray(hidden, np.float64), want, rtol=1e-5, atol=1e-5)
    want_pooled = np.tanh(want[:, 0] @ plain["pooler.dense.weight"].T.astype(np.float64) + plain["pooler.dense.bias"])
    np.testing.assert_allclose(np.asarray(pooled, np.float64), want_pooled, rtol=1e-5, atol=1e-5)


def test_bert_mapping_with_a_block_format_and_extra_layers():
    class Named(TinyBert):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [nn.TransformerBlock(DIM, HEADS, FF, norm_first=False, norm_epsilon=EPS, name=f"layer_{i}")
                           for i in range(LAYERS)]

    model = Named(name="bert").build(jax.random.key(0), jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6), jnp.int32))
    checkpoint, _ = hf_checkpoint(layers=LAYERS + 1)
    rules = nn.bert_mapping("bert/embeddings", "bert/layer_{}")  # the pooler is skipped
    with pytest.raises(ValueError) as info:
        nn.load_weights(model, checkpoint, rules)
    message = str(info.value)
    assert "missing (weights of the model that no tensor fills): ['bert/pooler/kernel', 'bert/pooler/bias']" in message
    assert ("unexpected: 'bert.encoder.layer.2.attention.self.query.weight' -> "
            "'bert/layer_2/attention/query/kernel' is not a weight of the model") in message
    assert message.count("unexpected:") == 16  # every tensor of the extra layer


def test_bert_mapping_arguments_are_validated():
    with pytest.raises(ValueError, match=r"one path with a single '\{\}' for the layer index, e.g. 'encoder/block_\{\}'"):
        nn.bert_mapping("bert/embeddings", "bert/block")
    with pytest.raises(ValueError, match=r"embeddings must be a layer path such as 'encoder/embeddings'. Received: embeddings=''"):
        nn.bert_mapping("", "bert/block_{}")
    with pytest.raises(ValueError, match=r"blocks must be a non-empty sequence of paths"):
        nn.bert_mapping("bert/embeddings", [])
