"""One declaration per op: each argument of its public function once, by name, with its role and
the form it takes.

An op module declares its public function in a :class:`Declaration` (``DECLARATIONS`` in the
module); what the rest of ropekv needs to know about the op follows from it and is written
nowhere else:

* the torch custom ops (``ropekv.torch``): their schemas with the eager defaults, their
  ``mutates_args``, their fakes, the variants an output argument implies (allocating, ``_out``,
  ``_in_place``) and the Python function that picks one;
* the JAX form (``ropekv.jax``): its inputs, its input-output aliases, the abstract values of its
  outputs and the order it returns them in;
* the output rule (``Declaration.outputs``): the shape and dtype of each output the op may
  allocate, from the arguments' metadata alone; one function for the torch fakes, the JAX
  abstract values and the torch forms' allocations;
* the lists of ops (``ropekv._registry`` names each op once, with its module; the API page, the
  framework modules, the bench and ``ropekv check`` follow from the registry);
* the shape, dtype and stride rules a first call binds in one C call
  (``Declaration.dim_program``: the program of ``ropekv._arrays.bind_dims`` for one form of a
  call, from the declared shapes; the paged op checks its common calls so, its checks in order
  deciding any other call and naming every error).

Roles (``Arg.role``):

``read``
    an array the op only reads;
``written``
    an array the op writes in place (a cache, ``status``, a scales array);
``out``
    an output array the caller may give (written) or leave to the op (allocated and returned,
    by the output rule); ``into`` names the input the op may write it into instead (``q_out=q``:
    the ``_in_place`` variant), and ``default_into`` makes that the default (the output is the
    input unless given);
``scalar``
    a Python value, static in the JAX form.

Forms (``Arg.form``) say how an argument is spelled in the eager call and what it becomes in a
torch schema, where everything is a tensor, a number, a string, a list or a dtype:

=====================  ==============================================  ======================
form                   eager value                                     schema arguments
=====================  ==============================================  ======================
``tensor``             an array                                        ``Tensor``
``pair``               a pair of arrays ``(a, b)``                     ``Tensor a, Tensor b``
``tensor_or_pair``     an array, or a pair ``(a, b)``                  ``Tensor a, Tensor? b``
``int`` ... ``str``    a number, a bool, a string                      the same
``floats``             a float or a pair of floats                     ``float[]``
``float_or_tensor``    a float, or an array                            ``float? a, Tensor? b``
``floats_or_tensor``   a float, a pair of floats, or an array          ``float[]? a, Tensor? b``
``ints``               a tuple of ints                                 ``SymInt[]``
``dtype``              a dtype (NumPy, its name, or torch)             ``ScalarType``
=====================  ==============================================  ======================

(``?`` wherever the argument may be None; ``a`` / ``b`` are ``Arg.parts``.)
"""

from __future__ import annotations

import importlib
import numbers
from typing import Any, NamedTuple

from ropekv._arrays import FLOAT32, INT32, UINT32
from ropekv._checks import check_flag

REQUIRED = object()  # the default of an argument the caller must give

READ, WRITTEN, OUT, SCALAR = "read", "written", "out", "scalar"
ARRAY_FORMS = ("tensor", "pair", "tensor_or_pair")
_SCALAR_SCHEMA = {
    "int": "SymInt",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "floats": "float[]",
    "ints": "SymInt[]",
    "dtype": "ScalarType",
}


class Arg(NamedTuple):
    """One argument of an op's public function."""

    name: str
    role: str
    form: str = "tensor"
    default: Any = REQUIRED
    parts: tuple = ()  # the schema's names of a pair or of a number-or-array argument
    into: str | None = None  # OUT: the input it may be written into (the _in_place variant)
    default_into: bool = False  # OUT: the input is the output unless one is given
    written_when: str | None = None  # READ: written too when this bool scalar is True
    alias: str | None = None  # OUT: an input it may be the very same array as (``into`` implies it)
    nullable: bool = False  # required, but None is a value (FlashInfer's q_nope, k_nope, v)
    check: Any = None  # SCALAR: the eager op's own check of it (value -> value), run first
    shape: tuple = ()  # an array: the shapes it may have, each spelled by its dims: "(T, Hq, D)"
    dtypes: tuple = ()  # an array: the dtypes it may have (NumPy dtypes; a str: that argument's)
    aka: tuple = ()  # a pair: its parts' names in the op's other form (MLA's ckv_cache, kpe_cache)
    layered: bool = False  # an array of one layer, or of all with layer_idx: (num_layers, ...)

    @property
    def optional(self):
        """None is a value of it (its default, or a required argument that may be None)."""
        return self.default is None or self.nullable

    @property
    def is_array(self):
        return self.form in ARRAY_FORMS

    @property
    def ndims(self):
        """The ranks of :attr:`shape`'s spellings, sorted, each once."""
        return tuple(sorted({_rank(s) for s in self.shape}))

    def allowed_dtypes(self, dtype_of):
        """The dtypes the array may have in a call: :attr:`dtypes`, each argument name replaced
        by ``dtype_of(name)`` (that argument's dtype in the call; None: not given, dropped)."""
        found = [dtype_of(d) if isinstance(d, str) else d for d in self.dtypes]
        return tuple(dict.fromkeys(d for d in found if d is not None))

    def schema_parts(self):
        """``[(schema name, schema type)]`` of this argument (types without the ``?``)."""
        if self.form == "tensor":
            return [(self.name, "Tensor")]
        if self.form in ("pair", "tensor_or_pair"):
            return [(p, "Tensor") for p in self.parts]
        if self.form == "float_or_tensor":
            return [(self.parts[0], "float"), (self.parts[1], "Tensor")]
        if self.form == "floats_or_tensor":
            return [(self.parts[0], "float[]"), (self.parts[1], "Tensor")]
        return [(self.name, _SCALAR_SCHEMA[self.form])]


def _rank(spelled):
    """The rank of a spelled shape: ``"(T, Hq, D)"`` 3, ``"(B + 1,)"`` 1, ``"()"`` 0."""
    inner = spelled.strip()
    if not (inner.startswith("(") and inner.endswith(")")):
        raise ValueError(f"a shape is spelled as a tuple of dims, got {spelled!r}")
    return len([d for d in inner[1:-1].split(",") if d.strip()])


def arg(name, role=READ, form="tensor", default=REQUIRED, **kw):
    """An :class:`Arg`; ``default=None`` makes it optional."""
    a = Arg(name, role, form, default, **kw)
    if a.shape:
        a.ndims  # noqa: B018 - a shape that is not spelled as a tuple fails here, at import
    if form in ("pair", "tensor_or_pair", "float_or_tensor", "floats_or_tensor"):
        if len(a.parts) != 2:
            raise ValueError(f"{name}: a {form} argument names its two schema parts")
    elif form not in ("tensor", *_SCALAR_SCHEMA):
        raise ValueError(f"{name}: unknown form {form!r}")
    if (role == SCALAR) == a.is_array:
        raise ValueError(f"{name}: role {role} with form {form}")
    return a


def array(name, **kw):
    """An array the op only reads (``optional=True``: None by default; ``nullable=True``:
    required, but may be None)."""
    return arg(name, READ, default=None if kw.pop("optional", False) else REQUIRED, **kw)


def written(name, **kw):
    """An array the op writes in place."""
    return arg(name, WRITTEN, default=None if kw.pop("optional", False) else REQUIRED, **kw)


def out(name, **kw):
    """An output the caller may give; allocated by the op otherwise."""
    return arg(name, OUT, default=None, **kw)


def scalar(name, form, default=REQUIRED, **kw):
    """A Python value of ``form`` ``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"floats"``,
    ``"float_or_tensor"``, ... (the table above)."""
    return arg(name, SCALAR, form, default, **kw)


def ragged_paged():
    """The ragged batch's index arrays of MAX's paged ops (MLA, QK-norm, fused QKV), in order."""
    return (
        array("input_row_offsets", shape=("(B + 1,)",), dtypes=(INT32, UINT32)),
        array("cache_lengths", shape=("(B,)",), dtypes=(INT32,)),
        array("block_table", shape=("(B, max_pages)",), dtypes=(INT32,)),
    )


# A paged K/V cache's dims in each kv_layout, as the declarations and the errors spell them (the
# paged, QK-norm and fused QKV ops and the torch / JAX output rules read this one table)
PAGED_LAYOUTS = {"NHD": "(num_pages, page_size, Hkv, D)", "HND": "(num_pages, Hkv, page_size, D)"}


def paged_layout(kv_layout):
    """``(dims, dims "for" the layout)`` of a paged cache in ``kv_layout`` (PAGED_LAYOUTS), as an
    error names what it expected."""
    spelled = PAGED_LAYOUTS[kv_layout]
    return spelled, f"{spelled} for {kv_layout}"


def paged_kv_cache(dtypes):
    """``paged_kv_cache=``: the (K, V) page pools MAX's paged ops write (QK-norm, fused QKV), in
    the NHD or HND layout, all layers of them with ``layer_idx``; ``dtypes`` as the op allows."""
    return arg(
        "paged_kv_cache",
        WRITTEN,
        "pair",
        parts=("k_cache", "v_cache"),
        shape=tuple(PAGED_LAYOUTS.values()),
        dtypes=dtypes,
        layered=True,
    )


def kv_cache_scales(layered=False):
    """``kv_cache_scales=``: the per-token-head scales a paged op writes beside an fp8 or int8
    cache (the paged and QK-norm ops), one array for K and one for V."""
    return arg(
        "kv_cache_scales",
        WRITTEN,
        "pair",
        None,
        parts=("k_scales", "v_scales"),
        shape=("(num_pages, page_size, Hkv)", "(num_pages, Hkv, page_size)"),
        dtypes=(FLOAT32,),
        layered=layered,
    )


def status():
    """``status=``: the int32 element an op writes (0, or the flag of a refused batch)."""
    return written("status", optional=True, shape=("(1,)", "()"), dtypes=(INT32,))


def _schema_default(value):
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


class Variant(NamedTuple):
    """One registered torch op of a declaration."""

    name: str  # torch.ops.ropekv.<name>
    outs: str  # "new" (allocated, returned), "given" (the _out op) or "into" (_in_place)
    flag: bool  # the value of the declaration's ``written_when`` flag this op stands for


class Declaration:
    """An op's public function, declared: ``args`` in the eager function's order.
    ``keyword``: arguments of the eager function that no functional form has (``stream``; torch
    and XLA choose it). ``outputs(values) -> {name: (shape, dtype)}``: the output rule, from
    ``values`` (``{name: value}`` of a call, arrays as ``ropekv._frameworks.MetaView``), for
    each ``out`` argument, in their order. ``capture_check(values, where)``: refuses a call that
    cannot be recorded into a graph (the JAX form's ``command_buffer_compatible=True``)."""

    def __init__(self, name, args, *, outputs=None, keyword=("stream",), capture_check=None):
        self.capture_check = capture_check  # (values, where): refuses a call XLA cannot record
        self.name = name
        self.args = tuple(args)
        self.keyword = tuple(keyword)
        self.outputs = outputs
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: an argument is declared twice")
        self.inputs = self.args
        self.outs = tuple(a for a in self.inputs if a.role == OUT)
        self.scalars = tuple(a for a in self.inputs if a.role == SCALAR)
        self.by_name = {a.name: a for a in self.args}
        flags = {a.written_when for a in self.inputs if a.written_when}
        if len(flags) > 1:
            raise ValueError(f"{name}: at most one written_when flag")
        self.flag = flags.pop() if flags else None

    def __repr__(self):
        return f"Declaration({self.name!r})"

    # ---- the API page ----------------------------------------------------------------------

    def arguments_rst(self):
        """The API page's table of the op's arguments: each with its role and, for an array,
        the shapes and dtypes it may have (reStructuredText, a ``list-table``)."""
        rows = [("argument", "role", "shape", "dtype", "default")]
        for a in self.inputs:
            names = ", ".join(f"``{p}``" for p in a.parts) if a.form == "pair" else f"``{a.name}``"
            if a.aka:
                names += f" (or {', '.join(f'``{p}``' for p in a.aka)})"
            if a.role == SCALAR and not a.shape:
                shape, dtypes = "", ""
            else:
                shape = " or ".join(f"``{s}``" for s in a.shape)
                if a.layered:
                    shape += "; with ``layer_idx``, ``num_layers`` first"
                dtypes = ", ".join(_dtype_text(d) for d in a.dtypes)
            default = "" if a.default is REQUIRED else f"``{a.default!r}``"
            if a.nullable:
                default = "(may be ``None``)"
            role = _FORM_TEXT[a.form] if a.role == SCALAR else _ROLE_TEXT[a.role]
            rows.append((names, role, shape, dtypes, default))
        lines = [f".. list-table:: Arguments of ``{self.name}``", "   :header-rows: 1", ""]
        for row in rows:
            lines += [f"   * - {row[0]}"] + [f"     - {cell}".rstrip() for cell in row[1:]]
        return "\n".join(lines) + "\n"

    # ---- a first call's shape and dtype rules, bound in one call -----------------------------

    def dim_program(self, slots, spellings, relations=(), rows=(), contiguous=(), scalars=()):
        """The program of :func:`ropekv._arrays.bind_dims` for one form of a call: ``spellings``
        maps each array the form takes (its launch name, an argument's or a pair's part's) to
        the one of its declared shapes it has in that form; ``slots`` are the launch's array
        names (an ``Op``'s, whose views the program reads); ``relations`` spell dims that follow
        from others (``"D = R + no_rope_dim"``); ``rows`` name the arrays read in rows (stride 1
        in their last dim), ``contiguous`` those that must be C-contiguous; ``scalars`` name the
        dims a call binds before any array (vars 0, 1, ...: ``bind_dims``' ``bound``). Each
        array's dtypes are its declaration's (an argument named there: that array's dtype).
        Returns ``(vars, program)``: ``{dim name: var}`` and the program."""
        names = dict(zip(scalars, range(len(scalars))))

        def var(token):
            if not token or token.isdigit():
                raise ValueError(f"{self.name}: a dim is a name, got {token!r}")
            return names.setdefault(token, len(names))

        entries = []
        for name, spelled in spellings.items():
            a = self._array_of(name)
            if spelled not in a.shape:
                raise ValueError(f"{self.name}: {name} is declared {a.shape}, not {spelled}")
            dims = tuple(var(t.strip()) for t in spelled.strip("()").split(",") if t.strip())
            dtypes = tuple(slots.index(d) if isinstance(d, str) else d for d in a.dtypes)
            contig = 2 if name in contiguous else 1 if name in rows else 0
            entries.append((slots.index(name), dims, dtypes, contig))
        rels = []
        for text in relations:
            lhs, rhs = (t.strip() for t in text.split("="))
            terms = [t.strip() for t in rhs.split("+")]
            k = sum(int(t) for t in terms if t.isdigit())
            dims = [names[t] for t in terms if not t.isdigit()]  # named in some spelling
            if not 1 <= len(dims) <= 2:
                raise ValueError(f"{self.name}: a relation sums one or two dims, got {text!r}")
            rels.append((names[lhs], dims[0], dims[1] if len(dims) > 1 else -1, k))
        return names, (len(names), tuple(entries), tuple(rels))

    def _array_of(self, name):
        """The declared array argument ``name`` is, itself or a part (or ``aka``) of a pair."""
        for a in self.inputs:
            if a.shape and (a.name == name or name in a.parts or name in a.aka):
                return a
        raise ValueError(f"{self.name}: no array {name!r} with declared shapes")

    # ---- what the op writes ----------------------------------------------------------------

    def written(self, variant):
        """Schema names of the arrays ``variant`` writes (its ``mutates_args``)."""
        names = []
        for a in self.inputs:
            writes = a.role == WRITTEN or (a.written_when and variant.flag)
            if a.role == OUT:
                writes = variant.outs == "given"
            elif any(o.into == a.name for o in self.outs):
                writes = writes or variant.outs == "into"
            if writes:
                names += [p for p, t in a.schema_parts() if t == "Tensor"]
        return tuple(names)

    # ---- the launch's roles (each op module's written arrays and in-place pairs) ------------

    def launch_written(self, names, rename=None):
        """The positions in ``names`` (an op's launch arrays: its ``Op`` names) of the arrays the
        op writes when they are given: every ``written`` array (each part of a pair) and every
        ``out``, in ascending order. ``rename`` maps a declared name to its launch name (the MLA
        form of the paged op names its caches ``ckv_cache`` / ``kpe_cache``)."""
        rename = rename or {}
        wanted = [
            rename.get(p, p)
            for a in self.inputs
            if a.role in (WRITTEN, OUT)
            for p, t in a.schema_parts()
            if t == "Tensor"
        ]
        return tuple(sorted(names.index(n) for n in wanted))

    def launch_written_when(self, names):
        """The positions in ``names`` of the read arrays written too when the declaration's
        ``written_when`` flag is on (the contiguous op's ``k`` with ``write_k_in_place``)."""
        return tuple(names.index(a.name) for a in self.inputs if a.written_when)

    def launch_layered(self, names):
        """The names in ``names`` (an op's launch arrays) of the arrays that carry a leading
        ``(num_layers, ...)`` dimension in a call with ``layer_idx`` (``Op(layered=...)``): each
        part of each ``layered`` argument, by its declared names and its ``aka``."""
        wanted = {n for a in self.inputs if a.layered for n in (a.name, *a.parts, *a.aka)}
        return tuple(n for n in names if n in wanted)

    def launch_in_place(self, names):
        """The pairs of positions in ``names`` that may be one array: each ``out`` with the input
        it may be written into (``into``, or ``alias`` where no ``_in_place`` variant exists)."""
        return [
            (names.index(a.into or a.alias), names.index(a.name))
            for a in self.outs
            if a.into or a.alias
        ]

    def variants(self):
        """The registered torch ops: the base op (allocating its outputs, or writing them into
        their inputs for ``default_into``), ``_out`` (the caller's outputs) and ``_in_place``
        (each output written into its ``into`` input), each also ``_<flag>`` variant."""
        kinds = []
        if not self.outs:
            kinds = [("", "new")]
        elif all(o.default_into for o in self.outs):
            kinds = [("", "into"), ("_out", "given")]
        else:
            kinds = [("", "new"), ("_out", "given")]
            if all(o.into for o in self.outs):
                kinds.append(("_in_place", "into"))
        flags = (False, True) if self.flag else (False,)
        suffix = {False: "", True: "_" + (self.flag or "").removeprefix("write_")}
        return [Variant(f"{self.name}{suffix[f]}{s}", kind, f) for f in flags for s, kind in kinds]

    # ---- the torch schema ------------------------------------------------------------------

    def schema(self, variant, defaults=True):
        """``(schema, {name: default})`` of ``variant``: the inputs' schema parts in order (the flag
        dropped: the variant implies it), a ``given`` variant's outputs right after the required
        ones (a custom op takes no keyword-only tensor), the arguments with defaults last, the
        ``new`` variant's outputs returned; the dict has the schema's arguments in order, each with
        its default (:data:`REQUIRED` for none)."""
        written = set(self.written(variant))
        required, rest = [], []
        for a in self.inputs:
            if a.name == self.flag or (a.role == OUT and variant.outs != "given"):
                continue
            for i, (name, typ) in enumerate(a.schema_parts()):
                if a.role == OUT:
                    optional, default = False, REQUIRED
                elif i == 0:
                    optional, default = a.optional, a.default
                else:  # the second part of a pair or of a number-or-array argument
                    optional = a.optional or a.form != "pair"
                    default = None if optional else REQUIRED
                if typ == "Tensor" and name in written:
                    typ = f"Tensor(a{len(required) + len(rest)}!)"
                text = f"{typ}{'?' if optional else ''} {name}"
                if default is REQUIRED:
                    required.append((text, name, default))
                else:
                    if defaults:
                        text += "=" + _schema_default(default)
                    rest.append((text, name, default))
        if variant.outs != "new":
            n = 0
        else:
            n = len(self.outs)
        returns = "()" if n == 0 else "Tensor" if n == 1 else f"({', '.join(['Tensor'] * n)})"
        args = [*required, *rest]
        text = f"({', '.join(t for t, _, _ in args)}) -> {returns}"
        return text, {name: default for _, name, default in args}

    # ---- between the eager call and the schema ---------------------------------------------

    def bind(self, args, kwargs, where, signature=None):
        """``{name: value}`` of a call ``where(*args, **kwargs)`` against ``signature`` (the
        eager one by default: every input but ``keyword``; positional up to the first
        keyword-only argument), defaults filled in; Python's own ``TypeError`` messages for a
        missing, unknown or repeated argument."""
        names = [a.name for a in self.inputs] if signature is None else list(signature)
        if len(args) > len(names):
            raise TypeError(
                f"{where}() takes {len(names)} positional arguments but {len(args)} were given"
            )
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
            if key in values:
                raise TypeError(f"{where}() got multiple values for argument {key!r}")
            values[key] = value
        for name in names:
            if name not in values:
                default = self.by_name[name].default
                if default is REQUIRED:
                    raise TypeError(f"{where}() missing required argument: {name!r}")
                values[name] = default
        return values

    def expand(self, values, is_array):
        """``values`` (eager spelling) as ``{schema name: value}``, with the eager messages for a
        pair that is not one; ``is_array(x)``: whether ``x`` is an array of the framework."""
        out = {}
        for a in self.inputs:
            v = values.get(a.name)
            if a.form == "tensor" or a.role == SCALAR and a.form not in _EXPANDED:
                out[a.name] = v
            elif a.form == "pair":
                out.update(zip(a.parts, (None, None) if v is None else pair(v, a)))
            elif a.form == "tensor_or_pair":
                out.update(zip(a.parts, pair(v, a) if isinstance(v, tuple | list) else (v, None)))
            elif a.form == "floats":
                out[a.name] = float_list(v, a.name)
            elif a.form in ("float_or_tensor", "floats_or_tensor"):
                number = a.form == "float_or_tensor"
                if is_array(v):
                    out.update(zip(a.parts, (None, v)))
                else:
                    out.update(zip(a.parts, (v if number else float_list(v, a.name), None)))
            elif a.form == "ints":
                out[a.name] = None if v is None else list(v)
        return out

    def collapse(self, schema_values):
        """``{schema name: value}`` back to the eager spelling ``{name: value}``."""
        out = {}
        for a in self.inputs:
            if a.form == "tensor" or a.role == SCALAR and a.form not in _EXPANDED:
                out[a.name] = schema_values.get(a.name)
                continue
            if a.form in ("pair", "tensor_or_pair"):
                x, y = (schema_values.get(p) for p in a.parts)
                if a.form == "tensor_or_pair":
                    out[a.name] = x if y is None else (x, y)
                else:
                    out[a.name] = None if x is None and y is None else (x, y)
            elif a.form == "floats":
                out[a.name] = floats_arg(schema_values.get(a.name))
            elif a.form in ("float_or_tensor", "floats_or_tensor"):
                number, tensor = (schema_values.get(p) for p in a.parts)
                if tensor is not None:
                    out[a.name] = tensor
                else:
                    out[a.name] = number if a.form == "float_or_tensor" else floats_arg(number)
            elif a.form == "ints":
                v = schema_values.get(a.name)
                out[a.name] = None if v is None else tuple(v)
        return out

    def check_scalars(self, values):
        """The scalar checks a functional form runs before anything else (the eager op runs
        the rest): each bool flag a bool, and each scalar with its own ``check`` (``layer_idx``)
        through it, with the eager messages; returns ``values`` with the checked values."""
        for a in self.scalars:
            v = values.get(a.name)
            if a.form == "bool":
                values[a.name] = check_flag(v, a.name)
            elif a.check is not None and v is not None:
                values[a.name] = a.check(v)
        return values

    def metas(self, values, is_array, meta):
        """``values`` with every array as ``meta(array, name)`` (its metadata, for the output
        rule), a pair's arrays named by their schema parts."""
        out = dict(values)
        for a in self.inputs:
            v = values.get(a.name)
            if is_array(v):
                out[a.name] = meta(v, a.parts[0] if a.parts else a.name)
            elif isinstance(v, tuple | list) and a.is_array:
                out[a.name] = tuple(
                    meta(x, p) if is_array(x) else x for x, p in zip(v, a.parts or (a.name,) * 2)
                )
        return out

    def written_arrays(self, values):
        """``[(name, value)]`` of the arrays a call with ``values`` writes in place (the
        functional forms return them, in this order, after the outputs): each given written
        array (a pair as a pair), and the flag's array when the flag is on."""
        found = []
        for a in self.inputs:
            writes = a.role == WRITTEN or (a.written_when and values.get(a.written_when))
            if writes and values.get(a.name) is not None:
                found.append((a.name, values[a.name]))
        return found


_EXPANDED = ("floats", "float_or_tensor", "floats_or_tensor", "ints")
_ROLE_TEXT = {READ: "read", WRITTEN: "written in place", OUT: "output (allocated if not given)"}
_FORM_TEXT = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "floats": "float or pair of floats",
    "ints": "tuple of ints",
    "dtype": "dtype",
    "float_or_tensor": "float or array",
    "floats_or_tensor": "float, pair of floats or array",
}


def _dtype_text(d):
    return f"{d}'s dtype" if isinstance(d, str) else str(d)


def pair(value, a):
    """The two arrays of pair argument ``a`` (ValueError naming it for anything else)."""
    if not isinstance(value, tuple | list) or len(value) != 2 or any(x is None for x in value):
        shown = type(value).__qualname__
        if isinstance(value, tuple | list):
            shown += f" of length {len(value)}"
        raise ValueError(
            f"{a.name} must be a pair of arrays ({a.parts[0]}, {a.parts[1]}), got {shown}"
        )
    return value[0], value[1]


def float_list(value, name):
    """A float or a pair of floats (or None) as a list of floats; TypeError naming ``name``
    for anything else (the eager op checks the count and the values)."""
    if value is None:
        return None
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 2) <= 1:
        value = tuple(value.reshape(-1).tolist())
    values = value if isinstance(value, tuple | list) else (value,)
    for s in values:
        if isinstance(s, bool) or not isinstance(s, numbers.Real):
            raise TypeError(f"{name} must be a float or a pair of floats, got {value!r}")
    return [float(s) for s in values]


def floats_arg(values):
    """A schema's list of floats back to the eager value: None, a float or a pair."""
    if values is None:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def declarations(framework):
    """The declarations of the registry's ops that have a form in ``framework`` (``"torch"`` or
    ``"jax"``), in registry order. Every op of the registry is declared: its module's
    ``DECLARATIONS`` names it (``TypeError`` otherwise)."""
    from ropekv import _registry

    return [declaration(entry) for entry in _registry.OPS if getattr(entry, framework)]


def declaration(entry):
    """The declaration of the registry's op ``entry`` (a ``_registry.OpEntry``): its module's
    ``DECLARATIONS`` names it (``TypeError`` otherwise)."""
    module = importlib.import_module(f"ropekv.{entry.module}")
    decl = next((d for d in getattr(module, "DECLARATIONS", ()) if d.name == entry.name), None)
    if decl is None:
        raise TypeError(f"ropekv.{entry.module} declares no {entry.name} (DECLARATIONS)")
    return decl
