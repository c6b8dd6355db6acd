"""The policy classes: plain, int8-quantized and float8-quantized.

Policies are frozen dataclasses whose fields are strings and ints, so they compare by value,
hash, pickle, and can be static arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import numpy as np

from autopolicy.policies import _modes, _names

__all__ = [
    "DTypePolicy",
    "FloatDTypePolicy",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "Int4DTypePolicy",
    "GPTQDTypePolicy",
    "AWQDTypePolicy",
]


def _global_source_name() -> str:
    """The global policy's name, or its source name when the global policy is quantized."""
    from autopolicy.policies import _global  # pylint: disable=import-outside-toplevel

    policy = _global.dtype_policy()
    return getattr(policy, "source_name", None) or policy.name


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class DTypePolicy:
    """A dtype policy: the dtype a layer computes in and the dtype it stores variables in.

    Args:
      name: A float dtype (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``),
        ``"mixed_float16"`` or ``"mixed_bfloat16"`` (compute in 16 bits, variables in float32),
        or a non-float dtype such as ``"int32"``. None means the global policy's name.

    Raises:
      TypeError: if ``name`` is neither a string nor None.
      ValueError: if ``name`` is not a valid policy name.

    >>> policy = DTypePolicy("mixed_bfloat16")
    >>> policy.compute_dtype, policy.variable_dtype
    ('bfloat16', 'float32')
    >>> policy
    <DTypePolicy "mixed_bfloat16">
    """

    name: str
    compute_dtype: str
    variable_dtype: str

    quantization_mode: ClassVar[str | None] = None
    #: The class name in Keras JSON (and in the registry of quantization modes).
    keras_class_name: ClassVar[str] = "DTypePolicy"

    def __init__(self, name: str | None = None):
        if name is None:
            name = _global_source_name()
        _names.check_is_str(name)
        if _names.split_quantized(name) is not None:
            raise ValueError(
                f"{name!r} is a quantized policy name: use autopolicy.policies.get({name!r}) or "
                f"one of {'/'.join(POLICY_CLASSES)}. Received: name={name!r}"
            )
        dtypes = _names.parse_plain(name)
        self._set_fields(name=name, compute_dtype=dtypes.compute, variable_dtype=dtypes.variable)

    def _set_fields(self, **fields: Any) -> None:
        for key, value in fields.items():
            object.__setattr__(self, key, value)

    @property
    def should_cast_variables(self) -> bool:
        """Whether variables must be cast to a different dtype for computation (TF 2 name)."""
        return self.compute_dtype != self.variable_dtype

    def convert_input(self, x: Any, autocast: bool, dtype: Any) -> Any:
        """Casts a floating-point array to ``dtype`` when ``autocast`` is on.

        Integer and boolean arrays (token ids, masks) and Python scalars are returned unchanged.

        >>> import numpy as np
        >>> DTypePolicy("float16").convert_input(np.ones(2), True, "float16").dtype
        dtype('float16')
        >>> DTypePolicy("float16").convert_input(np.arange(2), True, "float16").dtype
        dtype('int64')
        """
        x_dtype = getattr(x, "dtype", None)
        if not autocast or x_dtype is None or not hasattr(x, "astype"):
            return x
        if not _names.is_floating(x_dtype) or np.dtype(x_dtype) == np.dtype(dtype):
            return x
        return x.astype(np.dtype(dtype))

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DTypePolicy":
        return cls(**config)

    def __repr__(self) -> str:
        return f'<{type(self).__name__} "{self.name}">'


# Keras kept this name for compatibility; here it is the very same class.
FloatDTypePolicy = DTypePolicy


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class QuantizedDTypePolicy(DTypePolicy):
    """A policy whose layers run quantized kernels on top of a float source policy.

    Args:
      mode: A quantization mode this class builds in the registry of quantization modes:
        ``"int8"``, or ``"int4"`` (int4 weights with one scale per output channel).
      source_name: The non-quantized policy the float parts follow (``"float32"``,
        ``"mixed_bfloat16"``, ...). None means the global policy's name. int8 with a float16
        compute dtype is refused: the rescaled int32 products overflow float16.

    >>> QuantizedDTypePolicy("int8", "mixed_bfloat16")
    <QuantizedDTypePolicy "int8_from_mixed_bfloat16">
    """

    mode: str
    source_name: str

    keras_class_name: ClassVar[str] = "QuantizedDTypePolicy"

    def __init__(self, mode: str, source_name: str | None = None):
        self._init_quantized(mode, source_name)

    def _init_quantized(self, spelling: str, source_name: str | None, **extra: Any) -> None:
        """Sets the fields from the mode as spelled in the name (``"int4/128"``) and the source."""
        mode = _names.check_mode(spelling, self.keras_class_name)
        if source_name is None:
            source_name = _global_source_name()
        dtypes = _names.check_source(mode, source_name)
        self._set_fields(
            name=f"{spelling}_from_{source_name}",
            compute_dtype=dtypes.compute,
            variable_dtype=dtypes.variable,
            mode=mode.name,
            source_name=source_name,
            **extra,
        )

    @property
    def quantization_mode(self) -> str:  # type: ignore[override]
        return self.mode

    def get_config(self) -> dict[str, Any]:
        return {"mode": self.mode, "source_name": self.source_name}


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class QuantizedFloat8DTypePolicy(QuantizedDTypePolicy):
    """A float8 policy with delayed scaling.

    Args:
      mode: ``"float8"``.
      source_name: The non-quantized policy the float parts follow; None means the global one.
      amax_history_length: How many steps of absolute maxima each float8 tensor remembers to
        compute its scale (an int from 1 to 2**20).

    >>> QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=16).amax_history_length
    16
    """

    amax_history_length: int

    keras_class_name: ClassVar[str] = "QuantizedFloat8DTypePolicy"

    def __init__(
        self,
        mode: str = "float8",
        source_name: str | None = None,
        amax_history_length: int = _names.DEFAULT_AMAX_HISTORY_LENGTH,
    ):
        if isinstance(amax_history_length, bool) or not isinstance(
            amax_history_length, (int, np.integer)
        ):
            raise TypeError(
                "amax_history_length must be an integer. "
                f"Received: amax_history_length={amax_history_length!r}"
            )
        low, high = _names.MIN_AMAX_HISTORY_LENGTH, _names.MAX_AMAX_HISTORY_LENGTH
        if not low <= amax_history_length <= high:
            raise ValueError(
                f"amax_history_length must be between {low} and {high} (2**20). "
                f"Received: amax_history_length={amax_history_length!r}"
            )
        self._init_quantized(mode, source_name, amax_history_length=int(amax_history_length))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "amax_history_length": self.amax_history_length}


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Int4DTypePolicy(QuantizedDTypePolicy):
    """An int4 policy with a block size, as Keras 3.15's ``Int4DTypePolicy``.

    Args:
      mode: ``"int4/<block_size>"``: ``<block_size>`` consecutive inputs (along the contracted
        axis) share one scale per output, e.g. ``"int4/128"``; ``"int4/-1"`` is one scale per
        output channel (the same weights as ``QuantizedDTypePolicy("int4")``).
      source_name: The non-quantized policy the float parts follow; None means the global one.

    Raises:
      ValueError: for another mode, or a block size that is not -1 or a positive integer.

    >>> policy = Int4DTypePolicy("int4/128", "float32")
    >>> policy.name, policy.quantization_mode, policy.block_size, policy.get_config()["mode"]
    ('int4/128_from_float32', 'int4', 128, 'int4/128')
    """

    block_size: int

    keras_class_name: ClassVar[str] = "Int4DTypePolicy"

    def __init__(self, mode: str, source_name: str | None = None):
        self._init_quantized(mode, source_name, block_size=_int4_block_size(mode))

    def get_config(self) -> dict[str, Any]:
        return {"mode": f"{self.mode}/{self.block_size}", "source_name": self.source_name}


_BLOCK_FORMAT = "'int4/<block_size>' with block_size -1 (per output channel) or a positive integer, e.g. 'int4/128'"


def _int4_block_size(mode: object) -> int:
    """The block size written in ``mode`` (``"int4/128"`` -> 128), validated."""
    _names.check_mode(mode, Int4DTypePolicy.keras_class_name)  # also refuses non-strings
    text = mode.partition("/")[2]  # type: ignore[union-attr]
    # Only the canonical decimal spelling, so that equal policies have equal names.
    if not re.fullmatch(r"-?(0|[1-9][0-9]*)", text):
        raise ValueError(f"Invalid mode for Int4DTypePolicy. Expected {_BLOCK_FORMAT}. Received: mode={mode!r}")
    block_size = int(text)
    if block_size == 0 or block_size < -1:
        raise ValueError(
            "Invalid int4 block size. Expected -1 (per output channel) or a positive integer. "
            f"Received: block_size={block_size} (in mode={mode!r})"
        )
    return block_size


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class _WeightOnlyDTypePolicy(QuantizedDTypePolicy):
    """The shared part of Keras 3.15's GPTQ and AWQ policies: ``"<mode>/<weight_bits>/<group_size>"``."""

    weight_bits: int
    group_size: int

    #: The bit widths the class accepts (Keras's choices).
    WEIGHT_BITS: ClassVar[tuple[int, ...]] = ()

    def __init__(self, mode: str, source_name: str | None = None):
        bits, group_size = self._parse_mode(mode)
        self._init_quantized(mode, source_name, weight_bits=bits, group_size=group_size)

    @classmethod
    def _parse_mode(cls, mode: object) -> tuple[int, int]:
        entry = _names.check_mode(mode, cls.keras_class_name)  # also refuses non-strings
        expected = f"'{entry.name}/<weight_bits>/<group_size>', e.g. '{entry.example}'"
        parts = mode.split("/")  # type: ignore[union-attr]
        # Only canonical decimal spellings, so that equal policies have equal names.
        if len(parts) != 3 or not all(re.fullmatch(r"-?(0|[1-9][0-9]*)", p) for p in parts[1:]):
            raise ValueError(f"Invalid mode for {cls.keras_class_name}. Expected {expected}, with integer "
                             f"<weight_bits> and <group_size>. Received: mode={mode!r}")
        bits, group_size = int(parts[1]), int(parts[2])
        if bits not in cls.WEIGHT_BITS:
            raise ValueError(f"Invalid weight_bits for {cls.keras_class_name}. Expected one of {cls.WEIGHT_BITS}. "
                             f"Received: weight_bits={bits} (in mode={mode!r})")
        if group_size == 0 or group_size < -1:
            raise ValueError(
                f"Invalid group_size for {cls.keras_class_name}. Expected -1 (one group per output channel) or a "
                f"positive integer. Received: group_size={group_size} (in mode={mode!r})")
        return bits, group_size

    def get_config(self) -> dict[str, Any]:
        return {"mode": f"{self.mode}/{self.weight_bits}/{self.group_size}", "source_name": self.source_name}


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class GPTQDTypePolicy(_WeightOnlyDTypePolicy):
    """A GPTQ policy, as Keras 3.15's ``GPTQDTypePolicy``: weight-only quantization whose weights
    are set by calibration (``autopolicy.nn.calibrate_weights``).

    Args:
      mode: ``"gptq/<weight_bits>/<group_size>"``: 2, 3, 4 or 8 bits; groups of ``<group_size>``
        inputs share a scale and zero point per output, or -1 for one per output channel.
      source_name: The non-quantized policy the float parts follow; None means the global one.

    Raises:
      ValueError: for another mode, bits not in (2, 3, 4, 8), or a group size that is not -1 or
        a positive integer.

    >>> policy = GPTQDTypePolicy("gptq/4/128", "float32")
    >>> policy.name, policy.quantization_mode, policy.weight_bits, policy.group_size
    ('gptq/4/128_from_float32', 'gptq', 4, 128)
    >>> policy.get_config()
    {'mode': 'gptq/4/128', 'source_name': 'float32'}
    """

    keras_class_name: ClassVar[str] = "GPTQDTypePolicy"
    WEIGHT_BITS: ClassVar[tuple[int, ...]] = (2, 3, 4, 8)


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class AWQDTypePolicy(_WeightOnlyDTypePolicy):
    """An AWQ policy, as Keras 3.15's ``AWQDTypePolicy``: 4-bit weight-only quantization with
    activation-aware input-channel scales, set by calibration (``autopolicy.nn.calibrate_weights``).

    Args:
      mode: ``"awq/4/<group_size>"`` (Keras's AWQ has 4 bits only); ``<group_size>`` -1 or a
        positive integer.
      source_name: The non-quantized policy the float parts follow; None means the global one.

    >>> AWQDTypePolicy("awq/4/-1", "mixed_bfloat16")
    <AWQDTypePolicy "awq/4/-1_from_mixed_bfloat16">
    """

    keras_class_name: ClassVar[str] = "AWQDTypePolicy"
    WEIGHT_BITS: ClassVar[tuple[int, ...]] = (4,)


#: The quantized policy classes by Keras class name (the registry names them by these).
POLICY_CLASSES: dict[str, type[QuantizedDTypePolicy]] = {
    cls.keras_class_name: cls
    for cls in (QuantizedDTypePolicy, QuantizedFloat8DTypePolicy, Int4DTypePolicy, GPTQDTypePolicy, AWQDTypePolicy)
}


def _check_registry_classes() -> None:
    missing = [f.class_name for m in _modes.MODES for f in m.forms if f.class_name not in POLICY_CLASSES]
    if missing:
        raise ValueError(f"The registry of quantization modes names unknown policy classes: {missing}")


_check_registry_classes()
