"""Ctrl-C at random moments of a tune: how many interrupts end in a crash instead of exit 130.

Each try starts ``autopolicy tune`` on a 2-layer experiment in a fresh run directory (a first
run: ``--no-shared-cache``, so nothing comes from an earlier try), waits
until ``cache/measurements.json`` first appears (the first measurement flush, when JAX work is
in flight), then sends SIGINT after a random delay (0 to ``--window`` seconds, seeded) and
records the exit status. A clean interrupt is exit 130 with the "interrupted; run the same
command again to resume" line; a run that finished before the signal (exit 0, no traceback) is
counted apart; anything else (a negative status: killed by a signal such as SIGSEGV, or a
traceback) is a crash.

    python benchmarks/bench_interrupts.py --tries 50
    python benchmarks/bench_interrupts.py --tries 20 --root ../other-checkout  # another version

Prints one line per try and then ``crashes: N/T``; exits 1 when there was a crash.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESUME = "interrupted; run the same command again to resume"

EXPERIMENT = textwrap.dedent('''
    """two layers on random data, for interrupt tests."""
    import jax, jax.numpy as jnp, numpy as np
    from autopolicy import nn
    from autopolicy.experiment import Experiment

    def build(cache_dir):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
        model = nn.Sequential([nn.Dense(32, activation="relu"), nn.Dense(4)], name="tiny")
        model = model.build(jax.random.key(0), x)
        reference = model(x)

        def fidelity(m):
            return 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))

        return Experiment(name="tiny", model=model, eval_fn=fidelity, sample_input=x,
                          candidates=("float32", "mixed_bfloat16", "int8_from_float32"), max_drop=0.05)
''')


def interrupt_once(workdir: pathlib.Path, delay: float, timeout: float = 300.0, root: pathlib.Path = ROOT,
                   progress: bool = False, reuse: bool = False, profile_accuracy: str | None = None
                   ) -> tuple[str, int, str]:
    """Runs one tune, interrupts it ``delay`` s after the first flush; ("clean"|"finished"|"crash", rc, tail)."""
    experiment = workdir / "tiny.py"
    if not experiment.exists():
        experiment.write_text(EXPERIMENT)
    out = workdir / f"run-{time.monotonic_ns()}"
    measurements = out / "cache" / "measurements.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "autopolicy", "tune", str(experiment), "--out", str(out), "--repeats", "3",
         "--no-report", *([] if progress else ["--no-progress"]),
         *(["--profile-accuracy", profile_accuracy] if profile_accuracy else []),
         # (a checkout from before the machine-wide cache has no such flag, nor needs it)
         *(["--no-shared-cache"] if not reuse and "--no-shared-cache" in (root / "autopolicy" / "cli.py").read_text()
           else [])],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not measurements.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rc = proc.returncode
    tail = " | ".join(err.strip().splitlines()[-2:])
    if rc == 130 and RESUME in err and "Traceback" not in err:
        return "clean", rc, tail
    if rc == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err:
        return "finished", rc, tail
    return "crash", rc, tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=50)
    parser.add_argument("--window", type=float, default=1.5, help="seconds after the first flush")
    parser.add_argument("--earliest", type=float, default=0.0,
                        help="the shortest delay: signals land between this and --window s after the first flush")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=pathlib.Path, default=ROOT,
                        help="the checkout whose autopolicy runs (to compare before and after a change)")
    parser.add_argument("--progress", action="store_true", help="tune with progress output (default: none)")
    parser.add_argument("--reuse", action="store_true",
                        help="use the machine-wide cache ($AUTOPOLICY_CACHE): runs finish sooner, so more signals "
                             "land as a run ends")
    parser.add_argument("--profile-accuracy", choices=["auto", "first_order", "measure", "always"], default=None,
                        help="passed to tune: 'always' scores every candidate (signals land while the next "
                             "candidate compiles in the background)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    counts = {"clean": 0, "finished": 0, "crash": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.tries):
            delay = rng.uniform(args.earliest, args.window)
            outcome, rc, tail = interrupt_once(pathlib.Path(tmp), delay, root=args.root, progress=args.progress,
                                               reuse=args.reuse, profile_accuracy=args.profile_accuracy)
            counts[outcome] += 1
            print(f"try {i + 1:2d}: delay {delay:.3f} s -> {outcome} (exit {rc}) {tail[:160]}", flush=True)
    print(f"crashes: {counts['crash']}/{args.tries} (clean interrupts {counts['clean']}, "
          f"finished before the signal {counts['finished']})")
    return 1 if counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
