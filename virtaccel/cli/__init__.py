"""`virtaccel`: the command line."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import bench, demo, stats, vm
from . import compile as compile_cmd
from . import objdump, run
from . import tenants as tenants_cmd
from ._args import seed as _seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="virtaccel", description="A virtualized AI-accelerator stack (VA-1).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="boot one VM with a VA-1 over virtio-mmio and run a two-layer MLP")
    p.add_argument("--seed", type=_seed, default=0, help="machine and data seed (default 0)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace-event JSON (Perfetto) of the run")
    p.set_defaults(func=demo.cli)
    bench.add_parser(sub)
    stats.add_parser(sub)
    vm.add_parser(sub)
    compile_cmd.add_parser(sub)
    run.add_parser(sub)
    objdump.add_parser(sub)
    tenants_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
