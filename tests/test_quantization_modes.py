"""The registry of quantization modes and its numerics side: one table that names, JSON, layers,
kernels and reports all read."""

import dataclasses

import jax
import pytest

import autopolicy as ap
import autopolicy.nn as nn
from autopolicy import policies
from autopolicy.numerics import modes as numerics_modes
from autopolicy.policies import _modes

# The nn layer class of each layer kind.
LAYER_CLASSES = {"dense": nn.Dense, "einsum_dense": nn.EinsumDense, "conv": nn.Conv2D, "embedding": nn.Embedding}


def test_public_names_read_the_registry():
    assert policies.QUANTIZATION_MODES == tuple(m.name for m in _modes.MODES)
    assert policies.QUANTIZATION_MODES[:2] == ("int8", "float8")  # Keras's order
    assert set(LAYER_CLASSES) == set(policies.LAYER_KINDS)


@pytest.mark.parametrize("mode", [m.name for m in _modes.MODES])
def test_every_mode_runs_on_the_layer_kinds_it_claims(mode):
    entry = policies.get_quantization_mode(mode)
    execution = numerics_modes.numerics_of(mode)
    for kind, cls in LAYER_CLASSES.items():
        assert cls.layer_kind == kind
        assert (mode in cls.supported_quantization_modes) == (kind in entry.layer_kinds)
        if kind in entry.layer_kinds:
            assert callable(execution.kernel(cls.kernel_op))


def test_supported_modes_are_derived_from_the_layer_kind():
    assert nn.Conv2D.supported_quantization_modes == ("int8",)
    assert nn.Embedding(4, 2).supported_quantization_modes == ("int8",)
    assert nn.Dense(2).supported_quantization_modes == policies.modes_for_layer_kind("dense")
    assert "float8" in nn.EinsumDense.supported_quantization_modes
    assert nn.LayerNormalization().supported_quantization_modes == ()


def test_every_form_parses_to_its_class_and_back_to_the_same_json_class():
    for mode in _modes.MODES:
        for form in mode.forms:
            policy = ap.get(f"{form.example}_from_float32")
            assert type(policy).keras_class_name == form.class_name
            assert policy.quantization_mode == mode.name
            assert tuple(policy.get_config()) == form.config_keys
            assert ap.serialize(policy)["class_name"] == form.class_name


def test_registry_entries_are_hashable_and_frozen():
    entry = policies.get_quantization_mode("int8")
    assert hash(entry) == hash(policies.get_quantization_mode("int8"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.name = "int7"  # type: ignore[misc]
    jax.jit(lambda x, m: x, static_argnums=1)(1.0, entry)  # usable as a static argument


@pytest.mark.parametrize(
    "call,text",
    [
        (lambda: policies.get_quantization_mode("int7"), "mode='int7'"),
        (lambda: policies.modes_for_layer_kind("lstm"), "kind='lstm'"),
        (lambda: numerics_modes.numerics_of("int7"), "mode='int7'"),
        (lambda: numerics_modes.numerics_of("float8").kernel("conv2d"), "'conv2d'"),
    ],
)
def test_lookups_name_the_bad_value(call, text):
    with pytest.raises(ValueError) as info:
        call()
    assert text in str(info.value)


def test_an_inconsistent_table_is_refused():
    int8 = policies.get_quantization_mode("int8")
    with pytest.raises(ValueError, match="Duplicate"):
        _modes._check_registry((int8, int8))
    with pytest.raises(ValueError, match="lstm"):
        _modes._check_registry((dataclasses.replace(int8, layer_kinds=("lstm",)),))
    wrong_keys = dataclasses.replace(int8.forms[0], config_keys=("mode",))
    with pytest.raises(ValueError, match="QuantizedDTypePolicy"):
        _modes._check_registry((int8, dataclasses.replace(int8, name="int2", forms=(
            dataclasses.replace(wrong_keys, spelling="int2"),))))


def test_report_colours_come_from_the_registry():
    from autopolicy.report import _plot  # pylint: disable=import-outside-toplevel

    names = [f"{mode}_from_float32" for mode in policies.QUANTIZATION_MODES]
    colours = _plot.policy_colors(["float32", "mixed_bfloat16"] + names)
    assert [colours[n] for n in names] == [policies.get_quantization_mode(m).color for m in policies.QUANTIZATION_MODES]
    assert len(set(colours.values())) == len(colours)  # every policy its own colour


def test_the_policy_side_of_the_registry_imports_no_jax():
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    # autopolicy/__init__ imports nn (and jax): load the policies package on its own.
    code = (
        "import sys, types; pkg = types.ModuleType('autopolicy'); pkg.__path__ = ['autopolicy']; "
        "sys.modules['autopolicy'] = pkg; import autopolicy.policies as p; "
        "print('jax' in sys.modules, p.QUANTIZATION_MODES)"
    )
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False ('int8', 'float8', 'int4', 'gptq', 'awq')"
