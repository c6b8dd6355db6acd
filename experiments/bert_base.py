"""bert_base: BERT-base (12 blocks x 768, 12 heads, MLP 3072, vocabulary 30522) with seeded
random weights, timed on a batch of 32 sequences of 128 tokens: an encoder sized for a GPU.

The model is BERT's own layout built from the library's layers, in an ``nn.Sequential``:
``nn.BertEmbeddings`` (word, position and token-type tables, then a LayerNorm) and post-norm
``nn.TransformerBlock`` blocks (epsilon 1e-12, exact GELU), so a tuned model loads with
``autopolicy.load_tuned`` without this file. (``encoder_latency``'s pre-norm ``Encoder`` has its
sizes fixed in module constants, so it cannot give the small form, and is not reused.)

Scored by fidelity to the float32 model: the mean cosine similarity of the final hidden states,
each token's, on the timed batch itself (fixed random token ids), 1.0 for float32. The budget is
an absolute drop of 0.001: a tuned model keeps a cosine of at least 0.999. The timed input is the
whole batch.

The float32 weights are 0.44 GB and a tune compiles the model many times: the full form is meant
for a GPU. ``--small`` (``build(cache_dir, small=True)``) is the same task at 2 blocks x 128 (2
heads, MLP 512, vocabulary 1024) on 4 sequences of 32 tokens, which tunes in under a minute on two
CPU cores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import nn
from autopolicy.experiment import Experiment

DESCRIPTION = ("BERT-base (12 x 768, 12 heads, MLP 3072), random weights, batch 32 x 128 tokens (a GPU task); "
               "metric: cosine fidelity to float32, at least 0.999")


@dataclasses.dataclass(frozen=True)
class Size:
    """The shape of the encoder and of its timed batch."""

    vocab: int
    dim: int
    heads: int
    mlp: int
    blocks: int
    batch: int
    seq: int


FULL = Size(vocab=30522, dim=768, heads=12, mlp=3072, blocks=12, batch=32, seq=128)
SMALL = Size(vocab=1024, dim=128, heads=2, mlp=512, blocks=2, batch=4, seq=32)
MAX_LENGTH = 512      # rows of the position table, as BERT's
CALIBRATION = 8       # sequences (of another seed) for float8 scales and output fidelity
MAX_DROP = 0.001      # absolute: a cosine of at least 0.999


def encoder(size: Size) -> nn.Sequential:
    """An unbuilt BERT encoder of ``size``: embeddings, then post-norm blocks; call it on
    ``(batch, time)`` token ids for the ``(batch, time, dim)`` final hidden states."""
    blocks = [nn.TransformerBlock(size.dim, size.heads, size.mlp, norm_first=False, norm_epsilon=1e-12,
                                  name=f"block_{i}") for i in range(size.blocks)]
    return nn.Sequential([nn.BertEmbeddings(size.vocab, size.dim, MAX_LENGTH, name="embeddings"), *blocks],
                         name="bert_base")


def token_ids(size: Size, count: int, seed: int) -> jax.Array:
    """``(count, size.seq)`` int32 random token ids, seeded."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, size.vocab, (count, size.seq)), jnp.int32)


def cosine_metric(ids: jax.Array, reference: np.ndarray):
    """``metric(model)``: the mean cosine similarity, over every token of ``ids``, of the model's
    final hidden states and ``reference`` (float32's), computed in float64 on the host."""

    def cosine(model) -> float:
        out = np.asarray(model(ids).astype(jnp.float32), np.float64)
        norms = np.linalg.norm(out, axis=-1) * np.linalg.norm(reference, axis=-1)
        return float(np.mean(np.sum(out * reference, -1) / norms))

    return cosine


def build(cache_dir, small: bool = False) -> Experiment:
    """The tuning task: the latency of the encoder on the whole batch; the metric is the mean
    cosine similarity to float32 on that batch, an absolute drop of MAX_DROP allowed.

    Args:
      cache_dir: Unused (random weights: nothing to train or cache).
      small: The small form (SMALL instead of FULL), for CPUs and tests.
    """
    del cache_dir
    size = SMALL if small else FULL
    ids = token_ids(size, size.batch, seed=0)
    model = encoder(size).build(jax.random.key(0), ids[:1])
    reference = np.asarray(model(ids), np.float64)
    return Experiment(
        name="bert_base",
        model=model,
        eval_fn=cosine_metric(ids, reference),
        sample_input=ids,
        calibration_inputs=[token_ids(size, min(CALIBRATION, size.batch), seed=1)],
        max_drop=MAX_DROP,
        relative=False,
        metric_name="cosine similarity to float32 outputs",
        description=DESCRIPTION,
    )
