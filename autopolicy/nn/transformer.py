"""A residual transformer block (pre-norm or post-norm, as BERT), built from the standard layers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn._module import Module
from autopolicy.nn.attention import MultiHeadAttention
from autopolicy.nn.core import Dropout
from autopolicy.nn.dense import Dense
from autopolicy.nn.normalization import LayerNormalization
from autopolicy.nn.sequential import Sequential

__all__ = ["TransformerBlock", "causal_mask"]


def causal_mask(batch: int, length: int) -> jax.Array:
    """``(batch, length, length)`` booleans: position t attends to positions <= t."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (batch, length, length))


class TransformerBlock(Module):
    """A residual transformer encoder block, pre-norm (``norm_first=True``) or post-norm.

    Pre-norm: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))``. Post-norm, as BERT:
    ``norm1(x + attention(x))``, then ``norm2(x + mlp(x))``. The residual stream stays in this
    block's compute dtype whatever its sublayers compute in.

    Args:
      dim: Model width.
      num_heads: Attention heads (``dim`` must divide evenly).
      mlp_dim: Hidden width of the MLP.
      dropout: Dropout on the attention probabilities and both residual branches.
      causal: Mask attention to earlier positions (language models).
      norm_first: Pre-norm (True) or post-norm (False, BERT).
      norm_epsilon: The LayerNormalizations' epsilon (BERT: 1e-12).
      activation: The MLP's activation (``"gelu"`` is the exact one, as BERT's).

    Call as ``block(x, mask=None)``: ``x`` is ``(batch, time, dim)``; ``mask`` is
    ``(batch, time)``, True (or 1) for real tokens and False (0) for padding, which no position
    attends to (the outputs at padded positions are computed but meaningless).

    Sublayers: ``norm1``, ``attention`` (``query``, ``key``, ``value``, ``attention``,
    ``attention_output``), ``norm2``, ``mlp`` (``dense``, ``dense_1``).

    >>> block = TransformerBlock(16, 2, 32).build(jax.random.key(0), jnp.ones((1, 4, 16)))
    >>> [p.split("/", 1)[1] for p in block.layers_by_path()][:4]
    ['norm1', 'attention/query', 'attention/key', 'attention/value']
    >>> bert = TransformerBlock(16, 2, 32, norm_first=False, norm_epsilon=1e-12, name="layer_0")
    >>> bert = bert.build(jax.random.key(0), jnp.ones((2, 4, 16)), mask=jnp.ones((2, 4), bool))
    >>> bert(jnp.ones((2, 4, 16)), mask=jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])).shape
    (2, 4, 16)
    """

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout: float = 0.0,
                 causal: bool = False, norm_first: bool = True, norm_epsilon: float = 1e-3,
                 activation: Any = "gelu", **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(dim, bool) or not isinstance(dim, int) or not isinstance(num_heads, int) or dim % num_heads:
            raise ValueError(f"dim must be a multiple of num_heads. Received: dim={dim!r}, num_heads={num_heads!r}")
        for arg, value in (("causal", causal), ("norm_first", norm_first)):
            if not isinstance(value, bool):
                raise TypeError(f"{arg} must be a bool. Received: {arg}={value!r}")
        self.causal = causal
        self.norm_first = norm_first
        self.norm1 = LayerNormalization(norm_epsilon)
        self.attention = MultiHeadAttention(num_heads, dim // num_heads, dropout=dropout)
        self.norm2 = LayerNormalization(norm_epsilon)
        self.mlp = Sequential([Dense(mlp_dim, activation=activation), Dense(dim)])
        self.dropout = Dropout(dropout)

    def call(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        causal = causal_mask(x.shape[0], x.shape[1]) if self.causal else None
        if self.norm_first:
            h = self.norm1(x)
            x = x + self.cast(self.dropout(self.attention(h, h, attention_mask=causal, mask=mask)))
            return x + self.cast(self.dropout(self.mlp(self.norm2(x))))
        x = self.cast(self.norm1(x + self.cast(self.dropout(self.attention(x, x, attention_mask=causal, mask=mask)))))
        return self.cast(self.norm2(x + self.cast(self.dropout(self.mlp(x)))))
