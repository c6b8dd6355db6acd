"""Reading llama-family GGUF files (llama.cpp's format): the configuration, the dequantized
float32 weights, and the byte-level BPE tokenizer, into a :class:`~autopolicy.nn.LlamaDecoder`.

Needs the ``gguf`` package (``pip install gguf``), imported only when a file is read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.nn.llama import LlamaConfig, LlamaDecoder

__all__ = ["load_gguf", "read_config", "gguf_weights", "gguf_tokenizer", "unpermute_rotary"]

INSTALL = "pip install gguf"
_CONTROL = 3  # llama.cpp's token type of special (control) tokens


def _gguf() -> Any:
    try:
        import gguf  # pylint: disable=import-outside-toplevel
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"Reading a GGUF file needs the 'gguf' package (llama.cpp's reader); install it: {INSTALL}"
        ) from error
    return gguf


def _reader(source: Any) -> Any:
    gguf = _gguf()
    if isinstance(source, gguf.GGUFReader):
        return source
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No GGUF file at {path!r}")
    return gguf.GGUFReader(path)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"The GGUF file has no field {key!r}")
    return field.contents()


def read_config(reader: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` from a GGUF file's ``llama.*`` fields (a path or a ``GGUFReader``).

    Raises:
      ValueError: when the architecture is not ``llama`` or a field is missing.
    """
    reader = _reader(reader)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"load_gguf reads llama-architecture files. Received general.architecture={arch!r}")
    vocab = reader.fields.get("llama.vocab_size")
    return LlamaConfig(
        vocab_size=int(vocab.contents()) if vocab is not None else len(_field(reader, "tokenizer.ggml.tokens")),
        dim=int(_field(reader, "llama.embedding_length")),
        blocks=int(_field(reader, "llama.block_count")),
        heads=int(_field(reader, "llama.attention.head_count")),
        kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        mlp_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_base=float(_field(reader, "llama.rope.freq_base")),
        norm_epsilon=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_length=int(_field(reader, "llama.context_length")),
    )


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of query/key weight rows.

    llama.cpp's converter reorders each head's output rows from the "rotate half" layout (feature
    ``i`` paired with ``i + head_dim/2``) to interleaved pairs (``2i`` with ``2i + 1``), the layout
    its rotary kernel expects. This puts them back, for :func:`~autopolicy.nn.llama.rotary`.

    Args:
      weight: ``(heads * head_dim, in)`` rows as stored in the GGUF file (PyTorch layout).
      heads: The heads of that projection (key/value heads for the key).

    >>> rows = np.arange(4.0)[:, None]  # one head of 4: stored order a0 b0 a1 b1
    >>> unpermute_rotary(rows, 1)[:, 0]   # back to a0 a1 b0 b1
    array([0., 2., 1., 3.])
    """
    out = weight.shape[0]
    if out % (2 * heads):
        raise ValueError(f"{out} rows do not split into {heads} heads of an even size")
    return weight.reshape(heads, out // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_weights(reader: Any, config: LlamaConfig, root: str, unpermute: bool = True) -> dict[str, np.ndarray]:
    """``{model weight name: float32 array}`` for :func:`~autopolicy.nn.load_weights`: every tensor
    dequantized (``gguf.quants.dequantize``), PyTorch ``(out, in)`` matrices transposed and split
    into heads, the query/key rows put back in the rotary layout (``unpermute=False`` keeps
    llama.cpp's order: wrong for this model, for tests), and the embedding also loaded into the
    head when the file has no ``output.weight`` (tied)."""
    gguf = _gguf()
    reader = _reader(reader)
    hd, dim = config.head_dim, config.dim
    projections = {
        "attn_q": ("attention/query", config.heads), "attn_k": ("attention/key", config.kv_heads),
        "attn_v": ("attention/value", config.kv_heads), "attn_output": ("attention/attention_output", None),
        "ffn_gate": ("mlp/gate", None), "ffn_up": ("mlp/up", None), "ffn_down": ("mlp/down", None),
    }
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = tensor.name
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        array = array.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if name == "token_embd.weight":
            out[f"{root}/embedding/kernel"] = array
        elif name == "output.weight":
            out[f"{root}/head/kernel"] = array.T
        elif name == "output_norm.weight":
            out[f"{root}/final_norm/scale"] = array
        elif name.startswith("blk."):
            _, index, kind, _ = name.split(".")
            block = f"{root}/block_{index}"
            if kind == "attn_norm":
                out[f"{block}/attention_norm/scale"] = array
            elif kind == "ffn_norm":
                out[f"{block}/mlp_norm/scale"] = array
            elif kind in projections:
                path, heads = projections[kind]
                if kind in ("attn_q", "attn_k") and unpermute:
                    array = unpermute_rotary(array, heads)
                kernel = array.T
                if heads is not None:
                    kernel = kernel.reshape(dim, heads, hd)
                elif kind == "attn_output":
                    kernel = kernel.reshape(config.heads, hd, dim)
                out[f"{block}/{path}/kernel"] = kernel
            else:
                raise ValueError(f"Unexpected GGUF tensor {name!r}")
        else:
            raise ValueError(f"Unexpected GGUF tensor {name!r}")
    out.setdefault(f"{root}/head/kernel", out[f"{root}/embedding/kernel"].T)
    return out


def gguf_tokenizer(reader: Any) -> Any:
    """A ``tokenizers.Tokenizer`` rebuilt from the file's ``tokenizer.ggml.*`` fields: byte-level
    BPE (``gpt2``) with the file's vocabulary and merges, digits split one by one (as SmolLM2's),
    and the control tokens (``<|im_start|>``, ...) as special tokens.

    Raises:
      ValueError: for a tokenizer model other than ``gpt2``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel

    reader = _reader(reader)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"gguf_tokenizer rebuilds byte-level BPE ('gpt2') tokenizers. Received tokenizer.ggml.model={kind!r}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    return tok


def load_gguf(path: Any, name: str = "llama", dtype: Any = None) -> tuple[LlamaDecoder, LlamaConfig, Any]:
    """Builds a :class:`~autopolicy.nn.LlamaDecoder` from a llama-architecture GGUF file.

    The quantized tensors are dequantized to float32 (``gguf``'s own dequantize): that float32
    model is the reference. Apply policies to it afterwards (``model.with_dtype_policy``).

    Args:
      path: The ``.gguf`` file.
      name: The model's (root layer's) name.
      dtype: The model's policy (default: the global one).

    Returns:
      ``(model, config, tokenizer)``: the tokenizer is a ``tokenizers.Tokenizer``
      (:func:`gguf_tokenizer`).

    Raises:
      ModuleNotFoundError: naming ``pip install gguf`` when the package is missing.
      FileNotFoundError, ValueError: for a missing file, another architecture, or tensors the
        model does not have.
    """
    from autopolicy.nn.weights import load_weights  # pylint: disable=import-outside-toplevel

    reader = _reader(path)
    config = read_config(reader)
    model = LlamaDecoder(dataclasses.asdict(config), name=name, dtype=dtype)  # a dict: it saves
    model = model.build(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    model, _ = load_weights(model, gguf_weights(reader, config, name))
    return model, config, gguf_tokenizer(reader)
