"""The GGUF export's mapping and command line, without llama.cpp (the llamacpp tier runs llama.cpp)."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
from autopolicy import _tuned, cli, llamacpp, nn

TINY = nn.LlamaConfig(vocab_size=40, dim=32, blocks=2, heads=4, kv_heads=2, mlp_dim=64, rope_base=100.0)
MAP = {"tiny/block_0/attention/query": "gptq/4/32_from_float32", "tiny/block_0/mlp/up": "int8_from_float32",
       "tiny/block_1/mlp/down": "int4/128_from_float32", "tiny/block_1/attention/key": "mixed_bfloat16",
       "tiny/head": "int8_from_float32"}


@pytest.fixture(scope="module")
def tiny():
    return nn.LlamaDecoder(dataclasses.asdict(TINY), name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_each_projection_takes_the_gguf_type_of_its_policy_and_the_tied_table_the_heads(tiny):
    types = llamacpp.gguf_types(tiny.with_dtype_policy(ap.DTypePolicyMap("float32", MAP)))
    kinds = {name: kind for name, (kind, _) in types.items()}
    assert len(kinds) == 2 * 7 + 1  # seven matrices a block, and the embedding table (tied: no output.weight)
    assert kinds["blk.0.attn_q.weight"] == "Q4_1"  # 4 bits, a scale and zero point per group
    assert kinds["blk.0.ffn_up.weight"] == "Q8_0"
    assert kinds["blk.1.ffn_down.weight"] == "Q4_0"  # symmetric int4
    assert kinds["blk.1.attn_k.weight"] == "BF16"
    assert kinds["token_embd.weight"] == "Q8_0"  # the head's policy: its product runs at every token
    assert kinds["blk.0.attn_k.weight"] == kinds["blk.1.ffn_gate.weight"] == "F32"
    assert "not GPTQ's calibrated ones" in types["blk.0.attn_q.weight"][1]
    untied = llamacpp.gguf_types(tiny.with_dtype_policy(ap.DTypePolicyMap("float32", MAP)), tied=False)
    assert untied["output.weight"][0] == "Q8_0" and untied["token_embd.weight"][0] == "F32"


def test_the_tensor_type_file_anchors_each_name_and_leaves_the_tables_to_their_own_flags(tiny):
    types = llamacpp.gguf_types(tiny.with_dtype_policy(ap.DTypePolicyMap("float32", MAP)))
    lines = llamacpp.tensor_type_lines(types).splitlines()
    assert len(lines) == 14 and r"^blk\.0\.attn_q\.weight$=q4_1" in lines
    assert not any("token_embd" in line for line in lines)
    # llama.cpp matches each pattern anywhere in a name (regex_search): anchored, each names one tensor
    # (blk.1 is not blk.10 of a deeper model), and the tables take their own flags.
    names = [*types, *(n.replace("blk.1.", "blk.10.") for n in types if n.startswith("blk.1."))]
    for line in lines:
        pattern, _ = line.split("=")
        assert len([n for n in names if re.search(pattern, n)]) == 1, pattern
    assert llamacpp.quantize_flags(types) == ["--token-embedding-type", "q8_0"]


@pytest.mark.parametrize("policy, kind", [("float16", "F16"), ("float32", "F32"), ("gptq/8/-1_from_float32", "Q8_0"),
                                          ("awq/4/128_from_float32", "Q4_1"), ("float8_from_float32", "Q8_0"),
                                          ("int4_from_float32", "Q4_0"), ("gptq/3/64_from_float32", "Q3_K")])
def test_gguf_type_of_each_policy(policy, kind):
    assert llamacpp.gguf_type(ap.policies.get(policy))[0] == kind


def test_a_model_that_is_not_a_llama_decoder_is_refused():
    with pytest.raises(ValueError, match="The GGUF export writes llama decoders .* Received a Dense"):
        llamacpp.gguf_types(nn.Dense(3))


def test_cmake_options_follow_the_cpu_flags_and_keep_amx_off():
    avx2 = llamacpp.cmake_options({"avx", "avx2", "fma", "f16c", "bmi2"})
    vnni = llamacpp.cmake_options({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_int8"})
    assert "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2 and "-DGGML_NATIVE=OFF" in avx2
    assert "-DGGML_AVX512=ON" in vnni and "-DGGML_AVX512_VNNI=ON" in vnni and "-DGGML_AMX_INT8=OFF" in vnni
    assert "-DGGML_BMI2=OFF" in vnni


def test_perplexity_like_llama_scores_the_second_half_of_each_window(tiny):
    rng = np.random.default_rng(0)
    windows = rng.integers(0, TINY.vocab_size, (3, 8)).astype(np.int32)
    logp = np.asarray(jax.nn.log_softmax(tiny(jnp.asarray(windows)), axis=-1), np.float64)
    # Positions 4, 5, 6 predict tokens 5, 6, 7 in each window.
    nll = -np.mean([logp[w, j, windows[w, j + 1]] for w in range(3) for j in (4, 5, 6)])
    assert llamacpp.perplexity_like_llama(tiny, windows) == pytest.approx(math.exp(nll), rel=1e-5)
    with pytest.raises(ValueError, match=r"windows must be integer token ids of shape \(count, ctx\) with ctx >= 4"):
        llamacpp.perplexity_like_llama(tiny, windows[:, :3])


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, tiny):
    tuned = tiny.with_dtype_policy(ap.DTypePolicyMap("float32", MAP))
    directory = str(tmp_path_factory.mktemp("lm"))
    _tuned.save_tuned(tuned, directory, ap.DTypePolicyMap("float32", MAP), source={"name": "tiny", "cache_length": 64})
    return directory


def test_export_writes_the_tensor_type_file_and_says_how_to_use_it(lm_run, tmp_path, capsys):
    out = tmp_path / "types.txt"
    assert cli.main(["export", lm_run, "--format", "llama-tensor-types", "--out", str(out)]) == 0
    assert r"^blk\.1\.ffn_down\.weight$=q4_0" in out.read_text().splitlines()
    said = capsys.readouterr().out
    assert f"wrote {out} (15 tensors); use it as: llama-quantize --allow-requantize --tensor-type-file {out} " \
           "--token-embedding-type q8_0 SOURCE.gguf OUT.gguf Q8_0" in said


def test_export_to_gguf_needs_a_source_and_takes_its_options_alone(lm_run, tmp_path, capsys):
    out = str(tmp_path / "tuned.gguf")
    assert cli.main(["export", lm_run, "--format", "gguf", "--out", out]) == 2
    assert "records no source GGUF file: name it with --source FILE.gguf" in capsys.readouterr().err
    assert cli.main(["export", lm_run, "--format", "gguf", "--out", out, "--source", str(tmp_path / "no.gguf")]) == 2
    assert f"no GGUF file at {str(tmp_path / 'no.gguf')!r}" in capsys.readouterr().err
    assert cli.main(["export", lm_run, "--source", "x.gguf", "--out", out]) == 2
    assert "--source goes with --format gguf (got --format json)" in capsys.readouterr().err
    assert cli.main(["export", lm_run, "--format", "gguf", "--model", str(tmp_path / "m")]) == 2
    assert "--model copies the tuned model as it is: --format and --source go with --out" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_tools_missing_name_the_build_command(tmp_path, monkeypatch):
    monkeypatch.delenv(llamacpp.ENV, raising=False)
    monkeypatch.setenv("AUTOPOLICY_CACHE", str(tmp_path))
    assert llamacpp.find_tools() is None
    with pytest.raises(llamacpp.LlamaCppError, match=r"run `\S+ -m autopolicy.llamacpp build`"):
        llamacpp.require_tools()
    monkeypatch.setenv(llamacpp.ENV, str(tmp_path / "none"))
    with pytest.raises(llamacpp.LlamaCppError, match="names .*none', which is not a folder"):
        llamacpp.find_tools()
    monkeypatch.setenv(llamacpp.ENV, str(tmp_path))
    with pytest.raises(llamacpp.LlamaCppError, match="llama-quantize is not in"):
        llamacpp.find_tools().path("llama-quantize")
