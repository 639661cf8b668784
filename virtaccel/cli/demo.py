"""`virtaccel demo`: the walking skeleton end to end, from the runtime API to numpy
inside the device model, on one VM with one VA-1 over virtio-mmio."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any


ATOL = 1e-4


@dataclass
class DemoReport:
    seed: int
    result: dict[str, Any]
    commands: list[tuple[str, int]] = field(default_factory=list)  # (opcode, device ns)
    virtual_ns: int = 0
    wall_s: float = 0.0
    digest: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.result.get("ok")) and float(self.result["max_abs_error"]) <= ATOL


def run_demo(seed: int = 0, trace_path: str | None = None) -> DemoReport:
    from virtaccel.guests import mlp

    from ..session import Session
    with Session(attach="mmio", seed=seed, keep_trace=trace_path is not None) as s:
        times = s.command_times()
        result = s.run(lambda os_: mlp.main(os_, seed=seed), name="mlp")
    if trace_path is not None:
        s.write_trace(trace_path)
    return DemoReport(seed, dict(result), times.commands, s.now_ns(), s.wall_s, s.digest())


def cli(args: argparse.Namespace) -> int:
    from ._args import check_output
    from ._out import wants_json_on_stdout, write_json
    for path, flag in ((args.trace, "--trace"), (args.json, "--json")):
        if path is not None:
            check_output(path, flag, allow_stdout=flag == "--json")
    report = run_demo(args.seed, args.trace)
    r = report.result
    verdict = "OK" if report.ok else "MISMATCH"
    if args.json is not None:
        write_json(args.json, {
            "seed": report.seed, "ok": report.ok, "max_abs_error": float(r["max_abs_error"]),
            "atol": ATOL, "commands": [{"opcode": op, "device_ns": ns} for op, ns in report.commands],
            "device_ns": sum(ns for _, ns in report.commands), "virtual_ns": report.virtual_ns,
            "wall_s": report.wall_s, "digest": report.digest})
    if wants_json_on_stdout(args.json):
        return 0 if report.ok else 1
    print("virtaccel demo: two-layer MLP (f32, batch 64, 512 -> 1024 -> 256, GEMM + bias + ReLU x2)")
    print(f"  on one VA-1 over virtio-mmio in one VM, seed {report.seed}")
    _command_table(report.commands, report.virtual_ns)
    print(f"max abs error vs numpy: {float(r['max_abs_error']):.3e} (atol {ATOL:g})  {verdict}")
    print(f"wall time: {report.wall_s:.3f} s")
    print(f"trace digest: {report.digest}")
    if args.trace:
        print(f"trace written to {args.trace} (Chrome trace-event JSON; open it in Perfetto)")
    if args.json and args.json != "-":
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def _command_table(commands: list[tuple[str, int]], virtual_ns: int) -> None:
    """Per-command device time, their total and the run's virtual time."""
    from ._out import print_table
    rows: list[tuple[object, ...]] = [(i, op, f"{ns / 1000:.3f}") for i, (op, ns) in enumerate(commands)]
    total = sum(ns for _, ns in commands)
    print_table(("#", "command", "device us"), rows, right=("#", "device us"),
                totals=[("", "total device", f"{total / 1000:.3f}"),
                        ("", "virtual time", f"{virtual_ns / 1000:.3f}")])
