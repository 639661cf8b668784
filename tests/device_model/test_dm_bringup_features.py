"""Register-level rules of issue 13's features on the device side: queue reset before
DRIVER_OK and without the feature, NOTIFICATION_DATA's width on virtio-pci, the split
ring's IN_ORDER descriptor rule, and the function's offer (Va1Config.virtio_features)."""
from __future__ import annotations

import struct

import pytest
from dm_fakes import FakeClock, FakeDma, FakeIrq, RecordingTracer

from device_model import DevicePorts, MmioTransport, Va1Config, Va1Device
from device_model.va1.config import VIRTIO_OPTIONS, ConfigError
from device_model.virtio.queue import Queue
from device_model.virtio.ring import RingError
from device_model.virtio.split_ring import SplitRing
from hwspec import virtio as V
from hwspec import virtio_mmio as R

ACK, DRV, FOK = 1, 2, 8


def _mmio(features: int) -> MmioTransport:
    dev = Va1Device(Va1Config(virtio_features=VIRTIO_OPTIONS),
                    DevicePorts(FakeDma(), FakeClock(), RecordingTracer()))
    m = MmioTransport(dev, irq=FakeIrq())
    m.write(R.STATUS, 4, ACK)
    m.write(R.STATUS, 4, ACK | DRV)
    for sel in (0, 1):
        m.write(R.DRIVER_FEATURES_SEL, 4, sel)
        m.write(R.DRIVER_FEATURES, 4, features >> (32 * sel) & 0xFFFF_FFFF)
    m.write(R.STATUS, 4, ACK | DRV | FOK)
    assert m.read(R.STATUS, 4) & FOK
    return m


BASE = 1 << V.F_VERSION_1 | 1 << V.F_ACCESS_PLATFORM


def test_queue_reset_without_the_feature_is_logged_and_does_nothing() -> None:
    m = _mmio(BASE)
    m.write(R.QUEUE_SEL, 4, 0)
    m.write(R.QUEUE_NUM, 4, 8)
    m.write(R.QUEUE_READY, 4, 1)
    m.write(R.QUEUE_RESET, 4, 1)
    assert [v.rule for v in m.violations] == ["queue/reset-not-negotiated"]
    assert m.read(R.QUEUE_READY, 4) == 1


def test_queue_reset_before_driver_ok() -> None:
    m = _mmio(BASE | 1 << V.F_RING_RESET)
    m.write(R.QUEUE_SEL, 4, 0)
    m.write(R.QUEUE_RESET, 4, 1)                 # not enabled yet
    m.write(R.QUEUE_NUM, 4, 8)
    m.write(R.QUEUE_READY, 4, 1)
    m.write(R.QUEUE_RESET, 4, 2)                 # only 1 may be written
    assert m.read(R.QUEUE_READY, 4) == 1
    m.write(R.QUEUE_RESET, 4, 1)                 # enabled: registers back to reset values
    assert (m.read(R.QUEUE_READY, 4), m.read(R.QUEUE_RESET, 4)) == (0, 0)
    assert m.queues[0].size == m.queues[0].max_size
    assert [v.rule for v in m.violations] == ["queue/reset-not-enabled", "queue/reset-value"]
    assert not m.read(R.STATUS, 4) & V.STATUS_DEVICE_NEEDS_RESET


def test_packed_queue_sizes_need_not_be_powers_of_two() -> None:
    m = _mmio(BASE | 1 << V.F_RING_PACKED)
    m.write(R.QUEUE_SEL, 4, 0)
    m.write(R.QUEUE_NUM, 4, 12)
    assert m.queues[0].size == 12 and m.violations == []
    split = _mmio(BASE)
    split.write(R.QUEUE_SEL, 4, 0)
    split.write(R.QUEUE_NUM, 4, 12)
    assert [v.rule for v in split.violations] == ["queue/size"]


def test_the_offer_follows_the_config() -> None:
    dev = Va1Device(Va1Config(), DevicePorts(FakeDma(), FakeClock(), RecordingTracer()))
    assert not dev.avail_features() >> V.F_RING_PACKED & 1
    dev2 = Va1Device(Va1Config(virtio_features=VIRTIO_OPTIONS),
                     DevicePorts(FakeDma(), FakeClock(), RecordingTracer()))
    for bit in (V.F_RING_PACKED, V.F_IN_ORDER, V.F_NOTIFICATION_DATA, V.F_RING_RESET):
        assert dev2.avail_features() >> bit & 1
    with pytest.raises(ConfigError, match="virtio_features"):
        Va1Config(virtio_features=1 << V.F_SR_IOV)


def test_split_in_order_chains_start_where_the_last_ended() -> None:
    dma = FakeDma()
    base = dma.base
    q = Queue(16)
    q.size, q.ready = 4, True
    q.desc_table, q.avail_ring, q.used_ring = base, base + 0x100, base + 0x200
    ring = SplitRing(q, indirect=False, event_idx=False, in_order=True)

    def desc(i: int, flags: int, nxt: int) -> None:
        dma.write(base + 16 * i, struct.pack("<QIHH", base + 0x1000, 8, flags, nxt))

    def publish(slot: int, head: int) -> None:
        dma.write(base + 0x100 + 4 + 2 * slot, struct.pack("<H", head))
        dma.write(base + 0x100 + 2, struct.pack("<H", slot + 1))

    desc(0, V.DESC_F_NEXT, 1)
    desc(1, V.DESC_F_WRITE, 0)
    publish(0, 0)
    assert ring.pop(dma) is not None
    desc(3, V.DESC_F_WRITE, 0)                   # skips descriptor 2
    publish(1, 3)
    with pytest.raises(RingError) as exc:
        ring.pop(dma)
    assert exc.value.rule == "ring/in-order-desc"


def test_pci_notification_data_is_32_bits_and_checked() -> None:
    from dm_pci_driver import PciRig
    from device_model.va1.device import BASE_FEATURES
    rig = PciRig(Va1Config(virtio_features=VIRTIO_OPTIONS),
                 features=BASE_FEATURES | 1 << V.F_NOTIFICATION_DATA, event_idx=False)
    addr = rig.notify_addr(2)
    rig.bw(addr, 2, 2)                                   # 16 bits: no data
    assert [v.rule for v in rig.fn.violations[rig.vio_before:]] == ["notify/data-width"]
    rig.bw(addr, 4, 2 | 0 << 16)                         # avail idx 0: nothing claimed
    assert not rig.c8(20) & V.STATUS_DEVICE_NEEDS_RESET
    rig.bw(addr, 4, 2 | 5 << 16)                         # claims 5 the ring does not hold
    assert rig.c8(20) & V.STATUS_DEVICE_NEEDS_RESET
    assert rig.fn.violations[-1].rule == "notify/data"


@pytest.mark.parametrize("negotiated", [True, False])
def test_mmio_queue_notify_carries_data_only_with_the_feature(negotiated: bool) -> None:
    """QueueNotify with NOTIFICATION_DATA: the queue index in bits 0-15, the claim checked
    above them; without the feature the whole value is the queue index."""
    from dm_driver import Rig
    rig = Rig(Va1Config(virtio_features=VIRTIO_OPTIONS))
    split = rig.offered() & ~(1 << V.F_RING_PACKED)      # the rig's queues are split rings
    rig = Rig(Va1Config(virtio_features=VIRTIO_OPTIONS),
              features=split if negotiated else split & ~(1 << V.F_NOTIFICATION_DATA))
    rig.w(R.QUEUE_NOTIFY, 2 | 0 << 16)              # queue 2, avail index 0: nothing claimed
    assert not rig.r(R.STATUS) & V.STATUS_DEVICE_NEEDS_RESET
    assert rig.mmio.violations[rig.vio_before:] == []
    rig.w(R.QUEUE_NOTIFY, 2 | 5 << 16)              # claims 5 the ring does not hold
    if negotiated:
        assert rig.r(R.STATUS) & V.STATUS_DEVICE_NEEDS_RESET
        assert rig.mmio.violations[-1].rule == "notify/data"
    else:                                            # queue 327682: no such queue
        assert not rig.r(R.STATUS) & V.STATUS_DEVICE_NEEDS_RESET
        assert [v.rule for v in rig.mmio.violations[rig.vio_before:]] == ["queue/not-ready"]
    rig.w(R.STATUS, 0)                               # reset: no feature is in force
    rig.w(R.QUEUE_NOTIFY, 2 | 5 << 16)
    assert rig.mmio.violations[-1].rule == "queue/not-ready"
    assert "327682" in rig.mmio.violations[-1].message
