"""The weight-only (GPTQ/AWQ) CPU kernel: equal to the XLA dequantize-then-dot path within float32
rounding on every instruction-set path this CPU has (the portable one forced too), on random
and adversarial weights; its fallbacks (act-order g_idx, gradients) and errors.

Tolerance: ``1e-5 * sum_k |x[k]| * scale[n, g(k)] * (q[n, k] + zero[n, g(k)])`` per output,
the magnitude of the terms the kernel sums (so also where they cancel to a small output).
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
from autopolicy.numerics import cpu_kernels, cpu_weight_only, kernels, weight_only
from autopolicy.numerics.device import Device
from helpers import on_the_cpu  # noqa: F401  (a fixture)

needs_kernel = pytest.mark.skipif(not cpu_weight_only.AVAILABLE,
                                  reason=f"no weight-only CPU kernel: {cpu_weight_only.unavailable_reason()}")
PATHS = cpu_kernels.supported_paths() if cpu_kernels.AVAILABLE else ()
RTOL = 1e-5
# (rows, K, N): batch 1 and 7; K not a multiple of 32 or 128 (300, 97), of 8 (97); odd N (45, 33);
# N of every remainder modulo 4 at batch 1 (the AVX2 kernel's rows a pass there: 45, 64, 30, 31).
SHAPES = [(1, 300, 45), (7, 256, 33), (1, 576, 64), (7, 97, 17), (1, 130, 30), (1, 64, 31)]


@pytest.fixture
def path_restored():
    yield
    if cpu_kernels.AVAILABLE:
        cpu_kernels.set_path(PATHS[0])


# The kernels run on CPUs: their operands there, also where the default device is a GPU.
pytestmark = pytest.mark.usefixtures("on_the_cpu")
_store = jax.jit(weight_only.store, static_argnums=(4, 5))  # one compilation a shape, not one an op


def _weights(n, k, bits, group_size, seed, awq=False, extremes=False):
    """Stored GPTQ/AWQ weights (Keras's layout) of random grid values, scales and zero points;
    ``extremes``: only the grid's ends, 0 and 2**bits - 1, for values and zero points."""
    rng = np.random.default_rng(seed)
    maxq = 2**bits - 1
    groups = weight_only.group_count(k, group_size)
    if extremes:
        q = rng.choice(np.array([0, maxq]), (n, k))
        zero = rng.choice(np.array([0, maxq]), (n, groups))
    else:
        q, zero = rng.integers(0, maxq + 1, (n, k)), rng.integers(0, maxq + 1, (n, groups))
    scale = rng.uniform(0.01, 0.2, (n, groups)).astype(np.float32)
    stored = _store(q, scale, zero, weight_only.group_index(k, group_size), bits, jnp.float32)
    if awq:
        stored["awq_scales"] = jnp.asarray(rng.uniform(0.25, 4.0, (k,)).astype(np.float32))
    return stored, q, zero, scale


def _inputs(m, k, seed, outliers=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if outliers:  # a few channels 1000x larger, as LLM activations have
        x[:, rng.choice(k, 3, replace=False)] *= 1000.0
    return jnp.asarray(x)


def _bound(x, weights, q, zero, scale, group_size):
    """Per output: sum_k |x'[k]| * scale * (q + zero), x' the inputs AWQ's scales divide."""
    k = x.shape[1]
    xs = np.abs(np.asarray(x, np.float64))
    if weights.get("awq_scales") is not None:
        xs = xs / np.asarray(weights["awq_scales"], np.float64)
    g = weight_only.group_index(k, group_size).astype(int)
    terms = np.asarray(scale, np.float64)[:, g] * (q + np.asarray(zero)[:, g])  # (N, K)
    return xs @ terms.T


@functools.cache
def _program(layout, kernel, dtype):
    """One jitted product per layout, kernel and dtype, shared by every path, shape and input (the
    path is chosen when the kernel runs)."""
    return jax.jit(lambda x_, w_: weight_only.einsum_kernel("mk,kn->mn", x_, w_, layout, dtype, kernel=kernel))


def _run(x, weights, layout, kernel, dtype=jnp.float32):
    return _program(layout, kernel, jnp.dtype(dtype))(x, weights)


def _assert_close_to_xla(x, weights, q, zero, scale, bits, group_size):
    layout = (bits, group_size)
    got, ref = _run(x, weights, layout, "cpu_ffi"), _run(x, weights, layout, "xla")
    assert got.dtype == jnp.float32 and got.shape == (x.shape[0], q.shape[0])
    bound = _bound(x, weights, q, zero, scale, group_size)
    error = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    assert np.all(error <= RTOL * bound + 1e-30), float(np.max(error / bound))
    assert float(np.max(np.abs(np.asarray(ref)))) > 0  # never a test on zeros


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (4, -1), (8, 32), (8, 128), (8, -1), (3, 32)])
def test_the_kernel_matches_xla_on_random_weights(path, rows, k, n, bits, group_size, path_restored):
    cpu_kernels.set_path(path)
    seed = rows * k + n + bits
    weights, q, zero, scale = _weights(n, k, bits, group_size, seed, awq=seed % 2 == 0)
    _assert_close_to_xla(_inputs(rows, k, seed), weights, q, zero, scale, bits, group_size)


@needs_kernel
@pytest.mark.parametrize("bits,k", [(4, 2048), (8, 1024)])
@pytest.mark.parametrize("rows", [1, 3])
def test_products_large_enough_to_share_out_over_threads_match_xla(bits, k, rows):
    # Over 1 MB of weights (ffi_weight_only.cc's kThreadedMinBytes): split in runs of rows (64 a
    # part from two rows of x; one row of x: about four runs a thread, multiples of 64 rows).
    weights, q, zero, scale = _weights(1030, k, bits, 128, seed=rows + bits, awq=True)
    assert weights["kernel"].size >= 1024 * 1024
    _assert_close_to_xla(_inputs(rows, k, seed=7 + rows), weights, q, zero, scale, bits, 128)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, -1), (8, 128)])
@pytest.mark.parametrize("awq", [False, True])
def test_the_kernel_matches_xla_at_the_grid_extremes_and_outlier_inputs(path, bits, group_size, awq, path_restored):
    cpu_kernels.set_path(path)
    weights, q, zero, scale = _weights(33, 300, bits, group_size, seed=5, awq=awq, extremes=True)
    assert {0, 2**bits - 1} == set(np.unique(zero)) == set(np.unique(q))
    _assert_close_to_xla(_inputs(7, 300, seed=6, outliers=True), weights, q, zero, scale, bits, group_size)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_each_path_runs_its_own_weight_only_variant(path, path_restored):
    # A path the variant table misses falls to the portable loop (10x slower), silently.
    cpu_kernels.set_path(path)
    assert cpu_weight_only.variant() == {"avx512_vnni": "avx512", "avx_vnni": "avx2", "avx2": "avx2",
                                         "portable": "portable"}[path]


@needs_kernel
def test_the_simd_path_equals_the_portable_one_within_rounding(path_restored):
    weights, q, zero, scale = _weights(45, 576, 4, 32, seed=11, awq=True)
    x = _inputs(3, 576, seed=12)
    outs = {}
    for path in PATHS:
        cpu_kernels.set_path(path)
        outs[path] = np.asarray(_run(x, weights, (4, 32), "cpu_ffi"), np.float64)
    bound = _bound(x, weights, q, zero, scale, 32)
    for path in PATHS:
        assert np.all(np.abs(outs[path] - outs["portable"]) <= RTOL * bound)


@needs_kernel
def test_bfloat16_inputs_give_bfloat16_outputs_within_its_rounding():
    weights, q, zero, scale = _weights(64, 256, 4, 128, seed=21)
    x = _inputs(2, 256, seed=22).astype(jnp.bfloat16)
    got = _run(x, weights, (4, 128), "cpu_ffi", jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 64)
    exact = np.asarray(x, np.float64) @ np.asarray(weight_only.dequantize(weights, (4, 128), jnp.float32), np.float64)
    bound = _bound(x, weights, q, zero, scale, 128)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= 2**-8 * np.abs(exact) + RTOL * bound)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_g_idx_dequantizes_each_weight_with_its_group(path, bits, path_restored):
    cpu_kernels.set_path(path)
    weights, q, zero, scale = _weights(41, 128, bits, 32, seed=31 + bits)
    permuted = np.random.default_rng(32).permutation(np.asarray(weights["g_idx"]))
    weights["g_idx"] = jnp.asarray(permuted)
    x = _inputs(2, 128, seed=33)
    got, ref = _run(x, weights, (bits, 32), "cpu_ffi"), _run(x, weights, (bits, 32), "xla")
    g = permuted.astype(int)
    bound = np.abs(np.asarray(x, np.float64)) @ (np.asarray(scale, np.float64)[:, g] * (q + zero[:, g])).T
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) <= RTOL * bound)
    # The natural-order kernel would be far off here: the check is real.
    natural = dict(weights, g_idx=jnp.asarray(weight_only.group_index(128, 32)))
    assert float(jnp.max(jnp.abs(_run(x, natural, (bits, 32), "cpu_ffi") - ref))) > 1e-2


@needs_kernel
@pytest.mark.parametrize("value, shown", [(2.0, r"2\.0+"), (-1.0, r"-1\.0+"), (0.5, r"0\.50+"), (np.nan, "nan"),
                                          (3e9, r"3000000000\.0+")])
def test_a_g_idx_outside_the_groups_is_refused_naming_the_entry(value, shown):
    weights, _, _, _ = _weights(8, 64, 4, 32, seed=34)
    bad = np.asarray(weight_only.group_index(64, 32)).copy()
    bad[37] = value  # two groups: 0 and 1; the entry is in the second
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"g_idx\[37\] = {shown} is not a group in \[0, 2\)"):
        _run(_inputs(1, 64, seed=35), dict(weights, g_idx=jnp.asarray(bad)), (4, 32), "cpu_ffi").block_until_ready()


@needs_kernel
def test_gradients_flow_to_the_inputs_through_xla():
    weights, _, _, _ = _weights(24, 64, 4, 32, seed=41, awq=True)
    x = _inputs(3, 64, seed=42)

    def loss(x_, w_, kernel):
        return jnp.sum(weight_only.einsum_kernel("mk,kn->mn", x_, w_, (4, 32), jnp.float32, kernel=kernel) ** 2)

    dx_ffi, dw_ffi = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, weights, "cpu_ffi")
    dx_xla = jax.grad(loss)(x, weights, "xla")
    assert dx_ffi.shape == (3, 64) and dx_ffi.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dx_ffi), np.asarray(dx_xla), rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(dx_ffi))) > 0
    assert dw_ffi["kernel"].dtype == jax.dtypes.float0 and float(jnp.max(jnp.abs(dw_ffi["kernel_scale"]))) == 0.0


@pytest.mark.slow
@needs_kernel
def test_a_calibrated_dense_offers_and_runs_the_kernel():
    rng = np.random.default_rng(51)
    x = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    model = nn.Sequential([nn.Dense(40, name="proj")], name="m").build(jax.random.key(0), x)
    model = nn.calibrate_weights(model.quantize("gptq/4/32"), [x])
    layer = model.layers_by_path()["m/proj"]
    assert layer.kernel_choices() == ("xla", "cpu_ffi") + (("cpu_ffi_avx2",) if "avx2" in PATHS else ())
    fast = model.with_kernels({"m/proj": "cpu_ffi"})
    assert fast.layers_by_path()["m/proj"].quantization_kernel == "cpu_ffi"
    x1 = x[:1]
    y, ref = jax.jit(lambda m, a: m(a))(fast, x1), jax.jit(lambda m, a: m(a))(model, x1)
    assert y.shape == (1, 40)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(ref))))
    assert "autopolicy_weight_only_matmul" in jax.jit(lambda m, a: m(a)).lower(fast, x1).as_text()


def test_other_einsums_and_kernel_names_are_handled():
    weights, _, _, _ = _weights(12, 16, 8, -1, seed=61)
    x = _inputs(2, 16, seed=62)
    if cpu_weight_only.AVAILABLE:  # a transposed input is not x[..., k] @ kernel[k, n]: the XLA path
        got = weight_only.einsum_kernel("km,kn->mn", x.T, weights, (8, -1), jnp.float32, kernel="cpu_ffi")
        ref = weight_only.einsum_kernel("km,kn->mn", x.T, weights, (8, -1), jnp.float32, kernel="xla")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    with pytest.raises(ValueError, match=r"Invalid GPTQ/AWQ kernel\. Expected one of \('xla', 'cpu_ffi', "
                                         r"'cpu_ffi_avx2', 'pallas'\)\. Received: kernel='s8s8'"):
        weight_only.einsum_kernel("mk,kn->mn", x, weights, (8, -1), jnp.float32, kernel="s8s8")


@needs_kernel
def test_bad_operands_are_named():
    x, q = jnp.ones((1, 64), jnp.float32), jnp.ones((4, 64), jnp.uint8)
    s, z = jnp.ones((8, 2), jnp.float32), jnp.ones((8, 2), jnp.uint8)
    with pytest.raises(ValueError, match=r"Expected one of \(4, 8\)\. Received: bits=5"):
        cpu_weight_only.weight_only_matmul(x, q, s, z, 5, 32)
    with pytest.raises(ValueError, match=r"x must be a 2-D float32 array\. Received: int8\[1, 64\]"):
        cpu_weight_only.weight_only_matmul(x.astype(jnp.int8), q, s, z, 4, 32)
    with pytest.raises(ValueError, match=r"group must be an int in \[1, 64\]\. Received: group=0"):
        cpu_weight_only.weight_only_matmul(x, q, s, z, 4, 0)
    with pytest.raises(ValueError, match=r"q must be uint8\[8, 64\].*Received: uint8\[4, 64\]"):
        cpu_weight_only.weight_only_matmul(x, q, s, z, 8, 32)
    with pytest.raises(ValueError, match=r"zero must be uint8\[8, 2\].*Received: float32\[8, 2\]"):
        cpu_weight_only.weight_only_matmul(x, q, s, z.astype(jnp.float32), 4, 32)
    with pytest.raises(ValueError, match=r"g_idx must be float32\[64\].*Received: float32\[63\]"):
        cpu_weight_only.weight_only_matmul(x, q, s, z, 4, 32, jnp.zeros((63,), jnp.float32))
    assert cpu_weight_only.weight_only_matmul(x, q, s, z, 4, 32).shape == (1, 8)


def test_the_kernel_is_a_candidate_only_on_cpus_where_built():
    gpu, cpu = Device("gpu", compute_capability="9.0"), Device("cpu", cpu_features=("avx2", "fma"))
    vnni = Device("cpu", cpu_features=("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"))
    built = cpu_weight_only.AVAILABLE and jax.device_count() == 1
    for mode in ("gptq", "awq"):
        assert kernels.candidate_kernels(mode, "einsum", gpu) == ("xla", "pallas")  # pallas: a GPU kernel
        expected = ("xla", "cpu_ffi") if built else ("xla",)
        assert kernels.candidate_kernels(mode, "einsum", cpu) == expected  # AVX2 is that CPU's best path
        # Where the best path is an AVX-512 one, its AVX2 path is a tactic of its own.
        avx2 = ("cpu_ffi_avx2",) if built and "avx2" in PATHS else ()
        assert kernels.candidate_kernels(mode, "einsum", vnni) == expected + avx2
        assert kernels.default_kernel(mode, "einsum", cpu) == "xla"  # chosen only by a measurement
    with pytest.raises(ValueError, match=r"Invalid GPTQ/AWQ kernel\. Expected one of \('xla', 'cpu_ffi', 'cpu_ffi_avx2', "
                                         r"'pallas'\)"):
        cpu_weight_only.kernel_available("avx2", cpu)


@needs_kernel
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, -1)])
def test_a_call_runs_the_path_it_names_whatever_the_path_in_use(bits, group_size, path_restored):
    weights, q, zero, scale = _weights(40, 300, bits, group_size, seed=71, awq=True)
    x = _inputs(3, 300, seed=72)
    layout = (bits, group_size)
    by_path = {}
    for path in PATHS:  # each path, process-wide
        cpu_kernels.set_path(path)
        by_path[path] = np.asarray(_run(x, weights, layout, "cpu_ffi"))
    cpu_kernels.set_path("portable")
    for path in PATHS:  # each path named by the call, the portable one in use: bit for bit
        group = 300 if group_size == -1 else group_size
        got = cpu_weight_only.weight_only_matmul(x / weights["awq_scales"], weights["kernel"], weights["kernel_scale"],
                                                 weights["kernel_zero"], bits, group, weights["g_idx"], simd_path=path)
        np.testing.assert_array_equal(np.asarray(got), by_path[path])
    if "avx2" in PATHS:  # the kernel name reaches the call: cpu_ffi_avx2 runs AVX2 whatever the path in use
        np.testing.assert_array_equal(np.asarray(_run(x, weights, layout, "cpu_ffi_avx2")), by_path["avx2"])
    with pytest.raises(ValueError, match=r"Invalid CPU kernel path\. Expected '' \(the one in use\) or one of "
                                         r"\(.*'portable'\) \(on this CPU\)\. Received: 'sse2'"):
        cpu_weight_only.weight_only_matmul(x, weights["kernel"], weights["kernel_scale"], weights["kernel_zero"], bits,
                                           300 if group_size == -1 else group_size, simd_path="sse2")


@pytest.mark.slow
def test_switched_off_the_weight_only_layers_keep_to_xla():
    code = ("from autopolicy.numerics import cpu_weight_only, kernels\n"
            "from autopolicy.numerics.device import Device\n"
            "print(cpu_weight_only.AVAILABLE, cpu_weight_only.unavailable_reason())\n"
            "print(kernels.candidate_kernels('gptq', 'einsum', Device('cpu', cpu_features=('avx2',))))\n")
    env = dict(os.environ, **{cpu_kernels.DISABLE_ENV: "1", "JAX_PLATFORMS": "cpu"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "False AUTOPOLICY_DISABLE_CPU_KERNELS is set"
    assert out.stdout.splitlines()[-1] == "('xla',)"
