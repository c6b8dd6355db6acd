"""Dense latency under each policy and each of its kernels, beside Keras 3's int8 Dense and the
raw XLA integer dots, all timed in one run.

For square sizes (batch M = inputs K = units N), times side by side, with
:class:`autopolicy.search.timing.Timer` (jitted, warmed up, amortized over many calls inside
one compiled loop, every candidate once per round in a fresh random order, medians):

- ``float32``, ``mixed_bfloat16``, ``mixed_float16``: one ``nn.Dense(N)`` (with bias), as a model
  calls it (XLA's dot in the compute dtype: the float kernel ``xla``), and
  ``mixed_*/f32_accumulate``: its product asked for a float32 result, rounded once
  (:mod:`autopolicy.numerics.float_dot`);
- ``int8 (layer)``: the same layer quantized to int8, called as a model calls it (its default
  kernel on this device), and ``int8/<kernel>`` for each int8 kernel (the layer's weights run
  through that kernel's op, :mod:`autopolicy.numerics.kernels`);
- ``float8/<kernel>`` for each float8 kernel (calibrated on the benchmark input);
- ``keras int8``: Keras 3's ``keras.layers.Dense(N)`` with the same weights after
  ``.quantize("int8")`` (JAX backend), called through ``stateless_call`` in the same loop;
- ``xla s8s8 dot`` and ``xla u8s8 dot``: the bare int32-accumulated products of already
  quantized operands (``lax.dot_general`` s8 x s8 -> s32, and the u8 x s8 primitive).

Every ratio is paired: the ratio of two candidates' times within each round, then the median
and the quartiles of those ratios. The report also says which integer dot each compiled program
contains (so a Keras call that silently ran in float would show), whether the int8 kernels'
outputs are bit-identical, and the issue's goals (autopolicy int8 >= 0.95x Keras int8 and
>= 0.9x the raw s8 dot at every size; >= 2.4x float32 at 1024 on VNNI CPUs; on an H100
bfloat16 >= 1.8x float32 and float8 >= 1.3x bfloat16 at 4096).

Usage::

    python benchmarks/bench_kernels.py                     # 256 ... 4096, a few minutes on 2 cores
    python benchmarks/bench_kernels.py --sizes 256 512 --repeats 5 --out /tmp/kernels.md

Without ``--out`` the report goes to ``reports/kernels-<device>.md``.
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
from typing import Any, Callable, Sequence

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import autopolicy.nn as nn  # noqa: E402
from autopolicy import _atomic  # noqa: E402
from autopolicy.nn.calibration import calibrate  # noqa: E402
from autopolicy.numerics import _u8s8_dot, float_dot, int8, kernels, modes  # noqa: E402
from autopolicy.numerics.device import Device, current_device, read_cpuinfo  # noqa: E402
from autopolicy.search.timing import Candidate, Timer, Timing  # noqa: E402

DEFAULT_SIZES = (256, 512, 1024, 2048, 4096)
FLOAT_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
BASELINE = "float32"
LAYER_INT8 = "int8 (layer)"
KERAS_INT8 = "keras int8"
RAW_S8 = "xla s8s8 dot"
RAW_U8 = "xla u8s8 dot"
# Goals of issue 13 (shown by the benchmark; no timed assertions in tests).
GOAL_VS_KERAS, GOAL_VS_RAW, GOAL_VNNI_1024 = 0.95, 0.9, 2.4
GOAL_H100_BF16, GOAL_H100_FP8_OVER_BF16 = 1.8, 1.3


def repeats_for(size: int) -> tuple[int, int]:
    """(timed rounds, warm-up rounds): fewer for the sizes where one call takes seconds.

    The timer already runs each candidate four times untimed (compilation check and the
    estimate of its duration), which warms up the large sizes well enough.
    """
    if size <= 1024:
        return 15, 2
    if size <= 2048:
        return 7, 0
    return 3, 0


# --- the device ----------------------------------------------------------------------------


def device_slug(device: Device, cpu_model: str | None) -> str:
    """A file-name-safe name of the device: the GPU's name, or the CPU model with its fastest
    int8 feature and core count (``intel-xeon-processor-amx-int8-2c``)."""
    if device.platform != "cpu":
        name = device.device_kind or device.platform
    else:
        tier = next((f for f in ("amx_int8", "avx512_vnni", "avx_vnni", "avx512f", "avx2", "i8mm",
                                 "asimddp", "asimd") if f in device.cpu_features), "baseline")
        name = f"{cpu_model or platform.machine()} {tier} {os.cpu_count()}c"
    name = re.sub(r"\((r|tm)\)|@.*?ghz|\bcpu\b", " ", name.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def device_lines(device: Device, cpu_model: str | None) -> list[str]:
    lines = [
        f"- platform: `{device.platform}`, device kind: `{device.device_kind}`, devices: {jax.device_count()}"
        + (f", compute capability {'.'.join(map(str, device.compute_capability))}"
           if device.compute_capability else ""),
        f"- CPU: {cpu_model or platform.processor() or 'unknown'}, {os.cpu_count()} cores; features: "
        f"{', '.join(device.cpu_features) or 'none of interest'}",
        f"- default kernels here: int8 `{kernels.default_kernel('int8', 'einsum', device)}`, float8 "
        f"`{kernels.default_kernel('float8', 'einsum', device)}`",
        f"- jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, "
        f"Python {platform.python_version()}" + (f", keras {_keras_version()}" if _keras_version() else ""),
    ]
    return lines


def _keras_version() -> str | None:
    try:
        return importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:
        return None


# --- candidates ------------------------------------------------------------------------------


def _call(model: nn.Module, x: jax.Array) -> jax.Array:
    return model(x)


def _with_kernel(mode: str, kernel: str) -> Callable[[nn.Module, jax.Array], jax.Array]:
    """A Dense layer's call with its quantized product run by ``mode``'s kernel ``kernel`` (what
    the layer does, with the kernel named instead of defaulted)."""
    op = kernels.kernel_spec(mode, kernel).fn("einsum")
    state = modes.numerics_of(mode).state

    def call(layer: nn.Module, x: jax.Array) -> jax.Array:
        weights = {name: getattr(layer, name) for name in ("kernel",) + state}
        if weights["kernel"].dtype != jnp.int8:  # float8 keeps a float kernel, read in the compute dtype
            weights["kernel"] = weights["kernel"].astype(x.dtype)
        y = op("mk,kn->mn", x, weights=weights, layout=(), compute_dtype=x.dtype)
        return y + layer.bias.astype(y.dtype)

    call.__name__ = f"{mode}_{kernel}"
    return call


def _float_with_kernel(kernel: str) -> Callable[[nn.Module, jax.Array], jax.Array]:
    """A float Dense layer's call with its product run by the float kernel ``kernel``."""

    def call(layer: nn.Module, x: jax.Array) -> jax.Array:
        # The layer reads its (float32) variables in the compute dtype, as here.
        y = float_dot.float_einsum("mk,kn->mn", x, layer.kernel.astype(x.dtype), kernel)
        return y + layer.bias.astype(y.dtype)

    call.__name__ = f"float_{kernel}"
    return call


def _raw_s8(_, x_q: jax.Array, k_q: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x_q, k_q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)


def _raw_u8(_, x_u8: jax.Array, k_q: jax.Array) -> jax.Array:
    return _u8s8_dot.u8s8_matmul(x_u8, k_q)


def keras_int8_dense(dense: nn.Module, size: int) -> tuple[Any, Candidate] | None:
    """Keras 3's Dense with ``dense``'s weights, quantized by Keras to int8, as a candidate
    (``stateless_call``, so its variables are loop inputs, not constants); None without Keras
    on the JAX backend."""
    try:
        import keras  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    if keras.backend.backend() != "jax":
        return None
    layer = keras.layers.Dense(size)
    layer.build((None, size))
    layer.kernel.assign(np.asarray(dense.kernel))
    layer.bias.assign(np.asarray(dense.bias))
    layer.quantize("int8")
    if layer.quantization_mode != "int8" or str(layer._kernel.dtype) != "int8":  # pylint: disable=protected-access
        raise RuntimeError(f"Keras did not quantize its Dense to int8: mode {layer.quantization_mode!r}")
    state = ([v.value for v in layer.trainable_variables], [v.value for v in layer.non_trainable_variables])

    def call(variables, x):
        return layer.stateless_call(variables[0], variables[1], x)[0]

    return layer, Candidate(call, (), state=state)


def make_candidates(size: int, seed: int) -> tuple[dict[str, Candidate], dict[str, str]]:
    """``{name: candidate}`` for one size and ``{name: what it is}``."""
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((size, size)).astype(np.float32))
    dense = nn.Dense(size, name="dense").build(jax.random.key(seed), x)
    candidates: dict[str, Candidate] = {}
    notes: dict[str, str] = {}
    for policy in FLOAT_POLICIES:
        layer = dense if policy == BASELINE else dense.with_dtype_policy(policy)
        candidates[policy] = Candidate(_call, (x.astype(layer.compute_dtype),), state=layer)
        notes[policy] = f"nn.Dense, policy {policy}, as a model calls it (float kernel `xla`)"
        if policy != BASELINE:
            name = f"{policy}/f32_accumulate"
            candidates[name] = Candidate(_float_with_kernel("f32_accumulate"), (x.astype(layer.compute_dtype),),
                                         state=layer)
            notes[name] = f"nn.Dense {policy} weights, kernel `f32_accumulate`: {kernels.kernel_spec('float', 'f32_accumulate').summary}"
    int8_layer = dense.quantize("int8")
    candidates[LAYER_INT8] = Candidate(_call, (x,), state=int8_layer)
    notes[LAYER_INT8] = f"nn.Dense int8_from_float32 as a model calls it (default kernel `{kernels.default_kernel('int8')}`)"
    float8_layer = calibrate(dense.quantize("float8"), [x])
    device = current_device()
    for mode, layer in (("int8", int8_layer), ("float8", float8_layer)):
        for spec in kernels.kernel_specs(mode):
            if not spec.available(device):  # e.g. the C++ CPU kernels on a GPU: no handler to call
                continue
            name = f"{mode}/{spec.name}"
            candidates[name] = Candidate(_with_kernel(mode, spec.name), (x,), state=layer)
            notes[name] = f"nn.Dense {mode}_from_float32 weights, kernel `{spec.name}`: {spec.summary}"
    keras_int8 = keras_int8_dense(dense, size)
    if keras_int8 is not None:
        _, cand = keras_int8
        candidates[KERAS_INT8] = Candidate(cand.fn, (x,), state=cand.state)
        notes[KERAS_INT8] = "keras.layers.Dense, same weights, .quantize('int8'), stateless_call"
    x_q, _ = int8.quantize_symmetric(x, (1,))
    candidates[RAW_S8] = Candidate(_raw_s8, (x_q, int8_layer.kernel))
    notes[RAW_S8] = "lax.dot_general s8 x s8 -> s32 of quantized operands (no quantization, no rescale)"
    if _u8s8_dot.AVAILABLE and device.platform == "cpu":
        x_u8 = jax.lax.bitcast_convert_type(x_q ^ jnp.int8(-128), jnp.uint8)
        candidates[RAW_U8] = Candidate(_raw_u8, (x_u8, int8_layer.kernel))
        notes[RAW_U8] = "the u8 x s8 -> s32 primitive of quantized operands"
    return candidates, notes


# --- checks beside the timings ------------------------------------------------------------


def integer_dot_kind(candidate: Candidate) -> str:
    """What the compiled candidate multiplies with, read from its optimized HLO."""
    fn = jax.jit(lambda state, *inputs: candidate.call(state, inputs))
    text = fn.lower(candidate.state, *candidate.inputs).compile().as_text()
    dots = re.findall(r"= (\w+)\[[^\]]*\]\S* (?:dot|convolution)\(", text)
    if not dots:
        return "no dot in the program (a library call?)"
    kinds = []
    for result in sorted(set(dots)):
        if result == "s32":
            kinds.append("u8 x s8 -> s32" if "u8[" in text else "s8 x s8 -> s32")
        else:
            kinds.append(f"{result} dot")
    where = " (YNNPACK fusion)" if "__ynn_fusion" in text else ""
    return ", ".join(kinds) + where


def outputs(candidates: dict[str, Candidate]) -> dict[str, np.ndarray]:
    out = {}
    for name, cand in candidates.items():
        y = jax.jit(lambda state, *inputs, c=cand: c.call(state, inputs))(cand.state, *cand.inputs)
        out[name] = np.asarray(jnp.asarray(y, jnp.float32) if y.dtype != jnp.int32 else y)
    return out


def relative_error(y: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - reference) / np.linalg.norm(reference))


# --- paired ratios -----------------------------------------------------------------------------


def paired_ratio(slow: Timing | Sequence[float], fast: Timing | Sequence[float]) -> tuple[float, float, float]:
    """Median and quartiles of ``slow / fast`` over the rounds (> 1: ``fast`` is faster); each a
    Timing or its samples, one per round."""
    ratios = np.asarray(getattr(slow, "samples", slow)) / np.asarray(getattr(fast, "samples", fast))
    q25, q50, q75 = np.percentile(ratios, [25, 50, 75])
    return float(q50), float(q25), float(q75)


def _fmt_ratio(r: tuple[float, float, float] | None) -> str:
    return "—" if r is None else f"{r[0]:.2f}x [{r[1]:.2f}–{r[2]:.2f}]"


def table_rows(size: int, timings: dict[str, Timing], errors: dict[str, float]) -> list[dict[str, Any]]:
    """One row per candidate: median, spread and the paired ratios to float32, Keras's int8 Dense
    and the raw s8 dot (None where that candidate was not timed)."""
    rows = []
    for name, t in timings.items():
        rows.append({
            "size": size, "name": name, "median_ms": t.median * 1e3, "cv": t.cv, "repeats": t.repeats,
            "inner": t.inner,
            "vs_float32": paired_ratio(timings[BASELINE], t),
            "vs_keras": paired_ratio(timings[KERAS_INT8], t) if KERAS_INT8 in timings else None,
            "vs_raw_s8": paired_ratio(timings[RAW_S8], t),
            "error": errors.get(name),
        })
    return rows


def bench_size(size: int, repeats: int | None, seed: int) -> dict[str, Any]:
    candidates, notes = make_candidates(size, seed)
    ys = outputs(candidates)
    reference = ys[BASELINE].astype(np.float64)
    programs = {name: integer_dot_kind(candidates[name]) for name in candidates
                if name.startswith("int8") or name in (KERAS_INT8, RAW_S8, RAW_U8)}
    int8_names = [n for n in candidates if n.startswith("int8")]
    identical = all(np.array_equal(ys[n], ys[int8_names[0]]) for n in int8_names)
    default_repeats, warmup = repeats_for(size)
    timer = Timer(candidates, warmup=warmup, seed=seed)
    timer.rounds(repeats or default_repeats)
    timings = timer.timings()
    errors = {name: relative_error(y, reference) for name, y in ys.items() if name not in (RAW_S8, RAW_U8)}
    rows = table_rows(size, timings, errors)
    return {"size": size, "rows": rows, "notes": notes, "programs": programs, "identical": identical,
            "int8_names": int8_names, "timings": timings, "cpu_per_wall": timer.cpu_per_wall}


# --- goals ---------------------------------------------------------------------------------------


def goal_checks(results: list[dict[str, Any]], device: Device) -> list[str]:
    lines = []

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    for res in results:
        by = {r["name"]: r for r in res["rows"]}
        size = res["size"]
        int8_rows = [LAYER_INT8] + sorted((n for n in by if n.startswith("int8/")), key=lambda n: by[n]["median_ms"])
        best = int8_rows[1] if len(int8_rows) > 1 else LAYER_INT8
        for label, name in (("layer (default kernel)", LAYER_INT8), (f"best kernel `{best}`", best)):
            row = by[name]
            if row["vs_keras"] is not None:
                ok = row["vs_keras"][0] >= GOAL_VS_KERAS
                lines.append(f"- {verdict(ok)} N={size}: autopolicy int8 {label} = {_fmt_ratio(row['vs_keras'])} "
                             f"Keras int8 (goal >= {GOAL_VS_KERAS}x)")
            ok = row["vs_raw_s8"][0] >= GOAL_VS_RAW
            lines.append(f"- {verdict(ok)} N={size}: autopolicy int8 {label} = {_fmt_ratio(row['vs_raw_s8'])} "
                         f"the raw s8 x s8 dot (goal >= {GOAL_VS_RAW}x)")
        if device.has_vnni and size == 1024:
            row = by[LAYER_INT8]
            lines.append(f"- {verdict(row['vs_float32'][0] >= GOAL_VNNI_1024)} N=1024 (VNNI CPU): autopolicy int8 = "
                         f"{_fmt_ratio(row['vs_float32'])} float32 (goal >= {GOAL_VNNI_1024}x)")
        if device.platform == "gpu" and size == 4096:
            bf16 = by["mixed_bfloat16"]
            lines.append(f"- {verdict(bf16['vs_float32'][0] >= GOAL_H100_BF16)} N=4096 ({device.device_kind}): "
                         f"mixed_bfloat16 = {_fmt_ratio(bf16['vs_float32'])} float32 (H100 goal >= {GOAL_H100_BF16}x)")
            fp8 = paired_ratio(res["timings"]["mixed_bfloat16"], res["timings"]["float8/fp8_dot"])
            lines.append(f"- {verdict(fp8[0] >= GOAL_H100_FP8_OVER_BF16)} N=4096 ({device.device_kind}): float8/fp8_dot "
                         f"= {_fmt_ratio(fp8)} mixed_bfloat16 (H100 goal >= {GOAL_H100_FP8_OVER_BF16}x)")
    if device.platform != "gpu":
        lines.append("- (H100 goals: not applicable, this run is not on a GPU)")
    return lines


# --- the report -----------------------------------------------------------------------------------


def markdown(results: list[dict[str, Any]], device: Device, cpu_model: str | None, command: str,
             seconds: float, load: tuple[tuple[float, ...], tuple[float, ...]], pending: list[int] = ()) -> str:
    """The report of ``results``; ``pending``: the sizes not measured yet (the report says it is
    incomplete)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Dense latency by policy and kernel, beside Keras 3's int8 Dense and the raw XLA dots",
        "",
        *([f"**Incomplete:** written after N = {results[-1]['size']}; not measured yet: N = "
           f"{', '.join(str(n) for n in pending)}.", ""] if pending else []),
        f"Produced by `{command}` on {now} in {seconds:.0f} s.",
        "",
        *device_lines(device, cpu_model),
        f"- load average (1, 5, 15 min) before: {', '.join(f'{v:.2f}' for v in load[0])}; after: "
        f"{', '.join(f'{v:.2f}' for v in load[1])}; this process's CPU seconds per wall second while timing: "
        + ", ".join(f"N={r['size']}: {r['cpu_per_wall']:.2f}" for r in results),
        "",
        "Square sizes `M = K = N`, a Gaussian `N x N` input. Latency: median seconds per call from "
        "`autopolicy.search.timing.Timer` (jitted, warmed up, amortized over calls inside one "
        "compiled loop, every candidate once per round in a fresh random order); `cv` is the "
        "robust coefficient of variation (IQR / 1.349 / median). Each ratio is paired: per "
        "round, the other candidate's time over this one's (> 1: this one is faster), then the "
        "median [quartiles] over the rounds. Error: norm(output - float32 output) / norm(float32 "
        "output). int8 quantizes its input per row at every call (timed); the raw dots take "
        "operands that are already quantized and return int32.",
        "",
        "| N | candidate | median ms | cv | vs float32 | vs Keras int8 | vs raw s8 dot | error | repeats x inner |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            error = "—" if r["error"] is None else f"{r['error'] * 100:.2f}%"
            out.append(f"| {r['size']} | {r['name']} | {r['median_ms']:.3f} | {r['cv']:.2f} | "
                       f"{_fmt_ratio(r['vs_float32'])} | {_fmt_ratio(r['vs_keras'])} | {_fmt_ratio(r['vs_raw_s8'])} | "
                       f"{error} | {r['repeats']} x {r['inner']} |")
    out += ["", "## Candidates", ""]
    out += [f"- `{name}`: {note}" for name, note in results[0]["notes"].items()]
    out += ["", "## Integer products in the compiled programs", ""]
    for res in results:
        kinds = "; ".join(f"`{name}`: {kind}" for name, kind in res["programs"].items())
        same = "bit-identical" if res["identical"] else "NOT bit-identical"
        out.append(f"- N = {res['size']}: {kinds}. int8 outputs ({', '.join(res['int8_names'])}): {same}.")
    out += ["", "## Goals (issue 13)", "", *goal_checks(results, device)]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="square sizes N")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds for every size (>= 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="where to write the Markdown report (atomically); default reports/kernels-<device>.md")
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
    command = shlex.join(["python", "benchmarks/bench_kernels.py"] + args_given)
    device = current_device()
    cpu_model, _ = read_cpuinfo()
    out_path = args.out or os.path.join("reports", f"kernels-{device_slug(device, cpu_model)}.md")
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = []
    for i, size in enumerate(args.sizes):
        res = bench_size(size, args.repeats, args.seed)
        results.append(res)
        summary = ", ".join(f"{r['name']} {r['vs_float32'][0]:.2f}x" for r in res["rows"] if r["name"] != BASELINE)
        print(f"[N={size}] float32 {res['timings'][BASELINE].median * 1e3:.2f} ms; {summary}", file=sys.stderr)
        if i + 1 < len(args.sizes):  # the sizes done so far survive an interrupt or a time limit
            _atomic.write_text(out_path, markdown(results, device, cpu_model, command, time.perf_counter() - start,
                                                  (load_before, os.getloadavg()), pending=args.sizes[i + 1:]))
    report = markdown(results, device, cpu_model, command, time.perf_counter() - start, (load_before, os.getloadavg()))
    print(report, end="")
    _atomic.write_text(out_path, report)
    print(f"wrote {out_path}", file=sys.stderr)
    print("\n".join(goal_checks(results, device)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
