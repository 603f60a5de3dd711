"""Shared test setup: hypothesis profiles and the ``gpu`` marker (skipped without a device)."""

from __future__ import annotations

import functools
import os

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
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"ropekv GPU tests: {'enabled' if gpu_available() else 'skipped (no CUDA device)'}"
