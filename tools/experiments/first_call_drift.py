"""Host time of a first call of a layout (kernels compiled, every op's plans cleared before each
call) at four points of one process: right after start-up, after importing torch, JAX and
FlashInfer, with every bench decode workload alive, and with the garbage collector off, after a
collection, frozen, and at two thresholds. Each figure: median of 15 first calls
(``ropekv.bench.timing.first_call_us``). On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/first_call_drift.py

H200 host at 38fa86f, two runs on fresh machines: paged GQA fp16 -> e4m3 one token 202.5 / 112.1
us after start-up, 128.3 / 177.1 after the imports, 91-104 at every later point (paged with dynamic
q and kv scales 221 / 123, 167 / 130, then 98-112; QK-norm Qwen3-32B 8 / 1 heads one token 181 /
95, 133 / 168, then 82-95; qk_rope 93 / 54, 70 / 89, then 47-52). The collector's state changed
nothing. So a single first-call figure on that host says more about the host's state at that
moment than about ropekv: read the budget from medians over several rounds (``ropekv bench``
now records the median of 7 rounds over every decode case, taken after all cases have run,
``ropekv.bench.timing.first_call_rounds``; ``first_call_c.py`` times the C helpers the same way).
"""

import gc

import cupy

from ropekv.bench import cases, timing

CASES = (
    "paged gqa fp16->e4m3 1x1",
    "paged gqa fp16->e4m3 64x1 dynamic q kv scales",
    "qknorm qwen3-32b tp 8/1 bf16->bf16 1x1",
    "qk_rope llama 32/8/128 fp16 1",
)


def main():
    sync = cupy.cuda.runtime.deviceSynchronize
    specs = {s.name: s for s in cases.bench_specs()}
    calls = {}
    for name in CASES:
        w = specs[name].make()
        call = w.bound({k: w.a[k] for k in w.outputs_names})
        call()  # compiles the kernels: what follows times planning, not NVRTC
        sync()
        calls[name] = call

    def measure(label):
        times = {n: round(timing.first_call_us(c, sync, 15), 1) for n, c in calls.items()}
        print(f"{label:34s}", times, "objects", len(gc.get_objects()), flush=True)

    measure("after start-up")
    import flashinfer  # noqa: F401
    import jax  # noqa: F401
    import torch  # noqa: F401

    measure("torch, JAX, FlashInfer imported")
    alive = [s.make() for s in cases.bench_specs() if s.decode]
    sync()
    measure(f"{len(alive)} decode workloads alive")
    gc.disable()
    measure("collector off")
    gc.enable()
    gc.collect()
    measure("after gc.collect()")
    gc.freeze()
    measure("after gc.freeze()")
    gc.unfreeze()
    for threshold in ((700, 10, 10), (10000, 10, 10)):
        gc.set_threshold(*threshold)
        measure(f"threshold {threshold}")


if __name__ == "__main__":
    main()
