"""Sequential: layers applied one after the other."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import jax

from autopolicy.nn._module import Module

__all__ = ["Sequential"]


class Sequential(Module):
    """Applies ``layers`` in order.

    Args:
      layers: Modules; unnamed ones are named after their class (``dense``, ``dense_1``...).
      name: The model's name (the first component of every layer path).
      dtype: A policy or map handed to every layer that was not given a dtype.

    >>> import autopolicy.nn as nn
    >>> mlp = nn.Sequential([nn.Dense(16, activation="relu"), nn.Dense(3)], name="mlp")
    >>> mlp = mlp.build(jax.random.key(0), jax.numpy.ones((2, 8)))
    >>> [layer.path for layer in mlp]
    ['mlp/dense', 'mlp/dense_1']
    """

    def __init__(self, layers: Sequence[Module], *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        layers = tuple(layers)
        bad = [layer for layer in layers if not isinstance(layer, Module)]
        if bad:
            raise TypeError(f"Sequential takes autopolicy.nn modules. Received: {bad!r}")
        self.layers = layers

    def call(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def __iter__(self) -> Iterator[Module]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> Module:
        return self.layers[index]
