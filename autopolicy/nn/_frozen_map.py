"""A hashable snapshot of a DTypePolicyMap, so a layer given a map keeps a static policy."""

from __future__ import annotations

import dataclasses

from autopolicy.policies import DTypePolicy, DTypePolicyMap


@dataclasses.dataclass(frozen=True)
class FrozenPolicyMap:
    """The items and default of a map, frozen when a layer is constructed with it."""

    items: tuple[tuple[str, DTypePolicy], ...]
    default: DTypePolicy
    _map: DTypePolicyMap = dataclasses.field(compare=False, hash=False, repr=False, default=None)

    @classmethod
    def from_map(cls, policy_map: DTypePolicyMap) -> "FrozenPolicyMap":
        # A default that follows the global policy is resolved now: None means "the global
        # policy at construction" for a layer's dtype.
        return cls(tuple(policy_map.items()), policy_map.default_policy)

    def lookup(self, path: str) -> DTypePolicy:
        if self._map is None:
            object.__setattr__(self, "_map", DTypePolicyMap(self.default, dict(self.items)))
        return self._map[path]

    def __repr__(self) -> str:
        return f"<DTypePolicyMap default_policy={self.default.name}, {len(self.items)} keys>"
