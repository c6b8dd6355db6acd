"""The weight-only (GPTQ/AWQ) CPU kernel beside XLA's dequantize-then-dot and float32, on the
SmolLM2-135M layer shapes and 4096 x 4096.

For each shape ``K x N`` and batch ``M`` (default 1), times side by side in one run with
:class:`autopolicy.search.timing.Timer` (jitted, warmed up, every candidate once per round in a
fresh random order, medians; ratios paired within rounds, with their quartiles):

- ``float32``: XLA's dot ``x @ w``;
- ``gptq/4/32 xla``, ``gptq/4/128 xla``: the GPTQ op on XLA (the whole kernel dequantized, then
  a float dot), with Keras's storage (4-bit values packed along the outputs, float32 scales and
  uint8 zero points per group of 32 or 128 inputs);
- ``gptq/4/32 ffi``, ``gptq/4/128 ffi``: the same op and weights on kernel ``cpu_ffi``
  (:mod:`autopolicy.numerics.cpu_weight_only`; the weights passed as arguments, so the
  on-device check of ``g_idx`` is timed too);
- ``gptq/8/-1 xla``, ``gptq/8/-1 ffi``: 8 bits per channel (SmolLM2's usual choice under a 2%
  perplexity budget), the same way;
- ``... ffi avx2``: kernel ``cpu_ffi_avx2`` (the same library on its AVX2 path), where the CPU's
  best path is another (``cpu_kernels.kernel_distinct_on``);
- ``int4/32 ffi``: the symmetric int4 kernel (``int4/32_from_float32``, kernel ``cpu_ffi``:
  int8 inputs, integer products), for comparison.

The weights are round-to-nearest on the GPTQ grid (calibration changes their values, not the
work). Usage::

    python benchmarks/bench_weight_only.py                       # batch 1, every shape
    python benchmarks/bench_weight_only.py --batches 1 7 --shapes 4096x4096 --out /tmp/w.md

Without ``--out`` the report goes to ``reports/weight-only-kernels-<device>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from typing import Any

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_kernels import bandwidth  # noqa: E402
from bench_kernels import device_lines, device_slug, paired_ratio  # noqa: E402

from autopolicy import _atomic  # noqa: E402
from autopolicy.numerics import cpu_kernels, cpu_weight_only, int4, weight_only  # noqa: E402
from autopolicy.numerics.device import current_device, read_cpuinfo  # noqa: E402
from autopolicy.search.timing import Candidate, Timer  # noqa: E402

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (4096, 4096))
BASELINE = "float32"
KERNEL_LABELS = {"xla": "xla", "cpu_ffi": "ffi", "cpu_ffi_avx2": "ffi avx2"}
#: (bits, group) of the weight-only layouts timed (-1: per channel).
LAYOUTS = ((4, 32), (4, 128), (8, -1))


def _weight_only_op(bits: int, group: int, kernel: str):
    def call(weights, x):
        return weight_only.einsum_kernel("mk,kn->mn", x, weights, (bits, group), jnp.float32, kernel=kernel)
    return call


def _int4_op(block: int):
    def call(weights, x):
        return int4.einsum_kernel("mk,kn->mn", x, weights, (block,), jnp.float32, kernel="cpu_ffi")
    return call


def candidates(m: int, k: int, n: int, seed: int) -> tuple[dict[str, Candidate], dict[str, int]]:
    """``{name: candidate}`` for one shape and batch, and the weight bytes each reads per call."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))
    out = {BASELINE: Candidate(lambda w_, x_: x_ @ w_, (x,), state=w)}
    nbytes = {BASELINE: 4 * k * n}
    avx2 = cpu_weight_only.AVAILABLE and cpu_kernels.kernel_distinct_on("cpu_ffi_avx2", current_device().cpu_features)
    for bits, group in LAYOUTS:
        q, scale, zero = weight_only.round_to_nearest(w.T, bits, group)
        stored = weight_only.store(q, scale, zero, weight_only.group_index(k, group), bits, jnp.float32)
        groups = weight_only.group_count(k, group)
        size = k * ((n + 1) // 2 if bits == 4 else n) + 5 * n * groups
        kernels = ["xla"] + (["cpu_ffi"] if cpu_weight_only.AVAILABLE else []) + (["cpu_ffi_avx2"] if avx2 else [])
        for kernel in kernels:
            name = f"gptq/{bits}/{group} {KERNEL_LABELS[kernel]}"
            out[name] = Candidate(_weight_only_op(bits, group, kernel), (x,), state=stored)
            nbytes[name] = size
    if cpu_kernels.AVAILABLE:
        q4 = int4._quantize_kernel(w, (0,), 32, jnp.dtype(jnp.float32))  # pylint: disable=protected-access
        out["int4/32 ffi"] = Candidate(_int4_op(32), (x,), state=q4)
        nbytes["int4/32 ffi"] = k * n // 2 + k * n // 8
    return out, nbytes


def bench(m: int, k: int, n: int, repeats: int, seed: int, bw: float) -> list[dict[str, Any]]:
    cands, nbytes = candidates(m, k, n, seed)
    timer = Timer(cands, warmup=1, seed=seed)
    timer.rounds(repeats)
    timings = timer.timings()
    rows = []
    for name, t in timings.items():
        q1, q3 = np.percentile(t.samples, [25, 75])
        rows.append({"shape": f"{k}x{n}", "batch": m, "name": name, "median_us": t.median * 1e6,
                     "quartiles_us": (q1 * 1e6, q3 * 1e6), "vs_float32": paired_ratio(timings[BASELINE], t),
                     "bandwidth": nbytes[name] / t.median / bw})
    return rows


def markdown(rows: list[dict[str, Any]], bw: float, command: str, load: tuple[str, str]) -> str:
    device = current_device()
    cpu_model, _ = read_cpuinfo()
    path = cpu_kernels.path() if cpu_kernels.AVAILABLE else f"not available ({cpu_kernels.unavailable_reason()})"
    lines = [f"# The weight-only (GPTQ/AWQ) CPU kernel on {cpu_model or device.device_kind}", "",
             f"Measured {datetime.date.today()} with `{command}`.", ""] + device_lines(device, cpu_model) + [
             f"- CPU kernel path: `{path}`; memory bandwidth (read-only sum of 256 MB): {bw / 1e9:.1f} GB/s",
             f"- load average (1, 5, 15 min) before: {load[0]}; after: {load[1]} (a shared machine)", "",
             "Each cell: median time per call [quartiles], and the paired ratio to float32 (median [quartiles] "
             "over rounds; > 1 is faster); at batch 1, the share of the bandwidth limit (bytes read / time / "
             "bandwidth).", ""]
    names = list(dict.fromkeys(r["name"] for r in rows))
    lines += ["| shape K x N | batch | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for key in dict.fromkeys((r["shape"], r["batch"]) for r in rows):
        cells = {r["name"]: r for r in rows if (r["shape"], r["batch"]) == key}
        text = []
        for name in names:
            r = cells.get(name)
            if r is None:
                text.append("—")
                continue
            ratio = r["vs_float32"]
            cell = (f"{r['median_us']:.0f} us [{r['quartiles_us'][0]:.0f}-{r['quartiles_us'][1]:.0f}], "
                    f"{ratio[0]:.2f}x [{ratio[1]:.2f}-{ratio[2]:.2f}]")
            if key[1] == 1:
                cell += f", {100 * r['bandwidth']:.0f}% bw"
            text.append(cell)
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES], help="K x N, e.g. 576x1536")
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    command = "python benchmarks/bench_weight_only.py" + (" " + shlex.join(given) if given else "")
    before = _load()
    bw = bandwidth()
    rows = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        for m in args.batches:
            rows += bench(m, k, n, args.repeats, args.seed, bw)
            print(f"{k}x{n} batch {m}: " + ", ".join(
                f"{r['name']} {r['median_us']:.0f} us {r['vs_float32'][0]:.2f}x" for r in rows
                if r["shape"] == f"{k}x{n}" and r["batch"] == m), file=sys.stderr)
    text = markdown(rows, bw, command, (before, _load()))
    cpu_model, _ = read_cpuinfo()
    out = args.out or os.path.join("reports", f"weight-only-kernels-{device_slug(current_device(), cpu_model)}.md")
    _atomic.write_text(out, text)
    print(text)
    print(f"written {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
