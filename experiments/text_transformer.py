"""text_transformer: a byte-level transformer language model on Python's own standard library.

Four pre-norm blocks (width 128, 4 heads, MLP 512) over 64-byte windows, trained briefly on
the standard library's sources and scored by next-byte accuracy on held-out files.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopolicy import datasets, nn, train
from autopolicy.experiment import Experiment, cached_model

DESCRIPTION = "byte-level LM, 4 pre-norm blocks (d=128, 4 heads), 64-byte context; metric: held-out next-byte accuracy"
SEQ, DIM, HEADS, MLP, BLOCKS = 64, 128, 4, 512, 4
BATCH = 32
STEPS = 800


@nn.register_serializable
class ByteLM(nn.Module):
    """Token and position embeddings, causal transformer blocks, a final norm and a byte head."""

    def __init__(self, seq=SEQ, dim=DIM, heads=HEADS, mlp=MLP, blocks=BLOCKS, **kwargs):
        super().__init__(**kwargs)
        self.tokens = nn.Embedding(256, dim)
        self.positions = nn.Embedding(seq, dim)
        self.blocks = [nn.TransformerBlock(dim, heads, mlp, causal=True) for _ in range(blocks)]
        self.norm = nn.LayerNormalization()
        self.head = nn.Dense(256)

    def call(self, ids):
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        x = self.cast(self.tokens(ids)) + self.cast(self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def windows(stream: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random (input, next-byte target) windows of length SEQ from ``stream``."""
    starts = np.random.default_rng(seed).integers(0, len(stream) - SEQ - 1, count)
    x = np.stack([stream[s : s + SEQ] for s in starts]).astype(np.int32)
    y = np.stack([stream[s + 1 : s + SEQ + 1] for s in starts]).astype(np.int32)
    return x, y


def _train(stream: np.ndarray) -> nn.Module:
    model = ByteLM(name="byte_lm").build(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    x, y = windows(stream, STEPS * BATCH, seed=1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, STEPS)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    model, _ = train.fit(model, optimizer, "sparse_categorical_crossentropy", (x, y), epochs=1,
                         batch_size=BATCH, seed=0)
    return model


def build(cache_dir) -> Experiment:
    train_stream, held_out = datasets.python_source_bytes(num_bytes=2_000_000, seed=0)
    model = cached_model(cache_dir, "text_transformer-v1", lambda: _train(train_stream),
                         custom_objects={"ByteLM": ByteLM})
    val = windows(held_out[: len(held_out) // 2], 256, seed=2)
    test = windows(held_out[len(held_out) // 2 :], 256, seed=3)
    return Experiment(
        name="text_transformer",
        model=model,
        eval_fn=lambda m: train.evaluate(m, val, batch_size=64)["accuracy"],
        test_fn=lambda m: train.evaluate(m, test, batch_size=64)["accuracy"],
        sample_input=jnp.asarray(val[0][:BATCH]),
        calibration_inputs=[jnp.asarray(val[0][:64])],
        max_drop=0.01,
        metric_name="held-out next-byte accuracy",
        description=DESCRIPTION,
    )
