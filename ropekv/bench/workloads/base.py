"""What every workload shares: the op table, the :class:`Workload` base class (inputs, outputs,
sampled rows), the case record :class:`CaseSpec`, the model shapes, and the PyTorch maths the
PyTorch peers compose."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ropekv import _registry
from ropekv.bench.arrays import _assign, _bits, _copy, _Gen, _torch, to_device, to_numpy

# op key (--ops) -> the ropekv functions it measures; an op runs when its first function exists
# (from ropekv/_registry.py)
OP_FUNCTIONS = _registry.workloads()
OPS = tuple(OP_FUNCTIONS)
SAMPLE_TOKENS = 512  # tokens whose outputs are compared between runners in the bench

LLAMA = {"Hq": 32, "Hkv": 8, "D": 128}  # Llama-3-8B attention
DSV3 = {"Hq": 128, "L": 512, "R": 64}  # DeepSeek-V3 MLA
QWEN3 = {"Hq": 32, "Hkv": 8, "D": 128}  # Qwen3-8B
QWEN3_32B = {"Hq": 64, "Hkv": 8, "D": 128}  # the Cake kernels' (64, 8) head configuration
SWEEP = (1, 4, 16, 64, 128, 256, 1024, 4096, 8192, 16384, 32768)
DECODE_SWEEP = (1, 4, 16, 64, 128, 256)  # tokens (one per request) of every op's decode sweep


def _ropekv():
    import ropekv

    return ropekv


def op_available(op):
    return hasattr(_ropekv(), OP_FUNCTIONS[op][0])


_recording: list = []  # set by Workload.bound: _fn hands out a recorder of the call instead


def _fn(name):
    fn = getattr(_ropekv(), name)
    if not _recording:
        return fn
    calls = _recording[-1]
    return lambda *args, **kwargs: calls.append(functools.partial(fn, *args, **kwargs))


class Workload:
    """Inputs and initial outputs of one case, and the ropekv call on them.

    ``a`` holds every array (inputs and the pristine initial outputs); ``OUTPUTS`` names those the
    op writes (for in-place ops the written input too). ``sample`` maps a comparison name to
    ``(array name, host index tuple)``: the rows compared between runners in the bench."""

    op = ""
    compare_mode = "elementwise"
    OUTPUTS: tuple = ()

    def __init__(self, xp, seed=0, poison=False, **kw):
        self.xp, self.kw, self.poison = xp, kw, poison
        self.g = _Gen(xp, seed)
        self.a: dict[str, Any] = {}
        self.sample: dict[str, tuple] = {}
        self.build(**kw)

    # the pieces each op defines
    def build(self, **kw):
        raise NotImplementedError

    def call(self, o):
        raise NotImplementedError

    def bound(self, o, **options):
        """``call(o, **options)`` with its arguments built once: a ``functools.partial`` of the
        ropekv function, so that a host-time measurement times ropekv's call and not the
        workload's argument building (a dict of keywords per call, about 1 us on the H200's
        host). Falls back to the workload's own call where it makes other than one ropekv call."""
        calls: list = []
        _recording.append(calls)
        try:
            self.call(o, **options)
        finally:
            _recording.pop()
        if len(calls) == 1:
            return calls[0]
        return functools.partial(self.call, o, **options)

    def options(self):
        """``ropekv bench --options``: the op's options this case can time, ``{label: (extra
        keyword arguments of the call, checked)}``. Each runs as the runner ``ropekv[+label]``
        beside the plain call; its ratio is the cost of the option when on. ``checked``: the
        option leaves the sampled outputs as the plain call writes them, so they are compared;
        one that changes them (another norm order, say) is timed only (its results are the GPU
        tests' business)."""
        return {}

    def torch_fn(self, t, o):
        """A callable running the same maths in PyTorch on torch views ``t`` (inputs) and ``o``
        (outputs); None when there is no such composition."""
        return

    def flashinfer_fn(self, t, o):
        return None

    # shared machinery
    @property
    def outputs_names(self):
        return tuple(n for n in self.OUTPUTS if self.a.get(n) is not None)

    def to_device(self):
        w = copy.copy(self)
        import cupy

        w.xp = cupy
        w.a = {k: to_device(v) for k, v in self.a.items()}
        return w

    def new_outputs(self):
        return {n: _copy(self.a[n]) for n in self.outputs_names}

    def reset(self, o):
        for n in self.outputs_names:
            if n in o:
                _assign(o[n], self.a[n])

    def outputs(self, o=None, full=False):
        """Host copies of the outputs: whole arrays (``full``) or the sampled rows."""
        o = self.a if o is None else o
        if full:
            return {n: to_numpy(o[n]) for n in self.outputs_names if n in o}
        out = {}
        for name, (arr, idx) in self.sample.items():
            if o.get(arr) is None:
                continue
            x = o[arr]
            dev = tuple(self._index(i) for i in idx)
            out[name] = to_numpy(_bits(x)[dev]).view(np.dtype(x.dtype))
        return out

    def _index(self, i):
        if isinstance(i, np.ndarray) and self.xp is not np:
            return self.xp.asarray(i)
        return i

    def _sample_tokens(self, T):
        if T <= SAMPLE_TOKENS:
            return np.arange(T)
        return np.sort(self.g.rng.choice(T, SAMPLE_TOKENS, replace=False))


def _tcast(x, dtype):
    """float32 -> ``dtype``, saturating for fp8 (torch's own cast overflows to NaN)."""
    torch = _torch()
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        m = torch.finfo(dtype).max
        x = x.clamp(-m, m)
    return x.to(dtype)


def _trope(x, cos, sin, is_neox):
    """Rotate the leading ``2 * cos.shape[-1]`` dims of float32 ``x``; the rest pass through."""
    torch = _torch()
    h = cos.shape[-1]
    if is_neox:
        a, b = x[..., :h], x[..., h : 2 * h]
        rot = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = x[..., 0 : 2 * h : 2], x[..., 1 : 2 * h : 2]
        rot = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return rot if x.shape[-1] == 2 * h else torch.cat([rot, x[..., 2 * h :]], -1)


def _trms(x, gamma, eps):
    torch = _torch()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gamma.float()


def _pages(B, pages_per_request, g, shuffle=True, spare=0):
    """``B * pages_per_request`` distinct page ids out of ``B * pages_per_request + spare``."""
    total = B * pages_per_request + spare
    ids = g.rng.permutation(total) if shuffle else np.arange(total)
    return ids[: B * pages_per_request], total


def _cos_sin(P, R):
    from ropekv.rope import cos_sin_cache

    return cos_sin_cache(P, R, base=500000.0)


class _RaggedMixin:
    """Ragged batch over a block table (MAX / vLLM convention), shared by mla, qknorm, qkv."""

    def ragged(self, B, S, prefix, page_size, spare_pages=0):
        g = self.g
        seq = prefix + S
        per = -(-seq // page_size)
        ids, num_pages = _pages(B, per, g, spare=spare_pages)
        self.a["input_row_offsets"] = g.put((np.arange(B + 1) * S).astype(np.int32))
        self.a["cache_lengths"] = g.put(np.full(B, prefix, np.int32))
        self.a["block_table"] = g.put(ids.reshape(B, per).astype(np.int32))
        batch = np.repeat(np.arange(B), S)
        self.a["token_batch"] = g.put(batch.astype(np.int32))  # for the PyTorch composition
        pos = prefix + np.tile(np.arange(S), B)
        self.page = ids.reshape(B, per)[batch, pos // page_size].astype(np.int64)
        self.entry = (pos % page_size).astype(np.int64)
        self.positions, self.batch, self.page_size, self.per = pos, batch, page_size, per
        return num_pages, seq


def _torch_ragged_addr(offsets, lens, table, b, ps):
    """(p, page, entry) per token from the ragged index arrays, on the device."""
    torch = _torch()
    b = b.long()
    p = lens.long()[b] + torch.arange(b.shape[0], device=b.device) - offsets.long()[b]
    return p, table.long()[b, p // ps], p % ps


# ---- the case record -----------------------------------------------------------------------------


@dataclasses.dataclass
class CaseSpec:
    op: str
    name: str
    tokens: int
    nbytes: int
    make: Callable[..., Workload]  # make(xp=None): builds the workload (on the device by default)
    decode: bool = False
    quick: bool = False
    compile: bool = False  # torch.compile peer (compiling costs seconds per dtype combination)
    series: str = ""  # the token sweep this case belongs to (plotted as a line)
    flops: int = 0
    weight_bytes: int = 0  # bytes of weights (and scales) streamed per call (QKV projection)
    weight_format: str = ""
    note: str = ""


def _cp():
    import cupy

    return cupy


def _lazy(cls, **kw):
    """``make(xp=None)`` of a case: the workload built with CuPy, or with ``xp`` (NumPy)."""
    return lambda xp=None: cls(xp if xp is not None else _cp(), seed=1, **kw)
