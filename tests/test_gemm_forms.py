"""GEMM forms: which GPU library path a compiled program takes (hand-written HLO in XLA:GPU's
printed form, and the CPU's real compiled text, which takes none), and the StableHLO autopolicy's
kernels hand XLA before optimization, lowered for CUDA without a GPU (``jax.export``).

The GPU's own compiled text comes from ``benchmarks/bench_gpu_kernels.py`` on a lent GPU (its
page's "HLO forms" section).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from autopolicy.numerics import gemm_forms, int8, kernels, weight_only
from autopolicy.numerics.float8 import Float8Meta
from autopolicy.numerics.gemm_forms import check_forms, check_lowered
from helpers import on_the_cpu  # noqa: F401  (a fixture)

_BACKEND = ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":'
            '{"alpha_real":1,"alpha_imag":0,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
            '"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},'
            '"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"},'
            '"epilogue":"DEFAULT","lhs_stride":"4096","rhs_stride":"16384","grad_x":false,"grad_y":false,'
            '"damax_output":false},"force_earliest_schedule":false}')

# cuBLASLt's float8 GEMM as XLA:GPU prints it on an H100: operands named without their shapes (newer
# XLA), the kernel transposed so its contracting dimension is minor, both scales folded in.
FP8_CUBLASLT = f"""HloModule jit_fp8, is_scheduled=true, entry_computation_layout={{(f8e4m3fn[16,256]{{1,0}}, f8e4m3fn[256,64]{{1,0}}, f32[], f32[])->bf16[16,64]{{1,0}}}}

%wrapped_transpose_computation (param_0: f8e4m3fn[256,64]) -> f8e4m3fn[64,256] {{
  %param_0 = f8e4m3fn[256,64]{{1,0}} parameter(0)
  ROOT %transpose.1 = f8e4m3fn[64,256]{{1,0}} transpose(%param_0), dimensions={{1,0}}
}}

ENTRY %main.12 (x.1: f8e4m3fn[16,256], k.1: f8e4m3fn[256,64], a.1: f32[], b.1: f32[]) -> bf16[16,64] {{
  %x.1 = f8e4m3fn[16,256]{{1,0}} parameter(0), metadata={{op_name="x"}}
  %k.1 = f8e4m3fn[256,64]{{1,0}} parameter(1), metadata={{op_name="k"}}
  %wrapped_transpose = f8e4m3fn[64,256]{{1,0}} fusion(%k.1), kind=kInput, calls=%wrapped_transpose_computation
  %a.1 = f32[] parameter(2)
  %b.1 = f32[] parameter(3)
  %multiply.2 = f32[] multiply(%a.1, %b.1), metadata={{op_name="jit(fp8)/mul"}}
  %constant_1 = f32[] constant(1)
  %cublas-lt-matmul.2 = (bf16[16,64]{{1,0}}, s8[33554432]{{0}}) custom-call(%x.1, %wrapped_transpose, %multiply.2, %constant_1), custom_call_target="__cublas$lt$matmul$f8", {_BACKEND}
  ROOT %get-tuple-element = bf16[16,64]{{1,0}} get-tuple-element(%cublas-lt-matmul.2), index=0
}}
"""

# int8 on legacy cuBLAS (XLA sends s8 GEMMs there), operands printed with their shapes (older XLA):
# the (K, N) kernel copied into a minor-contracting layout first.
INT8_CUBLAS = f"""HloModule jit_int8, is_scheduled=true

ENTRY %main (p0: s8[16,256], p1: s8[256,64]) -> s32[16,64] {{
  %p0 = s8[16,256]{{1,0}} parameter(0)
  %p1 = s8[256,64]{{1,0}} parameter(1)
  %copy.3 = s8[256,64]{{0,1}} copy(s8[256,64]{{1,0}} %p1)
  %cublas-gemm.1 = (s32[16,64]{{1,0}}, s8[4194304]{{0}}) custom-call(s8[16,256]{{1,0}} %p0, s8[256,64]{{0,1}} %copy.3), custom_call_target="__cublas$gemm", {_BACKEND}
  ROOT %get-tuple-element.1 = s32[16,64]{{1,0}} get-tuple-element((s32[16,64]{{1,0}}, s8[4194304]{{0}}) %cublas-gemm.1), index=0
}}
"""

FLOAT_CUBLAS = INT8_CUBLAS.replace("s8[16,256]", "bf16[16,256]").replace("s8[256,64]", "bf16[256,64]").replace(
    "(s32[16,64]", "(bf16[16,64]").replace("-> s32[16,64]", "-> bf16[16,64]").replace(
    "%get-tuple-element.1 = s32", "%get-tuple-element.1 = bf16")


def _triton_gemm(config, fused, operands, result):
    return f"""HloModule jit_triton, is_scheduled=true

{fused}

ENTRY %main ({operands}) -> {result} {{
  %p0 = bf16[16,256]{{1,0}} parameter(0)
  %p1 = u8[64,256]{{1,0}} parameter(1)
  ROOT %gemm_fusion_dot.1 = {result}{{1,0}} fusion(%p0, %p1), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={{"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{config},"force_earliest_schedule":false}}
}}
"""


# Weight-only dequantization inside a Triton GEMM (the legacy emitter: one fused computation).
TRITON_DEQUANT = _triton_gemm(
    '{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"64","split_k":"1",'
    '"num_stages":"4","num_warps":"4","num_ctas":"1"}}',
    """%gemm_fusion_dot.1_computation (parameter_0: bf16[16,256], parameter_1: u8[64,256]) -> bf16[16,64] {
  %parameter_0 = bf16[16,256]{1,0} parameter(0)
  %parameter_1 = u8[64,256]{1,0} parameter(1)
  %convert.5 = bf16[64,256]{1,0} convert(%parameter_1)
  ROOT %dot.1 = bf16[16,64]{1,0} dot(%parameter_0, %convert.5), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}""", "p0: bf16[16,256], p1: u8[64,256]", "bf16[16,64]")

_NESTED = ('{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"4",'
           '"output_tiles":[{"sizes":["16","64"]}],"num_ctas":1,"num_stages":3}}')


def _nested(lhs_type, rhs_type, rhs_root, dot_type):
    """XLA's newer Triton emitter: each operand a nested fusion of its own."""
    return _triton_gemm(_NESTED, f"""%lhs_computation (p: {lhs_type}[16,256]) -> {lhs_type}[16,256] {{
  ROOT %p = {lhs_type}[16,256]{{1,0}} parameter(0)
}}

%rhs_computation (p: u8[64,256]) -> {rhs_type}[64,256] {{
  %p = u8[64,256]{{1,0}} parameter(0)
  ROOT %r = {rhs_type}[64,256]{{1,0}} {rhs_root}
}}

%gemm_fusion_dot.1_computation (parameter_0: {lhs_type}[16,256], parameter_1: u8[64,256]) -> {dot_type}[16,64] {{
  %parameter_0 = {lhs_type}[16,256]{{1,0}} parameter(0)
  %block_fusion = {lhs_type}[16,256]{{1,0}} fusion(%parameter_0), kind=kCustom, calls=%lhs_computation, backend_config={{"fusion_backend_config":{_NESTED}}}
  %parameter_1 = u8[64,256]{{1,0}} parameter(1)
  %block_fusion.1 = {rhs_type}[64,256]{{1,0}} fusion(%parameter_1), kind=kCustom, calls=%rhs_computation, backend_config={{"fusion_backend_config":{_NESTED}}}
  ROOT %dot.2 = {dot_type}[16,64]{{1,0}} dot(%block_fusion, %block_fusion.1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
}}""", f"p0: {lhs_type}[16,256], p1: u8[64,256]", f"{dot_type}[16,64]")


NESTED_DEQUANT = _nested("bf16", "bf16", "convert(%p)", "bf16")
NESTED_INT8 = _nested("s8", "s8", "bitcast-convert(%p)", "s32")
NESTED_FP8 = _nested("f8e4m3fn", "f8e4m3fn", "bitcast-convert(%p)", "f32")
NESTED_FLOAT = _nested("bf16", "bf16", "bitcast-convert(%p)", "bf16")

PALLAS = """HloModule jit_pallas, is_scheduled=true

ENTRY %main (x: bf16[16,256], q: u8[64,256]) -> bf16[16,64] {
  %x = bf16[16,256]{1,0} parameter(0)
  %q = u8[64,256]{1,0} parameter(1)
  ROOT %custom-call.1 = bf16[16,64]{1,0} custom-call(%x, %q), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI
}
"""

# A GEMM in a timing loop's body: XLA left it in the loop.
IN_LOOP = f"""HloModule jit_loop, is_scheduled=true

%body (carry: (s32[], s8[16,256], s8[256,64])) -> (s32[], s8[16,256], s8[256,64]) {{
  %carry = (s32[], s8[16,256]{{1,0}}, s8[256,64]{{0,1}}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %x = s8[16,256]{{1,0}} get-tuple-element(%carry), index=1
  %k = s8[256,64]{{0,1}} get-tuple-element(%carry), index=2
  %cublas-gemm.1 = (s32[16,64]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %k), custom_call_target="__cublas$gemm", {_BACKEND}
  ROOT %tuple = (s32[], s8[16,256]{{1,0}}, s8[256,64]{{0,1}}) tuple(%i, %x, %k)
}}

%condition (carry.1: (s32[], s8[16,256], s8[256,64])) -> pred[] {{
  %carry.1 = (s32[], s8[16,256]{{1,0}}, s8[256,64]{{0,1}}) parameter(0)
  %i.1 = s32[] get-tuple-element(%carry.1), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}}

ENTRY %main (x: s8[16,256], k: s8[256,64]) -> s8[16,256] {{
  %zero = s32[] constant(0)
  %x = s8[16,256]{{1,0}} parameter(0)
  %k = s8[256,64]{{0,1}} parameter(1)
  %init = (s32[], s8[16,256]{{1,0}}, s8[256,64]{{0,1}}) tuple(%zero, %x, %k)
  %while = (s32[], s8[16,256]{{1,0}}, s8[256,64]{{0,1}}) while(%init), condition=%condition, body=%body
  ROOT %out = s8[16,256]{{1,0}} get-tuple-element(%while), index=1
}}
"""


@pytest.mark.parametrize("text,form,operands,result,kind", [
    (FP8_CUBLASLT, "cublaslt_fp8", ("f8e4m3fn", "f8e4m3fn"), "bf16", "fp8"),
    (INT8_CUBLAS, "cublas_int8", ("s8", "s8"), "s32", "int8"),
    (FLOAT_CUBLAS, "cublas", ("bf16", "bf16"), "bf16", "float"),
    (TRITON_DEQUANT, "triton_dequant", ("bf16", "bf16"), "bf16", "weight_only"),
    (NESTED_DEQUANT, "triton_dequant", ("bf16", "bf16"), "bf16", "weight_only"),
    (NESTED_INT8, "triton_int8", ("s8", "s8"), "s32", "int8"),
    (NESTED_FP8, "triton_fp8", ("f8e4m3fn", "f8e4m3fn"), "f32", "fp8"),
    (NESTED_FLOAT, "triton", ("bf16", "bf16"), "bf16", "float"),
    (PALLAS, "pallas_triton", ("bf16", "u8"), "bf16", "weight_only"),
])
def test_each_gpu_form_is_recognised(text, form, operands, result, kind):
    (found,) = gemm_forms.gemm_forms(text)
    assert (found.form, found.operands, found.result, found.in_loop) == (form, operands, result, False)
    check = check_forms(text, kind)
    assert check.ok and check.verdict == f"{kind}: {found.describe()}"
    other = "int8" if kind != "int8" else "fp8"
    assert not check_forms(text, other).ok


def test_what_the_forms_say_beyond_their_name():
    (fp8,) = gemm_forms.gemm_forms(FP8_CUBLASLT)
    assert fp8.detail == "__cublas$lt$matmul$f8, precision default,default"
    # Operands printed without shapes are found by name; the transposed kernel's is its own.
    assert fp8.operand_shapes == ("f8e4m3fn[16,256]{1,0}", "f8e4m3fn[64,256]{1,0}")
    assert fp8.copied_operands == (1,)  # a fusion whose root is a transpose
    (int8_gemm,) = gemm_forms.gemm_forms(INT8_CUBLAS)
    assert int8_gemm.copied_operands == (1,) and int8_gemm.operand_shapes[1] == "s8[256,64]{0,1}"
    assert int8_gemm.describe() == "cublas_int8 (s8 x s8 -> s32, operand 1 copied first)"
    (nested,) = gemm_forms.gemm_forms(NESTED_DEQUANT)
    assert nested.detail == "__triton_nested_gemm_fusion" and nested.name == "gemm_fusion_dot.1"


def test_a_gemm_in_a_while_body_is_in_a_loop():
    (found,) = gemm_forms.gemm_forms(IN_LOOP)
    assert (found.form, found.in_loop) == ("cublas_int8", True)


def test_a_program_without_a_gemm_says_so():
    text = "ENTRY %e (p: f32[2]) -> f32[2] {\n  ROOT %n = f32[2]{0} negate(f32[2]{0} %p)\n}\n"
    assert gemm_forms.gemm_forms(text) == ()
    assert check_forms(text, "int8") == gemm_forms.FormCheck(
        "int8", False, "int8: none of cublas_int8, triton_int8; no GEMM at all", ())


@pytest.mark.parametrize("check", [check_forms, check_lowered])
def test_an_unknown_kind_is_refused_naming_the_kinds(check):
    with pytest.raises(ValueError, match=r"Invalid product kind\. Expected one of \('float', 'fp8', 'int8', "
                                         r"'weight_only'\)\. Received: kind='int7'"):
        check("", "int7")


def test_every_expected_form_is_a_form():
    assert {f for _, forms in gemm_forms.EXPECTED_FORMS for f in forms} <= set(gemm_forms.FORMS)


# --- autopolicy's kernels ---------------------------------------------------------------------


def _gaussian(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def _fp8_weights(kernel):
    return {"kernel": kernel, "fp8": {"input": Float8Meta(4, 0.01), "kernel": Float8Meta(4, 0.005),
                                      "output_grad": Float8Meta(4)}}


@functools.cache
def _products():
    """``{name: (kind, fn, args)}``: each kernel's product at 16 x 256 x 64, its weights as a
    model holds them."""
    x, k = _gaussian((16, 256), 1, jnp.bfloat16), _gaussian((256, 64), 2)
    q, scale, zero = weight_only.round_to_nearest(k.T, 4, 128)
    gptq = weight_only.store(q, scale, zero, weight_only.group_index(256, 128), 4, jnp.float32)
    table = {
        "fp8_dot": ("fp8", "float8", "fp8_dot", _fp8_weights(k.astype(jnp.bfloat16)), ()),
        "emulated": ("fp8", "float8", "emulated", _fp8_weights(k.astype(jnp.bfloat16)), ()),
        "s8s8": ("int8", "int8", "s8s8", int8.quantize_weights(k, (0,), "einsum", None, jnp.float32), ()),
        "gptq": ("weight_only", "gptq", "xla", gptq, (4, 128)),
    }
    out = {}
    for name, (kind, mode, kernel, weights, layout) in table.items():
        op = kernels.kernel_spec(mode, kernel).fn("einsum")
        out[name] = (kind, functools.partial(op, "mk,kn->mn", layout=layout, compute_dtype=jnp.bfloat16),
                     (x, weights))
    return out


def _cuda_stablehlo(name):
    _, fn, args = _products()[name]
    return export.export(jax.jit(lambda x, w: fn(x, w)), platforms=["cuda"])(*args).mlir_module()


def test_the_fp8_product_is_an_e4m3_dot_scaled_by_scalars_outside_it():
    text = _cuda_stablehlo("fp8_dot")
    check = check_lowered(text, "fp8")
    assert check.ok, check.verdict
    assert check.verdict == "fp8: dots f8e4m3fn x f8e4m3fn -> f32"
    # Two scalar scales, multiplied together, then one broadcast multiply of the dot's result.
    assert text.count("stablehlo.dot_general") == 1 and "stablehlo.reduce" not in text


def test_an_inference_forward_with_delayed_scaling_reduces_over_nothing():
    # Not even in the jaxpr, before JAX's dead-code elimination: the amax is the backward pass's.
    _, fn, args = _products()["fp8_dot"]
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert "reduce_max" not in jaxpr and "fp8_einsum" in jaxpr
    # Training still records the amax of the input, the kernel and the output gradient.
    x, weights = args
    grads = jax.grad(lambda w: fn(x, w).astype(jnp.float32).sum())(weights)
    assert float(grads["fp8"]["input"].amax_history[0]) == pytest.approx(float(jnp.max(jnp.abs(x))))


def test_a_projection_to_heads_keeps_the_fp8_pattern():
    # Two free axes of the kernel: XLA's dot canonicalization reshapes the float8 operands, which
    # the rewriter lets pass between the float8 values and the dot.
    op = kernels.kernel_spec("float8", "fp8_dot").fn("einsum")
    x, k = _gaussian((2, 3, 64), 3, jnp.bfloat16), _gaussian((64, 4, 16), 4, jnp.bfloat16)
    fn = jax.jit(lambda x_, w_: op("btd,dhk->bthk", x_, w_, (), jnp.bfloat16))
    text = export.export(fn, platforms=["cuda"])(x, _fp8_weights(k)).mlir_module()
    assert check_lowered(text, "fp8") == gemm_forms.FormCheck("fp8", True, "fp8: dots f8e4m3fn x f8e4m3fn -> f32")


def test_the_emulated_float8_kernel_is_no_fp8_gemm():
    check = check_lowered(_cuda_stablehlo("emulated"), "fp8")
    assert not check.ok and "no float8 dot to f32/bf16/f16" in check.verdict


def test_a_per_channel_fp8_scale_is_no_scalar_scale():
    text = """func.func public @main(%arg0: tensor<16x32xf8E4M3FN>, %arg1: tensor<32x64xf8E4M3FN>, %arg2: tensor<64xf32>) -> tensor<16x64xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<16x32xf8E4M3FN>, tensor<32x64xf8E4M3FN>) -> tensor<16x64xf32>
    %1 = stablehlo.broadcast_in_dim %arg2, dims = [1] : (tensor<64xf32>) -> tensor<16x64xf32>
    %2 = stablehlo.multiply %0, %1 : tensor<16x64xf32>
    return %2 : tensor<16x64xf32>
  }"""
    check = check_lowered(text, "fp8")
    assert not check.ok and check.verdict.endswith("no scale by a broadcast scalar on the dot's result")


def test_the_int8_product_is_an_s8_dot_to_s32():
    check = check_lowered(_cuda_stablehlo("s8s8"), "int8")
    assert check.ok and check.verdict == "int8: dots s8 x s8 -> s32"


def test_the_weight_only_xla_kernel_dequantizes_before_a_float_dot_and_gathers_its_scales():
    # What makes the dequantization a pass of its own on a GPU: the scales and zero points are
    # gathered by g_idx, and XLA's Triton GEMM fusions take no gather.
    check = check_lowered(_cuda_stablehlo("gptq"), "weight_only")
    assert not check.ok
    assert check.verdict == "weight_only: dots bf16 x bf16 -> bf16; scales gathered by index (a gather)"


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("name", ["fp8_dot", "s8s8", "gptq"])
def test_a_cpu_program_takes_none_of_the_gpu_forms(name):
    kind, fn, args = _products()[name]
    text = jax.jit(lambda x, w: fn(x, w)).lower(*args).compile().as_text()
    check = check_forms(text, kind)
    assert not check.ok and check.verdict.startswith(f"{kind}: none of ")
    assert check.forms and {f.form for f in check.forms} == {"dot"}
