"""Accuracy cost of each layer under each policy, with the rest of the model in float32.

For a candidate, the model with only that layer switched is scored with the user's ``eval_fn``;
its outputs on the calibration inputs are compared with the float32 outputs (signal-to-
quantization-noise ratio, and KL divergence of the softmax of the last axis, for logits). A
candidate whose outputs contain inf or NaN, or whose metric is not finite, is disqualified.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import _multihost
from autopolicy.search import _checks, timing

__all__ = ["fidelity", "check_metric", "Scorer"]


def _floating_leaves(tree: Any) -> list[np.ndarray]:
    # An output that spans processes is read whole on every process (each computes the same figures).
    return [_multihost.host_array(x, np.float64) for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def fidelity(reference: Sequence[Any], outputs: Sequence[Any]) -> dict[str, float | bool]:
    """SQNR (dB) and mean KL divergence of ``outputs`` against ``reference`` (lists of trees).

    >>> r = [jnp.array([[1.0, 2.0, 3.0]])]
    >>> f = fidelity(r, [r[0] + 0.01])
    >>> round(f["sqnr_db"], 1), round(f["kl"], 6), f["finite"]
    (46.7, 0.0, True)
    """
    signal = noise = 0.0
    kls: list[float] = []
    finite = True
    for ref_tree, out_tree in zip(reference, outputs):
        for ref, out in zip(_floating_leaves(ref_tree), _floating_leaves(out_tree)):
            if not np.all(np.isfinite(out)):
                finite = False
                continue
            signal += float(np.sum(ref**2))
            noise += float(np.sum((out - ref) ** 2))
            if ref.ndim >= 1 and ref.shape[-1] > 1:
                p = _softmax(ref)
                q = _softmax(out)
                kls.append(float(np.mean(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)), axis=-1))))
    if not finite:
        return {"sqnr_db": float("nan"), "kl": float("nan"), "finite": False}
    sqnr = math.inf if noise == 0 else 10.0 * math.log10(max(signal, 1e-300) / noise)
    return {"sqnr_db": sqnr, "kl": float(np.mean(kls)) if kls else float("nan"), "finite": True}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def check_metric(value: Any, what: str, fn_name: str = "eval_fn") -> float:
    """The metric as a float (NaN and infinities pass: they disqualify the candidate); a clear
    TypeError for anything that is not a real number (:func:`autopolicy.search._checks.check_metric`)."""
    return _checks.check_metric(value, what, finite=False, fn_name=fn_name)


class Scorer:
    """Scores models: the user's metric, and output fidelity against the float32 model.

    Models are reached through the adapter: its program of a model runs jitted on each
    calibration batch.
    """

    def __init__(self, eval_fn: Callable[[Any], float], calibration: Sequence[tuple], adapter: Any, reference: Any):
        self.eval_fn = eval_fn
        self.calibration = list(calibration)
        self.adapter = adapter
        self.reference = self.outputs(reference)
        self.evaluations = 0

    def outputs(self, model: Any) -> list[Any]:
        program = self.adapter.model_program(model)
        return [program.run(*batch) for batch in self.calibration]

    def prefetch(self, model: Any) -> concurrent.futures.Future | None:
        """Compiles ``model``'s program for the first calibration batch in the background, where
        the adapter's program can be lowered ahead (:attr:`Program.lower`); None where it cannot.
        :meth:`outputs`, and an ``eval_fn`` calling the model on batches of that shape, then find
        it compiled."""
        program = self.adapter.model_program(model)
        if program.lower is None or not self.calibration:
            return None
        return timing.compile_lowered(program.lower(*self.calibration[0]))

    def metric(self, model: Any, what: str) -> float:
        self.evaluations += 1
        return check_metric(self.eval_fn(model), what)

    def score(self, model: Any, what: str) -> dict[str, float | bool]:
        """``{"metric", "sqnr_db", "kl", "finite"}`` for ``model``."""
        record: dict[str, Any] = fidelity(self.reference, self.outputs(model))
        metric = self.metric(model, what)
        record["metric"] = metric
        record["finite"] = bool(record["finite"]) and math.isfinite(metric)
        return record
