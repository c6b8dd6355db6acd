"""The tuned model in a run directory: ``TuneResult.save`` writes it, ``autopolicy.load_tuned``
reads it back in another process (alone, or onto the user's own float model), ``autopolicy
export --model`` copies it, ``autopolicy generate`` runs a language model's."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
import autopolicy.nn as nn
from autopolicy import _tuned, cli, search
from autopolicy.nn.weight_calibration import calibrate_weights
from autopolicy.search.adapter import digest_arrays

X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 24)), jnp.float32)
MAP = ap.DTypePolicyMap("float32", {"mlp/a": "int8_from_float32", "mlp/b": "gptq/4/8_from_float32",
                                    "mlp/c": "float8_from_float32"})


def mlp(seed=0, width=32):
    layers = [nn.Dense(width, activation="relu", name="a"), nn.Dense(32, activation="relu", name="b"),
              nn.Dense(5, name="c")]
    return nn.Sequential(layers, name="mlp").build(jax.random.key(seed), X)


def tuned_of(model):
    """``model`` under MAP: GPTQ weights and float8 scales calibrated, a kernel chosen."""
    tuned = nn.calibrate(calibrate_weights(model.with_dtype_policy(MAP), [X]), [X])
    kernel = tuned.layers_by_path()["mlp/a"].kernel_choices()[-1]
    return tuned.with_kernels({"mlp/a": kernel}), {"mlp/a": kernel}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory holding MLP's tuned model, as ``result.save`` writes it."""
    model = mlp()
    tuned, kernels = tuned_of(model)
    directory = tmp_path_factory.mktemp("run")
    written = _tuned.save_tuned(tuned, directory, MAP, kernels=kernels, device="cpu: test",
                                weights_digest=digest_arrays(model.with_dtype_policy("float32")), sample_args=(X,))
    assert written == os.path.join(str(directory), "tuned")
    return str(directory), model, tuned


def fresh_process_outputs(run_dir, tmp_path):
    """The outputs of ``load_tuned(run_dir)`` on X, computed in a process of its own."""
    np.save(tmp_path / "x.npy", np.asarray(X))
    code = textwrap.dedent(f"""
        import numpy as np, autopolicy
        model = autopolicy.load_tuned({run_dir!r})
        np.save({str(tmp_path / "y.npy")!r}, np.asarray(model(np.load({str(tmp_path / "x.npy")!r}))))
        print({{p: l.dtype_policy.name for p, l in model.layers_by_path().items()}})
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return np.load(tmp_path / "y.npy"), out.stdout


def test_the_run_directory_holds_the_tuned_model_and_its_manifest(run):
    run_dir, _, _ = run
    with open(os.path.join(run_dir, "tuned", "tuned.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["format"] == "autopolicy.tuned/1" and manifest["framework"] == "autopolicy.nn"
    assert manifest["calibrated"] == ["mlp/b", "mlp/c"]  # GPTQ weights, float8 scales
    assert sorted(os.listdir(os.path.join(run_dir, "tuned"))) == ["model.json", "tuned.json", "weights.npz"]
    assert manifest["nbytes"] == sum(os.path.getsize(os.path.join(run_dir, "tuned", f))
                                     for f in ("model.json", "weights.npz"))
    assert manifest["sample"] == [{"shape": [16, 24], "dtype": "float32"}]
    assert not [f for f in os.listdir(run_dir) if f.startswith(".tmp-")]


@pytest.mark.slow
def test_load_tuned_in_a_fresh_process_gives_the_tuned_outputs_exactly(run, tmp_path):
    run_dir, _, tuned = run
    outputs, printed = fresh_process_outputs(run_dir, tmp_path)
    np.testing.assert_array_equal(outputs, np.asarray(tuned(X)))
    assert "'mlp/b': 'gptq/4/8_from_float32'" in printed and "'mlp/c': 'float8_from_float32'" in printed
    loaded = ap.load_tuned(run_dir)
    assert loaded.kernels() == tuned.kernels() == {"mlp/a": tuned.kernels()["mlp/a"]}


def test_load_tuned_onto_the_users_float_model_gives_the_same_model(run):
    run_dir, model, tuned = run
    before = np.asarray(model(X))
    mine = ap.load_tuned(run_dir, model)
    np.testing.assert_array_equal(np.asarray(mine(X)), np.asarray(tuned(X)))
    assert {p: l.dtype_policy.name for p, l in mine.layers_by_path().items()} == {
        "mlp/a": "int8_from_float32", "mlp/b": "gptq/4/8_from_float32", "mlp/c": "float8_from_float32"}
    np.testing.assert_array_equal(np.asarray(model(X)), before)  # the user's model is untouched
    assert model.layers_by_path()["mlp/a"].dtype_policy.name == "float32"


def test_a_model_of_another_architecture_is_refused_by_name(run):
    with pytest.raises(ap.TunedModelError, match=r"layer 'mlp/a' is Dense\(16, activation=\"relu\"\) in model, "
                                                 r"Dense\(32, activation=\"relu\"\) in the run"):
        ap.load_tuned(run[0], mlp(width=16))
    with pytest.raises(ap.TunedModelError, match=r"lacks the layers \['mlp/c'\]"):
        ap.load_tuned(run[0], nn.Sequential([nn.Dense(32, name="a"), nn.Dense(32, name="b")],
                                            name="mlp").build(jax.random.key(0), X))
    with pytest.raises(ap.TunedModelError, match=r"The run tuned a autopolicy.nn model; model is a builtins.dict"):
        ap.load_tuned(run[0], {"a": 1})


def test_other_weights_are_quantized_from_the_users_and_the_calibrated_layers_named(run):
    run_dir, _, tuned = run
    other = mlp(seed=1)
    with pytest.warns(UserWarning, match=r"weights differ from those the run tuned.*\['mlp/b', 'mlp/c'\]"):
        mine = ap.load_tuned(run_dir, other)
    np.testing.assert_array_equal(mine.layers_by_path()["mlp/b"].kernel, tuned.layers_by_path()["mlp/b"].kernel)
    assert not np.array_equal(mine.layers_by_path()["mlp/a"].kernel, tuned.layers_by_path()["mlp/a"].kernel)


def test_runs_without_a_tuned_model_say_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="No run directory at"):
        ap.load_tuned(tmp_path / "nowhere")
    with pytest.raises(ap.TunedModelError, match=r"not a tune's run directory \(no policy_map.json either\)"):
        ap.load_tuned(tmp_path)
    ap.save_policy_map(MAP, tmp_path / "policy_map.json")
    with pytest.raises(ap.TunedModelError, match=r"run the tune again \(it resumes from its cache\)"):
        ap.load_tuned(tmp_path)
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "tuned.json").write_text("{not json")
    with pytest.raises(ap.TunedModelError, match="is damaged: not JSON"):
        ap.load_tuned(tmp_path)
    (tmp_path / "tuned" / "tuned.json").write_text(json.dumps({"format": "autopolicy.tuned/9"}))
    with pytest.raises(ap.TunedModelError, match="Received format: 'autopolicy.tuned/9'"):
        ap.load_tuned(tmp_path)
    (tmp_path / "tuned" / "tuned.json").write_text(json.dumps({"format": _tuned.FORMAT, "framework": "torch"}))
    with pytest.raises(ap.TunedModelError, match=r"unknown framework 'torch'. Expected one of \('autopolicy.nn', "):
        ap.load_tuned(tmp_path)


def test_saving_again_replaces_the_tuned_model_whole(run, tmp_path):
    _, model, _ = run
    float_map = ap.DTypePolicyMap("float32", {"mlp/a": "int8_from_float32"})
    _tuned.save_tuned(model.with_dtype_policy(float_map), tmp_path, float_map)
    _tuned.save_tuned(model, tmp_path, ap.DTypePolicyMap("float32"))
    assert sorted(os.listdir(tmp_path)) == ["tuned"]
    assert ap.load_tuned(tmp_path).layers_by_path()["mlp/a"].dtype_policy.name == "float32"
    assert _tuned.save_tuned(object(), tmp_path / "other", float_map) is None  # a kind autopolicy cannot save


def test_export_model_copies_the_tuned_model_for_load_tuned(run, tmp_path, capsys):
    run_dir, _, tuned = run
    out = str(tmp_path / "shipped")
    assert cli.main(["export", run_dir, "--model", out]) == 0
    assert re.fullmatch(rf"wrote {re.escape(out)} \(\d+\.\d MB\): load it with autopolicy.load_tuned\(.*\)\n",
                        capsys.readouterr().out)
    np.testing.assert_array_equal(np.asarray(ap.load_tuned(out)(X)), np.asarray(tuned(X)))
    assert cli.main(["export", run_dir, "--model", out]) == 2
    assert "exists and is not an empty directory: name a new directory" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "nowhere"), "--model", str(tmp_path / "x")]) == 2
    assert "no run directory at" in capsys.readouterr().err


# --- autopolicy generate ---------------------------------------------------------------------------

TINY = nn.LlamaConfig(vocab_size=40, dim=24, blocks=2, heads=6, kv_heads=2, mlp_dim=32, rope_base=100.0)
WORDS = [f"w{i}" for i in range(39)] + ["<unk>"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    model = nn.LlamaDecoder(dataclasses.asdict(TINY), name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    tuned = model.with_dtype_policy(ap.DTypePolicyMap("float32", {"tiny/block_0/mlp/up": "int8_from_float32"}))
    directory = str(tmp_path_factory.mktemp("lm"))
    _tuned.save_tuned(tuned, directory, ap.DTypePolicyMap("float32"), tokenizer=tokenizer(),
                      source={"name": "tiny", "cache_length": 64})
    return directory, tuned


def test_generate_prints_the_greedy_text_and_tokens_per_second(lm_run, capsys):
    run_dir, tuned = lm_run
    assert cli.main(["generate", run_dir, "--prompt", "w1 w2 w3", "--tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = nn.generation.greedy_generate(tuned, [1, 2, 3], 6, 64)
    assert lines[0] == "tuned: w1 w2 w3" + tokenizer().decode(expected)
    assert re.fullmatch(r"tuned: 6 tokens in \d+\.\d{3} s: \d+\.\d tokens/s \(prefill 3 tokens in \d+\.\d{3} s\)",
                        lines[1]), lines[1]
    assert len(lines) == 2  # no summary.json in this run: no decode-step figure to compare with


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "--tokens must be an integer >= 1. Received: 0"),
    (["--tokens", "62"], "the prompt (3 tokens) and --tokens 62 do not fit in the cache of 64 positions: shorten "
                         "them, or pass --cache-length 128"),
    (["--float32"], "--float32 needs the float model, and this run does not record where it came from"),
])
def test_generate_refuses_bad_input_in_one_line(lm_run, capsys, argv, message):
    assert cli.main(["generate", lm_run[0], "--prompt", "w1 w2 w3", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopolicy generate: error: ") and message in err and err.count("\n") == 1, err


def test_generate_refuses_a_run_that_is_not_a_language_models(run, capsys):
    assert cli.main(["generate", run[0], "--prompt", "hello"]) == 2
    assert ("is not a language model's run: it holds a autopolicy.nn model and no tokenizer (tuned/tokenizer.json)"
            in capsys.readouterr().err)


# --- a real tune -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_tunes_saved_model_loads_in_a_fresh_process_with_the_same_outputs(tmp_path):
    model = mlp()
    reference = np.asarray(model(X))

    def fidelity(m):
        return 1.0 - float(np.linalg.norm(np.asarray(m(X)) - reference) / np.linalg.norm(reference))

    result = search.tune(model, fidelity, X, candidates=["float32", "int8_from_float32", "gptq/8/-1_from_float32"],
                         max_drop=0.5, relative=False, repeats=3, progress=False, cache_dir=str(tmp_path / "cache"))
    tuned_dir = result.save(tmp_path / "run")
    assert tuned_dir == str(tmp_path / "run" / "tuned")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tuned_model"]["framework"] == "autopolicy.nn" and summary["tuned_model"]["nbytes"] > 0
    outputs, _ = fresh_process_outputs(str(tmp_path / "run"), tmp_path)
    np.testing.assert_array_equal(outputs, np.asarray(result.model(X)))
    np.testing.assert_array_equal(np.asarray(ap.load_tuned(tmp_path / "run", model)(X)), np.asarray(result.model(X)))
