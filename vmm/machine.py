"""The machine: one virtual clock, one seeded RNG, the trace, and the guest tasks.

Guest code is ordinary blocking Python running in guest tasks (threads, of which only
the one holding the baton runs). A task gives up the CPU only inside `wait_until` /
`sleep`; there the waiting task drives the event loop itself and hands the baton to
another task only when one is ready. When several are ready the seeded RNG picks, so the
same seed replays the same interleaving. Interrupt handlers run in the task that is
waiting, between events, never inside an event callback.

Picking the next task does not call every task's condition (that made a machine of n
guests cost O(n) per step). A wait condition is either undeclared (any callable: called
at every pick, as before) or declared with a `WaitDomain`: it reads only state that code
of that domain changes (one guest kernel: its tasks, interrupt handlers and timers). A
domain is "touched" when one of its interrupts or timers is delivered and when one of its
tasks stops running (waits or ends); an interrupt or task with no domain touches every
domain. The machine keeps the tasks known to be ready (new, deadlocked, deadline passed,
declared condition found true and its domain untouched since) in an ordered index set,
and calls at a pick only the conditions of undeclared waits, of touched domains and of
waits just begun. The ready list, in task order, and with it the RNG's pick, is exactly
what a call of every task's ready() would give (`Machine.verify_ready_set` checks that);
the k-th ready task is found by rank and select in O(log n).
"""
from __future__ import annotations

import enum
import gc
import heapq
import random
import threading
from collections import deque
from threading import get_ident
from typing import Any, Callable, ClassVar

from .errors import VmmError
from .index_set import IndexSet
from .scheduler import Scheduler, SchedulerError
from .trace import Trace


class GuestDeadlock(VmmError, RuntimeError):
    """A guest task waits with no timeout, no pending event and no other task to run."""


class VirtualTimeLimit(GuestDeadlock):
    """A guest task waits past the run's virtual-time limit (`Machine.time_limit_ns`):
    a driver whose timers keep time moving while a wait can never end would otherwise
    run forever. Handled as a deadlock: every waiting task's wait raises it."""


class TaskState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"


class WaitDomain:
    """State that only one guest kernel's own code changes (its tasks, interrupt handlers
    and timers). A wait condition declared with it is re-checked only after such code ran.
    `waiting`: indices of the tasks now waiting on a condition of this domain."""

    __slots__ = ("name", "waiting")

    def __init__(self, name: str) -> None:
        self.name = name
        self.waiting: set[int] = set()

    def __repr__(self) -> str:
        return f"WaitDomain({self.name!r})"


class GuestTask:
    def __init__(self, machine: "Machine", name: str, fn: Callable[[], Any], index: int,
                 domain: WaitDomain | None = None) -> None:
        self.machine = machine
        self.name = name
        self.fn = fn
        self.index = index           # position in machine.tasks
        self.domain = domain         # what its code may change (None: anything)
        self.state = TaskState.NEW
        self.cond: Callable[[], bool] | None = None
        self.cond_domain: WaitDomain | None = None   # what cond reads (None: anything)
        self.wait_serial = 0         # which wait a deadline-heap entry belongs to
        self.deadline: int | None = None
        self.what = ""
        self.deadlocked = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.baton = threading.Event()
        self.ident: int | None = None   # its thread's, once it runs
        self.thread = threading.Thread(target=self._main, name=f"guest-{name}", daemon=True)

    def ready(self, now: int) -> bool:
        if self.state is TaskState.DONE:
            return False   # a task that deadlocked and ended never runs again
        if self.state is TaskState.NEW or self.deadlocked:
            return True
        if self.state is not TaskState.WAITING:
            return False
        if self.deadline is not None and now >= self.deadline:
            return True
        assert self.cond is not None
        return bool(self.cond())

    def _main(self) -> None:
        self.ident = get_ident()
        self.baton.wait()
        self.baton.clear()
        self.state = TaskState.RUNNING
        self.machine.trace.emit("machine", "task_start", {"task": self.name})
        try:
            self.result = self.fn()
        except BaseException as exc:  # reported by run_tasks, never lost
            self.error = exc
        self.state = TaskState.DONE
        self.machine.trace.emit("machine", "task_end", {"task": self.name, "ok": self.error is None})
        self.machine._finish(self)


class PendingIrq:
    """What the interrupt controller queues for delivery in guest context. `domain`: the
    guest kernel whose handler runs (None: it may change anything). Empty slots: a
    subclass that declares its own (GuestTimer) has no __dict__, one that does not
    (Line) keeps one."""

    __slots__ = ()
    domain: WaitDomain | None = None

    def deliver(self) -> None:
        raise NotImplementedError


class Machine:
    # Check every pick against a call of every task's ready(); a task the ready set has
    # wrong is put right (the pick is the full scan's) and named in
    # ready_set_violations. For tests: it costs what the ready set saves.
    verify_ready_set: ClassVar[bool] = False
    ready_set_violations: ClassVar[list[str]] = []

    def __init__(self, seed: int = 0, keep_trace: bool = False,
                 time_limit_ns: int | None = None) -> None:
        if time_limit_ns is not None and time_limit_ns <= 0:
            raise ValueError(f"time_limit_ns must be > 0 (got {time_limit_ns})")
        self.seed = seed
        self.time_limit_ns = time_limit_ns
        self.sched = Scheduler()
        self.rng = random.Random(seed)
        self.trace = Trace(self.sched.now_ns, keep=keep_trace)
        self._mtrace = self.trace.tracer("machine")  # wait/wake: on every guest wait
        self.trace.emit("machine", "start", {"seed": seed})
        self.tasks: list[GuestTask] = []
        self._current: GuestTask | None = None
        self._pending_irqs: deque[PendingIrq] = deque()
        # Queue an interrupt (or timer) for delivery at the guest's next wait: the
        # deque's own append (an event callback's one call).
        self.pend_irq: Callable[[PendingIrq], None] = self._pending_irqs.append
        self._all_done = threading.Event()
        self._running_tasks = False
        self._main_deadline: int | None = None  # wait_until outside any task
        self._time_limited = False   # the deadlock that ended waits was the time limit
        self._live = 0               # tasks not DONE
        # The ready set (module docstring): tasks known ready, the candidates whose
        # ready() a pick calls, the declared waiters of every domain, and heaps of
        # (deadline, wait serial, index) of waiting tasks, one to find the earliest, one
        # to find those whose deadline passed.
        self._known_ready = IndexSet()
        self._candidates: set[int] = set()
        self._declared: set[int] = set()
        self._deadlines: list[tuple[int, int, int]] = []
        self._to_pass: list[tuple[int, int, int]] = []
        self._with_deadline = 0      # waiting tasks with a deadline
        self._serial = 0
        self._sleeping = WaitDomain("sleep")   # a sleep's condition never changes
        self.sched.deadlines = self._earliest_deadline

    # -- time ------------------------------------------------------------------------
    def now_ns(self) -> int:
        return self.sched.now_ns()

    def charge(self, ns: int) -> None:
        """The running guest spends `ns` of CPU time (an MMIO exit, say). Device events
        due meanwhile run; interrupts they raise wait for the guest's next wait."""
        if ns > 0:
            sched = self.sched
            when = sched._now + ns
            heap = sched._heap
            if heap and heap[0][0] <= when:
                sched.run_until_time(when)
            else:   # nothing due: what run_until_time(when) would do
                sched._now = when

    # -- interrupts ------------------------------------------------------------------
    def _deliver_irqs(self) -> None:
        pending = self._pending_irqs
        while pending:
            irq = pending.popleft()
            irq.deliver()
            self._touch(irq.domain)

    # -- the ready set ---------------------------------------------------------------
    def wait_domain(self, name: str) -> WaitDomain:
        """A new domain for one guest kernel's waits, tasks and interrupts."""
        return WaitDomain(name)

    def _touch(self, domain: WaitDomain | None) -> None:
        """Code of `domain` (None: of any) ran: its declared waiters are candidates."""
        waiting = self._declared if domain is None else domain.waiting
        if waiting:
            self._candidates |= waiting
            known = self._known_ready
            if known.count:
                for i in waiting:
                    known.discard(i)

    def _compact_deadlines(self) -> None:
        """Drop the entries of waits that ended (heaps of waits long gone stay small)."""
        def live(e: tuple[int, int, int]) -> bool:
            t = self.tasks[e[2]]
            return t.wait_serial == e[1] and t.state is TaskState.WAITING
        self._deadlines = [e for e in self._deadlines if live(e)]
        self._to_pass = [e for e in self._to_pass if live(e)]
        heapq.heapify(self._deadlines)
        heapq.heapify(self._to_pass)

    # -- tasks -----------------------------------------------------------------------
    def spawn(self, fn: Callable[[], Any], name: str,
              domain: WaitDomain | None = None) -> GuestTask:
        """A task running `fn`; `domain`: the guest kernel whose state its code may
        change (None: any, the safe default for host tasks and tests)."""
        if self._running_tasks:
            raise SchedulerError("guest tasks must be spawned before run_tasks()")
        task = GuestTask(self, name, fn, len(self.tasks), domain)
        self.tasks.append(task)
        self._known_ready.add(task.index)
        self._live += 1
        return task

    def run_tasks(self) -> list[GuestTask]:
        """Run every spawned task to completion; returns them (check .error, .result)."""
        pending = [t for t in self.tasks if t.state is TaskState.NEW]
        if not pending:
            return self.tasks
        self._running_tasks = True
        self._all_done.clear()
        self._touch(None)   # whatever ran outside the tasks
        # What the tasks find built (host, cards, guests) lives through the run: frozen,
        # the collector's full passes stop walking it again and again (on a machine of
        # 64 VMs they took about a tenth of the run). Left alone if the caller froze.
        freeze = gc.isenabled() and gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            for t in pending:
                t.thread.start()
            first = self._pick_ready(None)
            assert first is not None
            self._hand_to(first)
            self._all_done.wait()
            for t in pending:
                t.thread.join()
        finally:
            if freeze:
                gc.unfreeze()
            self._running_tasks = False
        return self.tasks

    def _pick_ready(self, exclude: GuestTask | None) -> GuestTask | None:
        """The next task to run: one of the ready tasks but `exclude`, in task order,
        picked by the seeded RNG when there are several (module docstring)."""
        now = self.sched._now
        tasks = self.tasks
        candidates = self._candidates
        known = self._known_ready
        to_pass = self._to_pass
        waiting = TaskState.WAITING
        while to_pass and to_pass[0][0] <= now:
            _, serial, i = heapq.heappop(to_pass)
            t = tasks[i]
            if t.wait_serial == serial and t.state is waiting:
                candidates.add(i)
        # Ready tasks that are not known to stay ready (undeclared waits): this pick only.
        extra: list[int] = []
        order = sorted(candidates) if len(candidates) > 1 else list(candidates)
        for i in order:
            t = tasks[i]
            if t is exclude:
                continue
            if t.ready(now):
                if (t.cond_domain is None and t.state is waiting and not t.deadlocked
                        and (t.deadline is None or now < t.deadline)):
                    extra.append(i)
                    continue
                known.add(i)     # ready until it runs or its domain is touched
            elif t.state is waiting and (t.cond_domain is None or t.deadlocked):
                continue         # undeclared: called again at the next pick
            candidates.discard(i)
        skip = exclude.index if exclude is not None and exclude.index in known else None
        if skip is not None:
            known.discard(skip)
        try:
            if self.verify_ready_set:
                self._verify_skipped(set(order), exclude, now)
            n = len(known) + len(extra)
            if n == 0:
                return None
            if n == 1:
                return tasks[extra[0] if extra else known.select(0)]
            return tasks[self._kth_ready(self.rng.randrange(n), extra)]
        finally:
            if skip is not None:
                known.add(skip)

    def _kth_ready(self, k: int, extra: list[int]) -> int:
        """The index of the k-th task of (known ready | extra) in task order; `extra` is
        sorted and disjoint from the known ready."""
        known = self._known_ready
        for j, e in enumerate(extra):
            pos = known.rank(e) + j
            if k < pos:
                return known.select(k - j)
            if k == pos:
                return e
        return known.select(k - len(extra))

    def _verify_skipped(self, checked: set[int], exclude: GuestTask | None, now: int) -> None:
        """Each task a pick did not call ready() on is known ready exactly when it is
        ready (called here: declared conditions only, which read state and change
        nothing)."""
        known = self._known_ready
        for t in self.tasks:
            if t.index in checked or t is exclude:
                continue
            ready = t.ready(now)
            if ready != (t.index in known):
                self.ready_set_violations.append(
                    f"task {t.name!r} ({t.state.value}, {t.what!r}) is "
                    f"{'' if ready else 'not '}ready but the ready set says otherwise: "
                    f"a condition declared with {t.cond_domain!r} changed without code of "
                    "that domain running")
                if ready:
                    known.add(t.index)
                else:
                    known.discard(t.index)

    def _hand_to(self, task: GuestTask) -> None:
        self._current = task
        task.baton.set()

    def _earliest_deadline(self) -> int | None:
        best = self._main_deadline
        if not self._with_deadline:
            return best   # the heap holds only waits that ended (compaction bounds it)
        heap = self._deadlines
        tasks = self.tasks
        waiting = TaskState.WAITING
        while heap:
            d, serial, i = heap[0]
            t = tasks[i]
            if t.wait_serial == serial and t.state is waiting:
                return d if best is None or d < best else best
            heapq.heappop(heap)
        return best

    def _step(self, what: str, who: str, own_deadline: int | None = None) -> None:
        """Let virtual time move: the next event, or the earliest task deadline."""
        nxt = self.sched.next_event_ns()
        limit = self._earliest_deadline()
        if own_deadline is not None and (limit is None or own_deadline < limit):
            limit = own_deadline
        step_to = nxt if nxt is not None and (limit is None or nxt <= limit) else limit
        cap = self.time_limit_ns
        if cap is not None and step_to is not None and step_to > cap:
            raise VirtualTimeLimit(f"guest task {who!r} waits for {what} past the run's "
                                   f"virtual-time limit of {cap} ns")
        if nxt is not None and (limit is None or nxt <= limit):
            self.sched.run_next()
        elif limit is not None:
            self.sched.advance_to(limit)
        else:
            raise GuestDeadlock(f"guest task {who!r} waits for {what} forever: "
                                f"no event is pending and no other task can run")

    def wait_until(self, cond: Callable[[], bool], timeout_ns: int | None, what: str,
                   domain: WaitDomain | None = None) -> bool:
        """Block until cond() holds (True) or the virtual timeout passes (False).
        `domain`: cond reads only state that code of this domain changes (module
        docstring); None: cond may read anything (device registers, memory a device
        writes, virtual time) and is checked at every pick. A guest kernel's waits come
        through wait_declared, which also says which conditions are declared.

        A task's wait with no deadline that ends at its first check (after the pending
        interrupts are delivered) never reaches a pick: its ready-set bookkeeping
        (`_begin_wait`, `_end_wait`) is done only once the wait has to block. A wait with
        a deadline begins at once: the deadline bounds the horizon devices see."""
        return self.wait_declared(domain, None, cond, timeout_ns, what)

    def wait_declared(self, domain: WaitDomain | None,
                      declared: Callable[[Callable[[], bool]], bool] | None,
                      cond: Callable[[], bool], timeout_ns: int | None, what: str) -> bool:
        """wait_until with the declaration first: `declared`, when given, says whether
        cond is declared with `domain` (asked once the wait begins), else it is
        undeclared. A guest kernel's services bind both with functools.partial
        (positional: a C call, no frame of their own)."""
        now = self.sched._now
        deadline = None if timeout_ns is None or timeout_ns < 0 else now + int(timeout_ns)
        begun = False
        outer_main = None   # the main deadline to restore (a wait outside any task)
        if self._running_tasks:
            me = self._current
            if me is None or get_ident() != me.ident:
                raise SchedulerError("wait_until called outside the running guest task")
            who = me.name
            # What this task did since it last ran (its own index is not among the
            # waiters touched, so this comes first either way).
            self._touch(me.domain)
            if deadline is not None:
                self._begin_wait(me, cond, deadline, what, domain, declared)
                begun = True
        else:
            me = None
            who = "main"
            outer_main = self._main_deadline
            if deadline is not None:
                self._main_deadline = deadline if outer_main is None else min(outer_main,
                                                                              deadline)
        timeout = -1 if deadline is None else deadline - now
        # Exact strs and ints are plain: the tracer need not check them again (-1 is).
        plain = type(who) is str and type(what) is str
        if plain and (deadline is None or type(timeout) is int):
            self._mtrace.emit_plain("wait", {"task": who, "what": what, "timeout": timeout})
        else:
            self._mtrace.emit("wait", task=who, what=what, timeout=timeout)
        woke = limited = False
        try:
            if self._pending_irqs:
                self._deliver_irqs()
            if cond():
                woke = True
                return True
            if me is not None and not begun:
                self._begin_wait(me, cond, deadline, what, domain, declared)
                begun = True
            while True:
                if deadline is not None and self.sched._now >= deadline:
                    return False
                other = self._pick_ready(me)
                if other is not None and me is not None:
                    self._hand_to(other)
                    me.baton.wait()
                    me.baton.clear()
                    if me.deadlocked:
                        if self._time_limited:
                            raise VirtualTimeLimit(f"guest task {me.name!r} waits for {what} "
                                                   "past the run's virtual-time limit of "
                                                   f"{self.time_limit_ns} ns")
                        raise GuestDeadlock(f"guest task {me.name!r} waits for {what} forever")
                else:
                    self._step(what, who, deadline)
                if self._pending_irqs:
                    self._deliver_irqs()
                if cond():
                    woke = True
                    return True
        except VirtualTimeLimit:
            limited = True
            raise
        finally:
            if limited:
                self._mtrace.emit("wake", task=who, what=what, ok=woke,
                                  time_limit=self.time_limit_ns)
            elif plain:
                self._mtrace.emit_plain("wake", {"task": who, "what": what, "ok": woke})
            else:
                self._mtrace.emit("wake", task=who, what=what, ok=woke)
            if begun:
                assert me is not None
                self._end_wait(me)
            if me is None:
                self._main_deadline = outer_main

    def _begin_wait(self, me: GuestTask, cond: Callable[[], bool], deadline: int | None,
                    what: str, domain: WaitDomain | None,
                    declared: Callable[[Callable[[], bool]], bool] | None) -> None:
        """The wait of `me` begins: it leaves the known ready, is a candidate, joins its
        domain's waiters (if cond is declared with it: see wait_declared) and the deadline
        heaps."""
        if declared is not None and domain is not None and not declared(cond):
            domain = None
        me.cond, me.deadline, me.what, me.state = cond, deadline, what, TaskState.WAITING
        me.cond_domain = domain
        self._serial += 1
        me.wait_serial = serial = self._serial
        i = me.index
        if self._known_ready.count:
            self._known_ready.discard(i)
        self._candidates.add(i)
        if domain is not None:
            domain.waiting.add(i)
            self._declared.add(i)
        if deadline is not None:
            self._with_deadline += 1
            heapq.heappush(self._deadlines, (deadline, serial, i))
            heapq.heappush(self._to_pass, (deadline, serial, i))
            if max(len(self._deadlines), len(self._to_pass)) > 2 * self._with_deadline + 64:
                self._compact_deadlines()

    def _end_wait(self, me: GuestTask) -> None:
        """The wait of `me` (begun) ends: it is running again."""
        i = me.index
        if self._known_ready.count:
            self._known_ready.discard(i)
        if me.cond_domain is not None:
            me.cond_domain.waiting.discard(i)
            self._declared.discard(i)
        if me.deadline is not None:
            self._with_deadline -= 1
        me.state, me.cond, me.deadline, me.cond_domain = TaskState.RUNNING, None, None, None

    def sleep(self, ns: int) -> None:
        self.wait_until(lambda: False, max(0, int(ns)), "sleep", self._sleeping)

    def _finish(self, task: GuestTask) -> None:
        """A task ended: drive time until another task can run, or end the run."""
        self._live -= 1
        self._known_ready.discard(task.index)
        self._touch(task.domain)
        while True:
            if self._live == 0:
                self._current = None
                self._all_done.set()
                return
            self._deliver_irqs()
            other = self._pick_ready(task)
            if other is not None:
                self._hand_to(other)
                return
            try:
                self._step("its condition", task.name)
            except GuestDeadlock as e:
                self._time_limited = isinstance(e, VirtualTimeLimit)
                for t in self.tasks:
                    if t.state is TaskState.WAITING:
                        t.deadlocked = True
                        self._candidates.add(t.index)
            except BaseException as exc:  # an event failed with no task to report it
                for t in self.tasks:
                    if t.state is TaskState.WAITING:
                        t.deadlocked = True
                        t.error = exc
                        self._candidates.add(t.index)
