"""Policy maps as Qwix rules: how a :class:`~autopolicy.policies.DTypePolicyMap` of an NNX model
reads as ``qwix.QuantizationRule`` s, and the text forms a config can paste.

Quantized policies become one rule per layer, matched by the layer's exact path (escaped, full
match, as Qwix matches ``module_path``); float policies need no rule (they are the modules'
compute ``dtype``). Keras's int8 and int4 policies quantize activations to int8 per row and
weights per output channel (int4: or per block of the contraction, Qwix's ``tile_size``);
float8 quantizes both to e4m3.

Numerics differ from Keras's in one place: Qwix's symmetric int8 bound is 127.5 (an int8 weight
can be -128) and its int4 bound 7.5, where Keras uses 127 and 7. The tuned model is what Qwix
runs, so its measured accuracy is that of the rules exported here.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

from autopolicy import policies

__all__ = ["RULE_MODES", "rule_fields", "qwix_rules", "rules_to_json", "rules_to_python"]

#: The quantization modes a Qwix rule can express (weights, activations).
RULE_MODES = ("int8", "int4", "float8")
_QTYPES = {"int8": ("int8", "int8"), "int4": ("int4", "int8"), "float8": ("float8_e4m3fn", "float8_e4m3fn")}


def rule_fields(path: str, policy: Any) -> dict | None:
    """The fields of the Qwix rule for the layer at ``path`` under ``policy`` (None: no rule).

    >>> rule_fields("layers/0", "int4/128_from_float32")
    {'module_path': 'layers/0', 'weight_qtype': 'int4', 'act_qtype': 'int8', 'tile_size': 128}
    >>> rule_fields("layers/0", "mixed_bfloat16") is None
    True

    Raises:
      ValueError: for a quantized policy Qwix cannot express here.
    """
    policy = policies.get(policy)
    mode = policy.quantization_mode
    if mode is None:
        return None
    if mode not in RULE_MODES:
        raise ValueError(f"The policy {policy.name!r} of {path!r} has no Qwix rule. Expected a policy of one of "
                         f"the modes {RULE_MODES} or a float policy. Received: mode={mode!r}")
    weight, act = _QTYPES[mode]
    fields = {"module_path": re.escape(path), "weight_qtype": weight, "act_qtype": act}
    block = getattr(policy, "block_size", None)
    if mode == "int4" and block not in (None, -1):
        fields["tile_size"] = int(block)
    return fields


def _entries(policy_map: Any, paths: Iterable[str] | None) -> list[tuple[str, Any]]:
    policy_map = policy_map if isinstance(policy_map, policies.DTypePolicyMap) else policies.DTypePolicyMap(
        policies.DEFAULT_POLICY_NAME, dict(policy_map))
    entries = list(policy_map.items())
    if paths is not None:
        known = set(paths)
        missing = sorted(key for key, _ in entries if key not in known)
        if missing:
            raise ValueError(f"The map names layers the model lacks: {missing}. The model's tunable layers: "
                             f"{sorted(known)}")
    return [(key, policies.get(value)) for key, value in entries]


def qwix_rules(policy_map: Any, paths: Iterable[str] | None = None) -> list:
    """The ``qwix.QuantizationRule`` s that quantize a model as ``policy_map`` says.

    Args:
      policy_map: A ``DTypePolicyMap`` (or a dict) keyed by exact layer paths (``layers/0``).
      paths: The model's layer paths: each key of the map must be one (see
        ``FlaxAdapter.paths``); None to skip the check.

    Returns:
      One rule per quantized layer, in the map's order; no catch-all, so every rule is used.

    Raises:
      ValueError: for a path the model lacks, or a policy Qwix cannot express.
    """
    import jax.numpy as jnp  # noqa: PLC0415
    import qwix  # noqa: PLC0415

    rules = []
    for path, policy in _entries(policy_map, paths):
        fields = rule_fields(path, policy)
        if fields is not None:
            fields["weight_qtype"] = jnp.dtype(fields["weight_qtype"])
            fields["act_qtype"] = jnp.dtype(fields["act_qtype"])
            rules.append(qwix.QuantizationRule(**fields))
    return rules


def _fields_list(policy_map: Any, paths: Iterable[str] | None) -> list[dict]:
    return [f for p, pol in _entries(policy_map, paths) if (f := rule_fields(p, pol)) is not None]


def rules_to_json(policy_map: Any, paths: Iterable[str] | None = None) -> str:
    """The rules of :func:`qwix_rules` as JSON (a list of the rules' fields, dtypes by name).

    >>> print(rules_to_json({"net/dense": "int8_from_float32"}))
    [
      {
        "module_path": "net/dense",
        "weight_qtype": "int8",
        "act_qtype": "int8"
      }
    ]
    """
    return json.dumps(_fields_list(policy_map, paths), indent=2)


def rules_to_python(policy_map: Any, paths: Iterable[str] | None = None) -> str:
    """The rules of :func:`qwix_rules` as Python source a config file can paste.

    >>> print(rules_to_python({"layers/1": "int4/32_from_float32"}))
    import jax.numpy as jnp
    import qwix
    <BLANKLINE>
    RULES = [
        qwix.QuantizationRule(module_path=r'layers/1', weight_qtype=jnp.int4, act_qtype=jnp.int8, tile_size=32),
    ]
    """
    lines = ["import jax.numpy as jnp", "import qwix", "", "RULES = ["]
    for fields in _fields_list(policy_map, paths):
        parts = [f"module_path=r{fields['module_path']!r}", f"weight_qtype=jnp.{fields['weight_qtype']}",
                 f"act_qtype=jnp.{fields['act_qtype']}"]
        if "tile_size" in fields:
            parts.append(f"tile_size={fields['tile_size']}")
        lines.append(f"    qwix.QuantizationRule({', '.join(parts)}),")
    lines.append("]")
    return "\n".join(lines)
