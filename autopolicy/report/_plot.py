"""What every report figure shares: an Agg figure, PNG output, titles, colours, short labels.

Figures are built on ``matplotlib.figure.Figure`` with an Agg canvas, never through pyplot, so a
report neither needs a display nor touches the backend or the figures of the caller's session.
"""

from __future__ import annotations

import io
import os
import textwrap
from typing import Any, Iterable, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import Bbox

from autopolicy import _atomic, policies

__all__ = ["new_figure", "save_png", "device_title", "short_labels", "policy_colors",
           "place_labels", "log_axis", "DPI", "LOG_RANGE", "MAX_HEIGHT_IN"]

DPI = 150
LOG_RANGE = 20.0  # an axis is logarithmic when its largest value is this many times its smallest
MAX_HEIGHT_IN = 40.0  # past this, a figure of many layers stops growing (labels shrink instead)
_KNOWN_COLORS = {  # one colour per policy family, the same in every figure
    "float32": "#4c72b0",
    "mixed_bfloat16": "#dd8452",
    "mixed_float16": "#c44e52",
    # Each quantization mode's colour, from the registry of quantization modes.
    **{f"{m}_from_float32": policies.get_quantization_mode(m).color for m in policies.QUANTIZATION_MODES},
}


def new_figure(width: float, height: float) -> Figure:
    """A figure with an Agg canvas and constrained layout (no pyplot state)."""
    fig = Figure(figsize=(width, min(height, MAX_HEIGHT_IN)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: str | os.PathLike) -> str:
    """Renders ``fig`` to PNG at :data:`DPI` and writes it to ``path`` atomically."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.15, facecolor="white")
    _atomic.write_bytes(path, buffer.getvalue())
    return os.fspath(path)


def device_title(summary: dict[str, Any], width: int = 90) -> str:
    """A short line naming the device, e.g. ``cpu: Intel(R) Xeon(R) ... (2 cores), jax 0.4.35``."""
    hw = summary.get("hardware")
    if isinstance(hw, dict) and hw.get("platform"):
        if hw["platform"] == "cpu" and isinstance(hw.get("cpu"), dict):
            what = f"{hw['cpu'].get('model')} ({hw['cpu'].get('cores')} cores)"
        else:
            what = f"{hw.get('device_kind')} x{hw.get('device_count', 1)}"
        line = f"{hw['platform']}: {what}, jax {hw.get('jax')}"
    else:
        line = str(summary.get("device") or "unknown device")
    return textwrap.shorten(line, width=width, placeholder=" …")


def _tail(path: str, width: int) -> str:
    """The last ``/`` components of ``path`` that fit in ``width`` characters."""
    if len(path) <= width:
        return path
    parts, kept = path.split("/"), ""
    for part in reversed(parts):
        candidate = part if not kept else f"{part}/{kept}"
        if len(candidate) + 2 > width:
            break
        kept = candidate
    return "…/" + kept if kept else "…" + path[-(width - 1):]


def short_labels(paths: Sequence[str], width: int = 30) -> list[str]:
    """Layer paths cut from the left to ``width`` characters, widened until they are unique.

    >>> short_labels(["model/encoder/block_0/attention/query", "model/head"], width=24)
    ['…/attention/query', 'model/head']
    """
    for w in range(width, max(len(p) for p in paths) + 1):
        labels = [_tail(p, w) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)


def policy_colors(names: Iterable[str]) -> dict[str, Any]:
    """A colour per policy: fixed for the default candidates, from tab10 for any other."""
    palette = colormaps["tab10"].colors
    spare = [c for i, c in enumerate(palette) if i not in (0, 1, 2, 3, 4)]
    out, extra = {}, 0
    for name in names:
        if name in _KNOWN_COLORS:
            out[name] = _KNOWN_COLORS[name]
        else:
            out[name], extra = spare[extra % len(spare)], extra + 1
    return out


def log_axis(axis) -> None:
    """A logarithmic axis labelled in plain numbers at 1, 2 and 5 times each power of ten."""
    if axis is axis.axes.xaxis:
        axis.axes.set_xscale("log")
    else:
        axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _offsets() -> list[tuple[float, float]]:
    """Label offsets in points: rings of growing radius around the point, beside it first."""
    return [(dx * r, dy * r) for r in (7, 20, 34, 48)
            for dx, dy in ((1, 0.6), (1, -0.6), (0, 1.2), (0, -1.2), (-1, 0.6), (-1, -0.6))]


_LEADER_FROM = 10.0  # points: a label further than this from its marker gets a leader line


def _annotate(ax, x: float, y: float, text: str, offset: tuple[float, float], fontsize: float):
    dx, dy = offset
    leader = {"arrowstyle": "-", "color": "#8a8a8a", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 5}
    ha = "left" if dx > 0 else ("right" if dx < 0 else "center")
    return ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", fontsize=fontsize, ha=ha,
                       va="bottom" if dy > 0 else "top",
                       arrowprops=leader if max(abs(dx), abs(dy)) > _LEADER_FROM else None)


def _distance(box: Bbox, point) -> float:
    px, py = point
    return float(np.hypot(max(box.x0 - px, 0.0, px - box.x1), max(box.y0 - py, 0.0, py - box.y1)))


def _fits(box: Bbox, frame: Bbox, taken: list, own, others: list, leader: bool) -> bool:
    """Inside the axes, clear of markers and labels, and (without a leader line) nearer its own
    marker than any other, so no reader pairs it with a neighbour."""
    if not _inside(box, frame) or any(box.overlaps(t) for t in taken):
        return False
    return leader or all(_distance(box, q) > _distance(box, own) + 6.0 for q in others)


def place_labels(ax, points: Sequence[tuple[float, float, str]], fontsize: float = 8,
                 avoid: Sequence = ()) -> None:
    """Annotates each ``(x, y, text)`` at the first nearby offset where its label fits (see
    ``_fits``) and clears the texts in ``avoid``, else at the nearest offset; labels away from
    their point get a leader line. A greedy placer: enough for the dozen labels of a figure."""
    renderer = ax.get_figure().canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pixels = [tuple(ax.transData.transform((x, y))) for x, y, _ in points]
    taken = [_marker_box(*p) for p in pixels] + [_text_box(t, renderer) for t in avoid]
    for i, (x, y, text) in enumerate(points):
        others = pixels[:i] + pixels[i + 1:]
        for offset in _offsets():
            ann = _annotate(ax, x, y, text, offset, fontsize)
            box = _text_box(ann, renderer)
            if _fits(box, frame, taken, pixels[i], others, max(map(abs, offset)) > _LEADER_FROM):
                break
            ann.remove()
        else:
            box = _text_box(_annotate(ax, x, y, text, _offsets()[0], fontsize), renderer)
        taken.append(box)


def _text_box(ann, renderer) -> Bbox:
    """The extent of a text, or of an annotation's text alone (its leader line may cross its
    own marker)."""
    if hasattr(ann, "update_positions"):
        ann.update_positions(renderer)
    return Text.get_window_extent(ann, renderer)


def _inside(box: Bbox, frame: Bbox) -> bool:
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


def _marker_box(px: float, py: float, half: float = 12.0) -> Bbox:
    return Bbox.from_extents(px - half, py - half, px + half, py + half)
