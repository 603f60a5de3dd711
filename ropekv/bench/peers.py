"""The peers a case is timed against, and the :class:`Runner` record that the timing and the
output check share (ropekv's call and each peer's, each on its own outputs).

Peers: FlashInfer's fused paged op (or its two launches for 16-bit caches), FlashInfer's Cake
kernels (QK-norm), PyTorch eager and ``torch.compile`` compositions of the same maths, cuBLAS (the
QKV projection's GEMM alone, and GEMM + ropekv's paged append), and 'steps' (the MLA op from
separate steps). A workload offers a peer by defining its method (``flashinfer_fn``,
``flashinfer_cake_fn``, ``torch_fn``, ``cublas_peers``, ``steps_peer``); a peer it lacks shows as
'-'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ropekv.bench.arrays import _torch, one_line, torch_view

PEERS = ("flashinfer", "flashinfer-cake", "torch", "torch-compile", "cublas", "steps")


@functools.cache
def peer_availability(backend="cuda"):
    """peer name -> None when it can run, else why not. On the NumPy backend only the PyTorch
    compositions run (on the CPU)."""
    status = {}
    try:
        import torch

        status["torch"] = (
            None
            if backend == "numpy" or torch.cuda.is_available()
            else "PyTorch sees no CUDA device"
        )
    except Exception as e:  # noqa: BLE001
        status["torch"] = f"PyTorch not importable ({type(e).__name__})"
    if backend == "numpy":
        for p in PEERS:
            status.setdefault(p, "needs the CUDA backend")
        return status
    status["torch-compile"] = status["torch"]
    if status["torch"] is None:
        try:
            import flashinfer.page
            import flashinfer.rope

            status["flashinfer"] = None
        except Exception as e:  # noqa: BLE001
            status["flashinfer"] = f"FlashInfer not importable ({type(e).__name__}: {e})"
        try:
            import flashinfer.cake_fused_qk_rope_append
            import flashinfer.cake_fused_qk_rope_fp8_append  # noqa: F401

            status["flashinfer-cake"] = None
        except Exception as e:  # noqa: BLE001
            status["flashinfer-cake"] = (
                f"FlashInfer's Cake kernels not importable (0.7.2 or "
                f"later; {type(e).__name__}: {e})"
            )
    else:
        status["flashinfer"] = status["flashinfer-cake"] = "needs PyTorch"
    status["cublas"] = status["steps"] = None
    return status


def _compiled(fn):
    """``torch.compile`` with dynamic shapes: one compilation serves every token count (dynamo
    caches per code object, guarded on the closure's constants and the dtypes)."""
    return _torch().compile(fn, dynamic=True)


@dataclasses.dataclass
class Runner:
    name: str
    call: Callable[[], Any]
    outputs: Callable[[], dict]
    reset: Callable[[], None] | None = None
    framework: str = "cupy"  # which graph capture times it ("numpy": host timing only)
    # maps ropekv's sampled outputs to what this runner's outputs are compared with (a peer that
    # writes another dtype), or None
    expect: Callable[[dict], dict] | None = None
    # a context manager factory entered around this runner's check and timing (--tune variants)
    context: Callable[[], Any] | None = None
    # what host time is measured on (ropekv: its call with the arguments built once), or None:
    # ``call``
    host_call: Callable[[], Any] | None = None


def make_runners(w, spec, peers, backend="cuda", variants=(), options=False):
    """ropekv's runner and the wanted peers' (name -> Runner, or name -> why not); then one
    ``ropekv[<label>]`` runner per ``--tune`` variant ``(label, changes)`` that changes this op,
    and with ``options`` one ``ropekv[+<option>]`` runner per option of the workload
    (:meth:`Workload.options`)."""
    framework = backend if backend == "numpy" else "cupy"
    o = w.new_outputs()
    ropekv = Runner(
        "ropekv",
        lambda: w.call(o),
        lambda: w.outputs(o),
        lambda: w.reset(o),
        framework=framework,
        host_call=w.bound(o),
    )
    out: dict[str, Any] = {}
    _add_variants(out, w, framework, variants, options)
    avail = peer_availability(backend)
    for peer in peers:
        if avail.get(peer):
            out[peer] = f"skipped: {avail[peer]}"
            continue
        try:
            _add_peer(out, w, spec, peer, backend)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be set up is reported
            out[peer] = f"error: {one_line(e)}"
    return ropekv, out


def is_variant(name):
    """Whether a runner of a case's ``peers`` is ropekv itself under a ``--tune`` variant or an
    option (``ropekv[<label>]``, ``ropekv[+<option>]``, :func:`_add_variants`), not a peer."""
    return name.startswith("ropekv[")


def _add_variants(out, w, framework, variants, options):
    """Into ``out``: the ``ropekv[<label>]`` runners of the ``--tune`` variants that change this
    op, and with ``options`` the ``ropekv[+<option>]`` ones."""
    from ropekv.bench import tuning

    for label, changes in variants:
        if w.op in changes:
            vo = w.new_outputs()
            out[f"ropekv[{label}]"] = Runner(
                f"ropekv[{label}]",
                functools.partial(w.call, vo),
                functools.partial(w.outputs, vo),
                functools.partial(w.reset, vo),
                framework,
                context=functools.partial(tuning.applied, changes),
                host_call=w.bound(vo),
            )
    if options:
        for label, (extra, checked) in w.options().items():
            vo = w.new_outputs()
            out[f"ropekv[+{label}]"] = Runner(
                f"ropekv[+{label}]",
                functools.partial(w.call, vo, **extra),
                functools.partial(w.outputs, vo),
                functools.partial(w.reset, vo),
                framework,
                expect=None if checked else _unchecked,
                host_call=w.bound(vo, **extra),
            )


def _add_peer(out, w, spec, peer, backend):
    """Into ``out``: the runner(s) of ``peer`` (cublas may add several), or ``"-"`` where the
    workload has none."""
    if peer == "steps":
        made = w.steps_peer() if hasattr(w, "steps_peer") else None
        if made is None:
            out[peer] = "-"
            return
        fn, outs, po = made
        out[peer] = Runner(peer, fn, outs, lambda po=po: w.reset(po))
        return
    if peer == "cublas":
        made = w.cublas_peers() if hasattr(w, "cublas_peers") else {}
        if not made:
            out[peer] = "-"
        for name, (fn, outs, po) in made.items():
            out[name] = Runner(name, fn, outs, (lambda po=po: w.reset(po)) if po else None)
        return
    po = w.new_outputs()
    to = {k: torch_view(v) for k, v in po.items()}
    ti = {k: torch_view(v) for k, v in w.a.items() if k not in po}
    reset = functools.partial(w.reset, po)
    if peer == "flashinfer-cake":
        made = w.flashinfer_cake_fn(ti, to, po) if hasattr(w, "flashinfer_cake_fn") else None
        if made is None:
            out[peer] = "-"
            return
        fn, outs, expect = made
        out[peer] = Runner(peer, fn, outs, reset, "torch", expect)
        return
    if peer == "flashinfer":
        made = w.flashinfer_fn(ti, to)
        if made is None:
            out[peer] = "-"
            return
        fn, extra_reset = made
        if extra_reset is not None:

            def reset(a=reset, b=extra_reset):
                a()
                b()

        out[peer] = Runner(peer, fn, functools.partial(w.outputs, po), reset, "torch")
        return
    made = w.torch_fn(ti, to)
    if made is None:
        out[peer] = "-"
        return
    fn, args = made
    if peer == "torch-compile":
        if not spec.compile:
            out[peer] = "-"
            return
        fn = _compiled(fn)
    out[peer] = Runner(
        peer,
        functools.partial(fn, *args),
        functools.partial(w.outputs, po),
        reset,
        "numpy" if backend == "numpy" else "torch",
    )


UNCHECKED = "not compared: the option changes the outputs"


def _unchecked(expected):
    """The ``expect`` of an option runner whose outputs differ from the plain call's by design."""
    return UNCHECKED
