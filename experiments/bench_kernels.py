"""Dense latency under each policy, as a speed-up over float32 measured in the same run.

For square sizes (batch M = inputs K = units N), times one ``nn.Dense`` (with bias) under
float32, mixed_bfloat16, mixed_float16, int8_from_float32 and float8_from_float32 (calibrated on
the benchmark input) with :func:`autopolicy.search.timing.measure`: jitted, warmed up, amortized
over many calls, candidates interleaved in random order, medians. Inputs are given in each
policy's compute dtype, as the previous layer of a model would hand them over. Also reports each
policy's relative error against float32 on the same (Gaussian) input and whether the compiled
int8 layer contains the u8 x s8 -> s32 dot (the CPU's VNNI path).

Usage::

    python experiments/bench_kernels.py                    # sizes 256 ... 4096, about 3 minutes
    python experiments/bench_kernels.py --sizes 256 1024
    python experiments/bench_kernels.py --out reports/kernels.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import autopolicy.nn as nn
from autopolicy import _atomic
from autopolicy.nn.calibration import calibrate
from autopolicy.search.timing import Candidate, measure

DEFAULT_SIZES = (256, 512, 1024, 2048, 4096)
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "int8_from_float32", "float8_from_float32")
BASELINE = "float32"


def repeats_for(size: int) -> tuple[int, int]:
    """(timed rounds, warm-up rounds): fewer for the sizes where one call takes seconds.

    ``measure`` already runs each candidate four times untimed (compilation check and the
    estimate of its duration), which warms up the large sizes well enough.
    """
    if size <= 1024:
        return 15, 2
    if size <= 2048:
        return 7, 0
    return 3, 0


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def device_lines() -> list[str]:
    device = jax.devices()[0]
    lines = [
        f"- platform: `{jax.default_backend()}`, device kind: `{device.device_kind}`, "
        f"devices: {jax.device_count()}",
        f"- jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, "
        f"Python {platform.python_version()}",
    ]
    if jax.default_backend() == "cpu":
        flags = cpu_flags()
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
        lines.insert(1, f"- CPU: {cpu_model()}, {os.cpu_count()} cores, ISA: {', '.join(isa) or 'n/a'}")
    return lines


def relative_error(y: jax.Array, reference: jax.Array) -> float:
    y = jnp.asarray(y, jnp.float32)
    return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))


def int8_dot_kind(model: nn.Module, x: jax.Array) -> str:
    """What the compiled int8 layer multiplies with, read from the optimized HLO."""
    text = jax.jit(_call).lower(model, x).compile().as_text()
    if not re.search(r"= s32\[[^\]]*\]\S* dot\(", text):
        return "no int32-accumulated dot found (check the compiled HLO)"
    kind = "u8 x s8 -> s32 dot" if "u8[" in text else "s8 x s8 -> s32 dot"
    if re.search(r"= s32\[[^\]]*\]\S* fusion\([^\n]*__ynn_fusion", text):
        kind += " in a YNNPACK fusion"
    return kind


def make_models(size: int, seed: int = 0) -> tuple[jax.Array, dict[str, nn.Module]]:
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((size, size)).astype(np.float32))
    dense = nn.Dense(size, name="dense").build(jax.random.key(seed), x)
    models = {
        "float32": dense,
        "mixed_bfloat16": dense.with_dtype_policy("mixed_bfloat16"),
        "mixed_float16": dense.with_dtype_policy("mixed_float16"),
        "int8_from_float32": dense.quantize("int8"),
        "float8_from_float32": calibrate(dense.quantize("float8"), [x]),
    }
    return x, models


def _call(model: nn.Module, x: jax.Array) -> jax.Array:
    return model(x)


def bench_size(size: int, repeats: int | None, seed: int) -> tuple[list[dict], str]:
    x, models = make_models(size, seed)
    forward = jax.jit(_call)
    reference = forward(models[BASELINE], x)
    rows = []
    candidates = {}
    for name, model in models.items():
        xi = x.astype(model.compute_dtype)
        candidates[name] = Candidate(_call, (xi,), state=model)
        rows.append({"size": size, "policy": name, "error": relative_error(forward(model, xi), reference)})
    default_repeats, warmup = repeats_for(size)
    timings = measure(candidates, repeats=repeats or default_repeats, warmup=warmup, seed=seed)
    base = timings[BASELINE].median
    for row in rows:
        t = timings[row["policy"]]
        row.update(median_ms=t.median * 1e3, cv=t.cv, speedup=base / t.median, repeats=t.repeats, inner=t.inner)
    int8_model = models["int8_from_float32"]
    return rows, int8_dot_kind(int8_model, x.astype(int8_model.compute_dtype))


def markdown(rows: list[dict], dots: dict[int, str], command: str, seconds: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Dense kernel latency by policy",
        "",
        f"Produced by `{command}` on {now} in {seconds:.0f} s.",
        "",
        *device_lines(),
        "",
        "One `nn.Dense(N)` (with bias) on an `N x N` Gaussian input, square `M = K = N`. Latency: "
        "median seconds per call from `autopolicy.search.timing.measure` (jitted, warmed up, "
        "amortized, candidates interleaved in random order); `cv` is the robust coefficient of "
        "variation (IQR / 1.349 / median). Speed-up = float32 median / policy median, both "
        "from the same run (> 1 is faster). Error = norm(policy output - float32 output) / "
        "norm(float32 output). Inputs arrive in each policy's compute dtype; int8 quantizes "
        "them per row at every call (included in the time); float8 is emulated "
        "(quantize-dequantize around a float32 product) unless the device has float8 units.",
        "",
        "| N | policy | median ms | cv | speed-up vs float32 | rel. error vs float32 | repeats x inner |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['size']} | {r['policy']} | {r['median_ms']:.3f} | {r['cv']:.2f} | "
            f"{r['speedup']:.2f}x | {r['error'] * 100:.2f}% | {r['repeats']} x {r['inner']} |"
        )
    out += ["", "int8 product in the compiled program:", ""]
    out += [f"- N = {size}: {kind}" for size, kind in dots.items()]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="square sizes N")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds for every size (>= 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the Markdown report here (atomically)")
    args = parser.parse_args(argv)
    bad = [s for s in args.sizes if s < 1]
    if bad:
        parser.error(f"--sizes must be positive. Received: {bad}")
    if args.repeats is not None and args.repeats < 3:
        parser.error(f"--repeats must be >= 3. Received: {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The command as a user types it (no machine-specific interpreter path).
    args_given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "experiments/bench_kernels.py"] + args_given)
    start = time.perf_counter()
    rows: list[dict] = []
    dots: dict[int, str] = {}
    for size in args.sizes:
        size_rows, dots[size] = bench_size(size, args.repeats, args.seed)
        rows += size_rows
        summary = ", ".join(f"{r['policy']} {r['speedup']:.2f}x" for r in size_rows[1:])
        print(f"[N={size}] float32 {size_rows[0]['median_ms']:.2f} ms; {summary}", file=sys.stderr)
    report = markdown(rows, dots, command, time.perf_counter() - start)
    print(report, end="")
    if args.out:
        _atomic.write_text(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
