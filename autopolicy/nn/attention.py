"""Multi-head attention built from EinsumDense projections, each its own tunable layer."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn._grouping import call_on_shared_input
from autopolicy.nn._module import Module
from autopolicy.nn.activations import accumulation_dtype
from autopolicy.nn.core import dropout
from autopolicy.nn.dense import EinsumDense

__all__ = ["DotProductAttention", "MultiHeadAttention", "padding_mask", "combine_masks"]


class DotProductAttention(Module):
    """``softmax(q k^T / sqrt(d)) v`` over ``(batch, time, heads, dim)`` tensors.

    The two products run in the compute dtype; the logits and the softmax run in float32 (or
    wider). ``attention_mask`` is ``(batch, query_time, key_time)``, True where attention is
    allowed; ``mask`` is ``(batch, key_time)``, True (or 1) for real tokens and False (0) for
    padding, which no query attends to. Masked logits are set to the most negative float32
    before the softmax, so a padded key gets exactly zero weight.

    >>> import autopolicy.nn as nn
    >>> q = jnp.ones((1, 3, 1, 2))
    >>> v = jnp.arange(6.0).reshape(1, 3, 1, 2)
    >>> att = nn.DotProductAttention().build(jax.random.key(0), q, q, v)
    >>> att(q, q, v, mask=jnp.array([[1, 1, 0]]))[0, :, 0]  # the third key is padding
    Array([[1., 2.],
           [1., 2.],
           [1., 2.]], dtype=float32)
    """

    tunable = True

    def __init__(self, dropout: float = 0.0, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1). Received: dropout={dropout!r}")
        self.dropout = float(dropout)

    def call(self, query, key, value, attention_mask=None, mask=None, training: bool = False):
        depth = query.shape[-1]
        query = query * jnp.asarray(1.0 / math.sqrt(depth), query.dtype)
        logits = jnp.einsum("bthd,bshd->bhts", query, key).astype(accumulation_dtype(query.dtype))
        allowed = combine_masks(attention_mask, mask, key.shape[0], query.shape[1], key.shape[1], self.path)
        if allowed is not None:
            logits = jnp.where(allowed[:, None, :, :], logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(query.dtype)
        probs = dropout(self, probs, self.dropout, training)
        return jnp.einsum("bhts,bshd->bthd", probs, value)


def padding_mask(mask: Any, batch: int, length: int, where: str) -> jax.Array:
    """``mask`` (``(batch, length)``, bool or 0/1) as booleans, True for real tokens.

    Raises:
      ValueError: naming ``where``, when the shape is not ``(batch, length)``.
    """
    mask = jnp.asarray(mask)
    if mask.shape != (batch, length):
        raise ValueError(
            f"{where}: mask must have shape (batch, key_time) = {(batch, length)}, True (or 1) for "
            f"real tokens. Received shape {mask.shape}"
        )
    return mask if mask.dtype == jnp.bool_ else mask != 0


def combine_masks(attention_mask: Any, mask: Any, batch: int, query_length: int, key_length: int,
                  where: str) -> jax.Array | None:
    """``(batch, query_time, key_time)`` booleans: ``attention_mask`` and the keys' padding
    ``mask`` together (None when both are None)."""
    allowed = None if attention_mask is None else jnp.asarray(attention_mask).astype(jnp.bool_)
    if mask is not None:
        keys = padding_mask(mask, batch, key_length, where)[:, None, :]
        keys = jnp.broadcast_to(keys, (batch, query_length, key_length))
        allowed = keys if allowed is None else jnp.logical_and(allowed, keys)
    return allowed


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
    Call as ``mha(query, value, key=None, attention_mask=None, mask=None)`` with
    ``(batch, time, features)`` inputs; ``mask`` is ``(batch, key_time)``, True (or 1) for the
    real tokens of ``key``/``value`` and False (0) for padding (Keras's ``value_mask``).
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

    def build_variables(self, query, value, key=None, attention_mask=None, mask=None) -> None:
        out = self.output_shape or query.shape[-1]
        self.output_dense = EinsumDense(
            "abcd,cde->abe",
            (None, out),
            bias_axes="e" if self.use_bias else None,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            name="attention_output",
        )

    def call(self, query, value, key=None, attention_mask=None, mask=None):
        key = value if key is None else key
        if query is key and key is value:  # self-attention: one kernel call where the policies agree
            q, k, v = call_on_shared_input([self.query_dense, self.key_dense, self.value_dense], query)
        else:
            q, k, v = self.query_dense(query), self.key_dense(key), self.value_dense(value)
        attended = self.attention(q, k, v, attention_mask=attention_mask, mask=mask)
        return self.output_dense(attended)
