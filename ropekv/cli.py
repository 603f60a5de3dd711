"""The ``ropekv`` command: ``info``, ``demo``, ``bench``, ``check``."""

from __future__ import annotations

import argparse
import sys

import ropekv

DESCRIPTION = (
    "Fused RoPE + KV-cache CUDA kernels for LLM inference. Without a GPU, NumPy inputs "
    "run the NumPy reference: 'ropekv demo' works on any machine."
)
# What bench and check print when there is no GPU (as ropekv.bench / ropekv.check word it).
NEEDS_GPU = {
    "bench": "the benchmark needs a CUDA GPU",
    "check": "it needs a CUDA GPU (the NumPy reference alone has nothing to check against)",
}


def _cmd_info(args):
    from ropekv._info import info

    return info()


def _cmd_demo(args):
    from ropekv._demo import demo

    return demo(backend=args.backend, steps=args.steps)


def _int_range(low, high, why):
    """argparse type: an integer in [low, high]; ``why`` explains the bounds in the error."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be between {low} and {high} ({why}), got {value}"
            )
        return value

    return parse


def _names(choices, what):
    """argparse type for ``--ops a,b`` / ``--ops a b``: comma-separated names from ``choices``."""

    def parse(text):
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def _variant(text):
    """argparse type for ``--tune``: a variant naming known tunables with values they accept
    (:mod:`ropekv.bench.tuning`), kept as its text."""
    from ropekv.bench import tuning

    try:
        tuning.validate(tuning.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _output_path(text):
    """argparse type for ``--json`` / ``--plot``: a file that can be written, checked before the
    run (a file made and removed in its directory; an existing file opened for writing, not
    truncated)."""
    import os
    import tempfile

    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    try:
        if os.path.exists(path):
            with open(path, "r+b"):
                pass
        else:
            fd, probe = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".ropekv-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror or e}") from None
    return text


def _flatten(lists):
    return None if lists is None else list(dict.fromkeys(n for names in lists for n in names))


def _gpu_ready(command):
    """True when a CUDA device is usable; else print why ``command`` cannot run."""
    from ropekv._info import device_state

    _, count, why = device_state()
    if not count:
        print(
            f"ropekv {command}: no CUDA device found; {NEEDS_GPU[command]}\n  reason: {why}",
            file=sys.stderr,
        )
    return bool(count)


def _cmd_bench(args):
    if not _gpu_ready("bench"):
        return 1
    from ropekv.bench import main

    return main(
        ops=_flatten(args.ops),
        peers=_flatten(args.peers),
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        cases=args.cases,
        frameworks=args.frameworks,
        tune=args.tune,
        options=args.options,
    )


def _cmd_check(args):
    if not _gpu_ready("check"):
        return 1
    from ropekv.check import check

    return check(ops=_flatten(args.ops))


def build_parser():
    parser = argparse.ArgumentParser(prog="ropekv", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"ropekv {ropekv.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "info", help="versions, device, ropekv's and CuPy's caches, which backend would run"
    )
    p.set_defaults(func=_cmd_info)
    _add_demo(sub)
    from ropekv import _registry  # ropekv.bench.OPS without importing the bench: a light parser

    ops = tuple(_registry.workloads())
    _add_bench(sub, ops)
    p = sub.add_parser(
        "check",
        help="every available op on this GPU against the NumPy reference, as a pass/fail table",
    )
    p.add_argument(
        "--ops",
        nargs="+",
        type=_names(ops, "op"),
        metavar="OP",
        help=f"ops to check (default: all that exist): {', '.join(ops)}",
    )
    p.set_defaults(func=_cmd_check)
    return parser


def _add_demo(sub):
    """The ``demo`` subcommand."""
    from ropekv._demo import CAPACITY, MAX_STEPS, PROMPT

    p = sub.add_parser(
        "demo",
        help="a Llama-3-8B-shaped prefill and decode through ropekv, checked against the reference",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "cuda", "numpy"),
        default="auto",
        help="auto: CUDA when a device is present, else the NumPy reference",
    )
    p.add_argument(
        "--steps",
        type=_int_range(0, MAX_STEPS, f"a {PROMPT}-token prompt in a {CAPACITY}-token cache"),
        default=8,
        help=f"decode steps after the prefill, 0 to {MAX_STEPS} (default 8)",
    )
    p.set_defaults(func=_cmd_demo)


def _add_bench(sub, ops):
    """The ``bench`` subcommand (``ops``: the op names it takes)."""
    peers = (
        "flashinfer",
        "flashinfer-cake",
        "torch",
        "torch-compile",
        "cublas",
        "steps",
    )  # == bench.PEERS
    p = sub.add_parser(
        "bench",
        help="every op against its peers and the copy bandwidth, one run",
        description="Time every available op on its standard cases against "
        "FlashInfer, PyTorch eager, torch.compile and cuBLAS (each "
        "when importable), checking each peer's output against "
        "ropekv's first, and against the device-to-device copy "
        "bandwidth measured in the same run.",
    )
    p.add_argument(
        "--ops",
        nargs="+",
        type=_names(ops, "op"),
        metavar="OP",
        help=f"ops to run (default: all that exist): {', '.join(ops)}",
    )
    p.add_argument(
        "--peers",
        nargs="+",
        type=_names(peers, "peer"),
        metavar="PEER",
        help=f"peers to compare with (default: all; with --quick: torch, cublas, "
        f"steps; steps = CuPy RMSNorm + ropekv's paged op, for mla): "
        f"{', '.join(peers)}",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        metavar="TEXT",
        help=(
            "only the cases whose name contains one of these strings (e.g. 'qkv fp8w' or '64x1'); "
            "a string starting with '=' names one case exactly ('=paged gqa fp16->e4m3 1x1')"
        ),
    )
    p.add_argument(
        "--quick", action="store_true", help="a few cases and repetitions (well under a minute)"
    )
    p.add_argument(
        "--frameworks",
        action="store_true",
        help="time ropekv inside compiled programs against its eager launch: "
        "torch.compile (default and reduce-overhead modes) under CUDA graphs, "
        "jax.jit with a donated cache (needs torch / JAX); alone it runs only "
        "these, with --ops or --cases it runs those cases too",
    )
    _add_bench_variants(p)
    p.set_defaults(func=_cmd_bench)


def _add_bench_variants(p):
    """``bench``'s launch-shape variants, options and outputs."""
    p.add_argument(
        "--tune",
        nargs="+",
        type=_variant,
        metavar="VARIANT",
        help="launch-shape variants timed beside ropekv's defaults on the cases of "
        "the ops they change, each 'op.key=value[,op.key=value]' over the op "
        "module's TUNING or its upper-case constants (e.g. paged.row_group=0 "
        "'paged.heavy=(2,2,3)' qkv.GEMV_MAX_TOKENS=1000)",
    )
    p.add_argument(
        "--options",
        action="store_true",
        help="also time each case with each option of its op on (status=, "
        "clear_unused_last_page_rows, mRoPE, ...), as runners 'ropekv[+option]' "
        "whose ratio is the option's cost",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        type=_output_path,
        help="write every figure and the environment here",
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        type=_output_path,
        help="draw time against tokens per op, and ropekv's speedup over the best "
        "peer per case, to this PNG (needs matplotlib: pip install "
        "'ropekv[plot]')",
    )


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
