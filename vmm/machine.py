"""The machine: one virtual clock, one seeded RNG, the trace, and the guest tasks.

Guest code is ordinary blocking Python running in guest tasks (threads, of which only
the one holding the baton runs). A task gives up the CPU only inside `wait_until` /
`sleep`; there the waiting task drives the event loop itself and hands the baton to
another task only when one is ready. When several are ready the seeded RNG picks, so the
same seed replays the same interleaving. Interrupt handlers run in the task that is
waiting, between events, never inside an event callback.
"""
from __future__ import annotations

import enum
import random
import threading
from collections import deque
from typing import Any, Callable

from .errors import VmmError
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


class GuestTask:
    def __init__(self, machine: "Machine", name: str, fn: Callable[[], Any]) -> None:
        self.machine = machine
        self.name = name
        self.fn = fn
        self.state = TaskState.NEW
        self.cond: Callable[[], bool] | None = None
        self.deadline: int | None = None
        self.what = ""
        self.deadlocked = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.baton = threading.Event()
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
    """What the interrupt controller queues for delivery in guest context."""

    def deliver(self) -> None:
        raise NotImplementedError


class Machine:
    def __init__(self, seed: int = 0, keep_trace: bool = False,
                 time_limit_ns: int | None = None) -> None:
        if time_limit_ns is not None and time_limit_ns <= 0:
            raise ValueError(f"time_limit_ns must be > 0 (got {time_limit_ns})")
        self.seed = seed
        self.time_limit_ns = time_limit_ns
        self.sched = Scheduler()
        self.rng = random.Random(seed)
        self.trace = Trace(self.sched.now_ns, keep=keep_trace)
        self.trace.emit("machine", "start", {"seed": seed})
        self.tasks: list[GuestTask] = []
        self._current: GuestTask | None = None
        self._pending_irqs: deque[PendingIrq] = deque()
        self._all_done = threading.Event()
        self._running_tasks = False
        self._main_deadline: int | None = None  # wait_until outside any task
        self._time_limited = False   # the deadlock that ended waits was the time limit
        self.sched.deadlines = self._earliest_deadline

    # -- time ------------------------------------------------------------------------
    def now_ns(self) -> int:
        return self.sched.now_ns()

    def charge(self, ns: int) -> None:
        """The running guest spends `ns` of CPU time (an MMIO exit, say). Device events
        due meanwhile run; interrupts they raise wait for the guest's next wait."""
        if ns > 0:
            self.sched.run_until_time(self.sched.now_ns() + ns)

    # -- interrupts ------------------------------------------------------------------
    def pend_irq(self, irq: PendingIrq) -> None:
        self._pending_irqs.append(irq)

    def _deliver_irqs(self) -> None:
        while self._pending_irqs:
            self._pending_irqs.popleft().deliver()

    # -- tasks -----------------------------------------------------------------------
    def spawn(self, fn: Callable[[], Any], name: str) -> GuestTask:
        if self._running_tasks:
            raise SchedulerError("guest tasks must be spawned before run_tasks()")
        task = GuestTask(self, name, fn)
        self.tasks.append(task)
        return task

    def run_tasks(self) -> list[GuestTask]:
        """Run every spawned task to completion; returns them (check .error, .result)."""
        pending = [t for t in self.tasks if t.state is TaskState.NEW]
        if not pending:
            return self.tasks
        self._running_tasks = True
        self._all_done.clear()
        for t in pending:
            t.thread.start()
        first = self._pick_ready(None)
        assert first is not None
        self._hand_to(first)
        self._all_done.wait()
        for t in pending:
            t.thread.join()
        self._running_tasks = False
        return self.tasks

    def _pick_ready(self, exclude: GuestTask | None) -> GuestTask | None:
        now = self.sched.now_ns()
        ready = [t for t in self.tasks if t is not exclude and t.ready(now)]
        if not ready:
            return None
        if len(ready) == 1:
            return ready[0]
        return ready[self.rng.randrange(len(ready))]

    def _hand_to(self, task: GuestTask) -> None:
        self._current = task
        task.baton.set()

    def _earliest_deadline(self) -> int | None:
        best = self._main_deadline
        waiting = TaskState.WAITING
        for t in self.tasks:
            d = t.deadline
            if d is not None and t.state is waiting and (best is None or d < best):
                best = d
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

    def wait_until(self, cond: Callable[[], bool], timeout_ns: int | None, what: str) -> bool:
        now = self.sched.now_ns()
        deadline = None if timeout_ns is None or timeout_ns < 0 else now + int(timeout_ns)
        me = self._current if self._running_tasks else None
        if self._running_tasks and (me is None or threading.current_thread() is not me.thread):
            raise SchedulerError("wait_until called outside the running guest task")
        if me is not None:
            me.cond, me.deadline, me.what, me.state = cond, deadline, what, TaskState.WAITING
        outer_main = self._main_deadline
        if me is None and deadline is not None:
            self._main_deadline = deadline if outer_main is None else min(outer_main, deadline)
        who = me.name if me is not None else "main"
        self.trace.emit("machine", "wait", {"task": who, "what": what,
                                            "timeout": -1 if deadline is None else deadline - now})
        woke = limited = False
        try:
            while True:
                self._deliver_irqs()
                if cond():
                    woke = True
                    return True
                if deadline is not None and self.sched.now_ns() >= deadline:
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
                    continue
                self._step(what, who, deadline)
        except VirtualTimeLimit:
            limited = True
            raise
        finally:
            wake: dict[str, object] = {"task": who, "what": what, "ok": woke}
            if limited:
                wake["time_limit"] = self.time_limit_ns
            self.trace.emit("machine", "wake", wake)
            if me is not None:
                me.state, me.cond, me.deadline = TaskState.RUNNING, None, None
            self._main_deadline = outer_main

    def sleep(self, ns: int) -> None:
        self.wait_until(lambda: False, max(0, int(ns)), "sleep")

    def _finish(self, task: GuestTask) -> None:
        """A task ended: drive time until another task can run, or end the run."""
        while True:
            if all(t.state is TaskState.DONE for t in self.tasks):
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
            except BaseException as exc:  # an event failed with no task to report it
                for t in self.tasks:
                    if t.state is TaskState.WAITING:
                        t.deadlocked = True
                        t.error = exc
