"""Policy names: the constants every check and error message is built from, and the parser."""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with NumPy)
import numpy as np

from autopolicy.policies import _modes

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
MIXED_POLICIES = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
# Keras accepts non-float dtypes for a plain policy; floats are then cast to them. "int8" is left
# out on purpose: alone it reads as the quantization mode, so it gets a pointed error instead.
OTHER_DTYPES = ("bool", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
QUANTIZATION_MODES = _modes.QUANTIZATION_MODES
#: The global policy until one is set, and the policy every comparison is made against.
DEFAULT_POLICY_NAME = "float32"
DEFAULT_AMAX_HISTORY_LENGTH = 1024  # Keras's default
MIN_AMAX_HISTORY_LENGTH = 1
# Far past any use (Keras uses 1024) and small enough that three float32 histories per layer
# stay at 12 MiB: a typo such as 10**30 is refused here, not deep inside JAX later.
MAX_AMAX_HISTORY_LENGTH = 2**20

PLAIN_NAMES = FLOAT_DTYPES + tuple(MIXED_POLICIES) + OTHER_DTYPES
FLOAT_SOURCE_NAMES = FLOAT_DTYPES + tuple(MIXED_POLICIES)
_SEPARATOR = "_from_"

VALID_FORMS = (
    f"a float dtype {FLOAT_DTYPES}, a mixed policy {tuple(MIXED_POLICIES)}, "
    f"a non-float dtype {OTHER_DTYPES}, or '<mode>_from_<source>' with mode in "
    f"{_modes.SPELLINGS} and source a float or mixed name (e.g. 'int8_from_float32')"
)


class DTypes(NamedTuple):
    compute: str
    variable: str


def check_is_str(name: object, argument: str = "name") -> str:
    if not isinstance(name, str):
        raise TypeError(
            f"A dtype policy {argument} must be a string. "
            f"Received: {argument}={name!r} of type {type(name).__name__}"
        )
    return name


def parse_plain(name: str) -> DTypes:
    """Returns the compute and variable dtypes of a non-quantized policy name."""
    if name in MIXED_POLICIES:
        return DTypes(MIXED_POLICIES[name], "float32")
    if name in FLOAT_DTYPES or name in OTHER_DTYPES:
        return DTypes(name, name)
    raise ValueError(_invalid_name_message(name))


def split_quantized(name: str) -> tuple[str, str] | None:
    """Splits ``'<mode>_from_<source>'`` into ``(mode, source)``; None for other names."""
    mode, sep, source = name.partition(_SEPARATOR)
    if not sep:
        return None
    return mode, source


def check_mode(spelling: object, cls_name: str) -> _modes.QuantizationMode:
    """The registry entry of the mode ``spelling`` is written in, if class ``cls_name`` builds it."""
    found = _modes.find_form(spelling) if isinstance(spelling, str) else None
    if found is None or found[1].class_name != cls_name:
        valid = tuple(f.spelling for f in _modes.forms_of_class(cls_name))
        hint = f" (use {found[1].class_name} for mode={spelling!r})" if found else ""
        raise ValueError(
            f"Invalid quantization mode for {cls_name}. Expected one of {valid}. "
            f"Received: mode={spelling!r}{hint}"
        )
    return found[0]


def check_source(mode: _modes.QuantizationMode, source_name: object) -> DTypes:
    """Validates the source of a quantized policy and returns its dtypes."""
    check_is_str(source_name, "source_name")
    if source_name not in FLOAT_SOURCE_NAMES:
        raise ValueError(
            f"Invalid source policy for quantization mode {mode.name!r}. Expected one of "
            f"{FLOAT_SOURCE_NAMES}. Received: source_name={source_name!r}"
        )
    dtypes = parse_plain(source_name)
    if dtypes.compute in mode.refused_compute_dtypes:
        accepted = [s for s in FLOAT_SOURCE_NAMES if parse_plain(s).compute not in mode.refused_compute_dtypes]
        # The same source with the nearest accepted compute dtype (mixed_float16 -> mixed_bfloat16).
        swapped = source_name.replace(dtypes.compute, "bfloat16")
        suggestion = swapped if swapped in accepted else accepted[0]
        raise ValueError(
            f"Quantization mode {mode.name!r} does not support compute dtype {dtypes.compute!r}: "
            f"{mode.refusal_reason}. Use a source in {tuple(accepted)}, e.g. "
            f"'{mode.name}_from_{suggestion}'. Received: source_name={source_name!r}"
        )
    return dtypes


def _invalid_name_message(name: str) -> str:
    found = _modes.find_form(name)
    if found is None and name in QUANTIZATION_MODES:
        # A mode spelled only with parameters (Keras's "gptq/<weight_bits>/<group_size>").
        form = _modes.get_quantization_mode(name).forms[0]
        return (
            f"{name!r} is a quantization mode, not a policy: add its parameters and source, "
            f"'{form.spelling}_from_<source>', e.g. '{form.example}_from_float32'. Received: name={name!r}"
        )
    if found is not None:
        # A parameterized spelling may hold a bad parameter: suggest the form's own example.
        example = name if name == found[1].spelling else found[1].example
        return (
            f"{name!r} is a quantization mode, not a policy: add its source, "
            f"'{name}_from_<source>', e.g. '{example}_from_float32'. Received: name={name!r}"
        )
    return f"Invalid dtype policy name. Expected {VALID_FORMS}. Received: name={name!r}"


def dtype_name(dtype: object) -> str:
    """The canonical name of a NumPy/JAX dtype or scalar type (``jnp.bfloat16`` -> 'bfloat16')."""
    return np.dtype(dtype).name


def is_floating(dtype: object) -> bool:
    """True for float dtypes, including the ml_dtypes ones (bfloat16, float8_*)."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or (dt.kind == "V" and "float" in dt.name)
