"""Using a causal language model: greedy generation with a key/value cache (a compiled prefill,
then the decode steps in one compiled loop; or one compiled decode step at a time) and perplexity
over fixed-length windows.

The model is any module called as ``model(ids)`` -> logits and
``model(ids, start=..., cache=...)`` -> ``(logits, cache)`` with ``model.init_cache(batch,
max_length)``, as :class:`~autopolicy.nn.LlamaDecoder`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["greedy_generate", "timed_generate", "Generation", "check_generation", "prefill", "decode_step", "decode_steps",
           "perplexity", "token_nll", "token_windows", "workload_phases", "next_step_input"]


@jax.jit
def prefill(model: Any, cache: Any, ids: jax.Array, at: Any = None) -> tuple[jax.Array, Any]:
    """``(logits, cache)`` after writing ``ids`` (``(batch, time)``) at positions ``0 .. time-1``:
    the logits of every position, or with ``at`` (an int array ``(n,)`` of time indices, the
    model's ``logits_at``) of those alone, ``(batch, n, vocab)``."""
    if at is None:
        return model(ids, start=jnp.zeros((), jnp.int32), cache=cache)
    return model(ids, start=jnp.zeros((), jnp.int32), cache=cache, logits_at=at)


@functools.partial(jax.jit, donate_argnames=("cache",))
def decode_step(model: Any, cache: Any, token: jax.Array, position: jax.Array) -> tuple[jax.Array, Any]:
    """``(next token's logits (batch, vocab), cache)`` for ``token`` (``(batch,)``) at ``position``
    (an int32 scalar): compiled once per model structure and cache length.

    The cache passed in is donated (its buffers are updated in place, where a kept input would
    cost a copy of the whole cache at every step): pass each step the cache the last one returned.
    """
    logits, cache = model(token[:, None], start=position, cache=cache)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=2)
def _greedy_loop(treedef: Any, leaves: list, cache: Any, token: jax.Array, position: jax.Array, steps: jax.Array,
                 stop: jax.Array, capacity: int) -> tuple:
    """Up to ``steps`` (<= ``capacity``) greedy decode steps in one compiled loop: from ``token``
    (int32 ``(batch,)``) at ``position``, each step's argmax fed to the next at the next position,
    ending early once every row's token is in ``stop``. Returns ``(tokens (batch, capacity), count,
    cache)``: the first ``count`` columns are the generated tokens. The model comes as its leaves
    (flattened once by the caller, not at every call) and the loop never returns to Python between
    tokens, so a token costs the step's own work and nothing more."""
    model = jax.tree_util.tree_unflatten(treedef, leaves)

    def stopped(t):
        return jnp.all(jnp.any(t[:, None] == stop[None, :], axis=-1))

    def more(carry):
        _, _, i, _, done = carry
        return (i < steps) & ~done

    def step(carry):
        cache, t, i, out, _ = carry
        logits, cache = model(t[:, None], start=position + i, cache=cache)
        t = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return cache, t, i + 1, out.at[:, i].set(t), stopped(t)

    out = jnp.zeros((token.shape[0], capacity), jnp.int32)
    cache, _, count, out, _ = jax.lax.while_loop(more, step, (cache, token, jnp.zeros((), jnp.int32), out, stopped(token)))
    return out, count, cache


def decode_steps(model: Any, cache: Any, token: jax.Array, position: Any, steps: int) -> tuple[jax.Array, Any]:
    """``steps`` greedy decode steps in one compiled loop, as :func:`greedy_generate` runs them:
    from ``token`` (int32 ``(batch,)``) written at ``position``, each step's argmax is the next
    step's token. Returns ``(tokens, cache)``: the generated ids, int32 ``(batch, steps)``, and the
    cache (the one passed in is donated: pass the one returned to the next call). Positions
    ``position .. position + steps - 1`` must fit in the cache. Compiled once per model structure,
    cache length and ``steps``.

    Raises:
      ValueError: for ``steps`` not an int >= 1, or (with a Python int ``position``, on a model
        with ``cache_length(cache)`` as :class:`~autopolicy.nn.LlamaDecoder`) positions outside
        the cache.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1. Received: steps={steps!r}")
    length = getattr(model, "cache_length", None)
    if isinstance(position, int) and length is not None and not 0 <= position <= length(cache) - steps:
        raise ValueError(f"Positions {position} .. {position + steps - 1} do not fit in the cache of "
                         f"{length(cache)} positions.")
    leaves, treedef = jax.tree_util.tree_flatten(model)
    out, _, cache = _greedy_loop(treedef, leaves, cache, jnp.asarray(token, jnp.int32),
                                 jnp.asarray(position, jnp.int32), jnp.asarray(steps, jnp.int32),
                                 jnp.zeros((0,), jnp.int32), steps)
    return out, cache


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`timed_generate` returns: the generated ids and the seconds each part took.

    Attributes:
      ids: The generated token ids (the prompt not included).
      prompt_tokens: The prompt's length (prefilled as a power of two, at least 16).
      prefill_s: The prefill's seconds (it also gives the first generated token).
      decode_s: The decode loop's seconds, for the tokens after the first.
    """

    ids: tuple[int, ...]
    prompt_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the decode loop (the tokens after the first), nan for none."""
        return (len(self.ids) - 1) / self.decode_s if len(self.ids) > 1 and self.decode_s > 0 else math.nan


def greedy_generate(model: Any, prompt: Sequence[int], steps: int, max_length: int = 256,
                    stop: Sequence[int] = ()) -> list[int]:
    """The ids of up to ``steps`` tokens that greedily continue ``prompt`` (token ids).

    The prompt is padded to a power of two (at least 16) and prefilled in one compiled call
    (padding after the prompt cannot affect it: attention is causal, and the decode steps
    overwrite those cache rows); the new tokens are decode steps over a cache of ``max_length``
    positions, all in one compiled loop (:func:`decode_steps`' loop, which also checks ``stop``),
    so no token waits for Python.

    Args:
      model: A built causal language model (see the module docstring).
      prompt: The prompt's token ids (at least one).
      steps: How many tokens to generate at most.
      max_length: The cache length; ``len(prompt) + steps`` must fit in it.
      stop: Ids that end the generation (included in the result).

    Raises:
      ValueError: for an empty prompt, a negative ``steps``, a prompt and steps that do not fit
        in ``max_length``, or ``stop`` holding anything but ints.
    """
    return list(timed_generate(model, prompt, steps, max_length, stop).ids)


def check_generation(prompt: Sequence[int], steps: Any, max_length: int, stop: Sequence[int] = ()) -> list[int]:
    """The prompt as ints, once ``prompt``, ``steps``, ``max_length`` and ``stop`` are checked
    (the errors of :func:`greedy_generate`)."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("greedy_generate needs a prompt of at least one token.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0. Received: steps={steps!r}")
    padded = _bucket(len(prompt))
    if max(padded, len(prompt) + steps) > max_length:
        raise ValueError(
            f"The prompt ({len(prompt)} tokens, prefilled as {padded}) and steps={steps} do not fit in "
            f"max_length={max_length}."
        )
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in stop):
        raise ValueError(f"stop must be token ids (ints). Received: stop={list(stop)!r}")
    return prompt


def timed_generate(model: Any, prompt: Sequence[int], steps: int, max_length: int = 256,
                   stop: Sequence[int] = ()) -> Generation:
    """:func:`greedy_generate`, with the prefill and the decode loop timed apart (each waited
    for; compilation included: run it once first to time a warm model).

    Raises:
      ValueError: as :func:`greedy_generate`.
    """
    prompt = check_generation(prompt, steps, max_length, stop)
    if steps == 0:
        return Generation((), len(prompt), 0.0, 0.0)
    padded = _bucket(len(prompt))
    ids = np.zeros((1, padded), np.int32)
    ids[0, : len(prompt)] = prompt
    start = time.perf_counter()
    # Only the last prompt token's logits: a traced index, so one compiled prefill per padded size.
    logits, cache = prefill(model, model.init_cache(1, max_length), jnp.asarray(ids),
                            jnp.asarray([len(prompt) - 1], jnp.int32))
    token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    jax.block_until_ready((token, cache))
    middle = time.perf_counter()
    leaves, treedef = jax.tree_util.tree_flatten(model)
    # The remaining steps - 1 tokens in one compiled loop, sized to a power of two (compiled once
    # per size, not per length asked for).
    out, count, _ = _greedy_loop(treedef, leaves, cache, token, jnp.asarray(len(prompt), jnp.int32),
                                 jnp.asarray(steps - 1, jnp.int32),
                                 jnp.asarray(sorted({int(t) for t in stop}), jnp.int32).reshape(-1), _bucket(steps))
    generated = [int(token[0])] + np.asarray(out)[0, : int(count)].tolist()
    end = time.perf_counter()
    return Generation(tuple(generated), len(prompt), middle - start, end - middle)


def token_windows(ids: Sequence[int], length: int, count: int | None = None) -> np.ndarray:
    """Consecutive, non-overlapping ``(windows, length)`` int32 windows of ``ids`` (the remainder
    dropped), at most ``count`` of them.

    >>> token_windows(range(7), 3)
    array([[0, 1, 2],
           [3, 4, 5]], dtype=int32)
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2. Received: length={length!r}")
    ids = np.asarray(list(ids), np.int32)
    n = len(ids) // length if count is None else min(count, len(ids) // length)
    if n < 1:
        raise ValueError(f"{len(ids)} tokens make no window of {length}")
    return ids[: n * length].reshape(n, length)


def token_nll(model: Any, ids: jax.Array) -> jax.Array:
    """The negative log-likelihood of every next token of ``ids`` (``(batch, time)``) under
    ``model``: ``(batch, time - 1)`` float32, differentiable (``exp`` of its mean is the
    perplexity).

    >>> uniform = lambda ids: jnp.zeros(ids.shape + (8,))  # equal logits over 8 tokens: log(8) each
    >>> token_nll(uniform, jnp.array([[1, 2, 3, 4]])).round(4)
    Array([[2.0794, 2.0794, 2.0794]], dtype=float32)
    """
    logits = model(ids)[:, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


@jax.jit
def _nll_sum(model: Any, ids: jax.Array) -> jax.Array:
    return jnp.sum(token_nll(model, ids))


def perplexity(model: Any, windows: Any, batch: int = 4) -> float:
    """``exp(mean negative log-likelihood)`` of every next token within each window (each
    window's first token is context only), ``batch`` windows per compiled call.

    Args:
      model: A causal language model, ``model(ids) -> (batch, time, vocab)`` logits.
      windows: ``(n, length)`` token ids, ``n`` a multiple of ``batch``.

    Raises:
      ValueError: when ``windows`` is not 2-D or ``n`` is not a multiple of ``batch``.
    """
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2 or len(windows) % batch:
        raise ValueError(f"windows must be (n, length >= 2) with n a multiple of batch={batch}. "
                         f"Received shape {windows.shape}")
    total = 0.0
    for i in range(0, len(windows), batch):
        total += float(_nll_sum(model, jnp.asarray(windows[i : i + batch], jnp.int32)))
    return float(np.exp(total / (windows.shape[0] * (windows.shape[1] - 1))))


def next_step_input(args: tuple, outputs: tuple) -> tuple:
    """A decode step's next arguments when it is timed back to back (``tune``'s ``step_carry``):
    the same token and position, and the cache the step returned, updated in place as a decoding
    loop does."""
    return (*args[:2], outputs[1], *args[3:])


def workload_phases(model: Any, requests: Sequence[Any], batch: int = 1, seed: int = 0) -> list:
    """The phases of generation requests for ``tune(..., workload=...)``: per request, a prefill
    of its prompt (``prefill`` tokens from an empty cache, the last token's logits alone), once,
    then one decode step (at the last position of a cache of ``prefill + decode`` positions, the
    attention reading all of it), ``decode`` times; phases the requests share are merged, their
    weights added.

    Args:
      model: A built causal language model (see the module docstring).
      requests: :class:`autopolicy.search.Request` objects (``parse_requests("prefill=512,decode=128")``).
      batch: Sequences per call (rows of the ids).
      seed: Seeds the prompt's token ids (the cost does not depend on them).

    Raises:
      ValueError: for no requests, a bad ``batch``, or a request longer than the model's
        ``max_length`` (when its config states one).
    """
    from autopolicy.search.workload import Phase, Request  # pylint: disable=import-outside-toplevel

    requests = list(requests)
    if not requests or not all(isinstance(r, Request) for r in requests):
        raise ValueError(f"requests must be autopolicy.search.Request objects (at least one). Received: {requests!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1. Received: batch={batch!r}")
    config = getattr(model, "config", None)
    limit, vocab = getattr(config, "max_length", None), getattr(config, "vocab_size", 2)
    rng = np.random.default_rng(seed)
    found: dict[tuple, list] = {}  # (kind, tokens, cache) -> [weight, args, carry]
    for r in requests:
        length = r.prefill + r.decode
        if limit is not None and length > limit:
            raise ValueError(f"A request of prefill={r.prefill} + decode={r.decode} = {length} tokens exceeds the "
                             f"model's max_length={limit}.")
        k = ("prefill", r.prefill, length)
        if k not in found:
            ids = rng.integers(1, max(vocab, 2), (batch, r.prefill)).astype(np.int32)
            found[k] = [0.0, (ids, np.asarray(0, np.int32), model.init_cache(batch, length),
                              np.asarray([r.prefill - 1], np.int32)), None]
        found[k][0] += r.weight
        if r.decode:
            k = ("decode", 1, length)
            if k not in found:
                token = np.full((batch, 1), 1, np.int32)
                found[k] = [0.0, (token, np.asarray(length - 1, np.int32), model.init_cache(batch, length)),
                            next_step_input]
            found[k][0] += r.weight * r.decode
    caches = {}
    for kind, tokens, length in found:
        caches.setdefault((kind, tokens), set()).add(length)
    phases = []
    for (kind, tokens, length), (weight, args, carry) in found.items():
        name = f"prefill {tokens}" if kind == "prefill" else "decode"
        if kind == "decode" or len(caches[(kind, tokens)]) > 1:
            name += f" at {length}"
        phases.append(Phase(name, args, weight, carry))
    return phases
