"""The device-side ring factory: the negotiated features pick the ring (the split ring
with its INDIRECT/EVENT_IDX options today), an unimplemented layout is refused by
name, and nothing outside device_model/virtio knows a ring layout."""
from __future__ import annotations

import pathlib
import re

import pytest

import device_model
from device_model.va1.device import OFFERED_FEATURES
from device_model.virtio.queue import Queue
from device_model.virtio.ring_factory import (RING_FEATURES, UnsupportedRingError,
                                              make_device_ring, ring_alignment_ok)
from device_model.virtio.split_ring import SplitRing
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


@pytest.mark.parametrize("bit,name", [(V.F_RING_PACKED, "VIRTIO_F_RING_PACKED"),
                                      (V.F_IN_ORDER, "VIRTIO_F_IN_ORDER")])
def test_unimplemented_ring_features_are_refused_by_name(bit: int, name: str) -> None:
    with pytest.raises(UnsupportedRingError, match=rf"{name} \(feature bit {bit}\)"):
        make_device_ring(BASE | 1 << bit, _queue())
    with pytest.raises(UnsupportedRingError, match=name):
        ring_alignment_ok(BASE | 1 << bit, _queue())


def test_alignment_follows_the_split_layout() -> None:
    q = _queue()
    assert ring_alignment_ok(BASE, q)
    for attr, bad in (("desc_table", 0x10008), ("avail_ring", 0x20001), ("used_ring", 0x30002)):
        q2 = _queue()
        setattr(q2, attr, bad)
        assert not ring_alignment_ok(BASE, q2), attr


def test_va1_offers_exactly_the_ring_features_the_factory_builds() -> None:
    ring_bits = sum(1 << b for b in (V.F_RING_INDIRECT_DESC, V.F_RING_EVENT_IDX,
                                      V.F_RING_PACKED, V.F_IN_ORDER))
    assert OFFERED_FEATURES & ring_bits == RING_FEATURES


_LAYOUT = re.compile(r"\bV\.(DESC|AVAIL_|USED_|desc_table_size|avail_ring_size|"
                     r"used_ring_size|QUEUE_SIZE_MAX)|\bSplitRing\b|split_ring")


def test_only_virtio_knows_the_ring_layout() -> None:
    root = pathlib.Path(device_model.__file__).parent
    offenders = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
                 if p.parent.name != "virtio" and _LAYOUT.search(p.read_text())]
    assert offenders == []
