"""`virtaccel vm run IMAGE [--seed N]`: boot a VM image and run its guest program."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..images import ImageError, load_image, run_image
from ._args import seed as _seed


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vm", help="VM images: boot one and run its guest program")
    vsub = p.add_subparsers(dest="vm_command", required=True)
    r = vsub.add_parser("run", help="boot IMAGE (vm_images/*.toml), run its program (sriov-vf: "
                                    "every tenant VM's), print the result and the trace digest; "
                                    "exit 1 unless the result is ok")
    r.add_argument("image", metavar="IMAGE", help="a VM image file (TOML)")
    r.add_argument("--seed", type=_seed, default=None, help="machine and data seed (default: the image's)")
    r.set_defaults(func=cli_run)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _print_tenants(tenants: dict[str, Any]) -> None:
    """One line per tenant VM of an sriov-vf image."""
    print(f"  {'tenant':<12} {'ok':<4} {'correct':<8} {'done':>5} {'p50 us':>8} {'p99 us':>8}  error")
    for name, r in tenants.items():
        if not isinstance(r, dict):
            print(f"  {name:<12} result {r!r}")
            continue
        lat = sorted(r.get("latencies_ns") or [0])
        p50 = lat[max(0, -(-len(lat) * 50 // 100) - 1)]
        p99 = lat[max(0, -(-len(lat) * 99 // 100) - 1)]
        correct = r.get("correct")
        print(f"  {name:<12} {'yes' if r.get('ok') else 'NO':<4} "
              f"{'-' if correct is None else ('yes' if correct else 'NO'):<8} "
              f"{r.get('completions', 0):>5} {p50 / 1000:>8.2f} {p99 / 1000:>8.2f}  "
              f"{r.get('error') or '; '.join(r.get('errors') or [])}")


def cli_run(args: argparse.Namespace) -> int:
    try:
        image = load_image(args.image)
        run = run_image(image, args.seed)
    except ImageError as e:
        print(f"virtaccel vm run: {e}", file=sys.stderr)
        return 2
    acc = image.accelerator
    print(f"virtaccel vm run: image {image.name!r} ({acc.mode}, {acc.transport}), seed {run.seed}")
    print(f"  program {image.entry}")
    if run.error is not None:
        print(f"  guest program failed: {type(run.error).__name__}: {run.error}")
    elif isinstance(run.result, dict) and isinstance(run.result.get("tenants"), dict):
        _print_tenants(run.result["tenants"])
    elif isinstance(run.result, dict):
        for k, v in run.result.items():
            print(f"  {k:<20} {_fmt(v)}")
    else:
        print(f"  result {run.result!r} (a dict with 'ok' expected)")
    print(f"  virtual time {run.virtual_ns / 1000:.3f} us, MMIO exits {run.exits}, "
          f"direct MMIO accesses {run.direct_accesses}")
    print(f"result: {'OK' if run.ok else 'FAILED'}")
    print(f"trace digest: {run.digest}")
    return 0 if run.ok else 1
