"""The device's own failures stay inside the function that met them (spec §6 "Device
failures"): a command whose kernel raises fails DEVICE_ERROR at its offset and faults
its context; a failure outside any command sets DEVICE_NEEDS_RESET on that function
alone. Nothing raises into the platform, the engine is released, other functions run on."""
from __future__ import annotations

import dataclasses
import struct

import dm_sriov as S
import pytest
from dm_driver import Rig, fill, nop, signal
from dm_pci_driver import PciRig
from dm_sriov import Card

from device_model import Va1Config
from device_model.ports import DmaPort
from device_model.va1 import commands as C
from device_model.va1 import device as D
from hwspec.isa import Opcode
from hwspec.va1 import NO_OFFSET, Status

BOOM = 0xB00B00  # the FILL pattern whose kernel "fails"


def _failing_fill(monkeypatch: pytest.MonkeyPatch, exc: Exception,
                  only: DmaPort | None = None) -> None:
    """FILL raises `exc` for pattern BOOM (on DMA port `only`, when given)."""
    real = C.OPS[Opcode.FILL]

    def execute(cmd: C.Command, dma: DmaPort, start_ns: int) -> None:
        if cmd.value == BOOM and (only is None or dma is only):
            raise exc
        real.execute(cmd, dma, start_ns)

    monkeypatch.setitem(C.OPS, Opcode.FILL, dataclasses.replace(real, execute=execute))


@pytest.mark.parametrize("exc", [MemoryError("Unable to allocate 64 GiB"),
                                 RuntimeError("kernel bug")], ids=["MemoryError", "RuntimeError"])
def test_a_kernel_that_raises_fails_its_command_device_error(
        monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    _failing_fill(monkeypatch, exc)
    rig = Rig(Va1Config(cmd_overhead_ns=1_000))
    ev = rig.post_event_buffer()
    ctx = rig.create_context()
    r = rig.submit(ctx, nop() + fill(0, 64, BOOM) + fill(64, 64, 1))
    assert Status(r.status) is Status.DEVICE_ERROR and Status.DEVICE_ERROR == 18
    assert r.error_offset == 8
    assert r.end_ns - r.start_ns == 1_000 + 1_001   # the NOP, then the failing FILL's cost
    assert rig.dev.memory.read(64, 4) == b"\0" * 4      # nothing after it ran
    assert rig.dev.contexts[ctx].faulted                # the context is faulted ...
    etype, ecid, efence, estatus, eoff = struct.unpack("<IIQII", rig.dma.g_read(ev, 24))
    assert (etype, ecid, estatus, eoff) == (1, ctx, 18, 8)   # ... and says so on eventq
    assert rig.dev.metrics.device_errors == 1 and rig.dev.metrics.faults == 1
    [err] = rig.tracer.kinds("cmd_error")
    assert err["opcode"] == "FILL" and err["error"] == type(exc).__name__
    assert rig.dev.processor.engines == [None] * len(rig.dev.processor.engines)
    assert rig.submit(ctx, nop()).status == Status.CONTEXT_FAULTED
    other = rig.create_context()                         # the function runs on
    assert rig.submit(other, fill(0, 64, 7)).status == 0
    assert rig.dev.memory.read(0, 4) == bytes([7, 0, 0, 0])
    assert rig.r(0x70) & 0x40 == 0                       # no NEEDS_RESET


def test_a_failing_command_buffer_decode_fails_the_submission_device_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig()
    ctx = rig.create_context()

    def decode(buf: bytes, env: C.DecodeEnv) -> list[C.Command]:
        raise MemoryError("views")

    monkeypatch.setattr(D, "decode", decode)
    r = rig.submit(ctx, nop())
    assert (Status(r.status), r.error_offset) == (Status.DEVICE_ERROR, NO_OFFSET)
    assert r.start_ns == r.end_ns
    assert [e["where"] for e in rig.tracer.kinds("device_error")] == ["prepare"]
    assert rig.dev.contexts[ctx].faulted


def _card(units: int = 1) -> Card:
    c = Card(Va1Config(cmd_overhead_ns=1_000, num_compute_units=units),
             memory=128 * S.MIB, ram=1 << 20)
    c.pf.use_all()
    c.pf.enable_vfs(2)
    return c


def _submit(rig: PciRig, ctx: int, buf: bytes, fence: int = 1) -> int:
    resp = rig.submit_nowait(ctx, buf, fence, 2)
    rig.kick(2)
    return resp


def _resp(rig: PciRig, addr: int) -> tuple[int, ...]:
    return struct.unpack("<IIQQQ", rig.dma.g_read(addr, 32))


def test_a_vf_whose_kernel_raises_fails_alone_while_the_other_vf_runs_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = _card(units=1)
    a, b = c.vf_rig(1), c.vf_rig(2)
    _failing_fill(monkeypatch, MemoryError("boom"), only=c.platform.dmas[1])
    ca, cb = a.create_context(), b.create_context()
    flag = b.alloc.alloc(8)
    # VF 2's work is queued behind VF 1's on the one compute unit: VF 1's failure
    # happens inside the dispatch that VF 2's events drive.
    rb0 = _submit(b, cb, fill(0, 4096, BOOM) + nop())   # same pattern, other VF: no fault
    ra = _submit(a, ca, nop() + fill(0, 64, BOOM) + nop())
    rb = _submit(b, cb, fill(0, 4096, 5) + signal(flag, 9), fence=2)
    c.clock.run()
    assert _resp(b, rb0)[0] == 0
    assert _resp(a, ra)[:2] == (Status.DEVICE_ERROR, 8)
    assert _resp(b, rb)[0] == 0 and int.from_bytes(b.dma.g_read(flag, 8), "little") == 9
    assert c.card.scheduler.engines == [None]
    dev_a, dev_b = c.card.vf_devices
    assert dev_a.processor.fs.running == dev_b.processor.fs.running == 0
    assert dev_a.contexts[ca].faulted and not dev_b.contexts[cb].faulted
    # VF 1 keeps working with a fresh context; its submission count is one per fence
    ca2 = a.create_context()
    assert a.submit(ca2, fill(0, 64, 3), fence=3).status == 0
    ends = [e for e in c.tracer.kinds("submit_end") if e["status"] == "DEVICE_ERROR"]
    assert len(ends) == 1


def test_a_failure_outside_any_command_needs_reset_on_that_vf_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = _card(units=1)
    a, b = c.vf_rig(1), c.vf_rig(2)
    ca, cb = a.create_context(), b.create_context()
    dev_a = c.card.vf_devices[0]

    def broken_completion(sub: object) -> None:
        raise RuntimeError("completion bug")

    monkeypatch.setattr(dev_a.processor, "_complete", broken_completion)
    ra = _submit(a, ca, nop() + nop())
    rb = _submit(b, cb, nop() + fill(0, 64, 4))
    c.clock.run()                                         # nothing raises out of the clock
    assert _resp(b, rb)[0] == 0
    assert a.c8(20) & 0x40                                # VF 1: DEVICE_NEEDS_RESET
    assert not b.c8(20) & 0x40
    assert _resp(a, ra)[0] == 0 and a.queues[2].pop_used() is None   # never completed
    assert c.card.scheduler.engines == [None] and dev_a.processor.fs.running == 0
    assert [e["where"] for e in c.tracer.kinds("device_error")] == ["function"]
    assert any(e["rule"] == "device/internal" for e in c.tracer.kinds("ring_broken"))
    # VF 2 goes on submitting after VF 1 broke
    assert b.submit(cb, fill(0, 64, 6), fence=2).status == 0
    # device status 0 (reset) brings VF 1 back
    monkeypatch.undo()
    a.init()
    assert not a.c8(20) & 0x40
    ca = a.create_context()
    assert a.submit(ca, fill(0, 64, 1)).status == 0


def test_an_exception_in_notify_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig()
    ctx = rig.create_context()

    def drain(qi: int) -> None:
        raise RuntimeError("ring walker bug")

    monkeypatch.setattr(rig.dev, "_drain_submitq", drain)
    rig.submit_nowait(ctx, nop())
    rig.kick(2)                                           # the guest's MMIO write returns
    rig.clock.run()
    assert rig.r(0x70) & 0x40                             # that function needs a reset
    assert [e["where"] for e in rig.tracer.kinds("device_error")] == ["function"]
    monkeypatch.undo()
    rig.init()                                            # and a reset brings it back
    ctx = rig.create_context()
    assert rig.submit(ctx, fill(0, 64, 2)).status == 0
