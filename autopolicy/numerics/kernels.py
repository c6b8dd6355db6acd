"""Kernels as tactics: the interchangeable ways to run one quantization mode's product.

Where a mode can multiply in more than one way (int8: XLA's s8 x s8 -> s32 dot, or the
u8 x s8 -> s32 dot of x86 VNNI/AMX), each way is a :class:`KernelSpec`: a name, the mode's op
functions with that kernel bound, and a predicate saying on which :class:`~autopolicy.numerics.
device.Device` it is worth timing. Which one a layer uses is decided by timing the candidates at
the layer's real shape on the target (like TensorRT's tactics); without a measurement,
:func:`default_kernel` applies the device rule of the mode:

- int8: ``"u8s8"`` on CPUs with avx512_vnni, avx_vnni or amx_int8; ``"s8s8"`` on every other
  CPU (XLA's u8 x s8 dot is several times slower there) and on GPUs and TPUs.
- float8: ``"fp8_dot"`` (a real float8 product: e4m3 operands, float32 accumulation, then the
  scales) on GPUs of compute capability 8.9 or higher; ``"emulated"`` (quantize-dequantize, then
  a product in the compute dtype) elsewhere.
- gptq, awq: ``"xla"`` (dequantize, then a float product); ``"cpu_ffi"``, autopolicy's CPU
  kernel (:mod:`autopolicy.numerics.cpu_weight_only`), or ``"cpu_ffi_avx2"``, the same on its
  AVX2 path, only where a measurement chose it; on GPUs, ``"pallas"``, a Pallas (Triton) kernel
  that dequantizes tile by tile in registers (:mod:`autopolicy.numerics.pallas_weight_only`),
  likewise only where a measurement chose it.

Products of 16-bit float policies (``bfloat16``, ``float16``, ``mixed_*``) are listed under the
pseudo-mode ``"float"`` (:mod:`autopolicy.numerics.float_dot`): ``"xla"``, XLA's dot in the compute
dtype (tensor cores on GPUs), and ``"f32_accumulate"``, the same product asked for a float32
result and rounded once (a native bfloat16 kernel on CPUs with AVX512-BF16 or AMX-BF16, the
default there for bfloat16). Their default depends on the compute dtype (``compute_dtype=``).

The int8 kernels are exact: the same int32 accumulators, the same outputs bit for bit. The
float8 kernels agree to float32 rounding (``exact=False`` on ``"fp8_dot"``; the tolerance is
stated in its ``summary``).

Every op function has the mode's op signature (:mod:`autopolicy.numerics.modes`); the low-level
functions take the kernel's name as ``kernel=`` (``int8.int8_einsum``, ``int8.int8_dense``,
``int8.int8_conv``) or ``kernel_name=`` (``float8.fp8_einsum``, whose ``kernel`` is the weights).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping

from autopolicy.numerics import cpu_kernels, cpu_weight_only, float8, float_dot, int4, int8, weight_only
from autopolicy.numerics.device import Device, current_device

__all__ = [
    "KernelSpec",
    "MODE_KERNELS",
    "INT8_KERNEL_SPECS",
    "INT4_KERNEL_SPECS",
    "FLOAT8_KERNEL_SPECS",
    "GPTQ_KERNEL_SPECS",
    "AWQ_KERNEL_SPECS",
    "FLOAT_KERNEL_SPECS",
    "kernel_specs",
    "kernel_spec",
    "candidate_kernels",
    "default_kernel",
    "runnable",
]

_log = logging.getLogger("autopolicy")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel (tactic) of a quantization mode.

    Attributes:
      mode: The quantization mode (``"int8"``).
      name: The kernel's name, unique within the mode (``"u8s8"``); the value of the low-level
        functions' ``kernel=`` argument and of a ``kernel`` column in profiles and reports.
      ops: ``(op, fn)`` pairs: each op it runs, with the mode's op signature and this kernel
        bound (``fn(equation, x, weights, layout, compute_dtype)`` for ``"einsum"``).
      available: ``available(device) -> bool``: whether it is worth timing on ``device``.
      exact: Whether its outputs equal the mode's other exact kernels bit for bit.
      summary: One line on what it does (and, when not exact, how close it is).
      needs_library: Whether it needs autopolicy's compiled CPU kernels.
      needs_gpu: Whether it runs only where JAX's default device is a GPU.
    """

    mode: str
    name: str
    ops: tuple[tuple[str, Callable[..., Any]], ...]
    available: Callable[[Device], bool]
    exact: bool
    summary: str
    #: Whether it runs autopolicy's own CPU library (:mod:`autopolicy.numerics.cpu_kernels`),
    #: which an install without a compiler lacks.
    needs_library: bool = False
    #: Whether it runs only on GPUs (a Pallas kernel: elsewhere only its interpreter, for tests).
    needs_gpu: bool = False

    @property
    def runnable(self) -> bool:
        """Whether this process can run it at all (its library, if it needs one, is loaded, and
        runs the SIMD path the kernel names on this CPU; a GPU, if it needs one, is the default
        device)."""
        if self.needs_gpu and current_device().platform != "gpu":
            return False
        if not self.needs_library:
            return True
        if not cpu_kernels.AVAILABLE:
            return False
        simd_path = cpu_kernels.FFI_KERNELS.get(self.name, "")
        return not simd_path or simd_path in cpu_kernels.supported_paths()

    @property
    def op_names(self) -> tuple[str, ...]:
        return tuple(op for op, _ in self.ops)

    def fn(self, op: str) -> Callable[..., Any]:
        """The function that runs ``op`` with this kernel.

        Raises:
          ValueError: if the kernel does not run ``op``.

        >>> kernel_spec("int8", "u8s8").fn("conv2d")
        Traceback (most recent call last):
        ...
        ValueError: The int8 kernel 'u8s8' has no 'conv2d' op: it runs ('einsum',).
        """
        for name, fn in self.ops:
            if name == op:
                return fn
        raise ValueError(f"The {self.mode} kernel {self.name!r} has no {op!r} op: it runs {self.op_names}.")


def _bind(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    bound = functools.partial(fn, kernel=name)
    functools.update_wrapper(bound, fn)
    return bound


def _ffi_spec(mode: str, name: str, einsum: Callable[..., Any], available: Callable[..., bool], exact: bool,
              summary: str) -> KernelSpec:
    """A kernel of autopolicy's CPU library (``name`` in ``cpu_kernels.FFI_KERNELS``): the mode's
    einsum op and availability check, bound to the kernel's name."""
    return KernelSpec(mode=mode, name=name, ops=(("einsum", _bind(einsum, name)),),
                      available=functools.partial(available, name), exact=exact, summary=summary,
                      needs_library=True)


#: What ``cpu_ffi_avx2`` is, in every mode's summary.
_AVX2_PATH = "the same library on its AVX2 path, on CPUs whose best path is another (AVX-512 or AVX-VNNI)"


INT8_KERNEL_SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        mode="int8",
        name="s8s8",
        ops=(("einsum", _bind(int8.einsum_kernel, "s8s8")), ("conv2d", _bind(int8.conv2d_kernel, "s8s8"))),
        available=functools.partial(int8.int8_kernel_available, "s8s8"),
        exact=True,
        summary="XLA's s8 x s8 -> s32 dot (preferred_element_type=int32)",
    ),
    KernelSpec(
        mode="int8",
        name="u8s8",
        ops=(("einsum", _bind(int8.einsum_kernel, "u8s8")),),
        available=functools.partial(int8.int8_kernel_available, "u8s8"),
        exact=True,
        summary="inputs shifted by +128 into uint8, XLA:CPU's u8 x s8 -> s32 dot (VNNI/AMX), minus "
                "128 x the stored column sums",
    ),
    _ffi_spec("int8", "cpu_ffi", int8.einsum_kernel, int8.int8_kernel_available, True,
              "autopolicy's own CPU kernel through the XLA FFI on the CPU's best SIMD path (AVX512-VNNI, "
              "AVX-VNNI, AVX2 or portable, chosen at run time): the weights streamed once at few rows, "
              "register-blocked GEMMs at many, on the caller and polling helper threads"),
    _ffi_spec("int8", "cpu_ffi_avx2", int8.einsum_kernel, int8.int8_kernel_available, True,
              f"{_AVX2_PATH}: its byte streams can beat the wider ones at batch 1 (a Zen 4 EPYC's decode step)"),
)

INT4_KERNEL_SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        mode="int4",
        name="xla",
        ops=(("einsum", _bind(int4.einsum_kernel, "xla")),),
        available=functools.partial(int4.int4_kernel_available, "xla"),
        exact=True,
        summary="XLA's int8 dots over the unpacked halves, one accumulator per block, then the scales",
    ),
    _ffi_spec("int4", "cpu_ffi", int4.einsum_kernel, int4.int4_kernel_available, False,
              "autopolicy's own CPU kernel through the XLA FFI: nibbles unpacked in registers, the "
              "block scales applied inside; within float32 rounding of the sum over blocks of 'xla'"),
    _ffi_spec("int4", "cpu_ffi_avx2", int4.einsum_kernel, int4.int4_kernel_available, False,
              f"{_AVX2_PATH}; as 'cpu_ffi', within float32 rounding of 'xla'"),
)

def _weight_only_specs(mode: str) -> tuple[KernelSpec, ...]:
    return (
        KernelSpec(
            mode=mode,
            name="xla",
            ops=(("einsum", _bind(weight_only.einsum_kernel, "xla")),),
            available=functools.partial(cpu_weight_only.kernel_available, "xla"),
            exact=True,
            summary="the whole kernel dequantized to the compute dtype, then XLA's float product",
        ),
        # Both run XLA's path off a CPU.
        _ffi_spec(mode, "cpu_ffi", weight_only.einsum_kernel, cpu_weight_only.kernel_available, False,
                  "autopolicy's own CPU kernel through the XLA FFI: the stored bytes read once, values "
                  "converted in registers, group scales and zero points applied per group; within float32 "
                  "rounding of 'xla' (which it falls back to for act-order g_idx and sharded operands)"),
        _ffi_spec(mode, "cpu_ffi_avx2", weight_only.einsum_kernel, cpu_weight_only.kernel_available, False,
                  f"{_AVX2_PATH} (on a Zen 4, whose AVX-512 runs as two 256-bit halves, it decoded SmolLM2 "
                  "under gptq/8 1.6x faster); as 'cpu_ffi', within float32 rounding of 'xla'"),
        KernelSpec(
            mode=mode,
            name="pallas",
            ops=(("einsum", _bind(weight_only.einsum_kernel, "pallas")),),
            available=functools.partial(cpu_weight_only.kernel_available, "pallas"),
            exact=False,
            summary="a Pallas (Triton) kernel for GPUs: the stored bytes read once in tiles, dequantized in "
                    "registers (the weights of 'xla' bit for bit), any g_idx; float32 accumulation, within "
                    "1e-5 x the norm of the exact product (float32 compute, IEEE products), 1e-2 x (bfloat16)",
            needs_gpu=True,
        ),
    )


#: The GPTQ and AWQ kernels (weight-only: float inputs).
GPTQ_KERNEL_SPECS: tuple[KernelSpec, ...] = _weight_only_specs("gptq")
AWQ_KERNEL_SPECS: tuple[KernelSpec, ...] = _weight_only_specs("awq")

FLOAT8_KERNEL_SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        mode="float8",
        name="emulated",
        ops=(("einsum", _bind(float8.einsum_kernel, "emulated")),),
        available=functools.partial(float8.float8_kernel_available, "emulated"),
        exact=True,
        summary="operands rounded to e4m3 and dequantized, then a product in the compute dtype",
    ),
    KernelSpec(
        mode="float8",
        name="fp8_dot",
        ops=(("einsum", _bind(float8.einsum_kernel, "fp8_dot")),),
        available=functools.partial(float8.float8_kernel_available, "fp8_dot"),
        exact=False,
        summary="e4m3 x e4m3 -> float32 dot, times both scales; within 1e-6 (float32 compute) and "
                "2e-3 (bfloat16) relative of the exact product, 'emulated' within 1e-6 and 1e-2",
    ),
)

def _float_op(name: str) -> Callable[..., Any]:
    def einsum(equation: str, x: Any, kernel: Any) -> Any:
        return float_dot.float_einsum(equation, x, kernel, name)

    einsum.__name__ = f"float_einsum_{name}"
    return einsum


#: The products of 16-bit float policies; their op is ``einsum(equation, x, kernel)``.
FLOAT_KERNEL_SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        mode="float",
        name="xla",
        ops=(("einsum", _float_op("xla")),),
        available=functools.partial(float_dot.float_kernel_available, "xla"),
        exact=True,
        summary="XLA's dot with its result in the compute dtype (float32 inside on XLA:CPU)",
    ),
    KernelSpec(
        mode="float",
        name="f32_accumulate",
        ops=(("einsum", _float_op("f32_accumulate")),),
        available=functools.partial(float_dot.float_kernel_available, "f32_accumulate"),
        exact=False,
        summary="the dot asked for a float32 result, rounded once to the compute dtype; equal to "
                "'xla' up to one ulp of the compute dtype (summation order)",
    ),
)

#: ``(mode, kernels)`` for every mode with more than one kernel; modes not listed have one
#: kernel, their mode's own.
MODE_KERNELS: tuple[tuple[str, tuple[KernelSpec, ...]], ...] = (
    ("int8", INT8_KERNEL_SPECS),
    ("int4", INT4_KERNEL_SPECS),
    ("float8", FLOAT8_KERNEL_SPECS),
    ("gptq", GPTQ_KERNEL_SPECS),
    ("awq", AWQ_KERNEL_SPECS),
)

_DEFAULTS: dict[str, Callable[[Device], str]] = {
    "int8": int8.default_int8_kernel,
    "int4": int4.default_int4_kernel,
    "float8": float8.default_float8_kernel,
    # "xla" for GPTQ and AWQ: the FFI kernel runs only where a measurement chose it, as int4's.
    "gptq": lambda device: "xla",
    "awq": lambda device: "xla",
}


def kernel_specs(mode: str) -> tuple[KernelSpec, ...]:
    """The kernels of ``mode``; ``()`` for a mode without a choice of kernels.

    >>> [spec.name for spec in kernel_specs("int8")]
    ['s8s8', 'u8s8', 'cpu_ffi', 'cpu_ffi_avx2']
    >>> [spec.name for spec in kernel_specs("gptq")]
    ['xla', 'cpu_ffi', 'cpu_ffi_avx2', 'pallas']
    >>> kernel_specs("float16")
    ()
    """
    if mode == "float":
        return FLOAT_KERNEL_SPECS
    return dict(MODE_KERNELS).get(mode, ())


def kernel_spec(mode: str, name: str) -> KernelSpec:
    """The kernel ``name`` of ``mode``.

    Raises:
      ValueError: naming the mode's kernels when it has none called ``name``.

    >>> kernel_spec("float8", "fp8_dot").exact
    False
    >>> kernel_spec("int8", "vnni")
    Traceback (most recent call last):
    ...
    ValueError: Invalid int8 kernel. Expected one of ('s8s8', 'u8s8', 'cpu_ffi', 'cpu_ffi_avx2'). Received: kernel='vnni'
    """
    specs = kernel_specs(mode)
    for spec in specs:
        if spec.name == name:
            return spec
    if not specs:
        raise ValueError(f"Quantization mode {mode!r} has no choice of kernels; modes with kernels: "
                         f"{tuple(m for m, _ in MODE_KERNELS)}. Received: kernel={name!r}")
    raise ValueError(f"Invalid {mode} kernel. Expected one of {tuple(s.name for s in specs)}. Received: kernel={name!r}")


def candidate_kernels(mode: str, op: str = "einsum", device: Device | None = None,
                      compute_dtype: Any = None) -> tuple[str, ...]:
    """The names of ``mode``'s kernels that run ``op`` and are worth timing on ``device`` (the
    tactics a search measures), default first.

    Args:
      mode: A quantization mode.
      op: An op of :mod:`autopolicy.numerics.modes` (``"einsum"``, ``"conv2d"``).
      device: None means :func:`~autopolicy.numerics.device.current_device`.
      compute_dtype: The compute dtype (used by ``"float"`` only).

    >>> candidate_kernels("int8", device=Device("gpu", compute_capability="9.0"))
    ('s8s8',)
    >>> candidate_kernels("float8", device=Device("gpu", compute_capability="9.0"))
    ('fp8_dot', 'emulated')
    """
    device = current_device() if device is None else device
    names = tuple(s.name for s in kernel_specs(mode) if op in s.op_names and s.available(device))
    default = default_kernel(mode, op, device, compute_dtype)
    return tuple(sorted(names, key=lambda n: n != default))


def default_kernel(mode: str, op: str = "einsum", device: Device | None = None,
                   compute_dtype: Any = None) -> str | None:
    """The kernel ``mode`` uses for ``op`` on ``device`` without a measurement (see the module
    docstring for the rules); None for a mode or op without a choice of kernels.

    Raises:
      ValueError: for ``mode="float"`` without a ``compute_dtype``.

    >>> default_kernel("int8", device=Device("cpu", cpu_features=("avx2", "fma")))
    's8s8'
    >>> default_kernel("float8", device=Device("gpu", compute_capability="8.0"))
    'emulated'
    >>> default_kernel("float", device=Device("cpu", cpu_features=("amx_bf16",)), compute_dtype="bfloat16")
    'f32_accumulate'
    """
    device = current_device() if device is None else device
    if mode == "float":
        if compute_dtype is None:
            raise ValueError("The default float kernel depends on the compute dtype: pass compute_dtype=.")
        return float_dot.default_float_kernel(compute_dtype, device) if op == "einsum" else None
    if mode not in _DEFAULTS:
        return None
    name = _DEFAULTS[mode](device)
    if op not in kernel_spec(mode, name).op_names:  # int8 conv2d: only s8s8; gather: none
        name = next((s.name for s in kernel_specs(mode) if op in s.op_names), None)
    return name


def runnable(layers: Mapping[str, Any], kernels: Mapping[str, str], source: str) -> dict[str, str]:
    """The kernel choices ``{layer path: kernel}`` this process can run, for ``layers`` (``{path:
    layer}``, layers with ``kernel_choices()``). A choice made on another machine may name a
    kernel this one lacks (``cpu_ffi`` where the CPU kernels are not built, ``cpu_ffi_avx2`` on a
    CPU without AVX2): those layers take their mode's default kernel, with one warning naming
    them (``source``: how the choices came, "saved" or "chosen"; every int8 kernel gives the same
    outputs, int4's and the weight-only ones' agree to float32 rounding). Paths ``layers`` does not
    have stay, for ``with_kernels`` to refuse."""
    dropped = {p: k for p, k in kernels.items()
               if p in layers and hasattr(layers[p], "kernel_choices") and k not in layers[p].kernel_choices()}
    if dropped:
        names = sorted(set(dropped.values()))
        _log.warning("autopolicy: %d layer(s) were %s with kernels this process cannot run (%s, e.g. %r); "
                     "they run their mode's default kernel here.", len(dropped), source, ", ".join(names),
                     next(iter(dropped)))
    return {p: k for p, k in kernels.items() if p not in dropped}
