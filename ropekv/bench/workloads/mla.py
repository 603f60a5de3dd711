"""The MLA RoPE + RMSNorm op (:func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache`): workload,
PyTorch peer, the 'steps' peer (a CuPy RMSNorm kernel, then ropekv's paged op), cases."""

from __future__ import annotations

import functools

import numpy as np

from ropekv import bytes as nbytes_of
from ropekv.bench.arrays import BF16, E4M3, E5M2, F16, FP8, _dtname
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    DSV3,
    OP_FUNCTIONS,
    CaseSpec,
    Workload,
    _cos_sin,
    _fn,
    _lazy,
    _RaggedMixin,
    _ropekv,
    _tcast,
    _torch,
    _torch_ragged_addr,
    _trms,
    _trope,
)


class MlaWL(_RaggedMixin, Workload):
    """:func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache` with the (ckv, kpe) cache layout."""

    op = "mla"
    OUTPUTS = ("q_rope_out", "ckv", "kpe")

    def build(
        self,
        B,
        S,
        prefix,
        Hq,
        L,
        R,
        dtype,
        cache_dtype,
        page_size=16,
        is_neox=False,
        kv_norm_dim=None,
        kv_scale=None,
        eps=1e-6,
    ):
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
        self.sample = {
            "q_rope_out": ("q_rope_out", (tok,)),
            "ckv_rows": ("ckv", rows),
            "kpe_rows": ("kpe", rows),
        }

    def call(self, o, **options):
        a = self.a
        return _fn("mla_rope_rmsnorm_append_paged_kv_cache")(
            a["q_rope"],
            a["kv"],
            a["gamma"],
            a["table"],
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            (o["ckv"], o["kpe"]),
            epsilon=self.eps,
            kv_norm_dim=self.kv_norm_dim,
            is_neox=self.is_neox,
            kv_scale=self.kv_scale,
            q_rope_out=o["q_rope_out"],
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
        L, R, nd, neox, eps = self.L, self.R, self.nd, self.is_neox, self.eps
        scale = self.kv_scale or 1.0
        ps = self.page_size

        def fn(q_rope, kv, gamma, table, offsets, lens, block_table, b, ckv, kpe, q_out):
            p, page, entry = _torch_ragged_addr(offsets, lens, block_table, b, ps)
            cs = table[p]
            q_out.copy_(
                _trope(q_rope.float(), cs[:, None, : R // 2], cs[:, None, R // 2 :], neox).to(
                    q_out.dtype
                )
            )
            x = kv.float()
            lat = _trms(x[:, :nd], gamma, eps)
            if nd < L:
                lat = torch.cat([lat, x[:, nd:L]], -1)
            ckv[page, entry] = _tcast(lat / scale, ckv.dtype)
            kpe[page, entry] = _tcast(
                _trope(x[:, L:], cs[:, : R // 2], cs[:, R // 2 :], neox) / scale, kpe.dtype
            )

        return fn, (
            t["q_rope"],
            t["kv"],
            t["gamma"],
            t["table"],
            t["input_row_offsets"],
            t["cache_lengths"],
            t["block_table"],
            t["token_batch"],
            o["ckv"],
            o["kpe"],
            o["q_rope_out"],
        )

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

        args = (
            np.uint64(a["kv"].data.ptr),
            np.int64(kv_row),
            np.uint64(a["gamma"].data.ptr),
            np.uint64(o["ckv"].data.ptr),
            np.uint64(rows.data.ptr),
            np.int32(nd),
            np.int32(L),
            inv_scale,
            np.float32(self.eps),
        )

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
            fn,
            a["q_rope"],
            a["kv"][:, L:],
            None,
            None,
            None,
            a["table"],
            positions,
            (o["ckv"][..., :0], o["kpe"]),
            kv_indices,
            indptr,
            a["token_batch"],
            positions,
            is_neox=self.is_neox,
            quant_scale_q=1.0,
            quant_scale_kv=scale,
            page_size=self.page_size,
            q_rope_out=q_out,
        )


RMSNORM_SRC = r"""
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

    module = cupy.RawModule(code=RMSNORM_SRC, options=("-std=c++17", *_header_options()))
    return module.get_function(
        f"rmsnorm_{_dtname(dtype).replace('fp16', 'f16')}_"
        f"{_dtname(cache_dtype).replace('fp16', 'f16')}"
    )


def specs():
    out = []
    for B, S in ((4, 2048), *((B, 1) for B in DECODE_SWEEP)):
        T = B * S
        out.append(
            CaseSpec(
                "mla",
                f"mla rmsnorm bf16->e4m3 {B}x{S}",
                T,
                nbytes_of.mla_rmsnorm_bytes(T, 128, 512, 64, BF16, E4M3),
                _lazy(MlaWL, B=B, S=S, prefix=1024, dtype=BF16, cache_dtype=E4M3, **DSV3),
                decode=S == 1,
                quick=B == 128,
                compile=B in (4, 128),
                series="mla rmsnorm bf16->e4m3" if S == 1 else "",
            )
        )
    return out


def check_cases(add):
    """``ropekv check``'s cases: ``add(op, name, workload class, **build arguments)``."""
    for cache in (BF16, E4M3):
        add(
            "mla",
            f"bf16->{_dtname(cache)} L512 R64",
            MlaWL,
            B=3,
            S=7,
            prefix=21,
            Hq=16,
            L=512,
            R=64,
            dtype=BF16,
            cache_dtype=cache,
            kv_scale=2.0 if cache in FP8 else None,
        )
    add(
        "mla",
        "fp16->e5m2 norm dim 128 of L256",
        MlaWL,
        B=2,
        S=5,
        prefix=3,
        Hq=32,
        L=256,
        R=32,
        dtype=F16,
        cache_dtype=E5M2,
        kv_norm_dim=128,
        page_size=32,
        kv_scale=0.5,
    )
