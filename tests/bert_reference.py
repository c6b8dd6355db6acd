"""An independent float64 NumPy BERT: the reference for the encoder layers and the MiniLM parity
tests. It shares no code with autopolicy.nn and reads weights by plain matrix names."""

import math

import numpy as np
from scipy.special import erf  # float64 erf (scipy comes with scikit-learn)


def gelu(x):
    """Exact GELU, ``x * Phi(x)``."""
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def attention(x, p, heads, mask=None, causal=False):
    """Multi-head self-attention; ``p`` holds ``wq, bq, wk, bk, wv, bv, wo, bo`` as ``[in, out]``
    matrices and vectors. Padded keys (mask 0) and, if causal, later keys get zero weight."""
    b, t, d = x.shape
    hd = p["wq"].shape[1] // heads

    def split(h):
        return h.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)

    q, k, v = (split(x @ p["w" + n] + p["b" + n]) for n in "qkv")
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    allowed = np.ones((b, 1, t, t), bool)
    if mask is not None:
        allowed = allowed & (np.asarray(mask)[:, None, None, :] != 0)
    if causal:
        allowed = allowed & np.tril(np.ones((t, t), bool))
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, heads * hd)
    return out @ p["wo"] + p["bo"]


def block(x, p, heads, norm_first, eps, mask=None, activation=gelu):
    """An encoder block: ``p`` adds ``g1, b1, g2, b2`` (norms) and ``w1, c1, w2, c2`` (MLP)."""
    mlp = lambda h: activation(h @ p["w1"] + p["c1"]) @ p["w2"] + p["c2"]  # noqa: E731
    if norm_first:
        x = x + attention(layer_norm(x, p["g1"], p["b1"], eps), p, heads, mask)
        return x + mlp(layer_norm(x, p["g2"], p["b2"], eps))
    x = layer_norm(x + attention(x, p, heads, mask), p["g1"], p["b1"], eps)
    return layer_norm(x + mlp(x), p["g2"], p["b2"], eps)


def hf_block_params(w, i):
    """Plain matrices of layer ``i`` of a Hugging Face BERT state dict (``[out, in]`` weights)."""
    f = lambda name: np.asarray(w[f"encoder.layer.{i}.{name}"], np.float64)  # noqa: E731
    p = {}
    for ours, theirs in (("q", "attention.self.query"), ("k", "attention.self.key"),
                         ("v", "attention.self.value"), ("o", "attention.output.dense")):
        p["w" + ours], p["b" + ours] = f(theirs + ".weight").T, f(theirs + ".bias")
    p["w1"], p["c1"] = f("intermediate.dense.weight").T, f("intermediate.dense.bias")
    p["w2"], p["c2"] = f("output.dense.weight").T, f("output.dense.bias")
    p["g1"], p["b1"] = f("attention.output.LayerNorm.weight"), f("attention.output.LayerNorm.bias")
    p["g2"], p["b2"] = f("output.LayerNorm.weight"), f("output.LayerNorm.bias")
    return p


def bert_embeddings(w, ids, eps, token_type_ids=None):
    f = lambda name: np.asarray(w[f"embeddings.{name}"], np.float64)  # noqa: E731
    types = np.zeros_like(ids) if token_type_ids is None else token_type_ids
    x = (f("word_embeddings.weight")[ids] + f("position_embeddings.weight")[: ids.shape[1]][None]
         + f("token_type_embeddings.weight")[types])
    return layer_norm(x, f("LayerNorm.weight"), f("LayerNorm.bias"), eps)


def bert(w, ids, mask, heads, eps, layers):
    """Hidden states after ``layers`` post-norm blocks of a Hugging Face BERT state dict."""
    x = bert_embeddings(w, ids, eps)
    for i in range(layers):
        x = block(x, hf_block_params(w, i), heads, norm_first=False, eps=eps, mask=mask)
    return x


def mean_pool_normalize(x, mask):
    """sentence-transformers' mean pooling over real tokens, then L2 normalization."""
    m = np.asarray(mask, np.float64)[..., None]
    e = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
