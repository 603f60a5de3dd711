"""``ropekv bench`` and ``ropekv check``: byte accounting, case construction, the runner on the
NumPy backend, the table / JSON / plot writers, the package's import structure and the command
line on the CPU; on a GPU, both commands run and exit 0."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import statistics
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from ropekv import _info, bench, check, cli, reference
from ropekv import bytes as nb
from ropekv.bench import cases, frameworks, report, runner, timing, tuning
from ropekv.bench.workloads import base, qkv
from tests.tool_loader import load_tool

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- minimal bytes -------------------------------------------------------------------------------


def test_gqa_bytes_match_the_flashinfer_figures():
    # ANCHORS.md: 71.4 us at 2.17 TB/s for GQA 32/8/128 fp16 -> e4m3, 8 x 1024 tokens
    n = nb.rope_kv_bytes(8192, 32, 8, 128, 128, F16, E4M3, E4M3)
    assert n == 8192 * (32 * 128 * 3 + 2 * 8 * 128 * 3 + 128 * 4)
    assert n / 71.4e-6 / 1e12 == pytest.approx(2.17, abs=0.01)


def test_mla_bytes_match_the_flashinfer_figures():
    # ANCHORS.md: 539 us at 3.39 TB/s for MLA 128 heads 64 + 512 bf16 -> e4m3, 4 x 2048 tokens
    n = nb.paged_mla_bytes(8192, 128, 512, 64, BF16, E4M3, E4M3)
    assert n == 8192 * (128 * 576 * 3 + 576 * 3 + 64 * 4)
    assert n / 539e-6 / 1e12 == pytest.approx(3.39, abs=0.01)


def test_contiguous_bytes_count_q_read_and_written_in_its_dtype():
    assert nb.contiguous_bytes(1, 32, 8, 128, 128, F16, F16) == 32 * 128 * 4 + 8 * 128 * 8 + 512
    assert nb.contiguous_bytes(2, 32, 8, 128, 64, F16, E4M3) == 2 * (
        32 * 128 * 4 + 2 * 8 * 128 * 3 + 256
    )


def test_mla_rmsnorm_bytes():
    per_token = 128 * 64 * 2 * 2 + 576 * 2 + 576 + 64 * 4
    assert nb.mla_rmsnorm_bytes(10, 128, 512, 64, BF16, E4M3) == 10 * per_token + 512 * 2
    assert nb.mla_rmsnorm_bytes(10, 128, 512, 64, BF16, E4M3, kv_norm_dim=128) == (
        10 * per_token + 128 * 2
    )


def test_qknorm_bytes_add_the_two_norm_weights_once():
    assert nb.qknorm_bytes(5, 32, 8, 128, 128, BF16, BF16) == (
        nb.rope_kv_bytes(5, 32, 8, 128, 128, BF16, BF16, BF16) + 2 * 128 * 2
    )


def test_qknorm_bytes_of_fp8_q_and_computed_scales():
    plain = nb.qknorm_bytes(5, 32, 8, 128, 128, BF16, E4M3)
    fp8_q = nb.qknorm_bytes(5, 32, 8, 128, 128, BF16, E4M3, q_out_dtype=E4M3)
    assert fp8_q == plain - 5 * 32 * 128  # one byte less per q element
    assert (
        nb.qknorm_bytes(5, 32, 8, 128, 128, BF16, E4M3, q_out_dtype=E4M3, q_scales=True)
        == fp8_q + 5 * 32 * 4
    )
    assert nb.qknorm_bytes(5, 32, 8, 128, 128, BF16, E4M3, kv_scales=True) == (
        plain + 5 * 2 * 8 * 4
    )


def test_qkv_bytes_and_flops():
    K, T = 4096, 1
    n = nb.qkv_bytes(T, K, 32, 8, 128, F16, F16)
    weights = 6144 * K * 2
    assert nb.qkv_weight_bytes(K, 32, 8, 128, F16) == weights
    assert n == T * K * 2 + weights + T * 4096 * 2 + T * 2048 * 2
    assert nb.qkv_bytes(T, K, 32, 8, 128, F16, F16, rotary_dim=128) == n + T * 128 * 4
    assert nb.qkv_bytes(T, K, 32, 8, 128, F16, F16, weight_dtype=np.uint8) == n - weights // 2
    assert nb.qkv_flops(8192, K, 32, 8, 128) == 2 * 8192 * K * 6144


def _workload_bytes(w, inputs, row_outputs, tokens, rotary_dim):
    """Bytes counted from a built workload's arrays: inputs whole, outputs one row per token."""
    total = sum(w.a[n].nbytes for n in inputs if w.a.get(n) is not None)
    for name, row_axes in row_outputs:
        a = w.a.get(name)
        if a is not None:
            total += tokens * a.dtype.itemsize * int(np.prod([a.shape[i] for i in row_axes]))
    return total + tokens * rotary_dim * 4


@pytest.mark.parametrize("cache", [F16, E4M3])
def test_contiguous_spec_bytes_equal_the_arrays(cache):
    w = bench.ContiguousWL(np, B=2, S=3, Hq=8, Hkv=2, D=64, C=16, dtype=F16, cache_dtype=cache)
    T = 6
    got = _workload_bytes(w, ("q", "k", "v"), [("q", (2, 3)), ("cache", (1, 2, 4))], T, 64)
    assert got == nb.contiguous_bytes(T, 8, 2, 64, 64, F16, cache)


@pytest.mark.parametrize("mla", [False, True])
def test_paged_spec_bytes_equal_the_arrays(mla):
    kw = {"B": 2, "S": 5, "prefix": 3, "Hq": 16, "dtype": BF16, "cache_dtype": E4M3, "mla": mla}
    w = bench.PagedWL(np, **(kw | ({"L": 128, "R": 32} if mla else {"Hkv": 4, "D": 64})))
    T = 10
    inputs = ("q_rope", "q_nope", "k_rope", "k_nope", "v")
    if mla:
        rows = [("q_rope_out", (1, 2)), ("q_nope_out", (1, 2)), ("cache0", (2,)), ("cache1", (2,))]
        want = nb.paged_mla_bytes(T, 16, 128, 32, BF16, E4M3, E4M3)
        got = _workload_bytes(w, inputs, rows, T, 32)
    else:
        rows = [("q_rope_out", (1, 2)), ("cache0", (2, 3)), ("cache1", (2, 3))]
        want = nb.rope_kv_bytes(T, 16, 4, 64, 64, BF16, E4M3, E4M3)
        # q_rope / k_rope are views of the whole q / k here (R = D)
        got = _workload_bytes(w, inputs, rows, T, 64)
    assert got == want


def test_mla_qknorm_qkv_spec_bytes_equal_the_arrays():
    w = bench.MlaWL(np, B=2, S=3, prefix=4, Hq=8, L=128, R=32, dtype=BF16, cache_dtype=E4M3)
    got = _workload_bytes(
        w, ("q_rope", "kv", "gamma"), [("q_rope_out", (1, 2)), ("ckv", (2,)), ("kpe", (2,))], 6, 32
    )
    assert got == nb.mla_rmsnorm_bytes(6, 8, 128, 32, BF16, E4M3)
    w = bench.QknormWL(np, B=2, S=3, prefix=4, Hq=8, Hkv=2, D=64, dtype=BF16, cache_dtype=E4M3)
    got = _workload_bytes(
        w,
        ("q", "k", "v", "q_gamma", "k_gamma"),
        [("q_out", (1, 2)), ("k_cache", (2, 3)), ("v_cache", (2, 3))],
        6,
        64,
    )
    assert got == nb.qknorm_bytes(6, 8, 2, 64, 64, BF16, E4M3)
    w = bench.QkvWL(np, B=2, S=3, prefix=4, K=96, Hq=4, Hkv=2, D=64, dtype=F16, cache_dtype=F16)
    got = _workload_bytes(
        w, ("hidden", "weight"), [("q_out", (1,)), ("k_cache", (2, 3)), ("v_cache", (2, 3))], 6, 64
    )
    assert got == nb.qkv_bytes(6, 96, 4, 2, 64, F16, F16, rotary_dim=64)


# ---- the case registry ---------------------------------------------------------------------------


def test_registry_covers_every_op_with_unique_names():
    specs = bench.bench_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    assert {s.op for s in specs} == set(bench.OPS)
    for op in bench.OPS:
        assert any(s.quick for s in specs if s.op == op), op
    sweep = sorted(s.tokens for s in specs if s.series == "paged gqa fp16->e4m3")
    assert sweep[0] == 1 and sweep[-1] == 32768 and len(sweep) == len(bench.SWEEP)
    # every op with decode cases sweeps the decode token counts (the QKV projection's quantized
    # weight formats: 1, 4, 8, 16, 64 and 128 tokens)
    for op in bench.OPS:
        decode = [s for s in specs if s.op == op and s.decode]
        if decode:
            series = {s.series for s in decode if s.series}
            assert series, op
            for name in series:
                tokens = sorted(s.tokens for s in specs if s.series == name and s.decode)
                want = (1, 4, 8, 16, 32, 64, 128) if "w K4096" in name else bench.DECODE_SWEEP
                assert tokens == sorted(want), (name, tokens)
    assert all(
        s.decode == (s.tokens <= 256 and "x1" in s.name.split()[-1] or s.decode) for s in specs
    )


def test_registry_holds_the_standard_cases():
    names = {s.name for s in bench.bench_specs()}
    for name in [
        "contiguous fp16->fp16 8x1024",
        "contiguous fp16->e4m3 64x1",
        "paged gqa fp16->e4m3 8x1024",
        "paged gqa fp16->e4m3 4x2048",
        "paged gqa fp16->fp16 256x1",
        "paged gqa bf16->e4m3 8x1024",
        "paged mla bf16->e4m3 4x2048",
        "paged mla bf16->e4m3 1x1",
        "mla rmsnorm bf16->e4m3 4x2048",
        "mla rmsnorm bf16->e4m3 128x1",
        "qkv fp16 K4096 N6144 T8192",
        "qkv fp16 K4096 N6144 T1",
    ]:
        assert name in names, name


def test_missing_ops_register_no_case(monkeypatch):
    monkeypatch.setattr(base, "op_available", lambda op: op == "contiguous")
    assert {s.op for s in bench.select_specs()} == {"contiguous"}
    assert {s.op for s in bench.select_specs(["paged"])} == set()
    assert all(s.quick for s in bench.select_specs(quick=True))
    assert {op for op, _, _ in bench.check_specs()} == {"contiguous"}


def test_cases_filter_by_name():
    got = [s.name for s in bench.select_specs(names=["qkv fp8w", "x2048"])]
    assert got and all("qkv fp8w" in n or "x2048" in n for n in got)
    assert any("x2048" in n for n in got) and any("fp8w" in n for n in got)
    assert bench.select_specs(names=["no such case"]) == []
    assert all("=" not in s.name for s in bench.bench_specs())  # "=" marks an exact name
    one = "paged gqa fp16->e4m3 1x1"
    assert len(bench.select_specs(names=[one])) > 1  # also 1x1 dynamic q, 1x1024 ...
    assert [s.name for s in bench.select_specs(names=[f"={one}"])] == [one]
    mixed = [s.name for s in bench.select_specs(names=[f"={one}", "x2048"])]
    assert one in mixed and all(n == one or "x2048" in n for n in mixed) and len(mixed) > 1
    assert bench.select_specs(names=[f"={one[:-1]}"]) == []


def test_qkv_weight_format_cases():
    """fp16 weights at 1-128 and 8192 tokens, fp8 (per-row) and 4-bit (group 128) weights at 1,
    4, 8, 16, 64 and 128 (Llama-3-8B shapes), each with the cuBLAS peer, each knowing its weight bytes;
    decode cases rotate over enough weight copies that graph replay cannot serve them from L2."""
    specs = {s.name: s for s in bench.bench_specs() if s.op == "qkv"}
    for label, tokens in (
        ("fp16", (1, 16, 64, 128, 8192)),
        ("fp8w", (1, 4, 8, 16, 64, 128)),
        ("int4w", (1, 4, 8, 16, 64, 128)),
    ):
        for T in tokens:
            assert f"qkv {label} K4096 N6144 T{T}" in specs, (label, T)
    N, K = 6144, 4096
    fp16 = specs["qkv fp16 K4096 N6144 T1"]
    fp8 = specs["qkv fp8w K4096 N6144 T1"]
    int4 = specs["qkv int4w K4096 N6144 T1"]
    assert fp16.weight_bytes == N * K * 2
    assert fp8.weight_bytes == N * K + N * 4
    assert int4.weight_bytes == N * K // 2 + N * K // 128 * 2
    assert fp16.nbytes - fp8.nbytes == fp16.weight_bytes - fp8.weight_bytes
    assert {s.weight_format for s in specs.values()} == set(qkv.WEIGHT_FORMATS.values())
    # the built arrays hold what the spec counts (small shapes, NumPy backend)
    for fmt in qkv.WEIGHT_FORMATS:
        w = bench.QkvWL(
            np,
            B=2,
            S=1,
            prefix=3,
            K=256,
            Hq=4,
            Hkv=2,
            D=64,
            dtype=F16,
            cache_dtype=F16,
            weight_format=fmt,
            copies=3,
        )
        assert w.weight_bytes == qkv.weight_bytes(512, 256, fmt)
        assert len(w.weight_copies) == 3
        assert all(
            c is not w.a["weight"]
            and np.array_equal(c.view(np.uint8), w.a["weight"].view(np.uint8))
            for c in w.weight_copies[1:]
        )


@pytest.mark.parametrize("fmt", ["e4m3", "int4"])
def test_qkv_quantized_weights_match_the_reference_dequantization(fmt):
    """weight_ref (what the PyTorch and cuBLAS peers multiply by) is the reference's dequantized
    weight rounded to fp16; the rotating call writes what one call writes."""
    w = bench.QkvWL(
        np,
        seed=4,
        B=3,
        S=1,
        prefix=9,
        K=512,
        Hq=4,
        Hkv=2,
        D=64,
        dtype=F16,
        cache_dtype=F16,
        weight_format=fmt,
        copies=2,
    )
    a = w.a
    want = reference.dequantize_weight(
        a["weight"], a["weight_scales"], 128 if fmt == "int4" else None
    )
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    got = a["weight_ref"].astype(np.float64)
    assert np.allclose(got, want, rtol=1e-3, atol=1e-6)
    outs = []
    for _ in range(2):  # copy 0, then copy 1
        o = w.new_outputs()
        w.call(o)
        outs.append(w.outputs(o, full=True))
    assert w.turn == 2
    for k in outs[0]:
        assert np.array_equal(outs[0][k].view(np.uint8), outs[1][k].view(np.uint8)), k


def test_check_cases_run_on_the_numpy_backend():
    cases = bench.check_specs()
    assert cases, "no op available"
    for op, name, build in cases:
        w = build()
        before = {k: v.copy() for k, v in w.outputs(full=True).items()}
        w.call(w.a)
        after = w.outputs(full=True)
        # the reference changed something, and both builds of one case are identical
        assert any(
            not np.array_equal(before[k].view(np.uint8), after[k].view(np.uint8)) for k in before
        ), name
        again = build().outputs(full=True)
        assert all(
            np.array_equal(again[k].view(np.uint8), before[k].view(np.uint8)) for k in before
        ), name


def test_bound_calls_make_the_workloads_call_with_arguments_built_once():
    """Host time is measured on ``Workload.bound``: one partial of the ropekv function whose
    call writes what the workload's own call writes (every case, options included)."""
    import functools

    import ropekv

    for op, name, build in bench.check_specs():
        w = build()
        for extra in [{}] + [e for e, _ in w.options().values()]:
            o_call, o_bound = w.new_outputs(), w.new_outputs()
            w.call(o_call, **extra)
            bound = w.bound(o_bound, **extra)
            assert isinstance(bound, functools.partial), name
            assert bound.func is getattr(ropekv, bound.func.__name__), name
            assert all(
                np.array_equal(
                    w.outputs(o_bound, full=True)[k].view(np.uint8),
                    w.new_outputs()[k].view(np.uint8),
                )
                for k in o_bound
            ), f"{name}: binding called ropekv"
            bound()
            for k, v in w.outputs(o_call, full=True).items():
                got = w.outputs(o_bound, full=True)[k]
                assert np.array_equal(got.view(np.uint8), v.view(np.uint8)), (name, extra, k)


def test_eager_host_time_is_timed_in_bursts_with_the_sync_outside():
    from ropekv import _timing

    log = []
    us = _timing.eager_host_us(
        lambda: log.append("call"), calls=350, sync=lambda: log.append("sync")
    )
    assert us > 0
    calls = log[50:]
    assert log[:50] == ["call"] * 50 and calls[0] == "sync"
    bursts = "".join("c" if x == "call" else "|" for x in calls[1:]).split("|")[:-1]
    assert bursts == ["c" * _timing.HOST_BURST] * (350 // _timing.HOST_BURST)


# ---- the host-time measurements the bench and tools/hosttime.py, tools/hostcost.py share ----------


def test_first_call_us_clears_plans_before_each_call_and_syncs_outside_the_timing(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "clear_plans", lambda: log.append("clear"))
    us = timing.first_call_us(lambda: log.append("call"), lambda: log.append("sync"), n=3)
    assert us > 0
    assert log == ["clear", "sync", "call", "sync"] * 3 + ["clear"]
    log.clear()
    timing.first_call_us(lambda: log.append("call"), n=2)  # no device (tools/hostcost.py)
    assert log == ["clear", "call"] * 2 + ["clear"]
    log.clear()
    timing.first_call_us(lambda: log.append("call"), lambda: None)
    assert log.count("call") == timing.FIRST_CALLS


def test_first_call_us_is_the_median(monkeypatch):
    ticks = iter([0.0, 1e-6, 10.0, 10.0 + 5e-6, 20.0, 20.0 + 2e-6, 30.0, 30.0 + 9e-6])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(timing, "clear_plans", lambda: None)
    assert timing.first_call_us(lambda: None, n=4) == pytest.approx(3.5)  # of 1, 5, 2, 9 us


def test_first_call_rounds_interleave_every_entry_and_settle_first(monkeypatch):
    """One first call of every entry a round, forward then backward, after untimed settling
    rounds; plans cleared before each call, the device synchronised outside the timing."""
    log = []
    monkeypatch.setattr(timing, "clear_plans", lambda: log.append("clear"))
    clock = iter(float(k) * 1e-6 for k in range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = [(name, lambda name=name: log.append(name)) for name in "abc"]
    times = timing.first_call_rounds(calls, lambda: log.append("sync"), rounds=4, settle=1)
    order = [x for x in log if x in "abc"]
    assert order == list("abccbaabccbaabc")  # the settling round, then 4
    assert log[:4] == ["clear", "sync", "a", "sync"] and log[-1] == "clear"
    assert log.count("clear") == 15 + 1 and log.count("sync") == 2 * 15
    assert set(times) == {"a", "b", "c"} and all(len(v) == 4 for v in times.values())
    assert all(us == pytest.approx(1.0) for v in times.values() for us in v)
    log.clear()
    assert timing.first_call_rounds(calls, None, rounds=2, settle=0)["a"]  # no device
    assert "sync" not in log and [x for x in log if x in "abc"] == list("abccba")


def test_first_call_phase_records_medians_spreads_and_rounds(monkeypatch):
    """The phase (stand-in calls): each decode case's first_us / first_us_torch becomes the
    median of its rounds, with [min, max] and the rounds beside it; host_rounds untouched;
    prefill, failed and unbuildable cases keep what they had; groups under the byte budget."""
    monkeypatch.setattr(timing, "clear_plans", lambda: None)
    spec = type("Spec", (), {"decode": True})
    prefill = type("Spec", (), {"decode": False})
    specs = [spec(), prefill(), spec(), spec(), spec()]

    def case(torch=True):
        r = {"host_us": 1.0, "first_us": 500.0, "host_rounds": {"first_us": [500.0]}}
        if torch:
            r["first_us_torch"] = 600.0
        return {"ropekv": r}

    cases = [case(), case(), case(torch=False), case(), dict(case(), error="x")]
    cases[3]["name"] = "broken"
    us = {0: [5, 1, 9, 3, 7], 2: [2, 2, 2, 2, 2]}  # per case: its calls' times in order
    seen = {}

    def first_calls(sp, c):
        i = next(k for k, x in enumerate(cases) if x is c)
        if c.get("name") == "broken":
            raise RuntimeError("cannot build")
        n = [0]

        def call(i=i):
            n[0] += 1
            seen.setdefault(i, 0)
            seen[i] += 1
            clock[0] += us[i][(n[0] - 1) % 5] * 1e-6  # (the cupy and torch calls share them)

        keys = ("first_us", "first_us_torch") if "first_us_torch" in c["ropekv"] else ("first_us",)
        return [(k, call) for k in keys], 10

    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(runner, "_first_calls", first_calls)
    freed = []
    monkeypatch.setattr(runner, "FIRST_PHASE_BYTES", 10)  # one case a group
    runner.first_call_phase(
        specs, cases, rounds=5, settle=0, sync=lambda: None, free=lambda: freed.append(1)
    )
    r = cases[0]["ropekv"]
    # a group's rounds alternate their order: CuPy, torch; torch, CuPy; ... (times 5 1 9 3 7 ...)
    assert r["first_rounds"] == {
        "first_us": pytest.approx([5, 3, 7, 9, 3]),
        "first_us_torch": pytest.approx([1, 9, 5, 1, 7]),
    }
    assert (r["first_us"], r["first_us_torch"]) == (pytest.approx(5), pytest.approx(5))
    assert r["first_us_spread"] == pytest.approx([3, 9])
    assert r["first_us_torch_spread"] == pytest.approx([1, 9])
    assert r["host_rounds"] == {"first_us": [500.0]}  # the in-run figures stay
    assert cases[2]["ropekv"]["first_us"] == pytest.approx(2.0)
    assert cases[2]["ropekv"]["first_us_spread"] == pytest.approx([2.0, 2.0])
    assert "first_us_torch" not in cases[2]["ropekv"]
    assert cases[1]["ropekv"]["first_us"] == 500.0 and "first_rounds" not in cases[1]["ropekv"]
    assert cases[3]["ropekv"]["first_us"] == 500.0
    assert cases[3]["ropekv"]["first_rounds_error"] == "RuntimeError: cannot build"
    assert "first_rounds" not in cases[4]["ropekv"]  # an errored case: not measured
    assert seen == {0: 10, 2: 5} and len(freed) == 2  # two groups, each freed


def _planted(ops):
    """A stand-in plan in each op's one-layer and multi-layer plans."""
    for op in ops:
        op.plans["stand-in"] = op.layer_plans["stand-in"] = object()


def _planted_left(ops):
    return [op.name for op in ops if "stand-in" in op.plans or "stand-in" in op.layer_plans]


def test_clear_plans_forgets_every_ops_plans_or_those_of_the_modules_named():
    from ropekv import _launch, _registry, contiguous, paged

    ops = timing.launch_ops()
    assert ops and all(isinstance(op, _launch.Op) for op in ops)
    mine = timing.launch_ops([contiguous])
    assert mine == timing.launch_ops(["contiguous"]) and mine
    assert all(op in ops for op in mine)
    assert len(timing.launch_ops(_registry.OP_MODULES)) == len(ops)
    others = [op for op in timing.launch_ops([paged]) if op not in mine]
    try:
        _planted(ops)
        timing.clear_plans([contiguous])
        assert _planted_left(mine) == [] and _planted_left(others) == [o.name for o in others]
        timing.clear_plans()
        assert _planted_left(ops) == []
    finally:
        timing.clear_plans()


def test_tune_variants_drop_every_plan_of_the_ops_they_change():
    from ropekv import contiguous

    ops = timing.launch_ops([contiguous])
    key = next(iter(contiguous.TUNING))
    try:
        _planted(ops)
        with tuning.applied({"contiguous": {key: contiguous.TUNING[key]}}):
            assert _planted_left(ops) == []  # dropped on entry
            _planted(ops)
        assert _planted_left(ops) == []  # and on exit
    finally:
        timing.clear_plans()


def test_eager_host_times_are_ropekvs_call_and_first_call_and_a_peers_call(monkeypatch):
    """The host times ``time_runner`` takes for a decode case and ``remeasure_host`` takes again:
    per eager call on the runner's host call (else its call), and ropekv's first call."""
    pytest.importorskip("cupy")  # imported for the device's sync (not called here)
    from ropekv import _timing

    seen = []
    monkeypatch.setattr(
        _timing, "eager_host_us", lambda fn, calls: seen.append(("per call", fn, calls)) or 2.0
    )
    monkeypatch.setattr(timing, "first_call_us", lambda fn, sync: seen.append(("first", fn)) or 9.0)
    bound, call = object(), object()
    ropekv = bench.Runner("ropekv", call, dict, host_call=bound)
    assert timing.eager_host_times(ropekv, {"host_calls": 7}) == {"host_us": 2.0, "first_us": 9.0}
    assert seen == [("per call", bound, 7), ("first", bound)]
    seen.clear()
    peer = bench.Runner("torch", call, dict)
    assert timing.eager_host_times(peer, {"host_calls": 7}) == {"host_us": 2.0}
    assert seen == [("per call", call, 7)]


def test_remeasure_host_takes_what_the_case_took(monkeypatch):
    """On the CUDA backend a round re-takes ``eager_host_times`` and ``torch_host_us`` (stand-ins
    here) on a new workload; each figure becomes the median of its rounds, a figure missing
    from a round counts as not measured."""
    spec = type("Spec", (), {"decode": True, "make": lambda self, xp=None: "w"})()
    made = []

    def make_runners(w, s, peers, backend):
        made.append((w, s, peers, backend))
        return bench.Runner("ropekv", lambda: None, dict, host_call=lambda: None), {}

    monkeypatch.setattr(runner, "make_runners", make_runners)
    monkeypatch.setattr(
        runner, "eager_host_times", lambda r, st: {"host_us": 3.0, "first_us": 30.0}
    )
    monkeypatch.setattr(runner, "torch_host_us", lambda w, calls: {"host_us_torch": 5.0})
    r = {"host_us": 1.0, "first_us": 10.0, "host_us_torch": 7.0, "first_us_torch": 70.0}
    case = {"ropekv": dict(r, host_rounds={k: [v] for k, v in r.items()})}
    runner.remeasure_host(spec, case, {"host_calls": 7}, "cuda")
    assert made == [("w", spec, (), "cuda")]
    got = case["ropekv"]
    assert got["host_rounds"] == {
        "host_us": [1.0, 3.0],
        "first_us": [10.0, 30.0],
        "host_us_torch": [7.0, 5.0],
        "first_us_torch": [70.0, None],
    }
    assert (got["host_us"], got["first_us"], got["host_us_torch"]) == (2.0, 20.0, 6.0)
    assert got["first_us_torch"] == 70.0


def test_the_host_time_tools_use_the_bench_measurements():
    """tools/hosttime.py and tools/hostcost.py time first calls and clear plans through
    ``ropekv.bench.timing``, and share their case options (hosttime's help needs no GPU)."""
    tools = pathlib.Path(ROOT) / "tools"
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, str(tools / "hosttime.py"), "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for option in ("--calls", "--cases", "--layers", "--replay", "--no-floor", "--profile"):
        assert option in out.stdout
    for name in ("hosttime.py", "hostcost.py"):
        source = (tools / name).read_text()
        assert "from ropekv.bench.timing import" in source, name
        assert "def ops(" not in source and "in ops()" not in source, name
    assert "perf_counter" not in (tools / "hosttime.py").read_text()  # it times through helpers


def _torch_outputs(w):
    """The outputs of ``w``'s PyTorch composition, or None where it has none (``torch_fn``
    returns None, as for the contiguous q_out / kv_cache_scales cases: the peers show "-")."""
    o = w.new_outputs()
    to = {k: bench.torch_view(v) for k, v in o.items()}
    ti = {k: bench.torch_view(v) for k, v in w.a.items() if k not in o}
    made = w.torch_fn(ti, to)
    if made is None:
        return None
    fn, args = made
    fn(*args)
    return w.outputs(o, full=True)


def test_torch_peers_compute_the_reference():
    """The PyTorch compositions (the eager and torch.compile peers) agree with the reference;
    every op has at least one case with a composition."""
    pytest.importorskip("torch")
    compared = set()
    ops = set()
    for op, name, build in bench.check_specs():
        ops.add(op)
        got = _torch_outputs(build())
        if got is None:
            continue
        ref = build()
        ref.call(ref.a)
        assert check.compare_all(got, ref.outputs(full=True), ref.compare_mode) is None, name
        compared.add(op)
    assert compared == ops


def test_torch_qkv_peer_computes_the_reference():
    pytest.importorskip("torch")
    for rope, layout in ((True, "NHD"), (False, "HND")):
        w = bench.QkvWL(
            np,
            seed=3,
            poison=True,
            B=2,
            S=5,
            prefix=7,
            K=256,
            Hq=4,
            Hkv=2,
            D=64,
            dtype=F16,
            cache_dtype=F16,
            layout=layout,
            rope=rope,
        )
        got = _torch_outputs(w)
        a = w.a
        reference.fused_qkv_matmul_append_paged_kv_cache(
            a["hidden"],
            a["weight"],
            a["input_row_offsets"],
            a["cache_lengths"],
            a["block_table"],
            a["k_cache"],
            a["v_cache"],
            a["q_out"],
            4,
            cos_sin_cache=a["table"],
            kv_layout=layout,
        )
        assert check.compare_all(got, w.outputs(full=True), "gemm") is None


@pytest.mark.parametrize("cache", [BF16, E4M3])
def test_steps_peer_maps_onto_the_paged_op(cache):
    """The 'steps' peer of the MLA op (RMSNorm, then ropekv's paged op) writes the MLA op's
    cache rows: checked here with the NumPy backend of both ops."""
    import ropekv

    w = bench.MlaWL(
        np,
        seed=5,
        poison=True,
        B=3,
        S=5,
        prefix=9,
        Hq=4,
        L=128,
        R=32,
        dtype=BF16,
        cache_dtype=cache,
        kv_scale=2.0 if cache == E4M3 else None,
    )
    fn = (
        ropekv.rope_quantize_fp8_append_paged_kv_cache
        if cache == E4M3
        else ropekv.rope_append_paged_kv_cache
    )
    o = w.new_outputs()
    # what the norm kernel writes: the normalised latent rows, divided by kv_scale, into ckv
    scale = w.kv_scale or 1.0
    o["ckv"][w.page, w.entry] = reference.to_dtype(
        reference.rms_norm(w.a["kv"][:, :128], w.a["gamma"], w.eps) / scale, cache
    )
    q_out = np.zeros(w.a["q_rope"].shape, cache)
    w.steps_append(fn, q_out, o, np)()
    got = {k: v for k, v in w.outputs(o, full=True).items() if k != "q_rope_out"}
    w.call(w.a)
    assert check.compare_all(got, w.outputs(full=True)) is None


def test_steps_peer_rmsnorm_kernel_compiles_for_sm90():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from ropekv._compile import _header_options

    prog = nvrtc.createProgram(bench.RMSNORM_SRC, "rmsnorm.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", "-std=c++17", *_header_options()])
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


# ---- comparisons ---------------------------------------------------------------------------------


def test_compare_tolerances():
    e = np.array([1.0, 2.0, -3.0], np.float16)
    assert check.compare(e, e) is None
    assert check.compare(np.nextafter(e, np.float16(9)), e) is None  # one unit in the last place
    assert "out of tolerance" in check.compare(e * np.float16(1.01), e)
    assert "shape" in check.compare(e[:2], e)
    assert "dtype" in check.compare(e.astype(np.float32), e)
    codes = np.array([0x30, 0x31, 0xB0], np.uint8).view(E4M3)
    assert check.compare(np.array([0x31, 0x30, 0xB1], np.uint8).view(E4M3), codes) is None
    assert "fp8 codes" in check.compare(np.array([0x32, 0x31, 0xB0], np.uint8).view(E4M3), codes)
    x = np.random.default_rng(0).standard_normal(1000)
    assert check.compare(x + 1e-4, x, mode="gemm") is None
    assert "relative error" in check.compare(x + 0.1, x, mode="gemm")
    assert check.compare_all({"a": e}, {"b": e}) == "no output in common to compare"


# ---- the table and the JSON ----------------------------------------------------------------------


def _result():
    ok = {"us": 80.0, "event_us": 80.0, "gbps": 1900.0, "pct_copy": 45.0}
    return {
        "environment": {
            "gpu": "NVIDIA H200",
            "driver": "580",
            "cupy": "14.2.0",
            "git_revision": "abc",
        },
        "copy_bandwidth": 4.2e12,
        "wall_s": 12.5,
        "missing_ops": ["qkv"],
        "peer_status": {
            "flashinfer": "used",
            "torch": "used",
            "torch-compile": "FlashInfer not importable",
            "cublas": "used",
        },
        "cases": [
            {
                "op": "paged",
                "name": "paged gqa fp16->e4m3 8x1024",
                "tokens": 8192,
                "bytes": 155_189_248,
                "decode": False,
                "series": "s",
                "flops": 0,
                "ropekv": dict(ok),
                "peers": {
                    "flashinfer": {"status": "ok", "check": "ok", "us": 120.0, "ratio": 1.5},
                    "torch": {
                        "status": "mismatch",
                        "check": "MISMATCH: q: 3 of 9 values",
                        "us": 800.0,
                        "ratio": 10.0,
                    },
                    "torch-compile": {"status": "skipped: no torch"},
                },
            },
            {
                "op": "paged",
                "name": "paged gqa fp16->e4m3 64x1",
                "tokens": 64,
                "bytes": 1_212_416,
                "decode": True,
                "series": "s",
                "flops": 0,
                "ropekv": dict(ok, us=2.0, graph_us=2.0, host_us=9.5),
                "peers": {
                    "flashinfer": {
                        "status": "ok",
                        "us": 2.4,
                        "ratio": 1.2,
                        "host_us": 18.0,
                        "graph_us": 2.4,
                    },
                    "cublas": {
                        "status": "ok",
                        "us": 17.0,
                        "ratio": 8.5,
                        "host_us": 15.0,
                        "graph_error": "NotImplementedError: cuBLAS in capture",
                    },
                    "torch": {"status": "error: RuntimeError: boom"},
                    "torch-compile": {"status": "-"},
                },
            },
            {"op": "qkv", "name": "broken", "tokens": 1, "bytes": 10, "error": "ValueError: x"},
        ],
    }


def test_table_reports_ratios_mismatches_and_errors():
    header, rows, notes = bench.table_rows(_result())
    assert header[:6] == ["case", "ropekv us", "host us", "MB", "GB/s", "% copy"]
    assert header[6:] == ["flashinfer", "torch", "torch-compile", "cublas"]
    assert rows[0][1] == "80.0" and rows[0][4] == "1900" and rows[0][5] == "45"
    assert rows[0][6] == "120.0 (1.50x)"
    assert rows[0][7].startswith("MISMATCH 800.0 (10.00x)")
    assert rows[0][8] == "skip"
    assert rows[1][0].endswith("[graph]") and rows[1][2] == "9.5"
    assert rows[1][6] == "2.4 (1.20x) h18.0" and rows[1][7] == "error" and rows[1][8] == "-"
    assert rows[1][9] == "17.0 (8.50x) ev h15.0"  # event-timed: not capturable in a graph
    assert rows[2][1] == "error"
    text = "\n".join(notes)
    assert "MISMATCH: q" in text and "RuntimeError: boom" in text and "ValueError: x" in text
    assert "cuBLAS in capture" in text
    out = bench.report.text(_result())
    assert "copy bandwidth: 4.20 TB/s" in out and "total wall time: 12.5 s" in out
    assert "ops not in this ropekv (no cases): qkv" in out
    assert out.count("\n| ") >= 4


def test_json_round_trips(tmp_path):
    path = tmp_path / "bench.json"
    bench.write_json(_result(), str(path))
    data = json.loads(path.read_text())
    assert data["environment"]["gpu"] == "NVIDIA H200"
    assert data["cases"][0]["peers"]["flashinfer"]["ratio"] == 1.5
    assert data["copy_bandwidth"] == 4.2e12


def test_plot(tmp_path):
    path = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="matplotlib"):
            bench.plot(_result(), str(path))
        return
    bench.plot(_result(), str(path))
    assert path.stat().st_size > 1000


def test_speedups_take_the_fastest_matching_peer():
    got = bench.speedups(_result())
    # case 1: flashinfer 120 (ok) beats torch 800 (a mismatch, left out); case 2: flashinfer 2.4
    assert got == [
        ("paged gqa fp16->e4m3 8x1024", "flashinfer", 1.5),
        ("paged gqa fp16->e4m3 64x1", "flashinfer", pytest.approx(1.2)),
    ]
    assert "speedup over the best peer: 1.20x to 1.50x over 2 cases, 2 at or above 1" in (
        bench.report.text(_result())
    )


def test_plot_has_a_speedup_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.append(fig)
    )
    bench.plot(_result(), str(tmp_path / "x.png"))
    (fig,) = saved
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("ropekv's speedup"))
    assert [t.get_text() for t in panel.get_xticklabels()] == [
        "paged gqa fp16->e4m3 8x1024",
        "paged gqa fp16->e4m3 64x1",
    ]
    dots = np.concatenate([c.get_offsets() for c in panel.collections])
    assert np.allclose(sorted(dots[:, 1]), [1.2, 1.5])
    assert any(np.allclose(line.get_ydata(), 1.0) for line in panel.get_lines())  # the line at 1


def _small_specs():
    """Two small cases (a prefill and a decode) of two ops, built with NumPy."""
    return [
        bench.CaseSpec(
            "contiguous",
            "contiguous fp16->fp16 2x5",
            10,
            nb.contiguous_bytes(10, 4, 2, 64, 64, F16, F16),
            base._lazy(
                bench.ContiguousWL, B=2, S=5, Hq=4, Hkv=2, D=64, C=16, dtype=F16, cache_dtype=F16
            ),
            series="contiguous fp16->fp16",
        ),
        bench.CaseSpec(
            "qkv",
            "qkv int4w T2",
            2,
            1000,
            base._lazy(
                bench.QkvWL,
                B=2,
                S=1,
                prefix=3,
                K=256,
                Hq=4,
                Hkv=2,
                D=64,
                dtype=F16,
                cache_dtype=F16,
                weight_format="int4",
                copies=2,
            ),
            decode=True,
            weight_bytes=qkv.weight_bytes(512, 256, "int4"),
            weight_format="int4 g128",
        ),
    ]


def test_host_times_are_re_measured_lagging_cases_and_at_the_end(monkeypatch):
    """A decode case's host time is measured in its case, again HOST_LAG cases later, and the
    rounds the run's end leaves are taken in passes after the last case; the figure is the median
    of the rounds."""
    specs = [s for s in _small_specs() if s.decode] * 3  # three decode cases
    seen = []
    real = bench.runner.remeasure_host

    def spy(spec, case, settings, backend="cuda"):
        seen.append((len(seen_cases[0]), [c is case for c in seen_cases[0]].index(True)))
        real(spec, case, settings, backend)

    seen_cases = [[]]
    real_run_case = bench.runner.run_case

    def run_case(*args, **kwargs):
        case = real_run_case(*args, **kwargs)
        seen_cases[0].append(case)
        return case

    monkeypatch.setattr(bench.runner, "HOST_LAG", 1)
    monkeypatch.setattr(bench.runner, "remeasure_host", spy)
    monkeypatch.setattr(bench.runner, "run_case", run_case)
    result = bench.run(peers=[], specs=specs, backend="numpy", log=lambda *a: None)
    # (cases run so far, case re-measured): case i again after case i + 1 and i + 2
    assert seen[:3] == [(2, 0), (3, 1), (3, 0)]
    assert sorted(seen[3:]) == [(3, 1), (3, 2), (3, 2)]  # the end's passes
    for c in result["cases"]:
        rounds = c["ropekv"]["host_rounds"]["host_us"]
        assert len(rounds) == 3 and c["ropekv"]["host_us"] == statistics.median(rounds)


def test_peer_builds_name_the_peers_that_compiled_inside_the_run():
    """A peer whose checked first call of a case took more than PEER_BUILD_S compiled inside the
    run (FlashInfer's JIT): its seconds summed and its cases counted; quick first calls, peers
    that did not run, cases with errors and ropekv's own variants count nothing."""
    cases = [
        {"peers": {"flashinfer": {"first_s": 41.0, "us": 2.0}, "torch": {"first_s": 0.01}}},
        {"peers": {"flashinfer": {"first_s": 0.2}, "flashinfer-cake": {"first_s": 9.5}}},
        {"peers": {"flashinfer-cake": {"first_s": 9.0}, "cublas": "needs the CUDA backend"}},
        {"peers": {"ropekv[+status]": {"first_s": 12.0}, "ropekv[qkv.MMA_FORM=0]": {"first_s": 5}}},
        {"peers": {"torch": {"status": "error: boom"}}, "error": "boom"},
    ]
    assert runner.peer_builds(cases) == {"flashinfer": [41.0, 1], "flashinfer-cake": [18.5, 2]}
    assert runner.peer_builds(cases[3:]) == {}


def test_runner_on_the_numpy_backend(tmp_path):
    """The whole run (cases built, ropekv and the PyTorch peer called and compared, timed) on the
    host, then the report, the JSON and the plot from its result."""
    path = tmp_path / "run.json"
    logged = []
    result = bench.run(
        peers=["torch", "flashinfer"],
        specs=_small_specs(),
        backend="numpy",
        json_path=str(path),
        log=lambda i, n, text: logged.append((i, n)),
    )
    assert logged[0] == (0, 3) and logged[-1] == (3, 3)
    assert result["backend"] == "numpy" and result["copy_bandwidth"] > 0
    assert result["peer_status"]["flashinfer"] == "needs the CUDA backend"
    assert [c["name"] for c in result["cases"]] == ["contiguous fp16->fp16 2x5", "qkv int4w T2"]
    for c in result["cases"]:
        assert "error" not in c, c
        assert {
            "op",
            "name",
            "tokens",
            "bytes",
            "decode",
            "series",
            "flops",
            "peers",
            "ropekv",
            "seconds",
        } <= set(c)
        r = c["ropekv"]
        assert r["us"] > 0 and r["gbps"] > 0 and r["pct_copy"] > 0
        assert c["peers"]["flashinfer"]["status"].startswith("skipped")
        torch_peer = c["peers"]["torch"]
        if "torch" in sys.modules or _has_torch():
            assert torch_peer["status"] == "ok" and torch_peer["ratio"] > 0, torch_peer
            assert torch_peer["first_s"] > 0  # its checked first call, timed (peer_builds)
        else:
            assert torch_peer["status"].startswith("skipped")
    decode = result["cases"][1]
    assert decode["weight_bytes"] == qkv.weight_bytes(512, 256, "int4")
    assert decode["weight_format"] == "int4 g128"
    assert decode["ropekv"]["host_us"] > 0 and decode["ropekv"]["pct_copy_weights"] > 0
    rounds = decode["ropekv"]["host_rounds"]["host_us"]  # its case's, then two spread later
    assert len(rounds) == bench.runner.HOST_ROUNDS == 3 and all(us > 0 for us in rounds)
    assert decode["ropekv"]["host_us"] == statistics.median(rounds)
    assert "host_rounds" not in result["cases"][0]["ropekv"]  # prefill: no host time
    assert json.loads(path.read_text())["partial"] is True  # written after every case
    text = bench.report.text(result)
    assert "contiguous fp16->fp16 2x5" in text and "(w " in text
    assert "QKV projection by weight format" in text
    assert "ropekv host time over each op's decode cases" in text
    assert f"  qkv: per call, CuPy {decode['ropekv']['host_us']:.1f}" in text
    bench.write_json(result, str(path))
    data = json.loads(path.read_text())
    assert data["cases"][1]["ropekv"]["pct_copy_weights"] == pytest.approx(
        decode["ropekv"]["pct_copy_weights"]
    )
    if _has_matplotlib():
        bench.plot(result, str(tmp_path / "run.png"))
        assert (tmp_path / "run.png").stat().st_size > 1000


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_broken_case_is_reported_and_the_run_goes_on():
    def broken(xp=None):
        raise ValueError("cannot build")

    specs = [bench.CaseSpec("qkv", "broken", 1, 10, broken), *_small_specs()[:1]]
    result = bench.run(peers=[], specs=specs, backend="numpy", log=lambda *a: None)
    assert result["cases"][0]["error"] == "ValueError: cannot build"
    assert "ropekv" in result["cases"][1]
    assert "ValueError: cannot build" in bench.report.text(result)


def test_frameworks_results_print():
    torch_r = {
        "case": "paged gqa fp16->e4m3 64x1",
        "framework": "torch",
        "bare_us": 2.0,
        "compiled_us": 2.1,
        "overhead_us": 0.1,
        "reduce_overhead_us": 4.0,
        "peer_bare_us": 2.5,
        "peer_compiled_us": 2.6,
        "peer_fullgraph": True,
        "peer_ratio": 2.6 / 2.1,
    }
    jax_r = {
        "case": "paged gqa fp16->e4m3 64x1",
        "framework": "jax",
        "kernel_us": 2.0,
        "step_us": 2.5,
        "host_us": 30.0,
        "address_kept": True,
        "step_us_cmdbuf": 3.5,
        "host_us_cmdbuf": 31.0,
        "address_kept_cmdbuf": False,
        "scan_us_per_step": 2.2,
    }
    text = "\n".join(
        report.frameworks_lines(
            [
                torch_r,
                jax_r,
                {"case": "all", "framework": "jax", "skipped": "JAX not importable"},
                {"case": "qknorm", "framework": "torch", "error": "RuntimeError: boom"},
            ]
        )
    )
    assert "overhead  +0.10 (ok <= 0.3)" in text and "ratio 1.24 (ok >= 1.15)" in text
    assert "step (command buffer)     3.50 (MISSED <= 3.00)" in text
    assert "skipped: JAX not importable" in text and "error: RuntimeError: boom" in text


def test_a_frameworks_only_run_reports(monkeypatch):
    fake = [{"case": "c", "framework": "jax", "skipped": "JAX backend cpu, not gpu"}]
    monkeypatch.setattr(frameworks, "run", lambda calls: fake)
    result = bench.run(peers=[], specs=[], backend="numpy", frameworks=True, log=lambda *a: None)
    assert result["cases"] == [] and result["frameworks"] == fake
    text = bench.report.text(result)
    assert "Inside compiled programs" in text and "skipped: JAX backend cpu" in text


def test_a_failing_frameworks_run_is_an_error_entry(monkeypatch):
    def boom(calls):
        raise ImportError("cannot import name 'x'")

    monkeypatch.setattr(frameworks, "run", boom)
    result = bench.run(peers=[], specs=[], backend="numpy", frameworks=True, log=lambda *a: None)
    assert result["frameworks"][0]["error"] == "ImportError: cannot import name 'x'"


def test_frameworks_without_torch_or_jax_are_skipped_not_errors():
    if _has_torch():
        pytest.skip("PyTorch is installed here")
    (r,) = frameworks.bench_torch(4)
    assert "skipped" in r and "error" not in r


# ---- launch-shape variants (--tune) ----------------------------------------------------------


def test_tune_variants_parse_and_validate():
    assert tuning.parse("paged.heavy=(2,2,3),paged.row_group=0") == {
        "paged": {"heavy": (2, 2, 3), "row_group": 0}
    }
    assert tuning.parse("contiguous.block=64, mla.wave_blocks=660") == {
        "contiguous": {"block": 64},
        "mla": {"wave_blocks": 660},
    }
    for bad, why in (
        ("paged", "op.key=value"),
        ("nope.block=1", "unknown op 'nope'"),
        ("paged.block=x(", "Python literal"),
        ("", "empty variant"),
    ):
        with pytest.raises(ValueError, match=why):
            tuning.parse(bad)
    import ropekv.contiguous as mod

    key = next(iter(mod.TUNING))
    tuning.validate({"contiguous": {key: 1}})
    with pytest.raises(ValueError, match="has no TUNING key or constant not_a_knob"):
        tuning.validate({"contiguous": {"not_a_knob": 1}})
    tuning.validate({"qkv": {"GEMV_MAX_TOKENS": 1000}})  # a module constant
    with pytest.raises(ValueError, match="STEM"):
        tuning.validate({"qkv": {"STEM": "x"}})  # not a number


def test_tune_values_zero_where_it_means_off_and_at_least_one_for_sizes():
    """0 is a value of the thresholds and switches (paged.row_group, paged.lean_multi_upto,
    qknorm.decode_by_token, qknorm.rows_warps: a grid-size threshold although its name ends in
    a size word) and of an undeclared int key; sizes and counts take at least 1 (their kinds,
    ``tuning.KINDS``)."""
    for op, key, default in (
        ("paged", "row_group", 32),
        ("paged", "lean_multi_upto", 1 << 22),
        ("paged", "lean_multi", 4),
        ("qknorm", "decode_by_token", 1),
        ("qknorm", "rows_per_lane", 0),
        ("qknorm", "rows_warps", 512),
        ("qkv", "GEMV_MAX_TOKENS", 2),
        ("x", "some_rows", 4),  # undeclared: a threshold, whatever its name
    ):
        tuning.check_value(op, key, default, 0)
    for op, key, default in (
        ("contiguous", "block", 128),
        ("paged", "row_block_many", 128),
        ("contiguous", "prefill_rows", 3),
        ("qknorm", "rows_block_warps", 4),
        ("qkv", "GEMV_WARPS", 4),
        ("qkv", "TILED_CTAS_PER_SM", 2),
        ("qknorm", "narrow_width", 4),
    ):
        with pytest.raises(ValueError, match="at least 1|between 1 and 1024"):
            tuning.check_value(op, key, default, 0)
        tuning.check_value(op, key, default, 1)
    with pytest.raises(ValueError, match="between 1 and 1024"):
        tuning.check_value("contiguous", "block", 128, 2048)
    with pytest.raises(ValueError, match="at least 0"):
        tuning.check_value("qknorm", "rows_warps", 512, -1)


def test_every_tuning_key_has_a_declared_kind():
    """Each op module's TUNING keys are declared in tuning.KINDS, with a kind their default
    has (and every declared key exists: no stale entry)."""
    import importlib

    from ropekv.bench.workloads import OPS

    kinds = {
        tuning.SIZE: int,
        tuning.THREADS: int,
        tuning.THRESHOLD: int,
        tuning.SWITCH: bool,
        tuning.TUPLE: tuple,
        tuning.NUMBER: float,
    }
    for op in OPS:
        module = importlib.import_module(f"ropekv.{op}")
        for key, default in getattr(module, "TUNING", {}).items():
            kind = tuning.KINDS.get(f"{op}.{key}")
            assert kind is not None, f"{op}.{key} has no declared kind (tuning.KINDS)"
            assert type(default) is kinds[kind], (op, key, kind, default)
    for name, kind in tuning.KINDS.items():
        op, key = name.split(".")
        module = importlib.import_module(f"ropekv.{op}")
        default = (
            module.TUNING[key] if key in getattr(module, "TUNING", {}) else getattr(module, key)
        )
        assert type(default) is kinds[kind], (name, kind, default)


def test_tune_applies_and_restores_the_tuning():
    import ropekv.contiguous as mod
    import ropekv.qkv as qkv_mod

    key = next(iter(mod.TUNING))
    before, gemv = dict(mod.TUNING), qkv_mod.GEMV_MAX_TOKENS
    with (
        pytest.raises(RuntimeError),
        tuning.applied({"contiguous": {key: "changed"}, "qkv": {"GEMV_MAX_TOKENS": gemv + 100}}),
    ):
        assert mod.TUNING[key] == "changed"
        assert qkv_mod.GEMV_MAX_TOKENS == gemv + 100
        raise RuntimeError
    assert mod.TUNING == before and qkv_mod.GEMV_MAX_TOKENS == gemv


def test_tune_variants_run_as_runners(capsys, monkeypatch):
    """On the NumPy backend a variant computes what the default does (the reference ignores launch
    shapes): it is checked, timed, reported beside ropekv, and no peer in the speedup panel."""
    import ropekv.contiguous as mod

    key = next(iter(mod.TUNING))
    before = dict(mod.TUNING)
    label = f"contiguous.{key}={before[key]!r}"
    variants = [(label, tuning.parse(label)), ("qkv only", {"qkv": {"x": 1}})]
    result = bench.run(
        peers=[], specs=_small_specs()[:1], backend="numpy", tune=variants, log=lambda *a: None
    )
    (case,) = result["cases"]
    entry = case["peers"][f"ropekv[{label}]"]
    assert entry["status"] == "ok" and entry["check"] == "ok" and entry["ratio"] > 0
    assert "ropekv[qkv only]" not in case["peers"]
    assert result["tune"][label] == {"contiguous": {key: before[key]}}
    assert mod.TUNING == before
    assert bench.speedups(result) == []
    monkeypatch.setattr(runner, "gpu_status", lambda: (True, "Fake GPU"))
    assert bench.main(tune=["contiguous.not_a_knob=1"]) == 1
    assert "--tune: ropekv.contiguous has no TUNING key or constant not_a_knob" in (
        capsys.readouterr().err
    )


# ---- the package's structure ---------------------------------------------------------------------


def _imports(path):
    """Every module name a Python file imports (at any level)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_import_circle_between_bench_and_check():
    """check imports bench; nothing in ropekv/bench imports check (at any level); each imports
    cleanly in a fresh interpreter, and importing bench loads neither check, CuPy nor torch."""
    pkg = pathlib.Path(bench.__file__).parent
    files = sorted(pkg.rglob("*.py"))
    assert len(files) >= 10
    for f in files:
        # ``from ropekv import check`` reads as ropekv.check here
        bad = {n for n in _imports(f) if n == "ropekv.check" or n.startswith("ropekv.check.")}
        assert not bad, (f, bad)
    code = (
        "import sys; import ropekv.bench; "
        "assert 'ropekv.check' not in sys.modules, 'check'; "
        "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, 'heavy'; "
        "import ropekv.check"
    )
    for c in (code, "import ropekv.check; import ropekv.bench"):
        out = subprocess.run(
            [sys.executable, "-c", c],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr


def test_public_names_stay_importable():
    """Names that the tests, the tools and ``ropekv check`` use keep working."""
    for name in (
        "bench_specs",
        "check_specs",
        "select_specs",
        "run",
        "main",
        "table_rows",
        "write_json",
        "plot",
        "format_table",
        "context_lost",
        "progress",
        "ContiguousWL",
        "PagedWL",
        "MlaWL",
        "QknormWL",
        "QkvWL",
        "OPS",
        "PEERS",
        "DECODE_SWEEP",
        "SWEEP",
        "OP_FUNCTIONS",
        "make_runners",
        "torch_view",
        "torch_graph_us",
        "RMSNORM_SRC",
        "speedups",
    ):
        assert hasattr(bench, name), name
    for name in ("compare", "compare_all", "to_numpy", "to_device", "gpu_status", "check"):
        assert hasattr(check, name), name
    assert tuple(
        cli.build_parser()
        ._subparsers._group_actions[0]
        .choices["bench"]
        ._option_string_actions["--ops"]
        .type("paged,qkv")
    ) == ("paged", "qkv")
    assert set(bench.OPS) == set(cases.base.OPS)


def test_benchmarks_folder_is_gone():
    assert not (pathlib.Path(ROOT) / "benchmarks").exists()


def test_the_recorded_run_still_reads(tmp_path):
    """docs/bench.json (written by an earlier ropekv bench) goes through today's report and plot:
    the JSON schema only grew."""
    result = json.loads((pathlib.Path(ROOT) / "docs" / "bench.json").read_text())
    header, rows, _ = bench.table_rows(result)
    assert len(rows) == len(result["cases"]) and header[0] == "case"
    assert len(bench.speedups(result)) >= len(result["cases"]) // 2
    for c in result["cases"]:
        if c.get("decode") and "ropekv" in c:
            assert "host_us" in c["ropekv"] and "host_us_torch" in c["ropekv"], c["name"]
            for key in ("first_us", "first_us_torch", "host_rounds"):
                assert key in c["ropekv"], (c["name"], key)
    assert "speedup over the best peer" in bench.report.text(result)
    if _has_matplotlib():
        bench.plot(result, str(tmp_path / "recorded.png"))


def test_format_table_pads_columns():
    t = bench.format_table(["a", "bb"], [["xxx", 1]])
    assert t.splitlines() == ["| a   | bb |", "|-----|----|", "| xxx | 1  |"]


def test_context_lost_detection():
    assert bench.context_lost("CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access")
    assert not bench.context_lost("ValueError: q must have shape (T, Hq, R)")
    lost = {
        "error": "",
        "peers": {
            "torch": {"status": "error: CUDA error: an illegal memory access was encountered"}
        },
    }
    assert bench.context_lost(lost)
    assert not bench.context_lost({"name": "x", "peers": {"torch": {"status": "ok"}}})


def _fake_check(monkeypatch, outcomes):
    monkeypatch.setattr(check, "gpu_status", lambda: (True, "Fake GPU"))
    monkeypatch.setattr(
        check, "check_specs", lambda: [(op, name, outcome) for op, name, outcome in outcomes]
    )

    def run_one(outcome):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(check, "run_case", run_one)


def test_check_table_and_exit_code(monkeypatch, capsys):
    _fake_check(monkeypatch, [("paged", "a", None), ("mla", "b", None)])
    assert check.check() == 0
    out = capsys.readouterr().out
    assert "ropekv check on Fake GPU" in out and "2 passed, 0 failed" in out
    _fake_check(monkeypatch, [("paged", "a", None), ("mla", "b", "q_out: 3 values out")])
    assert check.check() == 1
    out = capsys.readouterr().out
    assert "| FAIL" in out and "q_out: 3 values out" in out and "1 passed, 1 failed" in out


def test_check_stops_after_a_sticky_cuda_error(monkeypatch, capsys):
    _fake_check(
        monkeypatch,
        [
            ("paged", "a", None),
            ("mla", "b", RuntimeError("cudaErrorIllegalAddress: boom")),
            ("qkv", "c", None),
        ],
    )
    assert check.check() == 1
    out = capsys.readouterr().out
    assert "not run: the CUDA context was lost in 'mla b'" in out
    assert "1 passed, 2 failed" in out


# ---- the command line ----------------------------------------------------------------------------


def _ropekv(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "ropekv", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_bench_help():
    out = _ropekv("bench", "--help")
    assert out.returncode == 0
    for flag in (
        "--ops",
        "--peers",
        "--cases",
        "--quick",
        "--frameworks",
        "--tune",
        "--json",
        "--plot",
    ):
        assert flag in out.stdout


def test_bad_ops_and_peers_are_usage_errors(capsys):
    for argv in (
        ["bench", "--ops", "paged,nope"],
        ["bench", "--peers", "vllm"],
        ["check", "--ops", "x"],
        ["bench", "--ops"],
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown op nope" in err and "unknown peer vllm" in err


def test_ops_and_peers_parse_commas_and_spaces(monkeypatch):
    seen = {}
    monkeypatch.setattr(_info, "device_state", lambda: (None, 1, None))  # pass cli's GPU check
    monkeypatch.setattr(bench, "main", lambda **kw: seen.update(kw) or 0)
    assert (
        cli.main(
            [
                "bench",
                "--ops",
                "paged,mla",
                "qkv",
                "--peers",
                "torch",
                "--quick",
                "--json",
                "x.json",
            ]
        )
        == 0
    )
    assert seen == {
        "ops": ["paged", "mla", "qkv"],
        "peers": ["torch"],
        "quick": True,
        "json_path": "x.json",
        "plot_path": None,
        "cases": None,
        "frameworks": False,
        "tune": None,
        "options": False,
    }
    seen.clear()
    assert cli.main(["bench", "--options", "--ops", "mla"]) == 0
    assert seen["options"] is True and seen["ops"] == ["mla"]
    seen.clear()
    assert cli.main(["bench", "--frameworks", "--cases", "qkv fp8w", "64x1"]) == 0
    assert seen["frameworks"] is True and seen["cases"] == ["qkv fp8w", "64x1"]
    assert seen["ops"] is None and seen["peers"] is None


def test_without_a_gpu_both_commands_exit_nonzero_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(_info, "device_state", lambda: (None, 1, None))  # pass cli's GPU check
    monkeypatch.setattr(check, "gpu_status", lambda: (False, "no CUDA device found"))
    monkeypatch.setattr(runner, "gpu_status", lambda: (False, "no CUDA device found"))
    assert cli.main(["bench", "--quick"]) == 1
    assert "no CUDA device found; the benchmark needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["check"]) == 1
    assert "no CUDA device found; it needs a CUDA GPU" in capsys.readouterr().err


def test_no_gpu_here_gives_the_message_through_the_console_command():
    from conftest import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    for cmd in ("bench", "check"):
        out = _ropekv(cmd)
        assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr, out.stderr


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_check_passes_on_this_gpu():
    out = _ropekv("check")
    print(out.stdout, out.stderr[-3000:])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "0 failed" in out.stdout


@pytest.mark.gpu
def test_bench_quick_runs(tmp_path):
    path = tmp_path / "quick.json"
    out = _ropekv("bench", "--quick", "--json", str(path))
    print(out.stdout, out.stderr[-3000:])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["cases"] and all("ropekv" in c for c in data["cases"])
    assert data["copy_bandwidth"] > 1e11
    if not os.environ.get("ROPEKV_UNDER_SANITIZER"):  # (every launch is slow under the sanitizer)
        assert data["wall_s"] < 60
    # every peer that ran agreed with ropekv (the quantized QKV weights against cuBLAS's fp16 GEMM
    # on the dequantized weights included)
    for c in data["cases"]:
        for peer, e in c["peers"].items():
            assert e["status"] in ("ok", "-") or e["status"].startswith("skipped"), (
                c["name"],
                peer,
                e,
            )
    for c in (c for c in data["cases"] if c["decode"]):  # host times: three rounds each
        r = c["ropekv"]
        assert set(r["host_rounds"]) == {"host_us", "first_us", "host_us_torch", "first_us_torch"}
        assert all(len(v) == 3 and None not in v for v in r["host_rounds"].values()), c["name"]
        # a replay costs less than a first call: the fastest round against the first calls'
        # median (a round's median per call read 167 us against first calls of 91 once, in a
        # quick run beside 15 GPU-test processes on 16 CPUs)
        assert 0 < min(r["host_rounds"]["host_us"]) < r["first_us"], c["name"]
        # the recorded first calls: the first-call phase's median, spread and rounds
        assert "first_rounds_error" not in r, (c["name"], r.get("first_rounds_error"))
        for key in ("first_us", "first_us_torch"):
            rounds = r["first_rounds"][key]
            assert len(rounds) == timing.FIRST_ROUNDS, c["name"]
            assert r[key] == statistics.median(rounds), c["name"]
            assert r[f"{key}_spread"] == [min(rounds), max(rounds)], c["name"]
    qkv_formats = {c["weight_format"] for c in data["cases"] if c["op"] == "qkv"}
    assert qkv_formats == {"fp16", "fp8 e4m3 per-row", "int4 g128"}
    assert all(c["peers"]["cublas"]["status"] == "ok" for c in data["cases"] if c["op"] == "qkv")


@pytest.mark.gpu
def test_graph_timing_ends_a_capture_an_exception_interrupts(monkeypatch):
    """A call that cannot be captured (cuBLAS through CuPy) raises, and the capture it interrupted
    is ended: an open capture would break every later synchronising call (cuRAND's, say)."""
    import cupy as cp

    from ropekv import _timing

    made = []

    class Recorded(cp.cuda.Stream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cp.cuda, "Stream", Recorded)
    a = cp.ones((64, 64), cp.float32)
    # the class depends on the CuPy / cuBLAS version (a cuBLAS or a CUDA runtime error)
    with pytest.raises(Exception):  # noqa: B017 - any error; what is checked is the capture's end
        _timing.graph_us(lambda: a @ a, calls=2, replays=1)
    assert made and not made[-1].is_capturing()
    cp.random.standard_normal(4)
    cp.cuda.Device().synchronize()


def test_options_run_as_runners_and_report_their_cost(monkeypatch):
    """``--options``: each option of the case's op runs as ``ropekv[+option]`` beside the plain
    call, is checked against it when it leaves the sampled rows alone, only timed when it does
    not, and the report gives its cost; option runners are not peers."""
    spec = bench.CaseSpec(
        "mla",
        "mla tiny 3x2",
        6,
        1,
        base._lazy(
            bench.MlaWL,
            B=3,
            S=2,
            prefix=5,
            Hq=4,
            L=64,
            R=32,
            dtype=np.float16,
            cache_dtype=np.float16,
        ),
    )
    plain = bench.MlaWL.options

    def options(self):
        out = plain(self)
        out["clear, unchecked"] = (out["clear"][0], False)
        return out

    monkeypatch.setattr(bench.MlaWL, "options", options)
    result = bench.run(peers=[], specs=[spec], backend="numpy", options=True, log=lambda *a: None)
    (case,) = result["cases"]
    assert "error" not in case, case
    assert result["options"] is True
    for label in ("status", "clear"):
        entry = case["peers"][f"ropekv[+{label}]"]
        assert entry["status"] == "ok" and entry["check"] == "ok" and entry["ratio"] > 0, entry
    entry = case["peers"]["ropekv[+clear, unchecked]"]
    assert entry["status"] == "ok" and entry["check"].startswith("not compared"), entry
    assert set(bench.report.option_costs(result)) == {"status", "clear", "clear, unchecked"}
    text = bench.report.text(result)
    assert "Options on" in text and "status" in text
    assert bench.speedups(result) == []
    # without --options no option runner
    result = bench.run(peers=[], specs=[spec], backend="numpy", log=lambda *a: None)
    assert not any(p.startswith("ropekv[+") for p in result["cases"][0]["peers"])


def test_qknorm_options_time_the_computed_scales():
    """The QK-norm workload's options on an fp8 cache with static scales: dynamic fp8 q and
    per-token-head KV scales run (NumPy backend) as unchecked runners (they change the outputs)
    and write their scales; a case that already computes scales, or a 16-bit cache, has none."""
    from ropekv.bench.workloads.qknorm import QknormWL

    kw = {"B": 2, "S": 3, "prefix": 5, "Hq": 4, "Hkv": 2, "D": 64, "dtype": BF16}
    spec = bench.CaseSpec(
        "qknorm", "qknorm tiny 2x3", 6, 1, base._lazy(QknormWL, cache_dtype=E4M3, **kw)
    )
    result = bench.run(peers=[], specs=[spec], backend="numpy", options=True, log=lambda *a: None)
    (case,) = result["cases"]
    assert "error" not in case, case
    for label in ("dynamic q", "kv scales"):
        entry = case["peers"][f"ropekv[+{label}]"]
        assert entry["status"] == "ok" and entry["check"].startswith("not compared"), entry
    w = QknormWL(np, cache_dtype=E4M3, **kw)
    opts = w.options()
    assert set(opts) == {"dynamic q", "kv scales"}
    for extra, checked in opts.values():
        assert not checked
        w.call(w.new_outputs(), **extra)
    q_scales = opts["dynamic q"][0]["q_scale_out"]
    assert q_scales.shape == (6, 4) and (q_scales > 0).all()
    k_scales, v_scales = opts["kv scales"][0]["kv_cache_scales"]
    assert (k_scales > 0).sum() == (v_scales > 0).sum() == 6 * 2  # one per token and KV head
    assert QknormWL(np, cache_dtype=E4M3, kv_dynamic=True, **kw).options() == {}
    assert QknormWL(np, cache_dtype=BF16, **kw).options() == {}


def test_source_digest_names_the_code_that_ran(tmp_path, monkeypatch):
    """The JSON's source_digest is the package's sources, not the git state a copied tree carries:
    the same for a byte-identical copy elsewhere, another after one kernel byte changes, blind to
    caches; ROPEKV_GIT_REVISION overrides the revision label."""
    import shutil

    import ropekv

    pkg = pathlib.Path(ropekv.__file__).resolve().parent
    copy = tmp_path / "ropekv"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = runner.source_digest()
    assert len(digest) == 12 and runner.source_digest(str(copy)) == digest
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "x.pyc").write_bytes(b"stale")
    (copy / "notes.txt").write_text("not a source")
    assert runner.source_digest(str(copy)) == digest
    kernel = copy / "kernels" / "qkv.cu"
    kernel.write_bytes(kernel.read_bytes() + b" ")
    assert runner.source_digest(str(copy)) != digest
    monkeypatch.delenv("ROPEKV_GIT_REVISION", raising=False)
    head = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    if head.returncode == 0:  # a checkout: its revision, "-dirty" with changes to tracked files
        assert runner.git_revision().removesuffix("-dirty") == head.stdout.strip()
    monkeypatch.setenv("ROPEKV_GIT_REVISION", "0123456789ab")
    assert runner.git_revision() == "0123456789ab"
    text = report.text(
        {**_result(), "environment": {"git_revision": "abc", "source_digest": digest}}
    )
    assert f"@ abc, sources {digest}" in text


def test_run_records_the_cpus_its_process_may_run_on(monkeypatch):
    """Host times move with the process's CPU placement, so the JSON and the text say which CPUs
    the run had: a pinned process names its core, an unpinned one the whole machine."""
    assert runner.cpu_ranges({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert runner.cpu_ranges({5}) == "5"
    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: {2}, raising=False)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 16)
    assert runner.host_cpus() == "2 of 16"
    text = report.text({**_result(), "environment": {"host_cpus": "2 of 16"}})
    assert "host CPUs the process may run on: 2 of 16" in text

    def refused(pid):
        raise OSError("not on this platform")

    monkeypatch.setattr(runner.os, "sched_getaffinity", refused, raising=False)
    assert runner.host_cpus() is None
    assert "host CPUs" not in report.text({**_result(), "environment": {}})


def test_graph_replay_times_the_eager_qkv_path():
    """While the bench captures a call for its graph replay, the fused QKV op's capture plans are
    off (GRAPH_MAX_TOKENS 0: a call that runs cuBLAS eagerly is refused and event-timed, as its
    host time is that path's); the setting comes back afterwards, after an error too."""
    from ropekv import qkv
    from ropekv.bench import timing

    before = qkv.GRAPH_MAX_TOKENS
    assert before > 0
    with timing._eager_path_in_graphs():
        assert qkv.GRAPH_MAX_TOKENS == 0
    assert qkv.GRAPH_MAX_TOKENS == before
    with pytest.raises(RuntimeError), timing._eager_path_in_graphs():
        raise RuntimeError("capture failed")
    assert qkv.GRAPH_MAX_TOKENS == before


# ---- tools/device_ab.py: two trees' device times in alternating processes ----------------------


FAKE_BENCH = """import json, sys
us = {us}
args = sys.argv[1:]
out = args[args.index("--json") + 1]
cases = [{{"name": n, "ropekv": {{"us": t}}}} for n, t in us.items()]
json.dump({{"cases": cases, "args": args[:-2]}}, open(out, "w"))
"""


def test_device_ab_alternates_trees_and_reads_each_trees_package(tmp_path, capsys):
    """tools/device_ab.py: old and new processes alternate (old first in odd rounds), each
    imports the ropekv of its own tree (stand-in packages whose ``python -m ropekv`` writes the
    bench JSON), gets the bench arguments after ``--`` (``--peers cublas`` added where they name
    no peers), and each case's line is the median of new over the median of old, printed after
    every round both trees have run; a case missing from a run is left out."""
    ab = load_tool("device_ab")
    assert ab.order(3) == [("old", 1), ("new", 1), ("new", 2), ("old", 2), ("old", 3), ("new", 3)]
    for tree, us in (("old", {"a": 10.0, "b": 4.0}), ("new", {"a": 11.0, "b": 4.0, "c": 1.0})):
        pkg = tmp_path / tree / "ropekv"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "__main__.py").write_text(FAKE_BENCH.format(us=us))
    out = tmp_path / "ab"
    ab.main(
        [str(tmp_path / "old"), "--new", str(tmp_path / "new"), "--rounds", "2"]
        + ["--out", str(out), "--", "--ops", "qkv"]
    )
    printed = capsys.readouterr().out.splitlines()
    assert [printed[k] for k in (0, 1, 4, 5)] == [
        "old round 1: done",
        "new round 1: done",
        "new round 2: done",
        "old round 2: done",
    ]
    for rows in (printed[2:4], printed[6:]):  # after round 1, after round 2
        assert [line.split()[0] for line in rows] == ["a", "b"]  # "c": not in the old runs
        assert rows[0].endswith("new / old 1.100") and rows[1].endswith("new / old 1.000")
    runs = [json.loads((out / f"{t}-{i}.json").read_text()) for t in ("old", "new") for i in (1, 2)]
    assert all(r["args"] == ["bench", "--ops", "qkv", "--peers", "cublas"] for r in runs)
    assert ab.bench_arguments(["--peers", "torch"]) == ["--peers", "torch"]


def test_device_ab_summary_medians():
    """summarize: per case the runs' times in order and median(new) / median(old)."""
    ab = load_tool("device_ab")

    def run(**us):
        return {"cases": [{"name": n, "ropekv": {"us": t}} for n, t in us.items()]}

    rows = ab.summarize({"old": [run(x=2.0), run(x=4.0), run(x=3.0)], "new": [run(x=3.0)] * 3})
    assert rows == [("x", [2.0, 4.0, 3.0], [3.0, 3.0, 3.0], 1.0)]
