"""Saving and restoring a tuned NNX model: its state with Orbax, its map and rules beside.

Qwix's advice for quantized models is to restore from a build function: build the float model,
quantize it with the same rules (which makes the quantized variables' structure), then restore
the saved values into it. :func:`load` does exactly that from the saved map.

Directory layout: ``state/`` (Orbax ``StandardCheckpointer``), ``policy_map.json`` (the Keras
envelope of :func:`autopolicy.save_policy_map`) and ``qwix_rules.json`` (for a config file).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable

from flax import nnx
import orbax.checkpoint as ocp

from autopolicy import _atomic, policies
from autopolicy.adapters._flax_rules import rules_to_json

__all__ = ["save", "load", "STATE_DIR", "MAP_FILE", "RULES_FILE"]

STATE_DIR, MAP_FILE, RULES_FILE = "state", "policy_map.json", "qwix_rules.json"


def save(model: nnx.Module, directory: str | os.PathLike, policy_map: Any) -> None:
    """Saves ``model`` (made by ``apply_policy_map(..., policy_map)``) in ``directory``.

    The state is written to a temporary directory beside and moved into place, so an
    interrupted save leaves the previous one (or nothing), never half a checkpoint.
    """
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    policy_map = policy_map if isinstance(policy_map, policies.DTypePolicyMap) else policies.DTypePolicyMap(
        policies.DEFAULT_POLICY_NAME, dict(policy_map))
    staging = tempfile.mkdtemp(prefix=".state-", dir=directory)
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(staging, STATE_DIR), nnx.state(model))
        checkpointer.wait_until_finished()
        target = os.path.join(directory, STATE_DIR)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, STATE_DIR), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    policies.save_policy_map(policy_map, os.path.join(directory, MAP_FILE))
    _atomic.write_text(os.path.join(directory, RULES_FILE), rules_to_json(policy_map) + "\n")


def load(directory: str | os.PathLike, build: Callable[[], nnx.Module], *sample_args: Any) -> nnx.Module:
    """The model :func:`save` wrote: ``build()`` makes the float model, the saved map is applied
    (Qwix quantizes it on ``sample_args``), then the saved values are restored into it.

    Raises:
      FileNotFoundError: if ``directory`` holds no saved model.
    """
    from autopolicy.adapters.flax import apply_policy_map  # noqa: PLC0415

    directory = os.path.abspath(os.fspath(directory))
    for name in (STATE_DIR, MAP_FILE):
        if not os.path.exists(os.path.join(directory, name)):
            raise FileNotFoundError(f"{directory!r} holds no saved NNX model: {name!r} is missing. "
                                    "Save one with autopolicy.flax.save(model, directory, policy_map).")
    policy_map = policies.load_policy_map(os.path.join(directory, MAP_FILE))
    model = apply_policy_map(build(), policy_map, *sample_args)
    restored = ocp.StandardCheckpointer().restore(os.path.join(directory, STATE_DIR), nnx.state(model))
    nnx.update(model, restored)
    return model
