"""Layers that honour dtype policies, as immutable JAX pytrees.

Build a model once with sample inputs, call it, jit it, train it with optax, give it a
``DTypePolicyMap``: every change returns a new model.

Floating-point inputs of every layer (positional and keyword, nested) are cast to the layer's
compute dtype, as in Keras 3 (TF 2 cast only the first argument); integer inputs (ids, masks)
never are. Weights are stored in the variable dtype and read in the compute dtype.
"""

from autopolicy.nn._context import rng_scope
from autopolicy.nn._module import Layer, Module, is_module
from autopolicy.nn._parts import PartOutputs
from autopolicy.nn import activations, initializers, regularizers, weights
from autopolicy.nn.attention import DotProductAttention, MultiHeadAttention
from autopolicy.nn.conv import Conv2D, MaxPooling2D
from autopolicy.nn.core import Activation, Dropout, Flatten, GlobalAveragePooling1D, Softmax
from autopolicy.nn.dense import Dense, EinsumDense
from autopolicy.nn.embedding import Embedding
from autopolicy.nn.normalization import LayerNormalization, RMSNormalization, UnitNormalization
from autopolicy.nn.sequential import Sequential
from autopolicy.nn.transformer import TransformerBlock, causal_mask
from autopolicy.nn.bert import BertEmbeddings, SentenceEncoder, bert_mapping
from autopolicy.nn.llama import LlamaAttention, LlamaBlock, LlamaConfig, LlamaDecoder, LlamaMLP
from autopolicy.nn.gguf import load_gguf
from autopolicy.nn.generation import greedy_generate, perplexity
from autopolicy.nn.weights import LoadReport, load_weights, weight_names
from autopolicy.nn.calibration import calibrate
from autopolicy.nn.weight_calibration import calibrate_weights, uncalibrated_layers
from autopolicy.nn.serialization import load, register_serializable, save
from autopolicy.nn._partition import combine, leaf_kinds, partition

__all__ = [
    "Module",
    "Layer",
    "is_module",
    "PartOutputs",
    "rng_scope",
    "Dense",
    "EinsumDense",
    "Embedding",
    "Conv2D",
    "MaxPooling2D",
    "LayerNormalization",
    "RMSNormalization",
    "UnitNormalization",
    "Dropout",
    "Activation",
    "Softmax",
    "Flatten",
    "GlobalAveragePooling1D",
    "DotProductAttention",
    "MultiHeadAttention",
    "Sequential",
    "TransformerBlock",
    "causal_mask",
    "BertEmbeddings",
    "SentenceEncoder",
    "bert_mapping",
    "LlamaConfig",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaBlock",
    "LlamaDecoder",
    "load_gguf",
    "greedy_generate",
    "perplexity",
    "load_weights",
    "weight_names",
    "LoadReport",
    "calibrate",
    "calibrate_weights",
    "uncalibrated_layers",
    "save",
    "load",
    "register_serializable",
    "partition",
    "combine",
    "leaf_kinds",
    "activations",
    "initializers",
    "regularizers",
    "weights",
]
