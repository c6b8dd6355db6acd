"""What every layer with a quantizable kernel shares: converting its weights between policies and
running the kernel of its quantization mode.

Which modes a layer supports comes from the registry of quantization modes through the layer's
kind (``layer_kind``); how a mode quantizes weights and computes comes from
:mod:`autopolicy.numerics.modes` through the op the layer runs (``kernel_op``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from autopolicy import policies
from autopolicy.nn import _context
from autopolicy.nn._module import Module
from autopolicy.numerics import kernels, modes, weight_only

__all__ = ["QuantizableKernel"]


class _ModesOfLayerKind:
    """``supported_quantization_modes``: the registry's modes for the class's ``layer_kind``."""

    def __get__(self, obj: Any, owner: type) -> tuple[str, ...]:
        return policies.modes_for_layer_kind(owner.layer_kind)


class QuantizableKernel(Module):
    """A layer with a ``kernel`` that has quantized forms.

    Subclasses name their kind (``layer_kind``, one of ``autopolicy.policies.LAYER_KINDS``), the
    op their kernel runs (``kernel_op``, one of ``autopolicy.numerics.modes.OPS``) and which
    axes of the kernel are contracted with the input (:meth:`kernel_contract_axes`); quantized
    weights keep their scales per slice over those axes. Attributes: ``kernel`` (float, or
    quantized), and each mode's state: ``kernel_scale`` and ``kernel_colsum`` (int8, int4),
    ``fp8`` (float8: a dict of :class:`~autopolicy.numerics.float8.Float8Meta` for the input,
    the kernel and the output gradient), ``kernel_scale``, ``kernel_zero``, ``g_idx`` and
    ``awq_scales`` (GPTQ, AWQ: None until ``autopolicy.nn.calibrate_weights`` sets them; the
    float kernel stays until then).
    """

    layer_kind: ClassVar[str]
    kernel_op: ClassVar[str]
    supported_quantization_modes = _ModesOfLayerKind()
    tunable: ClassVar[bool] = True

    def _init_quantization_slots(self) -> None:
        self.kernel = None
        self.kernel_scale = None
        self.kernel_colsum = None
        self.fp8 = None
        #: The static weight parameters of the stored form (int4: the block size).
        self._weights_layout = ()
        #: The layout the kernels get once calibration has seen the weights, or () for
        #: ``_weights_layout``: GPTQ/AWQ add whether the groups are in natural order
        #: (``autopolicy.numerics.weight_only.calibrated_layout``).
        self._calibrated_layout = ()
        #: The kernel (tactic) of the mode that runs the product, or None for the device's
        #: default (``autopolicy.numerics.kernels.default_kernel``). Set by ``with_kernels``.
        self.quantization_kernel = None

    def kernel_contract_axes(self) -> tuple[int, ...]:
        raise NotImplementedError

    # --- the matrix-product form (GPTQ and AWQ calibrate and store a (K, N) kernel) -----------

    def matmul_kernel(self, kernel: jax.Array) -> jax.Array:
        """The float ``kernel`` as the ``(K, N)`` matrix of the product this layer runs."""
        return kernel

    def matmul_rows(self, x: jax.Array) -> jax.Array:
        """An input ``x`` of this layer as the ``(rows, K)`` rows that multiply :meth:`matmul_kernel`."""
        return x.reshape((-1, x.shape[-1]))

    # --- running ------------------------------------------------------------------------------

    def _quantized_kernel(self, *args: Any, compute_dtype: Any, **kwargs: Any) -> Any:
        """Runs the kernel of the stored weights' mode for this layer's op.

        ``args`` and ``kwargs`` are the op's arguments besides ``weights`` and ``layout`` (see
        :mod:`autopolicy.numerics.modes`).
        """
        entry = modes.numerics_of(self._weights_mode)
        weights = {name: getattr(self, name) for name in ("kernel",) + entry.state}
        if entry.is_calibrated is not None and not entry.is_calibrated(weights):
            if _context.is_calibrating() and self.kernel_op == "einsum":
                equation, x = args  # the float kernel is still there, read in the compute dtype
                return jnp.einsum(equation, x, self.kernel).astype(compute_dtype)
            raise weight_only.UncalibratedError(
                f"{self.path!r} has the policy {self.dtype_policy.name!r}, whose weights come from calibration, and "
                "was not calibrated: call autopolicy.nn.calibrate_weights(model, batches) first (it runs the "
                "model on your batches and sets the quantized weights layer by layer).")
        chosen = self.__dict__.get("quantization_kernel")
        if chosen is not None:
            fn = kernels.kernel_spec(self._weights_mode, chosen).fn(self.kernel_op)
        else:
            fn = entry.kernel(self.kernel_op)
        layout = self.__dict__.get("_calibrated_layout") or self._weights_layout
        return fn(*args, weights=weights, layout=layout, compute_dtype=compute_dtype, **kwargs)

    # --- conversions ------------------------------------------------------------------------

    def _target_form(self) -> tuple[str | None, tuple]:
        """The mode and layout the current policy asks the weights to be in."""
        policy = self.dtype_policy
        mode = policy.quantization_mode
        return (mode, modes.numerics_of(mode).layout(policy)) if mode is not None else (None, ())

    def _finish_build(self) -> Module | None:
        mode, layout = self._target_form()
        if mode is None or (mode, layout) == (self._weights_mode, self._weights_layout):
            return None
        new = self._copy(mutable=True)
        new._quantize_weights()
        new._freeze()
        return new

    def _quantize_weights(self) -> None:
        """Converts this mutable copy's float kernel to the form its policy asks for."""
        policy = self.dtype_policy
        entry = modes.numerics_of(policy.quantization_mode)
        arrays = entry.quantize(
            self.kernel, self.kernel_contract_axes(), self.kernel_op, policy, self.variable_dtype
        )
        for key, value in arrays.items():
            object.__setattr__(self, key, value)
        frozen = set(entry.frozen) & set(arrays)
        self._nontrainable = tuple(sorted(set(self._nontrainable) | frozen))
        self._no_autocast = tuple(sorted(set(self._no_autocast) | (set(entry.no_autocast) & set(arrays))))
        self._weights_mode = entry.name
        self._weights_layout = entry.layout(policy)
        self._calibrated_layout = ()

    def kernel_choices(self) -> tuple[str, ...]:
        """The kernels (tactics) that can run this layer's product under its current policy, the
        device's default first; ``()`` when its mode has no choice of kernels (float, int4).

        >>> import jax, jax.numpy as jnp
        >>> import autopolicy.nn as nn
        >>> layer = nn.Dense(8).build(jax.random.key(0), jnp.ones((2, 4))).quantize("int8")
        >>> {"s8s8", "u8s8"} <= set(layer.kernel_choices())  # and "cpu_ffi" where it is built
        True
        """
        mode = self._weights_mode
        if mode is None:
            return ()
        names = tuple(s.name for s in kernels.kernel_specs(mode) if self.kernel_op in s.op_names and s.runnable)
        default = kernels.default_kernel(mode, self.kernel_op)
        return tuple(sorted(names, key=lambda n: n != default))

    def _convert_weights(self, old: Module) -> None:
        if (old._weights_mode, old._weights_layout) != self._target_form():
            self.quantization_kernel = None  # a kernel names a tactic of the old form's mode
        old_form = (old._weights_mode, old._weights_layout)
        new_form = self._target_form()
        if old_form[0] is not None and old_form != new_form:
            self._leave_form(old_form)
        super()._convert_weights(old)
        if new_form[0] is not None and new_form != old_form:
            self._quantize_weights()
        elif new_form[0] is not None:
            entry = modes.numerics_of(new_form[0])
            if entry.retune is not None:
                state = entry.retune({name: getattr(self, name) for name in entry.state}, self.dtype_policy)
                for key, value in state.items():
                    object.__setattr__(self, key, value)

    def _leave_form(self, old_form: tuple[str, tuple]) -> None:
        """Drops the state of the old form, or refuses when the float kernel is gone."""
        entry = modes.numerics_of(old_form[0])
        # GPTQ/AWQ layers keep their float kernel until calibrated: until then they can leave.
        awaiting = entry.is_calibrated is not None and not entry.is_calibrated(
            {name: getattr(self, name) for name in entry.state})
        if entry.replaces_kernel and not awaiting:
            layout = f" (layout {old_form[1]})" if old_form[1] else ""
            raise ValueError(
                f"{self.path!r} holds {old_form[0]} weights{layout} and cannot become "
                f"{self.dtype_policy.name!r}: {old_form[0]} quantization is lossy. Keep the float "
                "model and derive each variant from it."
            )
        for name in entry.state:
            object.__setattr__(self, name, None)
        self._weights_mode = None
        self._weights_layout = ()
        self._calibrated_layout = ()
