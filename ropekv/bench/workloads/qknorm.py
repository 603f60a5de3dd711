"""The QK-norm op (:func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache`): workload, PyTorch peer,
FlashInfer's Cake kernels as a peer, cases."""

from __future__ import annotations

import functools

import numpy as np

from ropekv import bytes as nbytes_of
from ropekv.bench.arrays import BF16, E4M3, FP8, _dtname, _torch, to_numpy
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    QWEN3,
    QWEN3_32B,
    CaseSpec,
    Workload,
    _cos_sin,
    _fn,
    _lazy,
    _RaggedMixin,
    _tcast,
    _torch_ragged_addr,
    _trms,
    _trope,
)


class QknormWL(_RaggedMixin, Workload):
    """:func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache` (Qwen3-style QK-norm)."""

    op = "qknorm"
    OUTPUTS = ("q_out", "k_cache", "v_cache", "q_scale_out", "k_scales", "v_scales")

    def build(
        self,
        B,
        S,
        prefix,
        Hq,
        Hkv,
        D,
        dtype,
        cache_dtype,
        page_size=16,
        layout="NHD",
        is_neox=True,
        kv_scale=None,
        eps=1e-6,
        packed=False,
        gamma_dtype=None,
        q_out_dtype=None,
        q_dynamic=False,
        kv_dynamic=False,
    ):
        """``packed``: q, k, v are views of one (T, Hq + 2 Hkv, D) projection output ``qkv``, as
        engines (and the Cake kernels) hold them; ``gamma_dtype``: that of the RMSNorm weights
        (default the input dtype); ``q_out_dtype``: q's output dtype (fp8: static scale 1.0, or
        per row with ``q_dynamic``); ``kv_dynamic``: per-token-head KV scales."""
        g = self.g
        num_pages, seq = self.ragged(B, S, prefix, page_size)
        T = B * S
        self.D, self.layout, self.is_neox, self.eps = D, layout, is_neox, eps
        self.Hq, self.Hkv, self.B, self.T, self.S = Hq, Hkv, B, T, S
        self.dtype, self.packed = np.dtype(dtype), packed
        self.cache_dtype = np.dtype(cache_dtype)
        self.fp8 = self.cache_dtype in FP8
        self.kv_dynamic, self.q_dynamic = kv_dynamic, q_dynamic
        self.q_out_dtype = self.dtype if q_out_dtype is None else np.dtype(q_out_dtype)
        self.quant = kv_dynamic or self.q_out_dtype != self.dtype
        self.kv_scale = (kv_scale or 1.0) if self.fp8 and not kv_dynamic else None
        if packed:
            qkv = g.randn((T, Hq + 2 * Hkv, D), dtype)
            self.a["qkv"] = qkv
            self.a["q"], self.a["k"] = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv]
            self.a["v"] = qkv[:, Hq + Hkv :]
        else:
            self.a["q"] = g.randn((T, Hq, D), dtype)
            self.a["k"] = g.randn((T, Hkv, D), dtype)
            self.a["v"] = g.randn((T, Hkv, D), dtype)
        gdt = dtype if gamma_dtype is None else gamma_dtype
        self.gamma_f32 = np.dtype(gdt) == np.float32
        self.a["q_gamma"] = g.randn((D,), gdt, scale=0.1, offset=1.0)
        self.a["k_gamma"] = g.randn((D,), gdt, scale=0.1, offset=1.0)
        # the sequence length after the append (the Cake kernels' seq_lens)
        self.a["seq_lens"] = g.put(np.full(B, seq, np.int32))
        self.a["table"] = g.put(_cos_sin(seq, D))
        self.a["q_out"] = g.zeros((T, Hq, D), self.q_out_dtype)
        shape = (
            (num_pages, page_size, Hkv, D) if layout == "NHD" else (num_pages, Hkv, page_size, D)
        )
        self.a["k_cache"] = g.cache(shape, cache_dtype, self.poison)
        self.a["v_cache"] = g.cache(shape, cache_dtype, self.poison)
        if q_dynamic:
            self.a["q_scale_out"] = g.zeros((T, Hq), np.float32)
        if kv_dynamic:
            self.a["k_scales"] = g.zeros(shape[:3], np.float32)
            self.a["v_scales"] = g.zeros(shape[:3], np.float32)
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
            "q_scale": ("q_scale_out", (tok,)),
            "k_scale_rows": ("k_scales", rows),
            "v_scale_rows": ("v_scales", rows),
        }

    def call(self, o, **options):
        a = self.a
        kw = {"kv_scale": self.kv_scale, "q_out": o["q_out"]}
        if self.q_dynamic:
            kw["q_scale_out"] = o["q_scale_out"]
        if self.kv_dynamic:
            kw["kv_cache_scales"] = (o["k_scales"], o["v_scales"])
        kw.update(options)
        return _fn("qk_rmsnorm_rope_append_paged_kv_cache")(
            a["q"],
            a["k"],
            a["v"],
            a["q_gamma"],
            a["k_gamma"],
            a["table"],
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            (o["k_cache"], o["v_cache"]),
            epsilon=self.eps,
            is_neox=self.is_neox,
            kv_layout=self.layout,
            **kw,
        )

    def options(self):
        """``ropekv bench --options``: on fp8 caches with static scales and a 16-bit q, the
        computed scales: dynamic fp8 q (an e4m3 q_out and its per-row scales: fewer bytes than
        the plain call's q) and per-token-head KV scales (the same bytes but the scales), timed
        only (they change the outputs)."""
        if not self.fp8 or self.quant:
            return {}
        T, Hq, D = self.T, self.Hq, self.D
        shape = self.a["k_cache"].shape[:3]
        return {
            "dynamic q": (
                {
                    "q_out": self.g.zeros((T, Hq, D), E4M3),
                    "q_scale_out": self.g.zeros((T, Hq), np.float32),
                },
                False,
            ),
            "kv scales": (
                {
                    "kv_scale": None,
                    "kv_cache_scales": (
                        self.g.zeros(shape, np.float32),
                        self.g.zeros(shape, np.float32),
                    ),
                },
                False,
            ),
        }

    def torch_fn(self, t, o):
        if self.quant:  # no PyTorch composition of the quantized outputs
            return None
        D, neox, eps, nhd = self.D, self.is_neox, self.eps, self.layout == "NHD"
        scale = self.kv_scale or 1.0
        ps = self.page_size

        def fn(q, k, v, qg, kg, table, offsets, lens, block_table, b, kc, vc, q_out):
            p, page, entry = _torch_ragged_addr(offsets, lens, block_table, b, ps)
            cs = table[p]
            cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2 :]
            q_out.copy_(_trope(_trms(q.float(), qg, eps), cos, sin, neox).to(q_out.dtype))
            kq = _tcast(_trope(_trms(k.float(), kg, eps), cos, sin, neox) / scale, kc.dtype)
            vq = _tcast(v.float() / scale, vc.dtype)
            if nhd:
                kc[page, entry], vc[page, entry] = kq, vq
            else:
                kc[page, :, entry], vc[page, :, entry] = kq, vq

        return fn, (
            t["q"],
            t["k"],
            t["v"],
            t["q_gamma"],
            t["k_gamma"],
            t["table"],
            t["input_row_offsets"],
            t["cache_lengths"],
            t["block_table"],
            t["token_batch"],
            o["k_cache"],
            o["v_cache"],
            o["q_out"],
        )

    def flashinfer_cake_fn(self, t, o, po):
        """FlashInfer 0.7.2's Cake kernels on the same packed qkv (heads (64, 8) or (8, 1), D 128,
        NHD, float32 weights, norm then RoPE): (call, outputs, expect) or None. The bf16 kernel
        writes q as bf16 (``clear_unused_last_page_rows=False``: the same work as ropekv); the fp8
        kernel writes q as e4m3 (static scale 1.0), compared with ropekv's q rounded to e4m3, or
        with ``q_dynamic`` with dynamic scales (``quant_policy=1``), compared with ropekv's e4m3
        q and its scales (Cake's prefill layout mapped onto ropekv's (T, Hq))."""
        if not (
            self.packed
            and self.gamma_f32
            and self.is_neox
            and self.layout == "NHD"
            and self.D == 128
            and (self.Hq, self.Hkv) in ((64, 8), (8, 1))
            and self.dtype == BF16
            and self.cache_dtype in (BF16, E4M3)
            and not self.kv_dynamic
            and (not self.quant or self.q_dynamic)
        ):
            return None
        if self.q_dynamic:
            return self._cake_dynamic(t, o, po)
        torch = _torch()
        T, Hq = self.T, self.Hq
        qkv = t["qkv"].view(T, -1)
        common = (qkv, t["table"], t["seq_lens"], t["input_row_offsets"], t["block_table"])
        weights = {"q_norm_weight": t["q_gamma"], "k_norm_weight": t["k_gamma"]}
        if not self.fp8:
            from flashinfer.cake_fused_qk_rope_append import (
                cake_fused_qk_rmsnorm_rope_append_paged_kv_cache as cake,
            )

            def bf16():
                cake(
                    *common,
                    o["k_cache"],
                    o["v_cache"],
                    num_q_heads=Hq,
                    num_kv_heads=self.Hkv,
                    qk_norm_policy=2,
                    eps=self.eps,
                    out_q=o["q_out"],
                    clear_unused_last_page_rows=False,
                    **weights,
                )

            return bf16, functools.partial(self.outputs, po), None
        from flashinfer.cake_fused_qk_rope_fp8_append import (
            cake_fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as cake,
        )

        dev = qkv.device
        out_q = torch.zeros((T, Hq, self.D), dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.full((1,), float(self.kv_scale), dtype=torch.float32, device=dev)
        q_scale_inv = torch.ones(1, dtype=torch.float32, device=dev)
        q_scale = torch.empty((0,), dtype=torch.float32, device=dev)
        flag = torch.empty((self.B, self.Hkv), dtype=torch.int32, device=dev)

        def fp8():
            cake(
                *common,
                (o["k_cache"], o["v_cache"]),
                is_prefill=self.S > 1,
                k_scale=scale,
                v_scale=scale,
                quant_policy=2,
                q_scale_inv=q_scale_inv,
                qk_norm_policy=2,
                out_q=out_q,
                q_scale=q_scale,
                split_k_flag=flag,
                **weights,
            )

        tok = self.sample["q_out"][1][0]

        def outputs():
            out = self.outputs(po)
            del out["q_out"]  # the peer's q is e4m3, in its own buffer
            out["q_out_e4m3"] = to_numpy(out_q[torch.as_tensor(tok, device=dev)])
            return out

        def expect(expected):
            return dict(expected, q_out_e4m3=expected["q_out"].astype(np.float32).astype(E4M3))

        return fp8, outputs, expect

    def _cake_dynamic(self, t, o, po):
        """The Cake fp8 kernel with dynamic q scales (``quant_policy=1``): decode (one token per
        request) lays the scales out (T, Hq), prefill (B, Hq, round_up(max_seqlen, 128)) by the
        token's index in its request."""
        from flashinfer.cake_fused_qk_rope_fp8_append import (
            cake_fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as cake,
        )

        torch = _torch()
        T, Hq, B, S = self.T, self.Hq, self.B, self.S
        qkv = t["qkv"].view(T, -1)
        dev = qkv.device
        prefill = S > 1
        scale_shape = (B, Hq, -(-S // 128) * 128) if prefill else (T, Hq)
        q_scale = torch.zeros(scale_shape, dtype=torch.float32, device=dev)
        flag = torch.empty((B, self.Hkv), dtype=torch.int32, device=dev)
        scale = torch.ones(1, dtype=torch.float32, device=dev)

        def fp8():
            cake(
                qkv,
                t["table"],
                t["seq_lens"],
                t["input_row_offsets"],
                t["block_table"],
                (o["k_cache"], o["v_cache"]),
                is_prefill=prefill,
                k_scale=scale,
                v_scale=scale,
                quant_policy=1,
                max_seqlen=S,
                qk_norm_policy=2,
                q_norm_weight=t["q_gamma"],
                k_norm_weight=t["k_gamma"],
                out_q=o["q_out"],
                q_scale=q_scale,
                split_k_flag=flag,
            )

        tok = self.sample["q_out"][1][0]

        def outputs():
            out = self.outputs(po)
            scales = to_numpy(q_scale)
            # every request has S tokens: token t is request t // S, index t % S
            out["q_scale"] = scales[tok // S, :, tok % S] if prefill else scales[tok]
            return out

        return fp8, outputs, None


def specs():
    return [
        *_qwen3_specs(),
        *_qwen3_32b_specs(),
        *_qwen3_32b_specs((8, 1)),
        *_quantized_q_kv_specs(),
    ]


def _qwen3_specs():
    """Qwen3-8B heads: prefill and decode, bf16 and e4m3 caches."""
    out = []
    for B, S, cache in ((8, 1024, BF16), (8, 1024, E4M3), (64, 1, E4M3)):
        T = B * S
        out.append(
            CaseSpec(
                "qknorm",
                f"qknorm bf16->{_dtname(cache)} {B}x{S}",
                T,
                nbytes_of.qknorm_bytes(T, 32, 8, 128, 128, BF16, cache),
                _lazy(QknormWL, B=B, S=S, prefix=1024, dtype=BF16, cache_dtype=cache, **QWEN3),
                decode=S == 1,
                quick=S == 1,
                compile=cache == E4M3,
            )
        )
    return out


def _qwen3_32b_specs(heads=(64, 8)):
    """Qwen3-32B heads on one packed qkv with float32 weights: the Cake kernels' shapes; with
    ``heads`` (8, 1), its heads per GPU when served on 8 (``tp 8/1``)."""
    out = []
    Hq, Hkv = heads
    tp = "" if heads == (64, 8) else f" tp {Hq}/{Hkv}"
    for cache in (BF16, E4M3):
        series = f"qknorm qwen3-32b{tp} bf16->{_dtname(cache)}"
        for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
            T = B * S
            out.append(
                CaseSpec(
                    "qknorm",
                    f"{series} {B}x{S}",
                    T,
                    nbytes_of.qknorm_bytes(T, Hq, Hkv, 128, 128, BF16, cache),
                    _lazy(
                        QknormWL,
                        B=B,
                        S=S,
                        prefix=1024,
                        dtype=BF16,
                        cache_dtype=cache,
                        packed=True,
                        gamma_dtype=np.float32,
                        **{**QWEN3_32B, "Hq": Hq, "Hkv": Hkv},
                    ),
                    decode=S == 1,
                    series=series if S == 1 else "",
                )
            )
    return out


def _quantized_q_kv_specs():
    """Computed scales: an fp8 q with dynamic scales, per-token-head KV scales."""
    out = []
    # fp8 q with dynamic per-token-per-head scales (the Cake fp8 kernel's quant_policy=1), e4m3
    # cache with a static scale; per-token-head KV scales (against the static-scale rows above)
    series = "qknorm qwen3-32b bf16->e4m3 q e4m3 dynamic"
    for B, S in ((8, 1024), *((B, 1) for B in DECODE_SWEEP)):
        T = B * S
        out.append(
            CaseSpec(
                "qknorm",
                f"{series} {B}x{S}",
                T,
                nbytes_of.qknorm_bytes(
                    T, 64, 8, 128, 128, BF16, E4M3, q_out_dtype=E4M3, q_scales=True
                ),
                _lazy(
                    QknormWL,
                    B=B,
                    S=S,
                    prefix=1024,
                    dtype=BF16,
                    cache_dtype=E4M3,
                    packed=True,
                    gamma_dtype=np.float32,
                    q_out_dtype=E4M3,
                    q_dynamic=True,
                    **QWEN3_32B,
                ),
                decode=S == 1,
                series=series if S == 1 else "",
            )
        )
    for B, S in ((8, 1024), (64, 1)):
        T = B * S
        out.append(
            CaseSpec(
                "qknorm",
                f"qknorm qwen3-32b bf16->e4m3 kv scales per token-head {B}x{S}",
                T,
                nbytes_of.qknorm_bytes(T, 64, 8, 128, 128, BF16, E4M3, kv_scales=True),
                _lazy(
                    QknormWL,
                    B=B,
                    S=S,
                    prefix=1024,
                    dtype=BF16,
                    cache_dtype=E4M3,
                    packed=True,
                    gamma_dtype=np.float32,
                    kv_dynamic=True,
                    **QWEN3_32B,
                ),
                decode=S == 1,
            )
        )
    return out


def check_cases(add):
    """``ropekv check``'s cases: ``add(op, name, workload class, **build arguments)``."""
    for cache, layout in ((BF16, "NHD"), (E4M3, "HND")):
        add(
            "qknorm",
            f"bf16->{_dtname(cache)} {layout}",
            QknormWL,
            B=3,
            S=9,
            prefix=30,
            Hq=16,
            Hkv=4,
            D=128,
            dtype=BF16,
            cache_dtype=cache,
            layout=layout,
            kv_scale=0.5 if cache in FP8 else None,
        )
    # quantized outputs: dynamic fp8 q; per-token-head KV scales (fp8 codes compare as adjacent,
    # int8 codes exactly, so the check takes e5m2)
    add(
        "qknorm",
        "bf16->e4m3 q e4m3 dynamic NHD",
        QknormWL,
        B=3,
        S=9,
        prefix=30,
        Hq=16,
        Hkv=4,
        D=128,
        dtype=BF16,
        cache_dtype=E4M3,
        q_out_dtype=E4M3,
        q_dynamic=True,
    )
    add(
        "qknorm",
        "bf16->e5m2 kv scales per token-head HND",
        QknormWL,
        B=3,
        S=9,
        prefix=30,
        Hq=16,
        Hkv=4,
        D=128,
        dtype=BF16,
        cache_dtype=np.dtype("float8_e5m2"),
        layout="HND",
        kv_dynamic=True,
    )
