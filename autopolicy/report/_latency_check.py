"""The latency model's figure: predicted and calibrated vs measured end-to-end latency."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from autopolicy.report import _plot
from autopolicy.report._end_to_end import _MAP, _STAR, _legend_markers, _log_if_wide, configurations

__all__ = ["latency_check", "TOLERANCE"]

TOLERANCE = 0.15  # the band: a prediction within 15% of the measured latency
_BAND = "#e3f1e6"
_TEXT_BOX = {"facecolor": "white", "edgecolor": "#cccccc", "boxstyle": "round,pad=0.4"}


def _style(c: dict, colors: dict, filled: bool) -> dict:
    """A configuration's marker: filled (calibrated) or open (predicted), in its policy colour."""
    style = dict(_MAP) if c["kind"] == "map" else {"marker": "o", "markersize": 8, "linestyle": "none",
                                                    "color": colors[c["policy"]], "zorder": 5}
    style.update(markeredgecolor="black" if filled else style["color"], markeredgewidth=0.6 if filled else 1.6)
    if not filled:
        style.update(markerfacecolor="white", zorder=4)
    return style


def _points(ax, configs: list[dict]) -> list[tuple[float, float, str]]:
    """Per configuration at its measured latency: an open marker at the predicted latency, a
    filled one at the calibrated latency (whiskers: +-1 CV of the measurement), joined by a line."""
    colors, labels = _plot.policy_colors(c["policy"] for c in configs if c["policy"]), []
    for c in configs:
        y, predicted, calibrated = c["measured_ms"], c["predicted_ms"], c["calibrated_ms"]
        if not math.isfinite(y):
            continue
        main = calibrated if math.isfinite(calibrated) else predicted
        if not math.isfinite(main):
            continue
        if math.isfinite(predicted) and math.isfinite(calibrated):
            ax.plot([predicted, calibrated], [y, y], color="#9a9a9a", linewidth=0.9, zorder=3)
            ax.plot([predicted], [y], **_style(c, colors, filled=False))
        spread = [[min(c["cv"] * y, 0.95 * y)], [c["cv"] * y]] if math.isfinite(c["cv"]) else None
        ax.errorbar([main], [y], yerr=spread, ecolor="#555555", elinewidth=0.9, capsize=2.5,
                    **_style(c, colors, filled=True))
        if c["chosen"]:
            ax.plot([main], [y], **_STAR)
        labels.append((main, y, c["label"]))
    return labels


def _median_error(configs: list[dict], key: str) -> float:
    errors = [abs(c[key] - c["measured_ms"]) / c["measured_ms"] for c in configs
              if math.isfinite(c[key]) and math.isfinite(c["measured_ms"]) and c["measured_ms"] > 0]
    return 100.0 * float(np.median(errors)) if errors else math.nan


def _errors_note(configs: list[dict]) -> str:
    parts = []
    for key, name in (("predicted_ms", "predicted"), ("calibrated_ms", "calibrated")):
        value = _median_error(configs, key)
        parts.append(f"{name} {value:.1f}%" if math.isfinite(value) else f"{name} —")
    return "median |error| vs measured:\n" + ", ".join(parts)


def _legend(configs: list[dict]) -> list:
    handles = [Line2D([], [], color="#7f7f7f", linestyle="--", label="measured = prediction"),
               Patch(facecolor=_BAND, edgecolor="none", label=f"prediction within ±{TOLERANCE:.0%} of measured")]
    if any(math.isfinite(c["calibrated_ms"]) for c in configs):
        handles += [Line2D([], [], marker="o", markersize=7, linestyle="none", color="#bbbbbb",
                           markerfacecolor="white", markeredgecolor="#777777", markeredgewidth=1.6,
                           label="predicted: sum of isolated layer latencies and casts"),
                    Line2D([], [], marker="o", markersize=7, linestyle="none", color="#777777",
                           markeredgecolor="black", markeredgewidth=0.6,
                           label="calibrated: per-policy scales fitted end to end")]
    return handles + _legend_markers(configs, "uniform policy (colour: policy)")


def latency_check(run: dict[str, Any], path: str | os.PathLike) -> str:
    """Predicted (sum of isolated layer latencies and casts, open markers) and calibrated (the
    latency model fitted on the end-to-end timings, filled markers) vs measured end-to-end
    latency of each uniform policy and verified map, with a y = x line, a band of +-15% and
    the median relative error of each; whiskers are one coefficient of variation of the
    measurement. A run without a latency model shows the predicted latencies filled.

    Args:
      run: A loaded run.
      path: Where to write the PNG.

    Returns:
      ``path`` as a string.
    """
    configs = configurations(run["summary"])
    values = [v for c in configs for v in (c["predicted_ms"], c["calibrated_ms"], c["measured_ms"])
              if math.isfinite(v) and v > 0]
    low, high = (min(values) / 1.3, max(values) * 1.3) if values else (0.1, 10.0)
    fig = _plot.new_figure(7.5, 7.4)
    ax = fig.add_subplot()
    line = np.geomspace(low, high, 64)
    ax.fill_between(line, line / (1 + TOLERANCE), line / (1 - TOLERANCE), color=_BAND, linewidth=0, zorder=0)
    ax.plot([low, high], [low, high], color="#7f7f7f", linestyle="--", linewidth=1.2, zorder=1)
    labels = _points(ax, configs)
    for axis in ("x", "y"):
        _log_if_wide(ax, axis, [low, high], wide=6.0)  # ratios matter here: log spreads a cluster
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal", adjustable="box")
    ax.grid(color="#eeeeee")
    calibrated = any(math.isfinite(c["calibrated_ms"]) for c in configs)
    ax.set_xlabel("predicted latency (ms): open = sum of isolated layers and casts, filled = calibrated"
                  if calibrated else "predicted latency (ms): sum of isolated layer latencies and casts")
    ax.set_ylabel("measured end-to-end latency (ms; median of paired rounds; whisker: ±1 CV)")
    note = ax.text(0.03, 0.97, _errors_note(configs), transform=ax.transAxes, fontsize=8, va="top", ha="left",
                   bbox=_TEXT_BOX, zorder=8)
    _plot.place_labels(ax, labels, avoid=[note])
    fig.legend(handles=_legend(configs), loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.set_title(f"Predicted and calibrated vs measured end-to-end latency\n{_plot.device_title(run['summary'])}",
                 fontsize=10)
    return _plot.save_png(fig, path)
