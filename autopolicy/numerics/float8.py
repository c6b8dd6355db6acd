"""float8 with delayed scaling: e4m3 forward (inputs, kernel), e5m2 backward (output gradient).

Each of the three tensors of a float8 product keeps a :class:`Float8Meta`: a history of its
absolute maxima and the scale derived from it. A step quantizes with the current scale
(``x / scale`` clipped to the format's range, then back); afterwards the history rolls by one,
records the step's amax, and the next scale is ``max(history) * 2**margin / fp8_max``, keeping
the old scale when that max is 0 or not finite.

Histories are updated by the gradient: :func:`fp8_einsum`'s backward pass returns the *updated*
metas as their "gradients" (the overwrite-with-gradient convention of Flax's float8 ops), so a
training step that differentiates with respect to them gets their new values and overwrites them.
A forward pass alone (inference) leaves them frozen.

Two kernels run the forward product (:data:`FLOAT8_KERNELS`): ``"emulated"`` rounds both
operands to the e4m3 grid and multiplies the dequantized values in the compute dtype (any
device); ``"fp8_dot"`` multiplies the e4m3 operands themselves, accumulating in float32
(``preferred_element_type``), and rescales the result by the product of the two scales: the
real float8 product of GPUs with compute capability 8.9 or higher (XLA lowers it to cuBLASLt's
float8 matrix product there). They agree to float32 rounding, not bit for bit (the emulated
kernel rounds each dequantized operand; see :func:`fp8_einsum`). The backward pass is the same.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from autopolicy._pytree import pytree_dataclass, replace, set_fields
from autopolicy.numerics import _sharding
from autopolicy.numerics.device import Device, current_device

__all__ = [
    "E4M3",
    "E5M2",
    "E4M3_MAX",
    "E5M2_MAX",
    "Float8Meta",
    "quantize_dequantize",
    "fp8_einsum",
    "FLOAT8_KERNELS",
    "float8_kernel_available",
    "default_float8_kernel",
    "DEFAULT_MARGIN",
    "overwrite_with_gradient",
    "quantize_weights",
    "einsum_kernel",
    "retune",
]

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344
DEFAULT_MARGIN = 0


@pytree_dataclass
class Float8Meta:
    """The delayed-scaling state of one float8 tensor.

    Args:
      history_length: How many steps of amax to remember (>= 1).
      scale: The initial scale (values are divided by it before the cast).

    >>> meta = Float8Meta(4)
    >>> meta.amax_history.shape, float(meta.scale)
    ((4,), 1.0)
    """

    amax_history: jax.Array
    scale: jax.Array

    def __init__(self, history_length: int, scale: float | jax.Array = 1.0):
        if isinstance(history_length, bool) or not isinstance(history_length, int) or history_length < 1:
            raise ValueError(f"history_length must be an int >= 1. Received: {history_length!r}")
        set_fields(
            self,
            amax_history=jnp.zeros((history_length,), jnp.float32),
            scale=jnp.asarray(scale, jnp.float32),
        )

    def update(self, amax: jax.Array, fp8_max: float, margin: int = DEFAULT_MARGIN) -> "Float8Meta":
        """Records ``amax`` and returns the meta holding the scale for the next step."""
        amax = jnp.asarray(amax, jnp.float32)
        # A non-finite amax (an overflowed step) is recorded as 0 so it cannot poison the
        # history for its whole length; the scale then stays where it was (not recomputed from
        # the shorter history, which could lower it right after an overflow).
        finite = jnp.isfinite(amax)
        amax = jnp.where(finite, amax, 0.0)
        history = jnp.roll(self.amax_history, 1).at[0].set(amax)
        top = jnp.max(history)
        new_scale = top * (2.0**margin) / fp8_max
        ok = finite & (top > 0) & jnp.isfinite(new_scale) & (new_scale > 0)
        return replace(self, amax_history=history, scale=jnp.where(ok, new_scale, self.scale))


def _quantize(x: jax.Array, scale: jax.Array, fp8_dtype: Any) -> jax.Array:
    """``x / scale`` saturated to the format's range and cast to it."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale.astype(jnp.float32), -fp8_max, fp8_max).astype(fp8_dtype)


def _dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def quantize_dequantize(x: jax.Array, scale: jax.Array, fp8_dtype: Any) -> jax.Array:
    """Rounds ``x`` to the float8 grid defined by ``scale`` (saturating), in ``x``'s dtype."""
    return _dequantize(_quantize(x, scale, fp8_dtype), scale, x.dtype)


#: The float8 forward kernels (see the module docstring).
FLOAT8_KERNELS = ("emulated", "fp8_dot")


def _check_kernel(kernel: Any) -> None:
    if kernel not in FLOAT8_KERNELS:
        raise ValueError(f"Invalid float8 kernel. Expected one of {FLOAT8_KERNELS} (or None for the "
                         f"device's default). Received: kernel={kernel!r}")


def float8_kernel_available(kernel: str, device: Device) -> bool:
    """Whether ``kernel`` compiles on ``device`` and is worth timing there.

    ``"fp8_dot"`` runs natively on GPUs of compute capability 8.9 or higher; XLA:CPU runs it
    too (converting the operands to float32 inside the dot), so there the measurement decides.
    Elsewhere (older GPUs, TPUs) it is not offered.

    >>> float8_kernel_available("fp8_dot", Device("gpu", compute_capability=(8, 0)))
    False
    """
    _check_kernel(kernel)
    if kernel == "fp8_dot":
        return device.platform == "cpu" or device.has_fp8_dot
    return True


def default_float8_kernel(device: Device | None = None) -> str:
    """``"fp8_dot"`` where the device multiplies float8 natively, else ``"emulated"``.

    Args:
      device: The device; None means :func:`~autopolicy.numerics.device.current_device`.

    >>> default_float8_kernel(Device("gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0"))
    'fp8_dot'
    >>> default_float8_kernel(Device("gpu", "NVIDIA A100-SXM4-40GB", compute_capability="8.0"))
    'emulated'
    """
    device = current_device() if device is None else device
    return "fp8_dot" if device.has_fp8_dot else "emulated"


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def fp8_einsum(
    equation: str,
    x: jax.Array,
    kernel: jax.Array,
    x_meta: Float8Meta,
    kernel_meta: Float8Meta,
    grad_meta: Float8Meta,
    kernel_name: str | None = None,
) -> jax.Array:
    """``einsum(equation, x, kernel)`` with both operands rounded to e4m3 by their scales.

    The backward pass rounds the output gradient to e5m2 with ``grad_meta``'s scale, and
    returns as the metas' "gradients" their updated values (see the module docstring).

    Args:
      equation: A two-operand einsum.
      x: The input; the result has its dtype.
      kernel: The float weights.
      x_meta, kernel_meta, grad_meta: The delayed-scaling state of the input, the kernel and the
        output gradient.
      kernel_name: The forward kernel, one of :data:`FLOAT8_KERNELS` (a static name), or None
        for :func:`default_float8_kernel`. ``"fp8_dot"`` differs from ``"emulated"`` by float32
        rounding (the emulated kernel rounds each dequantized operand to ``x``'s dtype, then
        multiplies; with a 16-bit ``x`` that rounding is the larger one).

    Raises:
      ValueError: for an unknown kernel name.
    """
    del grad_meta  # the backward pass's
    return _product(equation, x, kernel, x_meta, kernel_meta, kernel_name)


def _product(equation, x, kernel, x_meta, kernel_meta, kernel_name):
    """The forward product alone: no amax and no residuals, so an inference forward reduces over
    nothing (the pattern XLA:GPU's GEMM rewriter turns into cuBLASLt's float8 GEMM: an e4m3 dot
    to float32, then a multiply by a broadcast scalar, the product of the two scales)."""
    if kernel_name is None:
        kernel_name = default_float8_kernel()
    _check_kernel(kernel_name)
    x8, k8 = _quantize(x, x_meta.scale, E4M3), _quantize(kernel, kernel_meta.scale, E4M3)
    if kernel_name == "fp8_dot":
        acc = jnp.einsum(equation, x8, k8, preferred_element_type=jnp.float32,
                         out_sharding=_sharding.out_sharding(equation, x8, k8))
        scale = x_meta.scale.astype(jnp.float32) * kernel_meta.scale.astype(jnp.float32)
        return (acc * scale).astype(x.dtype)
    xq, kq = _dequantize(x8, x_meta.scale, x.dtype), _dequantize(k8, kernel_meta.scale, kernel.dtype)
    return jnp.einsum(equation, xq, kq, out_sharding=_sharding.out_sharding(equation, xq, kq))


def _fp8_fwd(equation, x, kernel, x_meta, kernel_meta, grad_meta, kernel_name=None):
    y = _product(equation, x, kernel, x_meta, kernel_meta, kernel_name)
    # The dequantized operands are the backward pass's residuals for both kernels (so both have
    # the same gradient), and the amaxes update the histories there.
    xq = quantize_dequantize(x, x_meta.scale, E4M3)
    kq = quantize_dequantize(kernel, kernel_meta.scale, E4M3)
    return y, (xq, kq, _amax(x), _amax(kernel), x_meta, kernel_meta, grad_meta)


def _fp8_bwd(equation, kernel_name, residuals, g):
    del kernel_name
    xq, kq, x_amax, k_amax, x_meta, kernel_meta, grad_meta = residuals
    gq = quantize_dequantize(g, grad_meta.scale, E5M2)
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(equation, a, b), xq, kq)
    dx, dk = vjp(gq.astype(xq.dtype))
    return (
        dx,
        dk,
        x_meta.update(x_amax, E4M3_MAX),
        kernel_meta.update(k_amax, E4M3_MAX),
        grad_meta.update(_amax(g), E5M2_MAX),
    )


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


def overwrite_with_gradient(old: Any, new: Any) -> Any:
    """Takes the updated metas that :func:`fp8_einsum` returned as gradients.

    A meta whose "gradient" is zero was not used in the step (its layer did not run), so it
    keeps its old value instead of being zeroed. Both arguments are trees of the same structure
    whose leaves are the fields of :class:`Float8Meta` (None leaves are kept as they are).
    """
    is_meta = lambda x: isinstance(x, Float8Meta)  # noqa: E731

    def pick(o, n):
        if not isinstance(o, Float8Meta):
            return o
        used = n.scale > 0
        return replace(
            o,
            amax_history=jnp.where(used, n.amax_history, o.amax_history),
            scale=jnp.where(used, n.scale, o.scale),
        )

    return jax.tree_util.tree_map(pick, old, new, is_leaf=is_meta)


# --- the mode's entry points (autopolicy.numerics.modes) --------------------------------------


def quantize_weights(kernel: jax.Array, contract_axes: Any, op: str, policy: Any, scale_dtype: Any) -> dict:
    """The float8 state of a kernel (which stays in float and keeps training): ``fp8``, the metas
    of the input, the kernel (its scale from the kernel's amax) and the output gradient."""
    del contract_axes, op, scale_dtype
    length = policy.amax_history_length
    kernel_amax = jnp.max(jnp.abs(kernel.astype(jnp.float32)))
    kernel_scale = jnp.where(kernel_amax > 0, kernel_amax / E4M3_MAX, 1.0)
    return {
        "fp8": {
            "input": Float8Meta(length),
            "kernel": Float8Meta(length, kernel_scale),
            "output_grad": Float8Meta(length),
        }
    }


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  kernel: str | None = None) -> jax.Array:
    """The mode's einsum op; ``kernel`` names the float8 kernel (None: the device's default)."""
    del layout, compute_dtype  # the product runs in x's dtype, which is the compute dtype
    meta = weights["fp8"]
    return fp8_einsum(equation, x, weights["kernel"], meta["input"], meta["kernel"], meta["output_grad"], kernel)


def retune(state: dict, policy: Any) -> dict:
    """``state`` with its histories cut or zero-padded to the policy's ``amax_history_length``."""
    length = policy.amax_history_length
    resized = {}
    for key, meta in state["fp8"].items():
        history = meta.amax_history[:length]
        if history.shape[0] < length:
            history = jnp.pad(history, (0, length - history.shape[0]))
        new = Float8Meta(length, meta.scale)
        set_fields(new, amax_history=history)
        resized[key] = new
    return {"fp8": resized}
