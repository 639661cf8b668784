"""`virtaccel tenants --vfs N --weights W1,...,WN [--aggressor K] [--seed S] [--json FILE]`:
a saturating multi-tenant run on one VA-1 card (virtaccel.suites.tenants)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ._args import CliError, check_output

if TYPE_CHECKING:
    from ..suites.tenants import ScenarioResult

BASE_DURATION_US = 1000
AGGRESSOR_US_PER_VF = 125


def default_duration_us(vfs: int, aggressor: int | None) -> int:
    """Virtual time each tenant submits for when --duration-us is not given.

    Tenant VMs boot one after another and start submitting when booted; the measuring
    window is where all of them submit, so the duration must outlast that spread. It is
    a few us per VM alone, but while an aggressor floods the card each later VM's boot
    waits behind it: about 100 us per VF at 64 VFs (measured: 6.4 ms at 64, 4.3 ms at
    48, 1.6 ms at 32). 125 us per VF leaves a window of 2 ms or more at every N.
    """
    if aggressor is None:
        return BASE_DURATION_US
    return BASE_DURATION_US + AGGRESSOR_US_PER_VF * vfs


def result_table(res: "ScenarioResult") -> tuple[list[str], list[tuple[object, ...]], list[str]]:
    """Columns, rows and right-aligned columns of the per-VF table."""
    agg = res.scenario.aggressor is not None
    cols = ["VF", "role", "weight", "device us", "share", "target", "err", "cmds", "done",
            "p50 us", "p99 us"]
    if agg:
        cols += ["solo p99", "x solo"]
    cols.append("correct")
    rows: list[tuple[object, ...]] = []
    for r in res.rows:
        row: list[object] = [r.vf, r.role, r.weight, f"{r.device_ns / 1000:.1f}",
                             f"{r.share:.3f}", f"{r.target:.3f}", f"{r.share_error:+.1%}",
                             r.commands, r.completed, f"{r.p50_ns / 1000:.2f}",
                             f"{r.p99_ns / 1000:.2f}"]
        if agg:
            row += ["-" if r.solo_p99_ns is None else f"{r.solo_p99_ns / 1000:.2f}",
                    "-" if r.p99_ratio is None else f"{r.p99_ratio:.2f}"]
        row.append("yes" if r.correct else "NO")
        rows.append(tuple(row))
    right = [c for c in cols if c not in ("role", "correct")]
    return cols, rows, right


def cli(args: argparse.Namespace) -> int:
    from ..errors import ScenarioError
    from ..suites.tenants import Scenario, parse_weights, run_tenants
    from ._out import print_table, wants_json_on_stdout, write_json
    from .progress import Progress
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    duration_us = args.duration_us if args.duration_us is not None \
        else default_duration_us(args.vfs, args.aggressor)
    try:
        weights = parse_weights(args.weights)
        sc = Scenario(vfs=args.vfs, weights=weights, aggressor=args.aggressor, seed=args.seed,
                      duration_ns=duration_us * 1000)
        sc.check()
    except ScenarioError as e:
        raise CliError(str(e)) from None
    runs = 1 if sc.aggressor is None else 2
    with Progress(runs, "tenants") as bar:
        bar.start(f"{sc.vfs} VMs, {duration_us} us of virtual time each")
        result = run_tenants(sc)
        bar.advance(runs)
    doc: dict[str, Any] = result.as_dict()
    if result.baseline is not None:
        doc["baseline"] = result.baseline.as_dict()
    if args.json is not None:
        try:
            write_json(args.json, doc)
        except OSError as e:
            raise CliError(f"--json {args.json}: {e.strerror or e}") from None
    if not wants_json_on_stdout(args.json):
        print(f"virtaccel tenants: {sc.vfs} VFs, weights {','.join(map(str, sc.weights))}, "
              f"{'aggressor VF ' + str(sc.aggressor) if sc.aggressor else 'no aggressor'}, "
              f"seed {sc.seed}, {sc.compute_units} compute units, {duration_us} us each")
        print(f"window {result.window_ns[0]} .. {result.window_ns[1]} ns (virtual)")
        cols, rows, right = result_table(result)
        print_table(cols, rows, right=right)
        print(f"Jain's fairness index over device time: {result.jain:.4f}; "
              f"largest share error {result.max_share_error:+.1%}")
        for n in result.notes:
            print(f"note: {n}")
        if args.json:
            print(f"wrote {args.json}")
    ok = doc["all_correct"] and not result.notes
    return 0 if ok else 1
