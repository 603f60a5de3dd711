"""``ropekv.checkpoints``: GPTQ, AWQ and compressed-tensors layers repacked for
``fused_qkv_matmul_append_paged_kv_cache``. Each format's tensors are built by the format's own
packing code where a package provides it (compressed-tensors) and by the packers below from the
documented bit layouts otherwise (each checked on a hand-worked example). The repacked weights must
dequantize exactly to the format's own formula, and the op (NumPy backend) must give exactly the
reference's result on those dequantized weights. GPU: the same imports from CuPy arrays and torch
CUDA tensors, byte for byte, and the kernels on them against the reference."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

import ropekv
from ropekv import checkpoints, reference
from tests.test_qkv import check_results, expected, make_case, rounded_weights, taken_path
from tests.tolerance import to_device, to_numpy

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
SHAPE = {"K": 256, "Hq": 4, "Hkv": 2, "D": 16}  # N = (4 + 2 * 2) * 16 = 128
N_SMALL = 128


# ---- packers from the documented layouts ---------------------------------------------------------


def pack_along_k(q):
    """GPTQ ``qweight``: ``(K, N)`` nibbles -> ``(K/8, N)`` int32, nibble j (bits 4j..) of word
    ``[i, n]`` holding ``q[8i + j, n]``."""
    K, N = q.shape
    q = np.asarray(q, np.uint32).reshape(K // 8, 8, N)
    return sum(q[:, j] << (4 * j) for j in range(8)).astype(np.uint32).view(np.int32)


def pack_along_n(z, order=tuple(range(8))):
    """GPTQ ``qzeros`` (``order`` 0..7) and AWQ ``qweight`` / ``qzeros`` (AWQ_ORDER): ``(R, N)``
    nibbles -> ``(R, N/8)`` int32, nibble i of word ``[r, c]`` holding ``z[r, 8c + order[i]]``."""
    R, N = z.shape
    z = np.asarray(z, np.uint32).reshape(R, N // 8, 8)
    return sum(z[:, :, order[i]] << (4 * i) for i in range(8)).astype(np.uint32).view(np.int32)


def test_packers_on_hand_worked_examples():
    q = np.zeros((16, 2), np.int64)
    q[:8, 0] = range(8)  # column 0, k = 0..7: nibbles 0..7
    q[8:, 1] = [1, 2, 3, 4, 5, 6, 7, 15]  # column 1, k = 8..15; the top nibble sets the sign
    packed = pack_along_k(q)
    assert packed.dtype == np.int32 and packed.shape == (2, 2)
    assert packed.view(np.uint32).tolist() == [[0x76543210, 0], [0, 0xF7654321]]
    z = np.array([list(range(8)) + [9] * 8])
    assert pack_along_n(z).view(np.uint32).tolist() == [[0x76543210, 0x99999999]]
    # AWQ: columns 0..7 holding 0..7, interleaved as nibbles 0, 2, 4, 6, 1, 3, 5, 7
    assert pack_along_n(z[:, :8], AWQ_ORDER).view(np.uint32).tolist() == [[0x75316420]]


# ---- checkpoints ---------------------------------------------------------------------------------


def scales_for(rng, shape, K, dtype=F16):
    return (rng.uniform(0.5, 1.5, shape) / (4.6 * math.sqrt(K))).astype(dtype)


def grouped(a, g):
    """``(K/g, N)`` per-group values repeated to ``(K, N)`` float64."""
    return np.repeat(np.asarray(a, np.float64), g, axis=0)


def gptq_case(seed, K, N, g, sym, fmt="gptq", scale_dtype=F16):
    """``(qweight, qzeros, scales)`` of a GPTQ layer and its weight ``W (N, K)`` float64 by GPTQ's
    formula. v1 (``"gptq"``) stores ``z - 1`` in 4 bits (a zero of 0 wraps to 15), v2 ``z``."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (K, N))
    z = np.full((K // g, N), 8) if sym else rng.integers(0, 16, (K // g, N))
    if not sym:
        z[0, :3] = [0, 15, 1]  # the v1 wrap (0 stored as 15) and the extremes
    stored = (z - 1) & 0xF if fmt == "gptq" else z
    s = scales_for(rng, (K // g, N), K, scale_dtype)
    W = ((q - grouped(z, g)) * grouped(s, g)).T
    return (pack_along_k(q), pack_along_n(stored), s), W


def awq_case(seed, K, N, g, scale_dtype=F16):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (K, N))
    z = rng.integers(0, 16, (K // g, N))
    s = scales_for(rng, (K // g, N), K, scale_dtype)
    W = ((q - grouped(z, g)) * grouped(s, g)).T
    return (pack_along_n(q, AWQ_ORDER), pack_along_n(z, AWQ_ORDER), s), W


def ct_int4_case(seed, K, N, g, sym, dtype=F16):
    """A compressed-tensors pack-quantized layer made by the library itself (``g=None``: the
    channel strategy): ``(compressed state dict, W float64 by the formula, the library's own
    decompressed weight)`` as NumPy arrays."""
    pytest.importorskip(
        "compressed_tensors", reason="the compressed-tensors checks need compressed-tensors"
    )
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    tdtype = {F16: torch.float16, BF16: torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(seed)
    W = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(tdtype)
    strategy = "channel" if g is None else "group"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy=strategy, group_size=g)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    Wg = W.reshape(N, 1 if g is None else K // g, -1)
    s, zp = calculate_qparams(Wg.amin(-1), Wg.amax(-1), args)
    q = quantize(x=W, scale=s, zero_point=zp, args=args, dtype=torch.int8)
    state = PackedQuantizationCompressor.compress(
        {"weight": W, "weight_scale": s, "weight_zero_point": zp}, scheme
    )
    decompressed = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    G = K if g is None else g
    formula = (q.numpy().astype(np.float64) - np.repeat(to_numpy(zp).astype(np.float64), G, 1)) * (
        np.repeat(to_numpy(s).astype(np.float64), G, 1)
    )
    return (
        {n: to_numpy(t) for n, t in state.items()},
        formula,
        to_numpy(decompressed),
        to_numpy(zp),
    )


def ct_fp8_case(seed, K, N, strategy):
    pytest.importorskip(
        "compressed_tensors", reason="the compressed-tensors checks need compressed-tensors"
    )
    import torch
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    gen = torch.Generator().manual_seed(seed)
    W = (torch.randn(N, K, generator=gen) / math.sqrt(K)).half()
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if strategy == "channel":
        mn, mx = W.amin(-1, keepdim=True), W.amax(-1, keepdim=True)
    else:
        mn, mx = W.amin().reshape(1), W.amax().reshape(1)
    s, zp = calculate_qparams(mn, mx, args)
    state = FloatQuantizationCompressor.compress(
        {"weight": W, "weight_scale": s, "weight_zero_point": zp}, scheme
    )
    decompressed = FloatQuantizationCompressor.decompress(state, scheme)["weight"]
    w8, scale = to_numpy(state["weight"]), to_numpy(state["weight_scale"])
    formula = w8.astype(np.float64) * np.asarray(scale, np.float64).reshape(-1, 1)
    return {n: to_numpy(t) for n, t in state.items()}, formula, to_numpy(decompressed)


def dequantized(w):
    """ropekv's reference dequantization of a QkvWeights (float64 ``(N, K)``)."""
    return reference.dequantize_weight(
        to_numpy(w.weight),
        to_numpy(w.weight_scales),
        w.group_size,
        None if w.zero_points is None else to_numpy(w.zero_points),
    )


def assert_layout(w, N, K, G, dtype, zero_points):
    weight, scales = to_numpy(w.weight), to_numpy(w.weight_scales)
    assert weight.dtype == np.uint8 and weight.shape == (N, K // 2)
    assert weight.flags.c_contiguous and scales.flags.c_contiguous
    assert scales.dtype == dtype and scales.shape == (N, K // G)
    assert w.group_size == G
    if zero_points:
        zp = to_numpy(w.zero_points)
        assert zp.dtype == np.uint8 and zp.shape == (N, K // G) and zp.flags.c_contiguous
        assert zp.max() <= 15
    else:
        assert w.zero_points is None


def check_op(w, W, dtype, seed=3, lengths=(3, 1, 0, 2)):
    """The op (NumPy backend) on the repacked weights against the reference on ``W`` (float64
    dequantized weights, no scales): q and both caches byte for byte."""
    args, kw = make_case(seed, lengths=lengths, dtype=dtype, **SHAPE)
    q_ref, k_ref, v_ref = expected({**args, "weight": W}, kw)
    caches = tuple(c.copy() for c in args["paged_kv_cache"])
    q = ropekv.fused_qkv_matmul_append_paged_kv_cache(
        **{**args, "weight": w.weight, "paged_kv_cache": caches}, **kw, **w.kwargs()
    )
    for got, ref, what in ((q, q_ref, "q"), *zip(caches, (k_ref, v_ref), ("k cache", "v cache"))):
        got = to_numpy(got)
        assert got.dtype == ref.dtype, what
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8), err_msg=what)


# ---- GPTQ ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq(g, sym, fmt):
    K, N = SHAPE["K"], N_SMALL
    (qweight, qzeros, scales), W = gptq_case(g + sym, K, N, g, sym, fmt)
    w = ropekv.import_gptq(qweight, qzeros, scales, checkpoint_format=fmt)
    assert_layout(w, N, K, g, F16, zero_points=not sym)
    np.testing.assert_array_equal(dequantized(w), W)
    if not sym:  # the v1 wrap: a zero of 0, stored as 15 (0 - 1 in 4 bits), reads back as 0
        assert w.zero_points[:3, 0].tolist() == [0, 15, 1]
    check_op(w, W, F16)
    # the checkpoint's own group_size and g_idx (no act-order) give the same
    same = ropekv.import_gptq(
        qweight, qzeros, scales, checkpoint_format=fmt, group_size=g, g_idx=np.arange(K) // g
    )
    for a, b in zip(w, same):
        np.testing.assert_array_equal(a, b)


def test_gptq_symmetric_without_qzeros_and_per_channel():
    K, N = SHAPE["K"], N_SMALL
    (qweight, qzeros, scales), W = gptq_case(7, K, N, K, True)
    for w in (
        ropekv.import_gptq(qweight, None, scales),
        ropekv.import_gptq(qweight, qzeros, scales, group_size=-1),
    ):
        assert_layout(w, N, K, K, F16, zero_points=False)
        np.testing.assert_array_equal(dequantized(w), W)


def test_gptq_scales_rounded_to_dtype():
    """float32 or bfloat16 calls: the scales are rounded once to the input dtype."""
    K, N, g = SHAPE["K"], N_SMALL, 64
    (qweight, qzeros, scales), _ = gptq_case(11, K, N, g, False, scale_dtype=F32)
    w = ropekv.import_gptq(qweight, qzeros, scales, dtype="bfloat16")
    assert_layout(w, N, K, g, BF16, zero_points=True)
    np.testing.assert_array_equal(to_numpy(w.weight_scales), scales.T.astype(BF16))
    (qweight, qzeros, s16), _ = gptq_case(11, K, N, g, False)
    w = ropekv.import_gptq(qweight, qzeros, s16, dtype=BF16)
    np.testing.assert_array_equal(to_numpy(w.weight_scales), s16.T.astype(BF16))
    q = (np.asarray(qweight.view(np.uint32))[:, None, :] >> (4 * np.arange(8))[None, :, None]) & 15
    q = q.reshape(K, N)
    z = (((qzeros.view(np.uint32)[:, :, None] >> (4 * np.arange(8))) & 15).reshape(-1, N) + 1) & 15
    W = ((q - grouped(z, g)) * grouped(s16.astype(BF16), g)).T
    np.testing.assert_array_equal(dequantized(w), W)
    check_op(w, W, BF16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # casts of inf and NaN
def test_bfloat16_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    f = np.concatenate(
        [
            np.arange(1 << 16, dtype=np.uint16).view(F16).astype(F32),  # every float16
            rng.standard_normal(4096).astype(F32),
            ((np.arange(4096, dtype=np.uint32) << 16) + 0x3F008000).view(F32),  # ties
            np.array([np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 0.0, -0.0], F32),
        ]
    )
    got = checkpoints._round_scales(f, BF16, np)
    want = f.astype(BF16)
    nan = np.isnan(want.astype(F32))
    assert np.array_equal(np.isnan(got.astype(F32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    np.testing.assert_array_equal(
        checkpoints._round_scales(f.astype(BF16), F16, np), f.astype(BF16).astype(F16)
    )


def test_gptq_act_order_refused():
    K, N, g = SHAPE["K"], N_SMALL, 64
    (qweight, qzeros, scales), _ = gptq_case(5, K, N, g, False)
    with pytest.raises(ValueError, match="act-order"):
        ropekv.import_gptq(qweight, qzeros, scales, desc_act=True)
    g_idx = (np.arange(K) // g)[np.random.default_rng(0).permutation(K)]
    with pytest.raises(ValueError, match="act-order"):
        ropekv.import_gptq(qweight, qzeros, scales, g_idx=g_idx.astype(np.int32))


# ---- AWQ -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", [32, 64, 128])
def test_awq(g):
    K, N = SHAPE["K"], N_SMALL
    (qweight, qzeros, scales), W = awq_case(g, K, N, g)
    w = ropekv.import_awq(qweight, qzeros, scales)
    assert_layout(w, N, K, g, F16, zero_points=True)
    np.testing.assert_array_equal(dequantized(w), W)
    check_op(w, W, F16)


def test_awq_is_not_gptq_order():
    """A column-ordered (GPTQ-style) word read as AWQ lands its values in the wrong columns."""
    z = np.arange(8)[None, :].repeat(64, 0)
    s = np.ones((1, 8), F16)
    w = ropekv.import_awq(pack_along_n(z), pack_along_n(z[:1]), s)
    col = to_numpy(w.weight)[:, 0] & 0xF  # k = 0 of each n
    assert col.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    w = ropekv.import_awq(pack_along_n(z, AWQ_ORDER), pack_along_n(z[:1], AWQ_ORDER), s)
    assert (to_numpy(w.weight)[:, 0] & 0xF).tolist() == list(range(8))


# ---- compressed-tensors ----------------------------------------------------------------------------


@pytest.mark.parametrize("g", [32, 64, 128, None])
@pytest.mark.parametrize("sym", [True, False])
def test_pack_quantized(g, sym):
    K, N = SHAPE["K"], N_SMALL
    state, W, decompressed, zp = ct_int4_case(g or 1, K, N, g, sym)
    if sym:
        assert "weight_zero_point" not in state
    w = ropekv.import_pack_quantized(
        state["weight_packed"],
        state["weight_scale"],
        state["weight_shape"],
        state.get("weight_zero_point"),
    )
    G = g or K
    assert_layout(w, N, K, G, F16, zero_points=not sym and bool((zp != 0).any()))
    np.testing.assert_array_equal(dequantized(w), W)
    # the library's own dequantization rounds (q - zp) * s to the scale dtype once
    np.testing.assert_array_equal(dequantized(w).astype(F16), decompressed)
    check_op(w, W, F16)
    if not sym:  # unpacked int8 zero points (the values before packing) give the same
        same = ropekv.import_pack_quantized(
            state["weight_packed"], state["weight_scale"], None, zp.astype(np.int8), group_size=G
        )
        np.testing.assert_array_equal(dequantized(same), W)


def test_pack_quantized_bfloat16():
    K, N = SHAPE["K"], N_SMALL
    state, W, decompressed, _ = ct_int4_case(4, K, N, 64, False, dtype=BF16)
    w = ropekv.import_pack_quantized(
        state["weight_packed"], state["weight_scale"], None, state["weight_zero_point"]
    )
    assert_layout(w, N, K, 64, BF16, zero_points=True)
    np.testing.assert_array_equal(dequantized(w), W)
    np.testing.assert_array_equal(dequantized(w).astype(BF16), decompressed)
    check_op(w, W, BF16)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_float_quantized(strategy):
    K, N = SHAPE["K"], N_SMALL
    state, W, decompressed = ct_fp8_case(9, K, N, strategy)
    w = ropekv.import_float_quantized(state["weight"], state["weight_scale"])
    assert w.weight is state["weight"] and w.group_size is None and w.zero_points is None
    scales = to_numpy(w.weight_scales)
    assert scales.dtype == F32 and scales.shape == (N,)
    np.testing.assert_array_equal(dequantized(w), W)
    np.testing.assert_array_equal(dequantized(w).astype(F16), decompressed)
    check_op(w, W, F16)


# ---- torch (CPU) -----------------------------------------------------------------------------------


def torch_of(x, device="cpu"):
    """A torch tensor of NumPy ``x`` (bfloat16 / float8 through their bits)."""
    import torch

    names = {BF16: (np.int16, torch.bfloat16), E4M3: (np.uint8, torch.float8_e4m3fn)}
    if x.dtype in names:
        bits, dtype = names[x.dtype]
        return torch.from_numpy(np.ascontiguousarray(x).view(bits)).to(device).view(dtype)
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def numpy_and_torch_cases():
    """(name, function, NumPy arguments, keywords) of every import."""
    K, N = SHAPE["K"], N_SMALL
    (gw, gz, gs), _ = gptq_case(1, K, N, 64, False)
    (aw, az, a_s), _ = awq_case(2, K, N, 32)
    yield "gptq", ropekv.import_gptq, (gw, gz, gs), {}
    yield "gptq-bf16", ropekv.import_gptq, (gw, gz, gs), {"dtype": "bfloat16"}
    yield "gptq-sym", ropekv.import_gptq, (gw, None, gs), {"g_idx": np.arange(K) // 64}
    yield "awq", ropekv.import_awq, (aw, az, a_s), {}
    rng = np.random.default_rng(3)
    packed = rng.integers(-(1 << 31), 1 << 31, (N, K // 8)).astype(np.int32)
    zp = rng.integers(-(1 << 31), 1 << 31, (N // 8, K // 32)).astype(np.int32)
    s = scales_for(rng, (N, K // 32), K, BF16)
    yield "pack-quantized", ropekv.import_pack_quantized, (packed, s, None, zp), {}
    w8 = rng.standard_normal((N, K)).astype(E4M3)
    yield "float-quantized", ropekv.import_float_quantized, (w8, s[:, :1].copy()), {}


@pytest.mark.parametrize("case", list(numpy_and_torch_cases()), ids=lambda c: c[0])
def test_torch_cpu_tensors_give_the_numpy_result(case):
    torch = pytest.importorskip("torch", reason="the torch checks need torch")
    _, fn, arrays, kw = case
    host = fn(*arrays, **kw)
    tw = fn(*(None if a is None else torch_of(a) for a in arrays), **kw)
    for a, b in zip(host, tw):
        if a is None or isinstance(a, int):
            assert a == b
            continue
        assert isinstance(b, torch.Tensor) and b.device.type == "cpu"
        got = to_numpy(b)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(a).view(np.uint8))


def test_torch_cpu_tensors_run_the_op():
    """Torch CPU tensors in, torch tensors out, through the op's DLPack intake."""
    torch = pytest.importorskip("torch", reason="the torch checks need torch")
    K, N, g = SHAPE["K"], N_SMALL, 32
    (qweight, qzeros, scales), W = gptq_case(8, K, N, g, False)
    w = ropekv.import_gptq(torch_of(qweight), torch_of(qzeros), torch_of(scales))
    assert all(isinstance(a, torch.Tensor) for a in (w.weight, w.weight_scales, w.zero_points))
    check_op(w, W, F16)


# ---- stacking projections --------------------------------------------------------------------------


def test_concat_qkv_weights_equals_the_fused_import():
    K, g = SHAPE["K"], 64
    rows = (64, 32, 32)  # q, k, v
    (qweight, qzeros, scales), _ = gptq_case(12, K, sum(rows), g, False)
    fused = ropekv.import_gptq(qweight, qzeros, scales)
    cuts = np.cumsum((0, *rows))
    parts = [
        ropekv.import_gptq(qweight[:, a:b], qzeros[:, a // 8 : b // 8], scales[:, a:b])
        for a, b in itertools.pairwise(cuts)
    ]
    stacked = ropekv.concat_qkv_weights(*parts)
    for a, b in zip(fused, stacked):
        np.testing.assert_array_equal(a, b)
    # a symmetric part (no zero points) stacks with zeros of 8
    (sw, _, ss), Ws = gptq_case(13, K, 32, g, True)
    mixed = ropekv.concat_qkv_weights(parts[0], ropekv.import_gptq(sw, None, ss), parts[2])
    assert to_numpy(mixed.zero_points)[64:96].tolist() == [[8] * (K // g)] * 32
    np.testing.assert_array_equal(dequantized(mixed)[64:96], Ws)


def test_concat_qkv_weights_fp8_per_tensor_scales_become_rows():
    K = SHAPE["K"]
    rows, parts, Ws = (64, 32, 32), [], []
    for i, n in enumerate(rows):
        state, W, _ = ct_fp8_case(20 + i, K, n, "tensor")
        parts.append(ropekv.import_float_quantized(state["weight"], state["weight_scale"]))
        Ws.append(W)
    w = ropekv.concat_qkv_weights(*parts)
    assert to_numpy(w.weight).dtype == E4M3 and to_numpy(w.weight_scales).shape == (128,)
    W = np.concatenate(Ws)
    np.testing.assert_array_equal(dequantized(w), W)
    check_op(w, W, F16)


# ---- validation ------------------------------------------------------------------------------------


def _gptq():
    (qweight, qzeros, scales), _ = gptq_case(0, 64, 16, 32, False)
    return qweight, qzeros, scales


def _awq():
    (qweight, qzeros, scales), _ = awq_case(0, 64, 16, 32)
    return qweight, qzeros, scales


def _ct():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 1 << 30, (16, 8)).astype(np.int32)
    return packed, np.ones((16, 2), F16)


def _fp8():
    return ropekv.import_float_quantized(np.ones((8, 16), E4M3), np.ones((), F32))


REJECTS = [
    (lambda: ropekv.import_gptq(_gptq()[0].astype(np.int64), *_gptq()[1:]), TypeError, "qweight"),
    (lambda: ropekv.import_gptq(*_gptq()[:2], _gptq()[2].astype(np.int32)), TypeError, "scales"),
    (lambda: ropekv.import_gptq(*_gptq()[:2], _gptq()[2].astype(F32)), TypeError, "dtype="),
    (lambda: ropekv.import_gptq(*_gptq(), dtype="float32"), TypeError, "dtype must be"),
    (lambda: ropekv.import_gptq(_gptq()[0], _gptq()[1].view(F32), _gptq()[2]), TypeError, "qzeros"),
    (lambda: ropekv.import_gptq(_gptq()[0].tolist(), *_gptq()[1:]), TypeError, "NumPy or CuPy"),
    (lambda: ropekv.import_gptq(*_gptq(), desc_act=True), ValueError, "act-order"),
    (lambda: ropekv.import_gptq(*_gptq(), g_idx=np.arange(64) % 2), ValueError, "act-order"),
    (lambda: ropekv.import_gptq(*_gptq(), g_idx=np.arange(32) // 32), ValueError, "g_idx"),
    (lambda: ropekv.import_gptq(*_gptq(), group_size=24), ValueError, "divide K"),
    (lambda: ropekv.import_gptq(*_gptq(), group_size=16), ValueError, "groups"),
    (lambda: ropekv.import_gptq(*_gptq(), group_size=0), ValueError, "positive"),
    (lambda: ropekv.import_gptq(*_gptq(), checkpoint_format="v3"), ValueError, "checkpoint"),
    (lambda: ropekv.import_gptq(*_gptq()[:2], _gptq()[2][:, :8]), ValueError, "scales"),
    (lambda: ropekv.import_gptq(*_gptq()[:2], _gptq()[2][:, :, None]), ValueError, "scales"),
    (lambda: ropekv.import_gptq(_gptq()[0], _gptq()[1][:1], _gptq()[2]), ValueError, "qzeros"),
    (
        lambda: ropekv.import_gptq(*_gptq()[:2], np.concatenate([_gptq()[2]] * 2)[:3]),
        ValueError,
        "groups",
    ),
    (  # K = 24 in 8 groups: groups of 3 columns, odd
        lambda: ropekv.import_gptq(np.zeros((3, 16), np.int32), None, np.ones((8, 16), F16)),
        ValueError,
        "even group_size",
    ),
    (lambda: ropekv.import_awq(*_awq()[:2], _awq()[2][:, :8]), ValueError, "scales"),
    (lambda: ropekv.import_awq(_awq()[0], _awq()[1][:, :1], _awq()[2]), ValueError, "qzeros"),
    (lambda: ropekv.import_awq(_awq()[0], _awq()[1].view(F32), _awq()[2]), TypeError, "qzeros"),
    (lambda: ropekv.import_pack_quantized(*_ct(), (16, 40)), ValueError, "weight_packed"),
    (lambda: ropekv.import_pack_quantized(*_ct(), (16, 63)), ValueError, "even K"),
    (lambda: ropekv.import_pack_quantized(*_ct(), (16, 64, 1)), ValueError, "weight_shape"),
    (lambda: ropekv.import_pack_quantized(_ct()[0].view(F32), _ct()[1]), TypeError, "packed"),
    (
        lambda: ropekv.import_pack_quantized(*_ct(), None, np.zeros((16, 2), F16)),
        TypeError,
        "weight_zero_point",
    ),
    (
        lambda: ropekv.import_pack_quantized(*_ct(), None, np.full((16, 2), 8, np.int8)),
        ValueError,
        r"\[-8, 7\]",
    ),
    (
        lambda: ropekv.import_pack_quantized(*_ct(), None, np.zeros((16, 2), np.int32)),
        ValueError,
        "weight_zero_point",
    ),
    (
        lambda: ropekv.import_pack_quantized(*_ct(), weight_g_idx=np.arange(64) % 2),
        ValueError,
        "act-order",
    ),
    (
        lambda: ropekv.import_float_quantized(np.ones((8, 16), ml_dtypes.float8_e5m2), np.ones(1)),
        TypeError,
        "float8_e4m3fn",
    ),
    (
        lambda: ropekv.import_float_quantized(np.ones((8, 16), E4M3), np.ones(1, np.int32)),
        TypeError,
        "weight_scale",
    ),
    (  # block scales (128 x 128 blocks in real checkpoints)
        lambda: ropekv.import_float_quantized(np.ones((8, 16), E4M3), np.ones((2, 2), F32)),
        ValueError,
        "one scale a row",
    ),
    (lambda: ropekv.import_float_quantized(np.ones(16, E4M3), np.ones(1, F32)), ValueError, "N, K"),
    (lambda: ropekv.concat_qkv_weights(), ValueError, "at least one"),
    (lambda: ropekv.concat_qkv_weights(_fp8(), (1, 2)), TypeError, "QkvWeights"),
    (
        lambda: ropekv.concat_qkv_weights(
            ropekv.import_gptq(*_gptq()), ropekv.import_gptq(*_gptq(), dtype="bfloat16")
        ),
        TypeError,
        "dtype",
    ),
    (
        lambda: ropekv.concat_qkv_weights(
            ropekv.import_gptq(*_gptq()), ropekv.import_gptq(_gptq()[0], None, _gptq()[2][:1])
        ),
        ValueError,
        "does not stack",
    ),
]


@pytest.mark.parametrize("fn, exc, match", REJECTS)
def test_rejects(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


# ---- GPU -------------------------------------------------------------------------------------------

LLAMA = {"K": 4096, "Hq": 32, "Hkv": 8, "D": 128, "R": 128, "P": 4096, "page_size": 16}
LLAMA_N = (32 + 2 * 8) * 128


def gpu_case(fmt, dtype):
    """(function, NumPy arguments, keywords) of a Llama-3-8B sized projection in ``fmt``."""
    K, N = LLAMA["K"], LLAMA_N
    if fmt in ("gptq", "gptq-sym"):
        (qweight, qzeros, scales), _ = gptq_case(30, K, N, 128, fmt == "gptq-sym")
        return ropekv.import_gptq, (qweight, qzeros, scales), {"dtype": dtype}
    if fmt == "awq":
        return ropekv.import_awq, awq_case(31, K, N, 128)[0], {"dtype": dtype}
    if fmt in ("ct-int4", "ct-int4-sym"):
        state, _, _, _ = ct_int4_case(32, K, N, 128, fmt == "ct-int4-sym")
        zp = state.get("weight_zero_point")
        args = (state["weight_packed"], state["weight_scale"], state["weight_shape"], zp)
        return ropekv.import_pack_quantized, args, {"dtype": dtype}
    state, _, _ = ct_fp8_case(33, K, N, "channel")
    return ropekv.import_float_quantized, (state["weight"], state["weight_scale"]), {}


def on_device(x, kind):
    if x is None:
        return None
    if kind == "cupy":
        return to_device(x)
    return torch_of(x, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize(
    "fmt, dtype",
    [
        ("gptq", F16),
        ("gptq", BF16),
        ("gptq-sym", F16),
        ("awq", F16),
        ("ct-int4", F16),
        ("ct-int4-sym", BF16),
        ("ct-fp8", F16),
    ],
)
def test_gpu_imports_match_the_host_and_run_the_kernels(kind, fmt, dtype):
    """Device arrays are repacked on their device to the bytes of the NumPy import; the op's
    kernels (decode, tensor-core and cuBLAS paths by token count) on them agree with the
    reference as in test_qkv."""
    if kind == "torch":
        torch = pytest.importorskip("torch", reason="the torch checks need torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
    fn, arrays, kw = gpu_case(fmt, dtype)
    host = fn(*arrays, **kw)
    dev = fn(*(on_device(a, kind) for a in arrays), **kw)
    for name, a, b in zip(host._fields, host, dev):
        if a is None or isinstance(a, int):
            assert a == b, name
            continue
        if kind == "cupy":
            import cupy as cp

            assert isinstance(b, cp.ndarray), name
        else:
            assert isinstance(b, torch.Tensor) and b.is_cuda, name
        got = to_numpy(b)
        assert got.dtype == to_numpy(a).dtype and got.shape == tuple(a.shape), name
        np.testing.assert_array_equal(
            np.ascontiguousarray(got).view(np.uint8),
            np.ascontiguousarray(to_numpy(a)).view(np.uint8),
            err_msg=name,
        )
    for lengths in ((1,), (1,) * 16, (40, 0, 89)):
        args, ckw = make_case(
            34,
            lengths=lengths,
            dtype=dtype,
            cached=[100 + 37 * i for i in range(len(lengths))],
            **LLAMA,
        )
        args = {**args, "weight": to_numpy(host.weight)}
        ckw = {
            **ckw,
            **{
                n: to_numpy(a) if a is not None and not isinstance(a, int) else a
                for n, a in host.kwargs().items()
            },
        }
        ckw = {n: a for n, a in ckw.items() if a is not None}
        taken = taken_path(args, ckw)
        rounded = taken == "cublas" or (taken in ("mma", "tiled", "lean_mma") and fmt != "ct-fp8")
        refs = expected(*rounded_weights(args, ckw)) if rounded else expected(args, ckw)
        originals = [c.copy() for c in args["paged_kv_cache"]]
        dargs = {n: to_device(x) for n, x in args.items() if n != "weight"}
        dkw = {n: to_device(x) for n, x in ckw.items() if n not in dev.kwargs()}
        q = ropekv.fused_qkv_matmul_append_paged_kv_cache(
            **dargs, weight=dev.weight, **dkw, **dev.kwargs()
        )
        check_results(args, ckw, q, dargs["paged_kv_cache"], originals, refs)
