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
"""

# torch's schema inference reads typing.Optional / List / Tuple on every torch version we support
# ruff: noqa: UP006, UP035, UP045
import inspect
import typing
from typing import List, Optional

import numpy as np
import torch

import ropekv
from ropekv import _checks as ck
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


def _scale_list(kv_scale, name="kv_scale"):
    """``kv_scale`` (None, a number, or a pair) as the op's ``float[]?``; the eager op checks the
    count and the values."""
    if kv_scale is None:
        return None
    values = kv_scale if isinstance(kv_scale, (tuple, list)) else (kv_scale,)
    for s in values:
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(
                f"{name} must be a float or a (k_scale, v_scale) pair of floats, got {kv_scale!r}"
            )
    return [float(s) for s in values]


def _scale_arg(kv_scale):
    """The op's ``float[]?`` back to the eager op's ``kv_scale``: None, a float or a pair."""
    if kv_scale is None:
        return None
    return kv_scale[0] if len(kv_scale) == 1 else tuple(kv_scale)


def _pair(caches, message):
    if not isinstance(caches, (tuple, list)) or len(caches) != 2:
        raise ValueError(message)
    return caches[0], caches[1]


def _flag(value, name):
    """A bool option, checked as the eager op checks it (torch's schema would take an int)."""
    return ck.check_flag(value, name)


def _eager(fn, *args, **kwargs):
    """Run the eager op ``fn`` on torch's current stream (ropekv's default for torch tensors,
    which is also the capture stream inside ``torch.cuda.graph``). Tensors that require grad are
    read as they are: ropekv reads their memory, never their autograd history (the ops have no
    derivative; backward through one raises torch's "no autograd formula" error)."""
    return fn(*args, **kwargs)


def _no_outputs(*args, **kwargs):
    """The fake of an op that only writes its arguments."""


def _optional(annotation):
    return typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(
        annotation
    )


# The schemas carry the eager functions' defaults from torch 2.13 on. Before it (2.11 on the H200
# machines) the dispatcher leaves out trailing arguments equal to their defaults and torch's
# in-place version bump of a custom op indexes the mutated arguments past them (IndexError in
# custom_ops.adinplaceorview_impl, which 2.13 mends with fill_defaults); there the raw ops take
# every argument, as before.
SCHEMA_DEFAULTS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _with_eager_defaults(fn, eager):
    """``fn``, a registered op's function, given the defaults of the eager function ``eager``, so
    that the op's schema has them (``torch.library.custom_op`` infers the schema from the
    signature, defaults included) and ``torch.ops.ropekv.<op>`` can be called with its required
    arguments only. An argument named as one of the eager function's takes that default, but for
    a tensor the op requires (the output an ``_out`` op writes, None in the eager function); one
    of the op's own (``kv_scales``, ``kpe_cache``, ``k_scales`` / ``v_scales``,
    ``quant_scales_q``: a part of an eager argument) defaults to None when it is optional. The
    defaults run from the last required argument to the end (custom ops take no keyword-only
    tensors, so an ``_out`` op's outputs follow its other required arguments)."""
    if not SCHEMA_DEFAULTS:
        return fn
    eager_params = inspect.signature(eager).parameters
    params = list(inspect.signature(fn).parameters.values())
    empty = inspect.Parameter.empty

    def default(p):
        e = eager_params.get(p.name)
        if e is None:
            return None if _optional(p.annotation) else empty
        if e.default is None and not _optional(p.annotation):
            return empty
        return e.default

    wanted = [default(p) for p in params]
    n = 0
    while n < len(params) and wanted[len(params) - 1 - n] is not empty:
        n += 1
    missed = [p.name for p, d in zip(params[: len(params) - n], wanted) if d is not empty]
    if missed:  # an optional argument before a required one: the op's order must change
        raise TypeError(f"{fn.__qualname__}: no default for {missed} (a required argument after)")
    fn.__defaults__ = tuple(wanted[len(params) - n :])
    return fn


def _custom_op(name, fn, eager, mutates_args, fake=None):
    """``torch.library.custom_op`` of ``fn`` (with ``eager``'s defaults) as ``ropekv::name``, its
    fake ``fake`` (none: the op only writes its arguments). The dispatcher may leave out trailing
    arguments that have their defaults: the fake sees every argument, the defaults filled in."""
    signature = inspect.signature(_with_eager_defaults(fn, eager))
    op = torch.library.custom_op(f"ropekv::{name}", fn, mutates_args=mutates_args)
    if fake is None:
        op.register_fake(_no_outputs)
    else:

        def full_fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return fake(*bound.args, **bound.kwargs)

        op.register_fake(full_fake)
    return op


# ---- mla_rope_rmsnorm_append_paged_kv_cache ----------------------------------------------------


def _mla_ops():
    name = "mla_rope_rmsnorm_append_paged_kv_cache"

    def run(
        q_rope,
        kv,
        gamma,
        cos_sin_cache,
        input_row_offsets,
        cache_lengths,
        block_table,
        kv_cache,
        kpe_cache,
        epsilon,
        kv_norm_dim,
        is_neox,
        kv_scale,
        clear,
        status,
        layer_idx,
        q_rope_out,
    ):
        cache = kv_cache if kpe_cache is None else (kv_cache, kpe_cache)
        _eager(
            ropekv.mla_rope_rmsnorm_append_paged_kv_cache,
            q_rope,
            kv,
            gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            cache,
            epsilon=epsilon,
            kv_norm_dim=kv_norm_dim,
            is_neox=is_neox,
            kv_scale=kv_scale,
            q_rope_out=q_rope_out,
            clear_unused_last_page_rows=clear,
            status=status,
            layer_idx=layer_idx,
        )

    def allocating(
        q_rope: Tensor,
        kv: Tensor,
        gamma: Tensor,
        cos_sin_cache: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        kv_cache: Tensor,
        kpe_cache: Optional[Tensor],
        epsilon: float,
        kv_norm_dim: Optional[int],
        is_neox: bool,
        kv_scale: Optional[float],
        clear_unused_last_page_rows: bool,
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> Tensor:
        out = _like_q(q_rope, "q_rope", "(T, Hq, R)")
        run(
            q_rope,
            kv,
            gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            kv_cache,
            kpe_cache,
            epsilon,
            kv_norm_dim,
            is_neox,
            kv_scale,
            clear_unused_last_page_rows,
            status,
            layer_idx,
            out,
        )
        return out

    def into(
        q_rope: Tensor,
        kv: Tensor,
        gamma: Tensor,
        cos_sin_cache: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        kv_cache: Tensor,
        q_rope_out: Tensor,
        kpe_cache: Optional[Tensor],
        epsilon: float,
        kv_norm_dim: Optional[int],
        is_neox: bool,
        kv_scale: Optional[float],
        clear_unused_last_page_rows: bool,
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> None:
        run(
            q_rope,
            kv,
            gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            kv_cache,
            kpe_cache,
            epsilon,
            kv_norm_dim,
            is_neox,
            kv_scale,
            clear_unused_last_page_rows,
            status,
            layer_idx,
            q_rope_out,
        )

    def in_place(
        q_rope: Tensor,
        kv: Tensor,
        gamma: Tensor,
        cos_sin_cache: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        kv_cache: Tensor,
        kpe_cache: Optional[Tensor],
        epsilon: float,
        kv_norm_dim: Optional[int],
        is_neox: bool,
        kv_scale: Optional[float],
        clear_unused_last_page_rows: bool,
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> None:
        run(
            q_rope,
            kv,
            gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            kv_cache,
            kpe_cache,
            epsilon,
            kv_norm_dim,
            is_neox,
            kv_scale,
            clear_unused_last_page_rows,
            status,
            layer_idx,
            q_rope,
        )

    return _three_ops(
        name,
        allocating,
        into,
        in_place,
        ("kv_cache", "kpe_cache", "status"),
        "q_rope",
        "q_rope_out",
        "(T, Hq, R)",
    )


def _like_q(q, name, layout):
    """An empty output shaped like ``q`` (checked as the eager op's first checks would)."""
    shape, dtype = fw.same_as_q(_meta(q, name), layout)
    return q.new_empty(shape, dtype=_torch_dtype(dtype))


def _three_ops(name, allocating, into, in_place, caches, q_name, out_name, layout, fake=None):
    """Register the allocating, ``_out`` and ``_in_place`` ops of an op with one q output (the
    allocating op's fake: ``fake``, by default an empty tensor like ``q``)."""
    eager = getattr(ropekv, name)
    fake = fake or (lambda q, *rest: _like_q(q, q_name, layout))
    op = _custom_op(name, allocating, eager, caches, fake)
    op_out = _custom_op(f"{name}_out", into, eager, (*caches, out_name))
    op_in_place = _custom_op(f"{name}_in_place", in_place, eager, (*caches, q_name))
    return op, op_out, op_in_place


_mla = _mla_ops()


def _pick(ops, q, out):
    """(op, output args, result) for an op with one q output: allocating, in place, or into
    the caller's tensor (the ``_out`` op takes it after its required arguments)."""
    op, op_out, op_in_place = ops
    if out is None:
        return op, (), None
    if out is q:
        return op_in_place, (), q
    return op_out, (out,), out


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
    q_rope_out=None,
    clear_unused_last_page_rows=False,
    status=None,
    layer_idx=None,
):
    """:func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache` as a custom op; returns
    ``q_rope_out``.

    ``kv_cache`` is one tensor or a ``(ckv, kpe)`` pair (the op's ``kv_cache`` and ``kpe_cache``).
    Runs ``torch.ops.ropekv.mla_rope_rmsnorm_append_paged_kv_cache`` (allocates ``q_rope_out``),
    ``..._out`` (writes the given ``q_rope_out``) or ``..._in_place`` (``q_rope_out=q_rope``).
    No ``stream=``. ``status`` (an int32 tensor of one element) is written in place (every form
    declares it mutated); ``layer_idx`` writes one layer of caches with a leading
    ``(num_layers, ...)`` dimension, as the eager op.
    """
    if isinstance(kv_cache, (tuple, list)):
        ckv, kpe = _pair(
            kv_cache,
            f"kv_cache must be one array (num_pages, page_size, L + R) or "
            f"a tuple (ckv, kpe), got a {type(kv_cache).__name__} of "
            f"{len(kv_cache)} arrays",
        )
    else:
        ckv, kpe = kv_cache, None
    op, extra, result = _pick(_mla, q_rope, q_rope_out)
    out = op(
        q_rope,
        kv,
        gamma,
        cos_sin_cache,
        input_row_offsets,
        cache_lengths,
        block_table,
        ckv,
        *extra,
        kpe,
        epsilon,
        kv_norm_dim,
        bool(is_neox),
        kv_scale,
        _flag(clear_unused_last_page_rows, "clear_unused_last_page_rows"),
        status,
        fw.layer_index(layer_idx),
    )
    return out if result is None else result


# ---- qk_rmsnorm_rope_append_paged_kv_cache -----------------------------------------------------


def _qknorm_out(q, q_out_dtype):
    """An empty ``q_out`` in ``q_out_dtype`` (checked as the eager op checks it)."""
    shape, dtype = fw.qknorm_q_output(_meta(q, "q"), q_out_dtype)
    return q.new_empty(shape, dtype=_torch_dtype(dtype))


def _qknorm_ops():
    name = "qk_rmsnorm_rope_append_paged_kv_cache"

    def run(
        q,
        k,
        v,
        q_gamma,
        k_gamma,
        cos_sin_cache,
        input_row_offsets,
        cache_lengths,
        block_table,
        k_cache,
        v_cache,
        epsilon,
        is_neox,
        kv_layout,
        kv_scale,
        options,
        q_out,
    ):
        (
            norm_order,
            weight_offset,
            clear,
            position_ids,
            mrope_section,
            mrope_interleaved,
            q_out_dtype,
            q_scale,
            q_scale_out,
            k_scales,
            v_scales,
            status,
            layer_idx,
        ) = options
        _eager(
            ropekv.qk_rmsnorm_rope_append_paged_kv_cache,
            q,
            k,
            v,
            q_gamma,
            k_gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            (k_cache, v_cache),
            epsilon=epsilon,
            is_neox=is_neox,
            kv_layout=kv_layout,
            kv_scale=_scale_arg(kv_scale),
            q_out=q_out,
            q_out_dtype=q_out_dtype,
            q_scale=q_scale,
            q_scale_out=q_scale_out,
            kv_cache_scales=None if k_scales is None else (k_scales, v_scales),
            norm_order=norm_order,
            weight_offset=weight_offset,
            clear_unused_last_page_rows=clear,
            position_ids=position_ids,
            mrope_section=fw.mrope_tuple(mrope_section),
            mrope_interleaved=mrope_interleaved,
            status=status,
            layer_idx=layer_idx,
        )

    def allocating(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_gamma: Tensor,
        k_gamma: Tensor,
        cos_sin_cache: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        epsilon: float,
        is_neox: bool,
        kv_layout: str,
        kv_scale: Optional[List[float]],
        norm_order: str,
        weight_offset: float,
        clear_unused_last_page_rows: bool,
        position_ids: Optional[Tensor],
        mrope_section: Optional[List[int]],
        mrope_interleaved: bool,
        q_out_dtype: Optional[torch.dtype],
        q_scale: Optional[float],
        q_scale_out: Optional[Tensor],
        k_scales: Optional[Tensor],
        v_scales: Optional[Tensor],
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> Tensor:
        out = _qknorm_out(q, q_out_dtype)
        run(
            q,
            k,
            v,
            q_gamma,
            k_gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            k_cache,
            v_cache,
            epsilon,
            is_neox,
            kv_layout,
            kv_scale,
            (
                norm_order,
                weight_offset,
                clear_unused_last_page_rows,
                position_ids,
                mrope_section,
                mrope_interleaved,
                q_out_dtype,
                q_scale,
                q_scale_out,
                k_scales,
                v_scales,
                status,
                layer_idx,
            ),
            out,
        )
        return out

    def into(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_gamma: Tensor,
        k_gamma: Tensor,
        cos_sin_cache: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        q_out: Tensor,
        epsilon: float,
        is_neox: bool,
        kv_layout: str,
        kv_scale: Optional[List[float]],
        norm_order: str,
        weight_offset: float,
        clear_unused_last_page_rows: bool,
        position_ids: Optional[Tensor],
        mrope_section: Optional[List[int]],
        mrope_interleaved: bool,
        q_out_dtype: Optional[torch.dtype],
        q_scale: Optional[float],
        q_scale_out: Optional[Tensor],
        k_scales: Optional[Tensor],
        v_scales: Optional[Tensor],
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> None:
        run(
            q,
            k,
            v,
            q_gamma,
            k_gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            k_cache,
            v_cache,
            epsilon,
            is_neox,
            kv_layout,
            kv_scale,
            (
                norm_order,
                weight_offset,
                clear_unused_last_page_rows,
                position_ids,
                mrope_section,
                mrope_interleaved,
                q_out_dtype,
                q_scale,
                q_scale_out,
                k_scales,
                v_scales,
                status,
                layer_idx,
            ),
            q_out,
        )

    def in_place(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_gamma: Tensor,
        k_gamma: Tensor,
        cos_sin_cache: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        epsilon: float,
        is_neox: bool,
        kv_layout: str,
        kv_scale: Optional[List[float]],
        norm_order: str,
        weight_offset: float,
        clear_unused_last_page_rows: bool,
        position_ids: Optional[Tensor],
        mrope_section: Optional[List[int]],
        mrope_interleaved: bool,
        q_out_dtype: Optional[torch.dtype],
        q_scale: Optional[float],
        q_scale_out: Optional[Tensor],
        k_scales: Optional[Tensor],
        v_scales: Optional[Tensor],
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> None:
        run(
            q,
            k,
            v,
            q_gamma,
            k_gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            k_cache,
            v_cache,
            epsilon,
            is_neox,
            kv_layout,
            kv_scale,
            (
                norm_order,
                weight_offset,
                clear_unused_last_page_rows,
                position_ids,
                mrope_section,
                mrope_interleaved,
                q_out_dtype,
                q_scale,
                q_scale_out,
                k_scales,
                v_scales,
                status,
                layer_idx,
            ),
            q,
        )

    def fake(q, *args):
        return _qknorm_out(q, args[20])  # q_out_dtype

    return _three_ops(
        name,
        allocating,
        into,
        in_place,
        ("k_cache", "v_cache", "q_scale_out", "k_scales", "v_scales", "status"),
        "q",
        "q_out",
        "(T, Hq, D)",
        fake,
    )


_qknorm = _qknorm_ops()


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
    q_out=None,
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
):
    """:func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache` as a custom op; returns ``q_out``.

    Runs ``torch.ops.ropekv.qk_rmsnorm_rope_append_paged_kv_cache`` (allocates ``q_out``, in
    ``q_out_dtype``: ``q``'s or fp8), ``..._out`` (writes the given ``q_out``) or
    ``..._in_place`` (``q_out=q``). ``kv_scale`` (a float or a pair) passes as a list of floats,
    ``mrope_section`` as a list of ints, ``q_out_dtype`` as a torch dtype (a NumPy dtype or a
    name is converted). No ``stream=``. ``q_scale_out``, ``kv_cache_scales`` (a pair, the op's
    ``k_scales`` and ``v_scales``) and ``status`` (an int32 tensor of one element) are written
    in place when given (every form declares them mutated); ``layer_idx`` writes one layer of
    caches with a leading ``(num_layers, ...)`` dimension (and of ``kv_cache_scales``' arrays),
    as the eager op.
    """
    k_cache, v_cache = _pair(
        paged_kv_cache,
        f"paged_kv_cache must be a tuple (k_cache, v_cache), got {type(paged_kv_cache).__name__}",
    )
    if kv_cache_scales is not None and (
        not isinstance(kv_cache_scales, (tuple, list)) or len(kv_cache_scales) != 2
    ):
        raise ValueError(
            f"kv_cache_scales must be a tuple (k_scales, v_scales), got "
            f"{type(kv_cache_scales).__name__}"
        )
    k_scales, v_scales = (None, None) if kv_cache_scales is None else kv_cache_scales
    if q_out_dtype is not None and not isinstance(q_out_dtype, torch.dtype):
        # a NumPy dtype or a name: checked (the eager message) and passed as a torch dtype
        q_out_dtype = _torch_dtype(fw.qknorm_q_output(_meta(q, "q"), q_out_dtype)[1])
    op, extra, result = _pick(_qknorm, q, q_out)
    out = op(
        q,
        k,
        v,
        q_gamma,
        k_gamma,
        cos_sin_cache,
        input_row_offsets,
        cache_lengths,
        block_table,
        k_cache,
        v_cache,
        *extra,
        epsilon,
        bool(is_neox),
        kv_layout,
        _scale_list(kv_scale),
        norm_order,
        weight_offset,
        _flag(clear_unused_last_page_rows, "clear_unused_last_page_rows"),
        position_ids,
        fw.mrope_list(mrope_section),
        _flag(mrope_interleaved, "mrope_interleaved"),
        q_out_dtype,
        q_scale,
        q_scale_out,
        k_scales,
        v_scales,
        status,
        fw.layer_index(layer_idx),
    )
    return out if result is None else result


# ---- fused_qkv_matmul_append_paged_kv_cache ----------------------------------------------------


def _qkv_out(hidden_state, k_cache, num_q_heads, kv_layout, layer_idx):
    shape, dtype = fw.qkv_output(
        _meta(hidden_state, "hidden_state"),
        _meta(k_cache, "k_cache"),
        num_q_heads,
        kv_layout,
        layer_idx,
    )
    return hidden_state.new_empty(shape, dtype=_torch_dtype(dtype))


def _qkv_ops():
    name = "fused_qkv_matmul_append_paged_kv_cache"

    def into(
        hidden_state: Tensor,
        weight: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        num_q_heads: int,
        out: Tensor,
        cos_sin_cache: Optional[Tensor],
        is_neox: bool,
        kv_layout: str,
        kv_scale: Optional[List[float]],
        weight_scales: Optional[Tensor],
        group_size: Optional[int],
        zero_points: Optional[Tensor],
        clear_unused_last_page_rows: bool,
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> None:
        # a call that runs cuBLAS takes a capturing stream itself: its plan's capture plan (the
        # fused kernel), or its refusal
        _eager(
            ropekv.fused_qkv_matmul_append_paged_kv_cache,
            hidden_state,
            weight,
            input_row_offsets,
            cache_lengths,
            block_table,
            (k_cache, v_cache),
            num_q_heads=num_q_heads,
            cos_sin_cache=cos_sin_cache,
            is_neox=is_neox,
            kv_layout=kv_layout,
            kv_scale=_scale_arg(kv_scale),
            weight_scales=weight_scales,
            group_size=group_size,
            zero_points=zero_points,
            out=out,
            clear_unused_last_page_rows=clear_unused_last_page_rows,
            status=status,
            layer_idx=layer_idx,
        )

    def allocating(
        hidden_state: Tensor,
        weight: Tensor,
        input_row_offsets: Tensor,
        cache_lengths: Tensor,
        block_table: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        num_q_heads: int,
        cos_sin_cache: Optional[Tensor],
        is_neox: bool,
        kv_layout: str,
        kv_scale: Optional[List[float]],
        weight_scales: Optional[Tensor],
        group_size: Optional[int],
        zero_points: Optional[Tensor],
        clear_unused_last_page_rows: bool,
        status: Optional[Tensor],
        layer_idx: Optional[int],
    ) -> Tensor:
        out = _qkv_out(hidden_state, k_cache, num_q_heads, kv_layout, layer_idx)
        into(
            hidden_state,
            weight,
            input_row_offsets,
            cache_lengths,
            block_table,
            k_cache,
            v_cache,
            num_q_heads,
            out,
            cos_sin_cache,
            is_neox,
            kv_layout,
            kv_scale,
            weight_scales,
            group_size,
            zero_points,
            clear_unused_last_page_rows,
            status,
            layer_idx,
        )
        return out

    def fake(
        hidden_state,
        weight,
        input_row_offsets,
        cache_lengths,
        block_table,
        k_cache,
        v_cache,
        num_q_heads,
        cos_sin_cache,
        is_neox,
        kv_layout,
        kv_scale,
        weight_scales,
        group_size,
        zero_points,
        clear_unused_last_page_rows,
        status,
        layer_idx,
    ):
        return _qkv_out(hidden_state, k_cache, num_q_heads, kv_layout, layer_idx)

    eager = ropekv.fused_qkv_matmul_append_paged_kv_cache
    op = _custom_op(name, allocating, eager, ("k_cache", "v_cache", "status"), fake)
    op_out = _custom_op(f"{name}_out", into, eager, ("k_cache", "v_cache", "status", "out"))
    return op, op_out


_qkv = _qkv_ops()


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
    out=None,
    clear_unused_last_page_rows=False,
    status=None,
    layer_idx=None,
):
    """:func:`ropekv.fused_qkv_matmul_append_paged_kv_cache` as a custom op; returns ``out``.

    Runs ``torch.ops.ropekv.fused_qkv_matmul_append_paged_kv_cache`` (allocates ``out``) or
    ``..._out`` (writes the given ``out``). ``kv_scale`` passes as a list of floats. No
    ``stream=``. Calls that run cuBLAS on temporaries eagerly run the fused kernel under
    CUDA-graph capture, up to ``ropekv.qkv.GRAPH_MAX_TOKENS`` tokens on sm_90; beyond (see
    ``ropekv.qkv.graph_safe``) they raise ``ValueError`` under capture. ``status`` (an int32
    tensor of one element) is written in place (both forms declare it mutated); ``layer_idx``
    writes one layer of caches with a leading ``(num_layers, ...)`` dimension, as the eager op.
    """
    k_cache, v_cache = _pair(
        paged_kv_cache,
        f"paged_kv_cache must be a (k_cache, v_cache) pair, "
        f"got {type(paged_kv_cache).__qualname__}",
    )
    op, op_out = _qkv
    args = (
        hidden_state,
        weight,
        input_row_offsets,
        cache_lengths,
        block_table,
        k_cache,
        v_cache,
        num_q_heads,
        cos_sin_cache,
        bool(is_neox),
        kv_layout,
        _scale_list(kv_scale),
        weight_scales,
        group_size,
        zero_points,
        _flag(clear_unused_last_page_rows, "clear_unused_last_page_rows"),
        status,
        fw.layer_index(layer_idx),
    )
    if out is None:
        return op(*args)
    op_out(*args[:8], out, *args[8:])  # out after the required arguments
    return out


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
        new = {}
        if variant.outs == "new" and decl.outs:
            new = _new_outputs(decl, values, values[first])
            values.update(new)
        result = eager(**values)
        if variant.outs != "new":
            return None
        if decl.outs:
            outs = [values[o.name] for o in decl.outs]
        else:
            outs = list(result) if len(decl.results) > 1 else [result]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def fake(*args, **kwargs):
        if variant.outs != "new":
            return None
        values = values_of(args, kwargs)
        if decl.outs:
            outs = list(_new_outputs(decl, values, values[first]).values())
        else:
            outs = [torch.empty_like(values[r.into]) for r in decl.results]
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
        values = decl.bind(args, kwargs, where)
        for a in decl.inputs:
            if a.role == SCALAR_ROLE and a.form == "bool":
                values[a.name] = ck.check_flag(values[a.name], a.name)
            elif a.form == "dtype" and values[a.name] is not None:
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


SCALAR_ROLE = _declare.SCALAR
for _entry in _registry.OPS:
    _decl = _declare.declaration_of(_entry)
    if _decl is not None and _entry.torch:
        globals()[_entry.name] = _declared(_decl)
del _entry, _decl
