"""``ropekv bench --frameworks``: ropekv inside compiled programs, against its eager launch.

Decode shapes of the standard cases (Llama-3-8B attention, 1024 cached tokens, page size 16; MLA:
DeepSeek-V3). Device times are medians over CUDA-graph replays (torch) or over back-to-back steps
queued behind a spin kernel on XLA's stream (JAX), in microseconds per call.

torch, per op:
  bare     the eager ropekv launch (torch tensors, ``stream=`` torch's) captured ``calls`` times
           in one ``torch.cuda.CUDAGraph``: replay time / calls
  compiled a module whose forward calls the ``ropekv.torch`` op (caches, inputs and outputs are
           buffers), ``torch.compile(fullgraph=True)``, its forward captured ``calls`` times
  overhead compiled - bare (target: at most 0.3 us)
  reduce   ``torch.compile(mode="reduce-overhead")``: one call = one graph launch, device time per
           call queued behind a spin kernel (graph launch included)
  peer     FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` (its custom op) in the same
           module, compiled and captured the same way; target: peer / compiled >= 1.15

JAX, per op: the jitted decode step (the cache donated):
  kernel   the eager ropekv kernel on CuPy arrays under CuPy graph replay
  step     device time per jitted step, steps queued back to back behind a spin kernel on XLA's
           stream (target: at most kernel + 1 us); also with ``command_buffer_compatible=True``
  scan     a ``jax.lax.scan`` over ``calls`` steps in one jitted call, device time per step
  host     wall time per jitted step, back to back
  address  whether the donated cache kept its buffer address across steps (no copy)

JAX is told not to preallocate GPU memory (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, set when this
module is imported, before JAX is) so that torch, CuPy and XLA share the device.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

import ropekv
from ropekv.bench.arrays import one_line

LLAMA = {"Hq": 32, "Hkv": 8, "D": 128}
PREFIX, PAGE = 1024, 16
TARGET_OVERHEAD_US, TARGET_PEER_RATIO, TARGET_JAX_US = 0.3, 1.15, 1.0


# ---- torch ---------------------------------------------------------------------------------------


def torch_graph_us(fn, calls, replays=20):
    """Device time per call of ``fn()`` captured ``calls`` times in one CUDA graph (the timer of
    ``ropekv bench``)."""
    from ropekv.bench import timing

    return timing.torch_graph_us(fn, calls, replays)


def torch_queued_us(fn, calls, replays=10):
    """Device time per call of ``calls`` back-to-back ``fn()`` queued behind a spin kernel, so the
    device never waits for the host (graph launches of reduce-overhead mode included)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = int(min(max(3 * host_s, 1e-3), 0.5) * 2e9)  # ~2 GHz clock: 3x the enqueue time
    times = []
    for _ in range(replays):
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


class Tensors:
    """The case's tensors as attributes (``t.q``), as the calls below read them."""

    def __init__(self, tensors):
        self.__dict__.update(tensors)


def torch_cases(device):
    """(name, tensors, eager(t, stream), ropekv.torch call(t), FlashInfer call(t) or None)."""
    import torch

    c = _TorchCases(torch, device)
    for build in (_paged_torch_case, _contiguous_torch_case, _qknorm_torch_case, _mla_torch_case):
        build(c, torch)  # in this order: the cases draw from one seeded generator
    return c.cases


class _TorchCases:
    """What :func:`torch_cases`'s cases are built with on ``device``: one seeded generator, the
    helpers that draw from it, and the list of cases :meth:`add` appends to."""

    def __init__(self, torch, device):
        import ropekv.torch as rt

        self.torch, self.device, self.rt = torch, device, rt
        self.g = torch.Generator(device=device).manual_seed(0)
        self.cases = []

    def randn(self, *shape, dtype=None):
        torch = self.torch
        x = torch.randn(*shape, generator=self.g, device=self.device, dtype=torch.float32)
        return x.to(dtype or torch.float16)

    def pages(self, B, seq):
        per = -(-seq // PAGE)
        num_pages = B * per + 64
        ids = self.torch.randperm(num_pages, generator=self.g, device=self.device)[: B * per]
        return per, num_pages, ids.int()

    def ints(self, values):
        return self.torch.as_tensor(np.asarray(values, np.int32), device=self.device)

    def table(self, P, R):
        return self.torch.from_numpy(ropekv.cos_sin_cache(P, R)).to(self.device)

    def zeros(self, *shape, dtype):
        """Zeros of ``dtype`` (8-bit ones made as float32 zeros, then converted)."""
        return self.torch.zeros(*shape, device=self.device).to(dtype)

    def add(self, name, t, function, args, flashinfer=None):
        """A case calling ``function`` on ``args(t) -> (positional, keywords)``: eagerly
        (``ropekv.<function>`` on a given stream) and as the torch op (``ropekv.torch``)."""
        eager_fn, op_fn = getattr(ropekv, function), getattr(self.rt, function)

        def eager(t, stream):
            a, kw = args(t)
            eager_fn(*a, **kw, stream=stream)

        def op(t):
            a, kw = args(t)
            return op_fn(*a, **kw)

        self.cases.append((name, t, eager, op, flashinfer))


def _paged_torch_case(c, torch):
    """Paged GQA fp16 -> e4m3, 64 x 1 (FlashInfer's op)."""
    Hq, Hkv, D = LLAMA["Hq"], LLAMA["Hkv"], LLAMA["D"]
    e4m3 = torch.float8_e4m3fn
    B = 64
    per, num_pages, ids = c.pages(B, PREFIX + 1)
    t = {
        "q": c.randn(B, Hq, D),
        "k": c.randn(B, Hkv, D),
        "v": c.randn(B, Hkv, D),
        "table": c.table(PREFIX + 16, D),
        "pos": c.ints(np.full(B, PREFIX)),
        "kv_indices": ids,
        "kv_indptr": c.ints(np.arange(B + 1) * per),
        "batch": c.ints(np.arange(B)),
        "k_cache": c.zeros(num_pages, PAGE, Hkv, D, dtype=e4m3),
        "v_cache": c.zeros(num_pages, PAGE, Hkv, D, dtype=e4m3),
        "q_out": torch.empty(B, Hq, D, device=c.device, dtype=e4m3),
        "q_nope_out": torch.empty(B, Hq, 0, device=c.device, dtype=e4m3),
    }

    def paged_args(t):
        return (
            (
                t.q,
                t.k,
                None,
                None,
                t.v,
                t.table,
                t.pos,
                (t.k_cache, t.v_cache),
                t.kv_indices,
                t.kv_indptr,
                t.batch,
                t.pos,
            ),
            {
                "page_size": PAGE,
                "quantize_dtype": e4m3,
                "q_rope_out": t.q_out,
                "q_nope_out": t.q_nope_out,
            },
        )

    def paged_flashinfer(t):
        import flashinfer.rope

        a, kw = paged_args(t)
        return flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache(
            *a, **{**kw, "q_nope_out": None}
        )

    c.add(
        "paged gqa fp16->e4m3 64x1",
        t,
        "rope_quantize_fp8_append_paged_kv_cache",
        paged_args,
        paged_flashinfer,
    )


def _contiguous_torch_case(c, torch):
    """Contiguous fp16 -> fp16, 64 x 1, a cache of C = 4096 rows."""
    Hq, Hkv, D = LLAMA["Hq"], LLAMA["Hkv"], LLAMA["D"]
    B, C = 64, 4096
    t = {
        "q": c.randn(B, 1, Hq, D),
        "k": c.randn(B, 1, Hkv, D),
        "v": c.randn(B, 1, Hkv, D),
        "cache": torch.zeros(B, 2, Hkv, C, D, device=c.device, dtype=torch.float16),
        "table": c.table(C, D),
        "lens": c.ints(np.full(B, PREFIX + 1)),
    }
    c.add(
        "contiguous fp16->fp16 64x1",
        t,
        "apply_rope_write_kv",
        lambda t: ((t.q, t.k, t.v, t.cache, t.table), {"kv_end_lens": t.lens}),
    )


def _qknorm_torch_case(c, torch):
    """QK-norm bf16 -> e4m3, 64 x 1 (Qwen3-8B)."""
    Hq, Hkv, D = LLAMA["Hq"], LLAMA["Hkv"], LLAMA["D"]
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    B = 64
    per, num_pages, ids = c.pages(B, PREFIX + 1)
    t = {
        "q": c.randn(B, Hq, D, dtype=bf16),
        "k": c.randn(B, Hkv, D, dtype=bf16),
        "v": c.randn(B, Hkv, D, dtype=bf16),
        "q_gamma": c.randn(D, dtype=torch.float32),
        "k_gamma": c.randn(D, dtype=torch.float32),
        "table": c.table(PREFIX + 16, D),
        "offsets": c.ints(np.arange(B + 1)),
        "lengths": c.ints(np.full(B, PREFIX)),
        "block_table": ids.reshape(B, per),
        "k_cache": c.zeros(num_pages, PAGE, Hkv, D, dtype=e4m3),
        "v_cache": c.zeros(num_pages, PAGE, Hkv, D, dtype=e4m3),
        "q_out": torch.empty(B, Hq, D, device=c.device, dtype=bf16),
    }

    def qknorm_args(t):
        return (
            (
                t.q,
                t.k,
                t.v,
                t.q_gamma,
                t.k_gamma,
                t.table,
                t.offsets,
                t.lengths,
                t.block_table,
                (t.k_cache, t.v_cache),
            ),
            {"q_out": t.q_out},
        )

    c.add("qknorm bf16->e4m3 64x1", t, "qk_rmsnorm_rope_append_paged_kv_cache", qknorm_args)


def _mla_torch_case(c, torch):
    """MLA RMSNorm bf16 -> e4m3, 128 x 1 (DeepSeek-V3: Hq 128, L 512, R 64)."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    B, L, R, Hm = 128, 512, 64, 128
    per, num_pages, ids = c.pages(B, PREFIX + 1)
    t = {
        "q": c.randn(B, Hm, R, dtype=bf16),
        "kv": c.randn(B, L + R, dtype=bf16),
        "gamma": c.randn(L, dtype=bf16),
        "table": c.table(PREFIX + 16, R),
        "offsets": c.ints(np.arange(B + 1)),
        "lengths": c.ints(np.full(B, PREFIX)),
        "block_table": ids.reshape(B, per),
        "cache": c.zeros(num_pages, PAGE, L + R, dtype=e4m3),
        "q_out": torch.empty(B, Hm, R, device=c.device, dtype=bf16),
    }

    def mla_args(t):
        return (
            (t.q, t.kv, t.gamma, t.table, t.offsets, t.lengths, t.block_table, t.cache),
            {"q_rope_out": t.q_out},
        )

    c.add("mla rmsnorm bf16->e4m3 128x1", t, "mla_rope_rmsnorm_append_paged_kv_cache", mla_args)


def bench_torch(calls):
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return [
            {
                "case": "all",
                "framework": "torch",
                "skipped": f"PyTorch not importable ({one_line(exc)})",
            }
        ]
    if not torch.cuda.is_available():
        return [{"case": "all", "framework": "torch", "skipped": "PyTorch sees no CUDA device"}]

    class Layer(torch.nn.Module):
        """One layer's call; every tensor a buffer (static addresses, as CUDA graphs need)."""

        def __init__(self, tensors, call):
            super().__init__()
            for name, t in tensors.items():
                self.register_buffer(name, t)
            self.call = call

        def forward(self):
            return self.call(self)

    results = []
    for name, tensors, eager, op, peer in torch_cases("cuda"):
        try:
            r = _torch_case(Layer, name, tensors, eager, op, peer, calls)
        except Exception as e:  # noqa: BLE001 - one broken case must not end the run
            r = {"case": name, "framework": "torch", "error": one_line(e)}
        results.append(r)
    return results


def _torch_case(Layer, name, tensors, eager, op, peer, calls):
    import torch

    r = {"case": name, "framework": "torch"}
    plain = Tensors(tensors)
    r["bare_us"] = torch_graph_us(
        lambda: eager(plain, torch.cuda.current_stream().cuda_stream), calls
    )
    torch._dynamo.reset()
    compiled = torch.compile(Layer(tensors, op), fullgraph=True)
    r["compiled_us"] = torch_graph_us(compiled, calls)
    r["overhead_us"] = r["compiled_us"] - r["bare_us"]
    torch._dynamo.reset()
    reduce = torch.compile(Layer(tensors, op), mode="reduce-overhead", fullgraph=True)
    r["reduce_overhead_us"] = torch_queued_us(reduce, calls)
    if peer is not None:
        r.update(_peer(Layer, tensors, peer, calls))
        if "peer_compiled_us" in r:
            r["peer_ratio"] = r["peer_compiled_us"] / r["compiled_us"]
    return r


def _peer(Layer, tensors, peer, calls):
    import torch

    out = {}
    try:
        plain = Tensors(tensors)
        out["peer_bare_us"] = torch_graph_us(lambda: peer(plain), calls)
        torch._dynamo.reset()
        try:
            compiled = torch.compile(Layer(tensors, peer), fullgraph=True)
            compiled()
            out["peer_fullgraph"] = True
        except Exception as exc:  # noqa: BLE001 - report and fall back to graph breaks
            out["peer_fullgraph_error"] = one_line(exc)
            torch._dynamo.reset()
            compiled = torch.compile(Layer(tensors, peer))
            out["peer_fullgraph"] = False
        out["peer_compiled_us"] = torch_graph_us(compiled, calls)
    except Exception as exc:  # noqa: BLE001 - any failure means: no peer in this run
        out["peer_error"] = one_line(exc)
    return out


def _torch_line(r):
    line = (
        f"torch  {r['case']:32s} bare {r['bare_us']:7.2f}  compiled+graph "
        f"{r['compiled_us']:7.2f}  overhead {r['overhead_us']:+6.2f} "
        f"({'ok' if r['overhead_us'] <= TARGET_OVERHEAD_US else 'MISSED'} <= "
        f"{TARGET_OVERHEAD_US})  reduce-overhead {r['reduce_overhead_us']:7.2f}"
    )
    if "peer_compiled_us" in r:
        ratio = r["peer_ratio"]
        line += (
            f"\n       FlashInfer bare {r['peer_bare_us']:7.2f}  compiled+graph "
            f"{r['peer_compiled_us']:7.2f} (fullgraph={r['peer_fullgraph']})  "
            f"ratio {ratio:.2f} ({'ok' if ratio >= TARGET_PEER_RATIO else 'MISSED'} >= "
            f"{TARGET_PEER_RATIO})"
        )
    if "peer_fullgraph_error" in r:
        line += f"\n       FlashInfer under fullgraph=True: {r['peer_fullgraph_error']}"
    if "peer_error" in r:
        line += f"\n       FlashInfer not timed: {r['peer_error']}"
    return line.split("\n")


# ---- JAX -----------------------------------------------------------------------------------------


class XlaStreamTimer:
    """Spin kernels and events on XLA's compute stream, issued from tiny jitted buffer callbacks
    (XLA runs its executions in order on that stream)."""

    def __init__(self):
        import cupy
        import jax
        import jax.numpy as jnp
        from jax.experimental.buffer_callback import buffer_callback

        from ropekv._launch import cupy_stream, stream_ptr_of
        from ropekv._timing import _spin_kernel

        self.start, self.stop = cupy.cuda.Event(), cupy.cuda.Event()
        self.spin_ns = 0

        def on_stream(action):
            """A jitted call that runs ``action(stream)`` on XLA's stream. Its output (never
            written, no copy) is what the caller waits on."""

            def callback(ctx, out, x):
                stream = cupy_stream(stream_ptr_of(ctx.stream), cupy.cuda.Device().id)
                with stream:  # CuPy's current stream: XLA's, for the spin kernel
                    action(stream)

            return jax.jit(
                buffer_callback(
                    callback, jax.ShapeDtypeStruct((1,), jnp.float32), has_side_effect=True
                )
            )

        def spin(stream):
            _spin_kernel()((1,), (1,), (np.int64(self.spin_ns),))  # on `stream`, the current

        self.dummy = jnp.zeros(1)
        self._spin = on_stream(spin)
        self._start = on_stream(self.start.record)
        self._stop = on_stream(self.stop.record)

    def per_call_us(self, run, calls, replays=10):
        """Device time per call of ``calls`` back-to-back ``run()`` behind a spin kernel."""
        import cupy
        import jax

        for _ in range(3):
            jax.block_until_ready(run())
        t0 = time.perf_counter()
        for _ in range(calls):
            out = run()
        jax.block_until_ready(out)
        host_s = time.perf_counter() - t0
        self.spin_ns = int(min(max(3 * host_s, 1e-3), 0.5) * 1e9)
        times = []
        for _ in range(replays):
            self._spin(self.dummy)
            self._start(self.dummy)
            for _ in range(calls):
                out = run()
            jax.block_until_ready((out, self._stop(self.dummy)))
            self.stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(self.start, self.stop) * 1e3 / calls)
        return statistics.median(times), host_s / calls * 1e6


def jax_cases():
    """(name, host caches, arrays, step(caches, arrays..., command_buffer) -> (caches, q8),
    make_eager() -> the bare ropekv call on CuPy arrays)."""
    import jax.numpy as jnp
    import ml_dtypes

    import ropekv.jax as rj

    rng = np.random.default_rng(0)
    Hq, Hkv, D, B = LLAMA["Hq"], LLAMA["Hkv"], LLAMA["D"], 64
    per = -(-(PREFIX + 1) // PAGE)
    num_pages = B * per + 64
    ids = rng.permutation(num_pages)[: B * per].astype(np.int32)
    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    host = {
        "q": rng.standard_normal((B, Hq, D)).astype(np.float16),
        "k": rng.standard_normal((B, Hkv, D)).astype(np.float16),
        "v": rng.standard_normal((B, Hkv, D)).astype(np.float16),
        "table": ropekv.cos_sin_cache(PREFIX + 16, D),
        "pos": np.full(B, PREFIX, np.int32),
        "kv_indices": ids,
        "kv_indptr": (np.arange(B + 1) * per).astype(np.int32),
        "batch": np.arange(B, dtype=np.int32),
    }
    caches = tuple(np.zeros((num_pages, PAGE, Hkv, D), e4m3) for _ in range(2))

    def step(caches, q, k, v, table, pos, kv_indices, kv_indptr, batch, *, command_buffer):
        q8, _, caches = rj.rope_quantize_fp8_append_paged_kv_cache(
            q,
            k,
            None,
            None,
            v,
            table,
            pos,
            caches,
            kv_indices,
            kv_indptr,
            batch,
            pos,
            page_size=PAGE,
            command_buffer_compatible=command_buffer,
        )
        return caches, q8

    def make_eager():
        """The bare ropekv call on CuPy copies of the same inputs."""
        import cupy as cp

        dev = {n: cp.asarray(x) for n, x in host.items()}
        dev_caches = tuple(cp.zeros(c.shape, cp.uint8).view(e4m3) for c in caches)
        q_out = cp.empty((B, Hq, D), cp.uint8).view(e4m3)
        q_nope_out = cp.empty((B, Hq, 0), cp.uint8).view(e4m3)

        def eager():
            ropekv.rope_quantize_fp8_append_paged_kv_cache(
                dev["q"],
                dev["k"],
                None,
                None,
                dev["v"],
                dev["table"],
                dev["pos"],
                dev_caches,
                dev["kv_indices"],
                dev["kv_indptr"],
                dev["batch"],
                dev["pos"],
                page_size=PAGE,
                q_rope_out=q_out,
                q_nope_out=q_nope_out,
            )

        return eager

    arrays = {n: jnp.asarray(x) for n, x in host.items()}
    return [("paged gqa fp16->e4m3 64x1", caches, arrays, step, make_eager)]


def bench_jax(calls):
    try:
        import jax
    except Exception as exc:  # noqa: BLE001
        return [
            {"case": "all", "framework": "jax", "skipped": f"JAX not importable ({one_line(exc)})"}
        ]
    if jax.default_backend() != "gpu":
        return [
            {
                "case": "all",
                "framework": "jax",
                "skipped": f"JAX backend {jax.default_backend()}, not gpu",
            }
        ]
    from ropekv._timing import graph_us

    try:
        timer = XlaStreamTimer()
    except Exception as e:  # noqa: BLE001 - reported; the torch results stand
        return [{"case": "all", "framework": "jax", "error": f"stream timer: {one_line(e)}"}]
    results = []
    for name, host_caches, arrays, step, make_eager in jax_cases():
        r = {"case": name, "framework": "jax"}
        try:
            r["kernel_us"] = graph_us(make_eager(), calls=calls)
            args = [
                arrays[n]
                for n in ("q", "k", "v", "table", "pos", "kv_indices", "kv_indptr", "batch")
            ]
            for command_buffer in (False, True):
                tag = "_cmdbuf" if command_buffer else ""
                us, host_us, kept = _jax_steps(
                    timer, step, host_caches, args, command_buffer, calls
                )
                r[f"step_us{tag}"], r[f"host_us{tag}"] = us, host_us
                r[f"address_kept{tag}"] = kept
            r["scan_us_per_step"] = _jax_scan(timer, step, host_caches, args, calls)
        except Exception as e:  # noqa: BLE001 - one broken case must not end the run
            r["error"] = one_line(e)
        results.append(r)
    return results


def _jax_steps(timer, step, host_caches, args, command_buffer, calls):
    """(device us per step, host us per step, cache address kept) of back-to-back jitted steps
    with the cache donated."""
    import jax
    import jax.numpy as jnp

    def one(caches, *a):
        return step(caches, *a, command_buffer=command_buffer)

    jstep = jax.jit(one, donate_argnums=0)
    state = {"caches": tuple(jnp.asarray(c) for c in host_caches)}
    state["caches"], _ = jstep(state["caches"], *args)
    jax.block_until_ready(state["caches"])
    pointers = [c.unsafe_buffer_pointer() for c in state["caches"]]

    def run():
        state["caches"], q8 = jstep(state["caches"], *args)
        return q8

    us, host_us = timer.per_call_us(run, calls)
    return us, host_us, [c.unsafe_buffer_pointer() for c in state["caches"]] == pointers


def _jax_scan(timer, step, host_caches, args, calls):
    """Device us per step of a jax.lax.scan over ``calls`` steps in one jitted call."""
    import jax
    import jax.numpy as jnp

    def scan_all(caches, *a):
        def body(carry, _):
            return step(carry, *a, command_buffer=False)

        return jax.lax.scan(body, caches, None, length=calls)

    jscan = jax.jit(scan_all, donate_argnums=0)
    state = {"caches": tuple(jnp.asarray(c) for c in host_caches)}

    def run():
        state["caches"], q8s = jscan(state["caches"], *args)
        return q8s

    us, _ = timer.per_call_us(run, 1)
    return us / calls


def _jax_line(r):
    target = r["kernel_us"] + TARGET_JAX_US
    line = f"jax    {r['case']:32s} kernel {r['kernel_us']:7.2f}"
    for tag, label in (("", "step"), ("_cmdbuf", "step (command buffer)")):
        us = r[f"step_us{tag}"]
        line += (
            f"\n       {label:22s} {us:7.2f} ({'ok' if us <= target else 'MISSED'} <= "
            f"{target:.2f})  host {r[f'host_us{tag}']:7.2f}  cache address kept: "
            f"{r[f'address_kept{tag}']}"
        )
    line += f"\n       scan, per step         {r['scan_us_per_step']:7.2f}"
    return line.split("\n")


def run(calls=64, only=None):
    """Every framework case (``only``: "torch" or "jax"): a list of result dicts, one per case
    (``error`` or ``skipped`` where it did not run)."""
    results = []
    if only in (None, "torch"):
        results += bench_torch(calls)
    if only in (None, "jax"):
        results += bench_jax(calls)
    return results


def describe(r):
    """The printed lines of one result."""
    head = f"{r['framework']:6s} {r['case']:32s}"
    if "skipped" in r:
        return [f"{head} skipped: {r['skipped']}"]
    if "error" in r:
        return [f"{head} error: {r['error']}"]
    return _torch_line(r) if r["framework"] == "torch" else _jax_line(r)
