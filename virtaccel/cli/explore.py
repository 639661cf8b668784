"""`virtaccel explore IMAGE --seeds A:B [--faults PLAN.toml] [--random-faults N] [--jobs N]
[--cluster ADDRESS] [--break NAME] [--plans DIR] [--json FILE]`: seed exploration
(virtaccel.suites.explore): exit 0 when every seed keeps the invariants, 1 when one
does not (each failure printed with its seed and a minimal plan), 2 for bad input."""
from __future__ import annotations

import argparse
import os
import tomllib
from typing import Any

from ._args import SEED_MAX, CliError, check_output


def parse_seeds(text: str) -> range:
    """`A:B`, the seeds A .. B-1 (CliError naming what is wrong)."""
    a, sep, b = text.partition(":")
    if not sep:
        raise CliError(f"--seeds {text!r}: give A:B (the seeds A .. B-1)")
    try:
        start, stop = int(a.strip(), 0), int(b.strip(), 0)
    except ValueError:
        raise CliError(f"--seeds {text!r}: A and B must be integers") from None
    if not 0 <= start <= SEED_MAX or not 0 <= stop <= SEED_MAX + 1:
        raise CliError(f"--seeds {text!r}: seeds are 0 .. 2**64-1")
    if start >= stop:
        raise CliError(f"--seeds {text!r}: empty range (A must be less than B)")
    return range(start, stop)


def load_plan(path: str, image: Any) -> Any:
    """A [[faults]] file checked against the image (CliError naming file and entry)."""
    from vmm.faults import FaultPlan, FaultPlanError

    from ..images import check_plan
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise CliError(f"--faults {path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CliError(f"--faults {path}: not valid TOML: {e}") from None
    extra = sorted(k for k in doc if k != "faults")
    if extra:
        raise CliError(f"--faults {path}: unknown key {extra[0]!r} (a plan has only "
                       "[[faults]] tables)")
    raw = doc.get("faults", [])
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise CliError(f"--faults {path}: faults must be an array of tables ([[faults]])")
    try:
        plan = FaultPlan(raw)
        check_plan(image, plan)
    except FaultPlanError as e:
        raise CliError(f"--faults {path}: {e}") from None
    return plan


def cli(args: argparse.Namespace) -> int:
    from ..images import ImageError, load_image
    from ..suites.invariants import DEFAULT_WAIT_BOUND_NS
    seeds = parse_seeds(args.seeds)
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    if args.plans is not None and not os.path.isdir(args.plans):
        raise CliError(f"--plans {args.plans}: not a directory")
    from ..suites.explore import DEFAULT_TIME_LIMIT_NS, check_breaks, explore, plan_toml
    try:
        breaks = check_breaks(b.strip() for b in (args.breaks or "").split(",") if b.strip())
    except ValueError as e:
        raise CliError(f"--break: {e}") from None
    wait_bound = args.wait_bound_ns or DEFAULT_WAIT_BOUND_NS
    time_limit = args.time_limit_ns or max(DEFAULT_TIME_LIMIT_NS, 4 * wait_bound)
    if time_limit <= wait_bound:
        raise CliError(f"--time-limit-ns {time_limit}: must exceed the wait bound "
                       f"({wait_bound} ns), or a hung wait ends before it is seen")
    try:
        image = load_image(args.image)
    except ImageError as e:
        raise CliError(str(e)) from None
    plan = load_plan(args.faults, image) if args.faults is not None else None
    if args.cluster is not None:
        try:
            import distributed  # noqa: F401
        except ImportError:
            raise CliError("--cluster needs Dask: pip install 'virtaccel[cluster]'") from None
    workers = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    from ._out import print_table, wants_json_on_stdout, write_json
    from .progress import Progress
    with Progress(len(seeds), "explore") as bar:
        report = explore(image, seeds, plan=plan, random_faults=args.random_faults,
                         breaks=breaks, workers=workers, cluster=args.cluster,
                         wait_bound_ns=wait_bound, time_limit_ns=time_limit,
                         shrink_limit=args.shrink,
                         progress=lambda r: bar.advance(note=f"seed {r.seed}"))
    doc = report.as_dict()
    try:
        if args.json is not None:
            write_json(args.json, doc)
        if args.plans is not None:
            for r in report.failures:
                with open(os.path.join(args.plans, f"seed-{r.seed}.toml"), "w",
                          encoding="utf-8") as f:
                    f.write(plan_toml(r.plan if r.minimal is None else r.minimal, r.seed,
                                      breaks))
    except OSError as e:
        raise CliError(f"{e.filename or '--json'}: {e.strerror or e}") from None
    if wants_json_on_stdout(args.json):
        return 0 if report.ok else 1
    print(f"virtaccel explore: image {image.name!r}, seeds {seeds.start}:{seeds.stop} "
          f"({len(seeds)} runs), {len(report.plan)} planned + {args.random_faults} random "
          f"faults per seed, {doc['faults_injected']} injected"
          + (f", breakage {','.join(breaks)}" if breaks else ""))
    if report.ok:
        print("every invariant held on every seed")
    else:
        print_table(["seed", "breaches", "first breach", "minimal plan"],
                    [(r.seed, len(r.breaches), _first(r.breaches),
                      "(not shrunk)" if r.minimal is None else
                      ", ".join(f"{e.get('name')}: {e['action']} on {e['function']}"
                                for e in r.minimal) or "(no fault)")
                     for r in report.failures],
                    title=f"{len(report.failures)} failing seeds", right=["seed", "breaches"])
        for r in report.failures:
            if r.minimal is None:
                continue
            print(f"\n--- seed {r.seed}: minimal plan ---")
            print(plan_toml(r.minimal, r.seed, breaks).rstrip("\n"))
        if report.unshrunk:
            print(f"\n{len(report.unshrunk)} failing seeds not shrunk (--shrink "
                  f"{report.shrink_limit}): {', '.join(map(str, report.unshrunk[:20]))}"
                  + (" ..." if len(report.unshrunk) > 20 else ""))
    for what, path in (("JSON", args.json), ("plans", args.plans)):
        if path:
            print(f"wrote {what} {path}")
    return 0 if report.ok else 1


def _first(breaches: list[dict[str, Any]]) -> str:
    b = breaches[0]
    return f"{b['kind']} {b['where']}: {b['detail']}"
