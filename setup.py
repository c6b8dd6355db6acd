"""Builds autopolicy's CPU kernels (autopolicy/numerics/cpu/*.cc) into one shared library that
autopolicy.numerics.cpu_kernels loads with ctypes and registers with the XLA FFI.

The build is optional: without a C++ compiler (or with the XLA FFI headers missing) the install
still succeeds, with a warning, and the package runs on its XLA kernels. The instruction-set
paths are all compiled in and chosen at run time from the CPU's features, so one build runs on
any x86-64 CPU.
"""

import concurrent.futures
import glob
import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = sorted(glob.glob(os.path.join("autopolicy", "numerics", "cpu", "*.cc")))
# The headers too: a header changed alone must rebuild the library (build_ext compares these and
# the sources with the built file, and skips the build when none is newer).
HEADERS = sorted(glob.glob(os.path.join("autopolicy", "numerics", "cpu", "*.h")))


def _ffi_include() -> str | None:
    """The XLA FFI headers shipped by jaxlib (what jax.ffi.include_dir() returns)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return include if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")) else None


def _compile_in_parallel(compiler) -> None:
    """Has ``compiler.compile`` compile the sources of one extension on one thread per core (the
    C++ build is most of a fresh install's own time; build_ext compiles them one by one). Through
    distutils' compile steps (_setup_compile, _get_cc_args, _compile); where a compiler lacks them,
    or anything in them fails, the serial compile runs instead."""
    serial = compiler.compile

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                extra_postargs=None, depends=None):
        try:
            macros_, objects, postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        except Exception:  # noqa: BLE001
            return serial(sources, output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs, depends)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, postargs, pp_opts)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(one, [o for o in objects if o in build]))
        return objects

    compiler.compile = compile


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: the kernels are an optimization."""

    def build_extension(self, ext):
        include = _ffi_include()
        if include is None:
            self.warn("autopolicy: the XLA FFI headers (jaxlib/include) were not found; the CPU kernels are "
                      "not built and the XLA kernels will be used")
            return
        ext.include_dirs.append(include)
        _compile_in_parallel(self.compiler)
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 (no compiler, a failed compile: the XLA paths stay)
            self.warn(f"autopolicy: building the CPU kernels failed ({e}); the XLA kernels will be used")


setup(
    ext_modules=[
        Extension(
            "autopolicy.numerics.cpu._autopolicy_cpu",
            sources=SOURCES,
            depends=HEADERS,
            include_dirs=[os.path.join("autopolicy", "numerics", "cpu")],
            language="c++",
            # -g0: no debug information (Python's own flags add -g): 27 -> 21-24 s to build on 2 cores,
            # a library a tenth the size.
            extra_compile_args=["-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-Wno-attributes",
                                "-Wno-return-type"],
            optional=True,
        )
    ]
    if sys.platform.startswith("linux") or sys.platform == "darwin"
    else [],
    cmdclass={"build_ext": OptionalBuildExt},
)
