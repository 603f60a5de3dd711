"""One small call of every op and variant, as NumPy keyword arguments, shared by the framework
tests (tests/test_torch_ops.py, tests/test_jax_ops.py). Built from the op tests' own case
builders, so caches start as random bytes (stray writes show) and index arrays are ragged."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tests import test_contiguous, test_mla, test_paged, test_qk_rope, test_qknorm, test_qkv
from tests.test_call_path import assert_op_close

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)
INT8 = np.dtype(np.int8)

# the arguments each op writes (besides the arrays it returns)
WRITES = {
    "apply_rope_write_kv": ("q", "kv_cache"),
    "rope_quantize_fp8_append_paged_kv_cache": ("paged_kv_cache",),
    "rope_append_paged_kv_cache": ("paged_kv_cache",),
    "mla_rope_rmsnorm_append_paged_kv_cache": ("kv_cache",),
    "qk_rmsnorm_rope_append_paged_kv_cache": ("paged_kv_cache",),
    "fused_qkv_matmul_append_paged_kv_cache": ("paged_kv_cache",),
    "apply_rope_with_cos_sin_cache_inplace": ("query", "key"),
    "apply_rope_with_cos_sin_cache": (),
}
OUTPUT_ARGS = ("q_rope_out", "q_nope_out", "q_out", "out", "query_out", "key_out")
# written when given, after the caches: computed scales, and the status of the ops that
# validate their offsets on the device
STATUS = "status"
WRITTEN_OPTIONS = ("q_scale_out", "kv_cache_scales", STATUS)


def assert_result_close(actual, expected, case, what):
    """One device result of ``case`` against the NumPy reference's: int8 codes equal or adjacent
    (the kernels compute scales in float32, the reference in float64), the fused QKV op's rows
    by relative error (``tests/test_call_path.assert_op_close``), the rest by
    ``tests/tolerance.assert_close``."""
    if np.dtype(expected.dtype) == INT8:
        test_contiguous.assert_codes_close(actual, expected, what)
    else:
        assert_op_close(actual, expected, "qkv" if case.op.startswith("fused_qkv") else "", what)


class Case:
    """``getattr(ops, op)(**kwargs)``: ``ops`` is ``ropekv`` or ``ropekv.torch``. ``in_place``
    names an output argument that is the input itself (``q_rope_out=q_rope``)."""

    def __init__(self, name, op, kwargs, in_place=None):
        self.name, self.op, self.kwargs, self.in_place = name, op, kwargs, in_place

    def fresh(self, convert=lambda x: x):
        """Copies of the arguments, each array passed through ``convert`` (an in-place output is
        the converted input itself, the same object)."""
        out = {}
        for n, x in self.kwargs.items():
            if isinstance(x, tuple):
                out[n] = tuple(convert(np.array(y)) if isinstance(y, np.ndarray) else y for y in x)
            elif isinstance(x, np.ndarray):
                out[n] = convert(np.array(x))
            else:
                out[n] = x
        if self.in_place:
            out[self.in_place[0]] = out[self.in_place[1]]
        return out

    def written(self, kwargs, status=True, outputs=True):
        """The arrays the call writes in ``kwargs`` (after the call), in a fixed order: the
        caches (and ``q`` / ``k``), the computed scales, ``status`` and the output arguments
        (those two left out with ``status=False`` / ``outputs=False``)."""
        names = list(WRITES[self.op])
        if self.op == "apply_rope_write_kv" and kwargs.get("write_k_in_place"):
            names.append("k")
        names += [
            n for n in WRITTEN_OPTIONS if kwargs.get(n) is not None and (status or n != STATUS)
        ]
        names += [n for n in OUTPUT_ARGS if outputs and kwargs.get(n) is not None]
        flat = []
        for n in names:
            x = kwargs[n]
            flat += list(x) if isinstance(x, tuple) else [x]
        return flat

    def run(self, ops, kwargs):
        """Call the op; returns every array it returned or wrote."""
        result = getattr(ops, self.op)(**kwargs)
        if result is None:
            result = ()
        elif not isinstance(result, tuple):
            result = (result,)
        return [*result, *self.written(kwargs)]

    def __repr__(self):
        return self.name


def _contiguous(name, seed, **kw):
    call = {n: kw.pop(n) for n in ("write_k_in_place", "is_neox", "kv_scale") if n in kw}
    return Case(name, "apply_rope_write_kv", {**test_contiguous.make_case(seed, **kw), **call})


def _paged(name, seed, op, **kw):
    outs = {n: kw.pop(n) for n in ("q_rope_out", "q_nope_out") if n in kw}
    args = test_paged.make_case(seed, **kw)
    T, Hq, R = args["q_rope"].shape
    Dn = 0 if args["q_nope"] is None else args["q_nope"].shape[2]
    dtype = args["paged_kv_cache"][0].dtype
    shapes = {"q_rope_out": (T, Hq, R), "q_nope_out": (T, Hq, Dn)}
    for n, given in outs.items():
        if given:
            args[n] = np.zeros(shapes[n], dtype)
    return Case(name, op, args)


def _ragged(name, module, op, seed, out=None, call=None, **kw):
    """mla / qknorm / qkv: ``out`` is None (allocated), "given" or "in_place"."""
    args, keywords = module.make_case(seed, **kw)
    args = {**args, **keywords, **(call or {})}
    out_name, q_name = {
        "mla": ("q_rope_out", "q_rope"),
        "qknorm": ("q_out", "q"),
        "qkv": ("out", None),
    }[name.split("-")[0]]
    in_place = None
    if out == "given":
        like = (
            args[q_name]
            if q_name
            else np.zeros(
                (
                    args["hidden_state"].shape[0],
                    args["num_q_heads"] * args["paged_kv_cache"][0].shape[3],
                ),
                args["hidden_state"].dtype,
            )
        )
        args[out_name] = np.zeros_like(like)
    elif out == "in_place":
        args[out_name] = args[q_name]
        in_place = (out_name, q_name)
    return Case(name, op, args, in_place)


def _mrope(case, interleaved):
    """``case`` with mRoPE positions ((3, B, S) or (3, T)) and the keywords that go with them,
    from the op tests' own builders."""
    rng = np.random.default_rng(len(case.name))
    a = case.kwargs
    R = a["cos_sin_cache"].shape[-1]
    if case.op == "apply_rope_write_kv":
        B, S = a["q"].shape[:2]
        a["position_ids"] = test_contiguous.mrope_ids(rng, B, S, a["cos_sin_cache"].shape[0])
        section = test_contiguous.mrope_section_for(R, interleaved)
    elif case.op.startswith("rope_"):
        args, kw = test_paged.with_mrope(a, rng, interleaved)
        a.update(args)
        section = kw["mrope_section"]
    else:
        a["position_ids"], section = test_qknorm.mrope_case(rng, a, R, interleaved)
    a.update(mrope_section=section, mrope_interleaved=interleaved)
    return case


def _layers(case, num_layers, layer):
    """``case`` on caches of ``num_layers`` layers (random bytes, layer ``layer`` the case's
    cache) written through ``layer_idx``."""
    rng = np.random.default_rng(num_layers + layer)
    name = WRITES[case.op][0]
    caches = case.kwargs[name]

    def layered(c):
        full = (rng.standard_normal((num_layers, *c.shape)) * 0.5).astype(c.dtype)
        full[layer] = c
        return full

    case.kwargs[name] = (
        tuple(layered(c) for c in caches) if isinstance(caches, tuple) else layered(caches)
    )
    if case.kwargs.get("kv_cache_scales") is not None:  # they carry the layer dimension too
        case.kwargs["kv_cache_scales"] = tuple(layered(c) for c in case.kwargs["kv_cache_scales"])
    case.kwargs["layer_idx"] = layer
    return case


def _status():
    return np.full(1, 99, np.int32)  # not 0: the op must write it


def _scales(rng, shape):
    """A scale array the op writes, starting as random values (stray or missing writes show)."""
    return rng.uniform(-3, 3, shape).astype(np.float32)


def _quant_contiguous(name, seed, write_k_in_place=False, **kw):
    """The contiguous op with ``q_out`` / ``q_scale`` / ``q_scale_out`` / ``kv_cache_scales``
    (``tests/test_contiguous.quant_case``)."""
    args = test_contiguous.quant_case(seed, **kw)
    return Case(name, "apply_rope_write_kv", {**args, "write_k_in_place": write_k_in_place})


def _computed_scales(case, q_scale_out=False, kv_cache_scales=False, status=False):
    """A paged or QK-norm ``case`` with the arrays of issue 14 the op writes: dynamic Q scales
    ``(T, Hq)``, per-token-head KV scales (the caches' shape without D) and ``status``. The
    static scales they replace are dropped (their default, None)."""
    rng = np.random.default_rng(len(case.name))
    a = case.kwargs
    q = a["q_rope"] if "q_rope" in a else a["q"]
    if q_scale_out:
        a.pop("quant_scale_q", None)
        a["q_scale_out"] = _scales(rng, q.shape[:2])
    if kv_cache_scales:
        a.pop("quant_scale_kv", None)
        a.pop("kv_scale", None)
        a["kv_cache_scales"] = tuple(_scales(rng, c.shape[:-1]) for c in a["paged_kv_cache"])
    if status:
        a["status"] = _status()
    return case


def _with_q_out(case, dtype, **call):
    """A QK-norm ``case`` with a given ``q_out`` of ``dtype`` (random bytes) and ``call``."""
    rng = np.random.default_rng(len(case.name))
    q = case.kwargs["q"]
    case.kwargs["q_out"] = rng.integers(
        0, 256, (*q.shape[:-1], q.shape[-1] * dtype.itemsize), np.uint8
    ).view(dtype)
    case.kwargs.update(call)
    return case


def _qk_rope(name, seed, op, out=None, **kw):
    """FlashInfer's RoPE on q and k: in place (``op`` the ``_inplace`` function), allocating, or
    into given outputs (``out="given"``)."""
    args = {n: x for n, x in test_qk_rope.make_case(seed, **kw).items() if n != "qkv"}
    if out == "given":
        rng = np.random.default_rng(seed)
        for n in ("query", "key"):
            args[f"{n}_out"] = rng.standard_normal(args[n].shape).astype(args[n].dtype)
    return Case(name, op, args)


def cases():
    """Every op with each of its registered forms (allocating, given outputs, in place)."""
    quant, plain = "rope_quantize_fp8_append_paged_kv_cache", "rope_append_paged_kv_cache"
    mla, qknorm = "mla_rope_rmsnorm_append_paged_kv_cache", "qk_rmsnorm_rope_append_paged_kv_cache"
    qkv = "fused_qkv_matmul_append_paged_kv_cache"
    return [
        _contiguous("contiguous-f16", 1, D=32, R=32),
        _contiguous("contiguous-fp8-positions", 2, D=32, R=16, cache_dtype=E4M3, pos=True),
        _contiguous(
            "contiguous-bf16-k-in-place",
            3,
            D=32,
            R=32,
            dtype=BF16,
            write_k_in_place=True,
            is_neox=False,
        ),
        _paged("paged-fp8-gqa", 4, quant, Dn=16),
        _paged("paged-fp8-mla", 5, quant, mla=True, Dn=16),
        _paged("paged-fp8-given-q-rope-out", 6, quant, Dn=16, q_rope_out=True),
        _paged(
            "paged-fp8-per-head-scales", 7, quant, per_head=True, q_rope_out=True, q_nope_out=True
        ),
        _paged("paged-f16-hnd", 8, plain, Dn=16, cache_dtype=np.float16, kv_layout="HND"),
        _ragged("mla", test_mla, mla, 9),
        _ragged("mla-split-given", test_mla, mla, 10, out="given", split=True),
        _ragged(
            "mla-fp8-in-place", test_mla, mla, 11, out="in_place", cache_dtype=E4M3, kv_scale=0.5
        ),
        _ragged("qknorm", test_qknorm, qknorm, 12),
        _ragged("qknorm-hnd-given", test_qknorm, qknorm, 13, out="given", layout="HND"),
        _ragged(
            "qknorm-fp8-in-place",
            test_qknorm,
            qknorm,
            14,
            out="in_place",
            cache_dtype=E4M3,
            call={"kv_scale": (0.5, 2.0)},
        ),
        _ragged("qkv-decode", test_qkv, qkv, 15, lengths=(1, 1)),
        _qk_rope("qk-rope-inplace", 40, "apply_rope_with_cos_sin_cache_inplace"),
        _qk_rope("qk-rope", 41, "apply_rope_with_cos_sin_cache", D=64, R=32, heads3=True),
        _qk_rope("qk-rope-given", 42, "apply_rope_with_cos_sin_cache", out="given", dtype=BF16),
        # more tokens than the fused kernels take, even under capture (cuBLAS, then the
        # epilogue): no CUDA graph
        _ragged(
            "qkv-prefill-given", test_qkv, qkv, 16, out="given", lengths=(300, 10, 0, 250), P=1024
        ),
        # cuBLAS eagerly, the fused kernel under CUDA-graph capture (sm_90, up to
        # ropekv.qkv.GRAPH_MAX_TOKENS)
        _ragged("qkv-graph-batch", test_qkv, qkv, 29, lengths=(150, 1, 0, 159), K=128, P=512),
        # a small batch: one fused kernel (the tensor cores on sm_90), which a graph can hold
        _ragged("qkv-batch", test_qkv, qkv, 28, lengths=(3, 1, 0, 2)),
        # issue 14's options (mRoPE, status, tail clearing, QK-norm variants) and multi-layer
        # caches (layer_idx)
        _mrope(_contiguous("contiguous-mrope", 17, D=32, R=32), False),
        _mrope(
            _contiguous("contiguous-fp8-mrope-interleaved", 18, D=32, R=32, cache_dtype=E4M3), True
        ),
        _mrope(_paged("paged-fp8-mrope-interleaved", 19, quant, Dn=16), True),
        _mrope(
            _paged("paged-f16-mrope-given", 20, plain, cache_dtype=np.float16, q_rope_out=True),
            False,
        ),
        _ragged(
            "mla-options",
            test_mla,
            mla,
            21,
            out="given",
            call={"clear_unused_last_page_rows": True, "status": _status()},
        ),
        _layers(_ragged("mla-split-layers", test_mla, mla, 22, split=True, cache_dtype=E4M3), 3, 1),
        _ragged(
            "qknorm-options-given",
            test_qknorm,
            qknorm,
            23,
            out="given",
            call={
                "norm_order": "after_rope",
                "weight_offset": 1.0,
                "clear_unused_last_page_rows": True,
                "status": _status(),
            },
        ),
        _mrope(_ragged("qknorm-mrope-in-place", test_qknorm, qknorm, 24, out="in_place"), True),
        _mrope(_ragged("qknorm-mrope", test_qknorm, qknorm, 25, call={"status": _status()}), False),
        _layers(
            _ragged(
                "qknorm-fp8-layers",
                test_qknorm,
                qknorm,
                26,
                cache_dtype=E4M3,
                call={"kv_scale": 0.5},
            ),
            4,
            3,
        ),
        _layers(_ragged("qkv-decode-layers", test_qkv, qkv, 27, lengths=(1, 1)), 2, 0),
        # decode-sized (the fused kernel; a CUDA graph can hold it, cuBLAS's temporaries not)
        _ragged(
            "qkv-options-given",
            test_qkv,
            qkv,
            39,
            out="given",
            lengths=(1, 1),
            call={"clear_unused_last_page_rows": True, "status": _status()},
        ),
        # issue 14's fp8 queries (static and dynamic scales), per-token-head KV scales (fp8 and
        # int8 caches) and the paged ops' device-side status
        _quant_contiguous("contiguous-q-out", 28, q_mode="copy"),
        _contiguous(
            "contiguous-fp8-float-kv-scale-pair",
            38,
            D=32,
            R=16,
            cache_dtype=E4M3,
            kv_scale=(0.5, 2.0),
        ),
        _quant_contiguous(
            "contiguous-fp8-q-dynamic-int8-kv-scales", 29, q_mode="dynamic e4m3", kv_dtype=INT8
        ),
        _quant_contiguous(
            "contiguous-fp8-q-static-kv-scales-k-in-place",
            30,
            q_mode="static e5m2",
            kv_dtype=E4M3,
            write_k_in_place=True,
        ),
        _computed_scales(
            _paged("paged-fp8-computed-scales-status", 31, quant, Dn=16),
            q_scale_out=True,
            kv_cache_scales=True,
            status=True,
        ),
        _computed_scales(
            _paged(
                "paged-fp8-q-dynamic-given",
                32,
                quant,
                Dn=16,
                per_head=True,
                q_rope_out=True,
                q_nope_out=True,
            ),
            q_scale_out=True,
        ),
        _computed_scales(
            _paged(
                "paged-int8-kv-scales-hnd-given",
                33,
                plain,
                cache_dtype=INT8,
                kv_layout="HND",
                q_rope_out=True,
            ),
            kv_cache_scales=True,
            status=True,
        ),
        _computed_scales(
            _ragged(
                "qknorm-fp8-q-dynamic-kv-scales",
                test_qknorm,
                qknorm,
                34,
                cache_dtype=E4M3,
                call={"q_out_dtype": "float8_e4m3fn"},
            ),
            q_scale_out=True,
            kv_cache_scales=True,
            status=True,
        ),
        _computed_scales(
            _ragged(
                "qknorm-int8-kv-scales-in-place",
                test_qknorm,
                qknorm,
                37,
                out="in_place",
                cache_dtype=INT8,
            ),
            kv_cache_scales=True,
        ),
        _with_q_out(
            _ragged("qknorm-fp8-q-static-given", test_qknorm, qknorm, 35, cache_dtype=E4M3),
            E5M2,
            q_scale=2.0,
            kv_scale=0.5,
        ),
        _layers(
            _computed_scales(
                _ragged(
                    "qknorm-kv-scales-layers",
                    test_qknorm,
                    qknorm,
                    36,
                    cache_dtype=E4M3,
                    layout="HND",
                ),
                kv_cache_scales=True,
            ),
            3,
            2,
        ),
    ]
