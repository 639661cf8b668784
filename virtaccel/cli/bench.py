"""`virtaccel bench`: run the benchmarks, print the table, write bench.json and bench.png."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ._args import CliError, check_output


def cli(args: argparse.Namespace) -> int:
    from ..bench import CASES, Sizes, run_bench, write_outputs
    from ..bench.rows import RIGHT_COLUMNS, TABLE_COLUMNS, table_rows
    from ._out import print_table, wants_json_on_stdout
    from .progress import Progress
    only = [k.strip() for k in args.only.split(",") if k.strip()] or None
    unknown = sorted(set(only or ()) - set(CASES))
    if unknown:
        raise CliError(f"--only: unknown case(s) {', '.join(unknown)}; "
                       f"choose from {', '.join(CASES)}")
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    sizes = Sizes.smoke() if args.smoke else Sizes.full()
    if args.blas_threads is not None:
        if args.blas_threads < 0:
            raise CliError(f"--blas-threads {args.blas_threads}: a count >= 0 (0: the BLAS "
                           "library's default)")
        sizes = dataclasses.replace(sizes, blas_threads=args.blas_threads)
    from ..bench.runner import blas_info, blas_line
    blas = blas_info(sizes.blas_threads)
    keys = only or list(CASES)
    with Progress(len(keys), "bench") as bar:
        rows = run_bench(sizes, keys, profile=not args.no_profile,
                         on_start=lambda k: bar.start(f"case {k}"),
                         on_step=lambda k: bar.advance(note=f"case {k} done"))
    quiet = wants_json_on_stdout(args.json)
    if not quiet:
        print(blas_line(blas))
        print("value and baseline: medians over their runs; ratio: of the medians (the "
              "target applies to it); ratio IQR: quartiles of the per-run ratios (value and baseline runs "
              "interleaved) or the band their quartiles allow")
        print_table(TABLE_COLUMNS, table_rows(rows), right=RIGHT_COLUMNS)
        for r in rows:
            if r.profile and r.profile.get("tottime"):
                _print_profile(r.name, r.profile)
    if args.json is not None:
        try:
            png = write_outputs(rows, args.json, {"smoke": bool(args.smoke), "blas": blas})
        except OSError as e:
            raise CliError(f"--json {args.json}: {e.strerror or e}") from None
        if not quiet:
            print(f"\nwrote {args.json} and {png}")
    return 0


def _print_profile(name: str, p: dict[str, Any]) -> None:
    """Where a row that misses its target spends its time."""
    layers = ", ".join(f"{k} {v:g}%" for k, v in p.get("by_layer", {}).items() if v >= 1)
    print(f"\n{name} misses its target; own time by layer: {layers}")
    print("  top functions by own time (cProfile):")
    for e in p["tottime"][:8]:
        print(f"  {e['tottime_pct']:5.1f}%  {e['ncalls']:>8}  {e['function']}")
    if p.get("phases"):
        print("  wall time between trace events, per iteration (separate run, no cProfile):")
        for ph in p["phases"][:6]:
            print(f"  {ph['us_per_iter']:>10.1f} us  {ph['pct']:5.1f}%  {ph['segment']}")
