"""Issue 13, done when: a ring-reset test resets one submit queue under load, with every
fence signalled exactly once and the other queues undisturbed (VIRTIO_F_RING_RESET on
virtio-mmio and virtio-pci, split and packed rings). Plus the driver's refusal without
the feature, and the watchdog resetting only the stalled queue."""
from __future__ import annotations

import errno
import struct
from typing import Any

import pytest

from guest_driver import uapi
from guest_driver.va1.driver import VA1Device, VA1Error
from hwspec import isa
from hwspec import va1 as A
from virtaccel.session import Session

NOPS = 200     # 200 NOPs of cmd_overhead_ns (500 ns): 100 us per submission
PER_QUEUE = 6


def _nop_buffer(dev: VA1Device) -> tuple[int, int]:
    one = struct.pack(isa.HEADER.format, isa.Opcode.NOP, 0, isa.HEADER.size)
    buf = one * NOPS
    iova = dev.alloc.alloc_dma(len(buf))
    dev.kernel.memory.write(iova, buf)
    return iova, len(buf)


def _under_load(os: uapi.GuestOS) -> dict[str, Any]:
    dev = os.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
    assert isinstance(dev, VA1Device)
    ctx = dev.create_context(flat=True)
    iova, n = _nop_buffer(dev)
    fences = {q: [dev.submit(ctx, q, iova, n) for _ in range(PER_QUEUE)] for q in (0, 1)}
    dev.kernel.sched.sleep(250_000)      # queue 0: two done, the third running
    done_before = [f.signalled for f in fences[0]]
    dev.reset_queue(0, "test")
    every = fences[0] + fences[1]
    dev.kernel.sched.wait_until(lambda: all(f.signalled for f in every), 10_000_000, "all")
    after = dev.submit(ctx, 0, iova, n)
    dev.wait_fence(after, 10_000_000)
    return {"done_before": done_before,
            "status": {q: [A.Status(f.status).name if f.signalled else "PENDING"
                           for f in fences[q]] for q in (0, 1)},
            "after": A.Status(after.status).name, "double": ctx.timeline.double_signals,
            "resets": dev.resets, "queue_resets": dev.queue_resets, "lost": ctx.lost}


@pytest.mark.parametrize("attach", ["mmio", "pci", "vfio"])
@pytest.mark.parametrize("ring", ["split", "packed"])
def test_one_submit_queue_reset_under_load(attach: str, ring: str) -> None:
    feats = ["indirect", "event_idx", "ring_reset"] + (["packed"] if ring == "packed" else [])
    with Session(attach=attach, seed=3, guest_features=feats) as s:
        r = s.run(_under_load)
        violations = _violations(s)
    assert r["done_before"][:2] == [True, True] and not all(r["done_before"])
    q0, q1 = r["status"][0], r["status"][1]
    assert q1 == ["OK"] * PER_QUEUE                      # the other queue undisturbed
    done = sum(r["done_before"])
    assert q0 == ["OK"] * done + ["ABORTED"] * (PER_QUEUE - done)
    assert r["double"] == 0                               # each fence signalled once
    assert (r["resets"], r["queue_resets"], r["lost"]) == (0, 1, False)
    assert r["after"] == "OK"                              # the queue works again
    assert violations == []


def _violations(s: Session) -> list[str]:
    out: list[str] = []
    for vm in s.vms:
        for acc in vm.accelerators:
            out += [v.rule for v in acc.transport.violations]
        for pacc in vm.pci_accelerators:
            out += [v.rule for v in pacc.function.violations]
    return out


def test_queue_reset_needs_the_feature() -> None:
    def program(os: uapi.GuestOS) -> int:
        dev = os.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
        try:
            dev.reset_queue(0)
        except VA1Error as e:
            return e.errno or 0
        return 0
    with Session(attach="mmio", seed=0) as s:
        assert s.run(program) == errno.EOPNOTSUPP


def test_watchdog_resets_only_the_stalled_queue() -> None:
    """A command that never ends (the fault port's hang with no preemption timeout):
    with RING_RESET the watchdog resets that submit queue alone; the context lives on."""
    device: list[Any] = []

    def program(os: uapi.GuestOS) -> dict[str, Any]:
        dev = os.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
        ctx = dev.create_context(flat=True)
        device[0].processor.fs.preemption_timeout_ns = 0   # the hang never ends
        device[0].fault_port.hang_next_command()
        iova, n = _nop_buffer(dev)
        hung = dev.submit(ctx, 0, iova, n)
        dev.wait_fence(hung, 5_000_000_000)
        again = dev.submit(ctx, 0, iova, n)
        dev.wait_fence(again, 10_000_000)
        return {"hung": A.Status(hung.status).name, "again": A.Status(again.status).name,
                "fires": dev.watchdog_fires, "resets": dev.resets,
                "queue_resets": dev.queue_resets, "lost": ctx.lost}
    with Session(attach="mmio", seed=0,
                 guest_features=["indirect", "event_idx", "ring_reset"]) as s:
        device.append(s.vms[0].accelerators[0].device)
        r = s.run(program)
    assert r == {"hung": "ABORTED", "again": "OK", "fires": 1, "resets": 0,
                 "queue_resets": 1, "lost": False}
