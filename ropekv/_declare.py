"""One declaration per op: each argument once, by name, with its role and what it may be.

An op module declares its public function's arguments in a :class:`Declaration`; what the rest
of ropekv needs to know about the op follows from it and is never written again:

* the one call path's :class:`ropekv._launch.Op`: its array arguments in order, its scalar
  arguments with how each enters the plan key, and which arguments it writes (by name);
* the argument checks that come before the op's own (:meth:`Declaration.check_call`: a scalar of
  the wrong type is a ``TypeError`` naming it, in declaration order);
* the torch custom op (``ropekv.torch``): its schema, with defaults, its ``mutates_args`` and its
  fake, which allocates the declared results;
* the JAX form (``ropekv.jax``): its input-output aliases and the abstract values of its results;
* the output rule (:meth:`Declaration.results`): the shape and dtype of each new result, one
  function shared by the eager op (which allocates with it), the torch fake and the JAX form.

Roles:

``read``
    an array the op only reads;
``written``
    an array the op writes (in place) and never reads as an input;
``in_place``
    an array read and written: the op's result lands in it;
``new``
    a result the op allocates and returns, shaped and typed like the argument ``like`` (the
    functional forms run the op in place on a copy of ``like``: see ``via``);
``scalar``
    a Python value: ``int``, ``float``, ``bool`` or ``str``.

Imports nothing of ropekv's but the launch constants, so the frameworks' modules can read every
declaration without touching a GPU.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

from ropekv._checks import check_flag
from ropekv._launch import FLAG, INT, KEY, Op

REQUIRED = object()  # the default of an argument the caller must give

READ, WRITTEN, IN_PLACE, NEW, SCALAR = "read", "written", "in_place", "new", "scalar"
_SCALAR_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
_PLAN_KEY = {"int": INT, "bool": FLAG, "float": KEY, "str": KEY}  # how a scalar enters a plan key
_SCHEMA = {"int": "SymInt", "float": "float", "bool": "bool", "str": "str"}


class Arg(NamedTuple):
    """One argument of an op's public function."""

    name: str
    role: str  # READ, WRITTEN, IN_PLACE, NEW or SCALAR
    type: str = "tensor"  # "tensor", or a scalar's "int" / "float" / "bool" / "str"
    default: Any = REQUIRED
    like: str | None = None  # NEW: the argument whose shape and dtype the result takes
    doc: str = ""

    @property
    def optional(self):
        return self.default is None

    @property
    def is_array(self):
        return self.role != SCALAR

    def schema(self, defaults, alias=None):
        """This argument in a torch schema (``Tensor`` / ``Tensor(a0!)?`` / ``SymInt`` / ...);
        ``alias``: the alias set of a written array."""
        if self.is_array:
            written = f"(a{alias}!)" if self.role in (WRITTEN, IN_PLACE) else ""
            text = f"Tensor{written}{'?' if self.optional else ''}"
        else:
            text = _SCHEMA[self.type] + ("?" if self.optional else "")
        text += f" {self.name}"
        if defaults and self.default is not REQUIRED:
            text += "=" + _schema_default(self.default)
        return text


def array(name, *, optional=False, doc=""):
    """An array the op only reads."""
    return Arg(name, READ, default=None if optional else REQUIRED, doc=doc)


def written(name, *, optional=False, doc=""):
    """An array the op writes (the addressed slots of a cache, an output given by the caller)."""
    return Arg(name, WRITTEN, default=None if optional else REQUIRED, doc=doc)


def in_place(name, *, doc=""):
    """An array the op reads and writes its result into."""
    return Arg(name, IN_PLACE, doc=doc)


def new(name, *, like, doc=""):
    """A result the op allocates, shaped and typed like the argument ``like``."""
    return Arg(name, NEW, like=like, doc=doc)


def scalar(name, type, default=REQUIRED, *, doc=""):
    """A Python value: ``type`` is ``"int"``, ``"float"``, ``"bool"`` or ``"str"``."""
    if type not in _SCALAR_TYPES:
        raise ValueError(f"{name}: unknown scalar type {type!r}")
    return Arg(name, SCALAR, type, default, doc=doc)


def _schema_default(value):
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


class Declaration:
    """An op's public function, declared: ``args`` in the function's order (``new`` results are
    not arguments of the eager function; they are its return value, in declaration order), and
    ``keyword`` the names of the keyword-only arguments the eager function takes beside them
    (``enable_pdl``, ``stream``) that no functional form has.

    ``via``: for an op whose results are new arrays, the declaration of its in-place sibling
    (same arguments, the ``like`` arrays written in place): the functional forms (JAX) run that
    one on their output buffers, which start as copies of the inputs.
    """

    def __init__(self, name, args, *, keyword=("enable_pdl", "stream"), via=None, doc=""):
        self.name = name
        self.args = tuple(args)
        self.keyword = tuple(keyword)
        self.via = via
        self.doc = doc
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: an argument is declared twice: {names}")
        for a in self.args:
            if a.role == NEW and a.like not in names:
                raise ValueError(f"{name}: result {a.name} is like {a.like!r}, no argument")
        self.inputs = tuple(a for a in self.args if a.role != NEW)
        self.results = tuple(a for a in self.args if a.role == NEW)
        self.arrays = tuple(a.name for a in self.inputs if a.is_array)
        self.scalars = tuple(a for a in self.inputs if not a.is_array)
        self.written = tuple(a.name for a in self.inputs if a.role in (WRITTEN, IN_PLACE))
        self.required = tuple(a.name for a in self.inputs if a.default is REQUIRED)

    def __repr__(self):
        return f"Declaration({self.name!r})"

    # ---- the one call path --------------------------------------------------------------------

    def op(self, prepare, *, extra_arrays=(), extra_flags=(), layered=()):
        """The :class:`ropekv._launch.Op` of this declaration: its arrays (then ``extra_arrays``,
        arrays the op passes that are no argument of the public function, such as a new result
        allocated by the caller), its scalars each entering the plan key as its type says (then
        ``extra_flags``, ``[(name, kind)]``), and ``written`` by name."""
        flags = [(a.name, _PLAN_KEY[a.type]) for a in self.scalars] + list(extra_flags)
        return Op(self.name, (*self.arrays, *extra_arrays), prepare, layered, flags)

    def index(self, name, op=None):
        """The position of array argument ``name`` in the Op's arrays."""
        names = op.names if op is not None else self.arrays
        return names.index(name)

    def written_indices(self, op=None):
        """The positions, in the Op's arrays, of the arrays this op writes."""
        return tuple(self.index(n, op) for n in self.written)

    def check_call(self, values):
        """The checks every call of this op takes first, in declaration order: each scalar of the
        type it is declared with (``TypeError`` naming it; a bool is no int or float; an int is a
        float). ``values``: ``{name: value}``."""
        for a in self.scalars:
            value = values[a.name]
            if value is None and a.optional:
                continue
            if a.type == "bool":
                check_flag(value, a.name)
            elif a.type == "int":
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError(f"{a.name} must be an int, got {type(value).__qualname__}")
            elif a.type == "float":
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError(f"{a.name} must be a float, got {type(value).__qualname__}")
            elif not isinstance(value, str):
                raise TypeError(f"{a.name} must be a str, got {type(value).__qualname__}")

    # ---- the output rule -------------------------------------------------------------------

    def result_specs(self, shapes):
        """``[(name, shape, dtype)]`` of the new results, from ``shapes``: ``{name: (shape,
        dtype)}`` of the array arguments (real, fake or abstract). The one output rule."""
        return [(a.name, *shapes[a.like]) for a in self.results]

    # ---- the functional forms --------------------------------------------------------------

    def bind(self, args, kwargs, where):
        """``{name: value}`` of a call ``(*args, **kwargs)`` of a functional form (the eager
        signature without ``keyword``), defaults filled in; ``TypeError`` as Python's own for a
        missing, unknown or repeated argument."""
        names = [a.name for a in self.inputs]
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
        for a in self.inputs:
            if a.name not in values:
                if a.default is REQUIRED:
                    raise TypeError(f"{where}() missing required argument: {a.name!r}")
                values[a.name] = a.default
        return values

    def schema(self, defaults=True):
        """The torch custom op's schema: the inputs in order, the new results returned."""
        written = {name: i for i, name in enumerate(self.written)}
        args = ", ".join(a.schema(defaults, written.get(a.name)) for a in self.inputs)
        n = len(self.results)
        returns = "()" if n == 0 else "Tensor" if n == 1 else f"({', '.join(['Tensor'] * n)})"
        return f"({args}) -> {returns}"


def declaration_of(entry):
    """The :class:`Declaration` of a registry entry (``ropekv._registry.OpEntry``), or None for an
    op whose module declares none (its framework forms are written out in ``ropekv.torch`` and
    ``ropekv.jax``)."""
    import importlib

    module = importlib.import_module(f"ropekv.{entry.module}")
    for decl in getattr(module, "DECLARATIONS", ()):
        if decl.name == entry.name:
            return decl
    return None
