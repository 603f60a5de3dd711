"""``ropekv.jax``: jitted ops against the NumPy backend, donation without a cache copy, a
``jax.lax.scan`` over decode steps, and the errors under vmap / grad (CPU, in CI when JAX is
installed); the same on the GPU, where the donated cache must keep its address."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

# torch and CuPy tests share the GPU with this process: XLA takes memory as it needs it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")

import jax.numpy as jnp

import ropekv
import ropekv.jax as rj
from tests.framework_cases import E4M3, OUTPUT_ARGS, assert_result_close, cases
from tests.tolerance import assert_close

CASES = cases()
IDS = [c.name for c in CASES]


def on_host(x):
    return jax.device_put(x, jax.devices("cpu")[0])


def split(case, convert=on_host):
    """(arrays, statics): the case's keyword arguments for ``ropekv.jax`` (no output arguments
    but the contiguous op's ``q_out``, which is an input-output alias there; a given QK-norm
    ``q_out`` becomes its dtype, ``q_out_dtype``), arrays converted (on the host by default;
    traced under jit), everything else static."""
    arrays, statics = {}, {}
    for n, x in case.fresh().items():
        if n == "q_out" and case.op == "qk_rmsnorm_rope_append_paged_kv_cache":
            statics.setdefault("q_out_dtype", x.dtype)
            continue
        if n in OUTPUT_ARGS and not (n == "q_out" and case.op == "apply_rope_write_kv"):
            continue
        if isinstance(x, np.ndarray):
            arrays[n] = convert(x)
        elif isinstance(x, tuple) and x and isinstance(x[0], np.ndarray):
            arrays[n] = tuple(convert(y) for y in x)
        else:
            statics[n] = x
    return arrays, statics


def expected(case):
    """The eager NumPy results in the order ``ropekv.jax`` returns them (flattened): the
    returned arrays and the caches, not the caller's output arguments, which JAX has none of."""
    if case.op == "apply_rope_write_kv":  # (q or q_out, k?, kv_cache, q_scale_out?, scales?)
        a = case.fresh()
        ropekv.apply_rope_write_kv(**a)
        names = [
            "q_out" if a.get("q_out") is not None else "q",
            *(["k"] if a.get("write_k_in_place") else []),
            "kv_cache",
            "q_scale_out",
            "kv_cache_scales",
        ]
        return [a[n] for n in names if a.get(n) is not None]
    got = case.run(ropekv, case.fresh())
    given = sum(case.kwargs.get(n) is not None for n in OUTPUT_ARGS)
    return got[: len(got) - given]


def run_jitted(case, device=None, **jit):
    arrays, statics = split(case, lambda x: jax.device_put(x, device))
    fn = getattr(rj, case.op)
    return jax.tree_util.tree_leaves(jax.jit(lambda a: fn(**a, **statics), **jit)(arrays))


def assert_same(got, expected):
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        g = np.asarray(g)
        assert g.shape == e.shape and g.dtype == e.dtype, f"result {i}: {g.shape} {g.dtype}"
        assert np.array_equal(g.view(np.uint8), np.ascontiguousarray(e).view(np.uint8)), (
            f"result {i}: bytes differ"
        )


# ---- CPU -----------------------------------------------------------------------------------------

cpu = pytest.mark.skipif(not jax.devices("cpu"), reason="no JAX CPU device")


@cpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jitted_op_matches_the_numpy_backend(case):
    assert_same(run_jitted(case, jax.devices("cpu")[0]), expected(case))


@cpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_outside_jit_matches_the_numpy_backend(case):
    arrays, statics = split(case, lambda x: jax.device_put(x, jax.devices("cpu")[0]))
    got = jax.tree_util.tree_leaves(getattr(rj, case.op)(**arrays, **statics))
    assert_same(got, expected(case))


def paged_step(caches, q, k, v, table, pos, kv_indices, kv_indptr, batch):
    R = table.shape[1]
    q8, _, caches = rj.rope_quantize_fp8_append_paged_kv_cache(
        q[..., :R],
        k[..., :R],
        q[..., R:],
        k[..., R:],
        v,
        table,
        pos,
        caches,
        kv_indices,
        kv_indptr,
        batch,
        pos,
        page_size=caches[0].shape[1],
    )
    return caches, q8


def paged_arrays(case, device):
    a = case.fresh()
    q = np.concatenate([a["q_rope"], a["q_nope"]], -1)
    k = np.concatenate([a["k_rope"], a["k_nope"]], -1)
    put = functools.partial(jax.device_put, device=device)
    return (
        tuple(put(c) for c in a["paged_kv_cache"]),
        put(q),
        put(k),
        put(a["v"]),
        put(a["cos_sin_cache"]),
        put(a["pos_ids"]),
        put(a["kv_indices"]),
        put(a["kv_indptr"]),
        put(a["batch_indices"]),
    )


def host_copy(x):
    """A NumPy copy of ``x`` that leaves ``x`` donatable: the bytes go through a bitcast to
    unsigned integers, an XLA copy that NumPy then reads.

    JAX 0.11 (CPU backend) keeps the host view that ``np.asarray`` / ``np.array`` take of a
    bfloat16 or fp8 array for as long as the array lives, and then does not donate the array: the
    next donated call copies it into a new buffer and leaves the input alive (no ropekv op
    involved: ``jax.jit(lambda x: x.at[3].set(1), donate_argnums=0)`` on an fp8 array that NumPy
    has read shows it; JAX 0.10 donated it). Donation is a request that JAX honours when it can;
    what this file checks is that ropekv's op lets it, so the checks read donated caches this
    way."""
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    return np.asarray(jax.lax.bitcast_convert_type(x, bits)).view(x.dtype)


def check_donation_keeps_the_cache_buffer(device):
    case = next(c for c in CASES if c.name == "paged-fp8-gqa")
    caches, *rest = paged_arrays(case, device)
    # JAX on the host may borrow a NumPy array's memory, which XLA does not reuse: the addresses
    # are taken from the caches XLA owns (on the GPU, the device_put copies already are)
    caches = tuple(jnp.copy(c) for c in caches)
    pointers = [c.unsafe_buffer_pointer() for c in caches]
    step = jax.jit(paged_step, donate_argnums=0)
    expected_caches = tuple(np.array(c) for c in case.kwargs["paged_kv_cache"])
    for _ in range(3):
        caches, q8 = step(caches, *rest)
        jax.block_until_ready(caches)
        assert [c.unsafe_buffer_pointer() for c in caches] == pointers
        ref = dict(
            case.fresh(), paged_kv_cache=expected_caches, quant_scale_q=1.0, quant_scale_kv=1.0
        )  # paged_step's scales
        ref_q8, _ = ropekv.rope_quantize_fp8_append_paged_kv_cache(**ref)
        assert_close(q8, ref_q8, "q_rope_out")
        for got, want in zip(caches, expected_caches):
            assert_close(host_copy(got), want, "cache")
    # no copy of the cache anywhere in the compiled step
    hlo = step.lower(caches, *rest).compile().as_text()
    assert " copy(" not in hlo and "copy-start" not in hlo


@cpu
def test_donated_cache_is_updated_in_its_own_buffer():
    check_donation_keeps_the_cache_buffer(jax.devices("cpu")[0])


@cpu
def test_without_donation_the_input_cache_is_unchanged():
    case = next(c for c in CASES if c.name == "paged-fp8-gqa")
    caches, *rest = paged_arrays(case, jax.devices("cpu")[0])
    before = [np.array(c) for c in caches]
    new, _ = jax.jit(paged_step)(caches, *rest)
    for c, b in zip(caches, before):
        assert np.array_equal(np.asarray(c).view(np.uint8), b.view(np.uint8))
    assert not all(
        np.array_equal(np.asarray(n).view(np.uint8), b.view(np.uint8)) for n, b in zip(new, before)
    )
    # which costs XLA a copy of each cache (the donated step above has none)
    assert jax.jit(paged_step).lower(caches, *rest).compile().as_text().count(" copy(") >= 2


# ---- a jax.lax.scan over decode steps -----------------------------------------------------------


def decode_problem(seed=0, steps=8, B=3, Hq=4, Hkv=2, R=16, Dn=16, page_size=4):
    """``steps`` decode steps of B requests (one token each) over a shuffled paged fp8 cache: the
    per-step inputs stacked along a leading axis, and the NumPy arguments of step i."""
    rng = np.random.default_rng(seed)
    D = R + Dn
    prefix = rng.integers(0, 6, B)
    pages = -(-(prefix + steps) // page_size)
    num_pages = int(pages.sum()) + 2
    kv_indices = rng.permutation(num_pages)[: pages.sum()].astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    q = rng.standard_normal((steps, B, Hq, D)).astype(np.float16)
    k, v = (rng.standard_normal((steps, B, Hkv, D)).astype(np.float16) for _ in range(2))
    pos = (prefix[None, :] + np.arange(steps)[:, None]).astype(np.int32)
    caches = tuple(
        (rng.standard_normal((num_pages, page_size, Hkv, D)) * 0.5).astype(E4M3) for _ in range(2)
    )
    table = ropekv.cos_sin_cache(int(pos.max()) + 4, R)
    batch = np.arange(B, dtype=np.int32)
    return {
        "q": q,
        "k": k,
        "v": v,
        "pos": pos,
        "caches": caches,
        "table": table,
        "kv_indices": kv_indices,
        "kv_indptr": kv_indptr,
        "batch": batch,
        "R": R,
        "page_size": page_size,
    }


def decode_eager(p):
    """8 eager NumPy calls: the stacked q outputs and the final caches."""
    caches = tuple(c.copy() for c in p["caches"])
    R, outs = p["R"], []
    for i in range(len(p["q"])):
        q8, _ = ropekv.rope_quantize_fp8_append_paged_kv_cache(
            p["q"][i][..., :R],
            p["k"][i][..., :R],
            p["q"][i][..., R:],
            p["k"][i][..., R:],
            p["v"][i],
            p["table"],
            p["pos"][i],
            caches,
            p["kv_indices"],
            p["kv_indptr"],
            p["batch"],
            p["pos"][i],
            page_size=p["page_size"],
        )
        outs.append(q8)
    return np.stack(outs), caches


def decode_scan(p, device, donate=True):
    put = functools.partial(jax.device_put, device=device)

    def run(caches, q, k, v, pos, table, kv_indices, kv_indptr, batch):
        def body(caches, xs):
            qi, ki, vi, pi = xs
            return paged_step(caches, qi, ki, vi, table, pi, kv_indices, kv_indptr, batch)

        return jax.lax.scan(body, caches, (q, k, v, pos))

    run = jax.jit(run, donate_argnums=0 if donate else ())
    caches = tuple(put(c) for c in p["caches"])
    return run(
        caches,
        *(put(p[n]) for n in ("q", "k", "v", "pos", "table", "kv_indices", "kv_indptr", "batch")),
    )


@cpu
def test_scan_over_8_decode_steps_equals_8_eager_calls():
    p = decode_problem()
    q8, caches = decode_eager(p)
    new_caches, q8s = decode_scan(p, jax.devices("cpu")[0])
    assert_same([q8s, *new_caches], [q8, *caches])


# ---- what is not supported, and errors ----------------------------------------------------------


@cpu
def test_vmap_raises_a_clear_error():
    case = next(c for c in CASES if c.name == "qknorm")
    arrays, statics = split(case)
    batched = {n: (jnp.stack([x, x]) if n in ("q", "k", "v") else x) for n, x in arrays.items()}
    axes = {n: (0 if n in ("q", "k", "v") else None) for n in arrays}
    with pytest.raises(
        NotImplementedError, match="qk_rmsnorm_rope_append_paged_kv_cache does not support jax.vmap"
    ):
        jax.vmap(
            lambda a: rj.qk_rmsnorm_rope_append_paged_kv_cache(**a, **statics), in_axes=(axes,)
        )(batched)


@cpu
def test_grad_raises_a_clear_error():
    case = next(c for c in CASES if c.name == "qknorm")
    arrays, statics = split(case)

    def loss(q):
        q_out, _ = rj.qk_rmsnorm_rope_append_paged_kv_cache(**dict(arrays, q=q), **statics)
        return q_out.astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="has no derivative"):
        jax.grad(loss)(arrays["q"])
    with pytest.raises(NotImplementedError, match="has no derivative"):
        jax.jvp(loss, (arrays["q"],), (jnp.ones_like(arrays["q"]),))


@cpu
def test_stop_gradient_inputs_leave_other_gradients_alone():
    case = next(c for c in CASES if c.name == "qknorm")
    arrays, statics = split(case)
    q_out = rj.qk_rmsnorm_rope_append_paged_kv_cache(**arrays, **statics)[0]

    def loss(q, scale):
        out, _ = rj.qk_rmsnorm_rope_append_paged_kv_cache(
            **dict(arrays, q=jax.lax.stop_gradient(q)), **statics
        )
        return (out.astype(jnp.float32) * scale).sum() + q.astype(jnp.float32).sum()

    dq, dscale = jax.grad(loss, argnums=(0, 1))(arrays["q"], 1.0)
    assert np.all(np.asarray(dq, np.float32) == 1)
    assert dscale == pytest.approx(float(np.asarray(q_out, np.float32).sum()), rel=1e-5)


@cpu
def test_trace_time_errors_are_the_eager_ones():
    case = next(c for c in CASES if c.name == "paged-fp8-gqa")
    args = case.fresh()
    args["q_rope"] = args["q_rope"].reshape(args["q_rope"].shape[0], -1)
    with pytest.raises(ValueError) as eager:
        ropekv.rope_quantize_fp8_append_paged_kv_cache(**args)
    arrays, statics = split(case)
    arrays["q_rope"] = arrays["q_rope"].reshape(arrays["q_rope"].shape[0], -1)
    with pytest.raises(ValueError) as jitted:
        jax.jit(lambda a: rj.rope_quantize_fp8_append_paged_kv_cache(**a, **statics))(arrays)
    assert str(jitted.value) == str(eager.value)


@cpu
@pytest.mark.parametrize(
    "name,arg,bad,error",
    [
        ("qknorm-fp8-q-dynamic-kv-scales", "q_out_dtype", "int8", TypeError),
        # int8 paged caches without kv_cache_scales: a rule tying two arguments, a ValueError
        # (ropekv._checks.check_cache_scales)
        ("paged-int8-kv-scales-hnd-given", "kv_cache_scales", None, ValueError),
        ("paged-fp8-gqa", "quantize_dtype", np.int8, ValueError),
    ],
)
def test_trace_time_errors_of_the_output_dtypes_are_the_eager_ones(name, arg, bad, error):
    """The q output dtype (QK-norm's ``q_out_dtype``; int8 paged q outputs only with
    ``kv_cache_scales``) is derived while tracing, with the eager op's check, error class and
    message (the eager call allocating its outputs, as the JAX op does)."""
    case = next(c for c in CASES if c.name == name)
    args = {n: x for n, x in case.fresh().items() if n not in OUTPUT_ARGS}
    with pytest.raises(error) as eager:
        case.run(ropekv, dict(args, **{arg: bad}))
    arrays, statics = split(case)
    (arrays if arg == "kv_cache_scales" else statics)[arg] = bad
    fn = getattr(rj, case.op)
    with pytest.raises(error) as jitted:
        jax.jit(lambda a: fn(**a, **statics))(arrays)
    assert type(jitted.value) is type(eager.value)
    assert str(jitted.value) == str(eager.value)


@cpu
def test_run_time_errors_quote_the_eager_message():
    case = next(c for c in CASES if c.name == "contiguous-f16")
    args = case.fresh()
    args["k"] = args["k"][:, :, :1].copy()
    with pytest.raises(ValueError) as eager:
        ropekv.apply_rope_write_kv(**args)
    arrays, statics = split(case)
    arrays["k"] = arrays["k"][:, :, :1]
    with pytest.raises(Exception, match="ValueError") as jitted:
        jax.block_until_ready(jax.jit(lambda a: rj.apply_rope_write_kv(**a, **statics))(arrays))
    assert str(eager.value) in str(jitted.value)


@cpu
def test_command_buffer_flag_is_accepted_on_the_host():
    case = next(c for c in CASES if c.name == "qkv-decode")
    arrays, statics = split(case)
    got = jax.jit(
        lambda a: rj.fused_qkv_matmul_append_paged_kv_cache(
            **a, **statics, command_buffer_compatible=True
        )
    )(arrays)
    assert_same(jax.tree_util.tree_leaves(got), expected(case))


@cpu
@pytest.mark.parametrize(
    "name",
    [
        "qknorm-options-given",
        "mla-options",
        "paged-int8-kv-scales-hnd-given",
        "qknorm-fp8-q-dynamic-kv-scales",
        "qkv-options-given",
    ],
)
def test_status_reports_bad_offsets_and_the_caches_stay(name):
    """Malformed offsets (``input_row_offsets`` one above the next: code 2; ``kv_indptr[0] !=
    0``: code 4): the returned status holds the code, and every other returned alias (caches,
    scale arrays) the given array's bytes."""
    import copy

    case = copy.copy(next(c for c in CASES if c.name == name))
    if "kv_indptr" in case.kwargs:
        indptr = case.kwargs["kv_indptr"].copy()
        indptr[0] = 1
        case.kwargs, code = dict(case.kwargs, kv_indptr=indptr), 4
    else:
        offsets = case.kwargs["input_row_offsets"].copy()
        offsets[1] = offsets[2] + 1
        case.kwargs, code = dict(case.kwargs, input_row_offsets=offsets), 2
    arrays, statics = split(case)
    fn = getattr(rj, case.op)
    got = jax.tree_util.tree_leaves(jax.jit(lambda a: fn(**a, **statics))(arrays))
    given = case.written(case.fresh(), status=False, outputs=False)
    *aliases, status = got[len(got) - len(given) - 1 :]
    assert int(np.asarray(status)[0]) == code
    assert len(aliases) == len(given)
    for alias, want in zip(aliases, given):
        assert np.array_equal(np.asarray(alias).view(np.uint8), want.view(np.uint8))


@cpu
@pytest.mark.parametrize(
    "name,bad", [("qknorm-fp8-layers", True), ("qkv-decode-layers", 1.0), ("mla-split-layers", "1")]
)
def test_layer_idx_type_errors_are_the_eager_ones(name, bad):
    assert_jitted_error_is_the_eager_one(name, TypeError, layer_idx=bad)


def assert_jitted_error_is_the_eager_one(name, error, **bad):
    """Case ``name`` with the scalar arguments ``bad`` raises ``error`` under ``jax.jit`` with
    the eager op's message."""
    case = next(c for c in CASES if c.name == name)
    with pytest.raises(error) as eager:
        case.run(ropekv, dict(case.fresh(), **bad))
    arrays, statics = split(case)
    fn = getattr(rj, case.op)
    with pytest.raises(error) as jitted:
        jax.jit(lambda a: fn(**a, **dict(statics, **bad)))(arrays)
    assert str(jitted.value) == str(eager.value)


@cpu
@pytest.mark.parametrize(
    "name", ["contiguous-mrope", "paged-fp8-mrope-interleaved", "qknorm-mrope-in-place"]
)
@pytest.mark.parametrize("bad", [5, (1, 2), (1.0, 2, 3)])
def test_mrope_section_errors_are_the_eager_ones(name, bad):
    assert_jitted_error_is_the_eager_one(name, ValueError, mrope_section=bad)


@cpu
def test_donated_multi_layer_cache_is_updated_in_its_own_buffer():
    """One layer of a donated (num_layers, ...) cache written in place: no copy of the cache."""
    case = next(c for c in CASES if c.name == "qknorm-fp8-layers")
    arrays, statics = split(case)
    caches = tuple(jnp.copy(c) for c in arrays.pop("paged_kv_cache"))
    pointers = [c.unsafe_buffer_pointer() for c in caches]

    def step(caches, a):
        q_out, caches = rj.qk_rmsnorm_rope_append_paged_kv_cache(
            **a, paged_kv_cache=caches, **statics
        )
        return caches, q_out

    jitted = jax.jit(step, donate_argnums=0)
    new, q_out = jitted(caches, arrays)
    jax.block_until_ready(new)
    assert [c.unsafe_buffer_pointer() for c in new] == pointers
    assert_same([q_out, *new], expected(case))
    hlo = jitted.lower(new, arrays).compile().as_text()
    assert " copy(" not in hlo and "copy-start" not in hlo


def test_command_buffers_refuse_a_prefill_qkv_call():
    case = next(c for c in CASES if c.name == "qkv-prefill-given")
    arrays, statics = split(case)
    with pytest.raises(ValueError, match="cannot be recorded into XLA's command buffers"):
        rj.fused_qkv_matmul_append_paged_kv_cache(
            **arrays, **statics, command_buffer_compatible=True
        )


@cpu
@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("name", ["qkv-batch", "qkv-graph-batch"])
def test_command_buffers_take_a_qkv_batch_where_it_runs_one_kernel(name, capability, monkeypatch):
    """Six tokens run the tensor-core kernel on sm_90 (one launch, no temporaries), 310 tokens
    do under capture (cuBLAS eagerly): recorded; on sm_80 both run cuBLAS: refused when
    traced."""
    import ropekv._frameworks as fw

    monkeypatch.setattr(fw, "_least_capability", lambda: capability)
    case = next(c for c in CASES if c.name == name)
    arrays, statics = split(case)
    fn = jax.jit(
        lambda a: rj.fused_qkv_matmul_append_paged_kv_cache(
            **a, **statics, command_buffer_compatible=True
        )
    )
    if capability == 80:
        with pytest.raises(ValueError, match="cannot be recorded into XLA's command buffers"):
            fn(arrays)
    else:
        assert_same(jax.tree_util.tree_leaves(fn(arrays)), expected(case))


# ---- GPU -----------------------------------------------------------------------------------------


def gpu_device():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_jitted_op_matches_the_reference(case):
    got = run_jitted(case, gpu_device())
    for i, (g, e) in enumerate(zip(got, expected(case), strict=True)):
        assert_result_close(np.asarray(g), e, case, f"result {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv-batch", "qkv-graph-batch"])
def test_gpu_command_buffers_record_a_qkv_batch(name):
    """A small batch (the tensor-core kernel on sm_90) and one of 310 tokens (cuBLAS eagerly, the
    fused kernel when captured) with command_buffer_compatible=True: the reference's results,
    warm (the kernels compiled outside XLA's capture) and again."""
    case = next(c for c in CASES if c.name == name)
    device = gpu_device()
    run_jitted(case, device)  # compiles the kernel and makes the plan, outside any capture
    arrays, statics = split(case, lambda x: jax.device_put(x, device))
    fn = jax.jit(
        lambda a: rj.fused_qkv_matmul_append_paged_kv_cache(
            **a, **statics, command_buffer_compatible=True
        )
    )
    for _ in range(2):
        got = jax.tree_util.tree_leaves(fn(arrays))
        for i, (g, e) in enumerate(zip(got, expected(case), strict=True)):
            assert_result_close(np.asarray(g), e, case, f"result {i}")


@pytest.mark.gpu
def test_gpu_donated_cache_keeps_its_address():
    check_donation_keeps_the_cache_buffer(gpu_device())


@pytest.mark.gpu
@pytest.mark.parametrize("command_buffer", [False, True])
def test_gpu_scan_over_8_decode_steps_equals_8_eager_calls(command_buffer, monkeypatch):
    device = gpu_device()
    if command_buffer:  # record the op into XLA's command buffers (warm the kernel first)
        decode_scan(decode_problem(), device)
        original = rj.rope_quantize_fp8_append_paged_kv_cache
        monkeypatch.setattr(
            rj,
            "rope_quantize_fp8_append_paged_kv_cache",
            lambda *a, **k: original(*a, **k, command_buffer_compatible=True),
        )
    p = decode_problem()
    q8, caches = decode_eager(p)
    new_caches, q8s = decode_scan(p, device)
    assert_close(np.asarray(q8s), q8, "q outputs")
    for got, want in zip(new_caches, caches):
        assert_close(np.asarray(got), want, "cache")
    # the same 8 steps one jitted call at a time, donated: the same bytes as the scan
    step = jax.jit(paged_step, donate_argnums=0)
    put = functools.partial(jax.device_put, device=device)
    cs = tuple(put(c) for c in p["caches"])
    for i in range(8):
        cs, _ = step(
            cs,
            put(p["q"][i]),
            put(p["k"][i]),
            put(p["v"][i]),
            put(p["table"]),
            put(p["pos"][i]),
            put(p["kv_indices"]),
            put(p["kv_indptr"]),
            put(p["batch"]),
        )
    assert_same(list(cs), [np.asarray(c) for c in new_caches])
