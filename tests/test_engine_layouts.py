"""examples/engine_layouts.py: ropekv writing vLLM's packed per-layer cache (K and V halves of
each ``2 * D`` row, strided HND views), vLLM's cross-layer cache (``layer_idx``) and SGLang's
token-slot buffers (page size 1, slots as page ids). Each writes, at each token's slot, K roped
and V unchanged, and nothing else; on the NumPy backend (CI) and, marked gpu, on the kernels
against it."""

from __future__ import annotations

import numpy as np
import pytest

import ropekv
from examples import engine_layouts as el
from ropekv import reference
from tests.tolerance import assert_close, to_numpy

T, HQ, HKV, D = 6, 4, 2, 64


def data(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, HQ, D)).astype(np.float16)
    k, v = (rng.standard_normal((T, HKV, D)).astype(np.float16) for _ in range(2))
    pos = np.array([0, 1, 2, 7, 8, 9], np.int32)
    table = ropekv.cos_sin_cache(64, D)
    return q, k, v, pos, table


def roped_k(k, pos, table):
    cos, sin = reference.split_cos_sin(table[pos])
    return reference.to_dtype(
        reference.rope(k.astype(np.float64), cos[:, None], sin[:, None], True), np.float16
    )


def to_torch_cuda(*arrays):
    torch = pytest.importorskip("torch")
    return [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in arrays]


def vllm_packed(backend):
    q, k, v, pos, table = data()
    num_blocks, bs = 5, 4
    slots = np.array([17, 3, 4, 10, 11, 0], np.int32)  # vLLM's slot_mapping: block * bs + offset
    cache = np.zeros((num_blocks, HKV, bs, 2 * D), np.float16)
    args = (q, k, v, table, pos, slots, cache)
    if backend == "gpu":
        args = to_torch_cuda(*args)
    q_out = el.vllm_packed_append(*args)
    return to_numpy(q_out), to_numpy(args[-1]), (k, v, pos, table, slots, bs)


def test_vllm_packed_cache_on_the_numpy_backend():
    _, cache, (k, v, pos, table, slots, bs) = vllm_packed("numpy")
    want = np.zeros_like(cache)
    for t, s in enumerate(slots):
        want[s // bs, :, s % bs, :D] = roped_k(k, pos, table)[t]
        want[s // bs, :, s % bs, D:] = v[t]
    assert np.array_equal(cache, want)


@pytest.mark.gpu
def test_vllm_packed_cache_on_the_gpu():
    q_ref, cache_ref, _ = vllm_packed("numpy")
    q_out, cache, _ = vllm_packed("gpu")
    assert_close(q_out, q_ref, "q")
    assert_close(cache, cache_ref, "packed cache")


def vllm_cross_layer(backend):
    q, k, v, _, table = data(1)
    layers, blocks, bs = 3, 4, 4
    gamma = np.linspace(0.5, 1.5, D).astype(np.float32)
    offsets = np.array([0, 2, 6], np.int32)
    lengths = np.array([5, 0], np.int32)  # request 0 has 5 cached tokens, request 1 none
    block_table = np.array([[3, 1], [0, 2]], np.int32)
    cache = np.zeros((layers, blocks, 2, bs, HKV, D), np.float16)
    args = [q, k, v, gamma, gamma, table, offsets, lengths, block_table, cache]
    if backend == "gpu":
        args = to_torch_cuda(*args)
    q_out = el.vllm_cross_layer_append(*args, layer_idx=1)
    return to_numpy(q_out), to_numpy(args[-1]), [q, k, v, gamma, gamma, table, offsets, lengths,
                                                 block_table]  # fmt: skip


def test_vllm_cross_layer_cache_writes_one_layer():
    q_out, cache, args = vllm_cross_layer("numpy")
    # the same call on one layer's own (num_blocks, bs, Hkv, D) caches
    one = tuple(np.zeros(cache.shape[1:2] + cache.shape[3:], np.float16) for _ in range(2))
    q_one = ropekv.qk_rmsnorm_rope_append_paged_kv_cache(*args, one)
    assert np.array_equal(q_out, q_one)
    assert np.array_equal(cache[1, :, 0], one[0]) and np.array_equal(cache[1, :, 1], one[1])
    assert not cache[0].any() and not cache[2].any()  # other layers untouched
    assert np.count_nonzero(np.abs(cache[1]).sum(axis=-1)) == 2 * T * HKV  # each token's rows


@pytest.mark.gpu
def test_vllm_cross_layer_cache_on_the_gpu():
    q_ref, cache_ref, _ = vllm_cross_layer("numpy")
    q_out, cache, _ = vllm_cross_layer("gpu")
    assert_close(q_out, q_ref, "q")
    assert_close(cache, cache_ref, "cross-layer cache")


def sglang(backend):
    q, k, v, pos, table = data(2)
    num_slots = 16
    loc = np.array([9, 2, 15, 4, 5, 0], np.int32)  # SGLang's out_cache_loc
    kb, vb = (np.zeros((num_slots, HKV, D), np.float16) for _ in range(2))
    args = (q, k, v, table, pos, loc, kb, vb)
    if backend == "gpu":
        args = to_torch_cuda(*args)
    q_out = el.sglang_token_slots_append(*args)
    return to_numpy(q_out), to_numpy(args[-2]), to_numpy(args[-1]), (k, v, pos, table, loc)


def test_sglang_token_slots_on_the_numpy_backend():
    _, kb, vb, (k, v, pos, table, loc) = sglang("numpy")
    want_k, want_v = np.zeros_like(kb), np.zeros_like(vb)
    want_k[loc], want_v[loc] = roped_k(k, pos, table), v
    assert np.array_equal(kb, want_k) and np.array_equal(vb, want_v)


@pytest.mark.gpu
def test_sglang_token_slots_on_the_gpu():
    q_ref, kb_ref, vb_ref, _ = sglang("numpy")
    q_out, kb, vb, _ = sglang("gpu")
    assert_close(q_out, q_ref, "q")
    assert_close(kb, kb_ref, "k_buffer")
    assert_close(vb, vb_ref, "v_buffer")
