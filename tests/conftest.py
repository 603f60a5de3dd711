"""Shared test setup: hypothesis profiles, the ``gpu`` marker (skipped without a device) and the
``exhaustive`` marker (skipped unless asked for with ``--exhaustive-compile``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from ropekv._env import env_flag
from tests import sanitizer

# deadline=None: the first call of each kernel instantiation compiles it.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=15,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

if env_flag("ROPEKV_NO_MEMORY_POOL"):
    # tools/sanitize.sh: every CuPy allocation its own cudaMalloc, so memcheck sees its bounds
    import cupy

    cupy.cuda.set_allocator(None)

if sanitizer.active():
    sanitizer.setup_torch()


@functools.cache
def gpu_available():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except (ImportError, OSError, RuntimeError):  # no CuPy, no driver (CUDARuntimeError)
        return False


EXHAUSTIVE_ENV = "ROPEKV_EXHAUSTIVE_COMPILE"  # tests/test_compile.py reads it


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive-compile",
        action="store_true",
        help=f"run the tests marked exhaustive (every kernel instantiation through NVRTC, about "
        f"30 minutes cold on 2 CPUs); the same as {EXHAUSTIVE_ENV}=1",
    )


def pytest_configure(config):
    if config.getoption("--exhaustive-compile"):
        os.environ[EXHAUSTIVE_ENV] = "1"
    if os.environ.get("ROPEKV_TEST_INSTALLED", "") not in ("", "0"):
        # .ci/run: the suite against an installed wheel, never a ropekv/ folder beside the tests
        import ropekv

        where = Path(ropekv.__file__).resolve()
        if "site-packages" not in where.parts or Path.cwd().resolve() in where.parents:
            raise pytest.UsageError(
                f"ROPEKV_TEST_INSTALLED is set but ropekv was imported from {where}, not from "
                f"an installed package in site-packages"
            )


def exhaustive_requested():
    return os.environ.get(EXHAUSTIVE_ENV, "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    exhaustive = [item for item in items if "exhaustive" in item.keywords]
    if not exhaustive_requested():
        skip = pytest.mark.skip(
            reason=f"exhaustive compile sweep: run with --exhaustive-compile or {EXHAUSTIVE_ENV}=1"
        )
        for item in exhaustive:
            item.add_marker(skip)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Asked for and nothing of it selected (after -m / -k): an error, never a silent pass."""
    if exhaustive_requested() and not any("exhaustive" in i.keywords for i in session.items):
        pytest.exit(
            f"the exhaustive compile sweep was asked for (--exhaustive-compile or "
            f"{EXHAUSTIVE_ENV}=1) but no test marked exhaustive is selected",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_report_header(config):
    return f"ropekv GPU tests: {'enabled' if gpu_available() else 'skipped (no CUDA device)'}"
