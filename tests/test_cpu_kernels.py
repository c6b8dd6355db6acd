"""autopolicy's own CPU kernels (XLA FFI): the integer accumulators equal the XLA kernels' bit
for bit on every instruction-set path this CPU has, the portable one forced too; the float
epilogue of int4 within float32 rounding; clean fallbacks and errors."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy.numerics import cpu_kernels, cpu_weight_only, int4, int8, kernels
from autopolicy.numerics.device import Device

needs_kernels = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
PATHS = cpu_kernels.supported_paths() if cpu_kernels.AVAILABLE else ()

# (rows, K, N): batch 1 and 7, odd K, N not a multiple of the SIMD width (16), a wide N.
SHAPES = [(1, 64, 16), (1, 577, 45), (7, 96, 33), (7, 33, 17), (3, 1024, 80), (2, 130, 300)]


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


# The GEMM (M >= gemm_min_rows on paths that have one): (rows, K, N) at the edges of its 4 x 24
# register tile, its K chunks (up to 256 rows, fewer for wide column blocks) and its tasks: M, N
# and K not multiples of the tile, odd K, one row, one column, several chunks and tasks.
GEMM_SHAPES = [(1, 64, 24), (4, 48, 24), (5, 577, 45), (7, 33, 17), (9, 513, 300), (13, 1000, 401), (33, 3, 1),
               (17, 600, 770), (66, 130, 2050)]


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
def test_the_int4_gemm_equals_the_portable_path(rows, k, n, block, gemm_everywhere, path_restored):
    """Bit for bit: the same int32 block sums, the same float32 operations in the same order
    (blocks of 600 rows are longer than one K chunk: their sums cross chunks in int32)."""
    block = k if block == "channel" or block > k else block
    rng = np.random.default_rng(k * n + block + 1)
    x = rng.integers(-128, 128, (rows, k)).astype(np.int8)
    q = rng.integers(-8, 8, (k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 2.0, (-(-k // block), n)).astype(np.float32)
    _assert_every_int4_path_equals_portable(x, q, scale, block)


@needs_kernels
@pytest.mark.parametrize("rows,k,n", [(1, 64, 32), (1, 577, 45), (2, 130, 300), (3, 33, 70), (5, 1000, 96), (7, 96, 33)])
@pytest.mark.parametrize("block", ["channel", 2, 32])
def test_the_int4_streaming_kernel_equals_the_portable_path(rows, k, n, block, path_restored):
    """Below the GEMM: nibbles + 8 as unsigned bytes into vpmaddubsw, corrected by 8 * sum(x); the
    largest pair sums (x = -128 with nibbles -8 and 7) must neither saturate nor round."""
    block = k if block == "channel" else block
    rng = np.random.default_rng(k * n + block + 2)
    x = rng.choice(np.array([-128, 127, -1, 0], np.int8), (rows, k))
    q = rng.choice(np.array([-8, 7, -1, 0], np.int8), (k, n))
    scale = rng.uniform(0.01, 2.0, (-(-k // block), n)).astype(np.float32)
    _assert_every_int4_path_equals_portable(x, q, scale, block)


@needs_kernels
def test_the_gemm_threshold_is_settable():
    defaults = cpu_kernels.gemm_min_rows("int8"), cpu_kernels.gemm_min_rows("int4")
    assert defaults == (16, None)  # measured: int4's streaming kernel wins at every M
    cpu_kernels.set_gemm_min_rows(3)
    assert (cpu_kernels.gemm_min_rows("int8"), cpu_kernels.gemm_min_rows("int4")) == (3, 3)
    cpu_kernels.set_gemm_min_rows(None)
    assert (cpu_kernels.gemm_min_rows("int8"), cpu_kernels.gemm_min_rows("int4")) == defaults
    with pytest.raises(ValueError, match=r"Invalid kind. Expected one of \('int8', 'int4'\). Received: 'int2'"):
        cpu_kernels.gemm_min_rows("int2")


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("equation,x_shape,k_shape", [("mk,kn->mn", (7, 48), (48, 40)),
                                                     ("btd,dhk->bthk", (2, 3, 32), (32, 4, 8))])
def test_the_int8_einsum_is_bit_identical_to_xla(path, equation, x_shape, k_shape, path_restored):
    cpu_kernels.set_path(path)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape).astype(np.float32))
    axes = int8.contracted_axes(equation)[1]
    kernel_q, scale = int8.quantize_symmetric(jnp.asarray(rng.standard_normal(k_shape).astype(np.float32)), axes)
    xla = int8.int8_einsum(equation, x, kernel_q, scale, jnp.float32, None, "s8s8")
    ffi = jax.jit(lambda a: int8.int8_einsum(equation, a, kernel_q, scale, jnp.float32, None, "cpu_ffi"))(x)
    np.testing.assert_array_equal(np.asarray(ffi), np.asarray(xla))


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


def test_the_device_command_names_the_cpu_and_kernels(capsys):
    from autopolicy import cli

    assert cli.main(["device"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device: cpu (")
    assert out[2].startswith("cpu features: ")
    expected = (f"cpu kernels: built ({os.path.basename(cpu_kernels.library_path())}); paths this CPU runs: "
                if cpu_kernels.AVAILABLE else "cpu kernels: not available (")
    assert out[3].startswith(expected)
    assert out[5].startswith("int4 kernels timed by the search here: xla") and "(default without a measurement: xla)" in out[5]
    ffi = ", cpu_ffi" if cpu_weight_only.AVAILABLE and jax.device_count() == 1 else ""
    assert out[7] == f"gptq kernels timed by the search here: xla{ffi} (default without a measurement: xla)"
    assert out[-1].startswith(f"jax {jax.__version__}, jaxlib ")
