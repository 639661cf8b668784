"""`virtaccel bench`: run the benchmarks, print the table, write bench.json and bench.png."""
from __future__ import annotations

import argparse
import sys

from ..bench import CASES, Sizes, format_table, run_bench, write_outputs
from .progress import Progress


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("bench", help="benchmarks: ratios against numpy / copyto / a bare ring")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON (and FILE's .png chart)")
    p.add_argument("--only", metavar="ROWS", default="",
                   help=f"comma-separated cases to run, of {','.join(CASES)} (default all)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes: checks the machinery, the numbers mean nothing")
    p.add_argument("--no-profile", action="store_true",
                   help="do not profile rows that miss their target")
    p.set_defaults(func=cli)


def cli(args: argparse.Namespace) -> int:
    only = [k.strip() for k in args.only.split(",") if k.strip()] or None
    unknown = sorted(set(only or ()) - set(CASES))
    if unknown:
        print(f"virtaccel bench: unknown case(s) {', '.join(unknown)}; "
              f"choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    sizes = Sizes.smoke() if args.smoke else Sizes.full()
    keys = only or list(CASES)
    with Progress(len(keys), "bench") as bar:
        rows = run_bench(sizes, keys, profile=not args.no_profile,
                         on_start=lambda k: bar.start(f"case {k}"),
                         on_step=lambda k: bar.advance(note=f"case {k} done"))
    print(format_table(rows))
    for r in rows:
        if r.profile and r.profile.get("tottime"):
            layers = ", ".join(f"{k} {v:g}%" for k, v in r.profile.get("by_layer", {}).items()
                               if v >= 1)
            print(f"\n{r.name} misses its target; own time by layer: {layers}")
            print("  top functions by own time (cProfile):")
            for e in r.profile["tottime"][:8]:
                print(f"  {e['tottime_pct']:5.1f}%  {e['ncalls']:>8}  {e['function']}")
            if r.profile.get("phases"):
                print("  wall time between trace events, per iteration (separate run, no cProfile):")
                for p in r.profile["phases"][:6]:
                    print(f"  {p['us_per_iter']:>10.1f} us  {p['pct']:5.1f}%  {p['segment']}")
    if args.json:
        png = write_outputs(rows, args.json, {"smoke": bool(args.smoke)})
        print(f"\nwrote {args.json} and {png}")
    return 0
