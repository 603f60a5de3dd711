"""Python host cost of ropekv's call path, measured on a CPU with no GPU.

Every op's decode case of ``ropekv bench`` is built on the host (NumPy), and its arrays are
replaced by stand-ins of CuPy arrays and torch tensors: objects with the same attributes (pointer,
shape, strides, dtype, device) at fake device addresses. The driver is stubbed: kernels are never
compiled or loaded (``function_pointer`` gives a dummy), the launch is a no-op C function called
through the same ctypes / Cython wrapper (a compiled stub with ``cuLaunchKernel``'s signature when a
C compiler is around, else a Python no-op), the current device and stream are constants. What is
timed is then ropekv's own Python work per call: intake, plan key, plan lookup, overlap re-check,
stream rule, record refill and the call into the launch wrapper.

The stand-ins' attribute reads cost less than the real ones (a torch tensor's pointer, shape,
strides, dtype and device took about 0.5 us on the H200 host, CuPy's about 0.33 us) and the real
``cuLaunchKernel`` about 3.6 us, so a GPU host adds those to the figures here.

Usage::

    PYTHONPATH=$PWD python tools/hostcost.py              # replay and first-call costs per case
    PYTHONPATH=$PWD python tools/hostcost.py --profile    # plus a cProfile of each replay
    PYTHONPATH=$PWD python tools/hostcost.py --first-profile  # cProfile of the first calls
    PYTHONPATH=$PWD python tools/hostcost.py --phases  # median us of each first-call step
    PYTHONPATH=$PWD python tools/hostcost.py --layers 32  # also multi-layer caches (layer_idx)
    PYTHONPATH=$PWD python tools/hostcost.py --phases --touch 3  # 3 MB read between first calls

``--touch MB`` reads that many MB of host memory before each timed first call (outside its
timing): the CPU's caches lose the op's own code and data, as at an op's edge on the H200, where
another op's call runs between two first calls (``docs/design/host-path.md``, "Where the op-edge
step goes": a 1 / 3 / 8 MB read reproduces it).

``--layers N`` adds, for the ops with multi-layer caches, rows of the same case on caches of N
layers called with ``layer_idx`` cycling over them (an engine's step), and rows of the one-layer
call through the same wrapper with ``layer_idx=None``, which isolates the wrapper's own cost.

Run it alone: it installs a stand-in ``torch`` module in ``sys.modules`` for its own process.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import functools
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import types

import numpy as np

CASES = [
    "contiguous fp16->fp16 64x1",
    "paged gqa fp16->e4m3 64x1",
    "paged gqa fp16->e4m3 1x1",
    "paged mla bf16->e4m3 64x1",
    "mla rmsnorm bf16->e4m3 128x1",
    "qknorm bf16->e4m3 64x1",
    "qkv fp16 K4096 N6144 T1",
    "qkv fp16 K4096 N6144 T16",
    "qk_rope llama 32/8/128 fp16 1",
]


# ---- stand-ins of the frameworks -----------------------------------------------------------


class _Memory:
    """Fake device addresses, 256-byte aligned, never reused (also when threads allocate at
    once: the read and the bump of ``next`` under one lock, or two arrays could share one)."""

    next = 0x7F0000000000
    lock = threading.Lock()

    @classmethod
    def alloc(cls, nbytes):
        with cls.lock:
            p = cls.next
            cls.next += (max(nbytes, 1) + 511) // 256 * 256
        return p


class _Data:
    __slots__ = ("device_id", "ptr")

    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id


class FakeCupyArray:
    """Stands for ``cupy.ndarray``: the attributes ropekv reads."""

    __slots__ = ("data", "device", "dtype", "itemsize", "ndim", "shape", "size", "strides")

    def __init__(self, host):
        self.shape, self.dtype, self.itemsize = host.shape, host.dtype, host.itemsize
        self.strides, self.ndim, self.size = host.strides, host.ndim, host.size
        self.data = _Data(_Memory.alloc(host.nbytes), 0)
        self.device = 0


FakeCupyArray.__module__ = "cupy._core.core"  # ropekv tells CuPy arrays by their module


class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


class _TorchDevice:
    def __init__(self, type_, index):
        self.type, self.index = type_, index


def _fake_torch():
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-hostcost"
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "bool",
    ):
        setattr(torch, name, _TorchDtype(name))
    torch.strided = object()

    class Tensor:
        """Stands for ``torch.Tensor`` (methods like torch's: ``data_ptr()``, ``stride()``)."""

        __slots__ = (
            "_base",
            "_device",
            "_nbytes",
            "_neg",
            "_offset",
            "_ptr",
            "_stride",
            "dtype",
            "layout",
            "ndim",
            "shape",
        )
        is_nested = False

        def __init__(self, host, dtype=None):
            self.shape = torch.Size(host.shape)
            self._stride = tuple(s // host.itemsize for s in host.strides)
            self.dtype = dtype or getattr(torch, str(host.dtype))
            # a storage holding the view's whole byte span, the data pointer inside it (a
            # reversed view starts past the storage's first byte)
            lo = hi = 0
            if host.size:
                for n, st in zip(host.shape, host.strides):
                    lo, hi = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
                hi += host.itemsize
            self._nbytes = hi - lo
            self._base = _Memory.alloc(self._nbytes)
            self._ptr = self._base - lo
            self._offset = -lo // host.itemsize
            self._device = 0
            self._neg = False  # a lazy negation bit (x.neg() views)
            self.layout = torch.strided
            self.ndim = host.ndim

        def data_ptr(self):
            return self._ptr

        def stride(self):
            return self._stride

        def get_device(self):
            return self._device

        def untyped_storage(self):  # the storage is the view's byte span
            return types.SimpleNamespace(data_ptr=lambda: self._base, nbytes=lambda: self._nbytes)

        def storage_offset(self):
            return self._offset

        def is_neg(self):
            return self._neg

        def is_conj(self):
            return False

        @property
        def is_cuda(self):
            return True

        @property
        def device(self):
            return _TorchDevice("cuda", self._device)

    class Size(tuple):
        pass

    torch.Tensor, torch.Size = Tensor, Size
    torch.device = lambda type_, index=None: _TorchDevice(type_, index)
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: 0)
    torch._is_functional_tensor = lambda t: False  # read by the first call's tracing check

    def empty(shape, dtype=None, device=None):
        np_dtype = next(k for k, v in _np_torch().items() if v is dtype)
        return Tensor(np.empty(shape, np_dtype), dtype)

    torch.empty = empty
    return torch


def _np_torch():
    from ropekv import _arrays as ar

    ar._torch_maps()
    return ar._NUMPY_TO_TORCH


def to_cupy(x):
    return FakeCupyArray(x) if isinstance(x, np.ndarray) else x


def to_torch(x):
    if not isinstance(x, np.ndarray):
        return x
    torch = sys.modules["torch"]
    return torch.Tensor(x, _np_torch()[np.dtype(x.dtype)])


# ---- the stubbed driver ----------------------------------------------------------------------

_STUB_C = r"""
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void* stream, void** params, void** extra) {
  return 0;
}
int cuLaunchKernelEx(const void* config, void* f, void** params, void** extra) { return 0; }
"""


def _stub_library():
    """A shared library with no-op ``cuLaunchKernel`` / ``cuLaunchKernelEx`` (None without cc)."""
    folder = tempfile.mkdtemp(prefix="ropekv-hostcost-")
    src, lib = os.path.join(folder, "stub.c"), os.path.join(folder, "libcudastub.so")
    with open(src, "w") as f:
        f.write(_STUB_C)
    try:
        subprocess.run(
            ["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return ctypes.CDLL(lib)


class _Runtime:
    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def setDevice(device):
        pass


def install_stubs():
    """Replace the framework modules and the driver; returns the stub library (or None)."""
    sys.modules["torch"] = _fake_torch()
    from ropekv import _arrays as ar
    from ropekv import _launch

    ar.KNOWN_TYPES[:] = [FakeCupyArray, sys.modules["torch"].Tensor]
    _launch.function_pointer = lambda *a, **k: 0x1000
    import ropekv.qkv

    ropekv.qkv._compute_capability = lambda device: 90  # a Hopper GPU, as on the H200
    ropekv.qkv._sm_count = lambda device: 132
    ropekv.qkv._active_clusters = lambda *a: None  # (the driver has no say here)
    import ropekv.paged

    ropekv.paged.l2_bytes = lambda device: 60 << 20  # the H200's L2 (cached there too)
    _launch.current_stream_ptr = lambda device=-1: 0
    _launch._RUNTIME[0] = _Runtime
    _launch.Output._cupy = lambda self: FakeCupyArray(np.empty(self.shape, self.dtype))
    lib = _stub_library()
    if lib is not None:
        fn = lib.cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        _launch._launch_kernel = fn  # called as cupy_backends' launchKernel is
        # the C replay (ropekv/_native.c) launches through the stub's functions
        _launch._native_launchers = lambda: tuple(
            ctypes.cast(f, ctypes.c_void_p).value
            for f in (lib.cuLaunchKernel, lib.cuLaunchKernelEx)
        )
    else:
        _launch._launch_kernel = lambda *a: 0
        _launch._native_launchers = _no_driver
    return lib


def _no_driver():
    raise OSError("no C launch stub: the Python replay is timed")


def use_replay(kind):
    """Time the C replay (``"c"``) or the Python one (``"python"``): rebinds every op (its plans
    dropped)."""
    from ropekv.bench.timing import launch_ops

    for op in launch_ops():
        op.clear()
        op.reset_caller(native=kind != "python")


def host_workloads(names):
    """``{case: workload}`` of the bench cases, built on the host (NumPy)."""
    from ropekv import bench

    specs = {s.name: s for s in bench.bench_specs()}
    module = sys.modules[type(specs[names[0]]).__module__]
    saved = getattr(module, "_cp", None)
    module._cp = lambda: np  # the workloads build on the host
    try:
        return {n: specs[n].make() for n in names}
    finally:
        module._cp = saved


class Case:
    """One workload's call on fake device arrays of one kind."""

    def __init__(self, workload, convert):
        import copy

        self.w = copy.copy(workload)
        self.w.a = {k: convert(v) for k, v in workload.a.items()}
        self.o = {n: self.w.a[n] for n in workload.outputs_names}
        self.call = self.w.bound(self.o)  # the ropekv call, its arguments built once

    def __call__(self):
        return self.call()


# the ops that take layer_idx: their bench workload module and the cache arrays that gain a
# leading layer dimension (tools/hosttime.py uses the same table)
LAYERED = {
    "qk_rmsnorm_rope_append_paged_kv_cache": ("qknorm", ("k_cache", "v_cache")),
    "fused_qkv_matmul_append_paged_kv_cache": ("qkv", ("k_cache", "v_cache")),
    "mla_rope_rmsnorm_append_paged_kv_cache": ("mla", ("ckv", "kpe")),
}


class Cycling:
    """An op called with ``layer_idx`` cycling over ``layers`` layers (None: ``layer_idx=None``),
    as an engine's step calls it once per layer."""

    def __init__(self, fn, layers):
        self.fn, self.layers, self.turn = fn, layers, 0

    def __call__(self, *args, **kwargs):
        layer = None
        if self.layers is not None:
            layer = self.turn
            self.turn = layer + 1 if layer + 1 < self.layers else 0
        return self.fn(*args, layer_idx=layer, **kwargs)


class LayeredCase(Case):
    """A case on caches of ``layers`` layers called through :class:`Cycling` (``layers`` None:
    the one-layer caches through the same wrapper). ``install()`` puts the wrapper in place of
    the op in ``ropekv`` (the workloads look the op up there on each call)."""

    def __init__(self, workload, convert, name, layers):
        import ropekv

        super().__init__(workload, convert)
        if layers is not None:
            for c in LAYERED[name][1]:
                one = workload.a[c]
                self.o[c] = convert(np.zeros((layers, *one.shape), one.dtype))
        self.name, self.fn = name, getattr(ropekv, name)
        self.wrapper = Cycling(self.fn, layers)

    def __call__(self):  # through the workload, which looks the (installed) wrapper up per call
        return self.w.call(self.o)

    def install(self):
        import ropekv

        setattr(ropekv, self.name, self.wrapper)

    def uninstall(self):
        import ropekv

        setattr(ropekv, self.name, self.fn)


def layered_name(w):
    module = type(w).__module__.rsplit(".", 1)[-1]
    for name, (op_module, caches) in LAYERED.items():
        if module == op_module and all(c in w.a for c in caches):
            return name
    return None


def per_call_us(fn, n):
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


class Touch:
    """Reads ``mb`` MB of host memory per call (0: nothing): the CPU's caches evicted between two
    first calls, as another op's call evicts them at an op's edge (``--touch``)."""

    def __init__(self, mb=0):
        self.buf = np.ones(int(mb * (1 << 20)) // 8, np.int64) if mb else None

    def __call__(self):
        if self.buf is not None:
            self.buf.sum()


TOUCH = Touch()  # --touch sets it


def first_call_us(fn, n=20):
    """Median host time of ``n`` first calls of ``fn`` (the bench's measurement, no device to
    synchronise: ``ropekv.bench.timing.first_call_us``), :data:`TOUCH` run before each (outside
    the timing)."""
    from ropekv.bench import timing

    if TOUCH.buf is None:
        return timing.first_call_us(fn, n=n)
    times = []
    for _ in range(n):
        timing.clear_plans()
        TOUCH()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    timing.clear_plans()
    return float(np.median(times))


# the steps of a first call that --phases times (module, attribute), beside the op's _prepare and
# the C replay's calls (the layout miss and the first replay)
PHASES = (
    ("ropekv._arrays", "read_arguments"),
    ("ropekv._checks", "check_no_overlap"),
    ("ropekv._launch", "native_plan"),
)


def timer(acc, label, f):
    """``f`` wrapped so that each call adds its nanoseconds to ``acc[label]``."""

    def g(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t0

    return g


class TimedCaller:
    """An op's C replay with its calls timed: ``caller`` (the layout miss, and the first replay
    when ``_launch.FIRST_LAUNCH_DIRECT`` is off) and ``launch`` (a new plan's first launch)."""

    def __init__(self, caller, timed):
        self._call = timed("caller", caller)
        self.launch = timed("launch", caller.launch)

    def __call__(self, *args):
        return self._call(*args)


def first_phases(fn, n=50):
    """``{step: median us}`` of ``fn``'s first calls: the steps of :data:`PHASES`, the op's
    ``prepare`` and its C replay calls (``caller``: the layout miss plus the first replay), each
    wrapped in a timer for the run and restored after."""
    import importlib

    from ropekv.bench.timing import clear_plans, launch_ops

    acc, saved = {}, []
    timed = functools.partial(timer, acc)
    for mod_name, attr in PHASES:
        mod = importlib.import_module(mod_name)
        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, timed(attr, getattr(mod, attr)))
    for op in launch_ops():
        saved.append((op, "prepare", op.prepare))
        op.prepare = timed("prepare", op.prepare)
    fn()  # binds the callers
    for op in launch_ops():
        if op.caller is not None:
            saved.append((op, "caller", op.caller))
            op.caller = TimedCaller(op.caller, timed)
    rows = {}
    try:
        for _ in range(n):
            clear_plans()
            TOUCH()
            acc.clear()
            t0 = time.perf_counter_ns()
            fn()
            acc["total"] = time.perf_counter_ns() - t0
            for k, v in acc.items():
                rows.setdefault(k, []).append(v / 1e3)
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)
    return {k: float(np.median(v)) for k, v in rows.items()}


def add_case_arguments(parser, calls):
    """The options this tool and ``tools/hosttime.py`` share: ``--calls`` (default ``calls``),
    ``--cases``, ``--layers``, ``--replay``."""
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--cases", nargs="*", default=CASES)
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="also time multi-layer caches of this many layers (layer_idx)",
    )
    parser.add_argument(
        "--replay",
        choices=("c", "python"),
        default="c",
        help="the C replay of plans (ropekv/_native.c, the default where it "
        "builds) or the Python one",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="cProfile each replay")
    parser.add_argument("--first-profile", action="store_true", help="cProfile the first calls")
    parser.add_argument(
        "--phases", action="store_true", help="median time of each step of the first calls"
    )
    add_case_arguments(parser, calls=20000)
    parser.add_argument(
        "--first-launch",
        choices=("direct", "caller"),
        default="direct",
        help="a new plan's first launch: on the pointers the first call read (Caller.launch, "
        "the default) or through a second call of the C replay (as before)",
    )
    parser.add_argument(
        "--touch",
        type=float,
        default=0,
        metavar="MB",
        help="read this many MB of host memory before each first call (the op-edge model)",
    )
    args = parser.parse_args(argv)
    global TOUCH
    TOUCH = Touch(args.touch)
    from ropekv import _launch

    _launch.FIRST_LAUNCH_DIRECT = args.first_launch == "direct"
    lib = install_stubs()
    from ropekv.bench.timing import clear_plans  # after the stubs, as every use of ropekv.bench

    print(f"launch stub: {'compiled C (ctypes)' if lib else 'Python no-op'}")
    use_replay(args.replay)
    workloads = host_workloads(args.cases)
    rows = []
    for name, w in workloads.items():
        cupy_case, torch_case = Case(w, to_cupy), Case(w, to_torch)
        try:
            cupy_case()
        except ImportError as exc:  # the cuBLAS path of the fused QKV op needs the library
            print(f"{name}: skipped ({exc})")
            continue
        first = first_call_us(cupy_case)
        first_t = first_call_us(torch_case)
        cp_us = per_call_us(cupy_case, args.calls)
        th_us = per_call_us(torch_case, args.calls)
        rows.append((name, first, first_t, cp_us, th_us))
        op_name = layered_name(w) if args.layers else None
        if op_name is not None:
            for label, layers in (
                ("wrapper, one layer", None),
                (f"{args.layers} layers", args.layers),
            ):
                lc, lt = (LayeredCase(w, f, op_name, layers) for f in (to_cupy, to_torch))
                lc.install()
                try:
                    rows.append(
                        (
                            f"  {label}",
                            first_call_us(lc),
                            first_call_us(lt),
                            per_call_us(lc, args.calls),
                            per_call_us(lt, args.calls),
                        )
                    )
                finally:
                    lc.uninstall()
        for label, case in (("cupy", cupy_case), ("torch", torch_case)):
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls // 4):
                    case()
                prof.disable()
                print(f"==== replay profile: {name} ({label})")
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)
            if args.phases:
                steps = first_phases(case)
                print(f"first-call steps (median us), {name} ({label}): ", end="")
                print(", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
            if args.first_profile:
                prof = cProfile.Profile()
                for _ in range(50):
                    clear_plans()
                    TOUCH()
                    prof.enable()
                    case()
                    prof.disable()
                print(f"==== first-call profile: {name} ({label})")
                pstats.Stats(prof, stream=sys.stdout).sort_stats("cumtime").print_stats(30)
    from ropekv import _native

    print(
        f"replay: {_native.state() if args.replay == 'c' else 'Python plan replay (--replay python)'}"
    )
    print(f"{'case':34s} {'first cupy':>11s} {'first torch':>12s} {'cupy':>8s} {'torch':>8s}")
    for name, first, first_t, cp_us, th_us in rows:
        print(f"{name:34s} {first:9.1f}us {first_t:10.1f}us {cp_us:6.2f}us {th_us:6.2f}us")
    return rows


if __name__ == "__main__":
    main()
