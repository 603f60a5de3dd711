"""Plan replay on a CPU: every op called with stand-ins of CuPy arrays (and of torch tensors where
torch is not installed) at fake device addresses, the driver stubbed (``tools/hostcost.py``'s
fakes). What the GPU tests check with real memory, checked here on the records the launches get:
a replay refills every pointer and adds no plan, a new layout makes a new plan, overlap is
re-checked from pointers, ``plans.clear()`` forgets the newest plan too, and the unrolled
signature agrees with the generic one."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import struct
import sys

import numpy as np
import pytest

import ropekv
from ropekv import _arrays as ar
from ropekv import _launch
from tests.test_call_path import CASES, LATE_INPUT, OPS, map_arrays
from tests.tool_loader import load_tool

hostcost = load_tool("hostcost")


DECODE = {"qkv": {"lengths": (1, 1)}}  # the kernel path (more tokens run cuBLAS: Gemms below)
# the cuBLAS path (GEMMs, then the epilogue kernel): more tokens than the tensor-core kernels take
PREFILL = {"qkv": {"lengths": (ropekv.qkv.MMA_MAX_TOKENS, 30)}}


def all_ops():
    return [
        v
        for m in (ropekv.contiguous, ropekv.paged, ropekv.mla, ropekv.qknorm, ropekv.qkv)
        for v in vars(m).values()
        if isinstance(v, _launch.Op)
    ]


_RECORD_MAX = 4096  # the C replay's parameter record lives in a buffer of this size

_C_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
)


class Launches:
    """The stubbed ``cuLaunchKernel``: records each launch's stream and pointer fields, from the
    Python replay (called as CuPy's wrapper is) and from the C replay (``c_launch``, a C function
    pointer to the same recorder; its record lives on the C stack, so it is copied)."""

    def __init__(self):
        self.calls = []
        self.copies = []
        self.c_launch = _C_LAUNCH(self._from_c)
        self.fail = 0  # a CUresult to answer with

    def __call__(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv_ptr, extra):
        rec = ctypes.c_uint64.from_address(argv_ptr).value
        self.calls.append((stream, rec))
        if self.fail:
            from cupy_backends.cuda.api.driver import CUDADriverError

            raise CUDADriverError(self.fail)

    def _from_c(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        rec = ctypes.c_uint64.from_address(params).value
        copy = ctypes.create_string_buffer(ctypes.string_at(rec, _RECORD_MAX), _RECORD_MAX)
        self.copies.append(copy)
        self.calls.append((stream or 0, ctypes.addressof(copy)))
        return self.fail

    def pointers(self, k, n):
        """The first ``n`` 8-byte fields of launch ``k``'s record, as it is now."""
        return struct.unpack(f"={n}Q", ctypes.string_at(self.calls[k][1], 8 * n))


_C_SET_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_C_SET_POINTER_MODE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_C_GEMM_EX = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_int] * 5,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    *[ctypes.c_int] * 4,
)
FAKE_CUBLAS_HANDLE = 0x9000


class Gemms:
    """The stubbed cuBLAS functions of ``_launch.Gemm``, for both replays (C function pointers):
    ``calls`` holds ``("stream", handle, stream)``, ``("mode", handle, mode)`` and ``("gemm",
    handle, transa, transb, m, n, k, alpha, A, A type, lda, B, B type, ldb, beta, C, C type, ldc,
    compute type, algo)`` with alpha and beta read as floats; ``fail`` is a status to answer the
    GEMM with."""

    def __init__(self):
        self.calls = []
        self.fail = 0
        self.capturing = False  # what the stubbed cuStreamIsCapturing says of every stream
        self.functions = (
            _C_SET_STREAM(self._stream),
            _C_SET_POINTER_MODE(self._mode),
            _C_GEMM_EX(self._gemm),
        )

    def _stream(self, handle, stream):
        self.calls.append(("stream", handle, stream or 0))
        return 0

    def _mode(self, handle, mode):
        self.calls.append(("mode", handle, mode))
        return 0

    def _gemm(
        self,
        handle,
        ta,
        tb,
        m,
        n,
        k,
        alpha,
        a,
        at,
        lda,
        b,
        bt,
        ldb,
        beta,
        c,
        ct,
        ldc,
        compute,
        algo,
    ):
        alpha, beta = (ctypes.c_float.from_address(x).value for x in (alpha, beta))
        self.calls.append(
            (
                "gemm",
                handle,
                ta,
                tb,
                m,
                n,
                k,
                alpha,
                a,
                at,
                lda,
                b,
                bt,
                ldb,
                beta,
                c,
                ct,
                ldc,
                compute,
                algo,
            )
        )
        return self.fail

    def install(self, monkeypatch):
        """Both replays call these functions, on a fake handle."""
        addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self.functions)
        monkeypatch.setattr(_launch, "cublas_entry_points", lambda: addresses)
        monkeypatch.setattr(_launch, "_cublas_handle", lambda: FAKE_CUBLAS_HANDLE)
        monkeypatch.setattr(_launch, "_CUBLAS_CALLS", [None])
        monkeypatch.setattr(_launch, "_native_cublas_bound", [None])
        monkeypatch.setattr(_launch, "stream_capturing", lambda stream: self.capturing)


def use_c_replay(monkeypatch, launches):
    """Every op replays its plans in C (``ropekv/_native.c``), launching into ``launches``."""
    from ropekv import _native

    module = _native.load()
    if module is None:
        pytest.fail(f"the C replay did not build: {_native.state()}")
    address = ctypes.cast(launches.c_launch, ctypes.c_void_p).value
    monkeypatch.setattr(_launch, "_native_launchers", lambda: (address, None))
    _launch._native_module[0] = _launch._UNBOUND
    for op in all_ops():
        op.reset_caller()


@pytest.fixture(params=["python", "c"])
def stubbed(request, monkeypatch):
    """The fakes of tools/hostcost.py in place of CuPy's array type and the driver; every op's
    plans cleared before and after (a fake plan must never serve a real array). Each test runs
    with the Python replay and with the C one."""
    for op in all_ops():
        op.clear()
    launches = Launches()
    launches.replay = request.param
    if request.param == "c":
        use_c_replay(monkeypatch, launches)
    else:
        for op in all_ops():
            op.reset_caller(native=False)
    set_known_type(monkeypatch, 0, hostcost.FakeCupyArray)
    # a Hopper GPU, as tools/hostcost.py's stubs say (the QKV op's plans ask)
    monkeypatch.setattr(ropekv.qkv, "_compute_capability", lambda device: 90)
    monkeypatch.setattr(ropekv.qkv, "_sm_count", lambda device: 132)
    monkeypatch.setattr(ropekv.qkv, "_active_clusters", lambda *a: None)  # (no driver)
    monkeypatch.setattr(_launch, "_EMPTY_OUTPUTS", {})  # fake zero-size outputs stay here
    monkeypatch.setattr(_launch, "function_pointer", lambda *a, **k: 0x1000)
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device=-1: 0x5000)
    monkeypatch.setattr(_launch, "_launch_kernel", launches)
    monkeypatch.setattr(_launch, "_RUNTIME", [hostcost._Runtime])
    monkeypatch.setattr(
        _launch.Output,
        "_cupy",
        lambda self: hostcost.FakeCupyArray(np.empty(self.shape, self.dtype)),
    )
    launches.gemms = Gemms()
    launches.gemms.install(monkeypatch)
    yield launches
    for op in all_ops():
        op.clear()
        op.reset_caller()  # bound again, to the real driver, with the next plan
    _launch._native_module[0] = _launch._UNBOUND


class _ListEntry:
    """One entry of a list as an attribute, for monkeypatch.setattr (the list stays the same
    object: the C replay holds ``ar.KNOWN_TYPES``)."""

    def __init__(self, items, index):
        self.items, self.index = items, index

    @property
    def value(self):
        return self.items[self.index]

    @value.setter
    def value(self, value):
        self.items[self.index] = value


def set_known_type(monkeypatch, index, cls):
    """``ar.KNOWN_TYPES[index] = cls`` (0: CuPy's array type, 1: torch's tensor type) until the
    test ends."""
    monkeypatch.setattr(_ListEntry(ar.KNOWN_TYPES, index), "value", cls)


def fake_torch(monkeypatch):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: its tensors are tested on the GPU")
    torch = hostcost._fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    set_known_type(monkeypatch, 1, torch.Tensor)
    monkeypatch.setattr(ar, "_TORCH_TO_NUMPY", {})
    monkeypatch.setattr(ar, "_NUMPY_TO_TORCH", {})
    monkeypatch.setattr(_launch, "_torch_raw_stream", lambda device: 0x7000)
    return torch


def test_a_prefill_qkv_call_on_a_capturing_stream_runs_one_kernel(stubbed, monkeypatch):
    """The cuBLAS path runs on temporaries freed when the call returns, which a CUDA graph cannot
    hold. On a stream being captured, a call of up to GRAPH_MAX_TOKENS tokens runs the fused
    tensor-core kernel instead (one launch, no GEMM, nothing allocated but Q), on its first call
    and on a replay of the eager call's plan; the same call outside a capture runs cuBLAS + the
    epilogue. Beyond GRAPH_MAX_TOKENS a call on a capturing stream is refused before anything is
    allocated or launched."""
    T = sum(PREFILL["qkv"]["lengths"])
    kernels, allocated = [], []
    monkeypatch.setattr(
        _launch, "function_pointer", lambda stem, expr, *a, **k: kernels.append(expr) or 0x1000
    )
    monkeypatch.setattr(
        _launch.Output,
        "_cupy",
        lambda self: (
            allocated.append(self.shape) or hostcost.FakeCupyArray(np.empty(self.shape, self.dtype))
        ),
    )
    fn, kw = CASES["qkv"](44, **PREFILL["qkv"])
    gemms = stubbed.gemms
    gemms.capturing = True
    for _ in range(2):
        fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(stubbed.calls) == 2 and not gemms.calls
    assert len(allocated) == 2 and all(shape[0] == T for shape in allocated)  # Q, each call
    assert any(k.startswith(("qkv_mma", "qkv_wgmma")) for k in kernels)  # (and the epilogue:
    # the eager plan, built first; its temporaries were not allocated, nor cuBLAS called)
    gemms.capturing = False
    fn(**map_arrays(kw, hostcost.to_cupy))
    fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(stubbed.calls) == 4 and len(gemms.calls) == 6  # epilogues, and cuBLAS's calls
    assert any(k.startswith("qkv_epilogue") for k in kernels)
    gemms.capturing = True  # a replay of the eager plan: its capture plan
    fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(stubbed.calls) == 5 and len(gemms.calls) == 6
    monkeypatch.setattr(ropekv.qkv, "GRAPH_MAX_TOKENS", T - 1)  # (a flag: a plan of its own)
    calls, n_allocated = len(stubbed.calls), len(allocated)
    for _ in range(2):
        with pytest.raises(
            ValueError,
            match=f"cannot be recorded in a CUDA graph with hidden_state of T={T} tokens",
        ):
            fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(stubbed.calls) == calls and len(gemms.calls) == 6
    assert len(allocated) == n_allocated
    gemms.capturing = False
    fn, kw = CASES["qkv"](44, **DECODE["qkv"])  # the fused kernels: capturable, no check
    monkeypatch.setattr(_launch, "stream_capturing", lambda stream: pytest.fail("checked"))
    fn(**map_arrays(kw, hostcost.to_cupy))
    fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(stubbed.calls) == calls + 2


@pytest.mark.parametrize("wfmt, D", [("dense", 16), ("fp8", 16), ("int4", 16), ("dense", 256)])
def test_graph_safe_is_what_the_plans_refuse(wfmt, D, stubbed, monkeypatch):
    """ropekv.qkv.graph_safe (the frameworks' check before a capture) names exactly the calls
    whose plans take a capturing stream: on sm_90 and sm_80, at token counts around every
    switch, each weight format, and a head size the tensor-core kernels do not take."""
    gemms = stubbed.gemms
    monkeypatch.setattr(ropekv.qkv, "_sm_count", lambda device: 132)  # the tiled kernel's grid
    for cc in (90, 80):
        monkeypatch.setattr(ropekv.qkv, "_compute_capability", lambda device, cc=cc: cc)
        for op in all_ops():  # the plans of the other capability (not part of their keys)
            op.plans.clear()
        for T in sorted(
            {
                1,
                2,
                3,
                16,
                17,
                40,
                128,
                129,
                256,
                257,
                300,
                ropekv.qkv.GRAPH_MAX_TOKENS,
                ropekv.qkv.GRAPH_MAX_TOKENS + 1,
            }
        ):
            fn, kw = CASES["qkv"](
                45, lengths=(T,), wfmt=wfmt, K=128, D=D, R=D, P=512, group_size=32
            )
            fmt = {"dense": ropekv.qkv.W_DENSE, "fp8": ropekv.qkv.W_FP8, "int4": ropekv.qkv.W_INT4}[
                wfmt
            ]
            safe = ropekv.qkv.graph_safe(T, 128, D, fmt, 32, cc)
            gemms.capturing = True
            try:
                if safe:
                    fn(**map_arrays(kw, hostcost.to_cupy))
                else:
                    with pytest.raises(ValueError, match="cannot be recorded in a CUDA graph"):
                        fn(**map_arrays(kw, hostcost.to_cupy))
            finally:
                gemms.capturing = False


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_prefill_temporaries_come_from_the_callers_allocator(kind, stubbed, monkeypatch):
    """The cuBLAS path's temporaries (the GEMM's output, read by the epilogue) are allocated per
    call from the caller's allocator: torch's for torch tensors (they stay in torch's pool), CuPy's
    for CuPy arrays; the GEMM writes into the temporary of that very call, first call and
    replay alike."""
    monkeypatch.setattr(ropekv.qkv, "_compute_capability", lambda device: 90)
    convert = hostcost.to_cupy
    allocated = []
    if kind == "torch":
        torch = fake_torch(monkeypatch)
        convert = hostcost.to_torch
        empty = torch.empty

        def torch_empty(shape, dtype=None, device=None):
            allocated.append(empty(shape, dtype, device))
            return allocated[-1]

        monkeypatch.setattr(torch, "empty", torch_empty)
        monkeypatch.setattr(_launch.Output, "_cupy", lambda self: pytest.fail("CuPy allocated"))
    else:

        def cupy_empty(self):
            allocated.append(hostcost.FakeCupyArray(np.empty(self.shape, self.dtype)))
            return allocated[-1]

        monkeypatch.setattr(_launch.Output, "_cupy", cupy_empty)
    fn, kw = CASES["qkv"](45, **PREFILL["qkv"])
    T = sum(PREFILL["qkv"]["lengths"])
    for call in range(3):  # the first call, then replays
        args = map_arrays(kw, convert)
        del allocated[:]
        fn(**args)
        gemm = [c for c in stubbed.gemms.calls if c[0] == "gemm"][-1]
        (temporary,) = [a for a in allocated if _ptr(a) == gemm[15]]  # the GEMM's C
        assert tuple(temporary.shape) == (T, gemm[4])  # (T, N): Q|K|V


@pytest.mark.parametrize("op", OPS)
def test_a_negated_torch_tensor_of_a_planned_layout_is_refused(op, stubbed, monkeypatch):
    """A lazy negation (``x.neg()``: a bit on the tensor, its bytes as they were) is not in the
    layout key, so a replay would launch on the bytes as they are. The call is refused as a first
    call refuses it, though its layout has a plan, and nothing launches."""
    fake_torch(monkeypatch)
    fn, kw = CASES[op](43, **DECODE.get(op, {}))
    fn(**map_arrays(kw, hostcost.to_torch))
    fn(**map_arrays(kw, hostcost.to_torch))  # a replay: the plan serves this layout
    launched = len(stubbed.calls)
    args = map_arrays(kw, hostcost.to_torch)
    name = LATE_INPUT[op]
    args[name]._neg = True
    with pytest.raises(BufferError, match=f"{name} carries a lazy negation"):
        fn(**args)
    assert len(stubbed.calls) == launched
    args[name]._neg = False
    fn(**args)
    assert len(stubbed.calls) > launched


def stand_in(kind, monkeypatch):
    """The stand-in maker of ``kind``: CuPy arrays, or torch tensors with a fake torch."""
    if kind == "torch":
        fake_torch(monkeypatch)
        return hostcost.to_torch
    return hostcost.to_cupy


def record_op_arrays(monkeypatch):
    """A list that gets every Op call's arguments (the call goes on as before)."""
    seen = []
    call = _launch.Op.__call__
    monkeypatch.setattr(
        _launch.Op,
        "__call__",
        lambda self, arrays, *a, **k: seen.append(arrays) or call(self, arrays, *a, **k),
    )
    return seen


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("op", OPS)
def test_replay_refills_every_pointer(op, kind, stubbed, monkeypatch):
    convert = stand_in(kind, monkeypatch)
    fn, kw = CASES[op](41, **DECODE.get(op, {}))
    seen = record_op_arrays(monkeypatch)
    fn(**map_arrays(kw, convert))
    assert sum(len(o.plans) for o in all_ops()) == 1 and stubbed.calls
    n_first = len(stubbed.calls)
    (op_obj,) = [o for o in all_ops() if o.plans]
    plan = next(iter(op_obj.plans.values()))
    for _ in range(2):  # new arrays of the same layout: a replay with their pointers
        fn(**map_arrays(kw, convert))
        assert sum(len(o.plans) for o in all_ops()) == 1
        stream = stubbed.calls[-1][0]
        assert stream == (0x7000 if kind == "torch" else 0x5000)  # the stream rule
        ptrs = [0 if a is None else _ptr(a) for a in seen[-1]]
        assert_filled(stubbed, len(stubbed.calls) - 1, plan.steps[-1], ptrs)
    assert len(stubbed.calls) == 3 * n_first  # as many launches per call
    # every call went through the replay under test (the first call's launch too: once planned,
    # it is the C replay's)
    assert len(stubbed.copies) == (3 * n_first if stubbed.replay == "c" else 0)


def _ptr(x):
    return x.data.ptr if isinstance(x, hostcost.FakeCupyArray) else x.data_ptr()


class _CountedCaller:
    """An op's C replay with its entries counted: ``calls`` (the replay: a first call's layout
    miss) and ``launches`` (``launch``: a new plan's first launch)."""

    def __init__(self, caller):
        self.caller, self.calls, self.launches = caller, 0, 0

    def __call__(self, *args):
        self.calls += 1
        return self.caller(*args)

    def launch(self, *args):
        self.launches += 1
        return self.caller.launch(*args)


def count_caller_entries(monkeypatch):
    """Each op's C replay, once bound, wrapped in a :class:`_CountedCaller` (a list of them)."""
    counted = []
    bind = _launch.Op.bind_caller

    def bind_counted(self):
        bind(self)
        if self.caller is not None:
            self.caller = _CountedCaller(self.caller)
            counted.append(self.caller)

    monkeypatch.setattr(_launch.Op, "bind_caller", bind_counted)
    return counted


def assert_filled(stubbed, k, launch, ptrs, layer_strides=None):
    """Launch ``k``'s pointer fields are ``launch``'s slots on ``ptrs`` (plus each layered
    argument's layer offset); at least three are checked."""
    fields = stubbed.pointers(k, launch.n_ptr)
    filled = 0
    for field, (arg, offset) in zip(fields, launch.slots):
        if 0 <= arg < len(ptrs) and ptrs[arg]:
            extra = (layer_strides or {}).get(arg, 0)
            assert field == ptrs[arg] + extra + offset, f"pointer field of argument {arg}"
            filled += 1
    assert filled >= 3


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("op", OPS)
def test_a_first_call_launches_once_on_the_pointers_it_read(op, kind, direct, stubbed, monkeypatch):
    """A new layout's call launches its plan's steps once, with its arrays' pointers; with the C
    replay, that launch is ``Caller.launch`` on the pointers the first call read and checked (the
    replay itself entered once, for the layout miss: no second read), or with
    ``FIRST_LAUNCH_DIRECT`` off a second entry of the replay (as before). The next call of the
    layout is the C replay's alone."""
    monkeypatch.setattr(_launch, "FIRST_LAUNCH_DIRECT", direct)
    convert = stand_in(kind, monkeypatch)
    counted = count_caller_entries(monkeypatch)
    fn, kw = CASES[op](61, **DECODE.get(op, {}))
    seen = record_op_arrays(monkeypatch)
    fn(**map_arrays(kw, convert))
    (op_obj,) = [o for o in all_ops() if o.plans]
    plan = next(iter(op_obj.plans.values()))
    n_steps = len(plan.steps)
    assert len(stubbed.calls) == n_steps  # each step launched once
    stream = stubbed.calls[-1][0]
    assert stream == (0x7000 if kind == "torch" else 0x5000)  # the stream rule
    ptrs = [0 if a is None else _ptr(a) for a in seen[-1]]
    assert_filled(stubbed, n_steps - 1, plan.steps[-1], ptrs)
    if stubbed.replay == "python":
        assert not counted and plan.native is None
        return
    (caller,) = counted
    assert plan.native is not None and len(stubbed.copies) == n_steps  # launched in C
    # the op's first plan binds its replay: no layout miss before it
    assert (caller.calls, caller.launches) == ((0, 1) if direct else (1, 0))
    fn(**map_arrays(kw, convert))  # a replay: the C replay's, entered once
    assert (caller.calls, caller.launches) == ((1, 1) if direct else (2, 0))
    assert len(stubbed.calls) == len(stubbed.copies) == 2 * n_steps
    ptrs = [0 if a is None else _ptr(a) for a in seen[-1]]
    assert_filled(stubbed, 2 * n_steps - 1, plan.steps[-1], ptrs)
    op_obj.clear()  # the layout again, planned anew: the C replay's miss, then one launch
    fn(**map_arrays(kw, convert))
    assert (caller.calls, caller.launches) == ((2, 2) if direct else (4, 0))
    assert len(stubbed.calls) == len(stubbed.copies) == 3 * n_steps
    ptrs = [0 if a is None else _ptr(a) for a in seen[-1]]
    assert_filled(stubbed, 3 * n_steps - 1, plan.steps[-1], ptrs)


@pytest.mark.parametrize("direct", [True, False])
def test_a_multi_layer_first_call_launches_its_layer(direct, stubbed, monkeypatch):
    """The first call of a multi-layer layout launches on its layer's pointers (the whole arrays'
    checked, the layer's offset added at launch), and so does the replay of another layer."""
    monkeypatch.setattr(_launch, "FIRST_LAUNCH_DIRECT", direct)
    fn, kw = CASES["qknorm"](62)
    kw["paged_kv_cache"] = tuple(np.stack([c, c.copy(), c.copy()]) for c in kw["paged_kv_cache"])
    dev = map_arrays(kw, hostcost.to_cupy)
    seen = record_op_arrays(monkeypatch)
    for layer in (2, 1):
        fn(**dev, layer_idx=layer)
        (op_obj,) = [o for o in all_ops() if o.layer_plans]
        (plan,) = op_obj.layer_plans.values()
        assert len(op_obj.plans) == 0 and len(stubbed.calls) == len(plan.steps) * (3 - layer)
        assert (plan.native is not None) == (stubbed.replay == "c")
        ptrs = [0 if a is None else _ptr(a) for a in seen[-1]]
        strides = {i: layer * s for i, s in plan.layers.strides}
        assert len(strides) == 2
        assert_filled(stubbed, len(stubbed.calls) - 1, plan.steps[-1], ptrs, strides)
    assert len(stubbed.copies) == (len(stubbed.calls) if stubbed.replay == "c" else 0)


def test_a_new_layout_is_a_new_plan_and_clear_forgets_the_newest(stubbed):
    fn, kw = CASES["qknorm"](42)
    fn(**map_arrays(kw, hostcost.to_cupy))
    fn(**map_arrays(kw, hostcost.to_cupy))
    op = ropekv.qknorm._OP
    assert len(op.plans) == 1 and op.plans.last[3] is not None
    fn(**{**map_arrays(kw, hostcost.to_cupy), "epsilon": 1e-5})  # another flag value
    assert len(op.plans) == 2
    op.plans.clear()
    assert op.plans.last[3] is None
    fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(op.plans) == 1


def test_replay_rechecks_overlap(stubbed):
    fn, kw = CASES["qknorm"](43)
    dev = map_arrays(kw, hostcost.to_cupy)
    fn(**dev)
    k = dev["paged_kv_cache"][0]
    with pytest.raises(
        ValueError, match="k_cache is written in place but shares memory with v_cache"
    ):
        fn(**{**dev, "paged_kv_cache": (k, k)})


def test_bool_flag_never_replays_an_int_plan(stubbed):
    """The newest-plan check compares flags as the dict does: True never takes the plan of 1."""
    from tests.test_call_path import E4M3

    fn, kw = CASES["qknorm"](44, cache_dtype=E4M3)
    dev = map_arrays(kw, hostcost.to_cupy)
    fn(**{**dev, "kv_scale": 1})
    fn(**{**dev, "kv_scale": 1})  # the newest plan
    with pytest.raises(TypeError, match="kv_scale must be a real number, got True"):
        fn(**{**dev, "kv_scale": True})


def test_the_replay_first_try_agrees_with_signature(stubbed, monkeypatch):
    """signature() without names (the Python replay's first try) gives the same key, or None for
    an argument of another kind (then read again with names)."""
    arrays = [
        hostcost.to_cupy(np.zeros((4, 8), np.float16)),
        None,
        hostcost.to_cupy(np.zeros((3, 5, 2), np.int32)[:, ::2]),
    ]
    if importlib.util.find_spec("torch") is None:
        fake_torch(monkeypatch)
        arrays.append(hostcost.to_torch(np.zeros((2, 6), np.float32)))
    names = [f"a{i}" for i in range(len(arrays))]
    key, ptrs, kinds, _keep = ar.signature(arrays, names, None)
    assert ar.signature(arrays) == (key, ptrs, kinds, None)
    assert ar.signature([*arrays[:-1], np.zeros(3)]) is None  # NumPy: read with names
    assert ar.signature((None,)) == ((None,), [0], 0, None)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_device_readers_agree_with_the_numpy_reader(kind, stubbed, monkeypatch):
    """The CuPy reader's one pass (element strides, size, byte span) and the torch reader give
    the NumPy reader's view of the same layout: strided, reversed, transposed, broadcast and
    empty arrays."""
    convert, ptr = hostcost.to_cupy, lambda x: x.data.ptr
    if kind == "torch":
        fake_torch(monkeypatch)
        convert, ptr = hostcost.to_torch, lambda x: x.data_ptr()
    base = np.zeros((6, 5, 4), np.float16)
    for host in (
        base,
        base[:, ::2],
        base[::-1, :, 1:],
        base.transpose(2, 0, 1),
        np.broadcast_to(base[:1], (6, 5, 4)),
        base[:0],
        base[2, 3],
    ):
        dev = convert(host)
        view, ref = ar.as_view(dev, "x"), ar.as_view(host, "x")
        assert (view.shape, view.strides, view.size, view.span, view.dtype) == (
            ref.shape,
            ref.strides,
            ref.size,
            ref.span,
            ref.dtype,
        )
        assert (view.ptr, view.device, view.host, view.readonly, view.legacy) == (
            ptr(dev),
            0,
            None,
            False,
            False,
        )
        assert view.owner is dev and view.array is dev
    if kind == "torch":  # torch strides are elements: no odd byte stride to refuse
        return
    odd = hostcost.to_cupy(np.lib.stride_tricks.as_strided(np.zeros(16, np.float16), (3,), (3,)))
    with pytest.raises(
        BufferError, match="x has a byte stride of 3, not a multiple of its item size 2"
    ):
        ar.as_view(odd, "x")


def test_paged_option_kernel_plan_on_stand_ins(stubbed):
    """The paged op's option kernel (computed scales, status) gets a record of its own struct,
    built and launched on stand-ins: every field of OPTS_PARAMS given."""
    from tests import test_paged as tp

    args = tp.with_options(
        tp.make_case(20, Dn=8), np.random.default_rng(5), q_dyn=True, kv_dyn=True, status=True
    )
    tp.call(map_arrays(args, hostcost.to_cupy))
    (plan,) = [p for o in all_ops() for p in o.plans.values()]
    assert plan.steps[0].n_ptr == ropekv.paged.OPTS_PARAMS.n_pointers and stubbed.calls


def test_python_replay_builds_its_record_once_for_threads(monkeypatch):
    """A launch builds the Python replay's record on its first run (a first call served by the C
    replay never does); threads running a fresh launch at once each launch their own pointers,
    and one of them owns the record that is kept."""
    import threading

    seen, lock = [], threading.Lock()

    def launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, argv_ptr, extra):
        rec = ctypes.c_uint64.from_address(argv_ptr).value  # read now: a thread's own record
        with lock:
            seen.append((stream, struct.unpack("=3Q", ctypes.string_at(rec, 24))))

    monkeypatch.setattr(_launch, "function_pointer", lambda *a, **k: 0x1000)
    monkeypatch.setattr(_launch, "_launch_kernel", launch_kernel)
    params = _launch.ParamStruct(
        "P", [("a", np.uint64), ("b", np.uint64), ("c", np.uint64), ("n", np.int32)]
    )
    launch = _launch.Launch(
        "stem",
        "kernel<>",
        0,
        (1,),
        (32,),
        params,
        {"n": 5},
        {"a": (0, 0), "b": (1, 16), "c": (2, 0)},
    )
    assert launch._rec is None  # nothing of the Python replay built yet
    start = threading.Barrier(8)

    def work(t):
        start.wait()
        for k in range(50):
            base = (t << 32) + (k << 12)
            launch.run([base, base + 256, base + 512], t)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(seen) == 8 * 50
    for stream, (a, b, c) in seen:
        assert a >> 32 == stream and b == a + 256 + 16 and c == a + 512
    assert launch.owner in {th.ident for th in threads}
    assert bytes(launch.rec)[24:] == struct.pack("=i", 5) + bytes(len(launch.rec) - 28)


def _misaligned(x, offset=1):
    """A fake CuPy array of ``x``'s layout, its pointer moved by ``offset`` bytes."""
    a = hostcost.FakeCupyArray(x)
    a.data = hostcost._Data(a.data.ptr + offset, 0)
    return a


@pytest.mark.parametrize("struct_reads", [False, True])
def test_read_arguments_is_each_view_and_the_kinds(stubbed, monkeypatch, struct_reads):
    """A first call's one pass over its arguments gives each argument's as_view, the kinds
    signature() gives, and the misaligned device arrays in argument order (empty ones too: their
    checker lets them pass)."""
    torch = fake_torch(monkeypatch)
    f16 = np.zeros((4, 8), np.float16)
    arrays = [
        hostcost.FakeCupyArray(f16),
        None,
        np.zeros(3, np.int32),
        _misaligned(f16),
        torch.Tensor(np.zeros((2, 2), np.float32)),
        _misaligned(f16[:0]),
        None,
    ]
    names = [f"a{i}" for i in range(len(arrays))]
    if struct_reads:  # as the C replay's view_fields reads a CuPy array (the others: None)

        def fields(a):
            if a.__class__ is not hostcost.FakeCupyArray:
                return None
            v = ar._cupy_attributes(a, "x")
            return (v.ptr, v.shape, v.strides, v.dtype, v.device, v.size, *v.span)

        monkeypatch.setattr(ar, "_VIEW_FIELDS", [fields])
    views, kinds, misaligned = ar.read_arguments(arrays, names)
    for a, n, v in zip(arrays, names, views):
        if a is None:
            assert v is None
            continue
        w = ar.as_view(a, n)
        # (a view read from a struct leaves ``wait``, a CAI producer's stream, unset: None)
        assert [getattr(v, k, None) for k in ar.ArrayView.__slots__] == [
            getattr(w, k, None) for k in ar.ArrayView.__slots__
        ]
    assert kinds == ar.signature(arrays, names, None)[2] == ar.CUPY | ar.TORCH | ar.OTHER
    assert misaligned == [views[3], views[5]]
    assert ar.read_arguments(arrays[:3], names[:3])[2] is None  # none misaligned


@pytest.mark.parametrize("op", ["paged", "qknorm"])
def test_first_misaligned_argument_is_named_once_all_are_read(op, stubbed):
    """Element alignment is checked once every argument is read, in argument order: an empty
    misaligned array passes, the first non-empty one is named, and an argument that cannot be
    read at all is named before any misaligned one."""
    fn, kw = CASES[op](40)
    dev = map_arrays(kw, hostcost.to_cupy)
    first, second = [
        n for n, x in kw.items() if isinstance(x, np.ndarray) and x.itemsize > 1 and x.size
    ][:2]
    with pytest.raises(BufferError, match=f"^{second} starts at address"):
        fn(**{**dev, first: _misaligned(kw[first][:0]), second: _misaligned(kw[second])})
    with pytest.raises(TypeError, match=f"^{second} must be a NumPy array"):
        fn(**{**dev, first: _misaligned(kw[first]), second: object()})


# ---- hostile inputs on replay (issue 37) --------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_a_null_pointer_of_a_planned_layout_is_refused(op, stubbed):
    """An array at address 0 (a zero tensor, a freed storage) with the layout of a planned call:
    its key's alignment entry (16 for null, never 0) has no plan, so it takes the first-call path,
    which names it (BufferError), on the Python and the C replay alike, and nothing launches."""
    fn, kw = CASES[op](46, **DECODE.get(op, {}))
    fn(**map_arrays(kw, hostcost.to_cupy))
    fn(**map_arrays(kw, hostcost.to_cupy))  # a replay
    launched = len(stubbed.calls)
    args = map_arrays(kw, hostcost.to_cupy)
    name = LATE_INPUT[op]
    args[name].data.ptr = 0
    with pytest.raises(BufferError, match=f"{name} has a null data pointer"):
        fn(**args)
    assert len(stubbed.calls) == launched


def test_a_refused_int_value_never_replays_the_plan_of_its_equal(stubbed):
    """page_size=4.0 is refused on a first call; a plan for 4 must not serve it (4.0 == 4)."""
    fn, kw = CASES["paged"](47)
    dev = map_arrays(kw, hostcost.to_cupy)
    page_size = kw["page_size"]
    fn(**dev)
    fn(**dev)  # the newest plan
    for bad in (float(page_size), np.float64(page_size)):
        with pytest.raises(ValueError, match="page_size must be a positive integer"):
            fn(**{**dev, "page_size": bad})
    fn(**{**dev, "page_size": np.int64(page_size)})  # a NumPy int is the int's plan


@pytest.mark.parametrize("layer", [2**63, 2**70, -(2**70)])
def test_layer_idx_beyond_int64_on_replay_is_a_value_error(layer, stubbed):
    fn, kw = CASES["qknorm"](48)
    kw["paged_kv_cache"] = tuple(np.stack([c, c.copy()]) for c in kw["paged_kv_cache"])
    dev = map_arrays(kw, hostcost.to_cupy)
    fn(**dev, layer_idx=1)
    fn(**dev, layer_idx=0)  # a replay
    with pytest.raises(ValueError, match="layer_idx must be in"):
        fn(**dev, layer_idx=layer)


class _CAI:
    """A ``__cuda_array_interface__`` v3 producer at a fake device address, its work on
    ``stream``."""

    def __init__(self, host, stream):
        self.__cuda_array_interface__ = {
            "shape": host.shape,
            "typestr": host.dtype.str,
            "data": (hostcost._Memory.alloc(host.nbytes), False),
            "strides": None,
            "version": 3,
            "stream": stream,
        }


@pytest.mark.parametrize("explicit", [False, True])
def test_a_cai_producers_stream_is_waited_for(explicit, stubbed, monkeypatch):
    """CAI v3: the launch stream waits for the producer's stream before the kernel reads the
    array, with ``stream=`` and without it (then the stream rule's stream, here CuPy's current
    0x5000), on the first call and on a replay; the same stream needs no wait."""
    waits = []
    monkeypatch.setattr(ar, "_cai_device", lambda ptr: 0)
    monkeypatch.setattr(_launch, "stream_wait", lambda p, c, d: waits.append((p, c, d)))
    monkeypatch.setattr(_launch, "cupy_stream", lambda ptr, device: contextlib.nullcontext())
    fn, kw = CASES["qknorm"](49)
    extra = {"stream": 0x6000} if explicit else {}
    consumer = 0x6000 if explicit else 0x5000
    for call in range(2):
        args = map_arrays(kw, hostcost.to_cupy)
        args["v"] = _CAI(kw["v"], 0x1234)
        fn(**args, **extra)
        assert waits[-1] == (0x1234, consumer, 0) and len(waits) == call + 1
    args["v"] = _CAI(kw["v"], consumer)
    fn(**args, **extra)
    assert len(waits) == 2
    args["v"] = _CAI(kw["v"], None)
    fn(**args, **extra)
    assert len(waits) == 2
    for bad in (0, -1, "1", True):
        args["v"] = _CAI(kw["v"], bad)
        with pytest.raises(BufferError, match="stream must be None or a positive int"):
            fn(**args, **extra)


def test_a_dlpack_producer_is_asked_with_the_launch_stream_of_its_device(stubbed, monkeypatch):
    """Several GPUs: a DLPack producer on device 1 is asked to order its work before the launch
    stream on device 1 (CuPy's current stream there), not the current device's."""
    from tests.test_arrays import FakeProducer

    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device=-1: 0x5000 + device)
    fn, kw = CASES["qknorm"](50)
    args = map_arrays(kw, hostcost.to_cupy)
    producer = FakeProducer(kw["v"].copy(), device=(2, 1))
    args["v"] = producer
    with pytest.raises(ValueError, match="one device"):  # the others are on device 0
        fn(**args)
    assert producer.stream_seen == 0x5001
