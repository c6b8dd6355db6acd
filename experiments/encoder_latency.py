"""encoder_latency: a BERT-base-shaped encoder (hidden 768, 12 heads, sequence 128, 12 blocks)
with seeded random weights, where latency dominates.

Scored by fidelity to the float32 model: the mean cosine similarity of the final hidden states
on fixed random token sequences (1.0 for float32). Timed for a single 128-token request.
"""

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import nn
from autopolicy.experiment import Experiment

DESCRIPTION = "BERT-base-shaped encoder (12 x 768, 12 heads, seq 128), random weights; metric: cosine fidelity to float32"
VOCAB, SEQ, DIM, HEADS, MLP, BLOCKS = 30522, 128, 768, 12, 3072, 12


@nn.register_serializable
class Encoder(nn.Module):
    """Token and position embeddings, an embedding norm, and pre-norm transformer blocks."""

    def __init__(self, blocks=BLOCKS, **kwargs):
        super().__init__(**kwargs)
        self.tokens = nn.Embedding(VOCAB, DIM, embeddings_initializer="random_normal")
        self.positions = nn.Embedding(SEQ, DIM, embeddings_initializer="random_normal")
        self.embedding_norm = nn.LayerNormalization()
        self.blocks = [nn.TransformerBlock(DIM, HEADS, MLP) for _ in range(blocks)]
        self.norm = nn.LayerNormalization()

    def call(self, ids):
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        x = self.embedding_norm(self.cast(self.tokens(ids)) + self.cast(self.positions(positions)))
        x = self.cast(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build(cache_dir) -> Experiment:
    del cache_dir  # random weights: nothing to train or cache
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, SEQ)), jnp.int32)
    model = Encoder(name="encoder").build(jax.random.key(0), ids[:1])
    reference = np.asarray(model(ids), np.float64)

    def fidelity(m) -> float:
        out = np.asarray(m(ids).astype(jnp.float32), np.float64)
        cos = np.sum(out * reference, -1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(reference, axis=-1))
        return float(np.mean(cos))

    return Experiment(
        name="encoder_latency",
        model=model,
        eval_fn=fidelity,
        sample_input=ids[:1],
        calibration_inputs=[ids[:2]],
        max_drop=0.01,
        relative=False,
        metric_name="cosine similarity to float32 outputs",
        description=DESCRIPTION,
    )
