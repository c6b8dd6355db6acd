"""The global policy, and a scope that sets it for a block and always restores it."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from autopolicy.policies import _names
from autopolicy.policies._policy import DTypePolicy

__all__ = ["dtype_policy", "set_dtype_policy", "policy_scope"]

_DEFAULT = DTypePolicy(_names.DEFAULT_POLICY_NAME)
_global_policy: DTypePolicy = _DEFAULT
# A scope overrides the process-wide policy in its own context only (threads and asyncio tasks
# started elsewhere keep seeing the process-wide one).
_scoped_policy: contextvars.ContextVar[DTypePolicy | None] = contextvars.ContextVar(
    "autopolicy_scoped_policy", default=None
)


def _to_policy(policy: Any) -> DTypePolicy:
    from autopolicy.policies import _serialization  # pylint: disable=import-outside-toplevel

    if policy is None:
        raise ValueError(
            "The global dtype policy must be a policy or a policy name such as 'float32' or "
            "'mixed_bfloat16'. Received: policy=None"
        )
    resolved = _serialization.get(policy)
    if not isinstance(resolved, DTypePolicy):
        raise ValueError(
            "The global dtype policy cannot be a DTypePolicyMap: a map only makes sense per "
            f"layer. Received: policy={policy!r}"
        )
    return resolved


def dtype_policy() -> DTypePolicy:
    """Returns the current global dtype policy (``float32`` unless set).

    >>> dtype_policy()
    <DTypePolicy "float32">
    """
    scoped = _scoped_policy.get()
    return scoped if scoped is not None else _global_policy


def set_dtype_policy(policy: Any) -> None:
    """Sets the global dtype policy.

    Inside a :func:`policy_scope`, this changes the scoped policy until the scope ends.

    Args:
      policy: A policy or anything :func:`get` accepts except None (``"mixed_bfloat16"``).

    Raises:
      ValueError: if ``policy`` is None, a map, or not a valid policy.
    """
    global _global_policy
    resolved = _to_policy(policy)
    if _scoped_policy.get() is not None:
        _scoped_policy.set(resolved)
    else:
        _global_policy = resolved


@contextlib.contextmanager
def policy_scope(policy: Any) -> Iterator[DTypePolicy]:
    """Sets the global dtype policy inside a ``with`` block and restores it on exit.

    The previous policy comes back even when the block raises.

    >>> with policy_scope("mixed_bfloat16") as p:
    ...     dtype_policy().compute_dtype
    'bfloat16'
    >>> dtype_policy().name
    'float32'
    """
    resolved = _to_policy(policy)
    token = _scoped_policy.set(resolved)
    try:
        yield resolved
    finally:
        _scoped_policy.reset(token)
