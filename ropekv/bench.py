"""``ropekv bench``: every op against its peers and the copy bandwidth, in one run.

One *workload* per case builds the inputs once (CuPy arrays; the same memory is handed to PyTorch
and FlashInfer through DLPack), and gives every runner (ropekv and each peer) its own outputs with
the same initial contents. Before any timing, each runner is called once and its outputs are
compared with ropekv's on a sample of tokens (q rows and the cache rows those tokens address); a
peer that disagrees is still timed but flagged in the table.

Timing: prefill cases are timed with CUDA events around each call, after a spin kernel that keeps
the host's enqueueing out of the measurement, with the L2 flushed by a read when the case's bytes
would fit in it; the median of many calls. Decode cases (launch-bound) report the per-call time
under CUDA-graph replay, plus the host time per call of back-to-back eager calls. The copy
bandwidth (a 1 GiB device-to-device copy, bytes read + written) is measured in the same run.

The same workloads, at small shapes and built on the host, are the cases of ``ropekv check``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from ropekv import bytes as nbytes_of
from ropekv.check import BF16, FP8, compare_all, gpu_status, to_device, to_numpy

F16 = np.dtype(np.float16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)

# op key (--ops) -> the ropekv functions it measures; an op runs when its first function exists.
OP_FUNCTIONS = {
    "contiguous": ("apply_rope_write_kv",),
    "paged": ("rope_quantize_fp8_append_paged_kv_cache", "rope_append_paged_kv_cache"),
    "mla": ("mla_rope_rmsnorm_append_paged_kv_cache",),
    "qknorm": ("qk_rmsnorm_rope_append_paged_kv_cache",),
    "qkv": ("fused_qkv_matmul_append_paged_kv_cache",),
}
OPS = tuple(OP_FUNCTIONS)
PEERS = ("flashinfer", "flashinfer-cake", "torch", "torch-compile", "cublas", "steps")
L2_FLUSH_BELOW = 120 << 20  # cases moving fewer bytes than this could be served from the 60 MB L2
SAMPLE_TOKENS = 512  # tokens whose outputs are compared between runners in the bench


def op_available(op):
    import ropekv

    return hasattr(ropekv, OP_FUNCTIONS[op][0])


def _fn(name):
    import ropekv

    return getattr(ropekv, name)


def _dtname(dt):
    return {F16: "fp16", BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}.get(np.dtype(dt), str(dt))


# ---- arrays on either side -----------------------------------------------------------------------


def _special(dt):
    dt = np.dtype(dt)
    return dt in FP8 or dt == BF16


def _bits(x):
    """Same-size integer view of an fp8 / bfloat16 array (what CuPy kernels can copy and index)."""
    dt = np.dtype(x.dtype)
    if _special(dt):
        return x.view(np.uint8 if dt.itemsize == 1 else np.uint16)
    return x


def _copy(x):
    dt = np.dtype(x.dtype)
    return _bits(x).copy().view(dt) if _special(dt) else x.copy()


def _assign(dst, src):
    _bits(dst)[...] = _bits(src)


class _Gen:
    """Seeded random arrays in NumPy (``xp=numpy``) or directly on the device (``xp=cupy``)."""

    def __init__(self, xp, seed):
        self.xp, self.rng = xp, np.random.default_rng(seed)
        if xp is not np:
            xp.random.seed(seed)

    def randn(self, shape, dtype, scale=1.0, offset=0.0):
        if self.xp is np:
            a = self.rng.standard_normal(shape, dtype=np.float32)
        else:
            a = self.xp.random.standard_normal(shape, dtype=np.float32)
        if scale != 1.0 or offset != 0.0:
            a = a * np.float32(scale) + np.float32(offset)
        dtype = np.dtype(dtype)
        if dtype == BF16 and self.xp is not np:  # round to nearest even through the bits
            u = a.view(np.uint32)
            u = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
            return u.astype(np.uint16).view(BF16)
        if dtype in FP8:  # only for poisoned caches in `ropekv check`, built on the host
            return np.asarray(np.clip(a, -240, 240), np.float32).astype(dtype)
        return a.astype(dtype)

    def zeros(self, shape, dtype):
        dtype = np.dtype(dtype)
        if _special(dtype):
            return self.xp.zeros(shape, np.uint8 if dtype.itemsize == 1 else np.uint16).view(dtype)
        return self.xp.zeros(shape, dtype)

    def cache(self, shape, dtype, poison):
        """A cache: random contents when ``poison`` (checks), zeros otherwise (bench)."""
        return self.randn(shape, dtype) if poison else self.zeros(shape, dtype)

    def put(self, host):
        return host if self.xp is np else to_device(np.ascontiguousarray(host))


# ---- workloads -----------------------------------------------------------------------------------


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


def _torch():
    import torch

    return torch


def _to_torch(x):
    """Zero-copy torch view of a CuPy or NumPy array (fp8 / bfloat16 through a same-size
    integer view)."""
    if x is None:
        return None
    torch = _torch()
    dt = np.dtype(x.dtype)
    wrap = torch.from_numpy if isinstance(x, np.ndarray) else torch.from_dlpack
    if _special(dt):
        target = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2, BF16: torch.bfloat16}[dt]
        return wrap(x.view(np.uint8 if dt.itemsize == 1 else np.int16)).view(target)
    return wrap(x)


def _torch_dtype(dt):
    torch = _torch()
    return {F16: torch.float16, BF16: torch.bfloat16, E4M3: torch.float8_e4m3fn,
            E5M2: torch.float8_e5m2, np.dtype(np.float32): torch.float32}[np.dtype(dt)]


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
        a, b = x[..., :h], x[..., h:2 * h]
        rot = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = x[..., 0:2 * h:2], x[..., 1:2 * h:2]
        rot = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return rot if x.shape[-1] == 2 * h else torch.cat([rot, x[..., 2 * h:]], -1)


def _trms(x, gamma, eps):
    torch = _torch()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gamma.float()


def _pages(B, pages_per_request, g, shuffle=True, spare=0):
    """``B * pages_per_request`` distinct page ids out of ``B * pages_per_request + spare``."""
    total = B * pages_per_request + spare
    ids = g.rng.permutation(total) if shuffle else np.arange(total)
    return ids[:B * pages_per_request], total


class ContiguousWL(Workload):
    """:func:`ropekv.apply_rope_write_kv`: (B, S) tokens into a (B, 2, Hkv, C, D) cache."""

    op = "contiguous"
    OUTPUTS = ("q", "cache")

    def build(self, B, S, Hq, Hkv, D, C, dtype, cache_dtype, R=None, decode=False, is_neox=True,
              kv_scale=(1.0, 1.0)):
        g, R = self.g, R or D
        self.B, self.S, self.R, self.is_neox = B, S, R, is_neox
        self.a["q"] = g.randn((B, S, Hq, D), dtype)
        self.a["k"] = g.randn((B, S, Hkv, D), dtype)
        self.a["v"] = g.randn((B, S, Hkv, D), dtype)
        self.a["cache"] = g.cache((B, 2, Hkv, C, D), cache_dtype, self.poison)
        self.a["table"] = g.put(_cos_sin(C, R))
        if decode:
            lens = g.rng.integers(S, C + 1, size=B).astype(np.int32)
            self.a["kv_end_lens"] = g.put(lens)
        else:
            lens = np.full(B, S, np.int32)
        self.slots = lens[:, None].astype(np.int64) - S + np.arange(S)
        if np.dtype(cache_dtype) in FP8:
            self.a["kv_scale"] = g.put(np.asarray(kv_scale, np.float32))
        tok = self._sample_tokens(B * S)
        b, s = tok // S, tok % S
        slot = self.slots[b, s]
        self.sample = {"q": ("q", (b, s)), "k_rows": ("cache", (b, 0, slice(None), slot)),
                       "v_rows": ("cache", (b, 1, slice(None), slot))}

    def call(self, o):
        a = self.a
        _fn("apply_rope_write_kv")(o["q"], a["k"], a["v"], o["cache"], a["table"],
                                   kv_end_lens=a.get("kv_end_lens"), kv_scale=a.get("kv_scale"),
                                   is_neox=self.is_neox)

    def torch_fn(self, t, o):
        R, neox = self.R, self.is_neox
        scale = t.get("kv_scale")
        ks, vs = (scale[0], scale[1]) if scale is not None else (1.0, 1.0)
        return _torch_contiguous, (o["q"], t["k"], t["v"], o["cache"], t["table"],
                                   t.get("kv_end_lens"), ks, vs, R, neox)


def _torch_contiguous(q, k, v, cache, table, lens, ks, vs, R, neox):
    """RoPE, then K and V rows into the (B, 2, Hkv, C, D) cache, indexed as rows of D."""
    torch = _torch()
    B, S, Hkv, D = k.shape
    C = cache.shape[3]
    ar = torch.arange(S, device=q.device)
    slots = ar[None, :].expand(B, S) if lens is None else lens.long()[:, None] - S + ar
    cs = table[slots]
    cos, sin = cs[..., None, :R // 2], cs[..., None, R // 2:]
    q.copy_(_trope(q.float(), cos, sin, neox).to(q.dtype))
    heads = torch.arange(Hkv, device=q.device)
    b = torch.arange(B, device=q.device)[:, None, None]
    rows = ((b * 2 * Hkv + heads) * C + slots[..., None]).reshape(-1)  # K rows, (B * S * Hkv,)
    flat = cache.view(-1, D)
    flat[rows] = _tcast(_trope(k.float(), cos, sin, neox) / ks, cache.dtype).reshape(-1, D)
    flat[rows + Hkv * C] = _tcast(v.float() / vs, cache.dtype).reshape(-1, D)


def _cos_sin(P, R):
    from ropekv.rope import cos_sin_cache

    return cos_sin_cache(P, R, base=500000.0)


class PagedWL(Workload):
    """The FlashInfer-compatible paged op: GQA/MHA (3-D ``k_rope``) or MLA (2-D ``k_rope``)."""

    op = "paged"
    OUTPUTS = ("q_rope_out", "q_nope_out", "cache0", "cache1")

    def build(self, B, S, prefix, Hq, dtype, cache_dtype, Hkv=8, D=128, R=None, mla=False, L=512,
              page_size=16, layout="NHD", index_dtype=np.int32, is_neox=True, scales=(1.0, 1.0),
              spare_pages=0):
        g = self.g
        T, seq = B * S, prefix + S
        self.mla, self.layout, self.page_size, self.is_neox = mla, layout, page_size, is_neox
        self.dtype, self.cache_dtype = np.dtype(dtype), np.dtype(cache_dtype)
        self.fp8 = self.cache_dtype in FP8
        self.scales = scales
        per = -(-seq // page_size)
        ids, num_pages = _pages(B, per, g, spare=spare_pages)
        batch = np.repeat(np.arange(B), S)
        positions = prefix + np.tile(np.arange(S), B)
        indptr = np.arange(B + 1) * per
        self.page = ids[indptr[batch] + positions // page_size].astype(np.int64)
        self.entry = (positions % page_size).astype(np.int64)
        self.seq_len, self.B = seq, B
        for name, v in (("kv_indices", ids), ("kv_indptr", indptr), ("batch_indices", batch),
                        ("positions", positions), ("pos_ids", positions)):
            self.a[name] = g.put(v.astype(index_dtype))
        if mla:
            R = R or 64
            self.R = R
            self.a["q_rope"] = g.randn((T, Hq, R), dtype)
            self.a["q_nope"] = g.randn((T, Hq, L), dtype)
            self.a["k_rope"] = g.randn((T, R), dtype)
            self.a["k_nope"] = g.randn((T, L), dtype)
            self.a["v"] = None
            self.a["cache0"] = g.cache((num_pages, page_size, L), cache_dtype, self.poison)
            self.a["cache1"] = g.cache((num_pages, page_size, R), cache_dtype, self.poison)
        else:
            R = R or D
            self.R = R
            q = g.randn((T, Hq, D), dtype)
            k = g.randn((T, Hkv, D), dtype)
            # rope and nope parts sliced out of one buffer, as engines hold them
            self.a["q_rope"], self.a["q_nope"] = q[..., :R], (q[..., R:] if R < D else None)
            self.a["k_rope"], self.a["k_nope"] = k[..., :R], (k[..., R:] if R < D else None)
            self.a["v"] = g.randn((T, Hkv, D), dtype)
            shape = ((num_pages, page_size, Hkv, D) if layout == "NHD"
                     else (num_pages, Hkv, page_size, D))
            self.a["cache0"] = g.cache(shape, cache_dtype, self.poison)
            self.a["cache1"] = g.cache(shape, cache_dtype, self.poison)
        self.a["table"] = g.put(_cos_sin(seq, R))
        self.a["q_rope_out"] = g.zeros(self.a["q_rope"].shape, cache_dtype)
        if self.a["q_nope"] is not None:
            self.a["q_nope_out"] = g.zeros(self.a["q_nope"].shape, cache_dtype)
        tok = self._sample_tokens(T)
        page, entry = self.page[tok], self.entry[tok]
        rows = (page, entry) if mla or layout == "NHD" else (page, slice(None), entry)
        self.sample = {"q_rope_out": ("q_rope_out", (tok,)), "q_nope_out": ("q_nope_out", (tok,)),
                       "cache0_rows": ("cache0", rows), "cache1_rows": ("cache1", rows)}

    def call(self, o):
        a = self.a
        name = OP_FUNCTIONS["paged"][0 if self.fp8 else 1]
        return _fn(name)(
            a["q_rope"], a["k_rope"], a["q_nope"], a["k_nope"], a["v"], a["table"], a["pos_ids"],
            (o["cache0"], o["cache1"]), a["kv_indices"], a["kv_indptr"], a["batch_indices"],
            a["positions"], is_neox=self.is_neox,
            quantize_dtype=self.cache_dtype if self.fp8 else None, quant_scale_q=self.scales[0],
            quant_scale_kv=self.scales[1], page_size=self.page_size, kv_layout=self.layout,
            q_rope_out=o["q_rope_out"], q_nope_out=o.get("q_nope_out"))

    def torch_fn(self, t, o):
        ps, neox, mla, nhd = self.page_size, self.is_neox, self.mla, self.layout == "NHD"
        sq, skv = self.scales if self.fp8 else (1.0, 1.0)
        R = self.R

        def fn(q_rope, k_rope, q_nope, k_nope, v, table, pos_ids, kv_indices, kv_indptr,
               batch_indices, positions, c0, c1, q_rope_out, q_nope_out):
            torch = _torch()
            cs = table[pos_ids.long()]
            pos = positions.long()
            page = kv_indices[kv_indptr[batch_indices.long()].long() + pos // ps].long()
            entry = pos % ps
            cos, sin = cs[:, None, :R // 2], cs[:, None, R // 2:]
            q_rope_out.copy_(_tcast(_trope(q_rope.float(), cos, sin, neox) * sq, q_rope_out.dtype))
            if q_nope is not None:
                q_nope_out.copy_(_tcast(q_nope.float() * sq, q_nope_out.dtype))
            if mla:
                c0[page, entry] = _tcast(k_nope.float() * skv, c0.dtype)
                c1[page, entry] = _tcast(
                    _trope(k_rope.float(), cs[:, :R // 2], cs[:, R // 2:], neox) * skv, c1.dtype)
                return
            k = _trope(k_rope.float(), cos, sin, neox)
            if k_nope is not None:
                k = torch.cat([k, k_nope.float()], -1)
            kq, vq = _tcast(k * skv, c0.dtype), _tcast(v.float() * skv, c1.dtype)
            if nhd:
                c0[page, entry], c1[page, entry] = kq, vq
            else:
                c0[page, :, entry], c1[page, :, entry] = kq, vq

        return fn, (t["q_rope"], t["k_rope"], t.get("q_nope"), t.get("k_nope"), t.get("v"),
                    t["table"], t["pos_ids"], t["kv_indices"], t["kv_indptr"],
                    t["batch_indices"], t["positions"], o["cache0"], o["cache1"],
                    o["q_rope_out"], o.get("q_nope_out"))

    def flashinfer_fn(self, t, o):
        """FlashInfer 0.5.3: the fused op for fp8 caches; for fp16/bf16 caches (no fused op
        there) ``apply_rope_with_cos_sin_cache_inplace`` + ``append_paged_kv_cache``."""
        from flashinfer.page import append_paged_kv_cache
        from flashinfer.rope import (
            apply_rope_with_cos_sin_cache_inplace,
            rope_quantize_fp8_append_paged_kv_cache,
        )

        caches = (o["cache0"], o["cache1"])
        if self.fp8:
            def fused():
                rope_quantize_fp8_append_paged_kv_cache(
                    t["q_rope"], t["k_rope"], t.get("q_nope"), t.get("k_nope"), t.get("v"),
                    t["table"], t["pos_ids"], caches, t["kv_indices"], t["kv_indptr"],
                    t["batch_indices"], t["positions"], is_neox=self.is_neox,
                    quantize_dtype=_torch_dtype(self.cache_dtype), quant_scale_q=self.scales[0],
                    quant_scale_kv=self.scales[1], page_size=self.page_size,
                    kv_layout=self.layout, q_rope_out=o["q_rope_out"],
                    q_nope_out=o.get("q_nope_out"))
            return fused, None
        if self.mla or t.get("q_nope") is not None:
            return None  # the two-launch path needs full-width rotary heads
        torch = _torch()
        # in place: the peer's q output is its own copy of q, k is roped in its own copy
        q = o["q_rope_out"]
        k = torch.empty_like(t["k_rope"])
        T = q.shape[0]
        seq = self.seq_len
        last = torch.full((self.B,), (seq - 1) % self.page_size + 1, dtype=torch.int32,
                          device=q.device)
        head = q.shape[-1]

        def reset():
            q.copy_(t["q_rope"])
            k.copy_(t["k_rope"])

        def two_launches():
            apply_rope_with_cos_sin_cache_inplace(t["pos_ids"], q.view(T, -1), k.view(T, -1),
                                                  head, t["table"], is_neox=self.is_neox)
            append_paged_kv_cache(k, t["v"], t["batch_indices"], t["positions"], caches,
                                  t["kv_indices"], t["kv_indptr"], last, kv_layout=self.layout)
        return two_launches, reset


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


class MlaWL(_RaggedMixin, Workload):
    """:func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache` with the (ckv, kpe) cache layout."""

    op = "mla"
    OUTPUTS = ("q_rope_out", "ckv", "kpe")

    def build(self, B, S, prefix, Hq, L, R, dtype, cache_dtype, page_size=16, is_neox=False,
              kv_norm_dim=None, kv_scale=None, eps=1e-6):
        g = self.g
        num_pages, seq = self.ragged(B, S, prefix, page_size)
        T = B * S
        self.L, self.R, self.is_neox, self.eps = L, R, is_neox, eps
        self.nd = L if kv_norm_dim is None else kv_norm_dim
        self.kv_norm_dim = kv_norm_dim
        self.fp8 = np.dtype(cache_dtype) in FP8
        self.kv_scale = (kv_scale or 1.0) if self.fp8 else None
        self.a["q_rope"] = g.randn((T, Hq, R), dtype)
        self.a["kv"] = g.randn((T, L + R), dtype)
        self.a["gamma"] = g.randn((self.nd,), dtype, scale=0.1, offset=1.0)
        self.a["table"] = g.put(_cos_sin(seq, R))
        self.a["q_rope_out"] = g.zeros((T, Hq, R), dtype)
        self.a["ckv"] = g.cache((num_pages, page_size, L), cache_dtype, self.poison)
        self.a["kpe"] = g.cache((num_pages, page_size, R), cache_dtype, self.poison)
        tok = self._sample_tokens(T)
        rows = (self.page[tok], self.entry[tok])
        self.sample = {"q_rope_out": ("q_rope_out", (tok,)), "ckv_rows": ("ckv", rows),
                       "kpe_rows": ("kpe", rows)}

    def call(self, o):
        a = self.a
        return _fn("mla_rope_rmsnorm_append_paged_kv_cache")(
            a["q_rope"], a["kv"], a["gamma"], a["table"], a["input_row_offsets"],
            a["cache_lengths"], a["block_table"], (o["ckv"], o["kpe"]), epsilon=self.eps,
            kv_norm_dim=self.kv_norm_dim, is_neox=self.is_neox, kv_scale=self.kv_scale,
            q_rope_out=o["q_rope_out"])

    def torch_fn(self, t, o):
        torch = _torch()
        L, R, nd, neox, eps = self.L, self.R, self.nd, self.is_neox, self.eps
        scale = self.kv_scale or 1.0
        ps = self.page_size

        def fn(q_rope, kv, gamma, table, offsets, lens, block_table, b, ckv, kpe, q_out):
            p, page, entry = _torch_ragged_addr(offsets, lens, block_table, b, ps)
            cs = table[p]
            q_out.copy_(_trope(q_rope.float(), cs[:, None, :R // 2], cs[:, None, R // 2:],
                               neox).to(q_out.dtype))
            x = kv.float()
            lat = _trms(x[:, :nd], gamma, eps)
            if nd < L:
                lat = torch.cat([lat, x[:, nd:L]], -1)
            ckv[page, entry] = _tcast(lat / scale, ckv.dtype)
            kpe[page, entry] = _tcast(
                _trope(x[:, L:], cs[:, :R // 2], cs[:, R // 2:], neox) / scale, kpe.dtype)

        return fn, (t["q_rope"], t["kv"], t["gamma"], t["table"], t["input_row_offsets"],
                    t["cache_lengths"], t["block_table"], t["token_batch"], o["ckv"], o["kpe"],
                    o["q_rope_out"])


    def steps_peer(self):
        """The same result from separate steps: a CuPy kernel RMS-normalising the latent rows
        straight into their ckv cache rows (quantized there), then ropekv's paged op in MLA mode
        for the rotary part (q, and k into kpe). Only the cache rows are compared: the paged op's
        q output has the cache dtype. The norm kernel reads precomputed row offsets."""
        import cupy

        fn = getattr(_ropekv(), OP_FUNCTIONS["paged"][0 if self.fp8 else 1], None)
        if fn is None:
            return None
        a, L, nd = self.a, self.L, self.nd
        T = a["kv"].shape[0]
        kernel = _rmsnorm_kernel(np.dtype(a["kv"].dtype), np.dtype(a["ckv"].dtype))
        q_out = self.g.zeros(a["q_rope"].shape, a["ckv"].dtype)
        o = self.new_outputs()
        append = self.steps_append(fn, q_out, o, cupy)
        rows = cupy.asarray(self.page * self.page_size + self.entry)
        kv_row = a["kv"].strides[0] // a["kv"].dtype.itemsize
        inv_scale = np.float32(1.0 / (self.kv_scale or 1.0))

        args = (np.uint64(a["kv"].data.ptr), np.int64(kv_row), np.uint64(a["gamma"].data.ptr),
                np.uint64(o["ckv"].data.ptr), np.uint64(rows.data.ptr), np.int32(nd),
                np.int32(L), inv_scale, np.float32(self.eps))

        def steps():
            kernel((T,), (256,), args)
            append()

        steps.keep_alive = rows  # args hold its raw pointer

        def outputs():
            return {k: v for k, v in self.outputs(o).items() if k != "q_rope_out"}

        return steps, outputs, o

    def steps_append(self, fn, q_out, o, xp):
        """The paged-op step of :meth:`steps_peer`: rope(q) and rope(k) into kpe (no nope part:
        ckv passed zero-wide, the norm kernel fills it), the block table as FlashInfer-style
        ``kv_indices`` / ``kv_indptr``, MAX's dequantization scale as a quantization scale."""
        a, L = self.a, self.L
        indptr = xp.arange(a["block_table"].shape[0] + 1, dtype=np.int32) * np.int32(self.per)
        kv_indices = a["block_table"].reshape(-1)
        positions = xp.asarray(self.positions.astype(np.int32))
        scale = 1.0 / (self.kv_scale or 1.0)
        return functools.partial(
            fn, a["q_rope"], a["kv"][:, L:], None, None, None, a["table"], positions,
            (o["ckv"][..., :0], o["kpe"]), kv_indices, indptr, a["token_batch"], positions,
            is_neox=self.is_neox, quant_scale_q=1.0, quant_scale_kv=scale,
            page_size=self.page_size, q_rope_out=q_out)


_RMSNORM_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
// One block per token: cache[rows[t], :n] = x[t, :n] / sqrt(mean(x[t, :n]^2) + eps) * gamma,
// cache[rows[t], n:L] = x[t, n:L], each times inv_scale, in float32 then rounded (fp8 saturating).
#define RMSNORM(NAME, T, C)                                                                  \
extern "C" __global__ void NAME(const T* x, long long ld_x, const T* gamma, C* cache,        \
                                const long long* rows, int n, int L, float inv_scale,        \
                                float eps) {                                                 \
    const T* row = x + blockIdx.x * ld_x;                                                    \
    float s = 0.f;                                                                           \
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float v = (float)row[i]; s += v * v; } \
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);                     \
    __shared__ float part[32];                                                               \
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;                                 \
    __syncthreads();                                                                         \
    float total = 0.f;                                                                       \
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += part[w];                       \
    float inv = rsqrtf(total / n + eps);                                                     \
    C* dst = cache + rows[blockIdx.x] * L;                                                   \
    for (int i = threadIdx.x; i < L; i += blockDim.x) {                                      \
        float v = (float)row[i];                                                             \
        if (i < n) v = v * inv * (float)gamma[i];                                            \
        dst[i] = C(v * inv_scale);                                                           \
    }                                                                                        \
}
RMSNORM(rmsnorm_f16_f16, __half, __half)
RMSNORM(rmsnorm_f16_e4m3, __half, __nv_fp8_e4m3)
RMSNORM(rmsnorm_f16_e5m2, __half, __nv_fp8_e5m2)
RMSNORM(rmsnorm_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
RMSNORM(rmsnorm_bf16_e4m3, __nv_bfloat16, __nv_fp8_e4m3)
RMSNORM(rmsnorm_bf16_e5m2, __nv_bfloat16, __nv_fp8_e5m2)
"""


@functools.cache
def _rmsnorm_kernel(dtype, cache_dtype):
    import cupy

    from ropekv._compile import _header_options

    module = cupy.RawModule(code=_RMSNORM_SRC, options=("-std=c++17", *_header_options()))
    return module.get_function(f"rmsnorm_{_dtname(dtype).replace('fp16', 'f16')}_"
                               f"{_dtname(cache_dtype).replace('fp16', 'f16')}")


def _ropekv():
    import ropekv

    return ropekv


class QknormWL(_RaggedMixin, Workload):
    """:func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache` (Qwen3-style QK-norm)."""

    op = "qknorm"
    OUTPUTS = ("q_out", "k_cache", "v_cache")

    def build(self, B, S, prefix, Hq, Hkv, D, dtype, cache_dtype, page_size=16, layout="NHD",
              is_neox=True, kv_scale=None, eps=1e-6, packed=False, gamma_dtype=None):
        """``packed``: q, k, v are views of one (T, Hq + 2 Hkv, D) projection output ``qkv``, as
        engines (and the Cake kernels) hold them; ``gamma_dtype``: that of the RMSNorm weights
        (default the input dtype)."""
        g = self.g
        num_pages, seq = self.ragged(B, S, prefix, page_size)
        T = B * S
        self.D, self.layout, self.is_neox, self.eps = D, layout, is_neox, eps
        self.Hq, self.Hkv, self.B, self.T, self.S = Hq, Hkv, B, T, S
        self.dtype, self.packed = np.dtype(dtype), packed
        self.cache_dtype = np.dtype(cache_dtype)
        self.fp8 = self.cache_dtype in FP8
        self.kv_scale = (kv_scale or 1.0) if self.fp8 else None
        if packed:
            qkv = g.randn((T, Hq + 2 * Hkv, D), dtype)
            self.a["qkv"] = qkv
            self.a["q"], self.a["k"] = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv]
            self.a["v"] = qkv[:, Hq + Hkv:]
        else:
            self.a["q"] = g.randn((T, Hq, D), dtype)
            self.a["k"] = g.randn((T, Hkv, D), dtype)
            self.a["v"] = g.randn((T, Hkv, D), dtype)
        gdt = dtype if gamma_dtype is None else gamma_dtype
        self.gamma_f32 = np.dtype(gdt) == np.float32
        self.a["q_gamma"] = g.randn((D,), gdt, scale=0.1, offset=1.0)
        self.a["k_gamma"] = g.randn((D,), gdt, scale=0.1, offset=1.0)
        # the sequence length after the append (the Cake kernels' seq_lens)
        self.a["seq_lens"] = g.put(np.full(B, seq, np.int32))
        self.a["table"] = g.put(_cos_sin(seq, D))
        self.a["q_out"] = g.zeros((T, Hq, D), dtype)
        shape = ((num_pages, page_size, Hkv, D) if layout == "NHD"
                 else (num_pages, Hkv, page_size, D))
        self.a["k_cache"] = g.cache(shape, cache_dtype, self.poison)
        self.a["v_cache"] = g.cache(shape, cache_dtype, self.poison)
        tok = self._sample_tokens(T)
        rows = ((self.page[tok], self.entry[tok]) if layout == "NHD"
                else (self.page[tok], slice(None), self.entry[tok]))
        self.sample = {"q_out": ("q_out", (tok,)), "k_rows": ("k_cache", rows),
                       "v_rows": ("v_cache", rows)}

    def call(self, o):
        a = self.a
        return _fn("qk_rmsnorm_rope_append_paged_kv_cache")(
            a["q"], a["k"], a["v"], a["q_gamma"], a["k_gamma"], a["table"],
            a["input_row_offsets"], a["cache_lengths"], a["block_table"],
            (o["k_cache"], o["v_cache"]), epsilon=self.eps, is_neox=self.is_neox,
            kv_layout=self.layout, kv_scale=self.kv_scale, q_out=o["q_out"])

    def torch_fn(self, t, o):
        D, neox, eps, nhd = self.D, self.is_neox, self.eps, self.layout == "NHD"
        scale = self.kv_scale or 1.0
        ps = self.page_size

        def fn(q, k, v, qg, kg, table, offsets, lens, block_table, b, kc, vc, q_out):
            p, page, entry = _torch_ragged_addr(offsets, lens, block_table, b, ps)
            cs = table[p]
            cos, sin = cs[:, None, :D // 2], cs[:, None, D // 2:]
            q_out.copy_(_trope(_trms(q.float(), qg, eps), cos, sin, neox).to(q_out.dtype))
            kq = _tcast(_trope(_trms(k.float(), kg, eps), cos, sin, neox) / scale, kc.dtype)
            vq = _tcast(v.float() / scale, vc.dtype)
            if nhd:
                kc[page, entry], vc[page, entry] = kq, vq
            else:
                kc[page, :, entry], vc[page, :, entry] = kq, vq

        return fn, (t["q"], t["k"], t["v"], t["q_gamma"], t["k_gamma"], t["table"],
                    t["input_row_offsets"], t["cache_lengths"], t["block_table"],
                    t["token_batch"], o["k_cache"], o["v_cache"], o["q_out"])

    def flashinfer_cake_fn(self, t, o, po):
        """FlashInfer 0.7.2's Cake kernels on the same packed qkv (heads (64, 8) or (8, 1), D 128,
        NHD, float32 weights, norm then RoPE): (call, outputs, expect) or None. The bf16 kernel
        writes q as bf16 (``clear_unused_last_page_rows=False``: the same work as ropekv); the fp8
        kernel writes q as e4m3 (static scale 1.0), compared with ropekv's q rounded to e4m3."""
        if not (self.packed and self.gamma_f32 and self.is_neox and self.layout == "NHD"
                and self.D == 128 and (self.Hq, self.Hkv) in ((64, 8), (8, 1))
                and self.dtype == BF16 and self.cache_dtype in (BF16, E4M3)):
            return None
        torch = _torch()
        T, Hq = self.T, self.Hq
        qkv = t["qkv"].view(T, -1)
        common = (qkv, t["table"], t["seq_lens"], t["input_row_offsets"], t["block_table"])
        weights = {"q_norm_weight": t["q_gamma"], "k_norm_weight": t["k_gamma"]}
        if not self.fp8:
            from flashinfer.cake_fused_qk_rope_append import (
                cake_fused_qk_rmsnorm_rope_append_paged_kv_cache as cake)

            def bf16():
                cake(*common, o["k_cache"], o["v_cache"], num_q_heads=Hq, num_kv_heads=self.Hkv,
                     qk_norm_policy=2, eps=self.eps, out_q=o["q_out"],
                     clear_unused_last_page_rows=False, **weights)
            return bf16, functools.partial(self.outputs, po), None
        from flashinfer.cake_fused_qk_rope_fp8_append import (
            cake_fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as cake)

        dev = qkv.device
        out_q = torch.zeros((T, Hq, self.D), dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.full((1,), float(self.kv_scale), dtype=torch.float32, device=dev)
        q_scale_inv = torch.ones(1, dtype=torch.float32, device=dev)
        q_scale = torch.empty((0,), dtype=torch.float32, device=dev)
        flag = torch.empty((self.B, self.Hkv), dtype=torch.int32, device=dev)

        def fp8():
            cake(*common, (o["k_cache"], o["v_cache"]), is_prefill=self.S > 1, k_scale=scale,
                 v_scale=scale, quant_policy=2, q_scale_inv=q_scale_inv, qk_norm_policy=2,
                 out_q=out_q, q_scale=q_scale, split_k_flag=flag, **weights)

        tok = self.sample["q_out"][1][0]

        def outputs():
            out = self.outputs(po)
            del out["q_out"]  # the peer's q is e4m3, in its own buffer
            out["q_out_e4m3"] = to_numpy(out_q[torch.as_tensor(tok, device=dev)])
            return out

        def expect(expected):
            return dict(expected, q_out_e4m3=expected["q_out"].astype(np.float32).astype(E4M3))

        return fp8, outputs, expect


class QkvWL(_RaggedMixin, Workload):
    """:func:`ropekv.fused_qkv_matmul_append_paged_kv_cache` (fp16/bf16 weights, RoPE on)."""

    op = "qkv"
    compare_mode = "gemm"
    OUTPUTS = ("q_out", "k_cache", "v_cache")

    def build(self, B, S, prefix, K, Hq, Hkv, D, dtype, cache_dtype, page_size=16, layout="NHD",
              rope=True, kv_scale=None):
        g = self.g
        num_pages, seq = self.ragged(B, S, prefix, page_size)
        T = B * S
        self.T, self.Hq, self.Hkv, self.D, self.layout = T, Hq, Hkv, D, layout
        self.fp8 = np.dtype(cache_dtype) in FP8
        self.kv_scale = (kv_scale or 1.0) if self.fp8 else None
        N = (Hq + 2 * Hkv) * D
        self.a["hidden"] = g.randn((T, K), dtype)
        self.a["weight"] = g.randn((N, K), dtype, scale=1.0 / math.sqrt(K))
        self.a["table"] = g.put(_cos_sin(seq, D)) if rope else None
        self.a["q_out"] = g.zeros((T, Hq * D), dtype)
        shape = ((num_pages, page_size, Hkv, D) if layout == "NHD"
                 else (num_pages, Hkv, page_size, D))
        self.a["k_cache"] = g.cache(shape, cache_dtype, self.poison)
        self.a["v_cache"] = g.cache(shape, cache_dtype, self.poison)
        # for cuBLAS + ropekv's paged append: the block table as FlashInfer-style indices
        bt = to_numpy(self.a["block_table"])
        for name, v in (("kv_indices", bt.ravel()), ("kv_indptr", np.arange(B + 1) * self.per),
                        ("batch_indices", self.batch), ("positions", self.positions)):
            self.a[name] = g.put(np.asarray(v, np.int32))
        tok = self._sample_tokens(T)
        rows = ((self.page[tok], self.entry[tok]) if layout == "NHD"
                else (self.page[tok], slice(None), self.entry[tok]))
        self.sample = {"q_out": ("q_out", (tok,)), "k_rows": ("k_cache", rows),
                       "v_rows": ("v_cache", rows)}
        self.tok = tok

    def call(self, o):
        a = self.a
        return _fn("fused_qkv_matmul_append_paged_kv_cache")(
            a["hidden"], a["weight"], a["input_row_offsets"], a["cache_lengths"],
            a["block_table"], (o["k_cache"], o["v_cache"]), num_q_heads=self.Hq,
            cos_sin_cache=a["table"], is_neox=True, kv_layout=self.layout,
            kv_scale=self.kv_scale, out=o["q_out"])

    def torch_fn(self, t, o):
        torch = _torch()
        Hq, Hkv, D, nhd = self.Hq, self.Hkv, self.D, self.layout == "NHD"
        scale = self.kv_scale or 1.0
        ps = self.page_size
        rope = t.get("table") is not None

        def fn(hidden, weight, table, offsets, lens, block_table, b, kc, vc, q_out):
            p, page, entry = _torch_ragged_addr(offsets, lens, block_table, b, ps)
            x = torch.matmul(hidden, weight.t()).float()
            T = x.shape[0]
            q = x[:, :Hq * D].view(T, Hq, D)
            k = x[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
            v = x[:, (Hq + Hkv) * D:].view(T, Hkv, D)
            if rope:
                cs = table[p]
                cos, sin = cs[:, None, :D // 2], cs[:, None, D // 2:]
                q, k = _trope(q, cos, sin, True), _trope(k, cos, sin, True)
            q_out.copy_(q.reshape(T, Hq * D).to(q_out.dtype))
            kq, vq = _tcast(k / scale, kc.dtype), _tcast(v / scale, vc.dtype)
            if nhd:
                kc[page, entry], vc[page, entry] = kq, vq
            else:
                kc[page, :, entry], vc[page, :, entry] = kq, vq

        return fn, (t["hidden"], t["weight"], t.get("table"), t["input_row_offsets"],
                    t["cache_lengths"], t["block_table"], t["token_batch"], o["k_cache"],
                    o["v_cache"], o["q_out"])

    def cublas_peers(self):
        """'cublas': the projection alone (its V columns are checked against ropekv's V cache
        rows); 'cublas+ropekv': the projection, then ropekv's paged RoPE + append when present."""
        import cupy

        a, T, Hq, Hkv, D = self.a, self.T, self.Hq, self.Hkv, self.D
        tmp = cupy.empty((T, (Hq + 2 * Hkv) * D), a["hidden"].dtype)
        tok = self.tok

        def gemm():
            cupy.matmul(a["hidden"], a["weight"].T, out=tmp)

        def gemm_outputs():
            v = tmp[cupy.asarray(tok), (Hq + Hkv) * D:].reshape(len(tok), Hkv, D)
            return {"v_rows": to_numpy(v)} if not self.fp8 else {}

        peers = {"cublas": (gemm, gemm_outputs, None)}
        import ropekv

        fn = getattr(ropekv, OP_FUNCTIONS["paged"][1], None)
        if fn is None or a.get("table") is None or self.fp8:
            return peers
        o = self.new_outputs()
        q3 = o["q_out"].reshape(T, Hq, D)
        view = tmp.reshape(T, Hq + 2 * Hkv, D)

        def gemm_append():
            cupy.matmul(a["hidden"], a["weight"].T, out=tmp)
            fn(view[:, :Hq], view[:, Hq:Hq + Hkv], None, None, view[:, Hq + Hkv:], a["table"],
               a["positions"], (o["k_cache"], o["v_cache"]), a["kv_indices"], a["kv_indptr"],
               a["batch_indices"], a["positions"], is_neox=True, page_size=self.page_size,
               kv_layout=self.layout, q_rope_out=q3)

        peers["cublas+ropekv"] = (gemm_append, lambda: self.outputs(o), o)
        return peers


# ---- the case registry ---------------------------------------------------------------------------


@dataclasses.dataclass
class CaseSpec:
    op: str
    name: str
    tokens: int
    nbytes: int
    make: Callable[[], Workload]  # builds the workload on the device
    decode: bool = False
    quick: bool = False
    compile: bool = False  # torch.compile peer (compiling costs seconds per dtype combination)
    series: str = ""  # the token sweep this case belongs to (plotted as a line)
    flops: int = 0
    note: str = ""


def _cp():
    import cupy

    return cupy


LLAMA = {"Hq": 32, "Hkv": 8, "D": 128}  # Llama-3-8B attention
DSV3 = {"Hq": 128, "L": 512, "R": 64}  # DeepSeek-V3 MLA
QWEN3 = {"Hq": 32, "Hkv": 8, "D": 128}  # Qwen3-8B
QWEN3_32B = {"Hq": 64, "Hkv": 8, "D": 128}  # the Cake kernels' (64, 8) head configuration
SWEEP = (1, 4, 16, 64, 128, 256, 1024, 4096, 8192, 16384, 32768)
DECODE_SWEEP = (1, 4, 16, 64, 128, 256)  # tokens (one per request) of every op's decode sweep


def _contiguous_specs():
    out = []
    for cache in (F16, E4M3):
        series = f"contiguous fp16->{_dtname(cache)}"
        for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
            decode = S == 1
            kw = dict(B=B, S=S, C=4096, dtype=F16, cache_dtype=cache, decode=decode, **LLAMA)
            out.append(CaseSpec(
                "contiguous", f"{series} {B}x{S}", B * S,
                nbytes_of.contiguous_bytes(B * S, 32, 8, 128, 128, F16, cache),
                _lazy(ContiguousWL, **kw), decode=decode,
                quick=cache == F16 and B in (8, 64), compile=cache == F16 and B in (8, 64),
                series=series if decode else ""))
    return out


def _lazy(cls, **kw):
    return lambda: cls(_cp(), seed=1, **kw)


def _paged_gqa(B, S, dtype, cache, prefix=1024, **extra):
    T = B * S
    qout = cache if cache in FP8 else dtype
    return dict(op="paged", name=f"paged gqa {_dtname(dtype)}->{_dtname(cache)} {B}x{S}",
                tokens=T, nbytes=nbytes_of.rope_kv_bytes(T, 32, 8, 128, 128, dtype, qout, cache),
                make=_lazy(PagedWL, B=B, S=S, prefix=prefix, dtype=dtype, cache_dtype=cache,
                           **LLAMA),
                decode=S == 1, **extra)


def _paged_specs():
    out = []
    shapes = ((8, 1024), (4, 2048), (1, 1), (64, 1), (256, 1))
    for dtype, cache in ((F16, E4M3), (F16, F16)):
        for B, S in shapes:
            headline = (B, S) in ((8, 1024), (64, 1))
            out.append(CaseSpec(**_paged_gqa(B, S, dtype, cache, quick=headline and cache == E4M3,
                                             compile=headline)))
    # decode sweep of the fp16 -> fp16 case (fp16 -> e4m3 has the long sweep below)
    for T in DECODE_SWEEP:
        spec = CaseSpec(**_paged_gqa(T, 1, F16, F16))
        spec.series = "paged gqa fp16->fp16"
        if not any(s.name == spec.name for s in out):
            out.append(spec)
        else:
            next(s for s in out if s.name == spec.name).series = spec.series
    for dtype, cache in ((BF16, BF16), (BF16, E4M3)):
        for B, S in ((8, 1024), (64, 1)):
            out.append(CaseSpec(**_paged_gqa(B, S, dtype, cache)))
    # token sweep of the fp16 -> e4m3 case for the plot (requests of at most 1024 new tokens)
    for T in SWEEP:
        B, S = (T, 1) if T <= 256 else (T // min(T, 1024), min(T, 1024))
        spec = CaseSpec(**_paged_gqa(B, S, F16, E4M3, compile=T > 1))
        spec.series = "paged gqa fp16->e4m3"
        if not any(s.name == spec.name for s in out):
            spec.name += " (sweep)"
            out.append(spec)
        else:
            next(s for s in out if s.name == spec.name).series = spec.series
    for B, S in ((8, 1024), (4, 2048), *((B, 1) for B in DECODE_SWEEP)):
        T = B * S
        out.append(CaseSpec(
            "paged", f"paged mla bf16->e4m3 {B}x{S}", T,
            nbytes_of.paged_mla_bytes(T, 128, 512, 64, BF16, E4M3, E4M3),
            _lazy(PagedWL, B=B, S=S, prefix=1024, Hq=128, mla=True, L=512, R=64, dtype=BF16,
                  cache_dtype=E4M3, is_neox=False),
            decode=S == 1, quick=(B, S) == (128, 1), compile=(B, S) in ((4, 2048), (128, 1)),
            series="paged mla bf16->e4m3" if S == 1 else ""))
    return out


def _mla_specs():
    out = []
    for B, S in ((4, 2048), *((B, 1) for B in DECODE_SWEEP)):
        T = B * S
        out.append(CaseSpec(
            "mla", f"mla rmsnorm bf16->e4m3 {B}x{S}", T,
            nbytes_of.mla_rmsnorm_bytes(T, 128, 512, 64, BF16, E4M3),
            _lazy(MlaWL, B=B, S=S, prefix=1024, dtype=BF16, cache_dtype=E4M3, **DSV3),
            decode=S == 1, quick=B == 128, compile=B in (4, 128),
            series="mla rmsnorm bf16->e4m3" if S == 1 else ""))
    return out


def _qknorm_specs():
    out = []
    for B, S, cache in ((8, 1024, BF16), (8, 1024, E4M3), (64, 1, E4M3)):
        T = B * S
        out.append(CaseSpec(
            "qknorm", f"qknorm bf16->{_dtname(cache)} {B}x{S}", T,
            nbytes_of.qknorm_bytes(T, 32, 8, 128, 128, BF16, cache),
            _lazy(QknormWL, B=B, S=S, prefix=1024, dtype=BF16, cache_dtype=cache, **QWEN3),
            decode=S == 1, quick=S == 1, compile=cache == E4M3))
    # Qwen3-32B heads on one packed qkv with float32 weights: the Cake kernels' shapes
    for cache in (BF16, E4M3):
        series = f"qknorm qwen3-32b bf16->{_dtname(cache)}"
        for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
            T = B * S
            out.append(CaseSpec(
                "qknorm", f"{series} {B}x{S}", T,
                nbytes_of.qknorm_bytes(T, 64, 8, 128, 128, BF16, cache),
                _lazy(QknormWL, B=B, S=S, prefix=1024, dtype=BF16, cache_dtype=cache,
                      packed=True, gamma_dtype=np.float32, **QWEN3_32B),
                decode=S == 1, series=series if S == 1 else ""))
    return out


def _qkv_specs():
    out = []
    for T in (8192, *DECODE_SWEEP):
        B, S = (8, 1024) if T == 8192 else (T, 1)
        out.append(CaseSpec(
            "qkv", f"qkv fp16 K4096 N6144 T{T}", T,
            nbytes_of.qkv_bytes(T, 4096, 32, 8, 128, F16, F16, rotary_dim=128),
            _lazy(QkvWL, B=B, S=S, prefix=1024, K=4096, dtype=F16, cache_dtype=F16, **LLAMA),
            decode=S == 1, quick=T == 16, compile=T in (8192, 64),
            flops=nbytes_of.qkv_flops(T, 4096, 32, 8, 128),
            series="qkv fp16 K4096 N6144" if S == 1 else ""))
    return out


def bench_specs():
    """Every standard case, in table order (the ops that are missing included)."""
    return (_contiguous_specs() + _paged_specs() + _mla_specs() + _qknorm_specs()
            + _qkv_specs())


def check_specs():
    """(op, name, build() -> host Workload) of ``ropekv check``: small seeded shapes, every op that
    exists in ``ropekv``."""
    cases = []

    def add(op, name, cls, **kw):
        if op_available(op):
            seed = len(cases) + 7
            cases.append((op, name, lambda cls=cls, kw=kw, seed=seed:
                          cls(np, seed=seed, poison=True, **kw)))

    for dtype, cache, decode, neox in ((F16, F16, False, True), (BF16, E4M3, True, False),
                                       (F16, E5M2, True, True)):
        add("contiguous", f"{_dtname(dtype)}->{_dtname(cache)} {'decode' if decode else 'prefill'}"
            f"{'' if neox else ' interleaved'}", ContiguousWL, B=3, S=1 if decode else 19, Hq=8,
            Hkv=2, D=128, R=64 if decode else 128, C=64, dtype=dtype, cache_dtype=cache,
            decode=decode, is_neox=neox, kv_scale=(0.5, 2.0))
    for dtype, cache, layout, ps, idx in ((F16, E4M3, "NHD", 16, np.int32),
                                          (BF16, E4M3, "HND", 32, np.int64),
                                          (F16, F16, "NHD", 1, np.int32),
                                          (BF16, BF16, "HND", 16, np.int64),
                                          (F16, E5M2, "NHD", 128, np.int32)):
        add("paged", f"gqa {_dtname(dtype)}->{_dtname(cache)} {layout} page {ps} "
            f"{np.dtype(idx).name}", PagedWL, B=3, S=19, prefix=37, Hq=8, Hkv=2, D=128,
            R=128 if cache != E5M2 else 64, dtype=dtype, cache_dtype=cache, page_size=ps,
            layout=layout, index_dtype=idx, scales=(0.5, 2.0), spare_pages=5)
    add("paged", "mla bf16->e4m3 page 16", PagedWL, B=2, S=11, prefix=20, Hq=16, mla=True, L=512,
        R=64, dtype=BF16, cache_dtype=E4M3, is_neox=False, scales=(1.0, 0.5), spare_pages=3)
    for cache in (BF16, E4M3):
        add("mla", f"bf16->{_dtname(cache)} L512 R64", MlaWL, B=3, S=7, prefix=21, Hq=16, L=512,
            R=64, dtype=BF16, cache_dtype=cache, kv_scale=2.0 if cache in FP8 else None)
    add("mla", "fp16->e5m2 norm dim 128 of L256", MlaWL, B=2, S=5, prefix=3, Hq=32, L=256, R=32,
        dtype=F16, cache_dtype=E5M2, kv_norm_dim=128, page_size=32, kv_scale=0.5)
    for cache, layout in ((BF16, "NHD"), (E4M3, "HND")):
        add("qknorm", f"bf16->{_dtname(cache)} {layout}", QknormWL, B=3, S=9, prefix=30, Hq=16,
            Hkv=4, D=128, dtype=BF16, cache_dtype=cache, layout=layout,
            kv_scale=0.5 if cache in FP8 else None)
    for B, S, rope, layout in ((1, 7, True, "NHD"), (1, 1, False, "HND"), (3, 43, True, "HND")):
        add("qkv", f"fp16 K4096 {B}x{S} {'rope ' if rope else ''}{layout}", QkvWL, B=B, S=S,
            prefix=5, K=4096, Hq=32, Hkv=8, D=128, dtype=F16, cache_dtype=F16, layout=layout,
            rope=rope)
    return cases


# ---- peers ---------------------------------------------------------------------------------------


@functools.cache
def peer_availability():
    """peer name -> None when it can run, else why not."""
    status = {}
    try:
        import torch

        status["torch"] = None if torch.cuda.is_available() else "PyTorch sees no CUDA device"
    except Exception as e:  # noqa: BLE001
        status["torch"] = f"PyTorch not importable ({type(e).__name__})"
    status["torch-compile"] = status["torch"]
    if status["torch"] is None:
        try:
            import flashinfer.page
            import flashinfer.rope  # noqa: F401

            status["flashinfer"] = None
        except Exception as e:  # noqa: BLE001
            status["flashinfer"] = f"FlashInfer not importable ({type(e).__name__}: {e})"
        try:
            import flashinfer.cake_fused_qk_rope_append
            import flashinfer.cake_fused_qk_rope_fp8_append  # noqa: F401

            status["flashinfer-cake"] = None
        except Exception as e:  # noqa: BLE001
            status["flashinfer-cake"] = (f"FlashInfer's Cake kernels not importable (0.7.2 or "
                                         f"later; {type(e).__name__}: {e})")
    else:
        status["flashinfer"] = status["flashinfer-cake"] = "needs PyTorch"
    status["cublas"] = status["steps"] = None
    return status


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return None


def _compiled(fn):
    """``torch.compile`` with dynamic shapes: one compilation serves every token count (dynamo
    caches per code object, guarded on the closure's constants and the dtypes)."""
    return _torch().compile(fn, dynamic=True)


@dataclasses.dataclass
class Runner:
    name: str
    call: Callable[[], Any]
    outputs: Callable[[], dict]
    reset: Callable[[], None] | None = None
    framework: str = "cupy"  # which graph capture times it
    # maps ropekv's sampled outputs to what this runner's outputs are compared with (a peer that
    # writes another dtype), or None
    expect: Callable[[dict], dict] | None = None


def _runners(w: Workload, spec: CaseSpec, peers):
    """ropekv's runner and the wanted peers' (name -> Runner, or name -> why not)."""
    o = w.new_outputs()
    ropekv = Runner("ropekv", lambda: w.call(o), lambda: w.outputs(o), lambda: w.reset(o))
    out: dict[str, Any] = {}
    avail = peer_availability()
    for peer in peers:
        if avail.get(peer):
            out[peer] = f"skipped: {avail[peer]}"
            continue
        try:
            if peer == "steps":
                made = w.steps_peer() if isinstance(w, MlaWL) else None
                if made is None:
                    out[peer] = "-"
                    continue
                fn, outs, po = made
                out[peer] = Runner(peer, fn, outs, lambda po=po: w.reset(po))
                continue
            if peer == "cublas":
                made = w.cublas_peers() if isinstance(w, QkvWL) else {}
                if not made:
                    out[peer] = "-"
                for name, (fn, outs, po) in made.items():
                    out[name] = Runner(name, fn, outs, (lambda po=po: w.reset(po)) if po else None)
                continue
            po = w.new_outputs()
            to = {k: _to_torch(v) for k, v in po.items()}
            ti = {k: _to_torch(v) for k, v in w.a.items() if k not in po}
            reset = functools.partial(w.reset, po)
            if peer == "flashinfer-cake":
                made = w.flashinfer_cake_fn(ti, to, po) if isinstance(w, QknormWL) else None
                if made is None:
                    out[peer] = "-"
                    continue
                fn, outs, expect = made
                out[peer] = Runner(peer, fn, outs, reset, "torch", expect)
                continue
            if peer == "flashinfer":
                made = w.flashinfer_fn(ti, to)
                if made is None:
                    out[peer] = "-"
                    continue
                fn, extra_reset = made
                if extra_reset is not None:
                    reset = (lambda a=reset, b=extra_reset: (a(), b()))
                out[peer] = Runner(peer, fn, functools.partial(w.outputs, po), reset, "torch")
                continue
            made = w.torch_fn(ti, to)
            if made is None:
                out[peer] = "-"
                continue
            fn, args = made
            if peer == "torch-compile":
                if not spec.compile:
                    out[peer] = "-"
                    continue
                fn = _compiled(fn)
            out[peer] = Runner(peer, functools.partial(fn, *args),
                               functools.partial(w.outputs, po), reset, "torch")
        except Exception as e:  # noqa: BLE001 - a peer that cannot be set up is reported
            out[peer] = f"error: {_one_line(e)}"
    return ropekv, out


def _one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


# ---- timing --------------------------------------------------------------------------------------


def _torch_graph_us(fn, calls, replays):
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    del graph
    return float(np.median(times))


def _cupy_graph_us(fn, calls, replays):
    """:func:`ropekv._timing.graph_us`, ending a capture that an exception interrupted."""
    import cupy

    from ropekv import _timing

    try:
        return _timing.graph_us(fn, calls=calls, replays=replays)
    except Exception:
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            with contextlib.suppress(Exception):
                stream.end_capture()
        raise


def time_runner(r: Runner, spec: CaseSpec, settings, flusher):
    """{"us": per-call device time, "graph_us", "host_us", "event_us" where measured}."""
    from ropekv import _timing

    res: dict[str, Any] = {}
    if spec.decode:
        try:
            if r.framework == "torch":
                res["graph_us"] = _torch_graph_us(r.call, settings["graph_calls"], 10)
            else:
                res["graph_us"] = _cupy_graph_us(r.call, settings["graph_calls"], 10)
        except Exception as e:  # noqa: BLE001 - not capturable: fall back to events
            res["graph_error"] = _one_line(e)
        res["host_us"] = _timing.eager_host_us(r.call, calls=settings["host_calls"])
    flush = flusher if spec.nbytes < L2_FLUSH_BELOW else None
    res["event_us"] = _timing.device_us(r.call, reps=settings["reps"], flush=flush,
                                        budget_s=settings["budget_s"])
    res["l2_flushed"] = flush is not None
    res["us"] = res.get("graph_us", res["event_us"])
    return res


def torch_host_us(w: Workload, calls):
    """{"host_us_torch": host time per eager call of ropekv's call made with torch tensors viewing
    the workload's arrays (DLPack, zero-copy)}; {} without PyTorch, {"host_torch_error": ...} when
    the call fails on torch tensors."""
    if peer_availability().get("torch"):
        return {}
    try:
        torch = _torch()
        tw = copy.copy(w)
        tw.a = {k: _to_torch(v) for k, v in w.a.items()}
        o = {k: _to_torch(v) for k, v in w.new_outputs().items()}
        for _ in range(50):
            tw.call(o)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            tw.call(o)
        torch.cuda.synchronize()
        return {"host_us_torch": (time.perf_counter() - t0) / calls * 1e6}
    except Exception as e:  # noqa: BLE001 - reported, the case goes on
        return {"host_torch_error": _one_line(e)}


# ---- the run -------------------------------------------------------------------------------------


_START = [None]


def progress(i, n, text):
    """A one-line progress bar on stderr (with the seconds since the first call)."""
    if i == 0 or _START[0] is None:
        _START[0] = time.perf_counter()
    width = 24
    done = int(width * i / max(n, 1))
    line = (f"[{'#' * done}{'.' * (width - done)}] {i}/{n} "
            f"{time.perf_counter() - _START[0]:6.1f} s  {text}")
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line[:150] + ("\n" if i >= n else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def environment():
    """GPU, driver and library versions, and the git revision when there is one."""
    env = {"python": platform.python_version(), "ropekv": _version("ropekv"),
           "numpy": np.__version__, "cupy": _version("cupy"), "torch": _version("torch"),
           "flashinfer": _version("flashinfer")}
    try:
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["sm"] = f"{props['major']}{props['minor']}"
        env["sms"] = props["multiProcessorCount"]
        env["l2_bytes"] = props["l2CacheSize"]
        d, r = rt.driverGetVersion(), rt.runtimeGetVersion()
        env["cuda_driver_api"] = f"{d // 1000}.{d % 1000 // 10}"
        env["cuda_runtime"] = f"{r // 1000}.{r % 1000 // 10}"
    except Exception as e:  # noqa: BLE001
        env["gpu_error"] = _one_line(e)
    with contextlib.suppress(Exception):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
        if out.returncode == 0:
            env["driver"] = out.stdout.strip().splitlines()[0]
    env["git_revision"] = git_revision()
    return env


def git_revision():
    """``$ROPEKV_GIT_REVISION`` when set (a copy of the tree on a remote GPU machine may carry a
    stale ``.git``), else ``git rev-parse`` of the checkout ropekv runs from."""
    return os.environ.get("ROPEKV_GIT_REVISION") or _git_revision()


def _git_revision():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=False)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10,
                               check=False).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return None


def select_specs(ops=None, quick=False):
    """The cases to run: those of the chosen ops (all by default) whose op exists in ropekv."""
    specs = [s for s in bench_specs() if ops is None or s.op in ops]
    specs = [s for s in specs if op_available(s.op)]
    if quick:
        specs = [s for s in specs if s.quick]
    return specs


def run(ops=None, peers=None, quick=False, log=progress, json_path=None):
    """Run the benchmark; return the result dict (what ``--json`` writes; with ``json_path`` it is
    also written there after every case, so an interrupted run keeps what it measured)."""
    import cupy

    from ropekv import _timing

    t0 = time.perf_counter()
    explicit_peers = peers is not None
    if peers is None:
        peers = ("torch", "cublas", "steps") if quick else PEERS
    settings = ({"reps": 10, "graph_calls": 20, "host_calls": 50, "budget_s": 0.1} if quick
                else {"reps": 100, "graph_calls": 100, "host_calls": 500, "budget_s": 0.5})
    specs = select_specs(ops, quick)
    result: dict[str, Any] = {"command": " ".join(["ropekv", "bench", *sys.argv[2:]]),
                              "quick": quick, "peers": list(peers), "settings": settings}
    result["environment"] = environment()
    result["missing_ops"] = [op for op in (ops or OPS) if not op_available(op)]
    avail = peer_availability()
    result["peer_status"] = {p: ("used" if p in peers and not avail.get(p) else
                                 avail.get(p) or "not selected") for p in PEERS}
    if quick and not explicit_peers:
        for p in ("flashinfer", "torch-compile"):
            result["peer_status"][p] = "not selected (--quick; name it in --peers to include)"
    n = len(specs) + 1
    log(0, n, "copy bandwidth (1 GiB device-to-device)")
    result["copy_bytes"] = 2 << 30
    result["copy_bandwidth"] = _timing.copy_bandwidth(1 << 30, reps=5 if quick else 20)
    flusher = _timing.L2ReadFlusher()
    cases = []
    lost = None  # the case after which the CUDA context was unusable
    for i, spec in enumerate(specs):
        log(i + 1, n, spec.name)
        if lost:
            cases.append({"op": spec.op, "name": spec.name, "tokens": spec.tokens,
                          "bytes": spec.nbytes, "decode": spec.decode, "peers": {},
                          "error": f"not run: the CUDA context was lost in '{lost}'"})
            continue
        cases.append(run_case(spec, peers, settings, flusher, result["copy_bandwidth"]))
        if context_lost(cases[-1]):
            lost = spec.name
        if json_path:
            write_json(dict(result, cases=cases, wall_s=time.perf_counter() - t0,
                            partial=True), json_path)
        cupy.get_default_memory_pool().free_all_blocks()
        if peer_availability().get("torch") is None:
            _torch().cuda.empty_cache()
    log(n, n, "done")
    result["cases"] = cases
    result["wall_s"] = time.perf_counter() - t0
    return result


STICKY_ERRORS = ("IllegalAddress", "ILLEGAL_ADDRESS", "LaunchFailure", "LAUNCH_FAILED",
                 "IllegalInstruction", "ILLEGAL_INSTRUCTION", "MisalignedAddress",
                 "MISALIGNED_ADDRESS", "illegal memory access")


def context_lost(case_or_message):
    """Whether an error left the CUDA context unusable (a sticky error: every later call in this
    process fails with it, so later cases cannot run)."""
    if isinstance(case_or_message, str):
        texts = [case_or_message]
    else:
        texts = [case_or_message.get("error", "")]
        texts += [e.get("status", "") for e in case_or_message.get("peers", {}).values()]
    return any(k in t for t in texts for k in STICKY_ERRORS)


def run_case(spec: CaseSpec, peers, settings, flusher, copy_bw):
    case = {"op": spec.op, "name": spec.name, "tokens": spec.tokens, "bytes": spec.nbytes,
            "decode": spec.decode, "series": spec.series, "flops": spec.flops, "peers": {}}
    t = time.perf_counter()
    try:
        w = spec.make()
        ropekv, others = _runners(w, spec, peers)
        ropekv.reset()
        ropekv.call()
        expected = ropekv.outputs()
        case["ropekv"] = time_runner(ropekv, spec, settings, flusher)
    except Exception as e:  # noqa: BLE001 - one broken case must not end the run
        case["error"] = _one_line(e)
        case["seconds"] = time.perf_counter() - t
        return case
    if spec.decode:
        case["ropekv"].update(torch_host_us(w, settings["host_calls"]))
    us = case["ropekv"]["us"]
    case["ropekv"]["gbps"] = spec.nbytes / (us * 1e-6) / 1e9
    case["ropekv"]["pct_copy"] = 100 * spec.nbytes / (us * 1e-6) / copy_bw
    if spec.flops:
        case["ropekv"]["tflops"] = spec.flops / (us * 1e-6) / 1e12
    for name, r in others.items():
        entry: dict[str, Any] = {}
        case["peers"][name] = entry
        if isinstance(r, str):
            entry["status"] = r
            continue
        try:
            if r.reset:
                r.reset()
            r.call()
            mismatch = compare_all(r.outputs(), r.expect(expected) if r.expect else expected,
                                   w.compare_mode)
        except Exception as e:  # noqa: BLE001
            what = "skipped: compile failed" if name == "torch-compile" else "error"
            entry["status"] = f"{what}: {_one_line(e)}"
            continue
        entry["check"] = "ok" if mismatch is None else f"MISMATCH: {mismatch}"
        try:
            entry.update(time_runner(r, spec, settings, flusher))
            entry["ratio"] = entry["us"] / us
            entry["status"] = "ok" if mismatch is None else "mismatch"
        except Exception as e:  # noqa: BLE001
            entry["status"] = f"error: {_one_line(e)}"
    case["seconds"] = time.perf_counter() - t
    return case


# ---- output --------------------------------------------------------------------------------------


def format_table(header, rows):
    """A GitHub-markdown table with padded columns."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in cells[1:]])


def _fmt_us(us):
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def table_rows(result):
    """(header, rows, notes) of the result table."""
    peer_names = []
    for c in result["cases"]:
        for p in c.get("peers", {}):
            if p not in peer_names:
                peer_names.append(p)
    header = ["case", "ropekv us", "host us", "MB", "GB/s", "% copy", *peer_names]
    rows, notes = [], []
    for c in result["cases"]:
        mb = f"{c['bytes'] / 1e6:.1f}"
        if "error" in c:
            rows.append([c["name"], "error", "", mb, "", "", *["" for _ in peer_names]])
            notes.append(f"{c['name']}: {c['error']}")
            continue
        r = c["ropekv"]
        graph = "graph_us" in r
        name = c["name"] + (" [graph]" if graph else "")
        row = [name, _fmt_us(r["us"]), _fmt_us(r["host_us"]) if "host_us" in r else "", mb,
               f"{r['gbps']:.0f}", f"{r['pct_copy']:.0f}"]
        if c.get("flops") and not c.get("decode"):
            row[4] += f" ({r['tflops']:.0f} TFLOP/s)"
        for p in peer_names:
            e = c["peers"].get(p)
            if e is None:
                row.append("")
                continue
            status = e.get("status", "")
            if "us" in e:
                cell = f"{_fmt_us(e['us'])} ({e['ratio']:.2f}x)"
                if c.get("decode") and "graph_us" not in e and "graph_us" in r:
                    cell += " ev"
                    notes.append(f"{p}: 'ev' = event-timed, not capturable in a CUDA graph "
                                 f"({e.get('graph_error', '')})")
                if "host_us" in e:
                    cell += f" h{_fmt_us(e['host_us'])}"
                if status == "mismatch":
                    cell = "MISMATCH " + cell
                    notes.append(f"{c['name']} / {p}: {e['check']}")
                row.append(cell)
            elif status == "-":
                row.append("-")
            elif status.startswith("skipped"):
                row.append("skip")
                notes.append(f"{p}: {status}")
            else:
                row.append("error")
                notes.append(f"{c['name']} / {p}: {status}")
        rows.append(row)
    seen, unique = set(), []
    for n in notes:
        if n not in seen:
            seen.add(n)
            unique.append(n)
    return header, rows, unique


def report(result):
    """The text printed after a run."""
    env = result.get("environment", {})
    lines = [(f"ropekv bench on {env.get('gpu', '?')} (driver {env.get('driver', '?')}, CUDA "
              f"runtime {env.get('cuda_runtime', '?')}, CuPy {env.get('cupy')}, torch "
              f"{env.get('torch')}, FlashInfer {env.get('flashinfer')}, ropekv "
              f"{env.get('ropekv')} @ {env.get('git_revision') or 'unknown revision'})"),
             (f"copy bandwidth: {result['copy_bandwidth'] / 1e12:.2f} TB/s (1 GiB "
              f"device-to-device, read + write bytes)"), ""]
    header, rows, notes = table_rows(result)
    lines.append(format_table(header, rows))
    lines += ["", ("Times in us per call (median). [graph]: per-call time under CUDA-graph "
                   "replay; 'host us' and 'hN': host time per eager call, back to back. Ratio: "
                   "peer / ropekv (above 1: ropekv is faster). MB: minimal bytes (each input read "
                   "once, each output written once); GB/s and % copy: those bytes over ropekv's "
                   "time, against the copy bandwidth. '-': the peer has no such operation "
                   "(torch-compile runs on the headline cases only, to bound compile time; steps "
                   "= a CuPy RMSNorm kernel + ropekv's paged op, for the MLA op).")]
    for p, s in result.get("peer_status", {}).items():
        if s != "used":
            lines.append(f"peer {p}: {s}")
    if result.get("missing_ops"):
        lines.append(f"ops not in this ropekv (no cases): {', '.join(result['missing_ops'])}")
    lines += [f"note: {n}" for n in notes]
    lines.append(f"total wall time: {result['wall_s']:.1f} s")
    return "\n".join(lines)


def write_json(result, path):
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")


COLORS = {"ropekv": "C0", "flashinfer": "C1", "torch": "C2", "torch-compile": "C3",
          "cublas": "C4", "cublas+ropekv": "C5", "steps": "C6"}


def _group(case):
    """The dtype / layout family of a case: its name without the shape and sweep suffixes."""
    return case.get("series") or case["name"].replace(" (sweep)", "").rsplit(" ", 1)[0]


def plot(result, path):
    """Time against token count, one panel per op: ropekv and each peer on one case family (the
    token sweep where the op has one, else its family with the most cases), the copy-bandwidth
    floor (minimal bytes over the copy bandwidth) dotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'ropekv[plot]'") from e
    cases = [c for c in result["cases"] if "ropekv" in c]
    ops = [op for op in OPS if any(c["op"] == op for c in cases)]
    if not ops:
        raise RuntimeError("--plot: no case ran, nothing to plot")
    cols = min(3, len(ops))
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.3 * rows), squeeze=False)
    bw = result["copy_bandwidth"]
    for ax in axes.flat[len(ops):]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        mine = [c for c in cases if c["op"] == op]
        groups: dict[str, list] = {}
        for c in mine:
            groups.setdefault(_group(c), []).append(c)
        title = max(groups, key=lambda g: (any(c.get("series") for c in groups[g]),
                                           len(groups[g])))
        pts = sorted(groups[title], key=lambda c: c["tokens"])
        x = [c["tokens"] for c in pts]
        ax.plot(x, [c["ropekv"]["us"] for c in pts], "o-", color=COLORS["ropekv"], label="ropekv")
        names = [p for p in COLORS if any(p in c["peers"] for c in pts)]
        for p in names:
            px = [(c["tokens"], c["peers"][p]["us"]) for c in pts
                  if "us" in c["peers"].get(p, {})]
            if px:
                ax.plot(*zip(*px), "s--", color=COLORS.get(p), label=p, alpha=0.8)
        ax.plot(x, [c["bytes"] / bw * 1e6 for c in pts], "k:", label="copy-bandwidth floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    env = result.get("environment", {})
    fig.suptitle(f"ropekv bench on {env.get('gpu', '?')}: median us per call (decode points "
                 f"under CUDA-graph replay); copy bandwidth {bw / 1e12:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(ops=None, peers=None, quick=False, json_path=None, plot_path=None):
    """``ropekv bench``: returns the exit code."""
    ok, device = gpu_status()
    if not ok:
        print(f"ropekv bench: {device}; the benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    if plot_path:  # fail before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("ropekv bench: --plot needs matplotlib: pip install 'ropekv[plot]'",
                  file=sys.stderr)
            return 1
    result = run(ops, peers, quick, json_path=json_path)
    if not result["cases"]:
        print(f"ropekv bench: no case to run (ops missing from this ropekv: "
              f"{', '.join(result['missing_ops'])})", file=sys.stderr)
        return 1
    if json_path:
        write_json(result, json_path)
    if plot_path:
        plot(result, plot_path)
    print(report(result))
    if json_path:
        print(f"wrote {json_path}")
    if plot_path:
        print(f"wrote {plot_path}")
    errors = [c for c in result["cases"] if "error" in c]
    return 1 if errors else 0
