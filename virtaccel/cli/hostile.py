"""`virtaccel hostile [--attach A,...] [--category C,...] [--scenario PREFIX,...] [--seed N]
[--json FILE] [--html FILE]`: the hostile-guest suite (virtaccel.suites.hostile) with a
verdict per scenario; exit 0 when no WEDGED and no FAIL, 1 otherwise, 2 for bad
arguments."""
from __future__ import annotations

import argparse

from ._args import CliError, check_output

ATTACHMENTS = ("mmio", "pci", "vfio", "sriov", "vdpa")


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
    if args.self_test:
        return _self_test(args, attaches if args.attach is not None else None)
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


def _self_test(args: argparse.Namespace, attaches: list[str] | None) -> int:
    """`--self-test`: each breakage caught (FAIL/WEDGED with it on, PASS/REJECT off)."""
    for flag, value in (("--category", args.category), ("--scenario", args.scenario),
                        ("--html", args.html)):
        if value is not None:
            raise CliError(f"{flag} does not go with --self-test (each breakage runs the "
                           "scenarios that should catch it)")
    from ..suites.hostile.selftest import BREAKAGES, run_self_test
    from ._out import print_table, wants_json_on_stdout, write_json
    from .progress import Progress
    steps = sum(1 if attaches is None else len([a for a in attaches if a in b.attachments])
                for b in BREAKAGES)
    if steps == 0:
        raise CliError(f"--attach {args.attach!r}: no breakage applies")
    with Progress(steps, "hostile self-test") as bar:
        report = run_self_test(attaches, args.seed,
                               progress=lambda c: bar.advance(note=f"{c.attach} {c.breakage}"))
    if args.json is not None:
        try:
            write_json(args.json, report.as_dict())
        except OSError as e:
            raise CliError(f"--json: {e.strerror or e}") from None
    if not wants_json_on_stdout(args.json):
        print(f"virtaccel hostile --self-test: {len(report.catches)} breakage runs, seed "
              f"{args.seed}, {report.wall_s:.1f} s")
        rows: list[list[object]] = []
        for c in report.catches:
            names = ", ".join(f"{r.scenario} {r.verdict.value}" for r in c.caught[:3])
            more = f" (+{len(c.caught) - 3})" if len(c.caught) > 3 else ""
            rows.append([c.breakage, c.attach, c.runs, len(c.caught),
                         "caught" if c.ok else ("control not clean" if c.control_bad
                                                else "NOT CAUGHT"), names + more])
        print_table(["breakage", "attach", "scenarios", "FAIL/WEDGED", "result", "caught by"],
                    rows, right=["scenarios", "FAIL/WEDGED"])
        if report.skipped:
            print(f"not applicable to --attach {args.attach}: {', '.join(report.skipped)}")
        for c in report.catches:
            for r in c.control_bad:
                print(f"control run (break off) not clean: {c.attach} {r.scenario} "
                      f"{r.verdict.value} {r.rule}: {r.reason}")
        print("self-test " + ("passed: every breakage caught" if report.ok else "FAILED"))
    return 0 if report.ok else 1
