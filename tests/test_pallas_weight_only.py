"""The weight-only (GPTQ/AWQ) Pallas kernel, run here in Pallas's interpreter (the same kernel
code the Triton backend compiles on GPUs): its weights equal ``weight_only.dequantize``'s bit for
bit, its products the float64 product of those weights within a stated tolerance; its act-order,
tail, fallback and gradient handling; its place among the tactics; its errors.

Tolerances, relative to the norm of the float64 reference output: float32 compute 1e-5 (IEEE
float32 products, float32 accumulation); bfloat16 compute 1e-2 (the weights rounded to bfloat16,
as the XLA path rounds them, and the output too).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy.numerics import cpu_weight_only, kernels, pallas_weight_only, weight_only
from autopolicy.numerics.device import Device, current_device
from helpers import on_the_cpu  # noqa: F401  (a fixture)

# On a GPU machine too: the interpreter, on the CPU (the GPU run is the search's timing).
pytestmark = pytest.mark.usefixtures("on_the_cpu")

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
_store = jax.jit(weight_only.store, static_argnums=(4, 5))


def _weights(n, k, bits, group_size, seed, awq=False):
    """Stored weights (Keras's layout) of random grid values, zero points and scales."""
    rng = np.random.default_rng(seed)
    maxq = 2**bits - 1
    groups = weight_only.group_count(k, group_size)
    q, zero = rng.integers(0, maxq + 1, (n, k)), rng.integers(0, maxq + 1, (n, groups))
    scale = rng.uniform(0.01, 0.2, (n, groups)).astype(np.float32)
    stored = _store(q, scale, zero, weight_only.group_index(k, group_size), bits, jnp.float32)
    if awq:
        stored["awq_scales"] = jnp.asarray(rng.uniform(0.25, 4.0, (k,)).astype(np.float32))
    return stored


def _inputs(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def _reference(x, weights, layout):
    """``x @ W`` in float64, ``W`` the float32 weights of ``weight_only.dequantize``."""
    w = np.asarray(weight_only.dequantize(weights, layout, jnp.float32), np.float64)
    return np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, w.shape[0]) @ w


@functools.cache
def _program(equation, layout, dtype, kernel):
    return jax.jit(lambda x_, w_: weight_only.einsum_kernel(equation, x_, w_, layout, dtype, kernel=kernel))


def _run(x, weights, layout, dtype=jnp.float32, equation="mk,kn->mn", kernel="pallas"):
    return _program(equation, tuple(layout), jnp.dtype(dtype), kernel)(x, weights)


def _assert_close(got, x, weights, layout, dtype):
    ref = _reference(x, weights, layout)
    assert float(np.max(np.abs(ref))) > 0  # never a test on zeros
    error = np.linalg.norm(np.asarray(got.astype(jnp.float32), np.float64).reshape(ref.shape) - ref)
    assert error <= TOLERANCE[jnp.dtype(dtype).name] * np.linalg.norm(ref), error / np.linalg.norm(ref)


# (rows, K, N, bits, group size, compute dtype, AWQ): decode (1 row) and prefill (17) rows; K a
# multiple of no group (200 with groups of 64: a tail group) and a per-channel K of 200; odd N
# (45, 33) for the 4-bit packing; 3-bit values (one a byte, as 8-bit).
CASES = [
    (1, 256, 45, 4, 32, "float32", False),
    (17, 200, 45, 4, 64, "float32", True),
    pytest.param(1, 200, 64, 8, -1, "float32", True, marks=pytest.mark.slow),
    pytest.param(17, 300, 45, 8, 128, "float32", False, marks=pytest.mark.slow),
    pytest.param(5, 97, 17, 3, 32, "float32", True, marks=pytest.mark.slow),
    pytest.param(1, 200, 45, 4, 128, "bfloat16", False, marks=pytest.mark.slow),
    pytest.param(17, 256, 33, 8, 32, "bfloat16", True, marks=pytest.mark.slow),
    pytest.param(17, 200, 45, 4, -1, "bfloat16", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("rows,k,n,bits,group_size,dtype,awq", CASES)
def test_the_product_is_within_the_tolerance_of_float64(rows, k, n, bits, group_size, dtype, awq):
    weights = _weights(n, k, bits, group_size, seed=rows + k + n + bits, awq=awq)
    x = _inputs((rows, k), seed=k + bits, dtype=dtype)
    got = _run(x, weights, (bits, group_size), dtype)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (rows, n)
    _assert_close(got, x, weights, (bits, group_size), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits,group_size", [(4, 64), pytest.param(4, -1, marks=pytest.mark.slow), (8, 32),
                                             pytest.param(8, 128, marks=pytest.mark.slow)])
def test_the_kernel_dequantizes_exactly_as_weight_only_dequantize(bits, group_size, dtype):
    # x = I: each output is one weight times 1 plus zeros, so the product shows the kernel's
    # weights (in the compute dtype) exactly. K = 200: a tail tile; N = 45: odd, a tail tile.
    weights = _weights(45, 200, bits, group_size, seed=bits + group_size)
    got = pallas_weight_only.weight_only_matmul(
        jnp.eye(200, dtype=dtype), weights["kernel"], weights["kernel_scale"], weights["kernel_zero"], bits,
        200 if group_size == -1 else group_size, weights["g_idx"], interpret=True)
    expected = weight_only.dequantize(weights, (bits, group_size), dtype).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert len(np.unique(np.asarray(expected))) > 2 ** (bits - 1)


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_g_idx_dequantizes_each_weight_with_its_group(bits):
    weights = _weights(41, 128, bits, 32, seed=31 + bits)
    weights["g_idx"] = jnp.asarray(np.random.default_rng(32).permutation(np.asarray(weights["g_idx"])))
    assert np.any(np.diff(np.asarray(weights["g_idx"])) < 0)  # not monotone
    got = pallas_weight_only.weight_only_matmul(
        jnp.eye(128), weights["kernel"], weights["kernel_scale"], weights["kernel_zero"], bits, 32, weights["g_idx"],
        interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(weight_only.dequantize(weights, (bits, 32), jnp.float32)))
    x = _inputs((2, 128), seed=33)
    _assert_close(_run(x, weights, (bits, 32)), x, weights, (bits, 32), jnp.float32)


@pytest.mark.slow
def test_small_blocks_cover_many_tiles_and_give_the_same_product():
    # 16 x 16 x 16 tiles over 17 rows, 23 stored (4-bit) rows, K = 200: tails in every dimension.
    weights = _weights(45, 200, 4, 64, seed=41, awq=False)
    x = _inputs((17, 200), seed=42)
    args = (weights["kernel"], weights["kernel_scale"], weights["kernel_zero"], 4, 64, weights["g_idx"])
    small = pallas_weight_only.weight_only_matmul(x, *args, blocks=(16, 16, 16), interpret=True)
    _assert_close(small, x, weights, (4, 64), jnp.float32)
    default = pallas_weight_only.weight_only_matmul(x, *args, interpret=True)
    np.testing.assert_allclose(np.asarray(small), np.asarray(default), rtol=1e-5, atol=1e-5)


def test_the_kernel_runs_under_jit_on_batched_inputs():
    weights = _weights(33, 96, 4, 32, seed=51, awq=True)
    x = _inputs((2, 3, 96), seed=52)
    fn = jax.jit(lambda x_, w_: pallas_weight_only.einsum_kernel("btk,kn->btn", x_, w_, (4, 32), jnp.float32))
    got = fn(x, weights)
    assert got.shape == (2, 3, 33) and got.dtype == jnp.float32
    _assert_close(got, x, weights, (4, 32), jnp.float32)
    assert "pallas_call" in str(jax.make_jaxpr(fn)(x, weights))


def test_other_einsums_and_uncalibrated_weights_take_the_xla_path():
    weights = _weights(12, 16, 8, -1, seed=61)
    x = _inputs((2, 16), seed=62)
    got = _run(x.T, weights, (8, -1), equation="km,kn->mn")  # not x[..., k] @ kernel[k, n]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_run(x.T, weights, (8, -1), equation="km,kn->mn",
                                                                    kernel="xla")))
    uncalibrated = dict(weights, kernel_scale=None)
    with pytest.raises(weight_only.UncalibratedError, match="calibrate_weights"):
        weight_only.einsum_kernel("mk,kn->mn", x, uncalibrated, (8, -1), jnp.float32, kernel="pallas")


@pytest.mark.slow
def test_gradients_flow_to_the_inputs_through_xla():
    weights = _weights(24, 64, 4, 32, seed=71, awq=True)
    x = _inputs((3, 64), seed=72)

    def loss(x_, w_, kernel):
        return jnp.sum(weight_only.einsum_kernel("mk,kn->mn", x_, w_, (4, 32), jnp.float32, kernel=kernel) ** 2)

    dx, dw = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, weights, "pallas")
    np.testing.assert_allclose(np.asarray(dx), np.asarray(jax.grad(loss)(x, weights, "xla")), rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(dx))) > 0
    assert dw["kernel"].dtype == jax.dtypes.float0 and float(jnp.max(jnp.abs(dw["kernel_scale"]))) == 0.0


def test_the_kernel_is_a_tactic_on_gpus_only():
    gpu, cpu = Device("gpu", compute_capability="9.0"), Device("cpu", cpu_features=("avx2", "fma"))
    for mode in ("gptq", "awq"):
        spec = kernels.kernel_spec(mode, "pallas")
        assert not spec.exact and "1e-5" in spec.summary and spec.needs_gpu
        assert spec.available(gpu) and not spec.available(cpu)
        assert "pallas" in kernels.candidate_kernels(mode, "einsum", gpu)
        assert "pallas" not in kernels.candidate_kernels(mode, "einsum", cpu)
        assert kernels.default_kernel(mode, "einsum", gpu) == "xla"  # chosen only by a measurement
        # A layer offers it only where the default device is a GPU (elsewhere: the interpreter).
        assert spec.runnable is (current_device().platform == "gpu")
    assert cpu_weight_only.kernel_available("pallas", gpu) and not cpu_weight_only.kernel_available("pallas", cpu)


def test_bad_kernel_names_are_refused_with_the_choices():
    weights = _weights(8, 32, 4, 32, seed=81)
    x = _inputs((1, 32), seed=82)
    choices = r"Expected one of \('xla', 'cpu_ffi', 'cpu_ffi_avx2', 'pallas'\)\. Received: kernel='triton'"
    with pytest.raises(ValueError, match=rf"Invalid GPTQ/AWQ kernel\. {choices}"):
        weight_only.einsum_kernel("mk,kn->mn", x, weights, (4, 32), jnp.float32, kernel="triton")
    with pytest.raises(ValueError, match=rf"Invalid awq kernel\. {choices}"):
        kernels.kernel_spec("awq", "triton")
    with pytest.raises(ValueError, match=r"runs the kernel 'pallas' only .* Received: kernel='xla'"):
        pallas_weight_only.einsum_kernel("mk,kn->mn", x, weights, (4, 32), jnp.float32, kernel="xla")


def test_bad_operands_are_named():
    x, q = jnp.ones((1, 64), jnp.float32), jnp.ones((4, 64), jnp.uint8)
    s, z = jnp.ones((8, 2), jnp.float32), jnp.ones((8, 2), jnp.uint8)
    matmul = functools.partial(pallas_weight_only.weight_only_matmul, interpret=True)
    with pytest.raises(ValueError, match=r"Expected one of \(4, 8\)\. Received: bits=5"):
        matmul(x, q, s, z, 5, 32)
    with pytest.raises(ValueError, match=r"x must be a 2-D array of one of \('float32', 'bfloat16', 'float16'\)\. "
                                         r"Received: int8\[1, 64\]"):
        matmul(x.astype(jnp.int8), q, s, z, 4, 32)
    with pytest.raises(ValueError, match=r"group must be an int in \[1, 64\]\. Received: group=0"):
        matmul(x, q, s, z, 4, 0)
    with pytest.raises(ValueError, match=r"q must be \[8, 64\] of uint8 .*Received: uint8\[4, 64\]"):
        matmul(x, q, s, z, 8, 32)
    with pytest.raises(ValueError, match=r"zero must be \[8, 2\] of uint8 .*Received: float32\[8, 2\]"):
        matmul(x, q, s, z.astype(jnp.float32), 4, 32)
    with pytest.raises(ValueError, match=r"blocks must be \(block_m, block_n, block_k\), powers of two of at least "
                                         r"16\. Received: blocks=\(16, 24, 16\)"):
        matmul(x, q, s, z, 4, 32, blocks=(16, 24, 16))
    assert matmul(x, q, s, z, 4, 32).shape == (1, 8)


@pytest.mark.parametrize("bits,dtype", [(4, "float32"), (8, "bfloat16")])
def test_the_kernel_lowers_to_triton_for_cuda_without_a_gpu(bits, dtype):
    # Lowering runs the Triton backend's rules (power-of-two tensors, masked and gathered loads,
    # the dot): what the interpreter does not check. Compiling the Triton IR needs a GPU.
    from jax import export  # pylint: disable=import-outside-toplevel

    weights = _weights(45, 200, bits, 64, seed=91, awq=True)
    x = _inputs((17, 200), seed=92, dtype=dtype)
    fn = jax.jit(lambda x_, w_: pallas_weight_only.einsum_kernel("mk,kn->mn", x_, w_, (bits, 64), jnp.dtype(dtype),
                                                                 interpret=False))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = export.export(fn, platforms=["cuda"], disabled_checks=[triton])(x, weights).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "autopolicy_weight_only" in text
