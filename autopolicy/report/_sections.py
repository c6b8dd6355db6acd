"""What a report says, section by section, as document blocks."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

from autopolicy.report import _evidence, tables
from autopolicy.report._cells import MISSING
from autopolicy.report._document import Block, Facts, Heading, Image, Paragraph, Table

__all__ = ["report_blocks", "FIGURE_CAPTIONS"]

FIGURE_CAPTIONS = {
    "sensitivity": "Sensitivity: accuracy cost (metric drop, or rise when lower is better) of each layer under each "
                   "policy",
    "layer_latency": "Layer latency under each policy",
    "pareto_frontier": "End-to-end latency vs metric: measured and predicted frontiers, uniform policies, chosen "
                       "map, budget",
    "latency_check": "Predicted and calibrated vs measured end-to-end latency",
}


def _num(value: Any, spec: str = ".4g", suffix: str = "") -> str:
    """A number formatted by ``spec``, or a dash when it is missing or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return MISSING
    return f"{value:{spec}}{suffix}"


def _ms(seconds: Any) -> str:
    return _num(seconds * 1e3 if isinstance(seconds, (int, float)) else None, ".3g", " ms")


def _yes_no(value: Any) -> str:
    return "not evaluated" if value is None else ("yes" if value else "no")


def _chosen_line(run: dict[str, Any]) -> str:
    summary = run["summary"]
    changed, layers = len(summary["chosen"].get("policies") or {}), summary.get("layers", MISSING)
    what = f"{changed} of {layers} tuned layers changed" if changed else "every layer stays float32"
    return f"{summary['chosen'].get('name', MISSING)} ({what})"


def _speed(summary: dict[str, Any]) -> list[tuple[str, str]]:
    chosen, float32_s = summary["chosen"], summary["float32"].get("measured_latency_s")
    entry = dict(chosen)
    if entry.get("speedup_interval") is None and isinstance(summary.get("speedup_vs_float32_interval"), list):
        entry["speedup_interval"] = summary["speedup_vs_float32_interval"]
    reference = chosen.get("name") == f"uniform {tables.FLOAT32}"
    if reference:
        how = "float32 is the choice"
    elif _num(entry.get("speedup_vs_float32")) != MISSING:
        how = "median of paired per-round ratios, 95% interval"
    else:  # an older run: the ratio of median latencies
        how = "ratio of median latencies; no interval recorded"
    best = summary.get("best_uniform", MISSING)
    return [
        ("Speedup vs float32", f"{tables.speedup_text(entry, float32_s, reference=reference)} ({how}; measured end "
                               f"to end: {_ms(chosen.get('measured_latency_s'))} vs {_ms(float32_s)})"),
        (f"Speedup vs best uniform ({best})",
         f"{_num(summary.get('speedup_vs_best_uniform'), '.2f', '×')} (ratio of median latencies)"),
    ]


def _higher(budget: Mapping[str, Any]) -> bool:
    """The metric's direction (runs saved before it was recorded: higher is better)."""
    return budget.get("higher_is_better", True) is not False


def _word(budget: Mapping[str, Any]) -> str:
    return "drop" if _higher(budget) else "rise"


def _allowed(budget: Mapping[str, Any], spec: str = ".3g") -> str:
    """``0.4686`` or, for a relative budget, ``2% (0.4686)``."""
    allowed = _num(budget.get("allowed_drop"), spec)
    max_drop = budget.get("max_drop")
    if budget.get("relative") and isinstance(max_drop, (int, float)) and math.isfinite(max_drop):
        return f"{max_drop * 100:g}% of float32 ({allowed})"
    return allowed


def _metric(summary: dict[str, Any]) -> list[tuple[str, str]]:
    chosen, budget, test = summary["chosen"], summary["budget"], summary.get("test")
    word, drop = _word(budget), _num(chosen.get("drop"), ".3g")
    direction = "" if _higher(budget) else "lower is better; "
    items = [("Metric", f"{_num(chosen.get('metric'))} ({direction}float32 {_num(budget.get('baseline_metric'))}; "
                        f"{word} {drop}, allowed {word} {_allowed(budget)}; meets budget: "
                        f"{_yes_no(chosen.get('meets_budget'))})")]
    if isinstance(test, dict):
        items.append(("Test metric", f"{_num(test.get('chosen'))} chosen vs {_num(test.get('float32'))} float32"))
    return items


def _costs(run: dict[str, Any]) -> list[tuple[str, str]]:
    summary, profile = run["summary"], run["profile"]
    float32_bytes = int(profile.loc[profile["policy"] == tables.FLOAT32, "nbytes"].sum())
    memory = summary["budget"].get("memory_budget")
    within = "" if memory is None else f"; memory budget {_num(memory, ',')}"
    evaluations, cache = summary.get("evaluations") or {}, summary.get("cache") or {}
    profile_note = (" (per-layer accuracy costs not needed: the fastest assignment met the budget; "
                    "tune with --profile-accuracy always to measure them)"
                    if summary.get("accuracy_profile") == "skipped" else "")
    return [
        ("Weight bytes", f"{_num(summary['chosen'].get('nbytes'), ',')} chosen vs "
                         f"{_num(float32_bytes, ',')} in float32{within}"),
        ("Evaluations", f"{evaluations.get('profile', MISSING)} to profile, {evaluations.get('verify', MISSING)} "
                        f"to verify, {evaluations.get('total', MISSING)} in all{profile_note}"),
        ("Measurement cache", f"{cache.get('hits', MISSING)} hits, {cache.get('misses', MISSING)} misses"),
        ("Wall time", _num(summary.get("wall_time_s"), ".1f", " s")),
    ]


def _tuned_model(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the tuned model is and how to load it (runs that saved one)."""
    tuned = summary.get("tuned_model")
    if not isinstance(tuned, dict):
        return []
    size = _num(tuned.get("nbytes", 0) / 1e6, ".1f", " MB") if isinstance(tuned.get("nbytes"), (int, float)) else MISSING
    return [("Tuned model", f"{tuned.get('path', 'tuned')}/ in the run directory ({tuned.get('framework', MISSING)}, "
                            f"{size}): autopolicy.load_tuned(RUN_DIR)")]


def _headline(run: dict[str, Any]) -> list[Block]:
    summary = run["summary"]
    items = [("Chosen", _chosen_line(run)), *_speed(summary), *_metric(summary), *_tuned_model(summary),
             *_costs(run)]
    return [Heading("Headline"), Facts(items)]


def _hardware(summary: dict[str, Any]) -> list[Block]:
    hw = summary.get("hardware") if isinstance(summary.get("hardware"), dict) else {}
    cpu = hw.get("cpu") if isinstance(hw.get("cpu"), dict) else {}
    items = [("Device", str(summary.get("device", MISSING)))]
    for label, value in (("Platform", hw.get("platform")), ("Device kind", hw.get("device_kind")),
                         ("Device count", hw.get("device_count")),
                         ("Compute capability", hw.get("compute_capability")),
                         ("CPU", cpu.get("model")), ("CPU cores", cpu.get("cores")),
                         ("CPU features", ", ".join(cpu["features"]) if cpu.get("features") else None),
                         ("jax", hw.get("jax")), ("jaxlib", hw.get("jaxlib")), ("Python", hw.get("python")),
                         ("autopolicy", hw.get("autopolicy")), ("XLA_FLAGS", hw.get("xla_flags") or None),
                         ("Fingerprint", summary.get("fingerprint"))):
        if value is not None:
            items.append((label, str(value)))
    return [Heading("Device and versions"), Facts(items)]


def _memory(summary: dict[str, Any]) -> str:
    """The memory budget beside the chosen map's bytes, float32's and the least achievable."""
    memory = summary["budget"].get("memory_budget")
    if memory is None:
        return "none"
    figures = summary.get("memory") if isinstance(summary.get("memory"), dict) else {}
    chosen = figures.get("chosen_nbytes", summary["chosen"].get("nbytes"))
    parts = [f"chosen map {_num(chosen, ',')}", f"float32 {_num(figures.get('float32_nbytes'), ',')}"]
    if figures.get("least_nbytes") is not None:
        parts.append(f"least achievable {_num(figures.get('least_nbytes'), ',')}")
    return f"{_num(memory, ',', ' bytes')} of tuned weights ({', '.join(parts)})"


def _budget(summary: dict[str, Any]) -> list[Block]:
    budget = summary["budget"]
    higher, word = _higher(budget), _word(budget)
    limit = budget.get("limit_metric", budget.get("min_metric" if higher else "max_metric"))
    return [Heading("Budget"), Facts([
        ("Baseline (float32) metric", f"{_num(budget.get('baseline_metric'))} "
                                      f"({'higher' if higher else 'lower'} is better)"),
        (f"Allowed {word}", _allowed(budget, ".4g")),
        ("Minimum metric" if higher else "Maximum metric", _num(limit)),
        ("Memory budget", _memory(summary)),
        ("Candidates", ", ".join(summary.get("candidates") or []) or MISSING),
    ])]


def _tuner_cost(summary: dict[str, Any]) -> list[Block]:
    """Where the run's wall time went, phase by phase, and its XLA compilations (none for runs
    saved before these were recorded)."""
    costs = summary.get("costs") if isinstance(summary.get("costs"), dict) else {}
    phases = costs.get("phases_s") if isinstance(costs.get("phases_s"), dict) else {}
    if not phases:
        return []
    total = sum(float(v) for v in phases.values()) or 1.0
    items = [(name, f"{float(seconds):.1f} s ({100.0 * float(seconds) / total:.0f}%)")
             for name, seconds in phases.items()]
    items.append(("XLA compilations",
                  f"{costs.get('compilations', MISSING)} ({costs.get('compile_cache_hits', MISSING)} loaded from the "
                  f"persistent compilation cache), {_num(costs.get('compile_s'), '.1f', ' s')}"))
    return [Heading("Where the tuning time went"),
            Paragraph("Wall time of each phase of the run (a phase nested in another is counted once, in "
                      "itself), and the XLA compilations it asked for."), Facts(items)]


def _tables(run: dict[str, Any]) -> list[Block]:
    return [
        Heading("Chosen policy map"),
        Paragraph("policy_map.json holds this map in the Keras DTypePolicyMap format; load it with "
                  "autopolicy.load_policy_map, or in Keras with keras.dtype_policies.deserialize."),
        Table(tables.policy_map_table(run)),
        Heading("Uniform policies vs the chosen map"),
        Paragraph("Predicted: the sum of the isolated layer latencies and casts; calibrated: the latency model "
                  "fitted end to end; measured: the whole model jitted, the median of paired rounds. Speed-up vs "
                  "float32: the median of per-round ratios, its 95% interval in brackets, then the rounds; above "
                  "1 is faster than float32. A metric of — was never evaluated: the configuration was slower "
                  "than a verified map."),
        Table(tables.overview_table(run)),
        *_workload(run),
        *_evidence.latency_model(run),
        Heading("Per-layer measurements"),
        Paragraph(f"Latency in ms (median) under each policy; cost: the metric "
                  f"{_word(run['summary']['budget'])} with only that layer changed (— where it was not "
                  "measured); bytes: the layer's weights; kernel (where named): "
                  "the kernel the chosen policy runs, where its mode has several."),
        Table(tables.layer_table(run)),
    ]


def _workload(run: dict[str, Any]) -> list[Block]:
    """A workload's phases, configuration by configuration (nothing for a run timed on one call)."""
    frame = tables.workload_table(run)
    if frame is None:
        return []
    weights = "; ".join(f"{w.get('phase')}: {_num(w.get('weight'), 'g')} call(s)" for w in run["summary"]["workload"])
    return [Heading("Workload phases"),
            Paragraph(f"The objective is a workload, per unit of work {weights}. Each phase: the median ms of one "
                      "call end to end in the paired rounds, and float32's over it; total: the median of the "
                      "rounds' weighted sums, which every decision compared."),
            Table(frame)]


def _figures(figures: Mapping[str, str]) -> list[Block]:
    blocks: list[Block] = [Heading("Figures")]
    for name, path in figures.items():
        caption = FIGURE_CAPTIONS.get(name, name)
        blocks += [Heading(caption, 3), Image(caption, path)]
    return blocks


def report_blocks(run: dict[str, Any], run_dir: str | os.PathLike, figures: Mapping[str, str]) -> list[Block]:
    """The whole report: a warning when the machine was busy, headline, method, decisions,
    noise, device, budget, where the tuning time went, tables (with the latency model) and figures.

    Args:
      run: A loaded run.
      run_dir: The run directory (named in the report).
      figures: Figure name -> PNG path relative to the report.
    """
    summary = run["summary"]
    intro = Paragraph(f"Run directory: {os.fspath(run_dir)}. Device: {summary.get('device', MISSING)}.")
    return [Heading("autopolicy tuning report", 1), intro, *_evidence.noise_alert(summary), *_headline(run),
            *_evidence.method(summary), *_evidence.decisions(summary), *_evidence.noise(summary),
            *_hardware(summary), *_budget(summary), *_tuner_cost(summary), *_tables(run), *_figures(figures)]
