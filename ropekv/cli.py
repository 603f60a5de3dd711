"""The ``ropekv`` command: ``info``, ``demo``, ``bench``, ``check``."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args):
    from ropekv._info import info

    return info()


def _cmd_demo(args):
    from ropekv._demo import demo

    return demo(backend=args.backend, steps=args.steps)


def build_parser():
    parser = argparse.ArgumentParser(prog="ropekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, device, compile cache, which backend would run")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("demo", help="a Llama-3-8B-shaped prefill and decode through ropekv, "
                                    "checked against the reference")
    p.add_argument("--backend", choices=("auto", "cuda", "numpy"), default="auto",
                   help="auto: CUDA when a device is present, else the NumPy reference")
    p.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
