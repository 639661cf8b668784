"""PCI Command.Bus Master cleared with work in flight (spec §3a "Bus Master"): the
function issues no memory request while it is 0 (no DMA into guest RAM, no MSI), its
work is held, and it completes, every fence exactly once, when Bus Master is set again.
Over the emulated virtio-pci function and over VFIO passthrough of the host function."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import pci as P
from hwspec import va1
from userspace_runtime import CommandBufferBuilder
from virtaccel import Session

SEED = 20260707
MIB = 1 << 20
PATTERN_A, PATTERN_B = 0x5A5A_5A5A, 0xC3C3_C3C3
HOLD_NS = 5_000_000        # Bus Master off this long: far past every command's end


@pytest.mark.parametrize("attach", ["pci", "vfio"])
def test_work_in_flight_is_held_while_bus_master_is_off_and_completes_after(
        attach: str) -> None:
    """Queue 0: FILL, a WAIT that parks on a flag in guest RAM, then a D2H of 4 KiB.
    Queue 1: FILL, then a 1 MiB D2H that is still in flight. The guest clears Bus Master,
    then satisfies the WAIT: for 5 ms nothing in guest RAM changes (data, responses,
    used rings) and no MSI is sent. Bus Master back on: both complete OK, with their
    data, each fence once."""
    s = Session(attach=attach, seed=SEED, keep_trace=True).launch()
    seen: dict[str, Any] = {}

    def program(os_: uapi.GuestOS) -> None:
        drv = os_.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
        k = drv.kernel
        ctx = drv.create_context()
        drv.ctx_map(ctx, 0, 0, 4 * MIB)
        flag = drv.alloc.alloc(4096, 4096)
        data_a = drv.alloc.alloc(4096, 4096)
        data_b = drv.alloc.alloc(MIB, 4096)
        k.memory.write(flag, bytes(8))
        a = CommandBufferBuilder()
        a.fill(0, 4096, PATTERN_A)
        a.wait(flag, 1)
        a.dma_d2h(0, data_a, 4096)
        b = CommandBufferBuilder()
        b.fill(MIB, MIB, PATTERN_B)
        b.dma_d2h(MIB, data_b, MIB)
        bufs = []
        for cb in (a, b):
            addr = drv.alloc.alloc(len(cb), 4096)
            k.memory.write(addr, cb.bytes())
            bufs.append((addr, len(cb)))
        fa = drv.submit(ctx, 0, *bufs[0])
        fb = drv.submit(ctx, 1, *bufs[1])
        k.sched.sleep(10_000)          # A polls its flag; B's 1 MiB D2H runs (~33 us)
        assert not fa.signalled and not fb.signalled
        cfg = drv.transport.fn.cfg
        command = cfg.read16(P.COMMAND)
        assert command & P.COMMAND_MASTER
        cfg.write16(P.COMMAND, command & ~P.COMMAND_MASTER)
        seen["off_ns"] = k.sched.now_ns()
        k.memory.write(flag, (1).to_bytes(8, "little"))        # the WAIT is satisfied
        ram = k.ram
        before = bytes(k.memory.read(ram.base, ram.size))
        k.sched.sleep(HOLD_NS)
        after = bytes(k.memory.read(ram.base, ram.size))
        seen["ram_unchanged"] = before == after
        seen["signalled_while_off"] = (fa.signalled, fb.signalled)
        seen["on_ns"] = k.sched.now_ns()
        cfg.write16(P.COMMAND, command)
        assert drv.wait_fence(fa, 10**9) and drv.wait_fence(fb, 10**9)
        seen["status"] = (fa.status, fb.status)
        seen["end_ns"] = (fa.end_ns, fb.end_ns)
        seen["data_a"] = np.frombuffer(k.memory.read(data_a, 4096), np.uint32).copy()
        seen["data_b"] = np.frombuffer(k.memory.read(data_b, MIB), np.uint32).copy()
        seen["double"] = ctx.timeline.double_signals
        seen["fences"] = [(f.seq, f.signalled) for f in ctx.timeline.fences.values()]
        # the function works on as before
        c = CommandBufferBuilder()
        c.fill(0, 4096, 0x1111_1111)
        c.dma_d2h(0, data_a, 4096)
        addr = drv.alloc.alloc(len(c), 4096)
        k.memory.write(addr, c.bytes())
        fc = drv.submit(ctx, 0, addr, len(c))
        assert drv.wait_fence(fc, 10**9)
        seen["after"] = (fc.status, k.memory.read(data_a, 4))

    with s:
        s.run(program, name="bme")
    assert seen["ram_unchanged"], "the device wrote guest RAM with Bus Master off"
    assert seen["signalled_while_off"] == (False, False)
    assert seen["status"] == (va1.Status.OK, va1.Status.OK)
    assert (seen["data_a"] == PATTERN_A).all() and (seen["data_b"] == PATTERN_B).all()
    assert seen["double"] == 0 and seen["fences"] == [(1, True), (2, True)]
    # the WAIT and the held D2H both ended once Bus Master was back, not before
    assert all(end >= seen["on_ns"] for end in seen["end_ns"])
    assert seen["after"] == (va1.Status.OK, (0x1111_1111).to_bytes(4, "little"))
    events = s.machine.trace.events
    window = [e for e in events if seen["off_ns"] <= e.t_ns < seen["on_ns"]]
    assert not [e for e in window if e.kind in ("msix", "msi", "cmd", "submit_end")]
    assert [e for e in window if e.kind == "dma_held"]
    # each submission completed exactly once
    ends = [dict(e.fields)["fence"] for e in events if e.kind == "submit_end"]
    assert sorted(ends) == [1, 2, 3]


def test_reset_while_work_is_held_aborts_every_fence_once_and_writes_nothing() -> None:
    """Bus Master off with a submission held, then the driver resets the function (it
    sets Bus Master again as part of recovery): the held work is dropped, the fence
    completes ABORTED exactly once, and the device never writes the held data."""
    s = Session(attach="pci", seed=SEED, keep_trace=True).launch()
    seen: dict[str, Any] = {}

    def program(os_: uapi.GuestOS) -> None:
        drv = os_.devices["/dev/accel/accel0"]  # type: ignore[attr-defined]
        k = drv.kernel
        ctx = drv.create_context()
        drv.ctx_map(ctx, 0, 0, 4 * MIB)
        data = drv.alloc.alloc(MIB, 4096)
        b = CommandBufferBuilder()
        b.fill(0, MIB, PATTERN_B)
        b.dma_d2h(0, data, MIB)
        addr = drv.alloc.alloc(len(b), 4096)
        k.memory.write(addr, b.bytes())
        fence = drv.submit(ctx, 0, addr, len(b))
        k.sched.sleep(5_000)
        cfg = drv.transport.fn.cfg
        command = cfg.read16(P.COMMAND)
        cfg.write16(P.COMMAND, command & ~P.COMMAND_MASTER)
        k.sched.sleep(HOLD_NS)
        drv.recover("test: reset with Bus Master off")
        cfg.write16(P.COMMAND, command)
        k.sched.sleep(HOLD_NS)
        seen["fence"] = (fence.signalled, fence.status)
        seen["double"] = ctx.timeline.double_signals
        seen["data"] = bytes(k.memory.read(data, MIB))

    with s:
        s.run(program, name="bme-reset")
    assert seen["fence"] == (True, va1.Status.ABORTED) and seen["double"] == 0
    assert seen["data"] == bytes(MIB)
