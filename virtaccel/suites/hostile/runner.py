"""Run hostile scenarios: an attacker VM, a victim VM doing checked work, a verdict.

One fresh session per scenario and attachment (VM 0 attacks, VM 1 is the victim; for
"sriov" they hold VF 1 and VF 2 of one card). Three guest tasks run together: the
attacker (the scenario's program on the bare guest kernel, then a reset and a probe of
its function), the victim (`checked_gemm`, its checksums compared with numpy's), and a
watchdog that bounds the whole run in virtual time (and, as a last resort, in wall
time): when the budget runs out it cancels every pending event, so a task waiting
forever ends with GuestDeadlock instead of hanging the process.
"""
from __future__ import annotations

import functools
import random
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from device_model import Va1Config
from guest_driver import GuestDriverError
from userspace_runtime import UserspaceRuntimeError
from vmm.iommu import format_bdf
from vmm.machine import GuestDeadlock, GuestTask, TaskState
from vmm.trace import TraceEvent

from ...session import Session
from ...testing.tenants import check_victim, victim_program
from .core import Attack, Result, Scenario, Setup, Verdict
from .raw import Bump, RawVa1, find_transport, probe_round_trip

VM_MEMORY = 16 << 20
BUDGET_NS = 50_000_000          # virtual time for attack, victim, reset and probe
WALL_LIMIT_S = 60.0             # a scenario whose events run longer than this is halted
VICTIM_COUNT = 4
CANARY = 0x10000                # bytes of each canary range

# What a victim's own driver and runtime raise when its device stops answering: the
# victim stopped (WEDGED), not an exception escaping from somewhere else (FAIL).
_STOPPED = (OSError, GuestDriverError, UserspaceRuntimeError, GuestDeadlock)


@dataclass
class _Run:
    """What the three tasks of one scenario found out."""
    attack: Attack | None = None
    setup_error: str | None = None
    needs_reset: bool = False
    probe_error: str | None = None
    probe_flr: bool = False
    halted: bool = False
    halted_why: str = ""
    observed: list[str] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)
    victim_faults: int = 0


def _sources(session: Session) -> tuple[tuple[str, ...], int | None, int | None]:
    """Trace sources of the attacker's function (and what the VMM emits for it), the
    attacker's and the victim's requester IDs (passthrough only)."""
    att, vic = session.vms[0], session.vms[1]
    srcs: list[str] = []
    rid = vrid = None
    for acc in att.accelerators:
        srcs.append(acc.device.tracer.source)  # type: ignore[attr-defined]
    for pacc in att.pci_accelerators:
        srcs.append(pacc.device.tracer.source)  # type: ignore[attr-defined]
    for p in att.passthrough:
        hf = p.host_function
        rid = hf.requester_id
        tracer = getattr(hf.device, "tracer", None)
        srcs.append(getattr(tracer, "source", None) or f"host.{format_bdf(rid)}")
        srcs.append(p.endpoint.trace.source)
    for v in att.vdpa:
        hf = v.backend.vhost.parent.hf
        rid = hf.requester_id
        tracer = getattr(hf.device, "tracer", None)
        srcs.append(getattr(tracer, "source", None) or f"host.{format_bdf(rid)}")
        srcs.append(getattr(v.frontend.tracer, "source", ""))
    for p in vic.passthrough:
        vrid = p.host_function.requester_id
    for v in vic.vdpa:
        vrid = v.backend.vhost.parent.hf.requester_id
    return tuple(srcs), rid, vrid


def _read_ram(mem: Any, addr: int) -> bytes:
    return bytes(mem.read(addr, CANARY))


def _read_card(cmem: Any, addr: int) -> bytes:
    return bytes(cmem.data[addr:addr + CANARY])


class _Canaries:
    """Seeded patterns where neither the attacker's device nor the victim's driver may
    write: the victim VM's RAM below its kernel's allocator and at its top, and for
    "sriov" the card memory outside both VFs' partitions."""

    def __init__(self, session: Session, seed: int) -> None:
        self.ranges: list[tuple[str, Callable[[], bytes], bytes]] = []
        rng = random.Random(seed ^ 0xCA9A)
        vic = session.vms[1]
        mem = vic.memory
        for name, addr in (("victim RAM (kernel area)", mem.base + 0x1000),
                           ("victim RAM (top)", mem.base + mem.size - CANARY)):
            data = rng.randbytes(CANARY)
            mem.write(addr, data)
            self.ranges.append((name, functools.partial(_read_ram, mem, addr), data))
        card = getattr(session.pf, "device", None) if session.pf is not None else None
        cmem = getattr(card, "memory", None)
        if cmem is not None and hasattr(cmem, "data"):
            taken = [(p.base, p.base + p.device_memory) for p in getattr(card, "partitions", [])]
            spots = [("card memory (PF partition)", getattr(card, "pf_memory", 0) - CANARY),
                     ("card memory (unassigned pool)", int(cmem.size) - CANARY)]
            for name, addr in spots:
                if addr < 0 or any(lo < addr + CANARY and addr < hi for lo, hi in taken):
                    continue
                data = rng.randbytes(CANARY)
                cmem.data[addr:addr + CANARY] = memoryview(data)
                self.ranges.append((name, functools.partial(_read_card, cmem, addr), data))

    def changed(self) -> list[str]:
        return [name for name, read, data in self.ranges if read() != data]


def _halt(session: Session) -> None:
    """Cancel every pending event: the machine goes quiet, and a task that waits with
    no timeout ends with GuestDeadlock (vmm offers no public way; see docs/hostile.md)."""
    for timer in list(getattr(session.machine.sched, "_heap", [])):
        timer.cancel()


def _status_word(ev: TraceEvent) -> str:
    return f"cmd:{ev.get('status')}"


def run_scenario(sc: Scenario, attach: str, seed: int = 0, *, budget_ns: int = BUDGET_NS,
                 victim_count: int = VICTIM_COUNT,
                 wall_limit_s: float = WALL_LIMIT_S) -> Result:
    """Run `sc` on `attach` with pinned seeds; the verdict (never raises for what the
    device or the guests do)."""
    wall0 = time.perf_counter()
    config = Va1Config(**dict(sc.device_config)) if sc.device_config else None
    session = Session(attach=attach, seed=seed, vms=2, memory=VM_MEMORY, config=config)
    session.launch()
    run = _Run()
    try:
        if sc.prepare is not None:
            sc.prepare(session)
        srcs, rid, vrid = _sources(session)
        rid_s = format_bdf(rid) if rid is not None else None
        vrid_s = format_bdf(vrid) if vrid is not None else None

        def mine(source: str) -> bool:
            return any(source == s or source.startswith(s + ".") for s in srcs)

        def watch(ev: TraceEvent) -> None:
            kind = ev.kind
            if kind == "iommu_fault":
                req = ev.get("requester")
                if req == rid_s:
                    run.observed.append("iommu/fault")
                elif req == vrid_s:
                    run.victim_faults += 1
                return
            if not mine(ev.source):
                return
            if kind in ("violation", "ring_broken"):
                run.observed.append(str(ev.get("rule")))
                if kind == "ring_broken":
                    run.fenced.append(str(ev.get("rule")))
            elif kind == "cmd_invalid":
                run.observed.append(_status_word(ev))
            elif kind == "context_fault":
                run.fenced.append(_status_word(ev))
            elif kind == "submit_end" and ev.get("status") not in ("OK", "ABORTED"):
                run.observed.append(_status_word(ev))
            elif kind == "msix_vector_refused":
                run.observed.append("msix/vector-range")

        session.watch(watch)
        canaries = _Canaries(session, seed)
        att_vm = session.vms[0]
        vseed = session.program_seed(1)
        t0 = session.now_ns()

        def attacker(kernel: Any = None) -> None:
            k = att_vm.kernel
            t = find_transport(k)
            alloc = Bump(k.ram.base, k.ram.size)
            dev = RawVa1(k, t, alloc)
            atk = Attack(k, dev, alloc, random.Random(seed * 7919 + zlib.crc32(sc.name.encode())),
                         attach, session)
            run.attack = atk
            if sc.setup is Setup.RAW:
                dev.reset()
            else:
                if not dev.bring_up():
                    run.setup_error = f"bring-up before the attack failed (status {t.status():#x})"
                    return
                atk.ctx = dev.create_context()
                if atk.ctx is None:
                    run.setup_error = "CONTEXT_CREATE before the attack failed"
                    return
            sc.program(atk)
            run.needs_reset = dev.needs_reset()
            t.restore()
            probe = {} if atk.probe_features is None else {"features": atk.probe_features}
            err = probe_round_trip(dev, **probe)
            if err is not None and t.function_reset():
                run.probe_flr = True
                err2 = probe_round_trip(dev, **probe)
                err = None if err2 is None else f"{err}; after FLR: {err2}"
            run.probe_error = err

        if sc.setup is Setup.HOST:
            att_task = session.spawn_host(attacker, name="attacker.vmm")
        else:
            att_task = session.spawn_kernel(attacker, vm=0, name="attacker")
        vic_task = session.spawn(victim_program(vseed, count=victim_count), vm=1, name="victim")

        def watchdog() -> None:
            def over() -> bool:
                return (att_task.state is TaskState.DONE and vic_task.state is TaskState.DONE) \
                    or time.perf_counter() - wall0 > wall_limit_s
            if not session.machine.wait_until(over, budget_ns, "hostile watchdog") or \
                    not (att_task.state is TaskState.DONE and vic_task.state is TaskState.DONE):
                run.halted = True
                late = [n for n, tk in (("attacker", att_task), ("victim", vic_task))
                        if tk.state is not TaskState.DONE]
                run.halted_why = f"{' and '.join(late)} not done after " \
                                 f"{session.now_ns() - t0} ns"
                _halt(session)

        dog = session.spawn_host(watchdog, name="watchdog")
        session.run_tasks()
        result = _judge(sc, attach, run, att_task, vic_task, dog, canaries, vseed)
        result.virtual_ns = session.now_ns() - t0
        if run.attack is not None:
            result.notes = list(run.attack.notes)
    finally:
        session.close()
    result.wall_s = time.perf_counter() - wall0
    return result


def _rule(sc: Scenario, observed: Sequence[str]) -> str:
    if sc.rule in observed or not observed:
        return sc.rule
    return observed[0]


def _err(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


def _from_platform(e: BaseException) -> bool:
    """Was `e` raised inside the device model, the VMM or the guest driver (an escape),
    rather than by the hostile program itself?"""
    frames = traceback.extract_tb(e.__traceback__)
    return any(any(f"/{pkg}/" in f.filename for pkg in ("device_model", "vmm", "guest_driver"))
               for f in frames[1:])


def _judge(sc: Scenario, attach: str, run: _Run, att: GuestTask, vic: GuestTask,
           dog: GuestTask, canaries: _Canaries, vseed: int) -> Result:
    observed = list(dict.fromkeys(run.observed + run.fenced))

    def res(v: Verdict, rule: str, reason: str) -> Result:
        return Result(sc.name, sc.category, attach, v, rule, reason, observed)

    rule = _rule(sc, observed)
    for who, task in (("attacker", att), ("victim", vic), ("watchdog", dog)):
        e = task.error
        if e is None or (run.halted and isinstance(e, GuestDeadlock)):
            continue
        if who == "victim" and isinstance(e, _STOPPED):
            continue   # its driver gave up on its device: the victim stopped (below)
        if who == "attacker" and not _from_platform(e):
            return res(Verdict.FAIL, "harness/program", f"the hostile program raised: {_err(e)}")
        return res(Verdict.FAIL, "isolation/exception",
                   f"exception escaped into the {who}: {_err(e)}")
    changed = canaries.changed()
    if changed:
        return res(Verdict.FAIL, "isolation/memory",
                   f"memory outside the attacker's reach changed: {', '.join(changed)}")
    if run.attack is not None and run.attack.breaches:
        b_rule, msg = run.attack.breaches[0]
        return res(Verdict.FAIL, b_rule, msg)
    if run.halted:
        return res(Verdict.WEDGED, rule, f"hung: {run.halted_why}")
    if vic.error is not None:
        return res(Verdict.WEDGED, rule, f"victim stopped: {_err(vic.error)}")
    if not check_victim(vic.result, vseed):
        statuses = vic.result.get("statuses") if isinstance(vic.result, dict) else None
        return res(Verdict.FAIL, "isolation/victim-result",
                   f"victim's result wrong (statuses {statuses})")
    if run.setup_error is not None:
        return res(Verdict.FAIL, "harness/setup", run.setup_error)
    if run.probe_error is not None:
        return res(Verdict.WEDGED, rule, f"does not come back after reset: {run.probe_error}")
    fenced = run.needs_reset or bool(run.fenced) or any(
        o.startswith("cmd:") or o == "iommu/fault" for o in observed)
    how = "after FLR" if run.probe_flr else "after status 0"
    if fenced:
        why = "NEEDS_RESET" if run.needs_reset else "refused"
        return res(Verdict.REJECT, rule, f"{why} ({', '.join(observed) or 'no rule logged'}); "
                                         f"back {how}")
    return res(Verdict.PASS, rule, f"handled ({', '.join(observed) or 'nothing logged'}); "
                                   f"function works {how}")


@dataclass
class Report:
    """Every result of a run, with what it was run with."""
    seed: int
    attachments: list[str]
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """{attach: {category: {verdict: n}}}."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for r in self.results:
            cat = out.setdefault(r.attach, {}).setdefault(r.category, {})
            cat[r.verdict.value] = cat.get(r.verdict.value, 0) + 1
        return out

    def totals(self) -> dict[str, int]:
        out = {v.value: 0 for v in Verdict}
        for r in self.results:
            out[r.verdict.value] += 1
        return out

    @property
    def ok(self) -> bool:
        return not any(r.verdict.bad for r in self.results)

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "attachments": list(self.attachments),
                "scenarios": len(self.results), "totals": self.totals(),
                "counts": self.counts(), "ok": self.ok, "wall_s": round(self.wall_s, 3),
                "results": [r.as_dict() for r in self.results]}


def run_suite(scenarios: Iterable[Scenario], attachments: Sequence[str], seed: int = 0, *,
              progress: Callable[[Result], None] | None = None,
              **kw: Any) -> Report:
    """Every scenario on every attachment it applies to, in catalogue order."""
    wall0 = time.perf_counter()
    report = Report(seed, list(attachments))
    scs = list(scenarios)
    for attach in attachments:
        for sc in scs:
            if not sc.applies(attach):
                continue
            r = run_scenario(sc, attach, seed, **kw)
            report.results.append(r)
            if progress is not None:
                progress(r)
    report.wall_s = time.perf_counter() - wall0
    return report
