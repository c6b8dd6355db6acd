"""Embedding: a lookup table; int8 stores one scale per row."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn import initializers
from autopolicy.nn._quantizable import QuantizableKernel

__all__ = ["Embedding"]


class Embedding(QuantizableKernel):
    """Maps integer ids in ``[0, input_dim)`` to vectors of size ``output_dim``.

    Ids are never cast. The table is the layer's ``kernel`` (Keras calls it ``embeddings``, which
    is also available as a property). int8 keeps one scale per row of the table.

    >>> import autopolicy.nn as nn
    >>> emb = nn.Embedding(10, 4).build(jax.random.key(0), jnp.array([[1, 2]]))
    >>> emb(jnp.array([[1, 2, 3]])).shape
    (1, 3, 4)
    """

    layer_kind = "embedding"
    kernel_op = "gather"

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer: Any = "uniform",
                 *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        for arg, value in (("input_dim", input_dim), ("output_dim", output_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int. Received: {arg}={value!r}")
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.embeddings_initializer = initializers.check(embeddings_initializer, "embeddings_initializer")
        self._init_quantization_slots()

    @property
    def embeddings(self) -> jax.Array:
        return self.kernel

    def kernel_contract_axes(self) -> tuple[int, ...]:
        return (1,)  # one scale per row

    def build_variables(self, ids: jax.Array) -> None:
        if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
            raise TypeError(f"Embedding {self.path!r} takes integer ids. Received dtype {jnp.asarray(ids).dtype}")
        self.add_weight("kernel", (self.input_dim, self.output_dim), self.embeddings_initializer)

    def call(self, ids: jax.Array) -> jax.Array:
        ids = jnp.asarray(ids)
        if self._weights_mode is not None:
            return self._quantized_kernel(ids, compute_dtype=self.compute_dtype)
        return self.kernel[ids]
