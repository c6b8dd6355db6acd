"""The registry of quantization modes: one table that every part naming a mode reads.

An entry holds the policy-level facts of a mode, with no JAX in sight: how the mode part of a
``'<mode>_from_<source>'`` name is spelled and which policy class (and Keras JSON class) each
spelling builds with which config keys, the compute dtypes the mode refuses, the layer kinds
that have a kernel for it, and its colour in reports. The execution facts (the weight quantizer
and the kernels) are attached on the numerics side under the same mode name, in
:mod:`autopolicy.numerics.modes`.

Adding a mode: append a :class:`QuantizationMode` to ``MODES`` below (a new policy class only if
its config differs from ``QuantizedDTypePolicy``'s), write its numerics module (a weight
quantizer and a kernel per op it runs) and list it in ``autopolicy.numerics.modes``. Policy
names, Keras JSON, ``nn`` quantization and each layer's ``supported_quantization_modes`` (which
the search reads through its adapter) and the report colours then know it.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "PolicyForm",
    "QuantizationMode",
    "MODES",
    "QUANTIZATION_MODES",
    "LAYER_KINDS",
    "SPELLINGS",
    "get_quantization_mode",
    "find_form",
    "forms_of_class",
    "modes_for_layer_kind",
]

#: The layer kinds a mode can run on (each ``autopolicy.nn`` layer class with a quantizable
#: kernel names its kind; adapters of other frameworks map their layers onto these).
LAYER_KINDS = ("dense", "einsum_dense", "conv", "embedding")

_QUANTIZED_KEYS = ("mode", "source_name")


@dataclasses.dataclass(frozen=True)
class PolicyForm:
    """One spelling of a mode in policy names, and the policy class it builds.

    Attributes:
      spelling: The mode part of ``'<mode>_from_<source>'``: the mode name (``"int8"``), or the
        mode name, a slash and a parameter in angle brackets (``"int4/<block_size>"``), which
        matches every ``"int4/..."`` (the class then validates the parameter).
      class_name: The policy class it builds; also its ``class_name`` in Keras JSON.
      config_keys: The keys of that class's config (``get_config()``, Keras's JSON config).
      example: A valid spelling, used in messages.
    """

    spelling: str
    class_name: str
    config_keys: tuple[str, ...]
    example: str

    def matches(self, mode: str) -> bool:
        """Whether ``mode`` (the part before ``_from_``) is written in this form.

        >>> PolicyForm("int4/<block_size>", "Int4DTypePolicy", ("mode",), "int4/128").matches("int4/64")
        True
        """
        head, slash, _ = self.spelling.partition("/")
        return mode.startswith(head + "/") if slash else mode == self.spelling


@dataclasses.dataclass(frozen=True)
class QuantizationMode:
    """The policy-level facts of one quantization mode.

    Attributes:
      name: The mode (``policy.quantization_mode``), e.g. ``"int8"``.
      summary: One line on what runs quantized.
      forms: How its names are spelled and which policy class each spelling builds.
      layer_kinds: The kinds of layer (from ``LAYER_KINDS``) with a kernel for this mode.
      color: Its colour in report figures (for ``'<name>_from_float32'``).
      refused_compute_dtypes: Compute dtypes its policies refuse.
      refusal_reason: Why, for the error message.
      calibrated: True when the quantized weights come from a calibration pass over real inputs
        (GPTQ, AWQ: ``autopolicy.nn.calibrate_weights``), not from the weights alone; such
        modes run only once calibrated, so the search does not offer them as candidates.
    """

    name: str
    summary: str
    forms: tuple[PolicyForm, ...]
    layer_kinds: tuple[str, ...]
    color: str
    refused_compute_dtypes: tuple[str, ...] = ()
    refusal_reason: str = ""
    calibrated: bool = False

    @property
    def example(self) -> str:
        """The spelling error messages suggest: the first form's example."""
        return self.forms[0].example


MODES: tuple[QuantizationMode, ...] = (
    QuantizationMode(
        name="int8",
        summary="int8 weights per output channel; inputs quantized per row; int32 accumulation",
        forms=(PolicyForm("int8", "QuantizedDTypePolicy", _QUANTIZED_KEYS, "int8"),),
        layer_kinds=("dense", "einsum_dense", "conv", "embedding"),
        color="#55a868",
        refused_compute_dtypes=("float16",),
        # The rescaled int32 products leave float16's range (65504) easily.
        refusal_reason="int8 rescaling overflows float16 easily",
    ),
    QuantizationMode(
        name="float8",
        summary="e4m3 inputs and kernel, e5m2 output gradient, delayed scaling",
        forms=(
            PolicyForm(
                "float8",
                "QuantizedFloat8DTypePolicy",
                _QUANTIZED_KEYS + ("amax_history_length",),
                "float8",
            ),
        ),
        layer_kinds=("dense", "einsum_dense"),
        color="#8172b3",
    ),
    QuantizationMode(
        name="int4",
        summary="int4 weights packed two to a byte, scales per output channel or per block of "
        "the contracted axis; inputs quantized to int8 per row; int32 accumulation",
        forms=(
            # Per output channel, as Keras 3 names it: QuantizedDTypePolicy("int4", ...).
            PolicyForm("int4", "QuantizedDTypePolicy", _QUANTIZED_KEYS, "int4"),
            # Keras 3.15's Int4DTypePolicy: blocks of <block_size> inputs, or -1 per channel.
            PolicyForm("int4/<block_size>", "Int4DTypePolicy", _QUANTIZED_KEYS, "int4/128"),
        ),
        layer_kinds=("dense", "einsum_dense"),
        color="#e6ab02",
    ),
    QuantizationMode(
        name="gptq",
        summary="weight-only GPTQ: 2/3/4/8-bit weights, asymmetric scales and zero points per group "
        "of inputs, set column by column with error feedback from calibration inputs; float inputs",
        # Keras 3.15's GPTQDTypePolicy: "gptq/<weight_bits>/<group_size>" (no plain "gptq" form).
        forms=(PolicyForm("gptq/<weight_bits>/<group_size>", "GPTQDTypePolicy", _QUANTIZED_KEYS, "gptq/4/128"),),
        layer_kinds=("dense", "einsum_dense"),
        color="#937860",
        calibrated=True,
    ),
    QuantizationMode(
        name="awq",
        summary="weight-only AWQ: 4-bit weights, asymmetric scales and zero points per group, inputs "
        "channels scaled by a searched power of their mean magnitude; float inputs",
        forms=(PolicyForm("awq/<weight_bits>/<group_size>", "AWQDTypePolicy", _QUANTIZED_KEYS, "awq/4/128"),),
        layer_kinds=("dense", "einsum_dense"),
        color="#da8bc3",
        calibrated=True,
    ),
)

QUANTIZATION_MODES: tuple[str, ...] = tuple(m.name for m in MODES)
#: Every spelling of every mode, as error messages list them.
SPELLINGS: tuple[str, ...] = tuple(f.spelling for m in MODES for f in m.forms)


def get_quantization_mode(name: str) -> QuantizationMode:
    """The registry entry of mode ``name``.

    Raises:
      ValueError: if no mode has that name.

    >>> get_quantization_mode("int8").layer_kinds
    ('dense', 'einsum_dense', 'conv', 'embedding')
    """
    for mode in MODES:
        if mode.name == name:
            return mode
    raise ValueError(
        f"Invalid quantization mode. Expected one of {QUANTIZATION_MODES}. Received: mode={name!r}"
    )


def find_form(spelling: str) -> tuple[QuantizationMode, PolicyForm] | None:
    """The mode and form that ``spelling`` (the part before ``_from_``) is written in, or None.

    >>> mode, form = find_form("float8")
    >>> mode.name, form.class_name
    ('float8', 'QuantizedFloat8DTypePolicy')
    """
    for mode in MODES:
        for form in mode.forms:
            if form.matches(spelling):
                return mode, form
    return None


def forms_of_class(class_name: str) -> tuple[PolicyForm, ...]:
    """The forms that build policy class ``class_name`` (empty for a class no mode uses)."""
    return tuple(f for m in MODES for f in m.forms if f.class_name == class_name)


def modes_for_layer_kind(kind: str | None) -> tuple[str, ...]:
    """The modes with a kernel for layer kind ``kind`` (None: a layer without one).

    Raises:
      ValueError: for a kind not in ``LAYER_KINDS``.

    >>> modes_for_layer_kind("conv"), modes_for_layer_kind(None)
    (('int8',), ())
    """
    if kind is None:
        return ()
    if kind not in LAYER_KINDS:
        raise ValueError(f"Invalid layer kind. Expected one of {LAYER_KINDS}. Received: kind={kind!r}")
    return tuple(m.name for m in MODES if kind in m.layer_kinds)


def _check_registry(modes: tuple[QuantizationMode, ...]) -> None:
    """Refuses an inconsistent table at import (a mistake in this file, not user input)."""
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ValueError(f"Duplicate quantization mode names in the registry: {names}")
    keys_by_class: dict[str, tuple[str, ...]] = {}
    for mode in modes:
        unknown = [k for k in mode.layer_kinds if k not in LAYER_KINDS]
        # The first form is the mode's own name, or (Keras's gptq/awq, which have no plain form)
        # the name with its parameters: "gptq/<weight_bits>/<group_size>".
        if unknown or not mode.forms or mode.forms[0].spelling.partition("/")[0] != mode.name:
            raise ValueError(
                f"Registry entry {mode.name!r}: layer kinds must be among {LAYER_KINDS} (got "
                f"{unknown}) and its first form must be spelled {mode.name!r} (or '{mode.name}/<...>')."
            )
        for form in mode.forms:
            if keys_by_class.setdefault(form.class_name, form.config_keys) != form.config_keys:
                raise ValueError(f"Registry forms of {form.class_name} disagree on its config keys.")


_check_registry(MODES)
