"""The end-to-end Pareto figure of a report, and what the end-to-end figures share.

The figures plot the configurations the run timed as whole models: every uniform policy and
every verified map (round), with the chosen one as a star.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from autopolicy.report import _plot

__all__ = ["pareto_frontier", "configurations", "measured_frontier", "direction"]

_STAR = {"marker": "*", "markersize": 19, "color": "#ffd21f", "markeredgecolor": "black",
         "markeredgewidth": 0.9, "linestyle": "none", "zorder": 6}
_TEXT_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1}
_MAP = {"marker": "D", "markersize": 7, "color": "#333333", "linestyle": "none", "zorder": 4}


def _ms(seconds: Any) -> float:
    return seconds * 1e3 if isinstance(seconds, (int, float)) and math.isfinite(seconds) else math.nan


def _number(value: Any) -> float:
    """``value`` as a float, NaN when it is missing (null in the summary) or not finite."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def direction(summary: dict[str, Any]) -> float:
    """1 for a higher-is-better metric (and runs saved before metrics had a direction), -1 for a
    lower-is-better one: ``direction * metric`` grows as the metric gets better."""
    budget = summary.get("budget") if isinstance(summary.get("budget"), dict) else {}
    return 1.0 if budget.get("higher_is_better", True) else -1.0


def configurations(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The uniform policies and verified maps of a summary, with latencies in ms (NaN if unknown).

    Each item has ``name`` (as ``summary["chosen"]["name"]`` spells it), ``label``, ``kind``
    ("uniform" or "map"), ``policy`` (uniforms only), ``predicted_ms``, ``calibrated_ms`` (NaN
    in a run without a latency model), ``measured_ms``, ``cv``, ``metric`` (NaN when not
    evaluated) and ``chosen``.
    """
    chosen = summary["chosen"].get("name")
    items = [("uniform", f"uniform {p}", p, p, e) for p, e in summary["uniform"].items()]
    items += [("map", f"map (round {e.get('round')})", None, f"map round {e.get('round')}", e)
              for e in summary.get("maps") or []]
    return [{"name": name, "label": label, "kind": kind, "policy": policy,
             "predicted_ms": _ms(e.get("predicted_latency_s")), "calibrated_ms": _ms(e.get("calibrated_latency_s")),
             "measured_ms": _ms(e.get("measured_latency_s")),
             "cv": _number(e.get("measured_latency_cv")), "metric": _number(e.get("metric")),
             "chosen": name == chosen} for kind, name, policy, label, e in items]


def _log_if_wide(ax, axis: str, values: list[float], wide: float = _plot.LOG_RANGE) -> None:
    finite = [v for v in values if math.isfinite(v) and v > 0]
    if finite and max(finite) > wide * min(finite):
        _plot.log_axis(ax.xaxis if axis == "x" else ax.yaxis)


def _limit(budget: dict[str, Any]) -> float:
    """The worst metric within budget (``min_metric`` of a run saved before ``limit_metric``)."""
    return _number(budget.get("limit_metric", budget.get("min_metric")))


def _metric_limits(budget: dict[str, Any], metrics: list[float], sign: float = 1.0) -> tuple[float, float]:
    """A metric axis around the budget, in ``sign * metric`` (up is better): values far worse
    than it are drawn on the bottom edge."""
    base, floor_at = sign * _number(budget.get("baseline_metric")), sign * _limit(budget)
    known = [m for m in metrics + [base, floor_at] if math.isfinite(m)] or [0.0, 1.0]
    allowed = _number(budget.get("allowed_drop"))
    magnitude = abs(base) if math.isfinite(base) else 1.0
    scale = max(allowed if math.isfinite(allowed) else 0.0, 1e-3 * max(magnitude, 1.0))
    floor = (floor_at if math.isfinite(floor_at) else min(known)) - 6 * scale
    bottom, top = max(floor, min(known)), max(known)
    pad = max(top - bottom, scale)
    return bottom - 0.1 * pad, top + 0.25 * pad  # room above the best points for their labels


_PREDICTED = "#7f7f7f"
_MEASURED = "#1b7f3b"


def _step(ax, x: np.ndarray, y: np.ndarray, right: float, **style) -> None:
    """A frontier as a step line: the best metric at each latency, held to ``right``."""
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    ax.step(np.append(x, max(right, x[-1])), np.append(y, y[-1]), where="post", **style)


def _predicted_rows(frontier: pd.DataFrame) -> pd.DataFrame:
    """The solver's frontier: the rows marked "predicted" (every row of an older run)."""
    if "source" in frontier.columns:
        frontier = frontier[frontier["source"] == "predicted"]
    keep = np.isfinite(frontier["predicted_latency_s"].to_numpy(dtype=float)) & np.isfinite(
        frontier["predicted_metric"].to_numpy(dtype=float))
    return frontier[keep]


def measured_frontier(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured Pareto frontier, fastest first: ``{"name", "measured_ms", "metric"}`` per
    configuration timed and scored end to end that no other beats on both.

    From ``frontier.csv``'s "measured" rows; an older run without them gets the same rule
    applied to its summary's configurations.
    """
    frontier = run["frontier"]
    if "source" in frontier.columns and {"name", "metric", "measured_latency_s"} <= set(frontier.columns):
        rows = frontier[frontier["source"] == "measured"]
        points = [{"name": str(n), "measured_ms": _ms(_number(t)), "metric": _number(m)}
                  for n, m, t in zip(rows["name"], rows["metric"], rows["measured_latency_s"])]
        return sorted((p for p in points if math.isfinite(p["measured_ms"]) and math.isfinite(p["metric"])),
                      key=lambda p: p["measured_ms"])
    sign = direction(run["summary"])
    scored = sorted((c for c in configurations(run["summary"])
                     if math.isfinite(c["measured_ms"]) and math.isfinite(c["metric"])),
                    key=lambda c: (c["measured_ms"], -sign * c["metric"]))
    out, best = [], -math.inf
    for c in scored:
        if sign * c["metric"] > best:
            out.append({"name": c["name"], "measured_ms": c["measured_ms"], "metric": c["metric"]})
            best = sign * c["metric"]
    return out


def _frontier_lines(ax, run: dict[str, Any], configs: list[dict], right: float, sign: float = 1.0) -> tuple[list, list]:
    """The predicted frontier (grey, when the run has one) and the measured frontier (green, its
    points ringed; a point no configuration marks gets its own marker), drawn at ``sign *
    metric``. Returns the legend handles and the labels of points that are not configurations."""
    handles, labels = [], []
    predicted = _predicted_rows(run["frontier"])
    if not predicted.empty:
        x = predicted["predicted_latency_s"].to_numpy(dtype=float) * 1e3
        y = sign * predicted["predicted_metric"].to_numpy(dtype=float)
        # Dashed and above the measured line, so it stays visible where the two coincide.
        _step(ax, x, y, right, color=_PREDICTED, linewidth=1.3, linestyle="--", zorder=3)
        ax.plot(x, y, linestyle="none", color=_PREDICTED, marker="o", markersize=3.5, zorder=3)
        handles.append(Line2D([], [], color=_PREDICTED, marker="o", markersize=3.5, linestyle="--",
                              label="predicted frontier (solver: sum of isolated layer latencies)"))
    measured = measured_frontier(run)
    if measured:
        x = np.array([p["measured_ms"] for p in measured])
        y = sign * np.array([p["metric"] for p in measured])
        _step(ax, x, y, right, color=_MEASURED, linewidth=2.2, zorder=2)
        ax.plot(x, y, linestyle="none", marker="o", markersize=15, markerfacecolor="none",
                markeredgecolor=_MEASURED, markeredgewidth=1.8, zorder=7)
        known = {c["name"] for c in configs}
        for p in measured:
            if p["name"] not in known:
                ax.plot([p["measured_ms"]], [sign * p["metric"]], marker="o", markersize=6, color=_MEASURED, zorder=5)
                labels.append((p["measured_ms"], sign * p["metric"], p["name"]))
        handles.append(Line2D([], [], color=_MEASURED, linewidth=2.2, marker="o", markersize=11,
                              markerfacecolor="none", markeredgewidth=1.8,
                              label="measured frontier (timed end to end; ringed)"))
    return handles, labels


def _budget_lines(ax, budget: dict[str, Any], sign: float = 1.0) -> list:
    handles = []
    bound = "budget: min metric" if sign > 0 else "budget: max metric"
    for value, style, label in ((_limit(budget), {"color": "#c0392b", "linestyle": "--"}, bound),
                                (_number(budget.get("baseline_metric")), {"color": "#4c72b0", "linestyle": ":"},
                                 "float32 metric")):
        if math.isfinite(value):
            ax.axhline(sign * value, linewidth=1.3, zorder=1, **style)
            handles.append(Line2D([], [], linewidth=1.3, label=f"{label} = {value:.4g}", **style))
    return handles


def _plot_points(ax, configs: list[dict], bottom: float, top: float,
                 sign: float = 1.0) -> list[tuple[float, float, str]]:
    """Markers at (measured latency, ``sign *`` verified metric); below the axis: a triangle on its edge."""
    colors, labels = _plot.policy_colors(c["policy"] for c in configs if c["policy"]), []
    edge = bottom + 0.03 * (top - bottom)
    for c in configs:
        x, metric = c["measured_ms"], c["metric"]
        y = sign * metric
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
        text = f"{c['label']} ({metric:.3g}, off scale)" if off_scale else c["label"]
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
    """End-to-end latency vs metric: the measured frontier (configurations timed and scored end
    to end that no other beats, ringed, in every run), the predicted frontier when the run has
    one (the solver's, a grey step line), the uniform policies (measured latency, verified
    metric; a dotted line where the metric was never evaluated), the verified maps, the chosen
    one as a star, and the budget as a horizontal line. Better is up: a lower-is-better metric
    is drawn on an axis that grows downwards.

    Args:
      run: A loaded run.
      path: Where to write the PNG.

    Returns:
      ``path`` as a string.
    """
    summary, predicted = run["summary"], _predicted_rows(run["frontier"])
    configs, measured = configurations(summary), measured_frontier(run)
    fig = _plot.new_figure(9.0, 6.0)
    ax = fig.add_subplot()
    xs = [c["measured_ms"] for c in configs] + [p["measured_ms"] for p in measured]
    xs += list(predicted["predicted_latency_s"].to_numpy(dtype=float) * 1e3)
    sign = direction(summary)
    handles, extra_labels = _frontier_lines(ax, run, configs, max((x for x in xs if math.isfinite(x)), default=0.0),
                                            sign)
    metrics = [c["metric"] for c in configs] + [p["metric"] for p in measured]
    metrics += list(predicted["predicted_metric"].to_numpy(dtype=float))
    bottom, top = _metric_limits(summary["budget"], [sign * m for m in metrics], sign)
    handles += _budget_lines(ax, summary["budget"], sign)
    labels = _plot_points(ax, configs, bottom, top, sign) + extra_labels
    handles += _not_evaluated(ax, configs) + _legend_markers(
        configs, "uniform policy (measured latency, verified metric; colour: policy)")
    _log_if_wide(ax, "x", xs)
    ax.set_ylim(bottom, top)
    ax.set_xlim(*ax.get_xlim())  # freeze the limits before placing labels in screen space
    ax.grid(color="#eeeeee")
    ax.set_xlabel("end-to-end latency (ms): measured; predicted for the grey frontier")
    if sign < 0:  # drawn as -metric so that up is better: the ticks read the metric itself
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{-v:.4g}"))
    ax.set_ylabel("metric (higher is better)" if sign > 0 else "metric (lower is better; axis grows downwards)")
    _plot.place_labels(ax, labels, avoid=list(ax.texts))  # clear of the "not evaluated" notes
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.set_title(f"Latency vs metric: measured and predicted Pareto frontiers, uniform policies, chosen map\n"
                 f"{_plot.device_title(summary)}", fontsize=10)
    return _plot.save_png(fig, path)
