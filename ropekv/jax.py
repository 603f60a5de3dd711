"""ropekv's ops as functional JAX ops, callable inside ``jax.jit`` and ``jax.lax.scan``.

``import ropekv.jax`` gives functions with the names and arguments of the eager ops that return
the new cache(s) and their outputs instead of writing the caller's arrays::

    q_rope_out, q_nope_out, (k_cache, v_cache) = ropekv.jax.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, (k_cache, v_cache), ...)

Each call is one ``jax.experimental.buffer_callback``: XLA hands the callback its device buffers
and its stream, and the callback runs the eager op on them (on XLA's stream; NumPy reference on
CPU). Every cache is an input-output alias of the call, and so is ``q`` for
``apply_rope_write_kv`` (``k`` too with ``write_k_in_place=True``; ``q_out`` instead of ``q`` when
given), and every array the eager op writes when given (``status``, ``q_scale_out``,
``kv_cache_scales``), returned after the caches: the output buffer starts as the input's contents
and the op writes only the addressed rows into it. When the cache is donated
(``jax.jit(step, donate_argnums=...)``) XLA hands the callback the input's own buffer and the update
happens in place, with no copy; without donation XLA copies the cache first, as it must to keep the
input unchanged. In a ``jax.lax.scan`` over decode steps the cache is the loop carry and stays in
one buffer.

Differences from the eager functions:

* Functional: the caches (and ``q`` / ``k`` above) are returned, never written in the caller's
  arrays; ``q_rope_out`` / ``q_nope_out`` / ``out`` arguments and the QK-norm op's ``q_out`` do
  not exist (the op allocates its outputs, QK-norm's in ``q_out_dtype``; XLA owns the memory).
* No ``stream=``: the op runs on XLA's stream.
* Scalars (``epsilon``, ``kv_scale``, float scales, ``page_size``, layouts, flags) are static
  Python values; arrays may be traced.
* ``command_buffer_compatible=True`` lets XLA record the op into its CUDA graphs (command buffers)
  instead of calling Python on every run: XLA runs the callback again, under stream capture,
  whenever one of the op's buffer addresses changes, and replays the recording otherwise. It is off
  by default: the first call of a layout must not happen under capture (it compiles the kernel),
  and ``ROPEKV_CHECK_INDICES=1`` (host reads of index arrays) cannot run under capture.

Not supported: ``jax.vmap`` (the op has no batching rule: call it on the whole batch) and autodiff
(``jax.grad``, ``jax.jvp``: the op writes caches and has no derivative). Both raise
``NotImplementedError`` naming the op. Validation is the eager op's: the shapes and dtypes of the
outputs are derived at trace time with the eager messages; every other rule is checked when the
call runs and reaches the caller as XLA's runtime error quoting the eager message.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import ropekv
from ropekv import _declare, _registry
from ropekv import _frameworks as fw

__all__ = list(_registry.JAX)  # the registry's ops with a JAX form

_DL_CPU = 1  # DLPack device type of host memory


# ---- one op call: a buffer_callback with its caches aliased ----------------------------------


def _call(name, inputs, outputs, run, command_buffer_compatible):
    """Run an eager op inside a JAX computation.

    ``inputs``: ``[(key, array or None)]``. ``outputs``: ``[(key, spec)]`` where ``spec`` is a
    ``jax.ShapeDtypeStruct`` (a new array) or the key of an input the output aliases (its buffer
    then stands for that input in the eager call). ``run(arrays, stream)`` calls the eager op with
    ``arrays`` (key -> buffer, the outputs included) on ``stream`` (None on the host). Returns the
    outputs in order.
    """
    present = [(key, x) for key, x in inputs if x is not None]
    keys = [key for key, _ in present]
    position = {key: i for i, key in enumerate(keys)}
    types, aliases = [], {}
    for j, (_, spec) in enumerate(outputs):
        if isinstance(spec, str):
            x = present[position[spec]][1]
            types.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
            aliases[position[spec]] = j
        else:
            types.append(spec)
    targets = [spec if isinstance(spec, str) else key for key, spec in outputs]

    def callback(ctx, outs, *ins):
        host = (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
        # On the GPU the buffers go straight in (ropekv reads their __cuda_array_interface__ /
        # DLPack); on the host ropekv's NumPy reference writes through np.asarray views.
        view = np.asarray if host else _same
        arrays = {key: view(b) for key, b in zip(keys, ins)}
        arrays.update((key, view(b)) for key, b in zip(targets, outs))
        run(arrays, None if host else ctx.stream)

    fn = buffer_callback(
        callback,
        types,
        input_output_aliases=aliases,
        command_buffer_compatible=bool(command_buffer_compatible),
    )
    return _no_transforms(name, fn)(*(x for _, x in present))


def _same(x):
    return x


def _no_transforms(name, fn):
    """``fn`` with a clear error under ``jax.vmap`` and under differentiation."""
    batched = jax.custom_batching.custom_vmap(fn)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *args):
        raise NotImplementedError(
            f"ropekv.jax.{name} does not support jax.vmap: the op writes whole caches through "
            f"buffer aliases and has no batching rule; call it once on the whole batch (the "
            f"ragged and batched layouts already carry a batch dimension)"
        )

    differentiable = jax.custom_jvp(batched)

    @differentiable.defjvp
    def _jvp(primals, tangents):
        raise NotImplementedError(
            f"ropekv.jax.{name} has no derivative (jax.grad / jax.jvp): it writes KV caches; "
            f"apply jax.lax.stop_gradient to its inputs if they carry tangents"
        )

    return differentiable


def _meta(x, name):
    return fw.MetaView(name, x.shape, np.dtype(x.dtype))


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _pair(caches, message):
    if not isinstance(caches, tuple | list) or len(caches) != 2:
        raise ValueError(message)
    return caches[0], caches[1]


# ---- mla_rope_rmsnorm_append_paged_kv_cache ----------------------------------------------------


def mla_rope_rmsnorm_append_paged_kv_cache(
    q_rope,
    kv,
    gamma,
    cos_sin_cache,
    input_row_offsets,
    cache_lengths,
    block_table,
    kv_cache,
    *,
    epsilon=1e-6,
    kv_norm_dim=None,
    is_neox=False,
    kv_scale=None,
    clear_unused_last_page_rows=False,
    status=None,
    layer_idx=None,
    command_buffer_compatible=False,
):
    """:func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache` as a functional op.

    Returns ``(q_rope_out, kv_cache)``: the roped queries (a new array) and the new cache, one
    array or a ``(ckv, kpe)`` pair like the given one, aliasing it (donate it for an in-place
    update); with ``status``, ``(q_rope_out, kv_cache, status)``, the new status aliasing the
    given one. ``clear_unused_last_page_rows`` is static; ``layer_idx`` (a static int) writes one
    layer of caches with a leading ``(num_layers, ...)`` dimension, as the eager op.
    """
    layer_idx = fw.layer_index(layer_idx)
    split = isinstance(kv_cache, tuple | list)
    if split:
        caches = _pair(
            kv_cache,
            f"kv_cache must be one array (num_pages, page_size, L + R) or a "
            f"tuple (ckv, kpe), got a {type(kv_cache).__name__} of "
            f"{len(kv_cache)} arrays",
        )
    else:
        caches = (kv_cache, None)
    shape, dtype = fw.same_as_q(_meta(q_rope, "q_rope"), "(T, Hq, R)")

    def run(a, stream):
        cache = (a["cache0"], a["cache1"]) if split else a["cache0"]
        ropekv.mla_rope_rmsnorm_append_paged_kv_cache(
            a["q_rope"],
            a["kv"],
            a["gamma"],
            a["cos_sin_cache"],
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            cache,
            epsilon=epsilon,
            kv_norm_dim=kv_norm_dim,
            is_neox=bool(is_neox),
            kv_scale=kv_scale,
            q_rope_out=a["q_rope_out"],
            clear_unused_last_page_rows=clear_unused_last_page_rows,
            status=a.get("status"),
            layer_idx=layer_idx,
            stream=stream,
        )

    inputs = [
        ("q_rope", q_rope),
        ("kv", kv),
        ("gamma", gamma),
        ("cos_sin_cache", cos_sin_cache),
        ("input_row_offsets", input_row_offsets),
        ("cache_lengths", cache_lengths),
        ("block_table", block_table),
        ("cache0", caches[0]),
        ("cache1", caches[1]),
        ("status", status),
    ]
    outputs = [
        ("q_rope_out", _struct(shape, dtype)),
        ("cache0", "cache0"),
        *((("cache1", "cache1"),) if split else ()),
        *((("status", "status"),) if status is not None else ()),
    ]
    q_rope_out, *new = _call(
        "mla_rope_rmsnorm_append_paged_kv_cache", inputs, outputs, run, command_buffer_compatible
    )
    new_status = (new.pop(),) if status is not None else ()
    return (q_rope_out, tuple(new) if split else new[0], *new_status)


# ---- qk_rmsnorm_rope_append_paged_kv_cache -----------------------------------------------------


def qk_rmsnorm_rope_append_paged_kv_cache(
    q,
    k,
    v,
    q_gamma,
    k_gamma,
    cos_sin_cache,
    input_row_offsets,
    cache_lengths,
    block_table,
    paged_kv_cache,
    *,
    epsilon=1e-6,
    is_neox=True,
    kv_layout="NHD",
    kv_scale=None,
    q_out_dtype=None,
    q_scale=None,
    q_scale_out=None,
    kv_cache_scales=None,
    norm_order="before_rope",
    weight_offset=0.0,
    clear_unused_last_page_rows=False,
    position_ids=None,
    mrope_section=None,
    mrope_interleaved=False,
    status=None,
    layer_idx=None,
    command_buffer_compatible=False,
):
    """:func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache` as a functional op.

    Returns ``(q_out, (k_cache, v_cache))``: the normalised, roped queries (a new array, in the
    static ``q_out_dtype``: ``q``'s or fp8) and the new caches, aliasing the given ones (donate
    them for an in-place update). ``q_scale_out`` ``(T, Hq)``, ``kv_cache_scales`` (a pair of
    float32 arrays) and ``status`` ``(1,)`` int32 are input-output aliases too, returned after
    the caches in that order when given: ``q8, caches, q_scales, (k_scales, v_scales), status =
    ...``. Options as the eager op: ``q_scale``, ``norm_order``, ``weight_offset``,
    ``clear_unused_last_page_rows``, ``mrope_section`` and ``mrope_interleaved`` are static,
    ``position_ids`` an array; ``layer_idx`` (a static int) writes one layer of caches (and of
    ``kv_cache_scales``' arrays) with a leading ``(num_layers, ...)`` dimension.
    """
    layer_idx = fw.layer_index(layer_idx)
    k_cache, v_cache = _pair(
        paged_kv_cache,
        f"paged_kv_cache must be a tuple (k_cache, v_cache), got {type(paged_kv_cache).__name__}",
    )
    scales = kv_cache_scales is not None
    if scales and (not isinstance(kv_cache_scales, tuple | list) or len(kv_cache_scales) != 2):
        raise ValueError(
            f"kv_cache_scales must be a tuple (k_scales, v_scales), got "
            f"{type(kv_cache_scales).__name__}"
        )
    k_scales, v_scales = kv_cache_scales if scales else (None, None)
    shape, dtype = fw.qknorm_q_output(_meta(q, "q"), q_out_dtype)

    def run(a, stream):
        ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
            a["q"],
            a["k"],
            a["v"],
            a["q_gamma"],
            a["k_gamma"],
            a["cos_sin_cache"],
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            (a["k_cache"], a["v_cache"]),
            epsilon=epsilon,
            is_neox=bool(is_neox),
            kv_layout=kv_layout,
            kv_scale=kv_scale,
            q_out=a["q_out"],
            q_scale=q_scale,
            q_scale_out=a.get("q_scale_out"),
            kv_cache_scales=(a["k_scales"], a["v_scales"]) if scales else None,
            norm_order=norm_order,
            weight_offset=weight_offset,
            clear_unused_last_page_rows=clear_unused_last_page_rows,
            position_ids=a.get("position_ids"),
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            status=a.get("status"),
            layer_idx=layer_idx,
            stream=stream,
        )

    inputs = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("q_gamma", q_gamma),
        ("k_gamma", k_gamma),
        ("cos_sin_cache", cos_sin_cache),
        ("input_row_offsets", input_row_offsets),
        ("cache_lengths", cache_lengths),
        ("block_table", block_table),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("position_ids", position_ids),
        ("q_scale_out", q_scale_out),
        ("k_scales", k_scales),
        ("v_scales", v_scales),
        ("status", status),
    ]
    outputs = [
        ("q_out", _struct(shape, dtype)),
        ("k_cache", "k_cache"),
        ("v_cache", "v_cache"),
        *_aliases(q_scale_out=q_scale_out, k_scales=k_scales, v_scales=v_scales, status=status),
    ]
    q_out, new_k, new_v, *new = _call(
        "qk_rmsnorm_rope_append_paged_kv_cache", inputs, outputs, run, command_buffer_compatible
    )
    return (q_out, (new_k, new_v), *_regroup(new, q_scale_out, scales, status))


# ---- fused_qkv_matmul_append_paged_kv_cache ----------------------------------------------------


def fused_qkv_matmul_append_paged_kv_cache(
    hidden_state,
    weight,
    input_row_offsets,
    cache_lengths,
    block_table,
    paged_kv_cache,
    *,
    num_q_heads,
    cos_sin_cache=None,
    is_neox=True,
    kv_layout="NHD",
    kv_scale=None,
    weight_scales=None,
    group_size=None,
    zero_points=None,
    clear_unused_last_page_rows=False,
    status=None,
    layer_idx=None,
    command_buffer_compatible=False,
):
    """:func:`ropekv.fused_qkv_matmul_append_paged_kv_cache` as a functional op.

    Returns ``(out, (k_cache, v_cache))``: Q ``(T, Hq * D)`` (a new array) and the new caches,
    aliasing the given ones (donate them for an in-place update). Calls that run cuBLAS (see
    ``ropekv.qkv``: above ``GEMV_MAX_TOKENS`` tokens, or on sm_90 above ``WGMMA_MAX_TOKENS`` with
    fp16 / bf16 weights and ``MMA_MAX_TOKENS_QUANTIZED`` with fp8 and 4-bit weights) use CuPy
    temporaries, allocated outside XLA's memory pool; under capture they run the fused kernel
    instead, up to ``GRAPH_MAX_TOKENS`` tokens on sm_90. Those that cannot be captured
    (``ropekv.qkv.graph_safe``) refuse ``command_buffer_compatible=True`` (``ValueError``) when
    traced.
    ``layer_idx`` (a static int) writes one layer of caches with a leading ``(num_layers, ...)``
    dimension, as the eager op. ``clear_unused_last_page_rows`` is static; with ``status`` (an
    ``(1,)`` int32 array, an input-output alias like the caches) the result is ``(out, (k_cache,
    v_cache), status)``.
    """
    layer_idx = fw.layer_index(layer_idx)
    k_cache, v_cache = _pair(
        paged_kv_cache,
        f"paged_kv_cache must be a (k_cache, v_cache) pair, "
        f"got {type(paged_kv_cache).__qualname__}",
    )
    if command_buffer_compatible:
        fw.check_qkv_graph_safe(
            _meta(hidden_state, "hidden_state"),
            _meta(weight, "weight"),
            _meta(k_cache, "k_cache"),
            group_size,
            "into XLA's command buffers (command_buffer_compatible=True)",
        )
    shape, dtype = fw.qkv_output(
        _meta(hidden_state, "hidden_state"),
        _meta(k_cache, "k_cache"),
        num_q_heads,
        kv_layout,
        layer_idx,
    )

    def run(a, stream):
        ropekv.fused_qkv_matmul_append_paged_kv_cache(
            a["hidden_state"],
            a["weight"],
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            (a["k_cache"], a["v_cache"]),
            num_q_heads=num_q_heads,
            cos_sin_cache=a.get("cos_sin_cache"),
            is_neox=bool(is_neox),
            kv_layout=kv_layout,
            kv_scale=kv_scale,
            weight_scales=a.get("weight_scales"),
            group_size=group_size,
            zero_points=a.get("zero_points"),
            out=a["out"],
            clear_unused_last_page_rows=clear_unused_last_page_rows,
            status=a.get("status"),
            layer_idx=layer_idx,
            stream=stream,
        )

    inputs = [
        ("hidden_state", hidden_state),
        ("weight", weight),
        ("input_row_offsets", input_row_offsets),
        ("cache_lengths", cache_lengths),
        ("block_table", block_table),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("cos_sin_cache", cos_sin_cache),
        ("weight_scales", weight_scales),
        ("zero_points", zero_points),
        ("status", status),
    ]
    outputs = [
        ("out", _struct(shape, dtype)),
        ("k_cache", "k_cache"),
        ("v_cache", "v_cache"),
        *_aliases(status=status),
    ]
    out, new_k, new_v, *new = _call(
        "fused_qkv_matmul_append_paged_kv_cache", inputs, outputs, run, command_buffer_compatible
    )
    return (out, (new_k, new_v), *new)


# ---- the declared ops: their forms follow from their declarations (ropekv/_declare.py) -------


def _is_jax_array(x):
    return isinstance(x, jax.Array | np.ndarray) and not isinstance(x, np.generic)


def _declared(decl):
    """The JAX form of a declared op: the eager signature without its outputs (the op allocates
    them, but an output written into its input by default, which stays) and ``stream``; arrays
    are the call's inputs, the rest static. Returns the outputs, then each array the call writes
    in declaration order (a pair as a pair), all input-output aliases but new outputs."""
    run_decl = decl.via or decl
    eager = getattr(ropekv, run_decl.name)
    outs = [o for o in decl.outs if not o.default_into]
    names = [a.name for a in decl.inputs if a not in outs]

    def form(*args, command_buffer_compatible=False, **kwargs):
        values = decl.bind(args, kwargs, f"ropekv.jax.{decl.name}", names)
        for o in outs:
            values[o.name] = None
        schema = decl.expand(values, _is_jax_array)
        arrays = {}  # the call's array inputs: key -> array
        for a in decl.inputs:
            parts = a.schema_parts()
            for p, t in parts:
                if t == "Tensor" and schema.get(p) is not None:
                    arrays[p] = schema[p]
        outputs = []
        for o in decl.outs:
            if o.default_into:
                target = o.name if values[o.name] is not None else o.into
                arrays.setdefault(o.name, values[o.name]) if values[o.name] is not None else None
                outputs.append((o.name, target))
        if outs:
            metas = decl.metas(values, _is_jax_array, _meta)
            for name, (shape, dtype) in decl.outputs(metas).items():
                outputs.append((name, _struct(shape, dtype)))
        for r in decl.results:
            outputs.append((r.name, r.into))
        shape_of = []  # how the written arrays return: (key,) or a pair (key, key)
        for name, value in decl.written_arrays(values):
            a = decl.by_name[name]
            keys = [p for p, t in a.schema_parts() if t == "Tensor" and schema.get(p) is not None]
            if a.form == "tensor":
                keys = [name]
            for k in keys:
                outputs.append((k, k))
            shape_of.append(tuple(keys) if isinstance(value, tuple | list) else keys[0])

        def run(buffers, stream):
            given = dict(schema)
            given.update(buffers)
            call = decl.collapse(given)
            for o in outs:
                call[o.name] = buffers[o.name]
            for o in decl.outs:
                if o.default_into and values[o.name] is not None:
                    call[o.name] = buffers[o.name]
            if run_decl is not decl:
                call = {a.name: call.get(a.name, values.get(a.name)) for a in run_decl.inputs}
            eager(**call, stream=stream)

        got = _call(decl.name, list(arrays.items()), outputs, run, command_buffer_compatible)
        n = len(outputs) - sum(len(k) if isinstance(k, tuple) else 1 for k in shape_of)
        result, rest = list(got[:n]), list(got[n:])
        for keys in shape_of:
            if isinstance(keys, tuple):
                result.append(tuple(rest.pop(0) for _ in keys))
            else:
                result.append(rest.pop(0))
        return result[0] if len(result) == 1 else tuple(result)

    form.__name__ = form.__qualname__ = decl.name
    form.__doc__ = (
        f":func:`ropekv.{decl.name}` as a functional op: returns its outputs, then the arrays it "
        f"writes (input-output aliases: donate them to update in place). Scalars are static."
    )
    return form


for _entry in _registry.OPS:
    _decl = _declare.declaration_of(_entry)
    if _decl is not None and _entry.jax:
        globals()[_entry.name] = _declared(_decl)
del _entry, _decl
