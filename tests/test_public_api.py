"""Every public name resolves, and importing the core pulls in neither pandas nor matplotlib."""

import importlib
import subprocess
import sys

import pytest

PUBLIC_MODULES = [
    "autopolicy",
    "autopolicy.policies",
    "autopolicy.dtype_policies",
    "autopolicy.mixed_precision",
    "autopolicy.numerics",
    "autopolicy.nn",
    "autopolicy.train",
    "autopolicy.search",
    "autopolicy.report",
    "autopolicy.experiment",
    "autopolicy.keras",  # needs the keras extra (installed by the dev extra)
    "autopolicy.numerics.kernels",
    "autopolicy.numerics.device",
    "autopolicy.numerics.pallas_weight_only",
    "autopolicy.numerics.gemm_forms",
    "autopolicy.distributed",  # RayExecutor needs the distributed extra only when made
    "autopolicy.search.executor",
    "autopolicy.llamacpp",
]


#: Modules that need an optional extra: checked where it is installed, skipped (saying why) elsewhere.
NEEDS = {"autopolicy.keras": "keras"}


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_exists(module_name):
    if module_name in NEEDS:
        pytest.importorskip(NEEDS[module_name], reason=f"{module_name} needs the {NEEDS[module_name]} extra")
    module = importlib.import_module(module_name)
    assert module.__all__, module_name
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert not name.startswith("_"), f"{module_name}.{name} is private by its name"
        assert getattr(module, name) is not None, f"{module_name}.{name}"


@pytest.mark.slow
def test_core_import_is_light():
    code = (
        "import sys, autopolicy; "
        "heavy = [m for m in ('pandas', 'matplotlib', 'sklearn', 'tqdm', 'keras', 'flax') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # 5-10 s on a 2-core EPYC
def test_autopolicy_keras_is_an_attribute_imported_on_first_use():
    pytest.importorskip("keras", reason="autopolicy.keras needs the keras extra")
    code = (
        "import sys, autopolicy as ap; "
        "before = 'keras' in sys.modules; "
        "apply = ap.keras.apply_policy_map; "
        "print(before, 'keras' in sys.modules, 'keras' in dir(ap), apply.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True", "autopolicy.keras"]


def test_an_unknown_attribute_of_the_package_is_an_attribute_error():
    import autopolicy

    with pytest.raises(AttributeError, match="module 'autopolicy' has no attribute 'flux'"):
        autopolicy.flux  # noqa: B018
