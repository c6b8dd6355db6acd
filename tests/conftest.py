"""A strict numerics harness: warnings are errors (pyproject), silent upcasts fail, no global
policy leaks from one test into another.

Set up before JAX is imported, for a fast run under pytest-xdist (``-n auto``):

- each worker caps XLA's intra-op threads at its share of the cores, but at no fewer than 2
  (``max(2, os.cpu_count() // workers)``), so workers on many cores do not fight over them;
  ``XLA_FLAGS`` already naming ``intra_op_parallelism_threads`` is left as it is. CLI tests'
  subprocesses inherit the cap.
- XLA compiles at backend optimisation level 0 (``--xla_backend_optimization_level=0``; LLVM's
  code generation without its optimisations), unless ``XLA_FLAGS`` already names the level:
  compiling is most of the suite's time (backend compilation 55% of the fast tier's, measured with
  ``jax.monitoring``), and level 0 compiles in 20-40% less. The tests' numerics do not depend on
  it, except where a test equals a fused kernel's float epilogue bit for bit: level 0 forms no
  fused multiply-adds, so those references compile at level 3, XLA's default, as users run them.
- XLA's CPU fusions are emitted by its older LLVM IR emitters, not the MLIR fusion emitters
  (``--xla_cpu_use_fusion_emitters=false``, where the installed XLA has the flag and ``XLA_FLAGS``
  does not name it): these build an MLIR context and pass pipeline per fusion, and the fast tier
  took 38% less CPU time without them (fresh caches, the 2-core Xeon with AVX-512 and AMX:
  248-272 s -> 153-166 s; pytest's wall time 137-150 s -> 85-92 s), every test passing. The
  bit-exact references compile with the fusion emitters, as users run them.
- JAX's persistent compilation cache is on for the run, in the git-ignored ``.cache/jax-tests``
  (override with ``AUTOPOLICY_TEST_JAX_CACHE``; an empty value turns it off), with no minimum
  compile time, so a second run reuses the first one's compilations.
- Off a CPU backend (a GPU machine), float32 dots run at full precision
  (``jax_default_matmul_precision="highest"``), as the tests' references assume.
- autopolicy's machine-wide cache (``AUTOPOLICY_CACHE``: trained example weights, shared
  measurements) is the git-ignored ``.cache/autopolicy-tests``, so tests never read or write the
  user's ``~/.cache/autopolicy``.
"""

import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "jax")


def _cap_xla_threads() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if workers <= 1 or "intra_op_parallelism_threads" in flags:
        return
    # At most 2x oversubscribed: on 2 cores, 2 workers of 2 threads each ran heavy test files
    # 0-8% faster than 2 workers of 1 thread (compiles and Python leave cores idle), and 25-35%
    # faster than one process.
    threads = max(2, (os.cpu_count() or 1) // workers)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={threads}".strip()


def _fast_compiles() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} --xla_backend_optimization_level=0".strip()
    if "xla_cpu_use_fusion_emitters" not in flags and _xla_knows("xla_cpu_use_fusion_emitters"):
        flags = f"{flags} --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = flags


def _xla_knows(flag: str) -> bool:
    """Whether the installed XLA has ``flag`` (an unknown flag in ``XLA_FLAGS`` aborts the
    process): its name is in the library that parses them (read mapped, not loaded: ~30 ms), and
    no PJRT plugin is installed (``jax_plugins``): a GPU plugin's XLA parses the same variable, and
    on an H200 machine it rejected this CPU flag although jaxlib's library names it, aborting
    every test process."""
    import importlib.util  # pylint: disable=import-outside-toplevel
    import mmap  # pylint: disable=import-outside-toplevel

    plugins = importlib.util.find_spec("jax_plugins")
    if plugins is not None and any(pathlib.Path(p).is_dir() and any(pathlib.Path(p).iterdir())
                                   for p in plugins.submodule_search_locations or []):
        return False
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    for library in pathlib.Path(spec.submodule_search_locations[0]).glob("*.so"):
        try:
            with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(flag.encode()) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def _persistent_compilation_cache() -> None:
    cache = os.environ.get("AUTOPOLICY_TEST_JAX_CACHE",
                           str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax-tests"))
    if cache:  # environment, not jax.config: the CLI tests' subprocesses share the cache too
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _machine_cache() -> None:
    repo = pathlib.Path(__file__).resolve().parent.parent
    os.environ.setdefault("AUTOPOLICY_CACHE", str(repo / ".cache" / "autopolicy-tests"))


_cap_xla_threads()
_fast_compiles()
_persistent_compilation_cache()
_machine_cache()

import jax  # noqa: E402
import pytest  # noqa: E402

import autopolicy as ap  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
if jax.default_backend() != "cpu":
    # The tests' float32 references assume float32 products; a GPU's default rounds the operands
    # of float32 dots to TF32 (10-bit mantissas; an H200 missed 1e-6 tolerances by 2.6e-4).
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _no_leaked_global_policy():
    assert ap.dtype_policy() == ap.DTypePolicy("float32"), "a previous test leaked a global policy"
    yield
    leaked = ap.dtype_policy()
    ap.set_dtype_policy("float32")
    assert leaked == ap.DTypePolicy("float32"), f"the test leaked the global policy {leaked!r}"
