"""The command line: every command end to end on a tiny experiment, and every bad argument."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from autopolicy import cli
from autopolicy.search import load_run

TINY = textwrap.dedent('''
    """tiny: a 2-layer MLP on random data, for the CLI tests."""
    import jax, jax.numpy as jnp, numpy as np
    from autopolicy import nn
    from autopolicy.experiment import Experiment

    DESCRIPTION = "tiny test experiment"

    def build(cache_dir):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
        model = nn.Sequential([nn.Dense(32, activation="relu"), nn.Dense(4)], name="tiny")
        model = model.build(jax.random.key(0), x)
        reference = model(x)

        def fidelity(m):
            return 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))

        return Experiment(name="tiny", model=model, eval_fn=fidelity, sample_input=x,
                          candidates=("float32", "int8_from_float32"), max_drop=0.05)
''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("exp") / "tiny.py"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    status = cli.main(["tune", str(tiny), "--out", str(out), "--repeats", "3", "--no-progress", "--no-report"])
    assert status == 0
    return out


def test_tune_writes_a_run_directory(run_dir, capsys):
    assert {p.name for p in run_dir.iterdir()} >= {"profile.csv", "frontier.csv", "policy_map.json",
                                                     "summary.json", "cache"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["experiment"]["name"] == "tiny" and summary["layers"] == 2


def test_export_json_and_table_and_show(run_dir, tmp_path, capsys):
    assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "map.json")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'map.json'} and its kernels, {tmp_path / 'map.kernels.json'}"
    exported = json.loads((tmp_path / "map.json").read_text())
    assert exported == json.loads((run_dir / "policy_map.json").read_text())
    assert exported["class_name"] == "DTypePolicyMap"
    # The map's kernel sidecar goes with it: the kernel each chosen layer runs, as the profile says.
    sidecar = json.loads((tmp_path / "map.kernels.json").read_text())
    assert sidecar == json.loads((run_dir / "policy_map.kernels.json").read_text())
    profile = load_run(run_dir)["profile"]
    chosen = profile[profile["chosen"] & profile["kernel"].notna()]
    assert sidecar["format"] == "autopolicy.kernels/1" and sidecar["kernels"] == dict(zip(chosen["layer"], chosen["kernel"]))
    assert sidecar["device"] == json.loads((run_dir / "summary.json").read_text())["device"]
    assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "map.txt"), "--format", "table"]) == 0
    lines = (tmp_path / "map.txt").read_text().splitlines()
    assert lines[-1].split() == ["<default>", "float32"]
    capsys.readouterr()
    assert cli.main(["show", str(tmp_path / "map.json")]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_profile_prints_ratios(tiny, tmp_path, capsys):
    assert cli.main(["profile", str(tiny), "--repeats", "3", "--no-progress", "--out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert "tiny/dense" in out and "int8_from_float32" in out
    assert (tmp_path / "p.csv").read_text().startswith("layer,class,input_shape,policy")


#: The tuning tasks in experiments/, and nothing else there (benchmarks live in benchmarks/).
TASKS = ("bert_base", "decoder_1b", "digits_cnn", "digits_cnn_nnx", "digits_mlp", "encoder_latency", "keras_text",
         "minilm", "minilm_nnx", "smollm2", "text_transformer", "wide_mlp")


def test_list_names_exactly_the_tuning_tasks_each_with_its_description(capsys):
    assert cli.main(["list"]) == 0
    # An indented line under a task lists its options (tests/test_gpu_experiments.py).
    rows = [line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line[:1].strip()]
    assert tuple(name for name, _ in rows) == TASKS
    # Tasks of an extra that is not installed cannot be imported to read their description.
    needs = {"keras_text": "keras", "digits_cnn_nnx": "flax", "minilm_nnx": "flax"}
    for name, description in rows:  # a module without DESCRIPTION would be listed by its path
        if name in needs and importlib.util.find_spec(needs[name]) is None:
            assert needs[name] in description.lower(), (name, description)  # names what it needs
            continue
        assert ".py" not in description and not description.startswith(("/", "(cannot")), (name, description)


BAD = [
    (["tune", "no_such_experiment"], "no_such_experiment"),
    (["tune", "--max-drop", "banana"], "banana"),
    (["tune", "--max-drop=-1%"], "-1%"),
    (["tune", "--candidates", "float32,int7_from_float32"], "int7_from_float32"),
    (["tune", "--memory-budget", "lots"], "lots"),
    (["tune", "--repeats", "1"], "'1'"),
    (["report", "/no/such/run"], "/no/such/run"),
    (["export", "/no/such/run", "--out", "x.json"], "/no/such/run"),
    (["export", "."], "--out"),
    (["show", "/no/such/map.json"], "/no/such/map.json"),
    (["frobnicate"], "frobnicate"),
    ([], "COMMAND"),
]


def run(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse exits for usage errors and --help
        return e.code


@pytest.mark.parametrize("argv,text", BAD, ids=[" ".join(a) or "nothing" for a, _ in BAD])
def test_bad_arguments_give_one_line_and_status_2(argv, text, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert text in lines[0]


@pytest.mark.slow
def test_no_traceback_from_the_installed_command():
    proc = subprocess.run([sys.executable, "-m", "autopolicy", "tune", "--max-drop", "banana"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "autopolicy tune: error: argument --max-drop: 'banana' is not a fraction (like 0.01) or a "
        "percentage (like 1%)")


def test_show_rejects_a_file_that_is_not_a_map(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert cli.main(["show", str(bad)]) == 2
    assert "not a JSON policy map" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["tune", "report", "export", "show", "profile", "list", "apply"])
def test_every_command_has_help(command, capsys):
    assert run([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: autopolicy " + command)


@pytest.mark.parametrize("text,value", [("1%", 0.01), ("0.5", 0.5), ("2.5%", 0.025), ("1e-3", 0.001)])
def test_max_drop_parsing(text, value):
    assert cli._fraction(text) == pytest.approx(value)
