"""One Keras 3 layer under one policy: which layers are tunable, the modes Keras quantizes them
in, setting a built layer's policy in place (Keras's own ``layer.quantize``), float8 scales, and
a layer or model as a pure function of its weights.

Shared by the Keras adapter and :mod:`autopolicy.keras`; imports Keras (JAX backend).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from autopolicy import policies

if "keras" not in sys.modules:  # autopolicy is a JAX library: default Keras to its JAX backend
    os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402  (after the backend default)

__all__ = [
    "keras",
    "TUNABLE_KINDS",
    "QUANTIZABLE_MODES",
    "require_jax_backend",
    "is_tunable",
    "supported_modes",
    "to_keras",
    "canonical_name",
    "source_policy",
    "own_policy",
    "set_layer_policy",
    "calibrate_float8",
    "stateless_fn",
    "state_of",
    "values",
    "layer_copy",
    "quiet_numpy_conversion",
    "float16_attention_compiles",
    "attention_projections",
]

#: Leaf layer kinds whose policy the search chooses (the MultiHeadAttention projections are
#: EinsumDense layers).
TUNABLE_KINDS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Embedding,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)

#: The Keras quantization modes autopolicy can ask for (GPTQ and AWQ need a calibration
#: algorithm of their own and are left to Keras).
QUANTIZABLE_MODES = ("int8", "float8", "int4")
_FLOAT8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def require_jax_backend() -> None:
    """Raises unless Keras runs on JAX (autopolicy times and scores jitted JAX programs)."""
    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"autopolicy tunes Keras models on the JAX backend. Keras runs on {backend!r}: set "
            "KERAS_BACKEND=jax before importing keras."
        )


def is_tunable(layer: Any) -> bool:
    """A built leaf layer of a tunable kind with a path (the key of its policy)."""
    return isinstance(layer, TUNABLE_KINDS) and not layer._layers and layer.path is not None


def supported_modes(layer: Any) -> tuple[str, ...]:
    """The quantization modes Keras's own ``layer.quantize`` runs for this layer.

    Keras's quantizable layers refuse subclasses that do not define ``quantize`` themselves,
    so the class that defines it must be the layer's own; the modes are those its variable
    serialization knows.
    """
    owner = next((c for c in type(layer).__mro__ if "quantize" in vars(c)), None)
    if owner is not type(layer) or owner is keras.layers.Layer:
        return ()
    spec = getattr(layer, "variable_serialization_spec", None) or {}
    return tuple(mode for mode in QUANTIZABLE_MODES if mode in spec)


def to_keras(policy: Any) -> Any:
    """An autopolicy (or Keras) policy or name as Keras's policy object."""
    if isinstance(policy, keras.dtype_policies.DTypePolicy):
        return policy
    return keras.dtype_policies.deserialize(policies.serialize(policies.get(policy)))


def canonical_name(kpolicy: Any) -> str:
    """A Keras policy's name with int4 per-channel spelled one way (Keras writes ``int4/-1``)."""
    name = kpolicy.name
    if name.startswith("int4/-1_from_"):
        name = "int4" + name[len("int4/-1"):]
    if kpolicy.quantization_mode == "float8":
        name += f"@{kpolicy.amax_history_length}"
    return name


def source_policy(kpolicy: Any) -> Any:
    """The float policy a quantized policy computes in (the policy itself for a float one)."""
    source = getattr(kpolicy, "_source_name", None)
    return keras.dtype_policies.DTypePolicy(source) if kpolicy.quantization_mode else kpolicy


def own_policy(layer: Any) -> Any:
    """The policy a layer runs (its entry when it holds a Keras ``DTypePolicyMap``)."""
    policy = layer._dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def _retype(layer: Any, old: str, new: str) -> None:
    """Stores the layer's own float variables of dtype ``old`` as ``new`` (a built layer's
    variables keep the dtype they were created with; Keras has no public way to change it)."""
    for variable in layer._trainable_variables + layer._non_trainable_variables:
        if variable._dtype == old:
            value = keras.ops.cast(variable.value, new)
            variable._dtype = new
            variable._direct_assign(value)


@contextlib.contextmanager
def quiet_numpy_conversion():
    """Silences the one DeprecationWarning Keras 3.15 raises under NumPy 2 when it converts its
    own variables (``np.array(variable)`` in ``layer.quantize`` and saving): Keras's bug, not
    the caller's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"__array__ implementation doesn't accept a copy keyword",
                                category=DeprecationWarning)
        yield


def _quantize(layer: Any, kpolicy: Any) -> None:
    mode = kpolicy.quantization_mode
    config = None
    if mode == "int4":
        from keras.src.quantizers.quantization_config import Int4QuantizationConfig  # noqa: PLC0415

        config = Int4QuantizationConfig(block_size=getattr(kpolicy, "block_size", -1))
    # The policy is set first: Keras keeps a quantized policy already set (float8's history
    # length, int4's block size) and sets it itself otherwise.
    layer._dtype_policy = kpolicy
    with quiet_numpy_conversion():
        layer.quantize(mode, config=config)


def set_layer_policy(layer: Any, kpolicy: Any) -> str:
    """Makes a built layer run ``kpolicy`` in place; returns the policy name it runs.

    Float policies set the compute dtype (and retype the variables when the variable dtype
    changes); quantized ones call Keras's ``layer.quantize``. A quantized policy for a layer
    without that kernel leaves it on the source policy.

    Raises:
      ValueError: if the layer is already quantized under another policy.
    """
    current = own_policy(layer)
    if canonical_name(current) == canonical_name(kpolicy):
        layer._dtype_policy = current
        return current.name
    if current.quantization_mode is not None:
        raise ValueError(
            f"{type(layer).__name__} {layer.path!r} is already quantized ({current.name!r}) and cannot be "
            f"re-policied to {kpolicy.name!r}: start from the float model."
        )
    source = source_policy(kpolicy)
    if source.variable_dtype != current.variable_dtype:
        _retype(layer, current.variable_dtype, source.variable_dtype)
    layer._dtype_policy = source
    if kpolicy.quantization_mode is None or kpolicy.quantization_mode not in supported_modes(layer):
        return source.name
    _quantize(layer, kpolicy)
    return layer.dtype_policy.name


def calibrate_float8(layer: Any, input_amax: float) -> None:
    """Sets a float8 layer's frozen scales from its kernel's and its inputs' absolute maxima
    (Keras updates them only in training, so a post-training float8 layer needs this)."""
    kernel_amax = float(np.max(np.abs(np.asarray(layer._kernel.value, np.float32))))
    for prefix, amax in (("inputs", input_amax), ("kernel", kernel_amax)):
        if not (amax > 0 and np.isfinite(amax)):
            continue
        getattr(layer, f"{prefix}_scale").assign(np.float32(amax / _FLOAT8_MAX))
        history = np.zeros(getattr(layer, f"{prefix}_amax_history").shape, np.float32)
        history[0] = amax
        getattr(layer, f"{prefix}_amax_history").assign(history)


def values(layer: Any) -> list:
    """Copies of the values of a layer's (or model's) weights, in ``layer.weights`` order.

    Copies, because Keras's JAX trainer donates variable buffers to its jitted steps: a copy
    that shared them would delete the original's weights on its first ``predict``. (Keras's
    ``get_weights`` goes through a NumPy conversion that warns under NumPy 2.)
    """
    return [jnp.array(v.value, copy=True) for v in layer.weights]


@functools.lru_cache(maxsize=None)
def float16_attention_compiles() -> bool:
    """Whether Keras's attention core (``ops.dot_product_attention``) compiles for float16
    query, key and value on this device (XLA on CPU has no float16 dot with a float32 result)."""
    x = jnp.ones((1, 2, 1, 4), jnp.float16)
    try:
        jax.jit(lambda a: keras.ops.dot_product_attention(a, a, a, is_causal=True)).lower(x).compile()
    except Exception:  # pylint: disable=broad-except  # XLA's refusal has no exception class of its own
        return False
    return True


def attention_projections(model: Any) -> set[int]:
    """The ids of the query, key and value projections of every MultiHeadAttention in ``model``."""
    out = set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.MultiHeadAttention):
            out |= {id(getattr(layer, f"_{n}_dense", None)) for n in ("query", "key", "value")}
    return out


def state_of(layer: Any, copy: bool = False) -> tuple[list, list]:
    """The values of a layer's (or model's) trainable and non-trainable variables.

    With ``copy``, copies of them: a program that outlives a call of the user's ``eval_fn`` must
    not hold the variables' own buffers, which Keras's ``predict``, ``evaluate`` and ``fit``
    donate to their jitted steps (the program would then run on deleted arrays).
    """
    read = (lambda v: jnp.array(v.value, copy=True)) if copy else (lambda v: v.value)
    return ([read(v) for v in layer.trainable_variables], [read(v) for v in layer.non_trainable_variables])


def stateless_fn(layer: Any):
    """``fn(state, args, kwargs)``: the layer's own ``__call__`` (input casting and autocast
    included, which ``Layer.stateless_call`` skips) with its variables read from ``state``."""

    def fn(state, args, kwargs):
        trainable, non_trainable = state
        mapping = list(zip(layer.trainable_variables, trainable)) + list(
            zip(layer.non_trainable_variables, non_trainable))
        # Keras relies on JAX's standard promotion (a bfloat16 query meets a float32 key).
        with jax.numpy_dtype_promotion("standard"), keras.StatelessScope(state_mapping=mapping):
            return layer(*args, **kwargs)

    return fn


def layer_copy(layer: Any, kpolicy: Any, input_amax: float | None = None) -> Any:
    """A standalone copy of a built leaf layer, with its weights, running ``kpolicy``."""
    config = dict(layer.get_config())
    config["dtype"] = source_policy(kpolicy).name
    new = type(layer).from_config(config)
    new.build_from_config(layer.get_build_config())
    new.set_weights(values(layer))
    set_layer_policy(new, kpolicy)
    if new.quantization_mode == "float8" and input_amax is not None:
        calibrate_float8(new, input_amax)
    return new
