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


# ---- the declared ops: their forms follow from their declarations (ropekv/_declare.py) -------


def _is_jax_array(x):
    return isinstance(x, jax.Array | np.ndarray) and not isinstance(x, np.generic)


def _declared(decl):
    """The JAX form of a declared op: the eager signature without its outputs (the op allocates
    them, but an output written into its input by default, which stays) and ``stream``; arrays
    are the call's inputs, the rest static. Returns the outputs, then each array the call writes
    in declaration order (a pair as a pair), all input-output aliases but new outputs."""
    eager = getattr(ropekv, decl.name)
    outs = [o for o in decl.outs if not o.default_into]
    names = [a.name for a in decl.inputs if a not in outs]

    def form(*args, command_buffer_compatible=False, **kwargs):
        values = decl.check_scalars(decl.bind(args, kwargs, f"ropekv.jax.{decl.name}", names))
        if command_buffer_compatible and decl.capture_check is not None:
            decl.capture_check(
                decl.metas(values, _is_jax_array, _meta),
                "into XLA's command buffers (command_buffer_compatible=True)",
            )
        for o in outs:
            values[o.name] = None
        schema = decl.expand(values, _is_jax_array)
        arrays = {}  # the call's array inputs (a given default_into output among them)
        for a in decl.inputs:
            for p, t in a.schema_parts():
                if t == "Tensor" and schema.get(p) is not None:
                    arrays[p] = schema[p]
        # an output written into its input by default aliases the given output, else the input
        outputs = [
            (o.name, o.name if values[o.name] is not None else o.into)
            for o in decl.outs
            if o.default_into
        ]
        if outs:
            metas = decl.metas(values, _is_jax_array, _meta)
            for name, (shape, dtype) in decl.outputs(metas).items():
                outputs.append((name, _struct(shape, dtype)))
        shape_of = []  # how the written arrays return: (key,) or a pair (key, key)
        for name, value in decl.written_arrays(values):
            a = decl.by_name[name]
            keys = [p for p, t in a.schema_parts() if t == "Tensor" and schema.get(p) is not None]
            for k in keys:
                outputs.append((k, k))
            shape_of.append(tuple(keys) if isinstance(value, tuple | list) else keys[0])

        def run(buffers, stream):
            # the buffers (keyed as the inputs they alias, new outputs by name) over the
            # schema's values, back to the eager spelling
            eager(**decl.collapse({**schema, **buffers}), stream=stream)

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


for _decl in _declare.declarations("jax"):
    globals()[_decl.name] = _declared(_decl)
del _decl
