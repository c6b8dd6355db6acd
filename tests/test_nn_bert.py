"""BERT-style encoder layers: the padding mask through attention, pre- and post-norm blocks,
BERT embeddings, masked mean pooling, L2 normalization and the two GELUs, each against an
independent float64 NumPy reference (tests/bert_reference.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
import bert_reference as ref
from helpers import gaussian

DIM, HEADS, MLP = 16, 4, 32


def randomized(model, seed=0, scale=0.2):
    """Biases and LayerNorm parameters drawn anew (so none is 0 or 1); kernels as initialized."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path).rsplit(".", 1)[-1]
        offset = {"gamma": 1.0, "bias": 0.0, "beta": 0.0}.get(name)
        if offset is None:
            return x
        return jnp.asarray(offset + scale * rng.standard_normal(np.shape(x)), jnp.float32)

    return jax.tree_util.tree_unflatten(treedef, [draw(p, x) for p, x in leaves])


def block_params(block):
    """The block's weights as the reference's plain ``[in, out]`` matrices, in float64."""
    a = lambda x: np.asarray(x, np.float64)  # noqa: E731
    att = block.attention
    p = {}
    for ours, dense in (("q", att.query_dense), ("k", att.key_dense), ("v", att.value_dense)):
        p["w" + ours] = a(dense.kernel).reshape(DIM, DIM)
        p["b" + ours] = a(dense.bias).reshape(DIM)
    p["wo"], p["bo"] = a(att.output_dense.kernel).reshape(DIM, DIM), a(att.output_dense.bias)
    p["w1"], p["c1"] = a(block.mlp[0].kernel), a(block.mlp[0].bias)
    p["w2"], p["c2"] = a(block.mlp[1].kernel), a(block.mlp[1].bias)
    p["g1"], p["b1"] = a(block.norm1.gamma), a(block.norm1.beta)
    p["g2"], p["b2"] = a(block.norm2.gamma), a(block.norm2.beta)
    return p


def make_block(norm_first, epsilon=1e-12, activation="gelu", seed=0):
    block = nn.TransformerBlock(DIM, HEADS, MLP, norm_first=norm_first, norm_epsilon=epsilon,
                                activation=activation, name="block")
    block = block.build(jax.random.key(0), jnp.ones((2, 8, DIM)), mask=jnp.ones((2, 8), jnp.int32))
    return randomized(block, seed)


MASK = np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation,reference", [("gelu", ref.gelu), ("gelu_tanh", ref.gelu_tanh)])
def test_block_matches_float64_reference(norm_first, activation, reference):
    block = make_block(norm_first, activation=activation)
    x = gaussian((2, 8, DIM), seed=3)
    got = np.asarray(block(jnp.asarray(x), mask=jnp.asarray(MASK)), np.float64)
    want = ref.block(x.astype(np.float64), block_params(block), HEADS, norm_first, 1e-12, MASK, reference)
    assert got.shape == (2, 8, DIM)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pre_and_post_norm_differ():
    pre, post = make_block(True), make_block(False)
    x = jnp.asarray(gaussian((2, 8, DIM), seed=3))
    # Same weights, different placement of the norms: post-norm outputs are normalized rows.
    y = np.asarray(post(x), np.float64)
    assert float(np.max(np.abs(np.asarray(pre(x)) - y))) > 0.1
    gamma, beta = np.asarray(post.norm2.gamma, np.float64), np.asarray(post.norm2.beta, np.float64)
    np.testing.assert_allclose(((y - beta) / gamma).mean(-1), 0.0, atol=1e-5)


@pytest.mark.parametrize("norm_first", [True, False])
def test_padding_does_not_change_the_real_tokens(norm_first):
    block = make_block(norm_first)
    x = gaussian((2, 8, DIM), seed=4)
    x[0, 5:] = 50.0 * gaussian((3, DIM), seed=5)  # loud padding: it must not leak into real tokens
    padded = np.asarray(block(jnp.asarray(x), mask=jnp.asarray(MASK)))
    alone = np.asarray(block(jnp.asarray(x[:1, :5])))
    np.testing.assert_allclose(padded[0, :5], alone[0], rtol=0, atol=1e-6)
    as_bool = np.asarray(block(jnp.asarray(x), mask=jnp.asarray(MASK, bool)))
    np.testing.assert_array_equal(as_bool, padded)
    unmasked = np.asarray(block(jnp.asarray(x)))
    assert float(np.max(np.abs(unmasked[0, :5] - alone[0]))) > 1e-2  # the mask did something


def test_causal_and_padding_masks_combine():
    x = gaussian((2, 5, 8), seed=1)
    q = jnp.asarray(x.reshape(2, 5, 2, 4))  # query = key = value: self-attention, 2 heads of 4
    att = nn.DotProductAttention().build(jax.random.key(0), q, q, q)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = att(q, q, q, attention_mask=nn.causal_mask(2, 5), mask=jnp.asarray(mask))
    params = {"wq": np.eye(8), "wk": np.eye(8), "wv": np.eye(8), "wo": np.eye(8)}
    params.update({"b" + n: np.zeros(8) for n in "qkvo"})
    # With identity projections the reference's attention is this layer's product alone.
    want = ref.attention(x.astype(np.float64), params, 2, mask, causal=True)
    # Queries 3 and 4 of row 0 see only keys 0-2 (padding) even though causally allowed more.
    np.testing.assert_allclose(np.asarray(got).reshape(2, 5, 8), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_masked_keys_get_zero_weight_in_16_bit(policy):
    q = jnp.asarray(gaussian((1, 4, 2, 4), seed=1))
    k = np.asarray(gaussian((1, 6, 2, 4), seed=2))
    k[0, 4:] = 1e4  # would dominate (and overflow float16 logits) if not masked in float32
    v = np.asarray(gaussian((1, 6, 2, 4), seed=3))
    att = nn.DotProductAttention(dtype=policy).build(jax.random.key(0), q, q, q)
    mask = jnp.asarray([[1, 1, 1, 1, 0, 0]])
    got = att(q, jnp.asarray(k), jnp.asarray(v), mask=mask)
    alone = att(q, jnp.asarray(k[:, :4]), jnp.asarray(v[:, :4]))
    assert got.dtype == jnp.dtype(policy.split("_")[1])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))


def test_mask_of_the_wrong_shape_is_refused():
    block = make_block(True)
    with pytest.raises(ValueError, match=r"mask must have shape \(batch, key_time\) = \(2, 8\).*\(2, 7\)"):
        block(jnp.ones((2, 8, DIM)), mask=jnp.ones((2, 7), jnp.int32))


def test_block_arguments_are_validated():
    with pytest.raises(TypeError, match=r"norm_first must be a bool. Received: norm_first='post'"):
        nn.TransformerBlock(DIM, HEADS, MLP, norm_first="post")
    with pytest.raises(ValueError, match=r"epsilon must be a number > 0. Received: epsilon=0"):
        nn.TransformerBlock(DIM, HEADS, MLP, norm_epsilon=0)


def test_post_norm_block_saves_and_loads(tmp_path):
    block = make_block(False, epsilon=1e-12)
    x = jnp.asarray(gaussian((2, 8, DIM), seed=6))
    nn.save(block, tmp_path / "block")
    loaded = nn.load(tmp_path / "block")
    assert loaded.norm_first is False and loaded.norm1.epsilon == 1e-12
    np.testing.assert_array_equal(np.asarray(loaded(x, mask=jnp.asarray(MASK))),
                                  np.asarray(block(x, mask=jnp.asarray(MASK))))


def test_bert_embeddings_match_the_reference():
    emb = nn.BertEmbeddings(50, DIM, max_length=12, type_vocab_size=2, epsilon=1e-12, name="embeddings")
    emb = randomized(emb.build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)), seed=2)
    ids = np.array([[5, 9, 49, 0, 3, 3], [1, 2, 3, 4, 5, 6]], np.int32)
    types = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1]], np.int32)
    weights = {"embeddings.word_embeddings.weight": emb.word_embeddings.kernel,
               "embeddings.position_embeddings.weight": emb.position_embeddings.kernel,
               "embeddings.token_type_embeddings.weight": emb.token_type_embeddings.kernel,
               "embeddings.LayerNorm.weight": emb.norm.gamma, "embeddings.LayerNorm.bias": emb.norm.beta}
    got = np.asarray(emb(jnp.asarray(ids), token_type_ids=jnp.asarray(types)))
    np.testing.assert_allclose(got, ref.bert_embeddings(weights, ids, 1e-12, types), rtol=1e-5, atol=1e-5)
    default = np.asarray(emb(jnp.asarray(ids)))
    np.testing.assert_allclose(default, ref.bert_embeddings(weights, ids, 1e-12), rtol=1e-5, atol=1e-5)


def test_bert_embeddings_refuse_bad_inputs():
    emb = nn.BertEmbeddings(50, DIM, max_length=6, name="embeddings")
    emb = emb.build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"time <= max_length=6. Received shape \(1, 7\)"):
        emb(jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"token_type_ids must have the ids' shape \(1, 4\). Received shape \(1, 3\)"):
        emb(jnp.zeros((1, 4), jnp.int32), token_type_ids=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"type_vocab_size must be an int >= 0. Received: type_vocab_size=-1"):
        nn.BertEmbeddings(50, DIM, type_vocab_size=-1)
    plain = nn.BertEmbeddings(50, DIM, type_vocab_size=0, name="plain")
    plain = plain.build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    assert [p.split("/")[1] for p in plain.layers_by_path()] == ["word_embeddings", "position_embeddings", "norm", "dropout"]
    with pytest.raises(ValueError, match="type_vocab_size=0 and takes no token_type_ids"):
        plain(jnp.zeros((1, 4), jnp.int32), token_type_ids=jnp.zeros((1, 4), jnp.int32))


def test_masked_mean_pooling_matches_sentence_transformers():
    x = gaussian((2, 5, DIM), seed=7)
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    pool = nn.GlobalAveragePooling1D().build(jax.random.key(0), jnp.asarray(x), jnp.asarray(mask))
    got = np.asarray(pool(jnp.asarray(x), jnp.asarray(mask)), np.float64)
    np.testing.assert_allclose(got[0], x[0, :2].astype(np.float64).mean(0), rtol=1e-6, atol=1e-7)
    unit = nn.UnitNormalization().build(jax.random.key(0), jnp.asarray(got, jnp.float32))
    np.testing.assert_allclose(np.asarray(unit(jnp.asarray(got, jnp.float32))),
                               ref.mean_pool_normalize(x.astype(np.float64), mask), rtol=1e-6, atol=1e-7)


def test_unit_normalization_in_float32_inside():
    unit = nn.UnitNormalization(dtype="mixed_float16").build(jax.random.key(0), jnp.ones((2, 3)))
    x = jnp.asarray([[300.0, 400.0, 0.0], [0.0, 0.0, 0.0]], jnp.float16)  # 300**2 overflows float16
    y = unit(x)
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray([[0.6, 0.8, 0.0], [0.0, 0.0, 0.0]], np.float16))
    with pytest.raises(ValueError, match=r"epsilon must be a number > 0. Received: epsilon=-1"):
        nn.UnitNormalization(epsilon=-1)


@pytest.mark.parametrize("name,reference", [("gelu", ref.gelu), ("gelu_tanh", ref.gelu_tanh),
                                            ("gelu_approximate", ref.gelu_tanh)])
def test_gelu_activations(name, reference):
    x = np.linspace(-5.0, 5.0, 101)
    got = np.asarray(nn.activations.get(name)(jnp.asarray(x, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, reference(x), rtol=1e-6, atol=1e-6)  # float32 cancels in 1 + tanh
    # The two differ by up to ~5e-4 (near |x| = 2): each must match its own formula.
    other = ref.gelu_tanh if reference is ref.gelu else ref.gelu
    assert np.max(np.abs(got - other(x))) > 1e-4


@pytest.mark.parametrize("policy", ["int8_from_float32", "int4/8_from_float32"])
def test_self_attentions_projections_share_one_kernel_call_with_the_same_outputs(policy, monkeypatch):
    """Self-attention's query, key and value (with their biases) on one FFI kernel are one grouped
    call (AUTOPOLICY_GROUPED_PROJECTIONS=0: one each), with equal outputs bit for bit."""
    from autopolicy.numerics import cpu_kernels  # pylint: disable=import-outside-toplevel

    if not cpu_kernels.AVAILABLE or jax.default_backend() != "cpu":
        pytest.skip("needs the CPU kernels and a CPU backend")
    block = make_block(norm_first=True).with_dtype_policy(policy)
    block = block.with_kernels({p: "cpu_ffi" for p, layer in block.layers_by_path().items()
                                if layer.quantization_mode is not None})
    x = jnp.asarray(gaussian((2, 8, DIM), seed=4))
    outputs, programs = {}, {}
    for env in ("1", "0"):
        monkeypatch.setenv("AUTOPOLICY_GROUPED_PROJECTIONS", env)
        fn = jax.jit(lambda b, a: b(a, mask=MASK))  # traced afresh: the variable is read then
        programs[env] = fn.lower(block, x).as_text()
        outputs[env] = np.asarray(fn(block, x))
    mode = policy[:4]
    # (Several devices: the layers' own calls, as the FFI kernels are offered on one device only.)
    assert programs["1"].count(f"custom_call @autopolicy_{mode}_dense_group") == (jax.device_count() == 1)
    assert "dense_group" not in programs["0"]
    assert np.abs(outputs["1"]).max() > 0
    np.testing.assert_array_equal(outputs["1"], outputs["0"])
