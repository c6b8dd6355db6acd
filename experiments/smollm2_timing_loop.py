"""How the tuner's end-to-end timing loop sees a SmolLM2-135M decode step, against steady-state
decoding: why a tune prints smaller speed-ups than ``report_smollm2.py`` measures.

    .venv/bin/python experiments/smollm2_timing_loop.py [--rounds 12]

For float32 and uniform int8 (the CPU kernels), one decode step at cache ``smollm2.CACHE`` timed
four ways, the two models interleaved: ``cold`` (one call of the tuner's compiled loop right after
the other model ran, as the tuner's interleaved rounds do), ``warm`` (one call after two of the
same model), ``loop5`` (a call of five steps, per step), ``carried`` (one call after the other
model and one untimed step, with the tune's ``step_carry``: the cache fed from step to step and
call to call, donated, as ``autopolicy tune smollm2`` now times) and ``steady`` (``report_smollm2``'s timing:
Python-driven steps with the key/value cache donated and carried, after three untimed ones). Prints medians in ms
and each way's float32/int8 ratio; writes nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import report_smollm2  # noqa: E402
import smollm2  # noqa: E402

from autopolicy import search  # noqa: E402
from autopolicy.search import hardware, timing  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    model, _, _ = smollm2.load()
    made = search.get_adapter(model, smollm2.decode_input(model), [])
    models = {"float32": model, "int8": report_smollm2.with_kernels(model.with_dtype_policy("int8_from_float32"))}
    runs, carried = {}, {}
    for name, m in models.items():
        program = made.model_program(m)
        runs[name] = timing.compile_loop(timing.Candidate(program.fn, program.args, program.state), 1)
        carried[name] = timing.compile_loop(timing.Candidate(program.fn, program.args, program.state,
                                                             carry=smollm2.next_decode_input), 1)
        runs[name](), runs[name](), carried[name](), carried[name]()
    seen = {(name, way): [] for name in runs for way in ("cold", "warm", "loop5", "carried")}
    for _ in range(args.rounds):
        for name, run in runs.items():
            other = next(o for o in runs if o != name)
            runs[other](3)
            start = time.perf_counter()
            run(1)
            seen[name, "cold"].append(time.perf_counter() - start)
            run(2)
            start = time.perf_counter()
            run(1)
            seen[name, "warm"].append(time.perf_counter() - start)
            start = time.perf_counter()
            run(5)
            seen[name, "loop5"].append((time.perf_counter() - start) / 5)
            runs[other](3)
            carried[name].prime()  # as the tuner's Timer does before each timed call of a stateful step
            start = time.perf_counter()
            carried[name](1)
            seen[name, "carried"].append(time.perf_counter() - start)
    steady = report_smollm2.time_decode(models, smollm2.CACHE, args.rounds, 5)
    for name in runs:
        seen[name, "steady"] = list(steady[name])
    print(f"{hardware.describe()}; decode step, batch 1, cache {smollm2.CACHE}, {args.rounds} rounds")
    for way in ("cold", "warm", "loop5", "carried", "steady"):
        f32, i8 = np.median(seen["float32", way]), np.median(seen["int8", way])
        print(f"{way:7s} float32 {f32 * 1e3:6.2f} ms  int8 {i8 * 1e3:6.2f} ms  x{f32 / i8:.2f}")


if __name__ == "__main__":
    main()
