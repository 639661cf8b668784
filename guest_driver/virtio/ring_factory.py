"""Which driver-side ring a virtqueue gets, keyed on the negotiated feature bits.

Drivers ask for the ring features they can use (`RING_FEATURES`), then for a ring per
queue; they never see the layout. The split ring (virtio 1.x §2.7) or, with
VIRTIO_F_RING_PACKED, the packed ring (§2.8); both take INDIRECT_DESC, EVENT_IDX,
IN_ORDER and NOTIFICATION_DATA (the ring says what a notification carries). Written
independently of the device side's factory.
"""
from __future__ import annotations

from typing import TypeVar

from hwspec import virtio as V

from ..kernel import PhysMemory
from ..mm import RangeAllocator
from .packed_ring import PackedQueue
from .ring import DriverRing
from .split_ring import SplitQueue

T = TypeVar("T")

RING_FEATURES = ((1 << V.F_RING_INDIRECT_DESC) | (1 << V.F_RING_EVENT_IDX)
                 | (1 << V.F_RING_PACKED) | (1 << V.F_IN_ORDER)
                 | (1 << V.F_NOTIFICATION_DATA))
"""Ring feature bits the driver side implements (a driver may accept these)."""


def ring_features(features: int) -> int:
    """The bits of `features` that decide which ring is built and how: two rings built
    for the same value are interchangeable."""
    return features & RING_FEATURES


def make_driver_ring(features: int, memory: PhysMemory, alloc: RangeAllocator, index: int,
                     num: int, *, max_indirect: int = 8) -> DriverRing[T]:
    """The driver side of queue `index` with `num` entries for the negotiated
    `features`, its memory from `alloc`. `max_indirect`: segments one indirect table
    holds (when INDIRECT_DESC was negotiated). Raises ValueError for a bad size."""
    indirect = bool(features >> V.F_RING_INDIRECT_DESC & 1)
    event_idx = bool(features >> V.F_RING_EVENT_IDX & 1)
    in_order = bool(features >> V.F_IN_ORDER & 1)
    data = bool(features >> V.F_NOTIFICATION_DATA & 1)
    if features >> V.F_RING_PACKED & 1:
        return PackedQueue(memory, alloc, index, num, indirect=indirect, event_idx=event_idx,
                           in_order=in_order, notification_data=data,
                           max_indirect=max_indirect)
    return SplitQueue(memory, alloc, index, num, indirect=indirect, event_idx=event_idx,
                      in_order=in_order, notification_data=data, max_indirect=max_indirect)
