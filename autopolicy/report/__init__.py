"""Reports of tuning runs: tables, figures, and a Markdown/HTML report from a run directory.

This package imports pandas and matplotlib (Agg canvas only); ``import autopolicy`` does not
import it. The CLI's ``autopolicy report`` calls :func:`write_report`.
"""

from autopolicy.report._load import read_run
from autopolicy.report.figures import (
    FIGURES,
    latency_check,
    layer_latency_bars,
    pareto_frontier,
    sensitivity_heatmap,
)
from autopolicy.report.render import write_report
from autopolicy.report.tables import (
    latency_model_table,
    latency_scales_table,
    layer_table,
    overview_table,
    policy_map_table,
    speedup_text,
    to_markdown,
)

__all__ = [
    "write_report",
    "read_run",
    # tables
    "layer_table",
    "overview_table",
    "latency_model_table",
    "latency_scales_table",
    "speedup_text",
    "policy_map_table",
    "to_markdown",
    # figures
    "sensitivity_heatmap",
    "layer_latency_bars",
    "pareto_frontier",
    "latency_check",
    "FIGURES",
]
