"""NEEDS_RESET and recovery across the real driver and the real device.

A buggy (or hostile) agent breaks a submit ring behind the driver's back. The device
must name the rule, set DEVICE_NEEDS_RESET and raise the config interrupt; the driver
must reset and re-initialise; afterwards the function works in full again.
"""
from __future__ import annotations

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import va1, virtio, virtio_mmio
from userspace_runtime import Device, DeviceError, DriverError
from virtaccel import Session
from virtaccel.guests import mlp

SEED = 424242


def test_broken_ring_sets_needs_reset_and_driver_recovers_to_full_function() -> None:
    with Session(attach="mmio", seed=SEED, keep_trace=True) as s:
        check_recovery(s)


def check_recovery(s: Session) -> None:
    vm = s.vm
    acc = vm.accelerators[0]
    submitq = acc.transport.queues[va1.FIRST_SUBMITQ]
    seen: dict[str, object] = {}

    def break_the_ring() -> None:
        # avail.idx jumps by more than the queue size, then a doorbell.
        idx = int.from_bytes(vm.memory.read(submitq.avail_ring + 2, 2), "little")
        vm.memory.write(submitq.avail_ring + 2, ((idx + submitq.size + 5) & 0xFFFF).to_bytes(2, "little"))
        vm.bus.write(acc.platform.base + virtio_mmio.QUEUE_NOTIFY, 4, va1.FIRST_SUBMITQ)
        seen["status_after_break"] = acc.transport.read(virtio_mmio.STATUS, 4)

    def program(os_: uapi.GuestOS) -> dict[str, object]:
        dev = Device(os_)
        ctx = dev.create_context()
        stream = ctx.create_stream()
        buf = ctx.alloc((256,), np.float32)
        stream.fill(buf, 1.5)
        before = stream.download(buf).result()
        break_the_ring()
        # Work on the old context fails (aborted or refused), and says so.
        with pytest.raises((DeviceError, DriverError)):
            stream.fill(buf, 2.5)
            stream.download(buf).result()
        # A fresh open after recovery has the whole function again.
        return {"before": float(before.sum()), "after": mlp.main(os_, seed=SEED, batch=8)}

    result = s.run(program, name="recovery")
    assert result["before"] == pytest.approx(1.5 * 256)
    assert result["after"]["ok"] is True
    assert seen["status_after_break"] & virtio.STATUS_DEVICE_NEEDS_RESET
    assert [v.rule for v in acc.transport.violations] == ["ring/avail-idx-jump"]
    kinds = [ev.kind for ev in s.trace.events]
    assert "ring_broken" in kinds and "reset" in kinds
    # after recovery the device is live and clean again
    status = acc.transport.read(virtio_mmio.STATUS, 4)
    assert status & virtio.STATUS_DRIVER_OK and not status & virtio.STATUS_DEVICE_NEEDS_RESET
