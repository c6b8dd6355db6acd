"""How repeatable the search's layer timings are on this machine.

Measures one >= 1 ms layer (a float32 Dense, and its int8 twin) with
``autopolicy.search.timing.measure`` several times in a row, for a few repetition counts, and
reports the coefficient of variation of the medians across those measurements (the target is
<= 3%), plus the int8/float32 ratio and its spread: the search compares candidates, so the
ratio measured inside one interleaved run is what decides.

Run: ``python benchmarks/bench_timing.py --out reports/timing-<machine-class>.md``
"""

from __future__ import annotations

import argparse
import shlex
import sys

import jax
import numpy as np

from autopolicy import _atomic, nn
from autopolicy.search import hardware, timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=768, help="Dense width and batch (N x N)")
    parser.add_argument("--trials", type=int, default=8, help="measurements per repetition count")
    parser.add_argument("--repeats", type=int, nargs="+", default=[15, 30, 60])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    x = jax.random.normal(jax.random.key(0), (args.size, args.size))
    dense = nn.Dense(args.size).build(jax.random.key(1), x)
    candidates = {
        "float32": timing.Candidate(lambda m, a: m(a), (x,), dense),
        "int8": timing.Candidate(lambda m, a: m(a), (x,), dense.quantize("int8")),
    }
    rows = []
    for repeats in args.repeats:
        medians = {"float32": [], "int8": []}
        for trial in range(args.trials):
            result = timing.measure(candidates, repeats=repeats, seed=trial)
            for name in medians:
                medians[name].append(result[name].median)
        f32, i8 = np.array(medians["float32"]), np.array(medians["int8"])
        ratio = f32 / i8
        rows.append((repeats, 1e3 * f32.mean(), f32.std() / f32.mean(), 1e3 * i8.mean(), i8.std() / i8.mean(),
                     ratio.mean(), ratio.std() / ratio.mean()))
    args_given = sys.argv[1:] if argv is None else list(argv)
    lines = [
        "# Repeatability of layer timings",
        "",
        f"Device: {hardware.describe()}. Command: `{shlex.join(['python', 'benchmarks/bench_timing.py'] + args_given)}`.",
        "",
        f"A Dense({args.size}) on a {args.size} x {args.size} input, float32 and int8, timed together by "
        f"`timing.measure` {args.trials} times in a row per repetition count. CV = standard deviation of the "
        "medians across those measurements over their mean (target <= 3% for a >= 1 ms layer).",
        "",
        "| repeats | float32 ms | float32 CV | int8 ms | int8 CV | int8 speed-up | speed-up CV |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]:.3f} | {100 * r[2]:.1f}% | {r[3]:.3f} | {100 * r[4]:.1f}% | "
                     f"{r[5]:.2f}x | {100 * r[6]:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        _atomic.write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
