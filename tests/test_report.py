"""The report of a run directory: files, contents, tables, figures, and errors, on small
synthetic runs written by ``TuneResult.save``'s writer (no tuning here)."""

import json
import math
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

from autopolicy import policies, report, search
from autopolicy.report import tables
from autopolicy.report.render import markdown as report_markdown

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DEVICE = "cpu: Test CPU @ 3.00GHz (4 cores; avx2, fma); jax 0.0.test"
CANDIDATES = ["float32", "mixed_bfloat16", "int8_from_float32"]
FIGURE_NAMES = ["sensitivity", "layer_latency", "pareto_frontier", "latency_check"]

# layer, class, policy, latency (ms), accuracy cost, status, nbytes
LAYERS = [
    ("net/dense", "Dense", "float32", 1.0, 0.0, "reference", 4000),
    ("net/dense", "Dense", "mixed_bfloat16", 0.5, 0.001, "measured", 4000),
    ("net/dense", "Dense", "int8_from_float32", 0.25, 0.004, "measured", 1100),
    ("net/norm", "LayerNormalization", "float32", 0.2, 0.0, "reference", 512),
    ("net/norm", "LayerNormalization", "mixed_bfloat16", 0.3, math.nan, "skipped: slower than float32", 512),
    ("net/dense_1", "Dense", "float32", 2.0, 0.0, "reference", 8000),
    ("net/dense_1", "Dense", "mixed_bfloat16", 1.0, 0.002, "measured", 8000),
    ("net/dense_1", "Dense", "int8_from_float32", 3.0, math.nan, "disqualified: non-finite layer output", 2200),
]
MIXED = {"net/dense": "int8_from_float32", "net/dense_1": "mixed_bfloat16"}


def _profile(chosen: dict, old: bool = False) -> pd.DataFrame:
    index = {name: i for i, name in enumerate(dict.fromkeys(row[0] for row in LAYERS))}
    rows = [{"index": index[layer], "layer": layer, "class": cls, "input_shape": "8x4",
             "chained": index[layer] > 0, "policy": policy, "compute_dtype": policies.get(policy).compute_dtype,
             **({} if old else {"kernel": "s8s8" if policy.startswith("int8") else ""}),
             "latency_s": ms / 1e3,
             "latency_p25_s": 0.9 * ms / 1e3, "latency_p75_s": 1.1 * ms / 1e3, "latency_cv": 0.05, "repeats": 5,
             "inner": 2, "nbytes": nbytes, "finite_output": not status.startswith("disqualified"),
             "metric": 0.9 - cost, "accuracy_cost": cost, "sqnr_db": 40.0, "kl": 1e-5, "status": status,
             "chosen": chosen.get(layer, "float32") == policy}
            for layer, cls, policy, ms, cost, status, nbytes in LAYERS]
    return pd.DataFrame(rows)


def _entry(predicted_ms, measured_ms, metric, calibrated_ms=None, speedup=None, rounds=24):
    """A configuration's summary entry; ``speedup`` is ``(median, low, high)`` of paired rounds
    (None: an older run, without calibration or paired rounds)."""
    entry = {"predicted_latency_s": predicted_ms / 1e3, "measured_latency_s": measured_ms / 1e3,
             "measured_latency_cv": 0.05, "metric": metric, "drop": None if metric is None else 0.9 - metric,
             "meets_budget": None if metric is None else 0.9 - metric <= 0.009 + 1e-12}
    if speedup is not None:
        entry.update({"calibrated_latency_s": calibrated_ms / 1e3, "speedup_vs_float32": speedup[0],
                      "speedup_interval": list(speedup[1:]), "rounds": rounds})
    return entry


DECISIONS = [
    "uniform mixed_bfloat16 replaces uniform float32: 1.620x [1.550, 1.700] over 24 rounds (margin 1.02)",
    "map (round 1) replaces uniform mixed_bfloat16: 1.250x [1.180, 1.310] over 40 rounds (margin 1.02)",
]
BUSY_NOTE = ("the machine was busy: load average 3.1 on 4 cores beyond this run's own. Decisions used paired "
             "rounds and confidence intervals; rerun on a quiet machine for tighter figures.")


def _noise(busy: bool) -> dict:
    return {"load_1m": 3.1 if busy else 0.4, "cores": 4.0, "cpu_per_wall": 0.62 if busy else 1.0,
            "median_layer_cv": 0.14 if busy else 0.03, "noisy_layer_timings": 5 if busy else 0, "layer_timings": 8,
            "extra_rounds_seconds": 2.5 if busy else 0.0, "busy": busy, "note": BUSY_NOTE if busy else "quiet"}


def _summary(all_float32: bool, old: bool = False) -> dict:
    paired = (lambda *s: None) if old else (lambda *s: s)  # an older run has no paired rounds
    float32 = _entry(3.2, 4.0, 0.9, 3.8, paired(1.0, 1.0, 1.0))
    if all_float32:
        uniform = {"float32": float32, "mixed_bfloat16": _entry(1.8, 4.4, None, 4.4, paired(0.91, 0.88, 0.95)),
                   "int8_from_float32": _entry(3.45, 5.0, None, 5.0, paired(0.8, 0.78, 0.83))}
        chosen = {"name": "uniform float32", "policies": {}, "predicted_accuracy_cost": None, "nbytes": 12512,
                  **float32}
        maps, best, speedups, decisions = [], "float32", (1.0, 1.0), []
    else:
        uniform = {"float32": float32, "mixed_bfloat16": _entry(1.8, 2.5, 0.895, 2.6, paired(1.62, 1.55, 1.70)),
                   "int8_from_float32": _entry(3.42, 3.0, None, 3.0, paired(1.34, 1.30, 1.38))}
        map_entry = _entry(1.5, 2.0, 0.894, 2.1, paired(2.01, 1.93, 2.09), rounds=40)
        chosen = {"name": "map (round 1)", "policies": dict(MIXED), "predicted_accuracy_cost": 0.006,
                  "nbytes": 9612, **map_entry}
        maps = [{"round": 1, "predicted_accuracy_cost": 0.006, "exact": True, **map_entry}]
        best, speedups, decisions = "mixed_bfloat16", (2.0, 1.25), list(DECISIONS)
    summary = {
        "device": DEVICE,
        "hardware": {"platform": "cpu", "device_kind": "cpu", "device_count": 1,
                     "cpu": {"model": "Test CPU @ 3.00GHz", "features": ["avx2", "fma"], "cores": 4},
                     "jax": "0.0.test", "jaxlib": "0.0.test", "python": "3.11.0", "autopolicy": "0.1.0",
                     "xla_flags": ""},
        "fingerprint": "0123456789abcdef",
        "budget": {"baseline_metric": 0.9, "allowed_drop": 0.009, "min_metric": 0.891, "memory_budget": None},
        "candidates": CANDIDATES, "layers": 3, "chosen": chosen, "float32": float32, "best_uniform": best,
        "speedup_vs_float32": speedups[0], "speedup_vs_best_uniform": speedups[1],
        "uniform": uniform, "maps": maps,
        "evaluations": {"profile": 4, "verify": 2, "total": 6}, "cache": {"hits": 1, "misses": 20},
        "wall_time_s": 12.5, "test": {"float32": 0.89, "chosen": 0.885},
    }
    if not old:
        summary.update({
            "accuracy_profile": "measured",
            "speedup_vs_float32_interval": list(chosen["speedup_interval"]),
            "decisions": decisions,
            "latency_model": {"scale": {"int8_from_float32": 0.87, "float32": 1.21, "mixed_bfloat16": 1.4},
                              "fitted_on": 3 + len(maps)},
            "noise": _noise(busy=not all_float32),
        })
    return summary


# name, metric, measured latency (ms), calibrated latency (ms): the measured frontier, fastest first
MEASURED_FRONTIER = [("map (round 1)", 0.894, 2.0, 2.1, MIXED), ("uniform mixed_bfloat16", 0.895, 2.5, 2.6,
                     {layer: "mixed_bfloat16" for layer in ("net/dense", "net/dense_1")}),
                     ("uniform float32", 0.9, 4.0, 3.8, {})]
# predicted accuracy cost, predicted latency (ms), changed layers, policies: the solver's frontier
PREDICTED_FRONTIER = [(0.0, 3.2, 0, {}), (0.002, 2.2, 1, {"net/dense_1": "mixed_bfloat16"}), (0.006, 1.45, 2, MIXED)]


def _frontier(all_float32: bool = False, old: bool = False) -> pd.DataFrame:
    predicted = [{"source": "predicted", "name": "", "predicted_accuracy_cost": c, "predicted_metric": 0.9 - c,
                  "predicted_latency_s": ms / 1e3, "metric": math.nan, "measured_latency_s": math.nan,
                  "nbytes": 9612.0, "changed_layers": n, "within_budget": c <= 0.009, "exact": True,
                  "policies": json.dumps(p)} for c, ms, n, p in PREDICTED_FRONTIER]
    if old:  # before the measured frontier: no source, name, metric or measured latency
        return pd.DataFrame(predicted).drop(columns=["source", "name", "metric", "measured_latency_s"])
    measured = [{"source": "measured", "name": name, "predicted_accuracy_cost": math.nan,
                 "predicted_metric": math.nan, "predicted_latency_s": calibrated / 1e3, "metric": metric,
                 "measured_latency_s": ms / 1e3, "nbytes": 9612.0, "changed_layers": len(p),
                 "within_budget": True, "exact": None, "policies": json.dumps(p)}
                for name, metric, ms, calibrated, p in MEASURED_FRONTIER[-1 if all_float32 else 0:]]
    return pd.DataFrame(measured + predicted)


def write_run(run_dir, all_float32=False, old=False) -> str:
    """A small run directory, written by the real ``TuneResult.save`` writer; ``old``: as runs
    wrote it before paired rounds (no intervals, decisions, latency model, noise, measured
    frontier or kernel column)."""
    chosen = {} if all_float32 else MIXED
    entries = {**chosen, "net/act": "mixed_bfloat16"} if chosen else {}  # a follower of net/dense_1
    policy_map = policies.DTypePolicyMap("float32", entries)
    search.result.write_run(run_dir, policy_map, _profile(chosen, old), _frontier(all_float32, old),
                             _summary(all_float32, old))
    return os.fspath(run_dir)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    run_dir = write_run(tmp_path_factory.mktemp("run"))
    out_dir = tmp_path_factory.mktemp("out")
    return run_dir, report.write_report(run_dir, out_dir)


@pytest.fixture
def run(tmp_path):
    return report.read_run(write_run(tmp_path / "run"))


def _read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_every_public_name_exists():
    assert len(set(report.__all__)) == len(report.__all__)
    for name in report.__all__:
        assert getattr(report, name) is not None, name
    assert list(report.FIGURES) == FIGURE_NAMES


def test_write_report_writes_markdown_html_and_valid_pngs(written):
    _, paths = written
    assert set(paths) == {"markdown", "html", *FIGURE_NAMES}
    for name in FIGURE_NAMES:
        assert paths[name].endswith(os.path.join("figures", f"{name}.png"))
        with open(paths[name], "rb") as f:
            data = f.read()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, name


def test_markdown_has_device_headline_map_and_figure_links(written):
    run_dir, paths = written
    md = _read(paths["markdown"])
    assert report_markdown(run_dir) == md  # the Markdown alone, without drawing the figures, is the same
    assert DEVICE in md
    assert ("**Speedup vs float32:** 2.01× [1.93, 2.09] (40 rounds) (median of paired per-round ratios, 95% "
            "interval; measured end to end: 2 ms vs 4 ms)") in md
    assert "**Speedup vs best uniform (mixed_bfloat16):** 1.25× (ratio of median latencies)" in md
    assert "map (round 1) (2 of 3 tuned layers changed)" in md
    assert "| net/dense | int8_from_float32 | tuned |" in md
    assert "| net/dense_1 | mixed_bfloat16 | tuned |" in md
    assert "| net/act | mixed_bfloat16 | follows its input |" in md
    assert "| (every other layer) | float32 | default |" in md
    assert "**Evaluations:** 4 to profile, 2 to verify, 6 in all" in md
    assert "**Measurement cache:** 1 hits, 20 misses" in md
    assert "**Test metric:** 0.885 chosen vs 0.89 float32" in md
    assert "**Wall time:** 12.5 s" in md
    assert "**jaxlib:** 0.0.test" in md
    for name in FIGURE_NAMES:
        assert f"](figures/{name}.png)" in md


def test_html_is_self_contained(written):
    _, paths = written
    page = _read(paths["html"])
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", page)
    assert "<script" not in page and "<link" not in page
    assert page.count('src="data:image/png;base64,') == len(FIGURE_NAMES)
    assert 'src="figures/' not in page
    assert DEVICE in page
    assert "<td>net/dense</td><td>int8_from_float32</td>" in page


def test_layer_table_has_the_expected_values(run):
    table = report.layer_table(run).set_index("layer")
    assert list(table.index) == ["net/dense", "net/norm", "net/dense_1"]
    assert list(table["class"]) == ["Dense", "LayerNormalization", "Dense"]
    assert list(table["chosen"]) == ["int8_from_float32", "float32", "mixed_bfloat16"]
    assert list(table["kernel"]) == ["s8s8", "", ""]  # the kernel of the chosen policy, where named
    dense = table.loc["net/dense"]
    assert dense["float32 (ms)"] == pytest.approx(1.0)
    assert dense["int8_from_float32 (ms)"] == pytest.approx(0.25)
    assert dense["mixed_bfloat16 (cost)"] == pytest.approx(0.001)
    assert dense["int8_from_float32 (cost)"] == pytest.approx(0.004)
    assert (dense["float32 bytes"], dense["chosen bytes"]) == (4000, 1100)
    assert dense["notes"] == ""
    assert math.isnan(table.loc["net/norm", "int8_from_float32 (ms)"])  # not a candidate
    assert math.isnan(table.loc["net/norm", "mixed_bfloat16 (cost)"])
    assert table.loc["net/norm", "notes"] == "skipped (slower than float32): mixed_bfloat16"
    assert table.loc["net/dense_1", "notes"] == "disqualified (non-finite layer output): int8_from_float32"
    assert table.loc["net/dense_1", "chosen bytes"] == 8000


def test_overview_table_compares_uniforms_and_maps_with_float32(run):
    table = report.overview_table(run).set_index("configuration")
    assert list(table.index) == ["uniform float32", "uniform mixed_bfloat16", "uniform int8_from_float32",
                                 "map (round 1)"]
    assert list(table.columns) == tables.OVERVIEW_COLUMNS[1:]
    assert table.loc["map (round 1)", "chosen"] == "✓"
    assert table.loc["uniform float32", "chosen"] == ""
    assert table.loc["map (round 1)", "predicted (ms)"] == pytest.approx(1.5)
    assert table.loc["map (round 1)", "calibrated (ms)"] == pytest.approx(2.1)
    assert table.loc["map (round 1)", "measured (ms)"] == pytest.approx(2.0)
    assert list(table["speedup vs float32"]) == ["1.00× (reference; 24 rounds)", "1.62× [1.55, 1.70] (24 rounds)",
                                                 "1.34× [1.30, 1.38] (24 rounds)", "2.01× [1.93, 2.09] (40 rounds)"]
    assert table.loc["uniform mixed_bfloat16", "drop"] == pytest.approx(0.005)
    assert table.loc["uniform mixed_bfloat16", "meets budget"] == "yes"
    assert table.loc["uniform int8_from_float32", "meets budget"] == "not evaluated"
    assert pd.isna(table.loc["uniform int8_from_float32", "metric"])


def test_speedup_text_states_interval_and_rounds_or_a_dash():
    entry = {"speedup_vs_float32": 1.834, "speedup_interval": [1.79, 1.88], "rounds": 40}
    assert tables.speedup_text(entry) == "1.83× [1.79, 1.88] (40 rounds)"
    assert tables.speedup_text({**entry, "speedup_interval": None}) == "1.83× [—] (40 rounds)"
    assert tables.speedup_text({"measured_latency_s": 0.002}, float32_s=0.005) == "2.50× [—]"
    assert tables.speedup_text({"rounds": 12}, reference=True) == "1.00× (reference; 12 rounds)"
    assert tables.speedup_text({"measured_latency_s": None}, float32_s=0.005) == "—"


def test_latency_model_table_states_each_prediction_and_its_relative_error(run):
    table = report.latency_model_table(run).set_index("configuration")
    assert list(table.columns) == tables.LATENCY_MODEL_COLUMNS[1:]
    assert list(table["predicted error (%)"]) == pytest.approx([-20.0, -28.0, 14.0, -25.0])
    assert list(table["calibrated error (%)"]) == pytest.approx([-5.0, 4.0, 0.0, 5.0])
    assert table.loc["map (round 1)", "calibrated (ms)"] == pytest.approx(2.1)
    assert table.loc["uniform float32", "measured CV"] == pytest.approx(0.05)
    scales = report.latency_scales_table(run)
    assert list(scales["policy"]) == CANDIDATES  # candidate order, not the summary's
    assert list(scales["scale"]) == pytest.approx([1.21, 1.4, 0.87])


def test_markdown_states_method_decisions_latency_model_and_a_busy_machine(written):
    _, paths = written
    md = _read(paths["markdown"])
    sections = re.findall(r"^## (.+)$", md, flags=re.M)
    assert sections[:4] == ["Headline", "Method", "How it was decided", "Measurement noise"]
    assert sections.index("Uniform policies vs the chosen map") + 1 == sections.index("Latency model")
    # The warning comes before the headline, with the run's own note.
    warning = "> **⚠ Warning:** The machine was busy: load average 3.1 on 4 cores beyond this run's own."
    assert md.index(warning) < md.index("## Headline")
    assert "- **Verdict:** busy" in md
    assert "- **Load average (1 min):** 3.10 on 4 cores" in md
    assert "- **CPU time per wall second while timing:** 0.62" in md
    assert "- **Noisy layer timings (CV > 0.1):** 5 of 8" in md
    for line in DECISIONS:
        assert f"- `{line}`" in md
    assert "- **Extra rounds for close calls:** 2.5 s" in md
    assert "- **Winner:** map (round 1)" in md
    assert "- **Median |error|:** predicted 22.5%, calibrated 4.5%" in md
    assert "- **Fitted on:** 4 end-to-end timings" in md
    assert "| map (round 1) | 1.5 | 2.1 | 2 | 0.05 | -25 | 5 |" in md
    assert "| mixed_bfloat16 | 1.4 |" in md
    assert "| map (round 1) | ✓ | 1.5 | 2.1 | 2 | 2.01× [1.93, 2.09] (40 rounds) | 0.894 |" in md
    assert "a seeded 95% percentile bootstrap of that median" in md
    assert "fitted by least squares of relative errors on every end-to-end timing (4 configurations)" in md
    assert "- **Per-layer accuracy cost:** each layer changed alone and the whole model scored (eval_fn)" in md
    assert "predates paired rounds" not in md


def test_html_shows_the_warning_and_the_decision_lines(written):
    _, paths = written
    page = _read(paths["html"])
    assert page.count('<div class="warning" role="alert"><strong>⚠ Warning:</strong> The machine was busy') == 1
    assert f"<li><code>{DECISIONS[1]}</code></li>" in page
    assert "<h2>Latency model</h2>" in page


def test_a_quiet_run_without_decisions_says_float32_stays(tmp_path):
    md = report_markdown(write_run(tmp_path / "run", all_float32=True))
    assert "Warning" not in md
    assert "- **Verdict:** quiet" in md
    assert "No configuration that met the budget challenged float32, so float32 stays." in md


@pytest.mark.slow
def test_an_old_run_directory_without_the_new_keys_still_renders(tmp_path):
    run_dir = write_run(tmp_path / "run", old=True)
    assert "source" not in pd.read_csv(os.path.join(run_dir, "frontier.csv")).columns
    paths = report.write_report(run_dir, tmp_path / "out")
    md = _read(paths["markdown"])
    assert "**Speedup vs float32:** 2.00× [—] (ratio of median latencies; no interval recorded;" in md
    assert "| uniform mixed_bfloat16 |  | 1.8 | — | 2.5 | 1.60× [—] |" in md
    assert "| uniform float32 |  | 3.2 | — | 4 | 1.00× (reference) |" in md
    assert "This run predates paired rounds" in md
    assert md.count("Not recorded by this run (—).") == 2  # decisions and noise
    assert "Fitted scales: — (not recorded by this run)." in md
    assert "- **Median |error|:** predicted 22.5%, calibrated —" in md
    assert "Warning" not in md
    old_run = report.read_run(run_dir)
    assert report.latency_model_table(old_run)["calibrated (ms)"].isna().all()
    assert "kernel" not in report.layer_table(old_run).columns
    for name in FIGURE_NAMES:
        with open(paths[name], "rb") as f:
            assert f.read(8) == PNG_MAGIC, name


def _drawn(monkeypatch, figure, run, tmp_path):
    """The axes a figure function draws (its PNG still written)."""
    from autopolicy.report import _plot  # pylint: disable=import-outside-toplevel

    drawn, save = [], _plot.save_png
    monkeypatch.setattr(_plot, "save_png", lambda fig, path: drawn.append(fig) or save(fig, path))
    figure(run, tmp_path / "figure.png")
    return drawn[0].axes[0]


def _lines(ax, color):
    from matplotlib.colors import to_hex  # pylint: disable=import-outside-toplevel

    return [line for line in ax.get_lines() if color in (to_hex(line.get_color()), to_hex(line.get_markeredgecolor()))]


def test_pareto_figure_steps_through_the_measured_frontier_and_the_predicted_one(run, monkeypatch, tmp_path):
    from autopolicy.report._end_to_end import measured_frontier  # pylint: disable=import-outside-toplevel

    assert [(p["name"], p["measured_ms"], p["metric"]) for p in measured_frontier(run)] == [
        (name, pytest.approx(ms), metric) for name, metric, ms, _, _ in MEASURED_FRONTIER]
    ax = _drawn(monkeypatch, report.pareto_frontier, run, tmp_path)
    step, rings = _lines(ax, "#1b7f3b")  # the measured frontier: a step line, then its rings
    assert list(step.get_xdata()[:3]) == pytest.approx([2.0, 2.5, 4.0])
    assert list(step.get_ydata()[:3]) == pytest.approx([0.894, 0.895, 0.9])
    assert list(rings.get_xdata()) == pytest.approx([2.0, 2.5, 4.0])
    predicted = _lines(ax, "#7f7f7f")[0]  # the solver's frontier: predicted rows only
    assert list(predicted.get_xdata()[:3]) == pytest.approx([1.45, 2.2, 3.2])
    assert predicted.get_linestyle() == "--"
    labels = {t.get_text() for t in ax.texts}
    assert {"map round 1", "mixed_bfloat16", "float32"} <= labels


def test_pareto_figure_of_an_old_run_derives_the_measured_frontier_from_its_summary(tmp_path, monkeypatch):
    from autopolicy.report._end_to_end import measured_frontier  # pylint: disable=import-outside-toplevel

    old = report.read_run(write_run(tmp_path / "run", old=True))
    assert [p["name"] for p in measured_frontier(old)] == [name for name, *_ in MEASURED_FRONTIER]
    ax = _drawn(monkeypatch, report.pareto_frontier, old, tmp_path)
    assert len(_lines(ax, "#7f7f7f")[0].get_xdata()) == len(PREDICTED_FRONTIER) + 1  # held to the right edge


def test_latency_check_shows_predicted_open_and_calibrated_filled_against_measured(run, monkeypatch, tmp_path):
    ax = _drawn(monkeypatch, report.latency_check, run, tmp_path)
    open_markers = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
    points = sorted((line.get_xdata()[0], line.get_ydata()[0]) for line in open_markers)
    assert [v for point in points for v in point] == pytest.approx([1.5, 2.0, 1.8, 2.5, 3.2, 4.0, 3.42, 3.0])
    calibrated = sorted(t.xy for t in ax.texts if t.get_text() in ("float32", "mixed_bfloat16", "map round 1"))
    assert [v for point in calibrated for v in point] == pytest.approx([2.1, 2.0, 2.6, 2.5, 3.8, 4.0])
    note = next(t.get_text() for t in ax.texts if t.get_text().startswith("median |error|"))
    assert note == "median |error| vs measured:\npredicted 22.5%, calibrated 4.5%"


def test_to_markdown_aligns_numbers_escapes_pipes_and_dashes_missing_values():
    frame = pd.DataFrame({"name": ["a|b", "c"], "ms": [1.23456, float("nan")], "ok": [True, False],
                          "bytes": [1050624, 3]})
    assert report.to_markdown(frame) == (
        "| name | ms | ok | bytes |\n"
        "| --- | ---: | --- | ---: |\n"
        "| a\\|b | 1.235 | yes | 1,050,624 |\n"
        "| c | — | no | 3 |\n"
    )


@pytest.mark.slow
def test_all_float32_run_with_unevaluated_uniforms_reports_into_the_run_directory(tmp_path):
    run_dir = write_run(tmp_path / "run", all_float32=True)
    paths = report.write_report(run_dir)  # out_dir defaults to run_dir
    assert paths["markdown"] == os.path.join(run_dir, "report.md")
    assert paths["sensitivity"] == os.path.join(run_dir, "figures", "sensitivity.png")
    md = _read(paths["markdown"])
    assert "uniform float32 (every layer stays float32)" in md
    assert "**Speedup vs float32:** 1.00× (reference; 24 rounds) (float32 is the choice;" in md
    assert "| (every other layer) | float32 | default |" in md
    assert md.count("| not evaluated |") == 2
    run = report.read_run(run_dir)
    assert list(report.layer_table(run)["chosen"]) == ["float32"] * 3
    for name in FIGURE_NAMES:
        with open(paths[name], "rb") as f:
            assert f.read(8) == PNG_MAGIC


def test_a_figure_takes_a_run_loaded_by_search(tmp_path):
    run = search.load_run(write_run(tmp_path / "run"))
    path = report.sensitivity_heatmap(run, tmp_path / "sensitivity.png")
    assert path == os.fspath(tmp_path / "sensitivity.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_missing_run_directory_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        report.write_report(missing)


@pytest.mark.parametrize("name", ["profile.csv", "frontier.csv", "policy_map.json", "summary.json"])
def test_missing_file_is_named(tmp_path, name):
    run_dir = write_run(tmp_path / "run")
    os.remove(os.path.join(run_dir, name))
    with pytest.raises(FileNotFoundError, match=re.escape(name)):
        report.write_report(run_dir)
    assert not os.path.exists(os.path.join(run_dir, "report.md"))


@pytest.mark.parametrize("name, text, message", [
    ("summary.json", "{not json", "summary.json.*not valid JSON"),
    ("summary.json", "[1, 2]", "summary.json.*JSON object"),
    ("summary.json", '{"device": "cpu"}', "summary.json.*lacks the keys"),
    ("policy_map.json", "{not json", "policy_map.json.*not a valid policy map"),
    ("policy_map.json", '{"class_name": "Nope", "config": {}}', "policy_map.json.*not a valid policy map"),
    ("profile.csv", "layer,policy\na,float32\n", "profile.csv.*lacks the columns"),
    ("profile.csv", "", "profile.csv.*empty"),
    ("frontier.csv", "x,y\n1,2\n", "frontier.csv.*lacks the columns"),
])
def test_malformed_file_raises_value_error_naming_it(tmp_path, name, text, message):
    run_dir = write_run(tmp_path / "run")
    with open(os.path.join(run_dir, name), "w", encoding="utf-8") as f:
        f.write(text)
    with pytest.raises(ValueError, match=message):
        report.write_report(run_dir)


def test_profile_with_a_bad_chosen_value_is_refused(tmp_path):
    run_dir = write_run(tmp_path / "run")
    path = os.path.join(run_dir, "profile.csv")
    profile = pd.read_csv(path).astype({"chosen": object})
    profile.loc[0, "chosen"] = "maybe"
    profile.to_csv(path, index=False)
    with pytest.raises(ValueError, match="'chosen' must be True or False. Received: 'maybe'"):
        report.read_run(run_dir)


@pytest.mark.slow
def test_the_report_is_not_imported_by_autopolicy_and_never_imports_pyplot():
    code = ("import sys, autopolicy; core = 'autopolicy.report' in sys.modules; import autopolicy.report; "
            "print(core, 'matplotlib.pyplot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_first_order_run_states_each_candidates_fitted_scale(tmp_path):
    run_dir = write_run(tmp_path / "run", all_float32=False)
    path = os.path.join(run_dir, "summary.json")
    with open(path) as f:
        summary = json.load(f)
    summary.update(accuracy_profile="first_order", accuracy_scales={"int8_from_float32": 0.5644, "mixed_bfloat16": 0.0})
    with open(path, "w") as f:
        json.dump(summary, f)
    md = report_markdown(run_dir)
    assert ("(first-order sensitivity, autopolicy.search.first_order), in the metric's units; then each candidate's "
            "costs scaled so that they add up to its uniform policy's measured change (scales: int8_from_float32 "
            "0.564, mixed_bfloat16 0)") in md
