"""One small call of every op and variant, as NumPy keyword arguments, shared by the framework
tests (tests/test_torch_ops.py, tests/test_jax_ops.py). Built from the op tests' own case
builders, so caches start as random bytes (stray writes show) and index arrays are ragged."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tests import test_contiguous, test_mla, test_paged, test_qknorm, test_qkv

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

# the arguments each op writes (besides the arrays it returns)
WRITES = {
    "apply_rope_write_kv": ("q", "kv_cache"),
    "rope_quantize_fp8_append_paged_kv_cache": ("paged_kv_cache",),
    "rope_append_paged_kv_cache": ("paged_kv_cache",),
    "mla_rope_rmsnorm_append_paged_kv_cache": ("kv_cache",),
    "qk_rmsnorm_rope_append_paged_kv_cache": ("paged_kv_cache",),
    "fused_qkv_matmul_append_paged_kv_cache": ("paged_kv_cache",),
}
OUTPUT_ARGS = ("q_rope_out", "q_nope_out", "q_out", "out")
# written when given (the ops that validate their offsets on the device), after the caches
STATUS = "status"


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
                out[n] = tuple(convert(np.array(y)) if isinstance(y, np.ndarray) else y
                               for y in x)
            elif isinstance(x, np.ndarray):
                out[n] = convert(np.array(x))
            else:
                out[n] = x
        if self.in_place:
            out[self.in_place[0]] = out[self.in_place[1]]
        return out

    def written(self, kwargs):
        """The arrays the call writes in ``kwargs`` (after the call), in a fixed order."""
        names = list(WRITES[self.op])
        if self.op == "apply_rope_write_kv" and kwargs.get("write_k_in_place"):
            names.append("k")
        if kwargs.get(STATUS) is not None:
            names.append(STATUS)
        names += [n for n in OUTPUT_ARGS if kwargs.get(n) is not None]
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
    call = {n: kw.pop(n) for n in ("write_k_in_place", "is_neox") if n in kw}
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
    out_name, q_name = {"mla": ("q_rope_out", "q_rope"), "qknorm": ("q_out", "q"),
                        "qkv": ("out", None)}[name.split("-")[0]]
    in_place = None
    if out == "given":
        like = args[q_name] if q_name else np.zeros((args["hidden_state"].shape[0],
                                                     args["num_q_heads"]
                                                     * args["paged_kv_cache"][0].shape[3]),
                                                    args["hidden_state"].dtype)
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

    case.kwargs[name] = (tuple(layered(c) for c in caches) if isinstance(caches, tuple)
                         else layered(caches))
    case.kwargs["layer_idx"] = layer
    return case


def _status():
    return np.full(1, 99, np.int32)  # not 0: the op must write it


def cases():
    """Every op with each of its registered forms (allocating, given outputs, in place)."""
    quant, plain = "rope_quantize_fp8_append_paged_kv_cache", "rope_append_paged_kv_cache"
    mla, qknorm = "mla_rope_rmsnorm_append_paged_kv_cache", "qk_rmsnorm_rope_append_paged_kv_cache"
    qkv = "fused_qkv_matmul_append_paged_kv_cache"
    return [
        _contiguous("contiguous-f16", 1, D=32, R=32),
        _contiguous("contiguous-fp8-positions", 2, D=32, R=16, cache_dtype=E4M3, pos=True),
        _contiguous("contiguous-bf16-k-in-place", 3, D=32, R=32, dtype=BF16,
                    write_k_in_place=True, is_neox=False),
        _paged("paged-fp8-gqa", 4, quant, Dn=16),
        _paged("paged-fp8-mla", 5, quant, mla=True, Dn=16),
        _paged("paged-fp8-given-q-rope-out", 6, quant, Dn=16, q_rope_out=True),
        _paged("paged-fp8-per-head-scales", 7, quant, per_head=True, q_rope_out=True,
               q_nope_out=True),
        _paged("paged-f16-hnd", 8, plain, Dn=16, cache_dtype=np.float16, kv_layout="HND"),
        _ragged("mla", test_mla, mla, 9),
        _ragged("mla-split-given", test_mla, mla, 10, out="given", split=True),
        _ragged("mla-fp8-in-place", test_mla, mla, 11, out="in_place", cache_dtype=E4M3,
                kv_scale=0.5),
        _ragged("qknorm", test_qknorm, qknorm, 12),
        _ragged("qknorm-hnd-given", test_qknorm, qknorm, 13, out="given", layout="HND"),
        _ragged("qknorm-fp8-in-place", test_qknorm, qknorm, 14, out="in_place",
                cache_dtype=E4M3, call={"kv_scale": (0.5, 2.0)}),
        _ragged("qkv-decode", test_qkv, qkv, 15, lengths=(1, 1)),
        _ragged("qkv-prefill-given", test_qkv, qkv, 16, out="given"),
        # issue 14's options (mRoPE, status, tail clearing, QK-norm variants) and multi-layer
        # caches (layer_idx)
        _mrope(_contiguous("contiguous-mrope", 17, D=32, R=32), False),
        _mrope(_contiguous("contiguous-fp8-mrope-interleaved", 18, D=32, R=32,
                           cache_dtype=E4M3), True),
        _mrope(_paged("paged-fp8-mrope-interleaved", 19, quant, Dn=16), True),
        _mrope(_paged("paged-f16-mrope-given", 20, plain, cache_dtype=np.float16,
                      q_rope_out=True), False),
        _ragged("mla-options", test_mla, mla, 21, out="given",
                call={"clear_unused_last_page_rows": True, "status": _status()}),
        _layers(_ragged("mla-split-layers", test_mla, mla, 22, split=True, cache_dtype=E4M3),
                3, 1),
        _ragged("qknorm-options-given", test_qknorm, qknorm, 23, out="given",
                call={"norm_order": "after_rope", "weight_offset": 1.0,
                      "clear_unused_last_page_rows": True, "status": _status()}),
        _mrope(_ragged("qknorm-mrope-in-place", test_qknorm, qknorm, 24, out="in_place"), True),
        _mrope(_ragged("qknorm-mrope", test_qknorm, qknorm, 25, call={"status": _status()}),
               False),
        _layers(_ragged("qknorm-fp8-layers", test_qknorm, qknorm, 26, cache_dtype=E4M3,
                        call={"kv_scale": 0.5}), 4, 3),
        _layers(_ragged("qkv-decode-layers", test_qkv, qkv, 27, lengths=(1, 1)), 2, 0),
    ]
