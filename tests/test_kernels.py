"""Kernels as tactics: the device description, the default rule per device, and the numerics of
every kernel (int8: bit-identical to each other and to int64 arithmetic; float8: the real
float8 dot within stated tolerances of the emulated one).

GPUs are stood in for by :class:`Device` values: the choice of kernel is a pure function of the
description, and the kernels themselves run (and are compared) on the CPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy.numerics import _int8_accumulate, _u8s8_dot, cpu_kernels, float8, float_dot, int4, int8, kernels
from autopolicy.numerics.device import CPU_FEATURES, Device, current_device, known_cpu_features, parse_cpuinfo
from helpers import assert_bit_identical, gaussian, load_benchmark, on_cpu_backend

# --- stand-ins ------------------------------------------------------------------------------

H100 = Device("gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0")
L4 = Device("gpu", "NVIDIA L4", compute_capability=(8, 9))
A100 = Device("gpu", "NVIDIA A100-SXM4-40GB", compute_capability="8.0")
EPYC_AVX2 = Device("cpu", "cpu", ("avx2", "fma", "f16c"))  # the CPU: no AVX-512, no VNNI
SKYLAKE_X = Device("cpu", "cpu", ("avx2", "fma", "avx512f", "avx512bw"))  # AVX-512 without VNNI
CASCADE_LAKE = Device("cpu", "cpu", ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"))
ALDER_LAKE = Device("cpu", "cpu", ("avx2", "fma", "avx_vnni"))  # VNNI on 256-bit vectors only
SAPPHIRE_RAPIDS = Device("cpu", "cpu", ("avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"))
AMX_ONLY = Device("cpu", "cpu", ("amx_tile", "amx_int8"))
GRAVITON3 = Device("cpu", "cpu", ("asimd", "asimddp", "bf16", "i8mm"))
TPU = Device("tpu", "TPU v5 lite")

U8 = "u8s8" if _u8s8_dot.AVAILABLE else "s8s8"  # the VNNI default where this JAX has the primitive

# (device, int8 default, float8 default, int8 einsum candidates, float8 candidates)
SELECTION = {
    "H100": (H100, "s8s8", "fp8_dot", ("s8s8",), ("fp8_dot", "emulated")),
    "L4": (L4, "s8s8", "fp8_dot", ("s8s8",), ("fp8_dot", "emulated")),
    "A100": (A100, "s8s8", "emulated", ("s8s8",), ("emulated",)),
    "EPYC_AVX2": (EPYC_AVX2, "s8s8", "emulated", ("s8s8", "u8s8"), ("emulated", "fp8_dot")),
    "SKYLAKE_X": (SKYLAKE_X, "s8s8", "emulated", ("s8s8", "u8s8"), ("emulated", "fp8_dot")),
    "CASCADE_LAKE": (CASCADE_LAKE, U8, "emulated", (U8, {"u8s8": "s8s8", "s8s8": "u8s8"}[U8]),
                     ("emulated", "fp8_dot")),
    "ALDER_LAKE": (ALDER_LAKE, U8, "emulated", None, ("emulated", "fp8_dot")),
    "SAPPHIRE_RAPIDS": (SAPPHIRE_RAPIDS, U8, "emulated", None, ("emulated", "fp8_dot")),
    "AMX_ONLY": (AMX_ONLY, U8, "emulated", None, ("emulated", "fp8_dot")),
    "GRAVITON3": (GRAVITON3, "s8s8", "emulated", ("s8s8", "u8s8"), ("emulated", "fp8_dot")),
    "TPU": (TPU, "s8s8", "emulated", ("s8s8",), ("emulated",)),
}
if not _u8s8_dot.AVAILABLE:  # without the primitive, u8s8 is offered nowhere
    SELECTION = {k: (d, i, f, ("s8s8",) if c else c, fc) for k, (d, i, f, c, fc) in SELECTION.items()}


# --- the device description -----------------------------------------------------------------

EPYC_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse2 avx2 fma f16c bmi2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse2 avx2 fma f16c bmi2 sha_ni
"""
GRAVITON_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp sha512 i8mm bf16
CPU implementer\t: 0x41
"""


def test_parse_cpuinfo_reads_the_model_and_the_x86_flags():
    model, flags = parse_cpuinfo(EPYC_CPUINFO)
    assert model == "AMD EPYC 7B12"
    assert {"avx2", "fma", "sha_ni"} <= flags and "avx512_vnni" not in flags
    assert known_cpu_features(flags) == ("avx2", "fma", "f16c")
    assert Device("cpu", "cpu", tuple(flags)) == EPYC_AVX2


def test_parse_cpuinfo_reads_arm_features():
    model, flags = parse_cpuinfo(GRAVITON_CPUINFO)
    assert model is None
    assert known_cpu_features(flags) == ("asimd", "asimddp", "bf16", "i8mm")


def test_the_current_device_is_this_machine():
    device = current_device()
    assert device.platform == jax.devices()[0].platform
    assert set(device.cpu_features) <= set(CPU_FEATURES)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            _, flags = parse_cpuinfo(f.read())
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system")
    assert device.cpu_features == known_cpu_features(flags)
    assert current_device() is device  # read once


def test_device_keeps_known_features_in_a_canonical_order():
    a = Device("cpu", "cpu", ("amx_int8", "avx2", "sse4_2", "avx512_vnni"))
    b = Device("cpu", "cpu", ["avx512_vnni", "avx2", "amx_int8"])
    assert a.cpu_features == ("avx2", "avx512_vnni", "amx_int8")
    assert a == b and hash(a) == hash(b)


def test_device_is_a_static_jit_argument():
    @functools.partial(jax.jit, static_argnums=1)
    def scaled(x, device):
        return x * (2.0 if device.has_fp8_dot else 3.0)

    assert float(scaled(jnp.float32(1.0), H100)) == 2.0
    assert float(scaled(jnp.float32(1.0), A100)) == 3.0


@pytest.mark.parametrize("capability,expected", [("9.0", (9, 0)), ("8.9", (8, 9)), ("10", (10, 0)),
                                                 ((12, 0), (12, 0)), (None, None)])
def test_compute_capability_is_parsed(capability, expected):
    assert Device("gpu", compute_capability=capability).compute_capability == expected


@pytest.mark.parametrize("capability", ["gfx90a", "9.x", (9,), (9, -1), 9.0, (True, 0)])
def test_a_malformed_compute_capability_is_refused(capability):
    with pytest.raises(ValueError, match=r"compute_capability must be None, a \(major, minor\) tuple"):
        Device("gpu", compute_capability=capability)


def test_an_unknown_platform_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"Expected one of \('cpu', 'gpu', 'tpu', 'other'\)\. Received: platform='cuda'"):
        Device("cuda")


def test_cpu_features_must_be_names_not_one_string():
    with pytest.raises(TypeError, match="cpu_features must be an iterable of flag names. Received: 'avx2'"):
        Device("cpu", cpu_features="avx2")


@pytest.mark.parametrize("device,vnni,fp8", [
    (EPYC_AVX2, False, False), (SKYLAKE_X, False, False), (CASCADE_LAKE, True, False),
    (ALDER_LAKE, True, False), (AMX_ONLY, True, False), (GRAVITON3, False, False),
    (H100, False, True), (L4, False, True), (A100, False, False), (TPU, False, False),
    (Device("gpu", "AMD Instinct MI300X"), False, False),
])
def test_device_capabilities(device, vnni, fp8):
    assert (device.has_vnni, device.has_fp8_dot) == (vnni, fp8)


# --- the default rule and the candidates per device -------------------------------------------


@pytest.mark.parametrize("name", list(SELECTION))
def test_default_kernels_follow_the_device(name):
    device, int8_default, float8_default, _, _ = SELECTION[name]
    assert kernels.default_kernel("int8", "einsum", device) == int8_default
    assert int8.default_int8_kernel(device) == int8_default
    assert kernels.default_kernel("float8", "einsum", device) == float8_default
    assert float8.default_float8_kernel(device) == float8_default
    # A convolution has one int8 kernel on every device; gathers and int4 have no choice.
    assert kernels.default_kernel("int8", "conv2d", device) == "s8s8"
    assert kernels.default_kernel("int8", "gather", device) is None
    # int4's FFI kernel runs only where a measurement chose it.
    assert kernels.default_kernel("int4", "einsum", device) == "xla"


#: The int8 kernels this process can run (the FFI one needs its library built).
RUNNABLE_INT8 = tuple(s.name for s in kernels.INT8_KERNEL_SPECS if s.runnable)


def _ffi_on(device):
    """The FFI kernels are worth timing on CPUs where the library is built (one device); its AVX2
    path as a kernel of its own where that CPU's best path is a VNNI one and this CPU runs AVX2."""
    if not (device.platform == "cpu" and cpu_kernels.AVAILABLE and jax.device_count() == 1):
        return ()
    features = set(device.cpu_features)
    vnni_best = {"avx512f", "avx512bw", "avx512_vnni"} <= features or "avx_vnni" in features
    avx2_too = {"avx2", "fma"} <= features and "avx2" in cpu_kernels.supported_paths()
    return ("cpu_ffi", "cpu_ffi_avx2") if vnni_best and avx2_too else ("cpu_ffi",)


@pytest.mark.parametrize("name", list(SELECTION))
def test_candidates_are_the_kernels_worth_timing_default_first(name):
    device, int8_default, _, int8_candidates, float8_candidates = SELECTION[name]
    if int8_candidates is None:  # VNNI CPUs: both, the default first
        int8_candidates = (int8_default,) + tuple(k for k in ("s8s8", "u8s8") if k != int8_default)
        int8_candidates = int8_candidates if _u8s8_dot.AVAILABLE else ("s8s8",)
    assert kernels.candidate_kernels("int8", "einsum", device) == int8_candidates + _ffi_on(device)
    assert kernels.candidate_kernels("float8", "einsum", device) == float8_candidates
    assert kernels.candidate_kernels("int8", "conv2d", device) == ("s8s8",)
    assert kernels.candidate_kernels("int4", "einsum", device) == ("xla",) + _ffi_on(device)


def test_kernel_tables_name_each_kernel_once_per_mode():
    assert [m for m, _ in kernels.MODE_KERNELS] == ["int8", "int4", "float8", "gptq", "awq"]
    assert tuple(s.name for s in kernels.kernel_specs("int8")) == int8.INT8_KERNELS == (
        "s8s8", "u8s8", "cpu_ffi", "cpu_ffi_avx2")
    assert tuple(s.name for s in kernels.kernel_specs("int4")) == int4.INT4_KERNELS == ("xla", "cpu_ffi", "cpu_ffi_avx2")
    assert tuple(s.name for s in kernels.kernel_specs("float8")) == float8.FLOAT8_KERNELS
    assert [(s.name, s.exact) for s in kernels.FLOAT8_KERNEL_SPECS] == [("emulated", True), ("fp8_dot", False)]
    assert all(s.exact for s in kernels.INT8_KERNEL_SPECS)
    assert kernels.kernel_spec("int8", "s8s8").op_names == ("einsum", "conv2d")
    assert len({hash(s) for s in kernels.INT8_KERNEL_SPECS + kernels.INT4_KERNEL_SPECS + kernels.FLOAT8_KERNEL_SPECS}) == 9


def test_an_unknown_kernel_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"Invalid int8 kernel\. Expected one of \('s8s8', 'u8s8', 'cpu_ffi', 'cpu_ffi_avx2'\)\. Received: kernel='vnni'"):
        kernels.kernel_spec("int8", "vnni")
    with pytest.raises(ValueError, match=r"'bfloat16' has no choice of kernels; modes with kernels: \('int8', 'int4', 'float8', 'gptq', 'awq'\)"):
        kernels.kernel_spec("bfloat16", "s8s8")
    with pytest.raises(ValueError, match=r"Invalid gptq kernel\. Expected one of \('xla', 'cpu_ffi', 'cpu_ffi_avx2', 'pallas'\)\. Received: kernel='s8s8'"):
        kernels.kernel_spec("gptq", "s8s8")
    with pytest.raises(ValueError, match=r"Invalid int4 kernel\. Expected one of \('xla', 'cpu_ffi', 'cpu_ffi_avx2'\)\. Received: kernel='s8s8'"):
        kernels.kernel_spec("int4", "s8s8")
    with pytest.raises(ValueError, match=r"Invalid int8 einsum kernel\. Expected one of \('s8s8', 'u8s8', 'cpu_ffi', 'cpu_ffi_avx2'\) \(or None"):
        int8.int8_dense(jnp.ones((2, 4)), jnp.ones((4, 3), jnp.int8), jnp.ones((1, 3)), jnp.float32, kernel="S8S8")
    with pytest.raises(ValueError, match=r"Invalid float8 kernel\. Expected one of \('emulated', 'fp8_dot'\)"):
        _fp8(gaussian((4, 8)), gaussian((8, 4)), jnp.float32, "fp8")


def test_u8s8_refuses_an_einsum_with_a_batch_axis_and_the_default_falls_back():
    x = jnp.asarray(gaussian((2, 3, 8)))
    kernel_q, scale = int8.quantize_symmetric(jnp.asarray(gaussian((2, 8, 5), seed=2)), (1,))
    if _u8s8_dot.AVAILABLE:
        with pytest.raises(ValueError, match=r"'u8s8' runs einsums that are one matrix product .* 'bmk,bkn->bmn' is not"):
            int8.int8_einsum("bmk,bkn->bmn", x, kernel_q, scale, jnp.float32, kernel="u8s8")
    reference = int8.int8_einsum("bmk,bkn->bmn", x, kernel_q, scale, jnp.float32, kernel="s8s8")
    default = int8.int8_einsum("bmk,bkn->bmn", x, kernel_q, scale, jnp.float32)
    assert_bit_identical(default, reference)


def test_int8_conv_runs_only_s8s8():
    x = jnp.asarray(gaussian((1, 6, 6, 3)))
    kernel_q, scale = int8.quantize_symmetric(jnp.asarray(gaussian((3, 3, 3, 4), seed=2)), (0, 1, 2))
    conv = functools.partial(int8.int8_conv, x, kernel_q, scale, (1, 1), "SAME", jnp.float32)
    assert_bit_identical(conv(kernel="s8s8"), conv())
    with pytest.raises(ValueError, match=r"Invalid int8 conv2d kernel\. Expected one of \('s8s8',\) .*Received: kernel='u8s8'"):
        conv(kernel="u8s8")
    with pytest.raises(ValueError, match=r"The int8 kernel 'u8s8' has no 'conv2d' op: it runs \('einsum',\)\."):
        kernels.kernel_spec("int8", "u8s8").fn("conv2d")


def test_int8_conv_off_a_cpu_accumulates_in_float32_exactly():
    # cuDNN lowers few integer convolutions (an H200 refused (1, 6, 6, 3) x (3, 3, 3, 4)): off a CPU
    # the accumulators come from a float32 convolution, exact for windows of up to 1040 inputs.
    rng = np.random.default_rng(4)
    x_q = jnp.asarray(rng.choice(np.array([-127, 127, -3, 0, 5], np.int8), (2, 7, 7, 20)))
    kernel_q = jnp.asarray(rng.choice(np.array([-128, 127, 1, -1], np.int8), (3, 3, 20, 6)))
    with jax.default_device(jax.devices("cpu")[0]):  # XLA:CPU has the integer convolution
        exact = int8._conv(x_q, kernel_q, (2, 2), "SAME", preferred_element_type=jnp.int32)
    floated = int8._float_conv_accumulate(x_q, kernel_q, (2, 2), "SAME")
    assert floated.dtype == jnp.int32 and int(jnp.max(jnp.abs(exact))) > 2**16
    np.testing.assert_array_equal(np.asarray(floated), np.asarray(exact))
    from jax import export  # pylint: disable=import-outside-toplevel

    x = jnp.asarray(gaussian((1, 6, 6, 3)))
    kq, scale = int8.quantize_symmetric(jnp.asarray(gaussian((3, 3, 3, 4), seed=2)), (0, 1, 2))
    conv = jax.jit(lambda a: int8.int8_conv(a, kq, scale, (1, 1), "SAME", jnp.float32))
    convs = {platform: [line for line in export.export(conv, platforms=[platform])(x).mlir_module().splitlines()
                        if "stablehlo.convolution" in line] for platform in ("cpu", "cuda")}
    assert len(convs["cpu"]) == len(convs["cuda"]) == 1
    assert "tensor<1x6x6x3xi8>" in convs["cpu"][0] and "tensor<1x6x6x3xf32>" in convs["cuda"][0]


@pytest.mark.parametrize("k,dtype_off_cpu", [(3, "f32"), (15, "f32"), (16, "i8"), (130, "f32"), (132, "i8")])
def test_int8_contractions_not_a_multiple_of_4_off_a_cpu_sum_in_float32(k, dtype_off_cpu):
    # On an H200 XLA:GPU's int8 dot doubled the sums of K = 2, 3, 5, 6, 7, 9, ... 19.
    from jax import export  # pylint: disable=import-outside-toplevel

    x = jnp.asarray(gaussian((5, k)))
    kq, scale = int8.quantize_symmetric(jnp.asarray(gaussian((k, 7), seed=2)), (0,))
    for kernel in ("s8s8", "u8s8") if _u8s8_dot.AVAILABLE else ("s8s8",):
        fn = jax.jit(lambda a, kernel=kernel: int8.int8_einsum("mk,kn->mn", a, kq, scale, jnp.float32, kernel=kernel))
        dots = {platform: [line for line in export.export(fn, platforms=[platform])(x).mlir_module().splitlines()
                           if "stablehlo.dot_general" in line] for platform in ("cpu", "cuda")}
        assert len(dots["cpu"]) == len(dots["cuda"]) == 1
        assert f"tensor<5x{k}x{'ui8' if kernel == 'u8s8' else 'i8'}>" in dots["cpu"][0]
        assert f"tensor<5x{k}x{dtype_off_cpu}>" in dots["cuda"][0]
    x_q = jnp.full((5, k), 127, jnp.int8).at[1:3].set(-127)
    exact = np.asarray(x_q, np.int64) @ np.asarray(kq, np.int64)  # not XLA's int8 dot: on a GPU that is the bug
    floated = _int8_accumulate.float_accumulate("mk,kn->mn", x_q, kq)
    assert floated.dtype == jnp.int32 and np.abs(exact).max() > 127 * 127
    np.testing.assert_array_equal(np.asarray(floated), exact)


# --- int8: every kernel gives the same accumulators and outputs ---------------------------------

needs_u8 = pytest.mark.skipif(not _u8s8_dot.AVAILABLE, reason="this JAX has no hooks for the u8 x s8 primitive")

F32, BF16 = jnp.float32, jnp.bfloat16
EINSUM_CASES = [
    ("mk,kn->mn", (64, 512), (512, 256), F32),
    ("mk,kn->mn", (64, 512), (512, 256), BF16),
    ("mk,kn->mn", (1, 300), (300, 7), F32),  # one row (YNNPACK needs two: padded)
    ("mk,kn->mn", (5, 7), (7, 3), BF16),  # sizes that are not multiples of any tile
    ("abc,cde->abde", (2, 5, 64), (64, 4, 16), F32),  # project to heads
    ("abcd,cde->abe", (2, 5, 4, 16), (4, 16, 32), BF16),  # merge heads
    ("abc,dc->abd", (2, 5, 48), (24, 48), F32),  # kernel stored (out, in): needs transposes
    ("bca,cd->dab", (3, 40, 2), (40, 6), F32),  # contracted axis in the middle, output permuted
]
CASE_IDS = [f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3].__name__}" for c in EINSUM_CASES]


def _operands(equation, x_shape, kernel_shape):
    x = 3.0 * gaussian(x_shape)
    x[(0,) * x.ndim] = 0.0  # an exact zero in a row that also holds its abs-max
    _, kernel_axes = int8.contracted_axes(equation)
    kernel_q, kernel_scale = int8.quantize_symmetric(jnp.asarray(gaussian(kernel_shape, seed=2)), kernel_axes)
    return jnp.asarray(x), kernel_q, kernel_scale, int8.column_sums(kernel_q, kernel_axes)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _einsum(equation, x, kernel_q, kernel_scale, colsum, dtype, kernel):
    return int8.int8_einsum(equation, x.astype(dtype), kernel_q, kernel_scale, dtype, colsum, kernel)


@needs_u8
@pytest.mark.parametrize("equation,x_shape,kernel_shape,dtype", EINSUM_CASES, ids=CASE_IDS)
def test_int8_kernels_are_bit_identical(equation, x_shape, kernel_shape, dtype):
    x, kernel_q, kernel_scale, colsum = _operands(equation, x_shape, kernel_shape)
    outputs = {k: _einsum(equation, x, kernel_q, kernel_scale, colsum, dtype, k) for k in RUNNABLE_INT8}
    assert outputs["s8s8"].dtype == jnp.dtype(dtype)
    assert outputs["s8s8"].shape == np.einsum(equation, np.asarray(x), np.asarray(kernel_q)).shape
    assert_bit_identical(outputs["u8s8"], outputs["s8s8"])
    # Without stored column sums the u8 kernel computes them: still the same.
    assert_bit_identical(_einsum(equation, x, kernel_q, kernel_scale, None, dtype, "u8s8"), outputs["s8s8"])
    # And each kernel really is in its program.
    texts = {k: _einsum.lower(equation, x, kernel_q, kernel_scale, colsum, dtype, k).as_text()
             for k in RUNNABLE_INT8}
    assert "xui8>" in texts["u8s8"] and "xui8>" not in texts["s8s8"]
    assert "xi8>, tensor<" in texts["s8s8"] and "-> tensor<" in texts["s8s8"]


@needs_u8
@pytest.mark.parametrize("equation,x_shape,kernel_shape,dtype", EINSUM_CASES[:1] + EINSUM_CASES[-2:], ids=[
    CASE_IDS[0]] + CASE_IDS[-2:])
def test_int8_accumulators_equal_int64_arithmetic(equation, x_shape, kernel_shape, dtype):
    del dtype
    rng = np.random.default_rng(0)
    x_q = rng.integers(-127, 128, x_shape, dtype=np.int8)
    kernel_q = rng.integers(-127, 128, kernel_shape, dtype=np.int8)
    x_q.reshape(-1)[:3] = (127, -127, 0)  # both ends of the range
    expected = np.einsum(equation, x_q.astype(np.int64), kernel_q.astype(np.int64))
    for kernel in RUNNABLE_INT8:
        acc = jax.jit(int8.int8_accumulate, static_argnums=(0, 3))(equation, x_q, kernel_q, kernel)
        assert acc.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(acc), expected)


@needs_u8
def test_int8_kernels_have_the_same_gradient():
    x, kernel_q, kernel_scale, colsum = _operands("mk,kn->mn", (16, 64), (64, 32))

    def loss(x_, kernel):
        y = int8.int8_dense(x_, kernel_q, kernel_scale, jnp.float32, colsum, kernel=kernel)
        return jnp.sum(y * jnp.sin(y))

    grads = {k: jax.jit(jax.grad(loss), static_argnums=1)(x, k) for k in RUNNABLE_INT8}
    assert float(jnp.max(jnp.abs(grads["s8s8"]))) > 0.0
    assert_bit_identical(grads["u8s8"], grads["s8s8"])


@on_cpu_backend  # the u8 x s8 product has a CPU lowering only
@pytest.mark.parametrize("name,expect_u8", [("EPYC_AVX2", False), ("SAPPHIRE_RAPIDS", True), ("H100", False)])
def test_the_default_kernel_is_the_one_in_the_program(monkeypatch, name, expect_u8):
    # The default is read from the (stand-in) current device when the product is traced.
    monkeypatch.setattr(_int8_accumulate, "current_device", lambda: SELECTION[name][0])
    x, kernel_q, kernel_scale, colsum = _operands("mk,kn->mn", (8, 32), (32, 16))
    # A new function per test: a shared one would reuse the program traced for another device.
    dense = jax.jit(lambda *args: int8.int8_dense(*args[:3], jnp.float32, args[3]))
    text = dense.lower(x, kernel_q, kernel_scale, colsum).as_text()
    assert ("xui8>" in text) == (expect_u8 and _u8s8_dot.AVAILABLE)
    assert ("(tensor<8x32xi8>, tensor<32x16xi8>) -> tensor<8x16xi32>" in text) == (not expect_u8)
    assert "-> tensor<8x16xi32>" in text  # the product accumulates in int32 either way


def test_every_kernel_spec_runs_its_op_through_the_mode_signature():
    x, kernel_q, kernel_scale, colsum = _operands("abc,cde->abde", (2, 5, 64), (64, 4, 16))
    weights = {"kernel": kernel_q, "kernel_scale": kernel_scale, "kernel_colsum": colsum}
    reference = int8.int8_einsum("abc,cde->abde", x, kernel_q, kernel_scale, jnp.float32, colsum, "s8s8")
    for spec in kernels.INT8_KERNEL_SPECS:
        if (not _u8s8_dot.AVAILABLE and spec.name == "u8s8") or not spec.runnable:
            continue
        y = spec.fn("einsum")("abc,cde->abde", x, weights=weights, layout=(), compute_dtype=jnp.float32)
        assert_bit_identical(y, reference)


# --- float8: the real float8 dot against the emulated product ---------------------------------

def _metas(x, kernel):
    x_scale = float(np.max(np.abs(np.asarray(x, np.float32)))) / float8.E4M3_MAX
    kernel_scale = float(np.max(np.abs(np.asarray(kernel, np.float32)))) / float8.E4M3_MAX
    return float8.Float8Meta(4, x_scale), float8.Float8Meta(4, kernel_scale), float8.Float8Meta(4)


def _fp8_product(x, kernel, metas, dtype, kernel_name):
    return float8.fp8_einsum("mk,kn->mn", x.astype(dtype), kernel.astype(dtype), *metas, kernel_name)


_fp8_jit = jax.jit(_fp8_product, static_argnums=(3, 4))


def _fp8(x, kernel, dtype, kernel_name):
    return _fp8_jit(x, kernel, _metas(x, kernel), dtype, kernel_name)


def _fp8_lower(x, kernel, dtype, kernel_name):
    return _fp8_jit.lower(x, kernel, _metas(x, kernel), dtype, kernel_name).as_text()


def _fp8_reference(x, kernel, dtype):
    """The exact (float64) product of the e4m3-rounded operands of a ``dtype`` input."""
    x_meta, kernel_meta, _ = _metas(x, kernel)
    xq = float8.quantize_dequantize(jnp.asarray(x, dtype).astype(jnp.float32), x_meta.scale, float8.E4M3)
    kq = float8.quantize_dequantize(jnp.asarray(kernel, dtype).astype(jnp.float32), kernel_meta.scale, float8.E4M3)
    return np.asarray(xq, np.float64) @ np.asarray(kq, np.float64)


def _rel(y, reference):
    return float(np.linalg.norm(np.asarray(y, np.float64) - reference) / np.linalg.norm(reference))


# Measured on XLA:CPU (jax 0.10.2), 64x256 @ 256x128: float32 emulated 3.0e-7, fp8_dot 6.2e-8;
# bfloat16 emulated 3.9e-3 (dequantized operands rounded to bfloat16), fp8_dot 1.1e-3 (one
# rounding of the float32 accumulator to bfloat16).
FP8_TOLERANCES = {"float32": (1e-6, 1e-6, 1e-6), "bfloat16": (1e-2, 2e-3, 1e-2)}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_fp8_dot_matches_the_emulated_kernel(dtype):
    emulated_tol, fp8_tol, between_tol = FP8_TOLERANCES[dtype.__name__]
    x, kernel = gaussian((64, 256)), 0.05 * gaussian((256, 128), seed=2)
    reference = _fp8_reference(x, kernel, dtype)
    emulated, real = _fp8(x, kernel, dtype, "emulated"), _fp8(x, kernel, dtype, "fp8_dot")
    assert emulated.dtype == real.dtype == jnp.dtype(dtype)
    assert _rel(emulated, reference) <= emulated_tol
    assert _rel(real, reference) <= fp8_tol
    assert 0.0 < _rel(real, np.asarray(emulated, np.float64)) <= between_tol  # close, not equal


def test_fp8_dot_multiplies_float8_operands():
    x, kernel = gaussian((16, 32)), gaussian((32, 8), seed=2)
    text = _fp8_lower(x, kernel, F32, "fp8_dot")
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1
    assert "(tensor<16x32xf8E4M3FN>, tensor<32x8xf8E4M3FN>) -> tensor<16x8xf32>" in dots[0]
    emulated = [line for line in _fp8_lower(x, kernel, F32, "emulated").splitlines()
                if "stablehlo.dot_general" in line]
    assert "(tensor<16x32xf32>, tensor<32x8xf32>) -> tensor<16x8xf32>" in emulated[0]


@pytest.mark.parametrize("name,expected", [("H100", "f8E4M3FN"), ("L4", "f8E4M3FN"), ("A100", "xf32>, tensor"),
                                           ("EPYC_AVX2", "xf32>, tensor")])
def test_the_default_float8_kernel_follows_the_device(monkeypatch, name, expected):
    monkeypatch.setattr(float8, "current_device", lambda: SELECTION[name][0])
    x, kernel = gaussian((16, 32)), gaussian((32, 8), seed=2)
    # A new function per test: a shared one would reuse the program traced for another device.
    fresh = jax.jit(lambda a, b, metas: _fp8_product(a, b, metas, F32, None))
    text = fresh.lower(x, kernel, _metas(x, kernel)).as_text()
    dot = next(line for line in text.splitlines() if "stablehlo.dot_general" in line)
    assert expected in dot


def test_float8_kernels_have_the_same_gradients_and_meta_updates():
    x, kernel = jnp.asarray(gaussian((16, 32))), jnp.asarray(0.1 * gaussian((32, 8), seed=2))
    metas = _metas(x, kernel)

    weight = jnp.asarray(gaussian((16, 8), seed=3))

    def loss(x_, kernel_, metas_, kernel_name):
        # A loss linear in the output: the output gradient does not depend on the kernel.
        return jnp.sum(weight * float8.fp8_einsum("mk,kn->mn", x_, kernel_, *metas_, kernel_name))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    emulated, real = grad(x, kernel, metas, "emulated"), grad(x, kernel, metas, "fp8_dot")
    assert float(jnp.max(jnp.abs(emulated[0]))) > 0.0
    assert float(real[2][0].amax_history[0]) == float(np.max(np.abs(np.asarray(x))))  # recorded
    assert_bit_identical(real, emulated)  # input and kernel gradients, and the updated metas


def test_an_einsum_summing_within_one_operand_is_refused():
    kernel_q, scale = int8.quantize_symmetric(jnp.asarray(gaussian((8, 5), seed=2)), (0,))
    with pytest.raises(ValueError, match=r"sums only over letters of both operands; \['j'\] of 'mjk,kn->mn'"):
        int8.int8_einsum("mjk,kn->mn", jnp.ones((2, 3, 8)), kernel_q, scale, jnp.float32)


# --- 16-bit float policies: XLA's dot, or the same dot accumulated into a float32 result --------

SPR_BF16 = Device("cpu", "cpu", ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"))


@pytest.mark.parametrize("device,dtype,expected,candidates", [
    (SPR_BF16, "bfloat16", "f32_accumulate", ("f32_accumulate", "xla")),
    (SPR_BF16, "float16", "xla", ("xla", "f32_accumulate")),
    (Device("cpu", "cpu", ("amx_bf16",)), "bfloat16", "f32_accumulate", ("f32_accumulate", "xla")),
    (EPYC_AVX2, "bfloat16", "xla", ("xla", "f32_accumulate")),
    (H100, "bfloat16", "xla", ("xla",)),
    (A100, "float16", "xla", ("xla",)),
])
def test_float_kernel_defaults_follow_the_device_and_dtype(device, dtype, expected, candidates):
    assert kernels.default_kernel("float", "einsum", device, compute_dtype=dtype) == expected
    assert kernels.candidate_kernels("float", "einsum", device, compute_dtype=dtype) == candidates


def test_the_float_default_needs_a_compute_dtype():
    with pytest.raises(ValueError, match="depends on the compute dtype: pass compute_dtype="):
        kernels.default_kernel("float", "einsum", EPYC_AVX2)
    with pytest.raises(ValueError, match=r"Invalid float kernel\. Expected one of \('xla', 'f32_accumulate'\)"):
        float_dot.float_einsum("mk,kn->mn", jnp.ones((2, 2)), jnp.ones((2, 2)), "bf16")


def test_f32_accumulate_is_xla_up_to_one_ulp_in_bfloat16():
    x = jnp.asarray(gaussian((256, 512)), jnp.bfloat16)
    kernel = jnp.asarray(gaussian((512, 256), seed=2), jnp.bfloat16)
    product = jax.jit(float_dot.float_einsum, static_argnums=(0, 3))
    native, accumulated = product("mk,kn->mn", x, kernel, "xla"), product("mk,kn->mn", x, kernel, "f32_accumulate")
    assert native.dtype == accumulated.dtype == jnp.bfloat16
    a, b = np.asarray(native, np.float32), np.asarray(accumulated, np.float32)
    ulp = np.spacing(np.abs(a).astype(np.float32)) * 2.0**16  # bfloat16 keeps 8 of float32's 24 bits
    assert np.all(np.abs(a - b) <= ulp)
    assert np.mean(a != b) < 0.01  # measured 0.006%-0.017%: only the summation order differs
    text = product.lower("mk,kn->mn", x, kernel, "f32_accumulate").as_text()
    assert "(tensor<256x512xbf16>, tensor<512x256xbf16>) -> tensor<256x256xf32>" in text


def test_f32_accumulate_is_exactly_xla_in_float32():
    x, kernel = jnp.asarray(gaussian((32, 64))), jnp.asarray(gaussian((64, 16), seed=2))
    assert_bit_identical(float_dot.float_einsum("mk,kn->mn", x, kernel, "f32_accumulate"),
                         float_dot.float_einsum("mk,kn->mn", x, kernel, "xla"))


# --- the benchmark's bookkeeping (benchmarks/bench_kernels.py) --------------------------------


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_kernels")


def test_bench_names_the_device_in_the_report_file(bench):
    import os  # pylint: disable=import-outside-toplevel

    cores = os.cpu_count()
    assert bench.device_slug(H100, None) == "nvidia-h100-80gb-hbm3"
    assert bench.device_slug(EPYC_AVX2, "AMD EPYC 7B12") == f"amd-epyc-7b12-avx2-{cores}c"
    assert bench.device_slug(SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz") == \
        f"intel-xeon-platinum-8480-amx-int8-{cores}c"


def test_bench_ratios_are_paired_per_round(bench):
    from autopolicy.search.timing import summarize  # pylint: disable=import-outside-toplevel

    slow, fast = summarize([2.0, 4.0, 6.0, 9.0]), summarize([1.0, 2.0, 2.0, 3.0])
    assert bench.paired_ratio(slow, fast) == (2.5, 2.0, 3.0)  # ratios 2, 2, 3, 3


def test_bench_goal_checks(bench):
    from autopolicy.search.timing import summarize  # pylint: disable=import-outside-toplevel

    per_call = {"float32": 10.0, "mixed_bfloat16": 5.0, bench.LAYER_INT8: 4.0, "int8/s8s8": 3.0,
                "int8/u8s8": 3.5, bench.KERAS_INT8: 3.6, bench.RAW_S8: 3.0}
    timings = {name: summarize([t, t, t]) for name, t in per_call.items()}
    results = [{"size": 1024, "rows": bench.table_rows(1024, timings, {}), "timings": timings}]
    lines = bench.goal_checks(results, SAPPHIRE_RAPIDS)
    assert lines[:4] == [
        "- FAIL N=1024: autopolicy int8 layer (default kernel) = 0.90x [0.90–0.90] Keras int8 (goal >= 0.95x)",
        "- FAIL N=1024: autopolicy int8 layer (default kernel) = 0.75x [0.75–0.75] the raw s8 x s8 dot (goal >= 0.9x)",
        "- PASS N=1024: autopolicy int8 best kernel `int8/s8s8` = 1.20x [1.20–1.20] Keras int8 (goal >= 0.95x)",
        "- PASS N=1024: autopolicy int8 best kernel `int8/s8s8` = 1.00x [1.00–1.00] the raw s8 x s8 dot (goal >= 0.9x)",
    ]
    assert lines[4] == "- PASS N=1024 (VNNI CPU): autopolicy int8 = 2.50x [2.50–2.50] float32 (goal >= 2.4x)"
    assert not any("VNNI" in line for line in bench.goal_checks(results, EPYC_AVX2))


def test_bench_goal_checks_on_an_h100(bench):
    from autopolicy.search.timing import summarize  # pylint: disable=import-outside-toplevel

    per_call = {"float32": 10.0, "mixed_bfloat16": 5.0, "float8/fp8_dot": 4.0, bench.LAYER_INT8: 2.0,
                "int8/s8s8": 2.0, bench.RAW_S8: 2.0}
    timings = {name: summarize([t, t, t]) for name, t in per_call.items()}
    results = [{"size": 4096, "rows": bench.table_rows(4096, timings, {}), "timings": timings}]
    lines = bench.goal_checks(results, H100)
    assert lines[-2:] == [
        "- PASS N=4096 (NVIDIA H100 80GB HBM3): mixed_bfloat16 = 2.00x [2.00–2.00] float32 (H100 goal >= 1.8x)",
        "- FAIL N=4096 (NVIDIA H100 80GB HBM3): float8/fp8_dot = 1.25x [1.25–1.25] mixed_bfloat16 (H100 goal >= 1.3x)",
    ]
    assert not any("Keras" in line for line in lines)  # no Keras rows were timed


def test_bench_times_only_the_kernels_the_device_offers(bench, monkeypatch):
    # On an H100 the C++ CPU kernel has no CUDA handler: timing it stopped the benchmark there.
    monkeypatch.setattr(bench, "current_device", lambda: H100)
    monkeypatch.setattr(bench, "keras_int8_dense", lambda dense, size: None)  # Keras is not the point here
    candidates, notes = bench.make_candidates(16, 0)
    assert "int8/s8s8" in candidates and "float8/fp8_dot" in candidates
    assert "int8/cpu_ffi" not in candidates and "int8/u8s8" not in candidates
    assert set(notes) == set(candidates)


def test_bench_report_survives_an_interrupt_after_the_first_size(bench, monkeypatch, tmp_path):
    from autopolicy.search.timing import summarize  # pylint: disable=import-outside-toplevel

    def fake_bench_size(size, repeats, seed):
        if size == 16:
            raise KeyboardInterrupt
        timings = {name: summarize([t, t, t]) for name, t in
                   {"float32": 10.0, "mixed_bfloat16": 5.0, bench.LAYER_INT8: 4.0, "int8/s8s8": 3.0,
                    bench.RAW_S8: 3.0}.items()}
        return {"size": size, "rows": bench.table_rows(size, timings, {}), "notes": {}, "programs": {},
                "identical": True, "int8_names": ["int8/s8s8"], "timings": timings, "cpu_per_wall": 1.0}

    monkeypatch.setattr(bench, "bench_size", fake_bench_size)
    out = tmp_path / "kernels.md"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--sizes", "8", "16", "--out", str(out)])
    text = out.read_text()
    assert "**Incomplete:** written after N = 8; not measured yet: N = 16." in text
    assert "| 8 | int8/s8s8 |" in text
