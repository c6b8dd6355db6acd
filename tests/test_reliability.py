"""Reliability: every malformed input is refused with an error that names it, the command line
never shows a traceback and exits with a documented status, a run directory is locked, and a
killed run resumes without leftovers."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy import _atomic, _rundir, cli, experiment, nn, policies
from autopolicy.nn.serialization import DamagedSaveError
from autopolicy.search import _checks
from autopolicy.search.cache import MeasurementCache
from autopolicy.search.noise import NOISY_CV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)


class Row(NamedTuple):
    id: str
    make: Callable[[Any], Any]  # make(tmp_path) raises
    error: type
    needle: str  # the bad value, as the message must name it


def _file(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


# --- policy names and maps -------------------------------------------------------------------

GOOD_MAP = policies.serialize(policies.DTypePolicyMap("float32", {"m/dense": "mixed_bfloat16"}))


def _map_file(tmp_path, text) -> Any:
    return policies.load_policy_map(_file(tmp_path, "map.json", text))


POLICY_ROWS = [
    Row("name int7", lambda _: policies.get("int7_from_float32"), ValueError, "'int7_from_float32'"),
    Row("name misspelt", lambda _: policies.get("mixed_bfloat"), ValueError, "'mixed_bfloat'"),
    Row("name float33", lambda _: policies.DTypePolicy("float33"), ValueError, "'float33'"),
    Row("name empty", lambda _: policies.DTypePolicy(""), ValueError, "''"),
    Row("identifier list", lambda _: policies.get([]), ValueError, "[]"),
    Row("identifier float", lambda _: policies.get(3.5), ValueError, "3.5"),
    Row("int8 of int8", lambda _: policies.get("int8_from_int8"), ValueError, "'int8'"),
    Row("int8 of float16", lambda _: policies.get("int8_from_float16"), ValueError, "'float16'"),
    Row("amax 10**30", lambda _: policies.QuantizedFloat8DTypePolicy("float8", "float32", 10**30), ValueError,
        str(10**30)),
    Row("amax 0", lambda _: policies.QuantizedFloat8DTypePolicy("float8", "float32", 0), ValueError,
        "amax_history_length=0"),
    Row("unknown class", lambda _: policies.get({"class_name": "Nope", "config": {}}), ValueError, "'Nope'"),
    Row("map bad policy", lambda _: policies.DTypePolicyMap("float32", {"a": "nope"}), ValueError, "'nope'"),
    Row("map int key", lambda _: policies.DTypePolicyMap("float32", {3: "float32"}), ValueError, "key=3"),
    Row("map bad regex", lambda _: policies.DTypePolicyMap("float32", {"dense[": "float32"}), ValueError,
        "'dense['"),
    Row("map bad default", lambda _: policies.DTypePolicyMap("float3", {}), ValueError, "'float3'"),
    Row("map config not a dict", lambda _: policies.deserialize({"class_name": "DTypePolicyMap", "config": 5}),
        ValueError, "config=5"),
    Row("load fd 3", lambda _: policies.load_policy_map(3), TypeError, "path=3"),
    Row("load None", lambda _: policies.load_policy_map(None), TypeError, "path=None"),
    Row("map file missing", lambda t: policies.load_policy_map(str(t / "none.json")), FileNotFoundError,
        "none.json"),
    Row("map file 100000 deep", lambda t: _map_file(t, "[" * 100_000 + "]" * 100_000), ValueError,
        "nests too deeply"),
    Row("map file duplicate key", lambda t: _map_file(t, '{"class_name": "DTypePolicyMap", "class_name": "x"}'),
        ValueError, "duplicate key 'class_name'"),
    Row("map file truncated", lambda t: _map_file(t, json.dumps(GOOD_MAP)[:40]), ValueError, "map.json"),
    Row("map file not UTF-8", lambda t: _map_file(t, b"\xff\xfe{"), ValueError, "map.json"),
    Row("map file empty", lambda t: _map_file(t, ""), ValueError, "map.json"),
    Row("map file a list", lambda t: _map_file(t, "[1, 2]"), ValueError, "[1, 2]"),
    Row("map file unknown class", lambda t: _map_file(t, json.dumps({**GOOD_MAP, "class_name": "Frob"})),
        ValueError, "'Frob'"),
    Row("map file bad policy", lambda t: _map_file(t, json.dumps(GOOD_MAP).replace("mixed_bfloat16", "bf61")),
        ValueError, "'bf61'"),
]


# --- saved models ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    model = nn.Sequential([nn.Dense(4, activation="relu"), nn.Dense(2)], name="m").build(jax.random.key(0), X)
    nn.save(model, directory)
    return directory


def _damaged(weights: Callable[[bytes], bytes] | None = None, manifest: Callable[[dict], Any] | None = None):
    """A row's make(): damages a file of the saved model copied to tmp_path/model, loads it."""

    def make(tmp_path):
        directory = tmp_path / "model"
        if weights is not None:
            raw = (directory / "weights.npz").read_bytes()
            (directory / "weights.npz").write_bytes(weights(raw))
        if manifest is not None:
            loaded = json.loads((directory / "model.json").read_text())
            changed = manifest(loaded)
            (directory / "model.json").write_text(changed if isinstance(changed, str) else json.dumps(loaded))
        return nn.load(directory)

    return make


def _without_weights(tmp_path):
    (tmp_path / "model" / "weights.npz").unlink()
    return nn.load(tmp_path / "model")


def _garble(raw: bytes) -> bytes:
    middle = len(raw) // 2
    return raw[:middle] + b"\xff" * 40 + raw[middle + 40:]


def _object_npz(raw: bytes) -> bytes:
    import io  # pylint: disable=import-outside-toplevel

    names = np.load(io.BytesIO(raw)).files
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.array([object(), object()], dtype=object) for k in names})
    return buffer.getvalue()


def _npy(raw: bytes) -> bytes:
    import io  # pylint: disable=import-outside-toplevel

    buffer = io.BytesIO()
    np.save(buffer, np.ones(3, np.float32))
    return buffer.getvalue()


def _drop(key):
    return lambda m: m.pop(key) and None


def _set(path, value):
    def change(m):
        target = m
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return change


SAVED_ROWS = [
    Row("weights truncated", _damaged(weights=lambda r: r[: len(r) // 2]), DamagedSaveError, "BadZipFile"),
    Row("weights empty", _damaged(weights=lambda r: b""), DamagedSaveError, "weights.npz"),
    Row("weights garbled", _damaged(weights=_garble), DamagedSaveError, "Bad CRC-32"),
    Row("weights object arrays", _damaged(weights=_object_npz), DamagedSaveError, "object array under '.layers"),
    Row("weights a single .npy", _damaged(weights=_npy), DamagedSaveError, "single .npy"),
    Row("model.json truncated", _damaged(manifest=lambda m: json.dumps(m)[:50]), DamagedSaveError, "not JSON"),
    Row("model.json duplicate key", _damaged(manifest=lambda m: json.dumps(m).replace(
        '"dtypes": {', '"dtypes": {".layers[0].kernel": "bfloat16", ')), DamagedSaveError,
        "duplicate key '.layers[0].kernel'"),
    Row("model.json a list", _damaged(manifest=lambda m: "[1, 2]"), ValueError, "not an autopolicy model"),
    Row("model.json no config", _damaged(manifest=_drop("config")), DamagedSaveError, "lacks ['config']"),
    Row("model.json no build_inputs", _damaged(manifest=_drop("build_inputs")), DamagedSaveError,
        "lacks ['build_inputs']"),
    Row("model.json no policy_map", _damaged(manifest=_drop("policy_map")), DamagedSaveError,
        "lacks ['policy_map']"),
    Row("model.json no dtypes", _damaged(manifest=_drop("dtypes")), DamagedSaveError, "lacks ['dtypes']"),
    Row("build shape wrong", _damaged(manifest=_set(["build_inputs", "args", 0, "shape"], [4, 5])),
        DamagedSaveError, "saved float32(3, 4), the model has float32(5, 4)"),
    Row("build shape a string", _damaged(manifest=_set(["build_inputs", "args", 0, "shape"], "abc")),
        DamagedSaveError, "'abc'"),
    Row("config unknown class", _damaged(manifest=_set(["config", "class"], "Frob")), ValueError, "['Frob']"),
    Row("config a number", _damaged(manifest=_set(["config"], 5)), DamagedSaveError, "AttributeError"),
    Row("config bad keyword", _damaged(manifest=_set(["config", "kwargs", "bogus"], 1)), DamagedSaveError,
        "'bogus'"),
    Row("policy map garbled", _damaged(manifest=_set(["policy_map"], {"x": 1})), DamagedSaveError, "['x']"),
    Row("weight dtype garbled", _damaged(manifest=_set(["dtypes", ".layers[0].kernel"], "nonsense")),
        DamagedSaveError, "'nonsense'"),
    Row("weight dtype wrong", _damaged(manifest=_set(["dtypes", ".layers[0].kernel"], "float64")),
        DamagedSaveError, ".layers[0].kernel: saved float64"),
    Row("weights missing", _without_weights, FileNotFoundError, "it has no weights.npz"),
    Row("no saved model", lambda t: nn.load(t / "nothing"), FileNotFoundError, "nothing"),
    Row("directory an int", lambda _: nn.load(3), TypeError, "directory=3"),
]


SAVED_IDS = {row.id for row in SAVED_ROWS}


# --- tune's arguments, experiments, caches, run directories ----------------------------------

def _check(**overrides):
    args = dict(candidates=["float32"], max_drop=0.01, memory_budget=None, repeats=20, max_rounds=3)
    args.update(overrides)
    return lambda _: _checks.check_arguments(**args)


def _experiment(**overrides):
    fields = dict(name="e", model=object(), eval_fn=lambda m: 1.0, sample_input=X)
    fields.update(overrides)
    return lambda _: experiment.Experiment(**fields)


def _cache(content):
    def make(tmp_path):
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "measurements.json").write_bytes(content)
        return MeasurementCache(tmp_path / "cache")

    return make


def _locked_twice(tmp_path):
    with _rundir.RunLock(tmp_path):
        _rundir.RunLock(tmp_path).acquire()


ARGUMENT_ROWS = [
    Row("repeats 1", _check(repeats=1), ValueError, "repeats=1"),
    Row("repeats 10**6", _check(repeats=10**6), ValueError, "repeats=1000000"),
    Row("repeats 3.5", _check(repeats=3.5), ValueError, "repeats=3.5"),
    Row("repeats True", _check(repeats=True), ValueError, "repeats=True"),
    Row("max_rounds 0", _check(max_rounds=0), ValueError, "max_rounds=0"),
    Row("max_rounds 1000", _check(max_rounds=1000), ValueError, "max_rounds=1000"),
    Row("max_drop negative", _check(max_drop=-0.1), ValueError, "max_drop=-0.1"),
    Row("max_drop nan", _check(max_drop=float("nan")), ValueError, "max_drop=nan"),
    Row("max_drop inf", _check(max_drop=float("inf")), ValueError, "max_drop=inf"),
    Row("max_drop a string", _check(max_drop="1%"), ValueError, "max_drop='1%'"),
    Row("memory_budget 0", _check(memory_budget=0), ValueError, "memory_budget=0"),
    Row("memory_budget a string", _check(memory_budget="10MB"), ValueError, "memory_budget='10MB'"),
    Row("candidates a string", _check(candidates="float32"), ValueError, "'float32'"),
    Row("candidates empty", _check(candidates=[]), ValueError, "[]"),
    Row("candidate None", _check(candidates=[None]), ValueError, "None"),
    Row("candidate int7", _check(candidates=["int7_from_float32"]), ValueError, "'int7_from_float32'"),
    Row("relative max_drop 1.5", lambda _: _checks.check_budget(1.5, True), ValueError, "max_drop=1.5 (150%)"),
    Row("relative not a bool", lambda _: _checks.check_budget(0.1, "yes"), TypeError, "relative='yes'"),
    Row("min_speedup inf", lambda _: _checks.check_decision(float("inf"), 30), ValueError, "min_speedup=inf"),
    Row("min_speedup nan", lambda _: _checks.check_decision(float("nan"), 30), ValueError, "min_speedup=nan"),
    Row("min_speedup 0.9", lambda _: _checks.check_decision(0.9, 30), ValueError, "min_speedup=0.9"),
    Row("confirm_seconds inf", lambda _: _checks.check_decision(1.02, float("inf")), ValueError,
        "confirm_seconds=inf"),
    Row("confirm_seconds -1", lambda _: _checks.check_decision(1.02, -1), ValueError, "confirm_seconds=-1"),
    Row("eval_fn returns '0.9'", lambda _: _checks.check_metric("0.9", "the float32 model"), TypeError, "'0.9'"),
    Row("eval_fn returns True", lambda _: _checks.check_metric(True, "the float32 model"), TypeError,
        "True of type bool"),
    Row("eval_fn returns None", lambda _: _checks.check_metric(None, "the float32 model"), TypeError, "None"),
    Row("eval_fn returns complex", lambda _: _checks.check_metric(1 + 2j, "the float32 model"), TypeError,
        "(1+2j)"),
    Row("eval_fn returns a vector", lambda _: _checks.check_metric(jnp.ones(3), "the float32 model"), TypeError,
        "shape (3,)"),
    Row("eval_fn returns nan", lambda _: _checks.check_metric(float("nan"), "the float32 model"), ValueError,
        "nan"),
    Row("sample of strings", lambda _: _checks.check_sample_input(np.array(["a", "b"])), TypeError,
        "dtype <U1 and shape (2,)"),
    Row("sample of objects", lambda _: _checks.check_sample_input((X, np.array([object()]))), TypeError,
        "sample_input[1] holds an array of dtype object"),
    Row("sample a str", lambda _: _checks.check_sample_input("x.npy"), TypeError, "'x.npy'"),
    Row("sample None", lambda _: _checks.check_sample_input(None), ValueError, "None"),
    Row("sample empty", lambda _: _checks.check_sample_input(np.zeros((0, 3), np.float32)), ValueError,
        "shape (0, 3)"),
    Row("int ids into a float8 layer", lambda _: _checks.check_layer_input(
        "m/dense", np.zeros((8, 16), np.int32), "float8_from_float32"), ValueError,
        "dtype int32 and shape (8, 16)"),
    Row("experiment unknown", lambda _: experiment.load("no_such_experiment"), ValueError,
        "'no_such_experiment'"),
    Row("experiment an int", lambda _: experiment.load(3), TypeError, "3"),
    Row("experiment eval_fn None", _experiment(eval_fn=None), TypeError, "eval_fn=None"),
    Row("experiment max_drop -1", _experiment(max_drop=-1), ValueError, "max_drop=-1"),
    Row("experiment candidates a str", _experiment(candidates="float32"), TypeError, "candidates='float32'"),
    Row("experiment relative 1", _experiment(relative=1), TypeError, "relative=1"),
    Row("cache file garbled", _cache(b"{\"a\": [1, 2"), ValueError, "measurements.json"),
    Row("cache file a list", _cache(b"[1, 2]"), ValueError, "JSON list"),
    Row("cache file duplicate key", _cache(b'{"k": 1, "k": 2}'), ValueError, "duplicate key 'k'"),
    Row("cache_dir an int", lambda _: MeasurementCache(3), TypeError, "cache_dir=3"),
    Row("cache_dir a file", lambda t: MeasurementCache(_file(t, "f.txt", "x")), NotADirectoryError,
        "f.txt' is a file, not a directory"),
    Row("run directory locked", _locked_twice, _rundir.RunDirectoryLocked, f"process {os.getpid()}"),
    Row("output file a directory", lambda t: _rundir.check_output_file(t), IsADirectoryError, "is a directory"),
]


ROWS = POLICY_ROWS + SAVED_ROWS + ARGUMENT_ROWS


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_malformed_input_is_refused_naming_it(row, tmp_path, request):
    if row.id in SAVED_IDS:
        shutil.copytree(request.getfixturevalue("saved"), tmp_path / "model")
    with pytest.raises(Exception) as info:
        row.make(tmp_path)
    assert type(info.value) is row.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert row.needle in message, message
    assert "allow_pickle" not in message and "Traceback" not in message


def test_the_table_is_large_enough():
    assert len(ROWS) + len(CLI_ROWS) >= 60
    assert len({r.id for r in ROWS}) == len(ROWS)


# --- the command line ------------------------------------------------------------------------

TINY = textwrap.dedent('''
    """tiny: a 2-layer MLP on random data."""
    import os, pathlib, time
    import jax, jax.numpy as jnp, numpy as np
    from autopolicy import nn
    from autopolicy.experiment import Experiment

    DESCRIPTION = "tiny reliability experiment"
    CALLS = [0]

    def build(cache_dir):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
        model = nn.Sequential([nn.Dense(32, activation="relu"), nn.Dense(4)], name="tiny")
        model = model.build(jax.random.key(0), x)
        reference = model(x)

        def fidelity(m):
            CALLS[0] += 1
            hang = os.environ.get("TINY_HANG_AT_CALL")
            if hang and CALLS[0] == int(hang):  # the moment the test kills the run
                pathlib.Path(os.environ["TINY_MARKER"]).write_text(str(os.getpid()))
                time.sleep(600)
            return RESULT(1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference))))

        return Experiment(name="tiny", model=model, eval_fn=fidelity, sample_input=SAMPLE(x),
                          candidates=("float32", "int8_from_float32"), max_drop=0.05)

    RESULT = float
    SAMPLE = lambda x: x
''')


def _experiment_file(tmp_path, source: str, name: str = "exp.py") -> str:
    return _file(tmp_path, name, textwrap.dedent(source))


def _tune(*extra):
    return lambda tmp_path, source: ["tune", _experiment_file(tmp_path, source), "--out", str(tmp_path / "out"),
                                     "--repeats", "3", "--no-progress", "--no-report", *extra]


def _tune_source(source):
    return lambda tmp_path, _: _tune()(tmp_path, source)


def _show(text):
    return lambda tmp_path, _: ["show", _file(tmp_path, "map.json", text)]


def _tune_out(make_out):
    def argv(tmp_path, _):
        out = make_out(tmp_path)
        return ["tune", _experiment_file(tmp_path, TINY), "--out", out, "--repeats", "3", "--no-progress"]

    return argv


def _run_dir(tmp_path) -> str:
    """A run directory holding just a policy map (all that export reads)."""
    run = tmp_path / "run"
    run.mkdir()
    policies.save_policy_map(policies.DTypePolicyMap("float32", {"m/dense": "mixed_bfloat16"}),
                             str(run / "policy_map.json"))
    return str(run)


class CliRow(NamedTuple):
    id: str
    argv: Callable[[Any, str], list]  # argv(tmp_path, TINY)
    status: int
    needle: str


CLI_ROWS = [
    CliRow("experiment raises on import", _tune_source("raise RuntimeError('no data for exp')"), 2,
           "RuntimeError: no data for exp"),
    CliRow("experiment SyntaxError", _tune_source("def build(cache_dir)\n    return 1\n"), 2,
           "SyntaxError"),
    CliRow("experiment exits on import", _tune_source("import sys\nsys.exit(4)\n"), 2, "SystemExit: 4"),
    CliRow("experiment without build", _tune_source("x = 1\n"), 2, "does not define build"),
    CliRow("build returns None", _tune_source("def build(cache_dir):\n    return None\n"), 2,
           "It returned NoneType"),
    CliRow("build returns a dict", _tune_source("def build(cache_dir):\n    return {'model': 1}\n"), 2,
           "It returned dict"),
    CliRow("build raises", _tune_source("def build(cache_dir):\n    raise KeyError('weights_of_exp')\n"), 2,
           "KeyError: 'weights_of_exp'"),
    CliRow("build interrupted", _tune_source("def build(cache_dir):\n    raise KeyboardInterrupt\n"), 130,
           "interrupted"),
    CliRow("--max-drop 150%", _tune("--max-drop", "150%"), 2, "'150%' is over 100%"),
    CliRow("--max-drop 1.5 relative", _tune("--max-drop", "1.5"), 2, "max_drop=1.5"),
    CliRow("--repeats 20000", _tune("--repeats", "20000"), 2, "'20000'"),
    CliRow("--memory-budget 0", _tune("--memory-budget", "0"), 2, "'0' is not a size > 0"),
    CliRow("eval_fn returns a str", _tune_source(TINY.replace("RESULT = float", "RESULT = str")), 2,
           "It returned '1.0'"),
    CliRow("--out a file", _tune_out(lambda t: _file(t, "out.txt", "x")), 3, "out.txt' is a file"),
    CliRow("--out under a file", _tune_out(lambda t: os.path.join(_file(t, "f.txt", "x"), "run")), 3,
           "f.txt' is a file"),
    CliRow("show map 100000 deep", _show("[" * 100_000 + "]" * 100_000), 2, "nests too deeply"),
    CliRow("show map duplicate key", _show('{"class_name": "DTypePolicyMap", "class_name": "x"}'), 2,
           "duplicate key 'class_name'"),
    CliRow("show binary file", _show(b"\x00\xff\x13PK"), 2, "map.json"),
    CliRow("show a directory", lambda t, _: ["show", str(t)], 2, "no file at"),
    CliRow("report of an empty directory", lambda t, _: ["report", str(t)], 2, "has no profile.csv"),
    CliRow("export from no run", lambda t, _: ["export", str(t), "--out", str(t / "m.json")], 2, "no policy map"),
    CliRow("export --out under a file", lambda t, _: ["export", _run_dir(t), "--out", os.path.join(
        _file(t, "f.txt", "x"), "m.json")], 3, "f.txt' is a file"),
    CliRow("profile --out a directory", lambda t, _: ["profile", "digits_mlp", "--out", str(t)], 3,
           "is a directory"),
]


def _run(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("row", CLI_ROWS, ids=[r.id for r in CLI_ROWS])
def test_command_line_failures_are_one_line_with_a_documented_status(row, tmp_path, capsys):
    status = _run(row.argv(tmp_path, TINY))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("experiment ")]
    assert status == row.status, err
    assert status in cli.EXIT_STATUSES
    assert len(lines) == 1 and "Traceback" not in err, err
    assert row.needle in lines[0], lines[0]


def test_exit_statuses_are_documented_in_help_and_readme(capsys):
    assert _run(["--help"]) == 0
    help_text = capsys.readouterr().out
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for status in (0, 1, 2, 3, 130):
        assert f"  {status:<4} " in help_text
        assert f"| {status} |" in readme


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    def boom(args):
        raise KeyError("broken_key")

    monkeypatch.setitem(cli._COMMANDS, "list", boom)
    assert cli.main(["list"]) == 1
    err = capsys.readouterr().err
    assert err == ("autopolicy list: error: internal error: KeyError: 'broken_key' (rerun with --debug for the "
                   "traceback, and report it)\n")
    with pytest.raises(KeyError, match="broken_key"):
        cli.main(["list", "--debug"])


def _read_only(tmp_path, monkeypatch):
    """A directory that refuses new files: chmod, or for root (who ignores it) a refusing mkstemp."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return directory
    real = _rundir.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):  # noqa: A002
        if dir is not None and os.path.abspath(dir).startswith(str(directory)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(_rundir.tempfile, "mkstemp", refuse)
    return directory


def test_out_in_a_read_only_directory_fails_before_any_work(tmp_path, monkeypatch, capsys):
    ro = _read_only(tmp_path, monkeypatch)
    never = _experiment_file(tmp_path, "def build(cache_dir):\n    raise AssertionError('built')\n")
    assert cli.main(["tune", never, "--out", str(ro), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"autopolicy tune: error: cannot write in --out {str(ro)!r}: Permission denied: ")
    assert "choose another directory" in err and "built" not in err


def test_a_full_disk_is_status_3_naming_the_file_and_leaves_no_temp_file(tmp_path, monkeypatch, capsys):
    run = _run_dir(tmp_path)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_atomic.os, "fsync", full)
    assert cli.main(["export", run, "--out", str(tmp_path / "out" / "m.json")]) == 3
    err = capsys.readouterr().err
    expected = os.path.join(str(tmp_path / "out"), "m.json")
    assert err == (f"autopolicy export: error: No space left on device ({expected!r}): free some disk space and "
                   "run again\n")
    assert os.listdir(tmp_path / "out") == []


def test_a_damaged_cached_model_is_trained_again_with_a_warning(tmp_path):
    trained = []

    def train():
        trained.append(1)
        return nn.Dense(2).build(jax.random.key(len(trained)), X)

    first = experiment.cached_model(tmp_path, "exp-v1", train)
    assert len(trained) == 1
    weights = tmp_path / "exp-v1" / "weights.npz"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(UserWarning, match=r"The cached model '.*exp-v1' is damaged \(weights.npz is not a readable "
                                         r".npz archive \(BadZipFile: .*\)\); training it again.$"):
        second = experiment.cached_model(tmp_path, "exp-v1", train)
    assert len(trained) == 2
    assert not np.array_equal(np.asarray(first.kernel), np.asarray(second.kernel))  # a new model (another seed)
    third = experiment.cached_model(tmp_path, "exp-v1", train)  # repaired: loaded, not trained
    assert len(trained) == 2
    np.testing.assert_array_equal(np.asarray(third.kernel), np.asarray(second.kernel))
    with zipfile.ZipFile(weights) as archive:
        assert archive.testzip() is None


CACHED = textwrap.dedent('''
    import jax, numpy as np
    from autopolicy import nn
    from autopolicy.experiment import Experiment, cached_model

    def build(cache_dir):
        x = np.ones((2, 3), np.float32)
        model = cached_model(cache_dir, "cached-v1", lambda: nn.Dense(2).build(jax.random.key(0), x))
        return Experiment(name="cached", model=model, eval_fn=lambda m: 1.0, sample_input=x)
''')


@pytest.mark.slow
def test_the_command_line_rebuilds_a_damaged_experiment_cache_with_a_one_line_warning(tmp_path):
    exp = _experiment_file(tmp_path, CACHED, "cached.py")
    env = {**os.environ, "AUTOPOLICY_CACHE": str(tmp_path / "cache")}
    # --max-drop 1.5 stops the run right after build(): this test is about the cache.
    argv = [sys.executable, "-m", "autopolicy", "tune", exp, "--out", str(tmp_path / "out"), "--max-drop", "1.5"]
    first = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    weights = tmp_path / "cache" / "cached-v1" / "weights.npz"
    assert first.returncode == 2 and "warning" not in first.stderr and weights.is_file()
    weights.write_bytes(weights.read_bytes()[:60])  # truncated, as by a full disk or a crash
    damaged = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = damaged.stderr.splitlines()
    assert damaged.returncode == 2 and len(lines) == 3, damaged.stderr
    assert lines[1] == (f"autopolicy tune: warning: The cached model {str(weights.parent)!r} is damaged (weights.npz "
                        "is not a readable .npz archive (BadZipFile: File is not a zip file)); training it again.")
    assert lines[2].startswith("autopolicy tune: error: A relative max_drop is a fraction of the float32 metric")
    again = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "warning" not in again.stderr and len(again.stderr.splitlines()) == 2  # rebuilt: loaded as it is


def test_a_map_key_matching_no_layer_warns_with_the_nearest_paths():
    model = nn.Sequential([nn.Dense(4), nn.Dense(2)], name="mlp").build(jax.random.key(0), X)
    typo = policies.DTypePolicyMap("float32", {"mlp/dnese_1": "bfloat16", "mlp/dense": "bfloat16"})
    with pytest.warns(UserWarning, match=r"\['mlp/dnese_1'\] \('mlp/dnese_1': did you mean \['mlp/dense_1', "):
        mapped = model.with_dtype_policy(typo)
    assert [layer.dtype_policy.name for layer in mapped.layers] == ["bfloat16", "float32"]
    with pytest.raises(ValueError, match="did you mean"):
        model.with_dtype_policy(typo, strict=True)


# --- the lock, and orphaned temporary files --------------------------------------------------

HOLDER = textwrap.dedent('''
    import sys, time
    from autopolicy import _rundir
    lock = _rundir.RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
''')


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(_rundir.RunDirectoryLocked, match=f"in use by process {holder.pid}:") as info:
            _rundir.RunLock(run).acquire()
        assert info.value.pid == holder.pid
        started = time.perf_counter()
        never = _experiment_file(tmp_path, "def build(cache_dir):\n    raise AssertionError('built')\n")
        assert cli.main(["tune", never, "--out", str(run), "--no-progress"]) == 3
        assert time.perf_counter() - started < 2.0  # refused at once, not after waiting
        err = capsys.readouterr().err
        assert err.startswith(f"autopolicy tune: error: {str(run)!r} is in use by process {holder.pid}: ")
        with pytest.raises(_rundir.RunDirectoryLocked, match=str(holder.pid)):
            MeasurementCache(run)
        with monkeypatch.context() as patched:  # where flock is missing: the live process id decides
            patched.setattr(_rundir, "fcntl", None)
            with pytest.raises(_rundir.RunDirectoryLocked, match=f"in use by process {holder.pid}:"):
                _rundir.RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert (run / _rundir.LOCK_FILE).read_text().strip() == str(holder.pid)  # the dead holder's id is left
    with monkeypatch.context() as patched:
        patched.setattr(_rundir, "fcntl", None)
        with _rundir.RunLock(run):  # without flock too, a dead holder's lock is taken over
            assert (run / _rundir.LOCK_FILE).read_text().strip() == str(os.getpid())
    (run / _rundir.LOCK_FILE).write_text(f"{holder.pid}\n")  # as the killed holder left it
    (run / ".tmp-abcd-measurements.json").write_text('{"half')  # what a writer killed mid-write leaves
    (run / ".tmp-probe-x").write_text("")
    with MeasurementCache(run) as cache:  # the stale lock is taken over, the orphans removed
        assert (run / _rundir.LOCK_FILE).read_text().strip() == str(os.getpid())
        assert sorted(p.name for p in run.iterdir()) == [_rundir.LOCK_FILE]
        cache.put("k", 1.0)
    assert (run / _rundir.LOCK_FILE).read_text() == ""  # released
    assert json.loads((run / "measurements.json").read_text()) == {"k": 1.0}
    with MeasurementCache(run) as cache:  # free again
        assert cache.lookup("k") == 1.0 and (cache.hits, cache.misses) == (1, 0)


def test_a_closed_cache_refuses_new_writes_and_frees_the_directory(tmp_path):
    cache = MeasurementCache(tmp_path)
    cache.get_or_measure("a", lambda: 2.0)
    cache.close()
    cache.close()  # twice is harmless
    assert cache.lookup("a") == 2.0
    cache.put("b", 3.0)
    with pytest.raises(RuntimeError, match="closed"):
        cache.flush()
    with MeasurementCache(tmp_path) as again:
        assert again.entries == {"a": 2.0}


def _orphans(directory) -> list[str]:
    return sorted(p.name for p in directory.rglob(_atomic.TMP_PREFIX + "*"))


@pytest.mark.slow
def test_a_killed_tune_resumes_from_its_cache_and_leaves_no_temp_file(tmp_path, capsys):
    exp = _experiment_file(tmp_path, TINY, "tiny.py")
    out = tmp_path / "out"
    marker = tmp_path / "marker"
    argv = ["tune", exp, "--out", str(out), "--repeats", "3", "--no-progress", "--no-report"]
    env = {**os.environ, "TINY_HANG_AT_CALL": "2", "TINY_MARKER": str(marker)}
    # Killed at a chosen moment: in the second evaluation, after every latency was measured and cached.
    proc = subprocess.Popen([sys.executable, "-m", "autopolicy", *argv], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no marker"
        # Meanwhile a second run on the same directory is refused, naming the first.
        assert cli.main(argv) == 3
        assert f"in use by process {proc.pid}" in capsys.readouterr().err
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    cached = json.loads((out / "cache" / "measurements.json").read_text())
    assert len(cached) >= 2  # the latencies of both layers (and casts) survived the kill
    (out / "cache" / ".tmp-k1ll3d-measurements.json").write_text('{"partial')  # as a kill mid-write leaves
    (out / ".tmp-k1ll3d-summary.json").write_text("{")

    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    # Every measurement of the killed run reused, except noisy layer timings, which a later run
    # measures once more by design (search.noise: CV above NOISY_CV, not yet re-measured).
    noisy = sum(1 for r in cached.values() if isinstance(r, dict)
                and r.get("latency_cv", 0.0) > NOISY_CV and r.get("remeasured", True) is False)
    assert summary["cache"]["hits"] >= len(cached) - noisy
    assert _orphans(out) == []
    final = json.loads((out / "cache" / "measurements.json").read_text())
    assert set(cached) <= set(final)  # nothing lost (a noisy timing may be measured once more)
    assert (out / _rundir.LOCK_FILE).read_text() == ""
