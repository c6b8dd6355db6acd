"""How each quantization mode runs: its weight quantizer and kernels, keyed by the mode names of
the registry of quantization modes (:mod:`autopolicy.policies._modes`).

Numerics know nothing of layers: a kernel serves an *op*, and each layer says which op it runs.

- ``"einsum"``: ``kernel(equation, x, weights, layout, compute_dtype)``, a two-operand einsum
  without ellipsis (Dense, EinsumDense).
- ``"conv2d"``: ``kernel(x, weights, layout, compute_dtype, strides, padding)``, NHWC x HWIO.
- ``"gather"``: ``kernel(ids, weights, layout, compute_dtype)``, rows of a table (Embedding).

``weights`` maps attribute names to the arrays the quantizer made (``"kernel"`` and the mode's
``state``); ``layout`` is the mode's static weight parameters read from the policy (int4: its
block size). A mode's quantizer is
``quantize(kernel, contract_axes, op, policy, scale_dtype) -> {attribute: array}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from autopolicy.numerics import awq, float8, gptq, int4, int8, weight_only
from autopolicy.policies import QUANTIZATION_MODES

__all__ = ["OPS", "ModeNumerics", "NUMERICS", "numerics_of"]

OPS = ("einsum", "conv2d", "gather")


def _no_layout(policy: Any) -> tuple:
    del policy
    return ()


@dataclasses.dataclass(frozen=True)
class ModeNumerics:
    """The execution side of one quantization mode.

    Attributes:
      name: The mode's name in the registry (``"int8"``).
      quantize: The weight quantizer (see the module docstring for its signature).
      kernels: ``(op, kernel)`` pairs, one per op the mode runs.
      state: The attributes the quantizer sets besides ``kernel``.
      replaces_kernel: True when the float kernel is replaced (int8, int4: lossy, so a layer
        cannot go back to float); False when it stays and keeps training (float8).
      frozen: Attributes that are not trained.
      no_autocast: Attributes read in their stored dtype, never cast to the compute dtype.
      layout: ``layout(policy) -> tuple``: the weight parameters that need a new quantization
        when they change (int4's block size); ``()`` for none.
      retune: ``retune(state, policy) -> state`` for a policy of the same mode and layout whose
        other parameters changed (float8's history length), or None.
      is_calibrated: For modes whose weights come from calibration (GPTQ, AWQ):
        ``is_calibrated(weights) -> bool``; None for modes that quantize from the weights alone.
    """

    name: str
    quantize: Callable[..., dict]
    kernels: tuple[tuple[str, Callable[..., Any]], ...]
    state: tuple[str, ...]
    replaces_kernel: bool
    frozen: tuple[str, ...] = ()
    no_autocast: tuple[str, ...] = ()
    layout: Callable[[Any], tuple] = _no_layout
    retune: Callable[[dict, Any], dict] | None = None
    is_calibrated: Callable[[dict], bool] | None = None

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(op for op, _ in self.kernels)

    def kernel(self, op: str) -> Callable[..., Any]:
        """The kernel of ``op``.

        Raises:
          ValueError: if the mode has no kernel for ``op``.

        >>> numerics_of("int8").kernel("gather").__name__
        'gather_kernel'
        """
        for name, fn in self.kernels:
            if name == op:
                return fn
        raise ValueError(f"Quantization mode {self.name!r} has no {op!r} kernel: it runs {self.ops}.")


NUMERICS: tuple[ModeNumerics, ...] = (
    ModeNumerics(
        name="int8",
        quantize=int8.quantize_weights,
        kernels=(("einsum", int8.einsum_kernel), ("conv2d", int8.conv2d_kernel), ("gather", int8.gather_kernel)),
        state=("kernel_scale", "kernel_colsum"),
        replaces_kernel=True,
        frozen=("kernel", "kernel_scale", "kernel_colsum"),
        # The rescale runs in float32; reading the scale in a 16-bit compute dtype would round it
        # (bfloat16: up to 0.4% per output channel) before it is used.
        no_autocast=("kernel_scale",),
    ),
    ModeNumerics(
        name="float8",
        quantize=float8.quantize_weights,
        kernels=(("einsum", float8.einsum_kernel),),
        state=("fp8",),
        replaces_kernel=False,
        retune=float8.retune,
    ),
    ModeNumerics(
        name="int4",
        quantize=int4.quantize_weights,
        kernels=(("einsum", int4.einsum_kernel),),
        state=("kernel_scale", "kernel_colsum"),
        replaces_kernel=True,
        frozen=("kernel", "kernel_scale", "kernel_colsum"),
        no_autocast=("kernel_scale",),
        layout=int4.block_size_of,
    ),
    ModeNumerics(
        name="gptq",
        quantize=gptq.quantize_weights,
        kernels=(("einsum", weight_only.einsum_kernel),),
        state=("kernel_scale", "kernel_zero", "g_idx"),
        replaces_kernel=True,
        frozen=("kernel", "kernel_scale", "kernel_zero", "g_idx"),
        # g_idx holds group numbers (bfloat16 rounds them past 256); scales are applied in float32.
        no_autocast=("kernel_scale", "g_idx"),
        layout=weight_only.layout_of,
        is_calibrated=weight_only.is_calibrated,
    ),
    ModeNumerics(
        name="awq",
        quantize=awq.quantize_weights,
        kernels=(("einsum", weight_only.einsum_kernel),),
        state=("kernel_scale", "kernel_zero", "g_idx", "awq_scales"),
        replaces_kernel=True,
        frozen=("kernel", "kernel_scale", "kernel_zero", "g_idx", "awq_scales"),
        no_autocast=("kernel_scale", "g_idx", "awq_scales"),
        layout=weight_only.layout_of,
        is_calibrated=weight_only.is_calibrated,
    ),
)


def numerics_of(mode: str) -> ModeNumerics:
    """The execution side of quantization mode ``mode``.

    Raises:
      ValueError: if the mode has no numerics entry.
    """
    for entry in NUMERICS:
        if entry.name == mode:
            return entry
    raise ValueError(
        f"Invalid quantization mode. Expected one of {tuple(e.name for e in NUMERICS)}. Received: mode={mode!r}"
    )


def _check_against_registry() -> None:
    names = tuple(e.name for e in NUMERICS)
    if sorted(names) != sorted(QUANTIZATION_MODES):
        raise ValueError(
            f"Every registered quantization mode needs numerics and vice versa: the registry has "
            f"{QUANTIZATION_MODES}, autopolicy.numerics.modes has {names}."
        )
    for entry in NUMERICS:
        unknown = [op for op in entry.ops if op not in OPS]
        if unknown:
            raise ValueError(f"Numerics of {entry.name!r} name unknown ops {unknown}; ops are {OPS}.")


_check_against_registry()
