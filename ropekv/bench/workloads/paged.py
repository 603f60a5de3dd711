"""The FlashInfer-compatible paged ops (:func:`ropekv.rope_quantize_fp8_append_paged_kv_cache`,
:func:`ropekv.rope_append_paged_kv_cache`): workload, FlashInfer and PyTorch peers, cases."""

from __future__ import annotations

import numpy as np

from ropekv import bytes as nbytes_of
from ropekv.bench.arrays import BF16, E4M3, E5M2, F16, FP8, _dtname, _torch, _torch_dtype
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    LLAMA,
    OP_FUNCTIONS,
    SWEEP,
    CaseSpec,
    Workload,
    _cos_sin,
    _fn,
    _lazy,
    _pages,
    _tcast,
    _trope,
)


class PagedWL(Workload):
    """The FlashInfer-compatible paged op: GQA/MHA (3-D ``k_rope``) or MLA (2-D ``k_rope``)."""

    op = "paged"
    OUTPUTS = (
        "q_rope_out",
        "q_nope_out",
        "cache0",
        "cache1",
        "q_scale_out",
        "k_scales",
        "v_scales",
    )

    def build(
        self,
        B,
        S,
        prefix,
        Hq,
        dtype,
        cache_dtype,
        Hkv=8,
        D=128,
        R=None,
        mla=False,
        L=512,
        page_size=16,
        layout="NHD",
        index_dtype=np.int32,
        is_neox=True,
        scales=(1.0, 1.0),
        spare_pages=0,
        q_dyn=False,
        kv_dyn=False,
    ):
        """``q_dyn``: dynamic fp8 Q (``q_scale_out``); ``kv_dyn``: per-token-head KV scales
        (``kv_cache_scales``; the cache may be int8). Both have no peer."""
        g = self.g
        T, seq = B * S, prefix + S
        self.mla, self.layout, self.page_size, self.is_neox = mla, layout, page_size, is_neox
        self.dtype, self.cache_dtype = np.dtype(dtype), np.dtype(cache_dtype)
        self.quantized = self.cache_dtype in FP8 or self.cache_dtype == np.int8
        self.fp8 = self.cache_dtype in FP8
        self.scales = scales
        self.q_dyn, self.kv_dyn = q_dyn, kv_dyn
        per = -(-seq // page_size)
        ids, num_pages = _pages(B, per, g, spare=spare_pages)
        batch = np.repeat(np.arange(B), S)
        positions = prefix + np.tile(np.arange(S), B)
        indptr = np.arange(B + 1) * per
        self.page = ids[indptr[batch] + positions // page_size].astype(np.int64)
        self.entry = (positions % page_size).astype(np.int64)
        self.seq_len, self.B = seq, B
        for name, v in (
            ("kv_indices", ids),
            ("kv_indptr", indptr),
            ("batch_indices", batch),
            ("positions", positions),
            ("pos_ids", positions),
        ):
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
            shape = (
                (num_pages, page_size, Hkv, D)
                if layout == "NHD"
                else (num_pages, Hkv, page_size, D)
            )
            self.a["cache0"] = g.cache(shape, cache_dtype, self.poison)
            self.a["cache1"] = g.cache(shape, cache_dtype, self.poison)
        self.a["table"] = g.put(_cos_sin(seq, R))
        self.a["q_rope_out"] = g.zeros(self.a["q_rope"].shape, cache_dtype)
        if self.a["q_nope"] is not None:
            self.a["q_nope_out"] = g.zeros(self.a["q_nope"].shape, cache_dtype)
        if q_dyn:
            self.a["q_scale_out"] = g.zeros((T, Hq), np.float32)
        if kv_dyn:
            for name in ("k_scales", "v_scales"):
                self.a[name] = g.zeros(self.a["cache0"].shape[:-1], np.float32)
        tok = self._sample_tokens(T)
        page, entry = self.page[tok], self.entry[tok]
        rows = (page, entry) if mla or layout == "NHD" else (page, slice(None), entry)
        self.sample = {
            "q_rope_out": ("q_rope_out", (tok,)),
            "q_nope_out": ("q_nope_out", (tok,)),
            "cache0_rows": ("cache0", rows),
            "cache1_rows": ("cache1", rows),
            "q_scale_out": ("q_scale_out", (tok,)),
            "k_scales_rows": ("k_scales", rows),
            "v_scales_rows": ("v_scales", rows),
        }

    def call(self, o, **options):
        a = self.a
        name = OP_FUNCTIONS["paged"][0 if self.quantized else 1]
        kw = {"quant_scale_q": self.scales[0], "quant_scale_kv": self.scales[1]}
        if self.q_dyn:
            kw.update(q_scale_out=o["q_scale_out"], quant_scale_q=None)
        if self.kv_dyn:
            kw.update(kv_cache_scales=(o["k_scales"], o["v_scales"]), quant_scale_kv=None)
        kw.update(options)
        return _fn(name)(
            a["q_rope"],
            a["k_rope"],
            a["q_nope"],
            a["k_nope"],
            a["v"],
            a["table"],
            a["pos_ids"],
            (o["cache0"], o["cache1"]),
            a["kv_indices"],
            a["kv_indptr"],
            a["batch_indices"],
            a["positions"],
            is_neox=self.is_neox,
            quantize_dtype=self.cache_dtype if self.quantized else None,
            page_size=self.page_size,
            kv_layout=self.layout,
            q_rope_out=o["q_rope_out"],
            q_nope_out=o.get("q_nope_out"),
            **kw,
        )

    def options(self):
        """``ropekv bench --options``: status= (leaves the outputs as the plain call writes
        them), and on fp8 GQA caches the computed scales (they change the outputs: timed only)."""
        out = {"status": ({"status": self.g.zeros((1,), np.int32)}, True)}
        if self.fp8 and not (self.mla or self.q_dyn or self.kv_dyn):
            T, Hq = self.a["q_rope"].shape[:2]
            q_scales = {"q_scale_out": self.g.zeros((T, Hq), np.float32), "quant_scale_q": None}
            shape = self.a["cache0"].shape[:-1]
            kv_scales = {
                "kv_cache_scales": (
                    self.g.zeros(shape, np.float32),
                    self.g.zeros(shape, np.float32),
                ),
                "quant_scale_kv": None,
            }
            out["dynamic q"] = (q_scales, False)
            out["kv scales"] = (kv_scales, False)
        return out

    def torch_fn(self, t, o):
        if self.q_dyn or self.kv_dyn:
            return None  # computed scales: no composition of the peers'

        ps, neox, mla, nhd = self.page_size, self.is_neox, self.mla, self.layout == "NHD"
        sq, skv = self.scales if self.fp8 else (1.0, 1.0)
        R = self.R

        def fn(
            q_rope,
            k_rope,
            q_nope,
            k_nope,
            v,
            table,
            pos_ids,
            kv_indices,
            kv_indptr,
            batch_indices,
            positions,
            c0,
            c1,
            q_rope_out,
            q_nope_out,
        ):
            torch = _torch()
            cs = table[pos_ids.long()]
            pos = positions.long()
            page = kv_indices[kv_indptr[batch_indices.long()].long() + pos // ps].long()
            entry = pos % ps
            cos, sin = cs[:, None, : R // 2], cs[:, None, R // 2 :]
            q_rope_out.copy_(_tcast(_trope(q_rope.float(), cos, sin, neox) * sq, q_rope_out.dtype))
            if q_nope is not None:
                q_nope_out.copy_(_tcast(q_nope.float() * sq, q_nope_out.dtype))
            if mla:
                c0[page, entry] = _tcast(k_nope.float() * skv, c0.dtype)
                c1[page, entry] = _tcast(
                    _trope(k_rope.float(), cs[:, : R // 2], cs[:, R // 2 :], neox) * skv, c1.dtype
                )
                return
            k = _trope(k_rope.float(), cos, sin, neox)
            if k_nope is not None:
                k = torch.cat([k, k_nope.float()], -1)
            kq, vq = _tcast(k * skv, c0.dtype), _tcast(v.float() * skv, c1.dtype)
            if nhd:
                c0[page, entry], c1[page, entry] = kq, vq
            else:
                c0[page, :, entry], c1[page, :, entry] = kq, vq

        return fn, (
            t["q_rope"],
            t["k_rope"],
            t.get("q_nope"),
            t.get("k_nope"),
            t.get("v"),
            t["table"],
            t["pos_ids"],
            t["kv_indices"],
            t["kv_indptr"],
            t["batch_indices"],
            t["positions"],
            o["cache0"],
            o["cache1"],
            o["q_rope_out"],
            o.get("q_nope_out"),
        )

    def flashinfer_fn(self, t, o):
        """FlashInfer 0.5.3: the fused op for fp8 caches; for fp16/bf16 caches (no fused op
        there) ``apply_rope_with_cos_sin_cache_inplace`` + ``append_paged_kv_cache``."""
        from flashinfer.page import append_paged_kv_cache
        from flashinfer.rope import (
            apply_rope_with_cos_sin_cache_inplace,
            rope_quantize_fp8_append_paged_kv_cache,
        )

        if self.q_dyn or self.kv_dyn:
            return None  # FlashInfer 0.5.3 has no computed scales
        caches = (o["cache0"], o["cache1"])
        if self.fp8:

            def fused():
                rope_quantize_fp8_append_paged_kv_cache(
                    t["q_rope"],
                    t["k_rope"],
                    t.get("q_nope"),
                    t.get("k_nope"),
                    t.get("v"),
                    t["table"],
                    t["pos_ids"],
                    caches,
                    t["kv_indices"],
                    t["kv_indptr"],
                    t["batch_indices"],
                    t["positions"],
                    is_neox=self.is_neox,
                    quantize_dtype=_torch_dtype(self.cache_dtype),
                    quant_scale_q=self.scales[0],
                    quant_scale_kv=self.scales[1],
                    page_size=self.page_size,
                    kv_layout=self.layout,
                    q_rope_out=o["q_rope_out"],
                    q_nope_out=o.get("q_nope_out"),
                )

            return fused, None
        if self.mla or t.get("q_nope") is not None:
            return None  # the two-launch path needs full-width rotary heads
        torch = _torch()
        # in place: the peer's q output is its own copy of q, k is roped in its own copy
        q = o["q_rope_out"]
        k = torch.empty_like(t["k_rope"])
        T = q.shape[0]
        seq = self.seq_len
        last = torch.full(
            (self.B,), (seq - 1) % self.page_size + 1, dtype=torch.int32, device=q.device
        )
        head = q.shape[-1]

        def reset():
            q.copy_(t["q_rope"])
            k.copy_(t["k_rope"])

        def two_launches():
            apply_rope_with_cos_sin_cache_inplace(
                t["pos_ids"], q.view(T, -1), k.view(T, -1), head, t["table"], is_neox=self.is_neox
            )
            append_paged_kv_cache(
                k,
                t["v"],
                t["batch_indices"],
                t["positions"],
                caches,
                t["kv_indices"],
                t["kv_indptr"],
                last,
                kv_layout=self.layout,
            )

        return two_launches, reset


def _paged_gqa(B, S, dtype, cache, prefix=1024, q_dyn=False, kv_dyn=False, heads=(32, 8), **extra):
    """A GQA case; ``heads``: (Hq, Hkv) at D 128, Llama-3-8B's by default, else named
    ``tp Hq/Hkv`` (a larger model's heads per GPU under tensor parallelism)."""
    T = B * S
    Hq, Hkv = heads
    quantized = cache in FP8 or np.dtype(cache) == np.int8
    qout = cache if quantized else dtype
    tag = (" dynamic q" if q_dyn else "") + (" kv scales" if kv_dyn else "")
    tp = "" if heads == (32, 8) else f"tp {Hq}/{Hkv} "
    return dict(
        op="paged",
        name=f"paged gqa {tp}{_dtname(dtype)}->{_dtname(cache)} {B}x{S}{tag}",
        tokens=T,
        nbytes=nbytes_of.rope_kv_bytes(T, Hq, Hkv, 128, 128, dtype, qout, cache)
        + nbytes_of.computed_scale_bytes(T, Hq if q_dyn else 0, Hkv if kv_dyn else 0),
        make=_lazy(
            PagedWL,
            B=B,
            S=S,
            prefix=prefix,
            dtype=dtype,
            cache_dtype=cache,
            q_dyn=q_dyn,
            kv_dyn=kv_dyn,
            **{**LLAMA, "Hq": Hq, "Hkv": Hkv},
        ),
        decode=S == 1,
        **extra,
    )


def specs():
    out = []
    shapes = ((8, 1024), (4, 2048), (1, 1), (64, 1), (256, 1))
    for dtype, cache in ((F16, E4M3), (F16, F16)):
        for B, S in shapes:
            headline = (B, S) in ((8, 1024), (64, 1))
            out.append(
                CaseSpec(
                    **_paged_gqa(
                        B, S, dtype, cache, quick=headline and cache == E4M3, compile=headline
                    )
                )
            )
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
    # computed scales (issue 14), against the static fp16 -> e4m3 cases of the same shapes
    # ("paged gqa fp16->e4m3 8x1024", "... 64x1", "... 1x1"): `--cases "paged gqa fp16->e4m3"`
    for B, S in ((8, 1024), (64, 1), (1, 1)):
        for q_dyn, kv_dyn in ((True, False), (False, True), (True, True)):
            out.append(CaseSpec(**_paged_gqa(B, S, F16, E4M3, q_dyn=q_dyn, kv_dyn=kv_dyn)))
        out.append(CaseSpec(**_paged_gqa(B, S, F16, np.dtype(np.int8), kv_dyn=True)))
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
    # 1,536 tokens: the calls of 1,025-2,047 tokens that the lean kernel took over from the row
    # kernel (paged.lean_prefill_from), none of them a shape above
    out.append(CaseSpec(**_paged_gqa(2, 768, F16, E4M3)))
    # tensor-parallel head counts (per GPU): Llama-3-70B on 8 GPUs (8/1), on 16 (4/1)
    for heads in ((8, 1), (4, 1)):
        for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
            spec = CaseSpec(**_paged_gqa(B, S, F16, E4M3, heads=heads))
            spec.series = f"paged gqa tp {heads[0]}/{heads[1]} fp16->e4m3" if S == 1 else ""
            out.append(spec)
    return out + _mla_specs(128) + _mla_specs(16)


def _mla_specs(Hq):
    """Paged MLA (latent 512, rope 64): DeepSeek-V3's 128 heads, or its 16 heads per GPU on 8."""
    out = []
    tp = "" if Hq == 128 else f"tp {Hq} heads "
    for B, S in ((8, 1024), (4, 2048), *((B, 1) for B in DECODE_SWEEP)):
        T = B * S
        if Hq != 128 and (B, S) == (8, 1024):
            continue
        out.append(
            CaseSpec(
                "paged",
                f"paged mla {tp}bf16->e4m3 {B}x{S}",
                T,
                nbytes_of.paged_mla_bytes(T, Hq, 512, 64, BF16, E4M3, E4M3),
                _lazy(
                    PagedWL,
                    B=B,
                    S=S,
                    prefix=1024,
                    Hq=Hq,
                    mla=True,
                    L=512,
                    R=64,
                    dtype=BF16,
                    cache_dtype=E4M3,
                    is_neox=False,
                ),
                decode=S == 1,
                quick=Hq == 128 and (B, S) == (128, 1),
                compile=Hq == 128 and (B, S) in ((4, 2048), (128, 1)),
                series=f"paged mla {tp}bf16->e4m3" if S == 1 else "",
            )
        )
    return out


def check_cases(add):
    """``ropekv check``'s cases: ``add(op, name, workload class, **build arguments)``."""
    for dtype, cache, layout, ps, idx in (
        (F16, E4M3, "NHD", 16, np.int32),
        (BF16, E4M3, "HND", 32, np.int64),
        (F16, F16, "NHD", 1, np.int32),
        (BF16, BF16, "HND", 16, np.int64),
        (F16, E5M2, "NHD", 128, np.int32),
    ):
        add(
            "paged",
            f"gqa {_dtname(dtype)}->{_dtname(cache)} {layout} page {ps} {np.dtype(idx).name}",
            PagedWL,
            B=3,
            S=19,
            prefix=37,
            Hq=8,
            Hkv=2,
            D=128,
            R=128 if cache != E5M2 else 64,
            dtype=dtype,
            cache_dtype=cache,
            page_size=ps,
            layout=layout,
            index_dtype=idx,
            scales=(0.5, 2.0),
            spare_pages=5,
        )
    add(
        "paged",
        "gqa fp16->e4m3 HND page 16 dynamic q, kv scales",
        PagedWL,
        B=3,
        S=19,
        prefix=37,
        Hq=8,
        Hkv=2,
        D=128,
        R=64,
        dtype=F16,
        cache_dtype=E4M3,
        page_size=16,
        layout="HND",
        spare_pages=5,
        q_dyn=True,
        kv_dyn=True,
    )
    add(
        "paged",
        "mla bf16->e4m3 page 16",
        PagedWL,
        B=2,
        S=11,
        prefix=20,
        Hq=16,
        mla=True,
        L=512,
        R=64,
        dtype=BF16,
        cache_dtype=E4M3,
        is_neox=False,
        scales=(1.0, 0.5),
        spare_pages=3,
    )
