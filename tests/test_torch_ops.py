"""``ropekv.torch``: registration, fake implementations, ``torch.library.opcheck``, eager and
compiled calls against the NumPy backend (CPU, in CI when torch is installed), and the same on
CUDA with CUDA graphs and ``mode="reduce-overhead"`` (GPU)."""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropekv
import ropekv.torch as rt
from tests.framework_cases import assert_result_close, cases
from tests.tolerance import assert_close, to_numpy

CASES = cases()
IDS = [c.name for c in CASES]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

# every registered op and the arguments it writes
_SCALES = {"q_scale_out", "kv_cache_scales"}
_PAGED = {"k_cache", "v_cache", "q_scale_out", "k_scales", "v_scales", "status"}
_QKNORM = {"k_cache", "v_cache", "q_scale_out", "k_scales", "v_scales", "status"}
MUTATIONS = {
    "apply_rope_write_kv": {"q", "kv_cache", *_SCALES},
    "apply_rope_write_kv_out": {"q_out", "kv_cache", *_SCALES},
    "apply_rope_write_kv_k_in_place": {"q", "k", "kv_cache", *_SCALES},
    "apply_rope_write_kv_k_in_place_out": {"q_out", "k", "kv_cache", *_SCALES},
    "rope_quantize_fp8_append_paged_kv_cache": _PAGED,
    "rope_quantize_fp8_append_paged_kv_cache_out": {*_PAGED, "q_rope_out", "q_nope_out"},
    "rope_append_paged_kv_cache": _PAGED,
    "rope_append_paged_kv_cache_out": {*_PAGED, "q_rope_out", "q_nope_out"},
    "mla_rope_rmsnorm_append_paged_kv_cache": {"kv_cache", "kpe_cache", "status"},
    "mla_rope_rmsnorm_append_paged_kv_cache_out": {"kv_cache", "kpe_cache", "status", "q_rope_out"},
    "mla_rope_rmsnorm_append_paged_kv_cache_in_place": {
        "kv_cache",
        "kpe_cache",
        "status",
        "q_rope",
    },
    "qk_rmsnorm_rope_append_paged_kv_cache": _QKNORM,
    "qk_rmsnorm_rope_append_paged_kv_cache_out": {*_QKNORM, "q_out"},
    "qk_rmsnorm_rope_append_paged_kv_cache_in_place": {*_QKNORM, "q"},
    "fused_qkv_matmul_append_paged_kv_cache": {"k_cache", "v_cache", "status"},
    "fused_qkv_matmul_append_paged_kv_cache_out": {"k_cache", "v_cache", "status", "out"},
}


def to_torch(x, device="cpu"):
    """A torch copy of a NumPy array (bfloat16 and fp8 through an integer view)."""
    if x.dtype.name in _TORCH_DTYPES:
        bits = np.uint8 if x.dtype.itemsize == 1 else np.int16
        t = torch.from_numpy(np.ascontiguousarray(x).view(bits).copy())
        return t.view(_TORCH_DTYPES[x.dtype.name]).to(device)
    return torch.from_numpy(np.ascontiguousarray(x).copy()).to(device)


def on(device):
    return lambda x: to_torch(x, device)


def assert_same(got, expected):
    """Byte-identical arrays, one by one (the same reference or kernel ran on both sides)."""
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        g = to_numpy(g)
        assert g.shape == e.shape and g.dtype == e.dtype, f"result {i}: {g.shape} {g.dtype}"
        assert np.array_equal(g.view(np.uint8), np.ascontiguousarray(e).view(np.uint8)), (
            f"result {i}: bytes differ"
        )


def negated(case):
    """The case with new data of the same layouts: every 16-bit and fp8 array negated (exact)."""
    import copy

    other = copy.copy(case)

    def flip(x):
        if isinstance(x, tuple):
            return tuple(flip(y) for y in x)
        if isinstance(x, np.ndarray) and x.dtype.itemsize <= 2 and x.dtype.kind in "fV":
            return -x
        return x

    other.kwargs = {n: flip(x) for n, x in case.kwargs.items()}
    if case.in_place:
        other.kwargs[case.in_place[0]] = other.kwargs[case.in_place[1]]
    return other


class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each ``ropekv::`` op a wrapper calls, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "ropekv":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def compile_counter():
    """A fresh dynamo (the tests compile one lambda per case, one code object) and a counter."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend("inductor")


# ---- CPU -----------------------------------------------------------------------------------------


def test_every_op_is_registered_with_exactly_its_writes():
    for name, writes in MUTATIONS.items():
        schema = getattr(torch.ops.ropekv, name).default._schema
        written = {
            a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        }
        assert written == writes, name
        assert not any(r.alias_info for r in schema.returns), f"{name} returns an alias"


def eager_function(op_name):
    """The eager function a registered op runs (``f_out``, ``f_in_place``, ``f_k_in_place``: f)."""
    for suffix in ("_out", "_k_in_place", "_in_place"):
        if not hasattr(ropekv, op_name):
            op_name = op_name.removesuffix(suffix)
    return getattr(ropekv, op_name)


def declared_ops():
    """``{name: declaration}`` of the ops whose torch forms follow from their declarations
    (ropekv/_declare.py); their own test files hold what each writes."""
    from ropekv import _declare

    return {d.name: d for d in _declare.declarations("torch")}


def test_every_op_is_in_the_table_above():
    assert set(torch.ops.ropekv) >= set(MUTATIONS)
    registered = {
        n for n in dir(torch.ops.ropekv) if hasattr(getattr(torch.ops.ropekv, n), "default")
    }
    variants = {v.name for d in declared_ops().values() for v in d.variants()}
    assert registered == set(MUTATIONS) | variants


def test_declared_ops_write_what_they_declare():
    for decl in declared_ops().values():
        for variant in decl.variants():
            schema = getattr(torch.ops.ropekv, variant.name).default._schema
            written = {
                a.name
                for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write
            }
            assert written == set(decl.written(variant)), variant.name
            assert not any(r.alias_info for r in schema.returns), variant.name


@pytest.mark.skipif(not rt.SCHEMA_DEFAULTS, reason="the schemas carry defaults from torch 2.13 on")
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_schema_defaults_are_the_eager_functions(name):
    """Every schema argument named as an argument of the eager function has its default (but the
    output tensor an ``_out`` op requires); the op's own optional arguments (a part of an eager
    argument: ``kv_scales``, ``kpe_cache``, ``k_scales`` ...) default to None; the rest are
    required, as in the eager function."""
    eager = inspect.signature(eager_function(name)).parameters
    schema = getattr(torch.ops.ropekv, name).default._schema
    for a in schema.arguments:
        optional = isinstance(a.type, torch.OptionalType)
        e = eager.get(a.name)
        if e is None:
            expected = None if optional else inspect.Parameter.empty
        elif e.default is None and not optional:  # the output of an _out op
            assert a.alias_info is not None and a.alias_info.is_write, (name, a.name)
            expected = inspect.Parameter.empty
        else:
            expected = e.default
        got = a.default_value if a.has_default_value() else inspect.Parameter.empty
        assert got == expected and type(got) is type(expected), (name, a.name, got, expected)


class MinimalCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Runs each ``ropekv::`` op a wrapper calls as ``torch.ops.ropekv.<op>(required...,
    keyword=value)``: the schema's required arguments positionally, of the rest only those that
    differ from their default, by keyword. Records the ops and the arguments left out."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "ropekv":
            return func(*args, **kwargs)
        schema = func._schema
        required, keywords, left_out = [], {}, []
        for i, a in enumerate(schema.arguments):
            # (the dispatcher may leave out trailing arguments that have their defaults)
            value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            if not a.has_default_value():
                required.append(value)
            elif is_default(value, a.default_value):
                left_out.append(a.name)
            else:
                keywords[a.name] = value
        self.calls.append((func._opname, left_out))
        return getattr(torch.ops.ropekv, func._opname)(*required, **keywords)


def is_default(value, default):
    if default is None or isinstance(value, torch.Tensor):
        return value is default
    return type(value) is type(default) and value == default


@pytest.mark.skipif(not rt.SCHEMA_DEFAULTS, reason="the schemas carry defaults from torch 2.13 on")
def test_raw_ops_take_only_their_required_arguments():
    """Every registered op called as an aten op (required arguments, keywords for the rest that
    differ from their defaults) gives the wrapper's results; the cases cover every op."""
    called = set()
    for case in CASES:
        expected = case.run(rt, case.fresh(to_torch))
        mode = MinimalCalls()
        with mode:
            got = case.run(rt, case.fresh(to_torch))
        assert_same(got, [to_numpy(e) for e in expected])
        ((op_name, left_out),) = mode.calls
        assert left_out, f"{case.name}: {op_name} given every argument"
        called.add(op_name)
    # every hand-written op, and every declared op's variants that the cases reach
    variants = {v.name for d in declared_ops().values() for v in d.variants()}
    assert set(MUTATIONS) <= called <= set(MUTATIONS) | variants


@pytest.mark.skipif(not rt.SCHEMA_DEFAULTS, reason="the schemas carry defaults from torch 2.13 on")
def test_raw_op_call_like_an_aten_op():
    """The call of issue 34: the contiguous op with its required arrays and kv_end_lens only."""
    case = next(c for c in CASES if c.op == "apply_rope_write_kv" and "kv_end_lens" in c.kwargs)
    a = case.fresh(to_torch)
    args = [a[n] for n in ("q", "k", "v", "kv_cache", "cos_sin_cache")]
    torch.ops.ropekv.apply_rope_write_kv(*args, kv_end_lens=a["kv_end_lens"])
    b = case.fresh(to_torch)
    rt.apply_rope_write_kv(
        *[b[n] for n in ("q", "k", "v", "kv_cache", "cos_sin_cache")], kv_end_lens=b["kv_end_lens"]
    )
    assert_same([a["q"], a["kv_cache"]], [to_numpy(b["q"]), to_numpy(b["kv_cache"])])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_custom_op_matches_the_numpy_backend(case):
    expected = case.run(ropekv, case.fresh())
    assert_same(case.run(rt, case.fresh(to_torch)), expected)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck(case):
    recorder = Recorder()
    with recorder:
        case.run(rt, case.fresh(to_torch))
    assert len(recorder.calls) == 1
    func, args, kwargs = recorder.calls[0]
    torch.library.opcheck(func, args, kwargs, test_utils=opcheck_utils(args))


def opcheck_utils(args):
    """Every opcheck test, but the schema test with float8 tensors: its mutation check calls
    ``torch.allclose``, which torch does not implement for float8 (the registration test above
    pins what each op writes)."""
    flat = [x for a in args for x in (a if isinstance(a, list | tuple) else (a,))]
    fp8 = any(isinstance(x, torch.Tensor) and x.dtype in FP8 for x in flat)
    utils = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    return utils[1:] if fp8 else utils


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fake_implementations_give_the_output_shapes_and_dtypes(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    expected = case.run(ropekv, case.fresh())
    mode = FakeTensorMode()
    args = case.fresh(lambda x: mode.from_tensor(to_torch(x)))
    with mode:
        got = case.run(rt, args)
    assert [(tuple(g.shape), to_numpy_dtype(g.dtype)) for g in got] == [
        (e.shape, e.dtype) for e in expected
    ]


def to_numpy_dtype(dtype):
    names = {
        torch.bfloat16: ml_dtypes.bfloat16,
        torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
        torch.float8_e5m2: ml_dtypes.float8_e5m2,
    }
    return np.dtype(names.get(dtype) or str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiled_matches_the_numpy_backend_and_compiles_once(case):
    counter = compile_counter()
    fn = torch.compile(lambda a: case.run(rt, a), fullgraph=True, backend=counter)
    for data in (case, negated(case)):
        expected = data.run(ropekv, data.fresh())
        assert_same(fn(data.fresh(to_torch)), expected)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c.name
        in (
            "contiguous-f16",
            "paged-fp8-gqa",
            "mla-split-given",
            "qknorm-fp8-in-place",
            "contiguous-fp8-q-dynamic-int8-kv-scales",
            "paged-fp8-computed-scales-status",
            "qknorm-fp8-q-dynamic-kv-scales",
        )
    ],
    ids=str,
)
def test_compiled_code_writes_the_caches_in_place(case):
    """Inductor calls the op on the graph's own cache tensors: no clone, no copy back."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, code = run_and_get_code(
        torch.compile(lambda a: case.run(rt, a), fullgraph=True), case.fresh(to_torch)
    )
    code = "\n".join(code)
    assert "torch.ops.ropekv." in code
    assert "clone" not in code and "copy_" not in code


# The same bad input through eager NumPy, the custom op, the fake (FakeTensorMode) and the
# compiled op: one exception type and message. (rule, op case, argument, replacement)
BAD = [
    ("paged q_rope rank", "paged-fp8-gqa", "q_rope", lambda x: x.reshape(x.shape[0], -1)),
    (
        "paged cache dtype",
        "paged-fp8-gqa",
        "paged_kv_cache",
        lambda c: tuple(x.astype(np.float32) for x in c),
    ),
    ("mla q_rope dtype", "mla", "q_rope", lambda x: x.astype(np.float32)),
    ("qknorm q rank", "qknorm", "q", lambda x: x.reshape(x.shape[0], -1)),
    ("qkv hidden rank", "qkv-decode", "hidden_state", lambda x: x[None]),
    ("qkv num_q_heads", "qkv-decode", "num_q_heads", lambda h: 0),
    ("contiguous k shape", "contiguous-f16", "k", lambda x: x[:, :, :1]),
    ("qknorm kv_scale on a 16-bit cache", "qknorm", "kv_scale", lambda s: 2.0),
    ("qknorm norm_order", "qknorm", "norm_order", lambda _: "sideways"),
    ("qknorm mrope_section sum", "qknorm-mrope", "mrope_section", lambda s: (4, 4, 4)),
    ("qknorm layer_idx range", "qknorm-fp8-layers", "layer_idx", lambda i: 4),
    ("qkv layer_idx range", "qkv-decode-layers", "layer_idx", lambda i: -1),
    ("mla status dtype", "mla-options", "status", lambda s: s.astype(np.int64)),
    (
        "paged mrope_section sum",
        "paged-fp8-mrope-interleaved",
        "mrope_section",
        lambda s: (1, 1, 1),
    ),
    # issue 14's computed scales and fp8 queries (some checked by the fakes, the rest eagerly)
    ("qknorm q_out_dtype", "qknorm-fp8-q-dynamic-kv-scales", "q_out_dtype", lambda _: "int8"),
    ("qknorm q_scale with q_scale_out", "qknorm-fp8-q-dynamic-kv-scales", "q_scale", lambda _: 2.0),
    (
        "qknorm kv_cache_scales shape",
        "qknorm-int8-kv-scales-in-place",
        "kv_cache_scales",
        lambda s: tuple(x[:-1] for x in s),
    ),
    (
        "paged static q scale with q_scale_out",
        "paged-fp8-computed-scales-status",
        "quant_scale_q",
        lambda _: 2.0,
    ),
    (
        "paged int8 cache without kv_cache_scales",
        "paged-int8-kv-scales-hnd-given",
        "kv_cache_scales",
        lambda _: None,
    ),
    (
        "paged int8 quantize_dtype without kv_cache_scales",
        "paged-fp8-gqa",
        "quantize_dtype",
        lambda _: np.int8,
    ),
    (
        "paged kv_cache_scales dtype",
        "paged-fp8-computed-scales-status",
        "kv_cache_scales",
        lambda s: tuple(x.astype(np.float16) for x in s),
    ),
    (
        "paged status dtype",
        "paged-fp8-computed-scales-status",
        "status",
        lambda s: s.astype(np.int64),
    ),
    (
        "contiguous q_scale_out with a 16-bit q_out",
        "contiguous-q-out",
        "q_scale_out",
        lambda _: np.zeros((2, 3, 4), np.float32),
    ),
    (
        "contiguous kv_cache_scales on a 16-bit cache",
        "contiguous-q-out",
        "kv_cache_scales",
        lambda _: np.zeros((2, 2, 2, 16), np.float32),
    ),
]


def bad_case(name, arg, change):
    import copy

    case = copy.copy(next(c for c in CASES if c.name == name))
    case.kwargs = dict(case.kwargs, **{arg: change(case.kwargs.get(arg))})
    return case


def error_of(fn):
    """(type, message) of the error ``fn()`` raises."""
    try:
        fn()
    except (TypeError, ValueError, BufferError) as exc:
        return type(exc), str(exc)
    raise AssertionError("no error raised")


def compiled_error_of(fn, expected):
    """The error of a compiled call: the eager one when the op raised it while running, or, when
    a fake implementation raised it while dynamo traced, dynamo's ``TorchRuntimeError`` quoting
    it (dynamo drops the original exception, its message keeps it); when the Python function
    raised it while dynamo traced it (a ``q_out_dtype`` it converts), dynamo's ``Unsupported``
    ("Observed exception") quoting it."""
    kind, message = expected
    try:
        return error_of(fn)
    except torch._dynamo.exc.TorchRuntimeError as exc:
        assert f"got {kind.__name__}({message!r})" in str(exc), str(exc)
        return expected
    except torch._dynamo.exc.Unsupported as exc:
        assert f"raised exception {kind.__name__}(" in str(exc) and message in str(exc), str(exc)
        return expected


@pytest.mark.parametrize("rule,name,arg,change", BAD, ids=[b[0] for b in BAD])
def test_errors_are_the_eager_ones(rule, name, arg, change):
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = bad_case(name, arg, change)
    expected = error_of(lambda: case.run(ropekv, case.fresh()))
    assert error_of(lambda: case.run(rt, case.fresh(to_torch))) == expected
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: case.run(rt, a), fullgraph=True)
    assert compiled_error_of(lambda: compiled(case.fresh(to_torch)), expected) == expected
    mode = FakeTensorMode()
    args = case.fresh(lambda x: mode.from_tensor(to_torch(x)))
    with mode:
        try:
            case.run(rt, args)
        except (TypeError, ValueError) as exc:  # what the fake checks, it words as eager does
            assert (type(exc), str(exc)) == expected


@pytest.mark.parametrize(
    "name,bad", [("qknorm-fp8-layers", True), ("qkv-decode-layers", 1.0), ("mla-split-layers", "1")]
)
def test_layer_idx_type_errors_are_the_eager_ones(name, bad):
    """Checked before the op (torch's int schema would take a bool), with the eager message."""
    case = bad_case(name, "layer_idx", lambda i: bad)
    expected = error_of(lambda: case.run(ropekv, case.fresh()))
    assert expected[0] is TypeError
    assert error_of(lambda: case.run(rt, case.fresh(to_torch))) == expected


@pytest.mark.parametrize(
    "name", ["contiguous-mrope", "paged-fp8-mrope-interleaved", "qknorm-mrope-in-place"]
)
@pytest.mark.parametrize("bad", [5, (1, 2), (1.0, 2, 3), (True, 2, 3)])
def test_mrope_section_errors_are_the_eager_ones(name, bad):
    """Checked before the op (torch's int-list schema would refuse or coerce them in its own
    words), with the eager error and message."""
    case = bad_case(name, "mrope_section", lambda s: bad)
    expected = error_of(lambda: case.run(ropekv, case.fresh()))
    assert expected[0] is ValueError
    assert error_of(lambda: case.run(rt, case.fresh(to_torch))) == expected


@pytest.mark.parametrize(
    "name",
    ["qknorm-options-given", "mla-options", "paged-int8-kv-scales-hnd-given", "qkv-options-given"],
)
def test_status_reports_bad_offsets_and_nothing_is_written(name):
    """Malformed offsets (``input_row_offsets``: one above the next, code 2; the paged ops'
    ``kv_indptr``: not starting at 0, code 4): the status code, and the caches, the scale arrays
    and the given q output untouched, through the custom op as through the eager one."""
    case, code = malformed(name)
    for ops, convert in ((ropekv, np.asarray), (rt, to_torch)):
        args = case.fresh(convert)
        others = [x for x in case.written(args) if x is not args["status"]]
        before = [to_numpy(x).copy() for x in others]
        case.run(ops, args)
        assert int(to_numpy(args["status"])[0]) == code
        for x, b in zip(others, before):
            assert np.array_equal(to_numpy(x).view(np.uint8), b.view(np.uint8))


def malformed(name):
    """A copy of a case with a ``status`` whose offsets fail a check, and the code it names:
    ``input_row_offsets`` with an offset above the next (2), or ``kv_indptr[0] != 0`` (4)."""
    import copy

    case = copy.copy(next(c for c in CASES if c.name == name))
    if "kv_indptr" in case.kwargs:
        indptr = case.kwargs["kv_indptr"].copy()
        indptr[0] = 1
        case.kwargs = dict(case.kwargs, kv_indptr=indptr)
        return case, 4
    offsets = case.kwargs["input_row_offsets"].copy()
    offsets[1] = offsets[2] + 1
    case.kwargs = dict(case.kwargs, input_row_offsets=offsets)
    return case, 2


def test_backward_through_an_op_raises():
    case = next(c for c in CASES if c.name == "qknorm")
    args = case.fresh(to_torch)
    args["q"].requires_grad_(True)
    q_out = rt.qk_rmsnorm_rope_append_paged_kv_cache(**args)  # the forward runs
    assert_same([q_out], case.run(ropekv, case.fresh())[:1])
    with pytest.raises(RuntimeError, match="no autograd formula"):
        q_out.float().sum().backward()


def test_compiling_needs_grad_mode_off_when_inputs_require_grad():
    """An op that writes its arguments cannot carry an autograd formula: AOTAutograd refuses to
    compile a graph that would differentiate through it; without grad mode it compiles."""
    case = next(c for c in CASES if c.name == "qknorm")
    fn = torch.compile(lambda a: case.run(rt, a), fullgraph=True, backend=compile_counter())
    args = case.fresh(to_torch)
    args["q"].requires_grad_(True)
    with pytest.raises(Exception, match="no autograd formula"):
        fn(args)
    torch._dynamo.reset()
    with torch.inference_mode():
        assert_same(fn(args), case.run(ropekv, case.fresh()))


# ---- GPU -----------------------------------------------------------------------------------------


def expected_on_device(case):
    """The NumPy reference (what the kernels are checked against)."""
    return case.run(ropekv, case.fresh())


def assert_close_all(got, expected, case):
    """``assert_result_close`` per result (int8 codes may be adjacent; the fused QKV op's cuBLAS
    path, for prefill-sized calls, rounds the projection before its epilogue, so its rows are
    compared by relative error)."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_result_close(g, e, case, f"result {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_eager_and_compiled_match_the_reference(case):
    eager = case.run(rt, case.fresh(on("cuda")))
    assert_close_all(eager, expected_on_device(case), case)
    counter = compile_counter()
    fn = torch.compile(lambda a: case.run(rt, a), fullgraph=True, backend=counter)
    assert_same(fn(case.fresh(on("cuda"))), [to_numpy(x) for x in eager])
    other = negated(case)
    assert_close_all(fn(other.fresh(on("cuda"))), expected_on_device(other), other)
    assert counter.frame_count == 1  # the second call, new tensors and data: no recompilation


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_opcheck(case):
    recorder = Recorder()
    with recorder:
        case.run(rt, case.fresh(on("cuda")))
    func, args, kwargs = recorder.calls[0]
    torch.library.opcheck(func, args, kwargs, test_utils=opcheck_utils(args))


def _refill(dst, src):
    """Copy a fresh argument set into the tensors a graph captured."""
    for n, x in src.items():
        if isinstance(x, tuple):
            for d, s in zip(dst[n], x):
                if isinstance(s, torch.Tensor):
                    d.copy_(s)
        elif isinstance(x, torch.Tensor):
            dst[n].copy_(x)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.name.startswith("qkv-prefill")], ids=str
)
def test_cuda_graph_capture_and_replay_write_the_cache(case):
    static = case.fresh(on("cuda"))
    case.run(rt, case.fresh(on("cuda")))  # warm-up: compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = case.run(rt, static)
    for data in (case, negated(case)):
        _refill(static, data.fresh(on("cuda")))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_all(results, expected_on_device(data), data)


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_prefill_qkv_call_is_refused():
    """Prefill-sized QKV calls run cuBLAS on CuPy temporaries that a graph cannot hold."""
    case = next(c for c in CASES if c.name == "qkv-prefill-given")
    static = case.fresh(on("cuda"))
    case.run(rt, case.fresh(on("cuda")))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(ValueError, match="cannot be recorded in a CUDA graph"),
        torch.cuda.graph(graph),
    ):
        case.run(rt, static)


class PagedDecode(torch.nn.Module):
    """A decode layer's cache write: the caches are buffers (static addresses, as CUDA graphs
    need), q/k/v and the indices arrive per step."""

    def __init__(self, k_cache, v_cache, table):
        super().__init__()
        self.register_buffer("k_cache", k_cache)
        self.register_buffer("v_cache", v_cache)
        self.register_buffer("table", table)

    def forward(self, q, k, v, pos, kv_indices, kv_indptr, batch_indices):
        R = self.table.shape[1]
        q_rope, _ = rt.rope_quantize_fp8_append_paged_kv_cache(
            q[..., :R],
            k[..., :R],
            q[..., R:],
            k[..., R:],
            v,
            self.table,
            pos,
            (self.k_cache, self.v_cache),
            kv_indices,
            kv_indptr,
            batch_indices,
            pos,
            page_size=self.k_cache.shape[1],
        )
        return q_rope


@pytest.mark.gpu
def test_reduce_overhead_mode_runs_the_op_in_a_cuda_graph():
    from torch._dynamo.utils import counters

    case = next(c for c in CASES if c.name == "paged-fp8-gqa")
    a = case.fresh(on("cuda"))
    R = a["q_rope"].shape[2]
    q = torch.cat([a["q_rope"], a["q_nope"]], -1)
    k = torch.cat([a["k_rope"], a["k_nope"]], -1)
    module = PagedDecode(*a["paged_kv_cache"], a["cos_sin_cache"]).cuda()
    counters.clear()
    step = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    k_ref, v_ref = (to_numpy(c).copy() for c in a["paged_kv_cache"])
    for i in range(4):
        sign = -1 if i % 2 else 1
        args = (
            sign * q,
            sign * k,
            sign * a["v"],
            a["pos_ids"],
            a["kv_indices"],
            a["kv_indptr"],
            a["batch_indices"],
        )
        q8 = step(*args).clone()
        ref_caches = (k_ref, v_ref)
        ref_q, _ = ropekv.rope_quantize_fp8_append_paged_kv_cache(
            *(
                to_numpy(x)
                for x in (
                    sign * q[..., :R],
                    sign * k[..., :R],
                    sign * q[..., R:],
                    sign * k[..., R:],
                    sign * a["v"],
                    a["cos_sin_cache"],
                    a["pos_ids"],
                )
            ),
            ref_caches,
            *(
                to_numpy(x)
                for x in (a["kv_indices"], a["kv_indptr"], a["batch_indices"], a["pos_ids"])
            ),
            page_size=module.k_cache.shape[1],
        )
        assert_close(q8, ref_q, f"step {i} q")
        assert_close(module.k_cache, k_ref, f"step {i} k_cache")
        assert_close(module.v_cache, v_ref, f"step {i} v_cache")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_the_op_runs_on_the_current_torch_stream():
    """The inputs land on a side stream after a long sleep; the op, called inside
    ``torch.cuda.stream(side)``, sees them only if it runs on `side`."""
    case = next(c for c in CASES if c.name == "paged-fp8-gqa")
    other = negated(case)
    a, late = case.fresh(on("cuda")), other.fresh(on("cuda"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        _refill(a, late)
        got = case.run(rt, a)
        snapshot = [x.clone() for x in got]
    torch.cuda.synchronize()
    assert_close_all(snapshot, expected_on_device(other), other)
