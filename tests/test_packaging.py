"""The sdist and the wheel built from this checkout carry every file of the ``ropekv`` package:
modules of every subpackage (``ropekv.bench``, ``ropekv.bench.workloads``), the kernel sources
(``kernels/*.cu``, ``*.cuh``), ``_native.c`` and ``py.typed``. The wheel is built from the sdist,
as ``python -m build`` does, so a file the sdist drops is missing from the wheel too."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the build reads besides the package (pyproject's readme, license-files; MANIFEST.in's grafts).
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in")


def _backend_or_skip():
    """Skip only where the build front end or a new enough setuptools is not installed (the test
    extra installs both); the build itself runs without network (--no-isolation)."""
    try:
        import build  # noqa: F401
        import setuptools
    except ImportError as e:
        pytest.skip(f"needs the build backend (pip install -e '.[test]'): {e}")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(
            f"needs setuptools>=77 (pip install -e '.[test]'), have {setuptools.__version__}"
        )


def package_files():
    """Every file under ropekv/ of the checkout, as a path relative to the checkout."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "ropekv").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist member names relative to its top folder, wheel member names) of a build of a copy
    of the checkout (so the checkout gets no build/ or egg-info)."""
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "ropekv").is_dir():
        pytest.skip("not a source checkout (ropekv/ and pyproject.toml are not beside tests/)")
    _backend_or_skip()
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    src.mkdir()
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, src / name)
    for folder in ("ropekv", "docs", "tests", "tools"):
        if (ROOT / folder).is_dir():
            shutil.copytree(
                ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "_build")
            )
    out = tmp / "dist"
    run = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, (
        f"python -m build failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    (sdist,) = out.glob("ropekv-*.tar.gz")
    (wheel,) = out.glob("ropekv-*.whl")
    with tarfile.open(sdist) as tar:
        sdist_names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    with zipfile.ZipFile(wheel) as whl:
        wheel_names = set(whl.namelist())
    return sdist_names, wheel_names


def test_the_wheel_carries_the_whole_package(built):
    _, wheel_names = built
    in_wheel = {n for n in wheel_names if n.startswith("ropekv/")}
    want = package_files()
    assert {"ropekv/bench/runner.py", "ropekv/bench/workloads/base.py"} <= want
    assert {"ropekv/kernels/common.cuh", "ropekv/_native.c", "ropekv/py.typed"} <= want
    assert not want - in_wheel, f"missing from the wheel: {sorted(want - in_wheel)}"
    assert not in_wheel - want, f"in the wheel but not in the tree: {sorted(in_wheel - want)}"


def test_the_sdist_carries_the_whole_package(built):
    sdist_names, _ = built
    want = package_files()
    assert not want - sdist_names, f"missing from the sdist: {sorted(want - sdist_names)}"
    # what the suite needs to run from an unpacked sdist against an installed wheel (.ci/run)
    assert {"tests/conftest.py", "pyproject.toml", "docs/conf.py"} <= sdist_names
    assert "tools/hostcost.py" in sdist_names  # tests/test_replay_cpu.py loads its stand-ins
    assert "tools/device_ab.py" in sdist_names  # tests/test_bench.py runs it on stand-in trees
    assert "tools/sass_diff.py" in sdist_names  # tests/test_sass_diff.py loads it
    assert "tools/budgets.py" in sdist_names  # tests/test_budgets.py loads it
    assert "tools/targets.py" in sdist_names  # tests/test_targets.py loads it
