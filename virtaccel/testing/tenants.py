"""The multi-tenant test kit: a host with one VA-1 card, N VFs assigned to N VMs by VFIO,
each VM running a tenant program; per-VF measurements from the trace.

    bed = TenantBed(4, seed=7, resources=[VfResources(weight=w) for w in (1, 2, 4, 8)])
    results = bed.run([victim_program(seed) for ...])       # one program per VM
    bed.monitor.functions[1].device_ns                       # VF 1's device time

Why: every isolation and fairness claim is about one tenant's effect on the others, so
the same bed (one card, its VFs, one VM per VF, all guest tasks on one machine and one
virtual clock) serves fairness runs, latency runs and attack runs.

Per-VF observations come from the device's own trace (its per-function source, the
VF's requester ID): `submit_end` (queue, context, fence, status, start_ns, end_ns) and
`cmd` (start_ns, end_ns) events, aggregated as they happen (no trace is kept).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from device_model import Va1Config
from vmm.host import CardFactory, Host, HostPciFunction, PfDriverFactory
from vmm.iommu import format_bdf
from vmm.machine import GuestTask, Machine
from hwspec.va1 import VfResources
from vmm.trace import TraceEvent
from vmm.vm import Vm

from ..errors import LaunchError
from ..guests.tenant import checked_gemm, expected_checksums
from ..session import Session, VmSpec, tenant_seed

Program = Callable[[Any], Any]   # os -> result


def _int(value: object) -> int:
    """A trace field that holds an integer."""
    if not isinstance(value, int):
        raise TypeError(f"trace field {value!r} is not an integer")
    return value


def percentile(values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile (q in 0..100) of integers; 0 for none."""
    if not values:
        return 0
    xs = sorted(values)
    rank = min(len(xs), max(1, math.ceil(q * len(xs) / 100)))
    return int(xs[rank - 1])


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 is perfectly fair."""
    s, s2 = sum(xs), sum(x * x for x in xs)
    return (s * s) / (len(xs) * s2) if s2 > 0 else 1.0


@dataclass
class FunctionStats:
    """What one function (PF = 0, VF n = n) did, as its trace says."""
    source: str
    submissions: int = 0
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    device_ns: int = 0            # command time inside the monitor window
    commands: int = 0
    last_end_ns: int = 0
    end_times: list[int] = field(default_factory=list)
    intervals: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each cmd

    def device_ns_in(self, lo: int, hi: int) -> int:
        """Command time inside [lo, hi) (needs the monitor's keep_intervals)."""
        return sum(max(0, min(e, hi) - max(s, lo)) for s, e in self.intervals)


class FunctionMonitor:
    """Watches a machine's trace and aggregates per function (by trace source)."""

    def __init__(self, machine: Machine, sources: dict[str, int],
                 window: tuple[int, int] | None = None, keep_intervals: bool = False) -> None:
        self.sources = dict(sources)
        self.window = window
        self.keep_intervals = keep_intervals
        self.functions: dict[int, FunctionStats] = {i: FunctionStats(s) for s, i in sources.items()}
        machine.trace.watch(self._event)

    def add_source(self, source: str, index: int) -> None:
        self.sources[source] = index
        self.functions.setdefault(index, FunctionStats(source))

    def _index(self, source: str) -> int | None:
        i = self.sources.get(source)
        if i is None and "." in source:  # a sub-source of a function (e.g. "host.01:00.1.q2")
            for s, j in self.sources.items():
                if source.startswith(s + "."):
                    return j
        return i

    def _event(self, e: TraceEvent) -> None:
        if e.kind not in ("cmd", "submit_end"):
            return
        i = self._index(e.source)
        if i is None:
            return
        f = self.functions[i]
        if e.kind == "cmd":
            start, end = _int(e.get("start_ns", 0)), _int(e.get("end_ns", 0))
            if self.keep_intervals:
                f.intervals.append((start, end))
            if self.window is not None:
                start, end = max(start, self.window[0]), min(end, self.window[1])
            if end > start:
                f.device_ns += end - start
            f.commands += 1
            return
        f.submissions += 1
        status = str(e.get("status", ""))
        end = _int(e.get("end_ns", 0))
        f.last_end_ns = max(f.last_end_ns, end)
        f.end_times.append(end)
        if status == "OK":
            f.ok += 1
        else:
            f.failed[status] = f.failed.get(status, 0) + 1


@dataclass
class TenantResult:
    """One tenant VM's run."""
    index: int                    # VF number, 1-based
    vm: str
    result: Any
    error: BaseException | None

    @property
    def ok(self) -> bool:
        return self.error is None and isinstance(self.result, dict) and self.result.get("ok") is True


class TenantBed:
    """A host, one card with `n` VFs (each provisioned with its resources and bound to
    vfio-pci), and one VM per VF with the VF assigned by VFIO passthrough."""

    def __init__(self, n: int, *, seed: int = 0,
                 resources: Sequence[VfResources] | VfResources | None = None,
                 memory: int = 16 << 20, card_config: Va1Config | None = None,
                 card_factory: CardFactory | None = None,
                 pf_driver_factory: PfDriverFactory | None = None,
                 window: tuple[int, int] | None = None, keep_trace: bool = False,
                 keep_intervals: bool = False, **card_options: Any) -> None:
        self.seed = seed
        if isinstance(resources, VfResources):
            resources = [resources] * n
        self.resources = list(resources) if resources is not None else None
        specs = [VmSpec(f"tenant{i}", memory, self.resources[i - 1] if self.resources else None)
                 for i in range(1, n + 1)]
        self.session = Session(attach="sriov", seed=seed, vms=specs, config=card_config,
                               keep_trace=keep_trace, card_factory=card_factory,
                               pf_driver_factory=pf_driver_factory, card_options=card_options)
        try:
            self.session.launch()
        except LaunchError as e:
            raise e.__cause__ or e
        self.machine = self.session.machine
        host = self.session.host
        assert host is not None and self.session.pf is not None
        self.host: Host = host
        self.pf: HostPciFunction = self.session.pf
        self.vfs = self.session.vfs
        self.vms: list[Vm] = self.session.vms
        self.monitor = FunctionMonitor(
            self.machine, {f"{self.host.name}.{format_bdf(vf.requester_id)}": vf.vf_index or 0
                           for vf in self.vfs}, window, keep_intervals)
        self.monitor.add_source(f"{self.host.name}.{format_bdf(self.pf.requester_id)}", 0)
        self.tasks: list[GuestTask] = []
        self.closed = False

    def __enter__(self) -> "TenantBed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def vm(self, vf: int) -> Vm:
        return self.vms[vf - 1]

    def vf(self, vf: int) -> HostPciFunction:
        return self.vfs[vf - 1]

    def pf_driver(self) -> Any:
        return self.host.pf_driver(self.pf)

    def spawn(self, vf: int, program: Program, name: str | None = None) -> GuestTask:
        task = self.session.spawn(program, vm=vf - 1, name=name or f"tenant{vf}")
        self.tasks.append(task)
        return task

    def spawn_host(self, fn: Callable[[], Any], name: str = "host") -> GuestTask:
        """A host task (e.g. PF management while tenants run)."""
        task = self.session.spawn_host(fn, name)
        self.tasks.append(task)
        return task

    def run(self, programs: Sequence[Program | None] | None = None) -> list[TenantResult]:
        """Spawn programs[i] in VM i+1 (None: nothing there), run every task to the end."""
        if programs is not None:
            if len(programs) != len(self.vms):
                raise ValueError(f"{len(programs)} programs for {len(self.vms)} tenant VMs")
            for i, prog in enumerate(programs, start=1):
                if prog is not None:
                    self.spawn(i, prog)
        self.session.run_tasks()
        out = []
        for t in self.tasks:
            if t.name.startswith("tenant"):
                idx = int(t.name[len("tenant"):].split(".")[0] or 0)
                out.append(TenantResult(idx, t.name, t.result, t.error))
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.session.close()


# -- programs ------------------------------------------------------------------------------

def victim_program(seed: int, **kw: Any) -> Program:
    """A closed-loop checked-GEMM tenant (see virtaccel.guests.tenant.checked_gemm)."""
    if not kw.get("duration_ns"):
        kw.setdefault("count", 8)
    return lambda os_: checked_gemm(os_, seed, **kw)


def check_victim(result: Any, seed: int) -> bool:
    """Host side: every submission OK and every checksum is numpy's."""
    if not isinstance(result, dict) or result.get("ok") is not True:
        return False
    m, k, n = result["shape"]
    sums = result["checksums"]
    return bool(sums) and sums == expected_checksums(seed, len(sums), m, k, n)


@dataclass
class AttackOutcome:
    attacker: TenantResult
    victims: list[TenantResult]
    victims_correct: list[bool]
    bed: TenantBed

    @property
    def all_victims_correct(self) -> bool:
        return all(self.victims_correct) and len(self.victims_correct) == len(self.victims)


def run_attack(bed: TenantBed, attacker_vf: int, attacker: Program,
               victim_kw: dict[str, Any] | None = None) -> AttackOutcome:
    """Run `attacker` in VF `attacker_vf`'s VM and a checked victim in every other VM;
    check every victim's checksums against numpy."""
    seeds = {vf.vf_index: tenant_seed(bed.seed, vf.vf_index or 0) for vf in bed.vfs}
    programs: list[Program | None] = []
    for vf in bed.vfs:
        n = vf.vf_index or 0
        programs.append(attacker if n == attacker_vf else victim_program(seeds[n], **(victim_kw or {})))
    results = bed.run(programs)
    att = next(r for r in results if r.index == attacker_vf)
    vics = [r for r in results if r.index != attacker_vf]
    return AttackOutcome(att, vics, [check_victim(r.result, seeds[r.index]) for r in vics], bed)
