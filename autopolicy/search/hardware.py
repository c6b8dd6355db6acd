"""What machine the measurements are taken on, and a stable fingerprint of it.

Every measurement is keyed by the fingerprint: a cache filled on one machine (or under another
JAX) is never reused on another.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Any

import jax

from autopolicy._version import __version__

__all__ = ["detect", "fingerprint", "describe", "CPU_FEATURES"]

# CPU flags that decide which low-precision kernels can be fast.
CPU_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",  # Arm NEON
    "asimddp",  # Arm dot product (int8)
    "bf16",  # Arm bfloat16
    "i8mm",  # Arm int8 matrix multiply
)


def _cpu_info() -> dict[str, Any]:
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and model is None:
                    model = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "features": [f for f in CPU_FEATURES if f in flags],
        "cores": os.cpu_count(),
    }


def detect() -> dict[str, Any]:
    """The target: platform, device kind and count, CPU features or GPU compute capability,
    and the versions that change what XLA compiles."""
    import jaxlib  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    info: dict[str, Any] = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu": _cpu_info(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "python": platform.python_version(),
        "autopolicy": __version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
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
