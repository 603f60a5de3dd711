"""The C replay of launch plans (``ropekv/_native.c``) against the Python one, on a CPU: the same
launches, byte for byte, for every op and array kind; the driver's errors; the device switch;
threads; the calls it hands back to Python. ``tests/test_replay_cpu.py`` runs its tests with both
replays too. The fakes (arrays at fake device addresses, a stubbed driver) are those of
``tools/hostcost.py``."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import ropekv.qkv
from ropekv import _launch, _native
from tests.test_call_path import CACHE, CASES, OPS, map_arrays
from tests.test_replay_cpu import (
    _C_LAUNCH,
    DECODE,
    FAKE_CUBLAS_HANDLE,
    PREFILL,
    Gemms,
    all_ops,
    fake_torch,
    hostcost,
    set_known_type,
)

_C_LAUNCH_EX = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)


_Config = _launch._LaunchConfig  # CUlaunchConfig, as the Python replay spells it


class Recorder:
    """Both launch entry points of the driver, for both replays: each launch as (function, grid,
    block, shared memory, stream, attributes, record bytes)."""

    def __init__(self, record_size):
        self.size = record_size  # bytes of the records compared
        self.launches = []
        self.fail = 0
        self.c_launch = _C_LAUNCH(self._c)
        self.c_launch_ex = _C_LAUNCH_EX(self._c_ex)

    def _record(self, func, grid, block, smem, stream, attrs, params):
        rec = ctypes.c_uint64.from_address(params).value
        self.launches.append(
            (
                func,
                tuple(grid),
                tuple(block),
                smem,
                stream or 0,
                attrs,
                ctypes.string_at(rec, self.size),
            )
        )

    def python(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv_ptr, extra):
        self._record(func, (gx, gy, gz), (bx, by, bz), smem, stream, (), argv_ptr)
        if self.fail:
            from cupy_backends.cuda.api.driver import CUDADriverError

            raise CUDADriverError(self.fail)

    def _c(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self._record(func, (gx, gy, gz), (bx, by, bz), smem, stream, (), params)
        return self.fail

    def _attrs(self, config):
        return tuple(
            (config.attrs[k].id, config.attrs[k].value[:4]) for k in range(config.num_attrs)
        )

    def python_ex(self, config_ref, func, argv, extra):
        config = config_ref._obj
        self._record(
            func,
            config.grid,
            config.block,
            config.shared_mem,
            config.stream,
            self._attrs(config),
            ctypes.addressof(argv),
        )
        return self.fail

    def _c_ex(self, config_ptr, func, params, extra):
        config = _Config.from_address(config_ptr)
        self._record(
            func,
            config.grid,
            config.block,
            config.shared_mem,
            config.stream,
            self._attrs(config),
            params,
        )
        return self.fail


class _Runtime:
    """CuPy's runtime functions of the current device, with a log of device switches."""

    def __init__(self, current=0):
        self.current, self.log = current, []

    def getDevice(self):
        return self.current

    def setDevice(self, device):
        self.log.append(device)
        self.current = device


@pytest.fixture
def fakes(monkeypatch):
    """The fakes of tools/hostcost.py, every op cleared; yields a function that selects the
    replay (``"c"`` / ``"python"``) with a :class:`Recorder` behind both launch functions."""
    for op in all_ops():
        op.clear()

    runtime = _Runtime()
    set_known_type(monkeypatch, 0, hostcost.FakeCupyArray)
    # a Hopper GPU, as tools/hostcost.py's stubs say (the QKV op's plans ask)
    monkeypatch.setattr(ropekv.qkv, "_compute_capability", lambda device: 90)
    monkeypatch.setattr(ropekv.qkv, "_sm_count", lambda device: 132)
    monkeypatch.setattr(ropekv.qkv, "_active_clusters", lambda *a: None)  # (no driver)
    monkeypatch.setattr(_launch, "function_pointer", lambda *a, **k: 0x1000)
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device=-1: 0x5000)
    monkeypatch.setattr(_launch, "_RUNTIME", [runtime])
    monkeypatch.setattr(_launch, "_EMPTY_OUTPUTS", {})  # fake zero-size outputs stay here
    monkeypatch.setattr(
        _launch.Output,
        "_cupy",
        lambda self: hostcost.FakeCupyArray(np.empty(self.shape, self.dtype)),
    )
    monkeypatch.setattr(_launch, "cupy_stream", lambda ptr, device: contextlib.nullcontext())
    module = _native.load()
    if module is None:
        pytest.fail(f"the C replay did not build: {_native.state()}")
    recorder = Recorder(0)
    recorder.gemms = Gemms()
    recorder.gemms.install(monkeypatch)

    def select(replay):
        monkeypatch.setattr(_launch, "_launch_kernel", recorder.python)
        monkeypatch.setattr(_launch, "_cu_launch_kernel_ex", lambda: recorder.python_ex)
        launchers = tuple(
            ctypes.cast(f, ctypes.c_void_p).value for f in (recorder.c_launch, recorder.c_launch_ex)
        )
        monkeypatch.setattr(_launch, "_native_launchers", lambda: launchers)
        _launch._native_module[0] = _launch._UNBOUND
        for op in all_ops():
            op.reset_caller(native=replay != "python")
        return recorder

    select.runtime = runtime
    yield select
    for op in all_ops():
        op.clear()
        op.reset_caller()
    _launch._native_module[0] = _launch._UNBOUND


def _record_size(op_name):
    """The largest parameter record of the op's plans (compared byte for byte)."""
    return max(
        len(s.rec)
        for op in all_ops()
        for table in (op.plans, op.layer_plans)
        for p in table.values()
        for s in p.steps
        if type(s) is _launch.Launch
    )


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("stream", [None, 0x6000])
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("op", [*OPS, "qkv prefill", "qkv prefill e4m3"])
def test_c_replay_launches_what_the_python_replay_launches(
    op, kind, stream, pdl, fakes, monkeypatch
):
    """Same arrays, same outputs' addresses: the same launches, record bytes included, and the
    same cuBLAS calls (the QKV op's prefill path: one GEMM, or two with an fp8 cache)."""
    op, *path = op.split()
    convert = hostcost.to_cupy
    if kind == "torch":
        if importlib.util.find_spec("torch") is None:
            fake_torch(monkeypatch)
        else:
            pytest.skip("torch is installed: its tensors are tested on the GPU")
        convert = hostcost.to_torch
    if path:
        monkeypatch.setattr(ropekv.qkv, "_compute_capability", lambda device: 90)
        cache_dtype = _launch.ar.FLOAT8_E4M3FN if path[1:] == ["e4m3"] else None
        fn, kw = CASES[op](51, **PREFILL[op], cache_dtype=cache_dtype)
    else:
        fn, kw = CASES[op](51, **DECODE.get(op, {}))
    extra = {"enable_pdl": True} if pdl else {}
    if kind == "torch":  # outputs allocated on an explicit stream
        torch = sys.modules["torch"]
        monkeypatch.setattr(
            torch,
            "cuda",
            types.SimpleNamespace(
                stream=lambda s: contextlib.nullcontext(),
                ExternalStream=lambda ptr, device=None: ptr,
            ),
            raising=False,
        )
        monkeypatch.setattr(torch, "device", lambda *a: a, raising=False)
    if stream is not None:
        extra["stream"] = stream
    recorder = fakes("c")
    fn(**map_arrays(kw, convert), **extra)  # the first call plans (and launches in Python)
    recorder.size = _record_size(op)
    (plan,) = [p for o in all_ops() for p in o.plans.values()]
    assert plan.native is not None  # the C replay serves every step, cuBLAS GEMMs included
    gemm_steps = sum(type(s) is _launch.Gemm for s in plan.steps)
    assert gemm_steps == (0 if not path else 1 if len(path) == 1 else 2)
    second = map_arrays(kw, convert)
    gemms = recorder.gemms.calls
    mark = hostcost._Memory.next  # the outputs of both replays get the same fake addresses
    start, gemm_start = len(recorder.launches), len(gemms)
    fn(**second, **extra)
    by_c, gemms_by_c = recorder.launches[start:], gemms[gemm_start:]
    fakes("python")  # the plan of the first call, replayed in Python
    hostcost._Memory.next = mark
    start, gemm_start = len(recorder.launches), len(gemms)
    fn(**second, **extra)
    by_python, gemms_by_python = recorder.launches[start:], gemms[gemm_start:]
    assert by_c and by_c == by_python
    assert gemms_by_c == gemms_by_python
    expected_stream = stream if stream is not None else 0x7000 if kind == "torch" else 0x5000
    assert all(launch[4] == expected_stream for launch in by_c)
    assert all(bool(launch[5]) == pdl for launch in by_c)
    # each GEMM: the launch stream on the thread's handle, host pointer mode, then cublasGemmEx
    # with alpha 1, beta 0, float32 accumulation and the default algorithm
    assert len(gemms_by_c) == 3 * gemm_steps
    for k in range(gemm_steps):
        stream_call, mode_call, gemm = gemms_by_c[3 * k : 3 * k + 3]
        assert stream_call == ("stream", FAKE_CUBLAS_HANDLE, expected_stream)
        assert mode_call == ("mode", FAKE_CUBLAS_HANDLE, 0)
        assert gemm[:4] == ("gemm", FAKE_CUBLAS_HANDLE, 1, 0)
        assert gemm[7] == 1.0 and gemm[14] == 0.0 and gemm[18:] == (68, -1)


def test_replay_switches_to_the_plan_device_and_back(fakes):
    fn, kw = CASES["qknorm"](52)
    fakes("c")
    dev = map_arrays(kw, hostcost.to_cupy)
    fn(**dev)
    fakes.runtime.current = 3  # another device is current: the plan's (0) is entered and left
    fakes.runtime.log.clear()
    fn(**map_arrays(kw, hostcost.to_cupy))
    assert fakes.runtime.log == [0, 3] and fakes.runtime.current == 3


@pytest.mark.parametrize(("replay", "pdl"), [("c", False), ("c", True), ("python", True)])
def test_a_failed_launch_raises_the_driver_error_and_restores_the_device(fakes, replay, pdl):
    """Both replays raise the same error (the Python replay's launch without PDL goes through
    CuPy's wrapper, which raises CuPy's)."""
    fn, kw = CASES["qknorm"](53)
    recorder = fakes(replay)
    fn(**map_arrays(kw, hostcost.to_cupy), enable_pdl=pdl)
    fakes.runtime.current = 2
    recorder.fail = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    # CuPy's driver error where a driver names the code, else a RuntimeError with the code
    with pytest.raises(RuntimeError, match="CUDA_ERROR_ILLEGAL_ADDRESS|CUresult 700"):
        fn(**map_arrays(kw, hostcost.to_cupy), enable_pdl=pdl)
    assert fakes.runtime.current == 2 and fakes.runtime.log == [0, 2]


@pytest.mark.parametrize("replay", ["c", "python"])
def test_a_failed_cublas_call_raises_its_status_and_restores_the_device(fakes, replay, monkeypatch):
    monkeypatch.setattr(ropekv.qkv, "_compute_capability", lambda device: 90)
    fn, kw = CASES["qkv"](56, **PREFILL["qkv"])
    recorder = fakes(replay)
    fn(**map_arrays(kw, hostcost.to_cupy))
    launched = len(recorder.launches)
    fakes.runtime.current = 2
    recorder.gemms.fail = 13  # CUBLAS_STATUS_EXECUTION_FAILED
    # CuPy's cuBLAS error where CuPy's cuBLAS loads, else a RuntimeError with the status
    with pytest.raises(Exception, match="CUBLAS_STATUS_EXECUTION_FAILED|status 13"):
        fn(**map_arrays(kw, hostcost.to_cupy))
    assert fakes.runtime.current == 2 and fakes.runtime.log == [0, 2]
    assert len(recorder.launches) == launched  # the epilogue after the GEMM never launched


def test_two_threads_replay_one_plan_with_their_own_pointers(fakes):
    fn, kw = CASES["paged"](54)
    recorder = fakes("c")
    fn(**map_arrays(kw, hostcost.to_cupy))
    recorder.size = _record_size("paged")
    (plan,) = [p for o in all_ops() for p in o.plans.values()]
    n_ptr = plan.steps[0].n_ptr
    calls, errors = [], []

    def work():
        try:
            for _ in range(50):
                arrays = map_arrays(kw, hostcost.to_cupy)
                calls.append(
                    [(a.data.ptr, a.data.ptr + a.size * a.itemsize) for a in _flat_any(arrays)]
                )
                fn(**arrays)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(recorder.launches) == 1 + 4 * 50 * len(plan.steps)
    # each launch's pointer fields lie in the arrays of one call: no record mixes two calls
    # (fields in no call's arrays, such as allocated outputs, say nothing)
    for launch in recorder.launches[1:]:
        fields = np.frombuffer(launch[6][: 8 * n_ptr], np.uint64).tolist()
        owners = None
        for f in fields:
            mine = {k for k, spans in enumerate(calls) if any(lo <= f <= hi for lo, hi in spans)}
            if mine:
                owners = mine if owners is None else owners & mine
        assert owners, "a record holds pointers of two calls"


def test_an_array_of_another_kind_takes_the_python_path(fakes):
    module = _native.load()
    caller = module.Caller(("a", "b"), None, _launch.native_hooks(), _launch._MISS)
    plans = _launch._Plans()
    assert caller((None, np.zeros(3)), (), None, None, plans) is _launch._MISS
    assert caller([None, None], (), None, None, plans) is _launch._MISS  # not a tuple
    assert caller((None, None), ([],), None, None, plans) is _launch._MISS  # unhashable flags
    new = caller((None, None), (), None, None, plans)  # read whole, no plan yet: its key
    assert type(new) is _launch._NewLayout and new.layout == (None, None)
    a = hostcost.FakeCupyArray(np.zeros((2, 3), np.float16))
    new = caller((a, None), (), None, None, plans)
    assert type(new) is _launch._NewLayout
    assert new.layout == _launch.ar.signature((a, None), ("a", "b"), None)[0]


def test_multi_layer_replay_and_a_layer_out_of_range(fakes):
    fn, kw = CASES["qknorm"](55)
    recorder = fakes("c")
    dev = map_arrays(kw, hostcost.to_cupy)
    k, v = kw["paged_kv_cache"]
    layers = 4
    caches = tuple(hostcost.to_cupy(np.zeros((layers, *c.shape), c.dtype)) for c in (k, v))
    dev["paged_kv_cache"] = caches
    fn(**dev, layer_idx=1)
    recorder.size = _record_size("qknorm")
    plan = next(iter(next(o for o in all_ops() if o.layer_plans).layer_plans.values()))
    assert plan.native is not None
    k_cache = next(o for o in all_ops() if o.layer_plans).names.index("k_cache")
    slot = [i for i, (arg, _) in enumerate(plan.steps[0].slots) if arg == k_cache]
    assert slot, "the k cache's pointer field"
    for layer in (3, 0, 2):
        start = len(recorder.launches)
        fn(**dev, layer_idx=layer)
        field = np.frombuffer(recorder.launches[start][6][: 8 * (slot[0] + 1)], np.uint64)[-1]
        stride = caches[0].strides[0]
        assert field == caches[0].data.ptr + layer * stride + plan.steps[0].slots[slot[0]][1]
    with pytest.raises(ValueError, match="layer_idx"):
        fn(**dev, layer_idx=layers)


def test_native_source_compiles_cleanly(tmp_path):
    """The C replay builds without a warning (``-Wall -Wextra -Werror``) where there is a C
    compiler and Python's headers (CI's machine has both)."""
    include = sysconfig.get_paths()["include"]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: ropekv replays plans in Python here")
    out = tmp_path / "ext.so"
    done = subprocess.run(
        [
            cc,
            "-O2",
            "-std=c11",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unused-parameter",
            "-Wno-missing-field-initializers",
            "-Wno-cast-function-type",
            f"-I{include}",
            str(_native._SOURCE),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_native_off_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ROPEKV_NATIVE", "0")
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_state", {"module": None, "reason": "", "path": None})
    assert _native.load() is None
    assert "ROPEKV_NATIVE=0" in _native.state()


def test_scalar_arguments_the_c_replay_does_not_take_as_they_come(fakes):
    """A bool flag given as ``numpy.bool_`` or a key given as a list is normalized in Python (and
    replays the same plan); a bad one raises as on the first call, whichever replay runs."""
    fn, kw = CASES["qknorm"](56)
    recorder = fakes("c")
    fn(**map_arrays(kw, hostcost.to_cupy), is_neox=True, epsilon=1e-5)
    recorder.size = _record_size("qknorm")
    (op,) = [o for o in all_ops() if o.plans]
    dev = map_arrays(kw, hostcost.to_cupy)
    mark = hostcost._Memory.next
    start = len(recorder.launches)
    fn(**dev, is_neox=True, epsilon=1e-5)  # the C replay
    hostcost._Memory.next = mark
    fn(**dev, is_neox=np.bool_(True), epsilon=1e-5)  # normalized in Python: the same plan
    assert len(op.plans) == 1
    n = (len(recorder.launches) - start) // 2
    assert n and recorder.launches[start : start + n] == recorder.launches[start + n :]
    with pytest.raises(TypeError, match="is_neox must be a bool"):
        fn(**dev, is_neox=1, epsilon=1e-5)
    with pytest.raises(TypeError, match="enable_pdl must be a bool"):
        fn(**dev, is_neox=True, epsilon=1e-5, enable_pdl="yes")
    assert len(op.plans) == 1


def test_without_cuLaunchKernelEx_pdl_plans_replay_in_python(fakes, monkeypatch):
    """An old driver (no ``cuLaunchKernelEx``): plans that launch with programmatic dependent
    launch stay with the Python replay, the others take the C one."""
    recorder = fakes("c")
    address = ctypes.cast(recorder.c_launch, ctypes.c_void_p).value
    monkeypatch.setattr(_launch, "_native_launchers", lambda: (address, None))
    fn, kw = CASES["qknorm"](57)
    fn(**map_arrays(kw, hostcost.to_cupy), enable_pdl=True)
    fn(**map_arrays(kw, hostcost.to_cupy), enable_pdl=False)
    plans = {p.steps[0].pdl: p for o in all_ops() for p in o.plans.values()}
    assert plans[True].native is None and plans[False].native is not None
    start = len(recorder.launches)
    fn(**map_arrays(kw, hostcost.to_cupy), enable_pdl=True)  # the Python replay's launch
    assert len(recorder.launches) == start + len(plans[True].steps)


# ---- GPU: the C replay on a real device ---------------------------------------------------------


def _device_ops():
    import ropekv

    return [
        v
        for m in (ropekv.contiguous, ropekv.paged, ropekv.mla, ropekv.qknorm, ropekv.qkv)
        for v in vars(m).values()
        if isinstance(v, _launch.Op)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("op", [*OPS, "qkv prefill"])
def test_gpu_replays_in_c_and_matches_the_reference_and_the_python_replay(op, kind):
    """On a GPU machine with a C compiler the replay of every op runs in C (a build that fails
    there would quietly cost microseconds per call: this test says so instead), the QKV op's
    cuBLAS path included; its outputs equal the NumPy backend's and, bit for bit, the Python
    replay's."""
    from tests.test_call_path import assert_same, copy_kw
    from tests.tolerance import to_device, to_numpy

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: ropekv replays plans in Python here")
    convert = to_device
    if kind == "torch":
        torch = pytest.importorskip("torch")
        from ropekv.bench import torch_view

        convert = lambda x: torch_view(to_device(x))
        sync = torch.cuda.synchronize
    else:
        import cupy

        sync = cupy.cuda.runtime.deviceSynchronize
    op, *path = op.split()
    fn, kw = CASES[op](60, **(PREFILL if path else DECODE).get(op, {}))
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    for o in _device_ops():  # plans of earlier tests may predate a reset of their op's replay
        o.clear()
    fn(**map_arrays(copy_kw(kw), convert))  # plans
    by_c = map_arrays(copy_kw(kw), convert)
    out_c = fn(**by_c)
    sync()
    ops = [o for o in _device_ops() if o.plans]
    assert ops and all(o.caller is not None for o in ops), _native.state()
    assert all(p.native is not None for o in ops for p in o.plans.values()), _native.state()
    if path:
        assert any(type(s) is _launch.Gemm for o in ops for p in o.plans.values() for s in p.steps)
    assert_same(by_c, out_c, expected, out_expected, op)
    try:
        for o in _device_ops():
            o.reset_caller(native=False)
        by_python = map_arrays(copy_kw(kw), convert)
        out_python = fn(**by_python)
        sync()
    finally:
        for o in _device_ops():
            o.reset_caller()
    for a, b in zip(_flat_any((by_c, out_c)), _flat_any((by_python, out_python))):
        a, b = (np.ascontiguousarray(to_numpy(x)) for x in (a, b))
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _flat_any(x):
    if x is None or isinstance(x, (str, bytes, int, float, bool)):
        return
    if isinstance(x, dict):
        for k in sorted(x):
            yield from _flat_any(x[k])
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _flat_any(y)
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        yield x


@pytest.mark.parametrize("c_launches", [True, False])
def test_a_layer_that_changes_alignment_is_planned_again_in_python(fakes, monkeypatch, c_launches):
    """Caches whose layer stride is no multiple of 16 bytes: a layer of another alignment than
    the planned one is validated again (its vector widths may differ), never replayed, whether
    or not the plan has launches in C."""
    fn, kw = CASES["qknorm"](58)
    fakes("c")
    dev = map_arrays(kw, hostcost.to_cupy)
    layers = 9
    caches = []
    for c in kw["paged_kv_cache"]:
        per = c.size + 1  # one element of padding per layer: a 2-byte shift for fp16
        flat = np.zeros(layers * per, c.dtype)
        view = np.lib.stride_tricks.as_strided(
            flat, (layers, *c.shape), (per * c.itemsize, *c.strides)
        )
        caches.append(hostcost.to_cupy(view))
    dev["paged_kv_cache"] = tuple(caches)
    fn(**dev, layer_idx=0)
    (op,) = [o for o in all_ops() if o.layer_plans]
    (plan,) = op.layer_plans.values()
    assert plan.layers.strict
    if not c_launches:
        plan.native = None
    firsts = []
    first_call = _launch.Op.first_call
    monkeypatch.setattr(
        _launch.Op,
        "first_call",
        lambda self, *a, **k: firsts.append(a[-1]) or first_call(self, *a, **k),
    )
    for layer in (1, 8, 2):  # layer 8 starts 8 * 2 bytes on from layer 0's alignment: a replay
        fn(**dev, layer_idx=layer)
    assert firsts == [1, 2]


def _struct_probe_cases(cupy):
    """CuPy arrays of every layout a caller can make (the probe's own are in _native._probes)."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    base = cupy.zeros((6, 5, 8, 3), cupy.float32)
    cases = [
        base,
        base[1:4],
        base[:, ::2],
        base[..., 1],
        base[2, 3, 4, 1],
        base.T,
        base[::-1, :, ::-3],
        cupy.zeros((0,), cupy.int64),
        cupy.zeros((3, 0, 2), cupy.uint8),
        cupy.broadcast_to(base[0, 0, 0], (7, 3)),
        cupy.zeros(5, cupy.bool_),
        cupy.zeros((4, 64), cupy.uint8)[1:, 16:].view(ml_dtypes.float8_e5m2),
        cupy.asfortranarray(cupy.zeros((3, 4), cupy.float16)),
    ]
    for _ in range(20):  # random slices of a random-rank array
        ndim = int(rng.integers(1, 6))
        a = cupy.zeros(tuple(int(x) for x in rng.integers(1, 6, ndim)), cupy.float16)
        cases.append(
            a[
                tuple(
                    slice(int(rng.integers(0, n)), None, int(rng.choice([1, 2, -1])))
                    for n in a.shape
                )
            ]
        )
    return cases


@pytest.mark.gpu
def test_gpu_cupy_arrays_are_read_from_their_struct_as_their_attributes_give():
    """On a GPU machine the C replay reads CuPy arrays from their struct (the probe found the
    offsets and checked them), and those reads equal the attributes on every layout; other types,
    subclasses of ``cupy.ndarray`` included, are not read that way."""
    cupy = pytest.importorskip("cupy")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: ropekv replays plans in Python here")
    module = _launch.native_module()
    assert module is not None, _native.state()
    assert _native._state["cupy"] is None, _native.state()
    for a in _struct_probe_cases(cupy):
        assert module.raw_layout(a) == (a.shape, a.strides, a.dtype, a.data.ptr, -1), (
            a.shape,
            a.strides,
        )
        assert module.view_fields(a) == _fields(
            a.data.ptr,
            a.shape,
            [s // a.itemsize for s in a.strides],
            a.dtype,
            a.data.device_id,
            a.itemsize,
        )
    odd = cupy.lib.stride_tricks.as_strided(cupy.zeros(8, cupy.float16), (3,), (3,))
    assert module.view_fields(odd) is None  # a byte stride the attributes path names in its error

    class Sub(cupy.ndarray):
        pass

    assert module.raw_layout(cupy.zeros(3).view(Sub)) is None
    assert module.raw_layout(np.zeros(3)) is None
    assert module.raw_layout(None) is None


@pytest.mark.gpu
def test_gpu_struct_reads_turned_off_by_environment_are_off(monkeypatch):
    """``ROPEKV_NATIVE_CUPY=0`` turns struct reads that were on off (the C replay reads CuPy
    arrays through their attributes), and a probe without it turns them on again."""
    cupy = pytest.importorskip("cupy")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: ropekv replays plans in Python here")
    module = _launch.native_module()
    assert module is not None, _native.state()
    a = cupy.zeros((4, 3), cupy.float16)[1:]
    assert module.raw_layout(a) is not None, _native.state()
    monkeypatch.setenv("ROPEKV_NATIVE_CUPY", "0")
    try:
        _native.configure_cupy_reads(module)
        assert module.raw_layout(a) is None
        assert "ROPEKV_NATIVE_CUPY=0" in _native.state()
    finally:
        monkeypatch.delenv("ROPEKV_NATIVE_CUPY")
        _native.configure_cupy_reads(module)
    assert module.raw_layout(a) == (a.shape, a.strides, a.dtype, a.data.ptr, -1), _native.state()


@pytest.mark.gpu
def test_gpu_replay_sees_a_cupy_array_reshaped_in_place():
    """A CuPy array's shape set in place between two calls (``a.shape = ...``) reaches the replay
    (it reads the struct on every call, it keeps nothing of an array between calls): the new
    layout is validated, and refused, instead of replaying the old plan."""
    cupy = pytest.importorskip("cupy")
    from tests.test_call_path import copy_kw
    from tests.tolerance import to_device

    for o in _device_ops():
        o.clear()
    fn, kw = CASES["paged"](61, **DECODE.get("paged", {}))
    args = map_arrays(copy_kw(kw), to_device)
    fn(**args)
    fn(**args)  # a replay
    cupy.cuda.runtime.deviceSynchronize()
    q = args["q_rope"]
    T, H, R = q.shape
    q.shape = (T * H, R)
    with pytest.raises(ValueError, match="q_rope"):
        fn(**args)
    q.shape = (T, H, R)
    fn(**args)
    cupy.cuda.runtime.deviceSynchronize()


def test_struct_reads_off_by_environment(monkeypatch):
    """``ROPEKV_NATIVE_CUPY=0`` keeps the C replay on the arrays' attributes, and says so (the
    GPU test above checks the reads themselves)."""
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    monkeypatch.setenv("ROPEKV_NATIVE_CUPY", "0")
    monkeypatch.setitem(_native._state, "cupy", None)
    try:
        _native.configure_cupy_reads(module)
        assert "ROPEKV_NATIVE_CUPY=0" in _native.state()
    finally:
        monkeypatch.delenv("ROPEKV_NATIVE_CUPY")
        _launch._native_module[0] = _launch._UNBOUND  # probed again by the next device call


def test_struct_reads_refuse_offsets_outside_the_struct():
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    with pytest.raises(ValueError, match="outside the struct"):
        module.configure_cupy(np.ndarray, np.ndarray, 4096, 40, 48, 56, 16)
    module.configure_cupy(None)


# ---- torch tensors read from their TensorImpl -------------------------------------------------


def _torch_cases(torch, device):
    """torch tensors of every layout a caller can make (the probe's own are in
    _native._torch_probes): views, permutations, stride 0, 0-d, empty, 5 to 8 dimensions, every
    dtype ropekv reads, random slices."""
    from ropekv import _arrays

    rng = np.random.default_rng(11)
    base = torch.zeros((6, 5, 8, 3), device=device)
    cases = [
        base,
        base[1:4],
        base[:, ::2],
        base[..., 1],
        base[2, 3, 4, 1],
        base.permute(3, 1, 0, 2),
        base.mT,
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros((3, 0, 2), dtype=torch.uint8, device=device),
        base[0, 0, 0].expand(7, 3),
        torch.zeros((2, 3, 2, 3, 2), device=device)[:, 1:],
        torch.zeros((2,) * 8, dtype=torch.float16, device=device).permute(7, 6, 5, 4, 3, 2, 1, 0),
        torch.zeros((4, 64), dtype=torch.uint8, device=device)[1:, 16:].view(torch.float8_e5m2),
    ]
    cases += [
        torch.zeros(8, dtype=getattr(torch, name), device=device)[1:]
        for name in _arrays._TORCH_NAMES
        if hasattr(torch, name)
    ]
    for _ in range(20):  # random slices of a random-rank tensor
        ndim = int(rng.integers(1, 7))
        a = torch.zeros(
            tuple(int(x) for x in rng.integers(1, 6, ndim)), dtype=torch.bfloat16, device=device
        )
        cases.append(
            a[
                tuple(
                    slice(int(rng.integers(0, n)), None, int(rng.choice([1, 2, 3])))
                    for n in a.shape
                )
            ]
        )
    return cases


def _attributes(t):
    return tuple(t.shape), t.stride(), t.dtype, t.data_ptr(), t.get_device()


@contextlib.contextmanager
def _torch_reads_on(module, device):
    """The struct reads of torch tensors probed on ``device`` (a CPU works as well as a GPU: the
    TensorImpl is one C++ class), off again afterwards (probed again by the next device call)."""
    try:
        _native.configure_torch_reads(module, device)
        yield
    finally:
        _native.configure_torch_reads(module, None)
        _launch._torch_probed[0] = False


def _fields(ptr, shape, strides, dtype, device, itemsize):
    """What view_fields must give for a layout (element strides), as _arrays computes it."""
    from ropekv import _arrays

    size, span = _arrays._extent(shape, strides, itemsize)
    return (ptr, tuple(shape), tuple(strides), dtype, device, size, *span)


def _check_torch_reads(module, torch, device):
    for t in _torch_cases(torch, device):
        assert module.raw_layout(t) == _attributes(t), (t.shape, t.stride(), t.dtype)
        assert module.view_fields(t) == _fields(
            t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device(), t.element_size()
        )
    t = torch.zeros((4, 6), device=device)
    swapped = torch.zeros((3, 2), dtype=torch.float16, device=device)[1:]
    t.data = swapped  # same object, another storage and layout: read as it is now
    assert module.raw_layout(t) == _attributes(swapped)
    t.as_strided_((2, 2), (1, 2), 1)
    assert module.raw_layout(t) == _attributes(t)

    # left to the attributes: another type, a tensor that must not be written, copy-on-write
    # storage (data_ptr() copies it first), an inference tensor, a lazy negation
    refused = [torch.nn.Parameter(torch.zeros(3, device=device)), torch.zeros(3, device=device)]
    torch._C._set_throw_on_mutable_data_ptr(refused[1])
    shared = torch.zeros(5, device=device)
    refused += [shared, torch._lazy_clone(shared), torch._neg_view(torch.zeros(3, device=device))]
    with torch.inference_mode():
        refused.append(torch.zeros(3, device=device))
    for t in refused:
        assert module.raw_layout(t) is None, t


def test_torch_struct_reads_equal_the_attributes():
    """The offsets of a torch tensor's fields are found on tensors the probe makes (here on the
    CPU; the TensorImpl is the same class on a GPU), and the C reads give what the attributes do on
    every layout, a tensor whose ``.data`` was swapped or which was restrided in place included;
    the tensors whose pointer only ``data_ptr()`` may give are left to the attributes."""
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    with _torch_reads_on(module, "cpu"):
        assert _native._state["torch"] is None, _native.state()
        assert "torch tensors read from their TensorImpl" in _native.state()
        _check_torch_reads(module, torch, "cpu")
    assert module.raw_layout(torch.zeros(3)) is None


def test_torch_struct_reads_off_by_environment(monkeypatch):
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    monkeypatch.setenv("ROPEKV_NATIVE_TORCH", "0")
    with _torch_reads_on(module, "cpu"):
        assert "ROPEKV_NATIVE_TORCH=0" in _native.state()
        assert module.raw_layout(torch.zeros(3)) is None


def test_torch_struct_reads_refuse_offsets_outside_the_struct():
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    good = (16, 16, 56, 5, 144, 152, 160, 162, 168, 16, 59)
    for at, bad in [(0, 8), (0, 4096), (2, 1020), (3, 0), (6, 161), (9, 12)]:
        offsets = list(good)
        offsets[at] = bad
        with pytest.raises(ValueError, match="outside the struct"):
            module.configure_torch(types.SimpleNamespace, tuple(offsets), 0, 1, ())
    module.configure_torch(None)


def test_torch_struct_probe_failure_keeps_the_attributes(monkeypatch):
    """A probe that finds no offset (a torch of another layout) turns nothing on and says why."""
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    monkeypatch.setattr(_native, "_SCAN_BYTES", 16)  # the key set lies further on
    with _torch_reads_on(module, "cpu"):
        assert "key set" in _native._state["torch"]
        assert module.raw_layout(torch.zeros(3)) is None


@pytest.mark.gpu
def test_gpu_torch_tensors_are_read_from_their_tensorimpl():
    """On a GPU machine the first call with torch tensors turns the struct reads on (probed on that
    device), and they give what the attributes do on every layout of CUDA tensors."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from tests.test_call_path import copy_kw, to_torch

    fn, kw = CASES["contiguous"](62, **DECODE.get("contiguous", {}))
    fn(**map_arrays(copy_kw(kw), to_torch))
    module = _launch.native_module()
    assert module is not None, _native.state()
    assert _launch._torch_probed[0] and _native._state["torch"] is None, _native.state()
    _check_torch_reads(module, torch, "cuda")
    with _torch_reads_on(module, "cuda"):
        _check_torch_reads(module, torch, "cuda")


_VIEW_SLOTS = ("name", "ptr", "shape", "strides", "dtype", "device", "size", "span")


def _view_state(v):
    """What a first call reads of a view (None for None): its values, and its array by identity."""
    if v is None:
        return None
    flags = (v.readonly, v.legacy, v.host is None, v.owner is v.array)
    return tuple(getattr(v, k) for k in _VIEW_SLOTS) + flags + (id(v.array),)


def _read_both(arrays, names):
    """``read_arguments`` of a call with the C reader routed in and with the Python loop."""
    from ropekv import _arrays as ar

    reader = ar.NATIVE_READ[0]
    assert reader is not None
    c_read = ar.read_arguments(arrays, names)
    ar.NATIVE_READ[0] = None
    try:
        py_read = ar.read_arguments(arrays, names)
    finally:
        ar.NATIVE_READ[0] = reader

    def state(read):
        views, kinds, misaligned = read
        bad = None if misaligned is None else [v.name for v in misaligned]
        return [_view_state(v) for v in views], kinds, bad

    return state(c_read), state(py_read)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_gpu_first_call_arguments_read_in_c_equal_the_python_loop(kind):
    """A first call's arguments read by the C replay's ``read_views`` (every array None or one
    its struct reads take) give the views, kinds and misaligned arrays the Python loop gives, on
    every layout of the struct-read tests, in random calls of up to 24 arguments; a call with any
    other argument (a NumPy array, a CuPy byte stride that is no multiple of the item size, a
    torch.Tensor subclass) is left to the loop (``read_views`` answers None)."""
    from ropekv import _arrays as ar

    cupy = pytest.importorskip("cupy")
    if kind == "cupy":
        cases = _struct_probe_cases(cupy)
        base = cupy.zeros(40, cupy.uint8)
        cases.append(base[1:33].view(cupy.float16))  # a pointer that is no multiple of 2
        odd = cupy.lib.stride_tricks.as_strided(cupy.zeros(8, cupy.float16), (3,), (3,))
    else:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
        from ropekv.bench.timing import clear_plans
        from tests.test_call_path import copy_kw, to_torch

        fn, kw = CASES["contiguous"](62, **DECODE.get("contiguous", {}))
        clear_plans()  # a first call: torch reads probed on the device
        fn(**map_arrays(copy_kw(kw), to_torch))
        ar._from_torch(torch.zeros(3, device="cuda"), "t")  # and verified (by the Python loop)
        assert torch.cuda.current_device() in ar._VERIFIED_TORCH_DEVICES
        cases = _torch_cases(torch, "cuda")
        odd = torch.nn.Parameter(torch.zeros(3, device="cuda"))  # a subclass: the attributes
    module = _launch.native_module()
    assert module is not None, _native.state()
    readable = [a for a in cases if module.view_fields(a) is not None]
    assert len(readable) >= len(cases) - 8
    rng = np.random.default_rng(5)
    taken = 0
    for trial in range(200):
        n = int(rng.integers(1, 25))
        arrays = [
            None if rng.random() < 0.2 else readable[int(rng.integers(len(readable)))]
            for _ in range(n)
        ]
        names = [f"arg{i}" for i in range(n)]
        got = module.read_views(arrays, names, ar._TORCH_TO_NUMPY, ar._VERIFIED_TORCH_DEVICES)
        assert got is not None, [None if a is None else (a.shape, a.dtype) for a in arrays]
        taken += 1
        c_state, py_state = _read_both(arrays, names)
        assert c_state == py_state
    assert taken == 200
    for other in (np.zeros(3, np.float16), odd):
        arrays = [readable[0], other, None]
        names = ["a", "b", "c"]
        got = module.read_views(arrays, names, ar._TORCH_TO_NUMPY, ar._VERIFIED_TORCH_DEVICES)
        assert got is None
        if other is not odd or kind == "torch":  # (the odd CuPy stride raises in both forms)
            c_state, py_state = _read_both(arrays, names)
            assert c_state == py_state


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_a_negated_torch_view_of_a_planned_layout_is_refused(op):
    """A lazy negation (``torch._neg_view``) of a tensor whose layout has a plan: refused with
    the first call's BufferError, on the C replay (struct reads refuse its key set, the attribute
    path sees the bit), and nothing is written."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not hasattr(torch, "_neg_view"):
        pytest.skip("needs torch with CUDA and torch._neg_view")
    from tests.test_call_path import LATE_INPUT, copy_kw, to_torch

    fn, kw = CASES[op](63, **DECODE.get(op, {}))
    fn(**map_arrays(copy_kw(kw), to_torch))  # plans
    args = map_arrays(copy_kw(kw), to_torch)
    fn(**args)  # replays
    torch.cuda.synchronize()
    name = LATE_INPUT[op]
    cache = args[CACHE[op]]
    before = [c.clone() for c in (cache if isinstance(cache, (tuple, list)) else (cache,))]
    args[name] = torch._neg_view(args[name])
    assert args[name].is_neg()
    with pytest.raises(BufferError, match=f"{name} carries a lazy negation"):
        fn(**args)
    torch.cuda.synchronize()
    after = cache if isinstance(cache, (tuple, list)) else (cache,)
    for b, a in zip(before, after):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_a_prefill_qkv_call_in_a_stream_capture(monkeypatch):
    """The cuBLAS path's workspaces are freed when the call returns, so the C replay hands a call
    on a stream being captured into a CUDA graph to the plan: up to GRAPH_MAX_TOKENS tokens its
    capture plan runs (the fused kernel: the graph's Q is the eager call's within fp16 rounding),
    beyond it is refused (ValueError) before it allocates or launches anything; the same call
    outside the capture runs."""
    import cupy

    from tests.test_call_path import copy_kw
    from tests.tolerance import to_device

    fn, kw = CASES["qkv"](64, **PREFILL["qkv"])
    q0 = fn(**map_arrays(copy_kw(kw), to_device))  # plans (the C replay serves it from now on)
    args = map_arrays(copy_kw(kw), to_device)
    cupy.cuda.runtime.deviceSynchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        q = fn(**args)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    q, q0 = q.astype(cupy.float32), q0.astype(cupy.float32)
    assert float(cupy.abs(q - q0).max()) <= 0.01 * float(cupy.abs(q0).max())
    monkeypatch.setattr(ropekv.qkv, "GRAPH_MAX_TOKENS", q.shape[0] - 1)  # (a plan of its own)
    fn(**args)
    cupy.cuda.runtime.deviceSynchronize()
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="cannot be recorded in a CUDA graph"):
                fn(**args)
        finally:
            stream.end_capture()
        fn(**args)
    stream.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("explicit", [False, True])
def test_gpu_torch_prefill_qkv_temporaries_live_in_torchs_pool(explicit):
    """A prefill QKV call with torch tensors takes its temporaries (the cuBLAS output) and its
    new output from torch's caching allocator, on its launch stream (torch's current one, or
    ``stream=``), not from CuPy's pool; its result matches the reference."""
    torch = pytest.importorskip("torch")
    import cupy

    from ropekv.bench import torch_view
    from tests.test_call_path import assert_same, copy_kw
    from tests.tolerance import to_device

    for o in _device_ops():
        o.clear()
    fn, kw = CASES["qkv"](66, **PREFILL["qkv"])
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    convert = lambda x: torch_view(to_device(x))
    extra = {"stream": torch.cuda.Stream()} if explicit else {}
    fn(**map_arrays(copy_kw(kw), convert), **extra)  # plans
    torch.cuda.synchronize()
    args = map_arrays(copy_kw(kw), convert)
    # the inputs were copied on CuPy's stream; the call may run on a non-blocking torch stream,
    # which does not wait for it (the caller orders its producers with stream=, as here)
    cupy.cuda.runtime.deviceSynchronize()
    pool = cupy.get_default_memory_pool()
    cupy_bytes = pool.total_bytes()
    count = torch.cuda.memory_stats()["allocation.all.allocated"]
    out = fn(**args, **extra)
    made = torch.cuda.memory_stats()["allocation.all.allocated"] - count
    torch.cuda.synchronize()
    (plan,) = [p for o in _device_ops() for p in o.plans.values()]
    assert any(type(s) is _launch.Gemm for s in plan.steps)
    assert made == sum(1 for o in plan.outputs if o.size) >= 2  # out and the temporary, by torch
    assert pool.total_bytes() == cupy_bytes  # CuPy's pool neither grew nor was used
    assert_same(args, out, expected, out_expected, "qkv")


# ---- hardening of the torch struct reads (issue 37 item 11) -----------------------------------


def test_torch_struct_probe_inside_inference_mode_turns_the_reads_on():
    """A first call inside ``torch.inference_mode()`` probes on normal tensors: the reads go on
    (they turned off for the process before), and inference tensors stay with the attributes."""
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    with torch.inference_mode(), _torch_reads_on(module, "cpu"):
        assert _native._state["torch"] is None, _native.state()
        assert module.raw_layout(torch.zeros(3)) is None  # an inference tensor
        with torch.inference_mode(False):
            t = torch.zeros(3)
        assert module.raw_layout(t) == _attributes(t)


def test_torch_struct_reads_go_live_only_once_verified():
    """configure_torch stages the reads: raw_layout(t, True) reads with them (the probe's checks),
    nothing else does until enable_torch()."""
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None:
        pytest.skip(f"no C replay here: {_native.state()}")
    with _torch_reads_on(module, "cpu"):
        t = torch.zeros((2, 3))
        assert module.raw_layout(t) == _attributes(t)
        module.configure_torch(None)
        assert module.raw_layout(t) is None and module.raw_layout(t, True) is None
    with pytest.raises(ValueError, match="no torch reads configured"):
        module.enable_torch()


def test_torch_struct_probe_reads_within_the_allocation(monkeypatch):
    """The probe reads no byte of a TensorImpl / StorageImpl past its allocation's usable size."""
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None or _native._usable_size() is None:
        pytest.skip("no C replay or no malloc_usable_size here")
    reads = []
    string_at = ctypes.string_at

    def recorded(address, size=-1):
        reads.append((address, size))
        return string_at(address, size)

    monkeypatch.setattr(_native.ctypes, "string_at", recorded)
    with _torch_reads_on(module, "cpu"):
        assert _native._state["torch"] is None, _native.state()
    t = torch.zeros(3)
    impl, usable = t._cdata, _native._usable_size()(t._cdata)
    assert usable >= 16 and _native._object_bytes(impl, 10**6) <= usable


def test_a_struct_read_disagreeing_on_another_device_turns_the_reads_off(monkeypatch):
    """The offsets are probed on one device; the first tensor of each other device is checked
    against its attributes, and a disagreement turns the torch reads off (the attributes read it)."""
    torch = pytest.importorskip("torch")
    from ropekv import _arrays

    t = torch.arange(6.0).reshape(2, 3)
    wrong = (t.data_ptr(), (2, 3), (3, 1), torch.float32, 3, 6, 0, 24)  # device 3: not so
    failed = []
    monkeypatch.setattr(_arrays, "_VIEW_FIELDS", [lambda a: wrong])
    monkeypatch.setattr(_arrays, "_VERIFIED_TORCH_DEVICES", set())
    monkeypatch.setattr(_native, "torch_reads_failed", failed.append)
    v = _arrays.as_view(t, "t")
    assert v.device == _arrays.HOST and failed and "device 3" in failed[0]


def test_no_c_replay_without_the_gil(monkeypatch):
    """A free-threaded interpreter running without the GIL: the C replay (which needs it) is not
    loaded, so the GIL stays off; every call replays in Python."""
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    monkeypatch.setattr(_launch, "_native_launchers", lambda: (1, None))
    monkeypatch.setattr(_launch, "_native_module", [_launch._UNBOUND])
    assert _launch.native_module() is None
    assert "Py_MOD_GIL_USED" in Path(_native.__file__).with_name("_native.c").read_text()


def test_torch_exchange_api_reads_equal_the_attributes():
    """torch's DLPack C exchange API, read in C: what the attributes give on every layout; a lazy
    negation and a tensor whose export fails (no writable data pointer) left to the attributes."""
    torch = pytest.importorskip("torch")
    module = _native.load()
    if module is None or not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("no C replay or no DLPack C exchange API here")
    try:
        _native.configure_torch_exchange(module, "cpu")
        for t in _torch_cases(torch, "cpu"):
            assert module.raw_layout(t) == _attributes(t), (t.shape, t.stride(), t.dtype)
        must_not_write = torch.zeros(3)
        torch._C._set_throw_on_mutable_data_ptr(must_not_write)
        for t in (torch._neg_view(torch.zeros(3)), must_not_write):
            assert module.raw_layout(t) is None
    finally:
        _native.configure_torch_exchange(module, None)
    assert module.raw_layout(torch.zeros(3)) is None
