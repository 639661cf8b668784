"""The VMM's fast paths: the scheduler's horizon, the trace's canonical encoding, guest
memory's small accesses, and the null round trip's path (events, charges, MMIO, lines)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from vmm.bus import MmioBus
from vmm.guest import GuestMmio
from vmm.irq import InterruptController, Line
from vmm.machine import Machine
from vmm.memory import GuestMemory, GuestMemoryError, HostMemory
from vmm.scheduler import Scheduler
from vmm.trace import Trace, encode_batch


# --- horizon --------------------------------------------------------------------------

def test_horizon_without_owner_is_next_event_or_stop() -> None:
    s = Scheduler()
    assert s.horizon_ns() == -1  # no owner, no event: apply nothing ahead
    s.schedule(7, lambda: None, "e")
    assert s.horizon_ns() == 7


def test_horizon_counts_events_charges_and_guest_deadlines() -> None:
    m = Machine(0)
    s = m.sched
    assert s.horizon_ns() is None  # nobody can look: unbounded
    s.schedule(100, lambda: None, "e")
    assert s.horizon_ns() == 100
    seen: list[int | None] = []
    s.schedule(10, lambda: seen.append(s.horizon_ns()), "probe")
    s.run_until_time(50)  # a guest charged until 50 resumes then
    assert seen == [50]
    seen.clear()
    s.schedule_at(60, lambda: seen.append(s.horizon_ns()), "probe2")
    m.wait_until(lambda: bool(seen), 30, "probe")  # deadline at 80 (from 50)
    assert seen == [80]


def test_device_applies_a_whole_nop_buffer_in_one_event() -> None:
    """With the machine's horizon, a buffer of NOPs runs in one device step (not one
    event per NOP); virtual times are those of one command after another."""
    import userspace_runtime as rt
    from virtaccel import Session

    def run(n: int) -> tuple[int, list[tuple[int, int]], int]:
        session = Session(attach="mmio", seed=3, keep_trace=True).launch()
        machine = session.machine

        def program(os_: object) -> int:
            with rt.Device(os_) as dev:  # type: ignore[arg-type]
                s = dev.create_context().create_stream()
                b = rt.CommandBufferBuilder()
                for _ in range(n):
                    b.nop()
                s.enqueue(b)
                s.synchronize()
                before = machine.sched.events_run
                s.enqueue(b)
                s.synchronize()
                return machine.sched.events_run - before
        with session:
            events: int = session.run(program, name="t")
        spans = [(int(e.get("start_ns")), int(e.get("end_ns")))  # type: ignore[arg-type]
                 for e in machine.trace.events if e.kind == "cmd"]
        return events, spans, len(spans)

    events_1, _, _ = run(1)
    events_n, spans, count = run(200)
    assert count == 400
    assert events_n == events_1  # not one more event per NOP
    for (s0, e0), (s1, _) in zip(spans[200:], spans[201:]):
        assert s1 == e0 and e0 > s0


# --- trace encoding -------------------------------------------------------------------

def test_encoding_depends_on_values_not_object_identity() -> None:
    a = "".join(["vm", "0"])
    b = "".join(["v", "m0"])
    assert a == b and a is not b
    one = [(1, a, "k", {"x": a, "y": a})]
    two = [(1, b, "k", {"x": b, "y": "vm0"})]
    assert encode_batch(one) == encode_batch(two)
    assert encode_batch([(1, "s", "k", {"x": 1})]) != encode_batch([(1, "s", "k", {"x": True})])
    assert encode_batch([(1, "s", "k", {"x": 1, "y": 2})]) != \
        encode_batch([(1, "s", "k", {"y": 2, "x": 1})])  # field order counts


_DIGEST_PROGRAM = """
from vmm.trace import Trace
now = [0]
tr = Trace(lambda: now[0])
src = tr.tracer("dev")
for i in range(5000):
    now[0] = i * 3
    src.emit("cmd", opcode="NOP", offset=i * 8, name="n%d" % (i % 7), f=i / 3, ok=i % 2 == 0,
             none=None, path=(1, "a", (2, 3)))
    tr.emit("machine", "wait", {"task": "t" + str(i % 3), "what": "fence"})
print(tr.digest())
"""


def test_digest_is_the_same_in_every_process() -> None:
    digests = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _DIGEST_PROGRAM], env=env, check=True,
                             capture_output=True, text=True, cwd=os.getcwd())
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_source_tracer_and_trace_emit_hash_alike() -> None:
    def run(direct: bool) -> tuple[str, list[tuple[int, str, str, tuple]]]:  # type: ignore[type-arg]
        tr = Trace(lambda: 5, keep=True)
        if direct:
            tr.emit("dev", "k", {"a": 1, "b": "x"})
        else:
            tr.tracer("dev").emit("k", a=1, b="x")
        return tr.digest(), [(e.t_ns, e.source, e.kind, e.fields) for e in tr.events]
    assert run(True) == run(False)


def test_source_tracer_refuses_nondeterministic_fields() -> None:
    with pytest.raises(TypeError, match="not deterministic"):
        Trace(lambda: 0).tracer("s").emit("bad", obj=object())


# --- guest memory ---------------------------------------------------------------------

def test_small_reads_and_writes_are_bounds_checked() -> None:
    host = HostMemory(1 << 16)
    mem = GuestMemory(host, 0x1000, 0x2000)
    mem.write(0x1000, b"\x01\x02")
    mem.write(0x2ffe, bytearray(b"\x03\x04"))
    mem.write(0x1010, memoryview(b"\x05"))
    mem.write(0x1020, np.array([6, 7], np.uint16))
    assert mem.read(0x1000, 2) == b"\x01\x02"
    assert mem.read(0x2ffe, 2) == b"\x03\x04"
    assert mem.read(0x1010, 1) == b"\x05"
    assert mem.read(0x1020, 4) == b"\x06\x00\x07\x00"
    for gpa, n in ((0xfff, 2), (0x2fff, 2), (0x3000, 1)):
        with pytest.raises(GuestMemoryError):
            mem.write(gpa, bytes(n))
        with pytest.raises(GuestMemoryError):
            mem.read(gpa, n)
    with pytest.raises(GuestMemoryError):
        mem.read(0x1000, -1)
    assert mem.read(0x2ffe, 2) == b"\x03\x04" and mem.read(0x1000, 0) == b""


def test_emit_each_makes_the_same_events_as_emit() -> None:
    rows = [("NOP", 0, 10, 20, 0, 2), ("NOP", 8, 20, 30, 0, 2)]
    names = ("opcode", "offset", "start_ns", "end_ns", "engine", "queue")
    one = Trace(lambda: 7, keep=True)
    seen: list[object] = []
    one.watch(seen.append)
    one.tracer("dev").emit_each("cmd", names, rows)
    two = Trace(lambda: 7, keep=True)
    for row in rows:
        two.tracer("dev").emit("cmd", **dict(zip(names, row)))
    assert one.events == two.events == seen
    assert one.count == two.count == 2
    again = Trace(lambda: 7)
    again.tracer("dev").emit_each("cmd", names, rows)
    other = Trace(lambda: 7)
    other.tracer("dev").emit_each("cmd", names, rows[:1])
    assert other.digest() != again.digest()  # every event counts
    with pytest.raises(TypeError, match="not deterministic"):
        Trace(lambda: 0).tracer("s").emit_each("bad", ("x",), [(object(),)])


def test_guest_dma_fast_checks_fault_like_before() -> None:
    from device_model.ports import DmaFault
    from vmm.dma import GuestDma
    mem = GuestMemory(HostMemory(1 << 16), 0x1000, 0x2000)
    dma = GuestDma(mem)
    dma.write(0x1000, b"ab")
    dma.write(0x1002, np.array([1], np.uint16))
    dma.write(0x1004, memoryview(b"cd"))
    assert dma.read(0x1000, 6) == b"ab\x01\x00cd" and bytes(dma.view(0x1000, 2)) == b"ab"
    dma.probe_view(0x1000, 0x2000)
    for iova, n, reason in ((0xfff, 2, "not backed"), (0x2fff, 2, "not backed"),
                            (1 << 64, 1, "overflows"), (-1, 1, "overflows")):
        for op in (lambda: dma.read(iova, n), lambda: dma.write(iova, bytes(n)),
                   lambda: dma.view(iova, n), lambda: dma.probe_view(iova, n)):
            with pytest.raises(DmaFault, match=reason):
                op()
    assert dma.bytes_written == 6 and dma.bytes_read == 6


def test_guest_dma_ring_views_end_when_a_fault_plan_watches() -> None:
    from vmm.dma import GuestDma

    class Refuse:
        def dma(self, iova: int, length: int, reads: bool, writes: bool) -> str | None:
            return "refused"

    mem = GuestMemory(HostMemory(1 << 16), 0x1000, 0x2000)
    dma = GuestDma(mem)
    view = dma.ring_view(0x1000, 16)
    assert view is not None and dma.view_epoch == 0
    view[0:2] = b"xy"
    assert mem.read(0x1000, 2) == b"xy"   # the same bytes as the guest's
    assert dma.ring_view(0xfff, 16) is None and dma.ring_view(0x2ff8, 16) is None
    dma.fault_hook = Refuse()
    assert dma.view_epoch == 1 and dma.ring_view(0x1000, 16) is None
    dma.fault_hook = None
    assert dma.view_epoch == 2 and dma.ring_view(0x1000, 16) is not None


# --- the null round trip's path through the VMM -----------------------------------------

def test_timer_is_its_heap_entry_and_orders_by_time_then_sequence() -> None:
    s = Scheduler()
    seen: list[str] = []
    late = s.schedule(10, lambda: seen.append("late"), "late")
    first = s.schedule_at(3, lambda: seen.append("first"), "first")
    tie = s.schedule(10, lambda: seen.append("tie"), "tie")   # same time: scheduled later, runs later
    assert (late.when, late.label, first.when, tie.seq - late.seq) == (10, "late", 3, 2)
    assert not first.cancelled
    first.cancel()
    assert first.cancelled and s.next_event_ns() == 10 and s.horizon_ns() == 10
    s.run_until_time(10)
    assert seen == ["late", "tie"] and s.events_run == 2


def test_charge_runs_due_events_at_their_time_and_moves_the_clock() -> None:
    m = Machine(0)
    at: list[int] = []
    m.sched.schedule(30, lambda: at.append(m.now_ns()), "due")
    m.sched.schedule(500, lambda: at.append(m.now_ns()), "later").cancel()
    m.charge(50)
    assert at == [30] and m.now_ns() == 50
    m.charge(100)      # nothing due: the clock only moves
    m.charge(0)
    assert at == [30] and m.now_ns() == 150 and m.sched.events_run == 1


class _Regs:
    def __init__(self) -> None:
        self.log: list[tuple[str, int, int, int]] = []

    def read(self, offset: int, size: int) -> int:
        self.log.append(("r", offset, size, 0))
        return 0x1122334455667788

    def write(self, offset: int, size: int, value: int) -> None:
        self.log.append(("w", offset, size, value))


def _mmio(exit_cost: int = 100) -> tuple[Machine, MmioBus, GuestMmio, _Regs]:
    m = Machine(0, keep_trace=True)
    bus = MmioBus()
    regs = _Regs()
    bus.add(0x1000, 0x100, regs, "regs")
    return m, bus, GuestMmio(m, bus, m.trace.tracer("vm0.cpu"), exit_cost), regs


def test_guest_mmio_claimed_accesses_trap_mask_and_trace_like_the_bus() -> None:
    m, bus, mmio, regs = _mmio()
    for _ in range(2):   # the second access of each is served from the bus's claims
        assert mmio.read(0x1008, 2) == 0x7788
        mmio.write(0x1004, 1, 0x1ff)
    assert (0x1008, 2) in bus.claims and (0x1004, 1) in bus.claims
    assert regs.log == [("r", 8, 2, 0), ("w", 4, 1, 0xff)] * 2
    assert mmio.exits == 4 and m.now_ns() == 400 and bus.unclaimed == []
    assert [(e.kind, e.get("value"), e.get("exit"), e.t_ns) for e in m.trace.events
            if e.kind.startswith("mmio")] == [("mmio_read", 0x7788, True, 0),
                                              ("mmio_write", 0x1ff, True, 100),
                                              ("mmio_read", 0x7788, True, 200),
                                              ("mmio_write", 0x1ff, True, 300)]


def test_guest_mmio_claims_end_when_the_regions_change() -> None:
    m, bus, mmio, regs = _mmio()
    mmio.write(0x1000, 4, 1)
    bus.remove(0x1000)
    assert bus.claims == {}
    assert mmio.read(0x1000, 4) == 0xFFFFFFFF    # no region any more: unclaimed
    mmio.write(0x1000, 4, 2)
    assert [u.reason for u in bus.unclaimed] == ["no region", "no region"]
    other = _Regs()
    bus.add(0x1000, 0x10, other, "other")
    mmio.write(0x1000, 4, 3)
    assert regs.log == [("w", 0, 4, 1)] and other.log == [("w", 0, 4, 3)]


def test_guest_mmio_bad_accesses_are_logged_and_direct_regions_do_not_exit() -> None:
    m = Machine(0)
    bus = MmioBus()
    regs = _Regs()
    bus.add(0x2000, 0x100, regs, "bar", direct=True)
    mmio = GuestMmio(m, bus, m.trace.tracer("vm0.cpu"), 100)
    assert mmio.read(0x2000, 8) == 0x1122334455667788
    mmio.write(0x2000, 3, 5)         # a bad size in a direct region: no exit, logged
    mmio.write(0x20FE, 4, 5)         # straddles the end: no region, an exit
    assert (mmio.direct_accesses, mmio.exits, m.now_ns()) == (2, 1, 100)
    assert [u.reason for u in bus.unclaimed] == ["access size 3 is not 1, 2, 4 or 8",
                                                 "no region"]
    assert (0x2000, 3) not in bus.claims and regs.log == [("r", 0, 8, 0)]


def test_guest_mmio_fault_hook_delays_every_exit() -> None:
    m, bus, mmio, _ = _mmio(exit_cost=100)
    seen: list[tuple[int, int]] = []

    class Delay:
        def exit_delay_ns(self, addr: int, size: int) -> int:
            seen.append((addr, size))
            return 7

    mmio.write(0x1000, 4, 1)
    mmio.fault_hook = Delay()
    mmio.write(0x1000, 4, 1)         # claimed already: the hook still sees it
    mmio.read(0x1010, 4)
    assert seen == [(0x1000, 4), (0x1010, 4)] and m.now_ns() == 100 + 2 * 107


def test_line_fault_hook_sees_every_level_while_installed() -> None:
    chip = InterruptController(Machine(0), "vm0.irq", latency_ns=10)
    line = chip.line(3)
    asked: list[bool] = []

    class Hold:
        def line(self, ln: Line, level: bool) -> bool:
            asked.append(level)
            return False       # defers every level

    line.set_level(True)
    assert line.level
    line.fault_hook = Hold()
    line.set_level(False)
    assert asked == [False] and line.level
    line.apply_level(False)    # the hook applies levels itself, past the check
    assert not line.level and asked == [False]
    line.fault_hook = None
    line.set_level(True)
    assert line.level and asked == [False] and line.fault_hook is None


# --- round 5: emit_plain, the MMIO exit's fast path, the interrupt line ---------------

def test_emit_plain_hashes_keeps_and_batches_like_emit() -> None:
    """emit_plain makes the entry emit makes: the same digest, kept and watched events,
    count, across a full batch, with keep and watchers switched on late."""
    def run(plain: bool) -> tuple[str, int, list[object], list[object]]:
        tr = Trace(lambda: 9)
        src = tr.tracer("s")
        seen: list[object] = []
        for i in range(5000):
            if i == 4100:
                tr.watch(seen.append)
            if i == 4990:
                tr.keep = True
            if plain:
                src.emit_plain("e", {"i": i, "b": i % 2 == 0, "s": "x"})
            else:
                src.emit("e", i=i, b=i % 2 == 0, s="x")
        return tr.digest(), tr.count, tr.events, seen
    fast, slow = run(True), run(False)
    assert fast == slow and fast[1] == 5000 and len(fast[2]) == 10 and len(fast[3]) == 900


def _mmio_trace(mmio: GuestMmio, m: Machine, accesses: list[tuple[object, ...]]) -> list[object]:
    for acc in accesses:
        if len(acc) == 2:
            mmio.read(acc[0], acc[1])  # type: ignore[arg-type]
        else:
            mmio.write(acc[0], acc[1], acc[2])  # type: ignore[arg-type]
    return [(e.t_ns, e.kind, e.fields) for e in m.trace.events if e.kind.startswith("mmio")]


def test_guest_mmio_fast_and_general_paths_agree() -> None:
    """A claimed trapped access (the fast path) and the same access through the general
    path (_read/_write) make the same handler calls, events, times and charges, with an
    event due during the exit run at its time."""
    accesses: list[tuple[object, ...]] = [(0x1008, 2), (0x1004, 1, 0x1ff), (0x1008, 2),
                                         (0x1004, 1, 0x1ff), (0x1010, 8), (0x1010, 8, 3)]
    results = []
    for general in (False, True):
        m, bus, mmio, regs = _mmio()
        if general:
            mmio.read, mmio.write = mmio._read, mmio._write  # type: ignore[method-assign]
        ran: list[int] = []
        m.sched.schedule(150, lambda: ran.append(m.now_ns()), "due")
        events = _mmio_trace(mmio, m, accesses)
        results.append((events, regs.log, ran, m.now_ns(), mmio.exits, m.trace.digest()))
    assert results[0] == results[1]
    assert results[0][2] == [150] and results[0][3] == 600


def test_guest_mmio_fast_path_falls_back_for_unplain_values_and_hooks() -> None:
    """Values not of exact type int go through emit (which checks them); a numpy int is
    traced as the general path traces it; an object is refused with the same error. With
    a fault hook installed a claimed access takes the general path: charged the exit and
    the hook's delay, traced as before."""
    m, bus, mmio, regs = _mmio()
    mmio.write(0x1000, 4, 1)                       # claimed
    mmio.write(0x1000, 4, np.uint32(5))            # claimed, value not an exact int
    ev = [e for e in m.trace.events if e.kind == "mmio_write"]
    assert type(ev[1].get("value")) is np.uint32 and regs.log[-1] == ("w", 0, 4, 5)
    ref, rbus, rmmio, _ = _mmio()
    rmmio._write(0x1000, 4, 1)
    rmmio._write(0x1000, 4, np.uint32(5))
    assert ref.trace.digest() == m.trace.digest()

    class Weird(int):
        pass
    with pytest.raises(TypeError, match="not deterministic"):
        mmio.write(0x1000, 4, object())  # type: ignore[arg-type]
    mmio.write(0x1000, 4, Weird(2))                # an int subclass: checked, allowed
    assert regs.log[-1] == ("w", 0, 4, 2)

    class Delay:
        def exit_delay_ns(self, addr: int, size: int) -> int:
            return 7

    m, bus, mmio, regs = _mmio()
    mmio.fault_hook = Delay()
    mmio.write(0x1004, 1, 0x1ff)
    assert mmio.read(0x1008, 2) == 0x7788
    assert regs.log == [("w", 4, 1, 0xff), ("r", 8, 2, 0)]
    assert mmio.exits == 2 and m.now_ns() == 2 * 107
    ref, _, rmmio, _ = _mmio()
    rmmio.write(0x1004, 1, 0x1ff)
    ref.sched.advance_to(107)
    assert rmmio.read(0x1008, 2) == 0x7788
    assert [(e.t_ns, e.kind, e.fields) for e in m.trace.events] == \
        [(e.t_ns, e.kind, e.fields) for e in ref.trace.events]
    mmio.fault_hook = None
    assert mmio.read(0x1008, 2) == 0x7788 and m.now_ns() == 2 * 107 + 100


def test_guest_mmio_exit_cost_zero_does_not_move_the_clock() -> None:
    m, bus, mmio, _ = _mmio(exit_cost=0)
    mmio.write(0x1000, 4, 1)
    mmio.write(0x1000, 4, 1)
    assert mmio.read(0x1000, 4) == 0x55667788
    assert m.now_ns() == 0 and mmio.exits == 3


def test_line_arms_once_and_traces_irq_line() -> None:
    """A line is armed once while its delivery is scheduled, never without a handler;
    its irq_line events are the ones emit makes (same digest)."""
    m = Machine(0, keep_trace=True)
    chip = InterruptController(m, "vm0.irq", latency_ns=10)
    hits: list[int] = []
    chip.request_irq(2, lambda: hits.append(m.now_ns()), "t")
    line = chip.line(2)
    line.set_level(True)
    line.set_level(False)
    line.set_level(True)            # still scheduled: not armed twice
    assert len([t for t in m.sched._heap if t[2] is not None]) == 1
    chip.line(4).set_level(True)    # no handler: not armed
    assert len([t for t in m.sched._heap if t[2] is not None]) == 1
    start, *lines = m.trace.events
    assert start.kind == "start"
    assert [(e.kind, e.fields) for e in lines] == \
        [("irq_line", (("line", n), ("level", lv)))
         for n, lv in ((2, True), (2, False), (2, True), (4, True))]
    ref = Trace(lambda: 0)
    ref.emit(start.source, start.kind, dict(start.fields))
    for n, lv in ((2, True), (2, False), (2, True), (4, True)):
        ref.tracer("vm0.irq").emit("irq_line", line=n, level=lv)
    assert m.trace.digest() == ref.digest()


def test_wait_events_fall_back_to_emit_for_unplain_names() -> None:
    """A wait whose task name or reason is not an exact str is traced through emit
    (which checks it): a str subclass is allowed, an object refused at the wait."""
    class Name(str):
        pass
    m = Machine(0, keep_trace=True)
    assert m.wait_until(lambda: True, None, Name("w"))
    assert [(e.kind, e.get("what")) for e in m.trace.events[-2:]] == [("wait", "w"),
                                                                       ("wake", "w")]
    assert type(m.trace.events[-1].get("what")) is Name   # kept as given, not copied
    with pytest.raises(TypeError, match="not deterministic"):
        m.wait_until(lambda: True, None, object())  # type: ignore[arg-type]
