"""BERT: its embeddings (word + position + token type, then LayerNorm) as a composable layer, and
the mapping that reads Hugging Face BERT checkpoints into them and post-norm TransformerBlocks."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from autopolicy.nn._module import Module
from autopolicy.nn.core import Dropout, GlobalAveragePooling1D
from autopolicy.nn.embedding import Embedding
from autopolicy.nn.normalization import LayerNormalization, UnitNormalization
from autopolicy.nn.transformer import TransformerBlock
from autopolicy.nn.weights import Rule

__all__ = ["BertEmbeddings", "SentenceEncoder", "bert_mapping"]


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}. Received: {name}={value!r}")
    return value


class BertEmbeddings(Module):
    """``dropout(norm(word[ids] + position[0..T) + token_type[token_type_ids]))``, as BERT.

    Args:
      vocab_size: Rows of the word table.
      dim: Embedding (model) width.
      max_length: Rows of the position table: the longest sequence it takes.
      type_vocab_size: Rows of the token-type (segment) table; 0 for none.
      epsilon: The LayerNormalization's epsilon (BERT: 1e-12).
      dropout: Dropout on the output while training.
      embeddings_initializer: For the three tables (imported weights usually replace them).

    Call as ``embeddings(ids, token_type_ids=None)`` with ``(batch, time)`` integer ids;
    missing token types are 0 (one segment). Sublayers: ``word_embeddings``,
    ``position_embeddings``, ``token_type_embeddings`` (Embedding, each tunable on its own),
    ``norm`` (LayerNormalization) and ``dropout``; the sum runs in this layer's compute dtype.

    Raises:
      ValueError: for a non-positive size, or (when called) a sequence longer than
        ``max_length`` or token types of another shape than the ids.

    >>> import autopolicy.nn as nn
    >>> emb = nn.BertEmbeddings(100, 8, max_length=16, name="embeddings")
    >>> emb = emb.build(jax.random.key(0), jnp.zeros((1, 5), jnp.int32))
    >>> emb(jnp.array([[2, 7, 9]]), token_type_ids=jnp.array([[0, 0, 1]])).shape
    (1, 3, 8)
    >>> list(emb.layers_by_path())
    ['embeddings/word_embeddings', 'embeddings/position_embeddings', 'embeddings/token_type_embeddings', 'embeddings/norm', 'embeddings/dropout']
    """

    def __init__(self, vocab_size: int, dim: int, max_length: int = 512, type_vocab_size: int = 2,
                 epsilon: float = 1e-12, dropout: float = 0.0, embeddings_initializer: Any = "random_normal",
                 *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        _positive_int("vocab_size", vocab_size)
        _positive_int("dim", dim)
        self.max_length = _positive_int("max_length", max_length)
        self.type_vocab_size = _positive_int("type_vocab_size", type_vocab_size, minimum=0)
        self.word_embeddings = Embedding(vocab_size, dim, embeddings_initializer)
        self.position_embeddings = Embedding(max_length, dim, embeddings_initializer)
        self.token_type_embeddings = (
            Embedding(type_vocab_size, dim, embeddings_initializer) if type_vocab_size else None
        )
        self.norm = LayerNormalization(epsilon)
        self.dropout = Dropout(dropout)

    def call(self, ids: jax.Array, token_type_ids: jax.Array | None = None) -> jax.Array:
        ids = jnp.asarray(ids)
        if ids.ndim != 2 or ids.shape[1] > self.max_length:
            raise ValueError(
                f"{self.path!r} takes (batch, time) ids with time <= max_length={self.max_length}. "
                f"Received shape {ids.shape}"
            )
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        x = self.cast(self.word_embeddings(ids)) + self.cast(self.position_embeddings(positions))
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = jnp.zeros(ids.shape, jnp.int32)
            elif jnp.shape(token_type_ids) != ids.shape:
                raise ValueError(
                    f"{self.path!r}: token_type_ids must have the ids' shape {ids.shape}. "
                    f"Received shape {jnp.shape(token_type_ids)}"
                )
            x = x + self.cast(self.token_type_embeddings(token_type_ids))
        elif token_type_ids is not None:
            raise ValueError(f"{self.path!r} has type_vocab_size=0 and takes no token_type_ids.")
        return self.dropout(self.cast(self.norm(x)))


_PREFIX = r"(?:bert\.)?"  # BertModel checkpoints have none, BertFor... ones have "bert."
_NORM = ((r"(?:weight|gamma)", "gamma"), (r"(?:bias|beta)", "beta"))


def _block_rules(source: str, target: str) -> list[Rule]:
    """Rules for one encoder layer: ``source`` is its name prefix (a regex), ``target`` its path."""
    rules = [
        Rule(source + r"attention\.self\.(?P<proj>query|key|value)\.weight",
             target + r"/attention/\g<proj>/kernel", ("transpose", "reshape")),
        Rule(source + r"attention\.self\.(?P<proj>query|key|value)\.bias",
             target + r"/attention/\g<proj>/bias", "reshape"),
        Rule(source + r"attention\.output\.dense\.weight", target + "/attention/attention_output/kernel",
             ("transpose", "reshape")),
        Rule(source + r"attention\.output\.dense\.bias", target + "/attention/attention_output/bias"),
        Rule(source + r"intermediate\.dense\.weight", target + "/mlp/dense/kernel", "transpose"),
        Rule(source + r"intermediate\.dense\.bias", target + "/mlp/dense/bias"),
        Rule(source + r"output\.dense\.weight", target + "/mlp/dense_1/kernel", "transpose"),
        Rule(source + r"output\.dense\.bias", target + "/mlp/dense_1/bias"),
    ]
    for norm, name in ((r"attention\.output\.LayerNorm\.", "norm1"), (r"output\.LayerNorm\.", "norm2")):
        rules += [Rule(source + norm + foreign, f"{target}/{name}/{ours}") for foreign, ours in _NORM]
    return rules


def _check_path(argument: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value.startswith("/") or value.endswith("/"):
        raise ValueError(f"{argument} must be a layer path such as 'encoder/embeddings'. Received: {argument}={value!r}")
    return value


class SentenceEncoder(Module):
    """A BERT sentence encoder (as sentence-transformers' all-MiniLM-L6-v2): BERT embeddings,
    post-norm blocks with a padding mask, masked mean pooling and an L2 norm.

    Call as ``encoder(ids, mask)`` with ``(batch, time)`` token ids and a mask that is 1 for real
    tokens; returns ``(batch, dim)`` unit vectors. A library class, so that a saved encoder (a
    tuned one in a run directory) loads in any process.

    >>> import autopolicy.nn as nn
    >>> ids, mask = jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32)
    >>> encoder = nn.SentenceEncoder(50, 8, 2, 16, blocks=1, max_length=8).build(jax.random.key(0), ids, mask)
    >>> encoder(ids, mask).shape
    (2, 8)
    """

    def __init__(self, vocab_size: int = 30522, dim: int = 384, heads: int = 12, mlp: int = 1536, blocks: int = 6,
                 max_length: int = 512, type_vocab_size: int = 2, epsilon: float = 1e-12, activation: str = "gelu",
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.embeddings = BertEmbeddings(vocab_size, dim, max_length, type_vocab_size, epsilon)
        self.blocks = [TransformerBlock(dim, heads, mlp, norm_first=False, norm_epsilon=epsilon,
                                        activation=activation, name=f"block_{i}") for i in range(blocks)]
        self.pooling = GlobalAveragePooling1D()
        self.normalize = UnitNormalization()

    def call(self, ids: Any, mask: Any) -> Any:
        x = self.embeddings(ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.normalize(self.pooling(x, mask))


def bert_mapping(embeddings: str, blocks: str | Sequence[str], pooler: str | None = None) -> tuple[Rule, ...]:
    """Rules for :func:`~autopolicy.nn.load_weights` that read a Hugging Face BERT checkpoint.

    They map ``[bert.]embeddings.*`` to a :class:`BertEmbeddings` and
    ``[bert.]encoder.layer.<i>.*`` to post-norm :class:`~autopolicy.nn.TransformerBlock` s:
    query/key/value and the attention output (PyTorch ``[out, in]`` weights transposed and split
    into heads), the intermediate and output dense layers (the block's ``mlp``), and the
    LayerNorms (``weight``/``bias`` or the older ``gamma``/``beta``). ``position_ids`` buffers
    and the pre-training heads (``cls.*``) are skipped, and so is the pooler unless ``pooler``
    names a Dense layer for it. Tensors of layers beyond ``blocks`` are reported as unexpected.

    Args:
      embeddings: The path of the :class:`BertEmbeddings` (``"encoder/embeddings"``).
      blocks: The blocks' paths in order, or one path with ``{}`` for the layer index
        (``"encoder/block_{}"``).
      pooler: The path of a ``Dense`` for ``pooler.dense``, or None to skip it.

    Returns:
      A tuple of :class:`~autopolicy.nn.weights.Rule`; add your own rules to it.

    >>> rules = bert_mapping("bert/embeddings", "bert/block_{}")
    >>> len(rules), rules[0].replacement
    (20, 'bert/embeddings/word_embeddings/kernel')
    """
    embeddings = _check_path("embeddings", embeddings)
    if isinstance(blocks, str):
        if blocks.count("{}") != 1:
            raise ValueError(
                "blocks must be a sequence of block paths or one path with a single '{}' for the "
                f"layer index, e.g. 'encoder/block_{{}}'. Received: blocks={blocks!r}"
            )
        _check_path("blocks", blocks)
        targets = [(r"(?P<i>\d+)", blocks.replace("{}", r"\g<i>"))]
    elif isinstance(blocks, (list, tuple)) and blocks:
        targets = [(str(i), _check_path("blocks", path)) for i, path in enumerate(blocks)]
    else:
        raise ValueError(f"blocks must be a non-empty sequence of paths or a str with '{{}}'. Received: blocks={blocks!r}")
    source = _PREFIX + r"embeddings\."
    rules = [Rule(source + rf"{table}_embeddings\.weight", f"{embeddings}/{table}_embeddings/kernel")
             for table in ("word", "position", "token_type")]
    rules += [Rule(source + r"LayerNorm\." + foreign, f"{embeddings}/norm/{ours}") for foreign, ours in _NORM]
    rules.append(Rule(source + r"position_ids", None))
    for index, path in targets:
        rules += _block_rules(_PREFIX + rf"encoder\.layer\.{index}\.", path)
    if pooler is None:
        rules.append(Rule(_PREFIX + r"pooler\..*", None))
    else:
        pooler = _check_path("pooler", pooler)
        rules += [Rule(_PREFIX + r"pooler\.dense\.weight", f"{pooler}/kernel", "transpose"),
                  Rule(_PREFIX + r"pooler\.dense\.bias", f"{pooler}/bias")]
    rules.append(Rule(r"cls\..*", None))
    return tuple(rules)
