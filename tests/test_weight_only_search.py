"""GPTQ and AWQ policies as search candidates: each layer calibrated on its float inputs, the
tuned model carrying exactly the weights that were timed and scored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
from autopolicy import nn, search
from autopolicy.adapters.nn import NNAdapter
from autopolicy.nn import weight_calibration


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(96, 64)), jnp.float32)
    model = nn.Sequential([nn.Dense(64, activation="relu"), nn.Dense(8)], name="wo").build(jax.random.key(1), x)
    return model, x


def test_adapter_offers_and_calibrates_gptq_per_layer(mlp):
    model, x = mlp
    adapter = NNAdapter(model, (x,), [(x[:48],), (x[48:],)])
    assert {"gptq", "awq", "int8"} <= set(adapter.layers()[0].modes)
    policy = ap.get("gptq/4/16_from_float32")
    program = adapter.layer_program("wo/dense", policy)
    layer = program.state
    assert layer.kernel.dtype == np.uint8 and layer.kernel.shape == (32, 64)  # (N/2, K): two 4-bit rows a byte
    # Calibrated alone on the float inputs of both batches: calibrate_weights on the same rows agrees.
    alone = weight_calibration.calibrate_weights(
        model.layers_by_path()["wo/dense"].with_dtype_policy(policy), [(x[:48],), (x[48:],)], sequential=False)
    np.testing.assert_array_equal(np.asarray(layer.kernel), np.asarray(alone.kernel))
    # Bytes of the calibrated form without calibrating: 32x64 nibble bytes, (64, 4) float32 scales and
    # uint8 zeros, float32 g_idx (64) and bias (64).
    assert adapter.layer_bytes("wo/dense", policy) == layer.nbytes() == 2048 + 64 * 4 * 4 + 64 * 4 + 64 * 4 + 64 * 4


def test_with_policies_ships_the_scored_weights(mlp):
    model, x = mlp
    adapter = NNAdapter(model, (x,), [(x,)])
    policy = ap.get("awq/4/32_from_float32")
    scored = adapter.layer_program("wo/dense_1", policy).state
    tuned = adapter.with_policies(adapter.complete_map({"wo/dense_1": policy.name}))
    shipped = tuned.layers_by_path()["wo/dense_1"]
    assert shipped.dtype_policy.name == "awq/4/32_from_float32"
    for name in ("kernel", "kernel_scale", "kernel_zero", "awq_scales"):
        np.testing.assert_array_equal(np.asarray(getattr(shipped, name)), np.asarray(getattr(scored, name)))
    reference = model(x)
    err = float(jnp.linalg.norm(tuned(x) - reference) / jnp.linalg.norm(reference))
    assert 1e-3 < err < 0.1  # 4-bit weights in groups of 32 on a random layer: a real, bounded change (~6%)


@pytest.mark.slow
def test_tune_scores_gptq_candidates(mlp, tmp_path):
    model, x = mlp
    reference = model(x)

    def fidelity(m):
        return 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)) / jnp.mean(jnp.abs(reference)))

    result = search.tune(model, fidelity, x, candidates=["gptq/8/16_from_float32"], max_drop=0.05,
                         cache_dir=str(tmp_path), progress=False, repeats=3, calibration_inputs=[x],
                         profile_accuracy="always", min_speedup=1e9)  # accuracy only: never worth it on speed
    assert result.accuracy.method == "measured"
    costs = {path: result.accuracy.get(path, "gptq/8/16_from_float32").cost for path in ("wo/dense", "wo/dense_1")}
    assert all(0 <= c < 0.01 for c in costs.values()), costs  # 8-bit groups of 16: nearly lossless
    profile = result.profile
    rows = profile[profile["policy"] == "gptq/8/16_from_float32"]
    assert sorted(rows["layer"]) == ["wo/dense", "wo/dense_1"]
    assert (rows["nbytes"] < profile[profile["policy"] == "float32"]["nbytes"].values).all()
