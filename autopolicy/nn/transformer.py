"""A pre-norm residual transformer block, built from the standard layers."""

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
    """``x + attention(norm(x))`` then ``x + mlp(norm(x))``; the residual stream stays in this
    block's compute dtype whatever its sublayers compute in.

    Args:
      dim: Model width.
      num_heads: Attention heads (``dim`` must divide evenly).
      mlp_dim: Hidden width of the MLP.
      dropout: Dropout on the attention probabilities and both residual branches.
      causal: Mask attention to earlier positions (language models).

    >>> block = TransformerBlock(16, 2, 32).build(jax.random.key(0), jnp.ones((1, 4, 16)))
    >>> [p.split("/", 1)[1] for p in block.layers_by_path()][:4]
    ['norm1', 'attention/query', 'attention/key', 'attention/value']
    """

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout: float = 0.0,
                 causal: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(dim, bool) or not isinstance(dim, int) or not isinstance(num_heads, int) or dim % num_heads:
            raise ValueError(f"dim must be a multiple of num_heads. Received: dim={dim!r}, num_heads={num_heads!r}")
        self.causal = bool(causal)
        self.norm1 = LayerNormalization()
        self.attention = MultiHeadAttention(num_heads, dim // num_heads, dropout=dropout)
        self.norm2 = LayerNormalization()
        self.mlp = Sequential([Dense(mlp_dim, activation="gelu"), Dense(dim)])
        self.dropout = Dropout(dropout)

    def call(self, x: jax.Array) -> jax.Array:
        mask = causal_mask(x.shape[0], x.shape[1]) if self.causal else None
        h = self.norm1(x)
        x = x + self.cast(self.dropout(self.attention(h, h, attention_mask=mask)))
        return x + self.cast(self.dropout(self.mlp(self.norm2(x))))
