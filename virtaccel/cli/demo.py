"""`virtaccel demo`: the walking skeleton end to end, from the runtime API to numpy
inside the device model, on one VM with one VA-1 over virtio-mmio."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ..session import Session

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

    with Session(attach="mmio", seed=seed, keep_trace=trace_path is not None) as s:
        times = s.command_times()
        result = s.run(lambda os_: mlp.main(os_, seed=seed), name="mlp")
    if trace_path is not None:
        s.write_trace(trace_path)
    return DemoReport(seed, dict(result), times.commands, s.now_ns(), s.wall_s, s.digest())


def cli(args: argparse.Namespace) -> int:
    report = run_demo(args.seed, getattr(args, "trace", None))
    r = report.result
    print(f"virtaccel demo: two-layer MLP (f32, batch 64, 512 -> 1024 -> 256, GEMM + bias + ReLU x2)")
    print(f"  on one VA-1 over virtio-mmio in one VM, seed {report.seed}")
    print(f"  {'command':<14} {'device time':>14}")
    for opcode, ns in report.commands:
        print(f"  {opcode:<14} {ns / 1000:>11.3f} us")
    total = sum(ns for _, ns in report.commands)
    print(f"  {'total':<14} {total / 1000:>11.3f} us   (virtual time of the run: {report.virtual_ns / 1000:.3f} us)")
    verdict = "OK" if report.ok else "MISMATCH"
    print(f"max abs error vs numpy: {float(r['max_abs_error']):.3e} (atol {ATOL:g})  {verdict}")
    print(f"wall time: {report.wall_s:.3f} s")
    print(f"trace digest: {report.digest}")
    if getattr(args, "trace", None):
        print(f"trace written to {args.trace} (Chrome trace-event JSON; open it in Perfetto)")
    return 0 if report.ok else 1
