"""Dense and EinsumDense: the layers that hold most of a model's multiply-adds."""

from __future__ import annotations

import string
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.nn import activations, initializers
from autopolicy.nn._quantizable import QuantizableKernel
from autopolicy.numerics import _sharding, weight_only

__all__ = ["Dense", "EinsumDense"]


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    return value


class Dense(QuantizableKernel):
    """``activation(x @ kernel + bias)`` over the last axis of ``x``.

    Args:
      units: The output size.
      activation: A name (``"relu"``), a callable, or None.
      use_bias: Whether to add a bias.
      kernel_initializer, bias_initializer: Names or ``fn(key, shape, dtype)``.
      kernel_regularizer, bias_regularizer: Optional penalties (``nn.regularizers.L2(1e-4)``).
      name, dtype, autocast: See :class:`~autopolicy.nn.Module`.

    >>> import autopolicy.nn as nn
    >>> layer = nn.Dense(3, dtype="mixed_bfloat16").build(jax.random.key(0), jnp.ones((2, 4)))
    >>> layer.kernel.dtype, layer(jnp.ones((2, 4))).dtype
    (dtype('float32'), dtype(bfloat16))
    """

    layer_kind = "dense"
    kernel_op = "einsum"

    def __init__(
        self,
        units: int,
        activation: Any = None,
        use_bias: bool = True,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        *,
        name: str | None = None,
        dtype: Any = None,
        autocast: bool = True,
    ):
        super().__init__(name=name, dtype=dtype, autocast=autocast)
        self.units = _check_positive_int("units", units)
        activations.get(activation)
        self.activation = activation
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.check(kernel_initializer, "kernel_initializer")
        self.bias_initializer = initializers.check(bias_initializer, "bias_initializer")
        self.kernel_regularizer = kernel_regularizer
        self.bias_regularizer = bias_regularizer
        self._init_quantization_slots()
        self.bias = None

    def kernel_contract_axes(self) -> tuple[int, ...]:
        return (0,)

    def build_variables(self, x: jax.Array) -> None:
        if jnp.ndim(x) < 1:
            raise ValueError(f"Dense {self.path!r} needs inputs of rank >= 1. Received shape {jnp.shape(x)}")
        self.add_weight(
            "kernel", (x.shape[-1], self.units), self.kernel_initializer, regularizer=self.kernel_regularizer
        )
        if self.use_bias:
            self.add_weight("bias", (self.units,), self.bias_initializer, regularizer=self.bias_regularizer)

    def call(self, x: jax.Array) -> jax.Array:
        if self._weights_mode is None:
            y = jnp.einsum("...k,kn->...n", x, self.kernel,
                           out_sharding=_sharding.out_sharding("...k,kn->...n", x, self.kernel))
        else:  # quantized kernels take 2-D inputs: (rows, features)
            y2 = self._quantized_kernel("mk,kn->mn", _sharding.reshape(x, (-1, x.shape[-1])), compute_dtype=x.dtype)
            y = _sharding.reshape(y2, x.shape[:-1] + (y2.shape[-1],))
        if self.bias is not None:
            y = y + self.bias
        return activations.get(self.activation)(y)


class EinsumDense(QuantizableKernel):
    """A dense layer written as an einsum: ``einsum(equation, x, kernel) + bias``.

    Args:
      equation: ``"<input>,<kernel>-><output>"``, e.g. ``"abc,cde->abde"`` (project to heads);
        the input and output may start with ``...`` (``"...b,bc->...c"``).
      output_shape: The output's shape without the batch axis (the first output letter, or the
        ``...`` axes); None entries are taken from the input. An int means a 1-tuple.
      activation, kernel_initializer, bias_initializer, kernel_regularizer: As in ``Dense``.
      bias_axes: Output letters that get a bias (``"de"``), or None.

    >>> import autopolicy.nn as nn
    >>> layer = nn.EinsumDense("abc,cde->abde", (None, 4, 8), bias_axes="de")
    >>> layer = layer.build(jax.random.key(0), jnp.ones((2, 5, 16)))
    >>> layer.kernel.shape, layer(jnp.ones((2, 5, 16))).shape
    ((16, 4, 8), (2, 5, 4, 8))
    """

    layer_kind = "einsum_dense"
    kernel_op = "einsum"

    def __init__(
        self,
        equation: str,
        output_shape: int | Sequence[int | None],
        activation: Any = None,
        bias_axes: str | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        *,
        name: str | None = None,
        dtype: Any = None,
        autocast: bool = True,
    ):
        super().__init__(name=name, dtype=dtype, autocast=autocast)
        self.equation = _check_equation(equation)
        if isinstance(output_shape, int):
            output_shape = (output_shape,)
        self.output_shape = tuple(output_shape)
        lhs, kernel, out = _split(equation)
        if bias_axes is not None and any(c not in out.replace(".", "") for c in bias_axes):
            raise ValueError(
                f"bias_axes must be letters of the output {out!r}. Received: bias_axes={bias_axes!r}"
            )
        self.bias_axes = bias_axes
        activations.get(activation)
        self.activation = activation
        self.kernel_initializer = initializers.check(kernel_initializer, "kernel_initializer")
        self.bias_initializer = initializers.check(bias_initializer, "bias_initializer")
        self.kernel_regularizer = kernel_regularizer
        self._init_quantization_slots()
        self.bias = None

    def _full_equation(self, ndim: int) -> str:
        """The equation with ``...`` replaced by letters for an input of rank ``ndim``."""
        lhs, kernel, out = _split(self.equation)
        if "..." not in lhs:
            if len(lhs) != ndim:
                raise ValueError(
                    f"EinsumDense {self.path!r}: equation {self.equation!r} expects inputs of rank "
                    f"{len(lhs)}. Received rank {ndim}"
                )
            return self.equation
        used = set(lhs + kernel + out)
        free = [c for c in string.ascii_letters if c not in used]
        n = ndim - (len(lhs) - 3)
        if n < 0:
            raise ValueError(f"EinsumDense {self.path!r}: input rank {ndim} is too small for {self.equation!r}")
        ell = "".join(free[:n])
        return f"{lhs.replace('...', ell)},{kernel}->{out.replace('...', ell)}"

    def kernel_contract_axes(self) -> tuple[int, ...]:
        lhs, kernel, out = _split(self.equation)
        return tuple(i for i, c in enumerate(kernel) if c in lhs and c not in out)

    def build_variables(self, x: jax.Array) -> None:
        equation = self._full_equation(jnp.ndim(x))
        lhs, kernel, out = _split(equation)
        sizes = dict(zip(lhs, x.shape))
        named = _output_letters(self.equation, equation)
        if len(named) != len(self.output_shape):
            raise ValueError(
                f"EinsumDense {self.path!r}: output_shape {self.output_shape} must have one entry per "
                f"output axis after the batch/ellipsis axes {tuple(named)}."
            )
        for letter, size in zip(named, self.output_shape):
            if size is not None:
                if letter in sizes and sizes[letter] != size:
                    raise ValueError(
                        f"EinsumDense {self.path!r}: output axis {letter!r} has size {sizes[letter]} "
                        f"from the input but output_shape says {size}."
                    )
                sizes[letter] = size
        missing = [c for c in kernel if c not in sizes]
        if missing:
            raise ValueError(
                f"EinsumDense {self.path!r}: the sizes of kernel axes {missing} are unknown; give "
                "them in output_shape."
            )
        contract = self.kernel_contract_axes()
        others = tuple(i for i in range(len(kernel)) if i not in contract)
        self.add_weight(
            "kernel",
            tuple(sizes[c] for c in kernel),
            self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            fan_axes=(contract, others),
        )
        if self.bias_axes:
            first = min(out.index(c) for c in self.bias_axes)
            shape = tuple(sizes[c] if c in self.bias_axes else 1 for c in out[first:])
            self.add_weight("bias", shape, self.bias_initializer)

    def _product_letters(self) -> tuple[str, str]:
        """``(summed, free)``: the kernel's letters that the product sums over and those it keeps,
        each in the kernel's own order.

        Raises:
          ValueError: when the einsum is not one matrix product (a kernel letter that is also a
            batch axis of the input and output).
        """
        lhs, kernel, out = _split(self.equation)
        batch = [c for c in kernel if c in lhs and c in out]
        if batch:
            raise ValueError(
                f"EinsumDense {self.path!r}: {self.dtype_policy.name!r} stores the kernel as one matrix, and "
                f"{self.equation!r} is not one matrix product (kernel axes {batch} are batch axes of the input "
                "and output). Use int8, int4 or float8 for this layer."
            )
        return ("".join(c for c in kernel if c in lhs and c not in out), "".join(c for c in kernel if c not in lhs))

    def matmul_kernel(self, kernel: jax.Array) -> jax.Array:
        _, letters, _ = _split(self.equation)
        summed, free = self._product_letters()
        k = kernel.transpose([letters.index(c) for c in summed + free])
        return k.reshape((int(np.prod(k.shape[: len(summed)])), -1))

    def _matmul_input(self, x: jax.Array) -> tuple[jax.Array, tuple[int, ...], str]:
        """``x`` as ``(rows, K)`` rows of the product, the shape of its free axes, and their letters."""
        lhs, _, _ = _split(self._full_equation(x.ndim))
        summed, _ = self._product_letters()
        free_x = "".join(c for c in lhs if c not in summed)
        x_t = x.transpose([lhs.index(c) for c in free_x + summed])
        rows = x_t.shape[: len(free_x)]
        return x_t.reshape((-1, int(np.prod(x_t.shape[len(free_x):])))), rows, free_x

    def matmul_rows(self, x: jax.Array) -> jax.Array:
        return self._matmul_input(x)[0]

    def _matmul_call(self, x: jax.Array, equation: str) -> jax.Array:
        """GPTQ/AWQ: the product on the stored ``(K, N)`` kernel, its result put back in the
        equation's output layout."""
        x2, rows, free_x = self._matmul_input(x)
        _, free_k = self._product_letters()
        y2 = self._quantized_kernel("mk,kn->mn", x2, compute_dtype=x.dtype)
        sizes = dict(zip(_output_letters(self.equation, equation), self.output_shape))
        y = y2.reshape(rows + tuple(sizes[c] for c in free_k))
        out = _split(equation)[2]
        return y.transpose([(free_x + free_k).index(c) for c in out])

    def call(self, x: jax.Array) -> jax.Array:
        equation = self._full_equation(x.ndim)
        if self._weights_mode is None:
            y = jnp.einsum(equation, x, self.kernel, out_sharding=_sharding.out_sharding(equation, x, self.kernel))
        elif self._weights_mode in ("gptq", "awq") and weight_only.is_calibrated({"kernel_scale": self.kernel_scale}):
            y = self._matmul_call(x, equation)
        else:
            y = self._quantized_kernel(equation, x, compute_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return activations.get(self.activation)(y)


def _split(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.split("->")
    lhs, kernel = inputs.split(",")
    return lhs, kernel, out


def _check_equation(equation: Any) -> str:
    ok = isinstance(equation, str) and equation.count("->") == 1 and equation.split("->")[0].count(",") == 1
    if ok:
        lhs, kernel, out = _split(equation.replace(" ", ""))
        letters = lhs.replace("...", "") + kernel + out.replace("...", "")
        ok = letters.isalpha() and "." not in kernel and ("..." in lhs) == ("..." in out)
        ok = ok and all(c in lhs + kernel for c in out.replace("...", ""))
    if not ok:
        raise ValueError(
            "EinsumDense needs an equation '<input>,<kernel>-><output>' of letters, with '...' "
            f"allowed at the start of the input and output, e.g. 'abc,cd->abd'. Received: {equation!r}"
        )
    return equation.replace(" ", "")


def _output_letters(equation: str, full: str) -> str:
    """The output letters ``output_shape`` describes: all but the batch (or ``...``) axes."""
    _, _, out = _split(equation)
    if "..." in out:
        return out.replace("...", "")
    return _split(full)[2][1:]
