"""autopolicy's CPU kernels (XLA FFI) beside XLA's own paths and Keras 3's quantized Dense, on the
SmolLM2-135M layer shapes and 4096 x 4096, with the machine's memory bandwidth as the limit.

For each shape ``K x N`` and batch ``M``, times side by side in one run, with
:class:`autopolicy.search.timing.Timer` (jitted, warmed up, amortized over several calls in one
compiled loop, every candidate once per round in a fresh random order, medians; ratios paired
within rounds, with their quartiles):

- ``float32``: XLA's dot ``x @ w`` (what a float32 Dense runs);
- ``int8 xla`` / ``int8 ffi``: the package's int8 Dense op (input quantized per row, int8
  weights per channel, int32 accumulation, rescale) with the kernel ``s8s8`` (XLA's dot) or
  ``cpu_ffi`` (autopolicy's C++ kernel);
- ``int4 xla`` / ``int4 ffi``: the same with int4 weights per channel; ``int4/32 ffi`` with
  blocks of 32 (the grid of the SmolLM2 checkpoint);
- ``int8 ffi avx2`` (and int4, and ``avx_vnni``): the same FFI calls on each other
  instruction-set path this CPU also has (on an AVX512-VNNI machine, the AVX-VNNI and AVX2
  kernels beside the AVX-512 ones: the path is switched around each timed call);
- ``keras int8`` / ``keras int4``: Keras 3's ``Dense(N)`` with the same weights after
  ``.quantize(...)`` (JAX backend, ``stateless_call`` in the same compiled loop).

The bandwidth probe sums a 256 MB float32 array (read once per call); at batch 1 each kernel's
share of that limit is ``weight bytes / time / bandwidth``. Beside the kernels at those batches,
``read int8 bytes`` and ``read int4 bytes`` are XLA's read-only sums over as many bytes as the
int8 and int4 weights, timed the same way where those bytes stream from memory: what reading one
layer's bytes costs on the machine.

At batch 1 (``--streamed-batches``) the candidates are timed as a decoder runs its layers
instead: each in one program of at least 16 dependent calls cycling through copies of its weights
(twice the largest cache, at least 64 MB, at most 64 copies; cells marked "cached" had fewer
bytes than that), every candidate once per round in a fresh random order. In the timing loop a
batch-1 call paid a fixed cost per timed call of up to a millisecond (a 4096 x 4096 int8 layer
took 1.8 ms in a loop of one iteration, 0.63 ms per iteration in one of 16, 2-core EPYC) and
read weights the cache still held from the call before, neither of which a model's layers do.

Usage::

    python benchmarks/bench_cpu_kernels.py                 # every shape and batch, ~10 min on 2 cores
    python benchmarks/bench_cpu_kernels.py --batches 1 4 --shapes 576x1536 4096x4096 --out /tmp/k.md
    python benchmarks/bench_cpu_kernels.py --batches 1 --streamed-batches   # batch 1 in the timing loop
    python benchmarks/bench_cpu_kernels.py --ramp --batches 1 --shapes 576x1536   # the warm-up after a pause

Without ``--out`` the report goes to ``reports/cpu-kernels-<device>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import device_lines, device_slug, paired_ratio  # noqa: E402

from autopolicy import _atomic  # noqa: E402
from autopolicy.numerics import cpu_kernels, int4, int8  # noqa: E402
from autopolicy.numerics.device import current_device, read_cpuinfo  # noqa: E402
from autopolicy.search.timing import Candidate, Timer  # noqa: E402

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (4096, 4096))
BATCHES = (1, 4, 32, 256)
BASELINE = "float32"


def _int8_op(kernel: str):
    def call(state, x):
        kq, ks, colsum = state
        return int8.int8_dense(x, kq, ks, jnp.float32, colsum, kernel)
    return call


def _int4_op(kernel: str, block: int):
    def call(weights, x):
        return int4.einsum_kernel("mk,kn->mn", x, weights, (block,), jnp.float32, kernel=kernel)
    return call


def _keras_dense(w: np.ndarray, mode: str) -> Candidate | None:
    try:
        import keras  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    if keras.backend.backend() != "jax":
        return None
    layer = keras.layers.Dense(w.shape[1], use_bias=False)
    layer.build((None, w.shape[0]))
    layer.kernel.assign(w)
    layer.quantize(mode)
    state = ([v.value for v in layer.trainable_variables], [v.value for v in layer.non_trainable_variables])
    return Candidate(lambda variables, x: layer.stateless_call(variables[0], variables[1], x)[0], (), state=state)


def candidates(m: int, k: int, n: int, seed: int, keras: bool = True) -> tuple[dict[str, Candidate], dict[str, int]]:
    """``{name: candidate}`` for one shape and batch, and the weight bytes each reads per call
    (Keras 3's Dense among them where ``keras`` and Keras is installed)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    w_np = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    w = jnp.asarray(w_np)
    q8 = int8.quantize_weights(w, (0,), "einsum", None, jnp.float32)
    state8 = (q8["kernel"], q8["kernel_scale"], q8["kernel_colsum"])
    q4 = int4._quantize_kernel(w, (0,), int4.PER_CHANNEL, jnp.dtype(jnp.float32))  # pylint: disable=protected-access
    q4b = int4._quantize_kernel(w, (0,), 32, jnp.dtype(jnp.float32))  # pylint: disable=protected-access
    out = {BASELINE: Candidate(lambda w_, x_: x_ @ w_, (x,), state=w),
           "int8 xla": Candidate(_int8_op("s8s8"), (x,), state=state8),
           "int4 xla": Candidate(_int4_op("xla", int4.PER_CHANNEL), (x,), state=q4)}
    nbytes = {BASELINE: 4 * k * n, "int8 xla": k * n, "int4 xla": k * n // 2}
    if cpu_kernels.AVAILABLE:
        out["int8 ffi"] = Candidate(_int8_op("cpu_ffi"), (x,), state=state8)
        out["int4 ffi"] = Candidate(_int4_op("cpu_ffi", int4.PER_CHANNEL), (x,), state=q4)
        out["int4/32 ffi"] = Candidate(_int4_op("cpu_ffi", 32), (x,), state=q4b)
        nbytes.update({"int8 ffi": k * n, "int4 ffi": k * n // 2, "int4/32 ffi": k * n // 2 + k * n // 8})
        for other in _other_paths():
            for name in ("int8 ffi", "int4 ffi", "int4/32 ffi"):
                out[f"{name} {other}"], nbytes[f"{name} {other}"] = out[name], nbytes[name]
    for mode in ("int8", "int4") if keras else ():
        keras_candidate = _keras_dense(w_np, mode)
        if keras_candidate is not None:
            out[f"keras {mode}"] = Candidate(keras_candidate.fn, (x,), state=keras_candidate.state)
            nbytes[f"keras {mode}"] = k * n if mode == "int8" else k * n // 2
    return out, nbytes


def reads(k: int, n: int, seed: int) -> tuple[dict[str, Candidate], dict[str, int]]:
    """XLA's read-only sum over as many bytes as the int8 and the int4 weights of ``K x N`` (a
    float32 array of that size), timed where they stream from memory: what reading those bytes
    in a chain of dependent calls costs, beside the 256 MB probe. Not a bare read where the bytes
    are cached: there XLA's reduction is bound by its additions (a cached 1.3 MB sum ran at about
    22 GB/s on the 2-core EPYC, 8-17 MB from memory at 10-18), so the benchmark leaves it out of
    shapes whose copies would fit the caches."""
    rng = np.random.default_rng(seed + 1)
    out, nbytes = {}, {}
    for label, size in (("read int8 bytes", k * n), ("read int4 bytes", k * n // 2)):
        data = jnp.asarray(rng.standard_normal(max(1, size // 4)).astype(np.float32))
        # The sum depends on x (its first value added to every element, in one fused reduction), so
        # XLA can neither hoist it out of the chain nor share it between calls on the same copy.
        out[label] = Candidate(lambda d, x_: jnp.sum(d + x_[0, 0])[None], (jnp.ones((1, k), jnp.float32),), state=data)
        nbytes[label] = data.nbytes
    return out, nbytes


def _other_paths() -> list[str]:
    """The SIMD paths this CPU has besides the one in use (the portable one left out)."""
    best = cpu_kernels.path()
    return [p for p in cpu_kernels.supported_paths() if p not in (best, "portable")]


def _on_path(run, path: str):
    """``run`` with the kernels switched to ``path`` for the call (and back after); returns what
    ``run`` returns."""
    def call():
        best = cpu_kernels.path()
        cpu_kernels.set_path(path)
        try:
            return run()
        finally:
            cpu_kernels.set_path(best)
    return call


def bandwidth(seconds: float = 2.0) -> float:
    """Bytes per second of a read-only sum over 256 MB (median of repeated calls)."""
    data = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    times = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=seconds)
    while datetime.datetime.now() < deadline or len(times) < 5:
        start = datetime.datetime.now()
        total(data).block_until_ready()
        times.append((datetime.datetime.now() - start).total_seconds())
    return data.nbytes / float(np.median(times))


def bench(m: int, k: int, n: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    cands, nbytes = candidates(m, k, n, seed)
    timer = Timer(cands, warmup=1, seed=seed)
    for other in _other_paths():
        for name, (run, inner) in list(timer.runners.items()):
            if name.endswith(f" {other}"):
                timer.runners[name] = (_on_path(run, other), inner)
    timer.rounds(repeats)
    timings = timer.timings()
    rows = []
    for name, t in timings.items():
        rows.append({"shape": f"{k}x{n}", "batch": m, "name": name, "median_us": t.median * 1e6,
                     "vs_float32": paired_ratio(timings[BASELINE], t),
                     "bytes_per_s": nbytes[name] / t.median})
    return rows


def _cache_bytes() -> int:
    """The largest CPU cache's size (sysfs; 32 MB where it cannot be read)."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size", encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def next_input(x0: jax.Array, y: Any) -> jax.Array:
    """The next call's input in a chain of dependent calls: the chain's first input ``x0`` plus a
    runtime zero times the last output's first value, so no call starts before the one before it
    ends, as a model's layers run. Made from ``x0``, not from the previous input: a chain of adds
    (x plus the zero, then that plus the next) is fused by XLA into each later add (an add feeds
    both the next call and the next add, and XLA duplicates elementwise producers into their
    consumers, an optimization barrier notwithstanding), so the i-th step's fusion took i + 1
    operands and recomputed the chain's adds over K values: O(length^2) work outside the layers,
    which XLA split over its pool's threads where K was 1536, beside the kernels' own helper. On
    the 2-core Zen 3 EPYC (AVX2), 1536 x 576 at batch 1, 13 paired rounds: int8 76.3 us a call
    with the chain of adds against 47.2 from x0, int4 42.8 against 27.7, float32 195.8 against
    194.0; on 576 x 576 and 576 x 1536 0.93-1.27x, within this machine's noise."""
    first = jax.tree_util.tree_leaves(y)[0].reshape(-1)[0]
    return x0 + (1e-30 * first).astype(x0.dtype)


def _chained(fn, length: int):
    """``length`` dependent calls of ``fn(states[i % len(states)], x)``, one program, each call's
    input made from the one before by :func:`next_input`."""
    def run(states, x):
        y, x0 = None, x
        for i in range(length):
            y = fn(states[i % len(states)], x)
            x = next_input(x0, y)
        return y
    return jax.jit(run)


def _copies(nbytes: int, budget: int) -> int:
    """How many copies of ``nbytes`` of weights a streamed candidate cycles through: ``budget``
    bytes of them, at most 64."""
    return int(min(64, max(1, -(-budget // max(1, nbytes)))))


def _cached(nbytes: int, budget: int) -> bool:
    """Whether a streamed candidate's copies come to less than ``budget``: partly read from the
    caches."""
    return _copies(nbytes, budget) * nbytes < budget


def _streamed_programs(cands: dict[str, Candidate], nbytes: dict[str, int], budget: int) -> dict[str, tuple]:
    """``{name: (program, states, x, calls)}``: each candidate's program of ``calls`` dependent
    calls cycling through copies of its weights (``budget`` bytes of them, at most 64 copies),
    compiled and run once."""
    programs = {}
    for name, cand in cands.items():
        copies = _copies(nbytes[name], budget)
        length = max(16, copies)
        states = [cand.state] + [jax.tree_util.tree_map(jnp.copy, cand.state) for _ in range(copies - 1)]
        program, x = _chained(cand.fn, length), cand.inputs[0]
        jax.block_until_ready(program(states, x))
        programs[name] = (program, states, x, length)
    return programs


def bench_streamed(m: int, k: int, n: int, repeats: int, seed: int, budget: int,
                   target: float = 0.02, pause: float = 0.1, warm: float = 0.05) -> list[dict[str, Any]]:
    """As :func:`bench`, but each candidate runs as a decoder meets its layers: in one program of
    dependent calls cycling through copies of its weights, ``budget`` bytes of them (at most 64
    copies), so that, where that is more than the caches hold, every call reads its weights from
    memory. Per call: the program's time over its calls (a few programs back to back), every
    candidate once per round in a fresh random order, ``pause`` seconds before each (on the 2-core
    EPYC a 4096 x 4096 int8 layer took 1.65-1.75 ms right after XLA's int8 path, 1.29-1.40 ms
    after a pause of 0.1-0.5 s, float32 4.34 against 3.65-3.79 ms: a transient of the machine,
    not of the candidate), then ``warm`` seconds of the candidate's own program untimed, as a
    decoder's layers follow one another token after token. After the pause the helper threads
    have gone to sleep and the cores clocked down: every candidate runs slower for the first 20-40
    ms (``--ramp`` prints it; on the 2-core Zen 3 EPYC, 576 x 1536, float32 215-235 us a call in
    the first 10 ms against 181-184 from 40 ms on, int8 75-90 against 54-57), so ``warm`` is
    50 ms; ratios paired within rounds."""
    cands, nbytes = candidates(m, k, n, seed)
    if not _cached(k * n // 2, budget):  # the smaller read, of the int4 bytes, streams too (see reads)
        read_cands, read_bytes = reads(k, n, seed)
        cands, nbytes = {**cands, **read_cands}, {**nbytes, **read_bytes}
    rng = np.random.default_rng(seed)
    runners, resident = {}, {}
    for name, (program, states, x, length) in _streamed_programs(cands, nbytes, budget).items():
        start = time.perf_counter()
        jax.block_until_ready(program(states, x))
        reps = max(1, int(target / max(time.perf_counter() - start, 1e-6)))

        def run(program=program, states=states, x=x, reps=reps, calls=reps * length):
            until = time.perf_counter() + warm
            while True:
                jax.block_until_ready(program(states, x))
                if time.perf_counter() >= until:
                    break
            start = time.perf_counter()
            for _ in range(reps):
                out = program(states, x)
            jax.block_until_ready(out)
            return (time.perf_counter() - start) / calls
        path = next((p for p in _other_paths() if name.endswith(f" {p}")), None)
        runners[name] = _on_path(run, path) if path else run
        resident[name] = _cached(nbytes[name], budget)
    samples = {name: [] for name in runners}
    for _ in range(repeats):
        for i in rng.permutation(len(runners)):
            name = list(runners)[i]
            time.sleep(pause)
            samples[name].append(runners[name]())
    rows = []
    for name, times in samples.items():
        median = float(np.median(times))
        rows.append({"shape": f"{k}x{n}", "batch": m, "name": name, "median_us": median * 1e6,
                     "vs_float32": paired_ratio(samples[BASELINE], times), "bytes_per_s": nbytes[name] / median,
                     "streamed": not resident[name]})
    return rows


RAMP_WINDOWS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)
RAMP_NAMES = (BASELINE, "int8 ffi", "int4 ffi", "int4/32 ffi")


def ramp(m: int, k: int, n: int, repeats: int, seed: int, budget: int, pause: float = 0.1,
         windows: tuple[float, ...] = RAMP_WINDOWS, names: tuple[str, ...] = RAMP_NAMES) -> list[dict[str, Any]]:
    """How each candidate's time per call settles after a pause, as :func:`bench_streamed` meets
    it: ``repeats`` times, every candidate in ``names`` in turn, ``pause`` seconds idle, then its
    program back to back until ``windows[-1]`` seconds have passed, each program's time per call
    filed under the first window its end falls in. One row per candidate and window: the median
    time per call there, how many programs it had, and float32's median over this one's in the
    same window."""
    cands, nbytes = candidates(m, k, n, seed, keras=False)
    cands = {name: cands[name] for name in names if name in cands}
    programs = _streamed_programs(cands, {name: nbytes[name] for name in cands}, budget)
    per = {name: [[] for _ in windows] for name in programs}
    for _ in range(repeats):
        for name, (program, states, x, length) in programs.items():
            time.sleep(pause)
            begin = time.perf_counter()
            while True:
                start = time.perf_counter()
                jax.block_until_ready(program(states, x))
                end = time.perf_counter()
                slot = next((i for i, w in enumerate(windows) if end - begin <= w), None)
                if slot is None:
                    break
                per[name][slot].append((end - start) / length)
    rows = []
    for name, slots in per.items():
        for window, times in zip(windows, slots):
            base = per[BASELINE][windows.index(window)] if BASELINE in per else []
            median = float(np.median(times)) if times else float("nan")
            rows.append({"shape": f"{k}x{n}", "batch": m, "name": name, "window_ms": 1e3 * window,
                         "median_us": 1e6 * median, "programs": len(times),
                         "vs_float32": float(np.median(base)) / median if times and base else float("nan")})
    return rows


def ramp_markdown(rows: list[dict[str, Any]]) -> str:
    """One table per shape and batch: a row per candidate, a column per window after the pause
    (its upper end), each cell the median time per call [the ratio to float32 there]."""
    lines = []
    for key in dict.fromkeys((r["shape"], r["batch"]) for r in rows):
        mine = [r for r in rows if (r["shape"], r["batch"]) == key]
        windows = list(dict.fromkeys(r["window_ms"] for r in mine))
        lines += [f"{key[0]}, batch {key[1]}: time per call, up to each time after the pause", "",
                  "| candidate | " + " | ".join(f"<= {w:g} ms" for w in windows) + " |",
                  "|---|" + "---|" * len(windows)]
        for name in dict.fromkeys(r["name"] for r in mine):
            cells = {r["window_ms"]: r for r in mine if r["name"] == name}
            text = []
            for w in windows:
                r = cells[w]
                ratio = "" if name == BASELINE else (" [—]" if np.isnan(r["vs_float32"]) else f" [{r['vs_float32']:.2f}x]")
                text.append("—" if r["programs"] == 0 else f"{r['median_us']:.1f} us{ratio}")
            lines.append(f"| {name} | " + " | ".join(text) + " |")
        lines.append("")
    return "\n".join(lines)


def _fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f}x [{r[1]:.2f}-{r[2]:.2f}]"


def markdown(rows: list[dict[str, Any]], bw: float, command: str, streamed: tuple[int, ...] = ()) -> str:
    device = current_device()
    cpu_model, _ = read_cpuinfo()
    path = cpu_kernels.path() if cpu_kernels.AVAILABLE else f"not available ({cpu_kernels.unavailable_reason()})"
    lines = [f"# autopolicy's CPU kernels (XLA FFI) on {cpu_model or device.device_kind}", "",
             f"Measured {datetime.date.today()} with `{command}`.", ""] + device_lines(device, cpu_model) + [
             f"- CPU kernel path: `{path}`; memory bandwidth (read-only sum of 256 MB, the highest of the "
             f"probes before each shape): {bw / 1e9:.1f} GB/s", "",
             "Each cell: median time per call, and the paired ratio to float32 (median [quartiles] over rounds; "
             "> 1 is faster); at batch 1, the share of the bandwidth limit (weight bytes / time / bandwidth).", ""]
    if streamed:
        lines += [f"Batch{'es' if len(streamed) > 1 else ''} {', '.join(map(str, streamed))}: timed as a decoder runs its layers, in programs of "
                  "dependent calls cycling through copies of the weights (\"cached\": fewer bytes of copies than "
                  "twice the largest cache, so partly read from it); other batches in the search's timing loop.", ""]
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
            cell = f"{r['median_us']:.0f} us, {_fmt(r['vs_float32'])}"
            if key[1] == 1:
                cell += f", {100 * r['bytes_per_s'] / bw:.0f}% bw" + ("" if r.get("streamed", True) else " (cached)")
            text.append(cell)
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def dims(text: str, names: str, example: str) -> tuple[int, ...]:
    """The sizes of a shape argument such as ``576x1536``, one per letter of ``names`` (``"KN"``,
    ``"MKN"``), each positive; a bad one is named with ``example``."""
    parts = text.lower().split("x")
    if len(parts) != len(names) or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is {' x '.join(names)}, e.g. {example}; got {text!r}")
    sizes = tuple(int(p) for p in parts)
    if min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"{', '.join(names[:-1])} and {names[-1]} must be positive; got {text!r}")
    return sizes


def _shape(text: str) -> tuple[int, int]:
    """``(K, N)`` of a ``KxN`` shape argument, e.g. ``576x1536``."""
    return dims(text, "KN", "576x1536")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=list(SHAPES), help="K x N, e.g. 576x1536")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default: 9; 12 with --ramp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streamed-batches", nargs="*", type=int, default=[1],
                        help="batches timed as a decoder runs its layers: chains of dependent calls "
                             "cycling through copies of the weights (default: 1; none: every batch in the timing loop)")
    parser.add_argument("--warm", type=_seconds, default=0.05,
                        help="seconds each streamed candidate runs untimed after the pause before each sample "
                             "(default 0.05: see --ramp)")
    parser.add_argument("--ramp", action="store_true",
                        help="print how the streamed candidates' time per call settles after the pause "
                             "(the windows of up to 5-160 ms after it), instead of the benchmark")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, e.g. 0.05; got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"seconds must be 0 or more; got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_cpu_kernels.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                                             if (argv if argv is not None else sys.argv[1:]) else "")
    budget = max(64 << 20, 2 * _cache_bytes())
    if args.ramp:
        rows = []
        for k, n in args.shapes:
            for m in args.batches:
                rows += ramp(m, k, n, args.repeats or 12, args.seed, budget)
        cpu_model, _ = read_cpuinfo()
        path = cpu_kernels.path() if cpu_kernels.AVAILABLE else f"not available ({cpu_kernels.unavailable_reason()})"
        text = "\n".join([f"Measured {datetime.date.today()} with `{command}`.", ""]
                         + device_lines(current_device(), cpu_model) + [f"- CPU kernel path: `{path}`", "", ramp_markdown(rows)])
        if args.out:
            _atomic.write_text(args.out, text)
        print(text)
        return 0
    bw = bandwidth()
    print(f"bandwidth: {bw / 1e9:.1f} GB/s", file=sys.stderr)
    rows = []
    for k, n in args.shapes:
        bw = max(bw, bandwidth(1.0))  # the machine's memory is shared: the limit is the best it gave
        for m in args.batches:
            # 9 rounds at every batch: with 5 at batch 256 the 2-core EPYC's medians of one shape
            # moved far between runs (int8 576 x 576: 1.56x and 1.14x float32 in two runs of 5
            # rounds, 1.67x in one of 15).
            repeats = args.repeats or 9
            if m in args.streamed_batches:
                new = bench_streamed(m, k, n, repeats, args.seed, budget=budget, warm=args.warm)
            else:
                new = bench(m, k, n, repeats, args.seed)
            rows += new
            print(f"{k}x{n} batch {m}: " + ", ".join(f"{r['name']} {_fmt(r['vs_float32'])}" for r in new),
                  file=sys.stderr)
    text = markdown(rows, bw, command, tuple(sorted(set(args.streamed_batches) & set(args.batches))))
    cpu_model, _ = read_cpuinfo()
    out = args.out or os.path.join("reports", f"cpu-kernels-{device_slug(current_device(), cpu_model)}.md")
    _atomic.write_text(out, text)
    print(text)
    print(f"written {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
