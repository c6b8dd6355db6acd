"""Keras-compatible dtype policies: what dtype each layer computes in and stores variables in.

Also importable as ``autopolicy.dtype_policies`` (Keras's name for this module).
"""

from autopolicy.policies._global import dtype_policy, policy_scope, set_dtype_policy
from autopolicy.policies._map import DTypePolicyMap
from autopolicy.policies._names import DEFAULT_POLICY_NAME
from autopolicy.policies._modes import (
    LAYER_KINDS,
    QUANTIZATION_MODES,
    SPELLINGS as QUANTIZATION_SPELLINGS,
    PolicyForm,
    QuantizationMode,
    find_form as find_quantization_form,
    get_quantization_mode,
    modes_for_layer_kind,
)
from autopolicy.policies._policy import (
    AWQDTypePolicy,
    DTypePolicy,
    FloatDTypePolicy,
    GPTQDTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
)
from autopolicy.policies._serialization import (
    deserialize,
    get,
    load_policy_map,
    save_policy_map,
    serialize,
)

__all__ = [
    "DTypePolicy",
    "FloatDTypePolicy",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "Int4DTypePolicy",
    "GPTQDTypePolicy",
    "AWQDTypePolicy",
    "DTypePolicyMap",
    "DEFAULT_POLICY_NAME",
    "QUANTIZATION_MODES",
    "QUANTIZATION_SPELLINGS",
    "LAYER_KINDS",
    "QuantizationMode",
    "PolicyForm",
    "get_quantization_mode",
    "find_quantization_form",
    "modes_for_layer_kind",
    "get",
    "serialize",
    "deserialize",
    "set_dtype_policy",
    "dtype_policy",
    "policy_scope",
    "save_policy_map",
    "load_policy_map",
]
