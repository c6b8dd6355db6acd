"""A uint8 x int8 -> int32 matrix product emitted as one HLO dot (the CPU's VNNI path).

``lax.dot_general`` converts operands of different dtypes to the result dtype before XLA sees
them, which turns a u8 x s8 product into a slow s32 one. XLA's CPU backend hands a true
u8 x s8 -> s32 dot to YNNPACK, whose x86 kernel for it uses AVX512-VNNI / AVX-VNNI
(``vpdpbusd``, which multiplies unsigned by signed bytes). The int8 kernel ``"u8s8"``
(:mod:`autopolicy.numerics.int8`) shifts the quantized inputs by +128 into uint8, multiplies
with this primitive, and subtracts ``128 * column_sums(kernel)``: the result equals the
s8 x s8 product exactly.

Whether it beats XLA's own s8 x s8 dot is for a measurement to say: on a CPU without VNNI
(AVX2 only) it is several times slower than float32 (issue 13), which is why it is the default
only where VNNI or AMX-INT8 is present; on an AMX Xeon both int8 dots run at 4-6x float32.

On other platforms the primitive lowers to that s8 x s8 product directly (as a float32 one where
the contraction is not a multiple of 4 long, which XLA:GPU's int8 dot got wrong).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["AVAILABLE", "u8s8_matmul"]


def _define():
    from jax.extend.core import Primitive  # pylint: disable=import-outside-toplevel
    from jax.extend.mlir.dialects import stablehlo  # pylint: disable=import-outside-toplevel
    from jax.interpreters import mlir  # pylint: disable=import-outside-toplevel

    prim = Primitive("autopolicy_u8s8_matmul")

    def abstract_eval(a, b):
        if a.dtype != jnp.uint8 or b.dtype != jnp.int8 or a.ndim != 2 or b.ndim != 2:
            raise TypeError(f"u8s8_matmul takes u8[M,K] and s8[K,N]. Received {a} and {b}")
        if a.shape[1] != b.shape[0]:
            raise TypeError(f"u8s8_matmul: contracted sizes differ: {a.shape} x {b.shape}")
        return jax.core.ShapedArray((a.shape[0], b.shape[1]), jnp.int32)

    def lower_cpu(ctx, a, b):
        dims = stablehlo.DotDimensionNumbers.get(
            lhs_batching_dimensions=[],
            rhs_batching_dimensions=[],
            lhs_contracting_dimensions=[1],
            rhs_contracting_dimensions=[0],
        )
        try:
            out_type = mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
        except TypeError:  # JAX versions whose aval_to_ir_type takes only the aval
            out_type = mlir.aval_to_ir_type(ctx.avals_out[0])
        return [stablehlo.dot_general(out_type, a, b, dims)]

    def reference(a, b):
        signed = (a.astype(jnp.int16) - 128).astype(jnp.int8)
        if a.shape[1] % 4:  # XLA:GPU's int8 dot was wrong for such K (see _int8_accumulate): float32, exact
            acc = jnp.matmul(signed.astype(jnp.float32), b.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST).astype(jnp.int32)
        else:
            acc = jax.lax.dot_general(signed, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc + 128 * jnp.sum(b, axis=0, dtype=jnp.int32)

    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lower_cpu, platform="cpu")
    mlir.register_lowering(prim, mlir.lower_fun(reference, multiple_results=False))
    return prim


try:
    _PRIM = _define()
    AVAILABLE = True
except Exception:  # pragma: no cover - an older or newer JAX without these hooks  # pylint: disable=broad-except
    _PRIM = None
    AVAILABLE = False


@jax.jit
def u8s8_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` for ``a: u8[M, K]``, ``b: s8[K, N]``, accumulated exactly in int32.

    >>> a = jnp.array([[0, 255]], jnp.uint8); b = jnp.array([[1], [-2]], jnp.int8)
    >>> u8s8_matmul(a, b)
    Array([[-510]], dtype=int32)
    """
    return _PRIM.bind(a, b)
