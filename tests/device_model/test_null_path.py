"""The common case of a submission, from its notify to its interrupt, takes shorter
paths that must do exactly what the general ones do, and leave them for anything else:

- the split ring reads the usual request chain (one INDIRECT descriptor, a two-entry
  table: readable, then writable) in pop, and says when the ring is known empty
  (`drained`), so the device skips the pop that would find so;
- one submission at an idle lone function starts without enqueue and dispatch
  (`CommandProcessor.start_alone`); a lone function with nothing to start dispatches in
  a few tests;
- the request is unpacked and the response packed in place in the function's window;
  the used entry and the interrupt decision are one ring call (`push_used_interrupt`);
- a context keeps its DecodeEnv; decode asks the resolve cache's lookup only for
  another env or a moved address space;
- the device's submit_start, submit_end and irq events go through the tracer's
  emit_plain when it has one (ports.plain_emitter) and the times are exact ints, else
  through emit.
"""
from __future__ import annotations

import struct
from typing import Callable

import dm_driver
import pytest
from dm_driver import Bump, MockSplitQueue, Rig, fill, nop
from dm_fakes import FakeDma, RecordingTracer

from device_model.va1 import commands as C
from device_model.ports import NullTracer, plain_emitter
from device_model.va1.engine import CommandProcessor, Submission, _Run
from device_model.va1.requests import SubmitRequest
from device_model.va1.scheduler import Scheduler
from device_model.virtio.queue import Queue
from device_model.virtio.ring_factory import make_device_ring
from device_model.virtio import split_ring
from device_model.virtio.split_ring import SplitRing
from hwspec import va1
from hwspec import virtio as V
from hwspec.va1 import Status

EVENT_IDX = 1 << V.F_RING_EVENT_IDX
INDIRECT = 1 << V.F_RING_INDIRECT_DESC


def _submit_indirect(rig: Rig, ctx: int, cmdbuf: bytes, fence: int, queue: int = 2) -> int:
    """A submission as the guest driver makes it (one INDIRECT descriptor, a two-entry
    table); returns the response address. Not kicked."""
    cmd = rig.put(cmdbuf)
    req = rig.alloc.alloc(32)
    resp = rig.alloc.alloc(32)
    table = rig.alloc.alloc(32)
    rig.dma.g_write(req, struct.pack("<IIQIIQ", ctx, 0, cmd, len(cmdbuf), 0, fence))
    rig.queues[queue].add([(req, 32, False), (resp, 32, True)], indirect_table=table)
    return resp


def _scenario(rig: Rig) -> list[tuple[int, ...]]:
    """Single submissions, two in one kick, one on each queue, a bad context, a FILL:
    the responses in guest memory, in order."""
    cid = rig.create_context()
    resps: list[int] = []
    for fence, cmdbuf, queue in ((1, nop(), 2), (2, nop() * 3, 2), (3, fill(0, 64, 7), 3)):
        resps.append(_submit_indirect(rig, cid, cmdbuf, fence, queue))
        rig.kick(queue)
        rig.clock.run()
    resps.append(_submit_indirect(rig, cid, nop(), 4))
    resps.append(_submit_indirect(rig, cid, nop(), 5))
    rig.kick()
    resps.append(_submit_indirect(rig, cid, nop(), 6, 3))
    rig.kick(3)
    rig.clock.run()
    resps.append(_submit_indirect(rig, 99, nop(), 7))         # BAD_CONTEXT
    rig.kick()
    rig.clock.run()
    resps.append(rig.submit_nowait(cid, nop(), 8))          # a direct chain
    rig.kick()
    rig.clock.run()
    return [struct.unpack("<IIQQQ", rig.dma.g_read(r, 32)) for r in resps]


def _run(views: bool, features: int | None = None,
         patch: Callable[[pytest.MonkeyPatch], None] | None = None
         ) -> tuple[list[tuple[int, ...]], list[object], bytes]:
    with pytest.MonkeyPatch.context() as mp:
        if patch is not None:
            patch(mp)
        rig = Rig(qsize=8, features=features)
        rig.dma.view_epoch = 0 if views else None
        resps = _scenario(rig)
    return resps, list(rig.tracer.events), rig.dma.g_read(rig.dma.base, 1 << 16)


def _general(mp: pytest.MonkeyPatch) -> None:
    """The ring and lone-start fast paths off: the ring never known drained, the usual
    chain walked, completions in two ring calls, no lone start. The others stay on (the
    request and response in place in the window, the kept DecodeEnv, emit_plain)."""
    mp.setattr(SplitRing, "drained", property(lambda self: False, lambda self, v: None),
               raising=False)
    mp.setattr(split_ring, "_TWO_DESC_FROM", lambda mem, off: (0,) * 8)  # not the usual
    mp.setattr(CommandProcessor, "start_alone", lambda self, sub: False)
    mp.setattr(SplitRing, "push_used_interrupt",
               lambda self, dma, head, n: (self.push_used(dma, head, n),
                                           self.needs_interrupt(dma))[1])


@pytest.mark.parametrize("features", [None, "no-event-idx"])
def test_fast_and_general_paths_agree(features: str | None) -> None:
    """Same responses, same trace (events, fields, virtual times), same guest memory
    (rings included) with the fast paths, with them off, and without port views."""
    feats = None
    if features is not None:
        offered = Rig(qsize=8).offered()
        feats = offered & ~EVENT_IDX
    fast = _run(True, feats)
    assert fast == _run(True, feats, _general)
    resps, trace, _ = _run(False, feats)
    assert (resps, trace) == fast[:2]     # without views the device's own DMAs differ
    statuses = [r[0] for r in fast[0]]
    assert statuses == [Status.OK] * 6 + [Status.BAD_CONTEXT, Status.OK]


def test_the_fast_paths_are_taken_for_the_usual_submission(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(qsize=8)
    rig.dma.view_epoch = 0
    cid = rig.create_context()
    _submit_indirect(rig, cid, nop(), 1)                      # warms the windows
    rig.kick()
    rig.clock.run()
    calls: list[str] = []
    for cls, name in ((SplitRing, "_walk"), (SplitRing, "pop"), (SplitRing, "push_used"),
                      (CommandProcessor, "enqueue"), (Scheduler, "start_lone"),
                      (CommandProcessor, "startable"), (C.ResolveCache, "lookup")):
        orig = getattr(cls, name)

        def spy(*a: object, _o: Callable[..., object] = orig, _n: str = name,
                **k: object) -> object:
            calls.append(_n)
            return _o(*a, **k)
        monkeypatch.setattr(cls, name, spy)
    resp = _submit_indirect(rig, cid, nop(), 2)
    rig.kick()
    rig.clock.run()
    assert calls == ["pop", "start_lone"]            # one pop, the lone start, nothing else
    assert struct.unpack("<IIQQQ", rig.dma.g_read(resp, 32))[:3] == (Status.OK, 0xFFFFFFFF, 2)
    assert rig.dev.processor.sched._active == {}               # idle again


def _ring(features: int = INDIRECT | EVENT_IDX, views: bool = True
          ) -> tuple[FakeDma, Bump, MockSplitQueue, SplitRing]:
    dma = FakeDma(size=4 << 20)   # holds the 2 MiB windows the walk asks for
    dma.view_epoch = 0 if views else None
    alloc = Bump(dma)
    mq = MockSplitQueue(dma, alloc, 8)
    regs = Queue(8)
    regs.size = 8
    regs.desc_table, regs.avail_ring, regs.used_ring = mq.desc, mq.avail, mq.used
    regs.ready = True
    q = make_device_ring(features, regs)
    assert isinstance(q, SplitRing)
    return dma, alloc, mq, q


def _chain_fields(c: object) -> tuple[object, ...]:
    return (c.head, c.readable, c.writable, c.readable_len, c.writable_len,  # type: ignore[attr-defined]
            c.ring)  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", ["usual", "three-entries", "direct", "write-flag-extra",
                                   "empty-buffer", "outside-window", "next-not-1"])
def test_pop_reads_the_usual_chain_as_walk_does_and_walks_the_rest(
        shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dma, alloc, mq, q = _ring()
    # a first chain to place the walk's window around the buffers
    warm = alloc.alloc(64)
    mq.add([(warm, 32, False), (warm + 32, 32, True)], indirect_table=alloc.alloc(32))
    assert q.pop(dma) is not None
    a, b, table = alloc.alloc(32), alloc.alloc(32), alloc.alloc(48)
    if shape == "three-entries":
        head = mq.add([(a, 16, False), (a + 16, 16, False), (b, 32, True)], table)
    elif shape == "direct":
        head = mq.add([(a, 32, False), (b, 32, True)])
    else:
        head = mq.add([(a, 32, False), (b, 32, True)], table)
        if shape == "write-flag-extra":
            mq.write_desc(table, 1, b, 32, 2 | 8, 0)       # an unknown flag bit too
        elif shape == "empty-buffer":
            mq.write_desc(table, 0, a, 0, 1, 1)
        elif shape == "outside-window":
            mq.write_desc(table, 1, 8 << 20, 32, 2, 0)     # beyond RAM: ring/dma
        elif shape == "next-not-1":
            mq.write_desc(table, 0, a, 32, 1, 0)           # a loop back to entry 0
    walked: list[int] = []
    orig = SplitRing._walk

    def walk(self: SplitRing, *args: object) -> object:
        walked.append(1)
        return orig(self, *args)  # type: ignore[arg-type]
    monkeypatch.setattr(SplitRing, "_walk", walk)
    last = q.last_avail_idx
    try:
        got: object = _chain_fields(q.pop(dma))
    except Exception as e:  # the general walk's RingError
        got = repr(e)
    assert walked == ([] if shape == "usual" else [1])
    monkeypatch.setattr(SplitRing, "_walk", orig)
    mem = q._ring_mem(dma)
    try:
        want: object = _chain_fields(orig(q, dma, head, mem))
    except Exception as e:
        want = repr(e)
    assert got == want
    if shape == "outside-window":
        assert "ring/dma" in str(got)
    elif shape == "next-not-1":
        assert "ring/loop" in str(got)
    else:
        assert q.last_avail_idx == (last + 1) & 0xFFFF


def test_drained_says_when_a_pop_would_find_nothing() -> None:
    dma, alloc, mq, q = _ring()
    buf = alloc.alloc(64)
    mq.add([(buf, 8, False), (buf + 8, 8, True)])
    mq.add([(buf + 16, 8, False), (buf + 24, 8, True)])
    assert q.pop(dma) is not None and not q.drained        # a second chain is there
    assert q.pop(dma) is not None and q.drained             # the last one
    before = dma.g_read(dma.base, 1 << 16)
    assert q.pop(dma) is None and not q.drained              # and the skipped pop
    assert dma.g_read(dma.base, 1 << 16) == before          # changes nothing
    dma, alloc, mq, q = _ring(views=False)
    mq.add([(buf, 8, False), (buf + 8, 8, True)])
    assert q.pop(dma) is not None and not q.drained          # no view: never known


@pytest.mark.parametrize("features", [INDIRECT | EVENT_IDX, INDIRECT])
@pytest.mark.parametrize("views", [True, False])
@pytest.mark.parametrize("no_interrupt", [False, True])
def test_push_used_interrupt_is_push_used_then_needs_interrupt(
        features: int, views: bool, no_interrupt: bool) -> None:
    rings = [_ring(features, views) for _ in range(2)]
    answers: list[list[bool]] = [[], []]
    for k, (dma, alloc, mq, q) in enumerate(rings):
        buf = alloc.alloc(64)
        if no_interrupt:
            mq.w16(mq.avail, 1)                              # VRING_AVAIL_F_NO_INTERRUPT
            mq.w16(mq.used_event_addr, 2)                   # EVENT_IDX: after the 3rd
        for i in range(4):
            mq.add([(buf, 8, False), (buf + 8, 8, True)])
            chain = q.pop(dma)
            assert chain is not None
            if k == 0:
                answers[k].append(q.push_used_interrupt(dma, chain.head, i))
            else:
                q.push_used(dma, chain.head, i)
                answers[k].append(q.needs_interrupt(dma))
            mq.pop_used()
    assert answers[0] == answers[1]
    assert rings[0][0].g_read(rings[0][0].base, 1 << 16) == \
        rings[1][0].g_read(rings[1][0].base, 1 << 16)
    assert any(answers[0]) != (no_interrupt and not features & EVENT_IDX)


def test_push_used_interrupt_takes_the_two_calls_with_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With IN_ORDER (and ring views on) the completion goes through push_used, which
    holds a chain finished early and frees its id: more chains than the queue size go
    round, and two finished in reverse order go back as one batch once the first has."""
    calls: list[str] = []
    for name in ("push_used", "needs_interrupt"):
        orig = getattr(SplitRing, name)
        monkeypatch.setattr(SplitRing, name,
                            lambda self, *a, _o=orig, _n=name: calls.append(_n) or _o(self, *a))
    rings = [_ring(INDIRECT | EVENT_IDX | 1 << V.F_IN_ORDER) for _ in range(2)]
    answers: list[list[bool]] = [[], []]
    for k, (dma, alloc, mq, q) in enumerate(rings):
        buf = alloc.alloc(64)

        def complete(head: int) -> None:
            if k == 0:
                calls.clear()
                answers[k].append(q.push_used_interrupt(dma, head, 8))
                assert calls == ["push_used", "needs_interrupt"]
            else:
                q.push_used(dma, head, 8)
                answers[k].append(q.needs_interrupt(dma))
        for i in range(2 * mq.size + 1):                  # ids come round again
            head = mq.add([(buf, 8, False), (buf + 8, 8, True)], indirect_table=buf + 16)
            chain = q.pop(dma)
            assert chain is not None and chain.head == head == i % mq.size
            complete(head)
            assert mq.pop_used() == (head, 8)
        heads = [mq.add([(buf, 8, False), (buf + 8, 8, True)], indirect_table=buf + 16)
                 for _ in range(2)]
        chains = [q.pop(dma), q.pop(dma)]
        assert [c.head for c in chains if c is not None] == heads
        used = mq.used_idx()
        mq.w16(mq.used_event_addr, used)                  # EVENT_IDX: at the next entry
        complete(heads[1])
        assert mq.used_idx() == used and answers[k][-1] is False   # held
        complete(heads[0])
        assert mq.used_idx() == (used + 2) & 0xFFFF and answers[k][-1] is True
        assert mq.pop_used() == (heads[1], 8)             # the batch names its last
    assert answers[0] == answers[1]
    assert rings[0][0].g_read(rings[0][0].base, 1 << 16) == \
        rings[1][0].g_read(rings[1][0].base, 1 << 16)


# --- the lone start --------------------------------------------------------------------

def _idle_rig() -> tuple[Rig, int]:
    rig = Rig(qsize=8)
    rig.dma.view_epoch = 0
    return rig, rig.create_context()


def _sub(rig: Rig, cid: int, queue: int = 2) -> Submission:
    """A submission popped from `queue`, not handed to the processor."""
    _submit_indirect(rig, cid, nop(), 1, queue)
    chain = rig.dev.queues[queue].pop(rig.dma)
    assert chain is not None
    return Submission(queue, chain, SubmitRequest(cid, 0, rig.put(nop()), 8, 0, 1))


@pytest.mark.parametrize("why", ["stopped", "bus-master-off", "queued", "running",
                                 "dispatching", "second-function"])
def test_start_alone_declines_and_changes_nothing(why: str) -> None:
    rig, cid = _idle_rig()
    proc = rig.dev.processor
    sub = _sub(rig, cid)
    if why == "stopped":
        proc.fs.stopped = True
    elif why == "bus-master-off":
        proc.fs.bus_master = False
    elif why == "queued":
        proc.pending[1].append(_sub(rig, cid, 3))
    elif why == "running":
        proc.fs.running = 1
    elif why == "dispatching":
        proc.sched._dispatching = True
    else:
        proc.sched.register(CommandProcessor.__new__(CommandProcessor), 1)
    pending = [list(q) for q in proc.pending]
    active = dict(proc.sched._active)
    assert not proc.start_alone(sub)
    assert [list(q) for q in proc.pending] == pending and proc.sched._active == active
    assert proc.sched.engines == [None] * len(proc.sched.engines)
    assert rig.tracer.kinds("submit_start") == []


def test_start_alone_starts_as_enqueue_and_dispatch_do() -> None:
    traces = []
    for alone in (True, False):
        rig, cid = _idle_rig()
        proc = rig.dev.processor
        sub = _sub(rig, cid)
        rig.tracer.events.clear()
        if alone:
            assert proc.start_alone(sub)
        else:
            proc.enqueue(sub)
            proc.sched.dispatch()
        assert proc.sched._active == {proc.fs.index: proc.fs} and proc.fs.running == 1
        assert (proc._rr, proc._last_ctx, proc.busy) == (1, cid, [True, False])
        rig.clock.run()
        assert proc.sched._active == {} and proc.fs.running == 0
        traces.append(rig.tracer.events)
    assert traces[0] == traces[1] and [k for k, _ in traces[0]][:2] == ["submit_start", "cmd"]


# --- the kept decode environment ------------------------------------------------------

def test_a_context_keeps_its_env_and_a_renegotiation_makes_a_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Features change only through a reset, which drops the contexts: the contexts of
    the new negotiation get a new env, made for its features."""
    rig, cid = _idle_rig()
    lookups: list[int] = []
    orig = C.ResolveCache.lookup

    def lookup(self: C.ResolveCache, env: C.DecodeEnv, buf: bytes) -> object:
        lookups.append(1)
        return orig(self, env, buf)
    monkeypatch.setattr(C.ResolveCache, "lookup", lookup)
    assert rig.submit(cid, nop()).status == Status.OK
    env = rig.dev.contexts[cid].env
    assert env is not None and env.fp16 and lookups == [1]
    assert rig.submit(cid, nop(), fence=2).status == Status.OK
    assert rig.dev.contexts[cid].env is env and lookups == [1]   # kept, no lookup
    f16 = dm_driver.eltwise(0, 1, 16, 0, 64, 128)                 # an F16 ADD
    assert rig.submit(cid, f16, fence=3).status == Status.OK
    rig.features = rig.offered() & ~(1 << va1.F_FP16)
    rig.init()                                                    # reset, renegotiation
    assert rig.dev.contexts == {}
    cid = rig.create_context()
    assert rig.dev.contexts[cid].env is None
    assert rig.submit(cid, nop() * 2, fence=3).status == Status.OK
    new = rig.dev.contexts[cid].env
    assert new is not None and new is not env and not new.fp16 and lookups == [1, 1]
    assert rig.submit(cid, f16, fence=4).status == Status.BAD_DTYPE


def test_a_mapping_change_sends_decode_through_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(qsize=8)
    cid = rig.create_context(flat=False)
    ctx = rig.dev.contexts[cid]
    assert rig.submit(cid, nop()).status == Status.OK
    lookups: list[int] = []
    orig = C.ResolveCache.lookup
    monkeypatch.setattr(C.ResolveCache, "lookup",
                        lambda self, env, buf: lookups.append(1) or orig(self, env, buf))
    assert rig.submit(cid, nop(), fence=2).status == Status.OK and lookups == []
    ctx.aspace.map(0, 0, 1 << 16, 3, rig.dev.memory.size)   # the generation moves
    assert rig.submit(cid, nop(), fence=3).status == Status.OK and lookups == [1]


# --- the transport's two stores -------------------------------------------------------

def test_mmio_notify_and_ack_of_other_sizes_still_break_the_size_rule() -> None:
    rig, cid = _idle_rig()
    _submit_indirect(rig, cid, nop(), 1)
    rig.mmio.write(0x50, 2, 2)                                  # a 2-byte QueueNotify
    rig.mmio.write(0x64, 1, 1)                                  # a 1-byte InterruptACK
    assert [v.rule for v in rig.mmio.violations[rig.vio_before:]] == ["mmio/access-size"] * 2
    assert rig.tracer.kinds("submit_start") == []
    rig.kick()
    rig.clock.run()
    assert rig.irq.level and rig.ack_irq() == 1 and not rig.irq.level


# --- emit_plain --------------------------------------------------------------------------

class _PlainTracer(RecordingTracer):
    """A tracer with emit_plain: records the events it is handed like emit does, checks
    that every value is of an exact plain type and notes which events came that way."""

    def __init__(self) -> None:
        super().__init__()
        self.plain: list[str] = []

    def emit_plain(self, kind: str, fields: dict[str, object]) -> None:
        assert all(type(v) in (int, str, bool) for v in fields.values()), (kind, fields)
        self.plain.append(kind)
        self.events.append((kind, dict(fields)))


class _Tick(int):
    """An int that is not exactly an int (a clock's time the device did not make)."""


def test_plain_emitter_is_emit_plain_or_emit_with_the_same_fields() -> None:
    plain = _PlainTracer()
    assert plain_emitter(plain) == plain.emit_plain
    null = NullTracer()
    assert plain_emitter(null) == null.emit_plain
    rec = RecordingTracer()
    plain_emitter(rec)("irq", {"bits": 1, "status": 3})
    assert rec.events == [("irq", {"bits": 1, "status": 3})]


def test_device_events_through_emit_plain_are_those_of_emit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same responses, events and guest memory with a tracer that has emit_plain;
    the submission and interrupt events came through it."""
    fast = _run(True)
    monkeypatch.setattr(dm_driver, "RecordingTracer", _PlainTracer)
    rig = Rig(qsize=8)
    rig.dma.view_epoch = 0
    resps = _scenario(rig)
    assert (resps, rig.tracer.events, rig.dma.g_read(rig.dma.base, 1 << 16)) == fast
    assert isinstance(rig.tracer, _PlainTracer)
    assert {"submit_start", "submit_end", "irq"} <= set(rig.tracer.plain)
    assert rig.tracer.plain.count("submit_end") == len(rig.tracer.kinds("submit_end"))


def test_times_not_of_exact_int_type_go_through_emit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm_driver, "RecordingTracer", _PlainTracer)
    rig, cid = _idle_rig()
    assert isinstance(rig.tracer, _PlainTracer)
    clock = rig.clock
    monkeypatch.setattr(clock, "now_ns", lambda: _Tick(clock.now))
    resp = _submit_indirect(rig, cid, nop(), 1)
    rig.kick()
    rig.clock.run()
    assert struct.unpack("<IIQQQ", rig.dma.g_read(resp, 32))[0] == Status.OK
    assert "irq" in rig.tracer.plain              # submit_start/_end took emit
    assert not {"submit_start", "submit_end"} & set(rig.tracer.plain)
    assert [k for k, _ in rig.tracer.events if k.startswith("submit")] == [
        "submit_start", "submit_end"]


def test_submission_and_run_start_from_their_defaults() -> None:
    rig, cid = _idle_rig()
    sub = _sub(rig, cid)
    assert (sub.status, sub.error_offset, sub.start_ns, sub.end_ns, sub.engine) == (
        Status.OK, va1.NO_OFFSET, 0, 0, -1)
    run = _Run(sub, 0, rig.dev.processor, 7)
    assert (run.t, run.slice_start, run.next, run.cur_end, run.cmds, run.timed_out,
            run.wait_first, run.wait_polls, run.dropped, run.math) == (
        7, 7, 0, -1, (), False, -1, 0, False, True)
    other = _Run(sub, 0, rig.dev.processor, 9)
    run.next = 3
    assert other.next == 0 and "queue=2" in repr(sub)


class _Idle:
    """A function's processor with nothing to do (what the scheduler asks of one)."""

    def has_work(self) -> bool:
        return False

    def startable(self) -> bool:
        return False


def test_the_scheduler_keeps_its_lone_function_through_register_and_unregister() -> None:
    sched = Scheduler(2)
    assert sched.lone is None
    a = sched.register(_Idle(), 0)  # type: ignore[arg-type]
    assert sched.lone is a and not sched.competitor_waiting(a, True)
    b = sched.register(_Idle(), 1)  # type: ignore[arg-type]
    assert sched.lone is None
    sched.unregister(a)
    assert sched.lone is b and sched.functions == [b]
    sched.unregister(b)
    assert sched.lone is None and sched.functions == []
