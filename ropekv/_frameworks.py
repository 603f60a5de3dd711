"""What the framework integrations (:mod:`ropekv.torch`, :mod:`ropekv.jax`) derive from array
metadata alone: output shapes and dtypes, for torch fake tensors and JAX abstract values, which
have no memory. Each derivation checks the dims and dtypes it reads with the eager ops' own
``_checks`` helpers, so the messages are the eager ones; every other rule is checked by the eager
op itself when the call runs. Imports neither framework.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
from ropekv import paged
from ropekv._arrays import BFLOAT16, FLOAT16, ArrayView
from ropekv._launch import dtype_key

INPUT_DTYPES = (FLOAT16, BFLOAT16)


def MetaView(name, shape, dtype, strides=None, device=0):
    """An array's metadata as a ``ropekv._arrays.ArrayView`` with no memory behind it (pointer 0),
    for the ``_checks`` helpers. ``strides`` are in elements, C-contiguous when None."""
    shape = tuple(shape)
    if strides is None:
        acc, strides = 1, []
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = reversed(strides)
    return ArrayView(name, 0, shape, tuple(strides), np.dtype(dtype), device)


def same_as_q(q, layout):
    """``(shape, dtype)`` of an output shaped like the input ``q`` (MLA's ``q_rope_out``, QK-norm's
    ``q_out``): a 3-D float16/bfloat16 array."""
    ck.check_ndim(q, 3, layout)
    ck.check_dtype(q, INPUT_DTYPES)
    return q.shape, q.dtype


def qknorm_q_output(q, q_out_dtype):
    """``(shape, dtype)`` of the QK-norm op's new ``q_out``: ``q``'s shape in ``q_out_dtype``
    (``q``'s dtype by default, or fp8; a dtype, its name or a torch dtype), with the eager
    op's checks and messages."""
    shape, _ = same_as_q(q, "(T, Hq, D)")
    return shape, ck.check_q_out_dtype(dtype_key(q_out_dtype), q, None)


def qkv_output(hidden_state, k_cache, num_q_heads, kv_layout, layer_idx=None):
    """``(shape, dtype)`` of the fused QKV op's ``out``: ``(T, Hq * D)`` in the input dtype, D
    being the cache's last dim (with ``layer_idx``, the cache has a leading layer dimension)."""
    ck.check_ndim(hidden_state, 2, "(T, K)")
    ck.check_dtype(hidden_state, INPUT_DTYPES)
    Hq = ck.check_positive_int(num_q_heads, "num_q_heads")
    ck.check_choice(kv_layout, "kv_layout", tuple(decl.PAGED_LAYOUTS))
    layout = decl.PAGED_LAYOUTS[kv_layout]
    if layer_idx is None:
        ck.check_ndim(k_cache, 4, layout)
    else:
        ck.check_ndim(k_cache, 5, f"(num_layers, {layout[1:]}")
    return (hidden_state.shape[0], Hq * k_cache.shape[-1]), hidden_state.dtype


def check_qkv_graph_safe(hidden, weight, k_cache, group_size, where):
    """Refuse to record a fused QKV call that runs cuBLAS into a CUDA graph (its temporaries are
    freed when the call returns, and a graph would keep their addresses): ``ropekv.qkv.graph_safe``
    on the shapes and dtypes (MetaViews), with the compute capability of the least capable
    visible GPU (90 where there is none, so that host-only tracing takes the sm_90 rule)."""
    from ropekv import qkv

    T, K = hidden.shape[0], hidden.shape[-1]
    fmt = (
        qkv.W_INT4
        if weight.dtype == np.uint8
        else qkv.W_FP8
        if weight.dtype == ml_dtypes.float8_e4m3fn
        else qkv.W_DENSE
    )
    if not qkv.graph_safe(
        T, K, k_cache.shape[-1], fmt, group_size, _least_capability(), np.dtype(hidden.dtype)
    ):
        raise ValueError(
            f"fused_qkv_matmul_append_paged_kv_cache cannot be recorded {where} with "
            f"hidden_state of T={T} tokens: {qkv.GRAPH_RULE}"
        )


@functools.cache
def _least_capability():
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return min(int(cupy.cuda.Device(i).compute_capability) for i in range(n)) if n else 90
    except Exception:  # noqa: BLE001 - no CUDA runtime (a host-only trace): the sm_90 rule
        return 90


def dtype_of_name(name):
    """The NumPy dtype of a framework dtype's name (``"bfloat16"``, ``"float8_e4m3fn"``, ...), or
    None when NumPy and ml_dtypes have no such dtype."""
    name = str(name).rsplit(".", 1)[-1]
    try:
        return np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        return None


# ---- the output rules of the declarations (ropekv/_declare.py): {output: (shape, dtype)} -------
# ``v``: a call's eager values, arrays as MetaViews (a pair as a tuple of them).


def paged_outputs(v, quantize):
    """The paged ops' ``q_rope_out`` / ``q_nope_out``: ``(nnz, Hq, R)`` / ``(nnz, Hq, Dn)`` in
    ``quantize_dtype``, else the dtype of the given output, else the cache's."""
    ck.check_ndim(v["q_rope"], 3, "(nnz, Hq, R)")
    ck.check_dtype(v["q_rope"], INPUT_DTYPES)
    T, Hq, R = v["q_rope"].shape
    Dn = 0
    if v["q_nope"] is not None:
        ck.check_ndim(v["q_nope"], 3, "(nnz, Hq, no_rope_dim)")
        Dn = v["q_nope"].shape[2]
    caches = v["paged_kv_cache"]
    cache = caches[0] if isinstance(caches, tuple | list) else caches
    mla = len(v["k_rope"].shape) == 2
    if mla:  # the eager op's name of the MLA form's first cache
        cache.name = "ckv_cache"
    dtype, _ = paged.output_dtype(
        v["q_rope"],
        (v.get("q_rope_out"), v.get("q_nope_out"), cache),
        paged.as_dtype(v["quantize_dtype"]),
        quantize,
        mla,
        v["kv_cache_scales"] is not None,
        v["quant_scale_kv"] is not None,
    )
    return {"q_rope_out": ((T, Hq, R), dtype), "q_nope_out": ((T, Hq, Dn), dtype)}


def paged_fp8_outputs(v):
    return paged_outputs(v, True)


def paged_append_outputs(v):
    return paged_outputs(v, False)


def mla_outputs(v):
    """The MLA RMSNorm op's ``q_rope_out``: ``q_rope``'s shape and dtype."""
    return {"q_rope_out": same_as_q(v["q_rope"], "(T, Hq, R)")}


def qknorm_outputs(v):
    """The QK-norm op's ``q_out``: ``q``'s shape in ``q_out_dtype``."""
    return {"q_out": qknorm_q_output(v["q"], v["q_out_dtype"])}


def qkv_outputs(v):
    """The fused QKV op's ``out``: ``(T, Hq * D)`` in the input dtype."""
    caches = v["paged_kv_cache"]
    k_cache = caches[0] if isinstance(caches, tuple | list) else caches
    return {
        "out": qkv_output(
            v["hidden_state"], k_cache, v["num_q_heads"], v["kv_layout"], v["layer_idx"]
        )
    }


def qkv_capture_check(v, where):
    """Refuse recording a fused QKV call that runs cuBLAS (see :func:`check_qkv_graph_safe`)."""
    caches = v["paged_kv_cache"]
    check_qkv_graph_safe(v["hidden_state"], v["weight"], caches[0], v["group_size"], where)
