"""Configurations that cannot be chosen: over the memory budget, or failing to build or compile.
They are recorded with the reason and never chosen; the tune goes on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
from autopolicy import policies, search
from autopolicy.search import profiling
from autopolicy.search.adapter import Program, get_adapter
from tests.test_adapter import PARAMS, X, TwoMatmuls, TwoMatmulsAdapter, fidelity

W1, W2 = 64 * 128, 128 * 16  # weights of the two matmuls


class FailingAdapter(TwoMatmulsAdapter):
    """float16 models cannot be built; bfloat16 ones fail when traced (as a compile error would)."""

    def with_policies(self, policy_map):
        if any(policy_map[p].compute_dtype == "float16" for p in self.PATHS):
            raise NotImplementedError("no float16 kernel on this backend")
        return super().with_policies(policy_map)

    def model_program(self, model):
        if "bfloat16" in model.dtypes:
            def broken(params, x):
                raise RuntimeError("XLA could not compile a bfloat16 matmul")
            return Program(broken, (self.inputs["w1"],), model.params)
        return super().model_program(model)


def tune(**kwargs):
    options = dict(max_drop=0.5, relative=False, repeats=3, progress=False, confirm_seconds=0,
                   min_speedup=1.0, adapter=TwoMatmulsAdapter)
    options.update(kwargs)
    return search.tune(TwoMatmuls(PARAMS), fidelity, X, **options)


def test_configurations_that_fail_to_build_or_compile_are_excluded_not_fatal():
    result = tune(candidates=["float32", "mixed_float16", "mixed_bfloat16"], adapter=FailingAdapter)
    by_name = {c.name: c for c in result.configurations}
    assert by_name["uniform mixed_float16"].excluded.startswith(
        "failed to build: NotImplementedError: no float16 kernel on this backend")
    assert by_name["uniform mixed_bfloat16"].excluded.startswith(
        "failed to compile or run: RuntimeError: XLA could not compile a bfloat16 matmul")
    assert result.chosen.name == "uniform float32" and result.chosen.excluded == ""
    assert result.model.dtypes == ("float32", "float32")
    summary = result.summary["uniform"]
    assert summary["mixed_float16"]["excluded"].startswith("failed to build")
    assert summary["mixed_bfloat16"]["measured_latency_s"] is None


def test_a_memory_budget_excludes_float32_and_every_configuration_over_it():
    budget = 3 * W1 + 4 * W2  # float32 (4 * (W1 + W2) bytes) does not fit; bfloat16 weights do
    result = tune(candidates=["float32", "bfloat16"], memory_budget=budget)
    by_name = {c.name: c for c in result.configurations}
    float32 = by_name["uniform float32"]
    assert float32.nbytes == 4 * (W1 + W2)
    assert float32.excluded == f"over the memory budget: {4 * (W1 + W2):,} bytes > {budget:,}"
    assert result.chosen.name != "uniform float32"
    assert result.chosen.nbytes <= budget
    assert result.policy_map["w1"].name == "bfloat16"
    assert any("cannot be chosen (over the memory budget" in line for line in result.decisions)


def test_a_memory_budget_no_assignment_meets_is_refused_naming_the_least():
    with pytest.raises(ValueError, match=r"memory_budget=1000 cannot be met: the tuned layers' weights take at "
                                         rf"least {2 * (W1 + W2):,} bytes"):
        tune(candidates=["float32", "bfloat16"], memory_budget=1000)


@pytest.mark.parametrize("bad, message", [
    (dict(min_speedup=float("inf")), "min_speedup must be a finite number >= 1"),
    (dict(confirm_seconds=float("nan")), "confirm_seconds must be a finite number >= 0. Received: confirm_seconds=nan"),
    (dict(max_drop=1.5, relative=True), r"max_drop=1.5 \(150%\)"),
])
def test_tune_refuses_bad_decision_arguments_before_measuring(bad, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        tune(candidates=["float32"], cache_dir=str(tmp_path / "c"), **bad)
    assert not (tmp_path / "c").exists()  # refused before the cache was made


def test_tune_refuses_an_eval_fn_returning_a_string_naming_it():
    with pytest.raises(TypeError, match=r"eval_fn must return a real number \(a float\). It returned '0.9' of "
                                        "type str for the float32 model"):
        search.tune(TwoMatmuls(PARAMS), lambda m: "0.9", X, adapter=TwoMatmulsAdapter, progress=False)


def test_float8_is_left_out_for_a_layer_fed_integer_ids():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(16, 8)), jnp.int32)
    model = nn.Sequential([nn.Dense(12, name="on_ids"), nn.Dense(4, name="after")], name="m")
    with jax.numpy_dtype_promotion("standard"):  # a Dense that takes the ids as numbers
        model = model.build(jax.random.key(0), ids)
        layers = get_adapter(model, (ids,), [(ids,)]).layers()
    assert "float8" not in layers[0].modes and "int8" in layers[0].modes
    assert "float8" in layers[1].modes
    sites = profiling.sites(layers, [policies.get("float8_from_float32")])
    assert [p.name for p in sites[0].candidates] == ["float32"]
    assert [p.name for p in sites[1].candidates] == ["float32", "float8_from_float32"]
