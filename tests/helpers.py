"""Small numerics helpers shared by the tests."""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


#: For tests of what the package does on a CPU backend (its lowering, its device report): a GPU
#: machine's default backend is not one.
on_cpu_backend = pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs JAX's default backend to be a CPU")


@pytest.fixture
def on_the_cpu():
    """Runs the test with JAX's default device a CPU (the CPU kernels' tests, on a GPU machine)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def relative_error(y, reference):
    """Norm of the difference over the norm of the reference, in float32."""
    y = jnp.asarray(y, jnp.float32)
    return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))


@functools.cache
def digits():
    """``autopolicy.datasets.digits()``, loaded once per process when a test first needs it: not
    at import, which every pytest-xdist worker does for every module while collecting (importing
    scikit-learn takes over a second)."""
    from autopolicy import datasets  # pylint: disable=import-outside-toplevel

    return datasets.digits()


def gaussian(shape, seed=1):
    # NumPy, not jax.random: no compilation per shape, which keeps the suite fast.
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@jax.jit
def forward(model, x):
    return model(x)


def assert_bit_identical(a, b):
    """Same structure and, leaf by leaf, the same dtype, shape and bytes (-0.0 != 0.0, NaN == NaN)."""
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y, equal_nan=True) and x.tobytes() == y.tobytes()


def tiny_two_layer():
    """A 16 -> 32 (relu) -> 4 ``nn`` MLP on 64 seeded rows, and its fidelity metric: 1 minus the
    mean absolute difference from its float32 outputs (the executor tests' model)."""
    from autopolicy import nn  # pylint: disable=import-outside-toplevel

    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
    model = nn.Sequential([nn.Dense(32, activation="relu"), nn.Dense(4)], name="tiny").build(jax.random.key(0), x)
    reference = model(x)

    def fidelity(m):
        return 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))

    return model, fidelity, x


def ops_outside_loops(hlo_text, pattern=r"\b(dot|convolution)\("):
    """Instructions matching ``pattern`` that a compiled program (``compiled.as_text()``) runs
    outside every while loop: in its entry computation or what that calls other than a loop.
    A timing loop whose layer XLA hoisted out of the loop has its dot here."""
    import re  # pylint: disable=import-outside-toplevel

    computations, current = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = "ENTRY" if header.group(1) else header.group(2)
            computations[current] = []
        elif current is not None and line.strip() != "}":
            computations[current].append(line)
    outside, todo = {"ENTRY"}, ["ENTRY"]
    while todo:
        for line in computations.get(todo.pop(), []):
            if " while(" in line:
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                if callee not in outside:
                    outside.add(callee)
                    todo.append(callee)
    return [line.strip() for name in outside for line in computations.get(name, []) if re.search(pattern, line)]


def load_benchmark(name):
    """The module of ``benchmarks/<name>.py`` (the benchmarks are scripts, not a package)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


README_PATH = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_block(audience):
    """The code block after ``<!-- path: AUDIENCE -->`` in the README: ``(language, code)``."""
    text = README_PATH.read_text(encoding="utf-8")
    marker = f"<!-- path: {audience} -->\n```"
    if text.count(marker) != 1:
        raise AssertionError(f"README.md must have exactly one block after <!-- path: {audience} -->")
    language, _, rest = text.split(marker, 1)[1].partition("\n")
    return language, rest.split("```", 1)[0]


def run_readme_python(audience, namespace):
    """Executes the README's python block for ``audience`` in ``namespace`` (what the README
    assumes the reader has: their model, their data); returns the namespace."""
    language, code = readme_block(audience)
    assert language == "python", language
    exec(compile(code, f"README.md ({audience})", "exec"), namespace)  # noqa: S102
    return namespace
