"""The VA-1 command processor: runs validated commands with numpy and schedules
submissions on compute units in virtual time (spec §6, §7).

Scheduling: each submit queue runs its submissions in order, one at a time; up to
`num_compute_units` engines run submissions of different queues concurrently; a free
engine takes the next queue with work, round robin.

Virtual-time exactness: a command's effects belong at its end time. The processor
applies a command early only while its end time is <= `clock.next_event_ns()` (no other
event can run in between, so nobody can tell); otherwise it schedules a continuation.
Completions (response, used entry, interrupt) always happen exactly at `end_ns`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hwspec.isa import Activation, DType, EltOp, Opcode
from hwspec.va1 import NO_OFFSET, Status

from ..ports import Clock, DmaFault, DmaPort, Timer, Tracer
from ..virtio.queue import DescriptorChain
from .commands import Command
from .metrics import Metrics
from .ops.activations import apply_activation, gelu64, sigmoid64
from .requests import SubmitRequest

_F32 = np.dtype("<f4")


# --- the math ------------------------------------------------------------------------

def execute(cmd: Command, dma: DmaPort, start_ns: int) -> None:
    """Carry out one validated command. Host accesses may still raise DmaFault (the
    IOMMU mapping may have changed since validation); device views cannot fail."""
    with np.errstate(all="ignore"):  # inf/NaN are data, never an exception
        _execute(cmd, dma, start_ns)


def _execute(cmd: Command, dma: DmaPort, start_ns: int) -> None:
    op = cmd.opcode
    if cmd.run is not None:  # the newer opcodes carry their bound kernel
        cmd.run()
        return
    if op in (Opcode.NOP, Opcode.CALL):  # a CALL's callee commands follow it
        return
    if op == Opcode.GEMM:
        _gemm(cmd)
    elif op == Opcode.ELEMENTWISE:
        _elementwise(cmd)
    elif op == Opcode.FILL:
        assert cmd.dst is not None
        cmd.dst.view("<u4").fill(cmd.value)
    elif op == Opcode.DMA_D2D:
        assert cmd.dst is not None and cmd.src is not None
        cmd.dst[...] = cmd.src  # numpy copies through a temporary when ranges overlap
    elif op == Opcode.DMA_H2D:
        assert cmd.dst is not None
        np.copyto(cmd.dst, dma.view(cmd.host_addr, cmd.size))
    elif op == Opcode.DMA_D2H:
        assert cmd.src is not None
        dma.write(cmd.host_addr, cmd.src)
    elif op == Opcode.SIGNAL:
        dma.write(cmd.host_addr, cmd.value.to_bytes(8, "little"))
    elif op == Opcode.TIMESTAMP:
        dma.write(cmd.host_addr, start_ns.to_bytes(8, "little"))


def _gemm(cmd: Command) -> None:
    a, b, c = cmd.a, cmd.b, cmd.c
    assert a is not None and b is not None and c is not None
    act = cmd.activation
    if (cmd.dtype == DType.F32 and cmd.alpha == 1.0 and cmd.beta == 0.0
            and cmd.bias is None and act in (Activation.NONE, Activation.RELU)):
        # Fast path: BLAS writes straight into device memory.
        np.matmul(a, b, out=c)
        if act == Activation.RELU:
            np.maximum(c, 0, out=c)
        return
    if cmd.dtype == DType.F32:
        t = np.matmul(a, b)
    else:
        t = np.matmul(a.astype(_F32), b.astype(_F32))
    if cmd.alpha != 1.0:
        t *= np.float32(cmd.alpha)
    if cmd.beta != 0.0:
        t += np.float32(cmd.beta) * c.astype(_F32)
    if cmd.bias is not None:
        t += cmd.bias.astype(_F32)
    np.copyto(c, apply_activation(t, act), casting="unsafe")


_BINARY = {EltOp.ADD: np.add, EltOp.MUL: np.multiply, EltOp.SUB: np.subtract,
           EltOp.DIV: np.divide}


def _elementwise(cmd: Command) -> None:
    """One numpy ufunc per command; f16 binary ops round once (numpy computes them in
    f32), GELU and SIGMOID go through f64 and round once to the dtype."""
    a, b, out = cmd.a, cmd.b, cmd.dst
    assert a is not None and out is not None
    if cmd.op == EltOp.RELU:
        np.maximum(a, a.dtype.type(0), out=out)
    elif cmd.op == EltOp.GELU:
        np.copyto(out, gelu64(a), casting="unsafe")
    elif cmd.op == EltOp.SIGMOID:
        np.copyto(out, sigmoid64(a), casting="unsafe")
    else:
        assert b is not None
        _BINARY[EltOp(cmd.op)](a, b, out=out)  # b of shape [cols] broadcasts over rows


# --- scheduling ----------------------------------------------------------------------

@dataclass
class Submission:
    """One submit request on its way through a queue."""
    queue: int                    # virtqueue index
    chain: DescriptorChain
    req: SubmitRequest
    status: Status = Status.OK
    error_offset: int = NO_OFFSET
    start_ns: int = 0
    end_ns: int = 0
    engine: int = -1


@dataclass
class _Run:
    sub: Submission
    slot: int                     # position of the queue in the processor
    cmds: list[Command] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    next: int = 0


Prepare = Callable[[Submission], "tuple[Status, int, list[Command]]"]
Complete = Callable[[Submission], None]


class CommandProcessor:
    """Engines, per-queue FIFOs and the virtual-time runner."""

    def __init__(self, queues: list[int], num_engines: int, dma: DmaPort, clock: Clock,
                 tracer: Tracer, metrics: Metrics, prepare: Prepare,
                 complete: Complete) -> None:
        self.queues = list(queues)
        self.num_engines = num_engines
        self.dma = dma
        self.clock = clock
        self.tracer = tracer
        self.metrics = metrics
        self._prepare = prepare
        self._complete = complete
        self._epoch = 0
        self._timers: dict[int, Timer] = {}
        self._timer_seq = 0
        self.reset()

    def reset(self) -> None:
        """Drop all queued and running work and cancel every pending event."""
        self._epoch += 1
        for t in list(self._timers.values()):
            t.cancel()
        self._timers.clear()
        self.pending: list[deque[Submission]] = [deque() for _ in self.queues]
        self.busy = [False] * len(self.queues)
        self.engines: list[_Run | None] = [None] * self.num_engines
        self._rr = 0
        self._dispatching = False
        self._again = False

    # --- timers ----------------------------------------------------------------------

    def schedule(self, delay_ns: int, callback: Callable[[], None], label: str) -> None:
        """A cancellable event that is dropped by reset()."""
        epoch = self._epoch
        key = self._timer_seq
        self._timer_seq += 1

        def fire() -> None:
            self._timers.pop(key, None)
            if epoch == self._epoch:
                callback()

        self._timers[key] = self.clock.schedule(max(0, delay_ns), fire, label)

    # --- queueing --------------------------------------------------------------------

    def enqueue(self, sub: Submission) -> None:
        self.pending[self.queues.index(sub.queue)].append(sub)

    def take_queued(self, context_id: int) -> list[Submission]:
        """Remove the queued (not started) submissions of a context, in queue order."""
        taken: list[Submission] = []
        for q in self.pending:
            keep = [s for s in q if s.req.context_id != context_id]
            taken.extend(s for s in q if s.req.context_id == context_id)
            q.clear()
            q.extend(keep)
        return taken

    def idle(self) -> bool:
        return all(e is None for e in self.engines) and not any(self.pending)

    def dispatch(self) -> None:
        """Give free engines to queues with work, round robin."""
        if self._dispatching:
            self._again = True
            return
        self._dispatching = True
        try:
            while True:
                self._again = False
                engine = next((i for i, r in enumerate(self.engines) if r is None), None)
                slot = self._next_queue() if engine is not None else None
                if engine is None or slot is None:
                    if not self._again:
                        break
                    continue
                self._start(engine, slot)
        finally:
            self._dispatching = False

    def _next_queue(self) -> int | None:
        n = len(self.queues)
        for i in range(n):
            slot = (self._rr + i) % n
            if self.pending[slot] and not self.busy[slot]:
                self._rr = (slot + 1) % n
                return slot
        return None

    def _start(self, engine: int, slot: int) -> None:
        sub = self.pending[slot].popleft()
        self.busy[slot] = True
        now = self.clock.now_ns()
        sub.start_ns = now
        sub.engine = engine
        run = _Run(sub, slot)
        self.engines[engine] = run
        self.tracer.emit("submit_start", queue=sub.queue, context=sub.req.context_id,
                         fence=sub.req.fence_seq, engine=engine, start_ns=now)
        status, offset, cmds = self._prepare(sub)
        if status != Status.OK:
            sub.status, sub.error_offset, sub.end_ns = status, offset, now
            self._finish(run)
            return
        run.cmds = cmds
        t = now
        for c in cmds:
            t += c.cost_ns
            run.ends.append(t)
        sub.end_ns = t
        self._step(run)

    def _step(self, run: _Run) -> None:
        """Apply every command whose end time nobody can observe yet; then wait."""
        epoch = self._epoch
        now = self.clock.now_ns()
        sub = run.sub
        while run.next < len(run.cmds):
            end = run.ends[run.next]
            if end > now:
                limit = self.clock.next_event_ns()
                if limit is None or end > limit:
                    break
            cmd = run.cmds[run.next]
            start = run.ends[run.next - 1] if run.next else sub.start_ns
            try:
                execute(cmd, self.dma, start)
            except DmaFault as e:
                sub.status, sub.error_offset, sub.end_ns = Status.DMA_FAULT, cmd.offset, end
                self.tracer.emit("cmd_fault", queue=sub.queue, offset=cmd.offset,
                                 reason=e.reason,
                                 **({"path": "/".join(map(str, cmd.path))} if cmd.path else {}))
                run.next = len(run.cmds)
                break
            if epoch != self._epoch:
                return
            self.metrics.commands += 1
            self.metrics.dma_bytes += cmd.host_bytes
            self.tracer.emit("cmd", opcode=cmd.opcode.name, offset=cmd.offset,
                             start_ns=start, end_ns=end, engine=sub.engine, queue=sub.queue,
                             **({"path": "/".join(map(str, cmd.path))} if cmd.path else {}))
            run.next += 1
        if run.next < len(run.cmds):
            self.schedule(run.ends[run.next] - now, lambda: self._step(run), "va1-cmd")
        elif sub.end_ns > now:
            self.schedule(sub.end_ns - now, lambda: self._finish(run), "va1-submit-end")
        else:
            self._finish(run)

    def _finish(self, run: _Run) -> None:
        sub = run.sub
        self.engines[sub.engine] = None
        self.busy[run.slot] = False
        self.metrics.submissions += 1
        self.metrics.device_time_ns += sub.end_ns - sub.start_ns
        self.tracer.emit("submit_end", queue=sub.queue, context=sub.req.context_id,
                         fence=sub.req.fence_seq, status=sub.status.name,
                         error_offset=sub.error_offset, engine=sub.engine,
                         start_ns=sub.start_ns, end_ns=sub.end_ns)
        epoch = self._epoch
        self._complete(sub)
        if epoch == self._epoch:
            self.dispatch()
