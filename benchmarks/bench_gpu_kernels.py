"""Low-precision products timed on the device beside float32 and bfloat16, each checked against
float32 and shown with the GEMM form XLA compiled it to (:mod:`autopolicy.numerics.gemm_forms`).

Products ``x (rows, K) @ W (K, N)``: 4096 x 4096 x 4096, and the weight matrices of a 1B llama
decoder (d_model 2048, MLP 8192, 32 query and 8 key/value heads of 64, vocabulary 49152: q/o
2048 x 2048, k/v 2048 x 512, gate/up 2048 x 8192, down 8192 x 2048, the LM head 2048 x 49152) at
1, 512, 16 and 64 rows (a decoded token, a prefill, and between), in that order.

Kernels, one row each (inputs bfloat16 but for float32's; weights Gaussian / sqrt(K)):

- ``float32``: ``x @ W`` at JAX's default precision (``jax_default_matmul_precision``, reported;
  on GPUs of compute capability 8.0 or higher cuBLAS runs it as TF32), and ``float32/highest``,
  full float32: the reference every relative error is measured against.
- ``bfloat16``: both operands bfloat16, XLA's dot.
- ``fp8_dot``: autopolicy's float8 kernel (``kernels.kernel_spec("float8", "fp8_dot")``): the input
  and the bfloat16 kernel quantized to e4m3 at every call by delayed-scaling scales (each
  tensor's amax / 448, as calibrated), an e4m3 dot to float32, times both scales.
  ``fp8 dot only``: that dot of operands quantized beforehand (the GEMM alone).
- ``int8/s8s8``: autopolicy's int8 kernel: the input quantized per row at every call, XLA's
  s8 x s8 -> s32 dot, the rescale. ``s8 dot only``: that dot and rescale of a quantized input.
- ``gptq/8 xla``, ``gptq/4 xla``: GPTQ weights (round to nearest, groups of 128, float32 scales)
  through the ``xla`` kernel (the whole kernel dequantized, then a bfloat16 product);
  ``gptq/8 pallas``, ``gptq/4 pallas``: the Pallas (Triton) kernel, where a GPU is JAX's
  default device.

Timing, as GPUs need it: a timed call is one jitted program, a ``fori_loop`` whose iterations
each run ``--unroll`` products. Each product's input depends on the previous product's output
(its first element times a runtime zero, added to one element of the input), and the input and
the weights pass through an optimization barrier after each product, so XLA can neither hoist a
product or its weights' preparation (quantization, dequantization) out of the loop nor share it
between products (the page flags a GEMM found outside the loop). A product's time is the call's
over its products; each call is sized to last ``--target-ms``. An empty loop of the same
structure (no product) gives the loop's own cost per product, and a tiny jitted call the launch
overhead: reported apart, not subtracted. After a warm-up, ``--rounds`` rounds time every kernel
of a shape once each, in a fresh random order; times are medians [min, max] over the rounds,
ratios paired within rounds (float32's or bfloat16's time over this kernel's: > 1 is faster).
The GPU's clocks and power (``nvidia-smi``) are read after each shape's rounds.

Usage::

    python benchmarks/bench_gpu_kernels.py --out reports/        # a GPU: every shape (--budget-s caps it)
    python benchmarks/bench_gpu_kernels.py --small --out /tmp/gpu-kernels.md   # seconds, on a CPU

``--out`` names the page, or a directory for ``gpu-kernels-<machine class>.md`` (the default:
``reports/``); it is rewritten after every shape, so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import math
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import device_lines, device_slug  # noqa: E402

from autopolicy import _atomic  # noqa: E402
from autopolicy.numerics import gemm_forms, int8, kernels, weight_only  # noqa: E402
from autopolicy.numerics.device import current_device, known_cpu_features, read_cpuinfo  # noqa: E402
from autopolicy.numerics.float8 import E4M3, E4M3_MAX, Float8Meta  # noqa: E402

DECODER = (("q/o", 2048, 2048), ("k/v", 2048, 512), ("gate/up", 2048, 8192), ("down", 8192, 2048),
           ("lm head", 2048, 49152))
ROWS = (1, 512, 16, 64)
SMALL_SHAPES = (("square", 32, 256, 256), ("q/o", 1, 256, 256))  # one K x N: the weights compile once
GROUP = 128
REFERENCE, BASELINES, EMPTY = "float32/highest", ("float32", "bfloat16"), "(empty loop)"
#: Every row's relative error (to float32/highest) is below this: 4-bit weights (groups of 128)
#: give about 0.1 on Gaussian weights, float8 about 0.05, the others less.
ERROR_BOUND = 0.2
MAX_ITERATIONS = 100_000
SMI_FIELDS = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,pstate,temperature.gpu"
TABLE_COLUMNS = ("shape", "rows x K x N", "kernel", "us/product [min, max]", "x float32 [min, max]",
                 "x bfloat16 [min, max]", "rel. error", "HLO form")


def full_shapes() -> list[tuple[str, int, int, int]]:
    """``(label, rows, K, N)``: the square product, then the decoder's matrices by rows."""
    return [("square", 4096, 4096, 4096)] + [(label, rows, k, n) for rows in ROWS for label, k, n in DECODER]


# --- the products -------------------------------------------------------------------------------


@dataclasses.dataclass
class Product:
    """One kernel's product ``fn(x, weights)`` at one shape, and its kind for the HLO checks."""

    name: str
    kind: str
    fn: Callable[[Any, Any], jax.Array]
    x: jax.Array
    weights: Any


def _einsum_op(mode: str, kernel: str, layout: tuple) -> Callable[[Any, Any], jax.Array]:
    op = kernels.kernel_spec(mode, kernel).fn("einsum")
    return lambda x, w: op("mk,kn->mn", x, w, layout, jnp.bfloat16)


@jax.jit
def _weights(w32: jax.Array) -> dict[str, Any]:
    """Every kernel's weights from the float32 kernel (jitted: one compilation a shape, not one
    an operation)."""
    w = w32.astype(jnp.bfloat16)
    fp8_scale = jnp.max(jnp.abs(w.astype(jnp.float32))) / E4M3_MAX
    out = {"bfloat16": w, "fp8_scale": fp8_scale, "fp8": (w.astype(jnp.float32) / fp8_scale).astype(E4M3),
           "int8": int8.quantize_weights(w32, (0,), "einsum", None, jnp.float32)}
    for bits in (8, 4):
        q, scale, zero = weight_only.round_to_nearest(w32.T, bits, GROUP)
        out[f"gptq/{bits}"] = weight_only.store(q, scale, zero, weight_only.group_index(w32.shape[0], GROUP), bits,
                                                jnp.float32)
    return out


@jax.jit
def _inputs(x32: jax.Array) -> dict[str, jax.Array]:
    """The bfloat16 input, and its float8 and int8 forms for the dot-only rows."""
    x = x32.astype(jnp.bfloat16)
    fp8_scale = jnp.max(jnp.abs(x.astype(jnp.float32))) / E4M3_MAX
    x_q, x_scale = int8.quantize_symmetric(x, (1,))
    return {"bfloat16": x, "fp8_scale": fp8_scale, "fp8": (x.astype(jnp.float32) / fp8_scale).astype(E4M3),
            "int8": x_q, "int8_scale": x_scale}


def _fp8_dot_only(x8: jax.Array, w: dict) -> jax.Array:
    return (jnp.dot(x8, w["q"], preferred_element_type=jnp.float32) * w["scale"]).astype(jnp.bfloat16)


def _s8_dot_only(x_q: jax.Array, w: dict) -> jax.Array:
    acc = jnp.dot(x_q, w["kernel"], preferred_element_type=jnp.int32).astype(jnp.float32)
    return (acc * w["x_scale"] * w["kernel_scale"]).astype(jnp.bfloat16)


def _low_precision(x: dict, w: dict, skipped: list[str]) -> list[Product]:
    meta = {"input": Float8Meta(16, x["fp8_scale"]), "kernel": Float8Meta(16, w["fp8_scale"]),
            "output_grad": Float8Meta(16)}
    int8_w = w["int8"]
    out = [Product("fp8_dot", "fp8", _einsum_op("float8", "fp8_dot", ()), x["bfloat16"],
                   {"kernel": w["bfloat16"], "fp8": meta}),
           Product("fp8 dot only", "fp8", _fp8_dot_only, x["fp8"],
                   {"q": w["fp8"], "scale": x["fp8_scale"] * w["fp8_scale"]}),
           Product("int8/s8s8", "int8", _einsum_op("int8", "s8s8", ()), x["bfloat16"], int8_w),
           Product("s8 dot only", "int8", _s8_dot_only, x["int8"],
                   {"kernel": int8_w["kernel"], "kernel_scale": int8_w["kernel_scale"], "x_scale": x["int8_scale"]})]
    for bits in (8, 4):
        for kernel in ("xla", "pallas"):
            name = f"gptq/{bits} {kernel}"
            if not kernels.kernel_spec("gptq", kernel).runnable:
                skipped.append(f"`{name}`: not runnable here (needs JAX's default device to be a GPU)")
                continue
            out.append(Product(name, "weight_only", _einsum_op("gptq", kernel, (bits, GROUP)), x["bfloat16"],
                               w[f"gptq/{bits}"]))
    return out


def make_products(k: int, n: int, rows: int, seed: int, skipped: list[str]) -> list[Product]:
    """Every kernel's product at ``rows x k x n``; kernels this process cannot run go to
    ``skipped`` (a line each)."""
    rng = np.random.default_rng(seed)
    x32 = jnp.asarray(rng.standard_normal((rows, k), np.float32))
    w32 = jnp.asarray(rng.standard_normal((k, n), np.float32) / math.sqrt(k))
    x, w = _inputs(x32), _weights(w32)
    highest = jax.lax.Precision.HIGHEST
    return [Product("float32", "float", jnp.dot, x32, w32),
            Product(REFERENCE, "float", lambda a, b: jnp.dot(a, b, precision=highest), x32, w32),
            Product("bfloat16", "float", jnp.dot, x["bfloat16"], w["bfloat16"]),
            *_low_precision(x, w, skipped)]


# --- programs -----------------------------------------------------------------------------------


def loop_program(fn: Callable[[Any, Any], jax.Array], unroll: int) -> Callable[..., jax.Array]:
    """``program(x, weights, eps, count)``: ``count`` iterations of ``unroll`` dependent products
    (see the module docstring); returns the last product."""

    def program(x, weights, eps, count):
        def body(_, carry):
            x_, w_, y = carry
            for _ in range(unroll):
                y = fn(x_, w_)
                # One element updated in place: a slice, an add and a dynamic-update-slice
                # (``.at[].add`` is a scatter, which XLA:CPU turned into passes over all of x).
                corner = (0,) * x_.ndim
                first = jax.lax.dynamic_slice(x_, corner, (1,) * x_.ndim).astype(jnp.float32)
                delta = y.reshape(-1)[0].astype(jnp.float32) * eps
                x_ = jax.lax.dynamic_update_slice(x_, (first + delta).astype(x_.dtype), corner)
                x_, w_ = jax.lax.optimization_barrier((x_, w_))
            return x_, w_, y

        shape = jax.eval_shape(fn, x, weights)
        return jax.lax.fori_loop(0, count, body, (x, weights, jnp.zeros(shape.shape, shape.dtype)))[2]

    return program


def _empty(x: jax.Array, weights: Any) -> jax.Array:
    del weights
    return x[:1, :1]


@dataclasses.dataclass
class Compiled:
    """A product's compiled loop, and the texts its HLO checks read."""

    product: Product
    loop: Any = None
    loop_text: str = ""
    single_text: str = ""
    lowered_text: str = ""
    error: str = ""


def compile_all(products: list[Product], unroll: int, pool: concurrent.futures.Executor) -> list[Compiled]:
    """Each product's loop and single call, traced here, compiled in ``pool``; a product that fails
    keeps its error message instead."""
    eps, one = jnp.float32(0.0), jnp.int32(1)
    jobs = []
    for p in products:
        try:
            loop = jax.jit(loop_program(p.fn, unroll)).lower(p.x, p.weights, eps, one)
            single = None if p.fn is _empty else jax.jit(p.fn).lower(p.x, p.weights)
            jobs.append((Compiled(p, lowered_text=single.as_text() if single else ""), pool.submit(loop.compile),
                         pool.submit(single.compile) if single else None))
        except Exception as e:  # pylint: disable=broad-except
            jobs.append((Compiled(p, error=f"{type(e).__name__}: {e}".splitlines()[0]), None, None))
    for compiled, loop_future, single_future in jobs:
        try:
            if loop_future is not None:
                compiled.loop = loop_future.result()
                compiled.loop_text = compiled.loop.as_text()
                compiled.single_text = single_future.result().as_text() if single_future else ""
        except Exception as e:  # pylint: disable=broad-except
            compiled.error = f"{type(e).__name__}: {e}".splitlines()[0]
    return [c for c, _, _ in jobs]


# --- timing -------------------------------------------------------------------------------------


def _seconds(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def iterations_for(run: Callable[[int], Any], target_s: float) -> int:
    """Loop iterations for a call of about ``target_s``, from the slope between calls of 1 and of
    ``n`` iterations (a call's fixed cost kept out of the per-iteration estimate; ``n`` doubled
    while the longer call is not clearly longer, the slope between two nearly equal times being
    noise)."""
    one = min(_seconds(lambda: run(1)) for _ in range(3))
    if one >= target_s:
        return 1
    n = int(min(MAX_ITERATIONS, max(2, math.ceil(target_s / one))))
    while True:
        many = min(_seconds(lambda: run(n)) for _ in range(3))
        if many - one >= 0.25 * many or n >= MAX_ITERATIONS:
            break
        n = min(2 * n, MAX_ITERATIONS)
    per_iteration = max((many - one) / (n - 1), 1e-9)
    return int(min(MAX_ITERATIONS, max(1, math.ceil(target_s / per_iteration))))


def time_rounds(runs: dict[str, Callable[[int], Any]], iterations: dict[str, int], unroll: int, rounds: int,
                rng: np.random.Generator) -> dict[str, list[float]]:
    """Seconds per product of each run (``iterations`` of ``unroll`` products a call), one sample
    per round, the runs in a fresh random order each round."""
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            name = names[i]
            samples[name].append(_seconds(lambda: runs[name](iterations[name])) / (iterations[name] * unroll))
    return samples


def launch_overhead(calls: int = 200) -> tuple[float, float, float]:
    """Median, min and max seconds of a tiny jitted call (dispatch, launch and synchronization)."""
    tiny = jax.jit(lambda a: a + 1)
    a = jnp.zeros((), jnp.float32)
    jax.block_until_ready(tiny(a))
    times = [_seconds(lambda: tiny(a)) for _ in range(calls)]
    return float(np.median(times)), float(np.min(times)), float(np.max(times))


def spread(values: Any) -> tuple[float, float, float]:
    """Median, min and max."""
    values = np.asarray(values, np.float64)
    return float(np.median(values)), float(np.min(values)), float(np.max(values))


# --- one shape ----------------------------------------------------------------------------------


def relative_error(y: jax.Array, reference: np.ndarray) -> float:
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    return float(np.linalg.norm(y - reference) / np.linalg.norm(reference))


def outside_loop_work(hlo_text: str) -> list[str]:
    """The instructions of a compiled timing loop's entry computation that do work outside the
    loop (a fusion, dot, convert, custom call, transpose, gather, or a copy that changes a layout),
    other than filling an array with a constant: work XLA hoisted, which the time then omits."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = "ENTRY" if header.group(1) else header.group(2)
            computations[current] = []
        elif current is not None and line.strip() != "}":
            computations[current].append(line)
    entry = computations.get("ENTRY", [])
    layouts = dict(re.findall(r"%?([\w.\-]+) = \w+\[[^\]]*\](\{[^}]*\})", "\n".join(entry)))
    work = []
    for line in entry:
        op = re.search(r"%?([\w.\-]+) = (?:\([^=]*?\)|\w+\[[^\]]*\](\{[^}]*\})?) (fusion|dot|convert|custom-call|"
                       r"transpose|gather|copy)\((?:\S+ )?%?([\w.\-]+)", line)
        if op is None:
            continue
        name, layout, opcode, operand = op.groups()
        if opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", line)
            root = next((l for l in computations.get(called.group(1) if called else "", []) if "ROOT" in l), "")
            if re.search(r"= \S+ (broadcast|constant)\(", root):
                continue
        if opcode == "copy" and layouts.get(operand) == layout:
            continue
        work.append(name)
    return work


def _form_cell(compiled: Compiled) -> str:
    """The single call's GEMM forms, and any work XLA hoisted out of the timing loop."""
    cell = "; ".join(dict.fromkeys(f.describe() for f in gemm_forms.gemm_forms(compiled.single_text))) or "no GEMM"
    hoisted = outside_loop_work(compiled.loop_text)
    if hoisted:
        cell += f" **(outside the timing loop, so not timed: {', '.join(hoisted)})**"
    return cell


def _runner(c: Compiled) -> Callable[[int], jax.Array]:
    """A call of ``c``'s loop for ``count`` iterations."""
    eps = jnp.float32(0.0)

    def run(count: int) -> jax.Array:
        return c.loop(c.product.x, c.product.weights, eps, jnp.int32(count))

    return run


def _ready_runs(compiled: list[Compiled], target_s: float) -> tuple[dict, dict, dict]:
    """``(runs, outputs, iterations)`` of the programs that compiled: each run's call, its output
    (one iteration) and its iterations per timed call, after a warm-up. A program that fails to
    run keeps the error instead."""
    runs, outputs, iterations = {}, {}, {}
    for c in compiled:
        if c.error:
            continue
        run = _runner(c)
        try:
            outputs[c.product.name] = jax.block_until_ready(run(1))
            iterations[c.product.name] = iterations_for(run, target_s)
            jax.block_until_ready(run(iterations[c.product.name]))  # warm-up
        except Exception as e:  # pylint: disable=broad-except
            c.error = f"{type(e).__name__}: {e}".splitlines()[0]
            continue
        runs[c.product.name] = run
    return runs, outputs, iterations


def _row(c: Compiled, samples: dict[str, list[float]], output: jax.Array, reference: np.ndarray | None) -> dict:
    name = c.product.name
    ratios = {b: spread(np.asarray(samples[b]) / np.asarray(samples[name])) if b in samples else None
              for b in BASELINES}
    return {"name": name, "kind": c.product.kind, "time": spread(samples[name]), "ratios": ratios,
            "error": relative_error(output, reference) if reference is not None else float("nan"),
            "form": _form_cell(c), "check": gemm_forms.check_forms(c.single_text, c.product.kind),
            "lowered": gemm_forms.check_lowered(c.lowered_text, c.product.kind)}


def bench_shape(shape: tuple[str, int, int, int], args: argparse.Namespace, pool: concurrent.futures.Executor,
                skipped: list[str]) -> dict[str, Any]:
    """Compiles, sizes, warms up and times every kernel at one shape; its rows and HLO checks."""
    label, rows, k, n = shape
    products = make_products(k, n, rows, args.seed, skipped)
    bf16 = next(p for p in products if p.name == "bfloat16")
    products.append(Product(EMPTY, "float", _empty, bf16.x, bf16.weights))
    compiled = compile_all(products, args.unroll, pool)
    runs, outputs, iterations = _ready_runs(compiled, args.target_ms / 1e3)
    samples = time_rounds(runs, iterations, args.unroll, args.rounds, np.random.default_rng(args.seed))
    reference = np.asarray(outputs[REFERENCE], np.float64) if REFERENCE in outputs else None
    timed = [c for c in compiled if c.product.name in runs and c.product.name != EMPTY]
    return {"label": label, "rows": rows, "k": k, "n": n,
            "results": [_row(c, samples, outputs[c.product.name], reference) for c in timed],
            "empty": spread(samples[EMPTY]) if EMPTY in samples else None, "iterations": iterations,
            "failed": {c.product.name: c.error for c in compiled if c.error}, "state": device_state()}


# --- the machine --------------------------------------------------------------------------------


def device_state() -> str:
    """The GPU's clocks, power and state (``nvidia-smi``), or the CPU and its flags of interest."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        if out:
            return f"nvidia-smi ({SMI_FIELDS}): {out}"
    except (OSError, subprocess.SubprocessError):
        pass
    model, flags = read_cpuinfo()
    features = ", ".join(known_cpu_features(flags)) or "none of interest"
    return f"CPU: {model or 'unknown'}, {os.cpu_count()} cores; flags: {features}"


# --- the page -----------------------------------------------------------------------------------


def _us(t: tuple[float, float, float]) -> str:
    return f"{t[0] * 1e6:.2f} [{t[1] * 1e6:.2f}, {t[2] * 1e6:.2f}]"


def _ratio(r: tuple[float, float, float] | None) -> str:
    return "—" if r is None else f"{r[0]:.2f}x [{r[1]:.2f}, {r[2]:.2f}]"


def products_table(results: list[dict[str, Any]]) -> list[str]:
    out = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---|---|---|---:|---:|---:|---:|---|"]
    for res in results:
        size = f"{res['rows']} x {res['k']} x {res['n']}"
        for r in res["results"]:
            flag = "" if r["error"] < ERROR_BOUND else " **(over the bound)**"
            out.append(f"| {res['label']} | {size} | {r['name']} | {_us(r['time'])} | {_ratio(r['ratios']['float32'])} "
                       f"| {_ratio(r['ratios']['bfloat16'])} | {r['error']:.2e}{flag} | {r['form']} |")
    return out


def verdict_table(results: list[dict[str, Any]]) -> list[str]:
    """Per kernel: the StableHLO check (first shape), the compiled forms with the shapes that took
    each, and whether every shape took a form its kind pays on."""
    by_kernel: dict[str, dict[str, Any]] = {}
    for res in results:
        for r in res["results"]:
            entry = by_kernel.setdefault(r["name"], {"kind": r["kind"], "lowered": r["lowered"], "forms": {},
                                                     "ok": True})
            found = "; ".join(dict.fromkeys(f.describe() for f in r["check"].forms)) or "no GEMM"
            entry["forms"].setdefault(found, []).append(f"{res['label']} {res['rows']}")
            entry["ok"] &= r["check"].ok
    out = ["| kernel | kind | StableHLO before XLA | compiled GEMM forms (shapes: label rows) | verdict |",
           "|---|---|---|---|---|"]
    for name, e in by_kernel.items():
        forms = "<br>".join(f"{form} ({', '.join(shapes)})" for form, shapes in e["forms"].items())
        expected = "/".join(dict(gemm_forms.EXPECTED_FORMS)[e["kind"]])
        lowered = ("ok: " if e["lowered"].ok else "NO: ") + e["lowered"].verdict.split(": ", 1)[1]
        out.append(f"| {name} | {e['kind']} | {lowered} | {forms} | {'yes' if e['ok'] else 'NO'} ({expected}) |")
    return out


def markdown(results: list[dict[str, Any]], info: dict[str, Any], pending: list[tuple] = ()) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    precision = jax.config.jax_default_matmul_precision
    tf32 = next((r["error"] for res in results for r in res["results"] if r["name"] == "float32"), None)
    out = [f"# Low-precision products on {info['device'].device_kind or info['device'].platform}: time, error, "
           "GEMM form", ""]
    if pending:
        out += [f"**Incomplete:** not measured: {', '.join(f'{s[0]} {s[1]}' for s in pending)}.", ""]
    out += [f"Produced by `{info['command']}` on {now} in {time.perf_counter() - info['start']:.0f} s.", "",
            *device_lines(info["device"], info["cpu_model"]),
            f"- at the start: {info['state']}",
            f"- `jax_default_matmul_precision`: {precision!r} (None: `DEFAULT`); float32 at it against "
            f"`HIGHEST`: relative difference {'—' if tf32 is None else f'{tf32:.1e}'} (about 1e-3 means TF32)",
            f"- launch overhead (a tiny jitted call, {info['launch'][0] * 1e6:.1f} us [{info['launch'][1] * 1e6:.1f}, "
            f"{info['launch'][2] * 1e6:.1f}]); products per timed call: {info['unroll']} a loop iteration, "
            f"sized to {info['target_ms']} ms; {info['rounds']} rounds",
            "", "See the script's docstring for the kernels and the timing. Ratios: float32's or bfloat16's time "
            "over this row's, paired per round (> 1: faster). Rel. error: norm(y - y_highest) / norm(y_highest), "
            f"bound {ERROR_BOUND}. HLO form: the GEMMs of the product compiled alone.", "",
            "## Products", "", *products_table(results), "",
            "## HLO forms", "", *verdict_table(results), "",
            "## Loop overhead and the device, per shape", "",
            "| shape | rows x K x N | empty loop us/product [min, max] | iterations per call (float32) | "
            "device after the rounds |", "|---|---|---:|---:|---|"]
    for res in results:
        empty = "—" if res["empty"] is None else _us(res["empty"])
        out.append(f"| {res['label']} | {res['rows']} x {res['k']} x {res['n']} | {empty} | "
                   f"{res['iterations'].get('float32', '—')} | {res['state']} |")
    notes = info["skipped"] + [f"`{name}` at {res['label']} {res['rows']}: failed: {error}"
                               for res in results for name, error in res["failed"].items()]
    if notes:
        out += ["", "## Not run", "", *[f"- {note}" for note in dict.fromkeys(notes)]]
    return "\n".join(out) + "\n"


# --- the command --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes and few rounds (a CPU, seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (>= 3; default 7, --small 3)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="length of a timed call (default 20 ms, --small 1 ms)")
    parser.add_argument("--unroll", type=int, default=None, help="products per loop iteration (default 8 off "
                                                                 "a CPU, 1 on one)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new shape after this many seconds (the page lists the rest)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reports", help="the page, or a directory for gpu-kernels-<machine>.md")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.small else 7)
    args.target_ms = args.target_ms or (1.0 if args.small else 20.0)
    args.unroll = args.unroll or (8 if jax.default_backend() != "cpu" else 1)
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3. Received: {args.rounds}")
    if args.unroll < 1 or args.target_ms <= 0:
        parser.error(f"--unroll must be >= 1 and --target-ms > 0. Received: {args.unroll}, {args.target_ms}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    device = current_device()
    cpu_model, _ = read_cpuinfo()
    out = args.out
    if os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, f"gpu-kernels-{device_slug(device, cpu_model)}.md")
    info = {"command": shlex.join(["python", "benchmarks/bench_gpu_kernels.py"] + given), "device": device,
            "cpu_model": cpu_model, "start": time.perf_counter(), "state": device_state(),
            "launch": launch_overhead(), "unroll": args.unroll, "target_ms": args.target_ms,
            "rounds": args.rounds, "skipped": []}
    shapes = list(SMALL_SHAPES) if args.small else full_shapes()
    results = []
    with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        for i, shape in enumerate(shapes):
            if args.budget_s is not None and time.perf_counter() - info["start"] > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {len(shapes) - i} shapes not measured", file=sys.stderr)
                break
            results.append(bench_shape(shape, args, pool, info["skipped"]))
            res = results[-1]
            summary = ", ".join(f"{r['name']} {r['time'][0] * 1e6:.1f} us" for r in res["results"])
            print(f"[{shape[0]} {shape[1]}x{shape[2]}x{shape[3]}] {summary}", file=sys.stderr, flush=True)
            _atomic.write_text(out, markdown(results, info, pending=shapes[i + 1:]))
    page = markdown(results, info, pending=shapes[len(results):])
    _atomic.write_text(out, page)
    print("\n".join(verdict_table(results)))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
