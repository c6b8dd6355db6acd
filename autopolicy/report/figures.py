"""The per-layer figures of a report: the sensitivity heatmap and the layer latency bars.

Each function takes a loaded run (the dict :func:`autopolicy.report.read_run` returns) and an
output path, writes a PNG there (atomically, Agg backend, 150 dpi) and returns the path. The
end-to-end figures (Pareto frontier; predicted and calibrated vs measured latency) are written
in private modules and re-exported here, so this is the one public place for every figure.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.patches import Patch, Rectangle

from autopolicy.report import _plot
from autopolicy.report._end_to_end import pareto_frontier
from autopolicy.report._latency_check import latency_check
from autopolicy.report.tables import pivot

__all__ = ["sensitivity_heatmap", "layer_latency_bars", "pareto_frontier", "latency_check", "FIGURES"]

# Cells without a measured accuracy cost: face colour, hatch, and how the legend names them.
_UNMEASURED = {
    "skipped": ("#d9d9d9", "//"),
    "disqualified": ("#8c8c8c", "xx"),
    "not measured": ("#f4f4f4", ".."),
    "not needed": ("#eaf2fb", "\\\\"),
    "not a candidate": ("white", ""),
}
_PROFILED = ("measured", "reference")


def _kind(status: Any) -> str | None:
    """The legend group of a cell's status, or None when its cost was measured."""
    if not isinstance(status, str):
        return "not a candidate"
    if status in _PROFILED:
        return None
    kind = status.partition(":")[0]
    return kind if kind in _UNMEASURED else "not measured"


def _shade_unmeasured(ax, status: pd.DataFrame) -> list[Patch]:
    """Greys and hatches the cells without a cost; returns one legend patch per kind present."""
    reasons: dict[str, list[str]] = {}
    for (i, j), value in np.ndenumerate(status.to_numpy(dtype=object)):
        kind = _kind(value)
        if kind is None:
            continue
        face, hatch = _UNMEASURED[kind]
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=face, hatch=hatch, edgecolor="#9a9a9a",
                               linewidth=0))
        found = reasons.setdefault(kind, [])
        reason = value.partition(": ")[2] if isinstance(value, str) else ""
        if reason and reason not in found:
            found.append(reason)
    return [Patch(facecolor=_UNMEASURED[k][0], hatch=_UNMEASURED[k][1], edgecolor="#9a9a9a",
                  label=f"{k} ({'; '.join(r)})" if r else k) for k, r in reasons.items()]


def _annotate_costs(ax, values: np.ndarray, status: pd.DataFrame, vmax: float) -> None:
    """Writes each measured cost in its cell ("ref" for float32, "n/a" where not a candidate)."""
    for (i, j), value in np.ndenumerate(values):
        cell = status.iat[i, j]
        if not isinstance(cell, str):
            ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="#9a9a9a")
        elif cell in _PROFILED and math.isfinite(value):
            text = "ref" if cell == "reference" else ("0" if value == 0 else f"{value:.2g}")
            color = "white" if value / vmax > 0.6 else "black"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color)


def _outline_chosen(ax, chosen: pd.DataFrame) -> Patch:
    for i, j in zip(*np.nonzero(chosen.to_numpy(dtype=bool))):
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.6,
                               zorder=4))  # above the white cell grid
    return Patch(facecolor="none", edgecolor="black", linewidth=2.6, label="chosen")


def _cell_grid(ax, layers: list[str], policies: list[str]) -> None:
    ax.set_xticks(range(len(policies)), policies, rotation=25, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(layers)), _plot.short_labels(layers), fontsize=9 if len(layers) <= 40 else 6)
    ax.set_xticks(np.arange(-0.5, len(policies)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(layers)), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlim(-0.5, len(policies) - 0.5)
    ax.set_ylim(len(layers) - 0.5, -0.5)


def sensitivity_heatmap(run: dict[str, Any], path: str | os.PathLike) -> str:
    """Layers x policies coloured by accuracy cost (metric drop with only that layer changed; its
    rise for a lower-is-better metric),
    beside the same grid coloured by the model output's SQNR where layers were scored.

    Cells without a measured cost are grey and hatched by reason (skipped, disqualified),
    blank ones are policies the layer has no kernel for; chosen cells are outlined. The
    allowed drop is marked on the colour bar.

    Args:
      run: A loaded run.
      path: Where to write the PNG.

    Returns:
      ``path`` as a string.
    """
    cost, status = pivot(run, "accuracy_cost"), pivot(run, "status")
    layers, policies = list(cost.index), list(cost.columns)
    allowed = run["summary"]["budget"].get("allowed_drop") or 0.0
    word = "drop" if run["summary"]["budget"].get("higher_is_better", True) is not False else "rise"
    values = cost.to_numpy(dtype=float)
    finite = values[np.isfinite(values)]
    vmax = max(float(finite.max()) if finite.size else 0.0, allowed, 1e-12)
    sqnr = _scored_sqnr(run, status)
    panels = 1 if sqnr is None else 2
    fig = _plot.new_figure((3.4 + 1.35 * len(policies)) * panels, 2.4 + 0.42 * len(layers))
    ax = fig.add_subplot(1, panels, 1)
    cmap = colormaps["YlOrRd"].with_extremes(bad="white")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
    handles = _shade_unmeasured(ax, status) + [_outline_chosen(ax, pivot(run, "chosen").eq(True))]
    if values.size <= 600:
        _annotate_costs(ax, values, status, vmax)
    _cell_grid(ax, layers, policies)
    bar = fig.colorbar(image, ax=ax, label=f"accuracy cost (metric {word} vs float32)", shrink=0.9)
    if allowed:
        bar.ax.axhline(allowed, color="black", linestyle="--", linewidth=1.2)
        bar.ax.text(1.6, allowed, f"allowed\n{word}", transform=bar.ax.get_yaxis_transform(), fontsize=7, va="center")
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 2), fontsize=8, frameon=False)
    ax.set_title(f"Sensitivity: accuracy cost per layer and policy\n{_plot.device_title(run['summary'])}",
                 fontsize=10)
    if sqnr is not None:
        _sqnr_panel(fig, fig.add_subplot(1, 2, 2), sqnr, layers, policies)
    return _plot.save_png(fig, path)


def _scored_sqnr(run: dict[str, Any], status: pd.DataFrame) -> np.ndarray | None:
    """The model-output SQNR (dB) of each scored single-layer change (NaN elsewhere and for
    float32), or None when the profile has none (a run that scored no layer)."""
    if "sqnr_db" not in run["profile"].columns:
        return None
    values = pivot(run, "sqnr_db").reindex(index=status.index, columns=status.columns).to_numpy(dtype=float)
    scored = status.eq("measured").to_numpy()
    values = np.where(scored & np.isfinite(values), values, np.nan)
    return values if np.isfinite(values).any() else None


def _sqnr_panel(fig, ax, sqnr: np.ndarray, layers: list[str], policies: list[str]) -> None:
    """The same layers x policies by the SQNR of the model's output with only that layer changed:
    where a coarse metric (retrieval top-1) does not move, it still shows which layers lose most."""
    finite = sqnr[np.isfinite(sqnr)]
    low, high = float(finite.min()), float(finite.max())
    cmap = colormaps["YlOrRd_r"].with_extremes(bad="white")
    image = ax.imshow(np.ma.masked_invalid(sqnr), cmap=cmap, vmin=low, vmax=max(high, low + 1e-9), aspect="auto")
    if sqnr.size <= 600:
        for (i, j), value in np.ndenumerate(sqnr):
            if math.isfinite(value):
                dark = (high - value) / max(high - low, 1e-9) > 0.6
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
    _cell_grid(ax, layers, policies)
    fig.colorbar(image, ax=ax, label="model output SQNR vs float32 (dB; lower: more sensitive)", shrink=0.9)
    ax.set_title("Output SQNR with only that layer changed\n(blank: float32, not scored or not a candidate)",
                 fontsize=10)


def _whiskers(run: dict[str, Any], policy: str, median: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    if not {"latency_p25_s", "latency_p75_s"} <= set(run["profile"].columns):
        return None
    low = pivot(run, "latency_p25_s")[policy].to_numpy(dtype=float)[rows] * 1e3
    high = pivot(run, "latency_p75_s")[policy].to_numpy(dtype=float)[rows] * 1e3
    spread = np.stack([median - low, high - median])
    return np.where(np.isfinite(spread), np.clip(spread, 0.0, None), 0.0)


def _bars(ax, run: dict[str, Any], latency: pd.DataFrame, chosen: pd.DataFrame) -> list:
    """One bar per layer and policy, whiskers 25th-75th percentile, chosen bars outlined."""
    policies, colors = list(latency.columns), _plot.policy_colors(latency.columns)
    height = 0.82 / len(policies)
    for j, policy in enumerate(policies):
        median = latency[policy].to_numpy(dtype=float)
        rows = np.nonzero(np.isfinite(median))[0]
        y = rows + (j - (len(policies) - 1) / 2) * height
        ax.barh(y, median[rows], height=height * 0.9, color=colors[policy], label=policy,
                xerr=_whiskers(run, policy, median[rows], rows), error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        picked = chosen[policy].to_numpy(dtype=bool)[rows]
        ax.barh(y[picked], median[rows][picked], height=height * 0.9, fill=False, edgecolor="black", linewidth=2)
    return [Patch(facecolor=colors[p], label=p) for p in policies] + [
        Patch(facecolor="none", edgecolor="black", linewidth=2, label="chosen")]


def layer_latency_bars(run: dict[str, Any], path: str | os.PathLike) -> str:
    """Each layer's median latency under each policy (ms), grouped by layer, chosen outlined.

    The latency axis is logarithmic when the values span more than a factor of 20.

    Args:
      run: A loaded run.
      path: Where to write the PNG.

    Returns:
      ``path`` as a string.
    """
    latency, chosen = pivot(run, "latency_s") * 1e3, pivot(run, "chosen").eq(True)
    layers = list(latency.index)
    fig = _plot.new_figure(9.0, 2.3 + len(layers) * (0.13 * latency.shape[1] + 0.25))
    ax = fig.add_subplot()
    handles = _bars(ax, run, latency, chosen)
    finite = latency.to_numpy(dtype=float)[np.isfinite(latency.to_numpy(dtype=float))]
    if finite.size and finite.max() > _plot.LOG_RANGE * finite.min() > 0:
        _plot.log_axis(ax.xaxis)
    ax.set_yticks(range(len(layers)), _plot.short_labels(layers), fontsize=9 if len(layers) <= 40 else 6)
    ax.set_ylim(len(layers) - 0.5, -0.5)
    for i in range(len(layers) - 1):
        ax.axhline(i + 0.5, color="#dddddd", linewidth=0.8)
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    ax.set_xlabel("layer latency (ms; bar: median, whisker: 25th-75th percentile)")
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize=8, frameon=False)
    ax.set_title(f"Layer latency by policy\n{_plot.device_title(run['summary'])}", fontsize=10)
    return _plot.save_png(fig, path)


# name -> function: the report writes each to figures/<name>.png, in this order.
FIGURES = {
    "sensitivity": sensitivity_heatmap,
    "layer_latency": layer_latency_bars,
    "pareto_frontier": pareto_frontier,
    "latency_check": latency_check,
}
