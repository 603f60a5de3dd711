"""Output of a run: the table printed after it, the JSON record, and the plot (time against
tokens per op, and ropekv's speedup over the best peer per case)."""

from __future__ import annotations

import json
import statistics

from ropekv.bench.peers import is_variant
from ropekv.bench.workloads import OPS


def format_table(header, rows):
    """A GitHub-markdown table with padded columns."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join(
        [fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [fmt(r) for r in cells[1:]]
    )


def _fmt_us(us):
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def table_rows(result):
    """(header, rows, notes) of the result table."""
    peer_names = []
    for c in result["cases"]:
        for p in c.get("peers", {}):
            if p not in peer_names:
                peer_names.append(p)
    header = ["case", "ropekv us", "host us", "MB", "GB/s", "% copy", *peer_names]
    rows, notes = [], []
    for c in result["cases"]:
        mb = f"{c['bytes'] / 1e6:.1f}"
        if "error" in c:
            rows.append([c["name"], "error", "", mb, "", "", *["" for _ in peer_names]])
            notes.append(f"{c['name']}: {c['error']}")
            continue
        r = c["ropekv"]
        graph = "graph_us" in r
        name = c["name"] + (" [graph]" if graph else "")
        row = [
            name,
            _fmt_us(r["us"]),
            _fmt_us(r["host_us"]) if "host_us" in r else "",
            mb,
            f"{r['gbps']:.0f}",
            f"{r['pct_copy']:.0f}",
        ]
        if c.get("flops") and not c.get("decode"):
            row[4] += f" ({r['tflops']:.0f} TFLOP/s)"
        if "pct_copy_weights" in r:
            row[5] += f" (w {r['pct_copy_weights']:.0f})"
        for p in peer_names:
            e = c["peers"].get(p)
            if e is None:
                row.append("")
                continue
            status = e.get("status", "")
            if "us" in e:
                cell = f"{_fmt_us(e['us'])} ({e['ratio']:.2f}x)"
                if c.get("decode") and "graph_us" not in e and "graph_us" in r:
                    cell += " ev"
                    notes.append(
                        f"{p}: 'ev' = event-timed, not capturable in a CUDA graph "
                        f"({e.get('graph_error', '')})"
                    )
                if "host_us" in e:
                    cell += f" h{_fmt_us(e['host_us'])}"
                if status == "mismatch":
                    cell = "MISMATCH " + cell
                    notes.append(f"{c['name']} / {p}: {e['check']}")
                row.append(cell)
            elif status == "-":
                row.append("-")
            elif status.startswith("skipped"):
                row.append("skip")
                notes.append(f"{p}: {status}")
            else:
                row.append("error")
                notes.append(f"{c['name']} / {p}: {status}")
        rows.append(row)
    seen, unique = set(), []
    for n in notes:
        if n not in seen:
            seen.add(n)
            unique.append(n)
    return header, rows, unique


def text(result):
    """The text printed after a run."""
    env = result.get("environment", {})
    lines = [
        (
            f"ropekv bench on {env.get('gpu', '?')} (driver {env.get('driver', '?')}, CUDA "
            f"runtime {env.get('cuda_runtime', '?')}, CuPy {env.get('cupy')}, torch "
            f"{env.get('torch')}, FlashInfer {env.get('flashinfer')}, ropekv "
            f"{env.get('ropekv')} @ {env.get('git_revision') or 'unknown revision'}, sources "
            f"{env.get('source_digest') or '?'})"
        ),
        (
            f"copy bandwidth: {result['copy_bandwidth'] / 1e12:.2f} TB/s (1 GiB "
            f"device-to-device, read + write bytes)"
        ),
    ]
    if "plan_replay" in env:
        lines.append(f"plan replay: {env['plan_replay']}")
    if env.get("host_cpus"):
        lines.append(f"host CPUs the process may run on: {env['host_cpus']}")
    lines.append("")
    header, rows, notes = table_rows(result)
    lines.append(format_table(header, rows))
    lines += [
        "",
        (
            "Times in us per call (median). [graph]: per-call time under CUDA-graph "
            "replay; 'host us' and 'hN': host time per eager call, back to back. Ratio: "
            "peer / ropekv (above 1: ropekv is faster). MB: minimal bytes (each input read "
            "once, each output written once); GB/s and % copy: those bytes over ropekv's "
            "time, against the copy bandwidth. '-': the peer has no such operation "
            "(torch-compile runs on the headline cases only, to bound compile time; steps "
            "= a CuPy RMSNorm kernel + ropekv's paged op, for the MLA op). '(w N)' after "
            "% copy: the weight bytes alone over ropekv's time, against the copy "
            "bandwidth (QKV projection)."
        ),
    ]
    for p, s in result.get("peer_status", {}).items():
        if s != "used":
            lines.append(f"peer {p}: {s}")
    if result.get("missing_ops"):
        lines.append(f"ops not in this ropekv (no cases): {', '.join(result['missing_ops'])}")
    lines += [f"note: {n}" for n in notes]
    best = speedups(result)
    if best:
        ratios = [s for _, _, s in best]
        lines.append(
            f"speedup over the best peer: {min(ratios):.2f}x to {max(ratios):.2f}x over "
            f"{len(ratios)} cases, {sum(s >= 1 for s in ratios)} at or above 1"
        )
    lines += options_lines(result)
    lines += host_lines(result)
    lines += qkv_lines(result)
    lines += frameworks_lines(result.get("frameworks", []))
    lines.append(f"total wall time: {result['wall_s']:.1f} s")
    return "\n".join(lines)


HOST_FIGURES = (  # (key, label) of a decode case's host times, as host_lines reports them
    ("host_us", "per call, CuPy"),
    ("host_us_torch", "per call, torch"),
    ("first_us", "first call, CuPy"),
    ("first_us_torch", "first call, torch"),
)


def host_lines(result):
    """Per op, ropekv's host times over its decode cases: median and range of each figure
    (a case's figure is the median of its rounds spread over the run)."""
    by_op: dict[str, dict[str, list]] = {}
    for c in result["cases"]:
        r = c.get("ropekv", {})
        for key, _ in HOST_FIGURES:
            if c.get("decode") and key in r:
                by_op.setdefault(c["op"], {}).setdefault(key, []).append(r[key])
    if not by_op:
        return []
    lines = ["", "ropekv host time over each op's decode cases, us: median (min-max)"]
    for op, figures in by_op.items():
        cells = [
            f"{label} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
            for key, label in HOST_FIGURES
            if (v := figures.get(key))
        ]
        lines.append(f"  {op}: " + "; ".join(cells))
    return lines


def write_json(result, path):
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")


def speedups(result):
    """[(case name, best peer, peer us / ropekv us)] of every case with a peer whose output
    matched ropekv's: the fastest such peer (ratio above 1: ropekv is faster). ``--tune``
    variants of ropekv itself are not peers."""
    out = []
    for c in result["cases"]:
        if "ropekv" not in c:
            continue
        timed = {
            p: e["us"]
            for p, e in c.get("peers", {}).items()
            if e.get("status") == "ok" and "us" in e and not is_variant(p)
        }
        if timed:
            peer = min(timed, key=timed.get)
            out.append((c["name"], peer, timed[peer] / c["ropekv"]["us"]))
    return out


def option_costs(result):
    """{option label: [(case name, time with it on / the plain call's)]} of a ``--options`` run
    (the ``ropekv[+label]`` runners that ran)."""
    out = {}
    for c in result["cases"]:
        for p, e in c.get("peers", {}).items():
            if p.startswith("ropekv[+") and "ratio" in e and e.get("status") == "ok":
                out.setdefault(p[len("ropekv[+") : -1], []).append((c["name"], e["ratio"]))
    return out


def options_lines(result):
    """One line per option: its cost when on (ratio to the plain call on the same case), the
    range over the cases and how many stay within 10%."""
    costs = option_costs(result)
    if not costs:
        return []
    lines = [
        "",
        "Options on (ropekv[+option] time / the plain call's, same case; the goal: within 1.10x):",
    ]
    for label, rows in costs.items():
        ratios = [r for _, r in rows]
        worst = max(rows, key=lambda x: x[1])
        lines.append(
            f"  {label:16s} {min(ratios):.2f}x to {max(ratios):.2f}x over {len(rows)} "
            f"cases, {sum(r <= 1.10 for r in ratios)} within 1.10x (worst: {worst[0]})"
        )
    return lines


def qkv_lines(result):
    """The QKV projection by weight format: weight bytes over ropekv's time against the copy
    bandwidth, the ratio to cuBLAS's fp16 GEMM alone, and the speedup over fp16 weights at the
    same token count."""
    rows = [c for c in result["cases"] if c.get("weight_bytes") and "ropekv" in c]
    if not rows:
        return []
    fp16 = {c["tokens"]: c["ropekv"]["us"] for c in rows if c.get("weight_format") == "fp16"}
    lines = [
        "",
        (
            "QKV projection by weight format (weight bytes / ropekv time vs copy bandwidth; "
            "cuBLAS = its fp16 GEMM alone; speedup over fp16 weights at the same tokens):"
        ),
    ]
    for c in rows:
        r = c["ropekv"]
        line = (
            f"  {c['name']:34s} {_fmt_us(r['us']):>7s} us  weights "
            f"{c['weight_bytes'] / 1e6:6.1f} MB  {r.get('pct_copy_weights', 0):3.0f}% copy"
        )
        cublas = c.get("peers", {}).get("cublas", {})
        if "us" in cublas:
            line += f"  {cublas['us'] / r['us']:.2f}x cuBLAS"
        base = fp16.get(c["tokens"])
        if base and c.get("weight_format") != "fp16":
            line += f"  {base / r['us']:.2f}x fp16"
        lines.append(line)
    return lines


def frameworks_lines(results):
    """The framework cases (:mod:`ropekv.bench.frameworks`), one or a few lines each."""
    if not results:
        return []
    from ropekv.bench.frameworks import describe

    lines = [
        "",
        "Inside compiled programs (us per call; eager = the bare ropekv launch in a CUDA graph):",
    ]
    for r in results:
        lines += describe(r)
    return lines


COLORS = {
    "ropekv": "C0",
    "flashinfer": "C1",
    "flashinfer-cake": "C7",
    "torch": "C2",
    "torch-compile": "C3",
    "cublas": "C4",
    "cublas+ropekv": "C5",
    "steps": "C6",
}


def _group(case):
    """The dtype / layout family of a case: its name without the shape and sweep suffixes."""
    return case.get("series") or case["name"].replace(" (sweep)", "").rsplit(" ", 1)[0]


def plot(result, path):
    """One panel per op: time against token count for ropekv and each peer on one case family
    (the token sweep where the op has one, else its family with the most cases), the
    copy-bandwidth floor (minimal bytes over the copy bandwidth) dotted. Below them, one panel
    across the figure: ropekv's speedup over the best peer of every case (a dot per case, coloured
    by that peer, a line at 1), where a ratio near 1 shows that the log-log time panels hide."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'ropekv[plot]'") from e
    cases = [c for c in result["cases"] if "ropekv" in c]
    ops = [op for op in OPS if any(c["op"] == op for c in cases)]
    if not ops:
        raise RuntimeError("--plot: no case ran, nothing to plot")
    best = speedups(result)
    cols = min(3, len(ops))
    rows = -(-len(ops) // cols)
    width = max(5.5 * cols, 0.16 * len(best) + 2)
    fig = plt.figure(figsize=(width, 4.3 * rows + (5.2 if best else 0)))
    grid = fig.add_gridspec(
        rows + bool(best), cols, height_ratios=[1] * rows + ([1.25] if best else [])
    )
    bw = result["copy_bandwidth"]
    for i, op in enumerate(ops):
        _time_panel(fig.add_subplot(grid[i // cols, i % cols]), op, cases, bw)
    if best:
        _speedup_panel(fig.add_subplot(grid[rows, :]), best)
    env = result.get("environment", {})
    fig.suptitle(
        f"ropekv bench on {env.get('gpu', '?')}: median us per call (decode points "
        f"under CUDA-graph replay); copy bandwidth {bw / 1e12:.2f} TB/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _time_panel(ax, op, cases, bw):
    groups: dict[str, list] = {}
    for c in cases:
        if c["op"] == op:
            groups.setdefault(_group(c), []).append(c)
    title = max(groups, key=lambda g: (any(c.get("series") for c in groups[g]), len(groups[g])))
    pts = sorted(groups[title], key=lambda c: c["tokens"])
    x = [c["tokens"] for c in pts]
    fmt = pts[0].get("weight_format")
    ax.plot(
        x,
        [c["ropekv"]["us"] for c in pts],
        "o-",
        color=COLORS["ropekv"],
        label=f"ropekv {fmt} weights" if fmt else "ropekv",
    )
    if fmt:  # the other weight formats' ropekv lines (their peers multiply fp16 weights)
        for marker, (g, other) in zip(
            "v^<>", ((g, v) for g, v in groups.items() if g != title and v[0].get("weight_format"))
        ):
            other = sorted(other, key=lambda c: c["tokens"])
            ax.plot(
                [c["tokens"] for c in other],
                [c["ropekv"]["us"] for c in other],
                marker + "-",
                color=COLORS["ropekv"],
                alpha=0.6,
                label=f"ropekv {other[0]['weight_format']} weights",
            )
    for p, color in COLORS.items():
        px = [(c["tokens"], c["peers"][p]["us"]) for c in pts if "us" in c["peers"].get(p, {})]
        if px:
            ax.plot(*zip(*px), "s--", color=color, label=p, alpha=0.8)
    ax.plot(x, [c["bytes"] / bw * 1e6 for c in pts], "k:", label="copy-bandwidth floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("us per call")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


SPEEDUP_TICKS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
SPEEDUP_CAP = 4.0  # points above are drawn at the cap (a triangle) with their value written


def _speedup_panel(ax, best):
    """A dot per case at best peer time / ropekv time (log scale, a line at 1), case names below.
    The axis stops at 4x so that ratios near 1 stay readable; larger ones (PyTorch eager, 15-30x)
    sit on the top edge as triangles labelled with their value."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ratios = [r for _, _, r in best]
    cap = SPEEDUP_CAP if max(ratios) > SPEEDUP_CAP else max(ratios + [1.25]) * 1.1
    low = min(ratios + [0.8]) / 1.1
    for peer in dict.fromkeys(p for _, p, _ in best):
        idx = [i for i, (_, p, _) in enumerate(best) if p == peer]
        inside = [i for i in idx if ratios[i] <= cap]
        above = [i for i in idx if ratios[i] > cap]
        color = COLORS.get(peer, "k")
        if inside:
            ax.scatter(
                inside,
                [ratios[i] for i in inside],
                color=color,
                s=22,
                zorder=3,
                label=f"best peer: {peer}",
            )
        if above:
            ax.scatter(
                above,
                [cap] * len(above),
                color=color,
                marker="^",
                s=30,
                zorder=3,
                label=None if inside else f"best peer: {peer}",
            )
            for i in above:
                ax.annotate(
                    f"{ratios[i]:.0f}x",
                    (i, cap),
                    xytext=(0, -4),
                    textcoords="offset points",
                    ha="center",
                    va="top",
                    fontsize=5,
                    rotation=90,
                )
    ax.axhline(1.0, color="k", lw=1)
    ax.set_yscale("log")
    ax.set_ylim(low, cap * 1.08)
    ticks = [t for t in SPEEDUP_TICKS if low <= t <= cap * 1.08]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_xticks(range(len(best)), [name for name, _, _ in best], rotation=90, fontsize=6)
    ax.set_xlim(-0.7, len(best) - 0.3)
    ax.set_ylabel("best peer us / ropekv us")
    ax.set_title(
        "ropekv's speedup over the fastest peer whose output matched (above 1: ropekv "
        f"is faster; above {cap:g}x drawn at the top with its value)"
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
