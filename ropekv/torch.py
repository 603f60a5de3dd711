"""ropekv's ops as PyTorch custom ops (``torch.library``), for ``torch.compile`` and CUDA graphs.

``import ropekv.torch`` registers every op under the ``ropekv::`` namespace and gives Python
functions with the names and arguments of the eager ops. Inside ``torch.compile(fullgraph=True)``
they trace without a graph break (the op is opaque to the compiler, its outputs come from a fake
implementation that touches no memory), and a second call with new tensors of the same shapes
reuses the compiled graph. They can be captured in CUDA graphs (``torch.cuda.graph``,
``torch.compile(mode="reduce-overhead")``). Each call runs the eager op on torch's current stream
of the tensors' device; CPU tensors run the NumPy reference, as in eager ropekv.

Differences from the eager functions:

* No ``stream=`` argument: the op runs on ``torch.cuda.current_stream(device)``, like every torch
  op, which is also the capture stream inside ``torch.cuda.graph``.
* A custom op cannot return a tensor that aliases an input, so each eager function maps to a few
  registered ops, and the Python function here picks one: outputs allocated by the op (returned),
  outputs given by the caller (written in place, ``mutates_args``, returned by the Python function,
  not by the op), or in place (``q_rope_out=q_rope``, ``q_out=q``).
* ``paged_kv_cache`` / ``kv_cache`` tuples become two tensor arguments; a scale that may be a
  number or a tensor becomes two arguments; ``kv_scale`` pairs become a list of floats.

Each function ``f`` here runs ``torch.ops.ropekv.f``, whose outputs the op allocates and returns,
or ``torch.ops.ropekv.f_out`` when the caller gives them; the MLA and QK-norm ops also have
``f_in_place`` (``q_rope_out=q_rope``, ``q_out=q``), and ``apply_rope_write_kv`` has
``apply_rope_write_kv_k_in_place`` for ``write_k_in_place=True``, each with an ``_out`` form for a
``q_out`` that is not ``q``.
The registered ops' schemas carry the eager function's defaults: ``torch.ops.ropekv.f`` can be
called with its required arguments and keywords, as an aten op; an ``_out`` op takes its outputs
right after its required arguments (a custom op takes no keyword-only tensor).

Every op declares exactly what it writes (``mutates_args``): the caches, ``q`` for
``apply_rope_write_kv`` (roped in place), ``k`` for its ``_k_in_place`` form, the given outputs,
``q_rope`` / ``q`` for the ``_in_place`` forms, and the arrays written when given: ``status``
(paged, MLA, QK-norm, fused QKV), ``q_scale_out`` and ``kv_cache_scales`` (``k_scales`` /
``v_scales`` in the paged and QK-norm ops' schemas). With ``layer_idx`` the caches are whole ``(num_layers, ...)``
tensors, one layer written.

Validation is the eager op's, with its messages: the fake implementations check the dims and
dtypes they derive output shapes from, and the eager op checks everything when the op runs (under
``torch.compile`` an error a fake raises while tracing reaches the caller as dynamo's
``TorchRuntimeError`` quoting the eager message). Torch accepts no autograd formula for an op that
writes its arguments: eagerly the forward runs on tensors that require grad and backward through
an op raises torch's "no autograd formula was registered" error; ``torch.compile`` with grad
enabled raises it while compiling. Serve under ``torch.inference_mode()`` or ``torch.no_grad()``.

``docs/frameworks.md`` has a compiled module and the rules for CUDA graphs (caches as module
buffers, warm-up before capture).

Nothing here is written per op: every registered op, its schema (the eager arguments in order,
the required ones first, with the eager defaults), its ``mutates_args``, its fake and the Python
function follow from the op's declaration (``DECLARATIONS`` in its module, see
``ropekv/_declare.py``).
"""

import inspect

import numpy as np
import torch

import ropekv
from ropekv import _declare, _registry
from ropekv import _frameworks as fw
from ropekv._arrays import HOST

Tensor = torch.Tensor

__all__ = list(_registry.TORCH)  # the registry's ops with a torch form


# ---- helpers -----------------------------------------------------------------------------------


def _meta(t, name):
    """A tensor's metadata (real or fake) for the shared derivations of ``ropekv._frameworks``."""
    device = HOST if t.device.type == "cpu" else t.device.index
    return fw.MetaView(name, t.shape, fw.dtype_of_name(t.dtype), t.stride(), device)


def _torch_dtype(np_dtype):
    return getattr(torch, np_dtype.name)


# The schemas carry the eager functions' defaults from torch 2.13 on. Before it (2.11 on the H200
# machines) the dispatcher leaves out trailing arguments equal to their defaults and torch's
# in-place version bump of a custom op indexes the mutated arguments past them (IndexError in
# custom_ops.adinplaceorview_impl, which 2.13 mends with fill_defaults); there the raw ops take
# every argument, as before.
SCHEMA_DEFAULTS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


# ---- the declared ops: their forms follow from their declarations (ropekv/_declare.py) -------


def _is_tensor(x):
    return isinstance(x, Tensor)


def _as_torch_dtype(value, name):
    """A dtype argument (a torch or NumPy dtype, or its name) as the schema's torch dtype; the
    eager op checks which dtypes it takes."""
    if isinstance(value, torch.dtype):
        return value
    key = value.removeprefix("torch.") if isinstance(value, str) else getattr(value, "name", None)
    if key is None:
        try:
            key = np.dtype(value).name
        except TypeError:
            key = None
    found = getattr(torch, key, None) if key else None
    if not isinstance(found, torch.dtype):
        raise TypeError(
            f"{name} must be a dtype (a NumPy or torch dtype, or its name), got {value!r}"
        )
    return found


def _new_outputs(decl, values, device_of):
    """Empty tensors for the outputs of a call that are None, by the declaration's output rule
    (``values``: the call's eager values, given outputs included)."""
    metas = decl.metas(values, _is_tensor, _meta)
    rule = decl.outputs(metas)
    device = device_of.device
    return {
        name: torch.empty(shape, dtype=_torch_dtype(dtype), device=device)
        for name, (shape, dtype) in rule.items()
        if values.get(name) is None
    }


def _register(decl, variant, eager):
    """The custom op of one variant of a declaration."""
    schema, names = decl.schema(variant, defaults=SCHEMA_DEFAULTS)
    where = f"torch.ops.ropekv.{variant.name}"
    first = decl.inputs[0].name

    def values_of(args, kwargs):
        # (the dispatcher may leave out trailing arguments that have their defaults)
        given = dict(zip(names, args), **kwargs)
        for name, default in names.items():
            if name not in given:
                if default is _declare.REQUIRED:
                    raise TypeError(f"{where}() missing required argument: {name!r}")
                given[name] = default
        values = decl.collapse(given)
        if decl.flag:
            values[decl.flag] = variant.flag
        for o in decl.outs:
            values[o.name] = given.get(o.name) if variant.outs == "given" else None
            if variant.outs == "into":
                values[o.name] = values[o.into]
        return values

    def kernel(*args, **kwargs):
        values = values_of(args, kwargs)
        if variant.outs == "new" and decl.outs:
            values.update(_new_outputs(decl, values, values[first]))
        eager(**values)
        if variant.outs != "new" or not decl.outs:
            return None
        outs = [values[o.name] for o in decl.outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def fake(*args, **kwargs):
        if variant.outs != "new" or not decl.outs:
            return None
        values = values_of(args, kwargs)
        outs = list(_new_outputs(decl, values, values[first]).values())
        return outs[0] if len(outs) == 1 else tuple(outs)

    op = torch.library.custom_op(
        f"ropekv::{variant.name}", kernel, mutates_args=decl.written(variant), schema=schema
    )
    op.register_fake(fake)
    return op, names


def _declared(decl):
    """The Python function of a declared op: the eager signature (but ``decl.keyword``),
    checked and spelled as the schema wants, then the variant its outputs pick."""
    eager = getattr(ropekv, decl.name)
    ops = {v: _register(decl, v, eager) for v in decl.variants()}
    where = f"ropekv.torch.{decl.name}"
    params = [p for p in inspect.signature(eager).parameters.values() if p.name not in decl.keyword]
    signature = [p.name for p in params if p.kind != p.KEYWORD_ONLY]

    def form(*args, **kwargs):
        if len(args) > len(signature):
            raise TypeError(
                f"{where}() takes {len(signature)} positional arguments but {len(args)} were given"
            )
        values = decl.check_scalars(decl.bind(args, kwargs, where))
        for a in decl.inputs:
            if a.form == "dtype" and values[a.name] is not None:
                values[a.name] = _as_torch_dtype(values[a.name], a.name)
        flag = bool(values[decl.flag]) if decl.flag else False
        outs = [values[o.name] for o in decl.outs]
        if all(o is None for o in outs):
            kind = "into" if decl.outs and decl.outs[0].default_into else "new"
        elif all(o.into and values[o.name] is values[o.into] for o in decl.outs):
            kind = "into"
        else:
            kind = "given"
            if any(o is None for o in outs):  # the others: allocated by the output rule
                values.update(_new_outputs(decl, values, values[decl.inputs[0].name]))
        variant = next(v for v in ops if v.outs == kind and v.flag == flag)
        op, names = ops[variant]
        schema_values = decl.expand(values, _is_tensor)
        schema_values.update({o.name: values[o.name] for o in decl.outs})
        result = op(*[schema_values[n] for n in names])
        if kind == "new":
            return result
        outs = [values[o.name] for o in decl.outs]
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)

    form.__name__ = form.__qualname__ = decl.name
    form.__signature__ = inspect.Signature(params)
    form.__doc__ = (
        f":func:`ropekv.{decl.name}` as torch custom ops ({', '.join(v.name for v in ops)}); "
        f"no ``stream=``: torch's current stream."
    )
    return form


for _decl in _declare.declarations("torch"):
    globals()[_decl.name] = _declared(_decl)
del _decl
