"""`va1.poll_wait=1`: fence waits poll the used ring with the submit queues' interrupts
off (EVENT_IDX used_event parked, VRING_AVAIL_F_NO_INTERRUPT, or the packed ring's
DISABLE), so a round trip costs one MMIO exit (the kick) instead of three, and no
interrupt is delivered for it. Off by default: default runs keep their traces."""
from __future__ import annotations

from typing import Any

import pytest

import userspace_runtime as rt
from virtaccel.session import Session

ROUNDS = 20


def _round_trips(os_: Any) -> dict[str, Any]:
    with rt.Device(os_) as dev:
        ctx = dev.create_context()
        s = ctx.create_stream()
        nop = rt.CommandBufferBuilder()
        nop.nop()
        for _ in range(ROUNDS):
            s.enqueue(nop)
            s.synchronize()
        for _ in range(300):   # more than a queue holds: waits for ring space poll too
            s.enqueue(nop)
            s.flush()
        s.synchronize()
        ok = all(r.status == 0 for r in s.submissions)
        return {"ok": ok, "n": len(s.submissions), "stats": dev.stats()}


def _run(cmdline: str, features: tuple[str, ...]) -> tuple[dict[str, Any], int, list[str]]:
    with Session(attach="mmio", cmdline=cmdline, guest_features=features,
                 keep_trace=True) as session:
        result = session.run(_round_trips, name="poll")
        kinds = [e.kind for e in session.machine.trace.events if e.source == "vm0.irq"]
        return result, session.vms[0].mmio.exits, kinds


@pytest.mark.parametrize("features", [("indirect", "event_idx"), ("indirect",),
                                      ("packed", "event_idx"), ("packed",)])
def test_polled_waits_skip_the_interrupt(features: tuple[str, ...]) -> None:
    polled, polled_exits, polled_irqs = _run("va1.poll_wait=1", features)
    plain, plain_exits, plain_irqs = _run("", features)
    assert polled["ok"] and plain["ok"] and polled["n"] == plain["n"] == ROUNDS + 300
    assert polled["stats"]["lost_interrupts"] == 0
    # every interrupt of the plain run costs two exits (ISR read, ACK write)
    assert plain_irqs.count("irq") > ROUNDS
    assert plain_exits - polled_exits >= 2 * ROUNDS
    assert polled_irqs.count("irq") < 10   # control requests only (context, buffers)


def test_polled_ring_space_waits_beside_another_vm() -> None:
    """Two polled VMs side by side: their fence and ring-space waits reap used rings the
    device writes, so those conditions stay unmarked for the machine's ready set (every
    pick is checked against a full scan in tests)."""
    with Session(attach="mmio", vms=2, cmdline="va1.poll_wait=1", seed=3) as session:
        tasks = session.run_all([_round_trips, _round_trips])
    assert [t.error for t in tasks] == [None, None]
    results = [t.result for t in tasks]
    assert [r["ok"] for r in results] == [True, True]
    assert [r["n"] for r in results] == [ROUNDS + 300] * 2
