"""The two examples of docs/frameworks.md run as written and print what the page says (on the GPU
as written; on the CPU with the torch example's device switched to "cpu")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import sanitizer

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "frameworks.md").read_text()
TORCH_CODE, JAX_CODE = re.findall(r"```python\n(.*?)```", PAGE, re.DOTALL)
TORCH_PRINTS = [
    "torch.Size([8, 32, 128]) torch.float8_e4m3fn cache rows written: 32",
    "graphs compiled: 1",
]
JAX_PRINTS = [
    "(8, 32, 128) float8_e4m3fn same cache buffer: True",
    "(8, 8, 32, 128) cache rows written: 96",
]


def run(code, env=None):
    if "torch" in code and sanitizer.active():
        code = sanitizer.TORCH_SETUP + code
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_the_page_says_what_the_examples_print():
    for line in TORCH_PRINTS + JAX_PRINTS:
        assert f"`{line}`" in PAGE


def test_torch_example_on_the_cpu():
    pytest.importorskip("torch")
    code = TORCH_CODE.replace('device = "cuda"', 'device = "cpu"')
    assert run(code) == TORCH_PRINTS


def test_jax_example_on_the_cpu():
    pytest.importorskip("jax.experimental.buffer_callback")
    assert run(JAX_CODE, {"JAX_PLATFORMS": "cpu"}) == JAX_PRINTS


@pytest.mark.gpu
def test_torch_example_as_written():
    pytest.importorskip("torch")
    assert run(TORCH_CODE) == TORCH_PRINTS


@pytest.mark.gpu
def test_jax_example_as_written():
    pytest.importorskip("jax.experimental.buffer_callback")
    # asked in a child process: JAX is not started in this one (it would take GPU memory)
    if run("import jax; print(jax.default_backend())") != ["gpu"]:
        pytest.skip("JAX has no GPU backend here")
    assert run(JAX_CODE, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == JAX_PRINTS
