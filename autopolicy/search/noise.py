"""Is the machine quiet enough to trust the timings? What a run saw, said in its summary.

Three signals: the load average beyond this process (other work competing for the cores), this
process's CPU time per wall second while timing (well below what it uses on an idle machine
means it waited for the cores), and the spread of the timings themselves.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = ["NOISY_CV", "assess", "machine_load"]

#: A layer timing whose robust coefficient of variation exceeds this is re-measured when a
#: later run finds it in the cache, and counts as noisy.
NOISY_CV = 0.10


def machine_load() -> dict[str, float]:
    """The 1-minute load average and the number of cores (nan where the OS does not say)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = math.nan
    return {"load_1m": float(load), "cores": float(os.cpu_count() or 1)}


def assess(latency: Any, e2e: Any) -> dict[str, Any]:
    """The noise a run saw: load, CPU share, spreads, and a verdict with the reason."""
    load = machine_load()
    cvs = [t.latency_cv for table in latency.timings.values() for t in table.values() if t.latency_cv == t.latency_cv]
    layer_cv = float(np.median(cvs)) if cvs else math.nan
    noisy_layers = sum(cv > NOISY_CV for cv in cvs)
    cpu = e2e.cpu_per_wall
    # Our own timing threads account for about one runnable task; the rest is someone else's.
    others = load["load_1m"] - (cpu if cpu == cpu else 1.0)
    reasons = []
    if others > 0.5 * load["cores"]:
        reasons.append(f"load average {load['load_1m']:.1f} on {int(load['cores'])} cores beyond this run's own")
    if layer_cv > NOISY_CV:
        reasons.append(f"median layer timing CV {layer_cv:.2f} > {NOISY_CV}")
    return {
        **load,
        "cpu_per_wall": cpu,
        "median_layer_cv": layer_cv,
        "noisy_layer_timings": int(noisy_layers),
        "layer_timings": len(cvs),
        "extra_rounds_seconds": e2e.extra_seconds,
        "busy": bool(reasons),
        "note": ("the machine was busy: " + "; ".join(reasons) + ". Decisions used paired rounds and confidence "
                 "intervals; rerun on a quiet machine for tighter figures.") if reasons else "quiet",
    }
