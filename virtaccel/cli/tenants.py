"""`virtaccel tenants --vfs N --weights W1,...,WN [--aggressor K] [--seed S] --json FILE`:
a saturating multi-tenant run on one VA-1 card (virtaccel.suites.tenants)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..suites.tenants import DEFAULT_DURATION_NS, Scenario, ScenarioError, format_table, \
    parse_weights, run_tenants


def _int(what: str, lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{what} {value} is outside {lo} .. {hi}")
        return value
    return parse


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tenants", help="N tenant VMs on N VFs of one VA-1 card, saturating it: per-VF device "
                        "time, completions, p50/p99 latency, correctness; Jain's index")
    p.add_argument("--vfs", type=_int("--vfs", 0, 0xFFFF), required=True,
                   help="number of VFs (and tenant VMs), 1 .. TotalVFs (64)")
    p.add_argument("--weights", required=True, metavar="W1,W2,...",
                   help="one scheduling weight (>= 1) per VF, comma-separated")
    p.add_argument("--aggressor", type=_int("--aggressor", -(1 << 31), 1 << 31), default=None,
                   metavar="K", help="VF K floods its queues; the others run closed-loop and "
                                     "their p99 is compared with a run without the aggressor")
    p.add_argument("--seed", type=_int("--seed", 0, (1 << 64) - 1), default=0,
                   help="machine and data seed (default 0)")
    p.add_argument("--duration-us", type=_int("--duration-us", 1, 10**7),
                   default=DEFAULT_DURATION_NS // 1000,
                   help=f"virtual time each tenant submits for (default {DEFAULT_DURATION_NS // 1000})")
    p.add_argument("--json", metavar="FILE", required=True, help="write the results as JSON here")
    p.set_defaults(func=cli)


def cli(args: argparse.Namespace) -> int:
    try:
        weights = parse_weights(args.weights)
        sc = Scenario(vfs=args.vfs, weights=weights, aggressor=args.aggressor, seed=args.seed,
                      duration_ns=args.duration_us * 1000)
        sc.check()
    except ScenarioError as e:
        print(f"virtaccel tenants: {e}", file=sys.stderr)
        return 2
    result = run_tenants(sc)
    doc = result.as_dict()
    if result.baseline is not None:
        doc["baseline"] = result.baseline.as_dict()
    try:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    except OSError as e:
        print(f"virtaccel tenants: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(f"wrote {args.json}")
    ok = doc["all_correct"] and not result.notes
    return 0 if ok else 1
