"""ropekv writing the KV-cache layouts of vLLM and SGLang (see docs/integration.md).

Each function takes the engine's own tensors (NumPy arrays run ropekv's NumPy reference; torch /
CuPy GPU tensors its kernels) and writes them in place, returning the roped queries. The paged
ops address a page table; an engine's flat slot numbers become one: a single "request" owning
every page in order (``kv_indices = arange(num_pages)``), each token at position = its slot.
"""

from __future__ import annotations

import numpy as np

import ropekv


def _slot_table(num_pages, slots, like):
    """``(kv_indices, kv_indptr, batch_indices)`` making position ``slot`` land in page
    ``slot // page_size``, entry ``slot % page_size``, in ``like``'s array library."""
    indices = np.arange(num_pages, dtype=np.int32)
    indptr = np.array([0, num_pages], np.int32)
    batch = np.zeros(len(slots), np.int32)
    if isinstance(like, np.ndarray):
        return indices, indptr, batch
    import torch

    return tuple(torch.from_numpy(a).to(like.device) for a in (indices, indptr, batch))


def vllm_packed_append(q, k, v, cos_sin, positions, slot_mapping, kv_cache):
    """vLLM's packed per-layer cache ``[num_blocks, Hkv, block_size, 2 * D]``: K in the first
    half of each row, V in the second. Its halves are HND caches whose rows are ``2 * D`` apart,
    which the paged op addresses through their strides (no copy)."""
    D = k.shape[-1]
    k_cache, v_cache = kv_cache[..., :D], kv_cache[..., D:]
    indices, indptr, batch = _slot_table(kv_cache.shape[0], slot_mapping, kv_cache)
    q_out, _ = ropekv.rope_append_paged_kv_cache(
        q, k, None, None, v, cos_sin, positions, (k_cache, v_cache), indices, indptr, batch,
        slot_mapping, page_size=kv_cache.shape[2], kv_layout="HND",
    )  # fmt: skip
    return q_out


def vllm_cross_layer_append(q, k, v, q_gamma, k_gamma, cos_sin, offsets, cache_lengths,
                            block_table, kv_cache, layer_idx):  # fmt: skip
    """vLLM's cross-layer cache, one tensor for every layer ``[num_layers, num_blocks, 2,
    block_size, Hkv, D]``: the QK-norm op writes layer ``layer_idx`` of its K and V views
    (``layer_idx=``: one launch plan serves every layer)."""
    return ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
        q, k, v, q_gamma, k_gamma, cos_sin, offsets, cache_lengths, block_table,
        (kv_cache[:, :, 0], kv_cache[:, :, 1]), layer_idx=layer_idx,
    )  # fmt: skip


def sglang_token_slots_append(q, k, v, cos_sin, positions, out_cache_loc, k_buffer, v_buffer):
    """SGLang's token-slot buffers ``[num_slots, Hkv, D]`` (one per layer, K and V): pages of
    one token (``page_size=1``), the slots ``out_cache_loc`` as page ids."""
    caches = (k_buffer[:, None], v_buffer[:, None])  # (num_slots, 1, Hkv, D): NHD, page size 1
    indices, indptr, batch = _slot_table(k_buffer.shape[0], out_cache_loc, k_buffer)
    q_out, _ = ropekv.rope_append_paged_kv_cache(
        q, k, None, None, v, cos_sin, positions, caches, indices, indptr, batch, out_cache_loc,
        page_size=1, kv_layout="NHD",
    )  # fmt: skip
    return q_out
