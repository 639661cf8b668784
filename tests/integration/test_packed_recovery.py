"""The driver's recovery works on packed rings too (issue 13): a lost interrupt is polled
and re-armed through the packed driver event, and a DEVICE_NEEDS_RESET completes every
fence in flight ABORTED exactly once, then the function works again."""
from __future__ import annotations

import struct
from typing import Any

import pytest

from guest_driver import uapi
from hwspec import isa
from hwspec import va1 as A
from virtaccel.session import Session
from vmm.faults import FaultEntry, FaultPlan

FEATURES = ["packed", "indirect", "event_idx", "in_order", "notification_data"]


def _work(os: uapi.GuestOS) -> dict[str, Any]:
    dev = os.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
    ctx = dev.create_context(flat=True)
    one = struct.pack(isa.HEADER.format, isa.Opcode.NOP, 0, isa.HEADER.size) * 20
    iova = dev.alloc.alloc_dma(len(one))
    dev.kernel.memory.write(iova, one)
    fences = [dev.submit(ctx, q % 2, iova, len(one)) for q in range(12)]
    dev.kernel.sched.wait_until(lambda: all(f.signalled for f in fences), 50_000_000, "all")
    after_ctx = dev.create_context(flat=True)
    after = dev.submit(after_ctx, 0, iova, len(one))
    dev.wait_fence(after, 10_000_000)
    return {"status": [A.Status(f.status).name if f.signalled else "PENDING" for f in fences],
            "double": ctx.timeline.double_signals, "after": A.Status(after.status).name,
            "resets": dev.resets, "lost": dev.lost_interrupts,
            "features": dev.features}


@pytest.mark.parametrize("attach", ["pci", "vfio"])
def test_lost_interrupt_is_polled_on_a_packed_ring(attach: str) -> None:
    plan = FaultPlan([FaultEntry("vm0", "drop_interrupt", after=6, on="interrupt")])
    with Session(attach=attach, seed=2, guest_features=FEATURES, faults=plan) as s:
        r = s.run(_work)
    assert r["features"] >> 34 & 1                      # packed was negotiated
    assert r["status"] == ["OK"] * 12 and r["after"] == "OK"
    assert r["lost"] >= 1 and r["resets"] == 0 and r["double"] == 0


@pytest.mark.parametrize("attach", ["mmio", "pci", "vfio"])
def test_needs_reset_aborts_once_and_recovers_on_a_packed_ring(attach: str) -> None:
    plan = FaultPlan([FaultEntry("vm0", "needs_reset", after=3, on="submission")])
    with Session(attach=attach, seed=2, guest_features=FEATURES, faults=plan) as s:
        r = s.run(_work)
    assert r["resets"] == 1 and r["double"] == 0 and r["after"] == "OK"
    assert "ABORTED" in r["status"] and "PENDING" not in r["status"]
    assert set(r["status"]) <= {"OK", "ABORTED"}
