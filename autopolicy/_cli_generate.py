"""``autopolicy generate RUN_DIR --prompt TEXT``: the tuned language model of a run, greedily
continuing a prompt, with its tokens/s (and, with ``--float32``, the float reference's).

Imported by :mod:`autopolicy.cli` only for that command. Each model generates twice: once to
compile its prefill and decode loop, then the run whose text and times are printed.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from autopolicy import _tuned

__all__ = ["GenerateError", "language_model", "generate_lines", "EOS_TOKENS"]

#: End-of-text tokens that end a generation, where the tokenizer has them.
EOS_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>")


class GenerateError(ValueError):
    """Bad input to ``autopolicy generate``: reported in one line, exit status 2."""


def _tokenizer(run_dir: str) -> Any:
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

    return Tokenizer.from_file(os.path.join(_tuned.tuned_path(run_dir), _tuned.TOKENIZER_FILE))


def language_model(run_dir: str) -> dict[str, Any]:
    """The run's manifest, once it is known to hold a language model with its tokenizer.

    Raises:
      GenerateError: naming what the run holds instead.
    """
    try:
        manifest = _tuned.read_manifest(run_dir)
    except FileNotFoundError:
        raise GenerateError(f"no run directory at {run_dir!r}") from None
    except _tuned.TunedModelError as e:
        raise GenerateError(str(e)) from None
    tokenizer = os.path.join(_tuned.tuned_path(run_dir), _tuned.TOKENIZER_FILE)
    if manifest["framework"] != "autopolicy.nn" or not os.path.isfile(tokenizer):
        raise GenerateError(f"{run_dir!r} is not a language model's run: it holds a {manifest['framework']} model "
                            f"{'with' if os.path.isfile(tokenizer) else 'and no'} tokenizer "
                            f"({_tuned.TUNED_DIR}/{_tuned.TOKENIZER_FILE}); generate runs the tunes of language "
                            "models (autopolicy tune smollm2)")
    return manifest


def _float_model(manifest: dict[str, Any]) -> Any:
    from autopolicy import nn  # pylint: disable=import-outside-toplevel

    gguf = (manifest.get("source") or {}).get("gguf")
    if not gguf:
        raise GenerateError("--float32 needs the float model, and this run does not record where it came from "
                            "(tuned/tuned.json has no source)")
    if not os.path.isfile(gguf):
        raise GenerateError(f"--float32 needs the float model from {gguf!r}, which no longer exists (reinstall the "
                            "package that shipped it, or tune again)")
    return nn.load_gguf(gguf, name=(manifest.get("source") or {}).get("name") or "llama", dtype="float32")[0]


def _cache_length(manifest: dict[str, Any], requested: int | None) -> int:
    if requested is not None:
        return requested
    return int((manifest.get("source") or {}).get("cache_length") or 256)


def generate_lines(run_dir: str, prompt: str, tokens: int, float32: bool = False, cache_length: int | None = None,
                   emit: Callable[[str], None] = print) -> None:
    """Loads the run's tuned decoder (and with ``float32`` its float reference), generates
    ``tokens`` tokens after ``prompt`` greedily and emits the text and timings, line by line.

    Raises:
      GenerateError: for a run that is not a language model's, ``tokens`` < 1, an empty prompt,
        or a prompt and tokens that do not fit in the cache.
    """
    from autopolicy.nn import generation  # pylint: disable=import-outside-toplevel

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise GenerateError(f"--tokens must be an integer >= 1. Received: {tokens!r}")
    manifest = language_model(run_dir)
    tok = _tokenizer(run_dir)
    ids = tok.encode(prompt).ids
    if not ids:
        raise GenerateError("--prompt is empty: give some text to continue")
    length = _cache_length(manifest, cache_length)
    try:
        generation.check_generation(ids, tokens, length)
    except ValueError:
        raise GenerateError(f"the prompt ({len(ids)} tokens) and --tokens {tokens} do not fit in the cache of {length} "
                            f"positions: shorten them, or pass --cache-length {2 * length}") from None
    stop = [i for i in (tok.token_to_id(t) for t in EOS_TOKENS) if i is not None]
    models = [("tuned", _tuned.load_tuned(run_dir))]
    if float32:
        models.append(("float32", _float_model(manifest)))
    summary = _summary(run_dir)
    for label, model in models:
        generation.timed_generate(model, ids, tokens, length, stop)  # compiles; the next run is timed
        out = generation.timed_generate(model, ids, tokens, length, stop)
        emit(f"{label}: {prompt}{tok.decode(list(out.ids))}")
        emit(f"{label}: {len(out.ids)} tokens in {out.prefill_s + out.decode_s:.3f} s: "
             f"{out.decode_tokens_per_s:.1f} tokens/s (prefill {out.prompt_tokens} tokens in {out.prefill_s:.3f} s)")
    step = _run_step_seconds(summary)
    if step:
        emit(f"the tune timed one decode step of the tuned model at {1e3 * step:.2f} ms: {1 / step:.1f} tokens/s "
             f"(steps back to back at cache {length}; device: {summary.get('device', 'unknown')})")


def _summary(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _run_step_seconds(summary: dict[str, Any]) -> float | None:
    latency = (summary.get("chosen") or {}).get("measured_latency_s")
    return float(latency) if latency else None
