"""Multi-head attention built from EinsumDense projections, each its own tunable layer."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn._module import Module
from autopolicy.nn.activations import accumulation_dtype
from autopolicy.nn.core import dropout
from autopolicy.nn.dense import EinsumDense

__all__ = ["DotProductAttention", "MultiHeadAttention"]


class DotProductAttention(Module):
    """``softmax(q k^T / sqrt(d)) v`` over ``(batch, time, heads, dim)`` tensors.

    The two products run in the compute dtype; the softmax runs in float32.
    ``attention_mask`` is ``(batch, query_time, key_time)``, True where attention is allowed.
    """

    tunable = True

    def __init__(self, dropout: float = 0.0, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1). Received: dropout={dropout!r}")
        self.dropout = float(dropout)

    def call(self, query, key, value, attention_mask=None, training: bool = False):
        depth = query.shape[-1]
        query = query * jnp.asarray(1.0 / math.sqrt(depth), query.dtype)
        logits = jnp.einsum("bthd,bshd->bhts", query, key).astype(accumulation_dtype(query.dtype))
        if attention_mask is not None:
            logits = jnp.where(attention_mask[:, None, :, :], logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(query.dtype)
        probs = dropout(self, probs, self.dropout, training)
        return jnp.einsum("bhts,bshd->bthd", probs, value)


class MultiHeadAttention(Module):
    """Keras's MultiHeadAttention: query/key/value projections, attention, output projection.

    Args:
      num_heads: Number of heads.
      key_dim: Size of each head of the query and key.
      value_dim: Size of each head of the value (defaults to ``key_dim``).
      dropout: Dropout on the attention probabilities.
      use_bias: Whether the projections have biases.
      output_shape: Output feature size (defaults to the query's).
      kernel_initializer, bias_initializer: For the projections.

    Sublayers (each tunable on its own): ``query``, ``key``, ``value`` (EinsumDense),
    ``attention`` (DotProductAttention) and ``attention_output`` (EinsumDense).
    Call as ``mha(query, value, key=None, attention_mask=None)`` with ``(batch, time, features)``
    inputs.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        *,
        name: str | None = None,
        dtype: Any = None,
    ):
        super().__init__(name=name, dtype=dtype)
        for arg, val in (("num_heads", num_heads), ("key_dim", key_dim), ("value_dim", value_dim or key_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg} must be a positive int. Received: {arg}={val!r}")
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim or key_dim
        self.use_bias = bool(use_bias)
        self.output_shape = output_shape
        self.kernel_initializer = kernel_initializer
        self.bias_initializer = bias_initializer
        self.query_dense = self._projection("query", key_dim)
        self.key_dense = self._projection("key", key_dim)
        self.value_dense = self._projection("value", self.value_dim)
        self.attention = DotProductAttention(dropout, name="attention")
        self.output_dense = None

    def _projection(self, name: str, size: int) -> EinsumDense:
        return EinsumDense(
            "abc,cde->abde",
            (None, self.num_heads, size),
            bias_axes="de" if self.use_bias else None,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            name=name,
        )

    def build_variables(self, query, value, key=None, attention_mask=None) -> None:
        out = self.output_shape or query.shape[-1]
        self.output_dense = EinsumDense(
            "abcd,cde->abe",
            (None, out),
            bias_axes="e" if self.use_bias else None,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            name="attention_output",
        )

    def call(self, query, value, key=None, attention_mask=None):
        key = value if key is None else key
        q = self.query_dense(query)
        k = self.key_dense(key)
        v = self.value_dense(value)
        attended = self.attention(q, k, v, attention_mask=attention_mask)
        return self.output_dense(attended)
