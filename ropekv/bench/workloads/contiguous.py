"""The contiguous-cache op (:func:`ropekv.apply_rope_write_kv`): workload and cases."""

from __future__ import annotations

import numpy as np

from ropekv import bytes as nbytes_of
from ropekv.bench.arrays import BF16, E4M3, E5M2, F16, FP8, _dtname
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    LLAMA,
    CaseSpec,
    Workload,
    _cos_sin,
    _fn,
    _lazy,
    _tcast,
    _torch,
    _trope,
)

INT8 = np.dtype(np.int8)
F32 = np.dtype(np.float32)


class ContiguousWL(Workload):
    """:func:`ropekv.apply_rope_write_kv`: (B, S) tokens into a (B, 2, Hkv, C, D) cache."""

    op = "contiguous"
    OUTPUTS = ("q", "q_out", "q_scale_out", "cache", "cache_scales")

    def build(
        self,
        B,
        S,
        Hq,
        Hkv,
        D,
        C,
        dtype,
        cache_dtype,
        R=None,
        decode=False,
        is_neox=True,
        kv_scale=(1.0, 1.0),
        q_out_dtype=None,
        kv_rows=False,
    ):
        """``q_out_dtype``: fp8 queries into q_out with dynamic scales (q_scale_out); ``kv_rows``:
        per-token-head cache scales (kv_cache_scales) instead of ``kv_scale``."""
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
        if kv_rows:
            self.a["cache_scales"] = g.zeros((B, 2, Hkv, C), F32)
        elif np.dtype(cache_dtype) in FP8:
            self.a["kv_scale"] = g.put(np.asarray(kv_scale, np.float32))
        if q_out_dtype is not None:
            self.a["q_out"] = g.zeros((B, S, Hq, D), q_out_dtype)
            self.a["q_scale_out"] = g.zeros((B, S, Hq), F32)
        tok = self._sample_tokens(B * S)
        b, s = tok // S, tok % S
        slot = self.slots[b, s]
        q_name = "q" if q_out_dtype is None else "q_out"
        self.sample = {
            "q": (q_name, (b, s)),
            "k_rows": ("cache", (b, 0, slice(None), slot)),
            "v_rows": ("cache", (b, 1, slice(None), slot)),
        }
        if q_out_dtype is not None:
            self.sample["q_scales"] = ("q_scale_out", (b, s))
        if kv_rows:
            self.sample["kv_scales"] = ("cache_scales", (b, slice(None), slice(None), slot))

    def call(self, o, **options):
        a = self.a
        kw = {
            "kv_end_lens": a.get("kv_end_lens"),
            "kv_scale": a.get("kv_scale"),
            "is_neox": self.is_neox,
            "q_out": o.get("q_out"),
            "q_scale_out": o.get("q_scale_out"),
            "kv_cache_scales": o.get("cache_scales"),
        }
        kw.update(options)
        _fn("apply_rope_write_kv")(o.get("q", a["q"]), a["k"], a["v"], o["cache"], a["table"], **kw)

    def options(self):
        """``ropekv bench --options``: on an fp8 cache with a (2,) device kv_scale, the same
        scales as constants (the MODE 2 kernel; outputs unchanged, so checked). The computed
        scales' cases get their static counterpart, the same bytes moved (outputs differ: timed
        only): fp8 Q with a static q_scale, an e4m3 cache with static kv_scale."""
        out = {}
        scale = self.a.get("kv_scale")
        if scale is not None:
            out["kv_scale const"] = ({"kv_scale": tuple(float(x) for x in _host(scale))}, True)
        if "q_scale_out" in self.a:
            out["static q_scale"] = ({"q_scale_out": None, "q_scale": 1.0}, False)
        if "cache_scales" in self.a and self.a["cache"].dtype in FP8:
            out["static kv_scale"] = ({"kv_cache_scales": None, "kv_scale": (1.0, 1.0)}, False)
        return out

    def torch_fn(self, t, o):
        if "q_out" in self.a or "cache_scales" in self.a:  # no PyTorch composition of these
            return None
        R, neox = self.R, self.is_neox
        scale = t.get("kv_scale")
        ks, vs = (scale[0], scale[1]) if scale is not None else (1.0, 1.0)
        return _torch_contiguous, (
            o["q"],
            t["k"],
            t["v"],
            o["cache"],
            t["table"],
            t.get("kv_end_lens"),
            ks,
            vs,
            R,
            neox,
        )


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _torch_contiguous(q, k, v, cache, table, lens, ks, vs, R, neox):
    """RoPE, then K and V rows into the (B, 2, Hkv, C, D) cache, indexed as rows of D."""
    torch = _torch()
    B, S, Hkv, D = k.shape
    C = cache.shape[3]
    ar = torch.arange(S, device=q.device)
    slots = ar[None, :].expand(B, S) if lens is None else lens.long()[:, None] - S + ar
    cs = table[slots]
    cos, sin = cs[..., None, : R // 2], cs[..., None, R // 2 :]
    q.copy_(_trope(q.float(), cos, sin, neox).to(q.dtype))
    heads = torch.arange(Hkv, device=q.device)
    b = torch.arange(B, device=q.device)[:, None, None]
    rows = ((b * 2 * Hkv + heads) * C + slots[..., None]).reshape(-1)  # K rows, (B * S * Hkv,)
    flat = cache.view(-1, D)
    flat[rows] = _tcast(_trope(k.float(), cos, sin, neox) / ks, cache.dtype).reshape(-1, D)
    flat[rows + Hkv * C] = _tcast(v.float() / vs, cache.dtype).reshape(-1, D)


def specs():
    out = []
    for cache in (F16, E4M3):
        series = f"contiguous fp16->{_dtname(cache)}"
        for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
            decode = S == 1
            kw = dict(B=B, S=S, C=4096, dtype=F16, cache_dtype=cache, decode=decode, **LLAMA)
            out.append(
                CaseSpec(
                    "contiguous",
                    f"{series} {B}x{S}",
                    B * S,
                    nbytes_of.contiguous_bytes(B * S, 32, 8, 128, 128, F16, cache),
                    _lazy(ContiguousWL, **kw),
                    decode=decode,
                    quick=cache == F16 and B in (8, 64),
                    compile=cache == F16 and B in (8, 64),
                    series=series if decode else "",
                )
            )
    # the quantized outputs (issue 14), each against the plain fp16 -> e4m3 op above: fp8 queries
    # with dynamic scales, and per-token-head K/V scales (e4m3 and int8 caches)
    for label, cache, extra in (
        ("qe4m3 dyn", E4M3, {"q_out_dtype": E4M3}),
        ("kv rows", E4M3, {"kv_rows": True}),
        ("kv rows", INT8, {"kv_rows": True}),
    ):
        series = f"contiguous fp16->{_dtname(cache)} {label}"
        for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
            decode = S == 1
            kw = dict(
                B=B, S=S, C=4096, dtype=F16, cache_dtype=cache, decode=decode, **LLAMA, **extra
            )
            q_out = extra.get("q_out_dtype")
            out.append(
                CaseSpec(
                    "contiguous",
                    f"{series} {B}x{S}",
                    B * S,
                    nbytes_of.contiguous_bytes(
                        B * S,
                        32,
                        8,
                        128,
                        128,
                        F16,
                        cache,
                        q_out_dtype=q_out,
                        q_scales=q_out is not None,
                        kv_scales=extra.get("kv_rows", False),
                    ),
                    _lazy(ContiguousWL, **kw),
                    decode=decode,
                    series=series if decode else "",
                )
            )
    return out


def check_cases(add):
    """``ropekv check``'s cases: ``add(op, name, workload class, **build arguments)``."""
    for dtype, cache, decode, neox in (
        (F16, F16, False, True),
        (BF16, E4M3, True, False),
        (F16, E5M2, True, True),
    ):
        add(
            "contiguous",
            f"{_dtname(dtype)}->{_dtname(cache)} {'decode' if decode else 'prefill'}"
            f"{'' if neox else ' interleaved'}",
            ContiguousWL,
            B=3,
            S=1 if decode else 19,
            Hq=8,
            Hkv=2,
            D=128,
            R=64 if decode else 128,
            C=64,
            dtype=dtype,
            cache_dtype=cache,
            decode=decode,
            is_neox=neox,
            kv_scale=(0.5, 2.0),
        )
    for dtype, decode, neox in ((F16, False, True), (BF16, True, False)):
        add(
            "contiguous",
            f"{_dtname(dtype)}->e4m3 q e5m2 dynamic, kv rows "
            f"{'decode' if decode else 'prefill'}{'' if neox else ' interleaved'}",
            ContiguousWL,
            B=3,
            S=1 if decode else 19,
            Hq=8,
            Hkv=2,
            D=128,
            R=64 if decode else 128,
            C=64,
            dtype=dtype,
            cache_dtype=E4M3,
            decode=decode,
            is_neox=neox,
            q_out_dtype=E5M2,
            kv_rows=True,
        )
