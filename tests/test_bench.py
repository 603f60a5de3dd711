"""``ropekv bench`` and ``ropekv check``: byte accounting, case construction, the table / JSON
writer and the command line on the CPU; on a GPU, both commands run and exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from ropekv import _info, bench, check, cli, reference
from ropekv import bytes as nb

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
        32 * 128 * 4 + 2 * 8 * 128 * 3 + 256)


def test_mla_rmsnorm_bytes():
    per_token = 128 * 64 * 2 * 2 + 576 * 2 + 576 + 64 * 4
    assert nb.mla_rmsnorm_bytes(10, 128, 512, 64, BF16, E4M3) == 10 * per_token + 512 * 2
    assert nb.mla_rmsnorm_bytes(10, 128, 512, 64, BF16, E4M3, kv_norm_dim=128) == (
        10 * per_token + 128 * 2)


def test_qknorm_bytes_add_the_two_norm_weights_once():
    assert nb.qknorm_bytes(5, 32, 8, 128, 128, BF16, BF16) == (
        nb.rope_kv_bytes(5, 32, 8, 128, 128, BF16, BF16, BF16) + 2 * 128 * 2)


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
        rows = [("q_rope_out", (1, 2)), ("q_nope_out", (1, 2)), ("cache0", (2,)),
                ("cache1", (2,))]
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
    got = _workload_bytes(w, ("q_rope", "kv", "gamma"),
                          [("q_rope_out", (1, 2)), ("ckv", (2,)), ("kpe", (2,))], 6, 32)
    assert got == nb.mla_rmsnorm_bytes(6, 8, 128, 32, BF16, E4M3)
    w = bench.QknormWL(np, B=2, S=3, prefix=4, Hq=8, Hkv=2, D=64, dtype=BF16, cache_dtype=E4M3)
    got = _workload_bytes(w, ("q", "k", "v", "q_gamma", "k_gamma"),
                          [("q_out", (1, 2)), ("k_cache", (2, 3)), ("v_cache", (2, 3))], 6, 64)
    assert got == nb.qknorm_bytes(6, 8, 2, 64, 64, BF16, E4M3)
    w = bench.QkvWL(np, B=2, S=3, prefix=4, K=96, Hq=4, Hkv=2, D=64, dtype=F16, cache_dtype=F16)
    got = _workload_bytes(w, ("hidden", "weight"),
                          [("q_out", (1,)), ("k_cache", (2, 3)), ("v_cache", (2, 3))], 6, 64)
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
    # every op with decode cases sweeps the decode token counts
    for op in bench.OPS:
        decode = [s for s in specs if s.op == op and s.decode]
        if decode:
            series = {s.series for s in decode if s.series}
            assert series, op
            for name in series:
                tokens = sorted(s.tokens for s in specs if s.series == name and s.decode)
                assert tokens == sorted(bench.DECODE_SWEEP), (name, tokens)
    assert all(s.decode == (s.tokens <= 256 and "x1" in s.name.split()[-1] or s.decode)
               for s in specs)


def test_registry_holds_the_standard_cases():
    names = {s.name for s in bench.bench_specs()}
    for name in ["contiguous fp16->fp16 8x1024", "contiguous fp16->e4m3 64x1",
                 "paged gqa fp16->e4m3 8x1024", "paged gqa fp16->e4m3 4x2048",
                 "paged gqa fp16->fp16 256x1", "paged gqa bf16->e4m3 8x1024",
                 "paged mla bf16->e4m3 4x2048", "paged mla bf16->e4m3 1x1",
                 "mla rmsnorm bf16->e4m3 4x2048", "mla rmsnorm bf16->e4m3 128x1",
                 "qkv fp16 K4096 N6144 T8192", "qkv fp16 K4096 N6144 T1"]:
        assert name in names, name


def test_missing_ops_register_no_case(monkeypatch):
    monkeypatch.setattr(bench, "op_available", lambda op: op == "contiguous")
    assert {s.op for s in bench.select_specs()} == {"contiguous"}
    assert {s.op for s in bench.select_specs(["paged"])} == set()
    assert all(s.quick for s in bench.select_specs(quick=True))


def test_check_cases_run_on_the_numpy_backend():
    cases = bench.check_specs()
    assert cases, "no op available"
    for op, name, build in cases:
        w = build()
        before = {k: v.copy() for k, v in w.outputs(full=True).items()}
        w.call(w.a)
        after = w.outputs(full=True)
        # the reference changed something, and both builds of one case are identical
        assert any(not np.array_equal(before[k].view(np.uint8), after[k].view(np.uint8))
                   for k in before), name
        again = build().outputs(full=True)
        assert all(np.array_equal(again[k].view(np.uint8), before[k].view(np.uint8))
                   for k in before), name


def _torch_outputs(w):
    o = w.new_outputs()
    to = {k: bench._to_torch(v) for k, v in o.items()}
    ti = {k: bench._to_torch(v) for k, v in w.a.items() if k not in o}
    fn, args = w.torch_fn(ti, to)
    fn(*args)
    return w.outputs(o, full=True)


def test_torch_peers_compute_the_reference():
    """The PyTorch compositions (the eager and torch.compile peers) agree with the reference."""
    pytest.importorskip("torch")
    for op, name, build in bench.check_specs():
        ref = build()
        ref.call(ref.a)
        assert check.compare_all(_torch_outputs(build()), ref.outputs(full=True),
                                 ref.compare_mode) is None, name


def test_torch_qkv_peer_computes_the_reference():
    pytest.importorskip("torch")
    for rope, layout in ((True, "NHD"), (False, "HND")):
        w = bench.QkvWL(np, seed=3, poison=True, B=2, S=5, prefix=7, K=256, Hq=4, Hkv=2, D=64,
                        dtype=F16, cache_dtype=F16, layout=layout, rope=rope)
        got = _torch_outputs(w)
        a = w.a
        reference.fused_qkv_matmul_append_paged_kv_cache(
            a["hidden"], a["weight"], a["input_row_offsets"], a["cache_lengths"],
            a["block_table"], a["k_cache"], a["v_cache"], a["q_out"], 4,
            cos_sin_cache=a["table"], kv_layout=layout)
        assert check.compare_all(got, w.outputs(full=True), "gemm") is None


@pytest.mark.parametrize("cache", [BF16, E4M3])
def test_steps_peer_maps_onto_the_paged_op(cache):
    """The 'steps' peer of the MLA op (RMSNorm, then ropekv's paged op) writes the MLA op's
    cache rows: checked here with the NumPy backend of both ops."""
    import ropekv

    w = bench.MlaWL(np, seed=5, poison=True, B=3, S=5, prefix=9, Hq=4, L=128, R=32, dtype=BF16,
                    cache_dtype=cache, kv_scale=2.0 if cache == E4M3 else None)
    fn = ropekv.rope_quantize_fp8_append_paged_kv_cache if cache == E4M3 else \
        ropekv.rope_append_paged_kv_cache
    o = w.new_outputs()
    # what the norm kernel writes: the normalised latent rows, divided by kv_scale, into ckv
    scale = w.kv_scale or 1.0
    o["ckv"][w.page, w.entry] = reference.to_dtype(
        reference.rms_norm(w.a["kv"][:, :128], w.a["gamma"], w.eps) / scale, cache)
    q_out = np.zeros(w.a["q_rope"].shape, cache)
    w.steps_append(fn, q_out, o, np)()
    got = {k: v for k, v in w.outputs(o, full=True).items() if k != "q_rope_out"}
    w.call(w.a)
    assert check.compare_all(got, w.outputs(full=True)) is None


def test_steps_peer_rmsnorm_kernel_compiles_for_sm90():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from ropekv._compile import _header_options

    prog = nvrtc.createProgram(bench._RMSNORM_SRC, "rmsnorm.cu", [], [])
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
        "environment": {"gpu": "NVIDIA H200", "driver": "580", "cupy": "14.2.0",
                        "git_revision": "abc"},
        "copy_bandwidth": 4.2e12, "wall_s": 12.5, "missing_ops": ["qkv"],
        "peer_status": {"flashinfer": "used", "torch": "used",
                        "torch-compile": "FlashInfer not importable", "cublas": "used"},
        "cases": [
            {"op": "paged", "name": "paged gqa fp16->e4m3 8x1024", "tokens": 8192,
             "bytes": 155_189_248, "decode": False, "series": "s", "flops": 0,
             "ropekv": dict(ok),
             "peers": {"flashinfer": {"status": "ok", "check": "ok", "us": 120.0, "ratio": 1.5},
                       "torch": {"status": "mismatch", "check": "MISMATCH: q: 3 of 9 values",
                                 "us": 800.0, "ratio": 10.0},
                       "torch-compile": {"status": "skipped: no torch"}}},
            {"op": "paged", "name": "paged gqa fp16->e4m3 64x1", "tokens": 64,
             "bytes": 1_212_416, "decode": True, "series": "s", "flops": 0,
             "ropekv": dict(ok, us=2.0, graph_us=2.0, host_us=9.5),
             "peers": {"flashinfer": {"status": "ok", "us": 2.4, "ratio": 1.2, "host_us": 18.0,
                                      "graph_us": 2.4},
                       "cublas": {"status": "ok", "us": 17.0, "ratio": 8.5, "host_us": 15.0,
                                  "graph_error": "NotImplementedError: cuBLAS in capture"},
                       "torch": {"status": "error: RuntimeError: boom"},
                       "torch-compile": {"status": "-"}}},
            {"op": "qkv", "name": "broken", "tokens": 1, "bytes": 10, "error": "ValueError: x"},
        ]}


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
    out = bench.report(_result())
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


def test_format_table_pads_columns():
    t = bench.format_table(["a", "bb"], [["xxx", 1]])
    assert t.splitlines() == ["| a   | bb |", "|-----|----|", "| xxx | 1  |"]


def test_context_lost_detection():
    assert bench.context_lost("CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access")
    assert not bench.context_lost("ValueError: q must have shape (T, Hq, R)")
    lost = {"error": "", "peers": {"torch": {"status": "error: CUDA error: an illegal memory "
                                                       "access was encountered"}}}
    assert bench.context_lost(lost)
    assert not bench.context_lost({"name": "x", "peers": {"torch": {"status": "ok"}}})


def _fake_check(monkeypatch, outcomes):
    monkeypatch.setattr(check, "gpu_status", lambda: (True, "Fake GPU"))
    monkeypatch.setattr(bench, "check_specs",
                        lambda: [(op, name, outcome) for op, name, outcome in outcomes])

    def run_one(outcome):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(check, "_run_one", run_one)


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
    _fake_check(monkeypatch, [("paged", "a", None),
                              ("mla", "b", RuntimeError("cudaErrorIllegalAddress: boom")),
                              ("qkv", "c", None)])
    assert check.check() == 1
    out = capsys.readouterr().out
    assert "not run: the CUDA context was lost in 'mla b'" in out
    assert "1 passed, 2 failed" in out


# ---- the command line ----------------------------------------------------------------------------


def _ropekv(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ropekv", *args], capture_output=True,
                          text=True, env=env, timeout=600, check=False)


def test_bench_help():
    out = _ropekv("bench", "--help")
    assert out.returncode == 0
    for flag in ("--ops", "--peers", "--quick", "--json", "--plot"):
        assert flag in out.stdout


def test_bad_ops_and_peers_are_usage_errors(capsys):
    for argv in (["bench", "--ops", "paged,nope"], ["bench", "--peers", "vllm"],
                 ["check", "--ops", "x"], ["bench", "--ops"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown op nope" in err and "unknown peer vllm" in err


def test_ops_and_peers_parse_commas_and_spaces(monkeypatch):
    seen = {}
    monkeypatch.setattr(_info, "device_state", lambda: (None, 1, None))  # pass cli's GPU check
    monkeypatch.setattr(bench, "main", lambda **kw: seen.update(kw) or 0)
    assert cli.main(["bench", "--ops", "paged,mla", "qkv", "--peers", "torch", "--quick",
                     "--json", "x.json"]) == 0
    assert seen == {"ops": ["paged", "mla", "qkv"], "peers": ["torch"], "quick": True,
                    "json_path": "x.json", "plot_path": None}


def test_without_a_gpu_both_commands_exit_nonzero_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(check, "gpu_status", lambda: (False, "no CUDA device found"))
    monkeypatch.setattr(bench, "gpu_status", lambda: (False, "no CUDA device found"))
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
    assert data["wall_s"] < 60
