"""What every layer with a quantizable kernel shares: converting its weights between policies."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp

from autopolicy.nn._module import Module
from autopolicy.numerics import float8, int8

__all__ = ["QuantizableKernel"]


class QuantizableKernel(Module):
    """A layer with a ``kernel`` that has int8 and/or float8 forms.

    Subclasses say which axes of the kernel are contracted with the input
    (:meth:`kernel_contract_axes`); int8 keeps one scale per slice over those axes.
    Attributes: ``kernel`` (float, or int8 once quantized), ``kernel_scale`` and, for matrix products, ``kernel_colsum`` (int8 only),
    ``fp8`` (float8 only: a dict of :class:`~autopolicy.numerics.float8.Float8Meta` for the
    input, the kernel and the output gradient).
    """

    supported_quantization_modes: ClassVar[tuple[str, ...]] = ("int8", "float8")
    tunable: ClassVar[bool] = True
    #: Whether the int8 product is a matrix product that can use precomputed column sums.
    uses_column_sums: ClassVar[bool] = False

    def _init_quantization_slots(self) -> None:
        self.kernel = None
        self.kernel_scale = None
        self.kernel_colsum = None
        self.fp8 = None

    def kernel_contract_axes(self) -> tuple[int, ...]:
        raise NotImplementedError

    # --- conversions ------------------------------------------------------------------------

    def _finish_build(self) -> Module | None:
        mode = self.dtype_policy.quantization_mode
        if mode is None or mode == self._weights_mode:
            return None
        new = self._copy(mutable=True)
        new._quantize_weights(mode)
        new._freeze()
        return new

    def _quantize_weights(self, mode: str) -> None:
        """Converts this mutable copy's float kernel to ``mode``'s form."""
        if mode == "int8":
            kernel_q, scale = int8.quantize_symmetric(
                self.kernel, self.kernel_contract_axes(), scale_dtype=self.variable_dtype
            )
            object.__setattr__(self, "kernel", kernel_q)
            object.__setattr__(self, "kernel_scale", scale)
            frozen = {"kernel", "kernel_scale"}
            if self.uses_column_sums:
                # Measured: recomputing them at every call halves the int8 speed-up at 128 rows.
                colsum = int8.column_sums(kernel_q, self.kernel_contract_axes())
                object.__setattr__(self, "kernel_colsum", colsum)
                frozen.add("kernel_colsum")
            self._nontrainable = tuple(sorted(set(self._nontrainable) | frozen))
            # The rescale runs in float32; reading the scale in a 16-bit compute dtype would
            # round it (bfloat16: up to 0.4% per output channel) before it is used.
            self._no_autocast = tuple(sorted(set(self._no_autocast) | {"kernel_scale"}))
        else:
            length = self.dtype_policy.amax_history_length
            kernel_amax = jnp.max(jnp.abs(self.kernel.astype(jnp.float32)))
            kernel_scale = jnp.where(kernel_amax > 0, kernel_amax / float8.E4M3_MAX, 1.0)
            object.__setattr__(
                self,
                "fp8",
                {
                    "input": float8.Float8Meta(length),
                    "kernel": float8.Float8Meta(length, kernel_scale),
                    "output_grad": float8.Float8Meta(length),
                },
            )
        self._weights_mode = mode

    def _convert_weights(self, old: Module) -> None:
        old_mode, new_mode = old._weights_mode, self.dtype_policy.quantization_mode
        if old_mode == "int8" and new_mode != "int8":
            raise ValueError(
                f"{self.path!r} holds int8 weights and cannot become {self.dtype_policy.name!r}: "
                "int8 quantization is lossy. Keep the float model and derive each variant from it."
            )
        if old_mode == "float8" and new_mode != "float8":
            object.__setattr__(self, "fp8", None)
            self._weights_mode = None
        super()._convert_weights(old)
        if new_mode is not None and new_mode != old_mode:
            self._quantize_weights(new_mode)
        elif new_mode == "float8":
            self._resize_histories(self.dtype_policy.amax_history_length)

    def _resize_histories(self, length: int) -> None:
        resized = {}
        for key, meta in self.fp8.items():
            history = meta.amax_history[:length]
            if history.shape[0] < length:
                history = jnp.pad(history, (0, length - history.shape[0]))
            new = float8.Float8Meta(length, meta.scale)
            object.__setattr__(new, "amax_history", history)
            resized[key] = new
        object.__setattr__(self, "fp8", resized)
