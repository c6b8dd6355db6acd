"""Conv2D (NHWC inputs, HWIO kernels) and 2-D pooling."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.nn import activations, initializers
from autopolicy.nn._module import Module
from autopolicy.nn._quantizable import QuantizableKernel

__all__ = ["Conv2D", "MaxPooling2D"]

PADDINGS = ("valid", "same")


def _pair(name: str, value: Any) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them. Received: {name}={value!r}")
    return pair  # type: ignore[return-value]


def _padding(value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in PADDINGS:
        raise ValueError(f"Invalid padding. Expected one of {PADDINGS}. Received: padding={value!r}")
    return value.lower()


class Conv2D(QuantizableKernel):
    """A 2-D convolution over NHWC inputs.

    Args:
      filters: The number of output channels.
      kernel_size: An int or a pair.
      strides: An int or a pair.
      padding: ``"valid"`` or ``"same"``.
      activation, use_bias, kernel_initializer, bias_initializer: As in ``Dense``.

    int8 quantizes the kernel per output channel and each input example with one scale.

    >>> import autopolicy.nn as nn
    >>> conv = nn.Conv2D(4, 3, padding="same").build(jax.random.key(0), jnp.ones((1, 8, 8, 2)))
    >>> conv(jnp.ones((1, 8, 8, 2))).shape
    (1, 8, 8, 4)
    """

    layer_kind = "conv"
    kernel_op = "conv2d"

    def __init__(
        self,
        filters: int,
        kernel_size: int | tuple[int, int],
        strides: int | tuple[int, int] = 1,
        padding: str = "valid",
        activation: Any = None,
        use_bias: bool = True,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        *,
        name: str | None = None,
        dtype: Any = None,
        autocast: bool = True,
    ):
        super().__init__(name=name, dtype=dtype, autocast=autocast)
        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"filters must be a positive int. Received: filters={filters!r}")
        self.filters = filters
        self.kernel_size = _pair("kernel_size", kernel_size)
        self.strides = _pair("strides", strides)
        self.padding = _padding(padding)
        activations.get(activation)
        self.activation = activation
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.check(kernel_initializer, "kernel_initializer")
        self.bias_initializer = initializers.check(bias_initializer, "bias_initializer")
        self._init_quantization_slots()
        self.bias = None

    def kernel_contract_axes(self) -> tuple[int, ...]:
        return (0, 1, 2)

    def build_variables(self, x: jax.Array) -> None:
        if jnp.ndim(x) != 4:
            raise ValueError(f"Conv2D {self.path!r} needs NHWC inputs of rank 4. Received shape {jnp.shape(x)}")
        self.add_weight("kernel", self.kernel_size + (x.shape[-1], self.filters), self.kernel_initializer)
        if self.use_bias:
            self.add_weight("bias", (self.filters,), self.bias_initializer)

    def call(self, x: jax.Array) -> jax.Array:
        padding = self.padding.upper()
        if self._weights_mode is not None:
            y = self._quantized_kernel(x, compute_dtype=x.dtype, strides=self.strides, padding=padding)
        else:
            y = jax.lax.conv_general_dilated(
                x, self.kernel, self.strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
        if self.bias is not None:
            y = y + self.bias
        return activations.get(self.activation)(y)


class MaxPooling2D(Module):
    """Max pooling over NHWC inputs (``pool_size`` and ``strides`` default to 2)."""

    def __init__(self, pool_size: int | tuple[int, int] = 2, strides: Any = None, padding: str = "valid",
                 *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        self.pool_size = _pair("pool_size", pool_size)
        self.strides = self.pool_size if strides is None else _pair("strides", strides)
        self.padding = _padding(padding)

    def call(self, x: jax.Array) -> jax.Array:
        window = (1,) + self.pool_size + (1,)
        strides = (1,) + self.strides + (1,)
        # A concrete (NumPy) identity lets JAX see a max-pool and differentiate it.
        init = np.array(-np.inf, x.dtype)
        return jax.lax.reduce_window(x, init, jax.lax.max, window, strides, self.padding.upper())
