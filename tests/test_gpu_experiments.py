"""The GPU-sized experiments (bert_base, decoder_1b) in their small forms, and experiment options
(``autopolicy tune NAME --small --option KEY=VALUE``, ``experiment.build(module, **options)``)."""

import functools
import json
import os
import textwrap

import jax
import numpy as np
import pytest

from autopolicy import cli, experiment

#: An experiment with options of every kind, which records what its build received.
OPTIONED = textwrap.dedent('''
    """optioned: a Dense layer; its build's keyword parameters are its options."""
    from typing import Literal
    import jax, jax.numpy as jnp
    from autopolicy import nn
    from autopolicy.experiment import Experiment

    RECEIVED = []

    def build(cache_dir, small: bool = False, width: int = 8, scale: float = 1.0,
              mode: Literal["fast", "exact"] = "fast", label: str = "run"):
        RECEIVED.append({"small": small, "width": width, "scale": scale, "mode": mode, "label": label})
        x = jnp.ones((2, 4))
        model = nn.Dense(2 if small else width, name="optioned").build(jax.random.key(0), x)
        return Experiment(name="optioned", model=model, eval_fn=lambda m: 1.0, sample_input=x)
''')


@pytest.fixture(scope="module")
def optioned(tmp_path_factory):
    path = tmp_path_factory.mktemp("exp") / "optioned.py"
    path.write_text(OPTIONED)
    return experiment.load(path)


def run(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse exits for usage errors
        return e.code


def test_options_reach_build_and_name_the_form(optioned):
    exp = experiment.build(optioned, small=True, scale=2, mode="exact")
    assert optioned.RECEIVED[-1] == {"small": True, "width": 8, "scale": 2.0, "mode": "exact", "label": "run"}
    assert isinstance(optioned.RECEIVED[-1]["scale"], float)  # an int for a float option becomes a float
    assert exp.name == "optioned-small-scale2.0-mode-exact"
    assert exp.options == {"small": True, "width": 8, "scale": 2.0, "mode": "exact", "label": "run"}
    # Options at their defaults are the default form: its name, its run directory.
    assert experiment.build(optioned, width=8, mode="fast").name == "optioned"
    assert experiment.form_suffix(optioned, width=8) == ""
    assert experiment.form_suffix(optioned, small=False, width=16) == "-width16"
    assert [o.describe() for o in experiment.options_of(optioned).values()] == [
        "small (bool, default False)", "width (int, default 8)", "scale (float, default 1.0)",
        "mode in ('fast', 'exact'), default 'fast'", "label (str, default 'run')"]


def test_command_line_values_are_read_as_each_option_declares(optioned):
    given = dict(cli_options("width=16", "scale=2", "mode=exact", "label=5", "small=TRUE"))
    exp = experiment.build(optioned, **given)
    assert optioned.RECEIVED[-1] == {"small": True, "width": 16, "scale": 2.0, "mode": "exact", "label": "5"}
    assert exp.name == "optioned-small-width16-scale2.0-mode-exact-label-5"


def cli_options(*texts):
    return [cli._option(text) for text in texts]


@pytest.mark.parametrize("options,message", [
    ({"depth": 3}, "Unknown option 'depth' for the experiment 'optioned'. Expected one of "
                   "('small', 'width', 'scale', 'mode', 'label'). Received: depth=3"),
    ({"mode": "slow"}, "Invalid option mode for the experiment 'optioned'. Expected one of ('fast', 'exact'). "
                       "Received: mode='slow'"),
    ({"width": 2.5}, "Invalid option width for the experiment 'optioned'. Expected an int (like width=8). "
                     "Received: width=2.5"),
    ({"small": 1}, "Invalid option small for the experiment 'optioned'. Expected a bool (like small=true). "
                   "Received: small=1"),
])
def test_bad_options_are_refused_before_build(optioned, options, message):
    calls = len(optioned.RECEIVED)
    with pytest.raises(ValueError) as info:
        experiment.build(optioned, **options)
    assert str(info.value) == message
    assert len(optioned.RECEIVED) == calls


@pytest.mark.parametrize("argv,message", [
    (["tune", "bert_base", "--option", "batch=16"],
     "Unknown option 'batch' for the experiment 'bert_base'. Expected one of ('small',). Received: batch=16"),
    (["tune", "digits_mlp", "--small"],
     "Unknown option 'small' for the experiment 'digits_mlp'. Its build(cache_dir) takes no options. "
     "Received: small=True"),
    (["tune", "decoder_1b", "--small", "--option", "batch=2"],
     "Invalid option batch for the experiment 'decoder_1b'. Expected one of (1, 16, 64). Received: batch=2"),
    (["tune", "decoder_1b", "--option", "phase=train"],
     "Invalid option phase for the experiment 'decoder_1b'. Expected one of ('decode', 'prefill'). "
     "Received: phase='train'"),
    (["tune", "decoder_1b", "--option", "small=yes"],
     "Invalid option small for the experiment 'decoder_1b'. Expected a bool (like small=true). Received: small='yes'"),
    (["tune", "decoder_1b", "--small", "--option", "small=false"],
     "option 'small' given twice (small=true and small=false) (--small is --option small=true)"),
    (["tune", "decoder_1b", "--option", "batch16"],
     "argument --option: 'batch16' is not KEY=VALUE (like batch=16)"),
])
def test_option_errors_are_one_line_before_anything_runs(argv, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(argv + ["--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"autopolicy tune: error: {message}"
    assert not out.exists()  # refused before the run directory is made


def test_decoder_checks_its_options_when_called_directly():
    module = experiment.load("decoder_1b")
    with pytest.raises(ValueError, match=r"^Invalid batch for decoder_1b\. Expected one of \(1, 16, 64\)\. "
                                         r"Received: batch=2$"):
        module.build(None, small=True, batch=2)
    with pytest.raises(ValueError, match=r"Expected one of \('decode', 'prefill'\)\. Received: phase='train'$"):
        module.build(None, small=True, phase="train")


@pytest.mark.slow
def test_list_shows_each_experiments_options(capsys):
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    after = {line.split()[0]: lines[i + 1] for i, line in enumerate(lines[:-1]) if not line[:1].isspace()}
    assert after["decoder_1b"].split() == ["options:", *(
        "small (bool, default False); batch in (1, 16, 64), default 1; "
        "phase in ('decode', 'prefill'), default 'decode'").split()]
    assert after["bert_base"].split() == ["options:", "small", "(bool,", "default", "False)"]
    assert not after["digits_mlp"][:1].isspace()  # no options: no line


@functools.cache
def small(name: str, **options):
    return experiment.build(experiment.load(name), small=True, **options)


def test_bert_base_small_form():
    exp = small("bert_base")
    assert exp.name == "bert_base-small" and exp.options == {"small": True}
    assert exp.sample_input.shape == (4, 32)  # the timed input is the whole batch
    assert exp.model(exp.sample_input).shape == (4, 32, 128)
    assert exp.higher_is_better and not exp.relative and exp.max_drop == 0.001
    assert exp.eval_fn(exp.model) == pytest.approx(1.0, abs=1e-6)
    # int4 weights everywhere break the budget: a cosine below 0.999.
    assert exp.eval_fn(exp.model.with_dtype_policy("int4_from_float32")) < 1.0 - exp.max_drop


@pytest.mark.parametrize("batch,phase", [(1, "decode"), pytest.param(16, "decode", marks=pytest.mark.slow),
                                         pytest.param(1, "prefill", marks=pytest.mark.slow)])
def test_decoder_1b_small_forms(batch, phase):
    exp = small("decoder_1b", batch=batch, phase=phase)
    assert exp.options == {"small": True, "batch": batch, "phase": phase}
    assert exp.name == "decoder_1b-small" + ("" if batch == 1 else f"-batch{batch}") + (
        "" if phase == "decode" else "-phase-prefill")
    if phase == "decode":
        tokens, start, cache = exp.sample_input
        assert tokens.shape == (batch, 1) and int(start) == 63 and len(cache) == 2
        logits, new_cache = exp.model(*exp.sample_input)
        assert logits.shape == (batch, 1, 512)
        assert exp.step_carry(exp.sample_input, (logits, new_cache))[2] is new_cache
    else:
        (ids,) = exp.sample_input
        assert ids.shape == (batch, 32) and exp.step_carry is None
        assert exp.model(ids).shape == (batch, 32, 512)


def test_decoder_1b_metric_is_the_kl_to_float32():
    exp = small("decoder_1b")
    assert not exp.higher_is_better and not exp.relative and exp.max_drop == 0.01
    assert exp.eval_fn(exp.model) == pytest.approx(0.0, abs=1e-6)
    # Non-degenerate next-token distributions: far from uniform (log 512 = 6.2 nats) and from one-hot.
    ids = jax.numpy.zeros((1, 8), jax.numpy.int32) + 7
    p = jax.nn.softmax(exp.model(ids)[0], axis=-1)
    entropy = float(np.mean(-np.sum(np.asarray(p) * np.log(np.asarray(p)), -1)))
    assert 0.5 < entropy < 5.0
    assert exp.eval_fn(exp.model.with_dtype_policy("int4_from_float32")) > exp.max_drop


def test_the_full_decoder_is_about_a_billion_parameters():
    module = experiment.load("decoder_1b")
    c = module.FULL
    per_block = 2 * c.dim * c.heads * c.head_dim + 2 * c.dim * c.kv_heads * c.head_dim + 3 * c.dim * c.mlp_dim
    assert (c.dim, c.blocks, c.heads, c.kv_heads, c.mlp_dim, c.vocab_size) == (2048, 16, 32, 8, 8192, 49152)
    assert c.blocks * per_block + 2 * c.vocab_size * c.dim == pytest.approx(1.17e9, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("argv,name,options", [
    (["bert_base", "--small"], "bert_base-small", {"small": True}),
    (["decoder_1b", "--small", "--option", "batch=16"], "decoder_1b-small-batch16",
     {"small": True, "batch": 16, "phase": "decode"}),
])
def test_small_tunes_end_to_end(argv, name, options, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run directory: runs/<name of the form>
    assert cli.main(["tune", *argv, "--repeats", "3", "--no-progress", "--no-report"]) == 0
    out = tmp_path / "runs" / name
    assert (out / "policy_map.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"]["name"] == name and summary["experiment"]["options"] == options
    assert os.listdir(tmp_path / "runs") == [name]
