"""Which part of int4's XLA path goes wrong on a GPU: each variant's int32 accumulators (or the
whole product) on the default backend against numpy's, exactly.

    python experiments/gpu_int4_diag.py [--hlo DIR]

Prints one line per shape and variant: ``ok`` or the largest difference and the fraction of
entries that differ. ``--hlo DIR`` writes the optimized HLO of two variants (the package's, the int32 unpack) of the first
shape.
On a CPU every line should read ``ok``; this was written for the H200, where the batched int8
dot of the unpacked kernel gave wrong values (reports/gpu-h200-tune-2026-11-27.md).
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import int4, int8

#: int8's default path on the same kind of shapes, small contractions among them (m, k, n).
INT8_SHAPES = [(6, 48, 10), (5, 2, 12), (5, 3, 7), (4, 16, 33), (1, 576, 1536), (7, 130, 24)]
SHAPES = [(6, 48, 10, 16), (1, 576, 1536, 32), (7, 64, 24, int4.PER_CHANNEL), (3, 128, 40, 64), (5, 50, 12, 16)]


def _unpack_masked(packed, k):
    """Sign extension by arithmetic on int32, no 8-bit shifts."""
    p = packed.astype(jnp.int32)
    low, high = (p & 15), (p >> 4)
    both = jnp.stack([low, high], axis=1)
    both = jnp.where(both >= 8, both - 16, both).astype(jnp.int8)
    q = both.reshape((2 * packed.shape[0],) + packed.shape[1:])
    return q[:k]


def _unpack_xor(packed, k):
    """((nibble ^ 8) - 8) in uint8 then a bitcast: no shifts on signed bytes."""
    low = (packed & np.uint8(15)) ^ np.uint8(8)
    high = jax.lax.shift_right_logical(packed, np.uint8(4)) ^ np.uint8(8)
    both = jnp.stack([low, high], axis=1).astype(jnp.int16) - 8
    q = both.astype(jnp.int8).reshape((2 * packed.shape[0],) + packed.shape[1:])
    return q[:k]


def _batched(q, xq, groups, block):
    if groups == 1:
        return jnp.matmul(xq, q, preferred_element_type=jnp.int32)[None]
    n = q.shape[1]
    xb, qb = xq.reshape((xq.shape[0], groups, block)), q.reshape((groups, block, n))
    return jnp.einsum("mgb,gbn->gmn", xb, qb, preferred_element_type=jnp.int32)


def _looped(q, xq, groups, block, acc=jnp.int32):
    k = q.shape[0]
    return jnp.stack([jnp.matmul(xq[:, g * block:min(k, (g + 1) * block)], q[g * block:min(k, (g + 1) * block)],
                                 preferred_element_type=acc, precision="highest") for g in range(groups)])


def _variants(k, groups, block):
    exact = groups * block == k
    mm = _batched if exact else _looped
    return {
        "unpack alone": lambda xq, p: int4._unpack(p, k).astype(jnp.int32),
        "unpack+dot (package)": lambda xq, p: mm(int4._unpack(p, k), xq, groups, block),
        "unpack|barrier|dot": lambda xq, p: mm(jax.lax.optimization_barrier(int4._unpack(p, k)), xq, groups, block),
        "unpack+dot looped": lambda xq, p: _looped(int4._unpack(p, k), xq, groups, block),
        "masked int32 unpack+dot": lambda xq, p: mm(_unpack_masked(p, k), xq, groups, block),
        "xor uint8 unpack+dot": lambda xq, p: mm(_unpack_xor(p, k), xq, groups, block),
        "int32 dot": lambda xq, p: mm(int4._unpack(p, k).astype(jnp.int32), xq.astype(jnp.int32), groups, block),
        "f32 dot": lambda xq, p: jnp.round(_f32(int4._unpack(p, k), xq, groups, block)).astype(jnp.int32),
    }


def _f32(q, xq, groups, block):
    if groups * block == q.shape[0] and groups > 1:
        n = q.shape[1]
        return jnp.einsum("mgb,gbn->gmn", xq.astype(jnp.float32).reshape((xq.shape[0], groups, block)),
                          q.astype(jnp.float32).reshape((groups, block, n)), precision="highest")
    return _looped(q.astype(jnp.float32), xq.astype(jnp.float32), groups, block, acc=jnp.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hlo", type=pathlib.Path, default=None)
    args = ap.parse_args()
    print("jax", jax.__version__, jax.devices())
    rng = np.random.default_rng(0)
    for si, (m, k, n, bs) in enumerate(SHAPES):
        block = k if bs == int4.PER_CHANNEL else bs
        groups = int4.block_count(k, bs)
        w = rng.standard_normal((k, n)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        with jax.default_device(jax.devices("cpu")[0]):
            q, scale = int4.quantize_int4(jnp.asarray(w), bs)
            packed = np.asarray(int4.pack_int4(q))
            q = np.asarray(q).astype(np.int64)
            amax = np.abs(x).max(axis=1, keepdims=True)
            xq = np.clip(np.round(x / (amax / 127)), -127, 127).astype(np.int8)
            y_cpu = np.asarray(int4._int4_product(jnp.asarray(x), jnp.asarray(packed), scale,
                                                  jnp.zeros_like(scale, jnp.int32), bs, jnp.float32, "xla"))
        qp = np.pad(q, [(0, groups * block - k), (0, 0)])
        xp = np.pad(xq.astype(np.int64), [(0, 0), (0, groups * block - k)])
        ref = np.einsum("mgb,gbn->gmn", xp.reshape(m, groups, block), qp.reshape(groups, block, n))
        y_dev = np.asarray(jax.jit(lambda a, b, c: int4._int4_product(a, b, c, jnp.zeros_like(c, jnp.int32), bs, jnp.float32,
                                                                        "xla"))(x, packed, np.asarray(scale)))
        rel = np.abs(y_dev - y_cpu).max() / np.abs(y_cpu).max()
        print(f"shape m={m} k={k} n={n} block={bs}: whole product on {jax.default_backend()} vs cpu: "
              f"rel. max diff {rel:.3g}; |y_dev| max {np.abs(y_dev).max():.4g}, |y_cpu| max {np.abs(y_cpu).max():.4g}")
        for name, fn in _variants(k, groups, block).items():
            want = q if name == "unpack alone" else ref
            f = jax.jit(fn)
            got = np.asarray(f(xq, packed)).astype(np.int64)
            if got.shape != want.shape:
                print(f"  {name:26s} shape {got.shape} != {want.shape}")
                continue
            bad = got != want
            status = "ok" if not bad.any() else (f"WRONG: max |diff| {np.abs(got - want).max()}, "
                                                  f"{bad.mean():.1%} differ, |got| max {np.abs(got).max()}")
            print(f"  {name:26s} {status}")
            if args.hlo and si == 0 and name in ("unpack+dot (package)", "masked int32 unpack+dot"):
                args.hlo.mkdir(parents=True, exist_ok=True)
                text = f.lower(xq, packed).compile().as_text()
                (args.hlo / (name.replace(" ", "_").replace("|", "-").replace("+", "-").replace("(", "").replace(")", "")
                             + ".txt")).write_text(text)

    for m, k, n in INT8_SHAPES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        kq, ks = (np.asarray(a) for a in int8.quantize_symmetric(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), (0,)))
        fn = jax.jit(lambda a, b, c: int8.int8_einsum("mk,kn->mn", a, b, c, jnp.float32))
        acc = jax.jit(lambda a, b: int8.int8_accumulate("mk,kn->mn", a, b))
        xq = np.clip(np.round(x * 20), -127, 127).astype(np.int8)
        with jax.default_device(jax.devices("cpu")[0]):
            want = np.asarray(fn(x, kq, ks))
        got = np.asarray(fn(x, kq, ks))
        exact = xq.astype(np.int64) @ kq.astype(np.int64)
        acc_ok = np.array_equal(np.asarray(acc(xq, kq)).astype(np.int64), exact)
        rel = np.abs(got - want).max() / np.abs(want).max()
        print(f"int8 m={m} k={k} n={n}: product rel. max diff vs cpu {rel:.3g}; accumulators "
              f"{'ok' if acc_ok else 'WRONG'}")

    # XLA's own s8 x s8 -> s32 dot (not the package's path) over contractions of 1 to 20.
    raw = jax.jit(lambda a, b: jnp.einsum("mk,kn->mn", a, b, preferred_element_type=jnp.int32))
    wrong = []
    for k in range(1, 21):
        a = rng.integers(-127, 128, (5, k)).astype(np.int8)
        b = rng.integers(-127, 128, (k, 7)).astype(np.int8)
        if not np.array_equal(np.asarray(raw(a, b)).astype(np.int64), a.astype(np.int64) @ b.astype(np.int64)):
            wrong.append(k)
    print(f"XLA's s8 x s8 -> s32 dot (5, K) x (K, 7), K = 1..20: wrong for K in {wrong}")


if __name__ == "__main__":
    main()
