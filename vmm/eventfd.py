"""Real eventfds (os.eventfd) and in-process wake-ups of whoever waits on them.

Why: VFIO signals a device interrupt by writing 1 to an eventfd, and KVM's irqfd turns
that eventfd into a guest interrupt. In one process with deterministic time nothing may
block or poll, so the writer wakes the eventfd's waiters synchronously, as the kernel's
eventfd_signal() runs its wait-queue callbacks. The counter itself is the kernel's: a
waiter reads it with a non-blocking os.eventfd_read.
"""
from __future__ import annotations

import os
from typing import Callable

Waiter = Callable[[int], None]


def new_eventfd() -> int:
    """A non-blocking, close-on-exec eventfd, counter 0."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def is_eventfd(fd: int) -> bool | None:
    """True for an open eventfd, False for another open fd, None for a closed one (what
    eventfd_ctx_fdget tells apart: EINVAL for the second, EBADF for the third)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return "eventfd-count" in f.read()
    except OSError:
        return None


def drain(fd: int) -> int:
    """Read and reset the counter; 0 when nothing was signalled (never blocks)."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


class EventfdWaitQueues:
    """The host kernel's eventfd wait queues: fd -> callbacks run on every signal."""

    def __init__(self) -> None:
        self._waiters: dict[int, list[Waiter]] = {}
        self.signals = 0
        self.errors: list[tuple[int, int]] = []  # (fd, errno) of signals that failed

    def add_waiter(self, fd: int, waiter: Waiter) -> None:
        self._waiters.setdefault(fd, []).append(waiter)

    def remove_waiter(self, fd: int, waiter: Waiter) -> None:
        lst = self._waiters.get(fd, [])
        if waiter in lst:
            lst.remove(waiter)
        if not lst:
            self._waiters.pop(fd, None)

    def signal(self, fd: int, value: int = 1) -> None:
        """eventfd_signal(): add `value` to the counter, then wake the waiters."""
        try:
            os.eventfd_write(fd, value)
        except OSError as e:  # the user closed it: the signal is lost, never raised
            self.errors.append((fd, e.errno or 0))
            return
        self.signals += 1
        for waiter in list(self._waiters.get(fd, ())):
            waiter(fd)


class IrqfdRegistry:
    """KVM irqfd for one VM: an eventfd assigned to a callback that injects a guest
    interrupt. On each wake the counter is read (non-blocking) and, if it was
    non-zero, `inject()` runs once (signals between two reads coalesce, as in KVM)."""

    def __init__(self, waitq: EventfdWaitQueues) -> None:
        self.waitq = waitq
        self._assigned: dict[int, tuple[Callable[[], None], Waiter]] = {}
        self.injections = 0

    def assign(self, fd: int, inject: Callable[[], None]) -> None:
        if fd in self._assigned:
            raise ValueError(f"eventfd {fd} already has an irqfd")

        def wake(fd_: int) -> None:
            if drain(fd_):
                self.injections += 1
                inject()

        self._assigned[fd] = (inject, wake)
        self.waitq.add_waiter(fd, wake)
        wake(fd)  # a signal that came before the assignment is not lost

    def deassign(self, fd: int) -> None:
        entry = self._assigned.pop(fd, None)
        if entry is not None:
            self.waitq.remove_waiter(fd, entry[1])

    def assigned(self) -> tuple[int, ...]:
        return tuple(self._assigned)
