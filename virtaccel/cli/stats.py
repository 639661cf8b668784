"""`virtaccel stats`: run a workload and print per-function and per-context counters.

Two sources, side by side:
- per function, through the uAPI: DRM_IOCTL_VA1_GET_STATS on /dev/accel/accelN from
  inside the guest after the workload (submissions, commands, device time, DMA bytes
  over the host link, faulted contexts, interrupts taken by the driver);
- per function and per context, observed by the host (`StatsCollector`, a trace
  watcher): submissions, commands, device time, faults, interrupts (per function only)
  and queue-depth high-water marks (submissions queued or running on the device,
  sampled at every event of the device; per submit queue and per context).

Bytes moved per context are not observable yet: neither the `cmd` trace event nor the
uAPI carries per-context byte counts (see docs/benchmarks.md, "Stats").
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from vmm.machine import Machine
from vmm.trace import TraceEvent
from vmm.vm import Vm

from ..session import Session

if TYPE_CHECKING:
    from rich.table import Table

_SUBMIT_KINDS = ("submit_start", "submit_end", "cmd", "cmd_fault", "cmd_invalid",
                 "context_fault", "irq")


@dataclass
class ContextStats:
    """Counters of one device context, as the host observes them."""
    function: str
    context: int
    submissions: int = 0
    commands: int = 0
    device_time_ns: int = 0
    faults: int = 0                 # submissions that ended with a non-OK status
    queue_depth_hwm: int = 0        # this context's submissions queued or running, max
    bytes_moved: int | None = None  # not observable yet (needs device/uAPI support)


@dataclass
class FunctionStats:
    """Counters of one device function (host view, and the uAPI's if read)."""
    function: str
    submissions: int = 0
    commands: int = 0
    device_time_ns: int = 0
    faults: int = 0                 # submissions with a non-OK status
    context_faults: int = 0         # contexts marked faulted
    interrupts: int = 0             # interrupts the function raised
    queue_depth_hwm: dict[int, int] = field(default_factory=dict)  # per virtqueue
    uapi: dict[str, int] | None = None  # DRM_IOCTL_VA1_GET_STATS, if read


def _int(ev: TraceEvent, name: str, default: int = 0) -> int:
    value = ev.get(name, default)
    return int(value) if isinstance(value, int) else default


class StatsCollector:
    """Watches a machine's trace and counts per function and per context.

    `add_device(source, device)` lets it sample the device's queues (the VMM owns the
    device object, as a hypervisor owns its emulated devices); without it the
    queue-depth high-water marks stay 0.
    """

    def __init__(self, machine: Machine) -> None:
        self.functions: dict[str, FunctionStats] = {}
        self.contexts: dict[tuple[str, int], ContextStats] = {}
        self._engine_ctx: dict[tuple[str, int], int] = {}
        self._devices: dict[str, Any] = {}
        machine.trace.watch(self._on_event)

    def add_device(self, source: str, device: Any) -> None:
        self._devices[source] = device
        self.function(source)

    def add_vm(self, vm: Vm) -> None:
        """Register every VA-1 attached to `vm` (sources `<vm>.va1.<n>`)."""
        for i, acc in enumerate(vm.accelerators):
            self.add_device(f"{vm.name}.va1.{i}", acc.device)

    def function(self, source: str) -> FunctionStats:
        if source not in self.functions:
            self.functions[source] = FunctionStats(source)
        return self.functions[source]

    def context(self, source: str, cid: int) -> ContextStats:
        key = (source, cid)
        if key not in self.contexts:
            self.contexts[key] = ContextStats(source, cid)
        return self.contexts[key]

    def _on_event(self, ev: TraceEvent) -> None:
        if ev.kind == "ctrl" and ev.get("type") == "CONTEXT_CREATE" and ev.get("status") == "OK":
            self.context(ev.source, _int(ev, "context"))
        if ev.kind not in _SUBMIT_KINDS:
            if ev.source in self._devices:
                self._sample(ev.source)
            return
        if ev.kind == "irq" and "." in ev.source and ev.source.rpartition(".")[2] == "irq":
            return  # the VM's interrupt controller, not a device
        f = self.function(ev.source)
        if ev.kind == "irq":
            f.interrupts += 1
        elif ev.kind == "submit_start":
            self._engine_ctx[(ev.source, _int(ev, "engine", -1))] = _int(ev, "context")
        elif ev.kind == "cmd":
            f.commands += 1
            cid = self._engine_ctx.get((ev.source, _int(ev, "engine", -1)))
            if cid is not None:
                self.context(ev.source, cid).commands += 1
        elif ev.kind == "submit_end":
            c = self.context(ev.source, _int(ev, "context"))
            dt = max(_int(ev, "end_ns") - _int(ev, "start_ns"), 0)
            f.submissions += 1
            c.submissions += 1
            f.device_time_ns += dt
            c.device_time_ns += dt
            if ev.get("status") != "OK":
                f.faults += 1
                c.faults += 1
        elif ev.kind == "context_fault":
            f.context_faults += 1
        self._sample(ev.source)

    def _sample(self, source: str) -> None:
        """Queue depths right now: queued + running submissions per queue and context."""
        dev = self._devices.get(source)
        proc = getattr(dev, "processor", None)
        if proc is None:
            return
        f = self.function(source)
        per_ctx: dict[int, int] = {}
        queues = getattr(proc, "queues", [])
        pending = getattr(proc, "pending", [])
        for slot, q in enumerate(queues):
            waiting = list(pending[slot]) if slot < len(pending) else []
            running = [r.sub for r in getattr(proc, "engines", []) if r is not None
                       and r.sub.queue == q]
            depth = len(waiting) + len(running)
            if depth > f.queue_depth_hwm.get(q, 0):
                f.queue_depth_hwm[q] = depth
            for sub in waiting + running:
                cid = sub.req.context_id
                per_ctx[cid] = per_ctx.get(cid, 0) + 1
        for cid, depth in per_ctx.items():
            c = self.context(source, cid)
            c.queue_depth_hwm = max(c.queue_depth_hwm, depth)

    def to_json(self) -> dict[str, Any]:
        return {"functions": [asdict(f) for f in self.functions.values()],
                "contexts": [asdict(c) for c in self.contexts.values()]}


def run_stats(seed: int = 0) -> tuple[StatsCollector, dict[str, Any]]:
    """Run the demo MLP in one VM, read GET_STATS through the uAPI at the end."""
    from userspace_runtime import Device
    from virtaccel.guests import mlp

    with Session(attach="mmio", seed=seed) as session:
        stats = StatsCollector(session.machine)
        stats.add_vm(session.vm)

        def program(os_: Any) -> dict[str, Any]:
            result = mlp.main(os_, seed=seed)
            with Device(os_) as dev:
                result["uapi_stats"] = dev.stats()
            return result

        result = session.run(program, name="mlp")
    stats.function("vm0.va1.0").uapi = dict(result["uapi_stats"])
    return stats, dict(result)


def stats_tables(stats: StatsCollector) -> list["Table"]:
    """The per-function and per-context tables (uAPI GET_STATS in brackets where read)."""
    from ._out import table

    def both(host: int, u: dict[str, int], key: str) -> str:
        return f"{host}" if key not in u else f"{host} [{u[key]}]"

    frows = []
    for f in stats.functions.values():
        u = f.uapi or {}
        dev_us = f"{f.device_time_ns / 1000:.3f}"
        if "device_time_ns" in u:
            dev_us += f" [{u['device_time_ns'] / 1000:.3f}]"
        hwm = " ".join(f"q{q}:{d}" for q, d in sorted(f.queue_depth_hwm.items())) or "-"
        frows.append((f.function, both(f.submissions, u, "submissions"),
                      both(f.commands, u, "commands"), dev_us, f.faults,
                      both(f.context_faults, u, "faults"), both(f.interrupts, u, "interrupts"),
                      u.get("dma_bytes", "-"), hwm))
    crows = [(c.function, c.context, c.submissions, c.commands,
              f"{c.device_time_ns / 1000:.3f}", c.faults, c.queue_depth_hwm,
              "n/a" if c.bytes_moved is None else c.bytes_moved)
             for c in stats.contexts.values()]
    return [
        table(("function", "subs", "cmds", "device us", "faults", "ctx faults", "irqs",
               "dma bytes", "queue depth hwm"), frows,
              title="per function (host view; uAPI GET_STATS in brackets where read)",
              right=("subs", "cmds", "device us", "faults", "ctx faults", "irqs", "dma bytes")),
        table(("function", "ctx", "subs", "cmds", "device us", "faults", "queue hwm", "bytes"),
              crows, title="per context (host view)",
              right=("ctx", "subs", "cmds", "device us", "faults", "queue hwm", "bytes")),
    ]


def format_stats(stats: StatsCollector) -> str:
    """The tables as plain text (no terminal codes)."""
    import io

    from ._out import console
    buf = io.StringIO()
    con = console(buf)
    for t in stats_tables(stats):
        con.print(t)
    return buf.getvalue().rstrip("\n")


def cli(args: argparse.Namespace) -> int:
    from ._args import check_output
    from ._out import console, wants_json_on_stdout, write_json
    if args.json is not None:
        check_output(args.json, "--json", allow_stdout=True)
    stats, result = run_stats(args.seed)
    if args.json is not None:
        write_json(args.json, stats.to_json())
    if not wants_json_on_stdout(args.json):
        print(f"virtaccel stats: demo MLP, seed {args.seed}, one VM, one VA-1")
        con = console()
        for t in stats_tables(stats):
            con.print(t)
        if args.json:
            print(f"wrote {args.json}")
    return 0 if result.get("ok") else 1
