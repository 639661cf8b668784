"""`virtaccel demo`: the walking skeleton end to end, from the runtime API to numpy
inside the device model, on one VM with one VA-1 over virtio-mmio."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from vmm.machine import Machine
from vmm.trace import TraceEvent

from ..trace_export import write_chrome_trace
from vmm.vm import Vm

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

    machine = Machine(seed, keep_trace=trace_path is not None)
    vm = Vm(machine, "vm0")
    vm.attach_va1_mmio()
    commands: list[tuple[str, int]] = []

    def on_event(ev: TraceEvent) -> None:
        if ev.kind == "cmd":
            start, end = ev.get("start_ns"), ev.get("end_ns")
            assert isinstance(start, int) and isinstance(end, int)
            commands.append((str(ev.get("opcode")), end - start))

    machine.trace.watch(on_event)
    task = vm.spawn_program(lambda os_: mlp.main(os_, seed=seed), name="mlp")
    wall0 = time.perf_counter()
    machine.run_tasks()
    wall = time.perf_counter() - wall0
    vm.close()
    if task.error is not None:
        raise task.error
    if trace_path is not None:
        write_chrome_trace(machine.trace, trace_path)
    return DemoReport(seed, dict(task.result), commands, machine.now_ns(), wall, machine.trace.digest())


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
