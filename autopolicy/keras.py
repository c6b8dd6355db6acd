"""Policy maps on Keras 3 models (JAX backend): apply one to a copy, save it, load it back.

Not imported by ``import autopolicy``: importing this module imports Keras (with
``KERAS_BACKEND=jax`` as the default when Keras is not imported yet).

Saving: Keras 3.15 rebuilds the sublayers of a MultiHeadAttention with the attention layer's own
policy on reload, so a quantized or bfloat16 projection is lost ("expected 2 variables, but
received 0"), and a subclassed model rebuilds every layer with the default policy. A model
from :func:`apply_policy_map` keeps its composite layers' sublayer policies in a Keras
``DTypePolicyMap`` on the composite layer, so a Functional or Sequential model reloads with
``keras.saving.load_model``; :func:`save` also stores the map (and the layer paths) in the
``.keras`` archive, and :func:`load` re-applies it, so every kind of model reloads exactly.

>>> import autopolicy.keras as apk  # before Keras: its backend defaults to JAX
>>> import keras
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
...                           keras.layers.Dense(2, name="out")], name="net")
>>> tuned = apk.apply_policy_map(model, {"net/hidden": "int8_from_float32", "net/out": "mixed_bfloat16"})
>>> [(layer.path, layer.dtype_policy.name) for layer in tuned.layers]
[('net/hidden', 'int8_from_float32'), ('net/out', 'mixed_bfloat16')]
>>> [layer.dtype_policy.name for layer in model.layers]  # the original is untouched
['float32', 'float32']
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from typing import Any, Iterable

from autopolicy import policies
from autopolicy.adapters import _keras_models as models
from autopolicy.adapters._keras_layers import keras, quiet_numpy_conversion

__all__ = ["apply_policy_map", "policy_map_of", "save", "load", "ARCHIVE_MEMBER"]

#: The member of a ``.keras`` archive in which :func:`save` stores the map and layer paths.
ARCHIVE_MEMBER = "autopolicy.json"
_FORMAT = 1


def _batches(calibration_inputs: Iterable[Any] | None) -> list[tuple]:
    if calibration_inputs is None:
        return []
    return [b if isinstance(b, tuple) else (b,) for b in calibration_inputs]


def _check_keys(policy_map: policies.DTypePolicyMap, model: Any, strict: bool) -> None:
    paths = [layer.path for layer in models.all_layers(model) if layer.path]
    unused = policy_map.unused_keys(paths)
    if not unused:
        return
    message = f"Keys of the policy map match no layer path of {model.name!r}: {unused}. Paths are: {paths}"
    if strict:
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=3)


def apply_policy_map(model: Any, policy_map: Any, strict: bool = False,
                     calibration_inputs: Iterable[Any] | None = None) -> Any:
    """A copy of a built Keras model whose every layer runs its policy under ``policy_map``.

    A layer's policy is ``policy_map[layer.path]`` (an exact key, else the one key that fully
    matches as a regular expression, else the map's default), as everywhere in autopolicy and in
    Keras >= 3.12. Float policies set the compute dtype (and the variable dtype); quantized ones
    run Keras's own ``layer.quantize(mode)``; a layer without that kernel (LayerNormalization)
    keeps the source policy. Layers Keras gives no path (Dropout, Softmax, pooling) run their
    nearest ancestor's policy; layers that do not compute in floats (InputLayer, lookups) keep
    theirs. The original model is never modified.

    Args:
      model: A built ``keras.Model`` (Functional, Sequential, or subclassed with
        ``get_config``/``from_config``), with float weights.
      policy_map: An autopolicy or Keras ``DTypePolicyMap``, or a ``{path: policy}`` dict
        (default float32).
      strict: Raise, rather than warn, when a key matches no layer path (a typo).
      calibration_inputs: Batches (arrays or tuples) to set float8 scales from (Keras updates
        them only in training); without them float8 layers keep Keras's initial scales.

    Returns:
      The new ``keras.Model``; :func:`save` writes it with its map.

    Raises:
      TypeError: for a model that is not a ``keras.Model``, or a map of another type.
      ValueError: for an unbuilt or already quantized model, or unused keys when ``strict``.
    """
    models.check_model(model)
    pmap = models.to_policy_map(policy_map)
    _check_keys(pmap, model, strict)
    batches = _batches(calibration_inputs)
    copy = models.copy_model(model, batches[0] if batches else None)
    amax = models.record_calls(copy, batches)[1] if batches else {}
    models.apply_policies(copy, pmap)
    models.calibrate(copy, amax)
    models.remember(copy, pmap)
    return copy


def policy_map_of(model: Any) -> policies.DTypePolicyMap | None:
    """The map a model was made with by :func:`apply_policy_map`, :func:`load` or the tuner."""
    return models.map_of(model)


def save(model: Any, filepath: str | os.PathLike, policy_map: Any = None) -> None:
    """Saves a model running a policy map to a ``.keras`` file that :func:`load` restores exactly.

    The archive is Keras's own (``keras.saving.load_model`` reads a Functional or Sequential
    one) plus a member ``autopolicy.json`` holding the map and the layer paths.

    Args:
      model: A model returned by :func:`apply_policy_map`, :func:`load` or
        ``autopolicy.search.tune`` (``result.model``).
      filepath: Where to write; must end in ``.keras``.
      policy_map: The model's map; by default the one it was made with.

    Raises:
      ValueError: if no map is known for the model, or its layers do not run the map's policies.
    """
    pmap = models.to_policy_map(policy_map) if policy_map is not None else models.map_of(model)
    if pmap is None:
        raise ValueError(
            f"No policy map is known for {model.name!r}: pass policy_map=..., or save a model made by "
            "autopolicy.keras.apply_policy_map."
        )
    wrong = models.mismatches(model, pmap)
    if wrong:
        raise ValueError(f"The model does not run the policy map; layers and (runs, map says): {wrong}")
    if not str(filepath).endswith(".keras"):
        raise ValueError(f"The file name must end in .keras. Received: filepath={str(filepath)!r}")
    with quiet_numpy_conversion():  # Keras converts int4 kernels with np.array(variable) when saving
        model.save(filepath)
    meta = {"format": _FORMAT, "name": model.name, "layers": models.layer_index(model),
            "policy_map": policies.serialize(pmap)}
    with zipfile.ZipFile(filepath, "a") as archive:
        archive.writestr(ARCHIVE_MEMBER, json.dumps(meta))


def load(filepath: str | os.PathLike, custom_objects: dict | None = None, compile: bool = True,  # noqa: A002
         safe_mode: bool = True) -> Any:
    """Loads a ``.keras`` file; one written by :func:`save` comes back running its map.

    The model is made from its config, given the saved layer names and paths, put under its
    map (quantized layers quantized), and then given the saved weights.

    Args:
      filepath: A ``.keras`` file.
      custom_objects, compile, safe_mode: As for ``keras.saving.load_model``.

    Raises:
      ValueError: if the archive's autopolicy member has an unknown format.
    """
    with zipfile.ZipFile(filepath) as archive:
        if ARCHIVE_MEMBER not in archive.namelist():
            return keras.saving.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                           safe_mode=safe_mode)
        meta = json.loads(archive.read(ARCHIVE_MEMBER))
        config = json.loads(archive.read("config.json"))
    if meta.get("format") != _FORMAT:
        raise ValueError(f"Unknown {ARCHIVE_MEMBER} format {meta.get('format')!r} in {str(filepath)!r}; "
                         f"this autopolicy reads format {_FORMAT}.")
    if not compile:
        config["compile_config"] = None
    pmap = policies.deserialize(meta["policy_map"])
    model = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects, safe_mode=safe_mode)
    models.align(model, meta["layers"], meta["name"])
    models.apply_policies(model, pmap)
    model.load_weights(filepath)
    models.remember(model, pmap)
    return model
