"""The machine-wide cache the command line shares between run directories.

``$AUTOPOLICY_CACHE`` (default ``~/.cache/autopolicy``, where the experiments also keep their
trained weights; ``autopolicy tune --no-shared-cache`` leaves it alone) holds JAX's persistent
compilation cache (``jax/``: a layer compiled once is loaded, not compiled, by
every later run) and the layer and cast timings (``measurements/``, keyed by the hardware
fingerprint and the layer's signature, so they are only reused on the same machine and
software). A run directory keeps its own copy of every measurement it used, so it resumes and
reports without this cache.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "directory", "enable_compilation_cache"]

ENV = "AUTOPOLICY_CACHE"


def directory() -> str:
    """``$AUTOPOLICY_CACHE``, or ``~/.cache/autopolicy`` when it is unset or empty (the same
    root as the experiments' trained weights, ``autopolicy.experiment.default_cache_dir``).

    >>> import os
    >>> os.environ[ENV] = "/tmp/ap-cache"; directory()
    '/tmp/ap-cache'
    >>> del os.environ[ENV]
    """
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "autopolicy")


def enable_compilation_cache(path: str) -> str:
    """Turns JAX's persistent compilation cache on in ``path`` (every compilation cached, however
    quick: a tune compiles hundreds of small programs), unless one is already configured (by
    ``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``); returns the directory in use."""
    import jax  # pylint: disable=import-outside-toplevel

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return configured
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
