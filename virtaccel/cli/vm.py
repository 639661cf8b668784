"""`virtaccel vm run IMAGE [--seed N] [--features NAMES] [--strict] [--trace FILE]
[--json FILE]`: boot a VM image and run its guest program.

`--features` picks the optional virtio features the guest driver may accept (as the
image's [guest] does); `--strict` makes any driver rule the device logged (a transport
violation, a ring rule that set DEVICE_NEEDS_RESET) fail the run, with the rules printed:
a driver under bring-up must run clean, not merely produce the right answer.

The MMIO table counts every guest access to device registers by whether it cost a VM
exit: on passthrough the doorbells are direct (the BAR is mapped into the guest) and the
MSI-X table writes exit (the VMM traps them). `--trace` writes those accesses, one event
each, into the Chrome trace (the VM's `cpu` track) with the rest of the run.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from typing import Any, Iterable

from ._args import CliError, check_output

MMIO_KINDS = ("mmio_read", "mmio_write")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _percentile(values: list[int], pct: int) -> int:
    lat = sorted(values or [0])
    return lat[max(0, -(-len(lat) * pct // 100) - 1)]


def _tenant_rows(tenants: dict[str, Any]) -> list[tuple[object, ...]]:
    """One row per tenant VM of an sriov-vf image."""
    rows: list[tuple[object, ...]] = []
    for name, r in tenants.items():
        if not isinstance(r, dict):
            rows.append((name, "NO", "-", "-", "-", "-", f"result {r!r}"))
            continue
        lat = list(r.get("latencies_ns") or [])
        correct = r.get("correct")
        rows.append((name, "yes" if r.get("ok") else "NO",
                     "-" if correct is None else ("yes" if correct else "NO"),
                     r.get("completions", 0), f"{_percentile(lat, 50) / 1000:.2f}",
                     f"{_percentile(lat, 99) / 1000:.2f}",
                     r.get("error") or "; ".join(r.get("errors") or [])))
    return rows


def mmio_counts(events: Iterable[Any]) -> dict[str, dict[str, int]]:
    """Guest MMIO accesses per VM: reads and writes, with and without a VM exit, and
    the MSI-X table writes the VMM trapped."""
    out: dict[str, Counter[str]] = {}
    for ev in events:
        if ev.kind in MMIO_KINDS:
            vm = ev.source.rsplit(".", 1)[0]
            how = "exit" if ev.get("exit", True) else "direct"
            out.setdefault(vm, Counter())[f"{ev.kind[5:]}s_{how}"] += 1
        elif ev.kind == "msix_table_write":
            out.setdefault(ev.source.split(".", 1)[0], Counter())["msix_table_writes"] += 1
    keys = ("reads_exit", "writes_exit", "reads_direct", "writes_direct", "msix_table_writes")
    return {vm: {k: c.get(k, 0) for k in keys} for vm, c in out.items()}


def cli_run(args: argparse.Namespace) -> int:
    from ..images import ImageError, load_image, run_image
    from ..trace_export import write_chrome_trace
    from ._out import print_table, wants_json_on_stdout, write_json
    if args.trace is not None:
        check_output(args.trace, "--trace")
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    try:
        image = load_image(args.image)
        if args.features is not None:
            image = dataclasses.replace(image, guest_features=_features(args.features))
        run = run_image(image, args.seed, keep_trace=args.trace is not None)
    except ImageError as e:
        raise CliError(str(e)) from None
    strict_failed = bool(args.strict and run.violations)
    if args.trace is not None:
        try:
            write_chrome_trace(run.trace_events, args.trace)
        except OSError as e:
            raise CliError(f"--trace {args.trace}: {e.strerror or e}") from None
    acc = image.accelerator
    mmio = mmio_counts(run.trace_events) if args.trace is not None else {}
    if args.json is not None:
        write_json(args.json, {
            "image": image.path, "name": image.name, "mode": acc.mode,
            "transport": acc.transport, "seed": run.seed, "entry": image.entry, "ok": run.ok,
            "result": _jsonable(run.result),
            "error": None if run.error is None else f"{type(run.error).__name__}: {run.error}",
            "virtual_ns": run.virtual_ns, "mmio_exits": run.exits,
            "direct_mmio_accesses": run.direct_accesses, "mmio": mmio,
            "guest_features": (None if image.guest_features is None
                               else list(image.guest_features)),
            "violations": [{"source": src, "rule": rule, "message": msg}
                           for src, rule, msg in run.violations],
            "strict": bool(args.strict), "digest": run.digest})
    if wants_json_on_stdout(args.json):
        return 0 if run.ok and not strict_failed else 1
    print(f"virtaccel vm run: image {image.name!r} ({acc.mode}, {acc.transport}), seed {run.seed}")
    print(f"  program {image.entry}")
    if image.guest_features is not None:
        print(f"  guest features {', '.join(image.guest_features) or '(none)'}")
    if run.error is not None:
        print(f"  guest program failed: {type(run.error).__name__}: {run.error}")
    elif isinstance(run.result, dict) and isinstance(run.result.get("tenants"), dict):
        print_table(("tenant", "ok", "correct", "done", "p50 us", "p99 us", "error"),
                    _tenant_rows(run.result["tenants"]), right=("done", "p50 us", "p99 us"))
    elif isinstance(run.result, dict):
        print_table(("result", "value"), [(k, _fmt(v)) for k, v in run.result.items()])
    else:
        print(f"  result {run.result!r} (a dict with 'ok' expected)")
    if mmio:
        print_table(("vm", "reads (exit)", "writes (exit)", "reads (direct)",
                     "writes (direct)", "MSI-X table writes"),
                    [(vm, *c.values()) for vm, c in mmio.items()],
                    title="guest MMIO accesses (exit: trapped by the VMM; direct: "
                          "a BAR mapped into the guest)",
                    right=("reads (exit)", "writes (exit)", "reads (direct)",
                           "writes (direct)", "MSI-X table writes"))
    print(f"  virtual time {run.virtual_ns / 1000:.3f} us, MMIO exits {run.exits}, "
          f"direct MMIO accesses {run.direct_accesses}")
    if args.trace is not None:
        print(f"trace written to {args.trace} (Chrome trace-event JSON, every MMIO access "
              "with its exit flag on each VM's cpu track; open it in Perfetto)")
    if run.violations:
        print_table(("source", "rule", "message"), run.violations,
                    title=f"driver rules the device logged ({len(run.violations)})")
    if strict_failed:
        rules = sorted({rule for _, rule, _ in run.violations})
        print(f"strict: the device logged {len(run.violations)} violation(s) of "
              f"{', '.join(rules)}")
    print(f"result: {'OK' if run.ok and not strict_failed else 'FAILED'}")
    print(f"trace digest: {run.digest}")
    return 0 if run.ok and not strict_failed else 1


def _features(text: str) -> tuple[str, ...]:
    """--features: comma-separated names, or 'none'."""
    from ..session import GUEST_FEATURES
    if text.strip() == "none":
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in GUEST_FEATURES:
            raise CliError(f"--features: unknown feature {n!r} (known: "
                           f"{', '.join(GUEST_FEATURES)}, or none)")
    if not names:
        raise CliError("--features: give feature names, or none")
    return names


def _jsonable(value: Any) -> Any:
    """The program's result as JSON can hold it (numpy scalars and arrays as lists)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
