"""The guest services' short paths on the null round trip: a guest wait straight into
the machine (the guest_state mark asked only when the wait begins), guest timers that
are their own event callback, the scheduler's run of due events, and the tracers' copy
of the trace's batch limit."""
from __future__ import annotations

from guest_driver.kernel import guest_state
from vmm.guest import GuestMmio, GuestSched, GuestTimer
from vmm.machine import Machine
from vmm.scheduler import Scheduler
from vmm.trace import Trace, TraceEvent


def test_guest_wait_without_domain_declares_nothing() -> None:
    m = Machine(0)
    sched = GuestSched(m)
    flag: list[bool] = []

    def task() -> None:
        sched.start_timer(10, lambda: flag.append(0 in m._declared), "set")
        assert sched.wait_until(guest_state(lambda: bool(flag)), None, "flag")

    m.spawn(task, "t")
    assert [t.error for t in m.run_tasks()] == [None]
    assert flag == [False]          # waiting, and not among the declared waiters
    assert m.wait_until(lambda: True, None, "main") and m.now_ns() == 10


def _waits(m: Machine, sched: GuestSched, marked: bool) -> tuple[list[bool], list[str]]:
    """A task of the kernel's domain waits for a flag its timer sets; another task of
    the same domain looks whether the first is among the domain's declared waiters."""
    dom = sched.domain
    assert dom is not None
    flag: list[bool] = []
    seen: list[bool] = []

    def cond() -> bool:
        return bool(flag)

    def waiter() -> None:
        sched.start_timer(500, lambda: flag.append(True), "set")
        assert sched.wait_until(guest_state(cond) if marked else cond, None, "flag")

    def looker() -> None:
        seen.append(0 in dom.waiting)

    m.spawn(waiter, "waiter", dom)
    m.spawn(looker, "looker", dom)
    tasks = m.run_tasks()
    return seen, [repr(t.error) for t in tasks if t.error is not None]


def test_marked_conditions_are_declared_with_the_kernels_domain_and_others_are_not() -> None:
    for marked in (True, False):
        m = Machine(3)
        sched = GuestSched(m, m.wait_domain("k"))
        seen, errors = _waits(m, sched, marked)
        assert errors == []
        assert seen == [marked]
        assert m.now_ns() >= 500


def test_a_wait_ending_at_its_first_check_never_asks_whether_it_is_declared() -> None:
    m = Machine(0)
    dom = m.wait_domain("k")
    asked: list[object] = []

    def declared(cond: object) -> bool:
        asked.append(cond)
        return True

    def task() -> None:
        assert m.wait_declared(dom, declared, lambda: True, None, "now")
        assert asked == []
        flag: list[bool] = []
        m.sched.schedule(10, lambda: flag.append(True), "later")
        assert m.wait_declared(dom, declared, lambda: bool(flag), None, "later")
        assert len(asked) == 1          # asked once, when the wait began

    m.spawn(task, "t", dom)
    assert [t.error for t in m.run_tasks()] == [None]


def test_guest_timer_fires_once_and_cancel_stops_it_before_or_after_it_fires() -> None:
    m = Machine(0)
    ran: list[str] = []
    t = GuestTimer(m, 100, lambda: ran.append("a"), "a")
    assert not t.cancelled
    m.sched.run_until_time(100)
    assert ran == [] and len(m._pending_irqs) == 1     # fired: pended for the guest
    m._deliver_irqs()
    assert ran == ["a"] and t.cancelled
    t.deliver()
    assert ran == ["a"]                                 # once only

    early = GuestTimer(m, 50, lambda: ran.append("early"), "early")
    early.cancel()
    m.sched.run_until_time(m.now_ns() + 100)
    assert len(m._pending_irqs) == 0

    late = GuestTimer(m, 50, lambda: ran.append("late"), "late")
    m.sched.run_until_time(m.now_ns() + 50)
    assert len(m._pending_irqs) == 1
    late.cancel()                                       # fired, not yet delivered
    m._deliver_irqs()
    assert ran == ["a"]
    assert GuestTimer(m, -5, lambda: None, "neg")._event.when == m.now_ns()


def test_run_until_time_skips_cancelled_events_and_counts_only_those_run() -> None:
    s = Scheduler()
    ran: list[str] = []
    a = s.schedule(10, lambda: ran.append("a"), "a")
    s.schedule(20, lambda: ran.append("b"), "b")
    late = s.schedule(100, lambda: ran.append("late"), "late")
    a.cancel()
    late.cancel()
    s.run_until_time(50)
    assert ran == ["b"] and s.events_run == 1 and s.now_ns() == 50
    assert s.next_event_ns() is None          # the cancelled one is never run
    s.run_until_time(200)
    assert ran == ["b"] and s.events_run == 1 and s.now_ns() == 200
    first = s.schedule(0, lambda: None, "x")
    second = s.schedule(0, lambda: None, "y")
    assert second.seq == first.seq + 1


def test_tracers_made_before_keep_or_watch_follow_them() -> None:
    s = Scheduler()
    tr = Trace(s.now_ns)
    t = tr.tracer("src")
    t.emit_plain("a", {"n": 1})
    assert tr.events == []
    seen: list[TraceEvent] = []
    tr.watch(seen.append)
    t.emit_plain("b", {"n": 2})
    t.emit("c", n=3)
    assert [e.kind for e in seen] == ["b", "c"]
    tr.keep = True
    t.emit_plain("d", {"n": 4})
    assert [e.kind for e in tr.events] == ["d"]
    tr.keep = False
    t.emit_plain("e", {"n": 5})
    assert [e.kind for e in tr.events] == ["d"] and [e.kind for e in seen][-1] == "e"
    tr2 = Trace(s.now_ns)
    t2 = tr2.tracer("src")
    tr2.keep = True
    tr2.keep = False
    t2.emit_plain("f", {"n": 6})
    assert tr2.events == [] and t2._limit == tr2._limit > 1
    assert tr2.count == 1


def test_guest_mmio_fast_path_ends_with_a_fault_hook_and_comes_back_without() -> None:
    from vmm.bus import MmioBus

    class Regs:
        def read(self, offset: int, size: int) -> int:
            return 0x55

        def write(self, offset: int, size: int, value: int) -> None:
            pass

    class Delay:
        def exit_delay_ns(self, addr: int, size: int) -> int:
            seen.append((addr, size))
            return 3

    seen: list[tuple[int, int]] = []
    m = Machine(0, keep_trace=True)
    bus = MmioBus()
    bus.add(0x1000, 0x100, Regs(), "regs")
    mmio = GuestMmio(m, bus, m.trace.tracer("vm0.cpu"), 10)
    mmio.write(0x1000, 4, 1)                    # claimed: the next access is fast
    mmio.fault_hook = Delay()
    assert mmio.fault_hook is not None
    mmio.write(0x1000, 4, 1)
    assert mmio.read(0x1000, 4) == 0x55
    assert seen == [(0x1000, 4), (0x1000, 4)] and m.now_ns() == 10 + 2 * 13
    mmio.fault_hook = None
    mmio.write(0x1000, 4, 1)
    assert seen == [(0x1000, 4), (0x1000, 4)] and m.now_ns() == 10 + 2 * 13 + 10
    assert [e.kind for e in m.trace.events if e.kind.startswith("mmio")] == \
        ["mmio_write", "mmio_write", "mmio_read", "mmio_write"]
