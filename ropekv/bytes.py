"""Minimal bytes each ropekv operation must move through device memory.

Each input is read once and each output written once: q, k, v (and the MLA latent row, the hidden
state, the weights) in their input dtype, the q output and the cache rows in their output dtype,
one float32 cos/sin row of R values per token, and per-call vectors (RMSNorm weights) once. Index
arrays are left out: they are a few bytes per token, and leaving them out keeps these counts equal
to the ones quoted for FlashInfer in ``docs/performance.md``. Achieved bandwidth is these bytes
over the measured time; no kernel can beat the device-to-device copy bandwidth on them.

Dtypes may be anything ``numpy.dtype`` accepts (ml_dtypes fp8 and bfloat16 included).
"""

from __future__ import annotations

import numpy as np

COS_SIN_ITEMSIZE = 4  # float32 tables


def _size(dtype):
    return np.dtype(dtype).itemsize


def rope_kv_bytes(
    tokens, num_q_heads, num_kv_heads, head_dim, rotary_dim, dtype, q_out_dtype, cache_dtype
):
    """RoPE on q and k, then k and v into a cache (the contiguous and the paged GQA/MHA ops).

    Per token: q, k, v read (``dtype``), q written (``q_out_dtype``), the K and V cache rows
    written (``cache_dtype``), one cos/sin row of ``rotary_dim`` float32 read."""
    i, o, c = _size(dtype), _size(q_out_dtype), _size(cache_dtype)
    per_token = (
        num_q_heads * head_dim * (i + o)
        + 2 * num_kv_heads * head_dim * (i + c)
        + rotary_dim * COS_SIN_ITEMSIZE
    )
    return tokens * per_token


def computed_scale_bytes(tokens, q_heads=0, kv_heads=0):
    """The float32 scales an op computes and writes (docs/conventions.md, "Computed scales"):
    one per token and Q head (dynamic fp8 Q, ``q_heads``) and one per written K row and V row
    (per-token-head KV scales, ``kv_heads``). Add to the op's own count."""
    return tokens * (q_heads + 2 * kv_heads) * 4


def contiguous_bytes(
    tokens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    rotary_dim,
    dtype,
    cache_dtype,
    q_out_dtype=None,
    q_scales=False,
    kv_scales=False,
):
    """:func:`ropekv.apply_rope_write_kv`: q is roped in place (read and written in its dtype), or
    read and written to a ``q_out`` of ``q_out_dtype``; plus the computed scales
    (:func:`computed_scale_bytes`) of ``q_scales`` and ``kv_scales``."""
    return rope_kv_bytes(
        tokens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        dtype,
        q_out_dtype or dtype,
        cache_dtype,
    ) + computed_scale_bytes(tokens, num_q_heads * bool(q_scales), num_kv_heads * bool(kv_scales))


def paged_mla_bytes(tokens, num_q_heads, kv_lora_rank, rope_dim, dtype, q_out_dtype, cache_dtype):
    """The paged op in MLA mode (2-D ``k_rope``): q_rope and q_nope read and written, k_rope and
    k_nope read, their kpe and ckv cache rows written, one cos/sin row per token."""
    i, o, c = _size(dtype), _size(q_out_dtype), _size(cache_dtype)
    width = kv_lora_rank + rope_dim
    per_token = num_q_heads * width * (i + o) + width * (i + c) + rope_dim * COS_SIN_ITEMSIZE
    return tokens * per_token


def mla_rmsnorm_bytes(
    tokens, num_q_heads, kv_lora_rank, rope_dim, dtype, cache_dtype, kv_norm_dim=None
):
    """:func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache`: q_rope read and written in its dtype,
    the ``(L + R)`` kv row read and its cache row written, one cos/sin row per token, gamma once."""
    i, c = _size(dtype), _size(cache_dtype)
    width = kv_lora_rank + rope_dim
    norm = kv_lora_rank if kv_norm_dim is None else kv_norm_dim
    per_token = num_q_heads * rope_dim * 2 * i + width * (i + c) + rope_dim * COS_SIN_ITEMSIZE
    return tokens * per_token + norm * i


def qknorm_bytes(
    tokens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    rotary_dim,
    dtype,
    cache_dtype,
    q_out_dtype=None,
    q_scales=False,
    kv_scales=False,
):
    """:func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache`: as :func:`rope_kv_bytes` with q out
    in ``q_out_dtype`` (default the input dtype), plus the two ``(D,)`` norm weights once, plus
    the float32 computed scales written: one per q row (``q_scales``, dynamic fp8 q) and one per
    K and V row (``kv_scales``, per-token-head KV scales)."""
    q_out_dtype = dtype if q_out_dtype is None else q_out_dtype
    return (
        rope_kv_bytes(
            tokens, num_q_heads, num_kv_heads, head_dim, rotary_dim, dtype, q_out_dtype, cache_dtype
        )
        + 2 * head_dim * _size(dtype)
        + computed_scale_bytes(tokens, num_q_heads * bool(q_scales), num_kv_heads * bool(kv_scales))
    )


def qkv_bytes(
    tokens,
    hidden,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype,
    cache_dtype,
    weight_dtype=None,
    rotary_dim=0,
):
    """:func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`: the hidden state and the weights
    read once, q written in the input dtype, K and V cache rows written, one cos/sin row per token
    when RoPE is applied (``rotary_dim > 0``)."""
    i, c = _size(dtype), _size(cache_dtype)
    w = i if weight_dtype is None else _size(weight_dtype)
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    return (
        tokens * hidden * i
        + n * hidden * w
        + tokens * num_q_heads * head_dim * i
        + tokens * 2 * num_kv_heads * head_dim * c
        + tokens * rotary_dim * COS_SIN_ITEMSIZE
    )


def qkv_weight_bytes(hidden, num_q_heads, num_kv_heads, head_dim, weight_dtype):
    """The weight bytes alone (the decode floor: a GEMV streams them once)."""
    return (num_q_heads + 2 * num_kv_heads) * head_dim * hidden * _size(weight_dtype)


def qkv_flops(tokens, hidden, num_q_heads, num_kv_heads, head_dim):
    """Multiply-adds of the projection, counted as 2 flops each."""
    return 2 * tokens * hidden * (num_q_heads + 2 * num_kv_heads) * head_dim
