"""Per-call host cost of reading torch tensors in the C replay: torch's DLPack C exchange API
(``torch.Tensor.__dlpack_c_exchange_api__``, ``dltensor_from_py_object_no_sync``) against the
TensorImpl struct reads at probed offsets (``_native.configure_torch_reads``) and the attributes.

A paged-op-like call: 10 torch tensors (2 of them None), through ``_native.Caller`` with no launch
(its plan is a stub whose replay does nothing: the same constant work in every mode), so the
differences between the rows are the reads. On the CPU by default; ``--device cuda`` on a GPU
machine. Prints a small table (median of the per-call times, microseconds) and exits 0.

    PYTHONPATH=. python tools/experiments/dlpack_exchange.py [--device cuda] [--calls 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ropekv import _arrays, _launch, _native


class _StubPlan:
    native = None  # no launches in C: the replay hands the call to replay() below

    def replay(self, *args):
        return None


def _tensors(device):
    f16, i32 = torch.float16, torch.int32
    return (
        torch.empty((8, 32, 128), dtype=f16, device=device),  # q
        torch.empty((8, 8, 128), dtype=f16, device=device),  # k
        torch.empty((8, 8, 128), dtype=f16, device=device),  # v
        torch.empty((4096, 64), dtype=torch.float32, device=device),  # cos_sin_cache
        torch.empty(8, dtype=i32, device=device),  # positions
        torch.empty((512, 16, 8, 128), dtype=f16, device=device),  # k_cache
        torch.empty((512, 16, 8, 128), dtype=f16, device=device),  # v_cache
        torch.empty(9, dtype=i32, device=device),  # kv_indptr
        torch.empty(64, dtype=i32, device=device),  # kv_indices
        torch.empty(8, dtype=i32, device=device),  # batch_indices
        None,
        None,
    )


def _per_call_us(caller, arrays, calls, repeats):
    plans = _launch._Plans()
    new = caller(arrays, (), None, None, plans)
    assert type(new) is _launch._NewLayout, new
    plans.last = (hash(()), (), new.layout, _StubPlan())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            caller(arrays, (), None, None, plans)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples), new.layout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    module = _native.load()
    if module is None:
        print(f"no C replay here: {_native.state()}")
        return
    device = torch.device(args.device)
    probe_device = (
        device.index
        if device.type == "cuda" and device.index is not None
        else (0 if device.type == "cuda" else "cpu")
    )
    _arrays._note_type(torch.Tensor, "torch")
    arrays = _tensors(device)
    names = tuple(f"a{i}" for i in range(len(arrays)))
    caller = module.Caller(names, None, _launch.native_hooks(), _launch._MISS)
    rows, layouts = [], []

    def attributes():
        module.configure_exchange(None)
        _native.configure_torch_reads(module, None)

    def tensorimpl():
        module.configure_exchange(None)
        _native.configure_torch_reads(module, probe_device)
        if _native._state["torch"] is not None:
            raise LookupError(_native._state["torch"])

    def exchange():
        _native.configure_torch_reads(module, None)
        _native.configure_torch_exchange(module, probe_device)

    for label, setup in [
        ("attributes (data_ptr(), shape, stride(), ...)", attributes),
        ("TensorImpl struct reads (probed offsets)", tensorimpl),
        ("DLPack C exchange API (+ is_neg())", exchange),
    ]:
        try:
            setup()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append((label, None, f"{type(exc).__name__}: {exc}"))
            continue
        us, layout = _per_call_us(caller, arrays, args.calls, args.repeats)
        layouts.append(layout)
        rows.append((label, us, ""))
    attributes()
    same = all(layout == layouts[0] for layout in layouts)
    print(
        f"torch {torch.__version__}, device {device}, {sum(a is not None for a in arrays)} "
        f"tensors per call, {args.calls} calls x {args.repeats} (median)"
    )
    print(f"{'read':48s} {'us/call':>8s} {'vs TensorImpl':>14s}")
    base = next((us for label, us, _ in rows if us is not None and "TensorImpl" in label), None)
    for label, us, note in rows:
        if us is None:
            print(f"{label:48s} {'-':>8s} {'':>14s}  {note}")
        else:
            delta = "" if base is None else f"{us - base:+.2f}"
            print(f"{label:48s} {us:8.2f} {delta:>14s}")
    print(f"keys identical across reads: {same}")


if __name__ == "__main__":
    main()
