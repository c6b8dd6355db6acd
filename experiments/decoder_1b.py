"""decoder_1b: a llama-shaped decoder of 1.2 billion parameters with seeded random weights, timed
for one decode step at a batch of 1, 16 or 64 sequences, or for a prefill: a GPU task.

SmolLM2's architecture scaled up (as Llama 3.2 1B is shaped): width 2048, 16 blocks, grouped-query
attention with 32 query and 8 key/value heads (head size 64), SwiGLU MLP 8192, RMSNorm, rotary
base 100000, vocabulary 49152. The embedding and the head are untied (two random tables): 0.97B
parameters in the blocks and 0.20B in the tables, 4.7 GB in float32, so the full form is for a
GPU only.

Weights: the library's seeded initializers (Glorot uniform projections, normal embedding), drawn
one array at a time (each on the host in float64 before its float32 copy; no float64 copy of the
model is kept), except the head, drawn in float32 with ``jax.random`` from a normal of standard
deviation LOGIT_STD / sqrt(width): the final RMSNorm's outputs have unit scale, so the logits have
a spread of about LOGIT_STD and the next-token distributions are neither near uniform (Glorot's
head gives logits of spread 0.3) nor one-hot.

Options (``autopolicy tune decoder_1b --option batch=16 --option phase=prefill``):

- ``phase="decode"`` (default): the timed call is one decode step of ``batch`` sequences at the
  last position of a cache of CACHE positions (the attention reads all of it), run back to back
  on the cache each step returns (``step_carry``), as decoding does;
- ``phase="prefill"``: the timed call is the forward pass of ``batch`` prompts of PREFILL tokens
  (the logits of every position; no cache is written);
- ``batch`` in BATCHES (default 1);
- ``small=True`` (``--small``): the same task at width 128, 2 blocks (8 query and 2 key/value
  heads), MLP 512, vocabulary 512, a cache of 64 and prompts of 32, with three of the candidates
  (SMALL_CANDIDATES), which tunes in about a minute on two CPU cores.

The metric is the fidelity to float32: the mean Kullback-Leibler divergence KL(float32 || tuned)
of the next-token distributions at every position of WINDOWS fixed random token windows, in nats,
0 for float32 and lower is better. It does not depend on ``batch`` or ``phase``, so every form of
one size shares its accuracy measurements. The budget is an absolute rise of MAX_KL nats: on the
small form, bfloat16 and 8-bit weights everywhere fit within it, 4-bit weights or float8
everywhere do not (see MAX_KL).
"""

from __future__ import annotations

import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import nn
from autopolicy.experiment import Experiment
from autopolicy.nn import generation

DESCRIPTION = ("llama-shaped decoder, 1.2B parameters (16 x 2048, GQA 32/8, MLP 8192), random weights, a GPU "
               "task; decode step at batch 1/16/64 or a 512-token prefill; metric: KL to float32 (nats)")

Batch = Literal[1, 16, 64]
Phase = Literal["decode", "prefill"]
BATCHES: tuple[int, ...] = typing.get_args(Batch)
PHASES: tuple[str, ...] = typing.get_args(Phase)

FULL = nn.LlamaConfig(vocab_size=49152, dim=2048, blocks=16, heads=32, kv_heads=8, mlp_dim=8192,
                      rope_base=100000.0, max_length=2048)
SMALL = nn.LlamaConfig(vocab_size=512, dim=128, blocks=2, heads=8, kv_heads=2, mlp_dim=512,
                       rope_base=100000.0, max_length=256)
#: Per size: the decode objective's cache positions, the prefill's prompt tokens, and the scored
#: windows (count, tokens each) with how many go to one compiled call.
CACHE = {"full": 1024, "small": 64}
PREFILL = {"full": 512, "small": 32}
WINDOWS = {"full": (8, 256, 4), "small": (4, 32, 4)}
CALIBRATION = 4      # windows (of another seed) for GPTQ and float8 calibration
LOGIT_STD = 4.0      # the spread of the float32 logits (the head's scale)
#: The budget: mean KL(float32 || tuned) per token, in nats. By Pinsker's inequality the mean
#: total-variation distance between the next-token distributions is then at most
#: sqrt(0.01 / 2) = 0.07. On the small form (a 2-core CPU; each policy on every projection and the
#: head, the embedding float32, GPTQ calibrated on the calibration windows), the KL of
#: mixed_bfloat16 is 0.0005, of 8-bit GPTQ weights 0.003, of int8 0.004, of float8 0.07, of 4-bit
#: GPTQ weights in groups of 128 0.39 and of int4 per channel 0.29: 0.01 admits bfloat16 and the
#: 8-bit forms everywhere, float8 and 4-bit weights on some layers only. (The full form's figures
#: are still to be measured on a GPU.)
MAX_KL = 0.01
#: GPU candidates: bfloat16 compute (the float32 layers stay an option), int8 and float8 dots, and
#: weight-only GPTQ at 8 bits per channel and 4 bits in groups of 128 (calibrated on the
#: calibration windows), each on bfloat16 activations.
CANDIDATES = ("mixed_bfloat16", "int8_from_mixed_bfloat16", "float8_from_mixed_bfloat16",
              "gptq/8/-1_from_mixed_bfloat16", "gptq/4/128_from_mixed_bfloat16")
#: The small form's: one of each kind (a float, an int8 dot, calibrated weight-only), so that it
#: tunes in under a minute on two CPU cores (where float8 is emulated), a tune costing about a
#: second of compilation per layer shape and candidate.
SMALL_CANDIDATES = ("mixed_bfloat16", "int8_from_mixed_bfloat16", "gptq/4/128_from_mixed_bfloat16")


def check_options(batch: int, phase: str) -> None:
    """Raises ValueError naming the valid values when ``batch`` or ``phase`` is not one of them."""
    if isinstance(batch, bool) or batch not in BATCHES:
        raise ValueError(f"Invalid batch for decoder_1b. Expected one of {BATCHES}. Received: batch={batch!r}")
    if phase not in PHASES:
        raise ValueError(f"Invalid phase for decoder_1b. Expected one of {PHASES}. Received: phase={phase!r}")


def decoder(config: nn.LlamaConfig, seed: int = 0) -> nn.LlamaDecoder:
    """The built float32 decoder named ``decoder_1b``: the library's initializers for every weight
    but the head's, drawn from a normal of standard deviation ``LOGIT_STD / sqrt(dim)``."""
    model = nn.LlamaDecoder(config, name="decoder_1b").build(jax.random.key(seed), jnp.zeros((1, 2), jnp.int32))
    head = jax.random.normal(jax.random.key(seed + 1), model.head.kernel.shape, jnp.float32)
    scale = jnp.float32(LOGIT_STD / math.sqrt(config.dim))

    def replace(path, leaf):
        return head * scale if jax.tree_util.keystr(path) == ".head.kernel" else leaf

    return jax.tree_util.tree_map_with_path(replace, model)


def random_windows(config: nn.LlamaConfig, count: int, length: int, seed: int) -> np.ndarray:
    """``(count, length)`` int32 random token ids, seeded."""
    return np.random.default_rng(seed).integers(0, config.vocab_size, (count, length)).astype(np.int32)


@jax.jit
def _log_probs(model, ids: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(model(ids).astype(jnp.float32), axis=-1)


@jax.jit
def _kl_sum(model, ids: jax.Array, reference: jax.Array) -> jax.Array:
    """The summed KL(reference || model) over every position of ``ids``."""
    logq = _log_probs(model, ids)
    return jnp.sum(jnp.exp(reference) * (reference - logq))


def kl_metric(reference_model, windows: np.ndarray, batch: int):
    """``metric(model)``: the mean KL divergence, in nats per position, from ``reference_model``'s
    next-token distributions to ``model``'s on ``windows``, ``batch`` windows per compiled call
    (the reference's log-probabilities are computed once and kept on the device)."""
    chunks = [jnp.asarray(windows[i : i + batch]) for i in range(0, len(windows), batch)]
    references = [_log_probs(reference_model, ids) for ids in chunks]
    positions = windows.size

    def kl_divergence(model) -> float:
        return sum(float(_kl_sum(model, ids, ref)) for ids, ref in zip(chunks, references)) / positions

    return kl_divergence


def decode_input(model: nn.LlamaDecoder, batch: int, cache_length: int) -> tuple:
    """``(tokens, start, cache)``: one decode step's arguments for ``batch`` sequences at the last
    position of an empty cache of ``cache_length`` positions (the attention reads all of them)."""
    return (jnp.zeros((batch, 1), jnp.int32), jnp.asarray(cache_length - 1, jnp.int32),
            model.init_cache(batch, cache_length))


def next_decode_input(args: tuple, outputs: tuple) -> tuple:
    """The next timed step's arguments (``step_carry``): the same tokens and position, and the
    cache the step returned, so that steps run back to back on one cache, as decoding does."""
    tokens, start, _ = args
    return tokens, start, outputs[1]


def build(cache_dir, small: bool = False, batch: Batch = 1, phase: Phase = "decode") -> Experiment:
    """The tuning task: the latency of a decode step or a prefill (``phase``) at ``batch``; the
    metric is the mean KL divergence from float32's next-token distributions (lower is better),
    an absolute rise of MAX_KL allowed.

    Args:
      cache_dir: Unused (random weights: nothing to train or cache).
      small: The small form (SMALL instead of FULL), for CPUs and tests.
      batch: Sequences per timed call, one of BATCHES.
      phase: ``"decode"`` or ``"prefill"`` (PHASES).

    Raises:
      ValueError: for a ``batch`` or ``phase`` not among the valid ones, naming them.
    """
    del cache_dir
    check_options(batch, phase)
    size = "small" if small else "full"
    config = SMALL if small else FULL
    model = decoder(config)
    count, length, per_call = WINDOWS[size]
    if phase == "decode":
        sample, carry = decode_input(model, batch, CACHE[size]), next_decode_input
    else:
        sample, carry = (jnp.asarray(random_windows(config, batch, PREFILL[size], seed=2)),), None
    return Experiment(
        name="decoder_1b",
        model=model,
        eval_fn=kl_metric(model, random_windows(config, count, length, seed=0), per_call),
        sample_input=sample,
        step_carry=carry,
        calibration_inputs=[(random_windows(config, CALIBRATION, length, seed=1),)],
        max_drop=MAX_KL,
        relative=False,
        higher_is_better=False,
        candidates=SMALL_CANDIDATES if small else CANDIDATES,
        metric_name="KL divergence from float32 (nats per token)",
        description=DESCRIPTION,
        # `--workload prefill=512,decode=128`: a prefill then decode steps, at `batch` sequences.
        workload_fn=lambda requests: generation.workload_phases(model, requests, batch=batch),
    )
