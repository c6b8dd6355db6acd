"""autopolicy's own CPU kernels (XLA FFI): the integer accumulators equal the XLA kernels' bit
for bit on every instruction-set path this CPU has, the portable one forced too; the float
epilogue of int4 within float32 rounding; the fused dense calls (quantize, product, rescale,
bias in one call) equal to the package's XLA path bit for bit; clean fallbacks and errors."""

import argparse
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy.numerics import cpu_kernels, cpu_weight_only, int4, int8, kernels
from autopolicy.numerics.device import Device, current_device
from helpers import load_benchmark, on_cpu_backend, on_the_cpu  # noqa: F401  (a fixture)

needs_kernels = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
# The kernels run on CPUs: their operands there, also where the default device is a GPU.
pytestmark = pytest.mark.usefixtures("on_the_cpu")
PATHS = cpu_kernels.supported_paths() if cpu_kernels.AVAILABLE else ()

# (rows, K, N): batch 1 and 7, odd K, N not a multiple of the SIMD widths (16 and 32 columns on
# AVX2, 64 on AVX512-VNNI), K not a multiple of 8 (two quads of K rows a VNNI pass), a wide N.
SHAPES = [(1, 64, 16), (1, 577, 45), (7, 96, 33), (7, 33, 17), (3, 1024, 80), (2, 130, 300), (5, 515, 200),
          (1, 260, 128)]


def _int8_operands(rows, k, n, seed, extremes=False):
    rng = np.random.default_rng(seed)
    if extremes:  # only the int8 extremes: the largest products, -128 included
        return (rng.choice(np.array([-128, 127], np.int8), (rows, k)),
                rng.choice(np.array([-128, 127], np.int8), (k, n)))
    return rng.integers(-128, 128, (rows, k)).astype(np.int8), rng.integers(-128, 128, (k, n)).astype(np.int8)


@pytest.fixture
def path_restored():
    yield
    if cpu_kernels.AVAILABLE:
        cpu_kernels.set_path(PATHS[0])


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("extremes", [False, True])
def test_int8_accumulators_are_exact(path, rows, k, n, extremes, path_restored):
    cpu_kernels.set_path(path)
    x, w = _int8_operands(rows, k, n, seed=rows * k + n, extremes=extremes)
    expected = x.astype(np.int64) @ w.astype(np.int64)
    got = np.asarray(jax.jit(cpu_kernels.int8_matmul)(x, w))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,n", SHAPES + [(1, 577, 96), (4, 64, 64), (1, 70, 2113), (2, 530, 2080), (1, 520, 2100),
                                     (2, 133, 192)])
@pytest.mark.parametrize("operands", ["random", "extremes", "one_row_at_-128"])
def test_int8_accumulators_are_exact_within_the_quantizers_range(path, rows, k, n, operands, path_restored):
    """x within [-127, 127], what the quantizer makes, where the AVX2 path multiplies bytes
    (|w| x sign-adjusted x: the largest pair, 2 x 128 x 127, must not saturate); with one row
    holding a -128, that row's group of rows is summed the other way, the others still by bytes.
    (2, 133, 192): two rows over whole rows a multiple of 64 wide, K not a multiple of 8, as the
    VNNI stream's 8-row passes for narrow whole rows take them."""
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(rows * k + n + 1)
    if operands == "extremes":
        x = rng.choice(np.array([-127, 127], np.int8), (rows, k))
        w = rng.choice(np.array([-128, 127], np.int8), (k, n))
    else:
        x = rng.integers(-127, 128, (rows, k)).astype(np.int8)
        w = rng.integers(-128, 128, (k, n)).astype(np.int8)
        if operands == "one_row_at_-128":
            x[0, k // 2] = -128
    expected = x.astype(np.int64) @ w.astype(np.int64)
    got = np.asarray(jax.jit(cpu_kernels.int8_matmul)(x, w))
    np.testing.assert_array_equal(got, expected)


def _int4_reference(x, q, scale, block):
    """float64 sum over blocks of the exact int accumulators times the scales."""
    k, n = q.shape
    groups = -(-k // block)
    qp = np.pad(q.astype(np.int64), ((0, groups * block - k), (0, 0))).reshape(groups, block, n)
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, groups * block - k))).reshape(x.shape[0], groups, block)
    acc = np.einsum("mgb,gbn->mgn", xp, qp)
    return np.einsum("mgn,gn->mn", acc.astype(np.float64), scale.astype(np.float64))

def _assert_every_int4_path_equals_portable(x, q, scale, block):
    """Every instruction-set path gives the portable path's float32 outputs bit for bit, and the
    portable path equals the float64 reference within float32 rounding of the block sums."""
    packed = int4.pack_int4(jnp.asarray(q))
    call = jax.jit(cpu_kernels.int4_matmul, static_argnums=3)
    got = {}
    for path in PATHS:
        cpu_kernels.set_path(path)
        got[path] = np.asarray(call(x, packed, scale, block))
    for path in PATHS:
        np.testing.assert_array_equal(got[path], got["portable"], err_msg=path)
    expected = _int4_reference(x, q, scale, block)
    np.testing.assert_allclose(got["portable"], expected, rtol=0,
                               atol=4e-7 * scale.shape[0] * np.abs(expected).max() + 1e-6)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("block", ["channel", 32, 2, 3])
def test_int4_products_match_the_exact_sum(path, rows, k, n, block, path_restored):
    cpu_kernels.set_path(path)
    block = k if block == "channel" else block
    rng = np.random.default_rng(k * n + block)
    x = rng.integers(-127, 128, (rows, k)).astype(np.int8)
    q = rng.choice(np.array([-8, -7, 7, 3, -1], np.int8), (k, n))  # extremes of the nibble range
    groups = -(-k // block)
    scale = rng.uniform(0.01, 2.0, (groups, n)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_kernels.int4_matmul, static_argnums=3)(x, int4.pack_int4(jnp.asarray(q)), scale, block))
    expected = _int4_reference(x, q, scale, block)
    # float32 sums of at most G terms: within G ulps of the largest term.
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-7 * groups * np.abs(expected).max() + 1e-6)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
# Past the serial 128 KB: K >= 2048 at any width, and K >= 512 over at most 2048 columns: odd K
# over rows of whole 32-column steps (the next pass fetched in order), and N not a multiple of 32.
@pytest.mark.parametrize("rows,k,n", [(1, 4100, 72), (3, 2050, 70), (4, 16512, 32), (1, 577, 576), (2, 1536, 200)])
def test_long_per_channel_int4_split_over_k_is_exact(path, rows, k, n, path_restored):
    """Few rows over K >= 2048 (or K >= 512 over narrow layers), per channel: K is split into
    slabs whose float sums are exact, so the outputs are float32(int sums) * scale bit for bit,
    with the extremes of both ranges (at K = 16512 the sums reach 2**24 - 1024), and equal to the
    calls that do not split (serial)."""
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(k + rows)
    x = rng.choice(np.array([-127, 127, 5], np.int8), (rows, k))
    q = rng.choice(np.array([-8, 7, -3], np.int8), (k, n))
    if k == 16512:
        x[0], q[:, 0] = -127, -8
    scale = rng.uniform(0.01, 2.0, (1, n)).astype(np.float32)
    call = jax.jit(cpu_kernels.int4_matmul, static_argnums=3)
    packed = int4.pack_int4(jnp.asarray(q))
    got = np.asarray(call(x, packed, scale, k))
    sums = x.astype(np.int64) @ q.astype(np.int64)
    assert np.abs(sums).max() < 2**24 and (k != 16512 or sums[0, 0] == 127 * 8 * k)
    np.testing.assert_array_equal(got, sums.astype(np.float32) * scale)
    try:
        cpu_kernels.set_serial_max_bytes(1 << 40)
        np.testing.assert_array_equal(np.asarray(call(x, packed, scale, k)), got)
    finally:
        cpu_kernels.set_serial_max_bytes(None)


# The GEMMs (M >= gemm_min_rows on paths that have one): (rows, K, N) at the edges of their
# register tiles (AVX2 int8 and AVX-VNNI 4 x 24, AVX2 int4 6 x 16, AVX512-VNNI 8 x 48), their K
# chunks (AVX2 up to 512 rows, 1024 for int4, packed into about 1 MB, VNNI up to 512 rows into
# about 192 KB: fewer for wide column blocks; K = 2101 over 1030 columns crosses chunks on every
# path) and their tasks: M, N and K not multiples of the tile, odd K, one row, one column, whole
# tiles over several chunks, several tasks, and a partial last panel after many whole ones at an
# odd K.
GEMM_SHAPES = [(1, 64, 24), (4, 48, 24), (5, 577, 45), (7, 33, 17), (9, 513, 300), (13, 1000, 401), (33, 3, 1),
               (17, 600, 770), (66, 130, 2050), (16, 1030, 96), (5, 2101, 1030), (67, 1001, 40)]


@pytest.fixture
def gemm_everywhere():
    """Runs the GEMM at every M (the streaming kernels otherwise serve small M)."""
    cpu_kernels.set_gemm_min_rows(1)
    yield
    cpu_kernels.set_gemm_min_rows(None)


@needs_kernels
@pytest.mark.parametrize("rows,k,n", GEMM_SHAPES)
@pytest.mark.parametrize("extremes", [False, True])
def test_the_int8_gemm_is_exact(rows, k, n, extremes, gemm_everywhere, path_restored):
    x, w = _int8_operands(rows, k, n, seed=rows * k + n + 1, extremes=extremes)
    expected = x.astype(np.int64) @ w.astype(np.int64)
    for path in PATHS:
        cpu_kernels.set_path(path)
        np.testing.assert_array_equal(np.asarray(jax.jit(cpu_kernels.int8_matmul)(x, w)), expected, err_msg=path)


@needs_kernels
@pytest.mark.parametrize("rows,k,n", GEMM_SHAPES)
@pytest.mark.parametrize("block", ["channel", 2, 32, 600])
@pytest.mark.parametrize("extremes", [False, True])
def test_the_int4_gemm_equals_the_portable_path(rows, k, n, block, extremes, gemm_everywhere, path_restored):
    """Bit for bit: the same int32 block sums, the same float32 operations in the same order
    (blocks of 600 rows are longer than one K chunk: their sums cross chunks in int32). With
    extremes, the first row of x is all -128 and the last all 127, the first column of the weights
    all 7 and the last all -8: AVX2's vpmaddubsw GEMM adds 32 K rows in int16 lanes before it
    widens them, and these corners are the largest such sums (+-30720, where one more quad of K
    rows would wrap)."""
    block = k if block == "channel" or block > k else block
    rng = np.random.default_rng(k * n + block + 1)
    if extremes:
        x = rng.choice(np.array([-128, 127, -1, 0], np.int8), (rows, k))
        q = rng.choice(np.array([-8, 7, -1, 0], np.int8), (k, n))
        x[0], x[-1], q[:, 0], q[:, -1] = -128, 127, 7, -8
    else:
        x = rng.integers(-128, 128, (rows, k)).astype(np.int8)
        q = rng.integers(-8, 8, (k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 2.0, (-(-k // block), n)).astype(np.float32)
    _assert_every_int4_path_equals_portable(x, q, scale, block)


@needs_kernels
@pytest.mark.parametrize("rows,k,n", [(1, 64, 32), (1, 577, 45), (2, 130, 300), (3, 33, 70), (5, 1000, 96), (7, 96, 33),
                                      (4, 70, 192), (1, 1030, 64)])
@pytest.mark.parametrize("block", ["channel", 2, 4, 6, 32])
def test_the_int4_streaming_kernel_equals_the_portable_path(rows, k, n, block, path_restored):
    """Below the GEMM: nibbles + 8 as unsigned bytes into vpmaddubsw (AVX2) or vpdpbusd (VNNI: quads
    of K rows, so blocks of 4 rows are the shortest it takes; 2 and 6 go to AVX2), corrected by 8 *
    sum(x); the largest sums (x = -128 with nibbles -8 and 7) must neither saturate nor round."""
    block = k if block == "channel" else block
    rng = np.random.default_rng(k * n + block + 2)
    x = rng.choice(np.array([-128, 127, -1, 0], np.int8), (rows, k))
    q = rng.choice(np.array([-8, 7, -1, 0], np.int8), (k, n))
    scale = rng.uniform(0.01, 2.0, (-(-k // block), n)).astype(np.float32)
    _assert_every_int4_path_equals_portable(x, q, scale, block)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
def test_the_gemm_thresholds_are_the_paths_and_settable(path, path_restored):
    cpu_kernels.set_path(path)
    defaults = cpu_kernels.gemm_min_rows("int8"), cpu_kernels.gemm_min_rows("int4")
    # Measured: AVX2's GEMMs beat its streams from 16 rows (int8, vpmaddwd) and 24 (int4, vpmaddubsw);
    # the AVX512-VNNI GEMMs beat its streams from 16 rows; AVX-VNNI's int8 GEMM beats the AVX2 stream
    # from 8 rows, its int4 GEMM from 16; the portable path has no GEMM.
    assert defaults == {"portable": (None, None), "avx2": (16, 24), "avx_vnni": (8, 16),
                        "avx512_vnni": (16, 16)}[path]
    cpu_kernels.set_gemm_min_rows(3)
    assert (cpu_kernels.gemm_min_rows("int8"), cpu_kernels.gemm_min_rows("int4")) == (3, 3)
    cpu_kernels.set_gemm_min_rows(None)
    assert (cpu_kernels.gemm_min_rows("int8"), cpu_kernels.gemm_min_rows("int4")) == defaults
    with pytest.raises(ValueError, match=r"Invalid kind. Expected one of \('int8', 'int4'\). Received: 'int2'"):
        cpu_kernels.gemm_min_rows("int2")


@functools.cache
def _int8_einsum_program(equation, dtype, kernel):
    """The int8 einsum with one kernel, shared by every path (chosen when the kernel runs)."""
    return jax.jit(lambda a, q, s: int8.int8_einsum(equation, a, q, s, dtype, None, kernel))


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("equation,x_shape,k_shape", [("mk,kn->mn", (7, 48), (48, 40)),
                                                     ("btd,dhk->bthk", (2, 3, 32), (32, 4, 8)),
                                                     ("btd,hkd->bthk", (1, 1, 33), (4, 5, 33))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])  # float16: the unfused call
def test_the_int8_einsum_is_bit_identical_to_xla(path, equation, x_shape, k_shape, dtype, path_restored):
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32).astype(dtype)  # numpy casts: no compilations
    axes = int8.contracted_axes(equation)[1]
    kernel_q, scale = int8.quantize_symmetric(rng.standard_normal(k_shape).astype(np.float32), axes)
    xla = _int8_einsum_program(equation, dtype, "s8s8")(x, kernel_q, scale)
    ffi = _int8_einsum_program(equation, dtype, "cpu_ffi")(x, kernel_q, scale)
    assert ffi.dtype == jnp.dtype(dtype) and ffi.shape == xla.shape
    np.testing.assert_array_equal(np.asarray(ffi).astype(np.float32), np.asarray(xla).astype(np.float32))


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block", [int4.PER_CHANNEL, 16, 5])
def test_the_int4_einsum_matches_xla_within_rounding(path, block, path_restored):
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 70)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((70, 36)).astype(np.float32))
    weights = int4._quantize_kernel(w, (0,), block, jnp.dtype(jnp.float32))
    xla = int4.einsum_kernel("mk,kn->mn", x, weights, (block,), jnp.float32, kernel="xla")
    ffi = int4.einsum_kernel("mk,kn->mn", x, weights, (block,), jnp.float32, kernel="cpu_ffi")
    np.testing.assert_allclose(np.asarray(ffi), np.asarray(xla), rtol=2e-6, atol=2e-6 * float(jnp.max(jnp.abs(xla))))


# --- the fused dense calls ------------------------------------------------------------------

# (rows, K, N): batch 1 and 7, SmolLM2's narrowest layer, odd K, N not a multiple of 16 or 32.
# (70, 1000, 37): x quantized on the threads (70000 values), the GEMM, and a last partial eight columns.
DENSE_SHAPES = [(1, 576, 192), (1, 577, 45), (7, 96, 33), (7, 33, 17), (2, 130, 300), (70, 1000, 37)]


def _float_input(rows, k, seed, adversarial):
    """Random rows of different magnitudes; adversarial: the row's extremes (quantized to -127 and
    127), values at half steps of the scale (ties of the rounding), and a row of zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * rng.uniform(0.01, 30.0, (rows, 1))
    if adversarial:
        amax = rng.uniform(0.5, 4.0, (rows, 1))
        steps = rng.integers(-127, 127, (rows, k)) + rng.choice([0.0, 0.5], (rows, k))
        x = np.where(rng.random((rows, k)) < 0.2, np.sign(rng.standard_normal((rows, k))) * amax, steps * amax / 127)
        x[:, 0] = amax[:, 0]
        x[-1] = 0.0  # batch 1: the whole input is zero
    return x.astype(np.float32)


def _int8_kernel(k, n, seed, adversarial):
    rng = np.random.default_rng(seed)
    q = rng.choice(np.array([-128, 127], np.int8), (k, n)) if adversarial else rng.integers(-127, 128, (k, n))
    return q.astype(np.int8), rng.uniform(1e-3, 0.1, (1, n)).astype(np.float32)


# The XLA references the fused calls equal bit for bit, compiled as users' programs are: at XLA's
# default optimisation level (the test run compiles at level 0, conftest, where LLVM forms no fused
# multiply-adds and the float epilogue rounds differently, by one unit in the last place), and
# with the MLIR fusion emitters where conftest turned them off.
_AS_USERS_COMPILE = {"xla_backend_optimization_level": 3}
if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):  # the tests' fast compiles
    _AS_USERS_COMPILE["xla_cpu_use_fusion_emitters"] = True


@functools.cache
def _fused_int8_programs(with_bias):
    """(XLA, kernel) programs of the int8 layer, shared by every path, shape and input (the path
    is chosen when the kernel runs, so one compilation serves them all). One program a bias case:
    XLA rounds the rescale and the bias add once (one multiply-add) only where the output without
    the bias is not also an output of the program."""

    def xla(a, q, w_scale, b):  # the layer as XLA runs it: quantize, s8 x s8 -> s32 dot, rescale, + bias
        y = int8.int8_einsum("mk,kn->mn", a, q, w_scale, a.dtype, None, "s8s8")
        return y + b if with_bias else y

    def ffi(a, q, w_scale, b):
        return cpu_kernels.int8_dense(a, q, w_scale, b if with_bias else None)

    return jax.jit(xla, compiler_options=_AS_USERS_COMPILE), jax.jit(ffi)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,n", DENSE_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_int8_dense_equals_the_xla_path(path, rows, k, n, dtype, adversarial, with_bias, path_restored):
    cpu_kernels.set_path(path)
    x = _float_input(rows, k, rows * k + n, adversarial).astype(dtype)  # numpy casts: no compilations
    q, w_scale = _int8_kernel(k, n, k + n, adversarial)
    b = np.random.default_rng(n).standard_normal(n).astype(np.float32).astype(dtype)
    xla, ffi = _fused_int8_programs(with_bias)

    expected = xla(x, q, w_scale, b)
    got = ffi(x, q, w_scale, b)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (rows, n)
    got, expected = np.asarray(got).astype(np.float32), np.asarray(expected).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    if adversarial:  # the zero row quantizes to zeros: its output is the bias alone
        np.testing.assert_array_equal(got[-1], b.astype(np.float32) if with_bias else np.zeros(n, np.float32))


@functools.cache
def _fused_int4_programs(block):
    """(unfused, fused) programs of the int4 layer at one block size, each giving the outputs
    without and with the bias, shared by every path, shape and input."""

    def unfused(a, packed, scale, b):
        xq, xs = int8.quantize_symmetric(a, (1,))
        y = (cpu_kernels.int4_matmul(xq, packed, scale, block) * xs).astype(a.dtype)
        return y, y + b

    def fused(a, packed, scale, b):
        return cpu_kernels.int4_dense(a, packed, scale, block, None), cpu_kernels.int4_dense(a, packed, scale, block, b)

    return jax.jit(unfused, compiler_options=_AS_USERS_COMPILE), jax.jit(fused)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,n", DENSE_SHAPES)
@pytest.mark.parametrize("block", ["channel", 32, 3])  # 3: odd blocks take the portable kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_int4_dense_equals_the_unfused_call(path, rows, k, n, block, dtype, with_bias, path_restored):
    """Against the XLA quantization and rescale around :func:`cpu_kernels.int4_matmul` (the
    int4 layer's ``cpu_ffi`` path before the fused call): equal bit for bit."""
    _check_fused_int4(path, rows, k, n, block, dtype, with_bias)


@needs_kernels
@pytest.mark.parametrize("path", [p for p in PATHS if p != "portable"])  # the paths with GEMMs
@pytest.mark.parametrize("rows,k,n", [(20, 96, 37), (70, 1000, 37)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_dense_calls_rescale_each_gemm_task_as_the_unfused_ones(path, rows, k, n, dtype, with_bias,
                                                                          gemm_everywhere, path_restored):
    """The GEMMs' tasks rescale their own blocks of the output (int4 per channel and in blocks,
    int8): still equal bit for bit, bfloat16 outputs and partial tiles included."""
    for block in ("channel", 32):
        _check_fused_int4(path, rows, k, n, block, dtype, with_bias)
    test_the_fused_int8_dense_equals_the_xla_path(path, rows, k, n, dtype, True, with_bias, None)


@needs_kernels
@pytest.mark.parametrize("path", [p for p in PATHS if p != "portable"])  # the paths with GEMMs
def test_a_gemm_calls_rows_are_quantized_and_packed_in_runs_of_whole_panels(path, gemm_everywhere, path_restored):
    """From 65536 values of x, a GEMM call quantizes and packs x a run of whole panels per thread
    before any tile starts: on one thread, the machine's, and sixteen (67 rows: runs of 8 in
    4-row panels, of 6 in AVX2 int4's 6-row ones, the last a partial panel; on two threads runs
    of 36 and 31 rows), still equal bit for bit to the
    XLA path (int8), the unfused call (int4) and one call per product (grouped)."""
    rows, k, n = 67, 1001, 40
    try:
        for threads in (1, None, 16):
            cpu_kernels.set_threads(threads)
            test_the_fused_int8_dense_equals_the_xla_path(path, rows, k, n, "float32", True, True, None)
            _check_fused_int4(path, rows, k, n, "channel", "bfloat16", False)
        test_a_grouped_call_equals_one_call_per_product(path, rows, k, (n, 24), 32, "float32", None)
    finally:
        cpu_kernels.set_threads(None)


def _check_fused_int4(path, rows, k, n, block, dtype, with_bias):
    cpu_kernels.set_path(path)
    block = k if block == "channel" else block
    x = _float_input(rows, k, rows + k * n, adversarial=True).astype(dtype)
    rng = np.random.default_rng(block + n)
    packed = int4.pack_int4(jnp.asarray(rng.choice(np.array([-8, 7, -1, 3], np.int8), (k, n))))
    scale = jnp.asarray(rng.uniform(1e-3, 0.1, (-(-k // block), n)).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32).astype(dtype)
    unfused, fused = _fused_int4_programs(block)

    expected = unfused(x, packed, scale, b)[with_bias]
    got = fused(x, packed, scale, b)[with_bias]
    assert got.dtype == jnp.dtype(dtype) and got.shape == (rows, n)
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), np.asarray(expected).astype(np.float32))


# --- a SIMD path named per call: the "cpu_ffi_avx2" kernel (tactic) -----------------------------

needs_avx2 = pytest.mark.skipif(not cpu_kernels.AVAILABLE or "avx2" not in PATHS, reason="this CPU runs no AVX2 path")


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 20])  # the streams (K slabs at 1-2 rows) and the GEMMs
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576), (577, 45)])
def test_a_call_naming_the_avx2_path_runs_it_and_gives_the_same_outputs(rows, k, n, path_restored):
    """The per-call path: the same outputs as the process-wide path set to AVX2, and the int8
    ones equal to the path in use's bit for bit (int4 per channel as well; in blocks within float32
    rounding of the sum over blocks, which paths may add in another order)."""
    x = jnp.asarray(_float_input(rows, k, rows * k + n, adversarial=True))
    q, w_scale = _int8_kernel(k, n, k + n, adversarial=True)
    rng = np.random.default_rng(k * n)
    packed = int4.pack_int4(jnp.asarray(rng.integers(-8, 8, (k, n)).astype(np.int8)))
    scales = {block: jnp.asarray(rng.uniform(1e-3, 0.1, (-(-k // block), n)).astype(np.float32)) for block in (k, 32)}

    def outputs(simd_path):
        return [np.asarray(cpu_kernels.int8_dense(x, q, w_scale, simd_path=simd_path))] + [
            np.asarray(cpu_kernels.int4_dense(x, packed, scales[b], b, simd_path=simd_path)) for b in (k, 32)]

    named = outputs("avx2")
    cpu_kernels.set_path("avx2")
    np.testing.assert_array_equal(named, outputs(""))  # the path named per call is the path run
    cpu_kernels.set_path(PATHS[0])
    best = outputs("")
    np.testing.assert_array_equal(named[0], best[0])
    np.testing.assert_array_equal(named[1], best[1])
    np.testing.assert_allclose(named[2], best[2], rtol=1e-6, atol=1e-6 * np.abs(best[2]).max())


@needs_kernels
def test_a_path_this_cpu_cannot_run_is_refused_naming_the_ones_it_can():
    x, w = _int8_operands(1, 64, 16, seed=1)
    with pytest.raises(ValueError, match=r"Invalid CPU kernel path\. Expected '' \(the one in use\) or one of "
                                         r"\('.*'\) \(on this CPU\)\. Received: 'sse2'"):
        cpu_kernels.int8_matmul(x, w, "sse2")
    # Past the Python check (a program built elsewhere), the library refuses it, naming its paths.
    call = jax.ffi.ffi_call("autopolicy_int8_matmul", jax.ShapeDtypeStruct((1, 16), jnp.int32))
    with pytest.raises(Exception, match=r"path 'sse2' is not one this CPU runs; it runs 'portable'"):
        jax.block_until_ready(jax.jit(lambda a, b: call(a, b, path="sse2"))(x, w))
    with pytest.raises(ValueError, match=r"Invalid CPU kernel\. Expected one of \('cpu_ffi', 'cpu_ffi_avx2'\)\. "
                                         r"Received: 'xla'"):
        cpu_kernels.kernel_path("xla")


@needs_kernels
@pytest.mark.parametrize("features,distinct", [
    (("avx2", "fma"), False),  # AVX2 is the best path: "cpu_ffi" runs it already
    (("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"), True),
    (("avx2", "fma", "avx_vnni"), True),
    (("avx2", "fma", "avx512f", "avx512bw"), False),  # AVX-512 without VNNI: AVX2 is the best path
    ((), False),  # an Arm CPU: no AVX2 at all
])
def test_the_avx2_kernel_is_a_tactic_of_its_own_only_where_the_best_path_is_another(features, distinct):
    expected = distinct and "avx2" in PATHS  # and where this library runs AVX2
    assert cpu_kernels.kernel_distinct_on("cpu_ffi_avx2", features) is expected
    assert cpu_kernels.kernel_distinct_on("cpu_ffi", features) is True
    device = Device("cpu", "stand-in", cpu_features=features)
    assert int8.int8_kernel_available("cpu_ffi_avx2", device) is (expected and jax.device_count() == 1)
    assert int4.int4_kernel_available("cpu_ffi_avx2", device) is (expected and jax.device_count() == 1)


@needs_kernels
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576), (4096, 64)])
def test_the_serial_threshold_changes_no_result(k, n):
    """Both sides of the threshold (every call on the caller alone; every call split over the
    pool: K slabs for int8 at batch 1, column chunks for int4) give the same outputs."""
    default = cpu_kernels.serial_max_bytes()
    assert default == 128 * 1024
    x = jnp.asarray(_float_input(1, k, k, adversarial=False))
    q, w_scale = _int8_kernel(k, n, n, adversarial=False)
    packed = int4.pack_int4(jnp.asarray(np.random.default_rng(k).integers(-8, 8, (k, n)).astype(np.int8)))
    scale = jnp.asarray(np.random.default_rng(n).uniform(0.01, 1.0, (k // 32, n)).astype(np.float32))
    int8_fn = jax.jit(lambda a: cpu_kernels.int8_dense(a, q, w_scale))
    int4_fn = jax.jit(lambda a: cpu_kernels.int4_dense(a, packed, scale, 32))
    results = []
    try:
        for nbytes in (0, 2**40):
            cpu_kernels.set_serial_max_bytes(nbytes)
            assert cpu_kernels.serial_max_bytes() == nbytes
            results.append((np.asarray(int8_fn(x)), np.asarray(int4_fn(x))))
    finally:
        cpu_kernels.set_serial_max_bytes(None)
    assert cpu_kernels.serial_max_bytes() == default
    for split, serial in zip(*results):
        assert np.abs(split).max() > 0
        np.testing.assert_array_equal(split, serial)
    with pytest.raises(ValueError, match=r"nbytes must be >= 0 \(or None for the default\). Received: nbytes=-5"):
        cpu_kernels.set_serial_max_bytes(-5)


@needs_kernels
def test_slabs_split_by_columns_for_many_threads_change_no_result():
    """Split for 16 threads (more than K's slabs: 576 rows make two), each slab's columns are
    split too; int8, per-channel int4 and weight-only outputs equal the caller-alone ones, bit
    for bit; calls split for more threads than the cores start no threads of their own each
    time; set_threads is checked and restored."""
    rng = np.random.default_rng(3)
    cases = []
    for rows, k, n in ((1, 576, 2048), (3, 1536, 600), (2, 576, 600), (1, 640, 333)):
        x = jnp.asarray(_float_input(rows, k, k + n, adversarial=False))
        q, w_scale = _int8_kernel(k, n, n, adversarial=False)
        packed = int4.pack_int4(jnp.asarray(rng.integers(-8, 8, (k, n)).astype(np.int8)))
        scale = jnp.asarray(rng.uniform(0.01, 1.0, (1, n)).astype(np.float32))
        wq = jnp.asarray(rng.integers(0, 256, (n, k)).astype(np.uint8))
        ws = jnp.asarray(rng.uniform(0.01, 0.1, (n, k // 64)).astype(np.float32))
        wz = jnp.asarray(rng.integers(0, 256, (n, k // 64)).astype(np.uint8))
        g_idx = jnp.asarray((np.arange(k) // 64).astype(np.float32))
        cases.append(jax.jit(lambda x=x, q=q, w_scale=w_scale, packed=packed, scale=scale, k=k, wq=wq, ws=ws, wz=wz,
                             g_idx=g_idx: (cpu_kernels.int8_dense(x, q, w_scale), cpu_kernels.int4_dense(x, packed, scale, k),
                                           cpu_weight_only.weight_only_matmul(x, wq, ws, wz, 8, 64, g_idx))))
    assert cpu_kernels.threads() is None
    results = {}
    try:
        for n_threads in (16, 1):
            cpu_kernels.set_threads(n_threads)
            assert cpu_kernels.threads() == n_threads
            results[n_threads] = [[np.asarray(y) for y in fn()] for fn in cases]
        if os.path.isdir("/proc/self/task"):  # more threads asked for than the cores: no new ones per call
            cpu_kernels.set_threads(16)
            before = len(os.listdir("/proc/self/task"))
            for _ in range(40):
                jax.block_until_ready(cases[0]())
            assert len(os.listdir("/proc/self/task")) <= before + 2
    finally:
        cpu_kernels.set_threads(None)
    assert cpu_kernels.threads() is None
    for split, alone in zip(results[16], results[1], strict=True):
        for a, b in zip(split, alone, strict=True):
            assert np.abs(a).max() > 0
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"n must be >= 1 \(or None for XLA's pool's thread count\). Received: n=0"):
        cpu_kernels.set_threads(0)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 64])
def test_the_kernels_own_helpers_change_no_result(rows):
    """The polling helpers (the default) and XLA's pool (spin 0) split the same tasks: equal
    outputs, for int8, int4 and the weight-only product, at batch 1 (GEMV) and 64 (GEMM); also
    from two Python threads calling at once (one job may replace the other's: each caller still
    finishes its own tasks)."""
    import concurrent.futures

    default = cpu_kernels.spin_us()
    assert default == 500
    k, n = 1536, 576
    rng = np.random.default_rng(rows)
    # Committed to the CPU: the calls from the pool's threads do not see this module's default
    # device (a thread-local setting), and on a GPU machine ran there (no FFI handler on CUDA).
    x = jax.device_put(_float_input(rows, k, k, adversarial=False), jax.devices("cpu")[0])
    q, w_scale = _int8_kernel(k, n, n, adversarial=False)
    packed = int4.pack_int4(jnp.asarray(rng.integers(-8, 8, (k, n)).astype(np.int8)))
    scale = jnp.asarray(rng.uniform(0.01, 1.0, (k // 32, n)).astype(np.float32))
    wq = jnp.asarray(rng.integers(0, 256, (n, k)).astype(np.uint8))
    ws = jnp.asarray(rng.uniform(0.01, 0.1, (n, k // 128)).astype(np.float32))
    wz = jnp.asarray(rng.integers(0, 256, (n, k // 128)).astype(np.uint8))
    g_idx = jnp.asarray((np.arange(k) // 128).astype(np.float32))
    fn = jax.jit(lambda a: (cpu_kernels.int8_dense(a, q, w_scale), cpu_kernels.int4_dense(a, packed, scale, 32),
                            cpu_weight_only.weight_only_matmul(a, wq, ws, wz, 8, 128, g_idx)))
    results = {}
    try:
        for us in (0, 2000, None):
            cpu_kernels.set_spin_us(us)
            assert cpu_kernels.spin_us() == (default if us is None else us)
            results[us] = [np.asarray(y) for y in fn(x)]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                results[(us, "threads")] = [[np.asarray(y) for y in f.result()]
                                            for f in [pool.submit(fn, x) for _ in range(4)]]
    finally:
        cpu_kernels.set_spin_us(None)
    assert cpu_kernels.spin_us() == default
    assert all(np.abs(y).max() > 0 for y in results[0])
    runs = [results[us] for us in (2000, None)] + [out for us in (0, 2000, None) for out in results[(us, "threads")]]
    assert len(runs) == 14
    for got in runs:
        for ours, xla in zip(got, results[0], strict=True):
            np.testing.assert_array_equal(ours, xla)
    with pytest.raises(ValueError, match=r"us must be >= 0 \(or None for the default\). Received: us=-1"):
        cpu_kernels.set_spin_us(-1)


@needs_kernels
def test_calls_with_a_large_x_hand_their_tasks_to_xlas_pool_with_the_same_results():
    """From pool_min_values() values of x (131072 by default) a call's tasks go to XLA's pool,
    not the polling helpers: the same outputs either way (int8 and int4 GEMMs, the fused rescale
    and the quantizer split over rows), and a clear error for a negative size."""
    assert cpu_kernels.pool_min_values() == cpu_kernels.POOL_MIN_VALUES_DEFAULT == 131072
    k, n = 640, 200
    rng = np.random.default_rng(11)
    x = jax.device_put(_float_input(300, k, 5, adversarial=True), jax.devices("cpu")[0])  # 192000 values
    q, w_scale = _int8_kernel(k, n, 7, adversarial=True)
    packed = int4.pack_int4(jnp.asarray(rng.integers(-8, 8, (k, n)).astype(np.int8)))
    scale = jnp.asarray(rng.uniform(0.01, 1.0, (k // 32, n)).astype(np.float32))
    fn = jax.jit(lambda a: (cpu_kernels.int8_dense(a, q, w_scale), cpu_kernels.int4_dense(a, packed, scale, 32),
                            cpu_kernels.int4_dense(a, packed, scale[:1], k)))
    results = {}
    try:
        for values in (1 << 40, 0, None):  # never, always, the default (this x reaches it)
            cpu_kernels.set_pool_min_values(values)
            assert cpu_kernels.pool_min_values() == (cpu_kernels.POOL_MIN_VALUES_DEFAULT if values is None else values)
            results[values] = [np.asarray(y) for y in fn(x)]
    finally:
        cpu_kernels.set_pool_min_values(None)
    assert all(np.abs(y).max() > 0 for y in results[0]) and results[0][0].shape == (300, n)
    for values in (0, None):
        for helpers, pool in zip(results[1 << 40], results[values], strict=True):
            np.testing.assert_array_equal(pool, helpers)
    with pytest.raises(ValueError, match=r"values must be >= 0 \(or None for the default\). Received: values=-3"):
        cpu_kernels.set_pool_min_values(-3)


@needs_kernels
def test_the_fused_calls_name_bad_operands():
    x, q, s = jnp.ones((2, 4)), jnp.ones((4, 3), jnp.int8), jnp.ones((1, 3))
    with pytest.raises(ValueError, match=r"int8_dense: x must be a 2-D array of one of \('float32', 'bfloat16'\). "
                                         r"Received: float16\[2, 4\]"):
        cpu_kernels.int8_dense(x.astype(jnp.float16), q, s)
    with pytest.raises(ValueError, match=r"int8_dense: x must be \(M, K\) and the kernel \(K, N\) int8. Received: "
                                         r"x \[2, 4\], kernel int8\[5, 3\]"):
        cpu_kernels.int8_dense(x, jnp.ones((5, 3), jnp.int8), s)
    with pytest.raises(ValueError, match=r"the kernel scale must be float32 with 3 values. Received: float32\[1, 4\]"):
        cpu_kernels.int8_dense(x, q, jnp.ones((1, 4)))
    with pytest.raises(ValueError, match=r"the bias must be \(3,\) bfloat16 \(the output's dtype\). Received: "
                                         r"float32\[3\]"):
        cpu_kernels.int8_dense(x, q, s, jnp.ones((3,)), out_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"out_dtype must be one of \('float32', 'bfloat16'\). Received: "
                                         r"out_dtype='float64'"):
        cpu_kernels.int8_dense(x, q, s, out_dtype="float64")
    packed, scale = jnp.ones((2, 3), jnp.uint8), jnp.ones((1, 3))
    with pytest.raises(ValueError, match=r"int4_dense: block must be in \[1, 4\]. Received: block=5"):
        cpu_kernels.int4_dense(x, packed, scale, 5)
    with pytest.raises(ValueError, match=r"int4_dense: the scale must be float32 \(2, 3\). Received: float32\[1, 3\]"):
        cpu_kernels.int4_dense(x, packed, scale, 2)
    with pytest.raises(ValueError, match=r"the packed kernel needs 2 rows; it has 3"):
        cpu_kernels.int4_dense(x, jnp.ones((3, 3), jnp.uint8), scale, 4)


# --- grouped dense calls: several products of one x in one call ---------------------------------


def _group_operands(k, widths, block, seed):
    """Per width: int8 (kernel, scale) with the int8 extremes, and packed int4 (kernel, scale)."""
    rng = np.random.default_rng(seed)
    groups = 1 if block == "channel" else -(-k // block)
    int8s = [(jnp.asarray(rng.choice(np.array([-128, 127, 1, -3], np.int8), (k, n))),
              jnp.asarray(rng.uniform(1e-3, 0.1, (n,)).astype(np.float32))) for n in widths]
    int4s = [(jnp.asarray(rng.integers(0, 256, ((k + 1) // 2, n)).astype(np.uint8)),
              jnp.asarray(rng.uniform(1e-3, 0.1, (groups, n)).astype(np.float32))) for n in widths]
    return int8s, int4s


@functools.cache
def _group_programs(block, dtype):
    """(grouped, one call each) programs for int8 and int4 products of one x."""
    def grouped(x, int8s, int4s):
        b = x.shape[1] if block == "channel" else block
        return (cpu_kernels.int8_dense_group(x, int8s, out_dtype=dtype),
                cpu_kernels.int4_dense_group(x, int4s, b, out_dtype=dtype))

    def separate(x, int8s, int4s):
        b = x.shape[1] if block == "channel" else block
        return (tuple(cpu_kernels.int8_dense(x, w, s, out_dtype=dtype) for w, s in int8s),
                tuple(cpu_kernels.int4_dense(x, w, s, b, out_dtype=dtype) for w, s in int4s))

    return jax.jit(grouped), jax.jit(separate)


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,k,widths", [(1, 576, (576, 192, 192)), (2, 577, (45, 300)), (7, 96, (33, 17, 64)),
                                           (20, 130, (200, 24))])  # 20 rows: the GEMMs where the path has them
@pytest.mark.parametrize("block", ["channel", 32, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_grouped_call_equals_one_call_per_product(path, rows, k, widths, block, dtype, path_restored):
    """Bit for bit, int8 (its extremes) and int4 (every nibble), on each path, also split for 16
    threads (ranges over every product, more of them than the cores); an adversarial x (ties of
    the rounding, a zero last row) above one row."""
    cpu_kernels.set_path(path)
    x = jnp.asarray(_float_input(rows, k, rows + k, adversarial=rows > 1)).astype(dtype)
    int8s, int4s = _group_operands(k, widths, block, seed=rows * k)
    grouped, separate = _group_programs(block, dtype)
    expected = separate(x, int8s, int4s)
    try:
        for threads in (None, 16):
            cpu_kernels.set_threads(threads)
            got = grouped(x, int8s, int4s)
            for mode_got, mode_expected in zip(got, expected, strict=True):
                for y, e, n in zip(mode_got, mode_expected, widths, strict=True):
                    assert y.shape == (rows, n) and y.dtype == jnp.dtype(dtype)
                    assert np.abs(np.asarray(e, np.float32)).max() > 0
                    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(e, np.float32))
    finally:
        cpu_kernels.set_threads(None)


@needs_kernels
def test_grouped_calls_name_bad_operands():
    x = jnp.ones((2, 4))
    q, s = jnp.ones((4, 3), jnp.int8), jnp.ones((3,))
    with pytest.raises(ValueError, match=r"int8_dense_group: needs at least one \(kernel, scale\) pair. Received none"):
        cpu_kernels.int8_dense_group(x, [])
    with pytest.raises(ValueError, match=r"int8_dense_group: kernel 1 must be \(4, N\) int8. Received: int8\[5, 3\]"):
        cpu_kernels.int8_dense_group(x, [(q, s), (jnp.ones((5, 3), jnp.int8), s)])
    with pytest.raises(ValueError, match=r"the scale of kernel 0 must be float32 with 3 values. Received: float32\[4\]"):
        cpu_kernels.int8_dense_group(x, [(q, jnp.ones((4,)))])
    with pytest.raises(ValueError, match=r"int4_dense_group: x must be a 2-D array of one of \('float32', 'bfloat16'\)"):
        cpu_kernels.int4_dense_group(x.astype(jnp.float16), [(jnp.ones((2, 3), jnp.uint8), jnp.ones((1, 3)))], 4)
    with pytest.raises(ValueError, match=r"int4_dense_group: block must be in \[1, 4\]. Received: block=0"):
        cpu_kernels.int4_dense_group(x, [(jnp.ones((2, 3), jnp.uint8), jnp.ones((1, 3)))], 0)
    with pytest.raises(ValueError, match=r"int4_dense_group: the scale of kernel 1 must be float32 \(2, 3\). "
                                         r"Received: float32\[1, 3\]"):
        cpu_kernels.int4_dense_group(x, [(jnp.ones((2, 3), jnp.uint8), jnp.ones((2, 3)))] * 1
                                     + [(jnp.ones((2, 3), jnp.uint8), jnp.ones((1, 3)))], 2)
    # The target itself checks too (called directly): a kernel without its scale.
    call = jax.ffi.ffi_call("autopolicy_int8_dense_group", [jax.ShapeDtypeStruct((2, 3), jnp.float32)])
    with pytest.raises(Exception, match=r"autopolicy int8 dense group: needs a kernel and a scale per output; it has "
                                        r"1 operands after x and 1 outputs"):
        jax.block_until_ready(call(x, q, path=""))


@needs_kernels
@pytest.mark.skipif(jax.device_count() != 1, reason="grouped calls run on one device (the FFI kernels' rule)")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.slow
def test_grouped_products_have_the_layers_gradients_and_lower_to_xla_off_a_cpu(mode):
    from autopolicy.numerics import grouped  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    ws = [jnp.asarray(rng.standard_normal((40, n)).astype(np.float32)) for n in (24, 8)]
    if mode == "int8":
        layout, mats = (), [int8._quantize_kernel(w, (0,), True, jnp.dtype(jnp.float32)) for w in ws]  # pylint: disable=protected-access
    else:
        layout, mats = (8,), [int4._quantize_kernel(w, (0,), 8, jnp.dtype(jnp.float32)) for w in ws]  # pylint: disable=protected-access
    fn = int8.einsum_kernel if mode == "int8" else int4.einsum_kernel

    def loss(a, group):
        if group:
            ys = grouped.grouped_products(mode, layout, jnp.float32, "cpu_ffi", a, mats)
        else:
            ys = [fn("mk,kn->mn", a, m, layout, jnp.float32, kernel="cpu_ffi") for m in mats]
        return sum(jnp.sum(jnp.sin(y)) for y in ys)

    assert float(loss(x, True)) == float(loss(x, False))
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x, True)), np.asarray(jax.grad(loss)(x, False)))
    program = functools.partial(grouped.grouped_products, mode, layout, jnp.float32, "cpu_ffi")
    assert f"custom_call @autopolicy_{mode}_dense_group" in _exported_text(lambda a: program(a, mats), "cpu", x)
    on_gpu = _exported_text(lambda a: program(a, mats), "cuda", x)
    assert "custom_call @autopolicy_" not in on_gpu and "stablehlo.dot_general" in on_gpu
    with pytest.raises(ValueError, match=r"grouped_products: needs a mode of \('int8', 'int4'\), an FFI kernel .* "
                                         r"Received: mode='int8', kernel='s8s8', x float32\[3, 40\], 1 device\(s\)"):
        grouped.grouped_products("int8", (), jnp.float32, "s8s8", x, mats)


@needs_kernels
def test_int4_gradients_flow_through_the_xla_path():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    weights = int4._quantize_kernel(jnp.asarray(rng.standard_normal((40, 24)).astype(np.float32)), (0,), 8,
                                    jnp.dtype(jnp.float32))

    def loss(a, name):
        return jnp.sum(int4.einsum_kernel("mk,kn->mn", a, weights, (8,), jnp.float32, kernel=name) ** 2)

    ffi, xla = jax.grad(loss)(x, "cpu_ffi"), jax.grad(loss)(x, "xla")
    assert float(jnp.max(jnp.abs(xla))) > 0
    np.testing.assert_allclose(np.asarray(ffi), np.asarray(xla), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(xla))))


@needs_kernels
def test_gradients_flow_through_the_xla_path():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 24)).astype(np.float32))
    kernel_q, scale = int8.quantize_symmetric(jnp.asarray(rng.standard_normal((24, 8)).astype(np.float32)), (0,))

    def loss(a, name):
        return jnp.sum(int8.int8_einsum("mk,kn->mn", a, kernel_q, scale, jnp.float32, None, name) ** 2)

    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x, "cpu_ffi")), np.asarray(jax.grad(loss)(x, "s8s8")))


@needs_kernels
def test_bad_operands_are_named():
    with pytest.raises(ValueError, match=r"x must be a 2-D int8 array. Received: float32\[2, 3\]"):
        cpu_kernels.int8_matmul(jnp.ones((2, 3)), jnp.ones((3, 4), jnp.int8))
    with pytest.raises(ValueError, match=r"x is \(M, 3\) but the kernel has 5 rows"):
        cpu_kernels.int8_matmul(jnp.ones((2, 3), jnp.int8), jnp.ones((5, 4), jnp.int8))
    with pytest.raises(ValueError, match=r"the packed kernel needs 2 rows; it has 3"):
        cpu_kernels.int4_matmul(jnp.ones((2, 3), jnp.int8), jnp.ones((3, 4), jnp.uint8), jnp.ones((1, 4)), 3)
    with pytest.raises(ValueError, match=r"the scale must be float32 \(2, 4\)"):
        cpu_kernels.int4_matmul(jnp.ones((2, 4), jnp.int8), jnp.ones((2, 4), jnp.uint8), jnp.ones((1, 4)), 2)
    with pytest.raises(ValueError, match=r"Invalid CPU kernel path. Expected one of .*Received: 'avx9000'"):
        cpu_kernels.set_path("avx9000")
    with pytest.raises(ValueError, match=r"'cpu_ffi' runs einsums that are one matrix product .* 'bmk,bkn->bmn'"):
        int8.int8_einsum("bmk,bkn->bmn", jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5), jnp.int8), jnp.ones((2, 1, 5)),
                         jnp.float32, None, "cpu_ffi")


def test_the_kernels_are_candidates_only_on_cpus_where_built():
    gpu = Device("gpu", compute_capability="9.0")
    assert "cpu_ffi" not in kernels.candidate_kernels("int8", "einsum", gpu)
    assert kernels.candidate_kernels("int4", "einsum", gpu) == ("xla",)
    cpu = Device("cpu", cpu_features=("avx2", "fma"))
    assert ("cpu_ffi" in kernels.candidate_kernels("int4", "einsum", cpu)) == cpu_kernels.AVAILABLE
    assert kernels.default_kernel("int8", "einsum", cpu) == "s8s8"  # chosen only by a measurement


@pytest.mark.slow
def test_switched_off_the_package_keeps_to_xla_with_one_notice():
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(message)s')\n"
            "from autopolicy.numerics import cpu_kernels, kernels\n"
            "from autopolicy.numerics.device import Device\n"
            "print(cpu_kernels.AVAILABLE, cpu_kernels.unavailable_reason())\n"
            "cpu = Device('cpu', cpu_features=('avx2',))\n"
            "print(kernels.candidate_kernels('int8', 'einsum', cpu), kernels.candidate_kernels('int4', 'einsum', cpu))\n")
    env = dict(os.environ, **{cpu_kernels.DISABLE_ENV: "1", "JAX_PLATFORMS": "cpu"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False AUTOPOLICY_DISABLE_CPU_KERNELS is set"
    assert lines.count("autopolicy: the CPU kernels are not available (AUTOPOLICY_DISABLE_CPU_KERNELS is set); "
                       "the XLA kernels are used.") == 1
    assert lines[-1] == "('s8s8', 'u8s8') ('xla',)"


@on_cpu_backend
def test_the_device_command_names_the_cpu_and_kernels(capsys):
    from autopolicy import cli

    assert cli.main(["device"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device: cpu (")
    assert out[2].startswith("cpu features: ")
    expected = (f"cpu kernels: built ({os.path.basename(cpu_kernels.library_path())}); paths this CPU runs: "
                if cpu_kernels.AVAILABLE else "cpu kernels: not available (")
    assert out[3].startswith(expected)
    if cpu_kernels.AVAILABLE:
        assert out[3].endswith(f"; in use: {cpu_kernels.path()}; threads a call splits for: as many as XLA's pool has "
                               f"(our polling helpers, XLA's pool from an x of 131072 values)")
    if cpu_weight_only.AVAILABLE:  # then one more line: the weight-only kernel's variant
        assert out.pop(4) == f"weight-only (GPTQ/AWQ) kernel: {cpu_weight_only.variant()} variant"
    if cpu_kernels.AVAILABLE:  # and whether projections sharing an input run as one call
        state = ("on (one int8/int4 call where their policies and kernels agree)" if jax.device_count() == 1
                 else f"off here: {jax.device_count()} devices (the FFI kernels run on one)")
        assert out.pop(4) == f"projections sharing an input (q/k/v, gate/up): {state}"
    assert out[5].startswith("int4 kernels timed by the search here: xla") and "(default without a measurement: xla)" in out[5]
    ffi = ", cpu_ffi" if cpu_weight_only.AVAILABLE and jax.device_count() == 1 else ""
    if ffi and cpu_kernels.kernel_distinct_on("cpu_ffi_avx2", current_device().cpu_features):
        ffi += ", cpu_ffi_avx2"  # a CPU whose best path is an AVX-512 one
    assert out[7] == f"gptq kernels timed by the search here: xla{ffi} (default without a measurement: xla)"
    assert out[-1].startswith(f"jax {jax.__version__}, jaxlib ")


def _attention_ref(q, keys, values, position):
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    n = position + 1
    logits = np.einsum("bhgd,bhds->bhgs", q, keys[..., :n])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgs,bhsd->bhgd", p, values[:, :, :n])


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("d,g,length", [(8, 3, 20), (64, 3, 150), (64, 5, 300), (128, 2, 70), (128, 1, 64)])
def test_decode_attention_matches_a_float64_reference(path, d, g, length, path_restored):
    """Batch 2, 2 key/value heads of g query heads each: the first, a middle and the last position
    (entries past the position, here large, must be left out); head_dim 64 and 128 take vectors
    of sums for whole chunks of 64 positions and groups three, two or one at a time (5 = 3 + 2),
    the rest plain loops; on each SIMD path (the portable path: the baseline loops); each head's
    positions split into parts for 8 and 16 threads too (at 300 positions and 8 threads: four
    parts of two chunks, the last one empty), merged."""
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(d + g)
    b, h = 2, 2
    q = rng.standard_normal((b, h, g, d)).astype(np.float32) * (3.0 / np.sqrt(d))  # peaked softmaxes too
    keys = rng.standard_normal((b, h, d, length)).astype(np.float32)
    values = rng.standard_normal((b, h, length, d)).astype(np.float32)
    fn = jax.jit(cpu_kernels.decode_attention)
    try:
        for threads in (None, 8, 16):
            cpu_kernels.set_threads(threads)
            for position in (0, length // 2 + 3, length - 1):
                k, v = keys.copy(), values.copy()
                k[..., position + 1:], v[:, :, position + 1:] = 50.0, 50.0  # not yet written: must not count
                got = np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(position, jnp.int32)))
                assert got.shape == (b, h, g, d) and got.dtype == np.float32
                np.testing.assert_allclose(got, _attention_ref(q, k, v, position), rtol=1e-5, atol=2e-6)
    finally:
        cpu_kernels.set_threads(None)
    at_zero = np.asarray(fn(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(0, jnp.int32)))
    np.testing.assert_allclose(at_zero, np.broadcast_to(values[:, :, :1], (b, h, g, d)), rtol=1e-6)  # one entry: it


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("length", [40, 100])  # the scalar exp's tail alone; whole vectors too
def test_decode_attention_weighs_a_minus_infinite_logit_as_nothing(path, length, path_restored):
    """A key of -inf (a logit of -inf) takes no weight, as XLA's softmax gives it, on each path:
    the vectorized exp once clamped it to NaN (x * 0 - 87.3 is NaN at -inf), which made the whole
    head NaN."""
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(length)
    q = np.abs(rng.standard_normal((1, 1, 2, 64))).astype(np.float32) / 8 + 0.01  # every q > 0
    keys = rng.standard_normal((1, 1, 64, length)).astype(np.float32)
    values = rng.standard_normal((1, 1, length, 64)).astype(np.float32)
    keys[0, 0, 0, 3] = keys[0, 0, 0, length - 7] = -np.inf  # those positions' logits: -inf
    got = np.asarray(jax.jit(cpu_kernels.decode_attention)(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values),
                                                          jnp.asarray(length - 1, jnp.int32)))
    assert np.isfinite(got).all()
    kept = np.setdiff1d(np.arange(length), [3, length - 7])
    expected = _attention_ref(q, keys[..., kept], values[:, :, kept], len(kept) - 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-6)


@needs_kernels
def test_decode_attention_names_bad_operands():
    q, k, v = jnp.ones((1, 2, 3, 8)), jnp.ones((1, 2, 8, 16)), jnp.ones((1, 2, 16, 8))
    pos = jnp.asarray(3, jnp.int32)
    with pytest.raises(ValueError, match=r"for q \(1, 2, 3, 8\) the keys must be \(1, 2, 8, 'max_length'\) and the "
                                         r"values \(1, 2, 'max_length', 8\). Received: \(1, 2, 16, 8\), \(1, 2, 16, 8\)"):
        cpu_kernels.decode_attention(q, v, v, pos)
    with pytest.raises(ValueError, match=r"must be float32. Received: bfloat16, float32, float32"):
        cpu_kernels.decode_attention(q.astype(jnp.bfloat16), k, v, pos)
    with pytest.raises(ValueError, match=r"head_dim must be at most 256. Received: 300"):
        cpu_kernels.decode_attention(jnp.ones((1, 1, 1, 300)), jnp.ones((1, 1, 300, 4)), jnp.ones((1, 1, 4, 300)), pos)
    with pytest.raises(ValueError, match=r"must be 4-D"):
        cpu_kernels.decode_attention(q[0], k, v, pos)
    with pytest.raises(Exception, match=r"the position 16 is outside the cache \[0, 16\)"):
        jax.block_until_ready(jax.jit(cpu_kernels.decode_attention)(q, k, v, jnp.asarray(16, jnp.int32)))


@needs_kernels
@on_cpu_backend
def test_the_tuners_fingerprint_names_the_kernel_path_and_build(path_restored, monkeypatch):
    # Cached timings of one build's kernels, or of another path, are not this one's.
    from autopolicy.search import hardware

    info = hardware.detect()
    assert info["cpu_kernels"] == {"path": cpu_kernels.path(), "build": cpu_kernels.build_id()}
    assert len(info["cpu_kernels"]["build"]) == 16
    other_build = dict(info, cpu_kernels=dict(info["cpu_kernels"], build="0" * 16))
    assert hardware.fingerprint(other_build) != hardware.fingerprint(info)
    cpu_kernels.set_path("portable")
    assert hardware.detect()["cpu_kernels"]["path"] == "portable"
    assert hardware.fingerprint() != hardware.fingerprint(info)
    cpu_kernels.set_path(PATHS[0])
    # A thread count set for the calls times them otherwise: a fingerprint of its own; so does a
    # size of x from which the calls use XLA's pool other than the default.
    for setter, key, value in ((cpu_kernels.set_threads, "threads", 1),
                               (cpu_kernels.set_pool_min_values, "pool_min_values", 0)):
        try:
            setter(value)
            assert hardware.detect()["cpu_kernels"][key] == value
            assert hardware.fingerprint() != hardware.fingerprint(info)
        finally:
            setter(None)
        assert hardware.fingerprint() == hardware.fingerprint(info)
    # Projections called one by one time a decoder otherwise too.
    monkeypatch.setenv("AUTOPOLICY_GROUPED_PROJECTIONS", "0")
    assert hardware.detect()["cpu_kernels"]["grouped_projections"] is False
    assert hardware.fingerprint() != hardware.fingerprint(info)
    monkeypatch.delenv("AUTOPOLICY_GROUPED_PROJECTIONS")
    assert hardware.fingerprint() == hardware.fingerprint(info)


def _exported_text(fn, platform, *args):
    """The StableHLO that ``fn`` lowers to for ``platform`` (no such device needed)."""
    from jax import export  # pylint: disable=import-outside-toplevel

    checks = [export.DisabledSafetyCheck.custom_call(f"autopolicy_{op}")
              for op in ("int8_matmul", "int8_dense", "int4_matmul", "int4_dense", "weight_only_matmul",
                         "int8_dense_group", "int4_dense_group")]
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


def _ffi_ops():
    """``{name: (fn, args)}``: each op of the package asked for kernel "cpu_ffi"."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 40)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((40, 24)).astype(np.float32))
    kq, ks = int8.quantize_symmetric(w, (0,))
    w4 = int4._quantize_kernel(w, (0,), 8, jnp.dtype(jnp.float32))  # pylint: disable=protected-access
    from autopolicy.numerics import weight_only  # pylint: disable=import-outside-toplevel

    stored = weight_only.store(jnp.asarray(rng.integers(0, 16, (24, 40))),
                               jnp.asarray(rng.uniform(0.01, 0.2, (24, 5)).astype(np.float32)),
                               jnp.asarray(rng.integers(0, 16, (24, 5))), weight_only.group_index(40, 8), 4,
                               jnp.float32)
    return {
        "int8 fused": (lambda a: int8.int8_einsum("mk,kn->mn", a, kq, ks, jnp.float32, None, "cpu_ffi"), (x,)),
        "int8 float16": (lambda a: int8.int8_einsum("mk,kn->mn", a, kq, ks, jnp.float16, None, "cpu_ffi"),
                         (x.astype(jnp.float16),)),
        "int8 accumulators": (lambda a: int8.int8_accumulate("mk,kn->mn", a, kq, "cpu_ffi"), (kq.T[:2],)),
        "int4": (lambda a: int4.einsum_kernel("mk,kn->mn", a, w4, (8,), jnp.float32, kernel="cpu_ffi"), (x,)),
        "weight-only": (lambda a: weight_only.einsum_kernel("mk,kn->mn", a, stored, (4, 8), jnp.float32,
                                                            kernel="cpu_ffi"), (x,)),
    }


@needs_kernels
@pytest.mark.parametrize("op", ["int8 fused", "int8 float16", "int8 accumulators", "int4", "weight-only"])
def test_ops_asked_for_the_cpu_kernel_lower_to_xla_off_a_cpu(op):
    # The FFI targets exist on CPUs only: on a GPU these programs failed to compile ("No FFI handler
    # registered ... on a platform CUDA"); lowered for one now, they hold XLA's ops alone.
    fn, args = _ffi_ops()[op]
    assert "custom_call @autopolicy_" in _exported_text(fn, "cpu", *args)
    on_gpu = _exported_text(fn, "cuda", *args)
    # (Not the bare prefix: on a VNNI CPU the default int8 kernel is the package's u8 x s8
    # primitive, whose name stays in the GPU program's debug locations.)
    assert "custom_call @autopolicy_" not in on_gpu
    assert "stablehlo.dot_general" in on_gpu


# --- the benchmark's bare reads (benchmarks/bench_cpu_kernels.py) -----------------------------


def test_the_benchmarks_reads_cover_the_weights_bytes_and_depend_on_the_input():
    """The reads timed beside the kernels read as many bytes as the int8 and int4 weights, and
    their sums change with the call's input (XLA can neither hoist one out of a chain of calls
    nor share it between calls on the same copy: a read it could hoist ran at 4x the probe)."""
    bench = load_benchmark("bench_cpu_kernels")

    reads, nbytes = bench.reads(96, 40, seed=0)
    assert nbytes == {"read int8 bytes": 96 * 40, "read int4 bytes": 96 * 40 // 2}
    for name, read in reads.items():
        assert read.state.nbytes == nbytes[name] and read.state.dtype == jnp.float32
        x = read.inputs[0]
        assert x.shape == (1, 96)
        once, shifted = read.fn(read.state, x), read.fn(read.state, x + 1.0)
        assert once.shape == (1,)
        # x[0, 0] is added to every element read: one more adds one per element to the sum.
        np.testing.assert_allclose(float(shifted[0] - once[0]), read.state.size, rtol=1e-4)
        np.testing.assert_allclose(float(once[0]), float(np.sum(np.asarray(read.state, np.float64) + 1.0)),
                                   rtol=1e-5, atol=1e-3)


def test_the_benchmarks_ramp_files_each_program_under_its_window():
    """--ramp times every candidate after a pause in windows of time: one row per candidate and
    window, float32 the baseline of each window, and a table a row per candidate."""
    bench = load_benchmark("bench_cpu_kernels")
    windows = (0.003, 0.03)
    # Two of the candidates (each compiles a program of 16 calls): float32 and, where the
    # extension is built, the int8 kernel; "int4 ffi" is not among those asked for.
    rows = bench.ramp(1, 64, 48, repeats=2, seed=0, budget=1 << 16, pause=0.0, windows=windows,
                      names=(bench.BASELINE, "int8 ffi"))
    names = [name for name in (bench.BASELINE, "int8 ffi") if name in bench.candidates(1, 64, 48, 0, keras=False)[0]]
    assert [(r["name"], r["window_ms"]) for r in rows] == [(name, 1e3 * w) for name in names for w in windows]
    last = [r for r in rows if r["window_ms"] == 30.0]
    # Each program runs in well under 27 ms here: every candidate has programs in the last window.
    assert all(r["programs"] > 0 and r["median_us"] > 0 and r["shape"] == "64x48" and r["batch"] == 1 for r in last)
    assert [r["vs_float32"] for r in last if r["name"] == bench.BASELINE] == [1.0]
    table = bench.ramp_markdown(rows)
    assert table.splitlines()[0] == "64x48, batch 1: time per call, up to each time after the pause"
    assert "| candidate | <= 3 ms | <= 30 ms |" in table
    assert sum(line.startswith(("| float32 |", "| int8 ffi |", "| int4 ffi |", "| int4/32 ffi |"))
               for line in table.splitlines()) == len(names)


def test_the_benchmarks_chain_has_no_chain_of_adds_for_xla_to_recompute():
    """Each call of a benchmark chain waits for the one before, and the input between them costs
    one small fusion a call: none of the compiled chain's fusions takes more than two operands
    (the chain's first input and the last output; a chain of adds had fusions of up to 65), and
    every call's output still feeds the next call's input."""
    bench = load_benchmark("bench_cpu_kernels")
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((48, 40)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((1, 48)).astype(np.float32))
    program = bench._chained(lambda w_, x_: x_ @ w_, 24)  # pylint: disable=protected-access
    text = program.lower([w, w + 1.0], x).compile().as_text()
    fusions = [line.split(" fusion(", 1)[1].split(")", 1)[0] for line in text.splitlines() if " fusion(" in line]
    assert fusions and max(len(re.findall(r"%[\w.\-]+", operands)) for operands in fusions) <= 2
    # The runtime zero keeps the values: the chain's output is the last copy's product with x.
    np.testing.assert_allclose(np.asarray(program([w, w + 1.0], x)), np.asarray(x @ (w + 1.0)), rtol=1e-5)
    # Yet each input depends on the output before: the next input is x0 plus 1e-30 times it.
    y = jnp.full((1, 40), 3e29, jnp.float32)
    np.testing.assert_allclose(np.asarray(bench.next_input(x, y)), np.asarray(x) + 0.3, rtol=1e-5)


def test_the_pool_benchmark_reads_its_shapes_and_states_each_mode():
    """benchmarks/bench_cpu_pool.py: M x K x N shapes (a bad one named), and a line per shape with
    each mode's ratio to float32 and the default's speed over the helpers, from paired rounds."""
    bench = load_benchmark("bench_cpu_pool")
    assert bench._shape("256x576X192") == (256, 576, 192)  # pylint: disable=protected-access
    with pytest.raises(argparse.ArgumentTypeError, match="a shape is M x K x N, e.g. 256x576x192; got '576x192'"):
        bench._shape("576x192")  # pylint: disable=protected-access
    with pytest.raises(argparse.ArgumentTypeError, match="M, K and N must be positive; got '0x576x192'"):
        bench._shape("0x576x192")  # pylint: disable=protected-access
    base = np.array([4.0, 4.0, 4.0]) * 1e-3
    times = {(bench.BASELINE, "default"): base}
    for name in bench.KERNELS:
        times[(name, "helpers")] = base / 1.2
        times[(name, "pool")] = base / 1.5
        times[(name, "default")] = base / 1.5
    text = bench.line(256, 576, 192, times)
    assert text.startswith("256x576x192 (x 147456 values): float32 4000 us | int8 ffi: helpers 1.20x, pool 1.50x, "
                           "default 1.50x; default over helpers 1.25x [1.25-1.25] | int4 ffi: ")


def test_the_benchmark_names_a_bad_warm_up_or_shape(capsys):
    bench = load_benchmark("bench_cpu_kernels")
    assert bench.parse_args(["--warm", "0.2"]).warm == 0.2
    assert bench.parse_args([]).warm == 0.05
    with pytest.raises(SystemExit):
        bench.parse_args(["--warm", "soon"])
    assert "a number of seconds, e.g. 0.05; got 'soon'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--warm", "-1"])
    assert "seconds must be 0 or more; got '-1'" in capsys.readouterr().err
    assert bench.parse_args(["--shapes", "576x1536", "64X32"]).shapes == [(576, 1536), (64, 32)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "576by1536"])
    assert "a shape is K x N, e.g. 576x1536; got '576by1536'" in capsys.readouterr().err


@pytest.mark.parametrize("threads", [1, 2])
def test_the_read_ceiling_reads_every_word_of_a_copy(tmp_path, threads):
    """benchmarks/read_ceiling.py's reader sums all 1001 words of copy 0 (word i holds i), split
    between the caller and its helper or on the caller alone, and times a positive median."""
    ceiling = load_benchmark("read_ceiling")
    if ceiling.compiler() is None:
        pytest.skip("no C++ compiler ($CXX, g++ or c++)")
    binary = ceiling.build(str(tmp_path))
    median, checksum = ceiling.read_us(binary, 8 * 1001 + 5, copies=3, threads=threads, calls=64, repeats=3)
    assert checksum == 1001 * 1000 // 2
    assert median > 0


def test_the_read_ceiling_names_a_bad_shape(capsys):
    ceiling = load_benchmark("read_ceiling")
    with pytest.raises(SystemExit):
        ceiling.main(["--shapes", "576by1536"])
    assert "a shape is K x N, e.g. 576x1536; got '576by1536'" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match=r"K and N must be positive; got '0x5'"):
        ceiling._shape("0x5")  # pylint: disable=protected-access
