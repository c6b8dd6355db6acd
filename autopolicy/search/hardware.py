"""What machine the measurements are taken on, and a stable fingerprint of it.

Every measurement is keyed by the fingerprint: a cache filled on one machine (or under another
JAX) is never reused on another.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
from typing import Any

import jax

from autopolicy._version import __version__
from autopolicy.numerics import device as device_info

__all__ = ["detect", "fingerprint", "describe", "device_of", "CPU_FEATURES", "cache_bytes"]

#: CPU flags that decide which low-precision kernels can be fast (shared with the kernels).
CPU_FEATURES = device_info.CPU_FEATURES

def _cpu_info() -> dict[str, Any]:
    model, flags = device_info.read_cpuinfo()
    return {
        "model": model or platform.processor() or platform.machine(),
        "features": list(device_info.known_cpu_features(flags)),
        "cores": os.cpu_count(),
    }


def cache_bytes(platform_name: str = "cpu") -> int:
    """The last-level cache in bytes: the largest cache sysfs lists for CPU 0, 32 MiB where it
    lists none; 64 MiB on an accelerator (an H100's L2 is 50 MiB).

    Weights larger than this cannot stay cached from one call of a model to the next.
    """
    if platform_name != "cpu":
        return 64 << 20
    sizes = []
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(entry, encoding="utf-8") as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 << 20)


def device_of(info: dict[str, Any]) -> device_info.Device:
    """The :class:`~autopolicy.numerics.device.Device` that :func:`detect`'s ``info`` describes
    (what the kernel defaults read).

    >>> info = {"platform": "cpu", "device_kind": "cpu", "cpu": {"features": ["avx2", "fma"]}}
    >>> device_of(info).has_vnni
    False
    """
    platform_name = {"cuda": "gpu", "rocm": "gpu"}.get(info["platform"], info["platform"])
    if platform_name not in device_info.PLATFORMS:
        platform_name = "other"
    return device_info.Device(platform_name, str(info.get("device_kind", "")), tuple(info["cpu"]["features"]),
                              info.get("compute_capability"))


def detect() -> dict[str, Any]:
    """The target: platform, device kind and count, CPU features or GPU compute capability,
    and the versions that change what XLA compiles."""
    import jaxlib  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    info: dict[str, Any] = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "cpu": _cpu_info(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "python": platform.python_version(),
        "autopolicy": __version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if device.platform == "cpu":
        from autopolicy.numerics import cpu_kernels  # pylint: disable=import-outside-toplevel

        # Which C++ kernels run (the path in use, AUTOPOLICY_CPU_PATH included) and which build of
        # them, the threads a call splits for where set (AUTOPOLICY_CPU_THREADS), the size of x
        # from which calls use XLA's pool where not the default (AUTOPOLICY_CPU_POOL_VALUES), and
        # projections called one by one where grouping is off (AUTOPOLICY_GROUPED_PROJECTIONS=0):
        # timings of another build, path, thread count, pool size or grouping are not this one's.
        from autopolicy.numerics import grouped  # pylint: disable=import-outside-toplevel

        info["cpu_kernels"] = None
        if cpu_kernels.AVAILABLE:
            threads = cpu_kernels.threads()
            pool_values = cpu_kernels.pool_min_values()
            info["cpu_kernels"] = {"path": cpu_kernels.path(), "build": cpu_kernels.build_id(),
                                   **({} if threads is None else {"threads": threads}),
                                   **({} if pool_values == cpu_kernels.POOL_MIN_VALUES_DEFAULT
                                      else {"pool_min_values": pool_values}),
                                   **({} if grouped.enabled() else {"grouped_projections": False})}
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
        info["compute_capability"] = str(capability)
    return info


def fingerprint(info: dict[str, Any] | None = None) -> str:
    """A short stable hash of what the measurements depend on (not of the Python version)."""
    info = detect() if info is None else info
    relevant = {k: info.get(k) for k in ("platform", "device_kind", "device_count", "jax", "jaxlib",
                                         "compute_capability", "xla_flags")}
    relevant["cpu"] = {k: info["cpu"][k] for k in ("model", "features", "cores")}
    if info.get("cpu_kernels") is not None:  # absent from the records of older versions
        relevant["cpu_kernels"] = info["cpu_kernels"]
    if info.get("process_count", 1) > 1:  # multi-controller: the processes are part of the machine
        relevant["process_count"] = info["process_count"]
    digest = hashlib.sha256(json.dumps(relevant, sort_keys=True).encode("utf-8")).hexdigest()
    return digest[:16]


def describe(info: dict[str, Any] | None = None) -> str:
    """One line naming the device, e.g. ``cpu: Intel(R) Xeon(R) ... (2 cores; avx512_vnni)``."""
    info = detect() if info is None else info
    if info["platform"] == "cpu":
        features = ", ".join(info["cpu"]["features"]) or "no special features"
        return f"cpu: {info['cpu']['model']} ({info['cpu']['cores']} cores; {features}); jax {info['jax']}"
    extra = f", compute capability {info['compute_capability']}" if "compute_capability" in info else ""
    return f"{info['platform']}: {info['device_kind']} x{info['device_count']}{extra}; jax {info['jax']}"
