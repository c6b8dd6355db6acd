"""Validation of the search's public arguments: every bad value is refused where it enters, with
a message that names it and the valid choices."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import _multihost, policies

__all__ = [
    "MAX_REPEATS",
    "MAX_ROUNDS",
    "check_arguments",
    "check_budget",
    "allowed_worsening",
    "check_decision",
    "check_metric",
    "check_sample_input",
    "input_problem",
    "check_layer_input",
    "describe_inputs",
    "sample_refused",
]

#: Timing repetitions per layer: at least 3 (a median and a spread), at most this (hours).
MAX_REPEATS = 10_000
#: Verify/repair rounds.
MAX_ROUNDS = 100

#: Quantization modes whose kernels scale and round the layer's input itself: an integer input
#: (token ids fed straight to a Dense) cannot run them. int8 and int4 quantize integer inputs.
_FLOAT_INPUT_MODES = ("float8",)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}]. Received: {name}={value!r}")


def check_arguments(candidates, max_drop, memory_budget, repeats, max_rounds) -> list[policies.DTypePolicy]:
    """Checks ``tune``'s arguments; returns the candidates as policies.

    Raises:
      ValueError: naming the argument and its value: a ``max_drop`` that is not a finite number
        >= 0, a ``memory_budget`` that is not a finite number > 0 (or None), ``repeats`` outside
        [3, MAX_REPEATS], ``max_rounds`` outside [1, MAX_ROUNDS], or candidates that are not a
        non-empty list of single float-computing policies.

    >>> check_arguments(["float32"], 0.01, None, 10**6, 3)
    Traceback (most recent call last):
    ...
    ValueError: repeats must be an int in [3, 10000]. Received: repeats=1000000
    """
    if not _is_number(max_drop) or not math.isfinite(max_drop) or not max_drop >= 0:
        raise ValueError(f"max_drop must be a finite number >= 0. Received: max_drop={max_drop!r}")
    if memory_budget is not None and (not _is_number(memory_budget) or not math.isfinite(memory_budget)
                                      or not memory_budget > 0):
        raise ValueError(f"memory_budget must be a number of bytes > 0, or None. Received: "
                         f"memory_budget={memory_budget!r}")
    _check_int("repeats", repeats, 3, MAX_REPEATS)
    _check_int("max_rounds", max_rounds, 1, MAX_ROUNDS)
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


def check_decision(min_speedup: Any, confirm_seconds: Any) -> None:
    """Checks the decision margin and the time allowed to settle close calls.

    Raises:
      ValueError: for a ``min_speedup`` that is not a finite number >= 1, or a
        ``confirm_seconds`` that is not a finite number >= 0.

    >>> check_decision(float("inf"), 30)
    Traceback (most recent call last):
    ...
    ValueError: min_speedup must be a finite number >= 1 (1.02: 2% faster). Received: min_speedup=inf
    """
    if not _is_number(min_speedup) or not math.isfinite(min_speedup) or not min_speedup >= 1:
        raise ValueError(f"min_speedup must be a finite number >= 1 (1.02: 2% faster). Received: "
                         f"min_speedup={min_speedup!r}")
    if not _is_number(confirm_seconds) or not math.isfinite(confirm_seconds) or not confirm_seconds >= 0:
        raise ValueError(f"confirm_seconds must be a finite number >= 0. Received: confirm_seconds={confirm_seconds!r}")


def check_budget(max_drop: Any, relative: Any, higher_is_better: Any = True) -> None:
    """Checks that ``max_drop`` makes sense as the kind of change ``relative`` and
    ``higher_is_better`` say it is.

    A relative drop of a higher-is-better metric is a fraction of the float32 metric: above 1
    (``--max-drop 150%``) it allows more than the whole metric, surely a slip for 1.5%. A
    lower-is-better metric (perplexity, loss) has no ceiling, so a relative rise above 1 (the
    perplexity may double: ``max_drop=1.0``) is accepted.

    Raises:
      TypeError: if ``relative`` or ``higher_is_better`` is not a bool.
      ValueError: if ``relative``, ``higher_is_better`` and ``max_drop`` > 1.

    >>> check_budget(1.5, relative=True)
    Traceback (most recent call last):
    ...
    ValueError: A relative max_drop is a fraction of the float32 metric, at most 1 (100%).
    Received: max_drop=1.5 (150%); for an absolute drop pass relative=False (--absolute).
    >>> check_budget(1.5, relative=True, higher_is_better=False)  # perplexity up to 2.5x float32's
    """
    if not isinstance(relative, (bool, np.bool_)):
        raise TypeError(f"relative must be True or False. Received: relative={relative!r}")
    if not isinstance(higher_is_better, (bool, np.bool_)):
        raise TypeError(f"higher_is_better must be True (accuracy) or False (perplexity, loss). "
                        f"Received: higher_is_better={higher_is_better!r}")
    if relative and higher_is_better and _is_number(max_drop) and max_drop > 1:
        raise ValueError(
            f"A relative max_drop is a fraction of the float32 metric, at most 1 (100%). Received: "
            f"max_drop={max_drop!r} ({max_drop * 100:g}%); for an absolute drop pass relative=False (--absolute)."
        )


def allowed_worsening(baseline: float, max_drop: float, relative: bool, higher_is_better: bool = True) -> float:
    """The metric's allowed drop (higher is better) or rise (lower is better) from ``baseline``.

    Relative budgets are fractions of the float32 metric: of its magnitude when higher is
    better (as always), of the metric itself when lower is better ("at most 2% above float32's
    perplexity"), which must then be positive: a rise relative to a zero or negative perplexity
    or loss has no meaning.

    Raises:
      ValueError: for a relative budget on a lower-is-better metric whose float32 value is not
        positive, naming the value.

    >>> allowed_worsening(23.43, 0.02, True, higher_is_better=False)
    0.4686
    >>> allowed_worsening(-23.43, 0.02, True, higher_is_better=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: A relative max_drop of a lower-is-better metric ... Received: eval_fn(float32 model)=-23.43 ...
    """
    if not relative:
        return float(max_drop)
    if higher_is_better:
        return max_drop * abs(baseline)
    if not baseline > 0:
        raise ValueError(
            f"A relative max_drop of a lower-is-better metric is a fraction of its float32 value, which must be "
            f"> 0. Received: eval_fn(float32 model)={baseline!r} with max_drop={max_drop!r}, relative=True, "
            "higher_is_better=False; pass relative=False (--absolute) for an absolute rise, or check eval_fn's "
            "direction.")
    return max_drop * baseline


def check_metric(value: Any, what: str, finite: bool = True, fn_name: str = "eval_fn") -> float:
    """The value an ``eval_fn`` returned, as a float, if it is a real number.

    Accepted: Python ints and floats, NumPy and JAX scalars and 0-d arrays of an integer or
    floating dtype. Refused: strings (``"0.9"``), bools, None, complex numbers, arrays with
    more than one element.

    Args:
      value: What the function returned.
      what: The model it scored, for messages (``"the float32 model"``).
      finite: Also refuse NaN and infinities (the float32 baseline must be finite; a candidate's
        non-finite score may instead disqualify it, so pass False there).
      fn_name: The function's name in messages (``"eval_fn"``, ``"test_fn"``).

    Raises:
      TypeError: naming the value and its type, for anything that is not a real number.
      ValueError: for a non-finite value when ``finite``; with several JAX processes, for
        values that differ between them (every process must compute the same metric).

    >>> check_metric("0.9", "the float32 model")
    Traceback (most recent call last):
    ...
    TypeError: eval_fn must return a real number (a float). It returned '0.9' of type str for the float32 model.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is not None and np.ndim(value) == 0:
        real = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    else:
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not real:
        shape = f" with shape {np.shape(value)}" if np.ndim(value) else ""
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise TypeError(f"{fn_name} must return a real number (a float). It returned {shown} of type "
                        f"{type(value).__name__}{shape} for {what}.")
    # With several JAX processes each returns its own: they must agree (checked, not averaged).
    metric = _multihost.agreed(float(value), f"{fn_name}'s value for {what}")
    if finite and not math.isfinite(metric):
        raise ValueError(f"{fn_name} returned {metric!r} for {what}; it must return a finite number.")
    return metric


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _dtype_of(leaf: Any) -> np.dtype | None:
    """The dtype of an array leaf, None for a Python scalar (bool, int, float)."""
    if isinstance(leaf, (bool, int, float)):
        return None
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        dtype = np.asarray(leaf).dtype
    return np.dtype(dtype)


def check_sample_input(sample_input: Any) -> tuple:
    """The sample input as a tuple of positional arguments, if it can be timed at all.

    Each array in it must hold numbers (integers, floats or bools) and at least one element;
    whether the model takes it is checked by running the model on it. Integer arrays are
    fine: token ids for an embedding.

    Raises:
      TypeError: naming the position, dtype and shape of an array of strings, bytes or Python
        objects, or a str.
      ValueError: for a sample input with no array, or an empty array (shape named).

    >>> check_sample_input(np.array(["a", "b"]))
    Traceback (most recent call last):
    ...
    TypeError: sample_input holds an array of dtype <U1 and shape (2,), not numbers: pass the
    model's real input (a float or integer array).
    """
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    leaves = _leaves(args)
    if not leaves:
        raise ValueError(f"sample_input holds no array. Received: {str(sample_input)[:80]}")
    for where, leaf in leaves:
        name = "sample_input" + (where if isinstance(sample_input, tuple) else where[len("[0]"):])
        if isinstance(leaf, (str, bytes)):
            raise TypeError(f"{name} is a {type(leaf).__name__} {leaf[:40]!r}, not an array: pass the model's real "
                            "input (a float or integer array).")
        dtype = _dtype_of(leaf)
        if dtype is None:
            continue
        if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)) or dtype.kind == "c":
            raise TypeError(f"{name} holds an array of dtype {dtype} and shape {np.shape(leaf)}, not numbers: pass "
                            "the model's real input (a float or integer array).")
        if np.size(leaf) == 0:
            raise ValueError(f"{name} is empty (shape {np.shape(leaf)}, dtype {dtype}): time the model on a "
                             "realistic batch.")
    return args


def input_problem(inputs: Any, policy: Any) -> str | None:
    """Why a layer given ``inputs`` cannot run ``policy``, or None when it can.

    Float8 kernels scale and round their input to float8: an integer input (token ids fed to a
    Dense) cannot run them. An adapter can leave such candidates out for that layer, or raise
    with :func:`check_layer_input`.

    >>> print(input_problem(np.zeros((8, 16), np.int32), "float8_from_float32"))
    an input of dtype int32 and shape (8, 16), which 'float8_from_float32' cannot take: float8
    kernels quantize floating-point inputs
    >>> input_problem(np.zeros((8, 16), np.int32), "int8_from_float32") is None
    True
    """
    policy = policies.get(policy)
    mode = getattr(policy, "quantization_mode", None)
    if mode not in _FLOAT_INPUT_MODES:
        return None
    for _, leaf in _leaves(inputs):
        dtype = _dtype_of(leaf)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            return (f"an input of dtype {dtype} and shape {np.shape(leaf)}, which {policy.name!r} cannot take: "
                    f"{mode} kernels quantize floating-point inputs")
    return None


def check_layer_input(path: str, inputs: Any, policy: Any) -> None:
    """Raises if the layer at ``path``, given ``inputs``, cannot run ``policy``.

    Raises:
      ValueError: naming the layer, the input's dtype and shape, the policy and the remedy.
    """
    problem = input_problem(inputs, policy)
    if problem is not None:
        raise ValueError(f"Layer {path!r} gets {problem}. Cast that input to float32 in the model (or the sample "
                         f"input, if the layer reads it directly), or leave {policies.get(policy).name!r} out of "
                         "the candidates.")


def describe_inputs(args: tuple) -> str:
    """The shapes and dtypes of positional inputs, as a person reads them.

    >>> describe_inputs((np.zeros((64, 5)),))
    '(64, 5) float64'
    >>> describe_inputs((np.zeros((2, 8), np.int32), {"mask": np.ones((2, 8), bool)}))
    "((2, 8) int32, {'mask': (2, 8) bool})"
    """
    def one(x: Any) -> Any:
        dtype = _dtype_of(x)
        return type(x).__name__ if dtype is None else _Shape(f"{tuple(np.shape(x))} {dtype.name}")

    described = [jax.tree_util.tree_map(one, a) for a in args]
    return repr(described[0]) if len(described) == 1 else "(" + ", ".join(map(repr, described)) + ")"


class _Shape(str):
    def __repr__(self) -> str:
        return str(self)


def sample_refused(error: BaseException, args: tuple, expected: str | None) -> ValueError:
    """The error for a model that fails on ``sample_input``: the shape given, what the model was
    built for (``expected``, a clause such as ``"which was built for inputs (N, 12) float32"``,
    when the adapter knows it) and the model's own message.

    >>> str(sample_refused(ValueError("Size of label 'k' ..."), (np.zeros((64, 5)),),
    ...                    "which was built for inputs (N, 12) float32"))
    "sample_input of shape (64, 5) float64 does not fit the model, which was built for inputs (N, 12) float32: pass a sample of the model's real input shape (the model raised ValueError: Size of label 'k' ...)"
    """
    built = f", {expected}" if expected else ""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return ValueError(f"sample_input of shape {describe_inputs(args)} does not fit the model{built}: pass a sample "
                      f"of the model's real input shape (the model raised {type(error).__name__}: {message[:300]})")
