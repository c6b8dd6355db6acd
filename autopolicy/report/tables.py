"""The tables of a report, as pandas DataFrames, and a small Markdown renderer for them.

Every function takes a loaded run: the dict :func:`autopolicy.report.read_run` (or
:func:`autopolicy.search.load_run`) returns.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from autopolicy.report._cells import MISSING, format_cell, is_numeric_column
from autopolicy.search._defaults import REFERENCE as FLOAT32

__all__ = ["policy_order", "layer_order", "pivot", "layer_table", "entries", "speedup_text", "overview_table",
           "latency_model_table", "latency_scales_table", "policy_map_table", "to_markdown", "FLOAT32", "workload_table",
           "OVERVIEW_COLUMNS", "LATENCY_MODEL_COLUMNS"]

_PROFILED = ("measured", "reference")  # statuses whose accuracy cost was measured
OVERVIEW_COLUMNS = ["configuration", "chosen", "predicted (ms)", "calibrated (ms)", "measured (ms)",
                    "speedup vs float32", "metric", "drop", "meets budget"]
LATENCY_MODEL_COLUMNS = ["configuration", "predicted (ms)", "calibrated (ms)", "measured (ms)", "measured CV",
                         "predicted error (%)", "calibrated error (%)"]


def policy_order(run: dict[str, Any]) -> list[str]:
    """The policies of the profile, in the run's candidate order (then order of appearance)."""
    seen = list(dict.fromkeys(run["profile"]["policy"]))
    candidates = [p for p in run["summary"].get("candidates") or [] if p in seen]
    return candidates + [p for p in seen if p not in candidates]


def layer_order(run: dict[str, Any]) -> list[str]:
    """The profiled layers in model order (by ``index`` when the profile has it)."""
    profile = run["profile"]
    if "index" in profile.columns:
        profile = profile.sort_values("index", kind="stable")
    return list(dict.fromkeys(profile["layer"]))


def pivot(run: dict[str, Any], column: str) -> pd.DataFrame:
    """One profile column as a layers x policies frame (NaN where a layer lacks the policy)."""
    table = run["profile"].pivot(index="layer", columns="policy", values=column)
    return table.reindex(index=layer_order(run), columns=policy_order(run))


def _chosen(run: dict[str, Any]) -> pd.Series:
    """The chosen policy of each layer (float32 where no row is marked chosen)."""
    marked = run["profile"][run["profile"]["chosen"]].drop_duplicates("layer")
    chosen = marked.set_index("layer")["policy"].reindex(layer_order(run))
    return chosen.fillna(FLOAT32).astype(object)


def _notes(statuses: pd.Series, chosen: str) -> str:
    """Groups the non-measured statuses of one layer: 'skipped (slower than float32): a, b'."""
    groups: dict[str, list[str]] = {}
    for policy, status in statuses.dropna().items():
        if status not in _PROFILED:
            groups.setdefault(str(status), []).append(str(policy))
    notes = []
    for status, names in groups.items():
        kind, _, reason = status.partition(": ")
        notes.append(f"{kind} ({reason}): {', '.join(names)}" if reason else f"{status}: {', '.join(names)}")
    if statuses.get(chosen) not in _PROFILED and chosen in statuses.index:
        notes.append(f"{chosen} chosen as part of a uniform policy, not from its layer profile")
    return "; ".join(notes)


def _chosen_kernels(run: dict[str, Any], chosen: pd.Series) -> list[str] | None:
    """The kernel each layer's chosen policy runs ("" where none is named), or None when the
    profile names no kernel at all (older runs have no such column)."""
    if "kernel" not in run["profile"].columns:
        return None
    kernel = pivot(run, "kernel")
    names = [kernel.at[layer, policy] if policy in kernel.columns else None for layer, policy in chosen.items()]
    names = [n if isinstance(n, str) else "" for n in names]
    return names if any(names) else None


def layer_table(run: dict[str, Any]) -> pd.DataFrame:
    """One row per profiled layer: its class, chosen policy, latency (ms) and accuracy cost under
    each policy, weight bytes in float32 and as chosen, and notes on skipped policies.

    Args:
      run: A loaded run.

    Returns:
      Columns ``layer, class, chosen, [kernel,] "<policy> (ms)"..., "<policy> (cost)"..., float32
      bytes, chosen bytes, notes``; NaN where a layer has no such policy or its cost was not
      measured. ``kernel`` (the kernel the chosen policy runs) appears when the profile names one.
    """
    layers, policies, chosen = layer_order(run), policy_order(run), _chosen(run)
    latency, cost, nbytes = pivot(run, "latency_s") * 1e3, pivot(run, "accuracy_cost"), pivot(run, "nbytes")
    statuses = pivot(run, "status")
    classes = run["profile"].drop_duplicates("layer").set_index("layer").reindex(layers)
    table = pd.DataFrame({"layer": layers})
    table["class"] = classes["class"].to_numpy() if "class" in classes.columns else ""
    table["chosen"] = chosen.to_numpy()
    kernels = _chosen_kernels(run, chosen)
    if kernels is not None:
        table["kernel"] = kernels
    for policy in policies:
        table[f"{policy} (ms)"] = latency[policy].to_numpy()
    for policy in policies:
        table[f"{policy} (cost)"] = cost[policy].to_numpy()
    float32_bytes = nbytes[FLOAT32] if FLOAT32 in nbytes.columns else pd.Series(float("nan"), layers)
    table["float32 bytes"] = float32_bytes.to_numpy()
    table["chosen bytes"] = [nbytes.at[layer, policy] for layer, policy in chosen.items()]
    table["notes"] = [_notes(statuses.loc[layer], chosen[layer]) for layer in layers]
    return table


def _meets(value: Any) -> str:
    return "not evaluated" if value is None else ("yes" if value else "no")


def _finite(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing, not a number or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _ms(seconds: Any) -> float | None:
    value = _finite(seconds)
    return None if value is None else value * 1e3


def entries(run: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The configurations timed end to end, as ``(name, summary entry)``: each uniform policy
    ("uniform <policy>"), then each verified map ("map (round <n>)")."""
    summary = run["summary"]
    out = [(f"uniform {name}", entry) for name, entry in summary["uniform"].items()]
    return out + [(f"map (round {entry.get('round')})", entry) for entry in summary.get("maps") or []]


def speedup_text(entry: dict[str, Any], float32_s: Any = None, reference: bool = False) -> str:
    """A configuration's speed-up over float32 with its 95% interval and rounds.

    The median of the per-round ratios of paired end-to-end rounds, when the run recorded it;
    for an older run, the ratio of the median latencies (``float32_s`` over the entry's), with
    a dash for the interval it never measured.

    >>> speedup_text({"speedup_vs_float32": 1.834, "speedup_interval": [1.79, 1.88], "rounds": 40})
    '1.83× [1.79, 1.88] (40 rounds)'
    >>> speedup_text({"measured_latency_s": 0.002}, float32_s=0.004)
    '2.00× [—]'
    """
    rounds = entry.get("rounds")
    rounds = rounds if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds > 0 else None
    count = f" ({rounds} rounds)" if rounds else ""
    if reference:
        return f"1.00× (reference; {rounds} rounds)" if rounds else "1.00× (reference)"
    median, interval = _finite(entry.get("speedup_vs_float32")), entry.get("speedup_interval")
    if median is not None:
        bounds = [_finite(v) for v in interval] if isinstance(interval, list) and len(interval) == 2 else []
        if len(bounds) == 2 and None not in bounds:
            return f"{median:.2f}× [{bounds[0]:.2f}, {bounds[1]:.2f}]{count}"
        return f"{median:.2f}× [{MISSING}]{count}"
    measured, float32 = _finite(entry.get("measured_latency_s")), _finite(float32_s)
    if measured and float32:
        return f"{float32 / measured:.2f}× [{MISSING}]"
    return MISSING


def _overview_row(label: str, entry: dict[str, Any], float32_s: float | None, chosen: str) -> dict:
    return {
        "configuration": label,
        "chosen": "✓" if label == chosen else "",
        "predicted (ms)": _ms(entry.get("predicted_latency_s")),
        "calibrated (ms)": _ms(entry.get("calibrated_latency_s")),
        "measured (ms)": _ms(entry.get("measured_latency_s")),
        "speedup vs float32": speedup_text(entry, float32_s, reference=label == f"uniform {FLOAT32}"),
        "metric": entry.get("metric"),
        "drop": entry.get("drop"),
        "meets budget": f"excluded: {entry['excluded']}" if entry.get("excluded") else _meets(entry.get("meets_budget")),
    }


def overview_table(run: dict[str, Any]) -> pd.DataFrame:
    """Each uniform policy and each verified map (round) end to end, against float32.

    Args:
      run: A loaded run.

    Returns:
      Columns :data:`OVERVIEW_COLUMNS`: latencies in ms (predicted: the sum of isolated layer
      latencies and casts; calibrated: the latency model fitted end to end; measured: the
      median of paired rounds), the speed-up over float32 as :func:`speedup_text` writes it,
      metric and drop (named "rise" for a lower-is-better metric; None where the run never
      evaluated that configuration; its ``meets
      budget`` reads "not evaluated"). Figures an older run did not record are None.
    """
    summary = run["summary"]
    float32_s = summary["float32"].get("measured_latency_s")
    chosen = summary["chosen"].get("name", "")
    rows = [_overview_row(label, entry, float32_s, chosen) for label, entry in entries(run)]
    frame = pd.DataFrame(rows, columns=OVERVIEW_COLUMNS)
    if summary.get("budget", {}).get("higher_is_better", True) is False:
        frame = frame.rename(columns={"drop": "rise"})  # the worsening of a lower-is-better metric
    return frame


def workload_table(run: dict[str, Any]) -> pd.DataFrame | None:
    """A workload's phases for every configuration timed end to end: each phase's median ms per
    call, the weighted total per unit of work (the measured latency the decisions used), and each
    phase's speed-up over float32's (ratio of medians). None for a run timed on one call.

    The columns: ``configuration``, ``chosen``, ``<phase> (ms)`` for each phase, ``<phase> vs
    float32`` for each phase, ``total (ms)``.
    """
    summary = run["summary"]
    workload = summary.get("workload")
    if not isinstance(workload, list) or not workload:
        return None
    names = [str(w.get("phase")) for w in workload]
    reference = (summary.get("float32") or {}).get("phases") or {}
    chosen = summary["chosen"].get("name", "")
    rows = []
    for label, entry in entries(run):
        own = entry.get("phases") or {}
        row: dict[str, Any] = {"configuration": label, "chosen": "✓" if label == chosen else ""}
        for n in names:
            row[f"{n} (ms)"] = _ms(own.get(n))
        for n in names:
            row[f"{n} vs float32"] = (None if not own.get(n) or not reference.get(n)
                                      else round(reference[n] / own[n], 2))
        row["total (ms)"] = _ms(entry.get("measured_latency_s"))
        rows.append(row)
    return pd.DataFrame(rows)


def _error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 1)  # a tenth of a percent: far below the noise


def latency_model_table(run: dict[str, Any]) -> pd.DataFrame:
    """Predicted, calibrated and measured end-to-end latency of each configuration, with the
    relative error of each prediction.

    Args:
      run: A loaded run.

    Returns:
      Columns :data:`LATENCY_MODEL_COLUMNS`; an error is ``100 * (prediction - measured) /
      measured`` (positive: the prediction is too slow), None where a figure is missing.
    """
    rows = []
    for label, entry in entries(run):
        predicted, calibrated = _ms(entry.get("predicted_latency_s")), _ms(entry.get("calibrated_latency_s"))
        measured = _ms(entry.get("measured_latency_s"))
        rows.append({"configuration": label, "predicted (ms)": predicted, "calibrated (ms)": calibrated,
                     "measured (ms)": measured, "measured CV": _finite(entry.get("measured_latency_cv")),
                     "predicted error (%)": _error_pct(predicted, measured),
                     "calibrated error (%)": _error_pct(calibrated, measured)})
    return pd.DataFrame(rows, columns=LATENCY_MODEL_COLUMNS)


def latency_scales_table(run: dict[str, Any]) -> pd.DataFrame:
    """The latency model's fitted scale of each policy (calibrated = scale x isolated latency),
    in candidate order; empty when the run recorded no latency model.

    Args:
      run: A loaded run.

    Returns:
      Columns ``policy, scale``.
    """
    model = run["summary"].get("latency_model")
    scale = model.get("scale") if isinstance(model, dict) else None
    if not isinstance(scale, dict):
        scale = {}
    order = [p for p in run["summary"].get("candidates") or [] if p in scale]
    order += [p for p in scale if p not in order]
    return pd.DataFrame({"policy": order, "scale": [_finite(scale[p]) for p in order]}, columns=["policy", "scale"])


def policy_map_table(run: dict[str, Any]) -> pd.DataFrame:
    """The chosen map as ``path -> policy`` rows, then the default for every other layer.

    Args:
      run: A loaded run.

    Returns:
      Columns ``path, policy, role``: "tuned" for a profiled layer, "follows its input" for a
      parameter-free layer that takes its producer's compute dtype, and "default".
    """
    policy_map, tuned = run["policy_map"], set(run["profile"]["layer"])
    rows = [{"path": path, "policy": policy.name,
             "role": "tuned" if path in tuned else "follows its input"}
            for path, policy in policy_map.items()]
    rows.append({"path": "(every other layer)", "policy": policy_map.default_policy.name, "role": "default"})
    return pd.DataFrame(rows, columns=["path", "policy", "role"])


def _markdown_cell(value: Any) -> str:
    return format_cell(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(frame: pd.DataFrame) -> str:
    """Renders a DataFrame as a GitHub Markdown table (no index; numbers right-aligned).

    Args:
      frame: Any DataFrame; cells are formatted by ``format_cell`` (4 significant digits, a
        dash for NaN/None, yes/no for booleans) and ``|`` is escaped.

    Returns:
      The table, one line per row, ending with a newline.

    >>> print(to_markdown(pd.DataFrame({"layer": ["a|b"], "ms": [1.23456]})), end="")
    | layer | ms |
    | --- | ---: |
    | a\\|b | 1.235 |
    """
    header = "| " + " | ".join(_markdown_cell(c) for c in frame.columns) + " |"
    rule = "| " + " | ".join("---:" if is_numeric_column(frame.iloc[:, i]) else "---"
                             for i in range(frame.shape[1])) + " |"
    rows = ["| " + " | ".join(_markdown_cell(v) for v in row) + " |"
            for row in frame.itertuples(index=False, name=None)]
    return "\n".join([header, rule, *rows]) + "\n"
