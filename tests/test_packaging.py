"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel (the wheel built
from the sdist, in an isolated environment with only ``[build-system] requires``), the sdist
carries the C++ kernels' sources, and the wheel, installed alone into a fresh venv, imports from
that venv with the CPU kernels built wherever a C++ compiler is.

The fresh venv has no packages of its own besides the wheel (``pip install --no-deps``); it reads
the dependencies from this interpreter's site-packages, listed after its own in a ``.pth`` file,
so the ``autopolicy`` it imports can only be the wheel's. Minutes: the build compiles the C++
kernels and downloads the build requirements into its isolated environment. So it runs as its
own tier only, not in the slow tier:
``AUTOPOLICY_TEST_PACKAGING=1 python -m pytest tests/test_packaging.py`` (needs ``build``, in the
dev extra).
"""

import importlib.util
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest

pytestmark = [
    pytest.mark.slow, pytest.mark.packaging, pytest.mark.timeout(1800),
    pytest.mark.skipif(not os.environ.get("AUTOPOLICY_TEST_PACKAGING"),
                       reason="builds and installs the package: the packaging tier "
                              "(AUTOPOLICY_TEST_PACKAGING=1 .venv/bin/python -m pytest tests/test_packaging.py)"),
]

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)
CPU_SOURCES = ROOT / "autopolicy" / "numerics" / "cpu"
#: What .gitignore leaves out of a checkout, and what a copy for the build need not carry.
IGNORED = (".git", ".venv", "venv", ".cache", ".pytest_cache", "__pycache__", "*.pyc", "*.so", "*.egg-info",
           "build", "dist", "runs", "_build")


def _compiler() -> str | None:
    """The C++ compiler setuptools would find: ``$CXX``, else the usual names."""
    names = [os.environ["CXX"].split()[0]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((found for found in map(shutil.which, names) if found), None)


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    if importlib.util.find_spec("build") is None:
        pytest.skip("needs the 'build' package (in the dev extra): pip install build")
    # A copy of the working tree without what git ignores (a built library, caches, egg-info):
    # the sdist is what a clean checkout makes, and setuptools writes nothing into this one.
    src = tmp_path_factory.mktemp("src") / "autopolicy"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*IGNORED))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], cwd=out)
    return out


def _one(directory: pathlib.Path, pattern: str) -> pathlib.Path:
    found = sorted(directory.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {directory}, found {[p.name for p in found]}"
    return found[0]


def test_the_sdist_carries_the_cpu_kernels_sources_and_no_binary(dist):
    sdist = _one(dist, f"autopolicy-{VERSION}.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {pathlib.PurePosixPath(name).relative_to(f"autopolicy-{VERSION}").as_posix()
                 for name in tar.getnames() if "/" in name}
    wanted = {path.relative_to(ROOT).as_posix() for pattern in ("*.cc", "*.h") for path in CPU_SOURCES.glob(pattern)}
    assert wanted and wanted <= names, f"missing from the sdist: {sorted(wanted - names)}"
    assert {"pyproject.toml", "setup.py", "README.md"} <= names
    assert not [name for name in names if name.endswith(".so")], "the sdist ships a built library"


def test_the_wheel_holds_the_package_and_the_built_kernels(dist):
    wheel = _one(dist, f"autopolicy-{VERSION}-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "autopolicy/__init__.py" in names
    assert not [name for name in names if name.split("/")[0] in ("tests", "experiments", "benchmarks", "reports")]
    libraries = [name for name in names if name.startswith("autopolicy/numerics/cpu/_autopolicy_cpu")]
    if _compiler() is not None:
        assert libraries, "a C++ compiler is here, yet the wheel has no CPU-kernel library"


def test_the_wheel_alone_in_a_fresh_venv_imports_from_there(dist, tmp_path):
    wheel = _one(dist, f"autopolicy-{VERSION}-*.whl")
    venv = tmp_path / "fresh"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)])
    # The dependencies: this interpreter's site-packages, after the venv's own on sys.path.
    own = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    pathlib.Path(own, "zz_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    check = textwrap.dedent(f"""
        import pathlib, autopolicy
        from autopolicy.numerics import cpu_kernels
        assert pathlib.Path(autopolicy.__file__).resolve().is_relative_to(pathlib.Path({str(venv)!r}).resolve()), \\
            autopolicy.__file__
        assert autopolicy.__version__ == {VERSION!r}, autopolicy.__version__
        print("kernels", cpu_kernels.AVAILABLE, cpu_kernels.unavailable_reason())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = _run([str(python), "-c", check], cwd=tmp_path, env=env).stdout
    if _compiler() is not None:
        assert "kernels True" in out, out
    _run([str(venv / "bin" / "autopolicy"), "device"], cwd=tmp_path, env=env)
