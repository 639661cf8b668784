"""virtio-mmio v2 register window (spec §3): identity, features, status machine, queue
registers, interrupts, config space, and every driver-violation rule."""
from __future__ import annotations

import struct

import pytest
from dm_driver import ACK, DRV, DRV_OK, FEAT_OK, Rig, nop
from dm_fakes import FakeClock, FakeDma, FakeIrq, RecordingTracer

from device_model import DevicePorts, MmioTransport, Va1Config, Va1Device
from hwspec import va1


def fresh(config: Va1Config | None = None) -> tuple[MmioTransport, FakeIrq, RecordingTracer]:
    tr = RecordingTracer()
    irq = FakeIrq()
    dev = Va1Device(config or Va1Config(), DevicePorts(FakeDma(), FakeClock(), tr))
    return MmioTransport(dev, irq=irq, tracer=tr), irq, tr


def rules(m: MmioTransport) -> list[str]:
    return [v.rule for v in m.violations]


def test_identity_registers() -> None:
    m, _, _ = fresh()
    assert m.read(0x000, 4) == 0x74726976
    assert m.read(0x004, 4) == 2
    assert m.read(0x008, 4) == 60
    assert m.read(0x00C, 4) == 0x312D4156
    assert m.read(0x0FC, 4) == 0
    # write-only and unlisted registers read 0; writes to read-only registers ignored
    for off in (0x014, 0x020, 0x038, 0x050, 0x064, 0x080, 0x0A4, 0x0F0):
        assert m.read(off, 4) == 0
    m.write(0x000, 4, 5)
    assert m.read(0x000, 4) == 0x74726976
    assert m.violations == []


def test_offered_features() -> None:
    m, _, _ = fresh()
    got = []
    for sel in range(3):
        m.write(0x014, 4, sel)
        got.append(m.read(0x010, 4))
    # FP16 (0), INT8 (1), TIMESTAMP (2), INDIRECT (28), EVENT_IDX (29); VERSION_1 (32),
    # ACCESS_PLATFORM (33)
    assert got == [(1 << 0) | (1 << 1) | (1 << 2) | (1 << 28) | (1 << 29), 0b11, 0]


def test_config_space_reads() -> None:
    cfg = Va1Config(num_submit_queues=3, device_memory_size=1 << 20)
    m, _, _ = fresh(cfg)
    assert m.read(0x100, 4) == 3
    assert m.read(0x104, 4) == 4
    assert m.read(0x108, 8) == 1 << 20
    assert m.read(0x108, 4) == 1 << 20 and m.read(0x10C, 4) == 0
    assert m.read(0x120, 8) == 50 * 10**12
    assert m.read(0x138, 4) == 500
    assert m.read(0x13C, 2) == 64 and m.read(0x13C, 1) == 64
    assert m.read(0x11C, 4) == 0b1111  # dtype mask F32|F16|I8|I32
    assert m.read(0x118, 4) == 0x00010000
    image = b"".join(m.read(0x100 + i, 1).to_bytes(1, "little") for i in range(72))
    assert image == cfg.pack() and len(image) == va1.CONFIG.size
    assert m.read(0x100 + 72, 4) == 0  # past the end
    assert m.violations == []


def test_queue_num_max_and_select() -> None:
    m, _, _ = fresh(Va1Config(num_submit_queues=2, queue_size_max=128))
    for i in range(4):
        m.write(0x030, 4, i)
        assert m.read(0x034, 4) == 128
    m.write(0x030, 4, 4)
    assert m.read(0x034, 4) == 0


def test_full_handshake_and_interrupt_ack() -> None:
    rig = Rig()
    assert rig.mmio.violations == []
    cid = rig.create_context()
    assert rig.irq.level and rig.r(0x60) == 1
    rig.w(0x64, 1)
    assert not rig.irq.level and rig.r(0x60) == 0
    assert rig.irq.history[-2:] == [True, False]
    r = rig.submit(cid, nop())
    assert r.status == 0 and rig.irq.level
    assert [e["bits"] for e in rig.tracer.kinds("irq")][-1] == 1


@pytest.mark.parametrize("size", [1, 2, 3])
def test_register_access_size(size: int) -> None:
    m, _, tr = fresh()
    assert m.read(0x000, size) == 0
    m.write(0x070, size, 1)
    assert m.read(0x070, 4) == 0
    assert rules(m) == ["mmio/access-size", "mmio/access-size"]
    assert [e["rule"] for e in tr.kinds("violation")] == rules(m)


def test_config_write_is_violation() -> None:
    m, _, _ = fresh()
    m.write(0x100, 4, 7)
    assert m.read(0x100, 4) == 2
    assert rules(m) == ["config/write"]


def test_status_order_and_clear_bit() -> None:
    m, _, _ = fresh()
    m.write(0x070, 4, ACK | FEAT_OK)  # FEATURES_OK before DRIVER
    assert m.read(0x070, 4) == 0
    m.write(0x070, 4, ACK)
    m.write(0x070, 4, ACK | DRV)
    m.write(0x070, 4, ACK | DRV | DRV_OK)  # DRIVER_OK without FEATURES_OK
    assert m.read(0x070, 4) == ACK | DRV
    m.write(0x070, 4, ACK)  # clears DRIVER
    assert m.read(0x070, 4) == ACK | DRV
    m.write(0x070, 4, ACK | DRV | 0x80)  # FAILED may be added any time
    assert m.read(0x070, 4) == ACK | DRV | 0x80
    assert rules(m) == ["status/order", "status/order", "status/clear-bit"]


def test_driver_without_acknowledge() -> None:
    m, _, _ = fresh()
    m.write(0x070, 4, DRV)
    assert m.read(0x070, 4) == 0 and rules(m) == ["status/order"]


def _to_driver(m: MmioTransport) -> None:
    m.write(0x070, 4, ACK)
    m.write(0x070, 4, ACK | DRV)


@pytest.mark.parametrize("sel,value", [(0, 1 << 5), (0, 1 << 3), (1, 1 << 2), (2, 1), (0, 0)])
def test_features_not_offered(sel: int, value: int) -> None:
    m, _, _ = fresh()
    _to_driver(m)
    m.write(0x024, 4, 1)
    m.write(0x020, 4, 1)  # VERSION_1
    m.write(0x024, 4, sel)
    m.write(0x020, 4, value if sel != 1 else value | 1)
    m.write(0x070, 4, ACK | DRV | FEAT_OK)
    if value:
        assert m.read(0x070, 4) & FEAT_OK == 0
        assert rules(m) == ["features/not-offered"]
    else:
        assert m.read(0x070, 4) & FEAT_OK and rules(m) == []


def test_features_without_version_1() -> None:
    m, _, _ = fresh()
    _to_driver(m)
    m.write(0x024, 4, 0)
    m.write(0x020, 4, 1 << 28)
    m.write(0x070, 4, ACK | DRV | FEAT_OK)
    assert m.read(0x070, 4) == ACK | DRV
    assert rules(m) == ["features/not-offered"]


def test_features_after_features_ok() -> None:
    m, _, _ = fresh()
    _to_driver(m)
    m.write(0x024, 4, 1)
    m.write(0x020, 4, 1)
    m.write(0x070, 4, ACK | DRV | FEAT_OK)
    assert m.read(0x070, 4) & FEAT_OK
    m.write(0x020, 4, 3)
    assert rules(m) == ["features/after-features-ok"]
    assert m.acked_features == 1 << 32


def test_queue_registers_rules() -> None:
    rig = Rig(qsize=8)
    m = rig.mmio
    m.violations.clear()
    rig.w(0x030, 0)
    for off, v in ((0x038, 4), (0x044, 0), (0x080, 0x1000), (0x094, 1), (0x0A0, 0)):
        rig.w(off, v)
    assert rules(m) == ["queue/after-driver-ok"] * 5
    assert rig.r(0x044) == 1
    # queues still work
    cid = rig.create_context()
    assert rig.submit(cid, nop()).status == 0


def test_queue_bad_select_size_alignment() -> None:
    m, _, _ = fresh()
    _to_driver(m)
    m.write(0x030, 4, 9)
    m.write(0x038, 4, 8)
    m.write(0x044, 4, 1)
    assert rules(m) == ["queue/bad-select"] * 2
    m.violations.clear()
    m.write(0x030, 4, 0)
    for bad in (0, 3, 512, 257):
        m.write(0x038, 4, bad)
    assert rules(m) == ["queue/size"] * 4
    assert m.queues[0].size == 256
    m.write(0x038, 4, 64)
    assert m.queues[0].size == 64
    m.violations.clear()
    for lo, hi, addr in ((0x080, 0x084, 0x1008), (0x090, 0x094, 0x2000), (0x0A0, 0x0A4, 0x3000)):
        m.write(lo, 4, addr)
        m.write(hi, 4, 0)
    m.write(0x044, 4, 1)
    assert rules(m) == ["queue/alignment"] and m.read(0x044, 4) == 0
    m.write(0x080, 4, 0x1010)
    m.write(0x090, 4, 0x2001)
    m.write(0x044, 4, 1)
    m.write(0x090, 4, 0x2002)
    m.write(0x0A0, 4, 0x3002)
    m.write(0x044, 4, 1)
    m.write(0x0A0, 4, 0x3004)
    m.write(0x044, 4, 1)
    assert rules(m) == ["queue/alignment"] * 3 and m.read(0x044, 4) == 1
    # 64-bit addresses assemble from Low/High
    m.write(0x084, 4, 0x1)
    assert m.queues[0].desc_table == 0x1_0000_1010


def test_notify_not_ready() -> None:
    rig = Rig(qsize=8)
    rig.w(0x050, 7)
    rig.w(0x050, 99)
    assert rules(rig.mmio) == ["queue/not-ready"] * 2
    m, _, _ = fresh()
    m.write(0x050, 4, 0)
    assert rules(m) == ["queue/not-ready"]


def test_reset_clears_everything() -> None:
    rig = Rig(qsize=8)
    rig.create_context()
    assert rig.irq.level
    rig.w(0x070, 0)
    assert rig.r(0x070) == 0 and rig.r(0x060) == 0 and not rig.irq.level
    rig.w(0x030, 0)
    assert rig.r(0x044) == 0
    assert rig.mmio.acked_features == 0


def test_mmio_never_raises_on_odd_accesses() -> None:
    m, _, _ = fresh()
    for off in (-4, 0x1000, 0x2000, 0xFFF, 0x101):
        for size in (0, 1, 2, 3, 4, 5, 8, 16):
            assert isinstance(m.read(off, size), int)
            m.write(off, size, 2**70)
    assert m.read(0x070, 4) == 0


def test_irq_trace_deterministic_ints() -> None:
    rig = Rig(qsize=8)
    rig.create_context()
    ev = rig.tracer.kinds("irq")
    assert ev and all(isinstance(e["bits"], int) for e in ev)
    assert struct.pack("<I", rig.r(0x60)) == b"\x01\0\0\0"


def test_config_generation_register_follows_a_reconfigure() -> None:
    """ConfigGeneration (0x0FC) changes with the device configuration (a reconfigure
    that changes it), and not otherwise."""
    from dataclasses import replace

    from device_model.va1.memory import DeviceMemory
    m, _, _ = fresh()
    dev = m.device
    assert isinstance(dev, Va1Device)
    assert m.read(0x0FC, 4) == 0
    dev.reconfigure(dev.config, DeviceMemory(dev.config.device_memory_size))
    assert m.read(0x0FC, 4) == 0                    # same configuration
    new = replace(dev.config, device_memory_size=2 << 20, max_contexts=3)
    dev.reconfigure(new, DeviceMemory(2 << 20))
    assert m.read(0x0FC, 4) == 1
    assert m.read(0x108, 8) == 2 << 20 and m.read(0x13C, 4) == 3
    m.write(0x070, 4, 0)                            # a reset keeps the generation
    assert m.read(0x0FC, 4) == 1 and m.violations == []
