import pytest

from vmm.irq import InterruptController
from vmm.machine import GuestDeadlock, Machine


def test_wait_until_runs_events_until_the_condition_holds():
    m = Machine(seed=1)
    box = []
    m.sched.schedule(500, lambda: box.append(1), "fill")
    assert m.wait_until(lambda: bool(box), 1000, "box") is True
    assert m.now_ns() == 500


def test_wait_until_times_out_in_virtual_time():
    m = Machine(seed=1)
    assert m.wait_until(lambda: False, 2500, "never") is False
    assert m.now_ns() == 2500


def test_wait_forever_with_nothing_pending_is_a_named_deadlock():
    m = Machine(seed=1)
    with pytest.raises(GuestDeadlock, match="waits for the answer forever"):
        m.wait_until(lambda: False, None, "the answer")


def _interleaving(seed):
    m = Machine(seed=seed)
    log = []

    def worker(name):
        def run():
            for i in range(5):
                log.append((name, i, m.now_ns()))
                m.sleep(100)
            return name
        return run

    tasks = [m.spawn(worker(n), n) for n in "abc"]
    m.run_tasks()
    assert all(t.error is None for t in tasks)
    assert [t.result for t in tasks] == ["a", "b", "c"]
    return log


def test_tasks_interleave_deterministically_per_seed():
    first = _interleaving(7)
    assert first == _interleaving(7)
    assert len(first) == 15
    # each task sleeps 100 ns between steps: step i happens at virtual time 100*i
    assert all(t == 100 * i for _, i, t in first)
    assert any(_interleaving(s) != first for s in range(8, 20))


def test_a_task_waiting_forever_gets_a_deadlock_error_once_the_others_end():
    m = Machine(seed=0)
    stuck = m.spawn(lambda: m.wait_until(lambda: False, None, "nothing"), "stuck")
    fine = m.spawn(lambda: m.sleep(10) or "done", "fine")
    m.run_tasks()
    assert fine.error is None and fine.result == "done"
    assert isinstance(stuck.error, GuestDeadlock)


def test_level_interrupt_is_delivered_in_guest_context_and_redelivered_while_high():
    m = Machine(seed=0)
    chip = InterruptController(m, "vm.irq", latency_ns=200)
    line = chip.line(3)
    calls = []

    def handler():
        calls.append(m.now_ns())
        if len(calls) == 2:
            line.set_level(False)

    chip.request_irq(3, handler, "dev")
    m.sched.schedule(1000, lambda: line.set_level(True), "raise")
    assert m.wait_until(lambda: len(calls) == 2, 10_000, "two deliveries")
    assert calls == [1200, 1400]
    assert m.wait_until(lambda: len(calls) > 2, 5000, "no more") is False


def test_interrupts_raised_during_guest_cpu_time_wait_for_the_next_wait():
    m = Machine(seed=0)
    chip = InterruptController(m, "vm.irq", latency_ns=10)
    line = chip.line(0)
    calls = []
    chip.request_irq(0, lambda: (calls.append(m.now_ns()), line.set_level(False)), "dev")
    m.sched.schedule(5, lambda: line.set_level(True), "raise")
    m.charge(1000)  # the guest is busy (an MMIO exit, say): the device event runs, the handler does not
    assert calls == [] and m.now_ns() == 1000
    m.wait_until(lambda: bool(calls), 0, "poll")
    assert calls == [1000]


def test_a_time_limit_ends_waits_that_a_ticking_timer_would_keep_alive():
    """A periodic timer keeps virtual time moving, so a wait that can never end is no
    deadlock; the run's time limit ends it with a named error and a traced wake."""
    from vmm.machine import VirtualTimeLimit
    m = Machine(seed=0, keep_trace=True, time_limit_ns=5_000)

    def tick() -> None:
        m.sched.schedule(m.now_ns() + 100, tick, "tick")
    tick()
    stuck = m.spawn(lambda: m.wait_until(lambda: False, None, "a fence"), "stuck")
    other = m.spawn(lambda: m.wait_until(lambda: False, None, "another"), "other")
    fine = m.spawn(lambda: m.sleep(10) or "done", "fine")
    m.run_tasks()
    assert fine.result == "done"
    for t in (stuck, other):
        assert isinstance(t.error, VirtualTimeLimit), t.error
        assert "virtual-time limit of 5000 ns" in str(t.error)
    assert m.now_ns() <= 5_000
    wakes = [e for e in m.trace.events if e.kind == "wake" and e.get("time_limit") == 5_000]
    assert {e.get("task") for e in wakes} == {"stuck", "other"}


def test_a_time_limit_must_be_positive():
    with pytest.raises(ValueError, match="time_limit_ns must be > 0"):
        Machine(time_limit_ns=0)


def test_a_run_keeps_what_was_built_out_of_the_collectors_full_passes():
    import gc
    m = Machine(seed=1)
    built = [object() for _ in range(10)]
    seen = []
    m.spawn(lambda: seen.append(gc.get_freeze_count()), "t")
    assert gc.get_freeze_count() == 0
    m.run_tasks()
    assert seen and seen[0] >= len(built)       # frozen during the run
    assert gc.get_freeze_count() == 0           # and given back after it


def test_a_run_leaves_a_callers_frozen_heap_frozen():
    import gc
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        m = Machine(seed=1)
        m.spawn(lambda: None, "t")
        m.run_tasks()
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()


def test_wait_until_from_a_thread_that_is_not_the_running_task_is_refused():
    import threading

    from vmm.scheduler import SchedulerError
    m = Machine(seed=0)
    errors = []

    def foreign():
        try:
            m.wait_until(lambda: True, None, "from elsewhere")
        except SchedulerError as e:
            errors.append(str(e))

    def task():
        t = threading.Thread(target=foreign)
        t.start()
        t.join()
        return m.wait_until(lambda: True, None, "from the task")

    ran = m.spawn(task, "t")
    m.run_tasks()
    assert ran.error is None and ran.result is True
    assert errors == ["wait_until called outside the running guest task"]
