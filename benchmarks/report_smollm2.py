"""The SmolLM2-135M report: perplexity, weight bytes and decode speed of float32, every uniform
policy, a llama.cpp Q4_K_M-style hand recipe and tuned maps, measured side by side in one run;
generated text from float32 and a tuned model; the per-layer sensitivity heatmap of a tune run.

    .venv/bin/python benchmarks/report_smollm2.py --out reports/smollm2-<machine-class> \
        [--tuned runs/smollm2] [--tuned-budget runs/smollm2-40pct ...] [--reps 15]

Each configuration is built from the float32 model (``experiments/smollm2.py``); quantized
layers run autopolicy's CPU kernels (``cpu_ffi``) where the layer offers them, tuned maps run
the kernels their tune chose (``profile.csv``). Perplexity is that of the held-out split
(``smollm2.WINDOWS`` windows of ``smollm2.WINDOW`` tokens, the tune's ``test_fn``); decode is
one step at batch 1 and cache ``smollm2.CACHE``, timed with every configuration interleaved
(jit, warm-up, ``block_until_ready``), medians with quartiles, and each configuration's speed-up
over float32 from the per-round ratios. Weight bytes are ``model.nbytes()``: every array in
its stored dtype (the tied embedding table and head are separate copies, as the tuner counts
them). Writes ``README.md`` and ``results.json`` (and ``sensitivity.png`` for a tune run with
per-layer costs) atomically into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "experiments")]  # the other benchmarks; the tasks
import smollm2  # noqa: E402

import autopolicy as ap  # noqa: E402
from autopolicy import _atomic, nn  # noqa: E402
from autopolicy.nn import _base, generation  # noqa: E402
from autopolicy.numerics import cpu_kernels  # noqa: E402
from autopolicy.search import confidence, hardware  # noqa: E402

UNIFORM = ("mixed_bfloat16", "int8_from_float32", "int4_from_float32", "int4/128_from_float32",
           "int4/32_from_float32", "gptq/8/-1_from_float32", "gptq/4/32_from_float32")
KINDS = ("attention/query", "attention/key", "attention/value", "attention/attention_output",
         "mlp/gate", "mlp/up", "mlp/down")
PROMPTS = ("The capital of France is", "Python is a programming language that",
           "def fibonacci(n):")
FFI = "cpu_ffi"


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for which of n repeated tensors get the larger type in its _M recipes:
    the first and last eighth of the blocks, and every third block in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_map(model, blocks: int) -> dict[str, str]:
    """The Q4_K_M recipe as a map of this package's policies: the tensors llama.cpp gives 6 bits
    (the attention value and feed-forward down projections of the blocks ``_more_bits`` picks,
    and the tied embedding/output table, both its paths) on int8, every other weight matrix on 4 bits in blocks of 32 (Q4_K's
    sub-block size), the norms in float32."""
    policies = {}
    for path in model.layers_by_path():
        name = path.split("/", 1)[1]
        if name.endswith("norm"):
            continue
        more = name in ("embedding", "head")  # one tied tensor in the GGUF: llama.cpp's output type
        for kind in ("attention/value", "mlp/down"):
            if name.endswith(kind):
                more = _more_bits(int(name.split("/")[0].split("_")[1]), blocks)
        policies[path] = "int8_from_float32" if more else "int4/32_from_float32"
    return policies


def with_kernels(model, kernels: dict[str, str] | None = None):
    """The model with ``kernels`` (path -> kernel), or cpu_ffi on every layer that offers it."""
    if kernels is None:
        kernels = {p: FFI for p, layer in model.layers_by_path().items()
                   if layer.quantization_mode is not None and FFI in layer.kernel_choices()}
    return model.with_kernels(kernels) if kernels else model


def tuned_from_run(run: pathlib.Path) -> tuple[dict[str, str], dict[str, str], dict]:
    """``(policies, kernels, summary)`` of a tune run directory: the chosen map, the kernel the
    tune chose for each chosen layer (``profile.csv``), and ``summary.json``."""
    import json  # pylint: disable=import-outside-toplevel

    summary = json.loads((run / "summary.json").read_text())
    policies = dict(summary["chosen"]["policies"])
    kernels = {}
    with open(run / "profile.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("chosen") == "True" and row.get("kernel"):
                kernels[row["layer"]] = row["kernel"]
    return policies, kernels, summary


def calibration_batches(tok) -> list[tuple]:
    """The experiment's calibration batches, as the tune calibrates GPTQ/AWQ layers on them."""
    calibration = smollm2.windows(tok, "calibration", None)
    return [(calibration[smollm2.WINDOWS : smollm2.WINDOWS + smollm2.BATCH],)]


def calibrated(built, model, batches, cache: dict):
    """``built`` with its GPTQ/AWQ layers calibrated as the tune does (each alone, on its float
    inputs: ``sequential=False``), so a layer is calibrated once per policy across every
    configuration: from the uniform model of that policy, calibrated once and kept in ``cache``."""
    wanted = {p: layer.dtype_policy.name for p, layer in built.layers_by_path().items()
              if layer.quantization_mode in ("gptq", "awq")}
    for policy in sorted(set(wanted.values()) - set(cache)):
        t0 = time.perf_counter()
        cache[policy] = nn.calibrate_weights(model.with_dtype_policy(policy), batches,
                                             sequential=False).layers_by_path()
        print(f"calibrated {policy} in {time.perf_counter() - t0:.0f} s", flush=True)
    if not wanted:
        return built
    return _base.map_modules(built, lambda m: cache[wanted[m.path]][m.path] if m.path in wanted else None)


def time_decode(models: dict, cache_length: int, reps: int, inner: int, warm: int = 1) -> dict[str, np.ndarray]:
    """Seconds per decode step, ``reps`` interleaved rounds per model of ``inner`` greedy steps in
    one compiled loop (``generation.decode_steps``, the loop ``greedy_generate`` runs) ending at
    position ``cache_length - 1``, each after ``warm`` untimed calls of that model."""
    token = jnp.zeros((1,), jnp.int32)
    start = cache_length - inner
    caches = {name: m.init_cache(1, cache_length) for name, m in models.items()}

    def step(name):
        for _ in range(warm):  # the model before left its weights in the caches: steady state only
            out, caches[name] = generation.decode_steps(models[name], caches[name], token, start, inner)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        out, caches[name] = generation.decode_steps(models[name], caches[name], token, start, inner)  # donated
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / inner

    for name in models:
        step(name), step(name)
    samples = {name: [] for name in models}
    for r in range(reps):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for name in order:
            samples[name].append(step(name))
    return {name: np.asarray(s) for name, s in samples.items()}


def heatmap(profile: pathlib.Path, out: pathlib.Path, blocks: int) -> str | None:
    """A blocks x layer-kinds heatmap per candidate of the tune's per-layer accuracy costs (the
    estimate or the measurement the tune used), or None when the profile has no costs."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    costs: dict[str, np.ndarray] = {}
    with open(profile, newline="") as f:
        for row in csv.DictReader(f):
            value = row.get("accuracy_cost") or ""
            name = row["layer"].split("/", 1)[1]
            if not value or row["policy"] == "float32" or not name.startswith("block_"):
                continue
            block, kind = name.split("/", 1)
            if kind not in KINDS:
                continue
            grid = costs.setdefault(row["policy"], np.full((blocks, len(KINDS)), np.nan))
            grid[int(block.split("_")[1]), KINDS.index(kind)] = float(value)
    if not costs:
        return None
    fig, axes = plt.subplots(1, len(costs), figsize=(3.2 * len(costs), 7), squeeze=False)
    for ax, (policy, grid) in zip(axes[0], sorted(costs.items())):
        shown = np.log10(np.clip(grid, 1e-4, None))
        image = ax.imshow(shown, aspect="auto", cmap="magma_r", vmin=-4, vmax=max(0.5, np.nanmax(shown)))
        ax.set_title(policy, fontsize=9)
        ax.set_xticks(range(len(KINDS)), [k.split("/")[1].replace("attention_output", "out") for k in KINDS],
                      rotation=60, fontsize=8)
        ax.set_ylabel("block")
    fig.colorbar(image, ax=axes[0].tolist(), label="log10 perplexity cost (one layer changed)")
    fig.suptitle("SmolLM2-135M per-layer sensitivity (tune's accuracy costs)")
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)
    return out.name


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True,
                        help="the report's folder: reports/smollm2-<machine-class> (see benchmarks/README.md)")
    parser.add_argument("--tuned", type=pathlib.Path, help="a `autopolicy tune smollm2` run directory")
    parser.add_argument("--tuned-budget", type=pathlib.Path, nargs="*", default=[],
                        help="run directories tuned under memory budgets (each reported beside the rest)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=24, help="tokens generated per prompt")
    parser.add_argument("--uniform", nargs="*", default=list(UNIFORM))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model, config, tok = smollm2.load()
    heldout = smollm2.windows(tok, "heldout")
    specs: dict[str, tuple[dict | str, dict | None]] = {"float32": ("float32", None)}
    for policy in args.uniform:
        specs[policy] = (policy, None)
    specs["Q4_K_M-style"] = (q4_k_m_map(model, config.blocks), None)
    summaries = {}
    for label, run in [("tuned", args.tuned)] + [(None, run) for run in args.tuned_budget]:
        if run is not None:
            policies, kernels, summary = tuned_from_run(run)
            if label is None:
                budget = summary["budget"]
                memory = budget.get("memory_budget")
                label = ("tuned, " + (f"{memory / 1e6:.0f} MB budget, " if memory else "") +
                         f"max rise {100 * budget['max_drop']:.0f}%")
            summaries[label] = summary
            specs[label] = (policies, kernels)
    # GPTQ/AWQ layers are calibrated as the tune calibrates them: each layer alone on its float
    # inputs from the experiment's calibration batches.
    batches = calibration_batches(tok)
    models, rows, cache = {}, {}, {}
    for name, (policy, kernels) in specs.items():
        if policy == "float32":
            built = model
        else:
            built = model.with_dtype_policy(ap.DTypePolicyMap("float32", policy) if isinstance(policy, dict) else policy)
            built = with_kernels(calibrated(built, model, batches, cache), kernels)
        models[name] = built
        t0 = time.perf_counter()
        ppl = generation.perplexity(built, heldout, smollm2.BATCH)
        rows[name] = {"perplexity": ppl, "nbytes": built.nbytes(), "perplexity_s": time.perf_counter() - t0,
                      "kernels": sorted(set(built.kernels().values()))}
        print(f"{name:28s} perplexity {ppl:8.3f}  {built.nbytes() / 1e6:7.1f} MB", flush=True)
    timings = time_decode(models, smollm2.CACHE, args.reps, args.inner)
    base = timings["float32"]
    for name, s in timings.items():
        q1, med, q3 = np.percentile(s, [25, 50, 75])
        r1, rm, r3 = np.percentile(base / s, [25, 50, 75])
        ci = confidence.paired_speedup(base, s)  # the tuner's rule: a seeded bootstrap of that median
        rows[name].update(ms=med * 1e3, ms_q1=q1 * 1e3, ms_q3=q3 * 1e3, tokens_s=1 / med,
                          speedup=rm, speedup_q1=r1, speedup_q3=r3, speedup_ci=(ci.low, ci.high),
                          step_s=[float(v) for v in s])
    texts = {}
    shown = ["float32"] + [n for n in ("tuned", "Q4_K_M-style") if n in models][:1]
    for name in shown:
        texts[name] = [tok.decode(generation.greedy_generate(models[name], tok.encode(p).ids, args.tokens))
                       for p in PROMPTS]
    args.out.mkdir(parents=True, exist_ok=True)
    figure = heatmap(args.tuned / "profile.csv", args.out / "sensitivity.png", config.blocks) if args.tuned else None
    device = hardware.describe()
    kernel_path = cpu_kernels.path() if cpu_kernels.AVAILABLE else "none (XLA only)"
    forced = f"AUTOPOLICY_CPU_PATH={os.environ['AUTOPOLICY_CPU_PATH']} " if os.environ.get("AUTOPOLICY_CPU_PATH") else ""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    _atomic.write_json(args.out / "results.json", {"device": device, "load_average": load, "rows": rows,
                                                   "maps": {k: v[0] for k, v in specs.items()},
                                                   "generated": texts, "prompts": PROMPTS,
                                                   "summaries": summaries})
    f32 = rows["float32"]
    lines = [
        "# SmolLM2-135M-Instruct: per-layer precision for batch-1 decoding on a CPU", "",
        f"Device: {device}; CPU kernel path `{kernel_path}`. Load average at the end of the run: {load}. "
        f"Made by `{forced}python benchmarks/report_smollm2.py --out {args.out}"
        + (f" --tuned runs/{args.tuned.name}" if args.tuned else "")
        + (" --tuned-budget " + " ".join(f"runs/{r.name}" for r in args.tuned_budget) if args.tuned_budget else "")
        + (f" --uniform {' '.join(args.uniform)}" if tuple(args.uniform) != UNIFORM else "") + f" --reps {args.reps}` "
        f"in {time.perf_counter() - started:.0f} s.", "",
        f"Perplexity: {len(heldout)} held-out windows of {smollm2.WINDOW} tokens of Python's documentation "
        f"(`pydoc_data.topics`, the tune's `test_fn`). Decode: one step at batch 1, cache {smollm2.CACHE}, "
        f"{args.reps} interleaved rounds of {args.inner} greedy steps in one compiled loop (`generation.decode_steps`, as "
        f"`greedy_generate` decodes), each after {args.inner} untimed steps of the same model (steady-state decoding: "
        "the model timed before leaves its own weights in the caches); speed-up = median of per-round float32/config "
        "ratios [quartiles] (95% interval: a seeded percentile bootstrap of that median, as the tuner decides). Weight bytes: every array of the model in its stored dtype (the tied "
        "embedding and head are separate copies). Quantized layers run `cpu_ffi` (autopolicy's C++ "
        "kernels) where offered; tuned maps run the kernels their tune chose.", "",
        "The checkpoint is llama.cpp's Q4_1 (4 bits in blocks of 32 with a minimum), dequantized to "
        "float32 as the reference: a 4-bit format on the same grid reproduces it almost exactly, so the "
        "informative rows are the formats that do not align with it (per-channel int4, int4 in blocks of "
        "128, int8 activations).", "",
        "| configuration | perplexity | vs float32 | weight MB | % of float32 | ms / step | tokens/s | speed-up "
        "| 95% interval |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / f32['perplexity'] - 1):+.2f}% | "
            f"{r['nbytes'] / 1e6:.1f} | {100 * r['nbytes'] / f32['nbytes']:.0f}% | {r['ms']:.2f} "
            f"[{r['ms_q1']:.2f}, {r['ms_q3']:.2f}] | {r['tokens_s']:.1f} | "
            f"{r['speedup']:.2f}x [{r['speedup_q1']:.2f}, {r['speedup_q3']:.2f}] | "
            f"[{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}] |")
    lines += ["", "The Q4_K_M-style map: llama.cpp's Q4_K_M gives 6 bits to the attention value and "
              "feed-forward down projections of the first and last eighth of the blocks and every third "
              "block between, and to the output head, 4 bits (Q4_K: blocks of 32) to the rest. Here 6 bits "
              "become int8 (per channel, int8 activations) and Q4_K becomes int4 in blocks of 32.", ""]
    for label, summary in summaries.items():
        chosen = summary["chosen"]
        counts: dict[str, int] = {}
        for policy in chosen["policies"].values():
            counts[policy] = counts.get(policy, 0) + 1
        lines += [f"## The {label} map", "",
                  f"{len(chosen['policies'])} layers: " + ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
                  + f". Tune: {summary.get('wall_time_s', float('nan')):.0f} s wall; "
                  f"see the run's `report.md` for the phases.", ""]
    if figure:
        lines += ["## Sensitivity", "", f"![per-layer sensitivity]({figure})", "",
                  "Each cell: the tune's accuracy cost of running only that layer under the candidate "
                  "(perplexity rise), log scale; blank where the tune has no cost for it.", ""]
    lines += ["## Generated text (greedy)", ""]
    for i, prompt in enumerate(PROMPTS):
        lines.append(f"**{prompt!r}**")
        lines.append("")
        for name in texts:
            lines.append(f"- {name}: {texts[name][i]!r}")
        lines.append("")
    _atomic.write_text(args.out / "README.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    if not math.isfinite(f32["perplexity"]):
        raise SystemExit("float32 perplexity is not finite")


if __name__ == "__main__":
    main()
