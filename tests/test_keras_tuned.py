"""Keras as Keras users write it: ``eval_fn`` through ``model.predict``, ``model.evaluate``,
``model(x)`` or ``model(x, training=False)``, on Functional, Sequential and subclassed models,
with the real timer (no fake clock: a timed program runs after every ``predict``), and the tuned
model saved in the run directory and loaded back with ``autopolicy.load_tuned``."""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    keras = pytest.importorskip("keras")

import autopolicy as ap  # noqa: E402
from autopolicy import policies, search  # noqa: E402
from autopolicy.search import timing  # noqa: E402
from tests.test_keras_adapter import HELD_OUT, IDS, SEQ, VOCAB, functional_model, snapshot, assert_same_snapshot  # noqa: E402

layers = keras.layers
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
LABELS = np.random.default_rng(2).integers(0, 5, (HELD_OUT.shape[0],)).astype(np.int32)
CANDIDATES = ["float32", "mixed_bfloat16", "int8_from_float32"]


@pytest.fixture(autouse=True)
def _keras_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def sequential_model():
    """Embedding, Conv1D, Dense: the Sequential form."""
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((SEQ,), dtype="int32"), layers.Embedding(VOCAB, 16, name="embed"),
                             layers.Conv1D(16, 3, padding="same", activation="relu", name="conv"),
                             layers.GlobalAveragePooling1D(), layers.Dense(32, activation="relu", name="hidden"),
                             layers.Dense(5, name="head")], name="seq")


@keras.saving.register_keras_serializable(package="autopolicy_tests")
class Subclassed(keras.Model):
    """A subclassed model with MultiHeadAttention and Conv2D, rebuilt from its config."""

    def __init__(self, dim=16, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.embed = layers.Embedding(VOCAB, dim, name="embed")
        self.conv = layers.Conv2D(dim, 3, padding="same", activation="relu", name="conv")
        self.attn = layers.MultiHeadAttention(2, 8, name="attn")
        self.head = layers.Dense(5, name="head")

    def call(self, ids, training=False):
        x = self.embed(ids)
        x = keras.ops.reshape(self.conv(keras.ops.reshape(x, (-1, 4, 4, self.dim))), (-1, SEQ, self.dim))
        x = x + self.attn(x, x, training=training)
        return self.head(keras.ops.mean(x, axis=1))

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


def subclassed_model():
    keras.utils.set_random_seed(5)
    model = Subclassed(name="sub")
    model(IDS[:2])
    return model


def fidelity_of(outputs, reference):
    outputs = np.asarray(outputs, np.float32)
    return 1.0 - float(np.linalg.norm(outputs - reference) / np.linalg.norm(reference))


def idiom_eval(idiom, reference):
    """``eval_fn(model)`` as a Keras user writes it with ``idiom``."""
    if idiom == "predict":
        return lambda m: fidelity_of(m.predict(HELD_OUT, verbose=0), reference)
    if idiom == "evaluate":  # compiled with a loss and metrics: returns [loss, accuracy]
        return lambda m: float(m.evaluate(HELD_OUT, LABELS, verbose=0, return_dict=True)["acc"])
    if idiom == "call":
        return lambda m: fidelity_of(m(HELD_OUT), reference)
    return lambda m: fidelity_of(m(HELD_OUT, training=False), reference)


def compiled(model):
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
    return model


def test_a_timed_program_outlives_predict_on_its_model():
    """The bug of the issue: Keras's jitted predict step donates the model's variable buffers, and
    the timer still held them (ValueError: Buffer has been deleted or donated). Fails without
    the copies in the adapter's model_program."""
    made = search.get_adapter(compiled(functional_model()), (IDS,), [])
    model = made.with_policies(made.complete_map({"net/head": policies.get("int8_from_float32")}))
    program = made.model_program(model)
    run = timing.compile_loop(timing.Candidate(program.fn, program.args, program.state))
    run(2)
    expected = np.asarray(model(IDS))
    model.predict(HELD_OUT, verbose=0)
    model.evaluate(HELD_OUT, LABELS, verbose=0)  # donates them too
    run(2)  # the program's arrays are its own
    np.testing.assert_array_equal(np.asarray(model(IDS)), expected)


@pytest.mark.slow
@pytest.mark.parametrize("build, idiom", [
    (functional_model, "predict"),
    (functional_model, "evaluate"),
    (functional_model, "call"),
    (sequential_model, "call"),
    (subclassed_model, "call_training_false"),
    (subclassed_model, "predict"),
])
def test_every_idiom_tunes_applies_saves_and_reloads(build, idiom, tmp_path):
    model = build()
    if idiom == "evaluate":
        compiled(model)
    reference = np.asarray(model(HELD_OUT), np.float32)
    before, compile_config = snapshot(model), model.get_compile_config() if model.compiled else None
    result = search.tune(model, idiom_eval(idiom, reference), IDS, candidates=CANDIDATES, max_drop=0.05,
                         relative=False, repeats=3, progress=False, confirm_seconds=0.0,
                         cache_dir=str(tmp_path / "cache"))
    assert_same_snapshot(before, snapshot(model))  # weights and policies untouched
    assert (model.get_compile_config() if model.compiled else None) == compile_config
    tuned = result.model
    expected = np.asarray(tuned(IDS))
    np.testing.assert_array_equal(np.asarray(ap.keras.apply_policy_map(model, result.policy_map)(IDS)), expected)
    assert result.save(tmp_path / "run") == str(tmp_path / "run" / "tuned")
    from autopolicy import report  # pylint: disable=import-outside-toplevel

    with open(report.write_report(str(tmp_path / "run"))["markdown"], encoding="utf-8") as f:
        assert "**Tuned model:** tuned/ in the run directory (keras, " in f.read()
    np.testing.assert_array_equal(np.asarray(ap.load_tuned(tmp_path / "run")(IDS)), expected)
    np.testing.assert_array_equal(np.asarray(ap.load_tuned(tmp_path / "run", model)(IDS)), expected)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.slow
def test_the_issues_keras_tune_holds_every_check_in_a_fresh_process(tmp_path):
    """MHA, EinsumDense, Conv2D; eval_fn through predict; the real timer: tune, the original
    untouched, the tuned model under its policies, saved to .keras and reloaded (in the run
    directory and in another process) with identical outputs."""
    model = functional_model()
    reference = model.predict(HELD_OUT, verbose=0)
    before = snapshot(model)
    result = search.tune(model, idiom_eval("predict", reference), IDS, candidates=CANDIDATES, max_drop=0.5,
                         relative=False, repeats=3, progress=False, cache_dir=str(tmp_path / "cache"))
    assert_same_snapshot(before, snapshot(model))
    result.save(tmp_path / "run")
    np.save(tmp_path / "ids.npy", IDS)
    code = textwrap.dedent(f"""
        import os; os.environ["KERAS_BACKEND"] = "jax"
        import numpy as np, autopolicy
        model = autopolicy.load_tuned({str(tmp_path / "run")!r})
        np.save({str(tmp_path / "y.npy")!r}, np.asarray(model(np.load({str(tmp_path / "ids.npy")!r}))))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), np.asarray(result.model(IDS)))
    assert os.path.isfile(tmp_path / "run" / "tuned" / "model.keras")


def test_load_tuned_refuses_a_keras_model_of_another_architecture(tmp_path):
    model = sequential_model()
    tuned = ap.keras.apply_policy_map(model, {"seq/head": "int8_from_float32"})
    from autopolicy import _tuned  # pylint: disable=import-outside-toplevel

    _tuned.save_tuned(tuned, tmp_path, ap.keras.policy_map_of(tuned))
    np.testing.assert_array_equal(np.asarray(ap.load_tuned(tmp_path, model)(IDS)), np.asarray(tuned(IDS)))
    other = keras.Sequential([keras.Input((SEQ,), dtype="int32"), layers.Embedding(VOCAB, 16, name="embed"),
                              layers.GlobalAveragePooling1D(), layers.Dense(5, name="head")], name="seq")
    with pytest.raises(ap.TunedModelError, match=r"it lacks the layers \['seq/conv', 'seq/hidden'\]"):
        ap.load_tuned(tmp_path, other)


@pytest.mark.slow
def test_the_readme_keras_path_runs(tmp_path, monkeypatch):
    from helpers import run_readme_python  # pylint: disable=import-outside-toplevel

    monkeypatch.chdir(tmp_path)
    model = functional_model()
    y_val = np.asarray(model(HELD_OUT)).argmax(-1)  # the float model's own answers: accuracy 1.0
    namespace = run_readme_python("keras", {"keras_model": model, "x_val": HELD_OUT, "y_val": y_val})
    assert (tmp_path / "runs" / "keras" / "tuned" / "model.keras").is_file()
    np.testing.assert_array_equal(namespace["predictions"], namespace["result"].model.predict(HELD_OUT, verbose=0))
