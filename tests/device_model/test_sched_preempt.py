"""Quantum preemption at command boundaries, preemption timeout, WAIT, VF stop/resume
and VF FLR on a shared card (virtual time, deterministic)."""
from __future__ import annotations

import struct

import dm_sriov as S
import numpy as np
from dm_driver import Resp
from dm_pci_driver import PciRig
from dm_sriov import Card, Saturator, nops, run_until

from device_model import Va1Config
from hwspec import isa

NOP_NS = 10_000


def _card(n: int, units: int = 1) -> Card:
    c = Card(Va1Config(cmd_overhead_ns=NOP_NS, num_compute_units=units),
             memory=128 * S.MIB, ram=1 << 20)
    c.pf.use_all()
    c.pf.enable_vfs(n)
    return c


def _submit(rig: PciRig, ctx: int, buf: bytes, queue: int = 2, fence: int = 1) -> int:
    resp = rig.submit_nowait(ctx, buf, fence, queue)
    rig.kick(queue)
    return resp


def _resp(rig: PciRig, resp: int) -> Resp:
    return Resp(*struct.unpack("<IIQQQ", rig.dma.g_read(resp, 32)))


def _wait_cmd(addr: int, value: int) -> bytes:
    return struct.pack("<HHIQQ", isa.Opcode.WAIT, 0, 24, addr, value)


def _fill(dst: int, size: int, pattern: int) -> bytes:
    return struct.pack("<HHIQQII", isa.Opcode.FILL, 0, 32, dst, size, pattern, 0)


def _cmds(c: Card, queue: int) -> list[dict[str, object]]:
    return [e for e in c.tracer.kinds("cmd") if e["queue"] == queue]


def test_quantum_preempts_at_a_command_boundary_and_resumes_at_the_next_command() -> None:
    c = _card(2)
    assert c.pf.set_resources(1, 16 * S.MIB, quantum=30_000) == (0, 0)
    assert c.pf.set_resources(2, 16 * S.MIB, quantum=30_000) == (0, 0)
    a, b = c.vf_rig(1), c.vf_rig(2)
    ca, cb = a.create_context(), b.create_context()
    t0 = c.clock.now
    ra = _submit(a, ca, nops(10))
    c.clock.run(until=t0 + 15_000)              # A is inside its second NOP
    rb = _submit(b, cb, nops(2))
    c.clock.run()
    resp_a, resp_b = _resp(a, ra), _resp(b, rb)
    assert resp_a.status == resp_b.status == 0
    pre = [e for e in c.tracer.events if e[0] == "preempt"]
    assert len(pre) == 1
    # the quantum (30 us) ran out at the boundary after the third NOP
    assert pre[0][1]["at_ns"] == t0 + 30_000 and pre[0][1]["offset"] == 3
    # B ran its two NOPs then; A resumed at its fourth command and finished after B
    assert (resp_b.start_ns, resp_b.end_ns) == (t0 + 30_000, t0 + 50_000)
    assert resp_a.start_ns == t0                 # start_ns stays the first start
    assert resp_a.end_ns == t0 + 120_000
    a_cmds = [e for e in c.tracer.kinds("cmd") if e["start_ns"] >= t0 and e["engine"] == 0]
    order = [(e["start_ns"], e["offset"]) for e in a_cmds]
    assert order == sorted(order)
    assert c.card.vf_devices[0].metrics.preemptions == 1
    assert c.card.vf_devices[0].metrics.device_time_ns >= 100_000


def test_no_preemption_without_a_competitor() -> None:
    c = _card(2)
    assert c.pf.set_resources(1, 16 * S.MIB, quantum=10_000) == (0, 0)
    a = c.vf_rig(1)
    ca = a.create_context()
    t0 = c.clock.now
    r = _submit(a, ca, nops(20))
    c.clock.run()
    assert _resp(a, r).end_ns == t0 + 200_000
    assert not [e for e in c.tracer.events if e[0] == "preempt"]


def test_command_past_the_preemption_timeout_fails_and_faults_its_context() -> None:
    c = _card(2, units=2)
    # FILL of 1 MiB at 1 TB/s: 10 us overhead + 1.05 us; a NOP 10 us; timeout 10.5 us
    assert c.pf.set_resources(1, 16 * S.MIB, timeout=10_500) == (0, 0)
    a, b = c.vf_rig(1), c.vf_rig(2)
    ca, cb = a.create_context(), b.create_context()
    t0 = c.clock.now
    r = _submit(a, ca, nops(1) + _fill(0, 1 << 20, 0xDEADBEEF))
    rb = _submit(b, cb, _fill(0, 1 << 20, 0x01010101))
    c.clock.run()
    got = _resp(a, r)
    assert (got.status, got.error_offset) == (16, 8)          # TIMEOUT at the FILL
    assert got.end_ns == t0 + NOP_NS + 10_500
    assert not c.card.vf_devices[0].memory.data[: 1 << 20].any()   # stopped: not applied
    assert c.card.vf_devices[0].contexts[ca].faulted
    r2 = _submit(a, ca, nops(1), fence=2)
    c.clock.run()
    assert _resp(a, r2).status == 9                          # CONTEXT_FAULTED
    assert _resp(b, rb).status == 0                          # VF 2 (default timeout) fine
    assert (c.card.vf_devices[1].memory.data[: 1 << 20] == 1).all()
    st, q, raw = c.pf.admin_cmd(S.VF_STATS, 1, result_len=56)
    assert (st, q) == (0, 0) and struct.unpack(S.STATS_FMT, raw)[6] == 1   # timeouts


def test_wait_never_satisfied_times_out_while_others_keep_completing() -> None:
    c = _card(2)
    assert c.pf.set_resources(1, 16 * S.MIB, timeout=2_000_000) == (0, 0)
    a, b = c.vf_rig(1), c.vf_rig(2)
    ca, cb = a.create_context(), b.create_context()
    flag = a.put(bytes(8), 8)
    t0 = c.clock.now
    events0 = len(c.tracer.events)
    r = _submit(a, ca, nops(1) + _wait_cmd(flag, 1))
    load = Saturator(b, cb, nops(3), depth=2)
    run_until(c.clock, t0 + 5_000_000, [load])
    load.stopped = True
    got = _resp(a, r)
    assert (got.status, got.error_offset) == (16, 8)          # TIMEOUT at the WAIT
    assert got.end_ns >= t0 + NOP_NS + 2_000_000
    assert c.card.vf_devices[0].contexts[ca].faulted
    # the other function kept completing before, during and after the WAIT
    ends = sorted(r.end_ns for _, _, r in load.done)
    assert all(r.status == 0 for _, _, r in load.done)
    assert any(t0 + 100_000 < e < t0 + 2_000_000 for e in ends)
    assert any(e > t0 + 2_100_000 for e in ends)
    # polls back off: far fewer poll events than 1-us polling would need
    polls = sum(1 for k, _ in c.tracer.events[events0:] if k == "wait_yield")
    assert polls < 2 * len(load.done) + 100
    # the faulted context refuses new work
    r2 = _submit(a, ca, nops(1), fence=2)
    c.clock.run()
    assert _resp(a, r2).status == 9                          # CONTEXT_FAULTED


def test_wait_alone_polls_with_backoff_and_completes_when_the_value_arrives() -> None:
    c = _card(1)
    a = c.vf_rig(1)
    ca = a.create_context()
    flag = a.put(bytes(8), 8)
    t0 = c.clock.now
    r = _submit(a, ca, _wait_cmd(flag, 5))
    c.clock.schedule(300_000, lambda: a.dma.g_write(flag, struct.pack("<Q", 4)), "w4")
    c.clock.schedule(700_000, lambda: a.dma.g_write(flag, struct.pack("<Q", 7)), "w7")
    c.clock.run()
    got = _resp(a, r)
    assert got.status == 0
    # polls at +0, +1, +3, +7, ... us, then every 64 us: the first poll after 700 us
    polls = [0]
    step = isa.WAIT_POLL_MIN_NS
    while polls[-1] < 700_000:
        polls.append(polls[-1] + step)
        step = min(2 * step, isa.WAIT_POLL_MAX_NS)
    assert got.end_ns == t0 + polls[-1] + NOP_NS
    assert len(polls) < 20


def test_vf_stop_holds_work_and_resume_releases_it() -> None:
    c = _card(2, units=2)
    a, b = c.vf_rig(1), c.vf_rig(2)
    ca, cb = a.create_context(), b.create_context()
    t0 = c.clock.now
    r_long = _submit(a, ca, nops(20))
    c.clock.run(until=t0 + 25_000)
    assert c.pf.admin_cmd(S.VF_STOP, 1)[:2] == (0, 0)        # completes at +overhead
    stop_at = c.clock.now
    r_queued = _submit(a, ca, nops(1), queue=3, fence=2)
    rb = _submit(b, cb, nops(5))
    c.clock.run(until=stop_at + 1_000_000)
    assert a.queues[2].used_idx() == 0 and a.queues[3].used_idx() == 0   # held
    assert _resp(b, rb).status == 0 and b.queues[2].used_idx() == 1
    last = max(e["end_ns"] for e in c.tracer.kinds("cmd") if e["engine"] is not None
               and e["queue"] == 2 and e["start_ns"] >= t0 and e["end_ns"] <= stop_at + NOP_NS)
    # nothing of VF 1 ran after the boundary following the stop
    assert last <= stop_at + NOP_NS
    assert c.pf.admin_cmd(S.VF_RESUME, 1)[:2] == (0, 0)
    c.clock.run()
    got = _resp(a, r_long)
    assert got.status == 0 and got.start_ns == t0
    assert _resp(a, r_queued).status == 0


def test_flr_of_a_vf_leaves_the_others_running() -> None:
    c = _card(3, units=2)
    rigs = [c.vf_rig(n) for n in (1, 2, 3)]
    loads = [Saturator(r, r.create_context(), _fill(0x1000, 4096, 0x0A0B0C0D + i), depth=2)
             for i, r in enumerate(rigs)]
    t0 = c.clock.now
    run_until(c.clock, t0 + 2_000_000, loads)
    done_before = [len(ld.done) for ld in loads]
    c.card.vf_functions[1].function_level_reset()       # VF 2 FLR
    assert c.card.vf_functions[1].status == 0
    assert not c.card.vf_devices[1].memory.data.any()        # scrubbed
    loads[1].stopped = True
    run_until(c.clock, t0 + 4_000_000, [loads[0], loads[2]])
    for i in (0, 2):
        assert len(loads[i].done) > done_before[i] + 10
        assert all(r.status == 0 for _, _, r in loads[i].done)
        mem = c.card.vf_devices[i].memory.data
        assert (mem[0x1000:0x2000].view("<u4") == 0x0A0B0C0D + i).all()
    # after FLR, nothing of VF 2 ran
    assert not c.card.vf_devices[1].memory.data.any()


def test_vf_reset_by_admin_is_an_flr() -> None:
    c = _card(2)
    a = c.vf_rig(1)
    ca = a.create_context()
    assert a.submit(ca, _fill(0, 64, 0x55555555)).status == 0
    assert c.card.vf_devices[0].memory.data[:64].all()
    assert c.pf.admin_cmd(S.VF_RESET, 1)[:2] == (0, 0)
    assert c.card.vf_functions[0].status == 0 and c.card.vf_devices[0].contexts == {}
    assert not c.card.vf_devices[0].memory.data[:64].any()
    assert np.all(c.card.vf_functions[0].config_read(0x04, 2) == 0)  # command register cleared


def test_strict_priority_preempts_before_the_quantum_and_is_not_preempted() -> None:
    c = _card(2)
    assert c.pf.set_resources(1, 16 * S.MIB, prio=0, quantum=1_000_000_000) == (0, 0)
    assert c.pf.set_resources(2, 16 * S.MIB, prio=2, quantum=10_000) == (0, 0)
    lo, hi = c.vf_rig(1), c.vf_rig(2)
    cl, ch = lo.create_context(), hi.create_context()
    t0 = c.clock.now
    r_lo = _submit(lo, cl, nops(10))
    c.clock.run(until=t0 + 15_000)
    r_hi = _submit(hi, ch, nops(5))
    c.clock.run()
    a, b = _resp(lo, r_lo), _resp(hi, r_hi)
    # the realtime VF took the engine at the next boundary (20 us) and kept it
    assert (b.start_ns, b.end_ns) == (t0 + 20_000, t0 + 70_000)
    assert a.end_ns == t0 + 150_000
    assert c.card.vf_devices[1].metrics.preemptions == 0


def test_round_robin_across_contexts_within_a_function() -> None:
    rig = PciRig(Va1Config(num_submit_queues=3, num_compute_units=1, cmd_overhead_ns=NOP_NS,
                           device_memory_size=1 << 20))
    c1, c2 = rig.create_context(), rig.create_context()
    resps = [rig.submit_nowait(c1, nops(1), 1, 2), rig.submit_nowait(c1, nops(1), 2, 2),
             rig.submit_nowait(c1, nops(1), 3, 3), rig.submit_nowait(c2, nops(1), 4, 4)]
    t0 = rig.clock.now
    for q in (2, 3, 4):
        rig.kick(q)
    rig.clock.run()
    starts = {f: _resp(rig, r).start_ns - t0 for f, r in zip((1, 2, 3, 4), resps)}
    # c1 (queue 2), then c2 (queue 4) before c1's other queue, then c1 again
    assert starts[1] == 0 and starts[4] == NOP_NS
    assert sorted((starts[2], starts[3])) == [2 * NOP_NS, 3 * NOP_NS]
