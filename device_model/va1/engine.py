"""The VA-1 command processor: runs validated commands with numpy and schedules
submissions on compute units in virtual time (spec §6, §7).

Scheduling: each submit queue runs its submissions in order, one at a time; the card's
compute units (engines, shared by all functions: scheduler.py) run submissions of
different queues concurrently; a function given a free engine takes its next queue with
work, round robin. A run may be preempted at a command boundary (scheduler.py) and then
resumes at its next command; a command longer than the function's preemption timeout
stops at the timeout and fails its submission with TIMEOUT; WAIT polls in virtual time.

Virtual-time exactness: a command's effects belong at its end time. The processor
applies a command early only while its end time is <= the clock's horizon (`horizon_ns()`
when the clock has one: next event, end of a running guest's charge, deadlines of
waiting guests; else `next_event_ns()`): nobody can look in between, so nobody can tell.
Otherwise it schedules a continuation. A command that writes guest memory (`host_writes`
in the registry: SIGNAL, TIMESTAMP, DMA_D2H) is never applied early: a waiting guest's
condition is evaluated after every event, so it could poll that memory before the
command's end; such a command is applied by an event at its end time.
Completions (response, used entry, interrupt) always happen exactly at `end_ns`.

Failures: a command whose executor raises anything but DmaFault (a numpy MemoryError, a
bug) fails its submission with DEVICE_ERROR at its offset, like any command error. Any
other exception inside the processor's events or dispatch is caught at the function's
boundary (`failed`): the function alone is stopped (its owner sets NEEDS_RESET) and its
engines are released. Nothing raises into the platform, whose event may belong to
another function or another tenant's guest.
"""
from __future__ import annotations

from collections import deque
from functools import partial
from operator import attrgetter
from typing import Callable, Sequence

import numpy as np

from hwspec import isa
from hwspec.isa import Opcode
from hwspec.va1 import NO_OFFSET, Status

from ..ports import Clock, DmaFault, DmaPort, Timer, Tracer, plain_emitter
from ..testing_breaks import BREAKS
from ..virtio.ring import DescriptorChain
from .commands import OPS, Command
from .metrics import Metrics
from .requests import SubmitRequest
from .scheduler import FunctionSched, Scheduler

_OPNAME = {op: op.name for op in Opcode}
_STATUS_NAME = {s: s.name for s in Status}
_OPCODE_OF = attrgetter("opcode")
# Read from the registry once: the step loop asks for every command.
_POLLS = frozenset(op for op, spec in OPS.items() if spec.polls)
_TIME_ONLY = frozenset(op for op, spec in OPS.items() if spec.time_only)
_HOST_WRITES = frozenset(op for op, spec in OPS.items() if spec.host_writes)
# A submission's last command, when it is a big one (virtual cost at least this), is
# applied at its end time together with the completion instead of early: see _step.
_DEFER_LAST_MIN_NS = 10_000
_CMD_FIELDS = ("opcode", "offset", "start_ns", "end_ns", "engine", "queue")


# --- scheduling ----------------------------------------------------------------------

class Submission:
    """One submit request on its way through a queue. One is made per request: the
    fields after `req` start at their class defaults, so construction sets three."""

    queue: int                    # virtqueue index
    chain: DescriptorChain
    req: SubmitRequest
    status: Status = Status.OK
    error_offset: int = NO_OFFSET
    start_ns: int = 0
    end_ns: int = 0
    engine: int = -1

    def __init__(self, queue: int, chain: DescriptorChain, req: SubmitRequest) -> None:
        self.queue = queue
        self.chain = chain
        self.req = req

    def __repr__(self) -> str:
        return (f"Submission(queue={self.queue}, req={self.req}, status={self.status.name}, "
                f"engine={self.engine}, start_ns={self.start_ns}, end_ns={self.end_ns})")


class _Run:
    """A submission on (or waiting for) an engine. One is made per started submission:
    the fields after `t` start at their class defaults."""

    sub: Submission
    slot: int                     # position of the queue in the processor
    proc: "CommandProcessor"
    t: int                        # start time of command `next`
    slice_start: int              # when this run got its current engine
    cmds: Sequence[Command] = ()  # set once its submission is prepared
    next: int = 0
    cur_end: int = -1             # end of command `next` once committed (-1: not yet)
    timed_out: bool = False
    wait_first: int = -1          # first poll of the current WAIT
    wait_polls: int = 0
    dropped: bool = False         # its queue was reset (RING_RESET): never goes on
    math: bool = True             # holds a command that computes (not only time-only ones)

    def __init__(self, sub: Submission, slot: int, proc: "CommandProcessor", t: int) -> None:
        self.sub = sub
        self.slot = slot
        self.proc = proc
        self.t = self.slice_start = t


Prepare = Callable[[Submission], "tuple[Status, int, list[Command]]"]
Complete = Callable[[Submission], None]
OnFailure = Callable[[Exception], None]


class CommandProcessor:
    """One function's per-queue FIFOs and the virtual-time runner of its submissions.

    The engines belong to a `Scheduler` (the card's); without one the processor makes a
    private scheduler of `num_engines` engines (a single-function device)."""

    def __init__(self, queues: list[int], num_engines: int, dma: DmaPort, clock: Clock,
                 tracer: Tracer, metrics: Metrics, prepare: Prepare,
                 complete: Complete, scheduler: Scheduler | None = None,
                 function_index: int = 0) -> None:
        self.queues = list(queues)
        self.num_engines = num_engines
        self.dma = dma
        self.clock = clock
        self.tracer = tracer
        self.metrics = metrics
        self._prepare = prepare
        self._complete = complete
        # Set by the owner (the VA-1 function): what to do when the processor itself fails
        # (see `failed`); without one the processor only resets.
        self.on_failure: OnFailure | None = None
        self._epoch = 0
        self._timers: dict[int, Timer] = {}
        self._timer_seq = 0
        # How far ahead work may be applied at once (ports.Clock): the clock's
        # horizon_ns() when it has one, else its next event (None: no further).
        horizon = getattr(clock, "horizon_ns", None)
        self._horizon: Callable[[], int | None] = (
            horizon if horizon is not None else self._next_event_or_stop)
        # The tracer's batch form when it has one (ports.Tracer), else one emit per row.
        each = getattr(tracer, "emit_each", None)
        self._in_errstate = False   # _step: inside np.errstate(all="ignore")
        self._emit_plain = plain_emitter(tracer)
        self._emit_each: Callable[[str, tuple[str, ...], list[tuple]], None] = (  # type: ignore[type-arg]
            each if each is not None else self._emit_rows)
        self.sched: Scheduler | None = None
        self.reset()
        self.sched = scheduler if scheduler is not None else Scheduler(num_engines)
        self.engines = self.sched.engines
        self.fs: FunctionSched = self.sched.register(self, function_index)

    def detach(self) -> None:
        """Leave the card's scheduler (a VF being dropped)."""
        self.reset()
        if self.sched is not None:
            self.sched.unregister(self.fs)

    def reset(self) -> None:
        """Drop all queued and running work and cancel every pending event."""
        self._epoch += 1
        for t in list(self._timers.values()):
            t.cancel()
        self._timers.clear()
        self.pending: list[deque[Submission]] = [deque() for _ in self.queues]
        self.resume: list[_Run | None] = [None] * len(self.queues)
        self.busy = [False] * len(self.queues)
        self.sleeping = 0
        self.sleepers: dict[int, _Run] = {}   # slot -> its run yielded in a WAIT
        self.hang_pending = 0     # fault port: commands still to hang (FaultPort)
        self._rr = 0
        self._last_ctx = -1
        sched = self.sched
        if sched is not None:
            freed = False
            for i, r in enumerate(sched.engines):
                if r is not None and r.proc is self:
                    sched.engines[i] = None
                    freed = True
            self.fs.running = 0
            if freed:
                sched.dispatch()

    def _emit_rows(self, kind: str, names: tuple[str, ...], rows: list[tuple]) -> None:  # type: ignore[type-arg]
        """`_emit_each` for a tracer without emit_each: one emit per row."""
        for row in rows:
            self.tracer.emit(kind, **dict(zip(names, row)))

    def _next_event_or_stop(self) -> int:
        nxt = self.clock.next_event_ns()
        return -1 if nxt is None else nxt

    # --- timers ----------------------------------------------------------------------

    def schedule(self, delay_ns: int, callback: Callable[[], None], label: str) -> None:
        """A cancellable event that is dropped by reset()."""
        key = self._timer_seq
        self._timer_seq = key + 1
        self._timers[key] = self.clock.schedule(
            max(0, delay_ns), partial(self._fire, key, self._epoch, callback), label)

    def _fire(self, key: int, epoch: int, callback: Callable[[], None]) -> None:
        """An event of `schedule`: runs `callback` unless reset() came in between."""
        self._timers.pop(key, None)
        if epoch == self._epoch:
            try:
                callback()
            except Exception as e:  # never into the platform's event loop
                self.failed(e)

    def failed(self, exc: Exception) -> None:
        """An unexpected failure outside any one command (a bug in the processor or in
        its owner's completion path): this function alone stops. Its owner is told (the
        VA-1 function sets DEVICE_NEEDS_RESET); the processor drops its work and releases
        its engines, and the card's other functions go on."""
        self.tracer.emit("device_error", where="function", error=type(exc).__name__)
        try:
            if self.on_failure is not None:
                self.on_failure(exc)
        finally:
            self.reset()
            if self.sched is not None:
                self.sched.dispatch()

    # --- queueing --------------------------------------------------------------------

    def set_queues(self, queues: list[int]) -> None:
        """A new queue set (only while reset: nothing queued or running)."""
        self.queues = list(queues)
        self.reset()

    def has_work(self) -> bool:
        return any(self.pending) or any(self.resume)   # a _Run is always true

    def startable(self) -> bool:
        busy, resume = self.busy, self.resume
        for i, q in enumerate(self.pending):
            if (q or resume[i] is not None) and not busy[i]:
                return True
        return False

    def enqueue(self, sub: Submission) -> None:
        if not self.fs.running and not self.has_work():
            self.sched.became_active(self.fs)  # type: ignore[union-attr]
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

    def drop_queue(self, queue: int) -> int:
        """RING_RESET of one submit queue: its queued, running, preempted and waiting
        submissions are dropped, never completed (the driver completes them); their
        engines go back to the scheduler and the other queues go on. Returns how many."""
        if queue not in self.queues:
            return 0
        slot = self.queues.index(queue)
        dropped = len(self.pending[slot])
        self.pending[slot].clear()
        runs = [self.resume[slot], self.sleepers.get(slot)]
        self.resume[slot] = None
        for i, r in enumerate(self.engines):
            if r is not None and r.proc is self and r.slot == slot:
                self.engines[i] = None
                self.fs.running -= 1
                runs.append(r)
        for r in runs:
            if r is not None and not r.dropped:
                r.dropped = True
                dropped += 1
        self.busy[slot] = False
        self.dispatch()
        return dropped

    def idle(self) -> bool:
        return not self.fs.running and not self.sleeping and not self.has_work()

    def dispatch(self) -> None:
        """Give free engines to functions with work (the card's scheduler decides)."""
        self.sched.dispatch()  # type: ignore[union-attr]

    def start_alone(self, sub: Submission) -> bool:
        """A submission arriving at a lone function (the scheduler's only one), idle
        (nothing queued, running or asleep) and not halted: started as `enqueue(sub)`
        and the scheduler's dispatch would start it, without their scans
        (`Scheduler.start_lone`), and True. False: nothing was done (the caller
        enqueues and dispatches)."""
        fs = self.fs
        if fs.halted or not self.idle():
            return False
        sched = self.sched
        assert sched is not None
        return sched.start_lone(fs, sub)

    def start_next(self, engine: int, sub: Submission | None = None) -> None:
        """The scheduler gave us `engine`: start (or resume) our next queue's work, or
        `sub`, the caller knowing it would be alone in its queue, not queued, with
        nothing to resume and nothing else startable.

        The queue: round robin across contexts (the next context id after the last one
        started, among the heads of the startable queues), then across queues."""
        n = len(self.queues)
        if sub is None:
            slot: int | None = None
            busy, resume, pending = self.busy, self.resume, self.pending
            best_key = None
            last = self._last_ctx
            for i in range(n):
                s = (self._rr + i) % n
                if busy[s]:
                    continue
                run = resume[s]
                if run is not None:
                    cid = run.sub.req.context_id
                elif pending[s]:
                    cid = pending[s][0].req.context_id
                else:
                    continue
                key = (cid <= last, cid)
                if best_key is None or key < best_key:
                    slot, best_key = s, key
            if slot is None or best_key is None:  # pragma: no cover - startable() was asked
                return
            self._last_ctx = best_key[1]
            run = resume[slot]
        else:
            slot = self.queues.index(sub.queue)
            run = None
            self._last_ctx = sub.req.context_id
        self._rr = (slot + 1) % n
        self.busy[slot] = True
        self.fs.running += 1
        now = self.clock.now_ns()
        if run is not None:
            self.resume[slot] = None
            run.t = now
            run.slice_start = now
            run.sub.engine = engine
            self.engines[engine] = run
            self.tracer.emit("submit_resume", queue=run.sub.queue,
                             context=run.sub.req.context_id, fence=run.sub.req.fence_seq,
                             engine=engine, start_ns=now)
            self._step(run, now)
            return
        if sub is None:
            sub = self.pending[slot].popleft()
        sub.start_ns = now
        sub.engine = engine
        run = _Run(sub, slot, self, now)
        self.engines[engine] = run
        fields: dict[str, object] = {
            "queue": sub.queue, "context": sub.req.context_id, "fence": sub.req.fence_seq,
            "engine": engine, "start_ns": now}
        if type(now) is int:   # the clock's; the others the device's own ints
            self._emit_plain("submit_start", fields)
        else:
            self.tracer.emit("submit_start", **fields)
        try:
            status, offset, cmds = self._prepare(sub)
        except Exception as e:  # a device bug or host failure: this submission fails
            self.tracer.emit("device_error", where="prepare", queue=sub.queue,
                             error=type(e).__name__)
            status, offset, cmds = Status.DEVICE_ERROR, NO_OFFSET, []
        if status != Status.OK:
            sub.status, sub.error_offset, sub.end_ns = status, offset, now
            self._finish(run)
            return
        run.cmds = cmds
        run.math = not _TIME_ONLY.issuperset(map(_OPCODE_OF, cmds))
        self._step(run, now)

    def _preempt(self, run: _Run, hold: bool = False) -> None:
        """The run yields its engine and resumes later at command `run.next`: preempted
        by the scheduler, or (`hold`, or any yield while Bus Master is off) held
        because the function may not DMA, which is not counted as a preemption."""
        sub = run.sub
        self.engines[sub.engine] = None
        self.busy[run.slot] = False
        self.resume[run.slot] = run
        self.fs.running -= 1
        if hold or not self.fs.bus_master:
            self.tracer.emit("dma_held", queue=sub.queue, context=sub.req.context_id,
                             fence=sub.req.fence_seq, engine=sub.engine, offset=run.next,
                             at_ns=run.t)
        else:
            self.fs.preemptions += 1
            self.metrics.preemptions += 1
            self.tracer.emit("preempt", queue=sub.queue, context=sub.req.context_id,
                             fence=sub.req.fence_seq, engine=sub.engine, offset=run.next,
                             at_ns=run.t)
        self.sched.dispatch()  # type: ignore[union-attr]

    def set_bus_master(self, enabled: bool) -> None:
        """Bus Master off: no run starts and running ones yield at their next command
        boundary (or before a host transfer); on: they are dispatched again."""
        self.fs.bus_master = enabled
        if enabled and self.sched is not None:
            if not self.fs.running and self.has_work():
                self.sched.became_active(self.fs)
            self.sched.dispatch()

    def _sleep(self, run: _Run, until: int) -> None:
        """A WAIT with competitors: give the engine up until the next poll; its queue
        stays blocked (in order) and the run becomes startable again at `until`."""
        sub = run.sub
        self.engines[sub.engine] = None
        self.fs.running -= 1
        self.sleeping += 1
        self.tracer.emit("wait_yield", queue=sub.queue, context=sub.req.context_id,
                         engine=sub.engine, until_ns=until)

        self.sleepers[run.slot] = run

        def wake() -> None:
            self.sleeping -= 1
            self.sleepers.pop(run.slot, None)
            if run.dropped:
                self.dispatch()
                return
            if not self.fs.running and not self.has_work():
                self.sched.became_active(self.fs)  # type: ignore[union-attr]
            self.busy[run.slot] = False
            self.resume[run.slot] = run
            self.dispatch()

        self.schedule(until - self.clock.now_ns(), wake, "va1-wait-sleep")
        self.dispatch()

    def _step(self, run: _Run, now: int = -1) -> None:
        """Apply every command whose end time nobody can observe yet; then wait. `now`:
        the clock's time when the caller has it."""
        if run.dropped:
            return
        if run.math and not self._in_errstate:
            # inf/NaN are data, never an exception: a run that computes steps inside
            # errstate (one that does not has no floating-point state to set)
            with np.errstate(all="ignore"):
                self._in_errstate = True
                try:
                    self._step(run, now)
                finally:
                    self._in_errstate = False
            return
        epoch = self._epoch
        if now < 0:
            now = self.clock.now_ns()
        sub = run.sub
        fs = self.fs
        cmds = run.cmds
        n = len(cmds)   # a run's commands never change
        sched = self.sched
        assert sched is not None
        shared = sched.lone is not fs
        metrics = self.metrics
        while run.next < n:
            cmd = cmds[run.next]
            if (cmd.opcode in _TIME_ONLY and run.cur_end < 0 and not shared
                    and not fs.stopped and fs.bus_master  # not fs.halted
                    and not cmd.path and not self.hang_pending):
                # A run of time-only commands (NOPs): the generic path below, step for
                # step, minus what they cannot do (boundary checks are no-ops unshared
                # and unstopped; nothing executes, so nothing can schedule an event and
                # move the horizon).
                i = start_i = run.next
                t = run.t
                timeout = fs.preemption_timeout_ns
                weight = fs.weight
                engine, queue = sub.engine, sub.queue
                limit = self._horizon()
                rows: list[tuple[str, int, int, int, int, int]] = []
                append = rows.append
                vt = fs.vt
                t0 = t
                while i < n:
                    c = cmds[i]
                    if c.opcode not in _TIME_ONLY or c.path:
                        break
                    cost = c.cost_ns
                    if timeout and cost > timeout:
                        break
                    e = t + cost
                    if e > now and limit is not None and e > limit:
                        break
                    vt += cost / weight  # FunctionSched.charge, term by term
                    append((_OPNAME[c.opcode], c.offset, t, e, engine, queue))
                    t = e
                    i += 1
                fs.vt = vt
                fs.busy_ns += (d := t - t0)
                metrics.device_time_ns += d
                metrics.commands += i - start_i
                run.t, run.next = t, i
                if rows:  # one `cmd` event per command, as below, handed over in one call
                    self._emit_each("cmd", _CMD_FIELDS, rows)
                    if i == n:
                        break   # every command applied: the loop's test would end it
                    continue
            if run.cur_end < 0:
                # A command boundary at run.t.
                if fs.halted or shared and sched.competitor_waiting(
                        fs, run.t - run.slice_start >= fs.exec_quantum_ns):
                    if run.t > now:
                        self.schedule(run.t - now, partial(self._step, run), "va1-boundary")
                        return
                    self._preempt(run)
                    return
                if self.hang_pending:
                    if not self._hang(run, cmd, fs.preemption_timeout_ns):
                        return
                    continue
                if cmd.opcode in _POLLS:
                    if run.t > now:
                        self.schedule(run.t - now, partial(self._step, run), "va1-wait-poll")
                        return
                    if not self._poll(run, cmd, now):
                        return
                    continue
                timeout = fs.preemption_timeout_ns
                if timeout and cmd.cost_ns > timeout:
                    run.cur_end = run.t + timeout
                    run.timed_out = True
                else:
                    run.cur_end = run.t + cmd.cost_ns
            end = run.cur_end
            if end > now and not (BREAKS and "write/early-signal" in BREAKS):
                if cmd.opcode in _HOST_WRITES:
                    break   # a guest may poll what it writes: applied at its end time
                if run.next == n - 1 and cmd.cost_ns >= _DEFER_LAST_MIN_NS:
                    # A big last command is applied exactly at its end time, in the same
                    # event as the completion (due then anyway): no extra event, same
                    # virtual times, and the guest's way into its wait runs before the big
                    # copy or GEMM instead of after it on caches the copy flushed.
                    break
                limit = self._horizon()
                if limit is not None and end > limit:
                    break
            start = run.t
            if run.timed_out:
                self._timeout(run, cmd, end)
                break
            if not fs.bus_master and cmd.host_bytes:
                # Bus Master went off while the command ran, before its host transfer:
                # nothing is read or written; it starts again when Bus Master is back.
                run.cur_end = -1
                self._preempt(run, hold=True)
                return
            try:
                OPS[cmd.opcode].execute(cmd, self.dma, start)  # errstate: entered in _step
            except DmaFault as e:
                sub.status, sub.error_offset = Status.DMA_FAULT, cmd.offset
                self.tracer.emit("cmd_fault", queue=sub.queue, offset=cmd.offset,
                                 reason=e.reason,
                                 **({"path": "/".join(map(str, cmd.path))} if cmd.path else {}))
                self._charge(end - start)
                run.t, run.cur_end = end, -1
                run.next = n
                break
            except Exception as e:  # a kernel failed (MemoryError, a bug): this command
                self._device_error(run, cmd, end, e)
                break
            if epoch != self._epoch:
                return
            fs.charge(end - start)
            metrics.device_time_ns += end - start
            metrics.commands += 1
            metrics.dma_bytes += cmd.host_bytes
            if cmd.path:
                self.tracer.emit("cmd", opcode=_OPNAME[cmd.opcode], offset=cmd.offset,
                                 start_ns=start, end_ns=end, engine=sub.engine,
                                 queue=sub.queue, path="/".join(map(str, cmd.path)))
            else:
                self.tracer.emit("cmd", opcode=_OPNAME[cmd.opcode], offset=cmd.offset,
                                 start_ns=start, end_ns=end, engine=sub.engine,
                                 queue=sub.queue)
            run.t, run.cur_end = end, -1
            run.next += 1
        if run.next < n:
            self.schedule(run.cur_end - now, partial(self._step, run), "va1-cmd")
            return
        done = sub.end_ns = run.t
        if done > now:
            self.schedule(done - now, partial(self._finish, run), "va1-submit-end")
        else:
            self._finish(run)

    def _hang(self, run: _Run, cmd: Command, timeout: int) -> bool:
        """The fault port hangs this command (spec §14): it ends only at the preemption
        timeout, which fails it TIMEOUT. With no timeout (0) it never ends: the run keeps
        its engine until the function is reset. False: nothing more to do now."""
        self.hang_pending -= 1
        sub = run.sub
        self.tracer.emit("cmd_hang", queue=sub.queue, offset=cmd.offset,
                         opcode=cmd.opcode.name, start_ns=run.t,
                         end_ns=run.t + timeout if timeout else -1)
        if not timeout:
            return False
        run.cur_end = run.t + timeout
        run.timed_out = True
        return True

    def _device_error(self, run: _Run, cmd: Command, end: int, exc: Exception) -> None:
        """The command's executor raised: its submission fails DEVICE_ERROR at its offset
        and ends at the command's end time; whatever the kernel wrote of the command's own
        (validated) destinations stays."""
        sub = run.sub
        sub.status, sub.error_offset = Status.DEVICE_ERROR, cmd.offset
        self.metrics.device_errors += 1
        self.tracer.emit("cmd_error", queue=sub.queue, offset=cmd.offset,
                         opcode=cmd.opcode.name, error=type(exc).__name__,
                         **({"path": "/".join(map(str, cmd.path))} if cmd.path else {}))
        self._charge(end - run.t)
        run.t, run.cur_end = end, -1
        run.next = len(run.cmds)

    def _charge(self, ns: int) -> None:
        self.fs.charge(ns)
        self.metrics.device_time_ns += ns

    def _timeout(self, run: _Run, cmd: Command, end: int) -> None:
        sub = run.sub
        sub.status, sub.error_offset = Status.TIMEOUT, cmd.offset
        self.fs.timeouts += 1
        self.metrics.timeouts += 1
        self._charge(end - run.t)
        self.tracer.emit("cmd_timeout", queue=sub.queue, offset=cmd.offset,
                         opcode=cmd.opcode.name, start_ns=run.t, end_ns=end)
        run.t, run.cur_end = end, -1
        run.next = len(run.cmds)

    def _poll(self, run: _Run, cmd: Command, now: int) -> bool:
        """One WAIT poll at `now` (== run.t). True: the loop goes on (the WAIT is
        satisfied and committed, or failed); False: we rescheduled or yielded."""
        sub = run.sub
        fs = self.fs
        if run.wait_first < 0:
            run.wait_first, run.wait_polls = now, 0
        try:
            value = int.from_bytes(self.dma.read(cmd.host_addr, 8), "little")
        except DmaFault as e:
            sub.status, sub.error_offset = Status.DMA_FAULT, cmd.offset
            self.tracer.emit("cmd_fault", queue=sub.queue, offset=cmd.offset, reason=e.reason)
            run.next = len(run.cmds)
            run.wait_first = -1
            return True
        run.wait_polls += 1
        elapsed = now - run.wait_first
        timeout = fs.preemption_timeout_ns
        if value >= cmd.value:
            run.wait_first = -1
            run.cur_end = run.t + cmd.cost_ns
            return True
        if timeout and elapsed >= timeout:
            run.wait_first = -1
            run.cur_end = run.t
            self._timeout(run, cmd, run.t)
            return True
        interval = min(isa.WAIT_POLL_MAX_NS,
                       isa.WAIT_POLL_MIN_NS << min(run.wait_polls - 1, 20))
        nxt = run.t + interval
        if timeout:
            nxt = min(nxt, run.wait_first + timeout)
        if self.sched.other_waiting(fs):  # type: ignore[union-attr]
            self._sleep(run, nxt)
            return False
        self._charge(nxt - run.t)
        run.t = nxt
        self.schedule(nxt - now, partial(self._step, run), "va1-wait-poll")
        return False

    def _finish(self, run: _Run) -> None:
        if run.dropped:
            return
        sub = run.sub
        if self.engines[sub.engine] is run:
            self.engines[sub.engine] = None
        self.busy[run.slot] = False
        self.fs.running -= 1
        self.metrics.submissions += 1
        start, end = sub.start_ns, sub.end_ns
        fields: dict[str, object] = {
                  "queue": sub.queue, "context": sub.req.context_id,
                  "fence": sub.req.fence_seq, "status": _STATUS_NAME[sub.status],
                  "error_offset": sub.error_offset, "engine": sub.engine,
                  "start_ns": start, "end_ns": end}
        if type(start) is int is type(end):   # the clock's; the others the device's own
            self._emit_plain("submit_end", fields)
        else:
            self.tracer.emit("submit_end", **fields)
        self._complete(sub)
        self.sched.dispatch()  # type: ignore[union-attr]
