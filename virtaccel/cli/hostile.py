"""`virtaccel hostile [--attach A,...] [--category C,...] [--scenario PREFIX,...] [--seed N]
[--json FILE] [--html FILE]`: the hostile-guest suite (virtaccel.suites.hostile) with a
verdict per scenario; exit 0 when no WEDGED and no FAIL, 1 otherwise, 2 for bad
arguments."""
from __future__ import annotations

import argparse

from ._args import CliError, check_output

ATTACHMENTS = ("mmio", "pci", "vfio", "sriov")


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def cli(args: argparse.Namespace) -> int:
    attaches = _split(args.attach) if args.attach is not None else list(ATTACHMENTS)
    bad = [a for a in attaches if a not in ATTACHMENTS]
    if bad or not attaches:
        raise CliError(f"--attach {args.attach!r}: one or more of {', '.join(ATTACHMENTS)}, "
                       "comma-separated")
    for flag, path in (("--json", args.json), ("--html", args.html)):
        if path is not None:
            check_output(path, flag, allow_stdout=flag == "--json")
    from ..suites.hostile.catalogue import CATEGORIES, catalogue, select
    from ..suites.hostile.report import bad_rows, summary_rows, to_html
    from ..suites.hostile.runner import run_suite
    from ._out import print_table, wants_json_on_stdout, write_json
    from .progress import Progress
    cats = _split(args.category) if args.category else []
    unknown = [c for c in cats if c not in CATEGORIES]
    if unknown:
        raise CliError(f"--category {', '.join(map(repr, unknown))}: one of "
                       f"{', '.join(repr(c) for c in CATEGORIES)}")
    scs = select(catalogue(), categories=cats, names=_split(args.scenario or ""))
    runs = sum(1 for a in attaches for s in scs if s.applies(a))
    if runs == 0:
        raise CliError("no scenario matches --attach, --category and --scenario")
    with Progress(runs, "hostile") as bar:
        def step(r: object) -> None:
            bar.advance(note=f"{getattr(r, 'attach', '')} {getattr(r, 'scenario', '')}")
        report = run_suite(scs, attaches, args.seed, progress=step)
    doc = report.as_dict()
    try:
        if args.json is not None:
            write_json(args.json, doc)
        if args.html is not None:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(to_html(report))
    except OSError as e:
        flag = "--html" if args.html and getattr(e, "filename", None) == args.html else "--json"
        raise CliError(f"{flag}: {e.strerror or e}") from None
    if not wants_json_on_stdout(args.json):
        print(f"virtaccel hostile: {len(report.results)} scenario runs on "
              f"{', '.join(attaches)}, seed {args.seed}, {report.wall_s:.1f} s")
        cols, rows, totals = summary_rows(report)
        print_table(cols, rows, right=["scenarios", "PASS", "REJECT", "WEDGED", "FAIL"],
                    totals=totals)
        bad_list = bad_rows(report)
        if bad_list:
            print_table(["attach", "scenario", "verdict", "rule", "reason"], bad_list,
                        title="WEDGED and FAIL")
        for what, path in (("JSON", args.json), ("HTML", args.html)):
            if path:
                print(f"wrote {what} {path}")
    return 0 if report.ok else 1
