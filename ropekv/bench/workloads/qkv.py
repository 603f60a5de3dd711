"""The fused QKV projection (:func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`): workload,
PyTorch and cuBLAS peers, cases."""

from __future__ import annotations

import math

import numpy as np

from ropekv import bytes as nbytes_of
from ropekv.bench.arrays import E4M3, F16, FP8, _copy, _dtname, _torch, to_numpy
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    LLAMA,
    OP_FUNCTIONS,
    CaseSpec,
    Workload,
    _cos_sin,
    _fn,
    _lazy,
    _RaggedMixin,
    _tcast,
    _torch_ragged_addr,
    _trope,
)


class QkvWL(_RaggedMixin, Workload):
    """:func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`: fp16/bf16, fp8 or 4-bit weights."""

    op = "qkv"
    compare_mode = "gemm"
    OUTPUTS = ("q_out", "k_cache", "v_cache")

    def build(
        self,
        B,
        S,
        prefix,
        K,
        Hq,
        Hkv,
        D,
        dtype,
        cache_dtype,
        page_size=16,
        layout="NHD",
        rope=True,
        kv_scale=None,
        weight_format="dense",
        group_size=128,
        copies=1,
    ):
        """``weight_format``: "dense" (the input dtype), "e4m3" (float8_e4m3fn codes with float32
        per-row scales) or "int4" (two 4-bit values per byte, ``group_size`` columns per scale in
        the input dtype, zero point 8); quantized weights also keep ``weight_ref``, the dequantized
        weight in the input dtype, which the PyTorch and cuBLAS peers multiply by. ``copies``:
        ropekv's calls rotate over this many copies of the weights (decode cases: more bytes than
        the L2 holds, so graph-replayed calls stream their weights from memory)."""
        g = self.g
        num_pages, seq = self.ragged(B, S, prefix, page_size)
        T = B * S
        self.T, self.Hq, self.Hkv, self.D, self.layout = T, Hq, Hkv, D, layout
        self.fp8 = np.dtype(cache_dtype) in FP8
        self.kv_scale = (kv_scale or 1.0) if self.fp8 else None
        N = (Hq + 2 * Hkv) * D
        self.a["hidden"] = g.randn((T, K), dtype)
        self.weight_format, self.group_size = weight_format, group_size
        self._weights(N, K, dtype, weight_format, group_size)
        self.weight_copies = [self.a["weight"]] + [
            _copy(self.a["weight"]) for _ in range(copies - 1)
        ]
        self.turn = 0
        self.a["table"] = g.put(_cos_sin(seq, D)) if rope else None
        self.a["q_out"] = g.zeros((T, Hq * D), dtype)
        shape = (
            (num_pages, page_size, Hkv, D) if layout == "NHD" else (num_pages, Hkv, page_size, D)
        )
        self.a["k_cache"] = g.cache(shape, cache_dtype, self.poison)
        self.a["v_cache"] = g.cache(shape, cache_dtype, self.poison)
        # for cuBLAS + ropekv's paged append: the block table as FlashInfer-style indices
        bt = to_numpy(self.a["block_table"])
        for name, v in (
            ("kv_indices", bt.ravel()),
            ("kv_indptr", np.arange(B + 1) * self.per),
            ("batch_indices", self.batch),
            ("positions", self.positions),
        ):
            self.a[name] = g.put(np.asarray(v, np.int32))
        tok = self._sample_tokens(T)
        rows = (
            (self.page[tok], self.entry[tok])
            if layout == "NHD"
            else (self.page[tok], slice(None), self.entry[tok])
        )
        self.sample = {
            "q_out": ("q_out", (tok,)),
            "k_rows": ("k_cache", rows),
            "v_rows": ("v_cache", rows),
        }
        self.tok = tok

    def _weights(self, N, K, dtype, fmt, group_size):
        g, xp, s = self.g, self.xp, 1.0 / math.sqrt(K)
        if fmt == "dense":
            self.a["weight"] = g.randn((N, K), dtype, scale=s)
            return
        if fmt == "e4m3":
            # codes of magnitude 2^-4 .. 15 (exponent fields 3..10, any mantissa), random signs
            b = g.bytes((N, K))
            code = ((b & 0x80) | ((3 + ((b >> 3) & 7)) << 3) | (b & 7)).astype(np.uint8)
            scales = g.randn((N,), np.float32, scale=s / 40, offset=s / 4)
            lut = g.put(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32))
            ref = lut[code] * scales[:, None]
            self.a["weight"], self.a["weight_scales"] = code.view(E4M3), scales
            self.weight_kw = {"weight_scales": scales}
        elif fmt == "int4":
            packed = g.bytes((N, K // 2))
            scales = g.randn((N, K // group_size), dtype, scale=s / 40, offset=s / 4)
            nib = xp.empty((N, K), np.float32)
            nib[:, 0::2] = packed & np.uint8(0xF)
            nib[:, 1::2] = packed >> 4
            ref = (nib - np.float32(8)) * xp.repeat(g.float32(scales), group_size, axis=1)
            self.a["weight"], self.a["weight_scales"] = packed, scales
            self.weight_kw = {"weight_scales": scales, "group_size": group_size}
        else:
            raise ValueError(f"weight_format must be dense, e4m3 or int4, got {fmt!r}")
        self.a["weight_ref"] = g.cast(ref, dtype)

    @property
    def weight_bytes(self):
        """Bytes of the weights and their scales: what one call streams."""
        return sum(self.a[n].nbytes for n in ("weight", "weight_scales") if n in self.a)

    def call(self, o, **options):
        a = self.a
        weight = a["weight"]
        if len(self.weight_copies) > 1 and weight is self.weight_copies[0]:
            weight = self.weight_copies[self.turn % len(self.weight_copies)]
            self.turn += 1
        kw = (
            {}
            if self.weight_format == "dense"
            else {
                "weight_scales": a["weight_scales"],
                "group_size": self.group_size if self.weight_format == "int4" else None,
            }
        )
        return _fn("fused_qkv_matmul_append_paged_kv_cache")(
            a["hidden"],
            weight,
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            (o["k_cache"], o["v_cache"]),
            num_q_heads=self.Hq,
            cos_sin_cache=a["table"],
            is_neox=True,
            kv_layout=self.layout,
            kv_scale=self.kv_scale,
            out=o["q_out"],
            **kw,
            **options,
        )

    def options(self):
        # neither changes the sampled rows: the tail cleared lies past each request's new rows
        return {
            "status": ({"status": self.g.zeros((1,), np.int32)}, True),
            "clear": ({"clear_unused_last_page_rows": True}, True),
        }

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
            q = x[:, : Hq * D].view(T, Hq, D)
            k = x[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
            v = x[:, (Hq + Hkv) * D :].view(T, Hkv, D)
            if rope:
                cs = table[p]
                cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2 :]
                q, k = _trope(q, cos, sin, True), _trope(k, cos, sin, True)
            q_out.copy_(q.reshape(T, Hq * D).to(q_out.dtype))
            kq, vq = _tcast(k / scale, kc.dtype), _tcast(v / scale, vc.dtype)
            if nhd:
                kc[page, entry], vc[page, entry] = kq, vq
            else:
                kc[page, :, entry], vc[page, :, entry] = kq, vq

        weight = t["weight_ref"] if t.get("weight_ref") is not None else t["weight"]
        return fn, (
            t["hidden"],
            weight,
            t.get("table"),
            t["input_row_offsets"],
            t["cache_lengths"],
            t["block_table"],
            t["token_batch"],
            o["k_cache"],
            o["v_cache"],
            o["q_out"],
        )

    def cublas_peers(self):
        """'cublas': the projection alone, with fp16 weights (the dequantized ones for quantized
        formats; its V columns are checked against ropekv's V cache rows); 'cublas+ropekv': the
        projection, then ropekv's paged RoPE + append when present."""
        import cupy

        a, T, Hq, Hkv, D = self.a, self.T, self.Hq, self.Hkv, self.D
        weight = a.get("weight_ref", a["weight"])  # the fp16 GEMM, whatever ropekv's weights
        tmp = cupy.empty((T, (Hq + 2 * Hkv) * D), a["hidden"].dtype)
        tok = self.tok

        def gemm():
            cupy.matmul(a["hidden"], weight.T, out=tmp)

        def gemm_outputs():
            v = tmp[cupy.asarray(tok), (Hq + Hkv) * D :].reshape(len(tok), Hkv, D)
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
            cupy.matmul(a["hidden"], weight.T, out=tmp)
            fn(
                view[:, :Hq],
                view[:, Hq : Hq + Hkv],
                None,
                None,
                view[:, Hq + Hkv :],
                a["table"],
                a["positions"],
                (o["k_cache"], o["v_cache"]),
                a["kv_indices"],
                a["kv_indptr"],
                a["batch_indices"],
                a["positions"],
                is_neox=True,
                page_size=self.page_size,
                kv_layout=self.layout,
                q_rope_out=q3,
            )

        peers["cublas+ropekv"] = (gemm_append, lambda: self.outputs(o), o)
        return peers


WEIGHT_FORMATS = {"dense": "fp16", "e4m3": "fp8 e4m3 per-row", "int4": "int4 g128"}
L2_ROTATE_BYTES = 192 << 20  # decode cases rotate over weight copies holding at least this much


def weight_bytes(N, K, fmt, dtype=F16, group_size=128):
    """Bytes of the weights and their scales in ``fmt`` (what one call streams)."""
    if fmt == "dense":
        return N * K * np.dtype(dtype).itemsize
    if fmt == "e4m3":
        return N * K + N * 4
    return N * K // 2 + N * (K // group_size) * np.dtype(dtype).itemsize


# tokens of the fp8 and 4-bit weight cases: the decode sweep to 128, 8 (qkv_lean_mma's 8-token
# tile at its full width) and 32 (qkv_wgmma's smallest tile, where both formats start on it)
QUANTIZED_TOKENS = (1, 4, 8, 16, 32, 64, 128)


def specs():
    """fp16 weights at 1-256 and 8192 tokens (the decode sweep and a prefill), fp8 and 4-bit
    weights at :data:`QUANTIZED_TOKENS`; Llama-3-8B's projection (K 4096, N 6144)."""
    out = []
    for fmt, tokens in (
        ("dense", (8192, *DECODE_SWEEP)),
        ("e4m3", QUANTIZED_TOKENS),
        ("int4", QUANTIZED_TOKENS),
    ):
        out += [case(fmt, T) for T in tokens]
    return out


def case(fmt, T, dtype=F16, heads=LLAMA, K=4096):
    """The case of a model's projection with weights ``fmt`` ("dense", "e4m3", "int4") at ``T``
    tokens (8192: a prefill of 8 x 1024) and inputs ``dtype`` (named in the case when it is not
    fp16): by default Llama-3-8B's (``heads`` {"Hq": 32, "Hkv": 8, "D": 128}, K 4096, so N 6144),
    the bench's cases; other ``heads`` and ``K`` serve experiments (``tools/experiments``)."""
    Hq, Hkv, D = heads["Hq"], heads["Hkv"], heads["D"]
    N = (Hq + 2 * Hkv) * D
    label = {"dense": "fp16", "e4m3": "fp8w", "int4": "int4w"}[fmt]
    if dtype != F16:
        label = f"{label} {_dtname(dtype)}"
    wb = weight_bytes(N, K, fmt, dtype)
    B, S = (8, 1024) if T == 8192 else (T, 1)
    decode = S == 1
    nbytes = nbytes_of.qkv_bytes(T, K, Hq, Hkv, D, dtype, dtype, rotary_dim=D)
    bench = heads == LLAMA and K == 4096
    return CaseSpec(
        "qkv",
        f"qkv {label} K{K} N{N} T{T}",
        T,
        nbytes - N * K * np.dtype(dtype).itemsize + wb,
        _lazy(
            QkvWL,
            B=B,
            S=S,
            prefix=1024,
            K=K,
            dtype=dtype,
            cache_dtype=dtype,
            weight_format=fmt,
            copies=-(-L2_ROTATE_BYTES // wb) if decode else 1,
            **heads,
        ),
        decode=decode,
        quick=bench and T == 16,
        compile=bench and fmt == "dense" and T in (8192, 64) and dtype == F16,
        flops=nbytes_of.qkv_flops(T, K, Hq, Hkv, D),
        series=f"qkv {label} K{K} N{N}" if decode else "",
        weight_bytes=wb,
        weight_format=WEIGHT_FORMATS[fmt],
    )


def check_cases(add):
    """``ropekv check``'s cases: ``add(op, name, workload class, **build arguments)``."""
    for B, S, rope, layout in ((1, 7, True, "NHD"), (1, 1, False, "HND"), (3, 43, True, "HND")):
        add(
            "qkv",
            f"fp16 K4096 {B}x{S} {'rope ' if rope else ''}{layout}",
            QkvWL,
            B=B,
            S=S,
            prefix=5,
            K=4096,
            Hq=32,
            Hkv=8,
            D=128,
            dtype=F16,
            cache_dtype=F16,
            layout=layout,
            rope=rope,
        )
    for fmt, B, S, layout in (
        ("e4m3", 1, 1, "NHD"),
        ("e4m3", 3, 43, "HND"),
        ("int4", 2, 1, "HND"),
        ("int4", 3, 43, "NHD"),
    ):
        add(
            "qkv",
            f"{WEIGHT_FORMATS[fmt]} weights K4096 {B}x{S} rope {layout}",
            QkvWL,
            B=B,
            S=S,
            prefix=5,
            K=4096,
            Hq=8,
            Hkv=2,
            D=128,
            dtype=F16,
            cache_dtype=F16,
            layout=layout,
            weight_format=fmt,
        )
