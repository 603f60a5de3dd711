"""The run: the copy bandwidth, then every selected case (each peer checked against ropekv, then
timed), written to JSON after every case; the environment record; ``main`` of ``ropekv bench``."""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ropekv.bench import report as report_mod
from ropekv.bench import timing, tuning
from ropekv.bench.arrays import _torch, gpu_status, one_line
from ropekv.bench.cases import select_specs
from ropekv.bench.compare import compare_all
from ropekv.bench.peers import PEERS, UNCHECKED, is_variant, make_runners, peer_availability
from ropekv.bench.timing import eager_host_times, host_time, time_runner, torch_host_us
from ropekv.bench.workloads import OPS, op_available

_START = [None]


def progress(i, n, text):
    """A one-line progress bar on stderr (with the seconds since the first call)."""
    if i == 0 or _START[0] is None:
        _START[0] = time.perf_counter()
    width = 24
    done = int(width * i / max(n, 1))
    line = (
        f"[{'#' * done}{'.' * (width - done)}] {i}/{n} "
        f"{time.perf_counter() - _START[0]:6.1f} s  {text}"
    )
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line[:150] + ("\n" if i >= n else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return None


def environment():
    """GPU, driver and library versions, and the git revision when there is one."""
    env = {
        "python": platform.python_version(),
        "ropekv": _version("ropekv"),
        "numpy": np.__version__,
        "cupy": _version("cupy"),
        "torch": _version("torch"),
        "flashinfer": _version("flashinfer"),
    }
    try:
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["sm"] = f"{props['major']}{props['minor']}"
        env["sms"] = props["multiProcessorCount"]
        env["l2_bytes"] = props["l2CacheSize"]
        d, r = rt.driverGetVersion(), rt.runtimeGetVersion()
        env["cuda_driver_api"] = f"{d // 1000}.{d % 1000 // 10}"
        env["cuda_runtime"] = f"{r // 1000}.{r % 1000 // 10}"
    except Exception as e:  # noqa: BLE001
        env["gpu_error"] = one_line(e)
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if out.returncode == 0:
            env["driver"] = out.stdout.strip().splitlines()[0]
    env["host_cpus"] = host_cpus()
    env["git_revision"] = git_revision()
    env["source_digest"] = source_digest()
    return env


def cpu_ranges(cpus):
    """CPU numbers as ranges: {0, 1, 2, 3, 8} -> '0-3,8'."""
    out = []
    # consecutive numbers share their offset from their index in the sorted list
    for _, run in itertools.groupby(enumerate(sorted(cpus)), lambda ic: ic[1] - ic[0]):
        first, *rest = (c for _, c in run)
        out.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ",".join(out)


def host_cpus():
    """The CPUs the process may run on, against the machine's: '2 of 16' for a process pinned
    with ``taskset -c 2``, '0-15 of 16' for one that is not. Host times per call move with
    the scheduler's placement of the process (``docs/performance.md``), so a run says which it
    had; None where the platform does not tell."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    return f"{cpu_ranges(cpus)} of {os.cpu_count()}"


def source_digest(root=None):
    """A digest of the code that ran: SHA-256 (12 hex digits) over the relative paths and bytes
    of ropekv's sources (``.py``, ``.c``, ``.cu``, ``.cuh`` under the package), whatever git
    state the copy carries. The same digest from a checkout of a commit
    (``python -c "import ropekv.bench as b; print(b.source_digest())"``) proves that commit ran."""
    import hashlib

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ropekv/
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".py", ".c", ".cu", ".cuh")):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                with open(path, "rb") as f:
                    data = f.read()
                h.update(f"{rel}\0{len(data)}\0".encode())
                h.update(data)
    return h.hexdigest()[:12]


def git_revision():
    """``$ROPEKV_GIT_REVISION`` when set (a copy of the tree on a remote GPU machine may carry a
    stale ``.git``), else ``git rev-parse`` of the checkout ropekv runs from."""
    return os.environ.get("ROPEKV_GIT_REVISION") or _git_revision()


def _git_revision():
    try:
        out = _git("rev-parse", "--short=12", "HEAD")
        if out.returncode != 0:
            return None
        dirty = _git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return None


def _git(*args):
    """``git <args>`` in the checkout ropekv runs from (its completed process)."""
    here = os.path.dirname(os.path.abspath(__file__))  # ropekv/bench, inside the checkout
    return subprocess.run(
        ["git", "-C", here, *args], capture_output=True, text=True, timeout=10, check=False
    )


def _settings(quick):
    if quick:
        return {"reps": 10, "graph_calls": 20, "host_calls": 50, "budget_s": 0.1}
    return {"reps": 100, "graph_calls": 100, "host_calls": 500, "budget_s": 0.5}


def run(
    ops=None,
    peers=None,
    quick=False,
    log=progress,
    json_path=None,
    names=None,
    specs=None,
    backend="cuda",
    frameworks=False,
    tune=(),
    options=False,
):
    """Run the benchmark; return the result dict (what ``--json`` writes; with ``json_path`` it is
    also written there after every case, so an interrupted run keeps what it measured).

    ``names``: only the cases whose name contains one of these strings; ``specs``: these cases
    instead of the registry's; ``frameworks``: also time the ops inside compiled programs
    (:mod:`ropekv.bench.frameworks`); ``tune``: ``(label, changes)`` launch-shape variants
    (:mod:`ropekv.bench.tuning`), each timed as a runner beside ropekv's default; ``options``:
    also each case with each option of its op on (``ropekv[+option]`` runners).
    ``backend="numpy"`` builds the workloads with NumPy and times host calls (the CPU tests of
    the runner; no copy bandwidth, no CUDA peers)."""
    t0 = time.perf_counter()
    explicit_peers = peers is not None
    if peers is None:
        peers = ("torch", "cublas", "steps") if quick else PEERS
    settings = _settings(quick)
    if specs is None:
        specs = select_specs(ops, quick, names)
    result = _header(ops, peers, explicit_peers, quick, settings, backend, tune, options)
    n = len(specs) + 1 + bool(frameworks)
    log(0, n, "copy bandwidth (1 GiB device-to-device)")
    result["copy_bytes"] = 2 << 30
    result["copy_bandwidth"] = _copy_bandwidth(backend, quick)
    flusher = _flusher(backend)
    cases = []
    lost = None  # the case after which the CUDA context was unusable
    for i, spec in enumerate(specs):
        log(i + 1, n, spec.name)
        if lost:
            cases.append(
                {
                    "op": spec.op,
                    "name": spec.name,
                    "tokens": spec.tokens,
                    "bytes": spec.nbytes,
                    "decode": spec.decode,
                    "peers": {},
                    "error": f"not run: the CUDA context was lost in '{lost}'",
                }
            )
            continue
        cases.append(
            run_case(
                spec, peers, settings, flusher, result["copy_bandwidth"], backend, tune, options
            )
        )
        if context_lost(cases[-1]):
            lost = spec.name
        if not lost:
            for lag in range(HOST_LAG, HOST_ROUNDS * HOST_LAG, HOST_LAG):
                if i >= lag:
                    remeasure_host(specs[i - lag], cases[i - lag], settings, backend)
        if json_path:
            report_mod.write_json(
                dict(result, cases=cases, wall_s=time.perf_counter() - t0, partial=True), json_path
            )
        _free(backend)
    if not lost:  # the rounds the lagged re-measurements above did not reach
        for _ in range(HOST_ROUNDS - 1):
            for spec, case in zip(specs, cases):
                if host_rounds_done(case) < HOST_ROUNDS:
                    remeasure_host(spec, case, settings, backend)
        if backend == "cuda":  # the recorded first-call figures (first_call_phase)
            log(len(specs), n, f"first calls: {timing.FIRST_ROUNDS} rounds over the decode cases")
            first_call_phase(specs, cases, free=lambda: _free(backend))
    result["cases"] = cases
    result["peer_builds"] = peer_builds(cases)
    if backend == "cuda":  # known once a call has planned: host times depend on it
        from ropekv import _native

        result["environment"]["plan_replay"] = _native.state()
    if frameworks and not lost:
        from ropekv.bench import frameworks as fw

        log(n - 1, n, "frameworks: torch.compile, CUDA graphs, jax.jit")
        try:
            result["frameworks"] = fw.run(calls=20 if quick else 64)
        except Exception as e:  # noqa: BLE001 - the cases measured so far stand
            result["frameworks"] = [{"case": "all", "framework": "?", "error": one_line(e)}]
    log(n, n, "done")
    result["wall_s"] = time.perf_counter() - t0
    return result


def _header(ops, peers, explicit_peers, quick, settings, backend, tune, options):
    """The result dict's entries before the copy bandwidth and the cases: the command, the
    settings, the environment, and what each op and peer is (used, missing, not selected)."""
    result: dict[str, Any] = {
        "command": " ".join(["ropekv", "bench", *sys.argv[2:]]),
        "quick": quick,
        "peers": list(peers),
        "settings": settings,
    }
    if backend != "cuda":
        result["backend"] = backend
    if tune:
        result["tune"] = {label: changes for label, changes in tune}
    if options:
        result["options"] = True
    result["environment"] = (
        environment() if backend == "cuda" else {"python": platform.python_version()}
    )
    result["missing_ops"] = [op for op in (ops or OPS) if not op_available(op)]
    avail = peer_availability(backend)
    result["peer_status"] = {
        p: ("used" if p in peers and not avail.get(p) else avail.get(p) or "not selected")
        for p in PEERS
    }
    if quick and not explicit_peers:
        for p in ("flashinfer", "torch-compile"):
            result["peer_status"][p] = "not selected (--quick; name it in --peers to include)"
    return result


def _copy_bandwidth(backend, quick):
    """Read + write bytes per second of a 1 GiB device-to-device copy (64 MiB host copy on the
    NumPy backend)."""
    if backend == "numpy":
        src = np.ones(64 << 20, np.uint8)
        dst = np.empty_like(src)
        t = time.perf_counter()
        np.copyto(dst, src)
        return 2 * src.nbytes / max(time.perf_counter() - t, 1e-9)
    from ropekv import _timing

    return _timing.copy_bandwidth(1 << 30, reps=5 if quick else 20)


def _flusher(backend):
    if backend == "numpy":
        return None
    from ropekv import _timing

    return _timing.L2ReadFlusher()


def _free(backend):
    if backend == "numpy":
        return
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if peer_availability().get("torch") is None:
        _torch().cuda.empty_cache()


STICKY_ERRORS = (
    "IllegalAddress",
    "ILLEGAL_ADDRESS",
    "LaunchFailure",
    "LAUNCH_FAILED",
    "IllegalInstruction",
    "ILLEGAL_INSTRUCTION",
    "MisalignedAddress",
    "MISALIGNED_ADDRESS",
    "illegal memory access",
)


def context_lost(case_or_message):
    """Whether an error left the CUDA context unusable (a sticky error: every later call in this
    process fails with it, so later cases cannot run)."""
    if isinstance(case_or_message, str):
        texts = [case_or_message]
    else:
        texts = [case_or_message.get("error", "")]
        texts += [e.get("status", "") for e in case_or_message.get("peers", {}).values()]
    return any(k in t for t in texts for k in STICKY_ERRORS)


# A decode case's host times are the median of HOST_ROUNDS measurements: one in its case, the
# others HOST_LAG and 2 * HOST_LAG cases later (cases near the end: in passes after the last
# case). This host's timings drift for tens of seconds at a time (up to 1.5x, peers included);
# measurements a minute apart keep one such phase from setting a case's figure.
HOST_ROUNDS = 3
HOST_LAG = 40


HOST_KEYS = ("host_us", "first_us", "host_us_torch", "first_us_torch")


def remeasure_host(spec, case, settings, backend="cuda"):
    """One more measurement of ropekv's host times of a decode ``case`` (per call and first call,
    CuPy arrays and torch tensors, on a new workload of ``spec``), added to its ``host_rounds``;
    each of ``host_us``, ``first_us``, ``host_us_torch``, ``first_us_torch`` becomes the median of
    its rounds."""
    r = case.get("ropekv")
    if not spec.decode or r is None or "error" in case or "host_rounds" not in r:
        return
    try:
        w = spec.make(np) if backend == "numpy" else spec.make()
        runner, _ = make_runners(w, spec, (), backend)
        runner.call()
        if backend == "numpy":
            got = {"host_us": host_time(runner.call, spec, settings)["host_us"]}
        else:  # what run_case measured: time_runner's host times, then torch_host_us's
            got = {**eager_host_times(runner, settings), **torch_host_us(w, settings["host_calls"])}
    except Exception as e:  # noqa: BLE001 - the rounds so far stand
        r["host_rounds_error"] = one_line(e)
        got = {}
    for key, rounds in r["host_rounds"].items():
        rounds.append(got.get(key))  # None: not measured this round (counted, not retried)
        kept = [x for x in rounds if x is not None]
        if kept:
            r[key] = statistics.median(kept)


# the device bytes of workloads the first-call phase holds at once: the decode cases' workloads
# (about 39 GB of arrays in all, plus their outputs) are built and timed in groups below it
FIRST_PHASE_BYTES = 24 << 30


def _nbytes(arrays):
    return sum(getattr(x, "nbytes", 0) for x in arrays)


def _first_calls(spec, case):
    """``([(key, call)], nbytes)`` of a decode case for :func:`first_call_phase`: ropekv's call
    with its arguments built once on a new workload of ``spec`` and new outputs, as the case
    timed it (``first_us``), and with torch tensors viewing them (``first_us_torch``, where the
    case measured it), each called once; ``nbytes``: the workload's and outputs' bytes."""
    w = spec.make()
    r, _ = make_runners(w, spec, ())
    r.call()
    calls = [("first_us", r.host_call)]
    outputs = _nbytes(w.a[n] for n in w.outputs_names)  # each new_outputs() copies them
    nbytes = _nbytes(w.a.values()) + outputs
    if "first_us_torch" in case["ropekv"]:
        tw, to = timing.torch_workload(w, w.new_outputs())
        fn = tw.bound(to)
        fn()
        calls.append(("first_us_torch", fn))
        nbytes += outputs
    return calls, nbytes


def first_call_phase(
    specs, cases, rounds=timing.FIRST_ROUNDS, settle=timing.FIRST_SETTLE, sync=None, free=None
):
    """The recorded first-call figures of the decode cases, taken once every case has run:
    ``first_us`` / ``first_us_torch`` become the median over ``rounds`` rounds of
    :func:`ropekv.bench.timing.first_call_rounds` (every case of a group once per round, every
    op's plans cleared before each call; its docstring says why), with ``first_us_spread`` /
    ``first_us_torch_spread`` = ``[min, max]`` beside them and the rounds in ``first_rounds``.
    The first calls each case took as it ran stay in its ``host_rounds`` (how far the host's
    drift moved them). The cases are taken in groups whose workloads fit FIRST_PHASE_BYTES,
    ``free()`` called after each (default: none). A case whose calls cannot be built or run
    keeps its figures from ``host_rounds``, with ``first_rounds_error``. ``sync``: the device's
    synchronisation (default CuPy's)."""
    if sync is None:
        import cupy

        sync = cupy.cuda.runtime.deviceSynchronize
    entries, held = [], 0
    for i, (spec, case) in enumerate(zip(specs, cases)):
        r = case.get("ropekv")
        if not spec.decode or r is None or "error" in case or "first_us" not in r:
            continue
        try:
            calls, nbytes = _first_calls(spec, case)
        except Exception as e:  # noqa: BLE001 - the figures from host_rounds stand
            r["first_rounds_error"] = one_line(e)
            continue
        entries += [((i, key), fn) for key, fn in calls]
        held += nbytes
        if held >= FIRST_PHASE_BYTES:
            _first_rounds(entries, cases, sync, rounds, settle, free)
            entries, held = [], 0
    if entries:
        _first_rounds(entries, cases, sync, rounds, settle, free)


def _first_rounds(entries, cases, sync, rounds, settle, free):
    """One group of :func:`first_call_phase`: its rounds, then its figures into ``cases``."""
    try:
        times = timing.first_call_rounds(entries, sync, rounds, settle)
    except Exception as e:  # noqa: BLE001 - the figures from host_rounds stand
        for (i, _), _fn in entries:
            cases[i]["ropekv"]["first_rounds_error"] = one_line(e)
        times = {}
    entries.clear()  # the group's workloads freed
    if free is not None:
        free()
    for (i, key), us in times.items():
        r = cases[i]["ropekv"]
        r[key] = statistics.median(us)
        r[f"{key}_spread"] = [min(us), max(us)]
        r.setdefault("first_rounds", {})[key] = us


def host_rounds_done(case):
    """How many host-time rounds a case has (HOST_ROUNDS for a case without host times)."""
    rounds = case.get("ropekv", {}).get("host_rounds")
    return len(rounds["host_us"]) if rounds else HOST_ROUNDS


# A peer's checked first call of a case past this many seconds compiled something in the bench's
# own process. FlashInfer JIT-builds its rope, page and Cake modules on first use: on the H200 the
# cases where it did took 9-51 s, while with its modules cached no whole case (ropekv and every
# peer checked and timed) took more than 4.3 s.
PEER_BUILD_S = 3.0


def peer_builds(cases):
    """``{peer: [seconds, cases]}``: the peers whose checked first call of a case took more than
    PEER_BUILD_S, with those calls' seconds summed and counted (``first_s`` of each peer entry;
    ropekv's own ``--tune`` / ``--options`` runners, which compile ropekv's kernels, are not
    peers).

    Why a run says so: its host figures are suspect. On the H200 (52b2e17), a run that built
    every FlashInfer module inside it read first calls 1.8-2.0x (by op) those of a run of the same
    code on another machine of that kind whose modules another process had built; device times
    matched. (Two machines, so not proof of the cause; the one earlier run that built its
    modules inside it also read first calls past the 150 us budget.) A recorded run is taken once
    the modules are cached."""
    builds: dict[str, list] = {}
    for c in cases:
        for name, entry in c.get("peers", {}).items():
            if is_variant(name):  # --tune / --options runners: ropekv's own NVRTC builds
                continue
            s = entry.get("first_s", 0.0) if isinstance(entry, dict) else 0.0
            if s > PEER_BUILD_S:
                total = builds.setdefault(name, [0.0, 0])
                total[0] += s
                total[1] += 1
    return builds


def run_case(spec, peers, settings, flusher, copy_bw, backend="cuda", tune=(), options=False):
    case = {
        "op": spec.op,
        "name": spec.name,
        "tokens": spec.tokens,
        "bytes": spec.nbytes,
        "decode": spec.decode,
        "series": spec.series,
        "flops": spec.flops,
        "peers": {},
    }
    if spec.weight_bytes:
        case["weight_bytes"], case["weight_format"] = spec.weight_bytes, spec.weight_format
    t = time.perf_counter()
    try:
        w = spec.make(np) if backend == "numpy" else spec.make()
        ropekv, others = make_runners(w, spec, peers, backend, tune, options)
        ropekv.reset()
        ropekv.call()
        expected = ropekv.outputs()
        case["ropekv"] = time_runner(ropekv, spec, settings, flusher)
    except Exception as e:  # noqa: BLE001 - one broken case must not end the run
        case["error"] = one_line(e)
        case["seconds"] = time.perf_counter() - t
        return case
    if spec.decode and backend == "cuda":
        case["ropekv"].update(torch_host_us(w, settings["host_calls"]))
    if spec.decode and "host_us" in case["ropekv"]:
        r = case["ropekv"]
        r["host_rounds"] = {k: [r[k]] for k in HOST_KEYS if k in r}
    us = case["ropekv"]["us"]
    case["ropekv"]["gbps"] = spec.nbytes / (us * 1e-6) / 1e9
    case["ropekv"]["pct_copy"] = 100 * spec.nbytes / (us * 1e-6) / copy_bw
    if spec.flops:
        case["ropekv"]["tflops"] = spec.flops / (us * 1e-6) / 1e12
    if spec.weight_bytes:
        case["ropekv"]["pct_copy_weights"] = 100 * spec.weight_bytes / (us * 1e-6) / copy_bw
    for name, r in others.items():
        entry: dict[str, Any] = {}
        case["peers"][name] = entry
        if isinstance(r, str):
            entry["status"] = r
            continue
        with r.context() if r.context else contextlib.nullcontext():
            _check_and_time(name, r, entry, w, spec, settings, flusher, expected, us)
    case["seconds"] = time.perf_counter() - t
    return case


def _check_and_time(name, r, entry, w, spec, settings, flusher, expected, us):
    """One peer: called once and compared with ropekv's ``expected`` outputs, then timed."""
    try:
        if r.reset:
            r.reset()
        t = time.perf_counter()
        r.call()  # a peer that compiles on first use compiles here (peer_builds)
        entry["first_s"] = time.perf_counter() - t
        want = r.expect(expected) if r.expect else expected
        mismatch = None if want is UNCHECKED else compare_all(r.outputs(), want, w.compare_mode)
    except Exception as e:  # noqa: BLE001
        what = "skipped: compile failed" if name == "torch-compile" else "error"
        entry["status"] = f"{what}: {one_line(e)}"
        return
    entry["check"] = (
        UNCHECKED if want is UNCHECKED else "ok" if mismatch is None else f"MISMATCH: {mismatch}"
    )
    try:
        entry.update(time_runner(r, spec, settings, flusher))
        entry["ratio"] = entry["us"] / us
        entry["status"] = "ok" if mismatch is None else "mismatch"
    except Exception as e:  # noqa: BLE001
        entry["status"] = f"error: {one_line(e)}"


def main(
    ops=None,
    peers=None,
    quick=False,
    json_path=None,
    plot_path=None,
    cases=None,
    frameworks=False,
    tune=None,
    options=False,
):
    """``ropekv bench``: returns the exit code. ``tune``: variant texts (``op.key=value,...``);
    ``options``: time each case's op options too."""
    ok, device = gpu_status()
    if not ok:
        print(f"ropekv bench: {device}; the benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    if plot_path:  # fail before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "ropekv bench: --plot needs matplotlib: pip install 'ropekv[plot]'", file=sys.stderr
            )
            return 1
    try:
        variants = [(text, tuning.parse(text)) for text in tune or ()]
        for _, changes in variants:
            tuning.validate(changes)
    except ValueError as e:
        print(f"ropekv bench: --tune: {e}", file=sys.stderr)
        return 1
    if frameworks and ops is None and not cases:
        ops = []  # --frameworks alone: only the framework cases
    if variants and ops is None:
        ops = list(dict.fromkeys(op for _, changes in variants for op in changes))
    result = run(
        ops,
        peers,
        quick,
        json_path=json_path,
        names=cases,
        frameworks=frameworks,
        tune=variants,
        options=options,
    )
    if not result["cases"] and not result.get("frameworks"):
        why = (
            f"ops missing from this ropekv: {', '.join(result['missing_ops'])}"
            if result["missing_ops"]
            else "no case matches --ops / --cases"
        )
        print(f"ropekv bench: no case to run ({why})", file=sys.stderr)
        return 1
    if json_path:
        report_mod.write_json(result, json_path)
    if plot_path and result["cases"]:
        report_mod.plot(result, plot_path)
    print(report_mod.text(result))
    if json_path:
        print(f"wrote {json_path}")
    if plot_path and result["cases"]:
        print(f"wrote {plot_path}")
    if result.get("peer_builds"):
        built = ", ".join(
            f"{p} {s:.0f} s in {n} cases" for p, (s, n) in result["peer_builds"].items()
        )
        print(
            f"ropekv bench: peers compiled inside this run ({built}); host figures taken after "
            "in-process builds read slower (runner.peer_builds): for recorded host figures, run "
            "it again now that their modules are cached",
            file=sys.stderr,
        )
    errors = [c for c in result["cases"] if "error" in c]
    errors += [f for f in result.get("frameworks", []) if "error" in f]
    return 1 if errors else 0
