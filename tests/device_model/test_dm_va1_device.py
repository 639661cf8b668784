"""VA-1 function behaviour (spec §6, §8): controlq, submissions, faults and the eventq,
scheduling on compute units, virtual-time exactness, reset."""
from __future__ import annotations

import struct

import numpy as np
from dm_driver import Rig, eltwise, fill, gemm, nop, signal

from device_model import Va1Config
from hwspec.va1 import NO_OFFSET, Status

MEM = 4 << 20
CFG = Va1Config(device_memory_size=MEM)


# --- controlq ----------------------------------------------------------------------------

def test_context_ids_and_limits() -> None:
    rig = Rig(Va1Config(device_memory_size=MEM, max_contexts=3))
    assert [rig.create_context() for _ in range(3)] == [1, 2, 3]
    st, cid = struct.unpack("<II", rig.ctrl(1))
    assert (st, cid) == (Status.NO_RESOURCES, 0)
    assert rig.destroy_context(2) == Status.OK
    assert rig.destroy_context(2) == Status.BAD_CONTEXT
    assert rig.destroy_context(77) == Status.BAD_CONTEXT
    assert rig.create_context() == 2


def test_ctrl_timing_is_overhead_after_read() -> None:
    rig = Rig(CFG)
    rig.clock.now = 1000
    q = rig.queues[0]
    req, resp = rig.alloc.alloc(16), rig.alloc.alloc(8)
    rig.dma.g_write(req, struct.pack("<IIII", 1, 0, 0, 0))
    q.add([(req, 16, False), (resp, 8, True)])
    rig.kick(0)
    rig.clock.run(until=1000 + CFG.cmd_overhead_ns - 1)
    assert q.used_idx() == 0 and not rig.irq.level
    rig.clock.run(until=1000 + CFG.cmd_overhead_ns)
    assert q.pop_used() is not None and rig.irq.level


def test_ctrl_bad_requests() -> None:
    rig = Rig(CFG)
    assert struct.unpack("<II", rig.ctrl(9)) == (Status.BAD_ARG, 0)
    assert struct.unpack("<II", rig.ctrl(1, flags=2)) == (Status.BAD_REQUEST, 0)
    assert struct.unpack("<II", rig.ctrl(2, 5, reserved=1)) == (Status.BAD_REQUEST, 5)
    # GET_STATS needs 48 writable bytes: a bare BAD_REQUEST status
    assert rig.ctrl(3, resp_len=8) == struct.pack("<I", Status.BAD_REQUEST)
    # short readable part
    q = rig.queues[0]
    req, resp = rig.alloc.alloc(8), rig.alloc.alloc(8)
    q.add([(req, 8, False), (resp, 8, True)])
    rig.kick(0)
    rig.clock.run()
    got = q.pop_used()
    assert got is not None and got[1] == 4
    assert rig.dma.g_read(resp, 4) == struct.pack("<I", Status.BAD_REQUEST)
    # writable part too short for even a status: used.len = 0, nothing written
    req, resp = rig.alloc.alloc(16), rig.alloc.alloc(8)
    rig.dma.g_write(req, struct.pack("<IIII", 1, 0, 0, 0))
    rig.dma.g_write(resp, b"\xAA" * 8)
    head = q.add([(req, 16, False), (resp, 2, True)])
    rig.kick(0)
    rig.clock.run()
    assert q.pop_used() == (head, 0)
    assert rig.dma.g_read(resp, 8) == b"\xAA" * 8
    assert rig.dev.contexts == {}
    assert rig.mmio.violations == []


def test_get_stats_counts() -> None:
    rig = Rig(CFG)
    cid = rig.create_context()
    host = rig.alloc.alloc(64)
    r1 = rig.submit(cid, nop() + signal(host, 1))
    r2 = rig.submit(cid, fill(0, 64, 1) + fill(MEM, 4, 0), fence=2)
    assert r2.status == Status.OUT_OF_BOUNDS
    st = rig.stats()
    assert st[0] == Status.OK and st[1] == 0
    assert st[2:] == (2, 2, r1.end_ns - r1.start_ns, 8, 1)


# --- submissions -------------------------------------------------------------------------

def test_submission_checks_in_order() -> None:
    rig = Rig(Va1Config(device_memory_size=MEM, max_cmdbuf_size=64))
    cid = rig.create_context()
    buf = rig.put(nop())
    r = rig.submit(cid + 1, nop())
    assert (r.status, r.error_offset) == (Status.BAD_CONTEXT, NO_OFFSET)
    for kw, st in ((dict(flags=1), Status.BAD_REQUEST), (dict(reserved=2), Status.BAD_REQUEST),
                   (dict(length=0), Status.BAD_REQUEST), (dict(length=12), Status.BAD_REQUEST),
                   (dict(length=72), Status.CMDBUF_TOO_LARGE),
                   (dict(addr=0x1000, length=8), Status.DMA_FAULT),
                   (dict(addr=(1 << 64) - 8, length=16), Status.DMA_FAULT)):
        cid = rig.create_context()
        resp = rig.submit_nowait(cid, None, 5, addr=kw.pop("addr", buf),
                                 length=kw.pop("length", 8), **kw)
        rig.kick()
        rig.clock.run()
        rig.queues[2].pop_used()
        r = rig.resp(resp)
        assert (r.status, r.error_offset, r.fence) == (st, NO_OFFSET, 5), kw
        # the context is faulted now: its next submission is refused
        assert rig.submit(cid, nop()).status == Status.CONTEXT_FAULTED


def test_short_submit_chain() -> None:
    rig = Rig(CFG)
    q = rig.queues[2]
    req, resp = rig.alloc.alloc(32), rig.alloc.alloc(32)
    head = q.add([(req, 16, False), (resp, 32, True)])
    rig.kick()
    rig.clock.run()
    assert q.pop_used() == (head, 4)
    assert rig.dma.g_read(resp, 4) == struct.pack("<I", Status.BAD_REQUEST)
    head = q.add([(req, 32, False), (resp, 3, True)])
    rig.kick()
    rig.clock.run()
    assert q.pop_used() == (head, 0)


def test_fault_event_and_isolation() -> None:
    rig = Rig(CFG)
    ev = rig.post_event_buffer()
    bad, good = rig.create_context(), rig.create_context()
    r = rig.submit(bad, nop(16) + fill(0, 6, 0), fence=42)
    assert (r.status, r.error_offset) == (Status.BAD_SHAPE, 16)
    got = rig.queues[1].pop_used()
    assert got is not None and got[1] == 24
    assert struct.unpack("<IIQII", rig.dma.g_read(ev, 24)) == (1, bad, 42, Status.BAD_SHAPE, 16)
    assert rig.submit(bad, nop(), fence=43).status == Status.CONTEXT_FAULTED
    assert rig.submit(good, fill(0, 8, 7), fence=44).status == Status.OK
    assert rig.dev.memory.read(0, 8) == struct.pack("<II", 7, 7)
    # no further events for CONTEXT_FAULTED; no buffer posted -> dropped silently
    assert rig.queues[1].pop_used() is None
    assert rig.submit(good, fill(MEM, 4, 0), fence=45).status == Status.OUT_OF_BOUNDS
    assert rig.tracer.kinds("event_dropped")[-1]["reason"] == "no buffer"
    # destroy + recreate clears the fault
    assert rig.destroy_context(bad) == 0
    assert rig.create_context() == bad
    assert rig.submit(bad, nop(), fence=46).status == Status.OK
    assert rig.mmio.violations == []


def test_bad_context_does_not_fault() -> None:
    rig = Rig(CFG)
    rig.post_event_buffer()
    assert rig.submit(5, nop()).status == Status.BAD_CONTEXT
    assert rig.queues[1].pop_used() is None
    assert rig.stats()[-1] == 0


def test_in_order_per_queue_and_concurrent_across_queues() -> None:
    rig = Rig(CFG)
    cid = rig.create_context()
    work = gemm(128, 128, 128, 0, 0, 0)
    t0 = rig.clock.now
    ra = [rig.submit_nowait(cid, work, fence=i, queue=2) for i in range(3)]
    rb = [rig.submit_nowait(cid, work, fence=10 + i, queue=3) for i in range(2)]
    rig.kick(2)
    rig.kick(3)
    rig.clock.run()
    a = [rig.resp(x) for x in ra]
    b = [rig.resp(x) for x in rb]
    assert all(r.status == 0 for r in a + b)
    assert a[0].start_ns == b[0].start_ns == t0
    assert [r.start_ns for r in a[1:]] == [r.end_ns for r in a[:-1]]
    assert [r.start_ns for r in b[1:]] == [r.end_ns for r in b[:-1]]
    assert sorted({e["engine"] for e in rig.tracer.kinds("submit_start")}) == [0, 1]


def test_one_engine_round_robin() -> None:
    rig = Rig(Va1Config(device_memory_size=MEM, num_compute_units=1, num_submit_queues=3))
    cid = rig.create_context()
    for q in (2, 3, 4):
        for i in range(2):
            rig.submit_nowait(cid, nop(), fence=q * 10 + i, queue=q)
    for q in (2, 3, 4):
        rig.kick(q)
    rig.clock.run()
    order = [e["fence"] for e in rig.tracer.kinds("submit_start")]
    assert order == [20, 30, 40, 21, 31, 41]
    ends = [(e["start_ns"], e["end_ns"]) for e in rig.tracer.kinds("submit_end")]
    assert all(s == pe for (s, _), (_, pe) in zip(ends[1:], ends[:-1]))


def test_destroy_aborts_queued_not_running() -> None:
    rig = Rig(CFG)
    cid = rig.create_context()
    big = gemm(512, 512, 512, 0, 0, 0)
    resps = [rig.submit_nowait(cid, big, fence=i) for i in range(3)]
    rig.kick()
    # destroy while the first runs
    q = rig.queues[0]
    req, out = rig.alloc.alloc(16), rig.alloc.alloc(8)
    rig.dma.g_write(req, struct.pack("<IIII", 2, cid, 0, 0))
    q.add([(req, 16, False), (out, 8, True)])
    rig.kick(0)
    rig.clock.run()
    assert struct.unpack("<II", rig.dma.g_read(out, 8)) == (0, cid)
    st = [rig.resp(r) for r in resps]
    assert [s.status for s in st] == [Status.OK, Status.ABORTED, Status.ABORTED]
    destroy_done = st[1].end_ns
    assert st[1].start_ns == st[2].start_ns == st[2].end_ns == destroy_done
    assert destroy_done < st[0].end_ns
    assert rig.queues[2].pop_used() is not None


def test_completion_exactly_at_end_ns() -> None:
    rig = Rig(CFG)
    cid = rig.create_context()
    rig.ack_irq()
    resp = rig.submit_nowait(cid, gemm(256, 256, 256, 0, 0, 0))
    rig.kick()
    start = rig.clock.now
    dur = CFG.cmd_overhead_ns + max(-(-2 * 256**3 * 10**9 // CFG.peak_flops),
                                    -(-3 * 256 * 256 * 4 * 10**9 // CFG.mem_bandwidth))
    rig.clock.run(until=start + dur - 1)
    assert rig.queues[2].used_idx() == 0 and not rig.irq.level
    assert rig.dma.g_read(resp, 4) == bytes(4) and rig.clock.pending() == 1
    rig.clock.run(until=start + dur)
    assert rig.queues[2].used_idx() == 1 and rig.irq.level
    assert rig.resp(resp).end_ns == start + dur


def test_effects_visible_only_at_command_end() -> None:
    """A probe event between two commands' end times sees the first, not the second."""
    rig = Rig(CFG)
    cid = rig.create_context()
    start = rig.clock.now
    seen: list[bytes] = []
    f1_end = start + CFG.cmd_overhead_ns + 1
    rig.clock.schedule(f1_end - start + 10, lambda: seen.append(rig.dev.memory.read(0, 8)), "probe")
    rig.clock.schedule(1, lambda: seen.append(rig.dev.memory.read(0, 8)), "probe0")
    rig.submit(cid, fill(0, 4, 0x11) + fill(4, 4, 0x22))
    assert seen == [bytes(8), struct.pack("<II", 0x11, 0)]
    assert rig.dev.memory.read(0, 8) == struct.pack("<II", 0x11, 0x22)


def test_early_application_without_other_events() -> None:
    """With other events far away, a multi-command buffer runs in one go."""
    rig = Rig(CFG)
    cid = rig.create_context()
    rig.clock.schedule(10**9, lambda: None, "far")
    resp = rig.submit_nowait(cid, b"".join(fill(4 * i, 4, i) for i in range(50)))
    rig.kick()
    assert rig.dev.memory.read(196, 4) == struct.pack("<I", 49)  # already applied
    assert rig.queues[2].used_idx() == 0  # but not completed
    rig.clock.run(until=10**8)
    assert rig.resp(resp).status == 0 and rig.queues[2].used_idx() == 1


def test_event_idx_suppresses_interrupt() -> None:
    rig = Rig(CFG)
    cid = rig.create_context()
    rig.ack_irq()
    q = rig.queues[2]
    q.w16(q.used_event_addr, 5)
    for i in range(3):
        rig.submit(cid, nop(), fence=i)
    assert not rig.irq.level
    for i in range(3):
        rig.submit(cid, nop(), fence=10 + i)  # used idx passes 6
    assert rig.irq.level and rig.r(0x60) == 1
    assert q.r16(q.avail_event_addr) == 6


def test_no_interrupt_flag_without_event_idx() -> None:
    rig = Rig(CFG, features=(1 << 32))
    cid = rig.create_context()
    rig.ack_irq()
    q = rig.queues[2]
    q.w16(q.avail, 1)
    rig.submit(cid, nop())
    assert not rig.irq.level
    q.w16(q.avail, 0)
    rig.submit(cid, nop())
    assert rig.irq.level


# --- reset -----------------------------------------------------------------------------

def test_reset_drops_in_flight_and_no_dma_after() -> None:
    rig = Rig(CFG)
    cid = rig.create_context()
    out = rig.alloc.alloc(8)
    resps = [rig.submit_nowait(cid, gemm(512, 512, 512, 0, 0, 0) + signal(out, 9), fence=i)
             for i in range(3)]
    rig.kick()
    ctl = rig.queues[0]
    req, o = rig.alloc.alloc(16), rig.alloc.alloc(8)
    ctl.add([(req, 16, False), (o, 8, True)])
    rig.dma.g_write(req, struct.pack("<IIII", 1, 0, 0, 0))
    rig.kick(0)
    rig.w(0x70, 0)
    n = len(rig.dma.log)
    rig.clock.run()
    assert rig.dma.log[n:] == []
    assert rig.clock.pending() == 0
    assert all(rig.resp(r).status == 0 and rig.resp(r).end_ns == 0 for r in resps)
    assert rig.dma.g_read(out, 8) == bytes(8)
    assert rig.dev.contexts == {} and rig.dev.processor.idle()
    # device memory is kept, function restored after re-init
    rig.dev.memory.write(100, b"keep")
    rig.init()
    assert rig.dev.memory.read(100, 4) == b"keep"
    cid = rig.create_context()
    assert cid == 1 and rig.submit(cid, eltwise(2, 0, 4, 0, 0, 64)).status == 0


def test_trace_is_deterministic() -> None:
    def scenario() -> list[tuple[str, dict[str, object]]]:
        rig = Rig(CFG)
        cid = rig.create_context()
        rng = np.random.default_rng(5)
        rig.dev.memory.write(0, rng.standard_normal(64).astype(np.float32).tobytes())
        for q in (2, 3):
            rig.submit_nowait(cid, gemm(4, 4, 4, 0, 64, 128) + nop(), fence=q, queue=q)
            rig.kick(q)
        rig.clock.run()
        rig.submit(cid, fill(3, 4, 0))
        return rig.tracer.events

    t1, t2 = scenario(), scenario()
    assert t1 == t2
    kinds = {k for k, _ in t1}
    assert {"cmd", "submit_start", "submit_end", "irq", "violation"} - kinds == {"violation"}
    cmd = [f for k, f in t1 if k == "cmd"][0]
    assert set(cmd) == {"opcode", "offset", "start_ns", "end_ns", "engine", "queue"}
    end = [f for k, f in t1 if k == "submit_end"][0]
    assert {"queue", "context", "fence", "status", "engine"} <= set(end)


def test_reset_from_inside_an_interrupt_issues_no_more_dma() -> None:
    """A platform that delivers the IRQ synchronously and whose handler resets the device."""
    rig = Rig(CFG)
    cid = rig.create_context()
    rig.ack_irq()
    box: dict[str, int] = {}

    def level(high: bool) -> None:
        rig.irq.history.append(high)
        if high and "n" not in box:
            rig.mmio.write(0x70, 4, 0)
            box["n"] = len(rig.dma.log)

    rig.irq.set_level = level  # type: ignore[method-assign]
    for i in range(4):  # four short chains: the first completes at once, then reset
        q = rig.queues[2]
        req, resp = rig.alloc.alloc(32), rig.alloc.alloc(32)
        q.add([(req, 8, False), (resp, 32, True)])
    rig.submit_nowait(cid, b"\0" * 8)
    rig.kick()
    rig.clock.run()
    assert "n" in box and rig.dma.log[box["n"]:] == []
    assert rig.mmio.violations == []
