"""DTypePolicyMap: a per-layer policy for each layer path, with regular-expression keys."""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from autopolicy.policies import _global
from autopolicy.policies._policy import DTypePolicy

__all__ = ["DTypePolicyMap"]


class DTypePolicyMap:
    """Maps layer paths (``"mlp/dense_1"``) to dtype policies.

    A lookup ``m[path]`` returns the policy of the key equal to ``path`` if there is one;
    otherwise every key is tried as a regular expression that must match the *whole* path
    (``re.fullmatch``). One matching key gives its policy, several raise, none gives the default.

    Args:
      default_policy: The policy of paths no key matches: a policy or anything
        :func:`autopolicy.policies.get` accepts. None means the global policy *at lookup time*.
      policy_map: Optional initial ``{path_or_regex: policy}`` dict (insertion order is kept).

    Raises:
      TypeError: if ``policy_map`` is not a dict.
      ValueError: if ``default_policy`` is itself a map, or a key or value is invalid.

    >>> m = DTypePolicyMap("float32", {"mlp/dense_.*": "mixed_bfloat16"})
    >>> m["mlp/dense_1"], m["mlp/dense"]
    (<DTypePolicy "mixed_bfloat16">, <DTypePolicy "float32">)
    """

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __init__(self, default_policy: Any = None, policy_map: dict[str, Any] | None = None):
        if isinstance(default_policy, DTypePolicyMap):
            raise ValueError(
                "default_policy cannot be a DTypePolicyMap. Received: "
                f"default_policy={default_policy!r}"
            )
        self._default = None if default_policy is None else _to_value(default_policy, "<default>")
        if policy_map is not None and not isinstance(policy_map, dict):
            raise TypeError(
                f"policy_map must be a dict of {{path: policy}}. Received: policy_map={policy_map!r}"
                f" of type {type(policy_map).__name__}"
            )
        self._policies: dict[str, DTypePolicy] = {}
        self._patterns: dict[str, re.Pattern[str]] = {}
        for key, value in (policy_map or {}).items():
            self[key] = value

    # --- the policy this map stands for -----------------------------------------------------

    @property
    def follows_global(self) -> bool:
        """True when the default is the global policy at lookup time (``default_policy=None``)."""
        return self._default is None

    @property
    def default_policy(self) -> DTypePolicy:
        return self._default if self._default is not None else _global.dtype_policy()

    @property
    def name(self) -> str:
        return f"map_{self.default_policy.name}"

    @property
    def compute_dtype(self) -> str:
        return self.default_policy.compute_dtype

    @property
    def variable_dtype(self) -> str:
        return self.default_policy.variable_dtype

    @property
    def quantization_mode(self) -> str | None:
        return self.default_policy.quantization_mode

    @property
    def should_cast_variables(self) -> bool:
        return self.default_policy.should_cast_variables

    # --- lookups ----------------------------------------------------------------------------

    def matching_keys(self, path: str) -> list[str]:
        """The keys that give ``path`` its policy: ``[path]`` on an exact hit, else regex hits."""
        if path in self._policies:
            return [path]
        return [key for key, pattern in self._patterns.items() if pattern.fullmatch(path)]

    def __getitem__(self, path: str) -> DTypePolicy:
        if not isinstance(path, str):
            raise TypeError(f"Layer paths are strings. Received: path={path!r}")
        keys = self.matching_keys(path)
        if len(keys) > 1:
            raise ValueError(
                f"Layer path {path!r} matches several keys of the DTypePolicyMap: {keys}. "
                "Make the keys more specific, or add the exact path as a key."
            )
        return self._policies[keys[0]] if keys else self.default_policy

    def unused_keys(self, paths: Iterable[str]) -> list[str]:
        """The keys that match none of ``paths``, exactly or as a regex (typos, stale layers).

        >>> DTypePolicyMap("float32", {"mlp/dense": "bfloat16", "mlp/dnese": "float16"}
        ...               ).unused_keys(["mlp/dense", "mlp/dense_1"])
        ['mlp/dnese']
        """
        paths = list(paths)
        return [
            key
            for key, pattern in self._patterns.items()
            if not any(key == p or pattern.fullmatch(p) for p in paths)
        ]

    # --- mapping protocol -------------------------------------------------------------------

    def __setitem__(self, key: str, policy: Any) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"Keys of a DTypePolicyMap are non-empty layer paths. Received: key={key!r}")
        if key in self._policies:
            raise ValueError(
                f"The layer path {key!r} already has a policy ({self._policies[key]!r}); "
                "delete it first to replace it."
            )
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(f"The key {key!r} is not a valid regular expression: {e}") from None
        self._policies[key] = _to_value(policy, key)
        self._patterns[key] = pattern

    def __delitem__(self, key: str) -> None:
        if key not in self._policies:
            raise KeyError(key)
        del self._policies[key]
        del self._patterns[key]

    def pop(self, key: str, *default: Any) -> Any:
        """Removes ``key`` (an exact key, never a regex lookup) and returns its policy."""
        if key not in self._policies:
            if default:
                return default[0]
            raise KeyError(key)
        policy = self._policies[key]
        del self[key]
        return policy

    def __contains__(self, key: object) -> bool:
        return key in self._policies

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._policies))

    def __len__(self) -> int:
        return len(self._policies)

    def keys(self):
        return self._policies.keys()

    def values(self):
        return self._policies.values()

    def items(self):
        return self._policies.items()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DTypePolicyMap):
            return NotImplemented
        return self._default == other._default and list(self.items()) == list(other.items())

    # --- serialization ----------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Keras's config: the default as a name (plain) or envelope (quantized), values as
        envelopes. Never changes the stored policies."""
        from autopolicy.policies import _serialization  # pylint: disable=import-outside-toplevel

        if self._default is None:
            default = None
        elif type(self._default) is DTypePolicy:
            default = self._default.name
        else:
            default = _serialization.serialize(self._default)
        return {
            "default_policy": default,
            "policy_map": {k: _serialization.serialize(v) for k, v in self._policies.items()},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DTypePolicyMap":
        return cls(config.get("default_policy"), config.get("policy_map"))

    def __repr__(self) -> str:
        default = "None (global)" if self._default is None else self._default.name
        mapping = [(k, v.name) for k, v in self._policies.items()]
        return f"<DTypePolicyMap default_policy={default}, mapping={mapping}>"


def _to_value(policy: Any, key: str) -> DTypePolicy:
    from autopolicy.policies import _serialization  # pylint: disable=import-outside-toplevel

    if isinstance(policy, DTypePolicyMap):
        raise ValueError(f"A DTypePolicyMap cannot hold another map. Received for key {key!r}: {policy!r}")
    try:
        return _serialization.get(policy)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Cannot convert the policy for key {key!r} into a DTypePolicy: {e}") from None
