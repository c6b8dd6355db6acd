"""Llama-family decoders: rotary embeddings, grouped-query attention with a key/value cache,
SwiGLU feed-forward, RMSNorm, and an input embedding tied to the output head.

Every projection is a :class:`~autopolicy.nn.Dense` or :class:`~autopolicy.nn.EinsumDense`, so
each takes its own policy (int8, int4, float8, ...). The key/value cache is not part of the model:
it is a tuple of ``(keys, values)`` per block, keys ``(batch, kv_heads, head_dim, max_length)`` and
values ``(batch, kv_heads, max_length, head_dim)``, passed in and returned, so one compiled decode
step serves every position.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn import _config
from autopolicy.nn._grouping import call_on_shared_input
from autopolicy.nn._module import Module
from autopolicy.nn.activations import accumulation_dtype
from autopolicy.nn.dense import Dense, EinsumDense
from autopolicy.nn.embedding import Embedding
from autopolicy.nn.normalization import RMSNormalization

__all__ = ["LlamaConfig", "LlamaAttention", "LlamaMLP", "LlamaBlock", "LlamaDecoder", "rotary"]


@_config.register_data
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a llama-family decoder.

    Attributes:
      vocab_size: Rows of the embedding table (and columns of the head).
      dim: Model width.
      blocks: Number of decoder blocks.
      heads: Query heads.
      kv_heads: Key/value heads (``heads`` must be a multiple: grouped-query attention).
      mlp_dim: Hidden width of the SwiGLU feed-forward.
      rope_base: The rotary embeddings' base (SmolLM2: 100000).
      norm_epsilon: The RMSNorms' epsilon.
      max_length: The longest context (positions) the model was trained for.

    >>> LlamaConfig(vocab_size=64, dim=16, blocks=1, heads=4, kv_heads=2, mlp_dim=32).head_dim
    4
    """

    vocab_size: int
    dim: int
    blocks: int
    heads: int
    kv_heads: int
    mlp_dim: int
    rope_base: float = 10000.0
    norm_epsilon: float = 1e-5
    max_length: int = 2048

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "blocks", "heads", "kv_heads", "mlp_dim", "max_length"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{field} must be a positive int. Received: {field}={value!r}")
        if self.dim % self.heads or self.heads % self.kv_heads or (self.dim // self.heads) % 2:
            raise ValueError(
                "LlamaConfig needs dim a multiple of heads, an even head size and heads a multiple of "
                f"kv_heads. Received: dim={self.dim}, heads={self.heads}, kv_heads={self.kv_heads}"
            )
        for field in ("rope_base", "norm_epsilon"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{field} must be a number > 0. Received: {field}={value!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @classmethod
    def of(cls, config: Any) -> "LlamaConfig":
        """``config`` itself, or the config made from a dict of its fields.

        Raises:
          TypeError: for anything else.
        """
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls(**config)
        raise TypeError(f"config must be a LlamaConfig or a dict of its fields. Received: {config!r}")


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary position embeddings in the "rotate half" layout (Hugging Face's): feature ``i`` of
    each head pairs with feature ``i + head_dim / 2``, rotated by ``position * base**(-2i/head_dim)``.

    Args:
      x: ``(batch, time, heads, head_dim)``.
      positions: ``(time,)`` integer positions.
      base: The frequency base.

    Returns:
      ``x`` rotated, computed in float32, in ``x``'s dtype.

    >>> x = jnp.ones((1, 2, 1, 2))
    >>> jnp.round(rotary(x, jnp.array([0, 1]), 10000.0)[0, :, 0], 6)  # position 1 turns (1, 1) by 1 radian
    Array([[ 1.      ,  1.      ],
           [-0.301169,  1.381773]], dtype=float32)
    """
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class LlamaAttention(Module):
    """Causal grouped-query attention with rotary embeddings and an optional key/value cache.

    Sublayers (each tunable): ``query``, ``key``, ``value`` (EinsumDense to heads, no bias) and
    ``attention_output``. Call as ``attention(x, start=None, cache=None)``:

    - without a cache, ``x`` (``(batch, time, dim)``) attends causally to itself from position 0;
    - with ``cache=(keys, values)`` (keys ``(batch, kv_heads, head_dim, max_length)``, values
      ``(batch, kv_heads, max_length, head_dim)``) and ``start`` (an
      int32 scalar), the keys and values of ``x`` are written at positions
      ``start .. start + time - 1`` and each query attends to every cached position up to its
      own: a prefill (``start=0``, the prompt) and a decode step (``time=1``) are the same call.
      Returns ``(output, (keys, values))``.

    The products run in the compute dtype; the logits and the softmax in float32.

    >>> att = LlamaAttention(heads=4, kv_heads=2, head_dim=4).build(jax.random.key(0), jnp.ones((1, 3, 16)))
    >>> att(jnp.ones((1, 3, 16))).shape
    (1, 3, 16)
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rope_base: float = 10000.0,
                 *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        for arg, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int. Received: {arg}={value!r}")
        if heads % kv_heads:
            raise ValueError(f"heads must be a multiple of kv_heads. Received: heads={heads}, kv_heads={kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope_base = float(rope_base)
        self.query = EinsumDense("abc,cde->abde", (None, heads, head_dim), name="query")
        self.key = EinsumDense("abc,cde->abde", (None, kv_heads, head_dim), name="key")
        self.value = EinsumDense("abc,cde->abde", (None, kv_heads, head_dim), name="value")
        self.attention_output = None

    def build_variables(self, x, start=None, cache=None) -> None:
        self.attention_output = EinsumDense("abcd,cde->abe", (None, x.shape[-1]), name="attention_output")

    def call(self, x: jax.Array, start: Any = None, cache: Any = None) -> Any:
        batch, time = x.shape[0], x.shape[1]
        offset = jnp.zeros((), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        positions = offset + jnp.arange(time, dtype=jnp.int32)
        # One call of the CPU kernels where the three projections' policies and kernels agree.
        q, k, v = call_on_shared_input([self.query, self.key, self.value], x)
        q, k = rotary(q, positions, self.rope_base), rotary(k, positions, self.rope_base)
        # Keys are kept (batch, kv_heads, head_dim, length) and values (batch, kv_heads, length,
        # head_dim): a decode step's sums below then run along rows of both.
        if cache is None:
            keys, values, key_positions = k.transpose(0, 2, 3, 1), v.swapaxes(1, 2), positions
        else:
            cached_k, cached_v = cache
            length = cached_k.shape[-1] if cached_k.ndim == 4 else None
            if (cached_k.shape != (batch, self.kv_heads, self.head_dim, length)
                    or cached_v.shape != (batch, self.kv_heads, length, self.head_dim)):
                raise ValueError(
                    f"{self.path!r}: the cache must be keys (batch, kv_heads, head_dim, max_length) = "
                    f"({batch}, {self.kv_heads}, {self.head_dim}, max_length) and values (batch, kv_heads, "
                    f"max_length, head_dim) = ({batch}, {self.kv_heads}, max_length, {self.head_dim}). "
                    f"Received {cached_k.shape} and {cached_v.shape}"
                )
            keys = jax.lax.dynamic_update_slice(cached_k, k.transpose(0, 2, 3, 1).astype(cached_k.dtype),
                                                (0, 0, 0, offset))
            values = jax.lax.dynamic_update_slice(cached_v, v.swapaxes(1, 2).astype(cached_v.dtype),
                                                  (0, 0, offset, 0))
            key_positions = jnp.arange(length, dtype=jnp.int32)
        groups = self.heads // self.kv_heads
        q = q.reshape(batch, time, self.kv_heads, groups, self.head_dim)
        q = q * jnp.asarray(1.0 / math.sqrt(self.head_dim), q.dtype)
        kc, vc = keys.astype(q.dtype), values.astype(q.dtype)
        acc = accumulation_dtype(q.dtype)
        if time == 1 and cache is not None and _ffi_attention(q, kc, vc):
            # The package's CPU kernel: the same sums and softmax in one call (cpu_kernels.decode_attention).
            out = _cpu_kernels().decode_attention(q[:, 0], kc, vc, offset)  # (b, k, g, d)
            out = out[:, None].reshape(batch, time, self.heads, self.head_dim)
            out = self.attention_output(out)
            return out, (keys, values)
        if time == 1:
            # A decode step: both products as an elementwise product and a sum, which XLA fuses into
            # loops over the caches where they lie. As dots, XLA copied a cache transposed first
            # (whichever layout it was kept in), in every block at every step.
            qt = q.astype(acc).transpose(0, 2, 3, 1, 4)  # (b, k, g, 1, d)
            logits = jnp.sum(qt[..., None] * kc.astype(acc)[:, :, None, None, :, :], axis=-2)
        else:
            logits = jnp.einsum("btkgd,bkds->bkgts", q, kc).astype(acc)
        allowed = key_positions[None, :] <= positions[:, None]
        logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        if time == 1:
            out = jnp.sum(probs[..., None] * vc.astype(acc)[:, :, None, None, :, :], axis=-2)  # (b, k, g, 1, d)
            out = out.transpose(0, 3, 1, 2, 4).astype(q.dtype)
        else:
            out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(q.dtype), vc)
        out = out.reshape(batch, time, self.heads, self.head_dim)
        out = self.attention_output(out)
        return out if cache is None else (out, (keys, values))


#: Set to 1 to run a decode step's attention as XLA ops even where the CPU kernel is available.
XLA_ATTENTION_ENV = "AUTOPOLICY_XLA_ATTENTION"


def _cpu_kernels():
    from autopolicy.numerics import cpu_kernels  # pylint: disable=import-outside-toplevel

    return cpu_kernels


def _ffi_attention(q: jax.Array, kc: jax.Array, vc: jax.Array) -> bool:
    """Whether a decode step's attention runs the package's CPU kernel: float32 throughout, the
    kernels built, the default backend a CPU, and neither ``AUTOPOLICY_XLA_ATTENTION=1`` nor
    ``AUTOPOLICY_DISABLE_CPU_KERNELS=1`` set (both keep XLA's ops). Read when a step is traced."""
    if not (q.dtype == kc.dtype == vc.dtype == jnp.float32) or q.shape[-1] > 256:
        return False
    if jax.default_backend() != "cpu" or os.environ.get(XLA_ATTENTION_ENV, "").strip() not in ("", "0"):
        return False
    return _cpu_kernels().AVAILABLE


class LlamaMLP(Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``gate``, ``up`` and ``down`` are Dense layers
    without bias, each tunable.

    >>> mlp = LlamaMLP(8).build(jax.random.key(0), jnp.ones((1, 2, 4)))
    >>> [p.split("/")[-1] for p in mlp.layers_by_path()], mlp(jnp.ones((1, 2, 4))).shape
    (['gate', 'up', 'down'], (1, 2, 4))
    """

    def __init__(self, hidden_dim: int, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        self.hidden_dim = hidden_dim
        self.gate = Dense(hidden_dim, use_bias=False, name="gate")
        self.up = Dense(hidden_dim, use_bias=False, name="up")
        self.down = None

    def build_variables(self, x) -> None:
        self.down = Dense(x.shape[-1], use_bias=False, name="down")

    def call(self, x: jax.Array) -> jax.Array:
        gate, up = call_on_shared_input([self.gate, self.up], x)
        return self.down(self.cast(jax.nn.silu(gate)) * self.cast(up))


class LlamaBlock(Module):
    """A pre-norm decoder block: ``x + attention(attention_norm(x))``, then
    ``x + mlp(mlp_norm(x))``. Call as the attention: ``block(x, start=None, cache=None)``."""

    def __init__(self, config: Any, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        config = LlamaConfig.of(config)
        self.attention_norm = RMSNormalization(config.norm_epsilon, name="attention_norm")
        self.attention = LlamaAttention(config.heads, config.kv_heads, config.head_dim, config.rope_base,
                                        name="attention")
        self.mlp_norm = RMSNormalization(config.norm_epsilon, name="mlp_norm")
        self.mlp = LlamaMLP(config.mlp_dim, name="mlp")

    def call(self, x: jax.Array, start: Any = None, cache: Any = None) -> Any:
        attended = self.attention(self.attention_norm(x), start=start, cache=cache)
        if cache is not None:
            attended, cache = attended
        x = x + self.cast(attended)
        x = x + self.cast(self.mlp(self.mlp_norm(x)))
        return x if cache is None else (x, cache)


class LlamaDecoder(Module):
    """A llama-family causal language model: ``embedding``, ``block_0 ..``, ``final_norm`` and
    ``head`` (a Dense from the model width to the vocabulary, no bias).

    ``config`` is a :class:`LlamaConfig` or a dict of its fields; only a model made from a dict
    saves with :func:`~autopolicy.nn.save` (:func:`~autopolicy.nn.load_gguf` makes it so).

    The head and the embedding are separate layers, each with its own policy, even where the
    checkpoint ties them (one tensor): :func:`~autopolicy.nn.load_gguf` loads the same values
    into both, so the float model holds the table twice.

    Call as ``model(ids)`` for the logits of every position (float32, ``(batch, time, vocab)``),
    or ``model(ids, start=start, cache=cache)`` for ``(logits, new_cache)`` with a cache from
    :meth:`init_cache`.

    >>> config = LlamaConfig(vocab_size=32, dim=16, blocks=2, heads=4, kv_heads=2, mlp_dim=24)
    >>> model = LlamaDecoder(config).build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> model(jnp.array([[1, 2, 3]])).shape
    (1, 3, 32)
    >>> list(model.layers_by_path())[:4]
    ['llama_decoder/embedding', 'llama_decoder/block_0/attention_norm', 'llama_decoder/block_0/attention/query', 'llama_decoder/block_0/attention/key']
    """

    def __init__(self, config: Any, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        config = LlamaConfig.of(config)
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.dim, "random_normal", name="embedding")
        fields = dataclasses.asdict(config)  # a dict has a JSON form: the blocks save and load
        self.blocks = [LlamaBlock(fields, name=f"block_{i}") for i in range(config.blocks)]
        self.final_norm = RMSNormalization(config.norm_epsilon, name="final_norm")
        self.head = Dense(config.vocab_size, use_bias=False, name="head")

    def init_cache(self, batch: int, max_length: int, dtype: Any = jnp.float32) -> tuple:
        """An empty key/value cache: per block, zero keys ``(batch, kv_heads, head_dim, max_length)``
        and values ``(batch, kv_heads, max_length, head_dim)`` (the layouts the decode step's
        products read in place)."""
        for arg, value in (("batch", batch), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int. Received: {arg}={value!r}")
        c = self.config
        return tuple((jnp.zeros((batch, c.kv_heads, c.head_dim, max_length), dtype),
                      jnp.zeros((batch, c.kv_heads, max_length, c.head_dim), dtype)) for _ in self.blocks)

    @staticmethod
    def cache_length(cache: Any) -> int:
        """The ``max_length`` of a cache made by :meth:`init_cache` (positions it holds)."""
        return int(cache[0][1].shape[2])

    def call(self, ids: jax.Array, start: Any = None, cache: Any = None, logits_at: Any = None) -> Any:
        """Logits ``(batch, time, vocab)`` of ``ids`` ``(batch, time)``; with ``cache``, ``(logits,
        cache)`` after writing the ids at positions ``start ..`` (see :meth:`init_cache`).

        ``logits_at``: an int array ``(n,)`` of time indices into ``ids``: only those positions
        go through the final norm and the head (logits ``(batch, n, vocab)``), as a prefill needs
        only the last prompt token's (the head is 49152 x 576 on SmolLM2: over a 512-token
        prompt it is a fifth of the prefill's products). None: every position.
        """
        ids = jnp.asarray(ids)
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{self.path!r} takes (batch, time) integer ids. Received {ids.dtype} {ids.shape}")
        if logits_at is not None:
            logits_at = jnp.asarray(logits_at)
            if logits_at.ndim != 1 or not jnp.issubdtype(logits_at.dtype, jnp.integer):
                raise ValueError(f"{self.path!r}: logits_at must be a 1-D integer array of time indices. "
                                 f"Received {logits_at.dtype} {logits_at.shape}")
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"{self.path!r}: the cache must have one entry per block ({len(self.blocks)}). "
                             f"Received {len(cache)}")
        x = self.cast(self.embedding(ids))
        new_cache = []
        for i, block in enumerate(self.blocks):
            if cache is None:
                x = self.cast(block(x, start=start))
            else:
                x, (k, v) = block(x, start=start, cache=cache[i])
                x = self.cast(x)
                new_cache.append((k.astype(cache[i][0].dtype), v.astype(cache[i][1].dtype)))
        if logits_at is not None:
            x = jnp.take(x, logits_at, axis=1)
        logits = self.head(self.final_norm(x)).astype(jnp.float32)
        return logits if cache is None else (logits, tuple(new_cache))
