"""The ``autopolicy`` command line: tune, report, export, show, profile, list, apply.

Each command is one function ``_name(args) -> int``; :func:`main` turns every failure into one
line on stderr and a documented exit status (``EXIT_STATUSES``), never a traceback unless
``--debug`` is given. Outputs (run directories, files) are checked before any work starts, and a
run directory is locked for the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import re
import signal
import sys
import warnings
import zipfile
from typing import Any, Iterator, Sequence

from autopolicy import _interrupts

__all__ = ["main", "run", "build_parser", "EXIT_STATUSES"]

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

#: Every exit status of the command line and what it means (also shown by ``autopolicy --help``).
EXIT_STATUSES = {
    EXIT_OK: "success",
    EXIT_INTERNAL: "an unexpected internal error (a bug): rerun with --debug and report the traceback",
    EXIT_USAGE: "bad usage or input: an argument, a missing or damaged input file, a failing experiment",
    EXIT_ENVIRONMENT: "the environment: file system (permissions, full disk, a path that is a file), "
                      "run directory in use, memory",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C): run the same command again to resume",
}

_SIZE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class UsageError(Exception):
    """A bad argument or input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Fraction(float):
    """A ``--max-drop`` value that remembers how it was written (for messages)."""

    text: str = ""


def _fraction(text: str) -> float:
    """``0.01`` or ``1%`` -> 0.01 (over 100% is refused later, for a higher-is-better metric only:
    a perplexity may rise by more than itself)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a fraction (like 0.01) or a percentage (like 1%)")
    value = _Fraction(float(match.group(1)) / (100.0 if match.group(2) else 1.0))
    value.text = text if match.group(2) else ""
    return value


def _check_percentage(max_drop: float, higher_is_better: bool) -> None:
    """A percentage over 100% is a slip for a higher-is-better metric (at most the whole metric)."""
    text = getattr(max_drop, "text", "")
    if text and higher_is_better and max_drop > 1:
        raise UsageError(f"{text!r} is over 100%: a relative drop is at most the whole metric (a lower-is-better "
                         "metric, --lower-is-better, may rise by more)")


def _executor_spec(text: str) -> str:
    if not re.fullmatch(r"processes:[1-9]\d*|ray(:[1-9]\d*)?", text.strip()):
        from autopolicy.distributed import EXECUTOR_CHOICES  # pylint: disable=import-outside-toplevel

        raise argparse.ArgumentTypeError(f"{text!r} is not one of {EXECUTOR_CHOICES}")
    return text.strip()


def _size(text: str) -> int:
    """``10MB``, ``512KiB`` or ``1000000`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (like 10MB, 512KiB or 1000000); units: {sorted(_SIZE_UNITS)}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0")
    return size


def _candidates(text: str) -> list[str]:
    from autopolicy import policies  # pylint: disable=import-outside-toplevel

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of policies")
    for name in names:
        try:
            policies.get(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _repeats(text: str) -> int:
    from autopolicy.search._checks import MAX_REPEATS  # pylint: disable=import-outside-toplevel

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 3 <= value <= MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer in [3, {MAX_REPEATS}]")
    return value


def _option(text: str) -> tuple[str, Any]:
    from autopolicy import _experiment_options  # pylint: disable=import-outside-toplevel

    try:
        return _experiment_options.parse_assignment(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """``--small`` and ``--option KEY=VALUE``: options of the experiment's ``build``."""
    parser.add_argument("--small", action="store_true",
                        help="the experiment's small form (--option small=true), where it has one: a model that "
                             "tunes in about a minute on a CPU, for tests and a first look")
    parser.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the experiment's build (repeatable), read as the type it declares (an int, "
                             "a float, true/false or text); `autopolicy list` shows each experiment's. The run "
                             "directory defaults to runs/EXPERIMENT-<options> (runs/decoder_1b-small-batch16)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """``--small`` and the ``--option`` values as one dict; a key given twice is refused."""
    from autopolicy import _experiment_options  # pylint: disable=import-outside-toplevel

    pairs = ([("small", _experiment_options.Text("true"))] if args.small else []) + list(args.option)
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key in options:
            raise UsageError(f"option {key!r} given twice ({key}={options[key]} and {key}={value})"
                             + (" (--small is --option small=true)" if key == "small" else ""))
        options[key] = value
    return options


def _form_suffix(args: argparse.Namespace) -> str:
    """The default run directory's suffix for the options given (``-small-batch16``), checked
    against the experiment's ``build`` before anything runs."""
    options = _options(args)
    if not options:
        return ""
    if args.experiment.endswith(".keras"):
        raise UsageError("--small and --option are options of an experiment's build; a .keras model takes none")
    from autopolicy import experiment  # pylint: disable=import-outside-toplevel

    return experiment.form_suffix(experiment.load(args.experiment), **options)


def _epilog() -> str:
    lines = [f"  {status:<4} {meaning}" for status, meaning in EXIT_STATUSES.items()]
    return "exit statuses:\n" + "\n".join(lines) + "\nerrors are one line on stderr; --debug shows the traceback."


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopolicy", description=(
        "Find the fastest per-layer dtype policies (float32, bfloat16/float16, int8, float8) that keep "
        "a model's accuracy within budget on this machine, and report and export them."),
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    common = argparse.ArgumentParser(add_help=False)  # `autopolicy tune ... --debug` works too
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    add = lambda name, **kw: sub.add_parser(name, parents=[common], **kw)  # noqa: E731

    tune = add("tune", help="tune an experiment end to end and write a run directory and report")
    tune.add_argument("experiment", nargs="?", default="digits_mlp",
                      help="a built-in experiment (see `autopolicy list`), a .py file, or a .keras model with "
                           "--eval and --sample (default: digits_mlp)")
    _add_option_arguments(tune)
    tune.add_argument("--eval", default=None, metavar="MODULE:FUNCTION",
                      help="for a .keras model: eval(model) -> float, higher is better unless --lower-is-better "
                           "(module or file.py)")
    tune.add_argument("--sample", default=None, metavar="SAMPLE",
                      help="for a .keras model: a realistic input batch, a .npy/.npz file or MODULE:FUNCTION")
    tune.add_argument("--test", default=None, metavar="MODULE:FUNCTION",
                      help="for a .keras model: test(model) -> float on held-out data, reported only")
    tune.add_argument("--max-drop", type=_fraction, default=None,
                      help="how much worse than float32 the metric may get, a fraction or percentage: its drop, or "
                           "its rise for a lower-is-better metric (perplexity: 2%% allows up to 1.02x float32's) "
                           "(default: the experiment's, usually 1%%)")
    tune.add_argument("--absolute", action="store_true", help="--max-drop is absolute, not relative to float32")
    direction = tune.add_mutually_exclusive_group()
    direction.add_argument("--lower-is-better", dest="higher_is_better", action="store_false", default=None,
                           help="the metric is lower-is-better (perplexity, loss): --max-drop is the allowed rise "
                                "(default: the experiment's direction; higher is better for --eval)")
    direction.add_argument("--higher-is-better", dest="higher_is_better", action="store_true", default=None,
                           help="the metric is higher-is-better (accuracy): --max-drop is the allowed drop")
    tune.add_argument("--candidates", type=_candidates, default=None,
                      help="comma-separated policies (default: the experiment's, else "
                           "autopolicy.search.DEFAULT_CANDIDATES)")
    tune.add_argument("--memory-budget", type=_size, default=None, help="cap on weight bytes, e.g. 10MB")
    tune.add_argument("--workload", type=_workload, default=None, metavar="prefill=P,decode=G[,weight=W][;...]",
                      help="time generation requests (a prefill of P tokens, then G decode steps; several "
                           "separated by ';', weighted) and minimise their total, each phase reported; "
                           "for experiments that define workload_fn (smollm2)")
    tune.add_argument("--out", default=None, help="run directory (default: runs/EXPERIMENT); reruns resume; "
                                                   "one run at a time (it is locked)")
    tune.add_argument("--repeats", type=_repeats, default=20, help="timing repetitions per layer")
    tune.add_argument("--profile-accuracy", choices=("auto", "first_order", "measure", "always"), default="auto",
                      help="if the fastest assignment breaks the budget, auto: estimate per-layer costs (first "
                           "order where the experiment gives a loss_fn, else from layer output errors) and verify "
                           "end to end (measure only if that fails); first_order: estimate them from the "
                           "experiment's loss gradient x each layer's output error, verify, never measure; measure: "
                           "measure each layer's cost; always: measure every cost up front (a complete "
                           "sensitivity table)")
    tune.add_argument("--executor", type=_executor_spec, default=None, metavar="processes:N|ray[:N]",
                      help="run the one-layer accuracy evaluations on N spawned processes of this host, or on Ray "
                           "actors (pip install -e '.[distributed]'); latency is always measured here")
    tune.add_argument("--ray-address", default=None,
                      help="the Ray cluster for --executor ray (default: $RAY_ADDRESS, else a local one)")
    tune.add_argument("--no-report", action="store_true", help="skip writing the report")
    tune.add_argument("--no-model", action="store_true",
                      help="do not save the tuned model in RUN_DIR/tuned (autopolicy.load_tuned reads it)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bars")
    tune.add_argument("--no-shared-cache", action="store_true",
                      help="neither reuse nor add to the machine-wide cache ($AUTOPOLICY_CACHE, default "
                           "~/.cache/autopolicy: compiled programs and layer timings keyed by this machine's "
                           "fingerprint); the run directory keeps its own")

    report = add("report", help="write report.md and report.html (with figures) for a run")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="output directory (default: RUN_DIR)")

    export = add("export", help="export a run's policy map (and the kernels its layers run), or its tuned model")
    export.add_argument("run_dir")
    what = export.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="the map's output file")
    what.add_argument("--model", metavar="DIR", help="copy the tuned model to DIR (a new directory), which "
                      "autopolicy.load_tuned(DIR) reads as it reads RUN_DIR")
    export.add_argument("--format", choices=("json", "table", "gguf", "llama-tensor-types"), default="json",
                        help="with --out; json: Keras DTypePolicyMap envelope, with its kernels in OUT.kernels.json "
                             "beside it (for model.with_kernels); table: path and policy per line; gguf: a language "
                             "model's tune as a GGUF file llama.cpp runs, each tensor in the type nearest its policy, "
                             "quantized by llama.cpp's llama-quantize from the source GGUF (build it once: python -m "
                             "autopolicy.llamacpp build); llama-tensor-types: only the --tensor-type-file lines")
    export.add_argument("--source", default=None, metavar="GGUF",
                        help="with --format gguf: the GGUF file the tune started from (default: the one the run records)")

    generate = add("generate", help="greedily continue a prompt with a language model's tuned model, with tokens/s")
    generate.add_argument("run_dir", help="the run directory of a language model's tune (autopolicy tune smollm2)")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=int, default=32, help="how many tokens to generate (default 32)")
    generate.add_argument("--float32", action="store_true", help="also generate with the float32 reference model")
    generate.add_argument("--cache-length", type=int, default=None,
                          help="the key/value cache's positions (default: the tune's, 256 for smollm2)")

    show = add("show", help="print a policy map file")
    show.add_argument("map_file")

    profile = add("profile", help="time every layer of an experiment under every candidate")
    profile.add_argument("experiment")
    _add_option_arguments(profile)
    profile.add_argument("--candidates", type=_candidates, default=None)
    profile.add_argument("--repeats", type=_repeats, default=20)
    profile.add_argument("--out", default=None, help="also write the table as CSV")
    profile.add_argument("--no-progress", action="store_true")

    add("list", help="list the built-in experiments")
    add("device", help="this machine: CPU model and features, the kernels built and those that would run, "
                       "jax and XLA versions")

    apply = add("apply", help="apply a policy map to a .keras model and save the tuned model")
    apply.add_argument("map_file", help="a policy map (JSON, Keras envelope), e.g. RUN_DIR/policy_map.json")
    apply.add_argument("model", help="a .keras model file")
    apply.add_argument("--out", required=True, help="the tuned .keras file to write")
    apply.add_argument("--strict", action="store_true", help="fail when a key of the map matches no layer")
    apply.add_argument("--sample", default=None, metavar="SAMPLE",
                       help="a batch (.npy/.npz or MODULE:FUNCTION) to calibrate float8 scales on")
    return parser


def _experiment(name: str, options: dict | None = None) -> Any:
    from autopolicy import experiment  # pylint: disable=import-outside-toplevel

    module = experiment.load(name)
    print(f"experiment {name}: {getattr(module, 'DESCRIPTION', '')}", file=sys.stderr)
    return experiment.build(module, **(options or {}))


def _default_out(experiment: str, form: str = "") -> str:
    """``runs/NAME`` for a built-in name, a ``.py`` file or a ``.keras`` file; ``runs/NAME-small-batch16``
    for a form of it (``form``: the suffix of its options)."""
    return os.path.join("runs", (pathlib.Path(experiment).stem or experiment) + form)


def _tune_experiment(args: argparse.Namespace) -> Any:
    if args.experiment.endswith(".keras"):
        from autopolicy import _cli_keras  # pylint: disable=import-outside-toplevel

        return _cli_keras.keras_experiment(args.experiment, args.eval, args.sample, args.test)
    given = [flag for flag, value in (("--eval", args.eval), ("--sample", args.sample), ("--test", args.test)) if value]
    if given:
        raise UsageError(f"{', '.join(given)} only apply to a .keras model; an experiment defines its own")
    return _experiment(args.experiment, _options(args))


def _tune(args: argparse.Namespace) -> int:
    from autopolicy import _rundir  # pylint: disable=import-outside-toplevel

    form = _form_suffix(args)  # options checked before anything runs, whatever --out says
    out = args.out or _default_out(args.experiment, form)
    with _rundir.RunLock(out, "--out"):  # checked (creatable, writable, a directory) before any work
        return _tune_locked(args, out)


def _workload(text: str) -> tuple:
    from autopolicy.search import workload  # pylint: disable=import-outside-toplevel

    try:
        return workload.parse_requests(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _phases(exp: Any, requests: tuple | None) -> list | None:
    """The phases of ``--workload``'s requests, from the experiment's ``workload_fn``."""
    if requests is None:
        return None
    make = getattr(exp, "workload_fn", None)
    if make is None:
        raise UsageError(f"--workload needs an experiment that turns requests into timed phases (Experiment."
                         f"workload_fn, as smollm2 defines); {exp.name!r} has none")
    return list(make(requests))


def _tune_locked(args: argparse.Namespace, out: str) -> int:
    from autopolicy import search  # pylint: disable=import-outside-toplevel
    from autopolicy.search import _checks  # pylint: disable=import-outside-toplevel

    exp = _tune_experiment(args)
    workload = _phases(exp, args.workload)
    max_drop = exp.max_drop if args.max_drop is None else args.max_drop
    relative = exp.relative and not args.absolute
    higher_is_better = exp.higher_is_better if args.higher_is_better is None else args.higher_is_better
    if relative:
        _check_percentage(max_drop, higher_is_better)
    _checks.check_budget(max_drop, relative, higher_is_better)
    shared = _shared_cache(args, out)
    with contextlib.ExitStack() as stack:
        executor = None
        if args.executor:
            from autopolicy import distributed  # pylint: disable=import-outside-toplevel

            executor = stack.enter_context(distributed.running(
                distributed.make_executor(args.executor, args.ray_address)))
        result = search.tune(
            exp.model, exp.eval_fn, exp.sample_input,
            candidates=args.candidates or exp.candidates or search.DEFAULT_CANDIDATES, max_drop=max_drop,
            relative=relative, memory_budget=args.memory_budget,
            cache_dir=os.path.join(out, "cache"), progress=not args.no_progress,
            calibration_inputs=exp.calibration_inputs, test_fn=exp.test_fn, repeats=args.repeats,
            profile_accuracy=args.profile_accuracy, shared_cache_dir=shared, executor=executor,
            higher_is_better=higher_is_better, loss_fn=getattr(exp, "loss_fn", None),
            loss_link=getattr(exp, "loss_link", "fitted"), loss_inputs=getattr(exp, "loss_inputs", None),
            step_carry=getattr(exp, "step_carry", None), workload=workload,
        )
    result.summary["experiment"] = {"name": exp.name, "description": exp.description,
                                    "metric": exp.metric_name, "command": " ".join(["autopolicy"] + sys.argv[1:]),
                                    "options": getattr(exp, "options", {})}
    tuned = result.save(out, model=not args.no_model, tokenizer=getattr(exp, "tokenizer", None),
                        source=getattr(exp, "source", None))
    _print_summary(result.summary, out)
    _print_tuned(result.summary, out, tuned)
    if not args.no_report:
        import time  # pylint: disable=import-outside-toplevel

        from autopolicy import report  # pylint: disable=import-outside-toplevel
        from autopolicy.search import result as result_module  # pylint: disable=import-outside-toplevel

        start = time.perf_counter()
        written = report.write_report(out)
        # The report's own time, known once it is written, goes into summary.json afterwards.
        result.summary.setdefault("costs", {}).setdefault("phases_s", {})["report"] = round(
            time.perf_counter() - start, 3)
        result_module.write_summary(out, result.summary)
        print(f"report: {written.get('markdown', os.path.join(out, 'report.md'))}")
    return EXIT_OK


def _shared_cache(args: argparse.Namespace, out: str) -> str | None:
    """Turns JAX's persistent compilation cache on (machine-wide, or in the run directory with
    --no-shared-cache); returns the shared measurements' directory or None."""
    from autopolicy import _machine_cache  # pylint: disable=import-outside-toplevel

    if args.no_shared_cache:
        _machine_cache.enable_compilation_cache(os.path.join(out, "cache", "jax"))
        return None
    root = _machine_cache.directory()
    _machine_cache.enable_compilation_cache(os.path.join(root, "jax"))
    return os.path.join(root, "measurements")


def _print_summary(s: dict, out: str) -> None:
    chosen = s["chosen"]
    print(f"device: {s['device']}")
    name = (s.get("experiment") or {}).get("metric") or "metric"
    print(_budget_line(s["budget"], name))
    print(f"chosen map: {len(chosen['policies'])} of {s['layers']} layers changed; {name}: {chosen['metric']:.4f}; "
          f"{s['speedup_vs_float32']:.2f}x float32, {s['speedup_vs_best_uniform']:.2f}x best uniform "
          f"({s['best_uniform']})")
    if s.get("workload"):
        print(_workload_line(s))
    memory = s.get("memory") or {}
    if memory.get("budget") is not None:
        print(f"weights: {memory['chosen_nbytes']:,} bytes chosen, {memory['float32_nbytes']:,} in float32; "
              f"memory budget {int(memory['budget']):,} (at least {memory['least_nbytes']:,} possible)")
    for path, policy in chosen["policies"].items():
        print(f"  {path}: {policy}")
    cache = s.get("cache") or {}
    if cache:
        shared = (f" ({cache['shared_hits']} of them from the machine-wide cache of earlier runs)"
                  if cache.get("shared_hits") else "")
        print(f"measurements: {cache.get('hits', 0)} reused from the cache{shared}, {cache.get('misses', 0)} new")
    costs = s.get("costs") or {}
    if costs.get("phases_s"):
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in costs["phases_s"].items())
        print(f"time: {s['wall_time_s']:.1f} s ({phases}); {costs['compilations']} XLA compilations "
              f"({costs['compile_cache_hits']} loaded from the compilation cache)")
    print(f"run directory: {out}")


def _workload_line(s: dict) -> str:
    """``workload: prefill 512 x1: 40.1 ms (1.21x float32); decode at 640 x128: 7.9 ms (2.50x float32)``:
    the chosen configuration's time per call in each phase of a workload.

    >>> _workload_line({"workload": [{"phase": "decode", "weight": 8}], "chosen": {"phases": {"decode": 0.002}},
    ...                 "float32": {"phases": {"decode": 0.005}}})
    'workload: decode x8: 2.00 ms (2.50x float32)'
    """
    chosen, float32 = s["chosen"].get("phases") or {}, s["float32"].get("phases") or {}
    parts = []
    for w in s["workload"]:
        name, t, ref = w["phase"], chosen.get(w["phase"]), float32.get(w["phase"])
        ratio = f" ({ref / t:.2f}x float32)" if t and ref else ""
        parts.append(f"{name} x{w['weight']:g}: " + (f"{1e3 * t:.2f} ms{ratio}" if t else "not timed"))
    return "workload: " + "; ".join(parts)


def _megabytes(nbytes: float) -> str:
    """``12.3 MB``.

    >>> _megabytes(12_345_678)
    '12.3 MB'
    """
    return f"{nbytes / 1e6:.1f} MB"


def _print_tuned(s: dict, out: str, tuned: str | None) -> None:
    """The tuned model's line: where, its size on disk beside the float32 weights', how to load it."""
    info = s.get("tuned_model")
    if tuned is None or not info:
        print("tuned model: not saved (--no-model, or a model kind autopolicy cannot save); apply "
              f"{os.path.join(out, 'policy_map.json')} to your model")
        return
    float32 = (s.get("memory") or {}).get("float32_nbytes")
    beside = f"; the float32 weights of its tuned layers: {_megabytes(float32)}" if float32 else ""
    print(f"tuned model: {tuned} ({info['framework']}, {_megabytes(info['nbytes'])} on disk{beside}); "
          f"load it with autopolicy.load_tuned({out!r}), or skip saving it with --no-model")


def _budget_line(budget: dict, name: str = "metric") -> str:
    """``float32 perplexity: 23.4300 (lower is better); allowed rise 2% (0.4686): at most 23.8986``.

    >>> _budget_line({"baseline_metric": 23.43, "higher_is_better": False, "allowed_drop": 0.4686,
    ...               "max_drop": 0.02, "relative": True, "limit_metric": 23.8986}, "perplexity")
    'float32 perplexity: 23.4300 (lower is better); allowed rise 2% (0.4686): at most 23.8986'
    """
    higher = budget.get("higher_is_better", True)
    word, bound = ("drop", "at least") if higher else ("rise", "at most")
    allowed = f"{budget['allowed_drop']:.4g}"
    if budget.get("relative") and budget.get("max_drop") is not None:
        allowed = f"{budget['max_drop'] * 100:g}% ({allowed})"
    limit = budget.get("limit_metric", budget.get("min_metric"))
    return (f"float32 {name}: {budget['baseline_metric']:.4f} ({'higher' if higher else 'lower'} is better); "
            f"allowed {word} {allowed}: {bound} {limit:.4f}")


def _report(args: argparse.Namespace) -> int:
    from autopolicy import _rundir, report  # pylint: disable=import-outside-toplevel

    if not os.path.isdir(args.run_dir):
        raise UsageError(f"no run directory at {args.run_dir!r}")
    with _rundir.RunLock(args.out or args.run_dir, "--out" if args.out else "RUN_DIR"):
        written = report.write_report(args.run_dir, args.out)
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return EXIT_OK


def _map_rows(policy_map: Any) -> list[tuple[str, str]]:
    rows = [(key, policy.name) for key, policy in policy_map.items()]
    default = "(global policy)" if policy_map.follows_global else policy_map.default_policy.name
    return rows + [("<default>", default)]


def _export(args: argparse.Namespace) -> int:
    from autopolicy import _atomic, _rundir, _tuned, policies  # pylint: disable=import-outside-toplevel
    from autopolicy.search import result  # pylint: disable=import-outside-toplevel

    if not os.path.isdir(args.run_dir):
        raise UsageError(f"no run directory at {args.run_dir!r}")
    if args.model is not None:
        if args.format != "json" or args.source is not None:
            raise UsageError("--model copies the tuned model as it is: --format and --source go with --out")
        nbytes = _tuned.export_tuned(args.run_dir, args.model)
        print(f"wrote {args.model} ({_megabytes(nbytes)}): load it with autopolicy.load_tuned({args.model!r})")
        return EXIT_OK
    if args.format in ("gguf", "llama-tensor-types"):
        return _export_llama(args)
    if args.source is not None:
        raise UsageError(f"--source goes with --format gguf (got --format {args.format})")
    source = os.path.join(args.run_dir, result.MAP_FILE)
    if not os.path.isfile(source):
        raise UsageError(f"no policy map in {args.run_dir!r} (expected {source!r}); run `autopolicy tune` first")
    _rundir.check_output_file(args.out)
    policy_map = policies.load_policy_map(source)
    sidecar = os.path.join(args.run_dir, result.KERNELS_FILE)
    kernels = result.load_kernels(sidecar) if os.path.isfile(sidecar) else None  # older runs have none
    if args.format == "json":
        policies.save_policy_map(policy_map, args.out)
        if kernels is not None:  # the kernels beside the map (checked above), for model.with_kernels
            with open(sidecar, encoding="utf-8") as f:
                _atomic.write_text(result.kernels_path(args.out), f.read())
            print(f"wrote {args.out} and its kernels, {result.kernels_path(args.out)}")
            return EXIT_OK
    else:
        rows = _map_rows(policy_map)
        width = max(len(p) for p, _ in rows)
        _atomic.write_text(args.out, "".join(f"{p.ljust(width)}  {n}\n" for p, n in rows))
    print(f"wrote {args.out}")
    return EXIT_OK


def _export_llama(args: argparse.Namespace) -> int:
    """``export --format gguf|llama-tensor-types``: a language model's tune for llama.cpp."""
    from autopolicy import _atomic, _rundir, _tuned, llamacpp  # pylint: disable=import-outside-toplevel

    _rundir.check_output_file(args.out)
    try:
        manifest = _tuned.read_manifest(args.run_dir)
    except _tuned.TunedModelError as error:
        raise UsageError(f"{error} (--format {args.format} exports the tuned model)") from error
    if manifest.get("framework") != "autopolicy.nn":
        raise UsageError(f"--format {args.format} exports llama decoders tuned as autopolicy.nn models; the run in "
                         f"{args.run_dir!r} holds a {manifest.get('framework')} model")
    source = args.source or (manifest.get("source") or {}).get("gguf")
    if args.format == "gguf" and source is None:
        raise UsageError(f"the run in {args.run_dir!r} records no source GGUF file: name it with --source FILE.gguf")
    if source is not None and not os.path.isfile(source):
        raise UsageError(f"no GGUF file at {source!r}" + ("" if args.source else " (the run's source): name it with --source"))
    model = _tuned.load_tuned(args.run_dir)
    if args.format == "llama-tensor-types":
        try:
            tied = source is None or "output.weight" not in llamacpp.read_tensor_types(source)
            types = llamacpp.gguf_types(model, tied=tied)
        except ValueError as error:
            raise UsageError(str(error)) from error
        _atomic.write_text(args.out, llamacpp.tensor_type_lines(types))
        flags = " ".join(llamacpp.quantize_flags(types))
        print(f"wrote {args.out} ({len(types)} tensors); use it as: llama-quantize --allow-requantize "
              f"--tensor-type-file {args.out} {flags} SOURCE.gguf OUT.gguf Q8_0")
        return EXIT_OK
    try:
        written = llamacpp.export_gguf(model, source, args.out)
    except (llamacpp.LlamaCppError, ValueError) as error:
        raise UsageError(str(error)) from error
    counts = ", ".join(f"{n} {k}" for k, n in written.type_counts().items())
    print(f"wrote {args.out} ({_megabytes(written.nbytes)}; weight matrices: {counts})")
    for name, (asked, got) in written.fallbacks.items():
        print(f"  {name}: llama.cpp wrote {got} (the policy maps to {asked}, which does not fit its shape)")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from autopolicy import policies  # pylint: disable=import-outside-toplevel

    if not os.path.isfile(args.map_file):
        raise UsageError(f"no file at {args.map_file!r}")
    rows = _map_rows(policies.load_policy_map(args.map_file))
    width = max(len(p) for p, _ in rows)
    for path, name in rows:
        print(f"{path.ljust(width)}  {name}")
    return EXIT_OK


def _profile(args: argparse.Namespace) -> int:
    from autopolicy import _atomic, _rundir, search  # pylint: disable=import-outside-toplevel

    if args.out:
        _rundir.check_output_file(args.out)
    exp = _experiment(args.experiment, _options(args))
    candidates = args.candidates or exp.candidates or search.DEFAULT_CANDIDATES
    table = search.profile(exp.model, exp.sample_input, candidates=candidates,
                           repeats=args.repeats, progress=not args.no_progress)
    print(f"device: {search.hardware.describe()}")
    wide = table.pivot(index="layer", columns="policy", values="ratio_to_float32").loc[table["layer"].unique()]
    print("speed relative to float32 (higher is faster):")
    print(wide.round(2).to_string())
    if args.out:
        _atomic.write_text(args.out, table.to_csv(index=False))
        print(f"wrote {args.out}")
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    from autopolicy import experiment  # pylint: disable=import-outside-toplevel

    for name, path in experiment.available().items():
        try:
            module = experiment.load(name)
            description, options = getattr(module, "DESCRIPTION", path), experiment.options_of(module)
        except ValueError as e:  # one broken file does not hide the others
            description, options = f"(cannot be loaded: {_first_line(str(e))})", {}
        print(f"{name:18s} {description}")
        if options:  # `tune NAME --option KEY=VALUE` (--small for small=true)
            print(f"{'':18s} options: {'; '.join(o.describe() for o in options.values())}")
    return EXIT_OK


def _apply(args: argparse.Namespace) -> int:
    from autopolicy import _cli_keras, _rundir  # pylint: disable=import-outside-toplevel

    _rundir.check_output_file(args.out)
    print(_cli_keras.apply_map(args.map_file, args.model, args.out, args.strict, args.sample))
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from autopolicy import _cli_generate  # pylint: disable=import-outside-toplevel

    if not os.path.isdir(args.run_dir):
        raise UsageError(f"no run directory at {args.run_dir!r}")
    try:
        _cli_generate.generate_lines(args.run_dir, args.prompt, args.tokens, args.float32, args.cache_length)
    except _cli_generate.GenerateError as e:
        raise UsageError(str(e)) from None
    return EXIT_OK


def _device(args: argparse.Namespace) -> int:
    del args
    from autopolicy.numerics import _device_report  # pylint: disable=import-outside-toplevel

    print(_device_report.device_report())
    return EXIT_OK


_COMMANDS = {"tune": _tune, "report": _report, "export": _export, "show": _show, "profile": _profile,
             "list": _list, "apply": _apply, "device": _device, "generate": _generate}


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _os_message(error: OSError) -> str:
    """An OSError as one line: what failed, on which file, and what to do."""
    from autopolicy import _rundir  # pylint: disable=import-outside-toplevel

    if error.errno is None:  # autopolicy's own message, already naming the path and the remedy
        return _first_line(str(error))
    where = f" ({error.filename!r})" if error.filename is not None else ""
    advice = _rundir.remedy(error)
    return f"{error.strerror or error}{where}" + (f": {advice}" if advice else "")


def _failure(error: BaseException, command: str) -> tuple[int, str]:
    """The exit status and one-line message for an error that ended a command."""
    if isinstance(error, UsageError):
        return EXIT_USAGE, _first_line(str(error))
    if isinstance(error, FileNotFoundError):  # a missing input
        return EXIT_USAGE, _os_message(error)
    if isinstance(error, OSError):
        message = _os_message(error)
        if command == "tune" and error.errno is not None:
            message += "; a rerun resumes from the measurements cached so far"
        return EXIT_ENVIRONMENT, message
    if isinstance(error, MemoryError):
        return EXIT_ENVIRONMENT, "out of memory: close other programs, or tune a smaller model or batch"
    if isinstance(error, RecursionError):
        return EXIT_USAGE, "an input nests too deeply (RecursionError): check the files given"
    if isinstance(error, (ValueError, TypeError)):
        return EXIT_USAGE, _first_line(str(error))
    if isinstance(error, (zipfile.BadZipFile, EOFError)):
        return EXIT_USAGE, f"a file is damaged or truncated ({type(error).__name__}: {_first_line(str(error))})"
    return EXIT_INTERNAL, (f"internal error: {type(error).__name__}: {_first_line(str(error))} (rerun with --debug "
                           "for the traceback, and report it)")


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Warnings shown as ``autopolicy COMMAND: warning: ...`` lines, not with source lines."""
    original = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_: (
        f"autopolicy {command}: warning: {_first_line(str(message))}\n")
    try:
        yield
    finally:
        warnings.formatwarning = original


@contextlib.contextmanager
def _no_more_interrupts() -> Iterator[None]:
    """A second Ctrl-C while an interrupted command winds down is ignored (not a traceback)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be changed, nor received
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _settle() -> None:
    """Waits for the JAX computations still in flight (asynchronous dispatch) so that none is
    running, nor finishes, while the interpreter shuts down."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # pylint: disable=broad-except  # a deleted or failed array: nothing in flight
            pass


def run() -> None:
    """The ``autopolicy`` program: :func:`main`, then exit with its status.

    Once :func:`main` has returned, its work is done and written: a Ctrl-C from then on is
    ignored (it would otherwise land in the interpreter's teardown, as a traceback or a death by
    SIGINT), and one that arrives as it returns is reported like any other interrupt. After an
    interrupt (status 130), the process ends with ``os._exit`` once its output is flushed:
    everything it wrote is already on disk (the measurement cache, the run lock given back,
    atomically), and the interpreter's own teardown, with XLA's runtime still loaded, is
    skipped.
    """
    status = EXIT_INTERRUPTED
    try:
        status = main()
    except KeyboardInterrupt:  # after main's own handler: between its return and this line
        print("autopolicy: interrupted; run the same command again to resume", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    if status == EXIT_INTERRUPTED:
        os._exit(status)  # pylint: disable=protected-access
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (see ``EXIT_STATUSES``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _warnings_as_lines(args.command), _interrupts.catching():
            status = _COMMANDS[args.command](args)
            if _interrupts.pending():  # swallowed in a finalizer, with no checkpoint after it
                raise KeyboardInterrupt
            return status
    except KeyboardInterrupt:
        if args.debug:
            raise
        with _no_more_interrupts():
            _settle()
            print(f"autopolicy {args.command}: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # pylint: disable=broad-except
        if args.debug:
            raise
        status, message = _failure(e, args.command)
        print(f"autopolicy {args.command}: error: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    run()
