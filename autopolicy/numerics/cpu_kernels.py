"""autopolicy's own CPU kernels, called through the XLA FFI: int8 x int8 -> int32 products
against the package's int8 and packed int4 weights, where XLA's own are slower than float32.

The C++ (``autopolicy/numerics/cpu/``) is built by ``pip install -e .`` into one shared library
beside it; its instruction-set path (:data:`PATHS`: AVX512-VNNI, AVX-VNNI, AVX2, or the portable
reference) is chosen when it loads, from the CPU's features, never at build time.
:func:`int8_matmul` and :func:`int4_matmul` take int8 inputs quantized by the caller;
:func:`int8_dense` and :func:`int4_dense` (what the layers call) take the float input and do the
whole layer in one call: the per-row quantization, the integer product, the rescale and an
optional bias, each in the same float32 operations as the package's XLA path, so the outputs
equal it bit for bit. At batch 1 on small layers the separate XLA ops around the call cost as
much as the product. :func:`int8_dense_group` and :func:`int4_dense_group` do several such
layers of one input in one call (a decoder's query, key and value). Work is split over as many threads as XLA's intra-op pool has (or
:func:`set_threads` names): the calling thread and the library's own helpers, which poll for the next call
for :func:`spin_us` microseconds before they sleep (or XLA's pool itself, with
``set_spin_us(0)``, and for calls whose x has :func:`pool_min_values` values or more); calls
whose weights are below :func:`serial_max_bytes` run on the calling thread alone.

Without the library (no compiler at install, or ``AUTOPOLICY_DISABLE_CPU_KERNELS=1``) nothing
fails: :data:`AVAILABLE` is False, :func:`unavailable_reason` says why, and the search times the
XLA kernels only (one notice on the ``autopolicy`` logger names why).

>>> import jax.numpy as jnp
>>> if AVAILABLE and jax.default_backend() == "cpu":  # the accumulators of [[1, -2]] @ [[3], [4]]
...     assert int(int8_matmul(jnp.array([[1, -2]], jnp.int8), jnp.array([[3], [4]], jnp.int8))[0, 0]) == -5
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os

import jax
import jax.numpy as jnp

__all__ = ["AVAILABLE", "DISABLE_ENV", "unavailable_reason", "library_path", "path", "set_path",
           "supported_paths", "PATHS", "gemm_min_rows", "set_gemm_min_rows", "serial_max_bytes",
           "set_serial_max_bytes", "spin_us", "set_spin_us", "pool_min_values", "set_pool_min_values",
           "POOL_MIN_VALUES_DEFAULT", "threads", "set_threads", "int8_matmul", "int4_matmul",
           "int8_dense", "int4_dense", "int8_dense_group", "int4_dense_group", "decode_attention", "DENSE_DTYPES",
           "notice_once", "FFI_KERNELS", "kernel_path", "kernel_distinct_on"]

#: Set to 1 to leave the kernels out (as on a machine without a compiler).
DISABLE_ENV = "AUTOPOLICY_DISABLE_CPU_KERNELS"
#: The instruction-set paths, best first.
PATHS = ("avx512_vnni", "avx_vnni", "avx2", "portable")
_INT8_TARGET, _INT4_TARGET = "autopolicy_int8_matmul", "autopolicy_int4_matmul"
_INT8_DENSE, _INT4_DENSE = "autopolicy_int8_dense", "autopolicy_int4_dense"
_INT8_GROUP, _INT4_GROUP = "autopolicy_int8_dense_group", "autopolicy_int4_dense_group"
_DECODE_ATTENTION = "autopolicy_decode_attention"
#: The float dtypes :func:`int8_dense` and :func:`int4_dense` take and return.
DENSE_DTYPES = ("float32", "bfloat16")

#: The int8 and int4 kernel names (tactics) that run this library, and the SIMD path each asks
#: for: ``"cpu_ffi"`` the one in use (:func:`path`: the CPU's best), ``"cpu_ffi_avx2"`` the AVX2
#: path on a CPU whose best is another (AVX-512 or AVX-VNNI). Neither is assumed faster: on a
#: 2-core Zen 4 EPYC (AVX-512 VNNI) the AVX2 streams ran a SmolLM2-135M decode step faster than
#: the VNNI ones, its 576 x 192 layers slower; the search times both per layer and shape.
FFI_KERNELS = {"cpu_ffi": "", "cpu_ffi_avx2": "avx2"}

_log = logging.getLogger("autopolicy")


def library_path() -> str | None:
    """The built library's file, or None when the install built none."""
    here = os.path.join(os.path.dirname(__file__), "cpu")
    found = sorted(glob.glob(os.path.join(here, "_autopolicy_cpu*.so")))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def _build_digest(file: str, size: int, mtime_ns: int) -> str:  # pylint: disable=unused-argument
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def build_id() -> str | None:
    """A short hash of the built library's bytes (None without one): measurements of one build's
    kernels are not another's, so the tuner's cache keys carry it (``hardware.fingerprint``)."""
    file = library_path()
    if file is None:
        return None
    stat = os.stat(file)
    return _build_digest(file, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None, f"{DISABLE_ENV} is set"
    file = library_path()
    if file is None:
        return None, ("the C++ kernels were not built at install (no C++ compiler, or the build failed: "
                      "reinstall with `pip install -e . -v` to see why)")
    try:
        lib = ctypes.CDLL(file)
        for target, symbol in ((_INT8_TARGET, lib.AutopolicyInt8Matmul), (_INT4_TARGET, lib.AutopolicyInt4Matmul),
                               (_INT8_DENSE, lib.AutopolicyInt8Dense), (_INT4_DENSE, lib.AutopolicyInt4Dense),
                               (_INT8_GROUP, lib.AutopolicyInt8DenseGroup), (_INT4_GROUP, lib.AutopolicyInt4DenseGroup),
                               (_DECODE_ATTENTION, lib.AutopolicyDecodeAttention)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
        lib.autopolicy_cpu_path.restype = ctypes.c_char_p
        lib.autopolicy_cpu_set_path.argtypes = lib.autopolicy_cpu_path_supported.argtypes = [ctypes.c_char_p]
        lib.autopolicy_cpu_gemm_min_rows.restype = ctypes.c_int64
        lib.autopolicy_cpu_gemm_min_rows.argtypes = [ctypes.c_int]
        lib.autopolicy_cpu_set_gemm_min_rows.argtypes = [ctypes.c_int64]
        lib.autopolicy_cpu_serial_max_bytes.restype = ctypes.c_int64
        lib.autopolicy_cpu_set_serial_max_bytes.argtypes = [ctypes.c_int64]
        lib.autopolicy_cpu_spin_us.restype = ctypes.c_int64
        lib.autopolicy_cpu_set_spin_us.argtypes = [ctypes.c_int64]
        lib.autopolicy_cpu_pool_min_values.restype = ctypes.c_int64
        lib.autopolicy_cpu_set_pool_min_values.argtypes = [ctypes.c_int64]
        lib.autopolicy_cpu_threads.restype = ctypes.c_int64
        lib.autopolicy_cpu_set_threads.argtypes = [ctypes.c_int64]
    except (OSError, AttributeError) as e:
        return None, f"{os.path.basename(file)} failed to load: {e}"
    return lib, None


AVAILABLE = _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernels are not available, or None when they are."""
    return _load()[1]


@functools.lru_cache(maxsize=None)
def notice_once() -> None:
    """Logs, once per process, that the search keeps to XLA kernels and why."""
    if not AVAILABLE:
        _log.warning("autopolicy: the CPU kernels are not available (%s); the XLA kernels are used.",
                     unavailable_reason())


def on_cpu(kernel, fallback, *args):
    """``kernel(*args)`` where the program is lowered for a CPU, else ``fallback(*args)`` (XLA ops
    giving the same values): the FFI targets are registered for CPUs only, so an op asked for
    ``kernel="cpu_ffi"`` on a GPU runs its XLA path instead of failing to compile there. Both are
    traced; only the lowering platform's is lowered (``jax.lax.platform_dependent``), so a CPU
    program holds the FFI call alone.
    """
    return jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)


def _lib() -> ctypes.CDLL:
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"autopolicy's CPU kernels are not available: {reason}.")
    return lib


def path() -> str:
    """The instruction-set path the kernels run (one of :data:`PATHS`)."""
    return _lib().autopolicy_cpu_path().decode()


def supported_paths() -> tuple[str, ...]:
    """The paths this CPU can run, best first."""
    lib = _lib()
    return tuple(p for p in PATHS if lib.autopolicy_cpu_path_supported(p.encode()))


def set_path(name: str) -> None:
    """Makes the kernels run ``name`` (for tests and benchmarks; ``AUTOPOLICY_CPU_PATH`` sets it
    at load). Programs compiled before still call the same library, so the change is immediate.

    Raises:
      ValueError: for a path that is unknown or that this CPU cannot run.
    """
    supported = supported_paths()
    if name not in supported:
        raise ValueError(f"Invalid CPU kernel path. Expected one of {supported} (on this CPU). Received: {name!r}")
    _lib().autopolicy_cpu_set_path(name.encode())


def kernel_path(kernel: str) -> str:
    """The SIMD path the FFI kernel ``kernel`` (one of :data:`FFI_KERNELS`) asks for: ``""`` (the
    one in use) or a path's name.

    Raises:
      ValueError: for a name that is not an FFI kernel, or a path this CPU cannot run.
    """
    if kernel not in FFI_KERNELS:
        raise ValueError(f"Invalid CPU kernel. Expected one of {tuple(FFI_KERNELS)}. Received: {kernel!r}")
    name = FFI_KERNELS[kernel]
    if name and name not in supported_paths():
        raise ValueError(f"The kernel {kernel!r} runs the {name} path, which this CPU cannot: it runs "
                         f"{supported_paths()}. Use kernel='cpu_ffi'.")
    return name


#: The CPU features (:class:`~autopolicy.numerics.device.Device` names) each SIMD path needs.
_PATH_FEATURES = {"avx512_vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"},
                  "avx_vnni": {"avx2", "fma", "avx_vnni"}, "avx2": {"avx2", "fma"}}


def kernel_distinct_on(kernel: str, cpu_features) -> bool:
    """Whether the FFI kernel ``kernel`` runs code of its own on a CPU with ``cpu_features``: the
    library loaded, and for a named path one this library and that CPU run but not the CPU's best
    (which ``"cpu_ffi"`` already runs: timing the same code twice only adds noise to a search).

    >>> kernel_distinct_on("cpu_ffi_avx2", ("avx2", "fma"))  # AVX2 is that CPU's best path
    False
    """
    if kernel not in FFI_KERNELS:
        raise ValueError(f"Invalid CPU kernel. Expected one of {tuple(FFI_KERNELS)}. Received: {kernel!r}")
    if not AVAILABLE:
        return False
    name = FFI_KERNELS[kernel]
    if not name:
        return True
    features = set(cpu_features)
    runs = [p for p in PATHS if p in _PATH_FEATURES and _PATH_FEATURES[p] <= features]
    return name in runs and runs[0] != name and name in supported_paths()


def _path_attr(simd_path: str) -> str:
    if simd_path and simd_path not in supported_paths():
        raise ValueError(f"Invalid CPU kernel path. Expected '' (the one in use) or one of {supported_paths()} "
                         f"(on this CPU). Received: {simd_path!r}")
    return simd_path


def gemm_min_rows(kind: str = "int8") -> int | None:
    """The fewest rows of x (the batch M) for which the ``kind`` (``"int8"`` or ``"int4"``) product
    runs the register-blocked GEMM of the current path (:func:`path`); below it, the
    streaming kernels. None: never (the portable path has no GEMM). Measured defaults: AVX2 int8
    16 rows, int4 24; AVX-VNNI int8 8 rows, int4 16; AVX512-VNNI 16 rows, int8 and int4."""
    if kind not in ("int8", "int4"):
        raise ValueError(f"Invalid kind. Expected one of ('int8', 'int4'). Received: {kind!r}")
    rows = int(_lib().autopolicy_cpu_gemm_min_rows(int(kind == "int4")))
    return None if rows >= 2**63 - 1 else rows


def set_gemm_min_rows(rows: int | None) -> None:
    """Sets :func:`gemm_min_rows` of both kinds to ``rows`` (tests and benchmarks;
    ``AUTOPOLICY_CPU_GEMM_MIN_ROWS`` sets it at load); None restores the measured defaults. Takes
    effect at once, compiled programs included."""
    _lib().autopolicy_cpu_set_gemm_min_rows(0 if rows is None else max(1, int(rows)))


def serial_max_bytes() -> int:
    """The work below which a call runs on the calling thread alone: weight bytes (int4: packed)
    times rows of x. Above it the columns (or K slabs, or tiles) are split over the helper threads;
    below it, handing a share to another thread costs more than the share."""
    return int(_lib().autopolicy_cpu_serial_max_bytes())


def set_serial_max_bytes(nbytes: int | None) -> None:
    """Sets :func:`serial_max_bytes` (tests and benchmarks; ``AUTOPOLICY_CPU_SERIAL_BYTES`` sets
    it at load); 0 splits every call that can be split, None restores the measured default.
    Takes effect at once, compiled programs included.

    Raises:
      ValueError: for a negative ``nbytes``.
    """
    if nbytes is not None and int(nbytes) < 0:
        raise ValueError(f"nbytes must be >= 0 (or None for the default). Received: nbytes={nbytes!r}")
    _lib().autopolicy_cpu_set_serial_max_bytes(-1 if nbytes is None else int(nbytes))


def spin_us() -> int:
    """How long (microseconds) the kernels' own helper threads poll for the next call after each
    one before they sleep. A decoder calls a kernel per layer, tens of microseconds apart, with
    XLA's own ops between; a helper still polling takes its share at once, where a sleeping thread
    of XLA's pool took 50 us to wake on a 2-core VM. 0: no helpers of ours, XLA's pool as before."""
    return int(_lib().autopolicy_cpu_spin_us())


def set_spin_us(us: int | None) -> None:
    """Sets :func:`spin_us` (``AUTOPOLICY_CPU_SPIN_US`` sets it at load); 0 hands the calls' tasks
    to XLA's pool instead, None restores the default. Takes effect at once, compiled programs
    included.

    Raises:
      ValueError: for a negative ``us``.
    """
    if us is not None and int(us) < 0:
        raise ValueError(f"us must be >= 0 (or None for the default). Received: us={us!r}")
    _lib().autopolicy_cpu_set_spin_us(-1 if us is None else int(us))


# The library's default for pool_min_values (dispatch.cc's kPoolMinValues): 256 rows of 576.
POOL_MIN_VALUES_DEFAULT = 1 << 17


def pool_min_values() -> int:
    """The size of x (rows times K) from which a call hands its tasks to XLA's intra-op pool
    rather than to the kernels' own helpers: XLA splits the fusions that make such an x over its
    pool, so its threads are awake when the call starts, and on a 2-core VM a helper of ours
    beside them took its share late (at 256 and 512 rows the calls ran 1.02-1.30x faster on the
    pool in the search's timing loop: ``benchmarks/bench_cpu_pool.py``)."""
    return int(_lib().autopolicy_cpu_pool_min_values())


def set_pool_min_values(values: int | None) -> None:
    """Sets :func:`pool_min_values` (``AUTOPOLICY_CPU_POOL_VALUES`` sets it at load); 0 sends
    every call's tasks to XLA's pool, None restores the measured default. Takes effect at once,
    compiled programs included.

    Raises:
      ValueError: for a negative ``values``.
    """
    if values is not None and int(values) < 0:
        raise ValueError(f"values must be >= 0 (or None for the default). Received: values={values!r}")
    _lib().autopolicy_cpu_set_pool_min_values(-1 if values is None else int(values))


def threads() -> int | None:
    """The threads each kernel call splits its work for, where set (``set_threads`` or
    ``AUTOPOLICY_CPU_THREADS``); None: as many as XLA's intra-op pool has, the default."""
    n = int(_lib().autopolicy_cpu_threads())
    return n or None


def set_threads(n: int | None) -> None:
    """Has every kernel call split its work for ``n`` threads (``AUTOPOLICY_CPU_THREADS`` sets it
    at load), fewer or more than XLA's pool has: 1 keeps each call on the calling thread, and a
    count above the machine's cores splits the work as such a machine would (the threads there
    are take its tasks; tests use it). None restores the pool's count. Takes effect at once,
    compiled programs included.

    Raises:
      ValueError: for ``n`` < 1.
    """
    if n is not None and int(n) < 1:
        raise ValueError(f"n must be >= 1 (or None for XLA's pool's thread count). Received: n={n!r}")
    _lib().autopolicy_cpu_set_threads(0 if n is None else int(n))


def _check(x: jax.Array, w: jax.Array, w_dtype: str, what: str) -> None:
    if x.ndim != 2 or x.dtype != jnp.int8:
        raise ValueError(f"{what}: x must be a 2-D int8 array. Received: {x.dtype}{list(x.shape)}")
    if w.ndim != 2 or w.dtype != jnp.dtype(w_dtype):
        raise ValueError(f"{what}: the kernel must be a 2-D {w_dtype} array. Received: {w.dtype}{list(w.shape)}")


def int8_matmul(x: jax.Array, w: jax.Array, simd_path: str = "") -> jax.Array:
    """``x @ w`` accumulated in int32, for int8 ``x: (M, K)`` and ``w: (K, N)``, on the SIMD path
    ``simd_path`` (``""``: the one in use, :func:`path`; else one of :func:`supported_paths`).

    Raises:
      ValueError: for operands of other ranks, dtypes or mismatched ``K``, or a path this CPU
        cannot run.
      RuntimeError: when the kernels are not available (see :func:`unavailable_reason`).
    """
    _check(x, w, "int8", "int8_matmul")
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"int8_matmul: x is (M, {x.shape[1]}) but the kernel has {w.shape[0]} rows.")
    _lib()
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.int32)
    return jax.ffi.ffi_call(_INT8_TARGET, out)(x, w, path=_path_attr(simd_path))


def int4_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, block: int, simd_path: str = "") -> jax.Array:
    """``sum_g float(acc_g) * scale[g]`` ``(M, N)`` float32: the per-block int32 accumulators of
    int8 ``x: (M, K)`` times the int4 kernel packed as :func:`autopolicy.numerics.int4.pack_int4`
    does (``(ceil(K/2), N)`` uint8), each times its block's scales ``scale: (G, N)``, with
    ``G = ceil(K / block)`` blocks of ``block`` rows (``block = K``: one, per channel), on the
    SIMD path ``simd_path`` (as :func:`int8_matmul`).

    Raises:
      ValueError: for operands of other ranks or dtypes, a packed kernel of the wrong height, a
        scale of the wrong shape, or a block outside ``[1, K]``.
    """
    _check(x, packed, "uint8", "int4_matmul")
    k, n = x.shape[1], packed.shape[1]
    if packed.shape[0] != (k + 1) // 2:
        raise ValueError(f"int4_matmul: x is (M, {k}), so the packed kernel needs {(k + 1) // 2} rows; "
                         f"it has {packed.shape[0]}.")
    if not 1 <= block <= k:
        raise ValueError(f"int4_matmul: block must be in [1, {k}]. Received: block={block}")
    groups = -(-k // block)
    if tuple(scale.shape) != (groups, n) or scale.dtype != jnp.float32:
        raise ValueError(f"int4_matmul: the scale must be float32 ({groups}, {n}). Received: "
                         f"{scale.dtype}{list(scale.shape)}")
    _lib()
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(_INT4_TARGET, out)(x, packed, scale, block=int(block), path=_path_attr(simd_path))


def _dense_operands(what: str, x: jax.Array, n: int, bias: jax.Array | None, out_dtype) -> tuple:
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if x.ndim != 2 or x.dtype.name not in DENSE_DTYPES:
        raise ValueError(f"{what}: x must be a 2-D array of one of {DENSE_DTYPES}. Received: {x.dtype}{list(x.shape)}")
    if out_dtype.name not in DENSE_DTYPES:
        raise ValueError(f"{what}: out_dtype must be one of {DENSE_DTYPES}. Received: out_dtype={out_dtype.name!r}")
    if bias is None:
        bias = jnp.zeros((0,), out_dtype)
    elif bias.shape != (n,) or bias.dtype != out_dtype:
        raise ValueError(f"{what}: the bias must be ({n},) {out_dtype.name} (the output's dtype). Received: "
                         f"{bias.dtype}{list(bias.shape)}")
    return bias, jax.ShapeDtypeStruct((x.shape[0], n), out_dtype)


def int8_dense(x: jax.Array, w: jax.Array, w_scale: jax.Array, bias: jax.Array | None = None,
               out_dtype=None, simd_path: str = "") -> jax.Array:
    """The int8 layer in one call: ``x: (M, K)`` (float32 or bfloat16) quantized per row as
    :func:`autopolicy.numerics.int8.quantize_symmetric` does, times the int8 kernel ``w: (K, N)``
    in int32, rescaled ``float(acc) * (x_scale * w_scale)`` with ``w_scale: (N,)`` (or ``(1, N)``)
    float32, rounded to ``out_dtype`` (default: x's), plus ``bias: (N,)`` in ``out_dtype`` if given.
    Equal bit for bit to the package's XLA path (:func:`autopolicy.numerics.int8.int8_dense`
    followed by ``+ bias``). ``simd_path`` as :func:`int8_matmul`.

    Raises:
      ValueError: for operands of other ranks, dtypes or shapes, or a path this CPU cannot run.

    >>> import numpy as np
    >>> # x = [1, -2] quantizes to [64, -127] (scale 2/127); the kernel's scale 0.5
    >>> if AVAILABLE and jax.default_backend() == "cpu":
    ...     y = int8_dense(jnp.array([[1.0, -2.0]]), jnp.array([[2], [127]], jnp.int8), jnp.array([0.5]))
    ...     assert np.isclose(float(y[0, 0]), (64 * 2 - 127 * 127) * (2 / 127) * 0.5)
    """
    if w.ndim != 2 or w.dtype != jnp.int8 or x.ndim != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"int8_dense: x must be (M, K) and the kernel (K, N) int8. Received: x {list(x.shape)}, "
                         f"kernel {w.dtype}{list(w.shape)}")
    n = w.shape[1]
    if w_scale.size != n or w_scale.dtype != jnp.float32:
        raise ValueError(f"int8_dense: the kernel scale must be float32 with {n} values. Received: "
                         f"{w_scale.dtype}{list(w_scale.shape)}")
    bias, out = _dense_operands("int8_dense", x, n, bias, out_dtype)
    _lib()
    return jax.ffi.ffi_call(_INT8_DENSE, out)(x, w, w_scale.reshape((n,)), bias, path=_path_attr(simd_path))


def int4_dense(x: jax.Array, packed: jax.Array, scale: jax.Array, block: int, bias: jax.Array | None = None,
               out_dtype=None, simd_path: str = "") -> jax.Array:
    """The int4 layer in one call: ``x: (M, K)`` (float32 or bfloat16) quantized per row, times the
    packed int4 kernel (as :func:`int4_matmul`), ``y = sum_g float(acc_g) * scale[g]`` times x's
    row scale, rounded to ``out_dtype`` (default: x's), plus ``bias: (N,)`` in ``out_dtype`` if
    given. Equal to :func:`autopolicy.numerics.int4.int4_matmul` with ``kernel="cpu_ffi"`` bit for
    bit (to float32 rounding of the sum over blocks against ``kernel="xla"``). ``simd_path`` as
    :func:`int8_matmul`.

    Raises:
      ValueError: for operands of other ranks, dtypes or shapes, a block outside ``[1, K]``, or a
        path this CPU cannot run.
    """
    if x.ndim != 2 or packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(f"int4_dense: x must be (M, K) and the packed kernel (ceil(K/2), N) uint8. Received: "
                         f"x {list(x.shape)}, kernel {packed.dtype}{list(packed.shape)}")
    k, n = x.shape[1], packed.shape[1]
    if packed.shape[0] != (k + 1) // 2:
        raise ValueError(f"int4_dense: x is (M, {k}), so the packed kernel needs {(k + 1) // 2} rows; "
                         f"it has {packed.shape[0]}.")
    if not 1 <= block <= k:
        raise ValueError(f"int4_dense: block must be in [1, {k}]. Received: block={block}")
    groups = -(-k // block)
    if tuple(scale.shape) != (groups, n) or scale.dtype != jnp.float32:
        raise ValueError(f"int4_dense: the scale must be float32 ({groups}, {n}). Received: "
                         f"{scale.dtype}{list(scale.shape)}")
    bias, out = _dense_operands("int4_dense", x, n, bias, out_dtype)
    _lib()
    return jax.ffi.ffi_call(_INT4_DENSE, out)(x, packed, scale, bias, block=int(block), path=_path_attr(simd_path))


def _group_dtype(what: str, x: jax.Array, out_dtype) -> jnp.dtype:
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if x.ndim != 2 or x.dtype.name not in DENSE_DTYPES:
        raise ValueError(f"{what}: x must be a 2-D array of one of {DENSE_DTYPES}. Received: {x.dtype}{list(x.shape)}")
    if out_dtype.name not in DENSE_DTYPES:
        raise ValueError(f"{what}: out_dtype must be one of {DENSE_DTYPES}. Received: out_dtype={out_dtype.name!r}")
    return out_dtype


def int8_dense_group(x: jax.Array, kernels, out_dtype=None, simd_path: str = "") -> tuple[jax.Array, ...]:
    """Several int8 layers of one input in one call: for each ``(w, w_scale)`` of ``kernels`` (int8
    ``(K, N_i)`` and float32 ``N_i`` values), what :func:`int8_dense` returns without a bias, equal
    to it bit for bit. ``x`` is quantized once, and the threads share one set of tasks over every
    product's columns: a decoder's query, key and value projections (or its gate and up) cost one
    call instead of three (or two).

    Raises:
      ValueError: for no kernels, or operands as :func:`int8_dense` refuses them (naming which).
    """
    out_dtype = _group_dtype("int8_dense_group", x, out_dtype)
    kernels = tuple(kernels)
    if not kernels:
        raise ValueError("int8_dense_group: needs at least one (kernel, scale) pair. Received none.")
    operands, outs = [], []
    for i, (w, w_scale) in enumerate(kernels):
        if w.ndim != 2 or w.dtype != jnp.int8 or w.shape[0] != x.shape[1]:
            raise ValueError(f"int8_dense_group: kernel {i} must be ({x.shape[1]}, N) int8. Received: "
                             f"{w.dtype}{list(w.shape)}")
        if w_scale.size != w.shape[1] or w_scale.dtype != jnp.float32:
            raise ValueError(f"int8_dense_group: the scale of kernel {i} must be float32 with {w.shape[1]} values. "
                             f"Received: {w_scale.dtype}{list(w_scale.shape)}")
        operands += [w, w_scale.reshape((w.shape[1],))]
        outs.append(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), out_dtype))
    _lib()
    return tuple(jax.ffi.ffi_call(_INT8_GROUP, outs)(x, *operands, path=_path_attr(simd_path)))


def int4_dense_group(x: jax.Array, kernels, block: int, out_dtype=None, simd_path: str = "") -> tuple[jax.Array, ...]:
    """Several int4 layers of one input in one call: for each ``(packed, scale)`` of ``kernels``
    (as :func:`int4_dense` takes them, all with blocks of ``block`` rows), what :func:`int4_dense`
    returns without a bias, equal to it bit for bit; one call, as :func:`int8_dense_group`.

    Raises:
      ValueError: for no kernels, a block outside ``[1, K]``, or operands as :func:`int4_dense`
        refuses them (naming which).
    """
    out_dtype = _group_dtype("int4_dense_group", x, out_dtype)
    kernels = tuple(kernels)
    if not kernels:
        raise ValueError("int4_dense_group: needs at least one (packed kernel, scale) pair. Received none.")
    k = x.shape[1]
    if not 1 <= block <= k:
        raise ValueError(f"int4_dense_group: block must be in [1, {k}]. Received: block={block}")
    groups = -(-k // block)
    operands, outs = [], []
    for i, (packed, scale) in enumerate(kernels):
        if packed.ndim != 2 or packed.dtype != jnp.uint8 or packed.shape[0] != (k + 1) // 2:
            raise ValueError(f"int4_dense_group: kernel {i} must be ({(k + 1) // 2}, N) uint8 (packed int4 for "
                             f"K = {k}). Received: {packed.dtype}{list(packed.shape)}")
        n = packed.shape[1]
        if tuple(scale.shape) != (groups, n) or scale.dtype != jnp.float32:
            raise ValueError(f"int4_dense_group: the scale of kernel {i} must be float32 ({groups}, {n}). "
                             f"Received: {scale.dtype}{list(scale.shape)}")
        operands += [packed, scale]
        outs.append(jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    _lib()
    return tuple(jax.ffi.ffi_call(_INT4_GROUP, outs)(x, *operands, block=int(block), path=_path_attr(simd_path)))


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, position: jax.Array) -> jax.Array:
    """One decode step of grouped-query attention over a float32 key/value cache in one call:
    ``q: (batch, kv_heads, groups, head_dim)`` (already scaled by ``1/sqrt(head_dim)``), ``keys:
    (batch, kv_heads, head_dim, max_length)``, ``values: (batch, kv_heads, max_length, head_dim)``
    (:class:`autopolicy.nn.llama`'s cache layouts), ``position``: the int32 index of the newest
    cached entry; entries past it are left out. Returns ``softmax(q @ keys[..., :position + 1]) @
    values[:, :, :position + 1]``, ``(batch, kv_heads, groups, head_dim)`` float32, equal to the
    XLA ops within float32 rounding (the exponentials and the order of the sums differ).

    Raises:
      ValueError: for shapes that disagree or a head_dim over 256 (at trace time); the call fails
        for a position outside the cache.
    """
    if q.ndim != 4 or keys.ndim != 4 or values.ndim != 4:
        raise ValueError(f"decode_attention: q, keys and values must be 4-D. Received: {q.shape}, {keys.shape}, "
                         f"{values.shape}")
    b, h, g, d = q.shape
    length = keys.shape[-1]
    if keys.shape != (b, h, d, length) or values.shape != (b, h, length, d):
        raise ValueError(f"decode_attention: for q {q.shape} the keys must be {(b, h, d, 'max_length')} and the "
                         f"values {(b, h, 'max_length', d)}. Received: {keys.shape}, {values.shape}")
    if d > 256:
        raise ValueError(f"decode_attention: head_dim must be at most 256. Received: {d}")
    if not all(a.dtype == jnp.float32 for a in (q, keys, values)):
        raise ValueError(f"decode_attention: q, keys and values must be float32. Received: {q.dtype}, "
                         f"{keys.dtype}, {values.dtype}")
    _lib()
    pos = jnp.asarray(position, jnp.int32).reshape((1,))
    return jax.ffi.ffi_call(_DECODE_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, keys, values, pos)
