"""Kernel tactics for Keras's quantized layers: which int8 kernel runs their product.

Keras's int8 ``Dense`` and ``EinsumDense`` quantize their input and multiply two int8 operands
with ``keras.ops.matmul`` / ``keras.ops.einsum`` (XLA's s8 x s8 -> s32 dot, autopolicy's
``"s8s8"``). Inside :func:`kernel_scope`, this module routes exactly that product (both operands
int8) to :func:`autopolicy.numerics.int8.int8_accumulate` with the chosen kernel (``"u8s8"``:
the u8 x s8 dot of VNNI/AMX CPUs); everything else, and every call outside a scope, runs Keras's
own function. The int8 kernels give the same int32 accumulators bit for bit, so a layer's
outputs do not depend on the choice, only its speed.

Keras's own call is kept (its input quantizer, scales, bias, activation, LoRA); only the product
is swapped, by wrapping the JAX backend's ``matmul`` and ``einsum`` once (a no-op outside a
scope; the scope is a context variable, so other threads are unaffected).

Not covered, honestly: Keras's float8 layers quantize-dequantize and multiply in the compute
dtype (autopolicy's ``"emulated"``): a real float8 dot (``"fp8_dot"``) would mean reimplementing
their call, so they have one kernel; int8 convolutions and embeddings have one kernel each
(as in ``autopolicy.nn``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import string
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from autopolicy.adapters._keras_layers import keras
from autopolicy.numerics import int8, kernels

__all__ = ["kernel_scope", "active_kernel", "layer_kernels", "with_kernel", "install"]

_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("autopolicy_keras_int8_kernel", default=None)
#: The Keras layer kinds whose int8 product is one ``ops.matmul`` / ``ops.einsum`` of two int8
#: operands (their input quantized): the ones whose kernel can be chosen.
_CHOOSABLE = (keras.layers.Dense, keras.layers.EinsumDense)
_INSTALL_LOCK = threading.Lock()


def active_kernel() -> str | None:
    """The int8 kernel of the innermost :func:`kernel_scope` (None outside one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def kernel_scope(kernel: str | None):
    """Runs Keras's int8 products with ``kernel`` (one of :data:`autopolicy.numerics.int8.
    INT8_KERNELS`; None: Keras's own dot) while tracing or running inside the scope.

    Raises:
      ValueError: for a kernel int8 has not.
    """
    if kernel is not None:
        kernels.kernel_spec("int8", kernel)  # names the valid kernels when it is not one
    install()
    token = _ACTIVE.set(kernel)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _int8_pair(a: Any, b: Any) -> bool:
    return all(hasattr(x, "dtype") and jnp.dtype(x.dtype) == jnp.int8 for x in (a, b))


def _matmul_equation(x_ndim: int, k_ndim: int) -> str | None:
    """The einsum of ``matmul(x, k)`` for a 2-D ``k`` (a Dense kernel), else None."""
    if k_ndim != 2 or not 1 <= x_ndim <= 24:
        return None
    lead = string.ascii_lowercase[: x_ndim - 1]
    return f"{lead}y,yz->{lead}z"


def _wrap_matmul(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def matmul(x1, x2):
        kernel = _ACTIVE.get()
        if kernel is not None and _int8_pair(x1, x2):
            equation = _matmul_equation(jnp.ndim(x1), jnp.ndim(x2))
            if equation is not None:
                return int8.int8_accumulate(equation, jnp.asarray(x1), jnp.asarray(x2), kernel)
        return original(x1, x2)

    matmul.autopolicy_original = original
    return matmul


def _wrap_einsum(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        kernel = _ACTIVE.get()
        if (kernel is not None and len(operands) == 2 and not kwargs and "..." not in subscripts
                and _int8_pair(*operands)):
            return int8.int8_accumulate(subscripts, jnp.asarray(operands[0]), jnp.asarray(operands[1]), kernel)
        return original(subscripts, *operands, **kwargs)

    einsum.autopolicy_original = original
    return einsum


def install() -> None:
    """Wraps the JAX backend's ``matmul`` and ``einsum`` of Keras once (idempotent)."""
    from keras.src.backend.jax import numpy as backend_numpy  # noqa: PLC0415  (Keras's JAX backend)

    with _INSTALL_LOCK:
        for name, wrap in (("matmul", _wrap_matmul), ("einsum", _wrap_einsum)):
            fn = getattr(backend_numpy, name)
            if not hasattr(fn, "autopolicy_original"):
                setattr(backend_numpy, name, wrap(fn))


def _equation(layer: Any, input_shape: tuple) -> str | None:
    if isinstance(layer, keras.layers.EinsumDense):
        return layer.equation if "..." not in layer.equation else None
    return _matmul_equation(len(input_shape), 2)


def _runs(equation: str, input_shape: tuple, kernel_shape: tuple, kernel: str) -> bool:
    x = jax.ShapeDtypeStruct(input_shape, jnp.int8)
    k = jax.ShapeDtypeStruct(kernel_shape, jnp.int8)
    try:
        jax.eval_shape(lambda a, b: int8.int8_accumulate(equation, a, b, kernel), x, k)
    except ValueError:  # "u8s8" takes one matrix product only
        return False
    return True


def layer_kernels(layer: Any, mode: str | None, input_shape: tuple) -> tuple[str, ...]:
    """The kernels worth timing for ``layer``'s product in ``mode`` on this device, the default
    first; ``()`` when Keras's layer has one way to run it (see the module docstring)."""
    if mode != "int8" or not isinstance(layer, _CHOOSABLE):
        return ()
    equation = _equation(layer, input_shape)
    kernel_shape = tuple(layer.kernel.shape)
    if equation is None:
        return ()
    names = kernels.candidate_kernels("int8", "einsum")
    return tuple(n for n in names if _runs(equation, input_shape, kernel_shape, n))


def with_kernel(layer: Any, kernel: str) -> None:
    """Makes a quantized Keras layer run its int8 product with ``kernel`` from now on (its
    ``quantized_call`` enters :func:`kernel_scope`); not saved with the model."""
    kernels.kernel_spec("int8", kernel)
    original = type(layer).quantized_call.__get__(layer)

    def quantized_call(*args, **kwargs):
        with kernel_scope(kernel):
            return original(*args, **kwargs)

    object.__setattr__(layer, "quantized_call", quantized_call)
    object.__setattr__(layer, "autopolicy_kernel", kernel)
