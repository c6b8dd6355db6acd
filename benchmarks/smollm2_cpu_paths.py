"""A SmolLM2-135M decode step under each CPU kernel path this CPU runs, in one process: how fast
uniform int8 (and, with ``--policies``, other uniform policies) decodes against float32 on the
AVX2 path of an AVX-512 machine, beside its own best path.

    .venv/bin/python benchmarks/smollm2_cpu_paths.py [--rounds 4] [--policies int8_from_float32 ...]
        [--tuned runs/smollm2]

The kernels' path is switched with ``cpu_kernels.set_path`` between timings (compiled programs
call the same library, so the switch is immediate and the programs are the same). Every round
times float32 and each policy under each path, the paths in alternating order; a ratio is the
median over rounds of float32's time over the policy's in the same round, with its quartiles.
GPTQ/AWQ policies are calibrated as ``report_smollm2.py`` does. With ``--tuned RUN`` (a tune's
run directory) its map is timed too, on the path the library chose, three ways: each layer with
the kernel its tune chose (``profile.csv``; ``cpu_ffi_avx2`` names the AVX2 path per call), and
every layer with ``cpu_ffi`` or ``cpu_ffi_avx2`` where it offers them. Writes nothing; name the
CPU with the figures (the first line prints it).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "experiments")]  # the other benchmarks; the tasks
import report_smollm2  # noqa: E402
import smollm2  # noqa: E402

import autopolicy as ap  # noqa: E402
from autopolicy.numerics import cpu_kernels  # noqa: E402
from autopolicy.search import hardware  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds (each: 3 interleaved repeats of 5 steps)")
    parser.add_argument("--policies", nargs="+", default=["int8_from_float32"])
    parser.add_argument("--tuned", type=pathlib.Path, default=None,
                        help="a tune run directory: its map timed with its own kernels and with each FFI kernel")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1. Received: {args.rounds}")
    if not cpu_kernels.AVAILABLE:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    model, _, tok = smollm2.load()
    batches = [smollm2.windows(tok, "calibration", 8)[:4]]
    models = {"float32": model}
    cache: dict = {}
    for policy in args.policies:
        built = report_smollm2.calibrated(model.with_dtype_policy(policy), model, batches, cache)
        models[policy] = report_smollm2.with_kernels(built)
    tuned = []
    if args.tuned is not None:
        policies, chosen, _ = report_smollm2.tuned_from_run(args.tuned)
        built = model.with_dtype_policy(ap.DTypePolicyMap("float32", policies))
        built = report_smollm2.calibrated(built, model, batches, cache)
        models["tuned, its kernels"] = report_smollm2.with_kernels(built, chosen)
        for kernel in cpu_kernels.FFI_KERNELS:
            offered = {p: kernel for p, layer in built.layers_by_path().items()
                       if layer.quantization_mode is not None and kernel in layer.kernel_choices()}
            if offered:
                models[f"tuned, {kernel} everywhere"] = built.with_kernels(offered)
        tuned = [name for name in models if name.startswith("tuned")]
        print(f"tuned map: {len(chosen)} layers with a kernel chosen: "
              f"{ {k: list(chosen.values()).count(k) for k in sorted(set(chosen.values()))} }", flush=True)
    paths = cpu_kernels.supported_paths()
    print(f"device: {hardware.describe()}; CPU kernel paths: {', '.join(paths)}", flush=True)
    ratios: dict[tuple[str, str], list[float]] = {}
    f32: list[float] = []
    try:
        for r in range(args.rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                cpu_kernels.set_path(path)
                times = report_smollm2.time_decode(models, smollm2.CACHE, reps=3, inner=5)
                f32.extend(times["float32"].tolist())
                for policy in args.policies:
                    ratios.setdefault((policy, path), []).extend((times["float32"] / times[policy]).tolist())
                for name in tuned if path == paths[0] else ():  # each call names its path: the default's rounds
                    ratios.setdefault((name, "per-call kernels"), []).extend((times["float32"] / times[name]).tolist())
    finally:
        cpu_kernels.set_path(paths[0])
    print(f"float32: {np.median(f32) * 1e3:.2f} ms a step (median over every round)")
    for (policy, path), values in ratios.items():
        q1, med, q3 = np.percentile(values, [25, 50, 75])
        print(f"{policy} on {path}: {med:.2f}x float32 [{q1:.2f}, {q3:.2f}] over {len(values)} paired timings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
