"""How far a report's figures can be trusted: how they were obtained, how the winner was
decided, the latency model's errors, and the noise the run saw.

Older run directories lack the keys these sections read; each then says so and shows a dash.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from autopolicy.report import tables
from autopolicy.report._cells import MISSING
from autopolicy.report._document import Alert, Block, Bullets, Facts, Heading, Paragraph, Table
from autopolicy.search.noise import NOISY_CV

__all__ = ["noise_alert", "method", "decisions", "latency_model", "noise", "median_abs_error"]

_ACCURACY = {
    "measured": "each layer changed alone and the whole model scored (eval_fn)",
    "estimated": ("estimated from each layer's output error, scaled to the fastest map's observed drop (its rise, "
                  "for a lower-is-better metric)"),
    "first_order": ("estimated from the loss's gradient at each layer's output and the layer's output error under "
                    "each candidate (first-order sensitivity, autopolicy.search.first_order), in the metric's units"),
    "skipped": "not needed: the fastest assignment met the budget",
}


def _num(value: Any, spec: str = ".3g", suffix: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return MISSING
    return f"{value:{spec}}{suffix}"


def _noise(summary: dict[str, Any]) -> dict[str, Any]:
    value = summary.get("noise")
    return value if isinstance(value, dict) else {}


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def noise_alert(summary: dict[str, Any]) -> list[Block]:
    """A warning when the run found the machine busy, with the run's own note; else nothing."""
    seen = _noise(summary)
    if seen.get("busy") is not True:
        return []
    note = seen.get("note") or "the machine was busy"
    return [Alert(f"{_sentence(str(note))} Read the speed-up intervals below, not the medians alone.")]


def method(summary: dict[str, Any]) -> list[Block]:
    """How each number was obtained."""
    model = summary.get("latency_model") if isinstance(summary.get("latency_model"), dict) else {}
    fitted_on = model.get("fitted_on")
    accuracy = _ACCURACY.get(summary.get("accuracy_profile"), MISSING)
    scales = summary.get("accuracy_scales")
    if isinstance(scales, dict) and scales:
        accuracy += ("; then each candidate's costs scaled so that they add up to its uniform policy's measured "
                     "change (scales: " + ", ".join(f"{name} {_num(v)}" for name, v in scales.items()) + ")")
    items = [
        ("Layer latency", "each tunable layer jitted and timed alone under each policy: the median of repeats "
                          "(whiskers: 25th-75th percentile; CV: its spread)"),
        ("Predicted latency", "the sum of a configuration's isolated layer latencies and the casts between "
                              "layers of different dtypes"),
        ("Measured latency", "the whole model jitted and timed end to end; every configuration in the same "
                             "interleaved rounds (paired); the median over rounds, CV its spread"),
        ("Speed-up vs float32", "the median of the per-round ratios float32 / configuration over the paired "
                                "rounds; the interval: a seeded 95% percentile bootstrap of that median"),
        ("Decisions", "a configuration replaces float32 (or the one ahead of it) only when its interval's lower "
                      "bound clears the margin; when the interval straddles the margin, more paired rounds are "
                      "taken up to a time budget, and then the simpler configuration stays"),
        ("Calibrated latency", f"one scale per policy on the isolated layer latencies, fitted by least squares "
                               f"of relative errors on every end-to-end timing "
                               f"({fitted_on if isinstance(fitted_on, int) else MISSING} configurations); "
                               f"the solver ranks mixes with it"),
        ("Per-layer accuracy cost", accuracy),
    ]
    blocks: list[Block] = [Heading("Method"), Facts(items)]
    if "decisions" not in summary:
        blocks.append(Paragraph("This run predates paired rounds: its speed-ups are ratios of median latencies, "
                                f"without intervals ([{MISSING}]), and it recorded no decisions, latency model or "
                                "noise."))
    return blocks


def decisions(summary: dict[str, Any]) -> list[Block]:
    """The decision log: every challenge, its speed-up over the incumbent, its interval and rounds."""
    blocks: list[Block] = [Heading("How it was decided")]
    lines = summary.get("decisions")
    if not isinstance(lines, list):
        return blocks + [Paragraph(f"Not recorded by this run ({MISSING}).")]
    if not lines:
        return blocks + [Paragraph("No configuration that met the budget challenged float32, so float32 stays.")]
    extra = _noise(summary).get("extra_rounds_seconds")
    return blocks + [
        Paragraph("Uniform policies challenge first, fastest first, then the verified maps. Each line: the "
                  "challenger, the verdict, the incumbent, the challenger's speed-up over it (median of paired "
                  "per-round ratios) with its 95% interval and the rounds it took, and the margin the interval's "
                  "lower bound had to clear."),
        Bullets([str(line) for line in lines]),
        Facts([("Extra rounds for close calls", _num(extra, ".1f", " s")),
               ("Winner", str(summary["chosen"].get("name", MISSING)))]),
    ]


def median_abs_error(frame: Any, column: str) -> float:
    """The median absolute relative error (%) of a latency model table's column (NaN if none).

    >>> import pandas as pd
    >>> median_abs_error(pd.DataFrame({"e": [10.0, -30.0, None]}), "e")
    20.0
    """
    values = np.abs(frame[column].to_numpy(dtype=float))
    values = values[np.isfinite(values)]
    return float(np.median(values)) if values.size else math.nan


def latency_model(run: dict[str, Any]) -> list[Block]:
    """Predicted vs calibrated vs measured per configuration, and the fitted scales."""
    summary = run["summary"]
    model = summary.get("latency_model") if isinstance(summary.get("latency_model"), dict) else None
    table, scales = tables.latency_model_table(run), tables.latency_scales_table(run)
    predicted = median_abs_error(table, "predicted error (%)")
    calibrated = median_abs_error(table, "calibrated error (%)")
    fitted_on = model.get("fitted_on") if model else None
    blocks: list[Block] = [
        Heading("Latency model"),
        Paragraph("Predicted: the sum of isolated layer latencies and casts (where the model's weights exceed the "
                  "last-level cache, each layer no faster than its weight bytes over the streaming bandwidth). "
                  "Calibrated: the same terms with each "
                  "policy's scale fitted on the end-to-end timings (in sample: a policy only one configuration "
                  "uses is fitted exactly to it). Error: (prediction - measured) / measured; positive is too "
                  "slow."),
        Facts([("Median |error|", f"predicted {_num(predicted, '.1f', '%')}, "
                                  f"calibrated {_num(calibrated, '.1f', '%')}"),
               ("Fitted on", f"{fitted_on} end-to-end timings" if isinstance(fitted_on, int) else MISSING),
               ("Weight streaming floor", _stream(model))]),
        Table(table),
    ]
    if scales.empty:
        return blocks + [Paragraph(f"Fitted scales: {MISSING} (not recorded by this run).")]
    return blocks + [Paragraph("Fitted scales (calibrated layer latency = scale × isolated latency):"), Table(scales)]


def _stream(model: dict[str, Any] | None) -> str:
    if not model or "stream_bandwidth" not in model:
        return MISSING
    bandwidth = model["stream_bandwidth"]
    if bandwidth is None:
        return "none (the float32 weights fit in the last-level cache)"
    return f"{_num(bandwidth / 1e9, '.1f')} GB/s measured: a layer takes at least its weight bytes over it"


def noise(summary: dict[str, Any]) -> list[Block]:
    """What the run saw of the machine's load and the timings' spread, and its verdict."""
    seen = _noise(summary)
    blocks: list[Block] = [Heading("Measurement noise")]
    if not seen:
        return blocks + [Paragraph(f"Not recorded by this run ({MISSING}).")]
    busy = seen.get("busy")
    verdict = MISSING if busy is None else ("busy" if busy else "quiet")
    cores = seen.get("cores")
    noisy, timings = seen.get("noisy_layer_timings"), seen.get("layer_timings")
    return blocks + [Facts([
        ("Verdict", verdict if seen.get("note") in (None, verdict) else f"{verdict} ({seen['note']})"),
        ("Load average (1 min)", f"{_num(seen.get('load_1m'), '.2f')} on {_num(cores, '.0f')} cores"),
        ("CPU time per wall second while timing", _num(seen.get("cpu_per_wall"), ".2f")),
        ("Median layer timing CV", _num(seen.get("median_layer_cv"), ".3f")),
        (f"Noisy layer timings (CV > {NOISY_CV:g})",
         f"{_num(noisy, '.0f')} of {_num(timings, '.0f')} (re-measured when a later run reuses them)"),
    ])]
