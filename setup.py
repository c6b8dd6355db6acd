"""Builds autopolicy's CPU kernels (autopolicy/numerics/cpu/*.cc) into one shared library that
autopolicy.numerics.cpu_kernels loads with ctypes and registers with the XLA FFI.

The build is optional: without a C++ compiler (or with the XLA FFI headers missing) the install
still succeeds, with a warning, and the package runs on its XLA kernels. The instruction-set
paths are all compiled in and chosen at run time from the CPU's features, so one build runs on
any x86-64 CPU.
"""

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


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: the kernels are an optimization."""

    def build_extension(self, ext):
        include = _ffi_include()
        if include is None:
            self.warn("autopolicy: the XLA FFI headers (jaxlib/include) were not found; the CPU kernels are "
                      "not built and the XLA kernels will be used")
            return
        ext.include_dirs.append(include)
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
            extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-Wno-attributes", "-Wno-return-type"],
            optional=True,
        )
    ]
    if sys.platform.startswith("linux") or sys.platform == "darwin"
    else [],
    cmdclass={"build_ext": OptionalBuildExt},
)
