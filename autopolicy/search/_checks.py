"""Validation of the search's public arguments: every bad value is refused where it enters, with
a message that names it and the valid choices."""

from __future__ import annotations

from autopolicy import policies

__all__ = ["check_arguments"]


def check_arguments(candidates, max_drop, memory_budget, repeats, max_rounds) -> list[policies.DTypePolicy]:
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0:
        raise ValueError(f"max_drop must be a number >= 0. Received: max_drop={max_drop!r}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not memory_budget > 0):
        raise ValueError(f"memory_budget must be a number of bytes > 0 or None. Received: {memory_budget!r}")
    for name, value, low in (("repeats", repeats, 3), ("max_rounds", max_rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}. Received: {name}={value!r}")
    if isinstance(candidates, (str, policies.DTypePolicy)) or not candidates:
        raise ValueError(f"candidates must be a non-empty list of policies. Received: {candidates!r}")
    out = []
    for c in candidates:
        policy = policies.get(c) if c is not None else None
        if policy is None or isinstance(policy, policies.DTypePolicyMap):
            raise ValueError(f"Each candidate must be a single policy. Received: {c!r}")
        if policy.compute_dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"Candidate {policy.name!r} does not compute in a float dtype.")
        out.append(policy)
    return out
