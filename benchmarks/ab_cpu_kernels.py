"""Paired A/B of two builds of autopolicy's CPU kernels: the installed library against another
build of the same FFI handlers (say, main's), kernel alone, on the same inputs.

The other library is loaded with ctypes and its handlers registered under other FFI target
names, so both run in one process; each round calls every (build, kernel) once, in a fresh
random order, each call timed as the mean of several back-to-back calls (weights stay in cache
where they fit: these are kernel figures, not the layer figures of bench_cpu_kernels.py). The
speedup is the median over rounds of old time / new time, with its quartiles. int8 results must
be equal, int4 within float32 rounding (builds may round the block sums differently).

With ``--layers`` it times whole layers instead (float input, float output), as a model runs
them: a jitted chain of ``--chain`` dependent calls (each input nudged by the previous output,
so no call overlaps another; each variant cycling through its own copies of the weights, about
64 MB of them, so they stream from memory as a decoder's do), per call: float32 XLA dot; the
other build's fused int8 and int4 layer handlers (for a build older than them: its int8 and int4
kernels between the package's XLA quantization and rescale); and the installed build's fused
``cpu_kernels.int8_dense`` / ``int4_dense``. Outputs must be equal (int8, int4 per channel) bit
for bit. ``--bias`` gives every layer a bias (as a model's Dense has: the fused calls add it).

With ``--weight-only`` it times the GPTQ/AWQ kernel (``cpu_weight_only.weight_only_matmul``)
of both builds instead, kernel alone, for 8 and 4 bits per channel, 4 bits in groups of 32 and
128, and 8 bits in groups of 128 (outputs within 1e-5 of the largest); with ``--layers`` as well,
in chains that stream their weights from memory, beside float32 XLA.

Build the other library from a commit, for instance::

    git archive main autopolicy/numerics/cpu | tar -x -C /tmp/old
    g++ -O3 -std=c++17 -fPIC -shared -I"$(python -c 'import jax.ffi; print(jax.ffi.include_dir())')" \\
        -I/tmp/old/autopolicy/numerics/cpu /tmp/old/autopolicy/numerics/cpu/*.cc -o /tmp/old.so
    python benchmarks/ab_cpu_kernels.py --old /tmp/old.so --shapes 4096x4096 --batches 1 32 256
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import cpu_kernels, int4, int8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_kernels import next_input  # noqa: E402


def _timer(fn, args, reps):
    jax.block_until_ready(fn(*args))

    def run():
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / reps
    return run


def compare(k: int, n: int, m: int, rounds: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    w8 = jnp.asarray(rng.integers(-128, 128, (k, n)).astype(np.int8))
    packed = int4.pack_int4(jnp.asarray(rng.integers(-8, 8, (k, n)).astype(np.int8)))
    x8 = jnp.asarray(rng.integers(-127, 128, (m, k)).astype(np.int8))
    scales = {block: jnp.asarray(rng.uniform(0.01, 2.0, (-(-k // block), n)).astype(np.float32)) for block in (k, 32)}

    def old_int8(x, w):
        return jax.ffi.ffi_call("ab_old_int8", jax.ShapeDtypeStruct((m, n), jnp.int32))(x, w, **_OLD_ATTRS)

    def old_int4(block):
        return lambda x, p, s: jax.ffi.ffi_call("ab_old_int4", jax.ShapeDtypeStruct((m, n), jnp.float32))(
            x, p, s, block=block, **_OLD_ATTRS)

    def new_int4(block):
        return lambda x, p, s: cpu_kernels.int4_matmul(x, p, s, block)

    kernels = {"int8": (jax.jit(old_int8), jax.jit(cpu_kernels.int8_matmul), (x8, w8), k * n)}
    for block, name in ((k, "int4"), (32, "int4/32")):
        kernels[name] = (jax.jit(old_int4(block)), jax.jit(new_int4(block)), (x8, packed, scales[block]),
                         k * n // 2 + (0 if block == k else k * n // 8))
    reps = max(1, min(10, int(2e8 / (m * k * n))))
    runs = {}
    for name, (old_fn, new_fn, args, _) in kernels.items():
        a, b = np.asarray(old_fn(*args)), np.asarray(new_fn(*args))
        if name == "int8":
            np.testing.assert_array_equal(a, b)
        else:
            assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), name
        runs[(name, "old")] = _timer(old_fn, args, reps)
        runs[(name, "new")] = _timer(new_fn, args, reps)
    times = _interleaved(runs, rounds, rng)
    cells = [_old_new(name, times, nbytes) for name, (_, _, _, nbytes) in kernels.items()]
    return f"{k}x{n} batch {m}: " + " | ".join(cells)


def _interleaved(runs: dict, rounds: int, rng: np.random.Generator) -> dict:
    """Each timer's samples over ``rounds`` rounds, every round in a fresh random order."""
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for i in rng.permutation(len(runs)):
            key = list(runs)[i]
            times[key].append(runs[key]())
    return times


def _old_new(name: str, times: dict, nbytes: int) -> str:
    """One kernel's old and new medians, the new one's GB/s, and the old/new ratio's quartiles."""
    o, w = np.array(times[(name, "old")]), np.array(times[(name, "new")])
    ratio = o / w
    return (f"{name}: {np.median(o) * 1e6:.0f} -> {np.median(w) * 1e6:.0f} us "
            f"({nbytes / np.median(w) / 1e9:.1f} GB/s), {np.median(ratio):.2f}x "
            f"[{np.percentile(ratio, 25):.2f}-{np.percentile(ratio, 75):.2f}]")


def compare_weight_only(k: int, n: int, m: int, rounds: int, seed: int = 0) -> str:
    """The installed build's weight-only kernel against the other build's, same operands."""
    from autopolicy.numerics import cpu_weight_only, weight_only

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    runs, kinds = {}, {}
    for bits, group in ((8, k), (4, k), (4, 32), (4, 128), (8, 128)):
        groups = -(-k // group)
        q = jnp.asarray(rng.integers(0, 2**bits, (n, k)))
        scale = jnp.asarray(rng.uniform(0.01, 0.2, (n, groups)).astype(np.float32))
        zero = jnp.asarray(rng.integers(0, 2**bits, (n, groups)).astype(np.uint8))
        stored = weight_only.pack(q, bits) if bits == 4 else q.astype(jnp.uint8)
        g_idx = jnp.asarray(weight_only.group_index(k, group))
        name = f"{bits}-bit/{'channel' if group == k else group}"

        def old(x_, q_, s_, z_, g_, bits=bits, group=group):
            return jax.ffi.ffi_call("ab_old_weight_only", jax.ShapeDtypeStruct((m, n), jnp.float32))(
                x_, q_, s_, z_, g_, bits=np.int64(bits), group=np.int64(group), **_OLD_WEIGHT_ONLY_ATTRS)

        def new(x_, q_, s_, z_, g_, bits=bits, group=group):
            return cpu_weight_only.weight_only_matmul(x_, q_, s_, z_, bits, group, g_)

        args = (x, stored, scale, zero, g_idx)
        a, b = np.asarray(jax.jit(old)(*args)), np.asarray(jax.jit(new)(*args))
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), name
        kinds[name] = n * k * bits // 8
        runs[(name, "old")] = _timer(jax.jit(old), args, 10)
        runs[(name, "new")] = _timer(jax.jit(new), args, 10)
    times = _interleaved(runs, rounds, rng)
    return f"{k}x{n} batch {m}: " + " | ".join(_old_new(name, times, nbytes) for name, nbytes in kinds.items())


def _chains_interleaved(fns: dict, work: int, chain: int, rounds: int, rng: np.random.Generator) -> dict:
    """Seconds per layer call of each ``{name: (chained fn, args)}``, over ``rounds`` rounds in
    fresh random orders (each sample: a few back-to-back runs of the chain, ``work`` products each)."""
    reps = max(1, min(20, int(2e7 / work)))
    return _interleaved({name: _scaled(_timer(fn, args, reps), 1 / chain) for name, (fn, args) in fns.items()},
                        rounds, rng)


def _scaled(run, factor):
    return lambda: run() * factor


def compare_weight_only_layers(k: int, n: int, m: int, rounds: int, chain: int, seed: int = 0,
                               budget: float = 64e6) -> str:
    """The weight-only kernels of both builds (and float32 XLA) as a decoder meets them: each in a
    jitted chain of dependent calls cycling through its own copies of the weights, about
    ``budget`` bytes of them, so they stream from memory rather than the L3 cache."""
    from autopolicy.numerics import cpu_weight_only, weight_only

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    f32_copies = max(1, min(chain, int(budget // (4 * k * n))))
    fns = {"f32": (_chain(lambda x, w: x @ w, chain),
                   (x, [(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)),) for _ in range(f32_copies)]))}
    kinds = {}
    for bits, group in ((8, k), (4, k), (4, 32), (8, 128)):
        groups = -(-k // group)
        name = f"{bits}-bit/{'channel' if group == k else group}"
        kinds[name] = n * k * bits // 8
        weights = []
        for _ in range(max(1, min(chain, int(budget // kinds[name])))):
            q = jnp.asarray(rng.integers(0, 2**bits, (n, k)))
            weights.append((weight_only.pack(q, bits) if bits == 4 else q.astype(jnp.uint8),
                            jnp.asarray(rng.uniform(0.01, 0.2, (n, groups)).astype(np.float32)),
                            jnp.asarray(rng.integers(0, 2**bits, (n, groups)).astype(np.uint8)),
                            jnp.asarray(weight_only.group_index(k, group))))

        def old(x_, q_, s_, z_, g_, bits=bits, group=group):
            return jax.ffi.ffi_call("ab_old_weight_only", jax.ShapeDtypeStruct((m, n), jnp.float32))(
                x_, q_, s_, z_, g_, bits=np.int64(bits), group=np.int64(group), **_OLD_WEIGHT_ONLY_ATTRS)

        def new(x_, q_, s_, z_, g_, bits=bits, group=group):
            return cpu_weight_only.weight_only_matmul(x_, q_, s_, z_, bits, group, g_)

        fns[f"{name} old"] = (_chain(old, chain), (x, weights))
        fns[f"{name} new"] = (_chain(new, chain), (x, weights))
        a, b = (np.asarray(fns[f"{name} {v}"][0](*fns[f"{name} {v}"][1])) for v in ("old", "new"))
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a)), name
    times = _chains_interleaved(fns, m * k * n * chain, chain, rounds, rng)
    med = {name: np.median(t) for name, t in times.items()}
    cells = [f"f32 {med['f32'] * 1e6:.0f} us"]
    for name, nbytes in kinds.items():
        o, w = np.array(times[f"{name} old"]), np.array(times[f"{name} new"])
        cells.append(f"{name}: {np.median(o) * 1e6:.0f} -> {np.median(w) * 1e6:.0f} us ({nbytes / np.median(w) / 1e9:.1f} "
                     f"GB/s), new/old {np.median(o / w):.2f}x [{np.percentile(o / w, 25):.2f}-"
                     f"{np.percentile(o / w, 75):.2f}], vs f32 {med['f32'] / np.median(w):.2f}x")
    return f"{k}x{n} batch {m} (per layer, streamed): " + " | ".join(cells)


def _chain(layer, length):
    """``length`` dependent calls of ``layer(x, *weights[i % len(weights)])``, each input made
    from the first and the output before (bench_cpu_kernels.next_input: every call waits for the
    one before, as layers of a model do, with no chain of adds for XLA to recompute)."""
    def run(x, weights):
        y, x0 = None, x
        for i in range(length):
            y = layer(x, *weights[i % len(weights)])
            x = next_input(x0, y)
        return y
    return jax.jit(run)


# Whether the other build has the fused layer handlers (set in main): then its layers are timed
# through them, so --layers compares build with build; older builds' layers are the package's XLA
# quantization and rescale around their int8/int4 kernels.
_OLD_FUSED = False
# The attributes every int8/int4 call of the other build takes beyond its operands' (builds from
# autopolicy_cpu_ffi_version 2 name a SIMD path; "" is the one in use).
_OLD_ATTRS: dict = {}
# The same for its weight-only calls (from autopolicy_cpu_ffi_version 3).
_OLD_WEIGHT_ONLY_ATTRS: dict = {}


def _old_int8_layer(x, w, w_scale, b=None):
    if _OLD_FUSED:
        bias, out = cpu_kernels._dense_operands("int8_dense", x, w.shape[1], b, None)
        return jax.ffi.ffi_call("ab_old_int8_dense", out)(x, w, w_scale.reshape((w.shape[1],)), bias, **_OLD_ATTRS)
    xq, xs = int8.quantize_symmetric(x, (1,))
    acc = jax.ffi.ffi_call("ab_old_int8", jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.int32))(xq, w, **_OLD_ATTRS)
    y = acc.astype(jnp.float32) * (xs * w_scale)
    return y if b is None else y + b


def _old_int4_layer(x, packed, scale, b=None):
    k = x.shape[1]
    if _OLD_FUSED:
        bias, out = cpu_kernels._dense_operands("int4_dense", x, packed.shape[1], b, None)
        return jax.ffi.ffi_call("ab_old_int4_dense", out)(x, packed, scale, bias, block=int(k), **_OLD_ATTRS)
    xq, xs = int8.quantize_symmetric(x, (1,))
    y = jax.ffi.ffi_call("ab_old_int4", jax.ShapeDtypeStruct((x.shape[0], packed.shape[1]), jnp.float32))(
        xq, packed, scale, block=k, **_OLD_ATTRS)
    return y * xs if b is None else y * xs + b


def compare_layers(k: int, n: int, m: int, rounds: int, chain: int, seed: int = 0, budget: float = 64e6,
                   bias: bool = False) -> str:
    """Each variant's chain cycles through its own copies of the weights, about ``budget`` bytes
    of them (more than the L3 cache: the weights stream from memory, as a decoder's do). With
    ``bias`` every layer adds one (a model's Dense does)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    copies = {kind: max(1, min(chain, int(budget // (k * n * per)))) for kind, per in (("f32", 4), ("int8", 1),
                                                                                    ("int4", 0.5))}
    floats = [jnp.asarray(np.random.default_rng(seed + c).standard_normal((k, n)).astype(np.float32))
              for c in range(max(copies.values()))]
    b = jnp.asarray(rng.standard_normal((n,)).astype(np.float32)) if bias else None
    w8 = [(*int8.quantize_symmetric(w, (0,)), b) for w in floats[:copies["int8"]]]
    w4 = [(int4.pack_int4(q), s, b) for q, s in (int4.quantize_int4(w, int4.PER_CHANNEL) for w in floats[:copies["int4"]])]
    fns = {
        "f32": (_chain(lambda x, w, b: x @ w if b is None else x @ w + b, chain),
                (x, [(w, b) for w in floats[:copies["f32"]]])),
        "int8 old": (_chain(_old_int8_layer, chain), (x, w8)),
        "int8 new": (_chain(lambda x, w, s, b: cpu_kernels.int8_dense(x, w, s, b), chain), (x, w8)),
        "int4 old": (_chain(_old_int4_layer, chain), (x, w4)),
        "int4 new": (_chain(lambda x, p, s, b: cpu_kernels.int4_dense(x, p, s, k, b), chain), (x, w4)),
    }
    for kind in ("int8", "int4"):
        a, b = (np.asarray(fns[f"{kind} {v}"][0](*fns[f"{kind} {v}"][1])) for v in ("old", "new"))
        np.testing.assert_array_equal(a, b, err_msg=kind)
    del floats
    times = _chains_interleaved(fns, m * k * n * chain, chain, rounds, rng)
    med = {name: np.median(t) for name, t in times.items()}
    cells = [f"{name} {med[name] * 1e6:.1f}" for name in fns]
    gains = [f"{kind} new/old {np.median(np.array(times[f'{kind} old']) / np.array(times[f'{kind} new'])):.2f}x, "
             f"vs f32 {med['f32'] / med[f'{kind} new']:.2f}x" for kind in ("int8", "int4")]
    return f"{k}x{n} batch {m} (us/layer): " + ", ".join(cells) + " | " + "; ".join(gains)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the other build's shared library")
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "576x1536"], help="K x N")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", action="store_true", help="time whole layers (float in, float out)")
    parser.add_argument("--chain", type=int, default=16, help="dependent layer calls per jitted program")
    parser.add_argument("--bias", action="store_true", help="with --layers: every layer adds a bias")
    parser.add_argument("--weight-only", action="store_true", help="time the GPTQ/AWQ weight-only kernel")
    parser.add_argument("--old-path", default=None,
                        help="the SIMD path the other build runs (say, avx2 against the installed "
                             "build's avx512_vnni: two paths of one build side by side)")
    args = parser.parse_args(argv)
    if not cpu_kernels.AVAILABLE:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    lib = ctypes.CDLL(args.old)
    if args.old_path is not None:
        lib.autopolicy_cpu_set_path.argtypes = [ctypes.c_char_p]
        lib.autopolicy_cpu_set_path.restype = ctypes.c_int
        if not lib.autopolicy_cpu_set_path(args.old_path.encode()):
            print(f"the other build cannot run path {args.old_path!r} here; this CPU runs "
                  f"{list(cpu_kernels.supported_paths())}", file=sys.stderr)
            return 2
    jax.ffi.register_ffi_target("ab_old_int8", jax.ffi.pycapsule(lib.AutopolicyInt8Matmul), platform="cpu")
    jax.ffi.register_ffi_target("ab_old_int4", jax.ffi.pycapsule(lib.AutopolicyInt4Matmul), platform="cpu")
    global _OLD_FUSED, _OLD_ATTRS, _OLD_WEIGHT_ONLY_ATTRS
    version = lib.autopolicy_cpu_ffi_version() if hasattr(lib, "autopolicy_cpu_ffi_version") else 1
    _OLD_ATTRS = {"path": ""} if version >= 2 else {}
    _OLD_WEIGHT_ONLY_ATTRS = {"path": ""} if version >= 3 else {}
    _OLD_FUSED = hasattr(lib, "AutopolicyInt8Dense") and hasattr(lib, "AutopolicyInt4Dense")
    if _OLD_FUSED:
        jax.ffi.register_ffi_target("ab_old_int8_dense", jax.ffi.pycapsule(lib.AutopolicyInt8Dense), platform="cpu")
        jax.ffi.register_ffi_target("ab_old_int4_dense", jax.ffi.pycapsule(lib.AutopolicyInt4Dense), platform="cpu")
    if args.weight_only:
        jax.ffi.register_ffi_target("ab_old_weight_only", jax.ffi.pycapsule(lib.AutopolicyWeightOnlyMatmul),
                                    platform="cpu")
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        for m in args.batches:
            if args.weight_only and args.layers:
                print(compare_weight_only_layers(k, n, m, args.rounds, args.chain), flush=True)
            elif args.weight_only:
                print(compare_weight_only(k, n, m, args.rounds), flush=True)
            elif args.layers:
                print(compare_layers(k, n, m, args.rounds, args.chain, bias=args.bias), flush=True)
            else:
                print(compare(k, n, m, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
