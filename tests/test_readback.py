"""FlashInfer reads back what ropekv writes (GPU, FlashInfer 0.7.4).

Each test writes a ragged batch (random page ids) with a ropekv op on the GPU, checks the caches
against the same op on host copies (the NumPy reference), then runs FlashInfer's paged prefill
(``BatchPrefillWithPagedKVCacheWrapper``) over the prompts, appends one token per request and runs
its paged decode (``BatchDecodeWithPagedKVCacheWrapper``), or its MLA wrapper
(``BatchMLAPagedAttentionWrapper``), and compares each output with float64 attention over the
reference's K/V and queries (``examples/paged_attention.py``), within :func:`bound`.
"""

from __future__ import annotations

import importlib.util
import math

import ml_dtypes
import numpy as np
import pytest

import ropekv
from tests.tolerance import assert_close, to_numpy

torch = pytest.importorskip("torch")  # before the examples' helpers, which import it

from examples.paged_attention import PageTable, attention, gather, gather_scales

pytestmark = pytest.mark.gpu

HQ, HKV, D, R = 8, 2, 128, 64  # GQA group 4; rope dims [0, 64), dims [64, 128) pass through
PROMPTS = (1, 37, 75)  # tokens per request: one page, several, a partial last page
U16 = 2.0**-11  # fp16 unit roundoff
E4M3 = ml_dtypes.float8_e4m3fn
STATIC_KV = 3.0  # quant_scale_kv: stored = fp8(x * 3), read with k_scale = v_scale = 1 / 3


def flashinfer():
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed: these tests read ropekv's caches with it")
    import flashinfer as fi

    return fi


def bound(q, k, v, dq, dk, dv, sm_scale, q_pos):
    """Per output element, how far an attention kernel's result may lie from ``attention(q, k,
    v)`` in float64 (q ``(n, Hq, Dk)``, k ``(L, Hkv, Dk)``, v ``(L, Hkv, Dv)``) when it reads
    values within ``dq``, ``dk``, ``dv`` (elementwise, absolute) of them and computes as
    FlashInfer does (fp32 maths, P and the output rounded to fp16).

    The derivation: a key's score s_j = sm_scale q.k_j moves by at most eta_j = sm_scale
    sum_d(|q_d| dk_jd + dq_d |k_jd| + dq_d dk_jd); with every score within eta = max_j eta_j, each
    softmax weight p_j moves by at most p_j (e^(2 eta) - 1), so o = sum_j p_j v_j moves by at
    most (e^(2 eta) - 1) max_j |v_j - o| through the weights and e^(2 eta) max_j dv_j through
    the values. FlashInfer rounds P to fp16 for the P.V product (U16 sum_j p_j |v_j| <= U16
    max|v|) and the output to fp16 (U16 |o|); its fp32 accumulations and exp2 approximation
    add below 1e-5 max|v|.
    """
    group = q.shape[1] // k.shape[1]
    k, v, dk, dv = (x.repeat_interleave(group, dim=1) for x in (k, v, dk, dv))
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]  # (n, L)
    o = attention(q, k, v, sm_scale, q_pos)  # (n, Hq, Dv)
    eta = sm_scale * (
        torch.einsum("nhd,lhd->nhl", q.abs(), dk)
        + torch.einsum("nhd,lhd->nhl", dq, k.abs())
        + torch.einsum("nhd,lhd->nhl", dq, dk)
    )
    eta = eta.masked_fill(mask[:, None], 0).amax(dim=-1)  # (n, Hq)
    dev = (v[None] - o[:, None]).abs().amax(dim=-1)  # (n, L, Hq)
    dev = dev.masked_fill(mask[..., None], 0).amax(dim=1)  # (n, Hq)
    vmax, dvmax = v.abs().amax(dim=(0, 2)), dv.amax(dim=(0, 2))  # (Hq,)
    grow = torch.exp(2 * eta)
    per_row = (grow - 1) * dev + grow * dvmax + U16 * vmax + 1e-5 * vmax
    return o, per_row[..., None] + U16 * o.abs()


def check_attention(got, q, k, v, dq, dk, dv, sm_scale, q_pos, what):
    expected, tol = bound(q, k, v, dq, dk, dv, sm_scale, q_pos)
    err = (got.double().cpu() - expected).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g}, {worst:.3g} times the bound"


def host(x):
    """float64 torch tensor of a host copy (fp8 included)."""
    return torch.from_numpy(np.asarray(to_numpy(x), np.float64))


def rows(cache, scales, pages, n, page_size, layout, static=1.0):
    """One request's n rows, dequantized to float64: ``(n, H, D)``."""
    x = gather(host(cache), pages, n, page_size, layout) * static
    if scales is not None:
        x = x * gather_scales(host(scales), pages, n, page_size, layout)[..., None]
    return x


def fp8_zeros(shape):
    return torch.zeros(shape, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)


# ---- GQA / MHA caches: rope_append_paged_kv_cache and its fp8 form ----------------------------

KINDS = ("float16", "e4m3-static", "e4m3-token-head")


def gqa_caches(kind, layout, num_pages, page_size):
    shape = (num_pages, page_size, HKV, D) if layout == "NHD" else (num_pages, HKV, page_size, D)
    if kind == "float16":
        caches = tuple(torch.zeros(shape, dtype=torch.float16, device="cuda") for _ in range(2))
    else:
        caches = (fp8_zeros(shape), fp8_zeros(shape))
    scales = None
    if kind == "e4m3-token-head":
        scales = tuple(torch.zeros(shape[:-1], device="cuda") for _ in range(2))
    return caches, scales


def host_copy(x):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(host_copy(y) for y in x)
    return np.array(to_numpy(x))  # writable


def append_both(kind, args, caches, scales, layout, page_size):
    """The op on the GPU tensors and on host copies of everything (the reference); returns the
    (GPU, reference) fp16 queries ``(T, HQ, D)`` as attention reads them and the reference's
    caches and scales."""
    ref_caches, ref_scales = host_copy(caches), host_copy(scales)
    options = {"page_size": page_size, "kv_layout": layout}
    if kind == "e4m3-static":
        options["quant_scale_kv"] = STATIC_KV
    outs = []
    for arrays, cs, ss in (
        (args, caches, scales),
        (tuple(host_copy(a) for a in args), ref_caches, ref_scales),
    ):
        q_rope, k_rope, q_nope, k_nope, v, table, pos, kv_indices, kv_indptr, batch = arrays
        extra = {} if ss is None else {"kv_cache_scales": ss}
        op = (
            ropekv.rope_append_paged_kv_cache
            if kind == "float16"
            else ropekv.rope_quantize_fp8_append_paged_kv_cache
        )
        qr, qn = op(
            q_rope, k_rope, q_nope, k_nope, v, table, pos, cs, kv_indices, kv_indptr, batch, pos,
            **options, **extra,
        )  # fmt: skip
        outs.append(torch.cat([host(qr), host(qn)], dim=-1))  # fp8 q (scale 1) dequantized
    q_gpu = outs[0].half().cuda()  # fp8 and fp16 values are exact in fp16
    return q_gpu, outs[1], ref_caches, ref_scales


def inputs(tokens, rng, table, batch, pos, page_table):
    def rand(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float16)).cuda()

    indices = torch.from_numpy(np.concatenate(page_table.pages).astype(np.int32)).cuda()
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in page_table.pages])])
    return (
        rand(tokens, HQ, R), rand(tokens, HKV, R), rand(tokens, HQ, D - R),
        rand(tokens, HKV, D - R), rand(tokens, HKV, D), table, pos, indices,
        torch.from_numpy(indptr.astype(np.int32)).cuda(), batch,
    )  # fmt: skip


def read_and_check(fi_out, q_ref, q_gpu, caches, scales, ref_caches, ref_scales, ctx, what):
    """Compare FlashInfer's output for each request with float64 attention over the reference."""
    page_table, lengths, spans, layout, page_size, static = ctx
    for b, (start, stop) in enumerate(spans):
        n = lengths[b]
        pages = page_table.pages[b]
        ref_s = (None, None) if ref_scales is None else ref_scales
        gpu_s = (None, None) if scales is None else scales
        k, v = (
            rows(c, s, pages, n, page_size, layout, static)
            for c, s in zip(ref_caches, ref_s, strict=True)
        )
        k_gpu, v_gpu = (
            rows(c, s, pages, n, page_size, layout, static)
            for c, s in zip(caches, gpu_s, strict=True)
        )
        # what FlashInfer reads may differ from the reference by an adjacent fp8 code (the
        # kernel's float32 against the reference's float64 at a rounding boundary), and the
        # per-token-head dequantization may round to fp16
        u_read = U16 if scales is not None else 0.0
        dk = (k_gpu - k).abs() + u_read * k.abs()
        dv = (v_gpu - v).abs() + u_read * v.abs()
        q = q_ref[start:stop]
        dq = (host(q_gpu[start:stop]) - q).abs()
        pos = torch.arange(n - (stop - start), n)
        check_attention(
            fi_out[start:stop], q, k, v, dq, dk, dv, 1 / math.sqrt(D), pos, f"{what} request {b}"
        )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_prefill_and_decode_read_the_paged_cache(layout, page_size, kind):
    fi = flashinfer()
    rng = np.random.default_rng(page_size)
    page_table = PageTable([n + 1 for n in PROMPTS], page_size, seed=page_size + len(kind))
    caches, scales = gqa_caches(kind, layout, page_table.num_pages, page_size)
    cos_sin = torch.from_numpy(ropekv.cos_sin_cache(256, R, base=500000.0)).cuda()
    static = 1 / STATIC_KV if kind == "e4m3-static" else 1.0
    kv_dtype = torch.float16 if kind == "float16" else torch.float8_e4m3fn
    token_head = scales is not None
    run_scales = {"k_scale": static, "v_scale": static} if kind == "e4m3-static" else {}
    if token_head:
        run_scales = {"kv_cache_sf": scales}
    plan = {
        "q_data_type": torch.float16,
        "kv_data_type": kv_dtype,
        "sm_scale": 1 / math.sqrt(D),
        "use_token_head_sf": token_head,
    }

    def workspace():
        return torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")

    # prefill: every prompt in one ragged call, then FlashInfer's causal prefill over the pages
    batch, pos = (t.cuda() for t in page_table.append_indices([0] * 3, PROMPTS))
    args = inputs(sum(PROMPTS), rng, cos_sin, batch, pos, page_table)
    q_gpu, q_ref, ref_caches, ref_scales = append_both(
        kind, args, caches, scales, layout, page_size
    )
    for got, want, name in zip(caches, ref_caches, ("k_cache", "v_cache"), strict=True):
        assert_close(got, want, name)
    if token_head:
        for got, want in zip(scales, ref_scales, strict=True):
            np.testing.assert_allclose(to_numpy(got), want, rtol=1e-6)
    indices, indptr, last = page_table.csr(PROMPTS, device="cuda")
    qo = torch.tensor(np.cumsum([0, *PROMPTS]), dtype=torch.int32, device="cuda")
    prefill = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout, backend="fa2")
    prefill.plan(qo, indptr, indices, last, HQ, HKV, D, page_size, causal=True, **plan)
    out = prefill.run(q_gpu, caches, **run_scales)
    spans = list(zip(qo[:-1].tolist(), qo[1:].tolist(), strict=True))
    ctx = (page_table, list(PROMPTS), spans, layout, page_size, static)
    read_and_check(out, q_ref, q_gpu, caches, scales, ref_caches, ref_scales, ctx, "prefill")

    # decode: one more token per request, appended after the prompt, then FlashInfer's decode
    lengths = [n + 1 for n in PROMPTS]
    batch, pos = (t.cuda() for t in page_table.append_indices(PROMPTS, [1, 1, 1]))
    args = inputs(3, rng, cos_sin, batch, pos, page_table)
    q_gpu, q_ref, ref_caches, ref_scales = append_both(
        kind, args, caches, scales, layout, page_size
    )
    # the reference appended to host copies of the GPU caches: compare whole caches again
    for got, want, name in zip(caches, ref_caches, ("k_cache", "v_cache"), strict=True):
        assert_close(got, want, name)
    indices, indptr, last = page_table.csr(lengths, device="cuda")
    decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), layout)
    decode.plan(indptr, indices, last, HQ, HKV, D, page_size, **plan)
    out = decode.run(q_gpu, caches, **run_scales)
    ctx = (page_table, lengths, [(0, 1), (1, 2), (2, 3)], layout, page_size, static)
    read_and_check(out, q_ref, q_gpu, caches, scales, ref_caches, ref_scales, ctx, "decode")


# ---- the QK-norm op's cache --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, layout", [("float16", "NHD"), ("e4m3-static", "HND"), ("e4m3-token-head", "NHD")]
)
def test_flashinfer_reads_the_qk_norm_cache(kind, layout):
    fi = flashinfer()
    page_size = 16
    rng = np.random.default_rng(1)
    page_table = PageTable([n + 1 for n in PROMPTS], page_size, seed=3)
    caches, scales = gqa_caches(kind, layout, page_table.num_pages, page_size)
    cos_sin = torch.from_numpy(ropekv.cos_sin_cache(256, D, base=1e6)).cuda()
    gammas = [torch.from_numpy(rng.uniform(0.5, 1.5, D).astype(np.float32)).cuda() for _ in "qk"]
    block_table = page_table.block_table("cuda")
    # the QK-norm op's static kv_scale is a dequantization scale: stored = fp8(x / kv_scale)
    static = 0.25 if kind == "e4m3-static" else 1.0
    options = {"kv_layout": layout}
    if kind == "e4m3-static":
        options["kv_scale"] = static
    kv_dtype = torch.float16 if kind == "float16" else torch.float8_e4m3fn
    plan = {
        "q_data_type": torch.float16,
        "kv_data_type": kv_dtype,
        "sm_scale": 1 / math.sqrt(D),
        "use_token_head_sf": scales is not None,
    }
    run_scales = {"k_scale": static, "v_scale": static} if kind == "e4m3-static" else {}
    if scales is not None:
        run_scales = {"kv_cache_sf": scales}

    def append(new, cached):
        T = sum(new)

        def rand(*shape):
            return torch.from_numpy(rng.standard_normal(shape).astype(np.float16)).cuda()

        q, k, v = rand(T, HQ, D), rand(T, HKV, D), rand(T, HKV, D)
        offsets = torch.tensor(np.cumsum([0, *new]), dtype=torch.int32, device="cuda")
        lengths = torch.tensor(cached, dtype=torch.int32, device="cuda")
        args = (q, k, v, *gammas, cos_sin, offsets, lengths, block_table)
        ref_caches, ref_scales = host_copy(caches), host_copy(scales)
        q_gpu = ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
            *args, caches, kv_cache_scales=scales, **options
        )
        q_ref = ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
            *(host_copy(a) for a in args), ref_caches, kv_cache_scales=ref_scales, **options
        )
        for got, want, name in zip(caches, ref_caches, ("k_cache", "v_cache"), strict=True):
            assert_close(got, want, name)
        spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
        return q_gpu, host(q_ref), ref_caches, ref_scales, offsets, spans

    q_gpu, q_ref, ref_caches, ref_scales, qo, spans = append(PROMPTS, [0, 0, 0])
    indices, indptr, last = page_table.csr(PROMPTS, device="cuda")
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    prefill = fi.BatchPrefillWithPagedKVCacheWrapper(ws, layout, backend="fa2")
    prefill.plan(qo, indptr, indices, last, HQ, HKV, D, page_size, causal=True, **plan)
    out = prefill.run(q_gpu, caches, **run_scales)
    ctx = (page_table, list(PROMPTS), spans, layout, page_size, static)
    read_and_check(out, q_ref, q_gpu, caches, scales, ref_caches, ref_scales, ctx, "prefill")

    lengths = [n + 1 for n in PROMPTS]
    q_gpu, q_ref, ref_caches, ref_scales, _, spans = append([1, 1, 1], list(PROMPTS))
    indices, indptr, last = page_table.csr(lengths, device="cuda")
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    decode = fi.BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    decode.plan(indptr, indices, last, HQ, HKV, D, page_size, **plan)
    out = decode.run(q_gpu, caches, **run_scales)
    ctx = (page_table, lengths, spans, layout, page_size, static)
    read_and_check(out, q_ref, q_gpu, caches, scales, ref_caches, ref_scales, ctx, "decode")


# ---- MLA caches: FlashInfer's MLA paged attention ------------------------------------------------

H_MLA, L_MLA, R_MLA = 16, 512, 64  # DeepSeek's latent and rope widths (FlashInfer fa2 MLA's)


@pytest.mark.parametrize("op", ["paged", "rmsnorm-split", "rmsnorm-joined"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_mla_reads_the_mla_cache(op, page_size):
    """``rope_append_paged_kv_cache`` with a 2-D k_rope (ckv, kpe caches) and
    ``mla_rope_rmsnorm_append_paged_kv_cache`` with FlashInfer's split (ckv, kpe) and MAX's
    joined ``(pages, page_size, L + R)`` cache, read by ``BatchMLAPagedAttentionWrapper``
    (fa2, ``kv_cache_layout`` "split" / "packed": the packed last dim is ckv then kpe)."""
    flashinfer()
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    rng = np.random.default_rng(2)
    page_table = PageTable([n + 1 for n in PROMPTS], page_size, seed=5)
    P = page_table.num_pages
    f16 = {"dtype": torch.float16, "device": "cuda"}
    if op == "rmsnorm-joined":
        joined = torch.zeros(P, page_size, L_MLA + R_MLA, **f16)
        caches = (joined[..., :L_MLA], joined[..., L_MLA:])
        kv_arg = joined
    else:
        caches = (torch.zeros(P, page_size, L_MLA, **f16), torch.zeros(P, page_size, R_MLA, **f16))
        kv_arg = caches
    cos_sin = torch.from_numpy(ropekv.cos_sin_cache(256, R_MLA)).cuda()
    gamma = torch.from_numpy(rng.uniform(0.5, 1.5, L_MLA).astype(np.float32)).cuda()
    sm_scale = 1 / math.sqrt(128 + R_MLA)  # DeepSeek's qk head dim 192

    def rand(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float16)).cuda()

    def append(new, cached):
        T = sum(new)
        q_pe, q_nope = rand(T, H_MLA, R_MLA), rand(T, H_MLA, L_MLA)
        batch, pos = (t.cuda() for t in page_table.append_indices(cached, new))
        offsets = torch.tensor(np.cumsum([0, *new]), dtype=torch.int32, device="cuda")
        ref = host_copy(kv_arg)
        if op == "paged":
            k_pe, ckv = rand(T, R_MLA), rand(T, L_MLA)
            indices = torch.from_numpy(np.concatenate(page_table.pages).astype(np.int32)).cuda()
            indptr = np.concatenate([[0], np.cumsum([len(p) for p in page_table.pages])])
            indptr = torch.from_numpy(indptr.astype(np.int32)).cuda()
            args = (q_pe, k_pe, q_nope, ckv, None, cos_sin, pos, kv_arg, indices, indptr, batch)
            qr, qn = ropekv.rope_append_paged_kv_cache(*args, pos, page_size=page_size)
            host_args = [host_copy(a) for a in args]
            host_args[7] = ref
            rr, rn = ropekv.rope_append_paged_kv_cache(
                *host_args, host_copy(pos), page_size=page_size
            )
            q_gpu, q_ref = (qn, qr), (host(rn), host(rr))
        else:
            kv = rand(T, L_MLA + R_MLA)
            lengths = torch.tensor(cached, dtype=torch.int32, device="cuda")
            block_table = page_table.block_table("cuda")
            args = (q_pe, kv, gamma, cos_sin, offsets, lengths, block_table)
            qr = ropekv.mla_rope_rmsnorm_append_paged_kv_cache(*args, kv_arg)
            rr = ropekv.mla_rope_rmsnorm_append_paged_kv_cache(*(host_copy(a) for a in args), ref)
            q_gpu, q_ref = (q_nope, qr), (host(q_nope), host(rr))
        ref_pair = (ref[..., :L_MLA], ref[..., L_MLA:]) if op == "rmsnorm-joined" else ref
        for got, want, name in zip(caches, ref_pair, ("ckv", "kpe"), strict=True):
            assert_close(got, want, name)
        spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
        return q_gpu, q_ref, ref_pair, offsets, spans

    layout = "packed" if op == "rmsnorm-joined" else "split"
    for new, cached, causal in ((PROMPTS, [0, 0, 0], True), ([1, 1, 1], list(PROMPTS), False)):
        q_gpu, q_ref, ref_pair, qo, spans = append(list(new), cached)
        lengths = [c + n for c, n in zip(cached, new, strict=True)]
        indices, indptr, _ = page_table.csr(lengths, device="cuda")
        kv_len = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        wrapper = BatchMLAPagedAttentionWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), backend="fa2"
        )
        # causal only for the prefill (q and kv lengths equal there, so the diagonal's
        # alignment does not matter); a decode token sees its whole request
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(qo, indptr, indices, kv_len),
            num_heads=H_MLA,
            head_dim_ckv=L_MLA,
            head_dim_kpe=R_MLA,
            page_size=page_size,
            causal=causal,
            sm_scale=sm_scale,
            q_data_type=torch.float16,
            kv_data_type=torch.float16,
            query_layout="split",
            kv_cache_layout=layout,
        )
        out = wrapper.run(query=q_gpu, kv_cache=kv_arg)
        for b, (start, stop) in enumerate(spans):
            n, pages = lengths[b], page_table.pages[b]
            ckv, kpe = (gather(host(c), pages, n, page_size) for c in ref_pair)
            ckv_gpu, kpe_gpu = (gather(host(c), pages, n, page_size) for c in caches)
            q = torch.cat([q_ref[0][start:stop], q_ref[1][start:stop]], dim=-1)
            q_dev = torch.cat([host(q_gpu[0][start:stop]), host(q_gpu[1][start:stop])], dim=-1)
            k = torch.cat([ckv, kpe], dim=-1)
            dk = (torch.cat([ckv_gpu, kpe_gpu], dim=-1) - k).abs()
            check_attention(
                out[start:stop], q, k, ckv, (q_dev - q).abs(), dk, (ckv_gpu - ckv).abs(),
                sm_scale, torch.arange(n - (stop - start), n), f"MLA {op} request {b}",
            )  # fmt: skip
