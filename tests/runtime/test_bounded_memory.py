"""Memory stays bounded over many submissions: completed fences and submission results
are released once observed (tracemalloc counts Python allocations; no timing here)."""
from __future__ import annotations

import gc
import tracemalloc

import userspace_runtime as rt
from userspace_runtime._stream import SUBMISSION_HISTORY
from virtaccel.session import Session

WARMUP = SUBMISSION_HISTORY + 256   # the results window is full after it
FIRST, SECOND = 1500, 6000


def _traced_after(counts: tuple[int, ...]) -> list[int]:
    """Traced bytes after WARMUP and after each of `counts` more one-NOP submissions
    (each its own submission, synchronized every 64)."""
    out: list[int] = []
    session = Session(attach="mmio")

    def traced() -> int:
        session.machine.trace.digest()   # hashes the trace's pending batch (bounded)
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    def program(os_) -> None:
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            nop = rt.CommandBufferBuilder()
            nop.nop()

            def submit(n: int) -> None:
                for i in range(n):
                    s.enqueue(nop)
                    s.flush()
                    if i % 64 == 63:
                        s.synchronize()
                s.synchronize()

            submit(WARMUP)
            tracemalloc.start(1)
            try:
                out.append(traced())
                done = 0
                for n in counts:
                    submit(n - done)
                    done = n
                    out.append(traced())
            finally:
                tracemalloc.stop()
            assert len(s.submissions) == SUBMISSION_HISTORY and s.submissions[-1].ok
            ctx.destroy()

    with session:
        session.run(program)
    return out


def test_memory_per_submission_does_not_grow():
    base, first, second = _traced_after((FIRST, SECOND))
    per_sub = (second - first) / (SECOND - FIRST)
    # before fences and results were released: about 700 bytes per submission
    assert per_sub < 16, (base, first, second, per_sub)


def test_a_fence_read_once_is_released_and_a_later_wait_still_answers_ok():
    def program(os_) -> tuple[object, object, int, int]:
        with rt.Device(os_) as dev:
            ctx = dev.create_context()
            s = ctx.create_stream()
            nop = rt.CommandBufferBuilder()
            nop.nop()
            s.enqueue(nop)
            fence = s.flush()
            s.synchronize()
            first = s.submissions[-1]
            again = s._drv.wait(ctx.id, fence, 0)      # its record is gone by now
            kctx = os_.files[-1]._contexts[ctx.id]   # the driver's side of the context
            left, last = len(kctx.timeline.fences), kctx.timeline.last_seq
            ctx.destroy()
            return first, again, left, last
    with Session(attach="mmio") as session:
        first, again, left, last = session.run(program)
    assert first.ok and first.end_ns > first.start_ns
    assert again is not None and again.status == 0 and again.start_ns == again.end_ns == 0
    assert left == 0 and last == 1
