"""``write_report``: a run directory in, ``report.md``, ``report.html`` and ``figures/*.png`` out."""

from __future__ import annotations

import os

from autopolicy import _atomic
from autopolicy.report import _document
from autopolicy.report._load import read_run
from autopolicy.report._sections import report_blocks
from autopolicy.report.figures import FIGURES

__all__ = ["write_report", "markdown", "REPORT_MD", "REPORT_HTML", "FIGURE_DIR", "FIGURE_LINKS"]

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
FIGURE_DIR = "figures"
#: Each figure's path in the report, relative to the report's directory.
FIGURE_LINKS = {name: f"{FIGURE_DIR}/{name}.png" for name in FIGURES}


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Writes the report of a tuning run: Markdown, self-contained HTML, and PNG figures.

    Every file is written atomically. ``report.md`` links to ``figures/*.png``; ``report.html``
    embeds the same figures as data URIs and loads nothing from outside.

    Args:
      run_dir: A run directory written by :meth:`autopolicy.search.TuneResult.save`.
      out_dir: Where to write the report; defaults to ``run_dir``.

    Returns:
      The paths written: ``{"markdown": ..., "html": ..., "sensitivity": ..., "layer_latency":
      ..., "pareto_frontier": ..., "latency_check": ...}`` (the figure names are the keys of
      :data:`autopolicy.report.FIGURES`).

    Raises:
      FileNotFoundError: if ``run_dir`` or one of its files is missing.
      ValueError: if a file of the run is malformed.
    """
    run = read_run(run_dir)
    out_dir = os.fspath(run_dir if out_dir is None else out_dir)
    written = {name: plot(run, os.path.join(out_dir, FIGURE_LINKS[name])) for name, plot in FIGURES.items()}
    images = {}
    for name, path in written.items():
        with open(path, "rb") as f:
            images[FIGURE_LINKS[name]] = f.read()
    blocks = report_blocks(run, run_dir, FIGURE_LINKS)
    paths = {"markdown": os.path.join(out_dir, REPORT_MD), "html": os.path.join(out_dir, REPORT_HTML)}
    _atomic.write_text(paths["markdown"], _document.to_markdown(blocks))
    _atomic.write_text(paths["html"], _document.to_html(blocks, "autopolicy tuning report", images))
    return {**paths, **written}


def markdown(run_dir: str | os.PathLike) -> str:
    """The Markdown :func:`write_report` writes for ``run_dir``, without drawing its figures (it
    links to them in ``figures/``); nothing is written."""
    return _document.to_markdown(report_blocks(read_run(run_dir), run_dir, FIGURE_LINKS))
