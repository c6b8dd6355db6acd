"""The end-to-end figures of a report: the Pareto frontier and predicted vs measured latency.

Both plot the configurations the run timed as whole models: every uniform policy and every
verified map (round), with the chosen one as a star.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from autopolicy.report import _plot

__all__ = ["pareto_frontier", "latency_check", "configurations"]

_STAR = {"marker": "*", "markersize": 19, "color": "#ffd21f", "markeredgecolor": "black",
         "markeredgewidth": 0.9, "linestyle": "none", "zorder": 6}
_TEXT_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1}
_MAP = {"marker": "D", "markersize": 7, "color": "#333333", "linestyle": "none", "zorder": 4}


def _ms(seconds: Any) -> float:
    return seconds * 1e3 if isinstance(seconds, (int, float)) and math.isfinite(seconds) else math.nan


def _number(value: Any) -> float:
    """``value`` as a float, NaN when it is missing (null in the summary) or not finite."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def configurations(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The uniform policies and verified maps of a summary, with latencies in ms (NaN if unknown).

    Each item has ``name`` (as ``summary["chosen"]["name"]`` spells it), ``label``, ``kind``
    ("uniform" or "map"), ``policy`` (uniforms only), ``predicted_ms``, ``measured_ms``,
    ``cv``, ``metric`` (NaN when not evaluated) and ``chosen``.
    """
    chosen = summary["chosen"].get("name")
    items = [("uniform", f"uniform {p}", p, p, e) for p, e in summary["uniform"].items()]
    items += [("map", f"map (round {e.get('round')})", None, f"map round {e.get('round')}", e)
              for e in summary.get("maps") or []]
    return [{"name": name, "label": label, "kind": kind, "policy": policy,
             "predicted_ms": _ms(e.get("predicted_latency_s")), "measured_ms": _ms(e.get("measured_latency_s")),
             "cv": _number(e.get("measured_latency_cv")), "metric": _number(e.get("metric")),
             "chosen": name == chosen} for kind, name, policy, label, e in items]


def _log_if_wide(ax, axis: str, values: list[float], wide: float = _plot.LOG_RANGE) -> None:
    finite = [v for v in values if math.isfinite(v) and v > 0]
    if finite and max(finite) > wide * min(finite):
        _plot.log_axis(ax.xaxis if axis == "x" else ax.yaxis)


def _metric_limits(budget: dict[str, Any], metrics: list[float]) -> tuple[float, float]:
    """A metric axis around the budget: values far below it are drawn on the bottom edge."""
    base, floor_at = _number(budget.get("baseline_metric")), _number(budget.get("min_metric"))
    known = [m for m in metrics + [base, floor_at] if math.isfinite(m)] or [0.0, 1.0]
    allowed = _number(budget.get("allowed_drop"))
    magnitude = abs(base) if math.isfinite(base) else 1.0
    scale = max(allowed if math.isfinite(allowed) else 0.0, 1e-3 * max(magnitude, 1.0))
    floor = (floor_at if math.isfinite(floor_at) else min(known)) - 6 * scale
    bottom, top = max(floor, min(known)), max(known)
    pad = max(top - bottom, scale)
    return bottom - 0.1 * pad, top + 0.25 * pad  # room above the best points for their labels


def _frontier_line(ax, frontier: pd.DataFrame, right: float) -> list:
    """The frontier as a step line: the best predicted metric at each latency, held to ``right``."""
    if frontier.empty:
        return []
    ordered = frontier.sort_values("predicted_latency_s")
    x = ordered["predicted_latency_s"].to_numpy(dtype=float) * 1e3
    y = ordered["predicted_metric"].to_numpy(dtype=float)
    ax.step(np.append(x, max(right, x[-1])), np.append(y, y[-1]), where="post", color="#7f7f7f", linewidth=1.6,
            zorder=2)
    ax.plot(x, y, linestyle="none", color="#7f7f7f", marker="o", markersize=3.5, zorder=2)
    return [Line2D([], [], color="#7f7f7f", marker="o", markersize=3.5,
                   label="predicted frontier (sum of layer latencies)")]


def _budget_lines(ax, budget: dict[str, Any]) -> list:
    handles = []
    for key, style, label in (("min_metric", {"color": "#c0392b", "linestyle": "--"}, "budget: min metric"),
                              ("baseline_metric", {"color": "#4c72b0", "linestyle": ":"}, "float32 metric")):
        value = _number(budget.get(key))
        if math.isfinite(value):
            ax.axhline(value, linewidth=1.3, zorder=1, **style)
            handles.append(Line2D([], [], linewidth=1.3, label=f"{label} = {value:.4g}", **style))
    return handles


def _plot_points(ax, configs: list[dict], bottom: float, top: float) -> list[tuple[float, float, str]]:
    """Markers at (measured latency, verified metric); below the axis: a triangle on its edge."""
    colors, labels = _plot.policy_colors(c["policy"] for c in configs if c["policy"]), []
    edge = bottom + 0.03 * (top - bottom)
    for c in configs:
        x, y = c["measured_ms"], c["metric"]
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        off_scale = y < bottom
        style = dict(_MAP) if c["kind"] == "map" else {"marker": "o", "markersize": 8, "linestyle": "none",
                                                        "color": colors[c["policy"]], "zorder": 5}
        if off_scale:
            style["marker"] = "v"
        ax.plot([x], [edge if off_scale else y], markeredgecolor="black", markeredgewidth=0.6, **style)
        if c["chosen"]:
            ax.plot([x], [edge if off_scale else y], **_STAR)
        text = f"{c['label']} ({y:.3g}, off scale)" if off_scale else c["label"]
        labels.append((x, edge if off_scale else y, text))
    return labels


def _not_evaluated(ax, configs: list[dict]) -> list:
    """A dotted vertical line at the measured latency of each configuration never scored."""
    colors = _plot.policy_colors(c["policy"] for c in configs if c["policy"])
    missing = [c for c in configs if math.isfinite(c["measured_ms"]) and not math.isfinite(c["metric"])]
    for c in missing:
        color = colors.get(c["policy"], "#333333")
        ax.axvline(c["measured_ms"], color=color, linestyle=":", linewidth=1.6, zorder=1)
        ax.annotate(f"{c['label']}: not evaluated", (c["measured_ms"], 0.03), xycoords=ax.get_xaxis_transform(),
                    xytext=(-3, 0), textcoords="offset points", rotation=90, fontsize=7.5, color=color,
                    ha="right", va="bottom", bbox=_TEXT_BOX)
    if not missing:
        return []
    return [Line2D([], [], color="#555555", linestyle=":", label="uniform not evaluated (metric unknown)")]


def _legend_markers(configs: list[dict], uniform: str) -> list:
    handles = [Line2D([], [], marker="o", markersize=7, linestyle="none", color="#bbbbbb", markeredgecolor="black",
                      markeredgewidth=0.6, label=uniform)]
    if any(c["kind"] == "map" for c in configs):
        handles.append(Line2D([], [], markeredgecolor="black", label="verified map (round)", **_MAP))
    chosen = next((c["label"] for c in configs if c["chosen"]), None)
    if chosen:
        handles.append(Line2D([], [], label=f"chosen: {chosen}", **{**_STAR, "markersize": 13}))
    return handles


def pareto_frontier(run: dict[str, Any], path: str | os.PathLike) -> str:
    """End-to-end latency vs metric: the predicted frontier (a step line), the uniform policies
    (measured latency, verified metric; a dotted line where the metric was never evaluated),
    the verified maps, the chosen one as a star, and the budget as a horizontal line.

    Args:
      run: A loaded run.
      path: Where to write the PNG.

    Returns:
      ``path`` as a string.
    """
    summary, frontier = run["summary"], run["frontier"]
    configs = configurations(summary)
    fig = _plot.new_figure(9.0, 6.0)
    ax = fig.add_subplot()
    measured = [c["measured_ms"] for c in configs if math.isfinite(c["measured_ms"])]
    handles = _frontier_line(ax, frontier, max(measured, default=0.0))
    metrics = [c["metric"] for c in configs] + list(frontier["predicted_metric"].to_numpy(dtype=float))
    bottom, top = _metric_limits(summary["budget"], metrics)
    handles += _budget_lines(ax, summary["budget"])
    labels = _plot_points(ax, configs, bottom, top)
    handles += _not_evaluated(ax, configs) + _legend_markers(
        configs, "uniform policy (measured latency, verified metric; colour: policy)")
    _log_if_wide(ax, "x", [c["measured_ms"] for c in configs] + list(frontier["predicted_latency_s"] * 1e3))
    ax.set_ylim(bottom, top)
    ax.set_xlim(*ax.get_xlim())  # freeze the limits before placing labels in screen space
    ax.grid(color="#eeeeee")
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("metric (higher is better)")
    _plot.place_labels(ax, labels, avoid=list(ax.texts))  # clear of the "not evaluated" notes
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.set_title(f"Latency vs metric: Pareto frontier, uniform policies and the chosen map\n"
                 f"{_plot.device_title(summary)}", fontsize=10)
    return _plot.save_png(fig, path)


def _check_points(ax, configs: list[dict]) -> list[tuple[float, float, str]]:
    colors, labels = _plot.policy_colors(c["policy"] for c in configs if c["policy"]), []
    for c in configs:
        x, y = c["predicted_ms"], c["measured_ms"]
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        style = dict(_MAP) if c["kind"] == "map" else {"marker": "o", "markersize": 8, "linestyle": "none",
                                                        "color": colors[c["policy"]], "zorder": 5}
        spread = [[min(c["cv"] * y, 0.95 * y)], [c["cv"] * y]] if math.isfinite(c["cv"]) else None
        ax.errorbar([x], [y], yerr=spread, markeredgecolor="black", markeredgewidth=0.6, ecolor="#555555",
                    elinewidth=0.9, capsize=2.5, **style)
        if c["chosen"]:
            ax.plot([x], [y], **_STAR)
        labels.append((x, y, c["label"]))
    return labels


def latency_check(run: dict[str, Any], path: str | os.PathLike) -> str:
    """Predicted (sum of layer latencies and casts) vs measured end-to-end latency of each
    uniform policy and verified map, with a y = x line; whiskers are one coefficient of
    variation of the measurement.

    Args:
      run: A loaded run.
      path: Where to write the PNG.

    Returns:
      ``path`` as a string.
    """
    configs = configurations(run["summary"])
    values = [v for c in configs for v in (c["predicted_ms"], c["measured_ms"]) if math.isfinite(v) and v > 0]
    low, high = (min(values) / 1.3, max(values) * 1.3) if values else (0.1, 10.0)
    fig = _plot.new_figure(7.5, 7.0)
    ax = fig.add_subplot()
    ax.plot([low, high], [low, high], color="#7f7f7f", linestyle="--", linewidth=1.2, zorder=1)
    labels = _check_points(ax, configs)
    for axis in ("x", "y"):
        _log_if_wide(ax, axis, [low, high], wide=6.0)  # ratios matter here: log spreads a cluster
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal", adjustable="box")
    ax.grid(color="#eeeeee")
    ax.set_xlabel("predicted latency (ms): sum of measured layer latencies and casts")
    ax.set_ylabel("measured end-to-end latency (ms; whisker: ±1 CV)")
    _plot.place_labels(ax, labels)
    handles = [Line2D([], [], color="#7f7f7f", linestyle="--", label="measured = predicted")]
    handles += _legend_markers(configs, "uniform policy (colour: policy)")
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    ax.set_title(f"Predicted vs measured end-to-end latency\n{_plot.device_title(run['summary'])}", fontsize=10)
    return _plot.save_png(fig, path)
