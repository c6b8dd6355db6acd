"""The command line on Keras models: `autopolicy tune model.keras --eval ... --sample ...` and
`autopolicy apply map.json model.keras --out tuned.keras`, and their bad arguments."""

import json
import os
import re
import textwrap
import warnings

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    keras = pytest.importorskip("keras")

import autopolicy as ap  # noqa: E402
import autopolicy.keras as apk  # noqa: E402
from autopolicy import cli, policies  # noqa: E402
from test_keras_adapter import IDS, fake_clock, functional_model  # noqa: E402,F401  (fake_clock: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

EVAL = textwrap.dedent('''
    """The user's side: a held-out score and a sample batch."""
    import numpy as np

    IDS = np.random.default_rng(5).integers(0, 64, (48, 16)).astype(np.int32)
    REFERENCE = None

    def evaluate(model):
        global REFERENCE
        out = np.asarray(model.predict(IDS, verbose=0), np.float32)
        if REFERENCE is None:
            REFERENCE = out  # the first model scored is the float32 one
        return 1.0 - float(np.linalg.norm(out - REFERENCE) / np.linalg.norm(REFERENCE))

    def sample():
        return IDS[:32]
''')


@pytest.fixture(autouse=True)
def _keras_promotion():
    import jax

    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def files(tmp_path):
    model = functional_model()
    model.save(tmp_path / "model.keras")
    (tmp_path / "user_eval.py").write_text(EVAL)
    np.save(tmp_path / "sample.npy", IDS)
    return tmp_path


@pytest.mark.slow
def test_tune_a_keras_file_writes_the_map_and_the_tuned_model(files, fake_clock, capsys, monkeypatch):
    monkeypatch.chdir(files)  # --eval user_eval:evaluate imports from the working directory
    status = cli.main(["tune", "model.keras", "--eval", "user_eval:evaluate", "--sample", "sample.npy",
                       "--candidates", "float32,int8_from_float32", "--max-drop", "0.05", "--absolute",
                       "--out", "run", "--repeats", "3", "--no-progress", "--no-report"])
    assert status == 0
    out = capsys.readouterr().out
    assert re.search(r"tuned model: run/tuned \(keras, \d+\.\d MB on disk; .*\); load it with "
                     r"autopolicy.load_tuned\('run'\)", out), out
    policy_map = policies.load_policy_map(files / "run" / "policy_map.json")
    assert "int8_from_float32" in {p.name for p in policy_map.values()}
    summary = json.loads((files / "run" / "summary.json").read_text())
    assert summary["experiment"]["name"] == "model" and summary["experiment"]["metric"] == "evaluate"
    tuned = ap.load_tuned(files / "run")
    expected = apk.apply_policy_map(keras.saving.load_model(files / "model.keras"), policy_map)
    np.testing.assert_array_equal(np.asarray(tuned(IDS)), np.asarray(expected(IDS)))


@pytest.mark.slow  # 5-10 s on a 2-core EPYC
def test_apply_writes_a_tuned_model_that_reloads_with_the_same_outputs(files, capsys):
    policy_map = policies.DTypePolicyMap("float32", {"attn/query": "int8_from_float32", "attn/value": "mixed_bfloat16",
                                                     "head": "int8_from_float32"})
    policies.save_policy_map(policy_map, files / "map.json")
    status = cli.main(["apply", str(files / "map.json"), str(files / "model.keras"), "--out", str(files / "t.keras")])
    assert status == 0
    assert capsys.readouterr().out.strip() == f"wrote {files / 't.keras'}: 3 layers set by 3 keys of {files / 'map.json'}"
    expected = apk.apply_policy_map(keras.saving.load_model(files / "model.keras"), policy_map)
    for reloaded in (apk.load(files / "t.keras"), keras.saving.load_model(files / "t.keras")):
        np.testing.assert_array_equal(np.asarray(reloaded(IDS)), np.asarray(expected(IDS)))


@pytest.mark.parametrize("argv, message", [
    (["tune", "{d}/model.keras"], "needs --eval and --sample"),
    (["tune", "{d}/model.keras", "--eval", "{d}/user_eval.py:evaluate"], "needs --sample"),
    (["tune", "{d}/model.keras", "--eval", "no_such_module_xyz:f", "--sample", "{d}/sample.npy"],
     "Cannot import 'no_such_module_xyz'"),
    (["tune", "{d}/model.keras", "--eval", "{d}/user_eval.py:missing", "--sample", "{d}/sample.npy"],
     "has no function 'missing'"),
    (["tune", "{d}/model.keras", "--eval", "evaluate", "--sample", "{d}/sample.npy"],
     "--eval must be module:function or path/to/file.py:function. Received: 'evaluate'"),
    (["tune", "{d}/model.keras", "--eval", "{d}/user_eval.py:evaluate", "--sample", "{d}/nothing.npy"],
     "No sample file at"),
    (["tune", "{d}/missing.keras", "--eval", "{d}/user_eval.py:evaluate", "--sample", "{d}/sample.npy"],
     "No Keras model file at"),
    (["tune", "digits_mlp", "--eval", "{d}/user_eval.py:evaluate"], "--eval only apply to a .keras model"),
    (["apply", "{d}/map.json", "{d}/model.keras", "--out", "{d}/t.h5"], "--out must end in .keras. Received:"),
    (["apply", "{d}/map.json", "{d}/model.keras", "--out", "{d}/t.keras", "--strict"],
     r"match no layer path of 'net': \['attn/querry'\]"),
])
def test_bad_arguments_exit_2_with_one_line(files, capsys, argv, message):
    policies.save_policy_map(policies.DTypePolicyMap("float32", {"attn/querry": "int8_from_float32"}),
                             files / "map.json")
    status = cli.main([a.format(d=files) for a in argv])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
