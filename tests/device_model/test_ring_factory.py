"""The device-side ring factory: the negotiated features pick the ring (split, or packed
with VIRTIO_F_RING_PACKED; both with their INDIRECT/EVENT_IDX/IN_ORDER options), sizes
and alignment follow the layout, and nothing outside device_model/virtio knows a ring
layout."""
from __future__ import annotations

import pathlib
import re

import pytest

import device_model
from device_model.va1.config import DEFAULT_VIRTIO_FEATURES, VIRTIO_OPTIONS
from device_model.va1.device import ALL_FEATURES, OFFERED_FEATURES
from device_model.virtio.queue import Queue
from device_model.virtio.packed_ring import PackedRing
from device_model.virtio.ring_factory import (RING_FEATURES, make_device_ring,
                                              ring_alignment_ok, ring_size_ok)
from device_model.virtio.split_ring import SplitRing
from device_model.virtio.status import TRANSPORT_FEATURES
from hwspec import virtio as V

INDIRECT = 1 << V.F_RING_INDIRECT_DESC
EVENT_IDX = 1 << V.F_RING_EVENT_IDX
BASE = 1 << V.F_VERSION_1 | 1 << V.F_ACCESS_PLATFORM


def _queue(size: int = 64) -> Queue:
    q = Queue(256)
    q.size, q.ready = size, True
    q.desc_table, q.avail_ring, q.used_ring = 0x10000, 0x20000, 0x30000
    return q


@pytest.mark.parametrize("options", [0, INDIRECT, EVENT_IDX, INDIRECT | EVENT_IDX])
def test_split_features_give_a_split_ring_with_their_options(options: int) -> None:
    ring = make_device_ring(BASE | options, _queue())
    assert isinstance(ring, SplitRing)
    assert ring.indirect == bool(options & INDIRECT)
    assert ring.event_idx == bool(options & EVENT_IDX)
    assert (ring.size, ring.ready, ring.desc_table, ring.avail_ring, ring.used_ring) == (
        64, True, 0x10000, 0x20000, 0x30000)
    assert (ring.last_avail_idx, ring.next_used_idx) == (0, 0)


def test_ring_is_frozen_from_the_registers_at_build_time() -> None:
    q = _queue()
    ring = make_device_ring(BASE, q)
    q.reset()
    assert isinstance(ring, SplitRing) and ring.ready and ring.size == 64


IN_ORDER = 1 << V.F_IN_ORDER
PACKED = 1 << V.F_RING_PACKED


@pytest.mark.parametrize("options", [0, INDIRECT | EVENT_IDX, IN_ORDER,
                                     INDIRECT | EVENT_IDX | IN_ORDER])
def test_packed_feature_gives_a_packed_ring_with_its_options(options: int) -> None:
    ring = make_device_ring(BASE | PACKED | options, _queue())
    assert isinstance(ring, PackedRing)
    assert (ring.indirect, ring.event_idx, ring.in_order) == (
        bool(options & INDIRECT), bool(options & EVENT_IDX), bool(options & IN_ORDER))
    assert (ring.size, ring.desc_ring, ring.driver_event, ring.device_event) == (
        64, 0x10000, 0x20000, 0x30000)
    assert (ring.next_avail, ring.avail_wrap, ring.next_used, ring.used_wrap) == (0, 1, 0, 1)


def test_in_order_split_ring() -> None:
    ring = make_device_ring(BASE | IN_ORDER, _queue())
    assert isinstance(ring, SplitRing) and ring.in_order


def test_sizes_follow_the_layout() -> None:
    assert ring_size_ok(BASE, 64) and not ring_size_ok(BASE, 100)
    assert ring_size_ok(BASE | PACKED, 100) and ring_size_ok(BASE | PACKED, 1 << 15)
    assert not ring_size_ok(BASE | PACKED, 0) and not ring_size_ok(BASE | PACKED, (1 << 15) + 1)


def test_packed_alignment_is_16_4_4() -> None:
    q = _queue()
    q.avail_ring, q.used_ring = 0x20004, 0x30004
    assert ring_alignment_ok(BASE | PACKED, q)
    for attr, bad in (("desc_table", 0x10008), ("avail_ring", 0x20002), ("used_ring", 0x30002)):
        q2 = _queue()
        setattr(q2, attr, bad)
        assert not ring_alignment_ok(BASE | PACKED, q2), attr


def test_alignment_follows_the_split_layout() -> None:
    q = _queue()
    assert ring_alignment_ok(BASE, q)
    for attr, bad in (("desc_table", 0x10008), ("avail_ring", 0x20001), ("used_ring", 0x30002)):
        q2 = _queue()
        setattr(q2, attr, bad)
        assert not ring_alignment_ok(BASE, q2), attr


def test_va1_can_offer_exactly_the_ring_and_transport_features_implemented() -> None:
    bits = sum(1 << b for b in (V.F_RING_INDIRECT_DESC, V.F_RING_EVENT_IDX, V.F_RING_PACKED,
                                V.F_IN_ORDER, V.F_NOTIFICATION_DATA, V.F_RING_RESET,
                                V.F_NOTIF_CONFIG_DATA, V.F_ORDER_PLATFORM))
    assert ALL_FEATURES & bits == VIRTIO_OPTIONS == RING_FEATURES | TRANSPORT_FEATURES
    # by default (Va1Config.virtio_features) only the split ring's options, as always
    assert OFFERED_FEATURES & bits == DEFAULT_VIRTIO_FEATURES == INDIRECT | EVENT_IDX


_LAYOUT = re.compile(r"\bV\.(DESC|AVAIL_|USED_|PACKED_|desc_table_size|avail_ring_size|"
                     r"used_ring_size|packed_ring_size|QUEUE_SIZE_MAX)|\bSplitRing\b|"
                     r"split_ring|\bPackedRing\b|packed_ring")


def test_only_virtio_knows_the_ring_layout() -> None:
    root = pathlib.Path(device_model.__file__).parent
    offenders = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
                 if p.parent.name != "virtio" and _LAYOUT.search(p.read_text())]
    assert offenders == []
