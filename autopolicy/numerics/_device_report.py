"""What ``autopolicy device`` prints: the machine, its CPU features, the kernels it can run."""

from __future__ import annotations

import os
import platform

__all__ = ["device_report"]


def device_report() -> str:
    """Lines naming the device, the CPU and its features, the CPU kernel paths built and the one
    that runs, and the jax/jaxlib/XLA versions: what every figure should be quoted with."""
    import jax  # pylint: disable=import-outside-toplevel
    import jaxlib  # pylint: disable=import-outside-toplevel

    from autopolicy.numerics import cpu_kernels, cpu_weight_only, kernels  # pylint: disable=import-outside-toplevel
    from autopolicy.numerics.device import current_device, read_cpuinfo  # pylint: disable=import-outside-toplevel

    device = current_device()
    model, _ = read_cpuinfo()
    lines = [
        f"device: {device.platform} ({device.device_kind or 'unknown kind'}), {jax.device_count()} device(s), "
        f"{os.cpu_count()} CPU core(s)",
        f"cpu: {model or platform.processor() or 'unknown'} ({platform.machine()})",
        f"cpu features: {', '.join(device.cpu_features) or 'none of those autopolicy reads'}",
    ]
    if cpu_kernels.AVAILABLE:
        threads = cpu_kernels.threads()
        split = "as many as XLA's pool has" if threads is None else f"{threads} (AUTOPOLICY_CPU_THREADS or set_threads)"
        lines.append(f"cpu kernels: built ({os.path.basename(cpu_kernels.library_path())}); paths this CPU "
                     f"runs: {', '.join(cpu_kernels.supported_paths())}; in use: {cpu_kernels.path()}; "
                     f"threads a call splits for: {split} (our polling helpers, XLA's pool from an x of "
                     f"{cpu_kernels.pool_min_values()} values)")
        if cpu_weight_only.AVAILABLE:
            lines.append(f"weight-only (GPTQ/AWQ) kernel: {cpu_weight_only.variant()} variant")
        from autopolicy.numerics import grouped  # pylint: disable=import-outside-toplevel

        if not grouped.enabled():
            state = f"off ({grouped.GROUPED_ENV}=0): one call per projection"
        elif jax.device_count() != 1:
            state = f"off here: {jax.device_count()} devices (the FFI kernels run on one)"
        else:
            state = "on (one int8/int4 call where their policies and kernels agree)"
        lines.append(f"projections sharing an input (q/k/v, gate/up): {state}")
    else:
        lines.append(f"cpu kernels: not available ({cpu_kernels.unavailable_reason()}): XLA kernels only")
    for mode in ("int8", "int4", "float8", "gptq", "awq"):
        candidates = kernels.candidate_kernels(mode, "einsum", device)
        lines.append(f"{mode} kernels timed by the search here: {', '.join(candidates)} "
                     f"(default without a measurement: {kernels.default_kernel(mode, 'einsum', device)})")
    lines.append(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    return "\n".join(lines)
