"""autopolicy: per-layer dtype policies (float32, bfloat16/float16, int8, float8, int4, GPTQ,
AWQ) for JAX, and a search that picks the fastest ones that keep accuracy within budget.

Importing ``autopolicy`` does not import pandas or matplotlib (reports and the CLI do), nor a
framework: :mod:`autopolicy.keras` is imported (with Keras) on first use of ``autopolicy.keras``.
"""

import importlib

from autopolicy import datasets, dtype_policies, mixed_precision, nn, numerics, policies, search, train
from autopolicy.numerics import (
    DynamicLossScale,
    LossScaleOptimizer,
    LossScaleState,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    loss_scale_optimizer,
    select_tree,
)
from autopolicy.policies import (
    DTypePolicy,
    DTypePolicyMap,
    FloatDTypePolicy,
    AWQDTypePolicy,
    GPTQDTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
    deserialize,
    dtype_policy,
    get,
    load_policy_map,
    policy_scope,
    save_policy_map,
    serialize,
    set_dtype_policy,
)

from autopolicy._tuned import TunedModelError, load_tuned
from autopolicy._version import __version__

__all__ = [
    # modules
    "policies",
    "dtype_policies",
    "mixed_precision",
    "numerics",
    "nn",
    "train",
    "search",
    "datasets",
    # policies
    "DTypePolicy",
    "FloatDTypePolicy",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "Int4DTypePolicy",
    "GPTQDTypePolicy",
    "AWQDTypePolicy",
    "DTypePolicyMap",
    "get",
    "serialize",
    "deserialize",
    "set_dtype_policy",
    "dtype_policy",
    "policy_scope",
    "save_policy_map",
    "load_policy_map",
    # loss scaling
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScaleState",
    "loss_scale_optimizer",
    "LossScaleOptimizer",
    "all_finite",
    "select_tree",
    # tuned models
    "load_tuned",
    "TunedModelError",
]

#: Submodules that import a framework: reachable as attributes of the package, imported (with the
#: framework) on first access (PEP 562), never by ``import autopolicy``.
_LAZY_SUBMODULES = ("keras", "flax")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import sets the attribute too
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
