"""RoPE on q and k from a cos/sin table, no cache (:func:`ropekv.apply_rope_with_cos_sin_cache_inplace`
and :func:`ropekv.apply_rope_with_cos_sin_cache`): workload, FlashInfer and PyTorch peers, cases."""

from __future__ import annotations

import numpy as np

from ropekv.bench.arrays import BF16, F16, _dtname
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    LLAMA,
    CaseSpec,
    Workload,
    _cos_sin,
    _fn,
    _lazy,
    _trope,
)

TP8 = {"Hq": 8, "Hkv": 1, "D": 128}  # Llama-3-8B's attention at tensor parallelism 4 (8 / 1 heads)
PREFILL = 8192
COS_SIN_ITEMSIZE = 4


def qk_rope_bytes(tokens, Hq, Hk, D, R, dtype, out_of_place=False):
    """Minimal bytes of one call: in place, the rotary dims of q and k read and written; out of
    place, whole rows read and written; one float32 table row of R values per token."""
    item = np.dtype(dtype).itemsize
    dims = D if out_of_place else R
    return tokens * ((Hq + Hk) * dims * 2 * item + R * COS_SIN_ITEMSIZE)


class QkRopeWL(Workload):
    """``T`` tokens of ``Hq`` / ``Hk`` heads of ``D`` dims rotated by a ``(P, R)`` table:
    ``query`` / ``key`` as ``(T, H * D)`` arrays, or (``fused``) column views of one
    ``(T, (Hq + 2 Hk) D)`` QKV buffer, as engines split their projection. ``out_of_place``: the
    form with outputs (``query_out`` / ``key_out``, given as the bench's outputs)."""

    op = "qk_rope"
    OUTPUTS = ("query", "key", "qkv", "query_out", "key_out")

    def build(
        self,
        T,
        Hq,
        Hkv,
        D,
        dtype,
        R=None,
        P=None,
        is_neox=True,
        fused=False,
        out_of_place=False,
        bad_positions=False,
        pos_dtype=np.int64,
    ):
        g = self.g
        R = R or D
        P = P or max(T, 4096)
        self.T, self.Hq, self.Hk, self.D, self.R = T, Hq, Hkv, D, R
        self.is_neox, self.fused, self.out_of_place = is_neox, fused, out_of_place
        positions = g.rng.integers(0, P, T)
        if bad_positions and T:
            bad = g.rng.random(T) < 0.25
            positions[bad] = g.rng.choice([-1, P, 2**31 - 1], bad.sum())
        self.a["positions"] = g.put(positions.astype(pos_dtype))
        self.a["table"] = g.put(_cos_sin(P, R))
        if fused:
            self.a["qkv"] = g.randn((T, (Hq + 2 * Hkv) * D), dtype)
        else:
            self.a["query"] = g.randn((T, Hq * D), dtype)
            self.a["key"] = g.randn((T, Hkv * D), dtype)
        tok = self._sample_tokens(T)
        if out_of_place:
            self.a["query_out"] = g.zeros((T, Hq * D), dtype)
            self.a["key_out"] = g.zeros((T, Hkv * D), dtype)
            self.sample = {"query": ("query_out", (tok,)), "key": ("key_out", (tok,))}
        elif fused:
            self.sample = {"qkv": ("qkv", (tok,))}
        else:
            self.sample = {"query": ("query", (tok,)), "key": ("key", (tok,))}

    def _qk(self, arrays):
        """query and key: the workload's own, or views of its fused buffer."""
        if not self.fused:
            return arrays.get("query", self.a.get("query")), arrays.get("key", self.a.get("key"))
        qkv = arrays.get("qkv", self.a["qkv"])
        q_end = self.Hq * self.D
        return qkv[:, :q_end], qkv[:, q_end : q_end + self.Hk * self.D]

    def call(self, o, **options):
        a = self.a
        query, key = self._qk(o)
        kw = {"is_neox": self.is_neox, **options}
        if not self.out_of_place:
            _fn("apply_rope_with_cos_sin_cache_inplace")(
                a["positions"], query, key, self.D, a["table"], **kw
            )
            return
        _fn("apply_rope_with_cos_sin_cache")(
            a["positions"],
            query,
            key,
            self.D,
            a["table"],
            query_out=o["query_out"],
            key_out=o["key_out"],
            **kw,
        )

    def options(self):
        """``ropekv bench --options``: programmatic dependent launch (outputs unchanged)."""
        return {"pdl": ({"enable_pdl": True}, True)}

    def flashinfer_fn(self, t, o):
        """FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` on the same memory."""
        if self.out_of_place:
            return None
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

        query, key = self._qk(o)
        positions, table, D, neox = t["positions"], t["table"], self.D, self.is_neox

        def run():
            apply_rope_with_cos_sin_cache_inplace(positions, query, key, D, table, is_neox=neox)

        return run, None

    def torch_fn(self, t, o):
        if self.out_of_place:
            return None
        query, key = self._qk(o)
        return _torch_qk_rope, (t["positions"], query, key, t["table"], self.D, self.is_neox)


def _torch_qk_rope(positions, query, key, table, D, neox):
    """The same rotation in PyTorch eager: gather the table rows, rotate in float32, write back;
    a token whose position falls outside the table keeps its rows."""
    P, R = table.shape
    pos = positions.long()
    keep = ((pos >= 0) & (pos < P))[:, None, None]
    rows = table[pos.clamp(0, P - 1)]
    cos, sin = rows[:, None, : R // 2], rows[:, None, R // 2 :]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, D)
        rotated = _trope(heads.float(), cos, sin, neox).to(x.dtype)
        heads.copy_(rotated.where(keep, heads))


def _spec(T, shape, dtype, label, fused=False, series="", **extra):
    Hq, Hk, D = shape["Hq"], shape["Hkv"], shape["D"]
    layout = " fused" if fused else ""
    return CaseSpec(
        "qk_rope",
        f"qk_rope {label} {_dtname(dtype)}{layout} {T}",
        T,
        qk_rope_bytes(T, Hq, Hk, D, D, dtype),
        _lazy(QkRopeWL, T=T, dtype=dtype, fused=fused, **shape),
        decode=T <= max(DECODE_SWEEP),
        series=series,
        **extra,
    )


def specs():
    out = []
    for shape, label in ((LLAMA, "llama 32/8/128"), (TP8, "tp 8/1/128")):
        series = f"qk_rope {label} fp16"
        for T in (*DECODE_SWEEP, PREFILL):
            out.append(
                _spec(
                    T,
                    shape,
                    F16,
                    label,
                    series=series if T <= max(DECODE_SWEEP) else "",
                    quick=shape is LLAMA and T in (64, PREFILL),
                    compile=shape is LLAMA and T in (64, PREFILL),
                )
            )
    # bf16, and the engines' layout (views of a fused QKV buffer), at a decode and the prefill
    for T in (64, PREFILL):
        out.append(_spec(T, LLAMA, BF16, "llama 32/8/128"))
        out.append(_spec(T, LLAMA, F16, "llama 32/8/128", fused=True))
    return out


def check_cases(add):
    """``ropekv check``'s cases: ``add(op, name, workload class, **build arguments)``."""
    for dtype, T, neox, R, fused, out_of_place, pos_dtype in (
        (F16, 3, True, 128, False, False, np.int64),
        (BF16, 37, False, 64, True, False, np.int32),
        (F16, 1200, True, 64, False, True, np.int32),
        (BF16, 5, False, 128, True, True, np.int64),
    ):
        add(
            "qk_rope",
            f"{_dtname(dtype)} {T} tokens{'' if neox else ' interleaved'} R={R}"
            f"{' fused' if fused else ''}{' out of place' if out_of_place else ''}",
            QkRopeWL,
            T=T,
            Hq=8,
            Hkv=2,
            D=128,
            R=R,
            P=64,
            dtype=dtype,
            is_neox=neox,
            fused=fused,
            out_of_place=out_of_place,
            bad_positions=True,
            pos_dtype=pos_dtype,
        )
