"""What a kernel needs to know about the device it runs on: a small, hashable description.

Kernels are chosen by the device's platform, its CPU features (read from ``/proc/cpuinfo``) or
its GPU compute capability. :class:`Device` holds exactly that, so the choice is a pure function
of a value that a test can build by hand for a machine it does not have (an H100, an AVX2-only
EPYC) and that can be a static jit argument or a cache key.

The CPU-feature parsing here is pure (text in, flags out); :mod:`autopolicy.search.hardware`
can share it so the fingerprint and the kernel defaults read the same flags.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

__all__ = [
    "PLATFORMS",
    "CPU_FEATURES",
    "VNNI_FEATURES",
    "Device",
    "parse_cpuinfo",
    "read_cpuinfo",
    "known_cpu_features",
    "current_device",
]

#: Platforms a :class:`Device` may name: JAX's ``Device.platform`` (CUDA and ROCm are ``"gpu"``),
#: and ``"other"`` for any platform that has no kernels of its own (Metal, plugins).
PLATFORMS = ("cpu", "gpu", "tpu", "other")

#: CPU flags that decide which low-precision kernels can be fast (x86 and Arm names, as in
#: ``/proc/cpuinfo``).
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

#: Any of these gives the x86 u8 x s8 dot-product instructions (``vpdpbusd``) or AMX int8 tiles.
VNNI_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """The CPU model and every flag in the text of ``/proc/cpuinfo`` (x86 or Arm).

    >>> model, flags = parse_cpuinfo("model name\\t: Example CPU\\nflags\\t\\t: fpu avx2 fma\\n")
    >>> model, sorted(flags)
    ('Example CPU', ['avx2', 'fma', 'fpu'])
    """
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model is None:
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return model, frozenset(flags)


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str | None, frozenset[str]]:
    """:func:`parse_cpuinfo` of ``path``; ``(None, frozenset())`` where it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return None, frozenset()


def known_cpu_features(flags: Iterable[str]) -> tuple[str, ...]:
    """The flags that are in :data:`CPU_FEATURES`, in its order.

    >>> known_cpu_features({"fpu", "avx512_vnni", "avx2"})
    ('avx2', 'avx512_vnni')
    """
    flags = set(flags)
    return tuple(f for f in CPU_FEATURES if f in flags)


def _parse_capability(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        major, dot, minor = value.strip().partition(".")
        if major.isdigit() and (not dot or minor.isdigit()):
            return int(major), int(minor or 0)
    elif (isinstance(value, tuple) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        return value
    raise ValueError(
        "compute_capability must be None, a (major, minor) tuple of ints or a string like '9.0'. "
        f"Received: compute_capability={value!r}"
    )


@dataclasses.dataclass(frozen=True)
class Device:
    """The device a kernel runs on, as far as choosing a kernel needs to know.

    Args:
      platform: One of :data:`PLATFORMS`.
      device_kind: JAX's ``device_kind`` (``"cpu"``, ``"NVIDIA H100 80GB HBM3"``).
      cpu_features: The host CPU's flags (only those in :data:`CPU_FEATURES` are kept, sorted
        in its order, so equal machines give equal descriptions).
      compute_capability: A GPU's ``(major, minor)`` (a string such as ``"9.0"`` is accepted),
        or None.

    Raises:
      ValueError: for an unknown platform or a malformed compute capability.

    >>> h100 = Device("gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0")
    >>> h100.compute_capability, h100.has_fp8_dot, h100.has_vnni
    ((9, 0), True, False)
    >>> Device("cpu", cpu_features=("avx512_vnni", "avx2", "mmx")).cpu_features
    ('avx2', 'avx512_vnni')
    """

    platform: str
    device_kind: str = ""
    cpu_features: tuple[str, ...] = ()
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"Invalid platform. Expected one of {PLATFORMS}. Received: platform={self.platform!r}")
        if isinstance(self.cpu_features, str) or not all(isinstance(f, str) for f in self.cpu_features):
            raise TypeError(f"cpu_features must be an iterable of flag names. Received: {self.cpu_features!r}")
        object.__setattr__(self, "cpu_features", known_cpu_features(self.cpu_features))
        object.__setattr__(self, "compute_capability", _parse_capability(self.compute_capability))

    @property
    def has_vnni(self) -> bool:
        """Whether the host CPU has a u8 x s8 dot-product unit (any of :data:`VNNI_FEATURES`)."""
        return self.platform == "cpu" and any(f in self.cpu_features for f in VNNI_FEATURES)

    @property
    def has_fp8_dot(self) -> bool:
        """Whether the device multiplies float8 operands natively (NVIDIA compute capability
        8.9 or higher: Ada, Hopper, Blackwell)."""
        return self.platform == "gpu" and self.compute_capability is not None and self.compute_capability >= (8, 9)


@functools.lru_cache(maxsize=None)
def current_device() -> Device:
    """The description of JAX's default device (and of this host's CPU), read once.

    >>> current_device().platform in PLATFORMS
    True
    """
    import jax  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
    platform = platform if platform in PLATFORMS else "other"
    _, flags = read_cpuinfo()
    capability = getattr(device, "compute_capability", None)
    try:
        capability = _parse_capability(capability)
    except ValueError:  # a ROCm gfx name, for example: not an NVIDIA capability
        capability = None
    return Device(platform, str(device.device_kind), tuple(flags), capability)
