"""How one table cell reads in a report: the formatting Markdown and HTML tables share."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["format_cell", "is_numeric_column", "MISSING"]

MISSING = "—"  # what an absent value (None, NaN) reads as


def format_cell(value: Any) -> str:
    """Formats one value: 4 significant digits, integers with separators, yes/no, a dash for NaN.

    >>> [format_cell(v) for v in (0.000123456, 1050624, 2.0, True, None, float("nan"), "int8")]
    ['0.0001235', '1,050,624', '2', 'yes', '—', '—', 'int8']
    """
    if value is None or value is pd.NA:
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return MISSING
        if math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:.4g}"
    return str(value)


def is_numeric_column(column: pd.Series) -> bool:
    """True for number columns (right-aligned); booleans are not numbers here."""
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)
