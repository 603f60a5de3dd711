"""The ``ropekv`` command line on the CPU: help, version, argument ranges, the demo on the NumPy
backend, and a plain "no GPU / no CUDA driver" message where CUDA is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

import ropekv
from ropekv import _demo, _info, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_DRIVER = "no GPU / no CUDA driver found"


def run_ropekv(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "ropekv", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def usage_error(argv, capsys):
    """The stderr of an argparse usage error (exit code 2) for ``ropekv argv``."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ---- help and version ----------------------------------------------------------------------------


def test_bare_ropekv_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ropekv")
    for command in ("info", "demo", "bench", "check"):
        assert command in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ropekv {ropekv.__version__}"


@pytest.mark.parametrize("argv", [[], ["info"], ["demo"], ["bench"], ["check"]])
def test_help_is_plain_text(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ropekv")
    assert "``" not in out and ":func:" not in out


# ---- ropekv demo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", ["-1", str(_demo.MAX_STEPS + 1), "300"])
def test_demo_steps_out_of_range_are_usage_errors(steps, capsys):
    err = usage_error(["demo", "--steps", steps], capsys)
    assert f"argument --steps: must be between 0 and {_demo.MAX_STEPS}" in err
    assert f"got {int(steps)}" in err


def test_demo_steps_must_be_an_integer(capsys):
    assert "argument --steps: expected an integer, got '1.5'" in usage_error(
        ["demo", "--steps", "1.5"], capsys
    )


def test_demo_steps_range_ends_are_accepted():
    for steps in (0, _demo.MAX_STEPS):
        assert cli.build_parser().parse_args(["demo", "--steps", str(steps)]).steps == steps


def test_demo_limit_fits_the_cache():
    assert _demo.PROMPT + _demo.MAX_STEPS == _demo.CAPACITY


@pytest.mark.parametrize("steps", [0, 2])
def test_demo_runs_on_the_numpy_backend(steps, capsys):
    assert _demo.demo(backend="numpy", steps=steps) == 0
    out = capsys.readouterr().out
    assert "demo passed" in out and "MISMATCH" not in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("prefill", "decode"))]
    assert rows == ["prefill", "decode"] * 2 if steps else ["prefill"] * 2


def test_demo_rejects_steps_outside_the_cache():
    with pytest.raises(ValueError, match=f"between 0 and {_demo.MAX_STEPS}.*got -1"):
        _demo.demo(backend="numpy", steps=-1)


def test_demo_backend_cuda_without_a_device_says_why(monkeypatch):
    monkeypatch.setattr(_info, "device_state", lambda: (None, 0, NO_DRIVER))
    with pytest.raises(SystemExit, match=f"--backend cuda: {NO_DRIVER}"):
        _demo.demo(backend="cuda")


# ---- no GPU, no driver ---------------------------------------------------------------------------


def fake_cupy(driver, runtime=12090, count=None, status=None):
    """A stand-in for ``cupy`` whose runtime reports ``driver`` and either ``count`` devices or a
    CUDA error with ``status``."""

    class CUDARuntimeError(RuntimeError):
        def __init__(self):
            super().__init__(f"cudaError {status}")
            self.status = status

    def get_device_count():
        if count is None:
            raise CUDARuntimeError()
        return count

    rt = types.SimpleNamespace(
        driverGetVersion=lambda: driver,
        runtimeGetVersion=lambda: runtime,
        getDeviceCount=get_device_count,
    )
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))


@pytest.mark.parametrize(
    "cupy, want",
    [
        (fake_cupy(driver=0, status=35), NO_DRIVER),
        (
            fake_cupy(driver=12020, runtime=13000, status=35),
            "the CUDA driver (12.2) is older than CuPy's CUDA runtime (13.0): install ropekv[cuda12]",
        ),
        (
            fake_cupy(driver=13000, runtime=13020, status=35),
            "the CUDA driver (13.0) is older than CuPy's CUDA runtime (13.2): update the driver",
        ),
        (fake_cupy(driver=13000, status=100), "no GPU found (the CUDA driver sees no device)"),
        (fake_cupy(driver=13000, count=0), "no GPU found (the CUDA driver sees no device)"),
        (fake_cupy(driver=13000, status=999), "no usable GPU (CUDARuntimeError: cudaError 999)"),
    ],
)
def test_device_state_reasons(cupy, want, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    module, count, why = _info.device_state()
    assert module is cupy and count == 0
    assert why.startswith(want), why


def test_device_state_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    module, count, why = _info.device_state()
    assert module is None and count == 0 and "CuPy is not installed" in why


@pytest.mark.parametrize(
    "command, needs",
    [("bench", "the benchmark needs a CUDA GPU"), ("check", "it needs a CUDA GPU")],
)
def test_bench_and_check_without_a_driver(command, needs, monkeypatch, capsys):
    monkeypatch.setattr(_info, "device_state", lambda: (None, 0, NO_DRIVER))
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert f"ropekv {command}: no CUDA device found; {needs}" in err
    assert f"reason: {NO_DRIVER}" in err


def test_info_without_a_driver(monkeypatch, capsys):
    monkeypatch.setattr(_info, "device_state", lambda: (None, 0, NO_DRIVER))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"none: {NO_DRIVER}" in out
    assert "NumPy reference (no CUDA device)" in out


def test_this_machine_without_a_driver_gets_the_plain_message():
    """Through the console command, where this machine really has no CUDA driver."""
    cupy = pytest.importorskip("cupy")
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
    except Exception:  # noqa: BLE001
        driver = 0
    if driver:
        pytest.skip("this machine has a CUDA driver")
    out = run_ropekv("info")
    assert out.returncode == 0 and NO_DRIVER in out.stdout, out.stdout + out.stderr
    for command in ("bench", "check"):
        out = run_ropekv(command)
        assert out.returncode == 1 and NO_DRIVER in out.stderr, out.stderr
        assert "cudaError" not in out.stdout + out.stderr


# ---- bench arguments checked before the run -----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--json", "/nonexistent-dir/x.json"], "argument --json: cannot write"),
        (["--json", "."], "argument --json: . is a directory"),
        (["--plot", "/nonexistent-dir/x.png"], "argument --plot: cannot write"),
        (["--tune", "qknorm.block='x'"], "expected an integer between 1 and 1024"),
        (["--tune", "paged.heavy=(0,0,0)"], "a tuple of 3 positive integers"),
        (["--tune", "paged.light=(1,1)"], "a tuple of 3 positive integers"),
        (["--tune", "contiguous.block=-1"], "expected an integer between 1 and 1024"),
        (["--tune", "paged.row_group=-1"], "expected an integer at least 0"),
        (["--tune", "mla.wave_blocks=1e999"], "mla.wave_blocks=inf: expected an integer"),
        (["--tune", "qkv.FAST_INT4=1"], "expected True or False"),
        (["--tune", "paged.heavy=(2,2,3)", "qkv.GEMV_MAX_TOKENS=-1"], "GEMV_MAX_TOKENS=-1"),
    ],
)
def test_bench_arguments_are_usage_errors_before_the_run(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(_info, "device_state", lambda: pytest.fail("ran past the arguments"))
    err = usage_error(["bench", *argv], capsys)
    assert message in err and "Traceback" not in err


def test_bench_arguments_that_are_fine(tmp_path):
    out = tmp_path / "out.json"
    args = cli.build_parser().parse_args(
        ["bench", "--json", str(out), "--tune", "paged.row_group=0", "paged.heavy=(2,2,3)"]
    )
    assert args.json == str(out) and not out.exists() and not list(tmp_path.iterdir())
    assert args.tune == ["paged.row_group=0", "paged.heavy=(2,2,3)"]
