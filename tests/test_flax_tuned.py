"""Flax NNX: an ``eval_fn`` that donates the model's state (``nnx.jit(..., donate_argnums=0)``)
deletes only its own model's arrays, never the user's, the adapter's or a timed program's; the
tuned model is saved in the run directory and loaded back with ``autopolicy.load_tuned``, alone
(in another process) or onto the user's own model."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax", reason="the flax extra is not installed: pip install -e '.[flax]'")
qwix = pytest.importorskip("qwix", reason="the flax extra is not installed: pip install -e '.[flax]'")
from flax import nnx  # noqa: E402

import autopolicy as ap  # noqa: E402
from autopolicy import policies, search  # noqa: E402
from autopolicy.search import timing  # noqa: E402
from tests.test_flax_adapter import Net  # noqa: E402

pytestmark = pytest.mark.flax
X = jax.random.normal(jax.random.key(1), (64, 16))
HELD_OUT = jax.random.normal(jax.random.key(2), (128, 16))


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # Qwix 0.1.8's int8 path (test_flax_adapter says why)
        yield


@nnx.jit(donate_argnums=0)
def donating_forward(model, x):
    return model(x)


def test_a_donating_eval_fn_leaves_every_other_copy_alive():
    net = Net(nnx.Rngs(0))
    expected = np.asarray(net(X))
    made = search.get_adapter(net, (X,), [])
    model = made.with_policies(made.complete_map({"a_second": policies.get("int8_from_float32")}))
    program = made.model_program(model)
    run = timing.compile_loop(timing.Candidate(program.fn, program.args, program.state))
    run(2)
    donating_forward(model, X)  # deletes `model`'s own arrays
    run(2)
    np.testing.assert_array_equal(np.asarray(net(X)), expected)  # the user's
    np.testing.assert_array_equal(np.asarray(made.model(X)), expected)  # the adapter's float model
    made.with_policies(made.complete_map({}))(X)


@pytest.mark.slow
def test_a_tuned_nnx_model_loads_in_a_fresh_process_and_onto_the_users_model(tmp_path):
    net = Net(nnx.Rngs(0))
    reference = np.asarray(net(HELD_OUT))

    def eval_fn(model):  # through a donating nnx.jit, as a user may write it
        out = np.asarray(donating_forward(model, HELD_OUT))
        return 1.0 - float(np.linalg.norm(out - reference) / np.linalg.norm(reference))

    result = search.tune(net, eval_fn, X, candidates=["float32", "int8_from_float32", "int4_from_float32"],
                         max_drop=0.5, relative=False, repeats=3, progress=False, cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(np.asarray(net(HELD_OUT)), reference)  # the user's model untouched
    expected = np.asarray(result.model(HELD_OUT))
    result.save(tmp_path / "run")
    np.save(tmp_path / "x.npy", np.asarray(HELD_OUT))
    code = textwrap.dedent(f"""
        import jax, numpy as np, autopolicy
        with jax.numpy_dtype_promotion("standard"):
            model = autopolicy.load_tuned({str(tmp_path / "run")!r})
            np.save({str(tmp_path / "y.npy")!r}, np.asarray(model(np.load({str(tmp_path / "x.npy")!r}))))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)
    np.testing.assert_array_equal(np.asarray(ap.load_tuned(tmp_path / "run", net)(HELD_OUT)), expected)

    class Wider(nnx.Module):
        def __init__(self, rngs):
            self.b_first = nnx.Linear(16, 48, rngs=rngs)

        def __call__(self, x):
            return self.b_first(x)

    with pytest.raises(ap.TunedModelError, match="model does not match the run's architecture"):
        ap.load_tuned(tmp_path / "run", Wider(nnx.Rngs(0)))


@pytest.mark.slow
def test_the_readme_flax_path_runs(tmp_path, monkeypatch):
    from helpers import run_readme_python  # pylint: disable=import-outside-toplevel

    monkeypatch.chdir(tmp_path)
    net = Net(nnx.Rngs(0))
    namespace = run_readme_python("flax", {"nnx_model": net, "x": X, "reference": net(X)})
    expected = np.asarray(namespace["result"].model(X))
    np.testing.assert_array_equal(np.asarray(namespace["tuned"](X)), expected)
    np.testing.assert_array_equal(np.asarray(namespace["mine"](X)), expected)
