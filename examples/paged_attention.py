"""Page tables, page gathering and a plain attention over a paged KV cache, in torch.

The small engine pieces the examples share: :class:`PageTable` hands out pages in a random order
(so no test passes by reading pages in allocation order) and builds each index form the ops and
attention kernels take; :func:`gather` reads a request's rows back out of a cache in either
layout; :func:`attention` is the attention an engine would run over them (float32 on the CPU in
the Hugging Face example, float64 as the reference of the read-back tests).
"""

from __future__ import annotations

import math

import numpy as np
import torch


class PageTable:
    """Pages of ``num_pages`` handed to ``len(capacities)`` requests in a random order.

    Request b owns ``pages[b]``: ``ceil(capacities[b] / page_size)`` distinct page ids, its
    token at position p living in page ``pages[b][p // page_size]``, entry ``p % page_size``.
    """

    def __init__(self, capacities, page_size, num_pages=None, seed=0):
        self.page_size = page_size
        need = [math.ceil(c / page_size) for c in capacities]
        self.num_pages = num_pages if num_pages is not None else sum(need) + 3
        order = np.random.default_rng(seed).permutation(self.num_pages)
        starts = np.concatenate([[0], np.cumsum(need)])
        self.pages = [order[starts[b] : starts[b + 1]] for b in range(len(need))]

    # ---- FlashInfer's CSR form (also what the FlashInfer-style ropekv ops take) ----
    def csr(self, lengths, device="cpu"):
        """``(kv_indices, kv_indptr, kv_last_page_len)`` of the pages holding ``lengths[b]``
        tokens of each request, int32 (FlashInfer's ``plan`` arguments)."""
        used = [self.pages[b][: math.ceil(n / self.page_size)] for b, n in enumerate(lengths)]
        indices = np.concatenate(used).astype(np.int32) if used else np.zeros(0, np.int32)
        indptr = np.concatenate([[0], np.cumsum([len(u) for u in used])]).astype(np.int32)
        last = np.array([(n - 1) % self.page_size + 1 for n in lengths], np.int32)
        return tuple(torch.from_numpy(a).to(device) for a in (indices, indptr, last))

    def append_indices(self, cache_lengths, new_lengths, device="cpu"):
        """``(batch_indices, positions)`` of ``new_lengths[b]`` new tokens per request after
        ``cache_lengths[b]`` cached ones, int32 (``flashinfer.get_batch_indices_positions``)."""
        batch = np.concatenate(
            [np.full(n, b, np.int32) for b, n in enumerate(new_lengths)] + [np.zeros(0, np.int32)]
        )
        pos = np.concatenate(
            [np.arange(c, c + n, dtype=np.int32) for c, n in zip(cache_lengths, new_lengths)]
            + [np.zeros(0, np.int32)]
        )
        return torch.from_numpy(batch).to(device), torch.from_numpy(pos).to(device)

    def block_table(self, device="cpu"):
        """``(B, max_pages)`` int32 page ids (rows padded with -1): the block-table form of the
        QK-norm and MLA ops (MAX / vLLM style)."""
        width = max(len(p) for p in self.pages)
        table = np.full((len(self.pages), width), -1, np.int32)
        for b, p in enumerate(self.pages):
            table[b, : len(p)] = p
        return torch.from_numpy(table).to(device)


def gather(cache, pages, length, page_size, kv_layout="NHD"):
    """The first ``length`` rows of one request, ``(length, H, D)``, from a paged cache
    ``(num_pages, page_size, H, D)`` (NHD), ``(num_pages, H, page_size, D)`` (HND) or a one-head
    MLA cache ``(num_pages, page_size, D)`` (returned as ``(length, 1, D)``)."""
    pos = torch.arange(length)
    page = torch.as_tensor(np.asarray(pages), dtype=torch.long)[pos // page_size].to(cache.device)
    entry = (pos % page_size).to(cache.device)
    one_byte = cache.element_size() == 1 and cache.is_floating_point()
    raw = cache.view(torch.uint8) if one_byte else cache  # torch cannot index fp8 on every device
    if raw.dim() == 3:
        rows = raw[page, entry][:, None]
    elif kv_layout == "NHD":
        rows = raw[page, entry]
    else:
        rows = raw[page, :, entry]  # advanced indices around a slice: (length, H, D)
    return rows.view(cache.dtype) if one_byte else rows


def gather_scales(scales, pages, length, page_size, kv_layout="NHD"):
    """The per-token-head scales ``(length, H)`` of one request's rows from a scale array
    ``(num_pages, page_size, H)`` (NHD) or ``(num_pages, H, page_size)`` (HND)."""
    return gather(scales[..., None], pages, length, page_size, kv_layout)[..., 0]


def attention(q, k, v, sm_scale, q_positions, *, v_scale=None):
    """Causal attention of ``q (n, Hq, Dk)`` at positions ``q_positions (n,)`` over ``k (L, Hkv,
    Dk)``, ``v (L, Hkv, Dv)`` (key j at position j), grouped-query heads, computed in q's dtype:
    ``(n, Hq, Dv)``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).to(q.dtype)
    v = v.repeat_interleave(group, dim=1).to(q.dtype)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * sm_scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    mask = key_pos[None, :] > torch.as_tensor(q_positions, device=q.device)[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v)
