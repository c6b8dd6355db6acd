"""Policies on modules: what a module computes in, and retyping a tree (maps, quantization)."""

from __future__ import annotations

import difflib
import logging
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from autopolicy import policies
from autopolicy.nn._base import is_array, map_children
from autopolicy.nn._frozen_map import FrozenPolicyMap
from autopolicy.policies import DTypePolicy, DTypePolicyMap

__all__ = ["Retyping", "policy_source", "infer_policy", "INFER"]

logger = logging.getLogger("autopolicy.nn")

INFER = "infer"


class Retyping:
    """A module's dtype policy and the copies with other policies (a mixin of ``Module``)."""

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The policy this module runs under (a quantized policy it has no kernel for is read
        as its source policy)."""
        source = self._policy_source
        if source == INFER:
            raise RuntimeError(
                f"{self.path!r} uses the 'infer' policy and takes its dtype from its first input: "
                "build it first."
            )
        policy = source.lookup(self.path) if isinstance(source, FrozenPolicyMap) else source
        mode = policy.quantization_mode
        if mode is not None and mode not in self.supported_quantization_modes:
            return DTypePolicy(policy.source_name)
        return policy

    @property
    def compute_dtype(self) -> str:
        return self.dtype_policy.compute_dtype

    @property
    def variable_dtype(self) -> str:
        return self.dtype_policy.variable_dtype

    @property
    def quantization_mode(self) -> str | None:
        return self.dtype_policy.quantization_mode

    def cast(self, x: Any) -> Any:
        """Casts the floating-point arrays in ``x`` to this module's compute dtype."""
        dtype = jnp.dtype(self.compute_dtype)

        def leaf(a):
            if is_array(a) and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype:
                return a.astype(dtype)
            return a

        return jax.tree_util.tree_map(leaf, x)

    def with_dtype_policy(self, policy: Any, strict: bool = False) -> Any:
        """Returns a copy in which every module's policy is ``policy`` or ``map[module.path]``.

        Built layers convert their weights: cast to the new variable dtype, quantized for an
        int8 policy, given float8 scaling state for a float8 policy. A quantized policy for a
        layer with no such kernel (a LayerNormalization) leaves it on the source policy.

        Args:
          policy: A policy, name, config dict or ``DTypePolicyMap``.
          strict: Raise if a key of the map matches no module path (a typo); otherwise such keys
            give a ``UserWarning`` naming them and the nearest paths (on a built module).

        Raises:
          ValueError: for an invalid policy, or unused keys when ``strict``.
        """
        resolved = policies.get(policy)
        if isinstance(resolved, DTypePolicyMap):
            # An unbuilt module may lack the sublayers its build creates: only strict checks it.
            if strict or self.built:
                _check_keys(resolved, list(self.modules()), strict)
            lookup: Callable[[str], DTypePolicy] = resolved.__getitem__
        else:
            lookup = lambda path: resolved  # noqa: E731
        skipped: list[str] = []
        new = self._retyped(lookup, skipped)
        if skipped:
            logger.info("kept the source policy for layers without a quantized kernel: %s", skipped)
        return new

    def quantize(self, mode: str, filter: Callable[[str, Any], bool] | None = None) -> Any:  # noqa: A002
        """Returns a copy whose layers run ``mode`` kernels.

        ``mode`` is a quantization mode as policy names spell it (``"int8"``, ``"float8"``,
        ``"int4"``, ``"int4/128"``); each quantized layer gets the policy
        ``f"{mode}_from_{its policy}"``. ``"int4"`` keeps one scale per output channel, as the
        name ``int4_from_float32`` says (Keras 3.15's ``quantize("int4")`` defaults to blocks of
        128: pass ``"int4/128"`` for those). ``"gptq/4/128"`` and ``"awq/4/128"`` (Dense layers)
        give policies whose weights are then set by ``autopolicy.nn.calibrate_weights``. On a single layer,
        a layer type without such a kernel, an unbuilt layer or an already quantized one raise.
        On a model, layers without such a kernel are skipped (and logged);
        ``filter(path, layer)`` selects the layers to quantize.

        Raises:
          ValueError: for an invalid mode, an already quantized layer, or a layer type without a
            kernel for ``mode`` (single layer), or a float16 compute dtype for int8.
          RuntimeError: if the module is not built.
        """
        found = policies.find_quantization_form(mode) if isinstance(mode, str) else None
        if found is None:
            raise ValueError(
                f"Invalid quantization mode. Expected one of {policies.QUANTIZATION_SPELLINGS}. "
                f"Received: mode={mode!r}"
            )
        mode_name = found[0].name
        if not self.built:
            raise RuntimeError(
                f"{type(self).__name__} {self.path!r} is not built; quantize converts built weights: "
                "call model.build(key, sample_input) first."
            )
        single = not self.children()
        targets: dict[str, DTypePolicy] = {}
        skipped = []
        for path, layer in self.layers_by_path().items():
            if filter is not None and not filter(path, layer):
                continue
            if mode_name not in layer.supported_quantization_modes:
                if single:
                    raise ValueError(
                        f"{type(layer).__name__} {path!r} has no {mode_name} kernel: "
                        f"{type(layer).__name__} supports the quantization modes "
                        f"{layer.supported_quantization_modes}."
                    )
                skipped.append(path)
                continue
            current = layer.dtype_policy
            if current.quantization_mode is not None:
                raise ValueError(f"{path!r} is already quantized (policy {current.name!r}).")
            try:
                targets[path] = policies.get(f"{mode}_from_{current.name}")
            except ValueError as e:
                raise ValueError(f"Cannot quantize {path!r}: {e}") from None
        unchanged = {p: m.dtype_policy for p, m in self.modules().items()}
        new = self._retyped(lambda p: targets.get(p, unchanged[p]), [])
        if skipped:
            logger.warning("quantize(%r) skipped layers without such a kernel: %s", mode, skipped)
        return new

    def with_kernels(self, kernels: Any) -> Any:
        """Returns a copy whose quantized layers run the named kernels (tactics).

        A quantization mode may have several exactly equivalent kernels (int8: ``"s8s8"``, XLA's
        s8 x s8 -> s32 dot, and ``"u8s8"``, the u8 x s8 dot of VNNI/AMX CPUs; see
        :mod:`autopolicy.numerics.kernels`); which is faster depends on the machine and the
        shape, so the search times them and records its choice here. A layer without an entry
        (or with None) runs the device's default. Changing a layer's policy later resets its
        choice.

        Args:
          kernels: ``{layer path: kernel name or None}`` (a single layer may also take a name).

        Raises:
          ValueError: for a path that is not a layer of this module, a layer that is not
            quantized, or a kernel its mode has not (naming the layer's choices).

        >>> import autopolicy.nn as nn
        >>> model = nn.Sequential([nn.Dense(8, name="a")], name="m")
        >>> model = model.build(jax.random.key(0), jnp.ones((2, 4))).quantize("int8")
        >>> model.with_kernels({"m/a": "s8s8"}).layers_by_path()["m/a"].quantization_kernel
        's8s8'
        >>> model.with_kernels({"m/a": "vnni"})
        Traceback (most recent call last):
        ...
        ValueError: Invalid kernel for 'm/a' (int8, einsum). Expected one of [...'s8s8', 'u8s8'] or None. Received: 'vnni'
        """
        modules = self.modules()
        if isinstance(kernels, str) and not self.children():
            kernels = {self.path: kernels}
        if not isinstance(kernels, dict):
            raise TypeError(f"with_kernels takes a dict {{layer path: kernel name}}. Received: {kernels!r}")
        for path, name in kernels.items():
            layer = modules.get(path)
            if layer is None:
                close = difflib.get_close_matches(str(path), list(modules), n=3, cutoff=0.5)
                raise ValueError(f"with_kernels: {path!r} is not a layer path of {self.path!r}"
                                 + (f"; did you mean {close}?" if close else f"; paths: {list(modules)[:6]}"))
            choices = layer.kernel_choices() if hasattr(layer, "kernel_choices") else ()
            if name is not None and name not in choices:
                if not choices:
                    raise ValueError(f"{path!r} (policy {layer.dtype_policy.name!r}) has no choice of kernels; "
                                     f"only quantized int8 and float8 layers do. Received: {name!r}")
                raise ValueError(f"Invalid kernel for {path!r} ({layer.quantization_mode}, {layer.kernel_op}). "
                                 f"Expected one of {sorted(choices)} or None. Received: {name!r}")
        return self._with_kernels(kernels)

    def _with_kernels(self, kernels: dict) -> Any:
        if self.path in kernels and not self.children():
            return self._copy(quantization_kernel=kernels[self.path])
        if not any(p == self.path or p.startswith(self.path + "/") for p in kernels):
            return self
        new = self._copy(mutable=True)
        map_children(new, lambda child: child._with_kernels(kernels))
        new._freeze()
        return new

    def kernels(self) -> dict[str, str]:
        """``{layer path: kernel}`` for every layer that runs a kernel chosen by ``with_kernels``."""
        return {p: m.quantization_kernel for p, m in self.modules().items()
                if m.__dict__.get("quantization_kernel") is not None}

    def _retyped(self, lookup: Callable[[str], DTypePolicy], skipped: list[str]) -> Any:
        policy = lookup(self.path)
        new = self._copy(mutable=True, _policy_source=policy, _dtype_explicit=True)
        mode = policy.quantization_mode
        if mode is not None and mode not in self.supported_quantization_modes and not self.children():
            skipped.append(self.path)

        map_children(new, lambda child: child._retyped(lookup, skipped))
        if self._own_built and self._defines_weights():
            new._convert_weights(self)
        new._freeze()
        return new

    def _convert_weights(self, old: Any) -> None:
        """Converts the weights of this (mutable, just retyped) copy from ``old``'s policy.

        The base version casts float variables to the new variable dtype; quantizable layers
        extend it.
        """
        variable = jnp.dtype(self.variable_dtype)
        for key, value in list(self._attrs()):
            if (
                is_array(value)
                and jnp.issubdtype(value.dtype, jnp.floating)
                and key not in self._no_autocast
                and value.dtype != variable
            ):
                object.__setattr__(self, key, jnp.asarray(value).astype(variable))


def _check_keys(policy_map: DTypePolicyMap, paths: list[str], strict: bool) -> None:
    """Keys that match no module path are typos or stale layers: an error when ``strict``, else a
    warning, naming them and the nearest existing paths."""
    unused = policy_map.unused_keys(paths)
    if not unused:
        return
    near = []
    for key in unused:
        close = difflib.get_close_matches(key, paths, n=3, cutoff=0.5)
        near.append(f"{key!r}: did you mean {close}?" if close else f"{key!r}: no similar path")
    message = (f"Keys of the DTypePolicyMap match no layer path: {unused} ({'; '.join(near)}); "
               f"{len(paths)} paths, such as {paths[:4]}")
    if strict:
        raise ValueError(message)
    warnings.warn(message + ". Those keys are ignored (strict=True raises).", UserWarning, stacklevel=3)


def policy_source(dtype: Any) -> Any:
    if isinstance(dtype, str) and dtype == INFER:
        import warnings  # pylint: disable=import-outside-toplevel

        warnings.warn(
            "The 'infer' dtype policy (TF 1 behaviour: take the dtype of the first input) is "
            "deprecated; pass dtype='float32' (or the policy you want) instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        return INFER
    resolved = policies.get(dtype)
    if isinstance(resolved, DTypePolicyMap):
        return FrozenPolicyMap.from_map(resolved)
    return resolved


def infer_policy(module: Any, args: tuple, kwargs: dict) -> DTypePolicy:
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return DTypePolicy(jnp.dtype(leaf.dtype).name)
    raise ValueError(f"{module.path!r} uses the 'infer' policy but got no floating-point input.")
