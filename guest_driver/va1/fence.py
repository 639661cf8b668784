"""Fences: one per submission, numbered 1, 2, ... per context, signalled exactly once.

A fence is signalled by the submit queue's completion (device response), or by the
driver with ABORTED when the device is reset with the submission in flight. Whatever
comes second is ignored and counted, so "exactly once" is checkable.
"""
from __future__ import annotations

from typing import Callable

from hwspec.va1 import NO_OFFSET, Status

from ..kernel import GuestStateCondition, Tracer, plain_emitter


class Fence(GuestStateCondition):
    """One submission's fence. Called, it says whether it is signalled: a fence is its
    own wait condition, set only by the driver's interrupt path (guest state). Made on
    every submission: a slotted class built from positional arguments."""

    __slots__ = ("context", "seq", "queue", "signalled", "status", "error_offset",
                 "start_ns", "end_ns", "callbacks")

    def __init__(self, context: int, seq: int, queue: int,
                 callbacks: list[Callable[["Fence"], None]] | None = None) -> None:
        self.context = context   # uAPI context id
        self.seq = seq
        self.queue = queue
        self.signalled = False
        self.status = 0
        self.error_offset = NO_OFFSET
        self.start_ns = 0
        self.end_ns = 0
        self.callbacks: list[Callable[[Fence], None]] = [] if callbacks is None else callbacks

    def __repr__(self) -> str:
        return (f"Fence(context={self.context}, seq={self.seq}, queue={self.queue}, "
                f"signalled={self.signalled}, status={self.status})")

    def __call__(self) -> bool:
        return self.signalled

    def add_callback(self, cb: Callable[["Fence"], None]) -> None:
        """Run cb at signal time (interrupt context: must not wait), or now if signalled."""
        if self.signalled:
            cb(self)
        else:
            self.callbacks.append(cb)


class FenceTimeline:
    """Per-context sequence numbers and the record of every fence issued on it."""

    def __init__(self, context: int, tracer: Tracer) -> None:
        self.context = context
        self.tracer = tracer
        self._emit_plain = plain_emitter(tracer, context)
        self.last_seq = 0
        self.fences: dict[int, Fence] = {}
        self.double_signals = 0

    def next(self, queue: int, on_done: Callable[[Fence], None] | None = None) -> Fence:
        """The next fence of this context on `queue` (`on_done` its first callback)."""
        self.last_seq = seq = self.last_seq + 1
        fence = Fence(self.context, seq, queue, None if on_done is None else [on_done])
        self.fences[seq] = fence
        return fence

    def unissue(self, fence: Fence) -> None:
        """Take back the newest fence when its submission could not be queued at all."""
        assert fence.seq == self.last_seq and not fence.signalled
        del self.fences[fence.seq]
        self.last_seq -= 1

    def get(self, seq: int) -> Fence | None:
        return self.fences.get(seq)

    def release(self, fence: Fence) -> None:
        """Forget a fence whose OK result was read (WAIT), so that a context's records
        do not grow with every submission. A failed or aborted fence stays, for later
        WAITs to report its status."""
        if fence.signalled and fence.status == Status.OK:
            self.fences.pop(fence.seq, None)

    def released(self, seq: int) -> bool:
        """Whether `seq` was issued here and released: signalled OK and read."""
        return 0 < seq <= self.last_seq and seq not in self.fences

    def signal(self, fence: Fence, status: int, error_offset: int = NO_OFFSET,
               start_ns: int = 0, end_ns: int = 0) -> bool:
        """Signal once; a second signal is ignored (returns False)."""
        if fence.signalled:
            self.double_signals += 1
            return False
        fence.signalled = True
        fence.status = status = int(status)
        fence.error_offset = error_offset
        fence.start_ns = start_ns
        fence.end_ns = end_ns
        # plain: the context fixed at construction, a seq this timeline numbered, int()
        self._emit_plain("fence_signal", {"context": self.context, "fence": fence.seq,
                                          "status": status})
        cbs, fence.callbacks = fence.callbacks, []
        for cb in cbs:
            cb(fence)
        return True

    def abort_all(self) -> int:
        """Signal every unsignalled fence ABORTED; return how many."""
        n = 0
        for fence in list(self.fences.values()):
            if not fence.signalled:
                self.signal(fence, Status.ABORTED)
                n += 1
        return n

    @property
    def pending(self) -> int:
        return sum(1 for f in self.fences.values() if not f.signalled)
