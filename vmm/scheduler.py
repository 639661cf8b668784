"""The machine's event queue and virtual clock.

Everything that happens is an event ordered by (virtual time in ns, sequence number).
There is no wall clock here: time moves only when the earliest event runs or when a
guest is charged for what it does.
"""
from __future__ import annotations

import heapq
from heapq import heappush
from itertools import count
from typing import Any, Callable

from .errors import VmmError


class SchedulerError(VmmError, RuntimeError):
    """The scheduler or the machine's tasks were misused: an event in the past or with a
    negative delay, a skip past a due event, a task spawned late, a wait outside a task."""


class Timer(list[Any]):
    """Handle of one scheduled event, and its entry in the heap: [when, seq, callback,
    label]. Lists order in C by (when, seq), seq being unique, so keeping the heap costs
    no Python call per comparison and an event no __init__. cancel() drops the callback:
    the event is then skipped."""

    __slots__ = ()

    @property
    def when(self) -> int:
        return int(self[0])

    @property
    def seq(self) -> int:
        return int(self[1])

    @property
    def label(self) -> str:
        return str(self[3])

    @property
    def cancelled(self) -> bool:
        return self[2] is None

    def cancel(self) -> None:
        self[2] = None


class Scheduler:
    def __init__(self) -> None:
        self._now = 0
        # The next event's sequence number (1, 2, ...): one C call per event.
        self._next_seq: Callable[[], int] = count(1).__next__
        self._heap: list[Timer] = []
        self.events_run = 0
        self._until: int | None = None  # the bound of the run_until_time in progress
        # Set by the Machine that owns this scheduler: the earliest deadline of a waiting
        # guest (None: none). Without an owner, horizon_ns() is next_event_ns().
        self.deadlines: Callable[[], int | None] | None = None

    def now_ns(self) -> int:
        return self._now

    def schedule_at(self, when: int, callback: Callable[[], None], label: str) -> Timer:
        if when < self._now:
            raise SchedulerError(f"event {label!r} scheduled in the past ({when} < {self._now})")
        timer = Timer((when, self._next_seq(), callback, label))
        heappush(self._heap, timer)
        return timer

    def schedule(self, delay_ns: int, callback: Callable[[], None], label: str) -> Timer:
        if delay_ns < 0:
            raise SchedulerError(f"event {label!r} scheduled with negative delay {delay_ns}")
        # schedule_at inlined (never in the past: delay >= 0)
        timer = Timer((self._now + int(delay_ns), self._next_seq(), callback, label))
        heappush(self._heap, timer)
        return timer

    def _drop_cancelled(self) -> None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)

    def next_event_ns(self) -> int | None:
        self._drop_cancelled()
        return self._heap[0][0] if self._heap else None

    def horizon_ns(self) -> int | None:
        """The earliest virtual time at which anybody but the caller can observe
        anything: the next pending event, the end of a guest's running charge
        (run_until_time) and the deadlines of waiting guests. None: nothing bounds it
        (only events the caller itself schedules come next). Device models carry out
        work that ends no later than this at once (device_model.ports.Clock)."""
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        if self.deadlines is None:
            return heap[0][0] if heap else -1
        h: int | None = heap[0][0] if heap else None
        u = self._until
        if u is not None and (h is None or u < h):
            h = u
        d = self.deadlines()
        if d is not None and (h is None or d < h):
            h = d
        return h

    def run_next(self) -> bool:
        """Run the earliest event; False when there is none."""
        self._drop_cancelled()
        if not self._heap:
            return False
        when, _, callback, _ = heapq.heappop(self._heap)
        self._now = when
        self.events_run += 1
        callback()
        return True

    def run_until_time(self, when: int) -> None:
        """Run every event due at or before `when`, then set the clock to `when`.
        Cancelled entries are dropped as they come due (or reach the front for
        next_event_ns / horizon_ns): none is ever run."""
        outer = self._until
        self._until = when if outer is None or when < outer else outer
        heap = self._heap
        pop = heapq.heappop
        try:
            while heap and heap[0][0] <= when:   # run_next() inlined, for due events
                at, _, callback, _ = pop(heap)
                if callback is not None:
                    self._now = at
                    self.events_run += 1
                    callback()
        finally:
            self._until = outer
        if when > self._now:
            self._now = when

    def advance_to(self, when: int) -> None:
        """Move the clock forward with no event due before `when` (checked)."""
        nxt = self.next_event_ns()
        if nxt is not None and nxt < when:
            raise SchedulerError(f"cannot skip to {when}: an event is due at {nxt}")
        if when > self._now:
            self._now = when
