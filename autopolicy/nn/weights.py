"""Weight import: arrays by name (a dict or a ``.safetensors`` file) into a built model.

A model's weights are named by layer path and attribute: ``encoder/block_0/attention/query/kernel``
(see :func:`weight_names`). Foreign names (a PyTorch checkpoint's ``encoder.layer.0.attention
.self.query.weight``) are translated by a mapping, which also says how to bring each array to
the model's layout (``transpose`` a ``[out, in]`` weight, ``reshape`` it into heads).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping, Sequence, Union

import jax.numpy as jnp
import numpy as np

from autopolicy.nn._base import is_array, map_modules
from autopolicy.nn._module import Module

__all__ = ["load_weights", "weight_names", "LoadReport", "Rule", "TRANSFORMS"]

#: Steps a mapping may ask for, applied in order: ``transpose`` reverses the axes (a PyTorch
#: ``Linear.weight [out, in]`` becomes a ``kernel [in, out]``); ``reshape`` reshapes to the
#: model's shape (same size, row-major: ``[in, heads * head_dim]`` -> ``[in, heads, head_dim]``).
TRANSFORMS: dict[str, Callable[[np.ndarray, tuple], np.ndarray]] = {
    "transpose": lambda array, shape: np.transpose(array),
    "reshape": lambda array, shape: np.reshape(array, shape),
}

Transform = Union[str, Sequence[str], Callable[[np.ndarray, tuple], np.ndarray], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule of a mapping: a foreign name that fully matches ``pattern`` becomes
    ``pattern.sub(replacement, name)`` (None: the tensor is deliberately skipped), with
    ``transform`` applied to its array (a step of :data:`TRANSFORMS`, a tuple of them, or
    ``fn(array, model_shape) -> array``)."""

    pattern: str
    replacement: str | None
    transform: Any = ()

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"Rule pattern {self.pattern!r} is not a regular expression: {e}") from None
        if self.replacement is not None and not isinstance(self.replacement, str):
            raise TypeError(f"Rule replacement must be a str or None. Received: {self.replacement!r}")
        _check_transform(self.transform)
        if isinstance(self.transform, list):  # hashable, like every configuration object
            object.__setattr__(self, "transform", tuple(self.transform))


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` did.

    Attributes:
      loaded: Model weight names that received an array.
      missing: Model weight names that no source tensor filled.
      unexpected: ``(source name, model name)`` of tensors that match no model weight.
      mismatched: ``(source name, model name, source shape, model shape)`` of tensors whose
        shape (after the mapping's transform) differs from the weight's.
      duplicated: ``(model name, source names)`` of weights that several tensors map to.
      skipped: Source names the mapping deliberately dropped (mapped to None).
    """

    loaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[tuple[str, str], ...] = ()
    mismatched: tuple[tuple[str, str, tuple, tuple], ...] = ()
    duplicated: tuple[tuple[str, tuple[str, ...]], ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every weight was loaded and every tensor used (or deliberately skipped)."""
        return not (self.missing or self.unexpected or self.mismatched or self.duplicated)

    def problems(self) -> str:
        """One line per problem, every tensor named (empty when :attr:`ok`)."""
        lines = []
        if self.missing:
            lines.append(f"missing (weights of the model that no tensor fills): {list(self.missing)}")
        for source, key in self.unexpected:
            lines.append(f"unexpected: {source!r} -> {key!r} is not a weight of the model")
        for source, key, got, want in self.mismatched:
            lines.append(f"mis-shaped: {source!r} -> {key!r}: source shape {got}, model shape {want}")
        for key, sources in self.duplicated:
            lines.append(f"duplicated: {key!r} is given by several tensors {list(sources)}")
        return "\n".join(lines)


def weight_names(model: Module) -> dict[str, tuple[int, ...]]:
    """The model's weights by name (``layer path/attribute``) with their shapes.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import autopolicy.nn as nn
    >>> mlp = nn.Sequential([nn.Dense(4), nn.Dense(2)], name="mlp")
    >>> weight_names(mlp.build(jax.random.key(0), jnp.ones((1, 3))))
    {'mlp/dense/kernel': (3, 4), 'mlp/dense/bias': (4,), 'mlp/dense_1/kernel': (4, 2), 'mlp/dense_1/bias': (2,)}
    """
    return {f"{path}/{attr}": tuple(np.shape(value))
            for path, module in model.modules().items() for attr, value in _arrays(module)}


def _arrays(module: Module) -> list[tuple[str, Any]]:
    return [(attr, value) for attr, value in module._attrs() if is_array(value)]


def _check_transform(transform: Any) -> None:
    if transform is None or callable(transform):
        return
    steps = (transform,) if isinstance(transform, str) else transform
    if not isinstance(steps, (tuple, list)) or any(s not in TRANSFORMS for s in steps):
        raise ValueError(
            f"Unknown transform. Expected one of {tuple(TRANSFORMS)}, a tuple of them, or "
            f"fn(array, model_shape) -> array. Received: transform={transform!r}"
        )


def _apply(transform: Any, array: np.ndarray, shape: tuple) -> np.ndarray:
    if transform is None:
        return array
    if callable(transform):
        return np.asarray(transform(array, shape))
    for step in (transform,) if isinstance(transform, str) else transform:
        array = TRANSFORMS[step](array, shape)
    return array


def _as_rules(mapping: Any) -> Callable[[str], Any]:
    """Normalizes a mapping to ``fn(name) -> None | name | (name, transform)``."""
    if mapping is None:
        return lambda name: name
    if callable(mapping):
        return mapping
    if isinstance(mapping, Mapping):
        for value in mapping.values():
            if isinstance(value, tuple):
                _check_transform(value[1])
        return lambda name: mapping.get(name, name)
    if isinstance(mapping, (list, tuple)):
        rules = [r if isinstance(r, Rule) else Rule(*r) for r in mapping]
        compiled = [(re.compile(r.pattern), r) for r in rules]

        def apply(name: str) -> Any:
            for pattern, rule in compiled:
                if pattern.fullmatch(name):
                    if rule.replacement is None:
                        return None
                    return pattern.sub(rule.replacement, name, count=1), rule.transform
            return name

        return apply
    raise TypeError(
        "mapping must be None, a callable fn(name) -> None | name | (name, transform), a dict "
        f"{{foreign name: name}} or a list of (regex, replacement[, transform]) rules. "
        f"Received: {type(mapping).__name__}"
    )


def _entry(name: str, translated: Any) -> tuple[str, Any]:
    key, transform = translated if isinstance(translated, tuple) and len(translated) == 2 else (translated, ())
    if not isinstance(key, str):
        raise TypeError(
            f"The mapping turned {name!r} into {translated!r}; expected None, a name (str) or "
            "(name, transform)."
        )
    _check_transform(transform)
    return key, transform


def _read(source: Any) -> dict[str, np.ndarray]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not path.endswith(".safetensors"):
            raise ValueError(f"A weights file must be a .safetensors file. Received: {path!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No weights file at {path!r}")
        from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

        return load_file(path)
    if isinstance(source, Mapping):
        arrays = {k: np.asarray(v) for k, v in source.items()}
        bad = [k for k, v in arrays.items() if not isinstance(k, str) or v.dtype == object]
        if bad:
            raise TypeError(f"A weights dict maps names (str) to numeric arrays. Received bad entries {bad}")
        return arrays
    raise TypeError(
        f"source must be a dict of arrays or a .safetensors file path. Received: {type(source).__name__}"
    )


def load_weights(model: Module, source: Any, mapping: Any = None,
                 strict: bool = True) -> tuple[Module, LoadReport]:
    """Returns a copy of ``model`` with weights from ``source``, and a report.

    Arrays are cast to each weight's stored (variable) dtype. Translated names are full model
    weight names, root included (:func:`weight_names` lists them).

    Args:
      model: A built model whose layers hold float weights (load, then apply policies).
      source: A dict ``{name: array}`` or the path of a ``.safetensors`` file.
      mapping: How source names become model weight names: None (they already are), a dict
        ``{foreign name: name or (name, transform) or None}``, a list of
        ``(regex, replacement[, transform])`` rules (or :class:`Rule`; the first rule that fully
        matches a name wins, ``\\1`` refers to groups, a None replacement skips the tensor,
        names no rule matches are kept), or ``fn(name) -> None | name | (name, transform)``.
        A transform is a step of :data:`TRANSFORMS`, a tuple of steps, or
        ``fn(array, model_shape) -> array``. :func:`autopolicy.nn.bert_mapping` is one for
        Hugging Face BERT checkpoints.
      strict: Raise when a weight is missing or a tensor is unexpected, mis-shaped or
        duplicated; otherwise load what fits and report the rest.

    Returns:
      ``(new_model, report)``; see :class:`LoadReport`.

    Raises:
      ValueError: listing every missing, unexpected, mis-shaped and duplicated tensor (with
        both shapes) when ``strict``; for layers holding quantized weights.
      TypeError: for a source or mapping of the wrong type.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import autopolicy.nn as nn
    >>> dense = nn.Dense(2, name="proj").build(jax.random.key(0), jnp.ones((1, 3)))
    >>> torch_style = {"proj.weight": np.ones((2, 3)), "proj.bias": np.array([1.0, 2.0])}
    >>> rules = [(r"proj\\.weight", "proj/kernel", "transpose"), (r"proj\\.bias", "proj/bias")]
    >>> dense, report = nn.load_weights(dense, torch_style, rules)
    >>> dense.kernel.shape, dense(jnp.ones((1, 3)))
    ((3, 2), Array([[4., 5.]], dtype=float32))
    """
    if not isinstance(model, Module) or not model.built:
        raise ValueError("load_weights() needs a built model: model = model.build(key, sample_input)")
    quantized = [p for p, m in model.modules().items() if m._weights_mode is not None]
    if quantized:
        raise ValueError(
            f"load_weights() loads float weights, but {quantized} hold quantized weights: load into "
            "the float model, then apply the policies (model.with_dtype_policy(...))."
        )
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool. Received: strict={strict!r}")
    translate = _as_rules(mapping)
    arrays = _read(source)
    targets = {f"{path}/{attr}": value for path, m in model.modules().items() for attr, value in _arrays(m)}
    found: dict[str, list[tuple[str, np.ndarray]]] = {}
    unexpected, mismatched, skipped = [], [], []
    for name, array in arrays.items():
        translated = translate(name)
        if translated is None:
            skipped.append(name)
            continue
        key, transform = _entry(name, translated)
        if key not in targets:
            unexpected.append((name, key))
            continue
        want = tuple(np.shape(targets[key]))
        try:
            value = _apply(transform, array, want)
        except ValueError:  # a reshape to a shape of another size
            value = None
        if value is None or value.shape != want:
            mismatched.append((name, key, tuple(array.shape), want))
            continue
        found.setdefault(key, []).append((name, value))
    duplicated = [(key, tuple(n for n, _ in got)) for key, got in found.items() if len(got) > 1]
    report = LoadReport(
        loaded=tuple(k for k in targets if k in found and len(found[k]) == 1),
        missing=tuple(k for k in targets if k not in found and not any(m[1] == k for m in mismatched)),
        unexpected=tuple(unexpected),
        mismatched=tuple(mismatched),
        duplicated=tuple(duplicated),
        skipped=tuple(skipped),
    )
    if strict and not report.ok:
        raise ValueError(
            f"load_weights() could not load every weight of {model.path!r} "
            "(strict=False loads what fits and reports the rest):\n" + report.problems()
        )
    values = {k: found[k][0][1] for k in report.loaded}
    return _replace(model, values), report


def _replace(model: Module, values: dict[str, np.ndarray]) -> Module:
    def swap(module: Module) -> Module | None:
        changes = {}
        for attr, old in _arrays(module):
            key = f"{module.path}/{attr}"
            if key in values:
                changes[attr] = jnp.asarray(values[key], dtype=old.dtype)
        return module._copy(**changes) if changes else None

    return map_modules(model, swap)
