"""The machine's ready set: picks identical to a call of every task's ready(), at a cost
per pick that does not grow with the number of tasks."""
from __future__ import annotations

import random

import pytest

from guest_driver.kernel import guest_state, reads_guest_state_only
from vmm.index_set import IndexSet
from vmm.irq import InterruptController
from vmm.machine import GuestTask, Machine, TaskState


class FullScanMachine(Machine):
    """The pick as it was: every task's ready(), in task order."""

    def _pick_ready(self, exclude: GuestTask | None) -> GuestTask | None:
        now = self.sched.now_ns()
        ready = [t for t in self.tasks if t is not exclude and t.ready(now)]
        if not ready:
            return None
        if len(ready) == 1:
            return ready[0]
        return ready[self.rng.randrange(len(ready))]


def test_index_set_rank_and_select_match_a_sorted_list():
    rng = random.Random(5)
    s = IndexSet(4)
    ref: set[int] = set()
    for _ in range(3000):
        i = rng.randrange(300)
        if rng.random() < 0.55:
            s.add(i)
            ref.add(i)
        else:
            s.discard(i)
            ref.discard(i)
        srt = sorted(ref)
        assert len(s) == len(srt)
        if srt:
            k = rng.randrange(len(srt))
            assert s.select(k) == srt[k]
        q = rng.randrange(320)
        assert s.rank(q) == sum(1 for x in srt if x < q)
        assert (q in s) == (q in ref)
    assert list(s) == sorted(ref)
    with pytest.raises(IndexError, match="select"):
        s.select(len(ref))
    with pytest.raises(ValueError, match="non-negative"):
        s.add(-1)


def _scenario(machine_cls: type[Machine], seed: int, tasks: int = 12,
              domains: int = 4) -> tuple[list[tuple[str, int, int]], str]:
    """Tasks in several guest kernels wait on declared conditions their interrupts make
    true, on undeclared ones an event makes true, and sleep; the log of who ran when."""
    m = machine_cls(seed=seed, keep_trace=True)
    ev_rng = random.Random(seed + 1000)
    doms = [m.wait_domain(f"vm{d}") for d in range(domains)]
    chips = [InterruptController(m, f"vm{d}.irq", latency_ns=50, domain=doms[d])
             for d in range(domains)]
    flags = [0] * tasks
    box: list[int] = []
    log: list[tuple[str, int, int]] = []
    vectors = []
    for i in range(tasks):
        def handler(i: int = i) -> None:
            flags[i] += 1
        msg = chips[i % domains].alloc_msi(handler, f"t{i}")
        vectors.append(chips[i % domains].msi_vector(msg.data))

    def worker(i: int) -> GuestTask:
        d = i % domains

        def run() -> int:
            for step in range(6):
                want = flags[i] + 1
                vec = vectors[i]
                m.sched.schedule(ev_rng.randrange(1, 2000), vec.raise_, f"raise{i}")
                if i % 3 == 0:
                    m.wait_until(lambda: box.count(i) > step, None, f"box{i}")
                else:
                    m.wait_until(guest_state(lambda: flags[i] >= want), 5000, f"flag{i}",
                                 doms[d] if i % 3 == 1 else None)
                log.append((f"t{i}", step, m.now_ns()))
                if step % 2:
                    m.sleep(ev_rng.randrange(0, 300))
            return i
        return m.spawn(run, f"t{i}", doms[d] if i % 4 else None)

    def feeder() -> None:
        for i in range(tasks):
            if i % 3 == 0:
                box.append(i)
        if any(t.state is not TaskState.DONE for t in ts):
            m.sched.schedule(700, feeder, "feed")

    ts = [worker(i) for i in range(tasks)]
    m.sched.schedule(100, feeder, "feed")
    m.run_tasks()
    for t in ts:
        assert t.error is None, t.error
    return log, m.trace.digest()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_picks_are_those_of_a_full_scan(seed: int):
    log, digest = _scenario(Machine, seed)
    ref_log, ref_digest = _scenario(FullScanMachine, seed)
    assert len(log) == 12 * 6
    assert log == ref_log
    assert digest == ref_digest


def _cond_calls(tasks: int, machine_cls: type[Machine] = Machine) -> int:
    """Condition calls while `tasks` guests, each in its own kernel, wait on declared
    conditions that their own interrupts make true 20 times each."""
    m = machine_cls(seed=3)
    calls = [0]
    per_task = 20
    for i in range(tasks):
        dom = m.wait_domain(f"vm{i}")
        chip = InterruptController(m, f"vm{i}.irq", latency_ns=10, domain=dom)
        done = [0]

        def handler(done: list[int] = done) -> None:
            done[0] += 1
        vec = chip.msi_vector(chip.alloc_msi(handler, "done").data)

        def run(done: list[int] = done, vec=vec, i: int = i, dom=dom) -> None:
            for k in range(per_task):
                m.sched.schedule(100 + 37 * i, vec.raise_, "work")

                def cond(k: int = k, done: list[int] = done) -> bool:
                    calls[0] += 1
                    return done[0] > k
                m.wait_until(guest_state(cond), None, "done", dom)
        m.spawn(run, f"t{i}", dom)
    m.run_tasks()
    return calls[0]


def test_condition_calls_per_task_do_not_grow_with_the_number_of_tasks(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(Machine, "verify_ready_set", False)   # it calls every condition
    small, large = _cond_calls(8) / 8, _cond_calls(64) / 64
    assert large <= 1.25 * small, (small, large)
    # a full scan calls every waiting task's condition at each step
    assert _cond_calls(64, FullScanMachine) / 64 > 5 * large


def test_a_declared_condition_changed_outside_its_domain_is_caught():
    m = Machine(seed=0)
    dom = m.wait_domain("vm0")
    box: list[int] = []
    a = m.spawn(lambda: (m.wait_until(lambda: bool(box), 10_000, "box", dom), m.now_ns()),
                "a", dom)

    def b_run() -> None:
        m.sleep(10)             # a is found not ready here
        m.sched.schedule(5, lambda: box.append(1), "wrong")  # an event, not vm0's code
        m.sleep(100)
    b = m.spawn(b_run, "b", m.wait_domain("vm1"))
    m.run_tasks()
    found = list(Machine.ready_set_violations)
    Machine.ready_set_violations.clear()
    assert a.error is None and b.error is None
    assert a.result == (True, 15)   # the pick was put right: a ran at once
    assert found and "task 'a'" in found[0]
    assert "changed without code of that domain running" in found[0]


def test_guest_state_marks_lambdas_and_wraps_bound_methods():
    f = guest_state(lambda: True)
    assert reads_guest_state_only(f) and f() is True
    assert not reads_guest_state_only(lambda: True)

    class Box:
        full = False

        def ready(self) -> bool:
            return self.full
    box = Box()
    g = guest_state(box.ready)
    assert reads_guest_state_only(g) and g() is False
    box.full = True
    assert g() is True


def test_the_deadline_heaps_stay_small_over_many_ended_waits():
    m = Machine(seed=0)
    dom = m.wait_domain("vm0")
    chip = InterruptController(m, "vm0.irq", latency_ns=10, domain=dom)
    hits = [0]
    vec = chip.msi_vector(chip.alloc_msi(lambda: hits.__setitem__(0, hits[0] + 1), "x").data)

    def run() -> None:
        for k in range(2000):
            m.sched.schedule(10, vec.raise_, "x")
            assert m.wait_until(guest_state(lambda k=k: hits[0] > k), 10**12, "x", dom)
    t = m.spawn(run, "t", dom)
    m.run_tasks()
    assert t.error is None
    assert len(m._deadlines) < 200 and len(m._to_pass) < 200


def _prompt_waits(machine_cls: type[Machine], seed: int) -> tuple[list[tuple[str, int, int]],
                                                                   str, int]:
    """Tasks of two kernels wait, without deadlines, on declared conditions their
    interrupts make true; half the time the interrupt is already pending when the wait
    starts (it then ends at its first check, without ready-set bookkeeping), and a task
    sometimes wakes a sibling of its kernel through shared state."""
    m = machine_cls(seed=seed, keep_trace=True)
    rng = random.Random(seed + 7)
    doms = [m.wait_domain(f"vm{d}") for d in range(2)]
    chips = [InterruptController(m, f"vm{d}.irq", latency_ns=20, domain=doms[d])
             for d in range(2)]
    flags = [0] * 6
    shared = [0, 0]
    log: list[tuple[str, int, int]] = []
    vecs = []
    for i in range(6):
        def handler(i: int = i) -> None:
            flags[i] += 1
        vecs.append(chips[i % 2].msi_vector(chips[i % 2].alloc_msi(handler, f"t{i}").data))

    def worker(i: int) -> GuestTask:
        d = i % 2

        def run() -> None:
            for step in range(8):
                want = flags[i] + 1
                m.sched.schedule(rng.randrange(1, 40), vecs[i].raise_, f"raise{i}")
                if step % 2:
                    m.charge(60)             # the interrupt is pending at the wait
                m.wait_until(guest_state(lambda: flags[i] >= want), None, f"flag{i}",
                             doms[d])
                shared[d] += 1
                if i < 2:
                    seen = shared[d]
                    m.wait_until(guest_state(lambda: shared[d] > seen), None,
                                 f"shared{i}", doms[d])
                log.append((f"t{i}", step, m.now_ns()))
        return m.spawn(run, f"t{i}", doms[d])

    ts = [worker(i) for i in range(6)]
    m.run_tasks()
    errors = [t.error for t in ts if t.error is not None]
    return log, m.trace.digest(), len(errors)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_waits_ending_at_their_first_check_keep_the_picks_of_a_full_scan(seed: int) -> None:
    Machine.ready_set_violations.clear()
    Machine.verify_ready_set = True
    try:
        log, digest, errors = _prompt_waits(Machine, seed)
    finally:
        Machine.verify_ready_set = False
    assert Machine.ready_set_violations == []
    ref_log, ref_digest, ref_errors = _prompt_waits(FullScanMachine, seed)
    assert (log, digest, errors) == (ref_log, ref_digest, ref_errors)
    assert len(log) > 24
