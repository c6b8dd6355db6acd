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


def _profile(chosen: dict) -> pd.DataFrame:
    index = {name: i for i, name in enumerate(dict.fromkeys(row[0] for row in LAYERS))}
    rows = [{"index": index[layer], "layer": layer, "class": cls, "input_shape": "8x4",
             "chained": index[layer] > 0, "policy": policy, "compute_dtype": policies.get(policy).compute_dtype,
             "latency_s": ms / 1e3,
             "latency_p25_s": 0.9 * ms / 1e3, "latency_p75_s": 1.1 * ms / 1e3, "latency_cv": 0.05, "repeats": 5,
             "inner": 2, "nbytes": nbytes, "finite_output": not status.startswith("disqualified"),
             "metric": 0.9 - cost, "accuracy_cost": cost, "sqnr_db": 40.0, "kl": 1e-5, "status": status,
             "chosen": chosen.get(layer, "float32") == policy}
            for layer, cls, policy, ms, cost, status, nbytes in LAYERS]
    return pd.DataFrame(rows)


def _entry(predicted_ms, measured_ms, metric):
    return {"predicted_latency_s": predicted_ms / 1e3, "measured_latency_s": measured_ms / 1e3,
            "measured_latency_cv": 0.05, "metric": metric, "drop": None if metric is None else 0.9 - metric,
            "meets_budget": None if metric is None else 0.9 - metric <= 0.009 + 1e-12}


def _summary(all_float32: bool) -> dict:
    float32 = _entry(3.2, 4.0, 0.9)
    if all_float32:
        uniform = {"float32": float32, "mixed_bfloat16": _entry(1.8, 4.4, None),
                   "int8_from_float32": _entry(3.45, 5.0, None)}
        chosen = {"name": "uniform float32", "policies": {}, "predicted_accuracy_cost": None, "nbytes": 12512,
                  **float32}
        maps, best, speedups = [], "float32", (1.0, 1.0)
    else:
        uniform = {"float32": float32, "mixed_bfloat16": _entry(1.8, 2.5, 0.895),
                   "int8_from_float32": _entry(3.45, 3.0, None)}
        chosen = {"name": "map (round 1)", "policies": dict(MIXED), "predicted_accuracy_cost": 0.006,
                  "nbytes": 9612, **_entry(1.45, 2.0, 0.894)}
        maps = [{"round": 1, "predicted_accuracy_cost": 0.006, "exact": True, **_entry(1.45, 2.0, 0.894)}]
        best, speedups = "mixed_bfloat16", (2.0, 1.25)
    return {
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


def _frontier() -> pd.DataFrame:
    return pd.DataFrame([
        {"predicted_accuracy_cost": c, "predicted_metric": 0.9 - c, "predicted_latency_s": ms / 1e3,
         "nbytes": 9612.0, "changed_layers": n, "within_budget": c <= 0.009, "exact": True,
         "policies": json.dumps(p)}
        for c, ms, n, p in [(0.0, 3.2, 0, {}), (0.002, 2.2, 1, {"net/dense_1": "mixed_bfloat16"}),
                            (0.006, 1.45, 2, MIXED)]])


def write_run(run_dir, all_float32=False) -> str:
    """A small run directory, written by the real ``TuneResult.save`` writer."""
    chosen = {} if all_float32 else MIXED
    entries = {**chosen, "net/act": "mixed_bfloat16"} if chosen else {}  # a follower of net/dense_1
    policy_map = policies.DTypePolicyMap("float32", entries)
    search.result.write_run(run_dir, policy_map, _profile(chosen), _frontier(), _summary(all_float32))
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
    _, paths = written
    md = _read(paths["markdown"])
    assert DEVICE in md
    assert "**Speedup vs float32:** 2.00×" in md
    assert "**Speedup vs best uniform (mixed_bfloat16):** 1.25×" in md
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
    assert table.loc["map (round 1)", "measured (ms)"] == pytest.approx(2.0)
    assert table.loc["map (round 1)", "latency / float32"] == pytest.approx(0.5)
    assert table.loc["uniform mixed_bfloat16", "drop"] == pytest.approx(0.005)
    assert table.loc["uniform mixed_bfloat16", "meets budget"] == "yes"
    assert table.loc["uniform int8_from_float32", "meets budget"] == "not evaluated"
    assert pd.isna(table.loc["uniform int8_from_float32", "metric"])


def test_to_markdown_aligns_numbers_escapes_pipes_and_dashes_missing_values():
    frame = pd.DataFrame({"name": ["a|b", "c"], "ms": [1.23456, float("nan")], "ok": [True, False],
                          "bytes": [1050624, 3]})
    assert report.to_markdown(frame) == (
        "| name | ms | ok | bytes |\n"
        "| --- | ---: | --- | ---: |\n"
        "| a\\|b | 1.235 | yes | 1,050,624 |\n"
        "| c | — | no | 3 |\n"
    )


def test_all_float32_run_with_unevaluated_uniforms_reports_into_the_run_directory(tmp_path):
    run_dir = write_run(tmp_path / "run", all_float32=True)
    paths = report.write_report(run_dir)  # out_dir defaults to run_dir
    assert paths["markdown"] == os.path.join(run_dir, "report.md")
    assert paths["sensitivity"] == os.path.join(run_dir, "figures", "sensitivity.png")
    md = _read(paths["markdown"])
    assert "uniform float32 (every layer stays float32)" in md
    assert "**Speedup vs float32:** 1.00×" in md
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


def test_the_report_is_not_imported_by_autopolicy_and_never_imports_pyplot():
    code = ("import sys, autopolicy; core = 'autopolicy.report' in sys.modules; import autopolicy.report; "
            "print(core, 'matplotlib.pyplot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
